//! A doorbell an application poller may wait on instead of spinning: rung when something it
//! polls for has happened (an application notification was sorted, a bounce request finished).
//!
//! Tickets make the wait race-free: a poller takes a ticket *before* looking, and waits only while
//! nothing has rung since, so an event between its look and its wait is never slept through.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

/// The doorbell: a ring counter and the condition variable waiters sleep on. The counter is
/// read without the lock (taking a ticket is on every `getNotifs`); it changes only under it,
/// so a waiter that compares under the lock cannot miss a ring.
#[derive(Debug, Default)]
pub(crate) struct Doorbell {
    rung: AtomicU64,
    lock: Mutex<()>,
    cv: Condvar,
}

impl Doorbell {
    /// The current ticket: pass it to [`Self::wait_past`] after looking.
    pub(crate) fn ticket(&self) -> u64 {
        self.rung.load(Ordering::Acquire)
    }

    /// Rings: wakes every waiter.
    pub(crate) fn ring(&self) {
        {
            let _g = self.lock.lock();
            self.rung.fetch_add(1, Ordering::AcqRel);
        }
        self.cv.notify_all();
    }

    /// Waits until the bell has rung since `ticket` was taken, or `max` has passed. Returns
    /// whether it rang.
    pub(crate) fn wait_past(&self, ticket: u64, max: Duration) -> bool {
        let deadline = Instant::now() + max;
        let mut g = self.lock.lock();
        while self.ticket() == ticket {
            if self.cv.wait_until(&mut g, deadline).timed_out() {
                return self.ticket() != ticket;
            }
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn a_ring_after_the_ticket_ends_the_wait_and_none_means_the_full_wait() {
        let bell = Doorbell::default();
        let t = bell.ticket();
        bell.ring();
        let start = Instant::now();
        assert!(bell.wait_past(t, Duration::from_secs(30)), "a ring since the ticket must not be slept through");
        assert!(start.elapsed() < Duration::from_secs(5));

        let t = bell.ticket();
        let start = Instant::now();
        assert!(!bell.wait_past(t, Duration::from_millis(20)));
        assert!(start.elapsed() >= Duration::from_millis(20), "no ring: the wait lasts its bound");
    }

    #[test]
    fn a_ring_from_another_thread_wakes_the_waiter_early() {
        let bell = Arc::new(Doorbell::default());
        let t = bell.ticket();
        let b = Arc::clone(&bell);
        let ringer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(10));
            b.ring();
        });
        let start = Instant::now();
        assert!(bell.wait_past(t, Duration::from_secs(30)));
        assert!(start.elapsed() < Duration::from_secs(5), "woken by the ring, not by the bound");
        ringer.join().unwrap();
    }
}
