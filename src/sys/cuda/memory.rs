//! Device and pinned host memory. [`alloc_vram`] is the one place VRAM is taken, so that a
//! different allocator (fabric memory for multi-node NVLink, say) can replace it later.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::sys as cu;

use super::driver::Gpu;
use super::error::{CudaError, check};

/// A device allocation, freed on drop.
#[derive(Debug)]
pub struct DeviceAlloc {
    gpu: Arc<Gpu>,
    ptr: cu::CUdeviceptr,
    len: usize,
}

/// Takes `len` bytes of VRAM on `gpu` with cuMemAlloc: plain device memory, never managed
/// memory (managed memory can page and, oversubscribed, hang the GPU).
pub fn alloc_vram(gpu: &Arc<Gpu>, len: usize) -> Result<DeviceAlloc, CudaError> {
    gpu.bind()?;
    let mut ptr = 0;
    // SAFETY: the context is current; valid out-pointer. A zero-byte request is refused by the
    // driver, so ask for at least one byte.
    check("cuMemAlloc", unsafe { cu::cuMemAlloc_v2(&mut ptr, len.max(1)) })?;
    Ok(DeviceAlloc { gpu: gpu.clone(), ptr, len })
}

impl DeviceAlloc {
    /// The device address of the first byte.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a zero-length allocation.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The GPU it lives on.
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// Copies `src` to `[off, off + src.len())` and waits until the device holds it. Set-up and
    /// tests, not the data path.
    pub fn write(&self, off: usize, src: &[u8]) -> Result<(), CudaError> {
        self.range(off, src.len())?;
        self.gpu.bind()?;
        // SAFETY: the range lies inside the allocation (checked); `src` is valid for reads.
        check("cuMemcpyHtoD", unsafe { cu::cuMemcpyHtoD_v2(self.ptr + off as u64, src.as_ptr().cast(), src.len()) })?;
        // From pageable memory the copy may return before the DMA lands, and the copy streams
        // do not order with the default stream: wait, so later launches see the bytes.
        // SAFETY: no preconditions.
        check("cuCtxSynchronize", unsafe { cu::cuCtxSynchronize() })
    }

    /// Copies `[off, off + dst.len())` into `dst`, synchronously (waits for all work in the
    /// context that writes it). Set-up and tests, not the data path.
    pub fn read(&self, off: usize, dst: &mut [u8]) -> Result<(), CudaError> {
        self.range(off, dst.len())?;
        self.gpu.bind()?;
        // SAFETY: the range lies inside the allocation (checked); `dst` is valid for writes.
        check("cuMemcpyDtoH", unsafe { cu::cuMemcpyDtoH_v2(dst.as_mut_ptr().cast(), self.ptr + off as u64, dst.len()) })
    }

    /// Sets every byte to `value`, synchronously.
    pub fn fill(&self, value: u8) -> Result<(), CudaError> {
        self.gpu.bind()?;
        // SAFETY: the whole allocation.
        check("cuMemsetD8", unsafe { cu::cuMemsetD8_v2(self.ptr, value, self.len) })?;
        // SAFETY: no preconditions; makes the (possibly asynchronous) memset complete.
        check("cuCtxSynchronize", unsafe { cu::cuCtxSynchronize() })
    }

    fn range(&self, off: usize, n: usize) -> Result<(), CudaError> {
        match off.checked_add(n) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(CudaError::Plan("range outside the allocation")),
        }
    }
}

impl Drop for DeviceAlloc {
    fn drop(&mut self) {
        // Whoever launched work on this memory waited for it before dropping (the copy engine
        // synchronizes its streams first).
        if self.gpu.bind().is_ok() {
            // SAFETY: `ptr` came from cuMemAlloc in this context and is freed once.
            let _ = unsafe { cu::cuMemFree_v2(self.ptr) };
        }
    }
}

/// Page-locked host memory, mapped into the device's address space (the kernels can read it in
/// place, and async copies from it need no staging).
#[derive(Debug)]
pub struct PinnedHost {
    gpu: Arc<Gpu>,
    ptr: *mut u8,
    dev: u64,
    len: usize,
}

// SAFETY: the buffer is plain memory owned by this value; the driver handle is thread-safe.
unsafe impl Send for PinnedHost {}

impl PinnedHost {
    /// Allocates `len` bytes of pinned, device-mapped host memory.
    pub fn new(gpu: &Arc<Gpu>, len: usize) -> Result<Self, CudaError> {
        gpu.bind()?;
        let mut p: *mut c_void = std::ptr::null_mut();
        let flags = cu::CU_MEMHOSTALLOC_PORTABLE | cu::CU_MEMHOSTALLOC_DEVICEMAP;
        // SAFETY: the context is current; valid out-pointer.
        check("cuMemHostAlloc", unsafe { cu::cuMemHostAlloc(&mut p, len.max(1), flags) })?;
        let mut dev = 0;
        // SAFETY: `p` is a mapped allocation made just above.
        if let Err(e) = check("cuMemHostGetDevicePointer", unsafe { cu::cuMemHostGetDevicePointer_v2(&mut dev, p, 0) })
        {
            // SAFETY: frees what was allocated above.
            let _ = unsafe { cu::cuMemFreeHost(p) };
            return Err(e);
        }
        Ok(Self { gpu: gpu.clone(), ptr: p.cast(), dev, len: len.max(1) })
    }

    /// The host view.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` is valid for `len` bytes for our lifetime; `&mut self` makes this the
        // only host view. The device reads it only while a launch that was given it runs, and
        // callers rewrite a plan buffer only once that launch is known finished.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    /// The host address.
    pub fn host_ptr(&self) -> *const u8 {
        self.ptr
    }

    /// The address under which the device sees it.
    pub fn device_ptr(&self) -> u64 {
        self.dev
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when empty (never: at least one byte is allocated).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for PinnedHost {
    fn drop(&mut self) {
        let _ = self.gpu.bind();
        // SAFETY: allocated by cuMemHostAlloc and freed once; no launch still reads it (the
        // owner synchronizes its stream first).
        let _ = unsafe { cu::cuMemFreeHost(self.ptr.cast()) };
    }
}
