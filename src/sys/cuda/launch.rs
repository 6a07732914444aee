//! Typed launches of the gather and scatter kernels on an execution context.

use std::ffi::c_void;

use bounce_proto::CopyRun;
use cudarc::driver::sys as cu;

use super::error::{CudaError, check};
use super::exec::ExecContext;
use super::module::Kernels;
use super::plan::{PlanShape, encode, plan_bytes};

/// Which way a copy goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyDir {
    /// User pieces -> region.
    Gather,
    /// Region -> user pieces.
    Scatter,
}

/// Where the kernels read the plan from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PlanPlacement {
    /// A device copy, made once per job on the same stream (one small host-to-device copy):
    /// every warp's binary search then hits device memory / L2.
    #[default]
    Device,
    /// In place in the pinned host buffer (zero-copy): no extra copy, but each plan read
    /// crosses the host link.
    Host,
}

/// Threads per block: eight warps, each copying its own tiles.
pub(super) const BLOCK: u32 = 256;
/// Resident blocks per SM the grid is sized for (2048 threads per SM on sm_80/sm_90).
const BLOCKS_PER_SM: u32 = 8;

/// Queues a gather of `runs` (user pieces) into the region at `region_base` on `ctx`'s stream.
///
/// # Safety
/// - `kernels` and `ctx` belong to the same GPU, and `ctx` is idle (no earlier launch on it is
///   still reading its plan buffers).
/// - For every piece of every run, `[addr, addr + len)` is memory the device can read (VRAM of
///   this GPU, a peer's with access enabled, or mapped pinned host memory) and
///   `[region_base + region_off, .. + len)` memory of this GPU it can write; all of it stays
///   allocated until the stream has passed the launch; destinations do not overlap each other
///   or any source.
pub unsafe fn gather(
    ctx: &mut ExecContext,
    kernels: &Kernels,
    runs: &[CopyRun],
    region_base: u64,
    placement: PlanPlacement,
) -> Result<(), CudaError> {
    // SAFETY: forwarded from the caller's contract.
    unsafe { launch(ctx, kernels, CopyDir::Gather, runs, region_base, placement) }
}

/// Queues a scatter of the region at `region_base` into `runs` (user pieces) on `ctx`'s stream.
///
/// # Safety
/// As for [`gather`], with the roles swapped: the region is read and the user pieces written.
pub unsafe fn scatter(
    ctx: &mut ExecContext,
    kernels: &Kernels,
    runs: &[CopyRun],
    region_base: u64,
    placement: PlanPlacement,
) -> Result<(), CudaError> {
    // SAFETY: forwarded from the caller's contract.
    unsafe { launch(ctx, kernels, CopyDir::Scatter, runs, region_base, placement) }
}

/// Writes the plan of `runs` into `ctx`'s pinned buffer and, for [`PlanPlacement::Device`],
/// queues its copy to the device on `ctx`'s stream. Returns the plan's shape and the address
/// the kernels read it from. Public so benchmarks can time the plan upload on its own.
///
/// # Safety
/// `ctx` is idle: no earlier work queued on it still reads its plan buffers.
pub unsafe fn stage_plan(
    ctx: &mut ExecContext,
    runs: &[CopyRun],
    placement: PlanPlacement,
) -> Result<(PlanShape, u64), CudaError> {
    ctx.ensure_plan_bytes(plan_bytes(runs.len()))?;
    let shape = encode(runs, ctx.plan_host.as_mut_slice())?;
    let base = match placement {
        PlanPlacement::Host => ctx.plan_host.device_ptr(),
        PlanPlacement::Device => {
            ctx.gpu().bind()?;
            // SAFETY: the plan buffers hold `shape.bytes` (ensured above); the context is idle,
            // so no launch reads the device buffer while this copy overwrites it, and the host
            // buffer is not rewritten until the context's event says the stream passed here.
            check("cuMemcpyHtoDAsync", unsafe {
                cu::cuMemcpyHtoDAsync_v2(ctx.plan_dev.ptr(), ctx.plan_host.host_ptr().cast(), shape.bytes, ctx.stream)
            })?;
            ctx.plan_dev.ptr()
        }
    };
    Ok((shape, base))
}

/// # Safety
/// See [`gather`].
unsafe fn launch(
    ctx: &mut ExecContext,
    kernels: &Kernels,
    dir: CopyDir,
    runs: &[CopyRun],
    region_base: u64,
    placement: PlanPlacement,
) -> Result<(), CudaError> {
    // SAFETY: `ctx` is idle by the caller's contract.
    let (shape, base) = unsafe { stage_plan(ctx, runs, placement)? };
    if shape.tiles == 0 {
        return Ok(());
    }
    let f = match dir {
        CopyDir::Gather => kernels.gather,
        CopyDir::Scatter => kernels.scatter,
    };
    // SAFETY: `f` is the gather or scatter kernel; the plan lies in the context's buffers, which
    // stay valid and unchanged until the event completes (the context is idle by the caller's
    // contract and `stage_plan` queued its copy first); the pieces are valid by the contract.
    unsafe { queue_copy_kernel(ctx, kernels, f, &shape, base, region_base) }
}

/// Blocks of a copy kernel's grid for a job of `tiles` tiles: a warp per tile up to the
/// resident limit of `sms` SMs, and at least one block.
pub(super) fn copy_grid(sms: u32, tiles: u64) -> u32 {
    let warps_per_block = u64::from(BLOCK / 32);
    tiles.div_ceil(warps_per_block).min(u64::from(sms * BLOCKS_PER_SM)).max(1) as u32
}

/// Queues the copy kernel `f` (gather or scatter) over the encoded plan of `shape` at device
/// address `base` on `ctx`'s stream.
///
/// # Safety
/// - `f` is `kernels.gather` or `kernels.scatter`, and `kernels` and `ctx` belong to one GPU.
/// - `[base, base + shape.bytes)` holds a plan `encode` wrote (or its device copy, queued before
///   this on the stream), readable by the device and unchanged until the stream has passed the
///   launch.
/// - The pieces are valid as [`gather`] (or [`scatter`]) requires.
pub(super) unsafe fn queue_copy_kernel(
    ctx: &ExecContext,
    kernels: &Kernels,
    f: cu::CUfunction,
    shape: &PlanShape,
    base: u64,
    region_base: u64,
) -> Result<(), CudaError> {
    kernels.gpu().bind()?;
    let mut runs_ptr: u64 = base;
    let mut prefix_ptr: u64 = base + shape.prefix_off as u64;
    let mut nruns: u32 = shape.nruns;
    let mut region: u64 = region_base;
    let mut params: [*mut c_void; 4] =
        [(&raw mut runs_ptr).cast(), (&raw mut prefix_ptr).cast(), (&raw mut nruns).cast(), (&raw mut region).cast()];
    let grid = copy_grid(kernels.gpu().sm_count(), shape.tiles);
    // SAFETY: `f` is a kernel of a loaded module taking (const PlanRun*, const u64*, u32, u64),
    // matched by `params` in order and type; the values are copied by the driver at launch.
    // The plan and the pieces are valid by the caller's contract.
    check("cuLaunchKernel", unsafe {
        cu::cuLaunchKernel(f, grid, 1, 1, BLOCK, 1, 1, 0, ctx.stream, params.as_mut_ptr(), std::ptr::null_mut())
    })
}
