//! The initiator's side of the mailbox: for one transfer, which bytes of the target's mailbox to
//! READ, which record comes next, and which records to act on, refuse or ignore.
//!
//! Locating: until its first record arrives the initiator does not know which of the
//! transfer's [`candidates`] the target gave it, so it READs the first record of each (one
//! 64-byte descriptor per candidate, one READ request) and settles on the one that verifies
//! as record 1 of this transfer in that slot. From then on it READs that slot's ring.
//!
//! Rules, for a fetched image of the transfer's slot (its whole ring):
//! - only the record at the ring position of the next expected sequence number is looked at,
//!   and accepted when it decodes under this transfer's key, names this slot and transfer, and
//!   carries exactly that sequence number; then the next position is looked at, and so on;
//! - a record with an older sequence number is the previous lap or a replay: ignored (`stale`);
//! - a record that does not verify (torn by a READ racing the target's write, written by a
//!   third party, of another transfer) or that sits in another slot or at another position
//!   than it names (a genuine record copied elsewhere) is refused (`refused`) and read again
//!   on the next fetch: a forger can only delay answers until the transfer's no-progress
//!   timeout, never inject one;
//! - an authentic record that breaks the ring rule (a sequence number from a lap ahead) or
//!   names another transfer can only come from the target itself: a protocol error;
//! - after a FAIL nothing more is accepted.
//!
//! No clock, no IO: the shell posts the READ of [`MailboxReader::fetch`], hands the bytes to
//! [`MailboxReader::handle_fetched`] and carries [`MailboxReader::consumed`] back to the target.

use std::collections::VecDeque;

use crate::types::{Region, XferId};

use super::record::{Answer, RECORD_LEN, Record, RecordError, RecordKey, Seq, SlotId, Token};
use super::slots::{MailboxLayout, SlotError, candidates};

/// Counters of what the reader saw, for the shell's stats and warnings.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReaderStats {
    /// Records accepted, in order.
    pub accepted: u64,
    /// Positions that held an older record (nothing new yet, or a replay).
    pub stale: u64,
    /// Positions that held a record that did not verify or sat at the wrong position.
    pub refused: u64,
}

/// Why a fetched image ends the transfer: the target broke the protocol (or the shell handed
/// the wrong bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ReaderError {
    /// The image is not exactly the regions of `fetch`, back to back.
    #[error("fetched {got} bytes, expected {expected}")]
    WrongImageLength {
        /// The regions' total length.
        expected: u64,
        /// The length handed in.
        got: usize,
    },
    /// An authentic record is a lap ahead of the next expected one: the target overwrote a
    /// record this reader had not consumed.
    #[error("expected record {expected:?}, the target wrote {found:?} over it")]
    Skipped {
        /// The sequence number expected.
        expected: Seq,
        /// The one found.
        found: Seq,
    },
    /// An authentic record names another transfer.
    #[error("authentic record names {slot:?} / {xfer:?}")]
    Misbound {
        /// The slot it names.
        slot: SlotId,
        /// The transfer it names.
        xfer: XferId,
    },
    /// The target's layout is out of bounds.
    #[error(transparent)]
    Slot(#[from] SlotError),
    /// The target named a slot outside its layout.
    #[error("{slot:?} is outside the mailbox")]
    NoSuchSlot {
        /// The slot named.
        slot: SlotId,
    },
}

/// The initiator's reader of one transfer's mailbox slot.
///
/// Call order: [`locate`](Self::locate) when the WANT is sent (its token is the key); whenever
/// the transfer waits for an answer, READ the regions of [`fetch`](Self::fetch) from the
/// target's mailbox (one READ request, the regions back to back in local memory), call
/// [`handle_fetched`](Self::handle_fetched) with those bytes, drain
/// [`poll_answer`](Self::poll_answer) until `None`, and report [`consumed`](Self::consumed) to
/// the target in the next frame sent to it.
#[derive(Debug)]
pub struct MailboxReader {
    layout: MailboxLayout,
    place: Place,
    xfer: XferId,
    key: RecordKey,
    /// The next sequence number to accept.
    next: u64,
    finished: bool,
    answers: VecDeque<(Seq, Answer)>,
    stats: ReaderStats,
}

/// Where the reader looks.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Place {
    /// Not yet known: the first record of each candidate.
    Locating(Vec<SlotId>),
    /// This slot's ring.
    At { slot: SlotId, ring: Region },
}

impl MailboxReader {
    /// A reader for transfer `xfer`'s records in a mailbox of shape `layout`, under the
    /// transfer's `token`, starting by locating its slot among the token's candidates.
    ///
    /// # Errors
    /// [`ReaderError::Slot`] when the layout is out of bounds (it comes from the target).
    pub fn locate(layout: MailboxLayout, xfer: XferId, token: &Token) -> Result<Self, ReaderError> {
        layout.validate()?;
        Ok(Self::with_place(layout, Place::Locating(candidates(token, layout)), xfer, token))
    }

    /// A reader for transfer `xfer`'s records in a known `slot` of a mailbox of shape
    /// `layout`, under the transfer's `token`.
    ///
    /// # Errors
    /// [`ReaderError::Slot`] when the layout is out of bounds, [`ReaderError::NoSuchSlot`] when
    /// the slot is outside it (both come from the target, so they are untrusted).
    pub fn new(layout: MailboxLayout, slot: SlotId, xfer: XferId, token: &Token) -> Result<Self, ReaderError> {
        layout.validate()?;
        let ring = layout.slot_region(slot).ok_or(ReaderError::NoSuchSlot { slot })?;
        Ok(Self::with_place(layout, Place::At { slot, ring }, xfer, token))
    }

    fn with_place(layout: MailboxLayout, place: Place, xfer: XferId, token: &Token) -> Self {
        Self {
            layout,
            place,
            xfer,
            key: RecordKey::derive(token),
            next: 1,
            finished: false,
            answers: VecDeque::new(),
            stats: ReaderStats::default(),
        }
    }

    /// The regions to READ, relative to the target's mailbox base: while locating, the first
    /// record of each candidate slot; then the slot's ring.
    pub fn fetch(&self) -> Vec<Region> {
        match &self.place {
            Place::Locating(c) => c
                .iter()
                .filter_map(|&s| self.layout.slot_region(s))
                .map(|r| Region { offset: r.offset, len: RECORD_LEN as u64 })
                .collect(),
            Place::At { ring, .. } => vec![*ring],
        }
    }

    /// The transfer's slot, once located.
    pub fn slot(&self) -> Option<SlotId> {
        match self.place {
            Place::Locating(_) => None,
            Place::At { slot, .. } => Some(slot),
        }
    }

    /// The last sequence number accepted (0: none), to report to the target so it may reuse
    /// those ring positions.
    pub fn consumed(&self) -> Seq {
        Seq(self.next - 1)
    }

    /// True once a FAIL was accepted: the target sends nothing more for this transfer.
    pub fn is_finished(&self) -> bool {
        self.finished
    }

    /// What the reader has seen so far.
    pub fn stats(&self) -> ReaderStats {
        self.stats
    }

    /// Takes the bytes of the regions of [`fetch`](Self::fetch), back to back, and queues
    /// every new answer in order. Returns how many were accepted.
    ///
    /// # Errors
    /// See [`ReaderError`]: the image has the wrong length, or the target broke the protocol
    /// (the transfer should fail). Answers accepted before the error stay queued.
    pub fn handle_fetched(&mut self, image: &[u8]) -> Result<usize, ReaderError> {
        let expected: u64 = self.fetch().iter().map(|r| r.len).sum();
        if image.len() as u64 != expected {
            return Err(ReaderError::WrongImageLength { expected, got: image.len() });
        }
        let slot = match &self.place {
            Place::At { slot, .. } => *slot,
            Place::Locating(_) => return self.handle_locating(image),
        };
        let mut accepted = 0;
        // at most one lap: a ring holds `ring` records
        for _ in 0..self.layout.ring {
            if self.finished {
                break;
            }
            let pos = self.layout.position(Seq(self.next)) as usize;
            let bytes = &image[pos * RECORD_LEN..(pos + 1) * RECORD_LEN];
            let record = match Record::decode(bytes, &self.key) {
                Ok(r) => r,
                Err(RecordError::Empty) => break,
                Err(_) => {
                    self.stats.refused += 1;
                    break;
                }
            };
            if record.xfer != self.xfer {
                return Err(ReaderError::Misbound { slot: record.slot, xfer: record.xfer });
            }
            if record.slot != slot || self.layout.position(record.seq) as usize != pos {
                self.stats.refused += 1;
                break;
            }
            if record.seq.0 < self.next {
                self.stats.stale += 1;
                break;
            }
            if record.seq.0 > self.next {
                return Err(ReaderError::Skipped { expected: Seq(self.next), found: record.seq });
            }
            self.next += 1;
            self.finished = matches!(record.answer, Answer::Fail(_));
            self.answers.push_back((record.seq, record.answer));
            self.stats.accepted += 1;
            accepted += 1;
        }
        Ok(accepted)
    }

    /// Locating: the first candidate whose first record verifies as record 1 of this transfer
    /// in that slot becomes the transfer's slot, and that record its first answer.
    fn handle_locating(&mut self, image: &[u8]) -> Result<usize, ReaderError> {
        let Place::Locating(cands) = &self.place else { return Ok(0) };
        // a stack copy of the (at most CANDIDATES) ids, so the loop may update `self` without
        // a heap clone per poll
        let mut ids = [SlotId(0); super::slots::CANDIDATES];
        let n = cands.len().min(ids.len());
        ids[..n].copy_from_slice(&cands[..n]);
        for (&cand, bytes) in ids[..n].iter().zip(image.chunks_exact(RECORD_LEN)) {
            // Not counted as refused: the other candidates are other transfers' slots, whose
            // records never verify under our key (review 60, mailbox L1: every honest look
            // counted one).
            let Ok(record) = Record::decode(bytes, &self.key) else { continue };
            if record.xfer != self.xfer {
                return Err(ReaderError::Misbound { slot: record.slot, xfer: record.xfer });
            }
            if record.slot != cand || self.layout.position(record.seq) != 0 {
                // a genuine record copied out of the slot or the position it names
                self.stats.refused += 1;
                continue;
            }
            if record.seq != Seq(1) {
                return Err(ReaderError::Skipped { expected: Seq(1), found: record.seq });
            }
            let ring = self.layout.slot_region(cand).ok_or(ReaderError::NoSuchSlot { slot: cand })?;
            self.place = Place::At { slot: cand, ring };
            self.next = 2;
            self.finished = matches!(record.answer, Answer::Fail(_));
            self.answers.push_back((record.seq, record.answer));
            self.stats.accepted += 1;
            return Ok(1);
        }
        Ok(0)
    }

    /// The next accepted answer, in sequence order.
    #[must_use]
    pub fn poll_answer(&mut self) -> Option<(Seq, Answer)> {
        self.answers.pop_front()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mailbox::record::FailReason;
    use crate::mailbox::slots::candidates;
    use crate::types::ChunkIdx;
    use crate::wire::Credit;

    const LAYOUT: MailboxLayout = MailboxLayout { slots: 4, ring: 4 };
    const SLOT: SlotId = SlotId(2);
    const XFER: XferId = XferId(77);
    const TOKEN: Token = Token([5; 16]);

    fn grant(seq: u64) -> Record {
        Record {
            slot: SLOT,
            seq: Seq(seq),
            xfer: XFER,
            answer: Answer::Grant(Credit {
                chunk: ChunkIdx(seq as u32),
                region: Region { offset: seq * 4096, len: 4096 },
            }),
        }
    }

    /// The ring as the target would leave it after writing `records` in order.
    fn image(records: &[Record], token: &Token) -> Vec<u8> {
        let key = RecordKey::derive(token);
        let mut img = vec![0; LAYOUT.ring_bytes() as usize];
        for r in records {
            let pos = LAYOUT.position(r.seq) as usize * RECORD_LEN;
            img[pos..pos + RECORD_LEN].copy_from_slice(&r.encode(&key));
        }
        img
    }

    fn reader() -> MailboxReader {
        MailboxReader::new(LAYOUT, SLOT, XFER, &TOKEN).unwrap()
    }

    fn drain(r: &mut MailboxReader) -> Vec<u64> {
        std::iter::from_fn(|| r.poll_answer()).map(|(s, _)| s.0).collect()
    }

    #[test]
    fn fetch_names_the_slots_ring() {
        assert_eq!(reader().fetch(), [Region { offset: 2 * 256, len: 256 }]);
        assert_eq!(reader().slot(), Some(SLOT));
        assert!(matches!(
            MailboxReader::new(LAYOUT, SlotId(4), XFER, &TOKEN),
            Err(ReaderError::NoSuchSlot { slot: SlotId(4) })
        ));
        assert!(matches!(
            MailboxReader::new(MailboxLayout { slots: 0, ring: 4 }, SLOT, XFER, &TOKEN),
            Err(ReaderError::Slot(SlotError::BadLayout { .. }))
        ));
    }

    #[test]
    fn records_are_accepted_in_order_across_laps() {
        let mut r = reader();
        assert_eq!(r.handle_fetched(&image(&[], &TOKEN)), Ok(0));
        assert_eq!(r.handle_fetched(&image(&[grant(1), grant(2)], &TOKEN)), Ok(2));
        assert_eq!(drain(&mut r), [1, 2]);
        assert_eq!(r.consumed(), Seq(2));
        // the same image again: nothing new, one stale position looked at
        assert_eq!(r.handle_fetched(&image(&[grant(1), grant(2)], &TOKEN)), Ok(0));
        assert_eq!(r.stats().stale, 0, "position 3 is still empty");
        // the next lap: 3, 4, then 5 and 6 overwrite 1 and 2
        let lap: Vec<Record> = (1..=6).map(grant).collect();
        assert_eq!(r.handle_fetched(&image(&lap, &TOKEN)), Ok(4));
        assert_eq!(drain(&mut r), [3, 4, 5, 6]);
        assert_eq!(r.handle_fetched(&image(&lap, &TOKEN)), Ok(0));
        assert_eq!(r.stats(), ReaderStats { accepted: 6, stale: 1, refused: 0 });
    }

    #[test]
    fn a_record_under_another_token_is_refused() {
        let mut r = reader();
        assert_eq!(r.handle_fetched(&image(&[grant(1)], &Token([6; 16]))), Ok(0));
        assert_eq!(r.stats().refused, 1);
        assert_eq!(r.consumed(), Seq(0));
    }

    #[test]
    fn a_torn_record_is_retried_not_fatal() {
        let mut r = reader();
        let mut img = image(&[grant(1)], &TOKEN);
        img[10] ^= 0x40;
        assert_eq!(r.handle_fetched(&img), Ok(0));
        assert_eq!(r.handle_fetched(&image(&[grant(1)], &TOKEN)), Ok(1));
        assert_eq!(r.stats(), ReaderStats { accepted: 1, stale: 0, refused: 1 });
    }

    #[test]
    fn replays_and_moved_records_are_refused() {
        let mut r = reader();
        let lap: Vec<Record> = (1..=4).map(grant).collect();
        assert_eq!(r.handle_fetched(&image(&lap, &TOKEN)), Ok(4));
        // a third party writes the genuine record 1 back where record 5 will go: stale
        assert_eq!(r.handle_fetched(&image(&lap, &TOKEN)), Ok(0));
        assert_eq!(r.stats().stale, 1);
        // ... or copies the genuine record 2 into position 0: wrong position
        let mut img = image(&lap, &TOKEN);
        img.copy_within(RECORD_LEN..2 * RECORD_LEN, 0);
        assert_eq!(r.handle_fetched(&img), Ok(0));
        assert_eq!(r.stats().refused, 1);
        assert_eq!(drain(&mut r), [1, 2, 3, 4]);
    }

    #[test]
    fn an_authentic_record_a_lap_ahead_is_a_protocol_error() {
        let mut r = reader();
        assert_eq!(
            r.handle_fetched(&image(&[grant(5)], &TOKEN)),
            Err(ReaderError::Skipped { expected: Seq(1), found: Seq(5) })
        );
    }

    #[test]
    fn an_authentic_record_of_another_transfer_is_a_protocol_error_one_of_another_slot_refused() {
        let mut r = reader();
        let moved = Record { slot: SlotId(1), ..grant(1) };
        assert_eq!(r.handle_fetched(&image(&[moved], &TOKEN)), Ok(0));
        assert_eq!(r.stats().refused, 1);
        let other = Record { xfer: XferId(78), ..grant(1) };
        assert_eq!(
            r.handle_fetched(&image(&[other], &TOKEN)),
            Err(ReaderError::Misbound { slot: SLOT, xfer: XferId(78) })
        );
    }

    #[test]
    fn nothing_after_a_fail() {
        let mut r = reader();
        let fail = Record { answer: Answer::Fail(FailReason::Cancelled), ..grant(2) };
        assert_eq!(r.handle_fetched(&image(&[grant(1), fail, grant(3)], &TOKEN)), Ok(2));
        assert!(r.is_finished());
        assert_eq!(r.handle_fetched(&image(&[grant(1), fail, grant(3)], &TOKEN)), Ok(0));
        assert_eq!(drain(&mut r), [1, 2]);
    }

    /// The first records of the token's candidates, as the target leaves them when it gave
    /// the transfer candidate `which` and wrote `first` there.
    fn first_records(r: &MailboxReader, which: usize, first: &Record, token: &Token) -> Vec<u8> {
        let n = r.fetch().len();
        let mut img = vec![0; n * RECORD_LEN];
        img[which * RECORD_LEN..(which + 1) * RECORD_LEN].copy_from_slice(&first.encode(&RecordKey::derive(token)));
        img
    }

    #[test]
    fn locating_settles_on_the_candidate_holding_record_one() {
        let layout = MailboxLayout { slots: 64, ring: 4 };
        let mut r = MailboxReader::locate(layout, XFER, &TOKEN).unwrap();
        let cands = candidates(&TOKEN, layout);
        assert_eq!(r.slot(), None);
        assert_eq!(
            r.fetch(),
            cands.iter().map(|s| Region { offset: u64::from(s.0) * 256, len: 64 }).collect::<Vec<_>>()
        );
        // nothing yet, then another transfer's record in candidate 0 (passed over, not counted:
        // the other candidates are other transfers' slots), ours in candidate 2
        assert_eq!(r.handle_fetched(&vec![0; cands.len() * RECORD_LEN]), Ok(0));
        let mine = Record { slot: cands[2], ..grant(1) };
        let mut img = first_records(&r, 2, &mine, &TOKEN);
        img[..RECORD_LEN]
            .copy_from_slice(&Record { slot: cands[0], ..grant(1) }.encode(&RecordKey::derive(&Token([9; 16]))));
        assert_eq!(r.handle_fetched(&img), Ok(1));
        assert_eq!(r.slot(), Some(cands[2]));
        assert_eq!(r.stats().refused, 0);
        assert_eq!(r.fetch(), [Region { offset: u64::from(cands[2].0) * 256, len: 256 }]);
        assert_eq!(r.consumed(), Seq(1));
        assert_eq!(drain(&mut r), [1]);
    }

    #[test]
    fn locating_refuses_what_only_a_broken_target_writes() {
        let layout = MailboxLayout { slots: 64, ring: 4 };
        let cands = candidates(&TOKEN, layout);
        let mut r = MailboxReader::locate(layout, XFER, &TOKEN).unwrap();
        // a genuine record copied into another candidate by a third party: refused, not fatal
        let elsewhere = Record { slot: SlotId(cands[0].0 + 1), ..grant(1) };
        let img = first_records(&r, 0, &elsewhere, &TOKEN);
        assert_eq!(r.handle_fetched(&img), Ok(0));
        assert_eq!((r.slot(), r.stats().refused), (None, 1));
        // ... or moved within its own slot from position 1 to position 0 (found by the exchange
        // property test): refused too
        let moved = Record { slot: cands[0], ..grant(2) };
        let img = first_records(&r, 0, &moved, &TOKEN);
        assert_eq!(r.handle_fetched(&img), Ok(0));
        assert_eq!((r.slot(), r.stats().refused), (None, 2));
        let other = Record { slot: cands[0], xfer: XferId(1), ..grant(1) };
        let img = first_records(&r, 0, &other, &TOKEN);
        assert_eq!(r.handle_fetched(&img), Err(ReaderError::Misbound { slot: cands[0], xfer: XferId(1) }));
        let mut r = MailboxReader::locate(layout, XFER, &TOKEN).unwrap();
        let late = Record { slot: cands[1], ..grant(5) };
        let img = first_records(&r, 1, &late, &TOKEN);
        assert_eq!(r.handle_fetched(&img), Err(ReaderError::Skipped { expected: Seq(1), found: Seq(5) }));
    }

    #[test]
    fn wrong_image_length() {
        assert_eq!(reader().handle_fetched(&[0; 64]), Err(ReaderError::WrongImageLength { expected: 256, got: 64 }));
    }
}
