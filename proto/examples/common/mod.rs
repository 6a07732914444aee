//! What the examples share: two endpoints that loaded each other, their agents' names and
//! registration keys.

use std::time::Instant;

use bounce_proto::config::Config;
use bounce_proto::endpoint::Endpoint;
use bounce_proto::wire;
use bounce_proto::{PeerId, RegId, RegKey};

/// Where every endpoint's one registration starts.
pub(crate) const MEM_BASE: u64 = 0x7f00_0000_0000;

pub(crate) fn agent(i: usize) -> String {
    format!("agent-{i}")
}

pub(crate) fn key(i: usize) -> RegKey {
    RegKey([i as u8 ^ 0xa5; 32])
}

/// Endpoint `i` of two that loaded each other and exchanged HELLO; all its memory registered.
pub(crate) fn endpoint(config: &Config, i: usize, now: Instant) -> Endpoint {
    let mut ep = Endpoint::new(config, now, [i as u8 ^ 0x3c; 32]).expect("endpoint");
    ep.set_local_endpoint(format!("node-{i}").into_bytes());
    ep.add_registered(RegId(0), key(i), (MEM_BASE, 1 << 40), bounce_proto::ArenaId(0));
    for j in 0..2 {
        assert_eq!(ep.peers_mut().id(&agent(j)), PeerId(j as u64));
        if j != i {
            let caps = wire::Capabilities::host_arena(config.arena_usable_capacity(), config.max_chunk_size, j as u64);
            let ours = wire::Capabilities::host_arena(config.arena_usable_capacity(), config.max_chunk_size, i as u64);
            ep.handle_conn_info(now, &agent(j), Some(caps), Some(&ours));
            ep.handle_frame(now, &agent(j), &wire::encode_hello(j as u64, 0)).expect("HELLO");
            // Answer the ask the HELLO opens (a PING only the peer sees), as the peer would.
            let nonce = std::iter::from_fn(|| ep.poll_action())
                .find_map(|a| match a {
                    bounce_proto::endpoint::Action::Link { body: wire::Body::Ping { nonce }, .. } => Some(nonce),
                    _ => None,
                })
                .expect("a HELLO is asked about");
            let pong = wire::ControlFrame {
                session: j as u64,
                body: wire::Body::Pong { nonce, forget: bounce_proto::Token(0) },
            };
            ep.handle_frame(now, &agent(j), &pong.to_vec()).expect("PONG");
        }
    }
    ep
}
