//! Closing the bounce path: fail what is in flight, wait (bounded) for our writes and for the
//! grants we gave out, say GOODBYE, and let go of every peer arena.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bounce_proto::wire;

use super::Driver;
use super::pace::BUSY_SLEEP;

/// How long a closing engine waits for its own writes, then for the grants it gave out to come
/// back, before letting its arena go (an arena with grants still out is then kept mapped).
pub(super) const CLOSE_WAIT: Duration = Duration::from_secs(2);

/// How long a closing engine waits to answer the PINGs that confirm its GOODBYE (a round trip
/// to a live peer; one that is gone never asks).
const FAREWELL_WAIT: Duration = Duration::from_millis(200);

impl Driver {
    /// The engine is being destroyed: fails our transfers (no queued write is posted any
    /// more), waits (bounded) for our writes in flight, then says GOODBYE to every peer we
    /// greeted (none of our writes can land in its arena after it) and waits (bounded) for the
    /// grants we gave out to come back (DATA, cancels, reclaims). True when none is left.
    pub(super) fn close(&mut self) -> bool {
        let now = Instant::now();
        self.ep.close(now);
        self.stop_posting(now);
        let _ = self.run_until(Instant::now() + CLOSE_WAIT, |d| d.writes.is_empty());
        let goodbye = wire::encode_goodbye(self.session);
        for name in std::mem::take(&mut self.greeted) {
            match self.send_control(&name, &goodbye) {
                Ok(()) => {
                    self.farewells.insert(name);
                }
                Err(e) => tracing::debug!(peer = name, error = %e, "sending GOODBYE failed"),
            }
        }
        // A peer believes a GOODBYE only once we answer its PING about it (the name and
        // session are public): wait a little for those PINGs too, or a peer of an idle engine
        // learns of the close only through its liveness probe, if at all.
        let farewell_by = Instant::now() + FAREWELL_WAIT;
        let quiet = self.run_until(Instant::now() + CLOSE_WAIT, |d| {
            d.ep.grants_outstanding() == 0 && (d.farewells.is_empty() || Instant::now() >= farewell_by)
        });
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
    pub(super) fn shutdown(&mut self) -> bool {
        let now = Instant::now();
        self.ep.shutdown(now);
        self.stop_posting(now);
        // Writes may still read the arena, and mailbox READs land in the fetch area: wait for
        // them (bounded), then release.
        let deadline = Instant::now() + Duration::from_secs(5);
        while (!self.writes.is_empty() || self.fetches.reading()) && Instant::now() < deadline {
            self.data.progress();
            let moved = self.poll_writes(Instant::now()) | self.poll_fetches(Instant::now()) | self.drain_actions();
            if !moved {
                // A write to a peer that went may take the whole wait: not a core's worth.
                std::thread::sleep(BUSY_SLEEP);
            }
        }
        // A mailbox READ let go in flight earlier may still land in the fetch area: not quiet.
        let ended = self.writes.is_empty() && !self.fetches.reading() && !self.fetches.may_still_land();
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
