// The region plan check kernel (bounce_plan_check in ../gather_scatter.cu), compiled for the
// HOST with the few CUDA built-ins it uses stubbed, so that a machine without a GPU can test
// the kernel's own source against the CPU statement of the rules
// (tests/cuda_kernels.rs: region_plan_check_kernel_compiled_for_the_host_agrees_with_the_cpu_rules).
// Not part of the plugin; the NVRTC build (kernels/build_ptx.rs) never sees this file.
//
// The threads of the launch run one after another, so the stubbed atomics need no atomicity.
// Input (argv[1]), a sequence of cases, little-endian: nruns u32, limit u64, nranges u32, the
// plan (plan_bytes(nruns) bytes), starts (nranges u64), reach (nranges u64). Output (stdout):
// one character per case, '1' when the plan passed (bad == 0 and sum <= limit), else '0'.

#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline

struct uint4 {
    unsigned x, y, z, w;
};
struct HostDim {
    unsigned x, y, z;
};
static HostDim threadIdx, blockIdx, blockDim, gridDim;

static unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
    const unsigned long long old = *p;
    *p = old + v;
    return old;
}
static unsigned atomicMax(unsigned* p, unsigned v) {
    const unsigned old = *p;
    if (v > old) *p = v;
    return old;
}
static unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
    return (unsigned long long)(((unsigned __int128)a * b) >> 64);
}

#include "../gather_scatter.cu"

int main(int argc, char** argv) {
    if (argc != 2) {
        std::fprintf(stderr, "usage: %s CASES\n", argv[0]);
        return 2;
    }
    std::ifstream in(argv[1], std::ios::binary);
    const std::vector<unsigned char> d((std::istreambuf_iterator<char>(in)), {});
    size_t at = 0;
    auto take = [&](void* p, size_t n) {
        if (at + n > d.size()) {
            std::fprintf(stderr, "truncated input\n");
            std::exit(2);
        }
        std::memcpy(p, d.data() + at, n);
        at += n;
    };
    while (at < d.size()) {
        u32 nruns, nranges;
        u64 limit;
        take(&nruns, 4);
        take(&limit, 8);
        take(&nranges, 4);
        // u64 storage: the kernel reads the runs and tile offsets as 8-byte words.
        const size_t plan = 48ull * nruns + 8ull * (nruns + 1);
        std::vector<u64> words(plan / 8);
        take(words.data(), plan);
        std::vector<u64> starts(nranges), reach(nranges);
        take(starts.data(), 8ull * nranges);
        take(reach.data(), 8ull * nranges);
        u32 bad = 0;
        u64 sum = 0;
        const PlanRun* runs = (const PlanRun*)words.data();
        const u64* first_tile = words.data() + 6ull * nruns;
        blockDim.x = 256;
        gridDim.x = (nruns + 255) / 256;
        for (blockIdx.x = 0; blockIdx.x < gridDim.x; ++blockIdx.x)
            for (threadIdx.x = 0; threadIdx.x < blockDim.x; ++threadIdx.x)
                bounce_plan_check(runs, first_tile, nruns, limit, starts.data(), reach.data(), nranges, &bad, &sum);
        std::putchar(bad == 0 && sum <= limit ? '1' : '0');
    }
    return 0;
}
