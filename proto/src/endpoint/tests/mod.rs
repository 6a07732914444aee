//! Endpoint-level tests, plus the fixtures the sender and receiver tests share.

mod forget;
mod holds;
mod slot_queue;
mod standing;

use std::collections::BTreeMap;
use std::time::Duration;

use proptest::prelude::*;

use super::*;
use crate::plan::{self, DescPair, PlanParams};
use crate::types::{ArenaId, ChunkIdx, CopyRun, Region};
use crate::wire::{Ack, AckStatus, Credit, Data, Grant, Msg, Want};

pub(crate) const KIB: u64 = 1024;
pub(crate) const CHUNK: u64 = 4 * KIB;
pub(crate) const TIMEOUT: Duration = Duration::from_secs(1);
pub(crate) const SRC: u64 = 0x10_0000;
pub(crate) const DST: u64 = 0x20_0000;
pub(crate) const PEER: PeerId = PeerId(7);
pub(crate) const X: XferId = XferId(1);
/// The token every fixture transfer carries (the shell draws a random one per transfer).
pub(crate) const TOKEN: Token = Token(0x5eed_0f70_ce00);
/// A token nobody issued: what a forger without the secret has to guess.
pub(crate) const FORGED: Token = Token(0xbad);
/// The fixture registration covering `DST`, and its key (as its metadata carries it).
pub(crate) const REG: RegId = RegId(1);
pub(crate) const KEY: RegKey = RegKey([0x5a; 32]);

/// 1 KiB granules, 4 KiB chunks, window `w`, 1 s timeout, no liveness probe (its timers
/// would interleave with the ones these tests pin; tests/liveness.rs covers it).
pub(crate) fn config(arena: u64, w: u32, eager: bool) -> Config {
    let c = Config {
        arena_size: arena,
        arena_granularity: KIB,
        max_chunk_size: CHUNK,
        max_inflight_chunks: w,
        eager_gather: eager,
        request_timeout: TIMEOUT,
        peer_dead_after: Duration::ZERO,
        // Off here: the exchanges these tests pin have no standing flow in them
        // (`standing.rs` in the endpoint tests covers it).
        standing_bytes: 0,
        ..Config::default()
    };
    c.validate().unwrap();
    c
}

/// The secret PING nonces derive from (the shell draws one at random per engine).
pub(crate) const PROBE_KEY: [u8; 32] = [0x5b; 32];

/// An endpoint of `config(arena, w, eager)` with `[DST, DST + 64 KiB)` registered as `REG`.
pub(crate) fn endpoint(arena: u64, w: u32, eager: bool) -> (Endpoint, Instant) {
    let now = Instant::now();
    let mut ep = Endpoint::new(&config(arena, w, eager), now, PROBE_KEY).unwrap();
    ep.add_registered(REG, KEY, (DST, 64 * KIB), ArenaId(0));
    (ep, now)
}

/// `n` staged chunks of exactly 4 KiB: descriptor `i` copies `SRC + i*4K` to `DST + i*4K`.
/// Their sources are contiguous, but `direct` is cleared, as a shell does when the source
/// is not registered in one piece.
pub(crate) fn plan_of(n: u64) -> Plan {
    let mut p = direct_plan_of(n);
    for c in &mut p.chunks {
        c.direct = None;
    }
    p
}

/// [`plan_of`] with every chunk direct, as planned.
pub(crate) fn direct_plan_of(n: u64) -> Plan {
    let descs: Vec<DescPair> =
        (0..n).map(|i| DescPair { src: SRC + i * CHUNK, dst: DST + i * CHUNK, len: CHUNK }).collect();
    let mut p = plan::plan(&descs, PlanParams::new(CHUNK)).unwrap();
    assert!(p.chunks.iter().all(|c| c.direct.is_some()));
    p.dests = vec![crate::proof::Destination { reg: REG, key: KEY }];
    p
}

pub(crate) fn drain(ep: &mut Endpoint) -> Vec<Action> {
    std::iter::from_fn(|| ep.poll_action()).collect()
}

pub(crate) fn msgs(acts: &[Action]) -> Vec<(PeerId, Msg)> {
    acts.iter()
        .filter_map(|a| match a {
            Action::Send { peer, msg } => Some((*peer, msg.clone())),
            _ => None,
        })
        .collect()
}

/// `(xfer, chunk, status)` of each ACK sent.
pub(crate) fn acks(acts: &[Action]) -> Vec<(XferId, u32, AckStatus)> {
    msgs(acts)
        .into_iter()
        .filter_map(|(_, m)| match m {
            Msg::Ack(a) => Some((a.xfer, a.chunk.0, a.status)),
            _ => None,
        })
        .collect()
}

pub(crate) fn gathers(acts: &[Action]) -> Vec<(JobId, Region)> {
    acts.iter()
        .filter_map(|a| match a {
            Action::Gather { job, region, .. } => Some((*job, *region)),
            _ => None,
        })
        .collect()
}

/// `(job, source, remote, len)` of each write.
pub(crate) fn writes(acts: &[Action]) -> Vec<(JobId, WriteSource, Region, u64)> {
    acts.iter()
        .filter_map(|a| match a {
            Action::Write { job, source, remote, len, .. } => Some((*job, *source, *remote, *len)),
            _ => None,
        })
        .collect()
}

pub(crate) fn scatters(acts: &[Action]) -> Vec<(JobId, Region)> {
    acts.iter()
        .filter_map(|a| match a {
            Action::Scatter { job, region, .. } => Some((*job, *region)),
            _ => None,
        })
        .collect()
}

pub(crate) fn completes(acts: &[Action]) -> Vec<(XferId, Result<(), XferError>)> {
    acts.iter()
        .filter_map(|a| match a {
            Action::Complete { xfer, outcome } => Some((*xfer, outcome.clone())),
            _ => None,
        })
        .collect()
}

pub(crate) fn grant_msg(xfer: XferId, credits: &[(u32, Region)]) -> Msg {
    Msg::Grant(Grant {
        xfer,
        token: TOKEN,
        credits: credits.iter().map(|&(c, region)| Credit { chunk: ChunkIdx(c), region }).collect(),
    })
}

pub(crate) fn ack_msg(xfer: XferId, chunk: u32, region: Region, status: AckStatus) -> Msg {
    Msg::Ack(Ack { xfer, token: TOKEN, chunk: ChunkIdx(chunk), region, status })
}

pub(crate) fn want_msg(xfer: XferId, chunks: &[u64]) -> Msg {
    want_msg_by("", xfer, chunks)
}

/// The proof of `REG` for transfer `xfer` with `TOKEN`, as the agent `name` makes it.
pub(crate) fn proof_by(name: &str, xfer: u64) -> wire::Proof {
    crate::proof::prove_as(REG, &KEY, TOKEN, XferId(xfer), &crate::proof::Initiator::named(name))
}

/// [`want_msg`] as the agent `name` sends it (its proofs bound to that name).
pub(crate) fn want_msg_by(name: &str, xfer: XferId, chunks: &[u64]) -> Msg {
    let proofs = vec![proof_by(name, xfer.0)];
    Msg::Want(Want {
        arena: ArenaId(0),
        xfer,
        token: TOKEN,
        endpoint: Vec::new(),
        chunks: chunks.to_vec(),
        proofs,
        inline: None,
        standing: Default::default(),
    })
}

pub(crate) fn data_msg(xfer: XferId, chunk: u32, region: Region, runs: Vec<CopyRun>) -> Msg {
    Msg::Data(Data { xfer, token: TOKEN, chunk: ChunkIdx(chunk), region, runs, region_plan_runs: 0 })
}

/// A single-copy run of `len` bytes at region offset `off` to `addr`.
pub(crate) fn run(off: u64, addr: u64, len: u64) -> CopyRun {
    CopyRun { region_off: off, addr, len, count: 1, region_stride: 0, addr_stride: 0 }
}

/// A mailbox write that clears a place (a slot handed to a new transfer), not a record.
pub(crate) fn clears(a: &Action) -> bool {
    matches!(a, Action::PutRecord { bytes, .. } if bytes.iter().all(|&b| b == 0))
}

pub(crate) fn check(ep: &Endpoint) {
    ep.scheduler().check_invariants().unwrap();
}

#[test]
fn new_rejects_an_invalid_config() {
    let bad = Config { max_inflight_chunks: 0, ..Config::default() };
    assert!(matches!(Endpoint::new(&bad, Instant::now(), PROBE_KEY), Err(EndpointError::Config(_))));
}

fn frame(session: u64, msg: Msg) -> Vec<u8> {
    wire::Frame { session, msg }.to_vec()
}

/// Capabilities matching `config`'s, with instance nonce `session`.
fn caps(session: u64) -> wire::Capabilities {
    wire::Capabilities::host_arena(32 * KIB, CHUNK, session)
}

/// An endpoint that loaded agent `name`'s connection info with session 7.
fn with_loaded(name: &str) -> (Endpoint, Instant, PeerId) {
    let (mut ep, t) = endpoint(32 * KIB, 2, false);
    assert_eq!(ep.handle_conn_info(t, name, Some(caps(7)), Some(&caps(1))), Loaded::Compatible);
    let id = ep.peers_mut().id(name);
    (ep, t, id)
}

#[test]
fn frames_from_an_agent_never_loaded_are_refused_before_the_endpoint_sees_them() {
    let (mut ep, t) = endpoint(32 * KIB, 2, false);
    let r = ep.handle_frame(t, "stranger", &frame(1, want_msg_by("stranger", XferId(5), &[CHUNK])));
    assert_eq!(r, Err(FrameRefused::NotLoaded));
    assert!(drain(&mut ep).is_empty(), "no GRANT to an unknown agent");
    assert_eq!((ep.remote_flows(), ep.stats().wants, ep.stats().frames_refused), (0, 0, 1));
    assert!(matches!(ep.handle_frame(t, "stranger", b"\0BOUNCgarbage"), Err(FrameRefused::Malformed(_))));
    assert_eq!(ep.stats().frames_refused, 2);
}

#[test]
fn a_loaded_peer_is_served_through_handle_frame_and_protocol_errors_pass_through() {
    let (mut ep, t, id) = with_loaded("a");
    ep.handle_frame(t, "a", &frame(7, want_msg_by("a", XferId(5), &[CHUNK]))).unwrap();
    let sent = msgs(&drain(&mut ep));
    assert!(matches!(&sent[..], [(p, Msg::Grant(_))] if *p == id), "{sent:?}");
    let r = ep.handle_frame(t, "a", &frame(7, grant_msg(XferId(99), &[(0, Region { offset: 0, len: CHUNK })])));
    assert!(matches!(r, Err(FrameRefused::Protocol(ProtocolError::UnknownXfer { .. }))), "{r:?}");
    assert_eq!((ep.stats().protocol_errors, ep.stats().frames_refused), (1, 0));
}

#[test]
fn a_frame_of_a_stale_session_is_refused_and_changes_nothing() {
    let (mut ep, t, _) = with_loaded("a");
    ep.handle_frame(t, "a", &frame(7, want_msg_by("a", XferId(5), &[CHUNK]))).unwrap();
    let granted = msgs(&drain(&mut ep));
    let Msg::Grant(g) = &granted[0].1 else { panic!("{granted:?}") };
    let region = g.credits[0].region;
    // A DATA of an older incarnation for the region granted to the new one.
    let stale = frame(6, data_msg(XferId(5), 0, region, vec![run(0, DST, CHUNK)]));
    assert_eq!(ep.handle_frame(t, "a", &stale), Err(FrameRefused::StaleSession { got: 6, current: 7 }));
    assert!(drain(&mut ep).is_empty(), "no scatter, no ACK");
    assert_eq!(ep.remote_flows(), 1);
    assert_eq!(ep.peers().session("a"), Some(7));
    assert_eq!((ep.stats().control_forged, ep.stats().frames_refused), (1, 1));
}

/// The forgery of issue 10 item 6: a third party sends a WANT with a new session under a
/// loaded peer's name. It used to reset the peer (failing our transfer to it and
/// reclaiming its flows); now the session is the loaded capabilities' and the WANT is
/// refused, changing nothing.
#[test]
fn a_want_with_a_new_session_is_refused_without_resetting_the_peer() {
    let (mut ep, t, id) = with_loaded("a");
    ep.handle_frame(t, "a", &frame(7, want_msg_by("a", XferId(5), &[CHUNK, CHUNK]))).unwrap();
    drain(&mut ep);
    ep.submit(t, X, TOKEN, id, plan_of(1)).unwrap();
    drain(&mut ep);
    let free = ep.arena_free_bytes();
    assert_eq!((ep.remote_flows(), ep.in_flight_xfers()), (1, 1));
    for forged in [want_msg(XferId(5), &[CHUNK]), want_msg(XferId(6), &[CHUNK]), Msg::cancel(XferId(5), TOKEN, vec![])]
    {
        let r = ep.handle_frame(t, "a", &frame(8, forged));
        assert_eq!(r, Err(FrameRefused::StaleSession { got: 8, current: 7 }));
    }
    assert!(drain(&mut ep).is_empty(), "no completion, no GRANT");
    assert_eq!((ep.remote_flows(), ep.in_flight_xfers(), ep.arena_free_bytes()), (1, 1, free));
    assert_eq!(ep.scheduler().flow_held_count(crate::types::FlowKey { peer: id, xfer: XferId(5) }), 2);
    assert_eq!((ep.peers().session("a"), ep.stats().control_forged), (Some(7), 3));
    check(&ep);
}

/// A restart is learned from NIXL, not from frames: reloading the peer's metadata with a
/// new session reclaims everything of the old incarnation, and only then is the new
/// session admitted.
#[test]
fn a_reload_with_a_new_session_reclaims_the_old_incarnation() {
    let (mut ep, t, id) = with_loaded("a");
    ep.handle_frame(t, "a", &frame(7, want_msg_by("a", XferId(5), &[CHUNK, CHUNK]))).unwrap();
    drain(&mut ep);
    ep.submit(t, X, TOKEN, id, plan_of(1)).unwrap();
    drain(&mut ep);
    // Reloading the same metadata changes nothing.
    assert_eq!(ep.handle_conn_info(t, "a", Some(caps(7)), Some(&caps(1))), Loaded::Compatible);
    assert!(drain(&mut ep).is_empty());
    assert_eq!((ep.remote_flows(), ep.in_flight_xfers()), (1, 1));
    // The restarted agent's metadata: our transfer to the old incarnation fails as for a
    // lost peer and the old flow's regions come back, after a quarantine (the old process
    // may be stuck rather than gone).
    assert_eq!(ep.handle_conn_info(t, "a", Some(caps(8)), Some(&caps(1))), Loaded::Compatible);
    assert_eq!(completes(&drain(&mut ep)), vec![(X, Err(XferError::PeerLost))]);
    assert_eq!(ep.arena_quarantined_bytes(), 2 * CHUNK);
    assert_eq!((ep.remote_flows(), ep.arena_free_bytes() + 2 * CHUNK), (0, 32 * KIB));
    // The new incarnation goes by a new id (whatever still names the old one cannot touch it).
    // The old incarnation's WANT, captured and sent again under the new session, is a replay:
    // the name's replay state outlives its ids (review 60, H1). A restarted process's ids
    // start at its clock, above its old ones; the old session is refused.
    let new = ep.peers().lookup("a").unwrap();
    assert_ne!(new, id);
    let replayed = ep.handle_frame(t, "a", &frame(8, want_msg_by("a", XferId(5), &[CHUNK])));
    assert!(matches!(replayed, Err(FrameRefused::Protocol(ProtocolError::Replayed { .. }))), "{replayed:?}");
    assert!(drain(&mut ep).is_empty(), "nothing granted");
    ep.handle_frame(t, "a", &frame(8, want_msg_by("a", XferId(6), &[CHUNK]))).unwrap();
    drain(&mut ep);
    assert_eq!(ep.scheduler().flow_held_count(crate::types::FlowKey { peer: new, xfer: XferId(6) }), 1);
    // A reclaim of the old id, late (the shell queues it), takes nothing of the new one's.
    ep.handle_peer_lost(t, id);
    assert!(drain(&mut ep).is_empty());
    assert_eq!(ep.scheduler().flow_held_count(crate::types::FlowKey { peer: new, xfer: XferId(6) }), 1);
    let old = frame(7, want_msg(XferId(9), &[CHUNK]));
    assert_eq!(ep.handle_frame(t, "a", &old), Err(FrameRefused::StaleSession { got: 7, current: 8 }));
    assert_eq!(ep.peers().session("a"), Some(8));
    check(&ep);
}

/// The forgery of issue 10 item 6, second half: GRANT and ACK(Scattered) naming our
/// transfer and its chunk, from the right peer and session, but without the transfer's
/// token. The sender must never complete on them (and nothing of the transfer changes);
/// the real ones still complete it.
#[test]
fn a_forged_grant_and_ack_with_the_wrong_token_never_complete_the_sender() {
    let (mut ep, t, id) = with_loaded("a");
    ep.submit(t, X, TOKEN, id, plan_of(1)).unwrap();
    drain(&mut ep);
    let region = Region { offset: 0, len: CHUNK };
    let forge = |m: Msg| match m {
        Msg::Grant(g) => Msg::Grant(Grant { token: FORGED, ..g }),
        Msg::Ack(a) => Msg::Ack(Ack { token: FORGED, ..a }),
        m => m,
    };
    let r = ep.handle_frame(t, "a", &frame(7, forge(grant_msg(X, &[(0, region)]))));
    assert_eq!(r, Err(FrameRefused::Protocol(ProtocolError::WrongToken { peer: id, xfer: X })));
    assert!(drain(&mut ep).is_empty(), "no gather, no write for a forged credit");
    // The real GRANT: the chunk is gathered, written and its DATA (with our token) sent.
    ep.handle_frame(t, "a", &frame(7, grant_msg(X, &[(0, region)]))).unwrap();
    let acts = drain(&mut ep);
    ep.handle_gather_done(t, gathers(&acts)[0].0, true);
    let acts = drain(&mut ep);
    ep.handle_write_done(t, writes(&acts)[0].0, true);
    let sent = msgs(&drain(&mut ep));
    assert!(matches!(&sent[..], [(_, Msg::Data(d))] if d.token == TOKEN), "{sent:?}");
    // Now a forged ACK(Scattered) for exactly that chunk and region.
    let r = ep.handle_frame(t, "a", &frame(7, forge(ack_msg(X, 0, region, AckStatus::Scattered))));
    assert_eq!(r, Err(FrameRefused::Protocol(ProtocolError::WrongToken { peer: id, xfer: X })));
    assert!(drain(&mut ep).is_empty(), "no completion on a forged ACK");
    assert_eq!((ep.in_flight_xfers(), ep.sender().acked_chunks(X)), (1, Some(0)));
    assert_eq!(ep.stats().control_forged, 2);
    // The receiver's own ACK completes it.
    ep.handle_frame(t, "a", &frame(7, ack_msg(X, 0, region, AckStatus::Scattered))).unwrap();
    assert_eq!(completes(&drain(&mut ep)), vec![(X, Ok(()))]);
}

/// Receiver side: a DATA, cancel or further WANT naming a live flow but carrying another
/// token is dropped and counted; it neither scatters, nor refuses, nor reclaims the flow.
#[test]
fn data_cancel_and_want_with_the_wrong_token_leave_the_flow_alone() {
    let (mut ep, t, id) = with_loaded("a");
    ep.handle_frame(t, "a", &frame(7, want_msg_by("a", XferId(5), &[CHUNK]))).unwrap();
    let granted = msgs(&drain(&mut ep));
    let Msg::Grant(g) = &granted[0].1 else { panic!("{granted:?}") };
    assert_eq!(g.token, TOKEN, "the GRANT echoes the WANT's token");
    let region = g.credits[0].region;
    let forged = [
        Msg::Data(Data {
            xfer: XferId(5),
            token: FORGED,
            chunk: ChunkIdx(0),
            region,
            runs: vec![run(0, DST, CHUNK)],
            region_plan_runs: 0,
        }),
        Msg::cancel(XferId(5), FORGED, vec![]),
        Msg::Want(Want {
            arena: ArenaId(0),
            xfer: XferId(5),
            token: FORGED,
            endpoint: vec![],
            chunks: vec![CHUNK],
            proofs: vec![],
            inline: None,
            standing: Default::default(),
        }),
    ];
    for m in forged {
        let r = ep.handle_frame(t, "a", &frame(7, m));
        assert_eq!(r, Err(FrameRefused::Protocol(ProtocolError::WrongToken { peer: id, xfer: XferId(5) })));
    }
    assert!(drain(&mut ep).is_empty(), "no scatter, no ACK(Refused)");
    assert_eq!((ep.remote_flows(), ep.stats().control_forged, ep.stats().data_refused), (1, 3, 0));
    assert_eq!(ep.scheduler().flow_held_count(crate::types::FlowKey { peer: id, xfer: XferId(5) }), 1);
    // The real DATA scatters, and its ACK carries the flow's token.
    ep.receiver_mut().add_registered(REG, KEY, (DST, CHUNK), ArenaId(0));
    ep.handle_frame(t, "a", &frame(7, data_msg(XferId(5), 0, region, vec![run(0, DST, CHUNK)]))).unwrap();
    let acts = drain(&mut ep);
    ep.handle_scatter_done(t, scatters(&acts)[0].0, true);
    let sent = msgs(&drain(&mut ep));
    assert!(matches!(&sent[..], [(_, Msg::Ack(a))] if a.token == TOKEN && a.status == AckStatus::Scattered));
    check(&ep);
}

/// Loads agent "a" (session 1) with its arena, as NIXL and the inner engine would.
fn with_ready_arena() -> (Endpoint, Instant, PeerId) {
    let (mut ep, t) = endpoint(32 * KIB, 2, false);
    let mut caps = caps(1);
    caps.arenas.first_mut().key = vec![1];
    ep.peers_mut().load_conn_info("a", Some(caps.clone()), Some(&caps));
    ep.peers_mut().arena_loaded("a", true);
    let id = ep.peers().lookup("a").unwrap();
    (ep, t, id)
}

/// The PING nonce of an ask (our HELLO, then the PING), or a panic naming what was sent.
fn ask_nonce(acts: &[Action], to: PeerId) -> u64 {
    match acts {
        [
            Action::Link { peer: p, body: wire::Body::Hello { .. } },
            Action::Link { peer: q, body: wire::Body::Ping { nonce } },
        ] if *p == to && *q == to => *nonce,
        other => panic!("expected an ask (HELLO, PING) to {to:?}, got {other:?}"),
    }
}

/// A HELLO's session is published, so anyone holding the peer's metadata can forge one. It
/// counts only once the peer answers the ask it opens: a PING whose nonce only the peer sees.
#[test]
fn a_hello_counts_only_once_the_peer_echoes_the_nonce_of_the_ask_it_opened() {
    let (mut ep, t, id) = with_ready_arena();
    let hello = wire::encode_hello(1, crate::forget::load_tag(crate::Token(0)));
    // Invented names: refused, nothing recorded, nothing sent.
    for i in 0..4096 {
        assert_eq!(ep.handle_frame(t, &format!("invented-{i}"), &hello), Err(FrameRefused::NotLoaded));
    }
    assert!(drain(&mut ep).is_empty() && ep.peers().lookup("invented-0").is_none());
    // A HELLO under a's name and session (forged or not: it cannot tell) opens one ask.
    ep.handle_frame(t, "a", &hello).unwrap();
    let nonce = ask_nonce(&drain(&mut ep), id);
    assert!(!ep.peers().can_bounce("a"), "not before the answer");
    for _ in 0..100 {
        ep.handle_frame(t, "a", &hello).unwrap();
    }
    assert!(drain(&mut ep).is_empty(), "one ask open at a time: no frame per forged frame");
    // Answers that are not the peer's: another nonce, or the right one under another session.
    ep.handle_frame(
        t,
        "a",
        &wire::ControlFrame { session: 1, body: wire::Body::Pong { nonce: nonce ^ 1, forget: crate::Token(0) } }
            .to_vec(),
    )
    .unwrap();
    let stale = wire::ControlFrame { session: 2, body: wire::Body::Pong { nonce, forget: crate::Token(0) } }.to_vec();
    assert!(matches!(ep.handle_frame(t, "a", &stale), Err(FrameRefused::StaleSession { .. })));
    assert!(!ep.peers().can_bounce("a"));
    // Unanswered, the ask is repeated with the same nonce (a late PONG still counts).
    ep.handle_timeout(t + crate::hello::ASK_AGAIN_AFTER);
    assert_eq!(ask_nonce(&drain(&mut ep), id), nonce);
    // The peer's answer confirms it.
    ep.handle_frame(
        t,
        "a",
        &wire::ControlFrame { session: 1, body: wire::Body::Pong { nonce, forget: crate::Token(0) } }.to_vec(),
    )
    .unwrap();
    assert!(ep.peers().can_bounce("a") && ep.stats().hellos_confirmed == 1 && ep.stats().hello_asks == 2);
    assert_eq!(ep.poll_timeout(), None, "the ask is closed");
    // A HELLO for the load confirmed (its PONG's secret's tag) is a repeat: nothing is asked,
    // so two confirmed peers never trade HELLOs.
    for _ in 0..100 {
        ep.handle_frame(t, "a", &hello).unwrap();
    }
    assert!(drain(&mut ep).is_empty(), "a repeat asks nothing");
    // One for another load (the peer unloaded us and loaded us again, its FORGET lost: it
    // lacks our HELLO, and we its new secret) is asked about, at once the first time.
    let reload = |k: u128| wire::encode_hello(1, crate::forget::load_tag(crate::Token(k)));
    ep.handle_frame(t, "a", &reload(1)).unwrap();
    let again = ask_nonce(&drain(&mut ep), id);
    assert_ne!(again, nonce);
    let pong = |nonce, k| wire::ControlFrame { session: 1, body: wire::Body::Pong { nonce, forget: crate::Token(k) } };
    ep.handle_frame(t, "a", &pong(again, 1).to_vec()).unwrap();
    assert_eq!(ep.peers().hello("a", 1, crate::forget::load_tag(crate::Token(1))), Hello::Repeat, "the new load's");
    // Anyone can claim a reload: within the second after that ask, more reloads (forged, or a
    // real one just after) send nothing at once, and are asked about once when it ends.
    for k in 2..100 {
        ep.handle_frame(t + Duration::from_millis(500), "a", &reload(k)).unwrap();
    }
    assert!(drain(&mut ep).is_empty(), "at most one reload's ask a second");
    assert_eq!(ep.poll_timeout(), Some(t + crate::hello::REASK_CONFIRMED_AFTER), "deferred, not dropped");
    ep.handle_timeout(t + crate::hello::REASK_CONFIRMED_AFTER);
    let deferred = ask_nonce(&drain(&mut ep), id);
    ep.handle_frame(t + crate::hello::REASK_CONFIRMED_AFTER, "a", &pong(deferred, 99).to_vec()).unwrap();
    assert_eq!(ep.peers().hello("a", 1, crate::forget::load_tag(crate::Token(99))), Hello::Repeat, "its secret now");
    assert!(ep.peers().can_bounce("a"), "stays confirmed throughout");
    assert_eq!(ep.poll_timeout(), None, "nothing more to ask");
    // Loss forgets the peer's HELLO: after a reload it is asked about again.
    ep.handle_agent_lost(t, "a");
    assert!(!ep.peers().is_reachable("a") && !ep.peers().is_loaded("a"));
}

/// A forged HELLO for a peer that never loaded us: asked about a bounded number of times, then
/// dropped; our route to the peer never turns two way.
#[test]
fn an_unanswered_ask_is_dropped_after_its_last_repeat_and_changes_nothing() {
    let (mut ep, t, id) = with_ready_arena();
    ep.handle_frame(t, "a", &wire::encode_hello(1, 0)).unwrap();
    let nonce = ask_nonce(&drain(&mut ep), id);
    let mut asks = 1;
    while let Some(at) = ep.poll_timeout() {
        ep.handle_timeout(at);
        let acts = drain(&mut ep);
        if !acts.is_empty() {
            assert_eq!(ask_nonce(&acts, id), nonce);
            asks += 1;
        }
        assert!(at - t < Duration::from_secs(10), "the ask ends");
    }
    assert_eq!(asks, crate::hello::MAX_ASKS);
    // A PONG now confirms nothing, even one echoing the nonce.
    ep.handle_frame(
        t,
        "a",
        &wire::ControlFrame { session: 1, body: wire::Body::Pong { nonce, forget: crate::Token(0) } }.to_vec(),
    )
    .unwrap();
    assert!(!ep.peers().can_bounce("a") && ep.stats().hellos_confirmed == 0);
    // The peer's next HELLO (it loads us later) opens a new ask.
    ep.handle_frame(t, "a", &wire::encode_hello(1, 0)).unwrap();
    assert_ne!(ask_nonce(&drain(&mut ep), id), nonce, "a fresh nonce");
}

/// A closing engine's PONG carries the farewell mark: it never confirms a HELLO.
#[test]
fn an_ask_answered_by_a_closing_peer_confirms_nothing() {
    let (mut ep, t, id) = with_ready_arena();
    ep.handle_frame(t, "a", &wire::encode_hello(1, 0)).unwrap();
    let nonce = ask_nonce(&drain(&mut ep), id);
    let farewell =
        wire::ControlFrame { session: 1, body: wire::Body::Pong { nonce: nonce ^ FAREWELL, forget: crate::Token(0) } }
            .to_vec();
    ep.handle_frame(t, "a", &farewell).unwrap();
    assert!(!ep.peers().can_bounce("a"));
}

/// A GOODBYE is only asked about, one ask per peer at a time: a flood of them (anyone holding
/// the peer's metadata can send one) costs one PING per GOODBYE_ASK_GAP, always with the first
/// nonce, so the farewell PONG of a peer really closing still confirms (review 58: each
/// GOODBYE minted a new nonce, and the real farewell then matched nothing). A plain PONG (the
/// peer is not closing) leaves the ask open for a real GOODBYE later; the farewell ends it.
#[test]
fn goodbyes_are_asked_about_one_at_a_time_and_a_flood_cannot_hide_a_real_farewell() {
    let (mut ep, t, id) = with_ready_arena();
    let pings = |acts: Vec<Action>| -> Vec<u64> {
        acts.into_iter()
            .filter_map(|a| match a {
                Action::Link { peer, body: wire::Body::Ping { nonce } } if peer == id => Some(nonce),
                _ => None,
            })
            .collect()
    };
    for _ in 0..1000 {
        ep.handle_frame(t, "a", &wire::encode_goodbye(1)).unwrap();
    }
    let asked = pings(drain(&mut ep));
    assert_eq!(asked.len(), 1, "one PING for 1000 GOODBYEs within the gap");
    let later = t + GOODBYE_ASK_GAP;
    ep.handle_frame(later, "a", &wire::encode_goodbye(1)).unwrap();
    assert_eq!(pings(drain(&mut ep)), asked, "asked again after the gap, with the same nonce");
    // Not closing yet: a plain PONG ends nothing and leaves the ask open.
    assert!(matches!(ep.handle_pong(later, id, asked[0]), Pong::Other));
    assert!(matches!(ep.handle_pong(later, id, asked[0] ^ FAREWELL), Pong::Farewell), "the real farewell");
    // Confirmed: the ask is closed, and a GOODBYE after it is asked about afresh.
    assert!(!matches!(ep.handle_pong(later, id, asked[0] ^ FAREWELL), Pong::Farewell), "confirmed once");
    ep.handle_frame(later, "a", &wire::encode_goodbye(1)).unwrap();
    let fresh = pings(drain(&mut ep));
    assert!(fresh.len() == 1 && fresh != asked, "a fresh ask: {fresh:?} after {asked:?}");
}

/// `poll_timeout` is the earliest armed timer of both roles, and a `handle_timeout` before it
/// (a spurious wake-up) changes nothing.
#[test]
fn poll_timeout_is_the_minimum_and_a_spurious_timeout_does_nothing() {
    let (mut ep, t) = endpoint(32 * KIB, 2, false);
    assert_eq!(ep.poll_timeout(), None);
    ep.handle_timeout(t + TIMEOUT * 10);
    assert!(drain(&mut ep).is_empty());
    ep.submit(t, X, TOKEN, PEER, plan_of(2)).unwrap();
    let later = t + TIMEOUT / 4;
    ep.handle_msg(later, PeerId(9), want_msg(XferId(5), &[CHUNK])).unwrap();
    drain(&mut ep);
    // The sender's transfer times out at t + TIMEOUT; the receiver reclaims the silent
    // flow (it holds a granted region) half a timeout after its WANT, which is earlier.
    let flow_at = later + TIMEOUT / 2;
    assert!(flow_at < t + TIMEOUT);
    assert_eq!(ep.poll_timeout(), Some(flow_at));
    let before = (ep.stats().clone(), ep.in_flight_xfers(), ep.remote_flows(), ep.arena_free_bytes());
    ep.handle_timeout(flow_at - Duration::from_millis(1));
    assert!(drain(&mut ep).is_empty(), "a spurious timeout emits nothing");
    assert_eq!((ep.stats().clone(), ep.in_flight_xfers(), ep.remote_flows(), ep.arena_free_bytes()), before);
    assert_eq!(ep.poll_timeout(), Some(flow_at));
    ep.handle_timeout(flow_at);
    drain(&mut ep);
    assert_eq!((ep.stats().flows_timed_out, ep.remote_flows()), (1, 0));
    assert_eq!(ep.poll_timeout(), Some(t + TIMEOUT));
    ep.handle_timeout(t + TIMEOUT);
    assert_eq!(completes(&drain(&mut ep)), vec![(X, Err(XferError::Timeout))]);
    assert_eq!(ep.poll_timeout(), None);
}

/// Two endpoints with byte-level memories, driven until quiet with every job completing at
/// once: the smallest end-to-end run of the whole protocol.
struct Pair {
    eps: [Endpoint; 2],
    arenas: [Vec<u8>; 2],
    mem: [BTreeMap<u64, u8>; 2],
    done: Vec<(usize, XferId, Result<(), XferError>)>,
    now: Instant,
    /// Protocol errors from delivered frames, kept only when a test expects them (else a
    /// delivery that fails panics).
    refusals: Option<Vec<ProtocolError>>,
}

impl Pair {
    fn new(arena: u64, w: u32, eager: bool) -> Self {
        Self::of(&config(arena, w, eager), &config(arena, w, eager))
    }

    /// Two endpoints of configs `a` and `b`.
    fn of(a: &Config, b: &Config) -> Self {
        let now = Instant::now();
        let (a, b) = (Endpoint::new(a, now, PROBE_KEY).unwrap(), Endpoint::new(b, now, PROBE_KEY).unwrap());
        // One buffer for all the core's offsets: the scheduler's part, the mailbox and the
        // fetch area.
        let len = |ep: &Endpoint| vec![0; ep.one_way_layout().arena_len as usize];
        let mut p = Self {
            arenas: [len(&a), len(&b)],
            eps: [a, b],
            mem: [BTreeMap::new(), BTreeMap::new()],
            done: Vec::new(),
            now,
            refusals: None,
        };
        for ep in &mut p.eps {
            ep.add_registered(REG, KEY, (DST, 1 << 20), ArenaId(0));
        }
        p
    }

    /// Runs until no endpoint has anything to do; returns the steps taken.
    fn run(&mut self) -> usize {
        let mut steps = 0;
        loop {
            let mut idle = true;
            for me in 0..2 {
                while let Some(a) = self.eps[me].poll_action() {
                    idle = false;
                    steps += 1;
                    assert!(steps < 100_000, "no quiescence");
                    self.perform(me, a);
                    check(&self.eps[me]);
                }
            }
            // One-way transfers READ their targets' mailboxes (here: copy the bytes).
            for me in 0..2 {
                let xfers: Vec<XferId> = self.eps[me].one_way_xfers().collect();
                for xfer in xfers {
                    let Some(f) = self.eps[me].fetch(xfer) else { continue };
                    let base = self.eps[f.peer.0 as usize].one_way_layout().mailbox.offset;
                    let image: Vec<u8> = f
                        .regions
                        .iter()
                        .flat_map(|r| &self.arenas[f.peer.0 as usize][(base + r.offset) as usize..][..r.len as usize])
                        .copied()
                        .collect();
                    if self.eps[me].handle_fetched(self.now, xfer, &image) > 0 {
                        idle = false;
                    }
                }
            }
            if idle {
                return steps;
            }
        }
    }

    /// As [`run`](Self::run), but the actions `hold` picks (by endpoint and action) are kept
    /// back, as if still running, and returned.
    fn run_holding(&mut self, mut hold: impl FnMut(usize, &Action) -> bool) -> Vec<Action> {
        let mut held = Vec::new();
        loop {
            let mut idle = true;
            for me in 0..2 {
                while let Some(a) = self.eps[me].poll_action() {
                    idle = false;
                    if hold(me, &a) {
                        held.push(a);
                    } else {
                        self.perform(me, a);
                    }
                }
            }
            if idle {
                return held;
            }
        }
    }

    fn perform(&mut self, me: usize, a: Action) {
        let peer = 1 - me;
        let now = self.now;
        match a {
            Action::Send { peer: p, msg } => {
                assert_eq!(p.0 as usize, peer);
                match (self.eps[peer].handle_msg(now, PeerId(me as u64), msg), &mut self.refusals) {
                    (Err(e), Some(kept)) => kept.push(e),
                    (r, _) => r.unwrap(),
                }
            }
            Action::Gather { job, region, runs, .. } => {
                for r in runs.runs() {
                    for (off, addr, len) in r.copies() {
                        for k in 0..len {
                            let byte = self.mem[me].get(&(addr + k)).copied().unwrap_or(0);
                            self.arenas[me][(region.offset + off + k) as usize] = byte;
                        }
                    }
                }
                self.eps[me].handle_gather_done(now, job, true);
            }
            Action::Write { job, source, remote, len, .. } => {
                let src: Vec<u8> = match source {
                    WriteSource::Arena(local) => self.arenas[me][local.offset as usize..][..len as usize].to_vec(),
                    WriteSource::User { addr } => {
                        (addr..addr + len).map(|a| self.mem[me].get(&a).copied().unwrap_or(0)).collect()
                    }
                };
                self.arenas[peer][remote.offset as usize..][..len as usize].copy_from_slice(&src);
                self.eps[me].handle_write_done(now, job, true);
            }
            Action::Scatter { job, region, runs, .. } => {
                for r in runs.runs() {
                    for (off, addr, len) in r.copies() {
                        for k in 0..len {
                            let byte = self.arenas[me][(region.offset + off + k) as usize];
                            self.mem[me].insert(addr + k, byte);
                        }
                    }
                }
                self.eps[me].handle_scatter_done(now, job, true);
            }
            Action::Link { peer: p, body } => {
                assert_eq!(p.0 as usize, peer);
                match body {
                    wire::Body::Ping { nonce } => self.eps[peer].handle_ping(now, PeerId(me as u64), nonce),
                    wire::Body::Pong { nonce, .. } => {
                        if self.eps[peer].handle_pong(now, PeerId(me as u64), nonce) == Pong::Farewell {
                            self.eps[peer].handle_goodbye(now, PeerId(me as u64));
                        }
                    }
                    other => panic!("unexpected link frame {other:?}"),
                }
            }
            Action::PutRecord { offset, bytes } => {
                self.arenas[me][offset as usize..][..bytes.len()].copy_from_slice(&bytes);
            }
            Action::Read { job, remote, local, len, .. } => {
                let src = self.arenas[peer][remote.offset as usize..][..len as usize].to_vec();
                self.arenas[me][local.offset as usize..][..len as usize].copy_from_slice(&src);
                self.eps[me].handle_read_done(now, job, true);
            }
            Action::Complete { xfer, outcome } => self.done.push((me, xfer, outcome)),
        }
    }
}

impl Pair {
    /// Performs every action until quiet, but fetches no one-way transfer's answers: they
    /// lie unread in the target's mailbox (the transfer has no fetch slice).
    fn run_unfetched(&mut self) {
        while let Some((me, a)) = (0..2).find_map(|me| self.eps[me].poll_action().map(|a| (me, a))) {
            self.perform(me, a);
        }
    }

    /// One fetch of `me`'s one-way transfer `xfer`, as [`run`](Self::run) makes them.
    fn fetch_once(&mut self, me: usize, xfer: XferId) {
        let f = self.eps[me].fetch(xfer).expect("reading it");
        let base = self.eps[f.peer.0 as usize].one_way_layout().mailbox.offset;
        let arena = &self.arenas[f.peer.0 as usize];
        let image: Vec<u8> =
            f.regions.iter().flat_map(|r| &arena[(base + r.offset) as usize..][..r.len as usize]).copied().collect();
        self.eps[me].handle_fetched(self.now, xfer, &image);
    }
}

/// Review 60 (mailbox, H1): a one-way credit's age was counted from when its record was read,
/// so a GRANT that lay unread in the target's mailbox (the transfer had no fetch slice) passed
/// for a fresh one and was written (or read) after the target could have reclaimed its region
/// and granted it to another flow. Now it counts from the last look that did not find it
/// (here: the WANT or PULL going out): such a credit is never used, and the transfer fails.
/// Nor is a GRANT read together with the FAIL that ended its flow (here the target shut down
/// after granting two chunks: the first fetch, which locates the slot, reads only the first
/// GRANT; the next brings the second and the FAIL).
#[test]
fn a_grant_that_lay_unread_past_a_quarter_of_its_lease_is_never_used() {
    let cases = [
        (false, TIMEOUT / 4, false),
        (true, TIMEOUT / 4, false),
        (false, TIMEOUT / 2 + TIMEOUT / 8, false),
        (false, Duration::ZERO, true),
        (true, Duration::ZERO, true),
    ];
    for (read, late, shut) in cases {
        let chunks = if shut { 2 } else { 1 };
        let mut p = Pair::new(16 * KIB, 2, false);
        p.eps[1].keep_mailbox(true);
        let m = p.eps[1].one_way_layout().mailbox;
        let layout = crate::mailbox::MailboxLayout { slots: m.slots, ring: m.ring };
        let now = p.now;
        if read {
            let descs: Vec<DescPair> =
                (0..chunks).map(|i| DescPair { src: DST + i * CHUNK, dst: SRC + i * CHUNK, len: CHUNK }).collect();
            let mut plan = plan::plan(&descs, PlanParams::new(CHUNK)).unwrap();
            plan.dests = vec![crate::proof::Destination { reg: REG, key: KEY }];
            p.eps[0].submit_read(now, X, TOKEN, PeerId(1), plan, Some(layout)).unwrap();
        } else {
            p.eps[0].submit_one_way(now, X, TOKEN, PeerId(1), plan_of(chunks), layout).unwrap();
        }
        p.run_unfetched();
        assert_eq!(p.eps[1].stats().records_written, chunks, "read={read}: the GRANTs (READYs) lie unread");
        p.now += late;
        // Past the target's lease its flow is reclaimed and a FAIL follows the GRANT; so it is
        // when the target shuts down.
        let now = p.now;
        p.eps[1].handle_timeout(now);
        if shut {
            p.eps[1].shutdown(now);
        }
        p.run_unfetched();
        let (mut used, mut failed) = (0, false);
        for _ in 0..chunks {
            p.fetch_once(0, X);
            while let Some(a) = p.eps[0].poll_action() {
                used += u64::from(matches!(a, Action::Write { .. } | Action::Read { .. }));
                failed |= matches!(a, Action::Complete { xfer, outcome: Err(_) } if xfer == X);
                p.perform(0, a);
            }
        }
        // Shut: the first GRANT was read alone and fresh, before anything ended its flow.
        let fresh = u64::from(shut);
        assert_eq!(used, fresh, "read={read} late={late:?} shut={shut}: a dead credit was used");
        assert!(failed, "read={read} late={late:?} shut={shut}: the transfer fails");
        assert!(!p.mem[1].contains_key(&(DST + CHUNK)) && !p.mem[0].contains_key(&(SRC + CHUNK)));
    }
}

/// `plan_of(n)` with chunks `i` where `direct(i)` holds left direct.
fn plan_with_direct(n: u64, direct: impl Fn(usize) -> bool) -> Plan {
    let mut p = direct_plan_of(n);
    for (i, c) in p.chunks.iter_mut().enumerate() {
        if !direct(i) {
            c.direct = None;
        }
    }
    p
}

#[test]
fn peers_of_different_max_chunks_move_chunks_of_the_smaller_and_refuse_larger_ones_at_once() {
    // Endpoint 0 chunks up to 8 KiB in a 32 KiB arena; endpoint 1's arena is one 4 KiB
    // block. Capabilities no longer need equal max chunks: planned with the smaller (the
    // shell's `Capabilities::chunk_with`) every byte lands. A chunk larger than the target's
    // largest block (a peer that planned with its own max) is refused with its WANT: the
    // transfer fails at once, with no time passing, instead of waiting for a timeout.
    let big = Config { max_chunk_size: 2 * CHUNK, ..config(32 * KIB, 2, false) };
    let small = config(CHUNK, 2, false);
    let mut p = Pair::of(&big, &small);
    let theirs = wire::Capabilities::host_arena(CHUNK, small.max_chunk_size, 1);
    let chunk = wire::Capabilities::host_arena(32 * KIB, big.max_chunk_size, 2).chunk_with(&theirs);
    assert_eq!(chunk, CHUNK);
    for i in 0..(10 * CHUNK) {
        p.mem[0].insert(SRC + i, (i as u8).wrapping_mul(5).wrapping_add(3));
    }
    let descs: Vec<DescPair> =
        (0..10).map(|i| DescPair { src: SRC + i * CHUNK, dst: DST + i * CHUNK, len: CHUNK }).collect();
    let planned = |max| {
        let mut plan = plan::plan(&descs, PlanParams::new(max)).unwrap();
        plan.dests = vec![crate::proof::Destination { reg: REG, key: KEY }];
        plan
    };
    let now = p.now;
    p.eps[0].submit(now, XferId(1), TOKEN, PeerId(1), planned(chunk)).unwrap();
    p.run();
    assert_eq!(p.done, vec![(0, XferId(1), Ok(()))]);
    for i in 0..(10 * CHUNK) {
        assert_eq!(p.mem[1].get(&(DST + i)), Some(&(i as u8).wrapping_mul(5).wrapping_add(3)), "byte {i}");
    }
    assert_eq!(p.eps[1].stats().chunks_scattered, 10);

    let too_large = planned(2 * CHUNK);
    assert_eq!(too_large.chunks[0].bytes, 2 * CHUNK);
    p.refusals = Some(Vec::new());
    p.eps[0].submit(now, XferId(2), Token(TOKEN.0 + 1), PeerId(1), too_large).unwrap();
    p.run();
    assert_eq!(p.now, now, "no time passed");
    assert!(matches!(p.done[1], (0, XferId(2), Err(_))), "{:?}", p.done);
    let refusals = p.refusals.take().unwrap();
    assert!(matches!(refusals[..], [ProtocolError::BadWant { .. }]), "{refusals:?}");
    assert!(p.eps[0].is_idle() && p.eps[1].is_idle());
    assert_eq!((p.eps[0].arena_free_bytes(), p.eps[1].arena_free_bytes()), (32 * KIB, CHUNK));
}

#[test]
fn two_endpoints_move_every_byte_both_ways_through_small_arenas() {
    // Staged, mixed and fully direct plans.
    let modes: [fn(usize) -> bool; 3] = [|_| false, |i| i % 3 == 1, |_| true];
    for (eager, mode) in [false, true].into_iter().flat_map(|e| modes.map(|m| (e, m))) {
        let mut p = Pair::new(16 * KIB, 2, eager);
        // 40 KiB each way through 16 KiB arenas that also serve the other direction.
        for me in 0..2 {
            for i in 0..(10 * CHUNK) {
                p.mem[me].insert(SRC + i, (i as u8).wrapping_mul(3).wrapping_add(me as u8));
            }
            let now = p.now;
            p.eps[me].submit(now, X, TOKEN, PeerId(1 - me as u64), plan_with_direct(10, mode)).unwrap();
        }
        p.run();
        let mut done = p.done.clone();
        done.sort_by_key(|d| d.0);
        assert_eq!(done, vec![(0, X, Ok(())), (1, X, Ok(()))]);
        for me in 0..2 {
            for i in 0..(10 * CHUNK) {
                let want = (i as u8).wrapping_mul(3).wrapping_add(1 - me as u8);
                assert_eq!(p.mem[me].get(&(DST + i)), Some(&want), "eager={eager} side {me} byte {i}");
            }
            let ep = &p.eps[me];
            assert!(ep.is_idle());
            assert_eq!(ep.arena_free_bytes(), 16 * KIB);
            assert_eq!(ep.poll_timeout(), None);
            assert_eq!(ep.stats().completed, 1);
            assert_eq!(ep.stats().chunks_scattered, 10);
            assert_eq!(ep.stats().chunks_direct, (0..10).filter(|&i| mode(i)).count() as u64);
        }
    }
}

#[test]
fn a_one_way_write_moves_every_byte_through_the_targets_mailbox() {
    // Endpoint 1 keeps a mailbox; endpoint 0 sends one way, so every GRANT and ACK of its
    // transfers travels as a record it READs. Twenty chunks through a window of 2: 40
    // records through rings of 8, so the ring fills and the CURSORs must make room.
    for eager in [false, true] {
        let mut p = Pair::new(16 * KIB, 2, eager);
        p.eps[1].keep_mailbox(true);
        let m = p.eps[1].one_way_layout().mailbox;
        let layout = crate::mailbox::MailboxLayout { slots: m.slots, ring: m.ring };
        assert_eq!(layout.ring, 8);
        for i in 0..(20 * CHUNK) {
            p.mem[0].insert(SRC + i, (i as u8).wrapping_mul(7).wrapping_add(1));
        }
        for (n, xfer) in [XferId(1), XferId(2)].into_iter().enumerate() {
            let now = p.now;
            let token = Token(TOKEN.0 + n as u128);
            p.eps[0].submit_one_way(now, xfer, token, PeerId(1), plan_of(10), layout).unwrap();
        }
        p.run();
        let mut done = p.done.clone();
        done.sort_by_key(|d| d.1);
        assert_eq!(done, vec![(0, XferId(1), Ok(())), (0, XferId(2), Ok(()))], "eager={eager}");
        for i in 0..(10 * CHUNK) {
            let want = (i as u8).wrapping_mul(7).wrapping_add(1);
            assert_eq!(p.mem[1].get(&(DST + i)), Some(&want), "eager={eager} byte {i}");
        }
        let (tx, rx) = (p.eps[0].stats(), p.eps[1].stats());
        assert_eq!((tx.one_way_sent, rx.one_way_answered), (2, 2));
        // Per transfer 10 GRANTs and 10 ACKs: every record written was read.
        assert_eq!((rx.records_written, tx.records_read), (40, 40));
        assert_eq!(rx.chunks_scattered, 20);
        // Nothing stays behind: the last CURSORs freed both slots.
        assert!(p.eps[0].is_idle() && p.eps[1].is_idle());
        assert_eq!(p.eps[1].answering.flows(), 0);
        assert_eq!(p.eps[1].answering_slots_held(), 0);
        assert_eq!(p.eps[0].one_way_xfers().count(), 0);
    }
}

/// A one-way WANT frame (answers asked in our mailbox) of one chunk for transfer `xfer`, from an
/// agent never loaded here (its session is nobody's), carrying `proofs`.
fn one_way_want(xfer: u64, proofs: Vec<wire::Proof>) -> Vec<u8> {
    one_way_want_in(99, xfer, proofs)
}

/// [`one_way_want`] under `session`.
fn one_way_want_in(session: u64, xfer: u64, proofs: Vec<wire::Proof>) -> Vec<u8> {
    let w = Want {
        arena: ArenaId(0),
        xfer: XferId(xfer),
        token: TOKEN,
        endpoint: wire::REPLY_MAILBOX.to_vec(),
        chunks: vec![CHUNK],
        proofs,
        inline: None,
        standing: Default::default(),
    };
    wire::Frame { session, msg: Msg::Want(w) }.to_vec()
}

/// Review 60 (scatter, H1): replay state was kept per peer id, and a one-way frame under a
/// loaded name with any other session gets an id of its own (a new incarnation): a WANT of the
/// loaded peer, captured and sent again one way under an invented session, found an empty
/// window and opened its ended transfer again (an inline one wrote its old bytes over newer
/// ones, between two processes). The state is the name's now, whichever id the frame gets.
/// Review 61 (READ, M1): the same while the captured WANT's flow is still open. The proof is
/// good for its transfer id, and a fresh id under an invented session found no ended
/// transfer: a second flow of the transfer opened. Now a transfer open under another id of the
/// same name is a replay too; the flow itself goes on.
#[test]
fn a_captured_want_replayed_under_an_invented_session_while_its_flow_is_open_opens_nothing() {
    let (mut ep, t, id) = with_loaded("a");
    ep.keep_mailbox(true);
    ep.handle_frame(t, "a", &frame(7, want_msg_by("a", XferId(5), &[CHUNK, CHUNK]))).unwrap();
    drain(&mut ep);
    assert_eq!(ep.remote_flows(), 1);
    let replayed = ep.stats().control_replayed;
    for session in [9, 10] {
        let r = ep.handle_frame(t, "a", &one_way_want_in(session, 5, vec![proof_by("a", 5)]));
        assert!(matches!(r, Err(FrameRefused::Protocol(ProtocolError::Replayed { .. }))), "{r:?}");
    }
    assert!(drain(&mut ep).is_empty(), "nothing granted, nothing answered");
    assert_eq!((ep.remote_flows(), ep.stats().control_replayed), (1, replayed + 2));
    assert!(ep.schedulers().flow_held_count(FlowKey { peer: id, xfer: XferId(5) }) > 0, "the genuine flow goes on");
    // Another transfer of the name under a new session (the agent restarted) opens.
    ep.handle_frame(t, "a", &one_way_want_in(12, 6, vec![proof_by("a", 6)])).unwrap();
    assert_eq!(ep.remote_flows(), 2);
    check(&ep);
}

#[test]
fn a_captured_want_replayed_under_an_invented_session_is_a_replay() {
    let (mut ep, t, id) = with_loaded("a");
    ep.keep_mailbox(true);
    ep.handle_frame(t, "a", &frame(7, want_msg_by("a", XferId(5), &[CHUNK]))).unwrap();
    drain(&mut ep);
    ep.handle_frame(t, "a", &frame(7, want_msg_by("a", XferId(5), &[]))).unwrap();
    drain(&mut ep);
    assert_eq!(ep.remote_flows(), 0, "ended: canceled by its sender");
    let replayed = ep.stats().control_replayed;
    for session in [9, 10, 11] {
        let r = ep.handle_frame(t, "a", &one_way_want_in(session, 5, vec![proof_by("a", 5)]));
        assert!(matches!(r, Err(FrameRefused::Protocol(ProtocolError::Replayed { .. }))), "{r:?}");
    }
    assert!(drain(&mut ep).is_empty(), "nothing granted, nothing answered");
    assert_eq!((ep.remote_flows(), ep.stats().control_replayed), (0, replayed + 3));
    // A later transfer of the name, one way under a new session (the agent restarted), opens.
    ep.handle_frame(t, "a", &one_way_want_in(12, 6, vec![proof_by("a", 6)])).unwrap();
    assert_eq!(ep.remote_flows(), 1);
    assert_eq!(ep.peers().lookup("a"), Some(id), "the loaded id is untouched");
    check(&ep);
}

/// Review 59 (wire, M1): a loaded name is published, and a one-way WANT under it with an
/// invented session made a new incarnation, with an id of its own, before its proofs were
/// checked: junk under one loaded name could spend the ids that one-way admission lives on.
/// Such a WANT's proofs are checked first now, as a never-loaded name's are.
#[test]
fn invented_sessions_under_a_loaded_name_spend_no_id_without_a_proof() {
    let (mut ep, t, _old) = with_loaded("a");
    ep.keep_mailbox(true);
    for session in 100..300u64 {
        let r = ep.handle_frame(t, "a", &one_way_want_in(session, 1, Vec::new()));
        assert!(matches!(r, Err(FrameRefused::Protocol(ProtocolError::BadProof { .. }))), "{r:?}");
        assert_eq!(ep.peers().incarnation("a", session), None, "session {session} got an id");
    }
    assert_eq!(ep.stats().control_forged, 200);
    assert!(drain(&mut ep).is_empty());
    // A real new incarnation, proving its destination, is served.
    ep.handle_frame(t, "a", &one_way_want_in(8, 1, vec![proof_by("a", 1)])).unwrap();
    assert!(ep.peers().incarnation("a", 8).is_some());
    check(&ep);
}

/// A loaded agent restarts under the same name and transfers to us one way before NIXL here
/// reloads its metadata (plain UCX's one-sided writes would serve it; its frames used to be
/// dropped as stale, failing the transfer by timeout). Its WANT is admitted under an id of its
/// own, with the loaded incarnation's session rule untouched; the reload adopts that id, so its
/// flow goes on, and reclaims only the old incarnation's flow. Both ways NIXL reloads: a
/// disconnect then a load, and a load over the old one.
#[test]
fn a_restarted_peers_one_way_flow_is_served_before_its_reload_and_survives_it() {
    for disconnect_first in [true, false] {
        let (mut ep, t, old) = with_loaded("a");
        ep.keep_mailbox(true);
        ep.handle_frame(t, "a", &frame(7, want_msg_by("a", XferId(5), &[CHUNK]))).unwrap();
        drain(&mut ep);
        // The new incarnation (session 8): a one-way WANT proving its destination.
        let proof = || vec![proof_by("a", 1)];
        ep.handle_frame(t, "a", &one_way_want_in(8, 1, proof())).unwrap();
        let acts: Vec<Action> = drain(&mut ep).into_iter().filter(|a| !clears(a)).collect();
        assert!(acts.len() == 1 && matches!(acts[0], Action::PutRecord { .. }), "one GRANT record: {acts:?}");
        let inc = ep.peers().incarnation("a", 8).expect("an id of its own");
        assert_ne!(inc, old);
        assert_eq!((ep.remote_flows(), ep.stats().one_way_answered), (2, 1));
        // Only one-way traffic passes so: a two-way WANT under the new session is still stale,
        // and a proofless one-way WANT opens nothing.
        let two_way = ep.handle_frame(t, "a", &frame(8, want_msg_by("a", XferId(6), &[CHUNK])));
        assert_eq!(two_way, Err(FrameRefused::StaleSession { got: 8, current: 7 }));
        let proofless = ep.handle_frame(t, "a", &one_way_want_in(8, 2, Vec::new()));
        assert!(matches!(proofless, Err(FrameRefused::Protocol(ProtocolError::BadProof { .. }))), "{proofless:?}");
        assert_eq!(ep.remote_flows(), 2);
        // NIXL reloads the agent: the old incarnation's flow is reclaimed, the new one's kept,
        // and the new incarnation goes by the id its flow has.
        if disconnect_first {
            ep.handle_agent_lost(t, "a");
        }
        assert_eq!(ep.handle_conn_info(t, "a", Some(caps(8)), Some(&caps(1))), Loaded::Compatible);
        drain(&mut ep);
        assert_eq!(ep.peers().lookup("a"), Some(inc), "disconnect_first={disconnect_first}");
        assert_eq!(ep.peers().incarnation("a", 8), None, "adopted");
        assert_eq!(ep.remote_flows(), 1, "disconnect_first={disconnect_first}");
        assert!(!ep.holds_nothing_for(inc));
        // Its flow's frames pass under the now loaded session, to the same flow.
        let keep = Msg::Keep(wire::Keep { xfer: XferId(1), token: TOKEN });
        ep.handle_frame(t, "a", &frame(8, keep)).unwrap();
        assert_eq!(ep.remote_flows(), 1);
        // A late reclaim of the old id (the shell queues it) takes nothing of the new one's.
        ep.handle_peer_lost(t, old);
        assert_eq!(ep.remote_flows(), 1);
        check(&ep);
    }
}

#[test]
fn a_one_way_want_from_a_name_never_loaded_takes_a_slot_only_when_it_proves_its_destination() {
    let (mut ep, t) = endpoint(16 * KIB, 2, false);
    ep.keep_mailbox(true);
    let want = one_way_want;
    // Forged proofs, or none at all, under invented names: refused, no slot, no answer, no
    // flow (else keyless names could pin every mailbox slot and the arena, kept by KEEPs).
    for i in 0..20u64 {
        let mut p = crate::proof::prove(REG, &KEY, TOKEN, XferId(i));
        p.tag[0] ^= 1;
        let proofs = if i % 2 == 0 { vec![p] } else { Vec::new() };
        let r = ep.handle_frame(t, &format!("stranger-{i}"), &want(i, proofs));
        assert!(matches!(r, Err(FrameRefused::Protocol(ProtocolError::BadProof { .. }))), "{r:?}");
    }
    assert!(drain(&mut ep).is_empty(), "a forgery got an answer");
    assert_eq!((ep.answering_slots_held(), ep.remote_flows()), (0, 0));
    assert_eq!(ep.stats().control_forged, 20);
    // A valid proof: admitted without loaded metadata or session, answered in the mailbox.
    ep.handle_frame(t, "initiator", &want(1, vec![proof_by("initiator", 1)])).unwrap();
    let acts = drain(&mut ep);
    assert!(acts.iter().all(|a| matches!(a, Action::PutRecord { .. })), "{acts:?}");
    assert_eq!(acts.iter().filter(|a| !clears(a)).count(), 1, "one GRANT record (its slot's places cleared first)");
    assert_eq!((ep.answering_slots_held(), ep.remote_flows(), ep.stats().one_way_answered), (1, 1, 1));
    // Its other frames pass only for its flow: a DATA of a flow it never opened does not.
    let stray = Msg::Keep(wire::Keep { xfer: XferId(7), token: TOKEN });
    let r = ep.handle_frame(t, "initiator", &wire::Frame { session: 99, msg: stray }.to_vec());
    assert_eq!(r, Err(FrameRefused::NotLoaded));
}

/// A DATA whose region's end overflows (offset u64::MAX, or two halves of 2^64) for an open
/// one-way flow: the wire refuses the frame, and the core, handed one anyway, refuses it with
/// a record the initiator can read. Review 58: the refusal carried the peer's region into the
/// record writer, whose `assert!` panicked, and the shell then closed the bounce path for
/// every peer.
#[test]
fn a_one_way_data_with_an_overflowing_region_is_refused_without_a_panic() {
    for region in [Region { offset: u64::MAX, len: 1 }, Region { offset: 1 << 63, len: 1 << 63 }] {
        let (mut ep, t) = endpoint(16 * KIB, 2, false);
        ep.keep_mailbox(true);
        ep.handle_frame(t, "initiator", &one_way_want(1, vec![proof_by("initiator", 1)])).unwrap();
        drain(&mut ep);
        let run = CopyRun { region_off: 0, addr: DST, len: 1, count: 1, region_stride: 0, addr_stride: 0 };
        let data =
            Data { xfer: XferId(1), token: TOKEN, chunk: ChunkIdx(0), region, runs: vec![run], region_plan_runs: 0 };
        let bytes = wire::Frame { session: 99, msg: Msg::Data(data.clone()) }.to_vec();
        let r = ep.handle_frame(t, "initiator", &bytes);
        assert!(matches!(r, Err(FrameRefused::Malformed(_))), "{region:?}: {r:?}");
        assert!(drain(&mut ep).is_empty() && ep.remote_flows() == 1, "the flow is untouched");
        let id = ep.peers().lookup("initiator").expect("the one-way name's id");
        assert!(ep.handle_msg(t, id, Msg::Data(data)).is_err());
        let records = drain(&mut ep);
        assert!(
            !records.is_empty() && records.iter().all(|a| matches!(a, Action::PutRecord { .. })),
            "{region:?}: {records:?}"
        );
        assert_eq!((ep.remote_flows(), ep.stats().data_refused), (0, 1), "{region:?}: refused, reclaimed");
        check(&ep);
    }
}

/// Junk one-way frames under thousands of invented names (each name is admitted before its
/// frame is judged) fill the one-way names; a real initiator's WANT is still admitted and
/// answered: a name that holds nothing here is forgotten to make room.
#[test]
fn invented_one_way_names_cannot_lock_a_real_initiator_out() {
    use crate::peers::MAX_ONE_WAY_NAMES;
    let (mut ep, t) = endpoint(16 * KIB, 2, false);
    ep.keep_mailbox(true);
    let want = |proofs| one_way_want(1, proofs);
    let mut forged = crate::proof::prove(REG, &KEY, TOKEN, XferId(1));
    forged.tag[0] ^= 1;
    for i in 0..MAX_ONE_WAY_NAMES + 10 {
        let r = ep.handle_frame(t, &format!("junk-{i}"), &want(vec![forged]));
        assert!(matches!(r, Err(FrameRefused::Protocol(ProtocolError::BadProof { .. }))), "{i}: {r:?}");
    }
    ep.handle_frame(t, "initiator", &want(vec![proof_by("initiator", 1)])).unwrap();
    assert_eq!((ep.answering_slots_held(), ep.remote_flows(), ep.stats().one_way_answered), (1, 1, 1));
    // The real initiator, holding a flow now, is never the name forgotten.
    for i in 0..100 {
        let _ = ep.handle_frame(t, &format!("more-junk-{i}"), &want(vec![forged]));
    }
    assert!(ep.peers().lookup("initiator").is_some_and(|id| !ep.holds_nothing_for(id)));
}

/// A READ: endpoint 0 pulls 10 chunks of endpoint 1's registered memory into its own, two
/// way (answers as frames) and one way (answers READ from endpoint 1's mailbox): endpoint 1
/// gathers each chunk into its arena, announces it ready, endpoint 0 READs it, releases it
/// and scatters it locally. Through arenas smaller than the transfer.
#[test]
fn a_read_pulls_every_byte_through_the_targets_arena_two_way_and_one_way() {
    for one_way in [false, true] {
        let mut p = Pair::new(16 * KIB, 2, false);
        p.eps[1].keep_mailbox(true);
        let m = p.eps[1].one_way_layout().mailbox;
        let layout = crate::mailbox::MailboxLayout { slots: m.slots, ring: m.ring };
        // The target's source: its registered range at DST; our destinations at SRC.
        for i in 0..(10 * CHUNK) {
            p.mem[1].insert(DST + i, (i as u8).wrapping_mul(5).wrapping_add(3));
        }
        let descs: Vec<DescPair> =
            (0..10).map(|i| DescPair { src: DST + i * CHUNK, dst: SRC + i * CHUNK, len: CHUNK }).collect();
        let mut plan = plan::plan(&descs, PlanParams::new(CHUNK)).unwrap();
        plan.dests = vec![crate::proof::Destination { reg: REG, key: KEY }];
        let now = p.now;
        p.eps[0].submit_read(now, X, TOKEN, PeerId(1), plan, one_way.then_some(layout)).unwrap();
        p.run();
        assert_eq!(p.done, vec![(0, X, Ok(()))], "one_way={one_way}");
        for i in 0..(10 * CHUNK) {
            let want = (i as u8).wrapping_mul(5).wrapping_add(3);
            assert_eq!(p.mem[0].get(&(SRC + i)), Some(&want), "one_way={one_way} byte {i}");
        }
        let (ini, tgt) = (p.eps[0].stats(), p.eps[1].stats());
        assert_eq!((ini.chunks_pulled, tgt.chunks_served), (10, 10));
        // PULLs, RELEASEs (and one way, CURSORs) are the peer's; its answers, READ from the
        // mailbox one way, are ours (`peer_msgs`).
        assert_eq!(ini.peer_msgs, 0, "one_way={one_way}: the initiator served nobody");
        assert!(tgt.peer_msgs >= 10, "one_way={one_way}: {tgt:?}");
        assert_eq!(tgt.chunks_scattered, 0, "nothing was written into the target");
        if one_way {
            // Ten READY records (GRANTs), and no FAIL: the RELEASEs ended the flow.
            assert_eq!((tgt.records_written, ini.records_read), (10, 10));
            assert_eq!(p.eps[1].answering_slots_held(), 0);
        }
        for ep in &p.eps {
            assert!(ep.is_idle());
            assert_eq!(ep.arena_free_bytes(), 16 * KIB);
        }
    }
}

/// `peer_msgs` counts what peers send on their own initiative (HELLOs, PINGs, their transfers'
/// messages to our target role), never the GRANTs, ACKs and PONGs that answer ours: the shell
/// tells from it an engine that peers address (and that must look often for their unannounced
/// frames) from one that only initiates.
#[test]
fn only_the_target_of_a_transfer_counts_peer_messages() {
    let (mut ep, now, peer) = with_loaded("b");
    ep.handle_hello(now, peer, Hello::Ask);
    ep.handle_ping(now, peer, 7);
    assert_eq!(ep.stats().peer_msgs, 2, "a HELLO and a PING");
    let _ = ep.handle_pong(now, peer, 7);
    assert_eq!(ep.stats().peer_msgs, 2, "a PONG answers us");

    // A WRITE, two way: WANTs and DATAs at the target, GRANTs and ACKs at the initiator.
    let mut p = Pair::new(16 * KIB, 2, false);
    for i in 0..(10 * CHUNK) {
        p.mem[0].insert(SRC + i, i as u8);
    }
    let now = p.now;
    p.eps[0].submit(now, X, TOKEN, PeerId(1), plan_with_direct(10, |_| false)).unwrap();
    p.run();
    assert_eq!(p.done, vec![(0, X, Ok(()))]);
    assert_eq!(p.eps[0].stats().peer_msgs, 0, "the initiator served nobody");
    assert!(p.eps[1].stats().peer_msgs >= 10, "a DATA per chunk at least: {:?}", p.eps[1].stats());
    // READs: see a_read_pulls_every_byte_through_the_targets_arena_two_way_and_one_way.
}

/// Review 58: a WRITE held behind our cancel started under the id it got at submit. READs were
/// not held, so they started beside it; once 256 of them had ended at the target, the held
/// WRITE's WANT fell below the target's replay window, was dropped unanswered, and the WRITE
/// failed by its timeout. Now the READs wait with it, in submission order, and all succeed.
#[test]
fn reads_beside_a_held_write_wait_with_it_and_cannot_push_it_below_the_targets_replay_window() {
    let mut p = Pair::new(64 * KIB, 2, false);
    let (old, new) = (|i: u64| (i as u8).wrapping_mul(3), |i: u64| (i as u8).wrapping_mul(7).wrapping_add(1));
    for i in 0..CHUNK {
        p.mem[1].insert(DST + i, old(i));
        p.mem[0].insert(SRC + i, new(i));
    }
    let now = p.now;
    p.eps[0].submit(now, X, TOKEN, PeerId(1), direct_plan_of(1)).unwrap();
    // Everything runs but X's direct write, held as if still in flight.
    let mut held = p.run_holding(|me, a| me == 0 && matches!(a, Action::Write { .. }));
    assert_eq!(held.len(), 1, "X's write posted");
    let write = held.remove(0);
    p.eps[0].cancel(now, X);
    // Y writes elsewhere at the target; then 300 READs of DST.
    let y = XferId(2);
    let mut plan =
        plan::plan(&[DescPair { src: SRC, dst: DST + 8 * CHUNK, len: CHUNK }], PlanParams::new(CHUNK)).unwrap();
    plan.dests = vec![crate::proof::Destination { reg: REG, key: KEY }];
    p.eps[0].submit(now, y, TOKEN, PeerId(1), plan).unwrap();
    let reads: Vec<XferId> = (3..3 + 300).map(XferId).collect();
    for &z in &reads {
        let descs = [DescPair { src: DST, dst: SRC + z.0 * CHUNK, len: CHUNK }];
        let mut plan = plan::plan(&descs, PlanParams::new(CHUNK)).unwrap();
        plan.dests = vec![crate::proof::Destination { reg: REG, key: KEY }];
        p.eps[0].submit_read(now, z, TOKEN, PeerId(1), plan, None).unwrap();
    }
    p.run();
    let early = p.done.clone();
    p.perform(0, write);
    p.run();
    assert_eq!(p.eps[1].stats().control_replayed, 0, "Y's WANT taken for a replay");
    assert_eq!(early, vec![(0, X, Err(XferError::Canceled))], "nothing else ends before X's write");
    let mut ok: Vec<XferId> = p.done.iter().filter(|(_, _, r)| r.is_ok()).map(|&(_, x, _)| x).collect();
    ok.sort();
    assert_eq!(ok.len(), 301, "Y and every READ succeed: {:?}", p.done);
    assert!(ok[0] == y && ok[1..] == reads[..]);
    assert_eq!((p.eps[0].stats().writes_deferred, p.eps[0].stats().reads_deferred), (1, 300));
    for i in 0..CHUNK {
        assert_eq!(p.mem[1].get(&(DST + 8 * CHUNK + i)), Some(&new(i)), "Y's byte {i}");
        for z in &reads {
            assert_eq!(p.mem[0].get(&(SRC + z.0 * CHUNK + i)), Some(&old(i)), "READ {z:?} byte {i}");
        }
    }
}

/// A READ that fails while scatters into our memory run (cancelled by the application, timed
/// out, or its peer lost) is told failed only once they have ended: the application may reuse
/// its destinations the moment it learns, so nothing of the transfer may write them after.
#[test]
fn a_failed_read_is_told_only_once_its_scatters_into_our_memory_have_ended() {
    for how in ["cancel", "timeout", "peer lost"] {
        let mut p = Pair::new(16 * KIB, 2, false);
        let descs: Vec<DescPair> =
            (0..10).map(|i| DescPair { src: DST + i * CHUNK, dst: SRC + i * CHUNK, len: CHUNK }).collect();
        let mut plan = plan::plan(&descs, PlanParams::new(CHUNK)).unwrap();
        plan.dests = vec![crate::proof::Destination { reg: REG, key: KEY }];
        let now = p.now;
        p.eps[0].submit_read(now, X, TOKEN, PeerId(1), plan, None).unwrap();
        // Everything runs but our scatters, which are held as if still copying.
        let scatters = p.run_holding(|me, a| me == 0 && matches!(a, Action::Scatter { .. }));
        let mut held: Vec<JobId> = scatters
            .iter()
            .filter_map(|a| match a {
                Action::Scatter { job, .. } => Some(*job),
                _ => None,
            })
            .collect();
        assert!(held.len() >= 2, "{how}: scatters held {}", held.len());
        let later = p.now + TIMEOUT * 2;
        match how {
            "cancel" => p.eps[0].cancel(now, X),
            "timeout" => p.eps[0].handle_timeout(later),
            _ => p.eps[0].handle_peer_lost(now, PeerId(1)),
        }
        let end = if how == "timeout" { later } else { now };
        let told = |p: &mut Pair| {
            std::iter::from_fn(|| p.eps[0].poll_action())
                .filter_map(|a| match a {
                    Action::Complete { xfer, outcome } => Some((xfer, outcome)),
                    _ => None,
                })
                .collect::<Vec<_>>()
        };
        assert!(told(&mut p).is_empty(), "{how}: failure told with {} scatters still running", held.len());
        assert!(p.eps[0].owes_completion(X), "{how}");
        let last = held.pop().unwrap();
        for job in held {
            p.eps[0].handle_scatter_done(end, job, true);
            assert!(told(&mut p).is_empty(), "{how}: told before the last scatter ended");
        }
        p.eps[0].handle_scatter_done(end, last, true);
        let want = match how {
            "cancel" => XferError::Canceled,
            "timeout" => XferError::Timeout,
            _ => XferError::PeerLost,
        };
        assert_eq!(told(&mut p), vec![(X, Err(want))], "{how}: told once, after the last scatter");
        assert!(!p.eps[0].owes_completion(X), "{how}");
        assert_eq!(p.eps[0].jobs_in_flight(), 0, "{how}");
    }
}

/// What the property test below does to an endpoint.
#[derive(Debug, Clone)]
enum Op {
    Msg(u32, Msg),
    Done(usize, bool),
    Submit(u64, u64, u8),
    Cancel(u64),
    PeerLost(u32),
    Advance(u64),
}

fn any_region() -> impl Strategy<Value = Region> {
    prop_oneof![
        (0..32u64, prop::sample::select(vec![KIB, CHUNK, 2 * CHUNK]))
            .prop_map(|(o, len)| Region { offset: o * KIB, len }),
        (any::<u64>(), any::<u64>()).prop_map(|(offset, len)| Region { offset, len }),
    ]
}

fn any_run() -> impl Strategy<Value = CopyRun> {
    (0..8 * KIB, 0..64 * KIB, 0..5 * KIB, 0..4u32, 0..KIB, 0..KIB).prop_map(|(off, a, len, count, rs, as_)| CopyRun {
        region_off: off,
        addr: DST + a,
        len,
        count,
        region_stride: rs,
        addr_stride: as_,
    })
}

fn any_msg() -> impl Strategy<Value = Msg> {
    let xfer = (0..4u64).prop_map(XferId);
    prop_oneof![
        (xfer.clone(), prop::collection::vec(prop_oneof![Just(CHUNK), 0..3 * CHUNK], 0..5))
            .prop_map(|(x, c)| want_msg(x, &c)),
        (xfer.clone(), prop::collection::vec((0..6u32, any_region()), 0..4)).prop_map(|(x, c)| grant_msg(x, &c)),
        (xfer.clone(), 0..6u32, any_region(), prop::collection::vec(any_run(), 0..3))
            .prop_map(|(x, c, r, runs)| data_msg(x, c, r, runs)),
        (
            xfer,
            0..6u32,
            any_region(),
            prop::sample::select(vec![AckStatus::Scattered, AckStatus::Refused, AckStatus::Failed])
        )
            .prop_map(|(x, c, r, st)| ack_msg(x, c, r, st)),
    ]
}

fn any_op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..3u32, any_msg()).prop_map(|(p, m)| Op::Msg(p, m)),
        4 => (any::<usize>(), prop::bool::weighted(0.9)).prop_map(|(i, ok)| Op::Done(i, ok)),
        1 => (0..4u64, 1..6u64, any::<u8>()).prop_map(|(x, n, d)| Op::Submit(x, n, d)),
        1 => (0..4u64).prop_map(Op::Cancel),
        1 => (0..3u32).prop_map(Op::PeerLost),
        1 => (0..1500u64).prop_map(Op::Advance),
    ]
}

/// The kind of an outstanding job: 0 gather, 1 write, 2 scatter.
fn collect_jobs(ep: &mut Endpoint, jobs: &mut Vec<(JobId, u8)>) {
    for a in drain(ep) {
        match a {
            Action::Gather { job, .. } => jobs.push((job, 0)),
            Action::Write { job, .. } => jobs.push((job, 1)),
            Action::Scatter { job, .. } => jobs.push((job, 2)),
            _ => {}
        }
    }
}

fn report(ep: &mut Endpoint, now: Instant, (job, kind): (JobId, u8), ok: bool) {
    match kind {
        0 => ep.handle_gather_done(now, job, ok),
        1 => ep.handle_write_done(now, job, ok),
        _ => ep.handle_scatter_done(now, job, ok),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    /// Arbitrary peer messages mixed with real work never panic, never break the arena's
    /// conservation invariant, and after shutdown every region comes back once the jobs in
    /// flight are reported.
    #[test]
    fn arbitrary_peer_input_never_breaks_the_endpoint(ops in prop::collection::vec(any_op(), 1..80), eager: bool) {
        let (mut ep, mut now) = endpoint(32 * KIB, 2, eager);
        ep.add_registered(REG, KEY, (DST, 64 * KIB), ArenaId(0));
        let mut jobs = Vec::new();
        for op in ops {
            match op {
                Op::Msg(p, m) => { let _ = ep.handle_msg(now, PeerId(u64::from(p)), m); }
                Op::Done(i, ok) if !jobs.is_empty() => {
                    let j = jobs.swap_remove(i % jobs.len());
                    report(&mut ep, now, j, ok);
                }
                Op::Done(..) => {}
                Op::Submit(x, n, d) => {
                    // Bit `i` of `d` makes chunk `i` direct.
                    let plan = plan_with_direct(n, |i| d >> i & 1 == 1);
                    let _ = ep.submit(now, XferId(x), TOKEN, PeerId(x % 3), plan);
                }
                Op::Cancel(x) => ep.cancel(now, XferId(x)),
                Op::PeerLost(p) => ep.handle_peer_lost(now, PeerId(u64::from(p))),
                Op::Advance(ms) => {
                    now += Duration::from_millis(ms);
                    ep.handle_timeout(now);
                }
            }
            collect_jobs(&mut ep, &mut jobs);
            prop_assert!(ep.scheduler().check_invariants().is_ok(), "{:?}", ep.scheduler().check_invariants());
            prop_assert!(ep.receiver().check_invariants().is_ok(), "{:?}", ep.receiver().check_invariants());
        }
        ep.shutdown(now);
        collect_jobs(&mut ep, &mut jobs);
        while let Some(j) = jobs.pop() {
            report(&mut ep, now, j, true);
            collect_jobs(&mut ep, &mut jobs);
        }
        prop_assert!(ep.is_idle());
        prop_assert_eq!(ep.arena_free_bytes(), 32 * KIB);
    }
}

/// A peer we transfer to two way that also sends us one-way flows. The probe PINGs it only
/// when a peer table says its id answers PINGs: this endpoint's own (empty here, as in the
/// shell, which admits frames itself and calls `handle_msg`) says no, so without
/// `set_ping_answerers` it stays unprobed, and our transfer to it, should it die, would fail
/// only at its timeout.
#[test]
fn a_two_way_peer_that_also_sends_one_way_flows_is_probed_when_the_shells_table_says_it_answers() {
    for answers in [None, Some(false), Some(true)] {
        let c = Config {
            probe_after: Duration::from_millis(100),
            peer_dead_after: Duration::from_secs(2),
            ..config(16 * KIB, 2, false)
        };
        c.validate().unwrap();
        let now = Instant::now();
        let mut ep = Endpoint::new(&c, now, PROBE_KEY).unwrap();
        ep.add_registered(REG, KEY, (DST, 64 * KIB), ArenaId(0));
        ep.keep_mailbox(true);
        if let Some(a) = answers {
            ep.set_ping_answerers(move |p| a && p == PEER);
        }
        ep.submit(now, X, Token(TOKEN.0 + 1), PEER, plan_of(1)).unwrap();
        let one_way = Want {
            arena: ArenaId(0),
            xfer: XferId(9),
            token: TOKEN,
            endpoint: wire::REPLY_MAILBOX.to_vec(),
            chunks: vec![CHUNK],
            proofs: vec![crate::proof::prove(REG, &KEY, TOKEN, XferId(9))],
            inline: None,
            standing: Default::default(),
        };
        ep.handle_msg(now, PEER, Msg::Want(one_way)).unwrap();
        assert_eq!(ep.remote_flows(), 1, "the one-way flow is open");
        drain(&mut ep);
        ep.handle_timeout(now + Duration::from_millis(150));
        let pinged = drain(&mut ep)
            .iter()
            .any(|a| matches!(a, Action::Link { peer, body: wire::Body::Ping { .. } } if *peer == PEER));
        assert_eq!(pinged, answers == Some(true), "answers={answers:?}");
    }
}

/// A one-way initiator's WANT captured on the wire. Sent under another name, its proofs (bound
/// to the initiator's name) prove nothing. Sent under its own name after its flow ended, it is
/// a replay, and stays one after other names pushed that name out of the peer table (the
/// window is kept under the name, and its next id takes it back). A flood of invented names
/// with forged proofs pushes nobody out.
#[test]
fn a_captured_one_way_want_opens_nothing_again_under_any_name_even_after_its_name_was_evicted() {
    use crate::peers::MAX_ONE_WAY_NAMES;
    let (mut ep, t) = endpoint(16 * KIB, 2, false);
    ep.keep_mailbox(true);
    let captured = one_way_want(1, vec![proof_by("initiator", 1)]);
    let r = ep.handle_frame(t, "thief", &captured);
    assert!(matches!(r, Err(FrameRefused::Protocol(ProtocolError::BadProof { .. }))), "{r:?}");
    assert_eq!((ep.remote_flows(), ep.stats().control_forged), (0, 1));
    ep.handle_frame(t, "initiator", &captured).unwrap();
    assert_eq!(ep.remote_flows(), 1, "the genuine WANT opens its flow");
    let first = ep.peers().lookup("initiator").unwrap();
    // Its flow ends (its initiator went quiet), and its mailbox slot with it.
    let later = t + Duration::from_secs(60);
    while let Some(due) = ep.poll_timeout().filter(|&d| d <= later) {
        ep.handle_timeout(due);
        drain(&mut ep);
    }
    ep.handle_timeout(later);
    drain(&mut ep);
    assert_eq!((ep.remote_flows(), ep.answering_slots_held()), (0, 0));
    assert!(ep.holds_nothing_for(first));
    let replayed = ep.stats().control_replayed;
    assert!(ep.handle_frame(later, "initiator", &captured).is_err(), "a replay under its own name");
    assert_eq!(ep.stats().control_replayed, replayed + 1);
    // Invented names whose proofs are forged take no id, and so push no name out...
    let mut forged = proof_by("junk", 1);
    forged.tag[0] ^= 1;
    for i in 0..MAX_ONE_WAY_NAMES + 10 {
        let _ = ep.handle_frame(later, &format!("junk-{i}"), &one_way_want(1, vec![forged]));
    }
    assert_eq!(ep.peers().lookup("initiator"), Some(first), "forgeries evict nobody");
    // ...but other initiators' genuine names may: evicted as admission evicts it.
    let gone = ep.peers_mut().evict_one_way(|_| true);
    assert_eq!(gone, Some(first));
    ep.handle_peer_evicted(later, first);
    assert_ne!(ep.peers().lookup("initiator"), Some(first), "evicted");
    let r = ep.handle_frame(later, "initiator", &captured);
    assert!(matches!(r, Err(FrameRefused::Protocol(ProtocolError::Replayed { .. }))), "{r:?}");
    assert_eq!((ep.remote_flows(), ep.stats().control_replayed), (0, replayed + 2));
    // A new transfer of the same initiator is served as usual.
    let want = |xfer| {
        let Msg::Want(mut w) = wire::Frame::decode(&one_way_want(xfer, vec![])).unwrap().msg else { unreachable!() };
        w.token = Token(TOKEN.0 + 1);
        w.proofs =
            vec![crate::proof::prove_as(REG, &KEY, w.token, w.xfer, &crate::proof::Initiator::named("initiator"))];
        wire::Frame { session: 99, msg: Msg::Want(w) }.to_vec()
    };
    ep.handle_frame(later, "initiator", &want(2)).unwrap();
    assert_eq!(ep.remote_flows(), 1);
}

/// A slow write under a sender timeout of 8 s to a receiver of 1 s, the receiver's timeout
/// known to the sender (`told`) or not: (KEEPs the sender sent, flows the receiver reclaimed,
/// regions granted since to other peers that overlap the slow write's).
fn slow_write_under_mismatched_timeouts(told: bool) -> (u32, u64, Vec<(PeerId, Region)>) {
    let ms = Duration::from_millis;
    let s_cfg = Config { request_timeout: Duration::from_secs(8), ..config(16 * KIB, 2, false) };
    let r_cfg = config(16 * KIB, 2, false); // 1 s
    assert_eq!(r_cfg.request_timeout, Duration::from_secs(1));
    let mut p = Pair::of(&s_cfg, &r_cfg);
    let (t, s, r) = (p.now, 0usize, 1usize);
    if told {
        // What the receiver's capabilities say (`handle_conn_info`, or the shell at submit).
        p.eps[s].set_peer_timeout(PeerId(1), r_cfg.request_timeout);
    }
    p.eps[s].submit(t, X, TOKEN, PeerId(1), plan_of(1)).unwrap();
    for (_, m) in msgs(&drain(&mut p.eps[s])) {
        p.eps[r].handle_msg(t, PeerId(0), m).unwrap();
    }
    let mut granted = None;
    for (_, m) in msgs(&drain(&mut p.eps[r])) {
        if let Msg::Grant(g) = &m {
            granted = Some(g.credits[0].region);
        }
        p.eps[s].handle_msg(t, PeerId(1), m).unwrap();
    }
    let granted = granted.expect("a grant");
    // The sender gathers and posts its write at once; the write is slow (a congested link).
    let g = gathers(&drain(&mut p.eps[s]));
    p.eps[s].handle_gather_done(t, g[0].0, true);
    let w = writes(&drain(&mut p.eps[s]));
    assert_eq!((w.len(), w[0].2), (1, granted));
    let (mut now, mut keeps, mut regranted) = (t, 0, Vec::new());
    while now < t + ms(900) {
        now += ms(10);
        if p.eps[s].poll_timeout().is_some_and(|d| d <= now) {
            p.eps[s].handle_timeout(now);
        }
        for (_, m) in msgs(&drain(&mut p.eps[s])) {
            keeps += u32::from(matches!(m, Msg::Keep(_)));
            let _ = p.eps[r].handle_msg(now, PeerId(0), m);
        }
        if p.eps[r].poll_timeout().is_some_and(|d| d <= now) {
            p.eps[r].handle_timeout(now);
        }
        drain(&mut p.eps[r]);
        // Other peers ask for the arena past the lease and its quarantine (a busy receiver).
        if now >= t + ms(760) && regranted.is_empty() {
            for k in 0..4u32 {
                let peer = PeerId(u64::from(10 + k));
                p.eps[r].handle_msg(now, peer, want_msg(XferId(100 + u64::from(k)), &[CHUNK])).unwrap();
            }
            for a in drain(&mut p.eps[r]) {
                if let Action::Send { peer, msg: Msg::Grant(g) } = a {
                    regranted.extend(g.credits.iter().map(|c| (peer, c.region)));
                }
            }
        }
    }
    let overlap = regranted
        .into_iter()
        .filter(|(_, reg)| reg.offset < granted.offset + granted.len && granted.offset < reg.offset + reg.len)
        .collect();
    (keeps, p.eps[r].stats().flows_timed_out, overlap)
}

/// Review 55 (liveness) F1: each side timed a credit's lease by its own timeout, and nothing
/// told the sender the receiver's, so a sender whose timeout was several times the receiver's
/// sent its first KEEP after the receiver had taken the region back and granted it to another
/// transfer, into which the slow write then landed. Told the receiver's timeout (its
/// capabilities carry it since wire version 16), the sender keeps the flow alive by the
/// smaller of the two.
#[test]
fn a_sender_keeps_a_credit_by_the_receivers_timeout_when_it_is_shorter() {
    let (keeps, reclaimed, overlap) = slow_write_under_mismatched_timeouts(true);
    assert!(keeps >= 6, "a KEEP every eighth of the receiver's 1 s: {keeps}");
    assert_eq!(reclaimed, 0, "the receiver kept the flow");
    assert!(overlap.is_empty(), "the slow write's region was granted to {overlap:?}");
}

/// And a credit is used within a quarter of the smaller timeout, or the chunk fails: a write
/// posted later could land after the receiver took the region back.
#[test]
fn a_credit_goes_stale_by_the_smaller_of_the_two_timeouts() {
    let s_cfg = Config { request_timeout: Duration::from_secs(8), ..config(16 * KIB, 2, false) };
    let r_cfg = config(16 * KIB, 2, false); // 1 s
    let mut p = Pair::of(&s_cfg, &r_cfg);
    let (t, s, r) = (p.now, 0usize, 1usize);
    p.eps[s].set_peer_timeout(PeerId(1), r_cfg.request_timeout);
    p.eps[s].submit(t, X, TOKEN, PeerId(1), plan_of(1)).unwrap();
    for (_, m) in msgs(&drain(&mut p.eps[s])) {
        p.eps[r].handle_msg(t, PeerId(0), m).unwrap();
    }
    for (_, m) in msgs(&drain(&mut p.eps[r])) {
        p.eps[s].handle_msg(t, PeerId(1), m).unwrap();
    }
    let g = gathers(&drain(&mut p.eps[s]));
    // The gather ends a quarter of the receiver's timeout after the credit came (a 16th of ours).
    let late = t + Duration::from_millis(250);
    p.eps[s].handle_gather_done(late, g[0].0, true);
    assert!(writes(&drain(&mut p.eps[s])).is_empty(), "no write into a region whose lease may have ended");
    assert_eq!(p.eps[s].stats().timeouts, 1);
}
