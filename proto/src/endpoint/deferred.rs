//! Transfers held back behind a cancel of ours: a WRITE that failed or was released with
//! writes still in flight sends its cancel only once they have ended (the target must not hand
//! their regions on before). Its chunks already DATAed may still be scattering at the target.
//! A WRITE submitted to the same peer meanwhile would open its flow before the target learns of
//! the release, and could be scattered beside the old one's scatters and end first, reporting
//! SUCCESS while the released bytes are still to land over it. So it waits here until the
//! cancel is out; the target then holds its DATAs until the orphaned scatters have ended (the
//! receiver's `order`). UCX posts both on one endpoint, whose writes land in post order.
//!
//! A READ submitted meanwhile waits too, in the same queue, so the peer's transfer ids reach
//! the target in the order they were given: a held WRITE started after 256 later READs had
//! ended there would fall below the target's replay window (`receiver::ended`) and be dropped
//! as a replay, unanswered, failing by its timeout (review 58).
//!
//! Only transfers to a peer with a WRITE's cancel pending wait, in the order submitted; the
//! cancel goes out when the old writes are reported done (the shell reports every job), or the
//! peer is lost. A held transfer is in flight like any other: its peer is watched by the
//! liveness probe, and it fails with [`XferError::Timeout`] if it is still held a request
//! timeout after it was submitted.

use super::*;
use crate::event::internal_error;

/// One transfer submitted while its peer had a cancel of ours pending.
#[derive(Debug)]
struct Held {
    xfer: XferId,
    token: Token,
    peer: PeerId,
    plan: Arc<Plan>,
    kind: HeldKind,
    /// When it fails if still held.
    deadline: Instant,
}

/// What a held transfer starts as.
#[derive(Debug)]
pub(super) enum HeldKind {
    Write(WriteRoute),
    /// A READ, one way through the target's mailbox of this shape when it has one.
    Read(Option<MailboxLayout>),
}

impl HeldKind {
    fn is_read(&self) -> bool {
        matches!(self, Self::Read(_))
    }
}

/// The transfers held back, in submission order.
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

    /// The earliest deadline of a held transfer.
    pub(super) fn next_timeout(&self) -> Option<Instant> {
        self.0.iter().map(|h| h.deadline).min()
    }
}

impl Endpoint {
    /// Whether a transfer to `peer` submitted now must wait: a cancel of ours to it is pending,
    /// or an earlier transfer to it waits already (they start in order).
    pub(super) fn defers_to(&self, peer: PeerId) -> bool {
        self.sender.cancel_pending_to(peer) || self.deferred.has_peer(peer)
    }

    /// Holds transfer `xfer` back (see the module): checked now as any submission, so a
    /// refusal still comes from the submit itself.
    pub(super) fn defer(
        &mut self,
        now: Instant,
        (xfer, token, peer): (XferId, Token, PeerId),
        plan: Arc<Plan>,
        kind: HeldKind,
    ) -> Result<(), SubmitError> {
        if self.deferred.contains(xfer) {
            return Err(SubmitError::DuplicateXfer { xfer });
        }
        self.sender.admit(&mut ctx!(self, now), xfer, &plan)?;
        debug!(
            xfer = xfer.0,
            peer = peer.0,
            read = kind.is_read(),
            "transfer held back behind a cancel still waiting for its writes"
        );
        if kind.is_read() {
            self.stats.reads_deferred += 1;
        } else {
            self.stats.writes_deferred += 1;
        }
        let deadline = now + self.sender.timeout();
        self.deferred.0.push_back(Held { xfer, token, peer, plan, kind, deadline });
        Ok(())
    }

    /// Starts the held transfers whose peer has no cancel of ours pending any more, in order.
    pub(super) fn start_deferred(&mut self, now: Instant) {
        while let Some(i) = self.deferred.0.iter().position(|h| !self.sender.cancel_pending_to(h.peer)) {
            let Some(h) = self.deferred.0.remove(i) else { break };
            let ids = (h.xfer, h.token, h.peer);
            let started = match h.kind {
                HeldKind::Write(route) => self.start_write(now, ids, h.plan, route),
                HeldKind::Read(mailbox) => self.start_read(now, ids, h.plan, mailbox),
            };
            // Admitted when held; the engine cannot have begun shutting down since (that fails
            // every held transfer), so a refusal here is a bug: it fails rather than hang.
            if let Err(e) = started {
                internal_error("a held transfer refused when started", &e);
                self.fail_unstarted(h.xfer, XferError::Refused);
            }
        }
    }

    /// Cancels held transfer `xfer`, if it is one: true when it was.
    pub(super) fn cancel_deferred(&mut self, xfer: XferId) -> bool {
        let Some(i) = self.deferred.0.iter().position(|h| h.xfer == xfer) else { return false };
        self.deferred.0.remove(i);
        self.fail_unstarted(xfer, XferError::Canceled);
        true
    }

    /// Fails the held transfers to `peer` (every one with `None`) with `err`: the peer is gone,
    /// or the engine is shutting down.
    pub(super) fn fail_deferred(&mut self, peer: Option<PeerId>, err: XferError) {
        let _ = self.fail_held_if(|h| peer.is_none_or(|p| h.peer == p), err);
    }

    /// Fails the held transfers whose request timeout has passed at `now`.
    pub(super) fn expire_deferred(&mut self, now: Instant) {
        if self.deferred.next_timeout().is_some_and(|t| t <= now) {
            let _ = self.fail_held_if(|h| h.deadline <= now, XferError::Timeout);
        }
    }

    /// Fails the held transfers `gone` picks with `err`; returns how many.
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

    /// Fails the held transfers that touch our memory in `range`, just deregistered (as the
    /// sender fails its transfers that do): started, a WRITE would gather from it, a READ
    /// scatter into it.
    pub(super) fn fail_deferred_touching(&mut self, range: (u64, u64)) {
        let reads = |h: &Held| crate::sender::touches_local(&h.plan, h.kind.is_read(), range);
        self.stats.dereg_failed += self.fail_held_if(reads, XferError::Deregistered);
    }

    /// Completes a transfer that never started with `err`, counted as one submitted and failed.
    fn fail_unstarted(&mut self, xfer: XferId, err: XferError) {
        debug!(xfer = xfer.0, error = %err, "held transfer failed before it started");
        self.stats.submitted += 1;
        self.stats.count_failed(&err);
        self.out.push_back(Action::Complete { xfer, outcome: Err(err) });
    }
}
