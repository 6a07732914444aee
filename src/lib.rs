//! nixl-bounce: the BOUNCE backend plugin for NIXL.
//!
//! NIXL loads `libplugin_BOUNCE.so` like any backend. BOUNCE creates NIXL's own UCX engine inside
//! itself and delegates to it, so a user gets everything UCX does; on top of that, WRITEs of many
//! small descriptors to a bounce-capable peer take the bounce path (gather into one registered
//! staging region, one RDMA write, scatter at the receiver).
//!
//! Layers that point one way (`ffi` -> `shell` -> {core crate, `sys`}), as cudarc's
//! safe/result/sys:
//! - [`ffi`]: only what NIXL's C++ calls into: the `extern "C"` entry points (raw-to-typed
//!   conversion), the panic guard every one runs in ([`ffi::guard`]), and the one mapping from
//!   the shell's errors to NIXL statuses.
//! - `shell`: safe IO code: the engine object, the peer and registration tables, the reactor
//!   and its seams (control channel, copy engine, data path). It never imports `ffi`.
//! - [`bounce_proto`] (own crate): the sans-IO protocol core. No unsafe, no threads, no clocks.
//! - [`sys`]: what Rust calls out to: the C++ shim's `bnc_shim_*` (the inner UCX engine), the
//!   inner plugin loader, the typed NIXL integers. It never imports the shell.
//!
//! Logging goes through `tracing`; set `NIXL_BOUNCE_LOG` (an `EnvFilter` directive such as
//! `info` or `nixl_bounce=debug`) to see it on stderr. The default is `warn`.

pub mod ffi;
mod shell;
pub mod sys;

pub use bounce_proto as proto;
