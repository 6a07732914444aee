//! Standing credits at the sender (docs/control-hops.md): the first two-way WRITE to a peer
//! also opens a standing flow there, whose region a later WANT claims (`Standing::Claim` with
//! the flow's token) so that its chunk 0 is written at submit, with no WANT -> GRANT.

use super::*;

impl Sender {
    /// Opens our standing flow at `peer` (see [`wire::Standing`]) when we have none there and
    /// the peer has not refused one. Named after transfer `xfer`, whose submit opens it, with
    /// a token derived from that transfer's.
    pub(super) fn open_standing(
        &mut self,
        ctx: &mut Ctx<'_>,
        xfer: XferId,
        token: Token,
        peer: PeerId,
        arena: ArenaId,
    ) {
        if self.standing_bytes == 0 || self.standing.contains_key(&peer) || self.no_standing.contains(&peer) {
            return;
        }
        let id = XferId(xfer.0 | STANDING_XFER_BIT);
        let token = Token(u128::from_le_bytes(proof::tag(&STANDING_TOKEN_KEY, token)));
        let bytes = self.standing_bytes;
        let want = Want {
            xfer: id,
            token,
            arena,
            endpoint: self.endpoint.clone(),
            chunks: vec![bytes],
            proofs: Vec::new(),
            inline: None,
            standing: Standing::Open,
        };
        ctx.send(peer, want);
        self.standing.insert(peer, StandingSlot { xfer: id, token, bytes, arena, region: None, awaited: ctx.now });
        ctx.stats.standing_opened_out += 1;
        debug!(peer = peer.0, xfer = id.0, bytes, "standing flow opened");
    }

    /// Whether the grant our standing flow at `peer` awaits was lost: awaited half a timeout
    /// (a GRANT answers a WANT within a round trip, an ACK(Kept) its claimer's chunk 0) with no
    /// transfer of ours that claimed it still in flight (its write may still be on the way into
    /// the region, and its own end settles the flow). Frames can be lost, and nothing else ever
    /// asked again: standing credits to that peer stayed off for its life.
    pub(super) fn standing_grant_lost(&self, now: Instant, peer: PeerId) -> bool {
        self.standing.get(&peer).is_some_and(|slot| {
            slot.region.is_none()
                && now >= slot.awaited + self.timeout / 2
                && !self.xfers.values().any(|x| x.peer == peer && x.claimed.is_some_and(|(c, _)| c == slot.xfer))
        })
    }

    /// Ends our standing flow at `peer`, if any: forgotten here and, with `cancel`, canceled
    /// there now (nothing of ours is being written into its region).
    pub(super) fn close_standing(&mut self, ctx: &mut Ctx<'_>, peer: PeerId, cancel: bool) {
        if let Some(slot) = self.standing.remove(&peer) {
            if cancel {
                ctx.send(peer, Msg::cancel(slot.xfer, slot.token, self.endpoint.clone()));
            }
            self.tombstone(ctx.now, slot.xfer, peer);
        }
    }

    /// A GRANT or ACK for our standing flow at `from`, if `xfer` names it: `None` otherwise.
    pub(super) fn standing_msg(
        &mut self,
        ctx: &mut Ctx<'_>,
        from: PeerId,
        xfer: XferId,
        token: Token,
    ) -> Option<Result<&mut StandingSlot, ProtocolError>> {
        let slot = self.standing.get_mut(&from).filter(|s| s.xfer == xfer)?;
        if slot.token != token {
            ctx.stats.control_forged += 1;
            return Some(Err(ProtocolError::WrongToken { peer: from, xfer }));
        }
        Some(Ok(slot))
    }
}
