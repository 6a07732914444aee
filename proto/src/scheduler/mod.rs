//! The engine's arena ledger and credit scheduler (design §5), shared by both roles.
//!
//! [`CreditScheduler`] owns the one [`Buddy`] over one of the engine's arenas and every region carved
//! from it, for the receiver role (credits granted to remote flows, WANT -> GRANT, and regions
//! being scattered) and for the sender role (the local gather staging,
//! [`acquire_local`](CreditScheduler::acquire_local)). It does not send messages, run copies
//! or know addresses; the receiver machine turns its [`Grant`]s into GRANT messages and its
//! frees into ACKs, and the sender machine uses the local API.
//!
//! Two concerns over one state, one file each:
//! - `ledger.rs`, the arena ledger: who holds each region (remote flows, orphaned scatters,
//!   local staging), the eager cap, per-peer held bytes, freeing, and conservation.
//! - `fair.rs`, the fair-share policy: which waiting flow gets the next region (round-robin
//!   ring and cursor, drain mode, per-peer share cap).
//!
//! This file holds the shared state, its types and errors, and the constructor; `arenas.rs`
//! holds [`arenas::ArenaSchedulers`], one scheduler per arena of an engine.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Instant;

use thiserror::Error;

use crate::buddy::{AllocError, Buddy};
use crate::types::{ChunkIdx, FlowKey, PeerId, Region};

/// Full rounds of grants a flow whose head chunk does not fit may be bypassed before the
/// scheduler enters drain mode for it (the design's `kBypassRounds`).
pub const BYPASS_ROUNDS: u64 = 2;

/// Errors from [`CreditScheduler`] calls. None of them changes the scheduler's state.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum SchedError {
    /// The arena geometry is invalid.
    #[error(transparent)]
    Alloc(#[from] AllocError),
    /// The per-flow window `W` is zero, so no flow could ever be granted.
    #[error("the per-flow in-flight window must be at least 1")]
    ZeroWindow,
    /// A WANT listed a zero-byte chunk.
    #[error("flow {}/{}: chunk #{index} of the WANT is empty", .flow.peer.0, .flow.xfer.0)]
    EmptyChunk {
        /// The flow that asked.
        flow: FlowKey,
        /// Position of the chunk in the WANT.
        index: usize,
    },
    /// A WANT listed a chunk larger than the largest arena block: it could never be granted.
    #[error("flow {}/{}: chunk of {bytes} bytes exceeds the largest arena block ({max} bytes)", .flow.peer.0, .flow.xfer.0)]
    ChunkTooLarge {
        /// The flow that asked.
        flow: FlowKey,
        /// The chunk size asked for.
        bytes: u64,
        /// [`CreditScheduler::max_chunk_bytes`].
        max: u64,
    },
    /// Chunks numbered from below the flow's next chunk: those are queued already.
    #[error("flow {}/{}: chunks from {first} but {next} are queued already", .flow.peer.0, .flow.xfer.0)]
    ChunkOrder {
        /// The flow that asked.
        flow: FlowKey,
        /// The first chunk asked for.
        first: u64,
        /// The flow's next chunk.
        next: u64,
    },
    /// The flow would queue more chunks than [`ChunkIdx`] can number.
    #[error("flow {}/{}: more than 2^32 chunks", .flow.peer.0, .flow.xfer.0)]
    TooManyChunks {
        /// The flow that asked.
        flow: FlowKey,
    },
    /// DATA names a region this flow does not hold (never granted, reclaimed, or another
    /// flow's): the DATA must be dropped.
    #[error("flow {}/{} holds no region at {offset:#x}", .flow.peer.0, .flow.xfer.0)]
    NotHeld {
        /// The flow the DATA came from.
        flow: FlowKey,
        /// The region handle it named.
        offset: u64,
    },
    /// A second DATA for a region whose scatter already began.
    #[error("region {offset:#x} is already scattering")]
    AlreadyScattering {
        /// The region handle.
        offset: u64,
    },
    /// `end_scatter` for a region that is not scattering.
    #[error("region {offset:#x} is not scattering")]
    NotScattering {
        /// The region handle.
        offset: u64,
    },
    /// [`CreditScheduler::adopt`] into a flow that already holds a region, is stamped, or
    /// has that chunk pending or not yet wanted.
    #[error("flow {}/{} cannot adopt a region as chunk {chunk}", .flow.peer.0, .flow.xfer.0)]
    CannotAdopt {
        /// The flow that was to adopt the region.
        flow: FlowKey,
        /// The chunk it was to hold.
        chunk: u32,
    },
    /// No local staging region starts at this offset (never acquired or already released).
    #[error("no local staging region at {offset:#x}")]
    NotLocal {
        /// The offset given.
        offset: u64,
    },
    /// `promote_local` on a region that is already credit-backed.
    #[error("local staging region {offset:#x} is not eager")]
    NotEager {
        /// The offset given.
        offset: u64,
    },
}

/// Shorthand for results of this module.
pub type Result<T> = std::result::Result<T, SchedError>;

/// A credit: exclusive permission for `flow` to write chunk `chunk` into `region`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Grant {
    /// The remote flow the credit belongs to.
    pub flow: FlowKey,
    /// The chunk it is for (the flow's chunks are granted strictly in order).
    pub chunk: ChunkIdx,
    /// The arena region to write; `region.len` is the buddy block size (>= the chunk bytes).
    pub region: Region,
}

/// Outcome of [`CreditScheduler::end_scatter`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EndScatter {
    /// The flow the region was granted to.
    pub flow: FlowKey,
    /// The chunk it carried.
    pub chunk: ChunkIdx,
    /// The region, now free.
    pub region: Region,
    /// True when the flow was reclaimed while the scatter ran: nobody waits for an ACK.
    pub orphaned: bool,
}

/// When a region taken back from a flow, and not being scattered, may be granted again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reuse {
    /// At once: the flow's writer said its writes have ended (a cancel, sent only after them),
    /// or the engine is shutting down.
    Now,
    /// Not before this instant (the region is *quarantined*): the flow was reclaimed because
    /// its writer went silent or was declared lost, and it may be slow rather than gone. A late
    /// write of it lands in a region nobody holds instead of in one granted since to another
    /// flow.
    After(Instant),
}

/// Regions released by [`CreditScheduler::reclaim_flow`] / [`CreditScheduler::reclaim_peer`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Reclaimed {
    /// Regions freed now (granted but not scattering, [`Reuse::Now`]), by ascending offset per
    /// flow.
    pub freed: Vec<Region>,
    /// Regions granted but not scattering, quarantined ([`Reuse::After`]): freed by
    /// [`CreditScheduler::lift_quarantine`] once their instant has passed, or by
    /// [`CreditScheduler::lift_flow`] when their writer says its writes have ended.
    pub quarantined: Vec<Region>,
    /// Regions still scattering: now orphaned, freed by their `end_scatter`.
    pub deferred: Vec<Region>,
}

/// The arena ledger of both roles and the credit allocation over it: a per-flow window,
/// round-robin fairness, drain mode against large-chunk starvation, and the local sender's
/// staging regions.
///
/// # Call order
/// - [`want`](Self::want) queues a flow's chunks (WANT); [`schedule`](Self::schedule) hands out
///   credits and returns them as [`Grant`]s for the caller to send.
/// - You *MUST* call `schedule()` after every call that queues work or frees space: `want`,
///   [`end_scatter`](Self::end_scatter), [`reclaim_flow`](Self::reclaim_flow),
///   [`reclaim_peer`](Self::reclaim_peer), [`lift_quarantine`](Self::lift_quarantine) and
///   [`release_local`](Self::release_local). Nothing
///   is granted behind your back, and a freed region granted to nobody stays free until the
///   next `schedule()`. Several such calls may be
///   batched before one `schedule()`; `schedule()` is idempotent (a second call right after
///   returns nothing, in O(1): a sweep that granted nothing is not repeated until something
///   changes).
/// - On DATA: [`is_held`](Self::is_held) validates the region handle (held by *this* flow, not
///   already scattering); [`begin_scatter`](Self::begin_scatter) marks it scattering; when the
///   scatter completes (success or failure) call [`end_scatter`](Self::end_scatter), which frees
///   the region, then `schedule()`.
/// - A cancel (empty WANT) is [`reclaim_flow`](Self::reclaim_flow); peer loss is
///   [`reclaim_peer`](Self::reclaim_peer). Regions still scattering are not freed then: they
///   are orphaned and freed by their `end_scatter`, so a new grant never overlaps a running
///   scatter. The other regions are freed at once ([`Reuse::Now`]) or quarantined until an
///   instant ([`Reuse::After`]); the caller wakes at [`next_lift`](Self::next_lift) and calls
///   [`lift_quarantine`](Self::lift_quarantine).
/// - The local sender takes gather staging with [`acquire_local`](Self::acquire_local) and gives
///   it back with [`release_local`](Self::release_local). Eager (credit-less) staging is capped
///   at half the usable capacity; [`promote_local`](Self::promote_local) moves a region out of
///   that budget once its credit arrives. Local staging ignores drain mode.
///
/// # Scheduling rules
/// - A flow may hold at most `W` regions (granted, written or scattering).
/// - Each sweep starts at the cursor and grants one region to the first flow that has pending
///   chunks, holds fewer than `W` regions and whose head chunk fits; the cursor then moves past
///   that flow. Sweeps repeat until one grants nothing. A flow's chunks are granted in order.
/// - A flow whose head did not fit is stamped with the grant sequence `s` and the ring length
///   `n` at that moment. Once `s + BYPASS_ROUNDS * n` grants have been issued (two full rounds
///   of every active flow) without it being granted, the scheduler enters *drain mode* for the
///   expired flow with the earliest such deadline: no remote grant is issued until that flow's
///   head fits, then it is granted and normal sweeps resume. A drain grant does not move the
///   cursor. When flows leave, each stamp's deadline tightens to `s + BYPASS_ROUNDS * n'`
///   with `n'` the flows left: two rounds of the flows still there, not of those gone.
/// - A flow with nothing pending and nothing held is erased at once (keys are never reused by
///   a correct sender; a reused key starts a new flow at chunk 0).
///
/// Fairness bound (derived in the comments of the property test
/// `random_operations_keep_invariants_fairness_and_liveness`, and checked there): while a flow
/// waits for its next grant (it has pending chunks and holds fewer than `W` regions), the other
/// flows receive at most `6M - 4` grants, where `M` is the number of flows active at some point
/// during the wait. With every region eventually scattered and ended and local staging
/// eventually released and quarantine eventually lifted, every pending chunk is eventually
/// granted.
///
/// # Panics
/// Only if the scheduler's own bookkeeping disagrees with its allocator (a bug here, never
/// caused by arguments or peer input; [`check_invariants`](Self::check_invariants) would
/// report it first).
#[derive(Debug)]
pub struct CreditScheduler {
    // Ledger (`ledger.rs`): `buddy`, the held regions in `flows`, `local`, `local_bytes`,
    // `eager_bytes`, `scattering`, `orphaned_bytes`, `quarantine`, `peer_held`. Fair share (`fair.rs`): the
    // pending chunks and stamps in `flows`, `ring`, `cursor`, `grant_seq`, `blocked`, `drain`,
    // `waiting`. `window` bounds both.
    buddy: Buddy,
    window: u32,
    /// Every active flow: its demand (pending chunks, stamp) and its holdings (regions).
    flows: BTreeMap<FlowKey, Flow>,
    /// Round-robin order of the keys of `flows`; new flows join at the back.
    ring: Vec<FlowKey>,
    /// Index into `ring` where the next sweep starts (0 when the ring is empty).
    cursor: usize,
    /// Remote grants issued so far.
    grant_seq: u64,
    /// Flows whose head did not fit, ordered by drain priority.
    blocked: BTreeSet<(Blocked, FlowKey)>,
    drain: Option<FlowKey>,
    local: BTreeMap<u64, Local>,
    local_bytes: u64,
    eager_bytes: u64,
    scattering: BTreeMap<u64, Scatter>,
    orphaned_bytes: u64,
    /// Regions reclaimed with [`Reuse::After`], not yet freed.
    quarantine: Quarantine,
    /// Bytes held (granted, not yet freed) by each peer's flows, for the per-peer share cap.
    peer_held: BTreeMap<PeerId, u64>,
    /// Number of each peer's flows waiting for a credit (something pending, window not full),
    /// for the share cap's "another peer waits". Kept in step at every change of a flow's
    /// pending chunks or held regions: a scan of all flows there made each grant O(flows) and
    /// a schedule pass O(flows^2), which one peer with thousands of flows turned into seconds.
    waiting: BTreeMap<PeerId, usize>,
    /// The largest chunk this arena stages or grants, as configured for it (`u64::MAX`: the
    /// arena's largest block): see [`CreditScheduler::limit_chunks`].
    max_chunk: u64,
    /// The largest free block when a sweep last granted nothing, while nothing changed since
    /// (every mutation clears it, [`CreditScheduler::touch`]): a sweep then would visit the
    /// same flows with the same outcome, so it returns at once. Without it every event swept
    /// every parked flow (review 56 H2).
    fruitless: Option<u64>,
    /// Flows visited by sweeps, for the tests of the short cut.
    #[cfg(test)]
    visits: u64,
}

#[derive(Debug, Default)]
struct Flow {
    pending: VecDeque<(ChunkIdx, u64)>,
    /// Index the next wanted chunk gets (u64: one past `u32::MAX` is representable).
    next_chunk: u64,
    /// Region offset -> what it holds; includes regions being scattered.
    held: BTreeMap<u64, Held>,
    blocked: Option<Blocked>,
}

#[derive(Debug, Clone, Copy)]
struct Held {
    chunk: ChunkIdx,
    len: u64,
}

/// Drain bookkeeping of a flow whose head chunk did not fit; ordered by deadline first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Blocked {
    /// Grant sequence at which the flow becomes a drain candidate.
    deadline: u64,
    /// Grant sequence at which it was stamped.
    at: u64,
}

#[derive(Debug, Clone, Copy)]
struct Local {
    len: u64,
    eager: bool,
}

/// Quarantined regions, by offset, with the same offsets in the order they may be freed and
/// by the flow they were reclaimed from.
#[derive(Debug, Default)]
struct Quarantine {
    regions: BTreeMap<u64, Rest>,
    by_time: BTreeSet<(Instant, u64)>,
    by_flow: BTreeSet<(FlowKey, u64)>,
    bytes: u64,
    /// Quarantined bytes per peer they were reclaimed from: charged to that peer's share, or a
    /// peer whose grants keep being reclaimed (refused DATAs, silence) could rest the whole
    /// arena while its held bytes stay under the cap.
    by_peer: BTreeMap<PeerId, u64>,
}

/// One quarantined region: its length, the flow it was reclaimed from, when it may be freed.
#[derive(Debug, Clone, Copy)]
struct Rest {
    len: u64,
    flow: FlowKey,
    until: Instant,
}

#[derive(Debug, Clone, Copy)]
struct Scatter {
    flow: FlowKey,
    chunk: ChunkIdx,
    len: u64,
    orphaned: bool,
}

pub mod arenas;
mod fair;
mod ledger;
#[cfg(test)]
mod tests;

impl CreditScheduler {
    /// An idle scheduler over an arena of `capacity` bytes with minimum block `granularity`
    /// and per-flow window `window` (the design's `W`).
    ///
    /// # Errors
    /// [`SchedError::Alloc`] for a bad geometry (see [`Buddy::new`]); [`SchedError::ZeroWindow`].
    pub fn new(capacity: u64, granularity: u64, window: u32) -> Result<Self> {
        if window == 0 {
            return Err(SchedError::ZeroWindow);
        }
        Ok(Self {
            buddy: Buddy::new(capacity, granularity)?,
            window,
            flows: BTreeMap::new(),
            ring: Vec::new(),
            cursor: 0,
            grant_seq: 0,
            blocked: BTreeSet::new(),
            drain: None,
            local: BTreeMap::new(),
            local_bytes: 0,
            eager_bytes: 0,
            scattering: BTreeMap::new(),
            orphaned_bytes: 0,
            quarantine: Quarantine::default(),
            peer_held: BTreeMap::new(),
            waiting: BTreeMap::new(),
            max_chunk: u64::MAX,
            fruitless: None,
            #[cfg(test)]
            visits: 0,
        })
    }

    /// Chunks above `bytes` (the arena's configured max chunk, which our capabilities
    /// advertise, so no honest peer's plan exceeds it) are refused. Without it a WANT may ask
    /// for the arena's largest block: one chunk as large as the whole arena, which takes it all
    /// when it is idle, or, as the drain target, holds every other flow's credits until it is
    /// all free (never, while a staging reserve of ours is out).
    pub fn limit_chunks(&mut self, bytes: u64) {
        self.touch();
        self.max_chunk = bytes;
    }

    /// Records that the state changed, so the next sweep visits every flow again. Called by
    /// every method that changes anything a sweep reads (flows' pending and held sets, stamps,
    /// the ring, the allocator, per-peer counts, the quarantine): conservatively, at the entry of
    /// each mutating method and again where regions are granted, freed or flows leave.
    fn touch(&mut self) {
        self.fruitless = None;
    }
}
