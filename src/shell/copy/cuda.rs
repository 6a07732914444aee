//! The CUDA copy engine: gathers and scatters between user memory (VRAM) and a VRAM arena with
//! the kernels of `kernels/` (or the driver's batched memcpy), behind the shell's copy seam.
//!
//! `submit` borrows an execution context (a high-priority stream, an event, plan buffers),
//! writes the job's runs into its pinned plan buffer, launches and records the event; with no
//! context free the job waits in a queue. `poll_done` only queries events (cuEventQuery): the
//! reactor spins while copies are in flight, so nothing here ever synchronizes except `Drop`,
//! which waits for every stream before the arena can be freed.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Weak};

use bounce_proto::endpoint::{JobId, JobRuns};
use bounce_proto::plan::Plan;
use bounce_proto::wire::region_plan;

use super::{CopyEngine, CopyJob, Dir};
use crate::sys::cuda::{self, CudaError, DeviceAlloc, DevicePlan, ExecPool, Kernels, PlanPlacement, PlanPool};

/// How the engine copies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CopyPath {
    /// The gather/scatter kernels, reading the plan from `PlanPlacement`.
    Kernel(PlanPlacement),
    /// One cuMemcpyBatchAsync per job (falls back to the kernels where the driver lacks it).
    Batched,
}

/// A job launched on context `ctx`; `ok` is false when its launch failed part-way (the event
/// still tells when the stream is past whatever was queued).
#[derive(Debug)]
struct Running {
    job: JobId,
    ctx: usize,
    ok: bool,
    /// A scatter by a peer's region plan: it succeeded only if the plan passed its check.
    checked: bool,
    /// Device plans the launch reads, kept alive until its event completes.
    _plans: Vec<Arc<DevicePlan>>,
}

/// Device copies of a prepared plan's chunk, for one side of it: its gather runs in the
/// kernels' form and, for a chunk carrying its plan in the region, its scatter runs (the bytes
/// copied behind the data); or, for a READ's local scatter, its scatter runs.
struct CachedChunk {
    owner: Weak<Plan>,
    runs: Arc<DevicePlan>,
    region_plan: Option<Arc<DevicePlan>>,
}

/// Device copies made at a prepared plan's first post and reused by every later post of it: a
/// scattered 32 MiB chunk's ~5,000 runs were encoded and uploaded on the reactor at every
/// launch. An entry dies with its plan (the application released the request); dead entries
/// go at the next upload. Keyed by plan, chunk and side (a WRITE's gather, a READ's scatter).
#[derive(Default)]
struct PlanCache(HashMap<(usize, usize, Dir), CachedChunk>);

impl PlanCache {
    /// The device copies of the `dir` side of chunk `chunk` of `plan`, uploaded on first use.
    fn get(
        &mut self,
        pool: &Arc<PlanPool>,
        plan: &Arc<Plan>,
        chunk: usize,
        dir: Dir,
    ) -> Result<&CachedChunk, CudaError> {
        let key = (Arc::as_ptr(plan) as usize, chunk, dir);
        // A live entry under this address is this plan's (an address is reused only after the
        // plan that held it was dropped, and then its entry's owner is dead).
        let fresh = self.0.get(&key).is_some_and(|c| c.owner.strong_count() > 0);
        if !fresh {
            self.0.retain(|_, c| c.owner.strong_count() > 0);
            let c = plan.chunks.get(chunk).ok_or(CudaError::Plan("chunk beyond its plan"))?;
            let (runs, region_plan) = match dir {
                Dir::Gather => (
                    Arc::new(pool.upload(&c.gather)?),
                    c.region_plan.map(|_| pool.upload(&c.scatter)).transpose()?.map(Arc::new),
                ),
                Dir::Scatter => (Arc::new(pool.upload(&c.scatter)?), None),
            };
            self.0.insert(key, CachedChunk { owner: Arc::downgrade(plan), runs, region_plan });
        }
        self.0.get(&key).ok_or(CudaError::Plan("plan cache entry vanished"))
    }
}

/// The CUDA implementation of [`CopyEngine`] over one VRAM arena.
pub(crate) struct CudaCopyEngine {
    // Declared before `arena`, so dropped first: each context synchronizes its stream on drop,
    // and `Drop` below synchronizes all of them before any field goes.
    pool: ExecPool,
    kernels: Kernels,
    arena: Arc<DeviceAlloc>,
    path: CopyPath,
    running: Vec<Running>,
    waiting: VecDeque<CopyJob>,
    plans: PlanCache,
    /// Device buffers for plans, kept when their plans drop: dropping an entry of `plans`
    /// (its request released) must not cuMemFree on the reactor, which waits for every kernel
    /// on the GPU, the application's included.
    uploads: Arc<PlanPool>,
    /// Refused at validation or launch, reported by the next `poll_done`.
    failed: Vec<JobId>,
    /// A device fault was seen: the context is unusable, new jobs are given back.
    broken: bool,
}

impl CudaCopyEngine {
    /// An engine with `contexts` execution contexts copying into and out of `arena`.
    /// `CopyPath::Batched` on a driver without cuMemcpyBatchAsync falls back to the kernels,
    /// with one log line.
    pub(crate) fn new(arena: Arc<DeviceAlloc>, contexts: usize, path: CopyPath) -> Result<Self, CudaError> {
        let gpu = arena.gpu().clone();
        let kernels = Kernels::load(&gpu)?;
        let path = match path {
            CopyPath::Batched if !gpu.has_batched_copy() => {
                tracing::warn!(
                    driver = gpu.driver_version(),
                    "cuMemcpyBatchAsync unavailable (CUDA >= 12.8 driver needed): copying with the kernels"
                );
                CopyPath::Kernel(PlanPlacement::Device)
            }
            p => p,
        };
        // Plan room for a typical chunk's runs; a context grows its buffers for larger jobs.
        let pool = ExecPool::new(&gpu, contexts, 1024)?;
        let uploads = PlanPool::new(&gpu)?;
        Ok(Self {
            pool,
            kernels,
            arena,
            path,
            running: Vec::new(),
            waiting: VecDeque::new(),
            plans: PlanCache::default(),
            uploads,
            failed: Vec::new(),
            broken: false,
        })
    }

    /// The path in use (after any fallback).
    pub(crate) fn path(&self) -> CopyPath {
        self.path
    }

    /// Launches `job` on the idle context `ctx`.
    fn launch(&mut self, ctx: usize, job: CopyJob) {
        let _span =
            tracing::trace_span!("cuda_launch", job = job.job.0, dir = ?job.dir, runs = job.runs.len()).entered();
        // The reactor's thread serves every arena's engine, and with an arena per GPU
        // (`bounce_arena_gpus`) another GPU's context may be current: streams and the kernels'
        // module are this context's. A no-op (one query) when it is current already.
        if let Err(e) = self.arena.gpu().bind() {
            tracing::warn!(job = job.job.0, error = %e, "cannot make the arena's CUDA context current");
            self.pool.release(ctx);
            self.failed.push(job.job);
            return;
        }
        let mut plans = Vec::new();
        let launched = self.queue(ctx, &job, &mut plans);
        if let Err(e) = &launched {
            tracing::warn!(job = job.job.0, error = %e, "CUDA copy launch failed");
        }
        let c = self.pool.get(ctx);
        match c.record() {
            Ok(()) => self.running.push(Running {
                job: job.job,
                ctx,
                ok: launched.is_ok(),
                checked: job.in_region.is_some(),
                _plans: plans,
            }),
            Err(e) => {
                // Without an event nothing tells when the stream is past this job's queued
                // work: wait for it here (a failure path only) before reusing the context.
                tracing::warn!(job = job.job.0, error = %e, "CUDA event record failed");
                match c.synchronize() {
                    Ok(()) => self.pool.release(ctx),
                    Err(e) => {
                        // Not known to be past the job: the context is never handed out again,
                        // and the engine takes no more jobs (it fails them, as after a fault).
                        tracing::error!(job = job.job.0, error = %e, "CUDA stream wait failed after a failed event record");
                        self.broken = true;
                    }
                }
                self.failed.push(job.job);
            }
        }
    }

    /// Queues `job`'s copies on the idle context `ctx`; `keep` gets the device plans they read.
    fn queue(&mut self, ctx: usize, job: &CopyJob, keep: &mut Vec<Arc<DevicePlan>>) -> Result<(), CudaError> {
        let region_base = self.arena.ptr() + job.region.offset;
        // A prepared chunk's gather (a WRITE's) or scatter (a READ's, into our own memory)
        // reads its device copy, made at its plan's first post.
        let cached = match (&job.runs, job.dir, self.path) {
            (JobRuns::Chunk { plan, chunk }, Dir::Gather, CopyPath::Kernel(_))
            | (JobRuns::ChunkScatter { plan, chunk }, Dir::Scatter, CopyPath::Kernel(_)) => {
                let c = self.plans.get(&self.uploads, plan, *chunk, job.dir)?;
                Some((c.runs.clone(), c.region_plan.clone()))
            }
            _ => None,
        };
        let c = self.pool.get(ctx);
        // SAFETY: `validate` put every run's region span inside the job's region (and a region
        // plan inside it too), and the region inside the arena, which lives until this engine
        // has synchronized (Drop). The user side is memory the application registered (NIXL
        // checked the local descriptors for a gather, and for a READ's local scatter, whose
        // runs, cached or not, are our own plan's; the receiver machine checked every run
        // against this engine's registrations for a scatter by a DATA's runs; a peer's region plan is
        // checked on the device, against the ranges the receiver machine proved, before its
        // scatter writes anything). The core gives each region to one job at a time. User
        // pieces of one job do not overlap, except in a peer's runs, whose checks do not forbid
        // it: there two pieces may write the same bytes of memory the peer proved it may write,
        // which then hold one piece's bytes or the other's, the same outcome as two of its
        // writes racing through UCX (no read of those bytes is part of the copy). `ctx` is idle (taken from the pool, which gets a
        // context back only after its event completed). Device plans stay alive in `keep`
        // until that event.
        unsafe {
            match (&job.in_region, &cached, self.path, job.dir) {
                (Some(p), ..) => cuda::scatter_region_plan(
                    c,
                    &self.kernels,
                    region_base,
                    p.offset,
                    p.runs,
                    p.allowed.starts(),
                    p.allowed.reach(),
                )?,
                (None, Some((g, _)), _, Dir::Gather) => cuda::gather_planned(c, &self.kernels, g, region_base)?,
                (None, Some((s, _)), _, Dir::Scatter) => cuda::scatter_planned(c, &self.kernels, s, region_base)?,
                (None, _, CopyPath::Kernel(p), Dir::Gather) => {
                    cuda::gather(c, &self.kernels, &job.runs, region_base, p)?
                }
                (None, _, CopyPath::Kernel(p), Dir::Scatter) => {
                    cuda::scatter(c, &self.kernels, &job.runs, region_base, p)?;
                }
                (None, _, CopyPath::Batched, Dir::Gather) => {
                    cuda::batched_copy(c, cuda::CopyDir::Gather, &job.runs, region_base)?;
                }
                (None, _, CopyPath::Batched, Dir::Scatter) => {
                    cuda::batched_copy(c, cuda::CopyDir::Scatter, &job.runs, region_base)?;
                }
            }
        }
        let Some((off, scatter)) = job.runs.region_plan().filter(|_| job.dir == Dir::Gather) else {
            keep.extend(cached.map(|(g, _)| g));
            return Ok(());
        };
        // The chunk's scatter plan goes behind its data, where the receiver looks for it:
        // one device-to-device copy of the bytes uploaded at the first post.
        // The gather's plan is kept first: the kernel is queued, so should what follows fail,
        // the plan must still outlive it (else its buffer could be reused for another upload).
        let (gather, cached_region_plan) = cached.map_or((None, None), |(g, rp)| (Some(g), rp));
        keep.extend(gather);
        let region_plan = match cached_region_plan {
            Some(rp) => rp,
            // The batched path keeps no device plans: upload this one for the launch.
            None => Arc::new(self.uploads.upload(scatter)?),
        };
        let len = region_plan::plan_bytes(u32::try_from(scatter.len()).unwrap_or(u32::MAX));
        if region_plan.len() as u64 != len || off.checked_add(len).is_none_or(|end| end > job.region.len) {
            return Err(CudaError::Plan("a region plan that does not fit its region"));
        }
        // SAFETY: `[region_base + off, + len)` lies inside the job's region (checked above),
        // which the core gave to this job alone; the source is the plan's device copy, alive
        // in `keep` until the context's event. `ctx` is idle, as above.
        unsafe { c.copy_d2d(region_base + off, region_plan.ptr(), region_plan.len())? };
        keep.push(region_plan);
        Ok(())
    }

    /// Launches waiting jobs while contexts are free.
    fn start_waiting(&mut self) {
        while !self.waiting.is_empty() {
            let Some(ctx) = self.pool.try_acquire() else { break };
            let job = self.waiting.pop_front().expect("checked non-empty");
            self.launch(ctx, job);
        }
    }
}

/// Checks a job against the arena, as the CPU workers do: the region inside the arena, every
/// run inside the region, no address arithmetic that overflows. False means a core bug.
fn validate(arena_len: u64, job: &CopyJob) -> bool {
    if !job.well_formed() {
        return false;
    }
    let plan_inside = job
        .in_region
        .as_ref()
        .is_none_or(|p| p.offset.checked_add(region_plan::plan_bytes(p.runs)).is_some_and(|end| end <= job.region.len));
    plan_inside
        && job.region.offset.checked_add(job.region.len).is_some_and(|end| end <= arena_len)
        && job
            .runs
            .iter()
            .all(|r| r.region_span().is_some_and(|(_, end)| end <= job.region.len) && r.addr_span().is_some())
}

impl CopyEngine for CudaCopyEngine {
    fn submit(&mut self, job: CopyJob) -> Result<(), CopyJob> {
        if self.broken {
            return Err(job);
        }
        if !validate(self.arena.len() as u64, &job) {
            tracing::error!(job = job.job.0, "copy job outside its arena region refused");
            self.failed.push(job.job);
            return Ok(());
        }
        match self.pool.try_acquire() {
            Some(ctx) if self.waiting.is_empty() => self.launch(ctx, job),
            Some(ctx) => {
                self.pool.release(ctx);
                self.waiting.push_back(job);
                self.start_waiting();
            }
            None => self.waiting.push_back(job),
        }
        Ok(())
    }

    fn prepare_thread(&mut self) -> bool {
        match self.arena.gpu().bind() {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(error = %e, "cannot make the arena's CUDA context current on this thread");
                false
            }
        }
    }

    // `any_thread` stays false: passes on the application's threads were measured no faster
    // for GPU arenas on the H200 (a bounced 16384 x 4 KiB VRAM WRITE 0.58-0.69 ms against
    // 0.55-0.60 without, BENCHMARKS.md session 11): with 16 cores the reactor thread already
    // spins around activity, and the GPU's copies, not the hops, bound the transfer. Beside a
    // host arena (`both`) the host engine's wish carries (`Copiers::any_thread`), and
    // `prepare_thread` makes such a thread fit for this engine.

    fn poll_done(&mut self, out: &mut Vec<(JobId, bool)>) -> usize {
        let before = out.len();
        let _ = self.arena.gpu().bind();
        let mut i = 0;
        while i < self.running.len() {
            let r = &self.running[i];
            match self.pool.get(r.ctx).is_done() {
                Ok(false) => i += 1,
                done => {
                    if let Err(e) = &done {
                        // A fault inside a copy is sticky for the whole CUDA context.
                        tracing::error!(job = r.job.0, error = %e, "CUDA copy failed on the device");
                        self.broken = true;
                    }
                    let r = self.running.swap_remove(i);
                    // A region plan's scatter ran only if the device's check passed; read
                    // before the context (and its verdict) goes back to the pool.
                    let passed = !r.checked || cuda::region_plan_verdict(self.pool.get(r.ctx));
                    if !passed {
                        tracing::warn!(job = r.job.0, "a peer's region plan was refused on the device; nothing copied");
                    }
                    out.push((r.job, r.ok && done.is_ok() && passed));
                    self.pool.release(r.ctx);
                }
            }
        }
        out.extend(self.failed.drain(..).map(|j| (j, false)));
        if self.broken {
            // Jobs not yet launched cannot run any more.
            out.extend(self.waiting.drain(..).map(|j| (j.job, false)));
        } else {
            self.start_waiting();
        }
        out.len() - before
    }

    fn in_flight(&self) -> usize {
        self.running.len() + self.waiting.len() + self.failed.len()
    }
}

impl Drop for CudaCopyEngine {
    fn drop(&mut self) {
        // No copy may still run when the arena (or a user buffer the caller frees after us)
        // goes; jobs not yet reported are abandoned, which the seam allows once nothing runs.
        let _ = self.arena.gpu().bind();
        if let Err(e) = self.pool.synchronize_all() {
            tracing::warn!(error = %e, "synchronizing the CUDA copy streams on shutdown");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sys::cuda::alloc_vram;
    use bounce_proto::endpoint::JobRuns;
    use bounce_proto::{CopyRun, Region};

    fn job(id: u64, dir: Dir, region: Region, runs: Vec<CopyRun>) -> CopyJob {
        CopyJob { job: JobId(id), dir, region, runs: JobRuns::Own(runs), in_region: None }
    }

    #[test]
    fn validation_refuses_regions_and_runs_outside_the_arena() {
        let run = |off, len| CopyRun { region_off: off, addr: 0, len, count: 2, region_stride: 16, addr_stride: 16 };
        let ok = job(1, Dir::Gather, Region { offset: 64, len: 64 }, vec![run(0, 16), run(32, 16)]);
        assert!(validate(128, &ok));
        assert!(!validate(127, &ok), "region past the arena end");
        assert!(
            !validate(1 << 20, &job(2, Dir::Gather, Region { offset: 0, len: 32 }, vec![run(8, 16)])),
            "run past the region"
        );
        let hostile = CopyRun { region_off: 0, addr: u64::MAX, len: 2, count: 1, region_stride: 0, addr_stride: 0 };
        assert!(
            !validate(1 << 20, &job(3, Dir::Scatter, Region { offset: 0, len: 32 }, vec![hostile])),
            "user address overflow"
        );
        assert!(
            !validate(u64::MAX, &job(4, Dir::Gather, Region { offset: u64::MAX, len: 2 }, vec![])),
            "region overflow"
        );
    }

    /// On a GPU: more jobs than contexts (queueing), gathers then scatters back, one refused
    /// job; every job is reported exactly once, with the right outcome and bytes.
    #[test]
    #[cfg_attr(miri, ignore = "loads the CUDA driver (FFI)")]
    fn engine_reports_every_job_once_and_moves_exact_bytes() {
        let Some(gpu) = crate::sys::cuda::gpu_for_test("engine_reports_every_job_once_and_moves_exact_bytes") else {
            return;
        };
        for path in [CopyPath::Kernel(PlanPlacement::Device), CopyPath::Kernel(PlanPlacement::Host), CopyPath::Batched]
        {
            let piece = 4096u64 + 3;
            let n = 64u64; // pieces per job
            let jobs = 12u64;
            let user_len = (2 * piece * n * jobs) as usize;
            let arena = Arc::new(alloc_vram(&gpu, (piece * n * jobs) as usize).unwrap());
            let src = alloc_vram(&gpu, user_len).unwrap();
            let dst = alloc_vram(&gpu, user_len).unwrap();
            let bytes: Vec<u8> = (0..user_len).map(|i| (i * 7 + i / 251) as u8).collect();
            src.write(0, &bytes).unwrap();
            dst.fill(0xEE).unwrap();
            let mut eng = CudaCopyEngine::new(arena.clone(), 3, path).unwrap();
            let region = |j: u64| Region { offset: j * piece * n, len: piece * n };
            let runs = |base: u64, j: u64| {
                vec![CopyRun {
                    region_off: 0,
                    addr: base + j * 2 * piece * n,
                    len: piece,
                    count: n as u32,
                    region_stride: piece,
                    addr_stride: 2 * piece,
                }]
            };
            let mut done = Vec::new();
            let wait_all = |eng: &mut CudaCopyEngine, done: &mut Vec<(JobId, bool)>| {
                while eng.in_flight() > 0 {
                    eng.poll_done(done);
                    std::hint::spin_loop();
                }
            };
            for j in 0..jobs {
                eng.submit(job(j, Dir::Gather, region(j), runs(src.ptr(), j))).unwrap();
            }
            eng.submit(job(99, Dir::Gather, Region { offset: arena.len() as u64, len: 1 }, vec![])).unwrap();
            wait_all(&mut eng, &mut done);
            for j in 0..jobs {
                eng.submit(job(100 + j, Dir::Scatter, region(j), runs(dst.ptr(), j))).unwrap();
            }
            wait_all(&mut eng, &mut done);
            done.sort_by_key(|d| d.0.0);
            let want: Vec<(JobId, bool)> = (0..jobs)
                .map(|j| (JobId(j), true))
                .chain([(JobId(99), false)])
                .chain((0..jobs).map(|j| (JobId(100 + j), true)))
                .collect();
            assert_eq!(done, want, "{path:?}: each job reported once with its outcome");
            let ran = eng.path();
            assert!(ran == path || (path == CopyPath::Batched && !gpu.has_batched_copy()), "{path:?} ran as {ran:?}");
            drop(eng);
            let mut got = vec![0u8; user_len];
            dst.read(0, &mut got).unwrap();
            for (i, (&g, &b)) in got.iter().zip(&bytes).enumerate() {
                // Pieces sit in the first half of each 2 * piece slot; the rest stays poison.
                let want = if (i as u64 % (2 * piece)) < piece { b } else { 0xEE };
                assert_eq!(g, want, "{path:?}: byte {i}");
            }
            println!("engine {path:?} (ran as {ran:?}): {} jobs byte-exact", 2 * jobs);
        }
    }

    /// On a GPU: a READ's local scatter by its prepared plan (`JobRuns::ChunkScatter`) is
    /// exact, uploads the chunk's scatter runs once for all posts of the plan (one cache entry,
    /// the same device copy), and the entry goes with the plan.
    #[test]
    #[cfg_attr(miri, ignore = "loads the CUDA driver (FFI)")]
    fn a_reads_scatter_by_its_prepared_plan_uploads_the_runs_once_and_is_exact() {
        use bounce_proto::plan::{DescPair, PlanParams, plan};
        let Some(gpu) =
            crate::sys::cuda::gpu_for_test("a_reads_scatter_by_its_prepared_plan_uploads_the_runs_once_and_is_exact")
        else {
            return;
        };
        let (piece, n) = (4096u64 + 3, 300u64);
        let arena = Arc::new(alloc_vram(&gpu, (piece * n) as usize).unwrap());
        let dst = alloc_vram(&gpu, (2 * piece * n) as usize).unwrap();
        let bytes: Vec<u8> = (0..piece * n).map(|i| (i * 13 + i / 241) as u8).collect();
        // Destinations every other slot, in reverse order: no two runs merge.
        let descs: Vec<DescPair> =
            (0..n).map(|i| DescPair { src: 0, dst: dst.ptr() + (n - 1 - i) * 2 * piece, len: piece }).collect();
        let p = Arc::new(plan(&descs, PlanParams { align: 1, ..PlanParams::new(piece * n) }).unwrap());
        assert_eq!(p.chunks.len(), 1);
        let mut eng = CudaCopyEngine::new(arena.clone(), 2, CopyPath::Kernel(PlanPlacement::Device)).unwrap();
        let region = Region { offset: 0, len: p.chunks[0].bytes };
        let mut uploaded = None;
        for post in 0..2u64 {
            arena.write(0, &bytes).unwrap();
            dst.fill(0xEE).unwrap();
            let runs = JobRuns::ChunkScatter { plan: p.clone(), chunk: 0 };
            eng.submit(CopyJob { job: JobId(post), dir: Dir::Scatter, region, runs, in_region: None }).unwrap();
            let mut done = Vec::new();
            while eng.in_flight() > 0 {
                eng.poll_done(&mut done);
                std::hint::spin_loop();
            }
            assert_eq!(done, [(JobId(post), true)]);
            let entry = eng.plans.0.get(&(Arc::as_ptr(&p) as usize, 0, Dir::Scatter)).expect("cached");
            let ptr = entry.runs.ptr();
            assert_eq!(*uploaded.get_or_insert(ptr), ptr, "post {post}: the same device copy");
            assert_eq!(eng.plans.0.len(), 1);
            let mut got = vec![0u8; (2 * piece * n) as usize];
            dst.read(0, &mut got).unwrap();
            for (i, &g) in got.iter().enumerate() {
                let (slot, at) = (i as u64 / (2 * piece), i as u64 % (2 * piece));
                let want = if at < piece { bytes[((n - 1 - slot) * piece + at) as usize] } else { 0xEE };
                assert_eq!(g, want, "post {post}: byte {i}");
            }
        }
        drop(p);
        // A dead entry goes at the next upload (of any plan).
        let other = Arc::new(plan(&descs[..1], PlanParams { align: 1, ..PlanParams::new(piece) }).unwrap());
        let entry = eng.plans.get(&eng.uploads, &other, 0, Dir::Scatter).unwrap();
        // Its device buffer was given back to the pool (kept, or serving this upload), not
        // freed on the reactor: cuMemFree waits for every kernel on the GPU.
        let reused = Some(entry.runs.ptr()) == uploaded;
        assert!(reused || eng.uploads.kept() == 1, "the dead plan's buffer was freed");
        assert_eq!(eng.plans.0.len(), 1, "only the live plan's entry is left");
    }
}
