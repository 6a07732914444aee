//! Operation-sequence fuzzing of the arena's buddy allocator on its own: allocations of any
//! size, frees (plain and hot) of live regions in any order, and frees of arbitrary offsets.
//! Shared by the
//! `buddy_ops` cargo-fuzz target and a stable test over seeded inputs.
//!
//! Checked after every step, against a shadow list of live regions: the allocator's own
//! invariants; conservation (free + live bytes = usable capacity); every granted region is a
//! power of two of at least `max(bytes, granularity)`, aligned to its size, inside the arena and
//! disjoint from every live region; an allocation is refused only when no free block is large
//! enough (next-fit must still find any fit); the lowest region freed hot since the last
//! allocation comes back from the next allocation of its size; a bogus free is an error that changes nothing. At
//! the end, freeing everything coalesces the arena back into its top-level blocks.

use arbitrary::Unstructured;
use bounce_proto::Region;
use bounce_proto::buddy::Buddy;

/// One thing that can happen to the allocator.
#[derive(Debug)]
enum Op {
    /// Allocate `bytes` (0 included: always refused).
    Alloc { bytes: u64 },
    /// Free the live region at `which % live`, hot or not; with `reuse`, allocate its size at
    /// once.
    Free { which: u16, hot: bool, reuse: bool },
    /// Free an arbitrary offset (double free, inside a block, past the end).
    Bogus { offset: u64 },
}

/// What a run exercised (so a stable test can prove it was not vacuous).
#[derive(Debug, Default, Clone, Copy)]
pub struct BuddyCoverage {
    /// Allocations granted.
    pub granted: u64,
    /// Allocations refused with bytes left free (fragmentation or a too-large request).
    pub refused_with_free_bytes: u64,
    /// Frees of live regions.
    pub freed: u64,
    /// Regions freed hot and taken again by the next allocation of their size.
    pub hot_reused: u64,
    /// Bogus frees rejected.
    pub bogus: u64,
}

/// Runs one operation sequence drawn from `data`; panics on any violated property.
pub fn run_buddy(data: &[u8]) -> BuddyCoverage {
    let mut u = Unstructured::new(data);
    let mut cov = BuddyCoverage::default();
    // Capacity need not be a power of two (top-level blocks of several sizes); granularity is.
    let Ok(g_shift) = u.int_in_range(0u32..=6) else { return cov };
    let granularity = 1u64 << (g_shift + 6);
    let Ok(units) = u.int_in_range(1u64..=300) else { return cov };
    let extra = u.int_in_range(0..=granularity - 1).unwrap_or(0);
    let capacity = units * granularity + extra;
    let mut b = Buddy::new(capacity, granularity).expect("valid geometry");
    let usable = units * granularity;
    let mut live: Vec<Region> = Vec::new();
    // The lowest offset freed hot since the last allocation.
    let mut hot_floor: Option<u64> = None;
    while !u.is_empty() {
        let op = match u.int_in_range(0u8..=9).unwrap_or(0) {
            0..=5 => Op::Alloc { bytes: u.int_in_range(0..=usable + granularity).unwrap_or(0) },
            6..=8 => Op::Free {
                which: u.arbitrary().unwrap_or(0),
                hot: u.arbitrary().unwrap_or(false),
                reuse: u.arbitrary().unwrap_or(false),
            },
            _ => Op::Bogus { offset: u.int_in_range(0..=usable + granularity).unwrap_or(0) },
        };
        match op {
            Op::Alloc { bytes } => match b.alloc(bytes) {
                Some(r) => {
                    let want = bytes.max(granularity).next_power_of_two();
                    assert!(bytes > 0, "a zero-byte request was granted {r:?}");
                    assert_eq!(r.len, want, "{bytes} bytes got {r:?}");
                    assert_eq!(r.offset % r.len, 0, "{r:?} is not aligned to its size");
                    assert!(r.offset + r.len <= usable, "{r:?} leaves the arena of {usable}");
                    assert!(
                        live.iter().all(|l| r.offset + r.len <= l.offset || l.offset + l.len <= r.offset),
                        "{r:?} overlaps a live region"
                    );
                    hot_floor = None;
                    live.push(r);
                    cov.granted += 1;
                }
                None => {
                    let fits = bytes > 0 && b.free_regions().any(|f| f.len >= bytes.max(granularity));
                    assert!(!fits, "{bytes} bytes refused although a free block fits");
                    if b.free_bytes() >= bytes && bytes > 0 {
                        cov.refused_with_free_bytes += 1;
                    }
                }
            },
            Op::Free { which, hot, reuse } => {
                if live.is_empty() {
                    continue;
                }
                let r = live.swap_remove(usize::from(which) % live.len());
                assert_eq!(if hot { b.free_hot(r.offset) } else { b.free(r.offset) }, Ok(r));
                cov.freed += 1;
                if hot {
                    hot_floor = Some(hot_floor.map_or(r.offset, |f: u64| f.min(r.offset)));
                }
                // The lowest region freed hot since the last allocation comes back first.
                if hot && reuse && hot_floor == Some(r.offset) {
                    assert_eq!(b.alloc(r.len), Some(r), "a region freed hot was not the next of its size");
                    hot_floor = None;
                    live.push(r);
                    cov.hot_reused += 1;
                }
            }
            Op::Bogus { offset } => {
                if live.iter().any(|l| l.offset == offset) {
                    continue; // not bogus: a real free, exercised above
                }
                let before = (b.free_bytes(), b.allocated_bytes());
                assert!(b.free(offset).is_err(), "freeing {offset:#x} (not a live start) succeeded");
                assert_eq!((b.free_bytes(), b.allocated_bytes()), before, "a rejected free changed the arena");
                cov.bogus += 1;
            }
        }
        b.check_invariants().unwrap_or_else(|e| panic!("invariant broken: {e}"));
        let live_bytes: u64 = live.iter().map(|r| r.len).sum();
        assert_eq!(b.free_bytes() + live_bytes, usable, "arena bytes not conserved");
        assert_eq!(b.allocated_bytes(), live_bytes);
    }
    for r in live.drain(..) {
        assert_eq!(b.free(r.offset), Ok(r));
    }
    assert_eq!(b.free_bytes(), usable);
    // Fully coalesced: one free block per set bit of the unit count, largest first.
    assert_eq!(b.free_regions().count() as u32, units.count_ones(), "the arena did not coalesce");
    cov
}
