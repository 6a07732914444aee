//! What Rust calls out to, below the shell: the C++ shim's `bnc_shim_*` functions (the inner
//! UCX engine), loading NIXL's UCX plugin, and the typed NIXL integers (`nixl_status_t`,
//! `nixl_mem_t`, `nixl_xfer_op_t`) both directions share.
//!
//! Nothing here imports the shell or the FFI entry points: errors are this layer's own types
//! ([`nixl::NixlStatus`], [`inner_plugin::LoadError`]), which the shell wraps.

pub mod c;
pub(crate) mod inner_plugin;
pub mod nixl;
pub(crate) mod nixl_version;
pub(crate) mod shim;
