//! The receiver role (design §5, §6, §9): remote flows that write into this engine's arena,
//! WANT -> GRANT, DATA -> validated scatter -> ACK, cancel and peer-loss reclaim.
//!
//! [`Receiver`] owns what the scheduler does not know: each flow's chunk sizes (to bound the
//! scatter runs by the bytes actually written), the scatter jobs in flight, the flows' idle
//! timers and the registered memory that DATA runs may target. Region ownership, the window and
//! fairness live in the endpoint's shared [`crate::scheduler::CreditScheduler`]. The
//! [`crate::endpoint::Endpoint`] drives it; nothing else does.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::{debug, trace, warn};

use crate::config::Config;
use crate::event::{Action, Ctx, DataFault, InRegionPlan, JobId, JobRuns, ProtocolError, internal_error};
use crate::proof::{BadProof, Initiator, Registrations};
use crate::scheduler::arenas::ArenaSchedulers;
use crate::scheduler::{Grant as SchedGrant, Reuse};
use crate::sender::STANDING_XFER_BIT;
use crate::timer::TimerTable;
use crate::types::{ArenaId, ChunkIdx, CopyRun, FlowKey, PeerId, RegId, RegKey, Region, Token, XferId};
use crate::wire::{self, Ack, AckStatus, Credit, Data, Grant, Keep, Pull, Release, Standing, Want};

/// Most flows one peer may have open at this receiver at once. Each open flow costs receiver
/// and scheduler state until it ends; without a cap a peer could grow that state without
/// bound by announcing transfers it never sends.
pub const MAX_FLOWS_PER_PEER: usize = 4096;
/// Most chunks one peer may have announced across its open flows (each announced chunk is
/// kept, with its size, until its flow ends), READ flows' kept gather runs counted with them.
/// 2^20 chunks is 2 TiB in flight at 2 MiB chunks.
pub const MAX_CHUNKS_PER_PEER: u64 = 1 << 20;
/// Most chunks (and kept gather runs) all peers together may have announced: the per-peer cap
/// bounds one peer, and this the many names a one-way target may serve (each its own peer),
/// so that announced-but-unsent chunks cannot grow this engine's memory past a few hundred MiB.
/// 2^22 chunks is 8 TiB in flight at 2 MiB chunks.
pub const MAX_CHUNKS_TOTAL: u64 = 1 << 22;
/// Most inline bytes ([`wire::Inline`]) held at once, across all peers, for flows whose chunk
/// the scheduler has not granted yet (a busy arena). Beyond it an inline WANT is served the
/// usual way (GRANT, write, DATA): a flood of them costs other peers the shortcut, never memory.
pub const MAX_INLINE_HELD: u64 = 4 << 20;
/// Share of the arena's usable bytes that standing credits ([`wire::Standing`]) may hold, all
/// peers together: beyond it a peer's standing flow is refused (it then uses the full exchange).
pub const STANDING_SHARE: u64 = 8;

/// What one peer's open flows hold here: the quantities [`MAX_FLOWS_PER_PEER`] and
/// [`MAX_CHUNKS_PER_PEER`] bound.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct PeerLoad {
    flows: usize,
    chunks: u64,
}

/// One remote flow as the receiver sees it.
#[derive(Debug)]
struct Flow {
    /// The token of the WANT that created the flow: every later WANT, cancel and DATA of the
    /// flow must carry it, and every GRANT and ACK echoes it.
    token: Token,
    /// The arena its regions are granted in (named by the WANT or PULL that created it; every
    /// later one must name it too).
    arena: ArenaId,
    /// The registrations the flow's WANTs proved (see [`crate::proof`]): its DATA runs may
    /// write only inside these (those still registered).
    proven: Vec<RegId>,
    /// Byte size of each chunk announced so far, by chunk index.
    chunks: Vec<u64>,
    /// Regions of this flow being scattered.
    scattering: usize,
    /// A READ flow (a PULL): each chunk's gather runs (source addresses here). Its regions are
    /// gathered when granted, announced ready with a GRANT, and freed by the initiator's
    /// RELEASE; `scattering` then counts its gathers in flight.
    pull: Option<PullRuns>,
    /// Scatter runs that came ahead of their chunk's DATA in a PLAN, by chunk index.
    plans: BTreeMap<u32, Planned>,
    /// Chunks answered ACK(Replan): an honest sender then sends the runs with the DATA, so a
    /// second DATA without them is refused (each would push the flow's lease back and, one way,
    /// add an answer to the mailbox backlog of a flow whose initiator reads none).
    replanned: BTreeSet<u32>,
    /// The one chunk's bytes and runs from the WANT ([`wire::Inline`]), taken until the
    /// chunk's region is granted: then they are put there and scattered, with no GRANT sent.
    inline: Option<wire::Inline>,
    /// The sender's standing flow ([`wire::Standing::Open`]): it holds at most one region, for
    /// a later transfer of the sender to claim, is reclaimed like any flow when its region goes
    /// unclaimed for the idle timeout (a lease), is not watched by the liveness probe, and
    /// carries no data of its own (it proved no registration, so any DATA naming it is refused).
    standing: bool,
    /// The standing flow whose region this flow's chunk 0 claimed, until that chunk's scatter
    /// gives it back ([`AckStatus::Kept`]); should the flow end first, the standing flow is
    /// granted a fresh region instead.
    claimed_from: Option<XferId>,
    /// Reclaimed when reached while it holds regions that wait for DATA; pushed back by WANT,
    /// DATA, new grants and finished scatters.
    /// The armed instant in `Receiver::timers` stays (at most this deadline) and is re-armed
    /// when it fires.
    deadline: Instant,
    /// Its last progress: opened, given regions, a DATA or RELEASE received, a scatter or
    /// gather ended. KEEPs and WANTs or PULLs adding to it push `deadline` on only until a
    /// request timeout after this (see [`Flow::kept`]).
    progress: Instant,
    /// When the flow was last given regions (a GRANT, or its WANT's claim of a standing
    /// credit); `None` while it has waited for the arena since its WANT. See
    /// `Receiver::drop_unserved`.
    given: Option<Instant>,
    /// A region of it stayed idle past [`REGION_LEASES`] leases: it is granted nothing more
    /// (chunks it announces since are dropped as they come), so it ends by its own lease once
    /// the regions it holds are written or left.
    frozen: bool,
}

impl Flow {
    /// The flow progressed at `now`: its lease starts again.
    fn progressed(&mut self, now: Instant, idle: Duration) {
        self.deadline = now + idle;
        self.progress = now;
    }

    /// A sign of life that is not progress (a KEEP; a WANT or PULL adding chunks): the lease
    /// moves on, but never past one and a half request timeouts (three leases) after the last
    /// progress. An honest sender fails its transfer after a request timeout without progress
    /// (the smaller of the two sides'), so its write has landed or been given up by then, with
    /// half a timeout to spare; without the cap a flow that only KEEPs held its regions for
    /// ever (review 56, H1).
    fn kept(&mut self, now: Instant, idle: Duration) {
        self.deadline = (now + idle).min(self.progress + idle * 3).max(self.deadline);
    }
}

/// A scatter job in flight.
#[derive(Debug, Clone, Copy)]
struct Scatter {
    flow: FlowKey,
    /// The arena of `region`.
    arena: ArenaId,
    token: Token,
    chunk: ChunkIdx,
    region: Region,
    bytes: u64,
    /// The destination addresses its runs write, `[start, end)`.
    span: (u64, u64),
    /// Memory it writes was deregistered while it was in flight: it is answered ACK(Failed)
    /// whatever its outcome (the shell waits for it before the deregistration returns).
    doomed: bool,
    /// Its flow ended here while it ran (see [`order`]): it holds back its peer's next scatters.
    orphan: bool,
}

/// A READ flow's gather runs, kept from its PULLs (see [`wire::Pull`]).
#[derive(Debug)]
struct PullRuns {
    /// The chunks announced so far, in order.
    chunks: Vec<PulledChunk>,
    /// The transfer's chunk count: the flow stays until all have come (and ended).
    total: u32,
    /// A chunk failed: its initiator fails the transfer and cancels; later PULLs are dropped.
    failed: bool,
}

impl PullRuns {
    /// True when no PULL of the flow is still to come.
    fn complete(&self) -> bool {
        self.failed || self.chunks.len() >= self.total as usize
    }
}

/// One READ chunk's gather runs: checked against the chunk and the flow's proven
/// registrations when its PULL came.
#[derive(Debug)]
struct PulledChunk {
    /// Shared with its gathers (a region reclaimed unread is gathered again).
    runs: Arc<Vec<CopyRun>>,
    /// The source span `[start, end)`.
    span: (u64, u64),
    /// [`Registrations::removals`] at that check: while it is unchanged, every run still lies
    /// inside registered memory and a gather starts without checking its runs again.
    removals: u64,
}

/// A chunk's scatter runs kept from its PLAN until its DATA (see [`wire::Plan`]): checked
/// against the chunk and the flow's proven registrations when they came.
#[derive(Debug)]
struct Planned {
    runs: Vec<CopyRun>,
    /// [`Registrations::removals`] at that check: while it is unchanged, the runs still lie
    /// inside registered memory.
    removals: u64,
    /// The bytes the runs were bounded by at that check (the chunk's).
    limit: u64,
}

impl Flow {
    /// What the flow holds against its peer's budget ([`MAX_CHUNKS_PER_PEER`]): its announced
    /// chunks, the runs of the PLANs it keeps and, for a READ flow, the gather runs it keeps.
    fn units(&self) -> u64 {
        let runs = self.pull.as_ref().map_or(0, |p| p.chunks.iter().map(|c| c.runs.len() as u64).sum::<u64>());
        let planned = self.plans.values().map(|p| p.runs.len() as u64).sum::<u64>();
        let inline = self.inline.as_ref().map_or(0, |i| i.runs.len() as u64);
        (self.chunks.len() as u64).saturating_add(runs).saturating_add(planned).saturating_add(inline)
    }
}

/// A READ flow's gather in flight (its region is marked busy in the scheduler meanwhile).
#[derive(Debug, Clone, Copy)]
struct PullGather {
    flow: FlowKey,
    /// The arena of `region`.
    arena: ArenaId,
    token: Token,
    chunk: ChunkIdx,
    region: Region,
    /// The source addresses its runs read, `[start, end)`.
    span: (u64, u64),
    /// Memory it reads was deregistered while it ran: it is answered ACK(Failed).
    doomed: bool,
}

/// Protocol state of the transfers peers send to this engine.
///
/// Driven only by [`crate::endpoint::Endpoint`], which documents the call order.
/// - WANT queues the flow's chunks in the scheduler; an empty WANT (cancel) reclaims the flow.
///   Credits come out of the endpoint's `schedule()` calls, batched into one GRANT per flow.
/// - Every later WANT, cancel and DATA of a flow must carry the [`Token`] of the WANT that
///   created it; one that does not is dropped and counted (`control_forged`), changing nothing.
///   GRANTs and ACKs echo the flow's token.
/// - A WANT proves the registrations the flow may scatter into ([`crate::proof`]); a WANT
///   with a bad proof is refused whole and counted (`control_forged`).
/// - DATA is validated: the flow holds the named region for that chunk and is not already
///   scattering it; every run lies within the chunk's bytes and inside one registered memory
///   range. A valid DATA becomes an [`Action::Scatter`]; an invalid one is answered with
///   ACK(Refused) and its flow is reclaimed. A DATA for a flow this receiver does not know (it
///   was canceled, timed out or lost) is dropped without an answer: its sender has already
///   failed or will time out, and an ACK would only be one more late message.
/// - A finished scatter frees the region and answers ACK(Scattered) or ACK(Failed), unless the
///   flow was reclaimed meanwhile (then nobody waits for it).
/// - A flow that holds granted regions without WANT, DATA, KEEP or a new grant for half the
///   request timeout is reclaimed: its sender is presumed dead. So is every flow of a lost
///   peer. Their regions are quarantined for a quarter timeout before they are granted again
///   (a writer presumed dead may only be slow); a cancel, sent after its writer's writes have
///   ended, frees them at once, also when it comes after the reclaim (its token is kept while
///   the regions rest).
#[derive(Debug)]
pub struct Receiver {
    idle_timeout: Duration,
    /// How long a region reclaimed from a silent or lost writer rests before it is granted
    /// again: a quarter of the request timeout. A flow is reclaimed after half of it without a
    /// sign of its writer, so a late write must come three quarters of a timeout after the
    /// writer's last sign to land in a region granted since; a longer rest would let a flow
    /// waiting for that region time out first.
    quarantine: Duration,
    /// The registrations made through this engine, with their keys.
    registered: Registrations,
    flows: BTreeMap<FlowKey, Flow>,
    /// Per-peer totals over `flows`, kept in step with it (see `check_invariants`).
    load: BTreeMap<PeerId, PeerLoad>,
    /// The per-peer caps: [`MAX_FLOWS_PER_PEER`] and [`MAX_CHUNKS_PER_PEER`] (tests lower them).
    caps: PeerLoad,
    /// The cap on all peers' announced chunks together: [`MAX_CHUNKS_TOTAL`] (tests lower it).
    total_chunks_cap: u64,
    scatters: BTreeMap<JobId, Scatter>,
    /// READ flows' gathers in flight.
    gathers: BTreeMap<JobId, PullGather>,
    timers: TimerTable<FlowKey>,
    /// No new WANT is accepted (closing or shut down).
    shutting_down: bool,
    /// Largest inline chunk taken from a WANT; 0: none (a GPU arena, or the option).
    inline_bytes: u64,
    /// The arenas inline chunks are not taken into, a bit per [`ArenaId`] (GPU memory).
    inline_declined: u16,
    /// Inline bytes held by flows not yet granted (at most [`MAX_INLINE_HELD`]).
    inline_held: u64,
    /// Per party (an id's agent name once named, see [`ended::Party`]), what makes a captured
    /// frame a replay: the transfers whose flows ended here (a WANT or PULL opening one again
    /// would scatter whatever the new flow's region holds into the old transfer's
    /// destinations), and the highest transfers whose inline chunk and standing claim were
    /// taken (one at or below would land its old bytes again over newer ones). Kept while an id
    /// of the party lives, then in `evicted`.
    replay: BTreeMap<ended::Party, ended::Replay>,
    /// Who each peer id's proofs must be made by (its agent name's hash, as the shell names the
    /// frames' sender); an id never named here is taken as the empty name. Set at an id's
    /// first WANT or PULL, forgotten when the id is retired.
    initiators: BTreeMap<PeerId, Initiator>,
    /// How many live ids each name has (`initiators` counted by name).
    named_ids: BTreeMap<Initiator, usize>,
    /// The replay state of names whose last id was retired, for the name's next id (else a
    /// captured WANT of the name, sent again after its id was retired, reloaded or evicted,
    /// would open a flow again).
    evicted: ended::Evicted,
    /// Largest standing credit given to one peer (`bounce_standing_bytes`); 0: none.
    standing_bytes: u64,
    /// Each peer's standing flow (at most one) and its chunk's bytes.
    standing: BTreeMap<PeerId, (XferId, u64)>,
    /// The token of each reclaimed flow whose regions rest in quarantine: its sender's cancel,
    /// which follows its writes, frees them at once. Pruned as quarantines end.
    resting: BTreeMap<FlowKey, Token>,
    /// Per peer with open flows, when it last showed that it uses what it is granted: an
    /// admitted DATA, PLAN, KEEP or RELEASE. A WANT shows nothing (announcing costs a flooder
    /// nothing). Forgotten with the peer's last flow.
    wrote: BTreeMap<PeerId, Instant>,
    /// Per peer, its scatters still running whose flows ended here, and its DATAs they hold
    /// back (see [`order`]).
    behind: order::Behind,
    /// When each region was last given to a flow (a grant, a claim of a standing credit), by
    /// arena and offset: a region held idle past [`REGION_LEASES`] leases of that freezes its
    /// flow ([`Flow::frozen`]), whatever progress the flow makes with its other regions. Bounded
    /// by the arenas'
    /// offsets; an entry left by a freed region is overwritten by the region's next grant and
    /// never read before it.
    given_at: BTreeMap<(ArenaId, u64), Instant>,
}

/// Leases (halves of the request timeout) a granted region may stay idle (unwritten, or for a
/// READ unreleased) before its flow is frozen: granted nothing more, it then ends by its own
/// lease (at most the cap KEEPs have, [`Flow::kept`], after its last progress) once the regions
/// it holds are written or left. The flow's lease runs from its last progress, so before this
/// a sender that wrote chunks 1, 2, 3, ... held chunk 0's region for ever: a few such regions
/// placed one per max-chunk block kept every max-chunk flow out of the arena, and drain mode
/// then held every peer's grants behind it (review 61, credits H1). The flow is not reclaimed
/// at once: a write of it in flight into another region, posted on a fresh credit, could
/// outlast the quarantine and land in a region granted since. An honest sender posts its write
/// within a quarter lease of the credit and KEEPs a slow one, which lands well within this.
pub(crate) const REGION_LEASES: u32 = 3;

impl Receiver {
    pub(crate) fn new(config: &Config, _now: Instant) -> Self {
        Self {
            idle_timeout: config.request_timeout / 2,
            quarantine: config.request_timeout / 4,
            registered: Registrations::default(),
            flows: BTreeMap::new(),
            load: BTreeMap::new(),
            caps: PeerLoad { flows: MAX_FLOWS_PER_PEER, chunks: MAX_CHUNKS_PER_PEER },
            total_chunks_cap: MAX_CHUNKS_TOTAL,
            scatters: BTreeMap::new(),
            gathers: BTreeMap::new(),
            timers: TimerTable::default(),
            shutting_down: false,
            inline_bytes: config.inline_bytes.min(u64::from(wire::MAX_INLINE_BYTES)),
            inline_declined: 0,
            inline_held: 0,
            replay: BTreeMap::new(),
            initiators: BTreeMap::new(),
            named_ids: BTreeMap::new(),
            evicted: ended::Evicted::default(),
            standing_bytes: config.standing_bytes,
            standing: BTreeMap::new(),
            resting: BTreeMap::new(),
            wrote: BTreeMap::new(),
            behind: order::Behind::default(),
            given_at: BTreeMap::new(),
        }
    }

    /// Whether a WANT or PULL may name `arena` for flow `key`: one of ours, and the flow's own
    /// when the flow exists.
    fn arena_ok(&self, scheds: &ArenaSchedulers, key: FlowKey, arena: ArenaId) -> bool {
        scheds.has(arena) && self.flows.get(&key).is_none_or(|f| f.arena == arena)
    }

    /// Lowers (never raises) the largest inline chunk taken from WANTs: the shell sets 0 when
    /// its arena is not host memory, where it could not put the bytes.
    pub(crate) fn set_inline_bytes(&mut self, bytes: u64) {
        self.inline_bytes = self.inline_bytes.min(bytes);
    }

    /// Whether inline chunks are taken into `arena` (see `Endpoint::set_arena_takes_inline`).
    pub(crate) fn set_arena_takes_inline(&mut self, arena: ArenaId, takes: bool) {
        let bit = inline_bit(arena);
        self.inline_declined = if takes { self.inline_declined & !bit } else { self.inline_declined | bit };
    }

    /// The standing flow `peer` holds here ([`wire::Standing`]), if any.
    pub fn standing_flow(&self, peer: PeerId) -> Option<XferId> {
        self.standing.get(&peer).map(|&(xfer, _)| xfer)
    }

    /// Arena bytes the peers' standing flows hold (granted and not yet claimed).
    pub fn standing_held_bytes(&self, scheds: &ArenaSchedulers) -> u64 {
        self.standing.iter().map(|(&peer, &(xfer, _))| scheds.flow_held_bytes(FlowKey { peer, xfer })).sum()
    }

    /// True while the receiver tracks flow `key`.
    pub fn has_flow(&self, key: FlowKey) -> bool {
        self.flows.contains_key(&key)
    }

    /// The token of flow `key`, while it is tracked.
    pub fn flow_token(&self, key: FlowKey) -> Option<Token> {
        self.flows.get(&key).map(|f| f.token)
    }

    /// True once a shutdown or close stopped accepting WANTs.
    pub fn is_shutting_down(&self) -> bool {
        self.shutting_down
    }

    /// Whether a flow of `peer` is open here.
    pub(crate) fn has_flows(&self, peer: PeerId) -> bool {
        self.flows.range(FlowKey::all_of(peer)).next().is_some()
    }

    /// Remote flows tracked (with pending chunks, granted or scattering regions).
    pub fn flows(&self) -> usize {
        self.flows.len()
    }

    /// Flows that wait on their sender: all but the standing ones (`standing` holds exactly the
    /// standing flows of `flows`, which [`Self::check_invariants`] checks).
    pub fn waiting_flows(&self) -> usize {
        self.flows.len().saturating_sub(self.standing.len())
    }

    /// Adds the peers whose flows we track (the liveness probe watches them). Runs after every
    /// input, so it visits one flow per peer (flows are ordered by peer), not every flow: a
    /// peer with thousands of flows costs one lookup.
    pub(crate) fn peers_waited_on(&self, out: &mut std::collections::BTreeSet<PeerId>) {
        let mut from = FlowKey { peer: PeerId(0), xfer: crate::types::XferId(0) };
        while let Some(k) = self.flows.range(from..).next().map(|(k, _)| *k) {
            // A standing flow waits for nothing (its lease ends it): a peer with no other flow
            // here is not probed for it, so two idle engines stay quiet. It has at most one.
            let mut flows = self.flows.range(k..).take_while(|(f, _)| f.peer == k.peer).take(2);
            if flows.any(|(_, f)| !f.standing) {
                out.insert(k.peer);
            }
            let Some(next) = k.peer.0.checked_add(1) else { break };
            from = FlowKey { peer: PeerId(next), xfer: crate::types::XferId(0) };
        }
    }

    /// Scatter jobs emitted and not yet reported (those of reclaimed flows included).
    pub fn scatters_in_flight(&self) -> usize {
        self.gathers.len() + self.scatters_only()
    }

    fn scatters_only(&self) -> usize {
        self.scatters.len()
    }

    /// The registrations DATA runs may target, once a flow proved them.
    pub fn registrations(&self) -> &Registrations {
        &self.registered
    }

    pub(crate) fn add_registered(&mut self, reg: RegId, key: RegKey, (addr, len): (u64, u64), arena: ArenaId) {
        if !self.registered.add(reg, key, (addr, len), arena) {
            warn!(reg = reg.0, addr, len, "ignoring an empty or wrapping registered range");
        }
    }

    pub(crate) fn remove_registered(&mut self, reg: RegId) {
        if !self.registered.remove(reg) {
            warn!(reg = reg.0, "removing a registration that is not known");
        }
    }

    /// Removes registration `reg` of `[addr, addr + len)` (as [`Self::remove_registered`]) and
    /// dooms every scatter or gather in flight that may touch memory the range loses: each is
    /// answered ACK(Failed), so its sender's transfer ends in an error. Later DATA naming the
    /// range is refused by validation.
    pub(crate) fn deregister(&mut self, ctx: &mut Ctx<'_>, reg: Option<RegId>, addr: u64, len: u64) {
        if let Some(reg) = reg {
            self.remove_registered(reg);
        }
        let end = addr.saturating_add(len);
        let (flows, registered) = (&self.flows, &self.registered);
        // A job's runs lie inside its flow's proven registrations, so it can touch the range
        // only when the flow proved `reg`; its span is only a hull, which may straddle memory
        // the flow never proved (another registration, or none, between two of its own). A job
        // whose flow is gone, or a range with no id, is judged by the span alone.
        let touches = |flow: &FlowKey, span: (u64, u64)| {
            let (lo, hi) = (span.0.max(addr), span.1.min(end));
            lo < hi
                && match (reg, flows.get(flow)) {
                    (Some(reg), Some(f)) => f.proven.contains(&reg),
                    _ => true,
                }
                // Memory another registration still covers stays the application's to write.
                && !registered.covers_any(lo, hi)
        };
        for s in self.scatters.values_mut() {
            if !s.doomed && touches(&s.flow, s.span) {
                debug!(
                    peer = s.flow.peer.0,
                    xfer = s.flow.xfer.0,
                    chunk = s.chunk.0,
                    "scatter into deregistered memory: doomed"
                );
                s.doomed = true;
                ctx.stats.dereg_failed += 1;
            }
        }
        for g in self.gathers.values_mut() {
            if !g.doomed && touches(&g.flow, g.span) {
                debug!(
                    peer = g.flow.peer.0,
                    xfer = g.flow.xfer.0,
                    chunk = g.chunk.0,
                    "gather from deregistered memory: doomed"
                );
                g.doomed = true;
                ctx.stats.dereg_failed += 1;
            }
        }
    }

    /// Who `peer`'s proofs must be made by ([`Self::name_initiator`]).
    /// The proof that fails, if `msg` opens a one-way flow (a WANT or PULL answered through
    /// our mailbox) with proofs that the agent `name` did not make: a forgery. A proof naming
    /// a registration since removed, or the wrong arena, is not one (its sender holds the key,
    /// and is answered with a refusal).
    pub(crate) fn forged_opening(&self, name: &str, msg: &wire::Msg) -> Option<BadProof> {
        let by = Initiator::named(name);
        let checked = match msg {
            wire::Msg::Want(w) if w.endpoint == wire::REPLY_MAILBOX && !w.is_cancel() => {
                self.registered.verify_opening((w.token, w.xfer), &by, &w.proofs, w.arena)
            }
            wire::Msg::Pull(p) if p.endpoint == wire::REPLY_MAILBOX && !p.is_cancel() => {
                self.registered.verify_opening((p.token, p.xfer), &by, &p.proofs, p.arena)
            }
            _ => return None,
        };
        match checked {
            Ok(_) | Err(BadProof::Deregistered(_) | BadProof::WrongArena(..)) => None,
            Err(forged) => Some(forged),
        }
    }

    pub(crate) fn initiator_of(&self, peer: PeerId) -> Initiator {
        self.initiators.get(&peer).copied().unwrap_or_default()
    }

    /// `peer` is the agent `by()` names (the shell's name for the sender of its frames): its
    /// proofs must be made by it, and its frames are checked against its name's replay state
    /// (see [`ended::Party`]). Set once per id (an id never changes name), so `by` is asked
    /// only at an id's first frame; the first live id of a name takes back the state its
    /// retired ids left.
    pub(crate) fn name_initiator(&mut self, peer: PeerId, by: impl FnOnce() -> Initiator) {
        let std::collections::btree_map::Entry::Vacant(v) = self.initiators.entry(peer) else { return };
        let by = *v.insert(by());
        let live = self.named_ids.entry(by).or_default();
        *live += 1;
        let mut state = if *live == 1 { self.evicted.take(&by).unwrap_or_default() } else { Default::default() };
        // Whatever the id did before it was named (nothing, as the endpoint names an id at its
        // first WANT or PULL) goes with it.
        if let Some(before) = self.replay.remove(&ended::Party::Id(peer)) {
            state.merge(before);
        }
        self.replay.entry(ended::Party::Name(by)).or_default().merge(state);
    }

    /// Whose replay state `peer`'s frames are checked against.
    fn party(&self, peer: PeerId) -> ended::Party {
        self.initiators.get(&peer).map_or(ended::Party::Id(peer), |&n| ended::Party::Name(n))
    }

    /// `peer`'s replay state (see [`Self::party`]).
    fn replay_of(&self, peer: PeerId) -> Option<&ended::Replay> {
        self.replay.get(&self.party(peer))
    }

    /// `peer`'s replay state, made on first use.
    fn replay_mut(&mut self, peer: PeerId) -> &mut ended::Replay {
        let party = self.party(peer);
        self.replay.entry(party).or_default()
    }

    /// Stops accepting WANTs (the engine is closing); flows already open keep their regions
    /// until their DATA, cancel, reclaim or [`Self::shutdown`].
    pub(crate) fn close(&mut self) {
        self.shutting_down = true;
    }

    /// Regions granted to remote flows and not yet returned (scattering ones included): where
    /// a peer may still write.
    pub(crate) fn grants_outstanding(&self, scheds: &ArenaSchedulers) -> usize {
        self.flows.keys().map(|&k| scheds.flow_held_count(k)).sum()
    }

    pub(crate) fn next_timeout(&self) -> Option<Instant> {
        self.timers.next()
    }

    pub(crate) fn handle_want(&mut self, ctx: &mut Ctx<'_>, from: PeerId, want: Want) -> Result<(), ProtocolError> {
        let key = FlowKey { peer: from, xfer: want.xfer };
        // A cancel or further WANT for a live flow must carry the token of the WANT that
        // created it: otherwise anyone who can guess a transfer id could reclaim the flow.
        if self.flows.get(&key).is_some_and(|f| f.token != want.token) {
            ctx.stats.control_forged += 1;
            return Err(ProtocolError::WrongToken { peer: from, xfer: want.xfer });
        }
        if want.is_cancel() && !self.flows.contains_key(&key) {
            return self.cancel_resting(ctx, key, want.token);
        }
        if want.is_cancel() {
            debug!(peer = from.0, xfer = want.xfer.0, "cancel");
            // Sent after the writes of the transfer ended: nothing can land any more.
            self.reclaim(ctx, key, Reuse::Now);
            return Ok(());
        }
        // A standing flow's id carries STANDING_XFER_BIT and a transfer's never (the sender's
        // rule): else an Open, which proves nothing, sent under a peer's published name and
        // session by anyone holding its metadata, would end in the transfers' replay window
        // and could push it past every id of the real peer's (review 59, H1).
        if (want.xfer.0 & STANDING_XFER_BIT != 0) != (want.standing == Standing::Open) {
            ctx.stats.control_forged += 1;
            return Err(ProtocolError::StandingWant { peer: from, xfer: want.xfer });
        }
        if !self.flows.contains_key(&key) {
            self.refuse_replay(ctx, key)?;
        }
        if self.shutting_down {
            debug!(peer = from.0, xfer = want.xfer.0, "WANT refused: shutting down");
            refuse_want(ctx, from, &want);
            return Ok(());
        }
        if !self.arena_ok(ctx.scheds, key, want.arena) {
            refuse_want(ctx, from, &want);
            return Err(ProtocolError::WrongArena { peer: from, xfer: want.xfer, arena: want.arena });
        }
        let live = self.flows.get(&key);
        // A READ flow's chunks are gathered from its PULLs' runs: a WANT adding chunks to it
        // would be granted regions no run fills (only its own initiator holds the token).
        if live.is_some_and(|f| f.pull.is_some()) {
            return Err(ProtocolError::WantForReadFlow { peer: from, xfer: want.xfer });
        }
        if live.is_some_and(|f| f.standing) || (live.is_some() && want.standing == Standing::Open) {
            return Err(ProtocolError::StandingWant { peer: from, xfer: want.xfer });
        }
        let load = self.load.get(&from).copied().unwrap_or_default();
        let flows = load.flows + usize::from(!self.flows.contains_key(&key));
        let chunks = load.chunks.saturating_add(want.chunks.len() as u64);
        if flows > self.caps.flows || chunks > self.caps.chunks {
            refuse_want(ctx, from, &want);
            return Err(ProtocolError::PeerOverLimit { peer: from, xfer: want.xfer, flows, chunks });
        }
        if let Err(total) = self.within_total(want.chunks.len() as u64) {
            refuse_want(ctx, from, &want);
            return Err(ProtocolError::OverTotalLimit { peer: from, xfer: want.xfer, chunks: total });
        }
        if want.standing == Standing::Open {
            return self.open_standing(ctx, from, want, PeerLoad { flows, chunks });
        }
        // Where the flow may scatter: only registrations whose metadata the sender holds.
        // The WANT that opens a flow must prove one at least, one way or two way: a loaded
        // peer's name and session are published, so a WANT proving nothing could come from
        // anyone holding its metadata, and its flows would hold our arena under that peer's
        // share (review 56, H1). Every honest WANT proves its destinations.
        let opens = !self.flows.contains_key(&key);
        let by = self.initiator_of(from);
        let proven = match if opens {
            self.registered.verify_opening((want.token, want.xfer), &by, &want.proofs, want.arena)
        } else {
            self.registered.verify((want.token, want.xfer), &by, &want.proofs, want.arena)
        } {
            Ok(proven) => {
                ctx.stats.frames_authentic += 1;
                proven
            }
            Err(source @ (BadProof::Deregistered(_) | BadProof::WrongArena(..))) => {
                // An honest sender whose WANT crossed the deregistration of its destination:
                // it learns at once instead of waiting for credits until its timeout. One
                // that named the wrong arena holds the key (it could write there through
                // UCX): refused too, and nothing is scattered.
                refuse_want(ctx, from, &want);
                return Err(ProtocolError::BadProof { peer: from, xfer: want.xfer, source });
            }
            Err(source) => {
                // A forgery gets no answer: it must not make this engine act.
                ctx.stats.control_forged += 1;
                return Err(ProtocolError::BadProof { peer: from, xfer: want.xfer, source });
            }
        };
        let claimed = match want.standing {
            Standing::Claim { xfer, token } => Some(self.claimable(ctx, from, &want, xfer, token)?),
            _ => None,
        };
        let now = ctx.now;
        let queued = match claimed {
            // Chunk 0 takes the standing region; the chunks after it queue as usual.
            Some(standing) => ctx.sched(want.arena).want_from(key, 1, &want.chunks[1..]).and_then(|()| {
                let sched = ctx.sched(want.arena);
                let adopted = sched.adopt(standing.flow, standing.region.offset, key, ChunkIdx(0));
                if adopted.is_ok() {
                    self.given_at.insert((want.arena, standing.region.offset), now);
                }
                if adopted.is_err() {
                    // Only queued, never granted: nothing to free.
                    sched.reclaim_flow(key, Reuse::Now);
                }
                adopted.map(drop)
            }),
            None => ctx.sched(want.arena).want(key, &want.chunks),
        };
        if let Err(source) = queued {
            refuse_want(ctx, from, &want);
            return Err(ProtocolError::BadWant { peer: from, xfer: want.xfer, source });
        }
        if let Some(standing) = claimed {
            // The region goes back to the standing flow when this chunk is scattered.
            self.replay_mut(from).claim_floor = Some(want.xfer);
            ctx.stats.standing_taken += 1;
            trace!(peer = from.0, xfer = want.xfer.0, region = %standing.region, "standing credit claimed");
        }
        let inline = match want.inline {
            Some(i) if self.flows.contains_key(&key) => {
                debug!(
                    peer = from.0,
                    xfer = want.xfer.0,
                    bytes = i.bytes.len(),
                    "inline bytes for a live flow ignored"
                );
                None
            }
            Some(i) => self.take_inline(from, (want.xfer, want.arena), (chunks, want.chunks.len() as u64), i),
            None => None,
        };
        let chunks = chunks + inline.as_ref().map_or(0, |i| i.runs.len() as u64);
        self.load.insert(from, PeerLoad { flows, chunks });
        ctx.stats.wants += 1;
        let deadline = ctx.now + self.idle_timeout;
        match self.flows.get_mut(&key) {
            Some(flow) => {
                flow.chunks.extend_from_slice(&want.chunks);
                // Sorted and deduplicated in one go: a membership test per proof was
                // quadratic in what the flow proved (review 56, L2).
                flow.proven.extend(proven);
                flow.proven.sort_unstable();
                flow.proven.dedup();
                flow.kept(ctx.now, self.idle_timeout);
                if flow.frozen {
                    ctx.scheds.drop_pending(key);
                }
            }
            None => {
                self.timers.set(key, deadline);
                let flow = Flow {
                    token: want.token,
                    arena: want.arena,
                    proven,
                    chunks: want.chunks,
                    scattering: 0,
                    pull: None,
                    plans: BTreeMap::new(),
                    replanned: BTreeSet::new(),
                    inline,
                    standing: false,
                    claimed_from: claimed.map(|g| g.flow.xfer),
                    deadline,
                    progress: ctx.now,
                    given: claimed.map(|_| ctx.now),
                    frozen: false,
                };
                self.flows.insert(key, flow);
            }
        }
        debug!(peer = from.0, xfer = want.xfer.0, chunks = self.flows[&key].chunks.len(), "flow wants");
        // An inline chunk's runs are checked now, as a DATA's would be (and again when its
        // region is granted, should a registration go meanwhile): a bad one refuses the WANT.
        let flow = &self.flows[&key];
        if let Some(i) = &flow.inline {
            if let Err(fault) = self.check_runs(flow, &i.runs, i.bytes.len() as u64) {
                ctx.stats.data_refused += 1;
                ctx.stats.data_runs_refused += 1;
                refuse_xfer(ctx, from, key.xfer, flow.token);
                self.reclaim(ctx, key, self.rest(ctx));
                return Err(ProtocolError::InvalidData { peer: from, xfer: key.xfer, chunk: ChunkIdx(0), fault });
            }
        }
        Ok(())
    }

    /// A KEEP: one of the sender's writes into this flow's regions is still in flight, so the
    /// flow is not silent: its deadline moves on (the timer re-arms when it fires). A KEEP
    /// for a flow that is gone is late and ignored; one with the wrong token is forged.
    pub(crate) fn handle_keep(&mut self, ctx: &mut Ctx<'_>, from: PeerId, keep: Keep) -> Result<(), ProtocolError> {
        let key = FlowKey { peer: from, xfer: keep.xfer };
        let Some(flow) = self.flows.get_mut(&key) else {
            trace!(peer = from.0, xfer = keep.xfer.0, "KEEP for an unknown flow ignored");
            return Ok(());
        };
        if flow.token != keep.token {
            ctx.stats.control_forged += 1;
            return Err(ProtocolError::WrongToken { peer: from, xfer: keep.xfer });
        }
        flow.kept(ctx.now, self.idle_timeout);
        self.wrote.insert(from, ctx.now);
        Ok(())
    }

    /// A PLAN: the runs of a chunk whose DATA is still to come. Checked now, against the chunk
    /// and the flow's proven registrations, and kept for the DATA (counted against the peer's
    /// budget meanwhile). One that is late, over the budget, a duplicate or invalid is dropped,
    /// changing nothing: a DATA that finds no plan asks for its runs (ACK(Replan)) and is
    /// checked whole, so a PLAN can never get more through than a DATA could.
    pub(crate) fn handle_plan(
        &mut self,
        ctx: &mut Ctx<'_>,
        from: PeerId,
        plan: wire::Plan,
    ) -> Result<(), ProtocolError> {
        let key = FlowKey { peer: from, xfer: plan.xfer };
        let Some(flow) = self.addressed_flow(ctx, key, plan.token, plan.chunk, "PLAN")? else { return Ok(()) };
        let (xfer, chunk) = (plan.xfer, plan.chunk);
        let fault = match flow.chunks.get(chunk.0 as usize) {
            None => Some(DataFault::ChunkMismatch),
            Some(_) if flow.pull.is_some() || flow.plans.contains_key(&chunk.0) => Some(DataFault::NotHeld),
            Some(&bytes) => self.check_runs(flow, &plan.runs, bytes).err(),
        };
        if let Some(fault) = fault {
            ctx.stats.plans_dropped += 1;
            return Err(ProtocolError::InvalidData { peer: from, xfer, chunk, fault });
        }
        self.wrote.insert(from, ctx.now);
        let runs = plan.runs.len() as u64;
        // Kept runs count as announced units, against the peer's budget and all peers' (many
        // one-way names each within its own budget would otherwise park gigabytes of runs).
        let load = self.load.get(&from).copied().unwrap_or_default();
        if load.chunks.saturating_add(runs) > self.caps.chunks || self.within_total(runs).is_err() {
            debug!(peer = from.0, xfer = xfer.0, chunk = chunk.0, runs, "PLAN dropped: over the peers' budget");
            ctx.stats.plans_dropped += 1;
            return Ok(());
        }
        self.load.entry(from).or_default().chunks += runs;
        let removals = self.registered.removals();
        if let Some(flow) = self.flows.get_mut(&key) {
            let limit = flow.chunks[chunk.0 as usize];
            flow.plans.insert(chunk.0, Planned { runs: plan.runs, removals, limit });
        }
        ctx.stats.plans_kept += 1;
        Ok(())
    }

    /// The flow a sender's PLAN or DATA (`kind`) names: `None` when it is gone (the frame is
    /// late: dropped without an answer, counted); an error when the frame lacks the flow's
    /// token (forged: counted, and neither answered nor a reclaim, since the flow belongs to
    /// its real sender).
    fn addressed_flow(
        &self,
        ctx: &mut Ctx<'_>,
        key: FlowKey,
        token: Token,
        chunk: ChunkIdx,
        kind: &str,
    ) -> Result<Option<&Flow>, ProtocolError> {
        let Some(flow) = self.flows.get(&key) else {
            trace!(
                peer = key.peer.0,
                xfer = key.xfer.0,
                chunk = chunk.0,
                kind,
                "late frame for an unknown flow dropped"
            );
            ctx.stats.late_data += 1;
            return Ok(None);
        };
        if flow.token != token {
            ctx.stats.control_forged += 1;
            return Err(ProtocolError::WrongToken { peer: key.peer, xfer: key.xfer });
        }
        ctx.stats.frames_authentic += 1;
        Ok(Some(flow))
    }

    /// Takes the plan flow `key` keeps for `chunk`, giving its runs back to the peer's budget.
    fn take_plan(&mut self, key: FlowKey, chunk: ChunkIdx) -> Option<Planned> {
        let planned = self.flows.get_mut(&key)?.plans.remove(&chunk.0)?;
        if let Some(load) = self.load.get_mut(&key.peer) {
            load.chunks -= planned.runs.len() as u64;
        }
        Some(planned)
    }

    pub(crate) fn handle_data(&mut self, ctx: &mut Ctx<'_>, from: PeerId, data: Data) -> Result<(), ProtocolError> {
        self.take_data(ctx, from, data, None)
    }

    /// A DATA, or (with `inline`) the bytes and runs of an inline chunk whose region was just
    /// granted, dressed as the DATA for that region: the same checks, the same scatter, the
    /// bytes put in the region first.
    fn take_data(
        &mut self,
        ctx: &mut Ctx<'_>,
        from: PeerId,
        mut data: Data,
        inline: Option<Vec<u8>>,
    ) -> Result<(), ProtocolError> {
        let key = FlowKey { peer: from, xfer: data.xfer };
        let Some(flow) = self.addressed_flow(ctx, key, data.token, data.chunk, "DATA")? else { return Ok(()) };
        let (bytes, limit) = match self.check_held(ctx, key, flow, &data) {
            Ok(held) => held,
            Err(fault) => return self.refuse_data(ctx, from, &data, fault),
        };
        if inline.is_none() {
            self.wrote.insert(from, ctx.now);
        }
        // A DATA with its runs makes any plan of the chunk moot; one without takes the plan.
        let planned = self.take_plan(key, data.chunk);
        if data.region_plan_runs != 0 {
            return self.scatter_in_region(ctx, from, key, data, bytes, limit);
        }
        let (mut still_registered, mut still_bounded) = (false, false);
        if data.runs.is_empty() {
            let Some(planned) = planned else {
                // Nothing kept for the chunk (dropped, or never sent): ask for the runs with
                // the DATA, once. The region stays held for it. Not an inline chunk's: its
                // sender holds no credit to send a DATA with, and would wait out its timeout
                // (review 62): refused, it fails at once.
                let again = inline.is_none();
                let Some(flow) = self.flows.get_mut(&key).filter(|f| again && !f.replanned.contains(&data.chunk.0))
                else {
                    return self.refuse_data(ctx, from, &data, DataFault::NoRuns);
                };
                flow.replanned.insert(data.chunk.0);
                flow.progressed(ctx.now, self.idle_timeout);
                ctx.stats.replans += 1;
                let (xfer, token, chunk, region) = (data.xfer, data.token, data.chunk, data.region);
                ctx.send(from, Ack { xfer, token, chunk, region, status: AckStatus::Replan });
                return Ok(());
            };
            still_registered = planned.removals == self.registered.removals();
            still_bounded = planned.limit <= limit;
            data.runs = planned.runs;
        }
        let flow = &self.flows[&key];
        // A plan's runs were checked when it came, against the registrations and the chunk's
        // bytes: unless a registration was removed since, or the region holds fewer bytes than
        // the chunk, they need no second pass (thousands of runs: tens of microseconds on the
        // receiver's critical path, issue 11).
        let checked = match (still_registered, still_bounded) {
            (true, true) => Ok(()),
            (true, false) => self.check_bounds(&data.runs, limit),
            (false, _) => self.check_runs(flow, &data.runs, limit),
        };
        if let Err(fault) = checked {
            return self.refuse_data(ctx, from, &data, fault);
        }
        if self.behind.holds(from) {
            return self.hold_data(ctx, key, data, inline, limit);
        }
        let Some((job, arena)) = self.begin_scatter(ctx, key, data.region) else { return Ok(()) };
        // Validation checked every run's span, so this fold cannot see a `None`.
        let span = data
            .runs
            .iter()
            .filter_map(CopyRun::addr_span)
            .fold((u64::MAX, 0), |(lo, hi), (a, b)| (lo.min(a), hi.max(b)));
        let scatter = Scatter {
            flow: key,
            arena,
            token: data.token,
            chunk: data.chunk,
            region: data.region,
            bytes,
            span,
            doomed: false,
            orphan: false,
        };
        self.scatters.insert(job, scatter);
        trace!(peer = from.0, xfer = data.xfer.0, chunk = data.chunk.0, region = %data.region, runs = data.runs.len(), "scatter");
        ctx.stats.inline_taken += u64::from(inline.is_some());
        ctx.push(Action::Scatter {
            job,
            peer: from,
            xfer: data.xfer,
            arena,
            region: data.region,
            runs: JobRuns::Own(data.runs),
            in_region: None,
            inline,
        });
        Ok(())
    }

    /// Marks `region` of flow `key` as scattering (a DATA passed its checks) and returns the
    /// job that will scatter it and the flow's arena; `None` only on an inconsistency (logged).
    fn begin_scatter(&mut self, ctx: &mut Ctx<'_>, key: FlowKey, region: Region) -> Option<(JobId, ArenaId)> {
        let Some(flow) = self.flows.get_mut(&key) else {
            internal_error("begin_scatter for a flow not known", &key.xfer.0);
            return None;
        };
        if let Err(e) = ctx.sched(flow.arena).begin_scatter(key, region.offset) {
            internal_error("begin_scatter after a successful validation", &e);
            return None;
        }
        flow.scattering += 1;
        flow.progressed(ctx.now, self.idle_timeout);
        Some((ctx.job(), flow.arena))
    }

    /// A DATA whose runs lie in its region: the plan must fill the end of the chunk's bytes
    /// (all of them written, none beyond); the copy engine checks the runs themselves against
    /// the data before the plan and the flow's proven registrations as they are now.
    fn scatter_in_region(
        &mut self,
        ctx: &mut Ctx<'_>,
        from: PeerId,
        key: FlowKey,
        data: Data,
        bytes: u64,
        limit: u64,
    ) -> Result<(), ProtocolError> {
        let runs = data.region_plan_runs;
        let Some(offset) = wire::region_plan::plan_offset(bytes, runs).filter(|_| limit == bytes) else {
            return self.refuse_data(ctx, from, &data, DataFault::RunOutsideChunk { index: 0 });
        };
        let allowed = self.registered.proven_ranges(&self.flows[&key].proven);
        let Some(span) = allowed.hull() else {
            // Nothing left that the peer may write: every run would fail.
            return self.refuse_data(ctx, from, &data, DataFault::RunOutsideRegistered { index: 0 });
        };
        if self.behind.holds(from) {
            return self.hold_data(ctx, key, data, None, limit);
        }
        let Some((job, arena)) = self.begin_scatter(ctx, key, data.region) else { return Ok(()) };
        // The scatter may touch any proven registration: a deregistration inside the hull dooms
        // it (conservative; the runs are not known here).
        let (token, chunk, region) = (data.token, data.chunk, data.region);
        let scatter =
            Scatter { flow: key, arena, token, chunk, region, bytes: offset, span, doomed: false, orphan: false };
        self.scatters.insert(job, scatter);
        trace!(peer = from.0, xfer = data.xfer.0, chunk = chunk.0, region = %region, runs, "scatter by region plan");
        ctx.stats.region_plans_received += 1;
        let in_region = Some(InRegionPlan { offset, runs, allowed });
        ctx.push(Action::Scatter {
            job,
            peer: from,
            xfer: data.xfer,
            arena,
            region,
            runs: JobRuns::Own(Vec::new()),
            in_region,
            inline: None,
        });
        Ok(())
    }

    pub(crate) fn handle_scatter_done(&mut self, ctx: &mut Ctx<'_>, job: JobId, ok: bool) {
        let Some(s) = self.scatters.remove(&job) else {
            warn!(job = job.0, "scatter done-event for an unknown job; ignored");
            return;
        };
        let orphan = s.orphan.then_some(s.flow.peer);
        self.end_scatter(ctx, s, ok);
        if let Some(peer) = orphan {
            self.orphan_ended(ctx, peer);
        }
    }

    /// Scatter `s` ended: frees (or keeps for the standing flow) its region and answers.
    fn end_scatter(&mut self, ctx: &mut Ctx<'_>, s: Scatter, ok: bool) {
        let ok = ok && !s.doomed;
        let claimed = self.flows.get(&s.flow).and_then(|f| f.claimed_from).filter(|_| s.chunk.0 == 0);
        if let Some(xfer) = claimed {
            if let Some(f) = self.flows.get_mut(&s.flow) {
                f.claimed_from = None;
            }
            match ok.then(|| self.keep_standing(ctx, s.flow, xfer, (s.arena, s.region))).flatten() {
                Some(true) => return self.scattered(ctx, s, true, AckStatus::Kept),
                // Orphaned meanwhile, and freed: nobody waits for the ACK.
                Some(false) => return self.count_scatter(ctx, &s, ok),
                None => self.rearm_standing(ctx, s.flow.peer),
            }
        }
        let end = match ctx.sched(s.arena).end_scatter(s.region.offset) {
            Ok(end) => end,
            Err(e) => return internal_error("end_scatter of a scatter job", &e),
        };
        trace!(
            peer = s.flow.peer.0,
            xfer = s.flow.xfer.0,
            chunk = s.chunk.0,
            ok,
            orphaned = end.orphaned,
            "scatter done"
        );
        if end.orphaned {
            // The flow was reclaimed while this scatter ran: nobody waits for the ACK.
            self.count_scatter(ctx, &s, ok);
            return;
        }
        let status = if ok { AckStatus::Scattered } else { AckStatus::Failed };
        self.scattered(ctx, s, ok, status);
    }

    fn count_scatter(&self, ctx: &mut Ctx<'_>, s: &Scatter, ok: bool) {
        if ok {
            ctx.stats.chunks_scattered += 1;
            ctx.stats.bytes_scattered += s.bytes;
        } else {
            ctx.stats.scatters_failed += 1;
        }
    }

    /// A scatter of a live flow ended (its region freed, or kept for the standing flow):
    /// counts it, answers `status` and forgets the flow if that was its last region.
    fn scattered(&mut self, ctx: &mut Ctx<'_>, s: Scatter, ok: bool, status: AckStatus) {
        self.count_scatter(ctx, &s, ok);
        ctx.send(s.flow.peer, Ack { xfer: s.flow.xfer, token: s.token, chunk: s.chunk, region: s.region, status });
        if let Some(flow) = self.flows.get_mut(&s.flow) {
            flow.scattering -= 1;
            flow.progressed(ctx.now, self.idle_timeout);
        }
        if !ctx.scheds.has_flow(s.flow) {
            self.forget(s.flow);
            debug!(peer = s.flow.peer.0, xfer = s.flow.xfer.0, "flow done");
        }
    }

    /// Sends fresh credits, one GRANT per flow (split only beyond the wire's credit cap).
    pub(crate) fn emit_grants(&mut self, ctx: &mut Ctx<'_>, grants: Vec<SchedGrant>) {
        ctx.stats.credits_granted += grants.len() as u64;
        // One batch per flow, in the order the flows were first granted.
        let mut batches: Vec<(FlowKey, Vec<Credit>)> = Vec::new();
        let mut index: BTreeMap<FlowKey, usize> = BTreeMap::new();
        for g in grants {
            let credit = Credit { chunk: g.chunk, region: g.region };
            let i = *index.entry(g.flow).or_insert_with(|| {
                batches.push((g.flow, Vec::new()));
                batches.len() - 1
            });
            batches[i].1.push(credit);
        }
        for (key, mut credits) in batches {
            let token = match self.flows.get_mut(&key) {
                Some(flow) => {
                    flow.progressed(ctx.now, self.idle_timeout);
                    flow.given = Some(ctx.now);
                    for c in &credits {
                        self.given_at.insert((flow.arena, c.region.offset), ctx.now);
                    }
                    flow.token
                }
                None => {
                    internal_error("grant for a flow the receiver does not track", &key.xfer.0);
                    continue;
                }
            };
            if self.flows.get(&key).is_some_and(|f| f.pull.is_some()) {
                self.start_gathers(ctx, key, token, &credits);
                continue;
            }
            if let Some(at) = credits.iter().position(|c| c.chunk.0 == 0) {
                if let Some(inline) = self.untake_inline(key) {
                    let credit = credits.remove(at);
                    self.scatter_inline(ctx, key, token, credit.region, inline);
                }
            }
            if credits.is_empty() {
                continue;
            }
            trace!(peer = key.peer.0, xfer = key.xfer.0, credits = credits.len(), "grant");
            for part in credits.chunks(wire::MAX_CREDITS as usize) {
                ctx.send(key.peer, Grant { xfer: key.xfer, token, credits: part.to_vec() });
            }
        }
    }

    /// `Ok` when `more` announced units keep all peers' together within
    /// [`MAX_CHUNKS_TOTAL`]; else the total they would make. Summed from the per-peer loads
    /// (a few entries, at most a few thousand one-way names) rather than kept beside them.
    pub(super) fn within_total(&self, more: u64) -> Result<(), u64> {
        let total = self.load.values().fold(more, |t, l| t.saturating_add(l.chunks));
        if total > self.total_chunks_cap { Err(total) } else { Ok(()) }
    }

    /// Lowers the cap on all peers' announced chunks together (tests).
    #[cfg(test)]
    pub(crate) fn set_total_chunks_cap(&mut self, chunks: u64) {
        self.total_chunks_cap = chunks;
    }

    /// Lowers the per-peer caps (tests: reaching the real ones takes thousands of flows).
    #[cfg(test)]
    pub(crate) fn set_peer_caps(&mut self, flows: usize, chunks: u64) {
        self.caps = PeerLoad { flows, chunks };
    }

    /// Checks that the per-peer totals match the open flows; `Err` describes the first
    /// mismatch. For tests, simulations and fuzzing.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut recount: BTreeMap<PeerId, PeerLoad> = BTreeMap::new();
        for (key, flow) in &self.flows {
            let l = recount.entry(key.peer).or_default();
            l.flows += 1;
            l.chunks += flow.units();
        }
        if recount != self.load {
            return Err(format!("per-peer load {:?} but the open flows add up to {:?}", self.load, recount));
        }
        let standing: BTreeMap<PeerId, (XferId, u64)> =
            self.flows.iter().filter(|(_, f)| f.standing).map(|(k, f)| (k.peer, (k.xfer, f.chunks[0]))).collect();
        if standing != self.standing {
            return Err(format!("standing flows {:?} but the open flows have {standing:?}", self.standing));
        }
        if let Some(peer) = self.wrote.keys().find(|p| !self.load.contains_key(p)) {
            return Err(format!("peer {} is remembered as writing but has no open flow", peer.0));
        }
        let held: u64 = self.flows.values().filter_map(|f| f.inline.as_ref()).map(|i| i.bytes.len() as u64).sum();
        if held != self.inline_held || held > MAX_INLINE_HELD {
            return Err(format!("inline bytes held {} but the open flows hold {held}", self.inline_held));
        }
        self.check_behind()?;
        let total = recount.values().fold(0u64, |t, l| t.saturating_add(l.chunks));
        if total > self.total_chunks_cap {
            return Err(format!("all peers hold {total} chunks, over the cap of {}", self.total_chunks_cap));
        }
        match recount.iter().find(|(_, l)| l.flows > self.caps.flows || l.chunks > self.caps.chunks) {
            Some((peer, l)) => Err(format!("peer {} holds {l:?}, over the per-peer caps", peer.0)),
            None => Ok(()),
        }
    }
}

/// Answers a WANT this receiver will not serve with an ACK(Refused) naming no credit (chunk 0,
/// the one-byte region at offset 0: a refusal of the whole transfer, see
/// [`crate::sender::Sender`]), so its sender fails at once instead of waiting for credits until
/// its timeout. A flow that exists keeps going: only a refused WANT is answered.
/// Arena `arena`'s bit in `Receiver::inline_declined` (MAX_ARENAS, 16, bits).
fn inline_bit(arena: ArenaId) -> u16 {
    1 << (arena.0 & 15)
}

fn refuse_want(ctx: &mut Ctx<'_>, to: PeerId, want: &Want) {
    refuse_xfer(ctx, to, want.xfer, want.token);
}

/// The refusal [`refuse_want`] sends, for transfer `xfer` of token `token`.
fn refuse_xfer(ctx: &mut Ctx<'_>, to: PeerId, xfer: XferId, token: Token) {
    let region = Region { offset: 0, len: 1 };
    ctx.send(to, Ack { xfer, token, chunk: ChunkIdx(0), region, status: AckStatus::Refused });
}

mod checks;
mod ended;
mod inline;
mod order;
mod read;
mod reclaim;
mod standing;
#[cfg(test)]
mod tests;
