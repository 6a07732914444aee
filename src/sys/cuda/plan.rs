//! The plan a launch reads: the job's copy runs as the kernels want them (48 bytes each), then
//! the prefix sum of tiles per run. Computed on the host in O(runs), once per job.

use bounce_proto::CopyRun;

use super::error::CudaError;

/// Bytes per tile: the unit one warp copies. Must equal BOUNCE_TILE in kernels/gather_scatter.cu.
pub const TILE: u64 = 4096;

/// One run as the kernels read it. Layout must match `PlanRun` in kernels/gather_scatter.cu.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct PlanRun {
    region_off: u64,
    addr: u64,
    len: u64,
    region_stride: u64,
    addr_stride: u64,
    count: u32,
    tiles_per_piece: u32,
}

const RUN_BYTES: usize = std::mem::size_of::<PlanRun>();
const _: () = assert!(RUN_BYTES == 48);

/// Bytes a plan of `nruns` runs takes: the runs, then `nruns + 1` tile offsets.
pub fn plan_bytes(nruns: usize) -> usize {
    nruns * RUN_BYTES + (nruns + 1) * 8
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
    let prefix_off = runs.len() * RUN_BYTES;
    let (run_area, rest) = out[..bytes].split_at_mut(prefix_off);
    let (prefixes, total) = rest.split_at_mut(runs.len() * 8);
    let mut tiles: u64 = 0;
    // Fixed-size pieces of the output, zipped with the runs: no bounds check per field (a
    // 5,000-run plan is encoded on the reactor for every scatter).
    for ((r, slot), prefix) in runs.iter().zip(run_area.chunks_exact_mut(RUN_BYTES)).zip(prefixes.chunks_exact_mut(8)) {
        let tpp = u32::try_from(r.len.div_ceil(TILE)).map_err(|_| CudaError::Plan("piece too long"))?;
        let p = PlanRun {
            region_off: r.region_off,
            addr: r.addr,
            len: r.len,
            region_stride: r.region_stride,
            addr_stride: r.addr_stride,
            count: r.count,
            tiles_per_piece: tpp,
        };
        prefix.copy_from_slice(&tiles.to_ne_bytes());
        tiles = u64::from(tpp)
            .checked_mul(u64::from(r.count))
            .and_then(|t| t.checked_add(tiles))
            .ok_or(CudaError::Plan("tile count overflow"))?;
        let (words, tail) = slot.split_at_mut(40);
        for (w, f) in words.chunks_exact_mut(8).zip([p.region_off, p.addr, p.len, p.region_stride, p.addr_stride]) {
            w.copy_from_slice(&f.to_ne_bytes());
        }
        tail[..4].copy_from_slice(&p.count.to_ne_bytes());
        tail[4..].copy_from_slice(&p.tiles_per_piece.to_ne_bytes());
    }
    total.copy_from_slice(&tiles.to_ne_bytes());
    // The kernel's tile arithmetic (total * warp) stays far below 2^64 under this bound.
    if tiles >= 1 << 40 {
        return Err(CudaError::Plan("job too large"));
    }
    Ok(PlanShape { nruns, prefix_off, bytes, tiles })
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
