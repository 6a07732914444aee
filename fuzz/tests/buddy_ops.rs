//! Runs the `buddy_ops` fuzz body on stable over seeded random inputs, so CI exercises it
//! without cargo-fuzz.

#[test]
fn random_allocation_sequences_keep_every_invariant() {
    let mut total = bounce_fuzz::buddy_ops::BuddyCoverage::default();
    for bytes in bounce_fuzz::seeded_inputs(0x2545_F491_4F6C_DD1D, 2000, |i| 16 + (i * 53) % 2048) {
        let c = bounce_fuzz::buddy_ops::run_buddy(&bytes);
        total.granted += c.granted;
        total.refused_with_free_bytes += c.refused_with_free_bytes;
        total.freed += c.freed;
        total.hot_reused += c.hot_reused;
        total.bogus += c.bogus;
    }
    eprintln!("{total:?}");
    // Not vacuous: grants, frees (hot ones reused at once among them), rejected frees, and
    // refusals despite free bytes (the case where a placement policy could wrongly give up)
    // all happen many times.
    assert!(total.granted > 50_000 && total.freed > 20_000 && total.hot_reused > 2_000, "{total:?}");
    assert!(total.bogus > 10_000 && total.refused_with_free_bytes > 1_000, "{total:?}");
}
