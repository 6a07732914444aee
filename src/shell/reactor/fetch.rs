//! The one-way initiator's mailbox polls (docs/one-way.md, "Poll policy"): for each of our
//! one-way transfers, the READs of the target's mailbox that bring its answers into a fetch
//! slice of our own arena, and when to post the next.
//!
//! Bookkeeping and policy only: the reactor posts the READs on its data path and hands the
//! bytes to the core. Each transfer being read holds one fetch slice; a transfer's READs are in
//! flight at most once at a time, and its slice is given back only once none is (a READ still
//! in flight would land in a slice given to another transfer).

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use bounce_proto::{PeerId, XferId};

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
    /// The target it reads.
    peer: PeerId,
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
    /// Slices each target's transfers hold, at most `per_peer_max`: a slice is held until its
    /// READ completes, and a stopped target's never do, so one stopped target (or a few) must
    /// not hold every slice and starve the transfers to the others.
    held: HashMap<PeerId, u32>,
    per_peer_max: u32,
    /// The peer registrations of READs let go in flight (an ended transfer's, after
    /// `FETCH_LET_GO`): such a READ may still land in our fetch area, so the area is not
    /// unmapped at a stop ([`Self::may_still_land`]) and those registrations are not unloaded
    /// ([`Self::uses`]) while the engine lives.
    let_go: HashSet<Md>,
}

impl Fetches {
    /// `slices` fetch slices, all free, at most a quarter of them (at least one) to one target.
    pub(crate) fn new(slices: u32) -> Self {
        let per_peer_max = (slices / 4).max(1);
        Self {
            free: (0..slices).rev().collect(),
            polls: HashMap::new(),
            held: HashMap::new(),
            per_peer_max,
            let_go: HashSet::new(),
        }
    }

    /// True when some READ is in flight or some transfer is being polled.
    pub(crate) fn busy(&self) -> bool {
        !self.polls.is_empty()
    }

    /// The poll of `xfer`, a transfer to `peer`, giving it a slice on first sight (`None`: no
    /// slice free now, or `peer`'s transfers hold their share; it waits for one).
    pub(crate) fn poll(&mut self, xfer: XferId, peer: PeerId, now: Instant) -> Option<&mut Poll> {
        if !self.polls.contains_key(&xfer) {
            // No slice free: nothing recorded (an entry per waiting peer would stay at 0).
            if self.free.is_empty() {
                return None;
            }
            let held = self.held.entry(peer).or_default();
            if *held >= self.per_peer_max {
                return None;
            }
            let slice = self.free.pop()?;
            *held += 1;
            let poll = Poll {
                slice,
                peer,
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

    /// The poll of `xfer`, if it holds a slice.
    pub(crate) fn existing(&mut self, xfer: XferId) -> Option<&mut Poll> {
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

    /// True when a READ in flight goes through the peer registration `md`, or one let go did.
    #[cfg(test)]
    pub(crate) fn uses(&self, md: Md) -> bool {
        let mut used = HashSet::new();
        self.uses_into(&mut used);
        used.contains(&md)
    }

    /// Adds the peer registrations READs in flight go through, and those of READs let go, to
    /// `into`.
    pub(crate) fn uses_into(&self, into: &mut HashSet<Md>) {
        into.extend(self.let_go.iter().copied());
        into.extend(self.polls.values().filter(|p| !p.reads.is_empty()).filter_map(|p| p.remote_md));
    }

    /// A READ through `md` was released before it came back (see the field `let_go`).
    pub(crate) fn note_let_go(&mut self, md: Md) {
        self.let_go.insert(md);
    }

    /// Whether a READ let go may still land in the fetch area.
    pub(crate) fn may_still_land(&self) -> bool {
        !self.let_go.is_empty()
    }

    /// `xfer` is no longer read (it ended) and none of its READs is in flight: its slice is
    /// free again.
    pub(crate) fn remove(&mut self, xfer: XferId) {
        if let Some(p) = self.polls.remove(&xfer) {
            self.free.push(p.slice);
            if let Some(n) = self.held.get_mut(&p.peer) {
                *n -= 1;
                if *n == 0 {
                    self.held.remove(&p.peer);
                }
            }
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

    const P: PeerId = PeerId(1);

    /// A READ let go in flight keeps its peer registration loaded and the fetch area mapped
    /// for the engine's life, whatever happens to its transfer's poll.
    #[test]
    fn a_read_let_go_keeps_its_registration_and_the_area() {
        let mut f = Fetches::new(8);
        assert!(!f.may_still_land() && !f.uses(Md(7)));
        f.poll(XferId(1), P, Instant::now()).expect("a slice");
        f.note_let_go(Md(7));
        f.remove(XferId(1));
        assert!(f.may_still_land());
        assert!(f.uses(Md(7)) && !f.uses(Md(8)));
        f.note_let_go(Md(7));
        assert_eq!(f.let_go, HashSet::from([Md(7)]), "each registration once");
    }

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
        assert!(f.poll(x, P, t).is_some());
        for _ in 0..EAGER_EMPTY_POLLS + 3 {
            f.fetched(x, 0, t);
        }
        assert_eq!(f.poll(x, P, t).unwrap().next_at, t + MIN_BACKOFF * 4);
        f.fetched(x, 2, t);
        assert_eq!(f.poll(x, P, t).unwrap().next_at, t, "an answer snaps the poll back");
    }

    #[test]
    fn a_slice_is_held_until_its_transfer_is_removed_and_then_reused() {
        let mut f = Fetches::new(8);
        f.free.truncate(2);
        let t = Instant::now();
        let a = f.poll(XferId(1), P, t).unwrap().slice;
        let b = f.poll(XferId(2), P, t).unwrap().slice;
        assert_ne!(a, b);
        assert!(f.poll(XferId(3), P, t).is_none(), "no slice free: the third waits");
        f.remove(XferId(1));
        assert_eq!(f.poll(XferId(3), P, t).unwrap().slice, a);
        assert_eq!(f.poll(XferId(2), P, t).unwrap().slice, b, "a held slice stays with its transfer");
    }

    /// A target whose READs never complete (stopped) keeps its transfers' slices: it holds at
    /// most a quarter of them, and transfers to other targets still get theirs.
    #[test]
    fn one_target_holds_at_most_a_quarter_of_the_slices() {
        let mut f = Fetches::new(8);
        let t = Instant::now();
        let stopped = PeerId(1);
        assert!(f.poll(XferId(1), stopped, t).is_some() && f.poll(XferId(2), stopped, t).is_some());
        assert!(f.poll(XferId(3), stopped, t).is_none(), "its share is two of eight");
        // Three other targets take the six slices left, two each.
        for x in 4..10u32 {
            assert!(f.poll(XferId(u64::from(x)), PeerId(u64::from(2 + (x - 4) / 2)), t).is_some(), "{x}");
        }
        assert!(f.poll(XferId(10), PeerId(9), t).is_none(), "every slice is held");
        f.remove(XferId(1));
        assert!(f.poll(XferId(10), PeerId(9), t).is_some(), "a freed slice serves another target");
        assert!(f.existing(XferId(10)).is_some() && f.existing(XferId(1)).is_none());
        f.remove(XferId(4));
        assert!(f.poll(XferId(3), stopped, t).is_some(), "back under its share, with a slice free");
    }
}
