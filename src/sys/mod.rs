//! What Rust calls out to, below the shell: the C++ shim's `bnc_shim_*` functions (the inner
//! UCX engine), loading NIXL's UCX plugin, the typed NIXL integers (`nixl_status_t`,
//! `nixl_mem_t`, `nixl_xfer_op_t`) both directions share, the CUDA driver ([`cuda`]),
//! cross-memory attach between processes of one host (`cma`), telling a forked child from
//! its parent (`fork`), and the ZMQ socket options the zmq crate cannot set (`zmq`).
//!
//! Nothing here imports the shell or the FFI entry points: errors are this layer's own types
//! ([`nixl::NixlStatus`], `inner_plugin::LoadError`, [`cuda::CudaError`]), which the shell
//! wraps. Public (and hidden from the docs) only so that integration tests
//! (tests/cuda_kernels.rs) can drive the kernels on a GPU; it is not the plugin's API.

pub mod c;
pub(crate) mod cma;
pub mod cuda;
pub(crate) mod fork;
pub(crate) mod inner_plugin;
pub mod nixl;
pub(crate) mod nixl_version;
pub mod nvtx;
pub(crate) mod shim;
pub(crate) mod thread;
pub(crate) mod zmq;
