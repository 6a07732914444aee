//! The liveness probe end to end in the core: two endpoints exchanging real encoded frames
//! through [`Endpoint::handle_frame`] in virtual time, with the default probe timings and the
//! default 30 s request timeout. A receiver that dies mid-transfer fails the sender's transfer
//! as lost within `probe_after + dead_after` of its last frame; a receiver whose scatters take
//! 3 s each keeps answering PINGs and the transfer succeeds.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use bounce_proto::config::Config;
use bounce_proto::endpoint::{Action, Endpoint, JobId, XferError};
use bounce_proto::plan::{self, DescPair, PlanParams};
use bounce_proto::proof::Destination;
use bounce_proto::wire::{ControlFrame, Frame};
use bounce_proto::{ArenaId, PeerId, RegId, RegKey, Token, XferId};

/// The key of the receiver's one registration, as its metadata would carry it.
const KEY: RegKey = RegKey([0x5a; 32]);

/// Connection info published by a node whose frames carry `session`.
fn caps(session: u64) -> bounce_proto::wire::Capabilities {
    bounce_proto::wire::Capabilities::host_arena(1 << 30, 1 << 20, session)
}

const KIB: u64 = 1024;
const CHUNK: u64 = 4 * KIB;
const SRC: u64 = 0x10_0000;
const DST: u64 = 0x20_0000;
const NAMES: [&str; 2] = ["a", "b"];
const X: XferId = XferId(1);

/// One scheduled event.
#[derive(Debug)]
enum Ev {
    /// A frame from node `from` arrives at node `to`.
    Deliver { from: usize, to: usize, frame: Vec<u8> },
    /// A third agent's frame under node 1's name and published session arrives at node 0
    /// (refused or not, it is no frame of node 1's).
    Forged { frame: Vec<u8> },
    /// A job of node `node` finishes.
    Done { node: usize, job: JobId, kind: u8 },
}

/// Two endpoints, a virtual clock and an event queue. Node 0 sends, node 1 receives.
struct Pair {
    eps: [Endpoint; 2],
    /// Each node's id for the other.
    ids: [PeerId; 2],
    alive: [bool; 2],
    start: Instant,
    now: Instant,
    queue: BTreeMap<(Instant, u64), Ev>,
    seq: u64,
    latency: Duration,
    scatter_time: Duration,
    done: Vec<(Instant, Result<(), XferError>)>,
    /// When node 0 last admitted a frame from node 1.
    last_from_receiver: Instant,
}

impl Pair {
    fn new(scatter_time: Duration) -> Self {
        let cfg = Config {
            arena_size: 64 * KIB,
            arena_granularity: KIB,
            max_chunk_size: CHUNK,
            max_inflight_chunks: 2,
            ..Config::default()
        };
        cfg.validate().unwrap();
        assert_eq!(cfg.request_timeout, Duration::from_secs(30), "the manifest default");
        let start = Instant::now();
        let mut eps =
            [Endpoint::new(&cfg, start, [0xfe; 32]).unwrap(), Endpoint::new(&cfg, start, [0xff; 32]).unwrap()];
        let mut ids = [PeerId(0); 2];
        for (me, ep) in eps.iter_mut().enumerate() {
            ep.set_local_name(NAMES[me]);
            let other = NAMES[1 - me];
            // The other node's connection info carries its session (node n sends n + 1).
            ep.peers_mut().load_conn_info(other, Some(caps(2 - me as u64)), None);
            ids[me] = ep.peers_mut().id(other);
            ep.add_registered(RegId(0), KEY, (DST, 1 << 20), ArenaId(0));
        }
        Self {
            eps,
            ids,
            alive: [true; 2],
            start,
            now: start,
            queue: BTreeMap::new(),
            seq: 0,
            latency: Duration::from_micros(50),
            scatter_time,
            done: Vec::new(),
            last_from_receiver: start,
        }
    }

    fn at(&mut self, at: Instant, ev: Ev) {
        self.seq += 1;
        self.queue.insert((at, self.seq), ev);
    }

    /// Submits `n` chunks of 4 KiB from node 0 to node 1.
    fn submit(&mut self, n: u64) {
        let descs: Vec<DescPair> =
            (0..n).map(|i| DescPair { src: SRC + i * CHUNK, dst: DST + i * CHUNK, len: CHUNK }).collect();
        let mut p = plan::plan(&descs, PlanParams::new(CHUNK)).unwrap();
        p.dests = vec![Destination { reg: RegId(0), key: KEY }];
        let (now, peer) = (self.now, self.ids[0]);
        self.eps[0].submit(now, X, Token(0x5eed), peer, p).unwrap();
        self.drain();
    }

    fn drain(&mut self) {
        for me in 0..2 {
            while let Some(a) = self.eps[me].poll_action() {
                self.perform(me, a);
            }
        }
    }

    fn perform(&mut self, me: usize, a: Action) {
        let session = me as u64 + 1;
        let soon = self.now + self.latency;
        match a {
            Action::Send { msg, .. } => {
                let frame = Frame { session, msg }.to_vec();
                self.at(soon, Ev::Deliver { from: me, to: 1 - me, frame });
            }
            Action::Link { body, .. } => {
                let frame = ControlFrame { session, body }.to_vec();
                self.at(soon, Ev::Deliver { from: me, to: 1 - me, frame });
            }
            Action::PutRecord { .. } => unreachable!("no node here keeps a mailbox"),
            Action::Read { .. } => unreachable!("no node here READs"),
            Action::Gather { job, .. } => self.at(soon, Ev::Done { node: me, job, kind: 0 }),
            Action::Write { job, .. } => self.at(soon, Ev::Done { node: me, job, kind: 1 }),
            Action::Scatter { job, .. } => {
                let at = self.now + self.scatter_time;
                self.at(at, Ev::Done { node: me, job, kind: 2 });
            }
            Action::Complete { outcome, .. } => {
                assert_eq!(me, 0);
                self.done.push((self.now, outcome));
            }
        }
    }

    /// Runs events and timers until `until` or until node 0's transfer completed.
    fn run(&mut self, until: Instant) {
        while self.done.is_empty() {
            let timers = (0..2).filter(|&n| self.alive[n]).filter_map(|n| self.eps[n].poll_timeout()).min();
            let next_ev = self.queue.keys().next().map(|k| k.0);
            let Some(next) = [timers, next_ev].into_iter().flatten().min() else { return };
            if next > until {
                return;
            }
            self.now = self.now.max(next);
            let now = self.now;
            if next_ev == Some(next) {
                let (_, ev) = self.queue.pop_first().unwrap();
                match ev {
                    Ev::Deliver { from, to, frame } if self.alive[to] => {
                        self.eps[to].handle_frame(now, NAMES[from], &frame).unwrap();
                        if to == 0 {
                            self.last_from_receiver = now;
                        }
                    }
                    Ev::Forged { frame } => {
                        let _ = self.eps[0].handle_frame(now, NAMES[1], &frame);
                    }
                    Ev::Done { node, job, kind } if self.alive[node] => match kind {
                        0 => self.eps[node].handle_gather_done(now, job, true),
                        1 => self.eps[node].handle_write_done(now, job, true),
                        _ => self.eps[node].handle_scatter_done(now, job, true),
                    },
                    _ => {}
                }
            } else {
                for n in 0..2 {
                    if self.alive[n] && self.eps[n].poll_timeout().is_some_and(|t| t <= now) {
                        self.eps[n].handle_timeout(now);
                    }
                }
            }
            self.drain();
        }
    }
}

/// A pair whose receiver died mid-transfer (SIGKILL: nothing more from it, ever), a few
/// chunks in; with when it died.
fn killed_mid_transfer() -> (Pair, Instant) {
    let mut p = Pair::new(Duration::from_micros(100));
    p.submit(64);
    p.run(p.start + Duration::from_millis(2));
    assert!(p.done.is_empty() && p.eps[1].stats().chunks_scattered > 0, "mid-transfer");
    p.alive[1] = false;
    let died = p.now;
    (p, died)
}

#[test]
fn a_receiver_that_dies_mid_transfer_fails_the_transfer_within_the_probe_bound() {
    let (mut p, died) = killed_mid_transfer();
    p.run(p.start + Duration::from_secs(60));
    let [(at, outcome)] = &p.done[..] else { panic!("{:?}", p.done) };
    assert_eq!(outcome, &Err(XferError::Unresponsive));
    let s = p.eps[0].stats();
    assert_eq!((s.peers_declared_dead, s.timeouts), (1, 0));
    assert!(s.pings_sent >= 2 && s.pongs_received == 0, "{s:?}");
    let bound = Duration::from_millis(250 + 1500);
    assert!(*at - p.last_from_receiver <= bound, "declared dead {:?} after its last frame", *at - p.last_from_receiver);
    assert!(*at - died < Duration::from_secs(2), "failed {:?} after the death", *at - died);
    // Nothing is left waiting on the dead peer: no transfer, no PING, no timer.
    assert_eq!((p.eps[0].in_flight_xfers(), p.eps[0].poll_timeout()), (0, None));
}

/// The receiver dies mid-transfer and a third agent holding its metadata (its name and
/// session are published) keeps sending frames under its name: PINGs, answers to our transfer
/// without its token, frames of flows it never opened. None is a sign of life (only a PONG
/// echoing our nonce, or a frame with a token of ours or of its flow, is): the receiver is
/// declared dead within the probe's bound, as with silence. Before, any admitted frame counted,
/// and the transfer failed only by the 30 s request timeout.
#[test]
fn frames_forged_under_a_dead_receivers_name_do_not_keep_it_alive() {
    use bounce_proto::wire::{Ack, AckStatus, Body, Credit, Cursor, Grant, Keep, Msg};
    use bounce_proto::{ChunkIdx, Region};
    let (mut p, died) = killed_mid_transfer();
    let wrong = Token(0xbad);
    let region = Region { offset: 0, len: CHUNK };
    let forged: Vec<Vec<u8>> = vec![
        ControlFrame { session: 2, body: Body::Ping { nonce: 7 } }.to_vec(),
        ControlFrame { session: 2, body: Body::Pong { nonce: 7, forget: bounce_proto::Token(0) } }.to_vec(),
        Frame {
            session: 2,
            msg: Msg::Grant(Grant { xfer: X, token: wrong, credits: vec![Credit { chunk: ChunkIdx(60), region }] }),
        }
        .to_vec(),
        Frame {
            session: 2,
            msg: Msg::Ack(Ack {
                xfer: XferId(77),
                token: wrong,
                chunk: ChunkIdx(0),
                region,
                status: AckStatus::Scattered,
            }),
        }
        .to_vec(),
        Frame { session: 2, msg: Msg::Keep(Keep { xfer: XferId(78), token: wrong }) }.to_vec(),
        Frame { session: 2, msg: Msg::Cursor(Cursor { xfer: XferId(79), token: wrong, consumed: 0 }) }.to_vec(),
    ];
    for i in 0..700u32 {
        let at = died + Duration::from_millis(50) * i;
        for f in &forged {
            p.at(at, Ev::Forged { frame: f.clone() });
        }
    }
    p.run(p.start + Duration::from_secs(60));
    let [(at, outcome)] = &p.done[..] else { panic!("{:?}", p.done) };
    assert_eq!(outcome, &Err(XferError::Unresponsive));
    let s = p.eps[0].stats();
    assert_eq!((s.peers_declared_dead, s.timeouts, s.pongs_received), (1, 0, 0), "{s:?}");
    assert!(*at - died < Duration::from_secs(2), "failed {:?} after the death, forgeries still arriving", *at - died);
}

#[test]
fn a_receiver_whose_scatters_take_3_s_answers_pings_and_the_transfer_succeeds() {
    let mut p = Pair::new(Duration::from_secs(3));
    p.submit(8);
    p.run(p.start + Duration::from_secs(120));
    let [(at, outcome)] = &p.done[..] else { panic!("{:?}", p.done) };
    assert_eq!(outcome, &Ok(()));
    // Four windows of two 3 s scatters each: about 12 s, far beyond the probe's bound.
    assert!(*at - p.start >= Duration::from_secs(12), "{:?}", *at - p.start);
    for ep in &p.eps {
        let s = ep.stats();
        assert_eq!(s.peers_declared_dead, 0, "{s:?}");
    }
    // The sender waited on silent ACKs and probed; every probe was answered.
    let s = p.eps[0].stats();
    assert!(s.pings_sent >= 8 && s.pongs_received == s.pings_sent, "{s:?}");
    assert_eq!(p.eps[1].stats().chunks_scattered, 8);
}

#[test]
fn with_probing_off_a_dead_receiver_is_found_only_by_the_request_timeout() {
    let mut p = Pair::new(Duration::from_millis(1));
    let cfg = Config {
        arena_size: 64 * KIB,
        arena_granularity: KIB,
        max_chunk_size: CHUNK,
        max_inflight_chunks: 2,
        peer_dead_after: Duration::ZERO,
        ..Config::default()
    };
    // A restarted process draws a new key.
    p.eps[0] = Endpoint::new(&cfg, p.start, [0xfd; 32]).unwrap();
    p.eps[0].set_local_name(NAMES[0]);
    p.eps[0].peers_mut().load_conn_info("b", None, None);
    p.ids[0] = p.eps[0].peers_mut().id("b");
    p.submit(64);
    p.alive[1] = false;
    p.run(p.start + Duration::from_secs(60));
    let [(at, outcome)] = &p.done[..] else { panic!("{:?}", p.done) };
    assert_eq!(outcome, &Err(XferError::Timeout));
    assert_eq!(*at - p.start, Duration::from_secs(30));
    assert_eq!((p.eps[0].stats().pings_sent, p.eps[0].stats().peers_declared_dead), (0, 0));
}

#[test]
fn a_transport_reporting_the_peer_unreachable_declares_it_dead_at_once_only_when_waited_on() {
    let mut p = Pair::new(Duration::from_micros(100));
    // Nothing waits on the receiver yet: the report changes nothing.
    let (now, b) = (p.now, p.ids[0]);
    p.eps[0].handle_peer_unreachable(now, b);
    assert_eq!(p.eps[0].stats().peers_declared_dead, 0);
    p.submit(64);
    p.alive[1] = false;
    let (now, b) = (p.now, p.ids[0]);
    p.eps[0].handle_peer_unreachable(now, b);
    p.drain();
    assert_eq!(p.done, vec![(now, Err(XferError::PeerLost))]);
    assert_eq!((p.eps[0].stats().peers_declared_dead, p.eps[0].in_flight_xfers()), (1, 0));
}

#[test]
fn every_peer_with_flows_or_transfers_is_probed_once_per_round() {
    let p = Pair::new(Duration::from_micros(100));
    let mut ep = p.eps.into_iter().next().unwrap();
    let t = p.start;
    // Flows from peers 3, 5 and 9 (several each), a transfer of ours to peer 1.
    for (peer, xfers) in [(3u64, 4u64), (5, 1), (9, 7)] {
        for x in 0..xfers {
            let token = Token(u128::from(x) + 1);
            let want = bounce_proto::wire::Want {
                arena: ArenaId(0),
                xfer: XferId(x),
                token,
                endpoint: Vec::new(),
                chunks: vec![CHUNK],
                proofs: vec![bounce_proto::proof::prove(RegId(0), &KEY, token, XferId(x))],
                inline: None,
                standing: Default::default(),
            };
            ep.handle_msg(t, PeerId(peer), want.into()).unwrap();
        }
    }
    let descs = [DescPair { src: SRC, dst: DST, len: CHUNK }];
    ep.submit(t, X, Token(7), PeerId(1), plan::plan(&descs, PlanParams::new(CHUNK)).unwrap()).unwrap();
    while ep.poll_action().is_some() {}
    let probe = Duration::from_millis(250);
    assert_eq!(ep.poll_timeout(), Some(t + probe));
    ep.handle_timeout(t + probe);
    let mut pinged: Vec<u64> = std::iter::from_fn(|| ep.poll_action())
        .filter_map(|a| match a {
            Action::Link { peer, body: bounce_proto::wire::Body::Ping { .. } } => Some(peer.0),
            _ => None,
        })
        .collect();
    pinged.sort();
    assert_eq!(pinged, vec![1, 3, 5, 9]);
}
