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
//! - A HELLO carries the tag of the load of our metadata it speaks for
//!   ([`crate::forget::load_tag`]). From a peer whose HELLO is confirmed, one with the tag of
//!   the load confirmed is a repeat and asks nothing. One with another tag is a *reload*: the
//!   peer unloaded our metadata and loaded it again (same session, no restart) and its FORGET
//!   was lost. It lacks our HELLO, which the ask carries, to ask about us in turn, and only
//!   the ask's PONG brings the new load's forget secret, without which its next FORGET would
//!   be refused as forged. Anyone can put another tag in a HELLO, so a reload's ask is opened
//!   at most once per [`REASK_CONFIRMED_AFTER`]; one heard sooner is *deferred* to the end of
//!   that second, never dropped (dropped, a real reload just after a forged one, or two
//!   reloads within a second, kept the old secret and left the peer one way to us). A repeat
//!   asks nothing, so two confirmed peers never trade HELLOs and a deferral starts no
//!   exchange that does not end.
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
/// Least time between two asks opened by reload HELLOs of a peer whose HELLO is confirmed.
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
    /// When an ask was last opened for a confirmed peer's reload (see [`REASK_CONFIRMED_AFTER`]).
    reasked: BTreeMap<PeerId, Instant>,
    /// Reloads heard within [`REASK_CONFIRMED_AFTER`] of the last one's ask: asked about when
    /// that second ends.
    deferred: BTreeMap<PeerId, Instant>,
}

impl HelloAsks {
    /// No ask open.
    pub fn new() -> Self {
        Self::default()
    }

    /// An admitted HELLO from `peer`, loaded and compatible, whose HELLO is not confirmed, or
    /// (`reloaded`) is confirmed for another load than this HELLO's: the ask to send now (its
    /// nonce from `nonce`), or `None` when one is open already (its PONG will bring what this
    /// one's would), or when this is a reload heard less than [`REASK_CONFIRMED_AFTER`] after
    /// the last reload's ask: then it is asked about when that second ends
    /// ([`handle_timeout`](Self::handle_timeout)).
    pub fn heard(&mut self, now: Instant, peer: PeerId, reloaded: bool, nonce: impl FnOnce() -> u64) -> Option<Ask> {
        if self.open.contains_key(&peer) {
            return None;
        }
        if reloaded {
            if let Some(&at) = self.reasked.get(&peer).filter(|&&at| now < at + REASK_CONFIRMED_AFTER) {
                self.deferred.insert(peer, at + REASK_CONFIRMED_AFTER);
                return None;
            }
            self.reasked.insert(peer, now);
        }
        self.deferred.remove(&peer);
        Some(self.open_ask(now, peer, nonce()))
    }

    fn open_ask(&mut self, now: Instant, peer: PeerId, nonce: u64) -> Ask {
        self.open.insert(peer, Open { nonce, due: now + ASK_AGAIN_AFTER, sent: 1 });
        Ask { peer, nonce }
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

    /// The asks due at `now`: open asks due again, and deferred reloads whose second ended
    /// (each a new ask, its nonce from `nonce`, unless one is open); asks sent [`MAX_ASKS`]
    /// times and still unanswered are dropped.
    pub fn handle_timeout(&mut self, now: Instant, mut nonce: impl FnMut() -> u64) -> Vec<Ask> {
        let mut again = Vec::new();
        let due: Vec<PeerId> = self.deferred.iter().filter(|&(_, &at)| at <= now).map(|(&p, _)| p).collect();
        for peer in due {
            self.deferred.remove(&peer);
            if !self.open.contains_key(&peer) {
                self.reasked.insert(peer, now);
                again.push(self.open_ask(now, peer, nonce()));
            }
        }
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
        self.open.values().map(|o| o.due).chain(self.deferred.values().copied()).min()
    }

    /// `peer` is gone (lost, reloaded, or said GOODBYE): its ask is dropped, a deferred one
    /// too; a PONG to it no longer confirms anything.
    pub fn forget(&mut self, peer: PeerId) {
        self.open.remove(&peer);
        self.reasked.remove(&peer);
        self.deferred.remove(&peer);
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
            assert!(a.handle_timeout(due - Duration::from_nanos(1), || unreachable!()).is_empty(), "never early");
            now = due;
            for ask in a.handle_timeout(now, || unreachable!("repeats keep their nonce")) {
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
        assert_eq!(a.handle_timeout(t + ASK_AGAIN_AFTER, || unreachable!()).len(), 1);
        assert!(a.answered(P, 5));
    }

    #[test]
    fn a_reload_is_asked_about_at_once_then_at_most_once_a_second_and_never_dropped() {
        let t = Instant::now();
        let ms = |n| t + Duration::from_millis(n);
        let mut a = HelloAsks::new();
        assert_eq!(a.heard(t, P, true, || 1), Some(Ask { peer: P, nonce: 1 }), "it reloaded us");
        assert!(a.answered(P, 1));
        for n in [0, 10, 999] {
            assert_eq!(a.heard(ms(n), P, true, || unreachable!("no ask within the second")), None);
        }
        // Deferred to the end of the second: one ask for all of them.
        assert_eq!(a.next_timeout(), Some(t + REASK_CONFIRMED_AFTER));
        assert!(a.handle_timeout(ms(999), || unreachable!("not yet")).is_empty());
        assert_eq!(a.handle_timeout(t + REASK_CONFIRMED_AFTER, || 2), vec![Ask { peer: P, nonce: 2 }]);
        assert!(a.answered(P, 2));
        assert_eq!(a.next_timeout(), None);
        // That ask counts as the second's: the next reload waits for the one after.
        assert_eq!(a.heard(ms(1500), P, true, || unreachable!()), None);
        assert_eq!(a.handle_timeout(ms(2000), || 3), vec![Ask { peer: P, nonce: 3 }]);
        assert!(a.heard(t, PeerId(4), true, || 4).is_some(), "per peer");
        assert!(a.answered(PeerId(4), 4));
        // An unconfirmed peer's HELLO is not held back by the limit, and takes a deferred
        // reload's place.
        assert!(a.answered(P, 3));
        assert_eq!(a.heard(ms(2100), P, true, || unreachable!()), None);
        assert!(a.heard(ms(2100), P, false, || 5).is_some());
        assert!(a.answered(P, 5));
        assert!(a.handle_timeout(ms(5000), || unreachable!("the deferred reload went with it")).is_empty());
    }

    #[test]
    fn a_deferred_reload_waits_while_an_ask_is_open_and_goes_with_a_forgotten_peer() {
        let t = Instant::now();
        let mut a = HelloAsks::new();
        a.heard(t, P, true, || 1).unwrap();
        assert!(a.answered(P, 1));
        assert_eq!(a.heard(t, P, true, || unreachable!()), None);
        a.forget(P);
        assert_eq!(a.next_timeout(), None, "nothing deferred for a forgotten peer");
        // Deferred while an ask is open: the open ask's PONG brings what it would have.
        a.heard(t, P, true, || 2).unwrap();
        assert!(a.answered(P, 2));
        assert_eq!(a.heard(t, P, true, || unreachable!()), None);
        a.heard(t, P, false, || 3).unwrap();
        assert_eq!(a.next_timeout(), Some(t + ASK_AGAIN_AFTER), "only the open ask's repeat");
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

    #[derive(Debug, Clone)]
    enum Op {
        /// Time passes (ms), then `handle_timeout`.
        Wait(u64),
        /// A HELLO of peer 0 or 1, a reload or not.
        Heard(usize, bool),
        /// The peer answers its open ask, if any.
        Answer(usize),
        Forget(usize),
    }

    fn op() -> impl proptest::strategy::Strategy<Value = Op> {
        use proptest::prelude::*;
        prop_oneof![
            (0..1500u64).prop_map(Op::Wait),
            (0..2usize, any::<bool>()).prop_map(|(p, r)| Op::Heard(p, r)),
            (0..2usize).prop_map(Op::Answer),
            (0..2usize).prop_map(Op::Forget),
        ]
    }

    proptest::proptest! {
        /// Whatever HELLOs come (forged reloads included) and whatever is answered: asks opened
        /// for reloads of one peer are at least a second apart, and a reload heard is asked
        /// about (or an ask is open that will bring what its ask would) within a second,
        /// unless the peer is forgotten first.
        #[test]
        fn reload_asks_are_a_second_apart_and_no_reload_goes_unasked(ops in proptest::collection::vec(op(), 0..80)) {
            let t0 = Instant::now();
            let mut now = t0;
            let mut a = HelloAsks::new();
            let mut counter = 0u64;
            let mut open: [Option<u64>; 2] = [None, None];
            let mut last_reload_ask: [Option<Instant>; 2] = [None, None];
            // A reload heard and not yet covered by an ask: when it was heard.
            let mut waiting: [Option<Instant>; 2] = [None, None];
            let opened = |p: usize, ask: Ask, reload: bool, now: Instant,
                              open: &mut [Option<u64>; 2], last: &mut [Option<Instant>; 2]| {
                proptest::prop_assert_eq!(ask.peer, PeerId(p as u64));
                if open[p].is_none() || open[p] != Some(ask.nonce) {
                    // A new ask (not a repeat of the open one's nonce).
                    if reload {
                        if let Some(at) = last[p] {
                            proptest::prop_assert!(now >= at + REASK_CONFIRMED_AFTER, "reload asks {:?} apart", now - at);
                        }
                        last[p] = Some(now);
                    }
                    open[p] = Some(ask.nonce);
                }
                Ok(())
            };
            for op in ops {
                match op {
                    Op::Wait(ms) => {
                        now += Duration::from_millis(ms);
                        let before = open;
                        let mut n = || { counter += 1; counter };
                        for ask in a.handle_timeout(now, &mut n) {
                            let p = ask.peer.0 as usize;
                            let deferred = before[p].is_none_or(|nonce| nonce != ask.nonce);
                            opened(p, ask, deferred, now, &mut open, &mut last_reload_ask)?;
                            if deferred {
                                waiting[p] = None;
                            }
                        }
                        // Dropped asks (unanswered after their last repeat) leave nothing open.
                        for (p, o) in open.iter_mut().enumerate() {
                            if o.is_some() && !a.open.contains_key(&PeerId(p as u64)) {
                                *o = None;
                            }
                        }
                    }
                    Op::Heard(p, reload) => {
                        let mut n = || { counter += 1; counter };
                        match a.heard(now, PeerId(p as u64), reload, &mut n) {
                            Some(ask) => {
                                proptest::prop_assert!(open[p].is_none(), "one ask open at a time");
                                opened(p, ask, reload, now, &mut open, &mut last_reload_ask)?;
                                waiting[p] = None;
                            }
                            None if open[p].is_some() => waiting[p] = None,
                            None => {
                                proptest::prop_assert!(reload, "only a reload waits");
                                waiting[p].get_or_insert(now);
                            }
                        }
                    }
                    Op::Answer(p) => {
                        if let Some(nonce) = open[p].take() {
                            proptest::prop_assert!(a.answered(PeerId(p as u64), nonce));
                        }
                    }
                    Op::Forget(p) => {
                        a.forget(PeerId(p as u64));
                        (open[p], waiting[p], last_reload_ask[p]) = (None, None, None);
                    }
                }
                for &at in waiting.iter().flatten() {
                    proptest::prop_assert!(now < at + REASK_CONFIRMED_AFTER, "a reload heard {:?} ago still unasked", now - at);
                    proptest::prop_assert!(a.next_timeout().is_some_and(|due| due <= at + REASK_CONFIRMED_AFTER));
                }
            }
        }
    }
}
