//! The target's mailbox writer: turns the answers of its transfers into the 64-byte record
//! writes the shell performs into the arena, in order, holding an answer back while its slot's
//! ring is full and releasing it when the initiator's cursor moves.
//!
//! It owns the [`SlotTable`] and each open transfer's key and backlog. It does not decide what
//! to answer (the receiver role does) and touches no memory: the shell copies each
//! [`RecordWrite`] to `mailbox base + offset` with one 64-byte copy.

use std::collections::{BTreeMap, VecDeque};
use std::time::Instant;

use crate::types::{PeerId, XferId};

use super::record::{Answer, FailReason, RECORD_LEN, Record, RecordKey, Seq, SlotId, Token};
use super::slots::{SlotConfig, SlotError, SlotTable, candidates};

/// One record for the shell to write into the mailbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordWrite {
    /// Byte offset from the mailbox base.
    pub offset: u64,
    /// The record, MAC'd under its transfer's key; all zeros clears a place.
    pub bytes: [u8; RECORD_LEN],
}

impl RecordWrite {
    /// Whether it clears a place (a slot handed to a new transfer) rather than writes a record.
    pub fn is_clear(&self) -> bool {
        self.bytes == [0; RECORD_LEN]
    }
}

/// An open transfer's writing state.
#[derive(Debug)]
struct Flow {
    slot: SlotId,
    key: RecordKey,
    /// Answers waiting for ring room, oldest first.
    backlog: VecDeque<Answer>,
    /// Closed by the caller at this time: the slot closes once the backlog is written, or
    /// the linger after this if the initiator never makes room for it.
    closing: Option<Instant>,
}

/// The target's side of the mailbox for all its transfers.
///
/// Call order: [`open`](Self::open) on a transfer's WANT (its token keys the records and picks
/// the candidate slots; on [`SlotError::Exhausted`] or [`SlotError::PeerAtCap`] the WANT waits
/// and `open` is called again later); [`answer`](Self::answer) for each GRANT / READY / ACK /
/// FAIL; [`handle_consumed`](Self::handle_consumed) when the initiator's frame carries its
/// cursor; [`close`](Self::close) after the last answer; [`release_peer`](Self::release_peer)
/// when the peer is lost. After each of these, drain [`poll_write`](Self::poll_write) until
/// `None` and perform the writes IN THAT ORDER (a record's ring position may be reused by a
/// later write once the initiator has consumed it).
#[derive(Debug)]
pub struct MailboxWriter {
    table: SlotTable,
    flows: BTreeMap<(PeerId, XferId), Flow>,
    writes: VecDeque<RecordWrite>,
}

impl MailboxWriter {
    /// A writer over an empty mailbox.
    ///
    /// # Errors
    /// As [`SlotTable::new`].
    pub fn new(cfg: SlotConfig) -> Result<Self, SlotError> {
        Ok(Self { table: SlotTable::new(cfg)?, flows: BTreeMap::new(), writes: VecDeque::new() })
    }

    /// The slot table (for stats and checks).
    pub fn table(&self) -> &SlotTable {
        &self.table
    }

    /// Answers of `peer`'s transfer `xfer` not yet written for want of ring room.
    pub fn backlog(&self, peer: PeerId, xfer: XferId) -> usize {
        self.flows.get(&(peer, xfer)).map_or(0, |f| f.backlog.len())
    }

    /// Opens `peer`'s transfer `xfer` under its `token`: gives it a slot among the token's
    /// candidates.
    ///
    /// # Errors
    /// As [`SlotTable::allocate`].
    pub fn open(&mut self, now: Instant, peer: PeerId, xfer: XferId, token: &Token) -> Result<SlotId, SlotError> {
        self.reclaim_expired(now);
        let slot = self.table.allocate(now, peer, xfer, &candidates(token, self.table.layout()))?;
        // The slot's places are cleared before its first record: its last holder's records
        // would otherwise sit past the new transfer's, and every look at them count as a
        // refusal, honest traffic passing for forgery (review 60, mailbox L1).
        if let Some(ring) = self.table.layout().slot_region(slot) {
            let places = (ring.offset..ring.end()).step_by(RECORD_LEN);
            self.writes.extend(places.map(|offset| RecordWrite { offset, bytes: [0; RECORD_LEN] }));
        }
        let flow = Flow { slot, key: RecordKey::derive(token), backlog: VecDeque::new(), closing: None };
        self.flows.insert((peer, xfer), flow);
        Ok(slot)
    }

    /// The slot [`open`](Self::open) would give `peer`'s transfer `xfer` under `token` now,
    /// without taking it (see [`SlotTable::vacancy`]; call
    /// [`reclaim_expired`](Self::reclaim_expired) first).
    ///
    /// # Errors
    /// As [`SlotTable::allocate`].
    pub fn vacancy(&self, peer: PeerId, xfer: XferId, candidates: &[SlotId]) -> Result<SlotId, SlotError> {
        self.table.vacancy(peer, xfer, candidates)
    }

    /// Frees the closing slots whose linger has ended by `now`, those of closed transfers
    /// whose backlog still waits for ring room included: an initiator that stops reading (it
    /// crashed, or never reports its cursor) leaves its last answers unwritten, and its slot
    /// must not stay held for ever.
    pub fn reclaim_expired(&mut self, now: Instant) {
        let linger = self.table.linger();
        let stuck: Vec<(PeerId, XferId)> = (self.flows.iter())
            .filter(|(_, f)| f.closing.is_some_and(|at| at + linger <= now))
            .map(|(k, _)| *k)
            .collect();
        for key in stuck {
            if let Some(flow) = self.flows.remove(&key) {
                // Its linger counted from its close: already over, freed just below.
                self.table.close(flow.closing.unwrap_or(now), flow.slot);
            }
        }
        self.table.reclaim_expired(now);
    }

    /// When the first closing slot's linger ends, a closed transfer's whose backlog waits
    /// included (see [`reclaim_expired`](Self::reclaim_expired)).
    pub fn next_expiry(&self) -> Option<Instant> {
        let linger = self.table.linger();
        let stuck = self.flows.values().filter_map(|f| f.closing).map(|at| at + linger).min();
        self.table.next_expiry().into_iter().chain(stuck).min()
    }

    /// Queues `answer` for `peer`'s transfer `xfer`: written at once when the ring has room,
    /// else when the initiator's cursor makes room.
    ///
    /// # Errors
    /// [`SlotError::UnknownTransfer`] when the transfer is not open (never opened, closed, or
    /// its peer released); [`SlotError::InvalidAnswer`] when `answer` could not be decoded by
    /// the initiator ([`Answer::validate`]: an empty or overflowing region), written as a
    /// FAIL instead, so its transfer ends rather than stalls. (The receiver role answers with
    /// regions it allocated, or a DATA's region the wire decoder bounded; review 58 found a
    /// path where a peer's region reached here, and an `assert!` then panicked the reactor.)
    pub fn answer(&mut self, peer: PeerId, xfer: XferId, answer: Answer) -> Result<(), SlotError> {
        let (answer, invalid) = match answer.validate() {
            Ok(()) => (answer, false),
            Err(_) => (Answer::Fail(FailReason::Refused), true),
        };
        let flow = self.flows.get_mut(&(peer, xfer)).filter(|f| f.closing.is_none());
        let flow = flow.ok_or(SlotError::UnknownTransfer { peer, xfer })?;
        flow.backlog.push_back(answer);
        self.flush(peer, xfer);
        if invalid {
            return Err(SlotError::InvalidAnswer { peer, xfer });
        }
        Ok(())
    }

    /// The initiator `from` has read its transfer `xfer`'s records up to `upto`: ring room
    /// frees, backlog is written, and a closed transfer's slot frees once all is read.
    ///
    /// # Errors
    /// As [`SlotTable::handle_consumed`].
    pub fn handle_consumed(&mut self, now: Instant, from: PeerId, xfer: XferId, upto: Seq) -> Result<(), SlotError> {
        self.table.handle_consumed(from, xfer, upto)?;
        self.flush(from, xfer);
        self.finish_if_drained(now, from, xfer);
        Ok(())
    }

    /// No more answers for `peer`'s transfer `xfer`: its slot closes once its backlog is
    /// written (and is reused once the initiator has read it all, or after the linger time).
    /// Closing an unknown transfer does nothing.
    pub fn close(&mut self, now: Instant, peer: PeerId, xfer: XferId) {
        if let Some(flow) = self.flows.get_mut(&(peer, xfer)) {
            flow.closing.get_or_insert(now);
        }
        self.finish_if_drained(now, peer, xfer);
    }

    /// `peer`'s transfer `xfer` is over and its initiator reads no more (it canceled): its
    /// backlog is dropped and its slot freed at once, open or already closing (lingering for
    /// a last count of records that will not come). Unknown transfers are ignored.
    pub fn drop_transfer(&mut self, peer: PeerId, xfer: XferId) {
        let slot = match self.flows.remove(&(peer, xfer)) {
            Some(flow) => Some(flow.slot),
            None => self.table.slot_of(peer, xfer),
        };
        if let Some(slot) = slot {
            self.table.release_slot(slot);
        }
    }

    /// Whether `peer` holds a slot (open or lingering) or a flow here.
    pub fn holds(&self, peer: PeerId) -> bool {
        self.table.held_by(peer) > 0 || self.flows.range((peer, XferId(0))..=(peer, XferId(u64::MAX))).next().is_some()
    }

    /// The peer is gone: its transfers are dropped with their backlogs and their slots freed.
    /// Returns the transfers, lowest first.
    ///
    /// Each open transfer's records not yet reported read are overwritten with FAILs first: a
    /// peer declared dead may only have stalled, and its reader would otherwise still take a
    /// GRANT or READY left there and move a region that has since been granted to another
    /// flow (review 58). Every unread place gets one, as the reader may have read further than
    /// it reported.
    pub fn release_peer(&mut self, peer: PeerId) -> Vec<XferId> {
        let range = (peer, XferId(0))..=(peer, XferId(u64::MAX));
        let gone: Vec<XferId> = self.flows.range(range).map(|(k, _)| k.1).collect();
        for xfer in &gone {
            let Some(flow) = self.flows.remove(&(peer, *xfer)) else { continue };
            for place in self.table.unread(flow.slot) {
                let record =
                    Record { slot: flow.slot, seq: place.seq, xfer: *xfer, answer: Answer::Fail(FailReason::TimedOut) };
                self.writes.push_back(RecordWrite { offset: place.offset, bytes: record.encode(&flow.key) });
            }
        }
        self.table.release_peer(peer);
        gone
    }

    /// The next record to write into the mailbox.
    #[must_use]
    pub fn poll_write(&mut self) -> Option<RecordWrite> {
        self.writes.pop_front()
    }

    /// Writes as much of the transfer's backlog as its ring has room for.
    fn flush(&mut self, peer: PeerId, xfer: XferId) {
        let Some(flow) = self.flows.get_mut(&(peer, xfer)) else { return };
        while let Some(&answer) = flow.backlog.front() {
            let Ok(place) = self.table.place(flow.slot) else { break };
            flow.backlog.pop_front();
            let record = Record { slot: flow.slot, seq: place.seq, xfer, answer };
            self.writes.push_back(RecordWrite { offset: place.offset, bytes: record.encode(&flow.key) });
        }
    }

    /// A closed transfer whose backlog is written closes its slot.
    fn finish_if_drained(&mut self, now: Instant, peer: PeerId, xfer: XferId) {
        if self.flows.get(&(peer, xfer)).is_some_and(|f| f.closing.is_some() && f.backlog.is_empty()) {
            if let Some(flow) = self.flows.remove(&(peer, xfer)) {
                self.table.close(now, flow.slot);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::mailbox::reader::MailboxReader;
    use crate::mailbox::slots::MailboxLayout;
    use crate::types::{ChunkIdx, Region};
    use crate::wire::{AckStatus, Credit};

    const LAYOUT: MailboxLayout = MailboxLayout { slots: 8, ring: 4 };
    const PEER: PeerId = PeerId(3);
    const XFER: XferId = XferId(40);
    const TOKEN: Token = Token([0x77; 16]);

    fn writer() -> MailboxWriter {
        MailboxWriter::new(SlotConfig { layout: LAYOUT, per_peer_max: 4, linger: Duration::from_secs(1) }).unwrap()
    }

    fn grant(i: u32) -> Answer {
        Answer::Grant(Credit { chunk: ChunkIdx(i), region: Region { offset: u64::from(i) * 64, len: 64 } })
    }

    /// Performs every pending write on `arena` (the mailbox bytes); returns the records written
    /// (places cleared not counted).
    fn apply(w: &mut MailboxWriter, arena: &mut [u8]) -> usize {
        let mut n = 0;
        while let Some(rw) = w.poll_write() {
            let at = rw.offset as usize;
            arena[at..at + RECORD_LEN].copy_from_slice(&rw.bytes);
            n += usize::from(!rw.is_clear());
        }
        n
    }

    fn read(r: &mut MailboxReader, arena: &[u8]) -> Vec<Answer> {
        let img: Vec<u8> =
            r.fetch().iter().flat_map(|g| arena[g.offset as usize..g.end() as usize].iter().copied()).collect();
        r.handle_fetched(&img).unwrap();
        std::iter::from_fn(|| r.poll_answer()).map(|(_, a)| a).collect()
    }

    #[test]
    fn answers_reach_a_locating_reader_in_order_through_a_full_ring() {
        let now = Instant::now();
        let mut w = writer();
        let mut arena = vec![0u8; LAYOUT.byte_len() as usize];
        let slot = w.open(now, PEER, XFER, &TOKEN).unwrap();
        assert_eq!(slot, candidates(&TOKEN, LAYOUT)[0]);
        let mut r = MailboxReader::locate(LAYOUT, XFER, &TOKEN).unwrap();
        for i in 0..6 {
            w.answer(PEER, XFER, grant(i)).unwrap();
        }
        // the ring holds 4: two wait
        assert_eq!(apply(&mut w, &mut arena), 4);
        assert_eq!(w.backlog(PEER, XFER), 2);
        assert_eq!(read(&mut r, &arena), [grant(0)], "locating reads record 1 only");
        assert_eq!(read(&mut r, &arena), [grant(1), grant(2), grant(3)]);
        w.handle_consumed(now, PEER, XFER, r.consumed()).unwrap();
        assert_eq!(apply(&mut w, &mut arena), 2);
        assert_eq!(read(&mut r, &arena), [grant(4), grant(5)]);
    }

    #[test]
    fn a_closed_transfer_keeps_its_slot_until_its_backlog_is_written_and_read() {
        let now = Instant::now();
        let mut w = writer();
        let mut arena = vec![0u8; LAYOUT.byte_len() as usize];
        let slot = w.open(now, PEER, XFER, &TOKEN).unwrap();
        let mut r = MailboxReader::locate(LAYOUT, XFER, &TOKEN).unwrap();
        for i in 0..5 {
            w.answer(PEER, XFER, grant(i)).unwrap();
        }
        w.close(now, PEER, XFER);
        assert_eq!(w.answer(PEER, XFER, grant(9)), Err(SlotError::UnknownTransfer { peer: PEER, xfer: XFER }));
        apply(&mut w, &mut arena);
        read(&mut r, &arena);
        read(&mut r, &arena);
        w.handle_consumed(now, PEER, XFER, r.consumed()).unwrap();
        apply(&mut w, &mut arena);
        assert_eq!(read(&mut r, &arena), [grant(4)]);
        assert_eq!(w.table().slot_of(PEER, XFER), Some(slot), "closing, last record unread");
        w.handle_consumed(now, PEER, XFER, r.consumed()).unwrap();
        assert_eq!(w.table().slot_of(PEER, XFER), None);
        w.table().assert_consistent();
    }

    #[test]
    fn a_closed_transfer_whose_backlog_is_never_made_room_for_frees_its_slot_after_the_linger() {
        let now = Instant::now();
        let mut w = writer();
        let slot = w.open(now, PEER, XFER, &TOKEN).unwrap();
        // Six answers into a ring of four, then the close: two wait for a cursor that never
        // comes (the initiator crashed, or never reports).
        for i in 0..6 {
            w.answer(PEER, XFER, grant(i)).unwrap();
        }
        let closed = now + Duration::from_millis(10);
        w.close(closed, PEER, XFER);
        assert_eq!(w.backlog(PEER, XFER), 2);
        let linger = Duration::from_secs(1);
        assert_eq!(w.next_expiry(), Some(closed + linger), "the wake-up that frees it");
        w.reclaim_expired(closed + linger - Duration::from_millis(1));
        assert_eq!(w.table().slot_of(PEER, XFER), Some(slot), "held during the linger");
        w.reclaim_expired(closed + linger);
        assert_eq!(w.table().slot_of(PEER, XFER), None, "freed after it");
        assert_eq!((w.table().held_by(PEER), w.backlog(PEER, XFER), w.next_expiry()), (0, 0, None));
        assert!(!w.holds(PEER));
        w.table().assert_consistent();
        // And the slot serves a new transfer.
        assert_eq!(w.open(closed + linger, PEER, XferId(41), &TOKEN), Ok(slot));
    }

    /// A released peer's unread records become FAILs, wherever its reader really is: one that
    /// only stalled (declared dead meanwhile) never takes a GRANT left in the freed slot.
    #[test]
    fn a_released_peers_unread_records_are_overwritten_with_fails() {
        let now = Instant::now();
        let mut w = writer();
        let mut arena = vec![0u8; LAYOUT.byte_len() as usize];
        w.open(now, PEER, XFER, &TOKEN).unwrap();
        let mut r = MailboxReader::locate(LAYOUT, XFER, &TOKEN).unwrap();
        for i in 0..3 {
            w.answer(PEER, XFER, grant(i)).unwrap();
        }
        apply(&mut w, &mut arena);
        // The reader takes the first GRANT and reports nothing; then the peer is released.
        assert_eq!(read(&mut r, &arena), [grant(0)]);
        assert_eq!(w.release_peer(PEER), [XFER]);
        assert_eq!(apply(&mut w, &mut arena), 3, "a FAIL over each record not reported read");
        assert_eq!(read(&mut r, &arena)[0], Answer::Fail(FailReason::TimedOut), "never the GRANT after it");
        assert!(!w.holds(PEER));
    }

    /// An answer no initiator could decode (empty, or past 2^64) is never written: a FAIL
    /// goes in its place, so the transfer ends instead of stalling, and the caller is told.
    /// (It panicked until review 58 found a peer's region could reach it.)
    #[test]
    fn an_answer_no_initiator_could_decode_is_written_as_a_fail() {
        for region in [Region { offset: 64, len: 0 }, Region { offset: u64::MAX, len: 1 }] {
            let mut w = writer();
            let mut arena = vec![0u8; LAYOUT.byte_len() as usize];
            w.open(Instant::now(), PEER, XFER, &TOKEN).unwrap();
            let mut r = MailboxReader::locate(LAYOUT, XFER, &TOKEN).unwrap();
            let bad = Answer::Ack { credit: Credit { chunk: ChunkIdx(0), region }, status: AckStatus::Refused };
            assert_eq!(w.answer(PEER, XFER, bad), Err(SlotError::InvalidAnswer { peer: PEER, xfer: XFER }));
            assert_eq!(apply(&mut w, &mut arena), 1);
            assert_eq!(read(&mut r, &arena), [Answer::Fail(FailReason::Refused)], "{region:?}");
        }
    }

    #[test]
    fn a_lost_peer_drops_its_transfers() {
        let now = Instant::now();
        let mut w = writer();
        w.open(now, PEER, XFER, &TOKEN).unwrap();
        w.open(now, PEER, XferId(1), &Token([1; 16])).unwrap();
        w.open(now, PeerId(4), XFER, &Token([2; 16])).unwrap();
        assert_eq!(w.release_peer(PEER), [XferId(1), XFER]);
        assert_eq!(w.table().held_by(PEER), 0);
        assert_eq!(w.answer(PEER, XFER, grant(0)), Err(SlotError::UnknownTransfer { peer: PEER, xfer: XFER }));
        w.answer(PeerId(4), XFER, grant(0)).unwrap();
        assert!(std::iter::from_fn(|| w.poll_write()).any(|rw| !rw.is_clear()));
    }

    /// Review 60 (mailbox, L1): a slot handed to a new transfer kept its last holder's
    /// records, and each look of the new reader at a place past its own records counted a
    /// refusal, in honest traffic. The places are cleared before the first record now.
    #[test]
    fn a_reused_slot_shows_its_new_reader_nothing_of_its_last_holder() {
        let one = MailboxLayout { slots: 1, ring: 4 };
        let cfg = SlotConfig { layout: one, per_peer_max: 1, linger: Duration::from_secs(1) };
        let (now, mut w) = (Instant::now(), MailboxWriter::new(cfg).unwrap());
        let mut arena = vec![0u8; one.byte_len() as usize];
        w.open(now, PEER, XFER, &TOKEN).unwrap();
        let mut r = MailboxReader::locate(one, XFER, &TOKEN).unwrap();
        for i in 0..4 {
            w.answer(PEER, XFER, grant(i)).unwrap();
        }
        w.close(now, PEER, XFER);
        apply(&mut w, &mut arena);
        read(&mut r, &arena);
        read(&mut r, &arena);
        w.handle_consumed(now, PEER, XFER, r.consumed()).unwrap();
        assert_eq!(w.table().slot_of(PEER, XFER), None, "read to the end: the slot is free");
        // The next transfer takes the only slot; one GRANT, then its reader looks on.
        let (next, token) = (XferId(41), Token([0x78; 16]));
        w.open(now, PEER, next, &token).unwrap();
        w.answer(PEER, next, grant(0)).unwrap();
        assert_eq!(apply(&mut w, &mut arena), 1, "one record; the cleared places are not records");
        let mut r = MailboxReader::locate(one, next, &token).unwrap();
        assert_eq!(read(&mut r, &arena), [grant(0)]);
        for _ in 0..3 {
            assert!(read(&mut r, &arena).is_empty());
        }
        assert_eq!(r.stats().refused, 0, "the last holder's records were cleared");
    }
}
