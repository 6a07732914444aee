//! What travels in NIXL's metadata, both ways: our connection info wrapped with our capabilities,
//! a peer's unwrapped and loaded (its arenas and mailbox loaded into the inner engine, a HELLO
//! queued), and the public data of each registration with its key and same-host records.

use super::*;

impl Engine {
    /// BOUNCE's connection info: the versioned envelope around the inner engine's.
    pub(crate) fn wrap_conn_info(&self, inner: &[u8]) -> Vec<u8> {
        let env = ConnEnvelope { caps: self.capabilities(), inner: inner.to_vec() };
        let mut out = Vec::with_capacity(inner.len() + 256);
        env.encode(&mut out);
        out
    }

    /// Takes a peer's connection info apart; returns the inner UCX conn info to load.
    ///
    /// # Errors
    /// [`Error::BadEnvelope`] when it is not a BOUNCE envelope we understand.
    pub(crate) fn load_conn_info(&self, agent: &str, envelope: &[u8]) -> Result<Vec<u8>> {
        let (env, caps_error) = ConnEnvelope::decode_lenient(envelope).map_err(|source| {
            tracing::warn!(peer = agent, error = %source, "rejecting malformed BOUNCE connection info");
            Error::BadEnvelope { agent: agent.to_owned(), source }
        })?;
        if let Some(why) = caps_error {
            // Another wire version (an older or newer BOUNCE) or garbage: loaded as an agent
            // without capabilities, it stays on plain UCX, as the README's gate says, instead of
            // failing the whole metadata load.
            tracing::info!(peer = agent, error = %why, "peer's bounce capabilities unreadable; plain UCX");
            Stats::bump(&self.stats.peers_incompatible);
        }
        if self.bounce.is_some() {
            let (loaded, replaced) = self.peers.loaded(agent, env.caps, self.capabilities().as_ref());
            if let Some((old, unload)) = replaced {
                // A new session: the agent restarted under the same name. Its old incarnation's
                // transfers and flows are void; the reactor reclaims them by the old id, which
                // the new incarnation never goes by, so no frame of the new session (admitted
                // before the reactor takes this, or its one-way flows begun before the
                // reload) can be reclaimed with them.
                tracing::info!(peer = agent, "peer reloaded with a new session: reclaiming its old state");
                self.retire_peer(agent, Some(old), unload);
            }
            match loaded {
                Loaded::Incompatible(why) => {
                    tracing::info!(peer = agent, reason = ?why, "peer cannot bounce with us; plain UCX");
                    Stats::bump(&self.stats.peers_incompatible);
                }
                Loaded::Compatible | Loaded::NoCapabilities => {}
            }
        }
        Ok(env.inner)
    }

    /// The inner conn info of a peer BOUNCE does not keep (a name that is not UTF-8): the
    /// envelope is checked as for any peer, and the peer is recorded nowhere, so it stays on
    /// plain UCX (`bnc_peer_loaded` then finds nothing to load for it).
    pub(crate) fn conn_info_for_ucx_only(&self, envelope: &[u8]) -> Result<Vec<u8>> {
        let (env, _) = ConnEnvelope::decode_lenient(envelope).map_err(|source| {
            tracing::warn!(error = %source, "rejecting malformed BOUNCE connection info");
            Error::BadEnvelope { agent: "(a name not UTF-8)".to_owned(), source }
        })?;
        Ok(env.inner)
    }

    /// The inner engine has loaded the peer's conn info: we can now answer it, so tell it
    /// (HELLO, at arena 0), and return its arena `index` to load when it can bounce with us
    /// and has one of that index (the shim asks for 0, 1, ... until there is none).
    pub(crate) fn peer_loaded(&self, agent: &str, index: ArenaId) -> Option<ArenaToLoad> {
        let sh = self.shared()?;
        if index == ArenaId(0) {
            // Over ZMQ the HELLO makes our socket to the peer: a prep right after this waits
            // a little for it to connect before choosing the one-way route (see `Links`).
            if let (Some(links), Some(endpoint)) =
                (self.bounce.as_ref().and_then(|b| b.links.as_ref()), self.peers.endpoint(agent))
            {
                links.expect(agent, &endpoint, Instant::now());
            }
            sh.inbox.push(Cmd::Hello(agent.to_owned(), self.peers.losses()));
        }
        self.peers.arena_to_load(agent, index)
    }

    /// Records the inner metadata of the peer's arena `index` and (index 0) of its mailbox's
    /// registration (None: loading failed, or it keeps no mailbox; without arena 0 it stays on
    /// UCX, without another arena nothing bounces through that one, without the mailbox it is
    /// bounced to two way only). What they replace (the peer's conn info was
    /// reloaded), or what is not kept, is unloaded once no write or READ uses it.
    pub(crate) fn peer_arena_loaded(&self, agent: &str, index: ArenaId, md: Option<Md>, mailbox: Option<Md>) {
        let Some(sh) = self.shared() else {
            // No reactor, so no write or READ: nothing else can use them.
            if let Some(shim) = &self.shim {
                for md in md.into_iter().chain(mailbox) {
                    let _ = shim.unload(md);
                }
            }
            return;
        };
        let (kept, unload) = self.peers.arena_loaded(agent, index, md, mailbox);
        if !kept {
            tracing::warn!(peer = agent, arena = index.0, "loading the peer's arena failed; plain UCX through it");
        }
        for arena in unload {
            sh.inbox.push(Cmd::Unload(arena));
        }
    }

    /// The peer disconnected: its transfers fail, its regions are reclaimed, its arena is
    /// unloaded once no write uses it.
    ///
    /// A peer that could bounce with us is told first (a FORGET, `bounce_proto::forget`), while
    /// it can still be reached: the inner engine disconnects it once this returns. Its
    /// transfers to us then go one way (as plain UCX's one-sided writes would go on) instead of
    /// failing, each after the liveness probe's bound, for want of our answers.
    pub(crate) fn peer_lost(&self, agent: &str) {
        let Some(sh) = self.shared() else { return };
        // Resolved while the peer is still in the table: its id (the load whose secret the
        // FORGET proves) and, for ZMQ, its control endpoint.
        let told = self.peers.compatible(agent).then(|| self.peers.loaded_id(agent)).flatten();
        let endpoint = self.peers.endpoint(agent).unwrap_or_default();
        let (id, unload) = self.peers.lost(agent);
        if let Some(told) = told {
            self.send_forget(sh, agent, told, endpoint);
        }
        self.retire_peer(agent, id, unload);
    }

    /// Sends `agent`, loaded here as `id` until now, the FORGET proving that load's secret.
    fn send_forget(&self, sh: &Shared, agent: &str, id: bounce_proto::PeerId, endpoint: Vec<u8>) {
        let Some(key) = sh.forget_key.get() else { return };
        let proof = bounce_proto::forget::secret(key, id);
        let body = bounce_proto::wire::Body::Forget { proof };
        let bytes = bounce_proto::wire::ControlFrame { session: self.session, body }.to_vec();
        match (self.config.control, &self.shim) {
            (ControlKind::Ucx, Some(shim)) => match shim.gen_notif(agent, &bytes) {
                Ok(()) => Stats::bump(&self.stats.forgets_sent),
                Err(status) => tracing::debug!(peer = agent, ?status, "sending FORGET failed"),
            },
            (ControlKind::Ucx, None) => {}
            // Counted by the reactor once the channel took it.
            (ControlKind::Zmq, _) => sh.inbox.push(Cmd::Forget { peer: agent.to_owned(), endpoint, frame: bytes }),
        }
    }

    /// The inner engine refused the conn info [`load_conn_info`](Self::load_conn_info) just
    /// unwrapped for `agent`: NIXL keeps no connection to it, so neither do we (a peer left
    /// loaded would have its frames admitted with nothing to answer them through).
    pub(crate) fn conn_info_failed(&self, agent: &str) {
        let (lost, unload) = self.peers.load_failed(agent);
        tracing::warn!(peer = agent, "the inner engine refused the peer's connection info; not loaded");
        self.retire_peer(agent, lost, unload);
    }

    /// Queues the reclaim of `agent`'s retired incarnation `id` (its transfers fail, its flows
    /// are reclaimed) and the unloading of its arena handles `unload` once no write uses them.
    fn retire_peer(&self, agent: &str, id: Option<bounce_proto::PeerId>, unload: Vec<Md>) {
        let Some(sh) = self.shared() else { return };
        if let Some(id) = id {
            sh.inbox.push(Cmd::PeerLost(agent.to_owned(), id));
        }
        if !unload.is_empty() {
            sh.inbox.push(Cmd::Unload(unload));
        }
    }

    /// Records a registration made through this engine, keyed by the inner metadata handle.
    /// GPU memory whose device id is not the GPU the driver says it is on is recorded as
    /// misplaced and given nothing else: no key and no same-host record (peers reach it
    /// through UCX), no scatter target, and our transfers from it go to UCX. UCX finds the GPU
    /// from the address itself, so a wrong id costs it nothing; one of our kernels launched on
    /// the named GPU would fault on the address and leave that GPU's context, the
    /// application's, unusable.
    pub(crate) fn mem_registered(&self, md: Md, reg: Registration) {
        self.registry.insert(md, reg);
        if reg.mem == MemKind::Vram && !on_its_gpu(&reg) {
            self.registry.set_misplaced(md);
            return;
        }
        let key = self.keys.issue(md);
        if key.is_some() {
            let reach = match reg.mem {
                MemKind::Vram => self.ipc.as_ref().and_then(|ipc| ipc.export(&reg)).map(Reach::Ipc),
                MemKind::Dram => self.cma.as_ref().and_then(|cma| cma.export(md, &reg)).map(Reach::Cma),
            };
            if let Some(r) = reach {
                self.keys.set_local_reach(md, r);
            }
        }
        // Only host memory may ever be a CPU scatter target or a direct write source: a peer
        // naming a GPU address in DATA must be refused, not dereferenced.
        let serves = self.bounce.as_ref().and_then(|b| b.arena_serving(&reg));
        if let (Some(sh), Some(arena), Some(d)) = (self.shared(), serves, key) {
            // No wake-up: the reactor needs it only for a later DATA or direct write, and it
            // drains its inbox, in order, before acting on either. Waking it made it take the
            // inner engine's lock right when the application's next call needed it (a
            // register + deregister cost 3x UCX's on 2 cores, issue 12).
            sh.inbox.push_quiet(Cmd::Registered(d, reg.addr, reg.len, arena));
        }
    }

    /// Forgets a registration, and returns only once nothing of the bounce path touches its
    /// memory: transfers that read it or scatter into it fail, and the copy jobs and writes
    /// already running on it have ended. Called before the inner engine's deregistration,
    /// without the shim's lock (the reactor needs it to finish its writes).
    pub(crate) fn mem_deregistered(&self, md: Md) {
        if let Some(cma) = &self.cma {
            cma.forget(md);
        }
        let key = self.keys.forget_local(md);
        let Some(r) = self.registry.remove(md) else { return };
        // Our same-host copies into or out of it end first. (A peer's, into it, cannot be
        // waited for: its liveness word, cleared above, stops only the peer's next post.) Not
        // those over bytes another registration of the same memory still covers whole.
        // Asked only of a request whose pieces meet the range (the registry's lock is a leaf,
        // taken inside the path's table lock).
        let place = ArenaPlace { mem: r.mem, dev: r.dev };
        let kept = |(a, b): (u64, u64)| self.registry.covering(place, a, b - a).is_some();
        match (r.mem, &self.cma, &self.ipc) {
            (MemKind::Dram, Some(cma), _) => cma.quiesce(r.addr, r.len, &kept),
            (MemKind::Vram, _, Some(ipc)) => ipc.quiesce(r.dev, r.addr, r.len, &kept),
            _ => {}
        }
        let (Some(b), Some(sh)) = (&self.bounce, self.shared()) else { return };
        if b.arena_serving(&r).is_none() {
            return; // never a copy source or target, never a direct-write source
        }
        sh.requests.revoke((r.addr, r.addr.saturating_add(r.len)), &kept);
        sh.deregister(key.map(|d| d.reg), r.addr, r.len, ArenaPlace { mem: r.mem, dev: r.dev });
    }

    /// Our registration `md`'s public data: the inner engine's `inner` wrapped with the
    /// registration's id and key (see `keys`).
    pub(crate) fn public_data(&self, md: Md, inner: &[u8]) -> Vec<u8> {
        self.keys.public_data(md, inner)
    }

    /// Takes a peer's registration metadata apart (see `keys`): the inner blob to load, and
    /// the destination it proves (`None`: not ours; it loads, but never bounces).
    ///
    /// # Errors
    /// [`Error::BadPublicData`]: ours by its magic but unreadable; not to be loaded at all.
    pub(crate) fn split_remote_md(&self, blob: &[u8]) -> Result<Split> {
        self.keys.split_remote(blob).map_err(Error::BadPublicData)
    }

    /// The inner engine loaded a peer's registration as `md`, carrying `dest`, from the blob
    /// whose split gave `ticket`.
    pub(crate) fn remote_md_loaded(&self, md: Md, dest: Destination, ticket: u64) {
        self.keys.remote_loaded(md, dest, ticket);
    }

    /// The inner engine did not load the blob whose split gave `ticket`.
    pub(crate) fn remote_md_load_failed(&self, ticket: u64) {
        self.keys.load_failed(ticket);
    }

    /// NIXL unloaded remote metadata `md`.
    pub(crate) fn remote_md_unloaded(&self, md: Md) {
        if let (Some(handle), Some(ipc)) = (self.keys.remote_unloaded(md), &self.ipc) {
            ipc.unmap(&handle);
        }
    }
}

/// Whether GPU registration `reg` is on the GPU its device id names, as the driver says.
/// Without a usable driver nothing of ours touches GPU memory anyway: taken as it is.
fn on_its_gpu(reg: &Registration) -> bool {
    use crate::sys::cuda::{CudaError, device_of};
    // Its last byte too: a registration that runs past its allocation (an application bug UCX
    // turns into a failed copy) would let a peer's scatter fault in the application's own CUDA
    // context (review 56). A contiguous mapping of several pieces (CUDA's virtual memory API)
    // passes; a hole between first and last byte is not looked for.
    let last = reg.addr.saturating_add(reg.len.max(1) - 1);
    let (first, end) = match (device_of(reg.addr), device_of(last)) {
        (Err(CudaError::Unavailable(_)), _) => return true,
        (Ok(first), Ok(end)) => (first, end),
        (Err(e), _) | (_, Err(e)) => {
            tracing::warn!(addr = reg.addr, len = reg.len, dev = reg.dev, error = %e,
                "GPU memory the driver does not know (all of it, first to last byte): its transfers go to UCX");
            return false;
        }
    };
    if end != first {
        tracing::warn!(
            addr = reg.addr,
            len = reg.len,
            "GPU memory registered across two GPUs' memory: its transfers go to UCX"
        );
        return false;
    }
    let same = u64::try_from(first).is_ok_and(|o| o == reg.dev);
    if !same {
        tracing::warn!(
            addr = reg.addr,
            dev = reg.dev,
            gpu = first,
            "GPU memory registered with the device id of another GPU: its transfers go to UCX"
        );
    }
    same
}
