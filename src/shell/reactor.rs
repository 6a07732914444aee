//! The reactor: one IO thread per engine that owns the sans-IO [`Endpoint`] and does what it
//! asks: sends control frames through the inner engine's notifications, runs gathers and
//! scatters on the copy workers, posts and polls RDMA writes, and records completions.
//!
//! Each iteration drains the inbox (application commands, control frames routed from either
//! thread, copy completions), progresses the inner engine, polls in-flight writes, fires timers,
//! then drains `poll_action()` to `None` (quinn's `ConnectionDriver` loop). Polling adapts: it
//! spins while work is in flight, backs off to short sleeps when progress stalls, and parks
//! (woken by new commands) when idle, so an idle engine costs no core.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::thread::{JoinHandle, Thread};
use std::time::{Duration, Instant};

use bounce_proto::config::Config;
use bounce_proto::endpoint::{Action, Endpoint, JobId, WriteSource, XferError};
use bounce_proto::wire::{self, Frame, Msg};
use bounce_proto::{PeerId, XferId};
use parking_lot::Mutex;

use crate::ffi::shim::{Md, Shim, WriteHandle};

use super::zmq_channel::ZmqChannel;
use crate::shell::requests::{Posted, Requests};
use crate::shell::stats::Stats;
use crate::shell::worker::{ArenaView, CopyJob, Dir, Workers};

/// A command for the reactor.
#[derive(Debug)]
pub(super) enum Cmd {
    /// Run a posted request.
    Submit(Posted),
    /// The application released an in-flight request.
    Cancel(XferId),
    /// A control frame from a peer agent.
    Control {
        /// Sender agent.
        peer: String,
        /// The raw frame.
        frame: Vec<u8>,
    },
    /// A copy job finished.
    CopyDone(JobId, bool),
    /// The peer disconnected.
    PeerLost(String),
    /// We loaded this peer's connection info: tell it we can answer (HELLO).
    Hello(String),
    /// Memory registered through this engine (the receiver may scatter into it).
    Registered(u64, u64, Md),
    /// Memory deregistered.
    Deregistered(u64, u64, Md),
}

/// The reactor's mailbox: a queue plus the thread to wake.
#[derive(Default)]
pub(super) struct Inbox {
    q: Mutex<VecDeque<Cmd>>,
    thread: Mutex<Option<Thread>>,
}

impl Inbox {
    /// Queues a command and wakes the reactor.
    pub(super) fn push(&self, cmd: Cmd) {
        self.q.lock().push_back(cmd);
        if let Some(t) = self.thread.lock().as_ref() {
            t.unpark();
        }
    }

    fn drain(&self, out: &mut Vec<Cmd>) {
        out.extend(self.q.lock().drain(..));
    }
}

/// What the reactor knows of a peer's arena (filled by the engine when its conn info loads).
#[derive(Debug, Clone, Copy)]
pub(super) struct PeerArena {
    /// Arena base address at the peer.
    pub base: u64,
    /// Arena length at the peer.
    pub len: u64,
    /// Device id.
    pub dev: u64,
    /// Inner-engine metadata from loadRemoteMD.
    pub md: Md,
}

/// Shared between the engine (application threads) and the reactor.
pub(super) struct Shared {
    /// Commands.
    pub inbox: Inbox,
    /// Bounce requests.
    pub requests: Requests,
    /// Counters.
    pub stats: Arc<Stats>,
    /// Peers' arenas by agent name.
    pub peer_arenas: Mutex<HashMap<String, PeerArena>>,
    /// Agents whose connection info NIXL loaded into this engine (the only ones we talk to),
    /// with their capabilities when compatible with ours.
    pub peers: Mutex<HashMap<String, Option<bounce_proto::wire::Capabilities>>>,
    /// Agents that told us (HELLO) they loaded OUR connection info, so they can answer a WANT.
    pub reachable: Mutex<std::collections::HashSet<String>>,
}

/// How this engine's control frames travel.
pub(super) struct Control {
    /// Our inner conn info, carried in WANTs (the design's reverse path).
    pub endpoint: Vec<u8>,
    /// The ZMQ channel when `bounce_control=zmq`; UCX notifications otherwise.
    pub zmq: Option<ZmqChannel>,
}

/// A running reactor; dropping it stops and joins the thread (and the workers).
pub(super) struct Reactor {
    shared: Arc<Shared>,
    stop: Arc<std::sync::atomic::AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

struct InFlightWrite {
    job: JobId,
    handle: WriteHandle,
}

struct QueuedWrite {
    job: JobId,
    peer: PeerId,
    source: WriteSource,
    remote: bounce_proto::Region,
    len: u64,
}

struct XferCtx {
    handle: u64,
    peer: String,
    notif: Option<Vec<u8>>,
}

struct Driver {
    ep: Endpoint,
    shim: Shim,
    shared: Arc<Shared>,
    session: u64,
    arena: ArenaView,
    arena_md: Md,
    workers: Workers,
    writes: Vec<InFlightWrite>,
    /// Writes the core asked for that wait for a slot (see MAX_WRITES_IN_FLIGHT).
    queued_writes: VecDeque<QueuedWrite>,
    copies: HashMap<JobId, Dir>,
    xfers: HashMap<XferId, XferCtx>,
    peer_ids: HashMap<String, PeerId>,
    peer_names: HashMap<PeerId, String>,
    peer_sessions: HashMap<PeerId, u64>,
    /// DRAM registrations made through this engine: (addr, len, inner metadata). Direct-source
    /// chunks are written from these.
    user_regs: Vec<(u64, u64, Md)>,
    warn_budget: RateLimit,
    /// Set by shutdown: queued writes are failed, never posted.
    stopping: bool,
    /// The ZMQ control channel when `bounce_control=zmq`; UCX notifications otherwise.
    zmq: Option<ZmqChannel>,
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
    /// Starts the reactor thread and `config.copy_workers` copy workers.
    ///
    /// # Errors
    /// When the core rejects the configuration.
    pub(super) fn start(
        config: &Config,
        shim: Shim,
        shared: Arc<Shared>,
        session: u64,
        arena: ArenaView,
        arena_md: Md,
        control: Control,
    ) -> Result<Self, String> {
        let Control { endpoint: local_endpoint, zmq } = control;
        let mut ep = Endpoint::new(config, Instant::now()).map_err(|e| e.to_string())?;
        ep.set_local_endpoint(local_endpoint);
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let inbox_owner = Arc::clone(&shared);
        let workers = Workers::start(config.copy_workers, arena, move |job, ok| {
            inbox_owner.inbox.push(Cmd::CopyDone(job, ok));
        });
        let mut d = Driver {
            ep,
            shim,
            shared: Arc::clone(&shared),
            session,
            arena,
            arena_md,
            workers,
            writes: Vec::new(),
            queued_writes: VecDeque::new(),
            copies: HashMap::new(),
            xfers: HashMap::new(),
            peer_ids: HashMap::new(),
            peer_names: HashMap::new(),
            peer_sessions: HashMap::new(),
            user_regs: Vec::new(),
            warn_budget: RateLimit { window: Instant::now(), left: 10 },
            stopping: false,
            zmq,
        };
        let stop2 = Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name("bounce-reactor".into())
            .spawn(move || {
                let span = tracing::debug_span!("reactor", session = d.session);
                let _g = span.enter();
                let shared = Arc::clone(&d.shared);
                // A panic here would be a bug in the shell or core. It must not leave requests
                // IN_PROG forever (nothing else runs their timeouts): fail them and refuse new
                // posts; the engine's other entry points keep working on plain UCX.
                if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| d.run(&stop2))).is_err() {
                    tracing::error!("the bounce reactor panicked; failing its transfers, bounce path closed");
                    shared.requests.close(XferError::ShuttingDown);
                }
            })
            .map_err(|e| format!("spawning the reactor failed: {e}"))?;
        *shared.inbox.thread.lock() = Some(thread.thread().clone());
        Ok(Self { shared, stop, thread: Some(thread) })
    }

    /// The state shared with application threads.
    pub(super) fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }
}

impl Drop for Reactor {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Release);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            let _ = t.join();
        }
        // Whatever was still in flight has been failed by the driver's shutdown.
        self.shared.requests.close(XferError::ShuttingDown);
    }
}

/// Most ZMQ messages taken per reactor pass, so a flood cannot starve the rest of the loop.
const ZMQ_POLL_BATCH: usize = 256;
/// Most HELLOs remembered from agents we have not loaded (yet).
const MAX_REACHABLE: usize = 1024;
/// Writes handed to the inner engine at once. UCX runs them one after another anyway; keeping
/// one queued behind the running one keeps the link busy, and holding the rest back here lets
/// each finished chunk's DATA go out at once instead of queueing behind every other write's
/// copy inside UCX's progress (measured: DATA arrived only after all 8 windowed writes).
const MAX_WRITES_IN_FLIGHT: usize = 2;
/// Polls this many times (yielding) with work in flight but nothing moving before sleeping.
/// Measured on the 2-core benchmark machine: 20 beat 200 and 2000 (BENCHMARKS.md).
const SPIN_ITERATIONS: u32 = 20;
/// Sleep between polls once spinning gave nothing (work in flight).
const BUSY_SLEEP: Duration = Duration::from_micros(50);
/// Longest park when idle; also how often an idle engine progresses the inner engine.
const IDLE_PARK: Duration = Duration::from_millis(2);

impl Driver {
    fn run(&mut self, stop: &std::sync::atomic::AtomicBool) {
        let mut cmds = Vec::new();
        let mut stalls = 0u32;
        while !stop.load(std::sync::atomic::Ordering::Acquire) {
            let moved = self.iterate(&mut cmds);
            // Busy includes the receiver role: a remote flow waiting for its next DATA must be
            // noticed at once, not after an idle park (which cost up to 2 ms per chunk).
            let busy = !self.writes.is_empty()
                || !self.queued_writes.is_empty()
                || !self.copies.is_empty()
                || !self.xfers.is_empty()
                || !self.ep.is_idle();
            if moved {
                stalls = 0;
            } else if busy {
                stalls += 1;
                if stalls > SPIN_ITERATIONS {
                    std::thread::park_timeout(BUSY_SLEEP);
                } else {
                    // yield, not spin_loop: on a machine with few cores the copy workers and
                    // the application need this core more than we do.
                    std::thread::yield_now();
                }
            } else {
                let wait = self
                    .ep
                    .poll_timeout()
                    .map(|t| t.saturating_duration_since(Instant::now()))
                    .unwrap_or(IDLE_PARK)
                    .min(IDLE_PARK);
                std::thread::park_timeout(wait);
            }
        }
        self.shutdown();
    }

    /// One pass; true when anything moved.
    fn iterate(&mut self, cmds: &mut Vec<Cmd>) -> bool {
        let mut moved = false;
        if self.shim.poll_notifs() != 0 {
            tracing::trace!("inner getNotifs failed");
        }
        if let Some(z) = &mut self.zmq {
            let malformed = z.poll(ZMQ_POLL_BATCH, |peer, frame| cmds.push(Cmd::Control { peer, frame }));
            self.shared.stats.control_dropped.fetch_add(malformed, std::sync::atomic::Ordering::Relaxed);
        }
        self.shared.inbox.drain(cmds);
        let now = Instant::now();
        for cmd in cmds.drain(..) {
            moved = true;
            self.handle_cmd(now, cmd);
        }
        moved |= self.poll_writes(now);
        if self.ep.poll_timeout().is_some_and(|t| t <= now) {
            self.ep.handle_timeout(now);
        }
        moved |= self.drain_actions();
        self.shared.stats.arena_free_bytes.store(self.ep.arena_free_bytes(), std::sync::atomic::Ordering::Relaxed);
        self.shared.stats.chunks_direct.store(self.ep.stats().chunks_direct, std::sync::atomic::Ordering::Relaxed);
        moved
    }

    fn peer_id(&mut self, name: &str) -> PeerId {
        if let Some(id) = self.peer_ids.get(name) {
            return *id;
        }
        let id = PeerId(u32::try_from(self.peer_ids.len()).unwrap_or(u32::MAX));
        self.peer_ids.insert(name.to_owned(), id);
        self.peer_names.insert(id, name.to_owned());
        id
    }

    fn handle_cmd(&mut self, now: Instant, cmd: Cmd) {
        match cmd {
            Cmd::Submit(p) => {
                let peer = self.peer_id(&p.peer);
                let chunks = p.plan.chunks.len() as u64;
                let bytes = p.plan.total_bytes;
                self.xfers.insert(p.xfer, XferCtx { handle: p.handle, peer: p.peer, notif: p.notif });
                Stats::bump(&self.shared.stats.bounce_xfers);
                self.shared.stats.bounce_chunks.fetch_add(chunks, std::sync::atomic::Ordering::Relaxed);
                self.shared.stats.bounce_bytes.fetch_add(bytes, std::sync::atomic::Ordering::Relaxed);
                if let Err(e) = self.ep.submit(now, p.xfer, peer, (*p.plan).clone()) {
                    tracing::warn!(xfer = p.xfer.0, error = %e, "bounce submit refused");
                    self.complete(p.xfer, Err(XferError::Refused));
                }
            }
            Cmd::Cancel(x) => {
                self.xfers.remove(&x);
                self.ep.cancel(now, x);
            }
            Cmd::Control { peer, frame } => self.on_control(now, &peer, &frame),
            Cmd::CopyDone(job, ok) => self.copy_done(now, job, ok),
            Cmd::PeerLost(name) => {
                if let Some(z) = &mut self.zmq {
                    z.forget(&name);
                }
                if let Some(&id) = self.peer_ids.get(&name) {
                    self.ep.handle_peer_lost(now, id);
                    self.peer_sessions.remove(&id);
                }
            }
            Cmd::Hello(name) => {
                // Only a peer that can bounce with us has a use for it (compatibility is
                // symmetric), and only such a peer has a ZMQ endpoint we could reach.
                let compatible = self.shared.peers.lock().get(&name).is_some_and(Option::is_some);
                if !compatible {
                    tracing::debug!(peer = name, "no HELLO to a peer that cannot bounce with us");
                } else if let Err(e) = self.send_frame(&name, &wire::encode_hello(self.session)) {
                    tracing::warn!(peer = name, error = e, "sending HELLO failed; the peer stays on plain UCX to us");
                }
            }
            Cmd::Registered(a, l, md) => {
                self.ep.add_registered(a, l);
                self.user_regs.push((a, l, md));
            }
            Cmd::Deregistered(a, l, md) => {
                self.ep.remove_registered(a, l);
                self.user_regs.retain(|r| *r != (a, l, md));
            }
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
        if wire::decode_hello(bytes).is_some() {
            // Recorded even before we load the peer (the two loads race); bounded so a flood of
            // invented names cannot grow it without limit.
            let mut r = self.shared.reachable.lock();
            if r.contains(peer) || r.len() < MAX_REACHABLE || self.shared.peers.lock().contains_key(peer) {
                r.insert(peer.to_owned());
            } else {
                drop(r);
                self.drop_frame(now, peer, &"HELLO from an unknown agent beyond the limit");
            }
            return;
        }
        let frame = match Frame::decode(bytes) {
            Ok(f) => f,
            Err(e) => return self.drop_frame(now, peer, &e),
        };
        let id = self.peer_id(peer);
        // A peer agent restarted under the same name: everything of its old incarnation is void.
        match self.peer_sessions.get(&id) {
            Some(&s) if s != frame.session => {
                if matches!(&frame.msg, Msg::Want(_)) {
                    tracing::info!(peer, "peer restarted (new session): reclaiming its old state");
                    self.ep.handle_peer_lost(now, id);
                    self.peer_sessions.insert(id, frame.session);
                } else {
                    return self.drop_frame(now, peer, &"stale session");
                }
            }
            Some(_) => {}
            None => {
                self.peer_sessions.insert(id, frame.session);
            }
        }
        // Only agents whose connection info NIXL loaded into this engine may talk to us: UCX
        // needs it to answer at all, and the WANT's reverse-path endpoint is NOT loaded on
        // trust -- UCX aborts the whole process on a malformed worker address (found by the
        // hostile-peer test), and nothing here can validate one.
        if !self.shared.peers.lock().contains_key(peer) {
            return self.drop_frame(now, peer, &"control frame from an agent whose connection info was never loaded");
        }
        if let Err(e) = self.ep.handle_msg(now, id, frame.msg) {
            self.drop_frame(now, peer, &e);
        }
    }

    /// Polls in-flight writes oldest first. After each completion the core's reaction (the
    /// chunk's DATA) goes out before anything else is polled: polling progresses the inner
    /// engine, which may run the next write's copy first and hold the DATA back behind it.
    fn poll_writes(&mut self, now: Instant) -> bool {
        let mut moved = false;
        let mut i = 0;
        while i < self.writes.len() {
            let st = self.shim.check(&self.writes[i].handle);
            if st == 1 {
                i += 1;
                continue;
            }
            let w = self.writes.remove(i);
            self.shim.release(w.handle);
            self.ep.handle_write_done(now, w.job, st == 0);
            let _ = self.drain_actions();
            moved = true;
        }
        moved
    }

    /// Carries out the core's actions, then posts queued writes one at a time, carrying out
    /// what each completion produces before the next write. UCX's shared-memory path copies a
    /// write synchronously inside its post, so a chunk's DATA is produced during the post; sent
    /// right away, the receiver scatters that chunk while the next one is written. (Posting
    /// every granted write first held all the DATAs back until the whole window was written:
    /// the receiver idled for 7 ms per 32 MiB window on the 2-core machine, BENCHMARKS.md.)
    fn drain_actions(&mut self) -> bool {
        let mut moved = false;
        loop {
            while let Some(a) = self.ep.poll_action() {
                moved = true;
                match a {
                    Action::Send { peer, msg } => self.send(peer, msg),
                    Action::Gather { job, region, runs, .. } => self.copy(job, Dir::Gather, region, runs),
                    Action::Scatter { job, region, runs, .. } => self.copy(job, Dir::Scatter, region, runs),
                    Action::Write { job, peer, source, remote, len, .. } => {
                        self.queued_writes.push_back(QueuedWrite { job, peer, source, remote, len });
                    }
                    Action::Complete { xfer, outcome } => self.complete(xfer, outcome),
                }
            }
            if self.stopping || self.writes.len() >= MAX_WRITES_IN_FLIGHT {
                return moved;
            }
            let Some(w) = self.queued_writes.pop_front() else { return moved };
            moved = true;
            self.write(w.job, w.peer, w.source, w.remote, w.len);
        }
    }

    fn send(&mut self, peer: PeerId, msg: Msg) {
        let Some(name) = self.peer_names.get(&peer).cloned() else { return };
        let bytes = Frame { session: self.session, msg }.to_vec();
        if let Err(e) = self.send_frame(&name, &bytes) {
            if self.warn_budget.allow(Instant::now()) {
                // The transfer this belonged to will time out; never block the reactor.
                tracing::warn!(peer = name, error = e, "sending a control frame failed");
            }
        }
    }

    /// One control frame to `peer` over the configured channel. With ZMQ, the peer's endpoint
    /// comes from the capabilities in its connection info.
    fn send_frame(&mut self, peer: &str, bytes: &[u8]) -> Result<(), String> {
        match &mut self.zmq {
            None => match self.shim.gen_notif(peer, bytes) {
                0 => Ok(()),
                st => Err(format!("UCX genNotif status {st}")),
            },
            Some(z) => {
                let peers = self.shared.peers.lock();
                let endpoint = peers.get(peer).and_then(Option::as_ref).map(|c| c.endpoint.as_slice());
                z.send(peer, endpoint.ok_or("no capabilities loaded for this peer")?, bytes)
            }
        }
    }

    fn copy(&mut self, job: JobId, dir: Dir, region: bounce_proto::Region, runs: Vec<bounce_proto::CopyRun>) {
        self.copies.insert(job, dir);
        if !self.workers.submit(CopyJob { job, dir, region, runs }) {
            self.copy_done(Instant::now(), job, false);
        }
    }

    fn copy_done(&mut self, now: Instant, job: JobId, ok: bool) {
        match self.copies.remove(&job) {
            Some(Dir::Gather) => self.ep.handle_gather_done(now, job, ok),
            Some(Dir::Scatter) => self.ep.handle_scatter_done(now, job, ok),
            None => tracing::error!(job = job.0, "completion for an unknown copy job"),
        }
    }

    /// The local side of a write: our arena, or user memory registered through this engine.
    fn write_source(&self, source: WriteSource, len: u64) -> Option<(Md, u64)> {
        match source {
            WriteSource::Arena(r) => Some((self.arena_md, self.arena.base + r.offset)),
            WriteSource::User { addr } => {
                let end = addr.checked_add(len)?;
                self.user_regs.iter().find(|(a, l, _)| *a <= addr && end <= a + l).map(|&(_, _, md)| (md, addr))
            }
        }
    }

    fn write(&mut self, job: JobId, peer: PeerId, source: WriteSource, remote: bounce_proto::Region, len: u64) {
        let now = Instant::now();
        let Some(name) = self.peer_names.get(&peer).cloned() else {
            return self.ep.handle_write_done(now, job, false);
        };
        let Some(pa) = self.shared.peer_arenas.lock().get(&name).copied() else {
            return self.ep.handle_write_done(now, job, false);
        };
        // The core checked the credit against its own bookkeeping; only we know the peer's
        // arena size. A credit pointing outside it comes from a broken or hostile peer: never
        // write there.
        if remote.offset.checked_add(len).is_none_or(|end| end > pa.len) || len > remote.len {
            self.drop_frame(now, &name, &"credit outside the peer's arena");
            return self.ep.handle_write_done(now, job, false);
        }
        let _span = tracing::trace_span!("write", job = job.0, peer = %name, len).entered();
        let Some((local_md, local_addr)) = self.write_source(source, len) else {
            tracing::warn!(peer = name, "direct-source chunk is no longer in registered memory");
            return self.ep.handle_write_done(now, job, false);
        };
        let res = self.shim.write(&name, 0, (local_md, local_addr, 0), (pa.md, pa.base + remote.offset, pa.dev), len);
        match res {
            Ok((0, h)) => {
                self.shim.release(h);
                self.ep.handle_write_done(now, job, true);
            }
            Ok((_, h)) => self.writes.push(InFlightWrite { job, handle: h }),
            Err(st) => {
                tracing::warn!(peer = name, status = st, "posting a bounce write failed");
                self.ep.handle_write_done(now, job, false);
            }
        }
    }

    fn complete(&mut self, xfer: XferId, outcome: Result<(), XferError>) {
        let Some(ctx) = self.xfers.remove(&xfer) else { return };
        let stats = &self.shared.stats;
        match &outcome {
            Ok(()) => {
                Stats::bump(&stats.bounce_ok);
                // Every chunk is scattered: now the notification may tell the peer's
                // application its data is in place (the same promise UCX makes).
                if let Some(msg) = &ctx.notif {
                    let st = self.shim.gen_notif(&ctx.peer, msg);
                    if st != 0 {
                        tracing::warn!(peer = ctx.peer, status = st, "sending the transfer's notification failed");
                    }
                }
            }
            Err(e) => {
                Stats::bump(&stats.bounce_failed);
                if matches!(e, XferError::Timeout) {
                    Stats::bump(&stats.timeouts);
                }
                tracing::debug!(xfer = xfer.0, error = %e, "bounce transfer failed");
            }
        }
        self.shared.requests.finish(ctx.handle, xfer, outcome);
    }

    /// Fails everything and waits for operations that still touch the arena.
    fn shutdown(&mut self) {
        let now = Instant::now();
        self.stopping = true;
        self.ep.shutdown(now);
        let _ = self.drain_actions();
        for w in std::mem::take(&mut self.queued_writes) {
            self.ep.handle_write_done(now, w.job, false);
        }
        let _ = self.drain_actions();
        // Writes may still read the arena: wait for them (bounded), then release.
        let deadline = Instant::now() + Duration::from_secs(5);
        while !self.writes.is_empty() && Instant::now() < deadline {
            let _ = self.shim.poll_notifs();
            let _ = self.poll_writes(Instant::now());
            let _ = self.drain_actions();
        }
        for w in self.writes.drain(..) {
            self.shim.release(w.handle);
        }
        // Copy workers are joined when the Driver (and its Workers) drop.
    }
}
