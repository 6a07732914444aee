//! The shell's copy seam (shape agreed in the helpers' seams.md): a private copy on this branch
//! so the CUDA copy engine compiles against it while the shell is reshaped elsewhere; the
//! integrator replaces this file with the real `copy/mod.rs` items.

// Nothing outside the CUDA engine uses the seam on this branch yet (the reactor is wired to
// it by the integrator).
#![cfg_attr(not(test), allow(dead_code))]

use bounce_proto::endpoint::JobId;
use bounce_proto::{CopyRun, Region};

/// Which way a job copies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Dir {
    /// User memory -> region.
    Gather,
    /// Region -> user memory.
    Scatter,
}

/// One gather or scatter over one arena region (offsets relative to the arena base).
#[derive(Debug)]
pub(crate) struct CopyJob {
    /// Reported back on completion.
    pub job: JobId,
    /// Direction.
    pub dir: Dir,
    /// The arena region.
    pub region: Region,
    /// The copies; `region_off` is relative to `region.offset`.
    pub runs: Vec<CopyRun>,
}

/// A copy engine: CPU workers (memcpy / streaming stores) or CUDA streams (kernels).
/// Contract: `submit` never blocks; every accepted job is reported exactly once by `poll_done`
/// (ok=false on any failure); `poll_done` never blocks; dropping the engine waits for (or safely
/// abandons, never leaving a copy running on freed memory) every accepted job.
pub(crate) trait CopyEngine: Send {
    /// Queues a job. Err gives the job back when the engine cannot take it (closed / broken):
    /// the caller then fails it.
    fn submit(&mut self, job: CopyJob) -> Result<(), CopyJob>;
    /// Appends finished jobs `(job, ok)` to `out`; returns how many were appended.
    fn poll_done(&mut self, out: &mut Vec<(JobId, bool)>) -> usize;
    /// Jobs accepted and not yet reported.
    fn in_flight(&self) -> usize;
}
