// The small C ABI between the C++ shim (NIXL's engine class) and the Rust plugin.
// Direction is marked on each declaration. Only plain structs, pointer+length pairs and integer
// status codes cross it (STYLE.md section 5); Rust never constructs or frees a C++ std object:
// when Rust produces bytes, it hands them to a `bnc_sink` that C++ copies into its own string.
// Every Rust entry point catches panics and returns a NIXL status code instead.
#pragma once
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// Borrowed bytes (not NUL-terminated).
typedef struct {
    const uint8_t *ptr;
    size_t len;
} bnc_str;

typedef struct {
    bnc_str key;
    bnc_str value;
} bnc_kv;

// C++-side byte sink: copies [ptr, ptr+len) into whatever `ctx` points at.
typedef void (*bnc_sink)(void *ctx, const uint8_t *ptr, size_t len);

typedef struct {
    bnc_str agent;
    const bnc_kv *params;
    size_t n_params;
    int32_t enable_prog_th;
    uint64_t pthr_delay_us;
    int32_t sync_mode;
    // Path of the shared object holding this shim (dladdr), used to find libplugin_UCX.so.
    bnc_str self_path;
} bnc_create_args;

typedef struct {
    void *engine;             // Rust engine handle, owned by Rust until bnc_engine_destroy
    const void *inner_plugin; // the UCX plugin's nixlBackendPlugin*, valid while `engine` lives
    int32_t inner_prog_th;    // init params BOUNCE chose for the inner engine
    uint64_t inner_pthr_delay_us;
    int32_t inner_sync_mode;
} bnc_create_out;

// ---- Rust -> exported to C++ ----
const char *bnc_plugin_name(void);
const char *bnc_plugin_version(void);
size_t bnc_option_count(void);
// Name and default of option `i`; 0 on success, NIXL_ERR_INVALID_PARAM past the end.
int32_t bnc_option_at(size_t i, bnc_str *name, bnc_str *default_value);

// Parses the config, loads the inner UCX plugin. On failure returns a NIXL error status and
// writes a human-readable reason into `err`.
int32_t bnc_engine_create(const bnc_create_args *args, bnc_create_out *out, bnc_sink err,
                          void *err_ctx);
// Gives the Rust engine the shim engine it may call back into (bnc_shim_* below). Called once,
// after the inner engine exists and before any other engine call.
int32_t bnc_engine_attach(void *engine, void *shim);
void bnc_engine_destroy(void *engine);

// Connection info: wraps the inner conn info into BOUNCE's versioned envelope...
int32_t bnc_conn_info_wrap(void *engine, bnc_str inner, bnc_sink out, void *out_ctx);
// ...and unwraps a peer's envelope, giving the inner conn info to `inner`.
int32_t bnc_conn_info_load(void *engine, bnc_str agent, bnc_str envelope, bnc_sink inner,
                           void *inner_ctx);

// Memory registration bookkeeping (the receiver scatters only into registered memory).
int32_t bnc_mem_registered(void *engine, const void *md, uint64_t addr, uint64_t len,
                           uint64_t dev, int32_t mem);
void bnc_mem_deregistered(void *engine, const void *md);

// Live counters, one "stats.<name>=<value>" line per sink call.
void bnc_stats(void *engine, bnc_sink line, void *ctx);

// ---- C++ shim -> exported to Rust ----
// The plugin descriptor handed to NIXL from nixl_plugin_init().
const void *bnc_shim_plugin(void);

#ifdef __cplusplus
}
#endif
