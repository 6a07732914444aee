//! Region plans: a chunk's scatter runs in fixed-width form, written by the sender into the
//! chunk's region right behind its data, so that one RDMA write carries both and the receiver's
//! copy engine reads them from its own arena: no PLAN frame to encode on the sender's reactor,
//! none to decode on the receiver's (issue 11: ~0.3 ms of a 16384 x 4 KiB VRAM transfer went to
//! varint-coding ~5,000 runs per chunk on both reactors).
//!
//! The form is the one the CUDA kernels read (`kernels/gather_scatter.cu`, `PlanRun`), so a GPU
//! receiver copies it once into private memory, checks it there with a kernel and scatters by
//! it with no host work per run:
//!
//! ```text
//! n records of 48 bytes, little-endian:
//!   region_off u64 | addr u64 | len u64 | region_stride u64 | addr_stride u64 | count u32 | tiles_per_piece u32
//! then n + 1 u64 `first_tile` prefix sums: first_tile[0] = 0,
//!   first_tile[r + 1] = first_tile[r] + count_r * tiles_per_piece_r
//! ```
//!
//! `tiles_per_piece` is `ceil(len / TILE)`; it and the prefix sums are redundant with the runs
//! and must match them exactly: the kernels split work by them. A DATA names the run count; the
//! plan ends where the chunk's region ends, and the runs may read only the bytes before it.
//!
//! The bytes come from the peer's write into our arena and are hostile: [`check`] is the
//! receiver's whole validation, and the CUDA check kernel implements the same predicate.

use crate::types::CopyRun;

/// Bytes per tile: the unit one GPU warp copies. Must equal `BOUNCE_TILE` in
/// `kernels/gather_scatter.cu`.
pub const TILE: u64 = 4096;

/// Bytes per run record.
pub const RECORD_BYTES: u64 = 48;

/// Bytes a plan of `runs` runs takes: the records, then `runs + 1` prefix sums.
pub const fn plan_bytes(runs: u32) -> u64 {
    RECORD_BYTES * runs as u64 + 8 * (runs as u64 + 1)
}

/// Why a region plan was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RegionPlanFault {
    /// The plan would not lie inside the region behind the data (or names no runs).
    #[error("the plan of {runs} runs does not fit its region")]
    Misplaced {
        /// Runs the DATA named.
        runs: u32,
    },
    /// Run `index` copies nothing, its spans overflow, or its tile count is not its length's.
    #[error("run {index} is malformed")]
    BadRun {
        /// Position of the run.
        index: usize,
    },
    /// Run `index` reads beyond the chunk's data.
    #[error("run {index} reads beyond the chunk's data")]
    OutsideChunk {
        /// Position of the run.
        index: usize,
    },
    /// Run `index` writes outside every range the flow may write.
    #[error("run {index} writes outside the flow's registrations")]
    OutsideRegistered {
        /// Position of the run.
        index: usize,
    },
    /// The prefix sum before run `index` is not the sum of the runs' tiles before it.
    #[error("tile prefix {index} is inconsistent")]
    BadPrefix {
        /// Position of the prefix sum.
        index: usize,
    },
    /// The runs copy more bytes in total than the chunk's data holds.
    #[error("the runs copy more bytes than the chunk holds")]
    TooManyBytes,
}

/// Where a plan of `runs` runs starts in a region of `region_len` bytes: its last bytes. `None`
/// when it would not fit, names no runs, or would leave the data misaligned for the records.
pub fn plan_offset(region_len: u64, runs: u32) -> Option<u64> {
    if runs == 0 {
        return None;
    }
    let off = region_len.checked_sub(plan_bytes(runs))?;
    (off % 8 == 0).then_some(off)
}

/// Tiles of one piece of `len` bytes.
fn tiles_per_piece(len: u64) -> Option<u32> {
    u32::try_from(len.div_ceil(TILE)).ok()
}

/// Writes the plan of `runs` into `out`, which must be exactly [`plan_bytes`] long. `None`
/// when a run cannot be expressed (a piece of 2^44 bytes or more, a tile count overflow):
/// the sender then keeps the plan out of the region.
pub fn encode(runs: &[CopyRun], out: &mut [u8]) -> Option<()> {
    let n = u32::try_from(runs.len()).ok()?;
    if out.len() as u64 != plan_bytes(n) {
        return None;
    }
    let (records, prefixes) = out.split_at_mut(runs.len() * RECORD_BYTES as usize);
    let mut tiles = 0u64;
    prefixes[..8].copy_from_slice(&0u64.to_le_bytes());
    // Fixed-size slices zipped with the runs: no bounds check per field.
    for ((r, rec), prefix) in
        runs.iter().zip(records.chunks_exact_mut(RECORD_BYTES as usize)).zip(prefixes[8..].chunks_exact_mut(8))
    {
        let tpp = tiles_per_piece(r.len)?;
        tiles = u64::from(tpp).checked_mul(u64::from(r.count))?.checked_add(tiles)?;
        let (words, tail) = rec.split_at_mut(40);
        for (w, v) in words.chunks_exact_mut(8).zip([r.region_off, r.addr, r.len, r.region_stride, r.addr_stride]) {
            w.copy_from_slice(&v.to_le_bytes());
        }
        tail[..4].copy_from_slice(&r.count.to_le_bytes());
        tail[4..].copy_from_slice(&tpp.to_le_bytes());
        prefix.copy_from_slice(&tiles.to_le_bytes());
    }
    Some(())
}

/// The plan of `runs`, encoded (see [`encode`]).
pub fn encoded(runs: &[CopyRun]) -> Option<Vec<u8>> {
    let mut out = vec![0; usize::try_from(plan_bytes(u32::try_from(runs.len()).ok()?)).ok()?];
    encode(runs, &mut out)?;
    Some(out)
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut w = [0; 8];
    w.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(w)
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut w = [0; 4];
    w.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(w)
}

/// Decodes and checks the plan `bytes` (a private copy of the region's last
/// [`plan_bytes`]`(runs)` bytes: the peer may write the region meanwhile) for a chunk whose
/// data is the region's first `limit` bytes: every run copies something, reads inside
/// `[0, limit)`, writes inside one range `covers` accepts, the tile counts and prefix sums are
/// exactly the runs', and all runs together copy at most `limit` bytes. Returns the runs.
pub fn check(
    bytes: &[u8],
    runs: u32,
    limit: u64,
    covers: impl Fn(u64, u64) -> bool,
) -> Result<Vec<CopyRun>, RegionPlanFault> {
    let n = runs as usize;
    if runs == 0 || bytes.len() as u64 != plan_bytes(runs) {
        return Err(RegionPlanFault::Misplaced { runs });
    }
    let (records, prefixes) = bytes.split_at(n * RECORD_BYTES as usize);
    if u64_at(prefixes, 0) != 0 {
        return Err(RegionPlanFault::BadPrefix { index: 0 });
    }
    let mut out = Vec::with_capacity(n);
    let (mut tiles, mut copies) = (0u64, 0u64);
    for (index, rec) in records.chunks_exact(RECORD_BYTES as usize).enumerate() {
        let run = CopyRun {
            region_off: u64_at(rec, 0),
            addr: u64_at(rec, 8),
            len: u64_at(rec, 16),
            region_stride: u64_at(rec, 24),
            addr_stride: u64_at(rec, 32),
            count: u32_at(rec, 40),
        };
        let tpp = u32_at(rec, 44);
        let bad = RegionPlanFault::BadRun { index };
        if run.len == 0 || tiles_per_piece(run.len) != Some(tpp) {
            return Err(bad);
        }
        let (Some((_, region_end)), Some((start, end)), Some(bytes)) =
            (run.region_span(), run.addr_span(), run.bytes())
        else {
            return Err(bad);
        };
        if region_end > limit {
            return Err(RegionPlanFault::OutsideChunk { index });
        }
        if !covers(start, end) {
            return Err(RegionPlanFault::OutsideRegistered { index });
        }
        // Each term is at most `limit` here or refused, so the sum cannot wrap before it fails.
        copies = copies.checked_add(bytes).filter(|&c| c <= limit).ok_or(RegionPlanFault::TooManyBytes)?;
        tiles = u64::from(tpp)
            .checked_mul(u64::from(run.count))
            .and_then(|t| t.checked_add(tiles))
            .ok_or(RegionPlanFault::BadRun { index })?;
        if u64_at(prefixes, (index + 1) * 8) != tiles {
            return Err(RegionPlanFault::BadPrefix { index: index + 1 });
        }
        out.push(run);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn run(region_off: u64, addr: u64, len: u64, count: u32, region_stride: u64, addr_stride: u64) -> CopyRun {
        CopyRun { region_off, addr, len, count, region_stride, addr_stride }
    }

    /// Two runs inside a 64 KiB chunk writing into [1 MiB, 2 MiB).
    fn honest() -> Vec<CopyRun> {
        vec![run(0, 1 << 20, 4096, 4, 4096, 8192), run(16384, (1 << 20) + 65536, 100, 1, 0, 0)]
    }

    fn covers_mib(a: u64, b: u64) -> bool {
        (1 << 20) <= a && b <= 2 << 20
    }

    #[test]
    fn an_honest_plan_round_trips_and_its_offset_is_the_regions_end() {
        let runs = honest();
        let bytes = encoded(&runs).unwrap();
        assert_eq!(bytes.len() as u64, plan_bytes(2));
        assert_eq!(check(&bytes, 2, 65536, covers_mib), Ok(runs));
        assert_eq!(plan_offset(65536 + plan_bytes(2), 2), Some(65536));
        assert_eq!(plan_offset(plan_bytes(2) - 1, 2), None, "does not fit");
        assert_eq!(plan_offset(65537 + plan_bytes(2), 2), None, "misaligned records");
        assert_eq!(plan_offset(4096, 0), None, "no runs");
    }

    /// The honest runs after `edit`, encoded with tile counts and prefixes that match the edited
    /// runs, so each case breaks exactly the rule its edit breaks.
    fn forged(edit: impl Fn(&mut Vec<CopyRun>)) -> Vec<u8> {
        let mut runs = honest();
        edit(&mut runs);
        // Encode with tile counts computed from the edited runs; a run the encoder cannot
        // express is written field by field.
        encoded(&runs).unwrap_or_else(|| {
            let mut b = vec![0; plan_bytes(runs.len() as u32) as usize];
            for (r, rec) in runs.iter().zip(b.chunks_exact_mut(48)) {
                for (i, v) in [r.region_off, r.addr, r.len, r.region_stride, r.addr_stride].into_iter().enumerate() {
                    rec[i * 8..i * 8 + 8].copy_from_slice(&v.to_le_bytes());
                }
                rec[40..44].copy_from_slice(&r.count.to_le_bytes());
            }
            b
        })
    }

    #[test]
    fn each_broken_rule_is_refused_with_its_fault() {
        let limit = 65536;
        let cases: Vec<(&str, Vec<u8>, RegionPlanFault)> = vec![
            (
                "one byte past the registration",
                forged(|r| r[1].addr = (2 << 20) - 99),
                RegionPlanFault::OutsideRegistered { index: 1 },
            ),
            (
                "one byte past the data",
                forged(|r| r[1].region_off = limit - 99),
                RegionPlanFault::OutsideChunk { index: 1 },
            ),
            ("count 0", forged(|r| r[0].count = 0), RegionPlanFault::BadRun { index: 0 }),
            ("length 0", forged(|r| r[1].len = 0), RegionPlanFault::BadRun { index: 1 }),
            (
                "overflowing stride",
                forged(|r| {
                    r[0].addr_stride = u64::MAX / 2;
                }),
                RegionPlanFault::BadRun { index: 0 },
            ),
            (
                "zero stride, many copies of one piece",
                forged(|r| {
                    r[0].count = 1000;
                    r[0].region_stride = 0;
                    r[0].addr_stride = 0;
                }),
                RegionPlanFault::TooManyBytes,
            ),
        ];
        for (what, bytes, fault) in cases {
            assert_eq!(check(&bytes, 2, limit, covers_mib), Err(fault), "{what}");
        }
        let honest = encoded(&honest()).unwrap();
        let mut tpp = honest.clone();
        tpp[44] += 1;
        assert_eq!(check(&tpp, 2, limit, covers_mib), Err(RegionPlanFault::BadRun { index: 0 }));
        let mut prefix = honest.clone();
        let p = 96 + 8;
        prefix[p] ^= 1;
        assert_eq!(check(&prefix, 2, limit, covers_mib), Err(RegionPlanFault::BadPrefix { index: 1 }));
        let mut first = honest.clone();
        first[96] = 1;
        assert_eq!(check(&first, 2, limit, covers_mib), Err(RegionPlanFault::BadPrefix { index: 0 }));
        assert_eq!(check(&honest, 2, limit, |_, _| false), Err(RegionPlanFault::OutsideRegistered { index: 0 }));
        assert_eq!(check(&honest[1..], 2, limit, covers_mib), Err(RegionPlanFault::Misplaced { runs: 2 }));
        assert_eq!(check(&[0; 8], 0, limit, covers_mib), Err(RegionPlanFault::Misplaced { runs: 0 }));
    }

    fn arb_run() -> impl Strategy<Value = CopyRun> {
        (0u64..1 << 16, 0u64..1 << 24, 1u64..10_000, 1u32..8, 0u64..20_000, 0u64..20_000)
            .prop_map(|(o, a, l, c, rs, as_)| run(o, a, l, c, rs, as_))
    }

    proptest! {
        /// Whatever the bytes, `check` never panics, and what it accepts obeys every rule.
        #[test]
        fn accepted_plans_obey_every_rule(bytes in proptest::collection::vec(any::<u8>(), 0..400), runs in 0u32..6, limit in 0u64..1 << 20) {
            if let Ok(out) = check(&bytes, runs, limit, |a, b| a < b && b <= 1 << 40) {
                let total: u64 = out.iter().map(|r| r.bytes().unwrap()).sum();
                prop_assert!(total <= limit);
                for r in &out {
                    prop_assert!(r.region_span().unwrap().1 <= limit);
                }
            }
        }

        /// Honest runs always encode and check back to themselves when the chunk holds them.
        #[test]
        fn honest_runs_round_trip(runs in proptest::collection::vec(arb_run(), 1..20)) {
            let limit = runs.iter().map(|r| r.region_span().unwrap().1).max().unwrap()
                .max(runs.iter().map(|r| r.bytes().unwrap()).sum());
            let bytes = encoded(&runs).unwrap();
            prop_assert_eq!(check(&bytes, runs.len() as u32, limit, |_, _| true), Ok(runs.clone()));
            if limit > 0 {
                prop_assert!(check(&bytes, runs.len() as u32, limit - 1, |_, _| true).is_err(), "one byte less refuses");
            }
        }
    }
}
