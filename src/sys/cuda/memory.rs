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

/// Small synchronous copies between host memory and one device allocation, on a stream of
/// their own: a GPU arena's mailbox records (written by the reactor) and the answers its
/// fetches brought in (read by the reactor). Each waits for its own copy only, never for the
/// gathers and scatters queued on the copy engine's streams.
#[derive(Debug)]
pub struct SmallCopies {
    alloc: Arc<DeviceAlloc>,
    stream: cu::CUstream,
}

// SAFETY: the stream is a driver handle usable from any thread with the context current (each
// call binds it); every call waits for its copy before returning, so no copy outlives the call
// that borrowed its host buffer.
unsafe impl Send for SmallCopies {}
// SAFETY: as above; the driver serializes work on one stream.
unsafe impl Sync for SmallCopies {}

impl SmallCopies {
    /// A stream for small copies into and out of `alloc`.
    pub fn new(alloc: Arc<DeviceAlloc>) -> Result<Self, CudaError> {
        alloc.gpu.bind()?;
        let mut stream = std::ptr::null_mut();
        // SAFETY: current context; valid out-pointer. Non-blocking: no implicit ordering with
        // the legacy default stream (the application's, or a scatter's).
        check("cuStreamCreate", unsafe {
            cu::cuStreamCreate(&mut stream, cu::CUstream_flags::CU_STREAM_NON_BLOCKING as u32)
        })?;
        Ok(Self { alloc, stream })
    }

    /// Copies `src` to byte `off` of the allocation and waits until the device holds it.
    pub fn put(&self, off: u64, src: &[u8]) -> Result<(), CudaError> {
        let off = self.inside(off, src.len())?;
        self.alloc.gpu.bind()?;
        // SAFETY: the range lies inside the allocation (checked), which outlives `self`; `src`
        // stays borrowed until the stream synchronization below has seen the copy complete.
        check("cuMemcpyHtoDAsync", unsafe {
            cu::cuMemcpyHtoDAsync_v2(self.alloc.ptr + off, src.as_ptr().cast(), src.len(), self.stream)
        })?;
        // SAFETY: a valid stream of this context.
        check("cuStreamSynchronize", unsafe { cu::cuStreamSynchronize(self.stream) })
    }

    /// Copies `dst.len()` bytes at byte `off` of the allocation into `dst`, and waits.
    pub fn get(&self, off: u64, dst: &mut [u8]) -> Result<(), CudaError> {
        let off = self.inside(off, dst.len())?;
        self.alloc.gpu.bind()?;
        // SAFETY: the range lies inside the allocation (checked); `dst` stays borrowed until
        // the synchronization below.
        check("cuMemcpyDtoHAsync", unsafe {
            cu::cuMemcpyDtoHAsync_v2(dst.as_mut_ptr().cast(), self.alloc.ptr + off, dst.len(), self.stream)
        })?;
        // SAFETY: a valid stream of this context.
        check("cuStreamSynchronize", unsafe { cu::cuStreamSynchronize(self.stream) })
    }

    /// Zeroes `len` bytes from byte `off` of the allocation, and waits.
    pub fn zero(&self, off: u64, len: usize) -> Result<(), CudaError> {
        let off = self.inside(off, len)?;
        self.alloc.gpu.bind()?;
        // SAFETY: the range lies inside the allocation (checked).
        check("cuMemsetD8Async", unsafe { cu::cuMemsetD8Async(self.alloc.ptr + off, 0, len, self.stream) })?;
        // SAFETY: a valid stream of this context.
        check("cuStreamSynchronize", unsafe { cu::cuStreamSynchronize(self.stream) })
    }

    fn inside(&self, off: u64, n: usize) -> Result<u64, CudaError> {
        let off = usize::try_from(off).map_err(|_| CudaError::Plan("range outside the allocation"))?;
        self.alloc.range(off, n)?;
        Ok(off as u64)
    }
}

impl Drop for SmallCopies {
    fn drop(&mut self) {
        if self.alloc.gpu.bind().is_ok() {
            // SAFETY: created in `new` and destroyed once; every copy on it was waited for.
            let _ = unsafe { cu::cuStreamDestroy_v2(self.stream) };
        }
    }
}
