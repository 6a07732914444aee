//! How the reactor waits between passes. Nothing wakes it when a frame, a write's completion or
//! a copy's completion reaches the inner engine or the GPU: it must poll, and how often it
//! polls is the latency of every control hop.
//!
//! - With something moving it never waits.
//! - On a host with many cores it spins (yielding) for [`HOT_SPIN`] after the last pass that
//!   moved anything: UCX delivers a large control frame (a PLAN of thousands of runs, tens of
//!   KB) a fragment per progress call, so a frame sent while both reactors slept 50 us between
//!   polls took 0.3-0.5 ms to cross the 16-core GPU host, and every hop of a bounced transfer
//!   waited up to a sleep (BENCHMARKS.md, issue 11). A busy UCX progress thread burns a core
//!   the same way, all the time; this spins only around activity.
//! - Otherwise, with work in flight, it yields [`SPIN_ITERATIONS`] times, then sleeps
//!   [`BUSY_SLEEP`] between polls: on a 2-core machine the copy workers and the application
//!   need the cores (a reactor polling every 50 us for 20 ms there made UCX's own round trips
//!   2x slower, issue 12).
//! - Idle, it sleeps a fraction of the time since a peer last addressed it (a HELLO, a PING or
//!   a message of the peer's transfer handled, or our HELLO to a peer just loaded:
//!   [`Pace::addressed`]) ([`IDLE_RAMP`], [`IDLE_RAMP_MANY_CORES`]), at least
//!   [`BUSY_SLEEP`] and at most `bounce_idle_park_us` (1 ms by default). A transfer that comes
//!   a while after the previous one is then seen within a small part of that pause, where
//!   doubling sleeps reached the longest park within 2 ms and a request after a pause waited
//!   half of it on average (the first request of a KV block on the H200 host, 80-100 ms after
//!   the previous block; BENCHMARKS.md, session 20). The wake-ups this costs grow with the
//!   logarithm of the pause (with the 256th, about 1000 in the quarter second after a burst),
//!   and an engine idle for longer parks the longest. A message served whole within one pass
//!   counts (a target serves an inline WANT, put, scatter and ACK, in one): counting only work
//!   in flight kept such a target at the longest park for every transfer of a run (an idle
//!   2-core target: 1.1 ms a transfer instead of 0.2 ms). The longest park is also the most a
//!   transfer after a long pause waits to be seen at a target whose application does not poll
//!   (about half of it on average), and how often an idle engine wakes.
//! - An engine that only initiates parks the longest once idle: nothing it waits for comes
//!   unannounced (its next transfer is its application's post, which wakes the reactor). Its
//!   own transfers ramped it too before: on 2 cores it woke 807-808 times in the 300 ms after
//!   a 4 MiB WRITE, 6.2-6.7% of a core, where the longest park gives 289-291 and 2.9-3.2%
//!   (`benches/wakes.py`, BENCHMARKS.md "Session 37").
//!
//! [`AppPolls`] decides the other half of a pass's cost: whether the reactor thread pulls the
//! inner engine itself or leaves that to an application polling it closely. Beside such an
//! application it also stays away longer: [`stand_down`] after an application thread drove a
//! pass, [`beside_puller`] while it only pulls and nothing is in flight.
//!
//! Time is passed in, so the policy is tested without a clock.

use std::time::{Duration, Instant};

/// Polls this many times (yielding) with work in flight but nothing moving before sleeping.
/// Measured on the 2-core benchmark machine: 20 beat 200 and 2000 (BENCHMARKS.md).
pub(super) const SPIN_ITERATIONS: u32 = 20;
/// Sleep between polls once spinning gave nothing (work in flight); also the shortest
/// `bounce_idle_park_us` the configuration accepts.
pub(super) const BUSY_SLEEP: Duration = Duration::from_micros(bounce_proto::config::MIN_IDLE_PARK_US);
/// How long a reactor on a many-core host keeps spinning after its last pass that moved.
pub(super) const HOT_SPIN: Duration = Duration::from_millis(1);
/// An idle park is the time since the last activity divided by this (see the module docs):
/// 0.3 ms 80 ms after a burst, the longest park (1 ms) after a quarter second.
pub(super) const IDLE_RAMP: u32 = 256;
/// The same on a host with [`HOT_SPIN_CORES`] or more, which has cores for the wake-ups: 0.1 ms
/// 100 ms after a burst. With the 256th the first KV request of a block on the H200 host still
/// had its PULL handled 330-440 us after it was sent, about half a 0.4 ms park (session 20).
pub(super) const IDLE_RAMP_MANY_CORES: u32 = 1024;
/// Fewest cores for [`HOT_SPIN`]: below, the reactor's core is needed elsewhere.
pub(super) const HOT_SPIN_CORES: usize = 8;

/// How long a thread of the bounce path keeps looking for work (yielding) after its last on a
/// host with `cores` cores: the reactor after a pass that moved, a copy worker after a job.
pub(crate) fn hot_spin(cores: usize) -> Duration {
    if cores >= HOT_SPIN_CORES { HOT_SPIN } else { Duration::ZERO }
}

/// What the reactor does before its next pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Wait {
    /// Nothing: something moved, go again.
    Now,
    /// Give the core away once, then go again.
    Yield,
    /// Sleep at most this long (an unpark ends it early).
    Park(Duration),
}

/// The reactor's waiting policy (see the module docs).
#[derive(Debug)]
pub(super) struct Pace {
    hot: Duration,
    ramp: u32,
    stalls: u32,
    longest_park: Duration,
    last_moved: Instant,
    /// When a peer last addressed it ([`Self::addressed`]); never for a new reactor or one whose
    /// engine only initiates, which park the longest at once.
    last_addressed: Option<Instant>,
}

impl Pace {
    /// The policy for a host with `cores` cores whose idle parks grow up to `longest_park`
    /// (`bounce_idle_park_us`).
    pub(super) fn new(cores: usize, longest_park: Duration, now: Instant) -> Self {
        let hot = hot_spin(cores);
        let ramp = if cores >= HOT_SPIN_CORES { IDLE_RAMP_MANY_CORES } else { IDLE_RAMP };
        Self { hot, ramp, stalls: 0, longest_park, last_moved: now, last_addressed: None }
    }

    /// A peer addressed the engine at `now` (a frame it sent on its own initiative was handled,
    /// on any thread, or we greeted a peer just loaded): idle parks ramp up from here, as more
    /// of its frames may follow unannounced.
    pub(super) fn addressed(&mut self, now: Instant) {
        self.last_addressed = Some(now);
    }

    /// After a pass at `now` that `moved` anything, with work in flight (`busy`) or not, and
    /// the core's next timer due in `timer`: what to do before the next pass. Idle, it parks
    /// at least `beside` ([`beside_puller`]), the time an application pulling the inner engine
    /// closely lets the reactor thread sleep.
    pub(super) fn after_pass(
        &mut self,
        now: Instant,
        moved: bool,
        busy: bool,
        timer: Option<Duration>,
        beside: Duration,
    ) -> Wait {
        if moved {
            self.stalls = 0;
            self.last_moved = now;
            return Wait::Now;
        }
        if now.saturating_duration_since(self.last_moved) < self.hot {
            return Wait::Yield;
        }
        if busy {
            self.stalls = self.stalls.saturating_add(1);
            return if self.stalls > SPIN_ITERATIONS { Wait::Park(BUSY_SLEEP) } else { Wait::Yield };
        }
        let park = self.last_addressed.map_or(self.longest_park, |t| {
            (now.saturating_duration_since(t) / self.ramp).max(beside).max(BUSY_SLEEP).min(self.longest_park)
        });
        Wait::Park(timer.unwrap_or(park).min(park))
    }
}

/// The reactor thread leaves the inner engine's notifications to the application only when the
/// application pulled within this long of the thread's previous look, so it polls at least
/// about this often. "Any pull since the previous look" was the rule before: an application
/// that polled every 0.5 ms had always pulled during the reactor's idle park, so the reactor
/// stopped pulling and each WANT or PULL waited for the application's next poll (on the 2-core
/// machine the first hop of a KV READ took a median 290 us, up to 680; issue 13).
pub(super) const POLLER_GAP: Duration = crate::shell::mailroom::CLOSE_PULL_GAP;

/// Whether the reactor thread leaves the inner engine's notifications to the application.
/// While the application pulls them closely its pull hands their control frames to a pass on
/// its own thread at once, and a reactor thread pulling beside it only contends for the lock
/// and, on a small host, for the cores (`Mailroom::app_pulled_since_look`); an application that
/// polls now and then must not make the reactor wait for it.
#[derive(Debug, Default)]
pub(super) struct AppPolls {
    last_look: Option<Instant>,
}

impl AppPolls {
    /// At the reactor thread's look at `now`, told whether the application `pulled` since the
    /// previous look: true when it did and that look was at most [`POLLER_GAP`] ago.
    pub(super) fn leave_to_app(&mut self, now: Instant, pulled: bool) -> bool {
        let close = self.last_look.is_some_and(|t| now.saturating_duration_since(t) <= POLLER_GAP);
        self.last_look = Some(now);
        pulled && close
    }
}

/// The shortest stand-down: how long the reactor thread leaves the passes to the application
/// after one of its threads drove, when it has only just started driving. As long as the
/// engine's busy-poll gap, so a poller that stops polling is replaced within it (one that goes
/// to wait resigns at once).
pub(super) const STAND_DOWN: Duration = Duration::from_micros(50);

/// The longest gap between an application's passes that still continues its run of driving,
/// once the run is that long (a run tolerates gaps as long as it has run, from [`STAND_DOWN`]).
///
/// Why: a pass that comes before the stand-down it earned is over is the same poller still
/// driving, and the reactor thread never took over meanwhile. With a fixed 50 us gap a
/// Python application's checks, 5-15 us apart but 60-80 us around each post (its own
/// bookkeeping between one transfer and the next), started a new run at every transfer, each
/// with a stand-down of 50 us: its reactor thread woke to look two or three times per small
/// transfer, each time taking the application's core on 2 cores (`perf sched`). Capped low,
/// so a poller that slows to sparse checks stops holding the reactor off after its first gap.
pub(super) const LONGEST_DRIVING_GAP: Duration = Duration::from_micros(200);

/// The streak of the application's passes the reactor thread stands down for: gaps of
/// [`STAND_DOWN`] at first, up to [`LONGEST_DRIVING_GAP`] once the run is that long; a longer
/// gap within [`LONGEST_DRIVING_GAP`] starts a run that counts it (`Streak::note`).
pub(super) fn driving_streak() -> crate::shell::streak::Streak {
    crate::shell::streak::Streak::growing(STAND_DOWN, LONGEST_DRIVING_GAP)
}

/// How long after the application's latest pass the reactor thread stands down, given that its
/// threads have been driving for `run` without a gap longer than the run allowed
/// ([`driving_streak`]): as long as that run, from [`STAND_DOWN`] up to `longest`
/// (`bounce_idle_park_us`).
///
/// Why it grows: while a poller drives, the reactor thread has nothing to do, and each of its
/// wake-ups to look costs a core for a while. On the 2-core machine a reactor that looked every
/// 50 us beside an application spinning on `checkXfer` took its core for 8-15 us each time
/// (`perf sched`), and a small bounced WRITE took 38-59 us where one that left the poller alone
/// took 15 (issue 12). A poller that has driven for a while will most likely drive again; one
/// that just started may be a single check. What it costs: work left in flight when a
/// long-running poller stops calling (without waiting in BOUNCE, which resigns) waits up to
/// `longest` for the reactor thread, once; the same bound as a transfer that reaches an idle
/// target whose application does not poll.
pub(super) fn stand_down(run: Duration, longest: Duration) -> Duration {
    run.clamp(STAND_DOWN, longest.max(STAND_DOWN))
}

/// What is left, `since` the latest event of a `streak` that ran `run`, of the stand-down that
/// run earns ([`stand_down`]); zero once it is over.
pub(super) fn stand_down_left((run, since): (Duration, Duration), longest: Duration) -> Duration {
    stand_down(run, longest).saturating_sub(since)
}

/// How long an idle reactor thread may sleep beside an application pulling the inner engine's
/// notifications closely, given its live `streak` of pulls (how long it has pulled closely, how
/// long ago it last pulled; `None` once its latest pull is further back than its streak's gap:
/// `Streak::live_at` of `Mailroom::pulls`): as long as a poller that drove that long makes it
/// stand down ([`stand_down`]), from the latest pull.
///
/// Why: such an application's pull sorts every control frame that reaches the inner engine and
/// hands it to a pass on its own thread (or wakes the reactor thread when none can run there),
/// so an idle reactor thread that looks finds nothing, yet each look takes a core. On the
/// 2-core machine a target's reactor thread, back from each idle park of 50-60 us to look
/// beside an application spinning on `getNotifs`, preempted one of the two polling
/// applications every time (`perf sched`): the one control round trip of a small WRITE (an
/// inline WANT) took 50-57 us where the notification round trip of its size takes about 20.
/// What it costs: an application that stops pulling leaves a frame that arrives after its
/// last pull to the reactor thread, up to `longest` later, once.
pub(super) fn beside_puller(streak: Option<(Duration, Duration)>, longest: Duration) -> Duration {
    streak.map_or(Duration::ZERO, |streak| stand_down_left(streak, longest))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn us(n: u64) -> Duration {
        Duration::from_micros(n)
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// The waits of `n` passes that move nothing, `step` apart, starting `from` after `t0`.
    fn stalled(p: &mut Pace, t0: Instant, from: Duration, step: Duration, n: u32, busy: bool) -> Vec<Wait> {
        (0..n).map(|i| p.after_pass(t0 + from + step * i, false, busy, None, Duration::ZERO)).collect()
    }

    #[test]
    fn few_cores_yield_a_while_then_sleep_between_polls_and_back_off_when_idle() {
        let t0 = Instant::now();
        let mut p = Pace::new(2, ms(2), t0);
        assert_eq!(p.after_pass(t0, true, true, None, Duration::ZERO), Wait::Now);
        let waits = stalled(&mut p, t0, us(1), us(1), SPIN_ITERATIONS + 2, true);
        assert!(waits[..SPIN_ITERATIONS as usize].iter().all(|w| *w == Wait::Yield), "{waits:?}");
        assert_eq!(waits[SPIN_ITERATIONS as usize..], [Wait::Park(BUSY_SLEEP); 2]);
        // The transfer in flight was a peer's, served here.
        let active = t0 + us(SPIN_ITERATIONS as u64 + 2);
        p.addressed(active);
        // Idle: a 256th of the time since a peer last addressed it, from 50 us up to 2 ms; a
        // timer due sooner cuts the park short.
        let park = |p: &mut Pace, after: Duration| p.after_pass(active + after, false, false, None, Duration::ZERO);
        assert_eq!(park(&mut p, us(100)), Wait::Park(BUSY_SLEEP));
        assert_eq!(park(&mut p, ms(12)), Wait::Park(BUSY_SLEEP));
        assert_eq!(park(&mut p, us(25_600)), Wait::Park(us(100)));
        assert_eq!(park(&mut p, ms(80)), Wait::Park(us(312) + Duration::from_nanos(500)));
        assert_eq!(park(&mut p, ms(256)), Wait::Park(ms(1)));
        assert_eq!(park(&mut p, ms(512)), Wait::Park(ms(2)));
        assert_eq!(park(&mut p, ms(60_000)), Wait::Park(ms(2)));
        assert_eq!(p.after_pass(active + ms(100), false, false, Some(us(30)), Duration::ZERO), Wait::Park(us(30)));
        // A peer addressing it again restarts the ramp.
        p.addressed(active + ms(70_000));
        assert_eq!(park(&mut p, ms(70_000) + us(1)), Wait::Park(BUSY_SLEEP));
    }

    #[test]
    fn a_peer_served_whole_in_one_pass_restarts_the_ramp() {
        let t0 = Instant::now();
        let mut p = Pace::new(2, ms(1), t0);
        assert_eq!(p.after_pass(t0 + ms(5), false, false, None, Duration::ZERO), Wait::Park(ms(1)));
        // A WANT served whole in one pass: moved, and idle again at once.
        p.addressed(t0 + ms(6));
        assert_eq!(p.after_pass(t0 + ms(6), true, false, None, Duration::ZERO), Wait::Now);
        let idle = stalled(&mut p, t0, ms(6), ms(40), 3, false);
        let ns = |n| Wait::Park(Duration::from_nanos(n));
        assert_eq!(idle, [Wait::Park(BUSY_SLEEP), ns(156_250), ns(312_500)]);
    }

    #[test]
    fn an_engine_that_only_initiates_parks_the_longest_as_soon_as_its_transfers_end() {
        // Its transfers move and keep work in flight, and their GRANTs and ACKs are no peer's
        // transfer: once idle nothing it waits for comes unannounced, and its application's
        // next post wakes it.
        let t0 = Instant::now();
        let mut p = Pace::new(2, ms(1), t0);
        assert_eq!(p.after_pass(t0, true, true, None, Duration::ZERO), Wait::Now);
        let busy = stalled(&mut p, t0, us(1), us(1), SPIN_ITERATIONS + 1, true);
        assert_eq!(busy[SPIN_ITERATIONS as usize], Wait::Park(BUSY_SLEEP), "work in flight is watched closely");
        assert_eq!(p.after_pass(t0 + us(30), true, false, None, Duration::ZERO), Wait::Now);
        assert_eq!(stalled(&mut p, t0, us(31), ms(10), 3, false), [Wait::Park(ms(1)); 3]);
        // Serving a peer later ramps it as any target.
        p.addressed(t0 + ms(50));
        assert_eq!(p.after_pass(t0 + ms(51), false, false, None, Duration::ZERO), Wait::Park(BUSY_SLEEP));
    }

    #[test]
    fn idle_parks_grow_to_the_configured_longest_and_a_new_reactor_starts_there() {
        let t0 = Instant::now();
        let mut p = Pace::new(2, us(500), t0);
        p.addressed(t0); // a peer served: parks start short again
        let idle = stalled(&mut p, t0, Duration::ZERO, ms(32), 6, false);
        let parks: Vec<_> = [50, 125, 250, 375, 500, 500].into_iter().map(|n| Wait::Park(us(n))).collect();
        assert_eq!(idle, parks);
        // The first idle park of a new reactor is already the longest.
        let mut fresh = Pace::new(2, us(500), t0);
        assert_eq!(fresh.after_pass(t0 + ms(5), false, false, None, Duration::ZERO), Wait::Park(us(500)));
    }

    #[test]
    fn many_cores_spin_for_the_hot_window_after_the_last_movement_then_pace_as_few_cores_do() {
        let t0 = Instant::now();
        let mut p = Pace::new(16, ms(2), t0);
        assert_eq!(p.after_pass(t0, true, true, None, Duration::ZERO), Wait::Now);
        // Busy or idle, nothing moving: yields only, for HOT_SPIN after the movement.
        let hot = stalled(&mut p, t0, us(1), us(10), 99, true);
        assert!(hot.iter().all(|w| *w == Wait::Yield), "{hot:?}");
        assert!(stalled(&mut p, t0, us(500), us(10), 20, false).iter().all(|w| *w == Wait::Yield));
        p.addressed(t0 + us(981));
        // Past the window, the few-core pacing: idle parks ramp up from when a peer last
        // addressed it (its frame handled at 981 us).
        assert_eq!(p.after_pass(t0 + HOT_SPIN, false, false, None, Duration::ZERO), Wait::Park(BUSY_SLEEP));
        // A 1024th of the time since then here, not the 256th of few cores.
        assert_eq!(p.after_pass(t0 + us(981 + 204_800), false, false, None, Duration::ZERO), Wait::Park(us(200)));
        // A movement opens a new window.
        assert_eq!(p.after_pass(t0 + ms(60), true, false, None, Duration::ZERO), Wait::Now);
        assert_eq!(p.after_pass(t0 + ms(60) + us(900), false, false, None, Duration::ZERO), Wait::Yield);
    }

    #[test]
    fn only_an_application_that_pulls_closely_is_left_the_pulls() {
        let t0 = Instant::now();
        let mut a = AppPolls::default();
        assert!(!a.leave_to_app(t0, true), "the first look has nothing to compare with");
        // A busy reactor looking every few microseconds beside an application spinning on
        // getNotifs: the application pulls.
        assert!(a.leave_to_app(t0 + us(5), true));
        assert!(!a.leave_to_app(t0 + us(10), false), "no pull since the previous look");
        // Parked for its shortest sleep while the application spins: still the application's.
        assert!(a.leave_to_app(t0 + us(10) + BUSY_SLEEP, true));
        // An idle park of 1 ms with an application polling every 0.5 ms: it pulled during the
        // park, but a frame may have waited up to half a millisecond for it. The reactor pulls.
        assert!(!a.leave_to_app(t0 + ms(1) + us(60), true));
        assert!(!a.leave_to_app(t0 + ms(2) + us(60), true));
        // Exactly the gap still counts as close; a microsecond more does not.
        assert!(a.leave_to_app(t0 + ms(2) + us(60) + POLLER_GAP, true));
        assert!(!a.leave_to_app(t0 + ms(2) + us(61) + POLLER_GAP * 2, true));
    }

    /// A target's application spins on `getNotifs`, and at each small WRITE the pull that finds
    /// its WANT runs the reactor's pass on its thread before the next pull (and only one pull
    /// in sixteen is timed): its timed pulls come tens of microseconds apart, 130 us around
    /// each such pass. Its streak holds through those gaps, so its idle reactor thread sleeps
    /// beside it as long as it has pulled. When a gap over 100 us ended the streak, the reactor
    /// thread fell back to its idle ramp after each (parks of 50 us after a peer's frames) and
    /// woke 3,200 times a second beside a target served small WRITEs on 2 cores (issue 12,
    /// `perf sched`).
    #[test]
    fn a_pullers_pass_sized_gaps_do_not_end_its_streak() {
        let pulls = crate::shell::mailroom::close_pulls();
        let mut t = pulls.epoch() + ms(1);
        let first = t;
        for _ in 0..20 {
            for _ in 0..4 {
                pulls.note(t);
                t += us(40);
            }
            t += us(130 - 40);
        }
        let last = t - us(130);
        let now = last + us(30);
        let streak = pulls.live_at(now);
        assert_eq!(streak, Some((last - first, us(30))), "one streak through every 130 us gap");
        assert_eq!(beside_puller(streak, ms(1)), ms(1) - us(30));
        // A pull that stops: the streak is over once its latest pull is further back than the
        // gap, and the reactor thread paces itself again.
        let gone = last + crate::shell::mailroom::PULL_STREAK_GAP + us(1);
        assert_eq!(pulls.live_at(gone), None);
        assert_eq!(beside_puller(pulls.live_at(gone), ms(1)), Duration::ZERO);
    }

    #[test]
    fn beside_an_application_pulling_closely_an_idle_reactor_sleeps_as_long_as_it_has_pulled() {
        let longest = ms(1);
        assert_eq!(beside_puller(None, longest), Duration::ZERO, "no pull yet");
        // Pulling for 400 us, the latest 30 us ago: a poller that drove that long.
        assert_eq!(beside_puller(Some((us(400), us(30))), longest), us(370));
        assert_eq!(beside_puller(Some((Duration::ZERO, us(10))), longest), STAND_DOWN - us(10), "one pull");
        assert_eq!(beside_puller(Some((ms(60), Duration::ZERO)), longest), longest);

        let t0 = Instant::now();
        let mut p = Pace::new(2, longest, t0);
        p.addressed(t0);
        assert_eq!(p.after_pass(t0, true, true, None, Duration::ZERO), Wait::Now);
        let idle = t0 + ms(1);
        // Idle soon after activity its own ramp parks the shortest; beside a puller it parks
        // what the puller allows, still cut short by a timer due sooner.
        assert_eq!(p.after_pass(idle, false, false, None, Duration::ZERO), Wait::Park(BUSY_SLEEP));
        assert_eq!(p.after_pass(idle, false, false, None, us(700)), Wait::Park(us(700)));
        assert_eq!(p.after_pass(idle, false, false, Some(us(90)), us(700)), Wait::Park(us(90)));
        // With work in flight the application's pulls drive passes (the other stand-down):
        // the busy pacing is unchanged.
        let busy: Vec<_> =
            (0..=SPIN_ITERATIONS).map(|i| p.after_pass(idle + us(u64::from(i)), false, true, None, ms(1))).collect();
        assert!(busy[..SPIN_ITERATIONS as usize].iter().all(|w| *w == Wait::Yield), "{busy:?}");
        assert_eq!(busy[SPIN_ITERATIONS as usize], Wait::Park(BUSY_SLEEP));
    }

    #[test]
    fn the_stand_down_grows_with_how_long_the_application_has_been_driving() {
        let longest = ms(1);
        assert_eq!(stand_down(Duration::ZERO, longest), STAND_DOWN, "a single pass");
        assert_eq!(stand_down(us(30), longest), STAND_DOWN);
        assert_eq!(stand_down(us(400), longest), us(400));
        assert_eq!(stand_down(ms(60), longest), longest, "never longer than the longest idle park");
        assert_eq!(stand_down(ms(60), us(20)), STAND_DOWN, "nor shorter than the shortest");
    }
}
