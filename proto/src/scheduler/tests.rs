//! Scheduler tests: design examples, ledger misuse, and the fairness/liveness property.

use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

use proptest::prelude::*;

use super::*;
use crate::types::XferId;

const G: u64 = 4096;

fn flow(peer: u64, xfer: u64) -> FlowKey {
    FlowKey { peer: PeerId(peer), xfer: XferId(xfer) }
}

fn sched(units: u64, window: u32) -> CreditScheduler {
    CreditScheduler::new(units * G, G, window).unwrap()
}

/// `(flow, chunk)` of each grant, for order assertions.
fn order(grants: &[Grant]) -> Vec<(FlowKey, u32)> {
    grants.iter().map(|g| (g.flow, g.chunk.0)).collect()
}

/// Scatters and ends `g` (DATA arrived, scatter done), checking invariants.
fn ack(s: &mut CreditScheduler, g: &Grant) -> EndScatter {
    s.begin_scatter(g.flow, g.region.offset).unwrap();
    let done = s.end_scatter(g.region.offset).unwrap();
    s.check_invariants().unwrap();
    done
}

#[test]
fn design_example_w2_grants_a_b_a_b_then_stops() {
    let (a, b) = (flow(1, 1), flow(2, 1));
    // The arena fits four regions; W = 2.
    let mut s = sched(4, 2);
    s.want(a, &[G, G, G]).unwrap();
    s.want(b, &[G, G]).unwrap();
    let grants = s.schedule();
    assert_eq!(order(&grants), vec![(a, 0), (b, 0), (a, 1), (b, 1)]);
    assert_eq!((s.flow_held_count(a), s.flow_held_count(b)), (2, 2));
    assert_eq!(s.pending_chunks(a), 1, "c3 waits for one of A's regions");
    assert!(s.schedule().is_empty());
    // One of A's regions is ACKed: the next schedule() grants c3 into it.
    ack(&mut s, &grants[0]);
    let next = s.schedule();
    assert_eq!(order(&next), vec![(a, 2)]);
    assert_eq!(next[0].region, grants[0].region);
    s.check_invariants().unwrap();
}

#[test]
fn window_caps_held_regions_even_with_space_left() {
    let f = flow(1, 1);
    let mut s = sched(64, 3);
    s.want(f, &[G; 10]).unwrap();
    let mut held: VecDeque<Grant> = s.schedule().into();
    assert_eq!(held.len(), 3);
    assert_eq!(s.free_bytes(), 61 * G);
    for next in 3..10 {
        ack(&mut s, &held.pop_front().unwrap());
        let g = s.schedule();
        assert_eq!(order(&g), vec![(f, next)], "one ACK, one credit");
        held.extend(g);
    }
    while let Some(g) = held.pop_front() {
        ack(&mut s, &g);
        assert!(s.schedule().is_empty());
    }
    assert!(!s.has_flow(f), "erased when done");
    assert_eq!(s.free_bytes(), 64 * G);
}

#[test]
fn grants_rotate_strictly_across_flows_in_a_tight_arena() {
    let flows: Vec<FlowKey> = (0..4).map(|x| flow(7, x)).collect();
    let mut s = sched(3, 8);
    for &f in &flows {
        s.want(f, &[G; 30]).unwrap();
    }
    let mut seen = Vec::new();
    let mut held: VecDeque<Grant> = VecDeque::new();
    for _ in 0..200 {
        let grants = s.schedule();
        seen.extend(grants.iter().map(|g| g.flow));
        held.extend(grants);
        let Some(g) = held.pop_front() else { break };
        ack(&mut s, &g);
    }
    assert_eq!(seen.len(), 120);
    // Three regions for four flows: every grant goes to the flow after the previous one.
    for (i, f) in seen.iter().enumerate() {
        assert_eq!(*f, flows[i % 4], "grant {i}");
    }
    assert_eq!(s.active_flows(), 0);
}

#[test]
fn a_peer_with_many_flows_leaves_half_the_arena_to_a_waiting_peer() {
    // 8 regions. Peer 1 has 100 flows; peer 2 asks after it.
    let mut s = sched(8, 8);
    for x in 0..100 {
        s.want(flow(1, x), &[G; 8]).unwrap();
    }
    let mut held: VecDeque<Grant> = s.schedule().into();
    assert_eq!(held.len(), 8, "alone, a peer may use the whole arena");
    s.want(flow(2, 0), &[G; 8]).unwrap();
    assert!(s.schedule().is_empty(), "nothing is free yet");
    // As peer 1's regions turn over, peer 2 gets every freed one until peer 1 is down to half.
    let mut to_two = 0;
    for _ in 0..8 {
        ack(&mut s, &held.pop_front().unwrap());
        let g = s.schedule();
        to_two += g.iter().filter(|g| g.flow.peer == PeerId(2)).count();
        held.extend(g.into_iter().filter(|g| g.flow.peer == PeerId(1)));
        s.check_invariants().unwrap();
    }
    let held_by_one: u64 = (0..100).map(|x| s.flow_held_bytes(flow(1, x))).sum();
    assert_eq!(to_two, 4, "peer 2 reached its half");
    assert_eq!(held_by_one, 4 * G);
}

#[test]
fn drain_mode_admits_a_big_head_blocked_by_a_stream_of_small_chunks() {
    // One peer, two flows: drain mode is about flows (across peers the share cap binds first).
    let (small, big) = (flow(1, 1), flow(1, 2));
    let mut s = sched(8, 100);
    s.want(small, &[G; 100]).unwrap();
    let mut held: VecDeque<Grant> = s.schedule().into();
    assert_eq!(held.len(), 8, "small fills the arena");
    s.want(big, &[8 * G]).unwrap();
    assert!(s.schedule().is_empty());
    // Without drain mode every freed unit would go straight back to `small` and `big`
    // would starve. It is stamped at grant 8 with two flows: drain at grant 8 + 2 * 2.
    for _ in 0..4 {
        ack(&mut s, &held.pop_front().unwrap());
        let g = s.schedule();
        assert_eq!(order(&g), vec![(small, s.grant_seq() as u32 - 1)]);
        held.extend(g);
    }
    assert_eq!(s.grant_seq(), 12);
    assert_eq!(s.drain_target(), Some(big));
    // Drain mode: the freed space is held back until the big head fits.
    for _ in 0..7 {
        ack(&mut s, &held.pop_front().unwrap());
        assert!(s.schedule().is_empty());
    }
    assert_eq!(s.free_bytes(), 7 * G, "space accumulates for the drain target");
    ack(&mut s, &held.pop_front().unwrap());
    let g = s.schedule();
    assert_eq!(order(&g), vec![(big, 0)]);
    assert_eq!(g[0].region, Region { offset: 0, len: 8 * G });
    assert_eq!(s.drain_target(), None);
    ack(&mut s, &g[0]);
    assert_eq!(s.schedule().len(), 8, "small resumes");
    s.check_invariants().unwrap();
}

/// A stamp counts two rounds of the flows still active: when flows leave (cancelled, or their
/// peer lost), a blocked flow's deadline tightens to two rounds of those left, instead of
/// waiting out rounds of flows that are gone.
#[test]
fn a_blocked_flows_deadline_tightens_when_other_flows_leave() {
    let (small, big) = (flow(1, 1), flow(1, 2));
    let gone = [flow(1, 3), flow(1, 4), flow(1, 5)];
    let mut s = sched(8, 100);
    for f in [small, gone[0], gone[1], gone[2]] {
        s.want(f, &[G; 100]).unwrap();
    }
    let mut held: VecDeque<Grant> = s.schedule().into();
    assert_eq!(held.len(), 8, "four flows fill the arena");
    held.retain(|g| g.flow == small);
    s.want(big, &[8 * G]).unwrap();
    assert!(s.schedule().is_empty());
    // `big` is stamped at grant 8 with five flows: two rounds of them end at grant 18. Three
    // leave, so two rounds of the two left end at grant 8 + 2 * 2.
    for f in gone {
        s.reclaim_flow(f, Reuse::Now);
    }
    let g = s.schedule();
    assert_eq!(order(&g), (2..6).map(|c| (small, c)).collect::<Vec<_>>(), "two rounds of two flows");
    assert_eq!((s.grant_seq(), s.drain_target()), (12, Some(big)));
    held.extend(g);
    while let Some(g) = held.pop_front() {
        ack(&mut s, &g);
        assert!(held.is_empty() || s.schedule().is_empty(), "drain mode holds the space for big");
    }
    assert_eq!(order(&s.schedule()), vec![(big, 0)]);
    s.check_invariants().unwrap();
}

#[test]
fn local_staging_ignores_drain_mode() {
    let (small, big) = (flow(1, 1), flow(1, 2));
    let mut s = sched(8, 100);
    s.want(small, &[G; 100]).unwrap();
    let mut held: VecDeque<Grant> = s.schedule().into();
    s.want(big, &[8 * G]).unwrap();
    s.schedule();
    while s.drain_target().is_none() {
        ack(&mut s, &held.pop_front().unwrap());
        held.extend(s.schedule());
    }
    ack(&mut s, &held.pop_front().unwrap());
    assert!(s.schedule().is_empty());
    let local = s.acquire_local(G, false).expect("drain mode is a remote-only barrier");
    s.check_invariants().unwrap();
    s.release_local(local.offset).unwrap();
}

#[test]
fn reclaim_flow_defers_a_scattering_region_until_end_scatter() {
    let (a, b) = (flow(1, 1), flow(1, 2));
    let mut s = sched(4, 4);
    s.want(a, &[G, G, G, G, G]).unwrap();
    let grants = s.schedule();
    assert_eq!(grants.len(), 4);
    let busy = grants[1];
    s.begin_scatter(a, busy.region.offset).unwrap();
    let r = s.reclaim_flow(a, Reuse::Now);
    let others: Vec<Region> = [0, 2, 3].iter().map(|&i| grants[i].region).collect();
    assert_eq!(r, Reclaimed { freed: others, quarantined: vec![], deferred: vec![busy.region] });
    assert!(!s.has_flow(a));
    assert_eq!(s.free_bytes(), 3 * G);
    s.check_invariants().unwrap();
    // The orphaned region is not re-granted while the scatter still reads it.
    s.want(b, &[4 * G]).unwrap();
    assert!(s.schedule().is_empty());
    // A late DATA for the cancelled flow is rejected.
    assert_eq!(s.is_held(a, grants[0].region.offset), None);
    assert!(matches!(s.begin_scatter(a, grants[0].region.offset), Err(SchedError::NotHeld { .. })));
    let end = s.end_scatter(busy.region.offset).unwrap();
    assert_eq!(end, EndScatter { flow: a, chunk: ChunkIdx(1), region: busy.region, orphaned: true });
    assert_eq!(order(&s.schedule()), vec![(b, 0)]);
    s.check_invariants().unwrap();
    assert_eq!(s.reclaim_flow(a, Reuse::Now), Reclaimed::default(), "a second cancel is a no-op");
}

#[test]
fn reclaim_peer_reclaims_every_flow_of_that_peer_only() {
    let mut s = sched(16, 2);
    let lost = [flow(3, 1), flow(3, 9), flow(3, u64::MAX)];
    let kept = flow(4, 0);
    for f in lost.iter().chain([&kept]) {
        s.want(*f, &[G, G, G]).unwrap();
    }
    let grants = s.schedule();
    assert_eq!(grants.len(), 8);
    let r = s.reclaim_peer(PeerId(3), Reuse::Now);
    assert_eq!(r.freed.len(), 6);
    assert!(r.deferred.is_empty());
    assert_eq!(s.active_flows(), 1);
    assert_eq!(s.flow_held_count(kept), 2);
    assert_eq!(s.free_bytes(), 14 * G);
    s.check_invariants().unwrap();
    assert_eq!(order(&s.schedule()), vec![], "kept is at its window");
}

#[test]
fn a_region_reclaimed_from_a_silent_writer_is_granted_again_only_after_its_quarantine() {
    let (silent, lost, next) = (flow(1, 1), flow(2, 1), flow(3, 1));
    let t0 = Instant::now();
    let (t1, t2) = (t0 + Duration::from_secs(1), t0 + Duration::from_secs(2));
    let mut s = sched(4, 4);
    s.want(silent, &[G, G]).unwrap();
    s.want(lost, &[G]).unwrap();
    let grants = s.schedule();
    assert_eq!(grants.len(), 3);
    let busy = grants.iter().find(|g| g.flow == silent).unwrap().region;
    s.begin_scatter(silent, busy.offset).unwrap();
    let r = s.reclaim_flow(silent, Reuse::After(t2));
    let idle: Vec<Region> = grants.iter().filter(|g| g.flow == silent && g.region != busy).map(|g| g.region).collect();
    assert_eq!(r, Reclaimed { freed: vec![], quarantined: idle.clone(), deferred: vec![busy] });
    let r = s.reclaim_peer(PeerId(2), Reuse::After(t1));
    let lost_region = grants.iter().find(|g| g.flow == lost).unwrap().region;
    assert_eq!(r.quarantined, vec![lost_region]);
    assert_eq!((s.quarantined_bytes(), s.free_bytes(), s.next_lift()), (2 * G, G, Some(t1)));
    s.check_invariants().unwrap();
    // Quarantined regions belong to nobody: a late DATA naming one is refused.
    assert_eq!(s.is_held(silent, idle[0].offset), None);
    assert_eq!(s.is_held(lost, lost_region.offset), None);
    // The whole arena is wanted; the one free unit is not enough while the rest rests.
    s.want(next, &[4 * G]).unwrap();
    assert!(s.schedule().is_empty());
    assert!(s.lift_quarantine(Some(t0)).is_empty(), "nothing is due before its instant");
    assert!(s.end_scatter(busy.offset).unwrap().orphaned);
    assert!(s.schedule().is_empty(), "the scattered region is back, the quarantined ones are not");
    assert_eq!(s.lift_quarantine(Some(t1)), vec![lost_region]);
    assert_eq!(s.next_lift(), Some(t2));
    assert!(s.schedule().is_empty());
    assert_eq!(s.lift_quarantine(Some(t2 + Duration::from_millis(1))), idle);
    assert_eq!((s.quarantined_bytes(), s.next_lift()), (0, None));
    assert_eq!(order(&s.schedule()), vec![(next, 0)]);
    s.check_invariants().unwrap();
}

#[test]
fn a_cancel_of_a_reclaimed_flow_lifts_its_quarantine_and_no_other() {
    let t = Instant::now() + Duration::from_secs(3600);
    let (a, b) = (flow(1, 1), flow(1, 2));
    let mut s = sched(8, 4);
    s.want(a, &[G, G]).unwrap();
    s.want(b, &[G]).unwrap();
    let grants = s.schedule();
    let of = |f: FlowKey| grants.iter().filter(|g| g.flow == f).map(|g| g.region).collect::<Vec<_>>();
    assert_eq!(s.reclaim_peer(PeerId(1), Reuse::After(t)).quarantined.len(), 3);
    assert!(s.is_resting(a) && s.is_resting(b));
    assert_eq!(s.lift_flow(a), of(a), "flow a's writer said its writes ended");
    assert!(!s.is_resting(a) && s.is_resting(b));
    assert_eq!(s.lift_flow(a), vec![], "a second cancel lifts nothing");
    assert_eq!((s.quarantined_bytes(), s.next_lift()), (G, Some(t)));
    s.check_invariants().unwrap();
    assert_eq!(s.lift_quarantine(Some(t)), of(b));
    assert!(!s.is_resting(b));
    s.check_invariants().unwrap();
}

#[test]
fn a_peers_resting_regions_count_against_its_share_of_the_arena() {
    let t = Instant::now() + Duration::from_secs(3600);
    let (a, b, c) = (flow(1, 1), flow(1, 2), flow(2, 1));
    let mut s = sched(8, 8);
    s.want(a, &[G, G, G, G]).unwrap();
    assert_eq!(s.schedule().len(), 4, "alone, peer 1 takes half the arena");
    // Its grants are reclaimed unwritten (refused DATA, silence): they rest, held by nobody.
    assert_eq!(s.reclaim_flow(a, Reuse::After(t)).quarantined.len(), 4);
    // Peer 2 waits for more than is free; peer 1 asks again.
    s.want(c, &[8 * G]).unwrap();
    s.want(b, &[G]).unwrap();
    assert_eq!(order(&s.schedule()), vec![], "peer 1's resting half is still its share");
    assert!(s.over_peer_share(PeerId(1), G));
    s.check_invariants().unwrap();
    // Its writer's cancel ends the rest: the arena is whole again and peer 2 takes it.
    s.lift_flow(a);
    assert_eq!(order(&s.schedule()), vec![(c, 0)]);
    s.check_invariants().unwrap();
}

#[test]
fn shutting_down_lifts_every_quarantine_at_once() {
    let t = Instant::now() + Duration::from_secs(3600);
    let mut s = sched(4, 4);
    s.want(flow(1, 1), &[G, G, G]).unwrap();
    assert_eq!(s.schedule().len(), 3);
    assert_eq!(s.reclaim_flow(flow(1, 1), Reuse::After(t)).quarantined.len(), 3);
    assert_eq!(s.lift_quarantine(None).len(), 3);
    assert_eq!((s.free_bytes(), s.quarantined_bytes()), (4 * G, 0));
    s.check_invariants().unwrap();
}

#[test]
fn finished_flows_are_erased_so_state_stays_bounded() {
    let mut s = sched(8, 2);
    for x in 0..10_000u64 {
        let f = flow(x % 5, x);
        s.want(f, &[G, 2 * G]).unwrap();
        for g in s.schedule() {
            ack(&mut s, &g);
        }
        for g in s.schedule() {
            ack(&mut s, &g);
        }
        assert_eq!(s.active_flows(), 0);
    }
    assert_eq!(s.grant_seq(), 20_000);
    assert_eq!(s.free_bytes(), 8 * G);
}

#[test]
fn eager_staging_is_capped_at_half_the_arena_and_credit_backed_is_not() {
    let mut s = sched(8, 2);
    assert_eq!(s.eager_cap(), 4 * G);
    let e1 = s.acquire_local(2 * G, true).unwrap();
    let e2 = s.acquire_local(G + 1, true).unwrap();
    assert_eq!(s.eager_bytes(), 4 * G);
    assert_eq!(s.acquire_local(1, true), None, "eager budget spent");
    let c = s.acquire_local(2 * G, false).unwrap();
    assert_eq!(s.local_bytes(), 6 * G);
    s.promote_local(e1.offset).unwrap();
    assert_eq!(s.eager_bytes(), 2 * G);
    let e3 = s.acquire_local(2 * G, true).unwrap();
    assert_eq!(s.acquire_local(1, false), None, "arena full");
    s.check_invariants().unwrap();
    for r in [e1, e2, c, e3] {
        s.release_local(r.offset).unwrap();
    }
    assert_eq!((s.local_bytes(), s.eager_bytes(), s.free_bytes()), (0, 0, 8 * G));
    assert_eq!(s.acquire_local(0, false), None);
}

#[test]
fn local_misuse_is_an_error_not_a_panic() {
    let mut s = sched(8, 2);
    let r = s.acquire_local(G, false).unwrap();
    assert_eq!(s.promote_local(r.offset), Err(SchedError::NotEager { offset: r.offset }));
    assert_eq!(s.release_local(r.offset), Ok(r));
    assert_eq!(s.release_local(r.offset), Err(SchedError::NotLocal { offset: r.offset }));
    assert_eq!(s.promote_local(r.offset), Err(SchedError::NotLocal { offset: r.offset }));
    // A remote grant is not local staging.
    s.want(flow(1, 1), &[G]).unwrap();
    let g = s.schedule()[0];
    assert_eq!(s.release_local(g.region.offset), Err(SchedError::NotLocal { offset: g.region.offset }));
    s.check_invariants().unwrap();
}

#[test]
fn want_rejects_empty_and_oversized_chunks_atomically() {
    let f = flow(1, 1);
    // 7 units: the largest block is 4 units.
    let mut s = CreditScheduler::new(7 * G + 5, G, 2).unwrap();
    assert_eq!(s.max_chunk_bytes(), 4 * G);
    assert_eq!(s.want(f, &[G, 0]), Err(SchedError::EmptyChunk { flow: f, index: 1 }));
    assert_eq!(s.want(f, &[G, 4 * G + 1]), Err(SchedError::ChunkTooLarge { flow: f, bytes: 4 * G + 1, max: 4 * G }));
    assert_eq!(s.active_flows(), 0, "nothing queued from a rejected WANT");
    assert_eq!(s.want(f, &[]), Ok(()));
    assert_eq!(s.active_flows(), 0, "an empty WANT creates no flow");
    assert_eq!(CreditScheduler::new(G, G, 0).unwrap_err(), SchedError::ZeroWindow);
    assert!(matches!(CreditScheduler::new(G, 3, 1), Err(SchedError::Alloc(_))));
}

#[test]
fn chunk_indices_continue_across_wants() {
    let f = flow(1, 1);
    let mut s = sched(16, 8);
    s.want(f, &[G]).unwrap();
    s.want(f, &[G, G]).unwrap();
    assert_eq!(order(&s.schedule()), vec![(f, 0), (f, 1), (f, 2)]);
    s.want(f, &[G]).unwrap();
    assert_eq!(order(&s.schedule()), vec![(f, 3)]);
}

#[test]
fn data_validation_rejects_foreign_duplicate_and_unknown_regions() {
    let (a, b) = (flow(1, 1), flow(2, 1));
    let mut s = sched(8, 2);
    s.want(a, &[G]).unwrap();
    s.want(b, &[G]).unwrap();
    let g = s.schedule();
    let (ga, gb) = (g[0], g[1]);
    assert_eq!(s.is_held(a, ga.region.offset), Some(ga));
    assert_eq!(s.is_held(a, gb.region.offset), None, "another flow's region");
    assert!(matches!(s.begin_scatter(a, gb.region.offset), Err(SchedError::NotHeld { .. })));
    s.begin_scatter(a, ga.region.offset).unwrap();
    assert_eq!(s.is_held(a, ga.region.offset), None, "already scattering");
    assert_eq!(s.begin_scatter(a, ga.region.offset), Err(SchedError::AlreadyScattering { offset: ga.region.offset }));
    assert_eq!(s.end_scatter(gb.region.offset), Err(SchedError::NotScattering { offset: gb.region.offset }));
    let end = s.end_scatter(ga.region.offset).unwrap();
    assert_eq!(end, EndScatter { flow: a, chunk: ChunkIdx(0), region: ga.region, orphaned: false });
    assert_eq!(s.end_scatter(ga.region.offset), Err(SchedError::NotScattering { offset: ga.region.offset }));
    s.check_invariants().unwrap();
}

// ---- Random operation sequences -------------------------------------------------------

#[derive(Debug, Clone)]
enum Op {
    /// Raw chunk sizes, mapped to `1..=largest block` skewed towards small ones.
    Want {
        id: u8,
        chunks: Vec<u64>,
    },
    /// A WANT with one bad chunk (0 bytes or over the largest block).
    BadWant {
        id: u8,
        zero: bool,
    },
    Begin(usize),
    End(usize),
    Ack(usize),
    /// A reclaim: freed at once with `None`, else quarantined for that many ms.
    Reclaim(u8, Option<u8>),
    ReclaimPeer(u8, Option<u8>),
    /// Time passes by this many ms, and the quarantines that ended are lifted.
    Tick(u8),
    /// The writer of flow `id` says its writes ended: its quarantined regions are freed.
    LiftFlow(u8),
    Acquire {
        raw: u64,
        eager: bool,
    },
    Promote(usize),
    Release(usize),
}

const FLOW_IDS: u8 = 6;

/// Flow `id` of a small key space, so keys are reused after a flow finishes (a new flow).
fn key(id: u8) -> FlowKey {
    flow(u64::from(id % 3), u64::from(id))
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..FLOW_IDS, prop::collection::vec(any::<u64>(), 1..6))
            .prop_map(|(id, chunks)| Op::Want { id, chunks }),
        1 => (0..FLOW_IDS, any::<bool>()).prop_map(|(id, zero)| Op::BadWant { id, zero }),
        2 => any::<usize>().prop_map(Op::Begin),
        2 => any::<usize>().prop_map(Op::End),
        4 => any::<usize>().prop_map(Op::Ack),
        1 => (0..FLOW_IDS, any::<Option<u8>>()).prop_map(|(id, rest)| Op::Reclaim(id, rest)),
        1 => (0..3u8, any::<Option<u8>>()).prop_map(|(p, rest)| Op::ReclaimPeer(p, rest)),
        1 => any::<u8>().prop_map(Op::Tick),
        1 => (0..FLOW_IDS).prop_map(Op::LiftFlow),
        2 => (any::<u64>(), any::<bool>()).prop_map(|(raw, eager)| Op::Acquire { raw, eager }),
        1 => any::<usize>().prop_map(Op::Promote),
        2 => any::<usize>().prop_map(Op::Release),
    ]
}

/// A flow's wait for its next grant: it has pending chunks and fewer than `W` regions.
#[derive(Debug)]
struct Wait {
    /// Grants to other flows since the wait began.
    bypassed: u64,
    /// Active flows when the wait began.
    active_at_start: u64,
    /// Value of `Harness::incarnations` when the wait began.
    incarnations_at_start: u64,
}

/// A receiver that calls `schedule()` after every operation, as the contract requires, and
/// mirrors what the scheduler must be doing to judge each step.
struct Harness {
    s: CreditScheduler,
    /// Per active flow: chunks wanted but not granted, in order.
    pending: BTreeMap<FlowKey, VecDeque<(ChunkIdx, u64)>>,
    next_chunk: BTreeMap<FlowKey, u32>,
    /// Granted regions not yet scattering.
    granted: Vec<Grant>,
    /// Scattering regions, with their orphaned flag.
    scattering: Vec<(Grant, bool)>,
    local: Vec<(Region, bool)>,
    /// Quarantined regions, when each may be freed (in ms since `t0`) and their flow.
    quarantined: Vec<(u64, Region, FlowKey)>,
    t0: Instant,
    now_ms: u64,
    waits: BTreeMap<FlowKey, Wait>,
    /// Flows created so far (a reused key after erasure counts again).
    incarnations: u64,
    max_ratio: f64,
    drains: u64,
}

impl Harness {
    fn new(units: u64, extra: u64, window: u32) -> Self {
        Self {
            s: CreditScheduler::new(units * G + extra, G, window).unwrap(),
            pending: BTreeMap::new(),
            next_chunk: BTreeMap::new(),
            granted: Vec::new(),
            scattering: Vec::new(),
            local: Vec::new(),
            quarantined: Vec::new(),
            t0: Instant::now(),
            now_ms: 0,
            waits: BTreeMap::new(),
            incarnations: 0,
            max_ratio: 0.0,
            drains: 0,
        }
    }

    fn held(&self, f: FlowKey) -> usize {
        self.granted.iter().filter(|g| g.flow == f).count()
            + self.scattering.iter().filter(|(g, o)| g.flow == f && !o).count()
    }

    /// Waiting in the fairness sense: wants a credit, is under its window, and its peer is
    /// within its share of the arena (a peer over its share is held back on purpose while
    /// others wait: that is the share cap, not a fairness violation).
    fn waiting(&self, f: FlowKey) -> bool {
        let head = self.pending.get(&f).and_then(|p| p.front().copied());
        head.is_some_and(|(_, bytes)| !self.s.over_peer_share(f.peer, bytes)) && self.held(f) < self.s.window() as usize
    }

    /// Active flows: the mirror forgets a flow exactly when the scheduler must erase it.
    fn active(&self) -> Vec<FlowKey> {
        self.pending.keys().copied().collect()
    }

    fn start_wait(&mut self, f: FlowKey) {
        let wait =
            Wait { bypassed: 0, active_at_start: self.active().len() as u64, incarnations_at_start: self.incarnations };
        self.waits.insert(f, wait);
    }

    fn forget_if_done(&mut self, f: FlowKey) {
        if self.pending.get(&f).is_some_and(|p| p.is_empty()) && self.held(f) == 0 {
            self.pending.remove(&f);
            self.next_chunk.remove(&f);
        }
    }

    fn apply(&mut self, op: Op) -> std::result::Result<(), TestCaseError> {
        let max = self.s.max_chunk_bytes();
        match op {
            Op::Want { id, chunks } => {
                let f = key(id);
                // Mostly small chunks with some large ones: the mix that needs drain mode.
                let bytes: Vec<u64> = chunks.iter().map(|r| ((1 + r % max) >> ((r >> 60) % 5)).max(1)).collect();
                self.s.want(f, &bytes).map_err(|e| TestCaseError::fail(e.to_string()))?;
                if !self.pending.contains_key(&f) {
                    self.incarnations += 1;
                }
                let next = self.next_chunk.entry(f).or_insert(0);
                let q = self.pending.entry(f).or_default();
                for b in bytes {
                    q.push_back((ChunkIdx(*next), b));
                    *next += 1;
                }
            }
            Op::BadWant { id, zero } => {
                let bad = if zero { 0 } else { max + 1 };
                prop_assert!(self.s.want(key(id), &[G, bad]).is_err());
            }
            Op::Begin(i) if !self.granted.is_empty() => {
                let g = self.granted.remove(i % self.granted.len());
                prop_assert_eq!(self.s.is_held(g.flow, g.region.offset), Some(g));
                prop_assert_eq!(self.s.begin_scatter(g.flow, g.region.offset), Ok(g));
                self.scattering.push((g, false));
            }
            Op::End(i) if !self.scattering.is_empty() => {
                let (g, orphaned) = self.scattering.remove(i % self.scattering.len());
                let end = EndScatter { flow: g.flow, chunk: g.chunk, region: g.region, orphaned };
                prop_assert_eq!(self.s.end_scatter(g.region.offset), Ok(end));
                if !orphaned {
                    self.forget_if_done(g.flow);
                }
            }
            Op::Ack(i) if !self.granted.is_empty() => {
                let g = self.granted.remove(i % self.granted.len());
                self.s.begin_scatter(g.flow, g.region.offset).map_err(|e| TestCaseError::fail(e.to_string()))?;
                prop_assert_eq!(self.s.end_scatter(g.region.offset).map(|e| e.orphaned), Ok(false));
                self.forget_if_done(g.flow);
            }
            Op::Reclaim(id, rest) => {
                let reuse = self.reuse(rest);
                let want = self.expect_reclaim(key(id), rest);
                prop_assert_eq!(self.s.reclaim_flow(key(id), reuse), want);
            }
            Op::ReclaimPeer(p, rest) => {
                let flows: Vec<FlowKey> = self.pending.keys().copied().filter(|f| f.peer == PeerId(p.into())).collect();
                let mut want = Reclaimed::default();
                for &f in &flows {
                    let r = self.expect_reclaim(f, rest);
                    want.freed.extend(r.freed);
                    want.quarantined.extend(r.quarantined);
                    want.deferred.extend(r.deferred);
                }
                prop_assert_eq!(self.s.reclaim_peer(PeerId(p.into()), self.reuse(rest)), want);
            }
            Op::Tick(ms) => {
                self.now_ms += u64::from(ms);
                // Earliest instant first, ties by offset.
                self.quarantined.sort();
                let due = self.quarantined.iter().take_while(|(at, _, _)| *at <= self.now_ms).count();
                let want: Vec<Region> = self.quarantined.drain(..due).map(|(_, r, _)| r).collect();
                let now = self.t0 + Duration::from_millis(self.now_ms);
                prop_assert_eq!(self.s.lift_quarantine(Some(now)), want);
            }
            Op::LiftFlow(id) => {
                let f = key(id);
                let mut want: Vec<Region> =
                    self.quarantined.iter().filter(|(_, _, q)| *q == f).map(|&(_, r, _)| r).collect();
                want.sort();
                self.quarantined.retain(|(_, _, q)| *q != f);
                prop_assert_eq!(self.s.is_resting(f), !want.is_empty());
                prop_assert_eq!(self.s.lift_flow(f), want);
            }
            Op::Acquire { raw, eager } => {
                let bytes = 1 + raw % max;
                let len = self.s.buddy().block_len(bytes).unwrap();
                let eager_ok = !eager || self.s.eager_bytes() + len <= self.s.eager_cap();
                let fits = self.s.buddy().largest_free() >= len;
                let got = self.s.acquire_local(bytes, eager);
                prop_assert_eq!(got.is_some(), eager_ok && fits);
                if let Some(r) = got {
                    self.local.push((r, eager));
                }
            }
            Op::Promote(i) if !self.local.is_empty() => {
                let i = i % self.local.len();
                let (r, eager) = self.local[i];
                let want = if eager { Ok(()) } else { Err(SchedError::NotEager { offset: r.offset }) };
                prop_assert_eq!(self.s.promote_local(r.offset), want);
                self.local[i].1 = false;
            }
            Op::Release(i) if !self.local.is_empty() => {
                let (r, _) = self.local.remove(i % self.local.len());
                prop_assert_eq!(self.s.release_local(r.offset), Ok(r));
                prop_assert_eq!(self.s.release_local(r.offset), Err(SchedError::NotLocal { offset: r.offset }));
            }
            Op::Begin(_) | Op::End(_) | Op::Ack(_) | Op::Promote(_) | Op::Release(_) => {}
        }
        self.step()
    }

    fn reuse(&self, rest: Option<u8>) -> Reuse {
        match rest {
            None => Reuse::Now,
            Some(ms) => Reuse::After(self.t0 + Duration::from_millis(self.now_ms + u64::from(ms))),
        }
    }

    /// Updates the mirror for a reclaim of `f` and returns what the scheduler must report.
    fn expect_reclaim(&mut self, f: FlowKey, rest: Option<u8>) -> Reclaimed {
        let mut r = Reclaimed::default();
        let mut freed: Vec<Region> = self.granted.iter().filter(|g| g.flow == f).map(|g| g.region).collect();
        let mut deferred: Vec<Region> = Vec::new();
        self.granted.retain(|g| g.flow != f);
        for (g, orphaned) in &mut self.scattering {
            if g.flow == f && !*orphaned {
                *orphaned = true;
                deferred.push(g.region);
            }
        }
        // The scheduler reports a flow's regions by ascending offset, freed and deferred
        // interleaved as they come.
        freed.sort();
        deferred.sort();
        match rest {
            None => r.freed = freed,
            Some(ms) => {
                let at = self.now_ms + u64::from(ms);
                self.quarantined.extend(freed.iter().map(|&region| (at, region, f)));
                r.quarantined = freed;
            }
        }
        r.deferred = deferred;
        self.pending.remove(&f);
        self.next_chunk.remove(&f);
        self.waits.remove(&f);
        r
    }

    /// The receiver's `schedule()` after an operation, judged against the mirror.
    fn step(&mut self) -> std::result::Result<(), TestCaseError> {
        let flows: Vec<FlowKey> = self.pending.keys().copied().collect();
        self.waits.retain(|f, _| flows.contains(f));
        for f in flows {
            match (self.waiting(f), self.waits.contains_key(&f)) {
                (true, false) => self.start_wait(f),
                (false, true) => {
                    self.waits.remove(&f);
                }
                _ => {}
            }
        }
        let grants = self.s.schedule();
        for g in grants {
            let head = self.pending.get_mut(&g.flow).and_then(|q| q.pop_front());
            let Some((chunk, bytes)) = head else {
                return Err(TestCaseError::fail(format!("grant {g:?} for a flow with nothing pending")));
            };
            prop_assert_eq!(g.chunk, chunk, "chunks are granted in order");
            prop_assert_eq!(Some(g.region.len), self.s.buddy().block_len(bytes));
            prop_assert!(self.held(g.flow) < self.s.window() as usize, "window respected");
            for (f, w) in &mut self.waits {
                if *f != g.flow {
                    w.bypassed += 1;
                    // Fairness bound, with M = flows active at some point of the wait:
                    // - before the scheduler first looks at the waiting flow, sweep grants
                    //   only go to flows between the cursor and it: <= M - 1; each other
                    //   flow is swept past at most once, so it is drained at most twice
                    //   (one old stamp, one new): <= 2(M - 1) drain grants;
                    // - once its head did not fit it is stamped with deadline s + 2n, n <= M:
                    //   <= 2M grants until the deadline (a stamp older than the wait, kept
                    //   while the share cap held the flow back, has n = the ring then, or the
                    //   ring at the last departure since, as `tighten_stamps` pulls it in; the
                    //   ring has only grown after that, so n <= M still);
                    // - after the deadline only drain grants happen, each to a distinct flow
                    //   with an earlier deadline: <= M - 1.
                    let m = w.active_at_start + (self.incarnations - w.incarnations_at_start);
                    let bound = 6 * m - 4;
                    self.max_ratio = self.max_ratio.max(w.bypassed as f64 / m as f64);
                    prop_assert!(
                        w.bypassed <= bound,
                        "{:?} bypassed {} times, bound {} (M = {})",
                        f,
                        w.bypassed,
                        bound,
                        m
                    );
                }
            }
            self.waits.remove(&g.flow);
            self.granted.push(g);
            if self.waiting(g.flow) {
                self.start_wait(g.flow);
            }
        }
        prop_assert!(self.s.schedule().is_empty(), "schedule() is idempotent");
        if self.s.drain_target().is_none() {
            // A sweep it skipped (nothing changed since one granted nothing) missed no grant.
            prop_assert_eq!(grantable(&self.s), None);
        }
        let quarantined: u64 = self.quarantined.iter().map(|(_, r, _)| r.len).sum();
        let next = self.quarantined.iter().map(|&(at, _, _)| self.t0 + Duration::from_millis(at)).min();
        prop_assert_eq!((self.s.quarantined_bytes(), self.s.next_lift()), (quarantined, next));
        self.drains += u64::from(self.s.drain_target().is_some());
        self.s.check_invariants().map_err(TestCaseError::fail)?;
        let active = self.active();
        prop_assert_eq!(self.s.active_flows(), active.len());
        for f in active {
            prop_assert_eq!(self.s.pending_chunks(f), self.pending[&f].len());
            prop_assert_eq!(self.s.flow_held_count(f), self.held(f));
        }
        Ok(())
    }

    /// Liveness: with every grant eventually scattered and ACKed, local staging released and
    /// every quarantine lifted in time, every pending chunk is granted. Each round empties the
    /// arena, and an
    /// empty arena always fits the drain target or the first eligible head, so each round
    /// grants at least one chunk.
    fn drain_all(&mut self) -> std::result::Result<(), TestCaseError> {
        let total: usize = self.pending.values().map(VecDeque::len).sum();
        let mut rounds = 0;
        loop {
            while !self.scattering.is_empty() {
                self.apply(Op::End(0))?;
            }
            while !self.granted.is_empty() {
                self.apply(Op::Ack(0))?;
            }
            while !self.local.is_empty() {
                self.apply(Op::Release(0))?;
            }
            // Every quarantine ends at most 255 ms after its reclaim.
            self.apply(Op::Tick(u8::MAX))?;
            if self.pending.is_empty() {
                break;
            }
            rounds += 1;
            prop_assert!(rounds <= total + 1, "no progress: {} rounds for {} chunks", rounds, total);
        }
        prop_assert_eq!(self.s.active_flows(), 0);
        prop_assert_eq!(self.s.free_bytes(), self.s.usable_capacity());
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(160))]

    /// Invariants after every step, exact mirror agreement, the fairness bound, and
    /// liveness once all ACKs flow.
    #[test]
    fn random_operations_keep_invariants_fairness_and_liveness(
        units in 1u64..24,
        extra in 0u64..G,
        window in 1u32..4,
        ops in prop::collection::vec(op(), 0..100),
    ) {
        let mut h = Harness::new(units, extra, window);
        for op in ops {
            h.apply(op)?;
        }
        h.drain_all()?;
    }
}

/// Many flows competing for a tiny arena with mixed chunk sizes and one ACK per step: the
/// deterministic stress version of the fairness property.
#[test]
fn fairness_bound_holds_under_heavy_contention() {
    let mut h = Harness::new(8, 0, 2);
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    // Raw sizes map to bytes `1 + raw % 8G` (top bits cleared: no shift): one chunk in
    // eight needs the whole arena, the others one unit.
    let chunk = |r: u64| {
        if r % 8 == 0 { 4 * G + r % (4 * G) } else { r % G }
    };
    for id in 0..FLOW_IDS {
        let chunks = (0..40).map(|_| chunk(next() & !(0xf << 60))).collect();
        h.apply(Op::Want { id, chunks }).unwrap();
    }
    for _ in 0..3000 {
        let op = match next() % 10 {
            0 => Op::Want { id: (next() % u64::from(FLOW_IDS)) as u8, chunks: vec![chunk(next() & !(0xf << 60))] },
            1 => Op::Begin(next() as usize),
            2 => Op::End(next() as usize),
            _ => Op::Ack(next() as usize),
        };
        h.apply(op).unwrap();
    }
    h.drain_all().unwrap();
    assert!(h.drains > 0, "the workload exercises drain mode");
    assert!(h.max_ratio <= 6.0, "worst bypass/M ratio {}", h.max_ratio);
}

// ---- The fruitless-sweep short cut and batch reclaim (review 56 H2) ---------------------

/// A flow a full sweep would grant now, if any: eligible, within its peer's share, and its
/// head fits the largest free block.
fn grantable(s: &CreditScheduler) -> Option<FlowKey> {
    let largest = s.buddy().largest_free();
    s.ring.iter().copied().find(|k| {
        let f = &s.flows[k];
        f.held.len() < s.window() as usize
            && f.pending.front().is_some_and(|&(_, bytes)| {
                !s.over_peer_share(k.peer, bytes) && s.buddy().block_len(bytes).is_some_and(|l| l <= largest)
            })
    })
}

/// What fair share keeps: the ring, the cursor, every stamp, the drain target, grants issued.
type Fair = (Vec<FlowKey>, usize, Vec<(Blocked, FlowKey)>, Vec<(FlowKey, Option<Blocked>)>, Option<FlowKey>, u64);

fn fair_state(s: &CreditScheduler) -> Fair {
    (
        s.ring.clone(),
        s.cursor,
        s.blocked.iter().copied().collect(),
        s.flows.iter().map(|(k, f)| (*k, f.blocked)).collect(),
        s.drain,
        s.grant_seq,
    )
}

#[test]
fn a_sweep_after_no_change_visits_no_flow_and_any_change_restores_a_full_one() {
    // Four regions, W = 1: four flows hold them, a hundred more park (stamped, nothing fits).
    let mut s = sched(4, 1);
    let flows: Vec<FlowKey> = (0..104).map(|x| flow(1, x)).collect();
    for &f in &flows {
        s.want(f, &[G]).unwrap();
    }
    let held = s.schedule();
    assert_eq!(held.len(), 4);
    let parked = || flows.len() as u64 - 4;
    assert!(s.visits >= 104, "the first pass looked at every flow");
    assert_eq!(s.blocked.len() as u64, parked(), "every parked flow is stamped");
    let before = fair_state(&s);
    s.visits = 0;
    for _ in 0..10 {
        assert!(s.schedule().is_empty());
    }
    assert_eq!(s.visits, 0, "no change: no flow visited");
    assert_eq!(fair_state(&s), before, "and nothing else differs");

    // A want (a new flow) is a change: the next sweep visits every flow again, once.
    s.want(flow(9, 1), &[G]).unwrap();
    assert!(s.schedule().is_empty());
    assert_eq!(s.visits, 105);
    assert!(s.schedule().is_empty());
    assert_eq!(s.visits, 105, "then nothing changed again");
    s.check_invariants().unwrap();

    // A want that cannot fit (a chunk larger than any free block) on a parked flow still
    // counts as a change.
    s.want(flows[50], &[2 * G]).unwrap();
    s.visits = 0;
    assert!(s.schedule().is_empty());
    assert_eq!(s.visits, 105);

    // A free is a change: its region is granted, then the ring is swept in full and found
    // empty of fits, and the next schedule visits nothing.
    ack(&mut s, &held[0]);
    s.visits = 0;
    let g = s.schedule();
    assert_eq!(g.len(), 1);
    assert_eq!(grantable(&s), None);
    let after_grant = s.visits;
    assert!(after_grant >= 105, "{after_grant}");
    assert!(s.schedule().is_empty());
    assert_eq!(s.visits, after_grant);

    // Local staging given back is a change too.
    ack(&mut s, &g[0]);
    let local = s.acquire_local(G, false).unwrap();
    assert!(s.schedule().is_empty(), "the arena is full again");
    let v = s.visits;
    s.release_local(local.offset).unwrap();
    assert_eq!(s.schedule().len(), 1);
    assert!(s.visits > v);
    s.check_invariants().unwrap();
}

/// A reference that skips nothing: `touch` before each `schedule`, and a peer reclaimed one
/// flow at a time; the scheduler under test must agree with it at every step.
struct Twin {
    s: CreditScheduler,
    r: CreditScheduler,
    granted: Vec<Grant>,
    scattering: Vec<u64>,
    local: Vec<u64>,
    t0: Instant,
    now_ms: u64,
}

impl Twin {
    fn apply(&mut self, op: Op) -> std::result::Result<(), TestCaseError> {
        let max = self.s.max_chunk_bytes();
        let reuse = |now_ms: u64, rest: Option<u8>| match rest {
            None => Reuse::Now,
            Some(ms) => Reuse::After(self.t0 + Duration::from_millis(now_ms + u64::from(ms))),
        };
        match op {
            Op::Want { id, chunks } => {
                let bytes: Vec<u64> = chunks.iter().map(|r| ((1 + r % max) >> ((r >> 60) % 5)).max(1)).collect();
                prop_assert_eq!(self.s.want(key(id), &bytes), self.r.want(key(id), &bytes));
            }
            Op::BadWant { id, zero } => {
                let bad = if zero { 0 } else { max + 1 };
                prop_assert_eq!(self.s.want(key(id), &[G, bad]), self.r.want(key(id), &[G, bad]));
            }
            Op::Begin(i) if !self.granted.is_empty() => {
                let g = self.granted.remove(i % self.granted.len());
                prop_assert_eq!(
                    self.s.begin_scatter(g.flow, g.region.offset),
                    self.r.begin_scatter(g.flow, g.region.offset)
                );
                self.scattering.push(g.region.offset);
            }
            Op::End(i) if !self.scattering.is_empty() => {
                let o = self.scattering.remove(i % self.scattering.len());
                prop_assert_eq!(self.s.end_scatter(o), self.r.end_scatter(o));
            }
            Op::Ack(i) if !self.granted.is_empty() => {
                let g = self.granted.remove(i % self.granted.len());
                for t in [&mut self.s, &mut self.r] {
                    t.begin_scatter(g.flow, g.region.offset).map_err(|e| TestCaseError::fail(e.to_string()))?;
                }
                prop_assert_eq!(self.s.end_scatter(g.region.offset), self.r.end_scatter(g.region.offset));
            }
            Op::Reclaim(id, rest) => {
                let reuse = reuse(self.now_ms, rest);
                prop_assert_eq!(self.s.reclaim_flow(key(id), reuse), self.r.reclaim_flow(key(id), reuse));
                self.granted.retain(|g| g.flow != key(id));
            }
            Op::ReclaimPeer(p, rest) => {
                let (peer, reuse) = (PeerId(p.into()), reuse(self.now_ms, rest));
                let keys: Vec<FlowKey> = self.r.flows.range(FlowKey::all_of(peer)).map(|(k, _)| *k).collect();
                let mut want = Reclaimed::default();
                for k in keys {
                    let one = self.r.reclaim_flow(k, reuse);
                    want.freed.extend(one.freed);
                    want.quarantined.extend(one.quarantined);
                    want.deferred.extend(one.deferred);
                }
                prop_assert_eq!(self.s.reclaim_peer(peer, reuse), want);
                self.granted.retain(|g| g.flow.peer != peer);
            }
            Op::Tick(ms) => {
                self.now_ms += u64::from(ms);
                let now = Some(self.t0 + Duration::from_millis(self.now_ms));
                prop_assert_eq!(self.s.lift_quarantine(now), self.r.lift_quarantine(now));
            }
            Op::LiftFlow(id) => prop_assert_eq!(self.s.lift_flow(key(id)), self.r.lift_flow(key(id))),
            Op::Acquire { raw, eager } => {
                let got = self.s.acquire_local(1 + raw % max, eager);
                prop_assert_eq!(got, self.r.acquire_local(1 + raw % max, eager));
                self.local.extend(got.map(|r| r.offset));
            }
            Op::Promote(i) if !self.local.is_empty() => {
                let o = self.local[i % self.local.len()];
                prop_assert_eq!(self.s.promote_local(o), self.r.promote_local(o));
            }
            Op::Release(i) if !self.local.is_empty() => {
                let o = self.local.remove(i % self.local.len());
                prop_assert_eq!(self.s.release_local(o), self.r.release_local(o));
            }
            Op::Begin(_) | Op::End(_) | Op::Ack(_) | Op::Promote(_) | Op::Release(_) => {}
        }
        self.r.touch();
        let grants = self.s.schedule();
        prop_assert_eq!(&grants, &self.r.schedule());
        self.granted.extend(grants);
        prop_assert_eq!(fair_state(&self.s), fair_state(&self.r));
        self.s.check_invariants().map_err(TestCaseError::fail)?;
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(160))]

    /// The short cut and the batch reclaim change no outcome: grants, ring, cursor, stamps and
    /// drain mode match a scheduler that sweeps in full every time and reclaims flow by flow.
    #[test]
    fn short_cut_and_batch_reclaim_match_full_sweeps_and_one_by_one_reclaims(
        units in 1u64..24,
        extra in 0u64..G,
        window in 1u32..4,
        ops in prop::collection::vec(op(), 0..120),
    ) {
        let new = || CreditScheduler::new(units * G + extra, G, window).unwrap();
        let mut t = Twin {
            s: new(),
            r: new(),
            granted: Vec::new(),
            scattering: Vec::new(),
            local: Vec::new(),
            t0: Instant::now(),
            now_ms: 0,
        };
        for op in ops {
            t.apply(op)?;
        }
    }
}

#[test]
fn a_peers_batch_reclaim_leaves_ring_cursor_and_stamps_as_one_by_one() {
    // Three peers' flows interleaved in the ring, most parked and stamped; the cursor at each
    // position in turn (the flow there lost or kept).
    for cursor_at in 0..12 {
        let build = || {
            let mut s = sched(4, 1);
            for x in 0..12u64 {
                s.want(flow(1 + x % 3, x), &[G, G]).unwrap();
            }
            let held = s.schedule();
            // Vary the stamps' deadlines: one more flow arrives after some grants.
            s.want(flow(4, 99), &[G]).unwrap();
            ack(&mut s, &held[0]);
            s.schedule();
            s.cursor = cursor_at;
            s
        };
        let mut batch = build();
        let mut one = build();
        assert!(one.blocked.len() >= 8, "most flows are stamped");
        let r = batch.reclaim_peer(PeerId(2), Reuse::Now);
        let mut want = Reclaimed::default();
        for x in (1..12).step_by(3) {
            let r = one.reclaim_flow(flow(2, x), Reuse::Now);
            want.freed.extend(r.freed);
            want.deferred.extend(r.deferred);
        }
        assert_eq!(r, want);
        assert_eq!(fair_state(&batch), fair_state(&one), "cursor at {cursor_at}");
        batch.check_invariants().unwrap();
        // And they go on the same.
        one.touch();
        assert_eq!(batch.schedule(), one.schedule());
        assert_eq!(fair_state(&batch), fair_state(&one));
    }
}
