//! Runs the `mailbox_decode` fuzz body on stable over its seed corpus and over seeded random
//! mutations of it (`tests/seed_corpus.rs` keeps `fuzz/corpus/mailbox_decode/` equal to what
//! the encoder produces).

use bounce_proto::mailbox::fuzzing;

#[test]
fn seeds_are_read_in_full() {
    let accepted: Vec<usize> = fuzzing::seed_rings().iter().map(|s| fuzzing::mailbox_decode(s)).collect();
    assert_eq!(accepted, [0, 3, 2]);
}

#[test]
fn mutated_rings_keep_every_property() {
    let seeds = fuzzing::seed_rings();
    let (mut accepted, mut spoiled) = (0, 0);
    for (i, noise) in bounce_fuzz::seeded_inputs(0x9E37_79B9_7F4A_7C15, 3000, |i| 2 + i % 6).enumerate() {
        // a seed ring with a few bytes overwritten (pairs of position, value), or cut short
        let mut ring = seeds[i % seeds.len()].clone();
        for pair in noise.chunks(2) {
            let at = (usize::from(pair[0]) * 7 + i) % ring.len();
            ring[at] = *pair.get(1).unwrap_or(&0);
        }
        if i % 10 == 0 {
            ring.truncate(i % ring.len());
        }
        let n = fuzzing::mailbox_decode(&ring);
        accepted += n;
        spoiled += usize::from(n < [0, 3, 2][i % seeds.len()]);
    }
    // Not vacuous: many records survive the noise and are accepted, and many rings lose some.
    eprintln!("accepted {accepted}, spoiled {spoiled}");
    assert!(accepted > 1000 && spoiled > 500, "accepted {accepted}, spoiled {spoiled}");
    for bytes in bounce_fuzz::seeded_inputs(7, 500, |i| i % 600) {
        fuzzing::mailbox_decode(&bytes);
    }
}
