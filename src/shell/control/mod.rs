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

/// A control channel.
pub(crate) trait ControlChannel: Send {
    /// Sends one control frame to `peer` (never blocks; a full queue is an error, the frame
    /// dropped).
    fn send(&mut self, peer: &str, frame: &[u8]) -> Result<(), ControlError>;
    /// Appends received control frames `(peer, bytes)` to `out`, taking up to `budget` of what
    /// the channel receives in (frames; for a byte-stream channel, chunks of bytes, each of
    /// which may complete several frames, or none); returns how much of `budget` it took, so
    /// that all of it means more may wait (count frames by `out`'s growth).
    fn poll(&mut self, budget: usize, out: &mut Vec<(String, Vec<u8>)>) -> usize;
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
