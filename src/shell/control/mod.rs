//! The control-channel seam: how WANT/GRANT/DATA/ACK and HELLO frames travel between engines.
//! [`ucx`] rides the inner engine's notifications (the default), [`zmq`] uses ZMQ sockets, and
//! `mem` (tests only) is an in-memory network. The reactor owns one as a `Box<dyn
//! ControlChannel>` and applies the same checks to frames from any of them.

pub(crate) mod links;
#[cfg(test)]
pub(crate) mod mem;
pub(crate) mod ucx;
pub(crate) mod zmq;

pub(crate) use crate::shell::error::ControlError;

/// A control frame as a channel received it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Inbound {
    /// The agent name it came under (what the sender says it is).
    pub(crate) peer: String,
    pub(crate) frame: Vec<u8>,
    /// The connection it came on, for channels whose connections anyone may open (ZMQ); 0
    /// for the others.
    pub(crate) conn: u64,
}

impl Inbound {
    /// A frame of a channel without connections of its own (UCX notifications).
    pub(crate) fn unconnected((peer, frame): (String, Vec<u8>)) -> Self {
        Self { peer, frame, conn: 0 }
    }
}

/// Tests compare what a channel received by name and bytes (a connection is checked apart).
#[cfg(test)]
impl PartialEq<(String, Vec<u8>)> for Inbound {
    fn eq(&self, (peer, frame): &(String, Vec<u8>)) -> bool {
        self.peer == *peer && self.frame == *frame
    }
}

/// A control channel.
pub(crate) trait ControlChannel: Send {
    /// Sends one control frame to `peer` (never blocks; a full queue is an error, the frame
    /// dropped).
    fn send(&mut self, peer: &str, frame: &[u8]) -> Result<(), ControlError>;
    /// Appends received control frames `(peer, bytes)` to `out`, taking up to `budget` of what
    /// the channel receives in (frames; for a byte-stream channel, chunks of bytes, each of
    /// which may complete several frames, or none); returns how much of `budget` it took, so
    /// that all of it means more may wait (count frames by `out`'s growth).
    fn poll(&mut self, budget: usize, out: &mut Vec<Inbound>) -> usize;
    /// The frame that came on connection `conn` (an [`Inbound::conn`]) at `now` was authentic
    /// (the core counted it in `frames_authentic`): the connection is a peer's. Channels
    /// whose connections anyone may open close such connections last when they must make
    /// room; the others have nothing to do.
    fn authentic(&mut self, conn: u64, now: std::time::Instant) {
        let _ = (conn, now);
    }
    /// Sends one frame to `peer` at `endpoint`, its control endpoint as resolved while it was
    /// still loaded: the last frame to a peer being unloaded (a FORGET), which [`Self::send`]
    /// could no longer resolve. Channels that need no endpoint (UCX) send as [`Self::send`].
    fn send_at(&mut self, peer: &str, endpoint: &[u8], frame: &[u8]) -> Result<(), ControlError> {
        let _ = endpoint;
        self.send(peer, frame)
    }
    /// Forgets a peer (peer lost): drop its socket / state.
    fn forget(&mut self, peer: &str);
    /// Whether frames arrive on a socket of the channel's own, which only a reactor pass reads
    /// (ZMQ), rather than among the inner engine's notifications, which whoever pulls them
    /// sorts (UCX). An application that polls then has to look at the socket too
    /// ([`Self::readable`]): otherwise a frame to a target whose application polls waits for
    /// the reactor thread, which stands down or parks while the application is there.
    fn own_socket(&self) -> bool {
        false
    }
    /// Whether a frame waits to be polled (cheap; no frame is taken). Only channels with
    /// [`Self::own_socket`] answer: the others say false.
    fn readable(&mut self) -> bool {
        false
    }
    /// A descriptor that turns readable when frames may have arrived (ZMQ's `ZMQ_FD`), for an
    /// idle reactor thread to sleep on; polled only, never read. `None`: frames come unannounced
    /// (UCX), the reactor looks after each park.
    fn wait_fd(&self) -> Option<std::os::fd::RawFd> {
        None
    }
}
