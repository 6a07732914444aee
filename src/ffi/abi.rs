//! `extern "C"` entry points: raw-to-typed conversion only, each body inside [`guard`].
//! Declarations for C++ live in `cpp/include/bounce_ffi.h`; keep the two in step.

use std::ffi::{CString, c_char, c_void};
use std::path::Path;
use std::sync::{LazyLock, Once};

use bounce_proto::manifest::{OPTIONS, PLUGIN_NAME, PLUGIN_VERSION};
use bounce_proto::proof::Destination;
use bounce_proto::{ArenaId, RegId, RegKey};

use super::{Status, guard, guard_value, guard_void};
use crate::shell::{CreateParams, DescView, Diverted, Engine, Error, Progress, Registration};
use crate::sys::c::{BncPairSink, BncSink, BncStr, sink_bytes};
use crate::sys::inner_plugin::{InnerPlugin, locate_ucx_plugin};
use crate::sys::nixl::{MemSeg, XferOp};
use crate::sys::shim::{Md, Shim};

/// The UTF-8 text a `bnc_str` views.
///
/// # Safety
/// As [`BncStr::bytes`]: `s` views live bytes (or is empty) for `'a`.
unsafe fn text<'a>(s: BncStr, what: &'static str) -> Result<&'a str, Error> {
    // SAFETY: forwarded contract.
    std::str::from_utf8(unsafe { s.bytes() }).map_err(|_| Error::BadUtf8(what))
}

/// Says once per process that an agent name is not UTF-8. NIXL's names are any bytes, and UCX
/// serves such a peer; BOUNCE keeps peers by text, so it leaves that peer to UCX (loaded with
/// no capabilities, its transfers passed through) rather than refusing it with nothing said.
fn non_utf8_name(entry: &str) {
    static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if !SAID.swap(true, std::sync::atomic::Ordering::Relaxed) {
        tracing::warn!(entry, "an agent name is not UTF-8: that peer stays on plain UCX");
    }
}

/// A key/value pair (`bnc_kv`).
#[repr(C)]
pub struct BncKv {
    key: BncStr,
    value: BncStr,
}

/// Arguments of `bnc_engine_create`.
#[repr(C)]
pub struct BncCreateArgs {
    agent: BncStr,
    params: *const BncKv,
    n_params: usize,
    enable_prog_th: i32,
    pthr_delay_us: u64,
    sync_mode: i32,
    self_path: BncStr,
}

/// Results of `bnc_engine_create`.
#[repr(C)]
pub struct BncCreateOut {
    engine: *mut c_void,
    inner_plugin: *const c_void,
    inner_prog_th: i32,
    inner_pthr_delay_us: u64,
    inner_sync_mode: i32,
}

unsafe extern "C" {
    /// The plugin descriptor defined by the C++ shim.
    fn bnc_shim_plugin() -> *const c_void;
}

static LOG_INIT: Once = Once::new();

/// True when the environment variable is set to something other than empty or `0`.
fn env_flag(name: &str) -> bool {
    std::env::var(name).is_ok_and(|v| !v.is_empty() && v != "0")
}

/// Installs the stderr `tracing` subscriber once, filtered by `NIXL_BOUNCE_LOG` (default `warn`).
/// `NIXL_BOUNCE_LOG_SPANS=1` also logs each span's busy and idle time when it closes (a control
/// frame's handling, a write, a copy launch): the timeline a trace of the pipeline needs.
/// `NIXL_BOUNCE_NVTX=1` makes every span of the engine an NVTX range too (see
/// [`crate::sys::nvtx`]), whatever `NIXL_BOUNCE_LOG` says.
fn init_logging() {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::{EnvFilter, Layer, filter};

    LOG_INIT.call_once(|| {
        let log = EnvFilter::try_from_env("NIXL_BOUNCE_LOG").unwrap_or_else(|_| EnvFilter::new("warn"));
        let spans = match env_flag("NIXL_BOUNCE_LOG_SPANS") {
            true => tracing_subscriber::fmt::format::FmtSpan::CLOSE,
            false => tracing_subscriber::fmt::format::FmtSpan::NONE,
        };
        let fmt = tracing_subscriber::fmt::layer()
            .with_span_events(spans)
            .with_writer(std::io::stderr)
            .with_target(false)
            .with_ansi(false)
            .with_filter(log);
        let (nvtx, nvtx_error) = match env_flag("NIXL_BOUNCE_NVTX") {
            false => (None, None),
            true => match crate::sys::nvtx::Nvtx::load(std::env::var("NIXL_BOUNCE_NVTX_LIB").ok().as_deref()) {
                // Spans only (no events), the engine's own, at every level.
                Ok(n) => {
                    let only = filter::Targets::new()
                        .with_target("nixl_bounce", tracing::Level::TRACE)
                        .with_target("bounce_proto", tracing::Level::TRACE);
                    (Some(crate::sys::nvtx::NvtxLayer::new(n).with_filter(only)), None)
                }
                Err(e) => (None, Some(e)),
            },
        };
        // try_init: a host process may already have installed a global subscriber.
        let on = nvtx.is_some();
        if tracing_subscriber::registry().with(fmt).with(nvtx).try_init().is_ok() {
            match nvtx_error {
                Some(e) => tracing::warn!(error = %e, "NIXL_BOUNCE_NVTX=1 but NVTX could not be loaded: no ranges"),
                None if on => tracing::info!("NVTX ranges on"),
                None => {}
            }
        }
    });
}

/// NIXL's plugin entry point: returns the plugin descriptor (a `nixlBackendPlugin*`).
#[unsafe(no_mangle)]
pub extern "C" fn nixl_plugin_init() -> *const c_void {
    let mut out = std::ptr::null();
    guard("nixl_plugin_init", || {
        init_logging();
        // SAFETY: bnc_shim_plugin takes no arguments and returns a pointer to static data.
        out = unsafe { bnc_shim_plugin() };
        Status::Success
    });
    out
}

/// NIXL's optional plugin exit point. Engines are destroyed individually; nothing global to free.
#[unsafe(no_mangle)]
pub extern "C" fn nixl_plugin_fini() {
    guard_void("nixl_plugin_fini", || {});
}

static NAME_C: LazyLock<CString> = LazyLock::new(|| CString::new(PLUGIN_NAME).unwrap_or_default());
static VERSION_C: LazyLock<CString> = LazyLock::new(|| CString::new(PLUGIN_VERSION).unwrap_or_default());

/// The backend name, NUL-terminated, static.
#[unsafe(no_mangle)]
pub extern "C" fn bnc_plugin_name() -> *const c_char {
    guard_value("bnc_plugin_name", std::ptr::null(), || NAME_C.as_ptr())
}

/// The plugin version, NUL-terminated, static.
#[unsafe(no_mangle)]
pub extern "C" fn bnc_plugin_version() -> *const c_char {
    guard_value("bnc_plugin_version", std::ptr::null(), || VERSION_C.as_ptr())
}

/// The NIXL versions this build accepts, comma-separated, NUL-terminated, static (read by
/// `nixl-bounce doctor`).
#[unsafe(no_mangle)]
pub extern "C" fn nixl_bounce_tested_nixl_versions() -> *const c_char {
    guard_value("nixl_bounce_tested_nixl_versions", std::ptr::null(), || {
        crate::sys::nixl_version::TESTED_NIXL_VERSIONS_C.as_ptr()
    })
}

/// The default inner UCX plugin (`NIXL_BOUNCE_UCX_PLUGIN`, else beside BOUNCE), loaded once
/// and kept, so `get_backend_options` can list UCX's options next to ours: every UCX param is
/// accepted unchanged. Null when it cannot be loaded (then only our options are listed).
///
/// # Safety
/// `self_path` views live bytes (or is empty).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn bnc_default_inner_plugin(self_path: BncStr) -> *const c_void {
    static DEFAULT: std::sync::OnceLock<Option<InnerPlugin>> = std::sync::OnceLock::new();
    let mut out = std::ptr::null();
    guard("bnc_default_inner_plugin", || {
        // SAFETY: caller contract.
        let me = unsafe { text(self_path, "plugin path") }.ok().filter(|p| !p.is_empty()).map(Path::new);
        let plugin = DEFAULT.get_or_init(|| {
            let configured = std::env::var("NIXL_BOUNCE_UCX_PLUGIN").ok().filter(|p| !p.is_empty());
            let path = locate_ucx_plugin(configured.as_deref(), me);
            InnerPlugin::load(&path).ok()
        });
        if let Some(p) = plugin {
            out = p.descriptor();
        }
        Status::Success
    });
    out
}

/// Number of manifest options.
#[unsafe(no_mangle)]
pub extern "C" fn bnc_option_count() -> usize {
    guard_value("bnc_option_count", 0, || OPTIONS.len())
}

/// Name and default of option `i` (static bytes).
///
/// # Safety
/// `name` and `default_value` are valid for writes (null is rejected).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn bnc_option_at(i: usize, name: *mut BncStr, default_value: *mut BncStr) -> i32 {
    guard("bnc_option_at", || {
        let Some(o) = OPTIONS.get(i) else { return Status::ErrInvalidParam };
        if name.is_null() || default_value.is_null() {
            return Status::ErrInvalidParam;
        }
        // SAFETY: both pointers are non-null and the caller guarantees they are writable.
        unsafe {
            *name = BncStr::from_static(o.name.as_bytes());
            *default_value = BncStr::from_static(o.default.as_bytes());
        }
        Status::Success
    })
    .code()
}

/// Hands `bytes` to a sink the shim passed in.
fn give(sink: BncSink, ctx: *mut c_void, bytes: &[u8]) {
    // SAFETY: every entry point's contract makes its sink/ctx pair a valid sink for the call.
    unsafe { sink_bytes(sink, ctx, bytes) }
}

/// Creates the Rust half of an engine and loads the inner UCX plugin.
///
/// # Safety
/// - `args` points at a valid `bnc_create_args` whose strings and params live for the call.
/// - `out` is valid for writes; `err`/`err_ctx` form a valid sink.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn bnc_engine_create(
    args: *const BncCreateArgs,
    out: *mut BncCreateOut,
    err: BncSink,
    err_ctx: *mut c_void,
) -> i32 {
    guard("bnc_engine_create", || {
        init_logging();
        if args.is_null() || out.is_null() {
            give(err, err_ctx, b"null argument");
            return Status::ErrInvalidParam;
        }
        if let Err(refusal) = crate::sys::nixl_version::check(|k| std::env::var(k).ok()) {
            give(err, err_ctx, refusal.to_string().as_bytes()); // the one line the shim prints
            return Status::ErrMismatch;
        }
        // SAFETY: non-null, and the caller guarantees it is a valid struct for the call.
        let a = unsafe { &*args };
        let parsed = (|| -> Result<CreateParams<'_>, Error> {
            // SAFETY: the shim builds every bnc_str from a live std::string.
            let agent = unsafe { text(a.agent, "agent name") }?;
            let kvs: &[BncKv] = if a.params.is_null() || a.n_params == 0 {
                &[]
            } else {
                // SAFETY: the shim passes a vector's data() and size(), live for the call.
                unsafe { std::slice::from_raw_parts(a.params, a.n_params) }
            };
            let mut params = Vec::with_capacity(kvs.len());
            for kv in kvs {
                // SAFETY: as above, each key/value views a live std::string.
                let (key, value) = unsafe { (kv.key.bytes(), kv.value.bytes()) };
                // Only our own options must be text: the others are UCX's, which the shim hands
                // the inner engine as NIXL gave them, and UCX takes any bytes (review 56).
                if !key.starts_with(b"bounce_") {
                    if let (Ok(k), Ok(v)) = (std::str::from_utf8(key), std::str::from_utf8(value)) {
                        params.push((k, v));
                    }
                    continue;
                }
                // SAFETY: as above.
                params.push(unsafe { (text(kv.key, "param name")?, text(kv.value, "param value")?) });
            }
            // SAFETY: as above.
            let self_path = unsafe { text(a.self_path, "plugin path") }?;
            Ok(CreateParams {
                agent,
                params,
                enable_prog_th: a.enable_prog_th != 0,
                pthr_delay_us: a.pthr_delay_us,
                sync_mode: a.sync_mode,
                self_path: (!self_path.is_empty()).then(|| Path::new(self_path)),
            })
        })();
        let created = parsed.and_then(|p| Engine::create(&p, |k| std::env::var(k).ok()));
        match created {
            Ok((engine, inner)) => {
                let plugin = engine.inner_plugin();
                let boxed = Box::into_raw(Box::new(engine));
                // SAFETY: `out` is non-null and writable (checked above / caller contract).
                unsafe {
                    *out = BncCreateOut {
                        engine: boxed.cast(),
                        inner_plugin: plugin,
                        inner_prog_th: i32::from(inner.prog_th),
                        inner_pthr_delay_us: inner.pthr_delay_us,
                        inner_sync_mode: inner.sync_mode,
                    };
                }
                Status::Success
            }
            Err(e) => {
                tracing::error!("BOUNCE engine creation failed: {e}");
                give(err, err_ctx, e.to_string().as_bytes());
                Status::from(&e)
            }
        }
    })
    .code()
}

/// # Safety
/// `engine` is null or a pointer returned by `bnc_engine_create` and not yet destroyed.
unsafe fn engine_ref<'a>(engine: *mut c_void) -> Option<&'a Engine> {
    // SAFETY: per the contract it is either null or a live Box<Engine> we handed out.
    unsafe { engine.cast::<Engine>().as_ref() }
}

/// Gives the Rust engine the shim pointer it may call back into.
///
/// # Safety
/// `engine` is a live engine handle; `shim` is null or a live shim engine whose `bnc_shim_*`
/// functions may be called from any thread until `bnc_engine_stop` on this engine has returned
/// (the shim destroys its inner engine only after that, and the Rust engine makes no shim call
/// once stopped).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn bnc_engine_attach(engine: *mut c_void, shim: *mut c_void) -> i32 {
    guard("bnc_engine_attach", || {
        // SAFETY: per the contract it is a live handle, and attach is called exactly once, before
        // any other call on this engine, from the thread that created it (NIXL has not been
        // handed the engine yet): no other reference exists, so the exclusive borrow is sound.
        // The reactor threads attach starts get only Arc-shared state and the shim, never a
        // reference to the Engine, so nothing aliases this borrow while it lives.
        let Some(e) = (unsafe { engine.cast::<Engine>().as_mut() }) else { return Status::ErrInvalidParam };
        // SAFETY: the shim stays callable until bnc_engine_stop returns (caller contract), and
        // every copy of the Shim (the reactor's, its channels') is dropped or unused by then,
        // which is what Shim requires.
        let Some(shim) = (unsafe { Shim::new(shim) }) else { return Status::Success };
        e.attach(shim);
        Status::Success
    })
    .code()
}

/// Closes an engine's bounce path, before the shim destroys the inner engine: says GOODBYE to
/// the peers, stops and joins the reactor, deregisters the arena (keeping its memory mapped if
/// a peer may still write into it) and unloads the peer arenas. Later calls on the engine stay
/// on plain UCX; `bnc_engine_destroy` must follow.
///
/// # Safety
/// `engine` is null or a live handle from `bnc_engine_create`; the shim it was attached to is
/// still alive (its inner engine too); no other call on this engine runs concurrently or
/// starts afterwards except `bnc_engine_destroy` (NIXL destroys an engine only once nothing
/// else uses it).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn bnc_engine_stop(engine: *mut c_void) {
    guard_void("bnc_engine_stop", || {
        // SAFETY: a live handle (contract) and no other call runs concurrently (contract); the
        // reactor threads hold only Arc-shared state and the shim, never a reference to the
        // Engine, and the bnc_shim_* functions they call never call back into the engine
        // (bounce_ffi.h): this exclusive borrow aliases nothing.
        if let Some(e) = unsafe { engine.cast::<Engine>().as_mut() } {
            e.stop();
        }
    });
}

/// Destroys an engine handle (after `bnc_engine_stop` and after the inner engine is gone).
///
/// # Safety
/// `engine` is null or a live handle from `bnc_engine_create`, not used afterwards.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn bnc_engine_destroy(engine: *mut c_void) {
    guard_void("bnc_engine_destroy", || {
        if !engine.is_null() {
            // SAFETY: it came from Box::into_raw in bnc_engine_create and is destroyed once, with
            // no other call running (contract): its reactor, the only other thread that ever
            // used its shared state, was joined by bnc_engine_stop (or is joined by Drop).
            drop(unsafe { Box::from_raw(engine.cast::<Engine>()) });
        }
    });
}

/// Wraps the inner conn info into BOUNCE's envelope.
///
/// # Safety
/// `engine` is a live handle; `inner` views live bytes; `out`/`ctx` form a valid sink.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn bnc_conn_info_wrap(engine: *mut c_void, inner: BncStr, out: BncSink, ctx: *mut c_void) -> i32 {
    guard("bnc_conn_info_wrap", || {
        // SAFETY: caller contract.
        let Some(e) = (unsafe { engine_ref(engine) }) else { return Status::ErrInvalidParam };
        // SAFETY: caller contract.
        let env = e.wrap_conn_info(unsafe { inner.bytes() });
        give(out, ctx, &env);
        Status::Success
    })
    .code()
}

/// Unwraps a peer's envelope into the inner conn info.
///
/// # Safety
/// `engine` is a live handle; `agent`/`envelope` view live bytes; `inner`/`ctx` form a valid sink.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn bnc_conn_info_load(
    engine: *mut c_void,
    agent: BncStr,
    envelope: BncStr,
    inner: BncSink,
    ctx: *mut c_void,
) -> i32 {
    guard("bnc_conn_info_load", || {
        // SAFETY: caller contract.
        let Some(e) = (unsafe { engine_ref(engine) }) else { return Status::ErrInvalidParam };
        // SAFETY: caller contract.
        let (agent, envelope) = match unsafe { (text(agent, "agent name"), envelope.bytes()) } {
            (Ok(a), b) => (Some(a), b),
            (Err(_), b) => (None, b),
        };
        let loaded = match agent {
            Some(agent) => e.load_conn_info(agent, envelope),
            None => {
                non_utf8_name("loadRemoteConnInfo");
                e.conn_info_for_ucx_only(envelope)
            }
        };
        match loaded {
            Ok(bytes) => {
                give(inner, ctx, &bytes);
                Status::Success
            }
            Err(err) => Status::from(&err),
        }
    })
    .code()
}

/// Wraps the inner engine's public data of our registration `md` with its id and key.
///
/// # Safety
/// `engine` is a live handle; `inner` views live bytes; `out`/`ctx` form a valid sink. `md` is
/// only used as a key, never dereferenced.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn bnc_public_data_wrap(
    engine: *mut c_void,
    md: *const c_void,
    inner: BncStr,
    out: BncSink,
    ctx: *mut c_void,
) -> i32 {
    guard("bnc_public_data_wrap", || {
        // SAFETY: caller contract.
        let Some(e) = (unsafe { engine_ref(engine) }) else { return Status::ErrInvalidParam };
        // SAFETY: caller contract.
        let blob = e.public_data(Md(md as usize), unsafe { inner.bytes() });
        give(out, ctx, &blob);
        Status::Success
    })
    .code()
}

/// Takes a peer's registration metadata apart: the inner blob goes to `inner`; `*reg` and
/// `key[0..32]` receive the registration's id and key and `*has_key` says whether there were
/// any (a blob that is not ours loads as is; one with our magic that does not decode is
/// refused, ERR_MISMATCH); `*ticket` names the same-host record the blob carried (0: none)
/// until the caller reports the inner engine's load of this blob: `bnc_remote_md_loaded` with
/// it, or `bnc_remote_md_load_failed`.
///
/// # Safety
/// `engine` is a live handle; `blob` views live bytes; `inner`/`ctx` form a valid sink; `reg`,
/// `has_key`, `ticket` and `key` (32 bytes) are valid for writes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn bnc_remote_md_split(
    engine: *mut c_void,
    blob: BncStr,
    inner: BncSink,
    ctx: *mut c_void,
    reg: *mut u64,
    key: *mut u8,
    has_key: *mut i32,
    ticket: *mut u64,
) -> i32 {
    guard("bnc_remote_md_split", || {
        if reg.is_null() || key.is_null() || has_key.is_null() || ticket.is_null() {
            return Status::ErrInvalidParam;
        }
        // SAFETY: caller contract.
        let Some(e) = (unsafe { engine_ref(engine) }) else { return Status::ErrInvalidParam };
        // SAFETY: caller contract.
        let split = match e.split_remote_md(unsafe { blob.bytes() }) {
            Ok(split) => split,
            Err(err) => return Status::from(&err),
        };
        give(inner, ctx, &split.inner);
        let (id, k, has) = split.dest.map_or((0, [0u8; 32], 0), |d| (d.reg.0, d.key.0, 1));
        // SAFETY: caller contract: all four are valid for writes, `key` for 32 bytes.
        unsafe {
            reg.write(id);
            std::ptr::copy_nonoverlapping(k.as_ptr(), key, k.len());
            has_key.write(has);
            ticket.write(split.ticket);
        }
        Status::Success
    })
    .code()
}

/// The inner engine loaded a peer's registration as `md`, from the blob whose
/// `bnc_remote_md_split` gave the id, the key (32 bytes) and `ticket`.
///
/// # Safety
/// `engine` is a live handle; `key` points at 32 readable bytes. `md` is only a key.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn bnc_remote_md_loaded(
    engine: *mut c_void,
    md: *const c_void,
    reg: u64,
    key: *const u8,
    ticket: u64,
) {
    guard_void("bnc_remote_md_loaded", || {
        // SAFETY: caller contract.
        let Some(e) = (unsafe { engine_ref(engine) }) else { return };
        if key.is_null() {
            e.remote_md_load_failed(ticket);
            return;
        }
        // SAFETY: caller contract: 32 readable bytes.
        let k: [u8; 32] = unsafe { std::ptr::read_unaligned(key.cast::<[u8; 32]>()) };
        e.remote_md_loaded(Md(md as usize), Destination { reg: RegId(reg), key: RegKey(k) }, ticket);
    });
}

/// The inner engine did not load the blob whose `bnc_remote_md_split` gave `ticket`: the
/// record it carried goes (it must never be taken by another blob's load).
///
/// # Safety
/// `engine` is a live handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn bnc_remote_md_load_failed(engine: *mut c_void, ticket: u64) {
    guard_void("bnc_remote_md_load_failed", || {
        // SAFETY: caller contract.
        if let Some(e) = unsafe { engine_ref(engine) } {
            e.remote_md_load_failed(ticket);
        }
    });
}

/// NIXL unloaded remote metadata `md`.
///
/// # Safety
/// `engine` is a live handle. `md` is only used as a key.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn bnc_remote_md_unloaded(engine: *mut c_void, md: *const c_void) {
    guard_void("bnc_remote_md_unloaded", || {
        // SAFETY: caller contract.
        if let Some(e) = unsafe { engine_ref(engine) } {
            e.remote_md_unloaded(Md(md as usize));
        }
    });
}

/// Records a registration made through the engine.
///
/// # Safety
/// `engine` is a live handle. `md` is only used as a key, never dereferenced.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn bnc_mem_registered(
    engine: *mut c_void,
    md: *const c_void,
    addr: u64,
    len: u64,
    dev: u64,
    mem: i32,
) -> i32 {
    guard("bnc_mem_registered", || {
        // SAFETY: caller contract.
        let Some(e) = (unsafe { engine_ref(engine) }) else { return Status::ErrInvalidParam };
        // Other segment kinds never take the bounce path.
        let Some(mem) = MemSeg::from_code(mem).and_then(MemSeg::kind) else { return Status::Success };
        e.mem_registered(Md(md as usize), Registration { addr, len, dev, mem });
        Status::Success
    })
    .code()
}

/// Forgets a registration.
///
/// # Safety
/// `engine` is a live handle. `md` is only used as a key.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn bnc_mem_deregistered(engine: *mut c_void, md: *const c_void) {
    guard_void("bnc_mem_deregistered", || {
        // SAFETY: caller contract.
        if let Some(e) = unsafe { engine_ref(engine) } {
            e.mem_deregistered(Md(md as usize));
        }
    });
}

/// C++ counter sink (`bnc_stat_sink`): the counter's index, its name and its value.
/// Nullable, as [`BncSink`].
type BncStatSink =
    Option<unsafe extern "C" fn(ctx: *mut c_void, index: usize, name: *const u8, len: usize, value: u64)>;

/// Emits the engine's counters that changed, one `(index, name, value)` per sink call. The
/// index lets the shim keep each counter's slot in NIXL's params map, so publishing a counter
/// formats no line and looks up no key (a prep publishes the two routing counters it bumps:
/// that was most of its cost over UCX's, issue 12).
///
/// # Safety
/// `engine` is a live handle; `sink`/`ctx` form a valid sink.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn bnc_stats(engine: *mut c_void, sink: BncStatSink, ctx: *mut c_void) {
    guard_void("bnc_stats", || {
        // SAFETY: caller contract.
        if let (Some(e), Some(sink)) = (unsafe { engine_ref(engine) }, sink) {
            // SAFETY: the sink copies the name, which is 'static, during the call.
            e.publish_changed_stats(|i, k, v| unsafe { sink(ctx, i, k.as_ptr(), k.len(), v) });
        }
    });
}

/// The inner engine loaded the peer: describes what the shim is to load of the peer's arena
/// `index` (the index in the peer's capabilities): the arena (bit 0 of the result) and, for
/// arena 0, its mailbox's host registration (bit 1); 0 when there is nothing (the shim asks for
/// 0, 1, ... and stops there, at most `MAX_ARENAS` times). Index 0 also sends HELLO.
///
/// # Safety
/// `engine` is a live handle; `agent` views live bytes; the out-pointers are writable;
/// `key`/`key_ctx` and `mbox_key`/`mbox_key_ctx` form valid sinks.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn bnc_peer_loaded(
    engine: *mut c_void,
    agent: BncStr,
    index: u32,
    addr: *mut u64,
    len: *mut u64,
    dev: *mut u64,
    mem: *mut i32,
    key: BncSink,
    key_ctx: *mut c_void,
    mbox_addr: *mut u64,
    mbox_len: *mut u64,
    mbox_key: BncSink,
    mbox_key_ctx: *mut c_void,
) -> i32 {
    let mut found = 0;
    guard("bnc_peer_loaded", || {
        // SAFETY: caller contract.
        let Some(e) = (unsafe { engine_ref(engine) }) else { return Status::ErrInvalidParam };
        // SAFETY: caller contract.
        let Ok(agent) = (unsafe { text(agent, "agent name") }) else { return Status::ErrInvalidParam };
        if [addr, len, dev, mbox_addr, mbox_len].iter().any(|p| p.is_null()) || mem.is_null() {
            return Status::ErrInvalidParam;
        }
        // Past MAX_ARENAS no peer has an arena: nothing to load.
        let Ok(index) = u8::try_from(index).map(ArenaId) else { return Status::Success };
        if let Some(a) = e.peer_loaded(agent, index) {
            // SAFETY: all four are non-null and writable per the contract.
            unsafe {
                *addr = a.base;
                *len = a.len;
                *dev = a.dev;
                *mem = MemSeg::from(a.mem).code();
            }
            give(key, key_ctx, &a.key);
            found = 1;
            if let Some((base, n, k)) = &a.mailbox {
                // SAFETY: both are non-null and writable per the contract.
                unsafe {
                    *mbox_addr = *base;
                    *mbox_len = *n;
                }
                give(mbox_key, mbox_key_ctx, k);
                found |= 2;
            }
        }
        Status::Success
    });
    found
}

/// Records the inner metadata of a peer's arena `index` and (index 0) of its mailbox's
/// registration (each null: loading it failed, or there was none).
///
/// # Safety
/// `engine` is a live handle; `agent` views live bytes. `md` and `mbox_md` are kept as opaque
/// values and only ever handed back to the shim.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn bnc_peer_arena_md(
    engine: *mut c_void,
    agent: BncStr,
    index: u32,
    md: *mut c_void,
    mbox_md: *mut c_void,
) {
    guard_void("bnc_peer_arena_md", || {
        // SAFETY: caller contract.
        if let (Some(e), Ok(a)) = unsafe { (engine_ref(engine), text(agent, "agent name")) } {
            let handle = |p: *mut c_void| (!p.is_null()).then_some(Md(p as usize));
            match u8::try_from(index) {
                Ok(i) => e.peer_arena_loaded(a, ArenaId(i), handle(md), handle(mbox_md)),
                // Never asked for (bnc_peer_loaded loads nothing there): hand the handles back.
                Err(_) => e.peer_arena_loaded(a, ArenaId(u8::MAX), handle(md), handle(mbox_md)),
            }
        }
    });
}

/// The peer disconnected.
///
/// # Safety
/// `engine` is a live handle; `agent` views live bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn bnc_peer_lost(engine: *mut c_void, agent: BncStr) {
    guard_void("bnc_peer_lost", || {
        // SAFETY: caller contract.
        if let (Some(e), Ok(a)) = unsafe { (engine_ref(engine), text(agent, "agent name")) } {
            e.peer_lost(a);
        }
    });
}

/// The inner engine refused the conn info `bnc_conn_info_load` unwrapped for `agent`.
///
/// # Safety
/// `engine` is a live handle; `agent` views live bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn bnc_conn_info_failed(engine: *mut c_void, agent: BncStr) {
    guard_void("bnc_conn_info_failed", || {
        // SAFETY: caller contract.
        if let (Some(e), Ok(a)) = unsafe { (engine_ref(engine), text(agent, "agent name")) } {
            e.conn_info_failed(a);
        }
    });
}

/// A NIXL meta descriptor (`bnc_meta_desc`): the shim hands NIXL's own lists over, asserting
/// at compile time that NIXL's meta descriptor has this layout.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct BncMetaDesc {
    addr: u64,
    len: u64,
    dev: u64,
    md: *const c_void,
}

// `descs` reads NIXL's descriptors as `DescView`s in place: the two must be laid out alike.
const _: () = {
    use std::mem::{align_of, offset_of, size_of};
    assert!(size_of::<BncMetaDesc>() == size_of::<DescView>());
    assert!(align_of::<BncMetaDesc>() == align_of::<DescView>());
    assert!(offset_of!(BncMetaDesc, addr) == offset_of!(DescView, addr));
    assert!(offset_of!(BncMetaDesc, len) == offset_of!(DescView, len));
    assert!(offset_of!(BncMetaDesc, dev) == offset_of!(DescView, dev));
    assert!(offset_of!(BncMetaDesc, md) == offset_of!(DescView, md));
    assert!(size_of::<*const c_void>() == size_of::<Md>());
    // And both to the layout the C header declares (the shim asserts `bnc_meta_desc` against
    // the same numbers), so the chain NIXL -> header -> Rust has no link kept by hand.
    #[cfg(target_pointer_width = "64")]
    assert!(
        size_of::<BncMetaDesc>() == 32
            && offset_of!(BncMetaDesc, addr) == 0
            && offset_of!(BncMetaDesc, len) == 8
            && offset_of!(BncMetaDesc, dev) == 16
            && offset_of!(BncMetaDesc, md) == 24
    );
};

/// NIXL's descriptor list, read in place: a copy of each list (8192 descriptors, 256 KiB) was
/// fresh memory at every prep, and its page faults were a tenth of a prep's time (issue 13,
/// vLLM's connector preps every request); the shim's own copy cost another 25 us.
///
/// # Safety
/// `p` is null with `n == 0`, or points at `n` live descriptors that stay unchanged for `'a`.
unsafe fn descs<'a>(p: *const BncMetaDesc, n: usize) -> &'a [DescView] {
    if p.is_null() || n == 0 {
        return &[];
    }
    // SAFETY: the caller's `n` descriptors live for 'a. `DescView` is `repr(C)` with the same
    // size, alignment and field offsets as `BncMetaDesc` (asserted above at compile time); its
    // fields are integers (`Md` is a transparent `usize`, the width of the pointer it takes the
    // place of), for which every bit pattern is valid, and the pointer is only ever handed back
    // to the shim as the integer it was.
    unsafe { std::slice::from_raw_parts(p.cast::<DescView>(), n) }
}

/// Routing decision for a request: `*xfer` = our handle (bounce) or 0 (delegate to UCX).
///
/// # Safety
/// `engine` is a live handle; `local`/`remote` are null with a count of 0, or point at
/// `n_local`/`n_remote` descriptors, 8-aligned, laid out as `bnc_meta_desc`, and unchanged
/// until the call returns (they are read in place, `descs`; nothing keeps a pointer into
/// them afterwards); `agent` views live bytes; `xfer` is writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn bnc_xfer_prep(
    engine: *mut c_void,
    op: i32,
    local: *const BncMetaDesc,
    n_local: usize,
    local_mem: i32,
    remote: *const BncMetaDesc,
    n_remote: usize,
    remote_mem: i32,
    agent: BncStr,
    xfer: *mut u64,
) -> i32 {
    guard("bnc_xfer_prep", || {
        if xfer.is_null() {
            return Status::ErrInvalidParam;
        }
        // SAFETY: caller contract.
        unsafe { *xfer = 0 };
        // SAFETY: caller contract.
        let Some(e) = (unsafe { engine_ref(engine) }) else { return Status::ErrInvalidParam };
        // SAFETY: caller contract.
        let Ok(agent) = (unsafe { text(agent, "agent name") }) else {
            // Never bounced to (see `non_utf8_name`): UCX prepares it (`*xfer` stays 0).
            non_utf8_name("prepXfer");
            e.prep_for_unkept_peer();
            return Status::Success;
        };
        // SAFETY: caller contract.
        let (l, r) = unsafe { (descs(local, n_local), descs(remote, n_remote)) };
        let (op, local_mem, remote_mem) =
            (XferOp::from_code(op), MemSeg::from_code(local_mem), MemSeg::from_code(remote_mem));
        if let Some(h) = e.prep(op, l, local_mem, r, remote_mem, agent) {
            // SAFETY: checked non-null above.
            unsafe { *xfer = h };
        }
        Status::Success
    })
    .code()
}

/// Posts a bounce request.
///
/// # Safety
/// `engine` is a live handle; `notif` views live bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn bnc_xfer_post(engine: *mut c_void, xfer: u64, notif: BncStr, has_notif: i32) -> i32 {
    guard("bnc_xfer_post", || {
        // SAFETY: caller contract.
        let Some(e) = (unsafe { engine_ref(engine) }) else { return Status::ErrInvalidParam };
        // SAFETY: caller contract.
        let msg = (has_notif != 0).then(|| unsafe { notif.bytes() }.to_vec());
        match e.post(xfer, msg) {
            Ok(()) => Status::InProg,
            Err(err) => Status::from(&err),
        }
    })
    .code()
}

/// Status of a bounce request.
///
/// # Safety
/// `engine` is a live handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn bnc_xfer_check(engine: *mut c_void, xfer: u64) -> i32 {
    guard("bnc_xfer_check", || {
        // SAFETY: caller contract.
        let Some(e) = (unsafe { engine_ref(engine) }) else { return Status::ErrInvalidParam };
        match e.check(xfer) {
            Ok(Progress::InFlight) => Status::InProg,
            Ok(Progress::Done) => Status::Success,
            Err(err) => Status::from(&err),
        }
    })
    .code()
}

/// Releases a bounce request (cancels it when in flight).
///
/// # Safety
/// `engine` is a live handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn bnc_xfer_release(engine: *mut c_void, xfer: u64) -> i32 {
    guard("bnc_xfer_release", || {
        // SAFETY: caller contract.
        let Some(e) = (unsafe { engine_ref(engine) }) else { return Status::ErrInvalidParam };
        match e.release(xfer) {
            Ok(()) => Status::Success,
            Err(err) => {
                // The shim releases the handle whatever this says (see its releaseReqH).
                tracing::warn!(handle = xfer, error = %err, "release of a request handle this engine does not hold");
                Status::from(&err)
            }
        }
    })
    .code()
}

/// Whether the application's `getNotifs` may pull the inner engine straight into its list
/// (1, or 2 when the bounce path is busy or control frames may wait on the control channel's
/// own socket: then say [`bnc_control_arrived`] after the pull) or
/// must go through [`bnc_notif_take`] (0; also on a bad handle or a panic).
///
/// # Safety
/// `engine` is a live handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn bnc_notif_direct(engine: *mut c_void) -> i32 {
    guard_value("bnc_notif_direct", 0, || {
        // SAFETY: caller contract.
        let Some(e) = (unsafe { engine_ref(engine) }) else { return 0 };
        match e.app_notifs_direct() {
            false => 0,
            true if e.look_after_app_pull() => 2,
            true => 1,
        }
    })
}

/// For a direct pull: 1 when the notification is a BOUNCE control frame, now taken by Rust; 0
/// when it is the application's (also on bad arguments or a panic: it stays in the list), with
/// `*skip` set to how many of its first bytes the application must not see (an escape's).
///
/// # Safety
/// `engine` is a live handle; `agent`/`msg` point at `agent_len`/`msg_len` readable bytes (or
/// are null with length 0); `skip` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn bnc_notif_divert(
    engine: *mut c_void,
    agent: *const u8,
    agent_len: usize,
    msg: *const u8,
    msg_len: usize,
    skip: *mut usize,
) -> i32 {
    guard_value("bnc_notif_divert", 0, || {
        // SAFETY: caller contract.
        let Some(e) = (unsafe { engine_ref(engine) }) else { return 0 };
        // SAFETY: caller contract: both ranges are readable (or null and empty) for the call.
        let (agent, msg) =
            unsafe { (BncStr::from_raw(agent, agent_len).bytes(), BncStr::from_raw(msg, msg_len).bytes()) };
        let (taken, skipped) = match e.divert_notif(agent, msg) {
            Diverted::Control => (1, 0),
            Diverted::App { skip } => (0, skip),
        };
        if !skip.is_null() {
            // SAFETY: caller contract: non-null `skip` is valid for a write.
            unsafe { skip.write(skipped) };
        }
        taken
    })
}

/// 1 when the application notification `msg` must travel escaped and `sink` got it so; 0 when
/// it goes as it is (also on a bad handle or a panic). See `Engine::escape_notif`.
///
/// # Safety
/// `engine` is a live handle; `msg` views live bytes; `sink`/`ctx` form a valid sink.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn bnc_notif_escape(engine: *mut c_void, msg: BncStr, sink: BncSink, ctx: *mut c_void) -> i32 {
    guard_value("bnc_notif_escape", 0, || {
        // SAFETY: caller contract.
        let Some(e) = (unsafe { engine_ref(engine) }) else { return 0 };
        // SAFETY: caller contract.
        match e.escape_notif(unsafe { msg.bytes() }) {
            Some(escaped) => {
                give(sink, ctx, &escaped);
                1
            }
            None => 0,
        }
    })
}

/// After a direct pull that diverted control frames, or that [`bnc_notif_direct`] answered 2
/// for (the inner engine's lock released): the calling thread runs a reactor pass, or wakes
/// the reactor (`Engine::after_app_pull`).
///
/// # Safety
/// `engine` is a live handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn bnc_control_arrived(engine: *mut c_void) {
    guard_void("bnc_control_arrived", || {
        // SAFETY: caller contract.
        if let Some(e) = unsafe { engine_ref(engine) } {
            let _ = e.after_app_pull();
        }
    });
}

/// Pulls what waits in the inner engine (control frames go to the reactor) and hands the
/// application's notifications to `sink`, in arrival order. Returns the inner engine's status
/// when pulling failed.
///
/// # Safety
/// `engine` is a live handle; `sink`/`ctx` form a valid pair sink.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn bnc_notif_take(engine: *mut c_void, sink: BncPairSink, ctx: *mut c_void) -> i32 {
    guard("bnc_notif_take", || {
        // SAFETY: caller contract.
        let Some(e) = (unsafe { engine_ref(engine) }) else { return Status::ErrInvalidParam };
        let Some(sink) = sink else { return Status::ErrInvalidParam };
        match e.take_notifs() {
            Ok(notifs) => {
                for n in notifs {
                    // SAFETY: the sink copies both byte ranges, which are live for the call.
                    unsafe { sink(ctx, n.agent.as_ptr(), n.agent.len(), n.msg.as_ptr(), n.msg.len()) };
                }
                Status::Success
            }
            Err(err) => Status::from(&err),
        }
    })
    .code()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shims_descriptors_are_read_in_place_field_for_field() {
        let target = 7u8;
        let md = (&raw const target).cast::<c_void>();
        let raw = [
            BncMetaDesc { addr: 0x1000, len: 64, dev: 0, md },
            BncMetaDesc { addr: u64::MAX - 1, len: 1, dev: 3, md: std::ptr::null() },
        ];
        // SAFETY: `raw` holds two live descriptors for the whole test.
        let views = unsafe { descs(raw.as_ptr(), raw.len()) };
        assert_eq!(views.len(), 2);
        assert_eq!((views[0].addr, views[0].len, views[0].dev, views[0].md), (0x1000, 64, 0, Md(md as usize)));
        assert_eq!((views[1].addr, views[1].len, views[1].dev, views[1].md), (u64::MAX - 1, 1, 3, Md(0)));
        // SAFETY: null with zero descriptors is the empty list.
        assert!(unsafe { descs(std::ptr::null(), 0) }.is_empty());
    }
}
