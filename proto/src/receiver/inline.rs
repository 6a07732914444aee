//! Inline chunks at the receiver: a one-chunk WRITE's bytes and runs carried in its WANT, held
//! (bounded by [`MAX_INLINE_HELD`]) until the chunk's region is granted, then put there and
//! scattered with no GRANT sent.

use super::*;

impl Receiver {
    /// Takes an inline chunk from a new flow's WANT when this receiver may: it takes inline
    /// chunks of this size into the flow's arena, the transfer is newer than any inline one
    /// taken from the peer (not a replay), and holding the bytes stays within
    /// [`MAX_INLINE_HELD`] and the runs within the peer's budget and all peers' (`units`: the
    /// peer's load with this WANT's chunks, and those chunks alone, not yet counted in the
    /// total). Otherwise the flow is served the usual way. A one-way flow's answer (the ACK)
    /// goes to its mailbox like any other.
    pub(super) fn take_inline(
        &mut self,
        from: PeerId,
        (xfer, arena): (XferId, ArenaId),
        (units, wanted): (u64, u64),
        inline: wire::Inline,
    ) -> Option<wire::Inline> {
        let len = inline.bytes.len() as u64;
        let fresh = self.replay_of(from).and_then(|r| r.inline_floor).is_none_or(|floor| xfer > floor);
        let runs = inline.runs.len() as u64;
        let budget =
            units.saturating_add(runs) <= self.caps.chunks && self.within_total(wanted.saturating_add(runs)).is_ok();
        let into = self.inline_declined & inline_bit(arena) == 0;
        let take = len <= self.inline_bytes && into && fresh && budget && self.inline_held + len <= MAX_INLINE_HELD;
        if !take {
            debug!(peer = from.0, xfer = xfer.0, bytes = len, fresh, "inline bytes declined");
            return None;
        }
        self.replay_mut(from).inline_floor = Some(xfer);
        self.inline_held += len;
        Some(inline)
    }

    /// The inline chunk flow `key` holds, if any, given back to the budgets it was held in.
    pub(super) fn untake_inline(&mut self, key: FlowKey) -> Option<wire::Inline> {
        let inline = self.flows.get_mut(&key)?.inline.take()?;
        self.inline_held -= inline.bytes.len() as u64;
        if let Some(load) = self.load.get_mut(&key.peer) {
            load.chunks -= inline.runs.len() as u64;
        }
        Some(inline)
    }

    /// Flow `key`'s inline chunk, its region just granted: instead of a GRANT, the bytes go in
    /// the region and are scattered as that region's DATA would be (every check included); the
    /// ACK answers the WANT.
    pub(super) fn scatter_inline(
        &mut self,
        ctx: &mut Ctx<'_>,
        key: FlowKey,
        token: Token,
        region: Region,
        inline: wire::Inline,
    ) {
        let wire::Inline { runs, bytes } = inline;
        let data = Data { xfer: key.xfer, token, chunk: ChunkIdx(0), region, runs, region_plan_runs: 0 };
        trace!(peer = key.peer.0, xfer = key.xfer.0, region = %region, bytes = bytes.len(), "inline chunk");
        if let Err(e) = self.take_data(ctx, key.peer, data, Some(bytes)) {
            ctx.stats.protocol_errors += 1;
            debug!(peer = key.peer.0, error = %e, "inline chunk refused");
        }
    }
}
