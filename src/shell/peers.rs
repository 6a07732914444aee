//! The one peer table: every agent this engine knows, by name and by the core's [`PeerId`].
//! The rules (who may talk to us, which session counts, how many HELLOs from agents not loaded
//! are remembered, who may be bounced to, whether a credit lies inside the peer's arena) are
//! the core's [`bounce_proto::peers::PeerTable`], where the simulation and the fuzzers reach
//! them; this wrapper adds only what the core cannot hold (the inner engine's metadata of each
//! peer's arena) and the lock: application threads write NIXL's loads and disconnects, the
//! reactor the rest.

use std::collections::HashMap;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::{AtomicU64, AtomicUsize};

use bounce_proto::gate::ArenaPlace;
use bounce_proto::mailbox::MailboxLayout;
use bounce_proto::oneway;
use bounce_proto::peers::{self, CreditRefused, Forgot, FrameRefused, Loaded};
use bounce_proto::wire::Capabilities;
use bounce_proto::{ArenaId, MemKind, PeerId, Region, Token};
use parking_lot::{Mutex, MutexGuard};

use crate::sys::shim::Md;

/// Why a write to a peer's region may not go ([`PeerTable::write_target`]).
#[derive(Debug)]
pub(crate) enum WriteRefused {
    /// NIXL no longer has the peer loaded (it disconnected, or was never loaded).
    Gone,
    /// Loaded, but its arena is not (or no longer) loaded here.
    NoArena,
    /// The region lies outside the peer's arena: a broken or hostile grant (the peer's name).
    Credit(String, CreditRefused),
}

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
    /// Its mailbox's registration, when it keeps one and loading it succeeded.
    pub(crate) mailbox: Option<PeerMailbox>,
}

impl PeerArena {
    /// Every inner metadata handle it holds: unloaded together once no write or READ uses
    /// any of them (one retiring arena).
    fn mds(&self) -> Vec<Md> {
        std::iter::once(self.md).chain(self.mailbox.map(|m| m.md)).collect()
    }
}

/// A peer's mailbox registration (host memory of its own), loaded into the inner engine: where
/// one-way fetches READ its answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PeerMailbox {
    /// Base address at the peer.
    pub(crate) base: u64,
    /// Length at the peer.
    pub(crate) len: u64,
    /// The mailbox's offset in it.
    pub(crate) offset: u64,
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
    /// The peer's mailbox registration (host memory), when it keeps one: base, length, key.
    pub(crate) mailbox: Option<(u64, u64, Vec<u8>)>,
}

#[derive(Debug, Default)]
struct Table {
    /// The core's rules and state.
    rules: peers::PeerTable,
    /// Each peer arena loaded into the inner engine, by peer and the arena's id in the peer's
    /// capabilities (its mailbox rides with arena 0, the one every engine has).
    arenas: HashMap<(PeerId, ArenaId), PeerArena>,
}

/// The peer table, shared by the engine's application threads and its reactor.
#[derive(Debug, Default)]
pub(crate) struct PeerTable {
    table: Mutex<Table>,
    /// Peers a transfer may bounce to, and peer arenas loaded: stored under the lock by every
    /// change that can move them ([`Changing`]), so a polling application's stats refresh reads
    /// both without taking it (issue 12). Both are counts the tables keep as they change, so
    /// storing them costs no pass over a table, whatever a flood of frames changes.
    ready: AtomicUsize,
    arenas: AtomicUsize,
    /// Disconnects so far, of any peer: a HELLO that fails to send is an error only if no peer
    /// was lost since it was queued (an application that unloads and reloads a peer at once
    /// races the inner engine, which knows the peer only once the reload is done; the reload
    /// queues its own HELLO).
    losses: AtomicU64,
}

/// The table locked by a change that may move the gauges; they are stored when it is dropped,
/// still under the lock, so the last change's values are the ones left.
struct Changing<'a> {
    table: MutexGuard<'a, Table>,
    owner: &'a PeerTable,
}

impl Deref for Changing<'_> {
    type Target = Table;
    fn deref(&self) -> &Table {
        &self.table
    }
}

impl DerefMut for Changing<'_> {
    fn deref_mut(&mut self) -> &mut Table {
        &mut self.table
    }
}

impl Drop for Changing<'_> {
    fn drop(&mut self) {
        self.owner.store_gauges(&self.table);
    }
}

impl PeerTable {
    /// The table, for a change that may move who can bounce or which arenas are loaded.
    fn change(&self) -> Changing<'_> {
        Changing { table: self.table.lock(), owner: self }
    }

    /// Stores the gauges from `t` (the locked table: the last change's values stay). Constant
    /// time: both are counts kept by the tables.
    fn store_gauges(&self, t: &Table) {
        self.ready.store(t.rules.bounce_peers(), Relaxed);
        self.arenas.store(t.arenas.len(), Relaxed);
    }

    // ---- from NIXL (application threads) ----

    /// NIXL loaded the agent's connection info, which published `theirs`; `ours` are our
    /// capabilities. Says whether the two can bounce together, and, when the load replaced an
    /// older incarnation of the agent (another session), that one's id and its arenas' inner
    /// metadata: everything of it must then be reclaimed, as for a lost peer, before the new
    /// one is told HELLO, and its arenas unloaded once no write uses them.
    pub(crate) fn loaded(
        &self,
        name: &str,
        theirs: Option<Capabilities>,
        ours: Option<&Capabilities>,
    ) -> (Loaded, Option<(PeerId, Vec<Md>)>) {
        let mut t = self.change();
        // The old incarnation's id goes with it (the new one gets another): its arenas are
        // taken here, to unload once no write uses them, or nothing would find them again.
        let replaced = t.rules.load_replaces(name, theirs.as_ref()).map(|old| (old, take_peer(&mut t.arenas, old)));
        (t.rules.load_conn_info(name, theirs, ours), replaced)
    }

    /// Arena `arena` of a peer that can bounce with us, to load (`None`: nothing to load, or
    /// past its last arena); arena 0 with its mailbox's registration.
    pub(crate) fn arena_to_load(&self, name: &str, arena: ArenaId) -> Option<ArenaToLoad> {
        let t = self.table.lock();
        let c = t.rules.compatible(name)?;
        let a = c.arenas.get(arena)?;
        Some(ArenaToLoad {
            base: a.base,
            len: a.len,
            dev: a.dev,
            mem: a.mem,
            key: a.key.clone(),
            mailbox: c
                .mailbox
                .filter(|_| arena == ArenaId(0))
                .map(|_| (c.mailbox_base, c.mailbox_len, c.mailbox_key.clone())),
        })
    }

    /// The inner engine loaded the peer's arena `index` as `md` and (arena 0) its mailbox
    /// registration as `mailbox` (`None`: loading failed or there is none; without arena 0,
    /// plain UCX to it; without another, no bounce through that one; without the mailbox, no
    /// one-way bounce to it). Returns whether the peer now has that arena, and the inner
    /// metadata no longer kept, by arena: the handles the new ones replace, and the new ones
    /// not kept. Each group is unloaded once no write or READ uses any of it.
    pub(crate) fn arena_loaded(
        &self,
        name: &str,
        index: ArenaId,
        md: Option<Md>,
        mailbox: Option<Md>,
    ) -> (bool, Vec<Vec<Md>>) {
        let mut t = self.change();
        if index == ArenaId(0) {
            t.rules.arena_loaded(name, md.is_some());
        }
        let given: Vec<Md> = md.into_iter().chain(mailbox).collect();
        let Some(id) = t.rules.lookup(name) else {
            return (false, [given].into_iter().filter(|g| !g.is_empty()).collect());
        };
        let caps = t.rules.compatible(name);
        let arena = match (md, caps.and_then(|c| Some((c, c.arenas.get(index)?)))) {
            (Some(md), Some((c, a))) => Some(PeerArena {
                base: a.base,
                len: a.len,
                dev: a.dev,
                mem: a.mem,
                md,
                mailbox: match (mailbox, c.mailbox) {
                    (Some(md), Some(m)) if index == ArenaId(0) => {
                        Some(PeerMailbox { base: c.mailbox_base, len: c.mailbox_len, offset: m.offset, md })
                    }
                    _ => None,
                },
            }),
            _ => None,
        };
        let old = match arena {
            Some(a) => t.arenas.insert((id, index), a),
            None => t.arenas.remove(&(id, index)),
        };
        // The handles kept are never unloaded (were the same ones reported twice), nor one
        // handed back twice.
        let kept = arena.map(|a| a.mds()).unwrap_or_default();
        let old = old.map(|a| a.mds()).unwrap_or_default();
        let old: Vec<Md> = old.into_iter().filter(|m| !kept.contains(m)).collect();
        let given: Vec<Md> = given.into_iter().filter(|m| !kept.contains(m) && !old.contains(m)).collect();
        (arena.is_some(), [old, given].into_iter().filter(|g| !g.is_empty()).collect())
    }

    /// The agent disconnected: forget everything NIXL and the agent told us, its id too (the
    /// name, should it come back, gets a new one; ids are never reused). Returns the lost id
    /// (`None`: never heard of) and its arena's inner metadata (and its mailbox's) to unload
    /// once nothing uses them (empty: none was loaded).
    pub(crate) fn lost(&self, name: &str) -> (Option<PeerId>, Vec<Md>) {
        let mut t = self.change();
        self.losses.fetch_add(1, Relaxed);
        let Some(id) = t.rules.lost(name) else { return (None, Vec::new()) };
        (Some(id), take_peer(&mut t.arenas, id))
    }

    /// The inner engine refused the connection info just loaded for `name` (the core's
    /// `PeerTable::load_failed`). Returns the id to reclaim as lost (`None`: none, or it went
    /// back to being a one-way incarnation) and any arena handles to unload.
    pub(crate) fn load_failed(&self, name: &str) -> (Option<PeerId>, Vec<Md>) {
        let mut t = self.change();
        let id = t.rules.lookup(name);
        let lost = t.rules.load_failed(name);
        (lost, id.map(|id| take_peer(&mut t.arenas, id)).unwrap_or_default())
    }

    /// Disconnects of any peer so far.
    pub(crate) fn losses(&self) -> u64 {
        self.losses.load(Relaxed)
    }

    /// Peer arenas loaded (their inner metadata held) now.
    pub(crate) fn arenas_loaded(&self) -> usize {
        self.arenas.load(Relaxed)
    }

    /// Where the agent's arenas live (in the order of its capabilities: an index is an
    /// [`ArenaId`]), when a transfer to it may bounce: loaded, compatible, its first arena
    /// loaded, and its HELLO confirmed. An arena whose load failed is listed too; a write into it
    /// finds no loaded arena and fails (`write_target`).
    pub(crate) fn bounce_arenas(&self, name: &str) -> Option<Vec<ArenaPlace>> {
        let t = self.table.lock();
        if !t.rules.can_bounce(name) {
            return None;
        }
        t.rules.compatible(name).map(places)
    }

    /// The largest chunk of a transfer between our arena `ours` and `name`'s arena `theirs`
    /// (the core's [`ArenaCaps::chunk_with`](bounce_proto::wire::ArenaCaps::chunk_with): the
    /// smaller of the two max chunks), when it is loaded and compatible and has that arena.
    pub(crate) fn chunk_with(
        &self,
        name: &str,
        (mine, ours): (&Capabilities, ArenaId),
        theirs: ArenaId,
    ) -> Option<u64> {
        let t = self.table.lock();
        let peer = t.rules.compatible(name)?.arenas.get(theirs)?;
        Some(mine.arenas.get(ours)?.chunk_with(peer))
    }

    /// Where the agent's arena lives and its mailbox's shape, when a transfer to it may bounce
    /// one way only: loaded, compatible, its arena loaded, a mailbox in bounds whose ring fits
    /// our `fetch_slice` (a ring is read whole into one slice: a peer running a larger window
    /// than ours, or advertising a huge ring, stays on UCX), but no HELLO (it never loaded us,
    /// or not yet). A peer that said HELLO is bounced to two way.
    pub(crate) fn one_way_target(&self, name: &str, fetch_slice: u64) -> Option<(Vec<ArenaPlace>, MailboxLayout)> {
        let t = self.table.lock();
        if t.rules.can_bounce(name) || !t.rules.can_bounce_one_way(name) {
            return None;
        }
        // Its mailbox's registration must be loaded too: our fetches READ through it.
        t.arenas.get(&(t.rules.lookup(name)?, ArenaId(0)))?.mailbox?;
        let caps = t.rules.compatible(name)?;
        let layout = oneway::peer_layout(caps).filter(|l| l.ring_bytes() <= fetch_slice)?;
        Some((places(caps), layout))
    }

    /// Where one-way fetches from a peer go: its name and its mailbox's registration.
    pub(crate) fn mailbox_target(&self, id: PeerId) -> Option<(String, PeerMailbox)> {
        let t = self.table.lock();
        let mailbox = t.arenas.get(&(id, ArenaId(0)))?.mailbox?;
        Some((t.rules.name(id)?.to_owned(), mailbox))
    }

    /// The peer a message frame from `name` under `session` is admitted as, and a one-way name
    /// forgotten to make room for it (the core's `PeerTable::admit_message`: the loaded peer
    /// under its session, or one-way traffic from a name never loaded or from another
    /// incarnation of a loaded one).
    ///
    /// # Errors
    /// A [`FrameRefused`]: drop the frame.
    pub(crate) fn admit_message(
        &self,
        name: &str,
        session: u64,
        one_way: impl Fn(Option<PeerId>) -> bool,
        holds_nothing: impl Fn(PeerId) -> bool,
    ) -> Result<(PeerId, Option<PeerId>), FrameRefused> {
        self.change().rules.admit_message(name, session, one_way, holds_nothing)
    }

    /// Peers a transfer may bounce to now.
    pub(crate) fn ready(&self) -> usize {
        self.ready.load(Relaxed)
    }

    // ---- from the reactor ----

    /// The id of an agent already in the table (`None`: never heard of).
    pub(crate) fn known_id(&self, name: &str) -> Option<PeerId> {
        self.table.lock().rules.lookup(name)
    }

    /// The id of an agent NIXL has loaded now (`None`: not loaded).
    pub(crate) fn loaded_id(&self, name: &str) -> Option<PeerId> {
        let t = self.table.lock();
        t.rules.lookup(name).filter(|_| t.rules.is_loaded(name))
    }

    /// True when a PING to `id` reaches the peer behind it (the core's
    /// [`peers::PeerTable::answers_pings`]): what the liveness probe asks about a peer that
    /// also holds one-way state with us.
    pub(crate) fn answers_pings(&self, id: PeerId) -> bool {
        self.table.lock().rules.answers_pings(id)
    }

    /// The name of a peer id.
    pub(crate) fn name(&self, id: PeerId) -> Option<String> {
        self.table.lock().rules.name(id).map(str::to_owned)
    }

    /// True when the agent's capabilities are compatible with ours (a HELLO is only of use to
    /// such a peer, and only such a peer has a ZMQ endpoint we could reach).
    pub(crate) fn compatible(&self, name: &str) -> bool {
        self.table.lock().rules.compatible(name).is_some()
    }

    /// The no-progress timeout the agent advertised (its leases on our credits run by it).
    pub(crate) fn request_timeout(&self, name: &str) -> Option<std::time::Duration> {
        self.table.lock().rules.compatible(name).map(bounce_proto::wire::Capabilities::request_timeout)
    }

    /// The control endpoint the agent advertised (ZMQ).
    pub(crate) fn endpoint(&self, name: &str) -> Option<Vec<u8>> {
        self.table.lock().rules.compatible(name).map(|c| c.endpoint.clone())
    }

    /// What a HELLO from `name` under `session`, for the load tagged `load`, calls for (the
    /// core's rules: nothing is recorded until the peer answers the ask,
    /// [`confirm_hello`](Self::confirm_hello)).
    pub(crate) fn hello(&self, name: &str, session: u64, load: u64) -> peers::Hello {
        self.table.lock().rules.hello(name, session, load)
    }

    /// `name`, admitted as `id`, answered the ask its HELLO opened: it may be bounced to two
    /// way (the core's `PeerTable::confirm_hello`). False when it is not loaded and compatible,
    /// or `id` is not its incarnation any more (reloaded since the answer was admitted).
    /// `forget` is the forget secret the answer carried.
    pub(crate) fn confirm_hello(&self, name: &str, id: PeerId, forget: Token) -> bool {
        let mut t = self.change();
        t.rules.lookup(name) == Some(id) && t.rules.confirm_hello(name, forget)
    }

    /// A FORGET from `name` under `session` proving `proof` (the core's
    /// `PeerTable::forgot_us`): [`Forgot::Us`] when the peer unloaded us, its HELLO no longer
    /// counting.
    ///
    /// # Errors
    /// As [`admit`](Self::admit): drop the frame.
    pub(crate) fn forgot_us(&self, name: &str, session: u64, proof: Token) -> Result<Forgot, FrameRefused> {
        self.change().rules.forgot_us(name, session, proof)
    }

    /// Whether a frame from `name` under `session` comes from no id we hold for it yet (see
    /// the core's [`PeerTable::is_unvouched`](bounce_proto::peers::PeerTable::is_unvouched)).
    pub(crate) fn is_unvouched(&self, name: &str, session: u64) -> bool {
        self.table.lock().rules.is_unvouched(name, session)
    }

    /// Applies the core's loading and session rules to a message frame from `name`: the
    /// session must be the one of the agent's loaded capabilities.
    ///
    /// # Errors
    /// [`FrameRefused::NotLoaded`], [`FrameRefused::NoSession`] or
    /// [`FrameRefused::StaleSession`]: drop the frame.
    pub(crate) fn admit(&self, name: &str, session: u64) -> Result<PeerId, FrameRefused> {
        self.table.lock().rules.admit(name, session)
    }

    /// The memory kind of peer `id`'s arena `arena`, when it is loaded.
    pub(crate) fn arena_mem(&self, id: PeerId, arena: ArenaId) -> Option<MemKind> {
        self.table.lock().arenas.get(&(id, arena)).map(|a| a.mem)
    }

    /// Where a write (or READ) of `len` bytes into the peer's granted `region` goes: its name
    /// and arena, once the region is checked against that arena (the core's rule). One lock
    /// for both, so a loss on another thread reads as [`WriteRefused::Gone`], never as a bad
    /// credit (it once failed a transfer as `WriteFailed` instead of `PeerLost`).
    ///
    /// # Errors
    /// A [`WriteRefused`]: never write then.
    pub(crate) fn write_target(
        &self,
        id: PeerId,
        (arena, region): (ArenaId, Region),
        len: u64,
    ) -> Result<(String, PeerArena), WriteRefused> {
        let t = self.table.lock();
        let name = t.rules.name(id).filter(|n| t.rules.is_loaded(n)).ok_or(WriteRefused::Gone)?;
        let loaded = *t.arenas.get(&(id, arena)).ok_or(WriteRefused::NoArena)?;
        t.rules.check_credit(id, arena, region, len).map_err(|e| WriteRefused::Credit(name.to_owned(), e))?;
        Ok((name.to_owned(), loaded))
    }

    /// A GOODBYE from `name` with `session` (see the core's `PeerTable::goodbye`). Returns the
    /// peer's id and its arena's inner metadata (and its mailbox's) to unload once nothing uses
    /// them.
    pub(crate) fn goodbye(&self, name: &str, session: u64) -> Result<(PeerId, Vec<Md>), FrameRefused> {
        let mut t = self.change();
        let id = t.rules.goodbye(name, session)?;
        let unload = take_peer(&mut t.arenas, id);
        Ok((id, unload))
    }

    /// Every peer arena's inner metadata (and mailbox's), forgotten here (the engine is shutting
    /// down).
    pub(crate) fn take_arenas(&self) -> Vec<Md> {
        self.change().arenas.drain().flat_map(|(_, a)| a.mds()).collect()
    }
}

/// Where each arena of `caps` lives, in order.
fn places(caps: &Capabilities) -> Vec<ArenaPlace> {
    caps.arenas.iter().map(|(_, a)| ArenaPlace { mem: a.mem, dev: a.dev }).collect()
}

/// Removes every arena of peer `id`; their inner metadata handles, to unload.
fn take_peer(arenas: &mut HashMap<(PeerId, ArenaId), PeerArena>, id: PeerId) -> Vec<Md> {
    let mut mds = Vec::new();
    arenas.retain(|&(peer, _), a| {
        if peer == id {
            mds.extend(a.mds());
        }
        peer != id
    });
    mds
}

#[cfg(test)]
mod tests {
    use super::*;

    const A0: ArenaId = ArenaId(0);

    fn caps(session: u64) -> Capabilities {
        let mut c = Capabilities {
            endpoint: b"tcp://10.0.0.1:1".to_vec(),
            ..Capabilities::host_arena(1 << 20, 1 << 16, session)
        };
        let arena = c.arenas.first_mut();
        (arena.base, arena.key) = (0x1000, b"key".to_vec());
        c
    }

    /// A peer with two arenas: each is loaded on its own (the mailbox with arena 0 only),
    /// writes go to the arena their flow named and are checked against its length, and a loss
    /// hands back every handle of every arena.
    #[test]
    fn every_arena_of_a_peer_is_loaded_and_written_by_its_id() {
        let t = PeerTable::default();
        let mut theirs = caps(9);
        theirs.mailbox = Some(bounce_proto::wire::MailboxCaps { offset: 0, slots: 1, ring: 1 });
        (theirs.mailbox_base, theirs.mailbox_len, theirs.mailbox_key) = (0x9000, 64, b"m".to_vec());
        let second = bounce_proto::wire::ArenaCaps { base: 0x40_0000, len: 0x2000, ..theirs.arenas.first().clone() };
        theirs.arenas = bounce_proto::wire::Arenas::new(vec![theirs.arenas.first().clone(), second]).unwrap();
        assert_eq!(t.loaded("b", Some(theirs), Some(&caps(1))), (Loaded::Compatible, None));
        let (zero, one) = (t.arena_to_load("b", A0).unwrap(), t.arena_to_load("b", ArenaId(1)).unwrap());
        assert!(zero.mailbox.is_some() && one.mailbox.is_none(), "the mailbox rides with arena 0");
        assert_eq!((one.base, one.len), (0x40_0000, 0x2000));
        assert!(t.arena_to_load("b", ArenaId(2)).is_none(), "the shim stops here");
        assert_eq!(t.arena_loaded("b", A0, Some(Md(5)), Some(Md(6))), (true, vec![]));
        assert_eq!(t.arena_loaded("b", ArenaId(1), Some(Md(7)), None), (true, vec![]));
        assert_eq!(t.arenas_loaded(), 2);
        confirmed(&t, "b", 9);
        let id = t.admit("b", 9).unwrap();
        let at = |arena, offset| t.write_target(id, (ArenaId(arena), Region { offset, len: 4096 }), 4096);
        assert_eq!(at(1, 0x1000).map(|(_, a)| (a.md, a.base)).ok(), Some((Md(7), 0x40_0000)));
        assert!(matches!(at(1, 0x2000), Err(WriteRefused::Credit(..))), "past the second arena's end");
        assert_eq!(at(0, 0x2000).map(|(_, a)| a.md).ok(), Some(Md(5)), "the first arena is larger");
        assert!(matches!(at(2, 0), Err(WriteRefused::NoArena)));
        let (lost, mut back) = t.lost("b");
        assert_eq!(lost, Some(id));
        back.sort_by_key(|m| m.0);
        assert_eq!(back, vec![Md(5), Md(6), Md(7)]);
        assert_eq!(t.arenas_loaded(), 0);
    }

    #[test]
    fn a_peer_can_bounce_once_loaded_with_its_arena_and_after_its_hello() {
        let t = PeerTable::default();
        assert_eq!(t.admit("b", 9), Err(FrameRefused::NotLoaded));
        assert_eq!(t.loaded("b", Some(caps(9)), Some(&caps(1))), (Loaded::Compatible, None));
        assert!(t.compatible("b"));
        assert_eq!(t.endpoint("b").as_deref(), Some(&b"tcp://10.0.0.1:1"[..]));
        assert_eq!(t.arena_to_load("b", A0).map(|a| a.key), Some(b"key".to_vec()));
        assert_eq!(t.arena_loaded("b", A0, Some(Md(5)), None), (true, vec![]));
        assert!(t.bounce_arenas("b").is_none(), "no HELLO yet");
        confirmed(&t, "b", 9);
        assert!(t.bounce_arenas("b").is_some());
        assert_eq!(t.ready(), 1);
        let id = t.admit("b", 9).unwrap();
        // A credit inside the peer's arena passes, one past its end is refused.
        let first = Region { offset: 0, len: 4096 };
        assert_eq!(t.write_target(id, (A0, first), 4096).map(|(n, a)| (n, a.md)).ok(), Some(("b".to_owned(), Md(5))));
        let past_end = t.write_target(id, (A0, Region { offset: (1 << 20) - 8, len: 4096 }), 16);
        assert!(matches!(past_end, Err(WriteRefused::Credit(..))));
        assert_eq!(t.lost("b"), (Some(id), vec![Md(5)]), "the lost peer's arena is handed back to unload");
        assert!(
            t.bounce_arenas("b").is_none() && matches!(t.write_target(id, (A0, first), 4096), Err(WriteRefused::Gone))
        );
        assert_eq!((t.ready(), t.arenas_loaded()), (0, 0), "the gauges follow the loss");
        assert_eq!(t.admit("b", 9), Err(FrameRefused::NotLoaded));
        for gone in [id, PeerId(99)] {
            assert!(matches!(t.write_target(gone, (A0, first), 4096), Err(WriteRefused::Gone)), "{gone:?}");
        }
        t.loaded("b", Some(caps(9)), Some(&caps(1)));
        assert_ne!(t.known_id("b"), Some(id), "a lost id is never given again");
        // An incompatible peer is loaded (it may talk to us, with its session) but has nothing
        // to load; one without capabilities has no session to send message frames with.
        assert!(matches!(t.loaded("c", Some(caps(3)), None), (Loaded::NoCapabilities, None)));
        assert!(t.admit("c", 3).is_ok() && t.arena_to_load("c", A0).is_none());
        assert!(matches!(t.loaded("d", None, Some(&caps(1))), (Loaded::NoCapabilities, None)));
        assert_eq!(t.admit("d", 1), Err(FrameRefused::NoSession));
        assert_eq!(
            t.arena_loaded("c", A0, Some(Md(6)), None),
            (false, vec![vec![Md(6)]]),
            "loaded but not kept: unload it"
        );
    }

    #[test]
    fn the_session_comes_from_the_loaded_metadata_and_changes_only_by_a_reload() {
        let t = PeerTable::default();
        assert_eq!(t.loaded("b", Some(caps(1)), Some(&caps(9))), (Loaded::Compatible, None));
        let b = t.known_id("b").unwrap();
        assert_eq!(t.admit("b", 1), Ok(b));
        assert_eq!(t.admit("b", 2), Err(FrameRefused::StaleSession { got: 2, current: 1 }));
        assert_eq!(t.admit("b", 1), Ok(b), "a refused frame changes nothing");
        assert_eq!(t.loaded("b", Some(caps(1)), Some(&caps(9))), (Loaded::Compatible, None), "same session");
        assert_eq!(t.arena_loaded("b", A0, Some(Md(5)), None), (true, vec![]));
        // A new incarnation: the old one's id and arena handles come back, to reclaim and to
        // unload (nothing would find them under the new id), and the new one gets a new id.
        assert_eq!(t.loaded("b", Some(caps(2)), Some(&caps(9))), (Loaded::Compatible, Some((b, vec![Md(5)]))));
        let b2 = t.known_id("b").unwrap();
        assert_ne!(b2, b);
        assert_eq!((t.admit("b", 2), t.arenas_loaded()), (Ok(b2), 0));
        assert!(matches!(t.write_target(b, (A0, Region { offset: 0, len: 64 }), 64), Err(WriteRefused::Gone)));
        assert_eq!(t.admit("b", 1), Err(FrameRefused::StaleSession { got: 1, current: 2 }));
    }

    #[test]
    fn every_arena_handle_dropped_from_the_table_is_handed_back_once_to_unload() {
        let t = PeerTable::default();
        t.loaded("b", Some(caps(9)), Some(&caps(1)));
        assert_eq!(t.arena_loaded("b", A0, Some(Md(5)), None), (true, vec![]));
        // NIXL reloaded b's conn info: the new handle replaces the old, which must be unloaded.
        assert_eq!(t.arena_loaded("b", A0, Some(Md(6)), None), (true, vec![vec![Md(5)]]));
        // The same handle reported again is kept, never unloaded.
        assert_eq!(t.arena_loaded("b", A0, Some(Md(6)), None), (true, vec![]));
        assert_eq!(t.arenas_loaded(), 1);
        // GOODBYE under another session changes nothing; under b's, its arena goes.
        confirmed(&t, "b", 9);
        assert_eq!(t.goodbye("b", 8), Err(FrameRefused::StaleSession { got: 8, current: 9 }));
        assert!(t.bounce_arenas("b").is_some());
        assert_eq!((t.ready(), t.arenas_loaded()), (1, 1), "a refused GOODBYE moves no gauge");
        let id = t.known_id("b").unwrap();
        assert_eq!(t.goodbye("b", 9), Ok((id, vec![Md(6)])));
        let region = Region { offset: 0, len: 4096 };
        assert!(
            t.bounce_arenas("b").is_none()
                && matches!(t.write_target(id, (A0, region), 4096), Err(WriteRefused::NoArena))
        );
        assert_eq!((t.ready(), t.arenas_loaded()), (0, 0));
        assert_eq!((t.arenas_loaded(), t.lost("b")), (0, (Some(id), vec![])), "handed back once only");
        // Loading failed after a success: the old handle goes too.
        t.loaded("c", Some(caps(3)), Some(&caps(1)));
        assert_eq!(t.arena_loaded("c", A0, Some(Md(7)), None), (true, vec![]));
        assert_eq!(t.arena_loaded("c", A0, None, None), (false, vec![vec![Md(7)]]));
        assert_eq!(t.arena_loaded("c", A0, Some(Md(8)), None), (true, vec![]));
        assert_eq!(t.take_arenas(), vec![Md(8)]);
        assert_eq!(t.arenas_loaded(), 0);
    }

    #[test]
    fn a_peers_mailbox_registration_is_loaded_beside_its_arena_and_unloaded_with_it() {
        let t = PeerTable::default();
        let layout = bounce_proto::oneway::OneWayLayout::for_config(&bounce_proto::config::Config::default());
        let with_mailbox = |session| Capabilities {
            mailbox: Some(layout.advertised()),
            mailbox_base: 0x7f00_0000_0000,
            mailbox_len: layout.area_len(),
            mailbox_key: b"mkey".to_vec(),
            ..caps(session)
        };
        t.loaded("b", Some(with_mailbox(9)), Some(&caps(1)));
        let load = t.arena_to_load("b", A0).expect("compatible");
        assert_eq!(load.mailbox, Some((0x7f00_0000_0000, layout.area_len(), b"mkey".to_vec())));
        // Its mailbox failed to load: two way only (after its HELLO), never one way.
        assert_eq!(t.arena_loaded("b", A0, Some(Md(5)), None), (true, vec![]));
        assert!(t.one_way_target("b", layout.fetch_slice).is_none(), "no mailbox registration to READ through");
        let id = t.known_id("b").unwrap();
        assert!(t.mailbox_target(id).is_none());
        // Reloaded with both: the old arena handle goes, the new pair is kept.
        assert_eq!(t.arena_loaded("b", A0, Some(Md(6)), Some(Md(7))), (true, vec![vec![Md(5)]]));
        assert!(t.one_way_target("b", layout.fetch_slice).is_some(), "one way before any HELLO");
        // A ring larger than our fetch slice (a larger window than ours): never one way.
        let smaller = layout.fetch_slice - bounce_proto::mailbox::RECORD_LEN as u64;
        assert!(t.one_way_target("b", smaller).is_none(), "its ring would not fit a fetch slice");
        let m = t.mailbox_target(id).map(|(n, m)| (n, m.base, m.len, m.offset, m.md));
        assert_eq!(m, Some(("b".to_owned(), 0x7f00_0000_0000, layout.area_len(), 0, Md(7))));
        confirmed(&t, "b", 9);
        assert!(
            t.one_way_target("b", layout.fetch_slice).is_none() && t.bounce_arenas("b").is_some(),
            "two way after its HELLO"
        );
        // The same pair reported again is kept; a new pair replaces both.
        assert_eq!(t.arena_loaded("b", A0, Some(Md(6)), Some(Md(7))), (true, vec![]));
        assert_eq!(t.arena_loaded("b", A0, Some(Md(8)), Some(Md(9))), (true, vec![vec![Md(6), Md(7)]]));
        // The arena failed to load: the old pair handed back, and the new handle, nothing kept;
        // a handle reported again is handed back once.
        assert_eq!(t.arena_loaded("b", A0, None, Some(Md(10))), (false, vec![vec![Md(8), Md(9)], vec![Md(10)]]));
        assert_eq!(t.arena_loaded("b", A0, Some(Md(15)), Some(Md(16))), (true, vec![]));
        assert_eq!(t.arena_loaded("b", A0, None, Some(Md(16))), (false, vec![vec![Md(15), Md(16)]]));
        assert_eq!(t.arena_loaded("b", A0, Some(Md(11)), Some(Md(12))), (true, vec![]));
        assert_eq!(t.lost("b"), (Some(id), vec![Md(11), Md(12)]), "both handed back to unload");
        assert_eq!(t.arenas_loaded(), 0);
        // A peer without a mailbox has none to load, and a handle given anyway is not kept.
        t.loaded("c", Some(caps(3)), Some(&caps(1)));
        assert_eq!(t.arena_to_load("c", A0).and_then(|a| a.mailbox), None);
        assert_eq!(t.arena_loaded("c", A0, Some(Md(13)), Some(Md(14))), (true, vec![vec![Md(14)]]));
        assert_eq!(t.take_arenas(), vec![Md(13)]);
    }

    /// The load tag of the secret these tests confirm HELLOs with (`Token(0)`).
    fn tag0() -> u64 {
        bounce_proto::forget::load_tag(Token(0))
    }

    /// `name`'s HELLO under `session`, asked about and answered (the reactor does the asking).
    fn confirmed(t: &PeerTable, name: &str, session: u64) {
        assert_eq!(t.hello(name, session, tag0()), peers::Hello::Ask);
        assert!(t.confirm_hello(name, t.known_id(name).unwrap(), Token(0)));
    }

    #[test]
    fn hellos_count_only_from_loaded_agents_and_once_confirmed() {
        let t = PeerTable::default();
        assert_eq!(t.hello("late", 9, tag0()), peers::Hello::NotLoaded);
        for i in 0..4096 {
            assert_eq!(t.hello(&format!("x{i}"), 9, tag0()), peers::Hello::NotLoaded);
        }
        assert!(t.known_id("x0").is_none(), "nothing recorded for names not loaded");
        t.loaded("late", Some(caps(9)), Some(&caps(1)));
        assert_eq!(t.arena_loaded("late", A0, Some(Md(5)), None), (true, vec![]));
        assert!(t.bounce_arenas("late").is_none(), "its early HELLO left nothing");
        assert_eq!(t.hello("late", 9, tag0()), peers::Hello::Ask, "a loaded agent is always heard");
        assert_eq!((t.ready(), t.bounce_arenas("late").is_none()), (0, true), "asked about, not yet counted");
        let late = t.known_id("late").unwrap();
        assert!(
            !t.confirm_hello("late", PeerId(late.0 + 1), Token(0)),
            "another incarnation's answer confirms nothing"
        );
        assert!(t.confirm_hello("late", late, Token(0)));
        assert!(t.bounce_arenas("late").is_some());
        assert_eq!(t.ready(), 1, "its confirmed HELLO counts it ready");
        assert_eq!(t.hello("late", 9, tag0()), peers::Hello::Repeat);
        assert!(!t.confirm_hello("x0", late, Token(0)), "nothing to confirm for a name not loaded");
        assert_eq!(t.ready(), 1, "repeats and strangers change nothing");
    }
}
