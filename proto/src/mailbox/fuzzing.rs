//! Entry points of the `mailbox_decode` cargo-fuzz target and its seed corpus.

use super::reader::{MailboxReader, ReaderError};
use super::record::{Answer, RECORD_LEN, Record, RecordKey, Seq, SlotId, Token};
use super::slots::{MailboxLayout, candidates};
use crate::types::{ChunkIdx, Region, XferId};
use crate::wire::{AckStatus, Credit};

/// The token every fuzz input is checked under.
pub const FUZZ_TOKEN: Token = Token([0x5a; 16]);
/// The layout of the ring image fuzz inputs are read as: 8 records, the reader on slot 1.
pub const FUZZ_LAYOUT: MailboxLayout = MailboxLayout { slots: 2, ring: 8 };
const FUZZ_SLOT: SlotId = SlotId(1);
const FUZZ_XFER: XferId = XferId(0x2a);

/// Runs `data` through the record decoder and the reader.
///
/// 1. The first 64 bytes as a record: decoding never panics, and what decodes re-encodes to
///    the same bytes.
/// 2. The same 48-byte body re-MAC'd under the fuzz key (what only the target could write): the
///    field rules run; what decodes re-encodes to the same bytes.
/// 3. `data` padded or cut to a ring image, handed to a fresh reader twice: never panics,
///    accepts records only in sequence from 1, never more than the ring holds, each one
///    authentic for this slot and transfer, and a second pass over the same image accepts
///    nothing new;
/// 4. `data` as the first records of the fuzz token's candidate slots, handed to a locating
///    reader: never panics, and settles only on a candidate whose first record is authentic
///    record 1 of this transfer in that slot.
///
/// Returns how many records the reader accepted (the stable tests check they are not vacuous).
///
/// # Panics
/// When one of those properties fails (a bug).
pub fn mailbox_decode(data: &[u8]) -> usize {
    let key = RecordKey::derive(&FUZZ_TOKEN);
    let mut rec = [0u8; RECORD_LEN];
    let n = data.len().min(RECORD_LEN);
    rec[..n].copy_from_slice(&data[..n]);
    if let Ok(r) = Record::decode(&rec, &key) {
        assert_eq!(r.encode(&key), rec, "decode accepted a non-canonical record");
    }
    let remac = remac(rec, &key);
    if let Ok(r) = Record::decode(&remac, &key) {
        assert_eq!(r.encode(&key), remac, "decode accepted a non-canonical record");
    }

    let ring = FUZZ_LAYOUT.ring_bytes() as usize;
    let mut image = vec![0u8; ring];
    let n = data.len().min(ring);
    image[..n].copy_from_slice(&data[..n]);
    let mut reader = MailboxReader::new(FUZZ_LAYOUT, FUZZ_SLOT, FUZZ_XFER, &FUZZ_TOKEN).expect("fuzz layout is valid");
    match reader.handle_fetched(&image) {
        Ok(_) | Err(ReaderError::Skipped { .. } | ReaderError::Misbound { .. }) => {}
        Err(e) => panic!("unexpected reader error {e}"),
    }
    let mut expect = 1;
    while let Some((seq, _)) = reader.poll_answer() {
        assert_eq!(seq, Seq(expect), "answers out of sequence");
        let pos = FUZZ_LAYOUT.position(seq) as usize * RECORD_LEN;
        let r = Record::decode(&image[pos..pos + RECORD_LEN], &key).expect("accepted an unauthentic record");
        assert_eq!((r.slot, r.xfer, r.seq), (FUZZ_SLOT, FUZZ_XFER, seq));
        expect += 1;
    }
    assert!(expect - 1 <= u64::from(FUZZ_LAYOUT.ring));
    assert_eq!(reader.consumed(), Seq(expect - 1));
    if reader.handle_fetched(&image).is_ok() {
        assert_eq!(reader.poll_answer(), None, "the same image accepted twice");
    }

    let mut locator = MailboxReader::locate(FUZZ_LAYOUT, FUZZ_XFER, &FUZZ_TOKEN).expect("fuzz layout is valid");
    let cands = candidates(&FUZZ_TOKEN, FUZZ_LAYOUT);
    let mut firsts = vec![0u8; cands.len() * RECORD_LEN];
    let n = data.len().min(firsts.len());
    firsts[..n].copy_from_slice(&data[..n]);
    if let Ok(1) = locator.handle_fetched(&firsts) {
        let slot = locator.slot().expect("located");
        let i = cands.iter().position(|&c| c == slot).expect("located on a candidate");
        let r = Record::decode(&firsts[i * RECORD_LEN..(i + 1) * RECORD_LEN], &key)
            .expect("located on an unauthentic record");
        assert_eq!((r.slot, r.xfer, r.seq), (slot, FUZZ_XFER, Seq(1)));
    } else {
        assert_eq!(locator.slot(), None);
    }
    (expect - 1) as usize
}

/// The record with its MAC recomputed over its body, as only the key's holder could write it.
fn remac(mut rec: [u8; RECORD_LEN], key: &RecordKey) -> [u8; RECORD_LEN] {
    let mac = key.mac(&rec[..48]);
    rec[48..].copy_from_slice(&mac);
    rec
}

/// Valid ring images for the `mailbox_decode` seed corpus: an empty ring, a ring with a GRANT,
/// an ACK and a READY in sequence, and a ring whose second record ends the transfer.
pub fn seed_rings() -> Vec<Vec<u8>> {
    let key = RecordKey::derive(&FUZZ_TOKEN);
    let credit = |i: u32| Credit { chunk: ChunkIdx(i), region: Region { offset: u64::from(i) * 0x1000, len: 0x1000 } };
    let rec = |seq: u64, answer| Record { slot: FUZZ_SLOT, seq: Seq(seq), xfer: FUZZ_XFER, answer };
    let ring = |records: &[Record]| {
        let mut img = vec![0u8; FUZZ_LAYOUT.ring_bytes() as usize];
        for r in records {
            let pos = FUZZ_LAYOUT.position(r.seq) as usize * RECORD_LEN;
            img[pos..pos + RECORD_LEN].copy_from_slice(&r.encode(&key));
        }
        img
    };
    vec![
        ring(&[]),
        ring(&[
            rec(1, Answer::Grant(credit(0))),
            rec(2, Answer::Ack { credit: credit(0), status: AckStatus::Scattered }),
            rec(3, Answer::Ready(credit(1))),
        ]),
        ring(&[rec(1, Answer::Ready(credit(2))), rec(2, Answer::Fail(super::FailReason::Cancelled))]),
    ]
}
