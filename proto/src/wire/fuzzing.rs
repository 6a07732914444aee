//! Entry points of the cargo-fuzz targets under `fuzz/` and their seed corpus.

use super::caps::{ArenaCaps, Capabilities};
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
    // An escaped application notification is canonical too, and never also a control frame.
    if let Some(app) = super::frame::unescape_app_notif(data) {
        assert_eq!(super::frame::escape_app_notif(app).as_deref(), Some(data));
        assert!(ControlFrame::decode(data).is_err());
    }
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

/// Decodes `data` as an envelope; if that succeeds, asserts re-encoding gives `data`; and
/// the lenient decode agrees with it (see the body).
///
/// # Panics
/// When the codec is not canonical (a bug).
pub fn envelope_decode(data: &[u8]) {
    assert_canonical(data, ConnEnvelope::decode, ConnEnvelope::to_vec);
    // The lenient decode (what the shell uses) never panics either, agrees with the strict one
    // whenever that succeeds, and otherwise fails or keeps the inner blob without capabilities.
    match (ConnEnvelope::decode(data), ConnEnvelope::decode_lenient(data)) {
        (Ok(strict), lenient) => assert_eq!(lenient, Ok((strict, None))),
        (Err(_), Ok((env, why))) => assert!(env.caps.is_none() && why.is_some(), "{env:?}"),
        (Err(_), Err(_)) => {}
    }
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
    use super::frame::Body;
    use crate::types::Token;
    let mut seeds: Vec<Vec<u8>> = samples::sample_frames().iter().map(Frame::to_vec).collect();
    // The link frames, which carry no message: HELLO, PING, PONG (with its forget secret),
    // GOODBYE and FORGET.
    let link = [
        Body::Hello { load: 0x1d },
        Body::Ping { nonce: 5 },
        Body::Pong { nonce: 5, forget: Token(0xfeed) },
        Body::Goodbye,
        Body::Forget { proof: Token(0xfeed) },
    ];
    seeds.extend(link.into_iter().map(|body| ControlFrame { session: 7, body }.to_vec()));
    // An application notification that begins with the magic, escaped.
    seeds.extend(super::frame::escape_app_notif(b"\0BOUNC the application's"));
    seeds
}

/// Valid encoded capability blobs for the `caps_decode` seed corpus.
pub fn seed_caps() -> Vec<Vec<u8>> {
    let zmq = samples::sample_caps();
    let ucx = Capabilities {
        control: crate::types::ControlKind::Ucx,
        endpoint: b"tcp://10.0.0.1:5555".to_vec(),
        ..zmq.clone()
    };
    // An agent with a host arena and arenas on two GPUs.
    let gpu = |dev| ArenaCaps {
        mem: crate::types::MemKind::Vram,
        dev,
        base: 0x7000_0000 << dev,
        ..zmq.arenas.first().clone()
    };
    let host = ArenaCaps { mem: crate::types::MemKind::Dram, ..zmq.arenas.first().clone() };
    let three = Capabilities {
        arenas: super::caps::Arenas::new(vec![host, gpu(0), gpu(1)]).unwrap_or(zmq.arenas.clone()),
        ..ucx.clone()
    };
    vec![zmq.to_vec(), ucx.to_vec(), three.to_vec()]
}

/// Valid encoded envelopes (with and without capabilities) for the `envelope_decode` corpus.
pub fn seed_envelopes() -> Vec<Vec<u8>> {
    samples::sample_envelopes().iter().map(ConnEnvelope::to_vec).collect()
}

/// Valid public-data envelopes (with and without an inner blob, one with an IPC record, one with
/// a CMA record) for the `public_decode` corpus.
pub fn seed_public() -> Vec<Vec<u8>> {
    let key = crate::types::RegKey([0x42; 32]);
    let ipc = super::IpcRecord { node: [7; 16], handle: [0x33; 64], alloc_off: 512, addr: 0x7000_0000, len: 1 << 20 };
    let cma = super::CmaRecord {
        node: [7; 16],
        pidns: 4026531836,
        pid: 77,
        start: 9,
        addr: 0x7000_0000,
        len: 1 << 20,
        live: 0x5000_0010,
        tag: 3,
    };
    [
        (Vec::new(), None, None),
        (b"ucx-rkey-blob".to_vec(), None, None),
        (b"ucx-rkey-blob".to_vec(), Some(ipc), None),
        (b"ucx-rkey-blob".to_vec(), None, Some(cma)),
    ]
    .into_iter()
    .enumerate()
    .map(|(i, (inner, ipc, cma))| PublicData { reg: crate::types::RegId(i as u64 + 1), key, ipc, cma, inner }.to_vec())
    .collect()
}

/// Checks `data` as a region plan behind a chunk (the first byte picks the run count, the next
/// eight the chunk's data length; the rest are the plan's bytes); whatever [`check`] accepts
/// obeys every rule, and re-encoding the runs it returns gives the plan's bytes back (the form
/// has one valid encoding per plan).
///
/// [`check`]: super::region_plan::check
///
/// # Panics
/// When an accepted plan breaks a rule or does not re-encode to itself (a bug).
pub fn region_plan_check(data: &[u8]) {
    use super::region_plan::{check, encoded};
    let [runs, l0, l1, l2, l3, l4, l5, l6, l7, plan @ ..] = data else { return };
    let limit = u64::from_le_bytes([*l0, *l1, *l2, *l3, *l4, *l5, *l6, *l7]) >> 24;
    // Ranges the flow may write: [4096, 2^40) minus nothing else; anything outside refuses.
    let covers = |a: u64, b: u64| a >= 4096 && b <= 1 << 40;
    if let Ok(out) = check(plan, u32::from(*runs), limit, covers) {
        let total = out.iter().try_fold(0u64, |s, r| s.checked_add(r.bytes()?));
        assert!(total.is_some_and(|t| t <= limit), "accepted runs copy more than the chunk");
        for r in &out {
            assert!(r.region_span().is_some_and(|(_, end)| end <= limit), "accepted run reads past the data");
            assert!(r.addr_span().is_some_and(|(a, b)| covers(a, b)), "accepted run writes outside");
        }
        assert_eq!(encoded(&out).as_deref(), Some(plan), "an accepted plan is not canonical");
    }
}

/// Honest region plans for the `region_plan_check` seed corpus.
pub fn seed_region_plans() -> Vec<Vec<u8>> {
    use super::region_plan::encoded;
    use crate::types::CopyRun;
    let runs = [
        vec![CopyRun { region_off: 0, addr: 8192, len: 4096, count: 4, region_stride: 4096, addr_stride: 8192 }],
        vec![
            CopyRun { region_off: 0, addr: 1 << 20, len: 100, count: 1, region_stride: 0, addr_stride: 0 },
            CopyRun { region_off: 104, addr: 3 << 20, len: 5000, count: 2, region_stride: 5000, addr_stride: 6000 },
        ],
    ];
    runs.iter()
        .map(|r| {
            let mut seed = vec![r.len() as u8];
            seed.extend_from_slice(&((1u64 << 20) << 24).to_le_bytes());
            seed.extend(encoded(r).expect("honest runs encode"));
            seed
        })
        .collect()
}

/// Feeds `data` to a [`super::stream::Streams`] as a run of events on eight connections: a
/// byte picks the connection, whether this is a notice (open or end) or bytes, and whether the
/// clock first moves on by the eviction time; two more the length of the bytes that follow.
/// Asserts the bounds: held bytes within the budget, connections within the cap, a connection
/// never evicted to make room for itself, and every message delivered within the name and
/// frame limits.
///
/// # Panics
/// When a bound is broken (a bug).
pub fn stream_feed(data: &[u8]) {
    use super::stream::{IDLE_EVICT, Limits, Streams};
    let limits = Limits { name: 32, frame: 2048, buffered: 6000, conns: 4 };
    let mut s = Streams::new(limits);
    let (mut out, mut dropped) = (Vec::new(), 0u64);
    let mut now = std::time::Instant::now();
    let mut rest = data;
    while let [op, a, b, tail @ ..] = rest {
        let id = [op & 7];
        if op & 16 != 0 {
            now += IDLE_EVICT;
        }
        let len = usize::from(u16::from_le_bytes([*a, *b])).min(tail.len());
        let (bytes, next) = tail.split_at(len);
        if op & 8 != 0 || bytes.is_empty() {
            let _ = s.notice(now, &id);
        } else {
            let _ = s.feed(now, &id, bytes, &mut out, &mut dropped, |n| n.len() % 2 == 0);
        }
        assert!(s.buffered() <= limits.buffered, "{} bytes held", s.buffered());
        assert!(s.conns() <= limits.conns);
        assert!(s.take_evicted().iter().all(|e| e[..] != id[..]), "evicted to make room for itself");
        rest = next;
    }
    assert!(out.iter().all(|(n, f)| n.len() <= limits.name && f.len() <= limits.frame));
}

/// Seeds for `stream_feed`: whole messages, one cut in two, and a header over the bounds.
pub fn seed_stream() -> Vec<Vec<u8>> {
    let msg = super::stream::encode("peer", b"\0BOUNC frame").unwrap_or_default();
    let event = |op: u8, bytes: &[u8]| {
        let mut e = vec![op];
        e.extend_from_slice(&u16::try_from(bytes.len()).unwrap_or(0).to_le_bytes());
        e.extend_from_slice(bytes);
        e
    };
    let mut over = vec![0u8; super::stream::HEADER];
    over[2..6].copy_from_slice(&4096u32.to_le_bytes());
    vec![
        [event(8, &[]), event(0, &msg), event(0, &msg)].concat(),
        [event(1, &msg[..5]), event(2, &msg), event(1, &msg[5..])].concat(),
        [event(3, &over), event(11, &[]), event(3, &msg)].concat(),
    ]
}
