//! Entry points of the cargo-fuzz targets under `fuzz/` and their seed corpus.

use super::caps::Capabilities;
use super::envelope::ConnEnvelope;
use super::frame::{ControlFrame, Frame};
use super::public::PublicData;
use super::samples::{self, assert_canonical};

/// Decodes `data` as a frame, and as a control frame of any kind (HELLO included); if either
/// succeeds, asserts re-encoding gives `data` back.
///
/// # Panics
/// When the codec is not canonical (a bug).
pub fn frame_decode(data: &[u8]) {
    assert_canonical(data, Frame::decode, Frame::to_vec);
    assert_canonical(data, ControlFrame::decode, ControlFrame::to_vec);
}

/// Encodes `frame` and asserts that decoding accepts it exactly when [`Msg::validate`](super::frame::Msg::validate)
/// does, and then returns an equal frame.
///
/// # Panics
/// When encode and decode disagree (a bug).
pub fn frame_encode(frame: &Frame) {
    let bytes = frame.to_vec();
    match (frame.msg.validate(), Frame::decode(&bytes)) {
        (Ok(()), Ok(back)) => assert_eq!(&back, frame),
        (Err(_), Err(_)) => {}
        (v, d) => panic!("validate {v:?} but decode {d:?}"),
    }
}

/// Decodes `data` as a capability blob; if that succeeds, asserts re-encoding gives `data`.
///
/// # Panics
/// When the codec is not canonical (a bug).
pub fn caps_decode(data: &[u8]) {
    assert_canonical(data, Capabilities::decode, Capabilities::to_vec);
}

/// Decodes `data` as an envelope; if that succeeds, asserts re-encoding gives `data`.
///
/// # Panics
/// When the codec is not canonical (a bug).
pub fn envelope_decode(data: &[u8]) {
    assert_canonical(data, ConnEnvelope::decode, ConnEnvelope::to_vec);
}

/// Decodes `data` as a registration's public-data envelope; if that succeeds, asserts
/// re-encoding gives `data`.
///
/// # Panics
/// When the codec is not canonical (a bug).
pub fn public_decode(data: &[u8]) {
    assert_canonical(data, PublicData::decode, PublicData::to_vec);
}

/// Valid encoded frames, one per message shape, for the `wire_decode` seed corpus.
pub fn seed_frames() -> Vec<Vec<u8>> {
    samples::sample_frames().iter().map(Frame::to_vec).collect()
}

/// Valid encoded capability blobs for the `caps_decode` seed corpus.
pub fn seed_caps() -> Vec<Vec<u8>> {
    let zmq = samples::sample_caps();
    let ucx = Capabilities {
        control: crate::types::ControlKind::Ucx,
        mem: crate::types::MemKind::Dram,
        endpoint: b"tcp://10.0.0.1:5555".to_vec(),
        ..zmq.clone()
    };
    vec![zmq.to_vec(), ucx.to_vec()]
}

/// Valid encoded envelopes (with and without capabilities) for the `envelope_decode` corpus.
pub fn seed_envelopes() -> Vec<Vec<u8>> {
    samples::sample_envelopes().iter().map(ConnEnvelope::to_vec).collect()
}

/// Valid public-data envelopes (with and without an inner blob) for the `public_decode` corpus.
pub fn seed_public() -> Vec<Vec<u8>> {
    let key = crate::types::RegKey([0x42; 32]);
    [Vec::new(), b"ucx-rkey-blob".to_vec()]
        .into_iter()
        .enumerate()
        .map(|(i, inner)| PublicData { reg: crate::types::RegId(i as u64 + 1), key, inner }.to_vec())
        .collect()
}
