//! Runs the `endpoint_ops` fuzz body on stable over seeded random inputs, so CI exercises it
//! without cargo-fuzz.

#[test]
fn random_operation_sequences_keep_every_invariant() {
    let mut total = bounce_fuzz::Coverage::default();
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    for len in (0..3000).map(|i| 64 + (i * 37) % 4096) {
        let bytes: Vec<u8> = (0..len)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state >> 24) as u8
            })
            .collect();
        let c = bounce_fuzz::run(&bytes);
        total.ops += c.ops;
        total.submitted += c.submitted;
        total.completed += c.completed;
        total.jobs_done += c.jobs_done;
    }
    eprintln!("{total:?}");
    // Not vacuous: the random sequences really drive transfers through jobs to completion.
    assert!(total.ops > 100_000, "{total:?}");
    assert!(total.submitted > 1_000 && total.completed > 1_000 && total.jobs_done > 1_000, "{total:?}");
}
