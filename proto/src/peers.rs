//! The peer table: what this engine knows about each peer agent, keyed by its NIXL agent name,
//! and the rules that decide whether a control frame from it is accepted.
//!
//! Per peer it keeps the [`PeerId`] the endpoint knows it by, whether NIXL loaded its connection
//! info into this engine (and its [`Capabilities`] when they are compatible with ours, which
//! carry the peer arena's base, length and device), whether the peer's arena was loaded into the
//! inner engine, the session (instance nonce) its frames carry, and whether its HELLO is confirmed.
//!
//! Rules (as the IO shell applied them before they moved here):
//! - A HELLO counts only from a loaded, compatible peer under its session, and only once the
//!   peer proved it (the endpoint's ask, [`crate::hello`]: a PING only the peer can answer;
//!   [`confirm_hello`](PeerTable::confirm_hello) on its PONG). Until then
//!   [`hello`](PeerTable::hello) says [`Hello::Ask`]; once confirmed, a HELLO tagged with the
//!   load confirmed is a [`Hello::Repeat`] and one of another load (the peer loaded us again,
//!   its FORGET lost) a [`Hello::Reloaded`], asked about again. A HELLO from a name not loaded (the two
//!   loads race) is dropped and leaves nothing behind: invented names cannot grow memory or
//!   lock a real peer out, and a real peer's early HELLO is made up by the ask that follows its
//!   next one (our HELLO on loading it makes it say HELLO again).
//! - A frame from an agent whose connection info was never loaded is refused: UCX needs it to
//!   answer at all, and a WANT's reverse-path endpoint is never loaded on trust.
//! - A peer's session is the one in the capabilities NIXL loaded for it, and nothing else: a
//!   message frame whose header carries another session is refused, whatever its kind (a
//!   frame of a dead incarnation, a replay, or a forgery by a third party that would otherwise
//!   reset the peer and answer for it). A peer that published no capabilities has no session
//!   and sends no message frames. A new session is accepted only through a metadata reload
//!   ([`load_conn_info`](PeerTable::load_conn_info) with new capabilities), which reports the
//!   replaced incarnation so that its old state is reclaimed.
//! - Bounce to a peer only when [`can_bounce`](PeerTable::can_bounce): loaded, compatible, its
//!   arena loaded, and its HELLO confirmed (it loaded ours, so it can answer our WANTs).
//! - A credit is written only inside the peer's arena ([`check_credit`](PeerTable::check_credit)).
//!
//! Pure bookkeeping: the endpoint feeds it frames ([`crate::endpoint::Endpoint::handle_frame`]),
//! the shell feeds it the loads and losses that NIXL reports.

use std::collections::{BTreeMap, BTreeSet};

use thiserror::Error;

use crate::types::{ArenaId, PeerId, Region, Token};
use crate::wire::{Capabilities, Incompatible, WireError};

/// Most agent names never loaded here that may be given an id to send one-way frames (see
/// [`PeerTable::admit_one_way`]): invented names cannot grow the table beyond it, and beyond
/// it a name that holds nothing is forgotten ([`PeerTable::evict_one_way`]), so junk frames
/// under invented names cannot lock real initiators out either.
pub const MAX_ONE_WAY_NAMES: usize = 4096;

/// Ids from here on go only to names the application loads: one-way names and incarnations
/// are refused once the id counter reaches it (see `PeerTable::fresh_id`), 2^32 ids short of the
/// end. Ids are 64 bits (review 59, L2: with 32, a flood of invented names could spend the
/// one-way ids in hours, and 2^24 loads after that made two loaded names share the last id):
/// at a million invented names a second, the one-way ids last over half a million years.
pub const ONE_WAY_IDS_END: u64 = u64::MAX - (1 << 32);

/// Longest agent name a control frame may come from. The name comes with the frame (a UCX
/// notification's sender, a ZMQ message's header), so the peer picks its length: a name kept
/// for one-way frames, or queued with a frame, must not make that peer's memory ours. NIXL
/// agent names are short (a host and a rank, a UUID).
pub const MAX_NAME_LEN: usize = 1024;

/// Why a control frame was refused. It was dropped and changed nothing else.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum FrameRefused {
    /// The bytes are no control frame of our wire version.
    #[error("malformed control frame: {0}")]
    Malformed(#[from] WireError),
    /// A message frame whose session differs from the one in the peer's loaded capabilities:
    /// from a dead earlier incarnation, a replay, or a forgery.
    #[error("stale session {got:#x} (the peer's is {current:#x})")]
    StaleSession {
        /// The session the frame carries.
        got: u64,
        /// The peer's recorded session.
        current: u64,
    },
    /// A message frame from a loaded agent that published no capabilities: it has no session
    /// and takes no part in bounce transfers.
    #[error("control message from an agent that published no capabilities")]
    NoSession,
    /// The agent's connection info is not loaded into this engine (never, or lost since).
    /// Nothing of it is recorded: invented names cannot grow the table.
    #[error("control frame from an agent whose connection info was never loaded")]
    NotLoaded,
    /// A FORGET without the secret of our load of the peer ([`crate::forget`]): forged, or
    /// one of an earlier load replayed.
    #[error("FORGET without the secret of its load here")]
    ForgedForget,
    /// The endpoint refused the message (see [`crate::event::ProtocolError`]).
    #[error(transparent)]
    Protocol(#[from] crate::event::ProtocolError),
}

/// What a HELLO changed (see [`PeerTable::hello`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub enum Hello {
    /// From a name not loaded: dropped, nothing recorded.
    NotLoaded,
    /// From a loaded peer whose HELLO is confirmed, for the load confirmed (its tag,
    /// [`crate::forget::load_tag`]): nothing new, nothing to ask.
    Repeat,
    /// From a loaded peer whose HELLO is confirmed, for another load: it unloaded us and loaded
    /// us again, and its FORGET was lost (or the HELLO is forged). Ask it, rate-limited
    /// ([`crate::hello`]): its PONG brings the new load's secret, and our HELLO, which it lacks.
    Reloaded,
    /// From a loaded, compatible peer whose HELLO is not confirmed: ask it (our HELLO and a
    /// PING, [`crate::hello`]); its PONG confirms ([`PeerTable::confirm_hello`]).
    Ask,
    /// From a loaded peer that cannot bounce with us (no or incompatible capabilities):
    /// nothing to ask.
    Unusable,
    /// From a loaded peer, under another session than its loaded capabilities' (a forgery,
    /// or an old incarnation): nothing recorded; drop it as a frame of a stale session.
    Stale {
        /// The peer's session (`None`: it published no capabilities).
        current: Option<u64>,
    },
}

impl Hello {
    /// The refusal of a [`Hello::Stale`] that carried `got`; `None` for any other outcome.
    pub fn refusal(self, got: u64) -> Option<FrameRefused> {
        match self {
            Self::Stale { current: Some(current) } => Some(FrameRefused::StaleSession { got, current }),
            Self::Stale { current: None } => Some(FrameRefused::NoSession),
            _ => None,
        }
    }
}

/// What a FORGET proved ([`PeerTable::forgot_us`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Forgot {
    /// The peer unloaded our metadata: its HELLO no longer counts.
    Us(PeerId),
    /// Its HELLO is not confirmed (it never loaded us, or its FORGET came already): nothing
    /// to undo.
    NotConfirmed,
    /// Not the secret its confirming PONG carried: a forgery (or a FORGET of an earlier load,
    /// replayed). Nothing changed.
    Forged,
}

/// What loading a peer's connection info decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Loaded {
    /// Both sides publish compatible capabilities: bounce may be used once the peer's arena is
    /// loaded and its HELLO is confirmed.
    Compatible,
    /// One side publishes no capabilities (bounce disabled or unusable there): plain UCX.
    NoCapabilities,
    /// The capabilities disagree: plain UCX.
    Incompatible(Incompatible),
}

/// Why a credit may not be written (see [`PeerTable::check_credit`]).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum CreditRefused {
    /// No peer has this id.
    #[error("unknown peer {}", .0.0)]
    UnknownPeer(PeerId),
    /// The peer's arena is not loaded (it cannot bounce with us, or it was lost), or it
    /// advertised no arena of that id.
    #[error("peer {}'s arena is not loaded", .0.0)]
    NoArena(PeerId),
    /// The write would leave the granted region or the peer's arena: a broken or hostile peer.
    #[error("credit {region} for {len} bytes lies outside peer {}'s arena of {arena_len} bytes", .peer.0)]
    OutsideArena {
        /// The peer.
        peer: PeerId,
        /// The granted region.
        region: Region,
        /// Bytes to write.
        len: u64,
        /// The peer's arena length.
        arena_len: u64,
    },
}

/// What the table knows about one agent name.
#[derive(Debug, Clone)]
struct Peer {
    id: PeerId,
    /// `Some` once NIXL loaded its connection info; inside, its capabilities when compatible.
    conn: Option<Option<Capabilities>>,
    /// Its arena was loaded into the inner engine.
    arena: bool,
    /// The session its frames must carry: the one in the capabilities loaded for it.
    session: Option<u64>,
    /// Its HELLO is confirmed (it answered our ask), with the forget secret its confirming
    /// PONG carried ([`crate::forget`]): a FORGET from it must prove that.
    hello: Option<Token>,
    /// The proof of a FORGET that came while its HELLO was not confirmed: a PONG carrying that
    /// secret confirms nothing (the peer sent it before it unloaded us, and the FORGET overtook
    /// it). Only the peer can make its secret, and it never uses one for two loads.
    forgot: Option<Token>,
}

impl Peer {
    /// Loaded, compatible, its arena loaded, and its HELLO confirmed.
    fn can_bounce(&self) -> bool {
        matches!(self.conn, Some(Some(_))) && self.arena && self.hello.is_some()
    }
}

/// Every peer agent this engine has heard of, by name (see the module docs for the rules).
#[derive(Debug, Clone, Default)]
pub struct PeerTable {
    by_name: BTreeMap<String, Peer>,
    names: BTreeMap<PeerId, String>,
    /// Names never loaded that were given an id for one-way frames (at most
    /// [`MAX_ONE_WAY_NAMES`], with `incarnations`).
    one_way: BTreeSet<String>,
    /// One-way initiators under the name of a loaded agent but another session: the agent
    /// restarted (or a third party claims its name), and NIXL here still holds its old
    /// metadata. Each gets an id of its own, so its flows never mix with the loaded
    /// incarnation's, and a reload with its session adopts that id
    /// ([`load_conn_info`](Self::load_conn_info)), so its flows go on.
    incarnations: BTreeMap<(String, u64), PeerId>,
    next_id: u64,
    /// Peers that can bounce now, kept in step by every change to an entry ([`tracked`]), so
    /// reading it costs no pass over the table: the shell publishes it after each change, a
    /// flood of HELLOs or GOODBYEs included.
    ready: usize,
}

/// Applies `f` to `p` and keeps `ready` in step with whether `p` can bounce before and after.
/// Every change to an entry's `conn`, `arena` or `hello` goes through here.
fn tracked<R>(ready: &mut usize, p: &mut Peer, f: impl FnOnce(&mut Peer) -> R) -> R {
    let before = p.can_bounce();
    let r = f(p);
    match (before, p.can_bounce()) {
        (false, true) => *ready += 1,
        (true, false) => *ready -= 1,
        _ => {}
    }
    r
}

impl PeerTable {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// The id of `name`, assigning the next free one on first sight. Ids are never reused.
    pub fn id(&mut self, name: &str) -> PeerId {
        self.entry(name).id
    }

    /// The id of `name`, if it was ever seen.
    pub fn lookup(&self, name: &str) -> Option<PeerId> {
        self.by_name.get(name).map(|p| p.id)
    }

    /// The name behind `id`.
    pub fn name(&self, id: PeerId) -> Option<&str> {
        self.names.get(&id).map(String::as_str)
    }

    /// NIXL loaded `name`'s connection info, which published `theirs` (`None`: bounce is off
    /// there); `ours` is what we publish. Records the peer as loaded, with its capabilities
    /// when both exist and are compatible, and its session (the one `theirs` carries, even when
    /// incompatible). A reload with the same session changes nothing else; see
    /// [`load_replaces`](Self::load_replaces) for one that brings a new incarnation.
    pub fn load_conn_info(&mut self, name: &str, theirs: Option<Capabilities>, ours: Option<&Capabilities>) -> Loaded {
        let session = theirs.as_ref().map(|c| c.session);
        let (caps, loaded) = match (theirs, ours) {
            (Some(theirs), Some(ours)) => match ours.compatible_with(&theirs) {
                Ok(()) => (Some(theirs), Loaded::Compatible),
                Err(why) => (None, Loaded::Incompatible(why)),
            },
            _ => (None, Loaded::NoCapabilities),
        };
        // Each incarnation of an agent goes by an id of its own: whatever still names the old
        // one's id (the reclaim its replacement queued, a frame admitted just before) can never
        // touch the new one's state. The new one takes the id its one-way flows already have
        // here, if it sent any, so that they go on.
        if self.replaced_by(name, session).is_some() {
            self.retire(name);
        }
        if !self.by_name.contains_key(name) {
            let adopted = session.and_then(|s| self.incarnations.remove(&(name.to_owned(), s)));
            self.insert(name, adopted);
        }
        let p = self.by_name.get_mut(name).expect("entry made above");
        tracked(&mut self.ready, p, |p| {
            if p.session != session {
                p.hello = None;
                p.forgot = None;
            }
            p.conn = Some(caps);
            p.session = session;
        });
        loaded
    }

    /// The peer whose old incarnation loading `theirs` for `name` would replace: `Some` when
    /// `name` is loaded with a session and `theirs` carries another one (or none). Everything
    /// the endpoint holds for that peer belongs to the old incarnation and must be reclaimed
    /// (as for a lost peer) before frames of the new session can arrive, so ask this *before*
    /// calling [`load_conn_info`](Self::load_conn_info).
    pub fn load_replaces(&self, name: &str, theirs: Option<&Capabilities>) -> Option<PeerId> {
        self.replaced_by(name, theirs.map(|c| c.session))
    }

    /// The entry of `name` that a load under `session` replaces: one loaded under another
    /// session, or any other entry of the name when a one-way incarnation of that session is
    /// there to be adopted (an entry never loaded, under which a third agent may have opened
    /// one-way flows: they go with it, and the incarnation's flows go on).
    fn replaced_by(&self, name: &str, session: Option<u64>) -> Option<PeerId> {
        let p = self.by_name.get(name)?;
        let other = p.conn.is_some() && p.session.is_some() && p.session != session;
        let adopts =
            session.is_some_and(|s| p.session != Some(s) && self.incarnations.contains_key(&(name.to_owned(), s)));
        (other || adopts).then_some(p.id)
    }

    /// NIXL's inner engine refused the connection info just loaded for `name`: NIXL keeps no
    /// connection to it, so neither may we. An entry under a session goes back to being a
    /// one-way incarnation of that session, its id kept (the agent may have begun one-way
    /// flows under it before this load, which go on as before it); one without a session is
    /// forgotten as lost. Returns the id to reclaim as lost, if any.
    pub fn load_failed(&mut self, name: &str) -> Option<PeerId> {
        let session = self.by_name.get(name).filter(|p| p.conn.is_some())?.session;
        let id = self.retire(name)?;
        match session {
            Some(s) => {
                self.names.insert(id, name.to_owned());
                self.incarnations.insert((name.to_owned(), s), id);
                None
            }
            None => Some(id),
        }
    }

    /// The inner engine loaded `name`'s arena (`ok`), or failed to. Only a compatible peer's
    /// arena counts as loaded.
    pub fn arena_loaded(&mut self, name: &str, ok: bool) {
        self.entry(name);
        let p = self.by_name.get_mut(name).expect("entry made above");
        tracked(&mut self.ready, p, |p| p.arena = ok && matches!(p.conn, Some(Some(_))));
    }

    /// The capabilities of `name` when it is loaded and compatible: the peer we may HELLO, and
    /// whose arena we may load.
    pub fn compatible(&self, name: &str) -> Option<&Capabilities> {
        self.by_name.get(name)?.conn.as_ref()?.as_ref()
    }

    /// True when `name`'s connection info was loaded (compatible or not).
    pub fn is_loaded(&self, name: &str) -> bool {
        self.by_name.get(name).is_some_and(|p| p.conn.is_some())
    }

    /// True when `name`'s HELLO is confirmed since its load.
    pub fn is_reachable(&self, name: &str) -> bool {
        self.by_name.get(name).is_some_and(|p| p.hello.is_some())
    }

    /// Whether transfers to `name` may take the bounce path: loaded, compatible, its arena
    /// loaded, and its HELLO confirmed.
    pub fn can_bounce(&self, name: &str) -> bool {
        self.by_name.get(name).is_some_and(Peer::can_bounce)
    }

    /// True when a PING to `id` reaches the peer behind it: `id` is the loaded incarnation
    /// of a name that can bounce with us (a one-way incarnation of a loaded name is not: the
    /// name's PINGs reach the other one, whose PONG never comes back to this id).
    pub fn answers_pings(&self, id: PeerId) -> bool {
        self.name(id).is_some_and(|n| self.can_bounce(n) && self.lookup(n) == Some(id))
    }

    /// Peers that can bounce with us now (a count kept as the table changes).
    pub fn bounce_peers(&self) -> usize {
        self.ready
    }

    /// The session recorded for `name`.
    pub fn session(&self, name: &str) -> Option<u64> {
        self.by_name.get(name)?.session
    }

    /// A HELLO from `name` carrying `session` (see [`Hello`]). Nothing is recorded: a HELLO
    /// switches our route to the peer from one way to two way, and anyone may claim a name and
    /// copy a published session, so it counts only once the peer answers the ask it opens
    /// ([`confirm_hello`](Self::confirm_hello)). One under a loaded peer's name but another
    /// session is refused as stale. `load` is the HELLO's load tag: once the peer's HELLO is
    /// confirmed, one for the load confirmed is a [`Hello::Repeat`], another a
    /// [`Hello::Reloaded`].
    pub fn hello(&self, name: &str, session: u64, load: u64) -> Hello {
        match self.by_name.get(name) {
            Some(p) if p.conn.is_some() => match p.session {
                Some(current) if current != session => Hello::Stale { current: Some(current) },
                None => Hello::Stale { current: None },
                Some(_) if p.hello.is_some_and(|s| crate::forget::load_tag(s) == load) => Hello::Repeat,
                Some(_) if p.hello.is_some() => Hello::Reloaded,
                Some(_) if matches!(p.conn, Some(Some(_))) => Hello::Ask,
                Some(_) => Hello::Unusable,
            },
            _ => Hello::NotLoaded,
        }
    }

    /// `name` answered the ask its HELLO opened (its PONG echoed a nonce only it saw): its
    /// HELLO counts, and it may be bounced to two way once its arena is loaded; `forget` is
    /// the forget secret that PONG carried ([`crate::forget`]), which a FORGET from it must
    /// prove. Returns false (nothing changed) unless it is loaded and compatible, and the
    /// secret is not one a FORGET already ended.
    pub fn confirm_hello(&mut self, name: &str, forget: Token) -> bool {
        match self.by_name.get_mut(name) {
            Some(p) if matches!(p.conn, Some(Some(_))) && p.forgot != Some(forget) => {
                tracked(&mut self.ready, p, |p| p.hello = Some(forget));
                true
            }
            _ => false,
        }
    }

    /// A FORGET from `name` under `session`, proving `proof` (see [`crate::forget`]): when
    /// `name` is loaded under that session, its HELLO confirmed and `proof` the secret its
    /// confirming PONG carried, the peer unloaded us: its HELLO no longer counts (our route to
    /// it is one way again, until it loads us and says HELLO again). Nothing changes
    /// otherwise.
    ///
    /// # Errors
    /// As [`admit`](Self::admit) for the session and loading rules.
    pub fn forgot_us(&mut self, name: &str, session: u64, proof: Token) -> Result<Forgot, FrameRefused> {
        let id = self.admit(name, session)?;
        let p = self.by_name.get_mut(name).expect("admitted: loaded");
        Ok(match p.hello {
            None => {
                p.forgot = Some(proof);
                Forgot::NotConfirmed
            }
            Some(secret) if secret != proof => Forgot::Forged,
            Some(_) => {
                // Remembered, so that a late PONG of an ask still open, carrying this same
                // secret, cannot confirm the HELLO again (review 59): a reload's PONG brings a
                // new secret.
                p.forgot = Some(proof);
                tracked(&mut self.ready, p, |p| p.hello = None);
                Forgot::Us(id)
            }
        })
    }

    /// Whether a frame from `name` under `session` comes from no id we hold for it yet: a
    /// name never heard of, or a loaded one under another session (another incarnation, see
    /// [`admit_message`](Self::admit_message)). Such a frame's opening must prove itself
    /// before an id is spent on it.
    pub fn is_unvouched(&self, name: &str, session: u64) -> bool {
        self.lookup(name).is_none() || matches!(self.admit(name, session), Err(FrameRefused::StaleSession { .. }))
    }

    /// Applies the loading and session rules to a message frame from `name` carrying
    /// `session`; returns the sending peer. Nothing is recorded, whatever the outcome.
    ///
    /// # Errors
    /// [`FrameRefused::NotLoaded`], [`FrameRefused::NoSession`] or
    /// [`FrameRefused::StaleSession`].
    pub fn admit(&self, name: &str, session: u64) -> Result<PeerId, FrameRefused> {
        // Loading first: a name NIXL never loaded gets no entry, no id and no session.
        let p = match self.by_name.get(name) {
            Some(p) if p.conn.is_some() => p,
            _ => return Err(FrameRefused::NotLoaded),
        };
        match p.session {
            Some(current) if current == session => Ok(p.id),
            Some(current) => Err(FrameRefused::StaleSession { got: session, current }),
            None => Err(FrameRefused::NoSession),
        }
    }

    /// Admits a one-way frame from `name`, which NIXL never loaded here (the caller checked
    /// the frame is one-way traffic: a WANT answered through our mailbox, or a message of such
    /// a flow, each carrying its flow's token). No session applies: we hold none for it, and
    /// the flow's token authenticates every frame of the flow. Gives the name an id on first
    /// sight, for at most [`MAX_ONE_WAY_NAMES`] names.
    ///
    /// # Errors
    /// [`FrameRefused::NotLoaded`] when the name is new and the cap is reached, or longer than
    /// [`MAX_NAME_LEN`].
    pub fn admit_one_way(&mut self, name: &str) -> Result<PeerId, FrameRefused> {
        if let Some(p) = self.by_name.get(name) {
            return Ok(p.id);
        }
        if self.one_way_full() || name.len() > MAX_NAME_LEN {
            return Err(FrameRefused::NotLoaded);
        }
        self.one_way.insert(name.to_owned());
        Ok(self.entry(name).id)
    }

    /// No one-way name or incarnation can be admitted now: they are [`MAX_ONE_WAY_NAMES`]
    /// together, or the ids they may take are spent.
    fn one_way_full(&self) -> bool {
        self.one_way.len() + self.incarnations.len() >= MAX_ONE_WAY_NAMES || self.one_way_ids_spent()
    }

    /// The id counter reached [`ONE_WAY_IDS_END`]: the ids left are loaded names'.
    fn one_way_ids_spent(&self) -> bool {
        self.next_id >= ONE_WAY_IDS_END
    }

    /// The id of the one-way incarnation of `name` under `session` (see
    /// [`admit_incarnation`](Self::admit_incarnation)), if it has one.
    pub fn incarnation(&self, name: &str, session: u64) -> Option<PeerId> {
        // Asked for every message frame: no key is built while there are none (the usual case).
        if self.incarnations.is_empty() {
            return None;
        }
        self.incarnations.get(&(name.to_owned(), session)).copied()
    }

    /// Admits a one-way frame from `name` under `session` while NIXL has `name` loaded under
    /// another session (the caller checked the frame is one-way traffic, as for
    /// [`admit_one_way`](Self::admit_one_way)): the agent restarted, and its new incarnation
    /// transfers to us before this side reloads its metadata, which plain UCX's one-sided
    /// writes would serve. It gets an id of its own on first sight, within the one-way names'
    /// cap. The loaded incarnation's session rule is untouched: nothing of this id is ever
    /// its, and a forger gains what an invented name would (its flows need our keys' proofs
    /// and carry their tokens).
    ///
    /// # Errors
    /// [`FrameRefused::NotLoaded`] when `name` is not loaded under another session, or the cap
    /// is reached.
    pub fn admit_incarnation(&mut self, name: &str, session: u64) -> Result<PeerId, FrameRefused> {
        if let Some(id) = self.incarnation(name, session) {
            return Ok(id);
        }
        let other = self.by_name.get(name).is_some_and(|p| p.conn.is_some() && p.session.is_some_and(|s| s != session));
        if !other || self.one_way_full() {
            return Err(FrameRefused::NotLoaded);
        }
        let id = self.fresh_id();
        self.names.insert(id, name.to_owned());
        self.incarnations.insert((name.to_owned(), session), id);
        Ok(id)
    }

    /// The peer a message frame from `name` under `session` is admitted as: the loaded
    /// peer's id under its own session ([`admit`](Self::admit)); or, for one-way traffic
    /// (`one_way(id)`: the endpoint's `admits_one_way`, given the id the frame's flows would
    /// be under), a name never loaded ([`admit_one_way`](Self::admit_one_way)) or another
    /// incarnation of a loaded one ([`admit_incarnation`](Self::admit_incarnation)). A one-way
    /// incarnation's frames go to it first, even once its session is the loaded one's
    /// (reloaded, it adopted the id: then both are one). When every one-way name is taken, one
    /// whose id `holds_nothing` is forgotten to make room and returned beside the admitted id:
    /// the endpoint must drop what little may remain of it (replay floors) before the frame.
    ///
    /// # Errors
    /// A [`FrameRefused`]: drop the frame; nothing changed.
    pub fn admit_message(
        &mut self,
        name: &str,
        session: u64,
        one_way: impl Fn(Option<PeerId>) -> bool,
        holds_nothing: impl Fn(PeerId) -> bool,
    ) -> Result<(PeerId, Option<PeerId>), FrameRefused> {
        if let Some(id) = self.incarnation(name, session).filter(|&id| one_way(Some(id))) {
            return Ok((id, None));
        }
        // A name we would never keep is refused before anything is forgotten to make room.
        if name.len() > MAX_NAME_LEN {
            return self.admit(name, session).map(|id| (id, None));
        }
        let stranger = match self.admit(name, session) {
            Ok(id) => return Ok((id, None)),
            Err(FrameRefused::NotLoaded) if one_way(self.lookup(name)) => false,
            Err(FrameRefused::StaleSession { .. }) if one_way(None) => true,
            Err(e) => return Err(e),
        };
        let admit = |t: &mut Self| if stranger { t.admit_incarnation(name, session) } else { t.admit_one_way(name) };
        match admit(self) {
            // Ids spent: evicting would only drop a name's state for nothing.
            Err(FrameRefused::NotLoaded) if self.one_way_full() && !self.one_way_ids_spent() => {
                // Names loaded since their admission leave first; if that made room, nobody
                // goes (review 59, L3: the frame was refused, or a name evicted, needlessly).
                self.prune_loaded_one_way();
                if !self.one_way_full() {
                    return admit(self).map(|id| (id, None));
                }
                let gone = self.evict_one_way(holds_nothing).ok_or(FrameRefused::NotLoaded)?;
                Ok((admit(self)?, Some(gone)))
            }
            r => r.map(|id| (id, None)),
        }
    }

    /// Forgets one name admitted for one-way frames that NIXL never loaded and whose id
    /// `holds_nothing` (no flow, no mailbox slot, nothing waiting: an endpoint's
    /// `holds_nothing_for`), to make room for another when [`MAX_ONE_WAY_NAMES`] are admitted.
    /// Its id is never given again: the name, should it come back, gets a new one. Names loaded
    /// since their admission are not one-way names any more and leave the set on the way. When
    /// no such name holds nothing, a one-way incarnation that holds nothing goes instead.
    /// Returns the forgotten id; `None` when every one-way name and incarnation holds something.
    pub fn evict_one_way(&mut self, holds_nothing: impl Fn(PeerId) -> bool) -> Option<PeerId> {
        self.prune_loaded_one_way();
        let mut victim = None;
        for name in &self.one_way {
            match self.by_name.get(name) {
                Some(p) if holds_nothing(p.id) => {
                    victim = Some((name.clone(), p.id));
                    break;
                }
                _ => {}
            }
        }
        if victim.is_none() {
            let idle = self.incarnations.iter().find(|(_, id)| holds_nothing(**id)).map(|(k, id)| (k.clone(), *id));
            let (key, id) = idle?;
            self.incarnations.remove(&key);
            self.names.remove(&id);
            return Some(id);
        }
        let (name, id) = victim?;
        self.one_way.remove(&name);
        if let Some(p) = self.by_name.remove(&name) {
            // Never loaded: it cannot have counted as ready.
            debug_assert!(!p.can_bounce());
        }
        self.names.remove(&id);
        Some(id)
    }

    /// Names admitted for one-way frames that NIXL has loaded since leave the one-way names
    /// (they count against the application's loads, not the one-way names' cap).
    fn prune_loaded_one_way(&mut self) {
        let by_name = &self.by_name;
        self.one_way.retain(|name| by_name.get(name).is_none_or(|p| p.conn.is_none()));
    }

    /// Whether transfers to `name` may bounce one way: loaded, compatible, its arena loaded,
    /// and it keeps a mailbox (no HELLO needed: it answers through the mailbox).
    pub fn can_bounce_one_way(&self, name: &str) -> bool {
        self.by_name.get(name).is_some_and(|p| matches!(&p.conn, Some(Some(c)) if c.mailbox.is_some()) && p.arena)
    }

    /// A GOODBYE from `name` carrying `session`: its engine is going away with its arena. The
    /// arena and HELLO are forgotten (nothing more is bounced to it until it is loaded and
    /// says HELLO again); its connection info and session stay, so the retraction of our
    /// credits and its last frames still pass. Returns its id.
    ///
    /// # Errors
    /// [`FrameRefused::NotLoaded`], or [`FrameRefused::StaleSession`] when `session` is not the
    /// peer's current one (a GOODBYE never starts a session); nothing changed.
    pub fn goodbye(&mut self, name: &str, session: u64) -> Result<PeerId, FrameRefused> {
        let p = match self.by_name.get_mut(name) {
            Some(p) if p.conn.is_some() => p,
            _ => return Err(FrameRefused::NotLoaded),
        };
        let current = match (&p.session, &p.conn) {
            (Some(s), _) => *s,
            (None, Some(Some(caps))) => caps.session,
            (None, _) => return Err(FrameRefused::NotLoaded),
        };
        if current != session {
            return Err(FrameRefused::StaleSession { got: session, current });
        }
        tracked(&mut self.ready, p, |p| {
            p.arena = false;
            p.hello = None;
        });
        Ok(p.id)
    }

    /// `name` disconnected (NIXL reports it): it is no longer loaded, its arena, HELLO and
    /// session are forgotten, and so is its id: whatever comes under the name next (a reload, a
    /// one-way frame, a transfer we submit) gets a new one, so the reclaim of the lost one can
    /// never touch it. Returns the lost id, if the name was known.
    pub fn lost(&mut self, name: &str) -> Option<PeerId> {
        self.retire(name)
    }

    /// Forgets `name`'s entry and its id (never given again).
    fn retire(&mut self, name: &str) -> Option<PeerId> {
        let p = self.by_name.get_mut(name)?;
        tracked(&mut self.ready, p, |p| {
            p.conn = None;
            p.arena = false;
            p.hello = None;
            p.session = None;
        });
        let id = p.id;
        self.by_name.remove(name);
        self.names.remove(&id);
        self.one_way.remove(name);
        Some(id)
    }

    /// Whether a write of `len` bytes into `peer`'s granted `region` of its arena `arena`
    /// stays inside the region and that arena. The core checks credits against its own
    /// bookkeeping; only the peer's capabilities tell the arena's size, so a credit from a
    /// broken or hostile peer that points outside it is caught here, before anything is
    /// written.
    ///
    /// # Errors
    /// A [`CreditRefused`]: never write then.
    pub fn check_credit(&self, peer: PeerId, arena: ArenaId, region: Region, len: u64) -> Result<(), CreditRefused> {
        let p = self.names.get(&peer).and_then(|n| self.by_name.get(n)).ok_or(CreditRefused::UnknownPeer(peer))?;
        let arena_len = match &p.conn {
            Some(Some(caps)) if p.arena => caps.arenas.get(arena).ok_or(CreditRefused::NoArena(peer))?.len,
            _ => return Err(CreditRefused::NoArena(peer)),
        };
        if region.offset.checked_add(len).is_none_or(|end| end > arena_len) || len > region.len {
            return Err(CreditRefused::OutsideArena { peer, region, len, arena_len });
        }
        Ok(())
    }

    fn entry(&mut self, name: &str) -> &mut Peer {
        if !self.by_name.contains_key(name) {
            self.insert(name, None);
        }
        self.by_name.get_mut(name).expect("inserted above")
    }

    /// A new entry for `name`, by `id` or the next free one.
    fn insert(&mut self, name: &str, id: Option<PeerId>) {
        let id = id.unwrap_or_else(|| self.fresh_id());
        self.names.insert(id, name.to_owned());
        let peer = Peer { id, conn: None, arena: false, session: None, hello: None, forgot: None };
        self.by_name.insert(name.to_owned(), peer);
    }

    /// The next id: never one given before. Ids are never reused (a retired id's frames must
    /// not reach a later peer), and one-way names, which junk frames under invented names can
    /// make and evict without end, stop taking them at [`ONE_WAY_IDS_END`]: after 2^32 such
    /// frames the counter would otherwise wrap to the first loaded peer's id. The ids above it
    /// are left to names the application loads.
    fn fresh_id(&mut self) -> PeerId {
        let id = PeerId(self.next_id);
        self.next_id = self.next_id.saturating_add(1);
        id
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::ControlKind;

    /// Junk frames under invented names can make and evict one-way names without end: once
    /// their ids are spent they are refused (evicting nobody), and the counter never wraps to
    /// a loaded peer's id; a name the application loads still gets a new id.
    #[test]
    fn one_way_names_stop_taking_ids_before_they_run_out_and_loaded_ones_still_get_new_ids() {
        let mut t = PeerTable::default();
        let first = t.entry("loaded").id;
        t.next_id = ONE_WAY_IDS_END - 1;
        let last = t.admit_one_way("w-last").expect("one id left");
        assert_eq!(last, PeerId(ONE_WAY_IDS_END - 1));
        assert_eq!(t.admit_one_way("w-next"), Err(FrameRefused::NotLoaded), "ids spent");
        let before = t.one_way.len();
        assert!(t.admit_message("w-junk", 9, |_| true, |_| true).is_err());
        assert_eq!(t.one_way.len(), before, "nothing evicted for a name that could not be admitted");
        let loaded = t.entry("loaded-later").id;
        assert!(loaded.0 >= ONE_WAY_IDS_END && loaded != first);
        let another = t.entry("loaded-after-that").id;
        assert!(another.0 > loaded.0, "each load past the end its own id");
        // 2^32 ids are left to loads past the one-way names' end: no application reloads that
        // often (review 59, L2: with 32-bit ids 2^24 were, and the last was shared).
        assert_eq!(u64::MAX - ONE_WAY_IDS_END, 1 << 32);
    }

    fn caps(max_chunk: u64) -> Capabilities {
        let mut c = Capabilities::host_arena(0x1_0000, max_chunk, 1);
        let arena = c.arenas.first_mut();
        (arena.base, arena.key) = (0x10_0000, vec![1]);
        c
    }

    /// The load tag of the secret the tests confirm HELLOs with (`Token(0)`).
    fn tag0() -> u64 {
        crate::forget::load_tag(Token(0))
    }

    /// A table where `name` is loaded, compatible, its arena loaded and its HELLO confirmed.
    fn ready(name: &str) -> PeerTable {
        let mut t = PeerTable::new();
        assert_eq!(t.load_conn_info(name, Some(caps(4096)), Some(&caps(4096))), Loaded::Compatible);
        t.arena_loaded(name, true);
        assert_eq!(t.hello(name, 1, tag0()), Hello::Ask);
        assert!(t.confirm_hello(name, Token(0)));
        t
    }

    /// After a FORGET that proved the confirmed secret, a late PONG carrying that same secret
    /// (an ask still open, answered before the peer unloaded us) confirms nothing; a reload's
    /// PONG, with a new secret, does (review 59).
    #[test]
    fn a_late_pong_with_a_forgotten_secret_does_not_confirm_the_hello_again() {
        let mut t = ready("p");
        assert!(matches!(t.forgot_us("p", 1, Token(0)), Ok(Forgot::Us(_))));
        assert!(!t.can_bounce("p"));
        assert!(!t.confirm_hello("p", Token(0)), "the forgotten secret confirmed the HELLO again");
        assert!(!t.can_bounce("p"));
        assert!(t.confirm_hello("p", Token(5)), "a new load's secret confirms");
        assert!(t.can_bounce("p"));
    }

    /// An id names one incarnation of an agent: stable while it is loaded, retired when it is
    /// lost or replaced (a reclaim of the old id, queued before the change, can then never
    /// touch what comes next under the name), and never given again.
    #[test]
    fn ids_are_stable_per_incarnation_and_never_reused() {
        let mut t = PeerTable::new();
        let a = t.id("a");
        let b = t.id("b");
        assert_ne!(a, b);
        assert_eq!(t.id("a"), a);
        t.load_conn_info("a", Some(caps(4096)), Some(&caps(4096)));
        assert_eq!(t.lookup("a"), Some(a), "a first load keeps the id transfers were submitted under");
        t.load_conn_info("a", Some(caps(4096)), Some(&caps(4096)));
        assert_eq!(t.lookup("a"), Some(a), "the same session: the same incarnation");
        assert_eq!(t.lost("a"), Some(a));
        assert_eq!((t.lookup("a"), t.name(a)), (None, None));
        let again = t.id("a");
        assert!(again != a && again != b);
        t.load_conn_info("a", Some(caps(4096)), Some(&caps(4096)));
        let replaced = t.load_conn_info("a", Some(Capabilities { session: 2, ..caps(4096) }), Some(&caps(4096)));
        assert_eq!(replaced, Loaded::Compatible);
        let third = t.lookup("a").unwrap();
        assert!(third != again && third != a && t.name(again).is_none());
        assert_eq!((t.lookup("b"), t.name(b), t.lookup("c")), (Some(b), Some("b"), None));
    }

    /// A loaded agent's name under another session: one-way traffic only, under an id of its
    /// own per session, within the one-way names' cap (an idle one gives way), and adopted by a
    /// reload with its session. The loaded peer's own rule is untouched.
    #[test]
    fn another_incarnation_of_a_loaded_name_is_admitted_one_way_under_its_own_id() {
        let mut t = ready("a");
        let a = t.lookup("a").unwrap();
        let nothing = |_| false;
        let (one_way, two_way) = (|_: Option<PeerId>| true, |_: Option<PeerId>| false);
        assert_eq!(t.admit_message("a", 1, two_way, nothing), Ok((a, None)), "its own session");
        assert_eq!(t.admit_message("a", 2, two_way, nothing), Err(FrameRefused::StaleSession { got: 2, current: 1 }));
        let (inc, gone) = t.admit_message("a", 2, one_way, nothing).unwrap();
        assert!(inc != a && gone.is_none());
        assert_eq!((t.incarnation("a", 2), t.name(inc)), (Some(inc), Some("a")));
        assert_eq!(t.admit_message("a", 2, one_way, nothing), Ok((inc, None)), "the same id for its flows");
        let (other, _) = t.admit_message("a", 3, one_way, nothing).unwrap();
        assert!(other != inc && other != a, "one id per session");
        assert_eq!(t.admit("a", 1), Ok(a));
        assert!(t.can_bounce("a") && t.bounce_peers() == 1, "the loaded peer is untouched");
        // Not for a name that is not loaded (that is admit_one_way's), nor under its own session.
        assert_eq!(t.admit_incarnation("x", 2), Err(FrameRefused::NotLoaded));
        assert_eq!(t.admit_incarnation("a", 1), Err(FrameRefused::NotLoaded));
        // The cap counts them with the one-way names; an idle one gives way, a busy one never.
        for i in 0..MAX_ONE_WAY_NAMES - 2 {
            t.admit_one_way(&format!("junk-{i}")).unwrap();
        }
        assert_eq!(t.admit_message("a", 4, one_way, nothing), Err(FrameRefused::NotLoaded), "full, all busy");
        let (fourth, gone) = t.admit_message("a", 4, one_way, |id| id == other).unwrap();
        assert_eq!(gone, Some(other));
        assert!(t.incarnation("a", 3).is_none() && t.name(other).is_none() && t.incarnation("a", 4) == Some(fourth));
        // NIXL reloads the agent with session 2: it adopts that incarnation's id.
        assert_eq!(t.load_replaces("a", Some(&Capabilities { session: 2, ..caps(4096) })), Some(a));
        t.load_conn_info("a", Some(Capabilities { session: 2, ..caps(4096) }), Some(&caps(4096)));
        assert_eq!((t.lookup("a"), t.incarnation("a", 2), t.name(a)), (Some(inc), None, None));
        assert_eq!(t.admit_message("a", 2, two_way, nothing), Ok((inc, None)));
        assert_eq!(t.bounce_peers(), 0, "a new incarnation is asked about again");
    }

    #[test]
    fn loading_records_capabilities_only_when_compatible() {
        let mut t = PeerTable::new();
        assert_eq!(t.load_conn_info("a", Some(caps(4096)), Some(&caps(4096))), Loaded::Compatible);
        let zmq = Capabilities { control: ControlKind::Zmq, ..caps(4096) };
        assert_eq!(
            t.load_conn_info("b", Some(zmq), Some(&caps(4096))),
            Loaded::Incompatible(Incompatible::ControlKind { local: ControlKind::Ucx, peer: ControlKind::Zmq })
        );
        assert_eq!(t.load_conn_info("c", None, Some(&caps(4096))), Loaded::NoCapabilities);
        assert_eq!(t.load_conn_info("d", Some(caps(4096)), None), Loaded::NoCapabilities);
        assert_eq!(t.compatible("a").map(|c| c.arenas.first().len), Some(0x1_0000));
        for n in ["b", "c", "d"] {
            assert!(t.is_loaded(n) && t.compatible(n).is_none(), "{n}");
        }
        assert!(!t.is_loaded("e"));
    }

    #[test]
    fn can_bounce_needs_loaded_compatible_arena_and_hello() {
        assert!(ready("a").can_bounce("a"));
        let mut t = PeerTable::new();
        t.load_conn_info("a", Some(caps(4096)), Some(&caps(4096)));
        assert!(!t.can_bounce("a"), "no arena, no HELLO");
        t.arena_loaded("a", true);
        assert_eq!(t.hello("a", 1, tag0()), Hello::Ask);
        assert!(!t.can_bounce("a"), "a HELLO alone counts for nothing: it is asked about");
        assert!(t.confirm_hello("a", Token(0)));
        assert_eq!(t.hello("a", 1, tag0()), Hello::Repeat, "the load confirmed");
        let reload = crate::forget::load_tag(Token(1));
        assert_eq!(t.hello("a", 1, reload), Hello::Reloaded, "another load of ours: ask again");
        assert!(t.confirm_hello("a", Token(1)), "its PONG brings the new load's secret");
        assert_eq!((t.hello("a", 1, reload), t.hello("a", 1, tag0())), (Hello::Repeat, Hello::Reloaded));
        assert!(t.confirm_hello("a", Token(0)));
        t.arena_loaded("a", false);
        assert!(!t.can_bounce("a"), "arena load failed");
        t.arena_loaded("a", true);
        assert!(t.can_bounce("a"));
        assert_eq!(t.bounce_peers(), 1);
        // An incompatible peer's arena never counts, whatever the shell reports.
        t.load_conn_info("b", Some(Capabilities { control: ControlKind::Zmq, ..caps(4096) }), Some(&caps(4096)));
        t.arena_loaded("b", true);
        assert_eq!(t.hello("b", 1, tag0()), Hello::Unusable, "nothing to ask an incompatible peer");
        assert!(!t.confirm_hello("b", Token(0)) && !t.can_bounce("b"));
        // HELLO without loading: dropped, nothing recorded, nothing to confirm.
        assert_eq!(t.hello("c", 1, tag0()), Hello::NotLoaded);
        assert!(!t.confirm_hello("c", Token(0)) && !t.is_reachable("c") && t.lookup("c").is_none());
        // Loss forgets everything but the id.
        t.lost("a");
        assert!(!t.can_bounce("a") && !t.is_reachable("a") && !t.is_loaded("a"));
        assert_eq!(t.bounce_peers(), 0);
    }

    #[test]
    fn the_session_is_the_loaded_capabilities_one_and_only_a_reload_changes_it() {
        let mut t = ready("a");
        let a = t.lookup("a").unwrap();
        assert_eq!(t.session("a"), Some(1), "from the loaded capabilities, before any frame");
        assert_eq!(t.admit("a", 1), Ok(a));
        // Another session is refused whatever the frame (a WANT no longer resets the peer).
        assert_eq!(t.admit("a", 8), Err(FrameRefused::StaleSession { got: 8, current: 1 }));
        assert_eq!(t.session("a"), Some(1), "a refused frame changes nothing");
        assert!(t.can_bounce("a"));
        // A reload with the same session replaces nothing; one with a new session replaces
        // the old incarnation, and only then is the new session admitted.
        assert_eq!(t.load_replaces("a", Some(&caps(4096))), None);
        let new = Capabilities { session: 8, ..caps(4096) };
        assert_eq!(t.load_replaces("a", Some(&new)), Some(a));
        assert_eq!(t.load_conn_info("a", Some(new), Some(&caps(4096))), Loaded::Compatible);
        let a8 = t.lookup("a").unwrap();
        assert_ne!(a8, a, "a new incarnation, a new id");
        assert_eq!(t.admit("a", 8), Ok(a8));
        assert_eq!(t.admit("a", 1), Err(FrameRefused::StaleSession { got: 1, current: 8 }));
        // Reloaded without capabilities: the old incarnation is replaced, and the peer has no
        // session left to send message frames with.
        assert_eq!(t.load_replaces("a", None), Some(a8));
        t.load_conn_info("a", None, None);
        assert_eq!(t.admit("a", 8), Err(FrameRefused::NoSession));
        // After a loss nothing is replaced: the loss reclaimed everything already.
        t.lost("a");
        assert_eq!(t.load_replaces("a", Some(&caps(4096))), None);
        assert_eq!(t.admit("a", 1), Err(FrameRefused::NotLoaded));
    }

    #[test]
    fn frames_from_an_agent_never_loaded_are_refused_and_leave_nothing_behind() {
        let mut t = PeerTable::new();
        assert_eq!(t.admit("x", 1), Err(FrameRefused::NotLoaded));
        // No entry: no id, no session (a stream of invented names cannot grow the table).
        assert_eq!((t.lookup("x"), t.session("x")), (None, None));
        assert_eq!(t.admit("x", 2), Err(FrameRefused::NotLoaded));
        // An incompatible peer is loaded: it may talk to us (to refuse bounce politely), with
        // the session its capabilities carry.
        t.load_conn_info("x", Some(caps(1)), Some(&caps(2)));
        let x = t.lookup("x").expect("loaded now");
        assert_eq!(t.admit("x", 1), Ok(x));
        // Lost again: refused again, and its session is forgotten.
        t.lost("x");
        assert_eq!(t.admit("x", 1), Err(FrameRefused::NotLoaded));
        assert_eq!(t.session("x"), None);
    }

    #[test]
    fn hellos_from_names_not_loaded_leave_nothing_and_cannot_lock_a_real_peer_out() {
        let mut t = PeerTable::new();
        // A real peer's HELLO arrives before we load it, then thousands of invented names.
        assert_eq!(t.hello("real", 1, tag0()), Hello::NotLoaded);
        for i in 0..4096 {
            assert_eq!(t.hello(&format!("stranger-{i}"), 1, tag0()), Hello::NotLoaded);
        }
        assert_eq!(t.lookup("real"), None, "no table entry, no id");
        assert_eq!(t.lookup("stranger-0"), None);
        // Loaded now: no HELLO yet. Our HELLO on load makes it say HELLO again, which is asked
        // about whatever the flood, and counts once answered.
        t.load_conn_info("real", Some(caps(4096)), Some(&caps(4096)));
        t.arena_loaded("real", true);
        assert!(!t.can_bounce("real"));
        assert_eq!(t.hello("real", 1, tag0()), Hello::Ask);
        assert!(t.confirm_hello("real", Token(0)) && t.can_bounce("real"));
        assert_eq!(t.hello("real", 1, tag0()), Hello::Repeat);
        // A loss forgets the HELLO: after a reload it is asked about again.
        t.lost("real");
        assert_eq!(t.hello("real", 1, tag0()), Hello::NotLoaded, "not loaded any more");
        t.load_conn_info("real", Some(caps(4096)), Some(&caps(4096)));
        assert!(!t.is_reachable("real"));
        assert_eq!(t.hello("real", 1, tag0()), Hello::Ask);
    }

    /// Anyone may claim a name and copy a published session: a HELLO under a loaded peer's
    /// name counts only under that peer's session, and then only once the peer answers the ask
    /// (the endpoint's PING, which a forger never sees). A forged one would switch our route to
    /// the peer from one way to two way, whose frames a peer that never loaded us drops.
    #[test]
    fn a_hello_counts_only_under_the_peers_own_session_and_once_confirmed() {
        let mut t = PeerTable::new();
        let one_way = Capabilities { session: 7, ..caps(4096) };
        t.load_conn_info("p", Some(one_way.clone()), Some(&caps(4096)));
        t.arena_loaded("p", true);
        assert_eq!(t.hello("p", 8, tag0()), Hello::Stale { current: Some(7) });
        assert_eq!(t.hello("p", 8, tag0()).refusal(8), Some(FrameRefused::StaleSession { got: 8, current: 7 }));
        assert!(!t.can_bounce("p") && !t.is_reachable("p"), "nothing recorded");
        // The right session only opens an ask; a forger's HELLO gets this far and no further.
        for _ in 0..3 {
            assert_eq!(t.hello("p", 7, tag0()), Hello::Ask);
            assert!(!t.can_bounce("p"));
        }
        assert!(t.confirm_hello("p", Token(0)) && t.can_bounce("p"));
        // A GOODBYE (confirmed by the endpoint) forgets it: asked about again afterwards.
        let id = t.lookup("p").unwrap();
        assert_eq!(t.goodbye("p", 7), Ok(id));
        assert_eq!(t.hello("p", 7, tag0()), Hello::Ask);
        // A reload with a new session forgets it too.
        t.confirm_hello("p", Token(0));
        t.load_conn_info("p", Some(Capabilities { session: 9, ..one_way }), Some(&caps(4096)));
        assert!(!t.is_reachable("p"));
        assert_eq!(t.hello("p", 9, tag0()), Hello::Ask);
    }

    /// Junk frames under thousands of invented names fill the one-way names; a real
    /// initiator is still admitted, in place of a name that holds nothing, and a name that
    /// holds something is never forgotten.
    #[test]
    fn invented_one_way_names_cannot_lock_a_real_initiator_out() {
        let mut t = PeerTable::new();
        let busy = t.admit_one_way("busy").unwrap();
        for i in 0..MAX_ONE_WAY_NAMES - 1 {
            t.admit_one_way(&format!("junk-{i}")).unwrap();
        }
        assert_eq!(t.admit_one_way("real"), Err(FrameRefused::NotLoaded), "full");
        // Only "busy" holds something: one of the junk names goes.
        let gone = t.evict_one_way(|id| id != busy).expect("an idle name");
        assert_ne!(gone, busy);
        assert_eq!(t.name(gone), None, "forgotten with its id");
        let real = t.admit_one_way("real").unwrap();
        assert!(real != gone && t.lookup("busy") == Some(busy));
        // Nothing to forget when every name holds something.
        assert_eq!(t.evict_one_way(|_| false), None);
        // A one-way name loaded since is not forgotten, and leaves the one-way names.
        t.load_conn_info("real", Some(caps(4096)), Some(&caps(4096)));
        assert_eq!(t.evict_one_way(|id| id == real), None);
        assert_eq!(t.lookup("real"), Some(real));
        assert!(t.admit_one_way("another").is_ok(), "its place in the one-way names is free");
    }

    /// Review 59 (wire, L3): the one-way names full, one of them loaded since, every other
    /// holding something: a frame under a new name is admitted in the loaded name's place,
    /// and nobody is evicted. (It was refused: the loaded name left, but no victim was found.)
    #[test]
    fn a_one_way_name_loaded_since_makes_room_without_an_eviction() {
        let mut t = PeerTable::new();
        for i in 0..MAX_ONE_WAY_NAMES {
            t.admit_one_way(&format!("busy-{i}")).unwrap();
        }
        t.load_conn_info("busy-7", Some(caps(4096)), Some(&caps(4096)));
        let (id, gone) = t.admit_message("newcomer", 5, |_| true, |_| false).expect("room made by the loaded name");
        assert_eq!((t.lookup("newcomer"), gone), (Some(id), None), "admitted, nobody evicted");
        assert!((0..MAX_ONE_WAY_NAMES).all(|i| t.lookup(&format!("busy-{i}")).is_some()));
    }

    /// A one-way name is the sender's to choose, its length too: one longer than any agent
    /// name we take is never kept (a name at the limit is), and, the names full, forgets none
    /// to make room for itself (it would not be kept anyway).
    #[test]
    fn an_overlong_one_way_name_is_not_admitted() {
        let mut t = PeerTable::new();
        let long = "n".repeat(MAX_NAME_LEN + 1);
        assert_eq!(t.admit_one_way(&long), Err(FrameRefused::NotLoaded));
        assert_eq!(t.one_way.len(), 0);
        assert!(t.admit_one_way(&"n".repeat(MAX_NAME_LEN)).is_ok());
        for i in 1..MAX_ONE_WAY_NAMES {
            t.admit_one_way(&format!("idle-{i}")).unwrap();
        }
        assert_eq!(t.admit_message(&long, 1, |_| true, |_| true), Err(FrameRefused::NotLoaded));
        assert_eq!(t.one_way.len(), MAX_ONE_WAY_NAMES, "nothing forgotten for it");
    }

    /// The incarnation a reload adopts wins over an entry of the name never loaded (one-way
    /// flows a third agent opened under it after the name was lost go with it, reclaimed by
    /// its id); and a load the inner engine refuses gives the incarnation back, its id and
    /// flows kept, while a refused load without a session is reclaimed as lost.
    #[test]
    fn a_reload_adopts_its_incarnation_over_any_entry_and_a_refused_load_gives_it_back() {
        let (one_way, nothing) = (|_: Option<PeerId>| true, |_: PeerId| false);
        let mut t = ready("a");
        let (inc, _) = t.admit_message("a", 2, one_way, nothing).unwrap();
        t.lost("a");
        let (stranger, _) = t.admit_message("a", 3, one_way, nothing).unwrap();
        assert_ne!(stranger, inc);
        assert_eq!(t.admit_message("a", 2, one_way, nothing), Ok((inc, None)), "its flows still go to it");
        let s2 = Capabilities { session: 2, ..caps(4096) };
        assert_eq!(t.load_replaces("a", Some(&s2)), Some(stranger));
        t.load_conn_info("a", Some(s2.clone()), Some(&caps(4096)));
        assert_eq!((t.lookup("a"), t.incarnation("a", 2), t.name(stranger)), (Some(inc), None, None));
        assert_eq!(t.admit_message("a", 2, |_| false, nothing), Ok((inc, None)), "one, loaded");
        // The inner engine refuses the load: back to a one-way incarnation, nothing to reclaim.
        assert_eq!(t.load_failed("a"), None);
        assert_eq!((t.lookup("a"), t.incarnation("a", 2), t.name(inc)), (None, Some(inc), Some("a")));
        assert_eq!(t.admit_message("a", 2, one_way, nothing), Ok((inc, None)));
        // Loaded again, it adopts it again.
        t.load_conn_info("a", Some(s2), Some(&caps(4096)));
        assert_eq!(t.lookup("a"), Some(inc));
        // A refused load with no session is reclaimed as lost; a name not loaded has nothing.
        t.load_conn_info("b", None, None);
        let b = t.lookup("b").unwrap();
        assert_eq!((t.load_failed("b"), t.lookup("b"), t.load_failed("c")), (Some(b), None, None));
    }

    #[test]
    fn credits_must_stay_inside_the_region_and_the_peer_arena() {
        let t = ready("a");
        let a = t.lookup("a").unwrap();
        let len = 0x1_0000; // the arena length in `caps`
        let ok = |offset, rlen, n| t.check_credit(a, ArenaId(0), Region { offset, len: rlen }, n);
        assert_eq!(ok(0, 4096, 4096), Ok(()));
        assert_eq!(ok(len - 4096, 4096, 4096), Ok(()), "ends exactly at the arena's end");
        assert_eq!(ok(len - 4096, 8192, 4096), Ok(()), "a region may be longer than the write");
        let outside = |offset, rlen, n| {
            Err(CreditRefused::OutsideArena { peer: a, region: Region { offset, len: rlen }, len: n, arena_len: len })
        };
        assert_eq!(ok(len - 4095, 4096, 4096), outside(len - 4095, 4096, 4096));
        assert_eq!(ok(0, 2048, 4096), outside(0, 2048, 4096), "longer than the granted region");
        assert_eq!(ok(u64::MAX, 4096, 1), outside(u64::MAX, 4096, 1), "wraps the address space");
        assert_eq!(
            t.check_credit(PeerId(99), ArenaId(0), Region { offset: 0, len: 1 }, 1),
            Err(CreditRefused::UnknownPeer(PeerId(99)))
        );
        let mut t = t;
        t.arena_loaded("a", false);
        assert_eq!(t.check_credit(a, ArenaId(0), Region { offset: 0, len: 1 }, 1), Err(CreditRefused::NoArena(a)));
    }

    /// A credit is checked against the arena its flow's WANT named: each of a peer's arenas
    /// has its own length, and an arena the peer did not advertise takes no write.
    #[test]
    fn credits_are_checked_against_the_arena_they_lie_in() {
        let mut t = PeerTable::new();
        let mut theirs = caps(4096);
        let small = crate::wire::ArenaCaps { len: 0x4000, ..theirs.arenas.first().clone() };
        theirs.arenas = crate::wire::Arenas::new(vec![theirs.arenas.first().clone(), small]).unwrap();
        t.load_conn_info("b", Some(theirs), Some(&caps(4096)));
        t.arena_loaded("b", true);
        let b = t.lookup("b").unwrap();
        let region = Region { offset: 0x8000, len: 4096 };
        assert_eq!(t.check_credit(b, ArenaId(0), region, 4096), Ok(()));
        assert!(matches!(
            t.check_credit(b, ArenaId(1), region, 4096),
            Err(CreditRefused::OutsideArena { arena_len: 0x4000, .. })
        ));
        assert_eq!(t.check_credit(b, ArenaId(1), Region { offset: 0x3000, len: 4096 }, 4096), Ok(()));
        assert_eq!(t.check_credit(b, ArenaId(2), Region { offset: 0, len: 1 }, 1), Err(CreditRefused::NoArena(b)));
    }

    /// Every change a peer can go through, with the agent it is for (of three) and, for loads
    /// and GOODBYEs, the session.
    #[derive(Debug, Clone)]
    enum Op {
        Load(usize, Option<u64>),
        LoadIncompatible(usize),
        Arena(usize, bool),
        Hello(usize, u64, u128),
        Confirm(usize, u128),
        Forget(usize, u64, u128),
        Goodbye(usize, u64),
        Lost(usize),
        OneWay(usize),
        Incarnation(usize, u64),
        LoadFailed(usize),
    }

    fn op() -> impl proptest::strategy::Strategy<Value = Op> {
        use proptest::prelude::*;
        let who = 0..3usize;
        let session = prop_oneof![Just(1u64), Just(2u64)];
        prop_oneof![
            (who.clone(), proptest::option::of(session.clone())).prop_map(|(w, s)| Op::Load(w, s)),
            who.clone().prop_map(Op::LoadIncompatible),
            (who.clone(), any::<bool>()).prop_map(|(w, ok)| Op::Arena(w, ok)),
            (who.clone(), session.clone(), 0..2u128).prop_map(|(w, s, k)| Op::Hello(w, s, k)),
            (who.clone(), 0..2u128).prop_map(|(w, k)| Op::Confirm(w, k)),
            (who.clone(), session.clone(), 0..2u128).prop_map(|(w, s, k)| Op::Forget(w, s, k)),
            (who.clone(), session).prop_map(|(w, s)| Op::Goodbye(w, s)),
            who.clone().prop_map(Op::Lost),
            who.clone().prop_map(Op::OneWay),
            (who.clone(), 1..4u64).prop_map(|(w, s)| Op::Incarnation(w, s)),
            who.prop_map(Op::LoadFailed),
        ]
    }

    proptest::proptest! {
        /// The count of peers that can bounce, kept as the table changes, is always what a
        /// pass over the table counts, whatever the order of loads, arenas, HELLOs, GOODBYEs
        /// (accepted or refused), FORGETs (proven or not), losses and one-way admissions (of
        /// incarnations too). And ids
        /// and names stay one to one: every name's id names it back, and no id goes by two names.
        #[test]
        fn the_ready_count_always_equals_a_recount(ops in proptest::collection::vec(op(), 0..64)) {
            let names = ["a", "b", "c"];
            let mut t = PeerTable::new();
            for op in ops {
                match op {
                    Op::Load(w, session) => {
                        let theirs = session.map(|s| Capabilities { session: s, ..caps(4096) });
                        let _ = t.load_conn_info(names[w], theirs, Some(&caps(4096)));
                    }
                    Op::LoadIncompatible(w) => {
                        let _ = t.load_conn_info(names[w], Some(caps(4096)), Some(&caps(8192)));
                    }
                    Op::Arena(w, ok) => t.arena_loaded(names[w], ok),
                    Op::Hello(w, s, k) => {
                        // A confirmed peer's HELLO is a repeat only for the load confirmed.
                        let held = t.by_name.get(names[w]).and_then(|p| p.hello);
                        let tag = crate::forget::load_tag(Token(k));
                        match t.hello(names[w], s, tag) {
                            Hello::Repeat => proptest::prop_assert_eq!(held, Some(Token(k))),
                            Hello::Reloaded => proptest::prop_assert!(held.is_some_and(|h| h != Token(k))),
                            Hello::Ask => proptest::prop_assert_eq!(held, None),
                            _ => {}
                        }
                    }
                    Op::Confirm(w, k) => {
                        let _ = t.confirm_hello(names[w], Token(k));
                    }
                    Op::Forget(w, s, k) => {
                        // Only the secret of the confirming PONG, under the loaded session,
                        // undoes a HELLO; the peer stays loaded under its id.
                        let before = (t.can_bounce(names[w]), t.lookup(names[w]), t.is_loaded(names[w]));
                        let held = t.by_name.get(names[w]).and_then(|p| p.hello);
                        match t.forgot_us(names[w], s, Token(k)) {
                            Ok(Forgot::Us(id)) => {
                                proptest::prop_assert_eq!(held, Some(Token(k)));
                                proptest::prop_assert_eq!(Some(id), before.1);
                                proptest::prop_assert!(!t.is_reachable(names[w]) && t.is_loaded(names[w]));
                            }
                            _ => {
                                let after = (t.can_bounce(names[w]), t.lookup(names[w]), t.is_loaded(names[w]));
                                proptest::prop_assert_eq!(before, after);
                            }
                        }
                    }
                    Op::Goodbye(w, s) => {
                        let _ = t.goodbye(names[w], s);
                    }
                    Op::Lost(w) => {
                        let _ = t.lost(names[w]);
                    }
                    Op::OneWay(w) => {
                        let _ = t.admit_one_way(names[w]);
                    }
                    Op::Incarnation(w, s) => {
                        let _ = t.admit_message(names[w], s, |_| true, |_| true);
                    }
                    Op::LoadFailed(w) => {
                        let _ = t.load_failed(names[w]);
                    }
                }
                let recount = names.iter().filter(|n| t.can_bounce(n)).count();
                proptest::prop_assert_eq!(t.bounce_peers(), recount);
                for (name, p) in &t.by_name {
                    proptest::prop_assert_eq!(t.name(p.id), Some(name.as_str()));
                }
                for ((name, _), id) in &t.incarnations {
                    proptest::prop_assert_eq!(t.name(*id), Some(name.as_str()));
                    proptest::prop_assert!(t.by_name.values().all(|p| p.id != *id));
                }
                proptest::prop_assert_eq!(t.names.len(), t.by_name.len() + t.incarnations.len());
            }
        }
    }
}
