//! What application threads and the reactor share: the [`Inbox`] of commands ([`Cmd`]), the
//! [`Completion`] an application thread waits on, and the [`Shared`] state (requests, counters,
//! peers, registrations, the fence).

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::Thread;
use std::time::Duration;

use bounce_proto::gate::ArenaPlace;
use bounce_proto::proof::Destination;
use bounce_proto::{ArenaId, PeerId, RegId, XferId};
use parking_lot::{Condvar, Mutex};

use super::alarm::Alarm;
use super::cell::WorkerPasses;
use crate::shell::doorbell::Doorbell;
use crate::shell::fence::Fence;
use crate::shell::peers::PeerTable;
use crate::shell::registry::Registry;
use crate::shell::requests::{Posted as PostedXfer, Requests};
use crate::shell::stats::Stats;
use crate::sys::shim::Md;

/// A command for the reactor.
#[derive(Debug)]
pub(crate) enum Cmd {
    /// Run a posted request.
    Submit(PostedXfer),
    /// The application released an in-flight request: signal `done` once nothing of it writes
    /// our memory any more (its failure, deferred while a READ's scatters run, is settled).
    Cancel(XferId, Signal),
    /// The peer disconnected, or was reloaded with a new session: everything of the id it went
    /// by (never the id of what comes next under its name) is reclaimed.
    PeerLost(String, PeerId),
    /// We loaded this peer's connection info: tell it we can answer (HELLO). With the count
    /// of peer losses then ([`crate::shell::peers::PeerTable::losses`]).
    Hello(String, u64),
    /// Memory registered through this engine, with its id and key (the receiver may scatter
    /// into it for flows that prove the key), address, length and the one arena that serves
    /// it (flows through another cannot prove it: that arena's copy engine must never touch it).
    Registered(Destination, u64, u64, ArenaId),
    /// The application deregistered `[addr, addr + len)` (marked removed in the [`Fence`]):
    /// fail what uses it in the core, then (with `done`) signal once no running copy job or
    /// write touches it.
    Deregister {
        /// The registration's id, when it had one (a key was issued for it).
        reg: Option<RegId>,
        /// Start of the range.
        addr: u64,
        /// Its length.
        len: u64,
        /// Signalled (dropped) when the range is no longer touched; `None` when nothing
        /// touched it at the deregistration (the application did not wait).
        done: Option<Signal>,
        /// The fence's mark at the deregistration: only jobs pinned up to it are waited for.
        mark: u64,
        /// The range was marked removed in the fence (lift the mark once applied).
        fenced: bool,
    },
    /// One peer arena's inner metadata (its arena's and its mailbox's registrations) that is
    /// no longer used for new writes or READs (the peer was lost, said goodbye or was
    /// reloaded): unload it once no write or READ in flight uses any of it.
    Unload(Vec<Md>),
    /// A FORGET the engine made for a peer NIXL is unloading, to send over a control channel
    /// of the reactor's own (ZMQ) at the peer's control endpoint (resolved before the peer left
    /// the table), before the [`Cmd::PeerLost`] behind it drops the peer's socket. (Over UCX
    /// the engine sends it itself, before the inner engine disconnects.)
    Forget { peer: String, endpoint: Vec<u8>, frame: Vec<u8> },
}

impl Cmd {
    /// Whether handling it is activity: the reactor then keeps looking closely (its hot
    /// window on a many-core host, the idle ramp restarted), as after a frame or a finished
    /// copy. The bookkeeping of a registration or of a deregistration nobody waits for is not:
    /// an application registering in a loop made the reactor of a 16-core host spin for 1 ms
    /// after each command, polling the inner engine beside every call the application made to
    /// it (a register + deregister 1.49x UCX's, a 4 KiB WRITE 1.20x; issue 12).
    pub(crate) fn stirs(&self) -> bool {
        !matches!(self, Self::Registered(..) | Self::Deregister { done: None, .. })
    }
}

/// What an application thread waits on while the reactor finishes a command.
#[derive(Debug, Default)]
pub(crate) struct Completion {
    pub(super) done: Mutex<bool>,
    pub(super) cv: Condvar,
}

impl Completion {
    fn signal(&self) {
        *self.done.lock() = true;
        self.cv.notify_all();
    }

    /// Waits until signalled or until the reactor of `shared` has ended (its copy engine is
    /// joined and its writes are released then, so nothing of it touches memory any more).
    ///
    /// Unbounded on purpose: what it waits for is a copy job or a write still touching memory
    /// the application is about to free (a deregistration, a released READ's destinations),
    /// and returning before it ends would let that job write freed memory. Every job ends
    /// within its own bound (a chunk's copy, a failed write's `DEREG_WRITE_WAIT`), so only an
    /// inner call that never returns keeps it waiting; that is said at 5 s and every minute
    /// after, at error level.
    pub(crate) fn wait(&self, shared: &Shared, what: &str) {
        let mut done = self.done.lock();
        let mut waited = Duration::ZERO;
        while !*done && !shared.ended.load(Ordering::Acquire) {
            let step = Duration::from_millis(50);
            let _ = self.cv.wait_for(&mut done, step);
            waited += step;
            if waited == Duration::from_secs(5) {
                tracing::warn!("still waiting for the bounce reactor to let go of {what}");
            } else if waited.as_millis() % 60_000 == 0 {
                tracing::error!(
                    waited_s = waited.as_secs(),
                    "the bounce reactor has not let go of {what}: a copy or an inner call does not end"
                );
            }
        }
    }
}

/// The reactor's side of a [`Completion`]: signals it when dropped, so whatever becomes of the
/// command (settled, or dropped by a reactor that stopped or panicked) the waiter wakes.
#[derive(Debug)]
pub(crate) struct Signal(pub(crate) Arc<Completion>);

impl Drop for Signal {
    fn drop(&mut self) {
        // Dropped by a panicking pass (its commands still queued): the waiter returns once the
        // reactor has ended (`Shared::ended`), after its copy engine is joined, not now.
        if std::thread::panicking() {
            return;
        }
        self.0.signal();
    }
}

/// The reactor's mailbox: a queue plus the thread to wake.
#[derive(Default)]
pub(crate) struct Inbox {
    pub(super) q: Mutex<VecDeque<Cmd>>,
    pub(super) thread: Mutex<Option<Thread>>,
    /// What the idle reactor thread sleeps on instead of parking, with a control channel that
    /// has a descriptor ([`super::alarm`]): rung with every wake.
    pub(super) alarm: std::sync::OnceLock<Arc<Alarm>>,
    /// A pass is wanted of the reactor thread even while it stands down beside an application
    /// that drives ([`Self::kick`]); cleared by the thread as it takes the driver for a pass.
    wanted: AtomicBool,
    /// The reactor thread has ended ([`Self::close`]): commands are dropped, not queued. Set
    /// and read with `q` locked, so no command slips in behind the last drain.
    closed: AtomicBool,
}

impl Inbox {
    /// Queues a command and has the reactor thread run a pass for it ([`Self::kick`]): the
    /// callers (loads, registrations, cancels, deregistrations) drive no pass themselves.
    pub(crate) fn push(&self, cmd: Cmd) {
        self.push_quiet(cmd);
        self.kick();
    }

    /// Wakes the reactor thread for a pass it must run even if it stands down beside an
    /// application that drove lately: work this thread queued or left (a command, a finished
    /// copy, control frames) and could not run a pass for, the driver being taken. A plain
    /// [`Self::wake`] only ends its sleep, and a stand-down then sleeps again for what is left
    /// (up to `bounce_idle_park_us`): a release waiting on its cancel waited that long behind
    /// the application's own last passes.
    pub(crate) fn kick(&self) {
        // Before the wake: the thread looks at it after every sleep (SeqCst both sides).
        self.wanted.store(true, Ordering::SeqCst);
        self.wake();
    }

    /// Whether a pass is wanted ([`Self::kick`]).
    pub(super) fn wanted(&self) -> bool {
        self.wanted.load(Ordering::SeqCst)
    }

    /// The reactor thread runs a pass now, with the driver held: what was wanted before is
    /// served by it; a kick from here on is seen after it.
    pub(super) fn serve_wanted(&self) {
        self.wanted.store(false, Ordering::SeqCst);
    }

    /// Queues a command without waking the reactor: bookkeeping it needs only before its next
    /// pass, which drains the inbox in order before anything else.
    pub(crate) fn push_quiet(&self, cmd: Cmd) {
        let mut q = self.q.lock();
        if self.closed.load(Ordering::Relaxed) {
            // Nobody will take it: dropped (its signal fires) after the lock is let go. Queued,
            // every later registration's bookkeeping would pile up for the engine's life.
            drop(q);
            drop(cmd);
            return;
        }
        q.push_back(cmd);
    }

    /// No command will be taken any more: drops those queued (their signals fire) and every
    /// one pushed from now on.
    pub(super) fn close(&self) {
        let left: VecDeque<Cmd> = {
            let mut q = self.q.lock();
            self.closed.store(true, Ordering::Relaxed);
            std::mem::take(&mut *q)
        };
        drop(left);
    }

    /// How many commands wait to be taken.
    #[cfg(test)]
    pub(super) fn queued(&self) -> usize {
        self.q.lock().len()
    }

    /// Wakes the reactor (a copy finished, a frame arrived).
    pub(crate) fn wake(&self) {
        if let Some(t) = self.thread.lock().as_ref() {
            t.unpark();
        }
        if let Some(a) = self.alarm.get() {
            a.ring();
        }
    }

    pub(super) fn drain(&self, out: &mut Vec<Cmd>) {
        out.extend(self.q.lock().drain(..));
    }
}

/// Shared between the engine (application threads) and the reactor.
pub(crate) struct Shared {
    /// Commands.
    pub(crate) inbox: Inbox,
    /// Bounce requests.
    pub(crate) requests: Requests,
    /// Counters.
    pub(crate) stats: Arc<Stats>,
    /// The one peer table.
    pub(crate) peers: Arc<PeerTable>,
    /// The one table of registrations.
    pub(crate) registry: Arc<Registry>,
    /// Peer arenas dropped from the peer table and not yet unloaded (writes still use them).
    pub(crate) arenas_retiring: AtomicU64,
    /// Jobs touching user memory, against deregistrations.
    pub(crate) fence: Fence,
    /// The reactor thread has ended: no command will be handled any more.
    pub(super) ended: AtomicBool,
    /// What the forget secrets in our PONGs derive from (`bounce_proto::forget`), set by the
    /// reactor as it starts: the engine proves the secret in the FORGET it sends a peer it
    /// unloads.
    pub(crate) forget_key: std::sync::OnceLock<[u8; 32]>,
    /// The reactor's driver, for a copy worker whose job just ended ([`Self::copy_finished`]);
    /// set once the reactor thread runs.
    pub(super) worker_passes: std::sync::OnceLock<WorkerPasses>,
}

impl Shared {
    /// Fresh shared state over the engine's counters, peers and registrations; `bell` is rung
    /// whenever a bounce request finishes.
    pub(crate) fn new(stats: Arc<Stats>, peers: Arc<PeerTable>, registry: Arc<Registry>, bell: Arc<Doorbell>) -> Self {
        Self {
            inbox: Inbox::default(),
            requests: Requests::new(bell),
            stats,
            peers,
            registry,
            arenas_retiring: AtomicU64::new(0),
            fence: Fence::default(),
            ended: AtomicBool::new(false),
            forget_key: std::sync::OnceLock::new(),
            worker_passes: std::sync::OnceLock::new(),
        }
    }

    /// A copy worker finished a job: it runs the pass that hands the job's result on when no
    /// other thread is in one ([`WorkerPasses`]), else wakes the reactor thread to run it.
    pub(crate) fn copy_finished(&self) {
        if !self.worker_passes.get().is_some_and(|w| w.pass(self)) {
            self.inbox.kick();
        }
    }

    /// The application deregisters `[addr, addr + len)` (registration `reg`, when it had an
    /// id), which the arena's copies may touch
    /// (the registration is already gone from the registry): returns once no copy job or write
    /// of the bounce path touches it, and none will. At once when none is running (the fence
    /// refuses later ones); otherwise after the reactor has failed what uses the range and the
    /// jobs on it have ended. The reactor applies the deregistration to the core either way.
    ///
    /// Memory that another live registration of the same memory (`place`) wholly covers stays
    /// the application's to be written: the fence is not marked for it, as the core does not
    /// doom scatters into it. Marked, it refused for a pass the jobs the core had judged fine
    /// (review 52, copy F2), and made the deregistration wait for jobs on memory nobody frees.
    pub(crate) fn deregister(&self, reg: Option<RegId>, addr: u64, len: u64, place: ArenaPlace) {
        // The reactor has ended (its copy engine joined): nothing runs to wait for, and a
        // fence mark would never be lifted.
        if self.ended.load(Ordering::Acquire) {
            return;
        }
        let covered = self.registry.covering(place, addr, len).is_some();
        let Some(mark) = (!covered).then(|| self.fence.deregister((addr, addr.saturating_add(len)))).flatten() else {
            self.inbox.push_quiet(Cmd::Deregister { reg, addr, len, done: None, mark: 0, fenced: !covered });
            return;
        };
        let done = Arc::new(Completion::default());
        self.inbox.push(Cmd::Deregister { reg, addr, len, done: Some(Signal(Arc::clone(&done))), mark, fenced: true });
        done.wait(self, "deregistered memory");
    }

    /// The application releases in-flight transfer `xfer`: returns once it is cancelled and
    /// nothing of it writes our memory any more (a READ's scatters still running end first;
    /// UCX's release cancels its requests, and a framework frees the destinations next).
    pub(crate) fn cancel(&self, xfer: XferId) {
        let done = Arc::new(Completion::default());
        self.inbox.push(Cmd::Cancel(xfer, Signal(Arc::clone(&done))));
        done.wait(self, "a released READ's destinations");
    }

    /// The reactor thread is done: commands queued from now on are dropped (their signals
    /// fire), and so are those it never took.
    pub(super) fn reactor_ended(&self) {
        self.ended.store(true, Ordering::Release);
        self.inbox.close();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shell::registry::Registration;
    use bounce_proto::MemKind;

    const HOST: ArenaPlace = ArenaPlace { mem: MemKind::Dram, dev: 0 };

    fn shared() -> Shared {
        Shared::new(Arc::default(), Arc::default(), Arc::default(), Arc::default())
    }

    fn reg(s: &Shared, md: usize, addr: u64, len: u64, mem: MemKind, dev: u64) {
        s.registry.insert(Md(md), Registration { addr, len, dev, mem });
    }

    /// What `deregisterMem` does: the registration leaves the registry, then the range goes
    /// to [`Shared::deregister`] (no job is pinned here, so it returns at once).
    fn deregister(s: &Shared, md: usize, place: ArenaPlace) -> (u64, u64) {
        let r = s.registry.remove(Md(md)).unwrap();
        s.deregister(Some(RegId(md as u64)), r.addr, r.len, place);
        (r.addr, r.addr + r.len)
    }

    fn pinnable(s: &Shared, span: (u64, u64)) -> bool {
        s.fence.pin(span, |_| true).map(|p| s.fence.unpin(p)).is_some()
    }

    /// Memory another registration of the same memory still covers whole is not fenced off:
    /// the core does not doom scatters into it, and jobs on it keep running before the reactor
    /// applies the deregistration (review 52, copy F2). Memory nothing else covers is.
    #[test]
    fn only_memory_no_other_registration_covers_is_fenced_off_at_a_deregistration() {
        let s = shared();
        reg(&s, 1, 0x10_000, 0x2000, MemKind::Dram, 0);
        reg(&s, 2, 0x10_000, 0x1000, MemKind::Dram, 0);
        // The same addresses on a GPU are other memory: no cover for host memory.
        reg(&s, 3, 0x20_000, 0x2000, MemKind::Vram, 0);
        reg(&s, 4, 0x20_000, 0x1000, MemKind::Dram, 0);
        let inner = deregister(&s, 2, HOST);
        assert!(pinnable(&s, inner), "a job inside the larger registration is still pinned");
        let uncovered = deregister(&s, 4, HOST);
        assert!(!pinnable(&s, uncovered), "memory covered only by GPU memory's addresses is fenced off");
        let outer = deregister(&s, 1, HOST);
        assert!(!pinnable(&s, outer), "the last registration of the memory fences it off");
        // Each deregistration still reaches the core (which dooms by its own rule).
        assert_eq!(s.inbox.queued(), 3);
    }
}
