//! A streak: a run of events none more than a gap after the one before (a gap that may grow
//! with the run: [`Streak::growing`]), such as an application's pulls of the inner engine or
//! its pollers' reactor passes. Any thread notes an
//! event and any other reads the streak, with two atomics and no lock, since the application's
//! `getNotifs` notes one at every call. The reactor thread stays away from the application's
//! threads while such a streak runs, for longer the longer it has run
//! ([`crate::shell::reactor`]'s stand-downs).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Events at most as far apart as the streak has run so far, from `gap` up to `longest_gap`
/// (a fixed gap when the two are equal), timed from an epoch.
#[derive(Debug)]
pub(crate) struct Streak {
    gap: Duration,
    longest_gap: Duration,
    epoch: Instant,
    /// The latest event, in nanoseconds since `epoch` (0: none, or the streak was ended).
    latest: AtomicU64,
    /// The first event of the current streak, likewise.
    first: AtomicU64,
}

impl Streak {
    /// No streak yet; an event extends the streak when it comes no later after the previous one
    /// than the streak had run by then, and at least `gap`, at most `longest_gap`, after it.
    /// A streak earns the gaps it tolerates: a single event is followed by `gap` only, a long
    /// run by up to `longest_gap`.
    pub(crate) fn growing(gap: Duration, longest_gap: Duration) -> Self {
        let longest_gap = longest_gap.max(gap);
        Self { gap, longest_gap, epoch: Instant::now(), latest: AtomicU64::new(0), first: AtomicU64::new(0) }
    }

    fn since_epoch(&self, now: Instant) -> u64 {
        // Never 0: that means "none".
        u64::try_from(now.saturating_duration_since(self.epoch).as_nanos()).unwrap_or(u64::MAX).max(1)
    }

    /// An event at `now`: it extends the streak when the previous one is at most the allowed
    /// gap ago (`gap`, or for a growing streak the run up to the previous event, clamped to
    /// `gap..=longest_gap`). Else it starts a new one: from the previous event when that is at
    /// most `longest_gap` ago, so the new run counts the gap it came back after and tolerates
    /// the next one as long; from `now` when it is further back.
    ///
    /// Why a gap within `longest_gap` is counted: events that come back at a steady rhythm
    /// longer than the run between two of them (a Python application that spends 120 us of its
    /// own between small transfers of 100 us each) would otherwise start a new run at every
    /// gap, and never earn the gap they keep; a reactor standing down beside them took three
    /// wake-ups a transfer where one a millisecond was due (issue 12). An event after a longer
    /// silence earns nothing: a single check still holds the reactor thread off only `gap`.
    pub(crate) fn note(&self, now: Instant) {
        let now = self.since_epoch(now);
        let before = self.latest.swap(now, Ordering::AcqRel);
        // A racing note may have stored a newer `first`: a run of 0, the shortest gap.
        let run = Duration::from_nanos(before.saturating_sub(self.first.load(Ordering::Acquire)));
        let gap = Duration::from_nanos(now.saturating_sub(before));
        if before == 0 || gap > self.longest_gap {
            self.first.store(now, Ordering::Release);
        } else if gap > self.allowed_gap(run) {
            self.first.store(before, Ordering::Release);
        }
    }

    /// An event at `now` that continues the streak whatever the gap since the previous one
    /// (the events' source was busy throughout, as an application in a pass that began with a
    /// [`Self::note`]); it starts a new one only when there is none (ended meanwhile).
    pub(crate) fn hold(&self, now: Instant) {
        let now = self.since_epoch(now);
        if self.latest.swap(now, Ordering::AcqRel) == 0 {
            self.first.store(now, Ordering::Release);
        }
    }

    /// The longest gap after which an event still extends a streak that has run `run`.
    pub(crate) fn allowed_gap(&self, run: Duration) -> Duration {
        run.clamp(self.gap, self.longest_gap)
    }

    /// As [`Self::at`], but `None` once the latest event is more than the allowed gap ago:
    /// the streak is over (its next event starts a new one).
    pub(crate) fn live_at(&self, now: Instant) -> Option<(Duration, Duration)> {
        self.at(now).filter(|&(run, since)| since <= self.allowed_gap(run))
    }

    /// Ends the streak (the next event starts a new one); true when one was running.
    pub(crate) fn end(&self) -> bool {
        self.latest.swap(0, Ordering::AcqRel) != 0
    }

    /// At `now`: how long the streak ran up to its latest event and how long ago that event
    /// was; `None` when there was none since the last [`Self::end`]. A streak whose latest
    /// event is more than `gap` ago is over for its next event, not here: the caller decides
    /// what an old streak is worth.
    pub(crate) fn at(&self, now: Instant) -> Option<(Duration, Duration)> {
        let latest = self.latest.load(Ordering::Acquire);
        if latest == 0 {
            return None;
        }
        // A racing `note` may have stored a newer `first` than this `latest`: a run of 0.
        let run = Duration::from_nanos(latest.saturating_sub(self.first.load(Ordering::Acquire)));
        let since = Duration::from_nanos(self.since_epoch(now).saturating_sub(latest));
        Some((run, since))
    }

    /// A streak that ran from `first` to `latest` (tests).
    #[cfg(test)]
    pub(crate) fn set(&self, first: Instant, latest: Instant) {
        self.first.store(self.since_epoch(first), Ordering::Release);
        self.latest.store(self.since_epoch(latest), Ordering::Release);
    }

    /// The instant times are counted from (tests place events after it).
    #[cfg(test)]
    pub(crate) fn epoch(&self) -> Instant {
        self.epoch
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn us(n: u64) -> Duration {
        Duration::from_micros(n)
    }

    #[test]
    fn events_within_the_gap_extend_the_streak_and_a_longer_gap_starts_a_new_one() {
        let s = Streak::growing(us(50), us(50));
        let t0 = s.epoch() + us(1000);
        assert_eq!(s.at(t0), None, "no event yet");
        s.note(t0);
        assert_eq!(s.at(t0 + us(7)), Some((Duration::ZERO, us(7))));
        for i in 1..=10 {
            s.note(t0 + us(40 * i));
        }
        assert_eq!(s.at(t0 + us(400)), Some((us(400), Duration::ZERO)));
        // Read long after, the streak still says how long it ran and how long ago it ended.
        assert_eq!(s.at(t0 + us(900)), Some((us(400), us(500))));
        // 51 us after the latest: a new streak.
        s.note(t0 + us(451));
        assert_eq!(s.at(t0 + us(461)), Some((Duration::ZERO, us(10))));
    }

    #[test]
    fn a_growing_streak_tolerates_gaps_as_long_as_it_has_run_up_to_its_longest() {
        let s = Streak::growing(us(50), us(200));
        let t0 = s.epoch() + us(1000);
        s.note(t0);
        // Run 0 so far: only the shortest gap extends it. A longer one, no longer than the
        // longest, starts a new run that counts the gap it came back after.
        s.note(t0 + us(60));
        assert_eq!(s.at(t0 + us(60)), Some((us(60), Duration::ZERO)), "60 us after a lone event: a new run of 60 us");
        // 40 us steps for 120 us, then a gap of 100 us: within the run so far (180 us).
        for i in 1..=3 {
            s.note(t0 + us(60 + 40 * i));
        }
        s.note(t0 + us(280));
        assert_eq!(s.at(t0 + us(280)), Some((us(280), Duration::ZERO)));
        // A longer run tolerates no more than the longest gap: 201 us starts anew even now.
        for i in 1..=20 {
            s.note(t0 + us(280 + 40 * i));
        }
        let last = t0 + us(1080);
        assert_eq!(s.at(last), Some((us(1080), Duration::ZERO)));
        s.note(last + us(200));
        assert_eq!(s.at(last + us(200)), Some((us(1280), Duration::ZERO)), "200 us: still the same run");
        s.note(last + us(401));
        assert_eq!(s.at(last + us(401)), Some((Duration::ZERO, Duration::ZERO)), "201 us: a new run");
    }

    #[test]
    fn a_live_streak_is_one_whose_latest_event_is_within_its_allowed_gap() {
        let s = Streak::growing(us(100), us(200));
        let t0 = s.epoch() + us(10);
        assert_eq!(s.live_at(t0), None, "no event yet");
        s.note(t0);
        assert_eq!(s.live_at(t0 + us(100)), Some((Duration::ZERO, us(100))));
        assert_eq!(s.live_at(t0 + us(101)), None, "a lone event: over after the shortest gap");
        for i in 1..=10 {
            s.note(t0 + us(50 * i));
        }
        let last = t0 + us(500);
        assert_eq!(s.live_at(last + us(200)), Some((us(500), us(200))));
        assert_eq!(s.live_at(last + us(201)), None, "never beyond the longest gap");
        assert_eq!(s.at(last + us(201)), Some((us(500), us(201))), "at() still tells how it ran");
    }

    #[test]
    fn a_streak_whose_longest_gap_is_its_gap_tolerates_no_more_however_long_it_ran() {
        let s = Streak::growing(us(50), us(50));
        let t0 = s.epoch() + us(10);
        for i in 0..=10 {
            s.note(t0 + us(40 * i));
        }
        s.note(t0 + us(400 + 51));
        assert_eq!(s.at(t0 + us(451)), Some((Duration::ZERO, Duration::ZERO)), "a long run earns no longer gap");
    }

    #[test]
    fn events_back_at_a_steady_rhythm_longer_than_their_runs_keep_one_streak_after_the_first_gap() {
        // Runs of 100 us (checks 10 us apart) with 150 us between them: the first gap is
        // longer than the run before it and starts a new run, which counts that gap; from then
        // on every gap is within the run.
        let s = Streak::growing(us(50), us(200));
        let t0 = s.epoch() + us(10);
        let mut t = t0;
        let mut firsts = Vec::new();
        for _ in 0..5 {
            for i in 0..=10 {
                s.note(t + us(10 * i));
            }
            let (run, _) = s.at(t + us(100)).unwrap();
            firsts.push(t + us(100) - run);
            t += us(250);
        }
        assert_eq!(firsts[0], t0);
        assert_eq!(firsts[1], t0 + us(100), "the first gap began a run from the event before it");
        assert!(firsts[2..].iter().all(|&f| f == firsts[1]), "one run from then on: {firsts:?}");
    }

    #[test]
    fn holding_continues_the_streak_across_any_gap_and_starts_one_only_when_none_runs() {
        let s = Streak::growing(us(50), us(200));
        let t0 = s.epoch() + us(10);
        s.hold(t0);
        assert_eq!(s.at(t0), Some((Duration::ZERO, Duration::ZERO)), "none ran: a new one");
        s.note(t0 + us(20));
        // A pass of 500 us that began with the note: the source was busy throughout.
        s.hold(t0 + us(520));
        assert_eq!(s.at(t0 + us(520)), Some((us(520), Duration::ZERO)));
        assert!(s.end());
        s.hold(t0 + us(600));
        assert_eq!(s.at(t0 + us(600)), Some((Duration::ZERO, Duration::ZERO)));
    }

    #[test]
    fn an_ended_streak_is_none_until_the_next_event_starts_another() {
        let s = Streak::growing(us(50), us(50));
        assert!(!s.end(), "nothing to end");
        let t0 = s.epoch() + us(10);
        s.note(t0);
        s.note(t0 + us(20));
        assert!(s.end());
        assert_eq!(s.at(t0 + us(30)), None);
        assert!(!s.end());
        s.note(t0 + us(40));
        assert_eq!(s.at(t0 + us(40)), Some((Duration::ZERO, Duration::ZERO)), "a new streak, not the old one's run");
    }
}
