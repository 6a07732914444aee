//! HELLO asks: a peer's HELLO is taken at its word only once the peer proves it can answer us.
//!
//! A HELLO says "I loaded your metadata": it turns our route to the peer from one way (answers
//! through our mailbox) to two way (answers by control frames). Its session is no secret (it
//! is in the peer's published metadata, which third agents may hold), so a HELLO alone could
//! be forged under the peer's name, and our two-way frames to a peer that never loaded us are
//! all dropped there: every transfer to it would fail. So a HELLO is only asked about:
//!
//! - An admitted HELLO from a loaded, compatible peer whose HELLO is not confirmed yet opens an
//!   *ask*: our own HELLO (its copy of ours may have come before it loaded us, and been
//!   dropped) and a PING whose nonce only the peer sees. It answers with a PONG only if it
//!   loaded us (a frame from an agent not loaded is dropped), and nobody else can echo the
//!   nonce. That PONG confirms the HELLO ([`HelloAsks::answered`]).
//! - One ask per peer at a time: a HELLO while one is open changes nothing, so a flood of
//!   forged HELLOs costs the peer at most the asks' schedule below, never a frame per frame.
//! - A HELLO from a peer whose HELLO is confirmed is asked about too, at most once per
//!   [`REASK_CONFIRMED_AFTER`]: the peer may have unloaded our metadata and loaded it again
//!   (same session, no restart), and then lacks our HELLO, which the ask carries, to ask about
//!   us in turn. Two confirmed peers never trade HELLOs otherwise, so this starts no exchange
//!   that does not end.
//! - An ask is repeated (HELLO and PING again, the same nonce) after [`ASK_AGAIN_AFTER`],
//!   doubling, [`MAX_ASKS`] times in all, then dropped. The repeats matter: a forged HELLO
//!   may have opened the ask just before the peer loaded us, and the peer's own HELLO then
//!   falls inside the open ask; a slow peer's PONG may be late. Keeping the nonce lets a late
//!   PONG of an earlier PING count.
//!
//! Pure bookkeeping, time passed in: the endpoint feeds it admitted HELLOs and PONGs, sends
//! what it returns, and forgets a peer's ask when the peer is lost or says GOODBYE.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use crate::types::PeerId;

/// Time after an ask before it is repeated (doubled after each repeat).
pub const ASK_AGAIN_AFTER: Duration = Duration::from_millis(100);
/// Asks sent per opened ask, the first included, before it is dropped unanswered.
pub const MAX_ASKS: u32 = 6;
/// Least time between two asks opened by HELLOs of a peer whose HELLO is confirmed.
pub const REASK_CONFIRMED_AFTER: Duration = Duration::from_secs(1);

/// An ask to send: our HELLO and a PING of `nonce` to `peer`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ask {
    /// The peer asked.
    pub peer: PeerId,
    /// The PING's nonce, which only the peer's PONG echoes.
    pub nonce: u64,
}

#[derive(Debug, Clone)]
struct Open {
    nonce: u64,
    /// When it is next repeated (or dropped, after the last).
    due: Instant,
    /// Asks sent so far.
    sent: u32,
}

/// The open asks, one per peer at most (see the module docs).
#[derive(Debug, Clone, Default)]
pub struct HelloAsks {
    open: BTreeMap<PeerId, Open>,
    /// When an ask was last opened for a confirmed peer (see [`REASK_CONFIRMED_AFTER`]).
    reasked: BTreeMap<PeerId, Instant>,
}

impl HelloAsks {
    /// No ask open.
    pub fn new() -> Self {
        Self::default()
    }

    /// An admitted HELLO from `peer`, loaded and compatible, whose HELLO is `confirmed` or
    /// not: the ask to send now (its nonce from `nonce`), or `None` when one is open already,
    /// or the peer is confirmed and was asked again less than [`REASK_CONFIRMED_AFTER`] ago.
    pub fn heard(&mut self, now: Instant, peer: PeerId, confirmed: bool, nonce: impl FnOnce() -> u64) -> Option<Ask> {
        if self.open.contains_key(&peer) {
            return None;
        }
        if confirmed {
            if self.reasked.get(&peer).is_some_and(|&at| now < at + REASK_CONFIRMED_AFTER) {
                return None;
            }
            self.reasked.insert(peer, now);
        }
        let nonce = nonce();
        self.open.insert(peer, Open { nonce, due: now + ASK_AGAIN_AFTER, sent: 1 });
        Some(Ask { peer, nonce })
    }

    /// A PONG from `peer` (admitted under its session): true when it echoes the open ask's
    /// nonce, which confirms the peer's HELLO; the ask is closed then.
    pub fn answered(&mut self, peer: PeerId, nonce: u64) -> bool {
        let hit = self.open.get(&peer).is_some_and(|o| o.nonce == nonce);
        if hit {
            self.open.remove(&peer);
        }
        hit
    }

    /// The asks due again at `now`; asks sent [`MAX_ASKS`] times and still unanswered are
    /// dropped.
    pub fn handle_timeout(&mut self, now: Instant) -> Vec<Ask> {
        let mut again = Vec::new();
        self.open.retain(|&peer, o| {
            if now < o.due {
                return true;
            }
            if o.sent >= MAX_ASKS {
                return false;
            }
            o.sent += 1;
            o.due = now + ASK_AGAIN_AFTER * (1 << (o.sent - 1));
            again.push(Ask { peer, nonce: o.nonce });
            true
        });
        again
    }

    /// When [`handle_timeout`](Self::handle_timeout) is next needed, if ever.
    pub fn next_timeout(&self) -> Option<Instant> {
        self.open.values().map(|o| o.due).min()
    }

    /// `peer` is gone (lost, reloaded, or said GOODBYE): its ask is dropped; a PONG to it no
    /// longer confirms anything.
    pub fn forget(&mut self, peer: PeerId) {
        self.open.remove(&peer);
        self.reasked.remove(&peer);
    }

    /// Asks open now.
    pub fn open(&self) -> usize {
        self.open.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: PeerId = PeerId(3);

    #[test]
    fn only_the_open_asks_nonce_confirms_and_closes_it() {
        let t = Instant::now();
        let mut a = HelloAsks::new();
        assert_eq!(a.heard(t, P, false, || 42), Some(Ask { peer: P, nonce: 42 }));
        assert!(!a.answered(P, 41), "another nonce");
        assert!(!a.answered(PeerId(4), 42), "another peer");
        assert!(a.answered(P, 42));
        assert_eq!(a.open(), 0);
        assert!(!a.answered(P, 42), "closed: a replayed PONG confirms nothing");
    }

    #[test]
    fn a_hello_while_an_ask_is_open_sends_nothing_more() {
        let t = Instant::now();
        let mut a = HelloAsks::new();
        assert!(a.heard(t, P, false, || 1).is_some());
        for _ in 0..1000 {
            assert_eq!(a.heard(t, P, false, || unreachable!("no new nonce while open")), None);
        }
        assert_eq!(a.open(), 1);
    }

    #[test]
    fn an_unanswered_ask_is_repeated_with_its_nonce_on_a_doubling_schedule_then_dropped() {
        let t = Instant::now();
        let mut a = HelloAsks::new();
        a.heard(t, P, false, || 9).unwrap();
        let mut now = t;
        let mut repeats = Vec::new();
        while let Some(due) = a.next_timeout() {
            assert!(a.handle_timeout(due - Duration::from_nanos(1)).is_empty(), "never early");
            now = due;
            for ask in a.handle_timeout(now) {
                assert_eq!(ask, Ask { peer: P, nonce: 9 });
                repeats.push(now - t);
            }
        }
        let ms: Vec<u128> = repeats.iter().map(Duration::as_millis).collect();
        assert_eq!(ms, [100, 300, 700, 1500, 3100], "{MAX_ASKS} asks in all, the first included");
        assert_eq!(now - t, Duration::from_millis(6300), "dropped one more interval after the last");
        assert_eq!(a.open(), 0);
        assert!(!a.answered(P, 9), "dropped: a late PONG confirms nothing");
    }

    #[test]
    fn a_late_pong_of_the_first_ping_counts_after_a_repeat() {
        let t = Instant::now();
        let mut a = HelloAsks::new();
        a.heard(t, P, false, || 5).unwrap();
        assert_eq!(a.handle_timeout(t + ASK_AGAIN_AFTER).len(), 1);
        assert!(a.answered(P, 5));
    }

    #[test]
    fn a_confirmed_peers_hello_is_asked_about_again_at_most_once_a_second() {
        let t = Instant::now();
        let mut a = HelloAsks::new();
        assert_eq!(a.heard(t, P, true, || 1), Some(Ask { peer: P, nonce: 1 }), "it may have reloaded us");
        assert!(a.answered(P, 1));
        for ms in [0, 10, 999] {
            let at = t + Duration::from_millis(ms);
            assert_eq!(a.heard(at, P, true, || unreachable!("no ask within the second")), None);
        }
        assert!(a.heard(t + REASK_CONFIRMED_AFTER, P, true, || 2).is_some());
        assert!(a.heard(t, PeerId(4), true, || 3).is_some(), "per peer");
        // An unconfirmed peer's HELLO is not held back by the limit.
        a.forget(P);
        assert!(a.heard(t + REASK_CONFIRMED_AFTER, P, false, || 4).is_some());
    }

    #[test]
    fn a_forgotten_peer_has_no_ask() {
        let t = Instant::now();
        let mut a = HelloAsks::new();
        a.heard(t, P, false, || 5).unwrap();
        a.forget(P);
        assert_eq!((a.open(), a.next_timeout()), (0, None));
        assert!(!a.answered(P, 5));
        assert!(a.heard(t, P, false, || 6).is_some(), "a new HELLO opens a new ask");
    }
}
