//! nixl-bounce: the BOUNCE backend plugin for NIXL.
//!
//! NIXL loads `libplugin_BOUNCE.so` like any backend. BOUNCE creates NIXL's own UCX engine inside
//! itself and delegates to it, so a user gets everything UCX does; on top of that, WRITEs of many
//! small descriptors to a bounce-capable peer take the bounce path (gather into one registered
//! staging region, one RDMA write, scatter at the receiver).
//!
//! Three layers, as cudarc's sys/result/safe:
//! - [`bounce_proto`] (own crate): the sans-IO protocol core. No unsafe, no threads, no clocks.
//! - [`shell`]: safe IO code: the engine object, loading the inner UCX plugin, the reactor.
//! - `ffi`: the only place (with the C++ shim in `cpp/`) that touches raw pointers. Every
//!   `extern "C"` body runs inside [`ffi::guard`], so no panic crosses into NIXL.
//!
//! Logging goes through `tracing`; set `NIXL_BOUNCE_LOG` (an `EnvFilter` directive such as
//! `info` or `nixl_bounce=debug`) to see it on stderr. The default is `warn`.

pub mod ffi;
pub mod shell;
#[doc(hidden)]
pub mod sys;

pub use bounce_proto as proto;
