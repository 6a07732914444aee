//! The copy-engine seam: gathers (user memory -> arena region) and scatters (arena region ->
//! user memory) run on a [`CopyEngine`], which never sees protocol state. Today's engine is
//! [`cpu::CpuEngine`] (worker threads, [`kernels`]) for host arenas, [`cuda::CudaCopyEngine`]
//! (streams and the kernels of `kernels/`) for GPU arenas; [`route::Copiers`] holds one per
//! arena of an engine.

pub(crate) mod cpu;
pub(crate) mod cuda;
mod kernels;
pub(crate) mod route;

use bounce_proto::endpoint::{InRegionPlan, JobId, JobRuns};
use bounce_proto::{CopyRun, Region};

/// Which way a job copies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Dir {
    /// User memory -> arena region.
    Gather,
    /// Arena region -> user memory.
    Scatter,
}

/// One gather or scatter over one arena region (offsets relative to the arena base).
#[derive(Debug)]
pub(crate) struct CopyJob {
    /// Reported back on completion.
    pub(crate) job: JobId,
    /// Direction.
    pub(crate) dir: Dir,
    /// The arena region.
    pub(crate) region: Region,
    /// The copies; each run's `region_off` is relative to `region.offset`. A gather whose
    /// chunk carries its plan in the region also writes that plan there
    /// ([`JobRuns::region_plan`]).
    pub(crate) runs: JobRuns,
    /// A scatter whose runs lie unchecked in the region: the engine copies them out, checks
    /// that copy ([`bounce_proto::wire::region_plan::check`] or the same on the device) and
    /// scatters by it, or copies nothing and reports failure.
    pub(crate) in_region: Option<InRegionPlan>,
}

impl CopyJob {
    /// Whether the job is one the core can emit: its chunk exists in its plan (or it names
    /// none), and only a scatter takes its runs from its region. Engines fail any other (an
    /// empty job would read as a copy done; a gather by a peer's plan would read where the
    /// peer chose). Neither comes from peer input today: defense in depth.
    pub(crate) fn well_formed(&self) -> bool {
        let gather_by_region_plan = self.in_region.is_some() && self.dir == Dir::Gather;
        !(self.runs.names_a_missing_chunk() || gather_by_region_plan)
    }
}

/// A copy engine: CPU workers (memcpy / streaming stores) or CUDA streams (kernels).
///
/// Contract: `submit` never waits for anything (it may run a small job at once on the calling
/// thread, which then reports it at the next `poll_done`); every accepted job is reported
/// exactly once by `poll_done` (ok=false on any failure); `poll_done` never blocks; dropping
/// the engine waits for (or safely abandons, never leaving a copy running on freed memory)
/// every accepted job.
/// The arena an engine copies into and out of is given to it at construction, and it checks
/// each job's region against that arena before copying (defense in depth).
pub(crate) trait CopyEngine: Send {
    /// Queues a job. `Err` gives the job back when the engine cannot take it (closed or
    /// broken): the caller then fails it.
    fn submit(&mut self, job: CopyJob) -> Result<(), CopyJob>;
    /// Appends finished jobs `(job, ok)` to `out`; returns how many were appended.
    fn poll_done(&mut self, out: &mut Vec<(JobId, bool)>) -> usize;
    /// Jobs accepted and not yet reported.
    fn in_flight(&self) -> usize;
    /// Appends the jobs that already finished inside [`Self::submit`] (copied on the submitting
    /// thread), as [`Self::poll_done`] would report them; returns how many. The reactor hands
    /// their completions on in the same pass (a small scatter's ACK goes out with the DATA's
    /// handling, not a pass later). None unless an engine says so.
    fn take_finished_inline(&mut self, _out: &mut Vec<(JobId, bool)>) -> usize {
        0
    }
    /// Prepares the calling thread for work on this engine's memory: the CUDA engine makes its
    /// GPU's context current there (the reactor's thread once at its start; where
    /// [`Self::any_thread`] allows passes on application threads, such a thread before each
    /// pass it runs, the FFI edge restoring its own context after),
    /// which the inner engine's writes from GPU memory need too. Nothing for host memory.
    /// False when the thread cannot be prepared: then no pass may run on it.
    fn prepare_thread(&mut self) -> bool {
        true
    }
    /// Puts `bytes` (an inline chunk from a peer's WANT) at the start of arena `region`, at once
    /// on the calling thread; false, putting nothing, when they do not fit the region or this
    /// engine's arena is not host memory. None unless an engine says so.
    fn put(&mut self, _region: Region, _bytes: &[u8]) -> bool {
        false
    }
    /// Gathers a chunk of `len` bytes by its gather `runs` (region offsets into the result,
    /// source addresses in user memory) into a new buffer, at once on the calling thread: the
    /// bytes a WANT carries inline. `None` when a run leaves the chunk or this engine does not
    /// copy host memory. None unless an engine says so.
    fn gather_inline(&mut self, _runs: &[CopyRun], _len: u64) -> Option<Vec<u8>> {
        None
    }
    /// Whether this engine wants application threads to run the reactor's passes while they
    /// poll (after [`Self::prepare_thread`]); when any engine of a reactor does, they run them
    /// for every arena ([`crate::shell::copy::route::Copiers::any_thread`]), so every engine
    /// must work on a prepared application thread. False unless an engine says so.
    fn any_thread(&self) -> bool {
        false
    }
}
