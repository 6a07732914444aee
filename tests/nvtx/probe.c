/* An NVTX injection library: the hook a profiler such as Nsight Systems attaches through.
 * NVTX loads the library named by NVTX_INJECTION64_PATH at the first NVTX call, calls its
 * InitializeInjectionNvtx2, and from then on routes nvtxRangePushA / nvtxRangePop to the
 * functions the library put into NVTX's core callback table. This one appends a line per call
 * to the file named by BOUNCE_NVTX_PROBE_OUT: "push <tid> <ns> <name>" or "pop <tid> <ns>".
 *
 * tests/python/test_nvtx.py builds it with the system C compiler and runs a bounced transfer
 * under it, to show that BOUNCE's spans reach an NVTX tool as ranges. The few declarations
 * below are the stable NVTX injection ABI (module, callback and export-table ids), written
 * here so that no NVTX header is needed to build it. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

typedef void (*nvtx_fn)(void);
typedef nvtx_fn **nvtx_table;

struct nvtx_callbacks {
    size_t struct_size;
    int (*get_module_function_table)(int module, nvtx_table *table, unsigned int *size);
};

enum {
    ETID_CALLBACKS = 1,       /* NVTX_ETID_CALLBACKS */
    MODULE_CORE = 1,          /* NVTX_CB_MODULE_CORE */
    CBID_CORE_RANGE_PUSH_A = 9, /* NVTX_CBID_CORE_RangePushA */
    CBID_CORE_RANGE_POP = 11, /* NVTX_CBID_CORE_RangePop */
};

static int out_fd = -1;

static void emit(const char *kind, const char *name) {
    if (out_fd < 0) return;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    char line[320];
    int n = snprintf(line, sizeof line, "%s %ld %lld %s\n", kind, (long)syscall(SYS_gettid),
                     (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec, name ? name : "");
    if (n > 0) {
        /* One write per line on an O_APPEND descriptor: lines of several threads never mix. */
        ssize_t ignored = write(out_fd, line, (size_t)(n < (int)sizeof line ? n : (int)sizeof line - 1));
        (void)ignored;
    }
}

static int range_push_a(const char *message) {
    emit("push", message);
    return 0;
}

static int range_pop(void) {
    emit("pop", NULL);
    return 0;
}

int InitializeInjectionNvtx2(const void *(*get_export_table)(uint32_t)) {
    const char *path = getenv("BOUNCE_NVTX_PROBE_OUT");
    if (!path || !get_export_table) return 0;
    out_fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (out_fd < 0) return 0;
    const struct nvtx_callbacks *cb = get_export_table(ETID_CALLBACKS);
    if (!cb || cb->struct_size < sizeof *cb || !cb->get_module_function_table) return 0;
    nvtx_table table = NULL;
    unsigned int size = 0;
    if (!cb->get_module_function_table(MODULE_CORE, &table, &size) || !table) return 0;
    if (size <= CBID_CORE_RANGE_POP) return 0;
    *table[CBID_CORE_RANGE_PUSH_A] = (nvtx_fn)range_push_a;
    *table[CBID_CORE_RANGE_POP] = (nvtx_fn)range_pop;
    emit("init", "probe");
    return 1;
}
