//! The engine's one staging arena, registered once with the inner UCX engine and shared by the
//! sender (gather staging) and receiver (RDMA target) roles: page-aligned anonymous host memory,
//! or device memory on one GPU (`bounce_arena_mem`). The core hands out regions as offsets;
//! only the copy engine and the write path turn them into addresses.

use std::sync::Arc;

use bounce_proto::MemKind;
use bounce_proto::gate::ArenaPlace;
use bounce_proto::wire::ArenaCaps;
use memmap2::MmapMut;

use crate::sys::cuda::{DeviceAlloc, Gpu, alloc_vram};

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
        // Zeroed before it is registered: cuMemAlloc may hand back memory this process freed
        // (activations, another request's KV), and any agent given our connection info may
        // READ any region of the arena (review 56; a host arena is fresh zero pages). Once, at
        // creation.
        alloc.fill(0).map_err(|e| fault(ArenaFault::Gpu(e)))?;
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

    /// This arena as our capabilities list it, with `usable` bytes and chunks of at most
    /// `max_chunk` (its options').
    pub(crate) fn advert(&self, usable: u64, max_chunk: u64) -> ArenaCaps {
        ArenaCaps {
            mem: self.place.mem,
            dev: self.place.dev,
            base: self.base,
            len: self.len,
            usable_capacity: usable,
            max_chunk,
            key: self.key.clone(),
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
