//! Which peers' ZMQ endpoints we have a TCP connection to, for the gate's one-way route.
//!
//! Why: a one-way transfer's WANT goes over ZMQ to the endpoint in the target's capabilities,
//! and its answers come back through the target's mailbox, never over a connection of ours. A
//! target whose endpoint we cannot reach (left at loopback between hosts, a firewall) never
//! sees the WANT: the transfer waited in a socket that never connected and failed by its
//! timeout (review 61, control M2), where a peer that cannot bounce must stay on plain UCX.
//! So the gate routes one way over ZMQ only to a peer whose socket has connected (ZMQ's connect
//! notice), and leaves the others on UCX.
//!
//! The socket is made when the peer is loaded (our HELLO to it), so a transfer prepared at once
//! after the load would find it still connecting: a prep waits for the connection for at most
//! [`FIRST_CONNECT_WAIT`] after the load, once (a reconnection is not waited for: a peer whose
//! connections keep ending must not slow every prep).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

/// How long after a peer's load a prep waits for its first connection (loopback connects in
/// well under a millisecond, a LAN in a few; a connection counts once open for 10 ms, and the
/// reactor looks at a connecting socket every millisecond).
pub(crate) const FIRST_CONNECT_WAIT: Duration = Duration::from_millis(100);

/// One peer's socket.
#[derive(Debug)]
struct Link {
    /// The endpoint it connects to (a peer reloaded under a new one is another link).
    endpoint: Vec<u8>,
    up: bool,
    /// Until when a prep waits for it to come up (the first connection after a load).
    wait_until: Option<Instant>,
}

/// The links of one engine, written by its ZMQ channel (the reactor) and by loads, read by preps.
#[derive(Debug, Default)]
pub(crate) struct Links {
    links: Mutex<HashMap<String, Link>>,
    changed: Condvar,
}

impl Links {
    /// `peer` was loaded with `endpoint`: its socket is about to be made (our HELLO); a prep
    /// until `now` + [`FIRST_CONNECT_WAIT`] waits for it. A link to that endpoint already up
    /// (a reload of the same incarnation) stays up.
    pub(crate) fn expect(&self, peer: &str, endpoint: &[u8], now: Instant) {
        let mut links = self.links.lock();
        let wait_until = Some(now + FIRST_CONNECT_WAIT);
        match links.get_mut(peer) {
            Some(l) if l.endpoint == endpoint => {
                if !l.up {
                    l.wait_until = wait_until;
                }
            }
            _ => {
                links.insert(peer.to_owned(), Link { endpoint: endpoint.to_vec(), up: false, wait_until });
            }
        }
    }

    /// A socket to `peer` at `endpoint` was made (or remade after its connection ended): not
    /// up until its connect notice. A load's wait for the same endpoint is kept.
    pub(crate) fn connecting(&self, peer: &str, endpoint: &[u8]) {
        let mut links = self.links.lock();
        match links.get_mut(peer) {
            Some(l) if l.endpoint == endpoint => l.up = false,
            _ => {
                links.insert(peer.to_owned(), Link { endpoint: endpoint.to_vec(), up: false, wait_until: None });
            }
        }
    }

    /// The socket to `peer` at `endpoint` connected.
    pub(crate) fn up(&self, peer: &str, endpoint: &[u8]) {
        let mut links = self.links.lock();
        if let Some(l) = links.get_mut(peer).filter(|l| l.endpoint == endpoint) {
            l.up = true;
            l.wait_until = None;
            self.changed.notify_all();
        }
    }

    /// The socket to `peer` is gone (the peer was lost or unloaded): nothing to wait for.
    pub(crate) fn gone(&self, peer: &str) {
        if self.links.lock().remove(peer).is_some() {
            self.changed.notify_all();
        }
    }

    /// Whether a one-way transfer to `peer`, whose capabilities advertise `endpoint`, can reach
    /// it: its socket to that endpoint is up, or comes up within the wait its load allows
    /// (counted from `now`, the clock passed in so that a test can run it without sleeping to
    /// a deadline). Blocks at most until that wait's end.
    pub(crate) fn reached(&self, peer: &str, endpoint: &[u8], now: Instant) -> bool {
        let mut links = self.links.lock();
        loop {
            let Some(l) = links.get(peer).filter(|l| l.endpoint == endpoint) else { return false };
            if l.up {
                return true;
            }
            match l.wait_until {
                Some(until) if until > now => {
                    // Woken by any link's change; a wake past the deadline sees it passed.
                    if self.changed.wait_until(&mut links, until).timed_out() {
                        let l = links.get_mut(peer).filter(|l| l.endpoint == endpoint);
                        let up = l.as_ref().is_some_and(|l| l.up);
                        if let Some(l) = l {
                            // Waited once: later preps go to UCX at once until it connects.
                            l.wait_until = None;
                        }
                        return up;
                    }
                }
                _ => return false,
            }
        }
    }

    /// Links held (a gauge for tests: bounded by the peers we send to).
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.links.lock().len()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    const EP: &[u8] = b"tcp://10.0.0.2:5555";

    /// Links where b was loaded at `t` with [`EP`], its socket made (not connected yet).
    fn loaded_at(t: Instant) -> Links {
        let r = Links::default();
        r.expect("b", EP, t);
        r.connecting("b", EP);
        r
    }

    /// Marks b's link at [`EP`] up after `ms`, from another thread (the reactor's role).
    fn up_after(r: &Arc<Links>, ms: u64) -> std::thread::JoinHandle<()> {
        let r = Arc::clone(r);
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(ms));
            r.up("b", EP);
        })
    }

    #[test]
    fn a_peer_is_reached_only_once_its_socket_to_the_advertised_endpoint_is_up() {
        let r = Links::default();
        let t = Instant::now();
        assert!(!r.reached("b", EP, t), "never loaded, no socket");
        r.connecting("b", EP);
        assert!(!r.reached("b", EP, t), "connecting, and no load to wait for");
        r.up("b", EP);
        assert!(r.reached("b", EP, t));
        assert!(!r.reached("b", b"tcp://10.0.0.2:6666", t), "a reload advertises another endpoint");
        r.up("b", b"tcp://10.0.0.2:6666");
        assert!(!r.reached("b", b"tcp://10.0.0.2:6666", t), "a notice for another endpoint's socket counts nothing");
        r.connecting("b", EP);
        assert!(!r.reached("b", EP, t), "its connection ended: down until the new one is up");
        r.gone("b");
        assert_eq!(r.len(), 0);
        assert!(!r.reached("b", EP, t));
    }

    #[test]
    fn a_prep_right_after_the_load_waits_for_the_first_connection() {
        let r = Arc::new(loaded_at(Instant::now()));
        let up = up_after(&r, 20);
        let asked = Instant::now();
        assert!(r.reached("b", EP, asked), "the connection came within the wait");
        assert!(asked.elapsed() < FIRST_CONNECT_WAIT, "it returned when the link came up");
        up.join().unwrap();
    }

    #[test]
    fn an_unreachable_peer_costs_one_bounded_wait_then_none() {
        let t = Instant::now();
        let r = loaded_at(t);
        let asked = Instant::now();
        assert!(!r.reached("b", EP, asked));
        let waited = asked.elapsed();
        assert!(
            waited >= FIRST_CONNECT_WAIT - Duration::from_millis(5),
            "it waited out the load's allowance: {waited:?}"
        );
        assert!(waited < FIRST_CONNECT_WAIT * 10, "{waited:?}");
        let again = Instant::now();
        assert!(!r.reached("b", EP, again));
        assert!(again.elapsed() < FIRST_CONNECT_WAIT * 9 / 10, "no second wait: {:?}", again.elapsed());
        // A prep past the allowance does not wait either.
        r.expect("c", EP, t);
        assert!(!r.reached("c", EP, t + FIRST_CONNECT_WAIT));
    }

    #[test]
    fn a_reconnection_is_not_waited_for_but_a_reload_is() {
        let t = Instant::now();
        let r = loaded_at(t);
        r.up("b", EP);
        r.connecting("b", EP); // its connection ended; a new socket
        assert!(!r.reached("b", EP, t), "no wait for a reconnection");
        r.expect("b", EP, t + Duration::from_secs(1)); // loaded again
        let r = Arc::new(r);
        let up = up_after(&r, 10);
        assert!(r.reached("b", EP, t + Duration::from_secs(1)));
        up.join().unwrap();
    }
}
