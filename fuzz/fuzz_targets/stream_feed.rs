//! The ZMQ channel's stream framing fed arbitrary events (connections opening and ending,
//! bytes in any cuts): never a panic, and what it holds stays within its bounds.
#![no_main]

use bounce_proto::wire::fuzzing;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| fuzzing::stream_feed(data));
