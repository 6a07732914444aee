//! The receiver's credit scheduler (design §5): which remote flow gets the next arena region.
//!
//! [`CreditScheduler`] owns the one [`Buddy`] over the engine's arena and every region carved
//! from it: credits granted to remote flows (WANT -> GRANT), regions being scattered, and the
//! local sender's gather staging ([`acquire_local`](CreditScheduler::acquire_local)). It does
//! not send messages, run copies or know addresses; the receiver machine turns its [`Grant`]s
//! into GRANT messages and its frees into ACKs, and the sender machine uses the local API.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use thiserror::Error;
use tracing::{debug, trace};

use crate::buddy::{AllocError, Buddy};
use crate::types::{ChunkIdx, FlowKey, PeerId, Region, XferId};

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

/// Regions released by [`CreditScheduler::reclaim_flow`] / [`CreditScheduler::reclaim_peer`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Reclaimed {
    /// Regions freed now (granted but not scattering), by ascending offset per flow.
    pub freed: Vec<Region>,
    /// Regions still scattering: now orphaned, freed by their `end_scatter`.
    pub deferred: Vec<Region>,
}

/// Receiver-side credit allocation over the one shared arena: a per-flow window, round-robin
/// fairness, drain mode against large-chunk starvation, and the local sender's staging regions.
///
/// # Call order
/// - [`want`](Self::want) queues a flow's chunks (WANT); [`schedule`](Self::schedule) hands out
///   credits and returns them as [`Grant`]s for the caller to send.
/// - You *MUST* call `schedule()` after every call that queues work or frees space: `want`,
///   [`end_scatter`](Self::end_scatter), [`reclaim_flow`](Self::reclaim_flow),
///   [`reclaim_peer`](Self::reclaim_peer) and [`release_local`](Self::release_local). Nothing
///   is granted behind your back, and a freed region granted to nobody stays free until the
///   next `schedule()`. Several such calls may be
///   batched before one `schedule()`; `schedule()` is idempotent (a second call right after
///   returns nothing).
/// - On DATA: [`is_held`](Self::is_held) validates the region handle (held by *this* flow, not
///   already scattering); [`begin_scatter`](Self::begin_scatter) marks it scattering; when the
///   scatter completes (success or failure) call [`end_scatter`](Self::end_scatter), which frees
///   the region, then `schedule()`.
/// - A cancel (empty WANT) is [`reclaim_flow`](Self::reclaim_flow); peer loss is
///   [`reclaim_peer`](Self::reclaim_peer). Regions still scattering are not freed then: they
///   are orphaned and freed by their `end_scatter`, so a new grant never overlaps a running
///   scatter.
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
///   cursor.
/// - A flow with nothing pending and nothing held is erased at once (keys are never reused by
///   a correct sender; a reused key starts a new flow at chunk 0).
///
/// Fairness bound (derived in the comments of the property test
/// `random_operations_keep_invariants_fairness_and_liveness`, and checked there): while a flow
/// waits for its next grant (it has pending chunks and holds fewer than `W` regions), the other
/// flows receive at most `6M - 4` grants, where `M` is the number of flows active at some point
/// during the wait. With every region eventually scattered and ended and local staging
/// eventually released, every pending chunk is eventually granted.
///
/// # Panics
/// Only if the scheduler's own bookkeeping disagrees with its allocator (a bug here, never
/// caused by arguments or peer input; [`check_invariants`](Self::check_invariants) would
/// report it first).
#[derive(Debug)]
pub struct CreditScheduler {
    buddy: Buddy,
    window: u32,
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
    /// Bytes held (granted, not yet freed) by each peer's flows, for the per-peer share cap.
    peer_held: BTreeMap<PeerId, u64>,
    /// Number of each peer's flows waiting for a credit (something pending, window not full),
    /// for the share cap's "another peer waits". Kept in step at every change of a flow's
    /// pending chunks or held regions: a scan of all flows there made each grant O(flows) and
    /// a schedule pass O(flows^2), which one peer with thousands of flows turned into seconds.
    waiting: BTreeMap<PeerId, usize>,
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

#[derive(Debug, Clone, Copy)]
struct Scatter {
    flow: FlowKey,
    chunk: ChunkIdx,
    len: u64,
    orphaned: bool,
}

/// Why a flow could not be granted its head chunk.
enum Miss {
    /// Nothing pending or window full: skip it.
    NotEligible,
    /// Eligible, but the head chunk does not fit in the arena now.
    NoFit,
}

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
            peer_held: BTreeMap::new(),
            waiting: BTreeMap::new(),
        })
    }

    /// Queues `chunks` (byte sizes) behind whatever `flow` already has pending. The flow's
    /// chunks are numbered 0, 1, 2, ... across all its WANTs; a new flow joins the back of the
    /// ring. An empty `chunks` does nothing (a cancel is [`reclaim_flow`](Self::reclaim_flow)).
    /// Call [`schedule`](Self::schedule) afterwards.
    ///
    /// # Errors
    /// [`SchedError::EmptyChunk`], [`SchedError::ChunkTooLarge`] (above
    /// [`max_chunk_bytes`](Self::max_chunk_bytes)) or [`SchedError::TooManyChunks`]; then no
    /// chunk of this WANT is queued.
    pub fn want(&mut self, flow: FlowKey, chunks: &[u64]) -> Result<()> {
        let max = self.max_chunk_bytes();
        for (index, &bytes) in chunks.iter().enumerate() {
            if bytes == 0 {
                return Err(SchedError::EmptyChunk { flow, index });
            }
            if bytes > max {
                return Err(SchedError::ChunkTooLarge { flow, bytes, max });
            }
        }
        let next = self.flows.get(&flow).map_or(0, |f| f.next_chunk);
        if next + chunks.len() as u64 > 1 << 32 {
            return Err(SchedError::TooManyChunks { flow });
        }
        if chunks.is_empty() {
            return Ok(());
        }
        let window = self.window as usize;
        let entry = self.flows.entry(flow).or_insert_with(|| {
            self.ring.push(flow);
            Flow::default()
        });
        let was = Self::is_waiting(entry, window);
        for (i, &bytes) in chunks.iter().enumerate() {
            // In range: checked against 2^32 above.
            entry.pending.push_back((ChunkIdx((next + i as u64) as u32), bytes));
        }
        entry.next_chunk = next + chunks.len() as u64;
        let now = Self::is_waiting(entry, window);
        Self::rewait(&mut self.waiting, flow.peer, was, now);
        trace!(?flow, chunks = chunks.len(), "want");
        Ok(())
    }

    /// Hands out as many credits as the rules allow (see the type docs) and returns them in
    /// grant order. The caller sends each to `grant.flow.peer`.
    pub fn schedule(&mut self) -> Vec<Grant> {
        let mut grants = Vec::new();
        loop {
            if self.drain.is_none() {
                self.drain = self.blocked.first().filter(|(b, _)| b.deadline <= self.grant_seq).map(|&(_, key)| key);
                if let Some(flow) = self.drain {
                    debug!(?flow, seq = self.grant_seq, "drain mode: holding remote grants");
                }
            }
            if let Some(key) = self.drain {
                match self.try_grant(key) {
                    Ok(grant) => {
                        debug!(flow = ?key, "drain mode: head granted");
                        self.drain = None;
                        grants.push(grant);
                    }
                    Err(Miss::NoFit) => break,
                    Err(Miss::NotEligible) => {
                        // Unreachable while the stamp invariant holds (a stamped flow gets no
                        // grant, so its window cannot fill); drop every stamp of it rather
                        // than pick it again and spin.
                        self.unblock(key);
                        self.blocked.retain(|(_, k)| *k != key);
                        self.drain = None;
                    }
                }
            } else if let Some(grant) = self.sweep() {
                grants.push(grant);
            } else {
                break;
            }
        }
        grants
    }

    /// The grant `flow` holds at `offset`, if it holds that region and its scatter has not
    /// begun: the check for an incoming DATA (a late DATA after a cancel, or one naming another
    /// flow's region, gets `None` and must be dropped).
    pub fn is_held(&self, flow: FlowKey, offset: u64) -> Option<Grant> {
        let held = self.flows.get(&flow)?.held.get(&offset)?;
        if self.scattering.contains_key(&offset) {
            return None;
        }
        Some(Grant { flow, chunk: held.chunk, region: Region { offset, len: held.len } })
    }

    /// Marks `flow`'s region at `offset` as scattering (DATA accepted). It stays held by the
    /// flow, and counts against its window, until [`end_scatter`](Self::end_scatter).
    ///
    /// # Errors
    /// [`SchedError::NotHeld`] when the flow does not hold that region;
    /// [`SchedError::AlreadyScattering`] for a duplicate DATA.
    pub fn begin_scatter(&mut self, flow: FlowKey, offset: u64) -> Result<Grant> {
        let held =
            *self.flows.get(&flow).and_then(|f| f.held.get(&offset)).ok_or(SchedError::NotHeld { flow, offset })?;
        if self.scattering.contains_key(&offset) {
            return Err(SchedError::AlreadyScattering { offset });
        }
        let scatter = Scatter { flow, chunk: held.chunk, len: held.len, orphaned: false };
        self.scattering.insert(offset, scatter);
        Ok(Grant { flow, chunk: held.chunk, region: Region { offset, len: held.len } })
    }

    /// Ends the scatter of the region at `offset` (successful or not) and frees the region. A
    /// flow left with nothing pending or held is erased. When the flow was reclaimed meanwhile
    /// the region was orphaned: it is freed all the same and `orphaned` is set. Call
    /// [`schedule`](Self::schedule) afterwards.
    ///
    /// # Errors
    /// [`SchedError::NotScattering`] when no scatter of that region is in progress.
    pub fn end_scatter(&mut self, offset: u64) -> Result<EndScatter> {
        let s = self.scattering.remove(&offset).ok_or(SchedError::NotScattering { offset })?;
        if s.orphaned {
            self.orphaned_bytes -= s.len;
        } else if let Some(flow) = self.flows.get_mut(&s.flow) {
            let window = self.window as usize;
            let was = Self::is_waiting(flow, window);
            flow.held.remove(&offset);
            Self::rewait(&mut self.waiting, s.flow.peer, was, Self::is_waiting(flow, window));
            Self::unhold(&mut self.peer_held, s.flow.peer, s.len);
            if flow.pending.is_empty() && flow.held.is_empty() {
                self.flows.remove(&s.flow);
                self.remove_from_ring(s.flow);
                trace!(flow = ?s.flow, "flow done");
            }
        }
        let region = self.free_region(offset);
        Ok(EndScatter { flow: s.flow, chunk: s.chunk, region, orphaned: s.orphaned })
    }

    /// Cancels `flow`: drops its pending chunks, frees its granted regions that are not
    /// scattering and orphans the scattering ones (freed by their `end_scatter`). The flow is
    /// erased. Unknown flows reclaim nothing. Call [`schedule`](Self::schedule) afterwards.
    pub fn reclaim_flow(&mut self, flow: FlowKey) -> Reclaimed {
        let mut out = Reclaimed::default();
        self.reclaim_into(flow, &mut out);
        out
    }

    /// [`reclaim_flow`](Self::reclaim_flow) for every flow of `peer` (peer loss), in key order.
    pub fn reclaim_peer(&mut self, peer: PeerId) -> Reclaimed {
        let lo = FlowKey { peer, xfer: XferId(0) };
        let hi = FlowKey { peer, xfer: XferId(u64::MAX) };
        let keys: Vec<FlowKey> = self.flows.range(lo..=hi).map(|(k, _)| *k).collect();
        let mut out = Reclaimed::default();
        for key in keys {
            self.reclaim_into(key, &mut out);
        }
        out
    }

    /// Takes a local gather-staging region for `bytes` bytes from the shared arena. With
    /// `eager` (no credit yet) it is refused when the eager staging would exceed
    /// [`eager_cap`](Self::eager_cap); credit-backed staging is not capped. Drain mode does not
    /// apply. `None` when `bytes` is 0, the cap is hit or no block fits.
    pub fn acquire_local(&mut self, bytes: u64, eager: bool) -> Option<Region> {
        let len = self.buddy.block_len(bytes)?;
        if eager && self.eager_bytes + len > self.eager_cap() {
            return None;
        }
        let region = self.buddy.alloc(bytes)?;
        self.local.insert(region.offset, Local { len, eager });
        self.local_bytes += len;
        if eager {
            self.eager_bytes += len;
        }
        Some(region)
    }

    /// Turns the eager staging region at `offset` into a credit-backed one (its credit
    /// arrived), so it no longer counts against the eager cap. It frees no arena space, so no
    /// `schedule()` is needed for it.
    ///
    /// # Errors
    /// [`SchedError::NotLocal`] for an unknown offset; [`SchedError::NotEager`] when it is
    /// already credit-backed.
    pub fn promote_local(&mut self, offset: u64) -> Result<()> {
        let local = self.local.get_mut(&offset).ok_or(SchedError::NotLocal { offset })?;
        if !local.eager {
            return Err(SchedError::NotEager { offset });
        }
        local.eager = false;
        self.eager_bytes -= local.len;
        Ok(())
    }

    /// Gives back the local staging region at `offset`. Call [`schedule`](Self::schedule)
    /// afterwards: the freed bytes may unblock a remote flow.
    ///
    /// # Errors
    /// [`SchedError::NotLocal`] when no local region starts there (for example a double
    /// release).
    pub fn release_local(&mut self, offset: u64) -> Result<Region> {
        let local = self.local.remove(&offset).ok_or(SchedError::NotLocal { offset })?;
        self.local_bytes -= local.len;
        if local.eager {
            self.eager_bytes -= local.len;
        }
        Ok(self.free_region(offset))
    }

    /// The per-flow window `W`.
    pub fn window(&self) -> u32 {
        self.window
    }

    /// Usable arena bytes (capacity rounded down to the granularity).
    pub fn usable_capacity(&self) -> u64 {
        self.buddy.usable_capacity()
    }

    /// The largest chunk a WANT may ask for: the arena's largest block. A fully drained arena
    /// can always fit it, which is what makes drain mode terminate.
    pub fn max_chunk_bytes(&self) -> u64 {
        self.buddy.largest_block()
    }

    /// The eager staging budget: half the usable capacity.
    pub fn eager_cap(&self) -> u64 {
        self.usable_capacity() / 2
    }

    /// Free arena bytes.
    pub fn free_bytes(&self) -> u64 {
        self.buddy.free_bytes()
    }

    /// Bytes of the regions `flow` holds (granted, written or scattering); 0 for unknown flows.
    pub fn flow_held_bytes(&self, flow: FlowKey) -> u64 {
        self.flows.get(&flow).map_or(0, |f| f.held.values().map(|h| h.len).sum())
    }

    /// Number of regions `flow` holds (at most `W`).
    pub fn flow_held_count(&self, flow: FlowKey) -> usize {
        self.flows.get(&flow).map_or(0, |f| f.held.len())
    }

    /// Chunks `flow` still waits to be granted.
    pub fn pending_chunks(&self, flow: FlowKey) -> usize {
        self.flows.get(&flow).map_or(0, |f| f.pending.len())
    }

    /// Bytes of local staging regions (eager and credit-backed).
    pub fn local_bytes(&self) -> u64 {
        self.local_bytes
    }

    /// Bytes of eager local staging regions.
    pub fn eager_bytes(&self) -> u64 {
        self.eager_bytes
    }

    /// Number of flows with pending chunks or held regions.
    pub fn active_flows(&self) -> usize {
        self.flows.len()
    }

    /// True when `flow` is active.
    pub fn has_flow(&self, flow: FlowKey) -> bool {
        self.flows.contains_key(&flow)
    }

    /// The flow drain mode is waiting for, if drain mode is active.
    pub fn drain_target(&self) -> Option<FlowKey> {
        self.drain
    }

    /// Remote grants issued since creation.
    pub fn grant_seq(&self) -> u64 {
        self.grant_seq
    }

    /// The embedded allocator, read-only (for inspection and invariant checks).
    pub fn buddy(&self) -> &Buddy {
        &self.buddy
    }

    /// Verifies every invariant; `Err` describes the first violation. Meant for tests, fuzzing
    /// and simulations (it walks the whole state).
    ///
    /// Checked: the buddy's own invariants; every allocated block has exactly one owner (a
    /// flow's held set, an orphaned scatter, or local staging) and every owned region is an
    /// allocated block (so owned regions never overlap); free + held + orphaned + local bytes ==
    /// usable capacity; each flow holds at most `W` regions and is not finished; the eager
    /// counter is exact and within the cap; the ring lists each active flow exactly once;
    /// scatter and drain bookkeeping is consistent.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        self.buddy.check_invariants()?;
        let mut owners: BTreeMap<u64, (u64, String)> = BTreeMap::new();
        let mut claim = |offset: u64, len: u64, who: String| match owners.insert(offset, (len, who)) {
            Some((_, first)) => Err(format!("region {offset:#x} owned twice: {first} and another")),
            None => Ok(()),
        };
        let mut held_bytes = 0;
        for (key, flow) in &self.flows {
            if flow.held.len() > self.window as usize {
                return Err(format!("{key:?} holds {} regions > W = {}", flow.held.len(), self.window));
            }
            if flow.pending.is_empty() && flow.held.is_empty() {
                return Err(format!("{key:?} is finished but not erased"));
            }
            for (&off, h) in &flow.held {
                claim(off, h.len, format!("{key:?}"))?;
                held_bytes += h.len;
            }
            if flow.blocked.is_some_and(|b| !self.blocked.contains(&(b, *key))) {
                return Err(format!("{key:?} is stamped but missing from the blocked set"));
            }
            if flow.blocked.is_some() && (flow.pending.is_empty() || flow.held.len() >= self.window as usize) {
                return Err(format!("{key:?} is stamped but not eligible"));
            }
        }
        let mut waiting: BTreeMap<PeerId, usize> = BTreeMap::new();
        for (key, flow) in &self.flows {
            if Self::is_waiting(flow, self.window as usize) {
                *waiting.entry(key.peer).or_default() += 1;
            }
        }
        if waiting != self.waiting {
            return Err(format!("waiting-flow counts {:?} != recount {waiting:?}", self.waiting));
        }
        let mut orphaned = 0;
        for (&off, s) in &self.scattering {
            let holder = self.flows.get(&s.flow).and_then(|f| f.held.get(&off));
            match (s.orphaned, holder) {
                (false, Some(h)) if h.len == s.len => {}
                (true, None) => {
                    claim(off, s.len, "orphaned scatter".into())?;
                    orphaned += s.len;
                }
                _ => {
                    return Err(format!("scatter of {off:#x} disagrees with {:?}'s held set", s.flow));
                }
            }
        }
        let (mut local, mut eager) = (0, 0);
        for (&off, l) in &self.local {
            claim(off, l.len, "local staging".into())?;
            local += l.len;
            eager += if l.eager { l.len } else { 0 };
        }
        let allocated: Vec<Region> = self.buddy.allocated_regions().collect();
        let owned: Vec<Region> = owners.iter().map(|(&offset, &(len, _))| Region { offset, len }).collect();
        if allocated != owned {
            return Err(format!("allocated blocks {allocated:?} != owned regions {owned:?}"));
        }
        let total = self.free_bytes() + held_bytes + orphaned + local;
        if total != self.usable_capacity() {
            return Err(format!("conservation: free+held+orphaned+local = {total} != {}", self.usable_capacity()));
        }
        if (orphaned, local, eager) != (self.orphaned_bytes, self.local_bytes, self.eager_bytes) {
            return Err("orphaned/local/eager byte counters drifted".into());
        }
        if self.eager_bytes > self.eager_cap() {
            return Err(format!("eager bytes {} exceed the cap {}", self.eager_bytes, self.eager_cap()));
        }
        let mut per_peer: BTreeMap<PeerId, u64> = BTreeMap::new();
        for (k, f) in &self.flows {
            let b: u64 = f.held.values().map(|h| h.len).sum();
            if b > 0 {
                *per_peer.entry(k.peer).or_default() += b;
            }
        }
        if per_peer != self.peer_held {
            return Err(format!("per-peer held bytes drifted: {:?} != {per_peer:?}", self.peer_held));
        }
        let ring: BTreeSet<FlowKey> = self.ring.iter().copied().collect();
        if ring.len() != self.ring.len() || !ring.iter().eq(self.flows.keys()) {
            return Err("ring and active flows differ".into());
        }
        if self.cursor >= self.ring.len().max(1) {
            return Err(format!("cursor {} outside ring of {}", self.cursor, self.ring.len()));
        }
        let stamped = self.flows.values().filter(|f| f.blocked.is_some()).count();
        if stamped != self.blocked.len() {
            return Err("blocked set has stale entries".into());
        }
        if self.drain.is_some_and(|d| self.flows.get(&d).is_none_or(|f| f.blocked.is_none())) {
            return Err("drain target is not a stamped flow".into());
        }
        Ok(())
    }

    /// One round-robin sweep from the cursor: grants the first flow that can take its head.
    fn sweep(&mut self) -> Option<Grant> {
        let n = self.ring.len();
        for i in 0..n {
            let idx = (self.cursor + i) % n;
            let key = self.ring[idx];
            match self.try_grant(key) {
                Ok(grant) => {
                    self.cursor = (idx + 1) % n;
                    return Some(grant);
                }
                Err(Miss::NoFit) => self.stamp(key),
                Err(Miss::NotEligible) => {}
            }
        }
        None
    }

    /// Grants `key` its head chunk if it is eligible and the chunk fits.
    fn try_grant(&mut self, key: FlowKey) -> std::result::Result<Grant, Miss> {
        let window = self.window as usize;
        let flow = self.flows.get_mut(&key).ok_or(Miss::NotEligible)?;
        if flow.held.len() >= window {
            return Err(Miss::NotEligible);
        }
        let &(chunk, bytes) = flow.pending.front().ok_or(Miss::NotEligible)?;
        if self.over_peer_share(key.peer, bytes) {
            return Err(Miss::NotEligible);
        }
        let flow = self.flows.get_mut(&key).ok_or(Miss::NotEligible)?;
        let region = self.buddy.alloc(bytes).ok_or(Miss::NoFit)?;
        let was = Self::is_waiting(flow, window);
        flow.pending.pop_front();
        flow.held.insert(region.offset, Held { chunk, len: region.len });
        Self::rewait(&mut self.waiting, key.peer, was, Self::is_waiting(flow, window));
        *self.peer_held.entry(key.peer).or_default() += region.len;
        self.grant_seq += 1;
        self.unblock(key);
        trace!(flow = ?key, chunk = chunk.0, offset = region.offset, len = region.len, "grant");
        Ok(Grant { flow: key, chunk, region })
    }

    /// The per-peer share cap: while another peer waits for credits, one peer may hold at most
    /// half the arena (but always at least one chunk). Fairness in the design is per flow, so a
    /// peer with many flows (or many announced and then abandoned: frozen, buggy or hostile)
    /// would otherwise take every region that frees up; the cap keeps half the arena turning
    /// over for the others. It never binds a peer that is alone.
    pub(crate) fn over_peer_share(&self, peer: PeerId, bytes: u64) -> bool {
        let held = self.peer_held.get(&peer).copied().unwrap_or(0);
        let need = self.buddy.block_len(bytes).unwrap_or(bytes);
        let cap = (self.usable_capacity() / 2).max(need);
        if held.saturating_add(need) <= cap {
            return false;
        }
        self.waiting.keys().any(|&p| p != peer)
    }

    /// Whether `flow` waits for a credit.
    fn is_waiting(flow: &Flow, window: usize) -> bool {
        !flow.pending.is_empty() && flow.held.len() < window
    }

    /// Records that a flow of `peer` went from waiting `was` to waiting `now`.
    fn rewait(waiting: &mut BTreeMap<PeerId, usize>, peer: PeerId, was: bool, now: bool) {
        match (was, now) {
            (false, true) => *waiting.entry(peer).or_default() += 1,
            (true, false) => {
                if let Some(n) = waiting.get_mut(&peer) {
                    *n -= 1;
                    if *n == 0 {
                        waiting.remove(&peer);
                    }
                }
            }
            _ => {}
        }
    }

    fn unhold(peer_held: &mut BTreeMap<PeerId, u64>, peer: PeerId, len: u64) {
        if let Some(h) = peer_held.get_mut(&peer) {
            *h = h.saturating_sub(len);
            if *h == 0 {
                peer_held.remove(&peer);
            }
        }
    }

    /// Stamps a flow whose head did not fit, unless it already carries a stamp.
    fn stamp(&mut self, key: FlowKey) {
        let deadline = self.grant_seq + BYPASS_ROUNDS * self.ring.len() as u64;
        if let Some(flow) = self.flows.get_mut(&key) {
            if flow.blocked.is_none() {
                let b = Blocked { deadline, at: self.grant_seq };
                flow.blocked = Some(b);
                self.blocked.insert((b, key));
            }
        }
    }

    fn unblock(&mut self, key: FlowKey) {
        if let Some(b) = self.flows.get_mut(&key).and_then(|f| f.blocked.take()) {
            self.blocked.remove(&(b, key));
        }
    }

    fn reclaim_into(&mut self, key: FlowKey, out: &mut Reclaimed) {
        self.unblock(key);
        let Some(flow) = self.flows.remove(&key) else {
            return;
        };
        Self::rewait(&mut self.waiting, key.peer, Self::is_waiting(&flow, self.window as usize), false);
        self.remove_from_ring(key);
        if self.drain == Some(key) {
            self.drain = None;
        }
        let (freed, deferred) = (out.freed.len(), out.deferred.len());
        for (offset, held) in flow.held {
            Self::unhold(&mut self.peer_held, key.peer, held.len);
            match self.scattering.get_mut(&offset) {
                Some(s) => {
                    s.orphaned = true;
                    self.orphaned_bytes += held.len;
                    out.deferred.push(Region { offset, len: held.len });
                }
                None => out.freed.push(self.free_region(offset)),
            }
        }
        debug!(
            flow = ?key,
            pending = flow.pending.len(),
            freed = out.freed.len() - freed,
            deferred = out.deferred.len() - deferred,
            "flow reclaimed"
        );
    }

    fn remove_from_ring(&mut self, key: FlowKey) {
        let Some(idx) = self.ring.iter().position(|k| *k == key) else {
            return;
        };
        self.ring.remove(idx);
        // Keep the cursor on the same flow (or on the removed flow's successor).
        if idx < self.cursor {
            self.cursor -= 1;
        }
        if self.cursor >= self.ring.len() {
            self.cursor = 0;
        }
    }

    /// Frees a region this scheduler owns; failure means the bookkeeping is corrupt.
    fn free_region(&mut self, offset: u64) -> Region {
        match self.buddy.free(offset) {
            Ok(region) => region,
            Err(e) => panic!("scheduler bookkeeping out of sync with its allocator: {e}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, VecDeque};

    use proptest::prelude::*;

    use super::*;

    const G: u64 = 4096;

    fn flow(peer: u32, xfer: u64) -> FlowKey {
        FlowKey { peer: PeerId(peer), xfer: XferId(xfer) }
    }

    fn sched(units: u64, window: u32) -> CreditScheduler {
        CreditScheduler::new(units * G, G, window).unwrap()
    }

    /// `(flow, chunk)` of each grant, for order assertions.
    fn order(grants: &[Grant]) -> Vec<(FlowKey, u32)> {
        grants.iter().map(|g| (g.flow, g.chunk.0)).collect()
    }

    /// Scatters and ends `g` (DATA arrived, scatter done), checking invariants.
    fn ack(s: &mut CreditScheduler, g: &Grant) -> EndScatter {
        s.begin_scatter(g.flow, g.region.offset).unwrap();
        let done = s.end_scatter(g.region.offset).unwrap();
        s.check_invariants().unwrap();
        done
    }

    #[test]
    fn design_example_w2_grants_a_b_a_b_then_stops() {
        let (a, b) = (flow(1, 1), flow(2, 1));
        // The arena fits four regions; W = 2.
        let mut s = sched(4, 2);
        s.want(a, &[G, G, G]).unwrap();
        s.want(b, &[G, G]).unwrap();
        let grants = s.schedule();
        assert_eq!(order(&grants), vec![(a, 0), (b, 0), (a, 1), (b, 1)]);
        assert_eq!((s.flow_held_count(a), s.flow_held_count(b)), (2, 2));
        assert_eq!(s.pending_chunks(a), 1, "c3 waits for one of A's regions");
        assert!(s.schedule().is_empty());
        // One of A's regions is ACKed: the next schedule() grants c3 into it.
        ack(&mut s, &grants[0]);
        let next = s.schedule();
        assert_eq!(order(&next), vec![(a, 2)]);
        assert_eq!(next[0].region, grants[0].region);
        s.check_invariants().unwrap();
    }

    #[test]
    fn window_caps_held_regions_even_with_space_left() {
        let f = flow(1, 1);
        let mut s = sched(64, 3);
        s.want(f, &[G; 10]).unwrap();
        let mut held: VecDeque<Grant> = s.schedule().into();
        assert_eq!(held.len(), 3);
        assert_eq!(s.free_bytes(), 61 * G);
        for next in 3..10 {
            ack(&mut s, &held.pop_front().unwrap());
            let g = s.schedule();
            assert_eq!(order(&g), vec![(f, next)], "one ACK, one credit");
            held.extend(g);
        }
        while let Some(g) = held.pop_front() {
            ack(&mut s, &g);
            assert!(s.schedule().is_empty());
        }
        assert!(!s.has_flow(f), "erased when done");
        assert_eq!(s.free_bytes(), 64 * G);
    }

    #[test]
    fn grants_rotate_strictly_across_flows_in_a_tight_arena() {
        let flows: Vec<FlowKey> = (0..4).map(|x| flow(7, x)).collect();
        let mut s = sched(3, 8);
        for &f in &flows {
            s.want(f, &[G; 30]).unwrap();
        }
        let mut seen = Vec::new();
        let mut held: VecDeque<Grant> = VecDeque::new();
        for _ in 0..200 {
            let grants = s.schedule();
            seen.extend(grants.iter().map(|g| g.flow));
            held.extend(grants);
            let Some(g) = held.pop_front() else { break };
            ack(&mut s, &g);
        }
        assert_eq!(seen.len(), 120);
        // Three regions for four flows: every grant goes to the flow after the previous one.
        for (i, f) in seen.iter().enumerate() {
            assert_eq!(*f, flows[i % 4], "grant {i}");
        }
        assert_eq!(s.active_flows(), 0);
    }

    #[test]
    fn a_peer_with_many_flows_leaves_half_the_arena_to_a_waiting_peer() {
        // 8 regions. Peer 1 has 100 flows; peer 2 asks after it.
        let mut s = sched(8, 8);
        for x in 0..100 {
            s.want(flow(1, x), &[G; 8]).unwrap();
        }
        let mut held: VecDeque<Grant> = s.schedule().into();
        assert_eq!(held.len(), 8, "alone, a peer may use the whole arena");
        s.want(flow(2, 0), &[G; 8]).unwrap();
        assert!(s.schedule().is_empty(), "nothing is free yet");
        // As peer 1's regions turn over, peer 2 gets every freed one until peer 1 is down to half.
        let mut to_two = 0;
        for _ in 0..8 {
            ack(&mut s, &held.pop_front().unwrap());
            let g = s.schedule();
            to_two += g.iter().filter(|g| g.flow.peer == PeerId(2)).count();
            held.extend(g.into_iter().filter(|g| g.flow.peer == PeerId(1)));
            s.check_invariants().unwrap();
        }
        let held_by_one: u64 = (0..100).map(|x| s.flow_held_bytes(flow(1, x))).sum();
        assert_eq!(to_two, 4, "peer 2 reached its half");
        assert_eq!(held_by_one, 4 * G);
    }

    #[test]
    fn drain_mode_admits_a_big_head_blocked_by_a_stream_of_small_chunks() {
        // One peer, two flows: drain mode is about flows (across peers the share cap binds first).
        let (small, big) = (flow(1, 1), flow(1, 2));
        let mut s = sched(8, 100);
        s.want(small, &[G; 100]).unwrap();
        let mut held: VecDeque<Grant> = s.schedule().into();
        assert_eq!(held.len(), 8, "small fills the arena");
        s.want(big, &[8 * G]).unwrap();
        assert!(s.schedule().is_empty());
        // Without drain mode every freed unit would go straight back to `small` and `big`
        // would starve. It is stamped at grant 8 with two flows: drain at grant 8 + 2 * 2.
        for _ in 0..4 {
            ack(&mut s, &held.pop_front().unwrap());
            let g = s.schedule();
            assert_eq!(order(&g), vec![(small, s.grant_seq() as u32 - 1)]);
            held.extend(g);
        }
        assert_eq!(s.grant_seq(), 12);
        assert_eq!(s.drain_target(), Some(big));
        // Drain mode: the freed space is held back until the big head fits.
        for _ in 0..7 {
            ack(&mut s, &held.pop_front().unwrap());
            assert!(s.schedule().is_empty());
        }
        assert_eq!(s.free_bytes(), 7 * G, "space accumulates for the drain target");
        ack(&mut s, &held.pop_front().unwrap());
        let g = s.schedule();
        assert_eq!(order(&g), vec![(big, 0)]);
        assert_eq!(g[0].region, Region { offset: 0, len: 8 * G });
        assert_eq!(s.drain_target(), None);
        ack(&mut s, &g[0]);
        assert_eq!(s.schedule().len(), 8, "small resumes");
        s.check_invariants().unwrap();
    }

    #[test]
    fn local_staging_ignores_drain_mode() {
        let (small, big) = (flow(1, 1), flow(1, 2));
        let mut s = sched(8, 100);
        s.want(small, &[G; 100]).unwrap();
        let mut held: VecDeque<Grant> = s.schedule().into();
        s.want(big, &[8 * G]).unwrap();
        s.schedule();
        while s.drain_target().is_none() {
            ack(&mut s, &held.pop_front().unwrap());
            held.extend(s.schedule());
        }
        ack(&mut s, &held.pop_front().unwrap());
        assert!(s.schedule().is_empty());
        let local = s.acquire_local(G, false).expect("drain mode is a remote-only barrier");
        s.check_invariants().unwrap();
        s.release_local(local.offset).unwrap();
    }

    #[test]
    fn reclaim_flow_defers_a_scattering_region_until_end_scatter() {
        let (a, b) = (flow(1, 1), flow(1, 2));
        let mut s = sched(4, 4);
        s.want(a, &[G, G, G, G, G]).unwrap();
        let grants = s.schedule();
        assert_eq!(grants.len(), 4);
        let busy = grants[1];
        s.begin_scatter(a, busy.region.offset).unwrap();
        let r = s.reclaim_flow(a);
        let others: Vec<Region> = [0, 2, 3].iter().map(|&i| grants[i].region).collect();
        assert_eq!(r, Reclaimed { freed: others, deferred: vec![busy.region] });
        assert!(!s.has_flow(a));
        assert_eq!(s.free_bytes(), 3 * G);
        s.check_invariants().unwrap();
        // The orphaned region is not re-granted while the scatter still reads it.
        s.want(b, &[4 * G]).unwrap();
        assert!(s.schedule().is_empty());
        // A late DATA for the cancelled flow is rejected.
        assert_eq!(s.is_held(a, grants[0].region.offset), None);
        assert!(matches!(s.begin_scatter(a, grants[0].region.offset), Err(SchedError::NotHeld { .. })));
        let end = s.end_scatter(busy.region.offset).unwrap();
        assert_eq!(end, EndScatter { flow: a, chunk: ChunkIdx(1), region: busy.region, orphaned: true });
        assert_eq!(order(&s.schedule()), vec![(b, 0)]);
        s.check_invariants().unwrap();
        assert_eq!(s.reclaim_flow(a), Reclaimed::default(), "a second cancel is a no-op");
    }

    #[test]
    fn reclaim_peer_reclaims_every_flow_of_that_peer_only() {
        let mut s = sched(16, 2);
        let lost = [flow(3, 1), flow(3, 9), flow(3, u64::MAX)];
        let kept = flow(4, 0);
        for f in lost.iter().chain([&kept]) {
            s.want(*f, &[G, G, G]).unwrap();
        }
        let grants = s.schedule();
        assert_eq!(grants.len(), 8);
        let r = s.reclaim_peer(PeerId(3));
        assert_eq!(r.freed.len(), 6);
        assert!(r.deferred.is_empty());
        assert_eq!(s.active_flows(), 1);
        assert_eq!(s.flow_held_count(kept), 2);
        assert_eq!(s.free_bytes(), 14 * G);
        s.check_invariants().unwrap();
        assert_eq!(order(&s.schedule()), vec![], "kept is at its window");
    }

    #[test]
    fn finished_flows_are_erased_so_state_stays_bounded() {
        let mut s = sched(8, 2);
        for x in 0..10_000u64 {
            let f = flow((x % 5) as u32, x);
            s.want(f, &[G, 2 * G]).unwrap();
            for g in s.schedule() {
                ack(&mut s, &g);
            }
            for g in s.schedule() {
                ack(&mut s, &g);
            }
            assert_eq!(s.active_flows(), 0);
        }
        assert_eq!(s.grant_seq(), 20_000);
        assert_eq!(s.free_bytes(), 8 * G);
    }

    #[test]
    fn eager_staging_is_capped_at_half_the_arena_and_credit_backed_is_not() {
        let mut s = sched(8, 2);
        assert_eq!(s.eager_cap(), 4 * G);
        let e1 = s.acquire_local(2 * G, true).unwrap();
        let e2 = s.acquire_local(G + 1, true).unwrap();
        assert_eq!(s.eager_bytes(), 4 * G);
        assert_eq!(s.acquire_local(1, true), None, "eager budget spent");
        let c = s.acquire_local(2 * G, false).unwrap();
        assert_eq!(s.local_bytes(), 6 * G);
        s.promote_local(e1.offset).unwrap();
        assert_eq!(s.eager_bytes(), 2 * G);
        let e3 = s.acquire_local(2 * G, true).unwrap();
        assert_eq!(s.acquire_local(1, false), None, "arena full");
        s.check_invariants().unwrap();
        for r in [e1, e2, c, e3] {
            s.release_local(r.offset).unwrap();
        }
        assert_eq!((s.local_bytes(), s.eager_bytes(), s.free_bytes()), (0, 0, 8 * G));
        assert_eq!(s.acquire_local(0, false), None);
    }

    #[test]
    fn local_misuse_is_an_error_not_a_panic() {
        let mut s = sched(8, 2);
        let r = s.acquire_local(G, false).unwrap();
        assert_eq!(s.promote_local(r.offset), Err(SchedError::NotEager { offset: r.offset }));
        assert_eq!(s.release_local(r.offset), Ok(r));
        assert_eq!(s.release_local(r.offset), Err(SchedError::NotLocal { offset: r.offset }));
        assert_eq!(s.promote_local(r.offset), Err(SchedError::NotLocal { offset: r.offset }));
        // A remote grant is not local staging.
        s.want(flow(1, 1), &[G]).unwrap();
        let g = s.schedule()[0];
        assert_eq!(s.release_local(g.region.offset), Err(SchedError::NotLocal { offset: g.region.offset }));
        s.check_invariants().unwrap();
    }

    #[test]
    fn want_rejects_empty_and_oversized_chunks_atomically() {
        let f = flow(1, 1);
        // 7 units: the largest block is 4 units.
        let mut s = CreditScheduler::new(7 * G + 5, G, 2).unwrap();
        assert_eq!(s.max_chunk_bytes(), 4 * G);
        assert_eq!(s.want(f, &[G, 0]), Err(SchedError::EmptyChunk { flow: f, index: 1 }));
        assert_eq!(
            s.want(f, &[G, 4 * G + 1]),
            Err(SchedError::ChunkTooLarge { flow: f, bytes: 4 * G + 1, max: 4 * G })
        );
        assert_eq!(s.active_flows(), 0, "nothing queued from a rejected WANT");
        assert_eq!(s.want(f, &[]), Ok(()));
        assert_eq!(s.active_flows(), 0, "an empty WANT creates no flow");
        assert_eq!(CreditScheduler::new(G, G, 0).unwrap_err(), SchedError::ZeroWindow);
        assert!(matches!(CreditScheduler::new(G, 3, 1), Err(SchedError::Alloc(_))));
    }

    #[test]
    fn chunk_indices_continue_across_wants() {
        let f = flow(1, 1);
        let mut s = sched(16, 8);
        s.want(f, &[G]).unwrap();
        s.want(f, &[G, G]).unwrap();
        assert_eq!(order(&s.schedule()), vec![(f, 0), (f, 1), (f, 2)]);
        s.want(f, &[G]).unwrap();
        assert_eq!(order(&s.schedule()), vec![(f, 3)]);
    }

    #[test]
    fn data_validation_rejects_foreign_duplicate_and_unknown_regions() {
        let (a, b) = (flow(1, 1), flow(2, 1));
        let mut s = sched(8, 2);
        s.want(a, &[G]).unwrap();
        s.want(b, &[G]).unwrap();
        let g = s.schedule();
        let (ga, gb) = (g[0], g[1]);
        assert_eq!(s.is_held(a, ga.region.offset), Some(ga));
        assert_eq!(s.is_held(a, gb.region.offset), None, "another flow's region");
        assert!(matches!(s.begin_scatter(a, gb.region.offset), Err(SchedError::NotHeld { .. })));
        s.begin_scatter(a, ga.region.offset).unwrap();
        assert_eq!(s.is_held(a, ga.region.offset), None, "already scattering");
        assert_eq!(
            s.begin_scatter(a, ga.region.offset),
            Err(SchedError::AlreadyScattering { offset: ga.region.offset })
        );
        assert_eq!(s.end_scatter(gb.region.offset), Err(SchedError::NotScattering { offset: gb.region.offset }));
        let end = s.end_scatter(ga.region.offset).unwrap();
        assert_eq!(end, EndScatter { flow: a, chunk: ChunkIdx(0), region: ga.region, orphaned: false });
        assert_eq!(s.end_scatter(ga.region.offset), Err(SchedError::NotScattering { offset: ga.region.offset }));
        s.check_invariants().unwrap();
    }

    // ---- Random operation sequences -------------------------------------------------------

    #[derive(Debug, Clone)]
    enum Op {
        /// Raw chunk sizes, mapped to `1..=largest block` skewed towards small ones.
        Want {
            id: u8,
            chunks: Vec<u64>,
        },
        /// A WANT with one bad chunk (0 bytes or over the largest block).
        BadWant {
            id: u8,
            zero: bool,
        },
        Begin(usize),
        End(usize),
        Ack(usize),
        Reclaim(u8),
        ReclaimPeer(u8),
        Acquire {
            raw: u64,
            eager: bool,
        },
        Promote(usize),
        Release(usize),
    }

    const FLOW_IDS: u8 = 6;

    /// Flow `id` of a small key space, so keys are reused after a flow finishes (a new flow).
    fn key(id: u8) -> FlowKey {
        flow(u32::from(id % 3), u64::from(id))
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (0..FLOW_IDS, prop::collection::vec(any::<u64>(), 1..6))
                .prop_map(|(id, chunks)| Op::Want { id, chunks }),
            1 => (0..FLOW_IDS, any::<bool>()).prop_map(|(id, zero)| Op::BadWant { id, zero }),
            2 => any::<usize>().prop_map(Op::Begin),
            2 => any::<usize>().prop_map(Op::End),
            4 => any::<usize>().prop_map(Op::Ack),
            1 => (0..FLOW_IDS).prop_map(Op::Reclaim),
            1 => (0..3u8).prop_map(Op::ReclaimPeer),
            2 => (any::<u64>(), any::<bool>()).prop_map(|(raw, eager)| Op::Acquire { raw, eager }),
            1 => any::<usize>().prop_map(Op::Promote),
            2 => any::<usize>().prop_map(Op::Release),
        ]
    }

    /// A flow's wait for its next grant: it has pending chunks and fewer than `W` regions.
    #[derive(Debug)]
    struct Wait {
        /// Grants to other flows since the wait began.
        bypassed: u64,
        /// Active flows when the wait began.
        active_at_start: u64,
        /// Value of `Harness::incarnations` when the wait began.
        incarnations_at_start: u64,
    }

    /// A receiver that calls `schedule()` after every operation, as the contract requires, and
    /// mirrors what the scheduler must be doing to judge each step.
    struct Harness {
        s: CreditScheduler,
        /// Per active flow: chunks wanted but not granted, in order.
        pending: BTreeMap<FlowKey, VecDeque<(ChunkIdx, u64)>>,
        next_chunk: BTreeMap<FlowKey, u32>,
        /// Granted regions not yet scattering.
        granted: Vec<Grant>,
        /// Scattering regions, with their orphaned flag.
        scattering: Vec<(Grant, bool)>,
        local: Vec<(Region, bool)>,
        waits: BTreeMap<FlowKey, Wait>,
        /// Flows created so far (a reused key after erasure counts again).
        incarnations: u64,
        max_ratio: f64,
        drains: u64,
    }

    impl Harness {
        fn new(units: u64, extra: u64, window: u32) -> Self {
            Self {
                s: CreditScheduler::new(units * G + extra, G, window).unwrap(),
                pending: BTreeMap::new(),
                next_chunk: BTreeMap::new(),
                granted: Vec::new(),
                scattering: Vec::new(),
                local: Vec::new(),
                waits: BTreeMap::new(),
                incarnations: 0,
                max_ratio: 0.0,
                drains: 0,
            }
        }

        fn held(&self, f: FlowKey) -> usize {
            self.granted.iter().filter(|g| g.flow == f).count()
                + self.scattering.iter().filter(|(g, o)| g.flow == f && !o).count()
        }

        /// Waiting in the fairness sense: wants a credit, is under its window, and its peer is
        /// within its share of the arena (a peer over its share is held back on purpose while
        /// others wait: that is the share cap, not a fairness violation).
        fn waiting(&self, f: FlowKey) -> bool {
            let head = self.pending.get(&f).and_then(|p| p.front().copied());
            head.is_some_and(|(_, bytes)| !self.s.over_peer_share(f.peer, bytes))
                && self.held(f) < self.s.window() as usize
        }

        /// Active flows: the mirror forgets a flow exactly when the scheduler must erase it.
        fn active(&self) -> Vec<FlowKey> {
            self.pending.keys().copied().collect()
        }

        fn start_wait(&mut self, f: FlowKey) {
            let wait = Wait {
                bypassed: 0,
                active_at_start: self.active().len() as u64,
                incarnations_at_start: self.incarnations,
            };
            self.waits.insert(f, wait);
        }

        fn forget_if_done(&mut self, f: FlowKey) {
            if self.pending.get(&f).is_some_and(|p| p.is_empty()) && self.held(f) == 0 {
                self.pending.remove(&f);
                self.next_chunk.remove(&f);
            }
        }

        fn apply(&mut self, op: Op) -> std::result::Result<(), TestCaseError> {
            let max = self.s.max_chunk_bytes();
            match op {
                Op::Want { id, chunks } => {
                    let f = key(id);
                    // Mostly small chunks with some large ones: the mix that needs drain mode.
                    let bytes: Vec<u64> = chunks.iter().map(|r| ((1 + r % max) >> ((r >> 60) % 5)).max(1)).collect();
                    self.s.want(f, &bytes).map_err(|e| TestCaseError::fail(e.to_string()))?;
                    if !self.pending.contains_key(&f) {
                        self.incarnations += 1;
                    }
                    let next = self.next_chunk.entry(f).or_insert(0);
                    let q = self.pending.entry(f).or_default();
                    for b in bytes {
                        q.push_back((ChunkIdx(*next), b));
                        *next += 1;
                    }
                }
                Op::BadWant { id, zero } => {
                    let bad = if zero { 0 } else { max + 1 };
                    prop_assert!(self.s.want(key(id), &[G, bad]).is_err());
                }
                Op::Begin(i) if !self.granted.is_empty() => {
                    let g = self.granted.remove(i % self.granted.len());
                    prop_assert_eq!(self.s.is_held(g.flow, g.region.offset), Some(g));
                    prop_assert_eq!(self.s.begin_scatter(g.flow, g.region.offset), Ok(g));
                    self.scattering.push((g, false));
                }
                Op::End(i) if !self.scattering.is_empty() => {
                    let (g, orphaned) = self.scattering.remove(i % self.scattering.len());
                    let end = EndScatter { flow: g.flow, chunk: g.chunk, region: g.region, orphaned };
                    prop_assert_eq!(self.s.end_scatter(g.region.offset), Ok(end));
                    if !orphaned {
                        self.forget_if_done(g.flow);
                    }
                }
                Op::Ack(i) if !self.granted.is_empty() => {
                    let g = self.granted.remove(i % self.granted.len());
                    self.s.begin_scatter(g.flow, g.region.offset).map_err(|e| TestCaseError::fail(e.to_string()))?;
                    prop_assert_eq!(self.s.end_scatter(g.region.offset).map(|e| e.orphaned), Ok(false));
                    self.forget_if_done(g.flow);
                }
                Op::Reclaim(id) => self.reclaim(&[key(id)])?,
                Op::ReclaimPeer(p) => {
                    let flows: Vec<FlowKey> =
                        self.pending.keys().copied().filter(|f| f.peer == PeerId(p.into())).collect();
                    let mut want = Reclaimed::default();
                    for &f in &flows {
                        let r = self.expect_reclaim(f);
                        want.freed.extend(r.freed);
                        want.deferred.extend(r.deferred);
                    }
                    prop_assert_eq!(self.s.reclaim_peer(PeerId(p.into())), want);
                }
                Op::Acquire { raw, eager } => {
                    let bytes = 1 + raw % max;
                    let len = self.s.buddy().block_len(bytes).unwrap();
                    let eager_ok = !eager || self.s.eager_bytes() + len <= self.s.eager_cap();
                    let fits = self.s.buddy().largest_free() >= len;
                    let got = self.s.acquire_local(bytes, eager);
                    prop_assert_eq!(got.is_some(), eager_ok && fits);
                    if let Some(r) = got {
                        self.local.push((r, eager));
                    }
                }
                Op::Promote(i) if !self.local.is_empty() => {
                    let i = i % self.local.len();
                    let (r, eager) = self.local[i];
                    let want = if eager { Ok(()) } else { Err(SchedError::NotEager { offset: r.offset }) };
                    prop_assert_eq!(self.s.promote_local(r.offset), want);
                    self.local[i].1 = false;
                }
                Op::Release(i) if !self.local.is_empty() => {
                    let (r, _) = self.local.remove(i % self.local.len());
                    prop_assert_eq!(self.s.release_local(r.offset), Ok(r));
                    prop_assert_eq!(self.s.release_local(r.offset), Err(SchedError::NotLocal { offset: r.offset }));
                }
                Op::Begin(_) | Op::End(_) | Op::Ack(_) | Op::Promote(_) | Op::Release(_) => {}
            }
            self.step()
        }

        fn reclaim(&mut self, flows: &[FlowKey]) -> std::result::Result<(), TestCaseError> {
            for &f in flows {
                let want = self.expect_reclaim(f);
                prop_assert_eq!(self.s.reclaim_flow(f), want);
            }
            Ok(())
        }

        /// Updates the mirror for a reclaim of `f` and returns what the scheduler must report.
        fn expect_reclaim(&mut self, f: FlowKey) -> Reclaimed {
            let mut r = Reclaimed::default();
            let mut freed: Vec<Region> = self.granted.iter().filter(|g| g.flow == f).map(|g| g.region).collect();
            let mut deferred: Vec<Region> = Vec::new();
            self.granted.retain(|g| g.flow != f);
            for (g, orphaned) in &mut self.scattering {
                if g.flow == f && !*orphaned {
                    *orphaned = true;
                    deferred.push(g.region);
                }
            }
            // The scheduler reports a flow's regions by ascending offset, freed and deferred
            // interleaved as they come.
            freed.sort();
            deferred.sort();
            r.freed = freed;
            r.deferred = deferred;
            self.pending.remove(&f);
            self.next_chunk.remove(&f);
            self.waits.remove(&f);
            r
        }

        /// The receiver's `schedule()` after an operation, judged against the mirror.
        fn step(&mut self) -> std::result::Result<(), TestCaseError> {
            let flows: Vec<FlowKey> = self.pending.keys().copied().collect();
            self.waits.retain(|f, _| flows.contains(f));
            for f in flows {
                match (self.waiting(f), self.waits.contains_key(&f)) {
                    (true, false) => self.start_wait(f),
                    (false, true) => {
                        self.waits.remove(&f);
                    }
                    _ => {}
                }
            }
            let grants = self.s.schedule();
            for g in grants {
                let head = self.pending.get_mut(&g.flow).and_then(|q| q.pop_front());
                let Some((chunk, bytes)) = head else {
                    return Err(TestCaseError::fail(format!("grant {g:?} for a flow with nothing pending")));
                };
                prop_assert_eq!(g.chunk, chunk, "chunks are granted in order");
                prop_assert_eq!(Some(g.region.len), self.s.buddy().block_len(bytes));
                prop_assert!(self.held(g.flow) < self.s.window() as usize, "window respected");
                for (f, w) in &mut self.waits {
                    if *f != g.flow {
                        w.bypassed += 1;
                        // Fairness bound, with M = flows active at some point of the wait:
                        // - before the scheduler first looks at the waiting flow, sweep grants
                        //   only go to flows between the cursor and it: <= M - 1; each other
                        //   flow is swept past at most once, so it is drained at most twice
                        //   (one old stamp, one new): <= 2(M - 1) drain grants;
                        // - once its head did not fit it is stamped with deadline s + 2n, n <= M:
                        //   <= 2M grants until the deadline;
                        // - after the deadline only drain grants happen, each to a distinct flow
                        //   with an earlier deadline: <= M - 1.
                        let m = w.active_at_start + (self.incarnations - w.incarnations_at_start);
                        let bound = 6 * m - 4;
                        self.max_ratio = self.max_ratio.max(w.bypassed as f64 / m as f64);
                        prop_assert!(
                            w.bypassed <= bound,
                            "{:?} bypassed {} times, bound {} (M = {})",
                            f,
                            w.bypassed,
                            bound,
                            m
                        );
                    }
                }
                self.waits.remove(&g.flow);
                self.granted.push(g);
                if self.waiting(g.flow) {
                    self.start_wait(g.flow);
                }
            }
            prop_assert!(self.s.schedule().is_empty(), "schedule() is idempotent");
            self.drains += u64::from(self.s.drain_target().is_some());
            self.s.check_invariants().map_err(TestCaseError::fail)?;
            let active = self.active();
            prop_assert_eq!(self.s.active_flows(), active.len());
            for f in active {
                prop_assert_eq!(self.s.pending_chunks(f), self.pending[&f].len());
                prop_assert_eq!(self.s.flow_held_count(f), self.held(f));
            }
            Ok(())
        }

        /// Liveness: with every grant eventually scattered and ACKed and local staging
        /// released, every pending chunk is granted. Each round empties the arena, and an
        /// empty arena always fits the drain target or the first eligible head, so each round
        /// grants at least one chunk.
        fn drain_all(&mut self) -> std::result::Result<(), TestCaseError> {
            let total: usize = self.pending.values().map(VecDeque::len).sum();
            let mut rounds = 0;
            loop {
                while !self.scattering.is_empty() {
                    self.apply(Op::End(0))?;
                }
                while !self.granted.is_empty() {
                    self.apply(Op::Ack(0))?;
                }
                while !self.local.is_empty() {
                    self.apply(Op::Release(0))?;
                }
                if self.pending.is_empty() {
                    break;
                }
                rounds += 1;
                prop_assert!(rounds <= total + 1, "no progress: {} rounds for {} chunks", rounds, total);
            }
            prop_assert_eq!(self.s.active_flows(), 0);
            prop_assert_eq!(self.s.free_bytes(), self.s.usable_capacity());
            Ok(())
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(160))]

        /// Invariants after every step, exact mirror agreement, the fairness bound, and
        /// liveness once all ACKs flow.
        #[test]
        fn random_operations_keep_invariants_fairness_and_liveness(
            units in 1u64..24,
            extra in 0u64..G,
            window in 1u32..4,
            ops in prop::collection::vec(op(), 0..100),
        ) {
            let mut h = Harness::new(units, extra, window);
            for op in ops {
                h.apply(op)?;
            }
            h.drain_all()?;
        }
    }

    /// Many flows competing for a tiny arena with mixed chunk sizes and one ACK per step: the
    /// deterministic stress version of the fairness property.
    #[test]
    fn fairness_bound_holds_under_heavy_contention() {
        let mut h = Harness::new(8, 0, 2);
        let mut rng = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        // Raw sizes map to bytes `1 + raw % 8G` (top bits cleared: no shift): one chunk in
        // eight needs the whole arena, the others one unit.
        let chunk = |r: u64| {
            if r % 8 == 0 { 4 * G + r % (4 * G) } else { r % G }
        };
        for id in 0..FLOW_IDS {
            let chunks = (0..40).map(|_| chunk(next() & !(0xf << 60))).collect();
            h.apply(Op::Want { id, chunks }).unwrap();
        }
        for _ in 0..3000 {
            let op = match next() % 10 {
                0 => Op::Want { id: (next() % u64::from(FLOW_IDS)) as u8, chunks: vec![chunk(next() & !(0xf << 60))] },
                1 => Op::Begin(next() as usize),
                2 => Op::End(next() as usize),
                _ => Op::Ack(next() as usize),
            };
            h.apply(op).unwrap();
        }
        h.drain_all().unwrap();
        assert!(h.drains > 0, "the workload exercises drain mode");
        assert!(h.max_ratio <= 6.0, "worst bypass/M ratio {}", h.max_ratio);
    }
}
