//! One-way WANTs that find no mailbox slot wait for one (issue 13): a peer past its quarter of
//! the slots, hostile floods against the queue's bounds, forgeries, cancels, timeouts and lost
//! peers, and more one-way WRITEs and READs in flight than a peer's slot cap, byte-exact.

use super::*;
use crate::oneway::{MAILBOX_SLOTS, WAITING_PER_PEER, WAITING_TOTAL};

/// Slots one peer may hold at the target (a quarter of them).
const CAP: u64 = (MAILBOX_SLOTS / 4) as u64;
const INI: PeerId = PeerId(1);

fn token(xfer: u64) -> Token {
    Token(TOKEN.0 ^ (u128::from(xfer) << 64) ^ 0x77)
}

/// A one-way WANT of one 4 KiB chunk for `xfer`, proving the fixture registration.
fn one_way_want(xfer: u64) -> Msg {
    let t = token(xfer);
    let proofs = vec![crate::proof::prove(REG, &KEY, t, XferId(xfer))];
    Msg::Want(Want {
        arena: ArenaId(0),
        xfer: XferId(xfer),
        token: t,
        endpoint: wire::REPLY_MAILBOX.to_vec(),
        chunks: vec![CHUNK],
        proofs,
        inline: None,
        standing: Default::default(),
    })
}

/// The same WANT with a proof that does not verify (one bit of its tag flipped).
fn forged_want(xfer: u64) -> Msg {
    let Msg::Want(mut w) = one_way_want(xfer) else { unreachable!() };
    w.proofs[0].tag[0] ^= 1;
    Msg::Want(w)
}

/// A target keeping a mailbox, with an arena of 4 regions.
fn target() -> (Endpoint, Instant) {
    let (mut ep, t) = endpoint(16 * KIB, 2, false);
    ep.keep_mailbox(true);
    (ep, t)
}

/// The mailbox records among `acts`, as (offset, bytes), of transfer `xfer` only.
fn records_of(acts: &[Action], xfer: u64) -> Vec<(u64, [u8; crate::mailbox::RECORD_LEN])> {
    acts.iter()
        .filter_map(|a| match a {
            Action::PutRecord { offset, bytes } if bytes[16..24] == xfer.to_le_bytes() => Some((*offset, *bytes)),
            _ => None,
        })
        .collect()
}

/// Records written per transfer (a record names its transfer in bytes 16..24).
fn count_records(acts: &[Action], written: &mut BTreeMap<u64, u64>) {
    for a in acts.iter().filter(|a| !clears(a)) {
        if let Action::PutRecord { bytes, .. } = a {
            let xfer = u64::from_le_bytes(bytes[16..24].try_into().expect("8 bytes"));
            *written.entry(xfer).or_insert(0) += 1;
        }
    }
}

/// Opens `INI`'s flows `0..CAP` (its whole share of slots); returns the records each got.
fn fill_the_cap(ep: &mut Endpoint, t: Instant) -> BTreeMap<u64, u64> {
    let mut written = BTreeMap::new();
    for x in 0..CAP {
        ep.handle_msg(t, INI, one_way_want(x)).unwrap();
        count_records(&drain(ep), &mut written);
    }
    assert_eq!(ep.answering_slots_held(), CAP as u32);
    written
}

/// Ends `INI`'s open flow `xfer` as its initiator would after a cancel: the cancel, then the
/// CURSOR reporting every record of it read, which frees its slot. Returns what followed.
fn end_flow(ep: &mut Endpoint, t: Instant, xfer: u64, written: &mut BTreeMap<u64, u64>) -> Vec<Action> {
    ep.handle_msg(t, INI, Msg::cancel(XferId(xfer), token(xfer), Vec::new())).unwrap();
    let mut acts = drain(ep);
    count_records(&acts, written);
    let consumed = written.get(&xfer).copied().unwrap_or(0);
    let cursor = Msg::Cursor(wire::Cursor { xfer: XferId(xfer), token: token(xfer), consumed });
    ep.handle_msg(t, INI, cursor).unwrap();
    let more = drain(ep);
    count_records(&more, written);
    acts.extend(more);
    acts
}

/// Lets the target's idle timer reclaim its flows, as when their initiator goes silent: each
/// gets a FAIL nobody reads, so its slot lingers. Returns when that happened.
fn reclaim_by_idle_timer(ep: &mut Endpoint) -> Instant {
    let reclaimed = ep.poll_timeout().expect("the flows' idle timer");
    ep.handle_timeout(reclaimed);
    drain(ep);
    reclaimed
}

/// Two targets given the same events, except that `queued` gets the late WANT while its peer
/// holds all its slots and `control` gets it only once a slot has freed: the waiter, opened
/// when the slot frees, writes byte for byte the records, at the same places, that the WANT
/// gets when it comes at that moment.
#[test]
fn a_want_past_the_peers_slot_cap_waits_and_then_gets_the_answers_it_would_have_got_at_once() {
    // An arena with a region for every flow, so the late one is granted as soon as it opens.
    let big = || {
        let (mut ep, t) = endpoint(128 * CHUNK, 2, false);
        ep.keep_mailbox(true);
        (ep, t)
    };
    let ((mut queued, t), (mut control, _)) = (big(), big());
    let (mut w_queued, mut w_control) = (fill_the_cap(&mut queued, t), fill_the_cap(&mut control, t));
    assert_eq!(w_queued, w_control);
    let late = CAP;
    let r = queued.handle_msg(t, INI, one_way_want(late));
    assert_eq!(r, Ok(()), "a genuine WANT that finds no slot is not an error");
    assert!(drain(&mut queued).is_empty(), "nothing is answered before it has a slot");
    assert_eq!((queued.stats().one_way_queued, queued.stats().one_way_refused), (1, 0));
    assert_eq!(queued.answering.waiting(), 1);
    assert_eq!(queued.remote_flows(), CAP as usize, "the receiver has not seen it");
    assert!(queued.poll_timeout().is_some(), "a waiter needs a wake-up");
    // Flow 0 ends; its slot frees and the waiter opens at once.
    let opened = records_of(&end_flow(&mut queued, t, 0, &mut w_queued), late);
    end_flow(&mut control, t, 0, &mut w_control);
    control.handle_msg(t, INI, one_way_want(late)).unwrap();
    let at_once = records_of(&drain(&mut control), late);
    assert_eq!(at_once.len(), 1, "one GRANT record");
    assert_eq!(opened, at_once, "byte for byte, at the same place");
    assert_eq!(queued.answering.waiting(), 0);
    assert_eq!(queued.stats().one_way_answered, control.stats().one_way_answered);
    assert_eq!(queued.stats().one_way_refused, 0);
}

#[test]
fn a_peers_waiting_wants_open_oldest_first_as_its_slots_free() {
    let (mut ep, t) = target();
    let mut written = fill_the_cap(&mut ep, t);
    for x in CAP..CAP + 3 {
        ep.handle_msg(t, INI, one_way_want(x)).unwrap();
    }
    assert_eq!(ep.answering.waiting(), 3);
    for (n, x) in (CAP..CAP + 3).enumerate() {
        end_flow(&mut ep, t, n as u64, &mut written);
        let key = |x| FlowKey { peer: INI, xfer: XferId(x) };
        assert!(ep.answering.is_one_way(key(x)), "waiter {x} opens {n}th");
        assert!((x + 1..CAP + 3).all(|later| ep.answering.is_waiting(key(later))), "the younger ones still wait");
    }
    assert_eq!((ep.answering.waiting(), ep.stats().one_way_queued), (0, 3));
}

#[test]
fn a_waiting_transfers_further_wants_are_held_and_opened_with_it() {
    let (mut ep, t) = target();
    let mut written = fill_the_cap(&mut ep, t);
    ep.handle_msg(t, INI, one_way_want(CAP)).unwrap();
    // Two more chunks for the waiting transfer, then a forger's WANT for it (another token).
    let Msg::Want(mut more) = one_way_want(CAP) else { unreachable!() };
    more.chunks = vec![CHUNK, CHUNK];
    ep.handle_msg(t, INI, Msg::Want(more.clone())).unwrap();
    let mut forged = more.clone();
    forged.token = FORGED;
    let forged_before = ep.stats().control_forged;
    assert_eq!(
        ep.handle_msg(t, INI, Msg::Want(forged)),
        Err(ProtocolError::WrongToken { peer: INI, xfer: XferId(CAP) })
    );
    assert_eq!(ep.stats().control_forged, forged_before + 1);
    end_flow(&mut ep, t, 0, &mut written);
    let key = FlowKey { peer: INI, xfer: XferId(CAP) };
    assert!(ep.answering.is_one_way(key));
    let chunks = ep.scheduler().pending_chunks(key) + ep.scheduler().flow_held_count(key);
    assert_eq!(chunks, 3, "the opening chunk and the two held after it");
}

/// A canceled one-way flow frees its slot as soon as the cancel comes: its initiator reads no
/// more records (its last CURSOR counts only what it read before), so a FAIL written after the
/// cancel held the slot unread for the whole linger. A forged cancel (another token) frees
/// nothing.
#[test]
fn a_canceled_one_way_flow_frees_its_slot_at_once_and_writes_no_fail() {
    let (mut ep, t) = target();
    let mut written = BTreeMap::new();
    ep.handle_msg(t, INI, one_way_want(7)).unwrap();
    count_records(&drain(&mut ep), &mut written);
    let before_cancel = written[&7];
    assert_eq!((ep.answering_slots_held(), before_cancel), (1, 1), "one slot, its GRANT written");
    let forged = Msg::cancel(XferId(7), FORGED, Vec::new());
    let _ = ep.handle_msg(t, INI, forged);
    drain(&mut ep);
    assert_eq!(ep.answering_slots_held(), 1, "a forged cancel frees nothing");
    ep.handle_msg(t, INI, Msg::cancel(XferId(7), token(7), Vec::new())).unwrap();
    let acts = drain(&mut ep);
    assert!(records_of(&acts, 7).is_empty(), "no FAIL for an initiator that gave up: {acts:?}");
    assert_eq!(ep.answering_slots_held(), 0, "freed with the cancel, not after the linger");
    // Its initiator's last CURSOR (what it read: the GRANT) is a late one now, and harmless.
    let cursor = Msg::Cursor(wire::Cursor { xfer: XferId(7), token: token(7), consumed: before_cancel });
    assert_eq!(ep.handle_msg(t, INI, cursor), Ok(()));
    assert_eq!(ep.answering_slots_held(), 0);
}

/// A target whose one-way flow 3 of INI ended by its idle timer (reclaimed, its FAIL unread):
/// no flow, its slot lingering for the last CURSOR. With when it was reclaimed.
fn ended_one_way_flow() -> (Endpoint, Instant) {
    let (mut ep, t) = target();
    ep.handle_msg(t, INI, one_way_want(3)).unwrap();
    drain(&mut ep);
    let reclaimed = reclaim_by_idle_timer(&mut ep);
    assert_eq!((ep.remote_flows(), ep.answering_slots_held()), (0, 1), "reclaimed, its slot lingering");
    (ep, reclaimed)
}

/// A one-way WANT refused as it opens (its destination deregistered) gets its ACK(Refused)
/// and no FAIL after it: its initiator ends the transfer on the ACK and reports reading one
/// record, which frees the slot then, not after the linger.
#[test]
fn a_one_way_want_refused_at_open_gets_no_fail_and_its_cursor_frees_the_slot() {
    let (mut ep, t) = target();
    ep.deregister(t, Some(REG), DST, 64 * KIB);
    drain(&mut ep);
    let _ = ep.handle_msg(t, INI, one_way_want(1));
    let mut written = BTreeMap::new();
    let acts = drain(&mut ep);
    count_records(&acts, &mut written);
    assert_eq!(written.get(&1), Some(&1), "the ACK(Refused) alone: {acts:?}");
    let cursor = Msg::Cursor(wire::Cursor { xfer: XferId(1), token: token(1), consumed: 1 });
    ep.handle_msg(t, INI, cursor).unwrap();
    drain(&mut ep);
    assert_eq!(ep.answering_slots_held(), 0, "freed by the cursor, not after the linger");
}

/// A cancel of a one-way flow the target has already closed (its FAIL written, its slot
/// lingering for the last CURSOR) frees the slot at once: its initiator will read no more
/// records, so no CURSOR would ever count that FAIL. A cancel with another token frees nothing.
#[test]
fn a_cancel_of_a_closed_one_way_flow_frees_its_lingering_slot() {
    let (mut ep, reclaimed) = ended_one_way_flow();
    let _ = ep.handle_msg(reclaimed, INI, Msg::cancel(XferId(3), FORGED, Vec::new()));
    drain(&mut ep);
    assert_eq!(ep.answering_slots_held(), 1, "a forged cancel frees nothing");
    ep.handle_msg(reclaimed, INI, Msg::cancel(XferId(3), token(3), Vec::new())).unwrap();
    assert!(drain(&mut ep).is_empty());
    assert_eq!(ep.answering_slots_held(), 0, "freed with the cancel");
    assert!(!ep.answering.holds(INI));
    // A late CURSOR is harmless, and a replayed WANT still opens nothing.
    let cursor = Msg::Cursor(wire::Cursor { xfer: XferId(3), token: token(3), consumed: 1 });
    let _ = ep.handle_msg(reclaimed, INI, cursor);
    assert_eq!(ep.answering_slots_held(), 0);
}

/// A slot whose FAIL is never reported read frees at the first timeout after its linger, with
/// no WANT waiting for it: its initiator's name is then free to be forgotten.
#[test]
fn a_lingering_slot_frees_at_a_timeout_after_its_linger_with_nothing_waiting() {
    let (mut ep, reclaimed) = ended_one_way_flow();
    ep.handle_timeout(reclaimed + TIMEOUT - Duration::from_millis(1));
    assert_eq!(ep.answering_slots_held(), 1, "not before the linger ends");
    ep.handle_timeout(reclaimed + TIMEOUT);
    assert_eq!(ep.answering_slots_held(), 0);
    assert!(!ep.answering.holds(INI));
}

/// A WANT replayed for a one-way flow that ended (its slot lingering for the last CURSOR) opens
/// nothing: the receiver would grant regions whose answers no slot could carry.
#[test]
fn a_want_replayed_after_its_one_way_flow_ended_opens_nothing() {
    let (mut ep, reclaimed) = ended_one_way_flow();
    assert_eq!(ep.handle_msg(reclaimed, INI, one_way_want(3)), Ok(()));
    let acts = drain(&mut ep);
    assert_eq!(ep.remote_flows(), 0, "no flow reopened: {acts:?}");
    assert!(acts.is_empty(), "nothing answered: {acts:?}");
}

/// A peer that said GOODBYE, or that the liveness probe declared dead, reads nothing more:
/// its slots free at once, as a lost peer's, not after their FAILs linger out. Every record it
/// had not reported read is overwritten first (with a FAIL): one declared dead may only have
/// stalled, and must not take a GRANT left there once its region went to another flow.
#[test]
fn a_peer_that_says_goodbye_or_is_declared_dead_frees_its_slots_at_once() {
    type Leave = fn(&mut Endpoint, Instant);
    let gone: [(&str, Leave); 2] = [
        ("goodbye", |ep, t| ep.handle_goodbye(t, INI)),
        ("declared dead", |ep, t| {
            ep.declare_dead(t, INI, XferError::Unresponsive);
            ep.pump(t); // as every caller does
        }),
    ];
    for (how, leave) in gone {
        let (mut ep, t) = target();
        let unread: u64 = fill_the_cap(&mut ep, t).values().sum();
        assert!(unread > 0, "GRANTs written, none read");
        leave(&mut ep, t);
        let acts = drain(&mut ep);
        let overwritten = acts.iter().filter(|a| matches!(a, Action::PutRecord { .. }) && !clears(a)).count() as u64;
        assert_eq!(overwritten, unread, "{how}: every unread record overwritten");
        assert_eq!((ep.remote_flows(), ep.answering_slots_held()), (0, 0), "{how}");
    }
}

/// A waiter holds its further WANTs whole, so they are charged by their bytes, not only by
/// their chunks: one-chunk WANTs each dragging a 64 KiB endpoint fill the peer's share of the
/// queue after 32 MiB of them, where counting chunks alone took 2^20 of them (64 GiB).
#[test]
fn a_waiters_held_wants_are_charged_by_their_bytes() {
    use crate::oneway::{HELD_BYTES_PER_UNIT, WAITING_UNITS_PER_PEER};
    let (mut ep, t) = target();
    fill_the_cap(&mut ep, t);
    ep.handle_msg(t, INI, one_way_want(CAP)).unwrap();
    let Msg::Want(mut heavy) = one_way_want(CAP) else { unreachable!() };
    heavy.endpoint = vec![0xee; 64 * KIB as usize];
    let mut held = 0u64;
    let refused = loop {
        match ep.handle_msg(t, INI, Msg::Want(heavy.clone())) {
            Ok(()) => held += 1,
            Err(e) => break e,
        }
        assert!(held < 1024, "still held after {held} WANTs of 64 KiB");
    };
    assert_eq!(refused, ProtocolError::NoMailboxSlot { peer: INI, xfer: XferId(CAP) });
    let bound = WAITING_UNITS_PER_PEER * HELD_BYTES_PER_UNIT;
    assert!(held * 64 * KIB <= bound && (held + 2) * 64 * KIB > bound, "{held} held against a {bound}-byte bound");
    // The whole transfer left the queue (opened without those chunks it could only time out),
    // and with it every byte it held.
    assert_eq!((ep.answering.waiting(), ep.answering.held_units()), (0, 0));
}

#[test]
fn a_waiter_leaves_on_cancel_on_timeout_and_with_its_peer() {
    for how in ["cancel", "timeout", "peer lost"] {
        let (mut ep, t) = target();
        let mut written = fill_the_cap(&mut ep, t);
        ep.handle_msg(t, INI, one_way_want(CAP)).unwrap();
        assert_eq!(ep.answering.waiting(), 1);
        let refused = match how {
            "cancel" => {
                ep.handle_msg(t, INI, Msg::cancel(XferId(CAP), token(CAP), Vec::new())).unwrap();
                0
            }
            "timeout" => {
                // Nothing frees a slot; its initiator's timeout passes: it is dropped, counted.
                ep.handle_timeout(t + TIMEOUT - Duration::from_millis(1));
                assert_eq!(ep.answering.waiting(), 1, "not before its deadline");
                ep.handle_timeout(t + TIMEOUT);
                1
            }
            _ => {
                ep.handle_peer_lost(t, INI);
                0
            }
        };
        drain(&mut ep);
        assert_eq!(ep.answering.waiting(), 0, "{how}");
        assert_eq!(ep.stats().one_way_refused, refused, "{how}");
        if how == "cancel" {
            // A freed slot opens nothing for it.
            let acts = end_flow(&mut ep, t, 0, &mut written);
            assert!(records_of(&acts, CAP).is_empty(), "{how}: {acts:?}");
            assert!(!ep.answering.is_one_way(FlowKey { peer: INI, xfer: XferId(CAP) }));
        }
    }
}

#[test]
fn a_flood_of_valid_wants_stops_at_the_queues_bounds_and_forgeries_never_enter() {
    let (mut ep, t) = target();
    // Five hostile peers with valid proofs, each sending its share of slots plus its share of
    // the queue plus more.
    let per_peer = CAP as usize + WAITING_PER_PEER + 16;
    let peers = 5;
    for p in 1..=peers {
        for x in 0..per_peer as u64 {
            let _ = ep.handle_msg(t, PeerId(p), one_way_want(x));
        }
        drain(&mut ep);
        assert!(ep.answering.waiting() <= WAITING_TOTAL);
    }
    let s = ep.stats().clone();
    let sent = (peers as usize * per_peer) as u64;
    let held = u64::from(ep.answering_slots_held());
    assert!(held <= u64::from(MAILBOX_SLOTS));
    assert_eq!(ep.answering.waiting(), WAITING_TOTAL, "the queue fills to its total bound");
    assert_eq!(s.one_way_queued, WAITING_TOTAL as u64);
    assert_eq!(s.one_way_answered + s.one_way_queued + s.one_way_refused, sent, "every WANT is accounted once");
    // Forgeries find the queue full too, but are refused as forgeries, never counted as queued.
    let before = (ep.answering.waiting(), ep.stats().one_way_queued, ep.stats().control_forged);
    for x in 0..100 {
        let r = ep.handle_msg(t, PeerId(9), forged_want(x));
        assert!(matches!(r, Err(ProtocolError::BadProof { .. })), "{r:?}");
    }
    assert_eq!((ep.answering.waiting(), ep.stats().one_way_queued), (before.0, before.1));
    assert_eq!(ep.stats().control_forged, before.2 + 100);
}

#[test]
fn one_peers_waiters_stop_at_its_share_of_the_queue() {
    let (mut ep, t) = target();
    fill_the_cap(&mut ep, t);
    for x in CAP..CAP + WAITING_PER_PEER as u64 + 5 {
        let _ = ep.handle_msg(t, INI, one_way_want(x));
    }
    assert_eq!(ep.answering.waiting(), WAITING_PER_PEER);
    assert_eq!((ep.stats().one_way_queued, ep.stats().one_way_refused), (WAITING_PER_PEER as u64, 5));
    // A forgery at a peer with slots free never takes one either (as before the queue).
    let (mut ep, t) = target();
    let r = ep.handle_msg(t, INI, forged_want(1));
    assert!(matches!(r, Err(ProtocolError::BadProof { .. })), "{r:?}");
    assert_eq!((ep.answering_slots_held(), ep.answering.waiting()), (0, 0));
}

/// Plans of two 1 KiB chunks each (a READ of them comes as two PULLs, the second held while
/// the transfer waits for a slot): transfer `k` moves two 1 KiB descriptors from `from + k*4K`
/// (and + 2K) to `to + k*4K` (and + 2K), leaving 1 KiB gaps between destinations.
fn gapped_plan(k: u64, from: u64, to: u64) -> Plan {
    let descs: Vec<DescPair> = [0, 2 * KIB]
        .iter()
        .map(|&o| DescPair { src: from + k * CHUNK + o, dst: to + k * CHUNK + o, len: KIB })
        .collect();
    let mut p = plan::plan(&descs, PlanParams::new(KIB)).unwrap();
    assert_eq!(p.chunks.len(), 2);
    p.dests = vec![crate::proof::Destination { reg: REG, key: KEY }];
    p
}

fn pattern(k: u64, i: u64) -> u8 {
    (i as u8).wrapping_mul(13).wrapping_add(k as u8).wrapping_add(1)
}

/// More one-way transfers in flight from one initiator than its share of the target's slots,
/// WRITEs then READs: every one completes, byte-exact, through slots freed by the others;
/// the bytes between destinations stay untouched; none is dropped.
#[test]
fn more_one_way_transfers_than_a_peers_slot_cap_all_complete_byte_exact() {
    let n = CAP + 16;
    for read in [false, true] {
        let mut p = Pair::new(16 * KIB, 2, false);
        p.eps[1].keep_mailbox(true);
        let m = p.eps[1].one_way_layout().mailbox;
        let layout = crate::mailbox::MailboxLayout { slots: m.slots, ring: m.ring };
        // Sources in the source side's memory: the initiator's for a WRITE, the target's for a READ.
        let (src_side, dst_side) = if read { (1, 0) } else { (0, 1) };
        let (from, to) = if read { (DST, SRC) } else { (SRC, DST) };
        for k in 0..n {
            for i in 0..CHUNK {
                p.mem[src_side].insert(from + k * CHUNK + i, pattern(k, i));
            }
        }
        for k in 0..n {
            let now = p.now;
            let (xfer, plan) = (XferId(k), gapped_plan(k, from, to));
            let r = if read {
                p.eps[0].submit_read(now, xfer, token(k), PeerId(1), plan, Some(layout))
            } else {
                p.eps[0].submit_one_way(now, xfer, token(k), PeerId(1), plan, layout)
            };
            r.unwrap();
        }
        p.run();
        let mut done = p.done.clone();
        done.sort_by_key(|d| d.1);
        let want: Vec<_> = (0..n).map(|k| (0, XferId(k), Ok(()))).collect();
        assert_eq!(done, want, "read={read}");
        for k in 0..n {
            for i in 0..CHUNK {
                let got = p.mem[dst_side].get(&(to + k * CHUNK + i)).copied();
                let moved = i < KIB || (2 * KIB..3 * KIB).contains(&i);
                let expect = moved.then(|| pattern(k, i));
                assert_eq!(got, expect, "read={read} transfer {k} byte {i}");
            }
        }
        let (ini, tgt) = (p.eps[0].stats(), p.eps[1].stats());
        assert!(tgt.one_way_queued >= n - CAP, "read={read}: {} queued", tgt.one_way_queued);
        assert_eq!((tgt.one_way_answered, tgt.one_way_refused, ini.one_way_sent), (n, 0, n), "read={read}");
        assert!(p.eps[0].is_idle() && p.eps[1].is_idle());
        assert_eq!((p.eps[1].answering_slots_held(), p.eps[1].answering.waiting()), (0, 0));
    }
}

/// A slot whose initiator never reports its last record read frees after the linger: the
/// endpoint asks to be woken then, and the waiter opens at that wake-up.
#[test]
fn a_waiter_opens_when_a_closed_slot_lingers_out() {
    let (mut ep, t) = target();
    fill_the_cap(&mut ep, t);
    // The initiator goes silent: its flows are reclaimed (a FAIL each) and, with no CURSOR
    // ever coming, their slots linger. (A cancel would free its slot at once.)
    let reclaimed = reclaim_by_idle_timer(&mut ep);
    assert_eq!((ep.remote_flows(), ep.answering_slots_held()), (0, CAP as u32), "reclaimed, lingering");
    let later = reclaimed + Duration::from_millis(1);
    ep.handle_msg(later, INI, one_way_want(CAP)).unwrap();
    assert_eq!(ep.answering.waiting(), 1);
    let wake = ep.poll_timeout().expect("a wake-up");
    assert!(wake <= reclaimed + TIMEOUT, "woken by the linger's end at the latest");
    ep.handle_timeout(reclaimed + TIMEOUT);
    drain(&mut ep);
    assert!(ep.answering.is_one_way(FlowKey { peer: INI, xfer: XferId(CAP) }), "opened at the linger's end");
    assert_eq!((ep.answering.waiting(), ep.stats().one_way_refused), (0, 0));
}

/// A one-way READ counts all the chunks its PULLs will bring, not only the first PULL's: when
/// its flow is reclaimed after chunk 0 was served but before the second PULL came (its
/// initiator stalled), the mailbox gets a FAIL, so the initiator fails now instead of at its
/// own timeout.
#[test]
fn a_one_way_read_reclaimed_between_its_pulls_is_answered_fail() {
    use crate::mailbox::{Answer, Record, RecordKey};
    let (mut ep, t) = target();
    let (xfer, tok) = (5, token(5));
    let run = CopyRun { region_off: 0, addr: DST, len: CHUNK, count: 1, region_stride: 0, addr_stride: 0 };
    let pull = wire::Pull {
        arena: ArenaId(0),
        xfer: XferId(xfer),
        token: tok,
        first: ChunkIdx(0),
        total: 2,
        endpoint: wire::REPLY_MAILBOX.to_vec(),
        chunks: vec![wire::PullChunk { bytes: CHUNK, runs: vec![run].into() }],
        proofs: vec![crate::proof::prove(REG, &KEY, tok, XferId(xfer))],
    };
    ep.handle_msg(t, INI, Msg::Pull(pull)).unwrap();
    let job = drain(&mut ep)
        .into_iter()
        .find_map(|a| if let Action::Gather { job, .. } = a { Some(job) } else { None })
        .expect("chunk 0 gathered");
    ep.handle_gather_done(t, job, true);
    let key = RecordKey::derive(&crate::oneway::record_token(tok));
    let answers = |acts: &[Action]| -> Vec<Answer> {
        records_of(acts, xfer).iter().map(|(_, b)| Record::decode(b, &key).expect("a valid record").answer).collect()
    };
    let ready = answers(&drain(&mut ep));
    let [Answer::Grant(credit) | Answer::Ready(credit)] = ready[..] else { panic!("{ready:?}") };
    let release = wire::Release { xfer: XferId(xfer), token: tok, chunk: credit.chunk, region: credit.region };
    ep.handle_msg(t, INI, Msg::Release(release)).unwrap();
    assert!(answers(&drain(&mut ep)).is_empty(), "chunk 1 is still to come: no end yet");
    ep.handle_timeout(t + Duration::from_secs(600));
    let end = answers(&drain(&mut ep));
    assert!(matches!(end[..], [Answer::Fail(_)]), "{end:?}");
}

/// `one_way_want(xfer)` without its proof, edited by `edit`.
fn proofless_want(xfer: u64, edit: fn(&mut Want)) -> Msg {
    let Msg::Want(mut w) = one_way_want(xfer) else { unreachable!() };
    w.proofs.clear();
    edit(&mut w);
    Msg::Want(w)
}

/// A one-way PULL of one 4 KiB chunk into `arena`, proving nothing.
fn proofless_pull(xfer: u64, arena: u8) -> Msg {
    let run = CopyRun { region_off: 0, addr: DST, len: CHUNK, count: 1, region_stride: 0, addr_stride: 0 };
    Msg::Pull(wire::Pull {
        xfer: XferId(xfer),
        token: token(xfer),
        arena: ArenaId(arena),
        first: ChunkIdx(0),
        total: 1,
        endpoint: wire::REPLY_MAILBOX.to_vec(),
        chunks: vec![wire::PullChunk { bytes: CHUNK, runs: Arc::new(vec![run]) }],
        proofs: Vec::new(),
    })
}

/// A one-way WANT or PULL that proves nothing is a forgery whatever else it asks: the
/// refusals the receiver answers before it reads proofs (a standing WANT, an arena we lack,
/// shutting down) must not open a slot for their answer, or keyless names sending such frames
/// would pin every mailbox slot for a full timeout each.
#[test]
fn proofless_one_way_frames_refused_before_their_proofs_are_read_take_no_slot_and_get_no_answer() {
    type Frame = fn(u64) -> Msg;
    let cases: [(&str, Frame); 5] = [
        ("standing", |x| proofless_want(x, |w| w.standing = wire::Standing::Open)),
        ("no such arena", |x| proofless_want(x, |w| w.arena = ArenaId(15))),
        ("plain", |x| proofless_want(x, |_| ())),
        ("PULL, no such arena", |x| proofless_pull(x, 15)),
        ("PULL", |x| proofless_pull(x, 0)),
    ];
    for shutting_down in [false, true] {
        for (what, frame) in &cases {
            let (mut ep, t) = target();
            if shutting_down {
                ep.shutdown(t);
                drain(&mut ep);
            }
            // Under many names, more frames than the mailbox has slots.
            for x in 0..MAILBOX_SLOTS as u64 + 8 {
                let r = ep.handle_msg(t, PeerId(1 + x % 8), frame(x));
                assert!(matches!(r, Err(ProtocolError::BadProof { .. })), "{what}: {r:?}");
            }
            let acts = drain(&mut ep);
            assert!(acts.is_empty(), "{what} (shutting down: {shutting_down}) got answers: {acts:?}");
            assert_eq!((ep.answering_slots_held(), ep.answering.waiting(), ep.remote_flows()), (0, 0, 0), "{what}");
            assert_eq!(ep.stats().control_forged, MAILBOX_SLOTS as u64 + 8, "{what}");
        }
    }
    // A genuine WANT still gets its slot and its GRANT record.
    let (mut ep, t) = target();
    ep.handle_msg(t, INI, one_way_want(1)).unwrap();
    assert_eq!((ep.answering_slots_held(), records_of(&drain(&mut ep), 1).len()), (1, 1));
}

/// One-way WANTs with forged proofs under ever new names are refused before any name is given
/// an id (each would use one up for good: 2^32 - 2^24 of them closed one-way admission until a
/// restart), counted as forged; a genuine one under a new name is still admitted.
#[test]
fn forged_one_way_wants_under_invented_names_take_no_id() {
    let (mut ep, t) = target();
    for i in 0..2000u64 {
        let name = format!("junk{i}");
        let r = ep.handle_frame(t, &name, &frame(7, forged_want(i + 1)));
        assert!(matches!(r, Err(FrameRefused::Protocol(ProtocolError::BadProof { .. }))), "{r:?}");
        assert!(ep.peers().lookup(&name).is_none(), "{name} was given an id");
    }
    assert_eq!((ep.stats().control_forged, ep.remote_flows()), (2000, 0));
    let Msg::Want(mut w) = one_way_want(9) else { unreachable!() };
    w.token = TOKEN;
    w.proofs = vec![proof_by("honest", 9)];
    ep.handle_frame(t, "honest", &frame(7, Msg::Want(w))).unwrap();
    assert!(ep.peers().lookup("honest").is_some());
    assert_eq!(ep.remote_flows(), 1);
}
