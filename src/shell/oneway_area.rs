//! The one-way area: our mailbox (the records this reactor writes and one-way peers READ) and
//! our fetch area (where our READs of peers' mailboxes land), in host memory registered with
//! the inner engine apart from the arena, whatever the arena's memory (bounce_proto::oneway).
//!
//! Host memory because both sides touch it from the CPU: the target's reactor writes each
//! 64-byte record, the initiator's reads each finished fetch. In a GPU arena each of those was a
//! synchronous device copy, and every fetch a READ of GPU memory, which UCX stages between
//! processes of one host: 296 us a fetch against 30 us from host memory (BENCHMARKS.md,
//! "Session 9").
//!
//! The core places records and fetches at its own offsets, which count past the arena's
//! scheduled part ([`OneWayLayout`]); the area starts at the mailbox's offset (its origin).

use bounce_proto::oneway::OneWayLayout;
use memmap2::MmapMut;

use crate::shell::copy::cpu::HostArena;
use crate::shell::error::ArenaFault;
use crate::shell::{Error, Result};
use crate::sys::nixl::MemSeg;
use crate::sys::shim::{Md, Shim, WriteSide};

/// Smallest page size we may meet; touching one byte per this many populates every page.
const SMALL_PAGE: usize = 4096;

/// The area, registered. Dropping it unmaps the memory: deregister it first, and drop it only
/// once no READ can touch it any more (else [`OneWayArea::leak`]).
pub(crate) struct OneWayArea {
    #[allow(dead_code)] // reason: held, never read: dropping it unmaps the area
    map: MmapMut,
    view: AreaView,
    key: Vec<u8>,
}

impl OneWayArea {
    /// Maps the area `layout` asks for and registers it as host memory.
    ///
    /// # Errors
    /// [`Error::Arena`]: mapping or registering failed.
    pub(crate) fn new(shim: &Shim, layout: &OneWayLayout) -> Result<Self> {
        let len = layout.area_len();
        let fault = |why| Error::Arena { len, why };
        let size = usize::try_from(len).map_err(|_| fault(ArenaFault::TooLarge))?;
        let mut map = MmapMut::map_anon(size).map_err(|e| fault(ArenaFault::Map(e)))?;
        // Populated now, not by the first records and fetches on a transfer's path.
        for b in map.iter_mut().step_by(SMALL_PAGE) {
            *b = 0;
        }
        let base = map.as_mut_ptr() as u64;
        let (md, key) = shim.register(base, len, 0, MemSeg::Dram).map_err(|st| fault(ArenaFault::Register(st)))?;
        let view =
            AreaView { host: HostArena { base, len, streaming_scatter: false }, origin: layout.mailbox.offset, md };
        Ok(Self { map, view, key })
    }

    /// What the reactor reads and writes through.
    pub(crate) fn view(&self) -> AreaView {
        self.view
    }

    /// The registration as our capabilities advertise it: base, length, the inner engine's
    /// public data.
    pub(crate) fn advert(&self) -> (u64, u64, Vec<u8>) {
        (self.view.host.base, self.view.host.len, self.key.clone())
    }

    /// Length in bytes.
    pub(crate) fn len(&self) -> u64 {
        self.view.host.len
    }

    /// Deregisters from the inner engine. Call once, after the reactor stopped.
    pub(crate) fn deregister(&self, shim: &Shim) {
        if let Err(st) = shim.deregister(self.view.md) {
            tracing::warn!(status = %st, "deregistering the one-way area failed");
        }
    }

    /// Gives up the area without unmapping it: a READ of ours may still land in it.
    pub(crate) fn leak(self) {
        std::mem::forget(self.map);
    }
}

/// The area as the reactor's thread uses it: records and fetched answers at the core's
/// offsets, and the local side of a fetch READ.
#[derive(Debug, Clone, Copy)]
pub(crate) struct AreaView {
    /// The mapped, registered bytes.
    pub(crate) host: HostArena,
    /// The core's offset of the area's first byte (the mailbox's).
    pub(crate) origin: u64,
    /// Inner-engine metadata of the registration.
    pub(crate) md: Md,
}

impl AreaView {
    /// Copies `bytes` to the core's offset `offset`; false, copying nothing, outside the area.
    pub(crate) fn put(&self, offset: u64, bytes: &[u8]) -> bool {
        offset.checked_sub(self.origin).is_some_and(|at| self.host.put(at, bytes))
    }

    /// `len` bytes at the core's offset `offset` (`None` outside the area).
    pub(crate) fn get(&self, offset: u64, len: u64) -> Option<Vec<u8>> {
        self.host.get(offset.checked_sub(self.origin)?, len)
    }

    /// The area at the core's offset `offset`, as the local side of a READ of `len` bytes
    /// (`None` outside the area).
    pub(crate) fn side(&self, offset: u64, len: u64) -> Option<WriteSide> {
        let at = offset.checked_sub(self.origin)?;
        at.checked_add(len).filter(|&end| end <= self.host.len)?;
        Some(WriteSide { mem: MemSeg::Dram, md: self.md, addr: self.host.base + at, dev: 0 })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_core_offsets_map_from_the_origin_and_nothing_outside_is_touched() {
        let mut mem = vec![0u8; 256];
        let host = HostArena { base: mem.as_mut_ptr() as u64, len: 256, streaming_scatter: false };
        let area = AreaView { host, origin: 1 << 20, md: Md(7) };
        assert!(area.put((1 << 20) + 192, &[7; 64]), "the last 64 bytes are inside");
        assert_eq!(area.get((1 << 20) + 192, 64), Some(vec![7; 64]));
        assert!(!area.put((1 << 20) + 193, &[9; 64]), "past the end");
        assert!(!area.put((1 << 20) - 1, &[9; 1]), "before the origin");
        assert!(!area.put(u64::MAX, &[9; 1]), "no wrap-around");
        assert_eq!(area.get((1 << 20) + 200, 64), None);
        assert!(mem[..192].iter().all(|&b| b == 0) && mem[192..].iter().all(|&b| b == 7), "nothing else written");
        let side = area.side((1 << 20) + 64, 64).expect("inside");
        assert_eq!((side.addr, side.md, side.mem, side.dev), (host.base + 64, Md(7), MemSeg::Dram, 0));
        assert!(area.side((1 << 20) + 200, 64).is_none() && area.side(0, 1).is_none());
        assert!(area.side(u64::MAX, 2).is_none());
    }
}
