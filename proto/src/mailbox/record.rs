//! The mailbox record: one fixed-size, authenticated answer of a target to an initiator
//! (GRANT, READY, ACK or FAIL), written by the target into its own registered arena and fetched
//! by the initiator with an RDMA READ (docs/one-way.md).
//!
//! This file owns the 64-byte layout, the per-transfer key and the MAC. It does not decide
//! where a record goes (`slots`) or whether a decoded record is the next one to act on
//! (`reader`). Decoding treats its input as hostile: any peer that loaded the target's metadata
//! can RDMA-write the arena, and a READ that races the target's own write returns a torn mix of
//! two records. Both show up here as a MAC that does not verify; decoding never panics.
//!
//! Layout (little-endian; the MAC covers bytes 0..48):
//!
//! | bytes | field |
//! |---|---|
//! | 0 | version (`RECORD_VERSION`) |
//! | 1 | kind: 1 GRANT, 2 READY, 3 ACK, 4 FAIL |
//! | 2 | status: ACK's [`AckStatus`], FAIL's [`FailReason`], else 0 |
//! | 3 | reserved, 0 |
//! | 4..8 | slot (`u32`): the slot the target wrote it to |
//! | 8..16 | sequence number (`u64`, from 1) within the slot's current transfer |
//! | 16..24 | the initiator's transfer id |
//! | 24..28 | chunk index (0 for FAIL) |
//! | 28..32 | reserved, 0 |
//! | 32..40 / 40..48 | region offset / length in the target's arena (0 / 0 for FAIL) |
//! | 48..64 | MAC: the first 16 bytes of keyed BLAKE3 over bytes 0..48 |

use crate::types::{ChunkIdx, Region, XferId};
use crate::wire::{AckStatus, Credit};

/// A slot of the mailbox, numbered from 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "fuzzing", derive(arbitrary::Arbitrary))]
pub struct SlotId(pub u32);

/// A record's sequence number within its slot's current transfer; the first record is 1, and
/// 0 means "none yet" in cursors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "fuzzing", derive(arbitrary::Arbitrary))]
pub struct Seq(pub u64);

/// Size of one record in bytes: one cache line, so a target's write of a record never spans
/// two lines and the initiator's READ of a whole ring is a multiple of it.
pub const RECORD_LEN: usize = 64;

/// Layout version in byte 0. An all-zero record (never written) is told apart by it.
pub const RECORD_VERSION: u8 = 1;

/// Bytes covered by the MAC.
const BODY_LEN: usize = 48;
/// Length of the truncated MAC (128 bits, as the token).
const MAC_LEN: usize = RECORD_LEN - BODY_LEN;
/// BLAKE3 key-derivation context: binds keys to this use, so a token can never serve as a key
/// for anything else.
const KEY_CONTEXT: &str = "nixl-bounce 2026-11 mailbox record v1";

const KIND_GRANT: u8 = 1;
const KIND_READY: u8 = 2;
const KIND_ACK: u8 = 3;
const KIND_FAIL: u8 = 4;

/// A per-transfer secret of 128 bits, chosen by the initiator (the shell draws it from the OS
/// generator) and sent to the target in its WANT; it never appears in the arena.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "fuzzing", derive(arbitrary::Arbitrary))]
pub struct Token(pub [u8; 16]);

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // A secret stays out of logs.
        f.write_str("Token(..)")
    }
}

/// The MAC key of one transfer's records, derived from its [`Token`] once per transfer.
#[derive(Clone)]
pub struct RecordKey([u8; 32]);

impl RecordKey {
    /// Derives the key for `token` (BLAKE3 `derive_key` under this layout's context string).
    pub fn derive(token: &Token) -> Self {
        Self(blake3::derive_key(KEY_CONTEXT, &token.0))
    }

    /// The truncated keyed BLAKE3 of a record body (bytes 0..48).
    pub(super) fn mac(&self, body: &[u8]) -> [u8; MAC_LEN] {
        let full = blake3::keyed_hash(&self.0, body);
        let mut out = [0; MAC_LEN];
        out.copy_from_slice(&full.as_bytes()[..MAC_LEN]);
        out
    }
}

impl std::fmt::Debug for RecordKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RecordKey(..)")
    }
}

/// Why a transfer ended on the target's side (a FAIL record).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "fuzzing", derive(arbitrary::Arbitrary))]
pub enum FailReason {
    /// The initiator's cancel was honoured.
    Cancelled,
    /// The target refused the WANT (malformed, or more than it will ever serve).
    Refused,
    /// The target gave up on the transfer after its no-progress timeout.
    TimedOut,
    /// The target's engine is shutting down.
    Shutdown,
    /// A gather (READ) or scatter (WRITE) copy failed on the target.
    CopyFailed,
}

/// What a record tells the initiator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "fuzzing", derive(arbitrary::Arbitrary))]
pub enum Answer {
    /// WRITE: the initiator may write this chunk into this region of the target's arena.
    Grant(Credit),
    /// READ: the target has gathered this chunk into this region; the initiator may READ it.
    Ready(Credit),
    /// WRITE: the chunk written to the region was scattered (or not: `status`).
    Ack {
        /// The chunk and the region it occupied.
        credit: Credit,
        /// What happened to it.
        status: AckStatus,
    },
    /// The target ended the transfer; nothing more will come in this slot for it.
    Fail(FailReason),
}

impl Answer {
    /// Checks that every answer but FAIL carries a non-empty region that does not overflow.
    ///
    /// # Errors
    /// [`RecordError::Invalid`] naming the broken rule.
    pub fn validate(&self) -> Result<(), RecordError> {
        match *self {
            Self::Grant(c) | Self::Ready(c) | Self::Ack { credit: c, .. } => {
                if c.region.len == 0 {
                    return Err(RecordError::Invalid { what: "empty region" });
                }
                if c.region.checked_end().is_none() {
                    return Err(RecordError::Invalid { what: "region overflows" });
                }
                Ok(())
            }
            Self::Fail(_) => Ok(()),
        }
    }
}

/// One mailbox record, as the target writes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "fuzzing", derive(arbitrary::Arbitrary))]
pub struct Record {
    /// The slot the record is written to (a record moved to another slot is refused).
    pub slot: SlotId,
    /// Its sequence number within the slot's current transfer, from 1.
    pub seq: Seq,
    /// The initiator's transfer id.
    pub xfer: XferId,
    /// The answer.
    pub answer: Answer,
}

/// Reasons 64 bytes are not a record the initiator may act on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RecordError {
    /// The input is not exactly [`RECORD_LEN`] bytes.
    #[error("a record is {RECORD_LEN} bytes, got {got}")]
    WrongLength {
        /// The length given.
        got: usize,
    },
    /// All zero: nothing was ever written here.
    #[error("empty record")]
    Empty,
    /// Byte 0 names a layout this build does not speak.
    #[error("unsupported record version {got}")]
    UnsupportedVersion {
        /// The version byte found.
        got: u8,
    },
    /// The MAC does not verify under this transfer's key: a torn READ, a record of another
    /// transfer, or a forgery. The reader cannot tell these apart and never needs to.
    #[error("record MAC does not verify")]
    BadMac,
    /// The MAC verifies but a field breaks the layout's rules (only a holder of the key, i.e.
    /// the target itself, can produce this).
    #[error("invalid record: {what}")]
    Invalid {
        /// What is wrong.
        what: &'static str,
    },
}

impl Record {
    /// Checks the rules [`Record::decode`] enforces on an authentic record: a sequence number
    /// of at least 1, and a non-empty region that does not overflow for every answer but FAIL.
    ///
    /// # Errors
    /// [`RecordError::Invalid`] naming the broken rule.
    pub fn validate(&self) -> Result<(), RecordError> {
        if self.seq.0 == 0 {
            return Err(RecordError::Invalid { what: "sequence 0" });
        }
        self.answer.validate()
    }

    /// The record's bytes, MAC'd under `key`. Total: an invalid record encodes too (and then
    /// fails to decode), so tests can build hostile input with it.
    pub fn encode(&self, key: &RecordKey) -> [u8; RECORD_LEN] {
        let mut b = [0u8; RECORD_LEN];
        let (kind, status, credit) = match self.answer {
            Answer::Grant(c) => (KIND_GRANT, 0, c),
            Answer::Ready(c) => (KIND_READY, 0, c),
            Answer::Ack { credit, status } => (KIND_ACK, ack_tag(status), credit),
            Answer::Fail(r) => (KIND_FAIL, fail_tag(r), NO_CREDIT),
        };
        b[0] = RECORD_VERSION;
        b[1] = kind;
        b[2] = status;
        b[4..8].copy_from_slice(&self.slot.0.to_le_bytes());
        b[8..16].copy_from_slice(&self.seq.0.to_le_bytes());
        b[16..24].copy_from_slice(&self.xfer.0.to_le_bytes());
        b[24..28].copy_from_slice(&credit.chunk.0.to_le_bytes());
        b[32..40].copy_from_slice(&credit.region.offset.to_le_bytes());
        b[40..48].copy_from_slice(&credit.region.len.to_le_bytes());
        let mac = key.mac(&b[..BODY_LEN]);
        b[BODY_LEN..].copy_from_slice(&mac);
        b
    }

    /// Decodes and authenticates one record under `key`. Order of checks: length, empty,
    /// version, MAC, then fields, so nothing of an unauthenticated record is interpreted.
    ///
    /// # Errors
    /// See [`RecordError`]; never panics, whatever `bytes` holds.
    pub fn decode(bytes: &[u8], key: &RecordKey) -> Result<Self, RecordError> {
        let b: &[u8; RECORD_LEN] = bytes.try_into().map_err(|_| RecordError::WrongLength { got: bytes.len() })?;
        if b.iter().all(|&x| x == 0) {
            return Err(RecordError::Empty);
        }
        if b[0] != RECORD_VERSION {
            return Err(RecordError::UnsupportedVersion { got: b[0] });
        }
        if !same_mac(&key.mac(&b[..BODY_LEN]), &b[BODY_LEN..]) {
            return Err(RecordError::BadMac);
        }
        if b[3] != 0 || b[28..32] != [0; 4] {
            return Err(RecordError::Invalid { what: "reserved bytes" });
        }
        let credit =
            Credit { chunk: ChunkIdx(u32_at(b, 24)), region: Region { offset: u64_at(b, 32), len: u64_at(b, 40) } };
        let (kind, status) = (b[1], b[2]);
        let answer = match kind {
            KIND_GRANT | KIND_READY if status != 0 => return Err(RecordError::Invalid { what: "status byte" }),
            KIND_GRANT => Answer::Grant(credit),
            KIND_READY => Answer::Ready(credit),
            KIND_ACK => Answer::Ack { credit, status: ack_from_tag(status)? },
            KIND_FAIL if credit != NO_CREDIT => return Err(RecordError::Invalid { what: "FAIL with a region" }),
            KIND_FAIL => Answer::Fail(fail_from_tag(status)?),
            _ => return Err(RecordError::Invalid { what: "kind" }),
        };
        let record = Self { slot: SlotId(u32_at(b, 4)), seq: Seq(u64_at(b, 8)), xfer: XferId(u64_at(b, 16)), answer };
        record.validate()?;
        Ok(record)
    }

    /// The kind an encoded record says it is ("GRANT", "READY", "ACK", "FAIL", else "?"),
    /// unverified: for traces of records this engine wrote itself, never for a decision.
    pub fn kind_name(bytes: &[u8]) -> &'static str {
        match bytes.get(1) {
            Some(&KIND_GRANT) => "GRANT",
            Some(&KIND_READY) => "READY",
            Some(&KIND_ACK) => "ACK",
            Some(&KIND_FAIL) => "FAIL",
            _ => "?",
        }
    }
}

/// The chunk and region fields of a FAIL record.
const NO_CREDIT: Credit = Credit { chunk: ChunkIdx(0), region: Region { offset: 0, len: 0 } };

/// Compares MACs without an early exit, so the time taken says nothing about how many leading
/// bytes a forgery got right.
fn same_mac(a: &[u8; MAC_LEN], b: &[u8]) -> bool {
    b.len() == MAC_LEN && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn u32_at(b: &[u8; RECORD_LEN], at: usize) -> u32 {
    let mut v = [0; 4];
    v.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(v)
}

fn u64_at(b: &[u8; RECORD_LEN], at: usize) -> u64 {
    let mut v = [0; 8];
    v.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(v)
}

fn ack_tag(s: AckStatus) -> u8 {
    match s {
        AckStatus::Scattered => 0,
        AckStatus::Refused => 1,
        AckStatus::Failed => 2,
        AckStatus::Replan => 3,
        // One-way flows never claim a standing credit (the receiver refuses claims answered
        // through the mailbox), so no record says Kept; were one asked for, it is a scatter.
        AckStatus::Kept => 0,
    }
}

fn ack_from_tag(t: u8) -> Result<AckStatus, RecordError> {
    match t {
        0 => Ok(AckStatus::Scattered),
        1 => Ok(AckStatus::Refused),
        2 => Ok(AckStatus::Failed),
        3 => Ok(AckStatus::Replan),
        _ => Err(RecordError::Invalid { what: "ACK status" }),
    }
}

fn fail_tag(r: FailReason) -> u8 {
    match r {
        FailReason::Cancelled => 0,
        FailReason::Refused => 1,
        FailReason::TimedOut => 2,
        FailReason::Shutdown => 3,
        FailReason::CopyFailed => 4,
    }
}

fn fail_from_tag(t: u8) -> Result<FailReason, RecordError> {
    match t {
        0 => Ok(FailReason::Cancelled),
        1 => Ok(FailReason::Refused),
        2 => Ok(FailReason::TimedOut),
        3 => Ok(FailReason::Shutdown),
        4 => Ok(FailReason::CopyFailed),
        _ => Err(RecordError::Invalid { what: "FAIL reason" }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(b: u8) -> RecordKey {
        RecordKey::derive(&Token([b; 16]))
    }

    fn grant() -> Record {
        Record {
            slot: SlotId(3),
            seq: Seq(7),
            xfer: XferId(0x2a),
            answer: Answer::Grant(Credit { chunk: ChunkIdx(5), region: Region { offset: 0x1000, len: 0x800 } }),
        }
    }

    #[test]
    fn every_answer_round_trips() {
        let credit = Credit { chunk: ChunkIdx(1), region: Region { offset: 64, len: 32 } };
        let answers = [
            Answer::Grant(credit),
            Answer::Ready(credit),
            Answer::Ack { credit, status: AckStatus::Scattered },
            Answer::Ack { credit, status: AckStatus::Refused },
            Answer::Ack { credit, status: AckStatus::Failed },
            Answer::Ack { credit, status: AckStatus::Replan },
            Answer::Fail(FailReason::Cancelled),
            Answer::Fail(FailReason::Refused),
            Answer::Fail(FailReason::TimedOut),
            Answer::Fail(FailReason::Shutdown),
            Answer::Fail(FailReason::CopyFailed),
        ];
        for answer in answers {
            let r = Record { answer, ..grant() };
            let bytes = r.encode(&key(1));
            assert_eq!(Record::decode(&bytes, &key(1)), Ok(r));
            let named = match answer {
                Answer::Grant(_) => "GRANT",
                Answer::Ready(_) => "READY",
                Answer::Ack { .. } => "ACK",
                Answer::Fail(_) => "FAIL",
            };
            assert_eq!(Record::kind_name(&bytes), named);
        }
        assert_eq!(Record::kind_name(&[]), "?");
        assert_eq!(Record::kind_name(&[1, 9]), "?");
    }

    #[test]
    fn golden_layout() {
        let b = grant().encode(&key(1));
        assert_eq!(&b[..8], &[1, 1, 0, 0, 3, 0, 0, 0]);
        assert_eq!(&b[8..16], &7u64.to_le_bytes());
        assert_eq!(&b[16..24], &0x2au64.to_le_bytes());
        assert_eq!(&b[24..32], &[5, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(&b[32..48], &[0, 0x10, 0, 0, 0, 0, 0, 0, 0, 8, 0, 0, 0, 0, 0, 0]);
        // the MAC depends on the key
        assert_ne!(b[48..], grant().encode(&key(2))[48..]);
    }

    #[test]
    fn another_transfers_key_is_refused() {
        assert_eq!(Record::decode(&grant().encode(&key(1)), &key(2)), Err(RecordError::BadMac));
    }

    #[test]
    fn any_flipped_bit_is_refused() {
        let good = grant().encode(&key(1));
        for bit in 0..RECORD_LEN * 8 {
            let mut b = good;
            b[bit / 8] ^= 1 << (bit % 8);
            assert!(Record::decode(&b, &key(1)).is_err(), "bit {bit} flipped still decodes");
        }
    }

    #[test]
    fn a_torn_record_is_refused() {
        // a READ racing the target's write: the first half of the new record, the rest old
        let old = grant().encode(&key(1));
        let new = Record { seq: Seq(8), ..grant() }.encode(&key(1));
        let mut torn = old;
        torn[..32].copy_from_slice(&new[..32]);
        assert_eq!(Record::decode(&torn, &key(1)), Err(RecordError::BadMac));
    }

    #[test]
    fn structural_refusals() {
        assert_eq!(Record::decode(&[0; 63], &key(1)), Err(RecordError::WrongLength { got: 63 }));
        assert_eq!(Record::decode(&[0; 64], &key(1)), Err(RecordError::Empty));
        let mut b = grant().encode(&key(1));
        b[0] = 2;
        assert_eq!(Record::decode(&b, &key(1)), Err(RecordError::UnsupportedVersion { got: 2 }));
    }

    /// Field rules are checked after the MAC: re-MAC a spoiled body as the target would.
    fn remac(mut b: [u8; RECORD_LEN], k: &RecordKey) -> [u8; RECORD_LEN] {
        let mac = k.mac(&b[..BODY_LEN]);
        b[BODY_LEN..].copy_from_slice(&mac);
        b
    }

    #[test]
    fn authentic_but_invalid_fields_are_refused() {
        let k = key(1);
        let good = grant().encode(&k);
        let spoil = |at: usize, v: u8| {
            let mut b = good;
            b[at] = v;
            Record::decode(&remac(b, &k), &k)
        };
        assert_eq!(spoil(1, 9), Err(RecordError::Invalid { what: "kind" }));
        assert_eq!(spoil(2, 1), Err(RecordError::Invalid { what: "status byte" }));
        assert_eq!(spoil(3, 1), Err(RecordError::Invalid { what: "reserved bytes" }));
        assert_eq!(spoil(29, 1), Err(RecordError::Invalid { what: "reserved bytes" }));
        let zero_seq = Record { seq: Seq(0), ..grant() }.encode(&k);
        assert_eq!(Record::decode(&zero_seq, &k), Err(RecordError::Invalid { what: "sequence 0" }));
        let empty = Record {
            answer: Answer::Grant(Credit { chunk: ChunkIdx(0), region: Region { offset: 8, len: 0 } }),
            ..grant()
        };
        assert_eq!(Record::decode(&empty.encode(&k), &k), Err(RecordError::Invalid { what: "empty region" }));
        let wraps = Record {
            answer: Answer::Ready(Credit { chunk: ChunkIdx(0), region: Region { offset: u64::MAX, len: 2 } }),
            ..grant()
        };
        assert_eq!(Record::decode(&wraps.encode(&k), &k), Err(RecordError::Invalid { what: "region overflows" }));
        let mut fail = Record { answer: Answer::Fail(FailReason::Shutdown), ..grant() }.encode(&k);
        fail[2] = 9;
        assert_eq!(Record::decode(&remac(fail, &k), &k), Err(RecordError::Invalid { what: "FAIL reason" }));
        fail[2] = 0;
        fail[40] = 1;
        assert_eq!(Record::decode(&remac(fail, &k), &k), Err(RecordError::Invalid { what: "FAIL with a region" }));
        let mut ack =
            Record { answer: Answer::Ack { credit: NO_CREDIT, status: AckStatus::Failed }, ..grant() }.encode(&k);
        ack[40] = 1;
        ack[2] = 4;
        assert_eq!(Record::decode(&remac(ack, &k), &k), Err(RecordError::Invalid { what: "ACK status" }));
    }

    #[test]
    fn token_never_prints() {
        assert_eq!(format!("{:?}", Token([7; 16])), "Token(..)");
        assert_eq!(format!("{:?}", key(7)), "RecordKey(..)");
    }
}
