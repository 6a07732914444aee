//! The initiator's side of the mailbox: for one transfer, which bytes of the target's mailbox to
//! READ, which record comes next, and which records to act on, refuse or ignore.
//!
//! Rules, for a fetched image of the transfer's slot (its whole ring):
//! - only the record at the ring position of the next expected sequence number is looked at,
//!   and accepted when it decodes under this transfer's key, names this slot and transfer, and
//!   carries exactly that sequence number; then the next position is looked at, and so on;
//! - a record with an older sequence number is the previous lap or a replay: ignored (`stale`);
//! - a record that does not verify (torn by a READ racing the target's write, written by a
//!   third party, of another transfer) or that sits at the wrong position for its sequence (a
//!   genuine record copied elsewhere) is refused (`refused`) and read again on the next fetch;
//!   a forger can only delay answers until the transfer's no-progress timeout, never inject one;
//! - an authentic record that breaks the ring rule (a sequence number from a lap ahead) or
//!   names another slot or transfer can only come from the target itself: a protocol error;
//! - after a FAIL nothing more is accepted.
//!
//! No clock, no IO: the shell posts the READ of [`MailboxReader::fetch`], hands the bytes to
//! [`MailboxReader::handle_fetched`] and carries [`MailboxReader::consumed`] back to the target.

use std::collections::VecDeque;

use crate::types::{Region, XferId};

use super::record::{Answer, RECORD_LEN, Record, RecordError, RecordKey, Seq, SlotId, Token};
use super::slots::{MailboxLayout, SlotError};

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
    /// The image is not exactly the slot's ring.
    #[error("fetched {got} bytes, the ring is {expected}")]
    WrongImageLength {
        /// The ring's length.
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
    /// An authentic record names another slot or transfer.
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
/// Call order: [`new`](Self::new) when the WANT is sent (its token is the key); whenever the
/// transfer waits for an answer, READ [`fetch`](Self::fetch) from the target's mailbox, call
/// [`handle_fetched`](Self::handle_fetched) with the bytes, drain
/// [`poll_answer`](Self::poll_answer) until `None`, and report [`consumed`](Self::consumed) to
/// the target in the next frame sent to it.
#[derive(Debug)]
pub struct MailboxReader {
    layout: MailboxLayout,
    slot: SlotId,
    ring: Region,
    xfer: XferId,
    key: RecordKey,
    /// The next sequence number to accept.
    next: u64,
    finished: bool,
    answers: VecDeque<(Seq, Answer)>,
    stats: ReaderStats,
}

impl MailboxReader {
    /// A reader for transfer `xfer`'s records in `slot` of a mailbox of shape `layout`, under
    /// the transfer's `token`.
    ///
    /// # Errors
    /// [`ReaderError::Slot`] when the layout is out of bounds, [`ReaderError::NoSuchSlot`] when
    /// the slot is outside it (both come from the target, so they are untrusted).
    pub fn new(layout: MailboxLayout, slot: SlotId, xfer: XferId, token: &Token) -> Result<Self, ReaderError> {
        layout.validate()?;
        let ring = layout.slot_region(slot).ok_or(ReaderError::NoSuchSlot { slot })?;
        Ok(Self {
            layout,
            slot,
            ring,
            xfer,
            key: RecordKey::derive(token),
            next: 1,
            finished: false,
            answers: VecDeque::new(),
            stats: ReaderStats::default(),
        })
    }

    /// The bytes to READ: the slot's ring, relative to the target's mailbox base.
    pub fn fetch(&self) -> Region {
        self.ring
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

    /// Takes a fetched image of the ring and queues every new answer in order. Returns how
    /// many were accepted.
    ///
    /// # Errors
    /// See [`ReaderError`]: the image has the wrong length, or the target broke the protocol
    /// (the transfer should fail). Answers accepted before the error stay queued.
    pub fn handle_fetched(&mut self, image: &[u8]) -> Result<usize, ReaderError> {
        if image.len() as u64 != self.ring.len {
            return Err(ReaderError::WrongImageLength { expected: self.ring.len, got: image.len() });
        }
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
            if record.slot != self.slot || record.xfer != self.xfer {
                return Err(ReaderError::Misbound { slot: record.slot, xfer: record.xfer });
            }
            if self.layout.position(record.seq) as usize != pos {
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
        assert_eq!(reader().fetch(), Region { offset: 2 * 256, len: 256 });
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
    fn an_authentic_record_of_another_slot_or_transfer_is_a_protocol_error() {
        let mut r = reader();
        let other = Record { xfer: XferId(78), ..grant(1) };
        assert_eq!(
            r.handle_fetched(&image(&[other], &TOKEN)),
            Err(ReaderError::Misbound { slot: SLOT, xfer: XferId(78) })
        );
        let moved = Record { slot: SlotId(1), ..grant(1) };
        assert_eq!(
            r.handle_fetched(&image(&[moved], &TOKEN)),
            Err(ReaderError::Misbound { slot: SlotId(1), xfer: XFER })
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

    #[test]
    fn wrong_image_length() {
        assert_eq!(reader().handle_fetched(&[0; 64]), Err(ReaderError::WrongImageLength { expected: 256, got: 64 }));
    }
}
