//! One BOUNCE engine: its configuration, the inner UCX plugin it delegates to, what it knows of
//! its peers, and the memory registered through it.
//!
//! Created by `ffi::abi::bnc_engine_create` when NIXL creates a "BOUNCE" backend; destroyed when
//! NIXL destroys it. All methods take `&self`: NIXL calls an engine from many threads.

use std::collections::HashMap;
use std::collections::hash_map::RandomState;
use std::ffi::c_void;
use std::hash::{BuildHasher, Hasher};
use std::path::Path;
use std::sync::atomic::{AtomicPtr, AtomicU64, Ordering};

use bounce_proto::config::Config;
use bounce_proto::wire::{Capabilities, ConnEnvelope};
use bounce_proto::MemKind;
use parking_lot::Mutex;

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

/// What we learned about a peer from its connection info.
#[derive(Debug, Clone)]
pub struct PeerInfo {
    /// Its capabilities, when it advertised compatible ones.
    pub caps: Option<Capabilities>,
}

/// One BOUNCE engine.
pub struct Engine {
    agent: String,
    config: Config,
    plugin: InnerPlugin,
    session: u64,
    shim: AtomicPtr<c_void>,
    peers: Mutex<HashMap<String, PeerInfo>>,
    registrations: Mutex<HashMap<usize, Registration>>,
    fallbacks: AtomicU64,
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
            plugin,
            session,
            shim: AtomicPtr::new(std::ptr::null_mut()),
            peers: Mutex::new(HashMap::new()),
            registrations: Mutex::new(HashMap::new()),
            fallbacks: AtomicU64::new(0),
        };
        Ok((engine, inner))
    }

    /// The inner plugin's descriptor for the shim.
    pub fn inner_plugin(&self) -> *const c_void {
        self.plugin.descriptor()
    }

    /// Records the shim engine this engine may call back into.
    pub fn attach(&self, shim: *mut c_void) {
        self.shim.store(shim, Ordering::Release);
    }

    /// The configuration in force.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The local agent name.
    pub fn agent(&self) -> &str {
        &self.agent
    }

    /// Our capabilities, or `None` while this engine cannot bounce (bounce disabled, or no
    /// arena yet), in which case peers keep every transfer on plain UCX.
    pub fn capabilities(&self) -> Option<Capabilities> {
        None
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
                    self.fallbacks.fetch_add(1, Ordering::Relaxed);
                    None
                }
            },
            _ => None,
        };
        self.peers.lock().insert(agent.to_owned(), PeerInfo { caps });
        Ok(env.inner)
    }

    /// True when transfers to `agent` may take the bounce path.
    pub fn peer_can_bounce(&self, agent: &str) -> bool {
        self.peers.lock().get(agent).is_some_and(|p| p.caps.is_some())
    }

    /// Records a registration made through this engine, keyed by the inner metadata handle.
    pub fn mem_registered(&self, md: usize, reg: Registration) {
        self.registrations.lock().insert(md, reg);
    }

    /// Forgets a registration.
    pub fn mem_deregistered(&self, md: usize) {
        self.registrations.lock().remove(&md);
    }

    /// Number of live registrations.
    pub fn registration_count(&self) -> usize {
        self.registrations.lock().len()
    }

    /// The random instance nonce carried in our control frames.
    pub fn session(&self) -> u64 {
        self.session
    }

    /// Counters as `(name, value)`, published to NIXL as `stats.<name>`.
    pub fn stats(&self) -> Vec<(&'static str, u64)> {
        vec![
            ("registrations", self.registration_count() as u64),
            ("peers_incompatible", self.fallbacks.load(Ordering::Relaxed)),
        ]
    }
}
