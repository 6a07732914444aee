//! Loading the driver and opening one GPU: the primary context, its SM count, the stream
//! priorities, and which batched-copy entry point the driver has.

use std::ffi::c_void;
use std::sync::{Arc, OnceLock};

use cudarc::driver::sys as cu;

use super::error::{CudaError, check};

/// CUDA 13's `cuMemcpyBatchAsync_v2`: (dsts, srcs, sizes, count, attrs, attr indices, attr
/// count, stream).
pub(super) type BatchV13 = unsafe extern "C" fn(
    *mut cu::CUdeviceptr,
    *mut cu::CUdeviceptr,
    *mut usize,
    usize,
    *mut cu::CUmemcpyAttributes,
    *mut usize,
    usize,
    cu::CUstream,
) -> cu::CUresult;

/// CUDA 12.8's `cuMemcpyBatchAsync`: as [`BatchV13`] plus a failure-index out-pointer before
/// the stream.
pub(super) type BatchV12 = unsafe extern "C" fn(
    *mut cu::CUdeviceptr,
    *mut cu::CUdeviceptr,
    *mut usize,
    usize,
    *mut cu::CUmemcpyAttributes,
    *mut usize,
    usize,
    *mut usize,
    cu::CUstream,
) -> cu::CUresult;

/// The driver's batched-copy entry point, in the ABI the driver has.
#[derive(Debug, Clone, Copy)]
pub(super) enum BatchFn {
    /// CUDA 13's ABI.
    V13(BatchV13),
    /// CUDA 12.8's ABI.
    V12(BatchV12),
}

/// The process-wide driver state: `cuInit` runs once; its outcome (the driver version, or why
/// CUDA is unusable) is kept.
fn driver() -> Result<i32, CudaError> {
    static DRIVER: OnceLock<Result<i32, CudaError>> = OnceLock::new();
    DRIVER
        .get_or_init(|| {
            // SAFETY: only tries to dlopen libcuda under its usual names; loading the vendor's
            // driver library runs its initialisers, which is what using CUDA means.
            if !unsafe { cu::is_culib_present() } {
                return Err(CudaError::Unavailable("libcuda (the CUDA driver) not found".into()));
            }
            // From here on cudarc's loader finds the library, so its calls do not panic.
            // SAFETY: cuInit(0) has no preconditions.
            check("cuInit", unsafe { cu::cuInit(0) }).map_err(|e| CudaError::Unavailable(e.to_string()))?;
            let mut v = 0;
            // SAFETY: valid out-pointer.
            check("cuDriverGetVersion", unsafe { cu::cuDriverGetVersion(&mut v) })?;
            Ok(v)
        })
        .clone()
}

/// The GPU of the CUDA context current on the calling thread, if any: `Ok(None)` when CUDA
/// works but this thread has no context (the application has not used a GPU yet). Creates no
/// context. `Unavailable` without libcuda.
pub fn current_device() -> Result<Option<i32>, CudaError> {
    driver()?;
    let mut ctx = std::ptr::null_mut();
    // SAFETY: the driver is initialised; valid out-pointer.
    check("cuCtxGetCurrent", unsafe { cu::cuCtxGetCurrent(&mut ctx) })?;
    if ctx.is_null() {
        return Ok(None);
    }
    let mut dev = 0;
    // SAFETY: a context is current on this thread; valid out-pointer.
    check("cuCtxGetDevice", unsafe { cu::cuCtxGetDevice(&mut dev) })?;
    let mut count = 0;
    // SAFETY: valid out-pointer.
    check("cuDeviceGetCount", unsafe { cu::cuDeviceGetCount(&mut count) })?;
    // A CUdevice is a handle: find the ordinal that names it.
    for ordinal in 0..count {
        let mut d = 0;
        // SAFETY: ordinal in range; valid out-pointer.
        check("cuDeviceGet", unsafe { cu::cuDeviceGet(&mut d, ordinal) })?;
        if d == dev {
            return Ok(Some(ordinal));
        }
    }
    Ok(None)
}

/// The ordinal of the GPU whose memory address `ptr` is, as the driver knows it
/// (`CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL`), whatever device id the application gave with it.
/// Creates no context. `Unavailable` without libcuda; the driver's error for an address it does
/// not know (host memory it never saw, say).
pub fn device_of(ptr: u64) -> Result<i32, CudaError> {
    driver()?;
    let mut ordinal: i32 = -1;
    // SAFETY: the driver is initialised (above); the out-pointer is valid for the attribute's
    // one i32; the driver looks `ptr` up in its own tables and never dereferences it.
    check("cuPointerGetAttribute", unsafe {
        cu::cuPointerGetAttribute(
            std::ptr::from_mut(&mut ordinal).cast::<c_void>(),
            cu::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            ptr,
        )
    })?;
    Ok(ordinal)
}

/// How many GPUs the driver shows this process (`CUDA_VISIBLE_DEVICES` applied). Creates no
/// context. `Unavailable` without libcuda.
pub fn device_count() -> Result<i32, CudaError> {
    driver()?;
    let mut count = 0;
    // SAFETY: the driver is initialised (above); valid out-pointer.
    check("cuDeviceGetCount", unsafe { cu::cuDeviceGetCount(&mut count) })?;
    Ok(count.max(0))
}

thread_local! {
    /// The context that was current on this thread before the first [`Gpu::bind`] that changed
    /// it since the last [`restore_thread_context`] (`Some(0)`: none was).
    static REPLACED: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
}

/// Makes current again on this thread the context (or no context) that was current before
/// [`Gpu::bind`] first replaced it, if it did. Every entry point NIXL calls runs this on its way
/// out: a CUDA context is the application's runtime's current device, and a call into BOUNCE
/// (registering GPU memory, a same-host GPU copy, a reactor pass on a copy engine that allows
/// it on application threads) must not change it under the application. Costs a thread-local
/// read when nothing was bound.
pub fn restore_thread_context() {
    // `try_with`: an entry point may be called from another thread-local's destructor at
    // thread exit, after this one is gone (nothing was bound there since, so nothing to undo).
    let Ok(Some(prev)) = REPLACED.try_with(std::cell::Cell::take) else { return };
    // A context was bound, so the driver is loaded and initialised. SAFETY: `prev` was current
    // on this thread when it was replaced; a context the application destroyed since is
    // refused by the driver with an error, which leaves no context current (nothing to do).
    let _ = unsafe { cu::cuCtxSetCurrent(prev as cu::CUcontext) };
}

/// One GPU with its primary context retained (shared with the application's runtime, so device
/// pointers it allocated are valid in it).
#[derive(Debug)]
pub struct Gpu {
    ordinal: i32,
    dev: cu::CUdevice,
    ctx: cu::CUcontext,
    sms: u32,
    driver_version: i32,
    priorities: (i32, i32),
    batch: Option<BatchFn>,
}

// SAFETY: a CUcontext and a CUdevice are process-wide driver handles usable from any thread
// (each thread makes the context current with `bind` before using it); the fn pointers are
// plain code addresses.
unsafe impl Send for Gpu {}
// SAFETY: as above; `Gpu` has no interior mutability.
unsafe impl Sync for Gpu {}

impl Gpu {
    /// Opens GPU `ordinal`: checks the driver, retains the device's primary context and makes it
    /// current on this thread. `Unavailable` without libcuda, without a device, or for a bad
    /// ordinal.
    pub fn open(ordinal: i32) -> Result<Arc<Self>, CudaError> {
        let driver_version = driver()?;
        let count = device_count().map_err(|e| CudaError::Unavailable(e.to_string()))?;
        if count == 0 {
            return Err(CudaError::Unavailable("no CUDA device".into()));
        }
        if ordinal < 0 || ordinal >= count {
            return Err(CudaError::Unavailable(format!("no CUDA device {ordinal} (the driver sees {count})")));
        }
        let mut dev = 0;
        // SAFETY: ordinal checked; valid out-pointer.
        check("cuDeviceGet", unsafe { cu::cuDeviceGet(&mut dev, ordinal) })?;
        let mut ctx = std::ptr::null_mut();
        // SAFETY: `dev` is a valid device; the retain is balanced by the release in Drop.
        check("cuDevicePrimaryCtxRetain", unsafe { cu::cuDevicePrimaryCtxRetain(&mut ctx, dev) })?;
        let mut gpu = Self { ordinal, dev, ctx, sms: 0, driver_version, priorities: (0, 0), batch: None };
        gpu.bind()?;
        let mut sms = 0;
        // SAFETY: valid device and out-pointer.
        check("cuDeviceGetAttribute", unsafe {
            cu::cuDeviceGetAttribute(&mut sms, cu::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev)
        })?;
        gpu.sms = sms.max(1) as u32;
        let (mut least, mut greatest) = (0, 0);
        // SAFETY: the context is current (bind above); valid out-pointers.
        check("cuCtxGetStreamPriorityRange", unsafe { cu::cuCtxGetStreamPriorityRange(&mut least, &mut greatest) })?;
        gpu.priorities = (least, greatest);
        gpu.batch = find_batch_fn(driver_version);
        Ok(Arc::new(gpu))
    }

    /// Makes this GPU's context current on the calling thread (cheap; call before driver work
    /// on a thread that may not have it). The context it replaces is remembered for
    /// [`restore_thread_context`]: an application thread that calls into BOUNCE gets its own
    /// back when the call returns.
    pub fn bind(&self) -> Result<(), CudaError> {
        let mut current = std::ptr::null_mut();
        // SAFETY: the driver is initialised (this Gpu exists); valid out-pointer.
        check("cuCtxGetCurrent", unsafe { cu::cuCtxGetCurrent(&mut current) })?;
        if current == self.ctx {
            return Ok(());
        }
        // SAFETY: `ctx` is retained for as long as `self` lives.
        check("cuCtxSetCurrent", unsafe { cu::cuCtxSetCurrent(self.ctx) })?;
        // At thread exit (see `restore_thread_context`) there is nothing to restore into.
        let _ = REPLACED.try_with(|r| {
            if r.get().is_none() {
                r.set(Some(current as usize));
            }
        });
        Ok(())
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> i32 {
        self.ordinal
    }

    /// Streaming multiprocessors: sizes the kernels' grids.
    pub fn sm_count(&self) -> u32 {
        self.sms
    }

    /// The driver's CUDA version, e.g. 13000.
    pub fn driver_version(&self) -> i32 {
        self.driver_version
    }

    /// The highest stream priority (numerically the smallest): copy streams use it so copies do
    /// not queue behind the application's kernels.
    pub fn high_priority(&self) -> i32 {
        self.priorities.1
    }

    /// Whether the driver has a batched memcpy.
    pub fn has_batched_copy(&self) -> bool {
        self.batch.is_some()
    }

    pub(super) fn batch_fn(&self) -> Result<BatchFn, CudaError> {
        self.batch.ok_or(CudaError::BatchUnsupported(self.driver_version))
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        // SAFETY: balances the retain in `open`; everything made in the context (allocations,
        // streams, modules) holds an Arc<Gpu>, so it is gone by now.
        let _ = unsafe { cu::cuDevicePrimaryCtxRelease_v2(self.dev) };
    }
}

/// Looks the batched memcpy up by name (cudarc's typed wrapper would panic on an older driver):
/// CUDA 13's `_v2` ABI first, then 12.8's.
fn find_batch_fn(driver_version: i32) -> Option<BatchFn> {
    if driver_version < 12080 {
        return None;
    }
    // SAFETY: `driver()` succeeded, so cudarc's library handle loads without panicking.
    let lib = unsafe { cu::culib() };
    // SAFETY: the symbols are the driver's, with the signatures of the CUDA 13.0 and 12.8
    // headers respectively (the enum's variant types); a missing symbol gives an Err.
    unsafe {
        if let Ok(f) = lib.get::<*const c_void>(b"cuMemcpyBatchAsync_v2\0") {
            return Some(BatchFn::V13(std::mem::transmute::<*const c_void, BatchV13>(*f)));
        }
        if let Ok(f) = lib.get::<*const c_void>(b"cuMemcpyBatchAsync\0") {
            return Some(BatchFn::V12(std::mem::transmute::<*const c_void, BatchV12>(*f)));
        }
    }
    None
}

/// For tests (the lib's and `tests/cuda_kernels.rs`): GPU 0, or `None` after printing that
/// `test` is skipped; with `BOUNCE_REQUIRE_GPU=1` (the GPU machine's runs) no GPU fails the test
/// instead: a run of skips must not pass as the GPU proof.
///
/// # Panics
/// With no GPU under `BOUNCE_REQUIRE_GPU=1`.
pub fn gpu_for_test(test: &str) -> Option<Arc<Gpu>> {
    match Gpu::open(0) {
        Ok(g) => Some(g),
        Err(e) => {
            assert!(
                std::env::var("BOUNCE_REQUIRE_GPU").as_deref() != Ok("1"),
                "{test}: BOUNCE_REQUIRE_GPU=1 but no GPU: {e}"
            );
            println!("{test}: skipped: no GPU ({e})");
            None
        }
    }
}
