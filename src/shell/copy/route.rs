//! One copy engine per arena (docs/arenas.md slice 4): jobs go to the engine of the arena
//! their region lies in, completions come from all of them. An engine with one arena has one.

use bounce_proto::endpoint::JobId;
use bounce_proto::{ArenaId, CopyRun, Region};

use super::{CopyEngine, CopyJob};

/// The engine's copy engines, by [`ArenaId`]: never empty.
pub(crate) struct Copiers(Vec<Box<dyn CopyEngine>>);

impl Copiers {
    /// The copy engine of each arena, by [`ArenaId`]; `None` for none.
    pub(crate) fn new(engines: Vec<Box<dyn CopyEngine>>) -> Option<Self> {
        (!engines.is_empty()).then_some(Self(engines))
    }

    /// Runs `job` on `arena`'s engine; gives it back when that engine cannot take it, or the
    /// arena is not ours (the core names only arenas it was given, so that is a bug, failed
    /// like a broken engine, never a copy into the wrong memory).
    pub(crate) fn submit(&mut self, arena: ArenaId, job: CopyJob) -> Result<(), CopyJob> {
        match self.0.get_mut(usize::from(arena.0)) {
            Some(engine) => engine.submit(job),
            None => Err(job),
        }
    }

    /// Every engine's finished jobs (see [`CopyEngine::poll_done`]).
    pub(crate) fn poll_done(&mut self, out: &mut Vec<(JobId, bool)>) -> usize {
        self.0.iter_mut().map(|e| e.poll_done(out)).sum()
    }

    /// Jobs accepted and not yet reported, by all engines.
    pub(crate) fn in_flight(&self) -> usize {
        self.0.iter().map(|e| e.in_flight()).sum()
    }

    /// Every engine's jobs finished inside their submit (see
    /// [`CopyEngine::take_finished_inline`]).
    pub(crate) fn take_finished_inline(&mut self, out: &mut Vec<(JobId, bool)>) -> usize {
        self.0.iter_mut().map(|e| e.take_finished_inline(out)).sum()
    }

    /// Prepares the calling thread for every engine (each GPU's context made current in turn:
    /// a thread serves them all); false, at the first that cannot be prepared (no pass may
    /// then run on the thread).
    pub(crate) fn prepare_thread(&mut self) -> bool {
        self.0.iter_mut().all(|e| e.prepare_thread())
    }

    /// Puts an inline chunk's `bytes` at the start of `arena`'s `region` (see
    /// [`CopyEngine::put`]); false when that arena's engine cannot.
    pub(crate) fn put(&mut self, arena: ArenaId, region: Region, bytes: &[u8]) -> bool {
        self.0.get_mut(usize::from(arena.0)).is_some_and(|e| e.put(region, bytes))
    }

    /// A WRITE's one chunk gathered from host memory into a buffer (see
    /// [`CopyEngine::gather_inline`]), by the first engine that copies host memory.
    pub(crate) fn gather_inline(&mut self, runs: &[CopyRun], len: u64) -> Option<Vec<u8>> {
        self.0.iter_mut().find_map(|e| e.gather_inline(runs, len))
    }

    /// Whether application threads run passes: when any engine asks for them. The others
    /// still work there: [`Self::prepare_thread`] binds each GPU's context for the pass and the
    /// FFI edge puts the application's back. An engine with a host and a GPU arena (`both`)
    /// then serves its small host-memory transfers as a host-only engine does (on the H200
    /// host a 256 x 64 B WRITE took 84-88 us with passes on the reactor thread alone, 56-63
    /// with the pollers', against 57-62 for a host-only engine), and its GPU transfers
    /// measured no slower (16384 x 4 KiB 0.61-0.90 against 0.84-0.90 ms, time-sliced on one
    /// GPU; BENCHMARKS.md "Session 32").
    pub(crate) fn any_thread(&self) -> bool {
        self.0.iter().any(|e| e.any_thread())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shell::copy::Dir;
    use bounce_proto::endpoint::JobRuns;

    /// An engine that records what it was given and finishes each job at the next poll.
    #[derive(Default)]
    struct Recorder {
        jobs: Vec<JobId>,
        done: Vec<(JobId, bool)>,
        puts: usize,
        host: bool,
    }

    impl CopyEngine for Recorder {
        fn any_thread(&self) -> bool {
            self.host
        }
        fn submit(&mut self, job: CopyJob) -> Result<(), CopyJob> {
            self.jobs.push(job.job);
            self.done.push((job.job, true));
            Ok(())
        }
        fn poll_done(&mut self, out: &mut Vec<(JobId, bool)>) -> usize {
            let n = self.done.len();
            out.append(&mut self.done);
            n
        }
        fn in_flight(&self) -> usize {
            self.done.len()
        }
        fn put(&mut self, _region: Region, _bytes: &[u8]) -> bool {
            self.puts += 1;
            self.host
        }
        fn gather_inline(&mut self, _runs: &[CopyRun], len: u64) -> Option<Vec<u8>> {
            self.host.then(|| vec![7; len as usize])
        }
    }

    fn job(id: u64) -> CopyJob {
        CopyJob {
            job: JobId(id),
            dir: Dir::Gather,
            region: Region { offset: 0, len: 64 },
            runs: JobRuns::Own(Vec::new()),
            in_region: None,
        }
    }

    #[test]
    fn jobs_go_to_their_arenas_engine_and_an_unknown_arena_gets_its_job_back() {
        assert!(Copiers::new(Vec::new()).is_none(), "never empty");
        let (gpu, host) = (Recorder::default(), Recorder { host: true, ..Recorder::default() });
        let mut c = Copiers::new(vec![Box::new(gpu), Box::new(host)]).unwrap();
        assert!(c.submit(ArenaId(0), job(1)).is_ok());
        assert!(c.submit(ArenaId(1), job(2)).is_ok());
        assert!(c.submit(ArenaId(1), job(3)).is_ok());
        let back = c.submit(ArenaId(2), job(4)).expect_err("no third arena");
        assert_eq!(back.job, JobId(4));
        assert_eq!(c.in_flight(), 3);
        let mut out = Vec::new();
        assert_eq!(c.poll_done(&mut out), 3);
        out.sort_by_key(|(j, _)| j.0);
        assert_eq!(out, vec![(JobId(1), true), (JobId(2), true), (JobId(3), true)]);
        // Inline bytes go into the named arena only, and are gathered by the host engine.
        assert!(!c.put(ArenaId(0), Region { offset: 0, len: 64 }, &[1]));
        assert!(c.put(ArenaId(1), Region { offset: 0, len: 64 }, &[1]));
        assert!(!c.put(ArenaId(5), Region { offset: 0, len: 64 }, &[1]));
        assert_eq!(c.gather_inline(&[], 3), Some(vec![7; 3]));
    }

    /// Pollers run passes when any arena's engine asks for them (a host arena does), so an
    /// engine with both arenas keeps its host arena's pollers; a GPU arena alone does not.
    #[test]
    fn pollers_run_passes_when_any_arena_asks_for_them() {
        let gpu = || Box::new(Recorder::default()) as Box<dyn CopyEngine>;
        let host = || Box::new(Recorder { host: true, ..Recorder::default() }) as Box<dyn CopyEngine>;
        assert!(!Copiers::new(vec![gpu()]).unwrap().any_thread());
        assert!(Copiers::new(vec![host()]).unwrap().any_thread());
        assert!(Copiers::new(vec![host(), gpu()]).unwrap().any_thread());
        assert!(Copiers::new(vec![gpu(), host()]).unwrap().any_thread());
        assert!(!Copiers::new(vec![gpu(), gpu()]).unwrap().any_thread());
    }
}
