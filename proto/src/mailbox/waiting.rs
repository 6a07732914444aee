//! The target's queue of transfers waiting for a mailbox slot: a one-way WANT or PULL that is
//! genuine but finds its peer at its slot cap, or all its candidate slots held, waits here
//! instead of being dropped, and is handed back, with every further message of its transfer
//! held since, as soon as one of its candidates is free for it.
//!
//! Bounded, so a hostile peer cannot grow it: at most `per_peer` waiting transfers per peer and
//! `total` in all, and at most `units_per_peer` / `units_total` held units (chunks and gather
//! runs: what a held message costs in memory). Fair: FIFO per peer (a peer's older transfer is
//! served before its younger one whenever both could take a free slot; one that cannot, because
//! its candidates are all held, does not block the others), round robin across peers. Each
//! waiter leaves by its deadline (its initiator has given up by then), on cancel, or with its
//! peer. What a waiter holds is opaque here (`T`): the caller holds the messages themselves.
//!
//! Pure bookkeeping, like the slot table: time comes in as `now`.

use std::collections::{BTreeMap, VecDeque};
use std::ops::Bound::{Excluded, Unbounded};
use std::time::{Duration, Instant};

use crate::types::{PeerId, XferId};

use super::record::{SlotId, Token};
use super::slots::SlotError;

/// Bounds of a [`SlotQueue`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueConfig {
    /// Most transfers one peer may have waiting.
    pub per_peer: usize,
    /// Most transfers waiting in all.
    pub total: usize,
    /// Most units (chunks and runs of held messages) one peer's waiters may hold.
    pub units_per_peer: u64,
    /// Most units held in all.
    pub units_total: u64,
    /// How long a transfer may wait: its initiator's no-progress timeout, after which nobody
    /// waits for the answer any more.
    pub wait: Duration,
}

/// Why a message was not queued. The caller drops it (and, for a further message of a waiting
/// transfer, the whole transfer: a flow opened without some of its chunks could only time out).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum QueueError {
    /// The peer already has its share of waiting transfers or held units.
    #[error("{peer:?} already has {waiting} transfers and {units} units waiting for a slot")]
    PeerFull {
        /// The peer.
        peer: PeerId,
        /// Its waiting transfers.
        waiting: usize,
        /// Units its waiters hold.
        units: u64,
    },
    /// The queue holds all it may.
    #[error("{waiting} transfers and {units} units wait for a slot: the queue is full")]
    Full {
        /// Waiting transfers.
        waiting: usize,
        /// Units held.
        units: u64,
    },
    /// The transfer waits already (a new one must not replace it) or, for a further message,
    /// does not wait.
    #[error("transfer {xfer:?} of {peer:?} is {}", if *waiting { "already waiting" } else { "not waiting" })]
    State {
        /// The peer.
        peer: PeerId,
        /// Its transfer.
        xfer: XferId,
        /// Whether it waits.
        waiting: bool,
    },
}

/// A transfer waiting for a slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Waiter<T> {
    /// Its peer.
    pub peer: PeerId,
    /// Its transfer.
    pub xfer: XferId,
    /// The token of the message that queued it: every further message must carry it.
    pub token: Token,
    /// Its candidate slots.
    pub candidates: Vec<SlotId>,
    /// What it holds, oldest first (the opening message, then the further ones).
    pub held: Vec<T>,
    /// Units it holds.
    pub units: u64,
    /// It leaves the queue unserved at this instant.
    pub deadline: Instant,
}

/// Transfers waiting for a mailbox slot.
///
/// Call order: [`push`](Self::push) a genuine opening message that found no slot;
/// [`hold`](Self::hold) each further message of a waiting transfer (checking its token against
/// [`token`](Self::token) first); whenever a slot may have freed,
/// [`pop_servable`](Self::pop_servable) until `None` and open each transfer returned with what it
/// held, in order; [`expire`](Self::expire) at [`next_deadline`](Self::next_deadline);
/// [`remove`](Self::remove) on cancel; [`release_peer`](Self::release_peer) when the peer is lost.
#[derive(Debug)]
pub struct SlotQueue<T> {
    cfg: QueueConfig,
    waiters: BTreeMap<(PeerId, XferId), Waiter<T>>,
    /// Each peer's waiting transfers, oldest first.
    order: BTreeMap<PeerId, VecDeque<XferId>>,
    /// Units held per peer (peers with waiters only) and in all.
    units: BTreeMap<PeerId, u64>,
    units_total: u64,
    /// The peer served last: the round robin starts after it.
    last: Option<PeerId>,
}

impl<T> SlotQueue<T> {
    /// An empty queue.
    pub fn new(cfg: QueueConfig) -> Self {
        Self {
            cfg,
            waiters: BTreeMap::new(),
            order: BTreeMap::new(),
            units: BTreeMap::new(),
            units_total: 0,
            last: None,
        }
    }

    /// Transfers waiting.
    pub fn len(&self) -> usize {
        self.waiters.len()
    }

    /// True when none waits.
    pub fn is_empty(&self) -> bool {
        self.waiters.is_empty()
    }

    /// Transfers of `peer` waiting.
    pub fn waiting_of(&self, peer: PeerId) -> usize {
        self.order.get(&peer).map_or(0, VecDeque::len)
    }

    /// Units held in all.
    pub fn units(&self) -> u64 {
        self.units_total
    }

    /// True when `peer`'s transfer `xfer` waits.
    pub fn contains(&self, peer: PeerId, xfer: XferId) -> bool {
        self.waiters.contains_key(&(peer, xfer))
    }

    /// The token a waiting transfer was queued under.
    pub fn token(&self, peer: PeerId, xfer: XferId) -> Option<&Token> {
        self.waiters.get(&(peer, xfer)).map(|w| &w.token)
    }

    /// Queues `peer`'s transfer `xfer`, holding `item` (`units` of it), until one of
    /// `candidates` is free for it or `now + wait`.
    ///
    /// # Errors
    /// [`QueueError::State`] when it waits already; [`QueueError::PeerFull`] or
    /// [`QueueError::Full`] at a bound (nothing is queued then).
    #[allow(clippy::too_many_arguments, reason = "one waiter's fields, each checked or stored once")]
    pub fn push(
        &mut self,
        now: Instant,
        peer: PeerId,
        xfer: XferId,
        token: Token,
        candidates: Vec<SlotId>,
        item: T,
        units: u64,
    ) -> Result<(), QueueError> {
        if self.contains(peer, xfer) {
            return Err(QueueError::State { peer, xfer, waiting: true });
        }
        let waiting = self.waiting_of(peer);
        if waiting >= self.cfg.per_peer {
            return Err(QueueError::PeerFull { peer, waiting, units: self.units_of(peer) });
        }
        if self.waiters.len() >= self.cfg.total {
            return Err(QueueError::Full { waiting: self.waiters.len(), units: self.units_total });
        }
        self.check_units(peer, units)?;
        let deadline = now + self.cfg.wait;
        let waiter = Waiter { peer, xfer, token, candidates, held: vec![item], units, deadline };
        self.waiters.insert((peer, xfer), waiter);
        self.order.entry(peer).or_default().push_back(xfer);
        self.add_units(peer, units);
        Ok(())
    }

    /// Holds a further message of waiting transfer `xfer` (`units` of it), after the ones it
    /// holds. The caller has checked its token.
    ///
    /// # Errors
    /// [`QueueError::State`] when the transfer does not wait; [`QueueError::PeerFull`] or
    /// [`QueueError::Full`] when its units would pass a bound (nothing is held then).
    pub fn hold(&mut self, peer: PeerId, xfer: XferId, item: T, units: u64) -> Result<(), QueueError> {
        if !self.contains(peer, xfer) {
            return Err(QueueError::State { peer, xfer, waiting: false });
        }
        self.check_units(peer, units)?;
        if let Some(w) = self.waiters.get_mut(&(peer, xfer)) {
            w.held.push(item);
            w.units += units;
        }
        self.add_units(peer, units);
        Ok(())
    }

    /// Takes the next transfer to serve: peers in round robin after the one served last, and
    /// within a peer the oldest waiter for which `vacancy` finds a slot. `vacancy` is asked
    /// about waiters only; a [`SlotError::PeerAtCap`] answer skips the rest of that peer's.
    pub fn pop_servable(
        &mut self,
        mut vacancy: impl FnMut(PeerId, XferId, &[SlotId]) -> Result<SlotId, SlotError>,
    ) -> Option<Waiter<T>> {
        let after = self.last;
        let peers: Vec<PeerId> = match after {
            Some(l) => {
                let later = self.order.range((Excluded(l), Unbounded));
                later.chain(self.order.range(..=l)).map(|(p, _)| *p).collect()
            }
            None => self.order.keys().copied().collect(),
        };
        for peer in peers {
            let Some(queue) = self.order.get(&peer) else { continue };
            let mut found = None;
            for &xfer in queue {
                let Some(w) = self.waiters.get(&(peer, xfer)) else { continue };
                match vacancy(peer, xfer, &w.candidates) {
                    Ok(_) => {
                        found = Some(xfer);
                        break;
                    }
                    Err(SlotError::PeerAtCap { .. }) => break,
                    Err(_) => {}
                }
            }
            if let Some(xfer) = found {
                self.last = Some(peer);
                return self.remove(peer, xfer);
            }
        }
        None
    }

    /// Takes `peer`'s transfer `xfer` out of the queue (a cancel), with what it held.
    pub fn remove(&mut self, peer: PeerId, xfer: XferId) -> Option<Waiter<T>> {
        let w = self.waiters.remove(&(peer, xfer))?;
        if let Some(q) = self.order.get_mut(&peer) {
            q.retain(|&x| x != xfer);
            if q.is_empty() {
                self.order.remove(&peer);
            }
        }
        if let Some(u) = self.units.get_mut(&peer) {
            *u -= w.units;
            if !self.order.contains_key(&peer) {
                self.units.remove(&peer);
            }
        }
        self.units_total -= w.units;
        Some(w)
    }

    /// The peer is gone: its waiters leave. Returns how many.
    pub fn release_peer(&mut self, peer: PeerId) -> usize {
        let xfers: Vec<XferId> = self.order.get(&peer).map(|q| q.iter().copied().collect()).unwrap_or_default();
        xfers.iter().filter(|&&x| self.remove(peer, x).is_some()).count()
    }

    /// Waiters whose deadline has come leave, unserved. Returns them, oldest deadline first.
    pub fn expire(&mut self, now: Instant) -> Vec<Waiter<T>> {
        let mut due: Vec<(Instant, PeerId, XferId)> =
            self.waiters.values().filter(|w| w.deadline <= now).map(|w| (w.deadline, w.peer, w.xfer)).collect();
        due.sort();
        due.into_iter().filter_map(|(_, p, x)| self.remove(p, x)).collect()
    }

    /// The earliest waiter's deadline.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.waiters.values().map(|w| w.deadline).min()
    }

    /// Checks the per-peer and total counts against the waiters (tests and fuzzing).
    ///
    /// # Panics
    /// When a count, an order list or a bound disagrees with the waiters.
    pub fn assert_consistent(&self) {
        let mut units: BTreeMap<PeerId, u64> = BTreeMap::new();
        for w in self.waiters.values() {
            *units.entry(w.peer).or_insert(0) += w.units;
            assert!(self.order.get(&w.peer).is_some_and(|q| q.contains(&w.xfer)));
        }
        assert_eq!(units, self.units);
        assert_eq!(units.values().sum::<u64>(), self.units_total);
        assert_eq!(self.order.values().map(VecDeque::len).sum::<usize>(), self.waiters.len());
        assert!(self.order.values().all(|q| !q.is_empty() && q.len() <= self.cfg.per_peer));
        assert!(self.waiters.len() <= self.cfg.total && self.units_total <= self.cfg.units_total);
        assert!(self.units.values().all(|&u| u <= self.cfg.units_per_peer));
    }

    fn units_of(&self, peer: PeerId) -> u64 {
        self.units.get(&peer).copied().unwrap_or(0)
    }

    fn check_units(&self, peer: PeerId, units: u64) -> Result<(), QueueError> {
        if self.units_of(peer).saturating_add(units) > self.cfg.units_per_peer {
            return Err(QueueError::PeerFull { peer, waiting: self.waiting_of(peer), units: self.units_of(peer) });
        }
        if self.units_total.saturating_add(units) > self.cfg.units_total {
            return Err(QueueError::Full { waiting: self.waiters.len(), units: self.units_total });
        }
        Ok(())
    }

    fn add_units(&mut self, peer: PeerId, units: u64) {
        *self.units.entry(peer).or_insert(0) += units;
        self.units_total += units;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const WAIT: Duration = Duration::from_millis(100);

    fn queue(per_peer: usize, total: usize) -> SlotQueue<u32> {
        SlotQueue::new(QueueConfig { per_peer, total, units_per_peer: 100, units_total: 150, wait: WAIT })
    }

    fn push(q: &mut SlotQueue<u32>, now: Instant, peer: u64, xfer: u64, units: u64) -> Result<(), QueueError> {
        q.push(now, PeerId(peer), XferId(xfer), Token([xfer as u8; 16]), vec![SlotId(xfer as u32)], 0, units)
    }

    /// Every waiter may take a slot.
    fn any(_: PeerId, _: XferId, c: &[SlotId]) -> Result<SlotId, SlotError> {
        Ok(c[0])
    }

    fn served(q: &mut SlotQueue<u32>) -> Vec<(u64, u64)> {
        std::iter::from_fn(|| q.pop_servable(any)).map(|w| (w.peer.0, w.xfer.0)).collect()
    }

    #[test]
    fn each_peer_is_served_oldest_first_and_peers_take_turns() {
        let now = Instant::now();
        let mut q = queue(8, 16);
        for (peer, xfer) in [(1, 10), (1, 11), (2, 20), (1, 12), (3, 30), (2, 21)] {
            push(&mut q, now, peer, xfer, 1).unwrap();
        }
        q.assert_consistent();
        assert_eq!(served(&mut q), [(1, 10), (2, 20), (3, 30), (1, 11), (2, 21), (1, 12)]);
        assert!(q.is_empty() && q.units() == 0);
        q.assert_consistent();
    }

    #[test]
    fn a_waiter_without_a_free_candidate_keeps_its_place_and_blocks_no_one() {
        let now = Instant::now();
        let mut q = queue(8, 16);
        for xfer in [1, 2, 3] {
            push(&mut q, now, 1, xfer, 1).unwrap();
        }
        // Slot 2 alone is free: the second waiter is served, the first keeps its place.
        let only_2 = |_, _, c: &[SlotId]| if c[0] == SlotId(2) { Ok(c[0]) } else { Err(SlotError::Exhausted) };
        assert_eq!(q.pop_servable(only_2).map(|w| w.xfer), Some(XferId(2)));
        assert_eq!(q.pop_servable(only_2).map(|w| w.xfer), None);
        // A peer at its cap is skipped whole, and asked only once.
        let mut asked = 0;
        let at_cap = |p, _, _: &[SlotId]| {
            asked += 1;
            Err(SlotError::PeerAtCap { peer: p, held: 4 })
        };
        assert!(q.pop_servable(at_cap).is_none());
        assert_eq!(asked, 1);
        assert_eq!(served(&mut q), [(1, 1), (1, 3)]);
    }

    #[test]
    fn the_bounds_hold_per_peer_and_in_total() {
        let now = Instant::now();
        let mut q = queue(3, 5);
        for xfer in 0..3 {
            push(&mut q, now, 1, xfer, 1).unwrap();
        }
        assert_eq!(push(&mut q, now, 1, 3, 1), Err(QueueError::PeerFull { peer: PeerId(1), waiting: 3, units: 3 }));
        push(&mut q, now, 2, 0, 1).unwrap();
        push(&mut q, now, 3, 0, 1).unwrap();
        assert_eq!(push(&mut q, now, 4, 0, 1), Err(QueueError::Full { waiting: 5, units: 5 }));
        assert_eq!(
            push(&mut q, now, 2, 0, 1),
            Err(QueueError::State { peer: PeerId(2), xfer: XferId(0), waiting: true }),
            "a second opening message does not replace the first"
        );
        // Units: 100 per peer, 150 in all, whether opening or further messages bring them.
        assert_eq!(
            q.hold(PeerId(2), XferId(0), 1, 100),
            Err(QueueError::PeerFull { peer: PeerId(2), waiting: 1, units: 1 })
        );
        q.hold(PeerId(2), XferId(0), 1, 99).unwrap();
        assert_eq!(q.hold(PeerId(3), XferId(0), 1, 60), Err(QueueError::Full { waiting: 5, units: 104 }));
        assert_eq!(
            q.hold(PeerId(3), XferId(9), 1, 1),
            Err(QueueError::State { peer: PeerId(3), xfer: XferId(9), waiting: false })
        );
        q.assert_consistent();
        assert_eq!(q.len(), 5);
        // Serving one makes room for another.
        assert!(q.pop_servable(any).is_some());
        push(&mut q, now, 4, 0, 1).unwrap();
        q.assert_consistent();
    }

    #[test]
    fn a_waiter_keeps_what_it_held_in_order() {
        let now = Instant::now();
        let mut q = queue(3, 5);
        push(&mut q, now, 1, 7, 2).unwrap();
        q.hold(PeerId(1), XferId(7), 1, 3).unwrap();
        q.hold(PeerId(1), XferId(7), 2, 4).unwrap();
        assert_eq!(q.token(PeerId(1), XferId(7)), Some(&Token([7; 16])));
        let w = q.pop_servable(any).unwrap();
        assert_eq!((w.held, w.units, w.deadline), (vec![0, 1, 2], 9, now + WAIT));
    }

    #[test]
    fn waiters_leave_at_their_deadline_on_cancel_and_with_their_peer() {
        let now = Instant::now();
        let mut q = queue(4, 8);
        push(&mut q, now, 1, 1, 1).unwrap();
        push(&mut q, now + WAIT / 2, 1, 2, 1).unwrap();
        push(&mut q, now, 2, 1, 1).unwrap();
        push(&mut q, now, 2, 2, 1).unwrap();
        assert_eq!(q.next_deadline(), Some(now + WAIT));
        assert!(q.expire(now + WAIT - Duration::from_millis(1)).is_empty());
        let gone: Vec<_> = q.expire(now + WAIT).iter().map(|w| (w.peer.0, w.xfer.0)).collect();
        assert_eq!(gone, [(1, 1), (2, 1), (2, 2)]);
        assert_eq!(q.next_deadline(), Some(now + WAIT + WAIT / 2));
        push(&mut q, now, 2, 3, 1).unwrap();
        assert!(q.remove(PeerId(1), XferId(2)).is_some());
        assert!(q.remove(PeerId(1), XferId(2)).is_none());
        push(&mut q, now, 1, 4, 1).unwrap();
        assert_eq!(q.release_peer(PeerId(2)), 1);
        assert_eq!(served(&mut q), [(1, 4)]);
        q.assert_consistent();
        assert_eq!(q.units(), 0);
    }
}
