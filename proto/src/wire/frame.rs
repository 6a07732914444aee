//! Control frames (design §5, §9): the 16-byte header (magic, version, kind, session) and the
//! messages it carries -- the four steps of a transfer ([`Want`], [`Grant`], [`Data`],
//! [`Ack`], together [`Msg`]) and HELLO, PING and PONG, facts about the link rather than steps
//! of a transfer. [`Frame`] carries a [`Msg`]; [`ControlFrame`] carries either kind of [`Body`] and
//! is decoded by the same header and body code.
//!
//! Every WANT, GRANT, DATA and ACK carries its transfer's [`Token`] right after the transfer id
//! (since [`WIRE_VERSION`] 3): the sender draws it, the receiver echoes it, and a frame whose
//! token is not its transfer's is a forgery (see `crate::peers` for the session rule, which
//! binds the header's session to the peer's loaded metadata).
//!
//! Every field has a fixed width except DATA's scatter runs, which are delta-coded with varints
//! (a DATA carries hundreds of them: see `Writer::run` below); the decoder accepts only their
//! one shortest form, so whatever `decode` accepts, `encode` reproduces byte for byte.

use std::sync::Arc;

use super::codec::{MAX_BLOB, Reader, Result, WireError, Writer, check_len};
use crate::types::{ArenaId, ChunkIdx, CopyRun, MAX_ARENAS, RegId, Region, Token, XferId};

/// Magic that starts every control frame; the leading NUL keeps it apart from printable
/// application notifications sharing the same channel.
pub const MAGIC: [u8; 6] = *b"\0BOUNC";
/// Version of the frame and capability layouts this build speaks.
pub const WIRE_VERSION: u8 = 17;
/// Length of the frame header: magic, version, kind, session.
pub const HEADER_LEN: usize = 16;
/// Most chunks one WANT may announce.
pub const MAX_CHUNKS_PER_WANT: u32 = 1 << 20;
/// Most credits one GRANT may carry.
pub const MAX_CREDITS: u32 = 1 << 16;
/// Most scatter runs one DATA may carry.
pub const MAX_RUNS: u32 = 1 << 20;
/// Most destination proofs one WANT may carry (one per destination registration).
pub const MAX_PROOFS: u32 = 1 << 12;
/// Most payload bytes one WANT may carry inline (see [`Inline`]).
pub const MAX_INLINE_BYTES: u32 = 64 << 10;

pub(super) const KIND_WANT: u8 = 1;
pub(super) const KIND_GRANT: u8 = 2;
pub(super) const KIND_DATA: u8 = 3;
pub(super) const KIND_ACK: u8 = 4;
/// A KEEP: a sender's write into the flow's region is still in flight (see [`Keep`]).
pub(super) const KIND_KEEP: u8 = 9;
/// A CURSOR: how far a one-way sender has read its flow's mailbox records (see [`Cursor`]).
pub(super) const KIND_CURSOR: u8 = 10;
/// A PULL: a READ's initiator asks the target to gather chunks for it (see [`Pull`]).
pub(super) const KIND_PULL: u8 = 11;
/// A RELEASE: a READ's initiator has read a region (see [`Release`]).
pub(super) const KIND_RELEASE: u8 = 12;
/// A PLAN: a chunk's scatter runs, sent ahead of its DATA (see [`Plan`]).
pub(super) const KIND_PLAN: u8 = 13;
/// The [`Want::endpoint`] of a sender that asks to be answered through the receiver's mailbox
/// (it loaded the receiver's metadata, the receiver may never have loaded its own: see
/// docs/one-way.md). Any other value, the empty one included, asks for GRANT and ACK frames.
pub const REPLY_MAILBOX: &[u8] = b"\0mailbox";
/// A HELLO frame: header and the sender's load tag (see [`Body::Hello`]).
pub(super) const KIND_HELLO: u8 = 5;
/// A PING frame: header and a nonce (see [`Body::Ping`]).
pub(super) const KIND_PING: u8 = 7;
/// A PONG frame: header, the PING's nonce and the answerer's forget proof for us (see
/// [`Body::Pong`]).
pub(super) const KIND_PONG: u8 = 8;
/// A FORGET frame: header and a forget proof (see [`Body::Forget`]).
pub(super) const KIND_FORGET: u8 = 14;
/// An application notification that begins with [`MAGIC`], escaped (see [`escape_app_notif`]):
/// header (session 0) and the notification's bytes as they are.
pub(super) const KIND_APP: u8 = 15;

/// Longest legal control frame of any kind, in bytes: a DATA with [`MAX_RUNS`] runs each in
/// its longest encoding, plus 4 KiB of headroom for fields a later wire version adds. A
/// transport may refuse anything longer unread (ZMQ's `ZMQ_MAXMSGSIZE`): no decoder would
/// accept it.
pub const MAX_FRAME_LEN: usize = {
    // Every message carries its transfer id (8) and token (16); a WANT also its proofs.
    let want = HEADER_LEN
        + 8
        + 16
        + 4
        + MAX_BLOB as usize
        + 4
        + MAX_CHUNKS_PER_WANT as usize * 8
        + 4
        + MAX_PROOFS as usize * PROOF_LEN
        + 4
        + MAX_INLINE_BYTES as usize
        + 4
        + MAX_RUNS as usize * MAX_RUN_LEN
        + 1
        + 8
        + 16;
    let grant = HEADER_LEN + 8 + 16 + 4 + MAX_CREDITS as usize * CREDIT_LEN;
    let data = HEADER_LEN + 8 + 16 + 4 + REGION_LEN + 4 + MAX_RUNS as usize * MAX_RUN_LEN + 4;
    // A PULL: its first chunk and total, its chunk sizes and run counts, every run in its
    // longest encoding, the proofs.
    let pull = HEADER_LEN
        + 8
        + 16
        + 4
        + 4
        + 4
        + MAX_BLOB as usize
        + 4
        + MAX_CHUNKS_PER_WANT as usize * (8 + 4)
        + MAX_RUNS as usize * MAX_RUN_LEN
        + 4
        + MAX_PROOFS as usize * PROOF_LEN;
    let longest = if want > grant { want } else { grant };
    let longest = if pull > longest { pull } else { longest };
    (if data > longest { data } else { longest }) + 4096
};
/// Most bytes one encoded scatter run takes: the flags, five varints of up to 10 bytes and the
/// count's varint of up to 5.
pub(super) const MAX_RUN_LEN: usize = 1 + 5 * 10 + 5;
/// A GOODBYE frame: header only (see [`Body::Goodbye`]).
pub(super) const KIND_GOODBYE: u8 = 6;

pub(super) const REGION_LEN: usize = 16;
pub(super) const PROOF_LEN: usize = 8 + 16;
pub(super) const CREDIT_LEN: usize = 4 + REGION_LEN;
/// Fewest bytes one encoded scatter run takes (its flags and a one-byte address delta).
pub(super) const MIN_RUN_LEN: usize = 2;
/// Run flag: `count`, `region_stride` and `addr_stride` follow (set unless the run is a single
/// copy with zero strides).
pub(super) const RUN_STRIDED: u8 = 0x01;
/// Run flag: `len` follows (set unless it equals the previous run's `len`).
pub(super) const RUN_NEW_LEN: u8 = 0x02;
/// Run flag: `region_off` follows (set unless the run starts where the previous one ended).
pub(super) const RUN_REGION_JUMP: u8 = 0x04;

/// A sender's request for credits for the chunks of one transfer, or, with no chunks, the
/// cancellation of that transfer's flow (design §5).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "fuzzing", derive(arbitrary::Arbitrary))]
pub struct Want {
    /// The transfer.
    pub xfer: XferId,
    /// The transfer's secret, drawn by the sender; the receiver's flow keeps the one of the
    /// WANT that created it.
    pub token: Token,
    /// The receiver's arena the flow's regions are granted in: the index of one it advertised
    /// (`Capabilities::arenas`), chosen by the sender for the
    /// memory place of the transfer's destinations (wire version 12). Ignored in a cancel.
    pub arena: ArenaId,
    /// How the receiver answers: [`REPLY_MAILBOX`] for mailbox records the sender READs (a
    /// one-way flow); otherwise with GRANT and ACK frames (it is never parsed as an address).
    pub endpoint: Vec<u8>,
    /// Byte size of each chunk in chunk order; empty means cancel.
    pub chunks: Vec<u64>,
    /// One proof per destination registration of the transfer (see [`crate::proof`]); the
    /// flow may scatter only into registrations so proven. A cancel carries none.
    pub proofs: Vec<Proof>,
    /// The transfer's only chunk, carried in the WANT itself (see [`Inline`]); `None` for the
    /// full exchange.
    pub inline: Option<Inline>,
    /// Whether the WANT opens the sender's standing flow or claims its region (see
    /// [`Standing`]); [`Standing::None`] for any other WANT.
    pub standing: Standing,
}

/// A standing credit (docs/control-hops.md): one region of the receiver's arena that a
/// sender holds ahead of its transfers, so that a transfer's first chunk is written with no
/// WANT -> GRANT round trip.
///
/// The sender opens a *standing flow*: a WANT of one chunk with [`Standing::Open`], no
/// proofs (its regions are never scattered from) and its own token. The receiver grants it
/// like any flow (on a lease, as any grant). A later WANT of a transfer claims the region the
/// standing flow holds for its chunk 0 ([`Standing::Claim`], with the standing flow's token):
/// the receiver moves that region to the new flow as if it had granted it there. The sender
/// writes chunk 0 into the region as soon as it sent the claim, and its DATA follows as for any
/// granted chunk. When that chunk is scattered the region goes back to the standing flow and
/// the ACK says so ([`AckStatus::Kept`]): no frame more than the full exchange's, and the
/// sender's next transfer can claim it at once. Should it not go back (the scatter failed, the
/// flow was reclaimed first), the standing flow is granted a fresh region.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "fuzzing", derive(arbitrary::Arbitrary))]
pub enum Standing {
    /// An ordinary WANT.
    #[default]
    None,
    /// This WANT opens the sender's standing flow (one chunk, no inline bytes).
    Open,
    /// This WANT's chunk 0 takes the region that standing flow `xfer` holds; `token` is that
    /// flow's, proving the claim comes from its sender.
    Claim {
        /// The standing flow.
        xfer: XferId,
        /// The standing flow's token.
        token: Token,
    },
}

const STANDING_NONE: u8 = 0;
const STANDING_OPEN: u8 = 1;
const STANDING_CLAIM: u8 = 2;

/// A small transfer's payload carried in its WANT: the receiver may put it in the region it
/// grants the chunk and scatter it at once, answering with the ACK alone, which takes the
/// WANT -> GRANT round trip and the write off the transfer (docs/control-hops.md). Or it may
/// ignore it and GRANT as for any WANT; the sender then writes the chunk as usual.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "fuzzing", derive(arbitrary::Arbitrary))]
pub struct Inline {
    /// The chunk's scatter runs, as a DATA carries them (offsets into `bytes`).
    pub runs: Vec<CopyRun>,
    /// The chunk's bytes: exactly the WANT's one chunk size, at most [`MAX_INLINE_BYTES`].
    pub bytes: Vec<u8>,
}

/// Proof that the sender holds the public metadata of the receiver's registration `reg`: the
/// keyed hash of the transfer's token under the registration's key ([`crate::proof::tag`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "fuzzing", derive(arbitrary::Arbitrary))]
pub struct Proof {
    /// The receiver's registration.
    pub reg: RegId,
    /// The tag.
    pub tag: [u8; 16],
}

impl Want {
    /// True when this WANT cancels the transfer instead of asking for credits.
    pub fn is_cancel(&self) -> bool {
        self.chunks.is_empty()
    }
}

/// One credit: exclusive permission to write one chunk into one region of the receiver's arena.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "fuzzing", derive(arbitrary::Arbitrary))]
pub struct Credit {
    /// The chunk the region is for.
    pub chunk: ChunkIdx,
    /// The granted region of the receiver's arena.
    pub region: Region,
}

/// A receiver's batch of credits for one transfer.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "fuzzing", derive(arbitrary::Arbitrary))]
pub struct Grant {
    /// The transfer.
    pub xfer: XferId,
    /// The flow's token, echoed.
    pub token: Token,
    /// The credits; never empty on the wire.
    pub credits: Vec<Credit>,
}

/// A sender's notice that a chunk has landed in its region, with the runs to scatter it by, or,
/// with no runs, by the runs of the chunk's [`Plan`] sent ahead.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "fuzzing", derive(arbitrary::Arbitrary))]
pub struct Data {
    /// The transfer.
    pub xfer: XferId,
    /// The transfer's token.
    pub token: Token,
    /// The chunk.
    pub chunk: ChunkIdx,
    /// The region it was written to (as granted).
    pub region: Region,
    /// Scatter runs; `CopyRun::addr` is the receiver's destination address. Empty when the
    /// chunk's runs went ahead in a [`Plan`] (a receiver that kept none answers
    /// [`AckStatus::Replan`]), or when they travel in the region.
    pub runs: Vec<CopyRun>,
    /// When not 0: the chunk's scatter runs, this many, lie in its region behind its data, in
    /// the fixed-width form of [`super::region_plan`] (then `runs` is empty).
    pub region_plan_runs: u32,
}

/// A chunk's scatter runs, sent ahead of the chunk's DATA so the receiver decodes and validates
/// them while the chunk is still being written: a fully scattered 32 MiB chunk has thousands of
/// runs (a 72 KB frame), and carried by its DATA they cost the receiver 0.6-0.9 ms after the
/// write, on the critical path of every chunk (BENCHMARKS.md, issue 11). Runs are relative to
/// the chunk's region; the sender sends a chunk's PLAN when its credit comes, right after
/// posting its write.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "fuzzing", derive(arbitrary::Arbitrary))]
pub struct Plan {
    /// The transfer.
    pub xfer: XferId,
    /// The transfer's token.
    pub token: Token,
    /// The chunk.
    pub chunk: ChunkIdx,
    /// Scatter runs, as in [`Data::runs`]. Never empty.
    pub runs: Vec<CopyRun>,
}

/// Outcome of a chunk's scatter, as reported in an ACK.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "fuzzing", derive(arbitrary::Arbitrary))]
#[non_exhaustive]
pub enum AckStatus {
    /// The chunk was scattered; its region is free again.
    Scattered,
    /// The runs failed validation; nothing was copied.
    Refused,
    /// The scatter copy failed.
    Failed,
    /// The DATA named no runs and the receiver kept no [`Plan`] for the chunk (it had no room
    /// for it, or it never arrived): send the DATA again with its runs. The region stays held.
    Replan,
    /// The chunk was scattered, and its region, which its WANT claimed from the sender's
    /// standing flow ([`Standing::Claim`]), is that flow's standing credit again: the sender
    /// may claim it for its next transfer (wire version 10).
    Kept,
}

/// A receiver's report on one chunk; a negative status lets the sender fail fast instead of
/// waiting for its timeout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "fuzzing", derive(arbitrary::Arbitrary))]
pub struct Ack {
    /// The transfer.
    pub xfer: XferId,
    /// The flow's token, echoed.
    pub token: Token,
    /// The chunk.
    pub chunk: ChunkIdx,
    /// The region the chunk occupied.
    pub region: Region,
    /// What happened to the chunk.
    pub status: AckStatus,
}

/// A sender's notice that a write into a region of the flow is still in flight: the receiver
/// must not reclaim the flow's regions as silent meanwhile (a write landing after the reclaim
/// could hit a region granted to another flow). Sent while a write outlasts an eighth of the
/// request timeout, again every eighth; a sender that is silent sends none and is reclaimed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "fuzzing", derive(arbitrary::Arbitrary))]
pub struct Keep {
    /// The transfer.
    pub xfer: XferId,
    /// The flow's token.
    pub token: Token,
}

/// A one-way sender's report of how far it has read its flow's mailbox records: the receiver may
/// reuse the ring positions up to `consumed`, and once the flow has ended, its slot. Sent when
/// half a ring has been read since the last report and once after the last record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "fuzzing", derive(arbitrary::Arbitrary))]
pub struct Cursor {
    /// The transfer.
    pub xfer: XferId,
    /// The flow's token.
    pub token: Token,
    /// The last record sequence number read (records are numbered from 1).
    pub consumed: u64,
}

/// A READ's initiator asks the target to gather these chunks out of its registered memory into
/// regions of its arena, each to be READ once it is announced ready (a GRANT of the region,
/// through the answer path of [`Want::endpoint`]); with no chunks, it cancels the flow like an
/// empty WANT would. The proofs cover the target registrations the runs read.
///
/// A READ of many chunks comes as several PULLs, each with the next chunks in order (`first`),
/// all naming the transfer's chunk count (`total`): the target gathers the first chunk while
/// the initiator still encodes, and it still decodes, the runs of the rest (one PULL of 16384
/// runs took 0.6 ms to encode and decode before anything was gathered). The first carries the
/// proofs; the target keeps the flow until all `total` chunks have come and ended.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "fuzzing", derive(arbitrary::Arbitrary))]
pub struct Pull {
    /// The transfer.
    pub xfer: XferId,
    /// The transfer's secret, as in a WANT.
    pub token: Token,
    /// The target's arena the chunks are gathered into, as [`Want::arena`]; the same in each
    /// PULL of a transfer.
    pub arena: ArenaId,
    /// The index of its first chunk in the transfer (0 in the PULL that opens the flow).
    pub first: ChunkIdx,
    /// The transfer's chunk count, the same in each of its PULLs (0 in a cancel).
    pub total: u32,
    /// How the target answers, as [`Want::endpoint`].
    pub endpoint: Vec<u8>,
    /// Each chunk: its size and the gather runs that fill its region (`CopyRun::addr` is the
    /// target's source address).
    pub chunks: Vec<PullChunk>,
    /// One proof per source registration of the transfer.
    pub proofs: Vec<Proof>,
}

/// One chunk of a [`Pull`].
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "fuzzing", derive(arbitrary::Arbitrary))]
pub struct PullChunk {
    /// Its size in bytes (the region to hold it).
    pub bytes: u64,
    /// Copies source -> region. Never empty. Shared with the sender's plan (see
    /// [`crate::plan::Chunk::gather`]) and, decoded, with the target's gathers.
    pub runs: Arc<Vec<CopyRun>>,
}

/// A READ's initiator has read the chunk's region: the target may reuse it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "fuzzing", derive(arbitrary::Arbitrary))]
pub struct Release {
    /// The transfer.
    pub xfer: XferId,
    /// The flow's token.
    pub token: Token,
    /// The chunk.
    pub chunk: ChunkIdx,
    /// The region it was read from (as announced).
    pub region: Region,
}

/// A control message.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "fuzzing", derive(arbitrary::Arbitrary))]
pub enum Msg {
    /// Sender → receiver: credits wanted (or cancel).
    Want(Want),
    /// Receiver → sender: credits granted.
    Grant(Grant),
    /// Sender → receiver: chunk written, scatter it.
    Data(Data),
    /// Receiver → sender: chunk scattered (or not).
    Ack(Ack),
    /// Sender → receiver: a write into the flow's region is still in flight.
    Keep(Keep),
    /// Sender → receiver (one-way flows): mailbox records read so far.
    Cursor(Cursor),
    /// READ initiator → target: gather these chunks for me (or, empty, cancel).
    Pull(Pull),
    /// READ initiator → target: I have read this region.
    Release(Release),
    /// Sender → receiver: a chunk's scatter runs, ahead of its DATA.
    Plan(Plan),
}

impl From<Want> for Msg {
    fn from(m: Want) -> Self {
        Self::Want(m)
    }
}

impl From<Grant> for Msg {
    fn from(m: Grant) -> Self {
        Self::Grant(m)
    }
}

impl From<Data> for Msg {
    fn from(m: Data) -> Self {
        Self::Data(m)
    }
}

impl From<Ack> for Msg {
    fn from(m: Ack) -> Self {
        Self::Ack(m)
    }
}

impl From<Keep> for Msg {
    fn from(m: Keep) -> Self {
        Self::Keep(m)
    }
}

impl Pull {
    /// True when this PULL cancels the READ instead of asking for chunks.
    pub fn is_cancel(&self) -> bool {
        self.chunks.is_empty()
    }
}

impl From<Pull> for Msg {
    fn from(m: Pull) -> Self {
        Self::Pull(m)
    }
}

impl From<Release> for Msg {
    fn from(m: Release) -> Self {
        Self::Release(m)
    }
}

impl From<Plan> for Msg {
    fn from(m: Plan) -> Self {
        Self::Plan(m)
    }
}

impl From<Cursor> for Msg {
    fn from(m: Cursor) -> Self {
        Self::Cursor(m)
    }
}

impl Msg {
    /// True for a cancel: a WANT or PULL without chunks.
    pub fn is_cancel(&self) -> bool {
        match self {
            Self::Want(w) => w.is_cancel(),
            Self::Pull(p) => p.is_cancel(),
            _ => false,
        }
    }

    /// The cancel WANT for `xfer`: no chunks, still carrying the endpoint so the receiver can
    /// reach back even if it never saw the original WANT.
    pub fn cancel(xfer: XferId, token: Token, endpoint: Vec<u8>) -> Self {
        Self::Want(Want {
            xfer,
            token,
            arena: ArenaId(0),
            endpoint,
            chunks: Vec::new(),
            proofs: Vec::new(),
            inline: None,
            standing: Standing::None,
        })
    }

    /// The transfer the message is about.
    pub fn xfer(&self) -> XferId {
        match self {
            Self::Want(m) => m.xfer,
            Self::Grant(m) => m.xfer,
            Self::Data(m) => m.xfer,
            Self::Ack(m) => m.xfer,
            Self::Keep(m) => m.xfer,
            Self::Cursor(m) => m.xfer,
            Self::Pull(m) => m.xfer,
            Self::Release(m) => m.xfer,
            Self::Plan(m) => m.xfer,
        }
    }

    /// The transfer token the message carries.
    pub fn token(&self) -> Token {
        match self {
            Self::Want(m) => m.token,
            Self::Grant(m) => m.token,
            Self::Data(m) => m.token,
            Self::Ack(m) => m.token,
            Self::Keep(m) => m.token,
            Self::Cursor(m) => m.token,
            Self::Pull(m) => m.token,
            Self::Release(m) => m.token,
            Self::Plan(m) => m.token,
        }
    }

    /// Short upper-case name of the message kind, for logs.
    pub fn kind_name(&self) -> &'static str {
        match self {
            Self::Want(m) if m.is_cancel() => "CANCEL",
            Self::Want(_) => "WANT",
            Self::Grant(_) => "GRANT",
            Self::Data(_) => "DATA",
            Self::Ack(_) => "ACK",
            Self::Keep(_) => "KEEP",
            Self::Cursor(_) => "CURSOR",
            Self::Pull(m) if m.is_cancel() => "PULL-CANCEL",
            Self::Pull(_) => "PULL",
            Self::Release(_) => "RELEASE",
            Self::Plan(_) => "PLAN",
        }
    }

    pub(super) fn kind_byte(&self) -> u8 {
        match self {
            Self::Want(_) => KIND_WANT,
            Self::Grant(_) => KIND_GRANT,
            Self::Data(_) => KIND_DATA,
            Self::Ack(_) => KIND_ACK,
            Self::Keep(_) => KIND_KEEP,
            Self::Cursor(_) => KIND_CURSOR,
            Self::Pull(_) => KIND_PULL,
            Self::Release(_) => KIND_RELEASE,
            Self::Plan(_) => KIND_PLAN,
        }
    }

    /// Checks the rules `decode` enforces beyond layout: counts within their caps, no zero-size
    /// chunk, region or run, no empty GRANT or DATA.
    ///
    /// `encode` does not check them (it cannot fail); a message that fails here is refused by
    /// the peer's decoder, so the machines should only build valid ones.
    ///
    /// # Errors
    /// The first rule broken, as [`WireError::CountTooLarge`] or [`WireError::Invalid`].
    pub fn validate(&self) -> Result<()> {
        match self {
            Self::Want(m) => {
                check_arena(m.arena)?;
                check_len("endpoint", m.endpoint.len(), MAX_BLOB)?;
                check_len("want chunks", m.chunks.len(), MAX_CHUNKS_PER_WANT)?;
                check_len("want proofs", m.proofs.len(), MAX_PROOFS)?;
                if m.chunks.contains(&0) {
                    return Err(WireError::Invalid { what: "zero-size chunk in WANT" });
                }
                if let Some(i) = &m.inline {
                    check_len("inline bytes", i.bytes.len(), MAX_INLINE_BYTES)?;
                    check_len("inline runs", i.runs.len(), MAX_RUNS)?;
                    if m.chunks.len() != 1 || m.chunks[0] != i.bytes.len() as u64 {
                        return Err(WireError::Invalid { what: "WANT inline bytes not its one chunk" });
                    }
                    if i.runs.is_empty() {
                        return Err(WireError::Invalid { what: "WANT inline without runs" });
                    }
                    check_runs(&i.runs)?;
                }
                match m.standing {
                    Standing::None => {}
                    Standing::Open if m.chunks.len() != 1 || m.inline.is_some() || !m.proofs.is_empty() => {
                        return Err(WireError::Invalid { what: "standing WANT not one bare chunk" });
                    }
                    Standing::Open => {}
                    Standing::Claim { .. } if m.chunks.is_empty() || m.inline.is_some() => {
                        return Err(WireError::Invalid { what: "standing claim on a cancel or an inline WANT" });
                    }
                    Standing::Claim { .. } => {}
                }
            }
            Self::Grant(m) => {
                check_len("grant credits", m.credits.len(), MAX_CREDITS)?;
                if m.credits.is_empty() {
                    return Err(WireError::Invalid { what: "GRANT without credits" });
                }
                if m.credits.iter().any(|c| c.region.len == 0) {
                    return Err(WireError::Invalid { what: "zero-length region in GRANT" });
                }
                if m.credits.iter().any(|c| c.region.checked_end().is_none()) {
                    return Err(WireError::Invalid { what: "region past 2^64 in GRANT" });
                }
            }
            Self::Data(m) => {
                check_len("data runs", m.runs.len(), MAX_RUNS)?;
                if m.region.len == 0 {
                    return Err(WireError::Invalid { what: "zero-length region in DATA" });
                }
                if m.region.checked_end().is_none() {
                    return Err(WireError::Invalid { what: "region past 2^64 in DATA" });
                }
                if m.region_plan_runs > MAX_RUNS || (m.region_plan_runs != 0 && !m.runs.is_empty()) {
                    return Err(WireError::Invalid { what: "DATA region plan" });
                }
                check_runs(&m.runs)?;
            }
            Self::Plan(m) => {
                check_len("plan runs", m.runs.len(), MAX_RUNS)?;
                if m.runs.is_empty() {
                    return Err(WireError::Invalid { what: "PLAN without runs" });
                }
                check_runs(&m.runs)?;
            }
            Self::Ack(m) => {
                if m.region.len == 0 {
                    return Err(WireError::Invalid { what: "zero-length region in ACK" });
                }
                if m.region.checked_end().is_none() {
                    return Err(WireError::Invalid { what: "region past 2^64 in ACK" });
                }
            }
            Self::Keep(_) | Self::Cursor(_) => {}
            Self::Pull(m) => {
                check_arena(m.arena)?;
                check_len("endpoint", m.endpoint.len(), MAX_BLOB)?;
                check_len("pull chunks", m.chunks.len(), MAX_CHUNKS_PER_WANT)?;
                check_len("pull proofs", m.proofs.len(), MAX_PROOFS)?;
                check_len("pull runs", m.chunks.iter().map(|c| c.runs.len()).sum(), MAX_RUNS)?;
                check_len("pull total", m.total as usize, MAX_CHUNKS_PER_WANT)?;
                if !m.chunks.is_empty() && u64::from(m.first.0) + m.chunks.len() as u64 > u64::from(m.total) {
                    return Err(WireError::Invalid { what: "PULL chunks past its total" });
                }
                if m.chunks.iter().any(|c| c.bytes == 0) {
                    return Err(WireError::Invalid { what: "zero-size chunk in PULL" });
                }
                if m.chunks.iter().any(|c| c.runs.is_empty()) {
                    return Err(WireError::Invalid { what: "PULL chunk without runs" });
                }
                if m.chunks.iter().flat_map(|c| c.runs.iter()).any(|r| r.count == 0 || r.len == 0) {
                    return Err(WireError::Invalid { what: "empty run in PULL" });
                }
            }
            Self::Release(m) => {
                if m.region.len == 0 {
                    return Err(WireError::Invalid { what: "zero-length region in RELEASE" });
                }
                if m.region.checked_end().is_none() {
                    return Err(WireError::Invalid { what: "region past 2^64 in RELEASE" });
                }
            }
        }
        Ok(())
    }
}

/// No run of a DATA or PLAN copies nothing.
/// An arena id no agent can have ([`MAX_ARENAS`] or more) is malformed; whether the receiver
/// has the arena is its own check.
fn check_arena(arena: ArenaId) -> Result<()> {
    if usize::from(arena.0) >= MAX_ARENAS {
        return Err(WireError::Invalid { what: "arena id" });
    }
    Ok(())
}

fn check_runs(runs: &[CopyRun]) -> Result<()> {
    if runs.iter().any(|r| r.count == 0) {
        return Err(WireError::Invalid { what: "run with count 0" });
    }
    if runs.iter().any(|r| r.len == 0) {
        return Err(WireError::Invalid { what: "run with length 0" });
    }
    Ok(())
}

/// A control message with the header that carries it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "fuzzing", derive(arbitrary::Arbitrary))]
pub struct Frame {
    /// The sending engine's random instance nonce, so a receiver can drop messages from a dead
    /// earlier incarnation of the same agent name, or replays.
    pub session: u64,
    /// The message.
    pub msg: Msg,
}

impl Frame {
    /// Appends the frame's encoding to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        let mut w = Writer(out);
        write_header(&mut w, self.msg.kind_byte(), self.session);
        write_msg(&mut w, &self.msg);
    }

    /// The frame's encoding as a new vector.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut out = Vec::new();
        self.encode(&mut out);
        out
    }

    /// Decodes exactly one frame carrying a [`Msg`]; trailing bytes are an error, and so is a
    /// HELLO ([`WireError::UnknownKind`]: it carries no message; see [`ControlFrame`]).
    ///
    /// # Errors
    /// Any [`WireError`]: wrong magic, version or kind, truncation, a count over its cap or
    /// beyond the input, a value [`Msg::validate`] rejects, or bytes left over.
    pub fn decode(bytes: &[u8]) -> Result<Self> {
        let mut r = Reader(bytes);
        let (kind, session) = read_header(&mut r)?;
        let msg = read_msg(&mut r, kind)?;
        r.finish()?;
        msg.validate()?;
        Ok(Self { session, msg })
    }
}

/// What a control frame carries.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "fuzzing", derive(arbitrary::Arbitrary))]
pub enum Body {
    /// HELLO: "I have loaded your connection info, so I can answer your WANTs". It is no step
    /// of a transfer but a fact about the link: a sender bounces to a peer only after its
    /// HELLO; until then it stays on plain UCX instead of sending WANTs nobody could answer.
    Hello {
        /// Which load of the receiver's metadata it speaks for: a one-way digest of that
        /// load's forget secret ([`crate::forget::load_tag`]). The receiver tells a repeat
        /// (its confirmed load's tag) from a reload (another tag), which it must ask about.
        load: u64,
    },
    /// PING: "are you alive?". A peer we wait on that has sent nothing for a while is probed
    /// (see `crate::liveness`); the nonce is echoed in the [`Body::Pong`]. Header and nonce only.
    Ping {
        /// Chosen by the prober, unpredictable to others, so a PONG cannot be forged blind.
        nonce: u64,
    },
    /// PONG: the answer to a [`Body::Ping`], echoing its nonce. Header, nonce and forget proof.
    Pong {
        /// The nonce of the PING answered.
        nonce: u64,
        /// The answerer's secret for the load of our metadata it answers under: it sends it
        /// back in a [`Body::Forget`] when it unloads us. Only a PONG that confirms a HELLO
        /// (its nonce was seen by the peer alone) records it.
        forget: Token,
    },
    /// FORGET: "I unloaded your metadata; I cannot answer your two-way frames any more". Sent
    /// by an engine whose application unloaded the peer (NIXL's `disconnect`), while it still
    /// can; it carries the secret of that load, which only its PONGs to us carried, so no
    /// third agent can send one. The peer fails its two-way transfers to us at once and goes
    /// one way to us (answers through our mailbox), as it would had we never loaded it.
    Forget {
        /// The forget secret our confirming PONG carried.
        proof: Token,
    },
    /// GOODBYE, header only: "my engine is going away; my arena with it". Sent by an engine
    /// being destroyed once its own writes have ended; the peer fails its transfers to it at
    /// once (retracting their credits once its own writes end) and forgets its arena.
    Goodbye,
    /// A step of a transfer.
    Msg(Msg),
}

/// Any control frame: a [`Msg`] or a HELLO, behind the same header and decoded by the same code
/// as [`Frame`]. A shell that reads frames off a channel decodes them with this one call.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "fuzzing", derive(arbitrary::Arbitrary))]
pub struct ControlFrame {
    /// The sending engine's instance nonce (see [`Frame::session`]).
    pub session: u64,
    /// What the frame carries.
    pub body: Body,
}

impl ControlFrame {
    /// Appends the frame's encoding to `out`: the header, then a HELLO's load tag, a PING's
    /// nonce, a PONG's nonce and forget secret, a FORGET's proof (a GOODBYE is the bare header).
    pub fn encode(&self, out: &mut Vec<u8>) {
        let mut w = Writer(out);
        match &self.body {
            Body::Hello { load } => {
                write_header(&mut w, KIND_HELLO, self.session);
                w.u64(*load);
            }
            Body::Ping { nonce } => {
                write_header(&mut w, KIND_PING, self.session);
                w.u64(*nonce);
            }
            Body::Pong { nonce, forget } => {
                write_header(&mut w, KIND_PONG, self.session);
                w.u64(*nonce);
                w.token(*forget);
            }
            Body::Forget { proof } => {
                write_header(&mut w, KIND_FORGET, self.session);
                w.token(*proof);
            }
            Body::Goodbye => write_header(&mut w, KIND_GOODBYE, self.session),
            Body::Msg(msg) => {
                write_header(&mut w, msg.kind_byte(), self.session);
                write_msg(&mut w, msg);
            }
        }
    }

    /// The frame's encoding as a new vector.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut out = Vec::new();
        self.encode(&mut out);
        out
    }

    /// Decodes exactly one frame of any kind; trailing bytes are an error.
    ///
    /// # Errors
    /// As [`Frame::decode`], except that HELLO, PING and PONG are accepted.
    pub fn decode(bytes: &[u8]) -> Result<Self> {
        let mut r = Reader(bytes);
        let (kind, session) = read_header(&mut r)?;
        let body = match kind {
            KIND_HELLO => Body::Hello { load: r.u64()? },
            KIND_PING => Body::Ping { nonce: r.u64()? },
            KIND_PONG => Body::Pong { nonce: r.u64()?, forget: r.token()? },
            KIND_FORGET => Body::Forget { proof: r.token()? },
            KIND_GOODBYE => Body::Goodbye,
            kind => Body::Msg(read_msg(&mut r, kind)?),
        };
        r.finish()?;
        if let Body::Msg(msg) = &body {
            msg.validate()?;
        }
        Ok(Self { session, body })
    }
}

impl From<Frame> for ControlFrame {
    fn from(f: Frame) -> Self {
        Self { session: f.session, body: Body::Msg(f.msg) }
    }
}

/// A HELLO frame from the engine with instance nonce `session`, for the load tagged `load`.
pub fn encode_hello(session: u64, load: u64) -> Vec<u8> {
    ControlFrame { session, body: Body::Hello { load } }.to_vec()
}

/// A GOODBYE frame from the engine with instance nonce `session`.
pub fn encode_goodbye(session: u64) -> Vec<u8> {
    ControlFrame { session, body: Body::Goodbye }.to_vec()
}

/// The sender's session when `bytes` is exactly a HELLO frame of our wire version.
pub fn decode_hello(bytes: &[u8]) -> Option<u64> {
    match ControlFrame::decode(bytes) {
        Ok(ControlFrame { session, body: Body::Hello { .. } }) => Some(session),
        _ => None,
    }
}

/// True when `bytes` starts with the control-frame magic: a cheap test that lets the shell tell
/// our frames from the application's own notifications before decoding.
pub fn is_control_frame(bytes: &[u8]) -> bool {
    bytes.starts_with(&MAGIC)
}

/// An application notification as it must travel to a BOUNCE peer: `None` when it goes as it is
/// (it does not begin with [`MAGIC`]), else wrapped in a header of kind APP, which the peer's
/// [`unescape_app_notif`] takes off before its application sees it. Without this a
/// notification beginning with the magic was taken for a control frame and never reached the
/// peer's application. Every agent NIXL lets us notify through the BOUNCE backend loaded our
/// BOUNCE metadata, so the receiver is a BOUNCE engine (of another wire version, it drops the
/// escaped notification as it would have dropped the bare one).
pub fn escape_app_notif(msg: &[u8]) -> Option<Vec<u8>> {
    if !is_control_frame(msg) {
        return None;
    }
    let mut out = Vec::with_capacity(HEADER_LEN + msg.len());
    let mut w = Writer(&mut out);
    write_header(&mut w, KIND_APP, 0);
    w.bytes(msg);
    Some(out)
}

/// The application notification inside an escaped one ([`escape_app_notif`]), or `None` when
/// `bytes` is not one. Anyone may send one: it is delivered as the bytes it carries, which the
/// sender could have sent as a notification through UCX anyway, and never looked at again.
pub fn unescape_app_notif(bytes: &[u8]) -> Option<&[u8]> {
    let mut r = Reader(bytes);
    // Only what `escape_app_notif` makes (its payload begins with the magic), so that the
    // codec stays canonical; anything else of kind APP is a malformed control frame.
    match read_header(&mut r) {
        Ok((KIND_APP, 0)) if is_control_frame(r.0) => Some(r.0),
        _ => None,
    }
}

/// The header: magic, version, kind, session.
fn write_header(w: &mut Writer<'_>, kind: u8, session: u64) {
    w.bytes(&MAGIC);
    w.u8(WIRE_VERSION);
    w.u8(kind);
    w.u64(session);
}

/// Reads and checks the header; returns the (unchecked) kind byte and the session.
fn read_header(r: &mut Reader<'_>) -> Result<(u8, u64)> {
    if r.array::<6>()? != MAGIC {
        return Err(WireError::BadMagic { what: "frame" });
    }
    let version = r.u8()?;
    if version != WIRE_VERSION {
        return Err(WireError::UnsupportedVersion { what: "frame", got: version.into() });
    }
    Ok((r.u8()?, r.u64()?))
}

/// The body of a [`Msg`], after its header.
fn write_msg(w: &mut Writer<'_>, msg: &Msg) {
    match msg {
        Msg::Want(m) => {
            w.u64(m.xfer.0);
            w.token(m.token);
            w.u8(m.arena.0);
            w.blob(&m.endpoint);
            w.len(m.chunks.len());
            m.chunks.iter().for_each(|&c| w.u64(c));
            w.len(m.proofs.len());
            for p in &m.proofs {
                w.u64(p.reg.0);
                w.bytes(&p.tag);
            }
            // 0 bytes: no inline chunk (an inline chunk is never empty).
            match &m.inline {
                None => w.len(0),
                Some(i) => {
                    w.len(i.bytes.len());
                    w.bytes(&i.bytes);
                    w.runs(&i.runs);
                }
            }
            match m.standing {
                Standing::None => w.u8(STANDING_NONE),
                Standing::Open => w.u8(STANDING_OPEN),
                Standing::Claim { xfer, token } => {
                    w.u8(STANDING_CLAIM);
                    w.u64(xfer.0);
                    w.token(token);
                }
            }
        }
        Msg::Grant(m) => {
            w.u64(m.xfer.0);
            w.token(m.token);
            w.len(m.credits.len());
            for c in &m.credits {
                w.u32(c.chunk.0);
                w.region(&c.region);
            }
        }
        Msg::Data(m) => {
            w.u64(m.xfer.0);
            w.token(m.token);
            w.u32(m.chunk.0);
            w.region(&m.region);
            w.runs(&m.runs);
            w.u32(m.region_plan_runs);
        }
        Msg::Ack(m) => {
            w.u64(m.xfer.0);
            w.token(m.token);
            w.u32(m.chunk.0);
            w.region(&m.region);
            w.u8(ack_tag(m.status));
        }
        Msg::Keep(m) => {
            w.u64(m.xfer.0);
            w.token(m.token);
        }
        Msg::Cursor(m) => {
            w.u64(m.xfer.0);
            w.token(m.token);
            w.u64(m.consumed);
        }
        Msg::Pull(m) => {
            w.u64(m.xfer.0);
            w.token(m.token);
            w.u8(m.arena.0);
            w.u32(m.first.0);
            w.u32(m.total);
            w.blob(&m.endpoint);
            w.len(m.chunks.len());
            // One allocation for the runs (typically 8-16 bytes each), as `Writer::runs` does.
            w.reserve(m.chunks.iter().map(|c| c.runs.len() * 16 + 12).sum());
            for c in &m.chunks {
                w.u64(c.bytes);
                w.len(c.runs.len());
                let mut prev = RunCursor::default();
                c.runs.iter().for_each(|r| prev = w.run(r, prev));
            }
            w.len(m.proofs.len());
            for p in &m.proofs {
                w.u64(p.reg.0);
                w.bytes(&p.tag);
            }
        }
        Msg::Release(m) => {
            w.u64(m.xfer.0);
            w.token(m.token);
            w.u32(m.chunk.0);
            w.region(&m.region);
        }
        Msg::Plan(m) => {
            w.u64(m.xfer.0);
            w.token(m.token);
            w.u32(m.chunk.0);
            w.runs(&m.runs);
        }
    }
}

/// The body of the [`Msg`] of kind byte `kind`; any other kind (HELLO included) is
/// [`WireError::UnknownKind`]. Not yet validated.
fn read_msg(r: &mut Reader<'_>, kind: u8) -> Result<Msg> {
    Ok(match kind {
        KIND_WANT => {
            let (xfer, token, arena) = (XferId(r.u64()?), r.token()?, ArenaId(r.u8()?));
            let endpoint = r.blob("endpoint")?;
            let n = r.count("want chunks", MAX_CHUNKS_PER_WANT, 8)?;
            let chunks = (0..n).map(|_| r.u64()).collect::<Result<_>>()?;
            let n = r.count("want proofs", MAX_PROOFS, PROOF_LEN)?;
            let proofs = (0..n).map(|_| Ok(Proof { reg: RegId(r.u64()?), tag: r.array()? })).collect::<Result<_>>()?;
            let inline = match r.count("inline bytes", MAX_INLINE_BYTES, 1)? {
                0 => None,
                n => {
                    let bytes = r.take(n)?.to_vec();
                    Some(Inline { bytes, runs: r.runs("inline runs")? })
                }
            };
            let standing = match r.u8()? {
                STANDING_NONE => Standing::None,
                STANDING_OPEN => Standing::Open,
                STANDING_CLAIM => Standing::Claim { xfer: XferId(r.u64()?), token: r.token()? },
                _ => return Err(WireError::Invalid { what: "WANT standing tag" }),
            };
            Msg::Want(Want { xfer, token, arena, endpoint, chunks, proofs, inline, standing })
        }
        KIND_GRANT => {
            let (xfer, token) = (XferId(r.u64()?), r.token()?);
            let n = r.count("grant credits", MAX_CREDITS, CREDIT_LEN)?;
            let credits =
                (0..n).map(|_| Ok(Credit { chunk: ChunkIdx(r.u32()?), region: r.region()? })).collect::<Result<_>>()?;
            Msg::Grant(Grant { xfer, token, credits })
        }
        KIND_DATA => {
            let (xfer, token) = (XferId(r.u64()?), r.token()?);
            let chunk = ChunkIdx(r.u32()?);
            let region = r.region()?;
            let runs = r.runs("data runs")?;
            let region_plan_runs = r.u32()?;
            Msg::Data(Data { xfer, token, chunk, region, runs, region_plan_runs })
        }
        KIND_PLAN => {
            let (xfer, token) = (XferId(r.u64()?), r.token()?);
            let chunk = ChunkIdx(r.u32()?);
            let runs = r.runs("plan runs")?;
            Msg::Plan(Plan { xfer, token, chunk, runs })
        }
        KIND_ACK => Msg::Ack(Ack {
            xfer: XferId(r.u64()?),
            token: r.token()?,
            chunk: ChunkIdx(r.u32()?),
            region: r.region()?,
            status: ack_from_tag(r.u8()?)?,
        }),
        KIND_KEEP => Msg::Keep(Keep { xfer: XferId(r.u64()?), token: r.token()? }),
        KIND_CURSOR => Msg::Cursor(Cursor { xfer: XferId(r.u64()?), token: r.token()?, consumed: r.u64()? }),
        KIND_PULL => {
            let (xfer, token, arena) = (XferId(r.u64()?), r.token()?, ArenaId(r.u8()?));
            let (first, total) = (ChunkIdx(r.u32()?), r.u32()?);
            let endpoint = r.blob("endpoint")?;
            let n = r.count("pull chunks", MAX_CHUNKS_PER_WANT, 8 + 4)?;
            let mut runs_left = MAX_RUNS;
            let chunks = (0..n)
                .map(|_| {
                    let bytes = r.u64()?;
                    let k = r.count("pull runs", runs_left, MIN_RUN_LEN)?;
                    runs_left -= k as u32;
                    Ok(PullChunk { bytes, runs: Arc::new(r.runs_of(k)?) })
                })
                .collect::<Result<_>>()?;
            let n = r.count("pull proofs", MAX_PROOFS, PROOF_LEN)?;
            let proofs = (0..n).map(|_| Ok(Proof { reg: RegId(r.u64()?), tag: r.array()? })).collect::<Result<_>>()?;
            Msg::Pull(Pull { xfer, token, arena, first, total, endpoint, chunks, proofs })
        }
        KIND_RELEASE => Msg::Release(Release {
            xfer: XferId(r.u64()?),
            token: r.token()?,
            chunk: ChunkIdx(r.u32()?),
            region: r.region()?,
        }),
        got => return Err(WireError::UnknownKind { got }),
    })
}

fn ack_tag(s: AckStatus) -> u8 {
    match s {
        AckStatus::Scattered => 0,
        AckStatus::Refused => 1,
        AckStatus::Failed => 2,
        AckStatus::Replan => 3,
        AckStatus::Kept => 4,
    }
}

fn ack_from_tag(t: u8) -> Result<AckStatus> {
    match t {
        0 => Ok(AckStatus::Scattered),
        1 => Ok(AckStatus::Refused),
        2 => Ok(AckStatus::Failed),
        3 => Ok(AckStatus::Replan),
        4 => Ok(AckStatus::Kept),
        _ => Err(WireError::Invalid { what: "ack status tag" }),
    }
}

/// What a scatter run is delta-coded against: where the previous run ended (region and user
/// side) and its copy length; all zero before the first run. Computed with wrapping
/// arithmetic, so encoder and decoder agree on any input, hostile ones included.
#[derive(Debug, Clone, Copy, Default)]
struct RunCursor {
    region_end: u64,
    addr_end: u64,
    len: u64,
}

impl RunCursor {
    fn after(r: &CopyRun) -> Self {
        let last = u64::from(r.count).wrapping_sub(1);
        Self {
            region_end: r.region_off.wrapping_add(r.region_stride.wrapping_mul(last)).wrapping_add(r.len),
            addr_end: r.addr.wrapping_add(r.addr_stride.wrapping_mul(last)).wrapping_add(r.len),
            len: r.len,
        }
    }

    /// The flags `r` is encoded with after a run that left this cursor.
    fn flags(r: &CopyRun, prev: Self) -> u8 {
        let mut f = 0;
        if r.count != 1 || r.region_stride != 0 || r.addr_stride != 0 {
            f |= RUN_STRIDED;
        }
        if r.len != prev.len {
            f |= RUN_NEW_LEN;
        }
        if r.region_off != prev.region_end {
            f |= RUN_REGION_JUMP;
        }
        f
    }
}

impl Reader<'_> {
    /// A count of scatter runs, then the runs (see [`Writer::runs`]).
    fn runs(&mut self, what: &'static str) -> Result<Vec<CopyRun>> {
        // `count` checked n against the bytes left: the allocation is bounded by the input.
        let n = self.count(what, MAX_RUNS, MIN_RUN_LEN)?;
        self.runs_of(n)
    }

    /// `n` scatter runs, `n` already checked against the bytes left by [`Reader::count`].
    /// Decoded into a vector reserved up front: collected through `Result`, a PULL chunk's
    /// vector could not be sized and regrew a dozen times, which (each copy faulting in fresh
    /// pages) made 40% of a 16384-run PULL's decode.
    fn runs_of(&mut self, n: usize) -> Result<Vec<CopyRun>> {
        let mut runs = Vec::with_capacity(n);
        let mut prev = RunCursor::default();
        for _ in 0..n {
            let run = self.run(prev)?;
            prev = RunCursor::after(&run);
            runs.push(run);
        }
        Ok(runs)
    }

    /// One scatter run, delta-coded against the run before it (see [`Writer::run`]).
    #[inline(always)]
    fn run(&mut self, prev: RunCursor) -> Result<CopyRun> {
        let flags = self.u8()?;
        if flags & !(RUN_STRIDED | RUN_NEW_LEN | RUN_REGION_JUMP) != 0 {
            return Err(WireError::Invalid { what: "scatter run flags" });
        }
        let region_off = if flags & RUN_REGION_JUMP != 0 { self.varint()? } else { prev.region_end };
        let delta = self.varint()?;
        let addr = prev.addr_end.wrapping_add((delta >> 1) ^ (delta & 1).wrapping_neg());
        let len = if flags & RUN_NEW_LEN != 0 { self.varint()? } else { prev.len };
        let (count, region_stride, addr_stride) = if flags & RUN_STRIDED != 0 {
            let count = u32::try_from(self.varint()?).map_err(|_| WireError::Invalid { what: "run count" })?;
            (count, self.varint()?, self.varint()?)
        } else {
            (1, 0, 0)
        };
        let run = CopyRun { region_off, addr, len, count, region_stride, addr_stride };
        // Canonical: each flag is set exactly when its field differs from the implied value.
        if RunCursor::flags(&run, prev) != flags {
            return Err(WireError::Invalid { what: "scatter run not in its canonical form" });
        }
        Ok(run)
    }
}

impl Writer<'_> {
    /// A count of scatter runs, then each delta-coded against the one before it.
    fn runs(&mut self, runs: &[CopyRun]) {
        // Typical runs take 8-16 bytes: one allocation instead of a dozen regrowths.
        self.reserve(runs.len() * 16);
        self.len(runs.len());
        let mut prev = RunCursor::default();
        runs.iter().for_each(|r| prev = self.run(r, prev));
    }

    /// One scatter run, delta-coded against the run before it: a flags byte, then
    /// `region_off` only when the run does not start where the previous one ended, the user
    /// address as a zigzag varint of its distance from the previous run's end, `len` only when
    /// it changes, and `count` and both strides only for a strided run. A DATA for 512
    /// scattered 4 KiB pieces shrinks from 22.5 KB (fixed 44-byte runs) to about 3 KB: one UCX
    /// message fragment instead of several, which each need the sender's progress to go out.
    /// Returns the cursor for the next run. Inlined into its loops: called, it passed the
    /// cursor through memory and encoding took 11.7 ns a run against 4.4 inlined (2 cores; a
    /// 2048-run PLAN took 40 us to encode on the H100 host, issue 11), slower than decoding.
    #[inline(always)]
    fn run(&mut self, r: &CopyRun, prev: RunCursor) -> RunCursor {
        let flags = RunCursor::flags(r, prev);
        self.u8(flags);
        if flags & RUN_REGION_JUMP != 0 {
            self.varint(r.region_off);
        }
        let delta = r.addr.wrapping_sub(prev.addr_end) as i64;
        self.varint(((delta << 1) ^ (delta >> 63)) as u64);
        if flags & RUN_NEW_LEN != 0 {
            self.varint(r.len);
        }
        if flags & RUN_STRIDED != 0 {
            self.varint(r.count.into());
            self.varint(r.region_stride);
            self.varint(r.addr_stride);
        }
        RunCursor::after(r)
    }
}
