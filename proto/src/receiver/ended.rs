//! The transfers whose flows ended, per peer: a WANT or PULL naming one again is a replay.
//!
//! Transfer ids grow, but a peer's WANTs may arrive slightly out of order (two threads
//! posting at once), so a plain "highest id seen" floor would refuse honest ones. Instead the
//! newest [`RECENT`] ended ids are kept exactly, and the floor rises only past ids pushed out
//! of that window: an honest WANT is refused only if more than [`RECENT`] later transfers to
//! the same peer ended before it arrived.
//!
//! Standing flows' ids ([`STANDING_XFER_BIT`]) lie above every transfer's, so they keep a
//! window of their own: in one window, 257 ended standing flows (one per pause of a bursty
//! workload) raised the floor past every transfer id, and each later WANT of that peer was
//! dropped as a replay and timed out (review 58).

use std::collections::{BTreeMap, VecDeque};

use crate::proof::Initiator;
use crate::sender::STANDING_XFER_BIT;
use crate::types::{PeerId, XferId};

/// Ended ids kept exactly per peer (8 bytes each).
pub(crate) const RECENT: usize = 256;

/// Evicted one-way names whose windows are kept; the oldest kept goes beyond. Only a name
/// whose proofs verified has a window (an opened flow), and a proof is bound to its name, so
/// only holders of our registration keys, who could write there through UCX anyway, can push
/// a name's window out.
pub(crate) const EVICTED_KEPT: usize = 4096;

/// One peer's ended flows: its transfers', and its standing flows' apart.
#[derive(Debug, Default)]
pub(crate) struct Ended {
    transfers: Window,
    standing: Window,
}

impl Ended {
    /// Flow `xfer` ended.
    pub(crate) fn note(&mut self, xfer: XferId) {
        self.window_mut(xfer).note(xfer);
    }

    /// Whether flow `xfer` ended here (or lies below its window, where it is taken as ended).
    pub(crate) fn covers(&self, xfer: XferId) -> bool {
        self.window(xfer).covers(xfer)
    }

    fn window(&self, xfer: XferId) -> &Window {
        if xfer.0 & STANDING_XFER_BIT == 0 { &self.transfers } else { &self.standing }
    }

    fn window_mut(&mut self, xfer: XferId) -> &mut Window {
        if xfer.0 & STANDING_XFER_BIT == 0 { &mut self.transfers } else { &mut self.standing }
    }

    /// Adds every id `other` covers.
    fn merge(&mut self, other: Self) {
        self.transfers.merge(other.transfers);
        self.standing.merge(other.standing);
    }
}

/// The ended ids of one id space.
#[derive(Debug, Default)]
struct Window {
    /// Every id at or below it is taken as ended.
    floor: Option<XferId>,
    /// Ended ids above the floor, sorted.
    recent: VecDeque<XferId>,
}

impl Window {
    fn note(&mut self, xfer: XferId) {
        if self.covers(xfer) {
            return;
        }
        let at = self.recent.partition_point(|&x| x < xfer);
        self.recent.insert(at, xfer);
        if self.recent.len() > RECENT {
            self.floor = self.recent.pop_front().max(self.floor);
        }
    }

    fn covers(&self, xfer: XferId) -> bool {
        self.floor.is_some_and(|f| xfer <= f) || self.recent.binary_search(&xfer).is_ok()
    }

    fn merge(&mut self, other: Self) {
        if let Some(f) = other.floor {
            self.floor = self.floor.max(Some(f));
            let floor = self.floor;
            self.recent.retain(|&x| floor.is_none_or(|f| x > f));
        }
        for x in other.recent {
            self.note(x);
        }
    }
}

/// Whose replay state a peer id's frames are checked against: once the id is named (at its
/// first WANT or PULL, see `Receiver::name_initiator`), its agent name's, which every id of
/// that name shares: the loaded one, a one-way one, another incarnation's, and those retired
/// before. A captured WANT replayed under an invented session gets a fresh id, and a restarted
/// agent's old WANTs come back under its new id: by id, each found an empty window (review 60,
/// H1). An id never named (the core's tests) is a party of its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Party {
    Name(Initiator),
    Id(PeerId),
}

/// One party's replay state: the transfers whose flows ended here, and the highest transfers
/// whose inline chunk was taken and whose claim of a standing credit was taken (transfer ids
/// only grow within one process, and a restarted one's start at its clock, above them).
#[derive(Debug, Default)]
pub(crate) struct Replay {
    pub(crate) ended: Ended,
    pub(crate) inline_floor: Option<XferId>,
    pub(crate) claim_floor: Option<XferId>,
}

impl Replay {
    pub(crate) fn merge(&mut self, other: Self) {
        self.ended.merge(other.ended);
        self.inline_floor = self.inline_floor.max(other.inline_floor);
        self.claim_floor = self.claim_floor.max(other.claim_floor);
    }
}

/// The replay state of names none of whose ids lives any more (lost, reloaded, evicted one-way
/// names), by name, at most [`EVICTED_KEPT`]: the name's next id takes it back.
#[derive(Debug, Default)]
pub(crate) struct Evicted {
    by_name: BTreeMap<Initiator, Replay>,
    /// Names in the order they were kept (a name taken back leaves a stale entry, skipped).
    order: VecDeque<Initiator>,
}

impl Evicted {
    /// Keeps `window` for `name` (merged with one kept before, should the name have had two ids).
    pub(crate) fn keep(&mut self, name: Initiator, window: Replay) {
        match self.by_name.get_mut(&name) {
            Some(old) => old.merge(window),
            None => {
                self.by_name.insert(name, window);
                self.order.push_back(name);
            }
        }
        while self.by_name.len() > EVICTED_KEPT {
            let Some(oldest) = self.order.pop_front() else { break };
            self.by_name.remove(&oldest);
        }
        // Stale entries (names taken back) never outnumber the kept ones by much.
        if self.order.len() > 2 * EVICTED_KEPT {
            let kept = &self.by_name;
            self.order.retain(|n| kept.contains_key(n));
        }
    }

    /// The state kept for `name`, if any (it is no longer kept here).
    pub(crate) fn take(&mut self, name: &Initiator) -> Option<Replay> {
        self.by_name.remove(name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn ended_ids_are_covered_others_not_and_the_floor_rises_past_the_window() {
        let mut e = Ended::default();
        assert!(!e.covers(XferId(5)));
        e.note(XferId(5));
        e.note(XferId(3));
        assert!(e.covers(XferId(5)) && e.covers(XferId(3)));
        assert!(!e.covers(XferId(4)), "an id still open (its WANT late) is not a replay");
        for x in 10..10 + RECENT as u64 {
            e.note(XferId(x));
        }
        assert!(e.covers(XferId(4)), "pushed below the window: taken as ended");
        assert!(!e.covers(XferId(10 + RECENT as u64)));
    }

    /// However many standing flows end (their ids above every transfer's), a transfer that
    /// never ended is not taken as one, nor a standing flow that never ended.
    #[test]
    fn standing_flows_ending_never_cover_a_transfer() {
        let mut e = Ended::default();
        e.note(XferId(3));
        for n in 1..=3 * RECENT as u64 {
            e.note(XferId(STANDING_XFER_BIT | n));
        }
        assert!(e.covers(XferId(3)) && e.covers(XferId(STANDING_XFER_BIT | 1)));
        assert!(!e.covers(XferId(1)) && !e.covers(XferId(4)) && !e.covers(XferId(u64::MAX >> 1)));
        assert!(!e.covers(XferId(STANDING_XFER_BIT | (3 * RECENT as u64 + 1))));
        // and the other way round: transfers ending push no standing flow below a floor
        let mut e = Ended::default();
        for n in 1..=3 * RECENT as u64 {
            e.note(XferId(n));
        }
        assert!(!e.covers(XferId(STANDING_XFER_BIT)) && e.covers(XferId(1)));
    }

    #[test]
    fn evicted_windows_are_kept_by_name_merged_and_bounded() {
        let (a, b) = (Initiator::named("a"), Initiator::named("b"));
        let mut kept = Evicted::default();
        let window = |ids: &[u64]| {
            let mut e = Replay::default();
            ids.iter().for_each(|&x| e.ended.note(XferId(x)));
            e.inline_floor = ids.iter().max().map(|&x| XferId(x));
            e
        };
        kept.keep(a, window(&[5, 9]));
        kept.keep(a, window(&[7]));
        kept.keep(b, window(&[1]));
        let back = kept.take(&a).expect("kept under its name");
        assert!([5, 7, 9].iter().all(|&x| back.ended.covers(XferId(x))) && !back.ended.covers(XferId(6)));
        assert_eq!(back.inline_floor, Some(XferId(9)), "the higher floor of the two");
        assert!(kept.take(&a).is_none(), "taken once");
        for i in 0..EVICTED_KEPT as u64 + 5 {
            kept.keep(Initiator::named(&format!("n{i}")), window(&[i]));
        }
        assert_eq!(kept.by_name.len(), EVICTED_KEPT);
        assert!(kept.order.len() <= 2 * EVICTED_KEPT);
        assert!(kept.take(&b).is_none(), "the oldest went first");
        assert!(kept.take(&Initiator::named(&format!("n{}", EVICTED_KEPT + 4))).is_some());
    }

    proptest! {
        /// Whatever the order ids end in (in one id space), every noted id stays covered, the window never grows
        /// past RECENT, and an id is covered only if noted or below an id that was noted and
        /// then pushed out of the window.
        #[test]
        fn noted_ids_stay_covered_within_bounded_memory(ids in proptest::collection::vec(0u64..2000, 0..800), probe in 0u64..2000) {
            let mut e = Window::default();
            for &x in &ids {
                e.note(XferId(x));
                prop_assert!(e.recent.len() <= RECENT);
            }
            for &x in &ids {
                prop_assert!(e.covers(XferId(x)));
            }
            if e.covers(XferId(probe)) && !ids.contains(&probe) {
                let floor = e.floor.expect("covered without being noted: only below the floor");
                prop_assert!(XferId(probe) <= floor && ids.contains(&floor.0));
            }
            prop_assert!(e.recent.iter().zip(e.recent.iter().skip(1)).all(|(a, b)| a < b), "sorted, no duplicates");
        }
    }
}
