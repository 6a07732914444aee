//! Registration keys (issue 10, item 7): the secrets that let a peer name our memory as a
//! bounce destination, and the ones peers gave us for theirs.
//!
//! Each registration made through this engine gets an id and a secret random key (from
//! `shell::drbg`); `getPublicData` publishes them around the inner engine's public data
//! ([`PublicData`]), so only an agent that was given the registration's metadata holds the key.
//! `loadRemoteMD` takes a peer's envelope apart, hands the inner blob to the inner engine and
//! remembers, by the inner metadata handle it returns, the key it carried; a transfer bounces
//! only when every remote descriptor's handle has one (its WANT proves them, see
//! `bounce_proto::proof`).
//!
//! A registration may also carry a [`Reach`], what a process of the same host needs to copy
//! into it without bouncing (`shell::ipc` for GPU memory, `shell::cma` for host memory): it
//! travels in the same envelope, waits under a ticket of the load that carried it until the
//! inner engine has loaded that blob, and is then kept by the inner remote handle, like the key.
//! Only that load can take it: a record that waited by the registration's id and key alone was
//! taken by the next load of any blob naming them, so an agent of this host holding another's
//! metadata could plant its own record under the other's id and key in a load that fails, and
//! our same-host transfers to the other would land in its process (review 55).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use bounce_proto::proof::Destination;
use bounce_proto::wire::{CmaRecord, IpcRecord, PUBLIC_MAGIC, PublicData, WireError};
use bounce_proto::{RegId, RegKey};
use parking_lot::Mutex;

use crate::sys::shim::{Md, MdMap};

/// Most peers' records waiting for their load at once.
const MAX_PENDING_REACH: usize = 1 << 16;

/// A peer's public data taken apart ([`Keys::split_remote`]).
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Split {
    /// The inner engine's blob.
    pub(crate) inner: Vec<u8>,
    /// The destination it proves (`None`: a blob that is not ours, proving nothing).
    pub(crate) dest: Option<Destination>,
    /// Names its same-host record until the load that carried it ends: [`Keys::remote_loaded`]
    /// with it keeps the record, [`Keys::load_failed`] drops it. 0: no record.
    pub(crate) ticket: u64,
}

/// The loads of peers' registrations a same-host request was prepared from
/// ([`Keys::reach_for_prep`]): its post copies only while every one of them is still loaded
/// ([`Keys::still_loaded`]). NIXL's `invalidateRemoteMD` (`remove_remote_agent`) unloads an
/// agent's registrations, and a request prepared before it must fail at a later post, as the
/// bounce path's does, rather than copy into a process the application no longer trusts
/// (review 55).
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(test, derive(Default))]
pub(crate) struct LoadStamp {
    /// [`Keys`]'s count of unloads and replaced loads when the request was prepared: while
    /// it has not moved, every load the request names is still there (one atomic read).
    epoch: u64,
    /// Each remote handle the request names, with the load it named.
    loads: Vec<(Md, u64)>,
}

/// What a process of the same host needs to copy into and out of a registration directly.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reach {
    /// GPU memory: map its allocation by CUDA IPC.
    Ipc(IpcRecord),
    /// Host memory: its process, for cross-memory attach.
    Cma(CmaRecord),
}

impl Reach {
    /// The CUDA IPC record, if it is one.
    pub(crate) fn ipc(&self) -> Option<IpcRecord> {
        if let Self::Ipc(r) = self { Some(*r) } else { None }
    }

    /// The CMA record, if it is one.
    pub(crate) fn cma(&self) -> Option<CmaRecord> {
        if let Self::Cma(r) = self { Some(*r) } else { None }
    }
}

/// Our registrations' ids and keys, and the keys peers published for theirs.
#[derive(Debug, Default)]
pub(crate) struct Keys {
    /// Our registrations, by the inner engine's handle.
    local: Mutex<MdMap<Destination>>,
    /// Peers' registrations we loaded, by the inner engine's remote handle.
    remote: Mutex<MdMap<Destination>>,
    /// Our registrations' same-host records, by the inner engine's handle.
    local_reach: Mutex<MdMap<Reach>>,
    /// Peers' records taken out of an envelope, waiting for the inner engine's load of that
    /// envelope, by its ticket ([`Split::ticket`]).
    pending_reach: Mutex<HashMap<u64, (Destination, Reach)>>,
    next_ticket: AtomicU64,
    /// Peers' records, by the inner engine's remote handle, with the load that kept each.
    remote_reach: Mutex<MdMap<(Reach, u64)>>,
    next_load: AtomicU64,
    /// Counts the unloads and replacements of kept records (see [`LoadStamp`]); changed only
    /// under `remote_reach`'s lock.
    reach_epoch: AtomicU64,
    next_id: AtomicU64,
    /// A blob without our envelope was loaded (logged once).
    foreign_seen: AtomicBool,
}

impl Keys {
    /// Gives our new registration `md` an id and a fresh random key. `None` when the OS has no
    /// randomness to give: the registration then has no key and is never a bounce destination.
    pub(crate) fn issue(&self, md: Md) -> Option<Destination> {
        let mut key = [0u8; 32];
        if let Err(e) = crate::shell::drbg::fill(&mut key) {
            tracing::warn!(error = %e, "no randomness for a registration key: it will never be a bounce destination");
            return None;
        }
        let dest = Destination { reg: RegId(self.next_id.fetch_add(1, Ordering::Relaxed) + 1), key: RegKey(key) };
        self.local.lock().insert(md, dest);
        Some(dest)
    }

    /// Our registration `md`'s id and key.
    pub(crate) fn local(&self, md: Md) -> Option<Destination> {
        self.local.lock().get(&md).copied()
    }

    /// Forgets our registration `md`; returns what it had.
    pub(crate) fn forget_local(&self, md: Md) -> Option<Destination> {
        self.local_reach.lock().remove(&md);
        self.local.lock().remove(&md)
    }

    /// Publishes `reach` with our registration `md` from now on.
    pub(crate) fn set_local_reach(&self, md: Md, reach: Reach) {
        self.local_reach.lock().insert(md, reach);
    }

    /// The public data to publish for our registration `md`: the inner engine's `inner`
    /// wrapped with the registration's id, key and same-host record (unwrapped when it has no
    /// key).
    pub(crate) fn public_data(&self, md: Md, inner: &[u8]) -> Vec<u8> {
        match self.local(md) {
            Some(d) => {
                let reach = self.local_reach.lock().get(&md).copied();
                let (ipc, cma) = match reach {
                    Some(Reach::Ipc(r)) => (Some(r), None),
                    Some(Reach::Cma(r)) => (None, Some(r)),
                    None => (None, None),
                };
                PublicData { reg: d.reg, key: d.key, ipc, cma, inner: inner.to_vec() }.to_vec()
            }
            None => inner.to_vec(),
        }
    }

    /// Takes a peer's public data apart: the inner engine's blob, the destination it proves,
    /// and a ticket for its same-host record, for the load of this blob only. A blob that is
    /// not ours (a peer without BOUNCE, an older build) loads as is, with no key: such
    /// destinations never bounce.
    ///
    /// # Errors
    /// A blob with our magic that does not decode (a newer layout, truncated): it would
    /// otherwise reach UCX's rkey parser.
    pub(crate) fn split_remote(&self, blob: &[u8]) -> Result<Split, WireError> {
        if !blob.starts_with(&PUBLIC_MAGIC) {
            if !self.foreign_seen.swap(true, Ordering::Relaxed) {
                tracing::info!("loading remote metadata without BOUNCE keys: transfers into it stay on UCX");
            }
            return Ok(Split { inner: blob.to_vec(), dest: None, ticket: 0 });
        }
        match PublicData::decode(blob) {
            Ok(p) => {
                let dest = Destination { reg: p.reg, key: p.key };
                let mut ticket = 0;
                if let Some(reach) = p.ipc.map(Reach::Ipc).or(p.cma.map(Reach::Cma)) {
                    ticket = self.next_ticket.fetch_add(1, Ordering::Relaxed) + 1;
                    let mut pending = self.pending_reach.lock();
                    // A load that never reports back (a caller that neither loaded nor failed)
                    // leaves its record here; bound what that costs. The records dropped only
                    // cost those loads their same-host path.
                    if pending.len() >= MAX_PENDING_REACH {
                        pending.clear();
                    }
                    pending.insert(ticket, (dest, reach));
                }
                Ok(Split { inner: p.inner, dest: Some(dest), ticket })
            }
            Err(e) => {
                // Ours by its magic, but unreadable: a newer layout or a truncated blob. Handed
                // to the inner engine it would be parsed as a UCX rkey, which UCX reads with no
                // length: refused instead.
                tracing::warn!(error = %e, "refusing a peer's BOUNCE registration metadata we cannot read");
                Err(e)
            }
        }
    }

    /// The inner engine loaded a peer's registration as `md`, carrying `dest`, from the blob
    /// whose split gave `ticket`: the record that blob carried (if any) is kept for `md`.
    pub(crate) fn remote_loaded(&self, md: Md, dest: Destination, ticket: u64) {
        let carried = (ticket != 0).then(|| self.pending_reach.lock().remove(&ticket)).flatten();
        let mut reach = self.remote_reach.lock();
        let replaced = match carried {
            Some((d, r)) if d == dest => {
                let load = self.next_load.fetch_add(1, Ordering::Relaxed) + 1;
                reach.insert(md, (r, load)).is_some()
            }
            // A handle is only ever the blob's own (a reused handle keeps no earlier record).
            _ => reach.remove(&md).is_some(),
        };
        if replaced {
            self.reach_epoch.fetch_add(1, Ordering::Release);
        }
        drop(reach);
        self.remote.lock().insert(md, dest);
    }

    /// The inner engine did not load the blob whose split gave `ticket`: its record goes.
    pub(crate) fn load_failed(&self, ticket: u64) {
        if ticket != 0 {
            self.pending_reach.lock().remove(&ticket);
        }
    }

    /// NIXL unloaded remote metadata `md`. Returns the IPC handle of its allocation when no
    /// other loaded registration names that allocation (its mapping may then go).
    pub(crate) fn remote_unloaded(&self, md: Md) -> Option<[u8; 64]> {
        self.remote.lock().remove(&md);
        let mut reach = self.remote_reach.lock();
        let (gone, _) = reach.remove(&md)?;
        self.reach_epoch.fetch_add(1, Ordering::Release);
        let gone = gone.ipc()?;
        (!reach.values().any(|(r, _)| r.ipc().is_some_and(|o| o.node == gone.node && o.handle == gone.handle)))
            .then_some(gone.handle)
    }

    /// The same-host records of the remote descriptors' registrations `mds`, run-length
    /// coded (a record and how many descriptors in a row it serves: descriptors of one
    /// registration come in runs, and a record per descriptor was ~110 bytes copied twice for
    /// each of 8192), when every one has one (`None` otherwise: no same-host path for the
    /// transfer), and the stamp of the loads they came from.
    pub(crate) fn reach_for_prep(&self, mds: impl IntoIterator<Item = Md>) -> Option<(Vec<(Reach, usize)>, LoadStamp)> {
        let remote = self.remote_reach.lock();
        let epoch = self.reach_epoch.load(Ordering::Acquire);
        let mut out: Vec<(Reach, usize)> = Vec::new();
        let mut loads: Vec<(Md, u64)> = Vec::new();
        let mut last = None;
        for md in mds {
            match out.last_mut() {
                Some((_, n)) if last == Some(md) => *n += 1,
                _ => {
                    let (r, load) = *remote.get(&md)?;
                    out.push((r, 1));
                    loads.push((md, load));
                    last = Some(md);
                }
            }
        }
        drop(remote);
        // Registrations interleaved in the list come back: each is checked once.
        loads.sort_unstable_by_key(|&(md, load)| (md.0, load));
        loads.dedup();
        Some((out, LoadStamp { epoch, loads }))
    }

    /// [`Self::reach_for_prep`]'s records alone.
    #[cfg(test)]
    fn remote_reach(&self, mds: impl IntoIterator<Item = Md>) -> Option<Vec<(Reach, usize)>> {
        self.reach_for_prep(mds).map(|(runs, _)| runs)
    }

    /// True while every load `stamp` names is still loaded: none of those registrations was
    /// unloaded (or loaded again under its handle) since the request was prepared.
    pub(crate) fn still_loaded(&self, stamp: &LoadStamp) -> bool {
        if self.reach_epoch.load(Ordering::Acquire) == stamp.epoch {
            return true;
        }
        let remote = self.remote_reach.lock();
        stamp.loads.iter().all(|(md, load)| remote.get(md).is_some_and(|(_, l)| l == load))
    }

    /// The distinct destinations the remote descriptors `mds` write into, when every one is
    /// a loaded registration with a key (`None` otherwise: the transfer stays on UCX).
    pub(crate) fn destinations(&self, mds: impl IntoIterator<Item = Md>) -> Option<Vec<Destination>> {
        let remote = self.remote.lock();
        let mut out: Vec<Destination> = Vec::new();
        let mut last = None;
        for md in mds {
            if last == Some(md) {
                continue; // descriptors of one registration come in runs: skip the lookups
            }
            last = Some(md);
            let d = *remote.get(&md)?;
            if !out.contains(&d) {
                out.push(d);
            }
        }
        Some(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Splits `blob` and reports its load as `md`, as the shim does; the destination it proved.
    fn load(keys: &Keys, blob: &[u8], md: usize) -> Option<Destination> {
        let split = keys.split_remote(blob).unwrap();
        if let Some(d) = split.dest {
            keys.remote_loaded(Md(md), d, split.ticket);
        }
        split.dest
    }

    #[test]
    fn keys_travel_in_public_data_and_prove_only_what_was_loaded() {
        let (ours, theirs) = (Keys::default(), Keys::default());
        let d = ours.issue(Md(1)).expect("randomness");
        let e = ours.issue(Md(2)).expect("randomness");
        assert_ne!(d.reg, e.reg);
        assert_ne!(d.key, e.key, "keys are random");
        let blob = ours.public_data(Md(1), b"rkey");
        let split = theirs.split_remote(&blob).unwrap();
        assert_eq!(split, Split { inner: b"rkey".to_vec(), dest: Some(d), ticket: 0 }, "no record, no ticket");
        theirs.remote_loaded(Md(10), d, split.ticket);
        assert_eq!(theirs.destinations([Md(10), Md(10)]), Some(vec![d]));
        assert_eq!(theirs.destinations([Md(10), Md(11)]), None, "md 11 was never loaded");
        // A foreign blob loads as is, proving nothing.
        assert_eq!(theirs.split_remote(b"plain"), Ok(Split { inner: b"plain".to_vec(), dest: None, ticket: 0 }));
        // Ours by its magic but unreadable (a newer version, truncated): refused, never handed
        // to the inner engine as an rkey.
        let mut newer = blob.clone();
        newer[8] = 0x7f;
        assert!(matches!(theirs.split_remote(&newer), Err(WireError::UnsupportedVersion { .. })));
        assert!(theirs.split_remote(&blob[..20]).is_err(), "truncated");
        theirs.remote_unloaded(Md(10));
        assert_eq!(theirs.destinations([Md(10)]), None);
        assert_eq!(ours.forget_local(Md(1)), Some(d));
        assert_eq!(ours.public_data(Md(1), b"rkey"), b"rkey", "no key, no envelope");
    }

    #[test]
    fn an_ipc_record_travels_with_its_key_and_is_kept_by_the_loaded_handle() {
        let (ours, theirs) = (Keys::default(), Keys::default());
        let d = ours.issue(Md(1)).expect("randomness");
        let e = ours.issue(Md(2)).expect("randomness");
        let ipc = IpcRecord { node: [1; 16], handle: [2; 64], alloc_off: 0, addr: 0x1000, len: 64 };
        ours.set_local_reach(Md(1), Reach::Ipc(ipc));
        let split = theirs.split_remote(&ours.public_data(Md(1), b"rkey")).unwrap();
        assert_eq!((split.inner.as_slice(), split.dest), (&b"rkey"[..], Some(d)));
        assert_ne!(split.ticket, 0, "a record waits under its load's ticket");
        let split_e = theirs.split_remote(&ours.public_data(Md(2), b"rkey")).unwrap();
        assert_eq!((split_e.dest, split_e.ticket), (Some(e), 0));
        assert_eq!(theirs.remote_reach([Md(10)]), None, "not loaded yet");
        theirs.remote_loaded(Md(10), d, split.ticket);
        theirs.remote_loaded(Md(11), e, split_e.ticket);
        assert_eq!(theirs.remote_reach([Md(10), Md(10)]), Some(vec![(Reach::Ipc(ipc), 2)]));
        assert_eq!(theirs.remote_reach([Md(10), Md(11)]), None, "registration 2 has no record");
        assert_eq!(theirs.remote_unloaded(Md(10)), Some([2; 64]), "the allocation's last registration");
        assert_eq!(theirs.remote_reach([Md(10)]), None);
        assert_eq!(ours.forget_local(Md(1)), Some(d));
        ours.issue(Md(1)).expect("randomness");
        load(&theirs, &ours.public_data(Md(1), b"rkey"), 12);
        assert_eq!(theirs.remote_reach([Md(12)]), None, "a forgotten registration's record is gone");
        // A host registration's CMA record travels the same way.
        let cma =
            CmaRecord { node: [1; 16], pidns: 7, pid: 42, start: 99, addr: 0x2000, len: 64, live: 0x3000, tag: 5 };
        ours.set_local_reach(Md(2), Reach::Cma(cma));
        load(&theirs, &ours.public_data(Md(2), b"rkey"), 13);
        assert_eq!(theirs.remote_reach([Md(13)]), Some(vec![(Reach::Cma(cma), 1)]));
        assert_eq!(
            theirs.remote_reach([Md(13), Md(13), Md(11), Md(13)]),
            None,
            "one descriptor without a record keeps the transfer off the same-host path"
        );
        assert_eq!(theirs.remote_unloaded(Md(13)), None, "no mapping behind a CMA record");
    }

    #[test]
    fn an_allocations_mapping_may_go_only_with_the_last_loaded_registration_that_names_it() {
        let (ours, theirs) = (Keys::default(), Keys::default());
        // Two registrations in one allocation (one handle), a third in another.
        let recs = [(1, [2; 64], 0), (2, [2; 64], 4096), (3, [3; 64], 0)];
        for (md, handle, alloc_off) in recs {
            ours.issue(Md(md)).expect("randomness");
            let r = IpcRecord { node: [1; 16], handle, alloc_off, addr: 0x10000 * md as u64, len: 64 };
            ours.set_local_reach(Md(md), Reach::Ipc(r));
            load(&theirs, &ours.public_data(Md(md), b"rkey"), 10 + md);
        }
        assert_eq!(theirs.remote_unloaded(Md(11)), None, "registration 2 still names the allocation");
        assert_eq!(theirs.remote_unloaded(Md(13)), Some([3; 64]));
        assert_eq!(theirs.remote_unloaded(Md(12)), Some([2; 64]));
        assert_eq!(theirs.remote_unloaded(Md(12)), None, "unloaded twice: nothing more to unmap");
    }

    /// Review 55 H1: agent C of this host holds A's metadata, so A's registration id and key.
    /// It publishes them with a record of its own process (its memory at A's address) in a
    /// blob whose load fails here, then we load A's own metadata, which carries no record
    /// (A's same-host path off). A's registration must not take C's record: our same-host
    /// WRITEs to A would land in C.
    #[test]
    fn a_record_is_kept_only_by_the_load_of_the_blob_that_carried_it() {
        let (a, us) = (Keys::default(), Keys::default());
        let d = a.issue(Md(1)).expect("randomness");
        let c_cma =
            CmaRecord { node: [1; 16], pidns: 7, pid: 4242, start: 99, addr: 0x2000, len: 64, live: 0x3000, tag: 5 };
        let forged = PublicData { reg: d.reg, key: d.key, ipc: None, cma: Some(c_cma), inner: b"rkey".to_vec() };
        // The forged blob's load fails in the inner engine, reported or not.
        for report in [true, false] {
            let split = us.split_remote(&forged.to_vec()).unwrap();
            assert_eq!(split.dest, Some(d));
            if report {
                us.load_failed(split.ticket);
            }
            assert_eq!(load(&us, &a.public_data(Md(1), b"rkey"), 10), Some(d));
            assert_eq!(us.remote_reach([Md(10)]), None, "A's registration must not carry C's record");
            assert_eq!(us.destinations([Md(10)]), Some(vec![d]), "it still bounces");
            us.remote_unloaded(Md(10));
        }
        // A blob's record goes only with a load of the same destination, and a handle loaded
        // again without one keeps none of its earlier load.
        let split = us.split_remote(&forged.to_vec()).unwrap();
        let other = Destination { reg: RegId(d.reg.0 + 1), key: d.key };
        us.remote_loaded(Md(11), other, split.ticket);
        assert_eq!(us.remote_reach([Md(11)]), None);
        let split = us.split_remote(&forged.to_vec()).unwrap();
        us.remote_loaded(Md(12), d, split.ticket);
        assert_eq!(us.remote_reach([Md(12)]), Some(vec![(Reach::Cma(c_cma), 1)]), "its own load keeps it");
        load(&us, &a.public_data(Md(1), b"rkey"), 12);
        assert_eq!(us.remote_reach([Md(12)]), None);
    }

    /// Review 55: a same-host request prepared before `remove_remote_agent` copied at a later
    /// post. Its stamp holds while the loads it names stay, whatever else loads or unloads,
    /// and never again once one goes, even when the same registration is loaded back under the
    /// same handle.
    #[test]
    fn a_same_host_request_is_bound_to_the_loads_it_was_prepared_from() {
        let (a, b, us) = (Keys::default(), Keys::default(), Keys::default());
        let cma =
            |pid| CmaRecord { node: [1; 16], pidns: 7, pid, start: 9, addr: 0x2000, len: 64, live: 0x3000, tag: 5 };
        for (keys, md, pid) in [(&a, 1, 40), (&a, 2, 40), (&b, 3, 41)] {
            keys.issue(Md(md)).expect("randomness");
            keys.set_local_reach(Md(md), Reach::Cma(cma(pid)));
        }
        load(&us, &a.public_data(Md(1), b"rkey"), 10);
        load(&us, &a.public_data(Md(2), b"rkey"), 11);
        let (runs, stamp) = us.reach_for_prep([Md(10), Md(11), Md(10)]).expect("records loaded");
        assert_eq!(runs.len(), 3);
        assert_eq!(stamp.loads.len(), 2, "each registration once");
        assert!(us.still_loaded(&stamp));
        // Another agent's loads and unloads leave it bound.
        load(&us, &b.public_data(Md(3), b"rkey"), 12);
        us.remote_unloaded(Md(12));
        assert_ne!(stamp.epoch, us.reach_epoch.load(Ordering::Relaxed), "the slow check runs");
        assert!(us.still_loaded(&stamp));
        // One of its registrations unloaded: never again, even loaded back at the same handle.
        us.remote_unloaded(Md(11));
        assert!(!us.still_loaded(&stamp));
        load(&us, &a.public_data(Md(2), b"rkey"), 11);
        assert!(!us.still_loaded(&stamp), "a new load is not the one it was prepared from");
        let (_, fresh) = us.reach_for_prep([Md(10), Md(11)]).expect("loaded again");
        assert!(us.still_loaded(&fresh), "a request prepared from the new load copies");
        // A handle reloaded without a record also ends the stamp's load.
        let plain = Destination { reg: RegId(77), key: RegKey([3; 32]) };
        us.remote_loaded(Md(10), plain, 0);
        assert!(!us.still_loaded(&fresh));
    }
}
