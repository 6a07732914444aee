//! The one peer table: every agent this engine knows, by name and by the core's [`PeerId`],
//! with what the engine learned from its connection info (capabilities, its arena loaded into
//! the inner engine), whether it said HELLO, and its session. Application threads write the
//! first part (NIXL loads and disconnects), the reactor the rest; both read it under one lock.
//!
//! The rules (who may talk to us, which session counts, who may be bounced to) are the shell's
//! today and are gathered here so they can move into the core as one piece.

use std::collections::HashMap;

use bounce_proto::wire::Capabilities;
use bounce_proto::{MemKind, PeerId};
use parking_lot::Mutex;

use crate::sys::shim::Md;

/// Most agents remembered only because they said HELLO before we loaded them (the two loads
/// race): a flood of invented names cannot grow the table without limit.
pub(crate) const MAX_UNLOADED_HELLOS: usize = 1024;

/// A peer's arena, loaded into the inner engine: where bounce writes go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PeerArena {
    /// Arena base address at the peer.
    pub(crate) base: u64,
    /// Arena length at the peer.
    pub(crate) len: u64,
    /// Device id.
    pub(crate) dev: u64,
    /// Memory kind.
    pub(crate) mem: MemKind,
    /// Inner-engine metadata from loadRemoteMD.
    pub(crate) md: Md,
}

/// What the shim must load for a peer that can bounce: its arena, as its capabilities
/// describe it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ArenaToLoad {
    /// Base address.
    pub(crate) base: u64,
    /// Length.
    pub(crate) len: u64,
    /// Device id.
    pub(crate) dev: u64,
    /// Memory kind.
    pub(crate) mem: MemKind,
    /// Remote key (the inner engine's public data for the arena registration).
    pub(crate) key: Vec<u8>,
}

/// What a control frame's session says about its sender.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SessionCheck {
    /// The session we know (or the first we hear of).
    Current,
    /// A WANT under a new session: the peer restarted under the same name, and everything of
    /// its old incarnation is void (the new session is now current).
    Restarted,
    /// Any other frame under a session that is not current: dropped.
    Stale,
}

/// One agent.
#[derive(Debug)]
struct Peer {
    name: String,
    /// NIXL loaded its connection info into this engine (the only agents we talk to).
    loaded: bool,
    /// Its capabilities, when compatible with ours.
    caps: Option<Capabilities>,
    /// Its arena, once loaded into the inner engine.
    arena: Option<PeerArena>,
    /// It said HELLO: it loaded OUR connection info, so it can answer a WANT.
    hello: bool,
    /// The session its control frames carry.
    session: Option<u64>,
}

#[derive(Debug, Default)]
struct Table {
    ids: HashMap<String, PeerId>,
    peers: Vec<Peer>,
    /// Agents in the table that said HELLO without being loaded.
    unloaded_hellos: usize,
}

impl Table {
    /// The agent's id, adding it (ids are never reused).
    fn id(&mut self, name: &str) -> PeerId {
        if let Some(id) = self.ids.get(name) {
            return *id;
        }
        let id = PeerId(u32::try_from(self.peers.len()).unwrap_or(u32::MAX));
        self.ids.insert(name.to_owned(), id);
        self.peers.push(Peer {
            name: name.to_owned(),
            loaded: false,
            caps: None,
            arena: None,
            hello: false,
            session: None,
        });
        id
    }

    fn get(&self, name: &str) -> Option<&Peer> {
        self.ids.get(name).and_then(|id| self.peers.get(id.0 as usize))
    }

    fn get_mut(&mut self, name: &str) -> Option<&mut Peer> {
        let id = *self.ids.get(name)?;
        self.peers.get_mut(id.0 as usize)
    }

    fn by_id(&self, id: PeerId) -> Option<&Peer> {
        self.peers.get(id.0 as usize)
    }

    fn recount(&mut self) {
        self.unloaded_hellos = self.peers.iter().filter(|p| p.hello && !p.loaded).count();
    }
}

/// The peer table, shared by the engine's application threads and its reactor.
#[derive(Debug, Default)]
pub(crate) struct PeerTable(Mutex<Table>);

impl PeerTable {
    // ---- from NIXL (application threads) ----

    /// NIXL loaded the agent's connection info; `caps` are its capabilities when compatible.
    pub(crate) fn loaded(&self, name: &str, caps: Option<Capabilities>) {
        let mut t = self.0.lock();
        let id = t.id(name);
        let p = &mut t.peers[id.0 as usize];
        p.loaded = true;
        p.caps = caps;
        t.recount();
    }

    /// The arena to load for a peer that can bounce with us (`None`: nothing to load).
    pub(crate) fn arena_to_load(&self, name: &str) -> Option<ArenaToLoad> {
        let t = self.0.lock();
        let c = t.get(name)?.caps.as_ref()?;
        Some(ArenaToLoad {
            base: c.arena_base,
            len: c.arena_len,
            dev: c.arena_dev,
            mem: c.mem,
            key: c.arena_key.clone(),
        })
    }

    /// The inner engine loaded the peer's arena as `md` (`None`: loading failed, plain UCX to
    /// it). Returns whether the peer now has an arena.
    pub(crate) fn arena_loaded(&self, name: &str, md: Option<Md>) -> bool {
        let mut t = self.0.lock();
        let Some(p) = t.get_mut(name) else { return false };
        p.arena = match (md, &p.caps) {
            (Some(md), Some(c)) => {
                Some(PeerArena { base: c.arena_base, len: c.arena_len, dev: c.arena_dev, mem: c.mem, md })
            }
            _ => None,
        };
        p.arena.is_some()
    }

    /// The agent disconnected: forget everything NIXL and the agent told us. Its id stays
    /// (ids are never reused).
    pub(crate) fn lost(&self, name: &str) {
        let mut t = self.0.lock();
        if let Some(p) = t.get_mut(name) {
            *p = Peer {
                name: std::mem::take(&mut p.name),
                loaded: false,
                caps: None,
                arena: None,
                hello: false,
                session: None,
            };
        }
        t.recount();
    }

    /// Where the agent's arena lives, when a transfer to it may bounce: its arena is loaded and
    /// it said HELLO.
    pub(crate) fn bounce_arena(&self, name: &str) -> Option<bounce_proto::gate::ArenaPlace> {
        let t = self.0.lock();
        let p = t.get(name).filter(|p| p.arena.is_some() && p.hello)?;
        let c = p.caps.as_ref()?;
        Some(bounce_proto::gate::ArenaPlace { mem: c.mem, dev: c.arena_dev })
    }

    /// Peers a transfer may bounce to now.
    pub(crate) fn ready(&self) -> usize {
        self.0.lock().peers.iter().filter(|p| p.arena.is_some() && p.hello).count()
    }

    // ---- from the reactor ----

    /// The id of a peer the application submits a transfer to (adding it if needed).
    pub(crate) fn id(&self, name: &str) -> PeerId {
        self.0.lock().id(name)
    }

    /// The id of an agent already in the table (`None`: never heard of).
    pub(crate) fn known_id(&self, name: &str) -> Option<PeerId> {
        self.0.lock().ids.get(name).copied()
    }

    /// The name of a peer id.
    pub(crate) fn name(&self, id: PeerId) -> Option<String> {
        self.0.lock().by_id(id).map(|p| p.name.clone())
    }

    /// True when the agent's capabilities are compatible with ours (a HELLO is only of use to
    /// such a peer, and only such a peer has a ZMQ endpoint we could reach).
    pub(crate) fn compatible(&self, name: &str) -> bool {
        self.0.lock().get(name).is_some_and(|p| p.caps.is_some())
    }

    /// The control endpoint the agent advertised (ZMQ).
    pub(crate) fn endpoint(&self, name: &str) -> Option<Vec<u8>> {
        self.0.lock().get(name).and_then(|p| p.caps.as_ref()).map(|c| c.endpoint.clone())
    }

    /// Records a HELLO. Recorded even before we load the agent (the two loads race), but at
    /// most [`MAX_UNLOADED_HELLOS`] such agents. `false`: refused.
    pub(crate) fn hello(&self, name: &str) -> bool {
        let mut t = self.0.lock();
        let known = t.get(name).is_some_and(|p| p.hello || p.loaded);
        if !known && t.unloaded_hellos >= MAX_UNLOADED_HELLOS {
            return false;
        }
        let id = t.id(name);
        t.peers[id.0 as usize].hello = true;
        t.recount();
        true
    }

    /// The id of an agent NIXL loaded (`None`: never loaded, or lost since: we do not talk to
    /// it; UCX needs its connection info to answer at all, and the reverse-path endpoint of a
    /// WANT is NOT loaded on trust).
    pub(crate) fn loaded_id(&self, name: &str) -> Option<PeerId> {
        let t = self.0.lock();
        let id = *t.ids.get(name)?;
        t.by_id(id).is_some_and(|p| p.loaded).then_some(id)
    }

    /// Checks a frame's session against the peer's: the first one seen becomes current; a WANT
    /// under another session means the peer restarted.
    pub(crate) fn check_session(&self, id: PeerId, session: u64, is_want: bool) -> SessionCheck {
        let mut t = self.0.lock();
        let Some(p) = t.peers.get_mut(id.0 as usize) else { return SessionCheck::Stale };
        match p.session {
            Some(s) if s != session => {
                if is_want {
                    p.session = Some(session);
                    SessionCheck::Restarted
                } else {
                    SessionCheck::Stale
                }
            }
            Some(_) => SessionCheck::Current,
            None => {
                p.session = Some(session);
                SessionCheck::Current
            }
        }
    }

    /// True when NIXL no longer has the peer loaded (it disconnected, or was never loaded).
    pub(crate) fn gone(&self, id: PeerId) -> bool {
        self.0.lock().by_id(id).is_none_or(|p| !p.loaded)
    }

    /// Where writes to a peer go: its name and arena.
    pub(crate) fn write_target(&self, id: PeerId) -> Option<(String, PeerArena)> {
        let t = self.0.lock();
        let p = t.by_id(id)?;
        p.arena.map(|a| (p.name.clone(), a))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bounce_proto::ControlKind;

    fn caps() -> Capabilities {
        Capabilities {
            wire_version: u16::from(bounce_proto::wire::WIRE_VERSION),
            control: ControlKind::Ucx,
            mem: MemKind::Dram,
            arena_base: 0x1000,
            arena_len: 1 << 20,
            arena_dev: 0,
            usable_capacity: 1 << 20,
            max_chunk: 1 << 16,
            session: 9,
            arena_key: b"key".to_vec(),
            endpoint: b"tcp://10.0.0.1:1".to_vec(),
        }
    }

    #[test]
    fn a_peer_can_bounce_once_loaded_with_its_arena_and_after_its_hello() {
        let t = PeerTable::default();
        assert!(t.loaded_id("b").is_none());
        t.loaded("b", Some(caps()));
        assert!(t.compatible("b"));
        assert_eq!(t.endpoint("b").as_deref(), Some(&b"tcp://10.0.0.1:1"[..]));
        assert_eq!(t.arena_to_load("b").map(|a| a.key), Some(b"key".to_vec()));
        assert!(t.arena_loaded("b", Some(Md(5))));
        assert!(t.bounce_arena("b").is_none(), "no HELLO yet");
        assert!(t.hello("b"));
        assert!(t.bounce_arena("b").is_some());
        assert_eq!(t.ready(), 1);
        let id = t.loaded_id("b").unwrap();
        assert_eq!(t.write_target(id).map(|(n, a)| (n, a.md)), Some(("b".to_owned(), Md(5))));
        t.lost("b");
        assert!(t.bounce_arena("b").is_none() && t.loaded_id("b").is_none() && t.write_target(id).is_none());
        assert!(t.gone(id) && t.gone(PeerId(99)));
        assert_eq!(t.id("b"), id, "ids are never reused");
        // An incompatible peer is loaded (it may talk to us) but has nothing to load.
        t.loaded("c", None);
        assert!(t.loaded_id("c").is_some() && t.arena_to_load("c").is_none());
        assert!(!t.arena_loaded("c", Some(Md(6))));
    }

    #[test]
    fn sessions_restart_only_on_a_want_and_stale_frames_are_refused() {
        let t = PeerTable::default();
        t.loaded("b", None);
        let id = t.loaded_id("b").unwrap();
        assert_eq!(t.check_session(id, 1, false), SessionCheck::Current);
        assert_eq!(t.check_session(id, 1, false), SessionCheck::Current);
        assert_eq!(t.check_session(id, 2, false), SessionCheck::Stale);
        assert_eq!(t.check_session(id, 2, true), SessionCheck::Restarted);
        assert_eq!(t.check_session(id, 1, false), SessionCheck::Stale);
        assert_eq!(t.check_session(PeerId(99), 1, true), SessionCheck::Stale);
    }

    #[test]
    fn hellos_from_unloaded_agents_are_bounded() {
        let t = PeerTable::default();
        for i in 0..MAX_UNLOADED_HELLOS {
            assert!(t.hello(&format!("x{i}")));
        }
        assert!(!t.hello("one-too-many"));
        assert!(t.hello("x0"), "a repeat is fine");
        t.loaded("late", None);
        assert!(t.hello("late"), "a loaded agent is always heard");
    }
}
