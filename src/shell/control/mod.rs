//! The control-channel seam: how WANT/GRANT/DATA/ACK and HELLO frames travel between engines.
//! [`ucx`] rides the inner engine's notifications (the default), [`zmq`] uses ZMQ sockets, and
//! [`mem`] is an in-memory network for tests. The reactor owns one as a `Box<dyn
//! ControlChannel>` and applies the same checks to frames from any of them.

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
    /// Appends up to `budget` received control frames `(peer, bytes)` to `out`; returns how
    /// many.
    fn poll(&mut self, budget: usize, out: &mut Vec<(String, Vec<u8>)>) -> usize;
    /// Forgets a peer (peer lost): drop its socket / state.
    fn forget(&mut self, peer: &str);
}
