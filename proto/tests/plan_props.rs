//! The planner's output, checked interval by interval against its input, over inputs the
//! in-crate property test leaves out: region plans behind a chunk's data, segments, pieces at
//! the top of the address space, lengths up to 2^46 and alignments up to 2^46 (the in-crate
//! test keeps small values, one segment and no region plans). Every chunk must be within
//! `max_chunk` with its region plan, its gather and scatter runs must cover the same region
//! bytes and pair them byte for byte, no run may cross a segment, a region plan must sit where
//! the receiver looks for it and pass the receiver's own check, and the moved bytes must be
//! exactly the input's.

use bounce_proto::CopyRun;
use bounce_proto::plan::{DescPair, Plan, PlanParams, pair_runs, plan, plan_segmented};
use bounce_proto::wire::region_plan::{check, encoded, plan_bytes, plan_offset};
use proptest::prelude::*;

fn d(src: u64, dst: u64, len: u64) -> DescPair {
    DescPair { src, dst, len }
}

/// Canonical form of a src->dst map given as (src, dst, len) intervals with disjoint sources:
/// sorted by source, maximal contiguous (both sides) intervals coalesced.
fn canon(mut v: Vec<(u64, u64, u64)>) -> Vec<(u64, u64, u64)> {
    v.retain(|t| t.2 > 0);
    v.sort_unstable();
    let mut out: Vec<(u64, u64, u64)> = Vec::new();
    for (s, t, l) in v {
        if let Some(last) = out.last_mut() {
            if last.0.checked_add(last.2) == Some(s) && last.1.checked_add(last.2) == Some(t) {
                last.2 += l;
                continue;
            }
        }
        out.push((s, t, l));
    }
    out
}

/// Seg of the input descriptor holding source byte `a` (sources are disjoint).
fn seg_of(descs: &[DescPair], segs: &[u32], a: u64) -> Option<u32> {
    descs.iter().zip(segs).find(|(x, _)| x.len > 0 && x.src <= a && a - x.src < x.len).map(|(_, s)| *s)
}

/// Checks every structural rule of the plan and returns the (src, dst, len) intervals it moves.
fn moved(
    p: &Plan,
    descs: &[DescPair],
    segs: &[u32],
    max_chunk: u64,
    thresh: u32,
) -> Result<Vec<(u64, u64, u64)>, String> {
    let mut out = Vec::new();
    for (i, c) in p.chunks.iter().enumerate() {
        if c.bytes == 0 || c.bytes > max_chunk {
            return Err(format!("chunk {i}: bytes {} (max {max_chunk})", c.bytes));
        }
        let data = c.data_bytes();
        if let Some(off) = c.region_plan {
            let runs = u32::try_from(c.scatter.len()).unwrap();
            if thresh == 0
                || runs < thresh
                || c.direct.is_some()
                || plan_offset(c.bytes, runs) != Some(off)
                || off + plan_bytes(runs) != c.bytes
            {
                return Err(format!("chunk {i}: bad region plan {c:?}"));
            }
            let enc = encoded(&c.scatter).ok_or("encode failed")?;
            check(&enc, runs, off, |_, _| true).map_err(|e| format!("chunk {i}: receiver refuses plan: {e}"))?;
        }
        // Each list's copies, sorted by region offset, each run within [0, data).
        let mut lists = [Vec::new(), Vec::new()];
        for (k, runs) in [&c.gather[..], &c.scatter[..]].into_iter().enumerate() {
            for (ri, r) in runs.iter().enumerate() {
                let (_, end) = r.region_span().ok_or("region span overflow")?;
                r.addr_span().ok_or("addr span overflow")?;
                if r.len == 0 || r.count == 0 || end > data {
                    return Err(format!("chunk {i}: run {r:?} empty or past data {data}"));
                }
                for (off, addr, len) in r.copies() {
                    lists[k].push((off, addr, len, ri));
                }
            }
            lists[k].sort_unstable();
        }
        let [g, s] = lists;
        // Walk both in region order: identical coverage, paired byte for byte.
        let (mut gi, mut si) = (0, 0);
        let (mut gc, mut sc) = (None::<(u64, u64, u64, usize)>, None::<(u64, u64, u64, usize)>);
        let mut run_seg: std::collections::HashMap<(usize, usize), u32> = Default::default();
        loop {
            if gc.is_none() && gi < g.len() {
                gc = Some(g[gi]);
                gi += 1;
            }
            if sc.is_none() && si < s.len() {
                sc = Some(s[si]);
                si += 1;
            }
            let (Some(a), Some(b)) = (gc, sc) else {
                if gc.is_some() || sc.is_some() {
                    return Err(format!("chunk {i}: gathered xor scattered"));
                }
                break;
            };
            if a.0 != b.0 {
                return Err(format!("chunk {i}: region {} vs {}: overlap or gathered xor scattered", a.0, b.0));
            }
            let n = a.2.min(b.2);
            out.push((a.1, b.1, n));
            if !segs.is_empty() {
                for (k, ri) in [(0, a.3), (1, b.3)] {
                    let sg = seg_of(descs, segs, a.1).ok_or("source byte not in input")?;
                    let sg2 = seg_of(descs, segs, a.1 + n - 1).ok_or("source byte not in input")?;
                    if sg != sg2 || *run_seg.entry((k, ri)).or_insert(sg) != sg {
                        return Err(format!("chunk {i}: {} run {ri} spans segments", ["gather", "scatter"][k]));
                    }
                }
            }
            gc = (a.2 > n).then(|| (a.0 + n, a.1 + n, a.2 - n, a.3));
            sc = (b.2 > n).then(|| (b.0 + n, b.1 + n, b.2 - n, b.3));
        }
    }
    Ok(out)
}

/// Descriptors with disjoint sources (in increasing or reversed order), destinations that
/// continue, stride or jump (also backwards), lengths and gaps times `scale`; optionally shifted
/// so the highest source and destination byte are u64::MAX. Returns (descs, scale).
fn descs_strategy() -> impl Strategy<Value = (Vec<DescPair>, u64)> {
    let step = (0u8..4, 1u64..200, 0u64..300, 0u64..4000);
    (proptest::collection::vec(step, 1..30), 0u32..3, any::<bool>(), any::<bool>()).prop_map(|(steps, sc, top, rev)| {
        let scale = [1u64, 1 << 20, 1 << 40][sc as usize];
        let mut prev = d(0, 1 << 50, 0);
        let (mut sgap, mut dstride) = (0u64, 64 * scale);
        let mut out = Vec::new();
        for (kind, len, gap, jump) in steps {
            let next_src = prev.src + prev.len;
            let cur = match kind {
                0 => d(next_src, prev.dst + prev.len, len * scale),
                1 if prev.len > 0 => d(next_src + sgap, prev.dst + dstride, prev.len),
                1 | 2 => {
                    sgap = gap * scale;
                    dstride = jump * scale;
                    d(next_src + sgap, prev.dst + dstride, len * scale)
                }
                _ => d(next_src + gap * scale, jump * scale * 3 + (1 << 49), len * scale),
            };
            out.push(cur);
            prev = cur;
        }
        if rev {
            out.reverse();
        }
        if top {
            let se = out.iter().map(|x| x.src + x.len).max().unwrap();
            let de = out.iter().map(|x| x.dst + x.len).max().unwrap();
            for x in &mut out {
                x.src += u64::MAX - se;
                x.dst += u64::MAX - de;
            }
        }
        (out, scale)
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(3000))]

    #[test]
    fn plans_map_every_interval_exactly(
        (descs, scale) in descs_strategy(),
        a in 0u32..7, mc in 1u64..700, ascale: bool, merge_runs: bool,
        region_plan_runs in prop_oneof![Just(0u32), 1u32..6],
        split_bytes in prop_oneof![Just(0u64), 1u64..400],
        seg_every in 0usize..4,
    ) {
        let align = if ascale { (1u64 << a) * scale } else { 1u64 << a };
        let max_chunk = (mc * scale).max(align);
        let segs: Vec<u32> = (0..descs.len()).map(|i| i.checked_div(seg_every).unwrap_or(0) as u32).collect();
        let params = PlanParams { max_chunk, align, merge_runs, region_plan_runs, split_bytes: split_bytes * scale };
        let p = plan_segmented(&descs, &segs, params).map_err(|e| TestCaseError::fail(format!("{e}")))?;
        prop_assert_eq!(p.total_bytes, descs.iter().map(|x| x.len).sum::<u64>());
        let got = moved(&p, &descs, &segs, max_chunk, region_plan_runs).map_err(TestCaseError::fail)?;
        let want: Vec<_> = descs.iter().map(|x| (x.src, x.dst, x.len)).collect();
        prop_assert_eq!(canon(got), canon(want));
        // Plain plan (one segment) moves the same.
        let p1 = plan(&descs, params).unwrap();
        let got1 = moved(&p1, &descs, &[], max_chunk, region_plan_runs).map_err(TestCaseError::fail)?;
        prop_assert_eq!(canon(got1), canon(descs.iter().map(|x| (x.src, x.dst, x.len)).collect()));
    }

    #[test]
    fn pair_runs_map_exactly_at_the_top((descs, _s) in descs_strategy(), merge: bool) {
        let runs: Vec<CopyRun> = pair_runs(&descs, merge).unwrap();
        let mut got = Vec::new();
        for r in &runs {
            prop_assert!(r.len > 0 && r.count > 0 && r.region_span().is_some() && r.addr_span().is_some(), "{:?}", r);
            got.extend(r.copies());
        }
        prop_assert_eq!(canon(got), canon(descs.iter().map(|x| (x.src, x.dst, x.len)).collect()));
    }
}

/// The balancing step sums the chunks' region bytes, alignment gaps included: two chunks of
/// 2^63 + 1 bytes each overflowed u64 (a panic in a debug build, a plan refused in release).
#[test]
fn balancing_chunks_whose_bytes_sum_past_u64_still_plans() {
    let descs: Vec<DescPair> = (0..6u64).map(|i| d(i, 1000 + i * 7 + i * i, 1)).collect();
    let align = 1u64 << 62;
    let params =
        PlanParams { max_chunk: 3 * align + 239, align, merge_runs: false, region_plan_runs: 1, split_bytes: 0 };
    let p = plan(&descs, params).unwrap();
    assert!(p.chunks.iter().all(|c| c.bytes <= params.max_chunk));
}

/// The generator reaches what this file is for: region plans, the top of the address space,
/// transfers of several chunks, descriptors larger than a chunk, several segments.
#[test]
fn the_inputs_reach_region_plans_the_top_of_memory_splits_and_segments() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;
    let mut r = TestRunner::deterministic();
    let strat = (descs_strategy(), 0u32..7, 1u64..700, any::<bool>(), prop_oneof![Just(0u32), 1u32..6], 0usize..4);
    let (mut rp, mut top, mut multi, mut split, mut n, mut segsplit) = (0, 0, 0, 0, 0, 0);
    for _ in 0..3000 {
        let ((descs, scale), a, mc, ascale, rpr, seg_every) = strat.new_tree(&mut r).unwrap().current();
        let align = if ascale { (1u64 << a) * scale } else { 1u64 << a };
        let max_chunk = (mc * scale).max(align);
        let segs: Vec<u32> = (0..descs.len()).map(|i| i.checked_div(seg_every).unwrap_or(0) as u32).collect();
        let params = PlanParams { max_chunk, align, merge_runs: true, region_plan_runs: rpr, split_bytes: 0 };
        let p = plan_segmented(&descs, &segs, params).unwrap();
        n += 1;
        rp += usize::from(p.chunks.iter().any(|c| c.region_plan.is_some()));
        top += usize::from(descs.iter().any(|x| x.src.checked_add(x.len).is_none_or(|e| e >= u64::MAX - 1)));
        multi += usize::from(p.chunks.len() > 1);
        split += usize::from(descs.iter().any(|x| x.len > max_chunk));
        segsplit += usize::from(seg_every > 0 && descs.len() > seg_every);
    }
    for (what, got) in
        [("region plans", rp), ("the top", top), ("several chunks", multi), ("a split", split), ("segments", segsplit)]
    {
        assert!(got * 10 >= n, "{what}: {got} of {n} cases");
    }
}

/// The same at the default alignment and a power-of-two max_chunk: 2^64 - 1 payload bytes
/// (overlapping descriptors), one alignment gap: the chunks' region bytes sum past u64::MAX.
#[test]
fn balancing_at_the_default_alignment_past_u64_still_plans() {
    let mut descs = vec![d(0, 0, 1)];
    descs.extend((0..(1u64 << 21) - 1).map(|_| d(0, 0, 1 << 43)));
    descs.push(d(0, 0, (1 << 43) - 2));
    assert_eq!(descs.iter().map(|x| x.len).sum::<u64>(), u64::MAX);
    let params = PlanParams { region_plan_runs: 1, ..PlanParams::new(1 << 50) };
    let p = plan(&descs, params).unwrap();
    assert!(p.chunks.iter().all(|c| c.bytes <= params.max_chunk));
}
