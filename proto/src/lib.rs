//! Sans-IO core of nixl-bounce.
//!
//! Everything here is pure protocol logic: no threads, no FFI, no CUDA, no sockets and no
//! clocks (time comes in as an argument), so that every rule of the bounce design can be
//! tested deterministically. The IO shell in the `nixl-bounce` crate drives these types.
//!
//! Modules, from the bottom up (each imports only modules above it in this list; the test
//! `tests/module_cycles.rs` fails on any import cycle):
//! - [`types`]: identifiers and small value types (`PeerId`, `XferId`, `Region`, `CopyRun`,
//!   `DEFAULT_ALIGN`).
//! - [`manifest`] / [`config`]: the option manifest and the typed configuration from NIXL
//!   backend params plus `NIXL_BOUNCE_*` overrides.
//! - [`plan`]: bin-packs (src, dst) descriptor pairs into chunks and coalesces copy runs.
//! - [`buddy`]: power-of-two buddy allocator over arena byte offsets.
//! - [`wire`]: versioned little-endian codec: `codec` (reader, writer, varints), `frame` (the
//!   control messages and HELLO), `caps` (capability blob and compatibility), `envelope`.
//! - [`scheduler`]: the arena ledger of both roles (who holds each region, the eager cap,
//!   conservation) and the fair-share credit policy over it (round robin, drain mode, share cap).
//! - `timer`: the deadline set both roles arm (one timer per transfer or remote flow).
//! - [`event`]: the types the endpoint and both roles share (actions, job ids, errors, stats).
//! - [`sender`] / [`receiver`]: the two role state machines.
//! - [`liveness`]: the probe that declares a silent peer we wait on dead (PING/PONG timings).
//! - [`hello`]: a peer's HELLO asked about (a PING only the peer can answer) before it counts.
//! - [`peers`]: the peer table (loaded connection info and capabilities, session, HELLO) and its
//!   frame-admission and credit-bounds rules.
//! - [`proof`]: destination proofs (a keyed hash of the transfer token under a registration
//!   key) and the registrations a receiver may scatter into.
//! - [`gate`]: the routing gate (bounce or pass through, and why) and direct-write coverage.
//! - [`endpoint`]: the one object the IO shell drives; owns the scheduler, both roles and the
//!   peer table, and takes raw control frames ([`endpoint::Endpoint::handle_frame`]).
//! - [`mailbox`]: one-way answers for a target that never loaded its initiator's metadata
//!   (authenticated records in the target's arena that the initiator READs; `docs/one-way.md`).
//! - [`oneway`]: one-way flows: moves a one-way flow's answers between the roles and the
//!   mailbox (records written at the target, READ and verified at the initiator).
#![forbid(unsafe_code)]

pub mod buddy;
pub mod config;
pub mod endpoint;
pub mod event;
pub mod forget;
pub mod gate;
pub mod hello;
pub mod liveness;
pub mod mailbox;
pub mod manifest;
pub mod oneway;
pub mod peers;
pub mod plan;
pub mod proof;
pub mod receiver;
pub mod scheduler;
pub mod sender;
mod timer;
pub mod types;
pub mod wire;

pub use types::*;
