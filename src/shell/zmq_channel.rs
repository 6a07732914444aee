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

/// Longest endpoint string accepted from a peer's capabilities.
const MAX_ENDPOINT: usize = 256;
/// Frames queued per peer before sends start failing (ZMQ's high-water mark).
const SEND_HWM: i32 = 65_536;

/// A bound ZMQ control channel.
pub(super) struct ZmqChannel {
    /// One PUSH socket per peer with the endpoint it is connected to, made on first send and
    /// remade when the peer's advertised endpoint changes (a restarted peer under the same
    /// name). Declared before the context: sockets must close before the context terminates.
    push: HashMap<String, (Vec<u8>, zmq::Socket)>,
    pull: zmq::Socket,
    endpoint: String,
    agent: String,
    _ctx: zmq::Context,
}

impl ZmqChannel {
    /// Binds the receiving socket on `host` (an IP address; empty picks the address of the
    /// default route, or loopback without one) and an ephemeral port.
    ///
    /// # Errors
    /// A description of what failed (socket creation, bind, reading the bound endpoint).
    pub(super) fn bind(agent: &str, host: &str) -> Result<Self, String> {
        let ctx = zmq::Context::new();
        let pull = ctx.socket(zmq::PULL).map_err(|e| format!("creating the ZMQ socket failed: {e}"))?;
        let host = if host.is_empty() { default_host() } else { host.to_owned() };
        pull.set_linger(0).map_err(|e| format!("ZMQ linger: {e}"))?;
        pull.bind(&format!("tcp://{host}:*")).map_err(|e| format!("binding ZMQ on {host} failed: {e}"))?;
        let endpoint = pull
            .get_last_endpoint()
            .map_err(|e| format!("reading the bound ZMQ endpoint failed: {e}"))?
            .map_err(|_| "the bound ZMQ endpoint is not UTF-8".to_owned())?;
        Ok(Self { push: HashMap::new(), pull, endpoint, agent: agent.to_owned(), _ctx: ctx })
    }

    /// The endpoint peers connect to (`tcp://host:port`), advertised in our capabilities.
    pub(super) fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Sends `frame` to `peer`, whose capabilities advertise `peer_endpoint`.
    ///
    /// # Errors
    /// The endpoint is not a `tcp://` address, the connect failed, or the frame could not be
    /// queued (the peer's queue is full); nothing blocks.
    pub(super) fn send(&mut self, peer: &str, peer_endpoint: &[u8], frame: &[u8]) -> Result<(), String> {
        if self.push.get(peer).is_none_or(|(at, _)| at.as_slice() != peer_endpoint) {
            self.push.remove(peer);
            let endpoint = valid_endpoint(peer_endpoint)?;
            let s = self._ctx.socket(zmq::PUSH).map_err(|e| format!("creating a ZMQ socket failed: {e}"))?;
            s.set_linger(0).map_err(|e| format!("ZMQ linger: {e}"))?;
            s.set_sndhwm(SEND_HWM).map_err(|e| format!("ZMQ high-water mark: {e}"))?;
            s.connect(endpoint).map_err(|e| format!("connecting to {endpoint} failed: {e}"))?;
            self.push.insert(peer.to_owned(), (peer_endpoint.to_vec(), s));
        }
        let (_, s) = &self.push[peer];
        s.send_multipart([self.agent.as_bytes(), frame], zmq::DONTWAIT)
            .map_err(|e| format!("queueing a frame for {peer} failed: {e}"))
    }

    /// Receives up to `max` waiting messages without blocking, handing each well-formed one
    /// to `f` as (sending agent, frame); returns how many malformed ones were dropped.
    pub(super) fn poll(&mut self, max: usize, mut f: impl FnMut(String, Vec<u8>)) -> u64 {
        let mut malformed = 0;
        for _ in 0..max {
            let Ok(mut parts) = self.pull.recv_multipart(zmq::DONTWAIT) else { break };
            let frame = parts.pop();
            match (parts.pop(), frame, parts.is_empty()) {
                (Some(name), Some(frame), true) => match String::from_utf8(name) {
                    Ok(name) => f(name, frame),
                    Err(_) => malformed += 1,
                },
                _ => malformed += 1,
            }
        }
        malformed
    }

    /// Closes the socket to `peer` (it was lost or removed); a later send reconnects.
    pub(super) fn forget(&mut self, peer: &str) {
        self.push.remove(peer);
    }
}

/// A peer's advertised endpoint, if it is a plausible `tcp://` address.
fn valid_endpoint(bytes: &[u8]) -> Result<&str, String> {
    let s = std::str::from_utf8(bytes).map_err(|_| "the peer's ZMQ endpoint is not UTF-8".to_owned())?;
    // Printable ASCII only: the zmq crate panics on an interior NUL (it unwraps a CString).
    let printable = bytes.iter().all(u8::is_ascii_graphic);
    if bytes.len() > MAX_ENDPOINT || !printable || !s.starts_with("tcp://") || s.len() <= "tcp://".len() {
        return Err(format!("the peer's ZMQ endpoint {s:?} is not a tcp:// address"));
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

    #[test]
    fn frames_travel_between_two_channels_with_the_sender_name() {
        let mut a = ZmqChannel::bind("alpha", "127.0.0.1").unwrap();
        let mut b = ZmqChannel::bind("beta", "127.0.0.1").unwrap();
        assert!(b.endpoint().starts_with("tcp://127.0.0.1:"));
        let ep = b.endpoint().as_bytes().to_vec();
        a.send("beta", &ep, b"\0BOUNC frame one").unwrap();
        a.send("beta", &ep, b"frame two").unwrap();
        let mut got = Vec::new();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while got.len() < 2 && std::time::Instant::now() < deadline {
            assert_eq!(b.poll(16, |n, f| got.push((n, f))), 0);
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
        let mut a = ZmqChannel::bind("alpha", "127.0.0.1").unwrap();
        let mut old = ZmqChannel::bind("beta", "127.0.0.1").unwrap();
        let mut new = ZmqChannel::bind("beta", "127.0.0.1").unwrap();
        let wait_for = |ch: &mut ZmqChannel, ms: u64| {
            let mut got = Vec::new();
            let deadline = std::time::Instant::now() + std::time::Duration::from_millis(ms);
            while got.is_empty() && std::time::Instant::now() < deadline {
                ch.poll(16, |_, f| got.push(f));
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            got
        };
        a.send("beta", old.endpoint().as_bytes(), b"to the old one").unwrap();
        assert_eq!(wait_for(&mut old, 10_000), [b"to the old one".to_vec()]);
        a.send("beta", new.endpoint().as_bytes(), b"to the new one").unwrap();
        assert_eq!(wait_for(&mut new, 10_000), [b"to the new one".to_vec()]);
        assert!(wait_for(&mut old, 200).is_empty(), "nothing more goes to the old endpoint");
    }

    #[test]
    fn a_bad_peer_endpoint_is_an_error_not_a_crash() {
        let mut a = ZmqChannel::bind("alpha", "127.0.0.1").unwrap();
        for bad in [&b""[..], b"tcp://", b"ipc:///tmp/x", b"\xff\xfe", b"tcp://no-such-host-\0:1", &[b'a'; 300][..]] {
            assert!(a.send("p", bad, b"x").is_err(), "{bad:?}");
        }
        assert!(valid_endpoint(b"tcp://10.0.0.1:5555").is_ok());
    }
}
