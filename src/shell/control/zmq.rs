//! The ZMQ control channel (`bounce_control=zmq`): our WANT/GRANT/DATA/ACK and HELLO frames over
//! ZMQ TCP sockets instead of the inner engine's UCX notifications.
//!
//! Each engine binds one `ZMQ_STREAM` socket on an ephemeral TCP port and advertises it as the
//! `endpoint` of its capability blob; to reach a peer it connects a `ZMQ_STREAM` socket of its
//! own to the endpoint in the peer's blob (the peer's connection info, which the application
//! chose to load). Both carry raw TCP bytes framed by [`bounce_proto::wire::stream`]: the sending agent's
//! name, then the frame. The name is what the sender says it is, exactly as with a UCX
//! notification, so the reactor applies the same checks (loaded peers only, session ids,
//! strict decoding). All sends and receives are non-blocking: a full queue drops the frame,
//! and the transfer it belonged to times out, never the reactor.
//!
//! Exposure: the socket binds only the address configured in `bounce_zmq_host` (loopback when
//! empty; never a wildcard). Whoever connects is held to bounds we count ourselves (a name and
//! a frame no longer than legal, all connections' unfinished messages within a budget, a cap
//! on connections) and cut off when it breaks one, and ZMQ holds at most [`RCV_HWM`] chunks per
//! connection for us: no sender can make us buffer more. (ZMQ's own PUSH/PULL messages could
//! not be bounded so: ZMQ keeps an unfinished multipart message out of the reader's sight and
//! without limit.) ZMQ itself authenticates nothing: what protects the transfers is the
//! frames' own checks (README, "Control channels").

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bounce_proto::wire;
use bounce_proto::wire::stream::{self as streams, Limits, Streams, Verdict};

use super::links::Links;
use super::{ControlChannel, ControlError, Inbound};
use crate::shell::stats::Stats;
use crate::sys::zmq as zsys;

/// Looks up a peer's advertised control endpoint (from the capabilities in its connection
/// info, kept in the peer table).
pub(crate) type Resolve = Box<dyn Fn(&str) -> Option<Vec<u8>> + Send>;

/// Longest endpoint string accepted from a peer's capabilities.
const MAX_ENDPOINT: usize = 256;
/// Frames queued per peer before sends start failing (ZMQ's high-water mark).
const SEND_HWM: i32 = 65_536;
/// How long the socket to a forgotten peer may still deliver what it queued (its last frame,
/// a FORGET, was sent just before) in ZMQ's I/O thread: closing does not wait for it, but a
/// socket closed with no linger would drop that frame unsent.
const FORGET_LINGER_MS: i32 = 200;
/// Chunks of bytes ZMQ reads ahead per connection for us (it reads 8 KiB at a time), beyond
/// which it stops reading that connection until we take them.
const RCV_HWM: i32 = 16;
/// What a sender is held to (see [`Streams`]): a name of at most 1 KiB, a frame no longer
/// than the longest legal one, two such frames unfinished over all connections, and 1024
/// connections.
const LIMITS: Limits = Limits {
    name: bounce_proto::peers::MAX_NAME_LEN,
    frame: wire::MAX_FRAME_LEN,
    buffered: 2 * wire::MAX_FRAME_LEN,
    conns: 1024,
};
/// What the channel holds senders to: [`LIMITS`], with a budget of 4 MiB under test, so that
/// reaching it takes little traffic.
const fn limits() -> Limits {
    if cfg!(test) { Limits { buffered: 4 << 20, ..LIMITS } } else { LIMITS }
}

/// The routing id of our one connection on each outgoing socket.
const OUT_ID: &[u8] = b"bounce";
/// How often the outgoing sockets not reached yet are looked at for their connect and
/// disconnect notices (a receive each): a prep waiting for a peer's first connection
/// ([`Links`]) waits about this long beyond [`LINK_STABLE`].
const LINK_LOOK_EVERY: Duration = Duration::from_millis(1);
/// How often every outgoing socket is looked at (an ended connection is seen this late at
/// most, or at the next send to it).
const LINKS_ALL_EVERY: Duration = Duration::from_millis(100);
/// How long a connection must stay open before its peer counts as reached.
const LINK_STABLE: Duration = Duration::from_millis(10);

/// A socket to one peer.
struct Link {
    /// The endpoint it connects to.
    endpoint: Vec<u8>,
    socket: zmq::Socket,
    /// Since when its connection is open (its connect notice, and no end since).
    open_since: Option<Instant>,
    /// Reported reached to [`Links`]: open for [`LINK_STABLE`] at least.
    up: bool,
}

/// A bound ZMQ control channel.
pub(crate) struct ZmqChannel {
    /// One outgoing socket per peer with the endpoint it is connected to, made on first send
    /// and remade when the peer's advertised endpoint changes (a restarted peer under the same
    /// name) or its connection ended. Declared before the context: sockets must close before
    /// the context terminates.
    push: HashMap<String, Link>,
    pull: zmq::Socket,
    /// Every incoming connection's unfinished message.
    streams: Streams,
    /// The frames one connection's bytes completed, before they are tagged with it.
    fed: Vec<(String, Vec<u8>)>,
    endpoint: String,
    agent: String,
    resolve: Resolve,
    /// Which of those sockets are connected, for the gate's one-way route.
    links: Arc<Links>,
    /// When the outgoing sockets were last looked at ([`LINK_LOOK_EVERY`]), and all of them
    /// ([`LINKS_ALL_EVERY`]).
    links_seen: Instant,
    links_all_seen: Instant,
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
    pub(crate) fn bind(
        agent: &str,
        host: &str,
        resolve: Resolve,
        links: Arc<Links>,
        stats: Arc<Stats>,
    ) -> Result<Self, ControlError> {
        let addr = bind_addr(host)?;
        let ctx = zmq::Context::new();
        let mut pull = ctx.socket(zmq::STREAM).map_err(zmq_err("socket"))?;
        pull.set_linger(0).map_err(zmq_err("linger"))?;
        pull.set_rcvhwm(RCV_HWM).map_err(zmq_err("high-water mark"))?;
        // A notice (an empty message) when a connection opens or ends: the cap counts them.
        zsys::set_int(&mut pull, zsys::ZMQ_STREAM_NOTIFY, 1).map_err(zmq_err("stream notify"))?;
        pull.set_ipv6(addr.starts_with("tcp://[")).map_err(zmq_err("ipv6"))?;
        pull.bind(&addr).map_err(zmq_err("bind"))?;
        let endpoint =
            pull.get_last_endpoint().map_err(zmq_err("last endpoint"))?.map_err(|_| ControlError::EndpointNotUtf8)?;
        let streams = Streams::new(limits());
        Ok(Self {
            push: HashMap::new(),
            pull,
            streams,
            fed: Vec::new(),
            endpoint,
            agent: agent.to_owned(),
            resolve,
            links,
            links_seen: Instant::now(),
            links_all_seen: Instant::now(),
            stats,
            ctx,
        })
    }

    /// The endpoint peers connect to (`tcp://host:port`), advertised in our capabilities.
    pub(crate) fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Makes the socket to `peer` at `peer_endpoint` and starts its connection: it is up (for
    /// [`Links`]) once its connect notice comes.
    ///
    /// # Errors
    /// The endpoint is not a `tcp://` address, or making the socket or starting the connect
    /// failed.
    fn open(&mut self, peer: &str, peer_endpoint: &[u8]) -> Result<(), ControlError> {
        let endpoint = valid_endpoint(peer_endpoint)?;
        let mut s = self.ctx.socket(zmq::STREAM).map_err(zmq_err("socket"))?;
        s.set_linger(0).map_err(zmq_err("linger"))?;
        s.set_sndhwm(SEND_HWM).map_err(zmq_err("high-water mark"))?;
        // Only its notices come in (an empty message when the connection opens, another when
        // it ends; the peer sends nothing on it), and only a few at a time.
        s.set_rcvhwm(RCV_HWM).map_err(zmq_err("high-water mark"))?;
        // A connect that fails is tried again (every 100 ms, backing off to 1 s): with no
        // retry, a peer not listening at our first send (a route flapping, a process still
        // starting) was never reached, every later frame queued into a connection that
        // never came. A connection that ended is made again by libzmq (with this backoff);
        // should a send to ours fail, a new socket is made.
        s.set_reconnect_ivl(100).map_err(zmq_err("reconnect"))?;
        s.set_reconnect_ivl_max(1000).map_err(zmq_err("reconnect"))?;
        zsys::set_int(&mut s, zsys::ZMQ_STREAM_NOTIFY, 1).map_err(zmq_err("stream notify"))?;
        zsys::set_bytes(&mut s, zsys::ZMQ_CONNECT_ROUTING_ID, OUT_ID).map_err(zmq_err("routing id"))?;
        // Without it libzmq refuses to connect to an IPv6 address (an engine bound to an
        // IPv6 `bounce_zmq_host`), and the frames wait in the pipe for ever.
        s.set_ipv6(endpoint.starts_with("tcp://[")).map_err(zmq_err("ipv6"))?;
        s.connect(endpoint).map_err(zmq_err("connect"))?;
        self.links.connecting(peer, peer_endpoint);
        self.push
            .insert(peer.to_owned(), Link { endpoint: peer_endpoint.to_vec(), socket: s, open_since: None, up: false });
        Ok(())
    }

    /// Takes the outgoing sockets' notices: those not reached yet at most every
    /// [`LINK_LOOK_EVERY`] (a prep may be waiting for one), all of them at most every
    /// [`LINKS_ALL_EVERY`] (each look is a system call or two per socket, and an idle engine
    /// with hundreds of peers loaded looks all the time). A connection counts once it has
    /// stayed open [`LINK_STABLE`]: something that accepts and closes at once (a peer at its
    /// connection cap, a proxy with no way on) never does. An ended one is down until libzmq's
    /// own reconnect (with its backoff) comes back.
    fn look_at_links(&mut self, now: Instant) {
        if now.duration_since(self.links_seen) < LINK_LOOK_EVERY || self.push.is_empty() {
            return;
        }
        self.links_seen = now;
        let all = now.duration_since(self.links_all_seen) >= LINKS_ALL_EVERY;
        if all {
            self.links_all_seen = now;
        }
        for (peer, link) in self.push.iter_mut().filter(|(_, l)| all || !l.up) {
            // A few notices at most per look (the rest wait for the next).
            for _ in 0..4 {
                let Ok(parts) = link.socket.recv_multipart(zmq::DONTWAIT) else { break };
                // Our peers send nothing on our connection: only an empty message (a notice)
                // counts, an open and an end in turn.
                if parts.len() != 2 || !parts[1].is_empty() {
                    continue;
                }
                if link.open_since.take().is_none() {
                    link.open_since = Some(now);
                } else if link.up {
                    link.up = false;
                    self.links.connecting(peer, &link.endpoint);
                }
            }
            if !link.up && link.open_since.is_some_and(|t| now.duration_since(t) >= LINK_STABLE) {
                link.up = true;
                self.links.up(peer, &link.endpoint);
            }
        }
    }

    /// Sends `frame` to `peer`, whose capabilities advertise `peer_endpoint`.
    ///
    /// # Errors
    /// The endpoint is not a `tcp://` address, the connect failed, or the frame could not be
    /// queued (the peer's queue is full); nothing blocks.
    fn send_to(&mut self, peer: &str, peer_endpoint: &[u8], frame: &[u8]) -> Result<(), ControlError> {
        let msg = streams::encode(&self.agent, frame).ok_or(ControlError::FrameTooLong(frame.len()))?;
        if self.push.get(peer).is_none_or(|l| l.endpoint.as_slice() != peer_endpoint) {
            self.push.remove(peer);
            self.open(peer, peer_endpoint)?;
        }
        let s = &self.push[peer].socket;
        match s.send_multipart([OUT_ID, &msg[..]], zmq::DONTWAIT) {
            Ok(()) => Ok(()),
            Err(zmq::Error::EAGAIN) => Err(zmq_err("send")(zmq::Error::EAGAIN)),
            Err(e) => {
                // The connection ended (the peer went, or cut us off): a new socket, down until
                // it connects (and down if it cannot be made).
                self.push.remove(peer);
                self.links.connecting(peer, peer_endpoint);
                let _ = self.open(peer, peer_endpoint);
                Err(zmq_err("send")(e))
            }
        }
    }
}

impl ControlChannel for ZmqChannel {
    /// With ZMQ, the peer's endpoint comes from the capabilities in its connection info.
    fn send(&mut self, peer: &str, frame: &[u8]) -> Result<(), ControlError> {
        let endpoint = (self.resolve)(peer).ok_or(ControlError::NoEndpoint)?;
        self.send_to(peer, &endpoint, frame)
    }

    fn send_at(&mut self, peer: &str, endpoint: &[u8], frame: &[u8]) -> Result<(), ControlError> {
        self.send_to(peer, endpoint, frame)
    }

    /// Reads up to `budget` waiting chunks without blocking, appends the frames they complete,
    /// and returns how many chunks it read: a frame over 2 MiB in transit can take the whole
    /// budget and complete nothing, and the reactor must still know that more waits (the
    /// socket's descriptor will not say so again). Malformed messages are counted as dropped
    /// control frames, and a connection that breaks a bound is closed.
    fn poll(&mut self, budget: usize, out: &mut Vec<Inbound>) -> usize {
        let mut dropped = 0u64;
        let now = Instant::now();
        self.look_at_links(now);
        let mut read = 0;
        while read < budget {
            let Ok(mut parts) = self.pull.recv_multipart(zmq::DONTWAIT) else { break };
            read += 1;
            let (Some(data), Some(id), true) = (parts.pop(), parts.pop(), parts.is_empty()) else {
                dropped += 1;
                continue;
            };
            let verdict = if data.is_empty() {
                self.streams.notice(now, &id)
            } else {
                // Activity is what a loaded peer sends (one with an endpoint here).
                let resolve = &self.resolve;
                let v = self.streams.feed(now, &id, &data, &mut self.fed, &mut dropped, |name| resolve(name).is_some());
                let conn = conn_tag(&id);
                out.extend(self.fed.drain(..).map(|(peer, frame)| Inbound { peer, frame, conn }));
                v
            };
            // An empty message to a connection closes it: this one, and any closed to make
            // room for it.
            if verdict == Verdict::Close {
                let _ = self.pull.send_multipart([&id[..], &[][..]], zmq::DONTWAIT);
            }
            for idle in self.streams.take_evicted() {
                let _ = self.pull.send_multipart([&idle[..], &[][..]], zmq::DONTWAIT);
            }
        }
        for _ in 0..dropped {
            Stats::bump(&self.stats.control_dropped);
        }
        read
    }

    /// Closes the socket to `peer` (it was lost or removed, or declared dead). What it queued
    /// still goes out for [`FORGET_LINGER_MS`] (a FORGET sent just before). A peer still loaded
    /// (declared dead while only stalled) gets a new socket at once: a one-way target is sent
    /// nothing until it is reached again.
    fn forget(&mut self, peer: &str) {
        if let Some(link) = self.push.remove(peer) {
            let _ = link.socket.set_linger(FORGET_LINGER_MS);
        }
        match (self.resolve)(peer) {
            Some(endpoint) if self.open(peer, &endpoint).is_ok() => {}
            _ => self.links.gone(peer),
        }
    }

    /// Such a connection is closed last when strangers' connections need room (see
    /// [`Streams::authentic`]).
    fn authentic(&mut self, conn: u64, now: Instant) {
        if let Some(id) = routing_id(conn) {
            self.streams.authentic(now, &id);
        }
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

/// A connection's routing id as an [`Inbound::conn`]: its length in the top byte, its bytes
/// below. libzmq gives each connection of a `ZMQ_STREAM` socket a 5-byte id; a longer one
/// (none of ours) gets 0, and its frames never mark it.
fn conn_tag(id: &[u8]) -> u64 {
    if id.is_empty() || id.len() > 7 {
        return 0;
    }
    let len = id.len() as u64; // at most 7
    id.iter().enumerate().fold(len << 56, |tag, (i, &b)| tag | u64::from(b) << (8 * i))
}

/// The routing id [`conn_tag`] made `tag` of.
fn routing_id(tag: u64) -> Option<Vec<u8>> {
    let len = usize::try_from(tag >> 56).ok().filter(|&l| (1..=7).contains(&l))?;
    Some((0..len).map(|i| (tag >> (8 * i)) as u8).collect())
}

/// A peer's advertised endpoint, if it is `tcp://` and an IP address with a port, as our
/// engines advertise (`bind_addr`). A host name would make libzmq resolve it, blocking, on the
/// thread that also reads our receiving socket, at every reconnect: a name whose resolver never
/// answers held every peer's frames for seconds (review 54, control H1).
fn valid_endpoint(bytes: &[u8]) -> Result<&str, ControlError> {
    let bad = || ControlError::BadEndpoint(String::from_utf8_lossy(bytes).into_owned());
    let s = std::str::from_utf8(bytes).map_err(|_| bad())?;
    // Printable ASCII only: the zmq crate panics on an interior NUL (it unwraps a CString).
    let printable = bytes.iter().all(u8::is_ascii_graphic);
    let addr = s.strip_prefix("tcp://").and_then(|a| a.parse::<std::net::SocketAddr>().ok());
    if bytes.len() > MAX_ENDPOINT || !printable || addr.is_none() {
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
        (ZmqChannel::bind(agent, "127.0.0.1", Box::new(|_| None), Arc::default(), Arc::clone(&stats)).unwrap(), stats)
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

    /// An engine bound to an IPv6 `bounce_zmq_host` is reached: the connecting socket enables
    /// IPv6 (without it libzmq never connected, and the frames waited in the pipe for ever).
    /// A host without IPv6 loopback cannot run it, and says so (under CI it fails).
    #[test]
    fn a_peer_bound_to_an_ipv6_address_is_reached() {
        let stats = Arc::new(Stats::default());
        let bind6 = |agent| ZmqChannel::bind(agent, "::1", Box::new(|_| None), Arc::default(), Arc::clone(&stats));
        let (mut a, mut b) = match (bind6("alpha"), bind6("beta")) {
            (Ok(a), Ok(b)) => (a, b),
            (Err(e), _) | (_, Err(e)) => {
                assert!(std::env::var("CI").is_err(), "no IPv6 loopback under CI: {e}");
                eprintln!("SKIPPED (loudly): this host cannot bind ZMQ to ::1: {e}");
                return;
            }
        };
        assert!(b.endpoint().starts_with("tcp://[::1]:"), "{}", b.endpoint());
        let ep = b.endpoint().as_bytes().to_vec();
        a.send_to("beta", &ep, b"\0BOUNC over v6").unwrap();
        let mut got = Vec::new();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while got.is_empty() && std::time::Instant::now() < deadline {
            b.poll(16, &mut got);
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert_eq!(got, [("alpha".to_owned(), b"\0BOUNC over v6".to_vec())]);
    }

    /// A frame longer than a poll's budget of chunks completes nothing in one poll, which then
    /// says it took its whole budget (so the reactor polls again instead of parking: the
    /// socket's descriptor will not say again that more waits); it arrives whole over the next.
    #[test]
    fn a_poll_that_completes_no_frame_still_says_it_took_its_whole_budget() {
        let (mut a, _) = bind("alpha");
        let (mut b, _) = bind("beta");
        let ep = b.endpoint().as_bytes().to_vec();
        let frame: Vec<u8> = (0..1u32 << 20).map(|i| i as u8).collect();
        a.send_to("beta", &ep, &frame).unwrap();
        let (mut got, mut full_without_frame) = (Vec::new(), false);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while got.is_empty() && std::time::Instant::now() < deadline {
            let took = b.poll(4, &mut got);
            full_without_frame |= took == 4 && got.is_empty();
            if took < 4 {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        }
        assert_eq!(got, [("alpha".to_owned(), frame)]);
        assert!(full_without_frame, "a poll of 4 chunks (32 KiB at most) never took its whole budget");
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
        let mut got = Vec::new();
        // The stream socket first delivers the connection's notice (an empty message): it makes
        // the socket readable too, and a poll takes it as no frame. Wait through it.
        loop {
            while !b.readable() && std::time::Instant::now() < deadline {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            assert!(b.readable(), "the frame arrived");
            assert!(b.readable(), "asking takes nothing");
            b.poll(16, &mut got);
            if got.len() == 1 {
                break;
            }
            assert!(std::time::Instant::now() < deadline, "no frame within 10 s");
        }
        assert_eq!(got.len(), 1);
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
            got.into_iter().map(|i| i.frame).collect::<Vec<_>>()
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
        let bind = |host: &str| ZmqChannel::bind("a", host, Box::new(|_| None), Arc::default(), Arc::clone(&stats));
        assert!(bind("").unwrap().endpoint().starts_with("tcp://127.0.0.1:"), "empty: loopback only");
        assert!(bind("127.0.0.1").unwrap().endpoint().starts_with("tcp://127.0.0.1:"));
        for bad in ["0.0.0.0", "::", "*", "eth0", "localhost", "224.0.0.1", "10.0.0.1:5555"] {
            assert!(matches!(bind(bad), Err(ControlError::BindHost(h)) if h == bad), "{bad}");
        }
        assert_eq!(bind_addr("::1").unwrap(), "tcp://[::1]:*");
    }

    fn wait(ch: &mut ZmqChannel, got: &mut Vec<Inbound>, n: usize, ms: u64) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_millis(ms);
        while got.len() < n && std::time::Instant::now() < deadline {
            ch.poll(16, got);
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }

    /// A raw TCP connection to the channel's endpoint.
    fn raw(ch: &ZmqChannel) -> std::net::TcpStream {
        let addr = ch.endpoint().trim_start_matches("tcp://");
        std::net::TcpStream::connect(addr).unwrap()
    }

    /// A header promising a frame longer than the longest legal one gets its connection cut
    /// before the body is read; the channel keeps receiving from everyone else.
    #[test]
    fn an_oversized_message_is_cut_off_and_the_channel_keeps_working() {
        use std::io::{Read, Write};
        let (mut b, b_stats) = bind("beta");
        let (mut a, _) = bind("alpha");
        let mut m = raw(&b);
        let mut header = vec![0u8; streams::HEADER];
        header[2..6].copy_from_slice(&(wire::MAX_FRAME_LEN as u32 + 1).to_le_bytes());
        m.write_all(&header).unwrap();
        let mut got = Vec::new();
        wait(&mut b, &mut got, 1, 300);
        assert!(got.is_empty());
        // The connection is closed: a read sees its end.
        m.set_read_timeout(Some(std::time::Duration::from_secs(10))).unwrap();
        assert_eq!(m.read(&mut [0u8; 16]).unwrap(), 0, "the connection was not closed");
        assert_eq!(b_stats.control_dropped.load(std::sync::atomic::Ordering::Relaxed), 1);
        let ep = b.endpoint().as_bytes().to_vec();
        a.send_to("beta", &ep, b"\0BOUNC after").unwrap();
        wait(&mut b, &mut got, 1, 10_000);
        assert_eq!(got, [("alpha".to_owned(), b"\0BOUNC after".to_vec())]);
    }

    /// Messages that never finish, over many connections, hold no more than the budget: the
    /// connections that would take it over are cut off (with ZMQ's own multipart messages the
    /// parts piled up unseen and without limit), and honest frames still pass.
    #[test]
    fn messages_that_never_finish_are_held_within_the_budget() {
        use std::io::Write;
        let (mut b, _) = bind("beta");
        let (mut a, _) = bind("alpha");
        let budget = limits().buffered;
        // Each connection promises the longest legal frame and streams pieces of it.
        let mut header = vec![0u8; streams::HEADER];
        header[2..6].copy_from_slice(&(wire::MAX_FRAME_LEN as u32).to_le_bytes());
        let chunk = vec![0xAB_u8; 256 << 10];
        let mut conns: Vec<std::net::TcpStream> = (0..8).map(|_| raw(&b)).collect();
        let mut got = Vec::new();
        for c in &mut conns {
            c.write_all(&header).unwrap();
            c.set_nonblocking(true).unwrap();
        }
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while b.streams.conns() == 0 || b.streams.conns() == conns.len() {
            assert!(std::time::Instant::now() < deadline, "no connection was cut off at the budget");
            for c in &mut conns {
                let _ = c.write(&chunk);
            }
            b.poll(4096, &mut got);
            assert!(b.streams.buffered() <= budget, "{} bytes held", b.streams.buffered());
        }
        assert!(got.is_empty());
        let ep = b.endpoint().as_bytes().to_vec();
        a.send_to("beta", &ep, b"\0BOUNC honest").unwrap();
        wait(&mut b, &mut got, 1, 10_000);
        assert_eq!(got, [("alpha".to_owned(), b"\0BOUNC honest".to_vec())]);
        assert!(b.streams.buffered() <= budget);
    }

    /// A sender whose connection was cut off (here: by a header over the bounds) is connected
    /// anew by its next send.
    #[test]
    fn a_sender_cut_off_reconnects_on_its_next_send() {
        let (mut b, _) = bind("beta");
        let (mut a, _) = bind("alpha");
        let ep = b.endpoint().as_bytes().to_vec();
        let huge = vec![0u8; wire::MAX_FRAME_LEN + 1];
        let mut got = Vec::new();
        let _ = a.send_to("beta", &ep, &huge);
        wait(&mut b, &mut got, 1, 300);
        assert!(got.is_empty());
        // Until the send that finds the connection gone, frames are lost; then they pass.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while got.is_empty() && std::time::Instant::now() < deadline {
            let _ = a.send_to("beta", &ep, b"\0BOUNC again");
            wait(&mut b, &mut got, 1, 50);
        }
        assert!(got.first().is_some_and(|i| *i == ("alpha".to_owned(), b"\0BOUNC again".to_vec())));
    }

    /// A peer not listening yet at our first send (its connect refused: a route flapping, a
    /// process still starting) is reached once it listens: the socket made for it keeps
    /// trying, rather than queueing every later frame into a connection that never comes.
    #[test]
    fn a_peer_unreachable_at_first_connect_is_reached_once_it_listens() {
        use std::io::Read;
        let (mut a, _) = bind("alpha");
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let ep = format!("tcp://127.0.0.1:{port}").into_bytes();
        a.send_to("beta", &ep, b"\0BOUNC early").unwrap();
        std::thread::sleep(std::time::Duration::from_millis(300));
        let listener = std::net::TcpListener::bind(("127.0.0.1", port)).expect("the port is free again");
        listener.set_nonblocking(true).unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        let mut conn = loop {
            let _ = a.send_to("beta", &ep, b"\0BOUNC late");
            match listener.accept() {
                Ok((c, _)) => break c,
                Err(_) => {
                    assert!(std::time::Instant::now() < deadline, "no connection came once the peer listened");
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
            }
        };
        conn.set_read_timeout(Some(std::time::Duration::from_secs(2))).unwrap();
        let mut bytes = [0u8; 64];
        let n = conn.read(&mut bytes).unwrap();
        assert!(n > 0, "a frame arrives on the connection");
    }

    /// Polls `ch` (which looks at its outgoing sockets at most every millisecond) until
    /// `cond` holds or `ms` pass; returns whether it held.
    fn poll_until(ch: &mut ZmqChannel, ms: u64, cond: impl Fn() -> bool) -> bool {
        let deadline = std::time::Instant::now() + std::time::Duration::from_millis(ms);
        let mut got = Vec::new();
        while std::time::Instant::now() < deadline {
            ch.poll(16, &mut got);
            if cond() {
                return true;
            }
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        cond()
    }

    /// The one-way route's signal (review 61, control M2): a peer counts as reached once our
    /// socket to the endpoint it advertises has connected, never while nothing listens there,
    /// and no longer once that connection ended (a new socket then tries again).
    #[test]
    fn a_peer_counts_as_reached_only_while_our_socket_to_its_endpoint_is_connected() {
        let stats = Arc::new(Stats::default());
        let links = Arc::new(Links::default());
        let mut a =
            ZmqChannel::bind("alpha", "127.0.0.1", Box::new(|_| None), Arc::clone(&links), Arc::clone(&stats)).unwrap();
        let (b, _) = bind("beta");
        let ep = b.endpoint().as_bytes().to_vec();
        let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let dead = format!("tcp://127.0.0.1:{dead}").into_bytes();
        let now = std::time::Instant::now();
        a.send_to("beta", &ep, b"\0BOUNC hello").unwrap();
        a.send_to("gamma", &dead, b"\0BOUNC hello").unwrap();
        let past = now + super::super::links::FIRST_CONNECT_WAIT; // no load's wait: a plain look
        assert!(poll_until(&mut a, 5000, || links.reached("beta", &ep, past)), "connected, never marked reached");
        assert!(!poll_until(&mut a, 300, || links.reached("gamma", &dead, past)), "nothing listens there");
        assert!(!links.reached("beta", &dead, past), "reached at the endpoint advertised, not another");
        // The peer goes: its end of our connection closes; the link is down, and a new socket
        // keeps trying.
        drop(b);
        assert!(poll_until(&mut a, 5000, || !links.reached("beta", &ep, past)), "the ended connection still counts");
        assert!(a.push.get("beta").is_some_and(|l| !l.up), "its socket kept (libzmq reconnects it), down");
        // Lost or unloaded (no endpoint resolves for it any more): nothing is kept.
        a.forget("beta");
        a.forget("gamma");
        assert!(a.push.is_empty() && links.len() == 0);
    }

    /// Something at the endpoint that accepts and closes at once (a peer at its connection
    /// cap, a proxy with nowhere to go) never counts as reached (review 62: each connect made
    /// the peer reached for a moment, long enough for a prep to choose the one-way route).
    #[test]
    fn an_endpoint_that_accepts_and_closes_at_once_is_never_reached() {
        let links = Arc::new(Links::default());
        let mut a =
            ZmqChannel::bind("alpha", "127.0.0.1", Box::new(|_| None), Arc::clone(&links), Arc::default()).unwrap();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let ep = format!("tcp://{}", listener.local_addr().unwrap()).into_bytes();
        listener.set_nonblocking(true).unwrap();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stop2 = Arc::clone(&stop);
        let closer = std::thread::spawn(move || {
            let mut accepted = 0;
            while !stop2.load(std::sync::atomic::Ordering::Relaxed) {
                match listener.accept() {
                    Ok((c, _)) => {
                        accepted += 1;
                        drop(c);
                    }
                    Err(_) => std::thread::sleep(std::time::Duration::from_millis(1)),
                }
            }
            accepted
        });
        a.send_to("beta", &ep, b"\0BOUNC hello").unwrap();
        let past = std::time::Instant::now() + super::super::links::FIRST_CONNECT_WAIT;
        assert!(!poll_until(&mut a, 700, || links.reached("beta", &ep, past)), "a connection closed at once counted");
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        assert!(closer.join().unwrap() >= 1, "nothing ever connected: the check proved nothing");
    }

    #[test]
    fn a_bad_peer_endpoint_is_an_error_not_a_crash() {
        let (mut a, _) = bind("alpha");
        for bad in [&b""[..], b"tcp://", b"ipc:///tmp/x", b"\xff\xfe", b"tcp://no-such-host-\0:1", &[b'a'; 300][..]] {
            assert!(a.send_to("p", bad, b"x").is_err(), "{bad:?}");
        }
        assert!(valid_endpoint(b"tcp://10.0.0.1:5555").is_ok());
        assert!(valid_endpoint(b"tcp://[::1]:5555").is_ok());
        // A host name (resolved, blocking, by libzmq), a missing port, an interface name.
        for bad in [&b"tcp://localhost:5555"[..], b"tcp://10.0.0.1", b"tcp://eth0:5555", b"tcp://10.0.0.1:*"] {
            assert!(valid_endpoint(bad).is_err(), "{bad:?}");
        }
        // A peer without a known endpoint is an error too, through the channel interface.
        assert!(matches!(a.send("p", b"x"), Err(ControlError::NoEndpoint)));
    }
}
