//! The sender role (design §6, §8 "Sender chunk/request lifecycle", §9): the table of transfers
//! this engine submitted and the life of each of their chunks, WANT -> credit -> gather ->
//! write -> DATA -> ACK, or for a direct chunk (its source already laid out like its region,
//! [`crate::plan::Chunk::direct`]) WANT -> credit -> write from user memory -> DATA -> ACK.
//!
//! [`Sender`] owns the per-transfer state, the parked credits (granted but not yet staged for
//! lack of local arena space), the orphaned staging regions of failed transfers, and the
//! cancels deferred until their writes finish. It does not own arena space: staging regions
//! come from the endpoint's shared [`crate::scheduler::CreditScheduler`]. The
//! [`crate::endpoint::Endpoint`] drives it; nothing else does.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::{debug, trace, warn};

use crate::config::Config;
use crate::event::{Action, Ctx, JobId, JobRuns, ProtocolError, SubmitError, WriteSource, XferError, internal_error};
use crate::plan::Plan;
use crate::proof;
use crate::timer::TimerTable;
use crate::types::{ArenaId, ChunkIdx, PeerId, Region, Token, XferId};
use crate::wire::{self, Ack, AckStatus, Data, Grant, Msg, Standing, Want};

/// A credit as the sender keeps it: the granted remote region and when it arrived.
#[derive(Debug, Clone, Copy)]
struct Credit {
    region: Region,
    at: Instant,
}

/// Transfer ids with this bit set name standing flows ([`wire::Standing`]): each is the id of
/// the transfer whose submit opened it with the bit set, so it is unique and never a
/// transfer's (the shell numbers transfers from 1; `submit` refuses ids with the bit).
pub const STANDING_XFER_BIT: u64 = 1 << 63;

/// Key under which a standing flow's token is derived from the token of the transfer that
/// opened it (the core draws no randomness): only the two ends of that transfer know it.
const STANDING_TOKEN_KEY: crate::types::RegKey = crate::types::RegKey(*b"nixl-bounce standing flow token.");

/// This engine's standing flow at one peer ([`wire::Standing`]).
#[derive(Debug, Clone, Copy)]
struct StandingSlot {
    xfer: XferId,
    token: Token,
    /// The bytes asked for.
    bytes: u64,
    /// The peer's arena it lies in (that of the transfer that opened it): only transfers
    /// bounced through the same arena claim it.
    arena: ArenaId,
    /// The region granted and not claimed yet, and when its GRANT came; `None` while a grant
    /// is awaited.
    region: Option<(Region, Instant)>,
    /// Since when a grant is awaited (the flow opened, or its region claimed): one awaited
    /// half a timeout with no claimer left in flight was lost, and the flow is asked again.
    awaited: Instant,
}

/// Where one chunk is in its lifecycle.
#[derive(Debug, Clone, Copy)]
enum Stage {
    /// No credit, no staging.
    Idle,
    /// Credit arrived, but no local staging space yet; listed in `Sender::parked`.
    Parked { credit: Credit },
    /// Gather in flight; eager when `credit` is still `None`.
    Gathering { local: Region, job: JobId, credit: Option<Credit> },
    /// Staged with nothing in flight: an eager chunk waiting for its credit, or (only on the
    /// way into `Sender::fail`) a chunk whose job just finished.
    Gathered { local: Region },
    /// RDMA write in flight, from the staging region or (a direct chunk) from user memory.
    Writing { source: WriteSource, job: JobId, credit: Credit },
    /// DATA sent at `sent`; waiting for the ACK. The staging region went back when the write
    /// was done: its bytes are in the peer's region (nothing ever writes them again), so a
    /// target that never ACKs holds none of our arena.
    DataSent { direct: bool, credit: Credit, sent: Instant, replanned: bool },
    /// Scattered at the receiver; staging released.
    Acked,
    /// A READ's chunk: RDMA READ of the target's ready region into `local` in flight.
    Reading { local: Region, job: JobId, credit: Credit },
    /// A READ's chunk read (RELEASE sent): the local scatter to the destinations in flight.
    Pulled { local: Region, job: JobId },
}

impl Stage {
    /// The stage of a chunk whose write was not posted or failed: still staged in its region,
    /// or back to idle for a direct chunk, which holds nothing.
    fn unwritten(source: WriteSource) -> Self {
        match source {
            WriteSource::Arena(local) => Self::Gathered { local },
            WriteSource::User { .. } => Self::Idle,
        }
    }
}

impl Xfer {
    /// Sends chunk `i`'s PLAN when it has at least `min_runs` scatter runs (never when
    /// `min_runs` is 0) and none went yet: the receiver checks those runs while the chunk is
    /// written, and its DATA then carries none. Sent when the chunk's credit comes, after its
    /// write is posted: PLANs sent with the WANT (tens of KB each for a scattered 32 MiB chunk)
    /// crossed the control channel while the WANT and its GRANT did, and their encoding held
    /// the initiator's reactor before it read the GRANT; on the GPU host the GRANT hop took
    /// ~230 us instead of ~80 (issue 11).
    fn plan_chunk(&mut self, ctx: &mut Ctx<'_>, xfer: XferId, i: usize, min_runs: usize) {
        let runs = &self.plan.chunks[i].scatter;
        // A READ's scatter runs are ours to run, and a region plan travels with the data:
        // nothing to send.
        let in_region = self.plan.chunks[i].region_plan.is_some();
        if self.read || in_region || min_runs == 0 || runs.len() < min_runs || self.planned[i] {
            return;
        }
        self.planned[i] = true;
        ctx.stats.plans_sent += 1;
        let chunk = ChunkIdx(u32::try_from(i).unwrap_or(u32::MAX));
        ctx.send(self.peer, wire::Plan { xfer, token: self.token, chunk, runs: runs.clone() });
    }

    /// The DATA announcing chunk `i` written into `region`: with its runs unless they went
    /// ahead in a PLAN and `inline` is false, or they lie in the region behind the data.
    fn data(&self, xfer: XferId, i: usize, region: Region, inline: bool) -> Data {
        let c = &self.plan.chunks[i];
        let chunk = ChunkIdx(u32::try_from(i).unwrap_or(u32::MAX));
        if c.region_plan.is_some() {
            let region_plan_runs = c.region_plan_runs();
            return Data { xfer, token: self.token, chunk, region, runs: Vec::new(), region_plan_runs };
        }
        let runs = if self.planned[i] && !inline { Vec::new() } else { c.scatter.clone() };
        Data { xfer, token: self.token, chunk, region, runs, region_plan_runs: 0 }
    }
}

/// How a WRITE's WANT asks to be answered, and what it carries.
#[derive(Debug, Default)]
pub(crate) struct WantShape {
    /// Answers through the target's mailbox (a one-way transfer), else as frames.
    pub(crate) one_way: bool,
    /// The shell's gather of the plan's one chunk, to ride in the WANT when it may
    /// ([`wire::Inline`]; see `Sender::inline_chunk`).
    pub(crate) inline: Option<Vec<u8>>,
    /// No standing credit claimed or opened ([`crate::endpoint::WriteRoute::no_standing`]).
    pub(crate) no_standing: bool,
}

/// One submitted transfer.
#[derive(Debug)]
struct Xfer {
    peer: PeerId,
    /// The transfer's secret (see [`Token`]): sent in its WANT, DATA and cancel, required in
    /// every GRANT and ACK.
    token: Token,
    /// Shared with the prepared request it was posted from: a post copies no runs.
    plan: Arc<Plan>,
    stages: Vec<Stage>,
    acked: usize,
    /// Some chunk is not direct, so the transfer may need the staging reserve.
    staged: bool,
    /// A READ: the target gathers, we READ its region and scatter locally (see `submit_read`).
    read: bool,
    /// Chunks whose runs went ahead in a PLAN (their DATA carries none).
    planned: Vec<bool>,
    /// Fails with a timeout when reached; pushed back by every sign of progress (the armed
    /// instant in `Sender::timers` stays, at most this deadline, and is re-armed when it fires).
    deadline: Instant,
    /// When a WRITE's WANT went out, until its first GRANT: that wait is the WANT -> GRANT
    /// round trip ([`crate::event::Stats::grant_wait_ns`]).
    wanted: Option<Instant>,
    /// Its one chunk rode in the WANT ([`wire::Inline`]) and no GRANT came: the receiver's ACK
    /// may come with no write from us, for a region we never saw.
    inline: bool,
    /// The standing flow (and its token) whose region chunk 0 claimed: if the transfer fails,
    /// that flow is canceled with it, after its writes (see `Sender::fail`).
    claimed: Option<(XferId, Token)>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum JobKind {
    Gather,
    Write,
    /// A READ's RDMA read of the target's region.
    Read,
    /// A READ's local scatter.
    Scatter,
}

/// A job of a live transfer.
#[derive(Debug, Clone, Copy)]
struct JobRef {
    xfer: XferId,
    chunk: usize,
    kind: JobKind,
}

/// A job of a failed transfer still in flight, and the staging region it holds until done.
#[derive(Debug, Clone, Copy)]
struct Orphan {
    xfer: XferId,
    /// The arena of `region`.
    arena: ArenaId,
    /// `None` for a direct write: nothing to free, but a pending cancel still waits for it.
    region: Option<Region>,
    kind: JobKind,
}

/// A cancel held back until the failed transfer's writes have all finished.
#[derive(Debug, Clone, Copy)]
struct PendingCancel {
    peer: PeerId,
    token: Token,
    writes: usize,
    /// The standing flow the transfer claimed a region of, canceled with it.
    standing: Option<(XferId, Token)>,
    /// A READ's: it leaves nothing scattering at the target, so later WRITEs need not wait
    /// for it (see [`cancel_pending_to`](Sender::cancel_pending_to)).
    read: bool,
}

/// Protocol state of the transfers this engine sends.
///
/// Driven only by [`crate::endpoint::Endpoint`], which documents the call order. Per transfer:
/// `submit` sends WANT (and, with eager gather, stages and gathers the first chunks up to `W`
/// and the eager budget); each credit binds to its chunk (promoting an eager staging region, or
/// acquiring one and gathering now, or parking the credit when the arena is full); gather done
/// plus credit posts the write; write done sends DATA; ACK(Scattered) releases the staging
/// region; all chunks ACKed completes the transfer. Any failure completes it with an error and
/// retracts its credits with a cancel (an empty WANT), sent only after its in-flight writes
/// finished.
///
/// # Direct chunks
/// A chunk with [`crate::plan::Chunk::direct`] set is never staged: no local region, no
/// gather, no eager staging (the eager cap of `W` chunks counts staged chunks only). Its credit
/// posts the write from user memory at once, under the same credit checks as any other; its
/// ACK has nothing to release. A failure with its write in flight orphans no region, but the
/// cancel still waits for that write, as for a staged one.
///
/// # The staging reserve
/// While it has transfers in flight, the sender keeps one region of `max_chunk_size` bytes of
/// the shared arena in reserve (one in each arena its transfers stage in). It counts against
/// the eager budget (half the arena), so remote flows can always still be granted the other
/// half; it is taken before any eager staging, and retaken whenever space frees, before the
/// scheduler grants that space to remote flows. A credit that finds no other staging space
/// takes the reserve (promoting it to credit-backed).
/// Without it two engines sending to each other can fill both arenas with credits granted to
/// the other side, each waiting for staging space that only the other's progress would free.
/// With it a credit is staged as soon as the reserve is back: a reserve-staged chunk needs
/// nothing more from the local arena to be written, scattered and acknowledged. Transfers made
/// only of direct chunks never stage, so they do not hold the reserve.
#[derive(Debug)]
pub struct Sender {
    timeout: Duration,
    eager: bool,
    window: usize,
    /// Fewest runs a chunk's plan needs to go ahead in a PLAN; 0: never (see [`wire::Plan`]).
    plan_ahead_runs: usize,
    /// Largest chunk sent inside its WANT ([`wire::Inline`]); 0: never.
    inline_bytes: u64,
    /// Largest chunk each of our arenas stages, by [`ArenaId`] (its options' max chunk: a host
    /// arena's and a GPU arena's differ); plans take the smaller of it and the peer arena's.
    max_chunks: Vec<u64>,
    endpoint: Vec<u8>,
    /// Who our proofs are made by: our agent name ([`proof::Initiator`]).
    initiator: proof::Initiator,
    xfers: BTreeMap<XferId, Xfer>,
    jobs: BTreeMap<JobId, JobRef>,
    orphans: BTreeMap<JobId, Orphan>,
    /// In-flight transfers with [`Xfer::staged`], by the arena they stage in: an arena's
    /// reserve is kept while its count is non-zero.
    staging_xfers: BTreeMap<ArenaId, usize>,
    pending_cancels: BTreeMap<XferId, PendingCancel>,
    /// Failed READs whose completion waits for their scatters into our memory still running
    /// (the error, and how many): the application may reuse the destinations as soon as it
    /// sees the failure (or its release of the request returns), so nothing of the transfer
    /// may write them after that.
    failing_reads: BTreeMap<XferId, (XferError, usize)>,
    /// Chunks in [`Stage::Parked`], oldest first; entries of failed transfers are dropped
    /// lazily.
    parked: VecDeque<(XferId, usize)>,
    /// Arenas whose oldest parked credit has waited an eighth of a timeout without fitting, as
    /// of the last `retry_parked`: new credits and eager gathers there take no staging space
    /// until it is served (see `retry_parked`).
    staging_held: Vec<ArenaId>,
    /// One no-progress timer per in-flight transfer.
    timers: TimerTable<XferId>,
    /// Recently finished transfers and their peers, so that GRANTs and ACKs racing with the
    /// end of a transfer are ignored quietly instead of reported as protocol errors.
    finished: BTreeMap<XferId, PeerId>,
    finished_order: VecDeque<(Instant, XferId)>,
    /// Per arena, one max-chunk staging region kept back while transfers staging there are in
    /// flight, for a credit that finds the arena full (see the type docs).
    reserve: BTreeMap<ArenaId, Region>,
    /// Some arena's reserve may need taking or giving back (`staging_xfers` or `reserve`
    /// changed, or a reserve could not be taken yet): `retry_parked` looks only then.
    reserve_stale: bool,
    shutting_down: bool,
    /// Writes posted and not yet done (of live and of failed transfers): while one outlasts
    /// `keep_every`, its flow gets a KEEP every `keep_every` (see [`wire::Keep`]).
    writes: BTreeMap<JobId, WriteInFlight>,
    /// When the next round of KEEPs is due; `None` with no write in flight.
    next_keep: Option<Instant>,
    /// Each peer's own no-progress timeout, from its capabilities ([`Self::set_peer_timeout`]):
    /// its leases on the credits it grants us run by it (see [`Self::lease_base`]).
    peer_timeouts: BTreeMap<PeerId, Duration>,
    /// An eighth of the request timeout: the receiver reclaims a flow silent for half of it.
    keep_every: Duration,
    /// Bytes of the standing credit asked of each peer written to two way; 0: none.
    standing_bytes: u64,
    /// Our standing flow at each peer (see [`wire::Standing`]).
    standing: BTreeMap<PeerId, StandingSlot>,
    /// Peers that refused our standing flow: not asked again until they are lost.
    no_standing: BTreeSet<PeerId>,
    /// Per peer, the highest transfer that claimed our standing credit there. The receiver
    /// refuses a claim at or below the newest it took from us as a replay, and transfers may
    /// reach `submit` out of id order (the shell numbers them at post, on the posting thread),
    /// so a lower one claiming after a higher would fail for nothing: it goes the usual way.
    claim_floor: BTreeMap<PeerId, XferId>,
    /// Plans that passed [`check_plan`], newest first, with the chunk limit they passed under
    /// (see [`CheckedPlans`]).
    checked: CheckedPlans,
}

/// The plans [`check_plan`] passed lately, so that a prepared request posted again is not
/// checked again: its check walks every run of every chunk (32,768 for a 16384-piece GPU
/// WRITE), which took 18-31 us of a 0.3 ms transfer's submit on the H100 host (issue 11).
///
/// Kept as `Weak` pointers: a plan is immutable while shared, `Arc::get_mut` refuses while a
/// `Weak` exists, and `Arc::make_mut` moves the value to a new allocation instead of writing
/// through it; and the allocation a `Weak` points to is never reused while the `Weak` lives. So
/// a `Weak` pointing at the very allocation submitted names bytes that passed.
#[derive(Debug, Default)]
struct CheckedPlans(VecDeque<(std::sync::Weak<Plan>, u64)>);

impl CheckedPlans {
    /// How many plans are remembered: a framework's prepared requests in flight at once.
    const KEPT: usize = 64;

    fn passed(&self, plan: &Arc<Plan>, max_chunk: u64) -> bool {
        self.0.iter().any(|(w, m)| *m == max_chunk && std::ptr::eq(w.as_ptr(), Arc::as_ptr(plan)))
    }

    fn remember(&mut self, plan: &Arc<Plan>, max_chunk: u64) {
        self.0.retain(|(w, _)| w.strong_count() > 0);
        if self.0.len() == Self::KEPT {
            self.0.pop_back();
        }
        self.0.push_front((Arc::downgrade(plan), max_chunk));
    }
}

/// A write in flight, as KEEPs need it.
#[derive(Debug, Clone, Copy)]
struct WriteInFlight {
    peer: PeerId,
    xfer: XferId,
    token: Token,
}

impl Sender {
    pub(crate) fn new(config: &Config, _now: Instant) -> Self {
        Self {
            timeout: config.request_timeout,
            eager: config.eager_gather,
            window: usize::try_from(config.max_inflight_chunks).unwrap_or(usize::MAX),
            plan_ahead_runs: usize::try_from(config.plan_ahead_runs).unwrap_or(usize::MAX),
            inline_bytes: config.inline_bytes.min(u64::from(wire::MAX_INLINE_BYTES)),
            max_chunks: vec![config.max_chunk_size],
            endpoint: Vec::new(),
            initiator: proof::Initiator::default(),
            xfers: BTreeMap::new(),
            jobs: BTreeMap::new(),
            orphans: BTreeMap::new(),
            staging_xfers: BTreeMap::new(),
            pending_cancels: BTreeMap::new(),
            failing_reads: BTreeMap::new(),
            parked: VecDeque::new(),
            staging_held: Vec::new(),
            timers: TimerTable::default(),
            finished: BTreeMap::new(),
            finished_order: VecDeque::new(),
            reserve: BTreeMap::new(),
            reserve_stale: false,
            shutting_down: false,
            writes: BTreeMap::new(),
            next_keep: None,
            peer_timeouts: BTreeMap::new(),
            keep_every: config.request_timeout / 8,
            standing_bytes: config.standing_bytes.min(config.max_chunk_size),
            standing: BTreeMap::new(),
            no_standing: BTreeSet::new(),
            claim_floor: BTreeMap::new(),
            checked: CheckedPlans::default(),
        }
    }

    /// `peer` runs with no-progress timeout `timeout` (its capabilities say so): the credits
    /// it grants are leased by it.
    pub(crate) fn set_peer_timeout(&mut self, peer: PeerId, timeout: Duration) {
        self.peer_timeouts.insert(peer, timeout);
    }

    /// The timeout the leases on `peer`'s credits run by: the smaller of ours and the
    /// peer's. A receiver takes back a region left unwritten for half of *its* timeout and
    /// grants it again a quarter later; a credit used within a quarter of the smaller timeout,
    /// kept alive every eighth of it, never meets that, whichever side's timeout is longer
    /// (review 55: a sender whose timeout was several times the receiver's wrote into a region
    /// granted since to another transfer).
    pub(crate) fn lease_base(&self, peer: PeerId) -> Duration {
        self.peer_timeouts.get(&peer).map_or(self.timeout, |&t| t.min(self.timeout))
    }

    /// Whether a transfer of ours to `peer`, or our standing flow there, is live.
    pub(crate) fn has_xfers_to(&self, peer: PeerId) -> bool {
        self.standing.contains_key(&peer) || self.xfers.values().any(|x| x.peer == peer)
    }

    /// Transfers submitted and not yet completed.
    pub fn in_flight(&self) -> usize {
        self.xfers.len()
    }

    /// Adds the peers our transfers in flight go to (the liveness probe watches them).
    pub(crate) fn peers_waited_on(&self, out: &mut std::collections::BTreeSet<PeerId>) {
        out.extend(self.xfers.values().map(|x| x.peer));
    }

    /// Staging regions of failed transfers still waiting for their job's done-event (direct
    /// writes of failed transfers hold none and are not counted).
    pub fn orphans(&self) -> usize {
        self.orphans.values().filter(|o| o.region.is_some()).count()
    }

    /// Whether `job` belongs to a transfer that ended (failed or canceled) before it was
    /// reported done.
    pub fn is_orphan(&self, job: JobId) -> bool {
        self.orphans.contains_key(&job)
    }

    /// Gather and write jobs emitted and not yet reported (orphans included).
    pub fn jobs_in_flight(&self) -> usize {
        self.jobs.len() + self.orphans.len()
    }

    /// Credits waiting for local staging space.
    pub fn parked_credits(&self) -> usize {
        self.xfers.values().flat_map(|x| &x.stages).filter(|s| matches!(s, Stage::Parked { .. })).count()
    }

    /// Cancels held back until the failed transfer's writes finish.
    pub fn pending_cancels(&self) -> usize {
        self.pending_cancels.len()
    }

    /// The request timeout: how long a transfer may make no progress.
    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Whether a cancel of ours to `peer` waits for its failed WRITE's writes to end.
    pub(crate) fn cancel_pending_to(&self, peer: PeerId) -> bool {
        !self.pending_cancels.is_empty() && self.pending_cancels.values().any(|c| c.peer == peer && !c.read)
    }

    /// Chunks of `xfer` acknowledged so far, if it is in flight.
    pub fn acked_chunks(&self, xfer: XferId) -> Option<usize> {
        self.xfers.get(&xfer).map(|x| x.acked)
    }

    pub(crate) fn inline_bytes(&self) -> u64 {
        self.inline_bytes
    }

    /// Lowers (never raises) the largest chunk sent inline.
    pub(crate) fn set_inline_bytes(&mut self, bytes: u64) {
        self.inline_bytes = self.inline_bytes.min(bytes);
    }

    pub(crate) fn set_local_endpoint(&mut self, bytes: Vec<u8>) {
        self.endpoint = bytes;
    }

    pub(crate) fn set_initiator(&mut self, by: proof::Initiator) {
        self.initiator = by;
    }

    pub(crate) fn next_timeout(&self) -> Option<Instant> {
        [self.timers.next(), self.next_keep].into_iter().flatten().min()
    }

    pub(crate) fn submit(
        &mut self,
        ctx: &mut Ctx<'_>,
        xfer: XferId,
        token: Token,
        peer: PeerId,
        plan: Arc<Plan>,
        shape: WantShape,
    ) -> Result<(), SubmitError> {
        self.admit(ctx, xfer, &plan)?;
        let WantShape { one_way, inline, no_standing } = shape;
        let proofs = plan.dests.iter().map(|d| proof::prove_as(d.reg, &d.key, token, xfer, &self.initiator)).collect();
        let chunks = plan.chunk_sizes().collect();
        // A one-way transfer asks to be answered through the target's mailbox.
        let endpoint = if one_way { wire::REPLY_MAILBOX.to_vec() } else { self.endpoint.clone() };
        let inline = inline.and_then(|bytes| self.inline_chunk(&plan, bytes));
        let inlined = inline.is_some();
        if inlined {
            ctx.stats.inline_sent += 1;
        }
        // Chunk 0 takes our standing credit at this peer when there is one and it fits. One
        // granted a quarter timeout ago is not used, as any credit (see `post_write`): the
        // receiver's lease on it may end before our write lands. Its flow goes, and a new one
        // is opened below.
        let lease = self.lease_base(peer) / 4;
        let stale = self.standing.get(&peer).and_then(|s| s.region).is_some_and(|(_, at)| ctx.now >= at + lease);
        if stale || self.standing_grant_lost(ctx.now, peer) {
            self.close_standing(ctx, peer, true);
        }
        let in_order = self.claim_floor.get(&peer).is_none_or(|&floor| xfer > floor);
        let claim = match self.standing.get_mut(&peer) {
            Some(slot) if !one_way && !inlined && !no_standing && in_order && slot.arena == plan.peer_arena => {
                match slot.region {
                    Some((region, _)) if region.len >= plan.chunks[0].bytes => {
                        slot.region = None;
                        slot.awaited = ctx.now;
                        Some((slot.xfer, slot.token, region))
                    }
                    _ => None,
                }
            }
            _ => None,
        };
        if claim.is_some() {
            self.claim_floor.insert(peer, xfer);
        }
        let standing = claim.map_or(Standing::None, |(xfer, token, _)| Standing::Claim { xfer, token });
        ctx.send(peer, Want { xfer, token, arena: plan.peer_arena, endpoint, chunks, proofs, inline, standing });
        if !one_way && !no_standing {
            self.open_standing(ctx, xfer, token, peer, plan.peer_arena);
        }
        let deadline = ctx.now + self.timeout;
        let staged = plan.chunks.iter().any(|c| c.direct.is_none());
        let (stages, planned) = (vec![Stage::Idle; plan.chunks.len()], vec![false; plan.chunks.len()]);
        let wanted = Some(ctx.now);
        let mut x = Xfer {
            peer,
            token,
            stages,
            plan,
            acked: 0,
            staged,
            read: false,
            planned,
            deadline,
            wanted,
            inline: inlined,
            claimed: claim.map(|(xfer, token, _)| (xfer, token)),
        };
        if staged {
            // Before any eager staging can take the budget the reserve lives in.
            self.start_staging(ctx, x.plan.local_arena);
        }
        let mut eager = 0;
        // An inline chunk is staged only if the receiver GRANTs it after all; an arena held for
        // an old parked credit stages nothing ahead.
        if self.eager && !inlined && !self.staging_held.contains(&x.plan.local_arena) {
            // Overlap the WANT -> GRANT round trip with the first gathers (design §6). Direct
            // chunks have nothing to gather.
            for i in 0..x.plan.chunks.len() {
                if eager == self.window {
                    break;
                }
                if x.plan.chunks[i].direct.is_some() {
                    continue;
                }
                let Some(local) = ctx.sched(x.plan.local_arena).acquire_local(x.plan.chunks[i].bytes, true) else {
                    break;
                };
                let job = start_gather(ctx, &mut self.jobs, xfer, &x, i, local);
                x.stages[i] = Stage::Gathering { local, job, credit: None };
                eager += 1;
            }
        }
        debug!(xfer = xfer.0, peer = peer.0, chunks = x.plan.chunks.len(), bytes = x.plan.total_bytes, eager, "submit");
        self.timers.set(xfer, deadline);
        self.xfers.insert(xfer, x);
        ctx.stats.submitted += 1;
        if let Some((_, _, region)) = claim {
            // Written at once, as if the GRANT had come: the region is ours until the
            // receiver hands it to this transfer on the claim.
            ctx.stats.standing_claims += 1;
            trace!(xfer = xfer.0, region = %region, "standing credit claimed");
            if let Err(e) = self.attach(ctx, xfer, 0, Credit { region, at: ctx.now }) {
                self.fail(ctx, xfer, e, true);
            } else if let Some(x) = self.xfers.get_mut(&xfer) {
                x.plan_chunk(ctx, xfer, 0, self.plan_ahead_runs);
            }
        }
        Ok(())
    }

    /// The [`wire::Inline`] for `plan` out of the shell's gather of its chunk, `bytes`: only for
    /// a WRITE of one chunk of at most `inline_bytes`, its runs in frames (no region plan), and
    /// bytes that are exactly that chunk. Anything else goes the full exchange.
    fn inline_chunk(&self, plan: &Plan, bytes: Vec<u8>) -> Option<wire::Inline> {
        let [chunk] = &plan.chunks[..] else { return None };
        let fits = chunk.bytes == bytes.len() as u64 && chunk.bytes <= self.inline_bytes;
        if !fits || chunk.region_plan.is_some() || chunk.scatter.is_empty() {
            debug!(bytes = bytes.len(), chunk = chunk.bytes, "inline bytes not sent");
            return None;
        }
        Some(wire::Inline { runs: chunk.scatter.clone(), bytes })
    }

    /// Whether a new transfer `xfer` of `plan` may start: not shutting down, a fresh id, a
    /// plan within the caps.
    pub(crate) fn admit(&mut self, ctx: &mut Ctx<'_>, xfer: XferId, plan: &Arc<Plan>) -> Result<(), SubmitError> {
        self.prune(ctx.now);
        if self.shutting_down {
            return Err(SubmitError::ShuttingDown);
        }
        if self.xfers.contains_key(&xfer) || self.finished.contains_key(&xfer) || xfer.0 & STANDING_XFER_BIT != 0 {
            return Err(SubmitError::DuplicateXfer { xfer });
        }
        if !ctx.scheds.has(plan.local_arena) {
            return Err(SubmitError::NoSuchArena { xfer, arena: plan.local_arena });
        }
        let max_chunk = self.max_chunk(plan.local_arena).min(ctx.sched(plan.local_arena).max_chunk_bytes());
        if self.checked.passed(plan, max_chunk) {
            return Ok(());
        }
        check_plan(xfer, plan, max_chunk)?;
        self.checked.remember(plan, max_chunk);
        Ok(())
    }

    /// True while `xfer` is to complete: in flight, or failed with its completion waiting for
    /// scatters into our memory (see `failing_reads`).
    pub fn owes_completion(&self, xfer: XferId) -> bool {
        self.xfers.contains_key(&xfer) || self.failing_reads.contains_key(&xfer)
    }

    /// True when `job` is one of this sender's jobs (live or orphaned).
    pub(crate) fn owns_job(&self, job: JobId) -> bool {
        self.jobs.contains_key(&job) || self.orphans.contains_key(&job)
    }

    pub(crate) fn cancel(&mut self, ctx: &mut Ctx<'_>, xfer: XferId) {
        if self.xfers.contains_key(&xfer) {
            self.fail(ctx, xfer, XferError::Canceled, true);
        } else {
            trace!(xfer = xfer.0, "cancel of a finished transfer ignored");
        }
    }

    /// The live transfer a GRANT or ACK from `from` carrying `token` names; `None` when it is
    /// not live (`unknown` already dealt with that), an error when it belongs to another peer
    /// or the token is not the transfer's (a forgery: counted in `control_forged`, and nothing
    /// of the transfer changes, so a forged ACK can never complete it).
    fn addressed_xfer(
        &mut self,
        ctx: &mut Ctx<'_>,
        from: PeerId,
        id: XferId,
        token: Token,
    ) -> Result<Option<&mut Xfer>, ProtocolError> {
        self.prune(ctx.now);
        if !self.xfers.contains_key(&id) {
            return self.unknown(ctx, from, id).map(|()| None);
        }
        match self.xfers.get_mut(&id) {
            Some(x) if x.peer != from => Err(ProtocolError::WrongPeer { xfer: id, expected: x.peer, got: from }),
            Some(x) if x.token != token => {
                ctx.stats.control_forged += 1;
                Err(ProtocolError::WrongToken { peer: from, xfer: id })
            }
            x => {
                ctx.stats.frames_authentic += 1;
                Ok(x)
            }
        }
    }

    /// Forgets what is kept per peer id for its whole life (the order floor of our claims), its
    /// id retired; [`handle_peer_lost`](Self::handle_peer_lost) has ended the rest.
    pub(crate) fn forget_peer(&mut self, peer: PeerId) {
        self.claim_floor.remove(&peer);
        self.peer_timeouts.remove(&peer);
    }

    /// Whether `from` may answer our transfer (or standing flow) `xfer` with `token`: the
    /// transfer is ours, to that peer, under that token. The token is secret to the two ends.
    pub(crate) fn is_answer(&self, from: PeerId, xfer: XferId, token: Token) -> bool {
        let ours = self.xfers.get(&xfer).is_some_and(|x| x.peer == from && x.token == token);
        ours || self.standing.get(&from).is_some_and(|s| s.xfer == xfer && s.token == token)
    }

    pub(crate) fn handle_grant(&mut self, ctx: &mut Ctx<'_>, from: PeerId, grant: Grant) -> Result<(), ProtocolError> {
        let now = ctx.now;
        self.handle_grant_written_after(ctx, from, grant, now)
    }

    /// [`handle_grant`](Self::handle_grant) of a GRANT written no earlier than `written_after`
    /// (read from a mailbox, where it may have lain unread): its credits' lease counts from
    /// there, so one that went stale meanwhile is never written (or read).
    pub(crate) fn handle_grant_written_after(
        &mut self,
        ctx: &mut Ctx<'_>,
        from: PeerId,
        grant: Grant,
        written_after: Instant,
    ) -> Result<(), ProtocolError> {
        let id = grant.xfer;
        if let Some(slot) = self.standing_msg(ctx, from, id, grant.token) {
            // Our standing flow's region: kept for the next transfer to this peer.
            let slot = slot?;
            let [c] = grant.credits[..] else {
                return Err(ProtocolError::DuplicateCredit { xfer: id, chunk: ChunkIdx(0) });
            };
            if slot.region.is_some() {
                return Err(ProtocolError::DuplicateCredit { xfer: id, chunk: c.chunk });
            }
            if c.region.len < slot.bytes || c.region.checked_end().is_none() {
                return Err(ProtocolError::BadCredit { xfer: id, chunk: c.chunk, region: c.region, bytes: slot.bytes });
            }
            trace!(peer = from.0, region = %c.region, "standing credit");
            slot.region = Some((c.region, ctx.now));
            return Ok(());
        }
        let timeout = self.timeout;
        let Some(x) = self.addressed_xfer(ctx, from, id, grant.token)? else { return Ok(()) };
        if grant.credits.is_empty() {
            return Err(ProtocolError::EmptyGrant { xfer: id });
        }
        // Validate the whole message before applying any of it.
        let mut seen = BTreeSet::new();
        for c in &grant.credits {
            let i = c.chunk.0 as usize;
            let Some(chunk) = x.plan.chunks.get(i) else {
                return Err(ProtocolError::ChunkOutOfRange { xfer: id, chunk: c.chunk, chunks: x.plan.chunks.len() });
            };
            let open =
                matches!(x.stages[i], Stage::Idle | Stage::Gathering { credit: None, .. } | Stage::Gathered { .. });
            if !seen.insert(i) || !open {
                return Err(ProtocolError::DuplicateCredit { xfer: id, chunk: c.chunk });
            }
            if c.region.len < chunk.bytes || c.region.checked_end().is_none() {
                return Err(ProtocolError::BadCredit {
                    xfer: id,
                    chunk: c.chunk,
                    region: c.region,
                    bytes: chunk.bytes,
                });
            }
        }
        x.deadline = ctx.now + timeout;
        if std::mem::take(&mut x.inline) {
            // The receiver declined the inline bytes: the chunk goes the full exchange.
            ctx.stats.inline_declined += 1;
        }
        if let Some(at) = x.wanted.take() {
            ctx.stats.grant_waits += 1;
            ctx.stats.grant_wait_ns += nanos(ctx.now, at);
        }
        let min_runs = self.plan_ahead_runs;
        for c in &grant.credits {
            trace!(xfer = id.0, chunk = c.chunk.0, region = %c.region, "credit");
            let credit = Credit { region: c.region, at: written_after.min(ctx.now) };
            if let Err(e) = self.attach(ctx, id, c.chunk.0 as usize, credit) {
                self.fail(ctx, id, e, true);
                return Ok(());
            }
        }
        // The writes are posted: now the credited chunks' plans, checked while they are written.
        if let Some(x) = self.xfers.get_mut(&id) {
            for c in &grant.credits {
                x.plan_chunk(ctx, id, c.chunk.0 as usize, min_runs);
            }
        }
        Ok(())
    }

    pub(crate) fn handle_ack(&mut self, ctx: &mut Ctx<'_>, from: PeerId, ack: Ack) -> Result<(), ProtocolError> {
        let id = ack.xfer;
        if let Some(slot) = self.standing_msg(ctx, from, id, ack.token) {
            slot?;
            // The only answer a standing flow gets is a refusal: no standing credit there.
            if ack.status != AckStatus::Refused {
                return Err(ProtocolError::UnexpectedAck { xfer: id, chunk: ack.chunk });
            }
            debug!(peer = from.0, "standing flow refused");
            self.close_standing(ctx, from, false);
            self.no_standing.insert(from);
            return Ok(());
        }
        let timeout = self.timeout;
        let Some(x) = self.addressed_xfer(ctx, from, id, ack.token)? else { return Ok(()) };
        let i = ack.chunk.0 as usize;
        let Some(&stage) = x.stages.get(i) else {
            return Err(ProtocolError::ChunkOutOfRange { xfer: id, chunk: ack.chunk, chunks: x.stages.len() });
        };
        if x.inline && i == 0 && matches!(stage, Stage::Idle) {
            // The answer to an inline WANT: the receiver put the bytes in a region of its own,
            // scattered them and freed it; nothing of ours is held.
            trace!(xfer = id.0, status = ?ack.status, "inline ack");
            match ack.status {
                AckStatus::Scattered => {
                    x.deadline = ctx.now + timeout;
                    if let Some(at) = x.wanted.take() {
                        ctx.stats.inline_acks += 1;
                        ctx.stats.inline_ack_wait_ns += nanos(ctx.now, at);
                    }
                    x.stages[0] = Stage::Acked;
                    x.acked = 1;
                    self.complete(ctx, id);
                }
                AckStatus::Refused => self.fail(ctx, id, XferError::Refused, true),
                AckStatus::Failed => self.fail(ctx, id, XferError::ScatterFailed, true),
                // Nothing was sent that could be replanned, or claimed.
                AckStatus::Replan | AckStatus::Kept => {
                    return Err(ProtocolError::UnexpectedAck { xfer: id, chunk: ack.chunk });
                }
            }
            return Ok(());
        }
        // A refusal, whatever the chunk's stage and whatever region it names: the receiver
        // reclaims every flow it refuses (`receiver::refuse_want`, a refused DATA), so nothing
        // of the transfer can complete any more, and its token shows it comes from the receiver.
        // (A refused standing claim names no region of ours and usually finds chunk 0's DATA
        // already sent: ignored, it left the transfer waiting for its timeout.)
        if ack.status == AckStatus::Refused {
            self.fail(ctx, id, XferError::Refused, true);
            return Ok(());
        }
        let Stage::DataSent { direct, credit, sent, replanned } = stage else {
            // A READ target whose gather of the chunk failed (nothing was announced ready).
            if x.read && ack.status == AckStatus::Failed {
                self.fail(ctx, id, XferError::GatherFailed, true);
                return Ok(());
            }
            return Err(ProtocolError::UnexpectedAck { xfer: id, chunk: ack.chunk });
        };
        // A DATA sent again with its runs leaves nothing to replan: a second Replan would only
        // keep the transfer alive (each pushes the deadline back) and make us send DATA again.
        if credit.region != ack.region || (replanned && ack.status == AckStatus::Replan) {
            return Err(ProtocolError::UnexpectedAck { xfer: id, chunk: ack.chunk });
        }
        x.deadline = ctx.now + timeout;
        trace!(xfer = id.0, chunk = ack.chunk.0, status = ?ack.status, "ack");
        if ack.status == AckStatus::Kept {
            // Chunk 0's region, claimed from our standing flow, is that flow's credit again.
            let claimed = x.claimed.filter(|_| i == 0).map(|(s, _)| s);
            match self.standing.get_mut(&from) {
                Some(slot) if Some(slot.xfer) == claimed && slot.region.is_none() => {
                    slot.region = Some((credit.region, ctx.now));
                }
                _ => debug!(xfer = id.0, chunk = i, "a region kept for a standing flow we no longer use"),
            }
        }
        let Some(x) = self.xfers.get_mut(&id) else { return Ok(()) };
        match ack.status {
            AckStatus::Scattered | AckStatus::Kept => {
                ctx.stats.ack_waits += 1;
                ctx.stats.ack_wait_ns += nanos(ctx.now, sent);
                x.stages[i] = Stage::Acked;
                x.acked += 1;
                let done = x.acked == x.stages.len();
                if done {
                    self.complete(ctx, id);
                }
            }
            // Failed above already; kept so that no arm panics should that move.
            AckStatus::Refused => self.fail(ctx, id, XferError::Refused, true),
            AckStatus::Failed => self.fail(ctx, id, XferError::ScatterFailed, true),
            AckStatus::Replan => {
                // The receiver kept no plan for the chunk: the DATA again, with its runs.
                ctx.stats.replans += 1;
                x.stages[i] = Stage::DataSent { direct, credit, sent: ctx.now, replanned: true };
                let data = x.data(id, i, credit.region, true);
                ctx.send(x.peer, data);
            }
        }
        Ok(())
    }

    /// The live transfer a finished job belongs to, its no-progress deadline pushed back; `None`
    /// when the job was orphaned or unknown (see `take_job`).
    fn finished_job(&mut self, ctx: &mut Ctx<'_>, job: JobId, kind: JobKind) -> Option<(JobRef, &mut Xfer)> {
        let r = self.take_job(ctx, job, kind)?;
        let Some(x) = self.xfers.get_mut(&r.xfer) else {
            internal_error("job of a vanished transfer", &r.xfer.0);
            return None;
        };
        x.deadline = ctx.now + self.timeout;
        Some((r, x))
    }

    pub(crate) fn handle_gather_done(&mut self, ctx: &mut Ctx<'_>, job: JobId, ok: bool) {
        let Some((r, x)) = self.finished_job(ctx, job, JobKind::Gather) else { return };
        let Stage::Gathering { local, credit, .. } = x.stages[r.chunk] else {
            return internal_error("gather done for a chunk not gathering", &r.chunk);
        };
        trace!(xfer = r.xfer.0, chunk = r.chunk, ok, "gather done");
        x.stages[r.chunk] = Stage::Gathered { local };
        if !ok {
            return self.fail(ctx, r.xfer, XferError::GatherFailed, true);
        }
        if let Some(credit) = credit {
            if let Err(e) = self.post_write(ctx, r.xfer, r.chunk, WriteSource::Arena(local), credit) {
                self.fail(ctx, r.xfer, e, true);
            }
        }
    }

    pub(crate) fn handle_write_done(&mut self, ctx: &mut Ctx<'_>, job: JobId, ok: bool) {
        self.writes.remove(&job);
        if self.writes.is_empty() {
            self.next_keep = None;
        }
        let Some((r, x)) = self.finished_job(ctx, job, JobKind::Write) else { return };
        let Stage::Writing { source, credit, .. } = x.stages[r.chunk] else {
            return internal_error("write done for a chunk not writing", &r.chunk);
        };
        trace!(xfer = r.xfer.0, chunk = r.chunk, ok, "write done");
        if !ok {
            x.stages[r.chunk] = Stage::unwritten(source);
            return self.fail(ctx, r.xfer, XferError::WriteFailed, true);
        }
        let direct = match source {
            WriteSource::Arena(local) => {
                release(ctx, x.plan.local_arena, local);
                false
            }
            WriteSource::User { .. } => true,
        };
        x.stages[r.chunk] = Stage::DataSent { direct, credit, sent: ctx.now, replanned: false };
        let chunk = &x.plan.chunks[r.chunk];
        ctx.stats.chunks_written += 1;
        ctx.stats.bytes_written += chunk.bytes;
        if direct {
            ctx.stats.chunks_direct += 1;
        }
        let data = x.data(r.xfer, r.chunk, credit.region, false);
        if data.region_plan_runs != 0 {
            ctx.stats.region_plans_sent += 1;
        }
        ctx.send(x.peer, data);
    }

    pub(crate) fn handle_peer_lost(&mut self, ctx: &mut Ctx<'_>, peer: PeerId) {
        self.fail_peer(ctx, peer, XferError::PeerLost);
    }

    /// As [`handle_peer_lost`](Self::handle_peer_lost), the transfers failing with `err`.
    pub(crate) fn fail_peer(&mut self, ctx: &mut Ctx<'_>, peer: PeerId, err: XferError) {
        let lost: Vec<XferId> = self.xfers.iter().filter(|(_, x)| x.peer == peer).map(|(&id, _)| id).collect();
        if !lost.is_empty() {
            debug!(peer = peer.0, xfers = lost.len(), error = %err, "failing the peer's transfers");
        }
        for id in lost {
            self.fail(ctx, id, err.clone(), false);
        }
        // Its new incarnation starts with no standing flow of ours, and may give one.
        self.close_standing(ctx, peer, false);
        self.no_standing.remove(&peer);
        // Nobody is left to receive those cancels; the orphans are still freed by their jobs.
        self.pending_cancels.retain(|_, c| c.peer != peer);
    }

    /// The peer said GOODBYE: its transfers fail with [`XferError::PeerLost`] at once, and
    /// (unlike a lost peer, which is gone) their credits are retracted once their writes end,
    /// so the closing peer sees its grants come back before it lets its arena go.
    pub(crate) fn handle_goodbye(&mut self, ctx: &mut Ctx<'_>, peer: PeerId) {
        let gone: Vec<XferId> = self.xfers.iter().filter(|(_, x)| x.peer == peer).map(|(&id, _)| id).collect();
        if !gone.is_empty() {
            debug!(peer = peer.0, xfers = gone.len(), "peer said goodbye: failing its transfers");
        }
        for id in gone {
            self.fail(ctx, id, XferError::PeerLost, true);
        }
        // Its standing region back too (one a failed transfer claimed goes with that one).
        self.close_standing(ctx, peer, true);
    }

    /// The application deregistered `[start, end)`: every transfer in flight that reads from
    /// it (a gather run or a direct chunk's source) fails with [`XferError::Deregistered`];
    /// its jobs still in flight become orphans as for any failure (the shell waits for those
    /// that touch the range before the deregistration returns).
    pub(crate) fn deregister(&mut self, ctx: &mut Ctx<'_>, start: u64, end: u64) {
        let hit: Vec<XferId> = self
            .xfers
            .iter()
            .filter(|(_, x)| touches_local(&x.plan, x.read, (start, end)))
            .map(|(&id, _)| id)
            .collect();
        for id in hit {
            ctx.stats.dereg_failed += 1;
            self.fail(ctx, id, XferError::Deregistered, true);
        }
    }

    pub(crate) fn handle_timeout(&mut self, ctx: &mut Ctx<'_>) {
        let now = ctx.now;
        if self.next_keep.is_some_and(|t| t <= now) {
            self.send_keeps(ctx);
        }
        while let Some(id) = self.timers.pop_due(now) {
            let Some(x) = self.xfers.get_mut(&id) else {
                continue;
            };
            if x.deadline <= now {
                debug!(xfer = id.0, acked = x.acked, chunks = x.stages.len(), "transfer timed out");
                self.fail(ctx, id, XferError::Timeout, true);
            } else {
                self.timers.set(id, x.deadline);
            }
        }
        self.prune(now);
    }

    pub(crate) fn shutdown(&mut self, ctx: &mut Ctx<'_>) {
        self.shutting_down = true;
        let all: Vec<XferId> = self.xfers.keys().copied().collect();
        for id in all {
            self.fail(ctx, id, XferError::ShuttingDown, true);
        }
        let peers: Vec<PeerId> = self.standing.keys().copied().collect();
        for peer in peers {
            self.close_standing(ctx, peer, true);
        }
    }

    /// Removes a reported job: a live one is returned; an orphan is released here.
    fn take_job(&mut self, ctx: &mut Ctx<'_>, job: JobId, kind: JobKind) -> Option<JobRef> {
        if let Some(o) = self.orphans.get(&job).copied() {
            if o.kind != kind {
                warn!(job = job.0, ?kind, "done-event of the wrong kind for an orphaned job; ignored");
                return None;
            }
            self.orphans.remove(&job);
            trace!(job = job.0, xfer = o.xfer.0, region = ?o.region, "orphan done");
            if let Some(region) = o.region {
                release(ctx, o.arena, region);
            }
            if kind == JobKind::Scatter {
                self.scatter_ended(ctx, o.xfer);
            }
            if matches!(kind, JobKind::Write | JobKind::Read) {
                if let Some(pc) = self.pending_cancels.get_mut(&o.xfer) {
                    pc.writes -= 1;
                    if pc.writes == 0 {
                        let (peer, token, standing) = (pc.peer, pc.token, pc.standing);
                        self.pending_cancels.remove(&o.xfer);
                        ctx.send(peer, Msg::cancel(o.xfer, token, self.endpoint.clone()));
                        if let Some((xfer, token)) = standing {
                            ctx.send(peer, Msg::cancel(xfer, token, self.endpoint.clone()));
                        }
                    }
                }
            }
            return None;
        }
        match self.jobs.get(&job) {
            Some(r) if r.kind == kind => self.jobs.remove(&job),
            Some(_) => {
                warn!(job = job.0, ?kind, "done-event of the wrong kind for a job; ignored");
                None
            }
            None => {
                warn!(job = job.0, ?kind, "done-event for an unknown job; ignored");
                None
            }
        }
    }
}

/// Checks what the peer's decoder and scheduler would refuse, so a bad plan fails at submit
/// rather than after a timeout.
fn check_plan(xfer: XferId, plan: &Plan, max_chunk: u64) -> Result<(), SubmitError> {
    if plan.chunks.is_empty() {
        return Err(SubmitError::EmptyPlan { xfer });
    }
    if plan.chunks.len() > wire::MAX_CHUNKS_PER_WANT as usize {
        return Err(SubmitError::TooManyChunks { xfer, chunks: plan.chunks.len(), max: wire::MAX_CHUNKS_PER_WANT });
    }
    if plan.dests.len() > wire::MAX_PROOFS as usize {
        return Err(SubmitError::TooManyDestinations { xfer, dests: plan.dests.len(), max: wire::MAX_PROOFS });
    }
    for (i, c) in plan.chunks.iter().enumerate() {
        let chunk = ChunkIdx(i as u32);
        if c.bytes > max_chunk {
            return Err(SubmitError::ChunkTooLarge { xfer, chunk, bytes: c.bytes, max: max_chunk });
        }
        let runs_ok = |runs: &[crate::types::CopyRun]| {
            !runs.is_empty()
                && runs.len() <= wire::MAX_RUNS as usize
                && runs.iter().all(|r| r.len != 0 && r.region_span().is_some_and(|(_, end)| end <= c.data_bytes()))
        };
        let direct_ok = c.direct.is_none_or(|addr| addr.checked_add(c.bytes).is_some());
        // A region plan fills the region's end exactly, where the receiver looks for it.
        let region_plan_ok = c.region_plan.is_none_or(|off| {
            c.direct.is_none() && wire::region_plan::plan_offset(c.bytes, c.region_plan_runs()) == Some(off)
        });
        if c.bytes == 0 || !runs_ok(&c.gather) || !runs_ok(&c.scatter) || !direct_ok || !region_plan_ok {
            return Err(SubmitError::BadChunk { xfer, chunk });
        }
    }
    Ok(())
}

/// Emits the gather of chunk `i` of `x` into `local` and records its job.
fn start_gather(
    ctx: &mut Ctx<'_>,
    jobs: &mut BTreeMap<JobId, JobRef>,
    id: XferId,
    x: &Xfer,
    i: usize,
    local: Region,
) -> JobId {
    let job = ctx.job();
    jobs.insert(job, JobRef { xfer: id, chunk: i, kind: JobKind::Gather });
    trace!(xfer = id.0, chunk = i, region = %local, "gather");
    let (arena, runs) = (x.plan.local_arena, JobRuns::Chunk { plan: x.plan.clone(), chunk: i });
    ctx.push(Action::Gather { job, xfer: id, arena, region: local, runs });
    job
}

/// Nanoseconds from `at` to `now` (0 if the clock went backwards; saturating).
fn nanos(now: Instant, at: Instant) -> u64 {
    u64::try_from(now.saturating_duration_since(at).as_nanos()).unwrap_or(u64::MAX)
}

/// Staging space for a credit-backed chunk of `bytes` in `arena`: a fresh region, unless the
/// arena is `held` for an older parked credit (`Sender::retry_parked`), else the reserve.
fn stage_credit(
    ctx: &mut Ctx<'_>,
    reserve: (&mut BTreeMap<ArenaId, Region>, &mut bool),
    arena: ArenaId,
    bytes: u64,
    held: bool,
) -> Option<Region> {
    (!held)
        .then(|| ctx.sched(arena).acquire_local(bytes, false))
        .flatten()
        .or_else(|| take_reserve(ctx, reserve, arena))
}

/// Hands `arena`'s reserve over to a credit-backed chunk, and marks `stale`: the arena's
/// reserve is to be retaken.
fn take_reserve(
    ctx: &mut Ctx<'_>,
    (reserve, stale): (&mut BTreeMap<ArenaId, Region>, &mut bool),
    arena: ArenaId,
) -> Option<Region> {
    let local = reserve.remove(&arena)?;
    *stale = true;
    promote(ctx, arena, local);
    Some(local)
}

fn promote(ctx: &mut Ctx<'_>, arena: ArenaId, local: Region) {
    if let Err(e) = ctx.sched(arena).promote_local(local.offset) {
        internal_error("promoting an eager staging region", &e);
    }
}

fn release(ctx: &mut Ctx<'_>, arena: ArenaId, local: Region) {
    if let Err(e) = ctx.sched(arena).release_local(local.offset) {
        internal_error("releasing a staging region", &e);
    }
}

mod ending;
mod read;
mod staging;
mod standing;

/// Whether transfer `plan` (a READ when `read`) touches our memory in `[start, end)`: a WRITE
/// reads its gather sources and direct chunks there, a READ writes its scatter destinations.
pub(crate) fn touches_local(plan: &Plan, read: bool, (start, end): (u64, u64)) -> bool {
    plan.local_spans(read).any(|(a, b)| a < end && start < b)
}

#[cfg(test)]
mod tests;
