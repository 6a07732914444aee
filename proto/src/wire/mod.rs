//! Versioned little-endian codec of the control plane (design §5, §9): the four control messages
//! (WANT / GRANT / DATA / ACK) and HELLO framed behind a 16-byte header, the capability blob exchanged in the
//! handshake, and the connection-info envelope that wraps the inner UCX engine's conn info.
//!
//! This module owns byte layouts only. It does not decide whether a message makes sense for the
//! state of a transfer (the sender and receiver machines do), nor does it send anything (the shell
//! does). Every field has a fixed width except DATA's scatter runs, every count is a `u32`, and
//! enum tags are validated strictly. Scatter runs are delta-coded with varints (a DATA carries
//! hundreds of them: see `Writer::run`), and the decoder accepts only their one shortest form.
//! So the encoding is canonical: whatever `decode` accepts, `encode` reproduces byte for byte
//! (the fuzz targets under `fuzz/` check exactly that).
//!
//! Decoding treats its input as hostile: it never panics, and it checks every count against both
//! an absolute cap and the bytes actually left before it allocates, so a 20-byte frame can never
//! make the receiver reserve gigabytes.
//!
//! One job per file: `codec.rs` the primitives (reader, writer, varints, the canonical-form
//! rules), `frame.rs` the control frames and their messages (HELLO included), `caps.rs` the
//! capability blob and the compatibility policy, `envelope.rs` the connection-info envelope, `public.rs` the public-data envelope of a
//! registration, `region_plan.rs` the fixed-width scatter plan a sender writes behind a chunk's data,
//! `samples.rs` one valid value of each (tests and fuzz seeds), `fuzzing.rs` the fuzz entry
//! points. This file only declares and re-exports them.

mod caps;
mod codec;
mod envelope;
mod frame;
#[cfg(feature = "fuzzing")]
pub mod fuzzing;
mod public;
pub mod region_plan;
#[cfg(any(test, feature = "fuzzing"))]
mod samples;
pub mod stream;
#[cfg(test)]
mod tests;

pub use crate::types::MAX_ARENAS;
pub use caps::{ArenaCaps, Arenas, Capabilities, Incompatible, MAX_CHUNK_SHRINK, MailboxCaps};
pub use codec::{MAX_BLOB, Result, WireError};
pub use envelope::{ConnEnvelope, ENVELOPE_MAGIC, ENVELOPE_VERSION};
pub use frame::{
    Ack, AckStatus, Body, ControlFrame, Credit, Cursor, Data, Frame, Grant, HEADER_LEN, Inline, Keep, MAGIC,
    MAX_CHUNKS_PER_WANT, MAX_CREDITS, MAX_FRAME_LEN, MAX_INLINE_BYTES, MAX_PROOFS, MAX_RUNS, Msg, Plan, Proof, Pull,
    PullChunk, REPLY_MAILBOX, Release, Standing, WIRE_VERSION, Want, decode_hello, encode_goodbye, encode_hello,
    escape_app_notif, is_control_frame, unescape_app_notif,
};
pub use public::{
    CmaRecord, IpcRecord, PUBLIC_MAGIC, PUBLIC_VERSION, PUBLIC_VERSION_CMA, PUBLIC_VERSION_IPC, PublicData,
};
