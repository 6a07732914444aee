//! One BOUNCE engine: its configuration, the inner UCX plugin it delegates to, the routing gate
//! and its bounce requests. What it knows of its peers and of the memory registered through it
//! lives in one table each ([`PeerTable`], [`Registry`]), shared with its reactor.
//!
//! Created by `ffi::abi::bnc_engine_create` when NIXL creates a "BOUNCE" backend; destroyed when
//! NIXL destroys it. All methods take `&self`: NIXL calls an engine from many threads.

use std::collections::hash_map::RandomState;
use std::ffi::c_void;
use std::hash::{BuildHasher, Hasher};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bounce_proto::config::{ArenaMem, Config, GpuCopy};
use bounce_proto::gate::{self, ArenaPlace, FallbackReason, GateInput, Route};
use bounce_proto::oneway::OneWayLayout;
use bounce_proto::peers::Loaded;
use bounce_proto::plan::{self, DescPair, PlanParams};
use bounce_proto::proof::Destination;
use bounce_proto::wire::{Arenas, Capabilities, ConnEnvelope};
use bounce_proto::{ArenaId, ControlKind, MemKind};
use parking_lot::Mutex;

use crate::shell::arena::Arena;
use crate::shell::cma::{self, CMA_HANDLE_BIT, CmaPath};
use crate::shell::control::ControlChannel;
use crate::shell::control::ucx::UcxChannel;
use crate::shell::control::zmq::ZmqChannel;
use crate::shell::copy::CopyEngine;
use crate::shell::copy::cpu::{CpuEngine, HostArena, INLINE_MAX_BYTES};
use crate::shell::copy::cuda::{CopyPath, CudaCopyEngine};
use crate::shell::datapath::ShimPath;
use crate::shell::ipc::{IPC_HANDLE_BIT, IpcPaths};
use crate::shell::keys::{Keys, Reach};
use crate::shell::mailroom::Mailroom;
use crate::shell::oneway_area::OneWayArea;
use crate::shell::peers::{ArenaToLoad, PeerTable};
use crate::shell::reactor::{ArenaPart, Cmd, Drove, LocalArena, Parts, Reactor, SOCKET_POLL_BATCH, Shared};
use crate::shell::registry::{Registration, Registry};
use crate::shell::requests::{Released, State};
use crate::shell::stats::{Published, Stats};
use crate::shell::{Error, Result};
use crate::sys::cuda::{self, Gpu, PlanPlacement};
use crate::sys::inner_plugin::{InnerPlugin, locate_ucx_plugin};
use crate::sys::nixl::{MemSeg, XferOp};
use crate::sys::shim::{Md, Notif, Shim};

/// What NIXL passed to `create_engine`, already decoded.
#[derive(Debug)]
pub(crate) struct CreateParams<'a> {
    /// The local agent's name.
    pub(crate) agent: &'a str,
    /// Every backend param (UCX's and ours).
    pub(crate) params: Vec<(&'a str, &'a str)>,
    /// The agent asked for a progress thread.
    pub(crate) enable_prog_th: bool,
    /// The agent's progress-thread delay, microseconds.
    pub(crate) pthr_delay_us: u64,
    /// The agent's thread-sync mode (`nixl_thread_sync_t`).
    pub(crate) sync_mode: i32,
    /// Where libplugin_BOUNCE.so is, to find libplugin_UCX.so beside it.
    pub(crate) self_path: Option<&'a Path>,
}

/// Init params BOUNCE chooses for its inner UCX engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct InnerInit {
    /// Run UCX's progress thread.
    pub(crate) prog_th: bool,
    /// Its poll delay, microseconds.
    pub(crate) pthr_delay_us: u64,
    /// Thread-sync mode.
    pub(crate) sync_mode: i32,
}

/// When the inner engine runs UCX's progress thread (bounce path off, thread asked for), it waits
/// on the workers' event fds and wakes at least every `delay` rounded up to whole milliseconds; a
/// delay of 0 (what NIXL's Python API passes) makes it poll without sleeping, a core while idle,
/// so we raise it.
const MIN_INNER_PTHR_DELAY_US: u64 = 1_000;

/// A descriptor as NIXL hands it to a backend (`bnc_meta_desc`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct DescView {
    /// Address.
    pub(crate) addr: u64,
    /// Length.
    pub(crate) len: u64,
    /// Device id (the GPU for VRAM).
    pub(crate) dev: u64,
    /// The metadata handle NIXL passed with it (for remote descriptors, the inner engine's
    /// remote handle from `loadRemoteMD`).
    pub(crate) md: Md,
}

/// Where the gate places an engine without a running bounce path (the gate then says
/// `Disabled` before it looks at memory).
const HOST_ARENA: ArenaPlace = ArenaPlace { mem: MemKind::Dram, dev: 0 };

/// The bounce machinery of an engine: its arenas and the reactor driving the core. Field order
/// is drop order: the reactor (thread + copy engines) stops before the arenas are deregistered.
struct Bounce {
    reactor: Reactor,
    /// By [`ArenaId`] (the order of our capabilities): one, or a host and a GPU arena (`both`).
    arenas: Vec<Arena>,
    /// Where each arena lives, by [`ArenaId`] (what the gate picks from): kept beside `arenas`
    /// so that every prep borrows a slice instead of collecting one.
    places: Vec<ArenaPlace>,
    /// Our mailbox and fetch area (`None`: it could not be set up; two way only).
    one_way: Option<OneWayArea>,
    caps: Capabilities,
}

/// Where a bounce request stands, as a status check reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Progress {
    /// Still in flight.
    InFlight,
    /// Every chunk was scattered at the receiver.
    Done,
}

/// Two status checks of one in-flight request closer than this are a busy poll (an
/// application loop doing nothing else in between; a Python loop around
/// `check_xfer_state` repeats every few microseconds).
const BUSY_POLL_GAP: Duration = Duration::from_micros(50);

/// One BOUNCE engine.
pub(crate) struct Engine {
    agent: String,
    config: Config,
    session: u64,
    stats: Arc<Stats>,
    /// The one table of registrations made through this engine.
    registry: Arc<Registry>,
    /// Our registrations' keys and the ones peers published for theirs.
    keys: Keys,
    /// The one table of peers.
    peers: Arc<PeerTable>,
    /// Sorts the inner engine's notifications (control frames / the application's).
    mail: Arc<Mailroom>,
    shim: Option<Shim>,
    bounce: Option<Bounce>,
    plugin: InnerPlugin,
    /// What was last published to NIXL (see [`Engine::publish_changed_stats`]).
    published: Mutex<Published>,
    /// The GPU whose memory an arena is, when `bounce_arena_mem` chose GPU memory.
    gpu: Option<Arc<Gpu>>,
    /// The GPU arena's options (GPU defaults for what is unset) beside a host arena under
    /// `config` (`both`); `None` with one arena, whose options `config` holds.
    gpu_config: Option<Config>,
    /// When `getNotifs` last found nothing (busy-poll detection, see [`Engine::take_notifs`]).
    last_empty_notifs: Mutex<Option<Instant>>,
    /// The same-host paths for GPU memory (`bounce_cuda_ipc`): one per GPU whose memory this
    /// engine registers, whatever its arena.
    ipc: Option<IpcPaths>,
    /// The same-host path for host memory (`bounce_cma`), whatever the arena.
    cma: Option<CmaPath>,
    /// The same-host paths' thresholds, by the memory kind they copy.
    mapped_limits: MappedLimits,
    /// Whether the one line about transfers of the other memory kind was logged.
    told_other_kind: AtomicBool,
}

impl Bounce {
    /// The arena whose copy engine may touch registration `reg` (the first that serves it),
    /// if any: only such memory is ever a copy's source or target, or a direct write's source.
    fn arena_serving(&self, reg: &Registration) -> Option<ArenaId> {
        // At most MAX_ARENAS (16) arenas: the index fits a u8.
        self.places.iter().position(|p| reg.serves(*p)).map(|i| ArenaId(i as u8))
    }
}

impl Engine {
    /// Parses the configuration (params, then `NIXL_BOUNCE_*` from `env`) and loads the UCX plugin.
    ///
    /// # Errors
    /// A bad configuration or a missing/incompatible UCX plugin.
    pub(crate) fn create(p: &CreateParams<'_>, env: impl Fn(&str) -> Option<String>) -> Result<(Self, InnerInit)> {
        let mut loaded = Config::from_params(p.params.iter().copied(), &env)?;
        let both = loaded.config.arena_mem == ArenaMem::Both;
        let gpu = match choose_gpu(p.agent, &loaded.config) {
            Some(gpu) if !both => {
                // A GPU arena: the options left unset take their VRAM defaults.
                loaded = Config::from_params_as(Some(MemKind::Vram), p.params.iter().copied(), &env)?;
                Some(gpu)
            }
            other => other,
        };
        // `both`: the engine's options (its host arena's) keep the host defaults, the GPU
        // arena's take the VRAM ones; the warnings of that second load are the first's.
        let gpu_config = match (both, &gpu) {
            (true, Some(_)) => {
                Some(Config::from_params_as(Some(MemKind::Vram), p.params.iter().copied(), &env)?.config)
            }
            _ => None,
        };
        for w in &loaded.warnings {
            tracing::warn!(agent = p.agent, "{w}");
        }
        let config = loaded.config;
        let path = locate_ucx_plugin(config.ucx_plugin.as_deref(), p.self_path);
        let plugin = InnerPlugin::load(&path)?;
        tracing::info!(agent = p.agent, ucx = %plugin.path().display(), "BOUNCE engine created");
        // Background progress, when the agent asked for a progress thread, is the reactor's: it
        // progresses the inner engine every pass and at least every `bounce_idle_park_us` (1 ms
        // by default) while idle, which serves a passive peer's READs over TCP faster than UCX's
        // own thread (test_progress.py, BENCHMARKS.md) at a fraction of its idle CPU, and leaves
        // pass-through free of the worker locking a progress thread brings (measured ~2x on a
        // 64 MiB write). With the bounce path off no reactor runs, so then the inner engine runs
        // UCX's own thread, made event-driven by the raised delay below (with NIXL's default
        // delay of 0 it spins).
        let inner_prog_th = p.enable_prog_th && !config.enabled;
        if p.enable_prog_th && !inner_prog_th {
            tracing::debug!(
                agent = p.agent,
                "the agent asked for a progress thread: the reactor progresses the inner engine"
            );
        }
        let inner = InnerInit {
            prog_th: inner_prog_th,
            pthr_delay_us: p.pthr_delay_us.max(MIN_INNER_PTHR_DELAY_US),
            sync_mode: p.sync_mode,
        };
        let session = RandomState::new().build_hasher().finish() | 1;
        let stats = Arc::new(Stats::default());
        // The same-host paths copy the memory they are given, not through the arena: an engine
        // has both whatever its arena (a GPU worker that also moves host memory, a host-arena
        // engine whose process registers GPU memory). Only an engine that asked for a GPU arena
        // and got none has no bounce path at all, and so none of these.
        let no_bounce = !config.enabled || (config.arena_mem == ArenaMem::Vram && gpu.is_none());
        let ipc = (!no_bounce && config.cuda_ipc).then(|| IpcPaths::new(gpu.as_ref(), Arc::clone(&stats)));
        let cma = (!no_bounce && config.cma)
            .then(|| {
                let cpus = std::thread::available_parallelism().ok().map(std::num::NonZeroUsize::get);
                let linger = crate::shell::reactor::hot_spin(cpus.unwrap_or(1));
                CmaPath::new(cma::workers_for(config.cma_workers, cpus), linger, Arc::clone(&stats))
            })
            .flatten();
        let mapped_limits = MappedLimits::new(&config, config.defaults_for == MemKind::Vram, &p.params, &env);
        let engine = Self {
            agent: p.agent.to_owned(),
            config,
            session,
            mail: Arc::new(Mailroom::new(Arc::clone(&stats))),
            stats,
            registry: Arc::default(),
            keys: Keys::default(),
            peers: Arc::default(),
            shim: None,
            bounce: None,
            plugin,
            published: Mutex::default(),
            gpu,
            gpu_config,
            last_empty_notifs: Mutex::new(None),
            ipc,
            cma,
            mapped_limits,
            told_other_kind: AtomicBool::new(false),
        };
        Ok((engine, inner))
    }

    /// The inner plugin's descriptor for the shim.
    pub(crate) fn inner_plugin(&self) -> *const c_void {
        self.plugin.descriptor()
    }

    /// Connects the engine to its shim (the inner engine now exists) and, when bounce is
    /// enabled, registers the arena and starts the reactor. A bounce set-up failure is a warning:
    /// the engine then advertises no capabilities and everything stays on plain UCX.
    pub(crate) fn attach(&mut self, shim: Shim) {
        self.shim = Some(shim);
        if !self.config.enabled {
            tracing::info!(agent = self.agent, "bounce disabled by configuration: pure UCX pass-through");
            return;
        }
        if self.config.arena_mem == ArenaMem::Vram && self.gpu.is_none() {
            // Asked for a GPU arena and no GPU could be had (logged at creation): a host arena
            // would bounce transfers the user did not ask to bounce.
            return;
        }
        match self.start_bounce(shim) {
            Ok(b) => self.bounce = Some(b),
            Err(why) => tracing::warn!(agent = self.agent, "bounce path unavailable, staying on plain UCX: {why}"),
        }
    }

    /// The control channel `bounce_control` names, with the endpoint to advertise (ZMQ).
    fn control_channel(&self, shim: Shim) -> Result<(Box<dyn ControlChannel>, Vec<u8>)> {
        Ok(match self.config.control {
            ControlKind::Zmq => {
                let peers = Arc::clone(&self.peers);
                let resolve = Box::new(move |peer: &str| peers.endpoint(peer));
                let z = ZmqChannel::bind(&self.agent, &self.config.zmq_host, resolve, Arc::clone(&self.stats))?;
                tracing::info!(agent = self.agent, endpoint = z.endpoint(), "ZMQ control channel bound");
                let endpoint = z.endpoint().as_bytes().to_vec();
                (Box::new(z), endpoint)
            }
            ControlKind::Ucx => (Box::new(UcxChannel::new(shim, Arc::clone(&self.mail))), Vec::new()),
        })
    }

    /// The options an arena of memory `mem` runs under: the GPU arena's beside a host one
    /// (`both`), else the engine's.
    fn arena_config(&self, mem: MemKind) -> &Config {
        match (mem, &self.gpu_config) {
            (MemKind::Vram, Some(c)) => c,
            _ => &self.config,
        }
    }

    /// The arenas `bounce_arena_mem` asks for, allocated and registered: the first (host
    /// memory, or the GPU's for `vram`/`auto` with a GPU) must be had; the GPU arena beside a
    /// host one (`both`) is given up with a warning (GPU memory then goes to UCX between hosts).
    fn make_arenas(&self, shim: &Shim) -> Result<Vec<Arena>> {
        let first = match (&self.gpu, &self.gpu_config) {
            (Some(gpu), None) => Arena::new_gpu(shim, gpu, self.config.arena_size)?,
            _ => Arena::new(shim, self.config.arena_size)?,
        };
        let mut arenas = vec![first];
        if let (Some(gpu), Some(c)) = (&self.gpu, &self.gpu_config) {
            match Arena::new_gpu(shim, gpu, c.arena_size) {
                Ok(a) => arenas.push(a),
                Err(e) => tracing::warn!(
                    agent = self.agent,
                    error = %e,
                    "no GPU arena beside the host one: GPU-memory transfers between hosts stay on UCX"
                ),
            }
        }
        Ok(arenas)
    }

    /// The copy engine of `arena`: CUDA streams for GPU memory, CPU workers for host memory.
    fn copier_for(&self, arena: &Arena, shared: &Arc<Shared>) -> Result<Box<dyn CopyEngine>> {
        let config = self.arena_config(arena.place().mem);
        Ok(match arena.device() {
            Some(vram) => {
                let path = match config.gpu_copy {
                    GpuCopy::Kernel => CopyPath::Kernel(PlanPlacement::Device),
                    GpuCopy::Batched => CopyPath::Batched,
                };
                let contexts = config.copy_workers.max(1) as usize;
                let engine = CudaCopyEngine::new(Arc::clone(vram), contexts, path)
                    .map_err(|e| Error::Arena { len: arena.len(), why: crate::shell::error::ArenaFault::Gpu(e) })?;
                tracing::info!(agent = self.agent, contexts, path = ?engine.path(), "CUDA copy engine");
                Box::new(engine)
            }
            None => {
                let host =
                    HostArena { base: arena.base(), len: arena.len(), streaming_scatter: config.streaming_scatter };
                let waker = Arc::clone(shared);
                let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
                let linger = crate::shell::reactor::hot_spin(cores);
                Box::new(CpuEngine::start(config.copy_workers, host, INLINE_MAX_BYTES, linger, move || {
                    waker.inbox.wake();
                })?)
            }
        })
    }

    /// Our capabilities: every arena with its own options' usable bytes and max chunk (`None`
    /// for no arena or more than the wire's 16; we make one or two).
    fn capabilities_of(&self, arenas: &[Arena]) -> Option<Capabilities> {
        let listed = arenas
            .iter()
            .map(|a| {
                let c = self.arena_config(a.place().mem);
                a.advert(c.arena_usable_capacity(), c.max_chunk_size)
            })
            .collect();
        Some(Capabilities {
            wire_version: u16::from(bounce_proto::wire::WIRE_VERSION),
            control: self.config.control,
            session: self.session,
            arenas: Arenas::new(listed)?,
            endpoint: Vec::new(),
            mailbox: None,
            mailbox_base: 0,
            mailbox_len: 0,
            mailbox_key: Vec::new(),
        })
    }

    fn start_bounce(&self, shim: Shim) -> Result<Bounce> {
        // Bound before the arenas: a failure here costs no registration to undo.
        let (control, control_endpoint) = self.control_channel(shim)?;
        let arenas = self.make_arenas(&shim)?;
        let Some(mut caps) = self.capabilities_of(&arenas) else {
            for a in &arenas {
                a.deregister(&shim);
            }
            return Err(Error::Arenas("none, or more than the wire's 16"));
        };
        let places: Vec<ArenaPlace> = arenas.iter().map(Arena::place).collect();
        // The mailbox one-way peers READ our answers from, and the fetch area our own one-way
        // READs land in (bounce_proto::oneway): host memory registered on its own, whatever
        // the arenas' memory, so the reactor writes records and reads answers in place.
        let layout = OneWayLayout::for_config(&self.config);
        let one_way = OneWayArea::new(&shim, &layout)
            .map_err(|e| tracing::warn!(agent = self.agent, error = %e, "no mailbox: bouncing two way only"))
            .ok();
        caps.endpoint = control_endpoint;
        if let Some(area) = &one_way {
            (caps.mailbox_base, caps.mailbox_len, caps.mailbox_key) = area.advert();
            caps.mailbox = Some(layout.advertised());
        }
        let shared = Arc::new(Shared::new(
            Arc::clone(&self.stats),
            Arc::clone(&self.peers),
            Arc::clone(&self.registry),
            self.mail.doorbell(),
        ));
        let started =
            shim.conn_info().map_err(|status| Error::Inner { op: "getConnInfo", status }).and_then(|endpoint| {
                let parts = arenas
                    .iter()
                    .map(|a| {
                        let c = self.arena_config(a.place().mem);
                        Ok(ArenaPart {
                            arena: LocalArena { place: a.place(), base: a.base(), md: a.md() },
                            copier: self.copier_for(a, &shared)?,
                            geometry: (c.arena_usable_capacity(), c.arena_granularity, c.max_chunk_size),
                        })
                    })
                    .collect::<Result<Vec<_>>>()?;
                let parts = Parts {
                    session: self.session,
                    endpoint,
                    arenas: parts,
                    one_way: one_way.as_ref().map(OneWayArea::view),
                    data: Box::new(ShimPath::new(shim, Arc::clone(&self.mail))),
                    control,
                    // The inner engine hands over everything it delivered at once; a socket
                    // is read in bounded batches.
                    control_budget: match self.config.control {
                        ControlKind::Zmq => SOCKET_POLL_BATCH,
                        ControlKind::Ucx => usize::MAX,
                    },
                };
                Reactor::start(&self.config, Arc::clone(&shared), parts)
            });
        let reactor = match started {
            Ok(r) => r,
            Err(e) => {
                for a in &arenas {
                    a.deregister(&shim);
                }
                if let Some(area) = &one_way {
                    area.deregister(&shim);
                }
                return Err(e);
            }
        };
        if self.config.control == ControlKind::Ucx {
            if let Some(t) = reactor.thread() {
                self.mail.accept_control(t);
            }
        }
        let bounce = Bounce { reactor, arenas, places, one_way, caps };
        // Registrations made before the bounce path started, each to the arena that serves it.
        for (md, r) in self.registry.all() {
            if let (Some(arena), Some(d)) = (bounce.arena_serving(&r), self.keys.local(md)) {
                shared.inbox.push(Cmd::Registered(d, r.addr, r.len, arena));
            }
        }
        self.stats.arenas.store(bounce.arenas.len() as u64, Ordering::Relaxed);
        for a in &bounce.arenas {
            let place = a.place();
            if place.mem == MemKind::Vram {
                self.stats.arena_gpu.store(place.dev.saturating_add(1), Ordering::Relaxed);
            }
            // Reading /proc/self/smaps costs time in a large process: only when it will be logged.
            let huge = tracing::enabled!(tracing::Level::INFO).then(|| a.huge_bytes()).flatten();
            tracing::info!(
                agent = self.agent,
                arena = a.len(),
                mem = ?place.mem,
                gpu = place.dev,
                huge_pages = huge,
                "bounce path ready"
            );
        }
        Ok(bounce)
    }

    fn shared(&self) -> Option<&Arc<Shared>> {
        self.bounce.as_ref().map(|b| b.reactor.shared())
    }

    /// Our capabilities, or `None` while this engine cannot bounce (bounce disabled, or no
    /// arena), in which case peers keep every transfer on plain UCX.
    pub(crate) fn capabilities(&self) -> Option<Capabilities> {
        self.bounce.as_ref().map(|b| b.caps.clone())
    }

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
        let env = ConnEnvelope::decode(envelope).map_err(|source| {
            tracing::warn!(peer = agent, error = %source, "rejecting malformed BOUNCE connection info");
            Error::BadEnvelope { agent: agent.to_owned(), source }
        })?;
        if self.bounce.is_some() {
            let (loaded, replaced) = self.peers.loaded(agent, env.caps, self.capabilities().as_ref());
            if replaced {
                // A new session: the agent restarted under the same name. Its old incarnation's
                // transfers and flows are void; the reactor reclaims them before the HELLO
                // that `peer_loaded` queues behind this, so no frame of the new session can
                // reach the old state.
                tracing::info!(peer = agent, "peer reloaded with a new session: reclaiming its old state");
                if let Some(sh) = self.shared() {
                    sh.inbox.push(Cmd::PeerLost(agent.to_owned()));
                }
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

    /// The inner engine has loaded the peer's conn info: we can now answer it, so tell it
    /// (HELLO, at arena 0), and return its arena `index` to load when it can bounce with us
    /// and has one of that index (the shim asks for 0, 1, ... until there is none).
    pub(crate) fn peer_loaded(&self, agent: &str, index: ArenaId) -> Option<ArenaToLoad> {
        let sh = self.shared()?;
        if index == ArenaId(0) {
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
    pub(crate) fn peer_lost(&self, agent: &str) {
        if let Some(sh) = self.shared() {
            let unload = self.peers.lost(agent);
            sh.inbox.push(Cmd::PeerLost(agent.to_owned()));
            if !unload.is_empty() {
                sh.inbox.push(Cmd::Unload(unload));
            }
        }
    }

    /// Records a registration made through this engine, keyed by the inner metadata handle.
    pub(crate) fn mem_registered(&self, md: Md, reg: Registration) {
        self.registry.insert(md, reg);
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
        let (Some(b), Some(sh)) = (&self.bounce, self.shared()) else { return };
        if b.arena_serving(&r).is_none() {
            return; // never a copy source or target, never a direct-write source
        }
        sh.deregister(key.map(|d| d.reg), r.addr, r.len);
    }

    /// Our registration `md`'s public data: the inner engine's `inner` wrapped with the
    /// registration's id and key (see `keys`).
    pub(crate) fn public_data(&self, md: Md, inner: &[u8]) -> Vec<u8> {
        self.keys.public_data(md, inner)
    }

    /// Takes a peer's registration metadata apart (see `keys`): the inner blob to load, and
    /// the destination it proves (`None`: not ours; it loads, but never bounces).
    pub(crate) fn split_remote_md(&self, blob: &[u8]) -> (Vec<u8>, Option<Destination>) {
        self.keys.split_remote(blob)
    }

    /// The inner engine loaded a peer's registration as `md`, carrying `dest`.
    pub(crate) fn remote_md_loaded(&self, md: Md, dest: Destination) {
        self.keys.remote_loaded(md, dest);
    }

    /// NIXL unloaded remote metadata `md`.
    pub(crate) fn remote_md_unloaded(&self, md: Md) {
        if let (Some(handle), Some(ipc)) = (self.keys.remote_unloaded(md), &self.ipc) {
            ipc.unmap(&handle);
        }
    }

    /// Routing decision for a request (the gate, README "What takes the bounce path"):
    /// `Some(handle)` when BOUNCE owns it, `None` to delegate it to UCX unchanged. `None` for
    /// an operation or memory segment NIXL does not define.
    pub(crate) fn prep(
        &self,
        op: Option<XferOp>,
        local: &[DescView],
        local_mem: Option<MemSeg>,
        remote: &[DescView],
        remote_mem: Option<MemSeg>,
        agent: &str,
    ) -> Option<u64> {
        let to_desc = |d: &DescView| gate::Desc { addr: d.addr, len: d.len, dev: d.dev };
        let (l, r): (Vec<_>, Vec<_>) = (local.iter().map(to_desc).collect(), remote.iter().map(to_desc).collect());
        // Two way once the peer said HELLO; else one way, answered through its mailbox, when
        // it keeps one and so do we (our READs of it land in our fetch area).
        let one_way_here = self.bounce.as_ref().is_some_and(|b| b.caps.mailbox.is_some());
        let two_way_arenas = self.peers.bounce_arenas(agent);
        let peer_arenas = two_way_arenas
            .or_else(|| one_way_here.then(|| self.peers.one_way_target(agent).map(|(places, _)| places)).flatten());
        // Each side bounces through the arena of its descriptors' memory (docs/arenas.md); with
        // none, the first, which the gate refuses for its memory.
        let (local_kind, remote_kind) = (local_mem.and_then(MemSeg::kind), remote_mem.and_then(MemSeg::kind));
        let ours = self.bounce.as_ref().map_or(&[HOST_ARENA][..], |b| &b.places[..]);
        let (our_id, our_place) = gate::arena_for(ours, local_kind, &l).unwrap_or((ArenaId(0), HOST_ARENA));
        let theirs = peer_arenas.as_deref().and_then(|p| gate::arena_for(p, remote_kind, &r));
        let config = self.arena_config(our_place.mem);
        let input = GateInput::new(
            config,
            self.bounce.is_some(),
            match op {
                Some(XferOp::Write) => gate::XferOp::Write,
                _ => gate::XferOp::Read, // an op NIXL does not define is not a write either
            },
            (local_kind, our_place),
            (remote_kind, theirs.map(|(_, place)| place)),
            &l,
            &r,
            theirs.is_some(),
        );
        let their_id = theirs.map_or(ArenaId(0), |(id, _)| id);
        // A READ's bytes go the other way: the peer's descriptors are the sources (its gather
        // runs), ours the destinations (our scatter runs).
        let read = matches!(op, Some(XferOp::Read));
        let pair = |(l, r): (&DescView, &DescView)| match read {
            false => DescPair { src: l.addr, dst: r.addr, len: l.len },
            true => DescPair { src: r.addr, dst: l.addr, len: l.len },
        };
        // A peer process of this host whose records we loaded: one kernel (GPU memory) or one
        // kernel copy per piece (host memory, CMA), no bounce.
        if let Some(h) = self.prep_mapped(op, &input, local, remote, agent, pair) {
            return Some(h);
        }
        // The gate runs once; `Bounce` without a running reactor cannot happen (the gate checks
        // `bounce_running`), and would count as disabled.
        let sh = match (gate::route(&input), self.shared()) {
            (Route::Bounce, Some(sh)) => sh,
            (Route::PassThrough(reason), _) => {
                if reason == FallbackReason::Mem {
                    self.tell_other_kind_once(&input);
                }
                return self.count_fallback(reason);
            }
            (Route::Bounce, None) => return self.count_fallback(FallbackReason::Disabled),
        };
        let pairs: Vec<DescPair> = local.iter().zip(remote).map(pair).collect();
        // Where the transfer writes must be registrations whose metadata (and key) we were
        // given: the WANT proves each, and the receiver scatters nowhere else.
        let Some(dests) = self.keys.destinations(remote.iter().map(|d| d.md)) else {
            tracing::debug!(peer = agent, "a destination has no BOUNCE key (metadata not ours); plain UCX");
            Stats::bump(&self.stats.fallback_unproven);
            Stats::bump(&self.stats.passthrough_xfers);
            return None;
        };
        let mut params = PlanParams::from_config(config);
        // Chunks that both arenas can hold: the smaller of our arena's max chunk (our caps
        // carry the config's) and the peer's arena's (a host arena's and a GPU arena's defaults
        // differ); the peer grants regions of the planned sizes.
        if let Some(chunk) =
            self.bounce.as_ref().and_then(|b| self.peers.chunk_with(agent, (&b.caps, our_id), their_id))
        {
            params.max_chunk = chunk;
        }
        // Plans in regions are for WRITEs, two way and one way (the DATA that names them goes
        // from the initiator either way): a READ's initiator scatters by its own runs.
        if read {
            params.region_plan_runs = 0;
        }
        // Runs never merge across registrations (either side's): the receiver checks each run
        // inside one.
        let mut seg = 0u32;
        let segs: Vec<u32> = local
            .iter()
            .zip(remote)
            .enumerate()
            .map(|(i, (l, r))| {
                if i > 0 && (local[i - 1].md, remote[i - 1].md) != (l.md, r.md) {
                    seg = seg.wrapping_add(1);
                }
                seg
            })
            .collect();
        match plan::plan_segmented(&pairs, &segs, params) {
            Ok(mut p) => {
                p.dests = dests;
                p.read = read;
                (p.local_arena, p.peer_arena) = (our_id, their_id);
                // A chunk may be written straight from user memory only when one registration
                // of the arena's memory made through this engine covers its whole source range.
                gate::restrict_direct(&mut p, &self.registry.for_gate(), input.arena.mem, self.config.direct_writes);
                Some(sh.requests.insert(agent.to_owned(), p))
            }
            Err(e) => {
                tracing::warn!(peer = agent, error = %e, "cannot plan the transfer; plain UCX");
                self.count_fallback(FallbackReason::Op)
            }
        }
    }

    /// The same-host path's request for a transfer the gate would let bounce, when every
    /// remote descriptor's registration came with a record of this host this engine can use:
    /// CUDA IPC for GPU memory (the path of the GPU our descriptors are on), CMA for host
    /// memory, whatever our arena, under that memory kind's thresholds (for host memory, none
    /// from `bounce_cma_large_bytes` up).
    fn prep_mapped(
        &self,
        op: Option<XferOp>,
        input: &GateInput<'_>,
        local: &[DescView],
        remote: &[DescView],
        agent: &str,
        pair: impl Fn((&DescView, &DescView)) -> DescPair,
    ) -> Option<u64> {
        let place = gate::mapped_place(input)?;
        // The path for that memory, if this engine has it.
        enum Path<'a> {
            Ipc(&'a IpcPaths),
            Cma(&'a CmaPath),
        }
        let path = match place.mem {
            MemKind::Vram => Path::Ipc(self.ipc.as_ref()?),
            MemKind::Dram => Path::Cma(self.cma.as_ref()?),
        };
        if !matches!(op, Some(XferOp::Write | XferOp::Read)) {
            return None;
        }
        let input = self.mapped_limits.apply(place.mem, input);
        if gate::route_mapped(&input, true) != Route::Bounce {
            return None;
        }
        let recs = self.keys.remote_reach(remote.iter().map(|d| d.md))?;
        let pairs: Vec<DescPair> = local.iter().zip(remote).map(pair).collect();
        let read = matches!(op, Some(XferOp::Read));
        match path {
            Path::Ipc(ipc) => {
                let recs: Option<Vec<_>> = recs.iter().map(|(r, n)| Some((r.ipc()?, *n))).collect();
                ipc.prep(place.dev, agent, &pairs, &recs?, read)
            }
            Path::Cma(cma) => {
                let recs: Option<Vec<_>> = recs.iter().map(|(r, n)| Some((r.cma()?, *n))).collect();
                cma.prep(agent, &pairs, &recs?, read)
            }
        }
    }

    /// Logs once per engine that a transfer went to UCX only because its memory is not our
    /// arena's kind (the gate's [`gate::other_arena_kind`]) and no same-host path took it
    /// (another host, or the path off): `auto` picks the arena before any memory is
    /// registered, so nothing else would tell the application.
    fn tell_other_kind_once(&self, input: &GateInput<'_>) {
        let Some(kind) = gate::other_arena_kind(input) else { return };
        if self.told_other_kind.swap(true, Ordering::Relaxed) {
            return;
        }
        tracing::warn!(
            agent = %self.agent,
            "{kind:?} transfers of many small descriptors go to UCX: no arena of this engine is {kind:?} \
             memory ({:?} is the one they met) and no same-host path took them (set bounce_arena_mem={} \
             or both on an engine that moves {kind:?} between hosts, README \"GPU memory\"); said once",
            input.arena.mem,
            if kind == MemKind::Dram { "dram" } else { "vram" },
        );
    }

    /// Counts a pass-through and its reason (README "What takes the bounce path"); the request
    /// goes to UCX (`None`).
    fn count_fallback(&self, reason: FallbackReason) -> Option<u64> {
        let s = &self.stats;
        Stats::bump(match reason {
            FallbackReason::Disabled => &s.fallback_disabled,
            // Malformed lists are counted with the wrong operations, as they always were: UCX
            // answers both with its own statuses.
            FallbackReason::Op | FallbackReason::Malformed => &s.fallback_op,
            FallbackReason::Mem => &s.fallback_mem,
            FallbackReason::Count => &s.fallback_count,
            FallbackReason::Size => &s.fallback_size,
            _ => &s.fallback_peer,
        });
        Stats::bump(&s.passthrough_xfers);
        None
    }

    /// Posts a bounce request.
    ///
    /// # Errors
    /// [`Error::NoBounce`], or what [`Requests::post`](crate::shell::requests::Requests::post)
    /// refuses.
    pub(crate) fn post(&self, handle: u64, notif: Option<Vec<u8>>) -> Result<()> {
        if let Some(ipc) = self.ipc.as_ref().filter(|_| handle & IPC_HANDLE_BIT != 0) {
            return ipc.post(handle, notif);
        }
        if let Some(cma) = self.cma.as_ref().filter(|_| handle & CMA_HANDLE_BIT != 0) {
            return cma.post(handle, notif);
        }
        let sh = self.shared().ok_or(Error::NoBounce)?;
        let p = sh.requests.post(handle, notif)?;
        // Submitted in a pass on this thread (the WANT leaves before post returns), or by the
        // reactor thread when no pass can run here.
        sh.inbox.push_quiet(Cmd::Submit(p));
        if self.drive().is_none() {
            sh.inbox.wake();
        }
        Ok(())
    }

    /// Status of a bounce request.
    ///
    /// # Errors
    /// [`Error::NoBounce`], [`Error::UnknownRequest`], [`Error::NotPosted`], or the transfer's
    /// failure as [`Error::Xfer`].
    pub(crate) fn check(&self, handle: u64) -> Result<Progress> {
        if let Some(ipc) = self.ipc.as_ref().filter(|_| handle & IPC_HANDLE_BIT != 0) {
            return ipc.check(handle, self.shim);
        }
        if let Some(cma) = self.cma.as_ref().filter(|_| handle & CMA_HANDLE_BIT != 0) {
            return cma.check(handle, self.shim, self.config.check_wait);
        }
        let sh = self.shared().ok_or(Error::NoBounce)?;
        let wait = self.poll_wait(self.drive());
        match sh.requests.check(handle, BUSY_POLL_GAP, wait) {
            None => Err(Error::UnknownRequest(handle)),
            Some(State::Prepared) => Err(Error::NotPosted(handle)),
            Some(State::Posted(_)) => {
                // Hand the core to the reactor and copy workers: an application spinning on
                // checkXfer otherwise takes a core they need. The busy-poll wait above does
                // most of that; the yield covers `bounce_check_wait_us = 0`.
                std::thread::yield_now();
                Ok(Progress::InFlight)
            }
            Some(State::Done(Ok(()))) => Ok(Progress::Done),
            Some(State::Done(Err(e))) => Err(Error::Xfer(e)),
        }
    }

    /// Releases a bounce request, cancelling it when still in flight.
    ///
    /// # Errors
    /// [`Error::NoBounce`], [`Error::UnknownRequest`].
    pub(crate) fn release(&self, handle: u64) -> Result<()> {
        if let Some(ipc) = self.ipc.as_ref().filter(|_| handle & IPC_HANDLE_BIT != 0) {
            return ipc.release(handle);
        }
        if let Some(cma) = self.cma.as_ref().filter(|_| handle & CMA_HANDLE_BIT != 0) {
            return cma.release(handle);
        }
        let sh = self.shared().ok_or(Error::NoBounce)?;
        match sh.requests.remove(handle) {
            None => Err(Error::UnknownRequest(handle)),
            Some(Released::InFlight(xfer)) => {
                sh.inbox.push(Cmd::Cancel(xfer));
                Ok(())
            }
            Some(Released::Idle) => Ok(()),
        }
    }

    /// The application's notifications, in arrival order, after pulling what waits in the
    /// inner engine (control frames found there go to the reactor).
    ///
    /// # Errors
    /// [`Error::Inner`] when the inner engine's `getNotifs` failed.
    ///
    /// An application that spins on `getNotifs` while bounce requests are in flight takes a
    /// core the reactor and copy workers need (and, in NIXL's STRICT mode, the agent lock its
    /// other threads need). Such a busy poll (an empty call within [`BUSY_POLL_GAP`] of the
    /// previous empty one) that again finds nothing waits on the doorbell, bounded by
    /// `bounce_check_wait_us`, until a notification is sorted or a request finishes. The reactor
    /// keeps pulling the inner engine while bounce requests are in flight, so nothing arrives
    /// unseen; with none in flight, `getNotifs` never waits (pass-through keeps UCX's cost).
    pub(crate) fn take_notifs(&self) -> Result<Vec<Notif>> {
        let bell = self.mail.bell();
        let ticket = bell.ticket();
        let got = self.pull_and_take()?;
        let drove = self.after_app_pull();
        if !got.is_empty() || !self.notif_poll_is_busy() {
            return Ok(got);
        }
        let wait = self.poll_wait(drove.or_else(|| self.drive()));
        if !wait.is_zero() && bell.wait_past(ticket, wait) {
            let got = self.pull_and_take()?;
            if self.mail.control_waiting() {
                let _ = self.control_arrived();
            }
            return Ok(got);
        }
        Ok(got)
    }

    /// Whether the application's `getNotifs` may pull the inner engine straight into its own
    /// list (asked with the inner engine's lock held): nothing older waits in the mailroom
    /// ([`Mailroom::app_pull_is_direct`]) and no bounce request is in flight (a poller then
    /// takes [`Self::take_notifs`], whose busy-poll wait needs it). Pass-through traffic then
    /// costs what UCX's own `getNotifs` does.
    pub(crate) fn app_notifs_direct(&self) -> bool {
        let direct = self.shim.is_some()
            && self.shared().is_none_or(|sh| sh.requests.in_flight() == 0)
            && self.mail.app_pull_is_direct();
        // The caller pulls the inner engine now; the other way notes its pull in
        // `Mailroom::pull_and_take`.
        if direct {
            self.mail.note_app_pull();
        }
        direct
    }

    /// Whether the bounce path has work in flight (a receiver's flows included), which a
    /// poller advances by driving ([`Self::control_arrived`] after its pull).
    pub(crate) fn bounce_busy(&self) -> bool {
        self.bounce.as_ref().is_some_and(|b| b.reactor.busy())
    }

    /// For a direct pull: takes `msg` when it is a control frame (see [`Mailroom::divert`]).
    /// The caller says [`Self::control_arrived`] once its pull is over and the inner engine's
    /// lock released.
    pub(crate) fn divert_notif(&self, agent: &[u8], msg: &[u8]) -> bool {
        self.mail.divert(agent, msg)
    }

    /// After the application's pull of the inner engine: a reactor pass on this thread when
    /// the pull found control frames or the bounce path is busy ([`Self::control_arrived`]),
    /// or when a frame waits on the control channel's own socket (ZMQ), which no pull of the
    /// inner engine sees. A target whose application polls then answers a WANT at its next
    /// poll, as it does over UCX notifications, not when its reactor thread next looks.
    pub(crate) fn after_app_pull(&self) -> Option<Drove> {
        if self.mail.control_waiting() || self.bounce_busy() {
            let drove = self.control_arrived();
            // The pass moved nothing and left copies on the workers (a receiver's scatter):
            // this poller will be back at once with nothing to do until one finishes, so it
            // hands its core over, as `check` does. On a small host a copy worker woken onto
            // the core of an application spinning on getNotifs otherwise waited out the
            // poller's time slice (2 cores, a 1 MiB bounced WRITE to a polling target: p99
            // 4.0-5.2 ms, 0.65-1.3 ms with the yield).
            if drove.is_some_and(|d| d.copying && !d.moved) {
                std::thread::yield_now();
            }
            drove
        } else {
            self.bounce.as_ref()?.reactor.drive_if_readable()
        }
    }

    /// Whether the application's direct pull must be followed by [`Self::after_app_pull`]:
    /// the bounce path is busy, or control frames may wait on a socket of the channel's own.
    pub(crate) fn look_after_app_pull(&self) -> bool {
        self.bounce_busy() || self.bounce.as_ref().is_some_and(|b| b.reactor.own_socket())
    }

    /// This application thread pulled control frames, or polled while the bounce path is
    /// busy: run a reactor pass here, or wake the reactor thread when no pass can run here (a
    /// GPU arena, or the thread is in a pass of its own and may have polled before the frames
    /// were queued).
    pub(crate) fn control_arrived(&self) -> Option<Drove> {
        let drove = self.drive();
        if drove.is_none() {
            self.mail.wake_reactor();
        }
        drove
    }

    /// One reactor pass on the calling thread ([`Reactor::drive`]), or `None` when none ran.
    /// Called only by pollers and posters, never with a lock of ours or the shim's held.
    fn drive(&self) -> Option<Drove> {
        self.bounce.as_ref()?.reactor.drive()
    }

    /// How long a busy poller of bounce requests waits, after `drove`, for one to finish.
    ///
    /// A poller whose pass ran and left no copy on the workers is the transfer's progress, as
    /// it is UCX's: it answers at once and drives again at its next call (waiting would leave
    /// the next frame to the reactor thread, which a spinning application keeps off the core on
    /// a small host). Otherwise it waits up to `bounce_check_wait_us`, so the copy workers and
    /// the reactor get the core (issue 12: a spinning poller cost them whole scheduler ticks).
    fn poll_wait(&self, drove: Option<Drove>) -> Duration {
        match drove {
            Some(d) if d.moved || !d.copying => Duration::ZERO,
            Some(_) => {
                // This poller stops driving for a while: the reactor thread takes over now.
                if let Some(b) = self.bounce.as_ref().filter(|_| !self.config.check_wait.is_zero()) {
                    b.reactor.resign();
                }
                self.config.check_wait
            }
            None => self.config.check_wait,
        }
    }

    /// Pulls the inner engine's notifications and takes the application's.
    fn pull_and_take(&self) -> Result<Vec<Notif>> {
        match &self.shim {
            Some(shim) => self.mail.pull_and_take(shim).map_err(|status| Error::Inner { op: "getNotifs", status }),
            None => Ok(self.mail.take_app()),
        }
    }

    /// Whether this empty `getNotifs` is part of a busy poll while bounce requests are in
    /// flight (see [`Self::take_notifs`]); records it as the latest empty call.
    fn notif_poll_is_busy(&self) -> bool {
        // Cheap checks first: with nothing bounced in flight this is every idle getNotifs.
        let Some(sh) = self.shared() else { return false };
        if sh.requests.in_flight() == 0 || self.config.check_wait.is_zero() {
            return false;
        }
        let now = Instant::now();
        let last = self.last_empty_notifs.lock().replace(now);
        last.is_some_and(|t| now.saturating_duration_since(t) < BUSY_POLL_GAP)
    }

    /// Gauges are derived from the state they describe, not kept in step by hand.
    fn refresh_gauges(&self) {
        self.stats.registrations.store(self.registry.len() as u64, Ordering::Relaxed);
        if let Some(sh) = self.shared() {
            self.stats.peers_ready.store(self.peers.ready() as u64, Ordering::Relaxed);
            let retiring = sh.arenas_retiring.load(Ordering::Relaxed);
            self.stats.peer_arenas_loaded.store(self.peers.arenas_loaded() as u64 + retiring, Ordering::Relaxed);
        }
    }

    /// Hands `publish` the counters that changed since the last call (all of them the first
    /// time). Publishing means formatting a line per counter and taking the inner engine's
    /// lock: a polling loop (getNotifs, checkXfer) must not pay that when nothing moved, nor a
    /// prep that bumps two counters pay for twenty (measured: an empty getNotifs cost 6x UCX's,
    /// issue 12); nor even compare every counter when none changed ([`Stats::publish_changes`]).
    /// `publish` runs under this engine's publish lock, so two threads publishing at once
    /// cannot leave an older value behind a newer one.
    /// Each counter goes with its index in [`Stats::for_each`]'s order, which never changes.
    pub(crate) fn publish_changed_stats(&self, publish: impl FnMut(usize, &'static str, u64)) {
        self.refresh_gauges();
        self.stats.publish_changes(&mut self.published.lock(), publish);
    }
}

/// The gate's thresholds for the same-host paths, by the memory kind a path copies: for the
/// arena's kind the configuration's, for the other kind the same options with that kind's
/// defaults. So a GPU-arena engine's host-memory transfers take the host defaults, as a
/// host-arena engine's do, and the other way round; an option the application set holds for
/// both.
#[derive(Debug, Clone, Copy)]
struct MappedLimits {
    /// `(min_descriptor_count, max_average_descriptor_size)` for host memory.
    dram: (u64, u64),
    /// The same for GPU memory.
    vram: (u64, u64),
    /// Host-memory transfers of at least this many bytes pass whatever their descriptors
    /// (`bounce_cma_large_bytes`; 0: none).
    dram_large: u64,
}

impl MappedLimits {
    fn new(config: &Config, gpu_arena: bool, params: &[(&str, &str)], env: impl Fn(&str) -> Option<String>) -> Self {
        let of = |c: &Config| (c.min_descriptor_count, c.max_average_descriptor_size);
        let other_kind = if gpu_arena { MemKind::Dram } else { MemKind::Vram };
        // Its warnings were said by the configuration's load; one that does not validate with
        // the other kind's defaults keeps the configuration's thresholds.
        let other = Config::from_params_as(Some(other_kind), params.iter().copied(), env)
            .map_or(of(config), |loaded| of(&loaded.config));
        let dram_large = config.cma_large_bytes;
        match gpu_arena {
            true => Self { dram: other, vram: of(config), dram_large },
            false => Self { dram: of(config), vram: other, dram_large },
        }
    }

    /// `input` under the thresholds for memory `mem`. A large host-memory transfer has none:
    /// split over the CMA path's threads it beats UCX's cma, which copies it on one.
    fn apply<'a>(&self, mem: MemKind, input: &GateInput<'a>) -> GateInput<'a> {
        let large = || {
            self.dram_large > 0 && input.local.iter().map(|d| d.len).fold(0u64, u64::saturating_add) >= self.dram_large
        };
        let (min_descriptor_count, max_average_descriptor_size) = match mem {
            MemKind::Dram if large() => (1, u64::MAX),
            MemKind::Dram => self.dram,
            MemKind::Vram => self.vram,
        };
        GateInput { min_descriptor_count, max_average_descriptor_size, ..*input }
    }
}

/// The GPU whose memory an arena should be (`None`: host memory only), as `bounce_arena_mem`
/// asks: `vram` and `both` take the GPU of the CUDA context current on this thread (the
/// application's), else GPU 0; `auto` takes the current context's GPU only (a process that
/// has not used a GPU keeps a host arena, and no CUDA context is created for it). Without a
/// usable driver or GPU a GPU arena cannot be had: one log line, then host memory for `auto`
/// and `both`, no bounce path for `vram` (see [`Engine::attach`]).
fn choose_gpu(agent: &str, config: &Config) -> Option<Arc<Gpu>> {
    if !config.enabled || config.arena_mem == ArenaMem::Dram {
        return None;
    }
    let explicit = matches!(config.arena_mem, ArenaMem::Vram | ArenaMem::Both);
    let ordinal = match (cuda::current_device(), explicit) {
        (Ok(Some(dev)), _) => dev,
        (Ok(None), true) => 0,
        (Ok(None), false) => return None,
        (Err(e), _) => {
            match config.arena_mem {
                ArenaMem::Vram => {
                    tracing::warn!(agent, error = %e, "bounce_arena_mem=vram but CUDA is unusable: no bounce path");
                }
                ArenaMem::Both => {
                    tracing::warn!(agent, error = %e, "bounce_arena_mem=both but CUDA is unusable: a host arena only");
                }
                _ => tracing::debug!(agent, error = %e, "no CUDA: host-memory arena"),
            }
            return None;
        }
    };
    match Gpu::open(ordinal) {
        Ok(gpu) => Some(gpu),
        Err(e) => {
            tracing::warn!(agent, gpu = ordinal, error = %e, "cannot open the GPU for the arena: host-memory arena");
            None
        }
    }
}

impl Engine {
    /// Closes the bounce path while the inner engine still exists (`bnc_engine_stop`): the
    /// reactor says GOODBYE, waits for the grants it gave out, unloads the peer arenas and is
    /// joined (with its copy engine); then the arena is deregistered, and its memory handed
    /// back only when no peer still held a grant in it (otherwise it stays mapped, leaked, so
    /// a late write cannot land in memory used for something else). Idempotent; afterwards the
    /// engine is plain UCX.
    pub(crate) fn stop(&mut self) {
        // Its running copies end first; its notifications need the inner engine.
        drop(self.ipc.take());
        drop(self.cma.take());
        let (Some(b), Some(shim)) = (self.bounce.take(), self.shim) else { return };
        let Bounce { reactor, arenas, one_way, .. } = b;
        let quiet = reactor.stop();
        self.stats.arenas.store(0, Ordering::Relaxed);
        for arena in &arenas {
            arena.deregister(&shim);
        }
        if let Some(area) = &one_way {
            area.deregister(&shim);
        }
        if quiet {
            drop(arenas);
            drop(one_way);
        } else {
            tracing::warn!(
                agent = self.agent,
                len = arenas.iter().map(Arena::len).sum::<u64>() + one_way.as_ref().map_or(0, OneWayArea::len),
                "a peer may still write into the arenas: their memory and the mailbox's are kept (leaked)"
            );
            for arena in arenas {
                arena.leak();
            }
            if let Some(area) = one_way {
                area.leak();
            }
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        // Normally done already by bnc_engine_stop, before the inner engine was destroyed.
        self.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KIB: u64 = 1024;

    fn limits(gpu_arena: bool, params: &[(&str, &str)], env: &[(&str, &str)]) -> MappedLimits {
        let env = |k: &str| env.iter().find(|(name, _)| *name == k).map(|(_, v)| (*v).to_owned());
        let kind = gpu_arena.then_some(MemKind::Vram).or(Some(MemKind::Dram));
        let config = Config::from_params_as(kind, params.iter().copied(), env).unwrap().config;
        MappedLimits::new(&config, gpu_arena, params, env)
    }

    #[test]
    fn each_memory_kind_takes_its_own_defaults_whatever_the_arena() {
        // Host memory: at most 64 KiB on average; GPU memory: 256 KiB (the manifest's columns).
        for gpu_arena in [false, true] {
            let l = limits(gpu_arena, &[], &[]);
            assert_eq!(l.dram, (256, 64 * KIB), "gpu arena: {gpu_arena}");
            assert_eq!(l.vram, (256, 256 * KIB), "gpu arena: {gpu_arena}");
        }
    }

    #[test]
    fn an_option_the_application_set_holds_for_both_kinds() {
        for gpu_arena in [false, true] {
            let l = limits(gpu_arena, &[("bounce_max_average_descriptor_size", "8KiB")], &[]);
            assert_eq!((l.dram.1, l.vram.1), (8 * KIB, 8 * KIB), "gpu arena: {gpu_arena}");
            let l = limits(gpu_arena, &[], &[("NIXL_BOUNCE_MIN_DESCRIPTOR_COUNT", "17")]);
            assert_eq!((l.dram.0, l.vram.0), (17, 17), "gpu arena: {gpu_arena}");
        }
    }

    /// A WRITE of host memory `d` to host memory `d`, our arena at `place`, no peer arena.
    fn host_write<'a>(config: &'a Config, place: ArenaPlace, d: &'a [gate::Desc]) -> GateInput<'a> {
        let dram = Some(MemKind::Dram);
        GateInput::new(config, true, gate::XferOp::Write, (dram, place), (dram, None), d, d, false)
    }

    #[test]
    fn the_same_host_gate_applies_the_thresholds_of_the_memory_it_copies() {
        let l = MappedLimits { dram: (4, 100), vram: (8, 1000), dram_large: 0 };
        let d: Vec<gate::Desc> = (0..6).map(|i| gate::Desc { addr: i * 0x1000, len: 512, dev: 0 }).collect();
        let place = ArenaPlace { mem: MemKind::Vram, dev: 0 };
        let config = Config::from_params_as(Some(MemKind::Vram), [], |_| None).unwrap().config;
        let mut input = host_write(&config, place, &d);
        // Six pieces of 512 bytes: too large on average for host memory here, too few for GPU.
        assert_eq!(gate::route_mapped(&l.apply(MemKind::Dram, &input), true), Route::PassThrough(FallbackReason::Size));
        (input.local_mem, input.remote_mem) = (Some(MemKind::Vram), Some(MemKind::Vram));
        assert_eq!(
            gate::route_mapped(&l.apply(MemKind::Vram, &input), true),
            Route::PassThrough(FallbackReason::Count)
        );
        let l = MappedLimits { vram: (4, 1000), ..l };
        assert_eq!(gate::route_mapped(&l.apply(MemKind::Vram, &input), true), Route::Bounce);
    }

    #[test]
    fn a_large_host_memory_transfer_passes_whatever_its_descriptors() {
        let d: Vec<gate::Desc> = (0..2).map(|i| gate::Desc { addr: i << 30, len: 4 << 20, dev: 0 }).collect();
        let place = ArenaPlace { mem: MemKind::Dram, dev: 0 };
        let config = Config::default();
        let input = host_write(&config, place, &d);
        let l = MappedLimits { dram: (256, 64 * KIB), vram: (256, 256 * KIB), dram_large: 8 << 20 };
        assert_eq!(gate::route_mapped(&l.apply(MemKind::Dram, &input), true), Route::Bounce, "8 MiB in two");
        let small = MappedLimits { dram_large: (8 << 20) + 1, ..l };
        assert_eq!(
            gate::route_mapped(&small.apply(MemKind::Dram, &input), true),
            Route::PassThrough(FallbackReason::Count)
        );
        let off = MappedLimits { dram_large: 0, ..l };
        assert_eq!(
            gate::route_mapped(&off.apply(MemKind::Dram, &input), true),
            Route::PassThrough(FallbackReason::Count)
        );
    }
}
