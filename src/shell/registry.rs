//! The registrations made through this engine, kept in one place: the application threads
//! record them, the gate reads them (may a chunk be written straight from user memory?), the
//! reactor resolves a direct write's source from them and feeds the core's own copy (the
//! receiver's scatter check, which stays in the core).

use std::sync::atomic::AtomicUsize;
use std::sync::atomic::Ordering::Relaxed;

use bounce_proto::MemKind;
use bounce_proto::gate::ArenaPlace;
use parking_lot::Mutex;

use crate::sys::shim::{Md, MdMap, MdSet};

/// A registration made through this engine (the receiver only ever scatters into these).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Registration {
    /// Start address.
    pub(crate) addr: u64,
    /// Length in bytes.
    pub(crate) len: u64,
    /// Device id (GPU ordinal for VRAM).
    pub(crate) dev: u64,
    /// Memory kind.
    pub(crate) mem: MemKind,
}

impl Registration {
    /// True when this registration is memory the arena at `place` can copy to and from: the
    /// same kind, and for GPU memory the arena's own GPU (a CPU copy must never touch a GPU
    /// address, nor a kernel another GPU's).
    pub(crate) fn serves(&self, place: ArenaPlace) -> bool {
        self.mem == place.mem && (place.mem == MemKind::Dram || self.dev == place.dev)
    }

    /// True when `[addr, addr + len)` lies inside this registration and it [`Self::serves`]
    /// the arena at `place`.
    fn covers(&self, place: ArenaPlace, addr: u64, len: u64) -> bool {
        self.serves(place) && addr.checked_add(len).is_some_and(|end| self.addr <= addr && end <= self.addr + self.len)
    }
}

/// The one table of registrations, keyed by the inner engine's metadata handle.
#[derive(Debug, Default)]
pub(crate) struct Registry {
    table: Mutex<MdMap<Registration>>,
    /// The table's length, stored under its lock by every change: a polling application's
    /// stats refresh reads it without taking the lock (issue 12).
    len: AtomicUsize,
    /// Registrations of GPU memory that is not on the GPU their device id names (see
    /// [`Self::set_misplaced`]), and how many (read without the lock: almost always 0).
    misplaced: Mutex<MdSet>,
    misplaced_len: AtomicUsize,
}

impl Registry {
    /// Records a registration.
    pub(crate) fn insert(&self, md: Md, reg: Registration) {
        let mut t = self.table.lock();
        t.insert(md, reg);
        self.len.store(t.len(), Relaxed);
    }

    /// Forgets a registration; returns it.
    pub(crate) fn remove(&self, md: Md) -> Option<Registration> {
        let mut t = self.table.lock();
        let r = t.remove(&md);
        self.len.store(t.len(), Relaxed);
        if self.misplaced_len.load(Relaxed) > 0 {
            let mut m = self.misplaced.lock();
            m.remove(&md);
            self.misplaced_len.store(m.len(), Relaxed);
        }
        r
    }

    /// Marks registration `md` as GPU memory whose device id is not the GPU it is on: no
    /// kernel of ours may touch it (one launched on the named GPU would fault, and leave that
    /// GPU's context, the application's, unusable), so transfers from it go to UCX.
    pub(crate) fn set_misplaced(&self, md: Md) {
        let mut m = self.misplaced.lock();
        m.insert(md);
        self.misplaced_len.store(m.len(), Relaxed);
    }

    /// Whether one of the registrations `mds` is [misplaced](Self::set_misplaced); costs one
    /// atomic load while none is.
    pub(crate) fn any_misplaced(&self, mut mds: impl Iterator<Item = Md>) -> bool {
        if self.misplaced_len.load(Relaxed) == 0 {
            return false;
        }
        let m = self.misplaced.lock();
        mds.any(|md| m.contains(&md))
    }

    /// How many there are (as of the last change; no lock).
    pub(crate) fn len(&self) -> usize {
        self.len.load(Relaxed)
    }

    /// Every registration, for replay to a reactor that starts after them.
    pub(crate) fn all(&self) -> Vec<(Md, Registration)> {
        self.table.lock().iter().map(|(m, r)| (*m, *r)).collect()
    }

    /// Every registration, as the core's gate takes them.
    pub(crate) fn for_gate(&self) -> Vec<bounce_proto::gate::Registration> {
        let t = self.table.lock();
        t.values().map(|r| bounce_proto::gate::Registration { addr: r.addr, len: r.len, mem: r.mem }).collect()
    }

    /// The registration the arena at `place` serves that holds all of `[addr, addr + len)`,
    /// with its handle.
    pub(crate) fn covering(&self, place: ArenaPlace, addr: u64, len: u64) -> Option<(Md, Registration)> {
        self.table.lock().iter().find(|(_, r)| r.covers(place, addr, len)).map(|(m, r)| (*m, *r))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_one_registration_of_the_arenas_memory_covering_the_whole_range_counts() {
        let host = ArenaPlace { mem: MemKind::Dram, dev: 0 };
        let gpu1 = ArenaPlace { mem: MemKind::Vram, dev: 1 };
        let r = Registry::default();
        r.insert(Md(1), Registration { addr: 1000, len: 100, dev: 0, mem: MemKind::Dram });
        r.insert(Md(2), Registration { addr: 5000, len: 100, dev: 1, mem: MemKind::Vram });
        r.insert(Md(3), Registration { addr: 9000, len: 100, dev: 0, mem: MemKind::Vram });
        assert_eq!(r.covering(host, 1000, 100).map(|(m, _)| m), Some(Md(1)));
        assert_eq!(r.covering(host, 1050, 50).map(|(m, _)| m), Some(Md(1)));
        assert!(r.covering(host, 1050, 51).is_none(), "past the end");
        assert!(r.covering(host, 999, 2).is_none(), "before the start");
        assert!(r.covering(host, 5000, 10).is_none(), "GPU memory is never a CPU write source");
        assert!(r.covering(host, u64::MAX - 1, 10).is_none(), "no overflow");
        assert_eq!(r.covering(gpu1, 5000, 10).map(|(m, _)| m), Some(Md(2)));
        assert!(r.covering(gpu1, 9000, 10).is_none(), "another GPU's memory is not this arena's");
        assert!(r.covering(gpu1, 1000, 10).is_none(), "host memory is not a GPU arena's");
        let serving = |p| r.all().iter().filter(|(_, reg)| reg.serves(p)).count();
        assert_eq!((serving(host), serving(gpu1)), (1, 1));
        assert_eq!(r.len(), 3);
        assert!(r.remove(Md(1)).is_some());
        assert!(r.covering(host, 1000, 100).is_none());
    }

    #[test]
    fn a_misplaced_registration_is_found_among_a_requests_until_it_is_removed() {
        let r = Registry::default();
        r.insert(Md(2), Registration { addr: 5000, len: 100, dev: 1, mem: MemKind::Vram });
        r.insert(Md(3), Registration { addr: 9000, len: 100, dev: 0, mem: MemKind::Vram });
        assert!(!r.any_misplaced([Md(2), Md(3)].into_iter()));
        r.set_misplaced(Md(2));
        assert!(r.any_misplaced([Md(3), Md(2)].into_iter()));
        assert!(!r.any_misplaced([Md(3), Md(3)].into_iter()));
        assert!(r.remove(Md(2)).is_some());
        assert!(!r.any_misplaced([Md(2)].into_iter()), "forgotten with its registration");
    }
}
