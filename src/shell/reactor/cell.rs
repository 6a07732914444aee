//! The reactor thread and the application threads that drive beside it: who runs a pass when
//! ([`super::Reactor::drive`]), and the thread's loop ([`Cell::run`]) with its stand-downs and
//! parks.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use super::alarm::Alarm;
use super::pace::{self, BUSY_SLEEP, Pace, STAND_DOWN, Wait};
use super::shared::Inbox;
use super::{Cell, Driver, Drove, Reactor, SOCKET_POLL_BATCH, Shared};

impl Reactor {
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
        if !self.cell.any_thread {
            return None;
        }
        let mut g = self.cell.try_driver(&self.stop)?;
        let d = g.as_mut()?;
        if !worth_a_pass(d) {
            return None;
        }
        // A GPU arena's context, current here until the FFI edge puts the application's back.
        // Without it the pass is the reactor thread's, at once: the caller may have consumed
        // the socket's edge (`drive_if_readable`), which would not wake the thread again.
        if !d.copiers.prepare_thread() {
            drop(g);
            self.shared.inbox.kick();
            return None;
        }
        let _span = tracing::debug_span!("reactor", session = d.session, inline = true).entered();
        self.cell.driving_from(Instant::now());
        let Some(end) = self.cell.pass_off_thread(g, &self.stop, &self.shared, "an application thread") else {
            return Some(Drove { moved: false, copying: false });
        };
        if end.more {
            // The rest of the batch is the reactor thread's, at once.
            self.cell.resign();
            self.shared.inbox.wake();
        } else {
            self.cell.drove(Instant::now());
            // This pass left work in flight while the reactor thread sleeps an idle park: it
            // must watch that work should the poller stop. Work begun and ended here (an inline
            // WANT put, scattered and answered) needs nobody, and waking the thread for it took
            // a polling application's core.
            if end.busy && self.cell.parked_idle.swap(false, Ordering::SeqCst) {
                self.shared.inbox.wake();
            }
        }
        Some(Drove { moved: end.moved, copying: end.copying })
    }
}

/// How a pass off the reactor thread ended ([`Cell::pass_off_thread`]).
struct PassEnd {
    moved: bool,
    /// Copy jobs were in flight after it.
    copying: bool,
    /// Frames of the channel's batch were left: they are the reactor thread's.
    more: bool,
    /// Work was in flight after it.
    busy: bool,
}

impl Cell {
    /// One pass of the driver held through `g` on the calling thread (`who`, for the log): the
    /// part an application's pass and a copy worker's share. The guard is released before it
    /// returns. A pass here handles a bounded batch of frames: a peer flooding us must not hold
    /// an application's call, or a copy worker, for the whole flood. `None` when the pass
    /// panicked: the bounce path is closed, and the reactor thread fails the transfers once it
    /// has dropped the driver (its copy engine may still run a READ's scatters into our
    /// memory, and a request seen failed may have its destinations reused at once).
    fn pass_off_thread(
        &self,
        mut g: parking_lot::MutexGuard<'_, Option<Driver>>,
        stop: &AtomicBool,
        shared: &Shared,
        who: &str,
    ) -> Option<PassEnd> {
        let d = g.as_mut()?;
        let budget = d.control_budget.min(SOCKET_POLL_BATCH);
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| d.iterate_with(budget, false))) {
            Ok(moved) => {
                let (copying, busy, more) = (d.copiers.in_flight() > 0, d.busy(), d.control_full);
                // SeqCst: read against `parked_idle` by a reactor thread about to park.
                self.busy.store(busy, Ordering::SeqCst);
                drop(g);
                Some(PassEnd { moved, copying, more, busy })
            }
            Err(_) => {
                // Before letting go: a thread that takes the driver next must find it closed,
                // not run a pass on the state this one left halfway.
                self.poisoned.store(true, Ordering::Release);
                stop.store(true, Ordering::Release);
                drop(g);
                tracing::error!("a bounce pass on {who} panicked; failing its transfers, bounce path closed");
                shared.inbox.wake();
                None
            }
        }
    }
}

/// What a copy worker needs to run a pass when its job ends ([`Shared::copy_finished`]).
///
/// Why: a finished copy's consequence (a gathered chunk's READY record or its write, a
/// scatter's ACK) otherwise waits for the reactor thread to be scheduled. On a host with few
/// cores, where the copy workers and a polling application take them, that came only once the
/// copies were all done: a bounced KV pull on 2 cores published its first chunk's READY
/// 444 us after that chunk's gather ended, when the target's application next polled. The
/// worker that finished holds a core already. Unlike an application's pass, a worker's does
/// not stand the reactor thread down: no poller keeps driving after it. Only on hosts where
/// the reactor thread does not spin after activity ([`super::pace::hot_spin`]): a KV batch on
/// 2 cores took 9-14% less time with two way metadata and as long one way, and on the 16-core
/// H100 host worker passes changed nothing measurable (BENCHMARKS.md "Session 48").
pub(crate) struct WorkerPasses {
    /// Weak: the driver owns the copy engine and its workers (a strong reference from a worker
    /// would be a cycle). The reactor thread drops the driver, joining the workers, before it
    /// lets go of the cell, so no worker ever holds the last reference.
    cell: Weak<Cell>,
    stop: Arc<AtomicBool>,
}

impl WorkerPasses {
    pub(super) fn new(cell: &Arc<Cell>, stop: &Arc<AtomicBool>) -> Self {
        Self { cell: Arc::downgrade(cell), stop: Arc::clone(stop) }
    }

    /// Runs one pass on the calling copy worker; false when none ran (another thread is in one,
    /// passes must stay on the reactor thread, or the reactor is stopping).
    pub(super) fn pass(&self, shared: &Shared) -> bool {
        self.cell.upgrade().is_some_and(|cell| cell.worker_pass(&self.stop, shared))
    }
}

impl Cell {
    /// The driver, for a pass on the calling thread: `None` while another thread holds it, or
    /// once the bounce path is closed. `stop` is looked at under the lock, where it is
    /// certain: a pass that panicked (`pass_off_thread`, [`PoisonOnPanic`]) and the reactor
    /// thread that stopped set it before they let go of the driver.
    fn try_driver(&self, stop: &AtomicBool) -> Option<parking_lot::MutexGuard<'_, Option<Driver>>> {
        let g = self.driver.try_lock()?;
        (!stop.load(Ordering::Acquire)).then_some(g)
    }

    fn worker_pass(&self, stop: &AtomicBool, shared: &Shared) -> bool {
        // Passes off the reactor thread need an engine that allows them: a host arena's does,
        // and an engine with a GPU arena beside it (`both`) then runs them too.
        if !self.any_thread {
            return false;
        }
        let Some(mut g) = self.try_driver(stop) else { return false };
        // As for an application's pass: a GPU arena's context current on this thread before
        // a pass may post a write from GPU memory or queue a GPU copy.
        if !g.as_mut().is_some_and(|d| d.copiers.prepare_thread()) {
            return false;
        }
        crate::shell::mark!("worker-pass", 0);
        // As after an application's pass: the rest of a batch of frames is the reactor
        // thread's, and work left in flight needs it awake.
        if let Some(end) = self.pass_off_thread(g, stop, shared, "a copy worker") {
            if end.more {
                // The rest of the batch is the reactor thread's, stand-down or not.
                shared.inbox.kick();
            } else if end.busy && self.parked_idle.swap(false, Ordering::SeqCst) {
                shared.inbox.wake();
            }
        }
        true
    }
}

/// Closes the bounce path when dropped by a panic: set before the driver's guard is released,
/// so no other thread runs a pass on what the panicking pass left.
struct PoisonOnPanic<'a> {
    cell: &'a Cell,
    stop: &'a AtomicBool,
}

impl Drop for PoisonOnPanic<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.cell.poisoned.store(true, Ordering::Release);
            self.stop.store(true, Ordering::Release);
        }
    }
}

/// Least time between two pollers' looks at a control socket of the channel's own
/// ([`Reactor::drive_if_readable`]). ZMQ answers "does a message wait" with a system call
/// (it polls its mailbox's descriptor); asked at every `getNotifs` it cost a notification
/// round trip 1.10-1.13x UCX's on 2 cores, once per 10 us 1.04 (the hops over ZMQ itself
/// take 40-80 us there, so the wait this adds is small beside them).
const SOCKET_LOOK_GAP: Duration = Duration::from_micros(10);

impl Cell {
    pub(super) fn since_epoch(&self, now: Instant) -> u64 {
        u64::try_from(now.saturating_duration_since(self.epoch).as_nanos()).unwrap_or(u64::MAX).max(1)
    }

    /// The reactor thread came back from a sleep (counted for the tests).
    fn woke(&self) {
        #[cfg(test)]
        self.wakes.fetch_add(1, Ordering::Relaxed);
    }

    /// How long the reactor thread may sleep beside the application's close pulls now
    /// ([`pace::beside_puller`]).
    fn beside_puller(&self, now: Instant, idle_park: Duration) -> Duration {
        pace::beside_puller(self.pulls.as_ref().and_then(|p| p.live_at(now)), idle_park)
    }

    /// Sleeps `at_least` (a stand-down, or the wait for an application's pass to let go of the
    /// driver), or longer beside an application pulling closely when nothing is in flight: its
    /// pulls hand every control frame to a pass on its thread, and the stand-down that ended
    /// (or the lock found taken) meant only that its thread had just driven one. Waking at the
    /// end of each such short wait to find the puller still there cost a target's reactor
    /// thread two wake-ups a millisecond beside an application spinning on `getNotifs` (issue
    /// 12). The longer sleep is an idle park: a pass that leaves work in flight wakes it, and
    /// so does a frame on the control channel's own socket (`alarm`, ZMQ).
    fn sleep_beside_puller(&self, at_least: Duration, idle_park: Duration, alarm: Option<&Alarm>) {
        let beside = if self.busy.load(Ordering::Acquire) {
            Duration::ZERO
        } else {
            self.beside_puller(Instant::now(), idle_park)
        };
        if beside > at_least && self.may_park_idle() {
            match alarm {
                Some(a) => a.wait(beside),
                None => std::thread::park_timeout(beside),
            }
            self.parked_idle.store(false, Ordering::Release);
        } else {
            std::thread::park_timeout(at_least);
        }
        self.woke();
    }

    /// Says the reactor thread is about to park idle (`parked_idle`), unless a pass on another
    /// thread left work in flight since the thread's last look: such a pass stores `busy`
    /// before it looks at `parked_idle` (both SeqCst, as here), so either it sees the flag and
    /// wakes the thread, or the thread sees its work here and must not park idle.
    pub(super) fn may_park_idle(&self) -> bool {
        self.parked_idle.store(true, Ordering::SeqCst);
        if self.busy.load(Ordering::SeqCst) {
            self.parked_idle.store(false, Ordering::Release);
            return false;
        }
        true
    }

    /// No application thread drives any more: the reactor thread stops standing down. True
    /// when it was (it may be parked for that, and wants waking).
    pub(super) fn resign(&self) -> bool {
        self.driving.end()
    }

    /// An application thread's pass begins at `now`. One that begins longer after the previous
    /// pass ended than the run of driving tolerates ([`pace::driving_streak`]), or after a
    /// resignation, starts a new run.
    pub(super) fn driving_from(&self, now: Instant) {
        self.driving.note(now);
    }

    /// An application thread's pass ended at `now`: the reactor thread stands down from here
    /// ([`Self::standing_down`]). The run holds through the pass however long it took: the gaps
    /// a run tolerates are the application's absences, and a post's pass (its gather, WANT and
    /// send) counted as one ended the runs of a Python application whose own work between
    /// transfers was shorter than the run allowed.
    pub(super) fn drove(&self, now: Instant) {
        self.driving.hold(now);
    }

    /// How much longer the reactor thread stands down, if an application thread drove lately:
    /// a poller that drives is the transfer's progress, and a reactor thread running passes
    /// beside it only contends for the driver and, on a small host, for the cores (a lock
    /// holder preempted by the other cost a scheduler tick, 4 ms, per transfer; each look of
    /// a thread woken to see whether the poller is still there took that core for 8-15 us).
    /// How long after the latest pass grows with how long the application has been driving
    /// ([`pace::stand_down`]).
    pub(super) fn standing_down(&self, now: Instant) -> Option<Duration> {
        let left = pace::stand_down_left(self.driving.at(now)?, self.longest_stand_down);
        (!left.is_zero()).then_some(left)
    }

    /// The reactor thread's loop: passes until `stop`, then closes and shuts down; true when no
    /// grant was left outstanding. Idle, it parks up to `idle_park` (`bounce_idle_park_us`), or
    /// sleeps on `alarm` as long when the control channel has a socket to wait on.
    pub(super) fn run(&self, stop: &AtomicBool, inbox: &Inbox, idle_park: Duration, alarm: Option<&Alarm>) -> bool {
        // Writes are posted from this thread too: a GPU arena's context must be current here
        // before the first one (a direct write from GPU memory may come before any copy).
        if let Some(d) = self.driver.lock().as_mut() {
            let _ = d.copiers.prepare_thread();
        }
        crate::sys::thread::precise_sleeps();
        let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
        let mut pace = Pace::new(cores, idle_park, Instant::now());
        // The driver's peer activity at the previous pass: a change, made by this thread's pass
        // or an application's, restarts the idle ramp.
        let mut activity_seen = 0;
        while !stop.load(Ordering::Acquire) {
            // Beside an application that drives, unless a thread that could not run a pass
            // wants one (`Inbox::kick`).
            // (No let chain: the crate builds on Rust 1.85, its `rust-version`.)
            if let Some(left) = (!inbox.wanted()).then(|| self.standing_down(Instant::now())).flatten() {
                self.sleep_beside_puller(left, idle_park, alarm);
                continue;
            }
            // An application thread in a pass does this pass's work: leave it the driver rather
            // than queue behind it (and be woken late when it lets go). Closed since the look
            // at `stop` above (a pass on another thread panicked), the loop's next look ends.
            let Some(mut g) = self.try_driver(stop) else {
                self.sleep_beside_puller(STAND_DOWN, idle_park, alarm);
                continue;
            };
            inbox.serve_wanted();
            // Dropped before `g` should this pass panic: the flags are set before the driver is
            // let go, as `pass_off_thread` does for a pass on another thread.
            let _poison = PoisonOnPanic { cell: self, stop };
            let pass = g.as_mut().map(|d| {
                // A full batch of the control channel counts as movement: more may wait, and a
                // socket that was not emptied does not signal its alarm again (ZMQ).
                let moved = d.iterate() || d.control_full;
                let now = Instant::now();
                let busy = d.busy();
                self.busy.store(busy, Ordering::Release);
                let beside = self.beside_puller(now, idle_park);
                let activity = d.peer_activity();
                let addressed = activity != activity_seen;
                activity_seen = activity;
                (moved, busy, addressed, d.ep.poll_timeout().map(|t| t.saturating_duration_since(now)), now, beside)
            });
            drop(g);
            let Some((moved, busy, addressed, timer, now, beside)) = pass else { return false };
            if addressed {
                pace.addressed(now);
            }
            match pace.after_pass(now, moved, busy, timer, beside) {
                Wait::Now => {}
                // yield, not spin_loop: on a machine with few cores the copy workers and the
                // application need this core more than we do.
                Wait::Yield => std::thread::yield_now(),
                Wait::Park(d) => {
                    // Set before parking and cleared after: an application pass that starts work
                    // meanwhile wakes us (an unpark before the park makes the park return at once).
                    if !busy && !self.may_park_idle() {
                        continue;
                    }
                    if d > BUSY_SLEEP {
                        crate::shell::mark!("park", d.as_micros());
                    }
                    match alarm {
                        // Idle: a frame on the socket or a wake ends the sleep, so it need not
                        // ramp up from a short one after activity (the ramp is for frames that
                        // come unannounced): it lasts until the next timer, at most the longest
                        // park, which bounds how late the inner engine's progress runs.
                        Some(a) if !busy => a.wait(timer.map_or(idle_park, |t| t.min(idle_park))),
                        _ => std::thread::park_timeout(d),
                    }
                    self.woke();
                    if d > BUSY_SLEEP {
                        crate::shell::mark!("unpark", 0);
                    }
                    self.parked_idle.store(false, Ordering::Release);
                }
            }
        }
        if self.poisoned.load(Ordering::Acquire) {
            return false;
        }
        let mut g = self.driver.lock();
        let Some(d) = g.as_mut() else { return false };
        let quiet = d.close();
        d.shutdown() && quiet
    }
}
