//! The arena ledger of both roles: which part of the engine's one arena is held by whom.
//!
//! Every region carved from the [`Buddy`](crate::buddy::Buddy) has exactly one owner: a remote
//! flow that was granted it (until its scatter ends, or it is reclaimed), an orphaned scatter
//! of a reclaimed flow (until its done-event), or the local sender's gather staging (eager,
//! capped at half the usable capacity, or credit-backed); a region reclaimed from a flow whose
//! writer may still write rests in quarantine, owned by nobody, until its instant passes. This
//! file holds the methods that move regions between those owners and free them, the per-peer
//! byte counts the share cap reads, the getters over them, and the conservation check (free +
//! held + orphaned + local + quarantined == usable capacity). Which flow gets the next region
//! is the fair-share policy's job (`fair.rs`).

use std::collections::BTreeMap;
use std::time::Instant;

use tracing::{debug, trace};

use super::{
    CreditScheduler, EndScatter, Flow, Grant, Held, Local, Reclaimed, Rest, Result, Reuse, Scatter, SchedError,
};
use crate::buddy::Buddy;
use crate::types::{ChunkIdx, FlowKey, PeerId, Region};

impl CreditScheduler {
    /// The grant `flow` holds at `offset`, if it holds that region and its scatter has not
    /// begun: the check for an incoming DATA (a late DATA after a cancel, or one naming another
    /// flow's region, gets `None` and must be dropped).
    pub fn is_held(&self, flow: FlowKey, offset: u64) -> Option<Grant> {
        let held = self.flows.get(&flow)?.held.get(&offset)?;
        if self.scattering.contains_key(&offset) {
            return None;
        }
        Some(Grant { flow, chunk: held.chunk, region: Region { offset, len: held.len } })
    }

    /// Marks `flow`'s region at `offset` as scattering (DATA accepted). It stays held by the
    /// flow, and counts against its window, until [`end_scatter`](Self::end_scatter).
    ///
    /// # Errors
    /// [`SchedError::NotHeld`] when the flow does not hold that region;
    /// [`SchedError::AlreadyScattering`] for a duplicate DATA.
    pub fn begin_scatter(&mut self, flow: FlowKey, offset: u64) -> Result<Grant> {
        self.touch();
        let held =
            *self.flows.get(&flow).and_then(|f| f.held.get(&offset)).ok_or(SchedError::NotHeld { flow, offset })?;
        if self.scattering.contains_key(&offset) {
            return Err(SchedError::AlreadyScattering { offset });
        }
        let scatter = Scatter { flow, chunk: held.chunk, len: held.len, orphaned: false };
        self.scattering.insert(offset, scatter);
        Ok(Grant { flow, chunk: held.chunk, region: Region { offset, len: held.len } })
    }

    /// The region `flow` holds whose scatter (or gather) has not begun, if any: the region a
    /// standing flow keeps for its sender (it holds at most one, [`wire::Standing`]).
    ///
    /// [`wire::Standing`]: crate::wire::Standing
    pub fn idle_held(&self, flow: FlowKey) -> Option<Grant> {
        let f = self.flows.get(&flow)?;
        let (&offset, held) = f.held.iter().find(|(off, _)| !self.scattering.contains_key(off))?;
        Some(Grant { flow, chunk: held.chunk, region: Region { offset, len: held.len } })
    }

    /// The offsets of the regions `flow` holds whose scatter (or gather) has not begun: granted
    /// and waiting for their DATA, or for a READ gathered and waiting for their RELEASE.
    pub fn idle_regions(&self, flow: FlowKey) -> impl Iterator<Item = u64> + '_ {
        let held = self.flows.get(&flow).map(|f| f.held.keys());
        held.into_iter().flatten().copied().filter(|off| !self.scattering.contains_key(off))
    }

    /// Moves the idle region `from` holds at `offset` to flow `to` as its chunk `chunk`, as if
    /// it had been granted there: a standing credit claimed by a new transfer
    /// ([`wire::Standing::Claim`]). Both flows are one peer's, so its held bytes do not change.
    /// `to` must hold nothing and not be stamped, and `chunk` must be numbered and not pending:
    /// the caller queues the chunks after it first (`want_from(to, chunk + 1, ..)`); a `to`
    /// that is not in the scheduler yet is added. `from` is erased when left with nothing.
    /// Call [`schedule`](Self::schedule) afterwards.
    ///
    /// # Errors
    /// [`SchedError::NotHeld`] when `from` does not hold that region idle (or `to` is another
    /// peer's); [`SchedError::CannotAdopt`] for a `to` that breaks the rules above. Nothing
    /// changes then.
    ///
    /// [`wire::Standing::Claim`]: crate::wire::Standing::Claim
    pub fn adopt(&mut self, from: FlowKey, offset: u64, to: FlowKey, chunk: ChunkIdx) -> Result<Grant> {
        self.touch();
        let idle = !self.scattering.contains_key(&offset);
        let held = self.flows.get(&from).and_then(|f| f.held.get(&offset)).copied();
        let Some(held) = held.filter(|_| idle && from.peer == to.peer && from != to) else {
            return Err(SchedError::NotHeld { flow: from, offset });
        };
        let cannot = SchedError::CannotAdopt { flow: to, chunk: chunk.0 };
        if let Some(f) = self.flows.get(&to) {
            let pending = f.pending.front().is_some_and(|&(c, _)| c <= chunk);
            if !f.held.is_empty() || f.blocked.is_some() || f.next_chunk <= u64::from(chunk.0) || pending {
                return Err(cannot);
            }
        }
        let window = self.window as usize;
        if let Some(f) = self.flows.get_mut(&from) {
            let was = Self::is_waiting(f, window);
            f.held.remove(&offset);
            Self::rewait(&mut self.waiting, from.peer, was, Self::is_waiting(f, window));
            if f.pending.is_empty() && f.held.is_empty() {
                self.unblock(from);
                self.flows.remove(&from);
                self.remove_from_ring(from);
                if self.drain == Some(from) {
                    self.drain = None;
                }
            }
        }
        let entry = self.flows.entry(to).or_insert_with(|| {
            self.ring.push(to);
            Flow { next_chunk: u64::from(chunk.0) + 1, ..Flow::default() }
        });
        let was = Self::is_waiting(entry, window);
        entry.held.insert(offset, Held { chunk, len: held.len });
        Self::rewait(&mut self.waiting, to.peer, was, Self::is_waiting(entry, window));
        trace!(?from, ?to, offset, chunk = chunk.0, "region adopted");
        Ok(Grant { flow: to, chunk, region: Region { offset, len: held.len } })
    }

    /// Ends the scatter of the region at `offset` (successful or not) and frees the region. A
    /// flow left with nothing pending or held is erased. When the flow was reclaimed meanwhile
    /// the region was orphaned: it is freed all the same and `orphaned` is set. Call
    /// [`schedule`](Self::schedule) afterwards.
    ///
    /// # Errors
    /// [`SchedError::NotScattering`] when no scatter of that region is in progress.
    pub fn end_scatter(&mut self, offset: u64) -> Result<EndScatter> {
        self.touch();
        let s = self.scattering.remove(&offset).ok_or(SchedError::NotScattering { offset })?;
        if s.orphaned {
            self.orphaned_bytes -= s.len;
        } else if let Some(flow) = self.flows.get_mut(&s.flow) {
            let window = self.window as usize;
            let was = Self::is_waiting(flow, window);
            flow.held.remove(&offset);
            Self::rewait(&mut self.waiting, s.flow.peer, was, Self::is_waiting(flow, window));
            Self::unhold(&mut self.peer_held, s.flow.peer, s.len);
            if flow.pending.is_empty() && flow.held.is_empty() {
                self.flows.remove(&s.flow);
                self.remove_from_ring(s.flow);
                trace!(flow = ?s.flow, "flow done");
            }
        }
        // Hot: the DATA that started this scatter came after its writer's write ended, so no
        // honest writer still reaches the region; reused next, its lines are still in cache.
        let region = self.free_region(offset, true);
        Ok(EndScatter { flow: s.flow, chunk: s.chunk, region, orphaned: s.orphaned })
    }

    /// Ends a job on the region at `offset` that leaves it held (a READ target's gather into
    /// it: the initiator READs it next): the flow holds it again, idle, until it is released
    /// (a `begin_scatter` + `end_scatter`) or reclaimed. When the flow was reclaimed while the
    /// job ran, the region is freed as by [`end_scatter`](Self::end_scatter) instead, and that
    /// is returned.
    ///
    /// # Errors
    /// [`SchedError::NotScattering`] when no job on that region is in progress.
    pub fn end_job(&mut self, offset: u64) -> Result<Option<EndScatter>> {
        self.touch();
        let s = self.scattering.get(&offset).ok_or(SchedError::NotScattering { offset })?;
        if s.orphaned {
            return self.end_scatter(offset).map(Some);
        }
        self.scattering.remove(&offset);
        Ok(None)
    }

    /// Drops `flow`'s pending chunks (nothing more is granted to it) but keeps the regions it
    /// holds, for a READ flow the target can no longer serve: its initiator may still be
    /// reading ready regions, which must not be freed under it before its cancel. A flow left
    /// with nothing held is erased. Unknown flows are ignored.
    pub fn drop_pending(&mut self, key: FlowKey) {
        self.touch();
        self.unblock(key);
        let window = self.window as usize;
        let Some(flow) = self.flows.get_mut(&key) else { return };
        let was = Self::is_waiting(flow, window);
        flow.pending.clear();
        Self::rewait(&mut self.waiting, key.peer, was, false);
        if self.drain == Some(key) {
            self.drain = None;
        }
        if self.flows.get(&key).is_some_and(|f| f.held.is_empty()) {
            self.flows.remove(&key);
            self.remove_from_ring(key);
        }
    }

    /// Cancels `flow`: drops its pending chunks, orphans its regions that are scattering (freed
    /// by their `end_scatter`) and frees the others as `reuse` says: at once, or after a
    /// quarantine. The flow is erased. Unknown flows reclaim nothing. Call
    /// [`schedule`](Self::schedule) afterwards.
    pub fn reclaim_flow(&mut self, flow: FlowKey, reuse: Reuse) -> Reclaimed {
        let mut out = Reclaimed::default();
        self.reclaim_into(flow, reuse, &mut out);
        out
    }

    /// [`reclaim_flow`](Self::reclaim_flow) for every flow of `peer` (peer loss), in key order.
    pub fn reclaim_peer(&mut self, peer: PeerId, reuse: Reuse) -> Reclaimed {
        self.touch();
        let keys: Vec<FlowKey> = self.flows.range(FlowKey::all_of(peer)).map(|(k, _)| *k).collect();
        let mut out = Reclaimed::default();
        for &key in &keys {
            self.reclaim_off_ring(key, reuse, &mut out);
        }
        // Every flow of the peer left `flows` above: one pass takes them out of the ring.
        if !keys.is_empty() {
            self.remove_from_ring_where(|k| k.peer == peer);
        }
        out
    }

    /// Frees the quarantined regions whose instant is at or before `now` (every one with
    /// `None`: the engine is shutting down), earliest first, and returns them. Call
    /// [`schedule`](Self::schedule) afterwards when any came back.
    pub fn lift_quarantine(&mut self, now: Option<Instant>) -> Vec<Region> {
        self.touch();
        let mut lifted = Vec::new();
        while let Some(&(at, offset)) = self.quarantine.by_time.first() {
            if now.is_some_and(|now| at > now) {
                break;
            }
            self.quarantine.by_time.pop_first();
            lifted.push(self.unrest(offset));
        }
        if !lifted.is_empty() {
            trace!(regions = lifted.len(), "quarantine lifted");
        }
        lifted
    }

    /// Frees at once the quarantined regions reclaimed from `flow` (its writer says its writes
    /// have ended: a cancel, sent after them), by ascending offset. Call
    /// [`schedule`](Self::schedule) afterwards when any came back.
    pub fn lift_flow(&mut self, flow: FlowKey) -> Vec<Region> {
        self.touch();
        let lo = (flow, 0);
        let offsets: Vec<u64> =
            self.quarantine.by_flow.range(lo..).take_while(|(f, _)| *f == flow).map(|&(_, o)| o).collect();
        offsets.into_iter().map(|offset| self.unrest(offset)).collect()
    }

    /// Whether regions reclaimed from `flow` are still quarantined.
    pub fn is_resting(&self, flow: FlowKey) -> bool {
        self.quarantine.by_flow.range((flow, 0)..).next().is_some_and(|(f, _)| *f == flow)
    }

    /// Takes the region at `offset` out of the quarantine and frees it (cold: a late write may
    /// have touched it, and nothing makes its lines warm).
    fn unrest(&mut self, offset: u64) -> Region {
        self.touch();
        if let Some(rest) = self.quarantine.regions.remove(&offset) {
            self.quarantine.by_time.remove(&(rest.until, offset));
            self.quarantine.by_flow.remove(&(rest.flow, offset));
            self.quarantine.bytes -= rest.len;
            Self::unhold(&mut self.quarantine.by_peer, rest.flow.peer, rest.len);
        }
        self.free_region(offset, false)
    }

    /// When the next quarantined region may be freed, if any is quarantined.
    pub fn next_lift(&self) -> Option<Instant> {
        self.quarantine.by_time.first().map(|&(at, _)| at)
    }

    /// Bytes of quarantined regions.
    pub fn quarantined_bytes(&self) -> u64 {
        self.quarantine.bytes
    }

    /// The quarantined region that starts at `offset`, if one does.
    pub fn quarantined_at(&self, offset: u64) -> Option<Region> {
        self.quarantine.regions.get(&offset).map(|rest| Region { offset, len: rest.len })
    }

    /// Takes a local gather-staging region for `bytes` bytes from the shared arena. With
    /// `eager` (no credit yet) it is refused when the eager staging would exceed
    /// [`eager_cap`](Self::eager_cap); credit-backed staging is not capped. Drain mode does not
    /// apply. `None` when `bytes` is 0, the cap is hit or no block fits.
    pub fn acquire_local(&mut self, bytes: u64, eager: bool) -> Option<Region> {
        self.touch();
        let len = self.buddy.block_len(bytes)?;
        if eager && self.eager_bytes + len > self.eager_cap() {
            return None;
        }
        let region = self.buddy.alloc(bytes)?;
        self.local.insert(region.offset, Local { len, eager });
        self.local_bytes += len;
        if eager {
            self.eager_bytes += len;
        }
        Some(region)
    }

    /// Turns the eager staging region at `offset` into a credit-backed one (its credit
    /// arrived), so it no longer counts against the eager cap. It frees no arena space, so no
    /// `schedule()` is needed for it.
    ///
    /// # Errors
    /// [`SchedError::NotLocal`] for an unknown offset; [`SchedError::NotEager`] when it is
    /// already credit-backed.
    pub fn promote_local(&mut self, offset: u64) -> Result<()> {
        self.touch();
        let local = self.local.get_mut(&offset).ok_or(SchedError::NotLocal { offset })?;
        if !local.eager {
            return Err(SchedError::NotEager { offset });
        }
        local.eager = false;
        self.eager_bytes -= local.len;
        Ok(())
    }

    /// Gives back the local staging region at `offset`. Call [`schedule`](Self::schedule)
    /// afterwards: the freed bytes may unblock a remote flow.
    ///
    /// # Errors
    /// [`SchedError::NotLocal`] when no local region starts there (for example a double
    /// release).
    pub fn release_local(&mut self, offset: u64) -> Result<Region> {
        self.touch();
        let local = self.local.remove(&offset).ok_or(SchedError::NotLocal { offset })?;
        self.local_bytes -= local.len;
        if local.eager {
            self.eager_bytes -= local.len;
        }
        // Hot: local staging, which no peer writes.
        Ok(self.free_region(offset, true))
    }

    /// Usable arena bytes (capacity rounded down to the granularity).
    pub fn usable_capacity(&self) -> u64 {
        self.buddy.usable_capacity()
    }

    /// The largest chunk a WANT may ask for: the arena's configured max chunk
    /// ([`limit_chunks`](Self::limit_chunks)), at most its largest block. A fully drained
    /// arena can always fit it, which is what makes drain mode terminate.
    pub fn max_chunk_bytes(&self) -> u64 {
        self.buddy.largest_block().min(self.max_chunk)
    }

    /// The eager staging budget: half the usable capacity.
    pub fn eager_cap(&self) -> u64 {
        self.usable_capacity() / 2
    }

    /// Free arena bytes.
    pub fn free_bytes(&self) -> u64 {
        self.buddy.free_bytes()
    }

    /// Bytes of the regions `flow` holds (granted, written or scattering); 0 for unknown flows.
    pub fn flow_held_bytes(&self, flow: FlowKey) -> u64 {
        self.flows.get(&flow).map_or(0, |f| f.held.values().map(|h| h.len).sum())
    }

    /// Number of regions `flow` holds (at most `W`).
    pub fn flow_held_count(&self, flow: FlowKey) -> usize {
        self.flows.get(&flow).map_or(0, |f| f.held.len())
    }

    /// Bytes of local staging regions (eager and credit-backed).
    pub fn local_bytes(&self) -> u64 {
        self.local_bytes
    }

    /// Bytes of eager local staging regions.
    pub fn eager_bytes(&self) -> u64 {
        self.eager_bytes
    }

    /// The embedded allocator, read-only (for inspection and invariant checks).
    pub fn buddy(&self) -> &Buddy {
        &self.buddy
    }

    /// Verifies every invariant; `Err` describes the first violation. Meant for tests, fuzzing
    /// and simulations (it walks the whole state).
    ///
    /// Checked: the buddy's own invariants; every allocated block has exactly one owner (a
    /// flow's held set, an orphaned scatter, local staging, or the quarantine) and every owned
    /// region is an allocated block (so owned regions never overlap); free + held + orphaned +
    /// local + quarantined bytes == usable capacity, and the quarantine's indexes agree;
    /// each flow holds at most `W` regions and is not finished; the eager counter is exact and
    /// within the cap; the ring lists each active flow exactly once; scatter and drain
    /// bookkeeping is consistent (the fair-share half is
    /// `check_fair_share`, in `fair.rs`).
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        self.buddy.check_invariants()?;
        let mut owners: BTreeMap<u64, (u64, String)> = BTreeMap::new();
        let mut claim = |offset: u64, len: u64, who: String| match owners.insert(offset, (len, who)) {
            Some((_, first)) => Err(format!("region {offset:#x} owned twice: {first} and another")),
            None => Ok(()),
        };
        let mut held_bytes = 0;
        for (key, flow) in &self.flows {
            if flow.held.len() > self.window as usize {
                return Err(format!("{key:?} holds {} regions > W = {}", flow.held.len(), self.window));
            }
            if flow.pending.is_empty() && flow.held.is_empty() {
                return Err(format!("{key:?} is finished but not erased"));
            }
            for (&off, h) in &flow.held {
                claim(off, h.len, format!("{key:?}"))?;
                held_bytes += h.len;
            }
        }
        let mut orphaned = 0;
        for (&off, s) in &self.scattering {
            let holder = self.flows.get(&s.flow).and_then(|f| f.held.get(&off));
            match (s.orphaned, holder) {
                (false, Some(h)) if h.len == s.len => {}
                (true, None) => {
                    claim(off, s.len, "orphaned scatter".into())?;
                    orphaned += s.len;
                }
                _ => {
                    return Err(format!("scatter of {off:#x} disagrees with {:?}'s held set", s.flow));
                }
            }
        }
        let (mut local, mut eager) = (0, 0);
        for (&off, l) in &self.local {
            claim(off, l.len, "local staging".into())?;
            local += l.len;
            eager += if l.eager { l.len } else { 0 };
        }
        let mut quarantined = 0;
        for (&off, rest) in &self.quarantine.regions {
            claim(off, rest.len, "quarantine".into())?;
            quarantined += rest.len;
        }
        let q = &self.quarantine;
        let timed = q.by_time.len() == q.regions.len()
            && q.by_time.iter().all(|&(at, o)| q.regions.get(&o).is_some_and(|r| r.until == at));
        let flowed = q.by_flow.len() == q.regions.len()
            && q.by_flow.iter().all(|&(f, o)| q.regions.get(&o).is_some_and(|r| r.flow == f));
        if !(timed && flowed) {
            return Err("the quarantine's indexes disagree with its regions".into());
        }
        let mut resting: BTreeMap<PeerId, u64> = BTreeMap::new();
        for rest in self.quarantine.regions.values() {
            *resting.entry(rest.flow.peer).or_default() += rest.len;
        }
        if quarantined != self.quarantine.bytes || resting != self.quarantine.by_peer {
            return Err("quarantined byte counters drifted".into());
        }
        let allocated: Vec<Region> = self.buddy.allocated_regions().collect();
        let owned: Vec<Region> = owners.iter().map(|(&offset, &(len, _))| Region { offset, len }).collect();
        if allocated != owned {
            return Err(format!("allocated blocks {allocated:?} != owned regions {owned:?}"));
        }
        let total = self.free_bytes() + held_bytes + orphaned + local + quarantined;
        if total != self.usable_capacity() {
            return Err(format!(
                "conservation: free+held+orphaned+local+quarantined = {total} != {}",
                self.usable_capacity()
            ));
        }
        if (orphaned, local, eager) != (self.orphaned_bytes, self.local_bytes, self.eager_bytes) {
            return Err("orphaned/local/eager byte counters drifted".into());
        }
        if self.eager_bytes > self.eager_cap() {
            return Err(format!("eager bytes {} exceed the cap {}", self.eager_bytes, self.eager_cap()));
        }
        let mut per_peer: BTreeMap<PeerId, u64> = BTreeMap::new();
        for (k, f) in &self.flows {
            let b: u64 = f.held.values().map(|h| h.len).sum();
            if b > 0 {
                *per_peer.entry(k.peer).or_default() += b;
            }
        }
        if per_peer != self.peer_held {
            return Err(format!("per-peer held bytes drifted: {:?} != {per_peer:?}", self.peer_held));
        }
        self.check_fair_share()
    }

    pub(super) fn unhold(peer_held: &mut BTreeMap<PeerId, u64>, peer: PeerId, len: u64) {
        if let Some(h) = peer_held.get_mut(&peer) {
            *h = h.saturating_sub(len);
            if *h == 0 {
                peer_held.remove(&peer);
            }
        }
    }

    pub(super) fn reclaim_into(&mut self, key: FlowKey, reuse: Reuse, out: &mut Reclaimed) {
        if self.reclaim_off_ring(key, reuse, out) {
            self.remove_from_ring(key);
        }
    }

    /// [`reclaim_into`](Self::reclaim_into) but for taking the flow out of the ring, which the
    /// caller does (for many flows at once, in [`reclaim_peer`](Self::reclaim_peer)); whether
    /// the flow was there.
    fn reclaim_off_ring(&mut self, key: FlowKey, reuse: Reuse, out: &mut Reclaimed) -> bool {
        self.touch();
        self.unblock(key);
        let Some(flow) = self.flows.remove(&key) else {
            return false;
        };
        Self::rewait(&mut self.waiting, key.peer, Self::is_waiting(&flow, self.window as usize), false);
        if self.drain == Some(key) {
            self.drain = None;
        }
        let (freed, quarantined, deferred) = (out.freed.len(), out.quarantined.len(), out.deferred.len());
        for (offset, held) in flow.held {
            Self::unhold(&mut self.peer_held, key.peer, held.len);
            let region = Region { offset, len: held.len };
            match (self.scattering.get_mut(&offset), reuse) {
                (Some(s), _) => {
                    s.orphaned = true;
                    self.orphaned_bytes += held.len;
                    out.deferred.push(region);
                }
                // Cold: nothing writes it any more, but nothing warmed it either.
                (None, Reuse::Now) => out.freed.push(self.free_region(offset, false)),
                (None, Reuse::After(at)) => {
                    self.quarantine.regions.insert(offset, Rest { len: held.len, flow: key, until: at });
                    self.quarantine.by_time.insert((at, offset));
                    self.quarantine.by_flow.insert((key, offset));
                    *self.quarantine.by_peer.entry(key.peer).or_default() += held.len;
                    self.quarantine.bytes += held.len;
                    out.quarantined.push(region);
                }
            }
        }
        debug!(
            flow = ?key,
            pending = flow.pending.len(),
            freed = out.freed.len() - freed,
            quarantined = out.quarantined.len() - quarantined,
            deferred = out.deferred.len() - deferred,
            "flow reclaimed"
        );
        true
    }

    /// Frees a region this scheduler owns, `hot` ([`Buddy::free_hot`]) when nothing can still
    /// write into it; failure means the bookkeeping is corrupt.
    pub(super) fn free_region(&mut self, offset: u64, hot: bool) -> Region {
        self.touch();
        let freed = if hot { self.buddy.free_hot(offset) } else { self.buddy.free(offset) };
        match freed {
            Ok(region) => region,
            Err(e) => panic!("scheduler bookkeeping out of sync with its allocator: {e}"),
        }
    }
}
