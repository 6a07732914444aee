//! One-way flows (issue 13, docs/one-way.md): bounce between an initiator that loaded the
//! target's metadata and a target that never loaded the initiator's, so it cannot send it a
//! frame. The target answers through its mailbox instead: GRANT and ACK become authenticated
//! 64-byte records ([`crate::mailbox`]) in its own arena, which the initiator READs.
//!
//! This module only moves answers between the two transports; the sender and receiver roles
//! decide exactly as for a two-way flow and never know the difference:
//! - target side ([`Answering`]): a WANT whose endpoint is [`wire::REPLY_MAILBOX`] opens a slot;
//!   every GRANT and ACK the receiver then sends that flow is taken out of the action queue and
//!   written as records instead ([`Action::PutRecord`]); when the receiver forgets the flow
//!   before its last chunk was acknowledged (timeout, cancel, refusal, shutdown) a FAIL record
//!   tells the initiator; a CURSOR frame frees ring room and, after the last record, the slot.
//! - initiator side ([`Reading`]): each one-way transfer has a [`MailboxReader`]; the shell READs
//!   what [`Reading::fetch`] names, hands the bytes to [`Reading::handle_fetched`], and the
//!   answers come back as the GRANT and ACK messages the sender would have received as frames
//!   (same token, same checks). How far it has read goes back to the target in CURSOR frames.
//!
//! Layout: the mailbox follows, in the endpoint's offsets, the part of the arena the credit
//! scheduler hands out, and after it comes the initiator's own fetch area, where its READs of
//! peers' mailboxes land ([`OneWayLayout`]). The shell keeps these two in host memory of their
//! own, registered apart from the arena, and advertises the mailbox at its offset there.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use crate::config::Config;
use crate::event::Action;
use crate::mailbox::{
    self, Answer, CANDIDATES, FailReason, MailboxLayout, MailboxReader, MailboxWriter, QueueConfig, QueueError,
    RECORD_LEN, ReaderError, Seq, SlotConfig, SlotError, SlotQueue, candidates,
};
use crate::types::{FlowKey, PeerId, Region, Token, XferId};
use crate::wire::{self, Ack, AckStatus, Credit, Cursor, Grant, MailboxCaps, Msg};

/// Slots in a mailbox: one-way transfers in flight into one target at once.
pub const MAILBOX_SLOTS: u32 = 256;
/// One-way transfers one peer may have waiting for a slot (on top of the quarter of the slots
/// it may hold): enough for a few hundred transfers in flight into one target.
pub const WAITING_PER_PEER: usize = MAILBOX_SLOTS as usize;
/// One-way transfers waiting for a slot in all, from every peer.
pub const WAITING_TOTAL: usize = 4 * MAILBOX_SLOTS as usize;
/// Units (chunks, gather runs, and held bytes: see [`HELD_BYTES_PER_UNIT`]) the waiting
/// transfers of one peer may hold: the size of the receiver's own per-peer chunk budget.
pub const WAITING_UNITS_PER_PEER: u64 = crate::receiver::MAX_CHUNKS_PER_PEER;
/// Chunks and gather runs held by all waiting transfers, their bytes counted too (see
/// [`HELD_BYTES_PER_UNIT`]: tens of MiB at most).
pub const WAITING_UNITS_TOTAL: u64 = 2 * WAITING_UNITS_PER_PEER;
/// Fetch slices of the initiator's fetch area: one-way transfers it can poll at once (the
/// others wait for a slice, in order), a quarter of them at most to one target (32: half of
/// what one initiator may hold of a target's mailbox slots).
pub const FETCH_SLICES: u32 = 128;

/// Where the mailbox and the fetch area lie, in the endpoint's offsets, for its configuration:
/// past the arena's part the credit scheduler hands out, so one offset space covers all three
/// (the simulation maps them as one buffer). The shell keeps `[mailbox.offset, arena_len)` in a
/// host registration of its own: the one-way area ([`OneWayLayout::area_len`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OneWayLayout {
    /// The mailbox, at its offset in the endpoint's offsets (advertised to peers at its offset
    /// in the one-way area: [`OneWayLayout::advertised`]).
    pub mailbox: MailboxCaps,
    /// Byte offset of the fetch area.
    pub fetch_offset: u64,
    /// Bytes of one fetch slice: the largest fetch of one transfer.
    pub fetch_slice: u64,
    /// Number of fetch slices.
    pub fetch_slices: u32,
    /// End of the fetch area: the scheduler's part, the mailbox and the fetch area together.
    pub arena_len: u64,
}

impl OneWayLayout {
    /// The layout for `config`: `ring` = 2W + 2 records per slot (up to W GRANTs and W ACKs
    /// unread, a FAIL, one spare), so a reader that keeps up never holds an answer back.
    pub fn for_config(config: &Config) -> Self {
        // Saturating: a window near u32::MAX (a valid setting) overflowed, a panic in a debug
        // build and, wrapped, a ring of 8 in a release one.
        let ring = config
            .max_inflight_chunks
            .saturating_mul(2)
            .saturating_add(2)
            .clamp(CANDIDATES as u32, MailboxLayout::MAX_RING);
        let layout = MailboxLayout { slots: MAILBOX_SLOTS, ring };
        let offset = config.arena_usable_capacity();
        let fetch_offset = offset + layout.byte_len();
        // A ring, or while locating one record of each candidate slot.
        let fetch_slice = layout.ring_bytes().max((CANDIDATES * RECORD_LEN) as u64);
        let arena_len = fetch_offset + fetch_slice * u64::from(FETCH_SLICES);
        Self {
            mailbox: MailboxCaps { offset, slots: layout.slots, ring: layout.ring },
            fetch_offset,
            fetch_slice,
            fetch_slices: FETCH_SLICES,
            arena_len,
        }
    }

    /// Bytes of the one-way area: the mailbox, then the fetch area.
    pub fn area_len(&self) -> u64 {
        self.arena_len - self.mailbox.offset
    }

    /// The mailbox as peers see it: at its offset in the one-way area (its start).
    pub fn advertised(&self) -> MailboxCaps {
        MailboxCaps { offset: 0, ..self.mailbox }
    }
}

/// The mailbox shape a peer advertised, checked against the registration it lies in: `None`
/// when it is out of bounds (a broken or hostile peer: then it is never bounced to one way).
pub fn peer_layout(caps: &wire::Capabilities) -> Option<MailboxLayout> {
    let m = caps.mailbox?;
    let layout = MailboxLayout { slots: m.slots, ring: m.ring };
    layout.validate().ok()?;
    let end = m.offset.checked_add(layout.byte_len())?;
    (end <= caps.mailbox_len).then_some(layout)
}

/// Why a one-way WANT was not taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum OneWayRefused {
    /// This engine keeps no mailbox (bounce is off, or its GPU arena got no copy stream).
    #[error("this engine keeps no mailbox")]
    NoMailbox,
    /// No slot for it now.
    #[error(transparent)]
    Slot(#[from] SlotError),
    /// No slot, and no room to wait for one.
    #[error(transparent)]
    Queue(#[from] QueueError),
}

/// Bytes of a held message that cost the queue one unit more, on top of one unit per chunk
/// and run: a waiting transfer holds its messages whole, and a WANT of one chunk may carry up to
/// a MiB of endpoint and thousands of proofs. With this the per-peer bound (2^20 units) holds
/// at most 32 MiB of such bytes, the whole queue 64 MiB.
pub const HELD_BYTES_PER_UNIT: u64 = 32;

/// What a held WANT or PULL costs the queue: its chunks and gather runs, and its variable
/// bytes (endpoint, proofs, runs; inline bytes too, though a held WANT's are stripped before
/// it is held) at [`HELD_BYTES_PER_UNIT`].
fn held_units(msg: &Msg) -> u64 {
    const PROOF: u64 = std::mem::size_of::<wire::Proof>() as u64;
    const RUN: u64 = std::mem::size_of::<crate::types::CopyRun>() as u64;
    let (count, bytes) = match msg {
        Msg::Want(w) => {
            let inline = w.inline.as_ref().map_or(0, |i| i.bytes.len() as u64 + RUN * i.runs.len() as u64);
            let bytes = w.endpoint.len() as u64 + 8 * w.chunks.len() as u64 + PROOF * w.proofs.len() as u64 + inline;
            (w.chunks.len() as u64, bytes)
        }
        Msg::Pull(p) => {
            let runs: u64 = p.chunks.iter().map(|c| c.runs.len() as u64).sum();
            let bytes =
                p.endpoint.len() as u64 + RUN * runs + 8 * p.chunks.len() as u64 + PROOF * p.proofs.len() as u64;
            (p.chunks.len() as u64 + runs, bytes)
        }
        _ => (0, 0),
    };
    count.saturating_add(bytes.div_ceil(HELD_BYTES_PER_UNIT))
}

/// One one-way flow into us, as the target answers it.
#[derive(Debug, Clone, Copy)]
struct Flow {
    token: Token,
    /// Chunks the flow announced and chunks acknowledged as scattered.
    chunks: usize,
    scattered: usize,
    /// The receiver forgot the flow and its slot is closing: only the CURSOR may still come.
    closed: bool,
    /// Its initiator canceled it (a cancel with its token): it reads nothing more, so its
    /// slot is freed as soon as the receiver forgets the flow, with no FAIL.
    canceled: bool,
    /// An ACK that fails the transfer (Refused, Failed) is written: its initiator ends the
    /// transfer on reading it, so a FAIL after it would only hold the slot, unread.
    failed: bool,
}

/// What became of a message of a transfer waiting for a slot ([`Answering::hold`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Held {
    /// A further WANT: held, replayed after the opening one.
    Kept,
    /// A cancel (an empty WANT or PULL): the transfer left the queue.
    Canceled,
    /// Anything else (a DATA, KEEP, CURSOR, ... before any GRANT): late or broken, ignored.
    Ignored,
}

/// Why a message of a waiting transfer was not held.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HoldError {
    /// It carries another token than the WANT that queued the transfer: a forgery.
    #[error("another token than the waiting transfer's")]
    WrongToken,
    /// Holding it would pass the queue's bounds: the whole transfer was dropped.
    #[error(transparent)]
    Full(#[from] QueueError),
}

/// The target's side: the mailbox writer, the one-way flows it answers, and the transfers
/// waiting for a slot.
///
/// # Waiting for a slot
/// A one-way WANT or PULL that is genuine (its proofs verify) but finds no slot (its peer
/// holds its quarter, or its candidates are all held) waits in a bounded [`SlotQueue`]
/// ([`wait`](Self::wait)) instead of being dropped: the message itself is held, not judged
/// into the receiver, and replayed exactly as it came once a candidate slot is free for it
/// ([`next_servable`](Self::next_servable)); further WANTs of the transfer are held behind it
/// ([`hold`](Self::hold)). So the receiver's credit scheduler never sees a flow it could not
/// answer: granting regions to a flow with no slot would hold arena space nobody can use (its
/// GRANTs could not be written) and keep the flow's idle timer running, and judging a WANT
/// once on arrival and again on opening would count it twice. The price: a refusal the
/// receiver would make (over its per-peer limits, a bad run) is made only when the transfer's
/// turn comes, and answered in its slot then. A waiter leaves when its initiator's timeout
/// has passed ([`expire`](Self::expire)), on cancel, or with its peer; only a WANT that
/// overflows the queue is dropped (`one_way_refused`).
#[derive(Debug)]
pub struct Answering {
    writer: Option<MailboxWriter>,
    /// Byte offset of the mailbox in the arena (records are placed relative to it).
    base: u64,
    flows: BTreeMap<FlowKey, Flow>,
    linger: Duration,
    /// Genuine WANTs and PULLs (and the further WANTs of their transfers) waiting for a slot.
    waiting: SlotQueue<Msg>,
}

impl Answering {
    /// A target with the mailbox of `layout` at byte `base` of its arena (`None`: it answers
    /// no one-way WANT).
    pub fn new(layout: Option<MailboxLayout>, base: u64, linger: Duration) -> Self {
        let writer = layout.and_then(|layout| {
            // A quarter of the slots per peer: one busy or hostile initiator cannot take them all.
            let per_peer_max = (layout.slots / 4).max(1);
            MailboxWriter::new(SlotConfig { layout, per_peer_max, linger }).ok()
        });
        let waiting = SlotQueue::new(QueueConfig {
            per_peer: WAITING_PER_PEER,
            total: WAITING_TOTAL,
            units_per_peer: WAITING_UNITS_PER_PEER,
            units_total: WAITING_UNITS_TOTAL,
            // The initiator's no-progress timeout: nobody waits for the answer after it.
            wait: linger,
        });
        Self { writer, base, flows: BTreeMap::new(), linger, waiting }
    }

    /// Whether a new one-way flow `key` under `token` would get a slot now.
    ///
    /// # Errors
    /// [`OneWayRefused::NoMailbox`]; [`SlotError::PeerAtCap`] or [`SlotError::Exhausted`]
    /// when it has to [`wait`](Self::wait).
    pub fn vacancy(&mut self, now: Instant, key: FlowKey, token: Token) -> Result<(), OneWayRefused> {
        let writer = self.writer.as_mut().ok_or(OneWayRefused::NoMailbox)?;
        writer.reclaim_expired(now);
        let candidates = candidates(&record_token(token), writer.table().layout());
        writer.vacancy(key.peer, key.xfer, &candidates)?;
        Ok(())
    }

    /// Queues `msg`, the genuine opening WANT or PULL of flow `key`, which found no slot.
    ///
    /// # Errors
    /// [`OneWayRefused::NoMailbox`], or the queue is at a bound ([`OneWayRefused::Queue`]):
    /// the WANT must be dropped.
    pub fn wait(&mut self, now: Instant, key: FlowKey, msg: Msg) -> Result<(), OneWayRefused> {
        let writer = self.writer.as_ref().ok_or(OneWayRefused::NoMailbox)?;
        let token = record_token(msg.token());
        let candidates = candidates(&token, writer.table().layout());
        let units = held_units(&msg);
        self.waiting.push(now, key.peer, key.xfer, token, candidates, msg, units)?;
        Ok(())
    }

    /// True when flow `key` waits for a slot.
    pub fn is_waiting(&self, key: FlowKey) -> bool {
        self.waiting.contains(key.peer, key.xfer)
    }

    /// True when `key` is a one-way flow here, open or waiting: its frames are admitted.
    pub fn knows(&self, key: FlowKey) -> bool {
        self.is_one_way(key) || self.is_waiting(key)
    }

    /// Transfers waiting for a slot.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Units the waiting transfers' held messages cost (see [`HELD_BYTES_PER_UNIT`]).
    pub fn held_units(&self) -> u64 {
        self.waiting.units()
    }

    /// A message of flow `key`, which waits for a slot: a further WANT or PULL is held behind
    /// the opening one, a cancel takes the transfer out of the queue, anything else is ignored.
    ///
    /// # Errors
    /// [`HoldError::WrongToken`] for another token than the waiting transfer's (nothing
    /// changes); [`HoldError::Full`] when holding a further WANT would pass the queue's bounds:
    /// the whole transfer is dropped then (opened without those chunks it could only time out).
    /// A PULL is held whole, runs and all: they count against the queue's bounds.
    pub fn hold(&mut self, key: FlowKey, msg: Msg) -> Result<Held, HoldError> {
        if self.waiting.token(key.peer, key.xfer) != Some(&record_token(msg.token())) {
            return Err(HoldError::WrongToken);
        }
        if !matches!(msg, Msg::Want(_) | Msg::Pull(_)) {
            return Ok(Held::Ignored);
        }
        if msg.is_cancel() {
            self.waiting.remove(key.peer, key.xfer);
            return Ok(Held::Canceled);
        }
        let units = held_units(&msg);
        if let Err(e) = self.waiting.hold(key.peer, key.xfer, msg, units) {
            self.waiting.remove(key.peer, key.xfer);
            return Err(e.into());
        }
        Ok(Held::Kept)
    }

    /// The next waiting transfer one of whose candidate slots is free for it now, with the
    /// messages it held, opening one first (round robin across peers, oldest first per peer).
    /// The caller replays them as if they had just come; the slot is taken when the first is
    /// accepted.
    pub fn next_servable(&mut self, now: Instant) -> Option<(FlowKey, Vec<Msg>)> {
        let writer = self.writer.as_mut()?;
        if self.waiting.is_empty() {
            return None;
        }
        writer.reclaim_expired(now);
        let w = self.waiting.pop_servable(|peer, xfer, c| writer.vacancy(peer, xfer, c))?;
        Some((FlowKey { peer: w.peer, xfer: w.xfer }, w.held))
    }

    /// Waiting transfers whose initiators have given up by `now` leave the queue, and slots
    /// whose linger ended are freed; returns how many transfers left the queue.
    pub fn expire(&mut self, now: Instant) -> usize {
        if let Some(w) = self.writer.as_mut() {
            w.reclaim_expired(now);
        }
        self.waiting.expire(now).len()
    }

    /// When the waiting transfers need a call even if no message comes: the first deadline of
    /// a waiter, or the first closing slot's linger end (which frees a slot for one). With
    /// nothing waiting there is no need: whoever comes next for a slot reclaims expired ones
    /// first ([`vacancy`](Self::vacancy), `open`), as does every timeout ([`expire`](Self::expire));
    /// and the reactor asks for this twice a pass, so it must stay cheap then.
    pub fn next_timeout(&self) -> Option<Instant> {
        if self.waiting.is_empty() {
            return None;
        }
        let linger = self.writer.as_ref().and_then(MailboxWriter::next_expiry);
        self.waiting.next_deadline().into_iter().chain(linger).min()
    }

    /// True when this engine keeps a mailbox.
    pub fn has_mailbox(&self) -> bool {
        self.writer.is_some()
    }

    /// True when `key` is a one-way flow (open, or its slot still closing).
    pub fn is_one_way(&self, key: FlowKey) -> bool {
        self.flows.contains_key(&key)
    }

    /// True when one-way flow `key` has ended here (the receiver forgot it) and only its slot
    /// lingers, for the initiator's last CURSOR.
    pub fn is_closed(&self, key: FlowKey) -> bool {
        self.flows.get(&key).is_some_and(|f| f.closed)
    }

    /// True when `peer` has a one-way flow here.
    pub fn has_peer(&self, peer: PeerId) -> bool {
        self.flows.range(FlowKey::all_of(peer)).next().is_some()
    }

    /// Mailbox slots held now (open or closing).
    pub fn slots_held(&self) -> u32 {
        self.writer.as_ref().map_or(0, |w| w.table().layout().slots - w.table().free())
    }

    /// Open one-way flows (slots closing included).
    pub fn flows(&self) -> usize {
        self.flows.len()
    }

    /// A one-way WANT for a new flow `key`: gives it a slot. A further WANT of a known flow
    /// adds its chunks.
    ///
    /// # Errors
    /// [`OneWayRefused`]: the WANT must be dropped (the initiator times out).
    pub fn open(&mut self, now: Instant, key: FlowKey, token: Token, chunks: usize) -> Result<(), OneWayRefused> {
        if let Some(f) = self.flows.get_mut(&key) {
            if !f.closed {
                f.chunks += chunks;
            }
            return Ok(());
        }
        let writer = self.writer.as_mut().ok_or(OneWayRefused::NoMailbox)?;
        writer.open(now, key.peer, key.xfer, &record_token(token))?;
        self.flows.insert(key, Flow { token, chunks, scattered: 0, closed: false, canceled: false, failed: false });
        Ok(())
    }

    /// A chunk of one-way READ flow `key` was released: it counts as done, as an ACK(Scattered)
    /// does for a WRITE flow (a flow that ends with all its chunks done gets no FAIL).
    pub fn count_done(&mut self, key: FlowKey) {
        if let Some(f) = self.flows.get_mut(&key) {
            f.scattered += 1;
        }
    }

    /// A cancel of one-way flow `key` carrying `token` came: if it is the flow's, its
    /// initiator has given the transfer up and reads no more records (its `Reading` ended with
    /// the cancel, and its last CURSOR counts only what it read). Without this, the FAIL written
    /// once the receiver forgot the flow stayed unread and held the slot for the whole linger:
    /// 64 canceled transfers of one initiator within a request timeout (vLLM aborts requests
    /// routinely) stalled its later one-way transfers to this target.
    /// A flow already closed, its slot lingering for a CURSOR that counts records its
    /// initiator will now never read, is freed at once for the same reason.
    pub fn note_cancel(&mut self, key: FlowKey, token: Token) {
        match self.flows.get_mut(&key).filter(|f| f.token == token) {
            Some(f) if !f.closed => f.canceled = true,
            Some(_) => {
                if let Some(w) = self.writer.as_mut() {
                    w.drop_transfer(key.peer, key.xfer);
                }
                self.flows.remove(&key);
            }
            None => {}
        }
    }

    /// The token of one-way flow `key`, for the frames that name it.
    pub fn token(&self, key: FlowKey) -> Option<Token> {
        self.flows.get(&key).map(|f| f.token)
    }

    /// A CURSOR from the flow's initiator (its token already checked by the caller); returns
    /// the record writes it released (answers held back for ring room).
    ///
    /// # Errors
    /// As [`MailboxWriter::handle_consumed`]: a cursor past the records written.
    pub fn handle_cursor(
        &mut self,
        now: Instant,
        key: FlowKey,
        consumed: u64,
        out: &mut std::collections::VecDeque<Action>,
    ) -> Result<usize, SlotError> {
        let Some(w) = self.writer.as_mut() else { return Ok(0) };
        w.handle_consumed(now, key.peer, key.xfer, Seq(consumed))?;
        if self.flows.get(&key).is_some_and(|f| f.closed) && w.table().slot_of(key.peer, key.xfer).is_none() {
            self.flows.remove(&key);
        }
        Ok(Self::put_records(self.base, w, out))
    }

    /// Takes the GRANTs and ACKs for one-way flows out of `out` and queues them as records;
    /// closes the slots of flows the receiver no longer has (`alive` says which it has), with a
    /// FAIL record first when they ended early; then appends the record writes to `out`.
    /// Returns how many records it appended.
    pub fn translate(
        &mut self,
        now: Instant,
        out: &mut std::collections::VecDeque<Action>,
        alive: impl Fn(FlowKey) -> bool,
        shutting_down: bool,
    ) -> usize {
        let Some(writer) = self.writer.as_mut() else { return 0 };
        if self.flows.is_empty() {
            // Only writes queued without a flow left: a released peer's unread records
            // overwritten (`release_peer`).
            return Self::put_records(self.base, writer, out);
        }
        let flows = &mut self.flows;
        let mut kept = std::collections::VecDeque::with_capacity(out.len());
        for action in out.drain(..) {
            let (peer, answers): (PeerId, Vec<Answer>) = match &action {
                Action::Send { peer, msg: Msg::Grant(g) } if is_open(flows, *peer, g.xfer) => {
                    (*peer, g.credits.iter().map(|&c| Answer::Grant(c)).collect())
                }
                Action::Send { peer, msg: Msg::Ack(a) } if is_open(flows, *peer, a.xfer) => {
                    let credit = Credit { chunk: a.chunk, region: a.region };
                    (*peer, vec![Answer::Ack { credit, status: a.status }])
                }
                _ => {
                    kept.push_back(action);
                    continue;
                }
            };
            let xfer = action_xfer(&action);
            let key = FlowKey { peer, xfer };
            for answer in answers {
                match (&answer, flows.get_mut(&key)) {
                    (Answer::Ack { status: AckStatus::Scattered, .. }, Some(f)) => f.scattered += 1,
                    (Answer::Ack { status: AckStatus::Refused | AckStatus::Failed, .. }, Some(f)) => f.failed = true,
                    _ => {}
                }
                // The receiver answers with regions it allocated, or a refused DATA's region,
                // which the wire bounded: never invalid (the writer fails the flow if it were).
                if let Err(e) = writer.answer(peer, xfer, answer) {
                    crate::event::internal_error("mailbox answer refused", &e);
                }
            }
        }
        *out = kept;
        // Flows the receiver has forgotten: their last answer is queued; close their slots.
        let ended: Vec<FlowKey> = flows.iter().filter(|(k, f)| !f.closed && !alive(**k)).map(|(k, _)| *k).collect();
        for key in ended {
            let Some(f) = flows.get_mut(&key) else { continue };
            if f.canceled {
                // Nobody will read a FAIL, nor report the records read: free the slot now.
                f.closed = true;
                writer.drop_transfer(key.peer, key.xfer);
                continue;
            }
            if f.scattered < f.chunks && !f.failed {
                let reason = if shutting_down { FailReason::Shutdown } else { FailReason::TimedOut };
                let _ = writer.answer(key.peer, key.xfer, Answer::Fail(reason));
            }
            f.closed = true;
            writer.close(now, key.peer, key.xfer);
        }
        // Slots freed (read to the end, or lingered out): forget their flows.
        flows.retain(|k, f| !f.closed || writer.table().slot_of(k.peer, k.xfer).is_some());
        Self::put_records(self.base, writer, out)
    }

    /// Appends the writer's queued record writes to `out`, in order; returns how many records
    /// (places cleared not counted).
    fn put_records(base: u64, writer: &mut MailboxWriter, out: &mut std::collections::VecDeque<Action>) -> usize {
        let mut written = 0;
        while let Some(w) = writer.poll_write() {
            written += usize::from(!w.is_clear());
            out.push_back(Action::PutRecord { offset: base + w.offset, bytes: w.bytes });
        }
        written
    }

    /// Whether anything here belongs to `peer`: a one-way flow (open or lingering), a slot, a
    /// transfer waiting for one.
    pub fn holds(&self, peer: PeerId) -> bool {
        self.has_peer(peer) || self.waiting.waiting_of(peer) > 0 || self.writer.as_ref().is_some_and(|w| w.holds(peer))
    }

    /// The peer is gone: its slots are freed at once, and its waiting transfers leave.
    pub fn release_peer(&mut self, peer: PeerId) {
        if let Some(w) = self.writer.as_mut() {
            w.release_peer(peer);
        }
        self.flows.retain(|k, _| k.peer != peer);
        self.waiting.release_peer(peer);
    }

    /// How long a closed slot waits for its last CURSOR.
    pub fn linger(&self) -> Duration {
        self.linger
    }
}

fn is_open(flows: &BTreeMap<FlowKey, Flow>, peer: PeerId, xfer: XferId) -> bool {
    flows.get(&FlowKey { peer, xfer }).is_some_and(|f| !f.closed)
}

fn action_xfer(a: &Action) -> XferId {
    match a {
        Action::Send { msg, .. } => msg.xfer(),
        _ => XferId(0),
    }
}

/// The mailbox's key material for a transfer token.
pub fn record_token(token: Token) -> mailbox::Token {
    mailbox::Token(token.0.to_le_bytes())
}

/// One one-way transfer of ours, as the initiator reads its answers.
#[derive(Debug)]
struct Reader {
    peer: PeerId,
    token: Token,
    reader: MailboxReader,
    /// The cursor last reported to the target.
    reported: u64,
    ring: u32,
    /// When the last image was handled (before any, when reading started).
    looked: Instant,
}

/// What one fetch READs: regions of the target's mailbox, back to back into the transfer's
/// fetch slice.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fetch {
    /// The transfer.
    pub xfer: XferId,
    /// The target.
    pub peer: PeerId,
    /// Regions relative to the target's mailbox base.
    pub regions: Vec<Region>,
}

/// An answer read from a mailbox, as the message the sender would have received as a frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Read {
    /// A GRANT or ACK for the sender.
    Msg(PeerId, Msg),
    /// The target ended the transfer (a FAIL record) or broke the protocol.
    Failed(XferId, FailReason),
}

/// The initiator's side: a mailbox reader per one-way transfer.
#[derive(Debug, Default)]
pub struct Reading {
    readers: BTreeMap<XferId, Reader>,
    /// Records refused by every reader so far (see [`Reading::refused`]).
    refused: u64,
}

impl Reading {
    /// Starts reading transfer `xfer`'s answers from `peer`'s mailbox of shape `layout`.
    ///
    /// # Errors
    /// The layout is out of bounds (checked before by [`peer_layout`], so never in practice).
    pub fn start(
        &mut self,
        now: Instant,
        xfer: XferId,
        peer: PeerId,
        token: Token,
        layout: MailboxLayout,
    ) -> Result<(), ReaderError> {
        let reader = MailboxReader::locate(layout, xfer, &record_token(token))?;
        self.readers.insert(xfer, Reader { peer, token, reader, reported: 0, ring: layout.ring, looked: now });
        Ok(())
    }

    /// True when `xfer` is read one way.
    pub fn contains(&self, xfer: XferId) -> bool {
        self.readers.contains_key(&xfer)
    }

    /// True when some one-way transfer of ours goes to `peer`.
    pub fn has_peer(&self, peer: PeerId) -> bool {
        self.readers.values().any(|r| r.peer == peer)
    }

    /// One-way transfers being read.
    pub fn len(&self) -> usize {
        self.readers.len()
    }

    /// True when none is.
    pub fn is_empty(&self) -> bool {
        self.readers.is_empty()
    }

    /// What to READ for transfer `xfer` now (`None`: not a one-way transfer of ours).
    pub fn fetch(&self, xfer: XferId) -> Option<Fetch> {
        let r = self.readers.get(&xfer)?;
        Some(Fetch { xfer, peer: r.peer, regions: r.reader.fetch() })
    }

    /// The one-way transfers being read, lowest id first.
    pub fn xfers(&self) -> impl Iterator<Item = XferId> + '_ {
        self.readers.keys().copied()
    }

    /// The bytes a fetch of `xfer` READ: the new answers, in order, as messages for the sender
    /// (or the end of the transfer), and, when half a ring has been read since the last report,
    /// a CURSOR for the target. Returns how many records were new.
    ///
    /// `written_after` is set to about when the records new in this image were written at the
    /// earliest: when the previous image was handled (they were not in it; it was read a fetch's
    /// round trip before, which the lease's three quarters of slack cover), or, for the first,
    /// when the reading started (the WANT or PULL went out then). A credit's age counts from
    /// there, not from now: a GRANT that lay unread (the transfer had no fetch slice) must not
    /// pass for a fresh one (review 60, mailbox H1).
    pub fn handle_fetched(
        &mut self,
        (now, written_after): (Instant, &mut Instant),
        xfer: XferId,
        image: &[u8],
        out: &mut Vec<Read>,
        cursor: &mut Option<(PeerId, Msg)>,
    ) -> usize {
        let Some(r) = self.readers.get_mut(&xfer) else { return 0 };
        *written_after = std::mem::replace(&mut r.looked, now).min(now);
        let refused_before = r.reader.stats().refused;
        let fetched = r.reader.handle_fetched(image);
        self.refused += r.reader.stats().refused - refused_before;
        let Ok(got) = fetched else {
            // The target broke the protocol (a record it alone could have written skips one
            // or names another transfer): the transfer fails.
            out.push(Read::Failed(xfer, FailReason::Refused));
            self.readers.remove(&xfer);
            return 0;
        };
        while let Some((_, answer)) = r.reader.poll_answer() {
            let (token, peer) = (r.token, r.peer);
            out.push(match answer {
                Answer::Grant(c) => Read::Msg(peer, Msg::Grant(Grant { xfer, token, credits: vec![c] })),
                Answer::Ack { credit, status } => {
                    Read::Msg(peer, Msg::Ack(Ack { xfer, token, chunk: credit.chunk, region: credit.region, status }))
                }
                // A READY belongs to a READ, which this initiator never asked of a one-way flow.
                Answer::Ready(_) => Read::Failed(xfer, FailReason::Refused),
                Answer::Fail(reason) => Read::Failed(xfer, reason),
            });
        }
        let consumed = r.reader.consumed().0;
        if consumed >= r.reported + u64::from(r.ring / 2).max(1) {
            r.reported = consumed;
            *cursor = Some((r.peer, Msg::Cursor(Cursor { xfer, token: r.token, consumed })));
        }
        got
    }

    /// Mailbox records refused so far, by every transfer's reader: records at the position read
    /// next that did not verify under the transfer's token or sat in another slot or position
    /// than they name (a third party's forgery or replay, or a READ torn by the target's own
    /// write), each counted every time it is read.
    pub fn refused(&self) -> u64 {
        self.refused
    }

    /// Transfer `xfer` ended: stops reading it, and returns the final CURSOR that frees its
    /// slot at the target (when something was read since the last report). After a failure
    /// the target may still write a FAIL past it; the slot then lingers out instead.
    pub fn finish(&mut self, xfer: XferId) -> Option<(PeerId, Msg)> {
        let r = self.readers.remove(&xfer)?;
        let consumed = r.reader.consumed().0;
        (consumed > r.reported).then_some((r.peer, Msg::Cursor(Cursor { xfer, token: r.token, consumed })))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ControlKind, MemKind};

    /// The ring holds 2W + 2 records, within the layout's bounds, whatever the window.
    #[test]
    fn the_ring_follows_the_window_within_its_bounds_even_for_the_largest_window() {
        let ring = |w| OneWayLayout::for_config(&Config { max_inflight_chunks: w, ..Config::default() }).mailbox.ring;
        assert_eq!(ring(8), 18);
        assert_eq!(ring(1), CANDIDATES as u32, "at least one record per candidate slot");
        assert_eq!(ring(u32::MAX / 2 + 1), MailboxLayout::MAX_RING, "no overflow");
        assert_eq!(ring(u32::MAX), MailboxLayout::MAX_RING);
    }

    #[test]
    fn a_peers_mailbox_is_used_only_inside_the_registration_it_advertised() {
        let layout = MailboxLayout { slots: 16, ring: 8 };
        let caps = |offset, mailbox_len| wire::Capabilities {
            wire_version: wire::WIRE_VERSION.into(),
            control: ControlKind::Ucx,
            session: 1,
            arenas: wire::Arenas::one(wire::ArenaCaps {
                mem: MemKind::Vram,
                dev: 0,
                base: 0x10_0000,
                len: 1 << 30,
                usable_capacity: 1 << 30,
                max_chunk: 1 << 20,
                key: b"a".to_vec(),
            }),
            endpoint: Vec::new(),
            mailbox: Some(MailboxCaps { offset, slots: layout.slots, ring: layout.ring }),
            mailbox_base: 0x7f00_0000_0000,
            mailbox_len,
            mailbox_key: b"m".to_vec(),
            request_timeout_ms: 10_000,
        };
        let fits = layout.byte_len();
        assert_eq!(peer_layout(&caps(0, fits)), Some(layout), "exactly its registration");
        assert_eq!(peer_layout(&caps(64, fits + 64)), Some(layout));
        // Past the end of its registration, however large the arena: never bounced to one way.
        assert_eq!(peer_layout(&caps(64, fits)), None);
        assert_eq!(peer_layout(&caps(u64::MAX - 8, fits)), None, "no wrap-around");
        let shape = wire::Capabilities { mailbox: Some(MailboxCaps { offset: 0, slots: 0, ring: 8 }), ..caps(0, fits) };
        assert_eq!(peer_layout(&shape), None, "a shape that does not validate");
        // Our own advertisement: at the start of the one-way area, which holds it and the
        // fetch area.
        let ours = OneWayLayout::for_config(&Config::default());
        let ad = ours.advertised();
        assert_eq!((ad.offset, ad.slots, ad.ring), (0, ours.mailbox.slots, ours.mailbox.ring));
        let mine = MailboxLayout { slots: ad.slots, ring: ad.ring };
        assert!(mine.byte_len() < ours.area_len());
        assert_eq!(ours.fetch_offset - ours.mailbox.offset, mine.byte_len(), "the fetch area follows");
        assert_eq!(ours.area_len(), mine.byte_len() + ours.fetch_slice * u64::from(ours.fetch_slices));
    }

    #[test]
    fn reading_takes_no_foreign_record_and_counts_none_while_locating() {
        let layout = MailboxLayout { slots: 16, ring: 8 };
        let (xfer, mut reading, t) = (XferId(9), Reading::default(), Instant::now());
        reading.start(t, xfer, PeerId(1), Token(0x5eed), layout).expect("layout in bounds");
        let len: u64 = reading.fetch(xfer).expect("reading it").regions.iter().map(|r| r.len).sum();
        let (mut out, mut cursor, mut after) = (Vec::new(), None, t);
        // Nothing written yet: not a refusal.
        let later = t + Duration::from_millis(5);
        assert_eq!(reading.handle_fetched((later, &mut after), xfer, &vec![0; len as usize], &mut out, &mut cursor), 0);
        assert_eq!(after, t, "the first image's records were written after the reading started");
        assert_eq!(reading.refused(), 0);
        // A record under another key in the first candidate slot (another transfer's slot, or a
        // third party's): passed over, not counted (review 60, mailbox L1: while locating,
        // every look at a candidate held by another transfer counted one).
        let mut image = vec![0u8; len as usize];
        image[..RECORD_LEN].fill(0xa5);
        image[0] = 1;
        for n in 1..=3 {
            let now = later + Duration::from_millis(n);
            assert_eq!(reading.handle_fetched((now, &mut after), xfer, &image, &mut out, &mut cursor), 0);
            assert_eq!(reading.refused(), 0);
            assert_eq!(after, now - Duration::from_millis(1), "a later image's: after the one before was handled");
        }
        assert!(out.is_empty() && cursor.is_none(), "a refused record became an answer: {out:?}");
    }
}
