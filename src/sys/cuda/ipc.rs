//! CUDA IPC: exporting the allocation that holds a registration, and mapping a peer process's
//! export into ours (the same-host path, `bounce_cuda_ipc`). Legacy IPC handles only: memory
//! from cuMemAlloc / cudaMalloc (what UCX's cuda_ipc transport also maps); other memory (virtual
//! memory management allocations, say) exports nothing and keeps the bounce path.

use std::sync::Arc;

use cudarc::driver::sys as cu;

use super::driver::Gpu;
use super::error::{CudaError, check};

/// The export of the allocation holding some address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IpcExport {
    /// The allocation's `CUipcMemHandle`.
    pub handle: [u8; 64],
    /// The allocation's first byte.
    pub base: u64,
    /// The allocation's length.
    pub len: u64,
}

/// Exports the allocation holding `addr` (memory of any GPU of this process, made by
/// cuMemAlloc). Errors for memory the driver cannot export.
pub fn ipc_export(gpu: &Gpu, addr: u64) -> Result<IpcExport, CudaError> {
    gpu.bind()?;
    let (mut base, mut len) = (0, 0usize);
    // SAFETY: the context is current; valid out-pointers. The driver only looks `addr` up.
    check("cuMemGetAddressRange", unsafe { cu::cuMemGetAddressRange_v2(&mut base, &mut len, addr) })?;
    let mut h = cu::CUipcMemHandle { reserved: [0; 64] };
    // SAFETY: `base` is the start of a live allocation (just looked up); valid out-pointer.
    check("cuIpcGetMemHandle", unsafe { cu::cuIpcGetMemHandle(&mut h, base) })?;
    Ok(IpcExport { handle: h.reserved.map(|c| c as u8), base, len: len as u64 })
}

/// A peer process's allocation mapped into this one; unmapped on drop.
#[derive(Debug)]
pub struct IpcMapping {
    gpu: Arc<Gpu>,
    ptr: u64,
    len: u64,
}

impl IpcMapping {
    /// Maps the allocation of `handle` (another process's export; a handle of this process
    /// fails) into `gpu`'s context, with peer access enabled when it lives on another GPU.
    pub fn open(gpu: &Arc<Gpu>, handle: &[u8; 64]) -> Result<Self, CudaError> {
        gpu.bind()?;
        let h = cu::CUipcMemHandle { reserved: handle.map(|b| b as std::ffi::c_char) };
        let mut ptr = 0;
        // SAFETY: the context is current; valid out-pointer. The driver validates the handle
        // (a forged or stale one fails; it names only memory its exporter allowed to share).
        check("cuIpcOpenMemHandle", unsafe {
            cu::cuIpcOpenMemHandle_v2(
                &mut ptr,
                h,
                cu::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as std::ffi::c_uint,
            )
        })?;
        let mut m = Self { gpu: gpu.clone(), ptr, len: 0 };
        // The length the driver mapped, not the one the peer claims: pieces are checked
        // against it, so a record claiming more than its allocation cannot reach past it.
        let mut base = 0;
        let mut len = 0usize;
        // SAFETY: `ptr` was just mapped in this context; valid out-pointers.
        check("cuMemGetAddressRange", unsafe { cu::cuMemGetAddressRange_v2(&mut base, &mut len, ptr) })?;
        if base != ptr {
            return Err(CudaError::Plan("an IPC mapping that does not start its allocation"));
        }
        m.len = len as u64;
        Ok(m)
    }

    /// This process's address of the allocation's first byte.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// The mapped allocation's length, as the driver reports it.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// True for an empty mapping (never made by `open`).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        // Kernels that use the mapping hold it (an `Arc`) until their event completed.
        let _ = self.gpu.bind();
        // SAFETY: opened in `open`, closed once.
        let _ = unsafe { cu::cuIpcCloseMemHandle(self.ptr) };
    }
}
