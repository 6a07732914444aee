//! The engine's protocol endpoint: the one object the IO shell drives (quinn-proto's
//! `Endpoint`/`Connection` shape, STYLE.md §3), plus the event types both roles share.
//!
//! An [`Endpoint`] owns one [`CreditScheduler`] per arena (each arena serves both directions,
//! design §2; an engine has one, or one per memory place it bounces through: docs/arenas.md,
//! [`add_arena`](Endpoint::add_arena)), the [`Sender`] role (transfers this engine submits) and the
//! [`Receiver`] role (transfers peers write into this engine). It routes inputs to the right
//! role and collects their outputs as [`Action`]s. It does not move bytes, send messages or read
//! the clock: the shell performs the actions, reports their completion back through the
//! `handle_*_done` methods, and passes `now` into every call.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use thiserror::Error;
use tracing::{debug, trace};

use crate::config::{Config, ConfigError};
use crate::event::Ctx;
// The shared event types live in `event`; re-exported here, where the shell has always found them.
pub use crate::event::{
    Action, DataFault, InRegionPlan, JobId, JobRuns, ProtocolError, Stats, SubmitError, WriteSource, XferError,
};
use crate::hello::HelloAsks;
use crate::liveness::{Liveness, LivenessConfig};
use crate::mailbox::{FailReason, MailboxLayout};
use crate::oneway::{Answering, HoldError, OneWayLayout, OneWayRefused, Read, Reading};
use crate::peers::{Forgot, FrameRefused, Hello, Loaded, PeerTable};
use crate::plan::Plan;
use crate::proof::BadProof;
use crate::receiver::Receiver;
use crate::scheduler::arenas::ArenaSchedulers;
use crate::scheduler::{CreditScheduler, SchedError};
use crate::sender::{Sender, WantShape};
use crate::types::{ArenaId, FlowKey, PeerId, RegId, RegKey, Token, XferId};
use crate::wire;

/// What a closing engine mixes into the nonce of a PING it answers ("goodbye!"): the PONG then
/// confirms its GOODBYE. Public, but of use only to whoever saw the PING's nonce, the peer.
pub const FAREWELL: u64 = 0x676f_6f64_6279_6521;

/// Shortest gap between two PINGs that ask a peer about GOODBYEs heard under its name
/// ([`Endpoint::handle_goodbye_said`]): a flood of forged GOODBYEs costs at most ten PINGs a
/// second per peer, and a closing engine waits 200 ms for the first.
pub const GOODBYE_ASK_GAP: Duration = Duration::from_millis(100);

/// What a PONG meant ([`Endpoint::handle_pong`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub enum Pong {
    /// The farewell answer to the PING that asked about the peer's GOODBYE: it is going away;
    /// forget its arena, then call [`Endpoint::handle_goodbye`].
    Farewell,
    /// The answer to the PING that asked about the peer's HELLO: it loaded us, and its HELLO
    /// counts now ([`PeerTable::confirm_hello`]).
    Hello,
    /// A liveness answer, or nothing we asked (ignored).
    Other,
}

/// How a WRITE is answered and what its WANT carries ([`Endpoint::submit_write`]).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct WriteRoute {
    /// Answers through this mailbox of the target's (one way: it may never have loaded our
    /// metadata); `None`: GRANT and ACK frames.
    pub mailbox: Option<MailboxLayout>,
    /// The shell's gather of the plan's one chunk, to ride in the WANT when it may
    /// ([`wire::Inline`]).
    pub inline: Option<Vec<u8>>,
    /// Neither claims nor opens our standing flow at the target ([`wire::Standing`]): the
    /// shell says so for a write into a GPU arena of the target's, where a standing region
    /// would hold GPU memory that the small host-memory writes it serves could not claim.
    pub no_standing: bool,
}

impl WriteRoute {
    /// Two way, with the plan's one chunk `bytes` to carry inline.
    pub fn inline(bytes: Vec<u8>) -> Self {
        Self { inline: Some(bytes), ..Self::default() }
    }
}

/// Why an [`Endpoint`] cannot be built.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum EndpointError {
    /// The configuration does not validate.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The scheduler rejected the arena geometry or window.
    #[error(transparent)]
    Sched(#[from] SchedError),
    /// An arena past the most an engine may have ([`crate::types::MAX_ARENAS`]).
    #[error("an engine has at most {} arenas", crate::types::MAX_ARENAS)]
    TooManyArenas,
}

/// Builds a [`Ctx`] from an endpoint's disjoint fields, so a role can borrow them while the
/// endpoint lends out the role itself.
macro_rules! ctx {
    ($ep:ident, $now:expr) => {
        Ctx {
            now: $now,
            scheds: &mut $ep.scheds,
            out: &mut $ep.out,
            next_job: &mut $ep.next_job,
            stats: &mut $ep.stats,
        }
    };
}

/// Protocol state and logic of one BOUNCE engine: its sender and receiver roles over its
/// arenas, each shared by both roles.
///
/// # Driving it
/// - Commands: [`submit`](Self::submit), [`cancel`](Self::cancel), [`shutdown`](Self::shutdown),
///   [`set_local_endpoint`](Self::set_local_endpoint),
///   [`add_registered`](Self::add_registered) / [`remove_registered`](Self::remove_registered).
/// - Inputs: [`handle_msg`](Self::handle_msg) for every decoded control message,
///   `handle_{gather,write,scatter}_done` for every job of an [`Action`],
///   [`handle_peer_lost`](Self::handle_peer_lost), and [`handle_timeout`](Self::handle_timeout)
///   once [`poll_timeout`](Self::poll_timeout) has passed.
/// - Outputs: after *every* command or input, drain [`poll_action`](Self::poll_action) until it
///   returns `None`, then re-arm the wakeup from [`poll_timeout`](Self::poll_timeout).
///
/// Every call takes `now`; it must not go backwards. The endpoint never reads a clock.
///
/// # Guarantees
/// - Each accepted transfer gets exactly one [`Action::Complete`]; none hangs: any stall ends
///   after `request_timeout` without progress.
/// - A region is freed only when nothing can still touch it: a failed transfer's staging region
///   with a gather or write in flight is an *orphan* until that job's done-event; a scattering
///   region of a reclaimed flow is freed by its scatter's done-event. A cancel (empty WANT) is
///   sent only once every write of the transfer has completed, so the receiver's reclaim never
///   frees a region a write may still land in.
/// - Peer input never panics; bad input is a [`ProtocolError`] and changes nothing unsafely.
///
/// Receiver-side staleness: a remote flow holding granted regions without WANT, DATA, KEEP or a
/// new grant for half the `request_timeout` is reclaimed (its sender is presumed dead or
/// stuck), so a long-running receiver never leaks regions and a silent peer cannot hold the
/// arena long enough to time out everyone else's transfers. The sender only posts a write
/// within a quarter `request_timeout` of receiving its credit, and while a write of its is in
/// flight for longer than an eighth it sends the flow a KEEP every eighth ([`wire::Keep`]), so
/// a slow write never lands in a region reclaimed (and granted again) under it; a sender that
/// is truly silent sends none. A dead one is declared so by the liveness probe. Should KEEPs be
/// lost, or a live peer be declared dead, the regions reclaimed rest in quarantine for a
/// quarter `request_timeout` before they are granted again ([`Reuse::After`]): a late write
/// lands where nobody reads. A cancel frees at once (it follows the transfer's writes), and
/// ends the quarantine of a flow reclaimed before it came.
///
/// [`Reuse::After`]: crate::scheduler::Reuse::After
#[derive(Debug)]
pub struct Endpoint {
    /// One scheduler per arena; the first is the one [`new`](Self::new) makes.
    scheds: ArenaSchedulers,
    /// The per-flow window `W` every arena's scheduler keeps.
    window: u32,
    sender: Sender,
    receiver: Receiver,
    out: VecDeque<Action>,
    next_job: u64,
    stats: Stats,
    peers: PeerTable,
    liveness: Liveness,
    /// What the forget secrets in our PONGs derive from ([`crate::forget`]).
    forget_key: [u8; 32],
    /// Scratch: the peers waited on, rebuilt after every input for the liveness probe.
    waited: BTreeSet<PeerId>,
    /// [`close`](Self::close) was called: nothing more is granted, and a PING is answered
    /// with the farewell PONG (see [`FAREWELL`]).
    closing: bool,
    /// GOODBYEs heard and not yet answered: the nonce of the PING that asks each peer, and
    /// when it was last sent (one open ask per peer, see
    /// [`handle_goodbye_said`](Self::handle_goodbye_said)).
    goodbyes: BTreeMap<PeerId, (u64, Instant)>,
    /// HELLOs heard and not yet confirmed: the PINGs that ask each peer (see [`crate::hello`]).
    hellos: HelloAsks,
    /// One-way flows into us, answered through our mailbox (see [`crate::oneway`]).
    answering: Answering,
    /// Our one-way transfers, whose answers we read from the targets' mailboxes.
    reading: Reading,
    /// Where our mailbox and fetch area lie, in our offsets (past the arena's scheduled part).
    one_way: OneWayLayout,
    /// Scratch for [`handle_fetched`](Self::handle_fetched).
    reads: Vec<Read>,
    /// Who answers a PING, when the peer table that knows is not ours (see
    /// [`set_ping_answerers`](Self::set_ping_answerers)).
    answers_pings: PingAnswerers,
    /// Transfers held back behind a cancel of ours still waiting for its writes (see `deferred`).
    deferred: deferred::Deferred,
    /// Peers declared dead since the shell last asked ([`take_declared_dead`](Self::take_declared_dead));
    /// a set, so one that is not asked keeps one entry per peer.
    declared_dead: BTreeSet<PeerId>,
}

/// The shell's view of which peers answer a PING ([`Endpoint::set_ping_answerers`]).
#[derive(Default)]
struct PingAnswerers(Option<Box<dyn Fn(PeerId) -> bool + Send>>);

impl PingAnswerers {
    /// `None`: the endpoint's own peer table knows.
    fn as_ref(&self) -> Option<&(dyn Fn(PeerId) -> bool + Send)> {
        self.0.as_deref()
    }
}

impl std::fmt::Debug for PingAnswerers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() { "PingAnswerers(shell)" } else { "PingAnswerers(own table)" })
    }
}

impl Endpoint {
    /// An idle endpoint over an arena of [`Config::arena_usable_capacity`] bytes with the
    /// configured granularity and window.
    ///
    /// `probe_key` is the secret the PING nonces (the liveness probe's, a GOODBYE's or a
    /// HELLO's ask) and the forget secrets our PONGs carry derive from. The caller draws it at
    /// random, once per engine: a nonce others could predict would let them forge a PONG (keep
    /// a dead peer alive, confirm a forged HELLO), and a secret they could derive would let
    /// them forge our FORGET. The core has no randomness of its own, so there is no default.
    ///
    /// # Errors
    /// [`EndpointError::Config`] when `config` does not validate; [`EndpointError::Sched`]
    /// for a geometry the scheduler refuses.
    pub fn new(config: &Config, now: Instant, probe_key: [u8; 32]) -> Result<Self, EndpointError> {
        config.validate()?;
        let mut sched =
            CreditScheduler::new(config.arena_usable_capacity(), config.arena_granularity, config.max_inflight_chunks)?;
        sched.limit_chunks(config.max_chunk_size);
        Ok(Self {
            scheds: ArenaSchedulers::new(sched),
            window: config.max_inflight_chunks,
            sender: Sender::new(config, now),
            receiver: Receiver::new(config, now),
            out: VecDeque::new(),
            next_job: 0,
            stats: Stats::default(),
            peers: PeerTable::new(),
            forget_key: crate::forget::key(&probe_key),
            liveness: Liveness::new(
                LivenessConfig { probe_after: config.probe_after, dead_after: config.peer_dead_after },
                probe_key,
            ),
            waited: BTreeSet::new(),
            closing: false,
            goodbyes: BTreeMap::new(),
            hellos: HelloAsks::new(),
            answering: Answering::new(None, 0, config.request_timeout),
            reading: Reading::default(),
            one_way: OneWayLayout::for_config(config),
            reads: Vec::new(),
            answers_pings: PingAnswerers::default(),
            deferred: deferred::Deferred::default(),
            declared_dead: BTreeSet::new(),
        })
    }

    /// Starts transfer `xfer` of `plan` to `peer`: queues its WANT and, with eager gather, the
    /// gathers of its first chunks (up to `W` and the eager half-arena budget). `token` is the
    /// transfer's secret: 128 bits the shell draws from a CSPRNG for each transfer (the core
    /// never draws randomness); the peer must echo it in every GRANT and ACK.
    ///
    /// # Errors
    /// A [`SubmitError`]; then nothing was queued and no [`Action::Complete`] will follow.
    pub fn submit(
        &mut self,
        now: Instant,
        xfer: XferId,
        token: Token,
        peer: PeerId,
        plan: impl Into<Arc<Plan>>,
    ) -> Result<(), SubmitError> {
        self.submit_write(now, xfer, token, peer, plan, WriteRoute::default())
    }

    /// Starts WRITE `xfer` as [`submit`](Self::submit) (two way) or
    /// [`submit_one_way`](Self::submit_one_way) (with [`WriteRoute::mailbox`]). With
    /// [`WriteRoute::inline`], the shell's gather of the plan's one chunk: when the plan is a
    /// single chunk of exactly those bytes, at most [`inline_bytes`](Self::inline_bytes), they
    /// ride in the WANT ([`wire::Inline`]) and the target may answer with the ACK alone;
    /// otherwise the bytes are dropped and the transfer goes the usual way.
    ///
    /// # Errors
    /// As [`submit`](Self::submit).
    ///
    /// A WRITE to a peer that a cancel of ours still waits to reach (a failed or released
    /// transfer's writes are in flight) starts only once that cancel is out, so the target
    /// learns of the release first and scatters this WRITE's bytes after the released one's
    /// (see `deferred`).
    pub fn submit_write(
        &mut self,
        now: Instant,
        xfer: XferId,
        token: Token,
        peer: PeerId,
        plan: impl Into<Arc<Plan>>,
        route: WriteRoute,
    ) -> Result<(), SubmitError> {
        self.submit_or_hold(now, (xfer, token, peer), plan.into(), deferred::HeldKind::Write(route))
    }

    /// Starts WRITE `xfer` (see [`submit_write`](Self::submit_write)).
    fn start_write(
        &mut self,
        now: Instant,
        (xfer, token, peer): (XferId, Token, PeerId),
        plan: Arc<Plan>,
        route: WriteRoute,
    ) -> Result<(), SubmitError> {
        let shape =
            WantShape { one_way: route.mailbox.is_some(), inline: route.inline, no_standing: route.no_standing };
        self.sender.submit(&mut ctx!(self, now), xfer, token, peer, plan, shape)?;
        self.read_answers(now, (xfer, token, peer), route.mailbox);
        Ok(())
    }

    /// One way (`mailbox`: the target's mailbox shape), transfer `xfer` just started reads its
    /// answers from the target's mailbox.
    fn read_answers(
        &mut self,
        now: Instant,
        (xfer, token, peer): (XferId, Token, PeerId),
        mailbox: Option<MailboxLayout>,
    ) {
        let Some(layout) = mailbox else { return };
        if self.reading.start(now, xfer, peer, token, layout).is_err() {
            // The layout was checked when the peer was loaded: unreachable in practice.
            self.sender.fail_by_peer(&mut ctx!(self, now), xfer, XferError::Refused);
        } else {
            self.stats.one_way_sent += 1;
        }
    }

    /// Largest chunk sent inside its WANT (`bounce_inline_bytes`); 0: never.
    pub fn inline_bytes(&self) -> u64 {
        self.sender.inline_bytes()
    }

    /// Lowers (never raises) the largest inline chunk sent in a WANT and taken from peers'
    /// WANTs to `bytes` (`bounce_inline_bytes` is the highest); 0: neither. The shell sets 0
    /// when its arena is not host memory: it could put no bytes there.
    pub fn set_inline_bytes(&mut self, bytes: u64) {
        self.sender.set_inline_bytes(bytes);
        self.receiver.set_inline_bytes(bytes);
    }

    /// Whether chunks carried inline in peers' WANTs are taken into `arena` (all arenas do
    /// unless told otherwise): the shell says no for an arena of GPU memory, where it could
    /// put no bytes. Such WANTs are granted as any other.
    pub fn set_arena_takes_inline(&mut self, arena: ArenaId, takes: bool) {
        self.receiver.set_arena_takes_inline(arena, takes);
    }

    /// Starts READ transfer `xfer` of `plan` from `peer` (gather runs: the peer's source
    /// addresses; scatter runs: our destinations): the peer gathers each chunk into its arena
    /// and announces it ready, we READ it into our staging and scatter it. With `mailbox`
    /// (one way: the peer never loaded us) the answers come through its mailbox as for
    /// [`submit_one_way`](Self::submit_one_way).
    ///
    /// # Errors
    /// As [`submit`](Self::submit).
    ///
    /// A READ from a peer that a cancel of ours still waits to reach starts only once that
    /// cancel is out, as a WRITE does (see `deferred`).
    pub fn submit_read(
        &mut self,
        now: Instant,
        xfer: XferId,
        token: Token,
        peer: PeerId,
        plan: impl Into<Arc<Plan>>,
        mailbox: Option<MailboxLayout>,
    ) -> Result<(), SubmitError> {
        self.submit_or_hold(now, (xfer, token, peer), plan.into(), deferred::HeldKind::Read(mailbox))
    }

    /// Starts READ `xfer` (see [`submit_read`](Self::submit_read)).
    fn start_read(
        &mut self,
        now: Instant,
        (xfer, token, peer): (XferId, Token, PeerId),
        plan: Arc<Plan>,
        mailbox: Option<MailboxLayout>,
    ) -> Result<(), SubmitError> {
        self.sender.submit_read(&mut ctx!(self, now), xfer, token, peer, plan, mailbox.is_some())?;
        self.read_answers(now, (xfer, token, peer), mailbox);
        Ok(())
    }

    /// True when one-way flow `key` ended here and only its slot lingers (for the initiator's
    /// last CURSOR): a WANT or PULL for it now is late or replayed, and judged it would open a
    /// flow whose answers no slot could carry, so it is dropped.
    fn one_way_ended(answering: &Answering, receiver: &Receiver, key: FlowKey) -> bool {
        answering.is_closed(key) && !receiver.has_flow(key)
    }

    /// Cancels an in-flight transfer (the application released it): [`XferError::Canceled`]
    /// and a cancel to the peer. Unknown or finished transfers are ignored. A READ's
    /// [`Action::Complete`] waits for its scatters into our memory still running, as for any
    /// failure: until then [`owes_completion`](Self::owes_completion) holds.
    pub fn cancel(&mut self, now: Instant, xfer: XferId) {
        if !self.cancel_deferred(xfer) {
            self.sender.cancel(&mut ctx!(self, now), xfer);
        }
        self.pump(now);
    }

    /// Sets the control endpoint carried in every WANT (the receiver's reverse path).
    pub fn set_local_endpoint(&mut self, bytes: Vec<u8>) {
        self.sender.set_local_endpoint(bytes);
    }

    /// Our agent name, which our proofs are bound to ([`crate::proof::Initiator`]): a receiver
    /// checks them against the name our frames reach it under. Without it, the empty name.
    pub fn set_local_name(&mut self, name: &str) {
        self.sender.set_initiator(crate::proof::Initiator::named(name));
    }

    /// Records registration `reg` of `[addr, addr + len)` with key `key`: memory the receiver
    /// may scatter into for a flow whose WANT proved it (see [`crate::proof`]). A DATA run must
    /// lie inside one registration its flow proved.
    pub fn add_registered(&mut self, reg: RegId, key: RegKey, range: (u64, u64), arena: ArenaId) {
        self.receiver.add_registered(reg, key, range, arena);
    }

    /// Forgets registration `reg`; unknown ids are ignored. Scatters already emitted are not
    /// affected.
    pub fn remove_registered(&mut self, reg: RegId) {
        self.receiver.remove_registered(reg);
    }

    /// The application deregistered `[addr, addr + len)` (registration `reg`, when it had an
    /// id): the receiver stops scattering into it (as
    /// [`remove_registered`](Self::remove_registered)) and answers ACK(Failed) for each
    /// scatter in flight into it; every transfer reading from it fails with
    /// [`XferError::Deregistered`]. Jobs already emitted still run: the shell must wait for
    /// those that touch the range before it lets the application free the memory.
    pub fn deregister(&mut self, now: Instant, reg: Option<RegId>, addr: u64, len: u64) {
        let mut ctx = ctx!(self, now);
        self.receiver.deregister(&mut ctx, reg, addr, len);
        self.sender.deregister(&mut ctx, addr, addr.saturating_add(len));
        self.fail_deferred_touching((addr, addr.saturating_add(len)));
        self.pump(now);
    }

    /// [`handle_msg`](Self::handle_msg) for a message that came from the agent `name` (as the
    /// channel names its sender): the proofs of `from`'s WANTs and PULLs must be made by that
    /// name. The name of an id is taken at its first WANT or PULL and never changes; an id
    /// only ever given to [`handle_msg`](Self::handle_msg) is taken as the empty name.
    ///
    /// # Errors
    /// As [`handle_msg`](Self::handle_msg).
    pub fn handle_msg_named(
        &mut self,
        now: Instant,
        from: PeerId,
        name: &str,
        msg: wire::Msg,
    ) -> Result<(), ProtocolError> {
        if matches!(msg, wire::Msg::Want(_) | wire::Msg::Pull(_)) {
            self.receiver.name_initiator(from, || crate::proof::Initiator::named(name));
        }
        self.handle_msg(now, from, msg)
    }

    /// Handles one control message from `from`: WANT and DATA go to the receiver, GRANT and
    /// ACK to the sender.
    ///
    /// # Errors
    /// A [`ProtocolError`] for input that breaks the protocol; the message was ignored (an
    /// invalid DATA was refused and its flow reclaimed). Log it; the endpoint stays usable.
    pub fn handle_msg(&mut self, now: Instant, from: PeerId, msg: wire::Msg) -> Result<(), ProtocolError> {
        trace!(peer = from.0, xfer = msg.xfer().0, kind = msg.kind_name(), "recv");
        // A sign of life only when it carries the token of one of our transfers to the peer or
        // of one of its flows into us (asked before handling it, which may end either): a
        // peer's name and session are published, so a frame they alone admit may come from any
        // agent holding its metadata, keeping a dead peer looking alive.
        if self.proves_life(from, &msg) {
            self.liveness.heard(now, from);
        }
        // A frame for our receiver role (not a GRANT or ACK, which answer our own transfers) of a
        // one-way flow still waiting for a slot.
        let to_receiver = !matches!(msg, wire::Msg::Grant(_) | wire::Msg::Ack(_));
        self.stats.peer_msgs += u64::from(to_receiver);
        if to_receiver && self.answering.is_waiting(FlowKey { peer: from, xfer: msg.xfer() }) {
            return self.hold_waiting(from, msg);
        }
        if msg.is_cancel() {
            self.answering.note_cancel(FlowKey { peer: from, xfer: msg.xfer() }, msg.token());
        }
        let mut ctx = ctx!(self, now);
        let r = match msg {
            wire::Msg::Want(m) if m.endpoint == wire::REPLY_MAILBOX && !m.is_cancel() => {
                let key = FlowKey { peer: from, xfer: m.xfer };
                if Self::one_way_ended(&self.answering, &self.receiver, key) {
                    Ok(())
                } else if self.answering.is_one_way(key) {
                    Self::more_one_way_chunks(&mut self.receiver, &mut self.answering, &mut ctx, key, m)
                } else if self.receiver.has_flow(key) {
                    // A flow that began two way stays so, whatever a later WANT asks.
                    self.receiver.handle_want(&mut ctx, from, m)
                } else {
                    Self::open_one_way(&mut self.receiver, &mut self.answering, &mut ctx, key, wire::Msg::Want(m))
                }
            }
            wire::Msg::Pull(m) if m.endpoint == wire::REPLY_MAILBOX && !m.is_cancel() => {
                // A one-way READ: opened like a one-way WANT (see there) by its first PULL; a
                // later one only adds to a flow (or, the flow gone, is dropped as late).
                let key = FlowKey { peer: from, xfer: m.xfer };
                if Self::one_way_ended(&self.answering, &self.receiver, key) {
                    Ok(())
                } else if m.first.0 > 0 || self.answering.is_one_way(key) || self.receiver.has_flow(key) {
                    self.receiver.handle_pull(&mut ctx, from, m)
                } else {
                    Self::open_one_way(&mut self.receiver, &mut self.answering, &mut ctx, key, wire::Msg::Pull(m))
                }
            }
            wire::Msg::Pull(m) => self.receiver.handle_pull(&mut ctx, from, m),
            wire::Msg::Release(m) => {
                let key = FlowKey { peer: from, xfer: m.xfer };
                let r = self.receiver.handle_release(&mut ctx, from, m);
                if r.is_ok() {
                    // A one-way READ flow's chunks end with their RELEASEs (no ACK is written).
                    self.answering.count_done(key);
                }
                r
            }
            wire::Msg::Cursor(c) => {
                let key = FlowKey { peer: from, xfer: c.xfer };
                match self.answering.token(key) {
                    None => Ok(()), // a late cursor of a slot already freed
                    Some(t) if t != c.token => {
                        self.stats.control_forged += 1;
                        Err(ProtocolError::WrongToken { peer: from, xfer: c.xfer })
                    }
                    Some(_) => match self.answering.handle_cursor(now, key, c.consumed, &mut self.out) {
                        Ok(written) => {
                            self.stats.records_written += written as u64;
                            Ok(())
                        }
                        Err(_) => Err(ProtocolError::BadCursor { peer: from, xfer: c.xfer }),
                    },
                }
            }
            wire::Msg::Want(m) => self.receiver.handle_want(&mut ctx, from, m),
            wire::Msg::Data(m) => self.receiver.handle_data(&mut ctx, from, m),
            wire::Msg::Plan(m) => self.receiver.handle_plan(&mut ctx, from, m),
            wire::Msg::Grant(m) => self.sender.handle_grant(&mut ctx, from, m),
            wire::Msg::Ack(m) => self.sender.handle_ack(&mut ctx, from, m),
            wire::Msg::Keep(m) => self.receiver.handle_keep(&mut ctx, from, m),
        };
        if let Err(e) = &r {
            // The shell logs the returned error at `warn`; this is for core-level traces.
            self.stats.protocol_errors += 1;
            debug!(peer = from.0, error = %e, "protocol error");
        }
        self.pump(now);
        r
    }

    /// Whether `msg` from `from` carries a secret only the peer and we hold: the token of one
    /// of our transfers to it (an answer) or of one of its flows into us.
    fn proves_life(&self, from: PeerId, msg: &wire::Msg) -> bool {
        let (xfer, token) = (msg.xfer(), msg.token());
        match msg {
            wire::Msg::Grant(_) | wire::Msg::Ack(_) => self.sender.is_answer(from, xfer, token),
            _ => {
                let key = FlowKey { peer: from, xfer };
                self.receiver.flow_token(key).or_else(|| self.answering.token(key)) == Some(token)
            }
        }
    }

    /// A PING from `from` (already admitted by the peer rules): it gets a PONG echoing `nonce`;
    /// once we are closing, `nonce ^ FAREWELL`, which confirms our GOODBYE. Not a sign of life:
    /// anyone holding the peer's metadata can send one under its name (its PONGs to our PINGs
    /// are, echoing a nonce only it saw).
    ///
    /// The PONG carries the forget secret of the peer's load here ([`crate::forget`]): the
    /// peer records it when the PONG confirms our HELLO, and honours our FORGET only with it.
    pub fn handle_ping(&mut self, _now: Instant, from: PeerId, nonce: u64) {
        self.stats.peer_msgs += 1;
        let nonce = if self.closing { nonce ^ FAREWELL } else { nonce };
        let forget = crate::forget::secret(&self.forget_key, from);
        self.out.push_back(Action::Link { peer: from, body: wire::Body::Pong { nonce, forget } });
    }

    /// A PONG from `from` (already admitted by the peer rules): a sign of life when it echoes
    /// one of our recent PINGs to it, else ignored. [`Pong::Farewell`] when it is the farewell
    /// answer to the PING that asked about its GOODBYE: the peer is going away, call
    /// [`handle_goodbye`](Self::handle_goodbye) (the shell first forgets its arena).
    /// [`Pong::Hello`] when it answers the ask of its HELLO: confirm the HELLO in the peer
    /// table ([`PeerTable::confirm_hello`]).
    pub fn handle_pong(&mut self, now: Instant, from: PeerId, nonce: u64) -> Pong {
        if self.goodbyes.get(&from).is_some_and(|&(asked, _)| nonce == asked ^ FAREWELL) {
            self.goodbyes.remove(&from);
            debug!(peer = from.0, "GOODBYE confirmed");
            self.stats.frames_authentic += 1;
            return Pong::Farewell;
        }
        if self.hellos.answered(from, nonce) {
            debug!(peer = from.0, "HELLO confirmed");
            self.stats.hellos_confirmed += 1;
            self.stats.frames_authentic += 1;
            self.liveness.heard(now, from);
            return Pong::Hello;
        }
        let answered = self.liveness.handle_pong(now, from, nonce);
        trace!(peer = from.0, nonce, answered, "pong");
        if answered {
            self.stats.pongs_received += 1;
            self.stats.frames_authentic += 1;
        }
        Pong::Other
    }

    /// A HELLO from loaded, compatible peer `from` under its session, as
    /// [`PeerTable::hello`] judged it: not confirmed ([`Hello::Ask`]), or confirmed for another
    /// load than this HELLO's ([`Hello::Reloaded`]: the peer loaded us again, its FORGET lost),
    /// is asked about, unless an ask is open already (a reload's, when one was opened less than
    /// a second ago, is deferred to the end of that second). The ask is our HELLO (the peer's
    /// copy of ours may have come before it loaded us) and a PING whose nonce only the peer
    /// sees; its PONG ([`Pong::Hello`]) confirms. A repeat of the load confirmed
    /// ([`Hello::Repeat`]) asks nothing. See [`crate::hello`].
    pub fn handle_hello(&mut self, now: Instant, from: PeerId, hello: Hello) {
        self.stats.peer_msgs += 1;
        let reloaded = match hello {
            Hello::Ask => false,
            Hello::Reloaded => true,
            _ => return,
        };
        let liveness = &mut self.liveness;
        if let Some(ask) = self.hellos.heard(now, from, reloaded, || liveness.next_nonce()) {
            self.send_ask(ask);
        }
    }

    /// The tag of this load of loaded peer `peer`'s metadata (of its id here,
    /// [`crate::forget::load_tag`]), which our HELLOs to it carry, so the peer tells them from
    /// a HELLO of an earlier load of ours ([`wire::encode_hello`]).
    pub fn load_tag_of(&self, peer: PeerId) -> u64 {
        crate::forget::load_tag(crate::forget::secret(&self.forget_key, peer))
    }

    /// Our HELLO to loaded peer `peer`, carrying [`load_tag_of`](Self::load_tag_of) it.
    pub fn hello_to(&self, peer: PeerId) -> wire::Body {
        wire::Body::Hello { load: self.load_tag_of(peer) }
    }

    fn send_ask(&mut self, ask: crate::hello::Ask) {
        self.stats.hello_asks += 1;
        trace!(peer = ask.peer.0, "asking about a HELLO");
        self.out.push_back(Action::Link { peer: ask.peer, body: self.hello_to(ask.peer) });
        self.out.push_back(Action::Link { peer: ask.peer, body: wire::Body::Ping { nonce: ask.nonce } });
    }

    /// A GOODBYE from loaded peer `from` under its session. Nothing about it is secret (the
    /// session is in its published metadata), so anyone who holds that metadata could send
    /// one and end every transfer between us and the peer. It is only asked about: a PING
    /// whose nonce only the peer sees, which a closing engine answers with the farewell PONG
    /// ([`handle_pong`](Self::handle_pong) returns true for it); a peer that is not closing
    /// answers a plain PONG, and the GOODBYE is forgotten.
    ///
    /// One ask per peer is open at a time, until the farewell PONG (or the peer's loss): a
    /// GOODBYE heard while one is open sends its PING again, with the same nonce, at most every
    /// [`GOODBYE_ASK_GAP`]; a plain PONG (the peer is not closing) leaves it open, so a real
    /// GOODBYE later is answered through it. Each GOODBYE minted a fresh nonce until session
    /// 58: a flood of forged ones cost a PING each, and each new nonce made the farewell PONG
    /// of a peer really closing match nothing, so its transfers failed by the probe's ~2 s
    /// instead of at once (review 58).
    pub fn handle_goodbye_said(&mut self, now: Instant, from: PeerId) {
        let nonce = match self.goodbyes.get(&from) {
            Some(&(_, sent)) if now.saturating_duration_since(sent) < GOODBYE_ASK_GAP => return,
            Some(&(nonce, _)) => nonce,
            None => self.liveness.next_nonce(),
        };
        self.goodbyes.insert(from, (nonce, now));
        self.out.push_back(Action::Link { peer: from, body: wire::Body::Ping { nonce } });
    }

    /// Handles one raw control frame from the agent `name`: decodes it, applies the peer rules
    /// of [`PeerTable`] (HELLO bound, loaded peers only, the session of the loaded
    /// capabilities) and hands an accepted message to [`handle_msg`](Self::handle_msg). A frame
    /// of another session is refused and counted in [`Stats::control_forged`].
    ///
    /// # Errors
    /// A [`FrameRefused`]: the frame was dropped (a refused message's effects are those of
    /// `handle_msg`). Log it; the endpoint stays usable.
    pub fn handle_frame(&mut self, now: Instant, name: &str, bytes: &[u8]) -> Result<(), FrameRefused> {
        let r = self.admit_frame(now, name, bytes);
        if let Err(e) = &r {
            if !matches!(e, FrameRefused::Protocol(_)) {
                self.stats.frames_refused += 1;
            }
            if matches!(e, FrameRefused::StaleSession { .. }) {
                self.stats.control_forged += 1;
            }
            debug!(peer = name, error = %e, "control frame refused");
        }
        r
    }

    fn admit_frame(&mut self, now: Instant, name: &str, bytes: &[u8]) -> Result<(), FrameRefused> {
        let frame = wire::ControlFrame::decode(bytes)?;
        let msg = match frame.body {
            wire::Body::Hello { load } => {
                // Counted only once asked about (see `crate::hello`); one from a name not loaded
                // leaves nothing behind.
                match self.peers.hello(name, frame.session, load) {
                    h @ (Hello::Ask | Hello::Reloaded | Hello::Repeat) => {
                        if let Some(peer) = self.peers.lookup(name) {
                            self.handle_hello(now, peer, h);
                        }
                    }
                    Hello::NotLoaded => return Err(FrameRefused::NotLoaded),
                    other => {
                        if let Some(refused) = other.refusal(frame.session) {
                            return Err(refused);
                        }
                    }
                }
                return Ok(());
            }
            wire::Body::Ping { nonce } => {
                let peer = self.peers.admit(name, frame.session)?;
                self.handle_ping(now, peer, nonce);
                return Ok(());
            }
            wire::Body::Pong { nonce, forget } => {
                let peer = self.peers.admit(name, frame.session)?;
                match self.handle_pong(now, peer, nonce) {
                    Pong::Farewell => {
                        let peer = self.peers.goodbye(name, frame.session)?;
                        self.handle_goodbye(now, peer);
                    }
                    Pong::Hello => {
                        self.peers.confirm_hello(name, forget);
                    }
                    Pong::Other => {}
                }
                return Ok(());
            }
            wire::Body::Forget { proof } => {
                match self.peers.forgot_us(name, frame.session, proof)? {
                    Forgot::Us(peer) => self.handle_forgotten(now, peer),
                    Forgot::NotConfirmed => {}
                    Forgot::Forged => {
                        self.stats.control_forged += 1;
                        return Err(FrameRefused::ForgedForget);
                    }
                }
                return Ok(());
            }
            wire::Body::Goodbye => {
                let peer = self.peers.admit(name, frame.session)?;
                self.handle_goodbye_said(now, peer);
                return Ok(());
            }
            wire::Body::Msg(msg) => msg,
        };
        // One way: an initiator we never loaded, or another incarnation of one we did, may open
        // a flow answered through our mailbox, and then send that flow's frames (each must
        // carry its token). A name never heard of, or a loaded name under another session (a
        // new incarnation), is given an id only once its opening's proofs verify: a loaded
        // name is published, and invented sessions under it spent an id each (review 59).
        if self.peers.is_unvouched(name, frame.session) {
            if let Some(e) = self.refuse_forged_opening(name, &msg) {
                return Err(FrameRefused::Protocol(e));
            }
        }
        let (receiver, answering, sender, deferred) = (&self.receiver, &self.answering, &self.sender, &self.deferred);
        let one_way = |id| Self::one_way_admissible(answering, id, &msg);
        let idle = |id| holds_nothing(receiver, answering, (sender, deferred), id);
        let (peer, gone) = self.peers.admit_message(name, frame.session, one_way, idle)?;
        if let Some(gone) = gone {
            self.handle_peer_evicted(now, gone);
        }
        Ok(self.handle_msg_named(now, peer, name, msg)?)
    }

    /// NIXL loaded the agent `name`'s connection info, which published `theirs`; `ours` is
    /// what we publish (see [`PeerTable::load_conn_info`]). A reload that brings a new session
    /// means the agent restarted under the same name: everything of its old incarnation is
    /// reclaimed first, as [`handle_peer_lost`](Self::handle_peer_lost) does. This is the only
    /// way a peer's session changes: a frame never changes it.
    pub fn handle_conn_info(
        &mut self,
        now: Instant,
        name: &str,
        theirs: Option<wire::Capabilities>,
        ours: Option<&wire::Capabilities>,
    ) -> Loaded {
        if let Some(old) = self.peers.load_replaces(name, theirs.as_ref()) {
            debug!(peer = name, "peer reloaded with a new session: reclaiming its old incarnation");
            self.handle_peer_retired(now, old);
        }
        let timeout = theirs.as_ref().map(wire::Capabilities::request_timeout);
        let loaded = self.peers.load_conn_info(name, theirs, ours);
        if let (Some(t), Some(id)) = (timeout, self.peers.lookup(name)) {
            self.sender.set_peer_timeout(id, t);
        }
        loaded
    }

    /// `peer`'s capabilities say it runs with no-progress timeout `timeout`
    /// ([`wire::Capabilities::request_timeout_ms`]): the credits it grants are leased by it, so
    /// ours to it are used within a quarter of the smaller of the two timeouts and kept alive
    /// every eighth of it. A shell that keeps its own peer table tells the endpoint so before
    /// it submits to the peer ([`handle_conn_info`](Self::handle_conn_info) does it itself).
    pub fn set_peer_timeout(&mut self, peer: PeerId, timeout: Duration) {
        self.sender.set_peer_timeout(peer, timeout);
    }

    /// The agent `name` disconnected: the peer table forgets its connection info, arena, HELLO
    /// and session, and its transfers and flows end as in
    /// [`handle_peer_lost`](Self::handle_peer_lost). Unknown names are ignored.
    pub fn handle_agent_lost(&mut self, now: Instant, name: &str) {
        if let Some(peer) = self.peers.lost(name) {
            self.handle_peer_retired(now, peer);
        }
    }

    /// Reports a finished [`Action::Gather`] (a sender's staging or a READ target's).
    /// Unknown jobs are logged and ignored.
    pub fn handle_gather_done(&mut self, now: Instant, job: JobId, ok: bool) {
        if self.receiver.owns_gather(job) {
            self.receiver.handle_gather_done(&mut ctx!(self, now), job, ok);
        } else {
            self.sender.handle_gather_done(&mut ctx!(self, now), job, ok);
        }
        self.pump(now);
    }

    /// Reports a finished [`Action::Read`].
    pub fn handle_read_done(&mut self, now: Instant, job: JobId, ok: bool) {
        self.sender.handle_read_done(&mut ctx!(self, now), job, ok);
        self.pump(now);
    }

    /// Reports a finished [`Action::Write`]. Unknown jobs are logged and ignored.
    pub fn handle_write_done(&mut self, now: Instant, job: JobId, ok: bool) {
        self.sender.handle_write_done(&mut ctx!(self, now), job, ok);
        self.pump(now);
    }

    /// Reports a finished [`Action::Scatter`] (a receiver's, or a READ initiator's local one).
    /// Unknown jobs are logged and ignored.
    pub fn handle_scatter_done(&mut self, now: Instant, job: JobId, ok: bool) {
        if self.sender.owns_job(job) {
            self.sender.handle_scatter_done(&mut ctx!(self, now), job, ok);
        } else {
            self.receiver.handle_scatter_done(&mut ctx!(self, now), job, ok);
        }
        self.pump(now);
    }

    /// The peer's id is retired for good (NIXL lost the agent or loaded another incarnation of
    /// it, or a one-way name was forgotten): [`handle_peer_lost`](Self::handle_peer_lost), and
    /// what is kept per id for its whole life (the order floor of our standing claims to it)
    /// goes too. Not for a peer declared dead by the probe: it may be alive, with its floors.
    pub fn handle_peer_retired(&mut self, now: Instant, peer: PeerId) {
        self.handle_peer_lost(now, peer);
        self.sender.forget_peer(peer);
    }

    /// One-way name `peer` was evicted from the peer table to make room for another (it held
    /// nothing here): its id is retired as [`handle_peer_retired`](Self::handle_peer_retired)
    /// does (its name's replay state is kept, for the id the name gets next, as for any
    /// retired id).
    pub fn handle_peer_evicted(&mut self, now: Instant, peer: PeerId) {
        self.handle_peer_retired(now, peer);
    }

    /// The peer is gone: its transfers fail with [`XferError::PeerLost`] (no cancel is sent)
    /// and its flows are reclaimed (scattering regions are freed by their done-events).
    pub fn handle_peer_lost(&mut self, now: Instant, peer: PeerId) {
        self.hellos.forget(peer);
        // An ask about its GOODBYE is moot (and, its id retired, would stay for good).
        self.goodbyes.remove(&peer);
        let mut ctx = ctx!(self, now);
        self.sender.handle_peer_lost(&mut ctx, peer);
        self.receiver.handle_peer_lost(&mut ctx, peer);
        self.answering.release_peer(peer);
        self.fail_deferred(Some(peer), XferError::PeerLost);
        self.pump(now);
    }

    /// The peer said GOODBYE (its engine is going away, its own writes have ended): its flows
    /// into us are reclaimed at once, and our transfers to it fail with
    /// [`XferError::PeerLost`], their credits retracted (a cancel) once our writes into its
    /// arena have ended, so it can tell when no write of ours can land there any more.
    pub fn handle_goodbye(&mut self, now: Instant, peer: PeerId) {
        self.hellos.forget(peer);
        let mut ctx = ctx!(self, now);
        self.sender.handle_goodbye(&mut ctx, peer);
        self.receiver.handle_peer_lost(&mut ctx, peer);
        // Its mailbox slots go with it, as for a lost peer: nobody will read them.
        self.answering.release_peer(peer);
        self.fail_deferred(Some(peer), XferError::PeerLost);
        self.pump(now);
    }

    /// The peer unloaded our metadata (its FORGET proved it, [`PeerTable::forgot_us`]): it can
    /// no longer send us frames, so our transfers to it fail with [`XferError::Forgotten`]
    /// (its side reclaimed their flows) and its flows into us are reclaimed (their writes
    /// still in flight land in quarantined regions), as for a lost peer, its replay floors
    /// kept. Its id stays: it is still loaded here, and our transfers to it go one way from now
    /// on. An ask about its HELLO stays open (it may have loaded us again already, its new
    /// HELLO overtaking the FORGET), and we say HELLO: a peer that loaded us again asks about
    /// it and we go two way again; one that did not drops it.
    pub fn handle_forgotten(&mut self, now: Instant, peer: PeerId) {
        self.stats.peers_forgot_us += 1;
        self.goodbyes.remove(&peer);
        self.end_with_living_id(now, peer, XferError::Forgotten);
        self.out.push_back(Action::Link { peer, body: self.hello_to(peer) });
        self.pump(now);
    }

    /// Fires the timers due at `now`: stalled transfers fail with [`XferError::Timeout`], silent
    /// remote flows are reclaimed, silent peers we wait on are PINGed, and a peer that answered
    /// no PING for the probe's bound is declared dead: its transfers fail with
    /// [`XferError::PeerLost`] and its flows are reclaimed, as in
    /// [`handle_peer_lost`](Self::handle_peer_lost); arena regions whose quarantine ended are
    /// freed and granted. Spurious or early calls are harmless.
    pub fn handle_timeout(&mut self, now: Instant) {
        // Waiters whose initiators have given up are dropped; the others may find a slot whose
        // linger ended (the pump below serves them).
        self.stats.one_way_refused += self.answering.expire(now) as u64;
        // Regions whose quarantine ended are free again (the pump below grants them).
        self.scheds.lift_quarantine(Some(now));
        let mut ctx = ctx!(self, now);
        self.sender.handle_timeout(&mut ctx);
        self.receiver.handle_timeout(&mut ctx);
        self.expire_deferred(now);
        self.watch_waited(now);
        let verdicts = self.liveness.handle_timeout(now);
        for (peer, nonce) in verdicts.pings {
            self.stats.pings_sent += 1;
            trace!(peer = peer.0, nonce, "ping");
            self.out.push_back(Action::Link { peer, body: wire::Body::Ping { nonce } });
        }
        for peer in verdicts.dead {
            debug!(peer = peer.0, "no sign of life after PINGs: peer declared dead");
            self.declare_dead(now, peer, XferError::Unresponsive);
        }
        let liveness = &mut self.liveness;
        for ask in self.hellos.handle_timeout(now, || liveness.next_nonce()) {
            self.send_ask(ask);
        }
        self.pump(now);
    }

    /// The peers declared dead (by the probe, or the transport) since the last call: the shell
    /// drops what its control channel still queues for them (a ZMQ connection that never
    /// completed holds every frame sent to it), as for a peer lost.
    pub fn take_declared_dead(&mut self) -> BTreeSet<PeerId> {
        std::mem::take(&mut self.declared_dead)
    }

    /// The transport says `peer` is gone for good (UCX refused a send to it with
    /// `ERR_REMOTE_DISCONNECT`: its endpoint failed): when we wait on it, it is declared dead at
    /// once, as the liveness probe would have done later. Otherwise nothing happens.
    pub fn handle_peer_unreachable(&mut self, now: Instant, peer: PeerId) {
        self.watch_waited(now);
        if self.waited.contains(&peer) {
            debug!(peer = peer.0, "the transport reports the peer unreachable: peer declared dead");
            self.declare_dead(now, peer, XferError::PeerLost);
            self.pump(now);
        }
    }

    /// Fails `peer`'s transfers with `err` and reclaims its flows, counted as a death.
    fn declare_dead(&mut self, now: Instant, peer: PeerId, err: XferError) {
        self.stats.peers_declared_dead += 1;
        self.declared_dead.insert(peer);
        // It may be alive, under the same id and session.
        self.end_with_living_id(now, peer, err);
    }

    /// Ends everything between us and `peer`, whose id lives on (it stays loaded here): our
    /// transfers to it fail with `err`, its flows into us are reclaimed with their replay
    /// floors kept, and its mailbox slots are released.
    fn end_with_living_id(&mut self, now: Instant, peer: PeerId, err: XferError) {
        let mut ctx = ctx!(self, now);
        self.sender.fail_peer(&mut ctx, peer, err.clone());
        self.receiver.reclaim_flows_of(&mut ctx, peer);
        self.answering.release_peer(peer);
        self.fail_deferred(Some(peer), err);
    }

    /// Fails every transfer with [`XferError::ShuttingDown`] (cancels are still queued for the
    /// peers), reclaims every remote flow and refuses new work. Regions with jobs in flight stay
    /// allocated until their done-events; [`is_idle`](Self::is_idle) says when none are left.
    pub fn shutdown(&mut self, now: Instant) {
        let mut ctx = ctx!(self, now);
        self.sender.shutdown(&mut ctx);
        self.receiver.shutdown(&mut ctx);
        self.fail_deferred(None, XferError::ShuttingDown);
        self.pump(now);
    }

    /// Starts closing (the engine is being destroyed): every transfer fails with
    /// [`XferError::ShuttingDown`] (cancels are queued, as in [`shutdown`](Self::shutdown)),
    /// no WANT is accepted and no region is granted any more, but regions already granted stay
    /// held (and their DATA is still scattered) until the peer retracts or uses them:
    /// [`grants_outstanding`](Self::grants_outstanding) counts them. Call
    /// [`shutdown`](Self::shutdown) when it reaches zero or the shell stops waiting.
    pub fn close(&mut self, now: Instant) {
        self.closing = true;
        let mut ctx = ctx!(self, now);
        self.sender.shutdown(&mut ctx);
        self.receiver.close();
        self.fail_deferred(None, XferError::ShuttingDown);
        self.pump(now);
    }

    /// Regions granted to peers and not yet returned: where a peer's write may still land.
    pub fn grants_outstanding(&self) -> usize {
        self.receiver.grants_outstanding(&self.scheds)
    }

    /// The next action for the shell; call until `None` after every command or input.
    #[must_use]
    pub fn poll_action(&mut self) -> Option<Action> {
        self.out.pop_front()
    }

    /// When [`handle_timeout`](Self::handle_timeout) should next be called, if ever. It may be
    /// early (the call is then a no-op); it is never late.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<Instant> {
        let waiting = self.answering.next_timeout();
        let lift = self.scheds.next_lift();
        let asks = self.hellos.next_timeout();
        let held = self.deferred.next_timeout();
        [
            self.sender.next_timeout(),
            self.receiver.next_timeout(),
            self.liveness.next_timeout(),
            waiting,
            lift,
            asks,
            held,
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// Transfers submitted and not yet completed.
    pub fn in_flight_xfers(&self) -> usize {
        self.sender.in_flight() + self.deferred.len()
    }

    /// Staging regions of failed transfers waiting for their gather or write to finish.
    pub fn orphans(&self) -> usize {
        self.sender.orphans()
    }

    /// Whether transfer `xfer` of ours is still to get its [`Action::Complete`]: in flight, or
    /// a failed READ whose scatters into our memory run on (its failure is told once they have
    /// ended, so that nothing of it writes the destinations after the application learns of
    /// it).
    pub fn owes_completion(&self, xfer: XferId) -> bool {
        self.sender.owes_completion(xfer) || self.deferred.contains(xfer)
    }

    /// Whether `job` (a gather, write or READ of ours) belongs to a transfer that ended before
    /// it was reported done: a write or READ not yet posted need not be (report it failed).
    pub fn is_orphan(&self, job: JobId) -> bool {
        self.sender.is_orphan(job)
    }

    /// Jobs emitted and not yet reported done (orphans included).
    pub fn jobs_in_flight(&self) -> usize {
        self.sender.jobs_in_flight() + self.receiver.scatters_in_flight()
    }

    /// Whether nothing here belongs to `peer`: no flow of its into us, nothing in our mailbox
    /// for it (slot, waiting transfer), no transfer of ours to it. Such a peer, if NIXL never
    /// loaded it, may be forgotten ([`PeerTable::evict_one_way`]); [`Self::handle_peer_lost`]
    /// then drops what little may remain of it (replay floors).
    pub fn holds_nothing_for(&self, peer: PeerId) -> bool {
        holds_nothing(&self.receiver, &self.answering, (&self.sender, &self.deferred), peer)
    }

    /// Remote flows the receiver tracks.
    pub fn remote_flows(&self) -> usize {
        self.receiver.flows()
    }

    /// True when nothing is in flight: no transfer, no remote flow, no job and no queued action.
    /// After [`shutdown`](Self::shutdown), the shell may drop the endpoint (and the arena) once
    /// this holds.
    pub fn is_idle(&self) -> bool {
        self.is_quiet() && self.remote_flows() == 0
    }

    /// True when nothing waits on a peer or a job: as [`Self::is_idle`], except that standing
    /// flows ([`wire::Standing`]) may remain, which wait for nothing (a later transfer claims
    /// their region, or their lease, a timer, ends them). The shell polls closely only while
    /// this is false: a standing flow kept a target's reactor polling every 50 us for as long
    /// as it stood after a single bounced WRITE, 11-35% of a core while idle (session 20).
    pub fn is_quiet(&self) -> bool {
        self.out.is_empty()
            && self.in_flight_xfers() == 0
            && self.jobs_in_flight() == 0
            && self.receiver.waiting_flows() == 0
    }

    /// Free arena bytes, over all arenas.
    pub fn arena_free_bytes(&self) -> u64 {
        self.scheds.free_bytes()
    }

    /// Arena bytes in quarantine, over all arenas: reclaimed from writers that went silent or
    /// were lost, free again a quarter request timeout later.
    pub fn arena_quarantined_bytes(&self) -> u64 {
        self.scheds.iter().map(|(_, s)| s.quarantined_bytes()).sum()
    }

    /// Arena bytes held for peers' standing credits ([`wire::Standing`]): granted ahead of
    /// their transfers, back when claimed and replaced, or at the lease's end.
    pub fn arena_standing_bytes(&self) -> u64 {
        self.receiver.standing_held_bytes(&self.scheds)
    }

    /// The first arena's credit scheduler (the one every engine has), read-only.
    pub fn scheduler(&self) -> &CreditScheduler {
        self.scheds.get(ArenaId(0))
    }

    /// Every arena's credit scheduler, read-only.
    pub fn schedulers(&self) -> &ArenaSchedulers {
        &self.scheds
    }

    /// Adds an arena of `capacity` usable bytes (offsets from 0, as the first arena's), minimum
    /// block `granularity` and chunks of at most `max_chunk` bytes staged in it (its own
    /// options', as its capabilities advertise), with the configured window: peers may then
    /// name it in their WANTs and PULLs, and plans stage in it ([`Plan::local_arena`]). Its id
    /// is its index in the capabilities the shell advertises, so arenas are added before any
    /// peer loads them.
    ///
    /// # Errors
    /// [`EndpointError::Sched`] for a geometry the scheduler refuses;
    /// [`EndpointError::TooManyArenas`] past [`crate::types::MAX_ARENAS`].
    pub fn add_arena(&mut self, capacity: u64, granularity: u64, max_chunk: u64) -> Result<ArenaId, EndpointError> {
        let mut sched = CreditScheduler::new(capacity, granularity, self.window)?;
        sched.limit_chunks(max_chunk);
        let id = self.scheds.add(sched).ok_or(EndpointError::TooManyArenas)?;
        self.sender.set_max_chunk(id, max_chunk);
        Ok(id)
    }

    /// The sender role, read-only.
    pub fn sender(&self) -> &Sender {
        &self.sender
    }

    /// The receiver role, read-only.
    pub fn receiver(&self) -> &Receiver {
        &self.receiver
    }

    /// The receiver role, mutable (tests that adjust it).
    #[cfg(test)]
    pub(crate) fn receiver_mut(&mut self) -> &mut Receiver {
        &mut self.receiver
    }

    /// The peer table, read-only.
    pub fn peers(&self) -> &PeerTable {
        &self.peers
    }

    /// Hands the liveness probe the peer table that knows who answers a PING, for a shell
    /// that keeps the peers itself (admits frames and calls [`handle_msg`](Self::handle_msg)):
    /// `answers(id)` must say whether `id` is the loaded incarnation of a name that can bounce
    /// with us ([`PeerTable::answers_pings`]). The probe asks it only about peers that also
    /// hold one-way state here; without it, this endpoint's own table is asked, and a shell
    /// that never fills it would leave a two-way peer unprobed while it also sends us one-way
    /// flows (our transfers to it, should it die, would fail only at their timeout). It must
    /// not call back into the endpoint.
    pub fn set_ping_answerers(&mut self, answers: impl Fn(PeerId) -> bool + Send + 'static) {
        self.answers_pings = PingAnswerers(Some(Box::new(answers)));
    }

    /// The peer table, for the loads NIXL reports (connection info, arenas).
    pub fn peers_mut(&mut self) -> &mut PeerTable {
        &mut self.peers
    }

    /// The counters.
    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    /// After any event that may have freed arena space: gives freed space first to parked
    /// local credits (they finish work a peer already reserved space for), then to remote
    /// flows through `schedule()`.
    ///
    /// Then opens the one-way flows waiting for a slot that one has freed for, and pumps again
    /// for them (each round opens at least one waiter, so this ends).
    fn pump(&mut self, now: Instant) {
        // A cancel that went out with a job just reported lets the WRITEs held behind it start.
        if self.deferred.len() > 0 {
            self.start_deferred(now);
        }
        loop {
            let mut ctx = ctx!(self, now);
            self.sender.retry_parked(&mut ctx);
            let mut free = ctx.scheds.free_bytes();
            if !self.closing {
                // Each arena schedules its own flows: one arena's drain mode or full ring
                // never holds back another's.
                let mut grants = Vec::new();
                for (_, sched) in ctx.scheds.iter_mut() {
                    let more = sched.schedule();
                    // One arena (the usual case): its list as it is, no copy.
                    if grants.is_empty() { grants = more } else { grants.extend(more) }
                }
                free = ctx.scheds.free_bytes();
                if !grants.is_empty() {
                    self.receiver.emit_grants(&mut ctx, grants);
                }
                self.watch_waited(now);
            }
            self.one_way_outputs(now);
            // What was granted may have been freed at once (an inline chunk whose runs a
            // deregistration made invalid refuses its flow), and ending one-way flows may free
            // space too: that space is scheduled in one more round, not left for the next event.
            let freed = self.scheds.free_bytes() > free;
            if !self.serve_waiting(now) && !freed {
                break;
            }
        }
    }
}

mod deferred;
mod one_way;

/// See [`Endpoint::holds_nothing_for`] (apart, so that the peer table may be borrowed beside).
fn holds_nothing(
    receiver: &Receiver,
    answering: &Answering,
    (sender, deferred): (&Sender, &deferred::Deferred),
    peer: PeerId,
) -> bool {
    !receiver.has_flows(peer) && !answering.holds(peer) && !sender.has_xfers_to(peer) && !deferred.has_peer(peer)
}
#[cfg(test)]
pub(crate) mod tests;
