//! Safe wrappers over the C++ shim's `bnc_shim_*` functions: the bounce reactor's handle on the
//! inner UCX engine (register the arena, post one-descriptor writes, poll them, send and poll
//! notifications). Raw pointers stay in this file.

use std::ffi::c_void;
use std::ptr::NonNull;

use super::abi::BncStr;

unsafe extern "C" {
    fn bnc_shim_register(
        shim: *mut c_void,
        addr: u64,
        len: u64,
        dev: u64,
        mem: i32,
        md: *mut *mut c_void,
        key: unsafe extern "C" fn(*mut c_void, *const u8, usize),
        key_ctx: *mut c_void,
    ) -> i32;
    fn bnc_shim_deregister(shim: *mut c_void, md: *mut c_void) -> i32;
    fn bnc_shim_conn_info(
        shim: *mut c_void,
        out: unsafe extern "C" fn(*mut c_void, *const u8, usize),
        ctx: *mut c_void,
    ) -> i32;
    fn bnc_shim_write(
        shim: *mut c_void,
        agent: BncStr,
        mem: i32,
        local_md: *mut c_void,
        laddr: u64,
        ldev: u64,
        remote_md: *mut c_void,
        raddr: u64,
        rdev: u64,
        len: u64,
        handle: *mut *mut c_void,
    ) -> i32;
    fn bnc_shim_check(shim: *mut c_void, handle: *mut c_void) -> i32;
    fn bnc_shim_release(shim: *mut c_void, handle: *mut c_void);
    fn bnc_shim_gen_notif(shim: *mut c_void, agent: BncStr, msg: BncStr) -> i32;
    fn bnc_shim_poll_notifs(shim: *mut c_void) -> i32;
}

/// Appends the bytes the shim hands us to the `Vec<u8>` behind `ctx`.
///
/// # Safety
/// `ctx` is a live `*mut Vec<u8>` and `ptr`/`len` describe readable bytes (or len is 0).
unsafe extern "C" fn vec_sink(ctx: *mut c_void, ptr: *const u8, len: usize) {
    // SAFETY: per the contract ctx is the &mut Vec<u8> we passed for this call.
    let v = unsafe { &mut *ctx.cast::<Vec<u8>>() };
    if len > 0 && !ptr.is_null() {
        // SAFETY: the shim passes a std::string's data()/size(), live for the call.
        v.extend_from_slice(unsafe { std::slice::from_raw_parts(ptr, len) });
    }
}

/// An inner-engine metadata handle (`nixlBackendMD*`), opaque to Rust.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Md(pub usize);

/// An in-flight inner request (`nixlBackendReqH*`), opaque to Rust; release it exactly once.
#[derive(Debug, PartialEq, Eq, Hash)]
pub struct WriteHandle(usize);

/// The shim engine, as seen by the reactor.
#[derive(Debug, Clone, Copy)]
pub struct Shim(NonNull<c_void>);

// SAFETY: the shim engine outlives every user of this pointer: C++ destroys the Rust engine
// (which joins the reactor and workers) before it destroys the inner engine or itself, and every
// bnc_shim_* call takes the shim's inner-engine lock, so calls from any thread are serialized.
unsafe impl Send for Shim {}
// SAFETY: as above; the pointer itself is never mutated.
unsafe impl Sync for Shim {}

fn s(b: &[u8]) -> BncStr {
    BncStr::from_bytes(b)
}

impl Shim {
    /// Wraps the pointer C++ passed to `bnc_engine_attach`; `None` when null.
    pub fn new(p: *mut c_void) -> Option<Self> {
        NonNull::new(p).map(Self)
    }

    /// Registers `[addr, addr+len)` with the inner engine; returns its metadata handle and
    /// public data (remote key).
    pub fn register(&self, addr: u64, len: u64, dev: u64, mem: i32) -> Result<(Md, Vec<u8>), i32> {
        let mut md = std::ptr::null_mut();
        let mut key = Vec::new();
        // SAFETY: shim is live (type invariant); md and key outlive the call; vec_sink matches
        // the sink contract for &mut Vec<u8>.
        let st = unsafe {
            bnc_shim_register(self.0.as_ptr(), addr, len, dev, mem, &mut md, vec_sink, (&raw mut key).cast())
        };
        if st == 0 && !md.is_null() { Ok((Md(md as usize), key)) } else { Err(st) }
    }

    /// Deregisters a handle from [`Self::register`].
    pub fn deregister(&self, md: Md) -> i32 {
        // SAFETY: shim is live; md came from register and is deregistered once.
        unsafe { bnc_shim_deregister(self.0.as_ptr(), md.0 as *mut c_void) }
    }

    /// The inner engine's own connection info (our reverse-path endpoint).
    pub fn conn_info(&self) -> Result<Vec<u8>, i32> {
        let mut out = Vec::new();
        // SAFETY: shim is live; out outlives the call.
        let st = unsafe { bnc_shim_conn_info(self.0.as_ptr(), vec_sink, (&raw mut out).cast()) };
        if st == 0 { Ok(out) } else { Err(st) }
    }

    /// Posts one write of `len` bytes from our arena to the peer's; returns the post status
    /// (`IN_PROG` or `SUCCESS`) and the handle to poll and release.
    #[allow(clippy::too_many_arguments)] // reason: mirrors the one-descriptor C signature
    pub fn write(
        &self,
        agent: &str,
        mem: i32,
        local: (Md, u64, u64),
        remote: (Md, u64, u64),
        len: u64,
    ) -> Result<(i32, WriteHandle), i32> {
        let mut h = std::ptr::null_mut();
        // SAFETY: shim is live; the metadata handles came from register/loadRemoteMD of this
        // engine and stay valid while the arena / peer entry lives (the reactor owns both).
        let st = unsafe {
            bnc_shim_write(
                self.0.as_ptr(),
                s(agent.as_bytes()),
                mem,
                local.0.0 as *mut c_void,
                local.1,
                local.2,
                remote.0.0 as *mut c_void,
                remote.1,
                remote.2,
                len,
                &mut h,
            )
        };
        if st >= 0 && !h.is_null() { Ok((st, WriteHandle(h as usize))) } else { Err(st) }
    }

    /// Polls a write: `IN_PROG`, `SUCCESS` or an error status.
    pub fn check(&self, h: &WriteHandle) -> i32 {
        // SAFETY: shim is live; h is an unreleased handle from write.
        unsafe { bnc_shim_check(self.0.as_ptr(), h.0 as *mut c_void) }
    }

    /// Releases a write handle (consumes it: exactly once).
    pub fn release(&self, h: WriteHandle) {
        // SAFETY: shim is live; h is an unreleased handle from write, consumed here.
        unsafe { bnc_shim_release(self.0.as_ptr(), h.0 as *mut c_void) }
    }

    /// Sends a notification through the inner engine.
    pub fn gen_notif(&self, agent: &str, msg: &[u8]) -> i32 {
        // SAFETY: shim is live; views are live for the call.
        unsafe { bnc_shim_gen_notif(self.0.as_ptr(), s(agent.as_bytes()), s(msg)) }
    }

    /// Progresses the inner engine and routes what arrived through `bnc_notif_route`.
    pub fn poll_notifs(&self) -> i32 {
        // SAFETY: shim is live.
        unsafe { bnc_shim_poll_notifs(self.0.as_ptr()) }
    }
}
