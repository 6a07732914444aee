// The C++ shim driven the way NIXL's core drives an engine (STYLE.md §8), with no core in the
// process: the plugin's descriptor, engine creation, conn info and registration metadata,
// scattered WRITEs (one with a notification) and a READ bounced and a WRITE passed to UCX,
// every byte checked, notifications both ways, and what the edge answers to input NIXL's
// core does not check but a C++ application may pass (an agent name that is not UTF-8, an
// undefined op, a non-empty notification list). `ci/test` builds it and runs it under
// valgrind; by hand:
//
//   g++ -std=c++20 -Icpp/include cpp/tests/shim_test.cpp -ldl -o /tmp/shim_test
//   /tmp/shim_test PLUGIN_DIR/libplugin_BOUNCE.so      # exit 0: every check held
//   /tmp/shim_test PLUGIN_DIR/libplugin_BOUNCE.so --oom  # only: a copy out of memory is an error
//
// `--oom` runs outside valgrind (which replaces operator new with its own): this executable's
// operator new interposes the plugin's, and fails on demand.
// The inner UCX plugin is found beside libplugin_BOUNCE.so, as NIXL's own install has it.
#include "nixl_abi.h"

#include <dlfcn.h>

#include <atomic>
#include <new>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

using namespace nixl_abi;

// Allocation failure on demand (`--oom`): while `oom_at` is not 0, every operator new of at
// least that many bytes throws. The plugin's own std::string copies call this one (the
// executable's definition comes first in the dynamic linker's lookup).
static std::atomic<size_t> oom_at{0};
static std::atomic<long> oom_thrown{0};

void *operator new(size_t n) {
    const size_t at = oom_at.load();
    if (at != 0 && n >= at) {
        oom_thrown.fetch_add(1);
        throw std::bad_alloc();
    }
    // From malloc, as libstdc++'s own operator new takes it: its operator delete (free) stays.
    if (void *p = std::malloc(n ? n : 1)) return p;
    throw std::bad_alloc();
}

namespace {

int failures = 0;

void check(bool ok, const char *what, long got = 0) {
    std::printf("%s %s", ok ? "ok  " : "FAIL", what);
    if (!ok) std::printf(" (got %ld)", got);
    std::printf("\n");
    if (!ok) ++failures;
}

// Seed-distinct bytes: no two buffers, and no two offsets within one, hold the same pattern.
void fill(std::vector<uint8_t> &b, uint32_t seed) {
    uint32_t x = seed * 2654435761u + 1;
    for (auto &v : b) {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        v = static_cast<uint8_t>(x);
    }
}

struct Plugin {
    BackendPlugin *p = nullptr;

    BackendEngine *engine(const char *agent, params_t &params) const {
        BackendInitParams ip;
        ip.localAgent = agent;
        ip.type = "BOUNCE";
        ip.customParams = &params;
        return p->create_engine(&ip);
    }
};

// One agent's side: an engine and one registered host buffer.
struct Side {
    BackendEngine *e = nullptr;
    std::vector<uint8_t> buf;
    BackendMD *md = nullptr;
};

bool reg(Side &s, size_t len, uint32_t seed) {
    s.buf.assign(len, 0);
    fill(s.buf, seed);
    BlobDesc d;
    d.addr = reinterpret_cast<uintptr_t>(s.buf.data());
    d.len = len;
    d.devId = 0;
    return s.e->registerMem(d, DRAM_SEG, s.md) == NIXL_SUCCESS && s.md;
}

// `from` loads `to`'s conn info under `name`, and `to`'s buffer's public data.
BackendMD *load_peer(Side &from, const Side &to, const std::string &name, nixl_status_t *conn_st) {
    std::string conn, pub;
    if (to.e->getConnInfo(conn) != NIXL_SUCCESS) return nullptr;
    *conn_st = from.e->loadRemoteConnInfo(name, conn);
    if (*conn_st != NIXL_SUCCESS) return nullptr;
    if (to.e->getPublicData(to.md, pub) != NIXL_SUCCESS) return nullptr;
    BlobDesc d;
    d.addr = reinterpret_cast<uintptr_t>(to.buf.data());
    d.len = to.buf.size();
    d.devId = 0;
    d.metaInfo = pub;
    BackendMD *out = nullptr;
    return from.e->loadRemoteMD(d, DRAM_SEG, name, out) == NIXL_SUCCESS ? out : nullptr;
}

long stat(const BackendEngine *e, const char *name) {
    const auto &p = e->getCustomParams();
    auto it = p.find(std::string("stats.") + name);
    return it == p.end() ? -1 : std::atol(it->second.c_str());
}

// Moves `n` pieces of `piece` bytes between `me`'s buffer (every other piece) and `peer`'s (the
// pieces in reverse order there) at `name`: a WRITE from `me` to `peer`, or a READ by `me`
// from `peer`; with `notif`, the notification `peer` gets once the bytes landed. Polls both
// engines as NIXL's core and a target's application would (what `peer` gets is kept in `got`);
// true when the transfer ended in SUCCESS within 20 s.
bool move_pieces(nixl_xfer_op_t op, Side &me, Side &peer, BackendMD *remote_md, const std::string &name, size_t n,
                 size_t piece, const std::string *notif = nullptr, notif_list_t *got = nullptr) {
    Side &src = me;
    Side &dst = peer;
    meta_dlist_t local(DRAM_SEG), remote(DRAM_SEG);
    for (size_t i = 0; i < n; ++i) {
        MetaDesc l, r;
        l.addr = reinterpret_cast<uintptr_t>(src.buf.data()) + 2 * i * piece;
        l.len = piece;
        l.devId = 0;
        l.metadataP = src.md;
        r.addr = reinterpret_cast<uintptr_t>(dst.buf.data()) + (n - 1 - i) * 2 * piece;
        r.len = piece;
        r.devId = 0;
        r.metadataP = remote_md;
        local.addDesc(l);
        remote.addDesc(r);
    }
    BackendOptArgs opt;
    if (notif) {
        opt.notifMsg = *notif;
        opt.hasNotif = true;
    }
    BackendReqH *h = nullptr;
    if (src.e->prepXfer(op, local, remote, name, h, &opt) != NIXL_SUCCESS || !h) return false;
    nixl_status_t st = src.e->postXfer(op, local, remote, name, h, &opt);
    auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (st == NIXL_IN_PROG && std::chrono::steady_clock::now() < until) {
        notif_list_t notifs;
        dst.e->getNotifs(notifs);
        if (got) got->insert(got->end(), notifs.begin(), notifs.end());
        st = src.e->checkXfer(h);
        std::this_thread::yield();
    }
    src.e->releaseReqH(h);
    return st == NIXL_SUCCESS;
}

// The first notification from `from` among `got`, or else polled from `e` for up to 10 s.
std::string notif_from(BackendEngine *e, const std::string &from, notif_list_t got = {}) {
    auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    do {
        for (auto &[agent, msg] : got)
            if (agent == from) return msg;
        got.clear();
        if (e->getNotifs(got) != NIXL_SUCCESS) return "(getNotifs failed)";
        std::this_thread::yield();
    } while (std::chrono::steady_clock::now() < until);
    return "(none)";
}

// The first `n` notifications from `from`, in arrival order (fewer after 10 s).
std::vector<std::string> notifs_from(BackendEngine *e, const std::string &from, size_t n) {
    std::vector<std::string> out;
    auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (out.size() < n && std::chrono::steady_clock::now() < until) {
        notif_list_t got;
        if (e->getNotifs(got) != NIXL_SUCCESS) break;
        for (auto &[agent, msg] : got)
            if (agent == from) out.push_back(msg);
        std::this_thread::yield();
    }
    return out;
}

// Every piece landed where it was sent, and every byte between the destinations is untouched.
bool exact(const std::vector<uint8_t> &src, const std::vector<uint8_t> &dst, uint32_t dst_seed, size_t n, size_t piece) {
    std::vector<uint8_t> want(dst.size());
    fill(want, dst_seed);
    for (size_t i = 0; i < n; ++i) std::memcpy(&want[(n - 1 - i) * 2 * piece], &src[2 * i * piece], piece);
    return want == dst;
}

} // namespace

// Review 62 (FFI, L2): a blob the plugin could not copy out (no memory) must make the call fail.
// It was swallowed, and getConnInfo and getPublicData reported SUCCESS with an empty blob (a
// peer's UCX would then parse an empty rkey). Each call is made once to learn its blob's size,
// then again with every allocation of that size failing, then once more with none failing.
int oom_checks(const Plugin &plugin) {
    params_t params;
    Side a;
    a.e = plugin.engine("oom-a", params);
    if (!a.e || a.e->getInitErr() || !reg(a, 1 << 20, 91)) {
        std::printf("FAILED: no engine to test with\n");
        return 1;
    }
    std::string conn, pub;
    check(a.e->getConnInfo(conn) == NIXL_SUCCESS && !conn.empty(), "getConnInfo, memory to spare");
    check(a.e->getPublicData(a.md, pub) == NIXL_SUCCESS && !pub.empty(), "getPublicData, memory to spare");
    struct Call {
        const char *what;
        size_t size;
        nixl_status_t (*call)(Side &, std::string &);
    } calls[] = {
        {"getConnInfo", conn.size(), [](Side &s, std::string &out) { return s.e->getConnInfo(out); }},
        {"getPublicData", pub.size(), [](Side &s, std::string &out) { return s.e->getPublicData(s.md, out); }},
    };
    for (auto &c : calls) {
        std::string out;
        const long thrown = oom_thrown.load();
        oom_at = c.size;
        const nixl_status_t st = c.call(a, out);
        oom_at = 0;
        std::printf("     %s, its %zu-byte copy failing: status %d, %ld allocations refused\n", c.what, c.size,
                    static_cast<int>(st), oom_thrown.load() - thrown);
        // Nothing refused would mean this operator new was not the plugin's: the check proves
        // nothing then, and says so by failing.
        check(oom_thrown.load() > thrown, "the plugin's copy went through this test's operator new");
        check(st == NIXL_ERR_BACKEND, "a blob that could not be copied out is ERR_BACKEND, not a SUCCESS", st);
        out.clear();
        check(c.call(a, out) == NIXL_SUCCESS && out.size() == c.size, "with memory back, the call succeeds again");
    }
    a.e->deregisterMem(a.md);
    plugin.p->destroy_engine(a.e);
    std::printf("%s: %d failed\n", failures ? "FAILED" : "passed", failures);
    return failures ? 1 : 0;
}

int main(int argc, char **argv) {
    const bool oom = argc == 3 && std::string(argv[2]) == "--oom";
    if (argc != 2 && !oom) {
        std::fprintf(stderr, "usage: %s PATH/libplugin_BOUNCE.so [--oom]\n", argv[0]);
        return 2;
    }
    // NIXL's core library first, as in any process that uses NIXL: BOUNCE's version guard
    // reads its version (it lies one directory above the plugin directory).
    std::string dir(argv[1]);
    dir = dir.substr(0, dir.find_last_of('/') + 1);
    if (!dlopen((dir + "../libnixl.so").c_str(), RTLD_NOW | RTLD_GLOBAL)) {
        std::fprintf(stderr, "dlopen: %s\n", dlerror());
        return 2;
    }
    void *so = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (!so) {
        std::fprintf(stderr, "dlopen: %s\n", dlerror());
        return 2;
    }
    auto init = reinterpret_cast<BackendPlugin *(*)()>(dlsym(so, "nixl_plugin_init"));
    if (!init) {
        std::fprintf(stderr, "no nixl_plugin_init in %s\n", argv[1]);
        return 2;
    }
    Plugin plugin{init()};
    if (oom) return oom_checks(plugin);
    check(plugin.p && plugin.p->api_version == kPluginApiVersion, "the descriptor is of plugin API version 1");
    check(std::string(plugin.p->get_plugin_name()) == "BOUNCE", "the plugin is named BOUNCE");
    params_t options = plugin.p->get_backend_options();
    check(options.count("bounce_arena_size") == 1, "its options list bounce_arena_size with its default");

    {
        // A value that cannot be parsed, and an impossible one, fail creation with an init
        // error, which NIXL reports as the backend's failure (README "Configuration").
        params_t unparsed{{"bounce_arena_size", "lots"}}, impossible{{"bounce_max_inflight_chunks", "0"}};
        BackendEngine *e = plugin.engine("unparsed", unparsed);
        check(!e || e->getInitErr(), "a value that cannot be parsed fails engine creation");
        if (e) plugin.p->destroy_engine(e);
        e = plugin.engine("impossible", impossible);
        check(!e || e->getInitErr(), "an impossible value (a window of 0) fails engine creation");
        if (e) plugin.p->destroy_engine(e);
        // Only our own options must be UTF-8: a UCX param's bytes are UCX's business, and UCX
        // takes them (review 56); one of ours that is not text is refused.
        params_t theirs{{"bounce_cma", "false"}, {"ucx_only_note", "caf\xe9"}},
            ours{{"bounce_control", "uc\xe9"}};
        e = plugin.engine("latin1-ucx", theirs);
        check(e && !e->getInitErr(), "a non-UTF-8 value of a param that is not ours still creates the engine");
        if (e) plugin.p->destroy_engine(e);
        e = plugin.engine("latin1-ours", ours);
        check(!e || e->getInitErr(), "a non-UTF-8 value of one of our options fails engine creation");
        if (e) plugin.p->destroy_engine(e);
    }

    // Two engines of one process; the same-host path off, so a scattered WRITE bounces.
    params_t pa{{"bounce_cma", "false"}}, pb{{"bounce_cma", "false"}};
    Side a, b;
    a.e = plugin.engine("A", pa);
    b.e = plugin.engine("B", pb);
    if (!a.e || a.e->getInitErr() || !b.e || b.e->getInitErr()) {
        check(false, "two engines are created");
        return 1;
    }
    const size_t n = 256, piece = 1024, len = 2 * n * piece;
    check(reg(a, len, 11) && reg(b, len, 22), "each registers a host buffer");

    // Both load each other (a bounce needs the HELLO both ways), A under its own name.
    nixl_status_t st = NIXL_ERR_UNKNOWN;
    BackendMD *b_of_a = load_peer(b, a, "A", &st);
    check(b_of_a != nullptr, "B loads A's conn info and registration", st);
    BackendMD *a_of_b = load_peer(a, b, "B", &st);
    check(a_of_b != nullptr, "A loads B's conn info and registration", st);

    // A scattered WRITE B -> A bounces (once the HELLOs are in: a first one may pass through).
    long bounced_before = stat(b.e, "bounce_ok");
    bool ok = true;
    for (int i = 0; i < 3 && ok; ++i) ok = move_pieces(NIXL_WRITE, b, a, b_of_a, "A", n, piece);
    check(ok, "a WRITE of 256 x 1 KiB pieces B -> A ends in SUCCESS");
    check(exact(b.buf, a.buf, 11, n, piece), "every byte landed, and nothing between the pieces moved");
    check(stat(b.e, "bounce_ok") > bounced_before, "it took the bounce path", stat(b.e, "bounce_ok"));

    // A WRITE with a notification: the target gets it once the bytes are in (NIXL's promise;
    // the bounce path sends it after the last scatter's ACK).
    fill(b.buf, 55);
    const std::string note("kv-ready:7");
    bounced_before = stat(b.e, "bounce_ok");
    notif_list_t got;
    check(move_pieces(NIXL_WRITE, b, a, b_of_a, "A", n, piece, &note, &got),
          "a bounced WRITE with a notification ends in SUCCESS");
    check(notif_from(a.e, "B", got) == note, "A gets its notification from B");
    check(exact(b.buf, a.buf, 11, n, piece), "every byte of it landed, and nothing between the pieces moved");
    check(stat(b.e, "bounce_ok") > bounced_before, "it took the bounce path", stat(b.e, "bounce_ok"));
    // A's application notification to B, outside any transfer, through the inner engine.
    check(a.e->genNotif("B", "hello-b") == NIXL_SUCCESS && notif_from(b.e, "A") == "hello-b",
          "a notification A -> B arrives as sent");
    // One that begins with BOUNCE's frame magic travels escaped and arrives as sent, between
    // two others (the shim's getNotifs strips the escape in place).
    const std::string magic("\0BOUNC like a frame", 19);
    check(a.e->genNotif("B", "before") == NIXL_SUCCESS && a.e->genNotif("B", magic) == NIXL_SUCCESS &&
              a.e->genNotif("B", "after") == NIXL_SUCCESS,
          "three notifications A -> B sent");
    check(notifs_from(b.e, "A", 3) == std::vector<std::string>{"before", magic, "after"},
          "a notification beginning with the frame magic arrives as sent, in its place");

    // A READ: B pulls A's pieces into its own buffer, bounced; every byte checked.
    fill(a.buf, 66);
    fill(b.buf, 77);
    std::vector<uint8_t> want(b.buf.size());
    fill(want, 77);
    for (size_t i = 0; i < n; ++i) std::memcpy(&want[2 * i * piece], &a.buf[(n - 1 - i) * 2 * piece], piece);
    long reads_before = stat(b.e, "bounce_ok");
    check(move_pieces(NIXL_READ, b, a, b_of_a, "A", n, piece), "a READ of 256 x 1 KiB pieces by B from A ends in SUCCESS");
    check(b.buf == want, "every byte read landed, and nothing between the pieces moved");
    check(stat(b.e, "bounce_ok") > reads_before, "it took the bounce path", stat(b.e, "bounce_ok"));

    // An agent name that is not UTF-8 (NIXL's names are any bytes): UCX serves that peer, so
    // BOUNCE leaves it to UCX instead of refusing it (review 52, FFI F7).
    const std::string odd("\xff\xfe-A", 4);
    std::fill(a.buf.begin(), a.buf.end(), 0);
    fill(a.buf, 33);
    fill(b.buf, 44);
    BackendMD *b_of_odd = load_peer(b, a, odd, &st);
    check(b_of_odd != nullptr, "B loads A's conn info and registration under a name that is not UTF-8", st);
    long passed_before = stat(b.e, "passthrough_xfers");
    check(b_of_odd && move_pieces(NIXL_WRITE, b, a, b_of_odd, odd, n, piece), "a WRITE to that name ends in SUCCESS");
    check(exact(b.buf, a.buf, 33, n, piece), "every byte of it landed, and nothing between the pieces moved");
    check(stat(b.e, "passthrough_xfers") > passed_before, "it went to UCX", stat(b.e, "passthrough_xfers"));

    // An op NIXL does not define goes to UCX, which refuses it when posted; nothing is bounced
    // as a WRITE.
    {
        meta_dlist_t local(DRAM_SEG), remote(DRAM_SEG);
        MetaDesc l, r;
        l.addr = reinterpret_cast<uintptr_t>(b.buf.data());
        l.len = r.len = piece;
        l.devId = r.devId = 0;
        l.metadataP = b.md;
        r.addr = reinterpret_cast<uintptr_t>(a.buf.data());
        r.metadataP = b_of_a;
        for (size_t i = 0; i < n; ++i) {
            local.addDesc(l);
            remote.addDesc(r);
        }
        BackendReqH *h = nullptr;
        const auto op = static_cast<nixl_xfer_op_t>(7);
        long passed = stat(b.e, "passthrough_xfers"), bounced = stat(b.e, "bounce_xfers");
        st = b.e->prepXfer(op, local, remote, "A", h, nullptr);
        if (st == NIXL_SUCCESS && h) {
            check(stat(b.e, "passthrough_xfers") == passed + 1, "an undefined op is handed to UCX");
            st = b.e->postXfer(op, local, remote, "A", h, nullptr);
            b.e->releaseReqH(h);
        }
        check(st != NIXL_SUCCESS && st != NIXL_IN_PROG, "an undefined op is refused", st);
        check(stat(b.e, "bounce_xfers") == bounced, "and never bounced", stat(b.e, "bounce_xfers"));
    }
    {
        notif_list_t not_empty{{"x", "y"}};
        st = a.e->getNotifs(not_empty);
        check(st == NIXL_ERR_INVALID_PARAM, "getNotifs refuses a list that is not empty", st);
    }
    // A conn info that is not BOUNCE's: a clear error, nothing recorded, no crash.
    st = b.e->loadRemoteConnInfo("C", std::string("\x01garbage", 8));
    check(st != NIXL_SUCCESS, "a malformed conn info is refused", st);

    // Teardown as NIXL's core does it.
    for (BackendMD *m : {b_of_a, b_of_odd})
        if (m) b.e->unloadMD(m);
    if (a_of_b) a.e->unloadMD(a_of_b);
    b.e->disconnect("A");
    b.e->disconnect(odd);
    a.e->disconnect("B");
    check(a.e->deregisterMem(a.md) == NIXL_SUCCESS && b.e->deregisterMem(b.md) == NIXL_SUCCESS,
          "the buffers deregister");
    plugin.p->destroy_engine(a.e);
    plugin.p->destroy_engine(b.e);
    std::printf("%s: %d failed\n", failures ? "FAILED" : "passed", failures);
    return failures ? 1 : 0;
}
