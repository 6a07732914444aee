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
use crate::types::{ArenaId, ChunkIdx, CopyRun, PeerId, Region, Token, XferId};
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
    /// DATA sent at `sent`; waiting for the ACK.
    DataSent { source: WriteSource, credit: Credit, sent: Instant },
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
    xfers: BTreeMap<XferId, Xfer>,
    jobs: BTreeMap<JobId, JobRef>,
    orphans: BTreeMap<JobId, Orphan>,
    /// In-flight transfers with [`Xfer::staged`], by the arena they stage in: an arena's
    /// reserve is kept while its count is non-zero.
    staging_xfers: BTreeMap<ArenaId, usize>,
    pending_cancels: BTreeMap<XferId, PendingCancel>,
    /// Chunks in [`Stage::Parked`], oldest first; entries of failed transfers are dropped
    /// lazily.
    parked: VecDeque<(XferId, usize)>,
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
            xfers: BTreeMap::new(),
            jobs: BTreeMap::new(),
            orphans: BTreeMap::new(),
            staging_xfers: BTreeMap::new(),
            pending_cancels: BTreeMap::new(),
            parked: VecDeque::new(),
            timers: TimerTable::default(),
            finished: BTreeMap::new(),
            finished_order: VecDeque::new(),
            reserve: BTreeMap::new(),
            reserve_stale: false,
            shutting_down: false,
            writes: BTreeMap::new(),
            next_keep: None,
            keep_every: config.request_timeout / 8,
            standing_bytes: config.standing_bytes.min(config.max_chunk_size),
            standing: BTreeMap::new(),
            no_standing: BTreeSet::new(),
            claim_floor: BTreeMap::new(),
        }
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
        let proofs = plan.dests.iter().map(|d| proof::prove(d.reg, &d.key, token)).collect();
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
        let lease = self.timeout / 4;
        let stale = self.standing.get(&peer).and_then(|s| s.region).is_some_and(|(_, at)| ctx.now >= at + lease);
        if stale {
            self.close_standing(ctx, peer, true);
        }
        let in_order = self.claim_floor.get(&peer).is_none_or(|&floor| xfer > floor);
        let claim = match self.standing.get_mut(&peer) {
            Some(slot) if !one_way && !inlined && !no_standing && in_order && slot.arena == plan.peer_arena => {
                match slot.region {
                    Some((region, _)) if region.len >= plan.chunks[0].bytes => {
                        slot.region = None;
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
        // An inline chunk is staged only if the receiver GRANTs it after all.
        if self.eager && !inlined {
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

    /// Opens our standing flow at `peer` (see [`wire::Standing`]) when we have none there and
    /// the peer has not refused one. Named after transfer `xfer`, whose submit opens it, with
    /// a token derived from that transfer's.
    fn open_standing(&mut self, ctx: &mut Ctx<'_>, xfer: XferId, token: Token, peer: PeerId, arena: ArenaId) {
        if self.standing_bytes == 0 || self.standing.contains_key(&peer) || self.no_standing.contains(&peer) {
            return;
        }
        let id = XferId(xfer.0 | STANDING_XFER_BIT);
        let token = Token(u128::from_le_bytes(proof::tag(&STANDING_TOKEN_KEY, token)));
        let bytes = self.standing_bytes;
        let want = Want {
            xfer: id,
            token,
            arena,
            endpoint: self.endpoint.clone(),
            chunks: vec![bytes],
            proofs: Vec::new(),
            inline: None,
            standing: Standing::Open,
        };
        ctx.send(peer, want);
        self.standing.insert(peer, StandingSlot { xfer: id, token, bytes, arena, region: None });
        ctx.stats.standing_opened_out += 1;
        debug!(peer = peer.0, xfer = id.0, bytes, "standing flow opened");
    }

    /// Ends our standing flow at `peer`, if any: forgotten here and, with `cancel`, canceled
    /// there now (nothing of ours is being written into its region).
    fn close_standing(&mut self, ctx: &mut Ctx<'_>, peer: PeerId, cancel: bool) {
        if let Some(slot) = self.standing.remove(&peer) {
            if cancel {
                ctx.send(peer, Msg::cancel(slot.xfer, slot.token, self.endpoint.clone()));
            }
            self.tombstone(ctx.now, slot.xfer, peer);
        }
    }

    /// A GRANT or ACK for our standing flow at `from`, if `xfer` names it: `None` otherwise.
    fn standing_msg(
        &mut self,
        ctx: &mut Ctx<'_>,
        from: PeerId,
        xfer: XferId,
        token: Token,
    ) -> Option<Result<&mut StandingSlot, ProtocolError>> {
        let slot = self.standing.get_mut(&from).filter(|s| s.xfer == xfer)?;
        if slot.token != token {
            ctx.stats.control_forged += 1;
            return Some(Err(ProtocolError::WrongToken { peer: from, xfer }));
        }
        Some(Ok(slot))
    }

    /// Starts READ transfer `xfer` of `plan` from `peer`: the plan's gather runs read the
    /// target's memory (`CopyRun::addr` there) and its scatter runs write ours. Sends the PULL;
    /// each ready region (a GRANT) is READ into local staging, released, and scattered here.
    /// No eager staging and no direct chunks: nothing can be staged before the target gathers.
    pub(crate) fn submit_read(
        &mut self,
        ctx: &mut Ctx<'_>,
        xfer: XferId,
        token: Token,
        peer: PeerId,
        mut plan: Arc<Plan>,
        one_way: bool,
    ) -> Result<(), SubmitError> {
        self.admit(ctx, xfer, &plan)?;
        if plan.chunks.iter().any(|c| c.direct.is_some()) {
            for c in &mut Arc::make_mut(&mut plan).chunks {
                c.direct = None;
            }
        }
        let endpoint = if one_way { wire::REPLY_MAILBOX.to_vec() } else { self.endpoint.clone() };
        let mut proofs = plan.dests.iter().map(|d| proof::prove(d.reg, &d.key, token)).collect();
        // `check_plan` capped the chunks at MAX_CHUNKS_PER_WANT, a u32.
        let total = plan.chunks.len() as u32;
        for (first, part) in pull_frames(&plan.chunks) {
            let chunks = part.iter().map(|c| wire::PullChunk { bytes: c.bytes, runs: Arc::clone(&c.gather) }).collect();
            let (first, proofs) = (ChunkIdx(first as u32), std::mem::take(&mut proofs));
            let (arena, endpoint) = (plan.peer_arena, endpoint.clone());
            ctx.send(peer, wire::Pull { xfer, token, arena, first, total, endpoint, chunks, proofs });
        }
        let deadline = ctx.now + self.timeout;
        let (stages, planned) = (vec![Stage::Idle; plan.chunks.len()], vec![false; plan.chunks.len()]);
        // A READ's GRANT comes after the target's gather: no control round trip to time.
        let x = Xfer {
            peer,
            token,
            stages,
            plan,
            acked: 0,
            staged: true,
            read: true,
            planned,
            deadline,
            wanted: None,
            inline: false,
            claimed: None,
        };
        self.start_staging(ctx, x.plan.local_arena);
        debug!(xfer = xfer.0, peer = peer.0, chunks = x.plan.chunks.len(), bytes = x.plan.total_bytes, "submit READ");
        self.timers.set(xfer, deadline);
        self.xfers.insert(xfer, x);
        ctx.stats.submitted += 1;
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
    fn admit(&mut self, ctx: &mut Ctx<'_>, xfer: XferId, plan: &Plan) -> Result<(), SubmitError> {
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
        check_plan(xfer, plan, self.max_chunk(plan.local_arena).min(ctx.sched(plan.local_arena).max_chunk_bytes()))
    }

    /// True when `job` is one of this sender's jobs (live or orphaned).
    pub(crate) fn owns_job(&self, job: JobId) -> bool {
        self.jobs.contains_key(&job) || self.orphans.contains_key(&job)
    }

    /// A READ's RDMA read ended: the region is released at the target and the chunk scattered
    /// here, or the transfer fails.
    pub(crate) fn handle_read_done(&mut self, ctx: &mut Ctx<'_>, job: JobId, ok: bool) {
        self.writes.remove(&job);
        if self.writes.is_empty() {
            self.next_keep = None;
        }
        let Some((r, x)) = self.finished_job(ctx, job, JobKind::Read) else { return };
        let Stage::Reading { local, credit, .. } = x.stages[r.chunk] else {
            return internal_error("read done for a chunk not reading", &r.chunk);
        };
        trace!(xfer = r.xfer.0, chunk = r.chunk, ok, "read done");
        if !ok {
            x.stages[r.chunk] = Stage::Gathered { local };
            return self.fail(ctx, r.xfer, XferError::ReadFailed, true);
        }
        let chunk = ChunkIdx(r.chunk as u32);
        ctx.send(x.peer, wire::Release { xfer: r.xfer, token: x.token, chunk, region: credit.region });
        let scatter = ctx.job();
        x.stages[r.chunk] = Stage::Pulled { local, job: scatter };
        // The plan's own runs, shared: a GPU engine keeps their device copy with the plan.
        let (peer, arena) = (x.peer, x.plan.local_arena);
        let runs = JobRuns::ChunkScatter { plan: Arc::clone(&x.plan), chunk: r.chunk };
        self.jobs.insert(scatter, JobRef { xfer: r.xfer, chunk: r.chunk, kind: JobKind::Scatter });
        ctx.push(Action::Scatter {
            job: scatter,
            peer,
            xfer: r.xfer,
            arena,
            region: local,
            runs,
            in_region: None,
            inline: None,
        });
    }

    /// A READ's local scatter ended: the chunk is done (the transfer completes with its last),
    /// or the transfer fails.
    pub(crate) fn handle_scatter_done(&mut self, ctx: &mut Ctx<'_>, job: JobId, ok: bool) {
        let Some((r, x)) = self.finished_job(ctx, job, JobKind::Scatter) else { return };
        let Stage::Pulled { local, .. } = x.stages[r.chunk] else {
            return internal_error("scatter done for a chunk not pulled", &r.chunk);
        };
        release(ctx, x.plan.local_arena, local);
        if !ok {
            x.stages[r.chunk] = Stage::Idle;
            return self.fail(ctx, r.xfer, XferError::ScatterFailed, true);
        }
        x.stages[r.chunk] = Stage::Acked;
        x.acked += 1;
        ctx.stats.chunks_pulled += 1;
        if x.acked == x.stages.len() {
            self.complete(ctx, r.xfer);
        }
    }

    /// Starts the RDMA read of READ chunk `i` into `local`, unless its credit is stale (the
    /// target reclaims a region left unread for half a timeout, as one left unwritten).
    fn start_read(
        &mut self,
        ctx: &mut Ctx<'_>,
        id: XferId,
        i: usize,
        (arena, local): (ArenaId, Region),
        credit: Credit,
    ) -> Result<(), XferError> {
        let Some(x) = self.xfers.get_mut(&id) else {
            release(ctx, arena, local);
            return Ok(());
        };
        if ctx.now >= credit.at + self.timeout / 4 {
            debug!(xfer = id.0, chunk = i, "READ credit went stale before the read");
            x.stages[i] = Stage::Gathered { local };
            return Err(XferError::Timeout);
        }
        let job = ctx.job();
        self.jobs.insert(job, JobRef { xfer: id, chunk: i, kind: JobKind::Read });
        x.stages[i] = Stage::Reading { local, job, credit };
        let len = x.plan.chunks[i].bytes;
        trace!(xfer = id.0, chunk = i, remote = %credit.region, %local, "read");
        let remote_arena = x.plan.peer_arena;
        ctx.push(Action::Read { job, xfer: id, peer: x.peer, remote_arena, remote: credit.region, arena, local, len });
        self.writes.insert(job, WriteInFlight { peer: x.peer, xfer: id, token: x.token });
        if self.next_keep.is_none() && !self.keep_every.is_zero() {
            self.next_keep = Some(ctx.now + self.keep_every);
        }
        Ok(())
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
            x => Ok(x),
        }
    }

    pub(crate) fn handle_grant(&mut self, ctx: &mut Ctx<'_>, from: PeerId, grant: Grant) -> Result<(), ProtocolError> {
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
            if c.region.len < slot.bytes || c.region.offset.checked_add(c.region.len).is_none() {
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
            if c.region.len < chunk.bytes || c.region.offset.checked_add(c.region.len).is_none() {
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
            let credit = Credit { region: c.region, at: ctx.now };
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
            x.deadline = ctx.now + timeout;
            trace!(xfer = id.0, status = ?ack.status, "inline ack");
            match ack.status {
                AckStatus::Scattered => {
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
        let Stage::DataSent { source, credit, sent } = stage else {
            // A refusal of the whole transfer (the receiver will not serve its WANT: see
            // `receiver::refuse_want`); its token shows it comes from the receiver.
            if ack.status == AckStatus::Refused {
                self.fail(ctx, id, XferError::Refused, true);
                return Ok(());
            }
            // A READ target whose gather of the chunk failed (nothing was announced ready).
            if x.read && ack.status == AckStatus::Failed {
                self.fail(ctx, id, XferError::GatherFailed, true);
                return Ok(());
            }
            return Err(ProtocolError::UnexpectedAck { xfer: id, chunk: ack.chunk });
        };
        if credit.region != ack.region {
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
                if let WriteSource::Arena(local) = source {
                    release(ctx, x.plan.local_arena, local);
                }
                if done {
                    self.complete(ctx, id);
                }
            }
            AckStatus::Refused => self.fail(ctx, id, XferError::Refused, true),
            AckStatus::Failed => self.fail(ctx, id, XferError::ScatterFailed, true),
            AckStatus::Replan => {
                // The receiver kept no plan for the chunk: the DATA again, with its runs.
                ctx.stats.replans += 1;
                x.stages[i] = Stage::DataSent { source, credit, sent: ctx.now };
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
        x.stages[r.chunk] = Stage::DataSent { source, credit, sent: ctx.now };
        let chunk = &x.plan.chunks[r.chunk];
        ctx.stats.chunks_written += 1;
        ctx.stats.bytes_written += chunk.bytes;
        if matches!(source, WriteSource::User { .. }) {
            ctx.stats.chunks_direct += 1;
        }
        let data = x.data(r.xfer, r.chunk, credit.region, false);
        if data.region_plan_runs != 0 {
            ctx.stats.region_plans_sent += 1;
        }
        ctx.send(x.peer, data);
    }

    pub(crate) fn handle_peer_lost(&mut self, ctx: &mut Ctx<'_>, peer: PeerId) {
        let lost: Vec<XferId> = self.xfers.iter().filter(|(_, x)| x.peer == peer).map(|(&id, _)| id).collect();
        if !lost.is_empty() {
            debug!(peer = peer.0, xfers = lost.len(), "peer lost: failing its transfers");
        }
        for id in lost {
            self.fail(ctx, id, XferError::PeerLost, false);
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
        let overlaps = |(a, b): (u64, u64)| a < end && start < b;
        let reads = |x: &Xfer| {
            x.plan.chunks.iter().any(|c| {
                if x.read {
                    // A READ's local side is its scatter's destinations.
                    return c.scatter.iter().filter_map(CopyRun::addr_span).any(overlaps);
                }
                c.direct.is_some_and(|d| overlaps((d, d.saturating_add(c.bytes))))
                    || c.gather.iter().filter_map(CopyRun::addr_span).any(overlaps)
            })
        };
        let hit: Vec<XferId> = self.xfers.iter().filter(|(_, x)| reads(x)).map(|(&id, _)| id).collect();
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

    /// Gives parked credits the local staging space that freed up, oldest first (a chunk that
    /// does not fit does not block smaller ones behind it), falling back on the reserve; then
    /// refills the reserve (or returns it when no transfer is left). Call before the
    /// scheduler's `schedule()`, so freed space serves local credits before new remote grants.
    pub(crate) fn retry_parked(&mut self, ctx: &mut Ctx<'_>) {
        if !self.parked.is_empty() {
            let mut keep = VecDeque::new();
            while let Some((id, i)) = self.parked.pop_front() {
                let Some(x) = self.xfers.get_mut(&id) else {
                    continue;
                };
                let Stage::Parked { credit } = x.stages[i] else {
                    continue;
                };
                let (read, arena) = (x.read, x.plan.local_arena);
                match ctx
                    .sched(arena)
                    .acquire_local(x.plan.chunks[i].bytes, false)
                    .or_else(|| take_reserve(ctx, (&mut self.reserve, &mut self.reserve_stale), arena))
                {
                    Some(local) if read => {
                        trace!(xfer = id.0, chunk = i, "parked READ credit staged");
                        if let Err(e) = self.start_read(ctx, id, i, (arena, local), credit) {
                            self.fail(ctx, id, e, true);
                        }
                    }
                    Some(local) => {
                        trace!(xfer = id.0, chunk = i, "parked credit staged");
                        let job = start_gather(ctx, &mut self.jobs, id, x, i, local);
                        x.stages[i] = Stage::Gathering { local, job, credit: Some(credit) };
                    }
                    None => keep.push_back((id, i)),
                }
            }
            self.parked = keep;
        }
        // Each arena's reserve goes back once no transfer stages there, and is retaken while
        // one does.
        if !self.reserve_stale {
            return;
        }
        let idle: Vec<ArenaId> =
            self.reserve.keys().copied().filter(|a| self.staging_xfers.get(a).is_none_or(|&n| n == 0)).collect();
        for arena in idle {
            if let Some(r) = self.reserve.remove(&arena) {
                release(ctx, arena, r);
            }
        }
        let wanting: Vec<ArenaId> = self
            .staging_xfers
            .iter()
            .filter(|&(a, &n)| n > 0 && !self.reserve.contains_key(a))
            .map(|(&a, _)| a)
            .collect();
        for arena in wanting {
            self.take_reserve_of(ctx, arena);
        }
        // An arena still without its reserve (full for now) is looked at again next time.
        self.reserve_stale = self.staging_xfers.iter().any(|(a, &n)| n > 0 && !self.reserve.contains_key(a));
    }

    /// A transfer staging in `arena` starts: counted, and the arena's reserve taken if it has
    /// none (before any eager staging can take the budget the reserve lives in).
    fn start_staging(&mut self, ctx: &mut Ctx<'_>, arena: ArenaId) {
        *self.staging_xfers.entry(arena).or_default() += 1;
        if !self.reserve.contains_key(&arena) {
            self.take_reserve_of(ctx, arena);
            self.reserve_stale |= !self.reserve.contains_key(&arena);
        }
    }

    /// A transfer staging in `arena` ended (the arena's last: its reserve goes back at the
    /// next `retry_parked`).
    fn stop_staging(&mut self, arena: ArenaId) {
        if let Some(n) = self.staging_xfers.get_mut(&arena) {
            *n -= 1;
            // The entry stays at 0 (an arena's count comes and goes with every transfer).
            self.reserve_stale |= *n == 0;
        }
    }

    /// The largest chunk `arena` stages (the first arena's for one never set).
    fn max_chunk(&self, arena: ArenaId) -> u64 {
        self.max_chunks.get(usize::from(arena.0)).copied().unwrap_or(self.max_chunks[0])
    }

    /// Sets the largest chunk `arena` stages (see [`crate::endpoint::Endpoint::add_arena`]).
    pub(crate) fn set_max_chunk(&mut self, arena: ArenaId, bytes: u64) {
        let i = usize::from(arena.0);
        if self.max_chunks.len() <= i {
            let first = self.max_chunks[0];
            self.max_chunks.resize(i + 1, first);
        }
        self.max_chunks[i] = bytes;
    }

    /// Takes `arena`'s reserve: one region of the largest chunk it stages.
    fn take_reserve_of(&mut self, ctx: &mut Ctx<'_>, arena: ArenaId) {
        let sched = ctx.sched(arena);
        let bytes = self.max_chunk(arena).min(sched.max_chunk_bytes());
        if let Some(r) = sched.acquire_local(bytes, true) {
            self.reserve.insert(arena, r);
        }
    }

    /// Binds a validated credit to chunk `i` of `id`.
    fn attach(&mut self, ctx: &mut Ctx<'_>, id: XferId, i: usize, credit: Credit) -> Result<(), XferError> {
        let Some(x) = self.xfers.get_mut(&id) else {
            internal_error("credit for a vanished transfer", &id.0);
            return Ok(());
        };
        if x.read {
            let Stage::Idle = x.stages[i] else {
                internal_error("READ credit for a chunk that already has one", &i);
                return Ok(());
            };
            let arena = x.plan.local_arena;
            return match ctx
                .sched(arena)
                .acquire_local(x.plan.chunks[i].bytes, false)
                .or_else(|| take_reserve(ctx, (&mut self.reserve, &mut self.reserve_stale), arena))
            {
                Some(local) => self.start_read(ctx, id, i, (arena, local), credit),
                None => {
                    trace!(xfer = id.0, chunk = i, "READ credit parked: no local staging space");
                    x.stages[i] = Stage::Parked { credit };
                    self.parked.push_back((id, i));
                    Ok(())
                }
            };
        }
        if let (Stage::Idle, Some(addr)) = (x.stages[i], x.plan.chunks[i].direct) {
            return self.post_write(ctx, id, i, WriteSource::User { addr }, credit);
        }
        let arena = x.plan.local_arena;
        match x.stages[i] {
            Stage::Idle => match ctx
                .sched(arena)
                .acquire_local(x.plan.chunks[i].bytes, false)
                .or_else(|| take_reserve(ctx, (&mut self.reserve, &mut self.reserve_stale), arena))
            {
                Some(local) => {
                    let job = start_gather(ctx, &mut self.jobs, id, x, i, local);
                    x.stages[i] = Stage::Gathering { local, job, credit: Some(credit) };
                }
                None => {
                    trace!(xfer = id.0, chunk = i, "credit parked: no local staging space");
                    x.stages[i] = Stage::Parked { credit };
                    self.parked.push_back((id, i));
                }
            },
            Stage::Gathering { local, job, credit: None } => {
                promote(ctx, arena, local);
                x.stages[i] = Stage::Gathering { local, job, credit: Some(credit) };
            }
            Stage::Gathered { local } => {
                promote(ctx, arena, local);
                return self.post_write(ctx, id, i, WriteSource::Arena(local), credit);
            }
            _ => internal_error("credit for a chunk that already has one", &i),
        }
        Ok(())
    }

    /// Posts the write of chunk `i` from `source` (its gathered region, or user memory for a
    /// direct chunk), unless its credit is stale.
    fn post_write(
        &mut self,
        ctx: &mut Ctx<'_>,
        id: XferId,
        i: usize,
        source: WriteSource,
        credit: Credit,
    ) -> Result<(), XferError> {
        let Some(x) = self.xfers.get_mut(&id) else {
            internal_error("write for a vanished transfer", &id.0);
            return Ok(());
        };
        if ctx.now >= credit.at + self.timeout / 4 {
            // The receiver reclaims regions left unwritten for half a timeout (a lease: a silent
            // peer must not hold the arena long enough to time out everyone else's transfers);
            // writing after a quarter could land in a region it has granted to someone else.
            debug!(xfer = id.0, chunk = i, "credit went stale before the write");
            x.stages[i] = Stage::unwritten(source);
            return Err(XferError::Timeout);
        }
        let job = ctx.job();
        self.jobs.insert(job, JobRef { xfer: id, chunk: i, kind: JobKind::Write });
        x.stages[i] = Stage::Writing { source, job, credit };
        let len = x.plan.chunks[i].bytes;
        trace!(xfer = id.0, chunk = i, ?source, remote = %credit.region, len, "write");
        let (arena, remote_arena) = (x.plan.local_arena, x.plan.peer_arena);
        ctx.push(Action::Write {
            job,
            xfer: id,
            peer: x.peer,
            source,
            arena,
            remote_arena,
            remote: credit.region,
            len,
        });
        self.writes.insert(job, WriteInFlight { peer: x.peer, xfer: id, token: x.token });
        if self.next_keep.is_none() && !self.keep_every.is_zero() {
            self.next_keep = Some(ctx.now + self.keep_every);
        }
        Ok(())
    }

    /// One round of KEEPs: one per flow with a write in flight, so the receiver does not
    /// reclaim a region a slow write may still land in. Re-armed while any write is in flight.
    ///
    /// Every write in flight counts, however young: its flow's lease at the receiver runs from
    /// the grant (half the timeout), and the write may be posted up to a quarter timeout after
    /// the credit came, so waiting until it is itself an eighth old could send its first KEEP
    /// half a timeout after the credit, when the flow is already reclaimed. This way the first
    /// KEEP leaves at most an eighth after the post: three eighths after the credit, an eighth
    /// ahead of the lease (the simulation found the race: a write landing in a region reclaimed
    /// under it).
    fn send_keeps(&mut self, ctx: &mut Ctx<'_>) {
        let now = ctx.now;
        let mut kept = BTreeSet::new();
        for w in self.writes.values() {
            if kept.insert((w.peer, w.xfer)) {
                trace!(peer = w.peer.0, xfer = w.xfer.0, "write still in flight: KEEP");
                ctx.push(Action::Send { peer: w.peer, msg: wire::Keep { xfer: w.xfer, token: w.token }.into() });
            }
        }
        ctx.stats.keeps_sent += kept.len() as u64;
        self.next_keep = (!self.writes.is_empty()).then(|| now + self.keep_every);
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

    /// Completes `id` successfully (every chunk acknowledged, every staging region released).
    fn complete(&mut self, ctx: &mut Ctx<'_>, id: XferId) {
        let Some(x) = self.xfers.remove(&id) else {
            return;
        };
        self.timers.stop(id);
        if x.staged {
            self.stop_staging(x.plan.local_arena);
        }
        debug!(xfer = id.0, chunks = x.stages.len(), bytes = x.plan.total_bytes, "transfer complete");
        ctx.stats.completed += 1;
        ctx.push(Action::Complete { xfer: id, outcome: Ok(()) });
        self.tombstone(ctx.now, id, x.peer);
    }

    /// The target ended transfer `id` (a one-way FAIL record) or broke the protocol: it fails
    /// with `err`, its credits retracted as for any failure.
    pub(crate) fn fail_by_peer(&mut self, ctx: &mut Ctx<'_>, id: XferId, err: XferError) {
        self.fail(ctx, id, err, true);
    }

    /// Fails `id`: completes it with `err`, releases its idle staging regions, orphans those
    /// with a job in flight and, with `cancel`, retracts its credits once its writes are done.
    fn fail(&mut self, ctx: &mut Ctx<'_>, id: XferId, err: XferError, cancel: bool) {
        let Some(x) = self.xfers.remove(&id) else {
            return;
        };
        self.timers.stop(id);
        if x.staged {
            self.stop_staging(x.plan.local_arena);
        }
        let arena = x.plan.local_arena;
        let mut writes = 0;
        for stage in &x.stages {
            match *stage {
                Stage::Gathering { local, job, .. } => {
                    self.jobs.remove(&job);
                    self.orphans.insert(job, Orphan { xfer: id, arena, region: Some(local), kind: JobKind::Gather });
                }
                Stage::Writing { source, job, .. } => {
                    self.jobs.remove(&job);
                    let region = match source {
                        WriteSource::Arena(local) => Some(local),
                        WriteSource::User { .. } => None,
                    };
                    self.orphans.insert(job, Orphan { xfer: id, arena, region, kind: JobKind::Write });
                    writes += 1;
                }
                Stage::Gathered { local } | Stage::DataSent { source: WriteSource::Arena(local), .. } => {
                    release(ctx, arena, local);
                }
                Stage::Reading { local, job, .. } => {
                    // The cancel waits for it, as for a write: the target must not reuse a
                    // region our READ may still be reading.
                    self.jobs.remove(&job);
                    self.orphans.insert(job, Orphan { xfer: id, arena, region: Some(local), kind: JobKind::Read });
                    writes += 1;
                }
                Stage::Pulled { local, job } => {
                    self.jobs.remove(&job);
                    self.orphans.insert(job, Orphan { xfer: id, arena, region: Some(local), kind: JobKind::Scatter });
                }
                Stage::DataSent { source: WriteSource::User { .. }, .. }
                | Stage::Idle
                | Stage::Parked { .. }
                | Stage::Acked => {}
            }
        }
        // A claim of our standing region: the region may hold (or be about to receive) this
        // transfer's write while the receiver refused the claim and left it with the standing
        // flow, which then goes too, after the writes, and is opened afresh by a later submit.
        let standing = x.claimed.filter(|&(s, _)| self.standing.get(&x.peer).is_some_and(|slot| slot.xfer == s));
        if standing.is_some() {
            // Its cancel goes with this transfer's, below (after the writes when some are out).
            self.close_standing(ctx, x.peer, false);
        } else if let Some((s, _)) = x.claimed {
            // A standing flow already replaced: its late messages are still expected.
            self.tombstone(ctx.now, s, x.peer);
        }
        if cancel {
            if writes == 0 {
                ctx.send(x.peer, Msg::cancel(id, x.token, self.endpoint.clone()));
                if let Some((s, token)) = standing {
                    ctx.send(x.peer, Msg::cancel(s, token, self.endpoint.clone()));
                }
            } else {
                let pc = PendingCancel { peer: x.peer, token: x.token, writes, standing };
                self.pending_cancels.insert(id, pc);
            }
        }
        debug!(xfer = id.0, peer = x.peer.0, error = %err, acked = x.acked, orphaned_writes = writes, "transfer failed");
        ctx.stats.failed += 1;
        match err {
            XferError::Timeout => ctx.stats.timeouts += 1,
            XferError::Canceled => ctx.stats.canceled += 1,
            XferError::Refused => ctx.stats.refused += 1,
            _ => {}
        }
        ctx.push(Action::Complete { xfer: id, outcome: Err(err) });
        self.tombstone(ctx.now, id, x.peer);
    }

    /// A GRANT or ACK for a transfer not in flight: quietly ignored when it finished recently
    /// (the message crossed our completion or cancel), a protocol error otherwise.
    fn unknown(&self, ctx: &mut Ctx<'_>, from: PeerId, xfer: XferId) -> Result<(), ProtocolError> {
        if self.finished.get(&xfer) == Some(&from) {
            trace!(xfer = xfer.0, "late message for a finished transfer ignored");
            ctx.stats.late_msgs += 1;
            return Ok(());
        }
        Err(ProtocolError::UnknownXfer { peer: from, xfer })
    }

    /// Remembers a finished transfer for two timeouts: long enough for every message in
    /// flight about it to arrive.
    fn tombstone(&mut self, now: Instant, id: XferId, peer: PeerId) {
        self.finished.insert(id, peer);
        self.finished_order.push_back((now + 2 * self.timeout, id));
    }

    fn prune(&mut self, now: Instant) {
        while let Some(&(t, id)) = self.finished_order.front() {
            if t > now {
                break;
            }
            self.finished_order.pop_front();
            self.finished.remove(&id);
        }
    }
}

/// Checks what the peer's decoder and scheduler would refuse, so a bad plan fails at submit
/// rather than after a timeout.
/// Most gather runs a later PULL of a READ carries (one chunk with more goes alone).
pub(crate) const PULL_FRAME_RUNS: usize = 1024;

/// How a READ's chunks are split into PULLs, as (index of the first chunk, the chunks): the
/// first chunk alone, so the target gathers it while the rest are still encoded, sent and
/// decoded; then whole chunks up to [`PULL_FRAME_RUNS`] runs a PULL.
fn pull_frames(chunks: &[crate::plan::Chunk]) -> impl Iterator<Item = (usize, &[crate::plan::Chunk])> + '_ {
    let mut first = 0;
    std::iter::from_fn(move || {
        if first >= chunks.len() {
            return None;
        }
        let mut end = first + 1;
        if first > 0 {
            let mut runs = chunks[first].gather.len();
            while end < chunks.len() && runs + chunks[end].gather.len() <= PULL_FRAME_RUNS {
                runs += chunks[end].gather.len();
                end += 1;
            }
        }
        let part = (first, &chunks[first..end]);
        first = end;
        Some(part)
    })
}

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoint::Endpoint;
    use crate::endpoint::WriteRoute;
    use crate::endpoint::tests::*;

    fn r(kib: u64) -> Region {
        Region { offset: kib * KIB, len: CHUNK }
    }

    /// A READ's PULLs: its first chunk alone, then whole chunks up to PULL_FRAME_RUNS runs a
    /// PULL, a chunk with more alone; every chunk exactly once, in order.
    #[test]
    fn a_read_is_pulled_first_chunk_alone_then_in_frames_of_whole_chunks() {
        let run = CopyRun { region_off: 0, addr: SRC, len: 1, count: 1, region_stride: 0, addr_stride: 0 };
        let chunk = |runs: usize| crate::plan::Chunk { gather: Arc::new(vec![run; runs]), ..Default::default() };
        let runs = [600, 600, 400, 30, 2000, 1, 1024, 1];
        let chunks: Vec<_> = runs.iter().map(|&n| chunk(n)).collect();
        let frames: Vec<(usize, usize)> = pull_frames(&chunks).map(|(first, part)| (first, part.len())).collect();
        // 600 + 400 fit in one; 30 + 2000 do not; 2000 and 1024 + 1 go alone.
        assert_eq!(frames, [(0, 1), (1, 2), (3, 1), (4, 1), (5, 1), (6, 1), (7, 1)]);
        let mut next = 0;
        for &(first, n) in &frames {
            assert_eq!(first, next, "in order, none skipped");
            assert!(n == 1 || runs[first..first + n].iter().sum::<usize>() <= PULL_FRAME_RUNS);
            next = first + n;
        }
        assert_eq!(next, runs.len());
        let one: Vec<_> = pull_frames(&chunks[..1]).map(|(f, p)| (f, p.len())).collect();
        assert_eq!(one, [(0, 1)]);
    }

    fn is_cancel(m: &Msg, xfer: XferId) -> bool {
        matches!(m, Msg::Want(w) if w.is_cancel() && w.xfer == xfer && w.token == TOKEN)
    }

    /// Feeds `msg` from `PEER` and returns the resulting actions.
    fn feed(ep: &mut Endpoint, now: Instant, msg: Msg) -> Vec<Action> {
        ep.handle_msg(now, PEER, msg).unwrap();
        drain(ep)
    }

    #[test]
    fn a_chunks_plan_follows_its_write_when_its_credit_comes_and_a_replan_sends_the_runs_with_the_data() {
        let now = Instant::now();
        let cfg = Config { plan_ahead_runs: 1, ..config(64 * KIB, 2, true) };
        let mut ep = Endpoint::new(&cfg, now).unwrap();
        let t = now;
        let plan = direct_plan_of(3);
        let runs = |i: usize| plan.chunks[i].scatter.clone();
        ep.submit(t, X, TOKEN, PEER, plan.clone()).unwrap();
        // The WANT alone: no plan crosses the control channel while the WANT and GRANT do.
        let sent: Vec<Msg> = msgs(&drain(&mut ep)).into_iter().map(|(_, m)| m).collect();
        assert!(matches!(&sent[..], [Msg::Want(_)]), "{sent:?}");
        let plan_msg =
            |i: u32| Msg::Plan(wire::Plan { xfer: X, token: TOKEN, chunk: ChunkIdx(i), runs: runs(i as usize) });
        // Credits for chunks 0 and 1: both writes are posted first, then both plans.
        let acts = feed(&mut ep, t, grant_msg(X, &[(0, r(0)), (1, r(4))]));
        let w = writes(&acts);
        assert_eq!(w.len(), 2);
        let first_send = acts.iter().position(|a| matches!(a, Action::Send { .. })).unwrap();
        let last_write = acts.iter().rposition(|a| matches!(a, Action::Write { .. })).unwrap();
        assert!(last_write < first_send, "writes before plans: {acts:?}");
        assert_eq!(msgs(&acts).into_iter().map(|(_, m)| m).collect::<Vec<_>>(), [plan_msg(0), plan_msg(1)]);
        assert_eq!(ep.stats().plans_sent, 2);
        // Chunk 0 written: its DATA names no runs.
        ep.handle_write_done(t, w[0].0, true);
        let sent: Vec<Msg> = msgs(&drain(&mut ep)).into_iter().map(|(_, m)| m).collect();
        assert_eq!(sent, [data_msg(X, 0, r(0), Vec::new())]);
        // The receiver kept no plan: the same DATA again, with its runs.
        let sent = msgs(&feed(&mut ep, t, ack_msg(X, 0, r(0), AckStatus::Replan)));
        assert_eq!(sent, [(PEER, data_msg(X, 0, r(0), runs(0)))]);
        assert_eq!(ep.stats().replans, 1);
        assert!(feed(&mut ep, t, ack_msg(X, 0, r(0), AckStatus::Scattered)).is_empty());
        assert_eq!(ep.sender().acked_chunks(X), Some(1));
        // Chunk 2's credit brings its plan; a second credit for a planned chunk cannot come.
        let acts = feed(&mut ep, t, grant_msg(X, &[(2, r(0))]));
        assert_eq!(msgs(&acts).into_iter().map(|(_, m)| m).collect::<Vec<_>>(), [plan_msg(2)]);
        assert_eq!(ep.stats().plans_sent, 3);
    }

    #[test]
    fn eager_lifecycle_gathers_before_the_grant_and_completes_after_every_ack() {
        let (mut ep, t) = endpoint(64 * KIB, 2, true);
        ep.set_local_endpoint(b"tcp://me".to_vec());
        ep.submit(t, X, TOKEN, PEER, plan_of(3)).unwrap();
        let acts = drain(&mut ep);
        // WANT first, then eager gathers of the first W chunks, staged under the eager budget.
        let Action::Send { peer, msg: Msg::Want(w) } = &acts[0] else { panic!("{acts:?}") };
        assert_eq!((*peer, w.xfer, &w.chunks[..], &w.endpoint[..]), (PEER, X, &[CHUNK; 3][..], &b"tcp://me"[..]));
        let g = gathers(&acts);
        assert_eq!(g.len(), 2);
        assert_eq!(ep.scheduler().eager_bytes(), 2 * CHUNK + CHUNK, "two chunks and the reserve");

        // Credits for chunks 0 and 1 promote the eager regions; nothing to do until gathers end.
        assert!(feed(&mut ep, t, grant_msg(X, &[(0, r(0)), (1, r(4))])).is_empty());
        assert_eq!(ep.scheduler().eager_bytes(), CHUNK, "only the reserve");
        ep.handle_gather_done(t, g[0].0, true);
        let w0 = writes(&drain(&mut ep));
        assert_eq!(w0, vec![(w0[0].0, WriteSource::Arena(g[0].1), r(0), CHUNK)]);
        ep.handle_gather_done(t, g[1].0, true);
        let w1 = writes(&drain(&mut ep));

        // Write done -> DATA with the credit's region and the chunk's scatter runs.
        ep.handle_write_done(t, w0[0].0, true);
        let m = msgs(&drain(&mut ep));
        let Msg::Data(d) = &m[0].1 else { panic!("{m:?}") };
        assert_eq!((d.chunk, d.region, d.runs[0].addr), (ChunkIdx(0), r(0), DST));
        ep.handle_write_done(t, w1[0].0, true);
        drain(&mut ep);

        // ACK releases the staging region; the next credit gathers on arrival.
        assert!(feed(&mut ep, t, ack_msg(X, 0, r(0), AckStatus::Scattered)).is_empty());
        assert_eq!(ep.scheduler().local_bytes(), CHUNK + CHUNK, "chunk 1's staging and the reserve");
        let g2 = gathers(&feed(&mut ep, t, grant_msg(X, &[(2, r(0))])));
        assert_eq!(g2.len(), 1);
        assert_eq!(ep.scheduler().eager_bytes(), CHUNK, "credit-backed staging is not eager");
        ep.handle_gather_done(t, g2[0].0, true);
        let w2 = writes(&drain(&mut ep));
        ep.handle_write_done(t, w2[0].0, true);
        drain(&mut ep);
        feed(&mut ep, t, ack_msg(X, 1, r(4), AckStatus::Scattered));
        check(&ep);
        let acts = feed(&mut ep, t, ack_msg(X, 2, r(0), AckStatus::Scattered));
        assert_eq!(completes(&acts), vec![(X, Ok(()))]);
        assert!(ep.is_idle());
        assert_eq!(ep.arena_free_bytes(), 64 * KIB);
        assert_eq!(ep.poll_timeout(), None);
        assert_eq!((ep.stats().chunks_written, ep.stats().bytes_written), (3, 3 * CHUNK));
    }

    /// The two control round trips are timed from the pass that sent to the pass that read the
    /// answer: WANT -> first GRANT once per WRITE (a later GRANT refills the window and is
    /// not one), DATA -> ACK once per scattered chunk, from the DATA sent last (a replan's).
    #[test]
    fn the_want_grant_and_data_ack_round_trips_are_timed_by_the_time_passed_in() {
        let us = Duration::from_micros;
        let (mut ep, t) = endpoint(64 * KIB, 1, false);
        ep.submit(t, X, TOKEN, PEER, plan_of(2)).unwrap();
        drain(&mut ep);
        let g = gathers(&feed(&mut ep, t + us(7), grant_msg(X, &[(0, r(0))])));
        assert_eq!((ep.stats().grant_waits, ep.stats().grant_wait_ns), (1, 7_000));
        ep.handle_gather_done(t + us(8), g[0].0, true);
        let w = writes(&drain(&mut ep));
        ep.handle_write_done(t + us(10), w[0].0, true);
        drain(&mut ep);
        // A replan at +20 sends the DATA again: the round trip counts from there.
        feed(&mut ep, t + us(20), ack_msg(X, 0, r(0), AckStatus::Replan));
        feed(&mut ep, t + us(31), ack_msg(X, 0, r(0), AckStatus::Scattered));
        assert_eq!((ep.stats().ack_waits, ep.stats().ack_wait_ns), (1, 11_000));
        // Chunk 1's credit refills the window: no WANT went before it.
        let g = gathers(&feed(&mut ep, t + us(40), grant_msg(X, &[(1, r(0))])));
        assert_eq!((ep.stats().grant_waits, ep.stats().grant_wait_ns), (1, 7_000));
        ep.handle_gather_done(t + us(41), g[0].0, true);
        let w = writes(&drain(&mut ep));
        ep.handle_write_done(t + us(45), w[0].0, true);
        drain(&mut ep);
        let acts = feed(&mut ep, t + us(50), ack_msg(X, 1, r(0), AckStatus::Scattered));
        assert_eq!(completes(&acts), vec![(X, Ok(()))]);
        assert_eq!((ep.stats().ack_waits, ep.stats().ack_wait_ns), (2, 16_000));
    }

    /// The WANT of an inline submission carries the chunk's bytes and runs and nothing is
    /// staged; the ACK alone completes it (timed from the WANT). Declined (a GRANT comes
    /// instead), the chunk goes the usual way, and its ACK must then name the granted region.
    #[test]
    fn an_inline_chunk_rides_in_its_want_and_its_ack_alone_completes_it_or_a_grant_sends_it_the_usual_way() {
        let us = Duration::from_micros;
        for declined in [false, true] {
            let (mut ep, t) = endpoint(64 * KIB, 2, true);
            let bytes = vec![0x5a; CHUNK as usize];
            ep.submit_write(t, X, TOKEN, PEER, plan_of(1), WriteRoute::inline(bytes.clone())).unwrap();
            let acts = drain(&mut ep);
            assert!(gathers(&acts).is_empty(), "nothing staged, even eagerly: {acts:?}");
            let [(_, Msg::Want(w))] = &msgs(&acts)[..] else { panic!("one WANT: {acts:?}") };
            let inline = w.inline.as_ref().expect("inline");
            assert_eq!((&inline.bytes, &inline.runs), (&bytes, &plan_of(1).chunks[0].scatter));
            assert_eq!(ep.stats().inline_sent, 1);
            if !declined {
                let acts = feed(&mut ep, t + us(9), ack_msg(X, 0, r(12), AckStatus::Scattered));
                assert_eq!(completes(&acts), vec![(X, Ok(()))]);
                assert_eq!((ep.stats().inline_acks, ep.stats().inline_ack_wait_ns), (1, 9_000));
                assert_eq!((ep.stats().chunks_written, ep.stats().grant_waits), (0, 0));
            } else {
                let g = gathers(&feed(&mut ep, t, grant_msg(X, &[(0, r(8))])));
                assert_eq!((g.len(), ep.stats().inline_declined), (1, 1));
                ep.handle_gather_done(t, g[0].0, true);
                let w = writes(&drain(&mut ep));
                ep.handle_write_done(t, w[0].0, true);
                drain(&mut ep);
                // Now only an ACK for the granted region ends it.
                assert!(ep.handle_msg(t, PEER, ack_msg(X, 0, r(12), AckStatus::Scattered)).is_err());
                let acts = feed(&mut ep, t, ack_msg(X, 0, r(8), AckStatus::Scattered));
                assert_eq!(completes(&acts), vec![(X, Ok(()))]);
                assert_eq!((ep.stats().chunks_written, ep.stats().inline_acks), (1, 0));
            }
            assert!(ep.is_idle());
            assert_eq!(ep.arena_free_bytes(), 64 * KIB);
            check(&ep);
        }
    }

    #[test]
    fn inline_bytes_that_are_not_the_plans_one_chunk_are_not_sent() {
        let (mut ep, t) = endpoint(64 * KIB, 2, false);
        // Two chunks; then one chunk with bytes of another length.
        ep.submit_write(t, X, TOKEN, PEER, plan_of(2), WriteRoute::inline(vec![0; 2 * CHUNK as usize])).unwrap();
        let short = WriteRoute::inline(vec![0; CHUNK as usize - 1]);
        ep.submit_write(t, XferId(2), TOKEN, PEER, plan_of(1), short).unwrap();
        for (_, m) in msgs(&drain(&mut ep)) {
            let Msg::Want(w) = m else { panic!("{m:?}") };
            assert!(w.inline.is_none());
        }
        assert_eq!(ep.stats().inline_sent, 0);
    }

    /// A plan stages in the arena it names (its gathers and the write read there; the reserve
    /// is that arena's) and bounces through the peer's arena it names; one naming an arena we
    /// lack is refused at submit, changing nothing.
    /// Each arena stages chunks up to its own max chunk (a host arena's 2 MiB, a GPU arena's
    /// 32 MiB by default): a plan of larger chunks is taken through an arena added with them
    /// and refused through the first, whose max chunk is the configuration's.
    #[test]
    fn each_arena_stages_chunks_up_to_its_own_max_chunk() {
        let (mut ep, t) = endpoint(64 * KIB, 2, false);
        assert_eq!(ep.add_arena(64 * KIB, KIB, 4 * CHUNK).unwrap(), ArenaId(1));
        let big = |xfer: u64, arena: u8| {
            let descs: Vec<crate::plan::DescPair> = (0..2)
                .map(|i| crate::plan::DescPair { src: SRC + i * 2 * CHUNK, dst: DST + i * 2 * CHUNK, len: 2 * CHUNK })
                .collect();
            let mut p = crate::plan::plan(&descs, crate::plan::PlanParams::new(4 * CHUNK)).unwrap();
            p.dests = vec![crate::proof::Destination { reg: REG, key: KEY }];
            p.local_arena = ArenaId(arena);
            assert_eq!(p.chunks.len(), 1, "one chunk of {} bytes", p.chunks[0].bytes);
            p.chunks[0].direct = None; // staged, not written from its (contiguous) sources
            (XferId(xfer), p)
        };
        let (x, p) = big(1, 0);
        assert!(matches!(ep.submit(t, x, TOKEN, PEER, p), Err(SubmitError::ChunkTooLarge { max: CHUNK, .. })));
        let (x, p) = big(2, 1);
        ep.submit(t, x, TOKEN, PEER, p).unwrap();
        drain(&mut ep);
        assert_eq!(ep.schedulers().get(ArenaId(1)).local_bytes(), 4 * CHUNK, "its reserve: one chunk of its size");
    }

    #[test]
    fn a_transfer_stages_in_its_own_arena_and_writes_into_the_peers_it_names() {
        let (mut ep, t) = endpoint(64 * KIB, 2, false);
        let through = |local: u8, peer: u8| {
            let mut p = plan_of(1);
            (p.local_arena, p.peer_arena) = (ArenaId(local), ArenaId(peer));
            p
        };
        let refused = ep.submit(t, XferId(9), TOKEN, PEER, through(1, 0));
        assert_eq!(refused, Err(SubmitError::NoSuchArena { xfer: XferId(9), arena: ArenaId(1) }));
        assert!(drain(&mut ep).is_empty() && ep.is_idle());
        assert_eq!(ep.add_arena(16 * KIB, KIB, CHUNK).unwrap(), ArenaId(1));
        ep.submit(t, X, TOKEN, PEER, through(1, 3)).unwrap();
        let wants: Vec<ArenaId> = msgs(&drain(&mut ep))
            .into_iter()
            .filter_map(|(_, m)| if let Msg::Want(w) = m { Some(w.arena) } else { None })
            .collect();
        assert_eq!(wants, vec![ArenaId(3)]);
        let (first, second) = (ep.schedulers().get(ArenaId(0)), ep.schedulers().get(ArenaId(1)));
        assert_eq!((first.local_bytes(), second.local_bytes()), (0, CHUNK), "the reserve is the staging arena's");
        let acts = feed(&mut ep, t, grant_msg(X, &[(0, r(8))]));
        let gather = acts.iter().find_map(|a| match a {
            Action::Gather { job, arena, .. } => Some((*job, *arena)),
            _ => None,
        });
        let (job, arena) = gather.expect("a gather");
        assert_eq!(arena, ArenaId(1));
        ep.handle_gather_done(t, job, true);
        let acts = drain(&mut ep);
        let write = acts.iter().find_map(|a| match a {
            Action::Write { job, arena, remote_arena, .. } => Some((*job, *arena, *remote_arena)),
            _ => None,
        });
        let (job, arena, remote_arena) = write.expect("a write");
        assert_eq!((arena, remote_arena), (ArenaId(1), ArenaId(3)));
        ep.handle_write_done(t, job, true);
        drain(&mut ep);
        let acts = feed(&mut ep, t, ack_msg(X, 0, r(8), AckStatus::Scattered));
        assert_eq!(completes(&acts), vec![(X, Ok(()))]);
        // Done: the staging region and the reserve are back in arena 1.
        assert_eq!(ep.schedulers().get(ArenaId(1)).free_bytes(), 16 * KIB);
        assert_eq!(ep.arena_free_bytes(), 80 * KIB);
        for (_, sched) in ep.schedulers().iter() {
            sched.check_invariants().unwrap();
        }
    }

    #[test]
    fn non_eager_gathers_only_when_a_credit_arrives() {
        let (mut ep, t) = endpoint(64 * KIB, 2, false);
        ep.submit(t, X, TOKEN, PEER, plan_of(2)).unwrap();
        let acts = drain(&mut ep);
        assert_eq!(acts.len(), 1, "only the WANT: {acts:?}");
        assert_eq!(ep.scheduler().local_bytes(), CHUNK, "only the reserve");
        let g = gathers(&feed(&mut ep, t, grant_msg(X, &[(1, r(8))])));
        assert_eq!(g.len(), 1);
        ep.handle_gather_done(t, g[0].0, true);
        let w = writes(&drain(&mut ep));
        assert_eq!(w[0].2, r(8), "credits bind to their own chunk, in any order");
    }

    #[test]
    fn credit_is_parked_when_the_local_arena_is_full_and_staged_after_a_release() {
        // The arena holds one chunk: the second credit must wait for the first ACK.
        let (mut ep, t) = endpoint(4 * KIB, 2, false);
        ep.submit(t, X, TOKEN, PEER, plan_of(2)).unwrap();
        drain(&mut ep);
        let g = gathers(&feed(&mut ep, t, grant_msg(X, &[(0, r(0)), (1, r(4))])));
        assert_eq!(g.len(), 1);
        assert_eq!(ep.sender().parked_credits(), 1);
        ep.handle_gather_done(t, g[0].0, true);
        let w = writes(&drain(&mut ep));
        ep.handle_write_done(t, w[0].0, true);
        drain(&mut ep);
        let g1 = gathers(&feed(&mut ep, t, ack_msg(X, 0, r(0), AckStatus::Scattered)));
        assert_eq!(g1.len(), 1, "the freed region goes to the parked credit");
        assert_eq!(ep.sender().parked_credits(), 0);
        check(&ep);
    }

    #[test]
    fn a_credit_that_finds_the_arena_full_of_remote_grants_takes_the_reserve() {
        let (mut ep, t) = endpoint(8 * KIB, 2, false);
        ep.submit(t, X, TOKEN, PEER, plan_of(2)).unwrap();
        drain(&mut ep);
        assert_eq!(ep.scheduler().local_bytes(), CHUNK, "the reserve is taken before any grant");
        // The peer also writes to us, and its credits take the rest of the arena.
        ep.handle_msg(t, PEER, want_msg(XferId(50), &[CHUNK; 4])).unwrap();
        drain(&mut ep);
        assert_eq!(ep.arena_free_bytes(), 0);
        let g = gathers(&feed(&mut ep, t, grant_msg(X, &[(0, r(0)), (1, r(4))])));
        assert_eq!(g.len(), 1, "chunk 0 is staged in the reserve");
        assert_eq!(ep.sender().parked_credits(), 1);
        ep.handle_gather_done(t, g[0].0, true);
        let w = writes(&drain(&mut ep));
        ep.handle_write_done(t, w[0].0, true);
        drain(&mut ep);
        // Its ACK frees the region: the parked credit takes it before the remote flow does.
        let g1 = gathers(&feed(&mut ep, t, ack_msg(X, 0, r(0), AckStatus::Scattered)));
        assert_eq!(g1.len(), 1);
        ep.handle_gather_done(t, g1[0].0, true);
        let w = writes(&drain(&mut ep));
        ep.handle_write_done(t, w[0].0, true);
        drain(&mut ep);
        let acts = feed(&mut ep, t, ack_msg(X, 1, r(4), AckStatus::Scattered));
        assert_eq!(completes(&acts), vec![(X, Ok(()))]);
        // With no transfer left the reserve goes back, straight to the waiting remote flow.
        assert_eq!(ep.scheduler().local_bytes(), 0);
        assert_eq!(ep.scheduler().flow_held_count(crate::types::FlowKey { peer: PEER, xfer: XferId(50) }), 2);
        check(&ep);
    }

    #[test]
    fn cancel_completes_at_once_but_retracts_credits_only_after_in_flight_writes() {
        let (mut ep, t) = endpoint(64 * KIB, 2, true);
        ep.submit(t, X, TOKEN, PEER, plan_of(3)).unwrap();
        let g = gathers(&drain(&mut ep));
        feed(&mut ep, t, grant_msg(X, &[(0, r(0))]));
        ep.handle_gather_done(t, g[0].0, true);
        let w = writes(&drain(&mut ep));

        ep.cancel(t, X);
        let acts = drain(&mut ep);
        assert_eq!(completes(&acts), vec![(X, Err(XferError::Canceled))]);
        assert!(msgs(&acts).is_empty(), "no cancel while a write may still land: {acts:?}");
        // Chunk 0's write and chunk 1's gather are in flight: their regions are orphans.
        assert_eq!(ep.orphans(), 2);
        assert_eq!(ep.scheduler().local_bytes(), 2 * CHUNK);

        ep.handle_write_done(t, w[0].0, true);
        let m = msgs(&drain(&mut ep));
        assert!(m.len() == 1 && is_cancel(&m[0].1, X), "{m:?}");
        ep.handle_gather_done(t, g[1].0, true);
        assert!(drain(&mut ep).is_empty());
        assert!(ep.is_idle());
        assert_eq!(ep.arena_free_bytes(), 64 * KIB);
        // A second cancel, or a late credit, is harmless.
        ep.cancel(t, X);
        assert!(feed(&mut ep, t, grant_msg(X, &[(1, r(4))])).is_empty());
        assert_eq!(ep.stats().late_msgs, 1);
    }

    #[test]
    fn no_progress_for_the_request_timeout_fails_the_transfer_and_cancels_it() {
        let (mut ep, t) = endpoint(64 * KIB, 2, false);
        ep.submit(t, X, TOKEN, PEER, plan_of(2)).unwrap();
        drain(&mut ep);
        assert_eq!(ep.poll_timeout(), Some(t + TIMEOUT));
        ep.handle_timeout(t + TIMEOUT / 2);
        assert!(drain(&mut ep).is_empty(), "an early call is harmless");
        // A credit is progress: the deadline moves.
        let half = t + TIMEOUT / 2;
        let g = gathers(&feed(&mut ep, half, grant_msg(X, &[(0, r(0))])));
        ep.handle_timeout(t + TIMEOUT);
        assert!(drain(&mut ep).is_empty());
        assert_eq!(ep.poll_timeout(), Some(half + TIMEOUT));
        ep.handle_timeout(half + TIMEOUT);
        let acts = drain(&mut ep);
        assert_eq!(completes(&acts), vec![(X, Err(XferError::Timeout))]);
        assert!(is_cancel(&msgs(&acts)[0].1, X));
        assert_eq!(ep.orphans(), 1, "the gather is still in flight");
        ep.handle_gather_done(half + TIMEOUT, g[0].0, true);
        assert!(ep.is_idle());
        assert_eq!(ep.stats().timeouts, 1);
    }

    #[test]
    fn a_credit_that_went_stale_is_never_written() {
        let (mut ep, t) = endpoint(64 * KIB, 2, false);
        ep.submit(t, X, TOKEN, PEER, plan_of(1)).unwrap();
        drain(&mut ep);
        let g = gathers(&feed(&mut ep, t, grant_msg(X, &[(0, r(0))])));
        // The shell reports the gather only after a whole timeout (and never ran our timer).
        ep.handle_gather_done(t + TIMEOUT, g[0].0, true);
        let acts = drain(&mut ep);
        assert!(writes(&acts).is_empty());
        assert_eq!(completes(&acts), vec![(X, Err(XferError::Timeout))]);
        assert!(ep.is_idle());
    }

    #[test]
    fn peer_loss_fails_its_transfers_without_a_cancel_and_frees_orphans_on_their_done_events() {
        let (mut ep, t) = endpoint(64 * KIB, 2, true);
        ep.submit(t, X, TOKEN, PEER, plan_of(2)).unwrap();
        ep.submit(t, XferId(2), TOKEN, PeerId(8), plan_of(1)).unwrap();
        let g = gathers(&drain(&mut ep));
        ep.handle_peer_lost(t, PEER);
        let acts = drain(&mut ep);
        assert_eq!(completes(&acts), vec![(X, Err(XferError::PeerLost))]);
        assert!(msgs(&acts).is_empty());
        assert_eq!(ep.in_flight_xfers(), 1, "the other peer's transfer lives on");
        assert_eq!(ep.orphans(), 2);
        ep.handle_gather_done(t, g[0].0, false);
        ep.handle_gather_done(t, g[1].0, true);
        assert!(drain(&mut ep).is_empty());
        assert_eq!(ep.orphans(), 0);
        assert_eq!(ep.scheduler().local_bytes(), 2 * CHUNK, "XferId(2)'s eager region and the reserve");
        check(&ep);
    }

    #[test]
    fn shutdown_fails_everything_and_refuses_new_transfers() {
        let (mut ep, t) = endpoint(64 * KIB, 2, true);
        ep.submit(t, X, TOKEN, PEER, plan_of(1)).unwrap();
        let g = gathers(&drain(&mut ep));
        ep.shutdown(t);
        let acts = drain(&mut ep);
        assert_eq!(completes(&acts), vec![(X, Err(XferError::ShuttingDown))]);
        assert!(is_cancel(&msgs(&acts)[0].1, X));
        assert_eq!(ep.submit(t, XferId(9), TOKEN, PEER, plan_of(1)), Err(SubmitError::ShuttingDown));
        assert!(!ep.is_idle(), "the gather is still in flight");
        ep.handle_gather_done(t, g[0].0, true);
        assert!(ep.is_idle());
        assert_eq!(ep.arena_free_bytes(), 64 * KIB);
    }

    /// Runs chunk 0 of a fresh 2-chunk transfer up to its DATA; returns the endpoint.
    fn up_to_data(eager: bool) -> (Endpoint, Instant) {
        let (mut ep, t) = endpoint(64 * KIB, 2, eager);
        ep.submit(t, X, TOKEN, PEER, plan_of(2)).unwrap();
        let mut g = gathers(&drain(&mut ep));
        g.extend(gathers(&feed(&mut ep, t, grant_msg(X, &[(0, r(0))]))));
        ep.handle_gather_done(t, g[0].0, true);
        let w = writes(&drain(&mut ep));
        ep.handle_write_done(t, w[0].0, true);
        drain(&mut ep);
        (ep, t)
    }

    #[test]
    fn a_refused_or_failed_scatter_fails_the_transfer_and_cancels_it() {
        for (status, err) in [(AckStatus::Refused, XferError::Refused), (AckStatus::Failed, XferError::ScatterFailed)] {
            let (mut ep, t) = up_to_data(false);
            let acts = feed(&mut ep, t, ack_msg(X, 0, r(0), status));
            assert_eq!(completes(&acts), vec![(X, Err(err))]);
            assert!(is_cancel(&msgs(&acts)[0].1, X));
            assert!(ep.is_idle());
            assert_eq!(ep.arena_free_bytes(), 64 * KIB);
        }
    }

    #[test]
    fn gather_and_write_failures_fail_the_transfer() {
        let (mut ep, t) = endpoint(64 * KIB, 2, true);
        ep.submit(t, X, TOKEN, PEER, plan_of(2)).unwrap();
        let g = gathers(&drain(&mut ep));
        ep.handle_gather_done(t, g[0].0, false);
        assert_eq!(completes(&drain(&mut ep)), vec![(X, Err(XferError::GatherFailed))]);
        ep.handle_gather_done(t, g[1].0, true);
        assert!(ep.is_idle());

        let (mut ep, t) = endpoint(64 * KIB, 2, false);
        ep.submit(t, X, TOKEN, PEER, plan_of(1)).unwrap();
        drain(&mut ep);
        let g = gathers(&feed(&mut ep, t, grant_msg(X, &[(0, r(0))])));
        ep.handle_gather_done(t, g[0].0, true);
        let w = writes(&drain(&mut ep));
        ep.handle_write_done(t, w[0].0, false);
        let acts = drain(&mut ep);
        assert_eq!(completes(&acts), vec![(X, Err(XferError::WriteFailed))]);
        assert!(is_cancel(&msgs(&acts)[0].1, X), "the failed write is over: cancel at once");
        assert!(ep.is_idle());
    }

    #[test]
    fn bad_peer_input_is_rejected_and_changes_nothing() {
        let (mut ep, t) = up_to_data(true);
        let before = format!("{:?}", ep.sender());
        let cases = [
            (PEER, grant_msg(XferId(99), &[(1, r(4))])),
            (PeerId(3), grant_msg(X, &[(1, r(4))])),
            (PEER, grant_msg(X, &[])),
            (PEER, grant_msg(X, &[(2, r(4))])),
            (PEER, grant_msg(X, &[(0, r(4))])),
            (PEER, grant_msg(X, &[(1, r(4)), (1, r(8))])),
            (PEER, grant_msg(X, &[(1, Region { offset: 0, len: 16 })])),
            (PEER, grant_msg(X, &[(1, Region { offset: u64::MAX - 10, len: CHUNK })])),
            (PEER, ack_msg(X, 1, r(4), AckStatus::Scattered)),
            (PEER, ack_msg(X, 0, r(4), AckStatus::Scattered)),
            (PEER, ack_msg(X, 5, r(0), AckStatus::Scattered)),
            (PeerId(3), ack_msg(X, 0, r(0), AckStatus::Refused)),
        ];
        let n = cases.len() as u64;
        for (from, msg) in cases {
            assert!(ep.handle_msg(t, from, msg.clone()).is_err(), "{msg:?} accepted");
            assert!(drain(&mut ep).is_empty());
            assert_eq!(format!("{:?}", ep.sender()), before, "{msg:?} changed the state");
        }
        assert_eq!(ep.stats().protocol_errors, n);
        // Valid input still works afterwards.
        assert!(ep.handle_msg(t, PEER, ack_msg(X, 0, r(0), AckStatus::Scattered)).is_ok());
    }

    #[test]
    fn submit_rejects_plans_the_peer_could_not_accept() {
        let (mut ep, t) = endpoint(64 * KIB, 2, true);
        assert_eq!(ep.submit(t, X, TOKEN, PEER, Plan::default()), Err(SubmitError::EmptyPlan { xfer: X }));
        let big = crate::plan::plan(
            &[crate::plan::DescPair { src: SRC, dst: DST, len: 8 * KIB }],
            crate::plan::PlanParams::new(8 * KIB),
        )
        .unwrap();
        assert!(matches!(ep.submit(t, X, TOKEN, PEER, big), Err(SubmitError::ChunkTooLarge { .. })));
        let mut bad = plan_of(1);
        bad.chunks[0].scatter[0].len = 2 * CHUNK;
        assert!(matches!(ep.submit(t, X, TOKEN, PEER, bad), Err(SubmitError::BadChunk { .. })));
        ep.submit(t, X, TOKEN, PEER, plan_of(1)).unwrap();
        assert_eq!(ep.submit(t, X, TOKEN, PEER, plan_of(1)), Err(SubmitError::DuplicateXfer { xfer: X }));
        ep.cancel(t, X);
        assert_eq!(
            ep.submit(t, X, TOKEN, PEER, plan_of(1)),
            Err(SubmitError::DuplicateXfer { xfer: X }),
            "ids are never reused"
        );
        assert_eq!(ep.stats().submitted, 1);
        let mut wraps = direct_plan_of(1);
        wraps.chunks[0].direct = Some(u64::MAX - 8);
        assert!(matches!(ep.submit(t, XferId(2), TOKEN, PEER, wraps), Err(SubmitError::BadChunk { .. })));
    }

    // ---- direct chunks ----

    fn user(chunk: u64) -> WriteSource {
        WriteSource::User { addr: SRC + chunk * CHUNK }
    }

    /// Reports the write `w` done and returns the DATA it caused.
    fn finish_write(ep: &mut Endpoint, t: Instant, w: (JobId, WriteSource, Region, u64)) -> wire::Data {
        ep.handle_write_done(t, w.0, true);
        let m = msgs(&drain(ep));
        let [(_, Msg::Data(d))] = &m[..] else { panic!("{m:?}") };
        d.clone()
    }

    #[test]
    fn a_fully_direct_plan_is_written_from_user_memory_without_any_staging() {
        for eager in [false, true] {
            let (mut ep, t) = endpoint(64 * KIB, 2, eager);
            ep.submit(t, X, TOKEN, PEER, direct_plan_of(3)).unwrap();
            let acts = drain(&mut ep);
            assert!(matches!(&acts[..], [Action::Send { msg: Msg::Want(_), .. }]), "only the WANT: {acts:?}");
            assert_eq!(ep.scheduler().local_bytes(), 0, "no eager staging and no reserve");

            // Each credit posts its write at once, straight from the chunk's source.
            let w = writes(&feed(&mut ep, t, grant_msg(X, &[(1, r(4)), (0, r(0))])));
            assert_eq!(
                w.iter().map(|w| (w.1, w.2, w.3)).collect::<Vec<_>>(),
                vec![(user(1), r(4), CHUNK), (user(0), r(0), CHUNK)]
            );
            let d = finish_write(&mut ep, t, w[1]);
            assert_eq!((d.chunk, d.region, d.runs[0].addr), (ChunkIdx(0), r(0), DST));
            finish_write(&mut ep, t, w[0]);
            // A credit for a chunk already written is still a duplicate.
            assert!(ep.handle_msg(t, PEER, grant_msg(X, &[(0, r(8))])).is_err());
            assert!(feed(&mut ep, t, ack_msg(X, 0, r(0), AckStatus::Scattered)).is_empty());
            let w2 = writes(&feed(&mut ep, t, grant_msg(X, &[(2, r(0))])));
            assert_eq!(w2[0].1, user(2));
            finish_write(&mut ep, t, w2[0]);
            feed(&mut ep, t, ack_msg(X, 1, r(4), AckStatus::Scattered));
            let acts = feed(&mut ep, t, ack_msg(X, 2, r(0), AckStatus::Scattered));
            assert_eq!(completes(&acts), vec![(X, Ok(()))]);
            assert!(ep.is_idle());
            assert_eq!(ep.arena_free_bytes(), 64 * KIB);
            let st = ep.stats();
            assert_eq!((st.chunks_written, st.chunks_direct, st.bytes_written), (3, 3, 3 * CHUNK));
        }
    }

    /// Chunks 0 and 2 direct, 1 and 3 staged.
    fn mixed_plan() -> Plan {
        let mut p = direct_plan_of(4);
        p.chunks[1].direct = None;
        p.chunks[3].direct = None;
        p
    }

    #[test]
    fn a_mixed_plan_stages_only_its_staged_chunks() {
        // W = 2: the eager cap covers two staged chunks, however many direct ones precede them.
        let (mut ep, t) = endpoint(64 * KIB, 2, true);
        ep.submit(t, X, TOKEN, PEER, mixed_plan()).unwrap();
        let g = gathers(&drain(&mut ep));
        let gathered: Vec<_> = g.iter().map(|&(job, _)| job).collect();
        assert_eq!(g.len(), 2);
        assert_eq!(ep.scheduler().eager_bytes(), 2 * CHUNK + CHUNK, "chunks 1 and 3, and the reserve");

        let credits = [(0, r(0)), (1, r(4)), (2, r(8)), (3, r(12))];
        let w = writes(&feed(&mut ep, t, grant_msg(X, &credits)));
        assert_eq!(w.iter().map(|w| (w.1, w.2)).collect::<Vec<_>>(), vec![(user(0), r(0)), (user(2), r(8))]);
        let mut staged = Vec::new();
        for (job, (_, region)) in gathered.into_iter().zip(&g) {
            ep.handle_gather_done(t, job, true);
            let ws = writes(&drain(&mut ep));
            assert_eq!(ws[0].1, WriteSource::Arena(*region));
            staged.extend(ws);
        }
        for w in w.into_iter().chain(staged) {
            finish_write(&mut ep, t, w);
        }
        assert_eq!(ep.scheduler().local_bytes(), 2 * CHUNK + CHUNK);
        for (i, region) in credits.into_iter().take(3) {
            assert!(feed(&mut ep, t, ack_msg(X, i, region, AckStatus::Scattered)).is_empty());
        }
        assert_eq!(ep.scheduler().local_bytes(), CHUNK + CHUNK, "chunk 3's staging and the reserve");
        let acts = feed(&mut ep, t, ack_msg(X, 3, r(12), AckStatus::Scattered));
        assert_eq!(completes(&acts), vec![(X, Ok(()))]);
        assert!(ep.is_idle());
        assert_eq!(ep.arena_free_bytes(), 64 * KIB);
        assert_eq!((ep.stats().chunks_written, ep.stats().chunks_direct), (4, 2));
    }

    #[test]
    fn direct_chunks_write_even_when_the_local_arena_is_full() {
        // One staged chunk fills the arena; the direct ones need none of it.
        let (mut ep, t) = endpoint(4 * KIB, 2, false);
        ep.submit(t, X, TOKEN, PEER, mixed_plan()).unwrap();
        drain(&mut ep);
        let acts = feed(&mut ep, t, grant_msg(X, &[(1, r(4)), (3, r(12)), (0, r(0)), (2, r(8))]));
        assert_eq!(gathers(&acts).len(), 1);
        assert_eq!(ep.sender().parked_credits(), 1);
        assert_eq!(writes(&acts).iter().map(|w| w.1).collect::<Vec<_>>(), vec![user(0), user(2)]);
        check(&ep);
    }

    /// Submits `X` as `chunks` direct chunks and grants chunk 0 region `r(0)`: its write is
    /// in flight (the only job).
    fn direct_write_granted(ep: &mut Endpoint, t: Instant, chunks: u64) -> Vec<(JobId, WriteSource, Region, u64)> {
        ep.submit(t, X, TOKEN, PEER, direct_plan_of(chunks)).unwrap();
        drain(ep);
        writes(&feed(ep, t, grant_msg(X, &[(0, r(0))])))
    }

    #[test]
    fn cancel_waits_for_an_in_flight_direct_write_that_has_no_region_to_orphan() {
        let (mut ep, t) = endpoint(64 * KIB, 2, false);
        let w = direct_write_granted(&mut ep, t, 2);
        ep.cancel(t, X);
        let acts = drain(&mut ep);
        assert_eq!(completes(&acts), vec![(X, Err(XferError::Canceled))]);
        assert!(msgs(&acts).is_empty(), "no cancel while the direct write may still land: {acts:?}");
        assert_eq!((ep.orphans(), ep.jobs_in_flight(), ep.sender().pending_cancels()), (0, 1, 1));
        assert!(!ep.is_idle());

        ep.handle_write_done(t, w[0].0, true);
        let m = msgs(&drain(&mut ep));
        assert!(m.len() == 1 && is_cancel(&m[0].1, X), "{m:?}");
        assert!(ep.is_idle());
        assert_eq!(ep.arena_free_bytes(), 64 * KIB);
        assert_eq!(ep.stats().chunks_written, 0, "a canceled write announces nothing");
    }

    #[test]
    fn a_write_in_flight_past_an_eighth_of_the_timeout_sends_keeps_until_it_is_done() {
        let (mut ep, t) = endpoint(64 * KIB, 2, true);
        let w = direct_write_granted(&mut ep, t, 2);
        let keeps = |acts: &[Action]| {
            msgs(acts).iter().filter(|(_, m)| matches!(m, Msg::Keep(k) if k.xfer == X && k.token == TOKEN)).count()
        };
        // Not yet: a write younger than an eighth of the timeout needs no KEEP.
        assert_eq!(ep.poll_timeout(), Some(t + TIMEOUT / 8));
        ep.handle_timeout(t + TIMEOUT / 16);
        assert_eq!(keeps(&drain(&mut ep)), 0);
        // Then one per round (one per flow, however many of its writes are in flight).
        ep.handle_timeout(t + TIMEOUT / 8);
        assert_eq!(keeps(&drain(&mut ep)), 1);
        ep.handle_timeout(t + TIMEOUT / 4);
        assert_eq!(keeps(&drain(&mut ep)), 1);
        assert_eq!(ep.stats().keeps_sent, 2);
        // Done: no more rounds.
        for (job, ..) in w {
            ep.handle_write_done(t + TIMEOUT / 4, job, true);
        }
        drain(&mut ep);
        ep.handle_timeout(t + TIMEOUT * 3 / 8);
        assert_eq!(keeps(&drain(&mut ep)), 0);
        assert_eq!(ep.stats().keeps_sent, 2);
    }

    #[test]
    fn a_write_posted_just_before_a_round_of_keeps_is_kept_in_that_round() {
        let (mut ep, t) = endpoint(64 * KIB, 2, true);
        direct_write_granted(&mut ep, t, 2);
        // A second transfer's write is posted just before the round X's write armed: its credit
        // may be a quarter timeout old by then, so waiting a round more could let its lease
        // (half a timeout from the grant) end before its first KEEP.
        let (y, late) = (XferId(2), t + TIMEOUT / 8 - Duration::from_millis(1));
        ep.submit(t, y, TOKEN, PEER, direct_plan_of(1)).unwrap();
        drain(&mut ep);
        assert_eq!(writes(&feed(&mut ep, late, grant_msg(y, &[(0, r(1))]))).len(), 1);
        ep.handle_timeout(t + TIMEOUT / 8);
        let kept: Vec<XferId> = msgs(&drain(&mut ep))
            .iter()
            .filter_map(|(_, m)| match m {
                Msg::Keep(k) => Some(k.xfer),
                _ => None,
            })
            .collect();
        assert_eq!(kept, vec![X, y]);
    }

    #[test]
    fn a_direct_transfer_times_out_and_cancels_after_its_write_finishes() {
        let (mut ep, t) = endpoint(64 * KIB, 2, true);
        let w = direct_write_granted(&mut ep, t, 2);
        // The write never reports within the timeout.
        ep.handle_timeout(t + TIMEOUT);
        let acts = drain(&mut ep);
        assert_eq!(completes(&acts), vec![(X, Err(XferError::Timeout))]);
        // No cancel while the write may still land; KEEPs tell the receiver it is in flight.
        assert!(msgs(&acts).iter().all(|(_, m)| matches!(m, Msg::Keep(_))), "{:?}", msgs(&acts));
        ep.handle_write_done(t + TIMEOUT, w[0].0, false);
        assert!(is_cancel(&msgs(&drain(&mut ep))[0].1, X));
        assert!(ep.is_idle());
        assert_eq!(ep.stats().timeouts, 1);

        // Without any credit, the cancel goes out at once.
        ep.submit(t + TIMEOUT, XferId(2), TOKEN, PEER, direct_plan_of(1)).unwrap();
        drain(&mut ep);
        ep.handle_timeout(t + 2 * TIMEOUT);
        let acts = drain(&mut ep);
        assert_eq!(completes(&acts), vec![(XferId(2), Err(XferError::Timeout))]);
        assert!(is_cancel(&msgs(&acts)[0].1, XferId(2)));
        assert!(ep.is_idle());
    }

    #[test]
    fn a_failed_direct_write_fails_the_transfer_and_cancels_at_once() {
        let (mut ep, t) = endpoint(64 * KIB, 2, false);
        let w = direct_write_granted(&mut ep, t, 1);
        ep.handle_write_done(t, w[0].0, false);
        let acts = drain(&mut ep);
        assert_eq!(completes(&acts), vec![(X, Err(XferError::WriteFailed))]);
        assert!(is_cancel(&msgs(&acts)[0].1, X));
        assert!(ep.is_idle());
    }

    #[test]
    fn peer_loss_with_a_direct_write_in_flight_waits_only_for_its_done_event() {
        let (mut ep, t) = endpoint(64 * KIB, 2, false);
        let w = direct_write_granted(&mut ep, t, 1);
        ep.handle_peer_lost(t, PEER);
        assert_eq!(completes(&drain(&mut ep)), vec![(X, Err(XferError::PeerLost))]);
        assert_eq!((ep.orphans(), ep.jobs_in_flight()), (0, 1));
        ep.handle_write_done(t, w[0].0, false);
        assert!(drain(&mut ep).is_empty(), "nobody to cancel at");
        assert!(ep.is_idle());
    }
}
