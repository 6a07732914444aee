//! FORGET ([`crate::forget`]): a peer that unloaded our metadata says so with the secret of its
//! load of us, which only its PONGs carried; nothing else undoes its HELLO.

use super::*;

/// `ep` asks about "a"'s HELLO and "a" answers the ask with a PONG carrying `secret`.
fn confirmed_with(ep: &mut Endpoint, t: Instant, id: PeerId, secret: Token) {
    ep.handle_frame(t, "a", &wire::encode_hello(1, 0)).unwrap();
    let nonce = ask_nonce(&drain(ep), id);
    let pong = wire::ControlFrame { session: 1, body: wire::Body::Pong { nonce, forget: secret } };
    ep.handle_frame(t, "a", &pong.to_vec()).unwrap();
    assert!(ep.peers().can_bounce("a"), "confirmed");
}

fn forget(session: u64, proof: Token) -> Vec<u8> {
    wire::ControlFrame { session, body: wire::Body::Forget { proof } }.to_vec()
}

#[test]
fn only_the_secret_of_the_confirming_pong_undoes_a_hello_and_our_transfers_fail_at_once() {
    let (mut ep, t, id) = with_ready_arena();
    let secret = Token(0x5ec2_e7f0_44e7);
    // Before its HELLO is confirmed there is nothing to undo (and nothing was promised, so
    // nothing is forged either), but the proof is kept: a PONG carrying that secret (sent
    // before the peer unloaded us, and overtaken by the FORGET) confirms nothing.
    let overtaken = Token(0x01d);
    ep.handle_frame(t, "a", &forget(1, overtaken)).unwrap();
    assert_eq!((ep.stats().peers_forgot_us, ep.stats().control_forged), (0, 0));
    ep.handle_frame(t, "a", &wire::encode_hello(1, 0)).unwrap();
    let nonce = ask_nonce(&drain(&mut ep), id);
    let late = wire::ControlFrame { session: 1, body: wire::Body::Pong { nonce, forget: overtaken } };
    ep.handle_frame(t, "a", &late.to_vec()).unwrap();
    assert!(!ep.peers().can_bounce("a"), "the PONG of the load the FORGET ended");
    confirmed_with(&mut ep, t, id, secret);
    // Our transfer to it in flight, and a flow of its into us.
    ep.submit(t, X, TOKEN, id, plan_of(2)).unwrap();
    ep.handle_frame(t, "a", &frame(1, want_msg_by("a", XferId(9), &[CHUNK]))).unwrap();
    drain(&mut ep);
    assert_eq!((ep.in_flight_xfers(), ep.remote_flows()), (1, 1));
    // Forgeries: another secret; the right one under another session; any under a name
    // never loaded. Each changes nothing.
    assert_eq!(ep.handle_frame(t, "a", &forget(1, Token(secret.0 ^ 1))), Err(FrameRefused::ForgedForget));
    assert!(matches!(ep.handle_frame(t, "a", &forget(2, secret)), Err(FrameRefused::StaleSession { .. })));
    assert_eq!(ep.handle_frame(t, "c", &forget(1, secret)), Err(FrameRefused::NotLoaded));
    assert!(drain(&mut ep).is_empty() && ep.peers().can_bounce("a"));
    assert_eq!((ep.in_flight_xfers(), ep.remote_flows(), ep.stats().peers_forgot_us), (1, 1, 0));
    assert_eq!(ep.stats().control_forged, 2, "the wrong secret and the stale session");
    // The peer's own FORGET: our transfer fails at once (not after the probe), its flow into
    // us is reclaimed, and it stays loaded under the same id, one way.
    ep.handle_frame(t, "a", &forget(1, secret)).unwrap();
    let acts = drain(&mut ep);
    assert_eq!(completes(&acts), vec![(X, Err(XferError::Forgotten))]);
    // And we say HELLO: were it to have loaded us again already, it would ask about it.
    assert!(acts.iter().any(|a| matches!(a, Action::Link { peer, body: wire::Body::Hello { .. } } if *peer == id)));
    assert_eq!((ep.in_flight_xfers(), ep.remote_flows(), ep.stats().peers_forgot_us), (0, 0, 1));
    assert!(!ep.peers().can_bounce("a") && !ep.peers().is_reachable("a"), "one way now");
    assert!(ep.peers().is_loaded("a") && ep.peers().lookup("a") == Some(id), "still loaded, same id");
    // Replayed: nothing left to undo.
    ep.handle_frame(t, "a", &forget(1, secret)).unwrap();
    assert_eq!(ep.stats().peers_forgot_us, 1);
    // It loads us again: its HELLO is asked about, and the PONG brings that load's secret. The
    // FORGET of the earlier load, replayed or late, undoes nothing now.
    confirmed_with(&mut ep, t, id, Token(0xa9a1));
    assert_eq!(ep.handle_frame(t, "a", &forget(1, secret)), Err(FrameRefused::ForgedForget));
    assert!(ep.peers().can_bounce("a"));
    check(&ep);
}

/// Our side of it: every PONG carries the secret of the asker's load here, the one the shell's
/// FORGET proves (`forget::secret` under `forget::key` of the probe key), and each load (id)
/// has its own.
#[test]
fn our_pongs_carry_the_secret_our_forget_proves_one_per_load() {
    let (mut ep, t) = endpoint(32 * KIB, 2, false);
    let key = PROBE_KEY;
    let secret_of = |ep: &mut Endpoint, id: PeerId| {
        ep.handle_ping(t, id, 42);
        match &drain(ep)[..] {
            [Action::Link { peer, body: wire::Body::Pong { nonce: 42, forget } }] if *peer == id => *forget,
            other => panic!("expected one PONG to {id:?}, got {other:?}"),
        }
    };
    let (first, second) = (secret_of(&mut ep, PeerId(3)), secret_of(&mut ep, PeerId(4)));
    assert_ne!(first, second, "one secret per load");
    assert_eq!(first, crate::forget::secret(&crate::forget::key(&key), PeerId(3)));
    // And our HELLOs carry that load's tag: the peer tells a reload of ours from a repeat.
    assert_eq!(ep.hello_to(PeerId(3)), wire::Body::Hello { load: crate::forget::load_tag(first) });
    assert_ne!(ep.hello_to(PeerId(3)), ep.hello_to(PeerId(4)));
}

/// A FORGET can be lost (best effort, sent as the application unloads us). A peer that then
/// loads us again says HELLO with its new load's tag: it is asked about even within a second of
/// the last such ask (then when that second ends), so the new secret comes, the peer gets our
/// HELLO back (two way again), and its next FORGET is honoured, not refused as forged.
#[test]
fn a_reload_after_a_lost_forget_brings_its_new_secret_even_within_the_second() {
    let (mut ep, t, id) = with_ready_arena();
    let tagged = |k: u128| wire::encode_hello(1, crate::forget::load_tag(Token(k)));
    let pong = |nonce, k| wire::ControlFrame { session: 1, body: wire::Body::Pong { nonce, forget: Token(k) } };
    confirmed_with(&mut ep, t, id, Token(1));
    // Load 2: its FORGET of load 1 was lost; its HELLO is asked about at once.
    ep.handle_frame(t, "a", &tagged(2)).unwrap();
    let nonce = ask_nonce(&drain(&mut ep), id);
    ep.handle_frame(t, "a", &pong(nonce, 2).to_vec()).unwrap();
    // Load 3, 0.2 s later, its FORGET of load 2 lost too: within the second, so deferred.
    let soon = t + Duration::from_millis(200);
    ep.handle_frame(soon, "a", &tagged(3)).unwrap();
    assert!(drain(&mut ep).is_empty());
    assert_eq!(ep.handle_frame(soon, "a", &forget(1, Token(3))), Err(FrameRefused::ForgedForget), "not yet learnt");
    let due = ep.poll_timeout().expect("the reload is asked about later");
    assert!(due <= t + crate::hello::REASK_CONFIRMED_AFTER, "{:?}", due - t);
    ep.handle_timeout(due);
    let nonce = ask_nonce(&drain(&mut ep), id);
    ep.handle_frame(due, "a", &pong(nonce, 3).to_vec()).unwrap();
    // Load 3's FORGET now ends our route two way to it at once.
    ep.submit(due, X, TOKEN, id, plan_of(2)).unwrap();
    drain(&mut ep);
    ep.handle_frame(due, "a", &forget(1, Token(3))).unwrap();
    assert_eq!(completes(&drain(&mut ep)), vec![(X, Err(XferError::Forgotten))]);
    assert_eq!(ep.stats().peers_forgot_us, 1);
    assert!(!ep.peers().can_bounce("a") && ep.peers().is_loaded("a"));
    // The repeats of a load confirmed ask nothing at all.
    confirmed_with(&mut ep, due, id, Token(4));
    for _ in 0..10 {
        ep.handle_frame(due, "a", &tagged(4)).unwrap();
    }
    assert!(drain(&mut ep).is_empty() && ep.poll_timeout().is_none());
    check(&ep);
}
