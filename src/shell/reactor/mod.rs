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
use bounce_proto::endpoint::{Action, Endpoint, JobId, WriteRoute, WriteSource, XferError};
use bounce_proto::gate::ArenaPlace;
use bounce_proto::mailbox::Record;
use bounce_proto::oneway::OneWayLayout;
use bounce_proto::{ArenaId, MemKind, PeerId, Region, Token, XferId};
use parking_lot::Mutex;

use crate::shell::control::{ControlChannel, Inbound};
use crate::shell::copy::route::Copiers;
use crate::shell::copy::{CopyEngine, Dir};
use crate::shell::datapath::{DataPath, WriteId};
use crate::shell::fence::Pin;
use crate::shell::oneway_area::AreaView;
use crate::shell::stats::Stats;
use crate::shell::streak::Streak;
use crate::shell::{Error, Result};
use crate::sys::shim::{Md, WriteSide};
use alarm::Alarm;
use fetch::Fetches;
use pace::AppPolls;

pub(crate) use pace::hot_spin;
pub(crate) use shared::{Cmd, Shared, Signal};

mod alarm;
mod cell;
mod closing;
mod copies;
mod fetch;
mod frames;
mod gauges;
mod one_way;
mod pace;
mod shared;
mod writes;

#[cfg(test)]
mod tests;

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
    /// Our agent name: the name our frames reach peers under, which our proofs are bound to.
    pub(crate) agent: String,
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
/// thread that polls. On hosts of fewer than 8 cores a copy worker whose job ended runs one
/// too ([`cell::WorkerPasses`]). The lock is only ever tried by application threads and copy
/// workers: one that finds it held leaves the work to the thread holding it.
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
    /// The ends of the passes on application threads, no more than [`pace::STAND_DOWN`] apart at
    /// first and up to [`pace::LONGEST_DRIVING_GAP`] once they have run that long (ended when
    /// the poller resigns). While pollers drive, the reactor thread stands down
    /// ([`Cell::standing_down`]).
    driving: Streak,
    /// The longest stand-down: `bounce_idle_park_us`.
    longest_stand_down: Duration,
    epoch: Instant,
    /// A pass panicked, on any thread: the driver's state is suspect, so no thread runs another
    /// pass, and the reactor thread ends without closing (the arena is kept). Set, with `stop`,
    /// before the panicking pass lets go of the driver.
    poisoned: AtomicBool,
    /// How many times the reactor thread came back from a sleep (an idle park, a stand-down, a
    /// lock it found taken, its alarm): on a small host each costs a core for a while, whatever
    /// the thread then does. Counted for the tests only.
    #[cfg(test)]
    wakes: AtomicU64,
    /// The application's pulls of the inner engine's notifications (the data path's
    /// [`DataPath::app_pull_streak`]), read without the driver: beside an application pulling
    /// closely the reactor thread sleeps whether or not it could take the driver.
    pulls: Option<Arc<Streak>>,
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
    /// The fence's mark at the deregistration: the jobs it waits for were pinned up to it.
    mark: u64,
    /// When it began to wait (the writes of failed transfers it waits for only so long).
    since: Instant,
    _done: Signal,
}

/// Longest a deregistration waits for direct writes out of its range whose transfers have
/// failed. Such a write to a peer that stopped never completes, and `deregisterMem` would wait
/// for ever; after this it is let go of (unpinned, still tracked until the inner engine ends
/// it), as plain UCX deregisters with a write in flight. Our own copies are always waited for:
/// they end.
const DEREG_WRITE_WAIT: Duration = Duration::from_secs(1);

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

/// At most a few warnings per second for peer misbehaviour (a hostile peer must not be able to
/// flood the log).
struct RateLimit {
    window: Instant,
    left: u32,
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
    /// Releases of in-flight transfers waiting for their completion (a failed READ's is told
    /// once its scatters into our memory end); declared after `copiers` for the same reason.
    cancels: HashMap<XferId, Signal>,
    /// Peer arenas (each its arena's and mailbox's handles) to unload once no write or READ in
    /// flight uses them.
    retiring: Vec<Vec<Md>>,
    /// Peers we said HELLO to: those that may bounce to us, and so get our GOODBYE.
    greeted: HashSet<String>,
    /// Peers we said GOODBYE to whose PING asking about it we have not answered yet (a
    /// closing engine waits a little for them, see `close`).
    farewells: HashSet<String>,
    /// HELLOs we sent on loading a peer: its HELLO, ask and transfers may follow, unannounced
    /// ([`Self::peer_activity`]).
    hellos_sent: u64,
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
    frames: Vec<Inbound>,
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

impl Reactor {
    /// Starts the reactor thread over `parts`.
    ///
    /// # Errors
    /// When the core rejects the configuration or the thread cannot be started.
    pub(crate) fn start(config: &Config, shared: Arc<Shared>, parts: Parts) -> Result<Self> {
        let Parts { agent, session, endpoint, arenas: parts, one_way: area, data, control, control_budget } = parts;
        // The PING nonces must be unpredictable to others (a forged PONG would keep a dead peer
        // alive, confirm a forged HELLO or a forged farewell): a random key per engine.
        let mut probe_key = [0u8; 32];
        crate::shell::drbg::fill(&mut probe_key)
            .map_err(|error| Error::Random { what: "the PING nonces' key", error })?;
        let mut ep = Endpoint::new(config, Instant::now(), probe_key)?;
        ep.set_local_endpoint(endpoint);
        ep.set_local_name(&agent);
        // The peers live in the shell's table, not the core's own: the probe asks it who
        // answers a PING (it locks the table; the reactor never calls the core holding it).
        let peers = Arc::clone(&shared.peers);
        ep.set_ping_answerers(move |id| peers.answers_pings(id));
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
        let _ = shared.forget_key.set(bounce_proto::forget::key(&probe_key));
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
            cancels: HashMap::new(),
            retiring: Vec::new(),
            greeted: HashSet::new(),
            farewells: HashSet::new(),
            hellos_sent: 0,
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
        let pulls = d.data.app_pull_streak();
        let cell = Arc::new(Cell {
            any_thread: d.copiers.any_thread(),
            own_socket: d.control.own_socket(),
            socket_looked_at: AtomicU64::new(0),
            driver: Mutex::new(Some(d)),
            parked_idle: AtomicBool::new(false),
            busy: AtomicBool::new(false),
            driving: pace::driving_streak(),
            longest_stand_down: config.idle_park,
            epoch: Instant::now(),
            poisoned: AtomicBool::new(false),
            #[cfg(test)]
            wakes: AtomicU64::new(0),
            pulls,
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
                    cell2.run(&stop2, &shared.inbox, idle_park, alarm.as_deref())
                }));
                if quiet.is_err() {
                    tracing::error!("the bounce reactor panicked; failing its transfers, bounce path closed");
                }
                // The copy engine joins its workers here; only then do waiting deregistrations
                // return. Taken under the lock: no application pass runs it any more.
                let d = cell2.driver.lock().take();
                drop(d);
                // Only now may a request be seen failed: no scatter of a READ runs any more
                // (after a panic, on either thread, nothing failed them before; after a stop,
                // `Reactor::halt` does this too).
                shared.requests.close(XferError::ShuttingDown);
                shared.reactor_ended();
                // After a panic nobody knows what peers still hold: keep the arena.
                quiet.unwrap_or(false)
            })
            .map_err(|source| Error::Spawn { what: "reactor", source })?;
        *shared.inbox.thread.lock() = Some(thread.thread().clone());
        // Copy workers run passes only where the reactor thread does not spin after activity
        // (a host of few cores, `cell::WorkerPasses`): on a larger host it sees their
        // completions within microseconds, and a worker's pass measured no better there.
        let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
        if pace::hot_spin(cores).is_zero() {
            let _ = shared.worker_passes.set(cell::WorkerPasses::new(&cell, &stop));
        }
        Ok(Self { shared, cell, stop, thread: Some(thread) })
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

    /// Moves whenever a peer may have begun to address us: it sent a frame on its own
    /// initiative (the core's `peer_msgs`: a HELLO, a PING, its transfer's message to our
    /// target role, handled on any thread) or we greeted it. The reactor thread's idle parks
    /// ramp up from such a change ([`pace::Pace::addressed`]); our own transfers' frames do not
    /// count, as nothing they wait for comes once they have ended.
    fn peer_activity(&self) -> u64 {
        self.ep.stats().peer_msgs + self.hellos_sent
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
        let commanded = !cmds.is_empty();
        for cmd in cmds.drain(..) {
            moved |= cmd.stirs();
            self.handle_cmd(now, cmd);
        }
        // A transfer just submitted opens with a message the target acts on (a READ's PULL, a
        // WRITE's WANT) and its first gathers: they go now, not after the fetches and writes
        // polled below. A one-way READ's first mailbox fetch was posted before its PULL went
        // out, though it cannot find an answer to a PULL not yet sent. (Only after commands:
        // an application's status poll runs a pass each call, and the pass drains at its end.)
        if commanded {
            moved |= self.drain_actions();
        }
        for f in frames.drain(..) {
            moved = true;
            let authentic = self.ep.stats().frames_authentic;
            self.on_control(now, &f.peer, &f.frame);
            // A connection that carried a frame only its peer could make is that peer's: kept
            // when a flood of strangers' connections needs room (ZMQ).
            if f.conn != 0 && self.ep.stats().frames_authentic != authentic {
                self.control.authentic(f.conn, now);
            }
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
        // What the channel still holds for a peer declared dead goes, as for one lost: a ZMQ
        // connection that never completed queued every frame sent to it (review 58). A peer
        // only stalled is reached again by the next send.
        for id in self.ep.take_declared_dead() {
            if let Some(name) = self.shared.peers.name(id) {
                self.control.forget(&name);
            }
        }
        // Gauges first: a deregistration that returns sees its failures counted.
        self.publish_gauges();
        self.settle();
        moved
    }

    /// Signals the deregistrations no running job touches any more, and unloads the retired
    /// peer arenas no write in flight uses.
    fn settle(&mut self) {
        if !self.deregs.is_empty() {
            let now = Instant::now();
            let overdue: Vec<(u64, u64)> = self
                .deregs
                .iter()
                .filter(|d| now.saturating_duration_since(d.since) >= DEREG_WRITE_WAIT)
                .map(|d| (d.start, d.end))
                .collect();
            for range in overdue {
                self.let_go_of_failed_writes(range);
            }
            let fence = &self.shared.fence;
            self.deregs.retain(|d| fence.busy((d.start, d.end), d.mark));
        }
        if !self.retiring.is_empty() {
            // One set of the handles in use, not a scan of every write per retired handle: a
            // peer restarting while its old incarnations' operations never end adds a retired
            // arena each time (review 58).
            let mut busy: HashSet<Md> = self.writes.iter().map(|w| w.remote_md).collect();
            self.fetches.uses_into(&mut busy);
            let data = &mut self.data;
            self.retiring.retain(|mds| {
                if mds.iter().any(|md| busy.contains(md)) {
                    return true;
                }
                for &md in mds {
                    data.unload(md);
                }
                false
            });
            self.shared.arenas_retiring.store(self.retiring.len() as u64, Ordering::Relaxed);
        }
    }

    /// Unpins the direct writes out of `range` whose transfers have failed (see
    /// [`DEREG_WRITE_WAIT`]); a live transfer's write is never let go of.
    fn let_go_of_failed_writes(&mut self, range: (u64, u64)) {
        let fence = &self.shared.fence;
        for w in &mut self.writes {
            let failed = self.ep.is_orphan(w.job);
            if let Some(pin) = w.pin.take_if(|p| failed && fence.pin_touches(p, range)) {
                tracing::warn!(
                    job = w.job.0,
                    "a deregistration waited a second for a write of a failed transfer out of its range: let go of"
                );
                fence.unpin(pin);
            }
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

    fn handle_cmd(&mut self, now: Instant, cmd: Cmd) {
        match cmd {
            Cmd::Submit(p) => {
                let _span = tracing::trace_span!("submit", handle = p.handle).entered();
                crate::shell::mark!("submit", p.handle);
                // The incarnation the request was prepared for, still loaded: else it was lost
                // or reloaded since (its loss may be queued behind this), and the transfer fails
                // as lost at once rather than waiting on an agent NIXL no longer has.
                let current = self.shared.peers.loaded_id(&p.peer).filter(|id| p.peer_id == Some(*id));
                let Some(peer) = current else {
                    let read = p.plan.read;
                    self.xfers.insert(p.xfer, XferCtx { handle: p.handle, peer: p.peer, notif: p.notif, read });
                    Stats::bump(&self.shared.stats.bounce_xfers);
                    self.complete(p.xfer, Err(XferError::PeerLost));
                    return;
                };
                // The peer's leases on our credits run by its own timeout: the core keeps each
                // credit within the smaller of the two.
                if let Some(t) = self.shared.peers.request_timeout(&p.peer) {
                    self.ep.set_peer_timeout(peer, t);
                }
                // Two way once the peer said HELLO; one way (answers READ from its mailbox)
                // when it never loaded us but keeps a mailbox, and we keep a fetch area.
                let one_way = self
                    .area
                    .as_ref()
                    .and_then(|_| self.shared.peers.one_way_target(&p.peer, self.one_way.fetch_slice));
                let one_way = one_way.map(|(_, l)| l);
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
            Cmd::Cancel(x, done) => {
                self.xfers.remove(&x);
                self.ep.cancel(now, x);
                // Its completion is owed while a READ's scatters into our memory run: the
                // release returns once it comes (the `Action::Complete` arm of `drain_actions`).
                if self.ep.owes_completion(x) {
                    self.cancels.insert(x, done);
                }
            }
            Cmd::Forget { peer, endpoint, frame } => {
                // Best effort: a peer that misses it finds out as before (its two-way frames
                // unanswered, the probe's verdict).
                self.count_sent(frame.len());
                match self.control.send_at(&peer, &endpoint, &frame) {
                    Ok(()) => Stats::bump(&self.shared.stats.forgets_sent),
                    Err(e) => tracing::debug!(peer, error = %e, "sending FORGET failed"),
                }
            }
            Cmd::PeerLost(name, id) => {
                self.greeted.remove(&name);
                self.control.forget(&name);
                self.ep.handle_peer_retired(now, id);
            }
            Cmd::Hello(name, losses) => {
                if !self.shared.peers.compatible(&name) {
                    tracing::debug!(peer = name, "no HELLO to a peer that cannot bounce with us");
                } else {
                    match self.send_hello(&name) {
                        // Only a peer greeted is told GOODBYE at the close.
                        Ok(true) => {
                            self.greeted.insert(name);
                            self.hellos_sent += 1;
                        }
                        Ok(false) => tracing::debug!(peer = name, "no HELLO: the peer was unloaded meanwhile"),
                        // The application may have unloaded the peer since this was queued (its
                        // loss is recorded before the inner engine disconnects), and loaded it
                        // again (then compatible, but the inner engine may not know it yet: the
                        // reload queues its own HELLO): nothing is wrong.
                        Err(e) if self.shared.peers.compatible(&name) && self.shared.peers.losses() == losses => {
                            tracing::warn!(peer = name, error = %e, "sending HELLO failed; the peer stays on plain UCX to us");
                        }
                        Err(e) => tracing::debug!(peer = name, error = %e, "no HELLO: the peer was unloaded meanwhile"),
                    }
                }
            }
            Cmd::Registered(d, a, l, arena) => self.ep.add_registered(d.reg, d.key, (a, l), arena),
            Cmd::Deregister { reg, addr, len, done, mark, fenced } => {
                // Let the core fail what uses the range first (so each such transfer ends as
                // Deregistered and is counted so, whatever it had queued), then hand out what
                // it emitted (the fence, still marking the range, refuses the jobs on it), then
                // lift the mark at once: the same addresses may be registered again by the next
                // command. `settle` signals once the jobs already running on the range have ended.
                self.ep.deregister(now, reg, addr, len);
                let _ = self.drain_actions();
                let range = (addr, addr.saturating_add(len));
                if fenced {
                    self.shared.fence.applied(range);
                }
                if let Some(done) = done {
                    self.deregs.push(PendingDereg { start: range.0, end: range.1, mark, since: now, _done: done });
                }
            }
            Cmd::Unload(mds) => self.retire(mds),
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
                            let in_region = in_region.is_some();
                            self.copies.insert(job, CopyInFlight { dir: Dir::Scatter, pin: None, in_region });
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
                        // Marked before the put, as a frame is before its send: once written,
                        // the record may be fetched and handled by the initiator before a mark
                        // taken after it (seen on 2 cores: handled 66 us "before" the put).
                        crate::shell::mark!(("put-", Record::kind_name(&bytes)), offset);
                        // Only an engine with a one-way area keeps a mailbox; the core places
                        // records inside it. A record not written is an answer the initiator
                        // never reads: its transfer times out.
                        if self.area.is_some_and(|a| !a.put(offset, &bytes)) {
                            self.area_outside("writing a mailbox record");
                        }
                    }
                    Action::Complete { xfer, outcome } => {
                        // A release waiting for this transfer returns now.
                        self.cancels.remove(&xfer);
                        self.complete(xfer, outcome);
                    }
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

    fn complete(&mut self, xfer: XferId, mut outcome: std::result::Result<(), XferError>) {
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
                // application its data is in place (the same promise UCX makes). One that
                // cannot be sent fails the request, as UCX's would: reported done, the peer's
                // application would wait for a notification that never comes.
                if let Some(msg) = &ctx.notif {
                    if let Err(st) = self.data.notify(&ctx.peer, msg) {
                        tracing::warn!(peer = ctx.peer, status = %st, "sending the transfer's notification failed");
                        outcome = Err(XferError::NotifFailed);
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
}
