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
// The default inner UCX plugin's descriptor (nixlBackendPlugin*), loaded once; null if absent.
const void *bnc_default_inner_plugin(bnc_str self_path);
// Name and default of option `i`; 0 on success, NIXL_ERR_INVALID_PARAM past the end.
int32_t bnc_option_at(size_t i, bnc_str *name, bnc_str *default_value);

// Parses the config, loads the inner UCX plugin. On failure returns a NIXL error status and
// writes a human-readable reason into `err`.
int32_t bnc_engine_create(const bnc_create_args *args, bnc_create_out *out, bnc_sink err,
                          void *err_ctx);
// Gives the Rust engine the shim engine it may call back into (bnc_shim_* below). Called once,
// after the inner engine exists and before any other engine call.
int32_t bnc_engine_attach(void *engine, void *shim);
// Teardown, in this order: bnc_engine_stop (closes the bounce path: GOODBYE to the peers, the
// reactor joined, the arena deregistered, peer arenas unloaded; it still uses the shim), then
// the shim destroys the inner engine, then bnc_engine_destroy (frees the Rust engine and
// unloads the UCX plugin library, so nothing of the inner plugin may be used after it).
void bnc_engine_stop(void *engine);
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
// Registration keys (issue 10, item 7): getPublicData wraps the inner blob with our
// registration's id and key; loadRemoteMD splits a peer's blob (inner blob to the sink, id and
// 32-byte key out, *has_key = 0 for a blob that is not ours, *ticket naming the same-host record
// it carried, 0 for none), then reports the inner engine's load of that blob with the ticket:
// the inner remote md when it loaded, or the failure (the record then goes, and no other blob's
// load can take it); unloadMD forgets it.
int32_t bnc_public_data_wrap(void *engine, const void *md, bnc_str inner, bnc_sink out, void *out_ctx);
int32_t bnc_remote_md_split(void *engine, bnc_str blob, bnc_sink inner, void *inner_ctx, uint64_t *reg,
                            uint8_t *key, int32_t *has_key, uint64_t *ticket);
void bnc_remote_md_loaded(void *engine, const void *md, uint64_t reg, const uint8_t *key, uint64_t ticket);
void bnc_remote_md_load_failed(void *engine, uint64_t ticket);
void bnc_remote_md_unloaded(void *engine, const void *md);

// C++-side counter sink: counter number `index` (the same counter, and name, for the engine's
// whole life), its name without the "stats." prefix, and its value.
typedef void (*bnc_stat_sink)(void *ctx, size_t index, const uint8_t *name, size_t name_len,
                              uint64_t value);

// Live counters that changed since the last call (all of them the first time), one per sink
// call; the sink runs under Rust's publish lock.
void bnc_stats(void *engine, bnc_stat_sink sink, void *ctx);

// After the inner engine loaded a peer's conn info, once per arena index 0, 1, ... until it
// returns 0 (at most BNC_MAX_ARENAS times): for index 0 Rust tells the peer we can answer it
// (HELLO); if the peer can bounce and has arena `index`, it describes that arena (bit 0 of the
// result; fills the out-params, `key` receives its remote key) and, for index 0 when the peer
// keeps one, its mailbox's host registration (bit 1; `mbox_addr`, `mbox_len`, `mbox_key`), so
// the shim can load them; 0: nothing (more) to load.
#define BNC_MAX_ARENAS 16
int32_t bnc_peer_loaded(void *engine, bnc_str agent, uint32_t index, uint64_t *addr, uint64_t *len,
                        uint64_t *dev, int32_t *mem, bnc_sink key, void *key_ctx, uint64_t *mbox_addr,
                        uint64_t *mbox_len, bnc_sink mbox_key, void *mbox_key_ctx);
// The inner engine's metadata for that peer's arena `index` and (index 0) its mailbox (each
// null when loading it failed or there was none).
void bnc_peer_arena_md(void *engine, bnc_str agent, uint32_t index, void *md, void *mbox_md);
// The peer is gone (disconnect): fail its transfers, reclaim its regions.
void bnc_peer_lost(void *engine, bnc_str agent);
// The inner engine refused the conn info bnc_conn_info_load unwrapped for the agent: undo the load.
void bnc_conn_info_failed(void *engine, bnc_str agent);

// A descriptor as NIXL hands it to a backend (nixlMetaDesc, 32 bytes).
typedef struct {
    uint64_t addr;
    uint64_t len;
    uint64_t dev;
    const void *md;
} bnc_meta_desc;

// Routing decision for prepXfer. On NIXL_SUCCESS, *xfer != 0 means BOUNCE owns the request
// (handle id for the calls below); *xfer == 0 means "delegate to the inner engine".
// `local` and `remote` are read in place: null with a count of 0, or 8-aligned lists that stay
// unchanged until the call returns (Rust keeps no pointer into them afterwards).
int32_t bnc_xfer_prep(void *engine, int32_t op, const bnc_meta_desc *local, size_t n_local,
                      int32_t local_mem, const bnc_meta_desc *remote, size_t n_remote,
                      int32_t remote_mem, bnc_str agent, uint64_t *xfer);
int32_t bnc_xfer_post(void *engine, uint64_t xfer, bnc_str notif, int32_t has_notif);
int32_t bnc_xfer_check(void *engine, uint64_t xfer);
int32_t bnc_xfer_release(void *engine, uint64_t xfer);

// (agent, message) pair sink: copies both byte ranges into whatever `ctx` points at.
typedef void (*bnc_pair_sink)(void *ctx, const uint8_t *a, size_t a_len, const uint8_t *b,
                              size_t b_len);
// The application's getNotifs: Rust pulls what waits in the inner engine (through
// bnc_shim_poll_notifs), keeps BOUNCE's control frames for its reactor and hands the
// application's notifications to `sink`, in arrival order. Returns the inner engine's status
// when pulling failed.
int32_t bnc_notif_take(void *engine, bnc_pair_sink sink, void *ctx);
// The short way for the application's getNotifs, asked with the inner engine's lock held:
// 1 when nothing the application must see first waits in Rust (no notification pulled by the
// reactor, no pull half done, no bounce request in flight whose poller may wait), so the shim
// may pull the inner engine straight into the caller's list (2: and the bounce path is busy or
// control frames may wait on a socket of the control channel's own: call bnc_control_arrived
// after the pull); 0 otherwise (use bnc_notif_take).
int32_t bnc_notif_direct(void *engine);
// For a direct pull, each notification in arrival order, with the inner engine's lock still
// held: 1 when it is a BOUNCE control frame, now Rust's (remove it from the list), 0 when it is
// the application's, whose first `*skip` bytes the application must not see (the escape a
// BOUNCE sender put around a notification beginning with the frame magic; 0 for the others).
int32_t bnc_notif_divert(void *engine, const uint8_t *agent, size_t agent_len, const uint8_t *msg,
                         size_t msg_len, size_t *skip);
// An application notification on its way to a peer (genNotif, a pass-through transfer's): 1
// when it begins with BOUNCE's frame magic and `sink` got it escaped, to be sent instead (the
// peer, a BOUNCE engine, would take the bare one for a control frame); 0 when it goes as it
// is (bounce_escape_notifs=false; also on a panic).
int32_t bnc_notif_escape(void *engine, bnc_str msg, bnc_sink sink, void *ctx);
// After a direct pull that diverted control frames or was answered 2 by bnc_notif_direct, with
// the inner lock released: Rust runs a pass of its reactor on this thread (or wakes it) when
// frames wait or work is in flight.
void bnc_control_arrived(void *engine);

// ---- C++ shim -> exported to Rust ----
// The plugin descriptor handed to NIXL from nixl_plugin_init().
const void *bnc_shim_plugin(void);

// Operations on the inner UCX engine for the bounce reactor. `shim` is the pointer given to
// bnc_engine_attach. Each takes the shim's inner-engine lock; none calls back into Rust (sinks
// only copy bytes).
int32_t bnc_shim_register(void *shim, uint64_t addr, uint64_t len, uint64_t dev, int32_t mem,
                          void **md, bnc_sink key, void *key_ctx);
int32_t bnc_shim_deregister(void *shim, void *md);
// Unloads remote metadata loaded through the inner engine (a peer's arena, see
// bnc_peer_arena_md).
int32_t bnc_shim_unload_md(void *shim, void *md);
int32_t bnc_shim_conn_info(void *shim, bnc_sink out, void *ctx);
int32_t bnc_shim_write(void *shim, bnc_str agent, int32_t local_mem, int32_t remote_mem,
                       void *local_md, uint64_t laddr,
                       uint64_t ldev, void *remote_md, uint64_t raddr, uint64_t rdev, uint64_t len,
                       void **handle);
// As bnc_shim_write, but READs `len` bytes of the peer's (remote) range into the local one.
int32_t bnc_shim_read(void *shim, bnc_str agent, int32_t local_mem, int32_t remote_mem,
                      void *local_md, uint64_t laddr,
                      uint64_t ldev, void *remote_md, uint64_t raddr, uint64_t rdev, uint64_t len,
                      void **handle);
int32_t bnc_shim_check(void *shim, void *handle);
void bnc_shim_release(void *shim, void *handle);
int32_t bnc_shim_gen_notif(void *shim, bnc_str agent, bnc_str msg);
// Progresses the inner engine and hands every notification that arrived to `sink`, in order.
int32_t bnc_shim_poll_notifs(void *shim, bnc_pair_sink sink, void *ctx);
// As bnc_shim_poll_notifs, but only when the inner-engine lock is free (or this thread holds
// it): `*polled` is 1 when it pulled, 0 when another thread holds the lock (nothing pulled).
// The reactor's background poll: blocking there put it in a lock convoy with an application
// calling the inner engine in a loop, and every one of the application's unlocks paid a wake.
int32_t bnc_shim_try_poll_notifs(void *shim, bnc_pair_sink sink, void *ctx, int32_t *polled);

#ifdef __cplusplus
}
#endif
