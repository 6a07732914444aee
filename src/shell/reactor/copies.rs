//! Gathers and scatters handed to the arenas' copy engines: pinned in the fence, run, and
//! reported to the core; and a one-chunk WRITE's inline bytes.

use std::time::Instant;

use bounce_proto::endpoint::{InRegionPlan, JobId, JobRuns};
use bounce_proto::{ArenaId, MemKind, Region};

use super::{CopyInFlight, Driver};
use crate::shell::copy::{CopyJob, Dir};
use crate::shell::fence::{runs_span, runs_touch};
use crate::shell::stats::Stats;

impl Driver {
    /// Hands the core the completions of copies that finished inside their submit; true when
    /// there were any (they may have queued actions).
    pub(super) fn finish_inline_copies(&mut self) -> bool {
        let mut done = std::mem::take(&mut self.inline_done);
        if self.copiers.take_finished_inline(&mut done) == 0 {
            self.inline_done = done;
            return false;
        }
        let now = Instant::now();
        for (job, ok) in done.drain(..) {
            self.copy_done(now, job, ok);
        }
        self.inline_done = done;
        true
    }

    pub(super) fn copy(
        &mut self,
        job: JobId,
        dir: Dir,
        (arena, region): (ArenaId, Region),
        runs: JobRuns,
        in_region: Option<InRegionPlan>,
    ) {
        // A plan in the region is not known yet: it may touch any range the flow proved
        // (`(starts[i], reach[i])` covers range i and is within the hull). Nothing is collected:
        // a gather names thousands of runs, and this runs on the reactor for every job.
        let span = match &in_region {
            Some(p) => p.allowed.hull(),
            None => runs_span(&runs),
        };
        let pin = match span {
            Some(span) => {
                let touches = |(s, e): (u64, u64)| match &in_region {
                    Some(p) => p.allowed.starts().iter().zip(p.allowed.reach()).any(|(&a, &b)| a < e && s < b),
                    None => runs_touch(&runs, (s, e)),
                };
                match self.shared.fence.pin(span, touches) {
                    Some(pin) => Some(pin),
                    None => {
                        // Its memory was deregistered since the core emitted it: never run it.
                        self.dereg_refused += 1;
                        let in_region = in_region.is_some();
                        self.copies.insert(job, CopyInFlight { dir, pin: None, in_region });
                        return self.copy_done(Instant::now(), job, false);
                    }
                }
            }
            None => None,
        };
        self.copies.insert(job, CopyInFlight { dir, pin, in_region: in_region.is_some() });
        crate::shell::mark!(if dir == Dir::Gather { "copy-gather" } else { "copy-scatter" }, job.0);
        if self.copiers.submit(arena, CopyJob { job, dir, region, runs, in_region }).is_err() {
            self.copy_done(Instant::now(), job, false);
        }
    }

    /// The bytes of a WRITE's one chunk, gathered now to ride in its WANT, when the core sends
    /// chunks of its size inline (`bounce_inline_bytes`; never from a GPU arena). Pinned in the
    /// fence like any gather: a deregistration of the sources returns only once no copy reads
    /// them, and sources already deregistered are not read (the transfer then goes the usual
    /// way, where its gather is refused and it fails as deregistered).
    pub(super) fn inline_bytes(&mut self, plan: &bounce_proto::plan::Plan) -> Option<Vec<u8>> {
        let [chunk] = &plan.chunks[..] else { return None };
        if chunk.bytes > self.ep.inline_bytes() || chunk.region_plan.is_some() {
            return None;
        }
        // From host memory only: a GPU arena's sources are GPU addresses, never read by the CPU.
        if self.arenas.get(usize::from(plan.local_arena.0)).map(|a| a.place.mem) != Some(MemKind::Dram) {
            return None;
        }
        let runs = &chunk.gather;
        let pin = self.shared.fence.pin(runs_span(runs)?, |range| runs_touch(runs, range))?;
        let bytes = self.copiers.gather_inline(runs, chunk.bytes);
        self.shared.fence.unpin(pin);
        bytes
    }

    pub(super) fn copy_done(&mut self, now: Instant, job: JobId, ok: bool) {
        crate::shell::mark!("copy-done", job.0);
        let dir = self.copies.remove(&job).map(|c| {
            if let Some(pin) = c.pin {
                self.shared.fence.unpin(pin);
            }
            if c.in_region && !ok {
                Stats::bump(&self.shared.stats.region_plans_failed);
            }
            c.dir
        });
        match dir {
            Some(Dir::Gather) => self.ep.handle_gather_done(now, job, ok),
            Some(Dir::Scatter) => self.ep.handle_scatter_done(now, job, ok),
            None => tracing::error!(job = job.0, "completion for an unknown copy job"),
        }
    }
}
