// The C++ edge of BOUNCE: NIXL's engine class, implemented over our own ABI declarations.
//
// It owns no policy. Each method either forwards to the inner UCX engine (created from NIXL's own
// UCX plugin, which Rust located and loaded) or hands plain data to Rust through bounce_ffi.h
// and acts on the answer. C++ exceptions never leave a method: NIXL's core does not expect them
// from a backend.
#include <dlfcn.h>

#include <cstdio>
#include <cstring>
#include <exception>
#include <new>
#include <string>

#include "bounce_ffi.h"
#include "nixl_abi.h"

using namespace nixl_abi;

namespace {

bnc_str view(const std::string &s) {
    return bnc_str{reinterpret_cast<const uint8_t *>(s.data()), s.size()};
}

void assign_sink(void *ctx, const uint8_t *ptr, size_t len) {
    static_cast<std::string *>(ctx)->assign(reinterpret_cast<const char *>(ptr), len);
}

std::string self_path() {
    Dl_info info{};
    if (dladdr(reinterpret_cast<void *>(&bnc_shim_plugin), &info) != 0 && info.dli_fname)
        return info.dli_fname;
    return {};
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
        // Rust first: its reactor may still be using the inner engine.
        if (rust_) bnc_engine_destroy(rust_);
        rust_ = nullptr;
        if (inner_ && plugin_) plugin_->destroy_engine(inner_);
        inner_ = nullptr;
    }

    bool supportsRemote() const override { return inner_->supportsRemote(); }
    bool supportsLocal() const override { return inner_->supportsLocal(); }
    bool supportsNotif() const override { return inner_->supportsNotif(); }
    mem_list_t getSupportedMems() const override { return inner_->getSupportedMems(); }

    nixl_status_t registerMem(const BlobDesc &mem, const nixl_mem_t &nixl_mem,
                              BackendMD *&out) override {
        nixl_status_t st = inner_->registerMem(mem, nixl_mem, out);
        if (st == NIXL_SUCCESS && out)
            bnc_mem_registered(rust_, out, mem.addr, mem.len, mem.devId, nixl_mem);
        return st;
    }
    nixl_status_t deregisterMem(BackendMD *meta) override {
        bnc_mem_deregistered(rust_, meta);
        return inner_->deregisterMem(meta);
    }
    nixl_status_t connect(const std::string &agent) override { return inner_->connect(agent); }
    nixl_status_t disconnect(const std::string &agent) override {
        return inner_->disconnect(agent);
    }
    nixl_status_t unloadMD(BackendMD *input) override { return inner_->unloadMD(input); }

    nixl_status_t prepXfer(const nixl_xfer_op_t &op, const meta_dlist_t &local,
                           const meta_dlist_t &remote, const std::string &agent,
                           BackendReqH *&handle, const BackendOptArgs *opt) const override {
        return inner_->prepXfer(op, local, remote, agent, handle, opt);
    }
    nixl_status_t postXfer(const nixl_xfer_op_t &op, const meta_dlist_t &local,
                           const meta_dlist_t &remote, const std::string &agent,
                           BackendReqH *&handle, const BackendOptArgs *opt) const override {
        return inner_->postXfer(op, local, remote, agent, handle, opt);
    }
    nixl_status_t checkXfer(BackendReqH *handle) const override {
        return inner_->checkXfer(handle);
    }
    nixl_status_t releaseReqH(BackendReqH *handle) const override {
        return inner_->releaseReqH(handle);
    }

    nixl_status_t prepMemView(const remote_meta_dlist_t &l, mem_view_t &v,
                              const BackendOptArgs *o) const override {
        return inner_->prepMemView(l, v, o);
    }
    nixl_status_t prepMemView(const meta_dlist_t &l, mem_view_t &v,
                              const BackendOptArgs *o) const override {
        return inner_->prepMemView(l, v, o);
    }
    void releaseMemView(mem_view_t v) const override { inner_->releaseMemView(v); }
    nixl_status_t getPublicData(const BackendMD *md, std::string &s) const override {
        return inner_->getPublicData(md, s);
    }

    nixl_status_t getConnInfo(std::string &out) const override {
        std::string inner;
        nixl_status_t st = inner_->getConnInfo(inner);
        if (st != NIXL_SUCCESS) return st;
        return static_cast<nixl_status_t>(bnc_conn_info_wrap(rust_, view(inner), assign_sink, &out));
    }
    nixl_status_t loadRemoteConnInfo(const std::string &agent, const std::string &conn) override {
        std::string inner;
        auto st = static_cast<nixl_status_t>(
            bnc_conn_info_load(rust_, view(agent), view(conn), assign_sink, &inner));
        if (st != NIXL_SUCCESS) return st;
        return inner_->loadRemoteConnInfo(agent, inner);
    }
    nixl_status_t loadRemoteMD(const BlobDesc &in, const nixl_mem_t &mem, const std::string &agent,
                               BackendMD *&out) override {
        return inner_->loadRemoteMD(in, mem, agent, out);
    }
    nixl_status_t loadLocalMD(BackendMD *in, BackendMD *&out) override {
        return inner_->loadLocalMD(in, out);
    }
    nixl_status_t getNotifs(notif_list_t &list) override { return inner_->getNotifs(list); }
    nixl_status_t genNotif(const std::string &agent, const std::string &msg) const override {
        return inner_->genNotif(agent, msg);
    }
    nixl_status_t queryMem(const RegDescListTag &d, std::vector<query_resp_t> &r) const override {
        return inner_->queryMem(d, r);
    }
    nixl_status_t estimateXferCost(const nixl_xfer_op_t &op, const meta_dlist_t &l,
                                   const meta_dlist_t &r, const std::string &a,
                                   BackendReqH *const &h, std::chrono::microseconds &d,
                                   std::chrono::microseconds &e, nixl_cost_t &m,
                                   const AgentOptArgsTag *x) const override {
        return inner_->estimateXferCost(op, l, r, a, h, d, e, m, x);
    }

private:
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
    }

    void *rust_ = nullptr;
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

params_t backend_options() {
    params_t m;
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
