//! One BOUNCE engine: its configuration, the inner UCX plugin it delegates to, what it knows of
//! its peers, and the memory registered through it.
//!
//! Created by `ffi::abi::bnc_engine_create` when NIXL creates a "BOUNCE" backend; destroyed when
//! NIXL destroys it. All methods take `&self`: NIXL calls an engine from many threads.

use std::collections::hash_map::RandomState;
use std::collections::{HashMap, VecDeque};
use std::ffi::c_void;
use std::hash::{BuildHasher, Hasher};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use bounce_proto::MemKind;
use bounce_proto::config::Config;
use bounce_proto::endpoint::XferError;
use bounce_proto::plan::{self, DescPair, PlanParams};
use bounce_proto::wire::{self, Capabilities, ConnEnvelope};
use parking_lot::Mutex;

use crate::ffi::Status;
use crate::ffi::shim::{Md, Shim};
use crate::shell::arena::Arena;
use crate::shell::reactor::{Cmd, Control, PeerArena, Reactor, Shared};
use crate::shell::requests::{PostError, State};
use crate::shell::stats::Stats;
use crate::shell::worker::ArenaView;
use crate::shell::{Error, InnerPlugin, Result, locate_ucx_plugin};

/// What NIXL passed to `create_engine`, already decoded.
#[derive(Debug)]
pub struct CreateParams<'a> {
    /// The local agent's name.
    pub agent: &'a str,
    /// Every backend param (UCX's and ours).
    pub params: Vec<(&'a str, &'a str)>,
    /// The agent asked for a progress thread.
    pub enable_prog_th: bool,
    /// The agent's progress-thread delay, microseconds.
    pub pthr_delay_us: u64,
    /// The agent's thread-sync mode (`nixl_thread_sync_t`).
    pub sync_mode: i32,
    /// Where libplugin_BOUNCE.so is, to find libplugin_UCX.so beside it.
    pub self_path: Option<&'a Path>,
}

/// Init params BOUNCE chooses for its inner UCX engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InnerInit {
    /// Run UCX's progress thread.
    pub prog_th: bool,
    /// Its poll delay, microseconds.
    pub pthr_delay_us: u64,
    /// Thread-sync mode.
    pub sync_mode: i32,
}

/// If the inner engine ever runs UCX's progress thread, it waits on the workers' event fds and
/// wakes at least every `delay`; a delay of 0 (what NIXL's Python API passes) would make it spin
/// a core while idle, so we raise it.
const MIN_INNER_PTHR_DELAY_US: u64 = 1_000;

/// A registration made through this engine (the receiver only ever scatters into these).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Registration {
    /// Start address.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Device id (GPU ordinal for VRAM).
    pub dev: u64,
    /// Memory kind.
    pub mem: MemKind,
}

/// A descriptor as NIXL hands it to a backend (`bnc_meta_desc`).
#[derive(Debug, Clone, Copy)]
pub struct DescView {
    /// Address.
    pub addr: u64,
    /// Length.
    pub len: u64,
    /// Device id.
    pub dev: u64,
}

/// NIXL's WRITE op code.
const NIXL_WRITE: i32 = 1;
/// NIXL's DRAM_SEG.
const DRAM_SEG: i32 = 0;

/// The bounce machinery of an engine: the arena and the reactor driving the core. Field order
/// is drop order: the reactor (thread + workers) stops before the arena is deregistered.
struct Bounce {
    reactor: Reactor,
    arena: Arena,
    caps: Capabilities,
    shim: Shim,
}

/// Two status checks of one in-flight request closer than this are a busy poll (an
/// application loop doing nothing else in between; a Python loop around
/// `check_xfer_state` repeats every few microseconds).
const BUSY_POLL_GAP: std::time::Duration = std::time::Duration::from_micros(50);

/// One BOUNCE engine.
pub struct Engine {
    agent: String,
    config: Config,
    session: u64,
    stats: Arc<Stats>,
    registrations: Mutex<HashMap<usize, Registration>>,
    app_notifs: Mutex<VecDeque<(Vec<u8>, Vec<u8>)>>,
    bounce: Option<Bounce>,
    plugin: InnerPlugin,
}

impl Engine {
    /// Parses the configuration (params, then `NIXL_BOUNCE_*` from `env`) and loads the UCX plugin.
    ///
    /// # Errors
    /// A bad configuration or a missing/incompatible UCX plugin.
    pub fn create(p: &CreateParams<'_>, env: impl Fn(&str) -> Option<String>) -> Result<(Self, InnerInit)> {
        let loaded = Config::from_params(p.params.iter().copied(), env)?;
        for w in &loaded.warnings {
            tracing::warn!(agent = p.agent, "{w}");
        }
        let config = loaded.config;
        let path = locate_ucx_plugin(config.ucx_plugin.as_deref(), p.self_path);
        let plugin = InnerPlugin::load(&path)?;
        tracing::info!(agent = p.agent, ucx = %plugin.path().display(), "BOUNCE engine created");
        // No UCX progress thread inside BOUNCE: measured side by side (BENCHMARKS.md), its worker
        // locking and wakeups cost pass-through ~2x on a 64 MiB write. Progress comes from the
        // application's own polling, exactly as with plain UCX without a progress thread, and
        // from BOUNCE's reactor once the bounce path is active.
        let inner = InnerInit {
            prog_th: false,
            pthr_delay_us: p.pthr_delay_us.max(MIN_INNER_PTHR_DELAY_US),
            sync_mode: p.sync_mode,
        };
        let session = RandomState::new().build_hasher().finish() | 1;
        let engine = Self {
            agent: p.agent.to_owned(),
            config,
            session,
            stats: Arc::new(Stats::default()),
            registrations: Mutex::new(HashMap::new()),
            app_notifs: Mutex::new(VecDeque::new()),
            bounce: None,
            plugin,
        };
        Ok((engine, inner))
    }

    /// The inner plugin's descriptor for the shim.
    pub fn inner_plugin(&self) -> *const c_void {
        self.plugin.descriptor()
    }

    /// Connects the engine to its shim (the inner engine now exists) and, when bounce is
    /// enabled, registers the arena and starts the reactor. A bounce set-up failure is a warning:
    /// the engine then advertises no capabilities and everything stays on plain UCX.
    pub fn attach(&mut self, shim: *mut c_void) {
        let Some(shim) = Shim::new(shim) else { return };
        if !self.config.enabled {
            tracing::info!(agent = self.agent, "bounce disabled by configuration: pure UCX pass-through");
            return;
        }
        match self.start_bounce(shim) {
            Ok(b) => self.bounce = Some(b),
            Err(why) => tracing::warn!(agent = self.agent, "bounce path unavailable, staying on plain UCX: {why}"),
        }
    }

    fn start_bounce(&self, shim: Shim) -> std::result::Result<Bounce, String> {
        // Bound before the arena: a failure here costs no registration to undo.
        let zmq = match self.config.control {
            bounce_proto::ControlKind::Zmq => {
                Some(super::zmq_channel::ZmqChannel::bind(&self.agent, &self.config.zmq_host)?)
            }
            _ => None,
        };
        let arena = Arena::new(&shim, self.config.arena_size)?;
        let mut caps = arena.capabilities(
            self.config.control,
            self.config.arena_usable_capacity(),
            self.config.max_chunk_size,
            self.session,
        );
        if let Some(z) = &zmq {
            caps.endpoint = z.endpoint().as_bytes().to_vec();
            tracing::info!(agent = self.agent, endpoint = z.endpoint(), "ZMQ control channel bound");
        }
        let endpoint = shim.conn_info().map_err(|st| format!("inner getConnInfo failed (status {st})"))?;
        let shared = Arc::new(Shared {
            inbox: Default::default(),
            requests: Default::default(),
            stats: Arc::clone(&self.stats),
            peer_arenas: Mutex::new(HashMap::new()),
            peers: Mutex::new(HashMap::new()),
            reachable: Mutex::new(Default::default()),
        });
        let view = ArenaView { base: arena.base(), len: arena.len(), streaming_scatter: self.config.streaming_scatter };
        let started =
            Reactor::start(&self.config, shim, shared, self.session, view, arena.md(), Control { endpoint, zmq });
        let reactor = match started {
            Ok(r) => r,
            Err(e) => {
                arena.deregister(&shim);
                return Err(e);
            }
        };
        for (md, r) in self.registrations.lock().iter().filter(|(_, r)| r.mem == MemKind::Dram) {
            reactor.shared().inbox.push(Cmd::Registered(r.addr, r.len, Md(*md)));
        }
        // Reading /proc/self/smaps costs time in a large process: only when it will be logged.
        let huge = tracing::enabled!(tracing::Level::INFO).then(|| arena.huge_bytes()).flatten();
        tracing::info!(agent = self.agent, arena = arena.len(), huge_pages = huge, "bounce path ready");
        Ok(Bounce { reactor, arena, caps, shim })
    }

    /// Our capabilities, or `None` while this engine cannot bounce (bounce disabled, or no
    /// arena), in which case peers keep every transfer on plain UCX.
    pub fn capabilities(&self) -> Option<Capabilities> {
        self.bounce.as_ref().map(|b| b.caps.clone())
    }

    /// BOUNCE's connection info: the versioned envelope around the inner engine's.
    pub fn wrap_conn_info(&self, inner: &[u8]) -> Vec<u8> {
        let env = ConnEnvelope { caps: self.capabilities(), inner: inner.to_vec() };
        let mut out = Vec::with_capacity(inner.len() + 256);
        env.encode(&mut out);
        out
    }

    /// Takes a peer's connection info apart; returns the inner UCX conn info to load.
    ///
    /// # Errors
    /// [`Error::BadEnvelope`] when it is not a BOUNCE envelope we understand.
    pub fn load_conn_info(&self, agent: &str, envelope: &[u8]) -> Result<Vec<u8>> {
        let env = ConnEnvelope::decode(envelope).map_err(|source| {
            tracing::warn!(peer = agent, error = %source, "rejecting malformed BOUNCE connection info");
            Error::BadEnvelope { agent: agent.to_owned(), source }
        })?;
        let caps = match (env.caps, self.capabilities()) {
            (Some(theirs), Some(ours)) => match ours.compatible_with(&theirs) {
                Ok(()) => Some(theirs),
                Err(why) => {
                    tracing::info!(peer = agent, reason = ?why, "peer cannot bounce with us; plain UCX");
                    Stats::bump(&self.stats.peers_incompatible);
                    None
                }
            },
            _ => None,
        };
        if let Some(b) = &self.bounce {
            b.reactor.shared().peers.lock().insert(agent.to_owned(), caps);
        }
        Ok(env.inner)
    }

    /// True when transfers to `agent` may take the bounce path (capabilities compatible and
    /// its arena loaded into the inner engine).
    pub fn peer_can_bounce(&self, agent: &str) -> bool {
        self.bounce.as_ref().is_some_and(|b| {
            let sh = b.reactor.shared();
            sh.peer_arenas.lock().contains_key(agent) && sh.reachable.lock().contains(agent)
        })
    }

    /// The inner engine has loaded the peer's conn info: we can now answer it, so tell it
    /// (HELLO), and return its arena to load when it can bounce with us:
    /// `(base, len, dev, mem, key)`.
    pub fn peer_loaded(&self, agent: &str) -> Option<(u64, u64, u64, i32, Vec<u8>)> {
        let b = self.bounce.as_ref()?;
        b.reactor.shared().inbox.push(Cmd::Hello(agent.to_owned()));
        let peers = b.reactor.shared().peers.lock();
        let c = peers.get(agent)?.as_ref()?;
        let mem = if c.mem == MemKind::Dram { 0 } else { 1 };
        Some((c.arena_base, c.arena_len, c.arena_dev, mem, c.arena_key.clone()))
    }

    /// Records the inner metadata of the peer's arena (None: loading failed, stay on UCX).
    pub fn peer_arena_loaded(&self, agent: &str, md: Option<usize>) {
        let Some(b) = &self.bounce else { return };
        let peers = b.reactor.shared().peers.lock();
        let caps = peers.get(agent).and_then(Option::as_ref);
        match (md, caps) {
            (Some(md), Some(c)) => {
                let pa = PeerArena { base: c.arena_base, len: c.arena_len, dev: c.arena_dev, md: Md(md) };
                b.reactor.shared().peer_arenas.lock().insert(agent.to_owned(), pa);
            }
            _ => {
                tracing::warn!(peer = agent, "loading the peer's arena failed; plain UCX to it");
                b.reactor.shared().peer_arenas.lock().remove(agent);
            }
        }
    }

    /// The peer disconnected: its transfers fail, its regions are reclaimed.
    pub fn peer_lost(&self, agent: &str) {
        if let Some(b) = &self.bounce {
            b.reactor.shared().peer_arenas.lock().remove(agent);
            b.reactor.shared().peers.lock().remove(agent);
            b.reactor.shared().reachable.lock().remove(agent);
            b.reactor.shared().inbox.push(Cmd::PeerLost(agent.to_owned()));
        }
    }

    /// Records a registration made through this engine, keyed by the inner metadata handle.
    pub fn mem_registered(&self, md: usize, reg: Registration) {
        self.registrations.lock().insert(md, reg);
        // Only host memory may ever be a CPU scatter target or a direct write source: a peer
        // naming a GPU address in DATA must be refused, not dereferenced.
        if let (Some(b), MemKind::Dram) = (&self.bounce, reg.mem) {
            b.reactor.shared().inbox.push(Cmd::Registered(reg.addr, reg.len, Md(md)));
        }
    }

    /// Forgets a registration.
    pub fn mem_deregistered(&self, md: usize) {
        let removed = self.registrations.lock().remove(&md);
        if let Some(r) = removed {
            if let (Some(b), MemKind::Dram) = (&self.bounce, r.mem) {
                b.reactor.shared().inbox.push(Cmd::Deregistered(r.addr, r.len, Md(md)));
            }
        }
    }

    /// Routing decision for a request (the gate, README "Routing"): `Ok(Some(handle))` when
    /// BOUNCE owns it, `Ok(None)` to delegate it to UCX unchanged.
    pub fn prep(
        &self,
        op: i32,
        local: &[DescView],
        local_mem: i32,
        remote: &[DescView],
        remote_mem: i32,
        agent: &str,
    ) -> Option<u64> {
        let s = &self.stats;
        let fallback = |c: &std::sync::atomic::AtomicU64| {
            Stats::bump(c);
            Stats::bump(&s.passthrough_xfers);
            None
        };
        let Some(b) = &self.bounce else { return fallback(&s.fallback_disabled) };
        if op != NIXL_WRITE {
            return fallback(&s.fallback_op);
        }
        if local_mem != DRAM_SEG || remote_mem != DRAM_SEG {
            return fallback(&s.fallback_mem);
        }
        let n = local.len();
        // Malformed lists (empty, unequal counts or lengths) go to UCX, which answers them with
        // its own statuses: the same errors a user of UCX gets.
        if n == 0 || remote.len() != n || local.iter().zip(remote).any(|(l, r)| l.len != r.len) {
            return fallback(&s.fallback_op);
        }
        if (n as u64) < self.config.min_descriptor_count {
            return fallback(&s.fallback_count);
        }
        let total: u64 = local.iter().map(|d| d.len).fold(0u64, u64::saturating_add);
        if total / n as u64 > self.config.max_average_descriptor_size {
            return fallback(&s.fallback_size);
        }
        if !self.peer_can_bounce(agent) {
            return fallback(&s.fallback_peer);
        }
        let pairs: Vec<DescPair> =
            local.iter().zip(remote).map(|(l, r)| DescPair { src: l.addr, dst: r.addr, len: l.len }).collect();
        match plan::plan(&pairs, PlanParams::from_config(&self.config)) {
            Ok(mut p) => {
                // A chunk may be written straight from user memory only when one DRAM
                // registration made through this engine covers its whole source range.
                let regs = self.registrations.lock();
                for c in &mut p.chunks {
                    if let Some(addr) = c.direct {
                        let end = addr.saturating_add(c.bytes);
                        let covered =
                            regs.values().any(|r| r.mem == MemKind::Dram && r.addr <= addr && end <= r.addr + r.len);
                        if !covered || !self.config.direct_writes {
                            c.direct = None;
                        }
                    }
                }
                drop(regs);
                Some(b.reactor.shared().requests.insert(agent.to_owned(), p))
            }
            Err(e) => {
                tracing::warn!(peer = agent, error = %e, "cannot plan the transfer; plain UCX");
                fallback(&s.fallback_op)
            }
        }
    }

    /// Posts a bounce request.
    pub fn post(&self, handle: u64, notif: Option<Vec<u8>>) -> Status {
        let Some(b) = &self.bounce else { return Status::ErrInvalidParam };
        match b.reactor.shared().requests.post(handle, notif) {
            Ok(p) => {
                b.reactor.shared().inbox.push(Cmd::Submit(p));
                Status::InProg
            }
            Err(PostError::Active) => Status::ErrRepostActive,
            Err(PostError::Unknown) => Status::ErrNotFound,
            Err(PostError::Closed) => Status::ErrBackend,
        }
    }

    /// Status of a bounce request.
    pub fn check(&self, handle: u64) -> Status {
        let Some(b) = &self.bounce else { return Status::ErrInvalidParam };
        match b.reactor.shared().requests.check(handle, BUSY_POLL_GAP, self.config.check_wait) {
            None => Status::ErrNotFound,
            Some(State::Prepared) => Status::ErrNotPosted,
            Some(State::Posted(_)) => {
                // Polling a bounce request cannot advance it (the reactor and copy workers do
                // the work), so hand the core to them: an application spinning on checkXfer
                // otherwise takes a core they need. The busy-poll wait above does most of that;
                // the yield covers `bounce_check_wait_us = 0`.
                std::thread::yield_now();
                Status::InProg
            }
            Some(State::Done(Ok(()))) => Status::Success,
            Some(State::Done(Err(e))) => xfer_status(&e),
        }
    }

    /// Releases a bounce request, cancelling it when still in flight.
    pub fn release(&self, handle: u64) -> Status {
        let Some(b) = &self.bounce else { return Status::ErrInvalidParam };
        match b.reactor.shared().requests.remove(handle) {
            None => Status::ErrNotFound,
            Some(Some(xfer)) => {
                b.reactor.shared().inbox.push(Cmd::Cancel(xfer));
                Status::Success
            }
            Some(None) => Status::Success,
        }
    }

    /// A notification pulled from the inner engine: control frames go to the reactor, the
    /// application's own wait for [`Self::take_notifs`].
    pub fn route_notif(&self, agent: &[u8], msg: &[u8]) {
        if wire::is_control_frame(msg) {
            match (&self.bounce, std::str::from_utf8(agent)) {
                (Some(b), Ok(a)) => {
                    b.reactor.shared().inbox.push(Cmd::Control { peer: a.to_owned(), frame: msg.to_vec() })
                }
                _ => Stats::bump(&self.stats.control_dropped),
            }
            return;
        }
        self.app_notifs.lock().push_back((agent.to_vec(), msg.to_vec()));
    }

    /// The application's notifications, in arrival order.
    pub fn take_notifs(&self) -> Vec<(Vec<u8>, Vec<u8>)> {
        self.app_notifs.lock().drain(..).collect()
    }

    /// Counters as `(name, value)`, published to NIXL as `stats.<name>`.
    pub fn stats(&self) -> Vec<(&'static str, u64)> {
        // Gauges are derived here from the state they describe, not kept in step by hand.
        self.stats.registrations.store(self.registrations.lock().len() as u64, Ordering::Relaxed);
        if let Some(b) = &self.bounce {
            let sh = b.reactor.shared();
            let ready = {
                let arenas = sh.peer_arenas.lock();
                sh.reachable.lock().iter().filter(|p| arenas.contains_key(*p)).count()
            };
            self.stats.peers_ready.store(ready as u64, Ordering::Relaxed);
        }
        self.stats.snapshot()
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        if let Some(b) = self.bounce.take() {
            let Bounce { reactor, arena, shim, .. } = b;
            drop(reactor); // joins the reactor and workers; in-flight writes ended or released
            arena.deregister(&shim);
        }
    }
}

/// The NIXL status a failed bounce transfer reports.
fn xfer_status(e: &XferError) -> Status {
    match e {
        XferError::PeerLost => Status::ErrRemoteDisconnect,
        XferError::Canceled => Status::ErrCanceled,
        _ => Status::ErrBackend,
    }
}
