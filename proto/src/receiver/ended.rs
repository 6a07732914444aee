//! The transfers whose flows ended, per peer: a WANT or PULL naming one again is a replay.
//!
//! Transfer ids grow, but a peer's WANTs may arrive slightly out of order (two threads
//! posting at once), so a plain "highest id seen" floor would refuse honest ones. Instead the
//! newest [`RECENT`] ended ids are kept exactly, and the floor rises only past ids pushed out
//! of that window: an honest WANT is refused only if more than [`RECENT`] later transfers to
//! the same peer ended before it arrived.

use std::collections::VecDeque;

use crate::types::XferId;

/// Ended ids kept exactly per peer (8 bytes each).
pub(crate) const RECENT: usize = 256;

/// One peer's ended transfers.
#[derive(Debug, Default)]
pub(crate) struct Ended {
    /// Every id at or below it is taken as ended.
    floor: Option<XferId>,
    /// Ended ids above the floor, sorted.
    recent: VecDeque<XferId>,
}

impl Ended {
    /// Transfer `xfer`'s flow ended.
    pub(crate) fn note(&mut self, xfer: XferId) {
        if self.covers(xfer) {
            return;
        }
        let at = self.recent.partition_point(|&x| x < xfer);
        self.recent.insert(at, xfer);
        if self.recent.len() > RECENT {
            self.floor = self.recent.pop_front().max(self.floor);
        }
    }

    /// Whether `xfer` ended here (or lies below the window, where it is taken as ended).
    pub(crate) fn covers(&self, xfer: XferId) -> bool {
        self.floor.is_some_and(|f| xfer <= f) || self.recent.binary_search(&xfer).is_ok()
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

    proptest! {
        /// Whatever the order ids end in, every noted id stays covered, the window never grows
        /// past RECENT, and an id is covered only if noted or below an id that was noted and
        /// then pushed out of the window.
        #[test]
        fn noted_ids_stay_covered_within_bounded_memory(ids in proptest::collection::vec(0u64..2000, 0..800), probe in 0u64..2000) {
            let mut e = Ended::default();
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
