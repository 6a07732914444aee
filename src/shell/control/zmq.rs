//! The ZMQ control channel (`bounce_control=zmq`): our WANT/GRANT/DATA/ACK and HELLO frames over
//! ZMQ TCP sockets instead of the inner engine's UCX notifications.
//!
//! Each engine binds one PULL socket on an ephemeral TCP port and advertises it as the
//! `endpoint` of its capability blob; to reach a peer it connects a PUSH socket to the endpoint
//! in the peer's blob (the peer's connection info, which the application chose to load). A
//! message is two parts: the sending agent's name, then the frame. The name is what the sender
//! says it is, exactly as with a UCX notification, so the reactor applies the same checks
//! (loaded peers only, session ids, strict decoding). All sends and receives are non-blocking:
//! a full queue drops the frame, and the transfer it belonged to times out, never the reactor.

use std::collections::HashMap;
use std::sync::Arc;

use super::{ControlChannel, ControlError};
use crate::shell::stats::Stats;

/// Looks up a peer's advertised control endpoint (from the capabilities in its connection
/// info, kept in the peer table).
pub(crate) type Resolve = Box<dyn Fn(&str) -> Option<Vec<u8>> + Send>;

/// Longest endpoint string accepted from a peer's capabilities.
const MAX_ENDPOINT: usize = 256;
/// Frames queued per peer before sends start failing (ZMQ's high-water mark).
const SEND_HWM: i32 = 65_536;

/// A bound ZMQ control channel.
pub(crate) struct ZmqChannel {
    /// One PUSH socket per peer with the endpoint it is connected to, made on first send and
    /// remade when the peer's advertised endpoint changes (a restarted peer under the same
    /// name). Declared before the context: sockets must close before the context terminates.
    push: HashMap<String, (Vec<u8>, zmq::Socket)>,
    pull: zmq::Socket,
    endpoint: String,
    agent: String,
    resolve: Resolve,
    /// Malformed messages are counted as dropped control frames.
    stats: Arc<Stats>,
    ctx: zmq::Context,
}

fn zmq_err(op: &'static str) -> impl FnOnce(zmq::Error) -> ControlError {
    move |source| ControlError::Zmq { op, source }
}

impl ZmqChannel {
    /// Binds the receiving socket on `host` (an IP address; empty picks the address of the
    /// default route, or loopback without one) and an ephemeral port.
    ///
    /// `resolve` finds a peer's advertised endpoint when a frame is sent to it.
    ///
    /// # Errors
    /// [`ControlError::Zmq`] (socket creation, bind, reading the bound endpoint) or
    /// [`ControlError::EndpointNotUtf8`].
    pub(crate) fn bind(agent: &str, host: &str, resolve: Resolve, stats: Arc<Stats>) -> Result<Self, ControlError> {
        let ctx = zmq::Context::new();
        let pull = ctx.socket(zmq::PULL).map_err(zmq_err("socket"))?;
        let host = if host.is_empty() { default_host() } else { host.to_owned() };
        pull.set_linger(0).map_err(zmq_err("linger"))?;
        pull.bind(&format!("tcp://{host}:*")).map_err(zmq_err("bind"))?;
        let endpoint =
            pull.get_last_endpoint().map_err(zmq_err("last endpoint"))?.map_err(|_| ControlError::EndpointNotUtf8)?;
        Ok(Self { push: HashMap::new(), pull, endpoint, agent: agent.to_owned(), resolve, stats, ctx })
    }

    /// The endpoint peers connect to (`tcp://host:port`), advertised in our capabilities.
    pub(crate) fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Sends `frame` to `peer`, whose capabilities advertise `peer_endpoint`.
    ///
    /// # Errors
    /// The endpoint is not a `tcp://` address, the connect failed, or the frame could not be
    /// queued (the peer's queue is full); nothing blocks.
    fn send_to(&mut self, peer: &str, peer_endpoint: &[u8], frame: &[u8]) -> Result<(), ControlError> {
        if self.push.get(peer).is_none_or(|(at, _)| at.as_slice() != peer_endpoint) {
            self.push.remove(peer);
            let endpoint = valid_endpoint(peer_endpoint)?;
            let s = self.ctx.socket(zmq::PUSH).map_err(zmq_err("socket"))?;
            s.set_linger(0).map_err(zmq_err("linger"))?;
            s.set_sndhwm(SEND_HWM).map_err(zmq_err("high-water mark"))?;
            s.connect(endpoint).map_err(zmq_err("connect"))?;
            self.push.insert(peer.to_owned(), (peer_endpoint.to_vec(), s));
        }
        let (_, s) = &self.push[peer];
        s.send_multipart([self.agent.as_bytes(), frame], zmq::DONTWAIT).map_err(zmq_err("send"))
    }
}

impl ControlChannel for ZmqChannel {
    /// With ZMQ, the peer's endpoint comes from the capabilities in its connection info.
    fn send(&mut self, peer: &str, frame: &[u8]) -> Result<(), ControlError> {
        let endpoint = (self.resolve)(peer).ok_or(ControlError::NoEndpoint)?;
        self.send_to(peer, &endpoint, frame)
    }

    /// Receives up to `budget` waiting messages without blocking; malformed ones are counted as
    /// dropped control frames.
    fn poll(&mut self, budget: usize, out: &mut Vec<(String, Vec<u8>)>) -> usize {
        let mut got = 0;
        for _ in 0..budget {
            let Ok(mut parts) = self.pull.recv_multipart(zmq::DONTWAIT) else { break };
            let frame = parts.pop();
            match (parts.pop(), frame, parts.is_empty()) {
                (Some(name), Some(frame), true) => match String::from_utf8(name) {
                    Ok(name) => {
                        out.push((name, frame));
                        got += 1;
                    }
                    Err(_) => Stats::bump(&self.stats.control_dropped),
                },
                _ => Stats::bump(&self.stats.control_dropped),
            }
        }
        got
    }

    /// Closes the socket to `peer` (it was lost or removed); a later send reconnects.
    fn forget(&mut self, peer: &str) {
        self.push.remove(peer);
    }
}

/// A peer's advertised endpoint, if it is a plausible `tcp://` address.
fn valid_endpoint(bytes: &[u8]) -> Result<&str, ControlError> {
    let bad = || ControlError::BadEndpoint(String::from_utf8_lossy(bytes).into_owned());
    let s = std::str::from_utf8(bytes).map_err(|_| bad())?;
    // Printable ASCII only: the zmq crate panics on an interior NUL (it unwraps a CString).
    let printable = bytes.iter().all(u8::is_ascii_graphic);
    if bytes.len() > MAX_ENDPOINT || !printable || !s.starts_with("tcp://") || s.len() <= "tcp://".len() {
        return Err(bad());
    }
    Ok(s)
}

/// The local address of the default route (no packet is sent: connecting a UDP socket only
/// picks the route), or loopback when there is none.
fn default_host() -> String {
    std::net::UdpSocket::bind("0.0.0.0:0")
        .and_then(|s| s.connect("192.0.2.1:9").and_then(|()| s.local_addr()))
        .map(|a| a.ip().to_string())
        .unwrap_or_else(|_| "127.0.0.1".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bind(agent: &str) -> (ZmqChannel, Arc<Stats>) {
        let stats = Arc::new(Stats::default());
        (ZmqChannel::bind(agent, "127.0.0.1", Box::new(|_| None), Arc::clone(&stats)).unwrap(), stats)
    }

    #[test]
    fn frames_travel_between_two_channels_with_the_sender_name() {
        let (mut a, _) = bind("alpha");
        let (mut b, b_stats) = bind("beta");
        assert!(b.endpoint().starts_with("tcp://127.0.0.1:"));
        let ep = b.endpoint().as_bytes().to_vec();
        a.send_to("beta", &ep, b"\0BOUNC frame one").unwrap();
        a.send_to("beta", &ep, b"frame two").unwrap();
        let mut got = Vec::new();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while got.len() < 2 && std::time::Instant::now() < deadline {
            b.poll(16, &mut got);
            assert_eq!(b_stats.control_dropped.load(std::sync::atomic::Ordering::Relaxed), 0);
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert_eq!(
            got,
            [("alpha".to_owned(), b"\0BOUNC frame one".to_vec()), ("alpha".to_owned(), b"frame two".to_vec())]
        );
    }

    /// A peer restarted under the same name advertises a new endpoint: frames follow it.
    #[test]
    fn a_new_endpoint_for_the_same_peer_name_is_followed() {
        let (mut a, _) = bind("alpha");
        let (mut old, _) = bind("beta");
        let (mut new, _) = bind("beta");
        let wait_for = |ch: &mut ZmqChannel, ms: u64| {
            let mut got = Vec::new();
            let deadline = std::time::Instant::now() + std::time::Duration::from_millis(ms);
            while got.is_empty() && std::time::Instant::now() < deadline {
                ch.poll(16, &mut got);
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            got.into_iter().map(|(_, f)| f).collect::<Vec<_>>()
        };
        a.send_to("beta", old.endpoint().as_bytes(), b"to the old one").unwrap();
        assert_eq!(wait_for(&mut old, 10_000), [b"to the old one".to_vec()]);
        a.send_to("beta", new.endpoint().as_bytes(), b"to the new one").unwrap();
        assert_eq!(wait_for(&mut new, 10_000), [b"to the new one".to_vec()]);
        assert!(wait_for(&mut old, 200).is_empty(), "nothing more goes to the old endpoint");
    }

    #[test]
    fn a_bad_peer_endpoint_is_an_error_not_a_crash() {
        let (mut a, _) = bind("alpha");
        for bad in [&b""[..], b"tcp://", b"ipc:///tmp/x", b"\xff\xfe", b"tcp://no-such-host-\0:1", &[b'a'; 300][..]] {
            assert!(a.send_to("p", bad, b"x").is_err(), "{bad:?}");
        }
        assert!(valid_endpoint(b"tcp://10.0.0.1:5555").is_ok());
        // A peer without a known endpoint is an error too, through the channel interface.
        assert!(matches!(a.send("p", b"x"), Err(ControlError::NoEndpoint)));
    }
}
