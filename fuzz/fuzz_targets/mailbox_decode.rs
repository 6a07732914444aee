//! Mailbox records and ring images from arbitrary bytes: decoding never panics, what decodes
//! re-encodes to the same bytes, and the initiator's reader accepts only authentic records, in
//! sequence, once (see `bounce_proto::mailbox::fuzzing::mailbox_decode`).
#![no_main]

use bounce_proto::mailbox::fuzzing;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    fuzzing::mailbox_decode(data);
});
