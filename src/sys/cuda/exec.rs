//! Execution contexts: a high-priority stream, a completion event, and the plan buffers of one
//! job in flight (pinned host, plus a device copy). A pool hands them out with `try_acquire` and
//! takes them back with `release`; a context is reused only after its event completed, so its
//! plan buffers are never rewritten under a running launch.

use std::sync::Arc;

use cudarc::driver::sys as cu;

use super::driver::Gpu;
use super::error::{CudaError, check};
use super::memory::{DeviceAlloc, PinnedHost, alloc_vram};
use super::plan::plan_bytes;

/// One stream with its event and plan buffers.
#[derive(Debug)]
pub struct ExecContext {
    gpu: Arc<Gpu>,
    pub(super) stream: cu::CUstream,
    event: cu::CUevent,
    pub(super) plan_host: PinnedHost,
    pub(super) plan_dev: DeviceAlloc,
    /// Per-piece arrays of the batched-memcpy path, kept until the copy is done.
    pub(super) batch: BatchArrays,
    /// Where the last region plan launch copies its verdict (pinned host, made on first use).
    pub(super) verdict: Option<PinnedHost>,
    /// The region limit (P) the last region plan launch checked against.
    pub(super) verdict_limit: u64,
    /// Jobs in a row whose plan fitted [`KEPT_PLAN_BYTES`] while the buffers were larger
    /// (see [`plan_len_for`]).
    small_jobs: u32,
}

/// Plan buffers a context keeps for good: honest chunks of 4 KiB pieces need under 0.5 MiB.
/// A larger job (a DATA may carry up to 2^20 runs: 64 MiB of plan) grows them for itself.
pub(super) const KEPT_PLAN_BYTES: usize = 1 << 20;
/// Jobs in a row that fit [`KEPT_PLAN_BYTES`] after which grown buffers shrink back: a peer
/// sending such DATAs now and then costs one reallocation pair per this many jobs at most,
/// and never holds the memory past them.
pub(super) const SHRINK_AFTER_JOBS: u32 = 64;

/// The length the plan buffers must be reallocated to before a job needing `need` bytes, given
/// their length `len` and the run of small jobs so far (updated), or `None` to keep them.
pub(super) fn plan_len_for(len: usize, need: usize, small_jobs: &mut u32) -> Option<usize> {
    if len < need {
        *small_jobs = 0;
        return Some(need.next_power_of_two());
    }
    if len <= KEPT_PLAN_BYTES || need > KEPT_PLAN_BYTES {
        *small_jobs = 0;
        return None;
    }
    *small_jobs += 1;
    if *small_jobs < SHRINK_AFTER_JOBS {
        return None;
    }
    *small_jobs = 0;
    Some(KEPT_PLAN_BYTES)
}

/// The argument arrays of one cuMemcpyBatchAsync call.
#[derive(Debug, Default)]
pub(super) struct BatchArrays {
    pub dsts: Vec<u64>,
    pub srcs: Vec<u64>,
    pub sizes: Vec<usize>,
}

// SAFETY: stream and event are driver handles usable from any thread with the context current;
// the context is used by one owner at a time (`&mut`).
unsafe impl Send for ExecContext {}

impl ExecContext {
    /// Makes a context whose plan buffers hold `plan_runs` runs (they grow on demand).
    pub fn new(gpu: &Arc<Gpu>, plan_runs: usize) -> Result<Self, CudaError> {
        gpu.bind()?;
        let mut stream = std::ptr::null_mut();
        // SAFETY: current context; valid out-pointer. Non-blocking: no implicit sync with the
        // legacy default stream the application may use.
        check("cuStreamCreateWithPriority", unsafe {
            cu::cuStreamCreateWithPriority(
                &mut stream,
                cu::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
                gpu.high_priority(),
            )
        })?;
        let mut event = std::ptr::null_mut();
        // SAFETY: current context; valid out-pointer. No timing: cheaper record and query.
        let made = check("cuEventCreate", unsafe {
            cu::cuEventCreate(&mut event, cu::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32)
        });
        if let Err(e) = made {
            // SAFETY: created above, unused.
            let _ = unsafe { cu::cuStreamDestroy_v2(stream) };
            return Err(e);
        }
        // Built field by field so that a failure below drops what exists (Drop syncs and
        // destroys the stream and event).
        let bytes = plan_bytes(plan_runs.max(1));
        let plan_host = PinnedHost::new(gpu, bytes);
        let plan_dev = alloc_vram(gpu, bytes);
        match (plan_host, plan_dev) {
            (Ok(plan_host), Ok(plan_dev)) => Ok(Self {
                gpu: gpu.clone(),
                stream,
                event,
                plan_host,
                plan_dev,
                batch: BatchArrays::default(),
                verdict: None,
                verdict_limit: 0,
                small_jobs: 0,
            }),
            (Err(e), _) | (_, Err(e)) => {
                // SAFETY: created above, never used.
                unsafe {
                    let _ = cu::cuEventDestroy_v2(event);
                    let _ = cu::cuStreamDestroy_v2(stream);
                }
                Err(e)
            }
        }
    }

    /// Makes the plan buffers hold `bytes`: grown for a larger job, shrunk back to
    /// [`KEPT_PLAN_BYTES`] after a run of small ones ([`plan_len_for`]). Only while the
    /// context is idle. Both are allocated before either is replaced: a failed allocation
    /// (VRAM taken by the application) leaves the pair as it was, never a host buffer larger
    /// than the device one, which the launches size their copies by.
    pub(super) fn ensure_plan_bytes(&mut self, bytes: usize) -> Result<(), CudaError> {
        let len = self.plan_host.len().min(self.plan_dev.len());
        if let Some(want) = plan_len_for(len, bytes, &mut self.small_jobs) {
            let host = PinnedHost::new(&self.gpu, want)?;
            let dev = alloc_vram(&self.gpu, want)?;
            (self.plan_host, self.plan_dev) = (host, dev);
        }
        Ok(())
    }

    /// The plan buffers' length (the smaller of the two).
    #[cfg(test)]
    pub(super) fn plan_len(&self) -> usize {
        self.plan_host.len().min(self.plan_dev.len())
    }

    /// Records the completion event after the work queued so far on the stream.
    pub fn record(&mut self) -> Result<(), CudaError> {
        // SAFETY: event and stream belong to this (current) context.
        check("cuEventRecord", unsafe { cu::cuEventRecord(self.event, self.stream) })
    }

    /// Whether the work before the last `record` has finished: never blocks (cuEventQuery).
    /// An error is the job's failure (a fault in a kernel, say).
    pub fn is_done(&self) -> Result<bool, CudaError> {
        // SAFETY: a valid event of this context.
        match unsafe { cu::cuEventQuery(self.event) } {
            cu::CUresult::CUDA_SUCCESS => Ok(true),
            cu::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            code => Err(CudaError::Driver { call: "cuEventQuery", code }),
        }
    }

    /// Waits for everything queued on the stream (tear-down and tests only).
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.gpu.bind()?;
        // SAFETY: a valid stream of this context.
        check("cuStreamSynchronize", unsafe { cu::cuStreamSynchronize(self.stream) })
    }

    /// Queues one device-to-device copy of `len` bytes (the bandwidth reference).
    ///
    /// # Safety
    /// `src` and `dst` must be device-accessible ranges of `len` bytes that stay allocated
    /// until the stream has passed this copy, and must not overlap.
    pub unsafe fn copy_d2d(&mut self, dst: u64, src: u64, len: usize) -> Result<(), CudaError> {
        // SAFETY: forwarded from the caller's contract.
        check("cuMemcpyDtoDAsync", unsafe { cu::cuMemcpyDtoDAsync_v2(dst, src, len, self.stream) })
    }

    /// The GPU.
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }
}

impl Drop for ExecContext {
    fn drop(&mut self) {
        // Its own context current: a thread may serve several GPUs' engines (an arena per GPU).
        let _ = self.gpu.bind();
        // Nothing of ours may still run on memory about to be freed (plan buffers, the arena).
        let _ = self.synchronize();
        // SAFETY: created in `new`, destroyed once, after the stream drained.
        unsafe {
            let _ = cu::cuEventDestroy_v2(self.event);
            let _ = cu::cuStreamDestroy_v2(self.stream);
        }
    }
}

/// A fixed set of execution contexts.
#[derive(Debug)]
pub struct ExecPool {
    ctxs: Vec<ExecContext>,
    free: Vec<usize>,
}

impl ExecPool {
    /// `n` contexts (at least one) with plan room for `plan_runs` runs each.
    pub fn new(gpu: &Arc<Gpu>, n: usize, plan_runs: usize) -> Result<Self, CudaError> {
        let ctxs = (0..n.max(1)).map(|_| ExecContext::new(gpu, plan_runs)).collect::<Result<Vec<_>, _>>()?;
        let free = (0..ctxs.len()).rev().collect();
        Ok(Self { ctxs, free })
    }

    /// Takes an idle context, if any.
    pub fn try_acquire(&mut self) -> Option<usize> {
        self.free.pop()
    }

    /// Gives context `i` back; its work must be done (or abandoned after a fault).
    pub fn release(&mut self, i: usize) {
        debug_assert!(!self.free.contains(&i), "context released twice");
        self.free.push(i);
    }

    /// Context `i`.
    pub fn get(&mut self, i: usize) -> &mut ExecContext {
        &mut self.ctxs[i]
    }

    /// Contexts in the pool.
    pub fn len(&self) -> usize {
        self.ctxs.len()
    }

    /// Never true (a pool has at least one context).
    pub fn is_empty(&self) -> bool {
        self.ctxs.is_empty()
    }

    /// Waits for every context's stream.
    pub fn synchronize_all(&self) -> Result<(), CudaError> {
        self.ctxs.iter().try_for_each(ExecContext::synchronize)
    }
}

/// A pair of timing events for measurements (benchmarks), on one context's stream.
#[derive(Debug)]
pub struct GpuTimer {
    gpu: Arc<Gpu>,
    start: cu::CUevent,
    stop: cu::CUevent,
}

impl GpuTimer {
    /// Two timing events.
    pub fn new(gpu: &Arc<Gpu>) -> Result<Self, CudaError> {
        gpu.bind()?;
        let (mut start, mut stop) = (std::ptr::null_mut(), std::ptr::null_mut());
        // SAFETY: current context; valid out-pointers.
        check("cuEventCreate", unsafe { cu::cuEventCreate(&mut start, 0) })?;
        // SAFETY: as above.
        if let Err(e) = check("cuEventCreate", unsafe { cu::cuEventCreate(&mut stop, 0) }) {
            // SAFETY: `start` was created just above in this (current) context and is used by
            // nothing yet.
            let _ = unsafe { cu::cuEventDestroy_v2(start) };
            return Err(e);
        }
        Ok(Self { gpu: gpu.clone(), start, stop })
    }

    /// Records the start on `ctx`'s stream.
    pub fn start(&self, ctx: &ExecContext) -> Result<(), CudaError> {
        // SAFETY: both handles belong to this context.
        check("cuEventRecord", unsafe { cu::cuEventRecord(self.start, ctx.stream) })
    }

    /// Records the stop on `ctx`'s stream, waits for it, and returns the milliseconds between.
    pub fn stop_ms(&self, ctx: &ExecContext) -> Result<f32, CudaError> {
        let mut ms = 0f32;
        // SAFETY: both handles belong to this context; valid out-pointer.
        unsafe {
            check("cuEventRecord", cu::cuEventRecord(self.stop, ctx.stream))?;
            check("cuEventSynchronize", cu::cuEventSynchronize(self.stop))?;
            check("cuEventElapsedTime", cu::cuEventElapsedTime(&mut ms, self.start, self.stop))?;
        }
        Ok(ms)
    }
}

impl Drop for GpuTimer {
    fn drop(&mut self) {
        let _ = self.gpu.bind();
        // SAFETY: created in `new`, destroyed once.
        unsafe {
            let _ = cu::cuEventDestroy_v2(self.start);
            let _ = cu::cuEventDestroy_v2(self.stop);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Grown plan buffers go back to the kept size after a run of small jobs, and only then:
    /// a peer's occasional huge DATA costs one reallocation pair per [`SHRINK_AFTER_JOBS`]
    /// jobs at most, and holds its memory no longer (review 56).
    #[test]
    fn grown_plan_buffers_shrink_back_after_a_run_of_small_jobs() {
        let mut small = 0;
        assert_eq!(plan_len_for(64 << 10, 100, &mut small), None, "fits");
        assert_eq!(plan_len_for(64 << 10, (300 << 10) + 1, &mut small), Some(512 << 10), "grown to a power of two");
        assert_eq!(plan_len_for(512 << 10, 100, &mut small), None, "at most the kept size: kept for good");
        assert_eq!(small, 0);
        let huge = 64 << 20;
        assert_eq!(plan_len_for(1 << 20, huge, &mut small), Some(huge));
        for job in 1..SHRINK_AFTER_JOBS {
            assert_eq!(plan_len_for(huge, 4096, &mut small), None, "small job {job}");
        }
        // A job that needs more than the kept size starts the run again.
        assert_eq!(plan_len_for(huge, KEPT_PLAN_BYTES + 1, &mut small), None);
        for job in 1..SHRINK_AFTER_JOBS {
            assert_eq!(plan_len_for(huge, 4096, &mut small), None, "small job {job} after a large one");
        }
        assert_eq!(plan_len_for(huge, 4096, &mut small), Some(KEPT_PLAN_BYTES), "the run is long enough");
        assert_eq!(small, 0);
        assert_eq!(plan_len_for(KEPT_PLAN_BYTES, KEPT_PLAN_BYTES, &mut small), None, "the kept size fits its own");
    }

    /// The same on a GPU: the context's pinned and device buffers follow the policy.
    #[test]
    #[cfg_attr(miri, ignore = "loads the CUDA driver (FFI)")]
    fn a_contexts_plan_buffers_grow_for_a_large_job_and_shrink_back() {
        let Some(gpu) = crate::sys::cuda::gpu_for_test("a_contexts_plan_buffers_grow_for_a_large_job_and_shrink_back")
        else {
            return;
        };
        let mut ctx = ExecContext::new(&gpu, 1024).unwrap();
        let first = ctx.plan_len();
        ctx.ensure_plan_bytes(8 << 20).unwrap();
        assert_eq!(ctx.plan_len(), 8 << 20);
        for _ in 1..SHRINK_AFTER_JOBS {
            ctx.ensure_plan_bytes(first).unwrap();
        }
        assert_eq!(ctx.plan_len(), 8 << 20);
        ctx.ensure_plan_bytes(first).unwrap();
        assert_eq!(ctx.plan_len(), KEPT_PLAN_BYTES);
    }
}
