//! One valid value of each wire shape, shared by the codec's tests and the fuzz seed corpus,
//! and the canonical-encoding assertion both use.

use super::caps::{ArenaCaps, Arenas, Capabilities, MailboxCaps};
use super::codec::Result;
use super::envelope::ConnEnvelope;
use super::frame::{Ack, AckStatus, Credit, Data, Frame, Grant, Inline, Msg, Proof, Standing, WIRE_VERSION, Want};
use crate::types::{ArenaId, ChunkIdx, ControlKind, CopyRun, MemKind, RegId, Region, Token, XferId};

/// One valid frame of each shape; the golden tests and the fuzz seed corpus start from these.
pub(super) fn sample_frames() -> Vec<Frame> {
    let region = Region { offset: 0x100, len: 0x40 };
    let run = CopyRun { region_off: 0, addr: 0x1000, len: 0x20, count: 2, region_stride: 0x20, addr_stride: 0x80 };
    let xfer = XferId(3);
    let chunk = ChunkIdx(2);
    let token = Token(0x0123_4567_89ab_cdef_fedc_ba98_7654_3210);
    let msgs = [
        Msg::Want(Want {
            // The receiver's second arena (wire version 12).
            arena: ArenaId(1),
            xfer: XferId(0x2a),
            token,
            endpoint: b"ep".to_vec(),
            chunks: vec![4096, 32],
            proofs: vec![Proof { reg: RegId(5), tag: [0xaa; 16] }],
            inline: None,
            // Chunk 0 claims the standing flow's region (wire version 10).
            standing: Standing::Claim { xfer: XferId(0x8000_0000_0000_0001), token },
        }),
        Msg::cancel(XferId(0x2a), token, b"tcp://10.0.0.1:5555".to_vec()),
        Msg::Grant(Grant {
            xfer,
            token,
            credits: vec![
                Credit { chunk: ChunkIdx(0), region },
                Credit { chunk: ChunkIdx(1), region: Region { offset: 0x140, len: 0x20 } },
            ],
        }),
        Msg::Data(Data { xfer, token, chunk, region, runs: vec![run], region_plan_runs: 0 }),
        Msg::Ack(Ack { xfer, token, chunk, region, status: AckStatus::Refused }),
        // A WANT carrying its one chunk (wire version 9).
        Msg::Want(Want {
            arena: ArenaId(0),
            xfer: XferId(0x2b),
            token,
            endpoint: b"ep".to_vec(),
            chunks: vec![0x40],
            proofs: vec![Proof { reg: RegId(5), tag: [0xbb; 16] }],
            inline: Some(Inline { runs: vec![run], bytes: (0..0x40).collect() }),
            standing: Default::default(),
        }),
        // A WANT that opens a standing flow (wire version 10).
        Msg::Want(Want {
            arena: ArenaId(0),
            xfer: XferId(0x8000_0000_0000_0029),
            token,
            endpoint: b"ep".to_vec(),
            chunks: vec![0x20_0000],
            proofs: vec![],
            inline: None,
            standing: Standing::Open,
        }),
    ];
    msgs.into_iter().enumerate().map(|(i, msg)| Frame { session: i as u64 + 1, msg }).collect()
}

pub(super) fn sample_caps() -> Capabilities {
    Capabilities {
        wire_version: WIRE_VERSION.into(),
        control: ControlKind::Zmq,
        session: 9,
        arenas: Arenas::one(ArenaCaps {
            mem: MemKind::Vram,
            dev: 0,
            base: 0x1000,
            len: 0x2000,
            usable_capacity: 0x2000,
            max_chunk: 0x400,
            key: b"k".to_vec(),
        }),
        endpoint: Vec::new(),
        mailbox: Some(MailboxCaps { offset: 0, slots: 256, ring: 18 }),
        mailbox_base: 0x7f00_0000_0000,
        mailbox_len: 256 * 18 * 64,
        mailbox_key: b"m".to_vec(),
        request_timeout_ms: 1500,
    }
}

pub(super) fn sample_envelopes() -> Vec<ConnEnvelope> {
    vec![
        ConnEnvelope { caps: None, inner: vec![0xab] },
        ConnEnvelope { caps: Some(sample_caps()), inner: b"ucx-worker-address".to_vec() },
    ]
}

/// Asserts the canonical-encoding property on arbitrary input: if `decode` accepts `data`,
/// `encode` gives back exactly `data`.
pub(super) fn assert_canonical<T>(data: &[u8], decode: fn(&[u8]) -> Result<T>, encode: fn(&T) -> Vec<u8>) {
    if let Ok(v) = decode(data) {
        assert_eq!(encode(&v), data, "decode accepted a non-canonical encoding");
    }
}
