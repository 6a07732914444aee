//! The one-way initiator's mailbox polls (docs/one-way.md, "Poll policy"): for each of our
//! one-way transfers, the READs of the target's mailbox that bring its answers into a fetch
//! slice of our own arena, and when to post the next.
//!
//! Bookkeeping and policy only: the reactor posts the READs on its data path and hands the
//! bytes to the core. Each transfer being read holds one fetch slice; a transfer's READs are in
//! flight at most once at a time, and its slice is given back only once none is (a READ still
//! in flight would land in a slice given to another transfer).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use bounce_proto::XferId;

use crate::shell::datapath::WriteId;
use crate::sys::shim::Md;

/// Empty polls re-posted at once before the back-off starts: answers usually come within a
/// few round trips of the previous one.
const EAGER_EMPTY_POLLS: u32 = 16;
/// The first back-off step, doubling up to [`MAX_BACKOFF`].
const MIN_BACKOFF: Duration = Duration::from_micros(10);
/// The longest wait between two polls of a transfer: the most an answer waits to be seen once
/// polls have backed off (the scatter of a window of chunks takes longer than this).
const MAX_BACKOFF: Duration = Duration::from_micros(200);

/// One transfer's poll.
#[derive(Debug)]
pub(crate) struct Poll {
    /// Its fetch slice.
    pub(crate) slice: u32,
    /// A fetch was posted and its bytes not yet handed to the core.
    pub(crate) posted: bool,
    /// When the fetch in flight was posted.
    pub(crate) posted_at: Instant,
    /// Its READs still in flight, and the bytes the fetch covers in all.
    pub(crate) reads: Vec<WriteId>,
    pub(crate) len: u64,
    /// The peer arena's inner metadata the READs go through (not unloaded while one runs).
    pub(crate) remote_md: Option<Md>,
    /// A READ failed: the fetch is void.
    pub(crate) failed: bool,
    /// Polls in a row that brought nothing new.
    empty: u32,
    /// Not before this instant.
    pub(crate) next_at: Instant,
}

/// The polls of all our one-way transfers.
#[derive(Debug)]
pub(crate) struct Fetches {
    free: Vec<u32>,
    polls: HashMap<XferId, Poll>,
}

impl Fetches {
    /// `slices` fetch slices, all free.
    pub(crate) fn new(slices: u32) -> Self {
        Self { free: (0..slices).rev().collect(), polls: HashMap::new() }
    }

    /// True when some READ is in flight or some transfer is being polled.
    pub(crate) fn busy(&self) -> bool {
        !self.polls.is_empty()
    }

    /// The poll of `xfer`, giving it a slice on first sight (`None`: no slice free now; it
    /// waits for one).
    pub(crate) fn poll(&mut self, xfer: XferId, now: Instant) -> Option<&mut Poll> {
        if !self.polls.contains_key(&xfer) {
            let slice = self.free.pop()?;
            let poll = Poll {
                slice,
                posted: false,
                posted_at: now,
                reads: Vec::new(),
                len: 0,
                remote_md: None,
                failed: false,
                empty: 0,
                next_at: now,
            };
            self.polls.insert(xfer, poll);
        }
        self.polls.get_mut(&xfer)
    }

    /// The transfers being polled.
    pub(crate) fn xfers(&self) -> Vec<XferId> {
        self.polls.keys().copied().collect()
    }

    /// A finished fetch of `xfer` brought `new` records: when to poll next.
    pub(crate) fn fetched(&mut self, xfer: XferId, new: usize, now: Instant) {
        let Some(p) = self.polls.get_mut(&xfer) else { return };
        p.posted = false;
        p.reads.clear();
        p.failed = false;
        if new > 0 {
            p.empty = 0;
            p.next_at = now;
        } else {
            p.empty = p.empty.saturating_add(1);
            p.next_at = now + backoff(p.empty);
        }
    }

    /// True when some READ is in flight.
    pub(crate) fn reading(&self) -> bool {
        self.polls.values().any(|p| !p.reads.is_empty())
    }

    /// Every READ still in flight, forgotten here (the reactor is stopping and releases them).
    pub(crate) fn take_reads(&mut self) -> Vec<WriteId> {
        self.polls.values_mut().flat_map(|p| std::mem::take(&mut p.reads)).collect()
    }

    /// True when a READ in flight goes through the peer registration `md`.
    pub(crate) fn uses(&self, md: Md) -> bool {
        self.polls.values().any(|p| !p.reads.is_empty() && p.remote_md == Some(md))
    }

    /// `xfer` is no longer read (it ended) and none of its READs is in flight: its slice is
    /// free again.
    pub(crate) fn remove(&mut self, xfer: XferId) {
        if let Some(p) = self.polls.remove(&xfer) {
            self.free.push(p.slice);
        }
    }
}

/// The wait after `empty` polls in a row brought nothing.
fn backoff(empty: u32) -> Duration {
    match empty.checked_sub(EAGER_EMPTY_POLLS) {
        None | Some(0) => Duration::ZERO,
        Some(n) => MIN_BACKOFF.saturating_mul(1 << (n - 1).min(16)).min(MAX_BACKOFF),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn polls_back_off_after_empty_rounds_up_to_the_cap_and_snap_back_on_an_answer() {
        assert_eq!(backoff(1), Duration::ZERO);
        assert_eq!(backoff(EAGER_EMPTY_POLLS), Duration::ZERO);
        assert_eq!(backoff(EAGER_EMPTY_POLLS + 1), MIN_BACKOFF);
        assert_eq!(backoff(EAGER_EMPTY_POLLS + 2), MIN_BACKOFF * 2);
        assert_eq!(backoff(EAGER_EMPTY_POLLS + 40), MAX_BACKOFF);
        let mut f = Fetches::new(1);
        let t = Instant::now();
        let x = XferId(1);
        assert!(f.poll(x, t).is_some());
        for _ in 0..EAGER_EMPTY_POLLS + 3 {
            f.fetched(x, 0, t);
        }
        assert_eq!(f.poll(x, t).unwrap().next_at, t + MIN_BACKOFF * 4);
        f.fetched(x, 2, t);
        assert_eq!(f.poll(x, t).unwrap().next_at, t, "an answer snaps the poll back");
    }

    #[test]
    fn a_slice_is_held_until_its_transfer_is_removed_and_then_reused() {
        let mut f = Fetches::new(2);
        let t = Instant::now();
        let a = f.poll(XferId(1), t).unwrap().slice;
        let b = f.poll(XferId(2), t).unwrap().slice;
        assert_ne!(a, b);
        assert!(f.poll(XferId(3), t).is_none(), "no slice free: the third waits");
        f.remove(XferId(1));
        assert_eq!(f.poll(XferId(3), t).unwrap().slice, a);
        assert_eq!(f.poll(XferId(2), t).unwrap().slice, b, "a held slice stays with its transfer");
    }
}
