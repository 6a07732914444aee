//! Typed configuration of the BOUNCE backend.
//!
//! Owns the translation of NIXL backend params (a string map) plus `NIXL_BOUNCE_*` environment
//! overrides into a [`Config`], and the rules that make a configuration usable. It does not read
//! the environment itself: the shell passes a lookup closure, so tests stay hermetic.
//!
//! The option set, defaults, env var names and docs come only from [`crate::manifest::OPTIONS`]
//! (generated from `plugin-manifest/manifest.toml`). Defaults are parsed from the manifest text
//! with the same parser as user input, so no default is ever restated in Rust.

use std::{fmt, time::Duration};

mod ucx_tls;

use crate::{
    manifest::{self, OptionSpec},
    types::{ControlKind, DEFAULT_ALIGN, MemKind},
};

/// Fewest microseconds of `bounce_idle_park_us`: a busy reactor's sleep between polls, which an
/// idle one must not undercut.
pub const MIN_IDLE_PARK_US: u64 = 50;

/// Most threads `bounce_copy_workers` and `bounce_cma_workers` may ask for: each is an OS
/// thread the engine starts at creation (100000 took 45 s of spawning before it failed), and
/// copies are bound by memory bandwidth long before this many cores.
pub const MAX_WORKERS: u32 = 256;

/// Configuration of one BOUNCE engine, shared by its sender and receiver roles.
///
/// Build it with [`Config::from_params`] (or [`Config::default`] for the manifest defaults);
/// both guarantee [`Config::validate`] holds. A hand-built value should be checked with
/// [`Config::validate`] before use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// Master switch of the bounce fast path (`bounce_enable`).
    pub enabled: bool,
    /// Memory of the staging arena as configured (`bounce_arena_mem`); `Auto` is resolved by
    /// the shell, which alone can see whether the process uses a GPU.
    pub arena_mem: ArenaMem,
    /// Which GPUs get a GPU arena (`bounce_arena_gpus`); the shell resolves it against the
    /// driver.
    pub arena_gpus: ArenaGpus,
    /// How a GPU arena copies (`bounce_gpu_copy`).
    pub gpu_copy: GpuCopy,
    /// The memory kind whose defaults filled the options left unset (see
    /// [`Config::from_params_as`]).
    pub defaults_for: MemKind,
    /// Size in bytes of the staging arena (`bounce_arena_size`).
    pub arena_size: u64,
    /// Smallest region of the arena's buddy allocator, a power of two (`bounce_arena_granularity`).
    pub arena_granularity: u64,
    /// Largest chunk of one RDMA write, a power of two no larger than
    /// [`Config::largest_region`] (`bounce_max_chunk_size`).
    pub max_chunk_size: u64,
    /// Per-flow pipeline depth W (`bounce_max_inflight_chunks`).
    pub max_inflight_chunks: u32,
    /// Number of gather/scatter copy workers (`bounce_copy_workers`).
    pub copy_workers: u32,
    /// Routing gate: minimum descriptor count of a bounced transfer (`bounce_min_descriptor_count`).
    pub min_descriptor_count: u64,
    /// Routing gate: maximum average descriptor size in bytes
    /// (`bounce_max_average_descriptor_size`).
    pub max_average_descriptor_size: u64,
    /// No-progress timeout of a bounced transfer (`bounce_request_timeout_ms`).
    pub request_timeout: Duration,
    /// Quiet time of a waited-on peer before it is PINGed (`bounce_probe_after_ms`).
    pub probe_after: Duration,
    /// No sign of life this long after the first unanswered PING: the peer is dead; zero turns
    /// probing off (`bounce_peer_dead_after_ms`).
    pub peer_dead_after: Duration,
    /// Gather before the receiver's grant arrives (`bounce_eager_gather`).
    pub eager_gather: bool,
    /// Control channel kind; must match the peer's (`bounce_control`).
    pub control: ControlKind,
    /// Fewest scatter runs a chunk must have for its runs to go ahead of its DATA in a PLAN;
    /// 0: never (`bounce_plan_ahead_runs`).
    pub plan_ahead_runs: u32,
    /// Fewest scatter runs a chunk must have for its runs to travel in its region, behind its
    /// data; 0: never (`bounce_region_plan_runs`).
    pub region_plan_runs: u32,
    /// Largest single-chunk WRITE whose bytes ride in its WANT (sent, and taken from peers);
    /// 0: never (`bounce_inline_bytes`).
    pub inline_bytes: u64,
    /// Bytes of the standing credit asked of each peer written to, and most given to one
    /// (clamped to the chunk size); 0: never (`bounce_standing_bytes`).
    pub standing_bytes: u64,
    /// A transfer of at least twice this many bytes that would take fewer than four chunks
    /// takes up to four about equal ones, none smaller than this; 0: never
    /// (`bounce_split_bytes`, [`crate::plan::PlanParams::split_for`]).
    pub split_bytes: u64,
    /// Coalesce copy runs in transfer plans (`bounce_scatter_run_merging`).
    pub scatter_run_merging: bool,
    /// Write chunks whose source is contiguous straight from user memory (`bounce_direct_writes`).
    pub direct_writes: bool,
    /// Copy same-host GPU transfers through CUDA IPC mappings of the peer's registrations
    /// instead of bouncing them (`bounce_cuda_ipc`).
    pub cuda_ipc: bool,
    /// Copy same-host host-memory transfers with cross-memory attach instead of bouncing them
    /// (`bounce_cma`).
    pub cma: bool,
    /// Threads of the same-host path for host memory (`bounce_cma_workers`); 0: the shell
    /// picks from the CPUs it may run on.
    pub cma_workers: u32,
    /// Same-host host-memory transfers of at least this many bytes take CMA whatever their
    /// descriptors (`bounce_cma_large_bytes`); 0: only what the gate's thresholds admit.
    pub cma_large_bytes: u64,
    /// Scatter with non-temporal stores (`bounce_streaming_scatter`).
    pub streaming_scatter: bool,
    /// Escape application notifications that begin with the frame magic
    /// (`bounce_escape_notifs`; see `wire::escape_app_notif`).
    pub escape_notifs: bool,
    /// Longest wait of a busy-polled status check (`bounce_check_wait_us`).
    pub check_wait: Duration,
    /// Longest sleep of an idle reactor between polls (`bounce_idle_park_us`).
    pub idle_park: Duration,
    /// Address to bind the ZMQ control socket on; empty means automatic (`bounce_zmq_host`).
    pub zmq_host: String,
    /// Path of NIXL's UCX plugin; `None` means the default next to this plugin
    /// (`bounce_ucx_plugin`).
    pub ucx_plugin: Option<String>,
}

/// Which memory the staging arena is made of (`bounce_arena_mem`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ArenaMem {
    /// GPU memory when the process has a current CUDA context at backend creation, else host.
    Auto,
    /// Host memory: host-memory transfers bounce.
    Dram,
    /// GPU memory: GPU-memory transfers bounce (CUDA copy engine).
    Vram,
    /// Two arenas: host memory (arena 0, under the host defaults) and GPU memory as for
    /// `Vram` (under the GPU defaults); each kind bounces through its own.
    Both,
}

/// Which GPUs get a GPU arena (`bounce_arena_gpus`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ArenaGpus {
    /// One, on the GPU `bounce_arena_mem` describes (the current context's, else GPU 0).
    Current,
    /// Every GPU the driver shows the process.
    All,
    /// These device ordinals, in this order: distinct, at least one, at most [`MAX_ARENA_GPUS`].
    Listed(Vec<u16>),
}

/// Most GPUs `bounce_arena_gpus` may list: with a host arena beside them (`both`) the engine
/// then has the wire's [`crate::types::MAX_ARENAS`] arenas.
pub const MAX_ARENA_GPUS: usize = crate::types::MAX_ARENAS - 1;

impl ArenaGpus {
    /// Whether the application named GPUs (a list or `all`): that asks for GPU memory even
    /// under `auto` without a current CUDA context.
    pub fn named(&self) -> bool {
        !matches!(self, Self::Current)
    }

    /// Parses `current`, `all` or a comma-separated list of ordinals (blanks allowed around
    /// each); `None` for anything else, an empty list, a repeated ordinal, or more than
    /// [`MAX_ARENA_GPUS`].
    pub fn parse(text: &str) -> Option<Self> {
        let t = text.trim();
        if t.eq_ignore_ascii_case("current") {
            return Some(Self::Current);
        }
        if t.eq_ignore_ascii_case("all") {
            return Some(Self::All);
        }
        let mut listed: Vec<u16> = Vec::new();
        for part in t.split(',') {
            let part = part.trim();
            // Digits only: no sign, no blank entry, and no overflow past u16.
            if part.is_empty() || !part.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            let ordinal: u16 = part.parse().ok()?;
            if listed.contains(&ordinal) || listed.len() == MAX_ARENA_GPUS {
                return None;
            }
            listed.push(ordinal);
        }
        Some(Self::Listed(listed))
    }
}

/// How a GPU arena gathers and scatters (`bounce_gpu_copy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuCopy {
    /// BOUNCE's CUDA kernels.
    Kernel,
    /// The driver's batched memcpy.
    Batched,
}

/// A [`Config`] together with the non-fatal problems found while building it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Loaded {
    /// The resulting, validated configuration.
    pub config: Config,
    /// Problems that were worked around (bad values, unknown params, clamping); the shell
    /// should log each one.
    pub warnings: Vec<ConfigWarning>,
}

/// Where an option's value came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ValueSource {
    /// A NIXL backend parameter.
    Param,
    /// The option's `NIXL_BOUNCE_*` environment variable (named here).
    Env(&'static str),
}

impl fmt::Display for ValueSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Param => f.write_str("backend param"),
            Self::Env(name) => write!(f, "env {name}"),
        }
    }
}

/// A non-fatal configuration problem; the configuration was built anyway.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ConfigWarning {
    /// A `bounce_*` param that the manifest does not declare (most likely a typo); ignored.
    UnknownParam {
        /// The param name as given.
        name: String,
    },
    /// `bounce_arena_gpus` names GPUs but `bounce_arena_mem` is `dram`: no GPU arena is made.
    GpusWithoutGpuArena,
    /// `UCX_TLS` leaves out UCX's `cuda_ipc`, so the CUDA IPC same-host path is off unless
    /// `bounce_cuda_ipc` asks for it (`explicit`: it did, and it is on).
    CudaIpcBesideUcxTls {
        /// `UCX_TLS` as set.
        ucx_tls: String,
        /// `bounce_cuda_ipc=true` was set explicitly: the path stays on.
        explicit: bool,
    },
    /// `bounce_max_chunk_size` was lowered to fit the arena and/or to a power of two.
    ChunkSizeAdjusted {
        /// The configured value.
        requested: u64,
        /// The value in effect.
        used: u64,
        /// The arena's largest allocatable block at the time.
        largest_region: u64,
    },
}

impl fmt::Display for ConfigWarning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::UnknownParam { name } => write!(f, "unknown backend param {name:?} ignored"),
            Self::GpusWithoutGpuArena => {
                f.write_str("bounce_arena_gpus ignored: bounce_arena_mem=dram makes no GPU arena")
            }
            Self::CudaIpcBesideUcxTls { ucx_tls, explicit: false } => write!(
                f,
                "bounce_cuda_ipc off: UCX_TLS={ucx_tls:?} leaves out cuda_ipc, so no CUDA IPC handle \
                 is published (GPU transfers between processes of one host bounce); set \
                 bounce_cuda_ipc=true to publish them anyway"
            ),
            Self::CudaIpcBesideUcxTls { ucx_tls, explicit: true } => write!(
                f,
                "bounce_cuda_ipc=true publishes CUDA IPC handles (each maps a registration's whole \
                 allocation) although UCX_TLS={ucx_tls:?} keeps UCX from publishing its own"
            ),
            Self::ChunkSizeAdjusted { requested, used, largest_region } => write!(
                f,
                "bounce_max_chunk_size {requested} lowered to {used} (power of two, at most the \
                 arena's largest region {largest_region})"
            ),
        }
    }
}

/// A configuration that cannot work (an error, never silently replaced by a default).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A value could not be parsed. Fatal, whatever the option: a default in its place would
    /// do what the user did not ask for (`bounce_enable=disable` bounced, a `bounce_control`
    /// typo spoke UCX to a ZMQ peer), with only a log line to say so (review 55).
    #[error(
        "{option}: cannot parse {value:?} from {from} (the default is {default:?}; README \"Configuration\" lists the values each option takes)"
    )]
    Unparsable {
        /// The option's param name.
        option: &'static str,
        /// Where the bad value came from.
        from: ValueSource,
        /// The rejected text.
        value: String,
        /// The option's default (for the arena's memory kind).
        default: &'static str,
    },
    /// The arena granularity is zero or not a power of two.
    #[error("bounce_arena_granularity {granularity} is not a power of two")]
    GranularityNotPowerOfTwo {
        /// The configured granularity.
        granularity: u64,
    },
    /// The arena cannot hold even one region of the minimum size.
    #[error("bounce_arena_size {arena_size} is smaller than bounce_arena_granularity {granularity}")]
    ArenaSmallerThanGranularity {
        /// The configured arena size.
        arena_size: u64,
        /// The configured granularity.
        granularity: u64,
    },
    /// The chunk size cannot hold one aligned descriptor slot of the transfer plan.
    #[error("bounce_max_chunk_size {max_chunk_size} is below the minimum {min}")]
    ChunkTooSmall {
        /// The chunk size in effect.
        max_chunk_size: u64,
        /// The smallest usable chunk size ([`DEFAULT_ALIGN`]).
        min: u64,
    },
    /// The chunk size is not a power of two (only possible for a hand-built [`Config`]).
    #[error("bounce_max_chunk_size {max_chunk_size} is not a power of two")]
    ChunkNotPowerOfTwo {
        /// The chunk size in effect.
        max_chunk_size: u64,
    },
    /// A chunk would not fit in the arena even when it is empty (only possible for a hand-built
    /// [`Config`]; [`Config::from_params`] clamps instead).
    #[error("bounce_max_chunk_size {max_chunk_size} exceeds the arena's largest region {largest_region}")]
    ChunkExceedsArena {
        /// The chunk size in effect.
        max_chunk_size: u64,
        /// [`Config::largest_region`].
        largest_region: u64,
    },
    /// The per-flow window W is zero, so no transfer could ever make progress.
    #[error("bounce_max_inflight_chunks must be at least 1")]
    ZeroInflightChunks,
    /// No copy worker would ever run a gather or scatter.
    #[error("bounce_copy_workers must be at least 1")]
    ZeroCopyWorkers,
    /// More threads than any host's memory can keep busy (see [`MAX_WORKERS`]).
    #[error("{option} must be at most {MAX_WORKERS}, got {got}")]
    TooManyWorkers {
        /// The option's param name.
        option: &'static str,
        /// The value given.
        got: u32,
    },
    /// `bounce_zmq_host` is not empty and not one specific IP address: the control socket
    /// would listen on every interface (a wildcard) and advertise an address no peer can use,
    /// or could not bind at all (a name, multicast).
    #[error("bounce_zmq_host {got:?} is not a specific IP address (empty: 127.0.0.1)")]
    ZmqHostNotAnAddress {
        /// The value given.
        got: String,
    },
    /// Every transfer would time out at once.
    #[error("bounce_request_timeout_ms must be at least 1")]
    ZeroRequestTimeout,
    /// An idle reactor would wake more often than a busy one.
    #[error(
        "bounce_idle_park_us must be at least {MIN_IDLE_PARK_US} (the sleep between polls of a reactor with work in flight), got {got}"
    )]
    IdleParkTooShort {
        /// The value given, in microseconds.
        got: u64,
    },
    /// More inline bytes than a WANT may carry.
    #[error("bounce_inline_bytes {got} exceeds the wire's limit of {} bytes", crate::wire::MAX_INLINE_BYTES)]
    InlineTooLarge {
        /// The value given.
        got: u64,
    },
    /// The manifest's default for an option does not parse as its own kind (a manifest bug).
    #[error("manifest default {value:?} of {option} does not parse as its kind {kind}")]
    BadManifestDefault {
        /// The option's param name.
        option: &'static str,
        /// The option's declared kind.
        kind: &'static str,
        /// The unparsable default.
        value: &'static str,
    },
    /// The manifest lacks an option [`Config`] needs, or declares it with a kind that does not fit
    /// the field (a manifest bug).
    #[error("manifest option {option} is missing or has an unexpected kind")]
    ManifestMismatch {
        /// The option's param name.
        option: &'static str,
    },
}

/// Result of configuration building and validation.
pub type Result<T> = std::result::Result<T, ConfigError>;

/// Prefix of every option this backend owns; other params belong to the wrapped UCX backend.
const PARAM_PREFIX: &str = "bounce_";

/// A parsed option value, before it is assigned to its typed field.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Value {
    Bool(bool),
    U64(u64),
    U32(u32),
    /// The canonical (manifest-spelled) variant of an `enum:` option.
    Enum(&'static str),
    Path(String),
    Gpus(ArenaGpus),
}

impl Config {
    /// Builds a configuration from NIXL backend params and environment overrides.
    ///
    /// For each manifest option the environment variable (looked up through `env`) wins over
    /// the param, which wins over the manifest default. An empty environment variable counts
    /// as unset. Params not starting with `bounce_` are ignored (the shell passes them on to
    /// UCX); unknown `bounce_*` params become [`ConfigWarning`]s, and a value that does not
    /// parse is [`ConfigError::Unparsable`] (it fails backend creation). `bounce_max_chunk_size` is
    /// then lowered to a power of two that fits the arena (see [`Config::largest_region`]).
    ///
    /// # Errors
    ///
    /// Any [`ConfigError`] from [`Config::validate`], or a manifest inconsistency.
    pub fn from_params<'a>(
        params: impl IntoIterator<Item = (&'a str, &'a str)>,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Loaded> {
        Self::from_params_as(None, params, env)
    }

    /// Like [`Config::from_params`], with the defaults of the options left unset taken for an
    /// arena of memory `arena` (the manifest's `default_vram` column for GPU memory). `None`
    /// takes them for what `bounce_arena_mem` says, host memory for `auto`: the shell resolves
    /// `auto` and, when it resolves to GPU memory, builds the configuration again with
    /// `Some(MemKind::Vram)`.
    ///
    /// # Errors
    ///
    /// As [`Config::from_params`].
    pub fn from_params_as<'a>(
        arena: Option<MemKind>,
        params: impl IntoIterator<Item = (&'a str, &'a str)>,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Loaded> {
        let mut warnings = Vec::new();
        let mut given: Vec<Option<&'a str>> = vec![None; manifest::OPTIONS.len()];
        for (name, value) in params {
            if !name.starts_with(PARAM_PREFIX) {
                continue;
            }
            match manifest::OPTIONS.iter().position(|o| o.name == name) {
                // Later duplicates win, as in a map insert.
                Some(i) => given[i] = Some(value),
                None => warnings.push(ConfigWarning::UnknownParam { name: name.to_owned() }),
            }
        }

        let chosen: Vec<_> = manifest::OPTIONS
            .iter()
            .zip(given)
            .map(|(spec, param)| match (env(spec.env).filter(|v| !v.is_empty()), param) {
                (Some(v), _) => Some((ValueSource::Env(spec.env), v)),
                (None, Some(v)) => Some((ValueSource::Param, v.to_owned())),
                (None, None) => None,
            })
            .collect();
        // The text an option was given (param or environment), if any.
        let given = |name: &str| {
            let i = manifest::OPTIONS.iter().position(|o| o.name == name);
            i.and_then(|i| chosen[i].as_ref()).map(|(_, v)| v.as_str())
        };
        // Which defaults apply depends on one option's value, so that one is read first.
        let defaults_for =
            arena.unwrap_or_else(|| match given("bounce_arena_mem").map(|v| v.trim().to_ascii_lowercase()) {
                Some(v) if v == "vram" => MemKind::Vram,
                _ => MemKind::Dram,
            });
        let mut values = Vec::with_capacity(manifest::OPTIONS.len());
        for (spec, chosen) in manifest::OPTIONS.iter().zip(&chosen) {
            let value = match chosen {
                Some((source, text)) => parse_value(spec.kind, text).ok_or_else(|| ConfigError::Unparsable {
                    option: spec.name,
                    from: *source,
                    value: text.clone(),
                    default: spec.default_for(defaults_for),
                })?,
                None => default_value(spec, defaults_for)?,
            };
            values.push((spec.name, value));
        }

        let mut config = Self::assemble(&values, defaults_for)?;
        // A CUDA IPC handle in our metadata lets any process of this host that holds it map the
        // whole allocation behind a registration. UCX's cuda_ipc publishes the same handles, so
        // BOUNCE grants a peer nothing more while UCX may use it; where UCX_TLS forbids it, the
        // path is off unless asked for by name.
        let ucx_tls = env("UCX_TLS");
        if config.cuda_ipc && !ucx_tls::allows(ucx_tls.as_deref(), "cuda_ipc") {
            // Set to a value that parsed (as true: the path is on), by param or environment.
            let explicit = given("bounce_cuda_ipc")
                .zip(manifest::option("bounce_cuda_ipc"))
                .is_some_and(|(text, o)| parse_value(o.kind, text).is_some());
            config.cuda_ipc = explicit;
            warnings.push(ConfigWarning::CudaIpcBesideUcxTls { ucx_tls: ucx_tls.unwrap_or_default(), explicit });
        }
        config.check_arena()?;
        let requested = config.max_chunk_size;
        let largest_region = config.largest_region();
        config.max_chunk_size = prev_power_of_two(requested.min(largest_region));
        if config.max_chunk_size != requested {
            warnings.push(ConfigWarning::ChunkSizeAdjusted { requested, used: config.max_chunk_size, largest_region });
        }
        config.validate()?;
        if config.arena_mem == ArenaMem::Dram && config.arena_gpus.named() {
            warnings.push(ConfigWarning::GpusWithoutGpuArena);
        }
        Ok(Loaded { config, warnings })
    }

    /// Maps parsed option values onto the typed fields, by manifest name.
    fn assemble(values: &[(&'static str, Value)], defaults_for: MemKind) -> Result<Self> {
        let get = |option: &'static str| {
            values.iter().find(|(n, _)| *n == option).map(|(_, v)| v).ok_or(ConfigError::ManifestMismatch { option })
        };
        let mismatch = |option| ConfigError::ManifestMismatch { option };
        let boolean = |option| match get(option)? {
            Value::Bool(b) => Ok(*b),
            _ => Err(mismatch(option)),
        };
        let u64_of = |option| match get(option)? {
            Value::U64(n) => Ok(*n),
            _ => Err(mismatch(option)),
        };
        let u32_of = |option| match get(option)? {
            Value::U32(n) => Ok(*n),
            _ => Err(mismatch(option)),
        };
        let control = match get("bounce_control")? {
            Value::Enum("ucx") => ControlKind::Ucx,
            Value::Enum("zmq") => ControlKind::Zmq,
            _ => return Err(mismatch("bounce_control")),
        };
        let arena_mem = match get("bounce_arena_mem")? {
            Value::Enum("auto") => ArenaMem::Auto,
            Value::Enum("dram") => ArenaMem::Dram,
            Value::Enum("vram") => ArenaMem::Vram,
            Value::Enum("both") => ArenaMem::Both,
            _ => return Err(mismatch("bounce_arena_mem")),
        };
        let arena_gpus = match get("bounce_arena_gpus")? {
            Value::Gpus(g) => g.clone(),
            _ => return Err(mismatch("bounce_arena_gpus")),
        };
        let gpu_copy = match get("bounce_gpu_copy")? {
            Value::Enum("kernel") => GpuCopy::Kernel,
            Value::Enum("batched") => GpuCopy::Batched,
            _ => return Err(mismatch("bounce_gpu_copy")),
        };
        let zmq_host = match get("bounce_zmq_host")? {
            Value::Path(p) => p.trim().to_owned(),
            _ => return Err(mismatch("bounce_zmq_host")),
        };
        let ucx_plugin = match get("bounce_ucx_plugin")? {
            Value::Path(p) if p.is_empty() => None,
            Value::Path(p) => Some(p.clone()),
            _ => return Err(mismatch("bounce_ucx_plugin")),
        };
        Ok(Self {
            enabled: boolean("bounce_enable")?,
            arena_mem,
            arena_gpus,
            gpu_copy,
            defaults_for,
            arena_size: u64_of("bounce_arena_size")?,
            arena_granularity: u64_of("bounce_arena_granularity")?,
            max_chunk_size: u64_of("bounce_max_chunk_size")?,
            max_inflight_chunks: u32_of("bounce_max_inflight_chunks")?,
            copy_workers: u32_of("bounce_copy_workers")?,
            min_descriptor_count: u64_of("bounce_min_descriptor_count")?,
            max_average_descriptor_size: u64_of("bounce_max_average_descriptor_size")?,
            request_timeout: Duration::from_millis(u64_of("bounce_request_timeout_ms")?),
            probe_after: Duration::from_millis(u64_of("bounce_probe_after_ms")?),
            peer_dead_after: Duration::from_millis(u64_of("bounce_peer_dead_after_ms")?),
            eager_gather: boolean("bounce_eager_gather")?,
            control,
            plan_ahead_runs: u32_of("bounce_plan_ahead_runs")?,
            region_plan_runs: u32_of("bounce_region_plan_runs")?,
            inline_bytes: u64_of("bounce_inline_bytes")?,
            standing_bytes: u64_of("bounce_standing_bytes")?,
            split_bytes: u64_of("bounce_split_bytes")?,
            scatter_run_merging: boolean("bounce_scatter_run_merging")?,
            direct_writes: boolean("bounce_direct_writes")?,
            cuda_ipc: boolean("bounce_cuda_ipc")?,
            cma: boolean("bounce_cma")?,
            cma_workers: u32_of("bounce_cma_workers")?,
            cma_large_bytes: u64_of("bounce_cma_large_bytes")?,
            streaming_scatter: boolean("bounce_streaming_scatter")?,
            escape_notifs: boolean("bounce_escape_notifs")?,
            check_wait: Duration::from_micros(u64_of("bounce_check_wait_us")?),
            idle_park: Duration::from_micros(u64_of("bounce_idle_park_us")?),
            zmq_host,
            ucx_plugin,
        })
    }

    /// Bytes of the arena the buddy allocator can hand out: `arena_size` rounded down to a
    /// multiple of `arena_granularity` (0 when the granularity is 0).
    pub fn arena_usable_capacity(&self) -> u64 {
        match self.arena_size.checked_rem(self.arena_granularity) {
            Some(rem) => self.arena_size - rem,
            None => 0,
        }
    }

    /// The arena's largest single allocatable block: the highest power of two of
    /// [`Config::arena_usable_capacity`] (a buddy allocator splits a non-power-of-two arena
    /// into power-of-two top blocks, and a region never spans two of them). 0 for an empty arena.
    pub fn largest_region(&self) -> u64 {
        prev_power_of_two(self.arena_usable_capacity())
    }

    /// Checks that the configuration can work.
    ///
    /// A `max_chunk_size` below the arena granularity is accepted: each chunk then wastes the
    /// rest of its granule, which is inefficient but correct. It must however hold one aligned
    /// plan slot ([`DEFAULT_ALIGN`] bytes), be a power of two (the buddy allocator would
    /// round it up anyway) and fit in [`Config::largest_region`], so that a drained arena can
    /// always grant any chunk.
    ///
    /// # Errors
    ///
    /// The first violated rule, as a [`ConfigError`].
    pub fn validate(&self) -> Result<()> {
        self.check_arena()?;
        if self.max_chunk_size < DEFAULT_ALIGN {
            return Err(ConfigError::ChunkTooSmall { max_chunk_size: self.max_chunk_size, min: DEFAULT_ALIGN });
        }
        if !self.max_chunk_size.is_power_of_two() {
            return Err(ConfigError::ChunkNotPowerOfTwo { max_chunk_size: self.max_chunk_size });
        }
        if self.max_chunk_size > self.largest_region() {
            return Err(ConfigError::ChunkExceedsArena {
                max_chunk_size: self.max_chunk_size,
                largest_region: self.largest_region(),
            });
        }
        if self.max_inflight_chunks == 0 {
            return Err(ConfigError::ZeroInflightChunks);
        }
        if self.copy_workers == 0 {
            return Err(ConfigError::ZeroCopyWorkers);
        }
        for (option, got) in [("bounce_copy_workers", self.copy_workers), ("bounce_cma_workers", self.cma_workers)] {
            if got > MAX_WORKERS {
                return Err(ConfigError::TooManyWorkers { option, got });
            }
        }
        // Checked here whatever the control channel, as every other value is: the same setting
        // under bounce_control=zmq would fail later, at the bind, with the bounce path off.
        if !self.zmq_host.is_empty()
            && !self.zmq_host.parse::<std::net::IpAddr>().is_ok_and(|ip| !ip.is_unspecified() && !ip.is_multicast())
        {
            return Err(ConfigError::ZmqHostNotAnAddress { got: self.zmq_host.clone() });
        }
        if self.request_timeout.is_zero() {
            return Err(ConfigError::ZeroRequestTimeout);
        }
        if self.idle_park < Duration::from_micros(MIN_IDLE_PARK_US) {
            return Err(ConfigError::IdleParkTooShort { got: self.idle_park.as_micros() as u64 });
        }
        if self.inline_bytes > u64::from(crate::wire::MAX_INLINE_BYTES) {
            return Err(ConfigError::InlineTooLarge { got: self.inline_bytes });
        }
        Ok(())
    }

    /// The arena rules, which must hold before the chunk size can be clamped.
    fn check_arena(&self) -> Result<()> {
        if !self.arena_granularity.is_power_of_two() {
            return Err(ConfigError::GranularityNotPowerOfTwo { granularity: self.arena_granularity });
        }
        if self.arena_size < self.arena_granularity {
            return Err(ConfigError::ArenaSmallerThanGranularity {
                arena_size: self.arena_size,
                granularity: self.arena_granularity,
            });
        }
        Ok(())
    }
}

impl Default for Config {
    /// The manifest defaults, with no params and no environment.
    ///
    /// # Panics
    ///
    /// If the manifest's defaults are inconsistent (a build-time bug the unit tests catch).
    fn default() -> Self {
        match Self::from_params([], |_| None) {
            Ok(loaded) => loaded.config,
            Err(e) => panic!("plugin manifest defaults are invalid: {e}"),
        }
    }
}

/// The manifest default of `spec`, parsed like user input.
fn default_value(spec: &'static OptionSpec, mem: MemKind) -> Result<Value> {
    let text = spec.default_for(mem);
    parse_value(spec.kind, text).ok_or(ConfigError::BadManifestDefault {
        option: spec.name,
        kind: spec.kind,
        value: text,
    })
}

/// Parses `text` as a value of manifest kind `kind`; `None` when it does not parse (or the kind
/// is unknown).
fn parse_value(kind: &'static str, text: &str) -> Option<Value> {
    match kind {
        "bool" => parse_bool(text).map(Value::Bool),
        "bytes" => parse_bytes(text).map(Value::U64),
        "u64" => text.trim().parse().ok().map(Value::U64),
        "u32" => text.trim().parse().ok().map(Value::U32),
        "path" => Some(Value::Path(text.to_owned())),
        "gpus" => ArenaGpus::parse(text).map(Value::Gpus),
        _ => {
            let variants = kind.strip_prefix("enum:")?;
            let text = text.trim();
            variants.split('|').find(|v| v.eq_ignore_ascii_case(text)).map(Value::Enum)
        }
    }
}

/// Parses a boolean: `true/false/1/0/yes/no/on/off`, case-insensitive, surrounding blanks
/// ignored.
pub fn parse_bool(text: &str) -> Option<bool> {
    const TRUE: [&str; 4] = ["true", "1", "yes", "on"];
    const FALSE: [&str; 4] = ["false", "0", "no", "off"];
    let t = text.trim();
    if TRUE.iter().any(|w| w.eq_ignore_ascii_case(t)) {
        Some(true)
    } else if FALSE.iter().any(|w| w.eq_ignore_ascii_case(t)) {
        Some(false)
    } else {
        None
    }
}

/// Parses a byte count: a decimal integer with an optional binary suffix `K/KB/KiB`,
/// `M/MB/MiB` or `G/GB/GiB` (case-insensitive, 1K = 1024, blanks allowed before the suffix).
/// `None` for anything else, including overflow, so bad input can never read as 0.
pub fn parse_bytes(text: &str) -> Option<u64> {
    let t = text.trim();
    let digits_end = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (digits, suffix) = t.split_at(digits_end);
    if digits.is_empty() {
        return None;
    }
    let number: u64 = digits.parse().ok()?;
    let shift = match suffix.trim_start().to_ascii_lowercase().as_str() {
        "" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        _ => return None,
    };
    number.checked_mul(1 << shift)
}

/// The largest power of two `<= n`, or 0 for 0.
fn prev_power_of_two(n: u64) -> u64 {
    match n {
        0 => 0,
        _ => 1 << (63 - n.leading_zeros()),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use proptest::prelude::*;

    use super::*;

    const KIB: u64 = 1 << 10;
    const MIB: u64 = 1 << 20;
    const GIB: u64 = 1 << 30;

    fn no_env(_: &str) -> Option<String> {
        None
    }

    fn load(params: &[(&str, &str)]) -> Result<Loaded> {
        Config::from_params(params.iter().copied(), no_env)
    }

    fn load_env(params: &[(&str, &str)], env: &[(&str, &str)]) -> Result<Loaded> {
        let env: HashMap<String, String> = env.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
        Config::from_params(params.iter().copied(), move |k| env.get(k).cloned())
    }

    fn spec(name: &str) -> &'static OptionSpec {
        manifest::option(name).unwrap()
    }

    #[test]
    fn every_manifest_option_parses_its_own_default() {
        for o in manifest::OPTIONS {
            assert!(parse_value(o.kind, o.default).is_some(), "{} default {:?}", o.name, o.default);
            if let Some(v) = o.default_vram {
                assert!(parse_value(o.kind, v).is_some(), "{} VRAM default {v:?}", o.name);
            }
        }
        // The VRAM defaults together form a valid configuration too.
        assert!(Config::from_params_as(Some(MemKind::Vram), [], no_env).is_ok());
    }

    #[test]
    fn every_manifest_option_is_read_into_the_config() {
        // Setting each option explicitly to its default changes nothing and warns about nothing:
        // every manifest option is known to from_params.
        let params: Vec<_> = manifest::OPTIONS.iter().map(|o| (o.name, o.default)).collect();
        let loaded = load(&params).unwrap();
        assert_eq!(loaded.warnings, vec![]);
        assert_eq!(loaded.config, Config::default());
    }

    /// A valid value of `spec`'s kind that differs from its default.
    fn non_default(spec: &OptionSpec) -> String {
        match spec.kind {
            "bool" => (!parse_bool(spec.default).unwrap()).to_string(),
            // Doubling keeps power-of-two sizes powers of two and the chunk within the arena.
            "bytes" | "u64" | "u32" => {
                let n = parse_bytes(spec.default).unwrap();
                (if spec.name == "bounce_max_chunk_size" { n / 2 } else { n.max(1) * 2 }).to_string()
            }
            "path" if spec.name == "bounce_zmq_host" => "10.0.0.7".into(),
            "path" => "/elsewhere/libplugin_UCX.so".into(),
            "gpus" => "1,0".into(),
            kind => {
                let variants = kind.strip_prefix("enum:").unwrap();
                variants.split('|').find(|v| *v != spec.default).unwrap().to_owned()
            }
        }
    }

    #[test]
    fn every_manifest_option_reaches_a_config_field() {
        for o in manifest::OPTIONS {
            let value = non_default(o);
            let loaded = load(&[(o.name, &value)]).unwrap();
            assert_eq!(loaded.warnings, vec![], "{}", o.name);
            assert_ne!(loaded.config, Config::default(), "{} = {value} changed nothing", o.name);
        }
    }

    #[test]
    fn default_config_matches_the_manifest_text() {
        let c = Config::default();
        c.validate().unwrap();
        let bytes = |n| parse_bytes(spec(n).default).unwrap();
        assert_eq!(c.enabled, parse_bool(spec("bounce_enable").default).unwrap());
        assert_eq!(c.arena_size, bytes("bounce_arena_size"));
        assert_eq!(c.arena_granularity, bytes("bounce_arena_granularity"));
        assert_eq!(c.max_chunk_size, bytes("bounce_max_chunk_size"));
        assert_eq!(c.max_average_descriptor_size, bytes("bounce_max_average_descriptor_size"));
        assert_eq!(c.max_inflight_chunks.to_string(), spec("bounce_max_inflight_chunks").default);
        assert_eq!(c.copy_workers.to_string(), spec("bounce_copy_workers").default);
        assert_eq!(c.cma_workers.to_string(), spec("bounce_cma_workers").default);
        assert_eq!(c.cma_large_bytes, bytes("bounce_cma_large_bytes"));
        assert_eq!(c.min_descriptor_count.to_string(), spec("bounce_min_descriptor_count").default);
        assert_eq!(c.request_timeout.as_millis().to_string(), spec("bounce_request_timeout_ms").default);
        assert_eq!(c.ucx_plugin.is_none(), spec("bounce_ucx_plugin").default.is_empty());
        assert!(Config::from_params([], no_env).unwrap().warnings.is_empty());
    }

    #[test]
    fn byte_suffixes_are_binary_and_case_insensitive() {
        let table: &[(&str, u64)] = &[
            ("0", 0),
            ("4096", 4096),
            ("1K", KIB),
            ("1k", KIB),
            ("2KB", 2 * KIB),
            ("2kb", 2 * KIB),
            ("3KiB", 3 * KIB),
            ("3kib", 3 * KIB),
            ("256MB", 256 * MIB),
            ("256mib", 256 * MIB),
            ("1M", MIB),
            ("1gb", GIB),
            ("1G", GIB),
            ("4GiB", 4 * GIB),
            ("512 KiB", 512 * KIB),
            ("  64\tK  ", 64 * KIB),
            ("17179869183G", 17_179_869_183 * GIB),
        ];
        for (text, want) in table {
            assert_eq!(parse_bytes(text), Some(*want), "{text:?}");
        }
        let bad = "|K|-1|+1|1.5G|1 T|1TB|1KK|1 K B|0x10|1e3|1B|ten|1_000|18446744073709551616";
        for text in bad.split('|').chain([" ", "17179869184G"]) {
            assert_eq!(parse_bytes(text), None, "{text:?}");
        }
    }

    #[test]
    fn bools_accept_the_usual_spellings() {
        for t in ["true", "TRUE", "1", "yes", "Yes", "on", " ON "] {
            assert_eq!(parse_bool(t), Some(true), "{t:?}");
        }
        for t in ["false", "False", "0", "no", "NO", "off", "Off"] {
            assert_eq!(parse_bool(t), Some(false), "{t:?}");
        }
        for t in ["", "2", "y", "enabled", "truee"] {
            assert_eq!(parse_bool(t), None, "{t:?}");
        }
    }

    #[test]
    fn params_set_typed_fields() {
        let c = load(&[
            ("bounce_enable", "off"),
            ("bounce_arena_size", "1GiB"),
            ("bounce_arena_gpus", "2,0"),
            ("bounce_arena_granularity", "1MiB"),
            ("bounce_max_chunk_size", "32M"),
            ("bounce_max_inflight_chunks", "4"),
            ("bounce_copy_workers", "6"),
            ("bounce_min_descriptor_count", "1024"),
            ("bounce_max_average_descriptor_size", "16K"),
            ("bounce_request_timeout_ms", "1500"),
            ("bounce_probe_after_ms", "100"),
            ("bounce_peer_dead_after_ms", "0"),
            ("bounce_eager_gather", "no"),
            ("bounce_control", "ZMQ"),
            ("bounce_plan_ahead_runs", "0"),
            ("bounce_region_plan_runs", "7"),
            ("bounce_inline_bytes", "1K"),
            ("bounce_standing_bytes", "256K"),
            ("bounce_split_bytes", "1M"),
            ("bounce_scatter_run_merging", "0"),
            ("bounce_direct_writes", "false"),
            ("bounce_cuda_ipc", "no"),
            ("bounce_cma", "off"),
            ("bounce_cma_workers", "3"),
            ("bounce_cma_large_bytes", "0"),
            ("bounce_streaming_scatter", "off"),
            ("bounce_escape_notifs", "false"),
            ("bounce_check_wait_us", "0"),
            ("bounce_idle_park_us", "250"),
            ("bounce_zmq_host", "10.0.0.7"),
            ("bounce_ucx_plugin", "/opt/nixl/libplugin_UCX.so"),
        ])
        .unwrap();
        assert_eq!(c.warnings, vec![]);
        let want = Config {
            enabled: false,
            arena_mem: ArenaMem::Auto,
            arena_gpus: ArenaGpus::Listed(vec![2, 0]),
            gpu_copy: GpuCopy::Kernel,
            defaults_for: MemKind::Dram,
            arena_size: GIB,
            arena_granularity: MIB,
            max_chunk_size: 32 * MIB,
            max_inflight_chunks: 4,
            copy_workers: 6,
            min_descriptor_count: 1024,
            max_average_descriptor_size: 16 * KIB,
            request_timeout: Duration::from_millis(1500),
            probe_after: Duration::from_millis(100),
            peer_dead_after: Duration::ZERO,
            eager_gather: false,
            control: ControlKind::Zmq,
            plan_ahead_runs: 0,
            region_plan_runs: 7,
            inline_bytes: 1024,
            standing_bytes: 256 * KIB,
            split_bytes: MIB,
            scatter_run_merging: false,
            direct_writes: false,
            cuda_ipc: false,
            cma: false,
            cma_workers: 3,
            cma_large_bytes: 0,
            streaming_scatter: false,
            escape_notifs: false,
            check_wait: Duration::ZERO,
            idle_park: Duration::from_micros(250),
            zmq_host: "10.0.0.7".into(),
            ucx_plugin: Some("/opt/nixl/libplugin_UCX.so".into()),
        };
        assert_eq!(c.config, want);
    }

    #[test]
    fn a_gpu_arena_takes_the_vram_defaults_for_what_is_unset_and_keeps_what_is_set() {
        // Named explicitly...
        let v = load(&[("bounce_arena_mem", "vram"), ("bounce_copy_workers", "2")]).unwrap().config;
        assert_eq!((v.arena_mem, v.defaults_for), (ArenaMem::Vram, MemKind::Vram));
        assert_eq!(v.max_chunk_size, 32 * MIB);
        assert_eq!(v.arena_granularity, MIB);
        assert_eq!(v.min_descriptor_count, 256, "the host default: the VRAM sweep found no other crossover");
        assert_eq!(v.max_average_descriptor_size, 256 * KIB);
        assert_eq!(v.copy_workers, 2, "a value the user set wins over either default");
        // ...or resolved from `auto` by the shell, which builds the config again for VRAM.
        let a = Config::from_params_as(Some(MemKind::Vram), [("bounce_arena_mem", "auto")], |_| None).unwrap();
        assert_eq!((a.config.arena_mem, a.config.defaults_for), (ArenaMem::Auto, MemKind::Vram));
        assert_eq!(a.config.max_chunk_size, 32 * MIB);
        // Host memory (and unresolved auto) keeps the host defaults, as does `both`, whose
        // first arena is host memory (the shell loads the GPU arena's options for VRAM).
        for (mem, want) in [("dram", ArenaMem::Dram), ("auto", ArenaMem::Auto), ("both", ArenaMem::Both)] {
            let d = load(&[("bounce_arena_mem", mem)]).unwrap().config;
            assert_eq!((d.arena_mem, d.defaults_for), (want, MemKind::Dram));
            assert_eq!(d.max_chunk_size, Config::default().max_chunk_size);
            assert_eq!(d.min_descriptor_count, 256);
        }
        // A garbage value fails, naming the default it would have had: the VRAM one for a GPU
        // arena.
        let g = load(&[("bounce_arena_mem", "vram"), ("bounce_max_chunk_size", "huge")]).unwrap_err();
        assert!(matches!(g, ConfigError::Unparsable { default: "32MiB", .. }), "{g:?}");
        assert!(matches!(load(&[("bounce_arena_mem", "tpu")]), Err(ConfigError::Unparsable { .. })));
    }

    #[test]
    fn arena_gpus_name_the_current_gpu_all_or_a_list_of_distinct_ordinals() {
        assert_eq!(Config::default().arena_gpus, ArenaGpus::Current);
        let gpus = |text: &str| load(&[("bounce_arena_mem", "vram"), ("bounce_arena_gpus", text)]).unwrap();
        for (text, want) in [
            ("current", ArenaGpus::Current),
            (" ALL ", ArenaGpus::All),
            ("3", ArenaGpus::Listed(vec![3])),
            ("1, 0 ,7", ArenaGpus::Listed(vec![1, 0, 7])),
        ] {
            let l = gpus(text);
            assert_eq!((&l.config.arena_gpus, l.warnings.len()), (&want, 0), "{text:?}");
        }
        let fifteen = (0..15).map(|i| i.to_string()).collect::<Vec<_>>().join(",");
        assert_eq!(ArenaGpus::parse(&fifteen).map(|g| g.named()), Some(true));
        // Each refused whole, with the default named: never a partial list.
        let gpus = |text: &str| load(&[("bounce_arena_mem", "vram"), ("bounce_arena_gpus", text)]);
        for bad in ["", "0,,1", "0,1,0", "-1", "1.5", "gpu0", "65536", "0 1", &format!("{fifteen},15")] {
            let e = gpus(bad).unwrap_err();
            assert!(
                matches!(e, ConfigError::Unparsable { option: "bounce_arena_gpus", default: "current", .. }),
                "{bad:?}: {e:?}"
            );
        }
        // Named GPUs with a host arena only: said, not silently dropped.
        let d = load(&[("bounce_arena_mem", "dram"), ("bounce_arena_gpus", "0,1")]).unwrap();
        assert_eq!(d.warnings, vec![ConfigWarning::GpusWithoutGpuArena]);
        assert!(load(&[("bounce_arena_mem", "dram")]).unwrap().warnings.is_empty());
    }

    #[test]
    fn worker_counts_and_the_zmq_host_are_checked_whatever_the_control_channel() {
        for option in ["bounce_copy_workers", "bounce_cma_workers"] {
            assert!(load(&[(option, "256")]).is_ok(), "{option} at the cap");
            let e = load(&[(option, "100000")]).unwrap_err();
            assert_eq!(e, ConfigError::TooManyWorkers { option: spec(option).name, got: 100_000 });
            assert!(e.to_string().contains(option), "{e}");
        }
        for ok in ["", " ", "10.0.0.7", "127.0.0.1", "::1", "fe80::1"] {
            assert!(load(&[("bounce_zmq_host", ok)]).is_ok(), "{ok:?}");
        }
        for (control, bad) in
            [("ucx", "0.0.0.0"), ("zmq", "::"), ("zmq", "my-host"), ("zmq", "239.1.1.1"), ("zmq", "10.0.0")]
        {
            let e = load(&[("bounce_control", control), ("bounce_zmq_host", bad)]).unwrap_err();
            assert_eq!(e, ConfigError::ZmqHostNotAnAddress { got: bad.into() }, "{bad:?}");
        }
    }

    #[test]
    fn a_value_that_does_not_parse_fails_the_configuration_naming_it() {
        // Every kind of option: a default in its place would do what was not asked for.
        for (option, value) in [
            ("bounce_enable", "disable"),
            ("bounce_control", "zeromq"),
            ("bounce_arena_size", "lots"),
            ("bounce_arena_size", "1.5GiB"),
            ("bounce_copy_workers", "-3"),
            ("bounce_max_inflight_chunks", "4294967296"),
            ("bounce_eager_gather", "maybe"),
            ("bounce_request_timeout_ms", ""),
        ] {
            let e = load(&[("bounce_copy_workers", "3"), (option, value)]).unwrap_err();
            assert_eq!(
                e,
                ConfigError::Unparsable {
                    option: spec(option).name,
                    from: ValueSource::Param,
                    value: value.into(),
                    default: spec(option).default,
                },
                "{option}={value:?}"
            );
            let text = e.to_string();
            assert!(text.contains(option) && text.contains(&format!("{value:?}")), "{text}");
        }
        // The first in manifest order is named, whatever the params' order.
        let e = load(&[("bounce_control", "tcp"), ("bounce_arena_size", "lots")]).unwrap_err();
        assert!(matches!(e, ConfigError::Unparsable { option: "bounce_arena_size", .. }), "{e:?}");
    }

    #[test]
    fn env_beats_param() {
        let loaded = load_env(
            &[("bounce_copy_workers", "3"), ("bounce_control", "ucx")],
            &[("NIXL_BOUNCE_COPY_WORKERS", "5"), ("NIXL_BOUNCE_CONTROL", "zmq")],
        )
        .unwrap();
        assert_eq!(loaded.config.copy_workers, 5);
        assert_eq!(loaded.config.control, ControlKind::Zmq);
        assert!(loaded.warnings.is_empty());
    }

    #[test]
    fn ucx_tls_without_cuda_ipc_turns_the_cuda_ipc_path_off_unless_asked_for_by_name() {
        let tls = |v| ("UCX_TLS", v);
        let off = load_env(&[], &[tls("tcp,cuda_copy")]).unwrap();
        assert!(!off.config.cuda_ipc);
        let warned = ConfigWarning::CudaIpcBesideUcxTls { ucx_tls: "tcp,cuda_copy".into(), explicit: false };
        assert_eq!(off.warnings, vec![warned]);
        assert!(off.warnings[0].to_string().contains("leaves out cuda_ipc"));
        // Asked for by name (param or environment): on, with a warning that says what it grants.
        for (params, env) in [
            (vec![("bounce_cuda_ipc", "true")], vec![tls("^cuda_ipc")]),
            (vec![], vec![tls("^cuda_ipc"), ("NIXL_BOUNCE_CUDA_IPC", "yes")]),
        ] {
            let on = load_env(&params, &env).unwrap();
            assert!(on.config.cuda_ipc, "{params:?} {env:?}");
            assert_eq!(
                on.warnings,
                vec![ConfigWarning::CudaIpcBesideUcxTls { ucx_tls: "^cuda_ipc".into(), explicit: true }]
            );
        }
        // An unparsable value is no request: refused.
        assert!(load_env(&[("bounce_cuda_ipc", "perhaps")], &[tls("tcp")]).is_err());
        // UCX may use cuda_ipc (named, through the cuda alias, or by default): on, no warning.
        for v in ["", "tcp,cuda", "rc,cuda_ipc", "^tcp"] {
            let l = load_env(&[], &[tls(v)]).unwrap();
            assert!(l.config.cuda_ipc && l.warnings.is_empty(), "UCX_TLS={v:?}: {l:?}");
        }
        // Turned off by the user: nothing to say.
        let off_anyway = load_env(&[("bounce_cuda_ipc", "false")], &[tls("tcp")]).unwrap();
        assert!(!off_anyway.config.cuda_ipc && off_anyway.warnings.is_empty());
    }

    #[test]
    fn bad_env_fails_naming_the_variable_and_does_not_fall_back_to_the_param() {
        let e = load_env(&[("bounce_copy_workers", "3")], &[("NIXL_BOUNCE_COPY_WORKERS", "many")]).unwrap_err();
        assert_eq!(
            e,
            ConfigError::Unparsable {
                option: "bounce_copy_workers",
                from: ValueSource::Env("NIXL_BOUNCE_COPY_WORKERS"),
                value: "many".into(),
                default: spec("bounce_copy_workers").default,
            }
        );
        assert!(e.to_string().contains("NIXL_BOUNCE_COPY_WORKERS"), "{e}");
    }

    #[test]
    fn empty_env_counts_as_unset() {
        let loaded = load_env(&[("bounce_copy_workers", "3")], &[("NIXL_BOUNCE_COPY_WORKERS", "")]).unwrap();
        assert_eq!(loaded.config.copy_workers, 3);
        assert!(loaded.warnings.is_empty());
    }

    #[test]
    fn unknown_bounce_param_warns_and_ucx_params_are_ignored() {
        let loaded = load(&[
            ("bounce_arena_sise", "1G"),
            ("num_workers", "4"),
            ("device_list", "mlx5_0"),
            ("ucx_error_handling_mode", "none"),
        ])
        .unwrap();
        assert_eq!(loaded.config, Config::default());
        assert_eq!(loaded.warnings, vec![ConfigWarning::UnknownParam { name: "bounce_arena_sise".into() }]);
    }

    #[test]
    fn empty_ucx_plugin_path_means_none() {
        assert_eq!(Config::default().ucx_plugin, None);
        let c = load(&[("bounce_ucx_plugin", "")]).unwrap().config;
        assert_eq!(c.ucx_plugin, None);
        let c = load(&[("bounce_ucx_plugin", " /p/x.so")]).unwrap().config;
        assert_eq!(c.ucx_plugin.as_deref(), Some(" /p/x.so"));
    }

    #[test]
    fn usable_capacity_and_largest_region() {
        let c = Config { arena_size: 5 * MIB + 100, arena_granularity: MIB, ..Config::default() };
        assert_eq!(c.arena_usable_capacity(), 5 * MIB);
        assert_eq!(c.largest_region(), 4 * MIB);
        let c = Config { arena_size: 256 * MIB, arena_granularity: 64 * KIB, ..c };
        assert_eq!(c.arena_usable_capacity(), 256 * MIB);
        assert_eq!(c.largest_region(), 256 * MIB);
        let c = Config { arena_granularity: 0, ..c };
        assert_eq!(c.arena_usable_capacity(), 0);
        assert_eq!(c.largest_region(), 0);
    }

    #[test]
    fn chunk_size_is_clamped_to_the_largest_region() {
        let loaded = load(&[
            ("bounce_arena_size", "6MiB"),
            ("bounce_arena_granularity", "1MiB"),
            ("bounce_max_chunk_size", "32MiB"),
        ])
        .unwrap();
        assert_eq!(loaded.config.max_chunk_size, 4 * MIB);
        assert_eq!(
            loaded.warnings,
            vec![ConfigWarning::ChunkSizeAdjusted { requested: 32 * MIB, used: 4 * MIB, largest_region: 4 * MIB }]
        );
    }

    #[test]
    fn chunk_size_is_rounded_down_to_a_power_of_two() {
        let loaded = load(&[("bounce_max_chunk_size", "3MiB")]).unwrap();
        assert_eq!(loaded.config.max_chunk_size, 2 * MIB);
        assert!(matches!(
            loaded.warnings[..],
            [ConfigWarning::ChunkSizeAdjusted { requested, used, .. }]
                if requested == 3 * MIB && used == 2 * MIB
        ));
    }

    #[test]
    fn chunk_size_that_fits_is_kept_silently() {
        let loaded = load(&[("bounce_max_chunk_size", "1M"), ("bounce_arena_size", "1M")]).unwrap();
        assert_eq!(loaded.config.max_chunk_size, MIB);
        assert!(loaded.warnings.is_empty());
    }

    #[test]
    fn chunk_smaller_than_granularity_is_allowed() {
        let loaded = load(&[("bounce_max_chunk_size", "4K")]).unwrap();
        assert_eq!(loaded.config.max_chunk_size, 4 * KIB);
        assert!(loaded.config.max_chunk_size < loaded.config.arena_granularity);
    }

    #[test]
    fn impossible_params_are_errors() {
        use ConfigError::*;
        let min = DEFAULT_ALIGN;
        let err = |params: &[(&str, &str)]| load(params).unwrap_err();
        let gran = "bounce_arena_granularity";
        let arena = "bounce_arena_size";
        let chunk = "bounce_max_chunk_size";
        let e = GranularityNotPowerOfTwo { granularity: 0 };
        assert_eq!(err(&[(gran, "0")]), e);
        let e = GranularityNotPowerOfTwo { granularity: 96 * KIB };
        assert_eq!(err(&[(gran, "96K")]), e);
        let e = ArenaSmallerThanGranularity { arena_size: MIB, granularity: 2 * MIB };
        assert_eq!(err(&[(arena, "1M"), (gran, "2M")]), e);
        let e = ArenaSmallerThanGranularity { arena_size: 0, granularity: 64 * KIB };
        assert_eq!(err(&[(arena, "0")]), e);
        let e = ChunkTooSmall { max_chunk_size: 0, min };
        assert_eq!(err(&[(chunk, "0")]), e);
        // 31 is first rounded down to 16.
        let e = ChunkTooSmall { max_chunk_size: 16, min };
        assert_eq!(err(&[(chunk, "31")]), e);
        assert_eq!(err(&[("bounce_max_inflight_chunks", "0")]), ZeroInflightChunks);
        assert_eq!(err(&[("bounce_copy_workers", "0")]), ZeroCopyWorkers);
        assert_eq!(err(&[("bounce_request_timeout_ms", "0")]), ZeroRequestTimeout);
        assert_eq!(err(&[("bounce_idle_park_us", "49")]), IdleParkTooShort { got: 49 });
        assert!(load(&[("bounce_idle_park_us", "50")]).is_ok());
    }

    #[test]
    fn hand_built_configs_are_validated() {
        use ConfigError::*;
        let check = |edit: fn(&mut Config)| {
            let mut c = Config::default();
            edit(&mut c);
            c.validate()
        };
        assert_eq!(check(|_| {}), Ok(()));
        let e = GranularityNotPowerOfTwo { granularity: 3 };
        assert_eq!(check(|c| c.arena_granularity = 3), Err(e));
        let e = ChunkNotPowerOfTwo { max_chunk_size: 3 * MIB };
        assert_eq!(check(|c| c.max_chunk_size = 3 * MIB), Err(e));
        let e = ChunkExceedsArena { max_chunk_size: 512 * MIB, largest_region: 256 * MIB };
        assert_eq!(check(|c| c.max_chunk_size = 512 * MIB), Err(e));
        let e = ChunkTooSmall { max_chunk_size: 16, min: DEFAULT_ALIGN };
        assert_eq!(check(|c| c.max_chunk_size = 16), Err(e));
        assert_eq!(check(|c| c.max_inflight_chunks = 0), Err(ZeroInflightChunks));
        assert_eq!(check(|c| c.copy_workers = 0), Err(ZeroCopyWorkers));
        assert_eq!(check(|c| c.request_timeout = Duration::ZERO), Err(ZeroRequestTimeout));
        assert_eq!(check(|c| c.idle_park = Duration::ZERO), Err(IdleParkTooShort { got: 0 }));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn byte_values_never_read_as_zero_unless_zero(text in prop_oneof![
            ".*",
            "[ \t]*[0-9]{0,22}[ \t]*(|[kKmMgG]|[kKmMgG][bB]|[kKmMgG][iI][bB]|x)[ \t]*",
        ]) {
            let literally_zero = {
                let t = text.trim();
                let digits: String = t.chars().take_while(char::is_ascii_digit).collect();
                !digits.is_empty() && digits.chars().all(|c| c == '0')
            };
            if let Some(n) = parse_bytes(&text) {
                prop_assert_eq!(n == 0, literally_zero, "{:?} -> {}", text, n);
            }
            // Through the whole loader: no panic; a value that parses is taken as parsed (a
            // non-zero input never yields 0), one that does not is refused.
            match load(&[("bounce_max_average_descriptor_size", &text)]) {
                Ok(loaded) => {
                    let v = loaded.config.max_average_descriptor_size;
                    prop_assert_eq!(Some(v), parse_bytes(&text), "{:?}", text);
                    prop_assert!(v != 0 || literally_zero, "{:?} -> 0", text);
                }
                Err(e) => prop_assert!(
                    parse_bytes(&text).is_none() && matches!(e, ConfigError::Unparsable { .. }),
                    "{:?}: {:?}", text, e
                ),
            }
        }

        #[test]
        fn a_gpu_list_is_distinct_and_bounded_whatever_the_text(text in prop_oneof![
            ".*",
            "[ ,0-9]{0,60}",
        ]) {
            if let Some(ArenaGpus::Listed(list)) = ArenaGpus::parse(&text) {
                prop_assert!((1..=MAX_ARENA_GPUS).contains(&list.len()), "{:?} -> {:?}", text, list);
                let mut sorted = list.clone();
                sorted.sort_unstable();
                sorted.dedup();
                prop_assert_eq!(sorted.len(), list.len(), "{:?} repeats a GPU", text);
            }
        }

        #[test]
        fn a_gpu_list_written_out_reads_back_in_its_order(
            set in prop::collection::hash_set(0u16..1024, 1..=MAX_ARENA_GPUS),
            sep in prop_oneof![Just(","), Just(", "), Just(" ,")],
        ) {
            let list: Vec<u16> = set.into_iter().collect();
            let text = list.iter().map(u16::to_string).collect::<Vec<_>>().join(sep);
            prop_assert_eq!(ArenaGpus::parse(&text), Some(ArenaGpus::Listed(list)));
        }
    }
}
