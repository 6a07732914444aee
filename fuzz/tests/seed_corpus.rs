//! Keeps the seed corpus under `fuzz/corpus/<target>/` equal to what the current encoders produce
//! (`bounce_proto::wire::fuzzing::seed_*`, `bounce_proto::mailbox::fuzzing::seed_rings`), so a layout change cannot leave stale seeds behind.
//!
//! `cargo test --manifest-path fuzz/Cargo.toml` checks; with `BLESS=1` it rewrites the seeds.

use std::{fs, path::PathBuf};

use bounce_proto::wire::fuzzing;

fn check_or_bless(target: &str, seeds: Vec<Vec<u8>>) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("corpus").join(target);
    let bless = std::env::var_os("BLESS").is_some();
    if bless {
        fs::create_dir_all(&dir).unwrap();
    }
    for (i, seed) in seeds.iter().enumerate() {
        let path = dir.join(format!("seed-{i}"));
        if bless {
            fs::write(&path, seed).unwrap();
        } else {
            let on_disk = fs::read(&path).unwrap_or_else(|e| panic!("{}: {e} (run with BLESS=1)", path.display()));
            assert_eq!(&on_disk, seed, "{} is stale (run with BLESS=1)", path.display());
        }
    }
}

#[test]
fn seed_corpus_matches_the_encoders() {
    check_or_bless("wire_decode", fuzzing::seed_frames());
    check_or_bless("caps_decode", fuzzing::seed_caps());
    check_or_bless("envelope_decode", fuzzing::seed_envelopes());
    check_or_bless("public_decode", fuzzing::seed_public());
    check_or_bless("mailbox_decode", bounce_proto::mailbox::fuzzing::seed_rings());
    check_or_bless("region_plan_check", fuzzing::seed_region_plans());
    check_or_bless("stream_feed", fuzzing::seed_stream());
}

#[test]
fn seeds_pass_their_targets() {
    fuzzing::seed_frames().iter().for_each(|s| fuzzing::frame_decode(s));
    fuzzing::seed_caps().iter().for_each(|s| fuzzing::caps_decode(s));
    fuzzing::seed_envelopes().iter().for_each(|s| fuzzing::envelope_decode(s));
    fuzzing::seed_public().iter().for_each(|s| fuzzing::public_decode(s));
    fuzzing::seed_region_plans().iter().for_each(|s| fuzzing::region_plan_check(s));
    fuzzing::seed_stream().iter().for_each(|s| fuzzing::stream_feed(s));
}

/// `stream_feed` over seeded random inputs (what the fuzzer does, briefly, on stable).
#[test]
fn random_byte_streams_keep_the_framing_bounds() {
    for input in bounce_fuzz::seeded_inputs(0x5eed_57ea, 3000, |i| 16 + (i * 37) % 9000) {
        fuzzing::stream_feed(&input);
    }
}
