//! Typed errors of the CUDA layer.

use cudarc::driver::sys as cu;

/// Why a CUDA operation failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CudaError {
    /// No usable driver or device: libcuda missing, cuInit failed, no GPU, bad ordinal.
    #[error("CUDA unavailable: {0}")]
    Unavailable(String),
    /// The plugin was built without NVRTC, so it carries no kernels.
    #[error("built without GPU kernels (NVRTC was not found at build time; see ci/setup)")]
    NoKernels,
    /// The driver has no cuMemcpyBatchAsync (it needs CUDA 12.8 or newer).
    #[error("the driver has no cuMemcpyBatchAsync (CUDA >= 12.8 needed; driver version {0})")]
    BatchUnsupported(i32),
    /// A driver call returned an error.
    #[error("{call} failed: {code:?}")]
    Driver {
        /// The driver function.
        call: &'static str,
        /// Its result.
        code: cu::CUresult,
    },
    /// The job cannot be expressed as a plan (a run too long, too many runs, overflow).
    #[error("bad copy plan: {0}")]
    Plan(&'static str),
}

/// Maps a driver result to `Ok` or [`CudaError::Driver`].
pub(super) fn check(call: &'static str, code: cu::CUresult) -> Result<(), CudaError> {
    if code == cu::CUresult::CUDA_SUCCESS { Ok(()) } else { Err(CudaError::Driver { call, code }) }
}
