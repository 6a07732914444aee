//! Control frames over a byte stream (the shell's ZMQ channel: a `ZMQ_STREAM` socket hands it
//! each TCP connection's bytes as they come): every message is a 6-byte header, the sender's
//! name length (u16 LE) and the frame's length (u32 LE), then the name and the frame. Sans-IO:
//! the shell feeds bytes per connection, with the time, and acts on the verdicts.
//!
//! Why not ZMQ's own messages: ZMQ refuses a message *part* over `ZMQ_MAXMSGSIZE`, but holds
//! the parts of an unfinished multipart message without limit and without telling the reader,
//! so anyone who could reach the socket could grow our memory until the process was killed
//! (2.4 GiB for 300 parts of 8 MiB, none delivered). Here every byte held is ours to count:
//! a connection's partial message is bounded by the longest legal name and frame, all
//! connections' together by a budget, and connections by a cap; whoever breaks a bound is cut
//! off, and the frame is dropped (the transfer it belonged to times out).
//!
//! The cap and the budget must not be a way to lock peers out either: connections that sent
//! nothing whole under a peer's name for [`IDLE_EVICT`] (1024 opened and left silent, or two that stall halfway
//! through the longest message) make room when a new connection or an honest message needs
//! it, the one idle longest first. A peer of ours whose connection went finds it gone at its
//! next send and connects again, so what eviction costs an honest peer idle that long, under
//! such a flood only, is that one frame.
//!
//! Names are public, so a third party can speak a quiet peer's name; what it cannot do is
//! send a frame the core accepts as authentic (a transfer's token, valid proofs, a PONG of a
//! nonce only the peer saw). The shell marks the connections that carried one
//! ([`Streams::authentic`]), and they are closed to make room only when no connection that
//! never carried one is idle enough to go (review 61, control M1: a stranger speaking a quiet
//! peer's name had that peer's connection evicted under a flood, and one-way initiators,
//! whose names are not loaded here, were evicted by plain connection churn).

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

/// Bytes before a message's name and frame.
pub const HEADER: usize = 6;

/// How long a connection must have gone without a whole message before it may be closed to
/// make room for another (see the module docs).
pub const IDLE_EVICT: Duration = Duration::from_secs(1);

/// The bounds the receiver holds senders to.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Longest sender name.
    pub name: usize,
    /// Longest frame.
    pub frame: usize,
    /// Most bytes of unfinished messages held over all connections.
    pub buffered: usize,
    /// Most connections at once.
    pub conns: usize,
}

/// `name` and `frame` as one message; `None` when either is longer than the header can say
/// (the receiver would refuse it anyway).
pub fn encode(name: &str, frame: &[u8]) -> Option<Vec<u8>> {
    let n = u16::try_from(name.len()).ok()?;
    let f = u32::try_from(frame.len()).ok()?;
    let mut m = Vec::with_capacity(HEADER + name.len() + frame.len());
    m.extend_from_slice(&n.to_le_bytes());
    m.extend_from_slice(&f.to_le_bytes());
    m.extend_from_slice(name.as_bytes());
    m.extend_from_slice(frame);
    Some(m)
}

/// What the socket should do after [`Streams::feed`] or [`Streams::notice`] (and, for the
/// connections [`Streams::take_evicted`] gives, close them too).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Go on reading the connection.
    Keep,
    /// Close the connection: it broke a bound (its partial message is dropped).
    Close,
}

/// Connections closed by us, remembered so that the socket's notice of their end is not taken
/// for a new connection.
const CLOSED_KEPT: usize = 1024;

/// One open connection: its unfinished message, when it last sent a whole one (or opened),
/// and whether it ever carried a frame the core found authentic.
#[derive(Debug)]
struct Conn {
    partial: Vec<u8>,
    active: Instant,
    authentic: bool,
}

/// Every connection's unfinished message.
#[derive(Debug)]
pub struct Streams {
    limits: Limits,
    conns: HashMap<Vec<u8>, Conn>,
    buffered: usize,
    closed: VecDeque<Vec<u8>>,
    /// Connections closed to make room, for the shell to close on the socket.
    evicted: Vec<Vec<u8>>,
    /// Per name `vouch` knows, the one connection whose messages under it keep it active (see
    /// [`feed`](Self::feed)). At most one entry per such name.
    vouched: HashMap<String, Vec<u8>>,
}

impl Streams {
    /// No connection yet, under `limits`.
    pub fn new(limits: Limits) -> Self {
        Self {
            limits,
            conns: HashMap::new(),
            buffered: 0,
            closed: VecDeque::new(),
            evicted: Vec::new(),
            vouched: HashMap::new(),
        }
    }

    /// Bytes of unfinished messages held now.
    pub fn buffered(&self) -> usize {
        self.buffered
    }

    /// Connections open now.
    pub fn conns(&self) -> usize {
        self.conns.len()
    }

    /// Connections closed since the last call to make room for others: close them on the
    /// socket too.
    pub fn take_evicted(&mut self) -> Vec<Vec<u8>> {
        std::mem::take(&mut self.evicted)
    }

    /// The socket's notice (an empty message) for connection `id` at `now`: a new connection,
    /// or the end of one we know. `Close` for a new one over the cap when no connection has
    /// been idle long enough to make room.
    pub fn notice(&mut self, now: Instant, id: &[u8]) -> Verdict {
        if let Some(c) = self.conns.remove(id) {
            self.buffered -= c.partial.len();
            return Verdict::Keep;
        }
        if let Some(i) = self.closed.iter().position(|c| c == id) {
            self.closed.remove(i);
            return Verdict::Keep;
        }
        self.opened(now, id)
    }

    fn opened(&mut self, now: Instant, id: &[u8]) -> Verdict {
        if self.conns.len() >= self.limits.conns && !self.evict_idle(now, id, false) {
            return self.close(id);
        }
        self.conns.insert(id.to_vec(), Conn { partial: Vec::new(), active: now, authentic: false });
        Verdict::Keep
    }

    /// Connection `id` carried a frame the core accepted as authentic at `now`: it is a peer's,
    /// active now, and closed to make room only after every idle one that never carried such
    /// a frame. An id no longer open is ignored.
    pub fn authentic(&mut self, now: Instant, id: &[u8]) {
        if let Some(c) = self.conns.get_mut(id) {
            c.authentic = true;
            c.active = now;
        }
    }

    /// Closes the connection other than `except` that has gone longest without a whole
    /// message, if that is at least [`IDLE_EVICT`] (with `holding`, only one holding an
    /// unfinished message), one that never carried an authentic frame before any that did;
    /// true when one went.
    fn evict_idle(&mut self, now: Instant, except: &[u8], holding: bool) -> bool {
        let victim = self
            .conns
            .iter()
            .filter(|(k, c)| k.as_slice() != except && (!holding || !c.partial.is_empty()))
            .filter(|(_, c)| now.saturating_duration_since(c.active) >= IDLE_EVICT)
            .min_by_key(|(_, c)| (c.authentic, c.active))
            .map(|(k, _)| k.clone());
        let Some(v) = victim else { return false };
        self.close(&v);
        self.evicted.push(v);
        true
    }

    /// Whether `name` keeps connection `id` active: it holds the name's vouch, or takes it from
    /// a holder closed or idle for [`IDLE_EVICT`].
    fn vouch_for(&mut self, now: Instant, id: &[u8], name: String) -> bool {
        let free = match self.vouched.get(&name) {
            None => true,
            Some(holder) if holder.as_slice() == id => true,
            Some(holder) => {
                self.conns.get(holder).is_none_or(|c| now.saturating_duration_since(c.active) >= IDLE_EVICT)
            }
        };
        if free {
            self.vouched.insert(name, id.to_vec());
        }
        free
    }

    fn close(&mut self, id: &[u8]) -> Verdict {
        if let Some(c) = self.conns.remove(id) {
            self.buffered -= c.partial.len();
        }
        if self.closed.len() == CLOSED_KEPT {
            self.closed.pop_front();
        }
        self.closed.push_back(id.to_vec());
        Verdict::Close
    }

    /// Bytes `data` arrived on connection `id` at `now`: every message they complete goes to
    /// `out` as (name, frame); `dropped` counts messages refused (a name that is not UTF-8).
    /// `Close`: the connection broke a bound; what it sent unfinished is dropped. The
    /// connection counts as active only when a message completed under a name `vouch` knows
    /// (a peer we loaded): junk messages under any other name, however frequent, would
    /// otherwise keep junk connections from ever going idle, and 1024 of them would lock every
    /// new connection out. Names are not secret, so a name keeps one connection active at a
    /// time: the first to speak under it, until it has gone [`IDLE_EVICT`] without doing so (or
    /// closed); junk under a loaded name then keeps one connection per loaded name at most
    /// (review 54, control M1).
    pub fn feed(
        &mut self,
        now: Instant,
        id: &[u8],
        data: &[u8],
        out: &mut Vec<(String, Vec<u8>)>,
        dropped: &mut u64,
        vouch: impl Fn(&str) -> bool,
    ) -> Verdict {
        if !self.conns.contains_key(id) && self.opened(now, id) == Verdict::Close {
            *dropped += 1;
            return Verdict::Close;
        }
        let limits = self.limits;
        let Some(conn) = self.conns.get_mut(id) else { return Verdict::Close };
        let buf = &mut conn.partial;
        let held = buf.len();
        buf.extend_from_slice(data);
        let mut at = 0;
        let mut names: Vec<&str> = Vec::new();
        let broke = loop {
            let rest = &buf[at..];
            if rest.len() < HEADER {
                break false;
            }
            let name_len = usize::from(u16::from_le_bytes([rest[0], rest[1]]));
            let frame_len = u32::from_le_bytes([rest[2], rest[3], rest[4], rest[5]]) as usize;
            if name_len > limits.name || frame_len > limits.frame {
                break true;
            }
            let end = HEADER + name_len + frame_len;
            if rest.len() < end {
                break false;
            }
            match std::str::from_utf8(&rest[HEADER..HEADER + name_len]) {
                Ok(name) => {
                    if names.len() < 4 && !names.contains(&name) && vouch(name) {
                        names.push(name);
                    }
                    out.push((name.to_owned(), rest[HEADER + name_len..end].to_vec()));
                }
                Err(_) => *dropped += 1,
            }
            at += end;
        };
        let names: Vec<String> = names.into_iter().map(str::to_owned).collect();
        buf.drain(..at);
        let left = buf.len();
        if buf.capacity() > 4 * left.max(64 << 10) {
            buf.shrink_to(left);
        }
        self.buffered = self.buffered - held + left;
        // Every name takes its vouch, not only the first (no short cut).
        let mut kept = false;
        for name in names {
            kept |= self.vouch_for(now, id, name);
        }
        if kept {
            if let Some(conn) = self.conns.get_mut(id) {
                conn.active = now;
            }
        }
        if broke {
            *dropped += 1;
            return self.close(id);
        }
        // Over the budget: connections stalled mid-message longest make room first.
        while self.buffered > limits.buffered && self.evict_idle(now, id, true) {}
        if self.buffered > limits.buffered {
            *dropped += 1;
            return self.close(id);
        }
        Verdict::Keep
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    const LIMITS: Limits = Limits { name: 64, frame: 4096, buffered: 16 << 10, conns: 4 };

    /// What feeding chunks gave: the messages, the count dropped, each feed's verdict.
    type Fed = (Vec<(String, Vec<u8>)>, u64, Vec<Verdict>);

    fn feed_all(s: &mut Streams, id: &[u8], chunks: &[&[u8]]) -> Fed {
        let (mut out, mut dropped, mut v) = (Vec::new(), 0, Vec::new());
        for c in chunks {
            v.push(s.feed(t0(), id, c, &mut out, &mut dropped, |_| true));
        }
        (out, dropped, v)
    }

    /// One instant for tests where no connection is ever idle long enough to be evicted.
    fn t0() -> Instant {
        use std::sync::OnceLock;
        static T: OnceLock<Instant> = OnceLock::new();
        *T.get_or_init(Instant::now)
    }

    proptest! {
        /// Messages cut at any points arrive whole, in order, and nothing stays held.
        #[test]
        fn messages_cut_anywhere_arrive_whole_and_in_order(
            msgs in prop::collection::vec(("[a-z]{0,16}", prop::collection::vec(any::<u8>(), 0..600)), 1..20),
            cuts in prop::collection::vec(1usize..700, 1..40),
        ) {
            let stream: Vec<u8> = msgs.iter().flat_map(|(n, f)| encode(n, f).unwrap()).collect();
            let mut chunks = Vec::new();
            let mut at = 0;
            for c in cuts.iter().cycle() {
                if at >= stream.len() {
                    break;
                }
                let end = (at + c).min(stream.len());
                chunks.push(&stream[at..end]);
                at = end;
            }
            let mut s = Streams::new(LIMITS);
            prop_assert_eq!(s.notice(t0(), b"c1"), Verdict::Keep);
            let (out, dropped, v) = feed_all(&mut s, b"c1", &chunks);
            prop_assert!(v.iter().all(|v| *v == Verdict::Keep));
            prop_assert_eq!(dropped, 0);
            prop_assert_eq!(out, msgs);
            prop_assert_eq!(s.buffered(), 0);
        }

        /// Whatever bytes come, nothing panics and what is held stays within the budget.
        #[test]
        fn any_bytes_keep_what_is_held_within_the_budget(
            chunks in prop::collection::vec((0u8..6, prop::collection::vec(any::<u8>(), 0..3000)), 0..60),
        ) {
            let mut s = Streams::new(LIMITS);
            let (mut out, mut dropped) = (Vec::new(), 0);
            for (conn, data) in &chunks {
                let id = [*conn];
                if data.is_empty() {
                    let _ = s.notice(t0(), &id);
                } else {
                    let _ = s.feed(t0(), &id, data, &mut out, &mut dropped, |_| true);
                }
                prop_assert!(s.buffered() <= LIMITS.buffered);
                prop_assert!(s.conns() <= LIMITS.conns);
            }
        }
    }

    /// A header promising more than the bounds is cut off at once, before any body comes.
    #[test]
    fn a_header_over_the_bounds_closes_the_connection_at_once() {
        let mut s = Streams::new(LIMITS);
        s.notice(t0(), b"x");
        let mut h = vec![0u8; HEADER];
        h[2..6].copy_from_slice(&(LIMITS.frame as u32 + 1).to_le_bytes());
        let (out, dropped, v) = feed_all(&mut s, b"x", &[&h]);
        assert_eq!((out.len(), dropped, v), (0, 1, vec![Verdict::Close]));
        assert_eq!((s.buffered(), s.conns()), (0, 0));
        // The socket's notice of its end is not a new connection.
        assert_eq!(s.notice(t0(), b"x"), Verdict::Keep);
        assert_eq!(s.conns(), 0);
    }

    /// Messages that never finish, on many connections, are cut off once they hold the whole
    /// budget; whole messages still pass.
    #[test]
    fn unfinished_messages_are_cut_off_at_the_budget() {
        let mut s = Streams::new(LIMITS);
        let (mut out, mut dropped) = (Vec::new(), 0);
        // Each connection sends all but 3 bytes of the longest legal message: 4100 bytes held.
        let unfinished = encode("n", &[7u8; 4096]).unwrap();
        let unfinished = &unfinished[..unfinished.len() - 3];
        let verdicts: Vec<Verdict> =
            (0..4u8).map(|c| s.feed(t0(), &[c], unfinished, &mut out, &mut dropped, |_| true)).collect();
        assert_eq!(verdicts[..3], [Verdict::Keep, Verdict::Keep, Verdict::Keep]);
        assert_eq!(verdicts[3], Verdict::Close, "the fourth took the held bytes over the budget");
        assert!(s.buffered() <= LIMITS.buffered && out.is_empty() && dropped == 1);
        let whole = encode("n", &[9u8; 100]).unwrap();
        assert_eq!(s.feed(t0(), b"ok", &whole, &mut out, &mut dropped, |_| true), Verdict::Keep);
        assert_eq!(out, vec![("n".to_owned(), vec![9u8; 100])]);
    }

    /// Connections over the cap are closed as they come.
    #[test]
    fn connections_over_the_cap_are_closed() {
        let mut s = Streams::new(LIMITS);
        for c in 0..LIMITS.conns as u8 {
            assert_eq!(s.notice(t0(), &[c]), Verdict::Keep);
        }
        assert_eq!(s.notice(t0(), b"one too many"), Verdict::Close);
        let (mut out, mut dropped) = (Vec::new(), 0);
        assert_eq!(s.feed(t0(), b"another", b"data", &mut out, &mut dropped, |_| true), Verdict::Close);
        assert_eq!(s.conns(), LIMITS.conns);
        // One ends: room for the next.
        assert_eq!(s.notice(t0(), &[0]), Verdict::Keep);
        assert_eq!(s.notice(t0(), b"next"), Verdict::Keep);
    }

    #[test]
    fn a_name_that_is_not_utf8_is_dropped_and_the_next_message_passes() {
        let mut s = Streams::new(LIMITS);
        let mut bad = encode("ab", b"frame").unwrap();
        bad[HEADER] = 0xff;
        let good = encode("ok", b"next").unwrap();
        let (out, dropped, v) = feed_all(&mut s, b"c", &[&bad, &good]);
        assert_eq!((out, dropped, v), (vec![("ok".to_owned(), b"next".to_vec())], 1, vec![Verdict::Keep; 2]));
        assert!(encode(&"n".repeat(70_000), b"").is_none(), "a name the header cannot say");
    }

    /// Streams with connections 0 to the cap noticed at once, and that instant.
    fn streams_at_the_cap() -> (Streams, Instant) {
        let mut s = Streams::new(LIMITS);
        let t = t0();
        for c in 0..LIMITS.conns as u8 {
            assert_eq!(s.notice(t, &[c]), Verdict::Keep);
        }
        (s, t)
    }

    /// Connections at the cap that keep sending junk (whole messages under names no loaded
    /// peer has, or empty ones) do not lock new connections out: only a message under a name
    /// `vouch` knows keeps a connection active, so the junk ones go idle and make room.
    #[test]
    fn chatty_junk_connections_do_not_lock_out_a_new_connection() {
        let (mut s, t) = streams_at_the_cap();
        let (mut out, mut dropped) = (Vec::new(), 0);
        let known = |name: &str| name == "peer";
        let junk = encode("", b"").unwrap();
        let honest = encode("peer", b"frame").unwrap();
        for step in 1..=2u32 {
            let at = t + IDLE_EVICT * 9 * step / 10;
            for c in 1..LIMITS.conns as u8 {
                assert_eq!(s.feed(at, &[c], &junk, &mut out, &mut dropped, known), Verdict::Keep);
            }
            assert_eq!(s.feed(at, &[0], &honest, &mut out, &mut dropped, known), Verdict::Keep);
        }
        let later = t + IDLE_EVICT * 2;
        assert_eq!(s.notice(later, b"new"), Verdict::Keep, "a junk connection made room");
        let evicted = s.take_evicted();
        assert_eq!(evicted.len(), 1);
        assert_ne!(evicted[0], vec![0], "never the connection a known peer keeps using");
    }

    /// Names are public: connections at the cap that all send messages under a loaded peer's
    /// name do not lock new connections out either. The name keeps one of them active (the
    /// first to use it); the others go idle and make room, and the name's own peer, once its
    /// connection is the one left, keeps it.
    #[test]
    fn chatty_connections_under_a_loaded_name_do_not_lock_out_a_new_connection() {
        let (mut s, t) = streams_at_the_cap();
        let (mut out, mut dropped) = (Vec::new(), 0);
        let known = |name: &str| name == "peer";
        let junk = encode("peer", b"junk").unwrap();
        for step in 1..=2u32 {
            let at = t + IDLE_EVICT * 9 * step / 10;
            for c in 0..LIMITS.conns as u8 {
                assert_eq!(s.feed(at, &[c], &junk, &mut out, &mut dropped, known), Verdict::Keep);
            }
        }
        let later = t + IDLE_EVICT * 2;
        assert_eq!(s.notice(later, b"new"), Verdict::Keep, "a connection made room");
        let evicted = s.take_evicted();
        assert_eq!(evicted.len(), 1);
        assert_ne!(evicted[0], vec![0], "never the connection that holds the name");
    }

    /// Review 61, control M1: a stranger speaks a quiet peer's (public) name on a connection of
    /// its own and leaves others silent at the cap. The peer's own connection, which carried an
    /// authentic frame, is the one idle longest; new connections still close the stranger's
    /// silent ones first (before the fix: the peer's, its next frame lost), and the peer's
    /// only once no other idle one is left.
    #[test]
    fn a_connection_that_carried_an_authentic_frame_is_closed_last_to_make_room() {
        let mut s = Streams::new(LIMITS);
        let t = t0();
        let (mut out, mut dropped) = (Vec::new(), 0);
        let known = |name: &str| name == "peer";
        assert_eq!(s.notice(t, b"peer's"), Verdict::Keep);
        let honest = encode("peer", b"frame").unwrap();
        assert_eq!(s.feed(t, b"peer's", &honest, &mut out, &mut dropped, known), Verdict::Keep);
        s.authentic(t, b"peer's");
        let opened = t + IDLE_EVICT / 2;
        for c in [&b"stranger"[..], b"silent 1", b"silent 2"] {
            assert_eq!(s.notice(opened, c), Verdict::Keep);
        }
        let junk = encode("peer", b"junk").unwrap();
        for at in [t + IDLE_EVICT * 3 / 2, t + IDLE_EVICT * 19 / 10] {
            assert_eq!(s.feed(at, b"stranger", &junk, &mut out, &mut dropped, known), Verdict::Keep);
        }
        let later = t + IDLE_EVICT * 2;
        assert_eq!(s.notice(later, b"new 1"), Verdict::Keep);
        assert_eq!(s.notice(later, b"new 2"), Verdict::Keep);
        let mut evicted = s.take_evicted();
        evicted.sort();
        assert_eq!(evicted, vec![b"silent 1".to_vec(), b"silent 2".to_vec()], "never the peer's while others idle");
        assert_eq!(s.notice(later, b"new 3"), Verdict::Keep);
        assert_eq!(s.take_evicted(), vec![b"peer's".to_vec()], "the last idle one left");
        // An id no longer open is ignored.
        s.authentic(later, b"peer's");
        assert_eq!(s.conns(), LIMITS.conns);
    }

    /// Connections left silent at the cap do not lock new ones out: once one has gone
    /// [`IDLE_EVICT`] without a whole message, a new connection takes its place (the one idle
    /// longest, for the shell to close); before that, and never a connection that keeps sending
    /// whole messages, none goes.
    #[test]
    fn a_connection_idle_past_the_eviction_time_makes_room_at_the_cap() {
        let mut s = Streams::new(LIMITS);
        let t = t0();
        for c in 0..LIMITS.conns as u8 {
            assert_eq!(s.notice(t, &[c]), Verdict::Keep);
        }
        assert_eq!(s.notice(t + IDLE_EVICT / 2, b"early"), Verdict::Close, "none idle long enough yet");
        // Connection 2 keeps sending whole messages; the others stay silent.
        let (mut out, mut dropped) = (Vec::new(), 0);
        let whole = encode("p", b"ping").unwrap();
        assert_eq!(s.feed(t + IDLE_EVICT / 2, &[2], &whole, &mut out, &mut dropped, |_| true), Verdict::Keep);
        assert!(s.take_evicted().is_empty());
        let later = t + IDLE_EVICT + Duration::from_millis(1);
        for n in 0..LIMITS.conns as u8 - 1 {
            assert_eq!(s.notice(later, &[b'n', n]), Verdict::Keep, "new connection {n}");
        }
        let mut evicted = s.take_evicted();
        evicted.sort();
        assert_eq!(evicted, vec![vec![0], vec![1], vec![3]], "the silent ones, never the sender");
        assert_eq!(s.conns(), LIMITS.conns);
        // Their ends, as the socket tells them, are not new connections.
        for e in &evicted {
            assert_eq!(s.notice(later, e), Verdict::Keep);
        }
        assert_eq!(s.conns(), LIMITS.conns);
    }

    /// Two connections stalled halfway through long messages hold the budget: an honest
    /// message that needs it closes the one stalled longest instead of being cut off itself,
    /// once that one has been stalled [`IDLE_EVICT`].
    #[test]
    fn a_message_stalled_past_the_eviction_time_makes_room_in_the_budget() {
        let limits = Limits { buffered: 9000, ..LIMITS };
        let mut s = Streams::new(limits);
        let t = t0();
        let (mut out, mut dropped) = (Vec::new(), 0);
        let long = encode("n", &[7u8; 4096]).unwrap();
        let stall = &long[..long.len() - 3];
        assert_eq!(s.feed(t, b"s1", stall, &mut out, &mut dropped, |_| true), Verdict::Keep);
        assert_eq!(
            s.feed(t + Duration::from_millis(10), b"s2", stall, &mut out, &mut dropped, |_| true),
            Verdict::Keep
        );
        let honest = encode("h", &[1u8; 2000]).unwrap();
        // Its first part takes the held bytes over the budget: too early to evict, so it is cut.
        let early = t + IDLE_EVICT / 2;
        assert_eq!(s.feed(early, b"h1", &honest[..1500], &mut out, &mut dropped, |_| true), Verdict::Close);
        assert!(s.take_evicted().is_empty());
        let later = t + IDLE_EVICT + Duration::from_millis(5);
        assert_eq!(s.feed(later, b"h2", &honest[..1500], &mut out, &mut dropped, |_| true), Verdict::Keep);
        assert_eq!(s.take_evicted(), vec![b"s1".to_vec()], "the one stalled longest");
        assert_eq!(s.feed(later, b"h2", &honest[1500..], &mut out, &mut dropped, |_| true), Verdict::Keep);
        assert_eq!(out, vec![("h".to_owned(), vec![1u8; 2000])]);
        assert!(s.buffered() <= limits.buffered);
    }
}
