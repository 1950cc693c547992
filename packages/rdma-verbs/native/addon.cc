// @tensorwire/rdma-verbs native addon.
//
// libibverbs is opened at run time with dlopen("libibverbs.so.1") and every exported
// function is resolved with a versioned dlvsym (IBVERBS_1.1, ...), so this addon loads on
// any Linux machine and can say exactly why RDMA is unavailable. Verbs that are static
// inline in verbs.h (ibv_post_send, ibv_poll_cq, ibv_req_notify_cq, the extended
// query_port path) dispatch through the context's ops table and therefore work on
// contexts opened through the dlopen'd library.
//
// Built without infiniband/verbs.h (TW_HAVE_VERBS_H undefined) the same exports exist, but
// probe() says so and opening a device throws.
//
// Threads: one poller thread per open device waits on that device's completion channel
// (plus an eventfd for shutdown) and hands batches of work completions to JavaScript
// through a ThreadSafeFunction. No thread per queue pair, and the event loop never blocks.
//
// Resources are addressed from JavaScript by per-device ids that are never reused
// (never by QPN or by pointer), so a stale id fails cleanly instead of touching freed or
// foreign state. All per-environment state lives in the Napi::Addon instance.

#include <napi.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <dlfcn.h>
#include <fcntl.h>
#include <poll.h>
#include <strings.h>
#include <sys/eventfd.h>
#include <unistd.h>

#ifdef TW_HAVE_VERBS_H
#include <infiniband/verbs.h>
#endif

namespace tw {

struct Counters {
  std::atomic<int64_t> devices{0};
  std::atomic<int64_t> pds{0};
  std::atomic<int64_t> mrs{0};
  std::atomic<int64_t> mws{0};
  std::atomic<int64_t> cqs{0};
  std::atomic<int64_t> qps{0};
  std::atomic<int64_t> channels{0};
  std::atomic<int64_t> threads{0};
  std::atomic<int64_t> postedWrs{0};
  std::atomic<int64_t> completions{0};
};

[[maybe_unused]] static std::string ErrnoText(int err) {  // unused only in the stub build
  char buf[256];
  buf[0] = 0;
  // GNU strerror_r returns char*
  const char* s = strerror_r(err, buf, sizeof buf);
  return std::string(s ? s : buf) + " (errno " + std::to_string(err) + ")";
}

#ifdef TW_HAVE_VERBS_H

// ---------------------------------------------------------------------------------------
// Fork safety.
//
// Node starts child processes with fork(). On a kernel without copy-on-fork for pinned
// (DMA) pages, a write by the parent to a registered page after a fork gets a fresh
// copy-on-write page while the NIC keeps DMAing to the old one: silent data corruption.
// ibv_fork_init() makes libibverbs madvise(MADV_DONTFORK) every registration so the child
// never shares them. It must run before any other libibverbs call, and its state is
// process-wide (one libibverbs per process however many Node environments load this
// addon), so the decision is made once per process and kept here. This is the one piece
// of static state in the addon: it mirrors process-wide libibverbs state, not anything
// owned by an environment.
struct ForkOutcome {
  std::string status;  // "unneeded" | "enabled" | "disabled" | "failed"
  std::string error;   // why, for "disabled" and "failed"
};

static bool ForkOptOut(std::string* value) {
  const char* v = getenv("TENSORWIRE_RDMA_FORK_INIT");
  if (v == nullptr || !(std::strcmp(v, "0") == 0 || strcasecmp(v, "off") == 0)) return false;
  *value = v;
  return true;
}

static const ForkOutcome& DecideFork(int (*forkInit)(), ibv_fork_status (*isForkInitialized)()) {
  static ForkOutcome outcome;  // process-wide, see above
  static std::once_flag once;
  std::call_once(once, [&] {
    if (isForkInitialized != nullptr) {
      ibv_fork_status s = isForkInitialized();
      if (s == IBV_FORK_UNNEEDED) {  // the kernel copies DMA pages on fork
        outcome.status = "unneeded";
        return;
      }
      if (s == IBV_FORK_ENABLED) {  // someone in this process already called ibv_fork_init
        outcome.status = "enabled";
        return;
      }
    }
    std::string optOut;
    // RDMAV_FORK_SAFE / IBV_FORK_SAFE make libibverbs call ibv_fork_init itself on its
    // first device scan, so an opt-out here could not hold; report what will be true.
    bool libRequested = getenv("RDMAV_FORK_SAFE") != nullptr || getenv("IBV_FORK_SAFE") != nullptr;
    if (ForkOptOut(&optOut) && !libRequested) {
      outcome.status = "disabled";
      outcome.error = "TENSORWIRE_RDMA_FORK_INIT=" + optOut;
      return;
    }
    if (forkInit == nullptr) {
      outcome.status = "failed";
      outcome.error = "libibverbs.so.1 has no ibv_fork_init@IBVERBS_1.1";
      return;
    }
    int rc = forkInit();  // returns an errno value
    if (rc == 0) {
      outcome.status = "enabled";
    } else {
      outcome.status = "failed";
      outcome.error = "ibv_fork_init: " + ErrnoText(rc);
    }
  });
  return outcome;
}

// ---------------------------------------------------------------------------------------
// The dlopen'd function table.
struct Verbs {
  void* handle = nullptr;
  std::string error;                  // why loading failed, empty when loaded
  std::vector<std::string> missing;   // required symbols not found
  bool attempted = false;

  ibv_device** (*get_device_list)(int*) = nullptr;
  void (*free_device_list)(ibv_device**) = nullptr;
  const char* (*get_device_name)(ibv_device*) = nullptr;
  __be64 (*get_device_guid)(ibv_device*) = nullptr;
  ibv_context* (*open_device)(ibv_device*) = nullptr;
  int (*close_device)(ibv_context*) = nullptr;
  int (*query_device)(ibv_context*, ibv_device_attr*) = nullptr;
  int (*query_port_compat)(ibv_context*, uint8_t, struct _compat_ibv_port_attr*) = nullptr;
  int (*query_gid)(ibv_context*, uint8_t, int, ibv_gid*) = nullptr;
  ibv_pd* (*alloc_pd)(ibv_context*) = nullptr;
  int (*dealloc_pd)(ibv_pd*) = nullptr;
  ibv_mr* (*reg_mr)(ibv_pd*, void*, size_t, int) = nullptr;
  ibv_mr* (*reg_dmabuf_mr)(ibv_pd*, uint64_t, size_t, uint64_t, int, int) = nullptr;  // optional
  int (*dereg_mr)(ibv_mr*) = nullptr;
  ibv_comp_channel* (*create_comp_channel)(ibv_context*) = nullptr;
  int (*destroy_comp_channel)(ibv_comp_channel*) = nullptr;
  ibv_cq* (*create_cq)(ibv_context*, int, void*, ibv_comp_channel*, int) = nullptr;
  int (*destroy_cq)(ibv_cq*) = nullptr;
  int (*get_cq_event)(ibv_comp_channel*, ibv_cq**, void**) = nullptr;
  void (*ack_cq_events)(ibv_cq*, unsigned int) = nullptr;
  ibv_qp* (*create_qp)(ibv_pd*, ibv_qp_init_attr*) = nullptr;
  int (*modify_qp)(ibv_qp*, ibv_qp_attr*, int) = nullptr;
  int (*destroy_qp)(ibv_qp*) = nullptr;
  const char* (*wc_status_str)(ibv_wc_status) = nullptr;
  int (*fork_init)() = nullptr;                        // optional
  ibv_fork_status (*is_fork_initialized)() = nullptr;  // optional (IBVERBS_1.13)
  ForkOutcome forkOutcome;                             // copy of the process-wide decision

  template <typename F>
  void Sym(F& slot, const char* name, const char* version, bool required) {
    void* p = dlvsym(handle, name, version);
    if (p == nullptr && required) missing.push_back(std::string(name) + "@" + version);
    slot = reinterpret_cast<F>(p);
  }

  bool Load() {
    if (attempted) return handle != nullptr && missing.empty();
    attempted = true;
    dlerror();
    handle = dlopen("libibverbs.so.1", RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
      const char* e = dlerror();
      error = std::string("dlopen(libibverbs.so.1) failed: ") + (e ? e : "unknown error");
      return false;
    }
    Sym(get_device_list, "ibv_get_device_list", "IBVERBS_1.1", true);
    Sym(free_device_list, "ibv_free_device_list", "IBVERBS_1.1", true);
    Sym(get_device_name, "ibv_get_device_name", "IBVERBS_1.1", true);
    Sym(get_device_guid, "ibv_get_device_guid", "IBVERBS_1.1", true);
    Sym(open_device, "ibv_open_device", "IBVERBS_1.1", true);
    Sym(close_device, "ibv_close_device", "IBVERBS_1.1", true);
    Sym(query_device, "ibv_query_device", "IBVERBS_1.1", true);
    Sym(query_port_compat, "ibv_query_port", "IBVERBS_1.1", true);
    Sym(query_gid, "ibv_query_gid", "IBVERBS_1.1", true);
    Sym(alloc_pd, "ibv_alloc_pd", "IBVERBS_1.1", true);
    Sym(dealloc_pd, "ibv_dealloc_pd", "IBVERBS_1.1", true);
    Sym(reg_mr, "ibv_reg_mr", "IBVERBS_1.1", true);
    Sym(reg_dmabuf_mr, "ibv_reg_dmabuf_mr", "IBVERBS_1.12", false);
    Sym(dereg_mr, "ibv_dereg_mr", "IBVERBS_1.1", true);
    Sym(create_comp_channel, "ibv_create_comp_channel", "IBVERBS_1.0", true);
    Sym(destroy_comp_channel, "ibv_destroy_comp_channel", "IBVERBS_1.0", true);
    Sym(create_cq, "ibv_create_cq", "IBVERBS_1.1", true);
    Sym(destroy_cq, "ibv_destroy_cq", "IBVERBS_1.1", true);
    Sym(get_cq_event, "ibv_get_cq_event", "IBVERBS_1.1", true);
    Sym(ack_cq_events, "ibv_ack_cq_events", "IBVERBS_1.1", true);
    Sym(create_qp, "ibv_create_qp", "IBVERBS_1.1", true);
    Sym(modify_qp, "ibv_modify_qp", "IBVERBS_1.1", true);
    Sym(destroy_qp, "ibv_destroy_qp", "IBVERBS_1.1", true);
    Sym(wc_status_str, "ibv_wc_status_str", "IBVERBS_1.1", true);
    Sym(fork_init, "ibv_fork_init", "IBVERBS_1.1", false);
    Sym(is_fork_initialized, "ibv_is_fork_initialized", "IBVERBS_1.13", false);
    if (!missing.empty()) {
      error = "libibverbs.so.1 lacks required symbols:";
      for (auto& m : missing) error += " " + m;
      return false;
    }
    // Before any other libibverbs call (every caller goes through Load first).
    forkOutcome = DecideFork(fork_init, is_fork_initialized);
    return true;
  }

  // Mirrors verbs.h's ___ibv_query_port: the extended op through the context when the
  // provider has it, else the exported (compat-layout) symbol.
  int QueryPort(ibv_context* ctx, uint8_t port, ibv_port_attr* attr) const {
    struct verbs_context* vctx = verbs_get_ctx_op(ctx, query_port);
    if (vctx == nullptr) {
      std::memset(attr, 0, sizeof *attr);
      return query_port_compat(ctx, port, reinterpret_cast<struct _compat_ibv_port_attr*>(attr));
    }
    return vctx->query_port(ctx, port, attr, sizeof *attr);
  }
};

#endif  // TW_HAVE_VERBS_H

class Device;

class RdmaAddon : public Napi::Addon<RdmaAddon> {
 public:
  RdmaAddon(Napi::Env env, Napi::Object exports);
  ~RdmaAddon();
  std::shared_ptr<Counters> counters = std::make_shared<Counters>();
#ifdef TW_HAVE_VERBS_H
  Verbs verbs;
#endif
  std::vector<Device*> liveDevices;  // closed on environment teardown

 private:
  Napi::Value Probe(const Napi::CallbackInfo& info);
  Napi::Value GetCounters(const Napi::CallbackInfo& info);
  Napi::Value ListDevices(const Napi::CallbackInfo& info);
  Napi::Value WcStatusString(const Napi::CallbackInfo& info);
};

static Napi::Error TypedError(Napi::Env env, const std::string& code, const std::string& message) {
  Napi::Error e = Napi::Error::New(env, message);
  e.Set("code", Napi::String::New(env, code));
  return e;
}

#ifdef TW_HAVE_VERBS_H

static std::string GidHex(const ibv_gid& gid) {
  static const char* hex = "0123456789abcdef";
  std::string s;
  for (int i = 0; i < 16; i++) {
    s.push_back(hex[gid.raw[i] >> 4]);
    s.push_back(hex[gid.raw[i] & 15]);
  }
  return s;
}

static bool GidIsZero(const ibv_gid& gid) {
  for (int i = 0; i < 16; i++)
    if (gid.raw[i] != 0) return false;
  return true;
}

static Napi::Object DescribeContext(Napi::Env env, const Verbs& v, ibv_context* ctx) {
  Napi::Object out = Napi::Object::New(env);
  ibv_device_attr da;
  std::memset(&da, 0, sizeof da);
  int rc = v.query_device(ctx, &da);
  if (rc != 0) {
    out.Set("error", "ibv_query_device: " + ErrnoText(rc));
    return out;
  }
  out.Set("fwVer", std::string(da.fw_ver));
  out.Set("vendorId", da.vendor_id);
  out.Set("vendorPartId", da.vendor_part_id);
  out.Set("maxQp", da.max_qp);
  out.Set("maxQpWr", da.max_qp_wr);
  out.Set("maxSge", da.max_sge);
  out.Set("maxSgeRd", da.max_sge_rd);  // SGEs per RDMA READ; 0 when the provider does not say
  out.Set("maxCq", da.max_cq);
  out.Set("maxCqe", da.max_cqe);
  out.Set("maxMr", da.max_mr);
  out.Set("maxMrSize", Napi::Number::New(env, static_cast<double>(da.max_mr_size)));
  out.Set("maxPd", da.max_pd);
  out.Set("maxQpRdAtom", da.max_qp_rd_atom);
  out.Set("maxQpInitRdAtom", da.max_qp_init_rd_atom);
  out.Set("maxMw", da.max_mw);
  out.Set("memoryWindowType2", (da.device_cap_flags & (IBV_DEVICE_MEM_WINDOW_TYPE_2A | IBV_DEVICE_MEM_WINDOW_TYPE_2B)) != 0);
  out.Set("physPortCnt", da.phys_port_cnt);
  Napi::Array ports = Napi::Array::New(env);
  for (uint32_t p = 1; p <= da.phys_port_cnt; p++) {
    Napi::Object po = Napi::Object::New(env);
    po.Set("port", p);
    ibv_port_attr pa;
    int prc = v.QueryPort(ctx, static_cast<uint8_t>(p), &pa);
    if (prc != 0) {
      po.Set("error", "ibv_query_port: " + ErrnoText(prc));
      ports.Set(ports.Length(), po);
      continue;
    }
    po.Set("state", static_cast<int>(pa.state));
    po.Set("maxMtu", static_cast<int>(pa.max_mtu));
    po.Set("activeMtu", static_cast<int>(pa.active_mtu));
    po.Set("lid", pa.lid);
    po.Set("smLid", pa.sm_lid);
    po.Set("linkLayer", static_cast<int>(pa.link_layer));
    po.Set("gidTblLen", pa.gid_tbl_len);
    po.Set("activeSpeed", static_cast<int>(pa.active_speed));
    po.Set("activeWidth", static_cast<int>(pa.active_width));
    po.Set("portCapFlags", pa.port_cap_flags);
    Napi::Array gids = Napi::Array::New(env);
    for (int i = 0; i < pa.gid_tbl_len; i++) {
      ibv_gid gid;
      if (v.query_gid(ctx, static_cast<uint8_t>(p), i, &gid) != 0) continue;
      if (GidIsZero(gid)) continue;
      Napi::Object g = Napi::Object::New(env);
      g.Set("index", i);
      g.Set("gid", GidHex(gid));
      gids.Set(gids.Length(), g);
    }
    po.Set("gids", gids);
    ports.Set(ports.Length(), po);
  }
  out.Set("ports", ports);
  return out;
}

// ---------------------------------------------------------------------------------------
// One open device: context, PD, completion channel, poller thread, and every resource
// created on it, addressed by never-reused ids.

struct MrEntry {
  ibv_mr* mr = nullptr;
  uint64_t length = 0;
  uint32_t access = 0;              // the ibv_access_flags it was registered with
  Napi::ObjectReference keepAlive;  // the JS ArrayBuffer of host memory, while registered
};

// A type-2 memory window. rkey is the key of its latest posted bind: for type 2 the
// consumer picks each bind's key (ibv_inc_rkey of the previous one), and providers do not
// update mw->rkey on a posted bind, so it is tracked here.
struct MwEntry {
  ibv_mw* mw = nullptr;
  uint32_t rkey = 0;
};

struct QpEntry {
  ibv_qp* qp = nullptr;
  uint32_t cqId = 0;
  uint32_t maxSendWr = 0;
  uint32_t maxSendSge = 1;
};

struct CompletionBatch {
  std::vector<double> values;  // (cqId, wrId, status, opcode, vendorErr) per completion; cqId 0 = device event
};

class Device : public Napi::ObjectWrap<Device> {
 public:
  static Napi::Function Init(Napi::Env env) {
    return DefineClass(env, "Device",
                       {
                           InstanceMethod<&Device::Info>("info"),
                           InstanceMethod<&Device::RegHost>("regHost"),
                           InstanceMethod<&Device::RegDmabuf>("regDmabuf"),
                           InstanceMethod<&Device::DeregMr>("deregMr"),
                           InstanceMethod<&Device::CreateCq>("createCq"),
                           InstanceMethod<&Device::DestroyCq>("destroyCq"),
                           InstanceMethod<&Device::CreateQp>("createQp"),
                           InstanceMethod<&Device::DestroyQp>("destroyQp"),
                           InstanceMethod<&Device::QpInit>("qpInit"),
                           InstanceMethod<&Device::QpRtr>("qpRtr"),
                           InstanceMethod<&Device::QpRts>("qpRts"),
                           InstanceMethod<&Device::QpError>("qpError"),
                           InstanceMethod<&Device::Post>("post"),
                           InstanceMethod<&Device::AllocMw>("allocMw"),
                           InstanceMethod<&Device::BindMw>("bindMw"),
                           InstanceMethod<&Device::DeallocMw>("deallocMw"),
                           InstanceMethod<&Device::Close>("close"),
                           InstanceAccessor<&Device::Name>("name"),
                           InstanceAccessor<&Device::IsOpen>("isOpen"),
                       });
  }

  Device(const Napi::CallbackInfo& info) : Napi::ObjectWrap<Device>(info) {
    Napi::Env env = info.Env();
    addon_ = env.GetInstanceData<RdmaAddon>();
    counters_ = addon_->counters;
    if (info.Length() < 2 || !info[0].IsString() || !info[1].IsFunction()) {
      throw TypedError(env, "TW_INVALID_INPUT", "new Device(name: string, onCompletions: function)");
    }
    name_ = info[0].As<Napi::String>().Utf8Value();
    Verbs& v = addon_->verbs;
    if (!v.Load()) throw TypedError(env, "TW_BACKEND_UNAVAILABLE", v.error);
    int n = 0;
    errno = 0;
    ibv_device** list = v.get_device_list(&n);
    if (list == nullptr) {
      throw TypedError(env, "TW_BACKEND_UNAVAILABLE", "ibv_get_device_list: " + ErrnoText(errno));
    }
    ibv_device* dev = nullptr;
    for (int i = 0; i < n; i++) {
      if (name_ == v.get_device_name(list[i])) dev = list[i];
    }
    if (dev == nullptr) {
      v.free_device_list(list);
      throw TypedError(env, "TW_BACKEND_UNAVAILABLE", "no RDMA device named " + name_);
    }
    errno = 0;
    ctx_ = v.open_device(dev);
    int openErr = errno;
    v.free_device_list(list);
    if (ctx_ == nullptr) throw TypedError(env, "TW_BACKEND_UNAVAILABLE", "ibv_open_device(" + name_ + "): " + ErrnoText(openErr));
    counters_->devices++;
    pd_ = v.alloc_pd(ctx_);
    if (pd_ == nullptr) {
      int e = errno;
      Teardown();
      throw TypedError(env, "TW_RESOURCE_EXHAUSTED", "ibv_alloc_pd: " + ErrnoText(e));
    }
    counters_->pds++;
    channel_ = v.create_comp_channel(ctx_);
    if (channel_ == nullptr) {
      int e = errno;
      Teardown();
      throw TypedError(env, "TW_RESOURCE_EXHAUSTED", "ibv_create_comp_channel: " + ErrnoText(e));
    }
    counters_->channels++;
    int flags = fcntl(channel_->fd, F_GETFL);
    fcntl(channel_->fd, F_SETFL, flags | O_NONBLOCK);
    wakeFd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (wakeFd_ < 0) {
      int e = errno;
      Teardown();
      throw TypedError(env, "TW_RESOURCE_EXHAUSTED", "eventfd: " + ErrnoText(e));
    }
    tsfn_ = Napi::ThreadSafeFunction::New(env, info[1].As<Napi::Function>(), "tensorwire-rdma-completions", 0, 1);
    tsfn_.Unref(env);  // pending transfers keep the loop alive through their deadline timers
    haveTsfn_ = true;
    // Environment teardown (worker exit, process exit without close()): the ThreadSafeFunction
    // registers its own cleanup hook, which closes and frees it; object and instance-data
    // finalizers run only after that. Hooks run in reverse order of registration, so this
    // one, added after the tsfn's, stops the poller and releases the tsfn while both are
    // still valid (otherwise the poller would call into, and Teardown release, a freed tsfn).
    env_ = env;
    if (napi_add_env_cleanup_hook(env, &Device::EnvCleanup, this) == napi_ok) cleanupHook_ = true;
    running_ = true;
    counters_->threads++;
    poller_ = std::thread([this] { PollLoop(); });
    open_ = true;
    addon_->liveDevices.push_back(this);
  }

  ~Device() override { Teardown(); }

  static void EnvCleanup(void* arg) {
    Device* self = static_cast<Device*>(arg);
    self->cleanupHook_ = false;  // being run: nothing to remove
    self->Teardown();
  }

  // Called on environment teardown and by close(): idempotent.
  void Teardown() {
    if (torn_) return;
    torn_ = true;
    open_ = false;
    if (cleanupHook_) {
      cleanupHook_ = false;
      napi_remove_env_cleanup_hook(env_, &Device::EnvCleanup, this);
    }
    auto& live = addon_->liveDevices;
    for (auto it = live.begin(); it != live.end(); ++it) {
      if (*it == this) {
        live.erase(it);
        break;
      }
    }
    Verbs& v = addon_->verbs;
    if (poller_.joinable()) {
      uint64_t one = 1;
      ssize_t w = write(wakeFd_, &one, sizeof one);
      (void)w;
      poller_.join();
      counters_->threads--;
    }
    running_ = false;
    // Memory windows first: deallocating a window invalidates its rkey, so no peer reaches
    // memory through it, and an MR with windows bound to it cannot be deregistered.
    for (auto& kv : mws_) {
      ibv_dealloc_mw(kv.second.mw);
      counters_->mws--;
    }
    mws_.clear();
    // Then queue pairs: destroying a QP guarantees the NIC no longer touches its buffers.
    for (auto& kv : qps_) {
      v.destroy_qp(kv.second.qp);
      counters_->qps--;
    }
    qps_.clear();
    for (auto& kv : mrs_) {
      v.dereg_mr(kv.second.mr);
      kv.second.keepAlive.Reset();
      counters_->mrs--;
    }
    mrs_.clear();
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& kv : cqs_) {
        v.destroy_cq(kv.second);
        counters_->cqs--;
      }
      cqs_.clear();
    }
    if (channel_ != nullptr) {
      v.destroy_comp_channel(channel_);
      channel_ = nullptr;
      counters_->channels--;
    }
    if (wakeFd_ >= 0) {
      close(wakeFd_);
      wakeFd_ = -1;
    }
    if (pd_ != nullptr) {
      v.dealloc_pd(pd_);
      pd_ = nullptr;
      counters_->pds--;
    }
    if (ctx_ != nullptr) {
      v.close_device(ctx_);
      ctx_ = nullptr;
      counters_->devices--;
    }
    if (haveTsfn_) {
      haveTsfn_ = false;
      tsfn_.Release();
    }
  }

 private:
  RdmaAddon* addon_ = nullptr;
  napi_env env_ = nullptr;
  bool cleanupHook_ = false;
  std::shared_ptr<Counters> counters_;
  std::string name_;
  ibv_context* ctx_ = nullptr;
  ibv_pd* pd_ = nullptr;
  ibv_comp_channel* channel_ = nullptr;
  int wakeFd_ = -1;
  Napi::ThreadSafeFunction tsfn_;
  bool haveTsfn_ = false;
  std::thread poller_;
  std::atomic<bool> running_{false};
  bool open_ = false;
  bool torn_ = false;
  uint32_t nextId_ = 1;
  std::map<uint32_t, MrEntry> mrs_;       // JS thread only
  std::map<uint32_t, QpEntry> qps_;       // JS thread only
  std::map<uint32_t, MwEntry> mws_;       // JS thread only
  std::mutex mu_;                         // guards cqs_ against the poller
  std::map<uint32_t, ibv_cq*> cqs_;
  std::vector<ibv_send_wr> postWrs_;      // post() scratch, JS thread only
  std::vector<ibv_sge> postSges_;

  void CheckOpen(Napi::Env env) {
    if (!open_) throw TypedError(env, "TW_CLOSED", "RDMA device " + name_ + " is closed");
  }

  static uint32_t U32(const Napi::Value& v, const char* what) {
    if (!v.IsNumber()) throw TypedError(v.Env(), "TW_INVALID_INPUT", std::string(what) + " must be a number");
    double d = v.As<Napi::Number>().DoubleValue();
    if (!(d >= 0 && d <= 4294967295.0) || d != static_cast<double>(static_cast<uint64_t>(d))) {
      throw TypedError(v.Env(), "TW_INVALID_INPUT", std::string(what) + " must be an unsigned 32-bit integer");
    }
    return static_cast<uint32_t>(d);
  }

  static uint32_t Field(const Napi::Object& o, const char* key) { return U32(o.Get(key), key); }

  // A non-negative integer number no larger than 2^53 - 1 (a byte offset or length).
  static uint64_t SafeIndex(const Napi::Value& v, const char* what) {
    if (!v.IsNumber()) throw TypedError(v.Env(), "TW_INVALID_INPUT", std::string(what) + " must be a number");
    double d = v.As<Napi::Number>().DoubleValue();
    if (!(d >= 0 && d <= 9007199254740991.0) || d != static_cast<double>(static_cast<uint64_t>(d))) {
      throw TypedError(v.Env(), "TW_INVALID_INPUT", std::string(what) + " must be a non-negative safe integer");
    }
    return static_cast<uint64_t>(d);
  }

  void PollLoop() {
    Verbs& v = addon_->verbs;
    for (;;) {
      pollfd fds[2];
      fds[0].fd = channel_->fd;
      fds[0].events = POLLIN;
      fds[0].revents = 0;
      fds[1].fd = wakeFd_;
      fds[1].events = POLLIN;
      fds[1].revents = 0;
      int r = poll(fds, 2, -1);
      if (r < 0) {
        if (errno == EINTR) continue;
        break;
      }
      if (fds[1].revents != 0) break;
      if ((fds[0].revents & (POLLERR | POLLHUP | POLLNVAL)) != 0 && (fds[0].revents & POLLIN) == 0) {
        auto* b = new CompletionBatch();
        b->values = {0, 0, -1, 0, 0};  // device-level failure
        Deliver(b);
        break;
      }
      auto* batch = new CompletionBatch();
      bool failed = false;
      {
        std::lock_guard<std::mutex> lock(mu_);
        for (;;) {
          ibv_cq* cq = nullptr;
          void* cqctx = nullptr;
          errno = 0;
          if (v.get_cq_event(channel_, &cq, &cqctx) != 0) {
            int e = errno;
            if (e == EAGAIN || e == EINTR) break;  // drained (EWOULDBLOCK == EAGAIN on Linux)
            failed = true;  // EIO: device disassociated; reading again would spin
            break;
          }
          v.ack_cq_events(cq, 1);
          uint32_t cqId = static_cast<uint32_t>(reinterpret_cast<uintptr_t>(cqctx));
          auto it = cqs_.find(cqId);
          if (it == cqs_.end() || it->second != cq) continue;
          ibv_req_notify_cq(cq, 0);
          ibv_wc wc[64];
          int k;
          while ((k = ibv_poll_cq(cq, 64, wc)) > 0) {
            for (int i = 0; i < k; i++) {
              batch->values.push_back(cqId);
              batch->values.push_back(static_cast<double>(wc[i].wr_id));
              batch->values.push_back(wc[i].status);
              batch->values.push_back(wc[i].opcode);
              batch->values.push_back(wc[i].vendor_err);
            }
            counters_->completions += k;
          }
        }
      }
      if (failed) {
        // The completions polled so far, then the device-level failure.
        batch->values.insert(batch->values.end(), {0, 0, -1, 0, 0});
      }
      if (batch->values.empty()) {
        delete batch;
      } else {
        Deliver(batch);
      }
      if (failed) break;
    }
  }

  void Deliver(CompletionBatch* b) {
    napi_status st = tsfn_.NonBlockingCall(b, [](Napi::Env env, Napi::Function fn, CompletionBatch* batch) {
      std::unique_ptr<CompletionBatch> owned(batch);
      if (env == nullptr || fn.IsEmpty()) return;
      size_t n = owned->values.size();
      Napi::Float64Array arr = Napi::Float64Array::New(env, n);
      std::memcpy(arr.Data(), owned->values.data(), n * sizeof(double));
      fn.Call({arr});
    });
    if (st != napi_ok) delete b;
  }

  Napi::Value Name(const Napi::CallbackInfo& info) { return Napi::String::New(info.Env(), name_); }
  Napi::Value IsOpen(const Napi::CallbackInfo& info) { return Napi::Boolean::New(info.Env(), open_); }

  Napi::Value Info(const Napi::CallbackInfo& info) {
    CheckOpen(info.Env());
    return DescribeContext(info.Env(), addon_->verbs, ctx_);
  }

  Napi::Value MrResult(Napi::Env env, uint32_t id, ibv_mr* mr, uint64_t length) {
    Napi::Object o = Napi::Object::New(env);
    o.Set("id", id);
    o.Set("lkey", mr->lkey);
    o.Set("rkey", mr->rkey);
    o.Set("addr", Napi::BigInt::New(env, static_cast<uint64_t>(reinterpret_cast<uintptr_t>(mr->addr))));
    o.Set("length", Napi::Number::New(env, static_cast<double>(length)));
    return o;
  }

  // regHost(view: Uint8Array, access: number) -> { id, lkey, rkey, addr, length }
  Napi::Value RegHost(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    CheckOpen(env);
    if (info.Length() < 2 || !info[0].IsTypedArray()) throw TypedError(env, "TW_INVALID_INPUT", "regHost(view: Uint8Array, access)");
    Napi::TypedArray ta = info[0].As<Napi::TypedArray>();
    if (ta.TypedArrayType() != napi_uint8_array) throw TypedError(env, "TW_INVALID_INPUT", "regHost needs a Uint8Array");
    Napi::Uint8Array u8 = ta.As<Napi::Uint8Array>();
    uint32_t access = U32(info[1], "access");
    size_t len = u8.ByteLength();
    if (len == 0) throw TypedError(env, "TW_INVALID_INPUT", "cannot register an empty buffer");
    void* addr = u8.Data();
    ibv_mr* mr = addon_->verbs.reg_mr(pd_, addr, len, static_cast<int>(access));
    if (mr == nullptr) {
      int e = errno;
      throw TypedError(env, e == ENOMEM ? "TW_RESOURCE_EXHAUSTED" : "TW_BACKEND_UNAVAILABLE", "ibv_reg_mr: " + ErrnoText(e));
    }
    uint32_t id = nextId_++;
    MrEntry& entry = mrs_[id];
    entry.mr = mr;
    entry.length = len;
    entry.access = access;
    entry.keepAlive = Napi::Persistent(u8.ArrayBuffer().As<Napi::Object>());
    counters_->mrs++;
    return MrResult(env, id, mr, len);
  }

  // regDmabuf(fd, offset, length, iova, access)
  Napi::Value RegDmabuf(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    CheckOpen(env);
    Verbs& v = addon_->verbs;
    if (v.reg_dmabuf_mr == nullptr) {
      throw TypedError(env, "TW_BACKEND_UNAVAILABLE", "libibverbs.so.1 has no ibv_reg_dmabuf_mr@IBVERBS_1.12 (rdma-core older than v34)");
    }
    if (info.Length() < 5 || !info[2].IsNumber() || !info[3].IsBigInt()) {
      throw TypedError(env, "TW_INVALID_INPUT", "regDmabuf(fd, offset, length, iova: bigint, access)");
    }
    int fd = static_cast<int>(U32(info[0], "fd"));
    double off = info[1].As<Napi::Number>().DoubleValue();
    double len = info[2].As<Napi::Number>().DoubleValue();
    bool lossless = false;
    uint64_t iova = info[3].As<Napi::BigInt>().Uint64Value(&lossless);
    uint32_t access = U32(info[4], "access");
    if (!(off >= 0) || !(len > 0) || !lossless) throw TypedError(env, "TW_INVALID_INPUT", "regDmabuf: bad offset, length or iova");
    ibv_mr* mr = v.reg_dmabuf_mr(pd_, static_cast<uint64_t>(off), static_cast<size_t>(len), iova, fd, static_cast<int>(access));
    if (mr == nullptr) {
      int e = errno;
      throw TypedError(env, e == ENOMEM ? "TW_RESOURCE_EXHAUSTED" : "TW_BACKEND_UNAVAILABLE", "ibv_reg_dmabuf_mr: " + ErrnoText(e));
    }
    uint32_t id = nextId_++;
    MrEntry& entry = mrs_[id];
    entry.mr = mr;
    entry.length = static_cast<uint64_t>(len);
    entry.access = access;
    counters_->mrs++;
    return MrResult(env, id, mr, entry.length);
  }

  Napi::Value DeregMr(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    if (!open_) return Napi::Boolean::New(env, false);
    uint32_t id = U32(info[0], "mr id");
    auto it = mrs_.find(id);
    if (it == mrs_.end()) return Napi::Boolean::New(env, false);
    int rc = addon_->verbs.dereg_mr(it->second.mr);
    if (rc != 0) throw TypedError(env, "TW_BACKEND_UNAVAILABLE", "ibv_dereg_mr: " + ErrnoText(rc));
    it->second.keepAlive.Reset();
    mrs_.erase(it);
    counters_->mrs--;
    return Napi::Boolean::New(env, true);
  }

  Napi::Value CreateCq(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    CheckOpen(env);
    uint32_t cqe = U32(info[0], "cqe");
    if (cqe == 0 || cqe > (1u << 22)) throw TypedError(env, "TW_INVALID_INPUT", "cqe out of range");
    uint32_t id = nextId_++;
    ibv_cq* cq = addon_->verbs.create_cq(ctx_, static_cast<int>(cqe), reinterpret_cast<void*>(static_cast<uintptr_t>(id)), channel_, 0);
    if (cq == nullptr) {
      int e = errno;
      throw TypedError(env, "TW_RESOURCE_EXHAUSTED", "ibv_create_cq: " + ErrnoText(e));
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      cqs_[id] = cq;
      int rc = ibv_req_notify_cq(cq, 0);
      if (rc != 0) {
        cqs_.erase(id);
        addon_->verbs.destroy_cq(cq);
        throw TypedError(env, "TW_BACKEND_UNAVAILABLE", "ibv_req_notify_cq: " + ErrnoText(rc));
      }
    }
    counters_->cqs++;
    return Napi::Number::New(env, id);
  }

  Napi::Value DestroyCq(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    if (!open_) return Napi::Boolean::New(env, false);
    uint32_t id = U32(info[0], "cq id");
    for (auto& kv : qps_) {
      if (kv.second.cqId == id) throw TypedError(env, "TW_INVALID_INPUT", "destroy the queue pairs on a CQ before the CQ");
    }
    std::lock_guard<std::mutex> lock(mu_);
    auto it = cqs_.find(id);
    if (it == cqs_.end()) return Napi::Boolean::New(env, false);
    int rc = addon_->verbs.destroy_cq(it->second);
    if (rc != 0) throw TypedError(env, "TW_BACKEND_UNAVAILABLE", "ibv_destroy_cq: " + ErrnoText(rc));
    cqs_.erase(it);
    counters_->cqs--;
    return Napi::Boolean::New(env, true);
  }

  // createQp(cqId, maxSendWr, maxSendSge = 1) -> { id, qpn, maxSendWr, maxSendSge }
  // (the capacities the provider actually gave, at least those asked for)
  Napi::Value CreateQp(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    CheckOpen(env);
    uint32_t cqId = U32(info[0], "cq id");
    uint32_t maxSendWr = U32(info[1], "maxSendWr");
    uint32_t maxSendSge = info.Length() > 2 && !info[2].IsUndefined() ? U32(info[2], "maxSendSge") : 1;
    if (maxSendSge == 0) throw TypedError(env, "TW_INVALID_INPUT", "maxSendSge must be at least 1");
    ibv_cq* cq = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = cqs_.find(cqId);
      if (it != cqs_.end()) cq = it->second;
    }
    if (cq == nullptr) throw TypedError(env, "TW_INVALID_INPUT", "unknown CQ id " + std::to_string(cqId));
    ibv_qp_init_attr ia;
    std::memset(&ia, 0, sizeof ia);
    ia.send_cq = cq;
    ia.recv_cq = cq;
    ia.qp_type = IBV_QPT_RC;
    ia.sq_sig_all = 0;
    ia.cap.max_send_wr = maxSendWr;
    ia.cap.max_recv_wr = 1;
    ia.cap.max_send_sge = maxSendSge;
    ia.cap.max_recv_sge = 1;
    ibv_qp* qp = addon_->verbs.create_qp(pd_, &ia);
    if (qp == nullptr) {
      int e = errno;
      throw TypedError(env, "TW_RESOURCE_EXHAUSTED", "ibv_create_qp: " + ErrnoText(e));
    }
    uint32_t id = nextId_++;
    qps_[id] = QpEntry{qp, cqId, ia.cap.max_send_wr, ia.cap.max_send_sge};
    counters_->qps++;
    Napi::Object o = Napi::Object::New(env);
    o.Set("id", id);
    o.Set("qpn", qp->qp_num);
    o.Set("maxSendWr", ia.cap.max_send_wr);
    o.Set("maxSendSge", ia.cap.max_send_sge);
    return o;
  }

  QpEntry& FindQp(Napi::Env env, const Napi::Value& v) {
    CheckOpen(env);
    uint32_t id = U32(v, "qp id");
    auto it = qps_.find(id);
    if (it == qps_.end()) throw TypedError(env, "TW_INVALID_INPUT", "unknown QP id " + std::to_string(id));
    return it->second;
  }

  void Modify(Napi::Env env, ibv_qp* qp, ibv_qp_attr& a, int mask, const char* what) {
    int rc = addon_->verbs.modify_qp(qp, &a, mask);
    if (rc != 0) throw TypedError(env, "TW_CONNECTION_BROKEN", std::string("ibv_modify_qp(") + what + "): " + ErrnoText(rc));
  }

  Napi::Value DestroyQp(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    if (!open_) return Napi::Boolean::New(env, false);
    uint32_t id = U32(info[0], "qp id");
    auto it = qps_.find(id);
    if (it == qps_.end()) return Napi::Boolean::New(env, false);
    int rc = addon_->verbs.destroy_qp(it->second.qp);
    if (rc != 0) throw TypedError(env, "TW_BACKEND_UNAVAILABLE", "ibv_destroy_qp: " + ErrnoText(rc));
    qps_.erase(it);
    counters_->qps--;
    return Napi::Boolean::New(env, true);
  }

  // qpInit(id, port, access)
  Napi::Value QpInit(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    QpEntry& q = FindQp(env, info[0]);
    ibv_qp_attr a;
    std::memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_INIT;
    a.pkey_index = 0;
    a.port_num = static_cast<uint8_t>(U32(info[1], "port"));
    a.qp_access_flags = U32(info[2], "access");
    Modify(env, q.qp, a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS, "INIT");
    return env.Undefined();
  }

  // qpRtr(id, { destQpn, rqPsn, dlid, mtu, port, sl, maxDestRdAtomic, minRnrTimer,
  //             isGlobal, dgid: Uint8Array(16), sgidIndex, hopLimit, trafficClass })
  Napi::Value QpRtr(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    QpEntry& q = FindQp(env, info[0]);
    if (!info[1].IsObject()) throw TypedError(env, "TW_INVALID_INPUT", "qpRtr needs attributes");
    Napi::Object o = info[1].As<Napi::Object>();
    ibv_qp_attr a;
    std::memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_RTR;
    a.path_mtu = static_cast<ibv_mtu>(Field(o, "mtu"));
    a.dest_qp_num = Field(o, "destQpn");
    a.rq_psn = Field(o, "rqPsn") & 0xffffff;
    a.max_dest_rd_atomic = static_cast<uint8_t>(Field(o, "maxDestRdAtomic"));
    a.min_rnr_timer = static_cast<uint8_t>(Field(o, "minRnrTimer"));
    a.ah_attr.dlid = static_cast<uint16_t>(Field(o, "dlid"));
    a.ah_attr.sl = static_cast<uint8_t>(Field(o, "sl"));
    a.ah_attr.src_path_bits = 0;
    a.ah_attr.port_num = static_cast<uint8_t>(Field(o, "port"));
    bool global = o.Get("isGlobal").ToBoolean().Value();
    if (global) {
      Napi::Value g = o.Get("dgid");
      if (!g.IsTypedArray() || g.As<Napi::Uint8Array>().ByteLength() != 16) throw TypedError(env, "TW_INVALID_INPUT", "dgid must be 16 bytes");
      a.ah_attr.is_global = 1;
      std::memcpy(a.ah_attr.grh.dgid.raw, g.As<Napi::Uint8Array>().Data(), 16);
      a.ah_attr.grh.sgid_index = static_cast<uint8_t>(Field(o, "sgidIndex"));
      a.ah_attr.grh.hop_limit = static_cast<uint8_t>(Field(o, "hopLimit"));
      a.ah_attr.grh.traffic_class = static_cast<uint8_t>(Field(o, "trafficClass"));
      a.ah_attr.grh.flow_label = 0;
    }
    Modify(env, q.qp, a,
           IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC |
               IBV_QP_MIN_RNR_TIMER,
           "RTR");
    return env.Undefined();
  }

  // qpRts(id, { sqPsn, timeout, retryCnt, rnrRetry, maxRdAtomic })
  Napi::Value QpRts(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    QpEntry& q = FindQp(env, info[0]);
    if (!info[1].IsObject()) throw TypedError(env, "TW_INVALID_INPUT", "qpRts needs attributes");
    Napi::Object o = info[1].As<Napi::Object>();
    ibv_qp_attr a;
    std::memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_RTS;
    a.sq_psn = Field(o, "sqPsn") & 0xffffff;
    a.timeout = static_cast<uint8_t>(Field(o, "timeout"));
    a.retry_cnt = static_cast<uint8_t>(Field(o, "retryCnt"));
    a.rnr_retry = static_cast<uint8_t>(Field(o, "rnrRetry"));
    a.max_rd_atomic = static_cast<uint8_t>(Field(o, "maxRdAtomic"));
    Modify(env, q.qp, a,
           IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC, "RTS");
    return env.Undefined();
  }

  // qpError(id): move to ERR so every outstanding work request completes with a flush error.
  Napi::Value QpError(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    QpEntry& q = FindQp(env, info[0]);
    ibv_qp_attr a;
    std::memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_ERR;
    Modify(env, q.qp, a, IBV_QP_STATE, "ERR");
    return env.Undefined();
  }

  // A double that is an integer in [0, max]; false for NaN, fractions and negatives.
  static bool AsUint(double d, double max, uint64_t* out) {
    if (!(d >= 0 && d <= max) || d != static_cast<double>(static_cast<uint64_t>(d))) return false;
    *out = static_cast<uint64_t>(d);
    return true;
  }

  // post(qpId, wrs: Float64Array, sges: Float64Array, rkeys: Uint32Array,
  //      firstWr, count, wrIdBase) -> { posted, errno, error? }
  //
  // Posts work requests [firstWr, firstWr + count) of `wrs` as ONE chain (one
  // ibv_post_send). Layouts (src/native.ts WrField / SgeField):
  //   wrs:  6 numbers per WR: op (0 READ, 1 WRITE), remote address high 32 bits, low 32 bits,
  //         index into `rkeys`, first SGE (index into `sges`), SGE count;
  //   sges: 3 numbers per SGE: MR id, offset in that MR, length.
  // The remote range of a WR is contiguous (address, total of its SGE lengths); its local side
  // is the SGE list, gathered (WRITE) or scattered (READ) in order. WR i of the chain gets
  // wr_id = wrIdBase + i; only the LAST one is signaled, so a chain that succeeds produces one
  // completion (with wr_id wrIdBase + count - 1). A WR that fails produces an error completion
  // whether signaled or not, and every later one on the QP flushes with one.
  // Unsignaled WRs hold send-queue slots until a later signaled completion on the QP retires
  // them: the caller counts the whole chain as in flight until its last WR completes.
  // Every WR and SGE is validated (ids, bounds against the registration, counts against the
  // QP's capacities) before anything is posted. Returns how many WRs the NIC accepted (all
  // of them unless ibv_post_send failed; then the ones before bad_wr, of which the last is not
  // signaled) and the errno when it failed.
  Napi::Value Post(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    QpEntry& q = FindQp(env, info[0]);
    auto isType = [&](size_t i, napi_typedarray_type t) {
      return info.Length() > i && info[i].IsTypedArray() && info[i].As<Napi::TypedArray>().TypedArrayType() == t;
    };
    if (!isType(1, napi_float64_array) || !isType(2, napi_float64_array) || !isType(3, napi_uint32_array) || info.Length() < 7) {
      throw TypedError(env, "TW_INVALID_INPUT", "post(qpId, wrs: Float64Array, sges: Float64Array, rkeys: Uint32Array, firstWr, count, wrIdBase)");
    }
    Napi::Float64Array wrArr = info[1].As<Napi::Float64Array>();
    Napi::Float64Array sgeArr = info[2].As<Napi::Float64Array>();
    Napi::Uint32Array rkeyArr = info[3].As<Napi::Uint32Array>();
    const size_t wrTotal = wrArr.ElementLength() / 6;
    const size_t sgeTotal = sgeArr.ElementLength() / 3;
    uint64_t first = SafeIndex(info[4], "firstWr");
    uint64_t count = SafeIndex(info[5], "count");
    uint64_t wrIdBase = SafeIndex(info[6], "wrIdBase");
    if (count == 0 || first > wrTotal || count > wrTotal - first) throw TypedError(env, "TW_INVALID_INPUT", "work requests out of range");
    if (count > q.maxSendWr) throw TypedError(env, "TW_RESOURCE_EXHAUSTED", "chain longer than the send queue");
    if (wrIdBase + count > 9007199254740992ull) throw TypedError(env, "TW_INVALID_INPUT", "wrIdBase + count must stay below 2^53");
    const double* w = wrArr.Data() + first * 6;
    const double* sg = sgeArr.Data();
    const uint32_t* rkeys = rkeyArr.Data();
    const size_t rkeyCount = rkeyArr.ElementLength();

    // First pass: validate every WR and its SGEs, and count the SGEs.
    size_t sgeSum = 0;
    uint32_t lastMrId = 0;
    const MrEntry* lastMr = nullptr;
    for (size_t i = 0; i < count; i++) {
      const double* f = w + i * 6;
      uint64_t op, hi, lo, rk, s0, ns;
      if (!AsUint(f[0], 1, &op)) throw TypedError(env, "TW_INVALID_INPUT", "unknown op");
      if (!AsUint(f[1], 4294967295.0, &hi) || !AsUint(f[2], 4294967295.0, &lo)) throw TypedError(env, "TW_INVALID_INPUT", "bad remote address");
      if (!AsUint(f[3], static_cast<double>(rkeyCount) - 1, &rk)) throw TypedError(env, "TW_INVALID_INPUT", "rkey index out of range");
      if (!AsUint(f[5], static_cast<double>(q.maxSendSge), &ns) || ns == 0) {
        throw TypedError(env, "TW_INVALID_INPUT", "a work request needs 1.." + std::to_string(q.maxSendSge) + " SGEs");
      }
      if (!AsUint(f[4], static_cast<double>(sgeTotal), &s0) || ns > sgeTotal - s0) throw TypedError(env, "TW_INVALID_INPUT", "SGEs out of range");
      uint64_t bytes = 0;
      for (uint64_t k = 0; k < ns; k++) {
        const double* e = sg + (s0 + k) * 3;
        uint64_t mrId, off, len;
        if (!AsUint(e[0], 4294967295.0, &mrId)) throw TypedError(env, "TW_INVALID_INPUT", "bad MR id");
        if (lastMr == nullptr || mrId != lastMrId) {
          auto it = mrs_.find(static_cast<uint32_t>(mrId));
          if (it == mrs_.end()) throw TypedError(env, "TW_INVALID_INPUT", "local memory is not registered (or was revoked)");
          lastMr = &it->second;
          lastMrId = static_cast<uint32_t>(mrId);
        }
        if (!AsUint(e[1], 9007199254740991.0, &off) || !AsUint(e[2], 2147483648.0, &len) || len == 0 || off > lastMr->length ||
            len > lastMr->length - off) {
          throw TypedError(env, "TW_INVALID_INPUT", "local range is outside its registration");
        }
        bytes += len;
      }
      if (bytes > 0x80000000ull) throw TypedError(env, "TW_INVALID_INPUT", "a work request moves at most 2 GiB");
      uint64_t raddr = (hi << 32) | lo;
      if (raddr > UINT64_MAX - bytes) throw TypedError(env, "TW_INVALID_INPUT", "bad remote address");
      sgeSum += ns;
    }

    // Second pass: build the chain (the vectors are sized first: sg_list points into them).
    postWrs_.resize(count);
    postSges_.resize(sgeSum);
    size_t at = 0;
    for (size_t i = 0; i < count; i++) {
      const double* f = w + i * 6;
      const size_t s0 = static_cast<size_t>(f[4]), ns = static_cast<size_t>(f[5]);
      ibv_sge* list = &postSges_[at];
      for (size_t k = 0; k < ns; k++) {
        const double* e = sg + (s0 + k) * 3;
        uint32_t mrId = static_cast<uint32_t>(e[0]);
        if (lastMr == nullptr || mrId != lastMrId) {
          lastMr = &mrs_.find(mrId)->second;  // validated above
          lastMrId = mrId;
        }
        ibv_mr* mr = lastMr->mr;
        list[k].addr = reinterpret_cast<uintptr_t>(mr->addr) + static_cast<uint64_t>(e[1]);
        list[k].length = static_cast<uint32_t>(e[2]);
        list[k].lkey = mr->lkey;
      }
      at += ns;
      ibv_send_wr& wr = postWrs_[i];
      std::memset(&wr, 0, sizeof wr);
      wr.wr_id = wrIdBase + i;
      wr.sg_list = list;
      wr.num_sge = static_cast<int>(ns);
      wr.opcode = f[0] == 0 ? IBV_WR_RDMA_READ : IBV_WR_RDMA_WRITE;
      wr.send_flags = i + 1 == count ? IBV_SEND_SIGNALED : 0;
      wr.wr.rdma.remote_addr = (static_cast<uint64_t>(f[1]) << 32) | static_cast<uint64_t>(f[2]);
      wr.wr.rdma.rkey = rkeys[static_cast<size_t>(f[3])];
      wr.next = i + 1 < count ? &postWrs_[i + 1] : nullptr;
    }
    ibv_send_wr* bad = nullptr;
    int rc = ibv_post_send(q.qp, postWrs_.data(), &bad);
    size_t posted = count;
    if (rc != 0) {
      posted = 0;
      if (bad != nullptr) {
        for (size_t i = 0; i < count && &postWrs_[i] != bad; i++) posted++;
      }
    }
    counters_->postedWrs += static_cast<int64_t>(posted);
    Napi::Object o = Napi::Object::New(env);
    o.Set("posted", Napi::Number::New(env, static_cast<double>(posted)));
    o.Set("errno", rc);
    if (rc != 0) o.Set("error", "ibv_post_send: " + ErrnoText(rc));
    return o;
  }

  // allocMw() -> { id, rkey }: a type-2 memory window on this device's PD, unbound.
  Napi::Value AllocMw(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    CheckOpen(env);
    errno = 0;
    ibv_mw* mw = ibv_alloc_mw(pd_, IBV_MW_TYPE_2);  // EOPNOTSUPP when the provider has no windows
    if (mw == nullptr) {
      int e = errno;
      throw TypedError(env, e == ENOMEM ? "TW_RESOURCE_EXHAUSTED" : "TW_BACKEND_UNAVAILABLE", "ibv_alloc_mw: " + ErrnoText(e));
    }
    uint32_t id = nextId_++;
    mws_[id] = MwEntry{mw, mw->rkey};
    counters_->mws++;
    Napi::Object o = Napi::Object::New(env);
    o.Set("id", id);
    o.Set("rkey", mw->rkey);
    return o;
  }

  // bindMw(qpId, mwId, mrId, offset, length, access, wrId: bigint)
  //   -> { posted, rkey, errno, error? }
  // Posts one signaled IBV_WR_BIND_MW on the QP binding the window to
  // [offset, offset + length) of the registration, under a fresh key (ibv_inc_rkey of the
  // window's current one); the old key stops working once the bind executes. A failed
  // post is returned, not thrown (ENOMEM means the send queue is full), and leaves the
  // window's key unchanged; rkey is then the unchanged key.
  Napi::Value BindMw(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    QpEntry& q = FindQp(env, info[0]);
    uint32_t mwId = U32(info[1], "mw id");
    auto mwIt = mws_.find(mwId);
    if (mwIt == mws_.end()) throw TypedError(env, "TW_INVALID_INPUT", "unknown MW id " + std::to_string(mwId));
    uint32_t mrId = U32(info[2], "mr id");
    auto mrIt = mrs_.find(mrId);
    if (mrIt == mrs_.end()) throw TypedError(env, "TW_INVALID_INPUT", "unknown MR id " + std::to_string(mrId));
    const MrEntry& m = mrIt->second;
    uint64_t off = SafeIndex(info[3], "offset");
    uint64_t len = SafeIndex(info[4], "length");
    if (len == 0) throw TypedError(env, "TW_INVALID_INPUT", "a memory window needs a positive length");
    if (off > m.length || len > m.length - off) throw TypedError(env, "TW_INVALID_INPUT", "window range is outside its registration");
    uint32_t access = U32(info[5], "access");
    const uint32_t allowed = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;
    if ((access & ~allowed) != 0) {
      throw TypedError(env, "TW_INVALID_INPUT", "window access may only combine LocalWrite, RemoteWrite, RemoteRead and RemoteAtomic");
    }
    if ((m.access & IBV_ACCESS_MW_BIND) == 0) {
      throw TypedError(env, "TW_INVALID_INPUT", "MR " + std::to_string(mrId) + " was not registered with MwBind access");
    }
    if (info.Length() < 7 || !info[6].IsBigInt()) throw TypedError(env, "TW_INVALID_INPUT", "wrId must be a bigint");
    bool lossless = false;
    uint64_t wrId = info[6].As<Napi::BigInt>().Uint64Value(&lossless);
    if (!lossless) throw TypedError(env, "TW_INVALID_INPUT", "wrId must fit in 64 unsigned bits");

    MwEntry& w = mwIt->second;
    uint32_t newRkey = ibv_inc_rkey(w.rkey);
    ibv_send_wr wr;
    std::memset(&wr, 0, sizeof wr);
    wr.wr_id = wrId;
    wr.sg_list = nullptr;
    wr.num_sge = 0;
    wr.opcode = IBV_WR_BIND_MW;
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.next = nullptr;
    wr.bind_mw.mw = w.mw;
    wr.bind_mw.rkey = newRkey;
    wr.bind_mw.bind_info.mr = m.mr;
    wr.bind_mw.bind_info.addr = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(m.mr->addr)) + off;
    wr.bind_mw.bind_info.length = len;
    wr.bind_mw.bind_info.mw_access_flags = access;
    ibv_send_wr* bad = nullptr;
    int rc = ibv_post_send(q.qp, &wr, &bad);
    Napi::Object o = Napi::Object::New(env);
    if (rc == 0) {
      w.rkey = newRkey;
      counters_->postedWrs++;
    }
    o.Set("posted", rc == 0);
    o.Set("rkey", w.rkey);
    o.Set("errno", rc);
    if (rc != 0) o.Set("error", "ibv_post_send(BIND_MW): " + ErrnoText(rc));
    return o;
  }

  // deallocMw(id) -> false when the id is unknown or the device is closed. Deallocating a
  // bound type-2 window invalidates its rkey.
  Napi::Value DeallocMw(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    if (!open_) return Napi::Boolean::New(env, false);
    uint32_t id = U32(info[0], "mw id");
    auto it = mws_.find(id);
    if (it == mws_.end()) return Napi::Boolean::New(env, false);
    int rc = ibv_dealloc_mw(it->second.mw);
    if (rc != 0) throw TypedError(env, "TW_BACKEND_UNAVAILABLE", "ibv_dealloc_mw: " + ErrnoText(rc));
    mws_.erase(it);
    counters_->mws--;
    return Napi::Boolean::New(env, true);
  }

  Napi::Value Close(const Napi::CallbackInfo& info) {
    Teardown();
    return info.Env().Undefined();
  }
};

#else  // !TW_HAVE_VERBS_H

class Device : public Napi::ObjectWrap<Device> {
 public:
  static Napi::Function Init(Napi::Env env) { return DefineClass(env, "Device", {}); }
  Device(const Napi::CallbackInfo& info) : Napi::ObjectWrap<Device>(info) {
    throw TypedError(info.Env(), "TW_BACKEND_UNAVAILABLE", "built without infiniband/verbs.h");
  }
  void Teardown() {}
};

#endif  // TW_HAVE_VERBS_H

RdmaAddon::RdmaAddon(Napi::Env env, Napi::Object exports) {
  DefineAddon(exports, {
                           InstanceMethod("probe", &RdmaAddon::Probe),
                           InstanceMethod("counters", &RdmaAddon::GetCounters),
                           InstanceMethod("listDevices", &RdmaAddon::ListDevices),
                           InstanceMethod("wcStatusString", &RdmaAddon::WcStatusString),
                           InstanceValue("Device", Device::Init(env)),
#ifdef TW_HAVE_VERBS_H
                           InstanceValue("builtWithVerbs", Napi::Boolean::New(env, true)),
#else
                           InstanceValue("builtWithVerbs", Napi::Boolean::New(env, false)),
#endif
                           InstanceValue("napiVersion", Napi::Number::New(env, NAPI_VERSION)),
                       });
}

RdmaAddon::~RdmaAddon() {
  // Environment teardown (process exit or worker termination): close what is still open.
  while (!liveDevices.empty()) liveDevices.back()->Teardown();
}

// probe() -> { built, buildReason?, library: { loaded, error? }, dmabuf,
//             fork: { status, error? }, deviceList: { ok, count, error? } }
Napi::Value RdmaAddon::Probe(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  Napi::Object out = Napi::Object::New(env);
#ifdef TW_HAVE_VERBS_H
  out.Set("built", true);
  Napi::Object lib = Napi::Object::New(env);
  bool ok = verbs.Load();
  lib.Set("loaded", ok);
  if (!ok) lib.Set("error", verbs.error);
  out.Set("library", lib);
  out.Set("dmabuf", ok && verbs.reg_dmabuf_mr != nullptr);
  if (ok) {
    Napi::Object fork = Napi::Object::New(env);
    fork.Set("status", verbs.forkOutcome.status);
    if (!verbs.forkOutcome.error.empty()) fork.Set("error", verbs.forkOutcome.error);
    out.Set("fork", fork);
    Napi::Object dl = Napi::Object::New(env);
    int n = 0;
    errno = 0;
    ibv_device** list = verbs.get_device_list(&n);
    if (list == nullptr) {
      int e = errno;
      dl.Set("ok", false);
      dl.Set("count", 0);
      dl.Set("error", "ibv_get_device_list: " + ErrnoText(e));
    } else {
      dl.Set("ok", true);
      dl.Set("count", n);
      Napi::Array names = Napi::Array::New(env);
      for (int i = 0; i < n; i++) names.Set(static_cast<uint32_t>(i), std::string(verbs.get_device_name(list[i])));
      dl.Set("names", names);
      verbs.free_device_list(list);
    }
    out.Set("deviceList", dl);
  }
#else
  out.Set("built", false);
  out.Set("buildReason", "built without infiniband/verbs.h (install libibverbs-dev / rdma-core-devel and rebuild)");
  out.Set("dmabuf", false);
#endif
  return out;
}

Napi::Value RdmaAddon::GetCounters(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  Napi::Object o = Napi::Object::New(env);
  auto set = [&](const char* k, const std::atomic<int64_t>& v) { o.Set(k, Napi::Number::New(env, static_cast<double>(v.load()))); };
  set("devices", counters->devices);
  set("pds", counters->pds);
  set("mrs", counters->mrs);
  set("mws", counters->mws);
  set("cqs", counters->cqs);
  set("qps", counters->qps);
  set("channels", counters->channels);
  set("threads", counters->threads);
  set("postedWrs", counters->postedWrs);
  set("completions", counters->completions);
  return o;
}

// listDevices() -> [{ name, guid, ...DescribeContext }] (opens each device briefly)
Napi::Value RdmaAddon::ListDevices(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
#ifdef TW_HAVE_VERBS_H
  if (!verbs.Load()) throw TypedError(env, "TW_BACKEND_UNAVAILABLE", verbs.error);
  int n = 0;
  errno = 0;
  ibv_device** list = verbs.get_device_list(&n);
  if (list == nullptr) throw TypedError(env, "TW_BACKEND_UNAVAILABLE", "ibv_get_device_list: " + ErrnoText(errno));
  Napi::Array out = Napi::Array::New(env);
  for (int i = 0; i < n; i++) {
    const char* name = verbs.get_device_name(list[i]);
    ibv_context* ctx = verbs.open_device(list[i]);
    Napi::Object d;
    if (ctx == nullptr) {
      d = Napi::Object::New(env);
      d.Set("error", "ibv_open_device: " + ErrnoText(errno));
    } else {
      d = DescribeContext(env, verbs, ctx);
      verbs.close_device(ctx);
    }
    d.Set("name", std::string(name));
    uint64_t guid = be64toh(verbs.get_device_guid(list[i]));
    char buf[32];
    snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(guid));
    d.Set("guid", std::string(buf));
    out.Set(static_cast<uint32_t>(i), d);
  }
  verbs.free_device_list(list);
  return out;
#else
  throw TypedError(env, "TW_BACKEND_UNAVAILABLE", "built without infiniband/verbs.h");
#endif
}

Napi::Value RdmaAddon::WcStatusString(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  if (info.Length() < 1 || !info[0].IsNumber()) throw TypedError(env, "TW_INVALID_INPUT", "wcStatusString(status: number)");
  int s = info[0].As<Napi::Number>().Int32Value();
#ifdef TW_HAVE_VERBS_H
  if (verbs.Load()) return Napi::String::New(env, verbs.wc_status_str(static_cast<ibv_wc_status>(s)));
#endif
  return Napi::String::New(env, "status " + std::to_string(s));
}

}  // namespace tw

using tw::RdmaAddon;
NODE_API_ADDON(RdmaAddon)
