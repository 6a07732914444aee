//! The CPU copy engine: worker threads running gathers and scatters with the kernels of
//! [`super::kernels`], off the reactor thread. Workers never see protocol state: they get a
//! [`CopyJob`] and report `(JobId, ok)`; each report also wakes the reactor through a callback.
//!
//! A small job (at most [`INLINE_MAX_BYTES`]) runs at once on the submitting thread instead:
//! handing a few KiB to a worker costs two thread wake-ups, tens of microseconds on a loaded
//! host, against a copy of a few microseconds (issue 12: a bounced 256 x 64 B WRITE spent more
//! in its gather's and scatter's hand-offs than in the copies).
//!
//! On a host with cores to spare a worker that finished a job keeps looking for the next one
//! (yielding) for a while before it blocks ([`CpuEngine::start`]'s `linger`), as the reactor
//! spins around activity: waking a blocked worker took 40-60 us between the chunks of a
//! transfer on the 16-core H200 host, and up to 256 us after a pause (BENCHMARKS.md, session
//! 19), and a transfer's chunks come a few hundred microseconds apart.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use bounce_proto::endpoint::{InRegionPlan, JobId};
use bounce_proto::wire::region_plan::{self, RegionPlanFault};
use bounce_proto::{CopyRun, Region};
use crossbeam_channel::{Receiver, Sender, TryRecvError};

use super::kernels;
use super::{CopyEngine, CopyJob, Dir};
use crate::shell::stats::Stats;
use crate::shell::{Error, Result};

/// The host arena a CPU engine copies into and out of.
#[derive(Debug, Clone, Copy)]
pub(crate) struct HostArena {
    /// Base address.
    pub(crate) base: u64,
    /// Length.
    pub(crate) len: u64,
    /// Scatter with streaming (non-temporal) stores.
    pub(crate) streaming_scatter: bool,
}

impl HostArena {
    /// Copies `bytes` into the arena at byte `offset` (a mailbox record); false, copying
    /// nothing, when they would leave the arena.
    pub(crate) fn put(&self, offset: u64, bytes: &[u8]) -> bool {
        if offset.checked_add(bytes.len() as u64).is_none_or(|end| end > self.len) {
            return false;
        }
        // SAFETY: `[base + offset, + len)` lies inside the mapped arena (checked above), which
        // outlives every engine that holds this value; `bytes` is a distinct Rust buffer. A
        // peer's RDMA READ may read these bytes meanwhile: a torn record fails its MAC there
        // and is read again.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), (self.base + offset) as *mut u8, bytes.len()) };
        true
    }

    /// Copies `len` bytes at byte `offset` out of the arena (a finished fetch); `None` when
    /// they would leave the arena.
    pub(crate) fn get(&self, offset: u64, len: u64) -> Option<Vec<u8>> {
        offset.checked_add(len).filter(|&end| end <= self.len)?;
        let mut out = vec![0; usize::try_from(len).ok()?];
        // SAFETY: inside the mapped arena (checked above), which outlives this call; the READ
        // that filled these bytes has completed, and no other job targets the fetch area.
        unsafe { std::ptr::copy_nonoverlapping((self.base + offset) as *const u8, out.as_mut_ptr(), out.len()) };
        Some(out)
    }
}

/// Largest job (bytes moved) run on the submitting thread rather than a worker: a copy of
/// this size takes a few microseconds, about what waking a worker costs on an idle host.
pub(crate) const INLINE_MAX_BYTES: u64 = 64 << 10;

/// A pool of copy threads.
pub(crate) struct CpuEngine {
    tx: Option<Sender<CopyJob>>,
    done: Receiver<(JobId, bool)>,
    /// Jobs run on the submitting thread, not yet reported.
    ran: Vec<(JobId, bool)>,
    arena: HostArena,
    /// Largest job run on the submitting thread ([`INLINE_MAX_BYTES`]; 0 for none).
    inline_max: u64,
    in_flight: Arc<AtomicUsize>,
    threads: Vec<JoinHandle<()>>,
    /// The engine's counters (`scatter_streamed_bytes`).
    stats: Arc<Stats>,
}

impl CpuEngine {
    /// Starts `n` workers (at least one) copying within `arena`; jobs of at most `inline_max`
    /// bytes run on the submitting thread instead. `wake` runs after each worker's job finishes
    /// (its report is then ready for [`CopyEngine::poll_done`]); a job run on the submitting
    /// thread is ready when `submit` returns, and wakes nobody. An idle worker looks for its
    /// next job, yielding, for `linger` after its last one before it blocks (see the module
    /// docs; zero on a host with few cores, where the application and the reactor need them).
    /// Every job adds the bytes it wrote with streaming stores to `stats.scatter_streamed_bytes`.
    ///
    /// # Errors
    /// [`Error::Spawn`] when a worker thread cannot be started.
    pub(crate) fn start(
        n: u32,
        arena: HostArena,
        inline_max: u64,
        linger: Duration,
        stats: Arc<Stats>,
        wake: impl Fn() + Send + Clone + 'static,
    ) -> Result<Self> {
        let (tx, rx): (Sender<CopyJob>, Receiver<CopyJob>) = crossbeam_channel::unbounded();
        let (done_tx, done) = crossbeam_channel::unbounded();
        let mut engine = Self {
            tx: Some(tx),
            done,
            ran: Vec::new(),
            arena,
            inline_max,
            in_flight: Arc::new(AtomicUsize::new(0)),
            threads: Vec::new(),
            stats,
        };
        for i in 0..n.max(1) {
            let (rx, done_tx, wake, stats) = (rx.clone(), done_tx.clone(), wake.clone(), Arc::clone(&engine.stats));
            let worker = std::thread::Builder::new().name(format!("bounce-copy-{i}")).spawn(move || {
                while let Some(job) = next_job(&rx, linger) {
                    crate::shell::mark!("worker-start", job.job.0);
                    let span = match job.dir {
                        Dir::Gather => tracing::trace_span!("gather", job = job.job.0, runs = job.runs.len()),
                        Dir::Scatter => tracing::trace_span!("scatter", job = job.job.0, runs = job.runs.len()),
                    };
                    let ok = run_guarded(arena, &job, &span, &stats);
                    crate::shell::mark!("worker-end", job.job.0);
                    let _ = done_tx.send((job.job, ok));
                    wake();
                }
            });
            match worker {
                Ok(t) => engine.threads.push(t),
                // Dropping `engine` joins the workers already started.
                Err(source) => return Err(Error::Spawn { what: "copy worker", source }),
            }
        }
        Ok(engine)
    }
}

impl CopyEngine for CpuEngine {
    fn submit(&mut self, job: CopyJob) -> std::result::Result<(), CopyJob> {
        let Some(tx) = &self.tx else { return Err(job) };
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        if job_bytes(&job) <= self.inline_max {
            let span = match job.dir {
                Dir::Gather => tracing::trace_span!("gather", job = job.job.0, runs = job.runs.len(), inline = true),
                Dir::Scatter => tracing::trace_span!("scatter", job = job.job.0, runs = job.runs.len(), inline = true),
            };
            let ok = run_guarded(self.arena, &job, &span, &self.stats);
            self.ran.push((job.job, ok));
            return Ok(());
        }
        tx.send(job).map_err(|e| {
            self.in_flight.fetch_sub(1, Ordering::Relaxed);
            e.into_inner()
        })
    }

    fn poll_done(&mut self, out: &mut Vec<(JobId, bool)>) -> usize {
        let before = out.len();
        out.append(&mut self.ran);
        out.extend(self.done.try_iter());
        let n = out.len() - before;
        self.in_flight.fetch_sub(n, Ordering::Relaxed);
        n
    }

    fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Relaxed)
    }

    fn put(&mut self, region: Region, bytes: &[u8]) -> bool {
        bytes.len() as u64 <= region.len && self.arena.put(region.offset, bytes)
    }

    fn gather_inline(&mut self, runs: &[CopyRun], len: u64) -> Option<Vec<u8>> {
        let within = |r: &CopyRun| r.region_span().is_some_and(|(_, end)| end <= len) && r.addr_span().is_some();
        if !runs.iter().all(within) {
            return None;
        }
        let mut out = vec![0u8; usize::try_from(len).ok()?];
        for r in runs {
            for (off, addr, n) in r.copies() {
                // SAFETY: `[off, off + n)` lies inside `out` (every run's region span is within
                // `len`, checked above). The source is local user memory NIXL validated against
                // this agent's registrations before prepXfer, as for any gather; it is not ours,
                // so it cannot overlap `out`.
                unsafe { kernels::copy_cached(addr as *const u8, out.as_mut_ptr().add(off as usize), n as usize) };
            }
        }
        Some(out)
    }

    fn take_finished_inline(&mut self, out: &mut Vec<(JobId, bool)>) -> usize {
        let n = self.ran.len();
        out.append(&mut self.ran);
        self.in_flight.fetch_sub(n, Ordering::Relaxed);
        n
    }

    fn any_thread(&self) -> bool {
        true
    }
}

impl Drop for CpuEngine {
    fn drop(&mut self) {
        self.tx = None; // closes the channel: workers finish queued jobs and exit
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// A worker's next job: looked for (yielding) for `linger` after the last one, then waited
/// for; `None` once the engine is gone. The copy workers of the bounce path and of the
/// same-host path for host memory (`shell::cma`) alike.
pub(crate) fn next_job<T>(rx: &Receiver<T>, linger: Duration) -> Option<T> {
    let idle = Instant::now();
    loop {
        match rx.try_recv() {
            Ok(job) => return Some(job),
            Err(TryRecvError::Disconnected) => return None,
            Err(TryRecvError::Empty) if idle.elapsed() < linger => std::thread::yield_now(),
            Err(TryRecvError::Empty) => return rx.recv().ok(),
        }
    }
}

/// Bytes a job moves: its runs', or its region's for a plan still in the region (unknown
/// before the check, and at most the region).
fn job_bytes(job: &CopyJob) -> u64 {
    if job.in_region.is_some() {
        return job.region.len;
    }
    job.runs.iter().try_fold(0u64, |sum, r| sum.checked_add(r.bytes()?)).unwrap_or(u64::MAX)
}

/// [`run`] inside `span`, its streamed bytes counted; a panicking job (a bug) reports failure
/// instead of killing its thread (a worker, or the reactor for a job run inline) and leaving
/// the transfer to its timeout.
fn run_guarded(arena: HostArena, job: &CopyJob, span: &tracing::Span, stats: &Stats) -> bool {
    let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| span.in_scope(|| run(arena, job))));
    if ran.is_err() && arena.streaming_scatter {
        // A panic skips the job's own fence: no completion may overtake its streaming stores,
        // even a failed one.
        kernels::fence();
    }
    match ran {
        Ok(Some(streamed)) => {
            if streamed > 0 {
                stats.scatter_streamed_bytes.fetch_add(streamed, Ordering::Relaxed);
            }
            true
        }
        _ => false,
    }
}

/// Checks a job's arena side, then copies; the bytes written with streaming stores. `None`
/// when the job would leave its region (the core never produces such a job; this is defense
/// in depth against a core bug), or when the plan a peer left in the region fails its check
/// (then nothing is copied).
fn run(arena: HostArena, job: &CopyJob) -> Option<u64> {
    if job.region.end() > arena.len || !job.well_formed() {
        return None;
    }
    let checked;
    let runs: &[CopyRun] = match &job.in_region {
        None => &job.runs,
        Some(plan) => match scatter_plan(arena, job.region, plan) {
            Ok(runs) => {
                checked = runs;
                &checked
            }
            Err(e) => {
                tracing::warn!(job = job.job.0, error = %e, "a peer's region plan was refused; nothing copied");
                return None;
            }
        },
    };
    let streamed = copy_runs(arena, job, runs)?;
    match job.runs.region_plan() {
        Some((off, scatter)) if job.dir == Dir::Gather => {
            write_plan(arena, job.region, off, scatter).then_some(streamed)
        }
        _ => Some(streamed),
    }
}

/// The runs of a peer's plan in `region`: copied out of the arena first (the peer can still
/// write there), then checked, so the runs used are exactly the runs checked.
fn scatter_plan(
    arena: HostArena,
    region: Region,
    plan: &InRegionPlan,
) -> std::result::Result<Vec<CopyRun>, RegionPlanFault> {
    let misplaced = RegionPlanFault::Misplaced { runs: plan.runs };
    let len = region_plan::plan_bytes(plan.runs);
    if plan.offset.checked_add(len).is_none_or(|end| end > region.len) {
        return Err(misplaced);
    }
    let bytes = arena.get(region.offset + plan.offset, len).ok_or(misplaced)?;
    region_plan::check(&bytes, plan.runs, plan.offset, |a, b| plan.allowed.covers(a, b))
}

/// Encodes chunk runs `scatter` into `region` at `off`, behind the gathered data.
fn write_plan(arena: HostArena, region: Region, off: u64, scatter: &[CopyRun]) -> bool {
    let Some(bytes) = region_plan::encoded(scatter) else { return false };
    off.checked_add(bytes.len() as u64).is_some_and(|end| end <= region.len) && arena.put(region.offset + off, &bytes)
}

/// Copies `runs` of `job` after checking their arena side; the bytes written with streaming
/// stores, `None` (nothing copied) when a run leaves the region.
fn copy_runs(arena: HostArena, job: &CopyJob, runs: &[CopyRun]) -> Option<u64> {
    for r in runs {
        match r.region_span() {
            Some((_, end)) if end <= job.region.len => {}
            _ => return None,
        }
        r.addr_span()?;
    }
    let mut streamed = 0u64;
    let region_base = arena.base + job.region.offset;
    let streaming = job.dir == Dir::Scatter && arena.streaming_scatter;
    let gather = job.dir == Dir::Gather;
    let mut copies = runs.iter().flat_map(CopyRun::copies).peekable();
    while let Some((off, addr, len)) = copies.next() {
        if gather {
            // The next piece's first lines are asked for while this one is copied: a gather's
            // pieces lie anywhere in the application's memory, and each one's first misses
            // otherwise wait for memory one after the other before the hardware prefetcher
            // takes up the page. A gather of 1024 random 4 KiB pieces took 15-19% less on the
            // 2-core machine, caches warm or cold (`benches/gather_prefetch.c`, BENCHMARKS.md
            // "Session 53").
            if let Some(&(_, next, next_len)) = copies.peek() {
                kernels::prefetch(next as *const u8, next_len as usize);
            }
        }
        let arena_ptr = (region_base + off) as *mut u8;
        let user_ptr = addr as *mut u8;
        let len = len as usize;
        // SAFETY: the arena side lies inside the mapped arena (checked above: region inside
        // the arena, every run's span inside the region). The user side is memory the
        // application registered: for a gather, NIXL validated the local descriptors
        // against this agent's registrations before calling prepXfer; for a scatter, the
        // receiver machine checked every run against the registrations made through this
        // engine before emitting the job, or (a region plan) `scatter_plan` checked the
        // runs against the ranges the receiver machine gave, and these are those runs. Arena
        // and user memory never overlap (the arena is our private mapping), and the core hands
        // each region to one job at a time.
        unsafe {
            match job.dir {
                Dir::Gather => kernels::copy_cached(user_ptr, arena_ptr, len),
                Dir::Scatter if streaming => streamed += kernels::copy_streaming(arena_ptr, user_ptr, len) as u64,
                Dir::Scatter => kernels::copy_cached(arena_ptr, user_ptr, len),
            }
        }
    }
    if streaming {
        // The completion this job reports next must not overtake its streaming stores.
        kernels::fence();
    }
    Some(streamed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use bounce_proto::endpoint::{JobId, JobRuns};
    use bounce_proto::plan::{self, DescPair, PlanParams};
    use bounce_proto::proof::Registrations;
    use bounce_proto::{RegId, RegKey};
    use std::sync::{Arc, mpsc};

    #[test]
    fn gather_then_scatter_moves_exact_bytes_and_refuses_escapes() {
        let mut arena = vec![0u8; 4096];
        let view = HostArena { base: arena.as_mut_ptr() as u64, len: 4096, streaming_scatter: true };
        let src: Vec<u8> = (0..64u8).collect();
        let mut dst = vec![0xEEu8; 128];
        let (tx, rx) = mpsc::channel();
        let stats = Arc::new(Stats::default());
        let mut w =
            CpuEngine::start(2, view, 0, Duration::ZERO, Arc::clone(&stats), move || tx.send(()).unwrap()).unwrap();
        let wait_one = |w: &mut CpuEngine| {
            rx.recv().unwrap();
            let mut done = Vec::new();
            assert_eq!(w.poll_done(&mut done), 1);
            done[0]
        };
        let region = Region { offset: 1024, len: 1024 };
        // two strided pieces of 16 bytes from src into the region
        let g =
            CopyRun { region_off: 0, addr: src.as_ptr() as u64, len: 16, count: 2, region_stride: 16, addr_stride: 32 };
        assert!(
            w.submit(CopyJob { job: JobId(1), dir: Dir::Gather, region, runs: JobRuns::Own(vec![g]), in_region: None })
                .is_ok()
        );
        assert_eq!(w.in_flight(), 1);
        assert_eq!(wait_one(&mut w), (JobId(1), true));
        assert_eq!(w.in_flight(), 0);
        let s = CopyRun {
            region_off: 0,
            addr: dst.as_mut_ptr() as u64 + 8,
            len: 32,
            count: 1,
            region_stride: 0,
            addr_stride: 0,
        };
        assert!(
            w.submit(CopyJob {
                job: JobId(2),
                dir: Dir::Scatter,
                region,
                runs: JobRuns::Own(vec![s]),
                in_region: None
            })
            .is_ok()
        );
        assert_eq!(wait_one(&mut w), (JobId(2), true));
        drop(w);
        assert!(dst[..8].iter().all(|&b| b == 0xEE));
        assert_eq!(&dst[8..24], &src[0..16]);
        assert_eq!(&dst[24..40], &src[32..48]);
        assert!(dst[40..].iter().all(|&b| b == 0xEE));
        // 32 bytes are below what the streaming kernel streams
        assert_eq!(stats.scatter_streamed_bytes.load(Ordering::Relaxed), 0);
        // a run past its region, and a region past the arena, are refused without copying
        let bad = CopyRun { region_off: 1000, len: 100, ..s };
        assert!(
            run(
                view,
                &CopyJob { job: JobId(3), dir: Dir::Scatter, region, runs: JobRuns::Own(vec![bad]), in_region: None }
            )
            .is_none()
        );
        let outside = Region { offset: 4000, len: 1024 };
        assert!(
            run(
                view,
                &CopyJob {
                    job: JobId(4),
                    dir: Dir::Scatter,
                    region: outside,
                    runs: JobRuns::Own(vec![]),
                    in_region: None
                }
            )
            .is_none()
        );
    }

    /// `stats.scatter_streamed_bytes` counts what a scatter wrote with streaming stores: the
    /// whole lines of each piece with `bounce_streaming_scatter` on (x86-64), nothing with it
    /// off, and never a gather's bytes.
    #[test]
    fn a_streaming_scatter_counts_the_lines_it_streamed() {
        let mut arena = vec![0u8; 1 << 14];
        let src: Vec<u8> = (0..4104u32).map(|i| (i * 7) as u8).collect();
        for streaming in [false, true] {
            let view = HostArena { base: arena.as_mut_ptr() as u64, len: 1 << 14, streaming_scatter: streaming };
            let stats = Stats::default();
            let region = Region { offset: 4096, len: 8192 };
            let span = tracing::Span::none();
            let mut dst = vec![0u8; 4200];
            let piece =
                |addr: u64| CopyRun { region_off: 0, addr, len: 4104, count: 1, region_stride: 0, addr_stride: 0 };
            let gather = CopyJob {
                job: JobId(1),
                dir: Dir::Gather,
                region,
                runs: JobRuns::Own(vec![piece(src.as_ptr() as u64)]),
                in_region: None,
            };
            assert!(run_guarded(view, &gather, &span, &stats));
            assert_eq!(stats.scatter_streamed_bytes.load(Ordering::Relaxed), 0, "a gather streams nothing");
            // an odd destination: a partial line at either end goes through ordinary stores
            let scatter = CopyJob {
                job: JobId(2),
                dir: Dir::Scatter,
                region,
                runs: JobRuns::Own(vec![piece(dst.as_mut_ptr() as u64 + 5)]),
                in_region: None,
            };
            assert!(run_guarded(view, &scatter, &span, &stats));
            assert_eq!(&dst[5..4109], &src[..]);
            let streamed = stats.scatter_streamed_bytes.load(Ordering::Relaxed);
            if streaming && cfg!(target_arch = "x86_64") {
                assert!(streamed % 64 == 0 && (4104 - 127..=4104).contains(&streamed), "{streamed}");
            } else {
                assert_eq!(streamed, 0);
            }
        }
    }

    /// A worker lingering after its job (a 60 s linger here) takes the jobs submitted while it
    /// looks, each copied and reported once, and ends as soon as the engine goes, not when its
    /// linger runs out.
    #[test]
    fn a_lingering_worker_takes_the_next_jobs_and_ends_with_the_engine() {
        let mut arena = vec![0u8; 1 << 16];
        let view = HostArena { base: arena.as_mut_ptr() as u64, len: 1 << 16, streaming_scatter: false };
        let src: Vec<u8> = (0..3 * 4096u32).map(|i| (i * 7 + 1) as u8).collect();
        let (tx, rx) = mpsc::channel();
        let mut w = CpuEngine::start(1, view, 0, Duration::from_secs(60), Arc::default(), move || tx.send(()).unwrap())
            .unwrap();
        for j in 0..3u64 {
            let run = CopyRun {
                region_off: 0,
                addr: src.as_ptr() as u64 + j * 4096,
                len: 4096,
                count: 1,
                region_stride: 0,
                addr_stride: 0,
            };
            let region = Region { offset: j * 4096, len: 4096 };
            let job =
                CopyJob { job: JobId(j), dir: Dir::Gather, region, runs: JobRuns::Own(vec![run]), in_region: None };
            assert!(w.submit(job).is_ok());
            rx.recv().unwrap();
            let mut done = Vec::new();
            assert_eq!(w.poll_done(&mut done), 1);
            assert_eq!(done, [(JobId(j), true)]);
        }
        assert_eq!(&arena[..src.len()], &src[..]);
        let t = Instant::now();
        drop(w);
        assert!(t.elapsed() < Duration::from_secs(10), "the worker outlived its engine for {:?}", t.elapsed());
    }

    /// A job of at most the inline bound is copied before `submit` returns and reported by the
    /// next `poll_done` without waking anyone; a larger one goes to a worker, which wakes.
    #[test]
    fn small_jobs_run_on_the_submitting_thread_and_large_ones_on_a_worker() {
        const BOUND: u64 = 4096;
        let mut arena = vec![0u8; 1 << 16];
        let view = HostArena { base: arena.as_mut_ptr() as u64, len: 1 << 16, streaming_scatter: false };
        let src: Vec<u8> = (0..8192u32).map(|i| (i * 13 + 5) as u8).collect();
        let (tx, rx) = mpsc::channel();
        let mut w =
            CpuEngine::start(1, view, BOUND, Duration::from_millis(1), Arc::default(), move || tx.send(()).unwrap())
                .unwrap();
        let gather = |job, len| CopyJob {
            job: JobId(job),
            dir: Dir::Gather,
            region: Region { offset: 0, len: 8192 },
            runs: JobRuns::Own(vec![CopyRun {
                region_off: 0,
                addr: src.as_ptr() as u64,
                len,
                count: 1,
                region_stride: 0,
                addr_stride: 0,
            }]),
            in_region: None,
        };
        assert!(w.submit(gather(1, BOUND)).is_ok());
        assert_eq!(w.in_flight(), 1);
        assert_eq!(&arena[..BOUND as usize], &src[..BOUND as usize], "copied before submit returned");
        let mut done = Vec::new();
        assert_eq!(w.poll_done(&mut done), 1);
        assert_eq!((done[0], w.in_flight()), ((JobId(1), true), 0));
        assert!(rx.try_recv().is_err(), "an inline job wakes nobody");
        assert!(w.submit(gather(2, BOUND + 1)).is_ok());
        rx.recv().unwrap();
        done.clear();
        // A worker's job is not one that finished inside submit: only poll_done reports it.
        assert_eq!(w.take_finished_inline(&mut done), 0);
        assert_eq!(w.poll_done(&mut done), 1);
        assert_eq!(done[0], (JobId(2), true));
        assert_eq!(&arena[..BOUND as usize + 1], &src[..BOUND as usize + 1]);
        // An inline job taken at once is reported once: poll_done does not report it again.
        done.clear();
        assert!(w.submit(gather(3, BOUND)).is_ok());
        assert_eq!(w.take_finished_inline(&mut done), 1);
        assert_eq!((done[0], w.in_flight()), ((JobId(3), true), 0));
        assert_eq!((w.take_finished_inline(&mut done), w.poll_done(&mut done)), (0, 0));
    }

    /// A gather of a chunk with a region plan writes the plan behind the data; the scatter by
    /// that plan, checked against the destination's registration, puts every byte in place;
    /// a plan that writes one byte outside the registration, or one the peer rewrote into a
    /// forgery, copies nothing.
    #[test]
    fn a_region_plan_is_gathered_behind_the_data_and_checked_before_its_scatter() {
        const ARENA: usize = 1 << 16;
        let mut arena = vec![0u8; ARENA];
        let view = HostArena { base: arena.as_mut_ptr() as u64, len: ARENA as u64, streaming_scatter: false };
        let src: Vec<u8> = (0..4096u32).map(|i| (i * 7 + 3) as u8).collect();
        let mut dst = vec![0xEEu8; 8192];
        let dst_base = dst.as_mut_ptr() as u64;
        // 32 scattered pieces of 64 bytes: destinations 200 bytes apart, in reverse order.
        let descs: Vec<DescPair> = (0..32u64)
            .map(|i| DescPair { src: src.as_ptr() as u64 + i * 64, dst: dst_base + (31 - i) * 200, len: 64 })
            .collect();
        let params = PlanParams { region_plan_runs: 4, ..PlanParams::new(1 << 15) };
        let p = Arc::new(plan::plan(&descs, params).unwrap());
        let off = p.chunks[0].region_plan.expect("32 runs carry their plan");
        let region = Region { offset: 4096, len: p.chunks[0].bytes };
        let gather = CopyJob {
            job: JobId(1),
            dir: Dir::Gather,
            region,
            runs: JobRuns::Chunk { plan: p.clone(), chunk: 0 },
            in_region: None,
        };
        assert!(run(view, &gather).is_some());
        // A job naming a chunk its plan lacks, or a gather by a plan in its region, copies
        // nothing and fails (an empty copy must not read as done).
        let job = |dir, runs, in_region| CopyJob { job: JobId(3), dir, region, runs, in_region };
        for bad in [
            job(Dir::Gather, JobRuns::Chunk { plan: p.clone(), chunk: 9 }, None),
            job(Dir::Scatter, JobRuns::ChunkScatter { plan: p.clone(), chunk: 9 }, None),
            job(
                Dir::Gather,
                JobRuns::Own(Vec::new()),
                Some(InRegionPlan { offset: off, runs: 1, allowed: Default::default() }),
            ),
        ] {
            assert!(run(view, &bad).is_none(), "{:?}", bad.runs.names_a_missing_chunk());
        }
        let mut regs = Registrations::default();
        regs.add(RegId(1), RegKey([1; 32]), (dst_base, 8192), bounce_proto::ArenaId(0));
        regs.add(RegId(2), RegKey([2; 32]), (dst_base + 8192, 8192), bounce_proto::ArenaId(0));
        let runs = p.chunks[0].scatter.len() as u32;
        let scatter = |allowed| CopyJob {
            job: JobId(2),
            dir: Dir::Scatter,
            region,
            runs: JobRuns::Own(Vec::new()),
            in_region: Some(InRegionPlan { offset: off, runs, allowed }),
        };
        // Only the second registration proved: every run falls outside it, nothing is copied.
        assert!(run(view, &scatter(regs.proven_ranges(&[RegId(2)]))).is_none());
        assert!(dst.iter().all(|&b| b == 0xEE));
        // A forged first run, one byte past the first registration: nothing is copied.
        let at = (region.offset + off) as usize;
        arena[at + 8..at + 16].copy_from_slice(&(dst_base + 8192 - 63).to_le_bytes());
        assert!(run(view, &scatter(regs.proven_ranges(&[RegId(1)]))).is_none());
        assert!(dst.iter().all(|&b| b == 0xEE));
        // Restored (its `addr` field), the plan scatters every piece and nothing else.
        let addr = p.chunks[0].scatter[0].addr;
        arena[at + 8..at + 16].copy_from_slice(&addr.to_le_bytes());
        assert!(run(view, &scatter(regs.proven_ranges(&[RegId(1)]))).is_some());
        for i in 0..32usize {
            let d = (31 - i) * 200;
            assert_eq!(&dst[d..d + 64], &src[i * 64..i * 64 + 64], "piece {i}");
            assert!(dst[d + 64..d + 200].iter().all(|&b| b == 0xEE), "bytes after piece {i}");
        }
        assert!(dst[32 * 200..].iter().all(|&b| b == 0xEE));
    }
}
