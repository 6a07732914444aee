//! The capability blob an agent publishes with its connection info (design §5), and the
//! compatibility policy over two of them: what a peer needs to decide whether bounce can be used
//! with us, and to write into our arena.

use super::codec::{Reader, Result, WireError, Writer};
use super::frame::WIRE_VERSION;
use crate::types::{ControlKind, MAX_ARENAS, MemKind};

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
    /// The peer's max chunk is not a power of two, or so much smaller than ours that planning
    /// with it ([`Capabilities::chunk_with`]) would cut our transfers into more than
    /// [`MAX_CHUNK_SHRINK`] times the chunks our own config asks for.
    #[error("max chunk {peer} is not a power of two of at least 1/{MAX_CHUNK_SHRINK} of ours ({local})")]
    MaxChunk {
        /// Our max chunk size in bytes.
        local: u64,
        /// The peer's max chunk size in bytes.
        peer: u64,
    },
}

/// How many times smaller than ours a peer's max chunk may be. Transfers with a peer are
/// planned in chunks of the smaller max chunk, so this bounds what a peer's capabilities can
/// make us plan: a hostile blob advertising 32-byte chunks would otherwise cut a 1 GiB transfer
/// into 32 million chunks (gigabytes of plan) in our process.
pub const MAX_CHUNK_SHRINK: u64 = 1024;

/// An agent's bounce capability blob, published with its connection info (design §5): what a
/// peer needs to decide whether bounce can be used with it and to write into its arenas.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "fuzzing", derive(arbitrary::Arbitrary))]
pub struct Capabilities {
    /// Wire version spoken (the frame header's version, widened).
    pub wire_version: u16,
    /// Control channel kind.
    pub control: ControlKind,
    /// The owner engine's instance nonce (as in frame headers).
    pub session: u64,
    /// The arenas peers may write into and read from, one per memory place; a frame names one
    /// by its index in this list (an [`ArenaId`](crate::types::ArenaId)).
    pub arenas: Arenas,
    /// The control endpoint (a ZMQ endpoint), or empty.
    pub endpoint: Vec<u8>,
    /// The mailbox one-way peers READ our answers from (docs/one-way.md), when we keep one.
    pub mailbox: Option<MailboxCaps>,
    /// Address of the first byte of the registration the mailbox lies in: host memory of its
    /// own, whatever the arenas' memory (a GPU arena's records would otherwise cost a device
    /// copy each, and every fetch a READ of GPU memory). 0 without a mailbox.
    pub mailbox_base: u64,
    /// Length of that registration in bytes (0 without a mailbox).
    pub mailbox_len: u64,
    /// The inner UCX engine's public data for that registration (empty without a mailbox).
    pub mailbox_key: Vec<u8>,
    /// The owner's no-progress timeout (`bounce_request_timeout_ms`), at least 1 ms. Its
    /// leases on the regions it grants run by it (an unwritten region is taken back after half
    /// of it), so a peer keeps a credit of ours no longer than our timeout allows, whatever
    /// its own (since wire version 16: with timeouts that differed, a slow write could land in
    /// a region granted since to another transfer).
    pub request_timeout_ms: u64,
}

/// One arena as its owner advertises it: where it lies, how much of it regions may use, the
/// largest chunk it moves and takes, and the key a peer's inner engine needs to reach it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "fuzzing", derive(arbitrary::Arbitrary))]
pub struct ArenaCaps {
    /// Memory kind of the arena.
    pub mem: MemKind,
    /// Device id of the arena (the GPU's ordinal for GPU memory, 0 for host memory).
    pub dev: u64,
    /// Address of the arena's first byte in the owner's address space.
    pub base: u64,
    /// Arena length in bytes.
    pub len: u64,
    /// Bytes of the arena usable for regions.
    pub usable_capacity: u64,
    /// Largest chunk in bytes this arena moves and takes. The two sides' may differ: an
    /// initiator plans its transfers with the smaller of its staging arena's and the peer's
    /// (see [`Self::chunk_with`]).
    pub max_chunk: u64,
    /// The inner UCX engine's public data for the arena registration (remote key).
    pub key: Vec<u8>,
}

impl ArenaCaps {
    /// The largest chunk of a transfer staged in `self` (ours) and bounced through `peer`
    /// (theirs), either way: the smaller max chunk, so that both arenas can always hold it.
    pub fn chunk_with(&self, peer: &Self) -> u64 {
        self.max_chunk.min(peer.max_chunk)
    }

    fn encode(&self, w: &mut Writer<'_>) {
        w.u8(mem_tag(self.mem));
        for v in [self.dev, self.base, self.len, self.usable_capacity, self.max_chunk] {
            w.u64(v);
        }
        w.blob(&self.key);
    }

    fn decode(r: &mut Reader<'_>) -> Result<Self> {
        Ok(Self {
            mem: mem_from_tag(r.u8()?)?,
            dev: r.u64()?,
            base: r.u64()?,
            len: r.u64()?,
            usable_capacity: r.u64()?,
            max_chunk: r.u64()?,
            key: r.blob("arena key")?,
        })
    }
}

/// An agent's arenas: never empty, at most [`MAX_ARENAS`]. The first is the one every engine
/// has (its `bounce_arena_mem`); an index into the list is an
/// [`ArenaId`](crate::types::ArenaId).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Arenas {
    first: ArenaCaps,
    rest: Vec<ArenaCaps>,
}

impl Arenas {
    /// One arena.
    pub fn one(arena: ArenaCaps) -> Self {
        Self { first: arena, rest: Vec::new() }
    }

    /// The list `arenas`, when it has 1 to [`MAX_ARENAS`] of them.
    pub fn new(arenas: Vec<ArenaCaps>) -> Option<Self> {
        let mut it = arenas.into_iter();
        let first = it.next()?;
        let rest: Vec<_> = it.collect();
        (rest.len() < MAX_ARENAS).then_some(Self { first, rest })
    }

    /// The first arena.
    pub fn first(&self) -> &ArenaCaps {
        &self.first
    }

    /// The first arena, to change it (tests and simulations describe peers with it).
    pub fn first_mut(&mut self) -> &mut ArenaCaps {
        &mut self.first
    }

    /// The arena with index `id`, if there is one.
    pub fn get(&self, id: crate::types::ArenaId) -> Option<&ArenaCaps> {
        match usize::from(id.0) {
            0 => Some(&self.first),
            i => self.rest.get(i - 1),
        }
    }

    /// How many arenas.
    #[allow(clippy::len_without_is_empty)] // never empty
    pub fn len(&self) -> usize {
        1 + self.rest.len()
    }

    /// The arenas with their ids, first to last.
    pub fn iter(&self) -> impl Iterator<Item = (crate::types::ArenaId, &ArenaCaps)> {
        // At most MAX_ARENAS (16) entries, so every index fits a u8.
        std::iter::once(&self.first).chain(&self.rest).enumerate().map(|(i, a)| (crate::types::ArenaId(i as u8), a))
    }
}

#[cfg(feature = "fuzzing")]
impl<'a> arbitrary::Arbitrary<'a> for Arenas {
    fn arbitrary(u: &mut arbitrary::Unstructured<'a>) -> arbitrary::Result<Self> {
        let first = u.arbitrary()?;
        let mut rest: Vec<ArenaCaps> = u.arbitrary()?;
        rest.truncate(MAX_ARENAS - 1);
        Ok(Self { first, rest })
    }
}

/// Where and how large an agent's mailbox is: `slots` rings of `ring` 64-byte records, starting
/// `offset` bytes into the registration [`Capabilities::mailbox_base`] names. Advertised by
/// an agent that answers one-way WANTs; a peer that loaded its metadata may then bounce to it
/// without it ever loading the peer's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "fuzzing", derive(arbitrary::Arbitrary))]
pub struct MailboxCaps {
    /// Byte offset of the mailbox in its registration.
    pub offset: u64,
    /// Number of slots.
    pub slots: u32,
    /// Records per slot.
    pub ring: u32,
}

impl Capabilities {
    /// The capabilities of one host arena of `capacity` usable bytes at address 0, on this build's
    /// wire version and the UCX control channel, chunks of `max_chunk`, instance `session`, the
    /// default 30 s timeout; no keys, no ZMQ endpoint, no mailbox. What a simulated peer publishes (simulations, examples,
    /// fuzzers, tests), with struct update syntax for anything else. A real engine describes
    /// its own arena instead.
    pub fn host_arena(capacity: u64, max_chunk: u64, session: u64) -> Self {
        Self {
            wire_version: WIRE_VERSION.into(),
            control: ControlKind::Ucx,
            session,
            arenas: Arenas::one(ArenaCaps {
                mem: MemKind::Dram,
                dev: 0,
                base: 0,
                len: capacity,
                usable_capacity: capacity,
                max_chunk,
                key: Vec::new(),
            }),
            endpoint: Vec::new(),
            mailbox: None,
            mailbox_base: 0,
            mailbox_len: 0,
            mailbox_key: Vec::new(),
            request_timeout_ms: 30_000, // bounce_request_timeout_ms's default
        }
    }

    /// The owner's no-progress timeout ([`Self::request_timeout_ms`]).
    pub fn request_timeout(&self) -> std::time::Duration {
        std::time::Duration::from_millis(self.request_timeout_ms)
    }

    /// Appends the blob's encoding to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        let mut w = Writer(out);
        w.u16(self.wire_version);
        w.u8(control_tag(self.control));
        w.u64(self.session);
        // At most MAX_ARENAS (16): the count fits a byte.
        w.u8(self.arenas.len() as u8);
        for (_, arena) in self.arenas.iter() {
            arena.encode(&mut w);
        }
        w.blob(&self.endpoint);
        // No mailbox: all zero (a mailbox has at least one slot).
        let m = self.mailbox.unwrap_or(MailboxCaps { offset: 0, slots: 0, ring: 0 });
        w.u64(m.offset);
        w.u32(m.slots);
        w.u32(m.ring);
        w.u64(self.mailbox_base);
        w.u64(self.mailbox_len);
        w.blob(&self.mailbox_key);
        w.u64(self.request_timeout_ms);
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
            session: r.u64()?,
            arenas: {
                let n = usize::from(r.u8()?);
                if n == 0 || n > MAX_ARENAS {
                    return Err(WireError::Invalid { what: "arena count" });
                }
                let arenas = (0..n).map(|_| ArenaCaps::decode(&mut r)).collect::<Result<Vec<_>>>()?;
                Arenas::new(arenas).ok_or(WireError::Invalid { what: "arena count" })?
            },
            endpoint: r.blob("endpoint")?,
            mailbox: {
                let (offset, slots, ring) = (r.u64()?, r.u32()?, r.u32()?);
                if slots == 0 && (offset != 0 || ring != 0) {
                    // "No mailbox" has one encoding only, so decoding and encoding agree.
                    return Err(WireError::Invalid { what: "mailbox fields without slots" });
                }
                (slots != 0).then_some(MailboxCaps { offset, slots, ring })
            },
            mailbox_base: r.u64()?,
            mailbox_len: r.u64()?,
            mailbox_key: r.blob("mailbox key")?,
            request_timeout_ms: match r.u64()? {
                0 => return Err(WireError::Invalid { what: "request timeout of 0" }),
                ms => ms,
            },
        };
        if caps.mailbox.is_none() && (caps.mailbox_base != 0 || caps.mailbox_len != 0 || !caps.mailbox_key.is_empty()) {
            return Err(WireError::Invalid { what: "mailbox registration without a mailbox" });
        }
        r.finish()?;
        Ok(caps)
    }

    /// Whether bounce may be used between us (`self`) and `peer`: wire version and control
    /// kind must match (design §5); every arena's max chunk must be a power of two of at least
    /// 1/[`MAX_CHUNK_SHRINK`] of our largest. Arena geometry, memory kind and max chunk may
    /// differ.
    ///
    /// The design asks for equal max chunks, because each side planned with its own. Here
    /// only the initiator plans, and with [`ArenaCaps::chunk_with`] the peer's arena, so every
    /// chunk fits both arenas' largest regions (each side's config clamps its max chunk to
    /// them). That lets a host-arena engine (2 MiB chunks by default) bounce with a GPU-arena
    /// one (32 MiB). One bad arena rules out the whole peer: a real engine never advertises one,
    /// so such a blob is broken or forged.
    ///
    /// # Errors
    /// The first mismatch, in the order version, control kind, max chunk (first bad arena).
    pub fn compatible_with(&self, peer: &Self) -> Result<(), Incompatible> {
        if self.wire_version != peer.wire_version {
            return Err(Incompatible::WireVersion { local: self.wire_version, peer: peer.wire_version });
        }
        if self.control != peer.control {
            return Err(Incompatible::ControlKind { local: self.control, peer: peer.control });
        }
        let ours = self.arenas.iter().map(|(_, a)| a.max_chunk).max().unwrap_or(0);
        for (_, arena) in peer.arenas.iter() {
            if !arena.max_chunk.is_power_of_two() || arena.max_chunk < ours / MAX_CHUNK_SHRINK {
                return Err(Incompatible::MaxChunk { local: ours, peer: arena.max_chunk });
            }
        }
        Ok(())
    }

    /// The largest chunk of a transfer between our first arena and the peer's, either way
    /// ([`ArenaCaps::chunk_with`]).
    pub fn chunk_with(&self, peer: &Self) -> u64 {
        self.arenas.first().chunk_with(peer.arenas.first())
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
