/*
 * What the copy engine's gather gains from asking for the next piece's first lines while it
 * copies the current one (src/shell/copy/cpu.rs, `kernels::prefetch`). A KV request's gather:
 * N pieces of SZ bytes, each at a random block of a 64 MiB cache, copied one after the other
 * into a contiguous region, then the region copied once more (what the READ does between two
 * processes of one host) and scattered with streaming stores (as the initiator does). No NIXL.
 *
 *   gcc -O2 benches/gather_prefetch.c -o /tmp/gather_prefetch
 *   /tmp/gather_prefetch [PREFETCH_BYTES]      # 256 by default, as the copy engine asks
 *
 * "warm": the pieces drawn afresh each time, the caches as the last gather left them; "cold":
 * 512 MiB written through before each gather, as another backend's traffic or an idle host
 * leaves them. Prints the median of 27 gathers per variant, the variants interleaved.
 */
#define _GNU_SOURCE
#include <emmintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <xmmintrin.h>

#define N 1024
#define SZ 4096
#define CACHE (64u << 20)
#define EVICT (512u << 20)
#define REPS 30
#define SKIP 3

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static uint64_t next(void) { rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17; return rng; }

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

static void gather(const char *src, const size_t *offs, char *region, size_t ahead) {
    for (int i = 0; i < N; i++) {
        if (ahead && i + 1 < N)
            for (size_t l = 0; l < ahead; l += 64) _mm_prefetch(src + offs[i + 1] + l, _MM_HINT_T0);
        memcpy(region + (size_t)i * SZ, src + offs[i], SZ);
    }
}

static void scatter_streaming(const char *region, const size_t *offs, char *dst) {
    for (int i = 0; i < N; i++)
        for (size_t l = 0; l < SZ; l += 16)
            _mm_stream_si128((__m128i *)(dst + offs[i] + l), _mm_loadu_si128((const __m128i *)(region + (size_t)i * SZ + l)));
    _mm_sfence();
}

static int cmp(const void *a, const void *b) { double x = *(const double *)a, y = *(const double *)b; return (x > y) - (x < y); }

int main(int argc, char **argv) {
    size_t ahead = argc > 1 ? strtoul(argv[1], 0, 0) : 256;
    char *src = aligned_alloc(4096, CACHE), *dst = aligned_alloc(4096, CACHE);
    char *region = aligned_alloc(4096, (size_t)N * SZ), *staging = aligned_alloc(4096, (size_t)N * SZ);
    char *evict = aligned_alloc(4096, EVICT);
    memset(src, 7, CACHE); memset(dst, 0, CACHE); memset(region, 0, (size_t)N * SZ);
    memset(staging, 0, (size_t)N * SZ); memset(evict, 0, EVICT);
    size_t offs[N], douts[N];
    for (int cold = 0; cold < 2; cold++) {
        double t[2][3][REPS - SKIP];
        for (int r = 0; r < REPS; r++) {
            for (int v = 0; v < 2; v++) {
                for (int i = 0; i < N; i++) offs[i] = (next() % (CACHE / SZ)) * SZ;
                for (int i = 0; i < N; i++) douts[i] = (next() % (CACHE / SZ)) * SZ;
                if (cold) for (size_t i = 0; i < EVICT; i += 64) evict[i] += 1;
                double t0 = now_us();
                gather(src, offs, region, v ? ahead : 0);
                double t1 = now_us();
                memcpy(staging, region, (size_t)N * SZ);
                double t2 = now_us();
                scatter_streaming(staging, douts, dst);
                double t3 = now_us();
                if (r >= SKIP) { t[v][0][r - SKIP] = t1 - t0; t[v][1][r - SKIP] = t2 - t1; t[v][2][r - SKIP] = t3 - t2; }
            }
        }
        for (int v = 0; v < 2; v++) {
            double m[3];
            for (int k = 0; k < 3; k++) { qsort(t[v][k], REPS - SKIP, sizeof(double), cmp); m[k] = t[v][k][(REPS - SKIP) / 2]; }
            printf("%s %-14s gather %6.0f us   copy %6.0f us   scatter %6.0f us   total %6.0f us\n", cold ? "cold" : "warm",
                   v ? "prefetch" : "plain", m[0], m[1], m[2], m[0] + m[1] + m[2]);
        }
    }
    printf("(prefetch: the next piece's first %zu bytes; %d pieces of %d B from a %u MiB cache)\n", ahead, N, SZ, CACHE >> 20);
    return (int)(dst[douts[0]] + evict[0]) & 0;
}
