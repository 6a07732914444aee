//! The simulation harness: endpoints joined by a simulated network and simulated copy engines
//! (quinn-proto's `tests/util.rs` `Pair` shape, with raft `network.rs`-style fault knobs).
//!
//! Time is virtual and jumps to the next event or endpoint timer. Messages are really encoded
//! through [`wire::Frame`] and handed to the receiving endpoint as raw bytes
//! ([`Endpoint::handle_frame`], so the peer rules apply to every one), delayed at random (reordered across channels, and
//! within a channel unless [`Knobs::fifo`]), and dropped with probability [`Knobs::drop_p`].
//! Gather, write and scatter jobs really move bytes between per-node user memories and arenas
//! (a direct write straight from the sender's user memory),
//! at their completion time (the latest moment a real copy engine could touch the memory), and
//! fail with probability [`Knobs::job_fail_p`] after a partial copy. Everything is driven by
//! one seeded RNG, so a seed replays exactly.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use bounce_proto::config::Config;
use bounce_proto::endpoint::{Action, Endpoint, InRegionPlan, JobId, JobRuns, WriteRoute, WriteSource, XferError};
use bounce_proto::mailbox::MailboxLayout;
use bounce_proto::peers::FrameRefused;
use bounce_proto::plan::{self, DescPair, PlanParams};
use bounce_proto::proof::Destination;
use bounce_proto::wire::{self, Frame, Msg, region_plan};
use bounce_proto::{ArenaId, CopyRun, FlowKey, PeerId, RegId, RegKey, Region, Token, XferId};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// The agent name of node `i`.
fn agent(i: usize) -> String {
    format!("agent-{i}")
}

/// Base address of every node's user memory.
pub(crate) const MEM_BASE: u64 = 0x7f00_0000_0000;

/// Fault and timing knobs of a simulation.
#[derive(Debug, Clone)]
pub(crate) struct Knobs {
    /// Message latency range.
    pub(crate) msg_delay: (Duration, Duration),
    /// Keep each (from, to) channel FIFO (UCX active messages are ordered per endpoint).
    pub(crate) fifo: bool,
    /// Job (gather / write / scatter) duration range.
    pub(crate) job_delay: (Duration, Duration),
    /// Probability that a message is lost.
    pub(crate) drop_p: f64,
    /// Probability that a job fails (after copying part of its bytes).
    pub(crate) job_fail_p: f64,
    /// Probability that the shell clears a chunk's [`plan::Chunk::direct`] before submit (as
    /// for a source not registered in one piece), so it is staged after all.
    pub(crate) clear_direct_p: f64,
    /// Every transfer goes one way: each node keeps a mailbox, answers through it, and READs
    /// its own transfers' answers from the target's (each READ takes a message delay).
    pub(crate) one_way: bool,
    /// Probability that the shell gathers a one-chunk WRITE into its WANT (see
    /// `Endpoint::submit_write`), two way or one way.
    pub(crate) inline_p: f64,
    /// Every KEEP is lost: a write in flight longer than half the request timeout then finds
    /// its flow reclaimed, and must land in a quarantined region (counted in
    /// [`Sim::quarantine_hits`]), never in one its receiver has granted since.
    pub(crate) drop_keeps: bool,
    /// Arenas per node: the first from the config, the others added with the same geometry.
    /// Each transfer stages in a random one of its initiator's and bounces through a random
    /// one of its target's (as a shell picks them by memory place).
    pub(crate) arenas: usize,
}

impl Default for Knobs {
    fn default() -> Self {
        Self {
            msg_delay: (Duration::from_micros(1), Duration::from_micros(40)),
            fifo: true,
            job_delay: (Duration::from_micros(1), Duration::from_micros(30)),
            drop_p: 0.0,
            job_fail_p: 0.0,
            clear_direct_p: 0.25,
            one_way: false,
            inline_p: 0.5,
            drop_keeps: false,
            arenas: 1,
        }
    }
}

/// An engine configuration for simulations: small arena, 256 B granules, 2 KiB chunks, 10 ms
/// timeout; a chunk of two or more scatter runs sends them ahead in a PLAN, one of a single run
/// in its DATA, so both paths run.
pub(crate) fn sim_config(arena: u64, window: u32, eager: bool) -> Config {
    let c = Config {
        arena_size: arena,
        arena_granularity: 256,
        max_chunk_size: 2048,
        max_inflight_chunks: window,
        eager_gather: eager,
        request_timeout: Duration::from_millis(10),
        plan_ahead_runs: 2,
        ..Config::default()
    };
    c.validate().expect("simulation config is valid");
    c
}

/// Arena `id`'s bytes of a node: the first arena, or one of the others (by id - 1). Over the
/// fields, so a copy can borrow user memory beside it.
fn arena_of<'a>(first: &'a mut [u8], extra: &'a mut [Vec<u8>], id: ArenaId) -> &'a mut [u8] {
    match id.0 {
        0 => first,
        k => &mut extra[usize::from(k) - 1],
    }
}

/// One simulated engine.
pub(crate) struct Node {
    /// The protocol endpoint.
    pub(crate) ep: Endpoint,
    /// The first arena's bytes (with the mailbox and fetch area behind its scheduled part).
    pub(crate) arena: Vec<u8>,
    /// The bytes of the arenas after the first, by id - 1.
    extra: Vec<Vec<u8>>,
    /// User memory at [`MEM_BASE`]; grows as transfers are added.
    pub(crate) mem: Vec<u8>,
    /// What `mem` held before the simulation ran.
    initial: Vec<u8>,
    /// False once killed.
    pub(crate) alive: bool,
    /// Outcome of each transfer this node submitted.
    pub(crate) outcomes: BTreeMap<XferId, Result<(), XferError>>,
}

impl Node {
    /// Carries out a gather (`to_arena`) or scatter job's runs between user memory and the
    /// arena; a failing job (`!ok`) copies only every other run, as a copy that broke midway.
    fn copy_runs(&mut self, (id, region): (ArenaId, Region), runs: &[CopyRun], ok: bool, to_arena: bool) {
        for (i, r) in runs.iter().enumerate() {
            if !ok && i % 2 == 1 {
                continue;
            }
            for (off, addr, len) in r.copies() {
                let at = (region.offset + off) as usize;
                let user = (addr - MEM_BASE) as usize;
                let arena = arena_of(&mut self.arena, &mut self.extra, id);
                let (arena, mem) = (&mut arena[at..at + len as usize], &mut self.mem[user..user + len as usize]);
                if to_arena {
                    arena.copy_from_slice(mem);
                } else {
                    mem.copy_from_slice(arena);
                }
            }
        }
    }

    /// Arena `id`'s bytes.
    pub(crate) fn arena_bytes(&mut self, id: ArenaId) -> &mut [u8] {
        arena_of(&mut self.arena, &mut self.extra, id)
    }

    /// Takes `len` fresh bytes of user memory (sources and destinations interleave; no two
    /// transfers share a byte).
    fn alloc(&mut self, node: usize, len: u64) -> u64 {
        let at = self.mem.len() as u64;
        let bytes: Vec<u8> = (at..at + len).map(|a| pattern(node, a)).collect();
        self.mem.extend_from_slice(&bytes);
        self.initial.extend_from_slice(&bytes);
        at
    }
}

/// A transfer the simulation submits.
#[derive(Debug, Clone)]
pub(crate) struct XferSpec {
    /// Sending node.
    pub(crate) from: usize,
    /// Receiving node.
    pub(crate) to: usize,
    /// Its id (unique per sender).
    pub(crate) xfer: XferId,
    /// Descriptors: `src` in the sender's memory, `dst` in the receiver's.
    pub(crate) descs: Vec<DescPair>,
    /// Chunks of its plan.
    pub(crate) chunks: usize,
    /// A READ: `to` initiates it and pulls from `from` (the bytes still go `from` -> `to`).
    pub(crate) read: bool,
    /// The initiator's arena it stages in and the target's it bounces through; `None`: drawn
    /// at submit (with [`Knobs::arenas`] above 1).
    pub(crate) arenas: Option<(ArenaId, ArenaId)>,
}

impl XferSpec {
    /// The node that submitted it (and gets its outcome).
    pub(crate) fn initiator(&self) -> usize {
        if self.read { self.to } else { self.from }
    }

    /// The node at the other end.
    pub(crate) fn target(&self) -> usize {
        if self.read { self.from } else { self.to }
    }
}

#[derive(Debug)]
enum Ev {
    Deliver {
        from: usize,
        to: usize,
        frame: Vec<u8>,
    },
    Gather {
        node: usize,
        job: JobId,
        xfer: XferId,
        arena: ArenaId,
        region: Region,
        runs: JobRuns,
    },
    Write {
        node: usize,
        job: JobId,
        xfer: XferId,
        peer: usize,
        source: WriteSource,
        arena: ArenaId,
        remote_arena: ArenaId,
        remote: Region,
        len: u64,
    },
    Scatter {
        node: usize,
        job: JobId,
        peer: usize,
        xfer: XferId,
        arena: ArenaId,
        region: Region,
        runs: Vec<CopyRun>,
        in_region: Option<InRegionPlan>,
        inline: Option<Vec<u8>>,
    },
    Submit {
        spec: usize,
    },
    Cancel {
        node: usize,
        xfer: XferId,
    },
    Kill {
        node: usize,
    },
    /// A READ transfer's RDMA read of the target's ready region completes.
    Read {
        node: usize,
        job: JobId,
        xfer: XferId,
        peer: usize,
        remote_arena: ArenaId,
        remote: Region,
        arena: ArenaId,
        local: Region,
        len: u64,
    },
    /// A one-way transfer's READ of its target's mailbox completes.
    Fetch {
        node: usize,
        xfer: XferId,
    },
}

/// A set of nodes, the network between them and the pending events.
pub(crate) struct Sim {
    /// The nodes; node `i` is `PeerId(i)` to the others.
    pub(crate) nodes: Vec<Node>,
    /// Every transfer, submitted or scheduled.
    pub(crate) specs: Vec<XferSpec>,
    /// Credits granted by node `to` to flow `(from, xfer)`: `(to, from, xfer) -> count`.
    pub(crate) granted: BTreeMap<(usize, usize, XferId), u64>,
    /// Transfers whose outcome must be an error: a job of theirs was failed by the harness,
    /// or the harness canceled them.
    pub(crate) tainted: BTreeSet<(usize, XferId)>,
    /// Simulated time elapsed.
    pub(crate) elapsed: Duration,
    /// Steps taken.
    pub(crate) steps: usize,
    knobs: Knobs,
    /// Each node's configuration (its arena, max chunk, ...).
    configs: Vec<Config>,
    start: Instant,
    rng: ChaCha8Rng,
    queue: BTreeMap<(Duration, u64), Ev>,
    seq: u64,
    /// Latest delivery time per channel, for FIFO channels.
    channel: BTreeMap<(usize, usize), Duration>,
    /// One-way transfers with a mailbox READ in flight.
    fetching: BTreeSet<(usize, XferId)>,
    /// Region plans gathered behind their chunk's data, and checked by a receiver.
    pub(crate) region_plans_written: u64,
    pub(crate) region_plans_checked: u64,
    /// Scatters of inline chunks (their bytes put in the region first).
    pub(crate) inline_scatters: u64,
    /// Writes that landed after their flow was reclaimed, in a region resting in quarantine
    /// ([`Knobs::drop_keeps`]).
    pub(crate) quarantine_hits: u64,
}

impl Sim {
    /// `n` nodes with configuration `config`, driven by `seed`. All user memory is registered.
    pub(crate) fn new(n: usize, config: &Config, knobs: Knobs, seed: u64) -> Self {
        Self::of(vec![config.clone(); n], knobs, seed)
    }

    /// A node of each configuration of `configs` (arenas and max chunks may differ, as
    /// capabilities allow), driven by `seed`. All user memory is registered.
    pub(crate) fn of(configs: Vec<Config>, knobs: Knobs, seed: u64) -> Self {
        let start = Instant::now();
        let n = configs.len();
        let nodes = (0..n)
            .map(|i| {
                let config = &configs[i];
                let mut ep = Endpoint::new(config, start, [i as u8 ^ 0x3c; 32]).unwrap();
                for k in 1..knobs.arenas {
                    let id = ep
                        .add_arena(config.arena_usable_capacity(), config.arena_granularity, config.max_chunk_size)
                        .unwrap();
                    assert_eq!(id, ArenaId(k as u8));
                }
                ep.set_local_endpoint(format!("node-{i}").into_bytes());
                // Frames reach the others under `agent(i)`: our proofs are bound to it.
                ep.set_local_name(&agent(i));
                ep.keep_mailbox(knobs.one_way);
                // All user memory, once per arena (registration `k` served by arena `k`): a
                // registration serves one arena, and transfers here go through any of them.
                for k in 0..knobs.arenas.max(1) {
                    ep.add_registered(RegId(k as u64), reg_key(i), (MEM_BASE, 1 << 40), ArenaId(k as u8));
                }
                // Every node loads every other's connection info, naming them in node order,
                // so the peer table numbers node `j` as `PeerId(j)`.
                for (j, theirs) in configs.iter().enumerate() {
                    assert_eq!(ep.peers_mut().id(&agent(j)), PeerId(j as u64));
                    if j != i {
                        // Node `j`'s metadata: its session is `j`, the one its frames carry.
                        let loaded = ep.handle_conn_info(
                            start,
                            &agent(j),
                            Some(caps(theirs, j as u64)),
                            Some(&caps(config, i as u64)),
                        );
                        assert_eq!(loaded, bounce_proto::peers::Loaded::Compatible);
                        // Each says HELLO to each, through the same frame path as the messages,
                        // and answers the ask it opens (a PING) as the peer's engine would.
                        ep.handle_frame(start, &agent(j), &wire::encode_hello(j as u64, 0)).expect("HELLO accepted");
                        let nonce = std::iter::from_fn(|| ep.poll_action())
                            .find_map(|a| match a {
                                Action::Link { body: wire::Body::Ping { nonce }, .. } => Some(nonce),
                                _ => None,
                            })
                            .expect("a HELLO is asked about");
                        let pong = wire::ControlFrame {
                            session: j as u64,
                            body: wire::Body::Pong { nonce, forget: bounce_proto::Token(0) },
                        };
                        ep.handle_frame(start, &agent(j), &pong.to_vec()).expect("PONG accepted");
                        assert!(ep.peers().is_reachable(&agent(j)));
                    }
                }
                Node {
                    ep,
                    // The scheduler's part, then the mailbox (and the fetch area, unused here).
                    arena: vec![0xEE; ep_arena_len(config)],
                    extra: vec![vec![0xEE; config.arena_usable_capacity() as usize]; knobs.arenas.saturating_sub(1)],
                    mem: Vec::new(),
                    initial: Vec::new(),
                    alive: true,
                    outcomes: BTreeMap::new(),
                }
            })
            .collect();
        Self {
            nodes,
            specs: Vec::new(),
            granted: BTreeMap::new(),
            tainted: BTreeSet::new(),
            elapsed: Duration::ZERO,
            steps: 0,
            knobs,
            configs,
            start,
            rng: ChaCha8Rng::seed_from_u64(seed),
            queue: BTreeMap::new(),
            seq: 0,
            channel: BTreeMap::new(),
            region_plans_written: 0,
            region_plans_checked: 0,
            inline_scatters: 0,
            quarantine_hits: 0,
            fetching: BTreeSet::new(),
        }
    }

    /// The simulation's RNG, for scenario choices.
    pub(crate) fn rng(&mut self) -> &mut ChaCha8Rng {
        &mut self.rng
    }

    /// Plans a transfer of about `bytes` payload bytes from `from` to `to` in random
    /// descriptors (dense, strided or scattered, sometimes shuffled, or read from one contiguous
    /// source buffer so that its chunks are direct) and schedules its submit at `at`. Returns
    /// its index in [`Sim::specs`].
    pub(crate) fn add_xfer(&mut self, from: usize, to: usize, bytes: u64, at: Duration) -> usize {
        // Unique across all nodes: a job's transfer id then names its initiator too.
        let xfer = XferId(self.specs.len() as u64 + 1);
        let style = self.rng.random_range(0..4);
        if style == 3 {
            return self.add_contiguous_xfer(from, to, xfer, bytes, at);
        }
        let mut lens = Vec::new();
        let mut total = 0;
        let fixed = self.rng.random_range(8..=600);
        while total < bytes {
            let len = match style {
                0 | 1 => fixed,
                _ => self.rng.random_range(1..=3000),
            };
            lens.push(len);
            total += len;
        }
        let (src_gap, dst_gap) = match style {
            0 => (0, 0),
            1 => (self.rng.random_range(0..64), self.rng.random_range(0..64)),
            _ => (u64::MAX, u64::MAX),
        };
        let mut descs = Vec::with_capacity(lens.len());
        for len in lens {
            let sg = if src_gap == u64::MAX { self.rng.random_range(0..200) } else { src_gap };
            let dg = if dst_gap == u64::MAX { self.rng.random_range(0..200) } else { dst_gap };
            let src = self.nodes[from].alloc(from, len + sg);
            let dst = self.nodes[to].alloc(to, len + dg);
            descs.push(DescPair { src: MEM_BASE + src + sg, dst: MEM_BASE + dst + dg, len });
        }
        if style == 2 && self.rng.random_bool(0.5) {
            // Destinations out of order: planning keeps input order, so runs jump around.
            for i in (1..descs.len()).rev() {
                let j = self.rng.random_range(0..=i);
                descs.swap(i, j);
            }
        }
        self.push_spec(XferSpec { from, to, xfer, descs, chunks: 0, read: false, arenas: None }, at)
    }

    /// As [`Sim::add_xfer`], as a READ: node `to` pulls the bytes from node `from`.
    pub(crate) fn add_read(&mut self, from: usize, to: usize, bytes: u64, at: Duration) -> usize {
        let spec = self.add_xfer(from, to, bytes, at);
        self.specs[spec].read = true;
        spec
    }

    /// The node that initiated transfer `xfer` (ids are unique across nodes).
    /// Whether `node`'s write into (or READ of, `what`) `peer`'s region `remote` for `xfer`
    /// succeeds: not when the peer is dead or a drawn job failure hits (which taints the
    /// transfer); `None` when `node` itself is dead. Asserts first that a live peer's flow still
    /// holds the region, or, with [`Knobs::drop_keeps`], that it rests in quarantine.
    fn remote_job(
        &mut self,
        node: usize,
        xfer: XferId,
        peer: usize,
        (arena, remote): (ArenaId, Region),
        what: &str,
    ) -> Option<bool> {
        if !self.nodes[node].alive {
            return None;
        }
        let mut ok = self.nodes[peer].alive;
        if ok && self.rng.random_bool(self.knobs.job_fail_p) {
            ok = false;
            self.tainted.insert((node, xfer));
        }
        if self.nodes[peer].alive {
            let ep = &self.nodes[peer].ep;
            let sched = ep.schedulers().get(arena);
            let held_by = |xfer| sched.is_held(FlowKey { peer: PeerId(node as u64), xfer }, remote.offset);
            // A chunk 0 written into a standing credit may land before its claim is taken:
            // the region is then still the sender's standing flow's.
            let standing = ep.receiver().standing_flow(PeerId(node as u64)).and_then(held_by);
            let held = held_by(xfer).or(standing);
            if held.is_none() && self.knobs.drop_keeps && sched.quarantined_at(remote.offset) == Some(remote) {
                self.quarantine_hits += 1;
                return Some(ok);
            }
            assert!(
                held.is_some_and(|g| g.region == remote),
                "node {node} xfer {xfer:?}: {what} {remote} of node {peer}, which the flow no longer holds"
            );
        }
        Some(ok)
    }

    fn initiator_of(&self, xfer: XferId) -> usize {
        self.specs.iter().find(|s| s.xfer == xfer).map_or(0, XferSpec::initiator)
    }

    /// A transfer whose sources are consecutive slices of one buffer, each a multiple of the
    /// plan alignment long: every chunk's source is laid out exactly as its region, so every
    /// chunk is planned direct. Destinations are scattered.
    fn add_contiguous_xfer(&mut self, from: usize, to: usize, xfer: XferId, bytes: u64, at: Duration) -> usize {
        let align = PlanParams::from_config(&self.configs[from]).align;
        let mut lens = Vec::new();
        let mut total = 0;
        while total < bytes {
            // Up to 80 slots: some descriptors exceed a chunk and are split.
            let len = align * self.rng.random_range(1..=80);
            lens.push(len);
            total += len;
        }
        let mut src = MEM_BASE + self.nodes[from].alloc(from, total);
        let mut descs = Vec::with_capacity(lens.len());
        for len in lens {
            let gap = self.rng.random_range(0..200);
            let dst = MEM_BASE + self.nodes[to].alloc(to, len + gap) + gap;
            descs.push(DescPair { src, dst, len });
            src += len;
        }
        let spec = self.push_spec(XferSpec { from, to, xfer, descs, chunks: 0, read: false, arenas: None }, at);
        let p = plan::plan(&self.specs[spec].descs, self.params(&self.specs[spec])).unwrap();
        // A chunk carrying its plan is staged (the plan goes behind the data).
        assert!(
            p.chunks.iter().all(|c| c.direct.is_some() || c.region_plan.is_some()),
            "contiguous sources plan direct"
        );
        spec
    }

    /// How a transfer is planned, as the shell does: by its initiator's configuration, in chunks
    /// of the smaller max chunk of the two nodes (`Capabilities::chunk_with`); a READ never
    /// carries its plan in a region (its initiator scatters by its own runs).
    fn params(&self, spec: &XferSpec) -> PlanParams {
        let (mine, theirs) = (&self.configs[spec.initiator()], &self.configs[spec.target()]);
        let p = PlanParams::from_config(mine);
        let chunk = caps(mine, 0).chunk_with(&caps(theirs, 0));
        PlanParams { max_chunk: chunk, region_plan_runs: if spec.read { 0 } else { p.region_plan_runs }, ..p }
    }

    fn push_spec(&mut self, mut spec: XferSpec, at: Duration) -> usize {
        spec.chunks = plan::plan(&spec.descs, self.params(&spec)).unwrap().chunks.len();
        self.specs.push(spec);
        let spec = self.specs.len() - 1;
        self.schedule(at, Ev::Submit { spec });
        spec
    }

    /// Cancels `xfer` of `node` at `at` (if it is still in flight then).
    pub(crate) fn cancel_at(&mut self, node: usize, xfer: XferId, at: Duration) {
        self.schedule(at, Ev::Cancel { node, xfer });
    }

    /// Kills `node` at `at`; the survivors are told through `handle_peer_lost`.
    pub(crate) fn kill_at(&mut self, node: usize, at: Duration) {
        self.schedule(at, Ev::Kill { node });
    }

    /// Runs the next event or timer, then every action it caused, then checks the invariants.
    /// False when nothing is left to do.
    pub(crate) fn step(&mut self) -> bool {
        let next_event = self.queue.first_key_value().map(|(k, _)| k.0);
        let next_timer =
            self.nodes.iter().filter(|n| n.alive).filter_map(|n| n.ep.poll_timeout()).min().map(|t| t - self.start);
        match (next_event, next_timer) {
            (None, None) => return false,
            (Some(e), Some(t)) if t < e => self.fire_timers(t),
            (None, Some(t)) => self.fire_timers(t),
            _ => {
                let ((at, _), ev) = self.queue.pop_first().unwrap();
                self.elapsed = self.elapsed.max(at);
                self.handle(ev);
            }
        }
        self.drain();
        self.post_fetches();
        self.steps += 1;
        for (i, n) in self.nodes.iter().enumerate().filter(|(_, n)| n.alive) {
            let scheds = n.ep.schedulers().iter().map(|(_, s)| s.check_invariants()).collect::<Result<Vec<_>, _>>();
            if let Err(e) = scheds.map(drop).and_then(|()| n.ep.receiver().check_invariants()) {
                panic!("node {i} after step {}: {e}", self.steps);
            }
        }
        true
    }

    /// Steps until nothing is left, at most `max` steps.
    pub(crate) fn drive_bounded(&mut self, max: usize) {
        while self.step() {
            assert!(self.steps <= max, "no quiescence after {max} steps ({:?} simulated)", self.elapsed);
        }
    }

    /// Steps until nothing is left (bounded by a generous step budget).
    pub(crate) fn drive(&mut self) {
        self.drive_bounded(2_000_000);
    }

    /// Checks the settled state: every transfer of a live sender completed exactly once (the
    /// harness asserts "once" as outcomes arrive), tainted ones failed, successful ones
    /// delivered every byte, and no byte outside the destinations of transfers into a node
    /// ever changed; every live endpoint is idle with its whole arena free.
    pub(crate) fn check_settled(&self) {
        for (i, n) in self.nodes.iter().enumerate().filter(|(_, n)| n.alive) {
            assert!(
                n.ep.is_idle(),
                "node {i} not idle: {} xfers, {} jobs",
                n.ep.in_flight_xfers(),
                n.ep.jobs_in_flight()
            );
            for (id, sched) in n.ep.schedulers().iter() {
                let capacity = self.configs[i].arena_usable_capacity();
                assert_eq!(sched.free_bytes(), capacity, "node {i} leaks space of arena {}", id.0);
            }
            assert_eq!(n.ep.poll_timeout(), None, "node {i} still has timers");
            assert_eq!(n.ep.stats().protocol_errors, 0, "node {i} saw protocol errors from honest peers");
            if self.nodes.iter().all(|n| n.alive) {
                assert_eq!(n.ep.stats().frames_refused, 0, "node {i} refused frames of live honest peers");
            }
        }
        // Destination bytes owned by each node's incoming transfers.
        let mut owned: Vec<BTreeMap<u64, (u64, usize)>> = vec![BTreeMap::new(); self.nodes.len()];
        for (k, s) in self.specs.iter().enumerate() {
            for d in s.descs.iter().filter(|d| d.len > 0) {
                owned[s.to].insert(d.dst - MEM_BASE, (d.len, k));
            }
        }
        for s in &self.specs {
            let sender = &self.nodes[s.initiator()];
            if !sender.alive {
                continue;
            }
            let outcome = sender.outcomes.get(&s.xfer);
            assert!(outcome.is_some(), "node {} xfer {:?} never completed", s.initiator(), s.xfer);
            if self.tainted.contains(&(s.initiator(), s.xfer)) {
                assert!(
                    outcome.unwrap().is_err(),
                    "node {} xfer {:?} reported Ok despite a failure",
                    s.initiator(),
                    s.xfer
                );
            }
        }
        for (i, n) in self.nodes.iter().enumerate() {
            if !n.alive {
                continue;
            }
            let mut a = 0usize;
            for (&start, &(len, k)) in &owned[i] {
                let (start, len) = (start as usize, len as usize);
                assert!(n.mem[a..start] == n.initial[a..start], "node {i}: bytes in {a:#x}..{start:#x} changed");
                let s = &self.specs[k];
                if self.nodes[s.initiator()].outcomes.get(&s.xfer).is_some_and(|o| o.is_ok()) {
                    let d = s.descs.iter().find(|d| (d.dst - MEM_BASE) as usize == start).unwrap();
                    let src = &self.nodes[s.from].mem[(d.src - MEM_BASE) as usize..][..len];
                    assert!(
                        src == &n.mem[start..start + len],
                        "node {i}: xfer {:?} from {} delivered wrong bytes at {start:#x}",
                        s.xfer,
                        s.from
                    );
                }
                a = start + len;
            }
            assert!(n.mem[a..] == n.initial[a..], "node {i}: bytes after {a:#x} changed");
        }
    }

    /// Starts a mailbox READ for every one-way transfer of a live node that has none in flight.
    fn post_fetches(&mut self) {
        if !self.knobs.one_way {
            return;
        }
        for i in 0..self.nodes.len() {
            if !self.nodes[i].alive {
                continue;
            }
            let xfers: Vec<XferId> = self.nodes[i].ep.one_way_xfers().collect();
            for xfer in xfers {
                if self.fetching.insert((i, xfer)) {
                    let at = self.elapsed + self.delay(self.knobs.msg_delay);
                    self.schedule(at, Ev::Fetch { node: i, xfer });
                }
            }
        }
    }

    fn schedule(&mut self, at: Duration, ev: Ev) {
        self.seq += 1;
        self.queue.insert((at, self.seq), ev);
    }

    fn delay(&mut self, (lo, hi): (Duration, Duration)) -> Duration {
        let ns = self.rng.random_range(lo.as_nanos() as u64..=hi.as_nanos() as u64);
        Duration::from_nanos(ns)
    }

    fn fire_timers(&mut self, t: Duration) {
        self.elapsed = self.elapsed.max(t);
        let now = self.start + self.elapsed;
        for n in self.nodes.iter_mut().filter(|n| n.alive) {
            if n.ep.poll_timeout().is_some_and(|d| d <= now) {
                n.ep.handle_timeout(now);
            }
        }
    }

    fn handle(&mut self, ev: Ev) {
        let now = self.start + self.elapsed;
        match ev {
            Ev::Deliver { from, to, frame } => {
                if !self.nodes[to].alive {
                    return;
                }
                let decoded = wire::ControlFrame::decode(&frame).expect("our frames decode");
                assert_eq!(decoded.session, from as u64);
                // The raw bytes go through the peer rules (session, loaded peers) as in the shell.
                match self.nodes[to].ep.handle_frame(now, &agent(from), &frame) {
                    Ok(()) => {}
                    // Frames of a killed node still in flight: it is no longer loaded.
                    Err(FrameRefused::NotLoaded) if !self.nodes[from].alive => {}
                    Err(e) => panic!("node {to}: honest frame from {from} refused: {e}"),
                }
            }
            Ev::Gather { node, job, xfer, arena, region, runs } => {
                if !self.nodes[node].alive {
                    return;
                }
                let ok = !self.rng.random_bool(self.knobs.job_fail_p);
                self.nodes[node].copy_runs((arena, region), runs.runs(), ok, true);
                if let (true, Some((off, scatter))) = (ok, runs.region_plan()) {
                    // The chunk's scatter runs behind its data, where the receiver reads them.
                    let bytes = region_plan::encoded(scatter).expect("an honest plan encodes");
                    let at = (region.offset + off) as usize;
                    assert!(off + bytes.len() as u64 <= region.len, "the region plan leaves its region");
                    self.nodes[node].arena_bytes(arena)[at..at + bytes.len()].copy_from_slice(&bytes);
                    self.region_plans_written += 1;
                }
                if !ok {
                    // Our own staging, or a READ target's gather: its initiator must fail.
                    self.tainted.insert((self.initiator_of(xfer), xfer));
                }
                self.nodes[node].ep.handle_gather_done(now, job, ok);
            }
            Ev::Write { node, job, xfer, peer, source, arena, remote_arena, remote, len } => {
                // The receiver must still hold the region for this flow, unscattered: a cancel or
                // reclaim that freed it first would let it be granted elsewhere.
                let Some(ok) = self.remote_job(node, xfer, peer, (remote_arena, remote), "write into") else { return };
                if self.nodes[peer].alive {
                    // A failed write may still have landed in part.
                    let copied = if ok { len } else { len / 2 };
                    let n = &mut self.nodes[node];
                    let src = match source {
                        WriteSource::Arena(local) => {
                            n.arena_bytes(arena)[local.offset as usize..][..copied as usize].to_vec()
                        }
                        WriteSource::User { addr } => n.mem[(addr - MEM_BASE) as usize..][..copied as usize].to_vec(),
                    };
                    self.nodes[peer].arena_bytes(remote_arena)[remote.offset as usize..][..copied as usize]
                        .copy_from_slice(&src);
                }
                self.nodes[node].ep.handle_write_done(now, job, ok);
            }
            Ev::Scatter { node, job, peer, xfer, arena, region, mut runs, in_region, inline } => {
                if !self.nodes[node].alive {
                    return;
                }
                if let Some(bytes) = inline {
                    // What the shell does first with an inline chunk: put it in its region.
                    assert!(bytes.len() as u64 <= region.len, "inline bytes beyond their region");
                    self.nodes[node].arena_bytes(arena)[region.offset as usize..][..bytes.len()]
                        .copy_from_slice(&bytes);
                    self.inline_scatters += 1;
                }
                if let Some(p) = in_region {
                    // What a copy engine does: copy the plan out of the arena, check that copy.
                    assert!(runs.is_empty());
                    let at = (region.offset + p.offset) as usize;
                    let bytes =
                        self.nodes[node].arena_bytes(arena)[at..at + region_plan::plan_bytes(p.runs) as usize].to_vec();
                    let checked = region_plan::check(&bytes, p.runs, p.offset, |a, b| p.allowed.covers(a, b));
                    // Honest peers only here: their plans always pass.
                    runs = checked.unwrap_or_else(|e| panic!("node {node}: an honest region plan was refused: {e}"));
                    self.region_plans_checked += 1;
                }
                let ok = !self.rng.random_bool(self.knobs.job_fail_p);
                self.nodes[node].copy_runs((arena, region), &runs, ok, false);
                if !ok {
                    // A WRITE's scatter at its receiver (`peer` sent it), or a READ's at its
                    // initiator: either way the initiator must fail.
                    debug_assert!(peer < self.nodes.len());
                    self.tainted.insert((self.initiator_of(xfer), xfer));
                }
                self.nodes[node].ep.handle_scatter_done(now, job, ok);
            }
            Ev::Submit { spec } => {
                let s = &self.specs[spec];
                if !self.nodes[s.initiator()].alive {
                    return;
                }
                let mut plan = plan::plan(&s.descs, self.params(s)).unwrap();
                let (from, to, xfer) = (s.initiator(), s.target(), s.xfer);
                if let Some((local, peer)) = s.arenas {
                    (plan.local_arena, plan.peer_arena) = (local, peer);
                } else if self.knobs.arenas > 1 {
                    // As a shell picks them from the memory places of the two sides.
                    plan.local_arena = ArenaId(self.rng.random_range(0..self.knobs.arenas) as u8);
                    plan.peer_arena = ArenaId(self.rng.random_range(0..self.knobs.arenas) as u8);
                }
                if s.read {
                    // The initiator holds the target's registration metadata (its sources).
                    plan.read = true;
                    plan.dests = vec![Destination { reg: RegId(u64::from(plan.peer_arena.0)), key: reg_key(to) }];
                    let token = Token(self.rng.random());
                    let layout = self.knobs.one_way.then(|| {
                        let m = self.nodes[to].ep.one_way_layout().mailbox;
                        MailboxLayout { slots: m.slots, ring: m.ring }
                    });
                    self.nodes[from].ep.submit_read(now, xfer, token, PeerId(to as u64), plan, layout).expect("submit");
                    if !self.nodes[to].alive {
                        self.nodes[from].ep.handle_peer_lost(now, PeerId(to as u64));
                    }
                    return;
                }
                for c in &mut plan.chunks {
                    if c.direct.is_some() && self.rng.random_bool(self.knobs.clear_direct_p) {
                        c.direct = None;
                    }
                }
                let token = Token(self.rng.random());
                // The sender holds the destination node's registration metadata.
                plan.dests = vec![Destination { reg: RegId(u64::from(plan.peer_arena.0)), key: reg_key(to) }];
                let mailbox = self.knobs.one_way.then(|| {
                    let m = self.nodes[to].ep.one_way_layout().mailbox;
                    MailboxLayout { slots: m.slots, ring: m.ring }
                });
                // The shell's gather of a one-chunk WRITE, into the bytes its WANT carries.
                let inline = (plan.chunks.len() == 1 && self.rng.random_bool(self.knobs.inline_p)).then(|| {
                    let c = &plan.chunks[0];
                    let mut bytes = vec![0u8; c.bytes as usize];
                    for r in c.gather.iter() {
                        for (off, addr, len) in r.copies() {
                            let user = (addr - MEM_BASE) as usize;
                            bytes[off as usize..][..len as usize]
                                .copy_from_slice(&self.nodes[from].mem[user..user + len as usize]);
                        }
                    }
                    bytes
                });
                let route = WriteRoute { mailbox, inline, ..WriteRoute::default() };
                self.nodes[from].ep.submit_write(now, xfer, token, PeerId(to as u64), plan, route).expect("submit");
                if !self.nodes[to].alive {
                    // The shell would not route to a lost peer; tell the endpoint again.
                    self.nodes[from].ep.handle_peer_lost(now, PeerId(to as u64));
                }
            }
            Ev::Cancel { node, xfer } => {
                let n = &mut self.nodes[node];
                if n.alive && !n.outcomes.contains_key(&xfer) && n.ep.sender().acked_chunks(xfer).is_some() {
                    self.tainted.insert((node, xfer));
                    n.ep.cancel(now, xfer);
                }
            }
            Ev::Read { node, job, xfer, peer, remote_arena, remote, arena, local, len } => {
                // The target must still hold the region for this flow, gathered and idle: a
                // reclaim that freed it first would let another flow's bytes be read.
                let Some(ok) = self.remote_job(node, xfer, peer, (remote_arena, remote), "READ of") else { return };
                if self.nodes[peer].alive {
                    let copied = if ok { len } else { len / 2 };
                    let src = self.nodes[peer].arena_bytes(remote_arena)[remote.offset as usize..][..copied as usize]
                        .to_vec();
                    self.nodes[node].arena_bytes(arena)[local.offset as usize..][..copied as usize]
                        .copy_from_slice(&src);
                }
                self.nodes[node].ep.handle_read_done(now, job, ok);
            }
            Ev::Fetch { node, xfer } => {
                self.fetching.remove(&(node, xfer));
                if !self.nodes[node].alive {
                    return;
                }
                let Some(f) = self.nodes[node].ep.fetch(xfer) else { return };
                let target = f.peer.0 as usize;
                if !self.nodes[target].alive {
                    // The READ fails: the target is gone.
                    self.nodes[node].ep.handle_fetch_failed(now, xfer);
                    return;
                }
                let base = self.nodes[target].ep.one_way_layout().mailbox.offset as usize;
                let arena = &self.nodes[target].arena;
                let image: Vec<u8> = f
                    .regions
                    .iter()
                    .flat_map(|r| &arena[base + r.offset as usize..][..r.len as usize])
                    .copied()
                    .collect();
                self.nodes[node].ep.handle_fetched(now, xfer, &image);
            }
            Ev::Kill { node } => {
                if !self.nodes[node].alive {
                    return;
                }
                self.nodes[node].alive = false;
                for (i, n) in self.nodes.iter_mut().enumerate() {
                    if i != node && n.alive {
                        n.ep.handle_agent_lost(now, &agent(node));
                    }
                }
            }
        }
    }

    /// Performs every queued action of every live node until none is left.
    fn drain(&mut self) {
        loop {
            let mut any = false;
            for i in 0..self.nodes.len() {
                if !self.nodes[i].alive {
                    continue;
                }
                while let Some(a) = self.nodes[i].ep.poll_action() {
                    any = true;
                    self.perform(i, a);
                }
            }
            if !any {
                return;
            }
        }
    }

    /// Puts `frame` from `me` on the wire to `to`: maybe lost, delayed, FIFO per channel.
    fn post(&mut self, me: usize, to: usize, frame: Vec<u8>) {
        if self.rng.random_bool(self.knobs.drop_p) {
            return;
        }
        let mut at = self.elapsed + self.delay(self.knobs.msg_delay);
        if self.knobs.fifo {
            let last = self.channel.entry((me, to)).or_default();
            at = at.max(*last);
            *last = at;
        }
        self.schedule(at, Ev::Deliver { from: me, to, frame });
    }

    fn perform(&mut self, me: usize, a: Action) {
        match a {
            Action::Send { peer, msg } => {
                let to = peer.0 as usize;
                if self.knobs.drop_keeps && matches!(msg, Msg::Keep(_)) {
                    return;
                }
                if let Msg::Grant(g) = &msg {
                    *self.granted.entry((me, to, g.xfer)).or_default() += g.credits.len() as u64;
                }
                msg.validate().expect("endpoints build valid messages");
                self.post(me, to, Frame { session: me as u64, msg }.to_vec());
            }
            Action::Read { job, xfer, peer, remote_arena, remote, arena, local, len } => {
                assert!(len <= remote.len && len <= local.len);
                let at = self.elapsed + self.delay(self.knobs.job_delay);
                let peer = peer.0 as usize;
                self.schedule(at, Ev::Read { node: me, job, xfer, peer, remote_arena, remote, arena, local, len });
            }
            Action::PutRecord { offset, bytes } => {
                assert!(self.knobs.one_way, "only one-way nodes keep a mailbox");
                self.nodes[me].arena[offset as usize..][..bytes.len()].copy_from_slice(&bytes);
            }
            // The liveness probe's PING and PONG travel like any frame.
            Action::Link { peer, body } => {
                self.post(me, peer.0 as usize, wire::ControlFrame { session: me as u64, body }.to_vec());
            }
            Action::Gather { job, xfer, arena, region, runs } => {
                let at = self.elapsed + self.delay(self.knobs.job_delay);
                self.schedule(at, Ev::Gather { node: me, job, xfer, arena, region, runs });
            }
            Action::Write { job, xfer, peer, source, arena, remote_arena, remote, len } => {
                assert!(len <= remote.len);
                match source {
                    WriteSource::Arena(local) => assert!(len <= local.len),
                    WriteSource::User { addr } => {
                        // A direct write reads exactly one chunk of this transfer's sources.
                        let s = self.specs.iter().find(|s| s.initiator() == me && s.xfer == xfer).unwrap();
                        let inside = |d: &DescPair| d.src <= addr && addr < d.src + d.len;
                        let first = s.descs.iter().position(inside).expect("direct source inside the transfer");
                        let mut end = addr;
                        for d in &s.descs[first..] {
                            if d.src > end || end >= addr + len {
                                break;
                            }
                            end = end.max(d.src + d.len);
                        }
                        assert!(end >= addr + len, "node {me}: direct write {addr:#x}+{len} reads past the sources");
                    }
                }
                let at = self.elapsed + self.delay(self.knobs.job_delay);
                let peer = peer.0 as usize;
                self.schedule(at, Ev::Write { node: me, job, xfer, peer, source, arena, remote_arena, remote, len });
            }
            Action::Scatter { job, peer, xfer, arena, region, runs, in_region, inline } => {
                let at = self.elapsed + self.delay(self.knobs.job_delay);
                self.schedule(
                    at,
                    Ev::Scatter {
                        node: me,
                        job,
                        peer: peer.0 as usize,
                        xfer,
                        arena,
                        region,
                        runs: runs.runs().to_vec(),
                        in_region,
                        inline,
                    },
                );
            }
            Action::Complete { xfer, outcome } => {
                let prev = self.nodes[me].outcomes.insert(xfer, outcome);
                assert!(prev.is_none(), "node {me}: xfer {xfer:?} completed twice");
                assert!(
                    self.specs.iter().any(|s| s.initiator() == me && s.xfer == xfer),
                    "node {me}: unknown xfer {xfer:?}"
                );
            }
        }
    }
}

/// The initial byte at offset `a` of node `node`'s memory.
pub(crate) fn pattern(node: usize, a: u64) -> u8 {
    (a.wrapping_mul(131) ^ (a >> 7) ^ (node as u64 * 29)) as u8
}

/// The arena a node of `config` maps: the scheduler's part, the mailbox and the fetch area.
fn ep_arena_len(config: &Config) -> usize {
    bounce_proto::oneway::OneWayLayout::for_config(config).arena_len as usize
}

/// The capabilities a node of `config` publishes with instance nonce `session`.
fn caps(config: &Config, session: u64) -> wire::Capabilities {
    wire::Capabilities::host_arena(config.arena_usable_capacity(), config.max_chunk_size, session)
}

/// The key of node `i`'s one registration (its user memory), as its metadata would carry it.
fn reg_key(i: usize) -> RegKey {
    RegKey([i as u8 ^ 0xa5; 32])
}
