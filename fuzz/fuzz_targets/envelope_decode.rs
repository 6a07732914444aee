//! Connection-info envelopes (what a peer's `getConnInfo` handed us) from arbitrary bytes:
//! decoding never panics, and whatever decodes re-encodes to the same bytes.
#![no_main]

use bounce_proto::wire::fuzzing;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| fuzzing::envelope_decode(data));
