//! The plan a launch reads: the job's copy runs as the kernels want them (48 bytes each), then
//! the prefix sum of tiles per run. Computed on the host in O(runs), once per job.
//!
//! The form is the wire's region plan (`bounce_proto::wire::region_plan`, which a peer writes
//! behind a chunk's data): one encoder for both, so the kernels and the wire cannot drift apart.

use bounce_proto::CopyRun;
use bounce_proto::wire::region_plan;

use super::error::CudaError;

/// Bytes per tile: the unit one warp copies. Must equal BOUNCE_TILE in kernels/gather_scatter.cu.
pub const TILE: u64 = region_plan::TILE;

// The records are read as native words by the kernels; the wire form is little-endian.
const _: () = assert!(cfg!(target_endian = "little"), "plans are little-endian");
const _: () = assert!(region_plan::RECORD_BYTES == 48, "PlanRun in kernels/gather_scatter.cu is 48 bytes");

/// Bytes a plan of `nruns` runs takes: the runs, then `nruns + 1` tile offsets.
pub fn plan_bytes(nruns: usize) -> usize {
    nruns * region_plan::RECORD_BYTES as usize + (nruns + 1) * 8
}

/// Where the parts of an encoded plan are.
#[derive(Debug, Clone, Copy)]
pub struct PlanShape {
    /// Runs in the plan.
    pub nruns: u32,
    /// Byte offset of the tile prefix sums.
    pub prefix_off: usize,
    /// Bytes used.
    pub bytes: usize,
    /// Tiles in the whole job.
    pub tiles: u64,
}

/// Writes the plan of `runs` into `out` (at least [`plan_bytes`] long). Public (as
/// `encode_plan`) for tests and tools that build plan bytes, region plans included.
pub fn encode(runs: &[CopyRun], out: &mut [u8]) -> Result<PlanShape, CudaError> {
    let nruns = u32::try_from(runs.len()).map_err(|_| CudaError::Plan("more than 2^32 runs"))?;
    let bytes = plan_bytes(runs.len());
    if out.len() < bytes {
        return Err(CudaError::Plan("plan buffer too small"));
    }
    region_plan::encode(runs, &mut out[..bytes]).ok_or(CudaError::Plan("piece too long or tile count overflow"))?;
    let mut total = [0; 8];
    total.copy_from_slice(&out[bytes - 8..bytes]);
    let tiles = u64::from_le_bytes(total);
    // The kernel's tile arithmetic (total * warp) stays far below 2^64 under this bound.
    if tiles >= 1 << 40 {
        return Err(CudaError::Plan("job too large"));
    }
    Ok(PlanShape { nruns, prefix_off: runs.len() * region_plan::RECORD_BYTES as usize, bytes, tiles })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn u64_at(b: &[u8], at: usize) -> u64 {
        u64::from_ne_bytes(b[at..at + 8].try_into().unwrap())
    }

    #[test]
    fn prefix_sums_count_tiles_per_piece_and_skip_empty_runs() {
        let runs = [
            CopyRun { region_off: 0, addr: 100, len: 4096, count: 3, region_stride: 4096, addr_stride: 8192 },
            CopyRun { region_off: 1 << 20, addr: 7, len: 0, count: 5, region_stride: 0, addr_stride: 0 },
            CopyRun { region_off: 2 << 20, addr: 9, len: 4097, count: 2, region_stride: 8192, addr_stride: 4097 },
        ];
        let mut buf = vec![0u8; plan_bytes(3)];
        let s = encode(&runs, &mut buf).unwrap();
        assert_eq!((s.nruns, s.prefix_off, s.bytes, s.tiles), (3, 144, 176, 3 + 4));
        assert_eq!([0, 1, 2, 3].map(|i| u64_at(&buf, 144 + i * 8)), [0, 3, 3, 7]);
        // Second run's fields, and its count/tiles word.
        assert_eq!(u64_at(&buf, 48), 1 << 20);
        assert_eq!(u64_at(&buf, 48 + 8), 7);
        assert_eq!(&buf[96 + 40..96 + 48], &[2u32.to_ne_bytes(), 2u32.to_ne_bytes()].concat()[..]);
        assert!(encode(&runs, &mut buf[..175]).is_err());
    }
}
