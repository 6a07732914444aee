//! The fair-share policy: which remote flow gets the next arena region.
//!
//! It owns the demand side of the flow table (each flow's pending chunks and their numbering)
//! and the order in which it is served: the round-robin ring and its cursor, the grant
//! sequence, the stamps of flows whose head chunk did not fit and the drain mode they lead to
//! (the design's `kBypassRounds`), and the per-peer share cap with the count of waiting flows
//! per peer it needs. It takes regions from the arena and records them through the ledger
//! (`ledger.rs`), and never frees one itself except through it.

use std::collections::{BTreeMap, BTreeSet};

use tracing::{debug, trace};

use super::{BYPASS_ROUNDS, Blocked, CreditScheduler, Flow, Grant, Held, Result, SchedError};
use crate::types::{ChunkIdx, FlowKey, PeerId};

/// Why a flow could not be granted its head chunk.
pub(super) enum Miss {
    /// Nothing pending or window full: skip it.
    NotEligible,
    /// Eligible, but the head chunk does not fit in the arena now.
    NoFit,
}

impl CreditScheduler {
    /// Queues `chunks` (byte sizes) behind whatever `flow` already has pending. The flow's
    /// chunks are numbered 0, 1, 2, ... across all its WANTs; a new flow joins the back of the
    /// ring. An empty `chunks` does nothing (a cancel is [`reclaim_flow`](Self::reclaim_flow)).
    /// Call [`schedule`](Self::schedule) afterwards.
    ///
    /// # Errors
    /// [`SchedError::EmptyChunk`], [`SchedError::ChunkTooLarge`] (above
    /// [`max_chunk_bytes`](Self::max_chunk_bytes)) or [`SchedError::TooManyChunks`]; then no
    /// chunk of this WANT is queued.
    pub fn want(&mut self, flow: FlowKey, chunks: &[u64]) -> Result<()> {
        let next = self.flows.get(&flow).map_or(0, |f| f.next_chunk);
        self.want_from(flow, next, chunks)
    }

    /// As [`want`](Self::want), numbering the chunks from `first`: a READ's later PULL names
    /// its first chunk, and the flow's earlier chunks may all have ended (and the flow left
    /// the scheduler) before it came.
    ///
    /// # Errors
    /// As [`want`](Self::want); [`SchedError::ChunkOrder`] when `first` is below the flow's
    /// next chunk.
    pub fn want_from(&mut self, flow: FlowKey, first: u64, chunks: &[u64]) -> Result<()> {
        let max = self.max_chunk_bytes();
        for (index, &bytes) in chunks.iter().enumerate() {
            if bytes == 0 {
                return Err(SchedError::EmptyChunk { flow, index });
            }
            if bytes > max {
                return Err(SchedError::ChunkTooLarge { flow, bytes, max });
            }
        }
        let queued = self.flows.get(&flow).map_or(0, |f| f.next_chunk);
        if first < queued {
            return Err(SchedError::ChunkOrder { flow, first, next: queued });
        }
        let next = first;
        if next + chunks.len() as u64 > 1 << 32 {
            return Err(SchedError::TooManyChunks { flow });
        }
        if chunks.is_empty() {
            return Ok(());
        }
        self.touch();
        let window = self.window as usize;
        let entry = self.flows.entry(flow).or_insert_with(|| {
            self.ring.push(flow);
            Flow::default()
        });
        let was = Self::is_waiting(entry, window);
        for (i, &bytes) in chunks.iter().enumerate() {
            // In range: checked against 2^32 above.
            entry.pending.push_back((ChunkIdx((next + i as u64) as u32), bytes));
        }
        entry.next_chunk = next + chunks.len() as u64;
        let now = Self::is_waiting(entry, window);
        Self::rewait(&mut self.waiting, flow.peer, was, now);
        trace!(?flow, chunks = chunks.len(), "want");
        Ok(())
    }

    /// Hands out as many credits as the rules allow (see the type docs) and returns them in
    /// grant order. The caller sends each to `grant.flow.peer`.
    pub fn schedule(&mut self) -> Vec<Grant> {
        let mut grants = Vec::new();
        loop {
            if self.drain.is_none() {
                self.drain = self.blocked.first().filter(|(b, _)| b.deadline <= self.grant_seq).map(|&(_, key)| key);
                if let Some(flow) = self.drain {
                    debug!(?flow, seq = self.grant_seq, "drain mode: holding remote grants");
                }
            }
            if let Some(key) = self.drain {
                match self.try_grant(key) {
                    Ok(grant) => {
                        debug!(flow = ?key, "drain mode: head granted");
                        self.drain = None;
                        grants.push(grant);
                    }
                    Err(Miss::NoFit) => break,
                    Err(Miss::NotEligible) => {
                        self.touch();
                        // Unreachable while the stamp invariant holds (a stamped flow gets no
                        // grant, so its window cannot fill); drop every stamp of it rather
                        // than pick it again and spin.
                        self.unblock(key);
                        self.blocked.retain(|(_, k)| *k != key);
                        self.drain = None;
                    }
                }
            } else if let Some(grant) = self.sweep() {
                grants.push(grant);
            } else {
                break;
            }
        }
        grants
    }

    /// The per-flow window `W`.
    pub fn window(&self) -> u32 {
        self.window
    }

    /// Chunks `flow` still waits to be granted.
    pub fn pending_chunks(&self, flow: FlowKey) -> usize {
        self.flows.get(&flow).map_or(0, |f| f.pending.len())
    }

    /// Number of flows with pending chunks or held regions.
    pub fn active_flows(&self) -> usize {
        self.flows.len()
    }

    /// True when `flow` is active.
    pub fn has_flow(&self, flow: FlowKey) -> bool {
        self.flows.contains_key(&flow)
    }

    /// The flow drain mode is waiting for, if drain mode is active.
    pub fn drain_target(&self) -> Option<FlowKey> {
        self.drain
    }

    /// Remote grants issued since creation.
    pub fn grant_seq(&self) -> u64 {
        self.grant_seq
    }

    /// One round-robin sweep from the cursor: grants the first flow that can take its head.
    pub(super) fn sweep(&mut self) -> Option<Grant> {
        let n = self.ring.len();
        // Nothing is allocated until the sweep grants (and returns): a head larger than the
        // largest free block misses without asking the allocator. A full arena otherwise cost
        // an allocation attempt (a search of every larger order, twice) per flow per event,
        // and a peer may hold thousands of flows (review 52, sender F5).
        let largest = self.buddy.largest_free();
        // Nothing changed since a sweep granted nothing (no free block grew either): this one
        // would miss every flow the same way, and stamp only flows stamped then (a stamp
        // leaves only through `unblock`, which touches), so it is skipped. Every event pumps a
        // schedule, and thousands of parked flows made each one a full pass (review 56 H2).
        if self.fruitless.is_some_and(|was| largest <= was) {
            return None;
        }
        for i in 0..n {
            let idx = (self.cursor + i) % n;
            let key = self.ring[idx];
            #[cfg(test)]
            {
                self.visits += 1;
            }
            match self.try_grant_within(key, largest) {
                Ok(grant) => {
                    self.cursor = (idx + 1) % n;
                    return Some(grant);
                }
                Err(Miss::NoFit) => self.stamp(key),
                Err(Miss::NotEligible) => {}
            }
        }
        // After the stamps above: they change nothing a sweep reads.
        self.fruitless = Some(largest);
        None
    }

    /// Grants `key` its head chunk if it is eligible and the chunk fits.
    pub(super) fn try_grant(&mut self, key: FlowKey) -> std::result::Result<Grant, Miss> {
        self.try_grant_within(key, u64::MAX)
    }

    /// [`try_grant`](Self::try_grant), told that no free block is larger than `largest`.
    fn try_grant_within(&mut self, key: FlowKey, largest: u64) -> std::result::Result<Grant, Miss> {
        let window = self.window as usize;
        let flow = self.flows.get_mut(&key).ok_or(Miss::NotEligible)?;
        if flow.held.len() >= window {
            return Err(Miss::NotEligible);
        }
        let &(chunk, bytes) = flow.pending.front().ok_or(Miss::NotEligible)?;
        if self.over_peer_share(key.peer, bytes) {
            return Err(Miss::NotEligible);
        }
        if bytes > largest {
            return Err(Miss::NoFit);
        }
        let flow = self.flows.get_mut(&key).ok_or(Miss::NotEligible)?;
        let region = self.buddy.alloc(bytes).ok_or(Miss::NoFit)?;
        let was = Self::is_waiting(flow, window);
        flow.pending.pop_front();
        flow.held.insert(region.offset, Held { chunk, len: region.len });
        Self::rewait(&mut self.waiting, key.peer, was, Self::is_waiting(flow, window));
        *self.peer_held.entry(key.peer).or_default() += region.len;
        self.grant_seq += 1;
        self.touch();
        self.unblock(key);
        trace!(flow = ?key, chunk = chunk.0, offset = region.offset, len = region.len, "grant");
        Ok(Grant { flow: key, chunk, region })
    }

    /// The per-peer share cap: while another peer waits for credits, one peer may hold at most
    /// half the arena (but always at least one chunk). Fairness in the design is per flow, so a
    /// peer with many flows (or many announced and then abandoned: frozen, buggy or hostile)
    /// would otherwise take every region that frees up; the cap keeps half the arena turning
    /// over for the others. It never binds a peer that is alone. Its regions resting in
    /// quarantine count as held: it made them unusable.
    pub(crate) fn over_peer_share(&self, peer: PeerId, bytes: u64) -> bool {
        let resting = self.quarantine.by_peer.get(&peer).copied().unwrap_or(0);
        let held = self.peer_held.get(&peer).copied().unwrap_or(0) + resting;
        let need = self.buddy.block_len(bytes).unwrap_or(bytes);
        let cap = (self.usable_capacity() / 2).max(need);
        if held.saturating_add(need) <= cap {
            return false;
        }
        self.waiting.keys().any(|&p| p != peer)
    }

    /// Whether `flow` waits for a credit.
    pub(super) fn is_waiting(flow: &Flow, window: usize) -> bool {
        !flow.pending.is_empty() && flow.held.len() < window
    }

    /// Records that a flow of `peer` went from waiting `was` to waiting `now`.
    pub(super) fn rewait(waiting: &mut BTreeMap<PeerId, usize>, peer: PeerId, was: bool, now: bool) {
        match (was, now) {
            (false, true) => *waiting.entry(peer).or_default() += 1,
            (true, false) => {
                if let Some(n) = waiting.get_mut(&peer) {
                    *n -= 1;
                    if *n == 0 {
                        waiting.remove(&peer);
                    }
                }
            }
            _ => {}
        }
    }

    /// Stamps a flow whose head did not fit, unless it already carries a stamp.
    pub(super) fn stamp(&mut self, key: FlowKey) {
        let deadline = self.grant_seq + BYPASS_ROUNDS * self.ring.len() as u64;
        if let Some(flow) = self.flows.get_mut(&key) {
            if flow.blocked.is_none() {
                let b = Blocked { deadline, at: self.grant_seq };
                flow.blocked = Some(b);
                self.blocked.insert((b, key));
            }
        }
    }

    pub(super) fn unblock(&mut self, key: FlowKey) {
        self.touch();
        if let Some(b) = self.flows.get_mut(&key).and_then(|f| f.blocked.take()) {
            self.blocked.remove(&(b, key));
        }
    }

    pub(super) fn remove_from_ring(&mut self, key: FlowKey) {
        self.touch();
        let Some(idx) = self.ring.iter().position(|k| *k == key) else {
            return;
        };
        self.ring.remove(idx);
        // Keep the cursor on the same flow (or on the removed flow's successor).
        if idx < self.cursor {
            self.cursor -= 1;
        }
        if self.cursor >= self.ring.len() {
            self.cursor = 0;
        }
        self.tighten_stamps();
    }

    /// Takes every flow `gone` selects out of the ring in one pass, leaving the ring, cursor and
    /// stamps as removing them one at a time with [`remove_from_ring`](Self::remove_from_ring)
    /// would: the cursor stays on its flow or moves to the first survivor after it (wrapping
    /// to 0), and stamps are tightened once, at the end. Each tightening only lowers deadlines
    /// to `at + BYPASS_ROUNDS * ring.len()` and the ring is shortest at the end, so the last
    /// one alone gives the same deadlines. One at a time cost O(ring + stamps) per flow: a
    /// peer's 4096 flows reclaimed took half a second (review 56 H2).
    pub(super) fn remove_from_ring_where(&mut self, gone: impl Fn(&FlowKey) -> bool) {
        self.touch();
        let (before, cursor) = (self.ring.len(), self.cursor);
        let (mut idx, mut kept_before_cursor) = (0, 0);
        self.ring.retain(|k| {
            let keep = !gone(k);
            if keep && idx < cursor {
                kept_before_cursor += 1;
            }
            idx += 1;
            keep
        });
        if self.ring.len() == before {
            return;
        }
        self.cursor = if kept_before_cursor < self.ring.len() { kept_before_cursor } else { 0 };
        self.tighten_stamps();
    }

    /// Pulls each stamp's deadline in to two rounds of the flows still active: a flow stamped
    /// while many flows were active would otherwise, after most of them left (cancelled, or
    /// their peer lost), wait out rounds of flows that are gone while the few left take every
    /// grant. That keeps the fairness bound in terms of the flows active during the wait.
    fn tighten_stamps(&mut self) {
        let rounds = BYPASS_ROUNDS * self.ring.len() as u64;
        let late: Vec<(Blocked, FlowKey)> =
            self.blocked.iter().filter(|(b, _)| b.at + rounds < b.deadline).copied().collect();
        for (b, key) in late {
            let tight = Blocked { deadline: b.at + rounds, at: b.at };
            self.blocked.remove(&(b, key));
            self.blocked.insert((tight, key));
            if let Some(flow) = self.flows.get_mut(&key) {
                flow.blocked = Some(tight);
            }
        }
    }

    /// The fair-share half of [`check_invariants`](Self::check_invariants): stamps, the
    /// waiting counts, the ring, the cursor and the drain target agree with the flows.
    pub(super) fn check_fair_share(&self) -> std::result::Result<(), String> {
        for (key, flow) in &self.flows {
            if flow.blocked.is_some_and(|b| !self.blocked.contains(&(b, *key))) {
                return Err(format!("{key:?} is stamped but missing from the blocked set"));
            }
            if flow.blocked.is_some() && (flow.pending.is_empty() || flow.held.len() >= self.window as usize) {
                return Err(format!("{key:?} is stamped but not eligible"));
            }
        }
        let mut waiting: BTreeMap<PeerId, usize> = BTreeMap::new();
        for (key, flow) in &self.flows {
            if Self::is_waiting(flow, self.window as usize) {
                *waiting.entry(key.peer).or_default() += 1;
            }
        }
        if waiting != self.waiting {
            return Err(format!("waiting-flow counts {:?} != recount {waiting:?}", self.waiting));
        }
        let ring: BTreeSet<FlowKey> = self.ring.iter().copied().collect();
        if ring.len() != self.ring.len() || !ring.iter().eq(self.flows.keys()) {
            return Err("ring and active flows differ".into());
        }
        if self.cursor >= self.ring.len().max(1) {
            return Err(format!("cursor {} outside ring of {}", self.cursor, self.ring.len()));
        }
        let stamped = self.flows.values().filter(|f| f.blocked.is_some()).count();
        if stamped != self.blocked.len() {
            return Err("blocked set has stale entries".into());
        }
        if self.drain.is_some_and(|d| self.flows.get(&d).is_none_or(|f| f.blocked.is_none())) {
            return Err("drain target is not a stamped flow".into());
        }
        Ok(())
    }
}
