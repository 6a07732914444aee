// The C++ edge of BOUNCE: NIXL's engine class, implemented over our own ABI declarations.
//
// It owns no policy. Each method either forwards to the inner UCX engine (created from NIXL's own
// UCX plugin, which Rust located and loaded) or hands plain data to Rust through bounce_ffi.h
// and acts on the answer. C++ exceptions never leave a method: every status-returning override
// runs through `guarded` (NIXL's core does not expect exceptions from a backend), and the sinks
// Rust calls are noexcept.
#include <dlfcn.h>

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <string>
#include <vector>

#include "bounce_ffi.h"
#include "nixl_abi.h"

using namespace nixl_abi;

namespace {

bnc_str view(const std::string &s) {
    return bnc_str{reinterpret_cast<const uint8_t *>(s.data()), s.size()};
}

// The sinks Rust calls back into: nothing may unwind into Rust (undefined behaviour there), so
// an allocation failure is swallowed; the bytes are then missing, as after any failed copy.
void assign_sink(void *ctx, const uint8_t *ptr, size_t len) noexcept {
    try {
        static_cast<std::string *>(ctx)->assign(reinterpret_cast<const char *>(ptr), len);
    } catch (...) {
    }
}

// A sink's target that remembers a copy that failed (no memory): the call is then an error,
// never a SUCCESS with its bytes missing (an empty conn info or registration blob, which a peer's
// UCX would parse as an rkey; review 62).
struct Into {
    std::string *s;
    bool lost = false;
};

void into_sink(void *ctx, const uint8_t *ptr, size_t len) noexcept {
    auto *in = static_cast<Into *>(ctx);
    try {
        in->s->assign(reinterpret_cast<const char *>(ptr), len);
    } catch (...) {
        in->lost = true;
    }
}

std::string self_path() {
    Dl_info info{};
    if (dladdr(reinterpret_cast<void *>(&bnc_shim_plugin), &info) != 0 && info.dli_fname)
        return info.dli_fname;
    return {};
}

void pair_sink(void *ctx, const uint8_t *a, size_t al, const uint8_t *b, size_t bl) noexcept {
    try {
        static_cast<notif_list_t *>(ctx)->emplace_back(
            std::string(reinterpret_cast<const char *>(a), al),
            std::string(reinterpret_cast<const char *>(b), bl));
    } catch (...) {
    }
}

// What NIXL holds for a request on BOUNCE: either the inner engine's own handle (pass-through)
// or the id of a request Rust owns (bounce path).
struct BounceReqH final : BackendReqH {
    BackendReqH *inner = nullptr;
    uint64_t xfer = 0;
};

// NIXL's meta descriptor and the ABI's have one layout, so prepXfer hands NIXL's own lists to
// Rust as they are. Copying them into lists of the ABI's type cost a prep of 8192 descriptors
// (as vLLM's connector makes for every request, issue 13) about 25 us on 2 cores. The Rust side
// asserts its view of the ABI type the same way (src/ffi/abi.rs).
static_assert(sizeof(MetaDesc) == sizeof(bnc_meta_desc), "meta descriptor size");
static_assert(alignof(MetaDesc) == alignof(bnc_meta_desc), "meta descriptor alignment");
// MetaDesc derives from BasicDesc, so it is not standard-layout and offsetof is only
// conditionally supported; g++ and clang lay a base's members out first and support it.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Winvalid-offsetof"
static_assert(offsetof(MetaDesc, addr) == offsetof(bnc_meta_desc, addr), "addr");
static_assert(offsetof(MetaDesc, len) == offsetof(bnc_meta_desc, len), "len");
static_assert(offsetof(MetaDesc, devId) == offsetof(bnc_meta_desc, dev), "devId");
static_assert(offsetof(MetaDesc, metadataP) == offsetof(bnc_meta_desc, md), "metadataP");
#pragma GCC diagnostic pop
// The ABI type itself, pinned to the numbers src/ffi/abi.rs pins its BncMetaDesc to: with the
// asserts above, NIXL's layout, the header's and Rust's are checked against each other.
static_assert(sizeof(bnc_meta_desc) == 32 && offsetof(bnc_meta_desc, addr) == 0 &&
                  offsetof(bnc_meta_desc, len) == 8 && offsetof(bnc_meta_desc, dev) == 16 &&
                  offsetof(bnc_meta_desc, md) == 24,
              "bnc_meta_desc as src/ffi/abi.rs declares it");

// `l`'s descriptors as the ABI's type (see the asserts above): valid while `l` is unchanged.
const bnc_meta_desc *abi_descs(const meta_dlist_t &l) {
    return reinterpret_cast<const bnc_meta_desc *>(l.descs.data());
}

// Every status-returning override runs its body through this: no C++ exception (an allocation
// failure, a std::string throw) may propagate into NIXL's core, which does not expect one.
template <typename F> static nixl_status_t guarded(F &&f) noexcept {
    try {
        return f();
    } catch (...) {
        return NIXL_ERR_UNKNOWN;
    }
}

class BounceEngine final : public BackendEngine {
public:
    BounceEngine(const BackendInitParams *p) : BackendEngine(p) {
        try {
            init(p);
        } catch (const std::exception &e) {
            fail(std::string("BOUNCE: engine creation threw: ") + e.what());
        } catch (...) {
            fail("BOUNCE: engine creation threw an unknown exception");
        }
    }

    ~BounceEngine() override {
        // Rust's bounce path first (its reactor uses the inner engine until joined, and the
        // arena and peer arenas are released through it), then the inner engine, then the Rust
        // engine, which owns the UCX plugin library plugin_ points into.
        if (rust_) bnc_engine_stop(rust_);
        if (inner_ && plugin_) plugin_->destroy_engine(inner_);
        inner_ = nullptr;
        plugin_ = nullptr;
        if (rust_) bnc_engine_destroy(rust_);
        rust_ = nullptr;
    }

    bool supportsRemote() const override { return inner_->supportsRemote(); }
    bool supportsLocal() const override { return inner_->supportsLocal(); }
    bool supportsNotif() const override { return inner_->supportsNotif(); }
    mem_list_t getSupportedMems() const override { return inner_->getSupportedMems(); }

    nixl_status_t registerMem(const BlobDesc &mem, const nixl_mem_t &nixl_mem,
                              BackendMD *&out) override {
        return guarded([&]() -> nixl_status_t {
            Lock g(mu_);
            nixl_status_t st = inner_->registerMem(mem, nixl_mem, out);
            if (st == NIXL_SUCCESS && out)
                bnc_mem_registered(rust_, out, mem.addr, mem.len, mem.devId, nixl_mem);
            return st;
        });
    }
    nixl_status_t deregisterMem(BackendMD *meta) override {
        return guarded([&]() -> nixl_status_t {
            bnc_mem_deregistered(rust_, meta);
            Lock g(mu_);
            return inner_->deregisterMem(meta);
        });
    }
    nixl_status_t connect(const std::string &agent) override {
        return guarded([&]() -> nixl_status_t {
            Lock g(mu_);
            return inner_->connect(agent);
        });
    }
    nixl_status_t disconnect(const std::string &agent) override {
        return guarded([&]() -> nixl_status_t {
            bnc_peer_lost(rust_, view(agent));
            Lock g(mu_);
            return inner_->disconnect(agent);
        });
    }
    nixl_status_t unloadMD(BackendMD *input) override {
        return guarded([&]() -> nixl_status_t {
            bnc_remote_md_unloaded(rust_, input);
            Lock g(mu_);
            return inner_->unloadMD(input);
        });
    }

    nixl_status_t prepXfer(const nixl_xfer_op_t &op, const meta_dlist_t &local,
                           const meta_dlist_t &remote, const std::string &agent,
                           BackendReqH *&handle, const BackendOptArgs *opt) const override {
        return guarded([&]() -> nixl_status_t {
            // The wrapper first: once Rust has prepared a request (an entry of its own, mapped
            // peer memory), nothing may fail before the wrapper owns it.
            // Owned until handed to NIXL: an exception from the inner prepXfer (caught by
            // `guarded`) must not leak it.
            std::unique_ptr<BounceReqH> h(new (std::nothrow) BounceReqH());
            if (!h) return NIXL_ERR_BACKEND;
            uint64_t xfer = 0;
            auto st = static_cast<nixl_status_t>(bnc_xfer_prep(
                rust_, op, abi_descs(local), local.descs.size(), local.type, abi_descs(remote),
                remote.descs.size(), remote.type, view(agent), &xfer));
            if (st != NIXL_SUCCESS) return st;
            h->xfer = xfer;
            if (xfer == 0) {
                Lock g(mu_);
                nixl_status_t st = inner_->prepXfer(op, local, remote, agent, h->inner, opt);
                if (st != NIXL_SUCCESS) return st;
            }
            handle = h.release();
            // Routing counters changed: publish them (prep is once per request, not a hot path).
            const_cast<BounceEngine *>(this)->refreshStats();
            return NIXL_SUCCESS;
        });
    }
    nixl_status_t postXfer(const nixl_xfer_op_t &op, const meta_dlist_t &local,
                           const meta_dlist_t &remote, const std::string &agent,
                           BackendReqH *&handle, const BackendOptArgs *opt) const override {
        return guarded([&]() -> nixl_status_t {
            auto *h = static_cast<BounceReqH *>(handle);
            if (!h) return NIXL_ERR_INVALID_PARAM;
            if (h->xfer != 0) {
                bnc_str msg{};
                const bool has = opt && opt->hasNotif;
                if (has) msg = view(opt->notifMsg);
                return static_cast<nixl_status_t>(bnc_xfer_post(rust_, h->xfer, msg, has ? 1 : 0));
            }
            if (opt && opt->hasNotif) {
                std::string escaped;
                const std::string *msg = wireNotif(opt->notifMsg, escaped);
                if (!msg) return NIXL_ERR_BACKEND;
                if (msg != &opt->notifMsg) {
                    // NIXL's optional args are these three fields (nixl_abi.h), so a copy with
                    // the escaped message is what the inner engine would have been given.
                    BackendOptArgs with_escape = *opt;
                    with_escape.notifMsg = std::move(escaped);
                    Lock g(mu_);
                    return inner_->postXfer(op, local, remote, agent, h->inner, &with_escape);
                }
            }
            Lock g(mu_);
            return inner_->postXfer(op, local, remote, agent, h->inner, opt);
        });
    }
    nixl_status_t checkXfer(BackendReqH *handle) const override {
        return guarded([&]() -> nixl_status_t {
            auto *h = static_cast<BounceReqH *>(handle);
            if (!h) return NIXL_ERR_INVALID_PARAM;
            if (h->xfer != 0) {
                auto st = static_cast<nixl_status_t>(bnc_xfer_check(rust_, h->xfer));
                // NIXL calls checkXfer through a const engine, but the engine object itself is
                // never const: publishing fresh counters when a bounce request settles is fine.
                if (st != NIXL_IN_PROG) const_cast<BounceEngine *>(this)->refreshStats();
                return st;
            }
            nixl_status_t st;
            {
                Lock g(mu_);
                st = inner_->checkXfer(h->inner);
            }
            if (st != NIXL_IN_PROG) const_cast<BounceEngine *>(this)->refreshStats();
            return st;
        });
    }
    nixl_status_t releaseReqH(BackendReqH *handle) const override {
        return guarded([&]() -> nixl_status_t {
            auto *h = static_cast<BounceReqH *>(handle);
            if (!h) return NIXL_ERR_INVALID_PARAM;
            // The wrapper lives exactly as long as NIXL holds the handle: NIXL keeps a handle
            // whose release failed and releases it again later, so a wrapper deleted before an
            // error would be used after free then.
            if (h->xfer != 0) {
                // Whatever this returns, Rust holds nothing more for the handle (an unknown one
                // was never or is no longer its; a panic was caught and logged there): the
                // handle is gone, and saying so keeps NIXL from releasing it again.
                (void)bnc_xfer_release(rust_, h->xfer);
                delete h;
                return NIXL_SUCCESS;
            }
            if (h->inner) {
                nixl_status_t st;
                {
                    Lock g(mu_);
                    st = inner_->releaseReqH(h->inner);
                }
                if (st != NIXL_SUCCESS) return st;  // still the inner engine's: kept for the retry
            }
            delete h;
            return NIXL_SUCCESS;
        });
    }

    nixl_status_t prepMemView(const remote_meta_dlist_t &l, mem_view_t &v,
                              const BackendOptArgs *o) const override {
        return guarded([&]() -> nixl_status_t {
            Lock g(mu_);
            return inner_->prepMemView(l, v, o);
        });
    }
    nixl_status_t prepMemView(const meta_dlist_t &l, mem_view_t &v,
                              const BackendOptArgs *o) const override {
        return guarded([&]() -> nixl_status_t {
            Lock g(mu_);
            return inner_->prepMemView(l, v, o);
        });
    }
    void releaseMemView(mem_view_t v) const override {
        // No status to report an exception with, and none may reach NIXL.
        try {
            Lock g(mu_);
            inner_->releaseMemView(v);
        } catch (...) {
        }
    }
    // Our registration's public data: the inner blob wrapped with the registration's id and
    // key, which a peer needs to name it as a bounce destination (Rust: shell/keys.rs).
    nixl_status_t getPublicData(const BackendMD *md, std::string &s) const override {
        return guarded([&]() -> nixl_status_t {
            std::string inner;
            {
                Lock g(mu_);
                nixl_status_t st = inner_->getPublicData(md, inner);
                if (st != NIXL_SUCCESS) return st;
            }
            s.clear();
            Into into{&s};
            auto st = static_cast<nixl_status_t>(bnc_public_data_wrap(rust_, md, view(inner), into_sink, &into));
            return st == NIXL_SUCCESS && into.lost ? NIXL_ERR_BACKEND : st;
        });
    }

    nixl_status_t getConnInfo(std::string &out) const override {
        return guarded([&]() -> nixl_status_t {
            std::string inner;
            {
                Lock g(mu_);
                nixl_status_t st = inner_->getConnInfo(inner);
                if (st != NIXL_SUCCESS) return st;
            }
            Into into{&out};
            auto st = static_cast<nixl_status_t>(bnc_conn_info_wrap(rust_, view(inner), into_sink, &into));
            return st == NIXL_SUCCESS && into.lost ? NIXL_ERR_BACKEND : st;
        });
    }
    nixl_status_t loadRemoteConnInfo(const std::string &agent, const std::string &conn) override {
        return guarded([&]() -> nixl_status_t {
            std::string inner;
            Into into{&inner};
            auto st = static_cast<nixl_status_t>(
                bnc_conn_info_load(rust_, view(agent), view(conn), into_sink, &into));
            if (st != NIXL_SUCCESS) return st;
            if (into.lost) {
                // Rust recorded the peer: drop it again, as for a load the inner engine refused.
                bnc_conn_info_failed(rust_, view(agent));
                return NIXL_ERR_BACKEND;
            }
            {
                Lock g(mu_);
                // Caught here, not by `guarded`: the peer Rust just recorded must be dropped
                // below, or Rust would admit its frames with nothing to answer them through.
                try {
                    st = inner_->loadRemoteConnInfo(agent, inner);
                } catch (...) {
                    st = NIXL_ERR_UNKNOWN;
                }
                if (st == NIXL_SUCCESS) {
                    loadPeerArenas(agent);
                    return NIXL_SUCCESS;
                }
            }
            // NIXL keeps no connection to the agent: neither may we (a peer recorded as loaded
            // would have its frames admitted with nothing to answer them through). Outside the
            // inner lock, as disconnect calls bnc_peer_lost.
            bnc_conn_info_failed(rust_, view(agent));
            return st;
        });
    }
    // A peer's registration: the inner engine loads the inner blob; Rust remembers the key it
    // carried by the inner remote md (a blob that is not ours loads as is, with no key).
    nixl_status_t loadRemoteMD(const BlobDesc &in, const nixl_mem_t &mem, const std::string &agent,
                               BackendMD *&out) override {
        return guarded([&]() -> nixl_status_t {
            BlobDesc inner = in;
            inner.metaInfo.clear();
            uint64_t reg = 0, ticket = 0;
            uint8_t key[32] = {};
            int32_t has_key = 0;
            Into into{&inner.metaInfo};
            auto st = static_cast<nixl_status_t>(bnc_remote_md_split(rust_, view(in.metaInfo), into_sink, &into,
                                                                     &reg, key, &has_key, &ticket));
            if (st != NIXL_SUCCESS) return st;
            // Every path below reports this blob's load, so the record it carried is kept for
            // its own handle or dropped: never left for another blob's load to take.
            struct Report {
                void *rust;
                uint64_t ticket;
                bool done = false;
                ~Report() {
                    if (!done) bnc_remote_md_load_failed(rust, ticket);
                }
            } report{rust_, ticket};
            if (into.lost) return NIXL_ERR_BACKEND;  // the report drops the record it carried
            {
                Lock g(mu_);
                st = inner_->loadRemoteMD(inner, mem, agent, out);
            }
            if (st == NIXL_SUCCESS && out && has_key) {
                bnc_remote_md_loaded(rust_, out, reg, key, ticket);
                report.done = true;
            }
            return st;
        });
    }
    nixl_status_t loadLocalMD(BackendMD *in, BackendMD *&out) override {
        return guarded([&]() -> nixl_status_t {
            Lock g(mu_);
            return inner_->loadLocalMD(in, out);
        });
    }
    nixl_status_t getNotifs(notif_list_t &list) override {
        return guarded([&]() -> nixl_status_t {
            if (!list.empty()) return NIXL_ERR_INVALID_PARAM;
            bool control = false;
            std::optional<nixl_status_t> st = pullDirect(list, control);
            // Outside the inner lock: the reactor pass this may run takes it again.
            if (control) bnc_control_arrived(rust_);
            if (!st) {
                // Rust pulls from the inner engine (bnc_shim_poll_notifs) and sorts what
                // arrived, after what its reactor pulled earlier.
                st = static_cast<nixl_status_t>(bnc_notif_take(rust_, pair_sink, &list));
            }
            if (*st != NIXL_SUCCESS) return *st;
            refreshStats();
            return NIXL_SUCCESS;
        });
    }
    nixl_status_t genNotif(const std::string &agent, const std::string &msg) const override {
        return guarded([&]() -> nixl_status_t {
            std::string escaped;
            const std::string *out = wireNotif(msg, escaped);
            if (!out) return NIXL_ERR_BACKEND;
            Lock g(mu_);
            return inner_->genNotif(agent, *out);
        });
    }
    nixl_status_t queryMem(const RegDescListTag &d, std::vector<query_resp_t> &r) const override {
        return guarded([&]() -> nixl_status_t {
            Lock g(mu_);
            return inner_->queryMem(d, r);
        });
    }
    nixl_status_t estimateXferCost(const nixl_xfer_op_t &op, const meta_dlist_t &l,
                                   const meta_dlist_t &r, const std::string &a,
                                   BackendReqH *const &h, std::chrono::microseconds &d,
                                   std::chrono::microseconds &e, nixl_cost_t &m,
                                   const AgentOptArgsTag *x) const override {
        return guarded([&]() -> nixl_status_t {
            auto *bh = static_cast<BounceReqH *>(h);
            if (bh && bh->xfer != 0) return NIXL_ERR_NOT_SUPPORTED;
            BackendReqH *inner_h = bh ? bh->inner : nullptr;
            Lock g(mu_);
            return inner_->estimateXferCost(op, l, r, a, inner_h, d, e, m, x);
        });
    }

    // ---- for the bounce reactor (bnc_shim_*) ----
    nixl_status_t shimRegister(uint64_t addr, uint64_t len, uint64_t dev, int32_t mem,
                               void **md, bnc_sink key, void *key_ctx) {
        BlobDesc d;
        d.addr = addr;
        d.len = len;
        d.devId = dev;
        BackendMD *out = nullptr;
        const nixl_mem_t m = static_cast<nixl_mem_t>(mem);
        Lock g(mu_);
        nixl_status_t st = inner_->registerMem(d, m, out);
        if (st != NIXL_SUCCESS) return st;
        std::string pub;
        st = inner_->getPublicData(out, pub);
        if (st != NIXL_SUCCESS) {
            inner_->deregisterMem(out);
            return st;
        }
        *md = out;
        key(key_ctx, reinterpret_cast<const uint8_t *>(pub.data()), pub.size());
        return NIXL_SUCCESS;
    }
    nixl_status_t shimDeregister(void *md) {
        Lock g(mu_);
        return inner_->deregisterMem(static_cast<BackendMD *>(md));
    }
    nixl_status_t shimUnload(void *md) {
        Lock g(mu_);
        return inner_->unloadMD(static_cast<BackendMD *>(md));
    }
    nixl_status_t shimConnInfo(bnc_sink out, void *ctx) {
        std::string s;
        Lock g(mu_);
        nixl_status_t st = inner_->getConnInfo(s);
        if (st == NIXL_SUCCESS) out(ctx, reinterpret_cast<const uint8_t *>(s.data()), s.size());
        return st;
    }
    // One single-descriptor transfer through the inner engine: a bounce write (WRITE), or a
    // one-way initiator's fetch of a peer's mailbox (READ).
    nixl_status_t shimPost(nixl_xfer_op_t op, const std::string &agent, nixl_mem_t lmem,
                           nixl_mem_t rmem, void *lmd, uint64_t laddr, uint64_t ldev, void *rmd,
                           uint64_t raddr, uint64_t rdev, uint64_t len, void **handle) {
        meta_dlist_t local(lmem), remote(rmem);
        MetaDesc l;
        l.addr = laddr;
        l.len = len;
        l.devId = ldev;
        l.metadataP = static_cast<BackendMD *>(lmd);
        MetaDesc r;
        r.addr = raddr;
        r.len = len;
        r.devId = rdev;
        r.metadataP = static_cast<BackendMD *>(rmd);
        local.descs.push_back(l);
        remote.descs.push_back(r);
        const BackendOptArgs no_notif{};
        BackendReqH *h = nullptr;
        Lock g(mu_);
        nixl_status_t st = inner_->prepXfer(op, local, remote, agent, h, &no_notif);
        if (st != NIXL_SUCCESS) return st;
        st = inner_->postXfer(op, local, remote, agent, h, &no_notif);
        if (st < 0) {
            inner_->releaseReqH(h);
            return st;
        }
        *handle = h;
        return st;
    }
    nixl_status_t shimCheck(void *h) {
        Lock g(mu_);
        return inner_->checkXfer(static_cast<BackendReqH *>(h));
    }
    void shimRelease(void *h) {
        Lock g(mu_);
        inner_->releaseReqH(static_cast<BackendReqH *>(h));
    }
    nixl_status_t shimGenNotif(const std::string &agent, const std::string &msg) {
        Lock g(mu_);
        return inner_->genNotif(agent, msg);
    }
    // The short way of getNotifs (see bnc_notif_direct): the inner engine's notifications go
    // straight into the caller's list, only control frames are handed to Rust, all under the
    // inner lock so no pull of the reactor's overtakes them. Returns the inner engine's status,
    // or nothing when the long way must be taken.
    // `control` is set when control frames were handed over, the bounce path is busy or frames
    // may wait on the control channel's own socket (ZMQ).
    std::optional<nixl_status_t> pullDirect(notif_list_t &list, bool &control) {
        Lock g(mu_);
        const int32_t direct = bnc_notif_direct(rust_);
        if (direct != 1 && direct != 2) return std::nullopt;
        control = direct == 2;
        nixl_status_t st = inner_->getNotifs(list);
        if (st != NIXL_SUCCESS) {
            list.clear();
            return st;
        }
        // In place, in arrival order: control frames leave the list, an escaped notification
        // loses its escape.
        auto kept = list.begin();
        for (auto &n : list) {
            size_t skip = 0;
            const bool c = bnc_notif_divert(rust_, reinterpret_cast<const uint8_t *>(n.first.data()),
                                            n.first.size(),
                                            reinterpret_cast<const uint8_t *>(n.second.data()),
                                            n.second.size(), &skip) == 1;
            control |= c;
            if (c) continue;
            if (skip != 0) n.second.erase(0, std::min(skip, n.second.size()));
            if (&*kept != &n) *kept = std::move(n);
            ++kept;
        }
        list.erase(kept, list.end());
        return NIXL_SUCCESS;
    }
    // `polled` null: waits for the inner lock. Otherwise only tries it, and sets `*polled` to 0
    // when another thread holds it (nothing pulled), 1 when it pulled.
    nixl_status_t pollNotifs(bnc_pair_sink sink, void *ctx, int32_t *polled) {
        notif_list_t got;
        {
            std::unique_lock<std::recursive_mutex> g(mu_, std::defer_lock);
            if (polled) {
                *polled = g.try_lock() ? 1 : 0;
                if (!*polled) return NIXL_SUCCESS;
            } else {
                g.lock();
            }
            nixl_status_t st = inner_->getNotifs(got);
            if (st != NIXL_SUCCESS) return st;
        }
        for (const auto &n : got) {
            sink(ctx, reinterpret_cast<const uint8_t *>(n.first.data()), n.first.size(),
                 reinterpret_cast<const uint8_t *>(n.second.data()), n.second.size());
        }
        return NIXL_SUCCESS;
    }

private:
    using Lock = std::lock_guard<std::recursive_mutex>;

    // The bytes an application notification travels as: `msg` itself, or its escape in
    // `escaped` (bnc_notif_escape: one that begins with BOUNCE's frame magic, which the peer
    // would take for a control frame). Null when the escape could not be copied (no memory).
    const std::string *wireNotif(const std::string &msg, std::string &escaped) const {
        if (bnc_notif_escape(rust_, view(msg), assign_sink, &escaped) != 1) return &msg;
        return escaped.empty() ? nullptr : &escaped;
    }

    // The peer's arenas, when it can bounce (each it advertises, in order), and its mailbox's
    // host registration, when it keeps one: loaded through the inner engine like any remote
    // registration, so bounce writes and mailbox READs use UCX's own remote key handling.
    // Called with mu_ held. Throws nothing: the inner engine has loaded the peer by now, and an exception out of here
    // would fail the load in NIXL while the inner engine and Rust keep the peer (NIXL's retry
    // would then be refused by UCX as already loaded, for good). An arena whose registration
    // does not load is left without one: transfers through it go to UCX.
    void loadPeerArenas(const std::string &agent) noexcept {
        auto load = [&](uint64_t a, uint64_t n, uint64_t devId, nixl_mem_t m, const std::string &k) -> BackendMD * {
            try {
                BlobDesc d;
                d.addr = a;
                d.len = n;
                d.devId = devId;
                d.metaInfo = k;
                BackendMD *md = nullptr;
                if (inner_->loadRemoteMD(d, m, agent, md) != NIXL_SUCCESS) md = nullptr;
                return md;
            } catch (...) {
                return nullptr;
            }
        };
        // Each of the peer's arenas in turn (index 0 also says HELLO and carries the mailbox).
        for (uint32_t i = 0; i < BNC_MAX_ARENAS; ++i) {
            uint64_t addr = 0, len = 0, dev = 0, mbox_addr = 0, mbox_len = 0;
            int32_t mem = 0;
            std::string key, mbox_key;
            Into key_into{&key}, mbox_into{&mbox_key};
            const int32_t found = bnc_peer_loaded(rust_, view(agent), i, &addr, &len, &dev, &mem, into_sink,
                                                  &key_into, &mbox_addr, &mbox_len, into_sink, &mbox_into);
            if (!(found & 1)) return;
            // A key that could not be copied is a load that failed: nothing goes through it.
            BackendMD *md = key_into.lost ? nullptr : load(addr, len, dev, static_cast<nixl_mem_t>(mem), key);
            BackendMD *mbox =
                (found & 2) && !mbox_into.lost ? load(mbox_addr, mbox_len, 0, DRAM_SEG, mbox_key) : nullptr;
            bnc_peer_arena_md(rust_, view(agent), i, md, mbox);
        }
    }

    // Publishes the counters as "stats.*" backend params, readable through NIXL's own
    // getBackendParams. The keys are inserted once at creation so later updates never rehash
    // the map a reader may be iterating; values are short (SSO) strings.
    // Rust hands over only the counters that changed since the last publish (while holding its
    // publish lock, so concurrent publishers stay ordered), so a polling loop (getNotifs,
    // checkXfer) pays neither the formatting nor the lock when nothing moved.
    void refreshStats() {
        bnc_stats(rust_, [](void *ctx, size_t i, const uint8_t *name, size_t n, uint64_t v) noexcept {
            // Called from Rust: nothing may unwind out of here (a lost counter update is fine).
            try {
                static_cast<BounceEngine *>(ctx)->setStat(i, name, n, v);
            } catch (...) {
            }
        }, this);
    }
    // Counter i's value in the params map: its key is built and looked up once (at creation,
    // when every counter is published), then reached by index. References to an unordered_map's
    // values stay valid across inserts and rehashes, and no key is ever erased.
    void setStat(size_t i, const uint8_t *name, size_t n, uint64_t v) {
        Lock g(mu_);
        if (i >= statValues_.size()) statValues_.resize(i + 1, nullptr);
        std::string *&slot = statValues_[i];
        if (!slot)
            slot = &mutableParams()["stats." + std::string(reinterpret_cast<const char *>(name), n)];
        *slot = std::to_string(v);
    }
    void fail(const std::string &why) {
        std::fprintf(stderr, "%s\n", why.c_str());
        initErr = true;
    }

    void init(const BackendInitParams *p) {
        // Hand Rust every param; it keeps its own (bounce_*) and tells us how to create the inner
        // engine. The inner engine gets the UCX params only.
        std::vector<bnc_kv> kvs;
        params_t inner_params;
        if (p->customParams) {
            kvs.reserve(p->customParams->size());
            for (const auto &kv : *p->customParams) {
                kvs.push_back(bnc_kv{view(kv.first), view(kv.second)});
                if (kv.first.rfind("bounce_", 0) != 0) inner_params.emplace(kv.first, kv.second);
            }
        }
        const std::string me = self_path();
        bnc_create_args args{view(p->localAgent), kvs.data(),
                             kvs.size(),          p->enableProgTh ? 1 : 0,
                             p->pthrDelay,        static_cast<int32_t>(p->syncMode),
                             view(me)};
        bnc_create_out out{};
        std::string err;
        int32_t st = bnc_engine_create(&args, &out, assign_sink, &err);
        if (st != NIXL_SUCCESS) {
            fail("BOUNCE: " + err);
            return;
        }
        rust_ = out.engine;
        plugin_ = static_cast<const BackendPlugin *>(out.inner_plugin);

        BackendInitParams ip;
        ip.localAgent = p->localAgent;
        ip.type = "UCX";
        ip.customParams = &inner_params;
        ip.enableProgTh = out.inner_prog_th != 0;
        ip.pthrDelay = out.inner_pthr_delay_us;
        ip.syncMode = static_cast<nixl_thread_sync_t>(out.inner_sync_mode);
        ip.enableTelemetry = false;
        inner_ = plugin_->create_engine(&ip);
        if (!inner_) {
            fail("BOUNCE: the inner UCX plugin returned no engine");
            return;
        }
        if (inner_->getInitErr()) {
            fail("BOUNCE: the inner UCX engine failed to initialize (see UCX log above)");
            plugin_->destroy_engine(inner_);
            inner_ = nullptr;
            return;
        }
        if (bnc_engine_attach(rust_, this) != NIXL_SUCCESS) {
            fail("BOUNCE: could not attach the inner engine");
            return;
        }
        refreshStats();
    }

    void *rust_ = nullptr;
    std::vector<std::string *> statValues_; // by counter index; see setStat (under mu_)
    mutable std::recursive_mutex mu_; // serializes every call into the inner engine
    const BackendPlugin *plugin_ = nullptr;
    BackendEngine *inner_ = nullptr;
};

BackendEngine *create_engine(const BackendInitParams *p) {
    try {
        return new BounceEngine(p);
    } catch (...) {
        return nullptr;
    }
}

void destroy_engine(BackendEngine *e) { delete e; }

const char *plugin_name() { return bnc_plugin_name(); }
const char *plugin_version() { return bnc_plugin_version(); }

// Our options (from the manifest) plus UCX's: every UCX param passes through unchanged.
params_t backend_options() {
    params_t m;
    const std::string me = self_path();
    if (auto *ucx = static_cast<const BackendPlugin *>(bnc_default_inner_plugin(view(me)))) {
        try {
            m = ucx->get_backend_options();
        } catch (...) {
            m.clear();
        }
    }
    for (size_t i = 0, n = bnc_option_count(); i < n; ++i) {
        bnc_str k{}, v{};
        if (bnc_option_at(i, &k, &v) != NIXL_SUCCESS) break;
        m.emplace(std::string(reinterpret_cast<const char *>(k.ptr), k.len),
                  std::string(reinterpret_cast<const char *>(v.ptr), v.len));
    }
    return m;
}

mem_list_t backend_mems() { return {DRAM_SEG, VRAM_SEG}; }

const BackendPlugin kPlugin{kPluginApiVersion, create_engine,   destroy_engine, plugin_name,
                            plugin_version,    backend_options, backend_mems};

} // namespace

extern "C" const void *bnc_shim_plugin(void) { return &kPlugin; }

namespace {
BounceEngine *eng(void *shim) { return static_cast<BounceEngine *>(shim); }
std::string str(bnc_str s) { return std::string(reinterpret_cast<const char *>(s.ptr), s.len); }
} // namespace

// The bounce reactor's view of the inner engine. Exceptions from the inner engine become
// NIXL_ERR_BACKEND here: they must never unwind into Rust.
#define BNC_SHIM_TRY(expr)                                                                         \
    try {                                                                                          \
        return expr;                                                                               \
    } catch (...) {                                                                                \
        return NIXL_ERR_BACKEND;                                                                   \
    }

extern "C" int32_t bnc_shim_register(void *shim, uint64_t addr, uint64_t len, uint64_t dev,
                                     int32_t mem, void **md, bnc_sink key, void *key_ctx) {
    BNC_SHIM_TRY(eng(shim)->shimRegister(addr, len, dev, mem, md, key, key_ctx))
}
extern "C" int32_t bnc_shim_deregister(void *shim, void *md) {
    BNC_SHIM_TRY(eng(shim)->shimDeregister(md))
}
extern "C" int32_t bnc_shim_unload_md(void *shim, void *md) {
    BNC_SHIM_TRY(eng(shim)->shimUnload(md))
}
extern "C" int32_t bnc_shim_conn_info(void *shim, bnc_sink out, void *ctx) {
    BNC_SHIM_TRY(eng(shim)->shimConnInfo(out, ctx))
}
extern "C" int32_t bnc_shim_write(void *shim, bnc_str agent, int32_t lmem, int32_t rmem,
                                  void *lmd, uint64_t laddr, uint64_t ldev, void *rmd,
                                  uint64_t raddr, uint64_t rdev, uint64_t len, void **handle) {
    BNC_SHIM_TRY(eng(shim)->shimPost(NIXL_WRITE, str(agent), static_cast<nixl_mem_t>(lmem),
                                     static_cast<nixl_mem_t>(rmem), lmd, laddr, ldev, rmd, raddr,
                                     rdev, len, handle))
}
extern "C" int32_t bnc_shim_read(void *shim, bnc_str agent, int32_t lmem, int32_t rmem,
                                 void *lmd, uint64_t laddr, uint64_t ldev, void *rmd,
                                 uint64_t raddr, uint64_t rdev, uint64_t len, void **handle) {
    BNC_SHIM_TRY(eng(shim)->shimPost(NIXL_READ, str(agent), static_cast<nixl_mem_t>(lmem),
                                     static_cast<nixl_mem_t>(rmem), lmd, laddr, ldev, rmd, raddr,
                                     rdev, len, handle))
}
extern "C" int32_t bnc_shim_check(void *shim, void *handle) {
    BNC_SHIM_TRY(eng(shim)->shimCheck(handle))
}
extern "C" void bnc_shim_release(void *shim, void *handle) {
    try {
        eng(shim)->shimRelease(handle);
    } catch (...) {
    }
}
extern "C" int32_t bnc_shim_gen_notif(void *shim, bnc_str agent, bnc_str msg) {
    BNC_SHIM_TRY(eng(shim)->shimGenNotif(str(agent), str(msg)))
}
extern "C" int32_t bnc_shim_poll_notifs(void *shim, bnc_pair_sink sink, void *ctx) {
    BNC_SHIM_TRY(eng(shim)->pollNotifs(sink, ctx, nullptr))
}
extern "C" int32_t bnc_shim_try_poll_notifs(void *shim, bnc_pair_sink sink, void *ctx,
                                            int32_t *polled) {
    *polled = 0;
    BNC_SHIM_TRY(eng(shim)->pollNotifs(sink, ctx, polled))
}
