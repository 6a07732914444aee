//! Region plans (a chunk's scatter runs written by the peer into our arena behind its data)
//! from arbitrary bytes: checking never panics, and what it accepts reads inside the chunk,
//! writes inside the allowed ranges, copies at most the chunk's bytes, and is canonical.
#![no_main]

use bounce_proto::wire::fuzzing;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| fuzzing::region_plan_check(data));
