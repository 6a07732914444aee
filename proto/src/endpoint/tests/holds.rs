//! Review 56, H1: how long a flow may hold our arena without progress. A KEEP says a write is
//! in flight, so it pushes the lease on, but only until a request timeout after the flow's last
//! progress; and a flow opens only on a WANT (or PULL) that proves a registration, two way as
//! one way, since a loaded peer's name and session are published.

use super::*;

fn one_way_want(name: &str, xfer: u64, chunks: &[u64]) -> Vec<u8> {
    let w = Want {
        arena: ArenaId(0),
        xfer: XferId(xfer),
        token: TOKEN,
        endpoint: wire::REPLY_MAILBOX.to_vec(),
        chunks: chunks.to_vec(),
        proofs: vec![proof_by(name, xfer)],
        inline: None,
        standing: Default::default(),
    };
    wire::Frame { session: 99, msg: Msg::Want(w) }.to_vec()
}

fn one_way_keep(xfer: u64) -> Vec<u8> {
    wire::Frame { session: 99, msg: Msg::Keep(wire::Keep { xfer: XferId(xfer), token: TOKEN }) }.to_vec()
}

/// An agent holding one registration's key opens flows under two invented one-way names, which
/// take the whole arena, and then only KEEPs them (no DATA ever). Before review 56 the honest
/// initiator's flow got no region in 30 request timeouts; now the two are reclaimed one and a
/// half request timeouts after their grants, and the honest flow is granted.
#[test]
fn keeps_alone_hold_regions_at_most_a_request_timeout_after_the_last_progress() {
    let (mut ep, t) = endpoint(16 * KIB, 2, false); // 4 regions of 4 KiB
    ep.keep_mailbox(true);
    for name in ["m1", "m2"] {
        ep.handle_frame(t, name, &one_way_want(name, 1, &[CHUNK, CHUNK])).unwrap();
    }
    drain(&mut ep);
    assert_eq!(ep.arena_free_bytes(), 0, "the two names hold the arena");
    ep.handle_frame(t, "honest", &one_way_want("honest", 1, &[CHUNK])).unwrap();
    drain(&mut ep);
    let honest = FlowKey { peer: ep.peers().lookup("honest").unwrap(), xfer: XferId(1) };
    let (mut now, mut granted_at) = (t, None);
    while now < t + TIMEOUT * 4 && granted_at.is_none() {
        now += TIMEOUT / 5; // a KEEP per name every fifth of a timeout (the lease is half)
        for name in ["m1", "m2"] {
            ep.handle_frame(now, name, &one_way_keep(1)).unwrap();
        }
        if ep.poll_timeout().is_some_and(|d| d <= now) {
            ep.handle_timeout(now);
        }
        drain(&mut ep);
        if ep.schedulers().flow_held_count(honest) > 0 {
            granted_at = Some(now);
        }
    }
    let granted_at = granted_at.expect("the honest flow got a region");
    // The KEEPs' flows go one and a half request timeouts after their grants; their regions
    // rest in quarantine a quarter timeout more (a late write lands where nobody reads).
    let bound = TIMEOUT * 3 / 2 + TIMEOUT / 4 + TIMEOUT * 2 / 5; // two KEEP steps of slack
    assert!(granted_at - t <= bound, "granted after {:?}", granted_at - t);
    assert!(ep.stats().flows_timed_out >= 2, "{:?}", ep.stats());
}

/// The same with no key: anyone holding two loaded peers' metadata knows their names and
/// sessions, and sent two-way WANTs under them that proved nothing, each opening a flow that
/// took a share of the arena. Such a WANT now opens nothing and gets no answer.
#[test]
fn a_want_under_a_loaded_name_that_proves_nothing_opens_no_flow() {
    let (mut ep, t) = endpoint(16 * KIB, 2, false);
    for (name, s) in [("p1", 71u64), ("p2", 72), ("honest", 73)] {
        assert_eq!(ep.handle_conn_info(t, name, Some(caps(s)), Some(&caps(1))), Loaded::Compatible);
    }
    let unproven = Msg::Want(Want {
        arena: ArenaId(0),
        xfer: XferId(1),
        token: FORGED,
        endpoint: Vec::new(),
        chunks: vec![CHUNK, CHUNK],
        proofs: Vec::new(),
        inline: None,
        standing: Default::default(),
    });
    for (name, s) in [("p1", 71u64), ("p2", 72)] {
        assert!(ep.handle_frame(t, name, &frame(s, unproven.clone())).is_err(), "{name}'s forged WANT");
        assert!(drain(&mut ep).is_empty(), "a forgery gets no answer");
    }
    assert_eq!(ep.arena_free_bytes(), 16 * KIB, "nothing held");
    ep.handle_frame(t, "honest", &frame(73, want_msg_by("honest", XferId(1), &[CHUNK]))).unwrap();
    drain(&mut ep);
    let honest = FlowKey { peer: ep.peers().lookup("honest").unwrap(), xfer: XferId(1) };
    assert_eq!(ep.schedulers().flow_held_count(honest), 1, "granted at once");
}

/// Review 61 (credits, H1): a flow's lease runs from its last progress, so a sender that
/// writes chunk 1, 2, 3, ... of a flow, each within a lease, and never chunk 0, held chunk 0's
/// region for ever (a few such regions, one per max-chunk block, kept every max-chunk flow
/// out of the arena). Each region now has its own cap: idle for `REGION_LEASES` leases after
/// its grant, its flow is granted nothing more and ends by its lease, whatever it did with its
/// other regions.
#[test]
fn a_region_never_written_is_reclaimed_while_its_flow_writes_the_others() {
    let (mut ep, t0) = endpoint(32 * KIB, 2, false);
    let key = FlowKey { peer: PEER, xfer: X };
    ep.handle_msg(t0, PEER, want_msg(X, &[CHUNK; 64])).unwrap();
    let credits = |acts: &[Action]| -> Vec<(u32, Region)> {
        msgs(acts)
            .into_iter()
            .filter_map(|(_, m)| match m {
                Msg::Grant(g) => Some(g.credits),
                _ => None,
            })
            .flatten()
            .map(|c| (c.chunk.0, c.region))
            .collect()
    };
    let first = credits(&drain(&mut ep));
    assert_eq!(first.len(), 2, "W = 2 credits: {first:?}");
    let (pinned, mut next, mut t) = (first[0].1, first[1], t0);
    let mut written = 0;
    // Four timeouts: the sender writes its newest chunk every quarter timeout, never chunk 0.
    for _ in 0..16 {
        t += TIMEOUT / 4;
        ep.handle_timeout(t);
        ep.handle_msg(t, PEER, data_msg(X, next.0, next.1, vec![run(0, DST, CHUNK)])).unwrap();
        let [(job, _)] = scatters(&drain(&mut ep))[..] else { break };
        ep.handle_scatter_done(t, job, true);
        written += 1;
        match credits(&drain(&mut ep))[..] {
            [c] => next = c,
            _ => break,
        }
    }
    assert!(written >= 4, "the flow made progress for a while ({written} chunks written)");
    // Frozen, the flow gets no more credits; it ends by its own lease, a lease after its last
    // progress (a write it had in flight then lands in quarantine, never in a region granted
    // since).
    for _ in 0..4 {
        t += TIMEOUT / 4;
        ep.handle_timeout(t);
    }
    drain(&mut ep);
    assert!(
        ep.scheduler().is_held(key, pinned.offset).is_none(),
        "a region left unwritten for four timeouts is still held: the lease was per flow only"
    );
    assert!(ep.stats().flows_timed_out >= 1, "{:?}", ep.stats());
    // Frozen about `REGION_LEASES` leases (plus one lease of timer slack) after its grant: no
    // credit after that point.
    let lease = TIMEOUT / 2;
    let cap = lease * crate::receiver::REGION_LEASES + lease;
    assert!(
        u32::try_from(written).unwrap() <= cap.as_millis() as u32 / (TIMEOUT / 4).as_millis() as u32,
        "{written} chunks written before the reclaim (cap {cap:?})"
    );
}
