//! The fence between `deregisterMem` and the bounce path's jobs: every copy job and direct
//! write is *pinned* here (its user-memory span) before it is handed to a copy engine or the
//! inner engine, and unpinned when it ends. A deregistration marks its range removed first and
//! then looks for a pinned job touching it: when there is none it may return at once (no job
//! touches the range now, and none pinned later can, since pinning refuses removed ranges);
//! otherwise it waits for the reactor. The removed mark stays until the reactor has handed out
//! every job the core emitted before it and applied the deregistration to the core (then the
//! same addresses may be registered and used again).
//!
//! This is what keeps a deregistration at UCX's cost when nothing is in flight: one lock, no
//! round trip to the reactor.

use std::collections::HashMap;

use bounce_proto::CopyRun;
use parking_lot::Mutex;

/// A user-memory range `[start, end)`.
pub(crate) type Span = (u64, u64);

/// Whether `[a, b)` and `[c, d)` share a byte.
pub(crate) fn overlaps((a, b): Span, (c, d): Span) -> bool {
    a < d && c < b
}

/// The outer bounds of `runs`' user-side spans (what a copy job pins); `None` for no copies.
pub(crate) fn runs_span(runs: &[CopyRun]) -> Option<Span> {
    runs.iter().filter_map(CopyRun::addr_span).reduce(|(a, b), (c, d)| (a.min(c), b.max(d)))
}

/// Whether one of `runs`' user-side spans overlaps `range` (the precise test behind a pin).
pub(crate) fn runs_touch(runs: &[CopyRun], range: Span) -> bool {
    runs.iter().filter_map(CopyRun::addr_span).any(|r| overlaps(r, range))
}

/// A same-host request's side in our memory: its pieces' ranges, so that a deregistration
/// tells precisely which requests it revokes (a KV request's pieces span many registrations;
/// its outer bounds would take in memory it never touches). Kept as they come, with their
/// outer bounds: the prep of every request pays one push a piece, and only a deregistration
/// whose range meets the outer bounds looks at the pieces.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Ranges {
    outer: Span,
    spans: Vec<Span>,
}

impl Ranges {
    /// The ranges of `spans` (empty ones left out).
    pub(crate) fn new(spans: impl IntoIterator<Item = Span>) -> Self {
        let spans: Vec<Span> = spans.into_iter().filter(|&(a, b)| a < b).collect();
        let outer = spans.iter().fold((u64::MAX, 0), |(a, b), &(c, d)| (a.min(c), b.max(d)));
        Self { outer, spans }
    }

    /// Whether one of the ranges overlaps `range`.
    #[cfg(test)]
    pub(crate) fn touches(&self, range: Span) -> bool {
        self.loses(range, &|_| false)
    }

    /// Whether deregistering `range` takes memory from under them: one of the ranges overlaps
    /// it where `kept` (memory another registration still covers whole) does not hold.
    pub(crate) fn loses(&self, range: Span, kept: &dyn Fn(Span) -> bool) -> bool {
        overlaps(self.outer, range) && spans_lose(self.spans.iter().copied(), range, kept)
    }
}

/// Whether one of `spans` overlaps `range` in bytes `kept` does not hold (see
/// [`Ranges::loses`]): only the overlap is asked about, the rest of a span keeps whatever
/// registration it had.
pub(crate) fn spans_lose(mut spans: impl Iterator<Item = Span>, range: Span, kept: &dyn Fn(Span) -> bool) -> bool {
    spans.any(|s| overlaps(s, range) && !kept((s.0.max(range.0), s.1.min(range.1))))
}

/// A pinned job's token (unpin it exactly once).
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Pin(u64);

#[derive(Debug, Default)]
struct State {
    pinned: HashMap<u64, Span>,
    next: u64,
    /// Deregistered ranges the reactor has not applied yet (one entry per deregistration).
    removed: Vec<Span>,
}

/// See the module docs. Shared by the application threads and the reactor.
#[derive(Debug, Default)]
pub(crate) struct Fence(Mutex<State>);

impl Fence {
    /// The application deregisters `range`: from now on no job touching it is pinned. Returns
    /// `Some(mark)` when a pinned job touches it (the caller must wait for the reactor, and
    /// only for jobs pinned up to `mark`: see [`busy`](Self::busy)).
    pub(crate) fn deregister(&self, range: Span) -> Option<u64> {
        let mut s = self.0.lock();
        s.removed.push(range);
        s.pinned.values().any(|&p| overlaps(p, range)).then_some(s.next)
    }

    /// The reactor applied the deregistration of `range` to the core and handed out every job
    /// the core emitted before it: the mark can go.
    pub(crate) fn applied(&self, range: Span) {
        let mut s = self.0.lock();
        if let Some(i) = s.removed.iter().position(|&r| r == range) {
            s.removed.swap_remove(i);
        }
    }

    /// Pins a job whose user memory lies within `span`, unless it touches a removed range;
    /// `touches(range)` says precisely whether it does (the span is only its outer bounds), and
    /// is asked only when the span overlaps one. `None`: the job must not run.
    pub(crate) fn pin(&self, span: Span, touches: impl Fn(Span) -> bool) -> Option<Pin> {
        let mut s = self.0.lock();
        if s.removed.iter().any(|&r| overlaps(span, r) && touches(r)) {
            return None;
        }
        s.next += 1;
        let id = s.next;
        s.pinned.insert(id, span);
        Some(Pin(id))
    }

    /// The pinned job ended.
    pub(crate) fn unpin(&self, pin: Pin) {
        self.0.lock().pinned.remove(&pin.0);
    }

    /// Whether pinned job `pin` touches `range`.
    pub(crate) fn pin_touches(&self, pin: &Pin, range: Span) -> bool {
        self.0.lock().pinned.get(&pin.0).is_some_and(|&p| overlaps(p, range))
    }

    /// True when a job pinned up to `mark` ([`deregister`](Self::deregister)'s) touches `range`.
    /// A job pinned after the mark does not touch it (pinning refused those that do), though
    /// its outer bounds may: counting it kept a deregistration of memory lying between a KV
    /// cache's layers waiting for as long as scatters straddling it kept coming.
    pub(crate) fn busy(&self, range: Span, mark: u64) -> bool {
        self.0.lock().pinned.iter().any(|(&id, &p)| id <= mark && overlaps(p, range))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A deregistration takes memory from under a request only where no other registration
    /// still covers the bytes its pieces share with the range (review 60, L3).
    #[test]
    fn ranges_lose_only_the_bytes_no_other_registration_keeps() {
        let r = Ranges::new([(100, 200), (1000, 1100)]);
        let kept_by = |a: u64, b: u64| move |(x, y): Span| a <= x && y <= b;
        assert!(r.loses((150, 160), &|_| false), "nothing keeps it");
        assert!(!r.loses((150, 160), &kept_by(0, 300)), "another registration covers the overlap");
        assert!(
            !r.loses((150, 1050), &kept_by(100, 1100)),
            "asked about the overlaps only: (150, 200) and (1000, 1050)"
        );
        assert!(r.loses((150, 1050), &kept_by(100, 200)), "(1000, 1050) is not kept");
        assert!(r.loses((0, 5000), &kept_by(120, 5000)), "(100, 120) is not kept");
        assert!(!r.loses((300, 900), &|_| false), "between the pieces: nothing lost");
    }

    #[test]
    fn ranges_tell_precisely_whether_a_range_is_touched() {
        // Two pieces of one layer, one of another far above, and an empty one between.
        let r = Ranges::new([(1000, 1100), (100, 200), (200, 300), (500, 500)]);
        assert!(r.touches((250, 260)) && r.touches((0, 101)) && r.touches((1099, 5000)));
        assert!(!r.touches((500, 501)), "an empty piece touches nothing");
        // Between and beyond them, within their outer bounds or not: untouched.
        assert!(!r.touches((300, 1000)) && !r.touches((0, 100)) && !r.touches((1100, 1200)));
        assert!(!Ranges::new([]).touches((0, u64::MAX)));
    }

    #[test]
    fn a_removed_range_refuses_pins_and_a_pinned_job_makes_the_deregistration_wait() {
        let f = Fence::default();
        let job = f.pin((100, 200), |_| true).expect("nothing removed yet");
        let mark = f.deregister((150, 160)).expect("the pinned job touches it: wait");
        assert!(f.busy((150, 160), mark) && !f.busy((200, 300), mark));
        assert!(f.pin((120, 130), |_| true).is_some(), "outside the removed range");
        assert_eq!(f.pin((155, 156), |_| true), None, "inside it: refused");
        // The outer span overlaps, but the job's runs do not touch the range: it runs, and the
        // deregistration does not wait for it.
        let straddling = f.pin((140, 170), |_| false).expect("its runs miss the range");
        f.unpin(job);
        assert!(!f.busy((150, 160), mark), "only jobs pinned before the mark are waited for");
        assert!(f.busy((150, 160), u64::MAX), "the straddling job's outer span overlaps");
        f.unpin(straddling);
        assert_eq!(f.deregister((100, 120)), None, "the job that touched it was unpinned");
        f.applied((150, 160));
        assert!(f.pin((155, 156), |_| true).is_some(), "applied: the range may be registered again");
        assert_eq!(f.pin((105, 106), |_| true), None, "(100, 120) is still removed");
    }
}
