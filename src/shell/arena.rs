//! The engine's one staging arena in host memory: page-aligned anonymous memory, registered once
//! with the inner UCX engine, shared by the sender (gather staging) and receiver (RDMA target)
//! roles. The core hands out regions as offsets; only the copy workers and the write path turn
//! them into addresses.

use bounce_proto::wire::Capabilities;
use bounce_proto::{ControlKind, MemKind};
use memmap2::MmapMut;

use crate::ffi::shim::{Md, Shim};

/// A registered host arena.
pub(super) struct Arena {
    map: MmapMut,
    base: u64,
    md: Md,
    key: Vec<u8>,
}

impl Arena {
    /// Maps `len` bytes (lazily zeroed pages: untouched parts cost nothing) and registers them.
    ///
    /// # Errors
    /// A description of what failed (mapping or registration).
    pub(super) fn new(shim: &Shim, len: u64) -> Result<Self, String> {
        let size = usize::try_from(len).map_err(|_| format!("arena size {len} does not fit"))?;
        // Populated up front: the arena is a long-lived RDMA staging buffer (a NIC registration
        // would pin every page anyway), and first-touch page faults would otherwise land on the
        // first transfers' critical path (seen as 12 ms on a first 4 MiB gather).
        let mut map = memmap2::MmapOptions::new()
            .len(size)
            .populate()
            .map_anon()
            .map_err(|e| format!("mapping the {len}-byte arena failed: {e}"))?;
        let base = map.as_mut_ptr() as u64;
        let (md, key) = shim
            .register(base, len, 0, 0)
            .map_err(|st| format!("registering the arena with UCX failed (status {st})"))?;
        Ok(Self { map, base, md, key })
    }

    /// Base address.
    pub(super) fn base(&self) -> u64 {
        self.base
    }

    /// Length in bytes.
    pub(super) fn len(&self) -> u64 {
        self.map.len() as u64
    }

    /// The inner engine's metadata handle for the registration.
    pub(super) fn md(&self) -> Md {
        self.md
    }

    /// What we advertise in our connection info.
    pub(super) fn capabilities(&self, control: ControlKind, usable: u64, max_chunk: u64, session: u64) -> Capabilities {
        Capabilities {
            wire_version: u16::from(bounce_proto::wire::WIRE_VERSION),
            control,
            mem: MemKind::Dram,
            arena_base: self.base,
            arena_len: self.len(),
            arena_dev: 0,
            usable_capacity: usable,
            max_chunk,
            session,
            arena_key: self.key.clone(),
            endpoint: Vec::new(),
        }
    }

    /// Deregisters from the inner engine. Call once, after every write using it ended.
    pub(super) fn deregister(&self, shim: &Shim) {
        let st = shim.deregister(self.md);
        if st != 0 {
            tracing::warn!(status = st, "deregistering the arena failed");
        }
    }
}
