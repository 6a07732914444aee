//! The standing credit ([`wire::Standing`], issue 12): a sender keeps one region of each
//! peer's arena granted ahead of its transfers, and a transfer's chunk 0 claims it with no
//! WANT -> GRANT round trip. Both ends, the lease, the refusals and the forgeries.

use super::*;
use crate::sender::STANDING_XFER_BIT;
use crate::wire::Standing;

/// Standing credits of one chunk, on both ends.
fn standing_endpoint(arena: u64, eager: bool) -> (Endpoint, Instant) {
    let now = Instant::now();
    let cfg = Config { standing_bytes: CHUNK, ..config(arena, 2, eager) };
    let mut ep = Endpoint::new(&cfg, now, PROBE_KEY).unwrap();
    ep.add_registered(REG, KEY, (DST, 64 * KIB), ArenaId(0));
    (ep, now)
}

/// The standing flow a peer opens: `xfer` with the bit, one `bytes` chunk, no proofs.
fn open_msg(xfer: u64, bytes: u64) -> Msg {
    Msg::Want(Want {
        arena: ArenaId(0),
        xfer: XferId(STANDING_XFER_BIT | xfer),
        token: Token(0x57a4d),
        endpoint: Vec::new(),
        chunks: vec![bytes],
        proofs: Vec::new(),
        inline: None,
        standing: Standing::Open,
    })
}

/// Transfer `xfer`'s WANT of `chunks` whose chunk 0 claims standing flow `standing` with
/// `token`.
fn claim_msg(xfer: XferId, chunks: &[u64], standing: u64, token: Token) -> Msg {
    let Msg::Want(mut w) = want_msg(xfer, chunks) else { unreachable!() };
    w.standing = Standing::Claim { xfer: XferId(STANDING_XFER_BIT | standing), token };
    Msg::Want(w)
}

fn grants(acts: &[Action]) -> Vec<(XferId, Vec<(u32, Region)>)> {
    msgs(acts)
        .into_iter()
        .filter_map(|(_, m)| match m {
            Msg::Grant(g) => Some((g.xfer, g.credits.iter().map(|c| (c.chunk.0, c.region)).collect())),
            _ => None,
        })
        .collect()
}

fn refusals(acts: &[Action]) -> Vec<XferId> {
    msgs(acts)
        .into_iter()
        .filter_map(|(_, m)| match m {
            Msg::Ack(a) if a.status == AckStatus::Refused => Some(a.xfer),
            _ => None,
        })
        .collect()
}

/// A receiver holding `PEER`'s standing flow 1, granted: returns its region.
fn with_standing(ep: &mut Endpoint, t: Instant) -> Region {
    ep.handle_msg(t, PEER, open_msg(1, CHUNK)).unwrap();
    let g = grants(&drain(ep));
    assert_eq!(g.len(), 1, "the standing flow is granted like any flow: {g:?}");
    assert_eq!(ep.receiver().standing_flow(PEER), Some(XferId(STANDING_XFER_BIT | 1)));
    g[0].1[0].1
}

#[test]
fn a_claim_takes_the_standing_region_for_chunk_0_with_no_grant_and_its_scatter_gives_it_back() {
    let (mut ep, t) = standing_endpoint(32 * KIB, false);
    let r1 = with_standing(&mut ep, t);
    let s = FlowKey { peer: PEER, xfer: XferId(STANDING_XFER_BIT | 1) };
    assert!(ep.is_quiet());
    ep.handle_msg(t, PEER, claim_msg(X, &[CHUNK, CHUNK], 1, Token(0x57a4d))).unwrap();
    let acts = drain(&mut ep);
    assert!(!ep.is_quiet(), "the claiming transfer's flow waits for its DATA");
    // Chunk 1 is granted as usual; chunk 0 never is: it holds the standing region already,
    // and the standing flow waits for it back (no fresh grant, no frame more).
    assert_eq!(grants(&acts).iter().map(|(x, c)| (*x, c.len(), c[0].0)).collect::<Vec<_>>(), vec![(X, 1, 1)]);
    assert_eq!(ep.scheduler().idle_held(FlowKey { peer: PEER, xfer: X }).map(|g| g.region), Some(r1));
    assert!(!ep.scheduler().has_flow(s));
    assert_eq!(ep.stats().standing_taken, 1);
    // The chunk's DATA names the standing region, and is scattered from it; the ACK says the
    // region is the standing flow's again.
    ep.handle_msg(t, PEER, data_msg(X, 0, r1, vec![run(0, DST, CHUNK)])).unwrap();
    let sc = scatters(&drain(&mut ep));
    assert_eq!(sc.iter().map(|s| s.1).collect::<Vec<_>>(), vec![r1]);
    ep.handle_scatter_done(t, sc[0].0, true);
    assert_eq!(acks(&drain(&mut ep)), vec![(X, 0, AckStatus::Kept)]);
    assert_eq!(ep.scheduler().idle_held(s).map(|g| g.region), Some(r1));
    assert_eq!(ep.stats().standing_kept, 1);
    check(&ep);
}

#[test]
fn a_replayed_claim_and_its_data_are_refused_and_scatter_nothing() {
    let (mut ep, t) = standing_endpoint(32 * KIB, false);
    let r1 = with_standing(&mut ep, t);
    let claim = claim_msg(X, &[CHUNK], 1, Token(0x57a4d));
    let data = data_msg(X, 0, r1, vec![run(0, DST, CHUNK)]);
    ep.handle_msg(t, PEER, claim.clone()).unwrap();
    ep.handle_msg(t, PEER, data.clone()).unwrap();
    let sc = scatters(&drain(&mut ep));
    ep.handle_scatter_done(t, sc[0].0, true);
    assert_eq!(acks(&drain(&mut ep)), vec![(X, 0, AckStatus::Kept)]);
    // The same two frames again (the region is the standing flow's again, same offset): the
    // transfer ended here, so its WANT is a replay, ignored with no answer.
    let r = ep.handle_msg(t, PEER, claim);
    assert!(matches!(r, Err(ProtocolError::Replayed { .. })), "{r:?}");
    assert!(refusals(&drain(&mut ep)).is_empty());
    let _ = ep.handle_msg(t, PEER, data);
    assert!(scatters(&drain(&mut ep)).is_empty(), "a replayed DATA scatters nothing");
    let s = FlowKey { peer: PEER, xfer: XferId(STANDING_XFER_BIT | 1) };
    assert_eq!(ep.scheduler().idle_held(s).map(|g| g.region), Some(r1), "the region stays with the standing flow");
    check(&ep);
}

#[test]
fn a_claimed_chunk_whose_scatter_fails_or_whose_flow_ends_first_gets_the_standing_flow_a_fresh_region() {
    for ending in ["failed scatter", "cancel"] {
        let (mut ep, t) = standing_endpoint(32 * KIB, false);
        let r1 = with_standing(&mut ep, t);
        let s = XferId(STANDING_XFER_BIT | 1);
        ep.handle_msg(t, PEER, claim_msg(X, &[CHUNK], 1, Token(0x57a4d))).unwrap();
        drain(&mut ep);
        if ending == "cancel" {
            let Msg::Want(mut cancel) = want_msg(X, &[]) else { unreachable!() };
            cancel.proofs.clear();
            ep.handle_msg(t, PEER, Msg::Want(cancel)).unwrap();
        } else {
            ep.handle_msg(t, PEER, data_msg(X, 0, r1, vec![run(0, DST, CHUNK)])).unwrap();
            let sc = scatters(&drain(&mut ep));
            ep.handle_scatter_done(t, sc[0].0, false);
        }
        let acts = drain(&mut ep);
        let fresh: Vec<XferId> = grants(&acts).into_iter().map(|(x, _)| x).collect();
        assert_eq!(fresh, vec![s], "{ending}: the standing flow is granted again");
        if ending != "cancel" {
            assert_eq!(acks(&acts), vec![(X, 0, AckStatus::Failed)]);
        }
        assert_eq!(ep.stats().standing_kept, 0);
        check(&ep);
    }
}

#[test]
fn claims_forged_stale_or_too_large_change_nothing_or_are_refused() {
    let (mut ep, t) = standing_endpoint(32 * KIB, false);
    let free = ep.arena_free_bytes();
    // No standing flow yet: the claim is refused, so its sender fails at once.
    let r = ep.handle_msg(t, PEER, claim_msg(X, &[CHUNK], 1, Token(0x57a4d)));
    assert!(matches!(r, Err(ProtocolError::BadClaim { .. })), "{r:?}");
    assert_eq!(refusals(&drain(&mut ep)), vec![X]);
    let r1 = with_standing(&mut ep, t);
    let held = ep.arena_free_bytes();
    assert_eq!(held, free - r1.len);
    // The standing flow's token is the proof of the claim: a forger gets no answer.
    let forged_before = ep.stats().control_forged;
    let r = ep.handle_msg(t, PEER, claim_msg(XferId(2), &[CHUNK], 1, FORGED));
    assert!(matches!(r, Err(ProtocolError::WrongToken { .. })), "{r:?}");
    assert!(drain(&mut ep).is_empty(), "a forgery makes the receiver act");
    assert_eq!(ep.stats().control_forged, forged_before + 1);
    // Another peer cannot claim it: it has no standing flow here.
    let r = ep.handle_msg(t, PeerId(9), claim_msg(XferId(3), &[CHUNK], 1, Token(0x57a4d)));
    assert!(matches!(r, Err(ProtocolError::BadClaim { .. })), "{r:?}");
    assert_eq!(refusals(&drain(&mut ep)), vec![XferId(3)]);
    // A chunk larger than the region is refused; the region stays the standing flow's.
    let r = ep.handle_msg(t, PEER, claim_msg(XferId(4), &[2 * CHUNK], 1, Token(0x57a4d)));
    assert!(r.is_err(), "{r:?}");
    assert_eq!(refusals(&drain(&mut ep)), vec![XferId(4)]);
    assert_eq!((ep.arena_free_bytes(), ep.remote_flows()), (held, 1));
    // The standing flow takes no DATA of its own: it proved no registration.
    let s = XferId(STANDING_XFER_BIT | 1);
    let data = Msg::Data(Data {
        xfer: s,
        token: Token(0x57a4d),
        chunk: ChunkIdx(0),
        region: r1,
        runs: vec![run(0, DST, CHUNK)],
        region_plan_runs: 0,
    });
    assert!(ep.handle_msg(t, PEER, data).is_err());
    let acts = drain(&mut ep);
    assert!(scatters(&acts).is_empty(), "nothing scattered from a standing region: {acts:?}");
    assert_eq!(ep.receiver().standing_flow(PEER), None, "and the flow is reclaimed");
    // Its region rests: its honest owner may be writing a claimed chunk into it right now.
    assert_eq!(ep.arena_free_bytes() + ep.arena_quarantined_bytes(), free);
    ep.handle_timeout(t + TIMEOUT / 4);
    assert_eq!(ep.arena_free_bytes(), free);
    check(&ep);
}

#[test]
fn a_receiver_gives_one_standing_flow_per_peer_within_an_eighth_of_its_arena() {
    let (mut ep, t) = standing_endpoint(64 * KIB, false);
    // An eighth of 64 KiB: two 4 KiB standing flows, from two peers.
    ep.handle_msg(t, PEER, open_msg(1, CHUNK)).unwrap();
    ep.handle_msg(t, PEER, open_msg(2, CHUNK)).unwrap();
    assert_eq!(refusals(&drain(&mut ep)), vec![XferId(STANDING_XFER_BIT | 2)], "one per peer");
    ep.handle_msg(t, PeerId(8), open_msg(1, CHUNK)).unwrap();
    ep.handle_msg(t, PeerId(9), open_msg(1, CHUNK)).unwrap();
    let acts = drain(&mut ep);
    assert_eq!(refusals(&acts), vec![XferId(STANDING_XFER_BIT | 1)], "the third goes over the share");
    assert_eq!(ep.stats().standing_opened, 2);
    assert_eq!(ep.stats().standing_refused, 2);
    // More than this receiver gives, or chunks added later, are refused too.
    ep.handle_msg(t, PeerId(10), open_msg(1, 2 * CHUNK)).unwrap();
    assert_eq!(refusals(&drain(&mut ep)), vec![XferId(STANDING_XFER_BIT | 1)]);
    let more = want_msg(XferId(STANDING_XFER_BIT | 1), &[CHUNK]);
    let Msg::Want(mut more) = more else { unreachable!() };
    more.token = Token(0x57a4d);
    assert!(matches!(ep.handle_msg(t, PEER, Msg::Want(more)), Err(ProtocolError::StandingWant { .. })));
    check(&ep);
}

/// Review 61 (credits, L2): the standing share counts the blocks the regions take, not the
/// bytes asked. Standing flows of one byte each took a 1 KiB block each while counting one
/// byte: 64 peers held all 64 blocks of the arena, eight times the share.
#[test]
fn standing_flows_of_one_byte_count_their_blocks_against_the_share() {
    let (mut ep, t) = standing_endpoint(64 * KIB, false);
    for peer in 0..64 {
        ep.handle_msg(t, PeerId(100 + peer), open_msg(1, 1)).unwrap();
    }
    drain(&mut ep);
    // An eighth of 64 KiB: eight blocks of 1 KiB.
    assert_eq!(ep.stats().standing_opened, 8, "{:?}", ep.stats());
    assert!(
        64 * KIB - ep.arena_free_bytes() <= 8 * KIB,
        "standing regions hold {} bytes",
        64 * KIB - ep.arena_free_bytes()
    );
    check(&ep);
}

#[test]
fn an_unclaimed_standing_region_is_reclaimed_after_the_idle_timeout_and_neither_probed_nor_polled_for_before() {
    let (mut ep, t) = standing_endpoint(32 * KIB, false);
    let free = ep.arena_free_bytes();
    with_standing(&mut ep, t);
    let mut waited = std::collections::BTreeSet::new();
    ep.receiver().peers_waited_on(&mut waited);
    assert!(waited.is_empty(), "a standing flow alone is not a reason to probe its peer");
    // Nor to poll closely: it waits for nothing but its lease, a timer.
    assert!(ep.is_quiet() && !ep.is_idle(), "quiet, not idle: the flow still holds its region");
    assert_eq!(ep.poll_timeout(), Some(t + TIMEOUT / 2));
    ep.handle_timeout(t + TIMEOUT / 4);
    assert_eq!(ep.receiver().standing_flow(PEER), Some(XferId(STANDING_XFER_BIT | 1)));
    let lease_end = t + TIMEOUT / 2 + Duration::from_millis(1);
    ep.handle_timeout(lease_end);
    assert_eq!(ep.receiver().standing_flow(PEER), None);
    // A claim may have crossed the lease's end: the region rests before anyone else gets it.
    assert_eq!(ep.arena_free_bytes() + ep.arena_quarantined_bytes(), free);
    assert_eq!(ep.poll_timeout(), Some(lease_end + TIMEOUT / 4));
    ep.handle_timeout(lease_end + TIMEOUT / 4);
    assert_eq!(ep.arena_free_bytes(), free);
    check(&ep);
}

/// A sender with standing credits, its first transfer submitted (that opens the standing
/// flow) and the standing GRANT fed: returns the standing id, its token and region.
fn sender_with_standing(eager: bool) -> (Endpoint, Instant, XferId, Token, Region) {
    let (mut ep, t) = standing_endpoint(32 * KIB, eager);
    ep.submit(t, X, TOKEN, PEER, plan_of(1)).unwrap();
    let sent = msgs(&drain(&mut ep));
    let opens: Vec<&Want> = sent
        .iter()
        .filter_map(|(_, m)| match m {
            Msg::Want(w) if w.standing == Standing::Open => Some(w),
            _ => None,
        })
        .collect();
    assert_eq!(opens.len(), 1, "{sent:?}");
    let (s, token) = (opens[0].xfer, opens[0].token);
    assert_ne!(token, TOKEN, "the standing flow has a token of its own");
    let region = Region { offset: 16 * KIB, len: CHUNK };
    let grant = Msg::Grant(Grant { xfer: s, token, credits: vec![Credit { chunk: ChunkIdx(0), region }] });
    ep.handle_msg(t, PEER, grant).unwrap();
    (ep, t, s, token, region)
}

#[test]
fn a_senders_next_write_claims_its_standing_region_and_writes_chunk_0_at_once() {
    for eager in [false, true] {
        let (mut ep, t, s, token, region) = sender_with_standing(eager);
        ep.submit(t, XferId(2), TOKEN, PEER, plan_of(1)).unwrap();
        let acts = drain(&mut ep);
        let claims: Vec<Standing> = msgs(&acts)
            .iter()
            .filter_map(|(_, m)| if let Msg::Want(w) = m { Some(w.standing) } else { None })
            .collect();
        assert_eq!(claims, vec![Standing::Claim { xfer: s, token }], "one claim, and no second open");
        // Chunk 0 is gathered with its credit already there, and written into the region.
        let g = gathers(&acts);
        assert_eq!(g.len(), 1, "{acts:?}");
        ep.handle_gather_done(t, g[0].0, true);
        let w = writes(&drain(&mut ep));
        assert_eq!(w.iter().map(|w| w.2).collect::<Vec<_>>(), vec![region]);
        assert_eq!(ep.stats().standing_claims, 1);
        // A third write before the region comes back goes the usual way.
        ep.submit(t, XferId(3), TOKEN, PEER, plan_of(1)).unwrap();
        let acts = drain(&mut ep);
        assert!(writes(&acts).is_empty(), "{acts:?}");
        assert_eq!(ep.stats().standing_claims, 1);
        // The second's ACK gives the region back: the fourth claims it with no GRANT at all.
        ep.handle_write_done(t, w[0].0, true);
        drain(&mut ep);
        ep.handle_msg(t, PEER, ack_msg(XferId(2), 0, region, AckStatus::Kept)).unwrap();
        assert_eq!(completes(&drain(&mut ep)), vec![(XferId(2), Ok(()))]);
        ep.submit(t, XferId(4), TOKEN, PEER, plan_of(1)).unwrap();
        let g = gathers(&drain(&mut ep));
        ep.handle_gather_done(t, g[0].0, true);
        let w = writes(&drain(&mut ep));
        assert_eq!(w.iter().map(|w| w.2).collect::<Vec<_>>(), vec![region]);
        assert_eq!(ep.stats().standing_claims, 2);
    }
}

#[test]
fn a_transfer_submitted_after_a_higher_one_claimed_does_not_claim_since_its_claim_would_be_refused() {
    let claims_of = |acts: &[Action]| -> Vec<(XferId, Standing)> {
        msgs(acts)
            .iter()
            .filter_map(|(_, m)| if let Msg::Want(w) = m { Some((w.xfer, w.standing)) } else { None })
            .collect()
    };
    let (mut ep, t, s, token, region) = sender_with_standing(false);
    // Transfer 5 reaches the core first (the shell numbers transfers at post, on the posting
    // thread, so two threads' transfers may arrive out of id order), claims and is done.
    ep.submit(t, XferId(5), TOKEN, PEER, plan_of(1)).unwrap();
    let acts = drain(&mut ep);
    assert_eq!(claims_of(&acts), vec![(XferId(5), Standing::Claim { xfer: s, token })]);
    ep.handle_gather_done(t, gathers(&acts)[0].0, true);
    let w = writes(&drain(&mut ep));
    ep.handle_write_done(t, w[0].0, true);
    drain(&mut ep);
    ep.handle_msg(t, PEER, ack_msg(XferId(5), 0, region, AckStatus::Kept)).unwrap();
    assert_eq!(completes(&drain(&mut ep)), vec![(XferId(5), Ok(()))]);
    // Transfer 3 comes now: the receiver would refuse its claim as a replay (at or below the
    // newest claim, 5), failing it for nothing. It asks for credits the usual way.
    ep.submit(t, XferId(3), TOKEN, PEER, plan_of(1)).unwrap();
    assert_eq!(claims_of(&drain(&mut ep)), vec![(XferId(3), Standing::None)]);
    // The region stays ours: the next transfer in order claims it.
    ep.submit(t, XferId(6), TOKEN, PEER, plan_of(1)).unwrap();
    assert_eq!(claims_of(&drain(&mut ep)), vec![(XferId(6), Standing::Claim { xfer: s, token })]);
    assert_eq!(ep.stats().standing_claims, 2);
}

#[test]
fn a_stale_standing_region_is_not_claimed_its_flow_is_canceled_and_a_new_one_opened() {
    let (mut ep, t, s, _, _) = sender_with_standing(false);
    ep.submit(t + TIMEOUT / 4, XferId(2), TOKEN, PEER, plan_of(1)).unwrap();
    let sent = msgs(&drain(&mut ep));
    let wants: Vec<(XferId, bool, Standing)> = sent
        .iter()
        .filter_map(|(_, m)| if let Msg::Want(w) = m { Some((w.xfer, w.is_cancel(), w.standing)) } else { None })
        .collect();
    let reopened = XferId(STANDING_XFER_BIT | 2);
    assert_eq!(
        wants,
        vec![(s, true, Standing::None), (XferId(2), false, Standing::None), (reopened, false, Standing::Open)]
    );
}

/// The WANTs among `acts`: `(xfer, is a cancel, standing)`.
fn wants_of(acts: &[Action]) -> Vec<(XferId, bool, Standing)> {
    msgs(acts)
        .iter()
        .filter_map(|(_, m)| if let Msg::Want(w) = m { Some((w.xfer, w.is_cancel(), w.standing)) } else { None })
        .collect()
}

/// A standing GRANT lost on the way (frames can be lost) left the slot awaiting it for the
/// peer's life: no later transfer claimed or reopened a standing credit there (review 52,
/// sender F3). Half a timeout after it was asked for, the next transfer cancels and reopens it.
#[test]
fn a_standing_flow_whose_grant_is_lost_is_asked_for_again() {
    let (mut ep, t) = standing_endpoint(32 * KIB, false);
    ep.submit(t, X, TOKEN, PEER, plan_of(1)).unwrap();
    let opened = wants_of(&drain(&mut ep));
    let s = XferId(STANDING_XFER_BIT | X.0);
    assert_eq!(opened, vec![(X, false, Standing::None), (s, false, Standing::Open)]);
    // Its GRANT never comes. Before half a timeout the flow is still awaited, not asked again.
    ep.submit(t + TIMEOUT / 2 - Duration::from_millis(1), XferId(2), TOKEN, PEER, plan_of(1)).unwrap();
    assert_eq!(wants_of(&drain(&mut ep)), vec![(XferId(2), false, Standing::None)]);
    // From half a timeout on, it is canceled there and opened afresh.
    ep.submit(t + TIMEOUT / 2, XferId(3), TOKEN, PEER, plan_of(1)).unwrap();
    let reopened = XferId(STANDING_XFER_BIT | 3);
    assert_eq!(
        wants_of(&drain(&mut ep)),
        vec![(s, true, Standing::None), (XferId(3), false, Standing::None), (reopened, false, Standing::Open)]
    );
}

/// A claimed region comes back with its claimer's ACK(Kept): while that claimer is in flight,
/// however long, the flow is not asked again (its write may still be on the way into the
/// region). Once it is gone with no region back, it is.
#[test]
fn a_claimed_standing_flow_is_asked_again_only_once_no_claimer_is_in_flight() {
    let (mut ep, t, s, token, _) = sender_with_standing(false);
    ep.submit(t, XferId(2), TOKEN, PEER, plan_of(1)).unwrap();
    assert_eq!(wants_of(&drain(&mut ep)), vec![(XferId(2), false, Standing::Claim { xfer: s, token })]);
    // Transfer 2 is still in flight (gathered, its write not done) half a timeout later.
    let late = t + TIMEOUT / 2;
    ep.submit(late, XferId(3), TOKEN, PEER, plan_of(1)).unwrap();
    assert_eq!(wants_of(&drain(&mut ep)), vec![(XferId(3), false, Standing::None)]);
    // Its ACK(Kept) never comes and it times out: its failure cancels the standing flow with
    // itself, and the next transfer opens a fresh one.
    ep.handle_timeout(t + TIMEOUT * 2);
    let _ = drain(&mut ep);
    ep.submit(t + TIMEOUT * 3, XferId(9), TOKEN, PEER, plan_of(1)).unwrap();
    let wants = wants_of(&drain(&mut ep));
    assert!(
        wants.iter().any(|&(_, cancel, st)| !cancel && st == Standing::Open),
        "a fresh standing flow is opened: {wants:?}"
    );
}

#[test]
fn a_failed_claimer_cancels_the_standing_flow_with_itself_after_its_write() {
    let (mut ep, t, s, token, region) = sender_with_standing(false);
    ep.submit(t, XferId(2), TOKEN, PEER, plan_of(1)).unwrap();
    let g = gathers(&drain(&mut ep));
    ep.handle_gather_done(t, g[0].0, true);
    let w = writes(&drain(&mut ep));
    // The receiver refuses the claimer while its write into the standing region is in flight.
    ep.handle_msg(t, PEER, ack_msg(XferId(2), 0, Region { offset: 0, len: 1 }, AckStatus::Refused)).unwrap();
    let acts = drain(&mut ep);
    assert_eq!(completes(&acts), vec![(XferId(2), Err(XferError::Refused))]);
    assert!(msgs(&acts).is_empty(), "no cancel while the write may land: {acts:?}");
    ep.handle_write_done(t, w[0].0, true);
    let cancels: Vec<(XferId, Token)> = msgs(&drain(&mut ep))
        .into_iter()
        .filter_map(|(_, m)| if let Msg::Want(w) = m { w.is_cancel().then_some((w.xfer, w.token)) } else { None })
        .collect();
    assert_eq!(cancels, vec![(XferId(2), TOKEN), (s, token)]);
    // A late GRANT of the old standing flow is quiet, and the next write opens a new one.
    let late = Msg::Grant(Grant { xfer: s, token, credits: vec![Credit { chunk: ChunkIdx(0), region }] });
    assert!(ep.handle_msg(t, PEER, late).is_ok());
    ep.submit(t, XferId(3), TOKEN, PEER, plan_of(1)).unwrap();
    let opens = msgs(&drain(&mut ep))
        .into_iter()
        .filter(|(_, m)| matches!(m, Msg::Want(w) if w.standing == Standing::Open))
        .count();
    assert_eq!(opens, 1);
}

/// The receiver refuses a claim (over a limit, its destination deregistered, the claim stale)
/// after the claimer's write ended and its DATA went out, the usual order, since the write
/// starts at submit: the transfer fails at once, not at its timeout, and the standing flow is
/// cancelled with it.
#[test]
fn a_claim_refused_after_its_data_went_out_fails_at_once() {
    let (mut ep, t, s, _, region) = sender_with_standing(false);
    ep.submit(t, XferId(2), TOKEN, PEER, plan_of(1)).unwrap();
    let g = gathers(&drain(&mut ep));
    ep.handle_gather_done(t, g[0].0, true);
    let w = writes(&drain(&mut ep));
    ep.handle_write_done(t, w[0].0, true);
    let data: Vec<Region> = msgs(&drain(&mut ep))
        .into_iter()
        .filter_map(|(_, m)| if let Msg::Data(d) = m { Some(d.region) } else { None })
        .collect();
    assert_eq!(data, vec![region], "chunk 0's DATA went out into the claimed region");
    let refused = ack_msg(XferId(2), 0, Region { offset: 0, len: 1 }, AckStatus::Refused);
    ep.handle_msg(t + Duration::from_micros(50), PEER, refused).unwrap();
    let acts = drain(&mut ep);
    assert_eq!(completes(&acts), vec![(XferId(2), Err(XferError::Refused))]);
    let cancels: Vec<XferId> = msgs(&acts)
        .into_iter()
        .filter_map(|(_, m)| if let Msg::Want(w) = m { w.is_cancel().then_some(w.xfer) } else { None })
        .collect();
    assert_eq!(cancels, vec![XferId(2), s], "the claimer and its standing flow cancelled");
}

#[test]
fn a_refused_standing_flow_is_not_asked_again_until_the_peer_is_lost() {
    let (mut ep, t) = standing_endpoint(32 * KIB, false);
    ep.submit(t, X, TOKEN, PEER, plan_of(1)).unwrap();
    let open = msgs(&drain(&mut ep))
        .into_iter()
        .find_map(|(_, m)| match m {
            Msg::Want(w) if w.standing == Standing::Open => Some(w),
            _ => None,
        })
        .unwrap();
    let refusal = Ack {
        xfer: open.xfer,
        token: open.token,
        chunk: ChunkIdx(0),
        region: Region { offset: 0, len: 1 },
        status: AckStatus::Refused,
    };
    ep.handle_msg(t, PEER, Msg::Ack(refusal)).unwrap();
    let opened = |ep: &mut Endpoint, x| {
        ep.submit(t, XferId(x), TOKEN, PEER, plan_of(1)).unwrap();
        msgs(&drain(ep)).iter().filter(|(_, m)| matches!(m, Msg::Want(w) if w.standing == Standing::Open)).count()
    };
    assert_eq!(opened(&mut ep, 2), 0);
    ep.handle_peer_lost(t, PEER);
    drain(&mut ep);
    assert_eq!(opened(&mut ep, 3), 1, "a new incarnation is asked again");
}

/// The standing flow lies in the peer's arena of the transfer that opened it: a transfer
/// bounced through another of the peer's arenas names its own arena and takes the full
/// exchange, and only one through the same arena claims the region.
#[test]
fn a_standing_region_is_claimed_only_by_transfers_through_its_arena() {
    let (mut ep, t, s, token, _) = sender_with_standing(false);
    let through = |arena: u8| {
        let mut p = plan_of(1);
        p.peer_arena = ArenaId(arena);
        p
    };
    ep.submit(t, XferId(2), TOKEN, PEER, through(1)).unwrap();
    let wants: Vec<(XferId, ArenaId, Standing)> = msgs(&drain(&mut ep))
        .into_iter()
        .filter_map(|(_, m)| if let Msg::Want(w) = m { Some((w.xfer, w.arena, w.standing)) } else { None })
        .collect();
    assert_eq!(wants, vec![(XferId(2), ArenaId(1), Standing::None)], "no claim, and no second standing flow");
    ep.submit(t, XferId(3), TOKEN, PEER, through(0)).unwrap();
    let wants: Vec<(XferId, ArenaId, Standing)> = msgs(&drain(&mut ep))
        .into_iter()
        .filter_map(|(_, m)| if let Msg::Want(w) = m { Some((w.xfer, w.arena, w.standing)) } else { None })
        .collect();
    assert_eq!(wants, vec![(XferId(3), ArenaId(0), Standing::Claim { xfer: s, token })]);
}

/// A write the shell marks `no_standing` (into a peer's GPU arena) neither opens a standing
/// flow nor claims the one it has: a later write without the mark still opens it, and a
/// marked one after that leaves it for the next unmarked write.
#[test]
fn a_write_marked_no_standing_neither_opens_nor_claims_the_standing_flow() {
    let (mut ep, t) = standing_endpoint(32 * KIB, false);
    let wants = |ep: &mut Endpoint| -> Vec<(XferId, Standing)> {
        msgs(&drain(ep))
            .into_iter()
            .filter_map(|(_, m)| if let Msg::Want(w) = m { Some((w.xfer, w.standing)) } else { None })
            .collect()
    };
    let marked = WriteRoute { no_standing: true, ..WriteRoute::default() };
    ep.submit_write(t, X, TOKEN, PEER, plan_of(1), marked.clone()).unwrap();
    assert_eq!(wants(&mut ep), vec![(X, Standing::None)], "no standing flow opened");
    let (mut ep, t, s, token, _) = sender_with_standing(false);
    ep.submit_write(t, XferId(2), TOKEN, PEER, plan_of(1), marked).unwrap();
    assert_eq!(wants(&mut ep), vec![(XferId(2), Standing::None)], "the region is not claimed");
    ep.submit(t, XferId(3), TOKEN, PEER, plan_of(1)).unwrap();
    assert_eq!(wants(&mut ep), vec![(XferId(3), Standing::Claim { xfer: s, token })]);
    assert_eq!(ep.stats().standing_claims, 1);
}

/// Standing flows' ids lie above every transfer's: however many of a peer's standing flows
/// end here (one per pause of a bursty workload, each closed by its sender as stale), its next
/// transfer is granted, not dropped as a replay to time out (review 58: the 257th ended
/// standing flow raised the one replay window's floor past every transfer id).
#[test]
fn a_peers_ended_standing_flows_never_make_its_next_transfer_a_replay() {
    let (mut ep, t) = standing_endpoint(32 * KIB, false);
    for n in 1..=257u64 {
        ep.handle_msg(t, PEER, open_msg(n, CHUNK)).unwrap();
        drain(&mut ep);
        // The sender closes it: an empty WANT with the flow's token.
        let close = Msg::Want(Want {
            arena: ArenaId(0),
            xfer: XferId(STANDING_XFER_BIT | n),
            token: Token(0x57a4d),
            endpoint: Vec::new(),
            chunks: Vec::new(),
            proofs: Vec::new(),
            inline: None,
            standing: Standing::None,
        });
        ep.handle_msg(t, PEER, close).unwrap();
        drain(&mut ep);
        assert_eq!(ep.receiver().standing_flow(PEER), None, "standing flow {n} closed");
    }
    let r = ep.handle_msg(t, PEER, want_msg(XferId(10_000), &[CHUNK]));
    assert!(r.is_ok(), "a new transfer refused: {r:?}");
    assert_eq!(grants(&drain(&mut ep)).len(), 1, "the new transfer is granted");
    assert_eq!(ep.stats().control_replayed, 0);
}

/// Review 59 (H1): an Open proves nothing, and a peer's name and session are published, so
/// anyone holding its metadata could open and close 257 "standing" flows under it with ids of
/// the transfers' space (bit 63 clear) and push that window past every id of the real peer's:
/// its transfers were then dropped as replays until it was reloaded. An id must lie in its
/// kind's space: such Opens, and PULLs with the standing bit, are refused as forged.
#[test]
fn a_standing_open_or_a_pull_with_an_id_of_the_other_space_is_refused_and_covers_nothing() {
    let (mut ep, t) = standing_endpoint(32 * KIB, false);
    for i in 0..257u64 {
        let x = XferId((1 << 63) - 1 - i);
        let Msg::Want(open) = open_msg(0, CHUNK) else { unreachable!() };
        let err = ep.handle_msg(t, PEER, Msg::Want(Want { xfer: x, ..open.clone() })).unwrap_err();
        assert_eq!(err, ProtocolError::StandingWant { peer: PEER, xfer: x });
        let cancel = Want { xfer: x, chunks: Vec::new(), standing: Standing::None, ..open };
        let _ = ep.handle_msg(t, PEER, Msg::Want(cancel));
        assert!(grants(&drain(&mut ep)).is_empty(), "nothing granted to {x:?}");
    }
    assert_eq!(ep.receiver().standing_flow(PEER), None);
    assert_eq!(ep.stats().control_forged, 257);
    // An ordinary WANT under a standing flow's id is refused the same way.
    let x = XferId(STANDING_XFER_BIT | 5);
    let err = ep.handle_msg(t, PEER, want_msg(x, &[CHUNK])).unwrap_err();
    assert_eq!(err, ProtocolError::StandingWant { peer: PEER, xfer: x });
    // The real peer's next transfer, at a wall-clock id, is granted.
    let r = ep.handle_msg(t, PEER, want_msg(XferId(1_800_000_000_000_000_000), &[CHUNK]));
    assert!(r.is_ok(), "the peer's transfer refused: {r:?}");
    assert_eq!(grants(&drain(&mut ep)).len(), 1);
    assert_eq!(ep.stats().control_replayed, 0);
}
