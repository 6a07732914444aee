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
//!
//! Exposure: the socket binds only the address configured in `bounce_zmq_host` (loopback when
//! empty; never a wildcard), and refuses any message part longer than the longest legal control
//! frame ([`wire::MAX_FRAME_LEN`]) before reading it (ZMQ drops the connection, the sender's
//! socket reconnects), so no peer can make it buffer more. ZMQ itself authenticates nothing:
//! what protects the transfers is the frames' own checks (README, "Control channels").

use std::collections::HashMap;
use std::sync::Arc;

use bounce_proto::wire;

use super::{ControlChannel, ControlError};
use crate::shell::stats::Stats;

/// Looks up a peer's advertised control endpoint (from the capabilities in its connection
/// info, kept in the peer table).
pub(crate) type Resolve = Box<dyn Fn(&str) -> Option<Vec<u8>> + Send>;

/// Longest endpoint string accepted from a peer's capabilities.
const MAX_ENDPOINT: usize = 256;
/// Frames queued per peer before sends start failing (ZMQ's high-water mark).
const SEND_HWM: i32 = 65_536;
/// Longest message part the socket accepts (`ZMQ_MAXMSGSIZE`): the longest legal control
/// frame. The other part, the sender's name, is far shorter.
const MAX_MESSAGE_PART: i64 = wire::MAX_FRAME_LEN as i64;

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
    /// Binds the receiving socket on `host` and an ephemeral port: exactly the configured IP
    /// address, or loopback when `host` is empty (other hosts then cannot reach us: set
    /// `bounce_zmq_host` to the address of the interface peers use). A wildcard address is
    /// refused: it would listen on every interface and advertise an address no peer can use.
    ///
    /// `resolve` finds a peer's advertised endpoint when a frame is sent to it.
    ///
    /// # Errors
    /// [`ControlError::BindHost`] for a host that is no specific IP address,
    /// [`ControlError::Zmq`] (socket creation, options, bind, reading the bound endpoint) or
    /// [`ControlError::EndpointNotUtf8`].
    pub(crate) fn bind(agent: &str, host: &str, resolve: Resolve, stats: Arc<Stats>) -> Result<Self, ControlError> {
        let addr = bind_addr(host)?;
        let ctx = zmq::Context::new();
        let pull = ctx.socket(zmq::PULL).map_err(zmq_err("socket"))?;
        pull.set_linger(0).map_err(zmq_err("linger"))?;
        pull.set_maxmsgsize(MAX_MESSAGE_PART).map_err(zmq_err("max message size"))?;
        pull.set_ipv6(addr.starts_with("tcp://[")).map_err(zmq_err("ipv6"))?;
        pull.bind(&addr).map_err(zmq_err("bind"))?;
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

    fn own_socket(&self) -> bool {
        true
    }

    /// `ZMQ_EVENTS`: a look at the socket's queue (a system call: ZMQ polls its mailbox).
    fn readable(&mut self) -> bool {
        self.pull.get_events().is_ok_and(|e| e.contains(zmq::POLLIN))
    }

    fn wait_fd(&self) -> Option<std::os::fd::RawFd> {
        self.pull.get_fd().ok()
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

/// The ZMQ bind address (ephemeral port) for the configured `host`: a specific IP address, or
/// loopback when empty.
fn bind_addr(host: &str) -> Result<String, ControlError> {
    let ip: std::net::IpAddr = match host {
        "" => std::net::Ipv4Addr::LOCALHOST.into(),
        h => h.parse().map_err(|_| ControlError::BindHost(h.to_owned()))?,
    };
    if ip.is_unspecified() || ip.is_multicast() {
        return Err(ControlError::BindHost(host.to_owned()));
    }
    Ok(match ip {
        std::net::IpAddr::V4(v4) => format!("tcp://{v4}:*"),
        std::net::IpAddr::V6(v6) => format!("tcp://[{v6}]:*"),
    })
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

    /// A poller may ask whether a frame waits without taking it: yes once one arrived, no
    /// again once polled.
    #[test]
    fn readable_says_whether_a_frame_waits_without_taking_it() {
        let (mut a, _) = bind("alpha");
        let (mut b, _) = bind("beta");
        assert!(b.own_socket());
        assert!(!b.readable(), "nothing sent yet");
        let ep = b.endpoint().as_bytes().to_vec();
        a.send_to("beta", &ep, b"\0BOUNC one").unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !b.readable() && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert!(b.readable(), "the frame arrived");
        assert!(b.readable(), "asking takes nothing");
        let mut got = Vec::new();
        assert_eq!(b.poll(16, &mut got), 1);
        assert!(!b.readable(), "polled");
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
    fn it_binds_only_the_configured_address_loopback_by_default_never_a_wildcard() {
        let stats = Arc::new(Stats::default());
        let bind = |host: &str| ZmqChannel::bind("a", host, Box::new(|_| None), Arc::clone(&stats));
        assert!(bind("").unwrap().endpoint().starts_with("tcp://127.0.0.1:"), "empty: loopback only");
        assert!(bind("127.0.0.1").unwrap().endpoint().starts_with("tcp://127.0.0.1:"));
        for bad in ["0.0.0.0", "::", "*", "eth0", "localhost", "224.0.0.1", "10.0.0.1:5555"] {
            assert!(matches!(bind(bad), Err(ControlError::BindHost(h)) if h == bad), "{bad}");
        }
        assert_eq!(bind_addr("::1").unwrap(), "tcp://[::1]:*");
    }

    /// A message part longer than the longest legal frame is refused by ZMQ before it is read
    /// (the connection is dropped); the channel keeps receiving, from that sender too once its
    /// socket reconnected.
    #[test]
    fn an_oversized_message_is_dropped_and_the_channel_keeps_working() {
        let (mut b, b_stats) = bind("beta");
        let (mut a, _) = bind("alpha");
        let ctx = zmq::Context::new();
        let raw = ctx.socket(zmq::PUSH).unwrap();
        raw.set_linger(0).unwrap();
        raw.connect(b.endpoint()).unwrap();
        let huge = vec![0u8; wire::MAX_FRAME_LEN + 1];
        raw.send_multipart([&b"mallory"[..], &huge[..]], 0).unwrap();
        let mut got = Vec::new();
        let wait = |ch: &mut ZmqChannel, got: &mut Vec<(String, Vec<u8>)>, n: usize, ms: u64| {
            let deadline = std::time::Instant::now() + std::time::Duration::from_millis(ms);
            while got.len() < n && std::time::Instant::now() < deadline {
                ch.poll(16, got);
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
        };
        wait(&mut b, &mut got, 1, 500);
        assert!(got.is_empty(), "the oversized message was delivered");
        // A regular frame still passes, from another sender...
        let ep = b.endpoint().as_bytes().to_vec();
        a.send_to("beta", &ep, b"\0BOUNC after").unwrap();
        wait(&mut b, &mut got, 1, 10_000);
        assert_eq!(got, [("alpha".to_owned(), b"\0BOUNC after".to_vec())]);
        // ...and from the dropped sender once ZMQ reconnected it.
        raw.send_multipart([&b"mallory"[..], &b"small"[..]], 0).unwrap();
        wait(&mut b, &mut got, 2, 10_000);
        assert_eq!(got.get(1), Some(&("mallory".to_owned(), b"small".to_vec())));
        assert_eq!(b_stats.control_dropped.load(std::sync::atomic::Ordering::Relaxed), 0);
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
