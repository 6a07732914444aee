//! One [`CreditScheduler`] per arena (docs/arenas.md): each arena has its own buddy allocator,
//! fairness ring and drain mode, so credits of host memory never wait for GPU memory's. The
//! first arena is the one every engine has; the others are added by the shell.

use std::time::Instant;

use super::{CreditScheduler, Reclaimed, Reuse};
use crate::types::{ArenaId, FlowKey, MAX_ARENAS, PeerId};

/// The engine's schedulers, by [`ArenaId`]: never empty, at most [`MAX_ARENAS`].
///
/// Lookups index by id: every id reaching them was checked on entry (a peer's WANT or PULL
/// by the receiver against [`len`](Self::len), a plan's local arena by the sender at submit),
/// as a map lookup of a key the caller just found would be.
#[derive(Debug)]
pub struct ArenaSchedulers(Vec<CreditScheduler>);

impl ArenaSchedulers {
    /// The schedulers of an engine with one arena, `first`.
    pub fn new(first: CreditScheduler) -> Self {
        Self(vec![first])
    }

    /// Adds an arena's scheduler; its id, or `None` when there are [`MAX_ARENAS`] already.
    pub fn add(&mut self, sched: CreditScheduler) -> Option<ArenaId> {
        if self.0.len() >= MAX_ARENAS {
            return None;
        }
        self.0.push(sched);
        // Below MAX_ARENAS (16): fits a u8.
        Some(ArenaId((self.0.len() - 1) as u8))
    }

    /// How many arenas.
    #[allow(clippy::len_without_is_empty)] // never empty
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether `id` names one of them.
    pub fn has(&self, id: ArenaId) -> bool {
        usize::from(id.0) < self.0.len()
    }

    /// Arena `id`'s scheduler (an id checked on entry, see the type's docs).
    pub fn get(&self, id: ArenaId) -> &CreditScheduler {
        &self.0[usize::from(id.0)]
    }

    /// Arena `id`'s scheduler, to change (an id checked on entry).
    pub fn get_mut(&mut self, id: ArenaId) -> &mut CreditScheduler {
        &mut self.0[usize::from(id.0)]
    }

    /// Every scheduler with its arena's id.
    pub fn iter(&self) -> impl Iterator<Item = (ArenaId, &CreditScheduler)> {
        // At most MAX_ARENAS entries: every index fits a u8.
        self.0.iter().enumerate().map(|(i, s)| (ArenaId(i as u8), s))
    }

    /// Every scheduler with its arena's id, to change.
    pub fn iter_mut(&mut self) -> impl Iterator<Item = (ArenaId, &mut CreditScheduler)> {
        self.0.iter_mut().enumerate().map(|(i, s)| (ArenaId(i as u8), s))
    }

    /// Free bytes over all arenas.
    pub fn free_bytes(&self) -> u64 {
        self.0.iter().map(CreditScheduler::free_bytes).sum()
    }

    /// The earliest end of a quarantine in any arena.
    pub fn next_lift(&self) -> Option<Instant> {
        self.0.iter().filter_map(CreditScheduler::next_lift).min()
    }

    // Flow-level calls: a flow lives in one arena, the one its WANT or PULL named, and is
    // unknown to the others, where these calls find nothing to do. So they need no arena id
    // (a flow may be reclaimed after the receiver forgot which arena it had).

    /// Whether any arena holds or queues anything for `flow`.
    pub fn has_flow(&self, flow: FlowKey) -> bool {
        self.0.iter().any(|s| s.has_flow(flow))
    }

    /// Whether `flow` has regions resting in quarantine in any arena.
    pub fn is_resting(&self, flow: FlowKey) -> bool {
        self.0.iter().any(|s| s.is_resting(flow))
    }

    /// Regions `flow` holds, over all arenas.
    pub fn flow_held_count(&self, flow: FlowKey) -> usize {
        self.0.iter().map(|s| s.flow_held_count(flow)).sum()
    }

    /// Bytes `flow` holds, over all arenas.
    pub fn flow_held_bytes(&self, flow: FlowKey) -> u64 {
        self.0.iter().map(|s| s.flow_held_bytes(flow)).sum()
    }

    /// [`CreditScheduler::drop_pending`] in every arena.
    pub fn drop_pending(&mut self, flow: FlowKey) {
        self.0.iter_mut().for_each(|s| s.drop_pending(flow));
    }

    /// [`CreditScheduler::reclaim_flow`] in every arena, the regions of all.
    pub fn reclaim_flow(&mut self, flow: FlowKey, reuse: Reuse) -> Reclaimed {
        merge(self.0.iter_mut().map(|s| s.reclaim_flow(flow, reuse)))
    }

    /// [`CreditScheduler::reclaim_peer`] in every arena, the regions of all.
    pub fn reclaim_peer(&mut self, peer: PeerId, reuse: Reuse) -> Reclaimed {
        merge(self.0.iter_mut().map(|s| s.reclaim_peer(peer, reuse)))
    }

    /// [`CreditScheduler::lift_flow`] in every arena; how many regions it freed.
    pub fn lift_flow(&mut self, flow: FlowKey) -> usize {
        self.0.iter_mut().map(|s| s.lift_flow(flow).len()).sum()
    }

    /// [`CreditScheduler::lift_quarantine`] in every arena; how many regions it freed.
    pub fn lift_quarantine(&mut self, now: Option<Instant>) -> usize {
        self.0.iter_mut().map(|s| s.lift_quarantine(now).len()).sum()
    }
}

fn merge(all: impl Iterator<Item = Reclaimed>) -> Reclaimed {
    all.fold(Reclaimed::default(), |mut out, r| {
        out.freed.extend(r.freed);
        out.quarantined.extend(r.quarantined);
        out.deferred.extend(r.deferred);
        out
    })
}
