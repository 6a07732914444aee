//! FORGET: telling a peer that we unloaded its metadata, in a way no third agent can copy.
//!
//! When NIXL here unloads a peer (`disconnect`), we can no longer send it frames, so its two-way
//! transfers to us (answered by GRANT and ACK frames) cannot finish, and every later one would
//! fail after the liveness probe's bound. Through plain UCX its one-sided writes would go on.
//! So, while we still can, we send it a FORGET: it fails its two-way transfers to us at once
//! and goes one way to us (answers through our mailbox), as if we had never loaded it.
//!
//! A FORGET must not be forgeable: anyone holding our published metadata knows our session,
//! and a forged one would fail a peer's transfers to us and slow the later ones. So it carries
//! a secret of this load of the peer's metadata here, which only we know and which we gave the
//! peer in our PONGs to it. The peer records it from the PONG that confirms our HELLO (its
//! nonce was seen by us alone, so that PONG is ours) and honours a FORGET only with it.
//!
//! The secret of a load is keyed BLAKE3 of the peer's id here under a key derived from the
//! engine's random probe key. A reload after an unload gives the peer a new id, so each load
//! has its own secret: a FORGET of an earlier load, replayed or late, does not match the one a
//! reload brought, and one secret tells nothing of another. (A load the inner engine refuses
//! hands its id back to the incarnation a later load adopts; no FORGET is sent for it.)

use crate::types::{PeerId, Token};

/// The key forget secrets derive from, from the engine's random probe key (see
/// [`crate::endpoint::Endpoint::new`]); derived, so a secret reveals nothing of the
/// PING nonces and the other way round.
pub fn key(probe_key: &[u8; 32]) -> [u8; 32] {
    blake3::derive_key("nixl-bounce 2026-12 FORGET secrets of loaded peers", probe_key)
}

/// The secret of the load of `peer`'s metadata that `peer` names here: carried in every PONG
/// we send it, and in the FORGET we send it when we unload it.
pub fn secret(key: &[u8; 32], peer: PeerId) -> Token {
    let hash = blake3::keyed_hash(key, &peer.0.to_le_bytes());
    let mut first = [0u8; 16];
    first.copy_from_slice(&hash.as_bytes()[..16]);
    Token(u128::from_le_bytes(first))
}

/// The tag of the load whose forget secret is `secret`, carried in our HELLOs to the peer: the
/// first 8 bytes of its BLAKE3 hash. The peer compares it with the tag of the secret it holds
/// from its confirming PONG: the same tag is a repeat of a HELLO it confirmed, another a reload
/// of its metadata here (a lost FORGET between), which it asks about to learn the new secret
/// (see [`crate::hello`]). One way: the tag tells nothing of the secret a FORGET must prove.
pub fn load_tag(secret: Token) -> u64 {
    let hash = blake3::hash(&secret.0.to_le_bytes());
    let mut first = [0u8; 8];
    first.copy_from_slice(&hash.as_bytes()[..8]);
    u64::from_le_bytes(first)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_load_and_each_engine_has_its_own_secret() {
        let (k1, k2) = (key(&[1; 32]), key(&[2; 32]));
        assert_ne!(secret(&k1, PeerId(7)), secret(&k1, PeerId(8)), "another load (id) here");
        assert_ne!(secret(&k1, PeerId(7)), secret(&k2, PeerId(7)), "another engine");
        assert_eq!(secret(&k1, PeerId(7)), secret(&k1, PeerId(7)), "the PONG's and the FORGET's agree");
        assert_ne!(key(&[1; 32]), [1; 32], "derived, not the probe key itself");
        let (a, b) = (secret(&k1, PeerId(7)), secret(&k1, PeerId(8)));
        assert_ne!(load_tag(a), load_tag(b), "each load its own tag");
        assert_eq!(load_tag(a), load_tag(a));
        assert_ne!(load_tag(a), a.0 as u64, "a digest, not the secret's own bytes");
    }
}
