// Our own ABI-compatible declarations of the parts of NIXL's backend plugin interface that BOUNCE
// touches, pinned to plugin API version 1 as shipped in nixl-cu12 1.5.1 (GCC 14, C++20,
// _GLIBCXX_USE_CXX11_ABI=1). No NIXL header ships in any registry, so these are written from the
// facts in ../shared/nixl-plugin-facts.md; every size and offset the facts list is pinned by a
// static_assert below, and the tests load the plugin into the real library.
//
// Only layout and virtual-method ORDER matter: NIXL's core calls our engine through its vtable
// and reads a few fields (initErr) directly, and we call the inner UCX engine the same way.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#if !defined(_GLIBCXX_USE_CXX11_ABI) || _GLIBCXX_USE_CXX11_ABI != 1
#error "NIXL 1.5.1 is built with the new libstdc++ string ABI"
#endif

namespace nixl_abi {

inline constexpr int kPluginApiVersion = 1;

enum nixl_mem_t : int { DRAM_SEG = 0, VRAM_SEG = 1, BLK_SEG = 2, OBJ_SEG = 3, FILE_SEG = 4 };
enum nixl_xfer_op_t : int { NIXL_READ = 0, NIXL_WRITE = 1 };
enum nixl_status_t : int {
    NIXL_IN_PROG = 1,
    NIXL_SUCCESS = 0,
    NIXL_ERR_NOT_POSTED = -1,
    NIXL_ERR_INVALID_PARAM = -2,
    NIXL_ERR_BACKEND = -3,
    NIXL_ERR_NOT_FOUND = -4,
    NIXL_ERR_MISMATCH = -5,
    NIXL_ERR_NOT_ALLOWED = -6,
    NIXL_ERR_REPOST_ACTIVE = -7,
    NIXL_ERR_UNKNOWN = -8,
    NIXL_ERR_NOT_SUPPORTED = -9,
    NIXL_ERR_REMOTE_DISCONNECT = -10,
    NIXL_ERR_CANCELED = -11,
    NIXL_ERR_NO_TELEMETRY = -12,
};
enum class nixl_thread_sync_t : int { NONE = 0, STRICT = 1, RW = 2 };
enum class nixl_cost_t : int { ANALYTICAL_BACKEND = 0 };

using params_t = std::unordered_map<std::string, std::string>;
using mem_list_t = std::vector<nixl_mem_t>;
using notif_list_t = std::vector<std::pair<std::string, std::string>>;
using query_resp_t = std::optional<params_t>;
using mem_view_t = void *;

struct BasicDesc {
    uintptr_t addr;
    size_t len;
    uint64_t devId;
};

struct BlobDesc : BasicDesc {
    std::string metaInfo;
};

class BackendMD {
public:
    explicit BackendMD(bool is_private) : isPrivateMD(is_private) {}
    virtual ~BackendMD() = default;

protected:
    bool isPrivateMD;
};

class BackendReqH {
public:
    BackendReqH() = default;
    virtual ~BackendReqH() = default;
};

struct MetaDesc : BasicDesc {
    BackendMD *metadataP = nullptr;
};

struct RemoteMetaDesc : MetaDesc {
    std::string remoteAgent;
};

// NIXL's descriptor list template: polymorphic, then the memory type, then the vector.
// Virtual slots in order: dtor (complete, deleting), resize, addDesc, getIndex.
template <class T> class DescList {
public:
    explicit DescList(nixl_mem_t t) : type(t) {}
    virtual ~DescList() = default;
    virtual void resize(const size_t &count) { descs.resize(count); }
    virtual void addDesc(const T &d) { descs.push_back(d); }
    virtual int getIndex(const BasicDesc &q) const {
        for (size_t i = 0; i < descs.size(); ++i) {
            const BasicDesc &d = descs[i];
            if (d.addr == q.addr && d.len == q.len && d.devId == q.devId) return static_cast<int>(i);
        }
        return -1;
    }

    nixl_mem_t type;
    std::vector<T> descs;
};

using meta_dlist_t = DescList<MetaDesc>;
using remote_meta_dlist_t = DescList<RemoteMetaDesc>;
struct RegDescListTag; // nixl_reg_dlist_t: only ever forwarded by reference
struct AgentOptArgsTag; // nixl_opt_args_t: only ever forwarded by pointer

struct BackendOptArgs {
    std::string notifMsg;
    bool hasNotif = false;
    std::string customParam;
};

struct BackendInitParams {
    std::string localAgent;
    std::string type;
    params_t *customParams = nullptr;
    bool enableProgTh = false;
    uint64_t pthrDelay = 0; // microseconds
    nixl_thread_sync_t syncMode = nixl_thread_sync_t::NONE;
    bool enableTelemetry = false;
};

struct TelemetryEvent {
    uint32_t eventType;
    uint64_t value;
};

// NIXL's engine base class. The data members mirror the real class exactly; the virtual
// methods are declared in the real vtable order.
class BackendEngine {
public:
    explicit BackendEngine(const BackendInitParams *p)
        : backendType(p->type),
          customParams(*p->customParams),
          localAgent(p->localAgent),
          enableTelemetry(p->enableTelemetry) {}
    BackendEngine(const BackendEngine &) = delete;
    BackendEngine &operator=(const BackendEngine &) = delete;

    virtual ~BackendEngine() = default;                                  // slots 0-1
    virtual bool supportsRemote() const = 0;                             // 2
    virtual bool supportsLocal() const = 0;                              // 3
    virtual bool supportsNotif() const = 0;                              // 4
    virtual mem_list_t getSupportedMems() const = 0;                     // 5
    virtual nixl_status_t registerMem(const BlobDesc &mem, const nixl_mem_t &nixl_mem,
                                      BackendMD *&out) = 0;              // 6
    virtual nixl_status_t deregisterMem(BackendMD *meta) = 0;            // 7
    virtual nixl_status_t connect(const std::string &remote_agent) = 0;  // 8
    virtual nixl_status_t disconnect(const std::string &remote_agent) = 0; // 9
    virtual nixl_status_t unloadMD(BackendMD *input) = 0;                // 10
    virtual nixl_status_t prepXfer(const nixl_xfer_op_t &op, const meta_dlist_t &local,
                                   const meta_dlist_t &remote, const std::string &remote_agent,
                                   BackendReqH *&handle,
                                   const BackendOptArgs *opt_args) const = 0; // 11
    virtual nixl_status_t postXfer(const nixl_xfer_op_t &op, const meta_dlist_t &local,
                                   const meta_dlist_t &remote, const std::string &remote_agent,
                                   BackendReqH *&handle,
                                   const BackendOptArgs *opt_args) const = 0; // 12
    virtual nixl_status_t checkXfer(BackendReqH *handle) const = 0;      // 13
    virtual nixl_status_t releaseReqH(BackendReqH *handle) const = 0;    // 14
    virtual nixl_status_t prepMemView(const remote_meta_dlist_t &, mem_view_t &,
                                      const BackendOptArgs *) const {
        return NIXL_ERR_NOT_SUPPORTED;
    } // 15
    virtual nixl_status_t prepMemView(const meta_dlist_t &, mem_view_t &,
                                      const BackendOptArgs *) const {
        return NIXL_ERR_NOT_SUPPORTED;
    } // 16
    virtual void releaseMemView(mem_view_t) const {} // 17
    virtual nixl_status_t getPublicData(const BackendMD *, std::string &) const {
        return NIXL_ERR_BACKEND;
    } // 18
    virtual nixl_status_t getConnInfo(std::string &) const { return NIXL_ERR_BACKEND; } // 19
    virtual nixl_status_t loadRemoteConnInfo(const std::string &, const std::string &) {
        return NIXL_ERR_BACKEND;
    } // 20
    virtual nixl_status_t loadRemoteMD(const BlobDesc &, const nixl_mem_t &, const std::string &,
                                       BackendMD *&) {
        return NIXL_ERR_BACKEND;
    } // 21
    virtual nixl_status_t loadLocalMD(BackendMD *, BackendMD *&) { return NIXL_ERR_BACKEND; } // 22
    virtual nixl_status_t getNotifs(notif_list_t &) { return NIXL_ERR_BACKEND; }           // 23
    virtual nixl_status_t genNotif(const std::string &, const std::string &) const {
        return NIXL_ERR_BACKEND;
    } // 24
    virtual nixl_status_t queryMem(const RegDescListTag &, std::vector<query_resp_t> &) const {
        return NIXL_ERR_NOT_SUPPORTED;
    } // 25
    virtual nixl_status_t estimateXferCost(const nixl_xfer_op_t &, const meta_dlist_t &,
                                           const meta_dlist_t &, const std::string &,
                                           BackendReqH *const &, std::chrono::microseconds &,
                                           std::chrono::microseconds &, nixl_cost_t &,
                                           const AgentOptArgsTag *) const {
        return NIXL_ERR_NOT_SUPPORTED;
    } // 26

    bool getInitErr() const noexcept { return initErr; }
    const std::string &getType() const noexcept { return backendType; }
    const params_t &getCustomParams() const noexcept { return customParams; }

private:
    std::string backendType;
    params_t customParams;
    std::vector<TelemetryEvent> telemetryEvents;
    std::mutex telemetryEventsMutex;

protected:
    // Our addition (inline, no layout change): the live params map NIXL's getBackendParams reads.
    params_t &mutableParams() noexcept { return customParams; }

    bool initErr = false;
    const std::string localAgent;
    const bool enableTelemetry;

    friend struct LayoutCheck;
};

// The plugin descriptor NIXL gets from nixl_plugin_init().
struct BackendPlugin {
    int api_version;
    BackendEngine *(*create_engine)(const BackendInitParams *);
    void (*destroy_engine)(BackendEngine *);
    const char *(*get_plugin_name)();
    const char *(*get_plugin_version)();
    params_t (*get_backend_options)();
    mem_list_t (*get_backend_mems)();
};

// offsetof on a polymorphic or non-standard-layout class is conditionally supported; GCC
// supports it, and it is the only way to pin the layout the core reads directly (initErr).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Winvalid-offsetof"
struct LayoutCheck {
    static_assert(sizeof(BasicDesc) == 24);
    static_assert(sizeof(BlobDesc) == 56);
    static_assert(sizeof(MetaDesc) == 32);
    static_assert(offsetof(MetaDesc, metadataP) == 24);
    static_assert(sizeof(RemoteMetaDesc) == 64);
    static_assert(sizeof(DescList<MetaDesc>) == 40);
    static_assert(sizeof(BackendOptArgs) == 72);
    static_assert(offsetof(BackendOptArgs, notifMsg) == 0);
    static_assert(offsetof(BackendOptArgs, hasNotif) == 32);
    static_assert(offsetof(BackendOptArgs, customParam) == 40);
    static_assert(sizeof(BackendMD) == 16);
    static_assert(sizeof(BackendInitParams) == 96);
    static_assert(offsetof(BackendInitParams, localAgent) == 0);
    static_assert(offsetof(BackendInitParams, type) == 32);
    static_assert(offsetof(BackendInitParams, customParams) == 64);
    static_assert(offsetof(BackendInitParams, enableProgTh) == 72);
    static_assert(offsetof(BackendInitParams, pthrDelay) == 80);
    static_assert(offsetof(BackendInitParams, syncMode) == 88);
    static_assert(offsetof(BackendInitParams, enableTelemetry) == 92);
    static_assert(sizeof(params_t) == 56);
    static_assert(sizeof(BackendPlugin) == 56);
    static_assert(sizeof(nixl_mem_t) == 4 && sizeof(nixl_status_t) == 4);
    static_assert(sizeof(nixl_thread_sync_t) == 4);
    static_assert(sizeof(BackendEngine) == 208);
    static_assert(offsetof(BackendEngine, backendType) == 8);
    static_assert(offsetof(BackendEngine, customParams) == 40);
    static_assert(offsetof(BackendEngine, telemetryEvents) == 96);
    static_assert(offsetof(BackendEngine, telemetryEventsMutex) == 120);
    static_assert(offsetof(BackendEngine, initErr) == 160);
    static_assert(offsetof(BackendEngine, localAgent) == 168);
    static_assert(offsetof(BackendEngine, enableTelemetry) == 200);
    static_assert(offsetof(DescList<MetaDesc>, type) == 8);
    static_assert(offsetof(DescList<MetaDesc>, descs) == 16);
};
#pragma GCC diagnostic pop

} // namespace nixl_abi
