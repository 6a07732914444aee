//! The table of requests BOUNCE owns (bounce path), shared by application threads (prep, post,
//! check, release) and the reactor (completion). Pass-through requests never enter it.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bounce_proto::XferId;
use bounce_proto::endpoint::XferError;
use bounce_proto::plan::Plan;
use parking_lot::Mutex;

/// Where a request stands.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum State {
    /// Prepared, never posted.
    Prepared,
    /// Posted as this transfer id (a repost gets a fresh one: rids are never reused).
    Posted(XferId),
    /// Finished.
    Done(Result<(), XferError>),
}

/// One prepared request.
#[derive(Debug)]
pub(super) struct Request {
    /// The peer agent.
    pub peer: String,
    /// The chunk plan, computed once at prep.
    pub plan: Arc<Plan>,
    /// Where it stands.
    pub state: State,
}

/// What the reactor needs to run a posted request.
#[derive(Debug)]
pub(super) struct Posted {
    /// Fresh transfer id.
    pub xfer: XferId,
    /// The request handle it belongs to.
    pub handle: u64,
    /// The peer agent.
    pub peer: String,
    /// The plan.
    pub plan: Arc<Plan>,
    /// Notification to deliver once every chunk is scattered.
    pub notif: Option<Vec<u8>>,
}

/// Why a post was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum PostError {
    /// No such handle.
    Unknown,
    /// Still in flight.
    Active,
    /// The reactor is gone (engine shutting down, or it died): nothing would ever run it.
    Closed,
}

/// The request table.
#[derive(Debug, Default)]
pub(super) struct Requests {
    map: Mutex<HashMap<u64, Request>>,
    /// Set under `map`'s lock by [`Self::close`]; posts are refused from then on.
    closed: std::sync::atomic::AtomicBool,
    next_handle: AtomicU64,
    next_xfer: AtomicU64,
}

impl Requests {
    /// Adds a prepared request; returns its handle id (never 0).
    pub(super) fn insert(&self, peer: String, plan: Plan) -> u64 {
        let h = self.next_handle.fetch_add(1, Ordering::Relaxed) + 1;
        self.map.lock().insert(h, Request { peer, plan: Arc::new(plan), state: State::Prepared });
        h
    }

    /// Marks a request posted under a fresh transfer id.
    pub(super) fn post(&self, handle: u64, notif: Option<Vec<u8>>) -> Result<Posted, PostError> {
        let mut map = self.map.lock();
        if self.closed.load(Ordering::Relaxed) {
            return Err(PostError::Closed);
        }
        let r = map.get_mut(&handle).ok_or(PostError::Unknown)?;
        if matches!(r.state, State::Posted(_)) {
            return Err(PostError::Active);
        }
        let xfer = XferId(self.next_xfer.fetch_add(1, Ordering::Relaxed) + 1);
        r.state = State::Posted(xfer);
        Ok(Posted { xfer, handle, peer: r.peer.clone(), plan: Arc::clone(&r.plan), notif })
    }

    /// The request's state.
    pub(super) fn state(&self, handle: u64) -> Option<State> {
        self.map.lock().get(&handle).map(|r| r.state.clone())
    }

    /// Records a transfer's outcome, if its request still waits for exactly that transfer.
    pub(super) fn finish(&self, handle: u64, xfer: XferId, outcome: Result<(), XferError>) {
        if let Some(r) = self.map.lock().get_mut(&handle) {
            if r.state == State::Posted(xfer) {
                r.state = State::Done(outcome);
            }
        }
    }

    /// Removes a request; returns the transfer to cancel if it was still in flight.
    pub(super) fn remove(&self, handle: u64) -> Option<Option<XferId>> {
        self.map.lock().remove(&handle).map(|r| match r.state {
            State::Posted(x) => Some(x),
            _ => None,
        })
    }

    /// Fails every in-flight request and refuses new posts: the reactor stopped or died, so
    /// nothing would ever run them (a post after this must not hang).
    pub(super) fn close(&self, why: XferError) {
        let mut map = self.map.lock();
        self.closed.store(true, Ordering::Relaxed);
        for r in map.values_mut() {
            if matches!(r.state, State::Posted(_)) {
                r.state = State::Done(Err(why.clone()));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repost_gets_a_fresh_xfer_and_stale_completions_are_ignored() {
        let t = Requests::default();
        let h = t.insert("peer".into(), Plan::default());
        assert_eq!(t.state(h), Some(State::Prepared));
        let p1 = t.post(h, None).unwrap();
        assert_eq!(t.post(h, None).unwrap_err(), PostError::Active);
        t.finish(h, p1.xfer, Ok(()));
        assert_eq!(t.state(h), Some(State::Done(Ok(()))));
        let p2 = t.post(h, Some(b"n".to_vec())).unwrap();
        assert_ne!(p1.xfer, p2.xfer);
        t.finish(h, p1.xfer, Err(XferError::Timeout)); // stale: ignored
        assert_eq!(t.state(h), Some(State::Posted(p2.xfer)));
        assert_eq!(t.remove(h), Some(Some(p2.xfer)));
        assert_eq!(t.post(h, None).unwrap_err(), PostError::Unknown);
    }

    #[test]
    fn closing_fails_in_flight_requests_and_refuses_new_posts() {
        let t = Requests::default();
        let (a, b) = (t.insert("p".into(), Plan::default()), t.insert("p".into(), Plan::default()));
        let pa = t.post(a, None).unwrap();
        t.close(XferError::ShuttingDown);
        assert_eq!(t.state(a), Some(State::Done(Err(XferError::ShuttingDown))));
        assert_eq!(t.post(b, None).unwrap_err(), PostError::Closed);
        t.finish(a, pa.xfer, Ok(())); // a late completion cannot turn it into a success
        assert_eq!(t.state(a), Some(State::Done(Err(XferError::ShuttingDown))));
    }
}
