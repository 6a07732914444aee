/*
 * The floor of the same-host path for host memory: the kernel's cross-memory copy
 * (process_vm_writev) of N pieces of SZ bytes from this process into a child, on T threads,
 * each call carrying at most 1024 pieces (IOV_MAX), as BOUNCE's CMA path issues them. No NIXL,
 * no UCX: what compare.py's "BOUNCE scattered" cannot go below on the same machine.
 *
 *   gcc -O2 -pthread benches/cma_floor.c -o /tmp/cma_floor
 *   /tmp/cma_floor THREADS SCATTERED   # SCATTERED 1: destinations drawn at random over
 *                                     # twice the bytes, as compare.py scatters them
 *
 * Prints the best of 15 runs. Needs ptrace access to its own child (the default
 * kernel.yama.ptrace_scope of 0 or 1 allows it).
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define N 16384
#define SZ 4096
#define PER_CALL 1024

static pid_t child;
static struct iovec local[N], remote[N];
static int threads;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void *part(void *arg) {
    long t = (long)arg;
    int per = N / threads, lo = t * per, hi = lo + per;
    for (int i = lo; i < hi; i += PER_CALL) {
        int n = hi - i < PER_CALL ? hi - i : PER_CALL;
        if (process_vm_writev(child, local + i, n, remote + i, n, 0) != (ssize_t)n * SZ) {
            perror("process_vm_writev");
            exit(1);
        }
    }
    return NULL;
}

int main(int argc, char **argv) {
    if (argc != 3 || (threads = atoi(argv[1])) < 1 || threads > 16) {
        fprintf(stderr, "usage: %s THREADS(1-16) SCATTERED(0|1)\n", argv[0]);
        return 2;
    }
    int scattered = atoi(argv[2]);
    char *src = mmap(NULL, (size_t)N * SZ, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    char *dst = mmap(NULL, (size_t)2 * N * SZ, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (src == MAP_FAILED || dst == MAP_FAILED) {
        perror("mmap");
        return 1;
    }
    memset(src, 1, (size_t)N * SZ);
    memset(dst, 0, (size_t)2 * N * SZ); /* faulted in before the fork: the child's own pages */
    child = fork();
    if (child == 0) {
        pause();
        return 0;
    }
    int *slot = malloc(sizeof(int) * 2 * N);
    for (int i = 0; i < 2 * N; i++) slot[i] = i;
    srand(1);
    for (int i = 2 * N - 1; i > 0; i--) {
        int j = rand() % (i + 1), x = slot[i];
        slot[i] = slot[j];
        slot[j] = x;
    }
    for (int i = 0; i < N; i++) {
        local[i] = (struct iovec){src + (size_t)i * SZ, SZ};
        remote[i] = (struct iovec){dst + (size_t)(scattered ? slot[i] : i) * SZ, SZ};
    }
    double best = 1e9;
    for (int run = 0; run < 15; run++) {
        pthread_t th[16];
        double t0 = now();
        for (long t = 0; t < threads; t++) pthread_create(&th[t], NULL, part, (void *)t);
        for (int t = 0; t < threads; t++) pthread_join(th[t], NULL);
        double took = now() - t0;
        if (took < best) best = took;
    }
    printf("%d x %d B, %d thread(s), destinations %s: best of 15 %.2f ms\n", N, SZ, threads,
           scattered ? "scattered" : "in order", best * 1e3);
    kill(child, SIGKILL);
    waitpid(child, NULL, 0);
    return 0;
}
