//! The liveness probe: notices within a bounded time that a peer we wait on has died, so its
//! transfers fail in seconds instead of after the no-progress timeout.
//!
//! Rules, per peer the endpoint *waits on* (a transfer of ours goes to it, or a flow of its
//! writes into us):
//! - Quiet time is measured from the later of its last sign of life and the moment we began
//!   waiting on it (a peer idle for an hour before a new transfer is not suspect at once).
//! - Any admitted frame from it is a sign of life; so is a PONG echoing the nonce of one of our
//!   last PINGs to it (a PONG with another nonce is ignored: it cannot have been made without
//!   seeing our PING). A PONG that arrives after another frame already proved the peer alive
//!   (two peers probing each other cross their PINGs) still counts as answered.
//! - Quiet for [`LivenessConfig::probe_after`]: it gets a PING, and another after each further
//!   `probe_after` of quiet (a modest rate: four a second at the default).
//! - No sign of life for [`LivenessConfig::dead_after`] after the first unanswered PING: the
//!   peer is declared dead (the endpoint fails its transfers as lost and reclaims its flows).
//!
//! So a dead peer is found at most `probe_after + dead_after` after its last frame (1.75 s
//! at the defaults). A slow but live peer is never declared dead: its reactor answers PINGs
//! whatever its copies are doing, and several PINGs go out within `dead_after`, so one lost or
//! late PONG does not kill it.
//!
//! Pure bookkeeping, time passed in: [`crate::endpoint::Endpoint`] tells it who it waits on and
//! what was heard, asks it at each timeout which PINGs to send and who is dead, and performs
//! both. Nonces come from a secret key the shell sets (no randomness here).

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use crate::types::PeerId;

/// PING nonces remembered per peer; older ones are forgotten (their PONGs no longer count, but
/// the later PINGs' do).
const MAX_OUTSTANDING: usize = 16;

/// The probe's timings (`bounce_probe_after_ms`, `bounce_peer_dead_after_ms`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LivenessConfig {
    /// Quiet time of a waited-on peer before the first PING, and between PINGs.
    pub probe_after: Duration,
    /// Time without a sign of life after the first unanswered PING before the peer is declared
    /// dead. Zero turns probing off (only the no-progress timeout then ends a stall).
    pub dead_after: Duration,
}

impl LivenessConfig {
    /// True when peers are probed at all.
    pub fn enabled(&self) -> bool {
        !self.dead_after.is_zero() && !self.probe_after.is_zero()
    }
}

/// What [`Liveness::handle_timeout`] decided.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Verdicts {
    /// Send a PING with this nonce to this peer.
    pub pings: Vec<(PeerId, u64)>,
    /// Peers declared dead; they are no longer watched.
    pub dead: Vec<PeerId>,
}

/// What is known about one watched peer since its quiet time began (its last sign of life, or
/// when we began waiting on it, whichever is later).
#[derive(Debug, Clone)]
struct Watch {
    /// When the first PING of this quiet time went out.
    first_ping: Option<Instant>,
    /// When the next PING is due.
    next_ping: Instant,
    /// Nonces of our last PINGs (newest last, at most [`MAX_OUTSTANDING`]).
    outstanding: Vec<u64>,
}

impl Watch {
    fn new(now: Instant, probe_after: Duration) -> Self {
        Self { first_ping: None, next_ping: now + probe_after, outstanding: Vec::new() }
    }

    /// When this watch next needs attention: its next PING, or the verdict on its first one.
    fn deadline(&self, dead_after: Duration) -> Instant {
        match self.first_ping {
            Some(first) => self.next_ping.min(first + dead_after),
            None => self.next_ping,
        }
    }
}

/// The liveness state of every peer the endpoint waits on (see the module docs for the rules).
///
/// # Driving it
/// After any change of who is waited on, [`watch`](Self::watch); on every admitted frame,
/// [`heard`](Self::heard); on a PONG, [`handle_pong`](Self::handle_pong); once
/// [`next_timeout`](Self::next_timeout) has passed, [`handle_timeout`](Self::handle_timeout),
/// then send its PINGs and fail its dead peers.
#[derive(Debug, Clone)]
pub struct Liveness {
    cfg: LivenessConfig,
    watched: BTreeMap<PeerId, Watch>,
    /// The PRF key the PING nonces derive from.
    key: [u8; 32],
    pings: u64,
}

impl Liveness {
    /// Nobody watched yet.
    /// A prober whose PING nonces derive from the secret `key` (the shell draws it at random:
    /// a nonce others could predict would let them forge the PONG that answers it).
    pub fn new(cfg: LivenessConfig, key: [u8; 32]) -> Self {
        Self { cfg, watched: BTreeMap::new(), key, pings: 0 }
    }

    /// The peers waited on now are `waited`: new ones start their quiet time at `now`, the
    /// others keep theirs, peers no longer waited on are forgotten.
    pub fn watch(&mut self, now: Instant, waited: &BTreeSet<PeerId>) {
        if !self.cfg.enabled() {
            return;
        }
        self.watched.retain(|p, _| waited.contains(p));
        for &p in waited {
            self.watched.entry(p).or_insert_with(|| Watch::new(now, self.cfg.probe_after));
        }
    }

    /// A frame from `peer` was admitted: it is alive. Its quiet time starts again; the nonces
    /// of our last PINGs stay valid for their PONGs.
    pub fn heard(&mut self, now: Instant, peer: PeerId) {
        if let Some(w) = self.watched.get_mut(&peer) {
            w.first_ping = None;
            w.next_ping = now + self.cfg.probe_after;
        }
    }

    /// A fresh nonce from the PINGs' sequence, for a PING that is not a probe (a GOODBYE's
    /// challenge, `Endpoint::handle_goodbye_said`; a HELLO's ask, `crate::hello`).
    pub fn next_nonce(&mut self) -> u64 {
        self.pings += 1;
        nonce(&self.key, self.pings)
    }

    /// A PONG from `peer`: a sign of life when it echoes one of our PINGs since its last one.
    /// Returns whether it did.
    pub fn handle_pong(&mut self, now: Instant, peer: PeerId, nonce: u64) -> bool {
        let answers = self.watched.get(&peer).is_some_and(|w| w.outstanding.contains(&nonce));
        if answers {
            self.heard(now, peer);
        }
        answers
    }

    /// The PINGs due at `now` and the peers found dead (no longer watched).
    pub fn handle_timeout(&mut self, now: Instant) -> Verdicts {
        let mut v = Verdicts::default();
        let (probe_after, dead_after) = (self.cfg.probe_after, self.cfg.dead_after);
        for (&peer, w) in &mut self.watched {
            if w.first_ping.is_some_and(|first| now >= first + dead_after) {
                v.dead.push(peer);
            } else if now >= w.next_ping {
                self.pings += 1;
                let nonce = nonce(&self.key, self.pings);
                if w.outstanding.len() == MAX_OUTSTANDING {
                    w.outstanding.remove(0);
                }
                w.outstanding.push(nonce);
                w.first_ping.get_or_insert(now);
                w.next_ping = now + probe_after;
                v.pings.push((peer, nonce));
            }
        }
        for p in &v.dead {
            self.watched.remove(p);
        }
        v
    }

    /// When [`handle_timeout`](Self::handle_timeout) is next needed, if ever.
    pub fn next_timeout(&self) -> Option<Instant> {
        self.watched.values().map(|w| w.deadline(self.cfg.dead_after)).min()
    }

    /// Peers watched now.
    pub fn watched(&self) -> usize {
        self.watched.len()
    }
}

/// The `n`-th PING nonce under `key`: keyed BLAKE3 of the counter, a PRF, so the nonces a peer
/// sees (every PING it is sent, asked for by a GOODBYE or a HELLO as often as it likes) tell it
/// nothing about the next one or about the key. (An invertible mix of a 64-bit seed, as before,
/// gave the seed away from two consecutive nonces, and with it every PONG a third party would
/// need to forge a peer's farewell or HELLO.)
fn nonce(key: &[u8; 32], n: u64) -> u64 {
    let mut first = [0; 8];
    first.copy_from_slice(&blake3::keyed_hash(key, &n.to_le_bytes()).as_bytes()[..8]);
    u64::from_le_bytes(first)
}

#[cfg(test)]
mod tests {
    use super::*;

    const PROBE: Duration = Duration::from_millis(250);
    const DEAD: Duration = Duration::from_millis(1500);

    fn live() -> Liveness {
        Liveness::new(LivenessConfig { probe_after: PROBE, dead_after: DEAD }, [0x5e; 32])
    }

    fn peers(ids: &[u32]) -> BTreeSet<PeerId> {
        ids.iter().map(|&i| PeerId(u64::from(i))).collect()
    }

    /// Steps time in `step`s from `from` to `to`, firing every due timeout as a shell would
    /// (at the first step at or after `next_timeout`); returns every verdict with its time.
    fn run(l: &mut Liveness, from: Instant, to: Instant, step: Duration) -> Vec<(Instant, Verdicts)> {
        let mut out = Vec::new();
        let mut now = from;
        while now <= to {
            if l.next_timeout().is_some_and(|t| t <= now) {
                let v = l.handle_timeout(now);
                if v != Verdicts::default() {
                    out.push((now, v));
                }
            }
            now += step;
        }
        out
    }

    #[test]
    fn a_silent_peer_is_pinged_then_declared_dead_within_the_bound() {
        let mut l = live();
        let t = Instant::now();
        l.watch(t, &peers(&[1]));
        assert_eq!(l.next_timeout(), Some(t + PROBE));
        let got = run(&mut l, t, t + Duration::from_secs(5), Duration::from_millis(1));
        let dead_at: Vec<Instant> = got.iter().filter(|(_, v)| !v.dead.is_empty()).map(|(at, _)| *at).collect();
        assert_eq!(dead_at, vec![t + PROBE + DEAD], "dead exactly probe_after + dead_after after the last sign");
        let pings: Vec<Instant> = got.iter().filter(|(_, v)| !v.pings.is_empty()).map(|(at, _)| *at).collect();
        // One PING every probe_after until the verdict: a modest, bounded rate.
        let want: Vec<Instant> = (1..=6).map(|k| t + PROBE * k).collect();
        assert_eq!(pings, want);
        assert_eq!((l.watched(), l.next_timeout()), (0, None), "a dead peer is no longer watched");
        let nonces: BTreeSet<u64> = got.iter().flat_map(|(_, v)| v.pings.iter().map(|p| p.1)).collect();
        assert_eq!(nonces.len(), 6, "every PING has its own nonce");
    }

    #[test]
    fn a_peer_that_answers_every_ping_is_never_declared_dead() {
        let mut l = live();
        let t = Instant::now();
        l.watch(t, &peers(&[1]));
        let mut now = t;
        let end = t + Duration::from_secs(60);
        let mut answered = 0;
        while now < end {
            if l.next_timeout().is_some_and(|at| at <= now) {
                let v = l.handle_timeout(now);
                assert!(v.dead.is_empty(), "declared dead at {:?}", now - t);
                for (p, nonce) in v.pings {
                    // The PONG comes back 400 ms later (a slow link, a busy peer), after the
                    // next PING went out: the older nonce still counts.
                    let late = now + Duration::from_millis(400);
                    while now < late {
                        now += Duration::from_millis(10);
                        assert!(l.handle_timeout(now).dead.is_empty());
                    }
                    assert!(l.handle_pong(now, p, nonce));
                    answered += 1;
                }
            }
            now += Duration::from_millis(10);
        }
        assert!(answered > 50, "{answered}");
        assert_eq!(l.watched(), 1);
    }

    #[test]
    fn any_frame_resets_the_quiet_time_and_a_forged_pong_does_not() {
        let mut l = live();
        let t = Instant::now();
        l.watch(t, &peers(&[1, 2]));
        let v = l.handle_timeout(t + PROBE);
        assert_eq!(v.pings.len(), 2);
        // Peer 1 sends a frame; peer 2 only a PONG with a nonce we never sent.
        l.heard(t + PROBE, PeerId(1));
        assert!(!l.handle_pong(t + PROBE, PeerId(2), v.pings[1].1 ^ 1));
        assert!(!l.handle_pong(t + PROBE, PeerId(2), v.pings[0].1), "peer 1's nonce is not peer 2's");
        let later = t + PROBE + DEAD;
        let v = l.handle_timeout(later);
        assert_eq!(v.dead, vec![PeerId(2)]);
        assert_eq!(l.watched(), 1);
    }

    #[test]
    fn crossed_pings_still_count_the_pong_as_answered() {
        let mut l = live();
        let t = Instant::now();
        l.watch(t, &peers(&[1]));
        let v = l.handle_timeout(t + PROBE);
        let nonce = v.pings[0].1;
        // The peer's own PING arrives first (a sign of life), then its PONG to ours.
        l.heard(t + PROBE, PeerId(1));
        assert!(l.handle_pong(t + PROBE, PeerId(1), nonce));
        assert_eq!(l.next_timeout(), Some(t + PROBE * 2));
    }

    #[test]
    fn quiet_time_starts_when_we_begin_waiting_and_unwaited_peers_are_forgotten() {
        let mut l = live();
        let t = Instant::now();
        // Heard long ago, but not waited on: nothing is tracked.
        l.heard(t, PeerId(1));
        assert_eq!(l.next_timeout(), None);
        let later = t + Duration::from_secs(3600);
        l.watch(later, &peers(&[1]));
        assert_eq!(l.next_timeout(), Some(later + PROBE));
        assert!(l.handle_timeout(later + PROBE).dead.is_empty());
        // The transfer ends: the peer is no longer waited on, whatever its PINGs.
        l.watch(later + PROBE, &peers(&[]));
        assert_eq!((l.watched(), l.next_timeout()), (0, None));
        // Waited on again: a fresh start, not the old PING's deadline.
        let again = later + DEAD * 10;
        l.watch(again, &peers(&[1]));
        assert_eq!(l.next_timeout(), Some(again + PROBE));
    }

    #[test]
    fn zero_turns_probing_off() {
        let mut l = Liveness::new(LivenessConfig { probe_after: PROBE, dead_after: Duration::ZERO }, [0x5e; 32]);
        let t = Instant::now();
        l.watch(t, &peers(&[1]));
        assert_eq!((l.watched(), l.next_timeout()), (0, None));
        assert_eq!(l.handle_timeout(t + Duration::from_secs(100)), Verdicts::default());
    }

    #[test]
    fn ping_and_pong_round_trip_through_the_frame_codec() {
        use crate::wire::{Body, ControlFrame, Frame, WireError};
        for body in
            [Body::Ping { nonce: 0x0102_0304_0506_0708 }, Body::Pong { nonce: u64::MAX, forget: crate::Token(0) }]
        {
            let f = ControlFrame { session: 9, body };
            let bytes = f.to_vec();
            let forget = if matches!(f.body, Body::Pong { .. }) { 16 } else { 0 };
            assert_eq!(bytes.len(), crate::wire::HEADER_LEN + 8 + forget);
            assert_eq!(ControlFrame::decode(&bytes), Ok(f.clone()));
            assert!(matches!(Frame::decode(&bytes), Err(WireError::UnknownKind { .. })), "no message");
            assert!(ControlFrame::decode(&bytes[..bytes.len() - 1]).is_err(), "truncated");
            let mut longer = bytes.clone();
            longer.push(0);
            assert_eq!(ControlFrame::decode(&longer), Err(WireError::TrailingBytes { n: 1 }));
        }
        let ping = ControlFrame { session: 1, body: Body::Ping { nonce: 5 } }.to_vec();
        assert_eq!(
            (ping[7], ControlFrame { session: 1, body: Body::Pong { nonce: 5, forget: crate::Token(0) } }.to_vec()[7]),
            (7, 8)
        );
    }

    /// The attack a mixing function without a key allows: a peer asks for PINGs (a GOODBYE
    /// under its own session gets one each), inverts the mix of two consecutive nonces to the
    /// seed and the counter, and predicts the next nonce, the one a PING to ANOTHER peer will
    /// carry: a forged PONG under that peer's name then confirms a forged HELLO or farewell.
    #[test]
    fn the_nonces_a_peer_sees_do_not_predict_the_next() {
        const PHI: u64 = 0x9E37_79B9_7F4A_7C15;
        const M1: u64 = 0xBF58_476D_1CE4_E5B9;
        const M2: u64 = 0x94D0_49BB_1331_11EB;
        fn mix(seed: u64, n: u64) -> u64 {
            let mut z = seed ^ n.wrapping_mul(PHI);
            z = (z ^ (z >> 30)).wrapping_mul(M1);
            z = (z ^ (z >> 27)).wrapping_mul(M2);
            z ^ (z >> 31)
        }
        fn unshift(mut x: u64, k: u32) -> u64 {
            let y = x;
            for _ in 0..64 / k {
                x = y ^ (x >> k);
            }
            x
        }
        fn inverse(m: u64) -> u64 {
            (0..6).fold(m, |x, _| x.wrapping_mul(2u64.wrapping_sub(m.wrapping_mul(x))))
        }
        // The attacker's model: the next nonce after (a, b), if a counter n gives both.
        let predict = |a: u64, b: u64| {
            let z1 = unshift(unshift(unshift(a, 31).wrapping_mul(inverse(M2)), 27).wrapping_mul(inverse(M1)), 30);
            (1..=1000u64)
                .map(|n| (n, z1 ^ n.wrapping_mul(PHI)))
                .find(|&(n, seed)| mix(seed, n + 1) == b)
                .map(|(n, seed)| mix(seed, n + 2))
        };
        // The attack is sound: against the unkeyed mix it predicts exactly.
        assert_eq!(predict(mix(0xfeed_f00d, 41), mix(0xfeed_f00d, 42)), Some(mix(0xfeed_f00d, 43)));
        // Against ours it finds no seed at all.
        let mut l = live();
        for _ in 0..40 {
            l.next_nonce();
        }
        let (a, b) = (l.next_nonce(), l.next_nonce());
        let next = l.next_nonce();
        assert_eq!(predict(a, b), None);
        assert_ne!(predict(a, b), Some(next));
        // And another key gives other nonces from the same counter.
        let mut other = Liveness::new(LivenessConfig { probe_after: PROBE, dead_after: DEAD }, [0x5f; 32]);
        assert_ne!(other.next_nonce(), live().next_nonce());
    }
}
