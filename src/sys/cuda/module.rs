//! The PTX of `kernels/`, embedded at build time (kernels/build_ptx.rs), and its module on a GPU.

use std::ffi::CString;
use std::sync::Arc;

use cudarc::driver::sys as cu;

use super::driver::Gpu;
use super::error::{CudaError, check};

/// Entry point of the gather kernel (kernels/gather_scatter.cu).
pub const GATHER_KERNEL: &str = "bounce_gather";
/// Entry point of the scatter kernel.
pub const SCATTER_KERNEL: &str = "bounce_scatter";
/// Entry point of the region plan check kernel.
pub const PLAN_CHECK_KERNEL: &str = "bounce_plan_check";
/// Entry point of the scatter that runs only when the region plan check passed.
pub const SCATTER_CHECKED_KERNEL: &str = "bounce_scatter_checked";

/// The PTX text NVRTC produced at build time; empty when the build had no NVRTC.
const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/gather_scatter.ptx"));

/// The embedded PTX, or `None` when the plugin was built without kernels.
pub fn embedded_ptx() -> Option<&'static str> {
    (!PTX.trim().is_empty()).then_some(PTX)
}

/// The kernels loaded into one GPU's context; unloaded on drop.
#[derive(Debug)]
pub struct Kernels {
    gpu: Arc<Gpu>,
    module: cu::CUmodule,
    pub(super) gather: cu::CUfunction,
    pub(super) scatter: cu::CUfunction,
    pub(super) plan_check: cu::CUfunction,
    pub(super) scatter_checked: cu::CUfunction,
}

// SAFETY: module and function handles are process-wide driver handles, usable from any thread
// with the context current.
unsafe impl Send for Kernels {}
// SAFETY: as above; nothing in `Kernels` is mutated after loading.
unsafe impl Sync for Kernels {}

impl Kernels {
    /// Loads the embedded PTX on `gpu` (the driver compiles it for the device here, once).
    pub fn load(gpu: &Arc<Gpu>) -> Result<Self, CudaError> {
        let ptx = embedded_ptx().ok_or(CudaError::NoKernels)?;
        let image = CString::new(ptx).map_err(|_| CudaError::Plan("PTX holds a NUL byte"))?;
        gpu.bind()?;
        let mut module = std::ptr::null_mut();
        // SAFETY: the context is current; `image` is NUL-terminated PTX text that outlives the call.
        check("cuModuleLoadData", unsafe { cu::cuModuleLoadData(&mut module, image.as_ptr().cast()) })?;
        let null = std::ptr::null_mut();
        let mut k =
            Self { gpu: gpu.clone(), module, gather: null, scatter: null, plan_check: null, scatter_checked: null };
        k.gather = k.function(GATHER_KERNEL)?;
        k.scatter = k.function(SCATTER_KERNEL)?;
        k.plan_check = k.function(PLAN_CHECK_KERNEL)?;
        k.scatter_checked = k.function(SCATTER_CHECKED_KERNEL)?;
        Ok(k)
    }

    fn function(&self, name: &str) -> Result<cu::CUfunction, CudaError> {
        let c = CString::new(name).expect("kernel names hold no NUL");
        let mut f = std::ptr::null_mut();
        // SAFETY: `module` is loaded; `c` is a NUL-terminated name.
        check("cuModuleGetFunction", unsafe { cu::cuModuleGetFunction(&mut f, self.module, c.as_ptr()) })?;
        Ok(f)
    }

    /// The GPU the module is loaded on.
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }
}

impl Drop for Kernels {
    fn drop(&mut self) {
        let _ = self.gpu.bind();
        // SAFETY: loaded in `load`, unloaded once; launches using it were waited for by their
        // owners (the copy engine synchronizes before dropping).
        let _ = unsafe { cu::cuModuleUnload(self.module) };
    }
}
