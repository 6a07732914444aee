//! Registration public data (what a peer's `getPublicData` handed us, through NIXL metadata)
//! from arbitrary bytes: decoding never panics, and whatever decodes re-encodes to the same bytes.
#![no_main]

use bounce_proto::wire::fuzzing;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| fuzzing::public_decode(data));
