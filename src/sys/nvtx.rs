//! NVTX ranges for Nsight Systems, loaded at run time: with `NIXL_BOUNCE_NVTX=1` every span the
//! engine enters (a control frame's handling, a submit, a write's post, a copy launch, a CPU
//! gather or scatter) is also an NVTX range, so the pipeline shows on the CPU rows of a
//! `nsys profile` timeline next to the GPU's kernels and copies.
//!
//! Nothing links against NVTX: `libnvToolsExt.so.1` (CUDA 12 toolkits) or CUDA 13's
//! `libnvtx3interop.so.1` is opened with `libloading` when the option is on, or the file named
//! by `NIXL_BOUNCE_NVTX_LIB`. Without it, one log line says so and nothing else changes. Under
//! `nsys` the library forwards to the profiler's injection; without a profiler its calls are
//! no-ops of a few nanoseconds.

use std::collections::HashMap;
use std::ffi::{CString, c_char, c_int};

use parking_lot::Mutex;
use tracing::span::Id;
use tracing::{Subscriber, span};
use tracing_subscriber::Layer;
use tracing_subscriber::layer::Context;
use tracing_subscriber::registry::LookupSpan;

/// `nvtxRangePushA`: opens a nested range named by a NUL-terminated string on this thread.
type PushFn = unsafe extern "C" fn(*const c_char) -> c_int;
/// `nvtxRangePop`: closes this thread's innermost range.
type PopFn = unsafe extern "C" fn() -> c_int;

/// The library names tried in order when `NIXL_BOUNCE_NVTX_LIB` is unset: the classic NVTX
/// library (CUDA 12 toolkits), then CUDA 13's `libnvtx3interop`, which exports the same entry
/// points over NVTX 3 (found in CUDA 13's `targets/<arch>/lib` and in PyPI's `nvidia/cu13/lib`,
/// the latter already loaded in a process that imported PyTorch).
const LIBRARIES: &[&str] = &["libnvToolsExt.so.1", "libnvtx3interop.so.1", "libnvToolsExt.so", "libnvtx3interop.so"];

/// The two NVTX entry points, and the library that keeps them valid.
pub struct Nvtx {
    push: PushFn,
    pop: PopFn,
    /// Held so that `push` and `pop` stay mapped; `None` for test doubles.
    _lib: Option<libloading::Library>,
}

impl Nvtx {
    /// Opens NVTX from `path`, or from the usual library names.
    ///
    /// # Errors
    /// The loader's message when no library opens or lacks either symbol.
    pub fn load(path: Option<&str>) -> Result<Self, String> {
        let names: Vec<&str> = path.map_or_else(|| LIBRARIES.to_vec(), |p| vec![p]);
        let mut errors = Vec::new();
        for name in names {
            // SAFETY: loading runs the library's initializers; NVTX's only set up its
            // injection hooks (and load the profiler's, when one is attached).
            let lib = match unsafe { libloading::Library::new(name) } {
                Ok(lib) => lib,
                Err(e) => {
                    errors.push(format!("{name}: {e}"));
                    continue;
                }
            };
            // SAFETY: the NVTX C API declares these symbols with exactly these signatures;
            // the pointers are used only while `lib` is held (it lives in the returned value).
            let symbols = unsafe {
                lib.get::<PushFn>(b"nvtxRangePushA\0")
                    .and_then(|push| Ok((*push, *lib.get::<PopFn>(b"nvtxRangePop\0")?)))
            };
            match symbols {
                Ok((push, pop)) => return Ok(Self { push, pop, _lib: Some(lib) }),
                Err(e) => errors.push(format!("{name}: {e}")),
            }
        }
        Err(errors.join("; "))
    }
}

/// A `tracing` layer that opens an NVTX range when a span is entered and closes it on exit.
/// Spans are entered and exited on one thread, in nested order, which is what NVTX's
/// push/pop ranges need.
pub struct NvtxLayer {
    nvtx: Nvtx,
    /// Span names as C strings, made once each (there are a handful).
    names: Mutex<HashMap<&'static str, CString>>,
}

impl NvtxLayer {
    /// A layer over loaded NVTX entry points.
    pub fn new(nvtx: Nvtx) -> Self {
        Self { nvtx, names: Mutex::new(HashMap::new()) }
    }
}

impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for NvtxLayer {
    fn on_enter(&self, id: &Id, ctx: Context<'_, S>) {
        let Some(span) = ctx.span(id) else { return };
        let name = span.metadata().name();
        let mut names = self.names.lock();
        // A span name with a NUL inside cannot be a C string: it gets a placeholder, so that
        // the pop on exit still has its push.
        let c = names.entry(name).or_insert_with(|| CString::new(name).unwrap_or_else(|_| c"span".into()));
        // SAFETY: `c` is a valid NUL-terminated string for the duration of the call (NVTX
        // copies what it keeps); `push` is a live NVTX entry point (see `Nvtx`).
        unsafe { (self.nvtx.push)(c.as_ptr()) };
    }

    fn on_exit(&self, _id: &Id, _ctx: Context<'_, S>) {
        // SAFETY: a live NVTX entry point; every exit follows its span's enter on this thread.
        unsafe { (self.nvtx.pop)() };
    }

    fn on_new_span(&self, _attrs: &span::Attributes<'_>, _id: &Id, _ctx: Context<'_, S>) {}
}

#[cfg(test)]
mod tests {
    use std::ffi::CStr;
    use std::sync::atomic::{AtomicI32, Ordering};

    use tracing_subscriber::layer::SubscriberExt;

    use super::*;

    static DEPTH: AtomicI32 = AtomicI32::new(0);
    static PUSHES: Mutex<Vec<String>> = Mutex::new(Vec::new());

    unsafe extern "C" fn fake_push(name: *const c_char) -> c_int {
        // SAFETY: the layer passes a valid C string.
        PUSHES.lock().push(unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned());
        DEPTH.fetch_add(1, Ordering::SeqCst)
    }

    unsafe extern "C" fn fake_pop() -> c_int {
        DEPTH.fetch_sub(1, Ordering::SeqCst)
    }

    /// Every entered span is one range named after it, nested as the spans are, and every
    /// range is closed.
    #[test]
    fn spans_become_balanced_nested_ranges_named_after_them() {
        let nvtx = Nvtx { push: fake_push, pop: fake_pop, _lib: None };
        let subscriber = tracing_subscriber::registry().with(NvtxLayer::new(nvtx));
        tracing::subscriber::with_default(subscriber, || {
            let outer = tracing::trace_span!("control", len = 68);
            let _o = outer.enter();
            assert_eq!(DEPTH.load(Ordering::SeqCst), 1);
            for _ in 0..2 {
                let _i = tracing::trace_span!("cuda_launch").entered();
                assert_eq!(DEPTH.load(Ordering::SeqCst), 2);
            }
        });
        assert_eq!(DEPTH.load(Ordering::SeqCst), 0);
        assert_eq!(*PUSHES.lock(), ["control", "cuda_launch", "cuda_launch"]);
    }

    /// Without the library, loading says why and nothing panics.
    #[test]
    fn a_missing_library_is_an_error_naming_it() {
        let err = Nvtx::load(Some("/nonexistent/libnvToolsExt.so.1")).err().expect("no such file");
        assert!(err.contains("/nonexistent/libnvToolsExt.so.1"), "{err}");
    }
}
