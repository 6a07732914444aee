//! Copy workers: gather (user memory -> arena region) and scatter (arena region -> user memory)
//! with the kernels of [`super::copy`], off the reactor thread. Workers never see protocol state: they get a
//! [`CopyJob`] and report `(JobId, ok)`.

use std::thread::JoinHandle;

use bounce_proto::endpoint::JobId;

use super::copy;
use bounce_proto::{CopyRun, Region};
use crossbeam_channel::{Receiver, Sender};

/// Which way a job copies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Dir {
    /// User addresses -> arena region.
    Gather,
    /// Arena region -> user addresses.
    Scatter,
}

/// One gather or scatter.
#[derive(Debug)]
pub(super) struct CopyJob {
    /// Reported back on completion.
    pub job: JobId,
    /// Direction.
    pub dir: Dir,
    /// The arena region (offsets relative to the arena base).
    pub region: Region,
    /// The copies; `region_off` is relative to `region.offset`.
    pub runs: Vec<CopyRun>,
}

/// Where the arena lives, for the workers.
#[derive(Debug, Clone, Copy)]
pub(super) struct ArenaView {
    /// Base address.
    pub base: u64,
    /// Length.
    pub len: u64,
    /// Scatter with streaming (non-temporal) stores.
    pub streaming_scatter: bool,
}

/// A pool of copy threads.
pub(super) struct Workers {
    tx: Option<Sender<CopyJob>>,
    threads: Vec<JoinHandle<()>>,
}

impl Workers {
    /// Starts `n` workers copying within `arena`; each completion goes to `done`.
    pub(super) fn start(n: u32, arena: ArenaView, done: impl Fn(JobId, bool) + Send + Clone + 'static) -> Self {
        let (tx, rx): (Sender<CopyJob>, Receiver<CopyJob>) = crossbeam_channel::unbounded();
        let threads = (0..n.max(1))
            .map(|i| {
                let rx = rx.clone();
                let done = done.clone();
                std::thread::Builder::new()
                    .name(format!("bounce-copy-{i}"))
                    .spawn(move || {
                        for job in rx {
                            let span = match job.dir {
                                Dir::Gather => tracing::trace_span!("gather", job = job.job.0, runs = job.runs.len()),
                                Dir::Scatter => tracing::trace_span!("scatter", job = job.job.0, runs = job.runs.len()),
                            };
                            // A panicking job (a bug) reports failure instead of killing the
                            // worker and leaving the job's transfer to its timeout.
                            let ok = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                                span.in_scope(|| run(arena, &job))
                            }))
                            .unwrap_or(false);
                            done(job.job, ok);
                        }
                    })
                    .expect("spawning a copy worker")
            })
            .collect();
        Self { tx: Some(tx), threads }
    }

    /// Queues a job.
    pub(super) fn submit(&self, job: CopyJob) -> bool {
        self.tx.as_ref().is_some_and(|tx| tx.send(job).is_ok())
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        self.tx = None; // closes the channel: workers finish queued jobs and exit
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Checks a job's arena side, then copies. False when the job would leave its region (the
/// core never produces such a job; this is defense in depth against a core bug).
fn run(arena: ArenaView, job: &CopyJob) -> bool {
    if job.region.end() > arena.len {
        return false;
    }
    for r in &job.runs {
        match r.region_span() {
            Some((_, end)) if end <= job.region.len => {}
            _ => return false,
        }
        if r.addr_span().is_none() {
            return false;
        }
    }
    let region_base = arena.base + job.region.offset;
    let streaming = job.dir == Dir::Scatter && arena.streaming_scatter;
    for r in &job.runs {
        for (off, addr, len) in r.copies() {
            let arena_ptr = (region_base + off) as *mut u8;
            let user_ptr = addr as *mut u8;
            let len = len as usize;
            // SAFETY: the arena side lies inside the mapped arena (checked above: region inside
            // the arena, every run's span inside the region). The user side is memory the
            // application registered: for a gather, NIXL validated the local descriptors
            // against this agent's registrations before calling prepXfer; for a scatter, the
            // receiver machine checked every run against the registrations made through this
            // engine before emitting the job. Arena and user memory never overlap (the arena is
            // our private mapping), and the core hands each region to one job at a time.
            unsafe {
                match job.dir {
                    Dir::Gather => copy::copy_cached(user_ptr, arena_ptr, len),
                    Dir::Scatter if streaming => copy::copy_streaming(arena_ptr, user_ptr, len),
                    Dir::Scatter => copy::copy_cached(arena_ptr, user_ptr, len),
                }
            }
        }
    }
    if streaming {
        // The completion this job reports next must not overtake its streaming stores.
        copy::fence();
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    #[test]
    fn gather_then_scatter_moves_exact_bytes_and_refuses_escapes() {
        let mut arena = vec![0u8; 4096];
        let view = ArenaView { base: arena.as_mut_ptr() as u64, len: 4096, streaming_scatter: true };
        let src: Vec<u8> = (0..64u8).collect();
        let mut dst = vec![0xEEu8; 128];
        let (tx, rx) = mpsc::channel();
        let w = Workers::start(2, view, move |job, ok| tx.send((job, ok)).unwrap());
        let region = Region { offset: 1024, len: 1024 };
        // two strided pieces of 16 bytes from src into the region
        let g =
            CopyRun { region_off: 0, addr: src.as_ptr() as u64, len: 16, count: 2, region_stride: 16, addr_stride: 32 };
        assert!(w.submit(CopyJob { job: JobId(1), dir: Dir::Gather, region, runs: vec![g] }));
        assert_eq!(rx.recv().unwrap(), (JobId(1), true));
        let s = CopyRun {
            region_off: 0,
            addr: dst.as_mut_ptr() as u64 + 8,
            len: 32,
            count: 1,
            region_stride: 0,
            addr_stride: 0,
        };
        assert!(w.submit(CopyJob { job: JobId(2), dir: Dir::Scatter, region, runs: vec![s] }));
        assert_eq!(rx.recv().unwrap(), (JobId(2), true));
        drop(w);
        assert!(dst[..8].iter().all(|&b| b == 0xEE));
        assert_eq!(&dst[8..24], &src[0..16]);
        assert_eq!(&dst[24..40], &src[32..48]);
        assert!(dst[40..].iter().all(|&b| b == 0xEE));
        // a run past its region, and a region past the arena, are refused without copying
        let bad = CopyRun { region_off: 1000, len: 100, ..s };
        assert!(!run(view, &CopyJob { job: JobId(3), dir: Dir::Scatter, region, runs: vec![bad] }));
        let outside = Region { offset: 4000, len: 1024 };
        assert!(!run(view, &CopyJob { job: JobId(4), dir: Dir::Scatter, region: outside, runs: vec![] }));
    }
}
