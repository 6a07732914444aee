//! Sans-IO core of nixl-bounce.
//!
//! Everything here is pure protocol logic: no threads, no FFI, no CUDA, no sockets and no
//! clocks (time comes in as an argument), so that every rule of the bounce design can be
//! tested deterministically. The IO shell in the `nixl-bounce` crate drives these types.
//!
//! - [`config`]: typed configuration from NIXL backend params plus `NIXL_BOUNCE_*` overrides.
//! - [`plan`]: bin-packs (src, dst) descriptor pairs into chunks and coalesces copy runs.
//! - [`wire`]: versioned little-endian codec of the control messages and capability blobs.
//! - [`buddy`]: power-of-two buddy allocator over arena byte offsets.
//! - [`scheduler`]: the arena ledger of both roles (who holds each region, the eager cap,
//!   conservation) and the fair-share credit policy over it (round robin, drain mode, share cap).
//! - [`sender`] / [`receiver`]: the two role state machines.
//! - `timer`: the deadline set both roles arm (one timer per transfer or remote flow).
//! - [`endpoint`]: the one object the IO shell drives; owns the scheduler, both roles and the
//!   peer table, and takes raw control frames ([`endpoint::Endpoint::handle_frame`]).
//! - [`peers`]: the peer table (loaded connection info and capabilities, session, HELLO) and its
//!   frame-admission and credit-bounds rules.
//! - [`gate`]: the routing gate (bounce or pass through, and why) and direct-write coverage.
//! - [`event`]: the types the endpoint and both roles share (actions, job ids, errors, stats).
#![forbid(unsafe_code)]

pub mod buddy;
pub mod config;
pub mod endpoint;
pub mod event;
pub mod gate;
pub mod manifest;
pub mod peers;
pub mod plan;
pub mod receiver;
pub mod scheduler;
pub mod sender;
mod timer;
pub mod types;
pub mod wire;

pub use types::*;
