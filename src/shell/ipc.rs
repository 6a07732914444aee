//! The same-host path (`bounce_cuda_ipc`): a GPU transfer between two processes of one host is
//! copied by one kernel launch, from the sources straight to the destinations, through this
//! process's CUDA IPC mapping of the peer's registrations. No staging, no credit, no control
//! frame, and no work in the peer's process.
//!
//! Why: on one host the bounce path pays for what the hardware does not need. Measured on one
//! H200 with two processes (BENCHMARKS.md, session 8): a bounced 16384 x 4 KiB WRITE spends its
//! GPU time in a gather, a write and a scatter of ~20 us each, but the work queued by one
//! process started 100-150 us after its launch whenever the other process had used the GPU
//! last, and a bounced transfer switches processes twice (the target scatters, the initiator
//! gathers the next). The peer's memory mapped here needs neither.
//!
//! Trust: the peer gives its handles only in the registration metadata it publishes (the same
//! envelope as its keys), and a handle names an allocation the peer exported; every piece is
//! checked to lie inside the registration its descriptor names, and the registration inside
//! the allocation as the driver mapped it (not as the peer claims), before anything is
//! launched. A peer can do no more to us this way than through UCX's own cuda_ipc transport,
//! which maps the same allocations from the same handles (and where `UCX_TLS` leaves cuda_ipc
//! out, the configuration turns this path off unless it is asked for by name).
//!
//! Completion: SUCCESS once the kernel's event has completed; the notification, if any, is
//! sent through the inner engine then, so it reaches the peer after the bytes.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use bounce_proto::MemKind;
use bounce_proto::endpoint::XferError;
use bounce_proto::plan::{self, DescPair};
use bounce_proto::wire::IpcRecord;
use parking_lot::{Mutex, RwLock};

use crate::shell::fence::{Ranges, Span};
use crate::shell::keys::LoadStamp;
use crate::shell::registry::Registration;
use crate::shell::stats::Stats;
use crate::shell::{Error, Progress, Result};
use crate::sys::cuda::{self, CudaError, DevicePlan, ExecContext, Gpu, IpcMapping, Kernels, PlanPool};
use crate::sys::shim::Shim;

/// Request handles of this path carry this bit; the bounce path's never do.
pub(crate) const IPC_HANDLE_BIT: u64 = 1 << 62;

/// A request handle of this path names, in these bits, the GPU whose path prepared it (below
/// them a counter; above them the paths' bits, [`IPC_HANDLE_BIT`] and the CMA path's).
const DEV_SHIFT: u32 = 40;
/// GPU ordinals a handle can name: one path per GPU up to this many.
const MAX_GPUS: u64 = 256;

/// Where a request of this path stands.
#[derive(Debug)]
enum State {
    Prepared,
    /// Launched; the context's event completes when the copy has.
    Running(ExecContext, Option<Vec<u8>>),
    Done(std::result::Result<(), XferError>),
}

/// A peer allocation mapped here, counted in `stats.ipc_mappings` while it is open.
#[derive(Debug)]
struct Mapped {
    map: IpcMapping,
    stats: Arc<Stats>,
}

impl Drop for Mapped {
    fn drop(&mut self) {
        // `map` closes right after this.
        self.stats.ipc_mappings.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A prepared request: the kernel plan in VRAM and the mappings it writes through.
#[derive(Debug)]
struct Request {
    peer: String,
    read: bool,
    plan: Arc<DevicePlan>,
    /// Kept open for as long as the request may launch.
    _maps: Vec<Arc<Mapped>>,
    /// Our memory its copies touch.
    local: Ranges,
    /// Part of that memory was deregistered since the prep: no post launches any more.
    revoked: bool,
    /// The loads of the peer's registrations it was prepared from: once one is unloaded
    /// (`remove_remote_agent`), no post launches any more.
    loads: LoadStamp,
    state: State,
}

/// The path for GPU memory on one GPU, `gpu`: its kernels run there, and peers' allocations
/// are mapped into its context.
#[derive(Debug)]
pub(crate) struct IpcPath {
    gpu: Arc<Gpu>,
    /// [`DEV_SHIFT`]'s bits of this path's request handles.
    dev_bits: u64,
    node: [u8; 16],
    kernels: Kernels,
    /// Peer allocations mapped, by handle, until no loaded registration names them (see
    /// [`IpcPath::unmap`]); `None`: the driver refused it (a handle of this very process, say),
    /// not tried again while it stays loaded.
    maps: Mutex<HashMap<[u8; 64], Option<Arc<Mapped>>>>,
    reqs: Mutex<HashMap<u64, Request>>,
    /// Execution contexts not running a request.
    idle: Mutex<Vec<ExecContext>>,
    /// Device buffers for the requests' copy plans, reused from request to request.
    plans: Arc<PlanPool>,
    next: AtomicU64,
    stats: Arc<Stats>,
    /// Running requests with a notification still to send (see [`IpcPath::settle`]), counted
    /// over all the engine's paths ([`IpcPaths::notifying`] is one load on every `getNotifs`).
    notifying: Arc<AtomicUsize>,
}

impl IpcPath {
    /// The path for memory on `gpu`; `None` (with the reason logged) when the host has no
    /// identity to check peers' handles against, the kernels do not load, or the GPU's ordinal
    /// is beyond what a handle can name.
    pub(crate) fn new(gpu: &Arc<Gpu>, stats: Arc<Stats>, notifying: Arc<AtomicUsize>) -> Option<Self> {
        let Some(dev_bits) = u64::try_from(gpu.ordinal()).ok().filter(|&d| d < MAX_GPUS).map(|d| d << DEV_SHIFT) else {
            tracing::warn!(gpu = gpu.ordinal(), "GPU ordinal beyond {MAX_GPUS}: no same-host path for its memory");
            return None;
        };
        let Some(node) = host_identity() else {
            tracing::info!("no host identity (/proc/sys/kernel/random/boot_id): no same-host path");
            return None;
        };
        match Kernels::load(gpu).and_then(|k| Ok((k, PlanPool::new(gpu)?))) {
            Ok((kernels, plans)) => Some(Self {
                gpu: gpu.clone(),
                dev_bits,
                node,
                kernels,
                maps: Mutex::default(),
                reqs: Mutex::default(),
                idle: Mutex::default(),
                plans,
                next: AtomicU64::new(1),
                stats,
                notifying,
            }),
            Err(e) => {
                tracing::warn!(error = %e, "kernels or a plan stream unavailable: no same-host path");
                None
            }
        }
    }

    /// The record to publish with our registration `reg` (GPU memory cuMemAlloc made), or
    /// `None` when it cannot be exported.
    pub(crate) fn export(&self, reg: &Registration) -> Option<IpcRecord> {
        if reg.mem != MemKind::Vram || reg.len == 0 {
            return None;
        }
        let e = match cuda::ipc_export(&self.gpu, reg.addr) {
            Ok(e) => e,
            Err(err) => {
                tracing::debug!(addr = reg.addr, error = %err, "GPU registration not exportable: no same-host path to it");
                return None;
            }
        };
        let alloc_off = reg.addr.checked_sub(e.base)?;
        // The whole registration inside the one allocation: a mapping reaches nothing else.
        (alloc_off.checked_add(reg.len)? <= e.len).then_some(IpcRecord {
            node: self.node,
            handle: e.handle,
            alloc_off,
            addr: reg.addr,
            len: reg.len,
        })
    }

    /// Prepares a transfer of `descs` (sources and destinations as NIXL gave them: ours and
    /// the peer's addresses), `ipc[i]` the record of descriptor i's remote registration.
    /// `None` when the path cannot take it (another host, a piece outside its registration, a
    /// handle the driver refuses): the caller bounces it or hands it to UCX.
    pub(crate) fn prep(
        &self,
        peer: &str,
        descs: &[DescPair],
        ipc: &[(IpcRecord, usize)],
        read: bool,
        loads: LoadStamp,
    ) -> Option<u64> {
        if descs.len() != ipc.iter().map(|(_, n)| n).sum::<usize>() {
            return None;
        }
        let mut maps: Vec<Arc<Mapped>> = Vec::new();
        let mut mapped = Vec::with_capacity(descs.len());
        let mut local = Vec::with_capacity(descs.len());
        let mut at = 0;
        // Runs of descriptors of one record (see `Keys::remote_reach`): mapped once a run.
        for (rec, n) in ipc {
            let m = self.map(rec)?;
            // The peer's claim (where its registration lies in the allocation, and how long
            // it is) must fit what the driver actually mapped.
            if rec.alloc_off.checked_add(rec.len).is_none_or(|end| end > m.map.len()) {
                tracing::warn!(peer, "a peer's IPC record claims more than its allocation: not mapped");
                return None;
            }
            let base = m.map.ptr().checked_add(rec.alloc_off)?;
            if !maps.iter().any(|x| Arc::ptr_eq(x, &m)) {
                maps.push(m);
            }
            for d in &descs[at..at + n] {
                let (ours, remote) = if read { (d.dst, d.src) } else { (d.src, d.dst) };
                local.push((ours, ours.saturating_add(d.len)));
                let local = translate(rec, base, remote, d.len)?;
                mapped.push(if read { DescPair { src: local, ..*d } } else { DescPair { dst: local, ..*d } });
            }
            at += n;
        }
        let runs = match plan::pair_runs(&mapped, true) {
            Ok(r) => r,
            Err(e) => {
                tracing::debug!(peer, error = %e, "cannot plan a same-host copy");
                return None;
            }
        };
        let plan = match self.plans.upload(&runs) {
            Ok(p) => Arc::new(p),
            Err(e) => {
                tracing::warn!(peer, error = %e, "cannot upload a same-host copy plan");
                return None;
            }
        };
        // The counter lives below the GPU's bits: one that reached them would name another
        // GPU's request (review 55; 2^40 preps on one path). No new request from then on:
        // such transfers bounce.
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        if n >= 1 << DEV_SHIFT {
            tracing::warn!(peer, "same-host GPU path out of request handles; transfers bounce");
            return None;
        }
        let h = IPC_HANDLE_BIT | self.dev_bits | n;
        let (local, revoked) = (Ranges::new(local), false);
        let req =
            Request { peer: peer.to_owned(), read, plan, _maps: maps, local, revoked, loads, state: State::Prepared };
        self.reqs.lock().insert(h, req);
        Some(h)
    }

    /// The mapping of `rec`'s allocation, opened at first use; `None` for another host's
    /// record or a handle the driver refuses.
    fn map(&self, rec: &IpcRecord) -> Option<Arc<Mapped>> {
        if rec.node != self.node {
            return None;
        }
        self.maps
            .lock()
            .entry(rec.handle)
            .or_insert_with(|| match IpcMapping::open(&self.gpu, &rec.handle) {
                Ok(map) => {
                    self.stats.ipc_mappings.fetch_add(1, Ordering::Relaxed);
                    Some(Arc::new(Mapped { map, stats: Arc::clone(&self.stats) }))
                }
                Err(e) => {
                    tracing::debug!(error = %e, "peer allocation not mappable here: it keeps the bounce path");
                    None
                }
            })
            .clone()
    }

    /// No loaded registration names the allocation `handle` any more (NIXL unloaded the last
    /// one, as it does when the peer is removed or disconnects): forget its mapping. Requests
    /// prepared through it keep it open until they are released; then it closes, so a
    /// long-lived engine does not keep every departed peer's memory mapped. (A prep racing the
    /// unload of the registration it names may map the allocation again, which then stays
    /// until the engine goes; NIXL forbids using metadata while it is unloaded.)
    pub(crate) fn unmap(&self, handle: &[u8; 64]) {
        self.maps.lock().remove(handle);
    }

    /// Launches request `h`; the notification goes to the peer once the copy is done.
    ///
    /// # Errors
    /// [`Error::UnknownRequest`], [`Error::RepostActive`], `PeerLost` as [`Error::Xfer`] when
    /// `loaded` says a registration of the peer it was prepared from was unloaded since, or
    /// the launch's failure as [`Error::Xfer`] (the request is then done with that error).
    pub(crate) fn post(&self, h: u64, notif: Option<Vec<u8>>, loaded: impl Fn(&LoadStamp) -> bool) -> Result<()> {
        let mut reqs = self.reqs.lock();
        let req = reqs.get_mut(&h).ok_or(Error::UnknownRequest(h))?;
        if matches!(req.state, State::Running(..)) {
            return Err(Error::RepostActive(h));
        }
        if req.revoked {
            req.state = State::Done(Err(XferError::Deregistered));
            return Err(Error::Xfer(XferError::Deregistered));
        }
        // The application unloaded the peer (or reloaded it) since the prep: fails as the bounce
        // path's requests for a lost incarnation do.
        if !loaded(&req.loads) {
            req.state = State::Done(Err(XferError::PeerLost));
            return Err(Error::Xfer(XferError::PeerLost));
        }
        let failed = if req.read { XferError::ReadFailed } else { XferError::WriteFailed };
        let launched = self.context().and_then(|mut ctx| {
            // SAFETY: every piece's source and destination was checked at prep to lie inside a
            // registration: ours (NIXL checked the local descriptors against them) or the
            // peer's, reached through its mapping, which `req` keeps open; the plan in VRAM is
            // kept alive by `req` too, and `release` waits for the launch before dropping
            // either. `ctx` is idle (taken from the pool, which gets contexts back only once
            // their event completed). The "region" base is 0: each run's region offset is its
            // source address (`plan::pair_runs`).
            unsafe { cuda::scatter_planned(&mut ctx, &self.kernels, &req.plan, 0)? };
            ctx.record()?;
            Ok(ctx)
        });
        match launched {
            Ok(ctx) => {
                Stats::bump(&self.stats.ipc_xfers);
                if notif.is_some() {
                    self.notifying.fetch_add(1, Ordering::AcqRel);
                }
                req.state = State::Running(ctx, notif);
                Ok(())
            }
            Err(e) => {
                tracing::warn!(peer = req.peer, error = %e, "same-host copy launch failed");
                req.state = State::Done(Err(failed.clone()));
                Err(Error::Xfer(failed))
            }
        }
    }

    /// An idle execution context, or a new one.
    fn context(&self) -> std::result::Result<ExecContext, CudaError> {
        self.gpu.bind()?;
        match self.idle.lock().pop() {
            Some(c) => Ok(c),
            None => ExecContext::new(&self.gpu, 1),
        }
    }

    /// Where request `h` stands; the first check that finds its copy done sends its
    /// notification through `shim`.
    ///
    /// # Errors
    /// [`Error::UnknownRequest`], [`Error::NotPosted`], the copy's failure as [`Error::Xfer`],
    /// or the notification's as [`Error::Inner`] (the bytes have landed then).
    pub(crate) fn check(&self, h: u64, shim: Option<Shim>) -> Result<Progress> {
        let mut reqs = self.reqs.lock();
        let req = reqs.get_mut(&h).ok_or(Error::UnknownRequest(h))?;
        let done = match &req.state {
            State::Prepared => return Err(Error::NotPosted(h)),
            State::Done(r) => return r.clone().map(|()| Progress::Done).map_err(Error::Xfer),
            State::Running(ctx, _) => match ctx.is_done() {
                Ok(false) => return Ok(Progress::InFlight),
                Ok(true) => Ok(()),
                Err(e) => {
                    // A fault inside the kernel: sticky for the CUDA context, as on the bounce path.
                    tracing::error!(peer = req.peer, error = %e, "same-host copy failed on the device");
                    Err(if req.read { XferError::ReadFailed } else { XferError::WriteFailed })
                }
            },
        };
        let State::Running(ctx, notif) = std::mem::replace(&mut req.state, State::Done(done.clone())) else {
            unreachable!("matched Running above");
        };
        if notif.is_some() {
            self.notifying.fetch_sub(1, Ordering::AcqRel);
        }
        if done.is_ok() {
            self.idle.lock().push(ctx);
        }
        done.map_err(Error::Xfer)?;
        Stats::bump(&self.stats.ipc_ok);
        if let (Some(msg), Some(shim)) = (notif, shim) {
            if let Err(status) = shim.gen_notif(&req.peer, &msg) {
                // Failed for good: a later check must not find it done (the peer's application
                // would wait for the notification for ever).
                req.state = State::Done(Err(XferError::NotifFailed));
                return Err(Error::Inner { op: "genNotif", status });
            }
        }
        Ok(Progress::Done)
    }

    /// Waits until no copy of ours runs into or out of our memory `[addr, addr + len)` on this
    /// GPU: its deregistration returns only then, as the bounce path's does (PyTorch's caching
    /// allocator hands freed memory to the next tensor at once). A request running there
    /// finishes as it would have: it was posted while the memory was registered. Every request
    /// touching it is revoked: a later post fails (`Deregistered`) instead of launching into
    /// memory that may hold another tensor by then.
    fn quiesce(&self, addr: u64, len: u64, kept: &dyn Fn(Span) -> bool) {
        let range = (addr, addr.saturating_add(len));
        for r in self.reqs.lock().values_mut().filter(|r| r.local.loses(range, kept)) {
            r.revoked = true;
            if let State::Running(ctx, _) = &r.state {
                if let Err(e) = ctx.synchronize() {
                    tracing::warn!(error = %e, "waiting for a same-host GPU copy before a deregistration");
                }
            }
        }
    }

    /// Sends the notification of every request whose copy has ended, as [`Self::check`] would
    /// at the application's next status query (failures are kept for that query): UCX sends a
    /// transfer's notification behind its data whether or not the application asks, and an
    /// application that waits for its peer's answer (polling `getNotifs`) without querying
    /// its own request would otherwise wait for ever (as the CMA path's `settle`). An event
    /// is queried from any thread, as `check` queries it from the application's.
    fn settle(&self, shim: Option<Shim>) {
        if self.notifying.load(Ordering::Acquire) == 0 {
            return;
        }
        let running: Vec<u64> = self
            .reqs
            .lock()
            .iter()
            .filter(|(_, r)| matches!(&r.state, State::Running(_, Some(_))))
            .map(|(&h, _)| h)
            .collect();
        for h in running {
            // Its outcome (and a failed notification) stays for the application's check.
            let _ = self.check(h, shim);
        }
    }

    /// Releases request `h`; one still running is waited for (a launched copy cannot be
    /// called back, and its plan and mappings must outlive it).
    ///
    /// # Errors
    /// [`Error::UnknownRequest`].
    pub(crate) fn release(&self, h: u64) -> Result<()> {
        // Waited for under the table's lock (as `quiesce` does): removed first, a running copy
        // would be out of a deregistration's sight while it ends.
        let mut reqs = self.reqs.lock();
        let req = reqs.remove(&h).ok_or(Error::UnknownRequest(h))?;
        if let State::Running(ctx, notif) = req.state {
            // Released before it was found done: no notification goes (as UCX's release
            // cancels what it has not sent).
            if notif.is_some() {
                self.notifying.fetch_sub(1, Ordering::AcqRel);
            }
            if ctx.synchronize().is_ok() {
                self.idle.lock().push(ctx);
            }
        }
        drop(reqs);
        Ok(())
    }
}

impl Drop for IpcPath {
    fn drop(&mut self) {
        // Running copies end before their plans and mappings are freed.
        for (_, req) in self.reqs.lock().drain() {
            if let State::Running(ctx, _) = req.state {
                let _ = ctx.synchronize();
            }
        }
    }
}

/// The same-host paths for the GPU memory of one engine: an [`IpcPath`] per GPU whose memory
/// the engine registers, opened at the first registration of that GPU's memory (the arena's
/// GPU's when the engine is created). So a host-arena engine (no CUDA context when the backend
/// was created, or `bounce_arena_mem=dram`) and an engine with memory on several GPUs copy
/// GPU memory between processes of one host as a GPU-arena engine does its arena's GPU's.
#[derive(Debug)]
pub(crate) struct IpcPaths {
    stats: Arc<Stats>,
    /// Shared by the paths (see [`IpcPath::notifying`]).
    notifying: Arc<AtomicUsize>,
    /// By GPU ordinal; `None`: that GPU's path could not be had (logged when tried; not tried
    /// again).
    by_dev: RwLock<HashMap<u64, Option<Arc<IpcPath>>>>,
}

impl IpcPaths {
    /// The paths of an engine, with those for its arenas' GPUs (`arena_gpus`) opened now.
    pub(crate) fn new(arena_gpus: &[Arc<Gpu>], stats: Arc<Stats>) -> Self {
        let paths = Self { stats, notifying: Arc::default(), by_dev: RwLock::default() };
        for gpu in arena_gpus {
            let path = IpcPath::new(gpu, Arc::clone(&paths.stats), Arc::clone(&paths.notifying)).map(Arc::new);
            paths.by_dev.write().insert(gpu.ordinal() as u64, path);
        }
        paths
    }

    /// The path for memory on GPU `dev`, opened (the GPU, its kernels, a plan stream) at the
    /// first call for it: the registration of that GPU's first memory, on the application's
    /// thread (its context is given back when the call returns, see `Gpu::bind`). It retains
    /// the GPU's primary context, the one the CUDA runtime and PyTorch use. Other paths' posts
    /// wait for the lock meanwhile, once per GPU.
    fn open(&self, dev: u64) -> Option<Arc<IpcPath>> {
        if let Some(p) = self.by_dev.read().get(&dev) {
            return p.clone();
        }
        let mut by_dev = self.by_dev.write();
        by_dev
            .entry(dev)
            .or_insert_with(|| {
                let gpu = i32::try_from(dev).map_err(|_| CudaError::Unavailable(format!("no CUDA device {dev}")));
                match gpu.and_then(Gpu::open) {
                    Ok(gpu) => IpcPath::new(&gpu, Arc::clone(&self.stats), Arc::clone(&self.notifying)).map(Arc::new),
                    Err(e) => {
                        tracing::warn!(gpu = dev, error = %e, "cannot open the GPU: no same-host path for its memory");
                        None
                    }
                }
            })
            .clone()
    }

    /// The path already open for GPU `dev`.
    fn path(&self, dev: u64) -> Option<Arc<IpcPath>> {
        self.by_dev.read().get(&dev).cloned().flatten()
    }

    /// The path that prepared request `h`.
    fn owner(&self, h: u64) -> Result<Arc<IpcPath>> {
        self.path(gpu_of(h)).ok_or(Error::UnknownRequest(h))
    }

    /// The record to publish with our registration `reg`: GPU memory only, exported through
    /// the path of its GPU (opened now if this is that GPU's first registration).
    pub(crate) fn export(&self, reg: &Registration) -> Option<IpcRecord> {
        if reg.mem != MemKind::Vram || reg.len == 0 {
            return None;
        }
        self.open(reg.dev)?.export(reg)
    }

    /// [`IpcPath::prep`] on the path of GPU `dev`, where every local descriptor lies (the
    /// gate's `mapped_place`); `None` when no registration of that GPU's memory opened one.
    pub(crate) fn prep(
        &self,
        dev: u64,
        peer: &str,
        descs: &[DescPair],
        ipc: &[(IpcRecord, usize)],
        read: bool,
        loads: LoadStamp,
    ) -> Option<u64> {
        self.path(dev)?.prep(peer, descs, ipc, read, loads)
    }

    /// [`IpcPath::post`] on the path that prepared `h`.
    pub(crate) fn post(&self, h: u64, notif: Option<Vec<u8>>, loaded: impl Fn(&LoadStamp) -> bool) -> Result<()> {
        self.owner(h)?.post(h, notif, loaded)
    }

    /// [`IpcPath::check`] on the path that prepared `h`.
    pub(crate) fn check(&self, h: u64, shim: Option<Shim>) -> Result<Progress> {
        self.owner(h)?.check(h, shim)
    }

    /// [`IpcPath::release`] on the path that prepared `h`.
    pub(crate) fn release(&self, h: u64) -> Result<()> {
        self.owner(h)?.release(h)
    }

    /// [`IpcPath::quiesce`] on the path of GPU `dev`, if one is open.
    pub(crate) fn quiesce(&self, dev: u64, addr: u64, len: u64, kept: &dyn Fn(Span) -> bool) {
        if let Some(p) = self.path(dev) {
            p.quiesce(addr, len, kept);
        }
    }

    /// True when a running request of a path still has its notification to send: `getNotifs`
    /// must then [`settle`](Self::settle) rather than pull the inner engine straight through.
    pub(crate) fn notifying(&self) -> bool {
        self.notifying.load(Ordering::Acquire) > 0
    }

    /// [`IpcPath::settle`] on every path.
    pub(crate) fn settle(&self, shim: Option<Shim>) {
        if !self.notifying() {
            return;
        }
        let paths: Vec<Arc<IpcPath>> = self.by_dev.read().values().flatten().cloned().collect();
        for p in paths {
            p.settle(shim);
        }
    }

    /// [`IpcPath::unmap`] on every path (each may have mapped the allocation).
    pub(crate) fn unmap(&self, handle: &[u8; 64]) {
        for p in self.by_dev.read().values().flatten() {
            p.unmap(handle);
        }
    }
}

/// The GPU whose path made request handle `h` (see [`DEV_SHIFT`]).
fn gpu_of(h: u64) -> u64 {
    (h >> DEV_SHIFT) % MAX_GPUS
}

/// Where `len` bytes at the peer's `addr` are in this process: `base` is the registration's
/// first byte as mapped here. `None` unless the whole range lies inside the registration.
fn translate(rec: &IpcRecord, base: u64, addr: u64, len: u64) -> Option<u64> {
    let off = addr.checked_sub(rec.addr)?;
    (off.checked_add(len)? <= rec.len).then_some(())?;
    base.checked_add(off)
}

/// This host's identity: its boot id (a handle is meaningless on another host, or after a
/// reboot).
pub(crate) fn host_identity() -> Option<[u8; 16]> {
    let s = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    parse_uuid(s.trim())
}

/// The 16 bytes of a textual UUID.
fn parse_uuid(s: &str) -> Option<[u8; 16]> {
    let hex: Vec<u8> = s.bytes().filter(|b| *b != b'-').collect();
    if hex.len() != 32 {
        return None;
    }
    let mut out = [0u8; 16];
    for (i, pair) in hex.chunks(2).enumerate() {
        out[i] = u8::from_str_radix(std::str::from_utf8(pair).ok()?, 16).ok()?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(addr: u64, len: u64) -> IpcRecord {
        IpcRecord { node: [0; 16], handle: [0; 64], alloc_off: 0x100, addr, len }
    }

    #[test]
    fn a_piece_is_translated_only_inside_its_registration() {
        let r = rec(0x10_0000, 0x1000);
        let base = 0x7000_0100; // the mapping's address plus alloc_off
        assert_eq!(translate(&r, base, 0x10_0000, 0x1000), Some(0x7000_0100));
        assert_eq!(translate(&r, base, 0x10_0ff0, 0x10), Some(0x7000_10f0));
        assert_eq!(translate(&r, base, 0x10_0ff0, 0x11), None, "one byte past the end");
        assert_eq!(translate(&r, base, 0x0f_ffff, 1), None, "one byte before the start");
        assert_eq!(translate(&r, base, u64::MAX, 2), None);
        assert_eq!(translate(&rec(0, u64::MAX), u64::MAX - 1, 4, 1), None, "the mapped address overflows");
    }

    #[test]
    fn a_handle_names_the_gpu_whose_path_made_it_and_keeps_clear_of_the_other_paths_bits() {
        use crate::shell::cma::CMA_HANDLE_BIT;
        for dev in [0, 1, 7, MAX_GPUS - 1] {
            for n in [1, 2, (1 << DEV_SHIFT) - 1] {
                let h = IPC_HANDLE_BIT | (dev << DEV_SHIFT) | n;
                assert_eq!(gpu_of(h), dev, "dev {dev}, n {n}");
                assert_eq!(h & CMA_HANDLE_BIT, 0, "never a CMA handle");
                assert_ne!(h & IPC_HANDLE_BIT, 0);
            }
        }
    }

    #[test]
    fn the_host_identity_is_the_boot_ids_bytes() {
        assert_eq!(
            parse_uuid("0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"),
            Some([0x0f, 0x1e, 0x2d, 0x3c, 0x4b, 0x5a, 0x69, 0x78, 0x87, 0x96, 0xa5, 0xb4, 0xc3, 0xd2, 0xe1, 0xf0])
        );
        assert_eq!(parse_uuid("0f1e2d3c-4b5a"), None);
        assert_eq!(parse_uuid("zz1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"), None);
        if std::path::Path::new("/proc/sys/kernel/random/boot_id").exists() {
            assert!(host_identity().is_some(), "Linux has a boot id");
        }
    }
}
