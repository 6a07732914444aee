//! Region plans on the target's GPU: the scatter plan the peer wrote into a chunk's region
//! behind the data (one RDMA write carries both) is never decoded on the CPU. One call,
//! [`scatter_region_plan`], queues on a context's stream: a device-side snapshot of the plan
//! bytes into the context's private buffer (the peer can still write into its region, so the
//! check and the scatter read only the snapshot), the allowed ranges and zeroed verdict words,
//! the check kernel, the scatter that runs only if the check passed, and the copy of the
//! verdict into pinned host memory; [`region_plan_verdict`] reads it once the context's event
//! completed. The rules the check applies are written in kernels/gather_scatter.cu; the format
//! is `plan.rs`'s (owned by the protocol core as its region plan format).
//!
//! Not here: where the plan lies (the caller computes `plan_off` from the chunk), refusing a
//! plan the frame says nothing sensible about, and the CPU twin of the check (the core's).

use std::ffi::c_void;

use cudarc::driver::sys as cu;

use super::error::{CudaError, check};
use super::exec::ExecContext;
use super::launch::{BLOCK, copy_grid};
use super::memory::PinnedHost;
use super::module::Kernels;
use super::plan::{TILE, plan_bytes};

/// Regions at or above this many data bytes are refused: it keeps the scatter kernel's tile
/// arithmetic (at most P tiles, times the warp count) far from 2^64.
pub const REGION_PLAN_MAX_DATA: u64 = 1 << 40;

/// Bytes of the verdict: `bad` (u32), 4 bytes of padding, `sum` (u64).
const VERDICT_BYTES: usize = 16;
/// `bad` as written on the host before a launch: "refused" until the launch's copy replaces it.
const NOT_CHECKED: u32 = u32::MAX;

/// Where the parts of one launch lie in the context's plan buffers (device, and the pinned
/// host buffer for the uploaded part, at the same offsets).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Layout {
    /// Bytes of the plan snapshot at offset 0: the runs, then `first_tile` at `48 * nruns`.
    plan: usize,
    /// Offset of `starts` (u64 each).
    starts: usize,
    /// Offset of `reach` (u64 each).
    reach: usize,
    /// Offset of the verdict words (8-byte aligned).
    verdict: usize,
    /// Bytes used in all.
    bytes: usize,
}

impl Layout {
    fn new(nruns: u32, nranges: usize) -> Self {
        // plan_bytes is a multiple of 8, so every array below stays 8-byte aligned.
        let plan = plan_bytes(nruns as usize);
        let starts = plan;
        let reach = starts + nranges * 8;
        let verdict = reach + nranges * 8;
        Self { plan, starts, reach, verdict, bytes: verdict + VERDICT_BYTES }
    }
}

/// Checks the arguments of [`scatter_region_plan`] and returns the device address of the
/// plan bytes in the region.
fn plan_address(region_base: u64, plan_off: u64, nruns: u32, starts: &[u64], reach: &[u64]) -> Result<u64, CudaError> {
    if nruns == 0 {
        return Err(CudaError::Plan("region plan without runs"));
    }
    if plan_off >= REGION_PLAN_MAX_DATA {
        return Err(CudaError::Plan("region plan behind more than 2^40 data bytes"));
    }
    let end = plan_off.checked_add(plan_bytes(nruns as usize) as u64).and_then(|e| region_base.checked_add(e));
    if end.is_none() {
        return Err(CudaError::Plan("region plan past the end of the address space"));
    }
    if starts.len() != reach.len() || u32::try_from(starts.len()).is_err() {
        return Err(CudaError::Plan("allowed ranges: starts and reach differ in length or exceed 2^32"));
    }
    // The check's binary search needs ascending starts; an unsorted set would allow memory by
    // accident. O(ranges), a handful of registrations.
    if starts.windows(2).any(|w| w[0] > w[1]) {
        return Err(CudaError::Plan("allowed ranges: starts not ascending"));
    }
    Ok(region_base + plan_off)
}

/// Queues, on `ctx`'s stream, the check of the region plan of `nruns` runs that lies at
/// `region_base + plan_off` (the data are region bytes `[0, plan_off)`, so `plan_off` is the
/// limit P of the rules) against the allowed ranges, and the scatter of the region's data by
/// that plan if, and only if, the check passed. Then record the context's event; once it
/// completed, [`region_plan_verdict`] says whether the plan passed (and so the scatter ran).
///
/// The allowed ranges have the shape of the core's `ProvenRanges`: `[a, b)` may be written iff,
/// with `i` the number of `starts <= a`, `i > 0` and `reach[i - 1] >= b`; empty slices allow
/// nothing (every plan is refused).
///
/// # Errors
/// [`CudaError::Plan`] without queuing anything (the verdict reads "refused") when
/// `nruns == 0`, `plan_off >= 2^40`, the plan's end overflows, `starts` and `reach` differ in
/// length, or `starts` is not ascending; a driver error when a copy or launch cannot be queued
/// (then part of the work may be queued: wait for the stream before reusing `ctx`; the verdict
/// reads "refused").
///
/// # Safety
/// - `kernels` and `ctx` belong to the same GPU, and `ctx` is idle: nothing queued on it earlier
///   still reads or writes its plan buffers or its verdict.
/// - `[region_base, region_base + plan_off + plan_bytes(nruns))` is memory of this GPU the
///   device can read, allocated until the stream has passed this work. Its bytes may be any
///   value and may change meanwhile (the peer's RDMA): the plan is snapshotted first and only
///   the snapshot is checked and used.
/// - `starts` ascending and `reach[i]` the farthest end among ranges `0..=i` (as the core's
///   `ProvenRanges` builds them) of ranges that are each memory the device may write and the
///   peer may write into, allocated until the stream has passed this work, and not overlapping
///   the region's `[0, plan_off)`: then every byte an accepted plan writes lies in one of them.
pub unsafe fn scatter_region_plan(
    ctx: &mut ExecContext,
    kernels: &Kernels,
    region_base: u64,
    plan_off: u64,
    nruns: u32,
    starts: &[u64],
    reach: &[u64],
) -> Result<(), CudaError> {
    // Until this launch's verdict copy lands, the verdict reads "refused": a call refused here,
    // a launch that failed half-queued, or a stale verdict of an earlier launch, never reads as
    // passed.
    let mut verdict_host = match ctx.verdict.take() {
        Some(v) => v,
        None => PinnedHost::new(ctx.gpu(), VERDICT_BYTES)?,
    };
    let words = verdict_host.as_mut_slice();
    words[..4].copy_from_slice(&NOT_CHECKED.to_le_bytes());
    words[8..16].copy_from_slice(&0u64.to_le_bytes());
    // Moving the handle moves no bytes: the pointer stays valid while the context holds it.
    let verdict_dst = verdict_host.host_ptr();
    ctx.verdict = Some(verdict_host);
    ctx.verdict_limit = plan_off;
    let plan_addr = plan_address(region_base, plan_off, nruns, starts, reach)?;
    let nranges = starts.len() as u32; // checked by plan_address
    let lay = Layout::new(nruns, starts.len());

    ctx.ensure_plan_bytes(lay.bytes)?;
    let host = ctx.plan_host.as_mut_slice();
    for (slot, v) in host[lay.starts..lay.reach].chunks_exact_mut(8).zip(starts) {
        slot.copy_from_slice(&v.to_le_bytes());
    }
    for (slot, v) in host[lay.reach..lay.verdict].chunks_exact_mut(8).zip(reach) {
        slot.copy_from_slice(&v.to_le_bytes());
    }
    // The check kernel adds into `sum` and maxes into `bad`: both start at zero.
    host[lay.verdict..lay.bytes].fill(0);
    let dev = ctx.plan_dev.ptr();
    let host_ptr = ctx.plan_host.host_ptr();
    let stream = ctx.stream;
    ctx.gpu().bind()?;

    // (a) The snapshot: from here on nothing reads the region's plan bytes.
    // SAFETY: the source is `plan_bytes(nruns)` readable bytes of the region (caller's
    // contract); the destination is the context's device buffer, which holds `lay.bytes`
    // (ensured above) and which no earlier work still uses (the context is idle).
    check("cuMemcpyDtoDAsync", unsafe { cu::cuMemcpyDtoDAsync_v2(dev, plan_addr, lay.plan, stream) })?;
    // (b, c) The allowed ranges and the zeroed verdict words, in one copy.
    // SAFETY: `[lay.starts, lay.bytes)` lies inside both plan buffers (ensured above); the
    // pinned host bytes are not rewritten until the event says the stream passed this copy
    // (the caller's idle rule for the next launch).
    check("cuMemcpyHtoDAsync", unsafe {
        cu::cuMemcpyHtoDAsync_v2(
            dev + lay.starts as u64,
            host_ptr.add(lay.starts).cast(),
            lay.bytes - lay.starts,
            stream,
        )
    })?;

    let mut runs_ptr: u64 = dev;
    let mut first_tile_ptr: u64 = dev + 48 * u64::from(nruns);
    let mut n: u32 = nruns;
    let mut limit: u64 = plan_off;
    let mut starts_ptr: u64 = dev + lay.starts as u64;
    let mut reach_ptr: u64 = dev + lay.reach as u64;
    let mut m: u32 = nranges;
    let mut bad_ptr: u64 = dev + lay.verdict as u64;
    let mut sum_ptr: u64 = bad_ptr + 8;
    let mut region: u64 = region_base;

    // (d) The check: one thread per run.
    let mut check_params: [*mut c_void; 9] = [
        (&raw mut runs_ptr).cast(),
        (&raw mut first_tile_ptr).cast(),
        (&raw mut n).cast(),
        (&raw mut limit).cast(),
        (&raw mut starts_ptr).cast(),
        (&raw mut reach_ptr).cast(),
        (&raw mut m).cast(),
        (&raw mut bad_ptr).cast(),
        (&raw mut sum_ptr).cast(),
    ];
    let check_grid = nruns.div_ceil(BLOCK);
    // SAFETY: `plan_check` takes (const PlanRun*, const u64*, u32, u64, const u64*, const u64*,
    // u32, u32*, u64*), matched by `check_params` in order and type (copied at launch). It
    // reads the snapshot (nruns runs, nruns + 1 tile offsets) and the m ranges, and writes the
    // verdict words: all inside the context's device buffer, queued after their copies.
    check("cuLaunchKernel", unsafe {
        cu::cuLaunchKernel(
            kernels.plan_check,
            check_grid,
            1,
            1,
            BLOCK,
            1,
            1,
            0,
            stream,
            check_params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    })?;

    // (e) The scatter, a no-op unless the check passed. The host does not know the tile
    // total (it is in the snapshot); an accepted plan has at most P tiles, and about
    // P / TILE + nruns when its pieces are not tiny: the grid is sized for that (fewer warps
    // than tiles is correct, only slower).
    let tiles_bound = (plan_off / TILE).saturating_add(u64::from(nruns)).min(plan_off);
    let grid = copy_grid(kernels.gpu().sm_count(), tiles_bound);
    let mut scatter_params: [*mut c_void; 7] = [
        (&raw mut runs_ptr).cast(),
        (&raw mut first_tile_ptr).cast(),
        (&raw mut n).cast(),
        (&raw mut region).cast(),
        (&raw mut bad_ptr).cast(),
        (&raw mut sum_ptr).cast(),
        (&raw mut limit).cast(),
    ];
    // SAFETY: `scatter_checked` takes (const PlanRun*, const u64*, u32, u64, const u32*,
    // const u64*, u64), matched by `scatter_params`. It copies only when the check passed, and
    // then reads only region bytes [0, P) and writes only allowed ranges (the rules in
    // kernels/gather_scatter.cu), which the caller's contract makes valid memory.
    check("cuLaunchKernel", unsafe {
        cu::cuLaunchKernel(
            kernels.scatter_checked,
            grid,
            1,
            1,
            BLOCK,
            1,
            1,
            0,
            stream,
            scatter_params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    })?;

    // (f) The verdict back to the host.
    // SAFETY: 16 bytes from the context's device buffer into the context's pinned verdict
    // buffer (16 bytes), which lives as long as the context and which nothing else writes
    // while the stream may still run this copy (the context is idle until its event).
    check("cuMemcpyDtoHAsync", unsafe {
        cu::cuMemcpyDtoHAsync_v2(verdict_dst.cast_mut().cast(), dev + lay.verdict as u64, VERDICT_BYTES, stream)
    })
}

/// Whether the last [`scatter_region_plan`] on `ctx` passed its check (and so scattered):
/// meaningful once the context's event, recorded after that call, has completed. False before
/// any region plan launch and after one that failed to queue.
pub fn region_plan_verdict(ctx: &ExecContext) -> bool {
    let Some(v) = &ctx.verdict else { return false };
    let p = v.host_ptr();
    // SAFETY: the buffer holds VERDICT_BYTES bytes and is page-aligned (cuMemHostAlloc), so
    // both reads are in bounds and aligned. Volatile: the device writes these bytes by DMA,
    // outside what the compiler sees.
    let (bad, sum) = unsafe { (p.cast::<u32>().read_volatile(), p.add(8).cast::<u64>().read_volatile()) };
    verdict_passed(u32::from_le(bad), u64::from_le(sum), ctx.verdict_limit)
}

/// The plan was valid: no run failed its own rules and the work sum is within the limit.
fn verdict_passed(bad: u32, sum: u64, limit: u64) -> bool {
    bad == 0 && sum <= limit
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_packs_plan_ranges_and_verdict_8_byte_aligned() {
        let l = Layout::new(3, 2);
        // 3 runs: 144 bytes of runs, 4 tile offsets.
        assert_eq!(l, Layout { plan: 176, starts: 176, reach: 192, verdict: 208, bytes: 224 });
        let empty = Layout::new(1, 0);
        assert_eq!((empty.plan, empty.starts, empty.reach, empty.verdict, empty.bytes), (64, 64, 64, 64, 80));
        for (n, m) in [(1u32, 0usize), (7, 3), (5000, 17)] {
            let l = Layout::new(n, m);
            assert!([l.plan, l.starts, l.reach, l.verdict].iter().all(|o| o % 8 == 0));
        }
    }

    #[test]
    fn arguments_that_name_no_sensible_plan_are_refused() {
        let ok = plan_address(0x1000, 4096, 2, &[0, 10], &[5, 20]);
        assert_eq!(ok, Ok(0x1000 + 4096));
        assert!(plan_address(0x1000, 4096, 0, &[], &[]).is_err(), "no runs");
        assert!(plan_address(0, REGION_PLAN_MAX_DATA, 1, &[], &[]).is_err(), "too much data");
        assert!(plan_address(0, REGION_PLAN_MAX_DATA - 8, 1, &[], &[]).is_ok());
        // The plan's end past 2^64, from the region base.
        assert!(plan_address(u64::MAX - 4096 - 63, 4096, 1, &[], &[]).is_err());
        assert!(plan_address(u64::MAX - 4096 - 64, 4096, 1, &[], &[]).is_ok());
        assert!(plan_address(0, 4096, 1, &[1], &[]).is_err(), "lengths differ");
        assert!(plan_address(0, 4096, 1, &[5, 4], &[6, 6]).is_err(), "unsorted");
        assert!(plan_address(0, 4096, 1, &[4, 4], &[6, 6]).is_ok(), "equal starts are sorted");
    }

    #[test]
    fn verdict_needs_no_bad_run_and_a_sum_within_the_limit() {
        assert!(verdict_passed(0, 4096, 4096));
        assert!(!verdict_passed(0, 4097, 4096));
        assert!(!verdict_passed(1, 0, 4096));
        assert!(!verdict_passed(NOT_CHECKED, 0, 4096));
    }
}
