//! Prepared plans: a job's copy runs encoded once into VRAM ([`DevicePlan`]) and launched many
//! times from there ([`gather_planned`], [`scatter_planned`]), so that a request posted again
//! and again costs no encode on the host and no host-to-device copy per launch. The encoded
//! bytes are also what the initiator copies behind a chunk's data as its region plan
//! ([`DevicePlan::ptr`], [`DevicePlan::len`], then `ExecContext::copy_d2d`).

use std::sync::Arc;

use parking_lot::Mutex;

use bounce_proto::CopyRun;
use cudarc::driver::sys as cu;

use super::driver::Gpu;
use super::error::{CudaError, check};
use super::exec::ExecContext;
use super::launch::queue_copy_kernel;
use super::memory::{DeviceAlloc, alloc_vram};
use super::module::Kernels;
use super::plan::{PlanShape, encode, plan_bytes};

/// An encoded kernel plan (the format of `plan.rs`, identical to a region plan) in VRAM of one
/// GPU, with its shape. Immutable once made; freed on drop, or given back to the [`PlanPool`]
/// it came from.
#[derive(Debug)]
pub struct DevicePlan {
    gpu: Arc<Gpu>,
    /// Always `Some` until dropped.
    mem: Option<DeviceAlloc>,
    shape: PlanShape,
    pool: Option<Arc<PlanPool>>,
}

impl Drop for DevicePlan {
    fn drop(&mut self) {
        // Whoever launched work reading the plan waited for it before dropping it (the same
        // rule as for freeing it), so the buffer may serve the next plan at once.
        if let (Some(pool), Some(mem)) = (self.pool.take(), self.mem.take()) {
            pool.give(mem);
        }
    }
}

/// Most plan buffers a [`PlanPool`] keeps, and most bytes.
const POOL_BUFFERS: usize = 32;
const POOL_BYTES: usize = 64 << 20;

/// Device buffers for plans made and dropped at a framework's pace (the same-host path makes
/// one per request), kept for the next plans, with one upload stream. Per plan, a cuMemAlloc,
/// a stream made and destroyed, and a cuMemFree cost the request's prep, and cuMemFree waits
/// for the whole device: releasing a request stalled on every kernel in flight, the
/// application's included.
#[derive(Debug)]
pub struct PlanPool {
    gpu: Arc<Gpu>,
    free: Mutex<Vec<DeviceAlloc>>,
    stream: cu::CUstream,
}

// SAFETY: the stream is a driver handle usable from any thread with the context current (each
// use binds it); an upload waits for its copy before returning, so no copy outlives the host
// buffer it reads. The free list is behind a lock.
unsafe impl Send for PlanPool {}
// SAFETY: as above; the driver serializes work on one stream.
unsafe impl Sync for PlanPool {}

impl PlanPool {
    /// An empty pool for plans on `gpu`.
    ///
    /// # Errors
    /// A driver error when the upload stream cannot be made.
    pub fn new(gpu: &Arc<Gpu>) -> Result<Arc<Self>, CudaError> {
        gpu.bind()?;
        let mut stream = std::ptr::null_mut();
        // SAFETY: current context; valid out-pointer. Non-blocking: an upload waits for nothing
        // on the legacy default stream (the application's).
        check("cuStreamCreate", unsafe {
            cu::cuStreamCreate(&mut stream, cu::CUstream_flags::CU_STREAM_NON_BLOCKING as u32)
        })?;
        Ok(Arc::new(Self { gpu: gpu.clone(), free: Mutex::new(Vec::new()), stream }))
    }

    /// As [`DevicePlan::upload`], into a buffer of this pool (a kept one when one fits, at most
    /// twice the size class needed), given back when the plan drops.
    ///
    /// # Errors
    /// As [`DevicePlan::upload`].
    pub fn upload(self: &Arc<Self>, runs: &[CopyRun]) -> Result<DevicePlan, CudaError> {
        let mut host = vec![0u8; plan_bytes(runs.len())];
        let shape = encode(runs, &mut host)?;
        let need = shape.bytes.max(1);
        // Buffers come in power-of-two size classes (4 KiB at least), so that plans of similar
        // sizes find them again; a kept buffer serves a plan of its class or the class below.
        let class = need.next_power_of_two().max(4096);
        let kept = {
            let mut free = self.free.lock();
            let best = free
                .iter()
                .enumerate()
                .filter(|(_, a)| a.len() >= need && a.len() <= class.saturating_mul(2))
                .min_by_key(|(_, a)| a.len())
                .map(|(i, _)| i);
            best.map(|i| free.swap_remove(i))
        };
        let mem = match kept {
            Some(m) => m,
            None => alloc_vram(&self.gpu, class)?,
        };
        self.gpu.bind()?;
        // SAFETY: `mem` holds at least `shape.bytes` bytes and nothing reads it (a kept buffer's
        // last plan was dropped after its launches ended); `host` stays borrowed until the
        // stream synchronization below has seen the copy complete.
        check("cuMemcpyHtoDAsync", unsafe {
            cu::cuMemcpyHtoDAsync_v2(mem.ptr(), host.as_ptr().cast(), shape.bytes, self.stream)
        })?;
        // SAFETY: the pool's stream, of this context.
        check("cuStreamSynchronize", unsafe { cu::cuStreamSynchronize(self.stream) })?;
        Ok(DevicePlan { gpu: self.gpu.clone(), mem: Some(mem), shape, pool: Some(Arc::clone(self)) })
    }

    /// Keeps `mem` for the next plans, unless the pool holds enough already (then it is freed).
    fn give(&self, mem: DeviceAlloc) {
        let mut free = self.free.lock();
        if free.len() < POOL_BUFFERS && free.iter().map(DeviceAlloc::len).sum::<usize>() + mem.len() <= POOL_BYTES {
            free.push(mem);
        }
    }

    /// Buffers kept now (tests).
    pub fn kept(&self) -> usize {
        self.free.lock().len()
    }
}

impl Drop for PlanPool {
    fn drop(&mut self) {
        self.free.get_mut().clear();
        if self.gpu.bind().is_ok() {
            // SAFETY: made in `new`, destroyed once; every upload waited for its copy.
            let _ = unsafe { cu::cuStreamDestroy_v2(self.stream) };
        }
    }
}

impl DevicePlan {
    /// Encodes `runs` and copies the plan into new VRAM of `gpu`, waiting until it is there
    /// (on a stream of its own, so it waits for nothing else running on the GPU). Made once
    /// per prepared request and chunk, not per launch.
    ///
    /// For a region plan (the peer scatters by it), the runs must keep the peer's rules
    /// (kernels/gather_scatter.cu, "Region plans"): every run at least one piece of at least
    /// one byte, pieces read from the data part of the region only, written to memory the peer
    /// proved, and the bytes of all pieces together no more than that data part. The encoder
    /// does not check them; the peer's GPU does, and refuses the whole plan.
    ///
    /// # Errors
    /// [`CudaError::Plan`] when `runs` cannot be encoded (see `plan.rs`), a driver error when
    /// the allocation or the copy fails.
    pub fn upload(gpu: &Arc<Gpu>, runs: &[CopyRun]) -> Result<Self, CudaError> {
        let mut host = vec![0u8; plan_bytes(runs.len())];
        let shape = encode(runs, &mut host)?;
        let mem = alloc_vram(gpu, shape.bytes)?;
        copy_to_device_and_wait(gpu, mem.ptr(), &host[..shape.bytes])?;
        Ok(Self { gpu: gpu.clone(), mem: Some(mem), shape, pool: None })
    }

    /// Device address of the first byte of the plan (its first run).
    pub fn ptr(&self) -> u64 {
        self.mem.as_ref().map_or(0, DeviceAlloc::ptr)
    }

    /// Bytes of the encoded plan: `plan_bytes(shape.nruns)`.
    pub fn len(&self) -> usize {
        self.shape.bytes
    }

    /// Never true: a plan holds at least its tile total.
    pub fn is_empty(&self) -> bool {
        self.shape.bytes == 0
    }

    /// Where the parts of the plan are, and the job's tile count.
    pub fn shape(&self) -> PlanShape {
        self.shape
    }

    /// The GPU it lives on.
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }
}

/// Queues a gather of `plan`'s runs (user pieces) into the region at `region_base` on `ctx`'s
/// stream. Touches none of `ctx`'s plan buffers, so `ctx` need not be idle.
///
/// # Safety
/// - `kernels`, `ctx` and `plan` belong to the same GPU.
/// - `plan` is not dropped until `ctx`'s stream has passed the launch.
/// - The pieces of `plan`'s runs are valid as [`super::gather`] requires: sources readable,
///   `[region_base + region_off, .. + len)` writable memory of this GPU, all of it allocated
///   until the stream has passed the launch, destinations not overlapping each other or a
///   source.
pub unsafe fn gather_planned(
    ctx: &mut ExecContext,
    kernels: &Kernels,
    plan: &DevicePlan,
    region_base: u64,
) -> Result<(), CudaError> {
    // SAFETY: forwarded from the caller's contract.
    unsafe { queue_planned(ctx, kernels, kernels.gather, plan, region_base) }
}

/// Queues a scatter of the region at `region_base` into `plan`'s runs (user pieces) on `ctx`'s
/// stream. For a plan this process made itself (a READ's local side); a plan that came from
/// the peer goes through [`super::scatter_region_plan`], which checks it.
///
/// # Safety
/// As for [`gather_planned`], with the roles swapped: the region is read and the user pieces
/// written.
pub unsafe fn scatter_planned(
    ctx: &mut ExecContext,
    kernels: &Kernels,
    plan: &DevicePlan,
    region_base: u64,
) -> Result<(), CudaError> {
    // SAFETY: forwarded from the caller's contract.
    unsafe { queue_planned(ctx, kernels, kernels.scatter, plan, region_base) }
}

/// # Safety
/// As for [`gather_planned`]; `f` is the gather or the scatter kernel of `kernels`.
unsafe fn queue_planned(
    ctx: &mut ExecContext,
    kernels: &Kernels,
    f: cu::CUfunction,
    plan: &DevicePlan,
    region_base: u64,
) -> Result<(), CudaError> {
    if plan.shape.tiles == 0 {
        return Ok(());
    }
    // SAFETY: `f` is a copy kernel; the plan is `encode`'s output in VRAM that nobody writes
    // after `upload` and that outlives the launch (caller's contract), as do the pieces.
    unsafe { queue_copy_kernel(ctx, kernels, f, &plan.shape, plan.ptr(), region_base) }
}

/// Copies `src` to device address `dst` and waits for the copy only: a temporary non-blocking
/// stream, so neither the legacy default stream (which an application's work may hold) nor the
/// whole context (cuCtxSynchronize would wait for every transfer in flight) is waited for.
fn copy_to_device_and_wait(gpu: &Arc<Gpu>, dst: u64, src: &[u8]) -> Result<(), CudaError> {
    gpu.bind()?;
    let mut stream = std::ptr::null_mut();
    // SAFETY: the context is current; valid out-pointer.
    check("cuStreamCreate", unsafe {
        cu::cuStreamCreate(&mut stream, cu::CUstream_flags::CU_STREAM_NON_BLOCKING as u32)
    })?;
    let copy_and_wait = || {
        // SAFETY: `dst` is device memory of at least `src.len()` bytes (the caller's
        // allocation) and `src` is valid for reads; from pageable memory the driver stages the
        // bytes before the call returns, and the synchronize below waits until they landed.
        check("cuMemcpyHtoDAsync", unsafe { cu::cuMemcpyHtoDAsync_v2(dst, src.as_ptr().cast(), src.len(), stream) })?;
        // SAFETY: the stream made above.
        check("cuStreamSynchronize", unsafe { cu::cuStreamSynchronize(stream) })
    };
    let copied = copy_and_wait();
    // SAFETY: made above; destroyed once. After a failed synchronize the driver still releases
    // it once its work is done.
    let _ = unsafe { cu::cuStreamDestroy_v2(stream) };
    copied
}

// A prepared request may be shared between threads (the reactor and the copy workers): a
// compile-time check that it stays so.
const _: () = {
    const fn shareable<T: Send + Sync>() {}
    shareable::<DevicePlan>();
};
