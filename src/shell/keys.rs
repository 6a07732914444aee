//! Registration keys (issue 10, item 7): the secrets that let a peer name our memory as a
//! bounce destination, and the ones peers gave us for theirs.
//!
//! Each registration made through this engine gets an id and a random key; `getPublicData`
//! publishes them around the inner engine's public data ([`PublicData`]), so only an agent
//! that was given the registration's metadata holds the key. `loadRemoteMD` takes a peer's
//! envelope apart, hands the inner blob to the inner engine and remembers, by the inner
//! metadata handle it returns, the key it carried; a transfer bounces only when every remote
//! descriptor's handle has one (its WANT proves them, see `bounce_proto::proof`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use bounce_proto::proof::Destination;
use bounce_proto::wire::PublicData;
use bounce_proto::{RegId, RegKey};
use parking_lot::Mutex;

use crate::sys::shim::Md;

/// Our registrations' ids and keys, and the keys peers published for theirs.
#[derive(Debug, Default)]
pub(crate) struct Keys {
    /// Our registrations, by the inner engine's handle.
    local: Mutex<HashMap<Md, Destination>>,
    /// Peers' registrations we loaded, by the inner engine's remote handle.
    remote: Mutex<HashMap<Md, Destination>>,
    next_id: AtomicU64,
    /// A blob without our envelope was loaded (logged once).
    foreign_seen: AtomicBool,
}

impl Keys {
    /// Gives our new registration `md` an id and a fresh random key. `None` when the OS has no
    /// randomness to give: the registration then has no key and is never a bounce destination.
    pub(crate) fn issue(&self, md: Md) -> Option<Destination> {
        let mut key = [0u8; 32];
        if let Err(e) = getrandom::fill(&mut key) {
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
        self.local.lock().remove(&md)
    }

    /// The public data to publish for our registration `md`: the inner engine's `inner`
    /// wrapped with the registration's id and key (unwrapped when it has none).
    pub(crate) fn public_data(&self, md: Md, inner: &[u8]) -> Vec<u8> {
        match self.local(md) {
            Some(d) => PublicData { reg: d.reg, key: d.key, inner: inner.to_vec() }.to_vec(),
            None => inner.to_vec(),
        }
    }

    /// Takes a peer's public data apart: the inner engine's blob, and the destination it
    /// proves. A blob that is not ours (a peer without BOUNCE, an older build) loads as is,
    /// with no key: such destinations never bounce.
    pub(crate) fn split_remote(&self, blob: &[u8]) -> (Vec<u8>, Option<Destination>) {
        match PublicData::decode(blob) {
            Ok(p) => (p.inner, Some(Destination { reg: p.reg, key: p.key })),
            Err(e) => {
                if !self.foreign_seen.swap(true, Ordering::Relaxed) {
                    tracing::info!(error = %e, "loading remote metadata without BOUNCE keys: transfers into it stay on UCX");
                }
                (blob.to_vec(), None)
            }
        }
    }

    /// The inner engine loaded a peer's registration as `md`, carrying `dest`.
    pub(crate) fn remote_loaded(&self, md: Md, dest: Destination) {
        self.remote.lock().insert(md, dest);
    }

    /// NIXL unloaded remote metadata `md`.
    pub(crate) fn remote_unloaded(&self, md: Md) {
        self.remote.lock().remove(&md);
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
        let (inner, got) = theirs.split_remote(&blob);
        assert_eq!((inner.as_slice(), got), (&b"rkey"[..], Some(d)));
        theirs.remote_loaded(Md(10), d);
        assert_eq!(theirs.destinations([Md(10), Md(10)]), Some(vec![d]));
        assert_eq!(theirs.destinations([Md(10), Md(11)]), None, "md 11 was never loaded");
        // A foreign blob loads as is, proving nothing.
        assert_eq!(theirs.split_remote(b"plain"), (b"plain".to_vec(), None));
        theirs.remote_unloaded(Md(10));
        assert_eq!(theirs.destinations([Md(10)]), None);
        assert_eq!(ours.forget_local(Md(1)), Some(d));
        assert_eq!(ours.public_data(Md(1), b"rkey"), b"rkey", "no key, no envelope");
    }
}
