//! The table of requests BOUNCE owns (bounce path), shared by application threads (prep, post,
//! check, release) and the reactor (completion). Pass-through requests never enter it.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use bounce_proto::endpoint::XferError;
use bounce_proto::plan::Plan;
use bounce_proto::{PeerId, XferId};
use parking_lot::{Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::shell::doorbell::Doorbell;
use crate::shell::fence::{Span, overlaps, spans_lose};
use crate::shell::{Error, Result};

/// Where a request stands.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum State {
    /// Prepared, never posted.
    Prepared,
    /// Posted as this transfer id (a repost gets a fresh one: rids are never reused).
    Posted(XferId),
    /// Finished.
    Done(std::result::Result<(), XferError>),
}

/// One prepared request.
#[derive(Debug)]
pub(crate) struct Request {
    /// The peer agent.
    pub peer: String,
    /// The incarnation of it the plan was made for (its id then; `None`: not known then).
    pub peer_id: Option<PeerId>,
    /// The chunk plan, computed once at prep.
    pub plan: Arc<Plan>,
    /// Where it stands.
    pub state: State,
    /// When the application last found it in flight (busy-poll detection).
    pub last_check: Option<Instant>,
    /// The outer bounds of our memory the plan touches (`None`: none), so that a
    /// deregistration looks at the plan's runs only when they may meet it.
    local_hull: Option<Span>,
    /// Part of that memory was deregistered since the prep: no post runs any more.
    revoked: bool,
}

/// What the reactor needs to run a posted request.
#[derive(Debug)]
pub(crate) struct Posted {
    /// Fresh transfer id.
    pub xfer: XferId,
    /// The request handle it belongs to.
    pub handle: u64,
    /// The peer agent.
    pub peer: String,
    /// The incarnation of it the plan was made for (see [`Request::peer_id`]).
    pub peer_id: Option<PeerId>,
    /// The plan.
    pub plan: Arc<Plan>,
    /// Notification to deliver once every chunk is scattered.
    pub notif: Option<Vec<u8>>,
}

/// What releasing a request left to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Released {
    /// It was not in flight: nothing to cancel.
    Idle,
    /// It was in flight as this transfer, which must be canceled.
    InFlight(XferId),
}

/// The transfer id before a table's first, taken at `now`: nanoseconds since 1970 (below
/// 2^61 until the year 2043, leaving 2^62 ids), or 0 for a clock before 1970.
fn first_xfer(now: std::time::SystemTime) -> u64 {
    now.duration_since(std::time::UNIX_EPOCH).map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(0) & ((1 << 62) - 1))
}

/// The request table.
#[derive(Debug, Default)]
pub(crate) struct Requests {
    map: Mutex<HashMap<u64, Request>>,
    /// Notified whenever a request finishes; busy pollers wait on it.
    finished: Condvar,
    /// Set under `map`'s lock by [`Self::close`]; posts are refused from then on.
    closed: std::sync::atomic::AtomicBool,
    next_handle: AtomicU64,
    next_xfer: AtomicU64,
    /// Requests posted and not yet finished or released (kept under `map`'s lock).
    in_flight: AtomicUsize,
    /// Rung whenever a request finishes (application pollers wait on it, see `Engine::take_notifs`).
    bell: Arc<Doorbell>,
}

impl Requests {
    /// An empty table that rings `bell` whenever a request finishes. Its transfer ids start
    /// above the wall clock's nanoseconds since 1970, not at 1: a process restarted under
    /// the same agent name then numbers its transfers above any its previous incarnation used.
    /// A target that cannot tell the two apart (one that never loaded our metadata) would
    /// otherwise take a reused id for the old transfer still open there, refuse the new
    /// WANT's token as a forgery and let the transfer time out, and would serve inline WANTs
    /// the slow way until the ids passed the old ones (they only grow).
    pub(crate) fn new(bell: Arc<Doorbell>) -> Self {
        Self { bell, next_xfer: AtomicU64::new(first_xfer(std::time::SystemTime::now())), ..Self::default() }
    }

    /// Requests posted and not yet finished or released.
    pub(crate) fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// Adds a request prepared for `peer` (its incarnation `peer_id`); returns its handle id
    /// (never 0).
    pub(crate) fn insert(&self, peer: String, peer_id: Option<PeerId>, plan: Plan) -> u64 {
        let h = self.next_handle.fetch_add(1, Ordering::Relaxed) + 1;
        let local_hull = plan.local_spans(plan.read).reduce(|(a, b), (c, d)| (a.min(c), b.max(d)));
        let plan = Arc::new(plan);
        let r = Request { peer, peer_id, plan, state: State::Prepared, last_check: None, local_hull, revoked: false };
        self.map.lock().insert(h, r);
        h
    }

    /// Marks a request posted under a fresh transfer id (tests; the engine posts with
    /// [`Self::post_then`]).
    ///
    /// # Errors
    /// [`Error::BounceClosed`] after [`Self::close`], [`Error::UnknownRequest`],
    /// [`Error::RepostActive`] while it is in flight.
    #[cfg(test)]
    pub(crate) fn post(&self, handle: u64, notif: Option<Vec<u8>>) -> Result<Posted> {
        self.post_locked(&mut self.map.lock(), handle, notif)
    }

    /// Marks a request posted under a fresh transfer id and hands it to `submit` while the
    /// table is still locked: a release of the same handle on another thread (which takes the lock to find it
    /// posted) then comes after the submit, and its cancel reaches the reactor after it. Let go
    /// between the two, a release could return before its own post's transfer ran, and a READ
    /// would then write the destinations it was releasing (review 58). `submit` must not take
    /// this table's lock.
    ///
    /// # Errors
    /// [`Error::BounceClosed`] after [`Self::close`], [`Error::UnknownRequest`],
    /// [`Error::RepostActive`] while it is in flight; then `submit` is not called.
    pub(crate) fn post_then(&self, handle: u64, notif: Option<Vec<u8>>, submit: impl FnOnce(Posted)) -> Result<()> {
        let mut map = self.map.lock();
        let posted = self.post_locked(&mut map, handle, notif)?;
        submit(posted);
        Ok(())
    }

    fn post_locked(&self, map: &mut HashMap<u64, Request>, handle: u64, notif: Option<Vec<u8>>) -> Result<Posted> {
        if self.closed.load(Ordering::Relaxed) {
            return Err(Error::BounceClosed);
        }
        let r = map.get_mut(&handle).ok_or(Error::UnknownRequest(handle))?;
        if matches!(r.state, State::Posted(_)) {
            return Err(Error::RepostActive(handle));
        }
        if r.revoked {
            r.state = State::Done(Err(XferError::Deregistered));
            return Err(Error::Xfer(XferError::Deregistered));
        }
        let xfer = XferId(self.next_xfer.fetch_add(1, Ordering::Relaxed) + 1);
        r.state = State::Posted(xfer);
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        Ok(Posted { xfer, handle, peer: r.peer.clone(), peer_id: r.peer_id, plan: Arc::clone(&r.plan), notif })
    }

    /// Our memory `range` is being deregistered: every request whose plan touches it where
    /// `kept` (another registration of that memory still covering those bytes whole) does not
    /// hold is revoked, so that a later post fails (`Deregistered`) instead of scattering into,
    /// or gathering from, memory the application may have freed (review 61, READ H1: the core
    /// fails only the transfers in flight, and a request prepared before and posted after
    /// wrote the range and reported DONE). Called before the reactor is told of the
    /// deregistration: a post that came first has queued its submit ahead of it, and the core
    /// fails it as in flight.
    pub(crate) fn revoke(&self, range: Span, kept: &dyn Fn(Span) -> bool) {
        let mut map = self.map.lock();
        for r in map.values_mut().filter(|r| !r.revoked && r.local_hull.is_some_and(|h| overlaps(h, range))) {
            r.revoked = spans_lose(r.plan.local_spans(r.plan.read), range, kept);
        }
    }

    /// The request's state.
    #[cfg(test)]
    pub(crate) fn state(&self, handle: u64) -> Option<State> {
        self.map.lock().get(&handle).map(|r| r.state.clone())
    }

    /// The request's state, as the application's status check sees it. A request found in
    /// flight by a check that follows the previous one within `tight` is being busy-polled:
    /// that check waits up to `wait` for any request to finish before answering, so the
    /// poller stops taking the cores the copy engine needs, and wakes the moment work ends.
    pub(crate) fn check(&self, handle: u64, tight: Duration, wait: Duration) -> Option<State> {
        let mut map = self.map.lock();
        let r = map.get_mut(&handle)?;
        if !matches!(r.state, State::Posted(_)) {
            return Some(r.state.clone());
        }
        let now = Instant::now();
        let busy_poll = r.last_check.is_some_and(|t| now.saturating_duration_since(t) < tight);
        r.last_check = Some(now);
        if !busy_poll || wait.is_zero() {
            return Some(r.state.clone());
        }
        let _ = self.finished.wait_for(&mut map, wait);
        // Measured from the end of the wait: the poller's next check is then tight again.
        let r = map.get_mut(&handle)?;
        r.last_check = Some(Instant::now());
        Some(r.state.clone())
    }

    /// Records a transfer's outcome, if its request still waits for exactly that transfer.
    pub(crate) fn finish(&self, handle: u64, xfer: XferId, outcome: std::result::Result<(), XferError>) {
        if let Some(r) = self.map.lock().get_mut(&handle) {
            if r.state == State::Posted(xfer) {
                r.state = State::Done(outcome);
                self.in_flight.fetch_sub(1, Ordering::Relaxed);
                self.finished.notify_all();
                self.bell.ring();
            }
        }
    }

    /// Removes a request; says whether it was still in flight (`None`: no such request).
    pub(crate) fn remove(&self, handle: u64) -> Option<Released> {
        self.map.lock().remove(&handle).map(|r| match r.state {
            State::Posted(x) => {
                self.in_flight.fetch_sub(1, Ordering::Relaxed);
                Released::InFlight(x)
            }
            _ => Released::Idle,
        })
    }

    /// Fails every in-flight request and refuses new posts: the reactor stopped or died, so
    /// nothing would ever run them (a post after this must not hang).
    pub(crate) fn close(&self, why: XferError) {
        let mut map = self.map.lock();
        self.closed.store(true, Ordering::Relaxed);
        for r in map.values_mut() {
            if matches!(r.state, State::Posted(_)) {
                r.state = State::Done(Err(why.clone()));
                self.in_flight.fetch_sub(1, Ordering::Relaxed);
            }
        }
        self.finished.notify_all();
        self.bell.ring();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repost_gets_a_fresh_xfer_and_stale_completions_are_ignored() {
        let t = Requests::default();
        let h = t.insert("peer".into(), None, Plan::default());
        assert_eq!(t.state(h), Some(State::Prepared));
        let p1 = t.post(h, None).unwrap();
        assert!(matches!(t.post(h, None), Err(Error::RepostActive(x)) if x == h));
        t.finish(h, p1.xfer, Ok(()));
        assert_eq!(t.state(h), Some(State::Done(Ok(()))));
        let p2 = t.post(h, Some(b"n".to_vec())).unwrap();
        assert_ne!(p1.xfer, p2.xfer);
        t.finish(h, p1.xfer, Err(XferError::Timeout)); // stale: ignored
        assert_eq!(t.state(h), Some(State::Posted(p2.xfer)));
        assert_eq!(t.remove(h), Some(Released::InFlight(p2.xfer)));
        assert!(matches!(t.post(h, None), Err(Error::UnknownRequest(x)) if x == h));
        let idle = t.insert("peer".into(), None, Plan::default());
        assert_eq!(t.remove(idle), Some(Released::Idle));
        assert_eq!(t.remove(idle), None);
    }

    /// A deregistration revokes the requests whose memory it takes (not one whose bytes there
    /// another registration still covers, nor one elsewhere): their next post fails, whatever
    /// their state, and nothing is handed to the reactor.
    #[test]
    fn a_request_over_deregistered_memory_fails_at_its_post() {
        use bounce_proto::plan::{DescPair, PlanParams, plan};
        let pieces = |at: u64| {
            let descs: Vec<DescPair> =
                (0..4).map(|i| DescPair { src: at + i * 8192, dst: i * 4096, len: 4096 }).collect();
            plan(&descs, PlanParams::new(1 << 20)).unwrap()
        };
        let t = Requests::default();
        let (hit, kept, elsewhere) = (
            t.insert("peer".into(), None, pieces(0x10_0000)),
            t.insert("peer".into(), None, pieces(0x20_0000)),
            t.insert("peer".into(), None, pieces(0x40_0000)),
        );
        let done = t.post(hit, None).unwrap();
        t.finish(hit, done.xfer, Ok(()));
        // The first request's third piece, and the second's: the latter's bytes stay registered.
        t.revoke((0x10_4000, 0x10_5000), &|_| false);
        t.revoke((0x20_4000, 0x20_5000), &|_| true);
        let mut handed = 0;
        let r = t.post_then(hit, None, |_| handed += 1);
        assert!(matches!(r, Err(Error::Xfer(XferError::Deregistered))), "{r:?}");
        assert_eq!(t.state(hit), Some(State::Done(Err(XferError::Deregistered))));
        assert!(matches!(t.post(hit, None), Err(Error::Xfer(XferError::Deregistered))), "revoked for good");
        t.post_then(kept, None, |_| handed += 1).unwrap();
        t.post_then(elsewhere, None, |_| handed += 1).unwrap();
        assert_eq!(handed, 2, "only the requests that kept their memory were handed on");
    }

    /// A release racing its own post on another thread finds the request posted only once the
    /// post has handed its transfer on (the cancel then follows the submit), never between.
    #[test]
    fn a_release_racing_a_post_waits_until_the_transfer_is_handed_on() {
        let t = Arc::new(Requests::default());
        let h = t.insert("peer".into(), None, Plan::default());
        let mut releaser = None;
        let mut submitted = None;
        t.post_then(h, None, |p| {
            let t2 = Arc::clone(&t);
            let r = std::thread::spawn(move || t2.remove(h));
            std::thread::sleep(Duration::from_millis(50));
            assert!(!r.is_finished(), "the release ran between the post and its submit");
            submitted = Some(p.xfer);
            releaser = Some(r);
        })
        .unwrap();
        let released = releaser.unwrap().join().unwrap();
        assert_eq!(released, Some(Released::InFlight(submitted.unwrap())));
        assert_eq!(t.in_flight(), 0);
        // A post refused hands nothing on.
        assert!(matches!(t.post_then(h, None, |_| panic!("submitted")), Err(Error::UnknownRequest(_))));
    }

    /// A table made after another (a process restarted under the same name) numbers its
    /// transfers above every id the earlier one used, however many it posted.
    #[test]
    fn a_later_table_numbers_its_transfers_above_an_earlier_ones() {
        let earlier = Requests::new(Arc::new(Doorbell::default()));
        let h = earlier.insert("peer".into(), None, Plan::default());
        let mut last = XferId(0);
        for _ in 0..10_000 {
            let p = earlier.post(h, None).unwrap();
            assert!(p.xfer > last, "ids only grow");
            last = p.xfer;
            earlier.finish(h, p.xfer, Ok(()));
        }
        std::thread::sleep(Duration::from_millis(1));
        let later = Requests::new(Arc::new(Doorbell::default()));
        let h = later.insert("peer".into(), None, Plan::default());
        assert!(later.post(h, None).unwrap().xfer > last);
        let epoch = std::time::UNIX_EPOCH;
        assert_eq!(first_xfer(epoch + Duration::from_secs(1)), 1_000_000_000);
        assert!(first_xfer(epoch + Duration::from_secs(2_000_000_000)) < 1 << 62, "masked below 2^62");
        assert_eq!(first_xfer(epoch - Duration::from_secs(1)), 0, "a clock before 1970");
    }

    /// The first check of an in-flight request answers at once; a check right behind it (a
    /// busy poll) sleeps until a request finishes, bounded by the wait.
    #[test]
    fn busy_polled_checks_sleep_until_a_finish_and_no_longer_than_the_wait() {
        let t = Arc::new(Requests::default());
        let h = t.insert("p".into(), None, Plan::default());
        let p = t.post(h, None).unwrap();
        let (tight, long) = (Duration::from_secs(60), Duration::from_secs(60));
        let start = Instant::now();
        assert_eq!(t.check(h, tight, long), Some(State::Posted(p.xfer)));
        assert!(start.elapsed() < Duration::from_secs(30), "a first check must not wait");
        // Not tight: a zero gap threshold never counts as a busy poll.
        assert_eq!(t.check(h, Duration::ZERO, long), Some(State::Posted(p.xfer)));
        assert!(start.elapsed() < Duration::from_secs(30));
        // Tight, nothing finishes: bounded by the wait.
        let short = Duration::from_millis(30);
        let before = Instant::now();
        assert_eq!(t.check(h, tight, short), Some(State::Posted(p.xfer)));
        assert!(before.elapsed() >= short);
        // Tight, and the transfer finishes meanwhile: woken by the finish, not the timeout.
        let t2 = Arc::clone(&t);
        let finisher = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            t2.finish(h, p.xfer, Ok(()));
        });
        let before = Instant::now();
        assert_eq!(t.check(h, tight, long), Some(State::Done(Ok(()))));
        assert!(before.elapsed() < Duration::from_secs(30), "the finish must wake the check");
        finisher.join().unwrap();
        // A finished request answers at once, however tight the polling.
        assert_eq!(t.check(h, tight, long), Some(State::Done(Ok(()))));
        assert_eq!(t.check(42, tight, long), None);
    }

    #[test]
    fn closing_fails_in_flight_requests_and_refuses_new_posts() {
        let t = Requests::default();
        let (a, b) = (t.insert("p".into(), None, Plan::default()), t.insert("p".into(), None, Plan::default()));
        let pa = t.post(a, None).unwrap();
        t.close(XferError::ShuttingDown);
        assert_eq!(t.state(a), Some(State::Done(Err(XferError::ShuttingDown))));
        assert!(matches!(t.post(b, None), Err(Error::BounceClosed)));
        t.finish(a, pa.xfer, Ok(())); // a late completion cannot turn it into a success
        assert_eq!(t.state(a), Some(State::Done(Err(XferError::ShuttingDown))));
    }
}
