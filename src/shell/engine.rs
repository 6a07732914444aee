//! One BOUNCE engine: its configuration, the inner UCX plugin it delegates to, the routing gate
//! and its bounce requests. What it knows of its peers and of the memory registered through it
//! lives in one table each ([`PeerTable`], [`Registry`]), shared with its reactor.
//!
//! Created by `ffi::abi::bnc_engine_create` when NIXL creates a "BOUNCE" backend; destroyed when
//! NIXL destroys it. All methods take `&self`: NIXL calls an engine from many threads.
//!
//! Here: creation, posting, checking and releasing requests, the counters, stopping. Beside it:
//! [`start`] (the bounce path started at the first conn-info query), [`metadata`] (conn info and
//! registrations' public data, both ways), [`prep`] (the routing gate per memory kind) and
//! [`notifs`] (`getNotifs` and the reactor passes it runs).

use std::collections::hash_map::RandomState;
use std::ffi::c_void;
use std::hash::{BuildHasher, Hasher};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bounce_proto::config::{ArenaGpus, ArenaMem, Config, GpuCopy, MAX_ARENA_GPUS};
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
use crate::shell::control::links::Links;
use crate::shell::control::ucx::UcxChannel;
use crate::shell::control::zmq::ZmqChannel;
use crate::shell::copy::CopyEngine;
use crate::shell::copy::cpu::{CpuEngine, HostArena, INLINE_MAX_BYTES};
use crate::shell::copy::cuda::{CopyPath, CudaCopyEngine};
use crate::shell::datapath::ShimPath;
use crate::shell::ipc::{IPC_HANDLE_BIT, IpcPaths};
use crate::shell::keys::{Keys, LoadStamp, Reach, Split};
use crate::shell::mailroom::{Diverted, Mailroom};
use crate::shell::oneway_area::OneWayArea;
use crate::shell::peers::{ArenaToLoad, PeerTable};
use crate::shell::progress::ProgressThread;
use crate::shell::reactor::{ArenaPart, Cmd, Drove, LocalArena, Parts, Reactor, SOCKET_POLL_BATCH, Shared};
use crate::shell::registry::{Registration, Registry};
use crate::shell::requests::{Released, State};
use crate::shell::stats::{Published, Stats};
use crate::shell::{Error, Result};
use crate::sys::cuda::{self, Gpu, PlanPlacement};
use crate::sys::inner_plugin::{InnerPlugin, locate_ucx_plugin};
use crate::sys::nixl::{MemSeg, XferOp};
use crate::sys::shim::{Md, Notif, Shim};

mod metadata;
mod notifs;
mod prep;
mod start;

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

/// A descriptor as NIXL hands it to a backend (`bnc_meta_desc`). Laid out as the FFI's
/// descriptor, so a prep reads NIXL's list in place (`ffi::abi`'s `descs`).
#[derive(Debug, Clone, Copy)]
#[repr(C)]
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
    /// By [`ArenaId`] (the order of our capabilities): one, a host and a GPU arena (`both`),
    /// or one per GPU `bounce_arena_gpus` lists (after the host one with `both`).
    arenas: Vec<Arena>,
    /// Where each arena lives, by [`ArenaId`] (what the gate picks from): kept beside `arenas`
    /// so that every prep borrows a slice instead of collecting one.
    places: Vec<ArenaPlace>,
    /// Our mailbox and fetch area (`None`: it could not be set up; two way only).
    one_way: Option<OneWayArea>,
    caps: Capabilities,
    /// Which peers' ZMQ endpoints our sockets reached (`None` over UCX, which needs none): a
    /// one-way transfer goes only to a peer reached.
    links: Option<Arc<Links>>,
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
    /// The GPUs whose memory arenas are, in arena order, when `bounce_arena_mem` chose GPU
    /// memory (one, or those `bounce_arena_gpus` lists).
    gpus: Vec<Arc<Gpu>>,
    /// The GPU arenas' options (GPU defaults for what is unset) beside a host arena under
    /// `config` (`both`); `None` when every arena is of one kind, whose options `config` holds.
    gpu_config: Option<Config>,
    /// When `getNotifs` last found nothing (busy-poll detection, see [`Engine::take_notifs`]).
    last_empty_notifs: Mutex<Option<Instant>>,
    /// The lists a prep works in, kept for the next one (see [`prep::PrepScratch`]).
    prep_scratch: Mutex<prep::PrepScratch>,
    /// The same-host paths for GPU memory (`bounce_cuda_ipc`): one per GPU whose memory this
    /// engine registers, whatever its arena.
    ipc: Option<IpcPaths>,
    /// The same-host path for host memory (`bounce_cma`), whatever the arena.
    cma: Option<CmaPath>,
    /// The same-host paths' thresholds, by the memory kind they copy.
    mapped_limits: MappedLimits,
    /// `bounce_arena_mem=auto` that chose a GPU: the options with the host defaults (and their
    /// thresholds), for a host arena when the GPU arena cannot be had at start (its copy
    /// engine cannot start: a build without kernels, a driver refusing the PTX; its VRAM or
    /// registration refused), which `auto` promises rather than no bounce path.
    host_fallback: Option<(Config, MappedLimits)>,
    /// Whether the agent asked for NIXL's progress thread (the reactor gives that progress).
    wants_progress: bool,
    /// Background progress when the bounce path did not start and the agent asked for it.
    progress: Option<ProgressThread>,
    /// Whether the one line about transfers of memory of a kind no arena is was logged.
    told_other_kind: AtomicBool,
    /// Whether the one line about GPU memory on a GPU without an arena (or spread over
    /// several) was logged.
    told_other_gpu: AtomicBool,
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
        let gpus = Self::choose_gpus(p.agent, &loaded.config);
        let mut host_fallback = None;
        if !gpus.is_empty() && !both {
            if loaded.config.arena_mem == ArenaMem::Auto {
                // Loaded with the host defaults: what a host arena would run under.
                host_fallback = Some(loaded.config.clone());
            }
            // GPU arenas only: the options left unset take their VRAM defaults.
            loaded = Config::from_params_as(Some(MemKind::Vram), p.params.iter().copied(), &env)?;
        }
        // `both`: the engine's options (its host arena's) keep the host defaults, the GPU
        // arenas' take the VRAM ones; the warnings of that second load are the first's.
        let gpu_config = if both && !gpus.is_empty() {
            Some(Config::from_params_as(Some(MemKind::Vram), p.params.iter().copied(), &env)?.config)
        } else {
            None
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
        let no_bounce = !config.enabled || (config.arena_mem == ArenaMem::Vram && gpus.is_empty());
        let ipc = (!no_bounce && config.cuda_ipc).then(|| IpcPaths::new(&gpus, Arc::clone(&stats)));
        let cma = (!no_bounce && config.cma)
            .then(|| {
                let cpus = std::thread::available_parallelism().ok().map(std::num::NonZeroUsize::get);
                let linger = crate::shell::reactor::hot_spin(cpus.unwrap_or(1));
                CmaPath::new(cma::workers_for(config.cma_workers, cpus), linger, Arc::clone(&stats))
            })
            .flatten();
        let mapped_limits = MappedLimits::new(&config, config.defaults_for == MemKind::Vram, &p.params, &env);
        let host_fallback = host_fallback.map(|c| {
            let limits = MappedLimits::new(&c, false, &p.params, &env);
            (c, limits)
        });
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
            gpus,
            gpu_config,
            last_empty_notifs: Mutex::new(None),
            prep_scratch: Mutex::default(),
            ipc,
            cma,
            mapped_limits,
            host_fallback,
            wants_progress: p.enable_prog_th,
            progress: None,
            told_other_kind: AtomicBool::new(false),
            told_other_gpu: AtomicBool::new(false),
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
        if self.config.arena_mem == ArenaMem::Vram && self.gpus.is_empty() {
            // Asked for a GPU arena and no GPU could be had (logged at creation): a host arena
            // would bounce transfers the user did not ask to bounce.
            self.progress_without_reactor(shim);
            return;
        }
        let started = match (self.start_bounce(shim), self.host_fallback.take()) {
            // The GPU arena's own failure (its VRAM, registration or copy engine); another one
            // (a control socket) would fail a host arena alike.
            (Err(why @ Error::Arena { .. }), Some((config, limits))) => {
                // `auto`: a host arena, as on a host whose process uses no GPU.
                tracing::warn!(agent = self.agent, "bounce_arena_mem=auto: no GPU arena ({why}); a host-memory arena");
                (self.config, self.mapped_limits) = (config, limits);
                self.gpus.clear();
                self.start_bounce(shim)
            }
            (started, _) => started,
        };
        match started {
            Ok(b) => self.bounce = Some(b),
            Err(why) => {
                tracing::warn!(agent = self.agent, "bounce path unavailable, staying on plain UCX: {why}");
                self.progress_without_reactor(shim);
            }
        }
    }

    /// The bounce path is on but did not start: when the agent asked for NIXL's progress
    /// thread, which the reactor was to give (the inner engine was made without UCX's own),
    /// a thread of ours gives it instead ([`ProgressThread`]).
    fn progress_without_reactor(&mut self, shim: Shim) {
        if !self.wants_progress {
            return;
        }
        match ProgressThread::start(shim, Arc::clone(&self.mail), self.config.idle_park) {
            Ok(t) => self.progress = Some(t),
            Err(e) => {
                tracing::warn!(agent = self.agent, error = %e, "no background progress thread: progress only in NIXL calls")
            }
        }
    }

    fn shared(&self) -> Option<&Arc<Shared>> {
        self.bounce.as_ref().map(|b| b.reactor.shared())
    }

    /// Our capabilities, or `None` while this engine cannot bounce (bounce disabled, or no
    /// arena), in which case peers keep every transfer on plain UCX.
    pub(crate) fn capabilities(&self) -> Option<Capabilities> {
        self.bounce.as_ref().map(|b| b.caps.clone())
    }

    /// Posts a bounce request.
    ///
    /// # Errors
    /// [`Error::NoBounce`], or what [`Requests::post`](crate::shell::requests::Requests::post)
    /// refuses.
    pub(crate) fn post(&self, handle: u64, notif: Option<Vec<u8>>) -> Result<()> {
        // The notification goes out, when the transfer is done, as it must travel.
        let notif = notif.map(|msg| self.escape_notif(&msg).unwrap_or(msg));
        // A same-host request copies only while the peer registrations it was prepared from
        // are loaded (the bounce path's requests are bound to the peer's incarnation alike).
        let loaded = |stamp: &LoadStamp| self.keys.still_loaded(stamp);
        if let Some(ipc) = self.ipc.as_ref().filter(|_| handle & IPC_HANDLE_BIT != 0) {
            return ipc.post(handle, notif, loaded);
        }
        if let Some(cma) = self.cma.as_ref().filter(|_| handle & CMA_HANDLE_BIT != 0) {
            return cma.post(handle, notif, loaded);
        }
        let sh = self.shared().ok_or(Error::NoBounce)?;
        // Queued before the request is seen posted: a release on another thread cancels it
        // after it is submitted, never before. Submitted in a pass on this thread (the WANT
        // leaves before post returns), or by the reactor thread when no pass can run here.
        sh.requests.post_then(handle, notif, |p| sh.inbox.push_quiet(Cmd::Submit(p)))?;
        if self.drive().is_none() {
            sh.inbox.kick();
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
                sh.cancel(xfer);
                Ok(())
            }
            Some(Released::Idle) => Ok(()),
        }
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

impl Engine {
    /// Closes the bounce path while the inner engine still exists (`bnc_engine_stop`): the
    /// reactor says GOODBYE, waits for the grants it gave out, unloads the peer arenas and is
    /// joined (with its copy engine); then the arena is deregistered, and its memory handed
    /// back only when no peer still held a grant in it (otherwise it stays mapped, leaked, so
    /// a late write cannot land in memory used for something else). Idempotent; afterwards the
    /// engine is plain UCX.
    pub(crate) fn stop(&mut self) {
        // Its pull in progress ends before the inner engine goes.
        if let Some(mut progress) = self.progress.take() {
            progress.stop();
        }
        // Out of the engine before anything that could unwind: a panic below (caught at the
        // FFI edge) must not leave the bounce path for the final destroy, which runs after the
        // inner engine is gone (review 56); dropped here while unwinding, it stops with the
        // inner engine still alive.
        let bounce = self.bounce.take();
        // Its running copies end first; its notifications need the inner engine.
        drop(self.ipc.take());
        drop(self.cma.take());
        let (Some(b), Some(shim)) = (bounce, self.shim) else { return };
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
