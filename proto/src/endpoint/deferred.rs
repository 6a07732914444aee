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

/// What a transfer starts as (at once, or once its hold ends).
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

/// The transfers held back, per peer in submission order (a peer's start together, when its
/// cancel is out: a pass looks at the peers that hold some, not at every transfer held).
#[derive(Debug, Default)]
pub(super) struct Deferred(BTreeMap<PeerId, VecDeque<Held>>);

impl Deferred {
    pub(super) fn len(&self) -> usize {
        self.0.values().map(VecDeque::len).sum()
    }

    fn all(&self) -> impl Iterator<Item = &Held> {
        self.0.values().flatten()
    }

    pub(super) fn contains(&self, xfer: XferId) -> bool {
        self.all().any(|h| h.xfer == xfer)
    }

    pub(super) fn has_peer(&self, peer: PeerId) -> bool {
        self.0.contains_key(&peer)
    }

    /// Adds the peers held transfers wait on to `into`.
    pub(super) fn peers_into(&self, into: &mut BTreeSet<PeerId>) {
        into.extend(self.0.keys().copied());
    }

    /// The earliest deadline of a held transfer.
    pub(super) fn next_timeout(&self) -> Option<Instant> {
        self.all().map(|h| h.deadline).min()
    }
}

impl Endpoint {
    /// Whether a transfer to `peer` submitted now must wait: a cancel of ours to it is pending,
    /// or an earlier transfer to it waits already (they start in order).
    fn defers_to(&self, peer: PeerId) -> bool {
        self.sender.cancel_pending_to(peer) || self.deferred.has_peer(peer)
    }

    /// Submits transfer `xfer`: started at once, or held back (see the module) when its peer
    /// has a cancel of ours pending or transfers held already. An id held is refused to any
    /// other submit: started, the held one would later fail under the same id.
    pub(super) fn submit_or_hold(
        &mut self,
        now: Instant,
        ids: (XferId, Token, PeerId),
        plan: Arc<Plan>,
        kind: HeldKind,
    ) -> Result<(), SubmitError> {
        let (xfer, _, peer) = ids;
        if self.deferred.contains(xfer) {
            return Err(SubmitError::DuplicateXfer { xfer });
        }
        if self.defers_to(peer) {
            return self.defer(now, ids, plan, kind);
        }
        self.start(now, ids, plan, kind)?;
        self.pump(now);
        Ok(())
    }

    /// Starts transfer `xfer` as `kind` says; the caller pumps.
    fn start(
        &mut self,
        now: Instant,
        ids: (XferId, Token, PeerId),
        plan: Arc<Plan>,
        kind: HeldKind,
    ) -> Result<(), SubmitError> {
        match kind {
            HeldKind::Write(route) => self.start_write(now, ids, plan, route),
            HeldKind::Read(mailbox) => self.start_read(now, ids, plan, mailbox),
        }
    }

    /// Holds transfer `xfer` back (see the module): checked now as any submission, so a
    /// refusal still comes from the submit itself.
    fn defer(
        &mut self,
        now: Instant,
        (xfer, token, peer): (XferId, Token, PeerId),
        plan: Arc<Plan>,
        kind: HeldKind,
    ) -> Result<(), SubmitError> {
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
        self.deferred.0.entry(peer).or_default().push_back(Held { xfer, token, peer, plan, kind, deadline });
        Ok(())
    }

    /// Starts the held transfers of each peer that has no cancel of ours pending any more, in
    /// the order submitted.
    pub(super) fn start_deferred(&mut self, now: Instant) {
        if self.deferred.0.is_empty() {
            return;
        }
        let ready: Vec<PeerId> =
            self.deferred.0.keys().copied().filter(|&p| !self.sender.cancel_pending_to(p)).collect();
        for peer in ready {
            for h in self.deferred.0.remove(&peer).unwrap_or_default() {
                let started = self.start(now, (h.xfer, h.token, h.peer), h.plan, h.kind);
                // Admitted when held, its id refused to any other submit since; the engine
                // cannot have begun shutting down (that fails every held transfer). A refusal
                // here is a bug: it fails rather than hang.
                if let Err(e) = started {
                    internal_error("a held transfer refused when started", &e);
                    self.fail_unstarted(h.xfer, XferError::Refused);
                }
            }
        }
    }

    /// Cancels held transfer `xfer`, if it is one: true when it was.
    pub(super) fn cancel_deferred(&mut self, xfer: XferId) -> bool {
        let found = self.deferred.0.iter().find_map(|(&p, q)| q.iter().position(|h| h.xfer == xfer).map(|i| (p, i)));
        let Some((peer, i)) = found else { return false };
        if let Some(q) = self.deferred.0.get_mut(&peer) {
            q.remove(i);
            if q.is_empty() {
                self.deferred.0.remove(&peer);
            }
        }
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
        let mut failed = Vec::new();
        for q in self.deferred.0.values_mut() {
            let (out, kept): (VecDeque<Held>, VecDeque<Held>) = std::mem::take(q).into_iter().partition(&gone);
            *q = kept;
            failed.extend(out);
        }
        self.deferred.0.retain(|_, q| !q.is_empty());
        let gone = failed;
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
