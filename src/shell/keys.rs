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
//! travels in the same envelope, waits by the registration's id and key until the inner engine
//! has loaded the blob, and is then kept by the inner remote handle, like the key.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use bounce_proto::proof::Destination;
use bounce_proto::wire::{CmaRecord, IpcRecord, PUBLIC_MAGIC, PublicData, WireError};
use bounce_proto::{RegId, RegKey};
use parking_lot::Mutex;

use crate::sys::shim::{Md, MdMap};

/// Most peers' records waiting for their load at once.
const MAX_PENDING_REACH: usize = 1 << 16;

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
    /// Peers' records taken out of an envelope, waiting for the inner engine's load.
    pending_reach: Mutex<HashMap<Destination, Reach>>,
    /// Peers' records, by the inner engine's remote handle.
    remote_reach: Mutex<MdMap<Reach>>,
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

    /// Takes a peer's public data apart: the inner engine's blob, and the destination it
    /// proves. A blob that is not ours (a peer without BOUNCE, an older build) loads as is,
    /// with no key: such destinations never bounce.
    ///
    /// # Errors
    /// A blob with our magic that does not decode (a newer layout, truncated): it would
    /// otherwise reach UCX's rkey parser.
    pub(crate) fn split_remote(&self, blob: &[u8]) -> Result<(Vec<u8>, Option<Destination>), WireError> {
        if !blob.starts_with(&PUBLIC_MAGIC) {
            if !self.foreign_seen.swap(true, Ordering::Relaxed) {
                tracing::info!("loading remote metadata without BOUNCE keys: transfers into it stay on UCX");
            }
            return Ok((blob.to_vec(), None));
        }
        match PublicData::decode(blob) {
            Ok(p) => {
                let dest = Destination { reg: p.reg, key: p.key };
                if let Some(reach) = p.ipc.map(Reach::Ipc).or(p.cma.map(Reach::Cma)) {
                    let mut pending = self.pending_reach.lock();
                    // A blob whose load failed leaves its record here; bound what that costs.
                    if pending.len() >= MAX_PENDING_REACH {
                        pending.clear();
                    }
                    pending.insert(dest, reach);
                }
                Ok((p.inner, Some(dest)))
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

    /// The inner engine loaded a peer's registration as `md`, carrying `dest`.
    pub(crate) fn remote_loaded(&self, md: Md, dest: Destination) {
        if let Some(reach) = self.pending_reach.lock().remove(&dest) {
            self.remote_reach.lock().insert(md, reach);
        }
        self.remote.lock().insert(md, dest);
    }

    /// NIXL unloaded remote metadata `md`. Returns the IPC handle of its allocation when no
    /// other loaded registration names that allocation (its mapping may then go).
    pub(crate) fn remote_unloaded(&self, md: Md) -> Option<[u8; 64]> {
        self.remote.lock().remove(&md);
        let mut reach = self.remote_reach.lock();
        let gone = reach.remove(&md)?.ipc()?;
        (!reach.values().any(|r| r.ipc().is_some_and(|o| o.node == gone.node && o.handle == gone.handle)))
            .then_some(gone.handle)
    }

    /// The same-host records of the remote descriptors' registrations `mds`, run-length
    /// coded (a record and how many descriptors in a row it serves: descriptors of one
    /// registration come in runs, and a record per descriptor was ~110 bytes copied twice for
    /// each of 8192), when every one has one (`None` otherwise: no same-host path for the
    /// transfer).
    pub(crate) fn remote_reach(&self, mds: impl IntoIterator<Item = Md>) -> Option<Vec<(Reach, usize)>> {
        let remote = self.remote_reach.lock();
        let mut out: Vec<(Reach, usize)> = Vec::new();
        let mut last = None;
        for md in mds {
            match out.last_mut() {
                Some((_, n)) if last == Some(md) => *n += 1,
                _ => {
                    out.push((*remote.get(&md)?, 1));
                    last = Some(md);
                }
            }
        }
        Some(out)
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

    #[test]
    fn keys_travel_in_public_data_and_prove_only_what_was_loaded() {
        let (ours, theirs) = (Keys::default(), Keys::default());
        let d = ours.issue(Md(1)).expect("randomness");
        let e = ours.issue(Md(2)).expect("randomness");
        assert_ne!(d.reg, e.reg);
        assert_ne!(d.key, e.key, "keys are random");
        let blob = ours.public_data(Md(1), b"rkey");
        let (inner, got) = theirs.split_remote(&blob).unwrap();
        assert_eq!((inner.as_slice(), got), (&b"rkey"[..], Some(d)));
        theirs.remote_loaded(Md(10), d);
        assert_eq!(theirs.destinations([Md(10), Md(10)]), Some(vec![d]));
        assert_eq!(theirs.destinations([Md(10), Md(11)]), None, "md 11 was never loaded");
        // A foreign blob loads as is, proving nothing.
        assert_eq!(theirs.split_remote(b"plain"), Ok((b"plain".to_vec(), None)));
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
        let (inner, got) = theirs.split_remote(&ours.public_data(Md(1), b"rkey")).unwrap();
        assert_eq!((inner.as_slice(), got), (&b"rkey"[..], Some(d)));
        let (_, got_e) = theirs.split_remote(&ours.public_data(Md(2), b"rkey")).unwrap();
        assert_eq!(got_e, Some(e));
        assert_eq!(theirs.remote_reach([Md(10)]), None, "not loaded yet");
        theirs.remote_loaded(Md(10), d);
        theirs.remote_loaded(Md(11), e);
        assert_eq!(theirs.remote_reach([Md(10), Md(10)]), Some(vec![(Reach::Ipc(ipc), 2)]));
        assert_eq!(theirs.remote_reach([Md(10), Md(11)]), None, "registration 2 has no record");
        assert_eq!(theirs.remote_unloaded(Md(10)), Some([2; 64]), "the allocation's last registration");
        assert_eq!(theirs.remote_reach([Md(10)]), None);
        assert_eq!(ours.forget_local(Md(1)), Some(d));
        ours.issue(Md(1)).expect("randomness");
        let (_, again) = theirs.split_remote(&ours.public_data(Md(1), b"rkey")).unwrap();
        theirs.remote_loaded(Md(12), again.unwrap());
        assert_eq!(theirs.remote_reach([Md(12)]), None, "a forgotten registration's record is gone");
        // A host registration's CMA record travels the same way.
        let cma =
            CmaRecord { node: [1; 16], pidns: 7, pid: 42, start: 99, addr: 0x2000, len: 64, live: 0x3000, tag: 5 };
        ours.set_local_reach(Md(2), Reach::Cma(cma));
        let (_, got) = theirs.split_remote(&ours.public_data(Md(2), b"rkey")).unwrap();
        theirs.remote_loaded(Md(13), got.unwrap());
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
            let (_, got) = theirs.split_remote(&ours.public_data(Md(md), b"rkey")).unwrap();
            theirs.remote_loaded(Md(10 + md), got.unwrap());
        }
        assert_eq!(theirs.remote_unloaded(Md(11)), None, "registration 2 still names the allocation");
        assert_eq!(theirs.remote_unloaded(Md(13)), Some([3; 64]));
        assert_eq!(theirs.remote_unloaded(Md(12)), Some([2; 64]));
        assert_eq!(theirs.remote_unloaded(Md(12)), None, "unloaded twice: nothing more to unmap");
    }
}
