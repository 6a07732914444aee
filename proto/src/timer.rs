//! A set of deadlines, one per key (quinn's `TimerTable`, keyed by transfer or flow instead of
//! by a fixed timer enum): the sender arms one per transfer, the receiver one per remote flow.
//!
//! The table holds *when to look next*, not the rule that decides what is due: each role keeps
//! its own pushed-back deadline on the transfer or flow, and leaves the armed instant alone on
//! progress (no re-keying per message). When the armed instant passes, [`TimerTable::pop_due`]
//! hands the key back, and the role either acts or re-arms it at the later deadline. So
//! `poll_timeout` may be early, never late, and a spurious wake-up finds nothing due.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

/// At most one armed instant per key, ordered by time.
#[derive(Debug, Clone)]
pub(crate) struct TimerTable<K> {
    /// `(instant, key)` of every armed key, earliest first.
    queue: BTreeSet<(Instant, K)>,
    /// The instant each key is armed at (the inverse of `queue`).
    armed: BTreeMap<K, Instant>,
}

impl<K: Ord + Copy> Default for TimerTable<K> {
    fn default() -> Self {
        Self { queue: BTreeSet::new(), armed: BTreeMap::new() }
    }
}

impl<K: Ord + Copy> TimerTable<K> {
    /// Arms `key` at `at`, replacing an earlier arming of it.
    pub(crate) fn set(&mut self, key: K, at: Instant) {
        if let Some(old) = self.armed.insert(key, at) {
            self.queue.remove(&(old, key));
        }
        self.queue.insert((at, key));
    }

    /// Disarms `key`; a key not armed is ignored.
    pub(crate) fn stop(&mut self, key: K) {
        if let Some(at) = self.armed.remove(&key) {
            self.queue.remove(&(at, key));
        }
    }

    /// The earliest armed instant: when the owner must next be woken, if ever.
    pub(crate) fn next(&self) -> Option<Instant> {
        self.queue.first().map(|&(at, _)| at)
    }

    /// Disarms and returns one key armed at or before `now`, earliest first; `None` when
    /// nothing is due.
    pub(crate) fn pop_due(&mut self, now: Instant) -> Option<K> {
        let &(at, key) = self.queue.first()?;
        if at > now {
            return None;
        }
        self.queue.pop_first();
        self.armed.remove(&key);
        Some(key)
    }

    /// Armed keys.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        debug_assert_eq!(self.queue.len(), self.armed.len());
        self.armed.len()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn ms(t: Instant, n: u64) -> Instant {
        t + Duration::from_millis(n)
    }

    #[test]
    fn next_is_the_minimum_and_pop_due_drains_in_time_order() {
        let t = Instant::now();
        let mut tt = TimerTable::default();
        assert_eq!(tt.next(), None);
        tt.set(1u32, ms(t, 30));
        tt.set(2, ms(t, 10));
        tt.set(3, ms(t, 20));
        assert_eq!(tt.next(), Some(ms(t, 10)));
        assert_eq!(tt.pop_due(ms(t, 9)), None, "nothing is due before the minimum");
        assert_eq!(tt.len(), 3);
        assert_eq!(tt.pop_due(ms(t, 25)), Some(2));
        assert_eq!(tt.pop_due(ms(t, 25)), Some(3));
        assert_eq!(tt.pop_due(ms(t, 25)), None);
        assert_eq!(tt.next(), Some(ms(t, 30)));
        assert_eq!(tt.pop_due(ms(t, 30)), Some(1));
        assert_eq!((tt.next(), tt.len()), (None, 0));
    }

    #[test]
    fn set_replaces_and_stop_disarms() {
        let t = Instant::now();
        let mut tt = TimerTable::default();
        tt.set(7u32, ms(t, 10));
        tt.set(7, ms(t, 50));
        assert_eq!(tt.len(), 1);
        assert_eq!(tt.pop_due(ms(t, 10)), None, "the earlier arming is gone");
        assert_eq!(tt.next(), Some(ms(t, 50)));
        tt.set(8, ms(t, 5));
        tt.stop(8);
        tt.stop(9);
        assert_eq!(tt.next(), Some(ms(t, 50)));
        tt.stop(7);
        assert_eq!((tt.next(), tt.len()), (None, 0));
    }

    #[test]
    fn keys_armed_at_the_same_instant_all_fire() {
        let t = Instant::now();
        let mut tt = TimerTable::default();
        for k in 0..4u32 {
            tt.set(k, t);
        }
        let fired: Vec<u32> = std::iter::from_fn(|| tt.pop_due(t)).collect();
        assert_eq!(fired, vec![0, 1, 2, 3]);
    }
}
