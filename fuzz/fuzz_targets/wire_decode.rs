//! Control frames from arbitrary bytes: decoding never panics, and whatever decodes re-encodes to
//! the same bytes (the codec is canonical). The same input, read as a structured `Frame`, also
//! checks the other direction: encode, then decode accepts exactly the frames `validate` accepts.
#![no_main]

use bounce_proto::wire::{Frame, fuzzing};
use libfuzzer_sys::{arbitrary::Arbitrary, arbitrary::Unstructured, fuzz_target};

fuzz_target!(|data: &[u8]| {
    fuzzing::frame_decode(data);
    if let Ok(frame) = Frame::arbitrary(&mut Unstructured::new(data)) {
        fuzzing::frame_encode(&frame);
    }
});
