//! Power-of-two buddy allocator over arena byte offsets (design §4 `BuddyAllocator`).
//!
//! Owns only bookkeeping: which `[offset, offset + len)` slices of an arena are free or handed
//! out. It never sees a pointer; the shell turns an offset into an address (`base + offset`).
//! The [`crate::scheduler::CreditScheduler`] embeds one [`Buddy`] and is its only user in the
//! engine; there is no other owner of arena space.

use std::collections::{BTreeMap, BTreeSet};

use thiserror::Error;

use crate::types::Region;

/// Errors from building a [`Buddy`] or freeing a region in it.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum AllocError {
    /// The minimum block size is zero or not a power of two.
    #[error("allocation granularity {granularity} is not a non-zero power of two")]
    BadGranularity {
        /// The rejected granularity in bytes.
        granularity: u64,
    },
    /// The arena cannot hold even one minimum block.
    #[error("arena capacity {capacity} is smaller than the granularity {granularity}")]
    CapacityTooSmall {
        /// The arena size in bytes.
        capacity: u64,
        /// The minimum block size in bytes.
        granularity: u64,
    },
    /// `free` was called with an offset that is not the start of an allocated block (never
    /// allocated, already freed, or pointing inside a block).
    #[error("offset {offset:#x} is not an allocated block (double free or unknown offset)")]
    NotAllocated {
        /// The offending offset.
        offset: u64,
    },
}

/// Shorthand for results of this module.
pub type Result<T> = std::result::Result<T, AllocError>;

/// A power-of-two buddy allocator over the byte offsets of one arena.
///
/// # Geometry
/// The usable capacity is `capacity` rounded down to a multiple of `granularity`. It is covered
/// by its binary decomposition into power-of-two *top-level blocks*, largest first at offset 0
/// (7 units = 4 + 2 + 1 at offsets 0, 4, 6), so every block is aligned to its own size and a
/// block's buddy is `offset ^ len`. Blocks never merge across top-level blocks.
///
/// # Contract
/// - [`alloc(bytes)`](Self::alloc) hands out a block of `max(bytes, granularity)` rounded up to a
///   power of two, or `None` when no free block is that large (backpressure, not an error).
///   `bytes == 0` always returns `None`: a zero-length region is never a valid request.
/// - [`free(offset)`](Self::free) takes the offset of a block returned by `alloc` and merges it
///   with its free buddies; any other offset (double free, never allocated, inside a block) is
///   an [`AllocError::NotAllocated`] and leaves the allocator unchanged. Nothing here panics.
/// - Placement is deterministic next-fit: the lowest free block that fits at or after a
///   cursor, wrapping around to offset 0. [`alloc`](Self::alloc) leaves the cursor at the end
///   of the block it hands out and [`free`](Self::free) leaves it alone, so a region freed that
///   way is reused last; [`free_hot`](Self::free_hot) moves the cursor to the lowest block
///   freed hot since the last allocation, so the next allocation of its size takes it again.
///   Callers free *hot* what no peer can still write (a scattered region, local staging):
///   reused at once, its lines are still in cache. On the 16-core GPU host a bounced 1 MiB
///   WRITE's cma write into a reused region took 120 us instead of 230, the WRITE 587-607 us
///   instead of 765-767, and a 64 MiB one 15.1-16.4 ms instead of 16.1-18.1 (BENCHMARKS.md,
///   session 17); the lowest rather than the last block freed hot took the 64 MiB WRITE from
///   18.9-20.3 to 15.7-17.1 ms (session 18), as the working set stays at the arena's start.
///   They free the rest plainly (a reclaimed flow's regions, after the scheduler's quarantine
///   that keeps them from a slow writer's late write): that does not pull the cursor to them.
///   (Next-fit was chosen on the 2-core machine, where reusing regions
///   first put medians of a 64 MiB transfer in two modes; hot reuse there measured 15.1-22.9
///   ms against next-fit's 17.0-21.2, a wider spread around a lower median.)
/// - Both operations are `O(log n)` set operations per order (at most 64 orders).
///
/// Invariants (checked by [`check_invariants`](Self::check_invariants)): free blocks and
/// allocated blocks tile the usable capacity without overlap, and no two free buddies coexist
/// (freeing everything always coalesces back into the top-level blocks).
#[derive(Debug, Clone)]
pub struct Buddy {
    /// `log2(granularity)`: block of order `k` is `1 << (shift + k)` bytes.
    shift: u32,
    usable: u64,
    /// Order of the largest (first) top-level block.
    max_order: u32,
    /// Free block offsets, indexed by order.
    free: Vec<BTreeSet<u64>>,
    /// Where the next search starts: the end of the previous allocation, or the lowest block
    /// freed hot since (next-fit).
    cursor: u64,
    /// A block was freed hot since the last allocation (so `cursor` points at one).
    hot_since_alloc: bool,
    /// Allocated block offset -> order.
    allocated: BTreeMap<u64, u32>,
    free_bytes: u64,
}

impl Buddy {
    /// An empty allocator over `capacity` bytes with minimum block `granularity` bytes.
    ///
    /// # Errors
    /// [`AllocError::BadGranularity`] unless `granularity` is a non-zero power of two;
    /// [`AllocError::CapacityTooSmall`] when `capacity < granularity`.
    pub fn new(capacity: u64, granularity: u64) -> Result<Self> {
        if !granularity.is_power_of_two() {
            return Err(AllocError::BadGranularity { granularity });
        }
        if capacity < granularity {
            return Err(AllocError::CapacityTooSmall { capacity, granularity });
        }
        let shift = granularity.trailing_zeros();
        let usable = capacity & !(granularity - 1);
        let units = usable >> shift;
        let max_order = units.ilog2();
        let mut free = vec![BTreeSet::new(); max_order as usize + 1];
        let mut offset = 0;
        for order in (0..=max_order).rev() {
            if units & (1 << order) != 0 {
                free[order as usize].insert(offset);
                offset += 1 << (shift + order);
            }
        }
        Ok(Self {
            shift,
            usable,
            max_order,
            free,
            cursor: 0,
            hot_since_alloc: false,
            allocated: BTreeMap::new(),
            free_bytes: usable,
        })
    }

    /// The minimum block size in bytes.
    pub fn granularity(&self) -> u64 {
        1 << self.shift
    }

    /// Bytes under management: the capacity rounded down to a multiple of the granularity.
    pub fn usable_capacity(&self) -> u64 {
        self.usable
    }

    /// Bytes in free blocks.
    pub fn free_bytes(&self) -> u64 {
        self.free_bytes
    }

    /// Bytes in allocated blocks (block sizes, so including the rounding slack).
    pub fn allocated_bytes(&self) -> u64 {
        self.usable - self.free_bytes
    }

    /// The largest single allocation this arena can ever satisfy (its largest top-level block):
    /// a request of up to this many bytes succeeds once everything is freed.
    pub fn largest_block(&self) -> u64 {
        self.order_len(self.max_order)
    }

    /// The largest allocation that would succeed right now (0 when the arena is full).
    pub fn largest_free(&self) -> u64 {
        (0..=self.max_order).rev().find(|&o| !self.free[o as usize].is_empty()).map_or(0, |o| self.order_len(o))
    }

    /// The block size `alloc(bytes)` would hand out, or `None` when `bytes` is 0 or larger than
    /// [`largest_block`](Self::largest_block).
    pub fn block_len(&self, bytes: u64) -> Option<u64> {
        self.order_for(bytes).map(|o| self.order_len(o))
    }

    /// Allocates a block for `bytes` bytes: `len` is `max(bytes, granularity)` rounded up to a
    /// power of two. `None` when `bytes == 0` or no free block is large enough.
    pub fn alloc(&mut self, bytes: u64) -> Option<Region> {
        let want = self.order_for(bytes)?;
        let (block, have, offset) = self.next_fit(want, self.cursor).or_else(|| self.next_fit(want, 0))?;
        self.free[have as usize].remove(&block);
        // Split down to `want`, keeping the half that holds `offset` and freeing the other
        // (its buddy) at each level.
        let mut start = block;
        for order in (want..have).rev() {
            let half = self.order_len(order);
            if offset >= start + half {
                self.free[order as usize].insert(start);
                start += half;
            } else {
                self.free[order as usize].insert(start + half);
            }
        }
        debug_assert_eq!(start, offset);
        self.cursor = offset + self.order_len(want);
        self.hot_since_alloc = false;
        self.allocated.insert(offset, want);
        let len = self.order_len(want);
        self.free_bytes -= len;
        Some(Region { offset, len })
    }

    /// The lowest position at or after `from` where a block of order `want` can be carved out
    /// of a free block: `(free block, its order, position)`. A free block that straddles
    /// `from` counts (the position is then `from` rounded up to the block size), so freeing and
    /// coalescing behind the cursor does not pull the next allocation back to offset 0.
    fn next_fit(&self, want: u32, from: u64) -> Option<(u64, u32, u64)> {
        let size = self.order_len(want);
        (want..=self.max_order)
            .filter_map(|o| {
                let set = &self.free[o as usize];
                let len = self.order_len(o);
                let straddling = set.range(..=from).next_back().and_then(|&start| {
                    let pos = from.checked_next_multiple_of(size)?;
                    (pos.checked_add(size)? <= start + len).then_some((start, o, pos))
                });
                straddling.or_else(|| set.range(from..).find(|&&start| start >= from).map(|&start| (start, o, start)))
            })
            .min_by_key(|&(_, _, pos)| pos)
    }

    /// Frees the block that starts at `offset`, coalescing it with free buddies, and returns it.
    ///
    /// # Errors
    /// [`AllocError::NotAllocated`] when `offset` is not the start of an allocated block (double
    /// free, never allocated, or inside a block); the allocator is left unchanged.
    pub fn free(&mut self, offset: u64) -> Result<Region> {
        let order = self.allocated.remove(&offset).ok_or(AllocError::NotAllocated { offset })?;
        let region = Region { offset, len: self.order_len(order) };
        self.free_bytes += region.len;
        let (mut off, mut ord) = (offset, order);
        // A buddy of the right order can only exist inside the same top-level block: top-level
        // blocks have distinct sizes and each is aligned to its size (see the type docs).
        while ord < self.max_order {
            let len = self.order_len(ord);
            if !self.free[ord as usize].remove(&(off ^ len)) {
                break;
            }
            off &= !len;
            ord += 1;
        }
        self.free[ord as usize].insert(off);
        Ok(region)
    }

    /// [`free`](Self::free), then points the cursor at the freed block, or leaves it at a
    /// lower block freed hot since the last allocation: the next allocation of its size
    /// reuses the lowest of them while its lines are still in cache, and a transfer's regions
    /// start where the previous transfer's began instead of drifting up the arena.
    ///
    /// # Errors
    /// As for [`free`](Self::free); the cursor is then left unchanged.
    pub fn free_hot(&mut self, offset: u64) -> Result<Region> {
        let region = self.free(offset)?;
        self.cursor = if self.hot_since_alloc { self.cursor.min(region.offset) } else { region.offset };
        self.hot_since_alloc = true;
        Ok(region)
    }

    /// The allocated block starting at `offset`, if there is one.
    pub fn allocated_at(&self, offset: u64) -> Option<Region> {
        self.allocated.get(&offset).map(|&o| Region { offset, len: self.order_len(o) })
    }

    /// All allocated blocks, by ascending offset.
    pub fn allocated_regions(&self) -> impl Iterator<Item = Region> + '_ {
        self.allocated.iter().map(|(&offset, &o)| Region { offset, len: self.order_len(o) })
    }

    /// All free blocks, by ascending order then offset.
    pub fn free_regions(&self) -> impl Iterator<Item = Region> + '_ {
        self.free.iter().enumerate().flat_map(move |(o, set)| {
            let len = self.order_len(o as u32);
            set.iter().map(move |&offset| Region { offset, len })
        })
    }

    /// Verifies the allocator's invariants; `Err` describes the first violation. Meant for
    /// tests, fuzzing and debug assertions (it is `O(n log n)`).
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        let mut all: Vec<(Region, bool)> = self.free_regions().map(|r| (r, true)).collect();
        all.extend(self.allocated_regions().map(|r| (r, false)));
        all.sort();
        let mut cursor = 0;
        let mut free_sum = 0;
        for &(r, is_free) in &all {
            if r.offset != cursor {
                return Err(format!("gap or overlap at {cursor:#x}: next block is {r}"));
            }
            if r.offset % r.len != 0 {
                return Err(format!("block {r} is not aligned to its size"));
            }
            cursor = r.end();
            if is_free {
                free_sum += r.len;
            }
        }
        if cursor != self.usable {
            return Err(format!("blocks cover {cursor:#x} bytes, usable is {:#x}", self.usable));
        }
        if free_sum != self.free_bytes {
            return Err(format!("free blocks sum to {free_sum}, counter says {}", self.free_bytes));
        }
        for (o, set) in self.free.iter().enumerate().take(self.max_order as usize) {
            let len = self.order_len(o as u32);
            if let Some(off) = set.iter().find(|&&off| set.contains(&(off ^ len))) {
                return Err(format!("free buddies not coalesced at {off:#x} (order {o})"));
            }
        }
        Ok(())
    }

    fn order_len(&self, order: u32) -> u64 {
        1 << (self.shift + order)
    }

    fn order_for(&self, bytes: u64) -> Option<u32> {
        if bytes == 0 {
            return None;
        }
        let len = bytes.max(self.granularity()).checked_next_power_of_two()?;
        let order = len.trailing_zeros() - self.shift;
        (order <= self.max_order).then_some(order)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use proptest::prelude::*;

    use super::*;

    const G: u64 = 4096;

    fn r(offset: u64, len: u64) -> Region {
        Region { offset, len }
    }

    /// A naive reference model: one bit per granularity unit. It allocates the lowest aligned
    /// run of free units of the buddy block size, which is exactly the set of placements a
    /// buddy allocator may choose from, so it doubles as a checker for [`Buddy`]'s choices.
    #[derive(Debug)]
    struct Bitmap {
        g: u64,
        used: Vec<bool>,
        live: BTreeMap<u64, u64>,
    }

    impl Bitmap {
        fn block_len(&self, bytes: u64) -> Option<u64> {
            let len = bytes.max(self.g).checked_next_power_of_two()?;
            (bytes != 0 && len <= self.largest_block()).then_some(len)
        }

        fn largest_block(&self) -> u64 {
            let units = self.used.len() as u64;
            self.g << units.ilog2()
        }

        fn is_free(&self, region: Region) -> bool {
            let (a, b) = ((region.offset / self.g) as usize, (region.end() / self.g) as usize);
            region.offset % region.len == 0 && b <= self.used.len() && self.used[a..b].iter().all(|u| !u)
        }

        /// The lowest free aligned block of `len` bytes. Every aligned block that lies inside
        /// the usable capacity lies inside one top-level block, so this is "a buddy block
        /// exists".
        fn find(&self, len: u64) -> Option<Region> {
            let usable = self.used.len() as u64 * self.g;
            (0..usable / len).map(|i| r(i * len, len)).find(|&c| self.is_free(c))
        }

        fn set(&mut self, region: Region, used: bool) {
            let (a, b) = ((region.offset / self.g) as usize, (region.end() / self.g) as usize);
            self.used[a..b].iter_mut().for_each(|u| *u = used);
        }

        fn claim(&mut self, region: Region) {
            assert!(self.is_free(region), "{region} is not a free aligned block");
            self.set(region, true);
            self.live.insert(region.offset, region.len);
        }
    }

    /// The operations the shared suite needs, implemented by [`Buddy`] and by the [`Bitmap`]
    /// model so that one macro-generated suite runs over both (quinn range_set/tests.rs style).
    trait Allocator: Sized {
        fn make(capacity: u64, granularity: u64) -> Self;
        fn alloc(&mut self, bytes: u64) -> Option<Region>;
        fn free(&mut self, offset: u64) -> Result<Region>;
        fn free_bytes(&self) -> u64;
        fn allocated_bytes(&self) -> u64;
        fn usable(&self) -> u64;
        fn largest_free(&self) -> u64;
    }

    impl Allocator for Buddy {
        fn make(capacity: u64, granularity: u64) -> Self {
            Self::new(capacity, granularity).unwrap()
        }
        fn alloc(&mut self, bytes: u64) -> Option<Region> {
            let got = Self::alloc(self, bytes);
            self.check_invariants().unwrap();
            got
        }
        fn free(&mut self, offset: u64) -> Result<Region> {
            let got = Self::free(self, offset);
            self.check_invariants().unwrap();
            got
        }
        fn free_bytes(&self) -> u64 {
            Self::free_bytes(self)
        }
        fn allocated_bytes(&self) -> u64 {
            Self::allocated_bytes(self)
        }
        fn usable(&self) -> u64 {
            self.usable_capacity()
        }
        fn largest_free(&self) -> u64 {
            Self::largest_free(self)
        }
    }

    impl Allocator for Bitmap {
        fn make(capacity: u64, granularity: u64) -> Self {
            let units = (capacity / granularity) as usize;
            Self { g: granularity, used: vec![false; units], live: BTreeMap::new() }
        }
        fn alloc(&mut self, bytes: u64) -> Option<Region> {
            let region = self.find(self.block_len(bytes)?)?;
            self.claim(region);
            Some(region)
        }
        fn free(&mut self, offset: u64) -> Result<Region> {
            let len = self.live.remove(&offset).ok_or(AllocError::NotAllocated { offset })?;
            self.set(r(offset, len), false);
            Ok(r(offset, len))
        }
        fn free_bytes(&self) -> u64 {
            self.used.iter().filter(|u| !**u).count() as u64 * self.g
        }
        fn allocated_bytes(&self) -> u64 {
            self.live.values().sum()
        }
        fn usable(&self) -> u64 {
            self.used.len() as u64 * self.g
        }
        fn largest_free(&self) -> u64 {
            let mut len = Self::largest_block(self);
            while len >= self.g {
                if self.find(len).is_some() {
                    return len;
                }
                len /= 2;
            }
            0
        }
    }

    #[derive(Debug, Clone)]
    enum Op {
        Alloc(u64),
        /// Frees the live allocation at this index (modulo the live count).
        Free(usize),
        /// Frees an offset that may or may not be allocated.
        FreeRaw(u64),
    }

    fn ops(g: u64, max_bytes: u64) -> impl Strategy<Value = Vec<Op>> {
        let op = prop_oneof![
            5 => (0..=max_bytes).prop_map(Op::Alloc),
            4 => any::<usize>().prop_map(Op::Free),
            1 => (0..max_bytes / g + 2).prop_map(move |u| Op::FreeRaw(u * g / 2)),
        ];
        prop::collection::vec(op, 0..120)
    }

    /// A geometry: (granularity, capacity), capacity often not a power of two nor a multiple
    /// of the granularity.
    fn geometry() -> impl Strategy<Value = (u64, u64)> {
        (0u32..4, 1u64..40, 0u64..8).prop_map(|(s, units, extra)| {
            let g = 1u64 << s;
            (g, units * g + extra % g)
        })
    }

    macro_rules! allocator_suite {
        ($name:ident, $ty:ty) => {
            mod $name {
                use super::*;

                fn make(capacity: u64) -> $ty {
                    <$ty as Allocator>::make(capacity, G)
                }

                #[test]
                fn blocks_are_rounded_up_to_a_power_of_two_of_at_least_the_granularity() {
                    let mut a = make(64 * G);
                    assert_eq!(a.alloc(1).unwrap().len, G);
                    assert_eq!(a.alloc(G).unwrap().len, G);
                    assert_eq!(a.alloc(G + 1).unwrap().len, 2 * G);
                    assert_eq!(a.alloc(5 * G).unwrap().len, 8 * G);
                    assert_eq!(a.allocated_bytes(), 12 * G);
                    assert_eq!(a.free_bytes() + a.allocated_bytes(), a.usable());
                }

                #[test]
                fn zero_bytes_is_never_allocated() {
                    let mut a = make(4 * G);
                    assert_eq!(a.alloc(0), None);
                    assert_eq!(a.free_bytes(), 4 * G);
                }

                #[test]
                fn exact_capacity_fits_once_and_capacity_plus_one_never() {
                    let mut a = make(8 * G);
                    assert_eq!(a.alloc(8 * G + 1), None);
                    assert_eq!(a.alloc(8 * G), Some(r(0, 8 * G)));
                    assert_eq!(a.alloc(1), None);
                    assert_eq!(a.largest_free(), 0);
                    assert_eq!(a.free(0), Ok(r(0, 8 * G)));
                    assert_eq!(a.largest_free(), 8 * G);
                }

                #[test]
                fn exhausts_after_capacity_over_granularity_minimum_blocks() {
                    let mut a = make(16 * G);
                    let got: Vec<_> = (0..16).map(|_| a.alloc(G).unwrap()).collect();
                    assert_eq!(a.alloc(1), None);
                    let mut offsets: Vec<_> = got.iter().map(|r| r.offset).collect();
                    offsets.sort_unstable();
                    assert_eq!(offsets, (0..16).map(|i| i * G).collect::<Vec<_>>());
                }

                #[test]
                fn non_power_of_two_capacity_is_covered_by_its_binary_decomposition() {
                    // 7.5 units: usable 7 units = 4 + 2 + 1.
                    let mut a = <$ty as Allocator>::make(7 * G + G / 2, G);
                    assert_eq!(a.usable(), 7 * G);
                    assert_eq!(a.largest_block(), 4 * G);
                    assert_eq!(a.alloc(5 * G), None, "no 8-unit block exists");
                    let big = a.alloc(4 * G).unwrap();
                    let mid = a.alloc(2 * G).unwrap();
                    let small = a.alloc(G).unwrap();
                    assert_eq!(a.alloc(1), None);
                    for x in [big, mid, small] {
                        assert_eq!(x.offset % x.len, 0, "{x} is aligned");
                        a.free(x.offset).unwrap();
                    }
                    assert_eq!(a.largest_free(), 4 * G);
                    assert_eq!(a.free_bytes(), 7 * G);
                }

                #[test]
                fn double_free_and_unknown_offsets_are_errors() {
                    let mut a = make(8 * G);
                    let x = a.alloc(2 * G).unwrap();
                    assert_eq!(a.free(x.offset + G), Err(AllocError::NotAllocated { offset: x.offset + G }));
                    assert_eq!(a.free(x.offset), Ok(x));
                    assert_eq!(a.free(x.offset), Err(AllocError::NotAllocated { offset: x.offset }));
                    assert_eq!(a.free(1 << 40), Err(AllocError::NotAllocated { offset: 1 << 40 }));
                    assert_eq!(a.free_bytes(), 8 * G);
                }

                #[test]
                fn fragmentation_then_full_coalesce_back_to_one_block() {
                    let mut a = make(32 * G);
                    let all: Vec<_> = (0..32).map(|_| a.alloc(G).unwrap()).collect();
                    // Free every other unit: half the arena is free but no 2-unit block is.
                    for x in all.iter().filter(|x| (x.offset / G) % 2 == 0) {
                        a.free(x.offset).unwrap();
                    }
                    assert_eq!(a.free_bytes(), 16 * G);
                    assert_eq!(a.largest_free(), G);
                    assert_eq!(a.alloc(2 * G), None);
                    for x in all.iter().filter(|x| (x.offset / G) % 2 == 1) {
                        a.free(x.offset).unwrap();
                    }
                    assert_eq!(a.largest_free(), 32 * G);
                    assert_eq!(a.alloc(32 * G), Some(r(0, 32 * G)));
                }

                proptest! {
                    #![proptest_config(ProptestConfig::with_cases(64))]

                    #[test]
                    fn random_ops_conserve_bytes_never_overlap_and_fully_coalesce(
                        (g, capacity) in geometry(),
                        ops in ops(1, 48),
                    ) {
                        let mut a = <$ty as Allocator>::make(capacity, g);
                        let mut live: BTreeMap<u64, Region> = BTreeMap::new();
                        for op in ops {
                            match op {
                                Op::Alloc(bytes) => if let Some(x) = a.alloc(bytes) {
                                    prop_assert!(x.len >= bytes.max(g) && x.len.is_power_of_two());
                                    prop_assert_eq!(x.offset % x.len, 0);
                                    prop_assert!(x.end() <= a.usable());
                                    let before = live.range(..x.offset).next_back();
                                    prop_assert!(before.is_none_or(|(_, b)| b.end() <= x.offset));
                                    let after = live.range(x.offset..).next();
                                    prop_assert!(after.is_none_or(|(_, n)| x.end() <= n.offset));
                                    live.insert(x.offset, x);
                                },
                                Op::Free(i) if !live.is_empty() => {
                                    let off = *live.keys().nth(i % live.len()).unwrap();
                                    prop_assert_eq!(a.free(off), Ok(live.remove(&off).unwrap()));
                                }
                                Op::Free(_) => {}
                                Op::FreeRaw(off) => {
                                    let expect = live.remove(&off).ok_or(AllocError::NotAllocated { offset: off });
                                    prop_assert_eq!(a.free(off), expect);
                                }
                            }
                            let held: u64 = live.values().map(|x| x.len).sum();
                            prop_assert_eq!(a.allocated_bytes(), held);
                            prop_assert_eq!(a.free_bytes() + a.allocated_bytes(), a.usable());
                        }
                        for off in live.keys() {
                            a.free(*off).unwrap();
                        }
                        prop_assert_eq!(a.free_bytes(), a.usable());
                        prop_assert_eq!(a.largest_free(), a.largest_block());
                    }
                }
            }
        };
    }

    allocator_suite!(buddy_suite, Buddy);
    allocator_suite!(bitmap_model_suite, Bitmap);

    #[test]
    fn construction_rejects_bad_geometry() {
        assert_eq!(Buddy::new(G, 0).unwrap_err(), AllocError::BadGranularity { granularity: 0 });
        assert_eq!(Buddy::new(G, 3000).unwrap_err(), AllocError::BadGranularity { granularity: 3000 });
        assert_eq!(Buddy::new(G - 1, G).unwrap_err(), AllocError::CapacityTooSmall { capacity: G - 1, granularity: G });
        let b = Buddy::new(u64::MAX, 1).unwrap();
        assert_eq!(b.largest_block(), 1 << 63);
        assert_eq!(b.block_len(u64::MAX), None, "next power of two overflows");
    }

    #[test]
    fn top_level_blocks_are_the_binary_decomposition_largest_first() {
        let b = Buddy::new(13 * G + 17, G).unwrap();
        let mut tops: Vec<_> = b.free_regions().collect();
        tops.sort();
        assert_eq!(tops, vec![r(0, 8 * G), r(8 * G, 4 * G), r(12 * G, G)]);
        assert_eq!(b.largest_block(), 8 * G);
        assert_eq!(b.block_len(8 * G), Some(8 * G));
        assert_eq!(b.block_len(8 * G + 1), None);
    }

    #[test]
    fn a_freed_region_is_reused_last_not_first() {
        let mut b = Buddy::new(16 * 4096, 4096).unwrap();
        let first = b.alloc(4096).unwrap();
        b.free(first.offset).unwrap();
        // Free again and mergeable, but the search continues after it.
        let offsets: Vec<u64> = (0..4).map(|_| b.alloc(4096).unwrap().offset).collect();
        assert_eq!(offsets, [4096, 2 * 4096, 3 * 4096, 4 * 4096]);
        for off in offsets {
            b.free(off).unwrap();
        }
        b.check_invariants().unwrap();
        assert_eq!(b.free_bytes(), 16 * 4096);
    }

    #[test]
    fn a_region_freed_hot_is_reused_first_and_a_plain_free_after_it_still_last() {
        let mut b = Buddy::new(16 * 4096, 4096).unwrap();
        let regions: Vec<Region> = (0..4).map(|_| b.alloc(4096).unwrap()).collect();
        b.free_hot(regions[1].offset).unwrap();
        assert_eq!(b.alloc(4096), Some(regions[1]), "the hot region comes back at once");
        // The sweep goes on after it: the plainly freed region 0 is not next.
        b.free(regions[0].offset).unwrap();
        assert_eq!(b.alloc(4096), Some(r(4 * 4096, 4096)));
        // A hot free of a block whose buddy is free coalesces as any free does; the next
        // allocation of its size still lands on it, and a larger one does not go back.
        b.free_hot(regions[1].offset).unwrap();
        assert_eq!(b.alloc(4096), Some(regions[1]));
        b.free_hot(regions[1].offset).unwrap();
        assert_eq!(b.alloc(2 * 4096), Some(r(6 * 4096, 2 * 4096)));
        assert_eq!(b.free_hot(3 * 4096 + 1), Err(AllocError::NotAllocated { offset: 3 * 4096 + 1 }));
        b.check_invariants().unwrap();
    }

    #[test]
    fn of_several_regions_freed_hot_the_lowest_comes_back_first_until_the_next_allocation() {
        let mut b = Buddy::new(16 * 4096, 4096).unwrap();
        let regions: Vec<Region> = (0..6).map(|_| b.alloc(4096).unwrap()).collect();
        // A transfer's chunks are acknowledged out of order: 4, then 2, then 3.
        for i in [4, 2, 3] {
            b.free_hot(regions[i].offset).unwrap();
        }
        let next: Vec<Region> = (0..3).map(|_| b.alloc(4096).unwrap()).collect();
        assert_eq!(next, [regions[2], regions[3], regions[4]], "from the lowest, then on up");
        // After an allocation the next hot free points the cursor again, higher or not.
        b.free_hot(regions[5].offset).unwrap();
        b.free_hot(regions[4].offset).unwrap();
        assert_eq!(b.alloc(4096), Some(regions[4]));
        b.free_hot(regions[0].offset).unwrap();
        assert_eq!(b.alloc(4096), Some(regions[0]), "the first hot free after an allocation moves the cursor");
        b.check_invariants().unwrap();
    }

    #[test]
    fn alloc_splits_the_smallest_fitting_block_and_keeps_the_lower_half() {
        let mut b = Buddy::new(8 * G, G).unwrap();
        assert_eq!(b.alloc(G), Some(r(0, G)));
        let mut free: Vec<_> = b.free_regions().collect();
        free.sort();
        assert_eq!(free, vec![r(G, G), r(2 * G, 2 * G), r(4 * G, 4 * G)]);
        // Best fit: the 1-unit buddy, then the 2-unit block, before splitting the 4-unit one.
        assert_eq!(b.alloc(G), Some(r(G, G)));
        assert_eq!(b.alloc(2 * G), Some(r(2 * G, 2 * G)));
        assert_eq!(b.alloc(G), Some(r(4 * G, G)));
        assert_eq!(b.allocated_at(4 * G), Some(r(4 * G, G)));
        assert_eq!(b.allocated_at(5 * G), None);
    }

    #[test]
    fn free_coalesces_buddies_up_to_the_top_level_block() {
        let mut b = Buddy::new(8 * G, G).unwrap();
        let x: Vec<_> = (0..4).map(|_| b.alloc(G).unwrap()).collect();
        b.free(x[0].offset).unwrap();
        b.free(x[2].offset).unwrap();
        assert_eq!(b.largest_free(), 4 * G, "only the untouched upper half is whole");
        b.free(x[1].offset).unwrap();
        assert_eq!(b.free_regions().filter(|f| f.len == 2 * G).count(), 1, "units 0+1 merged");
        b.free(x[3].offset).unwrap();
        assert_eq!(b.free_regions().collect::<Vec<_>>(), vec![r(0, 8 * G)]);
        b.check_invariants().unwrap();
    }

    #[test]
    fn top_level_blocks_of_an_odd_capacity_never_merge() {
        let mut b = Buddy::new(3 * G, G).unwrap();
        let x = b.alloc(2 * G).unwrap();
        let y = b.alloc(G).unwrap();
        assert_eq!((x, y), (r(0, 2 * G), r(2 * G, G)));
        b.free(y.offset).unwrap();
        b.free(x.offset).unwrap();
        assert_eq!(b.largest_free(), 2 * G);
        assert_eq!(b.alloc(3 * G), None);
        b.check_invariants().unwrap();
    }

    #[derive(Debug, Clone)]
    enum DiffOp {
        Alloc(u64),
        Free(usize),
        FreeHot(usize),
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(128))]

        /// Differential check against the bitmap model. Placement may differ from the model's
        /// own policy, so the model follows the buddy's choices and judges them: every block the
        /// buddy hands out must be a free aligned block of the right size, and the buddy may
        /// say `None` only when no such block exists anywhere (no missed allocations, which
        /// holds because a fully coalesced buddy tree keeps every all-free aligned block whole).
        #[test]
        fn buddy_agrees_with_the_bitmap_model(
            (g, capacity) in geometry(),
            ops in prop::collection::vec(prop_oneof![
                3 => (0u64..48).prop_map(DiffOp::Alloc),
                1 => any::<usize>().prop_map(DiffOp::Free),
                1 => any::<usize>().prop_map(DiffOp::FreeHot),
            ], 0..150),
        ) {
            let mut buddy = Buddy::new(capacity, g).unwrap();
            let mut model = <Bitmap as Allocator>::make(capacity, g);
            prop_assert_eq!(buddy.usable_capacity(), Allocator::usable(&model));
            prop_assert_eq!(buddy.largest_block(), model.largest_block());
            for op in ops {
                match op {
                    DiffOp::Alloc(bytes) => {
                        let len = model.block_len(bytes);
                        prop_assert_eq!(buddy.block_len(bytes), len);
                        match buddy.alloc(bytes) {
                            Some(x) => {
                                prop_assert_eq!(Some(x.len), len);
                                prop_assert!(model.is_free(x), "{} overlaps or is misaligned", x);
                                model.claim(x);
                            }
                            None => prop_assert!(
                                len.is_none_or(|l| model.find(l).is_none()),
                                "buddy refused {} bytes but the model has a free block", bytes
                            ),
                        }
                    }
                    DiffOp::Free(i) if !model.live.is_empty() => {
                        let off = *model.live.keys().nth(i % model.live.len()).unwrap();
                        prop_assert_eq!(buddy.free(off), Allocator::free(&mut model, off));
                    }
                    DiffOp::FreeHot(i) if !model.live.is_empty() => {
                        let off = *model.live.keys().nth(i % model.live.len()).unwrap();
                        prop_assert_eq!(buddy.free_hot(off), Allocator::free(&mut model, off));
                    }
                    DiffOp::Free(_) | DiffOp::FreeHot(_) => {}
                }
                prop_assert_eq!(buddy.free_bytes(), Allocator::free_bytes(&model));
                prop_assert_eq!(buddy.largest_free(), Allocator::largest_free(&model));
                buddy.check_invariants().map_err(TestCaseError::fail)?;
            }
            let live: Vec<u64> = model.live.keys().copied().collect();
            for off in live {
                buddy.free(off).unwrap();
            }
            let mut tops: Vec<_> = buddy.free_regions().collect();
            tops.sort();
            let fresh = Buddy::new(capacity, g).unwrap();
            let mut want: Vec<_> = fresh.free_regions().collect();
            want.sort();
            prop_assert_eq!(tops, want, "freeing everything restores the top-level blocks");
        }
    }
}
