//! The sender's unit tests, through an [`crate::endpoint::Endpoint`] driven by hand.

use super::read::{PULL_FRAME_RUNS, pull_frames};
use super::*;
use crate::endpoint::Endpoint;
use crate::endpoint::WriteRoute;
use crate::endpoint::tests::*;
use crate::plan::{self, DescPair, PlanParams};
use crate::types::CopyRun;

fn r(kib: u64) -> Region {
    Region { offset: kib * KIB, len: CHUNK }
}

/// A READ's PULLs: its first chunk alone, then whole chunks up to PULL_FRAME_RUNS runs a
/// PULL, a chunk with more alone; every chunk exactly once, in order.
#[test]
fn a_read_is_pulled_first_chunk_alone_then_in_frames_of_whole_chunks() {
    let run = CopyRun { region_off: 0, addr: SRC, len: 1, count: 1, region_stride: 0, addr_stride: 0 };
    let chunk = |runs: usize| crate::plan::Chunk { gather: Arc::new(vec![run; runs]), ..Default::default() };
    let runs = [600, 600, 400, 30, 2000, 1, 1024, 1];
    let chunks: Vec<_> = runs.iter().map(|&n| chunk(n)).collect();
    let frames: Vec<(usize, usize)> = pull_frames(&chunks).map(|(first, part)| (first, part.len())).collect();
    // 600 + 400 fit in one; 30 + 2000 do not; 2000 and 1024 + 1 go alone.
    assert_eq!(frames, [(0, 1), (1, 2), (3, 1), (4, 1), (5, 1), (6, 1), (7, 1)]);
    let mut next = 0;
    for &(first, n) in &frames {
        assert_eq!(first, next, "in order, none skipped");
        assert!(n == 1 || runs[first..first + n].iter().sum::<usize>() <= PULL_FRAME_RUNS);
        next = first + n;
    }
    assert_eq!(next, runs.len());
    let one: Vec<_> = pull_frames(&chunks[..1]).map(|(f, p)| (f, p.len())).collect();
    assert_eq!(one, [(0, 1)]);
}

fn is_cancel(m: &Msg, xfer: XferId) -> bool {
    matches!(m, Msg::Want(w) if w.is_cancel() && w.xfer == xfer && w.token == TOKEN)
}

/// Feeds `msg` from `PEER` and returns the resulting actions.
fn feed(ep: &mut Endpoint, now: Instant, msg: Msg) -> Vec<Action> {
    ep.handle_msg(now, PEER, msg).unwrap();
    drain(ep)
}

#[test]
fn a_chunks_plan_follows_its_write_when_its_credit_comes_and_a_replan_sends_the_runs_with_the_data() {
    let now = Instant::now();
    let cfg = Config { plan_ahead_runs: 1, ..config(64 * KIB, 2, true) };
    let mut ep = Endpoint::new(&cfg, now, PROBE_KEY).unwrap();
    let t = now;
    let plan = direct_plan_of(3);
    let runs = |i: usize| plan.chunks[i].scatter.clone();
    ep.submit(t, X, TOKEN, PEER, plan.clone()).unwrap();
    // The WANT alone: no plan crosses the control channel while the WANT and GRANT do.
    let sent: Vec<Msg> = msgs(&drain(&mut ep)).into_iter().map(|(_, m)| m).collect();
    assert!(matches!(&sent[..], [Msg::Want(_)]), "{sent:?}");
    let plan_msg = |i: u32| Msg::Plan(wire::Plan { xfer: X, token: TOKEN, chunk: ChunkIdx(i), runs: runs(i as usize) });
    // Credits for chunks 0 and 1: both writes are posted first, then both plans.
    let acts = feed(&mut ep, t, grant_msg(X, &[(0, r(0)), (1, r(4))]));
    let w = writes(&acts);
    assert_eq!(w.len(), 2);
    let first_send = acts.iter().position(|a| matches!(a, Action::Send { .. })).unwrap();
    let last_write = acts.iter().rposition(|a| matches!(a, Action::Write { .. })).unwrap();
    assert!(last_write < first_send, "writes before plans: {acts:?}");
    assert_eq!(msgs(&acts).into_iter().map(|(_, m)| m).collect::<Vec<_>>(), [plan_msg(0), plan_msg(1)]);
    assert_eq!(ep.stats().plans_sent, 2);
    // Chunk 0 written: its DATA names no runs.
    ep.handle_write_done(t, w[0].0, true);
    let sent: Vec<Msg> = msgs(&drain(&mut ep)).into_iter().map(|(_, m)| m).collect();
    assert_eq!(sent, [data_msg(X, 0, r(0), Vec::new())]);
    // The receiver kept no plan: the same DATA again, with its runs.
    let sent = msgs(&feed(&mut ep, t, ack_msg(X, 0, r(0), AckStatus::Replan)));
    assert_eq!(sent, [(PEER, data_msg(X, 0, r(0), runs(0)))]);
    assert_eq!(ep.stats().replans, 1);
    assert!(feed(&mut ep, t, ack_msg(X, 0, r(0), AckStatus::Scattered)).is_empty());
    assert_eq!(ep.sender().acked_chunks(X), Some(1));
    // Chunk 2's credit brings its plan; a second credit for a planned chunk cannot come.
    let acts = feed(&mut ep, t, grant_msg(X, &[(2, r(0))]));
    assert_eq!(msgs(&acts).into_iter().map(|(_, m)| m).collect::<Vec<_>>(), [plan_msg(2)]);
    assert_eq!(ep.stats().plans_sent, 3);
}

#[test]
fn eager_lifecycle_gathers_before_the_grant_and_completes_after_every_ack() {
    let (mut ep, t) = endpoint(64 * KIB, 2, true);
    ep.set_local_endpoint(b"tcp://me".to_vec());
    ep.submit(t, X, TOKEN, PEER, plan_of(3)).unwrap();
    let acts = drain(&mut ep);
    // WANT first, then eager gathers of the first W chunks, staged under the eager budget.
    let Action::Send { peer, msg: Msg::Want(w) } = &acts[0] else { panic!("{acts:?}") };
    assert_eq!((*peer, w.xfer, &w.chunks[..], &w.endpoint[..]), (PEER, X, &[CHUNK; 3][..], &b"tcp://me"[..]));
    let g = gathers(&acts);
    assert_eq!(g.len(), 2);
    assert_eq!(ep.scheduler().eager_bytes(), 2 * CHUNK + CHUNK, "two chunks and the reserve");

    // Credits for chunks 0 and 1 promote the eager regions; nothing to do until gathers end.
    assert!(feed(&mut ep, t, grant_msg(X, &[(0, r(0)), (1, r(4))])).is_empty());
    assert_eq!(ep.scheduler().eager_bytes(), CHUNK, "only the reserve");
    ep.handle_gather_done(t, g[0].0, true);
    let w0 = writes(&drain(&mut ep));
    assert_eq!(w0, vec![(w0[0].0, WriteSource::Arena(g[0].1), r(0), CHUNK)]);
    ep.handle_gather_done(t, g[1].0, true);
    let w1 = writes(&drain(&mut ep));

    // Write done -> DATA with the credit's region and the chunk's scatter runs.
    ep.handle_write_done(t, w0[0].0, true);
    let m = msgs(&drain(&mut ep));
    let Msg::Data(d) = &m[0].1 else { panic!("{m:?}") };
    assert_eq!((d.chunk, d.region, d.runs[0].addr), (ChunkIdx(0), r(0), DST));
    ep.handle_write_done(t, w1[0].0, true);
    drain(&mut ep);

    // A write done gives its staging back (the bytes are in the peer's region); the ACK
    // holds nothing of ours. The next credit gathers on arrival.
    assert_eq!(ep.scheduler().local_bytes(), CHUNK, "only the reserve");
    assert!(feed(&mut ep, t, ack_msg(X, 0, r(0), AckStatus::Scattered)).is_empty());
    let g2 = gathers(&feed(&mut ep, t, grant_msg(X, &[(2, r(0))])));
    assert_eq!(g2.len(), 1);
    assert_eq!(ep.scheduler().eager_bytes(), CHUNK, "credit-backed staging is not eager");
    ep.handle_gather_done(t, g2[0].0, true);
    let w2 = writes(&drain(&mut ep));
    ep.handle_write_done(t, w2[0].0, true);
    drain(&mut ep);
    feed(&mut ep, t, ack_msg(X, 1, r(4), AckStatus::Scattered));
    check(&ep);
    let acts = feed(&mut ep, t, ack_msg(X, 2, r(0), AckStatus::Scattered));
    assert_eq!(completes(&acts), vec![(X, Ok(()))]);
    assert!(ep.is_idle());
    assert_eq!(ep.arena_free_bytes(), 64 * KIB);
    assert_eq!(ep.poll_timeout(), None);
    assert_eq!((ep.stats().chunks_written, ep.stats().bytes_written), (3, 3 * CHUNK));
}

/// The two control round trips are timed from the pass that sent to the pass that read the
/// answer: WANT -> first GRANT once per WRITE (a later GRANT refills the window and is
/// not one), DATA -> ACK once per scattered chunk, from the DATA sent last (a replan's).
#[test]
fn the_want_grant_and_data_ack_round_trips_are_timed_by_the_time_passed_in() {
    let us = Duration::from_micros;
    let (mut ep, t) = endpoint(64 * KIB, 1, false);
    ep.submit(t, X, TOKEN, PEER, plan_of(2)).unwrap();
    drain(&mut ep);
    let g = gathers(&feed(&mut ep, t + us(7), grant_msg(X, &[(0, r(0))])));
    assert_eq!((ep.stats().grant_waits, ep.stats().grant_wait_ns), (1, 7_000));
    ep.handle_gather_done(t + us(8), g[0].0, true);
    let w = writes(&drain(&mut ep));
    ep.handle_write_done(t + us(10), w[0].0, true);
    drain(&mut ep);
    // A replan at +20 sends the DATA again: the round trip counts from there.
    feed(&mut ep, t + us(20), ack_msg(X, 0, r(0), AckStatus::Replan));
    feed(&mut ep, t + us(31), ack_msg(X, 0, r(0), AckStatus::Scattered));
    assert_eq!((ep.stats().ack_waits, ep.stats().ack_wait_ns), (1, 11_000));
    // Chunk 1's credit refills the window: no WANT went before it.
    let g = gathers(&feed(&mut ep, t + us(40), grant_msg(X, &[(1, r(0))])));
    assert_eq!((ep.stats().grant_waits, ep.stats().grant_wait_ns), (1, 7_000));
    ep.handle_gather_done(t + us(41), g[0].0, true);
    let w = writes(&drain(&mut ep));
    ep.handle_write_done(t + us(45), w[0].0, true);
    drain(&mut ep);
    let acts = feed(&mut ep, t + us(50), ack_msg(X, 1, r(0), AckStatus::Scattered));
    assert_eq!(completes(&acts), vec![(X, Ok(()))]);
    assert_eq!((ep.stats().ack_waits, ep.stats().ack_wait_ns), (2, 16_000));
}

/// The WANT of an inline submission carries the chunk's bytes and runs and nothing is
/// staged; the ACK alone completes it (timed from the WANT). Declined (a GRANT comes
/// instead), the chunk goes the usual way, and its ACK must then name the granted region.
#[test]
fn an_inline_chunk_rides_in_its_want_and_its_ack_alone_completes_it_or_a_grant_sends_it_the_usual_way() {
    let us = Duration::from_micros;
    for declined in [false, true] {
        let (mut ep, t) = endpoint(64 * KIB, 2, true);
        let bytes = vec![0x5a; CHUNK as usize];
        ep.submit_write(t, X, TOKEN, PEER, plan_of(1), WriteRoute::inline(bytes.clone())).unwrap();
        let acts = drain(&mut ep);
        assert!(gathers(&acts).is_empty(), "nothing staged, even eagerly: {acts:?}");
        let [(_, Msg::Want(w))] = &msgs(&acts)[..] else { panic!("one WANT: {acts:?}") };
        let inline = w.inline.as_ref().expect("inline");
        assert_eq!((&inline.bytes, &inline.runs), (&bytes, &plan_of(1).chunks[0].scatter));
        assert_eq!(ep.stats().inline_sent, 1);
        if !declined {
            let acts = feed(&mut ep, t + us(9), ack_msg(X, 0, r(12), AckStatus::Scattered));
            assert_eq!(completes(&acts), vec![(X, Ok(()))]);
            assert_eq!((ep.stats().inline_acks, ep.stats().inline_ack_wait_ns), (1, 9_000));
            assert_eq!((ep.stats().chunks_written, ep.stats().grant_waits), (0, 0));
        } else {
            let g = gathers(&feed(&mut ep, t, grant_msg(X, &[(0, r(8))])));
            assert_eq!((g.len(), ep.stats().inline_declined), (1, 1));
            ep.handle_gather_done(t, g[0].0, true);
            let w = writes(&drain(&mut ep));
            ep.handle_write_done(t, w[0].0, true);
            drain(&mut ep);
            // Now only an ACK for the granted region ends it.
            assert!(ep.handle_msg(t, PEER, ack_msg(X, 0, r(12), AckStatus::Scattered)).is_err());
            let acts = feed(&mut ep, t, ack_msg(X, 0, r(8), AckStatus::Scattered));
            assert_eq!(completes(&acts), vec![(X, Ok(()))]);
            assert_eq!((ep.stats().chunks_written, ep.stats().inline_acks), (1, 0));
        }
        assert!(ep.is_idle());
        assert_eq!(ep.arena_free_bytes(), 64 * KIB);
        check(&ep);
    }
}

#[test]
fn inline_bytes_that_are_not_the_plans_one_chunk_are_not_sent() {
    let (mut ep, t) = endpoint(64 * KIB, 2, false);
    // Two chunks; then one chunk with bytes of another length.
    ep.submit_write(t, X, TOKEN, PEER, plan_of(2), WriteRoute::inline(vec![0; 2 * CHUNK as usize])).unwrap();
    let short = WriteRoute::inline(vec![0; CHUNK as usize - 1]);
    ep.submit_write(t, XferId(2), TOKEN, PEER, plan_of(1), short).unwrap();
    for (_, m) in msgs(&drain(&mut ep)) {
        let Msg::Want(w) = m else { panic!("{m:?}") };
        assert!(w.inline.is_none());
    }
    assert_eq!(ep.stats().inline_sent, 0);
}

/// A plan stages in the arena it names (its gathers and the write read there; the reserve
/// is that arena's) and bounces through the peer's arena it names; one naming an arena we
/// lack is refused at submit, changing nothing.
/// Each arena stages chunks up to its own max chunk (a host arena's 2 MiB, a GPU arena's
/// 32 MiB by default): a plan of larger chunks is taken through an arena added with them
/// and refused through the first, whose max chunk is the configuration's.
#[test]
fn each_arena_stages_chunks_up_to_its_own_max_chunk() {
    let (mut ep, t) = endpoint(64 * KIB, 2, false);
    assert_eq!(ep.add_arena(64 * KIB, KIB, 4 * CHUNK).unwrap(), ArenaId(1));
    let big = |xfer: u64, arena: u8| {
        let descs: Vec<crate::plan::DescPair> = (0..2)
            .map(|i| crate::plan::DescPair { src: SRC + i * 2 * CHUNK, dst: DST + i * 2 * CHUNK, len: 2 * CHUNK })
            .collect();
        let mut p = crate::plan::plan(&descs, crate::plan::PlanParams::new(4 * CHUNK)).unwrap();
        p.dests = vec![crate::proof::Destination { reg: REG, key: KEY }];
        p.local_arena = ArenaId(arena);
        assert_eq!(p.chunks.len(), 1, "one chunk of {} bytes", p.chunks[0].bytes);
        p.chunks[0].direct = None; // staged, not written from its (contiguous) sources
        (XferId(xfer), p)
    };
    let (x, p) = big(1, 0);
    assert!(matches!(ep.submit(t, x, TOKEN, PEER, p), Err(SubmitError::ChunkTooLarge { max: CHUNK, .. })));
    let (x, p) = big(2, 1);
    ep.submit(t, x, TOKEN, PEER, p).unwrap();
    drain(&mut ep);
    assert_eq!(ep.schedulers().get(ArenaId(1)).local_bytes(), 4 * CHUNK, "its reserve: one chunk of its size");
}

#[test]
fn a_transfer_stages_in_its_own_arena_and_writes_into_the_peers_it_names() {
    let (mut ep, t) = endpoint(64 * KIB, 2, false);
    let through = |local: u8, peer: u8| {
        let mut p = plan_of(1);
        (p.local_arena, p.peer_arena) = (ArenaId(local), ArenaId(peer));
        p
    };
    let refused = ep.submit(t, XferId(9), TOKEN, PEER, through(1, 0));
    assert_eq!(refused, Err(SubmitError::NoSuchArena { xfer: XferId(9), arena: ArenaId(1) }));
    assert!(drain(&mut ep).is_empty() && ep.is_idle());
    assert_eq!(ep.add_arena(16 * KIB, KIB, CHUNK).unwrap(), ArenaId(1));
    ep.submit(t, X, TOKEN, PEER, through(1, 3)).unwrap();
    let wants: Vec<ArenaId> = msgs(&drain(&mut ep))
        .into_iter()
        .filter_map(|(_, m)| if let Msg::Want(w) = m { Some(w.arena) } else { None })
        .collect();
    assert_eq!(wants, vec![ArenaId(3)]);
    let (first, second) = (ep.schedulers().get(ArenaId(0)), ep.schedulers().get(ArenaId(1)));
    assert_eq!((first.local_bytes(), second.local_bytes()), (0, CHUNK), "the reserve is the staging arena's");
    let acts = feed(&mut ep, t, grant_msg(X, &[(0, r(8))]));
    let gather = acts.iter().find_map(|a| match a {
        Action::Gather { job, arena, .. } => Some((*job, *arena)),
        _ => None,
    });
    let (job, arena) = gather.expect("a gather");
    assert_eq!(arena, ArenaId(1));
    ep.handle_gather_done(t, job, true);
    let acts = drain(&mut ep);
    let write = acts.iter().find_map(|a| match a {
        Action::Write { job, arena, remote_arena, .. } => Some((*job, *arena, *remote_arena)),
        _ => None,
    });
    let (job, arena, remote_arena) = write.expect("a write");
    assert_eq!((arena, remote_arena), (ArenaId(1), ArenaId(3)));
    ep.handle_write_done(t, job, true);
    drain(&mut ep);
    let acts = feed(&mut ep, t, ack_msg(X, 0, r(8), AckStatus::Scattered));
    assert_eq!(completes(&acts), vec![(X, Ok(()))]);
    // Done: the staging region and the reserve are back in arena 1.
    assert_eq!(ep.schedulers().get(ArenaId(1)).free_bytes(), 16 * KIB);
    assert_eq!(ep.arena_free_bytes(), 80 * KIB);
    for (_, sched) in ep.schedulers().iter() {
        sched.check_invariants().unwrap();
    }
}

#[test]
fn non_eager_gathers_only_when_a_credit_arrives() {
    let (mut ep, t) = endpoint(64 * KIB, 2, false);
    ep.submit(t, X, TOKEN, PEER, plan_of(2)).unwrap();
    let acts = drain(&mut ep);
    assert_eq!(acts.len(), 1, "only the WANT: {acts:?}");
    assert_eq!(ep.scheduler().local_bytes(), CHUNK, "only the reserve");
    let g = gathers(&feed(&mut ep, t, grant_msg(X, &[(1, r(8))])));
    assert_eq!(g.len(), 1);
    ep.handle_gather_done(t, g[0].0, true);
    let w = writes(&drain(&mut ep));
    assert_eq!(w[0].2, r(8), "credits bind to their own chunk, in any order");
}

#[test]
fn credit_is_parked_when_the_local_arena_is_full_and_staged_after_a_release() {
    // The arena holds one chunk: the second credit must wait for the first write.
    let (mut ep, t) = endpoint(4 * KIB, 2, false);
    ep.submit(t, X, TOKEN, PEER, plan_of(2)).unwrap();
    drain(&mut ep);
    let g = gathers(&feed(&mut ep, t, grant_msg(X, &[(0, r(0)), (1, r(4))])));
    assert_eq!(g.len(), 1);
    assert_eq!(ep.sender().parked_credits(), 1);
    ep.handle_gather_done(t, g[0].0, true);
    let w = writes(&drain(&mut ep));
    ep.handle_write_done(t, w[0].0, true);
    let g1 = gathers(&drain(&mut ep));
    assert_eq!(g1.len(), 1, "the region freed with the write goes to the parked credit");
    assert_eq!(ep.sender().parked_credits(), 0);
    assert!(gathers(&feed(&mut ep, t, ack_msg(X, 0, r(0), AckStatus::Scattered))).is_empty());
    check(&ep);
}

/// A transfer of one 1 KiB chunk: descriptor `i`'s own piece.
fn small_plan(i: u64) -> Plan {
    let desc = DescPair { src: SRC + i * KIB, dst: DST + i * KIB, len: KIB };
    let mut p = plan::plan(&[desc], PlanParams::new(CHUNK)).unwrap();
    p.chunks[0].direct = None;
    p.dests = vec![crate::proof::Destination { reg: REG, key: KEY }];
    p
}

/// A 4 KiB credit parked in a full arena whose space comes back in 1 KiB pieces used to see
/// every piece go to the 1 KiB credits parked behind it (first fit), and failed at a quarter
/// timeout while the engine was making progress (review 52, sender F4). Once it has waited an
/// eighth of a timeout, the credits behind it wait too, and the pieces coalesce for it.
#[test]
fn a_large_parked_credit_is_not_starved_by_smaller_ones_behind_it() {
    // 8 KiB of 1 KiB granules: the 4 KiB reserve and four 1 KiB staging regions.
    let (mut ep, t) = endpoint(8 * KIB, 2, false);
    let small = |i: u64| XferId(10 + i);
    let remote = |i: u64| Region { offset: 32 * KIB + i * KIB, len: KIB };
    // Four small transfers stage in the four free KiB; then L takes the reserve, and M parks.
    let mut small_writes = Vec::new();
    for i in 0..4 {
        ep.submit(t, small(i), TOKEN, PEER, small_plan(i)).unwrap();
        drain(&mut ep);
        let g = gathers(&feed(&mut ep, t, grant_msg(small(i), &[(0, remote(i))])));
        assert_eq!(g.len(), 1, "small transfer {i} stages");
        ep.handle_gather_done(t, g[0].0, true);
        small_writes.push(writes(&drain(&mut ep))[0].0);
    }
    let (l, m) = (XferId(2), XferId(3));
    ep.submit(t, l, TOKEN, PEER, plan_of(1)).unwrap();
    ep.submit(t, m, TOKEN, PEER, plan_of(1)).unwrap();
    drain(&mut ep);
    assert_eq!(gathers(&feed(&mut ep, t, grant_msg(l, &[(0, r(0))]))).len(), 1, "L stages in the reserve");
    assert!(gathers(&feed(&mut ep, t, grant_msg(m, &[(0, r(4))]))).is_empty());
    // Four more small transfers' credits park behind M.
    let later = t + TIMEOUT / 8;
    for i in 4..8 {
        ep.submit(later, small(i), TOKEN, PEER, small_plan(i)).unwrap();
        drain(&mut ep);
        assert!(gathers(&feed(&mut ep, later, grant_msg(small(i), &[(0, remote(i))]))).is_empty());
    }
    assert_eq!(ep.sender().parked_credits(), 5);
    // The first four small writes end one by one, each freeing 1 KiB: M has waited an eighth
    // of a timeout, so none goes to the small credits behind it, and the fourth makes the
    // 4 KiB block M fits.
    let mut staged = Vec::new();
    for w in &small_writes {
        ep.handle_write_done(later, *w, true);
        staged.extend(drain(&mut ep).into_iter().filter_map(|a| match a {
            Action::Gather { xfer, .. } => Some(xfer),
            _ => None,
        }));
    }
    assert_eq!(staged, vec![m], "M is staged, and nothing before it");
    assert_eq!(ep.sender().parked_credits(), 4);
    check(&ep);
}

#[test]
fn a_credit_that_finds_the_arena_full_of_remote_grants_takes_the_reserve() {
    let (mut ep, t) = endpoint(8 * KIB, 2, false);
    ep.submit(t, X, TOKEN, PEER, plan_of(2)).unwrap();
    drain(&mut ep);
    assert_eq!(ep.scheduler().local_bytes(), CHUNK, "the reserve is taken before any grant");
    // The peer also writes to us, and its credits take the rest of the arena.
    ep.handle_msg(t, PEER, want_msg(XferId(50), &[CHUNK; 4])).unwrap();
    drain(&mut ep);
    assert_eq!(ep.arena_free_bytes(), 0);
    let g = gathers(&feed(&mut ep, t, grant_msg(X, &[(0, r(0)), (1, r(4))])));
    assert_eq!(g.len(), 1, "chunk 0 is staged in the reserve");
    assert_eq!(ep.sender().parked_credits(), 1);
    ep.handle_gather_done(t, g[0].0, true);
    let w = writes(&drain(&mut ep));
    ep.handle_write_done(t, w[0].0, true);
    // Its write done frees the region: the parked credit takes it before the remote flow does.
    let g1 = gathers(&drain(&mut ep));
    assert_eq!(g1.len(), 1);
    assert!(gathers(&feed(&mut ep, t, ack_msg(X, 0, r(0), AckStatus::Scattered))).is_empty());
    ep.handle_gather_done(t, g1[0].0, true);
    let w = writes(&drain(&mut ep));
    ep.handle_write_done(t, w[0].0, true);
    drain(&mut ep);
    let acts = feed(&mut ep, t, ack_msg(X, 1, r(4), AckStatus::Scattered));
    assert_eq!(completes(&acts), vec![(X, Ok(()))]);
    // With no transfer left the reserve goes back, straight to the waiting remote flow.
    assert_eq!(ep.scheduler().local_bytes(), 0);
    assert_eq!(ep.scheduler().flow_held_count(crate::types::FlowKey { peer: PEER, xfer: XferId(50) }), 2);
    check(&ep);
}

#[test]
fn cancel_completes_at_once_but_retracts_credits_only_after_in_flight_writes() {
    let (mut ep, t) = endpoint(64 * KIB, 2, true);
    ep.submit(t, X, TOKEN, PEER, plan_of(3)).unwrap();
    let g = gathers(&drain(&mut ep));
    feed(&mut ep, t, grant_msg(X, &[(0, r(0))]));
    ep.handle_gather_done(t, g[0].0, true);
    let w = writes(&drain(&mut ep));

    ep.cancel(t, X);
    let acts = drain(&mut ep);
    assert_eq!(completes(&acts), vec![(X, Err(XferError::Canceled))]);
    assert!(msgs(&acts).is_empty(), "no cancel while a write may still land: {acts:?}");
    // Chunk 0's write and chunk 1's gather are in flight: their regions are orphans.
    assert_eq!(ep.orphans(), 2);
    assert_eq!(ep.scheduler().local_bytes(), 2 * CHUNK);

    ep.handle_write_done(t, w[0].0, true);
    let m = msgs(&drain(&mut ep));
    assert!(m.len() == 1 && is_cancel(&m[0].1, X), "{m:?}");
    ep.handle_gather_done(t, g[1].0, true);
    assert!(drain(&mut ep).is_empty());
    assert!(ep.is_idle());
    assert_eq!(ep.arena_free_bytes(), 64 * KIB);
    // A second cancel, or a late credit, is harmless.
    ep.cancel(t, X);
    assert!(feed(&mut ep, t, grant_msg(X, &[(1, r(4))])).is_empty());
    assert_eq!(ep.stats().late_msgs, 1);
}

#[test]
fn no_progress_for_the_request_timeout_fails_the_transfer_and_cancels_it() {
    let (mut ep, t) = endpoint(64 * KIB, 2, false);
    ep.submit(t, X, TOKEN, PEER, plan_of(2)).unwrap();
    drain(&mut ep);
    assert_eq!(ep.poll_timeout(), Some(t + TIMEOUT));
    ep.handle_timeout(t + TIMEOUT / 2);
    assert!(drain(&mut ep).is_empty(), "an early call is harmless");
    // A credit is progress: the deadline moves.
    let half = t + TIMEOUT / 2;
    let g = gathers(&feed(&mut ep, half, grant_msg(X, &[(0, r(0))])));
    ep.handle_timeout(t + TIMEOUT);
    assert!(drain(&mut ep).is_empty());
    assert_eq!(ep.poll_timeout(), Some(half + TIMEOUT));
    ep.handle_timeout(half + TIMEOUT);
    let acts = drain(&mut ep);
    assert_eq!(completes(&acts), vec![(X, Err(XferError::Timeout))]);
    assert!(is_cancel(&msgs(&acts)[0].1, X));
    assert_eq!(ep.orphans(), 1, "the gather is still in flight");
    ep.handle_gather_done(half + TIMEOUT, g[0].0, true);
    assert!(ep.is_idle());
    assert_eq!(ep.stats().timeouts, 1);
}

#[test]
fn a_credit_that_went_stale_is_never_written() {
    let (mut ep, t) = endpoint(64 * KIB, 2, false);
    ep.submit(t, X, TOKEN, PEER, plan_of(1)).unwrap();
    drain(&mut ep);
    let g = gathers(&feed(&mut ep, t, grant_msg(X, &[(0, r(0))])));
    // The shell reports the gather only after a whole timeout (and never ran our timer).
    ep.handle_gather_done(t + TIMEOUT, g[0].0, true);
    let acts = drain(&mut ep);
    assert!(writes(&acts).is_empty());
    assert_eq!(completes(&acts), vec![(X, Err(XferError::Timeout))]);
    assert!(ep.is_idle());
}

#[test]
fn peer_loss_fails_its_transfers_without_a_cancel_and_frees_orphans_on_their_done_events() {
    let (mut ep, t) = endpoint(64 * KIB, 2, true);
    ep.submit(t, X, TOKEN, PEER, plan_of(2)).unwrap();
    ep.submit(t, XferId(2), TOKEN, PeerId(8), plan_of(1)).unwrap();
    let g = gathers(&drain(&mut ep));
    ep.handle_peer_lost(t, PEER);
    let acts = drain(&mut ep);
    assert_eq!(completes(&acts), vec![(X, Err(XferError::PeerLost))]);
    assert!(msgs(&acts).is_empty());
    assert_eq!(ep.in_flight_xfers(), 1, "the other peer's transfer lives on");
    assert_eq!(ep.orphans(), 2);
    ep.handle_gather_done(t, g[0].0, false);
    ep.handle_gather_done(t, g[1].0, true);
    assert!(drain(&mut ep).is_empty());
    assert_eq!(ep.orphans(), 0);
    assert_eq!(ep.scheduler().local_bytes(), 2 * CHUNK, "XferId(2)'s eager region and the reserve");
    check(&ep);
}

#[test]
fn shutdown_fails_everything_and_refuses_new_transfers() {
    let (mut ep, t) = endpoint(64 * KIB, 2, true);
    ep.submit(t, X, TOKEN, PEER, plan_of(1)).unwrap();
    let g = gathers(&drain(&mut ep));
    ep.shutdown(t);
    let acts = drain(&mut ep);
    assert_eq!(completes(&acts), vec![(X, Err(XferError::ShuttingDown))]);
    assert!(is_cancel(&msgs(&acts)[0].1, X));
    assert_eq!(ep.submit(t, XferId(9), TOKEN, PEER, plan_of(1)), Err(SubmitError::ShuttingDown));
    assert!(!ep.is_idle(), "the gather is still in flight");
    ep.handle_gather_done(t, g[0].0, true);
    assert!(ep.is_idle());
    assert_eq!(ep.arena_free_bytes(), 64 * KIB);
}

/// Runs chunk 0 of a fresh 2-chunk transfer up to its DATA; returns the endpoint.
fn up_to_data(eager: bool) -> (Endpoint, Instant) {
    let (mut ep, t) = endpoint(64 * KIB, 2, eager);
    ep.submit(t, X, TOKEN, PEER, plan_of(2)).unwrap();
    let mut g = gathers(&drain(&mut ep));
    g.extend(gathers(&feed(&mut ep, t, grant_msg(X, &[(0, r(0))]))));
    ep.handle_gather_done(t, g[0].0, true);
    let w = writes(&drain(&mut ep));
    ep.handle_write_done(t, w[0].0, true);
    drain(&mut ep);
    (ep, t)
}

#[test]
fn a_refused_or_failed_scatter_fails_the_transfer_and_cancels_it() {
    for (status, err) in [(AckStatus::Refused, XferError::Refused), (AckStatus::Failed, XferError::ScatterFailed)] {
        let (mut ep, t) = up_to_data(false);
        let acts = feed(&mut ep, t, ack_msg(X, 0, r(0), status));
        assert_eq!(completes(&acts), vec![(X, Err(err))]);
        assert!(is_cancel(&msgs(&acts)[0].1, X));
        assert!(ep.is_idle());
        assert_eq!(ep.arena_free_bytes(), 64 * KIB);
    }
}

#[test]
fn gather_and_write_failures_fail_the_transfer() {
    let (mut ep, t) = endpoint(64 * KIB, 2, true);
    ep.submit(t, X, TOKEN, PEER, plan_of(2)).unwrap();
    let g = gathers(&drain(&mut ep));
    ep.handle_gather_done(t, g[0].0, false);
    assert_eq!(completes(&drain(&mut ep)), vec![(X, Err(XferError::GatherFailed))]);
    ep.handle_gather_done(t, g[1].0, true);
    assert!(ep.is_idle());

    let (mut ep, t) = endpoint(64 * KIB, 2, false);
    ep.submit(t, X, TOKEN, PEER, plan_of(1)).unwrap();
    drain(&mut ep);
    let g = gathers(&feed(&mut ep, t, grant_msg(X, &[(0, r(0))])));
    ep.handle_gather_done(t, g[0].0, true);
    let w = writes(&drain(&mut ep));
    ep.handle_write_done(t, w[0].0, false);
    let acts = drain(&mut ep);
    assert_eq!(completes(&acts), vec![(X, Err(XferError::WriteFailed))]);
    assert!(is_cancel(&msgs(&acts)[0].1, X), "the failed write is over: cancel at once");
    assert!(ep.is_idle());
}

#[test]
fn bad_peer_input_is_rejected_and_changes_nothing() {
    let (mut ep, t) = up_to_data(true);
    let before = format!("{:?}", ep.sender());
    let cases = [
        (PEER, grant_msg(XferId(99), &[(1, r(4))])),
        (PeerId(3), grant_msg(X, &[(1, r(4))])),
        (PEER, grant_msg(X, &[])),
        (PEER, grant_msg(X, &[(2, r(4))])),
        (PEER, grant_msg(X, &[(0, r(4))])),
        (PEER, grant_msg(X, &[(1, r(4)), (1, r(8))])),
        (PEER, grant_msg(X, &[(1, Region { offset: 0, len: 16 })])),
        (PEER, grant_msg(X, &[(1, Region { offset: u64::MAX - 10, len: CHUNK })])),
        (PEER, ack_msg(X, 1, r(4), AckStatus::Scattered)),
        (PEER, ack_msg(X, 0, r(4), AckStatus::Scattered)),
        (PEER, ack_msg(X, 5, r(0), AckStatus::Scattered)),
        (PeerId(3), ack_msg(X, 0, r(0), AckStatus::Refused)),
    ];
    let n = cases.len() as u64;
    for (from, msg) in cases {
        assert!(ep.handle_msg(t, from, msg.clone()).is_err(), "{msg:?} accepted");
        assert!(drain(&mut ep).is_empty());
        assert_eq!(format!("{:?}", ep.sender()), before, "{msg:?} changed the state");
    }
    assert_eq!(ep.stats().protocol_errors, n);
    // Valid input still works afterwards.
    assert!(ep.handle_msg(t, PEER, ack_msg(X, 0, r(0), AckStatus::Scattered)).is_ok());
}

#[test]
fn submit_rejects_plans_the_peer_could_not_accept() {
    let (mut ep, t) = endpoint(64 * KIB, 2, true);
    assert_eq!(ep.submit(t, X, TOKEN, PEER, Plan::default()), Err(SubmitError::EmptyPlan { xfer: X }));
    let big = crate::plan::plan(
        &[crate::plan::DescPair { src: SRC, dst: DST, len: 8 * KIB }],
        crate::plan::PlanParams::new(8 * KIB),
    )
    .unwrap();
    assert!(matches!(ep.submit(t, X, TOKEN, PEER, big), Err(SubmitError::ChunkTooLarge { .. })));
    let mut bad = plan_of(1);
    bad.chunks[0].scatter[0].len = 2 * CHUNK;
    assert!(matches!(ep.submit(t, X, TOKEN, PEER, bad), Err(SubmitError::BadChunk { .. })));
    ep.submit(t, X, TOKEN, PEER, plan_of(1)).unwrap();
    assert_eq!(ep.submit(t, X, TOKEN, PEER, plan_of(1)), Err(SubmitError::DuplicateXfer { xfer: X }));
    ep.cancel(t, X);
    assert_eq!(
        ep.submit(t, X, TOKEN, PEER, plan_of(1)),
        Err(SubmitError::DuplicateXfer { xfer: X }),
        "ids are never reused"
    );
    assert_eq!(ep.stats().submitted, 1);
    let mut wraps = direct_plan_of(1);
    wraps.chunks[0].direct = Some(u64::MAX - 8);
    assert!(matches!(ep.submit(t, XferId(2), TOKEN, PEER, wraps), Err(SubmitError::BadChunk { .. })));
}

#[test]
fn a_plan_posted_again_is_checked_once_and_a_changed_copy_is_checked_anew() {
    let (mut ep, t) = endpoint(64 * KIB, 2, true);
    let mut plan = Arc::new(plan_of(1));
    ep.submit(t, XferId(1), TOKEN, PEER, Arc::clone(&plan)).unwrap();
    ep.cancel(t, XferId(1));
    // Posted again, the same shared plan is admitted (from the memo of plans that passed).
    ep.submit(t, XferId(2), TOKEN, PEER, Arc::clone(&plan)).unwrap();
    ep.cancel(t, XferId(2));
    let _ = drain(&mut ep);
    // Made bad in place once the core let go of it: `make_mut` cuts the memo's `Weak` loose, so
    // the changed plan is checked and refused, not waved through as the plan that passed.
    assert_eq!(Arc::strong_count(&plan), 1, "the core keeps no plan of a finished transfer");
    Arc::make_mut(&mut plan).chunks[0].scatter[0].len = 2 * CHUNK;
    assert!(matches!(ep.submit(t, XferId(3), TOKEN, PEER, Arc::clone(&plan)), Err(SubmitError::BadChunk { .. })));
    // A bad copy of a plan that passed is another allocation: checked, refused.
    let good = Arc::new(plan_of(1));
    ep.submit(t, XferId(4), TOKEN, PEER, Arc::clone(&good)).unwrap();
    let mut copy = (*good).clone();
    copy.chunks[0].scatter[0].len = 2 * CHUNK;
    assert!(matches!(ep.submit(t, XferId(5), TOKEN, PEER, copy), Err(SubmitError::BadChunk { .. })));
}

// ---- direct chunks ----

fn user(chunk: u64) -> WriteSource {
    WriteSource::User { addr: SRC + chunk * CHUNK }
}

/// Reports the write `w` done and returns the DATA it caused.
fn finish_write(ep: &mut Endpoint, t: Instant, w: (JobId, WriteSource, Region, u64)) -> wire::Data {
    ep.handle_write_done(t, w.0, true);
    let m = msgs(&drain(ep));
    let [(_, Msg::Data(d))] = &m[..] else { panic!("{m:?}") };
    d.clone()
}

#[test]
fn a_fully_direct_plan_is_written_from_user_memory_without_any_staging() {
    for eager in [false, true] {
        let (mut ep, t) = endpoint(64 * KIB, 2, eager);
        ep.submit(t, X, TOKEN, PEER, direct_plan_of(3)).unwrap();
        let acts = drain(&mut ep);
        assert!(matches!(&acts[..], [Action::Send { msg: Msg::Want(_), .. }]), "only the WANT: {acts:?}");
        assert_eq!(ep.scheduler().local_bytes(), 0, "no eager staging and no reserve");

        // Each credit posts its write at once, straight from the chunk's source.
        let w = writes(&feed(&mut ep, t, grant_msg(X, &[(1, r(4)), (0, r(0))])));
        assert_eq!(
            w.iter().map(|w| (w.1, w.2, w.3)).collect::<Vec<_>>(),
            vec![(user(1), r(4), CHUNK), (user(0), r(0), CHUNK)]
        );
        let d = finish_write(&mut ep, t, w[1]);
        assert_eq!((d.chunk, d.region, d.runs[0].addr), (ChunkIdx(0), r(0), DST));
        finish_write(&mut ep, t, w[0]);
        // A credit for a chunk already written is still a duplicate.
        assert!(ep.handle_msg(t, PEER, grant_msg(X, &[(0, r(8))])).is_err());
        assert!(feed(&mut ep, t, ack_msg(X, 0, r(0), AckStatus::Scattered)).is_empty());
        let w2 = writes(&feed(&mut ep, t, grant_msg(X, &[(2, r(0))])));
        assert_eq!(w2[0].1, user(2));
        finish_write(&mut ep, t, w2[0]);
        feed(&mut ep, t, ack_msg(X, 1, r(4), AckStatus::Scattered));
        let acts = feed(&mut ep, t, ack_msg(X, 2, r(0), AckStatus::Scattered));
        assert_eq!(completes(&acts), vec![(X, Ok(()))]);
        assert!(ep.is_idle());
        assert_eq!(ep.arena_free_bytes(), 64 * KIB);
        let st = ep.stats();
        assert_eq!((st.chunks_written, st.chunks_direct, st.bytes_written), (3, 3, 3 * CHUNK));
    }
}

/// Chunks 0 and 2 direct, 1 and 3 staged.
fn mixed_plan() -> Plan {
    let mut p = direct_plan_of(4);
    p.chunks[1].direct = None;
    p.chunks[3].direct = None;
    p
}

#[test]
fn a_mixed_plan_stages_only_its_staged_chunks() {
    // W = 2: the eager cap covers two staged chunks, however many direct ones precede them.
    let (mut ep, t) = endpoint(64 * KIB, 2, true);
    ep.submit(t, X, TOKEN, PEER, mixed_plan()).unwrap();
    let g = gathers(&drain(&mut ep));
    let gathered: Vec<_> = g.iter().map(|&(job, _)| job).collect();
    assert_eq!(g.len(), 2);
    assert_eq!(ep.scheduler().eager_bytes(), 2 * CHUNK + CHUNK, "chunks 1 and 3, and the reserve");

    let credits = [(0, r(0)), (1, r(4)), (2, r(8)), (3, r(12))];
    let w = writes(&feed(&mut ep, t, grant_msg(X, &credits)));
    assert_eq!(w.iter().map(|w| (w.1, w.2)).collect::<Vec<_>>(), vec![(user(0), r(0)), (user(2), r(8))]);
    let mut staged = Vec::new();
    for (job, (_, region)) in gathered.into_iter().zip(&g) {
        ep.handle_gather_done(t, job, true);
        let ws = writes(&drain(&mut ep));
        assert_eq!(ws[0].1, WriteSource::Arena(*region));
        staged.extend(ws);
    }
    for w in w.into_iter().chain(staged) {
        finish_write(&mut ep, t, w);
    }
    assert_eq!(ep.scheduler().local_bytes(), CHUNK, "the staging went back with the writes: the reserve");
    for (i, region) in credits.into_iter().take(3) {
        assert!(feed(&mut ep, t, ack_msg(X, i, region, AckStatus::Scattered)).is_empty());
    }
    assert_eq!(ep.scheduler().local_bytes(), CHUNK);
    let acts = feed(&mut ep, t, ack_msg(X, 3, r(12), AckStatus::Scattered));
    assert_eq!(completes(&acts), vec![(X, Ok(()))]);
    assert!(ep.is_idle());
    assert_eq!(ep.arena_free_bytes(), 64 * KIB);
    assert_eq!((ep.stats().chunks_written, ep.stats().chunks_direct), (4, 2));
}

#[test]
fn direct_chunks_write_even_when_the_local_arena_is_full() {
    // One staged chunk fills the arena; the direct ones need none of it.
    let (mut ep, t) = endpoint(4 * KIB, 2, false);
    ep.submit(t, X, TOKEN, PEER, mixed_plan()).unwrap();
    drain(&mut ep);
    let acts = feed(&mut ep, t, grant_msg(X, &[(1, r(4)), (3, r(12)), (0, r(0)), (2, r(8))]));
    assert_eq!(gathers(&acts).len(), 1);
    assert_eq!(ep.sender().parked_credits(), 1);
    assert_eq!(writes(&acts).iter().map(|w| w.1).collect::<Vec<_>>(), vec![user(0), user(2)]);
    check(&ep);
}

/// Submits `X` as `chunks` direct chunks and grants chunk 0 region `r(0)`: its write is
/// in flight (the only job).
fn direct_write_granted(ep: &mut Endpoint, t: Instant, chunks: u64) -> Vec<(JobId, WriteSource, Region, u64)> {
    ep.submit(t, X, TOKEN, PEER, direct_plan_of(chunks)).unwrap();
    drain(ep);
    writes(&feed(ep, t, grant_msg(X, &[(0, r(0))])))
}

#[test]
fn cancel_waits_for_an_in_flight_direct_write_that_has_no_region_to_orphan() {
    let (mut ep, t) = endpoint(64 * KIB, 2, false);
    let w = direct_write_granted(&mut ep, t, 2);
    ep.cancel(t, X);
    let acts = drain(&mut ep);
    assert_eq!(completes(&acts), vec![(X, Err(XferError::Canceled))]);
    assert!(msgs(&acts).is_empty(), "no cancel while the direct write may still land: {acts:?}");
    assert_eq!((ep.orphans(), ep.jobs_in_flight(), ep.sender().pending_cancels()), (0, 1, 1));
    assert!(!ep.is_idle());

    ep.handle_write_done(t, w[0].0, true);
    let m = msgs(&drain(&mut ep));
    assert!(m.len() == 1 && is_cancel(&m[0].1, X), "{m:?}");
    assert!(ep.is_idle());
    assert_eq!(ep.arena_free_bytes(), 64 * KIB);
    assert_eq!(ep.stats().chunks_written, 0, "a canceled write announces nothing");
}

#[test]
fn a_write_in_flight_past_an_eighth_of_the_timeout_sends_keeps_until_it_is_done() {
    let (mut ep, t) = endpoint(64 * KIB, 2, true);
    let w = direct_write_granted(&mut ep, t, 2);
    let keeps = |acts: &[Action]| {
        msgs(acts).iter().filter(|(_, m)| matches!(m, Msg::Keep(k) if k.xfer == X && k.token == TOKEN)).count()
    };
    // Not yet: a write younger than an eighth of the timeout needs no KEEP.
    assert_eq!(ep.poll_timeout(), Some(t + TIMEOUT / 8));
    ep.handle_timeout(t + TIMEOUT / 16);
    assert_eq!(keeps(&drain(&mut ep)), 0);
    // Then one per round (one per flow, however many of its writes are in flight).
    ep.handle_timeout(t + TIMEOUT / 8);
    assert_eq!(keeps(&drain(&mut ep)), 1);
    ep.handle_timeout(t + TIMEOUT / 4);
    assert_eq!(keeps(&drain(&mut ep)), 1);
    assert_eq!(ep.stats().keeps_sent, 2);
    // Done: no more rounds.
    for (job, ..) in w {
        ep.handle_write_done(t + TIMEOUT / 4, job, true);
    }
    drain(&mut ep);
    ep.handle_timeout(t + TIMEOUT * 3 / 8);
    assert_eq!(keeps(&drain(&mut ep)), 0);
    assert_eq!(ep.stats().keeps_sent, 2);
}

#[test]
fn a_write_posted_just_before_a_round_of_keeps_is_kept_in_that_round() {
    let (mut ep, t) = endpoint(64 * KIB, 2, true);
    direct_write_granted(&mut ep, t, 2);
    // A second transfer's write is posted just before the round X's write armed: its credit
    // may be a quarter timeout old by then, so waiting a round more could let its lease
    // (half a timeout from the grant) end before its first KEEP.
    let (y, late) = (XferId(2), t + TIMEOUT / 8 - Duration::from_millis(1));
    ep.submit(t, y, TOKEN, PEER, direct_plan_of(1)).unwrap();
    drain(&mut ep);
    assert_eq!(writes(&feed(&mut ep, late, grant_msg(y, &[(0, r(1))]))).len(), 1);
    ep.handle_timeout(t + TIMEOUT / 8);
    let kept: Vec<XferId> = msgs(&drain(&mut ep))
        .iter()
        .filter_map(|(_, m)| match m {
            Msg::Keep(k) => Some(k.xfer),
            _ => None,
        })
        .collect();
    assert_eq!(kept, vec![X, y]);
}

#[test]
fn a_direct_transfer_times_out_and_cancels_after_its_write_finishes() {
    let (mut ep, t) = endpoint(64 * KIB, 2, true);
    let w = direct_write_granted(&mut ep, t, 2);
    // The write never reports within the timeout.
    ep.handle_timeout(t + TIMEOUT);
    let acts = drain(&mut ep);
    assert_eq!(completes(&acts), vec![(X, Err(XferError::Timeout))]);
    // No cancel while the write may still land; KEEPs tell the receiver it is in flight.
    assert!(msgs(&acts).iter().all(|(_, m)| matches!(m, Msg::Keep(_))), "{:?}", msgs(&acts));
    ep.handle_write_done(t + TIMEOUT, w[0].0, false);
    assert!(is_cancel(&msgs(&drain(&mut ep))[0].1, X));
    assert!(ep.is_idle());
    assert_eq!(ep.stats().timeouts, 1);

    // Without any credit, the cancel goes out at once.
    ep.submit(t + TIMEOUT, XferId(2), TOKEN, PEER, direct_plan_of(1)).unwrap();
    drain(&mut ep);
    ep.handle_timeout(t + 2 * TIMEOUT);
    let acts = drain(&mut ep);
    assert_eq!(completes(&acts), vec![(XferId(2), Err(XferError::Timeout))]);
    assert!(is_cancel(&msgs(&acts)[0].1, XferId(2)));
    assert!(ep.is_idle());
}

#[test]
fn a_failed_direct_write_fails_the_transfer_and_cancels_at_once() {
    let (mut ep, t) = endpoint(64 * KIB, 2, false);
    let w = direct_write_granted(&mut ep, t, 1);
    ep.handle_write_done(t, w[0].0, false);
    let acts = drain(&mut ep);
    assert_eq!(completes(&acts), vec![(X, Err(XferError::WriteFailed))]);
    assert!(is_cancel(&msgs(&acts)[0].1, X));
    assert!(ep.is_idle());
}

#[test]
fn peer_loss_with_a_direct_write_in_flight_waits_only_for_its_done_event() {
    let (mut ep, t) = endpoint(64 * KIB, 2, false);
    let w = direct_write_granted(&mut ep, t, 1);
    ep.handle_peer_lost(t, PEER);
    assert_eq!(completes(&drain(&mut ep)), vec![(X, Err(XferError::PeerLost))]);
    assert_eq!((ep.orphans(), ep.jobs_in_flight()), (0, 1));
    ep.handle_write_done(t, w[0].0, false);
    assert!(drain(&mut ep).is_empty(), "nobody to cancel at");
    assert!(ep.is_idle());
}

/// A chunk is replanned once: its DATA then carries every run, so a second Replan is a
/// broken or hostile receiver's. It is refused, sends nothing and does not push the
/// transfer's deadline back, so a target answering every DATA with Replan cannot keep the
/// transfer alive: it times out a timeout after the last real progress.
#[test]
fn a_second_replan_of_a_chunk_is_refused_and_the_transfer_still_times_out() {
    let (mut ep, t) = endpoint(64 * KIB, 2, false);
    ep.submit(t, X, TOKEN, PEER, direct_plan_of(1)).unwrap();
    drain(&mut ep);
    let w = writes(&feed(&mut ep, t, grant_msg(X, &[(0, r(0))])));
    ep.handle_write_done(t, w[0].0, true);
    drain(&mut ep);
    let replan = || ack_msg(X, 0, r(0), AckStatus::Replan);
    let first = t + TIMEOUT / 2;
    let sent = msgs(&feed(&mut ep, first, replan()));
    assert!(matches!(&sent[..], [(PEER, Msg::Data(_))]), "the DATA again, with its runs: {sent:?}");
    let mut now = first;
    for _ in 0..5 {
        now += TIMEOUT / 5;
        let err = ep.handle_msg(now, PEER, replan()).unwrap_err();
        assert_eq!(err, ProtocolError::UnexpectedAck { xfer: X, chunk: ChunkIdx(0) });
        assert!(drain(&mut ep).is_empty(), "no DATA sent again");
    }
    ep.handle_timeout(first + TIMEOUT);
    assert_eq!(completes(&drain(&mut ep)), vec![(X, Err(XferError::Timeout))]);
    assert_eq!(ep.stats().replans, 1);
}

/// The same for an inline transfer: ACKs that are no answer to it (Replan, Kept) from a target
/// holding its token are refused and do not put its timeout off.
#[test]
fn an_inline_transfer_answered_only_by_replans_and_kepts_still_times_out() {
    let (mut ep, t) = endpoint(64 * KIB, 2, false);
    let bytes = vec![7u8; CHUNK as usize];
    ep.submit_write(t, X, TOKEN, PEER, plan_of(1), WriteRoute::inline(bytes)).unwrap();
    drain(&mut ep);
    for (k, status) in [(1, AckStatus::Replan), (2, AckStatus::Kept)] {
        let now = t + TIMEOUT * k / 3;
        let err = ep.handle_msg(now, PEER, ack_msg(X, 0, r(0), status)).unwrap_err();
        assert_eq!(err, ProtocolError::UnexpectedAck { xfer: X, chunk: ChunkIdx(0) });
        ep.handle_timeout(now);
        assert!(completes(&drain(&mut ep)).is_empty());
    }
    ep.handle_timeout(t + TIMEOUT);
    assert_eq!(completes(&drain(&mut ep)), vec![(X, Err(XferError::Timeout))]);
}

/// A target that grants every chunk at once (past any window) and never ACKs holds none of
/// our arena once the writes are done: each write gives its staging back, so the credits
/// parked for lack of space are staged in turn, and another peer's transfer still finds room.
#[test]
fn a_target_that_never_acks_holds_no_staging_once_the_writes_are_done() {
    let (mut ep, t) = endpoint(64 * KIB, 2, false);
    ep.submit(t, X, TOKEN, PEER, plan_of(32)).unwrap();
    drain(&mut ep);
    let credits: Vec<(u32, Region)> = (0..32).map(|i| (i, r(4 * u64::from(i)))).collect();
    let mut acts = feed(&mut ep, t, grant_msg(X, &credits));
    assert!(ep.sender().parked_credits() > 0, "more credits than the arena stages at once");
    let mut written = 0;
    loop {
        for (job, _) in gathers(&acts) {
            ep.handle_gather_done(t, job, true);
        }
        let w = writes(&drain(&mut ep));
        if w.is_empty() {
            break;
        }
        for (job, ..) in w {
            ep.handle_write_done(t, job, true);
            written += 1;
        }
        acts = drain(&mut ep);
    }
    assert_eq!((written, ep.sender().parked_credits()), (32, 0));
    assert_eq!(ep.scheduler().local_bytes(), CHUNK, "only the reserve");
    let other = PeerId(8);
    let y = XferId(2);
    ep.submit(t, y, TOKEN, other, plan_of(1)).unwrap();
    drain(&mut ep);
    ep.handle_msg(t, other, grant_msg(y, &[(0, r(0))])).unwrap();
    assert_eq!(gathers(&drain(&mut ep)).len(), 1, "staged at once");
    check(&ep);
}

/// Whether `m` is the WANT that opens `xfer`.
fn is_want(m: &Msg, xfer: XferId) -> bool {
    matches!(m, Msg::Want(w) if w.xfer == xfer && !w.chunks.is_empty())
}

#[test]
fn a_write_submitted_while_a_cancel_to_its_peer_waits_starts_right_after_that_cancel() {
    let (mut ep, t) = endpoint(64 * KIB, 2, false);
    let w = direct_write_granted(&mut ep, t, 2);
    ep.cancel(t, X);
    drain(&mut ep);
    // X's cancel waits for its write; the target may still be scattering X's earlier chunks,
    // so Y, which may write the same destinations, must not reach it first.
    let y = XferId(2);
    ep.submit(t, y, TOKEN, PEER, direct_plan_of(1)).unwrap();
    assert!(msgs(&drain(&mut ep)).is_empty(), "no WANT before X's cancel");
    assert!(ep.owes_completion(y) && !ep.is_idle());
    assert_eq!((ep.stats().writes_deferred, ep.in_flight_xfers()), (1, 1));
    // Another peer's WRITE does not wait.
    ep.submit(t, XferId(3), TOKEN, PeerId(8), direct_plan_of(1)).unwrap();
    assert!(msgs(&drain(&mut ep)).iter().any(|(p, m)| *p == PeerId(8) && is_want(m, XferId(3))));
    ep.handle_write_done(t, w[0].0, true);
    let m: Vec<Msg> = msgs(&drain(&mut ep)).into_iter().filter(|(p, _)| *p == PEER).map(|(_, m)| m).collect();
    assert!(m.len() == 2 && is_cancel(&m[0], X) && is_want(&m[1], y), "cancel, then the WANT: {m:?}");
    assert_eq!(ep.stats().submitted, 3);
    check(&ep);
}

fn is_pull(m: &Msg, xfer: XferId) -> bool {
    matches!(m, Msg::Pull(p) if p.xfer == xfer && !p.chunks.is_empty())
}

/// Review 58: a READ started beside a held WRITE reached the target first; once 256 such READs
/// had ended there, the WRITE's WANT fell below the target's replay window and was dropped
/// unanswered, and the WRITE failed by its timeout. READs wait in the same queue now: the
/// peer's ids reach it in submission order, and a READ's PULL comes after the cancel.
#[test]
fn a_read_submitted_while_a_cancel_to_its_peer_waits_starts_after_the_writes_held_before_it() {
    let (mut ep, t) = endpoint(64 * KIB, 2, false);
    let w = direct_write_granted(&mut ep, t, 2);
    ep.cancel(t, X);
    drain(&mut ep);
    let (y, reads) = (XferId(2), [XferId(3), XferId(4)]);
    ep.submit(t, y, TOKEN, PEER, direct_plan_of(1)).unwrap();
    for z in reads {
        ep.submit_read(t, z, TOKEN, PEER, plan_of(1), None).unwrap();
    }
    assert!(msgs(&drain(&mut ep)).is_empty(), "no PULL before X's cancel and Y's WANT");
    assert!(reads.iter().all(|&z| ep.owes_completion(z)));
    assert_eq!((ep.stats().writes_deferred, ep.stats().reads_deferred, ep.in_flight_xfers()), (1, 2, 3));
    // A held id is taken: not even a peer that nothing holds may start a transfer under it
    // (it would start, and then the held one fail under the same id).
    let dup = Err(SubmitError::DuplicateXfer { xfer: reads[0] });
    assert_eq!(ep.submit_read(t, reads[0], TOKEN, PeerId(8), plan_of(1), None), dup);
    assert_eq!(ep.submit(t, reads[0], TOKEN, PeerId(8), direct_plan_of(1)), dup);
    // A READ from another peer does not wait.
    ep.submit_read(t, XferId(5), TOKEN, PeerId(8), plan_of(1), None).unwrap();
    assert!(msgs(&drain(&mut ep)).iter().any(|(p, m)| *p == PeerId(8) && is_pull(m, XferId(5))));
    ep.handle_write_done(t, w[0].0, true);
    let m: Vec<Msg> = msgs(&drain(&mut ep)).into_iter().filter(|(p, _)| *p == PEER).map(|(_, m)| m).collect();
    assert!(
        m.len() == 4
            && is_cancel(&m[0], X)
            && is_want(&m[1], y)
            && is_pull(&m[2], reads[0])
            && is_pull(&m[3], reads[1]),
        "the cancel, then the held transfers in the order submitted: {m:?}"
    );
    assert_eq!(ep.stats().submitted, 5);
    check(&ep);
}

#[test]
fn a_held_read_cancelled_timed_out_or_whose_destinations_go_fails_and_never_pulls() {
    let (mut ep, t) = endpoint(64 * KIB, 2, false);
    let w = direct_write_granted(&mut ep, t, 2);
    ep.cancel(t, X);
    drain(&mut ep);
    let (a, b, c) = (XferId(2), XferId(3), XferId(4));
    for z in [a, b] {
        ep.submit_read(t, z, TOKEN, PEER, plan_of(1), None).unwrap();
    }
    ep.submit_read(t + TIMEOUT / 2, c, TOKEN, PEER, plan_of(1), None).unwrap();
    ep.cancel(t, a);
    assert_eq!(completes(&drain(&mut ep)), vec![(a, Err(XferError::Canceled))]);
    // Held a request timeout, B fails by it; C, submitted later, is still held.
    ep.handle_timeout(t + TIMEOUT);
    assert_eq!(completes(&drain(&mut ep)), vec![(b, Err(XferError::Timeout))]);
    // Deregistering what it reads at the peer (its sources there) fails nothing; the memory it
    // would scatter into here does.
    ep.deregister(t + TIMEOUT, None, SRC, CHUNK);
    assert!(completes(&drain(&mut ep)).is_empty());
    ep.deregister(t + TIMEOUT, None, DST, CHUNK);
    assert_eq!(completes(&drain(&mut ep)), vec![(c, Err(XferError::Deregistered))]);
    assert_eq!((ep.stats().reads_deferred, ep.stats().dereg_failed), (3, 1));
    ep.handle_write_done(t + TIMEOUT, w[0].0, true);
    assert!(msgs(&drain(&mut ep)).iter().all(|(_, m)| !matches!(m, Msg::Pull(_))), "no held READ pulls");
    assert!(ep.is_idle());
    check(&ep);
}

#[test]
fn a_held_write_cancelled_or_whose_peer_is_lost_fails_without_a_word_to_the_peer() {
    let (mut ep, t) = endpoint(64 * KIB, 2, false);
    let w = direct_write_granted(&mut ep, t, 2);
    ep.cancel(t, X);
    drain(&mut ep);
    let (y, z) = (XferId(2), XferId(3));
    ep.submit(t, y, TOKEN, PEER, direct_plan_of(1)).unwrap();
    ep.submit(t, z, TOKEN, PEER, direct_plan_of(1)).unwrap();
    assert_eq!(ep.submit(t, z, TOKEN, PEER, direct_plan_of(1)), Err(SubmitError::DuplicateXfer { xfer: z }));
    ep.cancel(t, y);
    let acts = drain(&mut ep);
    assert_eq!(completes(&acts), vec![(y, Err(XferError::Canceled))]);
    assert!(msgs(&acts).is_empty() && !ep.owes_completion(y));
    ep.handle_peer_lost(t, PEER);
    let acts = drain(&mut ep);
    assert_eq!(completes(&acts), vec![(z, Err(XferError::PeerLost))]);
    assert!(msgs(&acts).is_empty(), "{acts:?}");
    ep.handle_write_done(t, w[0].0, true);
    assert!(msgs(&drain(&mut ep)).is_empty(), "nothing starts after the peer is lost");
    assert_eq!((ep.stats().submitted, ep.stats().failed, ep.stats().canceled), (3, 3, 2));
    assert!(ep.is_idle());
}

#[test]
fn a_held_write_whose_sources_are_deregistered_fails_and_never_gathers() {
    let (mut ep, t) = endpoint(64 * KIB, 2, false);
    let w = direct_write_granted(&mut ep, t, 2);
    ep.cancel(t, X);
    drain(&mut ep);
    let (y, z) = (XferId(2), XferId(3));
    ep.submit(t, y, TOKEN, PEER, plan_of(1)).unwrap();
    ep.submit(t, z, TOKEN, PEER, plan_of(1)).unwrap();
    assert!(msgs(&drain(&mut ep)).is_empty(), "both held");
    assert_eq!(ep.stats().writes_deferred, 2);
    // Memory none of them reads: both stay held.
    ep.deregister(t, None, SRC + 64 * KIB, CHUNK);
    assert!(completes(&drain(&mut ep)).is_empty());
    ep.deregister(t, None, SRC, CHUNK);
    assert_eq!(completes(&drain(&mut ep)), vec![(y, Err(XferError::Deregistered)), (z, Err(XferError::Deregistered))]);
    assert_eq!(ep.stats().dereg_failed, 2);
    ep.handle_write_done(t, w[0].0, true);
    let acts = drain(&mut ep);
    assert!(gathers(&acts).is_empty() && msgs(&acts).iter().all(|(_, m)| is_cancel(m, X)), "{acts:?}");
}

#[test]
fn a_held_write_is_a_transfer_in_flight_its_peer_watched_and_its_timeout_kept() {
    let (mut ep, t) = endpoint(64 * KIB, 2, false);
    let _w = direct_write_granted(&mut ep, t, 2);
    ep.cancel(t, X);
    drain(&mut ep);
    let y = XferId(2);
    let at = t + TIMEOUT / 2;
    ep.submit(at, y, TOKEN, PEER, direct_plan_of(1)).unwrap();
    assert!(msgs(&drain(&mut ep)).is_empty(), "held");
    // The write Y waits behind never ends (its peer froze): Y fails at its own timeout.
    assert!(ep.poll_timeout().is_some_and(|d| d <= at + TIMEOUT));
    ep.handle_timeout(at + TIMEOUT / 2);
    assert!(completes(&drain(&mut ep)).is_empty());
    ep.handle_timeout(at + TIMEOUT);
    assert_eq!(completes(&drain(&mut ep)), vec![(y, Err(XferError::Timeout))]);
    assert_eq!(ep.stats().timeouts, 1);
    assert!(!ep.owes_completion(y));
}

#[test]
fn the_peer_of_a_held_write_is_probed_and_the_write_fails_when_it_is_declared_dead() {
    let c = Config {
        probe_after: Duration::from_millis(100),
        peer_dead_after: Duration::from_millis(400),
        ..config(64 * KIB, 2, false)
    };
    let t = Instant::now();
    let mut ep = Endpoint::new(&c, t, PROBE_KEY).unwrap();
    ep.set_ping_answerers(|p| p == PEER);
    let _w = direct_write_granted(&mut ep, t, 2);
    ep.cancel(t, X);
    drain(&mut ep);
    let y = XferId(2);
    ep.submit(t, y, TOKEN, PEER, direct_plan_of(1)).unwrap();
    drain(&mut ep);
    // The peer froze with X's write in flight: only the held Y still waits on it.
    let mut pinged = 0;
    let mut now = t;
    while ep.owes_completion(y) && now < t + Duration::from_secs(1) {
        now = ep.poll_timeout().unwrap().max(now + Duration::from_millis(10));
        ep.handle_timeout(now);
        let acts = drain(&mut ep);
        pinged += acts
            .iter()
            .filter(|a| matches!(a, Action::Link { peer, body: wire::Body::Ping { .. } } if *peer == PEER))
            .count();
        if let Some(done) = completes(&acts).into_iter().find(|c| c.0 == y) {
            assert_eq!(done.1, Err(XferError::Unresponsive));
        }
    }
    assert!(pinged > 0 && !ep.owes_completion(y), "pings {pinged}, still owed: {}", ep.owes_completion(y));
    assert!(now < t + TIMEOUT, "declared dead before its timeout");
}

/// Review 61 (READ, L1): a READ's RDMA read that ends half a timeout after its credit came may
/// have read a region its target reclaimed (its KEEPs lost) and gave, after the quarantine, to
/// another flow: its bytes are not scattered and the transfer fails by its timeout. One that
/// ends in time is scattered as usual.
#[test]
fn a_read_that_ends_half_a_timeout_after_its_credit_scatters_nothing_and_fails() {
    let (mut ep, t) = endpoint(64 * KIB, 2, false);
    let reads = |acts: &[Action]| -> Vec<JobId> {
        acts.iter().filter_map(|a| if let Action::Read { job, .. } = a { Some(*job) } else { None }).collect()
    };
    for (xfer, late) in [(XferId(10), false), (XferId(11), true)] {
        ep.submit_read(t, xfer, TOKEN, PEER, plan_of(1), None).unwrap();
        assert!(msgs(&drain(&mut ep)).iter().any(|(_, m)| matches!(m, Msg::Pull(_))));
        let [job] = reads(&feed(&mut ep, t, grant_msg(xfer, &[(0, r(0))])))[..] else { panic!("one read") };
        let done = if late { t + TIMEOUT / 2 } else { t + TIMEOUT / 8 };
        ep.handle_read_done(done, job, true);
        let acts = drain(&mut ep);
        if late {
            assert!(scatters(&acts).is_empty(), "a late read's bytes were scattered");
            assert!(
                !msgs(&acts).iter().any(|(_, m)| matches!(m, Msg::Release(_))),
                "a late read's region was released as read"
            );
            assert_eq!(completes(&acts), vec![(xfer, Err(XferError::Timeout))]);
        } else {
            let [(scatter, _)] = scatters(&acts)[..] else { panic!("one scatter: {acts:?}") };
            ep.handle_scatter_done(done, scatter, true);
            assert_eq!(completes(&drain(&mut ep)), vec![(xfer, Ok(()))]);
        }
    }
    check(&ep);
}
