//! The sender as the initiator of READs (our addition: the reference design only writes, and
//! vLLM's decode side pulls): a READ is announced in PULLs carrying its chunks' gather runs;
//! each region the target gathered and announced ready (a GRANT) is READ into local staging,
//! released at the target, and scattered here.

use super::*;

impl Sender {
    /// Starts READ transfer `xfer` of `plan` from `peer`: the plan's gather runs read the
    /// target's memory (`CopyRun::addr` there) and its scatter runs write ours. Sends the PULL;
    /// each ready region (a GRANT) is READ into local staging, released, and scattered here.
    /// No eager staging and no direct chunks: nothing can be staged before the target gathers.
    pub(crate) fn submit_read(
        &mut self,
        ctx: &mut Ctx<'_>,
        xfer: XferId,
        token: Token,
        peer: PeerId,
        mut plan: Arc<Plan>,
        one_way: bool,
    ) -> Result<(), SubmitError> {
        self.admit(ctx, xfer, &plan)?;
        if plan.chunks.iter().any(|c| c.direct.is_some()) {
            for c in &mut Arc::make_mut(&mut plan).chunks {
                c.direct = None;
            }
        }
        let endpoint = if one_way { wire::REPLY_MAILBOX.to_vec() } else { self.endpoint.clone() };
        let mut proofs =
            plan.dests.iter().map(|d| proof::prove_as(d.reg, &d.key, token, xfer, &self.initiator)).collect();
        // `check_plan` capped the chunks at MAX_CHUNKS_PER_WANT, a u32.
        let total = plan.chunks.len() as u32;
        for (first, part) in pull_frames(&plan.chunks) {
            let chunks = part.iter().map(|c| wire::PullChunk { bytes: c.bytes, runs: Arc::clone(&c.gather) }).collect();
            let (first, proofs) = (ChunkIdx(first as u32), std::mem::take(&mut proofs));
            let (arena, endpoint) = (plan.peer_arena, endpoint.clone());
            ctx.send(peer, wire::Pull { xfer, token, arena, first, total, endpoint, chunks, proofs });
        }
        let deadline = ctx.now + self.timeout;
        let (stages, planned) = (vec![Stage::Idle; plan.chunks.len()], vec![false; plan.chunks.len()]);
        // A READ's GRANT comes after the target's gather: no control round trip to time.
        let x = Xfer {
            peer,
            token,
            stages,
            plan,
            acked: 0,
            staged: true,
            read: true,
            planned,
            deadline,
            wanted: None,
            inline: false,
            claimed: None,
        };
        self.start_staging(ctx, x.plan.local_arena);
        debug!(xfer = xfer.0, peer = peer.0, chunks = x.plan.chunks.len(), bytes = x.plan.total_bytes, "submit READ");
        self.timers.set(xfer, deadline);
        self.xfers.insert(xfer, x);
        ctx.stats.submitted += 1;
        Ok(())
    }

    /// A READ's RDMA read ended: the region is released at the target and the chunk scattered
    /// here, or the transfer fails.
    pub(crate) fn handle_read_done(&mut self, ctx: &mut Ctx<'_>, job: JobId, ok: bool) {
        self.writes.remove(&job);
        if self.writes.is_empty() {
            self.next_keep = None;
        }
        let Some((r, x)) = self.finished_job(ctx, job, JobKind::Read) else { return };
        let Stage::Reading { local, credit, .. } = x.stages[r.chunk] else {
            return internal_error("read done for a chunk not reading", &r.chunk);
        };
        trace!(xfer = r.xfer.0, chunk = r.chunk, ok, "read done");
        if !ok {
            x.stages[r.chunk] = Stage::Gathered { local };
            return self.fail(ctx, r.xfer, XferError::ReadFailed, true);
        }
        // A read that ended half a timeout after its credit came may have read a region the
        // target reclaimed meanwhile (half a timeout after the gather, its KEEPs lost) and,
        // after the quarter timeout's quarantine, gathered another flow's bytes into: those
        // must not be scattered here and reported done (review 61, READ L1; a late WRITE is
        // refused by its DATA instead). The quarter left covers the credit's own way here; an
        // honest read takes milliseconds.
        let peer = x.peer;
        let timeout = self.lease_base(peer);
        let Some(x) = self.xfers.get_mut(&r.xfer) else { return };
        if ctx.now >= credit.at + timeout / 2 {
            debug!(
                xfer = r.xfer.0,
                chunk = r.chunk,
                "READ ended half a timeout after its credit: its bytes are not trusted"
            );
            x.stages[r.chunk] = Stage::Gathered { local };
            return self.fail(ctx, r.xfer, XferError::Timeout, true);
        }
        let chunk = ChunkIdx(r.chunk as u32);
        ctx.send(x.peer, wire::Release { xfer: r.xfer, token: x.token, chunk, region: credit.region });
        let scatter = ctx.job();
        x.stages[r.chunk] = Stage::Pulled { local, job: scatter };
        // The plan's own runs, shared: a GPU engine keeps their device copy with the plan.
        let (peer, arena) = (x.peer, x.plan.local_arena);
        let runs = JobRuns::ChunkScatter { plan: Arc::clone(&x.plan), chunk: r.chunk };
        self.jobs.insert(scatter, JobRef { xfer: r.xfer, chunk: r.chunk, kind: JobKind::Scatter });
        ctx.push(Action::Scatter {
            job: scatter,
            peer,
            xfer: r.xfer,
            arena,
            region: local,
            runs,
            in_region: None,
            inline: None,
        });
    }

    /// A READ's local scatter ended: the chunk is done (the transfer completes with its last),
    /// or the transfer fails.
    pub(crate) fn handle_scatter_done(&mut self, ctx: &mut Ctx<'_>, job: JobId, ok: bool) {
        let Some((r, x)) = self.finished_job(ctx, job, JobKind::Scatter) else { return };
        let Stage::Pulled { local, .. } = x.stages[r.chunk] else {
            return internal_error("scatter done for a chunk not pulled", &r.chunk);
        };
        release(ctx, x.plan.local_arena, local);
        if !ok {
            x.stages[r.chunk] = Stage::Idle;
            return self.fail(ctx, r.xfer, XferError::ScatterFailed, true);
        }
        x.stages[r.chunk] = Stage::Acked;
        x.acked += 1;
        ctx.stats.chunks_pulled += 1;
        if x.acked == x.stages.len() {
            self.complete(ctx, r.xfer);
        }
    }

    /// Starts the RDMA read of READ chunk `i` into `local`, unless its credit is stale (the
    /// target reclaims a region left unread for half a timeout, as one left unwritten).
    pub(super) fn start_read(
        &mut self,
        ctx: &mut Ctx<'_>,
        id: XferId,
        i: usize,
        (arena, local): (ArenaId, Region),
        credit: Credit,
    ) -> Result<(), XferError> {
        let lease = self.xfers.get(&id).map_or(self.timeout, |x| self.lease_base(x.peer));
        let Some(x) = self.xfers.get_mut(&id) else {
            release(ctx, arena, local);
            return Ok(());
        };
        if ctx.now >= credit.at + lease / 4 {
            debug!(xfer = id.0, chunk = i, "READ credit went stale before the read");
            x.stages[i] = Stage::Gathered { local };
            return Err(XferError::Timeout);
        }
        let job = ctx.job();
        self.jobs.insert(job, JobRef { xfer: id, chunk: i, kind: JobKind::Read });
        x.stages[i] = Stage::Reading { local, job, credit };
        let len = x.plan.chunks[i].bytes;
        trace!(xfer = id.0, chunk = i, remote = %credit.region, %local, "read");
        let remote_arena = x.plan.peer_arena;
        ctx.push(Action::Read { job, xfer: id, peer: x.peer, remote_arena, remote: credit.region, arena, local, len });
        self.writes.insert(job, WriteInFlight { peer: x.peer, xfer: id, token: x.token });
        self.keep_from(ctx.now, lease);
        Ok(())
    }
}

/// Most gather runs a later PULL of a READ carries (one chunk with more goes alone).
pub(crate) const PULL_FRAME_RUNS: usize = 1024;

/// How a READ's chunks are split into PULLs, as (index of the first chunk, the chunks): the
/// first chunk alone, so the target gathers it while the rest are still encoded, sent and
/// decoded; then whole chunks up to [`PULL_FRAME_RUNS`] runs a PULL.
pub(super) fn pull_frames(chunks: &[crate::plan::Chunk]) -> impl Iterator<Item = (usize, &[crate::plan::Chunk])> + '_ {
    let mut first = 0;
    std::iter::from_fn(move || {
        if first >= chunks.len() {
            return None;
        }
        let mut end = first + 1;
        if first > 0 {
            let mut runs = chunks[first].gather.len();
            while end < chunks.len() && runs + chunks[end].gather.len() <= PULL_FRAME_RUNS {
                runs += chunks[end].gather.len();
                end += 1;
            }
        }
        let part = (first, &chunks[first..end]);
        first = end;
        Some(part)
    })
}
