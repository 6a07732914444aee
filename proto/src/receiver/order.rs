//! A flow that ends here while its scatters still run (its sender released or failed the
//! transfer, we refused or reclaimed it) leaves those scatters to finish: they copy from its
//! regions into the application's memory until they end. Its sender's next transfer to the same
//! destination, a full control exchange later, could otherwise be scattered by another copy
//! worker at the same time and end first, reporting SUCCESS before the old bytes land over
//! it. Plain UCX posts both on one endpoint, whose writes land in post order; so do we: while a
//! peer has such orphaned scatters running, its valid DATAs wait here (their regions stay held)
//! and are taken, checked again, once the last orphan has ended. Only that peer waits, and only
//! in that window.
//!
//! A READ's gathers wait the same way: the initiator holds its READs behind the cancel it owes
//! (the endpoint's `deferred`), so a PULL that comes while the peer's orphans run was posted
//! after the release; gathered at once, it could read the destinations half old and half
//! released bytes, where one UCX endpoint would have landed the released write first.

use std::collections::BTreeMap;

use super::*;

/// A DATA held back, with the inline bytes it carries (see `take_data`).
type HeldData = (Data, Option<Vec<u8>>);

/// Per peer, its orphaned scatters running and the DATAs they hold back.
#[derive(Debug, Default)]
pub(super) struct Behind {
    /// Orphaned scatters still running, per peer (never 0: an entry goes with its last one).
    orphans: BTreeMap<PeerId, u32>,
    /// DATAs held, per peer with orphans, in arrival order, each with its inline bytes.
    held: BTreeMap<PeerId, Vec<HeldData>>,
    /// READ gathers held, per peer with orphans: the flow, its token and the credits granted.
    gathers: BTreeMap<PeerId, Vec<(FlowKey, Token, Vec<Credit>)>>,
}

impl Behind {
    /// Whether `peer`'s DATAs wait: some of its orphaned scatters still run.
    pub(super) fn holds(&self, peer: PeerId) -> bool {
        self.orphans.contains_key(&peer)
    }

    /// Holds the gathers of READ flow `key` into `credits` (just granted) while `key.peer` has
    /// orphaned scatters running; false (nothing held) when it has none.
    pub(super) fn hold_gathers(&mut self, key: FlowKey, token: Token, credits: &[Credit]) -> bool {
        if !self.holds(key.peer) {
            return false;
        }
        self.gathers.entry(key.peer).or_default().push((key, token, credits.to_vec()));
        true
    }

    /// Whether the gather of flow `key` into `region` is held (so nothing is there to READ).
    pub(super) fn holds_gather(&self, key: FlowKey, region: Region) -> bool {
        self.gathers
            .get(&key.peer)
            .is_some_and(|h| h.iter().any(|(k, _, credits)| *k == key && credits.iter().any(|c| c.region == region)))
    }

    /// Regions of flow `key` granted whose gathers are held.
    pub(super) fn gathers_held_of(&self, key: FlowKey) -> usize {
        self.gathers.get(&key.peer).map_or(0, |h| h.iter().filter(|(k, ..)| *k == key).map(|(.., c)| c.len()).sum())
    }

    /// DATAs of flow `key` held.
    pub(super) fn held_of(&self, key: FlowKey) -> usize {
        self.held.get(&key.peer).map_or(0, |h| h.iter().filter(|(d, _)| d.xfer == key.xfer).count())
    }
}

impl Receiver {
    /// Holds a DATA of flow `key` that passed every check, until its peer's orphaned scatters
    /// have ended. A second DATA for a chunk already held is refused as one for a region
    /// already scattering is, so the held DATAs stay within the regions the peer holds. Its
    /// runs (checked against `limit`) are kept as the chunk's plan, in the peer's budget as a
    /// PLAN's are; over it they are dropped, and the DATA taken again asks for them
    /// (ACK(Replan)) as one whose plan was dropped does.
    pub(super) fn hold_data(
        &mut self,
        ctx: &mut Ctx<'_>,
        key: FlowKey,
        mut data: Data,
        inline: Option<Vec<u8>>,
        limit: u64,
    ) -> Result<(), ProtocolError> {
        let dup = self
            .behind
            .held
            .get(&key.peer)
            .is_some_and(|h| h.iter().any(|(d, _)| d.xfer == data.xfer && d.chunk == data.chunk));
        if dup {
            return self.refuse_data(ctx, key.peer, &data, DataFault::NotHeld);
        }
        let runs = std::mem::take(&mut data.runs);
        let n = runs.len() as u64;
        let load = self.load.get(&key.peer).copied().unwrap_or_default();
        let fits = n > 0 && load.chunks.saturating_add(n) <= self.caps.chunks && self.within_total(n).is_ok();
        let removals = self.registered.removals();
        if let Some(flow) = self.flows.get_mut(&key).filter(|_| fits) {
            flow.plans.insert(data.chunk.0, Planned { runs, removals, limit });
            self.load.entry(key.peer).or_default().chunks += n;
        }
        trace!(peer = key.peer.0, xfer = key.xfer.0, chunk = data.chunk.0, "DATA held behind an orphaned scatter");
        self.behind.held.entry(key.peer).or_default().push((data, inline));
        ctx.stats.scatters_held += 1;
        // Waiting for our own copies is not its sender's silence.
        if let Some(flow) = self.flows.get_mut(&key) {
            flow.progressed(ctx.now, self.idle_timeout);
        }
        Ok(())
    }

    /// Flow `key` ended here: its scatters still running become orphans of its peer, and its
    /// held DATAs are dropped (nobody waits for them).
    pub(super) fn orphan_scatters_of(&mut self, key: FlowKey) {
        let mut n = 0;
        for s in self.scatters.values_mut().filter(|s| s.flow == key && !s.orphan) {
            s.orphan = true;
            n += 1;
        }
        if n > 0 {
            *self.behind.orphans.entry(key.peer).or_default() += n;
        }
        if let Some(held) = self.behind.held.get_mut(&key.peer) {
            held.retain(|(d, _)| d.xfer != key.xfer);
        }
        // Its granted regions are reclaimed with it: none is gathering.
        if let Some(held) = self.behind.gathers.get_mut(&key.peer) {
            held.retain(|(k, ..)| *k != key);
        }
    }

    /// An orphaned scatter of `peer` ended; after its last one, the DATAs it held back are
    /// taken in the order they came (each checked again: a registration may have gone since).
    pub(super) fn orphan_ended(&mut self, ctx: &mut Ctx<'_>, peer: PeerId) {
        let Some(n) = self.behind.orphans.get_mut(&peer) else {
            return internal_error("an orphaned scatter of a peer with none counted", &peer.0);
        };
        *n -= 1;
        if *n > 0 {
            return;
        }
        self.behind.orphans.remove(&peer);
        for (key, token, credits) in self.behind.gathers.remove(&peer).unwrap_or_default() {
            self.start_gathers(ctx, key, token, &credits);
        }
        for (data, inline) in self.behind.held.remove(&peer).unwrap_or_default() {
            // A refusal among them may orphan more scatters: the rest are then held again.
            if let Err(e) = self.take_data(ctx, peer, data, inline) {
                ctx.stats.protocol_errors += 1;
                debug!(peer = peer.0, error = %e, "a held DATA refused");
            }
        }
    }

    /// Drops what is held for `peer`, whose id is retired (its flows are gone).
    pub(super) fn drop_held_of(&mut self, peer: PeerId) {
        self.behind.held.remove(&peer);
        self.behind.gathers.remove(&peer);
    }

    /// The orphans counted per peer are the scatters marked so, and DATAs and gathers are held
    /// only for a peer with orphans (else nothing would take them).
    pub(super) fn check_behind(&self) -> Result<(), String> {
        let mut recount: BTreeMap<PeerId, u32> = BTreeMap::new();
        for s in self.scatters.values().filter(|s| s.orphan) {
            *recount.entry(s.flow.peer).or_default() += 1;
        }
        if recount != self.behind.orphans {
            return Err(format!(
                "orphans counted {:?} but the scatters marked add up to {recount:?}",
                self.behind.orphans
            ));
        }
        if let Some(p) = self.behind.held.keys().find(|p| !self.behind.orphans.contains_key(p)) {
            return Err(format!("DATAs held for peer {} with no orphaned scatter running", p.0));
        }
        match self.behind.gathers.keys().find(|p| !self.behind.orphans.contains_key(p)) {
            Some(p) => Err(format!("gathers held for peer {} with no orphaned scatter running", p.0)),
            None => Ok(()),
        }
    }
}
