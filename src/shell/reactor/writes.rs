//! The data path's writes and READs of bounced chunks: queued, posted a few per peer at a time,
//! polled, and reported to the core, each checked against the peer's arena and pinned in the
//! fence while it reads user memory.

use std::time::Instant;

use bounce_proto::endpoint::WriteSource;
use bounce_proto::{ArenaId, PeerId, Region};

use super::{Driver, InFlightWrite, QueuedRead, QueuedWrite};
use crate::shell::datapath::Posted;
use crate::shell::peers::{PeerArena, WriteRefused};
use crate::sys::shim::{WriteSide, WriteState};

/// Writes handed to the data path at once, per peer. UCX runs them one after another anyway; keeping
/// one queued behind the running one keeps the link busy, and holding the rest back here lets
/// each finished chunk's DATA go out at once instead of queueing behind every other write's
/// copy inside UCX's progress (measured: DATA arrived only after all 8 windowed writes).
pub(super) const MAX_WRITES_IN_FLIGHT: usize = 2;

impl Driver {
    /// Polls in-flight writes oldest first. After each completion the core's reaction (the
    /// chunk's DATA) goes out before anything else is polled: polling progresses the inner
    /// engine, which may run the next write's copy first and hold the DATA back behind it.
    pub(super) fn poll_writes(&mut self, now: Instant) -> bool {
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

    /// Posts one queued write whose peer has room; true when it posted one (or dropped the
    /// queued writes of ended transfers). The caller drains
    /// what the write produced (on one host UCX copies it inside the post, so its DATA is
    /// ready at once) before it posts the next: posted back to back, five synchronous 2 MiB
    /// writes held the first one's DATA ~950 us on the 2-core machine. The oldest queued write
    /// whose peer has room goes first: a peer that stopped answering (its writes never
    /// complete: UCX's flush waits for it) must not hold back the writes to every other peer.
    pub(super) fn post_queued_writes(&mut self) -> bool {
        if self.stopping {
            return false;
        }
        // Dropping one is progress too: the caller drains what it produced (a cancel).
        let dropped = self.drop_orphaned_writes();
        let room = |peer: PeerId| self.writes.iter().filter(|w| w.peer == peer).count() < MAX_WRITES_IN_FLIGHT;
        let Some(i) = self.queued_writes.iter().position(|w| room(w.peer)) else { return dropped };
        let Some(w) = self.queued_writes.remove(i) else { return false };
        self.over_at_post |= self.write(w);
        true
    }

    /// Reports the queued writes of transfers that ended meanwhile (failed, canceled) as not
    /// done, without posting them: nothing was written, so their staging goes back and their
    /// transfer's cancel goes out now. Queued behind a peer that stopped answering (its
    /// writes in flight never complete), they would otherwise hold their staging for as long
    /// as the peer stays stopped.
    fn drop_orphaned_writes(&mut self) -> bool {
        if !self.queued_writes.iter().any(|w| self.ep.is_orphan(w.job)) {
            return false;
        }
        let now = Instant::now();
        let (ep, queued) = (&mut self.ep, &mut self.queued_writes);
        queued.retain(|w| {
            let orphan = ep.is_orphan(w.job);
            if orphan {
                ep.handle_write_done(now, w.job, false);
            }
            !orphan
        });
        true
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
    pub(super) fn read(&mut self, r: QueuedRead) {
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
        // The base came from the peer's metadata: one that wraps names no memory of it.
        let Some(addr) = pa.base.checked_add(remote.offset) else {
            tracing::debug!(peer = name, "peer arena address out of range");
            return self.ep.handle_read_done(now, job, false);
        };
        let remote_side = WriteSide { mem: pa.mem.into(), md: pa.md, addr, dev: pa.dev };
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
        // The base came from the peer's metadata: one that wraps names no memory of it.
        let Some(remote_addr) = pa.base.checked_add(remote.offset) else {
            tracing::debug!(peer = name, "peer arena address out of range");
            self.ep.handle_write_done(now, job, false);
            return true;
        };
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
        let remote = WriteSide { mem: pa.mem.into(), md: pa.md, addr: remote_addr, dev: pa.dev };
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
}
