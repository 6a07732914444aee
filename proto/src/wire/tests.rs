//! Codec tests: round trips, golden bytes, canonical form, hostile input.

use super::envelope::FLAG_CAPS;
use super::frame::*;
use super::samples::{assert_canonical, sample_caps, sample_envelopes, sample_frames};
use super::*;
use crate::types::{ArenaId, ChunkIdx, ControlKind, CopyRun, MemKind, RegId, Region, Token, XferId};
use proptest::prelude::*;

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    let s: String = s.split_whitespace().collect();
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
}

/// A legal region: not empty, its end at most 2^64.
fn arb_region() -> impl Strategy<Value = Region> {
    (0..u64::MAX)
        .prop_flat_map(|offset| (Just(offset), 1..=u64::MAX - offset))
        .prop_map(|(offset, len)| Region { offset, len })
}

fn arb_run() -> impl Strategy<Value = CopyRun> {
    (any::<u64>(), any::<u64>(), 1..=u64::MAX, 1..=u32::MAX, any::<u64>(), any::<u64>()).prop_map(
        |(region_off, addr, len, count, region_stride, addr_stride)| CopyRun {
            region_off,
            addr,
            len,
            count,
            region_stride,
            addr_stride,
        },
    )
}

/// An inline chunk of `bytes` bytes (0, 1, 2, ...) scattered by `runs` one-byte runs.
fn inline(bytes: usize, runs: usize) -> Option<Inline> {
    let run = |i: u64| CopyRun { region_off: i, addr: 0x1000 + i, len: 1, count: 1, region_stride: 0, addr_stride: 0 };
    Some(Inline { runs: (0..runs as u64).map(run).collect(), bytes: (0..bytes).map(|b| b as u8).collect() })
}

fn arb_blob() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(any::<u8>(), 0..24)
}

fn arb_status() -> impl Strategy<Value = AckStatus> {
    prop_oneof![Just(AckStatus::Scattered), Just(AckStatus::Refused), Just(AckStatus::Failed), Just(AckStatus::Replan)]
}

fn arb_msg() -> impl Strategy<Value = Msg> {
    let xfer = any::<u64>().prop_map(XferId);
    let token = any::<u128>().prop_map(Token);
    let chunk = any::<u32>().prop_map(ChunkIdx);
    let credit = (chunk.clone(), arb_region()).prop_map(|(chunk, region)| Credit { chunk, region });
    let proofs = prop::collection::vec((any::<u64>(), any::<[u8; 16]>()), 0..3)
        .prop_map(|p| p.into_iter().map(|(reg, tag)| Proof { reg: RegId(reg), tag }).collect::<Vec<_>>());
    prop_oneof![
        (
            xfer.clone(),
            (token.clone(), 0..MAX_ARENAS as u8),
            arb_blob(),
            prop::collection::vec(1..=u64::MAX, 0..8),
            proofs
        )
            .prop_map(|(xfer, (token, arena), endpoint, chunks, proofs)| Msg::Want(Want {
                arena: ArenaId(arena),
                xfer,
                token,
                endpoint,
                chunks,
                proofs,
                inline: None,
                standing: Default::default(),
            })),
        (
            xfer.clone(),
            token.clone(),
            prop::collection::vec(any::<u8>(), 1..64),
            prop::collection::vec(arb_run(), 1..4)
        )
            .prop_map(|(xfer, token, bytes, runs)| {
                let chunks = vec![bytes.len() as u64];
                Msg::Want(Want {
                    arena: ArenaId(0),
                    xfer,
                    token,
                    endpoint: vec![],
                    chunks,
                    proofs: vec![],
                    inline: Some(Inline { runs, bytes }),
                    standing: Default::default(),
                })
            }),
        (xfer.clone(), token.clone(), prop::collection::vec(credit, 1..6))
            .prop_map(|(xfer, token, credits)| Msg::Grant(Grant { xfer, token, credits })),
        (xfer.clone(), token.clone(), chunk.clone(), arb_region(), prop::collection::vec(arb_run(), 0..5), 0u32..3)
            .prop_map(|(xfer, token, chunk, region, runs, region_plan_runs)| {
                // A region plan only where the DATA names no runs: the one valid combination.
                let region_plan_runs = if runs.is_empty() { region_plan_runs } else { 0 };
                Msg::Data(Data { xfer, token, chunk, region, runs, region_plan_runs })
            }),
        (xfer.clone(), token.clone(), chunk.clone(), prop::collection::vec(arb_run(), 1..5))
            .prop_map(|(xfer, token, chunk, runs)| Msg::Plan(Plan { xfer, token, chunk, runs })),
        (xfer, token, chunk, arb_region(), arb_status())
            .prop_map(|(xfer, token, chunk, region, status)| Msg::Ack(Ack { xfer, token, chunk, region, status })),
    ]
}

fn arb_frame() -> impl Strategy<Value = Frame> {
    (any::<u64>(), arb_msg()).prop_map(|(session, msg)| Frame { session, msg })
}

fn arb_caps() -> impl Strategy<Value = Capabilities> {
    let control = prop_oneof![Just(ControlKind::Ucx), Just(ControlKind::Zmq)];
    let mem = prop_oneof![Just(MemKind::Dram), Just(MemKind::Vram)];
    // A mailbox comes with its registration; without one those fields are zero and empty.
    let mailbox = prop::option::of((any::<u64>(), 1..=u32::MAX, any::<u32>(), any::<(u64, u64)>(), arb_blob()))
        .prop_map(|m| match m {
            Some((offset, slots, ring, (base, len), key)) => {
                (Some(MailboxCaps { offset, slots, ring }), base, len, key)
            }
            None => (None, 0, 0, Vec::new()),
        });
    let arena = (mem, prop::array::uniform5(any::<u64>()), arb_blob()).prop_map(|(mem, v, key)| ArenaCaps {
        mem,
        dev: v[0],
        base: v[1],
        len: v[2],
        usable_capacity: v[3],
        max_chunk: v[4],
        key,
    });
    let arenas = prop::collection::vec(arena, 1..=MAX_ARENAS).prop_map(|v| Arenas::new(v).expect("1 to 16 arenas"));
    (control, any::<u64>(), arenas, arb_blob(), mailbox, 1..=u64::MAX).prop_map(
        |(
            control,
            session,
            arenas,
            endpoint,
            (mailbox, mailbox_base, mailbox_len, mailbox_key),
            request_timeout_ms,
        )| {
            Capabilities {
                wire_version: WIRE_VERSION.into(),
                control,
                session,
                arenas,
                endpoint,
                mailbox,
                mailbox_base,
                mailbox_len,
                mailbox_key,
                request_timeout_ms,
            }
        },
    )
}

fn arb_envelope() -> impl Strategy<Value = ConnEnvelope> {
    (prop::option::of(arb_caps()), arb_blob()).prop_map(|(caps, inner)| ConnEnvelope { caps, inner })
}

/// A valid encoding with a few bytes overwritten, truncated or extended: input close enough
/// to valid that decoding sometimes still succeeds, which is where non-canonical bugs hide.
fn mutated(valid: impl Strategy<Value = Vec<u8>>) -> impl Strategy<Value = Vec<u8>> {
    (valid, prop::collection::vec((any::<prop::sample::Index>(), prop_oneof![0..4u8, any::<u8>()]), 0..4), 0..3u8)
        .prop_map(|(mut bytes, edits, tail)| {
            for (at, b) in edits {
                let i = at.index(bytes.len());
                bytes[i] = b;
            }
            match tail {
                0 => {}
                1 => bytes.push(0),
                _ => {
                    bytes.pop();
                }
            }
            bytes
        })
}

fn body_of(frame: &Frame) -> Vec<u8> {
    frame.to_vec()[HEADER_LEN..].to_vec()
}

fn frame_bytes(kind: u8, body: &[u8]) -> Vec<u8> {
    let mut b = MAGIC.to_vec();
    b.extend_from_slice(&[WIRE_VERSION, kind]);
    b.extend_from_slice(&7u64.to_le_bytes());
    b.extend_from_slice(body);
    b
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn every_valid_frame_round_trips(frame in arb_frame()) {
        prop_assert_eq!(frame.msg.validate(), Ok(()));
        let bytes = frame.to_vec();
        prop_assert!(is_control_frame(&bytes));
        prop_assert_eq!(Frame::decode(&bytes), Ok(frame));
    }

    #[test]
    fn an_escaped_application_notification_comes_back_as_it_was(
        tail in proptest::collection::vec(any::<u8>(), 0..256),
        magic in any::<bool>(),
    ) {
        let msg: Vec<u8> = if magic { MAGIC.iter().copied().chain(tail).collect() } else { tail };
        match escape_app_notif(&msg) {
            None => prop_assert!(!is_control_frame(&msg), "a notification with the magic must be escaped"),
            Some(escaped) => {
                prop_assert!(is_control_frame(&msg));
                prop_assert_eq!(unescape_app_notif(&escaped), Some(&msg[..]));
            }
        }
    }

    #[test]
    fn capabilities_round_trip(caps in arb_caps()) {
        prop_assert_eq!(Capabilities::decode(&caps.to_vec()), Ok(caps));
    }

    #[test]
    fn envelopes_round_trip(env in arb_envelope()) {
        prop_assert_eq!(ConnEnvelope::decode(&env.to_vec()), Ok(env));
    }

    #[test]
    fn every_strict_prefix_of_a_frame_is_an_error(frame in arb_frame()) {
        let bytes = frame.to_vec();
        for n in 0..bytes.len() {
            prop_assert!(Frame::decode(&bytes[..n]).is_err(), "prefix {} accepted", n);
        }
    }

    #[test]
    fn every_strict_prefix_of_an_envelope_is_an_error(env in arb_envelope()) {
        let bytes = env.to_vec();
        for n in 0..bytes.len() {
            prop_assert!(ConnEnvelope::decode(&bytes[..n]).is_err(), "prefix {} accepted", n);
        }
        let caps = env.caps.map(|c| c.to_vec()).unwrap_or_default();
        for n in 0..caps.len() {
            prop_assert!(Capabilities::decode(&caps[..n]).is_err(), "caps prefix {} accepted", n);
        }
    }

    #[test]
    fn decoded_frames_reencode_to_the_same_bytes(
        bytes in prop_oneof![
            mutated(arb_frame().prop_map(|f| f.to_vec())),
            prop::collection::vec(any::<u8>(), 0..64),
            (1..=8u8, prop::collection::vec(any::<u8>(), 0..64))
                .prop_map(|(kind, body)| frame_bytes(kind, &body)),
            // Exactly an ACK's length with a near-valid status tag: these often decode.
            (prop::collection::vec(any::<u8>(), 28), 0..8u8).prop_map(|(mut b, tag)| {
                b.push(tag);
                frame_bytes(KIND_ACK, &b)
            }),
        ]
    ) {
        assert_canonical(&bytes, Frame::decode, Frame::to_vec);
        assert_canonical(&bytes, ControlFrame::decode, ControlFrame::to_vec);
        // `Frame` accepts exactly the `ControlFrame`s that carry a message.
        let any = ControlFrame::decode(&bytes);
        match Frame::decode(&bytes) {
            Ok(f) => prop_assert_eq!(any, Ok(ControlFrame::from(f))),
            Err(_) => prop_assert!(!matches!(any, Ok(ControlFrame { body: Body::Msg(_), .. })), "{:?}", any),
        }
    }

    #[test]
    fn decoded_envelopes_and_caps_reencode_to_the_same_bytes(
        env in mutated(arb_envelope().prop_map(|e| e.to_vec())),
        caps in mutated(arb_caps().prop_map(|c| c.to_vec())),
    ) {
        assert_canonical(&env, ConnEnvelope::decode, ConnEnvelope::to_vec);
        assert_canonical(&caps, Capabilities::decode, Capabilities::to_vec);
    }
}

#[test]
fn hello_round_trips_and_is_a_control_frame_but_no_msg() {
    let h = encode_hello(0x0102_0304_0506_0708, 0x1112_1314_1516_1718);
    assert_eq!(hex(&h), "00424f554e431105 0807060504030201 1817161514131211".replace(' ', ""));
    assert!(is_control_frame(&h));
    assert_eq!(decode_hello(&h), Some(0x0102_0304_0506_0708));
    assert_eq!(Frame::decode(&h), Err(WireError::UnknownKind { got: KIND_HELLO }));
    assert_eq!(decode_hello(&h[..23]), None);
    let mut longer = h.clone();
    longer.push(0);
    assert_eq!(decode_hello(&longer), None);
    let mut other_version = h.clone();
    other_version[6] = 2;
    assert_eq!(decode_hello(&other_version), None);
    let want = Frame { session: 1, msg: Msg::cancel(XferId(1), Token(1), vec![]) }.to_vec();
    assert_eq!(decode_hello(&want), None);
}

/// HELLO goes through the same header and body code as the messages: `ControlFrame` encodes
/// every sample message to the bytes `Frame` gives, decodes them back, and knows HELLO.
#[test]
fn control_frames_share_the_frame_codec_and_carry_hello() {
    for f in sample_frames() {
        let bytes = f.to_vec();
        let any = ControlFrame::from(f.clone());
        assert_eq!(any.to_vec(), bytes);
        assert_eq!(ControlFrame::decode(&bytes), Ok(any));
    }
    let hello = ControlFrame { session: 0x0102_0304_0506_0708, body: Body::Hello { load: 9 } };
    assert_eq!(hello.to_vec(), encode_hello(0x0102_0304_0506_0708, 9));
    assert_eq!(ControlFrame::decode(&hello.to_vec()), Ok(hello.clone()));
    let mut longer = hello.to_vec();
    longer.push(0);
    assert_eq!(ControlFrame::decode(&longer), Err(WireError::TrailingBytes { n: 1 }));
    let mut unknown = hello.to_vec();
    unknown[7] = 15; // 6 is GOODBYE (7 to 14 are taken too)
    assert_eq!(ControlFrame::decode(&unknown), Err(WireError::UnknownKind { got: 15 }));
    let mut future = hello.to_vec();
    future[6] = WIRE_VERSION + 1;
    assert!(matches!(ControlFrame::decode(&future), Err(WireError::UnsupportedVersion { .. })));
}

#[test]
fn frame_layout_is_pinned() {
    let frames = sample_frames();
    let [want, cancel, _, data, ack, _, _] = &frames[..] else { panic!("seven samples") };
    assert_eq!(
        hex(&want.to_vec()),
        hex(&unhex(
            "00424f554e43 11 01 0100000000000000
             2a00000000000000 1032547698badcfeefcdab8967452301 01 02000000 6570
             02000000 0010000000000000 2000000000000000
             01000000 0500000000000000 aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa
             00000000
             02 0100000000000080 1032547698badcfeefcdab8967452301"
        ))
    );
    assert_eq!(
        hex(&cancel.to_vec()[HEADER_LEN..]),
        format!(
            "2a00000000000000 1032547698badcfeefcdab8967452301 00 13000000 {} 00000000 00000000 00000000 00",
            hex(b"tcp://10.0.0.1:5555")
        )
        .replace(' ', "")
    );
    assert_eq!(
        hex(&data.to_vec()),
        hex(&unhex(
            "00424f554e43 11 03 0400000000000000
             0300000000000000 1032547698badcfeefcdab8967452301 02000000 0001000000000000 4000000000000000
             01000000
             03 8040 20 02 20 8001
             00000000"
        ))
    );
    assert_eq!(
        hex(&ack.to_vec()),
        hex(&unhex(
            "00424f554e43 11 04 0500000000000000
             0300000000000000 1032547698badcfeefcdab8967452301 02000000 0001000000000000 4000000000000000 01"
        ))
    );
}

/// The benchmark's DATA: 512 scattered 4 KiB pieces of a 2 MiB chunk. Fixed 44-byte runs
/// made it 22.5 KB; delta-coded it fits one small UCX message.
#[test]
fn scattered_runs_are_delta_coded_compactly() {
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let runs: Vec<CopyRun> = (0..512u64)
        .map(|i| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let slot = state % 32768; // anywhere in a 128 MiB buffer
            CopyRun {
                region_off: i * 4096,
                addr: 0x7f00_0000_0000 + slot * 4096,
                len: 4096,
                count: 1,
                region_stride: 0,
                addr_stride: 0,
            }
        })
        .collect();
    let data = Data {
        xfer: XferId(7),
        token: Token(7),
        chunk: ChunkIdx(3),
        region: Region { offset: 0, len: 2 << 20 },
        runs,
        region_plan_runs: 0,
    };
    let bytes = Frame { session: 1, msg: Msg::Data(data.clone()) }.to_vec();
    assert!(bytes.len() <= 3 * 1024, "{} bytes", bytes.len());
    assert_eq!(Frame::decode(&bytes).map(|f| f.msg), Ok(Msg::Data(data)));
}

/// Each run has exactly one encoding: a flag whose field equals the implied value, an
/// overlong varint and an unknown flag bit are all refused.
#[test]
fn only_the_canonical_run_encoding_decodes() {
    let good = sample_frames()[3].to_vec();
    // The sample's one run: flags 03 (strided, new length), address delta 8040, len 20,
    // count 02, strides 20 and 8001.
    // The DATA ends with the run, then its region plan's run count (none).
    let (head, run) = good[..good.len() - 4].split_at(good.len() - 12);
    assert_eq!(hex(run), "0380402002208001");
    let with = |r: &str| [head, &unhex(r)[..], &[0; 4]].concat();
    assert!(Frame::decode(&with("0380402002208001")).is_ok());
    let not_canonical = Err(WireError::Invalid { what: "scatter run not in its canonical form" });
    assert_eq!(Frame::decode(&with("07008040 2002208001")), not_canonical, "region jump to where it ends anyway");
    assert_eq!(Frame::decode(&with("0380402001 00 00")), not_canonical, "strided flag on a single copy");
    assert_eq!(
        Frame::decode(&with("038040a000 02208001")),
        Err(WireError::Invalid { what: "varint not in its shortest form" })
    );
    assert_eq!(Frame::decode(&with("0b80402002208001")), Err(WireError::Invalid { what: "scatter run flags" }));
    assert_eq!(
        Frame::decode(&with("03 ffffffffffffffffff7f 2002208001")),
        Err(WireError::Invalid { what: "varint over 64 bits" })
    );
}

#[test]
fn capabilities_and_envelope_layouts_are_pinned() {
    // Version, control kind, session, one arena (memory kind, device, base, length, usable,
    // max chunk, key), endpoint, mailbox (offset, slots, ring, base, length, key), request
    // timeout in ms.
    let caps = "1100 01 0900000000000000 01
                01 0000000000000000 0010000000000000 0020000000000000 0020000000000000 0004000000000000 01000000 6b
                00000000 0000000000000000 00010000 12000000 00000000007f0000 0080040000000000 01000000 6d
                dc05000000000000";
    assert_eq!(hex(&sample_caps().to_vec()), hex(&unhex(caps)));
    let envelopes = sample_envelopes();
    let [bare, full] = &envelopes[..] else { panic!("two samples") };
    assert_eq!(hex(&bare.to_vec()), hex(&unhex("4e58424f554e4345 0100 00 01000000 ab")));
    let caps_len = unhex(caps).len() as u32;
    let expect = format!(
        "4e58424f554e4345 0100 01 {} {} 12000000 {}",
        hex(&caps_len.to_le_bytes()),
        caps,
        hex(b"ucx-worker-address")
    );
    assert_eq!(hex(&full.to_vec()), hex(&unhex(&expect)));
}

#[test]
fn samples_decode_and_every_truncation_fails() {
    for f in sample_frames() {
        let bytes = f.to_vec();
        assert_eq!(Frame::decode(&bytes).as_ref(), Ok(&f));
        for n in 0..bytes.len() {
            assert!(Frame::decode(&bytes[..n]).is_err(), "{} prefix {n}", f.msg.kind_name());
        }
    }
    assert!(matches!(Frame::decode(&[]), Err(WireError::Truncated { need: 6, have: 0 })));
}

#[test]
fn an_application_notification_beginning_with_the_magic_travels_escaped() {
    assert_eq!(escape_app_notif(b"hello from the application"), None, "goes as it is");
    assert_eq!(escape_app_notif(b"\0BOUN"), None, "not the whole magic");
    let msg = b"\0BOUNC and the application's own bytes".to_vec();
    let escaped = escape_app_notif(&msg).expect("begins with the magic");
    // The pinned layout: the header of kind APP with session 0, then the bytes as they were.
    assert_eq!(hex(&escaped[..HEADER_LEN]), format!("00424f554e43{WIRE_VERSION:02x}0f0000000000000000"));
    assert_eq!(&escaped[HEADER_LEN..], &msg[..]);
    assert!(is_control_frame(&escaped), "a BOUNCE receiver sorts it out of the application's way");
    assert_eq!(unescape_app_notif(&escaped), Some(&msg[..]));
    assert!(ControlFrame::decode(&escaped).is_err(), "never handled as a control frame");
    // Only what the escape makes: another session, version or payload is not one.
    let mut other_session = escaped.clone();
    other_session[8] = 1;
    let mut other_version = escaped.clone();
    other_version[6] = WIRE_VERSION.wrapping_add(1);
    for bad in [other_session, other_version, frame_bytes(15, b"not the magic")[..].to_vec()] {
        assert_eq!(unescape_app_notif(&bad), None, "{}", hex(&bad));
    }
    for frame in sample_frames() {
        assert_eq!(unescape_app_notif(&frame.to_vec()), None, "{}", frame.msg.kind_name());
    }
    assert_eq!(unescape_app_notif(&encode_hello(3, 4)), None);
}

#[test]
fn foreign_bytes_are_not_control_frames() {
    assert!(!is_control_frame(b"hello from the application"));
    assert!(!is_control_frame(b"\0BOUN"));
    assert_eq!(Frame::decode(b"NXBOUNCE________"), Err(WireError::BadMagic { what: "frame" }));
    let mut bytes = sample_frames()[0].to_vec();
    bytes[0] = b'X';
    assert!(!is_control_frame(&bytes));
    assert_eq!(Frame::decode(&bytes), Err(WireError::BadMagic { what: "frame" }));
}

#[test]
fn other_versions_and_kinds_are_refused() {
    let mut bytes = sample_frames()[0].to_vec();
    bytes[6] = 2;
    assert_eq!(Frame::decode(&bytes), Err(WireError::UnsupportedVersion { what: "frame", got: 2 }));
    for kind in [0, 5, 0xff] {
        let mut bytes = sample_frames()[0].to_vec();
        bytes[7] = kind;
        assert_eq!(Frame::decode(&bytes), Err(WireError::UnknownKind { got: kind }));
    }
}

#[test]
fn a_body_under_another_kind_byte_is_refused() {
    let frames = sample_frames();
    for f in &frames {
        for kind in [KIND_WANT, KIND_GRANT, KIND_DATA, KIND_ACK] {
            if kind == f.msg.kind_byte() {
                continue;
            }
            let r = Frame::decode(&frame_bytes(kind, &body_of(f)));
            assert!(r.is_err(), "{} body as kind {kind} gave {r:?}", f.msg.kind_name());
        }
    }
}

/// An arena id is one byte, but no agent advertises more than `MAX_ARENAS`: an id past them is
/// malformed in any WANT or PULL (whether the receiver has a smaller one is its own check).
#[test]
fn wants_and_pulls_name_an_arena_below_the_most_an_agent_may_have() {
    let frames = sample_frames();
    let want = frames[0].to_vec();
    let at = HEADER_LEN + 8 + 16; // the header, the transfer id, the token
    assert_eq!(want[at], 1, "the sample WANT names arena 1");
    for (arena, ok) in [(0u8, true), (15, true), (16, false), (255, false)] {
        let mut bytes = want.clone();
        bytes[at] = arena;
        let got = Frame::decode(&bytes);
        if ok {
            assert!(matches!(&got, Ok(Frame { msg: Msg::Want(w), .. }) if w.arena == ArenaId(arena)), "{got:?}");
        } else {
            assert_eq!(got, Err(WireError::Invalid { what: "arena id" }), "arena {arena}");
        }
    }
    let pull = Msg::Pull(Pull {
        arena: ArenaId(16),
        xfer: XferId(3),
        token: Token(1),
        first: ChunkIdx(0),
        total: 1,
        endpoint: Vec::new(),
        chunks: vec![PullChunk { bytes: 64, runs: vec![].into() }],
        proofs: vec![],
    });
    assert_eq!(pull.validate(), Err(WireError::Invalid { what: "arena id" }));
    assert_eq!(Frame::decode(&Frame { session: 1, msg: pull }.to_vec()), Err(WireError::Invalid { what: "arena id" }));
}

#[test]
fn absurd_counts_are_refused_before_allocating() {
    let mut body = 1u64.to_le_bytes().to_vec(); // xfer
    body.extend_from_slice(&[7; 16]); // token
    body.push(0); // arena
    body.extend_from_slice(&0u32.to_le_bytes()); // empty endpoint
    body.extend_from_slice(&u32::MAX.to_le_bytes()); // chunk count
    body.extend_from_slice(&[1; 8]);
    assert_eq!(
        Frame::decode(&frame_bytes(KIND_WANT, &body)),
        Err(WireError::CountTooLarge { what: "want chunks", count: u32::MAX.into(), max: MAX_CHUNKS_PER_WANT.into() })
    );
    // Under the cap but beyond the input: refused from the count alone.
    body[29..33].copy_from_slice(&MAX_CHUNKS_PER_WANT.to_le_bytes());
    assert_eq!(Frame::decode(&frame_bytes(KIND_WANT, &body)), Err(WireError::Truncated { need: 8 << 20, have: 8 }));
    let mut endpoint = 1u64.to_le_bytes().to_vec();
    endpoint.extend_from_slice(&[7; 16]);
    endpoint.push(0);
    endpoint.extend_from_slice(&u32::MAX.to_le_bytes());
    assert!(matches!(
        Frame::decode(&frame_bytes(KIND_WANT, &endpoint)),
        Err(WireError::CountTooLarge { what: "endpoint", .. })
    ));
    let mut grant = 1u64.to_le_bytes().to_vec();
    grant.extend_from_slice(&[7; 16]);
    grant.extend_from_slice(&MAX_CREDITS.to_le_bytes());
    assert_eq!(
        Frame::decode(&frame_bytes(KIND_GRANT, &grant)),
        Err(WireError::Truncated { need: CREDIT_LEN << 16, have: 0 })
    );
    let mut data = body_of(&sample_frames()[3]);
    data[44..48].copy_from_slice(&u32::MAX.to_le_bytes());
    assert!(matches!(
        Frame::decode(&frame_bytes(KIND_DATA, &data)),
        Err(WireError::CountTooLarge { what: "data runs", .. })
    ));
    let mut env = sample_envelopes()[0].to_vec();
    env[11..15].copy_from_slice(&u32::MAX.to_le_bytes());
    assert!(matches!(ConnEnvelope::decode(&env), Err(WireError::CountTooLarge { what: "inner conn info", .. })));
}

#[test]
fn trailing_bytes_are_refused() {
    let mut bytes = sample_frames()[2].to_vec();
    bytes.push(0);
    assert_eq!(Frame::decode(&bytes), Err(WireError::TrailingBytes { n: 1 }));
    let mut caps = sample_caps().to_vec();
    caps.extend_from_slice(&[0, 0]);
    assert_eq!(Capabilities::decode(&caps), Err(WireError::TrailingBytes { n: 2 }));
    let mut env = sample_envelopes()[1].to_vec();
    env.push(0);
    assert_eq!(ConnEnvelope::decode(&env), Err(WireError::TrailingBytes { n: 1 }));
}

#[test]
fn invalid_values_are_refused() {
    let xfer = XferId(1);
    let chunk = ChunkIdx(0);
    let region = Region { offset: 0, len: 64 };
    let run = CopyRun { region_off: 0, addr: 0, len: 8, count: 1, region_stride: 0, addr_stride: 0 };
    let token = Token(1);
    let want = |chunks: Vec<u64>, proofs: Vec<Proof>, inline: Option<Inline>, standing: Standing| {
        Msg::Want(Want { arena: ArenaId(0), xfer, token, endpoint: vec![], chunks, proofs, inline, standing })
    };
    let proof = Proof { reg: RegId(1), tag: [0; 16] };
    let claim = Standing::Claim { xfer: XferId(1 << 63), token };
    let past = Region { offset: u64::MAX - 7, len: 16 };
    let bad = [
        want(vec![8, 0], vec![], None, Standing::None),
        // Inline bytes that are not exactly the WANT's one chunk, or scatter by no run.
        want(vec![8], vec![], inline(7, 1), Standing::None),
        want(vec![8, 8], vec![], inline(8, 1), Standing::None),
        want(vec![8], vec![], inline(8, 0), Standing::None),
        want(vec![], vec![], inline(8, 1), Standing::None),
        // A standing flow is one bare chunk; a claim names a chunk 0 and carries no bytes.
        want(vec![8, 8], vec![], None, Standing::Open),
        want(vec![8], vec![proof], None, Standing::Open),
        want(vec![8], vec![], inline(8, 1), Standing::Open),
        want(vec![], vec![], None, claim),
        want(vec![8], vec![], inline(8, 1), claim),
        Msg::Grant(Grant { xfer, token, credits: vec![] }),
        Msg::Grant(Grant { xfer, token, credits: vec![Credit { chunk, region: Region { offset: 0, len: 0 } }] }),
        Msg::Plan(Plan { xfer, token, chunk, runs: vec![] }),
        Msg::Plan(Plan { xfer, token, chunk, runs: vec![CopyRun { count: 0, ..run }] }),
        Msg::Data(Data {
            xfer,
            token,
            chunk,
            region: Region { offset: 0, len: 0 },
            runs: vec![run],
            region_plan_runs: 0,
        }),
        Msg::Data(Data { xfer, token, chunk, region, runs: vec![run], region_plan_runs: 1 }),
        Msg::Data(Data { xfer, token, chunk, region, runs: Vec::new(), region_plan_runs: MAX_RUNS + 1 }),
        Msg::Data(Data { xfer, token, chunk, region, runs: vec![CopyRun { count: 0, ..run }], region_plan_runs: 0 }),
        Msg::Data(Data { xfer, token, chunk, region, runs: vec![CopyRun { len: 0, ..run }], region_plan_runs: 0 }),
        Msg::Ack(Ack { xfer, token, chunk, region: Region { offset: 0, len: 0 }, status: AckStatus::Failed }),
        // Regions whose end lies past 2^64 (review 58: a refused DATA's region reached the
        // mailbox writer's check).
        Msg::Data(Data { xfer, token, chunk, region: past, runs: vec![run], region_plan_runs: 0 }),
        Msg::Ack(Ack { xfer, token, chunk, region: past, status: AckStatus::Refused }),
        Msg::Grant(Grant { xfer, token, credits: vec![Credit { chunk, region: past }] }),
        Msg::Release(Release { xfer, token, chunk, region: past }),
    ];
    for msg in bad {
        let frame = Frame { session: 1, msg };
        assert!(matches!(frame.msg.validate(), Err(WireError::Invalid { .. })), "{frame:?}");
        assert_eq!(Frame::decode(&frame.to_vec()), Err(frame.msg.validate().unwrap_err()));
    }
    let mut ack = sample_frames()[4].to_vec();
    *ack.last_mut().unwrap() = 5;
    assert_eq!(Frame::decode(&ack), Err(WireError::Invalid { what: "ack status tag" }));
    let mut caps = sample_caps().to_vec();
    caps[2] = 2;
    assert_eq!(Capabilities::decode(&caps), Err(WireError::Invalid { what: "control kind tag" }));
    caps[2] = 0;
    caps[12] = 7; // the first arena's memory kind
    assert_eq!(Capabilities::decode(&caps), Err(WireError::Invalid { what: "memory kind tag" }));
    // "No mailbox" has one encoding: its registration's fields zero and empty too.
    let none =
        Capabilities { mailbox: None, mailbox_base: 0, mailbox_len: 0, mailbox_key: Vec::new(), ..sample_caps() };
    assert_eq!(Capabilities::decode(&none.to_vec()), Ok(none.clone()));
    for stray in [
        Capabilities { mailbox_base: 1, ..none.clone() },
        Capabilities { mailbox_len: 1, ..none.clone() },
        Capabilities { mailbox_key: b"m".to_vec(), ..none.clone() },
    ] {
        let want = Err(WireError::Invalid { what: "mailbox registration without a mailbox" });
        assert_eq!(Capabilities::decode(&stray.to_vec()), want, "{stray:?}");
    }
}

#[test]
fn cancel_is_an_empty_want_that_keeps_its_endpoint() {
    let m = Msg::cancel(XferId(9), Token(9), b"ep".to_vec());
    assert_eq!(m.xfer(), XferId(9));
    assert_eq!(m.kind_name(), "CANCEL");
    let Msg::Want(w) = &m else { panic!("cancel is a WANT") };
    assert!(w.is_cancel());
    assert_eq!(w.endpoint, b"ep");
    let back = Frame::decode(&Frame { session: 3, msg: m.clone() }.to_vec()).unwrap();
    assert_eq!(back.msg, m);
    let names: Vec<_> = sample_frames().iter().map(|f| f.msg.kind_name()).collect();
    assert_eq!(names, ["WANT", "CANCEL", "GRANT", "DATA", "ACK", "WANT", "WANT"]);
}

#[test]
fn envelope_header_errors_are_specific() {
    let good = sample_envelopes()[1].to_vec();
    let mut b = good.clone();
    b[0] = b'x';
    assert_eq!(ConnEnvelope::decode(&b), Err(WireError::BadMagic { what: "envelope" }));
    let mut b = good.clone();
    b[8] = 2;
    assert_eq!(ConnEnvelope::decode(&b), Err(WireError::UnsupportedVersion { what: "envelope", got: 2 }));
    let mut b = good.clone();
    b[10] |= 0x02;
    assert_eq!(ConnEnvelope::decode(&b), Err(WireError::UnknownFlags { got: 0x03 }));
    let mut b = good.clone();
    b[15] = 2; // capabilities' wire version
    assert_eq!(ConnEnvelope::decode(&b), Err(WireError::UnsupportedVersion { what: "capabilities", got: 2 }));
    // Leniently, an agent of another wire version (or whose capabilities are garbage) keeps
    // its inner conn info and loses only the capabilities: it stays on plain UCX.
    let (env, why) = ConnEnvelope::decode_lenient(&b).unwrap();
    assert_eq!(env, ConnEnvelope { caps: None, inner: sample_envelopes()[1].inner.clone() });
    assert_eq!(why, Some(WireError::UnsupportedVersion { what: "capabilities", got: 2 }));
    assert_eq!(ConnEnvelope::decode_lenient(&good), Ok((sample_envelopes()[1].clone(), None)));
    // The envelope's own errors stay errors: a newer layout's flags say where nothing lies.
    let mut flags = good;
    flags[10] |= 0x02;
    assert_eq!(ConnEnvelope::decode_lenient(&flags), Err(WireError::UnknownFlags { got: 0x03 }));
    // Capabilities with bytes of their own left over inside the declared length.
    let mut caps = sample_caps().to_vec();
    caps.push(0);
    let mut b = ENVELOPE_MAGIC.to_vec();
    b.extend_from_slice(&ENVELOPE_VERSION.to_le_bytes());
    b.push(FLAG_CAPS);
    b.extend_from_slice(&(caps.len() as u32).to_le_bytes());
    b.extend_from_slice(&caps);
    b.extend_from_slice(&0u32.to_le_bytes());
    assert_eq!(ConnEnvelope::decode(&b), Err(WireError::TrailingBytes { n: 1 }));
}

/// `caps` with its one arena's max chunk set to `max_chunk`.
fn with_chunk(caps: &Capabilities, max_chunk: u64) -> Capabilities {
    let mut c = caps.clone();
    c.arenas.first_mut().max_chunk = max_chunk;
    c
}

#[test]
fn compatibility_needs_same_version_and_control_kind_and_chunks_take_the_smaller_max() {
    let local = sample_caps();
    let same_rules = Capabilities {
        session: 77,
        arenas: Arenas::one(ArenaCaps {
            mem: MemKind::Dram,
            base: 0xdead_0000,
            len: 1 << 30,
            dev: 3,
            usable_capacity: 1 << 29,
            key: vec![1, 2, 3],
            ..local.arenas.first().clone()
        }),
        endpoint: b"tcp://10.0.0.2:1".to_vec(),
        ..local.clone()
    };
    assert_eq!(local.compatible_with(&local), Ok(()));
    assert_eq!(local.compatible_with(&same_rules), Ok(()));
    assert_eq!(same_rules.compatible_with(&local), Ok(()));

    let other_version = Capabilities { wire_version: u16::from(WIRE_VERSION) + 1, ..local.clone() };
    let other_control = Capabilities { control: ControlKind::Ucx, ..local.clone() };
    let other_chunk = with_chunk(&local, 0x800);
    assert_eq!(
        local.compatible_with(&other_version),
        Err(Incompatible::WireVersion { local: WIRE_VERSION.into(), peer: u16::from(WIRE_VERSION) + 1 })
    );
    assert_eq!(
        local.compatible_with(&other_control),
        Err(Incompatible::ControlKind { local: ControlKind::Zmq, peer: ControlKind::Ucx })
    );
    // A host arena's 2 MiB chunks meet a GPU arena's 32 MiB ones: both plan with the smaller.
    assert_eq!(local.compatible_with(&other_chunk), Ok(()));
    assert_eq!((local.chunk_with(&other_chunk), other_chunk.chunk_with(&local)), (0x400, 0x400));
    // A peer cannot make us plan absurdly many chunks, nor chunks of odd sizes.
    let big = with_chunk(&local, 32 << 20);
    let smallest = (32 << 20) / MAX_CHUNK_SHRINK;
    for (peer, ok) in [(smallest, true), (smallest / 2, false), (32, false), (0, false), (3 << 20, false)] {
        let theirs = with_chunk(&local, peer);
        let want = if ok { Ok(()) } else { Err(Incompatible::MaxChunk { local: 32 << 20, peer }) };
        assert_eq!(big.compatible_with(&theirs), want, "peer max chunk {peer}");
    }
    // Several mismatches: the version is reported first, then the control kind.
    let all =
        Capabilities { wire_version: u16::from(WIRE_VERSION) + 1, control: ControlKind::Ucx, ..with_chunk(&local, 1) };
    assert!(matches!(local.compatible_with(&all), Err(Incompatible::WireVersion { .. })));
    let two = Capabilities { control: ControlKind::Ucx, ..with_chunk(&local, 1) };
    assert!(matches!(local.compatible_with(&two), Err(Incompatible::ControlKind { .. })));
}

#[test]
fn every_arena_a_peer_advertises_is_judged_and_the_bound_is_our_largest_chunk() {
    let host = ArenaCaps { mem: MemKind::Dram, max_chunk: 2 << 20, ..sample_caps().arenas.first().clone() };
    let gpu = ArenaCaps { mem: MemKind::Vram, max_chunk: 32 << 20, ..host.clone() };
    let ours = Capabilities { arenas: Arenas::new(vec![host.clone(), gpu.clone()]).unwrap(), ..sample_caps() };
    // 32 KiB is 1/1024 of our GPU arena's chunk: fine as the first arena or any other.
    let small = ArenaCaps { max_chunk: 32 << 10, ..host.clone() };
    let theirs = |arenas: Vec<ArenaCaps>| Capabilities { arenas: Arenas::new(arenas).unwrap(), ..sample_caps() };
    assert_eq!(ours.compatible_with(&theirs(vec![small.clone(), gpu.clone()])), Ok(()));
    // One bad arena anywhere in the list rules the peer out: a real engine advertises none.
    let bad = ArenaCaps { max_chunk: 16 << 10, ..host.clone() };
    for list in [vec![bad.clone()], vec![gpu.clone(), bad.clone()], vec![host.clone(), gpu.clone(), bad.clone()]] {
        assert_eq!(
            ours.compatible_with(&theirs(list.clone())),
            Err(Incompatible::MaxChunk { local: 32 << 20, peer: 16 << 10 }),
            "{list:?}"
        );
    }
    // A host-arena-only engine judges by its own (smaller) chunk.
    let host_only = theirs(vec![host.clone()]);
    assert_eq!(host_only.compatible_with(&theirs(vec![bad, gpu.clone()])), Ok(()));
    // Chunks of a transfer take the smaller of the two arenas involved.
    assert_eq!((host.chunk_with(&gpu), gpu.chunk_with(&host), gpu.chunk_with(&gpu)), (2 << 20, 2 << 20, 32 << 20));
}

#[test]
fn an_arena_list_has_one_to_sixteen_arenas_and_ids_index_it() {
    let a = |dev| ArenaCaps { dev, ..sample_caps().arenas.first().clone() };
    assert_eq!(Arenas::new(vec![]), None);
    assert_eq!(Arenas::new((0..17).map(a).collect()), None);
    let list = Arenas::new((0..16).map(a).collect()).expect("16 arenas");
    assert_eq!(list.len(), MAX_ARENAS);
    assert!(list.iter().all(|(id, arena)| arena.dev == u64::from(id.0) && list.get(id) == Some(arena)));
    assert_eq!(list.get(crate::types::ArenaId(16)), None);
    assert_eq!(Arenas::one(a(5)).get(crate::types::ArenaId(0)).map(|x| x.dev), Some(5));
    // The count on the wire: none and seventeen are refused; sixteen is taken.
    let caps = Capabilities { arenas: list, ..sample_caps() };
    let bytes = caps.to_vec();
    assert_eq!(Capabilities::decode(&bytes), Ok(caps.clone()));
    // version (2), control (1), session (8), then the count.
    for n in [0u8, 17, 255] {
        let mut forged = bytes.clone();
        forged[11] = n;
        assert_eq!(Capabilities::decode(&forged), Err(WireError::Invalid { what: "arena count" }), "{n} arenas");
    }
}

#[test]
fn oversized_blobs_encode_to_what_decode_refuses() {
    let big = Msg::Want(Want {
        arena: ArenaId(0),
        xfer: XferId(1),
        token: Token(1),
        endpoint: vec![0; MAX_BLOB as usize + 1],
        chunks: vec![8],
        proofs: vec![],
        inline: None,
        standing: Default::default(),
    });
    let err = big.validate().unwrap_err();
    assert!(matches!(err, WireError::CountTooLarge { what: "endpoint", .. }));
    assert_eq!(Frame::decode(&Frame { session: 0, msg: big }.to_vec()), Err(err));
}

/// `msg` in a frame of session 7 encodes to `golden` (hex, spaces ignored) and decodes back.
fn assert_pinned(msg: Msg, golden: &str) {
    let frame = Frame { session: 7, msg };
    assert_eq!(hex(&frame.to_vec()), hex(&unhex(golden)));
    assert_eq!(Frame::decode(&frame.to_vec()), Ok(frame));
}

/// Golden bytes: the exact encoding of a HELLO, of every sample message, of a capability
/// blob and of both envelope shapes, pinned before the codec was split into `wire/`. Any
/// change to these strings is a wire-format change and needs a new `WIRE_VERSION`.
#[test]
fn golden_bytes_of_every_frame_kind_caps_and_envelope() {
    let frames: Vec<String> = sample_frames().iter().map(|f| hex(&f.to_vec())).collect();
    let want = [
        // WANT
        "00424f554e4311010100000000000000 2a00000000000000 1032547698badcfeefcdab8967452301 01 02000000 6570 02000000 0010000000000000 2000000000000000 01000000 0500000000000000 aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa 00000000
         02 0100000000000080 1032547698badcfeefcdab8967452301",
        // cancel (empty WANT)
        "00424f554e4311010200000000000000 2a00000000000000 1032547698badcfeefcdab8967452301 00 13000000 7463703a2f2f31302e302e302e313a35353535 00000000 00000000 00000000 00",
        // GRANT
        "00424f554e4311020300000000000000 0300000000000000 1032547698badcfeefcdab8967452301 02000000
         00000000 0001000000000000 4000000000000000 01000000 4001000000000000 2000000000000000",
        // DATA
        "00424f554e4311030400000000000000 0300000000000000 1032547698badcfeefcdab8967452301 02000000 0001000000000000 4000000000000000
         01000000 0380402002208001 00000000",
        // ACK
        "00424f554e4311040500000000000000 0300000000000000 1032547698badcfeefcdab8967452301 02000000 0001000000000000 4000000000000000 01",
        // WANT with its one chunk inline: 0x40 bytes, then one run
        "00424f554e4311010600000000000000 2b00000000000000 1032547698badcfeefcdab8967452301 00 02000000 6570 01000000 4000000000000000
         01000000 0500000000000000 bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb
         40000000 000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f202122232425262728292a2b2c2d2e2f303132333435363738393a3b3c3d3e3f
         01000000 0380402002208001 00",
        // WANT opening a standing flow of one 2 MiB chunk
        "00424f554e4311010700000000000000 2900000000000080 1032547698badcfeefcdab8967452301 00 02000000 6570 01000000 0000200000000000
         00000000 00000000 01",
    ];
    assert_eq!(frames, want.map(|w| hex(&unhex(w))));
    // HELLO (kind 5): the load tag.
    assert_eq!(
        hex(&encode_hello(0x0102_0304_0506_0708, 0x1d)),
        "00424f554e4311050807060504030201 1d00000000000000".replace(' ', "")
    );
    // PONG (kind 8): the nonce echoed, then the answerer's forget secret; FORGET (kind 14):
    // the secret.
    let pong = ControlFrame { session: 7, body: Body::Pong { nonce: 5, forget: Token(0xfeed) } };
    assert_eq!(
        hex(&pong.to_vec()),
        hex(&unhex("00424f554e4311080700000000000000 0500000000000000 edfe0000000000000000000000000000"))
    );
    let forget = ControlFrame { session: 7, body: Body::Forget { proof: Token(0xfeed) } };
    assert_eq!(hex(&forget.to_vec()), hex(&unhex("00424f554e43110e0700000000000000 edfe0000000000000000000000000000")));
    for f in [pong, forget] {
        assert_eq!(ControlFrame::decode(&f.to_vec()), Ok(f.clone()));
        let bytes = f.to_vec();
        assert!(ControlFrame::decode(&bytes[..bytes.len() - 1]).is_err(), "truncated");
    }
    // CURSOR (kind 10): transfer, token, records read.
    let cursor = Frame { session: 7, msg: Msg::Cursor(Cursor { xfer: XferId(3), token: Token(0xfeed), consumed: 9 }) };
    assert_eq!(
        hex(&cursor.to_vec()),
        hex(&unhex(
            "00424f554e43110a0700000000000000 0300000000000000 edfe0000000000000000000000000000 0900000000000000"
        ))
    );
    assert_eq!(Frame::decode(&cursor.to_vec()), Ok(cursor));
    // PULL (kind 11): transfer, token, arena, first chunk, total chunks, endpoint, chunks (size,
    // delta-coded gather runs as in DATA), proofs.
    let run = CopyRun { region_off: 0, addr: 0x1000, len: 0x20, count: 2, region_stride: 0x20, addr_stride: 0x80 };
    let pull = Frame {
        session: 7,
        msg: Msg::Pull(Pull {
            arena: ArenaId(3),
            xfer: XferId(3),
            token: Token(0xfeed),
            first: ChunkIdx(1),
            total: 2,
            endpoint: Vec::new(),
            chunks: vec![PullChunk { bytes: 64, runs: vec![run].into() }],
            proofs: vec![Proof { reg: RegId(5), tag: [0xaa; 16] }],
        }),
    };
    assert_eq!(
        hex(&pull.to_vec()),
        hex(&unhex(
            "00424f554e43110b0700000000000000 0300000000000000 edfe0000000000000000000000000000 03 01000000
             02000000 00000000 01000000 4000000000000000 01000000 0380402002208001 01000000 0500000000000000 aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
        ))
    );
    assert_eq!(Frame::decode(&pull.to_vec()), Ok(pull));
    // PLAN (kind 13): transfer, token, chunk, delta-coded scatter runs as in DATA.
    let (xfer, token, chunk) = (XferId(3), Token(0xfeed), ChunkIdx(2));
    assert_pinned(
        Msg::Plan(Plan { xfer, token, chunk, runs: vec![run] }),
        "00424f554e43110d0700000000000000 0300000000000000 edfe0000000000000000000000000000 02000000
         01000000 0380402002208001",
    );
    // RELEASE (kind 12): transfer, token, chunk, region.
    assert_pinned(
        Msg::Release(Release { xfer, token, chunk, region: Region { offset: 0x100, len: 0x40 } }),
        "00424f554e43110c0700000000000000 0300000000000000 edfe0000000000000000000000000000 02000000
         0001000000000000 4000000000000000",
    );
    // Version, control kind, session, one arena (memory kind, device, base, length, usable,
    // max chunk, key), endpoint, mailbox (offset, slots, ring, base, length, key), request
    // timeout in ms.
    let caps = "1100 01 0900000000000000 01
                01 0000000000000000 0010000000000000 0020000000000000 0020000000000000 0004000000000000 01000000 6b
                00000000 0000000000000000 00010000 12000000 00000000007f0000 0080040000000000 01000000 6d
                dc05000000000000";
    assert_eq!(hex(&sample_caps().to_vec()), hex(&unhex(caps)));
    let envelopes: Vec<String> = sample_envelopes().iter().map(|e| hex(&e.to_vec())).collect();
    assert_eq!(
        envelopes,
        [
            hex(&unhex("4e58424f554e4345 0100 00 01000000 ab")),
            hex(&unhex(&format!(
                "4e58424f554e4345 0100 01 6b000000 {caps} 12000000 7563782d776f726b65722d61646472657373"
            ))),
        ]
    );
}

/// `MAX_FRAME_LEN` (what a transport may refuse unread) holds the longest legal frames: a DATA
/// of `MAX_RUNS` runs in their longest encoding and a WANT of `MAX_CHUNKS_PER_WANT` chunks with
/// the longest endpoint and `MAX_PROOFS` proofs, each of which the decoder accepts.
#[test]
fn the_longest_legal_frames_fit_in_max_frame_len() {
    let run = |i: u64| CopyRun {
        region_off: u64::MAX - i,
        addr: i.wrapping_mul(0x9E37_79B9_7F4A_7C15),
        len: u64::MAX - (i & 1),
        count: u32::MAX,
        region_stride: u64::MAX,
        addr_stride: u64::MAX,
    };
    let data = Msg::Data(Data {
        xfer: XferId(u64::MAX),
        token: Token(u128::MAX),
        chunk: ChunkIdx(u32::MAX),
        // Fixed-width fields: every legal region encodes as long.
        region: Region { offset: u64::MAX - 1, len: 1 },
        runs: (0..u64::from(MAX_RUNS)).map(run).collect(),
        region_plan_runs: 0,
    });
    let want = Msg::Want(Want {
        arena: ArenaId(0),
        xfer: XferId(u64::MAX),
        token: Token(u128::MAX),
        endpoint: vec![0xff; MAX_BLOB as usize],
        chunks: vec![u64::MAX; MAX_CHUNKS_PER_WANT as usize],
        proofs: (0..u64::from(MAX_PROOFS)).map(|i| Proof { reg: RegId(u64::MAX - i), tag: [0xff; 16] }).collect(),
        inline: None,
        standing: Default::default(),
    });
    // A PULL: every chunk with one run in its longest encoding (runs are capped in all).
    let pull = Msg::Pull(Pull {
        arena: ArenaId(0),
        xfer: XferId(u64::MAX),
        token: Token(u128::MAX),
        first: ChunkIdx(0),
        total: MAX_CHUNKS_PER_WANT,
        endpoint: vec![0xff; MAX_BLOB as usize],
        chunks: (0..u64::from(MAX_CHUNKS_PER_WANT))
            .map(|i| PullChunk { bytes: u64::MAX, runs: vec![run(i)].into() })
            .collect(),
        proofs: (0..u64::from(MAX_PROOFS)).map(|i| Proof { reg: RegId(u64::MAX - i), tag: [0xff; 16] }).collect(),
    });
    assert!(pull.validate().is_ok());
    let len = |msg| Frame { session: u64::MAX, msg }.to_vec().len();
    let (data, want, pull) = (len(data), len(want), len(pull));
    assert!(
        data <= MAX_FRAME_LEN && want <= MAX_FRAME_LEN && pull <= MAX_FRAME_LEN,
        "{data} {want} {pull} > {MAX_FRAME_LEN}"
    );
    // Tight: the cap is the longest PULL plus the headroom (a run's address delta may encode
    // one byte shorter here), so it refuses nothing legal and little more.
    assert!(pull + 4096 + MAX_RUNS as usize >= MAX_FRAME_LEN, "{pull}");
}

/// A KEEP is the header, the transfer id and the token, nothing else, and decodes back.
#[test]
fn a_keep_is_header_xfer_and_token() {
    let keep = Frame { session: 7, msg: Msg::Keep(Keep { xfer: XferId(0x2a), token: Token(0xfeed) }) };
    let bytes = keep.to_vec();
    assert_eq!(bytes.len(), HEADER_LEN + 8 + 16);
    assert_eq!(bytes[7], 9, "kind byte");
    assert_eq!(Frame::decode(&bytes), Ok(keep));
    assert!(Frame::decode(&bytes[..bytes.len() - 1]).is_err(), "a truncated KEEP is refused");
}
