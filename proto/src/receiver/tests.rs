//! The receiver's unit tests, through an [`crate::endpoint::Endpoint`] driven by hand.

use std::time::Duration;

use super::*;
use crate::endpoint::Endpoint;
use crate::endpoint::tests::*;
use crate::types::{ArenaId, CopyRun, XferId};
use crate::wire::Msg;

/// A receiver with a 32 KiB arena, W = 2, and `[DST, DST + 64 KiB)` registered.
fn receiver() -> (Endpoint, Instant) {
    let (mut ep, t) = endpoint(32 * KIB, 2, true);
    ep.add_registered(REG, KEY, (DST, 64 * KIB), ArenaId(0));
    (ep, t)
}

/// [`receiver`] whose arena's max chunk is half of it (16 KiB): one chunk then takes half the
/// arena, as the fairness tests need.
fn receiver_of_halves() -> (Endpoint, Instant) {
    let t = Instant::now();
    let c = Config { max_chunk_size: 16 * KIB, ..config(32 * KIB, 2, true) };
    let mut ep = Endpoint::new(&c, t, PROBE_KEY).unwrap();
    ep.add_registered(REG, KEY, (DST, 64 * KIB), ArenaId(0));
    (ep, t)
}

/// READ `XferId(9)` of one chunk at `addr` through arena 0, proving registration `reg`.
fn pull_of(reg: RegId, addr: u64) -> wire::Pull {
    wire::Pull {
        arena: ArenaId(0),
        xfer: XferId(9),
        token: TOKEN,
        first: ChunkIdx(0),
        total: 1,
        endpoint: Vec::new(),
        chunks: vec![wire::PullChunk { bytes: CHUNK, runs: vec![run(0, addr, CHUNK)].into() }],
        proofs: vec![crate::proof::prove(reg, &KEY, TOKEN, XferId(9))],
    }
}

/// The registration of the destination memory served by arena 1, in tests that add one
/// (a registration serves one arena: `REG` is arena 0's).
const REG_OF_1: RegId = RegId(101);

/// `msg` (a WANT) through arena `arena`, proving the registration that arena serves.
fn through(msg: Msg, arena: u8) -> Msg {
    let reg = if arena == 0 { REG } else { REG_OF_1 };
    match msg {
        Msg::Want(w) => {
            let proofs = vec![crate::proof::prove(reg, &KEY, w.token, w.xfer)];
            Msg::Want(wire::Want { arena: ArenaId(arena), proofs, ..w })
        }
        other => other,
    }
}

/// `(peer, xfer, chunk, region)` of every credit in the GRANTs among `acts`.
fn credits(acts: &[Action]) -> Vec<(PeerId, XferId, u32, Region)> {
    let mut out = Vec::new();
    for (peer, m) in msgs(acts) {
        if let Msg::Grant(g) = m {
            out.extend(g.credits.iter().map(|c| (peer, g.xfer, c.chunk.0, c.region)));
        }
    }
    out
}

/// Sends a 3-chunk WANT from `PEER`; returns the two regions granted.
fn wanted(ep: &mut Endpoint, t: Instant) -> [Region; 2] {
    ep.handle_msg(t, PEER, want_msg(X, &[CHUNK, CHUNK, 3000])).unwrap();
    let c = credits(&drain(ep));
    assert_eq!(c.len(), 2);
    [c[0].3, c[1].3]
}

fn full_run(chunk: u64) -> Vec<CopyRun> {
    vec![run(0, DST + chunk * CHUNK, CHUNK)]
}

#[test]
fn want_is_granted_up_to_the_window_in_one_grant_message() {
    let (mut ep, t) = receiver();
    ep.handle_msg(t, PEER, want_msg(X, &[CHUNK; 5])).unwrap();
    let acts = drain(&mut ep);
    assert_eq!(msgs(&acts).len(), 1, "one GRANT batches the flow's credits");
    let c = credits(&acts);
    assert_eq!(c.iter().map(|c| (c.0, c.1, c.2)).collect::<Vec<_>>(), vec![(PEER, X, 0), (PEER, X, 1)]);
    assert_eq!(ep.remote_flows(), 1);
    assert_eq!(ep.stats().credits_granted, 2);
    check(&ep);
}

#[test]
fn valid_data_is_scattered_then_acked_and_the_window_refilled() {
    let (mut ep, t) = receiver();
    let [r0, _] = wanted(&mut ep, t);
    ep.handle_msg(t, PEER, data_msg(X, 0, r0, full_run(0))).unwrap();
    let s = scatters(&drain(&mut ep));
    assert_eq!(s.len(), 1);
    assert_eq!(s[0].1, r0);
    ep.handle_scatter_done(t, s[0].0, true);
    let acts = drain(&mut ep);
    assert_eq!(acks(&acts), vec![(X, 0, AckStatus::Scattered)]);
    let c = credits(&acts);
    assert_eq!((c.len(), c[0].2), (1, 2), "the freed slot goes to chunk 2");
    assert_eq!(ep.stats().bytes_scattered, CHUNK);
    check(&ep);
}

/// Sends `runs` for chunk `chunk` in `region`, expects a refusal with `fault` and a reclaimed
/// flow whose regions rest in quarantine (its other writes may still land) and are free
/// again a quarter request timeout later, except `scattering` ones.
fn refused_with(
    ep: &mut Endpoint,
    t: Instant,
    (chunk, region, runs): (u32, Region, Vec<CopyRun>),
    fault: DataFault,
    scattering: u64,
) {
    let (refused, runs_refused) = (ep.stats().data_refused, ep.stats().data_runs_refused);
    let err = ep.handle_msg(t, PEER, data_msg(X, chunk, region, runs)).unwrap_err();
    assert_eq!(err, ProtocolError::InvalidData { peer: PEER, xfer: X, chunk: ChunkIdx(chunk), fault });
    // Counted, and as refused for its runs exactly when the region was the flow's.
    let about_runs = !matches!(fault, DataFault::NotHeld | DataFault::RegionMismatch | DataFault::ChunkMismatch);
    assert_eq!(
        (ep.stats().data_refused - refused, ep.stats().data_runs_refused - runs_refused),
        (1, u64::from(about_runs)),
        "{fault:?}"
    );
    let acts = drain(ep);
    assert!(scatters(&acts).is_empty());
    assert_eq!(acks(&acts), vec![(X, chunk, AckStatus::Refused)]);
    assert_eq!(ep.remote_flows(), 0, "the flow is reclaimed");
    let rest = ep.arena_quarantined_bytes();
    assert_eq!(ep.arena_free_bytes() + rest, 32 * KIB - scattering * CHUNK, "its regions are all accounted for");
    assert_eq!(ep.poll_timeout(), (rest > 0).then_some(t + TIMEOUT / 4));
    check(ep);
    ep.handle_timeout(t + TIMEOUT / 4);
    assert!(acks(&drain(ep)).is_empty(), "a lift answers nobody");
    assert_eq!(ep.arena_free_bytes(), 32 * KIB - scattering * CHUNK, "its regions are free again");
    check(ep);
}

fn expect_refused(ep: &mut Endpoint, t: Instant, chunk: u32, region: Region, runs: Vec<CopyRun>, fault: DataFault) {
    refused_with(ep, t, (chunk, region, runs), fault, 0);
}

#[test]
fn the_senders_cancel_after_a_refusal_ends_the_quarantine_and_a_forged_one_does_not() {
    let (mut ep, t) = receiver();
    let [r0, _] = wanted(&mut ep, t);
    let bad = vec![run(CHUNK - 8, DST, 16)];
    assert!(ep.handle_msg(t, PEER, data_msg(X, 0, r0, bad)).is_err());
    drain(&mut ep);
    assert_eq!(ep.arena_quarantined_bytes(), 2 * CHUNK, "chunk 1 may still be written: both rest");
    // Anyone else's cancel for the flow, or one without its token, lifts nothing.
    let forged = ep.stats().control_forged;
    assert!(ep.handle_msg(t, PEER, Msg::cancel(X, Token(0xbad), Vec::new())).is_err());
    ep.handle_msg(t, PeerId(8), Msg::cancel(X, TOKEN, Vec::new())).unwrap();
    drain(&mut ep);
    assert_eq!((ep.arena_quarantined_bytes(), ep.stats().control_forged), (2 * CHUNK, forged + 1));
    // The sender fails on the refusal and cancels once its writes have ended.
    ep.handle_msg(t, PEER, Msg::cancel(X, TOKEN, Vec::new())).unwrap();
    assert!(acks(&drain(&mut ep)).is_empty(), "a cancel is not answered");
    assert_eq!((ep.arena_quarantined_bytes(), ep.arena_free_bytes()), (0, 32 * KIB));
    assert_eq!(ep.poll_timeout(), None);
    // A second cancel finds nothing resting: no error, no change.
    ep.handle_msg(t, PEER, Msg::cancel(X, TOKEN, Vec::new())).unwrap();
    check(&ep);
}

#[test]
fn data_with_a_run_outside_the_region_or_the_chunk_is_refused() {
    let (mut ep, t) = receiver();
    let [r0, _] = wanted(&mut ep, t);
    expect_refused(&mut ep, t, 0, r0, vec![run(CHUNK - 8, DST, 16)], DataFault::RunOutsideChunk { index: 0 });

    // Chunk 2 is 3000 bytes in a 4 KiB block: the block's tail is stale and never scattered.
    let (mut ep, t) = receiver();
    let [r0, r1] = wanted(&mut ep, t);
    for (chunk, region) in [(0, r0), (1, r1)] {
        ep.handle_msg(t, PEER, data_msg(X, chunk, region, full_run(chunk.into()))).unwrap();
    }
    let s = scatters(&drain(&mut ep));
    ep.handle_scatter_done(t, s[0].0, true);
    let r2 = credits(&drain(&mut ep))[0].3;
    assert_eq!(r2.len, CHUNK);
    let runs = vec![run(0, DST, 2000), run(2048, DST + 2048, 1000)];
    refused_with(&mut ep, t, (2, r2, runs), DataFault::RunOutsideChunk { index: 1 }, 1);
    // The scatter of chunk 1 still runs: its region is freed by its done-event, unacked.
    ep.handle_scatter_done(t, s[1].0, true);
    assert!(acks(&drain(&mut ep)).is_empty());
    assert!(ep.is_idle());
}

#[test]
fn data_whose_runs_copy_more_than_the_chunk_is_refused_whatever_its_strides() {
    // count = u32::MAX with zero strides: every span lies inside the chunk and registered
    // memory, but the copy would be 2^32 pieces long.
    let (mut ep, t) = receiver();
    let [r0, _] = wanted(&mut ep, t);
    let storm = CopyRun { region_off: 0, addr: DST, len: 16, count: u32::MAX, region_stride: 0, addr_stride: 0 };
    let copies = 16 * u64::from(u32::MAX);
    expect_refused(&mut ep, t, 0, r0, vec![storm], DataFault::TooManyBytes { copies, chunk: CHUNK });
    // Two runs each inside the chunk whose sum is one byte over it.
    let (mut ep, t) = receiver();
    let [r0, _] = wanted(&mut ep, t);
    let runs = vec![run(0, DST, CHUNK), run(0, DST + CHUNK, 1)];
    expect_refused(&mut ep, t, 0, r0, runs, DataFault::TooManyBytes { copies: CHUNK + 1, chunk: CHUNK });
    // Exactly the chunk's bytes are fine.
    let (mut ep, t) = receiver();
    let [r0, _] = wanted(&mut ep, t);
    ep.handle_msg(t, PEER, data_msg(X, 0, r0, vec![run(0, DST, CHUNK)])).unwrap();
    assert_eq!(scatters(&drain(&mut ep)).len(), 1);
}

#[test]
fn data_with_a_run_outside_registered_memory_is_refused() {
    let (mut ep, t) = receiver();
    let [r0, _] = wanted(&mut ep, t);
    let runs = vec![run(0, DST, 8), run(8, DST + 64 * KIB - 4, 8)];
    expect_refused(&mut ep, t, 0, r0, runs, DataFault::RunOutsideRegistered { index: 1 });

    // Two adjacent registrations, both proven, are still two ranges: a run must lie
    // inside one of them.
    let (mut ep, t) = receiver();
    let next = RegId(2);
    ep.add_registered(next, KEY, (DST + 64 * KIB, 64 * KIB), ArenaId(0));
    let mut want = want_msg(X, &[CHUNK, CHUNK, 3000]);
    if let Msg::Want(w) = &mut want {
        w.proofs.push(crate::proof::prove(next, &KEY, TOKEN, X));
    }
    ep.handle_msg(t, PEER, want).unwrap();
    let r0 = credits(&drain(&mut ep))[0].3;
    let strided =
        CopyRun { region_off: 0, addr: DST + 64 * KIB - 100, len: 8, count: 2, region_stride: 8, addr_stride: 100 };
    expect_refused(&mut ep, t, 0, r0, vec![strided], DataFault::RunOutsideRegistered { index: 0 });
}

/// Issue 10 item 7: registered is not enough. A DATA into memory registered here but not
/// proven by its flow's WANT (the sender never got that buffer's metadata) is refused, and
/// so is one into a proven registration deregistered since.
#[test]
fn data_into_a_registered_range_the_want_did_not_prove_is_refused() {
    let (mut ep, t) = receiver();
    let canary = RegId(2);
    ep.add_registered(canary, RegKey([0xc0; 32]), (DST + 64 * KIB, 64 * KIB), ArenaId(0));
    let [r0, _] = wanted(&mut ep, t);
    expect_refused(&mut ep, t, 0, r0, vec![run(0, DST + 64 * KIB, 8)], DataFault::RunOutsideRegistered { index: 0 });
    // A WANT without proofs proves nothing, and opens nothing, even from a loaded peer in its
    // session (published: anyone holding its metadata could send it; review 56 H1): no GRANT,
    // no answer at all, counted as forged.
    let (mut ep, t) = receiver();
    let mut want = want_msg(X, &[CHUNK]);
    if let Msg::Want(w) = &mut want {
        w.proofs.clear();
    }
    let e = ep.handle_msg(t, PEER, want).unwrap_err();
    assert!(matches!(e, ProtocolError::BadProof { source: BadProof::NoProof, .. }), "{e:?}");
    assert!(drain(&mut ep).is_empty(), "a forgery gets no answer");
    // Proven, then deregistered before the DATA.
    let (mut ep, t) = receiver();
    let [r0, _] = wanted(&mut ep, t);
    ep.remove_registered(REG);
    expect_refused(&mut ep, t, 0, r0, vec![run(0, DST, 8)], DataFault::RunOutsideRegistered { index: 0 });
}

/// A WANT whose proof does not check out (a wrong tag, an unknown registration) is refused
/// whole and counted as forged: no flow, no GRANT.
#[test]
fn a_want_with_a_bad_proof_is_refused_and_counted() {
    let (mut ep, t) = receiver();
    let mut bad_tag = crate::proof::prove(REG, &KEY, TOKEN, X);
    bad_tag.tag[0] ^= 1;
    let cases = [
        (bad_tag, crate::proof::BadProof::WrongTag(REG)),
        (crate::proof::prove(REG, &RegKey([1; 32]), TOKEN, X), crate::proof::BadProof::WrongTag(REG)),
        (crate::proof::prove(REG, &KEY, FORGED, X), crate::proof::BadProof::WrongTag(REG)),
        (crate::proof::prove(REG, &KEY, TOKEN, XferId(X.0 + 1)), crate::proof::BadProof::WrongTag(REG)),
        (crate::proof::prove(RegId(9), &KEY, TOKEN, X), crate::proof::BadProof::UnknownRegistration(RegId(9))),
    ];
    for (i, (proof, why)) in cases.into_iter().enumerate() {
        let mut want = want_msg(X, &[CHUNK]);
        if let Msg::Want(w) = &mut want {
            w.proofs.push(proof);
        }
        let err = ep.handle_msg(t, PEER, want).unwrap_err();
        assert_eq!(err, ProtocolError::BadProof { peer: PEER, xfer: X, source: why });
        assert_eq!(ep.stats().control_forged, i as u64 + 1);
    }
    assert!(drain(&mut ep).is_empty(), "no GRANT, and no answer to a forgery");
    assert_eq!(ep.remote_flows(), 0);
}

#[test]
fn data_that_names_a_region_or_chunk_it_was_not_granted_is_refused() {
    let (mut ep, t) = receiver();
    let [r0, r1] = wanted(&mut ep, t);
    expect_refused(&mut ep, t, 1, r0, full_run(1), DataFault::ChunkMismatch);

    let (mut ep, t) = receiver();
    let [r0, _] = wanted(&mut ep, t);
    let shrunk = Region { len: KIB, ..r0 };
    expect_refused(&mut ep, t, 0, shrunk, vec![run(0, DST, 8)], DataFault::RegionMismatch);

    let (mut ep, t) = receiver();
    wanted(&mut ep, t);
    expect_refused(&mut ep, t, 0, Region { offset: 28 * KIB, len: CHUNK }, full_run(0), DataFault::NotHeld);

    // Another flow's region: the intruding flow is refused, the owner is untouched.
    let (mut ep, t) = receiver();
    let [r0, r1b] = wanted(&mut ep, t);
    assert_eq!(r1, r1b);
    ep.handle_msg(t, PeerId(8), want_msg(XferId(5), &[CHUNK])).unwrap();
    let theirs = credits(&drain(&mut ep))[0].3;
    let err = ep.handle_msg(t, PEER, data_msg(X, 0, theirs, full_run(0))).unwrap_err();
    assert!(matches!(err, ProtocolError::InvalidData { fault: DataFault::NotHeld, .. }));
    drain(&mut ep);
    assert_eq!(ep.remote_flows(), 1);
    assert_eq!(ep.scheduler().flow_held_count(FlowKey { peer: PeerId(8), xfer: XferId(5) }), 1);
    assert!(ep.scheduler().is_held(FlowKey { peer: PEER, xfer: X }, r0.offset).is_none());
    check(&ep);
}

#[test]
fn duplicate_data_for_a_scattering_region_is_refused_and_the_scatter_orphaned() {
    let (mut ep, t) = receiver();
    let [r0, _] = wanted(&mut ep, t);
    ep.handle_msg(t, PEER, data_msg(X, 0, r0, full_run(0))).unwrap();
    let s = scatters(&drain(&mut ep));
    assert!(ep.handle_msg(t, PEER, data_msg(X, 0, r0, full_run(0))).is_err());
    drain(&mut ep);
    assert_eq!(ep.arena_free_bytes(), 32 * KIB - 2 * CHUNK, "the scattering region is not freed under the copy");
    assert_eq!(ep.arena_quarantined_bytes(), CHUNK, "chunk 1's region may still be written: it rests");
    ep.handle_scatter_done(t, s[0].0, true);
    assert!(acks(&drain(&mut ep)).is_empty());
    assert!(ep.is_idle());
    ep.handle_timeout(t + TIMEOUT / 4);
    assert_eq!(ep.arena_free_bytes(), 32 * KIB);
}

fn plan_msg(chunk: u32, runs: Vec<CopyRun>) -> Msg {
    Msg::Plan(wire::Plan { xfer: X, token: TOKEN, chunk: ChunkIdx(chunk), runs })
}

/// The runs of the one scatter among `acts`.
fn scattered_runs(acts: &[Action]) -> Vec<CopyRun> {
    let runs: Vec<_> = acts
        .iter()
        .filter_map(|a| match a {
            Action::Scatter { runs, .. } => Some(runs.runs().to_vec()),
            _ => None,
        })
        .collect();
    assert_eq!(runs.len(), 1, "{acts:?}");
    runs.into_iter().next().unwrap_or_default()
}

fn invariants(ep: &Endpoint) {
    check(ep);
    ep.receiver().check_invariants().unwrap();
}

#[test]
fn a_plan_ahead_is_checked_and_kept_and_its_data_scatters_by_it_with_no_runs() {
    let (mut ep, t) = receiver();
    ep.handle_msg(t, PEER, want_msg(X, &[CHUNK, CHUNK, 3000])).unwrap();
    // Runs are region-relative: a PLAN needs no credit, it may come before the GRANT.
    let runs = vec![run(0, DST + 4 * CHUNK, 1000), run(1000, DST, CHUNK - 1000)];
    ep.handle_msg(t, PEER, plan_msg(1, runs.clone())).unwrap();
    assert_eq!(ep.stats().plans_kept, 1);
    invariants(&ep);
    let c = credits(&drain(&mut ep));
    ep.handle_msg(t, PEER, data_msg(X, 1, c[1].3, Vec::new())).unwrap();
    assert_eq!(scattered_runs(&drain(&mut ep)), runs, "the kept runs, in order");
    invariants(&ep);
}

#[test]
fn a_data_without_runs_and_no_plan_kept_asks_for_them_and_keeps_its_region() {
    let (mut ep, t) = receiver();
    let [r0, _] = wanted(&mut ep, t);
    ep.handle_msg(t, PEER, data_msg(X, 0, r0, Vec::new())).unwrap();
    let acts = drain(&mut ep);
    assert_eq!(acks(&acts), vec![(X, 0, AckStatus::Replan)]);
    assert!(scatters(&acts).is_empty());
    assert_eq!((ep.remote_flows(), ep.stats().replans), (1, 1));
    // The DATA again, with its runs: scattered as any.
    ep.handle_msg(t, PEER, data_msg(X, 0, r0, full_run(0))).unwrap();
    assert_eq!(scattered_runs(&drain(&mut ep)), full_run(0));
    invariants(&ep);
}

/// A chunk is asked for its runs once: a sender answering its Replan with another DATA
/// without runs is refused and its flow reclaimed, so a loop of empty DATAs can neither hold the
/// region past its lease nor pile answers up (one way, each would wait in the mailbox backlog).
#[test]
fn a_second_data_without_runs_for_a_replanned_chunk_is_refused_and_the_flow_reclaimed() {
    let (mut ep, t) = receiver();
    let [r0, _] = wanted(&mut ep, t);
    ep.handle_msg(t, PEER, data_msg(X, 0, r0, Vec::new())).unwrap();
    assert_eq!(acks(&drain(&mut ep)), vec![(X, 0, AckStatus::Replan)]);
    let err = ep.handle_msg(t, PEER, data_msg(X, 0, r0, Vec::new())).unwrap_err();
    let fault = DataFault::NoRuns;
    assert_eq!(err, ProtocolError::InvalidData { peer: PEER, xfer: X, chunk: ChunkIdx(0), fault });
    let acts = drain(&mut ep);
    assert_eq!(acks(&acts), vec![(X, 0, AckStatus::Refused)]);
    assert!(scatters(&acts).is_empty());
    assert_eq!((ep.remote_flows(), ep.stats().replans, ep.stats().data_refused), (0, 1, 1));
    invariants(&ep);
}

#[test]
fn a_plan_that_breaks_a_rule_is_dropped_and_can_never_get_more_through_than_a_data() {
    let (mut ep, t) = receiver();
    let [r0, r1] = wanted(&mut ep, t);
    let outside = vec![run(0, DST + 64 * KIB, 8)];
    let cases = [
        (plan_msg(0, outside.clone()), DataFault::RunOutsideRegistered { index: 0 }),
        (plan_msg(1, vec![run(CHUNK - 8, DST, 16)]), DataFault::RunOutsideChunk { index: 0 }),
        (plan_msg(9, full_run(0)), DataFault::ChunkMismatch),
    ];
    for (msg, fault) in cases {
        let chunk = match &msg {
            Msg::Plan(p) => p.chunk,
            _ => unreachable!(),
        };
        let err = ep.handle_msg(t, PEER, msg).unwrap_err();
        assert_eq!(err, ProtocolError::InvalidData { peer: PEER, xfer: X, chunk, fault });
    }
    // A second PLAN for a chunk that has one is dropped too; the first one stays.
    ep.handle_msg(t, PEER, plan_msg(1, full_run(1))).unwrap();
    let dup = ep.handle_msg(t, PEER, plan_msg(1, full_run(0))).unwrap_err();
    assert!(matches!(dup, ProtocolError::InvalidData { fault: DataFault::NotHeld, .. }), "{dup:?}");
    // A forged one (a guessed token) changes nothing.
    let forged = Msg::Plan(wire::Plan { xfer: X, token: FORGED, chunk: ChunkIdx(0), runs: full_run(0) });
    assert_eq!(ep.handle_msg(t, PEER, forged), Err(ProtocolError::WrongToken { peer: PEER, xfer: X }));
    assert_eq!((ep.stats().plans_dropped, ep.stats().plans_kept, ep.stats().control_forged), (4, 1, 1));
    assert!(drain(&mut ep).is_empty(), "a dropped PLAN is never answered");
    invariants(&ep);
    // Chunk 0 kept nothing: its DATA is asked for its runs, and those are checked whole.
    ep.handle_msg(t, PEER, data_msg(X, 0, r0, Vec::new())).unwrap();
    assert_eq!(acks(&drain(&mut ep)), vec![(X, 0, AckStatus::Replan)]);
    ep.handle_msg(t, PEER, data_msg(X, 1, r1, Vec::new())).unwrap();
    assert_eq!(scattered_runs(&drain(&mut ep)), full_run(1));
    refused_with(&mut ep, t, (0, r0, outside), DataFault::RunOutsideRegistered { index: 0 }, 1);
}

#[test]
fn a_plan_kept_across_a_deregistration_is_checked_again_at_its_data() {
    let (mut ep, t) = receiver();
    let [r0, _] = wanted(&mut ep, t);
    ep.handle_msg(t, PEER, plan_msg(0, full_run(0))).unwrap();
    assert_eq!(ep.stats().plans_kept, 1);
    ep.remove_registered(REG);
    let err = ep.handle_msg(t, PEER, data_msg(X, 0, r0, Vec::new())).unwrap_err();
    let fault = DataFault::RunOutsideRegistered { index: 0 };
    assert_eq!(err, ProtocolError::InvalidData { peer: PEER, xfer: X, chunk: ChunkIdx(0), fault });
    assert_eq!(acks(&drain(&mut ep)), vec![(X, 0, AckStatus::Refused)]);
    assert_eq!(ep.remote_flows(), 0);
    invariants(&ep);
}

#[test]
fn plans_count_against_the_peers_budget_and_one_over_it_is_dropped_quietly() {
    let (mut ep, t) = receiver();
    // 3 announced chunks + 2 runs fit; 3 more runs do not.
    ep.receiver_mut().set_peer_caps(8, 5);
    let [r0, r1] = wanted(&mut ep, t);
    ep.handle_msg(t, PEER, plan_msg(0, vec![run(0, DST, 8), run(8, DST + 64, CHUNK - 8)])).unwrap();
    let three = vec![run(0, DST, 8), run(8, DST + 64, 8), run(16, DST + 128, CHUNK - 16)];
    ep.handle_msg(t, PEER, plan_msg(1, three.clone())).unwrap();
    assert_eq!((ep.stats().plans_kept, ep.stats().plans_dropped), (1, 1));
    invariants(&ep);
    ep.handle_msg(t, PEER, data_msg(X, 1, r1, Vec::new())).unwrap();
    assert_eq!(acks(&drain(&mut ep)), vec![(X, 1, AckStatus::Replan)]);
    // Taking the kept plan gives its runs back to the budget.
    ep.handle_msg(t, PEER, data_msg(X, 0, r0, Vec::new())).unwrap();
    assert_eq!(scatters(&drain(&mut ep)).len(), 1);
    invariants(&ep);
    ep.handle_msg(t, PEER, data_msg(X, 1, r1, three)).unwrap();
    assert_eq!(scatters(&drain(&mut ep)).len(), 1);
    invariants(&ep);
    // A cancel takes whatever plans are left with the flow.
    ep.handle_msg(t, PEER, Msg::cancel(X, TOKEN, Vec::new())).unwrap();
    invariants(&ep);
}

/// Kept runs also count against all peers' units together: a PLAN within its own peer's
/// budget but past the engine's total is dropped quietly, as one past the peer's is.
#[test]
fn a_plan_past_all_peers_total_is_dropped_quietly_though_its_peer_has_room() {
    let (mut ep, t) = receiver();
    // The WANT's 3 chunks and 2 runs fit the total; 3 more runs do not (the peer's cap would).
    ep.receiver_mut().set_total_chunks_cap(5);
    let [r0, r1] = wanted(&mut ep, t);
    ep.handle_msg(t, PEER, plan_msg(0, vec![run(0, DST, 8), run(8, DST + 64, CHUNK - 8)])).unwrap();
    let three = vec![run(0, DST, 8), run(8, DST + 64, 8), run(16, DST + 128, CHUNK - 16)];
    ep.handle_msg(t, PEER, plan_msg(1, three.clone())).unwrap();
    assert_eq!((ep.stats().plans_kept, ep.stats().plans_dropped), (1, 1));
    assert!(drain(&mut ep).is_empty(), "a dropped PLAN is never answered");
    invariants(&ep);
    // The dropped one's chunk is asked for its runs; the kept one scatters.
    ep.handle_msg(t, PEER, data_msg(X, 1, r1, Vec::new())).unwrap();
    assert_eq!(acks(&drain(&mut ep)), vec![(X, 1, AckStatus::Replan)]);
    ep.handle_msg(t, PEER, data_msg(X, 0, r0, Vec::new())).unwrap();
    assert_eq!(scatters(&drain(&mut ep)).len(), 1);
    invariants(&ep);
}

#[test]
fn late_data_after_a_cancel_is_dropped_without_an_ack() {
    let (mut ep, t) = receiver();
    let [r0, _] = wanted(&mut ep, t);
    ep.handle_msg(t, PEER, Msg::cancel(X, TOKEN, Vec::new())).unwrap();
    assert!(drain(&mut ep).is_empty());
    assert_eq!(ep.arena_free_bytes(), 32 * KIB);
    // The region may already be someone else's: never scatter it, never answer.
    // (Placement is next-fit: four flows of W = 2 fill the 8-slot arena, r0 included.)
    for p in 8..12 {
        ep.handle_msg(t, PeerId(p), want_msg(XferId(5), &[CHUNK, CHUNK])).unwrap();
    }
    let theirs: Vec<_> = credits(&drain(&mut ep)).iter().map(|c| c.3).collect();
    assert!(theirs.contains(&r0), "{theirs:?} should include {r0:?}");
    assert!(ep.handle_msg(t, PEER, data_msg(X, 0, r0, full_run(0))).is_ok());
    assert!(drain(&mut ep).is_empty());
    assert_eq!(ep.stats().late_data, 1);
    // A cancel for a flow never seen is harmless too.
    ep.handle_msg(t, PEER, Msg::cancel(XferId(77), TOKEN, Vec::new())).unwrap();
    check(&ep);
}

#[test]
fn cancel_during_a_scatter_defers_the_free_and_sends_no_ack() {
    let (mut ep, t) = receiver();
    let [r0, _] = wanted(&mut ep, t);
    ep.handle_msg(t, PEER, data_msg(X, 0, r0, full_run(0))).unwrap();
    let s = scatters(&drain(&mut ep));
    ep.handle_msg(t, PEER, Msg::cancel(X, TOKEN, Vec::new())).unwrap();
    assert_eq!(ep.arena_free_bytes(), 32 * KIB - CHUNK);
    assert_eq!(ep.remote_flows(), 0);
    ep.handle_scatter_done(t, s[0].0, true);
    assert!(drain(&mut ep).is_empty());
    assert!(ep.is_idle());
    assert_eq!(ep.arena_free_bytes(), 32 * KIB);
}

#[test]
fn a_failed_scatter_is_acked_as_failed() {
    let (mut ep, t) = receiver();
    let [r0, _] = wanted(&mut ep, t);
    ep.handle_msg(t, PEER, data_msg(X, 0, r0, full_run(0))).unwrap();
    let s = scatters(&drain(&mut ep));
    ep.handle_scatter_done(t, s[0].0, false);
    assert_eq!(acks(&drain(&mut ep)), vec![(X, 0, AckStatus::Failed)]);
    assert_eq!(ep.stats().scatters_failed, 1);
}

#[test]
fn keeps_hold_off_the_reclaim_of_a_flow_whose_write_is_slow_and_a_forged_one_does_not() {
    let u = TIMEOUT / 4;
    let (mut ep, t) = receiver();
    let [r0, _] = wanted(&mut ep, t);
    let keep = |token| Msg::Keep(wire::Keep { xfer: X, token });
    // The sender's write of chunk 0 is slow: it sends a KEEP every eighth of the timeout.
    for k in 1..=8u32 {
        let at = t + TIMEOUT * k / 8;
        ep.handle_timeout(at);
        ep.handle_msg(at, PEER, keep(TOKEN)).unwrap();
    }
    assert_eq!(ep.stats().flows_timed_out, 0, "a flow kept alive is not reclaimed");
    // A KEEP with another token is forged: counted, and it holds nothing off.
    let forged = ep.handle_msg(t + TIMEOUT, PEER, keep(Token(TOKEN.0 ^ 1)));
    assert!(matches!(forged, Err(ProtocolError::WrongToken { .. })), "{forged:?}");
    assert_eq!(ep.stats().control_forged, 1);
    // The write lands; the region is still the flow's.
    ep.handle_msg(t + TIMEOUT, PEER, data_msg(X, 0, r0, full_run(0))).unwrap();
    assert_eq!(scatters(&drain(&mut ep)).len(), 1);
    // Silent from here: reclaimed half a timeout after its last frame.
    ep.handle_timeout(t + TIMEOUT + 2 * u);
    drain(&mut ep);
    assert_eq!(ep.stats().flows_timed_out, 1);
}

#[test]
fn a_flow_silent_for_half_a_timeout_is_reclaimed_but_one_waiting_for_the_arena_is_not() {
    // The lease is half the request timeout; u is half the lease, and the quarantine of a
    // reclaimed region.
    let u = TIMEOUT / 4;
    let (mut ep, t) = receiver_of_halves();
    let [r0, _] = wanted(&mut ep, t);
    // Peer 9 takes half the arena and goes silent; peer 8's chunk waits for space.
    ep.handle_msg(t, PeerId(9), want_msg(XferId(3), &[16 * KIB])).unwrap();
    ep.handle_msg(t, PeerId(8), want_msg(XferId(5), &[16 * KIB])).unwrap();
    drain(&mut ep);
    ep.handle_msg(t + u, PEER, data_msg(X, 0, r0, full_run(0))).unwrap();
    let s = scatters(&drain(&mut ep));
    assert_eq!(ep.poll_timeout(), Some(t + 2 * u));
    ep.handle_timeout(t + 2 * u);
    drain(&mut ep);
    assert_eq!(ep.stats().flows_timed_out, 1, "peer 9's flow sent nothing: reclaimed");
    assert_eq!(ep.remote_flows(), 2, "the active flow and the one waiting for space remain");
    // Peer 9's half rests for u: a write of it still in flight lands where nobody reads.
    let peer8 = FlowKey { peer: PeerId(8), xfer: XferId(5) };
    assert_eq!((ep.scheduler().flow_held_count(peer8), ep.arena_quarantined_bytes()), (0, 16 * KIB));
    // PEER's flow: chunk 0 scattering, chunk 1 granted but silent for a lease since DATA.
    ep.handle_timeout(t + 3 * u);
    drain(&mut ep);
    assert_eq!(ep.stats().flows_timed_out, 2);
    assert_eq!(
        ep.scheduler().flow_held_count(peer8),
        1,
        "peer 9's half came back and went to peer 8, a quarter timeout before its own timeout"
    );
    assert_eq!(ep.arena_quarantined_bytes(), CHUNK, "PEER's chunk 1 rests");
    ep.handle_scatter_done(t + 3 * u, s[0].0, true);
    assert!(acks(&drain(&mut ep)).is_empty(), "orphaned by the reclaim");
    // Peer 8 was granted at t + 3u and never wrote.
    ep.handle_timeout(t + 5 * u - Duration::from_millis(1));
    assert_eq!((ep.stats().flows_timed_out, ep.arena_quarantined_bytes()), (2, 0));
    ep.handle_timeout(t + 5 * u);
    drain(&mut ep);
    assert_eq!(ep.stats().flows_timed_out, 3);
    assert!(ep.is_idle());
    assert_eq!((ep.arena_quarantined_bytes(), ep.poll_timeout()), (16 * KIB, Some(t + 6 * u)));
    ep.handle_timeout(t + 6 * u);
    assert_eq!(ep.poll_timeout(), None);
    assert_eq!(ep.arena_free_bytes(), 32 * KIB);
}

#[test]
fn a_peer_that_lets_a_grant_lapse_unused_loses_its_queue_with_it() {
    // Peer 9 announces four transfers of one 16 KiB chunk each and then never writes: the
    // first two fill the arena, two wait for it.
    let lease = TIMEOUT / 2;
    let (mut ep, t) = receiver_of_halves();
    let silent = PeerId(9);
    for x in 1..=4 {
        ep.handle_msg(t, silent, want_msg(XferId(x), &[16 * KIB])).unwrap();
    }
    let given: Vec<XferId> = credits(&drain(&mut ep)).iter().map(|c| c.1).collect();
    assert_eq!(given, vec![XferId(1), XferId(2)]);
    // A lease later both grants lapse, and the queue goes with them: served, it would only
    // hand the same silence the arena again, a lease at a time.
    ep.handle_timeout(t + lease);
    assert!(credits(&drain(&mut ep)).is_empty());
    assert_eq!((ep.stats().flows_timed_out, ep.stats().flows_dropped_unserved), (2, 2));
    assert_eq!((ep.remote_flows(), ep.arena_quarantined_bytes()), (0, 32 * KIB));
    check(&ep);
    // The arena comes back whole after the quarantine, and nobody is granted it.
    ep.handle_timeout(t + lease + TIMEOUT / 4);
    assert!(credits(&drain(&mut ep)).is_empty());
    assert_eq!(ep.arena_free_bytes(), 32 * KIB);
    // A transfer the peer announces afterwards is served as usual.
    ep.handle_msg(t + TIMEOUT, silent, want_msg(XferId(5), &[16 * KIB])).unwrap();
    assert_eq!(credits(&drain(&mut ep)).len(), 1);
    check(&ep);
}

#[test]
fn a_peer_that_wrote_since_its_lapsed_grant_keeps_its_queue() {
    let lease = TIMEOUT / 2;
    let (mut ep, t) = receiver_of_halves();
    for x in 1..=4 {
        ep.handle_msg(t, PEER, want_msg(XferId(x), &[16 * KIB])).unwrap();
    }
    let c = credits(&drain(&mut ep));
    assert_eq!(c.iter().map(|c| c.1).collect::<Vec<_>>(), vec![XferId(1), XferId(2)]);
    // Transfer 1 is written and scattered (its region goes to transfer 3); transfer 2 is
    // lost at the sender, which keeps working.
    let data = Msg::Data(wire::Data {
        xfer: XferId(1),
        token: TOKEN,
        chunk: ChunkIdx(0),
        region: c[0].3,
        runs: vec![run(0, DST, 16 * KIB)],
        region_plan_runs: 0,
    });
    ep.handle_msg(t + lease / 2, PEER, data).unwrap();
    let s = scatters(&drain(&mut ep));
    let regranted = t + lease / 2 + Duration::from_millis(1);
    ep.handle_scatter_done(regranted, s[0].0, true);
    let next = credits(&drain(&mut ep));
    assert_eq!(next.iter().map(|c| c.1).collect::<Vec<_>>(), vec![XferId(3)]);
    ep.handle_timeout(t + lease);
    drain(&mut ep);
    assert_eq!((ep.stats().flows_timed_out, ep.stats().flows_dropped_unserved), (1, 0));
    assert_eq!(ep.remote_flows(), 2, "transfer 3, granted, and transfer 4, still waiting");
    // A write before a grant shows nothing about it: transfer 3 lapses too (the peer has
    // written nothing since it was given), and transfer 4 goes with it.
    ep.handle_timeout(regranted + lease);
    drain(&mut ep);
    assert_eq!((ep.stats().flows_timed_out, ep.stats().flows_dropped_unserved), (2, 1));
    assert_eq!(ep.remote_flows(), 0);
    check(&ep);
}

/// Each arena has its own scheduler: with the first arena full and a flow queued for it,
/// a flow through the second is granted its whole window at once, the queued one still
/// waits, and a DATA naming a region of one arena is checked against that arena's ledger
/// only. Freed space of one arena never goes to the other's flows.
#[test]
fn arenas_grant_independently_and_a_region_belongs_to_its_flows_arena() {
    let (mut ep, t) = receiver();
    assert_eq!(ep.add_arena(16 * KIB, KIB, CHUNK).unwrap(), ArenaId(1));
    ep.add_registered(REG_OF_1, KEY, (DST, 64 * KIB), ArenaId(1));
    assert_eq!(ep.schedulers().len(), 2);
    // Eight 4 KiB chunks fill the 32 KiB first arena (W = 2 per flow: four flows).
    for x in 0..4 {
        ep.handle_msg(t, PeerId(10 + x), want_msg(XferId(1), &[CHUNK, CHUNK])).unwrap();
    }
    assert_eq!(credits(&drain(&mut ep)).len(), 8);
    assert_eq!(ep.schedulers().get(ArenaId(0)).free_bytes(), 0);
    ep.handle_msg(t, PeerId(20), want_msg(XferId(1), &[CHUNK])).unwrap();
    assert!(credits(&drain(&mut ep)).is_empty(), "the first arena is full: the flow waits");
    // The second arena's flow gets its window at once, in its own arena's offsets.
    ep.handle_msg(t, PEER, through(want_msg(X, &[CHUNK, CHUNK, CHUNK]), 1)).unwrap();
    let got = credits(&drain(&mut ep));
    assert_eq!(got.iter().map(|c| (c.0, c.2)).collect::<Vec<_>>(), vec![(PEER, 0), (PEER, 1)]);
    assert_eq!(ep.schedulers().get(ArenaId(1)).free_bytes(), 8 * KIB);
    // Its region is held in arena 1 only: arena 0 holds a region at the same offset for
    // another flow, and this flow's DATA is checked against arena 1's ledger.
    let r0 = got[0].3;
    assert!(ep.schedulers().get(ArenaId(0)).is_held(FlowKey { peer: PEER, xfer: X }, r0.offset).is_none());
    ep.handle_msg(t, PEER, data_msg(X, 0, r0, full_run(0))).unwrap();
    let acts = drain(&mut ep);
    assert!(acts.iter().any(|a| matches!(a, Action::Scatter { arena: ArenaId(1), .. })), "{acts:?}");
    let s = scatters(&acts);
    assert_eq!(s.len(), 1);
    ep.handle_scatter_done(t, s[0].0, true);
    let acts = drain(&mut ep);
    assert_eq!(acks(&acts), vec![(X, 0, AckStatus::Scattered)]);
    // The freed arena-1 region goes to the flow's chunk 2, not to the flow waiting for
    // arena 0.
    assert_eq!(credits(&acts).iter().map(|c| (c.0, c.2)).collect::<Vec<_>>(), vec![(PEER, 2)]);
    for (_, sched) in ep.schedulers().iter() {
        sched.check_invariants().unwrap();
    }
    ep.receiver().check_invariants().unwrap();
}

/// An arena is named by the WANT or PULL that opens a flow: one this receiver does not
/// advertise is refused (answered, so an honest but confused sender learns at once), and
/// a flow's later WANTs cannot move it to another arena. Nothing is granted or moved.
#[test]
fn a_want_or_pull_naming_an_arena_we_lack_or_not_its_flows_is_refused() {
    let (mut ep, t) = receiver();
    let free = ep.arena_free_bytes();
    let named = |msg: Msg, arena: u8| match msg {
        Msg::Want(w) => Msg::Want(wire::Want { arena: ArenaId(arena), ..w }),
        Msg::Pull(p) => Msg::Pull(wire::Pull { arena: ArenaId(arena), ..p }),
        other => other,
    };
    let err = ep.handle_msg(t, PEER, named(want_msg(X, &[CHUNK]), 1)).unwrap_err();
    assert_eq!(err, ProtocolError::WrongArena { peer: PEER, xfer: X, arena: ArenaId(1) });
    assert_eq!(acks(&drain(&mut ep)), vec![(X, 0, AckStatus::Refused)]);
    assert_eq!((ep.remote_flows(), ep.arena_free_bytes()), (0, free));
    // The flow opened through arena 0 keeps it: a further WANT naming another is refused
    // and leaves the flow and its grants as they were.
    ep.handle_msg(t, PEER, want_msg(X, &[CHUNK])).unwrap();
    let granted = credits(&drain(&mut ep));
    assert_eq!(granted.len(), 1);
    let err = ep.handle_msg(t, PEER, named(want_msg(X, &[CHUNK]), 2)).unwrap_err();
    assert_eq!(err, ProtocolError::WrongArena { peer: PEER, xfer: X, arena: ArenaId(2) });
    // Refused (its sender fails the transfer and cancels the flow); until then the flow
    // keeps its region.
    assert_eq!(acks(&drain(&mut ep)), vec![(X, 0, AckStatus::Refused)]);
    assert_eq!(ep.remote_flows(), 1);
    assert_eq!(ep.scheduler().flow_held_count(FlowKey { peer: PEER, xfer: X }), 1);
    // A READ through an arena we lack.
    let pull = Msg::Pull(pull_of(REG, DST));
    let err = ep.handle_msg(t, PEER, named(pull.clone(), 15)).unwrap_err();
    assert_eq!(err, ProtocolError::WrongArena { peer: PEER, xfer: XferId(9), arena: ArenaId(15) });
    assert_eq!(acks(&drain(&mut ep)), vec![(XferId(9), 0, AckStatus::Refused)]);
    assert_eq!(ep.remote_flows(), 1);
    ep.handle_msg(t, PEER, pull).unwrap();
    assert_eq!(ep.remote_flows(), 2, "the same PULL through arena 0 is served");
    ep.receiver().check_invariants().unwrap();
    check(&ep);
}

/// A READ flow's region holds the target's gathered bytes for its initiator's READ: a DATA
/// naming it (with the flow's own token) is refused, scatters nothing, and the flow goes.
#[test]
fn a_data_on_a_read_flow_is_refused_and_scatters_nothing() {
    let (mut ep, t) = receiver();
    ep.handle_msg(t, PEER, Msg::Pull(pull_of(REG, DST))).unwrap();
    let g = gathers(&drain(&mut ep));
    ep.handle_gather_done(t, g[0].0, true);
    let ready = credits(&drain(&mut ep));
    assert_eq!(ready.len(), 1, "the chunk is announced ready");
    let r = ep.handle_msg(t, PEER, data_msg(XferId(9), 0, ready[0].3, vec![run(0, DST, CHUNK)]));
    assert!(matches!(r, Err(ProtocolError::InvalidData { fault: DataFault::NotHeld, .. })), "{r:?}");
    let acts = drain(&mut ep);
    assert!(scatters(&acts).is_empty(), "{acts:?}");
    assert_eq!(ep.remote_flows(), 0, "the flow is reclaimed");
    ep.receiver().check_invariants().unwrap();
}

/// A registration serves one arena (host memory the host arena, GPU memory its GPU's):
/// a WANT or PULL through another arena that proves it, with the right key, is refused
/// and answered, nothing is granted, gathered or scattered, and the same frame through
/// the registration's own arena is served. Else a peer could make a CPU copy engine
/// dereference a GPU address, or a kernel a host one.
#[test]
fn a_proof_through_an_arena_that_does_not_serve_the_registration_is_refused() {
    let (mut ep, t) = receiver();
    assert_eq!(ep.add_arena(16 * KIB, KIB, CHUNK).unwrap(), ArenaId(1));
    let gpu = RegId(102);
    ep.add_registered(gpu, KEY, (DST + 64 * KIB, 64 * KIB), ArenaId(1));
    let free = (ep.schedulers().get(ArenaId(0)).free_bytes(), ep.schedulers().get(ArenaId(1)).free_bytes());
    // Arena 0's registration proven through arena 1.
    let want = Msg::Want(wire::Want {
        arena: ArenaId(1),
        ..match want_msg(X, &[CHUNK]) {
            Msg::Want(w) => w,
            _ => unreachable!(),
        }
    });
    let err = ep.handle_msg(t, PEER, want).unwrap_err();
    assert!(matches!(err, ProtocolError::BadProof { source: BadProof::WrongArena(REG, ArenaId(1)), .. }), "{err:?}");
    assert_eq!(acks(&drain(&mut ep)), vec![(X, 0, AckStatus::Refused)]);
    // Arena 1's registration proven through arena 0, by a READ.
    let pull = pull_of(gpu, DST + 64 * KIB);
    let err = ep.handle_msg(t, PEER, Msg::Pull(pull.clone())).unwrap_err();
    assert!(
        matches!(err, ProtocolError::BadProof { source: BadProof::WrongArena(r, ArenaId(0)), .. } if r == gpu),
        "{err:?}"
    );
    let acts = drain(&mut ep);
    assert_eq!(acks(&acts), vec![(XferId(9), 0, AckStatus::Refused)]);
    assert!(!acts.iter().any(|a| matches!(a, Action::Gather { .. } | Action::Scatter { .. })), "{acts:?}");
    assert_eq!(ep.remote_flows(), 0);
    let now = (ep.schedulers().get(ArenaId(0)).free_bytes(), ep.schedulers().get(ArenaId(1)).free_bytes());
    assert_eq!(now, free, "nothing granted in either arena");
    // Each through its own arena is served.
    ep.handle_msg(t, PEER, Msg::Pull(wire::Pull { arena: ArenaId(1), ..pull })).unwrap();
    ep.handle_msg(t, PEER, want_msg(X, &[CHUNK])).unwrap();
    assert_eq!(ep.remote_flows(), 2);
    ep.receiver().check_invariants().unwrap();
    check(&ep);
}

/// All peers together are capped too: one-way names are each a peer of their own, and a
/// target serving many of them must not hold unbounded announced chunks. A WANT that would
/// pass the cap is refused and answered; one that fits is served.
#[test]
fn all_peers_announced_chunks_are_capped_together() {
    let (mut ep, t) = receiver();
    ep.receiver_mut().set_peer_caps(16, 100);
    ep.receiver_mut().set_total_chunks_cap(150);
    let other = PeerId(PEER.0 + 1);
    ep.handle_msg(t, PEER, want_msg(XferId(1), &[CHUNK; 100])).unwrap();
    drain(&mut ep);
    let over = ep.handle_msg(t, other, want_msg(XferId(2), &[CHUNK; 60]));
    assert_eq!(over, Err(ProtocolError::OverTotalLimit { peer: other, xfer: XferId(2), chunks: 160 }));
    assert_eq!(acks(&drain(&mut ep)), vec![(XferId(2), 0, AckStatus::Refused)]);
    ep.handle_msg(t, other, want_msg(XferId(3), &[CHUNK; 50])).unwrap();
    assert_eq!(ep.remote_flows(), 2);
    ep.receiver().check_invariants().unwrap();
    check(&ep);
}

#[test]
fn a_peers_pulls_are_capped_in_the_gather_runs_they_keep() {
    let (mut ep, t) = receiver();
    ep.receiver_mut().set_peer_caps(16, 100);
    let pull = |xfer: u64, runs: u64| {
        let runs: Vec<_> = (0..runs)
            .map(|i| CopyRun {
                region_off: i * 2,
                addr: DST + i * 2,
                len: 1,
                count: 1,
                region_stride: 0,
                addr_stride: 0,
            })
            .collect();
        Msg::Pull(wire::Pull {
            arena: ArenaId(0),
            xfer: XferId(xfer),
            token: TOKEN,
            first: ChunkIdx(0),
            total: 1,
            endpoint: Vec::new(),
            chunks: vec![wire::PullChunk { bytes: CHUNK, runs: runs.into() }],
            proofs: vec![crate::proof::prove(REG, &KEY, TOKEN, XferId(xfer))],
        })
    };
    let over = ep.handle_msg(t, PEER, pull(1, 200));
    assert!(matches!(over, Err(ProtocolError::PeerOverLimit { chunks: 201, .. })), "{over:?}");
    ep.handle_msg(t, PEER, pull(2, 50)).unwrap();
    let over = ep.handle_msg(t, PEER, pull(3, 60));
    assert!(matches!(over, Err(ProtocolError::PeerOverLimit { chunks: 112, .. })), "{over:?}");
    ep.receiver().check_invariants().unwrap();
    // Cancelling the accepted READ gives its 51 units (1 chunk, 50 runs) back.
    ep.handle_msg(t, PEER, Msg::cancel(XferId(2), TOKEN, Vec::new())).unwrap();
    drain(&mut ep);
    ep.handle_msg(t, PEER, pull(3, 60)).unwrap();
    ep.receiver().check_invariants().unwrap();
}

/// A peer cannot grow receiver state without bound by announcing transfers it never
/// sends: past the per-peer caps its WANTs are refused unqueued, other peers are not
/// affected, and ending a flow gives the room back.
#[test]
fn a_peer_is_capped_in_open_flows_and_announced_chunks() {
    const FLOWS: usize = 16;
    const CHUNKS: u64 = 64;
    let (mut ep, t) = receiver();
    assert_eq!(ep.receiver().caps, PeerLoad { flows: MAX_FLOWS_PER_PEER, chunks: MAX_CHUNKS_PER_PEER });
    ep.receiver_mut().set_peer_caps(FLOWS, CHUNKS);
    let greedy = PeerId(7);
    for x in 0..FLOWS as u64 {
        ep.handle_msg(t, greedy, want_msg(XferId(x), &[CHUNK])).unwrap();
    }
    let err = ep.handle_msg(t, greedy, want_msg(XferId(1 << 40), &[CHUNK])).unwrap_err();
    assert!(matches!(err, ProtocolError::PeerOverLimit { flows, .. } if flows == FLOWS + 1), "{err}");
    // More chunks for a flow it already has are fine while under the chunk cap.
    ep.handle_msg(t, greedy, want_msg(XferId(0), &[CHUNK])).unwrap();
    ep.handle_msg(t, PEER, want_msg(X, &[CHUNK])).unwrap();
    ep.receiver().check_invariants().unwrap();
    // Ending one flow makes room for a new one.
    ep.handle_msg(t, greedy, Msg::cancel(XferId(5), TOKEN, Vec::new())).unwrap();
    ep.handle_msg(t, greedy, want_msg(XferId(1 << 40), &[CHUNK])).unwrap();
    ep.handle_peer_lost(t, greedy);
    ep.receiver().check_invariants().unwrap();

    // The chunk cap, across WANTs of one flow and across flows.
    let half = vec![CHUNK; (CHUNKS / 2) as usize];
    ep.handle_msg(t, greedy, want_msg(XferId(1), &half)).unwrap();
    ep.handle_msg(t, greedy, want_msg(XferId(2), &half)).unwrap();
    let err = ep.handle_msg(t, greedy, want_msg(XferId(1), &[CHUNK])).unwrap_err();
    assert!(matches!(err, ProtocolError::PeerOverLimit { chunks, .. } if chunks == CHUNKS + 1), "{err}");
    assert!(ep.handle_msg(t, greedy, want_msg(XferId(3), &[CHUNK])).is_err());
    ep.receiver().check_invariants().unwrap();
    ep.handle_msg(t, greedy, Msg::cancel(XferId(2), TOKEN, Vec::new())).unwrap();
    ep.handle_msg(t, greedy, want_msg(XferId(3), &[CHUNK])).unwrap();
    ep.receiver().check_invariants().unwrap();
}

#[test]
fn peer_loss_and_shutdown_reclaim_flows_and_defer_scattering_regions() {
    let (mut ep, t) = receiver();
    let [r0, _] = wanted(&mut ep, t);
    ep.handle_msg(t, PEER, data_msg(X, 0, r0, full_run(0))).unwrap();
    let s = scatters(&drain(&mut ep));
    ep.handle_msg(t, PeerId(8), want_msg(XferId(5), &[CHUNK])).unwrap();
    drain(&mut ep);
    ep.handle_peer_lost(t, PEER);
    assert!(drain(&mut ep).is_empty());
    assert_eq!(ep.remote_flows(), 1);
    assert_eq!(ep.arena_quarantined_bytes(), CHUNK, "the lost peer's idle region rests");
    assert_eq!(ep.arena_free_bytes(), 32 * KIB - 3 * CHUNK, "peer 8's region, the scattering one, the resting one");
    ep.shutdown(t);
    assert_eq!(ep.arena_quarantined_bytes(), 0, "shutdown lifts the quarantine");
    assert!(drain(&mut ep).is_empty());
    assert_eq!(ep.remote_flows(), 0);
    ep.handle_msg(t, PEER, want_msg(XferId(6), &[CHUNK])).unwrap();
    assert_eq!(acks(&drain(&mut ep)), vec![(XferId(6), 0, AckStatus::Refused)], "refused after shutdown, no grants");
    ep.handle_scatter_done(t, s[0].0, true);
    assert!(drain(&mut ep).is_empty());
    assert!(ep.is_idle());
    assert_eq!(ep.arena_free_bytes(), 32 * KIB);
}

#[test]
fn a_want_the_scheduler_cannot_queue_is_a_protocol_error() {
    let (mut ep, t) = receiver();
    for chunks in [vec![CHUNK, 0], vec![64 * KIB]] {
        let err = ep.handle_msg(t, PEER, want_msg(X, &chunks)).unwrap_err();
        assert!(matches!(err, ProtocolError::BadWant { .. }), "{err}");
        assert_eq!(acks(&drain(&mut ep)), vec![(X, 0, AckStatus::Refused)], "the sender learns at once");
    }
    assert!(ep.is_idle());
    // The endpoint is still usable by the same sender.
    wanted(&mut ep, t);
}

/// A chunk above the arena's configured max chunk (which our capabilities advertise, so no
/// honest plan has one) is refused, even one the arena could hold. Before, one WANT for a chunk
/// as large as the whole arena was granted all of it when idle, past the half-arena share cap;
/// and, waiting as the drain target, it held every other peer's credits until the arena was all
/// free, which never came while a staging reserve of ours was out.
#[test]
fn a_want_above_the_configured_max_chunk_is_refused_even_when_the_arena_could_hold_it() {
    let (mut ep, t) = receiver();
    for (peer, chunks) in [(PeerId(3), vec![32 * KIB]), (PeerId(4), vec![CHUNK, 2 * CHUNK])] {
        let err = ep.handle_msg(t, peer, want_msg(X, &chunks)).unwrap_err();
        assert!(matches!(err, ProtocolError::BadWant { .. }), "{err}");
        assert_eq!(acks(&drain(&mut ep)), vec![(X, 0, AckStatus::Refused)]);
    }
    assert_eq!(ep.arena_free_bytes(), 32 * KIB, "nothing granted");
    // An honest peer is granted as usual.
    assert_eq!(wanted(&mut ep, t).len(), 2);
}

/// A WANT for `xfer` carrying its one chunk of `CHUNK` bytes (`fill`), scattered by `runs`.
fn inline_want(xfer: XferId, fill: u8, runs: Vec<CopyRun>) -> Msg {
    let Msg::Want(mut w) = want_msg(xfer, &[CHUNK]) else { unreachable!() };
    w.inline = Some(wire::Inline { runs, bytes: vec![fill; CHUNK as usize] });
    Msg::Want(w)
}

/// The scatters of `acts` with the inline bytes each carries.
fn inline_scatters(acts: &[Action]) -> Vec<(JobId, Region, Option<Vec<u8>>)> {
    acts.iter()
        .filter_map(|a| match a {
            Action::Scatter { job, region, inline, .. } => Some((*job, *region, inline.clone())),
            _ => None,
        })
        .collect()
}

#[test]
fn an_inline_want_is_put_in_a_region_and_scattered_with_no_grant_then_acked() {
    let (mut ep, t) = receiver();
    ep.handle_msg(t, PEER, inline_want(X, 0xab, full_run(0))).unwrap();
    let acts = drain(&mut ep);
    assert!(credits(&acts).is_empty(), "no GRANT: {acts:?}");
    let s = inline_scatters(&acts);
    assert_eq!(s.len(), 1);
    assert_eq!(s[0].2.as_deref(), Some(&[0xab; CHUNK as usize][..]), "the WANT's bytes go with the scatter");
    assert!(s[0].1.len >= CHUNK);
    ep.handle_scatter_done(t, s[0].0, true);
    assert_eq!(acks(&drain(&mut ep)), vec![(X, 0, AckStatus::Scattered)]);
    assert_eq!((ep.stats().inline_taken, ep.remote_flows()), (1, 0));
    assert_eq!(ep.arena_free_bytes(), 32 * KIB, "the region is free again");
    check(&ep);
}

/// An inline chunk's runs count against all peers' units together as a PLAN's do (review 58:
/// only the peer's own budget was checked, so each held inline WANT could pass the total by
/// its runs): past the total, the bytes are declined and the chunk is served the usual way.
#[test]
fn an_inline_chunk_whose_runs_pass_all_peers_total_is_declined_and_granted_instead() {
    let (mut ep, t) = receiver();
    // The WANT's chunk fits the total; its two runs besides do not.
    ep.receiver_mut().set_total_chunks_cap(2);
    let runs = vec![run(0, DST, 8), run(8, DST + 64, CHUNK - 8)];
    ep.handle_msg(t, PEER, inline_want(X, 0xab, runs.clone())).unwrap();
    let acts = drain(&mut ep);
    assert!(inline_scatters(&acts).is_empty(), "{acts:?}");
    assert_eq!(credits(&acts).len(), 1, "granted as a plain WANT");
    assert_eq!(ep.stats().inline_taken, 0);
    ep.receiver().check_invariants().unwrap();
    // Within the total, the same WANT rides inline.
    ep.receiver_mut().set_total_chunks_cap(4);
    ep.handle_msg(t, PEER, inline_want(XferId(2), 0xcd, runs)).unwrap();
    assert_eq!(inline_scatters(&drain(&mut ep)).len(), 1);
    ep.receiver().check_invariants().unwrap();
}

#[test]
fn an_inline_chunk_whose_runs_leave_the_proven_memory_is_refused_and_writes_nothing() {
    let (mut ep, t) = receiver();
    // Past the end of the registration, and a run that reads beyond the chunk.
    for (x, runs) in [(1, vec![run(0, DST + 64 * KIB - 8, 16)]), (2, vec![run(8, DST, CHUNK)])] {
        let err = ep.handle_msg(t, PEER, inline_want(XferId(x), 1, runs)).unwrap_err();
        assert!(matches!(err, ProtocolError::InvalidData { .. }), "{err}");
        let acts = drain(&mut ep);
        assert!(inline_scatters(&acts).is_empty(), "{acts:?}");
        assert_eq!(acks(&acts), vec![(XferId(x), 0, AckStatus::Refused)]);
        assert_eq!((ep.remote_flows(), ep.arena_free_bytes()), (0, 32 * KIB));
        check(&ep);
    }
    assert_eq!(ep.stats().inline_taken, 0);
}

/// A captured WANT and its DATA sent again after their flow ended: the WANT's proofs still
/// check out (made with its own token), and the region it would get is likely the same one,
/// so its DATA would scatter whatever the region holds now into the old destinations. The
/// ended transfer's WANT is ignored (counted as forged), and its DATA finds no flow.
#[test]
fn a_replayed_want_and_its_data_after_the_flow_ended_scatter_nothing() {
    let (mut ep, t) = receiver();
    ep.handle_msg(t, PEER, want_msg(X, &[CHUNK])).unwrap();
    let r0 = credits(&drain(&mut ep))[0].3;
    let data = data_msg(X, 0, r0, vec![run(0, DST, CHUNK)]);
    ep.handle_msg(t, PEER, data.clone()).unwrap();
    let sc = scatters(&drain(&mut ep));
    ep.handle_scatter_done(t, sc[0].0, true);
    drain(&mut ep);
    assert_eq!(ep.remote_flows(), 0, "the flow ended");
    let replayed = ep.stats().control_replayed;
    let r = ep.handle_msg(t, PEER, want_msg(X, &[CHUNK]));
    assert!(matches!(r, Err(ProtocolError::Replayed { .. })), "{r:?}");
    assert!(credits(&drain(&mut ep)).is_empty(), "no GRANT for a replay");
    let _ = ep.handle_msg(t, PEER, data);
    assert!(scatters(&drain(&mut ep)).is_empty(), "a replayed DATA scatters nothing");
    assert_eq!(ep.stats().control_replayed, replayed + 1);
    // A later transfer of the same peer is served as usual.
    ep.handle_msg(t, PEER, want_msg(XferId(X.0 + 1), &[CHUNK])).unwrap();
    assert_eq!(credits(&drain(&mut ep)).len(), 1);
    check(&ep);
}

#[test]
fn a_replayed_or_older_inline_want_is_served_the_usual_way_and_puts_nothing() {
    let (mut ep, t) = receiver();
    let later = XferId(X.0 + 5);
    ep.handle_msg(t, PEER, inline_want(later, 1, full_run(0))).unwrap();
    let s = inline_scatters(&drain(&mut ep));
    ep.handle_scatter_done(t, s[0].0, true);
    drain(&mut ep);
    // The same frame again: its transfer ended here, so it is a replay, ignored.
    let r = ep.handle_msg(t, PEER, inline_want(later, 2, full_run(0)));
    assert!(matches!(r, Err(ProtocolError::Replayed { .. })), "{r:?}");
    assert!(drain(&mut ep).is_empty());
    // An older transfer's, never seen here: no bytes put, a GRANT instead (which a replay's
    // sender, long done, ignores: nothing is written without it).
    ep.handle_msg(t, PEER, inline_want(X, 2, full_run(0))).unwrap();
    let acts = drain(&mut ep);
    assert!(inline_scatters(&acts).is_empty(), "{acts:?}");
    assert_eq!(credits(&acts).iter().map(|c| (c.1, c.2)).collect::<Vec<_>>(), vec![(X, 0)]);
    assert_eq!(ep.stats().inline_taken, 1);
    check(&ep);
}

/// A peer that unloaded us (FORGET) keeps its id and session here, so its captured inline
/// WANT, replayed after the FORGET has reclaimed its flows, must still find its floor.
#[test]
fn an_inline_want_replayed_after_its_sender_forgot_us_puts_nothing() {
    let (mut ep, t) = receiver();
    ep.handle_msg(t, PEER, inline_want(X, 1, full_run(0))).unwrap();
    let s = inline_scatters(&drain(&mut ep));
    ep.handle_scatter_done(t, s[0].0, true);
    drain(&mut ep);
    ep.handle_forgotten(t, PEER);
    drain(&mut ep);
    let r = ep.handle_msg(t, PEER, inline_want(X, 2, full_run(0)));
    assert!(matches!(r, Err(ProtocolError::Replayed { .. })), "{r:?}");
    assert!(inline_scatters(&drain(&mut ep)).is_empty(), "the replay put its bytes again");
    assert_eq!(ep.stats().inline_taken, 1);
    check(&ep);
}

#[test]
fn inline_bytes_wait_for_a_busy_arena_within_their_budget_and_go_with_a_cancel() {
    let (mut ep, t) = receiver();
    // Fill the 32 KiB arena: eight flows of one chunk.
    for x in 10..18 {
        ep.handle_msg(t, PEER, want_msg(XferId(x), &[CHUNK])).unwrap();
    }
    drain(&mut ep);
    assert_eq!(ep.arena_free_bytes(), 0);
    ep.handle_msg(t, PEER, inline_want(XferId(20), 3, full_run(0))).unwrap();
    assert!(inline_scatters(&drain(&mut ep)).is_empty(), "held until a region frees");
    check(&ep);
    // A region frees: the held bytes take it.
    ep.handle_msg(t, PEER, Msg::cancel(XferId(10), TOKEN, Vec::new())).unwrap();
    let s = inline_scatters(&drain(&mut ep));
    assert_eq!((s.len(), s[0].2.as_ref().map(Vec::len)), (1, Some(CHUNK as usize)));
    check(&ep);
    // Held bytes of a flow canceled before its grant are dropped with it.
    ep.handle_msg(t, PEER, inline_want(XferId(21), 4, full_run(1))).unwrap();
    ep.handle_msg(t, PEER, Msg::cancel(XferId(21), TOKEN, Vec::new())).unwrap();
    ep.handle_msg(t, PEER, Msg::cancel(XferId(11), TOKEN, Vec::new())).unwrap();
    assert!(inline_scatters(&drain(&mut ep)).is_empty());
    assert_eq!(ep.receiver().inline_held, 0);
    check(&ep);
}

#[test]
fn a_receiver_that_takes_no_inline_bytes_grants_as_for_any_want() {
    let (mut ep, t) = receiver();
    ep.set_inline_bytes(0);
    ep.handle_msg(t, PEER, inline_want(X, 1, full_run(0))).unwrap();
    let acts = drain(&mut ep);
    assert!(inline_scatters(&acts).is_empty());
    assert_eq!(credits(&acts).len(), 1);
    check(&ep);
}

/// Inline chunks are taken per arena: into one that declines them (GPU memory, where the
/// shell could put no bytes) the WANT is granted as any other, while another arena of the
/// same engine still takes them.
#[test]
fn an_arena_that_declines_inline_chunks_grants_their_wants_and_another_takes_them() {
    let (mut ep, t) = receiver();
    assert_eq!(ep.add_arena(16 * KIB, KIB, CHUNK).unwrap(), ArenaId(1));
    ep.add_registered(REG_OF_1, KEY, (DST, 64 * KIB), ArenaId(1));
    ep.set_arena_takes_inline(ArenaId(1), false);
    ep.handle_msg(t, PEER, through(inline_want(X, 1, full_run(0)), 1)).unwrap();
    let acts = drain(&mut ep);
    assert!(inline_scatters(&acts).is_empty());
    assert_eq!(credits(&acts).len(), 1, "granted in arena 1 as for any WANT");
    ep.handle_msg(t, PEER, inline_want(XferId(9), 2, full_run(1))).unwrap();
    assert_eq!(inline_scatters(&drain(&mut ep)).len(), 1, "arena 0 still takes them");
    // And back: arena 1 takes them again once told so.
    ep.set_arena_takes_inline(ArenaId(1), true);
    ep.handle_msg(t, PEER, through(inline_want(XferId(10), 3, full_run(2)), 1)).unwrap();
    assert_eq!(inline_scatters(&drain(&mut ep)).len(), 1);
    check(&ep);
}

/// The mirror of a PULL for a WRITE flow: a WANT naming a live READ flow, even with the
/// flow's own token, is refused. Nothing is granted for it (a region granted to a READ flow
/// is gathered from its PULL's runs, and this chunk has none), and the READ goes on.
#[test]
fn a_want_for_a_live_read_flow_is_refused_and_the_read_goes_on() {
    let (mut ep, t) = receiver();
    ep.handle_msg(t, PEER, Msg::Pull(pull_of(REG, DST))).unwrap();
    let acts = drain(&mut ep);
    assert!(acts.iter().any(|a| matches!(a, Action::Gather { .. })), "{acts:?}");
    let key = FlowKey { peer: PEER, xfer: XferId(9) };
    let free = ep.schedulers().get(ArenaId(0)).free_bytes();
    let err = ep.handle_msg(t, PEER, want_msg(XferId(9), &[CHUNK])).unwrap_err();
    assert_eq!(err, ProtocolError::WantForReadFlow { peer: PEER, xfer: XferId(9) });
    let acts = drain(&mut ep);
    assert!(acts.is_empty(), "nothing granted, gathered or answered: {acts:?}");
    assert_eq!(ep.schedulers().get(ArenaId(0)).free_bytes(), free);
    assert_eq!((ep.remote_flows(), ep.scheduler().flow_held_count(key)), (1, 1));
    ep.receiver().check_invariants().unwrap();
    check(&ep);
}

/// Flow `xfer` of one chunk from `peer`, granted: its region.
fn granted_one(ep: &mut Endpoint, t: Instant, peer: PeerId, xfer: XferId) -> Region {
    ep.handle_msg(t, peer, want_msg(xfer, &[CHUNK])).unwrap();
    let c = credits(&drain(ep));
    assert_eq!(c.len(), 1, "{c:?}");
    c[0].3
}

/// Flow X scattering chunk 0 into the destination's first chunk, then released by its sender:
/// returns the orphaned scatter's job.
fn released_while_scattering(ep: &mut Endpoint, t: Instant) -> JobId {
    let [r0, _] = wanted(ep, t);
    ep.handle_msg(t, PEER, data_msg(X, 0, r0, full_run(0))).unwrap();
    let s = scatters(&drain(ep));
    assert_eq!(s.len(), 1);
    ep.handle_msg(t, PEER, Msg::cancel(X, TOKEN, Vec::new())).unwrap();
    assert!(drain(ep).is_empty());
    s[0].0
}

#[test]
fn a_released_flows_running_scatter_holds_back_its_peers_next_data_until_it_ends() {
    let (mut ep, t) = receiver();
    let old = released_while_scattering(&mut ep, t);
    // The peer's next transfer writes the same destination: its bytes must land last.
    let y = XferId(2);
    let r = granted_one(&mut ep, t, PEER, y);
    ep.handle_msg(t, PEER, data_msg(y, 0, r, full_run(0))).unwrap();
    let acts = drain(&mut ep);
    assert!(scatters(&acts).is_empty() && acks(&acts).is_empty(), "held behind the orphan: {acts:?}");
    assert_eq!(ep.stats().scatters_held, 1);
    ep.receiver().check_invariants().unwrap();
    ep.handle_scatter_done(t, old, true);
    let new = scatters(&drain(&mut ep));
    assert_eq!(new.iter().map(|s| s.1).collect::<Vec<_>>(), vec![r], "taken once the orphan ended");
    ep.receiver().check_invariants().unwrap();
    ep.handle_scatter_done(t, new[0].0, true);
    assert_eq!(acks(&drain(&mut ep)), vec![(y, 0, AckStatus::Scattered)]);
    assert_eq!(ep.arena_free_bytes(), 32 * KIB);
    assert!(ep.is_idle());
    ep.receiver().check_invariants().unwrap();
    check(&ep);
}

#[test]
fn an_orphaned_scatter_holds_back_only_its_own_peers_data() {
    let (mut ep, t) = receiver();
    let old = released_while_scattering(&mut ep, t);
    let other = PeerId(8);
    let r = granted_one(&mut ep, t, other, XferId(5));
    ep.handle_msg(t, other, data_msg(XferId(5), 0, r, full_run(1))).unwrap();
    let s = scatters(&drain(&mut ep));
    assert_eq!(s.iter().map(|s| s.1).collect::<Vec<_>>(), vec![r], "another peer's DATA is not held");
    assert_eq!(ep.stats().scatters_held, 0);
    ep.handle_scatter_done(t, s[0].0, true);
    ep.handle_scatter_done(t, old, true);
    assert_eq!(acks(&drain(&mut ep)), vec![(XferId(5), 0, AckStatus::Scattered)]);
    assert_eq!(ep.arena_free_bytes(), 32 * KIB);
    ep.receiver().check_invariants().unwrap();
}

#[test]
fn a_held_data_sent_twice_is_refused_and_a_held_flow_released_is_never_scattered() {
    let (mut ep, t) = receiver();
    let old = released_while_scattering(&mut ep, t);
    let (y, z) = (XferId(2), XferId(3));
    let ry = granted_one(&mut ep, t, PEER, y);
    let rz = granted_one(&mut ep, t, PEER, z);
    ep.handle_msg(t, PEER, data_msg(y, 0, ry, full_run(0))).unwrap();
    ep.handle_msg(t, PEER, data_msg(z, 0, rz, full_run(1))).unwrap();
    assert!(drain(&mut ep).is_empty());
    assert_eq!(ep.stats().scatters_held, 2);
    // A second DATA for a held chunk: refused like one for a region already scattering.
    let err = ep.handle_msg(t, PEER, data_msg(y, 0, ry, full_run(0))).unwrap_err();
    assert_eq!(err, ProtocolError::InvalidData { peer: PEER, xfer: y, chunk: ChunkIdx(0), fault: DataFault::NotHeld });
    assert_eq!(acks(&drain(&mut ep)), vec![(y, 0, AckStatus::Refused)]);
    // Z's sender releases it while its DATA waits: nothing of it is scattered.
    ep.handle_msg(t, PEER, Msg::cancel(z, TOKEN, Vec::new())).unwrap();
    ep.receiver().check_invariants().unwrap();
    ep.handle_scatter_done(t, old, true);
    let acts = drain(&mut ep);
    assert!(scatters(&acts).is_empty() && acks(&acts).is_empty(), "{acts:?}");
    assert_eq!((ep.remote_flows(), ep.stats().data_refused), (0, 1));
    ep.handle_timeout(t + TIMEOUT / 4);
    assert_eq!(ep.arena_free_bytes(), 32 * KIB, "every region freed or out of quarantine");
    ep.receiver().check_invariants().unwrap();
    check(&ep);
}

/// A READ posted after its initiator released a WRITE (the READ waits for that cancel) reads
/// what the released WRITE left: its gather waits for the peer's orphaned scatters, as a DATA
/// does, and its region cannot be released (nothing was announced) while it waits.
#[test]
fn a_released_flows_running_scatter_holds_back_its_peers_next_read_gather_until_it_ends() {
    let (mut ep, t) = receiver();
    let old = released_while_scattering(&mut ep, t);
    let key = FlowKey { peer: PEER, xfer: XferId(9) };
    ep.handle_msg(t, PEER, Msg::Pull(pull_of(REG, DST))).unwrap();
    let acts = drain(&mut ep);
    assert!(gathers(&acts).is_empty() && msgs(&acts).is_empty(), "held behind the orphan: {acts:?}");
    assert_eq!((ep.stats().gathers_held, ep.scheduler().flow_held_count(key)), (1, 1));
    ep.receiver().check_invariants().unwrap();
    // No RELEASE of any region frees it: none was announced.
    for off in (0..32).step_by(4) {
        let release = wire::Release {
            xfer: key.xfer,
            token: TOKEN,
            chunk: ChunkIdx(0),
            region: Region { offset: off * KIB, len: CHUNK },
        };
        let err = ep.handle_msg(t, PEER, Msg::Release(release)).unwrap_err();
        assert!(matches!(err, ProtocolError::BadRelease { .. }), "{err:?}");
    }
    assert_eq!(ep.scheduler().flow_held_count(key), 1);
    // Waiting for our own copies is not the initiator's silence.
    for k in 1..=8u32 {
        ep.handle_timeout(t + TIMEOUT * k / 4);
        assert_eq!((ep.remote_flows(), ep.stats().flows_timed_out), (1, 0), "at {k} quarters");
    }
    let later = t + TIMEOUT * 2;
    ep.handle_scatter_done(later, old, true);
    let g = gathers(&drain(&mut ep));
    assert_eq!(g.len(), 1, "gathered once the orphan ended");
    ep.handle_gather_done(later, g[0].0, true);
    let announced = credits(&drain(&mut ep));
    assert_eq!(announced.len(), 1);
    assert_eq!(announced[0].3, g[0].1, "the region gathered is announced");
    ep.receiver().check_invariants().unwrap();
    check(&ep);
}

/// A READ that failed (a chunk's gather failed) while a later chunk's gather waited behind its
/// peer's orphans: that region is freed when the orphans end, not gathered for a transfer
/// nobody will READ (review 59).
#[test]
fn a_failed_reads_held_gathers_are_freed_not_gathered() {
    let (mut ep, t) = receiver();
    let key = FlowKey { peer: PEER, xfer: XferId(9) };
    let chunk = |i: u64| wire::PullChunk { bytes: CHUNK, runs: vec![run(0, DST + i * CHUNK, CHUNK)].into() };
    let pull = wire::Pull { total: 3, chunks: (0..3).map(chunk).collect(), ..pull_of(REG, DST) };
    ep.handle_msg(t, PEER, Msg::Pull(pull)).unwrap();
    let g = gathers(&drain(&mut ep));
    assert_eq!(g.len(), 2, "W = 2 chunks gathered at once");
    // Another transfer of the peer's, released while scattering: its scatter is an orphan.
    let old = released_while_scattering(&mut ep, t);
    // Chunk 0 gathered and READ: its RELEASE frees a region, granted to chunk 2 and held.
    ep.handle_gather_done(t, g[0].0, true);
    let announced = credits(&drain(&mut ep));
    assert_eq!(announced.len(), 1);
    let release = wire::Release { xfer: key.xfer, token: TOKEN, chunk: ChunkIdx(0), region: announced[0].3 };
    ep.handle_msg(t, PEER, Msg::Release(release)).unwrap();
    assert!(gathers(&drain(&mut ep)).is_empty());
    assert_eq!(ep.stats().gathers_held, 1, "chunk 2's gather held");
    // Chunk 1's gather fails: the READ has failed.
    ep.handle_gather_done(t, g[1].0, false);
    assert_eq!(acks(&drain(&mut ep)), vec![(key.xfer, 1, AckStatus::Failed)]);
    ep.handle_scatter_done(t, old, true);
    let acts = drain(&mut ep);
    assert!(gathers(&acts).is_empty(), "a failed READ's held region gathered: {acts:?}");
    assert_eq!(ep.scheduler().flow_held_count(key), 0, "chunk 2's region freed");
    ep.receiver().check_invariants().unwrap();
    let cancel = wire::Pull { chunks: Vec::new(), proofs: Vec::new(), ..pull_of(REG, DST) };
    ep.handle_msg(t, PEER, Msg::Pull(cancel)).unwrap();
    ep.handle_timeout(t + TIMEOUT / 4);
    assert_eq!(ep.arena_free_bytes(), 32 * KIB, "every region freed or out of quarantine");
    ep.receiver().check_invariants().unwrap();
    check(&ep);
}

/// A PULL under an id of the standing flows' space is refused as forged (review 59, H1: each
/// id space has a replay window of its own, and no frame may file itself in the other).
#[test]
fn a_pull_with_the_standing_bit_is_refused() {
    let (mut ep, t) = receiver();
    let x = XferId(crate::sender::STANDING_XFER_BIT | 9);
    let err = ep.handle_msg(t, PEER, Msg::Pull(wire::Pull { xfer: x, ..pull_of(REG, DST) })).unwrap_err();
    assert_eq!(err, ProtocolError::StandingWant { peer: PEER, xfer: x });
    assert!(drain(&mut ep).is_empty());
    assert_eq!((ep.stats().control_forged, ep.remote_flows()), (1, 0));
}

#[test]
fn a_read_cancelled_while_its_gather_is_held_is_never_gathered() {
    let (mut ep, t) = receiver();
    let old = released_while_scattering(&mut ep, t);
    ep.handle_msg(t, PEER, Msg::Pull(pull_of(REG, DST))).unwrap();
    assert!(gathers(&drain(&mut ep)).is_empty());
    let cancel = wire::Pull { chunks: Vec::new(), proofs: Vec::new(), ..pull_of(REG, DST) };
    ep.handle_msg(t, PEER, Msg::Pull(cancel)).unwrap();
    ep.receiver().check_invariants().unwrap();
    ep.handle_scatter_done(t, old, true);
    let acts = drain(&mut ep);
    assert!(gathers(&acts).is_empty(), "{acts:?}");
    assert_eq!(ep.remote_flows(), 0);
    ep.handle_timeout(t + TIMEOUT / 4);
    assert_eq!(ep.arena_free_bytes(), 32 * KIB, "every region freed or out of quarantine");
    ep.receiver().check_invariants().unwrap();
    check(&ep);
}

#[test]
fn a_held_data_keeps_its_flow_alive_however_long_it_waits() {
    let (mut ep, t) = receiver();
    let old = released_while_scattering(&mut ep, t);
    let y = XferId(2);
    let r = granted_one(&mut ep, t, PEER, y);
    ep.handle_msg(t + TIMEOUT / 4, PEER, data_msg(y, 0, r, full_run(0))).unwrap();
    assert!(scatters(&drain(&mut ep)).is_empty(), "held");
    // Its sender did its part: waiting for our own copies, the flow is never taken as silent.
    for k in 1..=8u32 {
        ep.handle_timeout(t + TIMEOUT * k / 4);
        assert_eq!((ep.remote_flows(), ep.stats().flows_timed_out), (1, 0), "at {k} quarters");
    }
    ep.handle_scatter_done(t + TIMEOUT * 2, old, true);
    let s = scatters(&drain(&mut ep));
    assert_eq!(s.iter().map(|s| s.1).collect::<Vec<_>>(), vec![r]);
    ep.receiver().check_invariants().unwrap();
}

#[test]
fn a_data_that_fails_its_checks_is_refused_at_once_even_while_its_peer_waits() {
    let (mut ep, t) = receiver();
    let old = released_while_scattering(&mut ep, t);
    let y = XferId(2);
    let r = granted_one(&mut ep, t, PEER, y);
    // Its runs copy more than the chunk: refused now, not held (nothing kept of it).
    let runs = vec![CopyRun { region_off: 0, addr: DST, len: 1, count: 100_000, region_stride: 0, addr_stride: 0 }];
    let err = ep.handle_msg(t, PEER, data_msg(y, 0, r, runs)).unwrap_err();
    assert!(matches!(err, ProtocolError::InvalidData { fault: DataFault::TooManyBytes { .. }, .. }), "{err:?}");
    assert_eq!((ep.stats().scatters_held, ep.stats().data_refused), (0, 1));
    ep.receiver().check_invariants().unwrap();
    ep.handle_scatter_done(t, old, true);
    assert!(scatters(&drain(&mut ep)).is_empty());
}

#[test]
fn a_held_datas_runs_count_in_its_peers_budget_and_over_it_are_asked_for_again() {
    let (mut ep, t) = receiver();
    let old = released_while_scattering(&mut ep, t);
    let (y, z) = (XferId(2), XferId(3));
    let ry = granted_one(&mut ep, t, PEER, y);
    let rz = granted_one(&mut ep, t, PEER, z);
    // The two flows announced one chunk each: room for one more unit only.
    ep.receiver_mut().set_peer_caps(MAX_FLOWS_PER_PEER, 3);
    ep.handle_msg(t, PEER, data_msg(y, 0, ry, full_run(0))).unwrap();
    ep.handle_msg(t, PEER, data_msg(z, 0, rz, full_run(1))).unwrap();
    assert_eq!(ep.stats().scatters_held, 2);
    ep.receiver().check_invariants().unwrap();
    ep.handle_scatter_done(t, old, true);
    let acts = drain(&mut ep);
    // Y's runs were kept: scattered. Z's did not fit: asked for again, its region kept.
    assert_eq!(scatters(&acts).iter().map(|s| s.1).collect::<Vec<_>>(), vec![ry]);
    assert_eq!(acks(&acts), vec![(z, 0, AckStatus::Replan)]);
    ep.handle_msg(t, PEER, data_msg(z, 0, rz, full_run(1))).unwrap();
    assert_eq!(scatters(&drain(&mut ep)).iter().map(|s| s.1).collect::<Vec<_>>(), vec![rz]);
    ep.receiver().check_invariants().unwrap();
}

/// Review 62 (success, L1): an inline chunk held behind an orphaned scatter whose runs no
/// longer fit its peer's budget is refused when it is taken again, so its sender fails at once.
/// It was answered ACK(Replan), which an inline transfer cannot act on (it has no credit to
/// send its runs with): it waited out its timeout, the region held meanwhile.
#[test]
fn an_inline_chunk_held_whose_runs_no_longer_fit_is_refused_not_asked_for_again() {
    let (mut ep, t) = receiver();
    let old = released_while_scattering(&mut ep, t);
    // The rest of the arena held by other flows (unwritten regions).
    for (z, chunks) in [(20, 2), (21, 2), (22, 2), (23, 1)] {
        ep.handle_msg(t, PEER, want_msg(XferId(z), &vec![CHUNK; chunks])).unwrap();
        assert_eq!(credits(&drain(&mut ep)).len(), chunks, "flow {z} granted");
    }
    // The inline WANT is taken (its runs within the budget) and waits for a region.
    let y = XferId(30);
    ep.handle_msg(t, PEER, inline_want(y, 0x5a, full_run(1))).unwrap();
    assert!(inline_scatters(&drain(&mut ep)).is_empty(), "no region free yet");
    // Meanwhile the peer's budget shrinks below what the held chunk's runs need again.
    ep.receiver_mut().set_peer_caps(MAX_FLOWS_PER_PEER, 4);
    // A flow ends: the inline chunk is granted a region, put, and held behind the orphan.
    ep.handle_msg(t, PEER, Msg::cancel(XferId(20), TOKEN, Vec::new())).unwrap();
    ep.handle_timeout(t + TIMEOUT / 4);
    let acts = drain(&mut ep);
    assert!(inline_scatters(&acts).is_empty() && acks(&acts).is_empty(), "held: {acts:?}");
    assert_eq!(ep.stats().scatters_held, 1);
    ep.handle_scatter_done(t + TIMEOUT / 4, old, true);
    let acts = drain(&mut ep);
    assert!(inline_scatters(&acts).is_empty(), "{acts:?}");
    assert_eq!(acks(&acts), vec![(y, 0, AckStatus::Refused)], "failed at once, not asked for runs it cannot send");
    // (The caps lowered under the peer's flows: put back before the load's recount.)
    ep.receiver_mut().set_peer_caps(MAX_FLOWS_PER_PEER, MAX_CHUNKS_PER_PEER);
    ep.receiver().check_invariants().unwrap();
}
