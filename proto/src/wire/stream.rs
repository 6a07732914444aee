//! Control frames over a byte stream (the shell's ZMQ channel: a `ZMQ_STREAM` socket hands it
//! each TCP connection's bytes as they come): every message is a 6-byte header, the sender's
//! name length (u16 LE) and the frame's length (u32 LE), then the name and the frame. Sans-IO:
//! the shell feeds bytes per connection and acts on the verdicts.
//!
//! Why not ZMQ's own messages: ZMQ refuses a message *part* over `ZMQ_MAXMSGSIZE`, but holds
//! the parts of an unfinished multipart message without limit and without telling the reader,
//! so anyone who could reach the socket could grow our memory until the process was killed
//! (2.4 GiB for 300 parts of 8 MiB, none delivered). Here every byte held is ours to count:
//! a connection's partial message is bounded by the longest legal name and frame, all
//! connections' together by a budget, and connections by a cap; whoever breaks a bound is cut
//! off, and the frame is dropped (the transfer it belonged to times out).

use std::collections::{HashMap, VecDeque};

/// Bytes before a message's name and frame.
pub const HEADER: usize = 6;

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

/// What the socket should do after [`Streams::feed`] or [`Streams::opened`].
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

/// Every connection's unfinished message.
#[derive(Debug)]
pub struct Streams {
    limits: Limits,
    conns: HashMap<Vec<u8>, Vec<u8>>,
    buffered: usize,
    closed: VecDeque<Vec<u8>>,
}

impl Streams {
    /// No connection yet, under `limits`.
    pub fn new(limits: Limits) -> Self {
        Self { limits, conns: HashMap::new(), buffered: 0, closed: VecDeque::new() }
    }

    /// Bytes of unfinished messages held now.
    pub fn buffered(&self) -> usize {
        self.buffered
    }

    /// Connections open now.
    pub fn conns(&self) -> usize {
        self.conns.len()
    }

    /// The socket's notice (an empty message) for connection `id`: a new connection, or the
    /// end of one we know. `Close` for a new one over the cap.
    pub fn notice(&mut self, id: &[u8]) -> Verdict {
        if let Some(partial) = self.conns.remove(id) {
            self.buffered -= partial.len();
            return Verdict::Keep;
        }
        if let Some(i) = self.closed.iter().position(|c| c == id) {
            self.closed.remove(i);
            return Verdict::Keep;
        }
        self.opened(id)
    }

    fn opened(&mut self, id: &[u8]) -> Verdict {
        if self.conns.len() >= self.limits.conns {
            return self.close(id);
        }
        self.conns.insert(id.to_vec(), Vec::new());
        Verdict::Keep
    }

    fn close(&mut self, id: &[u8]) -> Verdict {
        if let Some(partial) = self.conns.remove(id) {
            self.buffered -= partial.len();
        }
        if self.closed.len() == CLOSED_KEPT {
            self.closed.pop_front();
        }
        self.closed.push_back(id.to_vec());
        Verdict::Close
    }

    /// Bytes `data` arrived on connection `id`: every message they complete goes to `out` as
    /// (name, frame); `dropped` counts messages refused (a name that is not UTF-8). `Close`:
    /// the connection broke a bound; what it sent unfinished is dropped.
    pub fn feed(&mut self, id: &[u8], data: &[u8], out: &mut Vec<(String, Vec<u8>)>, dropped: &mut u64) -> Verdict {
        if !self.conns.contains_key(id) && self.opened(id) == Verdict::Close {
            *dropped += 1;
            return Verdict::Close;
        }
        let limits = self.limits;
        let Some(buf) = self.conns.get_mut(id) else { return Verdict::Close };
        let held = buf.len();
        buf.extend_from_slice(data);
        let mut at = 0;
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
                Ok(name) => out.push((name.to_owned(), rest[HEADER + name_len..end].to_vec())),
                Err(_) => *dropped += 1,
            }
            at += end;
        };
        buf.drain(..at);
        let now = buf.len();
        self.buffered = self.buffered - held + now;
        if broke || self.buffered > limits.buffered {
            *dropped += 1;
            return self.close(id);
        }
        if buf.capacity() > 4 * now.max(64 << 10) {
            buf.shrink_to(now);
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
            v.push(s.feed(id, c, &mut out, &mut dropped));
        }
        (out, dropped, v)
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
            prop_assert_eq!(s.notice(b"c1"), Verdict::Keep);
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
                    let _ = s.notice(&id);
                } else {
                    let _ = s.feed(&id, data, &mut out, &mut dropped);
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
        s.notice(b"x");
        let mut h = vec![0u8; HEADER];
        h[2..6].copy_from_slice(&(LIMITS.frame as u32 + 1).to_le_bytes());
        let (out, dropped, v) = feed_all(&mut s, b"x", &[&h]);
        assert_eq!((out.len(), dropped, v), (0, 1, vec![Verdict::Close]));
        assert_eq!((s.buffered(), s.conns()), (0, 0));
        // The socket's notice of its end is not a new connection.
        assert_eq!(s.notice(b"x"), Verdict::Keep);
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
        let verdicts: Vec<Verdict> = (0..4u8).map(|c| s.feed(&[c], unfinished, &mut out, &mut dropped)).collect();
        assert_eq!(verdicts[..3], [Verdict::Keep, Verdict::Keep, Verdict::Keep]);
        assert_eq!(verdicts[3], Verdict::Close, "the fourth took the held bytes over the budget");
        assert!(s.buffered() <= LIMITS.buffered && out.is_empty() && dropped == 1);
        let whole = encode("n", &[9u8; 100]).unwrap();
        assert_eq!(s.feed(b"ok", &whole, &mut out, &mut dropped), Verdict::Keep);
        assert_eq!(out, vec![("n".to_owned(), vec![9u8; 100])]);
    }

    /// Connections over the cap are closed as they come.
    #[test]
    fn connections_over_the_cap_are_closed() {
        let mut s = Streams::new(LIMITS);
        for c in 0..LIMITS.conns as u8 {
            assert_eq!(s.notice(&[c]), Verdict::Keep);
        }
        assert_eq!(s.notice(b"one too many"), Verdict::Close);
        let (mut out, mut dropped) = (Vec::new(), 0);
        assert_eq!(s.feed(b"another", b"data", &mut out, &mut dropped), Verdict::Close);
        assert_eq!(s.conns(), LIMITS.conns);
        // One ends: room for the next.
        assert_eq!(s.notice(&[0]), Verdict::Keep);
        assert_eq!(s.notice(b"next"), Verdict::Keep);
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
}
