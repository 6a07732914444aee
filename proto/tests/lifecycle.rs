//! The endpoint calls of an engine's lifecycle: deregistration (transfers that read the range
//! fail, scatters into it are answered as failed, later DATA into it is refused), GOODBYE from
//! a closing peer (its transfers fail at once, their credits are retracted once our writes
//! end, its flows into us are reclaimed) and closing (nothing more is granted; the grants given
//! out are counted until they come back).

use std::time::{Duration, Instant};

use bounce_proto::config::Config;
use bounce_proto::endpoint::{Action, Endpoint, FAREWELL, JobId, ProtocolError, XferError};
use bounce_proto::peers::FrameRefused;
use bounce_proto::plan::{self, DescPair, Plan, PlanParams};
use bounce_proto::proof;
use bounce_proto::wire::{self, Ack, AckStatus, Data, Frame, Grant, Msg, Want};
use bounce_proto::{ArenaId, ChunkIdx, CopyRun, PeerId, RegId, RegKey, Region, Token, XferId};

/// The secret PING nonces derive from (the shell draws one at random per engine).
const PROBE_KEY: [u8; 32] = [0x5b; 32];

const KIB: u64 = 1024;
const CHUNK: u64 = 4 * KIB;
const SRC: u64 = 0x10_0000;
const SRC2: u64 = 0x30_0000;
const DST: u64 = 0x20_0000;

fn config(eager: bool) -> Config {
    let c = Config {
        arena_size: 32 * KIB,
        arena_granularity: KIB,
        max_chunk_size: CHUNK,
        max_inflight_chunks: 2,
        eager_gather: eager,
        request_timeout: Duration::from_secs(60),
        // These pin exchanges with no standing flow in them (the simulation and the
        // endpoint's `standing` tests cover it).
        standing_bytes: 0,
        ..Config::default()
    };
    c.validate().unwrap();
    c
}

/// `n` gathered 4 KiB chunks from `src` to `DST`.
fn plan_from(src: u64, n: u64) -> Plan {
    let descs: Vec<DescPair> =
        (0..n).map(|i| DescPair { src: src + i * CHUNK, dst: DST + i * CHUNK, len: CHUNK }).collect();
    let mut p = plan::plan(&descs, PlanParams::new(CHUNK)).unwrap();
    for c in &mut p.chunks {
        c.direct = None;
    }
    p
}

fn drain(ep: &mut Endpoint) -> Vec<Action> {
    std::iter::from_fn(|| ep.poll_action()).collect()
}

fn completes(acts: &[Action]) -> Vec<(XferId, Result<(), XferError>)> {
    acts.iter()
        .filter_map(|a| match a {
            Action::Complete { xfer, outcome } => Some((*xfer, outcome.clone())),
            _ => None,
        })
        .collect()
}

fn gathers(acts: &[Action]) -> Vec<JobId> {
    acts.iter().filter_map(|a| if let Action::Gather { job, .. } = a { Some(*job) } else { None }).collect()
}

fn sent(acts: &[Action]) -> Vec<Msg> {
    acts.iter().filter_map(|a| if let Action::Send { msg, .. } = a { Some(msg.clone()) } else { None }).collect()
}

/// The destination registration the single-range tests use.
const D: RegId = RegId(1);

/// Transfer `xfer`'s token, as its sender drew it.
fn tok(xfer: u64) -> Token {
    Token(u128::from(xfer) * 7 + 1)
}

/// Registration `r`'s key, as its metadata carries it to a peer.
fn key(r: RegId) -> RegKey {
    RegKey([r.0 as u8; 32])
}

/// A peer's WANT for `chunks`, proving registration `D`.
fn want(xfer: u64, chunks: &[u64]) -> Msg {
    want_proving(xfer, chunks, &[D])
}

fn want_proving(xfer: u64, chunks: &[u64], regs: &[RegId]) -> Msg {
    want_proving_by("", xfer, chunks, regs)
}

/// [`want_proving`] as the agent `name` sends it (its proofs bound to that name).
fn want_proving_by(name: &str, xfer: u64, chunks: &[u64], regs: &[RegId]) -> Msg {
    let by = proof::Initiator::named(name);
    let proofs = regs.iter().map(|&r| proof::prove_as(r, &key(r), tok(xfer), XferId(xfer), &by)).collect();
    Msg::Want(Want {
        arena: ArenaId(0),
        xfer: XferId(xfer),
        token: tok(xfer),
        endpoint: Vec::new(),
        chunks: chunks.to_vec(),
        proofs,
        inline: None,
        standing: Default::default(),
    })
}

/// Connection info published by an engine with `session` (compatibility does not matter here:
/// it is what binds the peer's session).
fn caps(session: u64) -> wire::Capabilities {
    wire::Capabilities::host_arena(1 << 20, CHUNK, session)
}

fn credits(msgs: &[Msg]) -> Vec<(u32, Region)> {
    msgs.iter()
        .filter_map(|m| if let Msg::Grant(g) = m { Some(g) } else { None })
        .flat_map(|g| g.credits.iter().map(|c| (c.chunk.0, c.region)))
        .collect()
}

fn data(xfer: u64, chunk: u32, region: Region, addr: u64) -> Msg {
    let run = CopyRun { region_off: 0, addr, len: CHUNK, count: 1, region_stride: 0, addr_stride: 0 };
    Msg::Data(Data {
        xfer: XferId(xfer),
        token: tok(xfer),
        chunk: ChunkIdx(chunk),
        region,
        runs: vec![run],
        region_plan_runs: 0,
    })
}

fn acks(msgs: &[Msg]) -> Vec<AckStatus> {
    msgs.iter().filter_map(|m| if let Msg::Ack(a) = m { Some(a.status) } else { None }).collect()
}

#[test]
fn deregistration_fails_the_transfers_that_read_the_range_and_no_other() {
    let now = Instant::now();
    let mut ep = Endpoint::new(&config(true), now, PROBE_KEY).unwrap();
    let peer = PeerId(3);
    ep.submit(now, XferId(1), tok(1), peer, plan_from(SRC, 2)).unwrap();
    ep.submit(now, XferId(2), tok(2), peer, plan_from(SRC2, 2)).unwrap();
    let jobs = gathers(&drain(&mut ep));
    assert!(!jobs.is_empty(), "eager gathers are in flight");
    // The range of transfer 1's second source chunk only.
    ep.deregister(now, None, SRC + CHUNK, CHUNK);
    let acts = drain(&mut ep);
    assert_eq!(completes(&acts), vec![(XferId(1), Err(XferError::Deregistered))]);
    assert_eq!(ep.stats().dereg_failed, 1);
    assert_eq!(ep.in_flight_xfers(), 1, "transfer 2 reads other memory and goes on");
    // Its gathers still run (the shell waits for them); their staging regions come back after.
    assert!(ep.orphans() > 0);
    for j in jobs {
        ep.handle_gather_done(now, j, true);
    }
    drain(&mut ep);
    assert_eq!(ep.orphans(), 0);
    ep.shutdown(now);
    drain(&mut ep);
    assert!(ep.is_idle());
    assert_eq!(ep.arena_free_bytes(), 32 * KIB);
}

/// A receiver with `[DST, DST + 64 KiB)` registered `times` times, a flow of peer 5 granted
/// two chunks, and the first chunk's DATA scattering; returns the scatter's job and the
/// second credit.
fn scattering(times: usize) -> (Endpoint, Instant, JobId, Region) {
    let now = Instant::now();
    let mut ep = Endpoint::new(&config(false), now, PROBE_KEY).unwrap();
    for i in 0..times as u64 {
        ep.add_registered(RegId(D.0 + i), key(RegId(D.0 + i)), (DST, 64 * KIB), ArenaId(0));
    }
    ep.handle_msg(now, PeerId(5), want(9, &[CHUNK, CHUNK])).unwrap();
    let c = credits(&sent(&drain(&mut ep)));
    assert_eq!(c.len(), 2);
    ep.handle_msg(now, PeerId(5), data(9, c[0].0, c[0].1, DST)).unwrap();
    let job = drain(&mut ep)
        .into_iter()
        .find_map(|a| if let Action::Scatter { job, .. } = a { Some(job) } else { None })
        .expect("a scatter");
    (ep, now, job, c[1].1)
}

#[test]
fn a_scatter_into_deregistered_memory_is_answered_failed_and_later_data_refused() {
    let (mut ep, now, job, second) = scattering(1);
    ep.deregister(now, Some(D), DST, 64 * KIB);
    assert!(drain(&mut ep).is_empty(), "the running scatter is not cut short: the shell waits for it");
    // It ran to completion, yet the sender must not count the chunk as delivered.
    ep.handle_scatter_done(now, job, true);
    assert_eq!(acks(&sent(&drain(&mut ep))), vec![AckStatus::Failed]);
    assert_eq!((ep.stats().dereg_failed, ep.stats().chunks_scattered), (1, 0));
    // The next chunk's DATA names memory no longer registered.
    let r = ep.handle_msg(now, PeerId(5), data(9, 1, second, DST + CHUNK));
    assert!(matches!(r, Err(ProtocolError::InvalidData { .. })), "{r:?}");
    assert_eq!(acks(&sent(&drain(&mut ep))), vec![AckStatus::Refused]);
}

/// The race the CI run hit: the application deregisters the destination after the sender's
/// WANT left but before the receiver took it. The WANT proves a registration that is gone: it
/// is refused, and answered, so the sender fails at once instead of waiting for credits until
/// its (60 s) timeout.
#[test]
fn a_want_proving_a_registration_deregistered_before_it_arrived_fails_its_sender_at_once() {
    let now = Instant::now();
    let mut tx = Endpoint::new(&config(false), now, PROBE_KEY).unwrap();
    let mut rx = Endpoint::new(&config(false), now, PROBE_KEY).unwrap();
    rx.add_registered(D, key(D), (DST, 64 * KIB), ArenaId(0));
    let mut plan = plan_from(SRC, 2);
    plan.dests = vec![bounce_proto::proof::Destination { reg: D, key: key(D) }];
    tx.submit(now, XferId(1), tok(1), PeerId(5), plan).unwrap();
    let wants = sent(&drain(&mut tx));
    assert!(matches!(wants.as_slice(), [Msg::Want(_)]), "{wants:?}");
    rx.deregister(now, Some(D), DST, 64 * KIB);
    let r = rx.handle_msg(now, PeerId(5), wants[0].clone());
    assert!(matches!(r, Err(ProtocolError::BadProof { .. })), "{r:?}");
    let answer = sent(&drain(&mut rx));
    assert_eq!(acks(&answer), vec![AckStatus::Refused], "the refusal goes back");
    assert_eq!(rx.remote_flows(), 0);
    tx.handle_msg(now, PeerId(5), answer[0].clone()).unwrap();
    assert_eq!(completes(&drain(&mut tx)), vec![(XferId(1), Err(XferError::Refused))]);
    assert!(tx.is_idle());
}

#[test]
fn a_scatter_still_covered_by_another_registration_is_not_doomed() {
    let (mut ep, now, job, _) = scattering(2);
    ep.deregister(now, Some(D), DST, 64 * KIB);
    ep.handle_scatter_done(now, job, true);
    assert_eq!(acks(&sent(&drain(&mut ep))), vec![AckStatus::Scattered]);
    assert_eq!(ep.stats().dereg_failed, 0);
}

/// Registrations A, B and C side by side; a flow of peer 5 proving A and C only, whose one
/// chunk scatters 2 KiB into A and 2 KiB into C (its span straddles B); returns the scatter's job.
fn scattering_around_b() -> (Endpoint, Instant, JobId) {
    let now = Instant::now();
    let mut ep = Endpoint::new(&config(false), now, PROBE_KEY).unwrap();
    for (i, r) in [A, B, C].into_iter().enumerate() {
        ep.add_registered(r, key(r), (DST + i as u64 * 16 * KIB, 16 * KIB), ArenaId(0));
    }
    ep.handle_msg(now, PeerId(5), want_proving(9, &[CHUNK], &[A, C])).unwrap();
    let c = credits(&sent(&drain(&mut ep)));
    let half = CHUNK / 2;
    let run = |region_off, addr| CopyRun { region_off, addr, len: half, count: 1, region_stride: 0, addr_stride: 0 };
    let msg = Msg::Data(Data {
        xfer: XferId(9),
        token: tok(9),
        chunk: ChunkIdx(0),
        region: c[0].1,
        runs: vec![run(0, DST), run(half, DST + 32 * KIB)],
        region_plan_runs: 0,
    });
    ep.handle_msg(now, PeerId(5), msg).unwrap();
    let job = drain(&mut ep)
        .into_iter()
        .find_map(|a| if let Action::Scatter { job, .. } = a { Some(job) } else { None })
        .expect("a scatter");
    (ep, now, job)
}

const A: RegId = RegId(11);
const B: RegId = RegId(12);
const C: RegId = RegId(13);

#[test]
fn deregistering_memory_a_scatter_straddles_but_never_writes_leaves_it_whole() {
    let (mut ep, now, job) = scattering_around_b();
    ep.deregister(now, Some(B), DST + 16 * KIB, 16 * KIB);
    ep.handle_scatter_done(now, job, true);
    assert_eq!(acks(&sent(&drain(&mut ep))), vec![AckStatus::Scattered]);
    assert_eq!((ep.stats().dereg_failed, ep.stats().chunks_scattered), (0, 1));
}

#[test]
fn deregistering_one_of_the_registrations_a_scatter_writes_dooms_it() {
    for (r, at) in [(A, DST), (C, DST + 32 * KIB)] {
        let (mut ep, now, job) = scattering_around_b();
        ep.deregister(now, Some(r), at, 16 * KIB);
        ep.handle_scatter_done(now, job, true);
        assert_eq!(acks(&sent(&drain(&mut ep))), vec![AckStatus::Failed], "{r:?}");
        assert_eq!((ep.stats().dereg_failed, ep.stats().chunks_scattered), (1, 0));
    }
}

#[test]
fn goodbye_fails_our_transfers_retracts_their_credits_after_our_writes_and_reclaims_its_flows() {
    let now = Instant::now();
    let mut ep = Endpoint::new(&config(false), now, PROBE_KEY).unwrap();
    ep.add_registered(D, key(D), (DST, 64 * KIB), ArenaId(0));
    ep.peers_mut().load_conn_info("b", Some(caps(77)), None);
    let b = ep.peers_mut().id("b");
    let frame = |session, msg| Frame { session, msg }.to_vec();
    // b writes into us (a flow holding two regions) ...
    ep.handle_frame(now, "b", &frame(77, want_proving_by("b", 4, &[CHUNK, CHUNK], &[D]))).unwrap();
    drain(&mut ep);
    assert_eq!(ep.grants_outstanding(), 2);
    // ... and we write into b: credit, gather, write in flight.
    ep.submit(now, XferId(1), tok(1), b, plan_from(SRC, 2)).unwrap();
    drain(&mut ep);
    let grant = Msg::Grant(Grant {
        xfer: XferId(1),
        token: tok(1),
        credits: vec![wire::Credit { chunk: ChunkIdx(0), region: Region { offset: 0, len: CHUNK } }],
    });
    ep.handle_frame(now, "b", &frame(77, grant)).unwrap();
    let g = gathers(&drain(&mut ep));
    ep.handle_gather_done(now, g[0], true);
    let write = drain(&mut ep)
        .into_iter()
        .find_map(|a| if let Action::Write { job, .. } = a { Some(job) } else { None })
        .expect("a write");
    // A GOODBYE under another session is refused and changes nothing.
    assert_eq!(
        ep.handle_frame(now, "b", &wire::encode_goodbye(78)),
        Err(FrameRefused::StaleSession { got: 78, current: 77 })
    );
    assert_eq!(ep.in_flight_xfers(), 1);
    // A GOODBYE under b's session changes nothing either (anyone holding b's metadata knows
    // that session): it is asked about with a PING only b sees.
    ep.handle_frame(now, "b", &wire::encode_goodbye(77)).unwrap();
    let acts = drain(&mut ep);
    let asked = acts
        .iter()
        .find_map(|a| match a {
            Action::Link { peer, body: wire::Body::Ping { nonce } } if *peer == b => Some(*nonce),
            _ => None,
        })
        .expect("the GOODBYE is asked about");
    assert!(completes(&acts).is_empty() && ep.in_flight_xfers() == 1, "a GOODBYE alone ended a transfer");
    let pong = |nonce| {
        wire::ControlFrame { session: 77, body: wire::Body::Pong { nonce, forget: bounce_proto::Token(0) } }.to_vec()
    };
    // b alive and not closing echoes the nonce: nothing ends. Nor does a guess.
    for nonce in [asked, FAREWELL, asked ^ FAREWELL ^ 1] {
        ep.handle_frame(now, "b", &pong(nonce)).unwrap();
        assert!(completes(&drain(&mut ep)).is_empty() && ep.in_flight_xfers() == 1);
    }
    // b closing answers with the farewell PONG, which only whoever saw the PING can make.
    ep.handle_frame(now, "b", &pong(asked ^ FAREWELL)).unwrap();
    let acts = drain(&mut ep);
    assert_eq!(completes(&acts), vec![(XferId(1), Err(XferError::PeerLost))]);
    assert!(sent(&acts).is_empty(), "no cancel while our write may still land in b's arena");
    assert_eq!((ep.remote_flows(), ep.grants_outstanding()), (0, 0), "b's flow into us is reclaimed");
    assert!(!ep.peers().can_bounce("b"), "b's arena is forgotten");
    ep.handle_write_done(now, write, true);
    let msgs = sent(&drain(&mut ep));
    assert!(matches!(&msgs[..], [Msg::Want(w)] if w.is_cancel() && w.xfer == XferId(1)), "{msgs:?}");
    assert!(ep.is_idle());
}

/// A closing engine answers a PING with the farewell PONG, which confirms its GOODBYE; before
/// closing it echoes the nonce.
#[test]
fn a_closing_engine_answers_a_ping_with_the_farewell_pong() {
    let now = Instant::now();
    let mut ep = Endpoint::new(&config(false), now, PROBE_KEY).unwrap();
    ep.peers_mut().load_conn_info("b", Some(caps(77)), None);
    let b = ep.peers_mut().id("b");
    let ping = wire::ControlFrame { session: 77, body: wire::Body::Ping { nonce: 5 } }.to_vec();
    let pongs = |acts: Vec<Action>| {
        acts.into_iter()
            .filter_map(|a| match a {
                Action::Link { peer, body: wire::Body::Pong { nonce, .. } } if peer == b => Some(nonce),
                _ => None,
            })
            .collect::<Vec<_>>()
    };
    ep.handle_frame(now, "b", &ping).unwrap();
    assert_eq!(pongs(drain(&mut ep)), vec![5]);
    ep.close(now);
    drain(&mut ep);
    ep.handle_frame(now, "b", &ping).unwrap();
    assert_eq!(pongs(drain(&mut ep)), vec![5 ^ FAREWELL]);
}

#[test]
fn closing_grants_nothing_more_and_counts_the_grants_until_they_come_back() {
    let now = Instant::now();
    let mut ep = Endpoint::new(&config(false), now, PROBE_KEY).unwrap();
    ep.add_registered(D, key(D), (DST, 64 * KIB), ArenaId(0));
    // Peer 5's flow wants four chunks; the window grants two.
    ep.handle_msg(now, PeerId(5), want(9, &[CHUNK; 4])).unwrap();
    let c = credits(&sent(&drain(&mut ep)));
    assert_eq!(c.len(), 2);
    ep.submit(now, XferId(1), tok(1), PeerId(6), plan_from(SRC, 1)).unwrap();
    drain(&mut ep);
    ep.close(now);
    let acts = drain(&mut ep);
    assert_eq!(completes(&acts), vec![(XferId(1), Err(XferError::ShuttingDown))]);
    assert_eq!(ep.grants_outstanding(), 2);
    // A new WANT opens nothing; DATA for a granted region is still scattered and acknowledged,
    // and the region it frees is not granted again.
    ep.handle_msg(now, PeerId(7), want(3, &[CHUNK])).unwrap();
    ep.handle_msg(now, PeerId(5), data(9, c[0].0, c[0].1, DST)).unwrap();
    let job = drain(&mut ep)
        .into_iter()
        .find_map(|a| if let Action::Scatter { job, .. } = a { Some(job) } else { None })
        .expect("a scatter");
    ep.handle_scatter_done(now, job, true);
    let msgs = sent(&drain(&mut ep));
    assert_eq!(acks(&msgs), vec![AckStatus::Scattered]);
    assert!(credits(&msgs).is_empty(), "nothing is granted while closing");
    assert_eq!((ep.grants_outstanding(), ep.remote_flows()), (1, 1));
    // The peer retracts the rest.
    ep.handle_msg(now, PeerId(5), Msg::cancel(XferId(9), tok(9), Vec::new())).unwrap();
    assert!(sent(&drain(&mut ep)).is_empty());
    assert_eq!(ep.grants_outstanding(), 0);
    ep.shutdown(now);
    drain(&mut ep);
    assert!(ep.is_idle());
}

#[test]
fn goodbye_is_a_header_only_frame_of_kind_6() {
    let bytes = wire::encode_goodbye(0x0102_0304_0506_0708);
    assert_eq!(bytes.len(), 16);
    assert_eq!(bytes[7], 6);
    let f = wire::ControlFrame::decode(&bytes).unwrap();
    assert_eq!((f.session, f.body), (0x0102_0304_0506_0708, wire::Body::Goodbye));
    assert!(Frame::decode(&bytes).is_err(), "GOODBYE is no transfer message");
}

/// What the randomized run below keeps track of.
#[derive(Default)]
struct Model {
    /// `R1` is registered now.
    r1: bool,
    /// Closing: nothing may be granted any more.
    closed: bool,
    /// Outstanding jobs: (job, kind 0 gather / 1 write / 2 scatter).
    jobs: Vec<(JobId, u8)>,
    /// Scatters in flight: job -> (peer, xfer, region, touches R1, must be answered as failed).
    scatters: std::collections::BTreeMap<JobId, (PeerId, XferId, Region, bool, bool)>,
    /// Scatters reported done, waiting for their ACK: (peer, xfer, region) -> must be Failed.
    acks_due: std::collections::BTreeMap<(PeerId, XferId, Region), bool>,
    /// Credits granted to remote flows: (peer, xfer, chunk, region).
    credits: Vec<(PeerId, XferId, u32, Region)>,
    /// Local transfers in flight -> reads R1.
    local: std::collections::BTreeMap<XferId, bool>,
    /// Local transfers that read R1 when it was deregistered (none may complete Ok).
    doomed: std::collections::BTreeSet<XferId>,
    /// DATA we sent for local transfers: (xfer, chunk, region), for the peer's ACK.
    sent_data: Vec<(XferId, u32, Region)>,
    /// What the checks saw (so the run is shown not to be vacuous): doomed scatters answered,
    /// doomed local transfers ended, local transfers that succeeded, scatters emitted.
    seen: [u64; 4],
}

const R1: (u64, u64) = (DST, 64 * KIB);
const R2: (u64, u64) = (SRC2, 64 * KIB);
/// The registrations of `R1` and `R2`.
const RA: RegId = RegId(11);
const RB: RegId = RegId(12);
const LOCAL_PEER: PeerId = PeerId(5);

fn touches_r1(runs: &[CopyRun]) -> bool {
    runs.iter().filter_map(CopyRun::addr_span).any(|(a, b)| a < R1.0 + R1.1 && R1.0 < b)
}

impl Model {
    /// Takes every action, checking the lifecycle rules on the way.
    fn drain(&mut self, ep: &mut Endpoint) {
        while let Some(a) = ep.poll_action() {
            match a {
                Action::Gather { job, runs, .. } => {
                    assert!(self.r1 || !touches_r1(runs.runs()), "a gather reads deregistered memory");
                    self.jobs.push((job, 0));
                }
                Action::Write { job, .. } => self.jobs.push((job, 1)),
                Action::Scatter { job, peer, xfer, region, runs, .. } => {
                    let hit = touches_r1(&runs);
                    assert!(self.r1 || !hit, "a scatter into deregistered memory was emitted");
                    self.scatters.insert(job, (peer, xfer, region, hit, false));
                    self.seen[3] += 1;
                    self.jobs.push((job, 2));
                }
                Action::Complete { xfer, outcome } => {
                    assert!(self.local.remove(&xfer).is_some(), "{xfer:?} completed twice or unknown");
                    if self.doomed.contains(&xfer) {
                        assert!(outcome.is_err(), "{xfer:?} read deregistered memory yet succeeded");
                        self.seen[1] += 1;
                    } else if outcome.is_ok() {
                        self.seen[2] += 1;
                    }
                }
                Action::Send { peer, msg: Msg::Grant(g) } => {
                    assert!(!self.closed, "granted after close");
                    self.credits.extend(g.credits.iter().map(|c| (peer, g.xfer, c.chunk.0, c.region)));
                }
                Action::Send { peer, msg: Msg::Ack(a) } => {
                    if let Some(must_fail) = self.acks_due.remove(&(peer, a.xfer, a.region)) {
                        if must_fail {
                            assert_eq!(a.status, AckStatus::Failed, "a scatter into deregistered memory was acked");
                            self.seen[0] += 1;
                        }
                    }
                }
                Action::Send { msg: Msg::Data(d), .. } => self.sent_data.push((d.xfer, d.chunk.0, d.region)),
                // No endpoint here keeps a mailbox or submits a READ.
                Action::Send { .. } | Action::Link { .. } | Action::PutRecord { .. } => {}
                Action::Read { .. } => unreachable!("no READ is submitted here"),
            }
        }
    }
}

/// Random sequences of remote flows, local transfers, job completions, deregistration and
/// re-registration of one destination-and-source range, GOODBYEs and a close: no gather or
/// scatter touches the range while it is deregistered, a scatter running into it when it is
/// deregistered is answered as failed, a local transfer reading it never succeeds, nothing is
/// granted after close, and after shutdown the arena comes back whole.
#[test]
fn random_lifecycles_never_touch_deregistered_memory() {
    use rand::{Rng, SeedableRng};
    let mut seen = [0u64; 4];
    for seed in 0..300u64 {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let mut now = Instant::now();
        let mut ep = Endpoint::new(&config(rng.random_bool(0.5)), now, PROBE_KEY).unwrap();
        ep.add_registered(RA, key(RA), (R1.0, R1.1), ArenaId(0));
        ep.add_registered(RB, key(RB), (R2.0, R2.1), ArenaId(0));
        let mut m = Model { r1: true, ..Model::default() };
        let mut next = 1u64;
        for _ in 0..200 {
            match rng.random_range(0..12) {
                0 if !m.closed => {
                    let (peer, x) = (PeerId(rng.random_range(0..3)), 100 + rng.random_range(0..6u64));
                    let regs: &[RegId] = if m.r1 { &[RA, RB] } else { &[RB] };
                    let _ = ep.handle_msg(now, peer, want_proving(x, &[CHUNK; 3], regs));
                }
                1 if !m.credits.is_empty() => {
                    let (peer, x, chunk, region) = m.credits.swap_remove(rng.random_range(0..m.credits.len()));
                    let base = if rng.random_bool(0.5) { R1.0 } else { R2.0 };
                    let _ = ep.handle_msg(now, peer, data(x.0, chunk, region, base + rng.random_range(0..15) * CHUNK));
                }
                2..=4 if !m.jobs.is_empty() => {
                    let (job, kind) = m.jobs.swap_remove(rng.random_range(0..m.jobs.len()));
                    let ok = rng.random_bool(0.9);
                    match kind {
                        0 => ep.handle_gather_done(now, job, ok),
                        1 => ep.handle_write_done(now, job, ok),
                        _ => {
                            let (peer, x, region, _, must_fail) = m.scatters.remove(&job).unwrap();
                            m.acks_due.insert((peer, x, region), must_fail);
                            ep.handle_scatter_done(now, job, ok);
                        }
                    }
                }
                5 if !m.closed => {
                    // A local transfer, from R1 only while it is registered.
                    let from_r1 = m.r1 && rng.random_bool(0.5);
                    let src = if from_r1 { R1.0 } else { R2.0 };
                    let x = XferId(next);
                    next += 1;
                    if ep.submit(now, x, tok(x.0), LOCAL_PEER, plan_from(src, rng.random_range(1..4))).is_ok() {
                        m.local.insert(x, from_r1);
                    }
                }
                6 if !m.local.is_empty() => {
                    // The local peer grants one chunk of one of our transfers.
                    let (&x, _) = m.local.iter().nth(rng.random_range(0..m.local.len())).unwrap();
                    let chunk = rng.random_range(0..3u32);
                    let region = Region { offset: u64::from(chunk) * CHUNK, len: CHUNK };
                    let credit = wire::Credit { chunk: ChunkIdx(chunk), region };
                    let grant = Grant { xfer: x, token: tok(x.0), credits: vec![credit] };
                    let _ = ep.handle_msg(now, LOCAL_PEER, Msg::Grant(grant));
                }
                7 if !m.sent_data.is_empty() => {
                    let (x, chunk, region) = m.sent_data.swap_remove(rng.random_range(0..m.sent_data.len()));
                    let ack =
                        Ack { xfer: x, token: tok(x.0), chunk: ChunkIdx(chunk), region, status: AckStatus::Scattered };
                    let _ = ep.handle_msg(now, LOCAL_PEER, Msg::Ack(ack));
                }
                8 => {
                    if m.r1 {
                        m.r1 = false;
                        // Everything in flight on R1 now must end badly.
                        for s in m.scatters.values_mut().filter(|s| s.3) {
                            s.4 = true;
                        }
                        m.doomed.extend(m.local.iter().filter(|(_, r1)| **r1).map(|(x, _)| *x));
                        ep.deregister(now, Some(RA), R1.0, R1.1);
                    } else {
                        m.r1 = true;
                        ep.add_registered(RA, key(RA), (R1.0, R1.1), ArenaId(0));
                    }
                }
                9 if rng.random_bool(0.2) => ep.handle_goodbye(now, LOCAL_PEER),
                10 if rng.random_bool(0.05) && !m.closed => {
                    ep.close(now);
                    m.closed = true;
                }
                _ => {
                    now += Duration::from_millis(rng.random_range(0..50));
                    ep.handle_timeout(now);
                }
            }
            m.drain(&mut ep);
            assert!(ep.scheduler().check_invariants().is_ok(), "seed {seed}: {:?}", ep.scheduler().check_invariants());
            assert!(ep.receiver().check_invariants().is_ok(), "seed {seed}");
        }
        ep.shutdown(now);
        m.drain(&mut ep);
        while let Some((job, kind)) = m.jobs.pop() {
            match kind {
                0 => ep.handle_gather_done(now, job, false),
                1 => ep.handle_write_done(now, job, false),
                _ => ep.handle_scatter_done(now, job, true),
            }
            m.drain(&mut ep);
        }
        assert!(ep.is_idle(), "seed {seed}");
        assert!(m.local.is_empty(), "seed {seed}: transfers never completed: {:?}", m.local);
        assert_eq!(ep.arena_free_bytes(), 32 * KIB, "seed {seed}");
        for (t, n) in seen.iter_mut().zip(m.seen) {
            *t += n;
        }
    }
    // Not vacuous: doomed scatters and transfers really occur, and so do successes.
    let [failed_acks, doomed, succeeded, scatters] = seen;
    assert!(failed_acks > 20 && doomed > 20 && succeeded > 100 && scatters > 1000, "{seen:?}");
}

/// READ chunk `i`: one 4 KiB run from `DST + i * CHUNK`.
fn pull_chunk(i: u64) -> wire::PullChunk {
    let run = CopyRun { region_off: 0, addr: DST + i * CHUNK, len: CHUNK, count: 1, region_stride: 0, addr_stride: 0 };
    wire::PullChunk { bytes: CHUNK, runs: vec![run].into() }
}

/// A READ's gather runs are checked against the registrations at its PULL, and again for a
/// chunk gathered later only once a registration went meanwhile: a chunk whose source was
/// deregistered after the PULL is answered ACK(Failed) when its turn comes, never read, while
/// the chunks of the registration that stayed are gathered.
#[test]
fn a_read_chunk_whose_source_went_after_the_pull_fails_at_its_turn_and_no_other() {
    let now = Instant::now();
    let mut ep = Endpoint::new(&config(false), now, PROBE_KEY).unwrap();
    let (kept, gone) = (RegId(1), RegId(2));
    ep.add_registered(kept, key(kept), (DST, 2 * CHUNK), ArenaId(0));
    ep.add_registered(gone, key(gone), (DST + 2 * CHUNK, CHUNK), ArenaId(0));
    let (xfer, peer) = (9, PeerId(5));
    let chunks = (0..3).map(pull_chunk).collect();
    let proofs = [kept, gone].iter().map(|&r| proof::prove(r, &key(r), tok(xfer), XferId(xfer))).collect();
    let (first, endpoint) = (ChunkIdx(0), Vec::new());
    let pull = wire::Pull {
        arena: ArenaId(0),
        xfer: XferId(xfer),
        token: tok(xfer),
        first,
        total: 3,
        endpoint,
        chunks,
        proofs,
    };
    ep.handle_msg(now, peer, Msg::Pull(pull)).unwrap();
    let first = gathers(&drain(&mut ep));
    assert_eq!(first.len(), 2, "a window of two chunks");
    ep.deregister(now, Some(gone), DST + 2 * CHUNK, CHUNK);
    assert!(sent(&drain(&mut ep)).is_empty(), "nothing running reads the range");
    // Chunk 0 gathered and announced; its RELEASE frees the window for chunk 2.
    ep.handle_gather_done(now, first[0], true);
    let ready = credits(&sent(&drain(&mut ep)));
    assert_eq!(ready.iter().map(|c| c.0).collect::<Vec<_>>(), vec![0]);
    let release = wire::Release { xfer: XferId(xfer), token: tok(xfer), chunk: ChunkIdx(0), region: ready[0].1 };
    ep.handle_msg(now, peer, Msg::Release(release)).unwrap();
    let acts = drain(&mut ep);
    assert!(gathers(&acts).is_empty(), "chunk 2's source is not read");
    assert_eq!(acks(&sent(&acts)), vec![AckStatus::Failed]);
    assert_eq!(ep.stats().dereg_failed, 1);
    // Chunk 1 reads the registration that stayed: it is announced as usual.
    ep.handle_gather_done(now, first[1], true);
    assert_eq!(credits(&sent(&drain(&mut ep))).iter().map(|c| c.0).collect::<Vec<_>>(), vec![1]);
}

/// The PULL of `chunks` (see [`pull_chunk`]) starting at chunk `first` of a READ of `total`
/// chunks, proving `D` when it opens the flow.
fn pull(xfer: u64, first: u32, chunks: std::ops::Range<u64>, total: u32) -> Msg {
    let chunks = chunks.map(pull_chunk).collect();
    let proofs = if first == 0 { vec![proof::prove(D, &key(D), tok(xfer), XferId(xfer))] } else { Vec::new() };
    let (first, endpoint) = (ChunkIdx(first), Vec::new());
    Msg::Pull(wire::Pull {
        arena: ArenaId(0),
        xfer: XferId(xfer),
        token: tok(xfer),
        first,
        total,
        endpoint,
        chunks,
        proofs,
    })
}

/// A READ comes as several PULLs (the first chunk alone, so it is gathered while the rest
/// are still encoded and decoded): the target gathers chunk 0 at once, keeps the flow when
/// that chunk is READ and released before the next PULL came, takes the later chunks in order
/// only, and forgets the flow once all `total` chunks came and were released.
#[test]
fn a_read_split_in_pulls_is_served_from_its_first_pull_and_kept_until_its_last() {
    let now = Instant::now();
    let mut ep = Endpoint::new(&config(false), now, PROBE_KEY).unwrap();
    ep.add_registered(D, key(D), (DST, 8 * CHUNK), ArenaId(0));
    let (xfer, peer) = (9, PeerId(5));
    ep.handle_msg(now, peer, pull(xfer, 0, 0..1, 3)).unwrap();
    let g = gathers(&drain(&mut ep));
    assert_eq!(g.len(), 1, "chunk 0 is gathered before the rest of the READ is announced");
    ep.handle_gather_done(now, g[0], true);
    let ready = credits(&sent(&drain(&mut ep)));
    let release = |chunk: u32, region| {
        Msg::Release(wire::Release { xfer: XferId(xfer), token: tok(xfer), chunk: ChunkIdx(chunk), region })
    };
    ep.handle_msg(now, peer, release(0, ready[0].1)).unwrap();
    assert_eq!(ep.remote_flows(), 1, "the flow waits for its other chunks");
    // Out of order (chunk 2 before chunk 1), or claiming another total: refused, unqueued.
    let r = ep.handle_msg(now, peer, pull(xfer, 2, 2..3, 3));
    assert!(matches!(r, Err(ProtocolError::BadPull { .. })), "{r:?}");
    let r = ep.handle_msg(now, peer, pull(xfer, 1, 1..3, 4));
    assert!(matches!(r, Err(ProtocolError::BadPull { .. })), "{r:?}");
    // Another token cannot add to the flow.
    let mut forged = pull(xfer, 1, 1..3, 3);
    if let Msg::Pull(p) = &mut forged {
        p.token = Token(1);
    }
    assert!(matches!(ep.handle_msg(now, peer, forged), Err(ProtocolError::WrongToken { .. })));
    assert!(gathers(&drain(&mut ep)).is_empty());
    // The genuine next PULL: both chunks are gathered, announced and released.
    ep.handle_msg(now, peer, pull(xfer, 1, 1..3, 3)).unwrap();
    let g = gathers(&drain(&mut ep));
    assert_eq!(g.len(), 2);
    for j in g {
        ep.handle_gather_done(now, j, true);
    }
    for (chunk, region) in credits(&sent(&drain(&mut ep))) {
        assert!(chunk == 1 || chunk == 2);
        ep.handle_msg(now, peer, release(chunk, region)).unwrap();
    }
    assert_eq!(ep.remote_flows(), 0, "all three chunks came and ended: the flow is done");
    assert_eq!(ep.stats().chunks_served, 3);
    // A later PULL of the ended READ is dropped as late, and opens nothing.
    ep.handle_msg(now, peer, pull(xfer, 3, 3..4, 4)).unwrap();
    assert_eq!((ep.remote_flows(), ep.stats().late_data), (0, 1));
    assert!(drain(&mut ep).is_empty());
    // Its opening PULL sent again is a replay: it opens nothing and gathers nothing.
    let r = ep.handle_msg(now, peer, pull(xfer, 0, 0..1, 3));
    assert!(matches!(r, Err(ProtocolError::Replayed { .. })), "{r:?}");
    assert!(drain(&mut ep).is_empty());
    assert_eq!(ep.remote_flows(), 0);
    ep.receiver().check_invariants().unwrap();
}

/// A READ flow whose later PULLs never come (its initiator died between two) is reclaimed by
/// the idle timeout, like a flow that holds regions nobody writes.
#[test]
fn a_read_flow_waiting_for_pulls_that_never_come_is_reclaimed() {
    let now = Instant::now();
    let mut ep = Endpoint::new(&config(false), now, PROBE_KEY).unwrap();
    ep.add_registered(D, key(D), (DST, 8 * CHUNK), ArenaId(0));
    let peer = PeerId(5);
    ep.handle_msg(now, peer, pull(9, 0, 0..1, 2)).unwrap();
    let g = gathers(&drain(&mut ep));
    ep.handle_gather_done(now, g[0], true);
    let ready = credits(&sent(&drain(&mut ep)));
    let release = wire::Release { xfer: XferId(9), token: tok(9), chunk: ChunkIdx(0), region: ready[0].1 };
    ep.handle_msg(now, peer, Msg::Release(release)).unwrap();
    assert_eq!(ep.remote_flows(), 1);
    let later = now + Duration::from_secs(600);
    ep.handle_timeout(later);
    drain(&mut ep);
    assert_eq!((ep.remote_flows(), ep.stats().flows_timed_out), (0, 1));
    ep.receiver().check_invariants().unwrap();
    assert_eq!(ep.arena_free_bytes(), 32 * KIB);
}
