//! Destination proofs (issue 10, item 7): a peer may make us scatter only into registrations
//! whose public metadata it was given, as with plain UCX, where it can write only where it
//! holds a remote key.
//!
//! Each registration made through BOUNCE has an id and a random [`RegKey`], published only in
//! that registration's metadata. A sender proves, per destination registration of a transfer,
//! that it holds the key: its WANT carries a [`Proof`] whose tag is the keyed hash (BLAKE3) of
//! the transfer's [`Token`] and id under the key. Tags differ per transfer, so one seen on the
//! wire proves nothing for another transfer: not even for the same token under a fresh id (until
//! wire version 17 the id was not bound, and a captured WANT or PULL with only its id changed
//! opened a new flow; review 61). The id's own replays are refused by the receiver's replay
//! window. The receiver checks each proof against its
//! [`Registrations`] and lets the flow scatter only inside the registrations so proven.

use std::collections::BTreeMap;

use thiserror::Error;

use crate::types::{ArenaId, RegId, RegKey, Token, XferId};
use crate::wire::Proof;

/// Bytes of a proof's tag (a truncated BLAKE3 keyed hash: 128 bits, like the token).
pub const TAG_LEN: usize = 16;

/// The keyed hash of `token` under `key`, truncated to [`TAG_LEN`] bytes (also what a standing
/// flow's token derives from).
pub fn tag(key: &RegKey, token: Token) -> [u8; TAG_LEN] {
    truncate(&blake3::keyed_hash(&key.0, &token.0.to_le_bytes()))
}

fn truncate(hash: &blake3::Hash) -> [u8; TAG_LEN] {
    let mut out = [0; TAG_LEN];
    out.copy_from_slice(&hash.as_bytes()[..TAG_LEN]);
    out
}

/// Who a proof is made by: a hash of the initiator's agent name, which the receiver takes from
/// the channel the frame came on (the name NIXL or our ZMQ framing gives). Binding the tag to
/// it means a WANT captured on the wire and sent again under another name (a one-way name is
/// anyone's to invent) proves nothing, so only its own name can replay it, and the receiver's
/// per-name replay window ([`crate::receiver`]) refuses that.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Initiator([u8; 32]);

impl Initiator {
    /// The initiator named `name`.
    pub fn named(name: &str) -> Self {
        let mut h = blake3::Hasher::new_derive_key("nixl-bounce 2026-12 proof initiator");
        h.update(name.as_bytes());
        Self(*h.finalize().as_bytes())
    }
}

impl Default for Initiator {
    /// The initiator with the empty name: what an endpoint that was told no names uses on both
    /// sides (the core's tests).
    fn default() -> Self {
        Self::named("")
    }
}

/// The tag proving possession of `key` for transfer `xfer` with `token`, made by `initiator`:
/// the key's BLAKE3 keyed hash of the token (16 bytes, little-endian), the id (8 bytes,
/// little-endian) and the initiator's name hash (32 bytes), truncated to [`TAG_LEN`].
pub fn bound_tag(key: &RegKey, token: Token, xfer: XferId, initiator: &Initiator) -> [u8; TAG_LEN] {
    let mut h = blake3::Hasher::new_keyed(&key.0);
    h.update(&token.0.to_le_bytes());
    h.update(&xfer.0.to_le_bytes());
    h.update(&initiator.0);
    truncate(&h.finalize())
}

/// The proof for `key`'s registration `reg` in transfer `xfer` with `token`, made by
/// `initiator`.
pub fn prove_as(reg: RegId, key: &RegKey, token: Token, xfer: XferId, initiator: &Initiator) -> Proof {
    Proof { reg, tag: bound_tag(key, token, xfer, initiator) }
}

/// [`prove_as`] by the initiator with the empty name ([`Initiator::default`]).
pub fn prove(reg: RegId, key: &RegKey, token: Token, xfer: XferId) -> Proof {
    prove_as(reg, key, token, xfer, &Initiator::default())
}

/// A destination registration the sender holds the metadata (and so the key) of.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Destination {
    /// The receiver's registration id.
    pub reg: RegId,
    /// Its key, from the registration's public metadata.
    pub key: RegKey,
}

/// Why a WANT's proofs were refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum BadProof {
    /// No registration has this id (never, or deregistered since).
    #[error("unknown registration {}", .0.0)]
    UnknownRegistration(RegId),
    /// The tag is not the transfer token's under the registration's key.
    #[error("wrong tag for registration {}", .0.0)]
    WrongTag(RegId),
    /// A valid proof of a registration deregistered since its metadata went out: the sender
    /// is honest but late (no forgery), and its transfer cannot be served.
    #[error("registration {} was deregistered", .0.0)]
    Deregistered(RegId),
    /// A valid proof of a registration that the flow's arena does not serve (host memory for
    /// a GPU arena, or GPU memory for a host arena or another GPU's): that arena's copy engine
    /// must never touch it. An honest sender names the arena of its destinations' memory.
    #[error("registration {} is not served by arena {}", .0.0, .1.0)]
    WrongArena(RegId, ArenaId),
    /// No proof at all, in a frame that opens a one-way flow. An honest WANT or PULL proves
    /// every registration its runs touch, at least one; a one-way one proving none could never
    /// be served, and would only hold credits, mailbox slots and queue places of ours for a
    /// sender holding no key of ours and never loaded here.
    #[error("no proof")]
    NoProof,
}

/// Deregistered registrations remembered, so that a WANT racing a deregistration is told apart
/// from a forgery (the oldest is forgotten beyond).
pub const REMEMBERED_DEREGISTRATIONS: usize = 1024;

/// One registration: its key and the bytes it covers.
#[derive(Debug, Clone, Copy)]
struct Registration {
    key: RegKey,
    start: u64,
    end: u64,
    /// The one arena whose copy engine may touch it.
    arena: ArenaId,
}

/// The registrations made through this engine, by id: what a flow may prove and scatter into.
#[derive(Debug, Default, Clone)]
pub struct Registrations {
    by_id: BTreeMap<RegId, Registration>,
    /// The last [`REMEMBERED_DEREGISTRATIONS`] deregistered ids and keys, oldest first.
    gone: std::collections::VecDeque<(RegId, RegKey)>,
    /// Deregistrations so far: a check made while this was unchanged still holds.
    removals: u64,
}

impl Registrations {
    /// Records registration `reg` of `[addr, addr + len)` with `key`, served by `arena` (flows
    /// of other arenas cannot prove it). An empty or wrapping range is ignored (returns false);
    /// a repeated id replaces the older entry.
    pub fn add(&mut self, reg: RegId, key: RegKey, (addr, len): (u64, u64), arena: ArenaId) -> bool {
        let Some(end) = addr.checked_add(len).filter(|_| len > 0) else { return false };
        if self.by_id.insert(reg, Registration { key, start: addr, end, arena }).is_some() {
            // The replaced range may have covered more than the new one.
            self.removals += 1;
        }
        true
    }

    /// Forgets registration `reg`; true when it was known. Flows that proved it can no longer
    /// scatter into it.
    pub fn remove(&mut self, reg: RegId) -> bool {
        let Some(r) = self.by_id.remove(&reg) else { return false };
        if self.gone.len() == REMEMBERED_DEREGISTRATIONS {
            self.gone.pop_front();
        }
        self.gone.push_back((reg, r.key));
        self.removals += 1;
        true
    }

    /// How many registrations were removed so far. A [`covers`](Self::covers) check made when
    /// this had the same value still holds: registrations only shrink by removal.
    pub fn removals(&self) -> u64 {
        self.removals
    }

    /// [`Self::verify`] for the frame that opens a one-way flow (a WANT, or a READ's first
    /// PULL; later PULLs add to what the first proved and may prove nothing more): it must
    /// prove at least one registration.
    ///
    /// # Errors
    /// [`BadProof::NoProof`] for no proof, else as [`Self::verify`].
    pub fn verify_opening(
        &self,
        (token, xfer): (Token, XferId),
        by: &Initiator,
        proofs: &[Proof],
        arena: ArenaId,
    ) -> Result<Vec<RegId>, BadProof> {
        if proofs.is_empty() {
            return Err(BadProof::NoProof);
        }
        self.verify((token, xfer), by, proofs, arena)
    }

    /// Checks `proofs` for transfer `xfer` with `token` made by initiator `by` through `arena`;
    /// returns the proven registration ids, each once (a flow keeps them: a WANT repeating one
    /// proof 4096 times must not make it keep, and check every run against, 4096 copies).
    ///
    /// # Errors
    /// The first [`BadProof`]: then the WANT carrying them is refused as a whole.
    pub fn verify(
        &self,
        (token, xfer): (Token, XferId),
        by: &Initiator,
        proofs: &[Proof],
        arena: ArenaId,
    ) -> Result<Vec<RegId>, BadProof> {
        let mut proven = self.verify_each((token, xfer), by, proofs, arena)?;
        proven.sort_unstable();
        proven.dedup();
        Ok(proven)
    }

    fn verify_each(
        &self,
        (token, xfer): (Token, XferId),
        by: &Initiator,
        proofs: &[Proof],
        arena: ArenaId,
    ) -> Result<Vec<RegId>, BadProof> {
        proofs
            .iter()
            .map(|p| {
                let Some(r) = self.by_id.get(&p.reg) else {
                    // Only a proof under the gone registration's key counts as late, not forged.
                    let late = self
                        .gone
                        .iter()
                        .any(|(id, key)| *id == p.reg && same(&bound_tag(key, token, xfer, by), &p.tag));
                    return Err(if late {
                        BadProof::Deregistered(p.reg)
                    } else {
                        BadProof::UnknownRegistration(p.reg)
                    });
                };
                match (same(&bound_tag(&r.key, token, xfer, by), &p.tag), r.arena == arena) {
                    (false, _) => Err(BadProof::WrongTag(p.reg)),
                    (true, false) => Err(BadProof::WrongArena(p.reg, arena)),
                    (true, true) => Ok(p.reg),
                }
            })
            .collect()
    }

    /// True when `[start, end)` lies inside one of the registrations `proven` that still
    /// exists.
    pub fn covers(&self, proven: &[RegId], start: u64, end: u64) -> bool {
        proven.iter().filter_map(|id| self.by_id.get(id)).any(|r| r.start <= start && end <= r.end)
    }

    /// The ranges of the registrations `proven` that still exist, for checking many runs at
    /// once: a PLAN or DATA of thousands of runs looked each one up by id per run.
    pub fn proven_ranges(&self, proven: &[RegId]) -> ProvenRanges {
        let mut ranges: Vec<(u64, u64)> =
            proven.iter().filter_map(|id| self.by_id.get(id)).map(|r| (r.start, r.end)).collect();
        ranges.sort_unstable();
        let starts = ranges.iter().map(|r| r.0).collect();
        let reach = ranges.iter().scan(0, |m, r| {
            *m = r.1.max(*m);
            Some(*m)
        });
        ProvenRanges { starts, reach: reach.collect() }
    }

    /// True when `[start, end)` lies inside any registration recorded now (proven or not): the
    /// memory is still the application's to be written, whoever proved it.
    pub fn covers_any(&self, start: u64, end: u64) -> bool {
        self.by_id.values().any(|r| r.start <= start && end <= r.end)
    }

    /// Registrations recorded.
    pub fn len(&self) -> usize {
        self.by_id.len()
    }

    /// True when none is recorded.
    pub fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }
}

/// A flow's proven registrations as ranges, sorted by start (see
/// [`Registrations::proven_ranges`]); answers what [`Registrations::covers`] answers.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ProvenRanges {
    /// Range starts, ascending.
    starts: Vec<u64>,
    /// `reach[i]`: the farthest end among the ranges `0..=i`.
    reach: Vec<u64>,
}

impl ProvenRanges {
    /// True when `[start, end)` lies inside one of the ranges: among those starting at or
    /// before `start`, the one reaching farthest reaches `end`.
    pub fn covers(&self, start: u64, end: u64) -> bool {
        let n = self.starts.partition_point(|&s| s <= start);
        n > 0 && self.reach[n - 1] >= end
    }

    /// Range starts, ascending (for a copy engine that checks on the device what
    /// [`Self::covers`] answers).
    pub fn starts(&self) -> &[u64] {
        &self.starts
    }

    /// `reach()[i]`: the farthest end among the ranges `0..=i`.
    pub fn reach(&self) -> &[u64] {
        &self.reach
    }

    /// The smallest span holding every range (`None` when there is none): what a scatter by
    /// an unchecked plan may touch at most.
    pub fn hull(&self) -> Option<(u64, u64)> {
        Some((*self.starts.first()?, *self.reach.last()?))
    }
}

/// Tag equality without an early exit: the time taken says nothing about the tag.
fn same(a: &[u8; TAG_LEN], b: &[u8; TAG_LEN]) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The initiator the tests' proofs are made by.
    fn by() -> Initiator {
        Initiator::default()
    }

    const KEY: RegKey = RegKey([7; 32]);
    const A0: ArenaId = ArenaId(0);
    /// The transfer id the tests' proofs are made for.
    const X3: XferId = XferId(3);

    /// Review 61 (READ, M1): the tag binds the transfer's id. A WANT or PULL captured on the
    /// wire and sent again with only its id changed (a fresh id passes the replay window)
    /// opened a new flow on its old proofs; now its proofs are for another transfer.
    #[test]
    fn a_proof_holds_only_for_the_transfer_id_it_was_made_for() {
        let mut regs = Registrations::default();
        assert!(regs.add(RegId(1), KEY, (0x1000, 0x1000), A0));
        let t = Token(42);
        let p = prove(RegId(1), &KEY, t, X3);
        assert_eq!(regs.verify_opening((t, X3), &by(), &[p], A0), Ok(vec![RegId(1)]));
        for other in [XferId(4), XferId(3 | 1 << 63), XferId(0)] {
            assert_eq!(regs.verify_opening((t, other), &by(), &[p], A0), Err(BadProof::WrongTag(RegId(1))));
        }
        assert_ne!(bound_tag(&KEY, t, X3, &by()), bound_tag(&KEY, t, XferId(4), &by()));
    }

    proptest::proptest! {
        /// The ranges answer exactly what the per-id lookup answers, overlapping and nested
        /// registrations, unproven and removed ones included.
        #[test]
        fn proven_ranges_cover_exactly_what_covers_covers(
            regs in proptest::collection::vec((0u64..64, 1u64..32), 0..8),
            proven in proptest::collection::vec(0u64..10, 0..8),
            removed in proptest::collection::vec(0u64..10, 0..3),
            queries in proptest::collection::vec((0u64..100, 0u64..40), 1..40),
        ) {
            let mut r = Registrations::default();
            for (i, &(start, len)) in regs.iter().enumerate() {
                r.add(RegId(i as u64), KEY, (start, len), A0);
            }
            for id in removed {
                r.remove(RegId(id));
            }
            let proven: Vec<RegId> = proven.into_iter().map(RegId).collect();
            let ranges = r.proven_ranges(&proven);
            for (a, len) in queries {
                proptest::prop_assert_eq!(ranges.covers(a, a + len), r.covers(&proven, a, a + len), "[{}, {})", a, a + len);
            }
        }
    }

    #[test]
    fn a_proof_holds_only_for_the_initiator_that_made_it() {
        let mut regs = Registrations::default();
        assert!(regs.add(RegId(1), KEY, (0x1000, 0x1000), A0));
        let (t, a, b) = (Token(42), Initiator::named("a"), Initiator::named("b"));
        let p = prove_as(RegId(1), &KEY, t, X3, &a);
        assert_eq!(regs.verify((t, X3), &a, &[p], A0), Ok(vec![RegId(1)]));
        assert_eq!(regs.verify((t, X3), &b, &[p], A0), Err(BadProof::WrongTag(RegId(1))));
        assert_eq!(regs.verify((t, X3), &Initiator::default(), &[p], A0), Err(BadProof::WrongTag(RegId(1))));
        assert_ne!(Initiator::named("a"), Initiator::named("a\0"));
    }

    #[test]
    fn a_proof_holds_only_for_its_key_and_token() {
        let mut regs = Registrations::default();
        assert!(regs.add(RegId(1), KEY, (0x1000, 0x1000), A0));
        assert!(regs.add(RegId(2), RegKey([8; 32]), (0x4000, 0x1000), A0));
        let t = Token(42);
        assert_eq!(regs.verify((t, X3), &by(), &[prove(RegId(1), &KEY, t, X3)], A0), Ok(vec![RegId(1)]));
        // Another token, another key, another id, a flipped bit: all refused.
        assert_eq!(
            regs.verify((t, X3), &by(), &[prove(RegId(1), &KEY, Token(43), X3)], A0),
            Err(BadProof::WrongTag(RegId(1)))
        );
        assert_eq!(regs.verify((t, X3), &by(), &[prove(RegId(2), &KEY, t, X3)], A0), Err(BadProof::WrongTag(RegId(2))));
        assert_eq!(
            regs.verify((t, X3), &by(), &[prove(RegId(3), &KEY, t, X3)], A0),
            Err(BadProof::UnknownRegistration(RegId(3)))
        );
        let mut p = prove(RegId(1), &KEY, t, X3);
        p.tag[TAG_LEN - 1] ^= 1;
        assert_eq!(regs.verify((t, X3), &by(), &[p], A0), Err(BadProof::WrongTag(RegId(1))));
        // One bad proof among good ones spoils the lot.
        assert!(regs.verify((t, X3), &by(), &[prove(RegId(1), &KEY, t, X3), p], A0).is_err());
        // None proves nothing: an opening frame without proofs is refused; a later one adds
        // nothing to what its flow proved.
        assert_eq!(regs.verify_opening((t, X3), &by(), &[], A0), Err(BadProof::NoProof));
        assert_eq!(regs.verify((t, X3), &by(), &[], A0), Ok(vec![]));
        assert_eq!(regs.verify_opening((t, X3), &by(), &[prove(RegId(1), &KEY, t, X3)], A0), Ok(vec![RegId(1)]));
        assert_ne!(tag(&KEY, t), tag(&KEY, Token(43)), "tags differ per transfer");
        // Repeated proofs prove each registration once: what a flow keeps is bounded by what
        // is registered, not by how often a WANT repeats itself.
        let (one, two) = (prove(RegId(1), &KEY, t, X3), prove(RegId(2), &RegKey([8; 32]), t, X3));
        let mut repeated = vec![two; 2048];
        repeated.extend([one; 2048]);
        assert_eq!(regs.verify((t, X3), &by(), &repeated, A0), Ok(vec![RegId(1), RegId(2)]));
    }

    #[test]
    fn only_proven_registrations_that_still_exist_are_covered() {
        let mut regs = Registrations::default();
        regs.add(RegId(1), KEY, (0x1000, 0x1000), A0);
        regs.add(RegId(2), KEY, (0x4000, 0x1000), A0);
        assert!(regs.covers(&[RegId(1)], 0x1000, 0x2000));
        assert!(!regs.covers(&[RegId(1)], 0x1000, 0x2001), "past its end");
        assert!(!regs.covers(&[RegId(1)], 0x4000, 0x4010), "registered, not proven");
        assert!(!regs.covers(&[], 0x1000, 0x1010));
        assert!(regs.remove(RegId(1)));
        assert!(!regs.covers(&[RegId(1)], 0x1000, 0x1010), "deregistered since");
        // A valid proof of it is late, not forged; a wrong tag of it stays unknown.
        let t = Token(5);
        assert_eq!(
            regs.verify((t, X3), &by(), &[prove(RegId(1), &KEY, t, X3)], A0),
            Err(BadProof::Deregistered(RegId(1)))
        );
        let other = RegKey([9; 32]);
        assert_eq!(
            regs.verify((t, X3), &by(), &[prove(RegId(1), &other, t, X3)], A0),
            Err(BadProof::UnknownRegistration(RegId(1)))
        );
        assert!(!regs.add(RegId(3), KEY, (u64::MAX, 2), A0), "a wrapping range is ignored");
        assert_eq!(regs.len(), 1);
    }

    #[test]
    fn a_valid_proof_holds_only_through_the_arena_that_serves_the_registration() {
        // Host memory served by arena 0, GPU memory by arena 1: a flow through the host arena
        // must not prove the GPU registration (its CPU scatter would touch a GPU address),
        // nor the other way round, even with the right key.
        let mut regs = Registrations::default();
        regs.add(RegId(1), KEY, (0x1000, 0x1000), A0);
        regs.add(RegId(2), KEY, (0x9000, 0x1000), ArenaId(1));
        let t = Token(7);
        let (host, gpu) = (prove(RegId(1), &KEY, t, X3), prove(RegId(2), &KEY, t, X3));
        assert_eq!(regs.verify((t, X3), &by(), &[host], A0), Ok(vec![RegId(1)]));
        assert_eq!(regs.verify((t, X3), &by(), &[gpu], ArenaId(1)), Ok(vec![RegId(2)]));
        assert_eq!(regs.verify((t, X3), &by(), &[gpu], A0), Err(BadProof::WrongArena(RegId(2), A0)));
        assert_eq!(regs.verify((t, X3), &by(), &[host, gpu], A0), Err(BadProof::WrongArena(RegId(2), A0)));
        assert_eq!(regs.verify((t, X3), &by(), &[host], ArenaId(1)), Err(BadProof::WrongArena(RegId(1), ArenaId(1))));
        // A wrong tag stays a forgery whatever the arena.
        let forged = prove(RegId(2), &RegKey([1; 32]), t, X3);
        assert_eq!(regs.verify((t, X3), &by(), &[forged], A0), Err(BadProof::WrongTag(RegId(2))));
    }
}
