//! The event types the endpoint and both roles share (quinn-proto's `shared.rs`): the
//! [`Action`]s the shell performs, the [`JobId`]s it reports back, the errors of submissions and
//! peer input, the counters, and the per-call `Ctx` a role borrows.
//!
//! They live apart from [`crate::endpoint`] so the roles ([`crate::sender`], [`crate::receiver`])
//! can use them without importing the endpoint that owns the roles: dependencies point one way,
//! endpoint -> roles -> event.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use thiserror::Error;
use tracing::trace;

use crate::plan::{Plan, PlanError};
use crate::proof::ProvenRanges;
use crate::scheduler::arenas::ArenaSchedulers;
use crate::scheduler::{CreditScheduler, SchedError};
use crate::types::{ArenaId, ChunkIdx, CopyRun, PeerId, Region, XferId};
use crate::wire;

/// The copy runs of a gather or scatter: its own, or one chunk's of a prepared plan shared
/// with the shell, so that a post copies none of a chunk's thousands of runs and an engine may
/// keep what it derives from them (a device copy, say) for as long as the plan lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JobRuns {
    /// Runs of this job alone (a scatter's).
    Own(Vec<CopyRun>),
    /// A READ target's gather: the runs its flow keeps from the PULL, shared so that starting
    /// a gather of thousands of runs copies none of them.
    Pulled(Arc<Vec<CopyRun>>),
    /// The gather runs of chunk `chunk` of `plan`.
    Chunk {
        /// The prepared plan.
        plan: Arc<Plan>,
        /// The chunk's index in it.
        chunk: usize,
    },
    /// The scatter runs of chunk `chunk` of `plan`: a READ initiator's local scatter.
    ChunkScatter {
        /// The prepared plan.
        plan: Arc<Plan>,
        /// The chunk's index in it.
        chunk: usize,
    },
}

impl JobRuns {
    /// True when the job names a chunk its plan does not have: it has no runs, and a copy
    /// engine must fail it rather than report an empty copy done.
    pub fn names_a_missing_chunk(&self) -> bool {
        match self {
            Self::Own(_) | Self::Pulled(_) => false,
            Self::Chunk { plan, chunk } | Self::ChunkScatter { plan, chunk } => plan.chunks.get(*chunk).is_none(),
        }
    }

    /// The runs.
    pub fn runs(&self) -> &[CopyRun] {
        match self {
            Self::Own(runs) => runs,
            Self::Pulled(runs) => runs,
            Self::Chunk { plan, chunk } => plan.chunks.get(*chunk).map_or(&[], |c| &c.gather),
            Self::ChunkScatter { plan, chunk } => plan.chunks.get(*chunk).map_or(&[], |c| &c.scatter),
        }
    }

    /// For a chunk whose scatter runs travel in its region: where their plan goes in the
    /// region ([`crate::wire::region_plan`]) and the runs to encode there.
    pub fn region_plan(&self) -> Option<(u64, &[CopyRun])> {
        match self {
            Self::Own(_) | Self::Pulled(_) | Self::ChunkScatter { .. } => None,
            Self::Chunk { plan, chunk } => plan.chunks.get(*chunk).and_then(|c| Some((c.region_plan?, &c.scatter[..]))),
        }
    }
}

impl std::ops::Deref for JobRuns {
    type Target = [CopyRun];

    fn deref(&self) -> &[CopyRun] {
        self.runs()
    }
}

/// A scatter whose runs lie in its region (a [`crate::wire::region_plan`]) and have not been
/// checked: the copy engine reads them into memory of its own, checks them with
/// [`crate::wire::region_plan::check`] (or the same predicate on the device) against the data
/// before `offset` and the ranges in `allowed`, and scatters by that copy, or copies nothing
/// and reports failure.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InRegionPlan {
    /// Where the plan starts in the region; also how many bytes of data precede it.
    pub offset: u64,
    /// Runs in the plan.
    pub runs: u32,
    /// The registrations the flow proved, as they are when the DATA came: the runs may write
    /// there only.
    pub allowed: ProvenRanges,
}

/// Identifier of one gather, write or scatter job; unique within an [`Endpoint`](crate::endpoint::Endpoint).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct JobId(pub u64);

/// Something the shell must do for the endpoint, drained with [`Endpoint::poll_action`](crate::endpoint::Endpoint::poll_action).
///
/// Jobs ([`Action::Gather`], [`Action::Write`], [`Action::Scatter`]) *MUST* each be reported
/// back exactly once through the matching `handle_*_done` call, even after the transfer failed,
/// the peer was lost or the endpoint shut down: until then the arena region stays allocated,
/// because the copy engine or the NIC may still touch it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
pub enum Action {
    /// Send `msg` to `peer` (the shell wraps it into a [`wire::Frame`] with its session).
    Send {
        /// Destination peer.
        peer: PeerId,
        /// The control message.
        msg: wire::Msg,
    },
    /// Copy user source memory into the local arena `region`; each run's `region_off` is
    /// relative to `region.offset` and its `addr` is the source address. Report with
    /// [`Endpoint::handle_gather_done`](crate::endpoint::Endpoint::handle_gather_done).
    Gather {
        /// The job to report.
        job: JobId,
        /// The transfer the chunk belongs to.
        xfer: XferId,
        /// The local arena of the staging region.
        arena: ArenaId,
        /// Local staging region (a whole buddy block; the runs cover at most the chunk bytes).
        region: Region,
        /// Copies source -> region, and for a chunk with a [`Chunk::region_plan`] the plan to
        /// write behind its data (see [`JobRuns::region_plan`]).
        ///
        /// [`Chunk::region_plan`]: crate::plan::Chunk::region_plan
        runs: JobRuns,
    },
    /// One RDMA write of `len` bytes from `source` (a staged local arena region, or user memory
    /// for a [`crate::plan::Chunk::direct`] chunk) to the peer's arena region `remote`. Report
    /// with [`Endpoint::handle_write_done`](crate::endpoint::Endpoint::handle_write_done) once the data is visible at the target (or the
    /// write failed).
    Write {
        /// The job to report.
        job: JobId,
        /// The transfer the chunk belongs to.
        xfer: XferId,
        /// The peer whose arena is written.
        peer: PeerId,
        /// Where the `len` bytes are read from.
        source: WriteSource,
        /// The local arena a [`WriteSource::Arena`] region lies in.
        arena: ArenaId,
        /// The peer's arena written (the one the transfer's WANT named).
        remote_arena: ArenaId,
        /// Target region in the peer's arena, as granted.
        remote: Region,
        /// Bytes to write: the chunk size (at most both region lengths).
        len: u64,
    },
    /// Copy the local arena `region` out to user destinations; the runs were validated against
    /// the region, the chunk and the registered memory. Report with
    /// [`Endpoint::handle_scatter_done`](crate::endpoint::Endpoint::handle_scatter_done).
    Scatter {
        /// The job to report.
        job: JobId,
        /// The peer that wrote the chunk.
        peer: PeerId,
        /// The peer's transfer.
        xfer: XferId,
        /// The local arena of the region.
        arena: ArenaId,
        /// Local arena region holding the chunk.
        region: Region,
        /// Copies region -> destination; `addr` is the destination address: a DATA's (own),
        /// or a READ initiator's plan chunk (shared). Empty when `in_region` is set.
        runs: JobRuns,
        /// The runs lie in the region behind the chunk's data, unchecked: the copy engine
        /// checks them (see [`InRegionPlan`]) and copies nothing when they fail.
        in_region: Option<InRegionPlan>,
        /// The chunk's bytes, from its WANT ([`wire::Inline`]): put into `region` first, then
        /// scattered. A shell that cannot put them there fails the job without copying.
        inline: Option<Vec<u8>>,
    },
    /// Send a link-level frame (a PING or PONG of the liveness probe) to `peer`; the shell wraps
    /// `body` into a [`wire::ControlFrame`] with its session. No transfer depends on its
    /// delivery: a lost PING is followed by another.
    Link {
        /// Destination peer.
        peer: PeerId,
        /// What to send.
        body: wire::Body,
    },
    /// One RDMA READ of `len` bytes of the peer's arena region `remote` (a READ flow's chunk,
    /// announced ready) into our arena's staging region `local`. Report with
    /// [`Endpoint::handle_read_done`](crate::endpoint::Endpoint::handle_read_done) once the
    /// bytes are in `local` (or the read failed).
    Read {
        /// The job to report.
        job: JobId,
        /// The transfer the chunk belongs to.
        xfer: XferId,
        /// The peer whose arena is read.
        peer: PeerId,
        /// The peer's arena read (the one the transfer's PULLs named).
        remote_arena: ArenaId,
        /// The ready region in the peer's arena.
        remote: Region,
        /// Our arena of the staging region.
        arena: ArenaId,
        /// Our staging region.
        local: Region,
        /// Bytes to read: the chunk size.
        len: u64,
    },
    /// Write one mailbox record (a one-way flow's answer, see [`crate::oneway`]) into our own
    /// arena at `offset` (from the arena's base), with one 64-byte copy, in the order emitted.
    PutRecord {
        /// Byte offset from the arena's base.
        offset: u64,
        /// The record.
        bytes: [u8; crate::mailbox::RECORD_LEN],
    },
    /// A submitted transfer ended; emitted exactly once per successfully submitted transfer.
    Complete {
        /// The transfer.
        xfer: XferId,
        /// Its outcome.
        outcome: Result<(), XferError>,
    },
}

/// The local side of an [`Action::Write`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WriteSource {
    /// A staging region of the local arena, gathered before the write.
    Arena(Region),
    /// User memory at `addr`: a direct chunk, written unstaged from its source
    /// ([`crate::plan::Chunk::direct`]); the shell resolves the registration covering
    /// `[addr, addr + len)`.
    User {
        /// Source address of the chunk's first byte.
        addr: u64,
    },
}

/// Why a submitted transfer failed.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum XferError {
    /// No progress (grant, ack or job completion) for the request timeout, or a credit went
    /// stale before its chunk could be written.
    #[error("no progress within the request timeout")]
    Timeout,
    /// The peer was lost: the transport reports it gone, it said GOODBYE, or NIXL unloaded or
    /// reloaded it.
    #[error("peer lost")]
    PeerLost,
    /// The peer showed no sign of life for the liveness probe's bound (no PONG to our PINGs):
    /// declared dead here, though it may only be stalled. Told apart from [`Self::PeerLost`]
    /// because NIXL drops a peer whose transfer ends in `ERR_REMOTE_DISCONNECT` (unloads its
    /// metadata for every backend), which a stall of two seconds must not cost.
    #[error("the peer answered no PING within the probe's bound")]
    Unresponsive,
    /// The peer unloaded our metadata while the transfer was in flight (its FORGET, see
    /// [`crate::forget`]): it reclaimed the transfer's flow. The peer is still loaded here, and
    /// the transfer posted again goes one way.
    #[error("the peer unloaded our metadata")]
    Forgotten,
    /// The application canceled the transfer.
    #[error("canceled")]
    Canceled,
    /// The receiver refused a chunk's DATA (its runs failed validation).
    #[error("refused by the receiver")]
    Refused,
    /// A gather copy failed.
    #[error("gather failed")]
    GatherFailed,
    /// The RDMA write failed.
    #[error("write failed")]
    WriteFailed,
    /// A READ of a target's region into our staging failed.
    #[error("RDMA read failed")]
    ReadFailed,
    /// The receiver reported that its scatter copy failed.
    #[error("scatter failed at the receiver")]
    ScatterFailed,
    /// The endpoint is shutting down.
    #[error("shutting down")]
    ShuttingDown,
    /// The application deregistered memory the transfer reads (a gather or direct-write
    /// source) or a chunk of it was being scattered into.
    #[error("memory of the transfer was deregistered")]
    Deregistered,
    /// Every byte landed, but the notification the application gave with the transfer could
    /// not be sent (the shell's to report: the peer's application would wait for it forever).
    #[error("the transfer's notification could not be sent")]
    NotifFailed,
    /// The descriptors could not be planned (for the shell, which plans before submitting).
    #[error(transparent)]
    Plan(#[from] PlanError),
}

/// Why [`Endpoint::submit`](crate::endpoint::Endpoint::submit) refused a transfer; a refused transfer gets no
/// [`Action::Complete`].
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum SubmitError {
    /// [`Endpoint::shutdown`](crate::endpoint::Endpoint::shutdown) was called.
    #[error("the endpoint is shutting down")]
    ShuttingDown,
    /// The id is in flight or finished too recently (ids must never be reused).
    #[error("transfer {} is already known", .xfer.0)]
    DuplicateXfer {
        /// The id.
        xfer: XferId,
    },
    /// The plan stages in an arena this engine does not have ([`Plan::local_arena`]).
    #[error("transfer {} stages in arena {}, which this engine does not have", .xfer.0, .arena.0)]
    NoSuchArena {
        /// The transfer.
        xfer: XferId,
        /// The arena the plan names.
        arena: ArenaId,
    },
    /// The plan has no chunks.
    #[error("transfer {} has an empty plan", .xfer.0)]
    EmptyPlan {
        /// The transfer.
        xfer: XferId,
    },
    /// More chunks than one WANT can announce.
    #[error("transfer {} has {chunks} chunks, more than {max}", .xfer.0)]
    TooManyChunks {
        /// The transfer.
        xfer: XferId,
        /// Chunks in the plan.
        chunks: usize,
        /// [`wire::MAX_CHUNKS_PER_WANT`].
        max: u32,
    },
    /// More destination registrations than one WANT can prove.
    #[error("transfer {} writes into {dests} registrations, more than {max}", .xfer.0)]
    TooManyDestinations {
        /// The transfer.
        xfer: XferId,
        /// Destination registrations in the plan.
        dests: usize,
        /// [`wire::MAX_PROOFS`].
        max: u32,
    },
    /// A chunk is larger than the configured maximum chunk size.
    #[error("transfer {}: chunk #{} of {bytes} bytes exceeds the max chunk size ({max} bytes)", .xfer.0, .chunk.0)]
    ChunkTooLarge {
        /// The transfer.
        xfer: XferId,
        /// The chunk.
        chunk: ChunkIdx,
        /// Its size.
        bytes: u64,
        /// [`Config::max_chunk_size`](crate::config::Config::max_chunk_size).
        max: u64,
    },
    /// A chunk is empty, has no copy runs, has a degenerate run, or has too many runs for one
    /// DATA message.
    #[error("transfer {}: chunk #{} is malformed", .xfer.0, .chunk.0)]
    BadChunk {
        /// The transfer.
        xfer: XferId,
        /// The chunk.
        chunk: ChunkIdx,
    },
}

impl DataFault {
    /// Whether the DATA named a region its flow held and was refused for its scatter runs.
    pub fn is_about_runs(&self) -> bool {
        !matches!(self, Self::NotHeld | Self::RegionMismatch | Self::ChunkMismatch)
    }
}

/// What is wrong with a DATA message (see [`ProtocolError::InvalidData`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum DataFault {
    /// The flow does not hold the region, or it is already being scattered, or the flow is a
    /// READ's (its regions are READ by its initiator, never scattered from).
    NotHeld,
    /// The region's length differs from the granted one.
    RegionMismatch,
    /// The chunk index differs from the one the region was granted for.
    ChunkMismatch,
    /// No runs.
    NoRuns,
    /// More runs than [`wire::MAX_RUNS`].
    TooManyRuns,
    /// Run `index` is degenerate (zero count or length) or its span overflows.
    BadRun {
        /// Position of the run.
        index: usize,
    },
    /// Run `index` reads beyond the chunk's bytes (or the region).
    RunOutsideChunk {
        /// Position of the run.
        index: usize,
    },
    /// Run `index` writes outside every registration the flow's WANTs proved (or one proved
    /// but deregistered since).
    RunOutsideRegistered {
        /// Position of the run.
        index: usize,
    },
    /// The runs copy more bytes in total than the chunk holds: the work a DATA may cause is
    /// bounded by its chunk, whatever its counts and strides say.
    TooManyBytes {
        /// Bytes the runs would copy (saturated at `u64::MAX`).
        copies: u64,
        /// Bytes of the chunk.
        chunk: u64,
    },
}

/// Peer input that breaks the protocol. The message was ignored (or, for DATA, refused) and the
/// endpoint stays consistent; the shell should log it at `warn`.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum ProtocolError {
    /// A GRANT or ACK names a transfer this endpoint never had (or forgot long ago).
    #[error("peer {}: unknown transfer {}", .peer.0, .xfer.0)]
    UnknownXfer {
        /// The sending peer.
        peer: PeerId,
        /// The transfer named.
        xfer: XferId,
    },
    /// A GRANT or ACK for a transfer that goes to another peer.
    #[error("peer {}: transfer {} belongs to peer {}", .got.0, .xfer.0, .expected.0)]
    WrongPeer {
        /// The transfer named.
        xfer: XferId,
        /// Its peer.
        expected: PeerId,
        /// The sending peer.
        got: PeerId,
    },
    /// A GRANT or ACK whose token is not its transfer's, or a DATA, cancel or further WANT
    /// whose token is not its flow's: a forgery (or a frame of another incarnation). Dropped
    /// and counted in [`Stats::control_forged`]; nothing of the transfer or flow changed.
    #[error("peer {}: wrong token for transfer {}", .peer.0, .xfer.0)]
    WrongToken {
        /// The sending peer.
        peer: PeerId,
        /// The transfer named.
        xfer: XferId,
    },
    /// A WANT whose destination proofs do not check out: the sender does not hold the
    /// metadata of a registration it names. Refused whole, counted in
    /// [`Stats::control_forged`].
    #[error("peer {}: WANT for transfer {} refused: {source}", .peer.0, .xfer.0)]
    BadProof {
        /// The sending peer.
        peer: PeerId,
        /// The transfer.
        xfer: XferId,
        /// The first bad proof.
        source: crate::proof::BadProof,
    },
    /// A GRANT without credits.
    #[error("transfer {}: empty GRANT", .xfer.0)]
    EmptyGrant {
        /// The transfer.
        xfer: XferId,
    },
    /// A chunk index beyond the transfer's plan.
    #[error("transfer {}: chunk #{} out of range ({chunks} chunks)", .xfer.0, .chunk.0)]
    ChunkOutOfRange {
        /// The transfer.
        xfer: XferId,
        /// The chunk named.
        chunk: ChunkIdx,
        /// Chunks in the plan.
        chunks: usize,
    },
    /// A second credit for a chunk.
    #[error("transfer {}: duplicate credit for chunk #{}", .xfer.0, .chunk.0)]
    DuplicateCredit {
        /// The transfer.
        xfer: XferId,
        /// The chunk.
        chunk: ChunkIdx,
    },
    /// A credit whose region cannot hold the chunk (or wraps the address space).
    #[error("transfer {}: credit {region} for chunk #{} cannot hold {bytes} bytes", .xfer.0, .chunk.0)]
    BadCredit {
        /// The transfer.
        xfer: XferId,
        /// The chunk.
        chunk: ChunkIdx,
        /// The granted region.
        region: Region,
        /// The chunk size.
        bytes: u64,
    },
    /// An ACK for a chunk whose DATA was not sent, or naming another region.
    #[error("transfer {}: unexpected ACK for chunk #{}", .xfer.0, .chunk.0)]
    UnexpectedAck {
        /// The transfer.
        xfer: XferId,
        /// The chunk.
        chunk: ChunkIdx,
    },
    /// A WANT the scheduler cannot queue (a zero-size or oversized chunk, too many chunks).
    #[error("peer {}: bad WANT for transfer {}: {source}", .peer.0, .xfer.0)]
    BadWant {
        /// The sending peer.
        peer: PeerId,
        /// The transfer.
        xfer: XferId,
        /// The scheduler's reason.
        source: SchedError,
    },
    /// A WANT whose standing claim ([`crate::wire::Standing::Claim`]) names no standing flow
    /// of the peer with a region idle and large enough for its chunk 0; refused.
    #[error("peer {}: WANT for transfer {} claims no usable standing credit", .peer.0, .xfer.0)]
    BadClaim {
        /// The sending peer.
        peer: PeerId,
        /// The transfer.
        xfer: XferId,
    },
    /// A WANT adding chunks to a standing flow (which keeps its one), a second standing flow
    /// under a live flow's id, or a WANT or PULL whose id lies in the other kind's space (a
    /// standing flow's carries [`crate::sender::STANDING_XFER_BIT`], a transfer's never);
    /// ignored.
    #[error("peer {}: WANT for standing flow {} ignored", .peer.0, .xfer.0)]
    StandingWant {
        /// The sending peer.
        peer: PeerId,
        /// The flow.
        xfer: XferId,
    },
    /// A WANT or PULL that would open again a flow that ended here: a captured frame sent
    /// again (its proofs, made with its own token, still check out), whose DATA would scatter
    /// whatever its region holds now into the old transfer's destinations. Ignored, counted in
    /// [`Stats::control_replayed`].
    #[error("peer {}: transfer {} already ended here: a replay, ignored", .peer.0, .xfer.0)]
    Replayed {
        /// The sending peer.
        peer: PeerId,
        /// The transfer named.
        xfer: XferId,
    },
    /// A WANT naming a live READ flow (the mirror of a PULL for a WRITE flow); ignored.
    #[error("peer {}: WANT for transfer {}, a READ flow", .peer.0, .xfer.0)]
    WantForReadFlow {
        /// The sending peer.
        peer: PeerId,
        /// The flow.
        xfer: XferId,
    },
    /// A WANT or PULL naming an arena this receiver does not have, or not the one its flow
    /// lies in; refused.
    #[error("peer {}: transfer {} names arena {} (not ours, or not its flow's)", .peer.0, .xfer.0, .arena.0)]
    WrongArena {
        /// The sending peer.
        peer: PeerId,
        /// The transfer.
        xfer: XferId,
        /// The arena it named.
        arena: crate::types::ArenaId,
    },
    /// A WANT that would take the peer over [`crate::receiver::MAX_FLOWS_PER_PEER`] open flows
    /// or [`crate::receiver::MAX_CHUNKS_PER_PEER`] announced chunks; dropped unqueued.
    #[error("peer {}: WANT for transfer {} refused: {flows} open flows, {chunks} announced chunks would exceed the per-peer caps", .peer.0, .xfer.0)]
    PeerOverLimit {
        /// The sending peer.
        peer: PeerId,
        /// The transfer.
        xfer: XferId,
        /// Open flows the peer would have.
        flows: usize,
        /// Announced chunks the peer would have.
        chunks: u64,
    },
    /// A WANT or PULL that would take all peers' announced chunks together over
    /// [`crate::receiver::MAX_CHUNKS_TOTAL`]; refused (answered ACK(Refused)).
    #[error("peer {}: transfer {} refused: {chunks} chunks announced by all peers would exceed the receiver's cap", .peer.0, .xfer.0)]
    OverTotalLimit {
        /// The sending peer.
        peer: PeerId,
        /// The transfer.
        xfer: XferId,
        /// Announced chunks all peers would have.
        chunks: u64,
    },
    /// A one-way WANT (answers through our mailbox) that got no mailbox slot and cannot wait
    /// for one: we keep no mailbox, or the queue of WANTs waiting for a slot is at its bound
    /// (see [`crate::oneway::Answering`]). Dropped; its sender times out.
    #[error("peer {}: one-way WANT for transfer {} dropped: no mailbox slot", .peer.0, .xfer.0)]
    NoMailboxSlot {
        /// The sending peer.
        peer: PeerId,
        /// The transfer.
        xfer: XferId,
    },
    /// A PULL this target will not serve: its runs read outside the chunk or the registrations
    /// it proved, or it names a flow that exists. Refused whole (answered ACK(Refused)).
    #[error("peer {}: bad PULL for transfer {}: {why}", .peer.0, .xfer.0)]
    BadPull {
        /// The sending peer.
        peer: PeerId,
        /// The transfer.
        xfer: XferId,
        /// The rule it broke.
        why: &'static str,
    },
    /// A RELEASE naming a region its READ flow does not hold ready (or a flow that is no READ).
    #[error("peer {}: RELEASE for transfer {} chunk #{} names no ready region", .peer.0, .xfer.0, .chunk.0)]
    BadRelease {
        /// The sending peer.
        peer: PeerId,
        /// The transfer.
        xfer: XferId,
        /// The chunk.
        chunk: ChunkIdx,
    },
    /// A CURSOR claiming more records read than were written for the flow; ignored.
    #[error("peer {}: CURSOR for transfer {} is past the records written", .peer.0, .xfer.0)]
    BadCursor {
        /// The sending peer.
        peer: PeerId,
        /// The transfer.
        xfer: XferId,
    },
    /// A DATA that failed validation: it was dropped, answered with ACK(Refused), and the flow
    /// was reclaimed.
    #[error("peer {}: invalid DATA for transfer {} chunk #{}: {fault:?}", .peer.0, .xfer.0, .chunk.0)]
    InvalidData {
        /// The sending peer.
        peer: PeerId,
        /// The transfer.
        xfer: XferId,
        /// The chunk named.
        chunk: ChunkIdx,
        /// What is wrong.
        fault: DataFault,
    },
}

/// Counters of an [`Endpoint`](crate::endpoint::Endpoint), for observability and tests. All only ever grow.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Stats {
    /// Transfers accepted by [`Endpoint::submit`](crate::endpoint::Endpoint::submit).
    pub submitted: u64,
    /// Transfers completed successfully.
    pub completed: u64,
    /// Transfers that failed (any [`XferError`], cancellation included).
    pub failed: u64,
    /// WRITEs held back at submission behind a cancel of ours to the same peer that still
    /// waited for its transfer's writes (see [`Endpoint::submit_write`](crate::endpoint::Endpoint::submit_write)).
    pub writes_deferred: u64,
    /// READs held back so (see [`Endpoint::submit_read`](crate::endpoint::Endpoint::submit_read)).
    pub reads_deferred: u64,
    /// Failures by [`XferError::Timeout`].
    pub timeouts: u64,
    /// Failures by [`XferError::Canceled`].
    pub canceled: u64,
    /// Failures by [`XferError::Refused`].
    pub refused: u64,
    /// Chunks written and announced by DATA.
    pub chunks_written: u64,
    /// Chunk bytes written.
    pub bytes_written: u64,
    /// Of [`chunks_written`](Self::chunks_written), those written straight from user memory
    /// (direct chunks, no gather).
    pub chunks_direct: u64,
    /// GRANT or ACK messages for recently finished transfers, ignored.
    pub late_msgs: u64,
    /// WANT messages queued (cancels excluded).
    pub wants: u64,
    /// Credits granted to remote flows.
    pub credits_granted: u64,
    /// Chunks scattered successfully.
    pub chunks_scattered: u64,
    /// Chunk bytes scattered successfully.
    pub bytes_scattered: u64,
    /// Scatter jobs that failed.
    pub scatters_failed: u64,
    /// DATAs held until the scatters their peer left running when its flows ended here had
    /// ended (see the receiver's `order`): the peer's next bytes land after its released ones.
    pub scatters_held: u64,
    /// READ regions whose gather waited the same way: a peer's READ posted after its release
    /// reads what the released write left, not its bytes half landed.
    pub gathers_held: u64,
    /// DATA messages refused by validation.
    pub data_refused: u64,
    /// Of [`data_refused`](Self::data_refused), those for a region their flow held (or a WANT's
    /// inline chunk), refused for their scatter runs (a run outside the chunk or the
    /// registrations the flow proved, a degenerate one, too many runs or bytes): the checks a
    /// forged scatter meets.
    pub data_runs_refused: u64,
    /// DATA messages for unknown (canceled or reclaimed) flows, dropped silently.
    pub late_data: u64,
    /// Remote flows reclaimed because their sender went silent.
    pub flows_timed_out: u64,
    /// Remote flows dropped before their first grant because their peer let another flow's
    /// grant lapse and had used no grant since (see [`crate::endpoint::Endpoint`]'s timeouts).
    pub flows_dropped_unserved: u64,
    /// Arena regions put in quarantine: reclaimed from a flow whose writer went silent or was
    /// lost, and kept from every flow for a quarter of the request timeout.
    pub regions_quarantined: u64,
    /// Peer messages rejected with a [`ProtocolError`].
    pub protocol_errors: u64,
    /// Admitted frames peers sent on their own initiative, valid or not: HELLOs, PINGs, and the
    /// messages of their transfers handled in our target role (WANT, PLAN, DATA, PULL, RELEASE,
    /// CURSOR, KEEP); not the GRANTs, ACKs and PONGs that answer ours. The shell watches it to
    /// tell an engine that peers address, which must look often for their frames (they come
    /// unannounced), from one that only starts transfers of its own.
    pub peer_msgs: u64,
    /// Frames that looked valid but were not authentic: a wrong transfer token
    /// ([`ProtocolError::WrongToken`]), a bad destination proof ([`ProtocolError::BadProof`])
    /// or, through
    /// [`Endpoint::handle_frame`](crate::endpoint::Endpoint::handle_frame), a session other
    /// than the one in the peer's loaded capabilities.
    pub control_forged: u64,
    /// Frames proven to come from the peer they name: a transfer's own token matched (a GRANT,
    /// ACK or READY to our transfer; a DATA, PLAN, KEEP or RELEASE of a flow here), a WANT's or
    /// PULL's destination proofs verified, a PONG echoed a nonce only the peer saw. A shell
    /// whose frames come over connections anyone can open counts the connections that carried
    /// one as a peer's, and closes the others first under a flood (the ZMQ channel).
    pub frames_authentic: u64,
    /// WANTs and opening PULLs for a transfer whose flow already ended here
    /// ([`ProtocolError::Replayed`]): captured frames sent again. Ignored; not in
    /// `control_forged` (the frame is authentic, only late).
    pub control_replayed: u64,
    /// Control frames refused by the peer rules or the decoder
    /// ([`crate::peers::FrameRefused`] other than a protocol error).
    pub frames_refused: u64,
    /// PINGs sent to silent peers we wait on ([`crate::liveness`]).
    pub pings_sent: u64,
    /// PONGs that answered one of our PINGs.
    pub pongs_received: u64,
    /// Asks sent about peers' HELLOs (our HELLO and a PING only the peer can answer; repeats
    /// included, see [`crate::hello`]).
    pub hello_asks: u64,
    /// Peers' HELLOs confirmed by their PONG to our ask.
    pub hellos_confirmed: u64,
    /// Peers declared dead by the liveness probe (their transfers failed as lost).
    pub peers_declared_dead: u64,
    /// FORGETs that proved a peer unloaded our metadata (see [`crate::forget`]): our two-way
    /// transfers to it failed, and the later ones go one way.
    pub peers_forgot_us: u64,
    /// Transfers failed and scatters answered ACK(Failed) because the application deregistered
    /// memory they touch.
    pub dereg_failed: u64,
    /// KEEPs sent for writes still in flight (see [`crate::wire::Keep`]).
    pub keeps_sent: u64,
    /// Transfers we sent one way (answered through the target's mailbox).
    pub one_way_sent: u64,
    /// One-way flows we answered through our mailbox.
    pub one_way_answered: u64,
    /// One-way WANTs dropped for want of a mailbox slot (the initiator times out): the queue
    /// of WANTs waiting for a slot was full, or a waiting WANT's initiator gave up first.
    pub one_way_refused: u64,
    /// One-way WANTs (and PULLs) that found no mailbox slot and waited for one in the bounded
    /// queue (see [`crate::oneway::Answering`]), instead of being dropped.
    pub one_way_queued: u64,
    /// Mailbox records written into our arena.
    pub records_written: u64,
    /// Mailbox records read from targets.
    pub records_read: u64,
    /// Mailbox records read from targets and refused (forged, moved, replayed or torn), each
    /// time one was read.
    pub records_refused: u64,
    /// READ chunks this target gathered and announced ready.
    pub chunks_served: u64,
    /// READ chunks this initiator read and scattered.
    pub chunks_pulled: u64,
    /// PLANs sent ahead of their DATA (see [`crate::wire::Plan`]).
    pub plans_sent: u64,
    /// PLANs validated and kept for their chunk's DATA.
    pub plans_kept: u64,
    /// PLANs not kept: over the peer's budget, a duplicate, or refused by validation (the
    /// chunk's DATA is then answered ACK(Replan), and its runs come with the DATA).
    pub plans_dropped: u64,
    /// DATAs answered ACK(Replan) here, or (as sender) sent again with their runs.
    pub replans: u64,
    /// Chunks written with their scatter runs in the region behind their data.
    pub region_plans_sent: u64,
    /// DATAs whose runs lay in their region, handed to the copy engine to check and scatter.
    pub region_plans_received: u64,
    /// WRITE transfers whose first GRANT came (each one WANT -> GRANT round trip, timed).
    pub grant_waits: u64,
    /// Nanoseconds from each such transfer's WANT to its first GRANT, summed: the control
    /// round trip as this initiator's reactor saw it, from the pass that sent the WANT to the
    /// pass that read the GRANT (the target's handling included).
    pub grant_wait_ns: u64,
    /// Chunks ACKed as scattered (each one DATA -> ACK round trip, timed).
    pub ack_waits: u64,
    /// Nanoseconds from each such chunk's DATA to its ACK, summed: the round trip with the
    /// target's scatter of the chunk in it (one way: the mailbox fetches that found the ACK).
    pub ack_wait_ns: u64,
    /// WRITEs whose one chunk this initiator sent inside its WANT ([`wire::Inline`]).
    pub inline_sent: u64,
    /// Of those, the ones the target declined (it GRANTed the chunk instead).
    pub inline_declined: u64,
    /// Of those, the ones ACKed with no GRANT: one control round trip each, timed.
    pub inline_acks: u64,
    /// Nanoseconds from each such WANT to its ACK, summed (the target's fill and scatter in it).
    pub inline_ack_wait_ns: u64,
    /// Inline chunks this target took from a WANT: put in a region it granted itself and
    /// scattered from there.
    pub inline_taken: u64,
    /// Standing flows this initiator opened at its targets ([`wire::Standing::Open`]).
    pub standing_opened_out: u64,
    /// WRITEs whose first chunk this initiator wrote into a standing credit, with no
    /// WANT -> GRANT round trip.
    pub standing_claims: u64,
    /// Standing flows peers opened here.
    pub standing_opened: u64,
    /// Standing flows refused here (this target gives none of that size, the peer has one,
    /// or the standing share of the arena is taken); counted by the target.
    pub standing_refused: u64,
    /// Standing credits claimed here: a new flow's chunk 0 took the region its sender's
    /// standing flow held.
    pub standing_taken: u64,
    /// Of those, the regions given back to their standing flow once the chunk was scattered
    /// (answered ACK(Kept)), with no fresh grant needed.
    pub standing_kept: u64,
}

impl Stats {
    /// Counts a transfer that failed with `err`: in `failed`, and in its kind's counter.
    pub(crate) fn count_failed(&mut self, err: &XferError) {
        self.failed += 1;
        match err {
            XferError::Timeout => self.timeouts += 1,
            XferError::Canceled => self.canceled += 1,
            XferError::Refused => self.refused += 1,
            _ => {}
        }
    }
}

/// Shared mutable context a role borrows for one call: the scheduler, the action queue, the
/// job counter and the counters.
pub(crate) struct Ctx<'a> {
    pub(crate) now: Instant,
    pub(crate) scheds: &'a mut ArenaSchedulers,
    pub(crate) out: &'a mut VecDeque<Action>,
    pub(crate) next_job: &'a mut u64,
    pub(crate) stats: &'a mut Stats,
}

impl Ctx<'_> {
    /// Arena `arena`'s scheduler (an id checked on entry: see [`ArenaSchedulers`]).
    pub(crate) fn sched(&mut self, arena: ArenaId) -> &mut CreditScheduler {
        self.scheds.get_mut(arena)
    }

    /// A fresh job id.
    pub(crate) fn job(&mut self) -> JobId {
        let job = JobId(*self.next_job);
        *self.next_job += 1;
        job
    }

    /// Queues an action.
    pub(crate) fn push(&mut self, action: Action) {
        self.out.push_back(action);
    }

    /// Queues a message to `peer`.
    pub(crate) fn send(&mut self, peer: PeerId, msg: impl Into<wire::Msg>) {
        let msg = msg.into();
        trace!(peer = peer.0, xfer = msg.xfer().0, kind = msg.kind_name(), "send");
        self.out.push_back(Action::Send { peer, msg });
    }
}

/// Reports a broken internal invariant: a bug in this crate, never caused by peer input. Debug
/// builds stop here; release builds log and carry on, leaking at most the region involved.
pub(crate) fn internal_error(what: &str, err: &dyn std::fmt::Display) {
    debug_assert!(false, "{what}: {err}");
    tracing::error!(%err, "internal error: {what}");
}
