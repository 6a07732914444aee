//! Versioned little-endian codec of the control plane (design §5, §9): the four control messages
//! (WANT / GRANT / DATA / ACK) framed behind a 16-byte header, the capability blob exchanged in the
//! handshake, and the connection-info envelope that wraps the inner UCX engine's conn info.
//!
//! This module owns byte layouts only. It does not decide whether a message makes sense for the
//! state of a transfer (the sender and receiver machines do), nor does it send anything (the shell
//! does). Every field has a fixed width except DATA's scatter runs, every count is a `u32`, and
//! enum tags are validated strictly. Scatter runs are delta-coded with varints (a DATA carries
//! hundreds of them: see `Writer::run`), and the decoder accepts only their one shortest form.
//! So the encoding is canonical: whatever `decode` accepts, `encode` reproduces byte for byte
//! (the fuzz targets under `fuzz/` check exactly that).
//!
//! Decoding treats its input as hostile: it never panics, and it checks every count against both
//! an absolute cap and the bytes actually left before it allocates, so a 20-byte frame can never
//! make the receiver reserve gigabytes.

use crate::types::{ChunkIdx, ControlKind, CopyRun, MemKind, Region, XferId};

/// Magic that starts every control frame; the leading NUL keeps it apart from printable
/// application notifications sharing the same channel.
pub const MAGIC: [u8; 6] = *b"\0BOUNC";
/// Version of the frame and capability layouts this build speaks.
pub const WIRE_VERSION: u8 = 2;
/// Length of the frame header: magic, version, kind, session.
pub const HEADER_LEN: usize = 16;
/// Magic that starts a connection-info envelope.
pub const ENVELOPE_MAGIC: [u8; 8] = *b"NXBOUNCE";
/// Version of the envelope layout this build speaks.
pub const ENVELOPE_VERSION: u16 = 1;
/// Most chunks one WANT may announce.
pub const MAX_CHUNKS_PER_WANT: u32 = 1 << 20;
/// Most credits one GRANT may carry.
pub const MAX_CREDITS: u32 = 1 << 16;
/// Most scatter runs one DATA may carry.
pub const MAX_RUNS: u32 = 1 << 20;
/// Largest opaque byte string (endpoint, remote key, inner conn info).
pub const MAX_BLOB: u32 = 1 << 20;

const KIND_WANT: u8 = 1;
const KIND_GRANT: u8 = 2;
const KIND_DATA: u8 = 3;
const KIND_ACK: u8 = 4;
/// A HELLO frame: header only. It lives outside [`Msg`] because it is no protocol step of a
/// transfer but a fact about the link, handled by the shell: "I have loaded your connection
/// info, so I can answer your WANTs". A sender bounces to a peer only after its HELLO; until
/// then it stays on plain UCX instead of sending WANTs nobody could answer.
const KIND_HELLO: u8 = 5;

/// Envelope flag: a capability blob follows the flags byte.
const FLAG_CAPS: u8 = 0x01;

const REGION_LEN: usize = 16;
const CREDIT_LEN: usize = 4 + REGION_LEN;
/// Fewest bytes one encoded scatter run takes (its flags and a one-byte address delta).
const MIN_RUN_LEN: usize = 2;
/// Run flag: `count`, `region_stride` and `addr_stride` follow (set unless the run is a single
/// copy with zero strides).
const RUN_STRIDED: u8 = 0x01;
/// Run flag: `len` follows (set unless it equals the previous run's `len`).
const RUN_NEW_LEN: u8 = 0x02;
/// Run flag: `region_off` follows (set unless the run starts where the previous one ended).
const RUN_REGION_JUMP: u8 = 0x04;

/// Reasons a byte string is not a valid frame, capability blob or envelope.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    /// The input ended inside a field.
    #[error("truncated: need {need} more bytes, have {have}")]
    Truncated {
        /// Bytes the field being read requires.
        need: usize,
        /// Bytes that were left.
        have: usize,
    },
    /// The input does not start with the expected magic.
    #[error("bad {what} magic")]
    BadMagic {
        /// Which layout was expected (`"frame"` or `"envelope"`).
        what: &'static str,
    },
    /// The layout version is not one this build speaks.
    #[error("unsupported {what} version {got}")]
    UnsupportedVersion {
        /// Which layout (`"frame"`, `"capabilities"` or `"envelope"`).
        what: &'static str,
        /// The version found.
        got: u16,
    },
    /// The frame's kind byte names no known message.
    #[error("unknown message kind {got}")]
    UnknownKind {
        /// The kind byte found.
        got: u8,
    },
    /// A count exceeds its absolute cap.
    #[error("{what} count {count} exceeds the cap {max}")]
    CountTooLarge {
        /// Which list or byte string.
        what: &'static str,
        /// The count found (or the length of an oversized value being checked).
        count: u64,
        /// The cap.
        max: u64,
    },
    /// Bytes remain after a complete value.
    #[error("{n} trailing bytes")]
    TrailingBytes {
        /// How many bytes remain.
        n: usize,
    },
    /// An envelope sets flag bits this build does not know (a newer peer's layout).
    #[error("unknown envelope flags {got:#04x}")]
    UnknownFlags {
        /// The flags byte found.
        got: u8,
    },
    /// A field holds a value the protocol forbids.
    #[error("invalid {what}")]
    Invalid {
        /// What is wrong.
        what: &'static str,
    },
}

/// Shorthand for results of this module.
pub type Result<T, E = WireError> = std::result::Result<T, E>;

/// Reasons a peer's capabilities rule out the bounce path with it (design §5); the peer then
/// stays on the standard NIXL path.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Incompatible {
    /// The peer speaks another wire version.
    #[error("wire version {peer} differs from ours ({local})")]
    WireVersion {
        /// Our version.
        local: u16,
        /// The peer's version.
        peer: u16,
    },
    /// The peer uses another control channel kind.
    #[error("control kind {peer:?} differs from ours ({local:?})")]
    ControlKind {
        /// Our control kind.
        local: ControlKind,
        /// The peer's control kind.
        peer: ControlKind,
    },
    /// The peer chunks transfers differently, so the two plans would disagree.
    #[error("max chunk {peer} differs from ours ({local})")]
    MaxChunk {
        /// Our max chunk size in bytes.
        local: u64,
        /// The peer's max chunk size in bytes.
        peer: u64,
    },
}

/// A sender's request for credits for the chunks of one transfer, or, with no chunks, the
/// cancellation of that transfer's flow (design §5).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "fuzzing", derive(arbitrary::Arbitrary))]
pub struct Want {
    /// The transfer.
    pub xfer: XferId,
    /// The sender's control endpoint (or conn info) for the reverse path; may be empty.
    pub endpoint: Vec<u8>,
    /// Byte size of each chunk in chunk order; empty means cancel.
    pub chunks: Vec<u64>,
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
    /// The credits; never empty on the wire.
    pub credits: Vec<Credit>,
}

/// A sender's notice that a chunk has landed in its region, with the runs to scatter it by.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "fuzzing", derive(arbitrary::Arbitrary))]
pub struct Data {
    /// The transfer.
    pub xfer: XferId,
    /// The chunk.
    pub chunk: ChunkIdx,
    /// The region it was written to (as granted).
    pub region: Region,
    /// Scatter runs; `CopyRun::addr` is the receiver's destination address. Never empty.
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
}

/// A receiver's report on one chunk; a negative status lets the sender fail fast instead of
/// waiting for its timeout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "fuzzing", derive(arbitrary::Arbitrary))]
pub struct Ack {
    /// The transfer.
    pub xfer: XferId,
    /// The chunk.
    pub chunk: ChunkIdx,
    /// The region the chunk occupied.
    pub region: Region,
    /// What happened to the chunk.
    pub status: AckStatus,
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

impl Msg {
    /// The cancel WANT for `xfer`: no chunks, still carrying the endpoint so the receiver can
    /// reach back even if it never saw the original WANT.
    pub fn cancel(xfer: XferId, endpoint: Vec<u8>) -> Self {
        Self::Want(Want { xfer, endpoint, chunks: Vec::new() })
    }

    /// The transfer the message is about.
    pub fn xfer(&self) -> XferId {
        match self {
            Self::Want(m) => m.xfer,
            Self::Grant(m) => m.xfer,
            Self::Data(m) => m.xfer,
            Self::Ack(m) => m.xfer,
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
        }
    }

    fn kind_byte(&self) -> u8 {
        match self {
            Self::Want(_) => KIND_WANT,
            Self::Grant(_) => KIND_GRANT,
            Self::Data(_) => KIND_DATA,
            Self::Ack(_) => KIND_ACK,
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
                check_len("endpoint", m.endpoint.len(), MAX_BLOB)?;
                check_len("want chunks", m.chunks.len(), MAX_CHUNKS_PER_WANT)?;
                if m.chunks.contains(&0) {
                    return Err(WireError::Invalid { what: "zero-size chunk in WANT" });
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
            }
            Self::Data(m) => {
                check_len("data runs", m.runs.len(), MAX_RUNS)?;
                if m.region.len == 0 {
                    return Err(WireError::Invalid { what: "zero-length region in DATA" });
                }
                if m.runs.is_empty() {
                    return Err(WireError::Invalid { what: "DATA without runs" });
                }
                if m.runs.iter().any(|r| r.count == 0) {
                    return Err(WireError::Invalid { what: "run with count 0" });
                }
                if m.runs.iter().any(|r| r.len == 0) {
                    return Err(WireError::Invalid { what: "run with length 0" });
                }
            }
            Self::Ack(m) => {
                if m.region.len == 0 {
                    return Err(WireError::Invalid { what: "zero-length region in ACK" });
                }
            }
        }
        Ok(())
    }
}

/// A HELLO frame from the engine with instance nonce `session` (see `KIND_HELLO`).
pub fn encode_hello(session: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_LEN);
    out.extend_from_slice(&MAGIC);
    out.push(WIRE_VERSION);
    out.push(KIND_HELLO);
    out.extend_from_slice(&session.to_le_bytes());
    out
}

/// The sender's session when `bytes` is exactly a HELLO frame of our wire version.
pub fn decode_hello(bytes: &[u8]) -> Option<u64> {
    if bytes.len() != HEADER_LEN || bytes[..MAGIC.len()] != MAGIC {
        return None;
    }
    if bytes[MAGIC.len()] != WIRE_VERSION || bytes[MAGIC.len() + 1] != KIND_HELLO {
        return None;
    }
    let mut s = [0u8; 8];
    s.copy_from_slice(&bytes[MAGIC.len() + 2..]);
    Some(u64::from_le_bytes(s))
}

/// True when `bytes` starts with the control-frame magic: a cheap test that lets the shell tell
/// our frames from the application's own notifications before decoding.
pub fn is_control_frame(bytes: &[u8]) -> bool {
    bytes.starts_with(&MAGIC)
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
        w.bytes(&MAGIC);
        w.u8(WIRE_VERSION);
        w.u8(self.msg.kind_byte());
        w.u64(self.session);
        match &self.msg {
            Msg::Want(m) => {
                w.u64(m.xfer.0);
                w.blob(&m.endpoint);
                w.len(m.chunks.len());
                m.chunks.iter().for_each(|&c| w.u64(c));
            }
            Msg::Grant(m) => {
                w.u64(m.xfer.0);
                w.len(m.credits.len());
                for c in &m.credits {
                    w.u32(c.chunk.0);
                    w.region(&c.region);
                }
            }
            Msg::Data(m) => {
                w.u64(m.xfer.0);
                w.u32(m.chunk.0);
                w.region(&m.region);
                w.len(m.runs.len());
                let mut prev = RunCursor::default();
                m.runs.iter().for_each(|r| prev = w.run(r, prev));
            }
            Msg::Ack(m) => {
                w.u64(m.xfer.0);
                w.u32(m.chunk.0);
                w.region(&m.region);
                w.u8(ack_tag(m.status));
            }
        }
    }

    /// The frame's encoding as a new vector.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut out = Vec::new();
        self.encode(&mut out);
        out
    }

    /// Decodes exactly one frame; trailing bytes are an error.
    ///
    /// # Errors
    /// Any [`WireError`]: wrong magic, version or kind, truncation, a count over its cap or
    /// beyond the input, a value [`Msg::validate`] rejects, or bytes left over.
    pub fn decode(bytes: &[u8]) -> Result<Self> {
        let mut r = Reader(bytes);
        if r.array::<6>()? != MAGIC {
            return Err(WireError::BadMagic { what: "frame" });
        }
        let version = r.u8()?;
        if version != WIRE_VERSION {
            return Err(WireError::UnsupportedVersion { what: "frame", got: version.into() });
        }
        let kind = r.u8()?;
        let session = r.u64()?;
        let msg = match kind {
            KIND_WANT => {
                let xfer = XferId(r.u64()?);
                let endpoint = r.blob("endpoint")?;
                let n = r.count("want chunks", MAX_CHUNKS_PER_WANT, 8)?;
                let chunks = (0..n).map(|_| r.u64()).collect::<Result<_>>()?;
                Msg::Want(Want { xfer, endpoint, chunks })
            }
            KIND_GRANT => {
                let xfer = XferId(r.u64()?);
                let n = r.count("grant credits", MAX_CREDITS, CREDIT_LEN)?;
                let credits = (0..n)
                    .map(|_| Ok(Credit { chunk: ChunkIdx(r.u32()?), region: r.region()? }))
                    .collect::<Result<_>>()?;
                Msg::Grant(Grant { xfer, credits })
            }
            KIND_DATA => {
                let xfer = XferId(r.u64()?);
                let chunk = ChunkIdx(r.u32()?);
                let region = r.region()?;
                let n = r.count("data runs", MAX_RUNS, MIN_RUN_LEN)?;
                let mut prev = RunCursor::default();
                let runs = (0..n)
                    .map(|_| {
                        let run = r.run(prev)?;
                        prev = RunCursor::after(&run);
                        Ok(run)
                    })
                    .collect::<Result<_>>()?;
                Msg::Data(Data { xfer, chunk, region, runs })
            }
            KIND_ACK => Msg::Ack(Ack {
                xfer: XferId(r.u64()?),
                chunk: ChunkIdx(r.u32()?),
                region: r.region()?,
                status: ack_from_tag(r.u8()?)?,
            }),
            got => return Err(WireError::UnknownKind { got }),
        };
        r.finish()?;
        msg.validate()?;
        Ok(Self { session, msg })
    }
}

/// An agent's bounce capability blob, published with its connection info (design §5): what a
/// peer needs to decide whether bounce can be used with it and to write into its arena.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "fuzzing", derive(arbitrary::Arbitrary))]
pub struct Capabilities {
    /// Wire version spoken (the frame header's version, widened).
    pub wire_version: u16,
    /// Control channel kind.
    pub control: ControlKind,
    /// Memory kind of the arena.
    pub mem: MemKind,
    /// Address of the arena's first byte in the owner's address space.
    pub arena_base: u64,
    /// Arena length in bytes.
    pub arena_len: u64,
    /// Device id of the arena.
    pub arena_dev: u64,
    /// Bytes of the arena usable for regions.
    pub usable_capacity: u64,
    /// Largest chunk in bytes; both peers must agree.
    pub max_chunk: u64,
    /// The owner engine's instance nonce (as in frame headers).
    pub session: u64,
    /// The inner UCX engine's public data for the arena registration (remote key).
    pub arena_key: Vec<u8>,
    /// The control endpoint (a ZMQ endpoint), or empty.
    pub endpoint: Vec<u8>,
}

impl Capabilities {
    /// Appends the blob's encoding to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        let mut w = Writer(out);
        w.u16(self.wire_version);
        w.u8(control_tag(self.control));
        w.u8(mem_tag(self.mem));
        for v in [self.arena_base, self.arena_len, self.arena_dev, self.usable_capacity, self.max_chunk, self.session] {
            w.u64(v);
        }
        w.blob(&self.arena_key);
        w.blob(&self.endpoint);
    }

    /// The blob's encoding as a new vector.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut out = Vec::new();
        self.encode(&mut out);
        out
    }

    /// Decodes exactly one blob; trailing bytes are an error.
    ///
    /// A blob of another wire version is refused outright ([`WireError::UnsupportedVersion`]):
    /// its layout may differ from here on, and such a peer is incompatible anyway.
    ///
    /// # Errors
    /// Any [`WireError`] for a wrong version, unknown enum tag, truncation, an oversized byte
    /// string or bytes left over.
    pub fn decode(bytes: &[u8]) -> Result<Self> {
        let mut r = Reader(bytes);
        let wire_version = r.u16()?;
        if wire_version != u16::from(WIRE_VERSION) {
            return Err(WireError::UnsupportedVersion { what: "capabilities", got: wire_version });
        }
        let caps = Self {
            wire_version,
            control: control_from_tag(r.u8()?)?,
            mem: mem_from_tag(r.u8()?)?,
            arena_base: r.u64()?,
            arena_len: r.u64()?,
            arena_dev: r.u64()?,
            usable_capacity: r.u64()?,
            max_chunk: r.u64()?,
            session: r.u64()?,
            arena_key: r.blob("arena key")?,
            endpoint: r.blob("endpoint")?,
        };
        r.finish()?;
        Ok(caps)
    }

    /// Whether bounce may be used between us (`self`) and `peer`: wire version, control kind and
    /// max chunk size must match (design §5). Arena geometry and memory kind may differ.
    ///
    /// # Errors
    /// The first mismatch, in the order version, control kind, max chunk.
    pub fn compatible_with(&self, peer: &Self) -> Result<(), Incompatible> {
        if self.wire_version != peer.wire_version {
            return Err(Incompatible::WireVersion { local: self.wire_version, peer: peer.wire_version });
        }
        if self.control != peer.control {
            return Err(Incompatible::ControlKind { local: self.control, peer: peer.control });
        }
        if self.max_chunk != peer.max_chunk {
            return Err(Incompatible::MaxChunk { local: self.max_chunk, peer: peer.max_chunk });
        }
        Ok(())
    }
}

/// What the BOUNCE backend's `getConnInfo` returns: our capabilities, if bounce is usable here,
/// around the inner UCX engine's own conn info (opaque).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "fuzzing", derive(arbitrary::Arbitrary))]
pub struct ConnEnvelope {
    /// Our capabilities; `None` when bounce is disabled or unusable, so the peer stays on UCX.
    pub caps: Option<Capabilities>,
    /// The inner UCX engine's conn info, passed through untouched.
    pub inner: Vec<u8>,
}

impl ConnEnvelope {
    /// Appends the envelope's encoding to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        let mut w = Writer(out);
        w.bytes(&ENVELOPE_MAGIC);
        w.u16(ENVELOPE_VERSION);
        match &self.caps {
            Some(caps) => {
                w.u8(FLAG_CAPS);
                let at = w.0.len();
                w.u32(0);
                caps.encode(w.0);
                let n = w.0.len() - at - 4;
                w.0[at..at + 4].copy_from_slice(&len_u32(n).to_le_bytes());
            }
            None => w.u8(0),
        }
        w.blob(&self.inner);
    }

    /// The envelope's encoding as a new vector.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut out = Vec::new();
        self.encode(&mut out);
        out
    }

    /// Decodes exactly one envelope; trailing bytes are an error.
    ///
    /// # Errors
    /// [`WireError::BadMagic`], [`WireError::UnsupportedVersion`], [`WireError::UnknownFlags`]
    /// (a newer layout), truncation, an oversized inner blob, trailing bytes, or any error of
    /// [`Capabilities::decode`] on the embedded blob.
    pub fn decode(bytes: &[u8]) -> Result<Self> {
        let mut r = Reader(bytes);
        if r.array::<8>()? != ENVELOPE_MAGIC {
            return Err(WireError::BadMagic { what: "envelope" });
        }
        let version = r.u16()?;
        if version != ENVELOPE_VERSION {
            return Err(WireError::UnsupportedVersion { what: "envelope", got: version });
        }
        let flags = r.u8()?;
        if flags & !FLAG_CAPS != 0 {
            return Err(WireError::UnknownFlags { got: flags });
        }
        let caps = if flags & FLAG_CAPS != 0 {
            // The caps blob is bounded by the input itself, and decoding it allocates only its
            // own (capped) byte strings, so no absolute cap is needed on its length.
            let n = r.count("capabilities", u32::MAX, 1)?;
            Some(Capabilities::decode(r.take(n)?)?)
        } else {
            None
        };
        let inner = r.blob("inner conn info")?;
        r.finish()?;
        Ok(Self { caps, inner })
    }
}

fn check_len(what: &'static str, len: usize, max: u32) -> Result<()> {
    if len > max as usize {
        return Err(WireError::CountTooLarge { what, count: len as u64, max: max.into() });
    }
    Ok(())
}

/// Length as written on the wire; an impossible length becomes `u32::MAX`, which exceeds every
/// cap, so the peer refuses it instead of misreading a wrapped count.
fn len_u32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

fn ack_tag(s: AckStatus) -> u8 {
    match s {
        AckStatus::Scattered => 0,
        AckStatus::Refused => 1,
        AckStatus::Failed => 2,
    }
}

fn ack_from_tag(t: u8) -> Result<AckStatus> {
    match t {
        0 => Ok(AckStatus::Scattered),
        1 => Ok(AckStatus::Refused),
        2 => Ok(AckStatus::Failed),
        _ => Err(WireError::Invalid { what: "ack status tag" }),
    }
}

fn control_tag(c: ControlKind) -> u8 {
    match c {
        ControlKind::Ucx => 0,
        ControlKind::Zmq => 1,
    }
}

fn control_from_tag(t: u8) -> Result<ControlKind> {
    match t {
        0 => Ok(ControlKind::Ucx),
        1 => Ok(ControlKind::Zmq),
        _ => Err(WireError::Invalid { what: "control kind tag" }),
    }
}

/// Tags follow NIXL's `nixl_mem_t` numbering (`DRAM_SEG` = 0, `VRAM_SEG` = 1).
fn mem_tag(m: MemKind) -> u8 {
    match m {
        MemKind::Dram => 0,
        MemKind::Vram => 1,
    }
}

fn mem_from_tag(t: u8) -> Result<MemKind> {
    match t {
        0 => Ok(MemKind::Dram),
        1 => Ok(MemKind::Vram),
        _ => Err(WireError::Invalid { what: "memory kind tag" }),
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

/// Cursor over untrusted input: every read checks the bytes left first.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if n > self.0.len() {
            return Err(WireError::Truncated { need: n, have: self.0.len() });
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        let (head, rest) =
            self.0.split_first_chunk::<N>().ok_or(WireError::Truncated { need: N, have: self.0.len() })?;
        self.0 = rest;
        Ok(*head)
    }

    fn u8(&mut self) -> Result<u8> {
        Ok(self.array::<1>()?[0])
    }

    fn u16(&mut self) -> Result<u16> {
        self.array().map(u16::from_le_bytes)
    }

    fn u32(&mut self) -> Result<u32> {
        self.array().map(u32::from_le_bytes)
    }

    fn u64(&mut self) -> Result<u64> {
        self.array().map(u64::from_le_bytes)
    }

    /// Reads a `u32` count of `entry`-byte items and checks it against `max` and against the
    /// bytes left, so the caller may allocate `count` items safely.
    fn count(&mut self, what: &'static str, max: u32, entry: usize) -> Result<usize> {
        let n = self.u32()?;
        if n > max {
            return Err(WireError::CountTooLarge { what, count: n.into(), max: max.into() });
        }
        let need = (n as usize).saturating_mul(entry);
        if need > self.0.len() {
            return Err(WireError::Truncated { need, have: self.0.len() });
        }
        Ok(n as usize)
    }

    fn blob(&mut self, what: &'static str) -> Result<Vec<u8>> {
        let n = self.count(what, MAX_BLOB, 1)?;
        Ok(self.take(n)?.to_vec())
    }

    fn region(&mut self) -> Result<Region> {
        Ok(Region { offset: self.u64()?, len: self.u64()? })
    }

    /// A LEB128 varint of at most 64 bits, in its one shortest form (canonical decoding).
    fn varint(&mut self) -> Result<u64> {
        let mut v = 0u64;
        for i in 0..10 {
            let b = self.u8()?;
            let bits = u64::from(b & 0x7f);
            if i == 9 && b > 1 {
                return Err(WireError::Invalid { what: "varint over 64 bits" });
            }
            v |= bits << (7 * i);
            if b & 0x80 == 0 {
                if b == 0 && i > 0 {
                    return Err(WireError::Invalid { what: "varint not in its shortest form" });
                }
                return Ok(v);
            }
        }
        Err(WireError::Invalid { what: "varint over 64 bits" })
    }

    /// One scatter run, delta-coded against the run before it (see [`Writer::run`]).
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

    fn finish(self) -> Result<()> {
        match self.0.len() {
            0 => Ok(()),
            n => Err(WireError::TrailingBytes { n }),
        }
    }
}

/// Little-endian appender; the mirror image of [`Reader`].
struct Writer<'a>(&'a mut Vec<u8>);

impl Writer<'_> {
    fn bytes(&mut self, b: &[u8]) {
        self.0.extend_from_slice(b);
    }

    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }

    fn u16(&mut self, v: u16) {
        self.bytes(&v.to_le_bytes());
    }

    fn u32(&mut self, v: u32) {
        self.bytes(&v.to_le_bytes());
    }

    fn u64(&mut self, v: u64) {
        self.bytes(&v.to_le_bytes());
    }

    fn len(&mut self, n: usize) {
        self.u32(len_u32(n));
    }

    fn blob(&mut self, b: &[u8]) {
        self.len(b.len());
        self.bytes(b);
    }

    fn region(&mut self, g: &Region) {
        self.u64(g.offset);
        self.u64(g.len);
    }

    /// A LEB128 varint.
    fn varint(&mut self, mut v: u64) {
        while v >= 0x80 {
            self.u8(v as u8 | 0x80);
            v >>= 7;
        }
        self.u8(v as u8);
    }

    /// One scatter run, delta-coded against the run before it: a flags byte, then
    /// `region_off` only when the run does not start where the previous one ended, the user
    /// address as a zigzag varint of its distance from the previous run's end, `len` only when
    /// it changes, and `count` and both strides only for a strided run. A DATA for 512
    /// scattered 4 KiB pieces shrinks from 22.5 KB (fixed 44-byte runs) to about 3 KB: one UCX
    /// message fragment instead of several, which each need the sender's progress to go out.
    /// Returns the cursor for the next run.
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

/// One valid frame of each shape; the golden tests and the fuzz seed corpus start from these.
#[cfg(any(test, feature = "fuzzing"))]
fn sample_frames() -> Vec<Frame> {
    let region = Region { offset: 0x100, len: 0x40 };
    let run = CopyRun { region_off: 0, addr: 0x1000, len: 0x20, count: 2, region_stride: 0x20, addr_stride: 0x80 };
    let xfer = XferId(3);
    let chunk = ChunkIdx(2);
    let msgs = [
        Msg::Want(Want { xfer: XferId(0x2a), endpoint: b"ep".to_vec(), chunks: vec![4096, 32] }),
        Msg::cancel(XferId(0x2a), b"tcp://10.0.0.1:5555".to_vec()),
        Msg::Grant(Grant {
            xfer,
            credits: vec![
                Credit { chunk: ChunkIdx(0), region },
                Credit { chunk: ChunkIdx(1), region: Region { offset: 0x140, len: 0x20 } },
            ],
        }),
        Msg::Data(Data { xfer, chunk, region, runs: vec![run] }),
        Msg::Ack(Ack { xfer, chunk, region, status: AckStatus::Refused }),
    ];
    msgs.into_iter().enumerate().map(|(i, msg)| Frame { session: i as u64 + 1, msg }).collect()
}

#[cfg(any(test, feature = "fuzzing"))]
fn sample_caps() -> Capabilities {
    Capabilities {
        wire_version: WIRE_VERSION.into(),
        control: ControlKind::Zmq,
        mem: MemKind::Vram,
        arena_base: 0x1000,
        arena_len: 0x2000,
        arena_dev: 0,
        usable_capacity: 0x2000,
        max_chunk: 0x400,
        session: 9,
        arena_key: b"k".to_vec(),
        endpoint: Vec::new(),
    }
}

#[cfg(any(test, feature = "fuzzing"))]
fn sample_envelopes() -> Vec<ConnEnvelope> {
    vec![
        ConnEnvelope { caps: None, inner: vec![0xab] },
        ConnEnvelope { caps: Some(sample_caps()), inner: b"ucx-worker-address".to_vec() },
    ]
}

/// Asserts the canonical-encoding property on arbitrary input: if `decode` accepts `data`,
/// `encode` gives back exactly `data`.
#[cfg(any(test, feature = "fuzzing"))]
fn assert_canonical<T>(data: &[u8], decode: fn(&[u8]) -> Result<T>, encode: fn(&T) -> Vec<u8>) {
    if let Ok(v) = decode(data) {
        assert_eq!(encode(&v), data, "decode accepted a non-canonical encoding");
    }
}

/// Entry points of the cargo-fuzz targets under `fuzz/` and their seed corpus.
#[cfg(feature = "fuzzing")]
pub mod fuzzing {
    use super::{Capabilities, ConnEnvelope, Frame, assert_canonical};

    /// Decodes `data` as a frame; if that succeeds, asserts re-encoding gives `data` back.
    ///
    /// # Panics
    /// When the codec is not canonical (a bug).
    pub fn frame_decode(data: &[u8]) {
        assert_canonical(data, Frame::decode, Frame::to_vec);
    }

    /// Encodes `frame` and asserts that decoding accepts it exactly when [`super::Msg::validate`]
    /// does, and then returns an equal frame.
    ///
    /// # Panics
    /// When encode and decode disagree (a bug).
    pub fn frame_encode(frame: &Frame) {
        let bytes = frame.to_vec();
        match (frame.msg.validate(), Frame::decode(&bytes)) {
            (Ok(()), Ok(back)) => assert_eq!(&back, frame),
            (Err(_), Err(_)) => {}
            (v, d) => panic!("validate {v:?} but decode {d:?}"),
        }
    }

    /// Decodes `data` as a capability blob; if that succeeds, asserts re-encoding gives `data`.
    ///
    /// # Panics
    /// When the codec is not canonical (a bug).
    pub fn caps_decode(data: &[u8]) {
        assert_canonical(data, Capabilities::decode, Capabilities::to_vec);
    }

    /// Decodes `data` as an envelope; if that succeeds, asserts re-encoding gives `data`.
    ///
    /// # Panics
    /// When the codec is not canonical (a bug).
    pub fn envelope_decode(data: &[u8]) {
        assert_canonical(data, ConnEnvelope::decode, ConnEnvelope::to_vec);
    }

    /// Valid encoded frames, one per message shape, for the `wire_decode` seed corpus.
    pub fn seed_frames() -> Vec<Vec<u8>> {
        super::sample_frames().iter().map(Frame::to_vec).collect()
    }

    /// Valid encoded capability blobs for the `caps_decode` seed corpus.
    pub fn seed_caps() -> Vec<Vec<u8>> {
        let zmq = super::sample_caps();
        let ucx = Capabilities {
            control: crate::types::ControlKind::Ucx,
            mem: crate::types::MemKind::Dram,
            endpoint: b"tcp://10.0.0.1:5555".to_vec(),
            ..zmq.clone()
        };
        vec![zmq.to_vec(), ucx.to_vec()]
    }

    /// Valid encoded envelopes (with and without capabilities) for the `envelope_decode` corpus.
    pub fn seed_envelopes() -> Vec<Vec<u8>> {
        super::sample_envelopes().iter().map(ConnEnvelope::to_vec).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    fn unhex(s: &str) -> Vec<u8> {
        let s: String = s.split_whitespace().collect();
        (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
    }

    fn arb_region() -> impl Strategy<Value = Region> {
        (any::<u64>(), 1..=u64::MAX).prop_map(|(offset, len)| Region { offset, len })
    }

    fn arb_run() -> impl Strategy<Value = CopyRun> {
        (any::<u64>(), any::<u64>(), 1..=u64::MAX, 1..=u32::MAX, any::<u64>(), any::<u64>()).prop_map(
            |(region_off, addr, len, count, region_stride, addr_stride)| CopyRun {
                region_off,
                addr,
                len,
                count,
                region_stride,
                addr_stride,
            },
        )
    }

    fn arb_blob() -> impl Strategy<Value = Vec<u8>> {
        prop::collection::vec(any::<u8>(), 0..24)
    }

    fn arb_status() -> impl Strategy<Value = AckStatus> {
        prop_oneof![Just(AckStatus::Scattered), Just(AckStatus::Refused), Just(AckStatus::Failed)]
    }

    fn arb_msg() -> impl Strategy<Value = Msg> {
        let xfer = any::<u64>().prop_map(XferId);
        let chunk = any::<u32>().prop_map(ChunkIdx);
        let credit = (chunk.clone(), arb_region()).prop_map(|(chunk, region)| Credit { chunk, region });
        prop_oneof![
            (xfer.clone(), arb_blob(), prop::collection::vec(1..=u64::MAX, 0..8))
                .prop_map(|(xfer, endpoint, chunks)| Msg::Want(Want { xfer, endpoint, chunks })),
            (xfer.clone(), prop::collection::vec(credit, 1..6))
                .prop_map(|(xfer, credits)| Msg::Grant(Grant { xfer, credits })),
            (xfer.clone(), chunk.clone(), arb_region(), prop::collection::vec(arb_run(), 1..5))
                .prop_map(|(xfer, chunk, region, runs)| Msg::Data(Data { xfer, chunk, region, runs })),
            (xfer, chunk, arb_region(), arb_status())
                .prop_map(|(xfer, chunk, region, status)| { Msg::Ack(Ack { xfer, chunk, region, status }) }),
        ]
    }

    fn arb_frame() -> impl Strategy<Value = Frame> {
        (any::<u64>(), arb_msg()).prop_map(|(session, msg)| Frame { session, msg })
    }

    fn arb_caps() -> impl Strategy<Value = Capabilities> {
        let control = prop_oneof![Just(ControlKind::Ucx), Just(ControlKind::Zmq)];
        let mem = prop_oneof![Just(MemKind::Dram), Just(MemKind::Vram)];
        (control, mem, prop::array::uniform6(any::<u64>()), arb_blob(), arb_blob()).prop_map(
            |(control, mem, v, arena_key, endpoint)| Capabilities {
                wire_version: WIRE_VERSION.into(),
                control,
                mem,
                arena_base: v[0],
                arena_len: v[1],
                arena_dev: v[2],
                usable_capacity: v[3],
                max_chunk: v[4],
                session: v[5],
                arena_key,
                endpoint,
            },
        )
    }

    fn arb_envelope() -> impl Strategy<Value = ConnEnvelope> {
        (prop::option::of(arb_caps()), arb_blob()).prop_map(|(caps, inner)| ConnEnvelope { caps, inner })
    }

    /// A valid encoding with a few bytes overwritten, truncated or extended: input close enough
    /// to valid that decoding sometimes still succeeds, which is where non-canonical bugs hide.
    fn mutated(valid: impl Strategy<Value = Vec<u8>>) -> impl Strategy<Value = Vec<u8>> {
        (valid, prop::collection::vec((any::<prop::sample::Index>(), prop_oneof![0..4u8, any::<u8>()]), 0..4), 0..3u8)
            .prop_map(|(mut bytes, edits, tail)| {
                for (at, b) in edits {
                    let i = at.index(bytes.len());
                    bytes[i] = b;
                }
                match tail {
                    0 => {}
                    1 => bytes.push(0),
                    _ => {
                        bytes.pop();
                    }
                }
                bytes
            })
    }

    fn body_of(frame: &Frame) -> Vec<u8> {
        frame.to_vec()[HEADER_LEN..].to_vec()
    }

    fn frame_bytes(kind: u8, body: &[u8]) -> Vec<u8> {
        let mut b = MAGIC.to_vec();
        b.extend_from_slice(&[WIRE_VERSION, kind]);
        b.extend_from_slice(&7u64.to_le_bytes());
        b.extend_from_slice(body);
        b
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(128))]

        #[test]
        fn every_valid_frame_round_trips(frame in arb_frame()) {
            prop_assert_eq!(frame.msg.validate(), Ok(()));
            let bytes = frame.to_vec();
            prop_assert!(is_control_frame(&bytes));
            prop_assert_eq!(Frame::decode(&bytes), Ok(frame));
        }

        #[test]
        fn capabilities_round_trip(caps in arb_caps()) {
            prop_assert_eq!(Capabilities::decode(&caps.to_vec()), Ok(caps));
        }

        #[test]
        fn envelopes_round_trip(env in arb_envelope()) {
            prop_assert_eq!(ConnEnvelope::decode(&env.to_vec()), Ok(env));
        }

        #[test]
        fn every_strict_prefix_of_a_frame_is_an_error(frame in arb_frame()) {
            let bytes = frame.to_vec();
            for n in 0..bytes.len() {
                prop_assert!(Frame::decode(&bytes[..n]).is_err(), "prefix {} accepted", n);
            }
        }

        #[test]
        fn every_strict_prefix_of_an_envelope_is_an_error(env in arb_envelope()) {
            let bytes = env.to_vec();
            for n in 0..bytes.len() {
                prop_assert!(ConnEnvelope::decode(&bytes[..n]).is_err(), "prefix {} accepted", n);
            }
            let caps = env.caps.map(|c| c.to_vec()).unwrap_or_default();
            for n in 0..caps.len() {
                prop_assert!(Capabilities::decode(&caps[..n]).is_err(), "caps prefix {} accepted", n);
            }
        }

        #[test]
        fn decoded_frames_reencode_to_the_same_bytes(
            bytes in prop_oneof![
                mutated(arb_frame().prop_map(|f| f.to_vec())),
                prop::collection::vec(any::<u8>(), 0..64),
                (1..=4u8, prop::collection::vec(any::<u8>(), 0..64))
                    .prop_map(|(kind, body)| frame_bytes(kind, &body)),
                // Exactly an ACK's length with a near-valid status tag: these often decode.
                (prop::collection::vec(any::<u8>(), 28), 0..8u8).prop_map(|(mut b, tag)| {
                    b.push(tag);
                    frame_bytes(KIND_ACK, &b)
                }),
            ]
        ) {
            assert_canonical(&bytes, Frame::decode, Frame::to_vec);
        }

        #[test]
        fn decoded_envelopes_and_caps_reencode_to_the_same_bytes(
            env in mutated(arb_envelope().prop_map(|e| e.to_vec())),
            caps in mutated(arb_caps().prop_map(|c| c.to_vec())),
        ) {
            assert_canonical(&env, ConnEnvelope::decode, ConnEnvelope::to_vec);
            assert_canonical(&caps, Capabilities::decode, Capabilities::to_vec);
        }
    }

    #[test]
    fn hello_round_trips_and_is_a_control_frame_but_no_msg() {
        let h = encode_hello(0x0102_0304_0506_0708);
        assert_eq!(hex(&h), "00424f554e43020508070605040302 01".replace(' ', ""));
        assert!(is_control_frame(&h));
        assert_eq!(decode_hello(&h), Some(0x0102_0304_0506_0708));
        assert_eq!(Frame::decode(&h), Err(WireError::UnknownKind { got: KIND_HELLO }));
        assert_eq!(decode_hello(&h[..15]), None);
        let mut longer = h.clone();
        longer.push(0);
        assert_eq!(decode_hello(&longer), None);
        let mut other_version = h.clone();
        other_version[6] = 3;
        assert_eq!(decode_hello(&other_version), None);
        let want = Frame { session: 1, msg: Msg::cancel(XferId(1), vec![]) }.to_vec();
        assert_eq!(decode_hello(&want), None);
    }

    #[test]
    fn frame_layout_is_pinned() {
        let frames = sample_frames();
        let [want, cancel, _, data, ack] = &frames[..] else { panic!("five samples") };
        assert_eq!(
            hex(&want.to_vec()),
            hex(&unhex(
                "00424f554e43 02 01 0100000000000000
                 2a00000000000000 02000000 6570
                 02000000 0010000000000000 2000000000000000"
            ))
        );
        assert_eq!(
            hex(&cancel.to_vec()[HEADER_LEN..]),
            format!("2a00000000000000 13000000 {} 00000000", hex(b"tcp://10.0.0.1:5555")).replace(' ', "")
        );
        assert_eq!(
            hex(&data.to_vec()),
            hex(&unhex(
                "00424f554e43 02 03 0400000000000000
                 0300000000000000 02000000 0001000000000000 4000000000000000
                 01000000
                 03 8040 20 02 20 8001"
            ))
        );
        assert_eq!(
            hex(&ack.to_vec()),
            hex(&unhex(
                "00424f554e43 02 04 0500000000000000
                 0300000000000000 02000000 0001000000000000 4000000000000000 01"
            ))
        );
    }

    /// The benchmark's DATA: 512 scattered 4 KiB pieces of a 2 MiB chunk. Fixed 44-byte runs
    /// made it 22.5 KB; delta-coded it fits one small UCX message.
    #[test]
    fn scattered_runs_are_delta_coded_compactly() {
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let runs: Vec<CopyRun> = (0..512u64)
            .map(|i| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                let slot = state % 32768; // anywhere in a 128 MiB buffer
                CopyRun {
                    region_off: i * 4096,
                    addr: 0x7f00_0000_0000 + slot * 4096,
                    len: 4096,
                    count: 1,
                    region_stride: 0,
                    addr_stride: 0,
                }
            })
            .collect();
        let data = Data { xfer: XferId(7), chunk: ChunkIdx(3), region: Region { offset: 0, len: 2 << 20 }, runs };
        let bytes = Frame { session: 1, msg: Msg::Data(data.clone()) }.to_vec();
        assert!(bytes.len() <= 3 * 1024, "{} bytes", bytes.len());
        assert_eq!(Frame::decode(&bytes).map(|f| f.msg), Ok(Msg::Data(data)));
    }

    /// Each run has exactly one encoding: a flag whose field equals the implied value, an
    /// overlong varint and an unknown flag bit are all refused.
    #[test]
    fn only_the_canonical_run_encoding_decodes() {
        let good = sample_frames()[3].to_vec();
        // The sample's one run: flags 03 (strided, new length), address delta 8040, len 20,
        // count 02, strides 20 and 8001.
        let (head, run) = good.split_at(good.len() - 8);
        assert_eq!(hex(run), "0380402002208001");
        let with = |r: &str| [head, &unhex(r)[..]].concat();
        assert!(Frame::decode(&with("0380402002208001")).is_ok());
        let not_canonical = Err(WireError::Invalid { what: "scatter run not in its canonical form" });
        assert_eq!(Frame::decode(&with("07008040 2002208001")), not_canonical, "region jump to where it ends anyway");
        assert_eq!(Frame::decode(&with("0380402001 00 00")), not_canonical, "strided flag on a single copy");
        assert_eq!(
            Frame::decode(&with("038040a000 02208001")),
            Err(WireError::Invalid { what: "varint not in its shortest form" })
        );
        assert_eq!(Frame::decode(&with("0b80402002208001")), Err(WireError::Invalid { what: "scatter run flags" }));
        assert_eq!(
            Frame::decode(&with("03 ffffffffffffffffff7f 2002208001")),
            Err(WireError::Invalid { what: "varint over 64 bits" })
        );
    }

    #[test]
    fn capabilities_and_envelope_layouts_are_pinned() {
        let caps = "0200 01 01 0010000000000000 0020000000000000 0000000000000000
                    0020000000000000 0004000000000000 0900000000000000 01000000 6b 00000000";
        assert_eq!(hex(&sample_caps().to_vec()), hex(&unhex(caps)));
        let envelopes = sample_envelopes();
        let [bare, full] = &envelopes[..] else { panic!("two samples") };
        assert_eq!(hex(&bare.to_vec()), hex(&unhex("4e58424f554e4345 0100 00 01000000 ab")));
        let caps_len = unhex(caps).len() as u32;
        let expect = format!(
            "4e58424f554e4345 0100 01 {} {} 12000000 {}",
            hex(&caps_len.to_le_bytes()),
            caps,
            hex(b"ucx-worker-address")
        );
        assert_eq!(hex(&full.to_vec()), hex(&unhex(&expect)));
    }

    #[test]
    fn samples_decode_and_every_truncation_fails() {
        for f in sample_frames() {
            let bytes = f.to_vec();
            assert_eq!(Frame::decode(&bytes).as_ref(), Ok(&f));
            for n in 0..bytes.len() {
                assert!(Frame::decode(&bytes[..n]).is_err(), "{} prefix {n}", f.msg.kind_name());
            }
        }
        assert!(matches!(Frame::decode(&[]), Err(WireError::Truncated { need: 6, have: 0 })));
    }

    #[test]
    fn foreign_bytes_are_not_control_frames() {
        assert!(!is_control_frame(b"hello from the application"));
        assert!(!is_control_frame(b"\0BOUN"));
        assert_eq!(Frame::decode(b"NXBOUNCE________"), Err(WireError::BadMagic { what: "frame" }));
        let mut bytes = sample_frames()[0].to_vec();
        bytes[0] = b'X';
        assert!(!is_control_frame(&bytes));
        assert_eq!(Frame::decode(&bytes), Err(WireError::BadMagic { what: "frame" }));
    }

    #[test]
    fn other_versions_and_kinds_are_refused() {
        let mut bytes = sample_frames()[0].to_vec();
        bytes[6] = 3;
        assert_eq!(Frame::decode(&bytes), Err(WireError::UnsupportedVersion { what: "frame", got: 3 }));
        for kind in [0, 5, 0xff] {
            let mut bytes = sample_frames()[0].to_vec();
            bytes[7] = kind;
            assert_eq!(Frame::decode(&bytes), Err(WireError::UnknownKind { got: kind }));
        }
    }

    #[test]
    fn a_body_under_another_kind_byte_is_refused() {
        let frames = sample_frames();
        for f in &frames {
            for kind in [KIND_WANT, KIND_GRANT, KIND_DATA, KIND_ACK] {
                if kind == f.msg.kind_byte() {
                    continue;
                }
                let r = Frame::decode(&frame_bytes(kind, &body_of(f)));
                assert!(r.is_err(), "{} body as kind {kind} gave {r:?}", f.msg.kind_name());
            }
        }
    }

    #[test]
    fn absurd_counts_are_refused_before_allocating() {
        let mut body = 1u64.to_le_bytes().to_vec(); // xfer
        body.extend_from_slice(&0u32.to_le_bytes()); // empty endpoint
        body.extend_from_slice(&u32::MAX.to_le_bytes()); // chunk count
        body.extend_from_slice(&[1; 8]);
        assert_eq!(
            Frame::decode(&frame_bytes(KIND_WANT, &body)),
            Err(WireError::CountTooLarge {
                what: "want chunks",
                count: u32::MAX.into(),
                max: MAX_CHUNKS_PER_WANT.into()
            })
        );
        // Under the cap but beyond the input: refused from the count alone.
        body[12..16].copy_from_slice(&MAX_CHUNKS_PER_WANT.to_le_bytes());
        assert_eq!(Frame::decode(&frame_bytes(KIND_WANT, &body)), Err(WireError::Truncated { need: 8 << 20, have: 8 }));
        let mut endpoint = 1u64.to_le_bytes().to_vec();
        endpoint.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            Frame::decode(&frame_bytes(KIND_WANT, &endpoint)),
            Err(WireError::CountTooLarge { what: "endpoint", .. })
        ));
        let mut grant = 1u64.to_le_bytes().to_vec();
        grant.extend_from_slice(&MAX_CREDITS.to_le_bytes());
        assert_eq!(
            Frame::decode(&frame_bytes(KIND_GRANT, &grant)),
            Err(WireError::Truncated { need: CREDIT_LEN << 16, have: 0 })
        );
        let mut data = body_of(&sample_frames()[3]);
        data[28..32].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            Frame::decode(&frame_bytes(KIND_DATA, &data)),
            Err(WireError::CountTooLarge { what: "data runs", .. })
        ));
        let mut env = sample_envelopes()[0].to_vec();
        env[11..15].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(ConnEnvelope::decode(&env), Err(WireError::CountTooLarge { what: "inner conn info", .. })));
    }

    #[test]
    fn trailing_bytes_are_refused() {
        let mut bytes = sample_frames()[2].to_vec();
        bytes.push(0);
        assert_eq!(Frame::decode(&bytes), Err(WireError::TrailingBytes { n: 1 }));
        let mut caps = sample_caps().to_vec();
        caps.extend_from_slice(&[0, 0]);
        assert_eq!(Capabilities::decode(&caps), Err(WireError::TrailingBytes { n: 2 }));
        let mut env = sample_envelopes()[1].to_vec();
        env.push(0);
        assert_eq!(ConnEnvelope::decode(&env), Err(WireError::TrailingBytes { n: 1 }));
    }

    #[test]
    fn invalid_values_are_refused() {
        let xfer = XferId(1);
        let chunk = ChunkIdx(0);
        let region = Region { offset: 0, len: 64 };
        let run = CopyRun { region_off: 0, addr: 0, len: 8, count: 1, region_stride: 0, addr_stride: 0 };
        let bad = [
            Msg::Want(Want { xfer, endpoint: vec![], chunks: vec![8, 0] }),
            Msg::Grant(Grant { xfer, credits: vec![] }),
            Msg::Grant(Grant { xfer, credits: vec![Credit { chunk, region: Region { offset: 0, len: 0 } }] }),
            Msg::Data(Data { xfer, chunk, region, runs: vec![] }),
            Msg::Data(Data { xfer, chunk, region: Region { offset: 0, len: 0 }, runs: vec![run] }),
            Msg::Data(Data { xfer, chunk, region, runs: vec![CopyRun { count: 0, ..run }] }),
            Msg::Data(Data { xfer, chunk, region, runs: vec![CopyRun { len: 0, ..run }] }),
            Msg::Ack(Ack { xfer, chunk, region: Region { offset: 0, len: 0 }, status: AckStatus::Failed }),
        ];
        for msg in bad {
            let frame = Frame { session: 1, msg };
            assert!(matches!(frame.msg.validate(), Err(WireError::Invalid { .. })), "{frame:?}");
            assert_eq!(Frame::decode(&frame.to_vec()), Err(frame.msg.validate().unwrap_err()));
        }
        let mut ack = sample_frames()[4].to_vec();
        *ack.last_mut().unwrap() = 3;
        assert_eq!(Frame::decode(&ack), Err(WireError::Invalid { what: "ack status tag" }));
        let mut caps = sample_caps().to_vec();
        caps[2] = 2;
        assert_eq!(Capabilities::decode(&caps), Err(WireError::Invalid { what: "control kind tag" }));
        caps[2] = 0;
        caps[3] = 7;
        assert_eq!(Capabilities::decode(&caps), Err(WireError::Invalid { what: "memory kind tag" }));
    }

    #[test]
    fn cancel_is_an_empty_want_that_keeps_its_endpoint() {
        let m = Msg::cancel(XferId(9), b"ep".to_vec());
        assert_eq!(m.xfer(), XferId(9));
        assert_eq!(m.kind_name(), "CANCEL");
        let Msg::Want(w) = &m else { panic!("cancel is a WANT") };
        assert!(w.is_cancel());
        assert_eq!(w.endpoint, b"ep");
        let back = Frame::decode(&Frame { session: 3, msg: m.clone() }.to_vec()).unwrap();
        assert_eq!(back.msg, m);
        let names: Vec<_> = sample_frames().iter().map(|f| f.msg.kind_name()).collect();
        assert_eq!(names, ["WANT", "CANCEL", "GRANT", "DATA", "ACK"]);
    }

    #[test]
    fn envelope_header_errors_are_specific() {
        let good = sample_envelopes()[1].to_vec();
        let mut b = good.clone();
        b[0] = b'x';
        assert_eq!(ConnEnvelope::decode(&b), Err(WireError::BadMagic { what: "envelope" }));
        let mut b = good.clone();
        b[8] = 2;
        assert_eq!(ConnEnvelope::decode(&b), Err(WireError::UnsupportedVersion { what: "envelope", got: 2 }));
        let mut b = good.clone();
        b[10] |= 0x02;
        assert_eq!(ConnEnvelope::decode(&b), Err(WireError::UnknownFlags { got: 0x03 }));
        let mut b = good;
        b[15] = 3; // capabilities' wire version
        assert_eq!(ConnEnvelope::decode(&b), Err(WireError::UnsupportedVersion { what: "capabilities", got: 3 }));
        // Capabilities with bytes of their own left over inside the declared length.
        let mut caps = sample_caps().to_vec();
        caps.push(0);
        let mut b = ENVELOPE_MAGIC.to_vec();
        b.extend_from_slice(&ENVELOPE_VERSION.to_le_bytes());
        b.push(FLAG_CAPS);
        b.extend_from_slice(&(caps.len() as u32).to_le_bytes());
        b.extend_from_slice(&caps);
        b.extend_from_slice(&0u32.to_le_bytes());
        assert_eq!(ConnEnvelope::decode(&b), Err(WireError::TrailingBytes { n: 1 }));
    }

    #[test]
    fn compatibility_needs_same_version_control_kind_and_max_chunk() {
        let local = sample_caps();
        let same_rules = Capabilities {
            mem: MemKind::Dram,
            arena_base: 0xdead_0000,
            arena_len: 1 << 30,
            arena_dev: 3,
            usable_capacity: 1 << 29,
            session: 77,
            arena_key: vec![1, 2, 3],
            endpoint: b"tcp://10.0.0.2:1".to_vec(),
            ..local.clone()
        };
        assert_eq!(local.compatible_with(&local), Ok(()));
        assert_eq!(local.compatible_with(&same_rules), Ok(()));
        assert_eq!(same_rules.compatible_with(&local), Ok(()));

        let other_version = Capabilities { wire_version: 3, ..local.clone() };
        let other_control = Capabilities { control: ControlKind::Ucx, ..local.clone() };
        let other_chunk = Capabilities { max_chunk: 0x800, ..local.clone() };
        assert_eq!(local.compatible_with(&other_version), Err(Incompatible::WireVersion { local: 2, peer: 3 }));
        assert_eq!(
            local.compatible_with(&other_control),
            Err(Incompatible::ControlKind { local: ControlKind::Zmq, peer: ControlKind::Ucx })
        );
        assert_eq!(local.compatible_with(&other_chunk), Err(Incompatible::MaxChunk { local: 0x400, peer: 0x800 }));
        // Several mismatches: the version is reported first, then the control kind.
        let all = Capabilities { wire_version: 3, control: ControlKind::Ucx, max_chunk: 1, ..local.clone() };
        assert!(matches!(local.compatible_with(&all), Err(Incompatible::WireVersion { .. })));
        let two = Capabilities { control: ControlKind::Ucx, max_chunk: 1, ..local.clone() };
        assert!(matches!(local.compatible_with(&two), Err(Incompatible::ControlKind { .. })));
    }

    #[test]
    fn oversized_blobs_encode_to_what_decode_refuses() {
        let big = Msg::Want(Want { xfer: XferId(1), endpoint: vec![0; MAX_BLOB as usize + 1], chunks: vec![8] });
        let err = big.validate().unwrap_err();
        assert!(matches!(err, WireError::CountTooLarge { what: "endpoint", .. }));
        assert_eq!(Frame::decode(&Frame { session: 0, msg: big }.to_vec()), Err(err));
    }

    /// Golden bytes: the exact encoding of a HELLO, of every sample message, of a capability
    /// blob and of both envelope shapes, pinned before the codec was split into `wire/`. Any
    /// change to these strings is a wire-format change and needs a new `WIRE_VERSION`.
    #[test]
    fn golden_bytes_of_every_frame_kind_caps_and_envelope() {
        let frames: Vec<String> = sample_frames().iter().map(|f| hex(&f.to_vec())).collect();
        let want = [
            // WANT
            "00424f554e4302010100000000000000 2a00000000000000 02000000 6570 02000000 0010000000000000 2000000000000000",
            // cancel (empty WANT)
            "00424f554e4302010200000000000000 2a00000000000000 13000000 7463703a2f2f31302e302e302e313a35353535 00000000",
            // GRANT
            "00424f554e4302020300000000000000 0300000000000000 02000000
             00000000 0001000000000000 4000000000000000 01000000 4001000000000000 2000000000000000",
            // DATA
            "00424f554e4302030400000000000000 0300000000000000 02000000 0001000000000000 4000000000000000
             01000000 0380402002208001",
            // ACK
            "00424f554e4302040500000000000000 0300000000000000 02000000 0001000000000000 4000000000000000 01",
        ];
        assert_eq!(frames, want.map(|w| hex(&unhex(w))));
        assert_eq!(hex(&encode_hello(0x0102_0304_0506_0708)), "00424f554e4302050807060504030201");
        let caps = "0200 01 01 0010000000000000 0020000000000000 0000000000000000 0020000000000000
                    0004000000000000 0900000000000000 01000000 6b 00000000";
        assert_eq!(hex(&sample_caps().to_vec()), hex(&unhex(caps)));
        let envelopes: Vec<String> = sample_envelopes().iter().map(|e| hex(&e.to_vec())).collect();
        assert_eq!(
            envelopes,
            [
                hex(&unhex("4e58424f554e4345 0100 00 01000000 ab")),
                hex(&unhex(&format!(
                    "4e58424f554e4345 0100 01 3d000000 {caps} 12000000 7563782d776f726b65722d61646472657373"
                ))),
            ]
        );
    }
}
