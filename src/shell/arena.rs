//! The engine's one staging arena, registered once with the inner UCX engine and shared by the
//! sender (gather staging) and receiver (RDMA target) roles: page-aligned anonymous host memory,
//! or device memory on one GPU (`bounce_arena_mem`). The core hands out regions as offsets;
//! only the copy engine and the write path turn them into addresses.

use std::sync::Arc;

use bounce_proto::gate::ArenaPlace;
use bounce_proto::wire::{Capabilities, MailboxCaps};
use bounce_proto::{ControlKind, MemKind};
use memmap2::MmapMut;

use crate::shell::copy::cpu::HostArena;
use crate::sys::cuda::{DeviceAlloc, Gpu, SmallCopies, alloc_vram};

use crate::shell::error::ArenaFault;
use crate::shell::{Error, Result};
use crate::sys::nixl::MemSeg;
use crate::sys::shim::{Md, Shim};

/// Transparent huge page size on x86-64 and most aarch64 kernels; elsewhere the alignment is
/// merely wasted slack.
const HUGE_PAGE: usize = 2 << 20;
/// Smallest page size we may meet; touching one byte per this many populates every page.
const SMALL_PAGE: usize = 4096;

/// What holds an arena's memory for its lifetime.
enum Backing {
    /// Host memory (dropping unmaps); the arena is `len` bytes of it from `base`, the first
    /// huge-page boundary.
    #[allow(dead_code)] // reason: held, never read: dropping it unmaps the arena
    Host(MmapMut),
    /// Device memory on one GPU, shared with the CUDA copy engine (which must outlive no
    /// copy into it: it synchronizes its streams when dropped, before the last reference goes).
    Gpu(Arc<DeviceAlloc>),
}

/// The arena as the reactor's own thread reads and writes it: the mailbox records it puts
/// there and the answers its one-way fetches brought in (bounce_proto::oneway). Host memory is
/// copied in place; GPU memory by small synchronous copies on a stream of their own.
pub(crate) enum ArenaBytes {
    Host(HostArena),
    Gpu(SmallCopies),
}

/// Why the reactor could not read or write the arena's bytes (the caller logs it, rate-limited:
/// a broken GPU context would fail every record).
#[derive(Debug, thiserror::Error)]
pub(crate) enum BytesFault {
    /// The range leaves the arena (a core bug: it places records and fetches inside).
    #[error("range outside the arena")]
    Outside,
    /// The device refused the copy.
    #[error(transparent)]
    Device(#[from] crate::sys::cuda::CudaError),
}

impl ArenaBytes {
    /// Copies `bytes` to byte `offset` of the arena; copies nothing when they would leave it.
    pub(crate) fn put(&self, offset: u64, bytes: &[u8]) -> std::result::Result<(), BytesFault> {
        match self {
            Self::Host(h) => h.put(offset, bytes).then_some(()).ok_or(BytesFault::Outside),
            Self::Gpu(g) => Ok(g.put(offset, bytes)?),
        }
    }

    /// `len` bytes from byte `offset` of the arena.
    pub(crate) fn get(&self, offset: u64, len: u64) -> std::result::Result<Vec<u8>, BytesFault> {
        match self {
            Self::Host(h) => h.get(offset, len).ok_or(BytesFault::Outside),
            Self::Gpu(g) => {
                let mut out = vec![0; usize::try_from(len).map_err(|_| BytesFault::Outside)?];
                g.get(offset, &mut out)?;
                Ok(out)
            }
        }
    }
}

/// A registered arena.
pub(crate) struct Arena {
    backing: Backing,
    place: ArenaPlace,
    base: u64,
    len: u64,
    md: Md,
    key: Vec<u8>,
}

impl Arena {
    /// Maps `len` bytes (lazily zeroed pages: untouched parts cost nothing) and registers them.
    ///
    /// # Errors
    /// [`Error::Arena`]: mapping or registration failed.
    pub(crate) fn new(shim: &Shim, len: u64) -> Result<Self> {
        let fault = |why| Error::Arena { len, why };
        let size = usize::try_from(len).map_err(|_| fault(ArenaFault::TooLarge))?;
        // Backed by transparent huge pages where the kernel allows them (`madvise` mode is the
        // common default): every write into or out of the arena pins its pages, and with 4 KiB
        // pages the page walks cost as much as a third of the copy (2-core machine: a 4 MiB CMA
        // write into the arena took 0.87 ms, against 0.4 ms per 4 MiB for UCX between two
        // huge-page numpy buffers). Over-mapped by one huge page so an aligned start exists.
        let mut map =
            memmap2::MmapOptions::new().len(size + HUGE_PAGE).map_anon().map_err(|e| fault(ArenaFault::Map(e)))?;
        if let Err(e) = map.advise(memmap2::Advice::HugePage) {
            tracing::debug!(error = %e, "no transparent huge pages for the arena");
        }
        let skip = map.as_ptr().align_offset(HUGE_PAGE);
        // Populated up front: the arena is a long-lived RDMA staging buffer (a NIC registration
        // would pin every page anyway), and first-touch page faults would otherwise land on the
        // first transfers' critical path (seen as 12 ms on a first 4 MiB gather). One write per
        // small page faults everything in, as huge pages where granted.
        for b in map[skip..skip + size].iter_mut().step_by(SMALL_PAGE) {
            *b = 0;
        }
        let base = map[skip..].as_mut_ptr() as u64;
        let (md, key) = shim.register(base, len, 0, MemSeg::Dram).map_err(|st| fault(ArenaFault::Register(st)))?;
        let place = ArenaPlace { mem: MemKind::Dram, dev: 0 };
        Ok(Self { backing: Backing::Host(map), place, base, len, md, key })
    }

    /// Takes `len` bytes of device memory on `gpu` and registers them as VRAM of that GPU.
    ///
    /// # Errors
    /// [`Error::Arena`]: the allocation or the registration failed.
    pub(crate) fn new_gpu(shim: &Shim, gpu: &Arc<Gpu>, len: u64) -> Result<Self> {
        let fault = |why| Error::Arena { len, why };
        let size = usize::try_from(len).map_err(|_| fault(ArenaFault::TooLarge))?;
        let alloc = Arc::new(alloc_vram(gpu, size).map_err(|e| fault(ArenaFault::Gpu(e)))?);
        let dev = u64::try_from(gpu.ordinal()).unwrap_or(0);
        let base = alloc.ptr();
        let (md, key) = shim.register(base, len, dev, MemSeg::Vram).map_err(|st| fault(ArenaFault::Register(st)))?;
        let place = ArenaPlace { mem: MemKind::Vram, dev };
        Ok(Self { backing: Backing::Gpu(alloc), place, base, len, md, key })
    }

    /// The device allocation of a GPU arena (for its copy engine); `None` for a host arena.
    pub(crate) fn device(&self) -> Option<&Arc<DeviceAlloc>> {
        match &self.backing {
            Backing::Gpu(a) => Some(a),
            Backing::Host(_) => None,
        }
    }

    /// The arena's bytes for the reactor's mailbox and fetch area, from byte `from` on (zeroed
    /// there first on a GPU, whose memory comes uninitialized). `None` when a GPU arena cannot
    /// get its copy stream: the engine then keeps no mailbox and bounces two way only.
    pub(crate) fn bytes(&self, from: u64) -> Option<ArenaBytes> {
        match &self.backing {
            // Records and fetched answers are plain copies: the scatter setting plays no part.
            Backing::Host(_) => {
                Some(ArenaBytes::Host(HostArena { base: self.base, len: self.len, streaming_scatter: false }))
            }
            Backing::Gpu(alloc) => {
                let tail = usize::try_from(self.len.saturating_sub(from)).ok()?;
                let made = SmallCopies::new(Arc::clone(alloc)).and_then(|g| g.zero(from, tail).map(|()| g));
                made.map(ArenaBytes::Gpu)
                    .map_err(|e| tracing::warn!(error = %e, "no copy stream for the GPU arena's mailbox: one way off"))
                    .ok()
            }
        }
    }

    /// Bytes of the arena backed by huge pages, from `/proc/self/smaps` (`None` where that
    /// cannot be read). Reported at start-up: without huge pages every write pays page walks.
    pub(crate) fn huge_bytes(&self) -> Option<u64> {
        if self.device().is_some() {
            return None;
        }
        let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
        let (lo, hi) = (self.base, self.base + self.len);
        let mut inside = false;
        let mut total = 0u64;
        for line in smaps.lines() {
            // A mapping header is "start-end perms ..."; its fields follow until the next one.
            if let Some((range, _)) = line.split_once(' ') {
                if let Some((a, b)) = range.split_once('-') {
                    if let (Ok(a), Ok(b)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16)) {
                        inside = a < hi && lo < b;
                        continue;
                    }
                }
            }
            if inside {
                if let Some(kb) = line.strip_prefix("AnonHugePages:") {
                    total += kb.trim().trim_end_matches("kB").trim().parse::<u64>().ok()? * 1024;
                }
            }
        }
        Some(total.min(self.len))
    }

    /// Base address.
    pub(crate) fn base(&self) -> u64 {
        self.base
    }

    /// Length in bytes.
    pub(crate) fn len(&self) -> u64 {
        self.len
    }

    /// Where the arena lives: its memory kind and GPU.
    pub(crate) fn place(&self) -> ArenaPlace {
        self.place
    }

    /// The inner engine's metadata handle for the registration.
    pub(crate) fn md(&self) -> Md {
        self.md
    }

    /// What we advertise in our connection info (`mailbox`: where one-way peers READ our
    /// answers, when we keep a mailbox).
    pub(crate) fn capabilities(
        &self,
        control: ControlKind,
        usable: u64,
        max_chunk: u64,
        session: u64,
        mailbox: Option<MailboxCaps>,
    ) -> Capabilities {
        Capabilities {
            wire_version: u16::from(bounce_proto::wire::WIRE_VERSION),
            control,
            mem: self.place.mem,
            arena_base: self.base,
            arena_len: self.len(),
            arena_dev: self.place.dev,
            usable_capacity: usable,
            max_chunk,
            session,
            arena_key: self.key.clone(),
            endpoint: Vec::new(),
            mailbox,
        }
    }

    /// Deregisters from the inner engine. Call once, after every write using it ended.
    /// Gives up the arena without handing its memory back: a peer may still write into it, and
    /// a late write must never land in memory reused for something else.
    pub(crate) fn leak(self) {
        match self.backing {
            Backing::Host(map) => std::mem::forget(map),
            Backing::Gpu(alloc) => std::mem::forget(alloc),
        }
    }

    pub(crate) fn deregister(&self, shim: &Shim) {
        if let Err(st) = shim.deregister(self.md) {
            tracing::warn!(status = %st, "deregistering the arena failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_arena_bytes_round_trip_inside_and_refuse_outside_touching_nothing() {
        let mut mem = vec![0u8; 256];
        let host = HostArena { base: mem.as_mut_ptr() as u64, len: 256, streaming_scatter: false };
        let bytes = ArenaBytes::Host(host);
        bytes.put(192, &[7; 64]).expect("the last 64 bytes are inside");
        assert_eq!(bytes.get(192, 64).expect("inside"), vec![7; 64]);
        assert!(matches!(bytes.put(193, &[9; 64]), Err(BytesFault::Outside)));
        assert!(matches!(bytes.put(u64::MAX, &[9; 1]), Err(BytesFault::Outside)), "no wrap-around");
        assert!(matches!(bytes.get(200, 64), Err(BytesFault::Outside)));
        assert!(mem[..192].iter().all(|&b| b == 0) && mem[192..].iter().all(|&b| b == 7), "nothing else written");
    }
}
