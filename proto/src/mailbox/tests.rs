//! Property tests of the mailbox: the record codec against arbitrary bytes and records, the slot
//! table against arbitrary operation sequences, and a target and an initiator exchanging
//! records through a shared ring image while READs tear and a third party writes into it.

use std::time::{Duration, Instant};

use proptest::prelude::*;

use super::*;
use crate::mailbox::slots::candidates;
use crate::types::{ChunkIdx, PeerId, Region, XferId};
use crate::wire::{AckStatus, Credit};

fn credit() -> impl Strategy<Value = Credit> {
    (any::<u32>(), 0u64..u64::MAX / 2, 1u64..1 << 40)
        .prop_map(|(chunk, offset, len)| Credit { chunk: ChunkIdx(chunk), region: Region { offset, len } })
}

fn answer() -> impl Strategy<Value = Answer> {
    let status = prop_oneof![Just(AckStatus::Scattered), Just(AckStatus::Refused), Just(AckStatus::Failed)];
    let reason = prop_oneof![
        Just(FailReason::Cancelled),
        Just(FailReason::Refused),
        Just(FailReason::TimedOut),
        Just(FailReason::Shutdown),
        Just(FailReason::CopyFailed),
    ];
    prop_oneof![
        credit().prop_map(Answer::Grant),
        credit().prop_map(Answer::Ready),
        (credit(), status).prop_map(|(credit, status)| Answer::Ack { credit, status }),
        reason.prop_map(Answer::Fail),
    ]
}

fn record() -> impl Strategy<Value = Record> {
    (any::<u32>(), 1u64.., any::<u64>(), answer()).prop_map(|(slot, seq, xfer, answer)| Record {
        slot: SlotId(slot),
        seq: Seq(seq),
        xfer: XferId(xfer),
        answer,
    })
}

proptest! {
    #[test]
    fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..130), token in any::<[u8; 16]>()) {
        let key = RecordKey::derive(&Token(token));
        if let Ok(r) = Record::decode(&bytes, &key) {
            let again = r.encode(&key);
            prop_assert_eq!(again.as_slice(), bytes.as_slice());
        }
    }

    #[test]
    fn encode_decode_round_trip(r in record(), token in any::<[u8; 16]>()) {
        let key = RecordKey::derive(&Token(token));
        prop_assert_eq!(Record::decode(&r.encode(&key), &key), Ok(r));
    }

    #[test]
    fn another_token_is_refused(r in record(), a in any::<[u8; 16]>(), b in any::<[u8; 16]>()) {
        prop_assume!(a != b);
        let bytes = r.encode(&RecordKey::derive(&Token(a)));
        prop_assert_eq!(Record::decode(&bytes, &RecordKey::derive(&Token(b))), Err(RecordError::BadMac));
    }

    #[test]
    fn an_old_sequence_is_never_accepted_again(ring in 2u32..16, n in 1u64..40, old in 0u64..40) {
        let layout = MailboxLayout { slots: 1, ring };
        let token = Token([3; 16]);
        let key = RecordKey::derive(&token);
        let mut reader = MailboxReader::new(layout, SlotId(0), XferId(1), &token).unwrap();
        let mut img = vec![0u8; layout.ring_bytes() as usize];
        let rec = |seq| Record {
            slot: SlotId(0),
            seq: Seq(seq),
            xfer: XferId(1),
            answer: Answer::Grant(Credit { chunk: ChunkIdx(0), region: Region { offset: 0, len: 64 } }),
        };
        let put = |img: &mut Vec<u8>, seq| {
            let pos = layout.position(Seq(seq)) as usize * RECORD_LEN;
            img[pos..pos + RECORD_LEN].copy_from_slice(&rec(seq).encode(&key));
        };
        for seq in 1..=n {
            put(&mut img, seq);
            reader.handle_fetched(&img).unwrap();
        }
        prop_assert_eq!(reader.consumed(), Seq(n));
        // any genuine older record replayed into its own position is ignored
        let old = old % n + 1;
        put(&mut img, old);
        prop_assert_eq!(reader.handle_fetched(&img), Ok(0));
        prop_assert_eq!(reader.consumed(), Seq(n));
    }
}

/// One step of the slot-table model.
#[derive(Debug, Clone)]
enum SlotOp {
    Allocate(u64, u64),
    Place(u32),
    Consumed(u64, u64, u64),
    Close(u32),
    LosePeer(u64),
    Advance(u64),
}

fn slot_op() -> impl Strategy<Value = SlotOp> {
    prop_oneof![
        (0u64..4, 0u64..6).prop_map(|(p, x)| SlotOp::Allocate(p, x)),
        (0u32..6).prop_map(SlotOp::Place),
        (0u64..4, 0u64..6, 0u64..12).prop_map(|(p, x, c)| SlotOp::Consumed(p, x, c)),
        (0u32..6).prop_map(SlotOp::Close),
        (0u64..4).prop_map(SlotOp::LosePeer),
        (0u64..80).prop_map(SlotOp::Advance),
    ]
}

proptest! {
    /// Whatever the peers do, the table stays consistent, no peer ever holds more than its cap,
    /// and a peer under its cap is refused only when every slot is taken.
    #[test]
    fn slot_table_bounds_hold(ops in proptest::collection::vec(slot_op(), 1..200)) {
        let cfg = SlotConfig { layout: MailboxLayout { slots: 5, ring: 3 }, per_peer_max: 2, linger: Duration::from_millis(50) };
        let mut t = SlotTable::new(cfg).unwrap();
        let mut now = Instant::now();
        let cands = |p: u64, x: u64| candidates(&Token([(p as u8) ^ (x as u8).rotate_left(3); 16]), cfg.layout);
        for op in ops {
            match op {
                SlotOp::Allocate(p, x) => match t.allocate(now, PeerId(p), XferId(x), &cands(p, x)) {
                    Ok(s) => prop_assert!(cands(p, x).contains(&s)),
                    Err(SlotError::AlreadyHeld { .. }) => {}
                    Err(SlotError::PeerAtCap { held, .. }) => prop_assert_eq!(held, 2),
                    // refused only when no candidate is free (expired closing slots count as free)
                    Err(SlotError::Exhausted) => {
                        let again = t.allocate(now, PeerId(99), XferId(0), &cands(p, x));
                        prop_assert_eq!(again, Err(SlotError::Exhausted));
                    }
                    Err(e) => prop_assert!(false, "unexpected {e}"),
                },
                SlotOp::Place(s) => { let _ = t.place(SlotId(s)); }
                SlotOp::Consumed(p, x, c) => { let _ = t.handle_consumed(PeerId(p), XferId(x), Seq(c)); }
                SlotOp::Close(s) => t.close(now, SlotId(s)),
                SlotOp::LosePeer(p) => { t.release_peer(PeerId(p)); prop_assert_eq!(t.held_by(PeerId(p)), 0); }
                SlotOp::Advance(ms) => now += Duration::from_millis(ms),
            }
            t.assert_consistent();
        }
    }
}

/// Performs the writer's pending record writes on `arena` (the mailbox), in order.
fn apply(w: &mut MailboxWriter, arena: &mut [u8]) {
    while let Some(rw) = w.poll_write() {
        arena[rw.offset as usize..rw.offset as usize + RECORD_LEN].copy_from_slice(&rw.bytes);
    }
}

/// The bytes of `regions` of `arena`, back to back: what one READ request of them returns.
fn gather(arena: &[u8], regions: &[Region]) -> Vec<u8> {
    regions.iter().flat_map(|r| arena[r.offset as usize..r.end() as usize].iter().copied()).collect()
}

/// One step of the target / initiator / third-party exchange.
#[derive(Debug, Clone)]
enum Step {
    /// The target writes its next answer (if the ring has room).
    Write,
    /// The initiator READs the ring; with `Some(seed)` the READ races the target and returns a
    /// mix of the previous and the current image, word by word.
    Fetch(Option<u64>),
    /// The initiator's cursor reaches the target.
    Report,
    /// A third party writes bytes at a record position: random ones, or a copy of another
    /// position's genuine record.
    Forge { pos: u8, copy_from: Option<u8>, fill: u8 },
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        4 => Just(Step::Write),
        4 => proptest::option::weighted(0.3, any::<u64>()).prop_map(Step::Fetch),
        2 => Just(Step::Report),
        1 => (any::<u8>(), proptest::option::of(any::<u8>()), any::<u8>())
            .prop_map(|(pos, copy_from, fill)| Step::Forge { pos, copy_from, fill }),
    ]
}

proptest! {
    /// Through a ring that fills up, torn READs and a third party writing into the mailbox, the
    /// initiator accepts a prefix of exactly the target's answers, in order, and never reports
    /// a protocol error; without forgery, clean READs and cursor reports at the end deliver
    /// every answer.
    #[test]
    fn the_initiator_accepts_exactly_the_targets_records(steps in proptest::collection::vec(step(), 1..300), forge in any::<bool>()) {
        let layout = MailboxLayout { slots: 3, ring: 4 };
        let cfg = SlotConfig { layout, per_peer_max: 3, linger: Duration::from_secs(1) };
        let mut target = MailboxWriter::new(cfg).unwrap();
        let (peer, xfer, token) = (PeerId(1), XferId(9), Token([0x11; 16]));
        let now = Instant::now();
        // another transfer (under the same token, so with the same candidates) holds our first
        // candidate: the reader must find the second
        let first = target.open(now, peer, XferId(8), &token).unwrap();
        prop_assert_ne!(target.open(now, peer, xfer, &token).unwrap(), first);
        let mut reader = MailboxReader::locate(layout, xfer, &token).unwrap();
        let mut arena = vec![0u8; layout.byte_len() as usize];
        let mut last_read = Vec::new();
        let mut written: Vec<Answer> = Vec::new();
        let mut accepted: Vec<Answer> = Vec::new();
        let mut forged = false;
        for (i, step) in steps.into_iter().enumerate() {
            match step {
                Step::Write => {
                    let answer = Answer::Grant(Credit { chunk: ChunkIdx(i as u32), region: Region { offset: i as u64 * 64, len: 64 } });
                    target.answer(peer, xfer, answer).unwrap();
                    apply(&mut target, &mut arena);
                    written.push(answer);
                }
                Step::Fetch(tear) => {
                    let mut img = gather(&arena, &reader.fetch());
                    if let Some(seed) = tear.filter(|_| last_read.len() == img.len()) {
                        for (w, chunk) in img.chunks_mut(8).enumerate() {
                            if (seed >> (w % 64)) & 1 == 1 {
                                chunk.copy_from_slice(&last_read[w * 8..w * 8 + 8]);
                            }
                        }
                    }
                    prop_assert!(reader.handle_fetched(&img).is_ok());
                    while let Some((_, a)) = reader.poll_answer() {
                        accepted.push(a);
                    }
                    last_read = img;
                }
                Step::Report => {
                    target.handle_consumed(now, peer, xfer, reader.consumed()).unwrap();
                    apply(&mut target, &mut arena);
                }
                Step::Forge { pos, copy_from, fill } => {
                    if !forge {
                        continue;
                    }
                    forged = true;
                    let records = (layout.byte_len() as usize) / RECORD_LEN;
                    let at = pos as usize % records * RECORD_LEN;
                    match copy_from {
                        Some(from) => {
                            let from = from as usize % records * RECORD_LEN;
                            arena.copy_within(from..from + RECORD_LEN, at);
                        }
                        None => arena[at..at + RECORD_LEN].fill(fill),
                    }
                }
            }
            prop_assert!(accepted.len() <= written.len());
            prop_assert_eq!(&accepted[..], &written[..accepted.len()]);
        }
        if !forged {
            // clean READs and cursor reports deliver the rest, the backlog included
            for _ in 0..written.len() + 2 {
                reader.handle_fetched(&gather(&arena, &reader.fetch())).unwrap();
                target.handle_consumed(now, peer, xfer, reader.consumed()).unwrap();
                apply(&mut target, &mut arena);
            }
            while let Some((_, a)) = reader.poll_answer() {
                accepted.push(a);
            }
            prop_assert_eq!(target.backlog(peer, xfer), 0);
            prop_assert_eq!(accepted, written);
        }
    }
}

#[derive(Debug, Clone)]
enum QueueOp {
    Push(u64, u64, u64),
    Hold(u64, u64, u64),
    /// Serve with the slots of this bit mask free.
    Pop(u8),
    Remove(u64, u64),
    Advance(u64),
    LosePeer(u64),
}

fn queue_op() -> impl Strategy<Value = QueueOp> {
    prop_oneof![
        4 => (0u64..4, 0u64..12, 0u64..40).prop_map(|(p, x, u)| QueueOp::Push(p, x, u)),
        2 => (0u64..4, 0u64..12, 0u64..40).prop_map(|(p, x, u)| QueueOp::Hold(p, x, u)),
        3 => any::<u8>().prop_map(QueueOp::Pop),
        1 => (0u64..4, 0u64..12).prop_map(|(p, x)| QueueOp::Remove(p, x)),
        1 => (0u64..60).prop_map(QueueOp::Advance),
        1 => (0u64..4).prop_map(QueueOp::LosePeer),
    ]
}

proptest! {
    /// Whatever peers send, the queue of WANTs waiting for a slot stays within its bounds per
    /// peer and in total (transfers and held units), refuses exactly what would pass them, and
    /// serves each peer's waiters oldest first among those a slot is free for.
    #[test]
    fn slot_queue_bounds_hold_and_each_peer_is_served_oldest_first(ops in proptest::collection::vec(queue_op(), 1..200)) {
        let cfg = QueueConfig { per_peer: 3, total: 7, units_per_peer: 60, units_total: 100, wait: Duration::from_millis(50) };
        let mut q: SlotQueue<u64> = SlotQueue::new(cfg);
        let mut now = Instant::now();
        // The model: each peer's waiting transfers in arrival order, with their units.
        let mut model: std::collections::BTreeMap<u64, Vec<(u64, u64, Instant)>> = Default::default();
        let slot_of = |x: u64| SlotId((x % 8) as u32);
        for op in ops {
            match op {
                QueueOp::Push(p, x, u) => {
                    let r = q.push(now, PeerId(p), XferId(x), Token([x as u8; 16]), vec![slot_of(x)], x, u);
                    let mine = model.get(&p).map_or(0, Vec::len);
                    let units: u64 = model.values().flatten().map(|w| w.1).sum();
                    let my_units: u64 = model.get(&p).map_or(0, |v| v.iter().map(|w| w.1).sum());
                    let total: usize = model.values().map(Vec::len).sum();
                    let fits = mine < 3 && total < 7 && my_units + u <= 60 && units + u <= 100;
                    let dup = model.get(&p).is_some_and(|v| v.iter().any(|w| w.0 == x));
                    prop_assert_eq!(r.is_ok(), fits && !dup, "{:?}", r);
                    if r.is_ok() {
                        model.entry(p).or_default().push((x, u, now + cfg.wait));
                    }
                }
                QueueOp::Hold(p, x, u) => {
                    if q.hold(PeerId(p), XferId(x), x, u).is_ok() {
                        let w = model.get_mut(&p).and_then(|v| v.iter_mut().find(|w| w.0 == x));
                        prop_assert!(w.is_some(), "held for a transfer that does not wait");
                        if let Some(w) = w { w.1 += u; }
                    }
                }
                QueueOp::Pop(mask) => {
                    let free = |c: &[SlotId]| mask & (1 << c[0].0) != 0;
                    let got = q.pop_servable(|_, _, c| if free(c) { Ok(c[0]) } else { Err(SlotError::Exhausted) });
                    match got {
                        Some(w) => {
                            let v = model.get_mut(&w.peer.0).expect("a waiting peer");
                            let first = v.iter().position(|m| mask & (1 << slot_of(m.0).0) != 0);
                            prop_assert_eq!(first.map(|i| v[i].0), Some(w.xfer.0), "not the oldest servable");
                            if let Some(i) = first { v.remove(i); }
                            model.retain(|_, v| !v.is_empty());
                        }
                        None => prop_assert!(
                            model.values().flatten().all(|m| mask & (1 << slot_of(m.0).0) == 0),
                            "a servable waiter was left waiting"
                        ),
                    }
                }
                QueueOp::Remove(p, x) => {
                    let was = model.get(&p).is_some_and(|v| v.iter().any(|w| w.0 == x));
                    prop_assert_eq!(q.remove(PeerId(p), XferId(x)).is_some(), was);
                    if let Some(v) = model.get_mut(&p) { v.retain(|w| w.0 != x); }
                    model.retain(|_, v| !v.is_empty());
                }
                QueueOp::Advance(ms) => {
                    now += Duration::from_millis(ms);
                    let gone = q.expire(now).len();
                    let due = model.values().flatten().filter(|w| w.2 <= now).count();
                    prop_assert_eq!(gone, due);
                    for v in model.values_mut() { v.retain(|w| w.2 > now); }
                    model.retain(|_, v| !v.is_empty());
                }
                QueueOp::LosePeer(p) => {
                    prop_assert_eq!(q.release_peer(PeerId(p)), model.remove(&p).map_or(0, |v| v.len()));
                }
            }
            q.assert_consistent();
            prop_assert_eq!(q.len(), model.values().map(Vec::len).sum::<usize>());
            prop_assert_eq!(q.units(), model.values().flatten().map(|w| w.1).sum::<u64>());
        }
    }
}
