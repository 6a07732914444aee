//! The data-path seam: how the reactor moves a chunk's bytes to the peer (one RDMA write) and
//! tells the peer's application that a transfer landed (its notification). The real path is
//! the inner UCX engine through the shim ([`ShimPath`]); tests join two reactors with an
//! in-memory path that copies between two arenas.

use std::collections::HashMap;
use std::sync::Arc;

use crate::shell::mailroom::Mailroom;
use crate::shell::streak::Streak;
use crate::sys::nixl::NixlStatus;
use crate::sys::shim::{Md, Shim, WriteHandle, WritePosted, WriteSide, WriteState};

/// A write in flight on a [`DataPath`]; poll it with `check`, then `release` it once.
#[derive(Debug, PartialEq, Eq, Hash)]
pub(crate) struct WriteId(pub(crate) u64);

/// What a posted write became.
#[derive(Debug)]
pub(crate) enum Posted {
    /// It finished during the post.
    Done,
    /// It is in flight.
    InFlight(WriteId),
}

/// The reactor's data path.
pub(crate) trait DataPath: Send {
    /// Posts one write of `len` host-memory bytes from `local` to `remote` at `peer`.
    ///
    /// # Errors
    /// The status the post failed with.
    fn write(&mut self, peer: &str, local: WriteSide, remote: WriteSide, len: u64) -> Result<Posted, NixlStatus>;
    /// Posts one READ of `len` host-memory bytes of `remote` at `peer` into `local` (a
    /// one-way initiator's fetch of the peer's mailbox); polled and released like a write.
    ///
    /// # Errors
    /// The status the post failed with.
    fn read(&mut self, peer: &str, local: WriteSide, remote: WriteSide, len: u64) -> Result<Posted, NixlStatus>;
    /// Polls a write in flight.
    fn check(&mut self, w: &WriteId) -> WriteState;
    /// Releases a write (exactly once, finished or not).
    fn release(&mut self, w: WriteId);
    /// Sends the application notification of a finished transfer to `peer`.
    ///
    /// # Errors
    /// The status the send failed with.
    fn notify(&mut self, peer: &str, msg: &[u8]) -> Result<(), NixlStatus>;
    /// Progresses the path (incoming writes, notifications) without blocking.
    fn progress(&mut self);
    /// Whether the application pulled the inner engine's notifications since the last ask
    /// ([`crate::shell::mailroom::Mailroom::app_pulled_since_look`]): the reactor thread then
    /// leaves the pull to it. False for a path with no application pulling.
    fn app_pulls(&mut self) -> bool {
        false
    }
    /// The application's streak of close pulls of the inner engine's notifications
    /// ([`crate::shell::mailroom::Mailroom::pulls`]), which the reactor thread reads without
    /// the driver; `None` for a path with no application pulling.
    fn app_pull_streak(&self) -> Option<Arc<Streak>> {
        None
    }
    /// Unloads a peer arena's inner metadata (no write in flight uses it).
    fn unload(&mut self, md: Md);
}

/// The inner UCX engine as data path.
pub(crate) struct ShimPath {
    shim: Shim,
    mail: Arc<Mailroom>,
    writes: HashMap<u64, WriteHandle>,
    next: u64,
}

impl ShimPath {
    /// A data path over `shim`; progress pulls its notifications into `mail`.
    pub(crate) fn new(shim: Shim, mail: Arc<Mailroom>) -> Self {
        Self { shim, mail, writes: HashMap::new(), next: 0 }
    }
}

impl DataPath for ShimPath {
    fn write(&mut self, peer: &str, local: WriteSide, remote: WriteSide, len: u64) -> Result<Posted, NixlStatus> {
        match crate::shell::marks::timed("slow-write-post", || self.shim.write(peer, local, remote, len))? {
            WritePosted::Done => Ok(Posted::Done),
            WritePosted::InFlight(h) => {
                self.next += 1;
                self.writes.insert(self.next, h);
                Ok(Posted::InFlight(WriteId(self.next)))
            }
        }
    }

    fn read(&mut self, peer: &str, local: WriteSide, remote: WriteSide, len: u64) -> Result<Posted, NixlStatus> {
        match crate::shell::marks::timed("slow-read-post", || self.shim.read(peer, local, remote, len))? {
            WritePosted::Done => Ok(Posted::Done),
            WritePosted::InFlight(h) => {
                self.next += 1;
                self.writes.insert(self.next, h);
                Ok(Posted::InFlight(WriteId(self.next)))
            }
        }
    }

    fn check(&mut self, w: &WriteId) -> WriteState {
        self.writes.get(&w.0).map_or(WriteState::Failed(NixlStatus::ErrNotFound), |h| {
            crate::shell::marks::timed("slow-check", || self.shim.check(h))
        })
    }

    fn release(&mut self, w: WriteId) {
        if let Some(h) = self.writes.remove(&w.0) {
            self.shim.release(h);
        }
    }

    fn notify(&mut self, peer: &str, msg: &[u8]) -> Result<(), NixlStatus> {
        self.shim.gen_notif(peer, msg)
    }

    /// Progresses the inner engine by pulling its notifications (sorted by the mailroom:
    /// control frames for the UCX channel, the rest for the application), unless another
    /// thread is pulling right now (see [`Mailroom::try_pull`]).
    fn progress(&mut self) {
        if let Err(st) = self.mail.try_pull(&self.shim) {
            tracing::trace!(status = %st, "inner getNotifs failed");
        }
    }

    fn app_pulls(&mut self) -> bool {
        self.mail.app_pulled_since_look()
    }

    fn app_pull_streak(&self) -> Option<Arc<Streak>> {
        Some(self.mail.pulls())
    }

    fn unload(&mut self, md: Md) {
        if let Err(st) = self.shim.unload(md) {
            tracing::debug!(status = %st, "unloading a peer arena failed");
        }
    }
}
