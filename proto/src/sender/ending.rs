//! How transfers end: completed when every chunk is acknowledged, failed (by us, the peer, a
//! timeout or a deregistration) with their staging released or orphaned, and remembered
//! briefly afterwards so that late frames about them are quietly ignored.

use super::*;

impl Sender {
    /// Completes `id` successfully (every chunk acknowledged, every staging region released).
    pub(super) fn complete(&mut self, ctx: &mut Ctx<'_>, id: XferId) {
        let Some(x) = self.xfers.remove(&id) else {
            return;
        };
        self.timers.stop(id);
        if x.staged {
            self.stop_staging(x.plan.local_arena);
        }
        debug!(xfer = id.0, chunks = x.stages.len(), bytes = x.plan.total_bytes, "transfer complete");
        ctx.stats.completed += 1;
        ctx.push(Action::Complete { xfer: id, outcome: Ok(()) });
        self.tombstone(ctx.now, id, x.peer);
    }

    /// The target ended transfer `id` (a one-way FAIL record) or broke the protocol: it fails
    /// with `err`, its credits retracted as for any failure.
    pub(crate) fn fail_by_peer(&mut self, ctx: &mut Ctx<'_>, id: XferId, err: XferError) {
        self.fail(ctx, id, err, true);
    }

    /// Fails `id`: completes it with `err`, releases its idle staging regions, orphans those
    /// with a job in flight and, with `cancel`, retracts its credits once its writes are done.
    pub(super) fn fail(&mut self, ctx: &mut Ctx<'_>, id: XferId, err: XferError, cancel: bool) {
        let Some(x) = self.xfers.remove(&id) else {
            return;
        };
        self.timers.stop(id);
        if x.staged {
            self.stop_staging(x.plan.local_arena);
        }
        let arena = x.plan.local_arena;
        let (mut writes, mut scatters) = (0, 0);
        for stage in &x.stages {
            match *stage {
                Stage::Gathering { local, job, .. } => {
                    self.jobs.remove(&job);
                    self.orphans.insert(job, Orphan { xfer: id, arena, region: Some(local), kind: JobKind::Gather });
                }
                Stage::Writing { source, job, .. } => {
                    self.jobs.remove(&job);
                    let region = match source {
                        WriteSource::Arena(local) => Some(local),
                        WriteSource::User { .. } => None,
                    };
                    self.orphans.insert(job, Orphan { xfer: id, arena, region, kind: JobKind::Write });
                    writes += 1;
                }
                Stage::Gathered { local } => {
                    release(ctx, arena, local);
                }
                Stage::Reading { local, job, .. } => {
                    // The cancel waits for it, as for a write: the target must not reuse a
                    // region our READ may still be reading.
                    self.jobs.remove(&job);
                    self.orphans.insert(job, Orphan { xfer: id, arena, region: Some(local), kind: JobKind::Read });
                    writes += 1;
                }
                Stage::Pulled { local, job } => {
                    // It writes the application's memory: the failure is told once it ends.
                    self.jobs.remove(&job);
                    self.orphans.insert(job, Orphan { xfer: id, arena, region: Some(local), kind: JobKind::Scatter });
                    scatters += 1;
                }
                Stage::DataSent { .. } | Stage::Idle | Stage::Parked { .. } | Stage::Acked => {}
            }
        }
        // A claim of our standing region: the region may hold (or be about to receive) this
        // transfer's write while the receiver refused the claim and left it with the standing
        // flow, which then goes too, after the writes, and is opened afresh by a later submit.
        let standing = x.claimed.filter(|&(s, _)| self.standing.get(&x.peer).is_some_and(|slot| slot.xfer == s));
        if standing.is_some() {
            // Its cancel goes with this transfer's, below (after the writes when some are out).
            self.close_standing(ctx, x.peer, false);
        } else if let Some((s, _)) = x.claimed {
            // A standing flow already replaced: its late messages are still expected.
            self.tombstone(ctx.now, s, x.peer);
        }
        if cancel {
            if writes == 0 {
                ctx.send(x.peer, Msg::cancel(id, x.token, self.endpoint.clone()));
                if let Some((s, token)) = standing {
                    ctx.send(x.peer, Msg::cancel(s, token, self.endpoint.clone()));
                }
            } else {
                let pc = PendingCancel { peer: x.peer, token: x.token, writes, standing, read: x.read };
                self.pending_cancels.insert(id, pc);
            }
        }
        debug!(xfer = id.0, peer = x.peer.0, error = %err, acked = x.acked, orphaned_writes = writes, "transfer failed");
        ctx.stats.count_failed(&err);
        if scatters == 0 {
            ctx.push(Action::Complete { xfer: id, outcome: Err(err) });
        } else {
            self.failing_reads.insert(id, (err, scatters));
        }
        self.tombstone(ctx.now, id, x.peer);
    }

    /// One scatter of a failed READ ended: with its last, the failure is told.
    pub(super) fn scatter_ended(&mut self, ctx: &mut Ctx<'_>, id: XferId) {
        let Some((_, left)) = self.failing_reads.get_mut(&id) else { return };
        *left -= 1;
        if *left == 0 {
            if let Some((err, _)) = self.failing_reads.remove(&id) {
                ctx.push(Action::Complete { xfer: id, outcome: Err(err) });
            }
        }
    }

    /// A GRANT or ACK for a transfer not in flight: quietly ignored when it finished recently
    /// (the message crossed our completion or cancel), a protocol error otherwise.
    pub(super) fn unknown(&self, ctx: &mut Ctx<'_>, from: PeerId, xfer: XferId) -> Result<(), ProtocolError> {
        if self.finished.get(&xfer) == Some(&from) {
            trace!(xfer = xfer.0, "late message for a finished transfer ignored");
            ctx.stats.late_msgs += 1;
            return Ok(());
        }
        Err(ProtocolError::UnknownXfer { peer: from, xfer })
    }

    /// Remembers a finished transfer for two timeouts: long enough for every message in
    /// flight about it to arrive.
    pub(super) fn tombstone(&mut self, now: Instant, id: XferId, peer: PeerId) {
        self.finished.insert(id, peer);
        self.finished_order.push_back((now + 2 * self.timeout, id));
    }

    pub(super) fn prune(&mut self, now: Instant) {
        while let Some(&(t, id)) = self.finished_order.front() {
            if t > now {
                break;
            }
            self.finished_order.pop_front();
            self.finished.remove(&id);
        }
    }
}
