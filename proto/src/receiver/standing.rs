//! Standing credits at the receiver (docs/control-hops.md): a sender's standing flow holds one
//! region for its later transfers to claim with the flow's token; the region comes back with
//! the claimer's ACK (`AckStatus::Kept`), or the standing flow is granted a fresh one.

use super::*;

impl Receiver {
    /// A WANT that opens `from`'s standing flow ([`Standing::Open`]; `load`: the peer's load
    /// with it). Refused (the sender then uses the full exchange) when this receiver gives no
    /// standing credit of that size, the peer has one already, the standing share of the arena
    /// is taken, or the WANT asks for mailbox answers (one way: no GRANT could reach it).
    pub(super) fn open_standing(
        &mut self,
        ctx: &mut Ctx<'_>,
        from: PeerId,
        want: Want,
        load: PeerLoad,
    ) -> Result<(), ProtocolError> {
        let key = FlowKey { peer: from, xfer: want.xfer };
        let bytes = want.chunks[0];
        let sched = ctx.sched(want.arena);
        // The share counts the blocks the regions take, not the bytes asked: a standing flow
        // of one byte holds a granularity block (review 61, credits L2: 1-byte asks under
        // many loaded names held blocks far past the share while counting a byte each).
        let block = |b: u64| sched.buddy().block_len(b).unwrap_or(b);
        let held: u64 = self.standing.values().map(|&(_, b)| block(b)).sum();
        let share = sched.usable_capacity() / STANDING_SHARE;
        let fits = bytes <= self.standing_bytes.min(sched.max_chunk_bytes()) && held + block(bytes) <= share;
        let fresh = !self.standing.contains_key(&from) && !self.flows.contains_key(&key);
        // What the decoder refuses too (`Msg::validate`), for messages handed in directly.
        let bare = want.chunks.len() == 1 && want.inline.is_none() && want.proofs.is_empty();
        if !fits || !fresh || !bare || want.endpoint == wire::REPLY_MAILBOX {
            debug!(peer = from.0, xfer = want.xfer.0, bytes, fits, fresh, "standing flow refused");
            ctx.stats.standing_refused += 1;
            refuse_want(ctx, from, &want);
            return Ok(());
        }
        if let Err(source) = ctx.sched(want.arena).want(key, &want.chunks) {
            refuse_want(ctx, from, &want);
            return Err(ProtocolError::BadWant { peer: from, xfer: want.xfer, source });
        }
        self.load.insert(from, load);
        self.standing.insert(from, (want.xfer, bytes));
        // Leased like any grant: a region left unclaimed for the idle timeout is reclaimed with
        // the flow (its sender claims none older than half that, and opens a new one).
        let deadline = ctx.now + self.idle_timeout;
        self.timers.set(key, deadline);
        let flow = Flow {
            token: want.token,
            arena: want.arena,
            proven: Vec::new(),
            chunks: want.chunks,
            scattering: 0,
            pull: None,
            plans: BTreeMap::new(),
            replanned: BTreeSet::new(),
            inline: None,
            standing: true,
            claimed_from: None,
            deadline,
            progress: ctx.now,
            given: None,
            frozen: false,
        };
        self.flows.insert(key, flow);
        ctx.stats.standing_opened += 1;
        debug!(peer = from.0, xfer = want.xfer.0, bytes, "standing flow opened");
        Ok(())
    }

    /// The region `from`'s standing flow `xfer` holds, for `want`'s chunk 0 to claim
    /// ([`Standing::Claim`] with `token`). A claim without the standing flow's token is a
    /// forgery: not answered, nothing changes. A claim of a standing flow that is gone or holds
    /// no region (not granted yet, or claimed already), one too small for the chunk, or one
    /// for a flow that exists already or is answered one way, or one of a transfer at or below
    /// the newest that claimed (a replay: transfer ids only grow), refuses the WANT. The sender may
    /// be writing into the region already: it stays the standing flow's until the sender's
    /// cancel, which comes after its writes.
    pub(super) fn claimable(
        &self,
        ctx: &mut Ctx<'_>,
        from: PeerId,
        want: &Want,
        xfer: XferId,
        token: Token,
    ) -> Result<SchedGrant, ProtocolError> {
        let key = FlowKey { peer: from, xfer: want.xfer };
        let standing = FlowKey { peer: from, xfer };
        // The claimed region lies in the standing flow's arena: the claimer's must be the same.
        let Some(flow) = self.flows.get(&standing).filter(|f| f.standing && f.arena == want.arena) else {
            refuse_want(ctx, from, want);
            return Err(ProtocolError::BadClaim { peer: from, xfer: want.xfer });
        };
        if flow.token != token {
            ctx.stats.control_forged += 1;
            return Err(ProtocolError::WrongToken { peer: from, xfer });
        }
        let region = ctx.sched(want.arena).idle_held(standing);
        let usable = region.filter(|g| g.region.len >= want.chunks[0]);
        let fresh = self.replay_of(from).and_then(|r| r.claim_floor).is_none_or(|floor| want.xfer > floor);
        match usable {
            Some(g) if fresh && !self.flows.contains_key(&key) && want.endpoint != wire::REPLY_MAILBOX => Ok(g),
            _ => {
                refuse_want(ctx, from, want);
                Err(ProtocolError::BadClaim { peer: from, xfer: want.xfer })
            }
        }
    }

    /// Ends the scatter of the region flow `key`'s claimed chunk 0 was written in, and gives
    /// the region back to the standing flow `xfer` it came from, as that flow's idle region:
    /// `Some(true)`. `None`, the scatter left as it was, when the standing flow is gone or holds
    /// or waits for another region (a claim failed first); `Some(false)` when the flow was
    /// reclaimed while the scatter ran (the region is freed).
    pub(super) fn keep_standing(
        &mut self,
        ctx: &mut Ctx<'_>,
        key: FlowKey,
        xfer: XferId,
        (arena, region): (ArenaId, Region),
    ) -> Option<bool> {
        let standing = FlowKey { peer: key.peer, xfer };
        // The claim named the standing flow's arena (`claimable`): the region lies there.
        let same_arena = self.flows.get(&standing).is_some_and(|f| f.standing && f.arena == arena);
        if self.shutting_down || !same_arena || ctx.scheds.has_flow(standing) {
            return None;
        }
        match ctx.sched(arena).end_job(region.offset) {
            Ok(None) => {}
            Ok(Some(_)) => return Some(false),
            Err(e) => {
                internal_error("end the scatter of a claimed region", &e);
                return Some(false);
            }
        }
        if let Err(e) = ctx.sched(arena).adopt(key, region.offset, standing, ChunkIdx(0)) {
            // Unreachable (checked above); the region stays the flow's, idle, until its reclaim.
            internal_error("give a claimed region back to its standing flow", &e);
            return Some(false);
        }
        // A fresh lease, as for a grant.
        self.given_at.insert((arena, region.offset), ctx.now);
        let deadline = ctx.now + self.idle_timeout;
        if let Some(f) = self.flows.get_mut(&standing) {
            f.deadline = deadline;
        }
        self.timers.set(standing, deadline);
        ctx.stats.standing_kept += 1;
        trace!(peer = key.peer.0, xfer = key.xfer.0, region = %region, "claimed region kept for the standing flow");
        Some(true)
    }

    /// Asks the scheduler for a fresh region for `peer`'s standing flow when it holds none and
    /// waits for none: the region its last claim took will not come back.
    pub(super) fn rearm_standing(&mut self, ctx: &mut Ctx<'_>, peer: PeerId) {
        let Some(&(xfer, bytes)) = self.standing.get(&peer) else { return };
        let key = FlowKey { peer, xfer };
        let Some(arena) = self.flows.get(&key).map(|f| f.arena) else { return };
        if self.shutting_down || ctx.scheds.has_flow(key) {
            return;
        }
        if let Err(e) = ctx.sched(arena).want(key, &[bytes]) {
            internal_error("re-arm a standing flow", &e);
        }
    }
}
