//! Transfer plan: bin-packs (src, dst) descriptor pairs into chunks and coalesces copy runs
//! (design §4 BounceTransferPlan, §6 run merging).
//!
//! A chunk is what one RDMA write moves: at most `max_chunk` bytes of a staging region, into
//! which the sender gathers and out of which the receiver scatters. This module only computes
//! offsets and lengths: pure functions, no state, no addresses dereferenced (addresses are
//! opaque integers). The sender builds a [`Plan`] at submit time; the chunk sizes go into WANT
//! and each chunk's scatter runs into its DATA. A chunk whose source is already laid out like
//! its region is marked [`Chunk::direct`]: the sender writes it from user memory, unstaged.

use std::fmt;
use std::sync::Arc;

use crate::{
    config::Config,
    types::{ArenaId, CopyRun},
};

// Re-exported where it has always been found; it lives in `types` because `config` checks the
// chunk size against it and `plan` reads the config, and neither may import the other back.
pub use crate::types::DEFAULT_ALIGN;

/// One descriptor pair of a transfer: `len` bytes from `src` (local) to `dst` (remote).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "fuzzing", derive(arbitrary::Arbitrary))]
pub struct DescPair {
    /// Source address on the sender.
    pub src: u64,
    /// Destination address on the receiver.
    pub dst: u64,
    /// Length in bytes; zero-length pairs are skipped.
    pub len: u64,
}

/// Most chunks a transfer of a few chunks is split into ([`PlanParams::split_for`]). Four: a
/// KV request of 4 MiB of 4 KiB pieces took 1.06-1.42 ms in four 1 MiB chunks against
/// 1.33-1.72 ms in two of 2 MiB on the 16-core H200 host (BENCHMARKS.md, session 19); more
/// chunks add a control exchange each, and the two copy workers are already both busy.
pub const SPLIT_WAYS: u64 = 4;

/// Packing rules of [`plan`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlanParams {
    /// Largest chunk in bytes (at least `align`).
    pub max_chunk: u64,
    /// Alignment of each descriptor's offset in the region; a power of two.
    pub align: u64,
    /// Coalesce contiguous or uniformly strided pieces into one [`CopyRun`].
    pub merge_runs: bool,
    /// Fewest scatter runs for which a chunk carries them in its region ([`Chunk::region_plan`]);
    /// 0: never.
    pub region_plan_runs: u32,
    /// A transfer of at least twice this many region bytes that would take fewer than
    /// [`SPLIT_WAYS`] chunks takes up to that many of about equal size, none smaller than
    /// this ([`Self::split_for`]); 0: never.
    pub split_bytes: u64,
}

impl PlanParams {
    /// Parameters with the given chunk cap, [`DEFAULT_ALIGN`] and run merging on.
    pub fn new(max_chunk: u64) -> Self {
        Self { max_chunk, align: DEFAULT_ALIGN, merge_runs: true, region_plan_runs: 0, split_bytes: 0 }
    }

    /// The parameters a validated [`Config`] implies.
    pub fn from_config(config: &Config) -> Self {
        Self {
            merge_runs: config.scatter_run_merging,
            region_plan_runs: config.region_plan_runs,
            split_bytes: config.split_bytes,
            ..Self::new(config.max_chunk_size)
        }
    }

    /// The parameters for `descs`: with [`split_bytes`](Self::split_bytes) set, a transfer
    /// whose region bytes (each piece padded to `align`) would take fewer than [`SPLIT_WAYS`]
    /// chunks moves in `min(SPLIT_WAYS, bytes / split_bytes)` chunks of about equal size (when
    /// that is at least two): one chunk's gather, write and scatter then overlap the others'
    /// instead of following each other. A 1 MiB WRITE as one chunk had them in series; a KV
    /// request of 4 MiB moved as two 2 MiB chunks left each side's second copy after its
    /// first. Larger transfers already pipeline and keep `max_chunk`.
    pub fn split_for(self, descs: &[DescPair]) -> Self {
        // No alignment check: an alignment of 0 makes every piece's padding "overflow", the
        // sum saturates and the transfer is left as it is.
        if self.split_bytes == 0 {
            return self;
        }
        let padded = descs
            .iter()
            .fold(0u64, |sum, d| sum.saturating_add(d.len.checked_next_multiple_of(self.align).unwrap_or(u64::MAX)));
        let ways = (padded / self.split_bytes).min(SPLIT_WAYS);
        if ways < 2 {
            return self;
        }
        let part = padded.div_ceil(ways).checked_next_multiple_of(self.align).unwrap_or(self.max_chunk);
        if part >= self.max_chunk {
            return self;
        }
        Self { max_chunk: part, ..self }
    }

    fn validate(&self) -> Result<()> {
        if !self.align.is_power_of_two() {
            return Err(PlanError::AlignNotPowerOfTwo { align: self.align });
        }
        if self.max_chunk < self.align {
            return Err(PlanError::ChunkSmallerThanAlign { max_chunk: self.max_chunk, align: self.align });
        }
        Ok(())
    }
}

/// One chunk of a plan: a staging region's layout and the copies into and out of it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Chunk {
    /// Packed size in bytes, alignment padding between descriptors included (no trailing
    /// padding); the region size to request. Never more than [`PlanParams::max_chunk`].
    pub bytes: u64,
    /// Copies source → region; [`CopyRun::addr`] is the source address. Shared: a READ's PULL
    /// carries them to the target without copying thousands of runs.
    pub gather: Arc<Vec<CopyRun>>,
    /// Copies region → destination; [`CopyRun::addr`] is the destination address.
    pub scatter: Vec<CopyRun>,
    /// The source address of the whole chunk when its payload already lies in user memory
    /// exactly as the region would hold it: the gather copies one contiguous source range onto
    /// region bytes `0..bytes` (contiguous sources, no alignment padding; merged, that is one
    /// [`CopyRun`] with `count == 1`, `region_off == 0` and `len == bytes`). The sender writes
    /// straight from `[direct, direct + bytes)` and skips staging and the gather. [`plan`]
    /// sets it; the shell clears it (sets `None`) before submit when it cannot write from that
    /// memory, e.g. when the range is not registered in one piece. `gather` stays valid either
    /// way.
    pub direct: Option<u64>,
    /// Where the chunk's scatter runs lie in its region when they travel there
    /// ([`crate::wire::region_plan`]): the region is the data, padded to 8 bytes, then the
    /// plan, and `bytes` counts both. `None`: the runs travel in control frames. [`plan`] sets
    /// it for chunks of at least [`PlanParams::region_plan_runs`] runs; such a chunk is never
    /// [`Chunk::direct`] (the plan must be staged behind the data).
    pub region_plan: Option<u64>,
}

impl Chunk {
    /// Bytes of payload and padding before the region plan (all of `bytes` without one).
    pub fn data_bytes(&self) -> u64 {
        self.region_plan.unwrap_or(self.bytes)
    }

    /// Runs in the plan behind the data; 0 without one ([`plan`] places one only for a run
    /// count that fits a `u32`).
    pub fn region_plan_runs(&self) -> u32 {
        match self.region_plan {
            Some(_) => u32::try_from(self.scatter.len()).unwrap_or(u32::MAX),
            None => 0,
        }
    }
}

/// The chunks of one transfer, in order.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Plan {
    /// Non-empty chunks; their count fits in a `u32` (see [`crate::types::ChunkIdx`]).
    pub chunks: Vec<Chunk>,
    /// Payload bytes (the sum of the descriptor lengths, padding excluded).
    pub total_bytes: u64,
    /// The receiver's registrations the descriptors write into, with the keys the sender was
    /// given in their metadata: the WANT proves each ([`crate::proof`]). `plan` leaves it
    /// empty; the shell fills it from the remote descriptors. Without a proof for a
    /// destination the receiver refuses to scatter there.
    pub dests: Vec<crate::proof::Destination>,
    /// A READ: the descriptors' sources are the peer's (the gather runs read its memory, and
    /// `dests` prove its registrations) and their destinations ours. `plan` leaves it false;
    /// the shell sets it for a READ request.
    pub read: bool,
    /// The peer's arena the transfer bounces through (its regions: the destinations' place
    /// for a WRITE, the sources' for a READ), named in its WANT or PULLs. `plan` leaves it 0,
    /// the arena every engine has; the shell sets it from the peer's capabilities.
    pub peer_arena: ArenaId,
    /// Our arena the transfer stages in (a WRITE's gathers, a READ's landing regions): the
    /// one of the local descriptors' place. `plan` leaves it 0; the shell sets it.
    pub local_arena: ArenaId,
}

impl Plan {
    /// Each chunk's packed size, in chunk order (the WANT payload).
    pub fn chunk_sizes(&self) -> impl ExactSizeIterator<Item = u64> + '_ {
        self.chunks.iter().map(|c| c.bytes)
    }

    /// The byte spans of our own memory the transfer touches, `[start, end)`: a READ's scatter
    /// runs, a WRITE's gather runs and direct-write sources (a strided run counts as its
    /// whole span). A span that would overflow is left out: such a run was never planned.
    /// `read`: the transfer is a READ (the shell's plans say so in [`Self::read`]).
    pub fn local_spans(&self, read: bool) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.chunks.iter().flat_map(move |c| {
            let runs = if read { &c.scatter[..] } else { &c.gather[..] };
            let direct = c.direct.filter(|_| !read).map(|d| (d, d.saturating_add(c.bytes)));
            runs.iter().filter_map(CopyRun::addr_span).chain(direct)
        })
    }
}

/// Which side of a descriptor pair an error is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Side {
    /// The source address.
    Src,
    /// The destination address.
    Dst,
}

impl fmt::Display for Side {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Src => "src",
            Self::Dst => "dst",
        })
    }
}

/// Why a list of descriptors cannot be planned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PlanError {
    /// [`PlanParams::align`] is zero or not a power of two.
    #[error("plan alignment {align} is not a power of two")]
    AlignNotPowerOfTwo {
        /// The requested alignment.
        align: u64,
    },
    /// [`PlanParams::max_chunk`] cannot hold one aligned slot (this includes 0).
    #[error("max chunk {max_chunk} is smaller than the alignment {align}")]
    ChunkSmallerThanAlign {
        /// The requested chunk cap.
        max_chunk: u64,
        /// The requested alignment.
        align: u64,
    },
    /// A descriptor's `addr + len` does not fit in 64 bits.
    #[error("descriptor {index}: {side} {addr:#x} + {len} overflows the address space")]
    AddressOverflow {
        /// Index of the descriptor in the input.
        index: usize,
        /// The side that overflows.
        side: Side,
        /// Its start address.
        addr: u64,
        /// Its length.
        len: u64,
    },
    /// The sum of the descriptor lengths does not fit in 64 bits.
    #[error("total payload exceeds 2^64 bytes at descriptor {index}")]
    PayloadOverflow {
        /// Index of the descriptor at which the sum overflowed.
        index: usize,
    },
    /// The plan would need more chunks than a [`crate::types::ChunkIdx`] can number.
    #[error("plan needs at least {at_least} chunks, more than u32::MAX")]
    TooManyChunks {
        /// A lower bound of the chunks needed.
        at_least: u64,
    },
    /// [`plan_segmented`] got segments that are neither one per descriptor nor none.
    #[error("{segs} segments for {descs} descriptors")]
    Segments {
        /// Descriptors given.
        descs: usize,
        /// Segments given.
        segs: usize,
    },
}

/// Result of planning.
pub type Result<T> = std::result::Result<T, PlanError>;

/// Bin-packs `descs` into chunks of at most `params.max_chunk` bytes.
///
/// Descriptors are packed in input order, each at the next `align`-aligned offset of the
/// current chunk; zero-length ones are skipped. A descriptor that does not fit in the space
/// left starts a new chunk, so descriptors of at most `max_chunk` bytes are never split. A
/// descriptor larger than `max_chunk` has to be split anyway: it first fills the current
/// chunk's remaining space (if any), then continues in fresh chunks of `max_chunk` bytes,
/// and its last piece shares its chunk with the descriptors that follow. Runs are merged per
/// [`PlanParams::merge_runs`] (see [`CopyRun`]), separately for the gather and scatter lists.
/// A chunk whose source bytes are one contiguous range laid out exactly as in its region gets
/// [`Chunk::direct`], so that the sender can skip staging it.
/// Runs in O(n) of the descriptors plus the chunks produced.
///
/// # Errors
///
/// Invalid `params`, an address range that wraps, a payload sum above `u64::MAX`, or more
/// than `u32::MAX` chunks (mostly caught before any packing or allocation).
pub fn plan(descs: &[DescPair], params: PlanParams) -> Result<Plan> {
    plan_segmented(descs, &[], params)
}

/// [`plan`], where `segs[i]` names the pair of registrations descriptor i lies in (ours and the
/// peer's): no run merges pieces across a change of it. The receiver checks each run's whole
/// span against one registration, so a strided run reaching from the last block of one layer
/// to the first of the next (two registrations, adjacent in memory, the stride equal by
/// chance or, as with KV blocks at one offset of every layer, always) would be refused.
/// An empty `segs` is one segment.
///
/// # Errors
/// As [`plan`]; [`PlanError::Segments`] when `segs` is neither empty nor one per descriptor.
pub fn plan_segmented(descs: &[DescPair], segs: &[u32], params: PlanParams) -> Result<Plan> {
    if !segs.is_empty() && segs.len() != descs.len() {
        return Err(PlanError::Segments { descs: descs.len(), segs: segs.len() });
    }
    params.validate()?;
    let params = params.split_for(descs);
    let descs = Descs { pairs: descs, segs, sums: check_input(descs)? };
    if params.region_plan_runs == 0 {
        return packed(descs, params);
    }
    // Chunks carrying their plan hold less data: pack with a smaller cap until every chunk that
    // wants its plan in the region fits within `max_chunk` with it (a region one byte over
    // takes a buddy block twice the size). Fewer bytes per chunk never means more runs per
    // chunk, so this settles in a pass or two; after four, the chunks that still do not fit
    // keep their plans in control frames. The search looks at shapes (each chunk's size and
    // scatter runs, one counting pass, nothing allocated per run); only the packing chosen is
    // built: building each candidate made a 16384-piece GPU plan cost 4.4 ms.
    let mut cap = params.max_chunk;
    let mut chosen = None;
    for _ in 0..4 {
        let s = shape(descs, PlanParams { max_chunk: cap, ..params })?;
        let over =
            s.iter().filter_map(|c| c.with_region_plan(params)).map(|b| b.saturating_sub(params.max_chunk)).max();
        match over {
            Some(over) if over > 0 => {
                let smaller = cap.saturating_sub(over) / params.align * params.align;
                if smaller < params.align {
                    break;
                }
                cap = smaller;
            }
            _ => {
                chosen = Some(if cap < params.max_chunk { balanced(descs, params, cap, &s)? } else { (cap, s) });
                break;
            }
        }
    }
    let (cap, s) = match chosen {
        Some(c) => c,
        None => (cap, shape(descs, PlanParams { max_chunk: cap, ..params })?),
    };
    // When no chunk can carry its plan (smaller chunks merged fewer pieces into fewer runs than
    // the threshold), the plan packed at full size instead, which the room made for plans
    // would only have cut into more chunks.
    if plan_carriers(&s, params) == 0 {
        return packed(descs, params);
    }
    let mut p = packed(descs, PlanParams { max_chunk: cap, ..params })?;
    place_region_plans(&mut p, params);
    Ok(p)
}

/// Chunks of shape `s` that can carry their plans in their regions.
fn plan_carriers(s: &[ChunkShape], params: PlanParams) -> usize {
    s.iter().filter(|c| c.with_region_plan(params).is_some_and(|b| b <= params.max_chunk)).count()
}

/// The cap and shape of the packing with cap `cap` (shape `s`), shrunk to make room for
/// region plans, again with the cap that splits its bytes evenly over as many chunks, when
/// every chunk still fits with its plan: 64 MiB in 32 MiB chunks otherwise became two full
/// chunks and a sliver, where three even ones overlap their gathers, writes and scatters
/// better.
fn balanced(descs: Descs<'_>, params: PlanParams, cap: u64, s: &[ChunkShape]) -> Result<(u64, Vec<ChunkShape>)> {
    let n = s.len() as u64;
    if n < 2 {
        return Ok((cap, s.to_vec()));
    }
    // Summed wide: with the alignment gaps, chunks of nearly 2^64 payload bytes sum past u64.
    let total: u128 = s.iter().map(|c| u128::from(c.bytes)).sum();
    let even = u64::try_from(total.div_ceil(u128::from(n))).unwrap_or(u64::MAX);
    // Pieces are not split to fill a chunk to the byte: the exact third of 64 MiB of 4 KiB
    // pieces packs into four chunks. Try the even share rounded up to ever coarser steps.
    let mut tried = None;
    for step in [params.align, 4 << 10, 64 << 10, 1 << 20] {
        let Some(even_cap) = even.checked_next_multiple_of(step.max(params.align)) else { break };
        if even_cap >= params.max_chunk {
            break;
        }
        // An even share already a multiple of the coarser step gives the same cap again: its
        // packing was just refused (a GPU plan of 8192 pieces of 4 KiB, 32 MiB in two even
        // chunks, counted the same packing four times).
        if tried.replace(even_cap) == Some(even_cap) {
            continue;
        }
        // A cap whose packing cannot be made is refused like one that does not fit: the
        // packing `s` stands.
        let Ok(e) = shape(descs, PlanParams { max_chunk: even_cap, ..params }) else { continue };
        let fits = e.iter().filter_map(|c| c.with_region_plan(params)).all(|b| b <= params.max_chunk);
        // Smaller chunks may fall below the run threshold: never trade plans away for balance.
        if e.len() as u64 == n && fits && plan_carriers(&e, params) >= plan_carriers(s, params) {
            return Ok((even_cap, e));
        }
    }
    Ok((cap, s.to_vec()))
}

/// What the region-plan search needs of a chunk: its size and its scatter runs (how many, and
/// the longest copy).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ChunkShape {
    bytes: u64,
    scatter_runs: usize,
    longest_scatter: u64,
}

impl ChunkShape {
    fn of(c: &Chunk) -> Self {
        let longest_scatter = c.scatter.iter().map(|r| r.len).max().unwrap_or(0);
        Self { bytes: c.bytes, scatter_runs: c.scatter.len(), longest_scatter }
    }

    /// The region size the chunk needs with its plan behind its data, when it has enough runs
    /// for one (and the plan can be expressed).
    fn with_region_plan(&self, params: PlanParams) -> Option<u64> {
        let runs = u32::try_from(self.scatter_runs).ok()?;
        if runs < params.region_plan_runs
            || self.longest_scatter.div_ceil(crate::wire::region_plan::TILE) > u64::from(u32::MAX)
        {
            return None;
        }
        self.bytes.checked_next_multiple_of(8)?.checked_add(crate::wire::region_plan::plan_bytes(runs))
    }
}

/// Puts the plan of every chunk with enough runs behind its data where the region still fits
/// `max_chunk`.
fn place_region_plans(p: &mut Plan, params: PlanParams) {
    for c in &mut p.chunks {
        if let Some(bytes) = ChunkShape::of(c).with_region_plan(params).filter(|&b| b <= params.max_chunk) {
            c.region_plan = Some(c.bytes.next_multiple_of(8));
            c.bytes = bytes;
            c.direct = None;
        }
    }
}

/// The input of [`plan_segmented`].
#[derive(Clone, Copy)]
struct Descs<'a> {
    pairs: &'a [DescPair],
    /// One per pair, or empty (one segment).
    segs: &'a [u32],
    /// The pairs' sums; their check passed, once for every packing the search tries.
    sums: Sums,
}

/// [`plan`] without region plans.
fn packed(descs: Descs<'_>, params: PlanParams) -> Result<Plan> {
    let Sums { total_bytes, pieces } = descs.sums;
    check_chunks(total_bytes, params)?;
    // One pass into working lists with room for a chunk of average pieces, each chunk's lists
    // copied out at their exact size. Two passes (counting, then filling lists of exact size)
    // took twice as long (8192 random 4 KiB pieces: 131 against 67 us on 2 cores, the
    // allocator keeping its memory). Lists of exact size matter: a chunk's own lists grown
    // from empty, or allocated at a bound and shrunk, left the allocator fragments it gave
    // back to the kernel, and the next plan page-faulted (137 faults a prep of 8192 pieces).
    // The average piece's slot: its length padded to the alignment (so never more chunk slots
    // than `max_chunk / align`).
    let slot = total_bytes.checked_div(pieces).and_then(|avg| avg.checked_next_multiple_of(params.align));
    let typical = match slot {
        // One more for a piece split off the chunk before.
        Some(slot) if slot > 0 => usize::try_from(params.max_chunk / slot).unwrap_or(usize::MAX).saturating_add(1),
        _ => 1,
    };
    // A chunk holds at most one piece of each descriptor.
    let room = typical.min(descs.pairs.len());
    let mut builder = Builder {
        merge: params.merge_runs,
        last_seg: None,
        chunks: Vec::new(),
        gather: Vec::with_capacity(room),
        scatter: Vec::with_capacity(room),
    };
    pack(descs, params, &mut builder)?;
    Ok(Plan {
        chunks: builder.chunks,
        total_bytes,
        dests: Vec::new(),
        read: false,
        peer_arena: ArenaId(0),
        local_arena: ArenaId(0),
    })
}

/// What [`check_input`] sums over the descriptors.
#[derive(Clone, Copy)]
struct Sums {
    /// Payload bytes.
    total_bytes: u64,
    /// Descriptors that are not empty.
    pieces: u64,
}

/// Checks the descriptors up front, so that packing has no failure modes of the input, and
/// sums them.
fn check_input(descs: &[DescPair]) -> Result<Sums> {
    let (mut total_bytes, mut pieces) = (0u64, 0u64);
    for (index, d) in descs.iter().enumerate() {
        if d.len == 0 {
            continue;
        }
        pieces += 1;
        for (side, addr) in [(Side::Src, d.src), (Side::Dst, d.dst)] {
            if addr.checked_add(d.len).is_none() {
                return Err(PlanError::AddressOverflow { index, side, addr, len: d.len });
            }
        }
        total_bytes = total_bytes.checked_add(d.len).ok_or(PlanError::PayloadOverflow { index })?;
    }
    Ok(Sums { total_bytes, pieces })
}

/// Refuses a packing of `total_bytes` in chunks of `params.max_chunk` that needs more chunks
/// than a plan may have, before packing would spin through billions of them.
fn check_chunks(total_bytes: u64, params: PlanParams) -> Result<()> {
    let min_chunks = total_bytes.div_ceil(params.max_chunk);
    if min_chunks > MAX_CHUNKS {
        return Err(PlanError::TooManyChunks { at_least: min_chunks });
    }
    Ok(())
}

/// `x` rounded up to a multiple of `align`, a power of two ([`PlanParams::validate`]); `None`
/// past `u64::MAX`. A mask: `checked_next_multiple_of` compiles to a 64-bit division for an
/// alignment known only at run time, once per piece and pass (a GPU plan's region-plan search
/// packs several times: 8192 random pieces took 360 against 276 us on 2 cores).
#[inline(always)]
fn align_up(x: u64, align: u64) -> Option<u64> {
    debug_assert!(align.is_power_of_two());
    x.checked_add(align - 1).map(|v| v & !(align - 1))
}

/// Most chunks a plan may have: both the chunk count and chunk indices fit in a `u32`.
const MAX_CHUNKS: u64 = u32::MAX as u64;

/// Receiver of the packing decisions of [`pack`].
trait Sink {
    /// A piece of `len` bytes at offset `off` of the current chunk, from `src` to `dst`, of
    /// segment `seg` (see [`plan_segmented`]).
    fn piece(&mut self, off: u64, src: u64, dst: u64, len: u64, seg: u32);
    /// The current (non-empty) chunk is complete, `bytes` long.
    fn close(&mut self, bytes: u64) -> Result<()>;
}

/// The packing rules of [`plan`], for descriptors that passed [`check_input`].
fn pack(descs: Descs<'_>, params: PlanParams, sink: &mut impl Sink) -> Result<()> {
    let PlanParams { max_chunk, align, .. } = params;
    // End of the last piece of the current chunk; pieces are never empty, so 0 means the
    // chunk is empty.
    let mut used = 0u64;
    for (i, d) in descs.pairs.iter().enumerate().filter(|(_, d)| d.len != 0) {
        let seg = descs.segs.get(i).copied().unwrap_or(0);
        let DescPair { mut src, mut dst, len: mut rest } = *d;
        loop {
            // `used <= max_chunk`, but rounding up may still wrap for a huge `max_chunk`: then
            // there is no room left.
            let start = align_up(used, align);
            let room = start.map_or(0, |s| max_chunk.saturating_sub(s));
            match start {
                Some(start) if rest <= room => {
                    sink.piece(start, src, dst, rest, seg);
                    used = start + rest;
                    break;
                }
                Some(start) if rest > max_chunk && room > 0 => {
                    sink.piece(start, src, dst, room, seg);
                    used = start + room;
                    src += room;
                    dst += room;
                    rest -= room;
                }
                _ => {}
            }
            // The chunk is full or `rest` needs a fresh one. It is not empty: an empty chunk
            // has room for `min(rest, max_chunk) > 0` bytes, so one of the arms above placed
            // a piece, and each turn makes progress.
            sink.close(used)?;
            used = 0;
        }
    }
    if used > 0 {
        sink.close(used)?;
    }
    Ok(())
}

/// The shape of each chunk [`packed`] would build with `params`: one counting pass.
fn shape(descs: Descs<'_>, params: PlanParams) -> Result<Vec<ChunkShape>> {
    check_chunks(descs.sums.total_bytes, params)?;
    let mut sizer = Sizer::new(params);
    pack(descs, params, &mut sizer)?;
    Ok(sizer.shapes)
}

/// A counting pass for [`shape`]: each chunk's size, scatter run count and longest scatter
/// copy (the gather runs do not matter to the search it serves).
struct Sizer {
    merge: bool,
    /// The previous piece's segment: runs merge only within one.
    last_seg: Option<u32>,
    scatter: RunCounter,
    shapes: Vec<ChunkShape>,
}

impl Sizer {
    fn new(params: PlanParams) -> Self {
        Self { merge: params.merge_runs, last_seg: None, scatter: RunCounter::default(), shapes: Vec::new() }
    }
}

impl Sink for Sizer {
    #[inline(always)]
    fn piece(&mut self, off: u64, _src: u64, dst: u64, len: u64, seg: u32) {
        let merge = self.merge && self.last_seg.replace(seg).is_none_or(|last| last == seg);
        push_copy(&mut self.scatter, off, dst, len, merge);
    }

    fn close(&mut self, bytes: u64) -> Result<()> {
        if self.shapes.len() as u64 >= MAX_CHUNKS {
            return Err(PlanError::TooManyChunks { at_least: MAX_CHUNKS + 1 });
        }
        let longest_scatter = self.scatter.longest();
        let scatter_runs = self.scatter.finish();
        self.shapes.push(ChunkShape { bytes, scatter_runs, longest_scatter });
        Ok(())
    }
}

/// The packing's chunks, built as it goes: each chunk's runs collect in working lists kept
/// for the whole plan, and its own lists are exact copies of them.
struct Builder {
    merge: bool,
    /// As [`Sizer::last_seg`].
    last_seg: Option<u32>,
    chunks: Vec<Chunk>,
    gather: Vec<CopyRun>,
    scatter: Vec<CopyRun>,
}

impl Sink for Builder {
    #[inline(always)]
    fn piece(&mut self, off: u64, src: u64, dst: u64, len: u64, seg: u32) {
        let merge = self.merge && self.last_seg.replace(seg).is_none_or(|last| last == seg);
        push_copy(&mut self.gather, off, src, len, merge);
        push_copy(&mut self.scatter, off, dst, len, merge);
    }

    fn close(&mut self, bytes: u64) -> Result<()> {
        if self.chunks.len() as u64 >= MAX_CHUNKS {
            return Err(PlanError::TooManyChunks { at_least: MAX_CHUNKS + 1 });
        }
        let (gather, scatter) = (self.gather.to_vec(), self.scatter.to_vec());
        self.gather.clear();
        self.scatter.clear();
        let direct = direct_source(&gather, bytes);
        self.chunks.push(Chunk { bytes, gather: Arc::new(gather), scatter, direct, region_plan: None });
        Ok(())
    }
}

/// The source address when `gather` copies one contiguous source range onto the whole
/// `bytes`-long region, byte for byte (see [`Chunk::direct`]). Merged, that is a single run;
/// unmerged, a chain of single copies each continuing the last on both sides.
fn direct_source(gather: &[CopyRun], bytes: u64) -> Option<u64> {
    let start = gather.first()?.addr;
    let (mut off, mut addr) = (0u64, start);
    for r in gather {
        if r.count != 1 || r.region_off != off || r.addr != addr {
            return None;
        }
        off = off.checked_add(r.len)?;
        addr = addr.checked_add(r.len)?;
    }
    (off == bytes).then_some(start)
}

/// Runs that copy every pair's `len` bytes from `src` to `dst` in one launch, no region in
/// between: a run's `region_off` is the source address and `addr` the destination (a copy
/// kernel reads its "region" at base 0). The same-host path (`bounce_cuda_ipc`) copies so,
/// through a mapping of the peer's memory. Zero-length pairs are skipped; pairs are merged
/// into strided runs as [`plan`] merges pieces (when `merge`).
///
/// # Errors
/// [`PlanError::AddressOverflow`] for a pair whose range wraps the address space,
/// [`PlanError::PayloadOverflow`] when the total does not fit a `u64`.
pub fn pair_runs(descs: &[DescPair], merge: bool) -> Result<Vec<CopyRun>> {
    let Sums { pieces, .. } = check_input(descs)?;
    // A run per piece at most: no reallocation on the way (a same-host GPU prep of thousands
    // of pieces, made per request by vLLM's connector).
    let mut runs = Vec::with_capacity(usize::try_from(pieces).unwrap_or(0));
    for d in descs.iter().filter(|d| d.len > 0) {
        push_copy(&mut runs, d.src, d.dst, d.len, merge);
    }
    Ok(runs)
}

/// A run list as [`push_copy`] sees it: only its last run matters.
trait RunList {
    fn last_run(&mut self) -> Option<&mut CopyRun>;
    fn push_run(&mut self, run: CopyRun);
}

impl RunList for Vec<CopyRun> {
    fn last_run(&mut self) -> Option<&mut CopyRun> {
        self.last_mut()
    }

    fn push_run(&mut self, run: CopyRun) {
        self.push(run);
    }
}

/// A run list that keeps only its last run, the count and the longest copy of the runs before
/// the last.
#[derive(Default)]
struct RunCounter {
    last: Option<CopyRun>,
    runs: usize,
    longest: u64,
}

impl RunCounter {
    /// The longest copy of the current chunk's runs so far.
    fn longest(&self) -> u64 {
        self.last.map_or(self.longest, |r| self.longest.max(r.len))
    }

    /// The run count of the finished chunk; starts the next one.
    fn finish(&mut self) -> usize {
        (self.last, self.longest) = (None, 0);
        std::mem::take(&mut self.runs)
    }
}

impl RunList for RunCounter {
    fn last_run(&mut self) -> Option<&mut CopyRun> {
        self.last.as_mut()
    }

    fn push_run(&mut self, run: CopyRun) {
        // The last run is final once another follows (only the last one grows).
        if let Some(done) = self.last.replace(run) {
            self.longest = self.longest.max(done.len);
        }
        self.runs += 1;
    }
}

/// Appends the copy `(region_off, addr, len)` to `runs`, merged into the last run when
/// `merge` allows it. Pieces arrive in increasing `region_off`, so only the last run can
/// absorb the next one: merging is O(1) per piece. Inlined into both sinks' loops: a prep
/// plans every request vLLM's connector makes, and a called `push_copy` was a sixth of the
/// planning (16384 scattered pieces: 265 against 220 us on 2 cores).
#[inline(always)]
fn push_copy(runs: &mut impl RunList, region_off: u64, addr: u64, len: u64, merge: bool) {
    if merge {
        if let Some(last) = runs.last_run() {
            if absorb(last, region_off, addr, len) {
                return;
            }
        }
    }
    runs.push_run(CopyRun { region_off, addr, len, count: 1, region_stride: 0, addr_stride: 0 });
}

/// Extends `run` by the copy `(region_off, addr, len)` if the result still describes exactly
/// the same bytes: a single copy continued on both sides grows longer; otherwise an equal-length
/// copy at the run's strides (set by its second copy) adds one to its count. Strides are never
/// negative, so [`CopyRun::addr_span`] stays meaningful.
fn absorb(run: &mut CopyRun, region_off: u64, addr: u64, len: u64) -> bool {
    if run.count == 1 && run.region_off + run.len == region_off && run.addr.checked_add(run.len) == Some(addr) {
        run.len += len;
        return true;
    }
    if len != run.len || run.count == u32::MAX {
        return false;
    }
    // The last copy of the run: both positions are real piece addresses, so no overflow.
    let last = u64::from(run.count - 1);
    let last_region = run.region_off + last * run.region_stride;
    let last_addr = run.addr + last * run.addr_stride;
    let (Some(region_stride), Some(addr_stride)) = (region_off.checked_sub(last_region), addr.checked_sub(last_addr))
    else {
        return false;
    };
    if run.count == 1 {
        run.region_stride = region_stride;
        run.addr_stride = addr_stride;
    } else if (region_stride, addr_stride) != (run.region_stride, run.addr_stride) {
        return false;
    }
    run.count += 1;
    true
}

#[cfg(test)]
mod tests {
    use std::fmt::Write as _;

    use proptest::prelude::*;

    use super::*;

    fn d(src: u64, dst: u64, len: u64) -> DescPair {
        DescPair { src, dst, len }
    }

    fn params(max_chunk: u64, merge_runs: bool) -> PlanParams {
        PlanParams { merge_runs, ..PlanParams::new(max_chunk) }
    }

    /// One line per chunk, then one per run: `g`ather or `s`catter,
    /// `region_off<-addr len` and `xcount +region_stride/+addr_stride` for strided runs.
    fn render(p: &Plan) -> String {
        let mut out = format!("total {}\n", p.total_bytes);
        for (i, c) in p.chunks.iter().enumerate() {
            writeln!(out, "chunk {i} bytes {}", c.bytes).unwrap();
            for (tag, runs) in [("g", &c.gather[..]), ("s", &c.scatter[..])] {
                for r in runs {
                    write!(out, "  {tag} {}@{} len {}", r.region_off, r.addr, r.len).unwrap();
                    if r.count != 1 {
                        write!(out, " x{} +{}/+{}", r.count, r.region_stride, r.addr_stride).unwrap();
                    }
                    out.push('\n');
                }
            }
        }
        out
    }

    fn check(descs: &[DescPair], p: PlanParams, want: &str) {
        let got = render(&plan(descs, p).unwrap());
        assert_eq!(got.trim(), want.trim(), "\n--- got ---\n{got}");
    }

    #[test]
    fn runs_never_merge_across_segments() {
        // Two "layers" (registrations) back to back, the same block offset in each: one
        // segment merges the two pieces into a run striding from one layer into the next;
        // with a segment per layer they stay two runs, each inside its registration.
        let layer = 0x10_0000;
        let descs = [d(0x1000, 0x9000_0000 + 0xff000, 4096), d(0x2000, 0x9000_0000 + layer + 0xff000, 4096)];
        let one = plan(&descs, params(1 << 20, true)).unwrap();
        assert_eq!(one.chunks[0].scatter.len(), 1, "one segment: merged into a strided run");
        let two = plan_segmented(&descs, &[0, 1], params(1 << 20, true)).unwrap();
        assert_eq!(two.chunks[0].scatter.len(), 2);
        assert_eq!(two.chunks[0].gather.len(), 2, "neither side merges across");
        // Within one segment nothing changes.
        let same = plan_segmented(&descs, &[3, 3], params(1 << 20, true)).unwrap();
        assert_eq!(same.chunks, one.chunks);
        assert_eq!(plan_segmented(&descs, &[1], params(1 << 20, true)), Err(PlanError::Segments { descs: 2, segs: 1 }));
    }

    #[test]
    fn pair_runs_copy_source_to_destination_with_no_region_between() {
        // Contiguous on both sides: one run; equal pieces at equal strides: one strided run;
        // a source going backwards starts a new run (strides are never negative).
        let descs = [
            d(0x1000, 0x9000, 16),
            d(0x1010, 0x9010, 16),
            d(0x5000, 0x20000, 8),
            d(0x5100, 0x20040, 8),
            d(0x5200, 0x20080, 8),
            d(0x100, 0x30000, 4),
            d(0x200, 0x40000, 0),
        ];
        let runs = pair_runs(&descs, true).unwrap();
        let want = [
            CopyRun { region_off: 0x1000, addr: 0x9000, len: 32, count: 1, region_stride: 0, addr_stride: 0 },
            CopyRun { region_off: 0x5000, addr: 0x20000, len: 8, count: 3, region_stride: 0x100, addr_stride: 0x40 },
            CopyRun { region_off: 0x100, addr: 0x30000, len: 4, count: 1, region_stride: 0, addr_stride: 0 },
        ];
        assert_eq!(runs, want);
        // Unmerged: one run per non-empty pair, as given.
        assert_eq!(pair_runs(&descs, false).unwrap().len(), 6);
        assert!(matches!(pair_runs(&[d(u64::MAX - 3, 0, 8)], true), Err(PlanError::AddressOverflow { .. })));
        assert!(matches!(pair_runs(&[d(0, u64::MAX - 3, 8)], true), Err(PlanError::AddressOverflow { .. })));
    }

    proptest! {
        /// Every byte a pair names is copied exactly once, to its own destination offset.
        #[test]
        fn pair_runs_move_exactly_the_pairs_bytes(pieces in proptest::collection::vec((0u64..64, 1u64..48), 0..40), merge: bool) {
            let mut descs = Vec::new();
            let (mut src, mut dst) = (0u64, 1u64 << 20);
            for (gap, len) in pieces {
                src += gap;
                dst += gap / 2;
                descs.push(d(src, dst, len));
                src += len;
                dst += len;
            }
            let mut want: Vec<(u64, u64)> =
                descs.iter().flat_map(|p| (0..p.len).map(move |i| (p.src + i, p.dst + i))).collect();
            let mut got: Vec<(u64, u64)> = pair_runs(&descs, merge)
                .unwrap()
                .iter()
                .flat_map(|r| {
                    (0..u64::from(r.count)).flat_map(move |k| {
                        (0..r.len).map(move |i| (r.region_off + k * r.region_stride + i, r.addr + k * r.addr_stride + i))
                    })
                })
                .collect();
            want.sort_unstable();
            got.sort_unstable();
            prop_assert_eq!(got, want);
        }
    }

    #[test]
    fn empty_input_and_zero_lengths_give_no_chunks() {
        assert_eq!(plan(&[], PlanParams::new(64)).unwrap(), Plan::default());
        let zeros = [d(1, 2, 0), d(u64::MAX, u64::MAX, 0)];
        assert_eq!(plan(&zeros, PlanParams::new(64)).unwrap(), Plan::default());
    }

    #[test]
    fn zero_length_descriptors_are_skipped() {
        check(
            &[d(100, 200, 8), d(5, 5, 0), d(300, 400, 8)],
            params(1024, false),
            "
total 16
chunk 0 bytes 40
  g 0@100 len 8
  g 32@300 len 8
  s 0@200 len 8
  s 32@400 len 8",
        );
    }

    #[test]
    fn offsets_are_aligned_and_bytes_exclude_trailing_padding() {
        let p = plan(&[d(0, 0, 1), d(10, 10, 33), d(50, 50, 7)], params(1024, false)).unwrap();
        let offs: Vec<_> = p.chunks[0].gather.iter().map(|r| r.region_off).collect();
        assert_eq!(offs, vec![0, 32, 96]);
        assert_eq!(p.chunks[0].bytes, 103);
        let p = plan(&[d(0, 0, 1), d(10, 10, 1)], PlanParams { align: 8, ..params(64, false) }).unwrap();
        assert_eq!(p.chunks[0].bytes, 9);
    }

    #[test]
    fn descriptor_of_exactly_max_chunk_fills_one_chunk() {
        check(
            &[d(1000, 2000, 64)],
            params(64, true),
            "
total 64
chunk 0 bytes 64
  g 0@1000 len 64
  s 0@2000 len 64",
        );
    }

    #[test]
    fn descriptors_filling_a_chunk_exactly_share_it_and_one_more_byte_starts_another() {
        let p = plan(&[d(0, 0, 32), d(100, 100, 32)], params(64, false)).unwrap();
        assert_eq!(p.chunk_sizes().collect::<Vec<_>>(), vec![64]);
        let p = plan(&[d(0, 0, 32), d(100, 100, 33)], params(64, false)).unwrap();
        assert_eq!(p.chunk_sizes().collect::<Vec<_>>(), vec![32, 33]);
    }

    #[test]
    fn alignment_padding_can_push_a_descriptor_into_the_next_chunk() {
        // 40 + 24 = 64 would fit unpadded, but the second slot starts at 64.
        check(
            &[d(0, 0, 40), d(100, 100, 24)],
            params(64, false),
            "
total 64
chunk 0 bytes 40
  g 0@0 len 40
  s 0@0 len 40
chunk 1 bytes 24
  g 0@100 len 24
  s 0@100 len 24",
        );
    }

    #[test]
    fn descriptor_one_byte_over_max_chunk_is_split() {
        check(
            &[d(1000, 5000, 65)],
            params(64, true),
            "
total 65
chunk 0 bytes 64
  g 0@1000 len 64
  s 0@5000 len 64
chunk 1 bytes 1
  g 0@1064 len 1
  s 0@5064 len 1",
        );
    }

    #[test]
    fn huge_descriptor_fills_the_current_chunk_then_spans_several() {
        // 10 bytes already in the chunk: the 184-byte descriptor takes the 32 aligned bytes
        // left, two full chunks, and leaves 24 bytes that the next descriptor packs behind.
        check(
            &[d(0, 0, 10), d(1000, 9000, 184), d(500, 600, 8)],
            params(64, true),
            "
total 202
chunk 0 bytes 64
  g 0@0 len 10
  g 32@1000 len 32
  s 0@0 len 10
  s 32@9000 len 32
chunk 1 bytes 64
  g 0@1032 len 64
  s 0@9032 len 64
chunk 2 bytes 64
  g 0@1096 len 64
  s 0@9096 len 64
chunk 3 bytes 40
  g 0@1160 len 24
  g 32@500 len 8
  s 0@9160 len 24
  s 32@600 len 8",
        );
    }

    #[test]
    fn huge_descriptor_into_a_full_chunk_starts_fresh() {
        let p = plan(&[d(0, 0, 64), d(1000, 1000, 130)], params(64, false)).unwrap();
        assert_eq!(p.chunk_sizes().collect::<Vec<_>>(), vec![64, 64, 64, 2]);
    }

    #[test]
    fn contiguous_descriptors_merge_into_one_copy() {
        let descs: Vec<_> = (0..100).map(|i| d(4096 + 64 * i, 8192 + 64 * i, 64)).collect();
        check(
            &descs,
            params(1 << 20, true),
            "
total 6400
chunk 0 bytes 6400
  g 0@4096 len 6400
  s 0@8192 len 6400",
        );
    }

    #[test]
    fn uniform_strides_merge_into_one_strided_run() {
        // 8-byte descriptors: 32-byte slots in the region, src dense, dst every 100 bytes.
        let descs: Vec<_> = (0..50).map(|i| d(1000 + 8 * i, 7000 + 100 * i, 8)).collect();
        check(
            &descs,
            params(1 << 20, true),
            "
total 400
chunk 0 bytes 1576
  g 0@1000 len 8 x50 +32/+8
  s 0@7000 len 8 x50 +32/+100",
        );
    }

    #[test]
    fn gather_and_scatter_merge_independently() {
        // src contiguous, dst scattered at a constant stride: one long gather copy, one
        // strided scatter run.
        let descs: Vec<_> = (0..4).map(|i| d(64 * i, 10_000 + 1000 * i, 64)).collect();
        check(
            &descs,
            params(4096, true),
            "
total 256
chunk 0 bytes 256
  g 0@0 len 256
  s 0@10000 len 64 x4 +64/+1000",
        );
    }

    #[test]
    fn mixed_patterns_merge_greedily() {
        let descs = [
            d(0, 0, 32),
            d(32, 32, 32),     // contiguous: first copy grows to 64
            d(500, 900, 64),   // same length at strides 64/500 and 64/900
            d(1000, 1800, 64), // same strides again
            d(1, 3, 64),       // backwards on both sides: new run
            d(9000, 9000, 16), // different length: new run
        ];
        check(
            &descs,
            params(4096, true),
            "
total 272
chunk 0 bytes 272
  g 0@0 len 64 x3 +64/+500
  g 192@1 len 64
  g 256@9000 len 16
  s 0@0 len 64 x3 +64/+900
  s 192@3 len 64
  s 256@9000 len 16",
        );
    }

    #[test]
    fn runs_never_merge_across_chunks() {
        let descs: Vec<_> = (0..4).map(|i| d(64 * i, 64 * i, 64)).collect();
        check(
            &descs,
            params(128, true),
            "
total 256
chunk 0 bytes 128
  g 0@0 len 128
  s 0@0 len 128
chunk 1 bytes 128
  g 0@128 len 128
  s 0@128 len 128",
        );
    }

    #[test]
    fn without_merging_each_piece_is_one_run() {
        let descs: Vec<_> = (0..10).map(|i| d(64 * i, 64 * i, 64)).collect();
        let p = plan(&descs, params(1 << 20, false)).unwrap();
        assert_eq!(p.chunks[0].gather.len(), 10);
        assert_eq!(p.chunks[0].scatter.len(), 10);
        assert!(p.chunks[0].gather.iter().all(|r| r.count == 1));
    }

    fn directs(descs: &[DescPair], p: PlanParams) -> Vec<Option<u64>> {
        plan(descs, p).unwrap().chunks.iter().map(|c| c.direct).collect()
    }

    #[test]
    fn a_chunk_is_direct_exactly_when_its_gather_is_one_full_contiguous_copy() {
        let p = params(4096, true);
        // One descriptor; contiguous descriptors merged into one copy.
        assert_eq!(directs(&[d(1000, 9000, 100)], p), vec![Some(1000)]);
        let dense: Vec<_> = (0..8).map(|i| d(2000 + 64 * i, 30_000 - 100 * i, 64)).collect();
        assert_eq!(directs(&dense, p), vec![Some(2000)], "destinations do not matter");
        // Contiguous sources, but alignment padding between them in the region.
        assert_eq!(directs(&[d(0, 0, 40), d(40, 100, 24)], p), vec![None]);
        // Strided or jumping sources.
        let strided: Vec<_> = (0..4).map(|i| d(100 * i, 64 * i, 64)).collect();
        assert_eq!(directs(&strided, p), vec![None]);
        assert_eq!(directs(&[d(64, 0, 64), d(0, 64, 64)], p), vec![None], "backwards");
    }

    #[test]
    fn split_descriptors_give_direct_chunks_only_where_a_piece_fills_a_chunk_alone() {
        // The huge descriptor's pieces fill chunks 1 and 2 alone; chunks 0 and 3 share theirs.
        assert_eq!(
            directs(&[d(0, 0, 10), d(1000, 9000, 184), d(500, 600, 8)], params(64, true)),
            vec![None, Some(1032), Some(1096), None]
        );
        assert_eq!(directs(&[d(1000, 5000, 65)], params(64, true)), vec![Some(1000), Some(1064)]);
    }

    #[test]
    fn unmerged_contiguous_copies_are_direct_too() {
        // Without merging the gather keeps two runs, but they still chain byte for byte.
        let descs = [d(0, 0, 32), d(32, 500, 32)];
        let p = plan(&descs, params(4096, false)).unwrap();
        assert_eq!((p.chunks[0].gather.len(), p.chunks[0].direct), (2, Some(0)));
    }

    #[test]
    fn from_config_uses_chunk_size_and_merging_switch() {
        let cfg = Config { scatter_run_merging: false, ..Config::default() };
        let p = PlanParams::from_config(&cfg);
        assert_eq!(
            p,
            PlanParams {
                max_chunk: cfg.max_chunk_size,
                align: DEFAULT_ALIGN,
                merge_runs: false,
                region_plan_runs: 0,
                split_bytes: cfg.split_bytes,
            }
        );
    }

    const KIB: u64 = 1024;
    const MIB: u64 = 1024 * KIB;

    /// `n` pieces of `len` bytes, sources packed, destinations two pieces apart.
    fn strided(n: u64, len: u64) -> Vec<DescPair> {
        (0..n).map(|i| d(0x10_0000 + i * len, 0x4000_0000 + 2 * i * len, len)).collect()
    }

    #[test]
    fn a_transfer_of_a_few_chunks_is_split_in_up_to_four_equal_parts_when_large_enough() {
        let split = |descs: &[DescPair], split_bytes| {
            let params = PlanParams { split_bytes, ..PlanParams::new(2 * MIB) };
            plan(descs, params).unwrap().chunks.iter().map(|c| c.bytes).collect::<Vec<_>>()
        };
        // 1 MiB of 4 KiB pieces: one chunk unsplit; with a 512 KiB floor two halves, with a
        // 256 KiB floor four quarters (never more than SPLIT_WAYS).
        let one_mib = strided(256, 4 * KIB);
        assert_eq!(split(&one_mib, 0), [MIB]);
        assert_eq!(split(&one_mib, 512 * KIB), [512 * KIB, 512 * KIB]);
        assert_eq!(split(&one_mib, 256 * KIB), [256 * KIB; 4]);
        assert_eq!(split(&one_mib, 128 * KIB), [256 * KIB; 4]);
        // Three ways when the floor allows three and not four.
        assert_eq!(split(&strided(192, 4 * KIB), 256 * KIB), [256 * KIB; 3]);
        // Below twice the floor: untouched.
        assert_eq!(split(&one_mib, 512 * KIB + 1), [MIB]);
        // A KV request (4 MiB) moves in four 1 MiB chunks instead of two of 2 MiB; 3 MiB in
        // four of 768 KiB instead of 2 + 1.
        assert_eq!(split(&strided(1024, 4 * KIB), 512 * KIB), [MIB; 4]);
        assert_eq!(split(&strided(768, 4 * KIB), 512 * KIB), [768 * KIB; 4]);
        assert_eq!(split(&strided(1280, 4 * KIB), 512 * KIB), [1280 * KIB; 4]);
        // A transfer of four full chunks or more already pipelines and keeps its chunks.
        assert_eq!(split(&strided(2048, 4 * KIB), 512 * KIB), [2 * MIB; 4]);
        assert_eq!(split(&strided(2304, 4 * KIB), 512 * KIB), [2 * MIB, 2 * MIB, 2 * MIB, 2 * MIB, MIB]);
        // Padding counts: 256 pieces of 4000 bytes occupy 4032 each at the default alignment.
        let padded = split(&strided(256, 4000), 500 * KIB);
        assert_eq!(padded.len(), 2);
        assert!(padded.iter().all(|&b| b <= 256 * 4032 / 2), "{padded:?}");
    }

    #[test]
    fn bad_params_and_inputs_are_errors() {
        let one = [d(0, 0, 1)];
        let bad_params = [
            (PlanParams { align: 0, ..PlanParams::new(64) }, PlanError::AlignNotPowerOfTwo { align: 0 }),
            (PlanParams { align: 48, ..PlanParams::new(64) }, PlanError::AlignNotPowerOfTwo { align: 48 }),
            (PlanParams::new(0), PlanError::ChunkSmallerThanAlign { max_chunk: 0, align: 32 }),
            (PlanParams::new(31), PlanError::ChunkSmallerThanAlign { max_chunk: 31, align: 32 }),
        ];
        for (p, want) in bad_params {
            assert_eq!(plan(&one, p), Err(want));
        }
        let p = PlanParams::new(64);
        assert_eq!(
            plan(&[d(0, 0, 1), d(u64::MAX - 3, 0, 4)], p),
            Err(PlanError::AddressOverflow { index: 1, side: Side::Src, addr: u64::MAX - 3, len: 4 })
        );
        assert_eq!(
            plan(&[d(0, u64::MAX, 1)], p),
            Err(PlanError::AddressOverflow { index: 0, side: Side::Dst, addr: u64::MAX, len: 1 })
        );
        // Exactly reaching the end of the address space is fine.
        assert!(plan(&[d(u64::MAX - 4, u64::MAX - 4, 4)], p).is_ok());
        let half = 1 << 63;
        assert_eq!(plan(&[d(0, 0, half), d(0, 0, half)], p), Err(PlanError::PayloadOverflow { index: 1 }));
        assert_eq!(plan(&[d(0, 0, 1 << 40)], PlanParams::new(32)), Err(PlanError::TooManyChunks { at_least: 1 << 35 }));
    }

    #[test]
    fn huge_max_chunk_does_not_overflow() {
        let p = PlanParams::new(u64::MAX);
        let descs = [d(0, 0, u64::MAX - 1), d(0, 0, 1)];
        let got = plan(&descs, p).unwrap();
        assert_eq!(got.chunk_sizes().collect::<Vec<_>>(), vec![u64::MAX - 1, 1]);
    }

    #[test]
    fn many_small_descriptors_plan_in_one_pass() {
        // 16384 × 4 KiB dense descriptors into 4 MiB chunks.
        let descs: Vec<_> = (0..16384).map(|i| d(i << 12, (i << 12) + (1 << 40), 4096)).collect();
        let p = plan(&descs, PlanParams::new(4 << 20)).unwrap();
        assert_eq!(p.chunks.len(), 16);
        assert!(p.chunks.iter().all(|c| c.gather.len() == 1 && c.scatter.len() == 1));
    }

    // ---- properties ----

    /// Each region byte of each chunk mapped to its (src byte, dst byte), checking on the way
    /// that gather and scatter copies cover each region byte exactly once and stay within
    /// `bytes`. Sorted, so two plans moving the same bytes compare equal.
    fn byte_mapping(p: &Plan) -> std::result::Result<Vec<(u64, u64)>, String> {
        let mut pairs = Vec::new();
        for (i, c) in p.chunks.iter().enumerate() {
            let expand = |runs: &[CopyRun]| -> std::result::Result<Vec<Option<u64>>, String> {
                let mut map = vec![None; c.bytes as usize];
                for r in runs {
                    let (_, end) = r.region_span().ok_or("bad span")?;
                    if end > c.bytes {
                        return Err(format!("chunk {i}: run {r:?} ends past {}", c.bytes));
                    }
                    for (off, addr, len) in r.copies() {
                        for k in 0..len {
                            let slot = &mut map[(off + k) as usize];
                            if slot.is_some() {
                                return Err(format!("chunk {i}: region byte {} copied twice", off + k));
                            }
                            *slot = Some(addr + k);
                        }
                    }
                }
                Ok(map)
            };
            let gather = expand(&c.gather)?;
            let scatter = expand(&c.scatter)?;
            for (off, (g, s)) in gather.iter().zip(&scatter).enumerate() {
                match (g, s) {
                    (Some(g), Some(s)) => pairs.push((*g, *s)),
                    (None, None) => {}
                    _ => return Err(format!("chunk {i}: byte {off} gathered xor scattered")),
                }
            }
        }
        pairs.sort_unstable();
        Ok(pairs)
    }

    fn input_mapping(descs: &[DescPair]) -> Vec<(u64, u64)> {
        let mut pairs: Vec<_> = descs.iter().flat_map(|d| (0..d.len).map(move |k| (d.src + k, d.dst + k))).collect();
        pairs.sort_unstable();
        pairs
    }

    /// Descriptor lists that often continue contiguously or at a repeated stride, so that
    /// every merge path is exercised, plus arbitrary jumps (also backwards).
    fn descs_strategy() -> impl Strategy<Value = Vec<DescPair>> {
        let step = (0u8..4, 0u64..200, 0u64..4000, 0u64..4000);
        (proptest::collection::vec(step, 0..40), 0u64..200).prop_map(|(steps, first_len)| {
            let mut out: Vec<DescPair> = Vec::with_capacity(steps.len());
            let mut cur = d(10_000, 50_000, first_len);
            let mut stride = (64u64, 128u64);
            for (kind, len, a, b) in steps {
                out.push(cur);
                cur = match kind {
                    0 => d(cur.src + cur.len, cur.dst + cur.len, len),
                    1 => d(cur.src + stride.0, cur.dst + stride.1, cur.len),
                    2 => {
                        stride = (a, b);
                        d(cur.src + a, cur.dst + b, cur.len)
                    }
                    _ => d(a * 3, b * 3, len),
                };
            }
            out.push(cur);
            out
        })
    }

    fn params_strategy() -> impl Strategy<Value = (u64, u64)> {
        (0u32..7).prop_flat_map(|a| {
            let align = 1u64 << a;
            (align..600, Just(align))
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// The region-plan search decides on shapes (one counting pass) and builds only the
        /// packing it chose: a shape is exactly what the packing it stands for would build,
        /// chunk for chunk, merged or not, in one segment or several.
        #[test]
        fn a_shape_is_exactly_the_packing_it_stands_for(
            descs in descs_strategy(),
            (max_chunk, align) in params_strategy(),
            merge_runs: bool,
            seg_every in 0usize..6,
        ) {
            let segs: Vec<u32> = (0..descs.len()).map(|i| i.checked_div(seg_every).unwrap_or(0) as u32).collect();
            let d = Descs { pairs: &descs, segs: &segs, sums: check_input(&descs).unwrap() };
            let params = PlanParams { max_chunk, align, merge_runs, region_plan_runs: 0, split_bytes: 0 };
            let built: Vec<ChunkShape> = packed(d, params).unwrap().chunks.iter().map(ChunkShape::of).collect();
            prop_assert_eq!(shape(d, params).unwrap(), built);
        }

        #[test]
        fn plans_move_exactly_the_input_bytes(
            descs in descs_strategy(),
            (max_chunk, align) in params_strategy(),
            split_bytes in prop_oneof![Just(0u64), 1u64..200],
        ) {
            let want = input_mapping(&descs);
            let mut mappings = Vec::new();
            let mut run_counts = Vec::new();
            for merge_runs in [false, true] {
                let p = plan(&descs, PlanParams { max_chunk, align, merge_runs, region_plan_runs: 0, split_bytes }).unwrap();
                prop_assert_eq!(p.total_bytes, descs.iter().map(|d| d.len).sum::<u64>());
                prop_assert!(p.chunks.len() as u64 >= p.total_bytes.div_ceil(max_chunk));
                for c in &p.chunks {
                    prop_assert!(c.bytes > 0 && c.bytes <= max_chunk, "bytes {}", c.bytes);
                    prop_assert!(!c.gather.is_empty() && !c.scatter.is_empty());
                    if !merge_runs {
                        prop_assert!(c.gather.iter().all(|r| r.count == 1 && r.region_off % align == 0));
                    }
                }
                for c in &p.chunks {
                    // Direct exactly when region byte k comes from source byte `start + k`.
                    let mut src = vec![None; c.bytes as usize];
                    for (off, addr, len) in c.gather.iter().flat_map(CopyRun::copies) {
                        for k in 0..len {
                            src[(off + k) as usize] = Some(addr + k);
                        }
                    }
                    let start = src[0];
                    let contiguous = src.iter().enumerate().all(|(k, a)| *a == start.map(|s| s + k as u64));
                    prop_assert_eq!(c.direct, if contiguous { start } else { None }, "{:?}", c);
                }
                let got = byte_mapping(&p).map_err(TestCaseError::fail)?;
                prop_assert_eq!(&got, &want);
                mappings.push(got);
                run_counts.push(p.chunks.iter().map(|c| c.gather.len() + c.scatter.len()).sum::<usize>());
            }
            prop_assert_eq!(&mappings[0], &mappings[1]);
            prop_assert!(run_counts[1] <= run_counts[0]);
        }

        #[test]
        fn descriptors_that_fit_are_never_split(
            descs in descs_strategy(),
            (max_chunk, align) in params_strategy(),
        ) {
            let p =
                plan(&descs, PlanParams { max_chunk, align, merge_runs: false, region_plan_runs: 0, split_bytes: 0 })
                    .unwrap();
            // Unmerged, the gather runs in chunk order are the pieces in input order.
            let mut pieces = p.chunks.iter().flat_map(|c| c.gather.iter());
            for d in descs.iter().filter(|d| d.len > 0) {
                let (mut covered, mut n) = (0, 0u64);
                while covered < d.len {
                    let r = pieces.next().unwrap();
                    prop_assert_eq!(r.addr, d.src + covered);
                    covered += r.len;
                    n += 1;
                }
                prop_assert_eq!(covered, d.len);
                let most = if d.len <= max_chunk { 1 } else { d.len.div_ceil(max_chunk) + 1 };
                prop_assert!(n <= most, "{:?} in {} pieces", d, n);
            }
            prop_assert!(pieces.next().is_none());
        }
    }
}

#[cfg(test)]
mod region_plan_tests {
    use super::*;
    use crate::wire::region_plan::{plan_bytes, plan_offset};

    /// 16384 scattered 4 KiB pieces in 32 MiB chunks, each chunk carrying its ~5,000-run plan:
    /// every chunk's region (data, padding, plan) still fits 32 MiB, the plan fills its end
    /// exactly, its runs read only the data, no chunk is direct, and all pieces are planned (a
    /// last chunk with fewer runs than the threshold keeps them out of its region).
    #[test]
    fn chunks_make_room_for_their_plans_and_never_outgrow_max_chunk() {
        const MIB: u64 = 1 << 20;
        let descs: Vec<DescPair> = (0..16384u64)
            .map(|i| DescPair { src: (1 << 40) | (i * 4096), dst: (1 << 41) | ((i * 7919 % 32768) * 4096), len: 4096 })
            .collect();
        let params = PlanParams { region_plan_runs: 64, ..PlanParams::new(32 * MIB) };
        let p = plan(&descs, params).unwrap();
        assert!(p.chunks.len() >= 3, "the plans take room: {} chunks", p.chunks.len());
        let (mut pieces, mut planned) = (0, 0);
        for c in &p.chunks {
            let runs = c.scatter.len() as u32;
            pieces += c.scatter.iter().map(|r| u64::from(r.count)).sum::<u64>();
            let Some(off) = c.region_plan else {
                assert!(runs < 64, "a chunk of {runs} runs kept its plan out of its region");
                continue;
            };
            planned += 1;
            assert!(c.bytes <= 32 * MIB && c.direct.is_none());
            assert_eq!(plan_offset(c.bytes, runs), Some(off));
            assert_eq!(off + plan_bytes(runs), c.bytes);
            assert!(c.scatter.iter().chain(c.gather.iter()).all(|r| r.region_span().unwrap().1 <= off));
        }
        assert_eq!(pieces, 16384);
        assert!(planned >= 2, "{planned} chunks carry their plans");
        // Even chunks, not two full ones and a sliver (they overlap their copies better).
        let data: Vec<u64> = p.chunks.iter().map(Chunk::data_bytes).collect();
        let (lo, hi) = (data.iter().min().unwrap(), data.iter().max().unwrap());
        assert!(hi - lo <= 64 * 4096, "uneven chunks: {data:?}");
        // Below the threshold, or with it off, nothing changes.
        let off = plan(&descs, PlanParams::new(32 * MIB)).unwrap();
        assert!(off.chunks.iter().all(|c| c.region_plan.is_none()) && off.chunks.len() == 2);
        let few = plan(&descs, PlanParams { region_plan_runs: 1 << 20, ..params }).unwrap();
        assert_eq!(few, off);
    }
}

#[cfg(test)]
mod region_plan_threshold_tests {
    use super::*;

    /// 4096 x 16 KiB with destinations in a shuffled layout whose neighbours often share a
    /// stride (runs of two pieces): two 32 MiB chunks hold ~1,280 runs each, three even ones
    /// ~850. With the threshold at 1024 the plans cannot ride in the regions of either packing
    /// that fits, and the plan stays the plain two chunks, not three chunks without plans.
    #[test]
    fn room_for_plans_is_not_made_when_no_chunk_could_carry_one() {
        let slot = |i: u64| (i * 2 + (i / 2) % 2 * 4096) % 8192;
        let descs: Vec<DescPair> =
            (0..4096u64).map(|i| DescPair { src: i * 16384, dst: (1 << 40) + slot(i) * 16384, len: 16384 }).collect();
        let plain = plan(&descs, PlanParams::new(32 << 20)).unwrap();
        let runs: Vec<usize> = plain.chunks.iter().map(|c| c.scatter.len()).collect();
        let threshold = u32::try_from(runs.iter().min().unwrap() - 1).unwrap();
        // A threshold just under the two chunks' runs: any smaller packing has fewer runs.
        let p = plan(&descs, PlanParams { region_plan_runs: threshold, ..PlanParams::new(32 << 20) }).unwrap();
        // The packing with room for plans has three chunks of fewer runs, none at the threshold.
        let three = plan(&descs, PlanParams::new(22 << 20)).unwrap();
        assert!(three.chunks.len() == 3 && three.chunks.iter().all(|c| (c.scatter.len() as u32) < threshold));
        assert_eq!(p, plain, "runs of the plain chunks {runs:?}");
        let high = plan(&descs, PlanParams { region_plan_runs: 1 << 20, ..PlanParams::new(32 << 20) }).unwrap();
        assert_eq!(high, plain);
    }
}
