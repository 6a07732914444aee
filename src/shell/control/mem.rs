//! An in-memory control network for tests: channels joined by name, with a fault hook that
//! may drop or hold back (reorder) any frame.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use parking_lot::Mutex;

use super::{ControlChannel, ControlError, Inbound};

/// What the fault hook decides for one frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fate {
    /// Deliver it now.
    Deliver,
    /// Lose it.
    Drop,
    /// Hold it back and deliver it right after the next delivered frame (a reorder).
    Hold,
}

/// Decides the fate of a frame from `from` to `to`.
type Fault = Box<dyn FnMut(&str, &str, &[u8]) -> Fate + Send>;

#[derive(Default)]
struct Net {
    /// Frames waiting at each member, `(sender, frame)`.
    queues: HashMap<String, VecDeque<(String, Vec<u8>)>>,
    /// Held-back frames `(to, from, frame)`.
    held: Vec<(String, String, Vec<u8>)>,
    fault: Option<Fault>,
    /// Peers forgotten, `(member, peer)`, in order.
    forgotten: Vec<(String, String)>,
}

/// The network; clone it to join more members.
#[derive(Clone, Default)]
pub(crate) struct MemNet(Arc<Mutex<Net>>);

impl MemNet {
    /// A channel for member `name`.
    pub(crate) fn join(&self, name: &str) -> MemChannel {
        self.0.lock().queues.entry(name.to_owned()).or_default();
        MemChannel { name: name.to_owned(), net: self.clone(), socket: false }
    }

    /// A channel for member `name` that behaves as one with a socket of its own (ZMQ): only
    /// its polls see its frames, and it says when one waits.
    pub(crate) fn join_socket(&self, name: &str) -> MemChannel {
        MemChannel { socket: true, ..self.join(name) }
    }

    /// How many frames wait at member `name`.
    pub(crate) fn waiting(&self, name: &str) -> usize {
        self.0.lock().queues.get(name).map_or(0, VecDeque::len)
    }

    /// How many times member `name` forgot `peer` (dropped what its channel keeps for it).
    pub(crate) fn forgets(&self, name: &str, peer: &str) -> usize {
        self.0.lock().forgotten.iter().filter(|(m, p)| m == name && p == peer).count()
    }

    /// Installs the fault hook (replacing any previous one).
    pub(crate) fn set_fault(&self, f: impl FnMut(&str, &str, &[u8]) -> Fate + Send + 'static) {
        self.0.lock().fault = Some(Box::new(f));
    }
}

/// One member's end of a [`MemNet`].
pub(crate) struct MemChannel {
    name: String,
    net: MemNet,
    socket: bool,
}

impl ControlChannel for MemChannel {
    fn send(&mut self, peer: &str, frame: &[u8]) -> Result<(), ControlError> {
        let mut net = self.net.0.lock();
        if !net.queues.contains_key(peer) {
            return Err(ControlError::Unreachable(peer.to_owned()));
        }
        let fate = net.fault.as_mut().map_or(Fate::Deliver, |f| f(&self.name, peer, frame));
        match fate {
            Fate::Drop => {}
            Fate::Hold => net.held.push((peer.to_owned(), self.name.clone(), frame.to_vec())),
            Fate::Deliver => {
                let held = std::mem::take(&mut net.held);
                for (to, from, f) in std::iter::once((peer.to_owned(), self.name.clone(), frame.to_vec())).chain(held) {
                    if let Some(q) = net.queues.get_mut(&to) {
                        q.push_back((from, f));
                    }
                }
            }
        }
        Ok(())
    }

    fn poll(&mut self, budget: usize, out: &mut Vec<Inbound>) -> usize {
        let mut net = self.net.0.lock();
        let Some(q) = net.queues.get_mut(&self.name) else { return 0 };
        let n = budget.min(q.len());
        out.extend(q.drain(..n).map(Inbound::unconnected));
        n
    }

    fn forget(&mut self, peer: &str) {
        self.net.0.lock().forgotten.push((self.name.clone(), peer.to_owned()));
    }

    fn own_socket(&self) -> bool {
        self.socket
    }

    fn readable(&mut self) -> bool {
        self.socket && self.net.0.lock().queues.get(&self.name).is_some_and(|q| !q.is_empty())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_arrive_in_order_and_faults_drop_or_reorder() {
        let net = MemNet::default();
        let (mut a, mut b) = (net.join("a"), net.join("b"));
        a.send("b", b"1").unwrap();
        a.send("b", b"2").unwrap();
        assert!(matches!(a.send("c", b"x"), Err(ControlError::Unreachable(_))));
        let mut got = Vec::new();
        assert_eq!(b.poll(1, &mut got), 1);
        assert_eq!(b.poll(8, &mut got), 1);
        assert_eq!(got, [("a".to_owned(), b"1".to_vec()), ("a".to_owned(), b"2".to_vec())]);
        net.set_fault(|_, _, f| match f {
            b"lost" => Fate::Drop,
            b"late" => Fate::Hold,
            _ => Fate::Deliver,
        });
        for f in [&b"late"[..], b"lost", b"3"] {
            a.send("b", f).unwrap();
        }
        got.clear();
        b.poll(8, &mut got);
        assert_eq!(got, [("a".to_owned(), b"3".to_vec()), ("a".to_owned(), b"late".to_vec())]);
    }
}
