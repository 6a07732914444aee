//! Safe wrappers over the C++ shim's `bnc_shim_*` functions: Rust's handle on the inner UCX
//! engine (register memory, post one-descriptor writes and poll them, send and pull
//! notifications). Raw pointers and raw status codes stay in this file.

use std::ffi::c_void;
use std::ptr::NonNull;

use super::c::{BncPairSink, BncSink, BncStr};
use super::nixl::{MemSeg, NixlStatus};

unsafe extern "C" {
    fn bnc_shim_register(
        shim: *mut c_void,
        addr: u64,
        len: u64,
        dev: u64,
        mem: i32,
        md: *mut *mut c_void,
        key: BncSink,
        key_ctx: *mut c_void,
    ) -> i32;
    fn bnc_shim_deregister(shim: *mut c_void, md: *mut c_void) -> i32;
    fn bnc_shim_unload_md(shim: *mut c_void, md: *mut c_void) -> i32;
    fn bnc_shim_conn_info(shim: *mut c_void, out: BncSink, ctx: *mut c_void) -> i32;
    fn bnc_shim_write(
        shim: *mut c_void,
        agent: BncStr,
        lmem: i32,
        rmem: i32,
        local_md: *mut c_void,
        laddr: u64,
        ldev: u64,
        remote_md: *mut c_void,
        raddr: u64,
        rdev: u64,
        len: u64,
        handle: *mut *mut c_void,
    ) -> i32;
    fn bnc_shim_read(
        shim: *mut c_void,
        agent: BncStr,
        lmem: i32,
        rmem: i32,
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
    fn bnc_shim_poll_notifs(shim: *mut c_void, sink: BncPairSink, ctx: *mut c_void) -> i32;
    fn bnc_shim_try_poll_notifs(shim: *mut c_void, sink: BncPairSink, ctx: *mut c_void, polled: *mut i32) -> i32;
}

/// Appends the bytes the shim hands us to the `Vec<u8>` behind `ctx`.
///
/// # Safety
/// `ctx` is a live `*mut Vec<u8>` and `ptr`/`len` describe readable bytes (or len is 0).
unsafe extern "C" fn vec_sink(ctx: *mut c_void, ptr: *const u8, len: usize) {
    // Called from C++: a panic (capacity overflow) must not unwind into it; the bytes are then
    // missing, which the caller sees as a short or empty answer.
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // SAFETY: per the contract ctx is the &mut Vec<u8> we passed for this call.
        let v = unsafe { &mut *ctx.cast::<Vec<u8>>() };
        if len > 0 && !ptr.is_null() {
            // SAFETY: the shim passes a std::string's data()/size(), live for the call.
            v.extend_from_slice(unsafe { std::slice::from_raw_parts(ptr, len) });
        }
    }));
}

/// Appends one (agent, message) pair to the `Vec<Notif>` behind `ctx`.
///
/// # Safety
/// `ctx` is a live `*mut Vec<Notif>`; each pointer/length pair describes readable bytes (or its
/// length is 0).
unsafe extern "C" fn notif_sink(ctx: *mut c_void, a: *const u8, al: usize, m: *const u8, ml: usize) {
    // Called from C++: as vec_sink, no panic unwinds into it.
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // SAFETY: per the contract ctx is the &mut Vec<Notif> we passed for this call.
        let v = unsafe { &mut *ctx.cast::<Vec<Notif>>() };
        // SAFETY: the shim passes two std::strings' data()/size(), live for the call.
        let (agent, msg) = unsafe { (BncStr::from_raw(a, al).bytes(), BncStr::from_raw(m, ml).bytes()) };
        v.push(Notif { agent: agent.to_vec(), msg: msg.to_vec() });
    }));
}

/// One notification pulled from the inner engine: who sent it and what it says. The caller
/// tells control frames from the application's own messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Notif {
    /// The sending agent's name, as the inner engine reports it.
    pub(crate) agent: Vec<u8>,
    /// The message bytes.
    pub(crate) msg: Vec<u8>,
}

/// An inner-engine metadata handle (`nixlBackendMD*`), opaque to Rust: only a key and a value
/// handed back to the shim.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(transparent)]
pub(crate) struct Md(pub(crate) usize);

/// A map keyed by inner metadata handles. Fx hashing, not std's SipHash: the keys are this
/// process's own pointers, which no peer picks (nothing to flood), and a registration is
/// looked up by its handle about a dozen times between its register and its deregister
/// (issue 12: what registering through BOUNCE adds to UCX's).
pub(crate) type MdMap<V> = std::collections::HashMap<Md, V, rustc_hash::FxBuildHasher>;

/// A set of inner metadata handles, hashed as [`MdMap`].
pub(crate) type MdSet = std::collections::HashSet<Md, rustc_hash::FxBuildHasher>;

/// An in-flight inner request (`nixlBackendReqH*`), opaque to Rust; released exactly once
/// (by [`Shim::release`], which consumes it).
#[derive(Debug, PartialEq, Eq, Hash)]
pub(crate) struct WriteHandle(usize);

/// One side of a one-descriptor write: memory kind, registration handle, address, device id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct WriteSide {
    /// Memory segment of the range (a GPU arena writes from VRAM, a host one from DRAM; the
    /// two sides may differ).
    pub(crate) mem: MemSeg,
    /// Inner metadata of the registration the range lies in.
    pub(crate) md: Md,
    /// Address of the first byte.
    pub(crate) addr: u64,
    /// Device id.
    pub(crate) dev: u64,
}

/// What a posted write became.
#[derive(Debug)]
pub(crate) enum WritePosted {
    /// It finished during the post (the handle is already released).
    Done,
    /// It is in flight: poll it with [`Shim::check`], then [`Shim::release`] it.
    InFlight(WriteHandle),
}

/// Where an in-flight write stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WriteState {
    /// Still running.
    InProg,
    /// Visible at the target.
    Done,
    /// Failed with this status.
    Failed(NixlStatus),
}

/// The shim engine (C++ `BounceEngine`), as Rust calls it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Shim(NonNull<c_void>);

// SAFETY: the shim engine and its inner engine outlive every call through this pointer (the
// contract of `Shim::new`): `~BounceEngine` first calls bnc_engine_stop, which joins the reactor
// and copy workers (the only other threads holding a copy) and makes the engine's last shim
// calls (arena deregistration, peer-arena unloads); only then does it destroy the inner engine,
// and the Rust engine after it, which makes no shim call when dropped. Every bnc_shim_* call
// takes the shim's inner-engine lock, so calls from any thread are serialized.
unsafe impl Send for Shim {}
// SAFETY: as above; the pointer itself is never mutated.
unsafe impl Sync for Shim {}

impl Shim {
    /// Wraps the pointer C++ passed to `bnc_engine_attach`; `None` when null.
    ///
    /// # Safety
    /// - `p` is null or a live C++ `BounceEngine` whose `bnc_shim_*` functions may be called
    ///   from any thread for as long as any copy of the returned value is used.
    pub(crate) unsafe fn new(p: *mut c_void) -> Option<Self> {
        NonNull::new(p).map(Self)
    }

    /// Registers `[addr, addr+len)` with the inner engine; returns its metadata handle and
    /// public data (remote key).
    pub(crate) fn register(&self, addr: u64, len: u64, dev: u64, mem: MemSeg) -> Result<(Md, Vec<u8>), NixlStatus> {
        let mut md = std::ptr::null_mut();
        let mut key = Vec::new();
        // SAFETY: shim is live (type invariant); md and key outlive the call; vec_sink matches
        // the sink contract for &mut Vec<u8>.
        let st = unsafe {
            bnc_shim_register(
                self.0.as_ptr(),
                addr,
                len,
                dev,
                mem.code(),
                &mut md,
                Some(vec_sink),
                (&raw mut key).cast(),
            )
        };
        NixlStatus::from_code(st).ok()?;
        if md.is_null() {
            return Err(NixlStatus::ErrBackend);
        }
        Ok((Md(md as usize), key))
    }

    /// Deregisters a handle from [`Self::register`].
    pub(crate) fn deregister(&self, md: Md) -> Result<(), NixlStatus> {
        // SAFETY: shim is live; md came from register and is deregistered once.
        NixlStatus::from_code(unsafe { bnc_shim_deregister(self.0.as_ptr(), md.0 as *mut c_void) }).ok()
    }

    /// Unloads remote metadata the shim loaded through the inner engine (a peer's arena).
    pub(crate) fn unload(&self, md: Md) -> Result<(), NixlStatus> {
        // SAFETY: shim is live; md came from the inner engine's loadRemoteMD (loadPeerArena),
        // is unloaded once (the peer table hands each handle out once) and no write uses it.
        NixlStatus::from_code(unsafe { bnc_shim_unload_md(self.0.as_ptr(), md.0 as *mut c_void) }).ok()
    }

    /// The inner engine's own connection info (our reverse-path endpoint).
    pub(crate) fn conn_info(&self) -> Result<Vec<u8>, NixlStatus> {
        let mut out = Vec::new();
        // SAFETY: shim is live; out outlives the call; vec_sink matches &mut Vec<u8>.
        let st = unsafe { bnc_shim_conn_info(self.0.as_ptr(), Some(vec_sink), (&raw mut out).cast()) };
        NixlStatus::from_code(st).ok().map(|()| out)
    }

    /// Posts one write of `len` bytes from `local` to `remote` at `agent`.
    pub(crate) fn write(
        &self,
        agent: &str,
        local: WriteSide,
        remote: WriteSide,
        len: u64,
    ) -> Result<WritePosted, NixlStatus> {
        self.post(bnc_shim_write, agent, local, remote, len)
    }

    /// Posts one READ of `len` bytes of `remote` at `agent` into `local` (a one-way initiator's
    /// fetch of the peer's mailbox into its own arena). Completes like a write.
    pub(crate) fn read(
        &self,
        agent: &str,
        local: WriteSide,
        remote: WriteSide,
        len: u64,
    ) -> Result<WritePosted, NixlStatus> {
        self.post(bnc_shim_read, agent, local, remote, len)
    }

    fn post(
        &self,
        entry: unsafe extern "C" fn(
            *mut c_void,
            BncStr,
            i32,
            i32,
            *mut c_void,
            u64,
            u64,
            *mut c_void,
            u64,
            u64,
            u64,
            *mut *mut c_void,
        ) -> i32,
        agent: &str,
        local: WriteSide,
        remote: WriteSide,
        len: u64,
    ) -> Result<WritePosted, NixlStatus> {
        let mut h = std::ptr::null_mut();
        // SAFETY: `entry` is bnc_shim_write or bnc_shim_read, which share this signature; shim
        // is live; the metadata handles came from register/loadRemoteMD of this engine and stay
        // valid for the transfer: the arena is deregistered only after the reactor (which posts
        // every write and read) is joined, and a peer arena is unloaded only once no transfer
        // in flight uses it (the reactor retires it); the agent view is live for the call.
        let st = unsafe {
            entry(
                self.0.as_ptr(),
                BncStr::from_bytes(agent.as_bytes()),
                local.mem.code(),
                remote.mem.code(),
                local.md.0 as *mut c_void,
                local.addr,
                local.dev,
                remote.md.0 as *mut c_void,
                remote.addr,
                remote.dev,
                len,
                &mut h,
            )
        };
        if st < 0 || h.is_null() {
            return Err(NixlStatus::from_code(st));
        }
        let handle = WriteHandle(h as usize);
        match NixlStatus::from_code(st) {
            NixlStatus::Success => {
                self.release(handle);
                Ok(WritePosted::Done)
            }
            _ => Ok(WritePosted::InFlight(handle)),
        }
    }

    /// Polls a write.
    pub(crate) fn check(&self, h: &WriteHandle) -> WriteState {
        // SAFETY: shim is live; h is an unreleased handle from write.
        match NixlStatus::from_code(unsafe { bnc_shim_check(self.0.as_ptr(), h.0 as *mut c_void) }) {
            NixlStatus::InProg => WriteState::InProg,
            NixlStatus::Success => WriteState::Done,
            st => WriteState::Failed(st),
        }
    }

    /// Releases a write handle (consumes it: exactly once).
    pub(crate) fn release(&self, h: WriteHandle) {
        // SAFETY: shim is live; h is an unreleased handle from write, consumed here.
        unsafe { bnc_shim_release(self.0.as_ptr(), h.0 as *mut c_void) }
    }

    /// Sends a notification through the inner engine.
    pub(crate) fn gen_notif(&self, agent: &str, msg: &[u8]) -> Result<(), NixlStatus> {
        // SAFETY: shim is live; both views are live for the call.
        let st = unsafe {
            bnc_shim_gen_notif(self.0.as_ptr(), BncStr::from_bytes(agent.as_bytes()), BncStr::from_bytes(msg))
        };
        NixlStatus::from_code(st).ok()
    }

    /// Progresses the inner engine and appends every notification that arrived to `out`, in
    /// arrival order. Nothing is routed back into Rust: the caller decides what each one is.
    pub(crate) fn poll_notifs(&self, out: &mut Vec<Notif>) -> Result<(), NixlStatus> {
        // SAFETY: shim is live; `out` outlives the call; notif_sink matches &mut Vec<Notif>.
        let st = unsafe { bnc_shim_poll_notifs(self.0.as_ptr(), Some(notif_sink), (out as *mut Vec<Notif>).cast()) };
        NixlStatus::from_code(st).ok()
    }

    /// As [`Self::poll_notifs`], unless another thread holds the inner engine's lock: then
    /// returns `Ok(false)` at once, having pulled nothing.
    pub(crate) fn try_poll_notifs(&self, out: &mut Vec<Notif>) -> Result<bool, NixlStatus> {
        let mut polled = 0i32;
        // SAFETY: as poll_notifs; `polled` outlives the call.
        let st = unsafe {
            bnc_shim_try_poll_notifs(
                self.0.as_ptr(),
                Some(notif_sink),
                (out as *mut Vec<Notif>).cast(),
                &raw mut polled,
            )
        };
        NixlStatus::from_code(st).ok().map(|()| polled == 1)
    }
}
