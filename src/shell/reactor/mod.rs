//! The reactor: one IO thread per engine that owns the sans-IO [`Endpoint`] and does what it
//! asks: sends control frames over its [`ControlChannel`], runs gathers and scatters on its
//! [`CopyEngine`], posts and polls writes on its [`DataPath`], and records completions.
//!
//! Each iteration progresses the data path, reads control frames, drains the inbox
//! (application commands), collects copy completions, polls in-flight writes, fires timers,
//! then drains `poll_action()` to `None` (quinn's `ConnectionDriver` loop). Polling adapts: it
//! spins while work is in flight, backs off to short sleeps when progress stalls, and parks
//! (woken by new commands, and with a ZMQ control channel by a frame on its socket:
//! [`alarm`]) when idle, so an idle engine costs no core.
//!
//! The reactor never calls NIXL's entry points and never sees the shim directly: its three
//! seams are given to it, which is how the unit tests below join two reactors in memory.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::{JoinHandle, Thread};
use std::time::{Duration, Instant};

use bounce_proto::config::Config;
use bounce_proto::endpoint::{Action, Endpoint, InRegionPlan, JobId, JobRuns, WriteRoute, WriteSource, XferError};
use bounce_proto::gate::ArenaPlace;
use bounce_proto::mailbox::Record;
use bounce_proto::oneway::OneWayLayout;
use bounce_proto::peers::FrameRefused;
use bounce_proto::proof::Destination;
use bounce_proto::wire::{self, Frame, Msg};
use bounce_proto::{ArenaId, MemKind, PeerId, RegId, Region, Token, XferId};
use parking_lot::{Condvar, Mutex};

use crate::shell::control::{ControlChannel, ControlError};
use crate::shell::copy::route::Copiers;
use crate::shell::copy::{CopyEngine, CopyJob, Dir};
use crate::shell::datapath::{DataPath, Posted, WriteId};
use crate::shell::doorbell::Doorbell;
use crate::shell::fence::{Fence, Pin, runs_span, runs_touch};
use crate::shell::oneway_area::AreaView;
use crate::shell::peers::{PeerArena, PeerTable, WriteRefused};
use crate::shell::registry::Registry;
use crate::shell::requests::{Posted as PostedXfer, Requests};
use crate::shell::stats::Stats;
use crate::shell::streak::Streak;
use crate::shell::{Error, Result};
use crate::sys::nixl::{MemSeg, NixlStatus};
use crate::sys::shim::{Md, WriteSide, WriteState};
use alarm::Alarm;
use bounce_proto::peers::Hello;
use fetch::Fetches;
pub(crate) use pace::hot_spin;
use pace::{AppPolls, BUSY_SLEEP, Pace, STAND_DOWN, Wait};

mod alarm;
mod fetch;
mod pace;
#[cfg(test)]
mod tests;

/// A command for the reactor.
#[derive(Debug)]
pub(crate) enum Cmd {
    /// Run a posted request.
    Submit(PostedXfer),
    /// The application released an in-flight request.
    Cancel(XferId),
    /// The peer disconnected.
    PeerLost(String),
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
    },
    /// One peer arena's inner metadata (its arena's and its mailbox's registrations) that is
    /// no longer used for new writes or READs (the peer was lost, said goodbye or was
    /// reloaded): unload it once no write or READ in flight uses any of it.
    Unload(Vec<Md>),
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
    done: Mutex<bool>,
    cv: Condvar,
}

impl Completion {
    fn signal(&self) {
        *self.done.lock() = true;
        self.cv.notify_all();
    }

    /// Waits until signalled or until the reactor of `shared` has ended (its copy engine is
    /// joined and its writes are released then, so nothing of it touches memory any more).
    pub(crate) fn wait(&self, shared: &Shared) {
        let mut done = self.done.lock();
        let mut waited = Duration::ZERO;
        while !*done && !shared.ended.load(Ordering::Acquire) {
            let step = Duration::from_millis(50);
            let _ = self.cv.wait_for(&mut done, step);
            waited += step;
            if waited == Duration::from_secs(5) {
                tracing::warn!("still waiting for the bounce reactor to let go of deregistered memory");
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
        self.0.signal();
    }
}

/// The reactor's mailbox: a queue plus the thread to wake.
#[derive(Default)]
pub(crate) struct Inbox {
    q: Mutex<VecDeque<Cmd>>,
    thread: Mutex<Option<Thread>>,
    /// What the idle reactor thread sleeps on instead of parking, with a control channel that
    /// has a descriptor ([`alarm`]): rung with every wake.
    alarm: std::sync::OnceLock<Arc<Alarm>>,
}

impl Inbox {
    /// Queues a command and wakes the reactor.
    pub(crate) fn push(&self, cmd: Cmd) {
        self.q.lock().push_back(cmd);
        self.wake();
    }

    /// Queues a command without waking the reactor: bookkeeping it needs only before its next
    /// pass, which drains the inbox in order before anything else.
    pub(crate) fn push_quiet(&self, cmd: Cmd) {
        self.q.lock().push_back(cmd);
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

    fn drain(&self, out: &mut Vec<Cmd>) {
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
    ended: AtomicBool,
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
        }
    }

    /// The application deregisters `[addr, addr + len)` (registration `reg`, when it had an
    /// id), which the arena's copies may touch
    /// (the registration is already gone from the registry): returns once no copy job or write
    /// of the bounce path touches it, and none will. At once when none is running (the fence
    /// refuses later ones); otherwise after the reactor has failed what uses the range and the
    /// jobs on it have ended. The reactor applies the deregistration to the core either way.
    pub(crate) fn deregister(&self, reg: Option<RegId>, addr: u64, len: u64) {
        if !self.fence.deregister((addr, addr.saturating_add(len))) {
            self.inbox.push_quiet(Cmd::Deregister { reg, addr, len, done: None });
            return;
        }
        let done = Arc::new(Completion::default());
        self.inbox.push(Cmd::Deregister { reg, addr, len, done: Some(Signal(Arc::clone(&done))) });
        done.wait(self);
    }

    /// The reactor thread is done: commands queued from now on are dropped (their signals
    /// fire), and so are those it never took.
    fn reactor_ended(&self) {
        self.ended.store(true, Ordering::Release);
        let mut left = Vec::new();
        self.inbox.drain(&mut left);
        drop(left);
    }
}

/// Our arena, as the write path addresses it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LocalArena {
    /// Its memory kind and GPU (host, or GPU memory with the CUDA copy engine).
    pub(crate) place: ArenaPlace,
    /// Base address.
    pub(crate) base: u64,
    /// Inner-engine metadata of its registration.
    pub(crate) md: Md,
}

impl LocalArena {
    /// The arena at byte `offset`, as the local side of a write or READ.
    fn side(&self, offset: u64) -> WriteSide {
        WriteSide { mem: self.place.mem.into(), md: self.md, addr: self.base + offset, dev: self.place.dev }
    }
}

/// One of our arenas, as a reactor is given it.
pub(crate) struct ArenaPart {
    /// Where it lives and how writes address it.
    pub(crate) arena: LocalArena,
    /// Where the gathers and scatters of its regions run.
    pub(crate) copier: Box<dyn CopyEngine>,
    /// `(usable bytes, granularity, max chunk)` of its credit scheduler and staging (the first
    /// arena's must be the configuration's, which the core's endpoint is made with).
    pub(crate) geometry: (u64, u64, u64),
}

/// What a reactor is made of: the engine's identity and its three seams.
pub(crate) struct Parts {
    /// Our session id, carried in every frame.
    pub(crate) session: u64,
    /// Our inner conn info, carried in WANTs (the design's reverse path).
    pub(crate) endpoint: Vec<u8>,
    /// Our arenas, by [`ArenaId`] (the order of our capabilities): at least one.
    pub(crate) arenas: Vec<ArenaPart>,
    /// Our one-way area: our mailbox (records written by this thread) and our fetch area
    /// (one-way READs land there). `None`: no mailbox (two way only).
    pub(crate) one_way: Option<AreaView>,
    /// Where writes go.
    pub(crate) data: Box<dyn DataPath>,
    /// How control frames travel.
    pub(crate) control: Box<dyn ControlChannel>,
    /// Most control frames handled per pass (see [`SOCKET_POLL_BATCH`]).
    pub(crate) control_budget: usize,
}

/// A running reactor; [`Reactor::stop`] (or dropping it) says goodbye to the peers, stops and
/// joins the thread (and the copy engine).
pub(crate) struct Reactor {
    shared: Arc<Shared>,
    cell: Arc<Cell>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<bool>>,
}

/// What a pass on an application thread did ([`Reactor::drive`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Drove {
    /// Anything moved: another pass may move more at once.
    pub(crate) moved: bool,
    /// Copy jobs run on the copy workers: they need the cores more than a poller does.
    pub(crate) copying: bool,
}

/// The driver, shared between the reactor thread and application threads that run a pass of it
/// while they poll ([`Reactor::drive`]).
///
/// Why: every control hop of a bounced transfer otherwise waits for the reactor thread to be
/// scheduled. On a host with few cores an application spinning on `getNotifs` or `checkXfer`
/// holds a core the woken reactor needs, and a hop cost up to a scheduler tick (4 ms; issue
/// 12). The thread that found the frame handles it instead, as UCX's own progress runs on the
/// thread that polls. The lock is only ever tried by application threads: one that finds it
/// held leaves the work to the thread holding it.
struct Cell {
    /// `None` once the reactor thread has ended.
    driver: Mutex<Option<Driver>>,
    /// Passes may run on application threads ([`Copiers::any_thread`]: an arena's engine asks
    /// for it; a GPU arena's context is made current for the pass and the application's
    /// restored at the FFI edge).
    any_thread: bool,
    /// The control channel has a socket of its own ([`ControlChannel::own_socket`]): pollers
    /// look at it ([`Reactor::drive_if_readable`]).
    own_socket: bool,
    /// When a poller last asked the control socket whether a frame waits (nanoseconds since
    /// `epoch`; [`Reactor::drive_if_readable`]).
    socket_looked_at: AtomicU64,
    /// The reactor thread parks without work in flight (up to `bounce_idle_park_us`): a pass
    /// elsewhere that started work must wake it, or the work's next step could wait that long.
    parked_idle: AtomicBool,
    /// Work was in flight after the latest pass (whoever ran it): pollers then drive.
    busy: AtomicBool,
    /// The ends of the passes on application threads, no more than [`STAND_DOWN`] apart (ended
    /// when the poller resigns). While pollers drive, the reactor thread stands down
    /// ([`Cell::standing_down`]).
    driving: Streak,
    /// The longest stand-down: `bounce_idle_park_us`.
    longest_stand_down: Duration,
    epoch: Instant,
    /// A pass on an application thread panicked: the driver's state is suspect, so the reactor
    /// thread ends without closing (as after its own panic, the arena is kept).
    poisoned: AtomicBool,
}

struct InFlightWrite {
    /// A READ's RDMA read of a peer's ready region (reported with `handle_read_done`).
    read: bool,
    /// The peer it writes to (or reads from).
    peer: PeerId,
    job: JobId,
    id: WriteId,
    /// Its pin in the fence: the user memory it reads (a direct write).
    pin: Option<Pin>,
    /// The peer arena's inner metadata it writes through, which is not unloaded before it ends.
    remote_md: Md,
}

/// A copy job handed to the copy engine.
struct CopyInFlight {
    dir: Dir,
    /// Its pin in the fence: the user addresses its runs touch.
    pin: Option<Pin>,
    /// A scatter by a plan in its region (counted when it fails).
    in_region: bool,
}

/// A deregistration waiting for the jobs that touch its range.
struct PendingDereg {
    start: u64,
    end: u64,
    _done: Signal,
}

/// How long a closing engine waits for its own writes, then for the grants it gave out to come
/// back, before letting its arena go (an arena with grants still out is then kept mapped).
const CLOSE_WAIT: Duration = Duration::from_secs(2);

struct QueuedWrite {
    job: JobId,
    peer: PeerId,
    source: WriteSource,
    /// Our arena a [`WriteSource::Arena`] region lies in.
    arena: ArenaId,
    /// The peer's arena `remote` lies in.
    remote_arena: ArenaId,
    remote: Region,
    len: u64,
}

/// A READ the core asked for (see `drain_actions` for when it is posted).
struct QueuedRead {
    job: JobId,
    peer: PeerId,
    /// The peer's arena `remote` lies in.
    remote_arena: ArenaId,
    remote: Region,
    /// Our arena of `local`.
    arena: ArenaId,
    local: Region,
    len: u64,
}

struct XferCtx {
    handle: u64,
    peer: String,
    notif: Option<Vec<u8>>,
    /// A READ (counted per direction).
    read: bool,
}

struct Driver {
    ep: Endpoint,
    shared: Arc<Shared>,
    session: u64,
    /// Our arenas, by [`ArenaId`] (one today: docs/arenas.md slice 4).
    arenas: Vec<LocalArena>,
    /// Our mailbox and fetch area, in host memory (`None`: two way only).
    area: Option<AreaView>,
    /// Where our mailbox and fetch area lie, in the core's offsets.
    one_way: OneWayLayout,
    /// Our one-way transfers' mailbox polls.
    fetches: Fetches,
    /// One copy engine per arena.
    copiers: Copiers,
    data: Box<dyn DataPath>,
    control: Box<dyn ControlChannel>,
    control_budget: usize,
    writes: Vec<InFlightWrite>,
    /// Writes the core asked for that wait for a slot (see MAX_WRITES_IN_FLIGHT), or for the
    /// DATA of a write over at its post (`over_at_post`).
    queued_writes: VecDeque<QueuedWrite>,
    /// A write posted in the current drain finished (or failed) inside its post: the writes
    /// the core asks for next wait until its DATA has gone (`drain_actions`).
    over_at_post: bool,
    /// READs the core asked for in one drain after its first, posted one at a time by
    /// `drain_actions` before it returns (empty between drains; nothing it calls drains).
    queued_reads: VecDeque<QueuedRead>,
    copies: HashMap<JobId, CopyInFlight>,
    xfers: HashMap<XferId, XferCtx>,
    /// Deregistrations waiting for running jobs (declared after `copier`: dropped after the
    /// copy engine has joined its workers, so their waiters wake only then).
    deregs: Vec<PendingDereg>,
    /// Peer arenas (each its arena's and mailbox's handles) to unload once no write or READ in
    /// flight uses them.
    retiring: Vec<Vec<Md>>,
    /// Peers we said HELLO to: those that may bounce to us, and so get our GOODBYE.
    greeted: HashSet<String>,
    warn_budget: RateLimit,
    /// Set by shutdown: queued writes are failed, never posted.
    stopping: bool,
    /// Frames refused because their session is not the one of the sender's loaded metadata
    /// (the core counts wrong tokens; `stats.control_forged` is the sum).
    sessions_forged: u64,
    /// Copy jobs and direct writes the fence refused because their memory was being
    /// deregistered (their transfer fails before the core hears of the deregistration).
    dereg_refused: u64,
    /// Scratch buffers reused every pass.
    frames: Vec<(String, Vec<u8>)>,
    done: Vec<(JobId, bool)>,
    /// Scratch for [`Driver::finish_inline_copies`] (apart from `done`, which a pass holds
    /// taken while it drains actions).
    inline_done: Vec<(JobId, bool)>,
    cmds: Vec<Cmd>,
    /// The latest pass took as many control frames as its budget allowed.
    control_full: bool,
    /// Whether the reactor thread leaves the inner engine's notifications to the application.
    app_polls: AppPolls,
}

/// At most a few warnings per second for peer misbehaviour (a hostile peer must not be able to
/// flood the log).
struct RateLimit {
    window: Instant,
    left: u32,
}

impl RateLimit {
    fn allow(&mut self, now: Instant) -> bool {
        if now.duration_since(self.window) > Duration::from_secs(1) {
            self.window = now;
            self.left = 10;
        }
        self.left.checked_sub(1).map(|l| self.left = l).is_some()
    }
}

impl Reactor {
    /// Starts the reactor thread over `parts`.
    ///
    /// # Errors
    /// When the core rejects the configuration or the thread cannot be started.
    pub(crate) fn start(config: &Config, shared: Arc<Shared>, parts: Parts) -> Result<Self> {
        let Parts { session, endpoint, arenas: parts, one_way: area, data, control, control_budget } = parts;
        let mut ep = Endpoint::new(config, Instant::now())?;
        ep.set_local_endpoint(endpoint);
        let (mut arenas, mut copiers) = (Vec::with_capacity(parts.len()), Vec::with_capacity(parts.len()));
        for (i, part) in parts.into_iter().enumerate() {
            // The first arena is the endpoint's own, made with the configuration's geometry.
            let id = match i {
                0 if part.geometry
                    == (config.arena_usable_capacity(), config.arena_granularity, config.max_chunk_size) =>
                {
                    ArenaId(0)
                }
                0 => return Err(Error::Arenas("the first arena's geometry is not the configuration's")),
                _ => ep.add_arena(part.geometry.0, part.geometry.1, part.geometry.2)?,
            };
            if part.arena.place.mem != MemKind::Dram {
                // Inline chunks are put into host arenas only.
                ep.set_arena_takes_inline(id, false);
            }
            arenas.push(part.arena);
            copiers.push(part.copier);
        }
        let Some(copiers) = Copiers::new(copiers) else {
            return Err(Error::Arenas("none"));
        };
        if !arenas.iter().any(|a| a.place.mem == MemKind::Dram) {
            // Nor gathered, sent or taken without one.
            ep.set_inline_bytes(0);
        }
        // A mailbox only where we have one to write records into.
        ep.keep_mailbox(area.is_some());
        let one_way = ep.one_way_layout();
        // The liveness probe's nonces must be unpredictable to others (a forged PONG would keep
        // a dead peer alive): a random secret per engine.
        ep.set_probe_seed(std::hash::BuildHasher::hash_one(&std::hash::RandomState::new(), session));
        let stop = Arc::new(AtomicBool::new(false));
        // With a socket to wait on, an idle reactor thread sleeps on it (and on the wakers'
        // eventfd) instead of parking; without an eventfd it parks as over UCX.
        let alarm = control.wait_fd().and_then(|fd| match Alarm::new(fd) {
            Ok(a) => Some(Arc::new(a)),
            Err(e) => {
                tracing::warn!("no eventfd ({e}): the idle reactor looks at the control socket after each park");
                None
            }
        });
        if let Some(a) = &alarm {
            let _ = shared.inbox.alarm.set(Arc::clone(a));
        }
        let d = Driver {
            ep,
            shared: Arc::clone(&shared),
            session,
            arenas,
            area,
            one_way,
            fetches: Fetches::new(one_way.fetch_slices),
            copiers,
            data,
            control,
            control_budget,
            writes: Vec::new(),
            queued_writes: VecDeque::new(),
            over_at_post: false,
            queued_reads: VecDeque::new(),
            copies: HashMap::new(),
            xfers: HashMap::new(),
            deregs: Vec::new(),
            retiring: Vec::new(),
            greeted: HashSet::new(),
            warn_budget: RateLimit { window: Instant::now(), left: 10 },
            stopping: false,
            sessions_forged: 0,
            dereg_refused: 0,
            frames: Vec::new(),
            done: Vec::new(),
            inline_done: Vec::new(),
            cmds: Vec::new(),
            control_full: false,
            app_polls: AppPolls::default(),
        };
        let session = d.session;
        let cell = Arc::new(Cell {
            any_thread: d.copiers.any_thread(),
            own_socket: d.control.own_socket(),
            socket_looked_at: AtomicU64::new(0),
            driver: Mutex::new(Some(d)),
            parked_idle: AtomicBool::new(false),
            busy: AtomicBool::new(false),
            driving: Streak::new(STAND_DOWN),
            longest_stand_down: config.idle_park,
            epoch: Instant::now(),
            poisoned: AtomicBool::new(false),
        });
        let (stop2, cell2, shared2) = (Arc::clone(&stop), Arc::clone(&cell), Arc::clone(&shared));
        let idle_park = config.idle_park;
        let thread = std::thread::Builder::new()
            .name("bounce-reactor".into())
            .spawn(move || {
                let span = tracing::debug_span!("reactor", session);
                let _g = span.enter();
                let shared = shared2;
                // A panic here would be a bug in the shell or core. It must not leave requests
                // IN_PROG forever (nothing else runs their timeouts): fail them and refuse new
                // posts; the engine's other entry points keep working on plain UCX.
                let quiet = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    run(&cell2, &stop2, idle_park, alarm.as_deref())
                }));
                if quiet.is_err() {
                    tracing::error!("the bounce reactor panicked; failing its transfers, bounce path closed");
                    shared.requests.close(XferError::ShuttingDown);
                }
                // The copy engine joins its workers here; only then do waiting deregistrations
                // return. Taken under the lock: no application pass runs it any more.
                let d = cell2.driver.lock().take();
                drop(d);
                shared.reactor_ended();
                // After a panic nobody knows what peers still hold: keep the arena.
                quiet.unwrap_or(false)
            })
            .map_err(|source| Error::Spawn { what: "reactor", source })?;
        *shared.inbox.thread.lock() = Some(thread.thread().clone());
        Ok(Self { shared, cell, stop, thread: Some(thread) })
    }

    /// The poller that drove is about to wait (for copies on the workers or the GPU): the
    /// reactor thread stops standing down and, if it is parked for that, is woken, so nothing
    /// that arrives meanwhile waits for the stand-down to end.
    pub(crate) fn resign(&self) {
        if self.cell.resign() {
            self.shared.inbox.wake();
        }
    }

    /// Whether the control channel has a socket of its own, which pollers look at.
    pub(crate) fn own_socket(&self) -> bool {
        self.cell.own_socket
    }

    /// Whether work was in flight after the latest pass: a poller should drive.
    pub(crate) fn busy(&self) -> bool {
        self.cell.any_thread && self.cell.busy.load(Ordering::Acquire)
    }

    /// Runs one pass of the reactor on the calling (application) thread, when passes may run
    /// there and no other thread is running one; `None` when no pass ran (the reactor thread is
    /// in one and will see the same work in its next, or it has stopped).
    pub(crate) fn drive(&self) -> Option<Drove> {
        self.drive_when(|_| true)
    }

    /// For a poller that found nothing of ours among the inner engine's notifications: when
    /// the control channel has a socket of its own (ZMQ) and a frame waits there, runs a pass
    /// on the calling thread as [`Self::drive`] does; otherwise runs none (`None`) and leaves
    /// the reactor thread's pacing as it was (no stand-down: nothing was driven).
    pub(crate) fn drive_if_readable(&self) -> Option<Drove> {
        if !self.cell.own_socket {
            return None;
        }
        // Asking the socket is a system call: at most one look per gap, whoever polls.
        let now = self.cell.since_epoch(Instant::now());
        let last = self.cell.socket_looked_at.load(Ordering::Relaxed);
        if Duration::from_nanos(now.saturating_sub(last)) < SOCKET_LOOK_GAP
            || self.cell.socket_looked_at.compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed).is_err()
        {
            return None;
        }
        self.drive_when(|d| d.control.readable())
    }

    fn drive_when(&self, worth_a_pass: impl FnOnce(&mut Driver) -> bool) -> Option<Drove> {
        if !self.cell.any_thread || self.stop.load(Ordering::Acquire) {
            return None;
        }
        let mut g = self.cell.driver.try_lock()?;
        let d = g.as_mut()?;
        if !worth_a_pass(d) {
            return None;
        }
        // A GPU arena's context, current here until the FFI edge puts the application's back.
        if !d.copiers.prepare_thread() {
            return None;
        }
        let _span = tracing::debug_span!("reactor", session = d.session, inline = true).entered();
        // A pass on the application's call handles a bounded batch of frames: a peer flooding
        // us must not hold that call for the whole flood.
        let budget = d.control_budget.min(SOCKET_POLL_BATCH);
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| d.iterate_with(budget, false))) {
            Ok(moved) => {
                let copying = d.copiers.in_flight() > 0;
                let busy = d.busy();
                self.cell.busy.store(busy, Ordering::Release);
                let more = d.control_full;
                drop(g);
                if more {
                    // The rest of the batch is the reactor thread's, at once.
                    self.cell.resign();
                    self.shared.inbox.wake();
                } else {
                    self.cell.drove(Instant::now());
                    // This pass left work in flight while the reactor thread sleeps an idle
                    // park: it must watch that work should the poller stop. Work begun and
                    // ended here (an inline WANT put, scattered and answered) needs nobody,
                    // and waking the thread for it took a polling application's core.
                    if busy && self.cell.parked_idle.swap(false, Ordering::AcqRel) {
                        self.shared.inbox.wake();
                    }
                }
                Some(Drove { moved, copying })
            }
            Err(_) => {
                drop(g);
                tracing::error!(
                    "a bounce pass on an application thread panicked; failing its transfers, bounce path closed"
                );
                self.cell.poisoned.store(true, Ordering::Release);
                self.stop.store(true, Ordering::Release);
                self.shared.requests.close(XferError::ShuttingDown);
                self.shared.inbox.wake();
                Some(Drove { moved: false, copying: false })
            }
        }
    }

    /// The state shared with application threads.
    pub(crate) fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// The reactor thread (to wake it).
    pub(crate) fn thread(&self) -> Option<Thread> {
        self.thread.as_ref().map(|t| t.thread().clone())
    }

    /// Closes the engine's bounce path and joins the thread: fails every transfer, waits
    /// (bounded) for our writes, sends GOODBYE to every peer we greeted, waits (bounded) for
    /// the grants we gave out to come back, unloads every peer arena, and stops. Returns true
    /// when no grant was outstanding at the end: only then may the arena's memory be handed
    /// back (a late write from a peer could otherwise land in it).
    pub(crate) fn stop(mut self) -> bool {
        self.halt()
    }

    fn halt(&mut self) -> bool {
        self.stop.store(true, Ordering::Release);
        let quiet = match self.thread.take() {
            Some(t) => {
                // Wherever it sleeps: parked, or on its alarm.
                self.shared.inbox.wake();
                t.join().unwrap_or(false)
            }
            None => true,
        };
        // Whatever was still in flight has been failed by the driver's shutdown.
        self.shared.requests.close(XferError::ShuttingDown);
        quiet
    }
}

impl Drop for Reactor {
    fn drop(&mut self) {
        let _ = self.halt();
    }
}

/// Most control frames read from a socket (ZMQ) per reactor pass, so a flood cannot starve the
/// rest of the loop. Frames the inner engine already delivered (UCX) are all handled in the pass
/// that pulled them by the reactor thread, as they always were: a flood then runs as one pass,
/// with no timer firing (lease reclaims) in the middle of it. A pass on an application's call
/// ([`Reactor::drive`]) takes at most this many too, and leaves the rest to the reactor thread.
pub(crate) const SOCKET_POLL_BATCH: usize = 256;
/// Least time between two pollers' looks at a control socket of the channel's own
/// ([`Reactor::drive_if_readable`]). ZMQ answers "does a message wait" with a system call
/// (it polls its mailbox's descriptor); asked at every `getNotifs` it cost a notification
/// round trip 1.10-1.13x UCX's on 2 cores, once per 10 us 1.04 (the hops over ZMQ itself
/// take 40-80 us there, so the wait this adds is small beside them).
const SOCKET_LOOK_GAP: Duration = Duration::from_micros(10);
/// Writes handed to the data path at once, per peer. UCX runs them one after another anyway; keeping
/// one queued behind the running one keeps the link busy, and holding the rest back here lets
/// each finished chunk's DATA go out at once instead of queueing behind every other write's
/// copy inside UCX's progress (measured: DATA arrived only after all 8 windowed writes).
const MAX_WRITES_IN_FLIGHT: usize = 2;

impl Cell {
    fn since_epoch(&self, now: Instant) -> u64 {
        u64::try_from(now.saturating_duration_since(self.epoch).as_nanos()).unwrap_or(u64::MAX).max(1)
    }

    /// No application thread drives any more: the reactor thread stops standing down. True
    /// when it was (it may be parked for that, and wants waking).
    fn resign(&self) -> bool {
        self.driving.end()
    }

    /// An application thread's pass ended at `now`: the reactor thread stands down from here
    /// ([`Self::standing_down`]). A pass more than [`STAND_DOWN`] after the previous one (or
    /// after a resignation) starts a new run of driving.
    fn drove(&self, now: Instant) {
        self.driving.note(now);
    }

    /// How much longer the reactor thread stands down, if an application thread drove lately:
    /// a poller that drives is the transfer's progress, and a reactor thread running passes
    /// beside it only contends for the driver and, on a small host, for the cores (a lock
    /// holder preempted by the other cost a scheduler tick, 4 ms, per transfer; each look of
    /// a thread woken to see whether the poller is still there took that core for 8-15 us).
    /// How long after the latest pass grows with how long the application has been driving
    /// ([`pace::stand_down`]).
    fn standing_down(&self, now: Instant) -> Option<Duration> {
        let left = pace::stand_down_left(self.driving.at(now)?, self.longest_stand_down);
        (!left.is_zero()).then_some(left)
    }
}

/// The reactor thread's loop: passes until `stop`, then closes and shuts down; true when no
/// grant was left outstanding. Idle, it parks up to `idle_park` (`bounce_idle_park_us`), or
/// sleeps on `alarm` as long when the control channel has a socket to wait on.
fn run(cell: &Cell, stop: &AtomicBool, idle_park: Duration, alarm: Option<&Alarm>) -> bool {
    // Writes are posted from this thread too: a GPU arena's context must be current here
    // before the first one (a direct write from GPU memory may come before any copy).
    if let Some(d) = cell.driver.lock().as_mut() {
        let _ = d.copiers.prepare_thread();
    }
    crate::sys::thread::precise_sleeps();
    let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
    let mut pace = Pace::new(cores, idle_park, Instant::now());
    while !stop.load(Ordering::Acquire) {
        if let Some(left) = cell.standing_down(Instant::now()) {
            std::thread::park_timeout(left);
            continue;
        }
        // An application thread in a pass does this pass's work: leave it the driver rather
        // than queue behind it (and be woken late when it lets go).
        let Some(mut g) = cell.driver.try_lock() else {
            std::thread::park_timeout(STAND_DOWN);
            continue;
        };
        let pass = g.as_mut().map(|d| {
            let moved = d.iterate();
            let now = Instant::now();
            let busy = d.busy();
            cell.busy.store(busy, Ordering::Release);
            let beside = pace::beside_puller(d.data.app_pull_streak(now), idle_park);
            (moved, busy, d.ep.poll_timeout().map(|t| t.saturating_duration_since(now)), now, beside)
        });
        drop(g);
        let Some((moved, busy, timer, now, beside)) = pass else { return false };
        match pace.after_pass(now, moved, busy, timer, beside) {
            Wait::Now => {}
            // yield, not spin_loop: on a machine with few cores the copy workers and the
            // application need this core more than we do.
            Wait::Yield => std::thread::yield_now(),
            Wait::Park(d) => {
                if d > BUSY_SLEEP {
                    crate::shell::mark!("park", d.as_micros());
                }
                // Set before parking and cleared after: an application pass that starts work
                // meanwhile wakes us (an unpark before the park makes the park return at once).
                cell.parked_idle.store(!busy, Ordering::Release);
                match alarm {
                    // Idle: a frame on the socket or a wake ends the sleep, so it need not
                    // ramp up from a short one after activity (the ramp is for frames that
                    // come unannounced): it lasts until the next timer, at most the longest
                    // park, which bounds how late the inner engine's progress runs.
                    Some(a) if !busy => a.wait(timer.map_or(idle_park, |t| t.min(idle_park))),
                    _ => std::thread::park_timeout(d),
                }
                if d > BUSY_SLEEP {
                    crate::shell::mark!("unpark", 0);
                }
                cell.parked_idle.store(false, Ordering::Release);
            }
        }
    }
    if cell.poisoned.load(Ordering::Acquire) {
        return false;
    }
    let mut g = cell.driver.lock();
    let Some(d) = g.as_mut() else { return false };
    let quiet = d.close();
    d.shutdown() && quiet
}

impl Driver {
    /// One pass of the reactor thread (its channel's whole budget).
    fn iterate(&mut self) -> bool {
        self.iterate_with(self.control_budget, true)
    }

    /// Whether work is in flight: the reactor then polls closely. Includes the receiver role:
    /// a remote flow waiting for its next DATA must be noticed at once, not after an idle park
    /// (which cost up to 2 ms per chunk). A standing flow waits for nothing and does not count
    /// ([`bounce_proto::endpoint::Endpoint::is_quiet`]).
    fn busy(&self) -> bool {
        !self.writes.is_empty()
            || !self.queued_writes.is_empty()
            || self.copiers.in_flight() > 0
            || !self.xfers.is_empty()
            || !self.deregs.is_empty()
            || self.fetches.busy()
            || !self.ep.is_quiet()
    }

    /// One pass, handling at most `budget` control frames; true when anything moved. Sets
    /// `control_full` when the budget was used up (more may wait).
    fn iterate_with(&mut self, budget: usize, reactor_thread: bool) -> bool {
        let mut moved = false;
        // The reactor thread leaves the inner engine's notifications to an application that is
        // pulling them closely ([`AppPolls`]): its pull hands their control frames to a pass on
        // its own thread (or queues them and wakes us). Frames already queued are taken below
        // either way.
        if !(reactor_thread && self.app_polls.leave_to_app(Instant::now(), self.data.app_pulls())) {
            self.data.progress();
        }
        let mut frames = std::mem::take(&mut self.frames);
        self.control_full = self.control.poll(budget, &mut frames) >= budget;
        let mut cmds = std::mem::take(&mut self.cmds);
        self.shared.inbox.drain(&mut cmds);
        let mut done = std::mem::take(&mut self.done);
        self.copiers.poll_done(&mut done);
        let now = Instant::now();
        // Commands first: every command queued before the frames above were polled is among
        // them, and those frames may depend on one -- a WANT proving a registration made just
        // before its metadata went out, a frame of a peer's new incarnation after the reload
        // that reclaims the old one.
        for cmd in cmds.drain(..) {
            moved |= cmd.stirs();
            self.handle_cmd(now, cmd);
        }
        for (peer, frame) in frames.drain(..) {
            moved = true;
            self.on_control(now, &peer, &frame);
            // Answer each frame before decoding the next: a WANT's GRANT must not wait for the
            // PLANs that follow it (thousands of runs each) to be decoded and checked.
            self.drain_actions();
        }
        for (job, ok) in done.drain(..) {
            moved = true;
            self.copy_done(now, job, ok);
            // Each finished copy's consequence before the next one's: a gathered chunk's write
            // (copied inside its post on one host) and its DATA go before the next chunk's
            // write, so the receiver scatters one chunk while the next is written.
            self.drain_actions();
        }
        (self.frames, self.done, self.cmds) = (frames, done, cmds);
        moved |= self.poll_writes(now);
        moved |= self.poll_fetches(now);
        if self.ep.poll_timeout().is_some_and(|t| t <= now) {
            self.ep.handle_timeout(now);
        }
        moved |= self.drain_actions();
        // Gauges first: a deregistration that returns sees its failures counted.
        self.publish_gauges();
        self.settle();
        moved
    }

    /// Signals the deregistrations no running job touches any more, and unloads the retired
    /// peer arenas no write in flight uses.
    fn settle(&mut self) {
        if !self.deregs.is_empty() {
            let fence = &self.shared.fence;
            self.deregs.retain(|d| fence.busy((d.start, d.end)));
        }
        if !self.retiring.is_empty() {
            let mut i = 0;
            while i < self.retiring.len() {
                let busy = |md: &Md| self.writes.iter().any(|w| w.remote_md == *md) || self.fetches.uses(*md);
                if self.retiring[i].iter().any(busy) {
                    i += 1;
                } else {
                    for md in self.retiring.swap_remove(i) {
                        self.data.unload(md);
                    }
                }
            }
            self.shared.arenas_retiring.store(self.retiring.len() as u64, Ordering::Relaxed);
        }
    }

    /// One peer arena's handles (its arena and mailbox registrations), unloaded together once
    /// no write or READ uses any of them.
    fn retire(&mut self, mds: Vec<Md>) {
        if mds.is_empty() {
            return;
        }
        self.retiring.push(mds);
        self.shared.arenas_retiring.store(self.retiring.len() as u64, Ordering::Relaxed);
    }

    /// Counters the core keeps itself are copied, never counted a second time here.
    fn publish_gauges(&self) {
        let (s, core) = (&self.shared.stats, self.ep.stats());
        s.arena_free_bytes.store(self.ep.arena_free_bytes(), Ordering::Relaxed);
        s.arena_standing_bytes.store(self.ep.arena_standing_bytes(), Ordering::Relaxed);
        s.arena_quarantined_bytes.store(self.ep.arena_quarantined_bytes(), Ordering::Relaxed);
        s.arena_orphans.store(self.ep.orphans() as u64, Ordering::Relaxed);
        s.chunks_direct.store(core.chunks_direct, Ordering::Relaxed);
        s.timeouts.store(core.timeouts, Ordering::Relaxed);
        s.flows_timed_out.store(core.flows_timed_out, Ordering::Relaxed);
        s.flows_dropped_unserved.store(core.flows_dropped_unserved, Ordering::Relaxed);
        s.regions_quarantined.store(core.regions_quarantined, Ordering::Relaxed);
        s.pings_sent.store(core.pings_sent, Ordering::Relaxed);
        s.pongs_received.store(core.pongs_received, Ordering::Relaxed);
        s.peers_declared_dead.store(core.peers_declared_dead, Ordering::Relaxed);
        s.dereg_failed.store(core.dereg_failed + self.dereg_refused, Ordering::Relaxed);
        s.keeps_sent.store(core.keeps_sent, Ordering::Relaxed);
        s.one_way_sent.store(core.one_way_sent, Ordering::Relaxed);
        s.one_way_answered.store(core.one_way_answered, Ordering::Relaxed);
        s.one_way_refused.store(core.one_way_refused, Ordering::Relaxed);
        s.one_way_queued.store(core.one_way_queued, Ordering::Relaxed);
        s.records_written.store(core.records_written, Ordering::Relaxed);
        s.records_read.store(core.records_read, Ordering::Relaxed);
        s.records_refused.store(core.records_refused, Ordering::Relaxed);
        s.read_chunks_served.store(core.chunks_served, Ordering::Relaxed);
        s.read_chunks_pulled.store(core.chunks_pulled, Ordering::Relaxed);
        s.plans_sent.store(core.plans_sent, Ordering::Relaxed);
        s.plans_kept.store(core.plans_kept, Ordering::Relaxed);
        s.plans_dropped.store(core.plans_dropped, Ordering::Relaxed);
        s.replans.store(core.replans, Ordering::Relaxed);
        s.region_plans_sent.store(core.region_plans_sent, Ordering::Relaxed);
        s.region_plans_received.store(core.region_plans_received, Ordering::Relaxed);
        s.grant_waits.store(core.grant_waits, Ordering::Relaxed);
        s.grant_wait_ns.store(core.grant_wait_ns, Ordering::Relaxed);
        s.ack_waits.store(core.ack_waits, Ordering::Relaxed);
        s.ack_wait_ns.store(core.ack_wait_ns, Ordering::Relaxed);
        s.inline_sent.store(core.inline_sent, Ordering::Relaxed);
        s.inline_declined.store(core.inline_declined, Ordering::Relaxed);
        s.inline_acks.store(core.inline_acks, Ordering::Relaxed);
        s.inline_ack_wait_ns.store(core.inline_ack_wait_ns, Ordering::Relaxed);
        s.inline_taken.store(core.inline_taken, Ordering::Relaxed);
        s.standing_opened_out.store(core.standing_opened_out, Ordering::Relaxed);
        s.standing_claims.store(core.standing_claims, Ordering::Relaxed);
        s.standing_opened.store(core.standing_opened, Ordering::Relaxed);
        s.standing_refused.store(core.standing_refused, Ordering::Relaxed);
        s.standing_taken.store(core.standing_taken, Ordering::Relaxed);
        s.standing_kept.store(core.standing_kept, Ordering::Relaxed);
        s.control_forged.store(core.control_forged + self.sessions_forged, Ordering::Relaxed);
    }

    fn handle_cmd(&mut self, now: Instant, cmd: Cmd) {
        match cmd {
            Cmd::Submit(p) => {
                let _span = tracing::trace_span!("submit", handle = p.handle).entered();
                crate::shell::mark!("submit", p.handle);
                let peer = self.shared.peers.id(&p.peer);
                // Two way once the peer said HELLO; one way (answers READ from its mailbox)
                // when it never loaded us but keeps a mailbox, and we keep a fetch area.
                let one_way =
                    self.area.as_ref().and_then(|_| self.shared.peers.one_way_target(&p.peer)).map(|(_, l)| l);
                let chunks = p.plan.chunks.len() as u64;
                let bytes = p.plan.total_bytes;
                let read = p.plan.read;
                self.xfers.insert(p.xfer, XferCtx { handle: p.handle, peer: p.peer, notif: p.notif, read });
                Stats::bump(&self.shared.stats.bounce_xfers);
                self.shared.stats.bounce_chunks.fetch_add(chunks, Ordering::Relaxed);
                if self.arenas.get(usize::from(p.plan.local_arena.0)).is_some_and(|a| a.place.mem != MemKind::Dram) {
                    self.shared.stats.bounce_chunks_gpu_arena.fetch_add(chunks, Ordering::Relaxed);
                }
                self.shared.stats.bounce_bytes.fetch_add(bytes, Ordering::Relaxed);
                // The transfer's secret (see `Token`): only we and the receiver will know it.
                let mut secret = [0u8; 16];
                if let Err(e) = crate::shell::drbg::fill(&mut secret) {
                    tracing::warn!(xfer = p.xfer.0, error = %e, "no randomness for a transfer token");
                    self.complete(p.xfer, Err(XferError::Refused));
                    return;
                }
                let token = Token(u128::from_le_bytes(secret));
                // Shared, not copied: a scattered 64 MiB request's plan is ~10,000 runs.
                let plan = Arc::clone(&p.plan);
                let submitted = match plan.read {
                    true => self.ep.submit_read(now, p.xfer, token, peer, plan, one_way),
                    false => {
                        // Into a peer's host arena: inline bytes and standing credits serve
                        // small host-memory writes; a GPU arena takes neither.
                        let into_host = self.shared.peers.arena_mem(peer, plan.peer_arena) == Some(MemKind::Dram);
                        let inline = into_host.then(|| self.inline_bytes(&plan)).flatten();
                        let route = WriteRoute { mailbox: one_way, inline, no_standing: !into_host };
                        self.ep.submit_write(now, p.xfer, token, peer, plan, route)
                    }
                };
                if let Err(e) = submitted {
                    tracing::warn!(xfer = p.xfer.0, error = %e, "bounce submit refused");
                    self.complete(p.xfer, Err(XferError::Refused));
                }
            }
            Cmd::Cancel(x) => {
                self.xfers.remove(&x);
                self.ep.cancel(now, x);
            }
            Cmd::PeerLost(name) => {
                self.greeted.remove(&name);
                self.control.forget(&name);
                if let Some(id) = self.shared.peers.known_id(&name) {
                    self.ep.handle_peer_lost(now, id);
                }
            }
            Cmd::Hello(name, losses) => {
                if !self.shared.peers.compatible(&name) {
                    tracing::debug!(peer = name, "no HELLO to a peer that cannot bounce with us");
                } else if let Err(e) = self.control.send(&name, &wire::encode_hello(self.session)) {
                    // The application may have unloaded the peer since this was queued (its
                    // loss is recorded before the inner engine disconnects), and loaded it
                    // again (then compatible, but the inner engine may not know it yet: the
                    // reload queues its own HELLO): nothing is wrong.
                    if self.shared.peers.compatible(&name) && self.shared.peers.losses() == losses {
                        tracing::warn!(peer = name, error = %e, "sending HELLO failed; the peer stays on plain UCX to us");
                    } else {
                        tracing::debug!(peer = name, error = %e, "no HELLO: the peer was unloaded meanwhile");
                    }
                } else {
                    self.greeted.insert(name);
                }
            }
            Cmd::Registered(d, a, l, arena) => self.ep.add_registered(d.reg, d.key, (a, l), arena),
            Cmd::Deregister { reg, addr, len, done } => {
                // Let the core fail what uses the range first (so each such transfer ends as
                // Deregistered and is counted so, whatever it had queued), then hand out what
                // it emitted (the fence, still marking the range, refuses the jobs on it), then
                // lift the mark at once: the same addresses may be registered again by the next
                // command. `settle` signals once the jobs already running on the range have ended.
                self.ep.deregister(now, reg, addr, len);
                let _ = self.drain_actions();
                let range = (addr, addr.saturating_add(len));
                self.shared.fence.applied(range);
                if let Some(done) = done {
                    self.deregs.push(PendingDereg { start: range.0, end: range.1, _done: done });
                }
            }
            Cmd::Unload(mds) => self.retire(mds),
        }
    }

    fn drop_frame(&mut self, now: Instant, peer: &str, why: &dyn std::fmt::Display) {
        Stats::bump(&self.shared.stats.control_dropped);
        if self.warn_budget.allow(now) {
            tracing::warn!(peer, reason = %why, "dropping control frame");
        }
    }

    fn on_control(&mut self, now: Instant, peer: &str, bytes: &[u8]) {
        let _span = tracing::trace_span!("control", peer, len = bytes.len()).entered();
        // One decoder for every frame kind: HELLO is a frame like the others (the core's).
        let frame = match wire::ControlFrame::decode(bytes) {
            Ok(f) => f,
            Err(e) => return self.drop_frame(now, peer, &e),
        };
        let msg = match frame.body {
            wire::Body::Hello => {
                // The first HELLO of a compatible peer since its load is answered once: its
                // copy of ours may have been evicted from its bounded hints.
                if let Hello::First { answer: true } = self.shared.peers.hello(peer) {
                    if let Err(e) = self.control.send(peer, &wire::encode_hello(self.session)) {
                        tracing::debug!(peer, error = %e, "answering a HELLO failed");
                    }
                }
                return;
            }
            wire::Body::Ping { .. } | wire::Body::Pong { .. } => return self.on_probe(now, peer, frame),
            wire::Body::Goodbye => {
                match self.shared.peers.goodbye(peer, frame.session) {
                    Ok((id, unload)) => {
                        tracing::info!(peer, "peer said goodbye: its transfers fail, its arena is forgotten");
                        self.greeted.remove(peer);
                        self.retire(unload);
                        self.ep.handle_goodbye(now, id);
                    }
                    // A one-way initiator we never loaded says GOODBYE too: nothing binds it
                    // to a session, so it cannot end its flows here (their timers do).
                    Err(FrameRefused::NotLoaded) => tracing::debug!(peer, "GOODBYE from an agent never loaded"),
                    Err(e) => self.drop_frame(now, peer, &e),
                }
                return;
            }
            wire::Body::Msg(msg) => msg,
        };
        crate::shell::mark!(format_args!("recv-{}", msg.kind_name()), bytes.len());
        // The session must be the one of the peer's loaded metadata; a new one arrives only
        // through a metadata reload (`Engine::load_conn_info`), never through a frame.
        let admitted = match self.shared.peers.admit(peer, frame.session) {
            // One way: an initiator we never loaded may open a flow answered through our
            // mailbox, then send that flow's frames (each carries the flow's token).
            Err(FrameRefused::NotLoaded) if self.ep.admits_one_way(self.shared.peers.known_id(peer), &msg) => {
                self.shared.peers.admit_one_way(peer)
            }
            r => r,
        };
        let id = match admitted {
            Ok(id) => id,
            Err(e) => {
                if matches!(e, FrameRefused::StaleSession { .. }) {
                    self.sessions_forged += 1;
                }
                return self.drop_frame(now, peer, &e);
            }
        };
        if let Err(e) = self.ep.handle_msg(now, id, msg) {
            self.drop_frame(now, peer, &e);
        }
    }

    /// A PING or PONG of the liveness probe: admitted by the same session and loading rules as
    /// any frame (a PONG of a dead incarnation is stale), then handed to the core.
    fn on_probe(&mut self, now: Instant, peer: &str, frame: wire::ControlFrame) {
        let id = match self.shared.peers.admit(peer, frame.session) {
            Ok(id) => id,
            Err(e) => {
                if matches!(e, FrameRefused::StaleSession { .. }) {
                    self.sessions_forged += 1;
                }
                return self.drop_frame(now, peer, &e);
            }
        };
        match frame.body {
            wire::Body::Ping { nonce } => self.ep.handle_ping(now, id, nonce),
            wire::Body::Pong { nonce } => self.ep.handle_pong(now, id, nonce),
            _ => {}
        }
    }

    /// Our one-way transfers' mailbox READs: hands finished fetches to the core, frees the
    /// slices of ended transfers, and posts the fetches that are due (see `fetch`).
    fn poll_fetches(&mut self, now: Instant) -> bool {
        if self.area.is_none() {
            return false;
        }
        let mut moved = false;
        for xfer in self.fetches.xfers() {
            let live = self.ep.fetch(xfer).is_some();
            let Some(poll) = self.fetches.poll(xfer, now) else { continue };
            let mut pending = false;
            let mut k = 0;
            while k < poll.reads.len() {
                match self.data.check(&poll.reads[k]) {
                    WriteState::InProg => {
                        pending = true;
                        k += 1;
                        continue;
                    }
                    WriteState::Done => {}
                    WriteState::Failed(st) => {
                        tracing::debug!(xfer = xfer.0, status = %st, "a mailbox READ failed");
                        poll.failed = true;
                    }
                }
                let id = poll.reads.swap_remove(k);
                self.data.release(id);
            }
            if pending {
                continue;
            }
            if !live {
                self.fetches.remove(xfer);
                continue;
            }
            if poll.posted {
                let (failed, slice, len) = (poll.failed, poll.slice, poll.len);
                let took = now.saturating_duration_since(poll.posted_at);
                crate::shell::mark!("fetch-done", xfer.0);
                moved = true;
                let stats = &self.shared.stats;
                Stats::bump(&stats.mailbox_fetches);
                stats.mailbox_fetch_us.fetch_add(took.as_micros() as u64, Ordering::Relaxed);
                if failed {
                    // The target is gone or its arena unreachable: no answer will come.
                    self.fetches.fetched(xfer, 0, now);
                    self.ep.handle_fetch_failed(now, xfer);
                } else {
                    let at = self.one_way.fetch_offset + u64::from(slice) * self.one_way.fetch_slice;
                    // An unreadable fetch reads as nothing new: the next poll tries again, and
                    // the transfer's timeout bounds the wait.
                    let image = match self.area.as_ref().map(|a| a.get(at, len)) {
                        Some(Some(image)) => image,
                        Some(None) => {
                            self.area_outside("reading fetched answers");
                            Vec::new()
                        }
                        None => Vec::new(),
                    };
                    let new = self.ep.handle_fetched(now, xfer, &image);
                    if new > 0 {
                        crate::shell::mark!("fetched", new);
                    }
                    self.fetches.fetched(xfer, new, now);
                }
                let _ = self.drain_actions();
            }
        }
        let due: Vec<XferId> = self.ep.one_way_xfers().collect();
        for xfer in due {
            moved |= self.post_fetch(now, xfer);
        }
        moved
    }

    /// Posts the fetch of `xfer` when it is due and none is in flight; true when it posted.
    fn post_fetch(&mut self, now: Instant, xfer: XferId) -> bool {
        let Some(poll) = self.fetches.poll(xfer, now) else { return false };
        if poll.posted || poll.next_at > now {
            return false;
        }
        let Some(f) = self.ep.fetch(xfer) else { return false };
        let slice_at = self.one_way.fetch_offset + u64::from(poll.slice) * self.one_way.fetch_slice;
        let (Some(area), Some((name, mb))) = (self.area, self.shared.peers.mailbox_target(f.peer)) else {
            self.ep.handle_fetch_failed(now, xfer);
            let _ = self.drain_actions();
            return true;
        };
        poll.posted = true;
        poll.posted_at = now;
        crate::shell::mark!("fetch", xfer.0);
        poll.remote_md = Some(mb.md);
        let mut off = 0;
        for r in &f.regions {
            // Within our slice (the core's fetches never exceed one) and the peer's mailbox
            // registration (its layout was checked against it when it was loaded).
            let inside =
                mb.offset.checked_add(r.offset).and_then(|o| o.checked_add(r.len)).is_some_and(|end| end <= mb.len)
                    && off + r.len <= self.one_way.fetch_slice;
            let local = area.side(slice_at + off, r.len).filter(|_| inside);
            let Some(local) = local else {
                poll.failed = true;
                break;
            };
            let remote = WriteSide { mem: MemSeg::Dram, md: mb.md, addr: mb.base + mb.offset + r.offset, dev: 0 };
            match self.data.read(&name, local, remote, r.len) {
                Ok(Posted::Done) => {}
                Ok(Posted::InFlight(id)) => poll.reads.push(id),
                Err(st) => {
                    tracing::debug!(peer = name, status = %st, "posting a mailbox READ failed");
                    poll.failed = true;
                    break;
                }
            }
            off += r.len;
        }
        poll.len = off;
        true
    }

    /// Polls in-flight writes oldest first. After each completion the core's reaction (the
    /// chunk's DATA) goes out before anything else is polled: polling progresses the inner
    /// engine, which may run the next write's copy first and hold the DATA back behind it.
    fn poll_writes(&mut self, now: Instant) -> bool {
        let mut moved = false;
        let mut i = 0;
        while i < self.writes.len() {
            let ok = match self.data.check(&self.writes[i].id) {
                WriteState::InProg => {
                    i += 1;
                    continue;
                }
                WriteState::Done => true,
                WriteState::Failed(st) => {
                    tracing::debug!(status = %st, "a bounce write failed");
                    false
                }
            };
            let w = self.writes.remove(i);
            self.finish_write(now, w, ok);
            let _ = self.drain_actions();
            moved = true;
        }
        moved
    }

    /// Keeps a write or READ just posted in flight, or finishes it at once when its first check
    /// finds it done; true when it finished (and the core was told). On one host UCX copies
    /// inside the post and needs one more progress for the completion, which otherwise waited
    /// for a later pass's poll (0.5-0.9 ms in a 2-core trace, the receiver idle meanwhile).
    fn track_posted(&mut self, now: Instant, w: InFlightWrite) -> bool {
        let ok = match self.data.check(&w.id) {
            WriteState::InProg => {
                self.writes.push(w);
                return false;
            }
            WriteState::Done => true,
            WriteState::Failed(st) => {
                tracing::debug!(status = %st, "a bounce write failed");
                false
            }
        };
        self.finish_write(now, w, ok);
        true
    }

    /// Releases a finished write or READ and tells the core (its actions are the caller's to
    /// drain).
    fn finish_write(&mut self, now: Instant, w: InFlightWrite, ok: bool) {
        crate::shell::mark!(if w.read { "read-done" } else { "write-done" }, w.job.0);
        self.data.release(w.id);
        if let Some(pin) = w.pin {
            self.shared.fence.unpin(pin);
        }
        if w.read {
            self.ep.handle_read_done(now, w.job, ok);
        } else {
            self.ep.handle_write_done(now, w.job, ok);
        }
    }

    /// Carries out the core's actions, then posts queued writes one at a time, carrying out
    /// what each completion produces before the next write. UCX's shared-memory path copies a
    /// write synchronously inside its post, so a chunk's DATA is produced during the post; sent
    /// right away, the receiver scatters that chunk while the next one is written. (Posting
    /// every granted write first held all the DATAs back until the whole window was written:
    /// the receiver idled for 7 ms per 32 MiB window on the 2-core machine, BENCHMARKS.md.)
    fn drain_actions(&mut self) -> bool {
        let mut moved = false;
        let mut read_posted = false;
        loop {
            while let Some(a) = self.ep.poll_action() {
                moved = true;
                match a {
                    Action::Send { peer, msg } => self.send(peer, msg),
                    Action::Link { peer, body } => self.send_link(peer, body),
                    Action::Gather { job, arena, region, runs, .. } => {
                        self.copy(job, Dir::Gather, (arena, region), runs, None);
                    }
                    Action::Scatter { job, arena, region, runs, in_region, inline, .. } => {
                        // An inline chunk's bytes go into its region first (a host arena: the
                        // core takes none otherwise); not put, nothing may be scattered.
                        if inline.is_some_and(|bytes| !self.copiers.put(arena, region, &bytes)) {
                            self.copies.insert(job, CopyInFlight { dir: Dir::Scatter, pin: None, in_region: false });
                            self.copy_done(Instant::now(), job, false);
                        } else {
                            self.copy(job, Dir::Scatter, (arena, region), runs, in_region);
                        }
                    }
                    Action::Write { job, peer, source, arena, remote_arena, remote, len, .. } => {
                        let w = QueuedWrite { job, peer, source, arena, remote_arena, remote, len };
                        self.queued_writes.push_back(w);
                        // Posted now, before the actions after it: a chunk's PLAN follows its
                        // write, and encoding a scattered chunk's PLAN takes the reactor 100 us
                        // or more (on the H200 two PLANs held both writes back ~300 us). Unless
                        // a write of this drain is over already: its DATA is queued behind
                        // these actions and goes first (posted below, once they are done).
                        if !self.over_at_post {
                            self.post_queued_writes();
                        }
                    }
                    Action::Read { job, peer, remote_arena, remote, arena, local, len, .. } => {
                        let r = QueuedRead { job, peer, remote_arena, remote, arena, local, len };
                        if read_posted {
                            self.queued_reads.push_back(r);
                        } else {
                            read_posted = true;
                            self.read(r);
                        }
                    }
                    Action::PutRecord { offset, bytes } => {
                        // Only an engine with a one-way area keeps a mailbox; the core places
                        // records inside it. A record not written is an answer the initiator
                        // never reads: its transfer times out.
                        if self.area.is_some_and(|a| !a.put(offset, &bytes)) {
                            self.area_outside("writing a mailbox record");
                        }
                        crate::shell::mark!(format_args!("put-{}", Record::kind_name(&bytes)), offset);
                    }
                    Action::Complete { xfer, outcome } => self.complete(xfer, outcome),
                }
            }
            // Copies run inline just now are done: their completions go on at once (a scatter's
            // ACK, a gathered chunk's write), not at the next pass's poll, which on a busy
            // 2-core host can be tens of microseconds away.
            if self.finish_inline_copies() {
                moved = true;
                continue;
            }
            // The first READ of a drain goes at once, each later one after what the READ
            // before it caused. Between processes of one host UCX copies a READ inside its post
            // (`process_vm_readv`, 100-150 us a MiB on the H200 host): the two READs a mailbox
            // fetch with two READY records asked for, posted back to back, held the first one's
            // RELEASE and scatter behind the second one's copy.
            if let Some(r) = self.queued_reads.pop_front() {
                self.read(r);
                moved = true;
                continue;
            }
            // Every action of the writes over at their post is carried out.
            self.over_at_post = false;
            if self.stopping || !self.post_queued_writes() {
                return moved;
            }
            moved = true;
        }
    }

    /// Hands the core the completions of copies that finished inside their submit; true when
    /// there were any (they may have queued actions).
    fn finish_inline_copies(&mut self) -> bool {
        let mut done = std::mem::take(&mut self.inline_done);
        if self.copiers.take_finished_inline(&mut done) == 0 {
            self.inline_done = done;
            return false;
        }
        let now = Instant::now();
        for (job, ok) in done.drain(..) {
            self.copy_done(now, job, ok);
        }
        self.inline_done = done;
        true
    }

    /// Posts one queued write whose peer has room; true when it posted one. The caller drains
    /// what the write produced (on one host UCX copies it inside the post, so its DATA is
    /// ready at once) before it posts the next: posted back to back, five synchronous 2 MiB
    /// writes held the first one's DATA ~950 us on the 2-core machine. The oldest queued write
    /// whose peer has room goes first: a peer that stopped answering (its writes never
    /// complete: UCX's flush waits for it) must not hold back the writes to every other peer.
    fn post_queued_writes(&mut self) -> bool {
        if self.stopping {
            return false;
        }
        let room = |peer: PeerId| self.writes.iter().filter(|w| w.peer == peer).count() < MAX_WRITES_IN_FLIGHT;
        let Some(i) = self.queued_writes.iter().position(|w| room(w.peer)) else { return false };
        let Some(w) = self.queued_writes.remove(i) else { return false };
        self.over_at_post |= self.write(w);
        true
    }

    fn send(&mut self, peer: PeerId, msg: Msg) {
        let Some(name) = self.shared.peers.name(peer) else { return };
        crate::shell::mark!(format_args!("send-{}", msg.kind_name()), peer.0);
        let bytes = Frame { session: self.session, msg }.to_vec();
        let _span = tracing::trace_span!("send", peer = name, len = bytes.len()).entered();
        if let Err(e) = self.control.send(&name, &bytes) {
            self.send_failed(peer, &name, &e);
        }
    }

    /// Sends a link-level frame (the liveness probe's PING or PONG).
    fn send_link(&mut self, peer: PeerId, body: wire::Body) {
        let Some(name) = self.shared.peers.name(peer) else { return };
        let bytes = wire::ControlFrame { session: self.session, body }.to_vec();
        if let Err(e) = self.control.send(&name, &bytes) {
            self.send_failed(peer, &name, &e);
        }
    }

    /// The core placed a record or a fetch outside our one-way area (a core bug: it places
    /// them inside).
    fn area_outside(&mut self, what: &'static str) {
        if self.warn_budget.allow(Instant::now()) {
            tracing::warn!("{what} failed: range outside the one-way area");
        }
    }

    fn send_failed(&mut self, id: PeerId, peer: &str, e: &ControlError) {
        if self.warn_budget.allow(Instant::now()) {
            // The transfer this belonged to fails by the liveness probe or times out; never
            // block the reactor.
            tracing::warn!(peer, error = %e, "sending a control frame failed");
        }
        // UCX fails a send with ERR_REMOTE_DISCONNECT only once the peer's endpoint has failed
        // (measured: a SIGKILLed receiver's first PING, 250 ms after its last frame, already
        // failed so): nothing sent to it can arrive any more, so its transfers need not wait for
        // the probe's verdict.
        if matches!(e, ControlError::Notif(NixlStatus::ErrRemoteDisconnect)) {
            self.ep.handle_peer_unreachable(Instant::now(), id);
        }
    }

    fn copy(
        &mut self,
        job: JobId,
        dir: Dir,
        (arena, region): (ArenaId, Region),
        runs: JobRuns,
        in_region: Option<InRegionPlan>,
    ) {
        // A plan in the region is not known yet: it may touch any range the flow proved
        // (`(starts[i], reach[i])` covers range i and is within the hull). Nothing is collected:
        // a gather names thousands of runs, and this runs on the reactor for every job.
        let span = match &in_region {
            Some(p) => p.allowed.hull(),
            None => runs_span(&runs),
        };
        let pin = match span {
            Some(span) => {
                let touches = |(s, e): (u64, u64)| match &in_region {
                    Some(p) => p.allowed.starts().iter().zip(p.allowed.reach()).any(|(&a, &b)| a < e && s < b),
                    None => runs_touch(&runs, (s, e)),
                };
                match self.shared.fence.pin(span, touches) {
                    Some(pin) => Some(pin),
                    None => {
                        // Its memory was deregistered since the core emitted it: never run it.
                        self.dereg_refused += 1;
                        self.copies.insert(job, CopyInFlight { dir, pin: None, in_region: false });
                        return self.copy_done(Instant::now(), job, false);
                    }
                }
            }
            None => None,
        };
        self.copies.insert(job, CopyInFlight { dir, pin, in_region: in_region.is_some() });
        crate::shell::mark!(if dir == Dir::Gather { "copy-gather" } else { "copy-scatter" }, job.0);
        if self.copiers.submit(arena, CopyJob { job, dir, region, runs, in_region }).is_err() {
            self.copy_done(Instant::now(), job, false);
        }
    }

    /// The bytes of a WRITE's one chunk, gathered now to ride in its WANT, when the core sends
    /// chunks of its size inline (`bounce_inline_bytes`; never from a GPU arena). Pinned in the
    /// fence like any gather: a deregistration of the sources returns only once no copy reads
    /// them, and sources already deregistered are not read (the transfer then goes the usual
    /// way, where its gather is refused and it fails as deregistered).
    fn inline_bytes(&mut self, plan: &bounce_proto::plan::Plan) -> Option<Vec<u8>> {
        let [chunk] = &plan.chunks[..] else { return None };
        if chunk.bytes > self.ep.inline_bytes() || chunk.region_plan.is_some() {
            return None;
        }
        // From host memory only: a GPU arena's sources are GPU addresses, never read by the CPU.
        if self.arenas.get(usize::from(plan.local_arena.0)).map(|a| a.place.mem) != Some(MemKind::Dram) {
            return None;
        }
        let runs = &chunk.gather;
        let pin = self.shared.fence.pin(runs_span(runs)?, |range| runs_touch(runs, range))?;
        let bytes = self.copiers.gather_inline(runs, chunk.bytes);
        self.shared.fence.unpin(pin);
        bytes
    }

    fn copy_done(&mut self, now: Instant, job: JobId, ok: bool) {
        crate::shell::mark!("copy-done", job.0);
        let dir = self.copies.remove(&job).map(|c| {
            if let Some(pin) = c.pin {
                self.shared.fence.unpin(pin);
            }
            if c.in_region && !ok {
                Stats::bump(&self.shared.stats.region_plans_failed);
            }
            c.dir
        });
        match dir {
            Some(Dir::Gather) => self.ep.handle_gather_done(now, job, ok),
            Some(Dir::Scatter) => self.ep.handle_scatter_done(now, job, ok),
            None => tracing::error!(job = job.0, "completion for an unknown copy job"),
        }
    }

    /// The local side of a write: our arena, or user memory registered through this engine.
    fn write_source(&self, source: WriteSource, arena: ArenaId, len: u64) -> Option<WriteSide> {
        let arena = self.arenas.get(usize::from(arena.0))?;
        match source {
            WriteSource::Arena(r) => Some(arena.side(r.offset)),
            WriteSource::User { addr } => {
                // Only from a registration of the arena's memory: the gate planned it so.
                let (md, reg) = self.shared.registry.covering(arena.place, addr, len)?;
                Some(WriteSide { mem: reg.mem.into(), md, addr, dev: reg.dev })
            }
        }
    }

    /// The peer arena a write into (or READ of) its region `remote` of `len` bytes goes
    /// through, with the peer's name; `None` when it must not be posted: the peer is gone (NIXL
    /// disconnected it and our PeerLost command is still queued: the loss is taken now, so its
    /// transfers fail as lost, not as a failed write), or the region lies outside its arena.
    /// The core checked the region against its own bookkeeping; only we know the peer's arena
    /// size, and a region pointing outside it comes from a broken or hostile peer.
    fn peer_region(
        &mut self,
        now: Instant,
        peer: PeerId,
        remote: (ArenaId, Region),
        len: u64,
    ) -> Option<(String, PeerArena)> {
        match self.shared.peers.write_target(peer, remote, len) {
            Ok(target) => Some(target),
            Err(WriteRefused::Gone) => {
                self.ep.handle_peer_lost(now, peer);
                None
            }
            Err(WriteRefused::NoArena) => None,
            Err(WriteRefused::Credit(name, e)) => {
                self.drop_frame(now, &name, &e);
                None
            }
        }
    }

    /// A READ's RDMA read of the peer's ready region `remote` into our staging region `local`.
    fn read(&mut self, r: QueuedRead) {
        let QueuedRead { job, peer, remote_arena, remote, arena, local, len } = r;
        crate::shell::mark!("read", job.0);
        let now = Instant::now();
        let Some((name, pa)) = self.peer_region(now, peer, (remote_arena, remote), len) else {
            return self.ep.handle_read_done(now, job, false);
        };
        let Some(local_side) = self.arenas.get(usize::from(arena.0)).map(|a| a.side(local.offset)) else {
            // The core names only arenas it was given: a bug, failed, never read elsewhere.
            tracing::error!(arena = arena.0, "READ into an arena we do not have");
            return self.ep.handle_read_done(now, job, false);
        };
        let remote_side = WriteSide { mem: pa.mem.into(), md: pa.md, addr: pa.base + remote.offset, dev: pa.dev };
        match self.data.read(&name, local_side, remote_side, len) {
            Ok(Posted::Done) => self.ep.handle_read_done(now, job, true),
            Ok(Posted::InFlight(id)) => {
                self.track_posted(now, InFlightWrite { read: true, peer, job, id, pin: None, remote_md: pa.md });
            }
            Err(st) => {
                tracing::warn!(peer = name, status = %st, "posting a bounce READ failed");
                self.ep.handle_read_done(now, job, false);
            }
        }
    }

    /// Posts a write; true when it is over already (finished inside its post, or failed), so
    /// that the core holds its consequence (its DATA) among its actions.
    fn write(&mut self, w: QueuedWrite) -> bool {
        let QueuedWrite { job, peer, source, arena, remote_arena, remote, len } = w;
        let now = Instant::now();
        let Some((name, pa)) = self.peer_region(now, peer, (remote_arena, remote), len) else {
            self.ep.handle_write_done(now, job, false);
            return true;
        };
        let _span = tracing::trace_span!("write", job = job.0, peer = %name, len).entered();
        let Some(local) = self.write_source(source, arena, len) else {
            // The gate planned a direct chunk only inside a registration, and only a
            // deregistration removes one: it took the source away before its fence mark (the
            // registry goes first), so this is the same refusal as the fence's.
            tracing::debug!(peer = name, "direct-source chunk is no longer in registered memory");
            self.dereg_refused += 1;
            self.ep.handle_write_done(now, job, false);
            return true;
        };
        let user = match source {
            WriteSource::User { addr } => Some((addr, addr.saturating_add(len))),
            WriteSource::Arena(_) => None,
        };
        // A direct write reads user memory: pinned, so a deregistration waits for it (and one
        // that came first refuses it).
        let pin = match user {
            Some(span) => match self.shared.fence.pin(span, |_| true) {
                Some(pin) => Some(pin),
                None => {
                    tracing::debug!(peer = name, "direct-source chunk was deregistered");
                    self.dereg_refused += 1;
                    self.ep.handle_write_done(now, job, false);
                    return true;
                }
            },
            None => None,
        };
        let remote = WriteSide { mem: pa.mem.into(), md: pa.md, addr: pa.base + remote.offset, dev: pa.dev };
        crate::shell::mark!("write", job.0);
        let posted = self.data.write(&name, local, remote, len);
        crate::shell::mark!(
            if matches!(posted, Ok(Posted::InFlight(_))) { "write-posted" } else { "write-done" },
            job.0
        );
        // Only a write still in flight keeps its pin.
        let pin = match (&posted, pin) {
            (Ok(Posted::InFlight(_)), pin) => pin,
            (_, Some(pin)) => {
                self.shared.fence.unpin(pin);
                None
            }
            (_, None) => None,
        };
        match posted {
            Ok(Posted::Done) => self.ep.handle_write_done(now, job, true),
            Ok(Posted::InFlight(id)) => {
                return self.track_posted(now, InFlightWrite { read: false, peer, job, id, pin, remote_md: pa.md });
            }
            Err(st) => {
                tracing::warn!(peer = name, status = %st, "posting a bounce write failed");
                self.ep.handle_write_done(now, job, false);
            }
        }
        true
    }

    fn complete(&mut self, xfer: XferId, outcome: std::result::Result<(), XferError>) {
        crate::shell::mark!("complete", xfer.0);
        let Some(ctx) = self.xfers.remove(&xfer) else { return };
        // The core's counters first: an application that sees the request settle and then
        // reads the counters must find what ended it counted.
        self.publish_gauges();
        let stats = &self.shared.stats;
        match &outcome {
            Ok(()) => {
                Stats::bump(&stats.bounce_ok);
                Stats::bump(if ctx.read { &stats.bounce_read_ok } else { &stats.bounce_write_ok });
                // Every chunk is scattered: now the notification may tell the peer's
                // application its data is in place (the same promise UCX makes).
                if let Some(msg) = &ctx.notif {
                    if let Err(st) = self.data.notify(&ctx.peer, msg) {
                        tracing::warn!(peer = ctx.peer, status = %st, "sending the transfer's notification failed");
                    }
                }
            }
            Err(e) => {
                Stats::bump(&stats.bounce_failed);
                tracing::debug!(xfer = xfer.0, error = %e, "bounce transfer failed");
            }
        }
        self.shared.requests.finish(ctx.handle, xfer, outcome);
    }

    /// The engine is being destroyed: fails our transfers (no queued write is posted any
    /// more), waits (bounded) for our writes in flight, then says GOODBYE to every peer we
    /// greeted (none of our writes can land in its arena after it) and waits (bounded) for the
    /// grants we gave out to come back (DATA, cancels, reclaims). True when none is left.
    fn close(&mut self) -> bool {
        let now = Instant::now();
        self.ep.close(now);
        self.stop_posting(now);
        let _ = self.run_until(Instant::now() + CLOSE_WAIT, |d| d.writes.is_empty());
        let goodbye = wire::encode_goodbye(self.session);
        for name in std::mem::take(&mut self.greeted) {
            if let Err(e) = self.control.send(&name, &goodbye) {
                tracing::debug!(peer = name, error = %e, "sending GOODBYE failed");
            }
        }
        let quiet = self.run_until(Instant::now() + CLOSE_WAIT, |d| d.ep.grants_outstanding() == 0);
        if !quiet {
            tracing::warn!(
                grants = self.ep.grants_outstanding(),
                "peers still hold grants in our arena: it stays mapped (leaked) rather than handed back"
            );
        }
        quiet
    }

    /// From now on no write is posted: carries out what the core emitted, failing every write
    /// it queued instead of posting it.
    fn stop_posting(&mut self, now: Instant) {
        self.stopping = true;
        let _ = self.drain_actions();
        for w in std::mem::take(&mut self.queued_writes) {
            self.ep.handle_write_done(now, w.job, false);
        }
        let _ = self.drain_actions();
    }

    /// Keeps the loop going (frames, commands, completions; writes are no longer posted) until
    /// `done` holds or `deadline` passes; true when `done` held.
    fn run_until(&mut self, deadline: Instant, done: impl Fn(&Self) -> bool) -> bool {
        loop {
            if done(self) {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            if !self.iterate() {
                std::thread::park_timeout(BUSY_SLEEP);
            }
        }
    }

    /// Fails everything, waits for operations that still touch the arena and unloads every
    /// peer arena; true when every write ended (none was released in flight).
    fn shutdown(&mut self) -> bool {
        let now = Instant::now();
        self.ep.shutdown(now);
        self.stop_posting(now);
        // Writes may still read the arena, and mailbox READs land in the fetch area: wait for
        // them (bounded), then release.
        let deadline = Instant::now() + Duration::from_secs(5);
        while (!self.writes.is_empty() || self.fetches.reading()) && Instant::now() < deadline {
            self.data.progress();
            let _ = self.poll_writes(Instant::now());
            let _ = self.poll_fetches(Instant::now());
            let _ = self.drain_actions();
        }
        let ended = self.writes.is_empty() && !self.fetches.reading();
        for w in self.writes.drain(..) {
            self.data.release(w.id);
            if let Some(pin) = w.pin {
                self.shared.fence.unpin(pin);
            }
        }
        for id in self.fetches.take_reads() {
            self.data.release(id);
        }
        for md in std::mem::take(&mut self.retiring).into_iter().flatten().chain(self.shared.peers.take_arenas()) {
            self.data.unload(md);
        }
        self.shared.arenas_retiring.store(0, Ordering::Relaxed);
        self.publish_gauges();
        // The copy engine waits for its accepted jobs when the Driver drops.
        ended
    }
}
