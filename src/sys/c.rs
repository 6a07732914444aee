//! The plain C types of `cpp/include/bounce_ffi.h` that travel in both directions: borrowed
//! byte views and the C++ sinks Rust hands bytes to. Rust never builds or frees a C++ object.

use std::ffi::c_void;

/// Borrowed bytes (`bnc_str`), not NUL-terminated.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct BncStr {
    ptr: *const u8,
    len: usize,
}

impl BncStr {
    /// A view of static bytes.
    pub(crate) fn from_static(s: &'static [u8]) -> Self {
        Self { ptr: s.as_ptr(), len: s.len() }
    }

    /// A view of `b`, valid only while `b` is (the callee must not keep it).
    pub(crate) fn from_bytes(b: &[u8]) -> Self {
        Self { ptr: b.as_ptr(), len: b.len() }
    }

    /// A view of `len` bytes at `ptr` (as C++ handed them over).
    pub(crate) fn from_raw(ptr: *const u8, len: usize) -> Self {
        Self { ptr, len }
    }

    /// The viewed bytes.
    ///
    /// # Safety
    /// - `ptr` is null with `len == 0`, or valid for reads of `len` bytes for `'a`.
    pub(crate) unsafe fn bytes<'a>(self) -> &'a [u8] {
        if self.ptr.is_null() || self.len == 0 {
            return &[];
        }
        // SAFETY: the caller guarantees ptr/len describe live bytes for 'a.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

/// C++ byte sink (`bnc_sink`): copies `[ptr, ptr + len)` into whatever `ctx` points at.
/// `Option`: a function pointer from C may be null, and a plain `fn` type would make a null
/// undefined behaviour before any check (the same ABI as the nullable C pointer).
pub type BncSink = Option<unsafe extern "C" fn(ctx: *mut c_void, ptr: *const u8, len: usize)>;

/// C++ pair sink (`bnc_pair_sink`): copies two byte ranges (agent, message); nullable as
/// [`BncSink`].
pub type BncPairSink = Option<unsafe extern "C" fn(*mut c_void, *const u8, usize, *const u8, usize)>;

/// Hands `bytes` to a C++ sink.
///
/// # Safety
/// `sink`/`ctx` form a valid sink: `sink` copies exactly `len` bytes from `ptr` into `ctx`'s
/// object, which is alive for this call.
pub(crate) unsafe fn sink_bytes(sink: BncSink, ctx: *mut c_void, bytes: &[u8]) {
    let Some(sink) = sink else { return };
    // SAFETY: forwarded contract; `bytes` is live for the call.
    unsafe { sink(ctx, bytes.as_ptr(), bytes.len()) }
}
