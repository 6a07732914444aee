// Gather (user pieces -> one contiguous arena region) and scatter (region -> user pieces) over
// the core's copy runs, as they are: a run stands for `count` pieces of `len` bytes, piece i at
// `addr + i * addr_stride` on the user side and `region_off + i * region_stride` in the region.
//
// Built at cargo build time by NVRTC into PTX (build/kernels.rs) and loaded by the driver at
// run time (src/sys/cuda/module.rs): no CUDA toolkit on the build machine, only libcuda at run
// time. No #include: NVRTC supplies uint4 and the intrinsics itself.
//
// Work split. Every piece is cut into tiles of BOUNCE_TILE bytes (the last one shorter), and the
// tiles of the whole job are numbered in run order, so one flat index names (run, piece, tile).
// The host computes, once per job and in O(runs), the prefix sum `first_tile[r]` (the number of
// tiles before run r; first_tile[nruns] is the total). The launch is a fixed number of warps;
// warp w copies the contiguous tile range [total * w / W, total * (w + 1) / W): a binary search
// finds the run of its first tile, and later tiles walk forward through the runs. So a long
// piece is spread across many warps and blocks, thousands of short pieces cost one search per
// warp rather than per piece, and adjacent warps touch adjacent memory.
//
// Each tile is copied by one warp: 16-byte vectors (uint4) when source and destination share
// their alignment modulo 16 (head and tail bytes around an aligned middle), 8- or 4-byte words
// when they share only that much, single bytes otherwise. A 4 KiB tile is 256 vectors: eight per
// lane, all loaded before any is stored, so each lane keeps 128 bytes in flight.

typedef unsigned long long u64;
typedef unsigned int u32;

// Bytes per tile. Must equal TILE in src/sys/cuda/plan.rs.
#define BOUNCE_TILE 4096ull

// One run of the plan, 48 bytes. Must match PlanRun in src/sys/cuda/plan.rs.
struct PlanRun {
    u64 region_off;     // offset of piece 0 inside the region
    u64 addr;           // user address of piece 0 (device or mapped host address)
    u64 len;            // bytes per piece
    u64 region_stride;  // distance between pieces inside the region
    u64 addr_stride;    // distance between pieces at the user side
    u32 count;          // pieces in the run
    u32 tiles_per_piece;
};

// Copies n bytes with words of type T, one warp, lanes interleaved. `dst` and `src` must have
// the same address modulo sizeof(T); the unaligned head and the tail go byte by byte.
template <typename T>
__device__ __forceinline__ void copy_words(char* dst, const char* src, u64 n, u32 lane) {
    const u64 w = sizeof(T);
    u64 head = (w - ((u64)dst & (w - 1))) & (w - 1);
    if (head > n) head = n;
    if (lane < head) dst[lane] = src[lane];
    dst += head;
    src += head;
    n -= head;
    const u64 nw = n / w;
    const T* s = (const T*)src;
    T* d = (T*)dst;
    u64 i = lane;
    // Eight independent loads per lane before the stores: memory latency is hidden by bytes in
    // flight, not by more warps alone.
    for (; i + 7 * 32 < nw; i += 8 * 32) {
        T v0 = s[i], v1 = s[i + 32], v2 = s[i + 64], v3 = s[i + 96];
        T v4 = s[i + 128], v5 = s[i + 160], v6 = s[i + 192], v7 = s[i + 224];
        d[i] = v0; d[i + 32] = v1; d[i + 64] = v2; d[i + 96] = v3;
        d[i + 128] = v4; d[i + 160] = v5; d[i + 192] = v6; d[i + 224] = v7;
    }
    for (; i < nw; i += 32) d[i] = s[i];
    const u64 done = nw * w;
    if (lane < n - done) dst[done + lane] = src[done + lane];
}

__device__ __forceinline__ void copy_tile(char* dst, const char* src, u64 n, u32 lane) {
    const u64 mis = (u64)dst ^ (u64)src;
    if ((mis & 15) == 0) {
        copy_words<uint4>(dst, src, n, lane);
    } else if ((mis & 7) == 0) {
        copy_words<u64>(dst, src, n, lane);
    } else if ((mis & 3) == 0) {
        copy_words<u32>(dst, src, n, lane);
    } else {
        for (u64 i = lane; i < n; i += 32) dst[i] = src[i];
    }
}

// The shared body. GATHER: user -> region; otherwise region -> user.
template <bool GATHER>
__device__ __forceinline__ void run_tiles(const PlanRun* __restrict__ runs,
                                          const u64* __restrict__ first_tile, u32 nruns,
                                          u64 region_base) {
    const u32 lane = threadIdx.x & 31;
    const u64 warp = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const u64 nwarps = ((u64)gridDim.x * blockDim.x) >> 5;
    if (nruns == 0) return;
    const u64 total = first_tile[nruns];
    // total < 2^44 (bytes of one region / 1 plus pieces) and nwarps < 2^21: no overflow.
    const u64 begin = total * warp / nwarps;
    const u64 end = total * (warp + 1) / nwarps;
    if (begin >= end) return;

    // The last run r with first_tile[r] <= begin; first_tile[r + 1] > begin because `begin`
    // is a valid tile. Runs without tiles (len 0) share their successor's first_tile and are
    // skipped by both the search and the walk.
    u32 lo = 0, hi = nruns;
    while (hi - lo > 1) {
        const u32 mid = (lo + hi) >> 1;
        if (first_tile[mid] <= begin) lo = mid; else hi = mid;
    }
    u32 r = lo;
    u64 next = first_tile[r + 1];
    PlanRun run = runs[r];
    for (u64 t = begin; t < end; ++t) {
        while (t >= next) {
            ++r;
            next = first_tile[r + 1];
            run = runs[r];
        }
        const u64 rel = t - first_tile[r];
        const u64 piece = rel / run.tiles_per_piece;
        const u64 off = (rel - piece * run.tiles_per_piece) * BOUNCE_TILE;
        const u64 rest = run.len - off;
        const u64 n = rest < BOUNCE_TILE ? rest : BOUNCE_TILE;
        char* region = (char*)(region_base + run.region_off + piece * run.region_stride + off);
        char* user = (char*)(run.addr + piece * run.addr_stride + off);
        if (GATHER) copy_tile(region, user, n, lane); else copy_tile(user, region, n, lane);
    }
}

// User pieces -> region at `region_base`.
extern "C" __global__ void bounce_gather(const PlanRun* __restrict__ runs,
                                         const u64* __restrict__ first_tile, u32 nruns,
                                         u64 region_base) {
    run_tiles<true>(runs, first_tile, nruns, region_base);
}

// Region at `region_base` -> user pieces.
extern "C" __global__ void bounce_scatter(const PlanRun* __restrict__ runs,
                                          const u64* __restrict__ first_tile, u32 nruns,
                                          u64 region_base) {
    run_tiles<false>(runs, first_tile, nruns, region_base);
}
