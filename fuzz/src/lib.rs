//! Operation-sequence fuzzing of the whole sans-IO endpoint (sender + receiver + scheduler):
//! arbitrary peer messages (well-formed or not) interleaved with real submits, job completions
//! in any order, cancels, peer losses and clock jumps. Shared by the `endpoint_ops` cargo-fuzz
//! target and a stable test that runs it over seeded random inputs.
//!
//! Besides arbitrary messages, an honest-looking remote sender announces transfers and writes
//! DATA for the regions this endpoint granted it, with destinations that sometimes stray
//! outside the registered memory. A forger sends valid-looking frames that name live
//! transfers and flows (right transfer id, chunk and region) but carry a wrong token, or come
//! with a session other than the one in the peer's loaded capabilities; each must be refused,
//! counted in `control_forged`, and change nothing at all.
//!
//! Checked after every step: no panic, the arena's conservation invariants, the receiver's
//! per-peer totals, at most one `Complete` per transfer, and the safety property that matters
//! most: every scatter job copies out of its own region only, into registered memory only. At the end, after shutdown and every outstanding job's completion:
//! the whole arena is free again.

pub mod buddy_ops;

/// Deterministic pseudo-random fuzz inputs for the stable tests: `count` byte strings whose
/// lengths come from `len_of(i)`, from an xorshift generator seeded with `seed`.
pub fn seeded_inputs(seed: u64, count: usize, len_of: impl Fn(usize) -> usize) -> impl Iterator<Item = Vec<u8>> {
    let mut state = seed;
    (0..count).map(move |i| {
        (0..len_of(i))
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state >> 24) as u8
            })
            .collect()
    })
}

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use arbitrary::Unstructured;
use bounce_proto::config::Config;
use bounce_proto::endpoint::{Action, Endpoint, JobId, ProtocolError, WriteSource};
use bounce_proto::mailbox::{Answer, MailboxLayout, RECORD_LEN, Record, RecordKey, Seq, candidates};
use bounce_proto::oneway;
use bounce_proto::peers::FrameRefused;
use bounce_proto::plan::{DescPair, PlanParams, plan};
use bounce_proto::proof;
use bounce_proto::sender::STANDING_XFER_BIT;
use bounce_proto::wire::{
    Ack, AckStatus, Capabilities, Credit, Data, Frame, Grant, Keep, Msg, Plan, Pull, PullChunk, Release, Standing, Want,
};
use bounce_proto::{ArenaId, ChunkIdx, CopyRun, FlowKey, PeerId, RegId, RegKey, Region, Token, XferId};

/// One thing that can happen to an endpoint.
#[derive(Debug)]
pub enum Op {
    /// A control message from peer `from % 3` (anything a decoder could produce).
    Msg { from: u8, msg: Msg },
    /// The application submits a transfer of `descs` pieces of `size` bytes to `peer % 3`.
    Submit { peer: u8, descs: u8, size: u16, packed: bool },
    /// The job at `which` among the outstanding ones completes.
    Done { which: u8, ok: bool },
    /// The application cancels transfer `xfer`.
    Cancel { xfer: u8 },
    /// Peer `peer % 3` is lost.
    PeerLost { peer: u8 },
    /// Time passes.
    Tick { ms: u16 },
    /// Remote peer `from % 3` announces transfer `xfer` of `chunks % 4 + 1` chunks of
    /// `size % 16 KiB + 1` bytes each.
    RemoteWant { from: u8, xfer: u8, chunks: u8, size: u16 },
    /// The remote peer writes the credit at `which` among those granted to it and sends its
    /// DATA: one run of the chunk's bytes to `USER_BASE - 4 KiB + at % (USER_LEN + 8 KiB)`,
    /// so some destinations cross the registered range's edges; with `ahead`, a DATA naming
    /// no runs (they went ahead in a PLAN, or it is answered ACK(Replan)).
    RemoteData { which: u8, at: u32, ahead: bool },
    /// A remote sender's PLAN for chunk `chunk` of the announced flow at `which`: one run of
    /// the chunk's bytes to `USER_BASE - 4 KiB + at % (USER_LEN + 8 KiB)` (some stray and must
    /// be dropped, never scattered by a later DATA).
    RemotePlan { which: u8, chunk: u8, at: u32 },
    /// The remote receiver answers the DATA at `which` among those we sent: ACK(Scattered), or
    /// with `replan` ACK(Replan) (we must send the DATA again, with its runs).
    RemoteAck { which: u8, replan: bool },
    /// A forged frame aimed at live state: kind `kind % 7` (GRANT, ACK(Scattered) for one of
    /// our transfers; DATA for a granted region, cancel, WANT for a remote flow; a new WANT
    /// whose destination proof was made for another token; a KEEP for a granted flow) with the right ids and a token
    /// XORed with `flip | 1`, or, with `session`, the right token under a session XORed with
    /// `flip | 1`. It must be refused and change nothing.
    Forge { kind: u8, which: u8, flip: u128, session: bool },
    /// The application deregisters the user range (when registered) or registers it again
    /// under a new id and key (as the shell issues them). While it is deregistered no gather,
    /// scatter or direct write may touch it, and no transfer is submitted from it (the shell's
    /// gate needs the registration).
    Deregister,
    /// A remote sender's DATA for the credit at `which` with one strided run of hostile shape:
    /// `count` copies of `len % 64 KiB + 1` bytes, strides `region_stride` / `addr_stride`,
    /// starting at `USER_BASE + at % USER_LEN`. Whatever is accepted must copy no more than
    /// the chunk, inside its region and the registered range.
    HostileData { which: u8, len: u16, count: u32, region_stride: u32, addr_stride: u32, at: u32 },
    /// As [`Op::RemoteWant`], one way: the WANT asks for mailbox answers, which come out as
    /// record writes (the harness decodes them with the flow's token to learn its credits).
    OneWayWant { from: u8, xfer: u8, chunks: u8, size: u16 },
    /// A CURSOR for the one-way flow at `which` claiming `consumed` records read (honest or
    /// past what was written).
    Cursor { which: u8, consumed: u8 },
    /// The application submits a one-way transfer (as [`Op::Submit`]) to `peer % 3`, whose
    /// mailbox the harness plays.
    SubmitOneWay { peer: u8, descs: u8, size: u16 },
    /// A fetch of one of our one-way transfers returns: garbage, or the transfer's first record
    /// (a GRANT of `region` for `chunk`, or a FAIL) correctly keyed in the slot it locates,
    /// as a broken or hostile target could write it.
    Fetched { which: u8, garbage: bool, first: u8, chunk: u8, offset: u32, len: u32 },
    /// The application submits a READ of `descs` pieces of `size` bytes from `peer % 3`.
    SubmitRead { peer: u8, descs: u8, size: u16 },
    /// Remote peer `from % 3` PULLs `chunks % 4 + 1` chunks of `size % 16 KiB + 1` bytes, each
    /// gathered from `USER_BASE - 4 KiB + at % (USER_LEN + 8 KiB)` (some straddle the
    /// registered range's edges and must be refused).
    RemotePull { from: u8, xfer: u8, chunks: u8, size: u16, at: u32 },
    /// The remote READ initiator releases the ready region at `which` (or, with `wrong`, names
    /// another chunk than announced).
    RemoteRelease { which: u8, wrong: bool },
    /// The honest receiver grants chunk `chunk` of one of our WRITEs whose WANT went out
    /// (`which`), a region at `at` as long as the chunk: our write, and the chunk's PLAN, follow.
    RemoteGrant { which: u8, chunk: u8, at: u32 },
}

/// The agent name of peer `i`, whose loaded capabilities carry session `session_of(i)`.
fn agent(i: u64) -> String {
    format!("peer-{i}")
}

/// The first registration of (`USER_BASE`, `USER_LEN`) and the key its metadata carries; each
/// registration after a deregistration gets the next id and its own key.
const REG: RegId = RegId(1);
const KEY: RegKey = RegKey([0x3c; 32]);
/// The secret PING nonces derive from (the shell draws one at random per engine).
const PROBE_KEY: [u8; 32] = [0x5b; 32];

/// The key of registration `reg` (the first is [`KEY`]).
fn key_of(reg: RegId) -> RegKey {
    if reg == REG { KEY } else { RegKey([reg.0 as u8 ^ 0x5a; 32]) }
}

fn session_of(peer: PeerId) -> u64 {
    0x5e55_0000 + peer.0
}

/// The token our endpoint's transfer `xfer` carries (the shell draws random ones; distinct
/// values are all the harness needs).
fn our_token(xfer: XferId) -> Token {
    Token(u128::from(xfer.0).wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835) | 1)
}

/// The token the honest remote sender `peer` uses for its transfer `xfer`.
fn remote_token(peer: PeerId, xfer: XferId) -> Token {
    Token((u128::from(peer.0) << 64 | u128::from(xfer.0)).wrapping_mul(0xD6E8_FEB8_6659_FD93) | 2)
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Gather,
    Write,
    Scatter,
    Read,
}

const USER_BASE: u64 = 0x10_0000;
const USER_LEN: u64 = 1 << 20;

/// A second arena (a GPU one beside the host one, in a shell) and the memory it alone serves:
/// `[OTHER_BASE, OTHER_BASE + USER_LEN)`, registered as [`OTHER_REG`], never deregistered.
const OTHER_ARENA: ArenaId = ArenaId(1);
const OTHER_BASE: u64 = 0x8000_0000;
const OTHER_REG: RegId = RegId(900);

/// Where arena `arena`'s registered memory starts.
fn base_of(arena: ArenaId) -> u64 {
    if arena == OTHER_ARENA { OTHER_BASE } else { USER_BASE }
}

fn config() -> Config {
    let params = [
        ("bounce_arena_size", "64KiB"),
        ("bounce_arena_granularity", "4KiB"),
        ("bounce_max_chunk_size", "16KiB"),
        ("bounce_max_inflight_chunks", "2"),
        ("bounce_request_timeout_ms", "100"),
        // Chunks of two or more runs send them ahead in a PLAN, single runs ride in the DATA.
        ("bounce_plan_ahead_runs", "2"),
    ];
    Config::from_params(params, |_| None).expect("a valid fuzz configuration").config
}

impl Op {
    /// Draws one operation. Peer messages are drawn less often than the rest: an arbitrary
    /// message eats many input bytes, and the interesting states need submits and completions.
    fn draw(u: &mut Unstructured<'_>) -> arbitrary::Result<Self> {
        Ok(match u.int_in_range(0u8..=19)? {
            19 => Self::RemoteGrant { which: u.arbitrary()?, chunk: u.arbitrary()?, at: u.arbitrary()? },
            17 => Self::RemotePlan { which: u.arbitrary()?, chunk: u.arbitrary()?, at: u.arbitrary()? },
            18 => Self::RemoteAck { which: u.arbitrary()?, replan: u.arbitrary()? },
            15 => Self::Deregister,
            16 => Self::HostileData {
                which: u.arbitrary()?,
                len: u.arbitrary()?,
                count: u.arbitrary()?,
                region_stride: u.arbitrary()?,
                addr_stride: u.arbitrary()?,
                at: u.arbitrary()?,
            },
            0 => Self::Msg { from: u.arbitrary()?, msg: u.arbitrary()? },
            1 | 2 => Self::Submit {
                peer: u.arbitrary()?,
                descs: u.arbitrary()?,
                size: u.arbitrary()?,
                packed: u.arbitrary()?,
            },
            3..=7 => Self::Done { which: u.arbitrary()?, ok: u.int_in_range(0u8..=15)? != 0 },
            8 => Self::Cancel { xfer: u.arbitrary()? },
            9 => Self::PeerLost { peer: u.arbitrary()? },
            10 | 11 => Self::Tick { ms: u.arbitrary()? },
            13 if u.arbitrary::<bool>()? => Self::Forge {
                kind: u.arbitrary()?,
                which: u.arbitrary()?,
                flip: u.arbitrary()?,
                session: u.arbitrary()?,
            },
            14 => match u.int_in_range(0u8..=6)? {
                4 => Self::SubmitRead { peer: u.arbitrary()?, descs: u.arbitrary()?, size: u.arbitrary()? },
                5 => Self::RemotePull {
                    from: u.arbitrary()?,
                    xfer: u.arbitrary()?,
                    chunks: u.arbitrary()?,
                    size: u.arbitrary()?,
                    at: u.arbitrary()?,
                },
                6 => Self::RemoteRelease { which: u.arbitrary()?, wrong: u.arbitrary()? },
                0 => Self::OneWayWant {
                    from: u.arbitrary()?,
                    xfer: u.arbitrary()?,
                    chunks: u.arbitrary()?,
                    size: u.arbitrary()?,
                },
                1 => Self::Cursor { which: u.arbitrary()?, consumed: u.arbitrary()? },
                2 => Self::SubmitOneWay { peer: u.arbitrary()?, descs: u.arbitrary()?, size: u.arbitrary()? },
                _ => Self::Fetched {
                    which: u.arbitrary()?,
                    garbage: u.arbitrary()?,
                    first: u.arbitrary()?,
                    chunk: u.arbitrary()?,
                    offset: u.arbitrary()?,
                    len: u.arbitrary()?,
                },
            },
            12 => Self::RemoteWant {
                from: u.arbitrary()?,
                xfer: u.arbitrary()?,
                chunks: u.arbitrary()?,
                size: u.arbitrary()?,
            },
            _ => Self::RemoteData { which: u.arbitrary()?, at: u.arbitrary()?, ahead: u.int_in_range(0u8..=4)? == 0 },
        })
    }
}

/// What one run exercised (so a test can prove it is not vacuous).
#[derive(Debug, Default, Clone, Copy)]
pub struct Coverage {
    /// Operations applied.
    pub ops: usize,
    /// Transfers the endpoint accepted.
    pub submitted: usize,
    /// Transfers that completed (either way).
    pub completed: usize,
    /// Gather/write/scatter jobs completed by the harness.
    pub jobs_done: usize,
    /// Scatter jobs emitted (each checked against the arena and the registered memory).
    pub scatters: usize,
    /// DATA messages the receiver refused (destinations outside registered memory among them).
    pub data_refused: u64,
    /// Forged frames aimed at live transfers or flows, each refused and counted.
    pub forged: u64,
    /// Deregistrations of the user range applied.
    pub deregistrations: usize,
    /// Mailbox records the endpoint wrote (each checked to lie inside its mailbox).
    pub records: usize,
    /// Fetches of our one-way transfers' answers handed in.
    pub fetched: usize,
    /// READs submitted.
    pub reads: usize,
    /// READ chunks the endpoint gathered for remote initiators and announced ready.
    pub served: u64,
    /// Remote PLANs kept for their DATA.
    pub plans_kept: u64,
    /// PLANs we sent ahead of our DATAs (each checked to carry its transfer's token).
    pub plans_sent: u64,
    /// DATAs answered ACK(Replan) by the endpoint, or sent again by it with their runs.
    pub replans: u64,
    /// Scatters by plans left unchecked in their regions (each checked to be bounded by
    /// registered memory and its region).
    pub region_plans: usize,
    /// Scatters of inline chunks from remote WANTs (each checked to fit its region).
    pub inline_scatters: usize,
    /// Remote WANTs whose chunk 0 claimed the peer's standing credit.
    pub standing_taken: u64,
    /// Scatters through the second arena (each checked to write only the memory it serves).
    pub other_scatters: usize,
    /// Remote WANTs refused for proving a registration their arena does not serve.
    pub wrong_arena: usize,
    /// Remote flows that lapsed (granted, then silent for a lease).
    pub timed_out: u64,
    /// Never-granted remote flows dropped with a lapsed one, their peer having used no grant
    /// since it was given.
    pub dropped_unserved: u64,
}

/// What the harness has seen come out of the endpoint.
#[derive(Default)]
struct Seen {
    capacity: u64,
    jobs: Vec<(JobId, Kind)>,
    completed: BTreeSet<XferId>,
    /// Credits granted to the remote senders, not yet used.
    credits: Vec<(PeerId, XferId, ChunkIdx, Region)>,
    /// DATA our endpoint sent for its own transfers (the chunks an ACK may name).
    sent_data: Vec<(PeerId, XferId, ChunkIdx, Region)>,
    /// Our WRITEs whose WANT went out: peer, transfer, chunk sizes (what a GRANT may credit).
    wanted: Vec<(PeerId, XferId, Vec<u64>)>,
    scatters: usize,
    other_scatters: usize,
    region_plans: usize,
    inline_scatters: usize,
    /// The user range is registered (see [`Op::Deregister`]).
    registered: bool,
    /// One-way flows into the endpoint, whose answers come as records: (peer, xfer).
    one_way: Vec<(PeerId, XferId)>,
    /// READ flows into the endpoint (remote PULLs accepted).
    pulls: Vec<(PeerId, XferId)>,
    /// Regions those announced ready, not yet released.
    ready: Vec<(PeerId, XferId, ChunkIdx, Region)>,
    /// Where the endpoint's mailbox lies in its arena: `[start, end)`.
    mailbox: (u64, u64),
    records: usize,
}

/// Whether `r` touches the user range at all.
fn touches_user(r: &CopyRun) -> bool {
    r.addr_span().is_none_or(|(a, b)| a < USER_BASE + USER_LEN && USER_BASE < b)
}

impl Seen {
    /// Takes every pending action, checking each scatter job's safety on the way.
    fn drain(&mut self, ep: &mut Endpoint) {
        while let Some(a) = ep.poll_action() {
            match a {
                Action::Gather { job, runs, .. } => {
                    assert!(self.registered || !runs.iter().any(touches_user), "a gather reads deregistered memory");
                    self.jobs.push((job, Kind::Gather));
                }
                Action::Write { job, source, len, .. } => {
                    if let WriteSource::User { addr } = source {
                        let touches = addr < USER_BASE + USER_LEN && USER_BASE < addr.saturating_add(len);
                        assert!(self.registered || !touches, "a direct write reads deregistered memory");
                    }
                    self.jobs.push((job, Kind::Write));
                }
                Action::Scatter { job, arena, region, runs, in_region, inline, .. } => {
                    // Each arena scatters only into the memory it serves: the user range
                    // (deregistered at times) or the other arena's (always registered).
                    let (lo_ok, hi_ok) = (base_of(arena), base_of(arena) + USER_LEN);
                    let within = |(a, b): (u64, u64)| lo_ok <= a && b <= hi_ok;
                    if arena == OTHER_ARENA {
                        self.other_scatters += 1;
                    } else {
                        assert!(self.registered, "a scatter was emitted while its memory is deregistered");
                    }
                    if let Some(bytes) = &inline {
                        assert!(bytes.len() as u64 <= region.len, "inline bytes beyond their region {region:?}");
                        assert!(in_region.is_none(), "an inline chunk's runs are its own");
                        self.inline_scatters += 1;
                    }
                    if let Some(p) = &in_region {
                        // Unchecked runs: what bounds them is what the copy engine checks them
                        // against, which must be registered memory and leave room for the plan.
                        assert!(runs.runs().is_empty(), "a region plan's scatter names runs of its own");
                        let (lo, hi) = p.allowed.hull().expect("a region plan scatters only with ranges");
                        assert!(within((lo, hi)), "region plan may write outside its arena's memory");
                        let end = p.offset.checked_add(bounce_proto::wire::region_plan::plan_bytes(p.runs));
                        assert!(end.is_some_and(|e| e <= region.len), "region plan leaves its region {region:?}");
                        self.region_plans += 1;
                    }
                    assert!(region.end() <= self.capacity, "scatter of {region:?} outside the arena");
                    let copied: u64 = runs.iter().map(|r| r.bytes().expect("a validated run has a size")).sum();
                    assert!(copied <= region.len, "a scatter copies {copied} bytes out of a {region:?}");
                    for r in runs.runs() {
                        let inside = r.region_span().is_some_and(|(_, end)| end <= region.len);
                        assert!(inside, "scatter run {r:?} leaves its region {region:?}");
                        let registered = r.addr_span().is_some_and(within);
                        assert!(registered, "scatter run {r:?} writes outside the memory its arena serves");
                    }
                    self.scatters += 1;
                    self.jobs.push((job, Kind::Scatter));
                }
                Action::Complete { xfer, .. } => assert!(self.completed.insert(xfer), "{xfer:?} completed twice"),
                Action::Send { peer, msg: Msg::Grant(g) } if self.pulls.contains(&(peer, g.xfer)) => {
                    // A READ flow's GRANT announces a gathered region, ready to be READ.
                    for c in &g.credits {
                        assert!(c.region.end() <= self.capacity, "a ready region {:?} outside the arena", c.region);
                    }
                    self.ready.extend(g.credits.iter().map(|c| (peer, g.xfer, c.chunk, c.region)));
                }
                Action::Send { peer, msg: Msg::Grant(g) } => {
                    self.credits.extend(g.credits.iter().map(|c| (peer, g.xfer, c.chunk, c.region)));
                }
                Action::Send { peer, msg: Msg::Want(w) } if w.token == our_token(w.xfer) && !w.is_cancel() => {
                    self.wanted.push((peer, w.xfer, w.chunks.clone()));
                }
                Action::Send { peer, msg: Msg::Data(d) } => {
                    assert_eq!(d.token, our_token(d.xfer), "a DATA must carry its transfer's token");
                    self.sent_data.push((peer, d.xfer, d.chunk, d.region));
                }
                Action::Send { msg: Msg::Plan(p), .. } => {
                    assert_eq!(p.token, our_token(p.xfer), "a PLAN must carry its transfer's token");
                    assert!(!p.runs.is_empty(), "a PLAN names runs");
                }
                Action::Read { job, local, remote, len, .. } => {
                    assert!(local.end() <= self.capacity, "a READ into {local:?} outside the arena");
                    assert!(len <= local.len && len <= remote.len, "a READ of {len} bytes overflows a region");
                    self.jobs.push((job, Kind::Read));
                }
                Action::PutRecord { offset, bytes } => {
                    let inside = self.mailbox.0 <= offset && offset + bytes.len() as u64 <= self.mailbox.1;
                    assert!(inside, "a record at {offset:#x} outside the mailbox {:?}", self.mailbox);
                    self.records += 1;
                    // The honest one-way senders read their credits from the records.
                    for &(peer, xfer) in &self.one_way {
                        let key = RecordKey::derive(&oneway::record_token(remote_token(peer, xfer)));
                        if let Ok(r) = Record::decode(&bytes, &key)
                            && let (true, Answer::Grant(c)) = (r.xfer == xfer, r.answer)
                        {
                            self.credits.push((peer, xfer, c.chunk, c.region));
                        }
                    }
                }
                Action::Send { .. } | Action::Link { .. } => {}
            }
        }
    }
}

/// Runs one sequence of operations; panics (for the fuzzer to report) on a broken invariant.
pub fn run(data: &[u8]) -> Coverage {
    let mut cov = Coverage::default();
    let mut u = Unstructured::new(data);
    let mut ops = Vec::new();
    while !u.is_empty() && ops.len() < 256 {
        match Op::draw(&mut u) {
            Ok(op) => ops.push(op),
            Err(_) => break,
        }
    }
    let cfg = config();
    let mut now = Instant::now();
    let mut ep = Endpoint::new(&cfg, now, PROBE_KEY).expect("endpoint");
    ep.keep_mailbox(true);
    let layout = ep.one_way_layout();
    let mailbox = MailboxLayout { slots: layout.mailbox.slots, ring: layout.mailbox.ring };
    ep.add_registered(REG, KEY, (USER_BASE, USER_LEN), ArenaId(0));
    assert_eq!(ep.add_arena(cfg.arena_usable_capacity(), cfg.arena_granularity, cfg.max_chunk_size), Ok(OTHER_ARENA));
    ep.add_registered(OTHER_REG, key_of(OTHER_REG), (OTHER_BASE, USER_LEN), OTHER_ARENA);
    // Peers 0..3, loaded in order (so `agent(i)` is `PeerId(i)`) with their sessions.
    for i in 0..3 {
        let caps = Capabilities::host_arena(cfg.arena_usable_capacity(), cfg.max_chunk_size, session_of(PeerId(i)));
        ep.handle_conn_info(now, &agent(i), Some(caps), None);
        assert_eq!(ep.peers().lookup(&agent(i)), Some(PeerId(i)));
    }
    let mut next_xfer = 1u64;
    let capacity = cfg.arena_usable_capacity();

    // What the remote senders know: chunk sizes they announced (credits come with `seen`).
    let mut announced: BTreeMap<(PeerId, XferId), Vec<u64>> = BTreeMap::new();
    // The arena each remote flow was opened through (its DATA runs aim at that arena's memory).
    let mut flow_arena: BTreeMap<(PeerId, XferId), ArenaId> = BTreeMap::new();
    let mailbox_at = (layout.mailbox.offset, layout.mailbox.offset + mailbox.byte_len());
    let mut seen = Seen { capacity, registered: true, mailbox: mailbox_at, ..Seen::default() };
    let mut our_one_way: Vec<XferId> = Vec::new();
    let mut reg = REG;
    let done = |ep: &mut Endpoint, now: Instant, (job, kind): (JobId, Kind), ok: bool| match kind {
        Kind::Gather => ep.handle_gather_done(now, job, ok),
        Kind::Write => ep.handle_write_done(now, job, ok),
        Kind::Scatter => ep.handle_scatter_done(now, job, ok),
        Kind::Read => ep.handle_read_done(now, job, ok),
    };

    for op in ops.into_iter().take(256) {
        cov.ops += 1;
        match op {
            Op::Msg { from, msg } => {
                let _ = ep.handle_msg(now, PeerId(u64::from(from % 3)), msg);
            }
            Op::Submit { .. } if !seen.registered => {}
            Op::Submit { peer, descs, size, packed } => {
                let n = u64::from(descs % 64) + 1;
                let len = u64::from(size % 8192) + 1;
                let stride = if packed { len } else { len * 2 };
                // Unpacked destinations are shuffled (slot 7i mod n): scatter plans of several runs,
                // which go ahead of their DATA in PLANs.
                let slot = |i: u64| if packed { i } else { (i * 7) % n };
                let pairs: Vec<DescPair> = (0..n)
                    .map(|i| DescPair { src: USER_BASE + i * stride, dst: 0x4000_0000 + slot(i) * stride, len })
                    .collect();
                if let Ok(p) = plan(&pairs, PlanParams::from_config(&cfg)) {
                    let xfer = XferId(next_xfer);
                    if ep.submit(now, xfer, our_token(xfer), PeerId(u64::from(peer % 3)), p).is_ok() {
                        cov.submitted += 1;
                    }
                    next_xfer += 1;
                }
            }
            Op::Done { which, ok } => {
                if !seen.jobs.is_empty() {
                    let j = seen.jobs.remove(usize::from(which) % seen.jobs.len());
                    done(&mut ep, now, j, ok);
                    cov.jobs_done += 1;
                }
            }
            Op::Cancel { xfer } => ep.cancel(now, XferId(u64::from(xfer))),
            Op::PeerLost { peer } => ep.handle_peer_lost(now, PeerId(u64::from(peer % 3))),
            Op::Tick { ms } => {
                now += Duration::from_millis(u64::from(ms % 200));
                ep.handle_timeout(now);
            }
            Op::RemoteWant { from, xfer, chunks, size } => {
                let (peer, xfer) = (PeerId(u64::from(from % 3)), XferId(1000 + u64::from(xfer)));
                // Half the chunks a multiple of 8 bytes: where a region plan can end a chunk.
                let size = u64::from(size % (16 << 10)) + 1;
                let size = if size & 1 == 0 { size.next_multiple_of(8) } else { size };
                let sizes = vec![size; usize::from(chunks % 4) + 1];
                let token = remote_token(peer, xfer);
                // Half the WANTs go through the second arena; a quarter prove the registration
                // of the other arena (a hostile peer's, holding both keys): refused, whatever
                // the DATA that follows.
                let arena = if from & 0x40 != 0 { OTHER_ARENA } else { ArenaId(0) };
                let mismatched = from & 0x30 == 0x30;
                let proven = if (arena == OTHER_ARENA) != mismatched { OTHER_REG } else { reg };
                let proofs = vec![proof::prove(proven, &key_of(proven), token, xfer)];
                // Half the one-chunk WANTs carry the chunk inline, scattered by one run that
                // may leave the registration (a hostile peer's).
                let inline = (sizes.len() == 1 && from & 0x80 != 0).then(|| {
                    let addr = base_of(arena) - 4096 + (size * 131) % (USER_LEN + 8192);
                    let run = CopyRun { region_off: 0, addr, len: size, count: 1, region_stride: 0, addr_stride: 0 };
                    bounce_proto::wire::Inline { runs: vec![run], bytes: vec![0xa5; size as usize] }
                });
                // Some WANTs open the peer's standing flow (of at most 4 KiB: an eighth of this
                // arena holds two), or claim it, with its token or a forged one (a hostile
                // peer's), for chunks of at most 4 KiB.
                let mode = (chunks >> 4) % 16;
                let standing_id = XferId(STANDING_XFER_BIT | (1000 + peer.0));
                let (xfer, token, proofs, inline, standing) = match mode {
                    1 | 2 => (standing_id, remote_token(peer, standing_id), Vec::new(), None, Standing::Open),
                    3..=6 if inline.is_none() => {
                        let forged = mode == 6;
                        let claim_token = if forged { Token(7) } else { remote_token(peer, standing_id) };
                        (xfer, token, proofs, None, Standing::Claim { xfer: standing_id, token: claim_token })
                    }
                    _ => (xfer, token, proofs, inline, Standing::None),
                };
                let sizes = match standing {
                    Standing::Open => vec![sizes[0].min(4096)],
                    Standing::Claim { .. } => sizes.iter().map(|&s| s.min(4096)).collect(),
                    Standing::None => sizes,
                };
                let want = Msg::Want(Want {
                    arena,
                    xfer,
                    token,
                    endpoint: Vec::new(),
                    chunks: sizes.clone(),
                    proofs,
                    inline,
                    standing,
                });
                let existed = ep.receiver().has_flow(FlowKey { peer, xfer });
                let answered = ep.handle_msg(now, peer, want);
                if let Err(ProtocolError::BadProof { source: proof::BadProof::WrongArena(..), .. }) = answered {
                    assert!(mismatched, "a proof through the arena that serves it refused as of another arena");
                    cov.wrong_arena += 1;
                }
                if answered.is_ok() && standing != Standing::Open {
                    assert!(!mismatched, "a proof of another arena's memory accepted");
                    if !existed {
                        flow_arena.insert((peer, xfer), arena);
                    }
                    announced.entry((peer, xfer)).or_default().extend(sizes);
                    // A claim taken: chunk 0's region is the standing one, written as if granted.
                    if let Some(g) = ep.scheduler().idle_held(FlowKey { peer, xfer })
                        && matches!(standing, Standing::Claim { .. })
                        && g.chunk.0 == 0
                    {
                        seen.credits.push((peer, xfer, g.chunk, g.region));
                    }
                }
            }
            Op::RemoteData { which, at, ahead } => {
                if !seen.credits.is_empty() {
                    let (peer, xfer, chunk, region) = seen.credits.swap_remove(usize::from(which) % seen.credits.len());
                    if let Some(&len) = announced.get(&(peer, xfer)).and_then(|s| s.get(chunk.0 as usize)) {
                        let arena = flow_arena.get(&(peer, xfer)).copied().unwrap_or(ArenaId(0));
                        let addr = base_of(arena) - 4096 + u64::from(at) % (USER_LEN + 8192);
                        let run = CopyRun { region_off: 0, addr, len, count: 1, region_stride: 0, addr_stride: 0 };
                        let token = remote_token(peer, xfer);
                        // One DATA in four says its runs lie in the region, in a plan of 1-8
                        // runs that may or may not fit there.
                        let region_plan_runs = if !ahead && at % 4 == 0 { 1 + at / 4 % 8 } else { 0 };
                        let runs = if ahead || region_plan_runs != 0 { Vec::new() } else { vec![run] };
                        let data = Msg::Data(Data { xfer, token, chunk, region, runs, region_plan_runs });
                        let _ = ep.handle_msg(now, peer, data);
                        // A DATA asked for its runs keeps its credit for the runs' DATA.
                        if ahead && ep.receiver().has_flow(bounce_proto::FlowKey { peer, xfer }) {
                            seen.credits.push((peer, xfer, chunk, region));
                        }
                    }
                }
            }
            Op::RemotePlan { which, chunk, at } => {
                if !announced.is_empty() {
                    let (&(peer, xfer), sizes) =
                        announced.iter().nth(usize::from(which) % announced.len()).expect("in range");
                    let i = usize::from(chunk) % sizes.len();
                    let arena = flow_arena.get(&(peer, xfer)).copied().unwrap_or(ArenaId(0));
                    let addr = base_of(arena) - 4096 + u64::from(at) % (USER_LEN + 8192);
                    let run =
                        CopyRun { region_off: 0, addr, len: sizes[i], count: 1, region_stride: 0, addr_stride: 0 };
                    let (token, chunk) = (remote_token(peer, xfer), ChunkIdx(i as u32));
                    let _ = ep.handle_msg(now, peer, Msg::Plan(Plan { xfer, token, chunk, runs: vec![run] }));
                }
            }
            Op::RemoteAck { which, replan } => {
                if !seen.sent_data.is_empty() {
                    let (peer, xfer, chunk, region) =
                        seen.sent_data.swap_remove(usize::from(which) % seen.sent_data.len());
                    let status = if replan { AckStatus::Replan } else { AckStatus::Scattered };
                    let ack = Msg::Ack(Ack { xfer, token: our_token(xfer), chunk, region, status });
                    let _ = ep.handle_msg(now, peer, ack);
                }
            }
            Op::Deregister => {
                if seen.registered {
                    // Flush what the endpoint emitted before it learns (the shell's fence does
                    // the same: jobs handed out before the deregistration are waited for).
                    seen.drain(&mut ep);
                    ep.deregister(now, Some(reg), USER_BASE, USER_LEN);
                    cov.deregistrations += 1;
                } else {
                    reg = RegId(reg.0 + 1);
                    ep.add_registered(reg, key_of(reg), (USER_BASE, USER_LEN), ArenaId(0));
                }
                seen.registered = !seen.registered;
            }
            Op::HostileData { which, len, count, region_stride, addr_stride, at } => {
                if !seen.credits.is_empty() {
                    let (peer, xfer, chunk, region) = seen.credits.swap_remove(usize::from(which) % seen.credits.len());
                    let run = CopyRun {
                        region_off: 0,
                        addr: USER_BASE + u64::from(at) % USER_LEN,
                        len: u64::from(len % u16::MAX) + 1,
                        count,
                        region_stride: u64::from(region_stride),
                        addr_stride: u64::from(addr_stride),
                    };
                    let token = remote_token(peer, xfer);
                    let data = Data { xfer, token, chunk, region, runs: vec![run], region_plan_runs: 0 };
                    let _ = ep.handle_msg(now, peer, Msg::Data(data));
                }
            }
            Op::OneWayWant { from, xfer, chunks, size } => {
                let (peer, xfer) = (PeerId(u64::from(from % 3)), XferId(2000 + u64::from(xfer)));
                let sizes = vec![u64::from(size % (16 << 10)) + 1; usize::from(chunks % 4) + 1];
                let token = remote_token(peer, xfer);
                let proofs = vec![proof::prove(reg, &key_of(reg), token, xfer)];
                let endpoint = bounce_proto::wire::REPLY_MAILBOX.to_vec();
                // Half the one-chunk ones carry their chunk inline, as a two-way WANT may.
                let inline = (sizes.len() == 1 && from & 0x80 != 0).then(|| {
                    let len = sizes[0];
                    let addr = USER_BASE - 4096 + (len * 131) % (USER_LEN + 8192);
                    let run = CopyRun { region_off: 0, addr, len, count: 1, region_stride: 0, addr_stride: 0 };
                    bounce_proto::wire::Inline { runs: vec![run], bytes: vec![0x5a; len as usize] }
                });
                let want = Msg::Want(Want {
                    arena: ArenaId(0),
                    xfer,
                    token,
                    endpoint,
                    chunks: sizes.clone(),
                    proofs,
                    inline,
                    standing: Default::default(),
                });
                if ep.handle_msg(now, peer, want).is_ok() {
                    announced.entry((peer, xfer)).or_default().extend(sizes);
                    if !seen.one_way.contains(&(peer, xfer)) {
                        seen.one_way.push((peer, xfer));
                    }
                }
            }
            Op::Cursor { which, consumed } => {
                if !seen.one_way.is_empty() {
                    let (peer, xfer) = seen.one_way[usize::from(which) % seen.one_way.len()];
                    let token = remote_token(peer, xfer);
                    let c = bounce_proto::wire::Cursor { xfer, token, consumed: u64::from(consumed) };
                    let _ = ep.handle_msg(now, peer, Msg::Cursor(c));
                }
            }
            Op::SubmitOneWay { .. } if !seen.registered => {}
            Op::SubmitOneWay { peer, descs, size } => {
                let n = u64::from(descs % 64) + 1;
                let len = u64::from(size % 8192) + 1;
                let pairs: Vec<DescPair> = (0..n)
                    .map(|i| DescPair { src: USER_BASE + i * len * 2, dst: 0x4000_0000 + i * len * 2, len })
                    .collect();
                if let Ok(p) = plan(&pairs, PlanParams::from_config(&cfg)) {
                    let xfer = XferId(next_xfer);
                    let peer = PeerId(u64::from(peer % 3));
                    if ep.submit_one_way(now, xfer, our_token(xfer), peer, p, mailbox).is_ok() {
                        cov.submitted += 1;
                        our_one_way.push(xfer);
                    }
                    next_xfer += 1;
                }
            }
            Op::Fetched { which, garbage, first, chunk, offset, len } => {
                our_one_way.retain(|x| ep.fetch(*x).is_some());
                if !our_one_way.is_empty() {
                    let xfer = our_one_way[usize::from(which) % our_one_way.len()];
                    if let Some(f) = ep.fetch(xfer) {
                        let total: u64 = f.regions.iter().map(|r| r.len).sum();
                        let mut image = vec![0u8; total as usize];
                        if garbage {
                            for (i, b) in image.iter_mut().enumerate() {
                                *b = (i as u8).wrapping_mul(first) ^ chunk;
                            }
                        } else {
                            // Record 1 of the transfer, in the first candidate slot (a locating
                            // fetch reads one record per candidate, in candidate order).
                            let token = oneway::record_token(our_token(xfer));
                            let slot = candidates(&token, mailbox)[0];
                            let region = Region { offset: u64::from(offset), len: u64::from(len) };
                            let answer = if first % 4 == 0 {
                                Answer::Fail(bounce_proto::mailbox::FailReason::TimedOut)
                            } else {
                                Answer::Grant(Credit { chunk: ChunkIdx(u32::from(chunk)), region })
                            };
                            let rec = Record { slot, seq: Seq(1), xfer, answer };
                            if answer.validate().is_ok() && image.len() >= RECORD_LEN {
                                image[..RECORD_LEN].copy_from_slice(&rec.encode(&RecordKey::derive(&token)));
                            }
                        }
                        ep.handle_fetched(now, xfer, &image);
                        cov.fetched += 1;
                    }
                }
            }
            Op::SubmitRead { .. } if !seen.registered => {}
            Op::SubmitRead { peer, descs, size } => {
                // Sources in the peer's memory, destinations in our registered range.
                let n = u64::from(descs % 64) + 1;
                let len = u64::from(size % 8192) + 1;
                let pairs: Vec<DescPair> = (0..n)
                    .map(|i| DescPair { src: 0x4000_0000 + i * len * 2, dst: USER_BASE + i * len * 2, len })
                    .collect();
                if let Ok(mut p) = plan(&pairs, PlanParams::from_config(&cfg)) {
                    p.read = true;
                    let xfer = XferId(next_xfer);
                    if ep.submit_read(now, xfer, our_token(xfer), PeerId(u64::from(peer % 3)), p, None).is_ok() {
                        cov.submitted += 1;
                        cov.reads += 1;
                    }
                    next_xfer += 1;
                }
            }
            Op::RemotePull { from, xfer, chunks, size, at } => {
                let (peer, xfer) = (PeerId(u64::from(from % 3)), XferId(3000 + u64::from(xfer)));
                let bytes = u64::from(size % (16 << 10)) + 1;
                let addr = USER_BASE - 4096 + u64::from(at) % (USER_LEN + 8192);
                let run = CopyRun { region_off: 0, addr, len: bytes, count: 1, region_stride: 0, addr_stride: 0 };
                // 1-4 chunks, starting at chunk 0-2 of a READ of up to one chunk more: opening
                // PULLs (with proofs), later ones (without, as a sender sends them), out of order.
                let (n, first) = (u32::from(chunks % 4) + 1, u32::from((chunks >> 2) % 3));
                let total = first + n + u32::from((chunks >> 4) % 2);
                let chunks = vec![PullChunk { bytes, runs: vec![run].into() }; n as usize];
                let token = remote_token(peer, xfer);
                let proofs = if first == 0 { vec![proof::prove(reg, &key_of(reg), token, xfer)] } else { Vec::new() };
                let (first, endpoint) = (ChunkIdx(first), Vec::new());
                let pull = Msg::Pull(Pull { arena: ArenaId(0), xfer, token, first, total, endpoint, chunks, proofs });
                if ep.handle_msg(now, peer, pull).is_ok() {
                    seen.pulls.push((peer, xfer));
                }
            }
            Op::RemoteGrant { which, chunk, at } => {
                if !seen.wanted.is_empty() {
                    let (peer, xfer, ref sizes) = seen.wanted[usize::from(which) % seen.wanted.len()];
                    if !sizes.is_empty() {
                        let i = usize::from(chunk) % sizes.len();
                        let region = Region { offset: u64::from(at), len: sizes[i] };
                        let credits = vec![Credit { chunk: ChunkIdx(i as u32), region }];
                        let _ = ep.handle_msg(now, peer, Msg::Grant(Grant { xfer, token: our_token(xfer), credits }));
                    }
                }
            }
            Op::RemoteRelease { which, wrong } => {
                if !seen.ready.is_empty() {
                    let (peer, xfer, chunk, region) = seen.ready.swap_remove(usize::from(which) % seen.ready.len());
                    let chunk = if wrong { ChunkIdx(chunk.0 ^ 1) } else { chunk };
                    let token = remote_token(peer, xfer);
                    let _ = ep.handle_msg(now, peer, Msg::Release(Release { xfer, token, chunk, region }));
                }
            }
            Op::Forge { kind, which, flip, session } => {
                if let Some((peer, msg)) = forge(&seen, &announced, kind, which) {
                    cov.forged += u64::from(refuse_forgery(&mut ep, now, peer, msg, flip | 1, session));
                }
            }
        }
        seen.drain(&mut ep);
        if let Err(e) = ep.scheduler().check_invariants() {
            panic!("scheduler invariant broken: {e}");
        }
        if let Err(e) = ep.receiver().check_invariants() {
            panic!("receiver invariant broken: {e}");
        }
    }
    // Shut down, let every outstanding job end, and nothing may stay allocated.
    ep.shutdown(now);
    seen.drain(&mut ep);
    let mut guard = 0;
    while let Some(j) = seen.jobs.pop() {
        done(&mut ep, now, j, false);
        seen.drain(&mut ep);
        guard += 1;
        assert!(guard < 100_000, "jobs keep coming after shutdown");
    }
    assert_eq!(ep.arena_free_bytes(), 2 * capacity, "arena bytes leaked after shutdown");
    cov.completed = seen.completed.len();
    cov.scatters = seen.scatters;
    cov.other_scatters = seen.other_scatters;
    cov.region_plans = seen.region_plans;
    cov.inline_scatters = seen.inline_scatters;
    cov.standing_taken = ep.stats().standing_taken;
    cov.timed_out = ep.stats().flows_timed_out;
    cov.dropped_unserved = ep.stats().flows_dropped_unserved;
    cov.records = seen.records;
    cov.served = ep.stats().chunks_served;
    cov.data_refused = ep.stats().data_refused;
    cov.plans_kept = ep.stats().plans_kept;
    cov.plans_sent = ep.stats().plans_sent;
    cov.replans = ep.stats().replans;
    cov
}

/// A genuine-looking message aimed at live state, as the honest side would send it (right
/// ids, right token): GRANT or ACK(Scattered) for a chunk of ours whose DATA went out; DATA,
/// cancel or WANT for a remote flow we granted. `None` when there is no such state yet.
fn forge(seen: &Seen, announced: &BTreeMap<(PeerId, XferId), Vec<u64>>, kind: u8, which: u8) -> Option<(PeerId, Msg)> {
    let pick = |n: usize| usize::from(which) % n;
    Some(match kind % 7 {
        0 | 1 if !seen.sent_data.is_empty() => {
            let (peer, xfer, chunk, region) = seen.sent_data[pick(seen.sent_data.len())];
            let token = our_token(xfer);
            let msg = if kind.is_multiple_of(7) {
                Msg::Grant(Grant { xfer, token, credits: vec![Credit { chunk, region }] })
            } else {
                Msg::Ack(Ack { xfer, token, chunk, region, status: AckStatus::Scattered })
            };
            (peer, msg)
        }
        2 if !seen.credits.is_empty() => {
            let (peer, xfer, chunk, region) = seen.credits[pick(seen.credits.len())];
            let len = *announced.get(&(peer, xfer))?.get(chunk.0 as usize)?;
            let run = CopyRun { region_off: 0, addr: USER_BASE, len, count: 1, region_stride: 0, addr_stride: 0 };
            (
                peer,
                Msg::Data(Data {
                    xfer,
                    token: remote_token(peer, xfer),
                    chunk,
                    region,
                    runs: vec![run],
                    region_plan_runs: 0,
                }),
            )
        }
        3 | 4 if !announced.is_empty() => {
            let (&(peer, xfer), sizes) = announced.iter().nth(pick(announced.len()))?;
            let token = remote_token(peer, xfer);
            let chunks = if kind % 7 == 3 { Vec::new() } else { sizes[..1].to_vec() };
            (
                peer,
                Msg::Want(Want {
                    arena: ArenaId(which % 3),
                    xfer,
                    token,
                    endpoint: Vec::new(),
                    chunks,
                    proofs: Vec::new(),
                    inline: None,
                    standing: Default::default(),
                }),
            )
        }
        5 => {
            // A transfer nobody announced yet, proving the registration: once its token is
            // changed, the proof is for another token (a replayed or guessed tag).
            let (peer, xfer) = (PeerId(u64::from(which % 3)), XferId(1 << 32 | u64::from(which)));
            let token = remote_token(peer, xfer);
            let proofs = vec![proof::prove(REG, &KEY, token, xfer)];
            (
                peer,
                Msg::Want(Want {
                    arena: ArenaId(which % 3),
                    xfer,
                    token,
                    endpoint: Vec::new(),
                    chunks: vec![4096],
                    proofs,
                    inline: None,
                    standing: Default::default(),
                }),
            )
        }
        6 if !seen.credits.is_empty() => {
            // A KEEP for a granted flow: with its token it would hold the reclaim off.
            let (peer, xfer, _, _) = seen.credits[pick(seen.credits.len())];
            (peer, Msg::Keep(Keep { xfer, token: remote_token(peer, xfer) }))
        }
        _ => return None,
    })
}

/// Sends `msg` from `peer` with its token or (with `session`) its session XORed with `flip`,
/// through the frame path, and checks that it was refused as a forgery when it named live
/// state, and that nothing changed. Returns whether it was such a refusal.
fn refuse_forgery(ep: &mut Endpoint, now: Instant, peer: PeerId, mut msg: Msg, flip: u128, session: bool) -> bool {
    let real = session_of(peer);
    let frame_session = if session { real ^ (flip as u64 | 1) } else { real };
    if !session {
        let forged = Token(msg.token().0 ^ flip);
        match &mut msg {
            Msg::Want(m) => m.token = forged,
            Msg::Grant(m) => m.token = forged,
            Msg::Data(m) => m.token = forged,
            Msg::Ack(m) => m.token = forged,
            Msg::Keep(m) => m.token = forged,
            Msg::Cursor(m) => m.token = forged,
            Msg::Pull(m) => m.token = forged,
            Msg::Release(m) => m.token = forged,
            Msg::Plan(m) => m.token = forged,
        }
    }
    let xfer = msg.xfer();
    let before =
        (ep.stats().clone(), ep.in_flight_xfers(), ep.remote_flows(), ep.arena_free_bytes(), ep.jobs_in_flight());
    let bytes = Frame { session: frame_session, msg }.to_vec();
    let r = ep.handle_frame(now, &agent(peer.0), &bytes);
    // Our transfers and the remote flows may have ended since the harness noted them (then
    // the frame is late or unknown, not forged); while they live, the refusal is a forgery.
    let forged = match &r {
        Err(FrameRefused::StaleSession { got, current }) => {
            assert!(session && *got == frame_session && *current == real, "{r:?}");
            true
        }
        Err(FrameRefused::Protocol(
            ProtocolError::WrongToken { peer: p, xfer: x } | ProtocolError::BadProof { peer: p, xfer: x, .. },
        )) => {
            assert!(!session && *p == peer && *x == xfer, "{r:?}");
            true
        }
        other => {
            // Only a frame about state that is gone may get through, and then it changes no
            // transfer: a GRANT or ACK for a finished transfer is late, a DATA or cancel for a
            // gone flow is dropped, a WANT for a gone flow starts a new one (its token is its
            // own) -- never under a wrong session.
            assert!(!session, "a frame of a foreign session was accepted: {other:?}");
            false
        }
    };
    if forged {
        let stats = ep.stats();
        assert_eq!(stats.control_forged, before.0.control_forged + 1, "a forgery is counted once");
        assert_eq!(stats.completed, before.0.completed, "a forgery never completes a transfer");
        assert_eq!(stats.chunks_scattered, before.0.chunks_scattered);
        let after = (ep.in_flight_xfers(), ep.remote_flows(), ep.arena_free_bytes(), ep.jobs_in_flight());
        assert_eq!(after, (before.1, before.2, before.3, before.4), "a forgery changed the endpoint");
        let acted = ep.poll_action();
        assert!(acted.is_none(), "a forgery made the endpoint act: {acted:?} ({r:?})");
    }
    forged
}
