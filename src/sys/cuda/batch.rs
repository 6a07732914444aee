//! The second copy path: the driver's batched memcpy (cuMemcpyBatchAsync, CUDA >= 12.8), one
//! call for all the pieces of a job. Kept for comparison with the kernels (bench: the issue
//! measured it far slower for thousands of small pieces).

use bounce_proto::CopyRun;
use cudarc::driver::sys as cu;

use super::driver::BatchFn;
use super::error::{CudaError, check};
use super::exec::ExecContext;
use super::launch::CopyDir;

/// Most pieces one batched copy takes.
const MAX_BATCH_PIECES: u64 = 1 << 18;

/// Queues the copies of `runs` between the user pieces and the region at `region_base` as one
/// batched memcpy on `ctx`'s stream. `BatchUnsupported` when the driver lacks it.
///
/// # Safety
/// As for [`super::gather`]: `ctx` idle, every piece and region range valid for the copy's
/// direction until the stream has passed it, no overlaps.
pub unsafe fn batched_copy(
    ctx: &mut ExecContext,
    dir: CopyDir,
    runs: &[CopyRun],
    region_base: u64,
) -> Result<(), CudaError> {
    // A peer's DATA may name up to a chunk's bytes in 1-byte pieces: millions of entries, whose
    // arrays the context would keep. Jobs of more pieces than this fail (the ACK says so);
    // the kernel path, the default, takes any.
    let pieces: u64 = runs.iter().map(|r| u64::from(r.count)).sum();
    if pieces > MAX_BATCH_PIECES {
        return Err(CudaError::Plan("more pieces than the batched copy path takes"));
    }
    let f = ctx.gpu().batch_fn()?;
    let ordinal = ctx.gpu().ordinal();
    ctx.gpu().bind()?;
    let stream = ctx.stream;
    let b = &mut ctx.batch;
    b.dsts.clear();
    b.srcs.clear();
    b.sizes.clear();
    for r in runs {
        for (off, addr, len) in r.copies() {
            if len == 0 {
                continue;
            }
            let region = region_base.checked_add(off).ok_or(CudaError::Plan("region address overflow"))?;
            let (dst, src) = match dir {
                CopyDir::Gather => (region, addr),
                CopyDir::Scatter => (addr, region),
            };
            b.dsts.push(dst);
            b.srcs.push(src);
            b.sizes.push(usize::try_from(len).map_err(|_| CudaError::Plan("piece too long"))?);
        }
    }
    if b.sizes.is_empty() {
        return Ok(());
    }
    let loc = cu::CUmemLocation { type_: cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: ordinal };
    // Stream order: the sources may be read only once the stream reaches the copy (they are
    // written by earlier work on it).
    let mut attr = cu::CUmemcpyAttributes {
        srcAccessOrder: cu::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
        srcLocHint: loc,
        dstLocHint: loc,
        flags: cu::CUmemcpyFlags::CU_MEMCPY_FLAG_DEFAULT as u32,
    };
    let mut attr_idx = 0usize;
    let n = b.sizes.len();
    // Why the calls below are sound: the three arrays hold `n` entries each and stay alive (in
    // the context) until the copy is done; one attribute applies from index 0; the pieces are
    // valid by the caller's contract; the fn pointer was resolved from the driver with its ABI
    // (see BatchFn).
    let code = match f {
        BatchFn::V13(call) => {
            // SAFETY: see above; the CUDA 13 ABI has no failure index.
            unsafe {
                call(
                    b.dsts.as_mut_ptr(),
                    b.srcs.as_mut_ptr(),
                    b.sizes.as_mut_ptr(),
                    n,
                    &mut attr,
                    &mut attr_idx,
                    1,
                    stream,
                )
            }
        }
        BatchFn::V12(call) => {
            let mut fail = 0usize;
            // SAFETY: see above; `fail` is a valid out-pointer for the failure index.
            unsafe {
                call(
                    b.dsts.as_mut_ptr(),
                    b.srcs.as_mut_ptr(),
                    b.sizes.as_mut_ptr(),
                    n,
                    &mut attr,
                    &mut attr_idx,
                    1,
                    &mut fail,
                    stream,
                )
            }
        }
    };
    check("cuMemcpyBatchAsync", code)
}
