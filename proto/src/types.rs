//! Identifiers and small value types shared by every core module (the quinn `shared.rs` role):
//! newtypes so that a transfer id can never be confused with a peer id or an arena offset.

use std::fmt;

/// Alignment of each descriptor's offset inside a region, in bytes (design §4: 32 B, so that
/// the copy kernel's vectorized path applies whenever the user addresses allow it).
pub const DEFAULT_ALIGN: u64 = 32;

/// A peer agent, as numbered by the shell (which maps NIXL agent names to ids).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "fuzzing", derive(arbitrary::Arbitrary))]
pub struct PeerId(pub u64);

/// A transfer request id, chosen by the sender, monotonic and never reused within one engine
/// (the design's `rid`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "fuzzing", derive(arbitrary::Arbitrary))]
pub struct XferId(pub u64);

/// A transfer's secret: 128 random bits the sender draws for each transfer (the shell draws
/// them; the core never does, STYLE.md §1) and carries in its WANT, cancel and DATA. The
/// receiver stores it with the flow the WANT created and echoes it in every GRANT and ACK, so
/// only the two ends of the transfer know it: a frame naming the right transfer with another
/// token is a forgery (or a stale incarnation) and is dropped and counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "fuzzing", derive(arbitrary::Arbitrary))]
pub struct Token(pub u128);

/// A memory registration made through BOUNCE, as numbered by the engine that owns it and
/// published in its public metadata.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "fuzzing", derive(arbitrary::Arbitrary))]
pub struct RegId(pub u64);

/// One of an agent's arenas: its index in the list the agent advertises
/// ([`Capabilities::arenas`](crate::wire::Capabilities::arenas)). The first, id 0, is the one
/// every engine has.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "fuzzing", derive(arbitrary::Arbitrary))]
pub struct ArenaId(pub u8);

/// Most arenas one agent may advertise, so every [`ArenaId`] is below it. A real engine has
/// one per memory place it bounces through (host memory, each GPU it serves); the bound keeps
/// what a forged blob can make a peer load (one inner-engine load per arena) small.
pub const MAX_ARENAS: usize = 16;

/// A registration's secret key: random bits the owning engine draws at registration and
/// publishes only in that registration's public metadata, so holding it proves an agent was
/// given the metadata (see [`crate::proof`]).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "fuzzing", derive(arbitrary::Arbitrary))]
pub struct RegKey(pub [u8; 32]);

impl fmt::Debug for RegKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("RegKey(..)") // a secret: never in logs
    }
}

/// Index of a chunk within its transfer's plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "fuzzing", derive(arbitrary::Arbitrary))]
pub struct ChunkIdx(pub u32);

/// One independent request stream at a receiver: the design's flow key `"peer\x1f rid"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FlowKey {
    /// The sending peer.
    pub peer: PeerId,
    /// The sender's transfer id.
    pub xfer: XferId,
}

impl FlowKey {
    /// Every key of `peer`, for a range over a map ordered by key (peer first).
    pub fn all_of(peer: PeerId) -> std::ops::RangeInclusive<Self> {
        Self { peer, xfer: XferId(0) }..=Self { peer, xfer: XferId(u64::MAX) }
    }
}

/// A slice of an arena: `len` bytes at byte `offset` from the arena's base. The offset is the
/// region's handle (the design's `regionHandle`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "fuzzing", derive(arbitrary::Arbitrary))]
pub struct Region {
    /// Byte offset from the arena base.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
}

impl Region {
    /// One past the last byte of the region.
    pub fn end(&self) -> u64 {
        self.offset.saturating_add(self.len)
    }

    /// One past the last byte, `None` when that lies past 2^64 (a region no arena has, and no
    /// frame or mailbox record may carry).
    pub fn checked_end(&self) -> Option<u64> {
        self.offset.checked_add(self.len)
    }

    /// True when `[off, off + len)` lies inside this region (relative offsets, overflow-safe).
    pub fn contains_rel(&self, off: u64, len: u64) -> bool {
        off.checked_add(len).is_some_and(|end| end <= self.len)
    }
}

impl fmt::Display for Region {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "[{:#x}+{:#x}]", self.offset, self.len)
    }
}

/// A coalesced copy plan entry (the design's scatter run), used for both gather and scatter.
///
/// It stands for `count` copies of `len` bytes: copy `i` moves between
/// `region[region_off + i * region_stride ..][..len]` (offsets relative to the chunk's region)
/// and the user address `addr + i * addr_stride`. A single descriptor is `count == 1`; a
/// contiguous stretch of descriptors is merged into one longer copy; equal-length descriptors
/// advancing by constant strides on both sides are merged into one strided run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "fuzzing", derive(arbitrary::Arbitrary))]
pub struct CopyRun {
    /// Offset of the first copy within the chunk's region.
    pub region_off: u64,
    /// User address (source for gather, destination for scatter) of the first copy.
    pub addr: u64,
    /// Bytes per copy.
    pub len: u64,
    /// Number of copies (>= 1).
    pub count: u32,
    /// Distance between consecutive copies inside the region.
    pub region_stride: u64,
    /// Distance between consecutive copies at the user address.
    pub addr_stride: u64,
}

impl CopyRun {
    /// Total bytes this run moves, or `None` on overflow (possible only for hostile input).
    pub fn bytes(&self) -> Option<u64> {
        self.len.checked_mul(u64::from(self.count))
    }

    /// The region-relative byte span `[start, end)` the run touches, or `None` on overflow or
    /// `count == 0`.
    pub fn region_span(&self) -> Option<(u64, u64)> {
        Self::span(self.region_off, self.region_stride, self.len, self.count)
    }

    /// The user-address byte span `[start, end)` the run touches, or `None` on overflow or
    /// `count == 0`.
    pub fn addr_span(&self) -> Option<(u64, u64)> {
        Self::span(self.addr, self.addr_stride, self.len, self.count)
    }

    fn span(base: u64, stride: u64, len: u64, count: u32) -> Option<(u64, u64)> {
        let last = u64::from(count.checked_sub(1)?);
        let end = stride.checked_mul(last)?.checked_add(base)?.checked_add(len)?;
        Some((base, end))
    }

    /// Iterates the `(region_off, addr, len)` of each copy the run stands for.
    pub fn copies(&self) -> impl Iterator<Item = (u64, u64, u64)> + '_ {
        (0..u64::from(self.count)).map(move |i| {
            (
                self.region_off.wrapping_add(i.wrapping_mul(self.region_stride)),
                self.addr.wrapping_add(i.wrapping_mul(self.addr_stride)),
                self.len,
            )
        })
    }
}

/// Control-channel kind; both peers must use the same one (checked in the handshake).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "fuzzing", derive(arbitrary::Arbitrary))]
pub enum ControlKind {
    /// Control messages ride the inner UCX engine's notifications (default).
    Ucx,
    /// Control messages go over ZMQ/TCP.
    Zmq,
}

/// Memory kind of an arena or descriptor list, numbered as NIXL's `nixl_mem_t`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "fuzzing", derive(arbitrary::Arbitrary))]
pub enum MemKind {
    /// Host memory (`DRAM_SEG`).
    Dram,
    /// GPU memory (`VRAM_SEG`).
    Vram,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_spans_and_copies() {
        let r = CopyRun { region_off: 32, addr: 1000, len: 8, count: 3, region_stride: 8, addr_stride: 100 };
        assert_eq!(r.bytes(), Some(24));
        assert_eq!(r.region_span(), Some((32, 56)));
        assert_eq!(r.addr_span(), Some((1000, 1208)));
        let c: Vec<_> = r.copies().collect();
        assert_eq!(c, vec![(32, 1000, 8), (40, 1100, 8), (48, 1200, 8)]);
        let hostile = CopyRun { region_off: u64::MAX, addr: 0, len: 1, count: 2, region_stride: 1, addr_stride: 0 };
        assert_eq!(hostile.region_span(), None);
        let empty = CopyRun { count: 0, ..r };
        assert_eq!(empty.region_span(), None);
    }

    #[test]
    fn region_containment_is_overflow_safe() {
        let g = Region { offset: 4096, len: 1024 };
        assert!(g.contains_rel(0, 1024));
        assert!(!g.contains_rel(1, 1024));
        assert!(!g.contains_rel(u64::MAX, 2));
    }
}
