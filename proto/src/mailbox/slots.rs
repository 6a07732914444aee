//! The target's side of the mailbox: where the mailbox sits in the arena ([`MailboxLayout`]),
//! which transfer owns which slot ([`SlotTable`]), and the sequence and ring position of every
//! record the target writes.
//!
//! A slot is a ring of `ring` records owned by one transfer from its WANT until the initiator
//! has read its last record. Which slot: the first free one of the transfer's
//! [`candidates`], a short list both sides derive from the transfer's secret token, so the
//! initiator knows where to look without the target telling it (the target cannot tell it
//! anything before the first record), and no other peer can predict or aim at it. The target writes record `seq` at ring position `(seq - 1) % ring`
//! and never overwrites a record the initiator has not reported consumed (the initiator's
//! frames carry its cursor), so an initiator that reads slowly loses nothing. Slots are
//! bounded per peer: one initiator, hostile or just busy, holds at most `per_peer_max` slots,
//! so it can never take the slots other initiators need.
//!
//! Pure bookkeeping over indices: no clock (time comes in as `now`), no memory, no IO. The
//! initiator's side is `reader`.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use crate::types::{PeerId, Region, XferId};

use super::record::{RECORD_LEN, Seq, SlotId, Token};

/// Where the mailbox's slots lie: `slots` rings of `ring` records, packed from the mailbox's
/// base (which the target advertises with its arena). Both sides compute offsets from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MailboxLayout {
    /// Number of slots.
    pub slots: u32,
    /// Records per slot.
    pub ring: u32,
}

impl MailboxLayout {
    /// Most slots a mailbox may have (4 MiB of records at the largest ring).
    pub const MAX_SLOTS: u32 = 1 << 12;
    /// Most records per slot.
    pub const MAX_RING: u32 = 1 << 10;

    /// Checks the layout against its bounds (both sides check: a peer's advertised layout is
    /// untrusted input).
    ///
    /// # Errors
    /// [`SlotError::BadLayout`] when a count is 0 (or a ring below 2) or above its cap.
    pub fn validate(&self) -> Result<(), SlotError> {
        if !(1..=Self::MAX_SLOTS).contains(&self.slots) || !(2..=Self::MAX_RING).contains(&self.ring) {
            return Err(SlotError::BadLayout { slots: self.slots, ring: self.ring });
        }
        Ok(())
    }

    /// Bytes the whole mailbox takes.
    pub fn byte_len(&self) -> u64 {
        u64::from(self.slots) * self.ring_bytes()
    }

    /// Bytes of one slot's ring (what one initiator READ fetches).
    pub fn ring_bytes(&self) -> u64 {
        u64::from(self.ring) * RECORD_LEN as u64
    }

    /// The slot's ring, relative to the mailbox base; `None` for a slot outside the layout.
    pub fn slot_region(&self, slot: SlotId) -> Option<Region> {
        (slot.0 < self.slots).then(|| Region { offset: u64::from(slot.0) * self.ring_bytes(), len: self.ring_bytes() })
    }

    /// Ring position (record index within the slot) of sequence number `seq` (>= 1).
    pub fn position(&self, seq: Seq) -> u32 {
        // ring >= 1, and the remainder is < ring: it fits u32
        (seq.0.wrapping_sub(1) % u64::from(self.ring)) as u32
    }

    /// Where record `seq` of `slot` lies, relative to the mailbox base.
    fn place(&self, slot: SlotId, seq: Seq) -> RecordPlace {
        let base = self.slot_region(slot).map_or(0, |r| r.offset);
        RecordPlace { slot, seq, offset: base + u64::from(self.position(seq)) * RECORD_LEN as u64 }
    }
}

/// How many candidate slots a transfer has: enough that a peer holding its whole share of
/// slots rarely covers all of another transfer's candidates (with a quarter of the slots held,
/// (1/4)^8 < 2e-5), few enough that locating costs one small READ of 8 records.
pub const CANDIDATES: usize = 8;

/// BLAKE3 key-derivation context of the candidate list (distinct from the MAC key's).
const CANDIDATE_CONTEXT: &str = "nixl-bounce 2026-11 mailbox slot candidates v1";

/// The slots a transfer under `token` may get, in the target's order of preference, without
/// repeats (fewer than [`CANDIDATES`] when the mailbox is small). Both sides compute it: the
/// target allocates the first free one, the initiator READs the first record of each until
/// one verifies.
pub fn candidates(token: &Token, layout: MailboxLayout) -> Vec<SlotId> {
    let words = blake3::derive_key(CANDIDATE_CONTEXT, &token.0);
    let mut out = Vec::with_capacity(CANDIDATES);
    for w in words.chunks_exact(4).take(CANDIDATES) {
        let v = u32::from_le_bytes([w[0], w[1], w[2], w[3]]) % layout.slots.max(1);
        if !out.contains(&SlotId(v)) {
            out.push(SlotId(v));
        }
    }
    out
}

/// Where the target must write its next record of a transfer (offsets relative to the
/// mailbox base).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordPlace {
    /// The slot.
    pub slot: SlotId,
    /// The sequence number to put in the record.
    pub seq: Seq,
    /// Byte offset of the record from the mailbox base.
    pub offset: u64,
}

/// Configuration of a [`SlotTable`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotConfig {
    /// The mailbox's shape.
    pub layout: MailboxLayout,
    /// Most slots one peer may hold at once (open or closing).
    pub per_peer_max: u32,
    /// How long a closed slot waits for its initiator to report its last record read before
    /// it is reused anyway (a peer that never reports cannot pin it).
    pub linger: Duration,
}

/// Why a slot operation was refused. Peer-caused refusals are ordinary outcomes the target
/// answers (a queued or refused WANT), never panics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SlotError {
    /// The layout's counts are out of bounds.
    #[error("mailbox layout of {slots} slots x {ring} records is out of bounds")]
    BadLayout {
        /// Slots asked for.
        slots: u32,
        /// Ring length asked for.
        ring: u32,
    },
    /// `per_peer_max` is 0 or above the slot count.
    #[error("per-peer slot cap {max} must be in 1..={slots}")]
    BadCap {
        /// The cap asked for.
        max: u32,
        /// Slots in the layout.
        slots: u32,
    },
    /// The peer already holds its share of slots.
    #[error("peer {peer:?} already holds {held} slots (the cap)")]
    PeerAtCap {
        /// The peer.
        peer: PeerId,
        /// Slots it holds.
        held: u32,
    },
    /// Every candidate slot of the transfer is held: its WANT waits for one to be freed.
    #[error("no free candidate slot")]
    Exhausted,
    /// This transfer of this peer already has a slot (a duplicated WANT).
    #[error("transfer {xfer:?} of {peer:?} already holds {slot:?}")]
    AlreadyHeld {
        /// The peer.
        peer: PeerId,
        /// Its transfer.
        xfer: XferId,
        /// The slot it holds.
        slot: SlotId,
    },
    /// The slot is not open (free, closing, or outside the layout).
    #[error("{slot:?} is not open")]
    NotOpen {
        /// The slot.
        slot: SlotId,
    },
    /// The peer holds no slot for that transfer (never had one, or it was freed): a stale or
    /// lying cursor report.
    #[error("{peer:?} holds no slot for {xfer:?}")]
    UnknownTransfer {
        /// The peer that reported.
        peer: PeerId,
        /// The transfer it named.
        xfer: XferId,
    },
    /// An answer no initiator could decode (an empty or overflowing region): a FAIL was
    /// written in its place.
    #[error("invalid mailbox answer for {xfer:?} of {peer:?}: a FAIL was written instead")]
    InvalidAnswer {
        /// The peer it was for.
        peer: PeerId,
        /// Its transfer.
        xfer: XferId,
    },
    /// The initiator has not consumed enough records to free the ring position the next one
    /// needs; the target keeps the answer until it has.
    #[error("{slot:?}'s ring is full")]
    RingFull {
        /// The slot.
        slot: SlotId,
    },
    /// An initiator reported a cursor past the last record written.
    #[error("{slot:?}: consumed cursor {claimed} is past the last record written {written}")]
    CursorAhead {
        /// The slot.
        slot: SlotId,
        /// The cursor reported.
        claimed: u64,
        /// The last sequence number written.
        written: u64,
    },
}

/// The transfer a slot belongs to and its two cursors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Holder {
    peer: PeerId,
    xfer: XferId,
    /// Last sequence number written (0: none yet).
    written: u64,
    /// Last sequence number the initiator reported read.
    consumed: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SlotState {
    Free,
    /// Taking records.
    Open(Holder),
    /// Its transfer ended; waiting for the initiator to read the last record, or `until`.
    Closing(Holder, Instant),
}

/// The target's slot allocator and record sequencer.
///
/// Call order, per transfer: [`allocate`](Self::allocate) on its WANT, with the transfer's
/// [`candidates`] (a WANT refused with [`SlotError::Exhausted`] or [`SlotError::PeerAtCap`]
/// waits in a [`SlotQueue`](super::SlotQueue) until [`vacancy`](Self::vacancy) finds it a
/// slot: after a close, a CURSOR, a peer release, or at [`next_expiry`](Self::next_expiry));
/// then for each answer [`place`](Self::place)
/// and write the record there; [`handle_consumed`](Self::handle_consumed) whenever a frame of
/// the initiator reports its cursor; [`close`](Self::close) after the last record (or on
/// cancel / timeout); [`release_peer`](Self::release_peer) when the peer is lost.
/// A closed slot is reused once its initiator reports the last record read, or after
/// `linger`: [`allocate`](Self::allocate) reclaims expired slots itself, so there is no timer.
#[derive(Debug)]
pub struct SlotTable {
    cfg: SlotConfig,
    slots: Vec<SlotState>,
    by_xfer: BTreeMap<(PeerId, XferId), SlotId>,
    held: BTreeMap<PeerId, u32>,
}

impl SlotTable {
    /// An empty table.
    ///
    /// # Errors
    /// [`SlotError::BadLayout`] or [`SlotError::BadCap`] for an impossible configuration.
    pub fn new(cfg: SlotConfig) -> Result<Self, SlotError> {
        cfg.layout.validate()?;
        if cfg.per_peer_max == 0 || cfg.per_peer_max > cfg.layout.slots {
            return Err(SlotError::BadCap { max: cfg.per_peer_max, slots: cfg.layout.slots });
        }
        Ok(Self {
            cfg,
            slots: vec![SlotState::Free; cfg.layout.slots as usize],
            by_xfer: BTreeMap::new(),
            held: BTreeMap::new(),
        })
    }

    /// The mailbox's shape.
    pub fn layout(&self) -> MailboxLayout {
        self.cfg.layout
    }

    /// Slots `peer` holds (open or closing).
    pub fn held_by(&self, peer: PeerId) -> u32 {
        self.held.get(&peer).copied().unwrap_or(0)
    }

    /// The slot of `peer`'s transfer `xfer`, if it holds one.
    pub fn slot_of(&self, peer: PeerId, xfer: XferId) -> Option<SlotId> {
        self.by_xfer.get(&(peer, xfer)).copied()
    }

    /// How long a closed slot waits for its last record to be reported read.
    pub fn linger(&self) -> std::time::Duration {
        self.cfg.linger
    }

    /// Slots that are free now (not counting closing slots whose linger has expired).
    pub fn free(&self) -> u32 {
        self.slots.iter().filter(|s| matches!(s, SlotState::Free)).count() as u32
    }

    /// Gives `peer`'s transfer `xfer` the first free slot of `candidates` (slots outside the
    /// layout are skipped).
    ///
    /// # Errors
    /// [`SlotError::AlreadyHeld`], [`SlotError::PeerAtCap`] or [`SlotError::Exhausted`]; the
    /// table is unchanged then (apart from reclaiming expired slots).
    pub fn allocate(
        &mut self,
        now: Instant,
        peer: PeerId,
        xfer: XferId,
        candidates: &[SlotId],
    ) -> Result<SlotId, SlotError> {
        self.reclaim_expired(now);
        let slot = self.vacancy(peer, xfer, candidates)?;
        self.slots[slot.0 as usize] = SlotState::Open(Holder { peer, xfer, written: 0, consumed: 0 });
        self.by_xfer.insert((peer, xfer), slot);
        *self.held.entry(peer).or_insert(0) += 1;
        Ok(slot)
    }

    /// The slot [`allocate`](Self::allocate) would give `peer`'s transfer `xfer` now, without
    /// taking it, so a waiting WANT is judged only once it is sure of a slot. Unlike
    /// `allocate` it does not reclaim expired slots: call
    /// [`reclaim_expired`](Self::reclaim_expired) first (once for a whole queue of waiters).
    ///
    /// # Errors
    /// As [`allocate`](Self::allocate).
    pub fn vacancy(&self, peer: PeerId, xfer: XferId, candidates: &[SlotId]) -> Result<SlotId, SlotError> {
        if let Some(slot) = self.slot_of(peer, xfer) {
            return Err(SlotError::AlreadyHeld { peer, xfer, slot });
        }
        let held = self.held_by(peer);
        if held >= self.cfg.per_peer_max {
            return Err(SlotError::PeerAtCap { peer, held });
        }
        candidates
            .iter()
            .copied()
            .find(|c| matches!(self.slots.get(c.0 as usize), Some(SlotState::Free)))
            .ok_or(SlotError::Exhausted)
    }

    /// When the first closing slot's linger ends (it frees then even if never reported read):
    /// the wake-up a waiting WANT needs when nothing else will free a slot.
    pub fn next_expiry(&self) -> Option<Instant> {
        self.slots
            .iter()
            .filter_map(|s| match s {
                SlotState::Closing(_, until) => Some(*until),
                _ => None,
            })
            .min()
    }

    /// Assigns the next record of the transfer in `slot` its sequence number and place.
    ///
    /// # Errors
    /// [`SlotError::NotOpen`] when the slot is not open; [`SlotError::RingFull`] when the
    /// record would overwrite one the initiator has not consumed (nothing is assigned then).
    pub fn place(&mut self, slot: SlotId) -> Result<RecordPlace, SlotError> {
        let layout = self.cfg.layout;
        let Some(SlotState::Open(h)) = self.slots.get_mut(slot.0 as usize) else {
            return Err(SlotError::NotOpen { slot });
        };
        let seq = h.written + 1;
        if seq - h.consumed > u64::from(layout.ring) {
            return Err(SlotError::RingFull { slot });
        }
        h.written = seq;
        Ok(layout.place(slot, Seq(seq)))
    }

    /// The places of the records in `slot` written and not yet reported read, oldest first
    /// (none for a slot not held).
    pub fn unread(&self, slot: SlotId) -> Vec<RecordPlace> {
        let h = match self.slots.get(slot.0 as usize) {
            Some(SlotState::Open(h) | SlotState::Closing(h, _)) => *h,
            _ => return Vec::new(),
        };
        (h.consumed + 1..=h.written).map(|seq| self.cfg.layout.place(slot, Seq(seq))).collect()
    }

    /// The initiator `from` reports it has read every record of its transfer `xfer` up to
    /// `upto` (reports name the transfer, not the slot, so a late report of a finished
    /// transfer can never move the cursor of the slot's next holder). Stale (lower) cursors
    /// are ignored; a closing slot whose last record is read becomes free.
    ///
    /// # Errors
    /// [`SlotError::UnknownTransfer`] when `from` holds no slot for `xfer`;
    /// [`SlotError::CursorAhead`] for a cursor past the last record written (a lying or broken
    /// peer).
    pub fn handle_consumed(&mut self, from: PeerId, xfer: XferId, upto: Seq) -> Result<(), SlotError> {
        let slot = self.slot_of(from, xfer).ok_or(SlotError::UnknownTransfer { peer: from, xfer })?;
        let h = match &mut self.slots[slot.0 as usize] {
            SlotState::Open(h) | SlotState::Closing(h, _) => h,
            SlotState::Free => return Err(SlotError::UnknownTransfer { peer: from, xfer }),
        };
        if upto.0 > h.written {
            return Err(SlotError::CursorAhead { slot, claimed: upto.0, written: h.written });
        }
        h.consumed = h.consumed.max(upto.0);
        let drained = h.consumed == h.written;
        if drained && matches!(self.slots[slot.0 as usize], SlotState::Closing(..)) {
            self.free_slot(slot);
        }
        Ok(())
    }

    /// Ends the transfer in `slot`: no more records; the slot is reused once the initiator has
    /// read the last one, or `linger` after `now`. Closing a slot that is not open does nothing.
    pub fn close(&mut self, now: Instant, slot: SlotId) {
        if let Some(SlotState::Open(h)) = self.slots.get(slot.0 as usize).copied() {
            if h.consumed == h.written {
                self.free_slot(slot);
            } else {
                self.slots[slot.0 as usize] = SlotState::Closing(h, now + self.cfg.linger);
            }
        }
    }

    /// The peer is gone: every slot it holds is freed at once (nobody will read them), and
    /// returned, lowest first, so the caller can fail those transfers.
    pub fn release_peer(&mut self, peer: PeerId) -> Vec<SlotId> {
        let mut out: Vec<SlotId> =
            self.by_xfer.range((peer, XferId(0))..=(peer, XferId(u64::MAX))).map(|(_, &s)| s).collect();
        out.sort();
        for &slot in &out {
            self.free_slot(slot);
        }
        out
    }

    /// Frees `slot` now, open or closing (its transfer is over and nobody reads it any more).
    pub fn release_slot(&mut self, slot: SlotId) {
        if (slot.0 as usize) < self.slots.len() {
            self.free_slot(slot);
        }
    }

    /// Frees every closing slot whose linger has ended by `now`.
    pub fn reclaim_expired(&mut self, now: Instant) {
        let expired: Vec<SlotId> = (0..self.slots.len())
            .filter(|&i| matches!(self.slots[i], SlotState::Closing(_, until) if until <= now))
            .map(|i| SlotId(i as u32))
            .collect();
        for slot in expired {
            self.free_slot(slot);
        }
    }

    fn free_slot(&mut self, slot: SlotId) {
        let i = slot.0 as usize;
        if let SlotState::Open(h) | SlotState::Closing(h, _) = self.slots[i] {
            self.by_xfer.remove(&(h.peer, h.xfer));
            if let Some(n) = self.held.get_mut(&h.peer) {
                *n -= 1;
                if *n == 0 {
                    self.held.remove(&h.peer);
                }
            }
        }
        self.slots[i] = SlotState::Free;
    }

    /// Checks the table's bookkeeping against its slots (tests and fuzzing).
    ///
    /// # Panics
    /// When the per-peer counts, the transfer index or a cursor disagree with the slots.
    pub fn assert_consistent(&self) {
        let mut held: BTreeMap<PeerId, u32> = BTreeMap::new();
        let mut live = 0;
        for (i, s) in self.slots.iter().enumerate() {
            if let SlotState::Open(h) | SlotState::Closing(h, _) = s {
                live += 1;
                *held.entry(h.peer).or_insert(0) += 1;
                assert_eq!(self.by_xfer.get(&(h.peer, h.xfer)), Some(&SlotId(i as u32)));
                assert!(h.consumed <= h.written && h.written - h.consumed <= u64::from(self.cfg.layout.ring));
            }
        }
        assert_eq!(held, self.held);
        assert_eq!(self.by_xfer.len(), live);
        assert!(self.held.values().all(|&n| n <= self.cfg.per_peer_max));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every slot, lowest first, as a candidate list.
    fn all() -> Vec<SlotId> {
        (0..16).map(SlotId).collect()
    }

    fn table(slots: u32, ring: u32, cap: u32) -> SlotTable {
        SlotTable::new(SlotConfig {
            layout: MailboxLayout { slots, ring },
            per_peer_max: cap,
            linger: Duration::from_millis(100),
        })
        .unwrap()
    }

    #[test]
    fn candidates_are_distinct_in_range_and_token_bound() {
        let l = MailboxLayout { slots: 256, ring: 8 };
        let a = candidates(&Token([1; 16]), l);
        assert_eq!(a, candidates(&Token([1; 16]), l), "both sides derive the same list");
        assert_ne!(a, candidates(&Token([2; 16]), l));
        assert!(a.len() >= CANDIDATES - 1 && a.iter().all(|s| s.0 < 256));
        let mut d = a.clone();
        d.sort();
        d.dedup();
        assert_eq!(d.len(), a.len());
        // a two-slot mailbox: at most both slots
        assert!(candidates(&Token([1; 16]), MailboxLayout { slots: 2, ring: 8 }).len() <= 2);
    }

    #[test]
    fn only_free_candidates_are_given() {
        let now = Instant::now();
        let mut t = table(8, 4, 8);
        assert_eq!(t.allocate(now, PeerId(1), XferId(1), &[SlotId(5), SlotId(2)]), Ok(SlotId(5)));
        assert_eq!(t.allocate(now, PeerId(1), XferId(2), &[SlotId(5), SlotId(2)]), Ok(SlotId(2)));
        assert_eq!(
            t.allocate(now, PeerId(1), XferId(3), &[SlotId(5), SlotId(2), SlotId(99)]),
            Err(SlotError::Exhausted)
        );
        assert_eq!(t.free(), 6);
    }

    #[test]
    fn layout_offsets() {
        let l = MailboxLayout { slots: 4, ring: 8 };
        assert_eq!(l.byte_len(), 4 * 8 * 64);
        assert_eq!(l.slot_region(SlotId(2)), Some(Region { offset: 2 * 512, len: 512 }));
        assert_eq!(l.slot_region(SlotId(4)), None);
        assert_eq!(l.position(Seq(1)), 0);
        assert_eq!(l.position(Seq(8)), 7);
        assert_eq!(l.position(Seq(9)), 0);
    }

    #[test]
    fn bad_configs_are_refused() {
        for (slots, ring) in [(0, 8), (1, 1), (MailboxLayout::MAX_SLOTS + 1, 8), (1, MailboxLayout::MAX_RING + 1)] {
            assert_eq!(MailboxLayout { slots, ring }.validate(), Err(SlotError::BadLayout { slots, ring }));
        }
        let cfg = |per_peer_max| SlotConfig {
            layout: MailboxLayout { slots: 4, ring: 4 },
            per_peer_max,
            linger: Duration::ZERO,
        };
        assert_eq!(SlotTable::new(cfg(0)).unwrap_err(), SlotError::BadCap { max: 0, slots: 4 });
        assert_eq!(SlotTable::new(cfg(5)).unwrap_err(), SlotError::BadCap { max: 5, slots: 4 });
    }

    #[test]
    fn a_greedy_peer_stops_at_its_cap_and_others_still_get_slots() {
        let now = Instant::now();
        let mut t = table(8, 4, 3);
        let (greedy, other) = (PeerId(1), PeerId(2));
        for x in 0..3 {
            t.allocate(now, greedy, XferId(x), &all()).unwrap();
        }
        assert_eq!(t.allocate(now, greedy, XferId(3), &all()), Err(SlotError::PeerAtCap { peer: greedy, held: 3 }));
        for x in 0..3 {
            t.allocate(now, other, XferId(x), &all()).unwrap();
        }
        assert_eq!(t.free(), 2);
        t.assert_consistent();
    }

    #[test]
    fn exhaustion_and_duplicates() {
        let now = Instant::now();
        let mut t = table(2, 4, 2);
        let s = t.allocate(now, PeerId(1), XferId(1), &all()).unwrap();
        assert_eq!(
            t.allocate(now, PeerId(1), XferId(1), &all()),
            Err(SlotError::AlreadyHeld { peer: PeerId(1), xfer: XferId(1), slot: s })
        );
        t.allocate(now, PeerId(2), XferId(1), &all()).unwrap();
        assert_eq!(t.allocate(now, PeerId(3), XferId(1), &all()), Err(SlotError::Exhausted));
    }

    #[test]
    fn the_ring_never_overwrites_an_unconsumed_record() {
        let now = Instant::now();
        let mut t = table(2, 4, 2);
        let p = PeerId(1);
        let s = t.allocate(now, p, XferId(9), &all()).unwrap();
        let offs: Vec<u64> = (0..4).map(|_| t.place(s).unwrap().offset).collect();
        assert_eq!(offs, [0, 64, 128, 192]);
        assert_eq!(t.place(s), Err(SlotError::RingFull { slot: s }));
        t.handle_consumed(p, XferId(9), Seq(2)).unwrap();
        assert_eq!(t.place(s).unwrap(), RecordPlace { slot: s, seq: Seq(5), offset: 0 });
        assert_eq!(t.place(s).unwrap().seq, Seq(6));
        assert_eq!(t.place(s), Err(SlotError::RingFull { slot: s }));
        // a stale cursor changes nothing; a cursor past what was written is refused
        t.handle_consumed(p, XferId(9), Seq(1)).unwrap();
        assert_eq!(t.place(s), Err(SlotError::RingFull { slot: s }));
        assert_eq!(
            t.handle_consumed(p, XferId(9), Seq(7)),
            Err(SlotError::CursorAhead { slot: s, claimed: 7, written: 6 })
        );
        t.assert_consistent();
    }

    #[test]
    fn only_the_holder_moves_the_cursor() {
        let now = Instant::now();
        let mut t = table(2, 4, 2);
        let s = t.allocate(now, PeerId(1), XferId(9), &all()).unwrap();
        t.place(s).unwrap();
        let unknown = |peer, xfer| Err(SlotError::UnknownTransfer { peer, xfer });
        assert_eq!(t.handle_consumed(PeerId(2), XferId(9), Seq(1)), unknown(PeerId(2), XferId(9)));
        assert_eq!(t.handle_consumed(PeerId(1), XferId(8), Seq(1)), unknown(PeerId(1), XferId(8)));
        assert_eq!(t.place(SlotId(1)), Err(SlotError::NotOpen { slot: SlotId(1) }));
        assert_eq!(t.place(SlotId(77)), Err(SlotError::NotOpen { slot: SlotId(77) }));
        // the transfer ends and its slot goes to the same peer's next transfer: a late report
        // of the first transfer does not touch the second's cursor
        t.handle_consumed(PeerId(1), XferId(9), Seq(1)).unwrap();
        t.close(now, s);
        let s2 = t.allocate(now, PeerId(1), XferId(10), &all()).unwrap();
        assert_eq!(s2, s);
        t.place(s2).unwrap();
        assert_eq!(t.handle_consumed(PeerId(1), XferId(9), Seq(1)), unknown(PeerId(1), XferId(9)));
        for _ in 0..3 {
            t.place(s2).unwrap();
        }
        assert_eq!(t.place(s2), Err(SlotError::RingFull { slot: s2 }), "the old report freed nothing");
    }

    #[test]
    fn a_closed_slot_is_reused_after_its_last_record_is_read_or_after_linger() {
        let now = Instant::now();
        let mut t = table(1, 4, 1);
        let p = PeerId(1);
        let s = t.allocate(now, p, XferId(1), &all()).unwrap();
        t.place(s).unwrap();
        t.place(s).unwrap();
        t.close(now, s);
        assert_eq!(t.place(s), Err(SlotError::NotOpen { slot: s }));
        assert_eq!(t.allocate(now, PeerId(2), XferId(1), &all()), Err(SlotError::Exhausted));
        t.handle_consumed(p, XferId(1), Seq(1)).unwrap();
        assert_eq!(t.held_by(p), 1);
        t.handle_consumed(p, XferId(1), Seq(2)).unwrap();
        assert_eq!(t.held_by(p), 0);
        let s2 = t.allocate(now, PeerId(2), XferId(1), &all()).unwrap();
        t.place(s2).unwrap();
        // the next holder never reports: the slot comes back after linger, not before
        t.close(now, s2);
        let later = now + Duration::from_millis(99);
        assert_eq!(t.allocate(later, PeerId(3), XferId(1), &all()), Err(SlotError::Exhausted));
        let s3 = t.allocate(now + Duration::from_millis(100), PeerId(3), XferId(1), &all()).unwrap();
        assert_eq!(s3, s2);
        // a fresh transfer in a reused slot starts its sequence again
        assert_eq!(t.place(s3).unwrap().seq, Seq(1));
        t.assert_consistent();
    }

    #[test]
    fn a_lost_peer_frees_all_its_slots() {
        let now = Instant::now();
        let mut t = table(4, 4, 3);
        let a = t.allocate(now, PeerId(1), XferId(5), &all()).unwrap();
        let b = t.allocate(now, PeerId(1), XferId(2), &all()).unwrap();
        let c = t.allocate(now, PeerId(2), XferId(5), &all()).unwrap();
        t.place(b).unwrap();
        t.close(now, b); // closing, its record unread
        assert_eq!(t.release_peer(PeerId(1)), vec![a, b]);
        assert_eq!(t.held_by(PeerId(1)), 0);
        assert_eq!(t.slot_of(PeerId(2), XferId(5)), Some(c));
        assert_eq!(t.free(), 3);
        t.assert_consistent();
    }
}
