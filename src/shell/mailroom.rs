//! Sorting the inner engine's notifications: BOUNCE control frames go to the reactor's UCX
//! control channel, everything else is the application's and waits, in arrival order, for its
//! `getNotifs`.
//!
//! Both the reactor (every pass) and the application (`getNotifs`) pull from the inner engine:
//! the application must see its notifications without waiting for the reactor, and the reactor
//! must see control frames even when the application never polls. Whoever pulls sorts, here,
//! once: a frame travels up from the shim to its reader and never back through the FFI.
//!
//! The application's `getNotifs` takes a shorter way when nothing here is the application's
//! and no pull is half done ([`Mailroom::app_pull_is_direct`]): the shim pulls straight into
//! the caller's list and hands only the control frames over ([`Mailroom::divert`]). Going
//! through the queue cost a notification round trip 8-13% over UCX's (issue 12).
//!
//! Sorting wakes nobody. A pull inside a reactor pass is followed by that pass reading the
//! control queue, on whichever thread it runs; after an application's pull the engine runs a
//! pass on that thread or, when none can run there, has the reactor thread run one
//! (`Engine::control_arrived`: the inbox's kick, which also ends a stand-down; this
//! [`Mailroom::wake_reactor`] only where the engine has no bounce path). A wake-up at every sort made the
//! reactor thread take the polling application's core for 8-15 us after each frame an
//! application's pass pulled, on the 2-core machine, only to find the frame handled (issue 12).

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::thread::Thread;
use std::time::{Duration, Instant};

use bounce_proto::peers::MAX_NAME_LEN;
use bounce_proto::wire;
use parking_lot::Mutex;

use crate::shell::control::Inbound;
use crate::shell::doorbell::Doorbell;
use crate::shell::stats::Stats;
use crate::shell::streak::Streak;
use crate::sys::nixl::NixlStatus;
use crate::sys::shim::{Notif, Shim};

/// Most control frames kept for a reactor that does not drain them (it died): a hostile peer
/// must not grow memory without bound.
const MAX_QUEUED_CONTROL: usize = 1 << 16;
/// Most bytes of control frames kept likewise: the count alone would allow 65536 frames of the
/// longest legal size.
const MAX_QUEUED_CONTROL_BYTES: usize = 256 << 20;
/// Pulls of the application no more than this apart are close: it is polling, not calling now
/// and then (the reactor thread leaves the pulls to an application that pulled since its look
/// of no more than this ago, `reactor::pace::AppPolls`).
pub(crate) const CLOSE_PULL_GAP: Duration = Duration::from_micros(100);
/// The longest gap between two of the application's sampled pulls that continues its streak.
/// Why longer than [`CLOSE_PULL_GAP`]: the pull that finds a control frame runs the reactor's
/// pass on its thread (a WANT checked and scattered and its ACK sent: 20-60 us on the 2-core
/// machine) before the next pull, and only one pull in [`PULL_SAMPLE`] is timed. A target
/// spinning on `getNotifs` while small WRITEs came had its timed pulls 100-130 us apart at
/// each WRITE, and when a gap over 100 us ended its streak, its reactor thread fell back to
/// its idle ramp (parks of 50 us after a peer's frames) and woke 3,200 times a second, each
/// time taking an application's core.
pub(crate) const PULL_STREAK_GAP: Duration = Duration::from_micros(200);

/// The streak of the application's timed pulls ([`PULL_STREAK_GAP`] apart at most).
pub(crate) fn close_pulls() -> Streak {
    Streak::growing(PULL_STREAK_GAP, PULL_STREAK_GAP)
}

/// The application's pulls whose time is taken for the streak: one in this many (and the first
/// after each look of the reactor thread). A clock read at every pull cost an empty `getNotifs`
/// 4-6% (25-30 ns of 0.55 us on the 2-core machine). An application spinning on `getNotifs`
/// pulls every few microseconds, so its sampled pulls stay well within [`PULL_STREAK_GAP`] of
/// each other; one that polls more slowly than a sixteenth of that is not pulling closely and
/// is not taken for it.
const PULL_SAMPLE: u32 = 16;

/// Control frames `(sender, frame)` waiting for the reactor, in arrival order, and their total
/// bytes (for [`MAX_QUEUED_CONTROL_BYTES`]).
#[derive(Default)]
struct ControlQueue {
    frames: VecDeque<(String, Vec<u8>)>,
    bytes: usize,
}

/// What a direct pull does with one notification ([`Mailroom::divert`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Diverted {
    /// A control frame, taken.
    Control,
    /// The application's, from byte `skip` on (an escaped one's header skipped).
    App { skip: usize },
}

/// The sorting point for inner-engine notifications.
pub(crate) struct Mailroom {
    /// The application's notifications, in arrival order. Held while pulling, so two threads'
    /// pulls cannot overtake each other on the way in.
    app: Mutex<VecDeque<Notif>>,
    /// Pulls begun and not yet sorted, plus the application's notifications queued: while
    /// both are 0 nothing older than what the inner engine holds now waits here, so the
    /// application may take its notifications straight from the inner engine.
    unsorted: AtomicUsize,
    /// Control frames for the UCX control channel.
    control: Mutex<ControlQueue>,
    /// True while a reactor reads control frames from UCX (`bounce_control=ucx`); otherwise
    /// control frames arriving over UCX are dropped and counted.
    accepts_control: AtomicBool,
    /// The reactor thread, woken when an application thread's pull found control frames and
    /// no pass could run on that thread.
    reactor: Mutex<Option<Thread>>,
    /// Rung when an application notification was sorted (an application poller may wait on it).
    bell: Arc<Doorbell>,
    /// Set by every application `getNotifs` ([`Self::note_app_pull`]), cleared by the reactor
    /// thread's look ([`Self::app_pulled_since_look`]).
    app_pulled: AtomicBool,
    /// The application's pulls, each `getNotifs` ([`Self::note_app_pull`]), in streaks of
    /// timed pulls at most [`PULL_STREAK_GAP`] apart.
    pulls: Arc<Streak>,
    /// Pulls counted for [`PULL_SAMPLE`].
    pull_count: AtomicU32,
    stats: Arc<Stats>,
}

impl Mailroom {
    /// An empty mailroom that accepts no control frames yet.
    pub(crate) fn new(stats: Arc<Stats>) -> Self {
        Self {
            app: Mutex::new(VecDeque::new()),
            unsorted: AtomicUsize::new(0),
            control: Mutex::new(ControlQueue::default()),
            accepts_control: AtomicBool::new(false),
            reactor: Mutex::new(None),
            bell: Arc::default(),
            app_pulled: AtomicBool::new(false),
            pulls: Arc::new(close_pulls()),
            pull_count: AtomicU32::new(0),
            stats,
        }
    }

    /// The doorbell rung for every sorted application notification; the request table rings the
    /// same one when a bounce request finishes.
    pub(crate) fn doorbell(&self) -> Arc<Doorbell> {
        Arc::clone(&self.bell)
    }

    /// The same doorbell, borrowed (every `getNotifs` takes a ticket: no reference count
    /// traffic for it).
    pub(crate) fn bell(&self) -> &Doorbell {
        &self.bell
    }

    /// From now on control frames go to the UCX channel; `reactor` is woken when another
    /// thread's pull queued some.
    pub(crate) fn accept_control(&self, reactor: Thread) {
        *self.reactor.lock() = Some(reactor);
        self.accepts_control.store(true, Ordering::Release);
    }

    /// Pulls every notification waiting in the inner engine, sorts it, and takes the
    /// application's ([`Self::take_app`]), under one hold of the application queue (the
    /// application's `getNotifs` does both on every call). Control frames it queued wait for
    /// the caller to run a pass or wake the reactor ([`Self::control_waiting`]).
    ///
    /// # Errors
    /// The inner engine's `getNotifs` status when it failed (nothing was pulled or taken).
    pub(crate) fn pull_and_take(&self, shim: &Shim) -> Result<Vec<Notif>, NixlStatus> {
        self.note_app_pull();
        let mut app = self.app.lock();
        self.pull_into(&mut app, |got| crate::shell::marks::timed("slow-app-pull", || shim.poll_notifs(got)))?;
        Ok(self.drain(&mut app))
    }

    /// Whether the application's `getNotifs` may pull straight from the inner engine, skipping
    /// the queue: nothing of the application's waits here and no pull is between the inner
    /// engine and its sorting. Asked with the inner engine's lock held (the shim's), which
    /// every pull also takes to poll: a pull that starts later can only find newer
    /// notifications, and one that polled earlier has counted itself in `unsorted` before its
    /// poll, so its notifications are never overtaken.
    pub(crate) fn app_pull_is_direct(&self) -> bool {
        self.unsorted.load(Ordering::SeqCst) == 0
    }

    /// For a direct pull: takes `msg` from `agent` when it is a control frame (queued for the
    /// reactor, or dropped and counted, as a sorted one would be); otherwise it is the
    /// application's, from its `skip`th byte on (past the escape of one that begins with the
    /// magic, `wire::escape_app_notif`). Called with the inner engine's lock held, in arrival
    /// order, so control frames keep their order against every other pull. Wakes nobody: the
    /// caller handles what it queued once the lock is released, or wakes the reactor
    /// ([`crate::shell::engine`]'s `control_arrived`).
    pub(crate) fn divert(&self, agent: &[u8], msg: &[u8]) -> Diverted {
        if !wire::is_control_frame(msg) {
            return Diverted::App { skip: 0 };
        }
        if let Some(app) = wire::unescape_app_notif(msg) {
            return Diverted::App { skip: msg.len() - app.len() };
        }
        self.queue_control(agent.to_vec(), msg.to_vec());
        Diverted::Control
    }

    /// The application is pulling the inner engine's notifications (each `getNotifs`, either
    /// way): relaxed loads and stores, and a store only when the reactor thread looked since;
    /// the pull's time goes into the streak for the first pull after a look and every
    /// [`PULL_SAMPLE`]th.
    pub(crate) fn note_app_pull(&self) {
        crate::shell::mark!("app-pull", 0);
        let first_since_look = !self.app_pulled.load(Ordering::Relaxed);
        if first_since_look {
            self.app_pulled.store(true, Ordering::Relaxed);
        }
        // Two pulling threads may lose a count: it only samples.
        let n = self.pull_count.load(Ordering::Relaxed).wrapping_add(1);
        self.pull_count.store(n, Ordering::Relaxed);
        if first_since_look || n % PULL_SAMPLE == 0 {
            self.pulls.note(Instant::now());
        }
    }

    /// The application's streak of close pulls ([`Streak::live_at`] tells, at a time, how long
    /// its timed pulls have come no more than [`PULL_STREAK_GAP`] apart and how long ago it
    /// last pulled; `None` when it has not pulled within that gap). Every control frame that
    /// reaches the inner engine meanwhile is sorted by its next pull and handled on its thread
    /// (or the reactor is woken when no pass can run there), so the reactor thread, idle, need
    /// not look for itself.
    pub(crate) fn pulls(&self) -> Arc<Streak> {
        Arc::clone(&self.pulls)
    }

    /// [`Self::pulls`] at `now`.
    #[cfg(test)]
    pub(crate) fn pull_streak(&self, now: Instant) -> Option<(Duration, Duration)> {
        self.pulls.live_at(now)
    }

    /// Whether the application pulled since the reactor thread last asked (and forgets it).
    /// While it keeps pulling closely (the reactor's `AppPolls`), the reactor thread leaves the
    /// pulls to it: the application's pull hands the control frames it finds to a pass on its
    /// own thread at once, where a frame the reactor thread pulled waited for that thread to
    /// get a core. On the 2-core machine a WANT the reactor thread took reached its handling
    /// in a median 264 us against 80 us on the polling application's thread (issue 12, span
    /// timestamps).
    pub(crate) fn app_pulled_since_look(&self) -> bool {
        self.app_pulled.load(Ordering::Relaxed) && self.app_pulled.swap(false, Ordering::Relaxed)
    }

    /// Whether control frames wait for the reactor.
    pub(crate) fn control_waiting(&self) -> bool {
        !self.control.lock().frames.is_empty()
    }

    /// Pulls and sorts like [`Self::pull_and_take`], for a reactor pass (taking nothing): when
    /// another thread is pulling right now it returns at once with `Ok(false)` instead of
    /// waiting its turn. That pull sorts whatever is waiting, control frames included, and wakes
    /// the reactor for them, so waiting would only repeat it. Waiting cost whole milliseconds on
    /// the loaded 2-core machine: an application spinning on `getNotifs` took the lock again
    /// before the woken reactor ran, and every pass of a receiver's reactor (each control hop,
    /// each scatter completion) paid 3-4 ms (issue 12).
    /// Likewise when another thread holds the inner engine's lock (any application call into
    /// UCX): waiting for it made the reactor a convoy behind an application registering or
    /// polling in a loop, and each of the application's unlocks then paid a futex wake
    /// (register + deregister cost 4 us more than UCX's on 2 cores, issue 12). Whatever waits
    /// there is pulled on the reactor's next pass or by the application's next `getNotifs`.
    ///
    /// # Errors
    /// The inner engine's `getNotifs` status when it failed (nothing was pulled).
    pub(crate) fn try_pull(&self, shim: &Shim) -> Result<bool, NixlStatus> {
        self.try_pull_with(|got| crate::shell::marks::timed("slow-pull", || shim.try_poll_notifs(got)))
    }

    /// [`Self::try_pull`] over any source of notifications (the tests' stand-in for the shim),
    /// whose `poll` answers `Ok(false)` when it could not pull (the inner lock was held).
    fn try_pull_with(
        &self,
        poll: impl FnOnce(&mut Vec<Notif>) -> Result<bool, NixlStatus>,
    ) -> Result<bool, NixlStatus> {
        let Some(mut app) = self.app.try_lock() else { return Ok(false) };
        let mut polled = false;
        self.pull_into(&mut app, |got| poll(got).map(|p| polled = p))?;
        Ok(polled)
    }

    /// Pulls with `poll` and sorts, under the caller's hold of the application queue.
    fn pull_into(
        &self,
        app: &mut VecDeque<Notif>,
        poll: impl FnOnce(&mut Vec<Notif>) -> Result<(), NixlStatus>,
    ) -> Result<(), NixlStatus> {
        // Counted before the poll and until sorted (see `app_pull_is_direct`).
        self.unsorted.fetch_add(1, Ordering::SeqCst);
        let mut got = Vec::new();
        let polled = poll(&mut got);
        if polled.is_ok() {
            self.sort(app, got);
        }
        self.unsorted.store(app.len(), Ordering::SeqCst);
        polled
    }

    /// Empties the application's queue (held by the caller) into arrival order.
    fn drain(&self, app: &mut VecDeque<Notif>) -> Vec<Notif> {
        let out = app.drain(..).collect();
        self.unsorted.store(0, Ordering::SeqCst);
        out
    }

    /// Sorts pulled notifications (in arrival order) into the two queues. Wakes nobody for the
    /// control frames (see the module docs).
    fn sort(&self, app: &mut VecDeque<Notif>, got: Vec<Notif>) {
        let mut for_app = false;
        for mut n in got {
            if wire::is_control_frame(&n.msg) {
                let Some(escaped) = wire::unescape_app_notif(&n.msg) else {
                    self.queue_control(n.agent, n.msg);
                    continue;
                };
                n.msg.drain(..n.msg.len() - escaped.len());
            }
            app.push_back(n);
            for_app = true;
        }
        if for_app {
            self.bell.ring();
        }
    }

    /// Queues a control frame for the reactor, or drops it and counts it.
    fn queue_control(&self, agent: Vec<u8>, msg: Vec<u8>) {
        crate::shell::mark!("queued", msg.len());
        // Longer than any legal frame, or from a name longer than any we take: no decoder
        // would accept it, so it is not kept.
        let accepted = self.accepts_control.load(Ordering::Acquire)
            && msg.len() <= wire::MAX_FRAME_LEN
            && agent.len() <= MAX_NAME_LEN;
        let Ok(agent) = String::from_utf8(agent) else {
            Stats::bump(&self.stats.control_dropped);
            return;
        };
        if accepted {
            let mut q = self.control.lock();
            let bytes = agent.len() + msg.len();
            if q.frames.len() < MAX_QUEUED_CONTROL && q.bytes + bytes <= MAX_QUEUED_CONTROL_BYTES {
                q.bytes += bytes;
                q.frames.push_back((agent, msg));
                return;
            }
        }
        Stats::bump(&self.stats.control_dropped);
    }

    /// Wakes the reactor thread for control frames an application thread queued and could not
    /// handle itself.
    pub(crate) fn wake_reactor(&self) {
        if let Some(t) = self.reactor.lock().as_ref() {
            t.unpark();
        }
    }

    /// The application's notifications, in arrival order.
    pub(crate) fn take_app(&self) -> Vec<Notif> {
        let mut app = self.app.lock();
        self.drain(&mut app)
    }

    /// Moves up to `budget` control frames to `out`; returns how many.
    pub(crate) fn take_control(&self, budget: usize, out: &mut Vec<Inbound>) -> usize {
        let mut q = self.control.lock();
        let n = budget.min(q.frames.len());
        let taken: usize = q.frames.iter().take(n).map(|f| f.0.len() + f.1.len()).sum();
        q.bytes -= taken;
        out.extend(q.frames.drain(..n).map(Inbound::unconnected));
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    fn notif(agent: &[u8], msg: &[u8]) -> Notif {
        Notif { agent: agent.to_vec(), msg: msg.to_vec() }
    }

    #[test]
    fn control_frames_go_to_the_channel_and_the_rest_stays_in_order() {
        let stats = Arc::new(Stats::default());
        let m = Mailroom::new(Arc::clone(&stats));
        let hello = wire::encode_hello(7, 0);
        let mut app = m.app.lock();
        // No reactor reads UCX control frames yet: they are dropped and counted.
        m.sort(&mut app, vec![notif(b"p", &hello), notif(b"p", b"app one")]);
        assert_eq!(stats.control_dropped.load(Ordering::Relaxed), 1);
        m.accept_control(std::thread::current());
        m.sort(&mut app, vec![notif(b"p", b"app two"), notif(b"p", &hello), notif(b"\xff", &hello)]);
        drop(app);
        assert_eq!(stats.control_dropped.load(Ordering::Relaxed), 2, "a non-UTF-8 sender is dropped");
        assert_eq!(m.take_app(), [notif(b"p", b"app one"), notif(b"p", b"app two")]);
        assert!(m.take_app().is_empty());
        let mut out = Vec::new();
        assert_eq!(m.take_control(8, &mut out), 1);
        assert_eq!(out, [("p".to_owned(), hello)]);
    }

    /// The reactor's pull never waits for another thread's: while one is pulling it returns
    /// at once without touching the inner engine; otherwise it pulls and sorts like
    /// `pull_and_take`.
    #[test]
    fn a_reactor_pull_skips_while_another_thread_pulls() {
        let m = Mailroom::new(Arc::new(Stats::default()));
        m.accept_control(std::thread::current());
        let hello = wire::encode_hello(3, 0);
        let held = m.app.lock(); // the application's getNotifs is pulling
        let mut polled = false;
        let r = m.try_pull_with(|_| {
            polled = true;
            Ok(true)
        });
        assert_eq!(r, Ok(false));
        assert!(!polled, "the inner engine is not polled a second time");
        drop(held);
        let r = m.try_pull_with(|got| {
            got.extend([notif(b"p", b"app"), notif(b"p", &hello)]);
            Ok(true)
        });
        assert_eq!(r, Ok(true));
        assert_eq!(m.take_app(), [notif(b"p", b"app")]);
        let mut out = Vec::new();
        assert_eq!(m.take_control(8, &mut out), 1, "the control frame went to the reactor's queue");
        assert_eq!(m.try_pull_with(|_| Err(NixlStatus::ErrBackend)), Err(NixlStatus::ErrBackend));
        // Another thread holds the inner engine's lock: nothing pulled, nothing left counted
        // (the application's next getNotifs may still take the short way).
        assert_eq!(m.try_pull_with(|_| Ok(false)), Ok(false));
        assert!(m.app_pull_is_direct());
    }

    /// A pull that queues control frames wakes nobody: the pass that pulled reads them next, on
    /// its own thread, and an application's pull is followed by a pass there (or a wake when
    /// none can run, `Engine::control_arrived`). Only `wake_reactor` wakes. The reactor here is
    /// this test's thread: a wake leaves a token that makes its next park return at once.
    #[test]
    fn sorting_control_frames_wakes_nobody() {
        let m = Mailroom::new(Arc::new(Stats::default()));
        m.accept_control(std::thread::current());
        let hello = wire::encode_hello(4, 0);
        std::thread::park_timeout(Duration::ZERO); // no token left from before
        let r = m.try_pull_with(|got| {
            got.push(notif(b"p", &hello));
            Ok(true)
        });
        assert_eq!(r, Ok(true));
        assert!(m.control_waiting());
        let parked = || {
            let t = Instant::now();
            std::thread::park_timeout(Duration::from_millis(30));
            t.elapsed()
        };
        assert!(parked() >= Duration::from_millis(25), "a pass's pull woke the reactor");
        m.wake_reactor();
        assert!(parked() < Duration::from_millis(25), "an explicit wake does");
    }

    /// Each look of the reactor thread learns whether the application pulled since the look
    /// before: any number of pulls count once, and a look with none between says no.
    #[test]
    fn the_reactor_learns_once_per_look_whether_the_application_pulled() {
        let m = Mailroom::new(Arc::new(Stats::default()));
        assert!(!m.app_pulled_since_look(), "no pull yet");
        m.note_app_pull();
        m.note_app_pull();
        assert!(m.app_pulled_since_look());
        assert!(!m.app_pulled_since_look(), "the application stopped pulling");
        m.note_app_pull();
        assert!(m.app_pulled_since_look());
    }

    /// The streak of close pulls takes the time of the first pull after each look of the
    /// reactor thread and of every `PULL_SAMPLE`th: a spinning application's streak runs on,
    /// with its latest sampled pull at most a sample's worth of pulls ago.
    #[test]
    fn the_application_s_close_pulls_make_a_streak_timed_by_samples() {
        let m = Mailroom::new(Arc::new(Stats::default()));
        assert_eq!(m.pull_streak(Instant::now()), None, "no pull yet");
        m.note_app_pull();
        let (run, _) = m.pull_streak(Instant::now()).expect("the first pull is timed");
        assert_eq!(run, Duration::ZERO);
        // Spinning, the reactor thread not looking: timed every PULL_SAMPLE pulls, the streak
        // runs past a millisecond (on a loaded machine a preemption longer than the gap may
        // start it over: the spin goes on until it gets there, for at most a second).
        let start = Instant::now();
        let streak = loop {
            for _ in 0..PULL_SAMPLE {
                m.note_app_pull();
            }
            // None: a preemption longer than the gap came between the last pull and this look
            // (seen on CI's 2 cores); the spin goes on.
            let streak = m.pull_streak(Instant::now());
            if streak.is_some_and(|(run, since)| run >= Duration::from_millis(1) && since <= CLOSE_PULL_GAP)
                || start.elapsed() > Duration::from_secs(1)
            {
                break streak;
            }
        };
        assert!(
            streak.is_some_and(|(run, since)| run >= Duration::from_millis(1) && since <= CLOSE_PULL_GAP),
            "{streak:?}"
        );
        // A single pull after the reactor thread's look is timed whatever the count.
        std::thread::sleep(Duration::from_millis(5));
        assert!(m.app_pulled_since_look());
        m.note_app_pull();
        let (run, since) = m.pull_streak(Instant::now()).expect("a streak");
        assert_eq!(run, Duration::ZERO, "5 ms after the spin: a new streak");
        assert!(since < Duration::from_millis(5));
    }

    /// The application may pull straight from the inner engine only while nothing it must see
    /// first waits here: not while a pull sits between its poll and its sort, not while a
    /// reactor's pull left application notifications queued; and a direct pull hands control
    /// frames to the reactor's queue exactly as a sorted pull does.
    #[test]
    fn a_direct_pull_is_allowed_only_when_nothing_older_waits() {
        let stats = Arc::new(Stats::default());
        let m = Mailroom::new(Arc::clone(&stats));
        m.accept_control(std::thread::current());
        assert!(m.app_pull_is_direct(), "an empty mailroom");
        // Between the poll and the sort of a pull, the direct way is closed.
        let mut seen_during_poll = None;
        let r = m.try_pull_with(|got| {
            seen_during_poll = Some(m.app_pull_is_direct());
            got.push(notif(b"p", b"app"));
            Ok(true)
        });
        assert_eq!((r, seen_during_poll), (Ok(true), Some(false)));
        assert!(!m.app_pull_is_direct(), "the reactor's pull left one for the application");
        assert_eq!(m.take_app(), [notif(b"p", b"app")]);
        assert!(m.app_pull_is_direct(), "taken: open again");
        // A failed poll leaves nothing counted.
        assert_eq!(m.try_pull_with(|_| Err(NixlStatus::ErrBackend)), Err(NixlStatus::ErrBackend));
        assert!(m.app_pull_is_direct());
        // Diverting: control frames are taken (queued, or dropped and counted), the rest stays.
        let hello = wire::encode_hello(5, 0);
        assert_eq!(m.divert(b"p", b"app two"), Diverted::App { skip: 0 });
        assert_eq!(m.divert(b"p", &hello), Diverted::Control);
        assert_eq!(m.divert(b"\xff", &hello), Diverted::Control, "taken even when dropped");
        // An escaped notification stays the application's, its escape skipped.
        let escaped = wire::escape_app_notif(b"\0BOUNC app three").unwrap();
        assert_eq!(m.divert(b"p", &escaped), Diverted::App { skip: wire::HEADER_LEN });
        assert_eq!(stats.control_dropped.load(Ordering::Relaxed), 1);
        let mut out = Vec::new();
        assert_eq!(m.take_control(8, &mut out), 1);
        assert_eq!(out, [("p".to_owned(), hello)]);
        assert!(m.take_app().is_empty(), "diverting never queues for the application");
    }

    /// An application notification that begins with the frame magic reaches the application
    /// as it was sent, in its place among the others, when it came escaped (every BOUNCE
    /// sender escapes it); one that came bare is a control frame, refused by the reactor.
    #[test]
    fn an_escaped_application_notification_is_sorted_to_the_application_as_it_was_sent() {
        let stats = Arc::new(Stats::default());
        let m = Mailroom::new(Arc::clone(&stats));
        m.accept_control(std::thread::current());
        let theirs = b"\0BOUNC looks like ours".to_vec();
        let escaped = wire::escape_app_notif(&theirs).unwrap();
        let hello = wire::encode_hello(5, 0);
        let r = m.try_pull_with(|got| {
            got.extend([
                notif(b"p", b"one"),
                notif(b"p", &escaped),
                notif(b"q", &hello),
                notif(b"p", &theirs),
                notif(b"p", b"two"),
            ]);
            Ok(true)
        });
        assert_eq!(r, Ok(true));
        assert_eq!(m.take_app(), [notif(b"p", b"one"), notif(b"p", &theirs), notif(b"p", b"two")]);
        let mut out = Vec::new();
        assert_eq!(m.take_control(8, &mut out), 2);
        assert_eq!(out, [("q".to_owned(), hello), ("p".to_owned(), theirs)]);
    }

    /// A reactor that stops draining (it died) cannot make the queue grow without bound, in
    /// frames or in bytes; draining frees the room again.
    #[test]
    fn the_control_queue_is_bounded_in_frames_and_bytes() {
        let stats = Arc::new(Stats::default());
        let m = Mailroom::new(Arc::clone(&stats));
        m.accept_control(std::thread::current());
        let dropped = || stats.control_dropped.load(Ordering::Relaxed);
        let mut app = m.app.lock();
        // Longer than any legal frame: never queued.
        let mut huge = wire::encode_hello(1, 0);
        huge.resize(wire::MAX_FRAME_LEN + 1, 0);
        m.sort(&mut app, vec![notif(b"p", &huge)]);
        assert_eq!((dropped(), m.control.lock().frames.len()), (1, 0));
        // 16 MiB frames: the byte bound stops them long before the frame count does.
        let mut big = wire::encode_hello(1, 0);
        big.resize(16 << 20, 0);
        m.sort(&mut app, (0..20).map(|_| notif(b"p", &big)).collect());
        let fits = MAX_QUEUED_CONTROL_BYTES / (big.len() + 1); // each with its 1-byte name
        assert_eq!((m.control.lock().frames.len(), dropped()), (fits, 1 + (20 - fits) as u64));
        // Small frames: the frame count bounds them.
        let hello = wire::encode_hello(1, 0);
        let mut out = Vec::new();
        m.take_control(usize::MAX, &mut out);
        assert_eq!(m.control.lock().bytes, 0, "draining gives the bytes back");
        m.sort(&mut app, (0..MAX_QUEUED_CONTROL + 5).map(|_| notif(b"p", &hello)).collect());
        assert_eq!(m.control.lock().frames.len(), MAX_QUEUED_CONTROL);
        assert_eq!(dropped(), 1 + (20 - fits) as u64 + 5);
    }

    /// The sender's name comes with the frame, its length the peer's choice: a name longer
    /// than any we take is dropped with its frame, and the names queued count in the bytes.
    #[test]
    fn a_frame_from_an_overlong_name_is_dropped_and_names_count_in_the_bytes() {
        let stats = Arc::new(Stats::default());
        let m = Mailroom::new(Arc::clone(&stats));
        m.accept_control(std::thread::current());
        let mut app = m.app.lock();
        let hello = wire::encode_hello(1, 0);
        let long = vec![b'n'; MAX_NAME_LEN + 1];
        m.sort(&mut app, vec![notif(&long, &hello)]);
        assert_eq!(
            m.divert(&long, &hello),
            Diverted::Control,
            "a control frame is taken (here dropped), whatever its sender"
        );
        assert_eq!((stats.control_dropped.load(Ordering::Relaxed), m.control.lock().frames.len()), (2, 0));
        let name = vec![b'n'; MAX_NAME_LEN];
        m.sort(&mut app, vec![notif(&name, &hello)]);
        assert_eq!(m.control.lock().bytes, MAX_NAME_LEN + hello.len());
        let mut out = Vec::new();
        m.take_control(usize::MAX, &mut out);
        assert_eq!((out.len(), m.control.lock().bytes), (1, 0));
    }
}
