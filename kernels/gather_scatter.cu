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
        // Not (lo + hi) >> 1: in u32 that wraps past 2^31 runs, and the search never ends.
        const u32 mid = lo + ((hi - lo) >> 1);
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

// ---- Region plans ----
//
// A region plan is a scatter plan in the format above (runs, then first_tile) that the peer
// wrote into the region behind the chunk's data, at byte `limit` (P): the data is region bytes
// [0, P). It is HOSTILE input. The host snapshots it into memory the peer cannot reach, then
// bounce_plan_check checks the snapshot and bounce_scatter_checked scatters from the snapshot
// only if the check passed: the CPU never decodes it. The rules (the same predicate as the
// protocol core's CPU checker; they must agree exactly), for every run r:
//   count >= 1, len >= 1, tiles_per_piece == ceil(len / BOUNCE_TILE);
//   region_off + (count - 1) * region_stride + len <= P, without overflow;
//   end = addr + (count - 1) * addr_stride + len without overflow, and [addr, end) inside ONE
//   allowed range: with i = the number of starts <= addr, i > 0 and reach[i - 1] >= end;
//   count * len without overflow and <= P, and the sum over all runs <= P;
//   first_tile[0] == 0 and first_tile[r + 1] == first_tile[r] + count * tiles_per_piece.
// Once they hold, the job has at most P tiles (tiles_per_piece <= len), so run_tiles' tile
// arithmetic stays in range for P < 2^40 (the host refuses larger P), no piece has zero tiles
// (no division by zero), first_tile is strictly increasing (the binary search is sound), and
// every byte read lies in region [0, P) and every byte written in one allowed range.

// a * b into *out; false when the product does not fit in 64 bits.
__device__ __forceinline__ bool mul_fits(u64 a, u64 b, u64* out) {
    *out = a * b;
    return __umul64hi(a, b) == 0;
}

// a + b into *out; false when the sum does not fit in 64 bits.
__device__ __forceinline__ bool add_fits(u64 a, u64 b, u64* out) {
    *out = a + b;
    return *out >= a;
}

// Whether [a, b) lies inside one allowed range (starts ascending, reach[k] the farthest end
// among ranges 0..=k): among the ranges starting at or before a, the one reaching farthest
// reaches b. Upper-bound binary search, as partition_point(|s| s <= a) on the host.
__device__ __forceinline__ bool range_allowed(const u64* __restrict__ starts, const u64* __restrict__ reach,
                                              u32 nranges, u64 a, u64 b) {
    u32 lo = 0, hi = nranges;
    while (lo < hi) {
        const u32 mid = lo + ((hi - lo) >> 1);
        if (starts[mid] <= a) lo = mid + 1; else hi = mid;
    }
    return lo > 0 && reach[lo - 1] >= b;
}

// Checks a region plan snapshot, one thread per run. `*bad` and `*sum` must be zero before the
// launch. On return `*bad` is 0 when every run passed its own rules, else 1 + the highest index
// of a failing run (atomicMax; first_tile[0] != 0 counts against run 0); `*sum` is the sum of
// count * len over the runs whose own count * len fits and is <= limit. The plan is valid iff
// *bad == 0 and *sum <= limit afterwards. A sum that wraps past 2^64 marks the run whose add
// wrapped as bad: every wrap happens at some add, so none goes unseen.
extern "C" __global__ void bounce_plan_check(const PlanRun* __restrict__ runs,
                                             const u64* __restrict__ first_tile, u32 nruns,
                                             u64 limit, const u64* __restrict__ starts,
                                             const u64* __restrict__ reach, u32 nranges, u32* bad,
                                             u64* sum) {
    const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= nruns) return;
    const u32 r = (u32)i;
    const PlanRun run = runs[r];
    // Each test runs only when the ones before it held (&&): `count - 1` is computed only for
    // count >= 1, and no later rule sees a wrapped value.
    bool ok = run.count >= 1 && run.len >= 1;
    ok = ok && (u64)run.tiles_per_piece == (run.len - 1) / BOUNCE_TILE + 1;
    const u64 last = (u64)run.count - 1;
    u64 span = 0, end = 0;
    ok = ok && mul_fits(last, run.region_stride, &span) && add_fits(span, run.len, &end) &&
         add_fits(end, run.region_off, &end) && end <= limit;
    ok = ok && mul_fits(last, run.addr_stride, &span) && add_fits(span, run.len, &end) &&
         add_fits(end, run.addr, &end) && range_allowed(starts, reach, nranges, run.addr, end);
    u64 bytes = 0, next = 0;
    ok = ok && mul_fits((u64)run.count, run.len, &bytes) && bytes <= limit;
    // count * tiles_per_piece < 2^64 always (two 32-bit factors).
    ok = ok && add_fits(first_tile[r], (u64)run.count * run.tiles_per_piece, &next) && first_tile[r + 1] == next;
    ok = ok && (r != 0 || first_tile[0] == 0);
    if (ok) {
        const u64 before = atomicAdd((unsigned long long*)sum, (unsigned long long)bytes);
        ok = before + bytes >= before;
    }
    // r <= 2^32 - 2 (r < nruns), so r + 1 does not wrap to 0.
    if (!ok) atomicMax(bad, r + 1);
}

// Region at `region_base` -> user pieces, from a plan snapshot that bounce_plan_check checked
// earlier on the same stream: does nothing unless that check passed (*bad == 0, *sum <= limit).
extern "C" __global__ void bounce_scatter_checked(const PlanRun* __restrict__ runs,
                                                  const u64* __restrict__ first_tile, u32 nruns,
                                                  u64 region_base, const u32* __restrict__ bad,
                                                  const u64* __restrict__ sum, u64 limit) {
    // Written by the check kernel, which stream order completed before this launch began.
    if (*bad != 0 || *sum > limit) return;
    run_tiles<false>(runs, first_tile, nruns, region_base);
}
