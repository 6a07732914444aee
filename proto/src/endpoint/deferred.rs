//! WRITEs held back behind a cancel of ours: a transfer that failed or was released with
//! writes still in flight sends its cancel only once they have ended (the target must not hand
//! their regions on before). Its chunks already DATAed may still be scattering at the target.
//! A WRITE submitted to the same peer meanwhile would open its flow before the target learns of
//! the release, and could be scattered beside the old one's scatters and end first, reporting
//! SUCCESS while the released bytes are still to land over it. So it waits here until the
//! cancel is out; the target then holds its DATAs until the orphaned scatters have ended (the
//! receiver's `order`). UCX posts both on one endpoint, whose writes land in post order.
//!
//! Only WRITEs to a peer with a cancel pending wait, in the order submitted; the cancel goes out
//! when the old writes are reported done (the shell reports every job), or the peer is lost.
//! A held WRITE is a transfer in flight like any other: its peer is watched by the liveness
//! probe, and it fails with [`XferError::Timeout`] if it is still held a request timeout after
//! it was submitted.

use super::*;
use crate::event::internal_error;

/// One WRITE submitted while its peer had a cancel of ours pending.
#[derive(Debug)]
struct Held {
    xfer: XferId,
    token: Token,
    peer: PeerId,
    plan: Arc<Plan>,
    route: WriteRoute,
    /// When it fails if still held.
    deadline: Instant,
}

/// The WRITEs held back, in submission order.
#[derive(Debug, Default)]
pub(super) struct Deferred(VecDeque<Held>);

impl Deferred {
    pub(super) fn len(&self) -> usize {
        self.0.len()
    }

    pub(super) fn contains(&self, xfer: XferId) -> bool {
        self.0.iter().any(|h| h.xfer == xfer)
    }

    pub(super) fn has_peer(&self, peer: PeerId) -> bool {
        self.0.iter().any(|h| h.peer == peer)
    }

    /// Adds the peers held WRITEs wait on to `into`.
    pub(super) fn peers_into(&self, into: &mut BTreeSet<PeerId>) {
        into.extend(self.0.iter().map(|h| h.peer));
    }

    /// The earliest deadline of a held WRITE.
    pub(super) fn next_timeout(&self) -> Option<Instant> {
        self.0.iter().map(|h| h.deadline).min()
    }
}

impl Endpoint {
    /// Whether a WRITE to `peer` submitted now must wait: a cancel of ours to it is pending, or
    /// an earlier WRITE to it waits already (they start in order).
    pub(super) fn defers_write_to(&self, peer: PeerId) -> bool {
        self.sender.cancel_pending_to(peer) || self.deferred.has_peer(peer)
    }

    /// Holds WRITE `xfer` back (see the module): checked now as any submission, so a refusal
    /// still comes from the submit itself.
    pub(super) fn defer_write(
        &mut self,
        now: Instant,
        (xfer, token, peer): (XferId, Token, PeerId),
        plan: Arc<Plan>,
        route: WriteRoute,
    ) -> Result<(), SubmitError> {
        if self.deferred.contains(xfer) {
            return Err(SubmitError::DuplicateXfer { xfer });
        }
        self.sender.admit(&mut ctx!(self, now), xfer, &plan)?;
        debug!(xfer = xfer.0, peer = peer.0, "WRITE held back behind a cancel still waiting for its writes");
        self.stats.writes_deferred += 1;
        let deadline = now + self.sender.timeout();
        self.deferred.0.push_back(Held { xfer, token, peer, plan, route, deadline });
        Ok(())
    }

    /// Starts the held WRITEs whose peer has no cancel of ours pending any more, in order.
    pub(super) fn start_deferred(&mut self, now: Instant) {
        while let Some(i) = self.deferred.0.iter().position(|h| !self.sender.cancel_pending_to(h.peer)) {
            let Some(h) = self.deferred.0.remove(i) else { break };
            // Admitted when held; the engine cannot have begun shutting down since (that fails
            // every held WRITE), so a refusal here is a bug: the transfer fails rather than hang.
            if let Err(e) = self.start_write(now, (h.xfer, h.token, h.peer), h.plan, h.route) {
                internal_error("a held WRITE refused when started", &e);
                self.fail_unstarted(h.xfer, XferError::Refused);
            }
        }
    }

    /// Cancels held WRITE `xfer`, if it is one: true when it was.
    pub(super) fn cancel_deferred(&mut self, xfer: XferId) -> bool {
        let Some(i) = self.deferred.0.iter().position(|h| h.xfer == xfer) else { return false };
        self.deferred.0.remove(i);
        self.fail_unstarted(xfer, XferError::Canceled);
        true
    }

    /// Fails the held WRITEs to `peer` (every one with `None`) with `err`: the peer is gone, or
    /// the engine is shutting down.
    pub(super) fn fail_deferred(&mut self, peer: Option<PeerId>, err: XferError) {
        let _ = self.fail_held_if(|h| peer.is_none_or(|p| h.peer == p), err);
    }

    /// Fails the held WRITEs whose request timeout has passed at `now`.
    pub(super) fn expire_deferred(&mut self, now: Instant) {
        if self.deferred.next_timeout().is_some_and(|t| t <= now) {
            let _ = self.fail_held_if(|h| h.deadline <= now, XferError::Timeout);
        }
    }

    /// Fails the held WRITEs `gone` picks with `err`; returns how many.
    fn fail_held_if(&mut self, gone: impl Fn(&Held) -> bool, err: XferError) -> u64 {
        let (gone, kept): (VecDeque<Held>, VecDeque<Held>) =
            std::mem::take(&mut self.deferred.0).into_iter().partition(gone);
        self.deferred.0 = kept;
        let n = gone.len() as u64;
        for h in gone {
            self.fail_unstarted(h.xfer, err.clone());
        }
        n
    }

    /// Fails the held WRITEs that read our memory in `range`, just deregistered (as the
    /// sender fails its transfers that do): started, they would gather from it.
    pub(super) fn fail_deferred_reading(&mut self, range: (u64, u64)) {
        let reads = |h: &Held| crate::sender::touches_local(&h.plan, false, range);
        self.stats.dereg_failed += self.fail_held_if(reads, XferError::Deregistered);
    }

    /// Completes a WRITE that never started with `err`, counted as a transfer submitted and failed.
    fn fail_unstarted(&mut self, xfer: XferId, err: XferError) {
        debug!(xfer = xfer.0, error = %err, "held WRITE failed before it started");
        self.stats.submitted += 1;
        self.stats.count_failed(&err);
        self.out.push_back(Action::Complete { xfer, outcome: Err(err) });
    }
}
