// Node-API bindings for @tensorwire/cuda-ipc. Per-environment state lives in the Addon
// instance (no module-level statics), so the addon works in worker threads.
#include <napi.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <map>
#include <string>
#include <vector>

#include "copy_pool.h"
#include "cuda.h"
#include "layout.h"
#include "shm.h"

namespace tw {
namespace {

// Retries of one slot's ranges that overlapped a write, when copyBatch is not told.
constexpr uint32_t kDefaultBatchAttempts = 10000;

const char* ErrnoName(int e) {
  switch (e) {
    case EEXIST: return "EEXIST";
    case ENOENT: return "ENOENT";
    case EACCES: return "EACCES";
    case EPERM: return "EPERM";
    case ENOSPC: return "ENOSPC";
    case ENOMEM: return "ENOMEM";
    case EINVAL: return "EINVAL";
    case ENAMETOOLONG: return "ENAMETOOLONG";
    case EMFILE: return "EMFILE";
    default: return "";
  }
}

[[noreturn]] void Throw(Napi::Env env, const Status& s) {
  Napi::Error e = Napi::Error::New(env, s.message);
  e.Set("code", Napi::String::New(env, s.code));
  if (s.err != 0) {
    e.Set("errno", Napi::Number::New(env, s.err));
    e.Set("errnoName", Napi::String::New(env, ErrnoName(s.err)));
    e.Set("syscall", Napi::String::New(env, s.syscall));
  }
  throw e;
}

[[noreturn]] void ThrowInvalid(Napi::Env env, const std::string& message) { Throw(env, Status::Fail(kInvalidInput, message)); }

Napi::Value CudaError(Napi::Env env, const CudaStatus& s) {
  const char* code = kBackendUnavailable;
  if (s.result == CUDA_ERROR_OUT_OF_MEMORY) code = kResourceExhausted;
  if (s.result == CUDA_ERROR_INVALID_VALUE || s.result == CUDA_ERROR_INVALID_HANDLE || s.result == CUDA_ERROR_INVALID_DEVICE) {
    code = kInvalidInput;
  }
  Napi::Error e = Napi::Error::New(env, s.message);
  e.Set("code", Napi::String::New(env, code));
  e.Set("cuResult", Napi::Number::New(env, s.result));
  e.Set("cuCall", Napi::String::New(env, s.call));
  return e.Value();
}

struct Bytes {
  uint8_t* data = nullptr;
  size_t size = 0;
};

// A segment mapping (ArrayBuffer) or any ArrayBuffer handed in for decoding.
Bytes SegmentArg(const Napi::CallbackInfo& info, size_t i) {
  if (info.Length() <= i || !info[i].IsArrayBuffer()) ThrowInvalid(info.Env(), "argument " + std::to_string(i) + " must be an ArrayBuffer");
  Napi::ArrayBuffer ab = info[i].As<Napi::ArrayBuffer>();
  return Bytes{static_cast<uint8_t*>(ab.Data()), ab.ByteLength()};
}

Bytes U8Arg(const Napi::CallbackInfo& info, size_t i) {
  if (info.Length() <= i || !info[i].IsTypedArray()) ThrowInvalid(info.Env(), "argument " + std::to_string(i) + " must be a Uint8Array");
  Napi::TypedArray ta = info[i].As<Napi::TypedArray>();
  if (ta.TypedArrayType() != napi_uint8_array) ThrowInvalid(info.Env(), "argument " + std::to_string(i) + " must be a Uint8Array");
  Napi::Uint8Array u8 = ta.As<Napi::Uint8Array>();
  return Bytes{u8.Data(), u8.ByteLength()};
}

std::string StrArg(const Napi::CallbackInfo& info, size_t i) {
  if (info.Length() <= i || !info[i].IsString()) ThrowInvalid(info.Env(), "argument " + std::to_string(i) + " must be a string");
  return info[i].As<Napi::String>().Utf8Value();
}

uint64_t U64Arg(const Napi::CallbackInfo& info, size_t i) {
  if (info.Length() > i && info[i].IsBigInt()) {
    bool lossless = false;
    uint64_t v = info[i].As<Napi::BigInt>().Uint64Value(&lossless);
    if (!lossless) ThrowInvalid(info.Env(), "argument " + std::to_string(i) + " does not fit 64 bits");
    return v;
  }
  if (info.Length() > i && info[i].IsNumber()) {
    double d = info[i].As<Napi::Number>().DoubleValue();
    if (!(d >= 0) || d > 9007199254740991.0 || d != static_cast<double>(static_cast<uint64_t>(d))) {
      ThrowInvalid(info.Env(), "argument " + std::to_string(i) + " must be a non-negative safe integer");
    }
    return static_cast<uint64_t>(d);
  }
  ThrowInvalid(info.Env(), "argument " + std::to_string(i) + " must be a number or bigint");
}

int32_t I32Arg(const Napi::CallbackInfo& info, size_t i) {
  if (info.Length() <= i || !info[i].IsNumber()) ThrowInvalid(info.Env(), "argument " + std::to_string(i) + " must be a number");
  double d = info[i].As<Napi::Number>().DoubleValue();
  if (d != static_cast<double>(static_cast<int32_t>(d))) ThrowInvalid(info.Env(), "argument " + std::to_string(i) + " must be an int32");
  return static_cast<int32_t>(d);
}

std::vector<uint64_t> ShapeFrom(Napi::Env env, Napi::Value v) {
  if (!v.IsArray()) ThrowInvalid(env, "shape must be an array");
  Napi::Array a = v.As<Napi::Array>();
  if (a.Length() > kMaxNdim) ThrowInvalid(env, "shape has more than " + std::to_string(kMaxNdim) + " dimensions");
  std::vector<uint64_t> out;
  for (uint32_t i = 0; i < a.Length(); i++) {
    Napi::Value d = a.Get(i);
    if (!d.IsNumber()) ThrowInvalid(env, "shape[" + std::to_string(i) + "] must be a number");
    double x = d.As<Napi::Number>().DoubleValue();
    if (!(x >= 0) || x > 9007199254740991.0 || x != static_cast<double>(static_cast<uint64_t>(x))) {
      ThrowInvalid(env, "shape[" + std::to_string(i) + "] must be a non-negative safe integer");
    }
    out.push_back(static_cast<uint64_t>(x));
  }
  return out;
}

Napi::Object MetaToJs(Napi::Env env, const Meta& m) {
  Napi::Object o = Napi::Object::New(env);
  o.Set("kind", m.kind);
  o.Set("version", m.version);
  o.Set("headerSize", m.header_size);
  o.Set("dataOffset", Napi::Number::New(env, static_cast<double>(m.data_offset)));
  o.Set("capacity", Napi::Number::New(env, static_cast<double>(m.capacity)));
  o.Set("ownerPid", m.owner_pid);
  o.Set("device", m.device);
  o.Set("ownerStart", Napi::BigInt::New(env, m.owner_start));
  o.Set("ipcOffset", Napi::Number::New(env, static_cast<double>(m.ipc_offset)));
  o.Set("ipcHandle", Napi::Buffer<uint8_t>::Copy(env, m.ipc_handle, kIpcHandleBytes));
  o.Set("generation", Napi::BigInt::New(env, m.generation));
  o.Set("state", m.state);
  o.Set("importers", m.importers);
  o.Set("byteLength", Napi::Number::New(env, static_cast<double>(m.byte_length)));
  o.Set("dtype", m.dtype);
  Napi::Array shape = Napi::Array::New(env, m.ndim);
  for (uint32_t i = 0; i < m.ndim && i < kMaxNdim; i++) shape.Set(i, Napi::Number::New(env, static_cast<double>(m.shape[i])));
  o.Set("shape", shape);
  o.Set("id", m.id);
  return o;
}

void Unmap(Napi::Env, void* data, size_t* size) {
  if (data != nullptr && size != nullptr) munmap(data, *size);
  delete size;
}

Napi::ArrayBuffer WrapMapping(Napi::Env env, const Mapping& m) {
  // The mapping lives until V8 collects every view of this ArrayBuffer; the finalizer unmaps.
  size_t* hint = new size_t(m.size);
  try {
    return Napi::ArrayBuffer::New(env, m.addr, m.size, Unmap, hint);
  } catch (...) {
    munmap(m.addr, m.size);
    delete hint;
    throw;
  }
}

// Runs a CUDA driver call on the libuv thread pool and settles a promise with the result.
class CudaWorker : public Napi::AsyncWorker {
 public:
  using Exec = std::function<CudaStatus()>;
  using Done = std::function<Napi::Value(Napi::Env)>;
  CudaWorker(Napi::Env env, Exec exec, Done done)
      : Napi::AsyncWorker(env, "tensorwire.cuda"), deferred_(Napi::Promise::Deferred::New(env)), exec_(std::move(exec)),
        done_(std::move(done)) {}
  Napi::Promise Promise() { return deferred_.Promise(); }
  // Keeps a JS buffer (and so the memory it views) alive until the work settles.
  void Keep(Napi::Value v) {
    if (v.IsObject()) keep_.push_back(Napi::Persistent(v.As<Napi::Object>()));
  }
  void Execute() override { status_ = exec_(); }
  void OnOK() override {
    Napi::Env env = Env();
    if (!status_.ok()) {
      deferred_.Reject(CudaError(env, status_));
      return;
    }
    try {
      deferred_.Resolve(done_ ? done_(env) : env.Undefined());
    } catch (const Napi::Error& e) {
      deferred_.Reject(e.Value());
    }
  }
  void OnError(const Napi::Error& e) override { deferred_.Reject(e.Value()); }

 private:
  Napi::Promise::Deferred deferred_;
  Exec exec_;
  Done done_;
  CudaStatus status_;
  std::vector<Napi::ObjectReference> keep_;
};

// The tables of copyBatch kept for batches that reuse them (planBatch / copyPlanned).
struct BatchPlan {
  struct GrantInfo {
    uint64_t record;
    uint64_t generation;
  };
  bool write = false;
  std::vector<Napi::ObjectReference> locals;    // Uint8Array
  std::vector<Napi::ObjectReference> segments;  // ArrayBuffer
  std::vector<bool> seqlocked;
  std::vector<Napi::ObjectReference> grants;  // ArrayBuffer
  std::vector<GrantInfo> grant_info;
  std::vector<uint8_t> tokens;
  std::vector<BatchRemote> remotes;
  std::vector<double> spans;
  Napi::ObjectReference generations;  // BigUint64Array
};

// One copy's tables with every pointer and length read (on the JavaScript thread) and its
// ranges decoded, checked and merged: what RunBatch needs, nothing JavaScript can change.
struct RunState {
  BatchInput in;
  std::vector<BatchLocal> locals;
  std::vector<BatchSegment> segments;
  std::vector<BatchGrant> grants;
  std::vector<BatchRange> ranges;
  std::vector<uint32_t> order;
};

// copyPlannedAsync's work: RunBatch on a thread of libuv's pool over a RunState prepared on the
// JavaScript thread. It holds references to the plan (whose references keep every buffer and
// mapping the copy touches alive: a mapping is unmapped only by its ArrayBuffer's finalizer)
// and to the caller's generations array, written when the copy has ended. Settles its promise
// on the JavaScript thread; the environment's teardown waits for queued work to end.
class CopyWorker : public Napi::AsyncWorker {
 public:
  CopyWorker(Napi::Env env, Napi::Object plan, BatchPlan* batch_plan, Napi::Object generations)
      : Napi::AsyncWorker(env, "tensorwire.copy"), deferred_(Napi::Promise::Deferred::New(env)), plan_(Napi::Persistent(plan)), batch_plan_(batch_plan),
        generations_(Napi::Persistent(generations)) {}
  Napi::Promise Promise() { return deferred_.Promise(); }
  RunState& state() { return state_; }
  std::vector<uint64_t>& gens() { return gens_; }
  // The caller's control word (kCopyQueued when queued), referenced until the copy settles.
  void SetControl(Napi::Int32Array control) {
    control_ = Napi::Persistent(control.As<Napi::Object>());
    control_word_ = control.Data();
    state_.in.control = control_word_;
  }
  void Execute() override;
  void OnOK() override;
  void OnError(const Napi::Error& e) override;

 private:
  Napi::Promise::Deferred deferred_;
  Napi::ObjectReference plan_;
  BatchPlan* batch_plan_;  // plan_'s, alive while plan_ is referenced
  Napi::ObjectReference generations_;
  Napi::ObjectReference control_;
  int32_t* control_word_ = nullptr;  // control_'s element 0 (null: none)
  RunState state_;
  std::vector<uint64_t> gens_;
  BatchFailure failure_;
  bool ok_ = false;
};

// The error a failed batch throws: message, `code`, and where it is about one `remoteCode`,
// `range`, `grant`, `segment`.
Napi::Error BatchError(Napi::Env env, const BatchFailure& f) {
  Napi::Error e = Napi::Error::New(env, f.message);
  e.Set("code", Napi::String::New(env, f.code));
  if (f.remote_code[0] != '\0') e.Set("remoteCode", Napi::String::New(env, f.remote_code));
  if (f.range >= 0) e.Set("range", Napi::Number::New(env, static_cast<double>(f.range)));
  if (f.grant >= 0) e.Set("grant", Napi::Number::New(env, static_cast<double>(f.grant)));
  if (f.segment >= 0) e.Set("segment", Napi::Number::New(env, static_cast<double>(f.segment)));
  return e;
}

void CopyWorker::Execute() {
  // Claim the copy (queued -> copying): one the caller cancelled while it waited for this pool
  // thread is not started at all (the caller may have settled it already), and one whose
  // deadline passed while it waited fails before any byte moves.
  int32_t queued = kCopyQueued;
  if (control_word_ != nullptr && !__atomic_compare_exchange_n(control_word_, &queued, kCopyRunning, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
    failure_.code = kAborted;
    failure_.message = "the copy was cancelled before it started (its transfer was aborted or timed out)";
    ok_ = false;
    return;
  }
  if (state_.in.deadline_ms > 0 && BatchNowMs() > state_.in.deadline_ms) {
    failure_.code = kTimedOut;
    failure_.message = "deadline passed while the copy waited for a thread";
    ok_ = false;
    return;
  }
  ok_ = RunBatch(state_.in, &state_.order, gens_.data(), &failure_);
}

void CopyWorker::OnOK() {
  Napi::Env env = Env();
  try {
    // The generations each seqlocked segment was copied at, into the caller's array (its length
    // was checked when the work was queued; a typed array's length is fixed, and a detached one
    // reads as 0 elements).
    Napi::TypedArray out = generations_.Value().As<Napi::TypedArray>();
    if (out.ElementLength() >= gens_.size() && !gens_.empty()) {
      uint64_t* g = reinterpret_cast<uint64_t*>(static_cast<uint8_t*>(out.ArrayBuffer().Data()) + out.ByteOffset());
      std::memcpy(g, gens_.data(), gens_.size() * sizeof(uint64_t));
    }
    // A local buffer detached (transferred) or shrunk while the copy ran: the bytes went to
    // memory it no longer owns. Said, since it cannot be undone (the README forbids it).
    for (size_t i = 0; ok_ && i < batch_plan_->locals.size() && i < state_.locals.size(); i++) {
      if (batch_plan_->locals[i].Value().As<Napi::Uint8Array>().ByteLength() < state_.locals[i].size) {
        ok_ = false;
        failure_ = BatchFailure{};
        failure_.code = kInvalidInput;
        failure_.message = "local buffer " + std::to_string(i) + " of the batch was detached or shrunk while the copy ran";
      }
    }
    if (ok_) deferred_.Resolve(env.Undefined());
    else deferred_.Reject(BatchError(env, failure_).Value());
  } catch (const Napi::Error&) {
    // The environment is being torn down (a worker thread terminated while the copy ran, which
    // teardown waits for): no JavaScript can run, and nobody is left to tell. An error escaping
    // here would end the process.
  }
}

void CopyWorker::OnError(const Napi::Error& e) {
  try {
    deferred_.Reject(e.Value());
  } catch (const Napi::Error&) {
    // Torn down, as in OnOK.
  }
}
const napi_type_tag kBatchPlanTag = {0x74776261746368ULL, 0x706c616e76310001ULL};

class Addon : public Napi::Addon<Addon> {
 public:
  Addon(Napi::Env env, Napi::Object exports) : cuda_(std::make_shared<CudaDriver>()) {
    DefineAddon(exports, {
        InstanceMethod("layout", &Addon::Layout),
        InstanceMethod("nameProblem", &Addon::NameProblemJs),
        InstanceMethod("shmCreate", &Addon::ShmCreate),
        InstanceMethod("shmOpen", &Addon::ShmOpen),
        InstanceMethod("shmUnlink", &Addon::ShmUnlink),
        InstanceMethod("shmUnlinkAll", &Addon::ShmUnlinkAll),
        InstanceMethod("shmCreated", &Addon::ShmCreated),
        InstanceMethod("shmLocate", &Addon::ShmLocate),
        InstanceMethod("headerDecode", &Addon::HeaderDecode),
        InstanceMethod("viewMeta", &Addon::ViewMetaJs),
        InstanceMethod("seqWrite", &Addon::SeqWriteJs),
        InstanceMethod("seqCheck", &Addon::SeqCheckJs),
        InstanceMethod("seqCopy", &Addon::SeqCopyJs),
        InstanceMethod("seqCopyRange", &Addon::SeqCopyRangeJs),
        InstanceMethod("copyBatch", &Addon::CopyBatchJs),
        InstanceMethod("planBatch", &Addon::PlanBatchJs),
        InstanceMethod("copyPlanned", &Addon::CopyPlannedJs),
        InstanceMethod("copyPlannedAsync", &Addon::CopyPlannedAsyncJs),
        // copyPlannedAsync takes a control word (an addon built before it ignores one).
        InstanceValue("copyControl", Napi::Boolean::New(env, true), napi_enumerable),
        InstanceMethod("setState", &Addon::SetStateJs),
        InstanceMethod("loadState", &Addon::LoadStateJs),
        InstanceMethod("importerAdd", &Addon::ImporterAddJs),
        InstanceMethod("importerRemove", &Addon::ImporterRemoveJs),
        InstanceMethod("importers", &Addon::ImportersJs),
        InstanceMethod("grantEnter", &Addon::GrantEnterJs),
        InstanceMethod("grantLeave", &Addon::GrantLeaveJs),
        InstanceMethod("grantActive", &Addon::GrantActiveJs),
        InstanceMethod("grantRevoke", &Addon::GrantRevokeJs),
        InstanceMethod("recordEnter", &Addon::RecordEnterJs),
        InstanceMethod("recordLeave", &Addon::RecordLeaveJs),
        InstanceMethod("recordActive", &Addon::RecordActiveJs),
        InstanceMethod("recordPublish", &Addon::RecordPublishJs),
        InstanceMethod("recordRevoke", &Addon::RecordRevokeJs),
        InstanceMethod("recordFree", &Addon::RecordFreeJs),
        InstanceMethod("writeRangeTable", &Addon::WriteRangeTableJs),
        InstanceMethod("cudaProbe", &Addon::CudaProbe),
        InstanceMethod("cudaAlloc", &Addon::CudaAlloc),
        InstanceMethod("cudaExport", &Addon::CudaExport),
        InstanceMethod("cudaFree", &Addon::CudaFree),
        InstanceMethod("cudaImport", &Addon::CudaImport),
        InstanceMethod("cudaCloseImport", &Addon::CudaCloseImport),
        InstanceMethod("cudaCopy", &Addon::CudaCopy),
        InstanceMethod("cudaCopyRanges", &Addon::CudaCopyRanges),
        InstanceMethod("cudaHostRegister", &Addon::CudaHostRegister),
        InstanceMethod("cudaHostUnregister", &Addon::CudaHostUnregister),
    });
  }

  // Environment teardown: unlink every segment this environment created and did not free.
  ~Addon() {
    for (const auto& c : created_) {
      bool existed = false;
      UnlinkSegment(c.first, &existed);
      close(c.second);
    }
  }

 private:
  Napi::Value Layout(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    Napi::Object o = Napi::Object::New(env);
    o.Set("headerSize", kHeaderSize);
    o.Set("dataOffset", Napi::Number::New(env, static_cast<double>(kDataOffset)));
    o.Set("maxNdim", kMaxNdim);
    o.Set("maxNameLength", Napi::Number::New(env, static_cast<double>(kMaxNameLength)));
    o.Set("maxSegmentBytes", Napi::Number::New(env, static_cast<double>(kMaxSegmentBytes)));
    o.Set("tokenBytes", Napi::Number::New(env, static_cast<double>(kTokenBytes)));
    Napi::Object offsets = Napi::Object::New(env);
#define TW_OFF(f) offsets.Set(#f, Napi::Number::New(env, static_cast<double>(off::f)))
    TW_OFF(magic); TW_OFF(version); TW_OFF(kind); TW_OFF(header_size); TW_OFF(data_offset); TW_OFF(capacity);
    TW_OFF(owner_pid); TW_OFF(device); TW_OFF(owner_start); TW_OFF(ipc_offset); TW_OFF(ipc_handle);
    TW_OFF(generation); TW_OFF(state); TW_OFF(importers); TW_OFF(active); TW_OFF(byte_length); TW_OFF(dtype);
    TW_OFF(ndim); TW_OFF(shape); TW_OFF(id_length); TW_OFF(id); TW_OFF(ext); TW_OFF(grant_token);
    TW_OFF(grant_target); TW_OFF(grant_offset); TW_OFF(grant_length); TW_OFF(grant_name_len); TW_OFF(grant_name);
    TW_OFF(table_records); TW_OFF(table_dir); TW_OFF(table_arena);
#undef TW_OFF
    o.Set("offsets", offsets);
    Napi::Object table = Napi::Object::New(env);
    table.Set("recordBytes", Napi::Number::New(env, static_cast<double>(kRecordBytes)));
    table.Set("dirEntryBytes", Napi::Number::New(env, static_cast<double>(kDirEntryBytes)));
    table.Set("rangeEntryBytes", Napi::Number::New(env, static_cast<double>(kRangeEntryBytes)));
    table.Set("recordState", Napi::Number::New(env, static_cast<double>(rec::state)));
    table.Set("recordActive", Napi::Number::New(env, static_cast<double>(rec::active)));
    table.Set("recordGeneration", Napi::Number::New(env, static_cast<double>(rec::generation)));
    table.Set("recordToken", Napi::Number::New(env, static_cast<double>(rec::token)));
    table.Set("recordArenaOffset", Napi::Number::New(env, static_cast<double>(rec::arena_offset)));
    table.Set("recordCount", Napi::Number::New(env, static_cast<double>(rec::count)));
    table.Set("recordForm", Napi::Number::New(env, static_cast<double>(rec::form)));
    table.Set("maxRecords", Napi::Number::New(env, static_cast<double>(kMaxTableRecords)));
    table.Set("maxDir", Napi::Number::New(env, static_cast<double>(kMaxTableDir)));
    table.Set("maxArena", Napi::Number::New(env, static_cast<double>(kMaxTableArena)));
    o.Set("table", table);
    return o;
  }

  Napi::Value NameProblemJs(const Napi::CallbackInfo& info) {
    std::string p = NameProblem(StrArg(info, 0));
    return p.empty() ? info.Env().Undefined() : Napi::String::New(info.Env(), p);
  }

  Napi::Value ShmCreate(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    std::string name = StrArg(info, 0);
    uint64_t size = U64Arg(info, 1);
    if (info.Length() < 3 || !info[2].IsObject()) ThrowInvalid(env, "init must be an object");
    Napi::Object o = info[2].As<Napi::Object>();
    auto num = [&](const char* key, double dflt) -> double {
      Napi::Value v = o.Get(key);
      if (v.IsUndefined()) return dflt;
      if (!v.IsNumber()) ThrowInvalid(env, std::string("init.") + key + " must be a number");
      return v.As<Napi::Number>().DoubleValue();
    };
    InitParams p;
    p.kind = static_cast<uint32_t>(num("kind", kKindPool));
    if (p.kind < kKindPool || p.kind > kKindTable) ThrowInvalid(env, "init.kind is unknown");
    p.data_offset = static_cast<uint64_t>(num("dataOffset", 0));
    p.capacity = static_cast<uint64_t>(num("capacity", 0));
    p.owner_pid = static_cast<uint32_t>(num("ownerPid", 0));
    p.device = static_cast<int32_t>(num("device", -1));
    p.ipc_offset = static_cast<uint64_t>(num("ipcOffset", 0));
    p.byte_length = static_cast<uint64_t>(num("byteLength", 0));
    p.dtype = static_cast<uint32_t>(num("dtype", 1));
    Napi::Value start = o.Get("ownerStart");
    if (start.IsBigInt()) {
      bool lossless = false;
      p.owner_start = start.As<Napi::BigInt>().Uint64Value(&lossless);
    }
    Napi::Value shape = o.Get("shape");
    if (!shape.IsUndefined()) p.shape = ShapeFrom(env, shape);
    Napi::Value id = o.Get("id");
    if (!id.IsString()) ThrowInvalid(env, "init.id must be a string");
    p.id = id.As<Napi::String>().Utf8Value();
    Napi::Value handle = o.Get("ipcHandle");
    if (handle.IsTypedArray()) {
      Napi::Uint8Array h = handle.As<Napi::Uint8Array>();
      if (h.ByteLength() != kIpcHandleBytes) ThrowInvalid(env, "init.ipcHandle must be 64 bytes");
      std::memcpy(p.ipc_handle, h.Data(), kIpcHandleBytes);
      p.has_ipc_handle = true;
    }
    Mapping m;
    Status s = CreateSegment(name, size, p, &m);
    if (!s.ok()) Throw(env, s);
    created_[name] = m.fd;
    try {
      return WrapMapping(env, m);
    } catch (...) {
      Forget(name);
      throw;
    }
  }

  Napi::Value ShmOpen(const Napi::CallbackInfo& info) {
    std::string name = StrArg(info, 0);
    uint64_t max = U64Arg(info, 1);
    Mapping m;
    Status s = OpenSegment(name, max, &m);
    if (!s.ok()) Throw(info.Env(), s);
    return WrapMapping(info.Env(), m);
  }

  Napi::Value ShmUnlink(const Napi::CallbackInfo& info) {
    std::string name = StrArg(info, 0);
    bool existed = false;
    Status s = UnlinkSegment(name, &existed);
    if (!s.ok()) Throw(info.Env(), s);
    CloseCreated(name);
    return Napi::Boolean::New(info.Env(), existed);
  }

  Napi::Value ShmUnlinkAll(const Napi::CallbackInfo& info) {
    uint32_t n = 0;
    for (const auto& c : created_) {
      bool existed = false;
      if (UnlinkSegment(c.first, &existed).ok() && existed) n++;
      close(c.second);
    }
    created_.clear();
    return Napi::Number::New(info.Env(), n);
  }

  Napi::Value ShmCreated(const Napi::CallbackInfo& info) {
    Napi::Array a = Napi::Array::New(info.Env(), created_.size());
    uint32_t i = 0;
    for (const auto& c : created_) a.Set(i++, c.first);
    return a;
  }

  // shmLocate(name): the locator of a segment, read without opening the segment itself
  // (sweep() and create collisions judge a dead owner's leftovers by it): { pid, fd, kind,
  // ownerStart (bigint), size }.
  Napi::Value ShmLocate(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    Locator l;
    Status s = ReadLocator(StrArg(info, 0), &l);
    if (!s.ok()) Throw(env, s);
    Napi::Object o = Napi::Object::New(env);
    o.Set("pid", Napi::Number::New(env, l.pid));
    o.Set("fd", Napi::Number::New(env, l.fd));
    o.Set("kind", Napi::Number::New(env, l.kind));
    o.Set("ownerStart", Napi::BigInt::New(env, l.owner_start));
    o.Set("size", Napi::Number::New(env, static_cast<double>(l.size)));
    return o;
  }

  // The memfd behind a segment this environment created: closed once its name is unlinked,
  // so readers can no longer open it (mappings already made stay valid).
  void CloseCreated(const std::string& name) {
    auto it = created_.find(name);
    if (it == created_.end()) return;
    close(it->second);
    created_.erase(it);
  }

  void Forget(const std::string& name) {
    bool existed = false;
    UnlinkSegment(name, &existed);
    CloseCreated(name);
  }

  Napi::Value HeaderDecode(const Napi::CallbackInfo& info) {
    Bytes b = SegmentArg(info, 0);
    uint32_t kind = info.Length() > 1 && info[1].IsNumber() ? info[1].As<Napi::Number>().Uint32Value() : 0;
    std::string expect = info.Length() > 2 && info[2].IsString() ? info[2].As<Napi::String>().Utf8Value() : "";
    Meta m;
    Status s = DecodeHeader(b.data, b.size, kind, expect, &m);
    if (!s.ok()) Throw(info.Env(), s);
    return MetaToJs(info.Env(), m);
  }

  // The id -> view hot path: the same validation and seqlock-consistent read as
  // headerDecode(segment, pool, id), but the tensor fields go into a caller-owned
  // Float64Array (state, device, byteLength, capacity, dtype, ndim, shape[8]) instead of a
  // fresh 17-property object, and only the generation is returned (a bigint).
  Napi::Value ViewMetaJs(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    Bytes b = SegmentArg(info, 0);
    std::string expect = StrArg(info, 1);
    if (info.Length() <= 2 || !info[2].IsTypedArray() || info[2].As<Napi::TypedArray>().TypedArrayType() != napi_float64_array) {
      ThrowInvalid(env, "argument 2 must be a Float64Array");
    }
    Napi::Float64Array out = info[2].As<Napi::Float64Array>();
    if (out.ElementLength() < 6 + kMaxNdim) ThrowInvalid(env, "argument 2 must hold at least " + std::to_string(6 + kMaxNdim) + " numbers");
    Meta m;
    Status s = DecodeHeader(b.data, b.size, kKindPool, expect, &m);
    if (!s.ok()) Throw(env, s);
    double* o = out.Data();
    o[0] = m.state;
    o[1] = m.device;
    o[2] = static_cast<double>(m.byte_length);
    o[3] = static_cast<double>(m.capacity);
    o[4] = m.dtype;
    o[5] = m.ndim;
    for (uint32_t i = 0; i < kMaxNdim; i++) o[6 + i] = i < m.ndim ? static_cast<double>(m.shape[i]) : 0;
    return Napi::BigInt::New(env, m.generation);
  }

  Napi::Value SeqWriteJs(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    Bytes seg = SegmentArg(info, 0);
    uint64_t capacity = U64Arg(info, 1);
    Bytes src = U8Arg(info, 2);
    int32_t dtype = I32Arg(info, 3);
    if (dtype <= 0) ThrowInvalid(env, "dtype code must be positive");
    std::vector<uint64_t> shape = ShapeFrom(env, info.Length() > 4 ? info[4] : env.Undefined());
    uint64_t gen = 0;
    Status s = SeqWrite(seg.data, seg.size, capacity, src.data, src.size, static_cast<uint32_t>(dtype), shape, &gen);
    if (!s.ok()) Throw(env, s);
    return Napi::BigInt::New(env, gen);
  }

  Napi::Value SeqCheckJs(const Napi::CallbackInfo& info) {
    Bytes seg = SegmentArg(info, 0);
    uint64_t gen = U64Arg(info, 1);
    return Napi::Boolean::New(info.Env(), SeqCheck(seg.data, seg.size, gen));
  }

  Napi::Value SeqCopyJs(const Napi::CallbackInfo& info) {
    Bytes seg = SegmentArg(info, 0);
    std::string expect = info.Length() > 1 && info[1].IsString() ? info[1].As<Napi::String>().Utf8Value() : "";
    Bytes dst = U8Arg(info, 2);
    uint32_t attempts = info.Length() > 3 && info[3].IsNumber() ? info[3].As<Napi::Number>().Uint32Value() : 0;
    Meta m;
    Status s = SeqCopy(seg.data, seg.size, expect, dst.data, dst.size, attempts, &m);
    if (!s.ok()) Throw(info.Env(), s);
    return MetaToJs(info.Env(), m);
  }

  // seqCopyRange(segment, offset, length, dst, maxAttempts?): a seqlock-consistent copy of
  // mapping bytes [offset, offset + length) of a host pool slot into dst. Returns the
  // generation the copy is consistent with (a bigint).
  Napi::Value SeqCopyRangeJs(const Napi::CallbackInfo& info) {
    Bytes seg = SegmentArg(info, 0);
    uint64_t offset = U64Arg(info, 1);
    uint64_t length = U64Arg(info, 2);
    Bytes dst = U8Arg(info, 3);
    uint32_t attempts = info.Length() > 4 && info[4].IsNumber() ? info[4].As<Napi::Number>().Uint32Value() : 0;
    uint64_t gen = 0;
    Status s = SeqCopyRange(seg.data, seg.size, offset, length, dst.data, dst.size, attempts, &gen);
    if (!s.ok()) Throw(info.Env(), s);
    return Napi::BigInt::New(info.Env(), gen);
  }

  // copyBatch(op, ranges, count, stride, locals, remotes, spans, segments, segmentFlags, grants,
  //           grantInfo, tokens, deadlineMs, maxAttempts, generations): one stream batch of host
  //           copies in one call.
  //   op            0 read (segment -> local), 1 write (local -> segment)
  //   ranges        Float64Array, `stride` numbers per range (core's RANGE_STRIDE), the first
  //                 seven in core's RangeField order: request, local, localOffset, remote,
  //                 remoteOffset, length, remoteRange
  //   count         ranges in the batch (ranges.length >= stride * count)
  //   locals        Uint8Array[]: the local buffers, by RangeField.Local
  //   remotes       Float64Array, 3 numbers per remote (RangeField.Remote): grant index, first
  //                 span, span count (a whole registration has one span, a range grant one per
  //                 granted range; RangeField.RemoteRange picks one)
  //   spans         Float64Array, 3 numbers per span: segment index, base (offset of the granted
  //                 bytes in the segment mapping), limit (bytes granted)
  //   segments      ArrayBuffer[]: data segment mappings (shmOpen)
  //   segmentFlags  Uint8Array, one per segment: bit 0 = seqlocked pool slot
  //   grants        ArrayBuffer[]: grant segment or grant table mappings
  //   grantInfo     Float64Array, 2 numbers per grant: record (byte offset of a range-grant
  //                 record in a grant table; 0: a grant segment), generation (of the record)
  //   tokens        Uint8Array of 16 per grant
  //   deadlineMs    Date.now() milliseconds bounding waits and retries (0: none)
  //   maxAttempts   retries of one slot's ranges that overlapped a write (0: default)
  //   generations   BigUint64Array, one per segment: the generation each seqlocked segment was
  //                 copied at (0 for others)
  //   threads       optional, threads that copy (default 1: this thread only). A group of at
  //                 least 1 MiB (a slot's ranges, or the ranges of other segments) is cut by
  //                 bytes into pieces (>= 256 KiB, at most 64) that this thread and up to
  //                 `threads - 1` threads of a persistent pool claim one at a time; every piece
  //                 has ended before the batch leaves its grants.
  // Nothing from JS is trusted: every table entry and range (and the span it uses) is validated
  // against the real buffer and mapping lengths before any grant is entered or any byte moves.
  // Throws an error with `code` (TW_INVALID_INPUT, TW_REMOTE_REJECTED with `remoteCode`,
  // TW_TIMED_OUT) and, where it is about one, `range`, `grant` or `segment` (indices).
  Napi::Value CopyBatchJs(const Napi::CallbackInfo& info) {
    const bool write = OpArg(info, "copyBatch");
    Napi::Float64Array ranges = TypedArg(info, "copyBatch", 1, napi_float64_array, "Float64Array").As<Napi::Float64Array>();
    const CallArgs call = ParseCall(info, "copyBatch", {2, 3, 12, 13, 15});
    std::unique_ptr<BatchPlan> plan = ParsePlan(info, "copyBatch", write, {4, 5, 6, 7, 8, 9, 10, 11, 14});
    RunPlan(info.Env(), *plan, ranges, call, "copyBatch");
    return info.Env().Undefined();
  }

  // Positions of the table arguments in a call (copyBatch and planBatch put them elsewhere).
  struct TableArgs {
    size_t locals, remotes, spans, segments, flags, grants, grant_info, tokens, generations;
  };
  // Positions of the per-call arguments, and what they say once checked.
  struct CallPositions {
    size_t count, stride, deadline, attempts, threads;
  };
  struct CallArgs {
    size_t count;
    size_t stride;
    double deadline;
    double attempts;
    uint32_t threads;
  };

  static Napi::TypedArray TypedArg(const Napi::CallbackInfo& info, const char* fn, size_t i, napi_typedarray_type type, const char* what) {
    if (info.Length() <= i || !info[i].IsTypedArray() || info[i].As<Napi::TypedArray>().TypedArrayType() != type) {
      ThrowInvalid(info.Env(), std::string(fn) + ": argument " + std::to_string(i) + " must be a " + what);
    }
    return info[i].As<Napi::TypedArray>();
  }

  static Napi::Array ArrayArg(const Napi::CallbackInfo& info, const char* fn, size_t i, const char* what) {
    if (info.Length() <= i || !info[i].IsArray()) ThrowInvalid(info.Env(), std::string(fn) + ": argument " + std::to_string(i) + " must be an array of " + what);
    return info[i].As<Napi::Array>();
  }

  static double NumberArg(const Napi::CallbackInfo& info, const char* fn, size_t i, const char* what) {
    if (info.Length() <= i || !info[i].IsNumber()) ThrowInvalid(info.Env(), std::string(fn) + ": " + what + " must be a number");
    return info[i].As<Napi::Number>().DoubleValue();
  }

  // Argument 0: 0 (read) or 1 (write); true for a write.
  static bool OpArg(const Napi::CallbackInfo& info, const char* fn) {
    double op = NumberArg(info, fn, 0, "op");
    if (op != 0 && op != 1) ThrowInvalid(info.Env(), std::string(fn) + ": op must be 0 (read) or 1 (write)");
    return op == 1;
  }

  static CallArgs ParseCall(const Napi::CallbackInfo& info, const char* fn, const CallPositions& at) {
    Napi::Env env = info.Env();
    double count_d = NumberArg(info, fn, at.count, "count");
    if (!(count_d >= 0) || count_d > 0xffffffffu || count_d != static_cast<double>(static_cast<size_t>(count_d))) {
      ThrowInvalid(env, std::string(fn) + ": count must be a non-negative integer below 2^32");
    }
    double stride_d = NumberArg(info, fn, at.stride, "stride");
    if (!(stride_d >= static_cast<double>(kBatchFields)) || stride_d > 64 || stride_d != static_cast<double>(static_cast<size_t>(stride_d))) {
      ThrowInvalid(env, std::string(fn) + ": stride must be an integer from " + std::to_string(kBatchFields) + " to 64");
    }
    double deadline = NumberArg(info, fn, at.deadline, "deadlineMs");
    double attempts = NumberArg(info, fn, at.attempts, "maxAttempts");
    // Optional: threads that copy (1 = this thread only; large groups split by bytes).
    double threads_d = info.Length() > at.threads && !info[at.threads].IsUndefined() ? NumberArg(info, fn, at.threads, "threads") : 1;
    if (!(threads_d >= 1) || threads_d > CopyPool::kMaxThreads + 1 || threads_d != static_cast<double>(static_cast<uint32_t>(threads_d))) {
      ThrowInvalid(env, std::string(fn) + ": threads must be an integer from 1 to " + std::to_string(CopyPool::kMaxThreads + 1));
    }
    return CallArgs{static_cast<size_t>(count_d), static_cast<size_t>(stride_d), deadline, attempts, static_cast<uint32_t>(threads_d)};
  }

  // The tables of a call (positions `at`), checked for shape: the numbers copied out of their
  // typed arrays (so a buffer shared with another thread cannot change them after the check),
  // the buffers and mappings referenced. First every element read (an element read may run a
  // getter, which could detach or replace a buffer); pointers and lengths are read only when
  // the plan runs (RunPlan), with no JS running any more.
  static std::unique_ptr<BatchPlan> ParsePlan(const Napi::CallbackInfo& info, const char* fn, bool write, const TableArgs& at) {
    Napi::Env env = info.Env();
    const std::string name(fn);
    Napi::Array locals_js = ArrayArg(info, fn, at.locals, "Uint8Array");
    Napi::Float64Array remotes_js = TypedArg(info, fn, at.remotes, napi_float64_array, "Float64Array").As<Napi::Float64Array>();
    Napi::Float64Array spans_js = TypedArg(info, fn, at.spans, napi_float64_array, "Float64Array").As<Napi::Float64Array>();
    Napi::Array segments_js = ArrayArg(info, fn, at.segments, "ArrayBuffer");
    Napi::Uint8Array flags_js = TypedArg(info, fn, at.flags, napi_uint8_array, "Uint8Array").As<Napi::Uint8Array>();
    Napi::Array grants_js = ArrayArg(info, fn, at.grants, "ArrayBuffer");
    Napi::Float64Array ginfo_js = TypedArg(info, fn, at.grant_info, napi_float64_array, "Float64Array").As<Napi::Float64Array>();
    Napi::Uint8Array tokens_js = TypedArg(info, fn, at.tokens, napi_uint8_array, "Uint8Array").As<Napi::Uint8Array>();
    Napi::TypedArray gens_js = TypedArg(info, fn, at.generations, napi_biguint64_array, "BigUint64Array");
    auto plan = std::make_unique<BatchPlan>();
    plan->write = write;
    std::vector<Napi::Value> local_vals(locals_js.Length()), segment_vals(segments_js.Length()), grant_vals(grants_js.Length());
    for (uint32_t i = 0; i < local_vals.size(); i++) local_vals[i] = locals_js.Get(i);
    for (uint32_t i = 0; i < segment_vals.size(); i++) segment_vals[i] = segments_js.Get(i);
    for (uint32_t i = 0; i < grant_vals.size(); i++) grant_vals[i] = grants_js.Get(i);
    for (size_t i = 0; i < local_vals.size(); i++) {
      Napi::Value v = local_vals[i];
      if (!v.IsTypedArray() || v.As<Napi::TypedArray>().TypedArrayType() != napi_uint8_array) {
        ThrowInvalid(env, name + ": locals[" + std::to_string(i) + "] must be a Uint8Array");
      }
      plan->locals.push_back(Napi::Persistent(v.As<Napi::Object>()));
    }
    if (flags_js.ElementLength() != segment_vals.size()) ThrowInvalid(env, name + ": one segment flag per segment");
    if (gens_js.ElementLength() < segment_vals.size()) ThrowInvalid(env, name + ": generations must hold one value per segment");
    for (size_t i = 0; i < segment_vals.size(); i++) {
      if (!segment_vals[i].IsArrayBuffer()) ThrowInvalid(env, name + ": segments[" + std::to_string(i) + "] must be an ArrayBuffer");
      uint8_t flags = flags_js.Data()[i];
      if (flags > 1) ThrowInvalid(env, name + ": segment flags must be 0 or 1");
      plan->segments.push_back(Napi::Persistent(segment_vals[i].As<Napi::Object>()));
      plan->seqlocked.push_back(flags == 1);
    }
    auto safe = [](double d) { return d >= 0 && d <= 9007199254740991.0 && d == static_cast<double>(static_cast<uint64_t>(d)); };
    if (tokens_js.ByteLength() != grant_vals.size() * kTokenBytes) ThrowInvalid(env, name + ": tokens must hold 16 bytes per grant");
    if (ginfo_js.ElementLength() != grant_vals.size() * 2) ThrowInvalid(env, name + ": grantInfo must hold 2 numbers per grant");
    plan->tokens.assign(tokens_js.Data(), tokens_js.Data() + tokens_js.ByteLength());
    const double* gi = ginfo_js.Data();
    for (size_t i = 0; i < grant_vals.size(); i++) {
      if (!grant_vals[i].IsArrayBuffer()) ThrowInvalid(env, name + ": grants[" + std::to_string(i) + "] must be an ArrayBuffer");
      double record = BatchLoadOnce(gi + 2 * i), generation = BatchLoadOnce(gi + 2 * i + 1);
      if (!safe(record) || !safe(generation)) ThrowInvalid(env, name + ": grantInfo of grant " + std::to_string(i) + " is not a non-negative safe integer");
      plan->grants.push_back(Napi::Persistent(grant_vals[i].As<Napi::Object>()));
      plan->grant_info.push_back({static_cast<uint64_t>(record), static_cast<uint64_t>(generation)});
    }
    const size_t nrem_values = remotes_js.ElementLength();
    if (nrem_values % 3 != 0) ThrowInvalid(env, name + ": remotes must hold 3 numbers per remote");
    const double* rv = remotes_js.Data();
    for (size_t r = 0; r < nrem_values / 3; r++) {
      double grant = BatchLoadOnce(rv + 3 * r), first = BatchLoadOnce(rv + 3 * r + 1), n = BatchLoadOnce(rv + 3 * r + 2);
      for (double x : {grant, first, n}) {
        if (!safe(x)) ThrowInvalid(env, name + ": remote " + std::to_string(r) + " has a value that is not a non-negative safe integer");
      }
      if (grant > 0xffffffffu) ThrowInvalid(env, name + ": remote " + std::to_string(r) + " names a grant that is not in the batch");
      plan->remotes.push_back(BatchRemote{static_cast<uint32_t>(grant), static_cast<uint64_t>(first), static_cast<uint64_t>(n)});
    }
    if (spans_js.ElementLength() % kSpanFields != 0) ThrowInvalid(env, name + ": spans must hold 3 numbers per span");
    const double* sd = spans_js.Data();
    plan->spans.reserve(spans_js.ElementLength());
    for (size_t i = 0; i < spans_js.ElementLength(); i++) plan->spans.push_back(BatchLoadOnce(sd + i));
    plan->generations = Napi::Persistent(gens_js.As<Napi::Object>());
    return plan;
  }

  // A plan run over `ranges` on this thread (PreparePlan, then RunBatch).
  void RunPlan(Napi::Env env, BatchPlan& plan, const Napi::Float64Array& ranges, const CallArgs& call, const char* fn) {
    uint64_t* gens = PreparePlan(env, plan, ranges, call, fn, scratch_);
    BatchFailure f;
    if (!RunBatch(scratch_.in, &scratch_.order, gens, &f)) ThrowBatch(env, f);
  }

  // A plan made ready to run over `ranges`, into `st`: every buffer's pointer and length read
  // now (no JS runs from here on; a buffer detached since it was planned reads as 0 bytes),
  // the tables checked, then the ranges decoded, checked and merged. Returns the plan's
  // generations array (one value per segment, checked). Throws what the batch would.
  uint64_t* PreparePlan(Napi::Env env, BatchPlan& plan, const Napi::Float64Array& ranges, const CallArgs& call, const char* fn, RunState& st) {
    BatchInput& in = st.in;
    in = BatchInput{};
    in.write = plan.write;
    in.deadline_ms = std::isfinite(call.deadline) && call.deadline > 0 ? call.deadline : 0;
    in.max_attempts = call.attempts >= 1 && call.attempts <= 1e9 ? static_cast<uint32_t>(call.attempts) : kDefaultBatchAttempts;
    in.threads = call.threads;
    if (in.threads > 1) {
      if (!copy_pool_) copy_pool_ = std::make_unique<CopyPool>();
      in.pool = copy_pool_.get();
    }
    st.locals.resize(plan.locals.size());
    for (size_t i = 0; i < plan.locals.size(); i++) {
      Napi::Uint8Array u8 = plan.locals[i].Value().As<Napi::Uint8Array>();
      st.locals[i] = BatchLocal{u8.Data(), u8.ByteLength()};
    }
    st.segments.resize(plan.segments.size());
    for (size_t i = 0; i < plan.segments.size(); i++) {
      Napi::ArrayBuffer ab = plan.segments[i].Value().As<Napi::ArrayBuffer>();
      st.segments[i] = BatchSegment{static_cast<uint8_t*>(ab.Data()), ab.ByteLength(), plan.seqlocked[i]};
    }
    st.grants.resize(plan.grants.size());
    for (size_t i = 0; i < plan.grants.size(); i++) {
      Napi::ArrayBuffer ab = plan.grants[i].Value().As<Napi::ArrayBuffer>();
      st.grants[i] = BatchGrant{static_cast<uint8_t*>(ab.Data()), ab.ByteLength(), plan.tokens.data() + i * kTokenBytes, plan.grant_info[i].record, plan.grant_info[i].generation};
    }
    in.spans = plan.spans.data();
    in.n_spans = plan.spans.size() / kSpanFields;
    in.locals = st.locals.data();
    in.n_locals = st.locals.size();
    in.remotes = plan.remotes.data();
    in.n_remotes = plan.remotes.size();
    in.segments = st.segments.data();
    in.n_segments = st.segments.size();
    in.grants = st.grants.data();
    in.n_grants = st.grants.size();
    Napi::TypedArray gens_js = plan.generations.Value().As<Napi::TypedArray>();
    if (gens_js.ElementLength() < st.segments.size()) ThrowInvalid(env, std::string(fn) + ": generations must hold one value per segment");
    // BigUint64Array: 8-byte elements, 8-byte aligned by construction.
    uint64_t* gens = reinterpret_cast<uint64_t*>(static_cast<uint8_t*>(gens_js.ArrayBuffer().Data()) + gens_js.ByteOffset());
    DecodeRanges(env, st, ranges, call.count, call.stride, fn);
    return gens;
  }

  // The tables of `st.in` checked, then the ranges decoded, checked and merged into
  // `st.ranges` (for PreparePlan). Lengths of `ranges` are read only here, after every
  // element read of the caller (an element read may run a getter).
  void DecodeRanges(Napi::Env env, RunState& st, const Napi::Float64Array& ranges, size_t count, size_t stride, const char* fn) {
    BatchInput& in = st.in;
    BatchFailure f;
    if (!CheckBatchTables(in, &f)) ThrowBatch(env, f);
    if (count > ranges.ElementLength() / stride) ThrowInvalid(env, std::string(fn) + ": ranges holds fewer than stride * count numbers");
    st.ranges.resize(count);
    const double* rd = ranges.Data();
    // Every range is decoded and checked on its own (its granted range, the mapping and the
    // local buffer); a range that continues the previous one in both memories (same local,
    // same segment, adjacent bytes on both sides: the granted blocks of a range grant laid
    // out back to back) is then copied as part of it, one memcpy instead of one per block.
    // The merged copy moves exactly the bytes of the checked ranges, nothing else.
    size_t merged = 0;
    for (size_t i = 0; i < count; i++) {
      BatchRange& r = st.ranges[merged];
      if (!DecodeBatchRange(rd, stride, i, in, &r, &f)) ThrowBatch(env, f);
      if (merged > 0) {
        BatchRange& prev = st.ranges[merged - 1];
        if (prev.local == r.local && prev.segment == r.segment && prev.local_offset + prev.length == r.local_offset &&
            prev.remote_at + prev.length == r.remote_at) {
          prev.length += r.length;
          continue;
        }
      }
      merged++;
    }
    in.ranges = st.ranges.data();
    in.count = merged;
  }

  // planBatch(op, locals, remotes, spans, segments, segmentFlags, grants, grantInfo, tokens,
  //           generations): the tables of copyBatch kept natively for batches that reuse them
  //           (the transport's plan per batch and per local and remote), parsed and checked as
  //           copyBatch parses them (ParsePlan). Returns an opaque plan for copyPlanned.
  Napi::Value PlanBatchJs(const Napi::CallbackInfo& info) {
    const bool write = OpArg(info, "planBatch");
    std::unique_ptr<BatchPlan> plan = ParsePlan(info, "planBatch", write, {1, 2, 3, 4, 5, 6, 7, 8, 9});
    Napi::External<BatchPlan> ext = Napi::External<BatchPlan>::New(info.Env(), plan.release(), [](Napi::Env, BatchPlan* p) { delete p; });
    ext.TypeTag(&kBatchPlanTag);
    return ext;
  }

  // copyPlanned(plan, ranges, count, stride, deadlineMs, maxAttempts, threads): copyBatch
  // over a plan of planBatch (RunPlan, as copyBatch runs its own tables).
  Napi::Value CopyPlannedJs(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    if (info.Length() < 1 || !info[0].IsExternal() || !info[0].As<Napi::External<BatchPlan>>().CheckTypeTag(&kBatchPlanTag)) {
      ThrowInvalid(env, "copyPlanned: argument 0 must be a plan of planBatch");
    }
    BatchPlan& plan = *info[0].As<Napi::External<BatchPlan>>().Data();
    Napi::Float64Array ranges = TypedArg(info, "copyPlanned", 1, napi_float64_array, "Float64Array").As<Napi::Float64Array>();
    RunPlan(env, plan, ranges, ParseCall(info, "copyPlanned", {2, 3, 4, 5, 6}), "copyPlanned");
    return env.Undefined();
  }

  // copyPlannedAsync(plan, ranges, count, stride, deadlineMs, maxAttempts, threads, generations, control?):
  //           copyPlanned with the copy off the JavaScript thread. Everything copyPlanned checks
  //           is checked here, before this returns (a bad range or table throws, nothing is
  //           queued); the bytes then move on a thread of libuv's pool (RunBatch: grants entered
  //           and left, seqlock checks, the deadline, as copyPlanned). Returns a promise that
  //           settles on this thread when the copy has ended: undefined, or the error copyPlanned
  //           would have thrown. `generations` (BigUint64Array, one value per segment of the
  //           plan) receives the generation each seqlocked segment was copied at, before the
  //           promise settles (the plan's own array is left alone: posts of one plan may overlap).
  //           The pool of copy threads serves one copy at a time: a copy that finds it busy
  //           copies on its own thread. `control` (optional Int32Array, element 0 at 0) stops
  //           the copy: the thread that starts it swaps 0 (queued) for 1 (copying) and does
  //           nothing if it finds 2 (cancelled); the caller stores 2 to cancel, and a copy
  //           already running stops at its next range, piece, 4 MiB step or seqlock wait; the
  //           promise then rejects with TW_ABORTED once nothing touches the memory any more.
  //           A copy whose deadline passed while it waited for a thread fails with TW_TIMED_OUT
  //           before any byte moves.
  Napi::Value CopyPlannedAsyncJs(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    if (info.Length() < 1 || !info[0].IsExternal() || !info[0].As<Napi::External<BatchPlan>>().CheckTypeTag(&kBatchPlanTag)) {
      ThrowInvalid(env, "copyPlannedAsync: argument 0 must be a plan of planBatch");
    }
    BatchPlan& plan = *info[0].As<Napi::External<BatchPlan>>().Data();
    Napi::Float64Array ranges = TypedArg(info, "copyPlannedAsync", 1, napi_float64_array, "Float64Array").As<Napi::Float64Array>();
    const CallArgs call = ParseCall(info, "copyPlannedAsync", {2, 3, 4, 5, 6});
    Napi::TypedArray out = TypedArg(info, "copyPlannedAsync", 7, napi_biguint64_array, "BigUint64Array");
    if (out.ElementLength() < plan.segments.size()) ThrowInvalid(env, "copyPlannedAsync: generations must hold one value per segment");
    Napi::Int32Array control;
    if (info.Length() > 8 && !info[8].IsUndefined()) {
      control = TypedArg(info, "copyPlannedAsync", 8, napi_int32_array, "Int32Array").As<Napi::Int32Array>();
      if (control.ElementLength() < 1 || control.Data() == nullptr) ThrowInvalid(env, "copyPlannedAsync: control must hold one value");
      if (__atomic_load_n(control.Data(), __ATOMIC_SEQ_CST) != kCopyQueued) ThrowInvalid(env, "copyPlannedAsync: control must start at 0 (queued)");
    }
    std::unique_ptr<CopyWorker> w(new CopyWorker(env, info[0].As<Napi::Object>(), &plan, out));
    PreparePlan(env, plan, ranges, call, "copyPlannedAsync", w->state());
    if (!control.IsEmpty()) w->SetControl(control);
    w->gens().assign(plan.segments.size(), 0);
    Napi::Promise p = w->Promise();
    w.release()->Queue();
    return p;
  }

  [[noreturn]] static void ThrowBatch(Napi::Env env, const BatchFailure& f) { throw BatchError(env, f); }

  Napi::Value SetStateJs(const Napi::CallbackInfo& info) {
    Bytes seg = SegmentArg(info, 0);
    Status s = SetState(seg.data, seg.size, static_cast<uint32_t>(I32Arg(info, 1)));
    if (!s.ok()) Throw(info.Env(), s);
    return info.Env().Undefined();
  }

  Napi::Value LoadStateJs(const Napi::CallbackInfo& info) {
    Bytes seg = SegmentArg(info, 0);
    return Napi::Number::New(info.Env(), LoadState(seg.data, seg.size));
  }

  Napi::Value ImporterAddJs(const Napi::CallbackInfo& info) {
    Bytes seg = SegmentArg(info, 0);
    bool live = false;
    Status s = ImporterAdd(seg.data, seg.size, &live);
    if (!s.ok()) Throw(info.Env(), s);
    return Napi::Boolean::New(info.Env(), live);
  }

  Napi::Value ImporterRemoveJs(const Napi::CallbackInfo& info) {
    Bytes seg = SegmentArg(info, 0);
    uint32_t remaining = 0;
    Status s = ImporterRemove(seg.data, seg.size, &remaining);
    if (!s.ok()) Throw(info.Env(), s);
    return Napi::Number::New(info.Env(), remaining);
  }

  Napi::Value ImportersJs(const Napi::CallbackInfo& info) {
    Bytes seg = SegmentArg(info, 0);
    return Napi::Number::New(info.Env(), LoadImporters(seg.data, seg.size));
  }

  Napi::Value GrantEnterJs(const Napi::CallbackInfo& info) {
    Bytes seg = SegmentArg(info, 0);
    Bytes token = U8Arg(info, 1);
    return Napi::Number::New(info.Env(), GrantEnter(seg.data, seg.size, token.data, token.size));
  }

  Napi::Value GrantLeaveJs(const Napi::CallbackInfo& info) {
    Bytes seg = SegmentArg(info, 0);
    GrantLeave(seg.data, seg.size);
    return info.Env().Undefined();
  }

  Napi::Value GrantActiveJs(const Napi::CallbackInfo& info) {
    Bytes seg = SegmentArg(info, 0);
    return Napi::Number::New(info.Env(), GrantActive(seg.data, seg.size));
  }

  Napi::Value GrantRevokeJs(const Napi::CallbackInfo& info) {
    Bytes seg = SegmentArg(info, 0);
    Status s = GrantRevoke(seg.data, seg.size);
    if (!s.ok()) Throw(info.Env(), s);
    return info.Env().Undefined();
  }

  // ---- range-grant records (offset: the record's byte offset in the grant table mapping) ----

  Napi::Value RecordEnterJs(const Napi::CallbackInfo& info) {
    Bytes seg = SegmentArg(info, 0);
    uint64_t offset = U64Arg(info, 1);
    uint64_t generation = U64Arg(info, 2);
    Bytes token = U8Arg(info, 3);
    return Napi::Number::New(info.Env(), RecordEnter(seg.data, seg.size, offset, generation, token.data, token.size));
  }

  Napi::Value RecordLeaveJs(const Napi::CallbackInfo& info) {
    Bytes seg = SegmentArg(info, 0);
    RecordLeave(seg.data, seg.size, U64Arg(info, 1));
    return info.Env().Undefined();
  }

  Napi::Value RecordActiveJs(const Napi::CallbackInfo& info) {
    Bytes seg = SegmentArg(info, 0);
    return Napi::Number::New(info.Env(), RecordActive(seg.data, seg.size, U64Arg(info, 1)));
  }

  Napi::Value RecordPublishJs(const Napi::CallbackInfo& info) {
    Bytes seg = SegmentArg(info, 0);
    Status s = RecordPublish(seg.data, seg.size, U64Arg(info, 1), U64Arg(info, 2));
    if (!s.ok()) Throw(info.Env(), s);
    return info.Env().Undefined();
  }

  Napi::Value RecordRevokeJs(const Napi::CallbackInfo& info) {
    Bytes seg = SegmentArg(info, 0);
    uint32_t active = 0;
    Status s = RecordRevoke(seg.data, seg.size, U64Arg(info, 1), U64Arg(info, 2), &active);
    if (!s.ok()) Throw(info.Env(), s);
    return Napi::Number::New(info.Env(), active);
  }

  Napi::Value RecordFreeJs(const Napi::CallbackInfo& info) {
    Bytes seg = SegmentArg(info, 0);
    Status s = RecordFree(seg.data, seg.size, U64Arg(info, 1));
    if (!s.ok()) Throw(info.Env(), s);
    return info.Env().Undefined();
  }

  // writeRangeTable(table, arenaOffset, ranges, count, regs): check a grant's ranges and write
  // its range table in the table's arena (WriteRangeTable). `ranges` is a Float64Array of 3
  // numbers per range (registration index, offset, length), `regs` one of 3 per registration
  // (directory index, base in its segment mapping, byte length). Returns the sum of the
  // lengths, or -(k + 1) for the first bad range k; throws TW_INVALID_INPUT when the arguments
  // or the table do not fit.
  Napi::Value WriteRangeTableJs(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    Bytes seg = SegmentArg(info, 0);
    uint64_t arena_offset = U64Arg(info, 1);
    auto f64 = [&](size_t i) -> Napi::Float64Array {
      if (info.Length() <= i || !info[i].IsTypedArray() || info[i].As<Napi::TypedArray>().TypedArrayType() != napi_float64_array) {
        ThrowInvalid(env, "writeRangeTable: argument " + std::to_string(i) + " must be a Float64Array");
      }
      return info[i].As<Napi::Float64Array>();
    };
    Napi::Float64Array ranges = f64(2);
    uint64_t count = U64Arg(info, 3);
    Napi::Float64Array regs = f64(4);
    if (count > ranges.ElementLength() / 3) ThrowInvalid(env, "writeRangeTable: ranges hold fewer than count ranges");
    if (regs.ElementLength() % 3 != 0) ThrowInvalid(env, "writeRangeTable: regs must hold 3 numbers per registration");
    const size_t nregs = regs.ElementLength() / 3;
    for (size_t j = 0; j < nregs; j++) {
      const double dir = regs[3 * j], b = regs[3 * j + 1], len = regs[3 * j + 2];
      if (!(dir >= 0 && dir < 4294967296.0 && dir == __builtin_floor(dir) && b >= 0 && b == __builtin_floor(b) && len >= 0 && len == __builtin_floor(len) && b + len < 9007199254740992.0)) {
        ThrowInvalid(env, "writeRangeTable: regs[" + std::to_string(j) + "] is not (directory index, base, length) of non-negative integers");
      }
    }
    double result = 0;
    Status s = WriteRangeTable(seg.data, seg.size, arena_offset, ranges.Data(), static_cast<size_t>(count), regs.Data(), nregs, &result);
    if (!s.ok()) Throw(env, s);
    return Napi::Number::New(env, result);
  }

  // ---- CUDA ----

  Napi::Value CudaProbe(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    cuda_->Probe();
    Napi::Object o = Napi::Object::New(env);
    o.Set("available", cuda_->available());
    o.Set("reason", cuda_->reason());
    o.Set("driverVersion", cuda_->driver_version());
    o.Set("deviceCount", cuda_->device_count());
    Napi::Array names = Napi::Array::New(env, cuda_->device_count());
    for (int i = 0; i < cuda_->device_count(); i++) names.Set(static_cast<uint32_t>(i), cuda_->DeviceName(i));
    o.Set("devices", names);
    return o;
  }

  int DeviceArg(const Napi::CallbackInfo& info, size_t i) {
    int32_t d = I32Arg(info, i);
    if (d < 0) ThrowInvalid(info.Env(), "device must be >= 0");
    cuda_->Probe();
    if (!cuda_->available()) Throw(info.Env(), Status::Fail(kBackendUnavailable, cuda_->reason()));
    return d;
  }

  Napi::Value Queue(CudaWorker* w) {
    Napi::Promise p = w->Promise();
    w->Queue();
    return p;
  }

  Napi::Value CudaAlloc(const Napi::CallbackInfo& info) {
    int device = DeviceArg(info, 0);
    uint64_t bytes = U64Arg(info, 1);
    if (bytes == 0 || bytes > kMaxSegmentBytes) ThrowInvalid(info.Env(), "allocation size is out of range");
    auto drv = cuda_;
    auto ptr = std::make_shared<CUdeviceptr>(0);
    return Queue(new CudaWorker(
        info.Env(), [drv, device, bytes, ptr] { return drv->Alloc(device, static_cast<size_t>(bytes), ptr.get()); },
        [ptr](Napi::Env env) -> Napi::Value { return Napi::BigInt::New(env, static_cast<uint64_t>(*ptr)); }));
  }

  Napi::Value CudaExport(const Napi::CallbackInfo& info) {
    int device = DeviceArg(info, 0);
    CUdeviceptr p = U64Arg(info, 1);
    auto drv = cuda_;
    struct Out {
      CUipcMemHandle handle;
      CUdeviceptr base = 0;
      size_t size = 0;
    };
    auto out = std::make_shared<Out>();
    return Queue(new CudaWorker(
        info.Env(), [drv, device, p, out] { return drv->Export(device, p, &out->handle, &out->base, &out->size); },
        [out, p](Napi::Env env) -> Napi::Value {
          Napi::Object o = Napi::Object::New(env);
          o.Set("handle", Napi::Buffer<uint8_t>::Copy(env, reinterpret_cast<const uint8_t*>(out->handle.reserved), 64));
          o.Set("base", Napi::BigInt::New(env, static_cast<uint64_t>(out->base)));
          o.Set("offset", Napi::Number::New(env, static_cast<double>(p - out->base)));
          o.Set("allocSize", Napi::Number::New(env, static_cast<double>(out->size)));
          return o;
        }));
  }

  Napi::Value CudaFree(const Napi::CallbackInfo& info) {
    int device = DeviceArg(info, 0);
    CUdeviceptr p = U64Arg(info, 1);
    auto drv = cuda_;
    return Queue(new CudaWorker(info.Env(), [drv, device, p] { return drv->Free(device, p); }, nullptr));
  }

  Napi::Value CudaImport(const Napi::CallbackInfo& info) {
    int device = DeviceArg(info, 0);
    Bytes h = U8Arg(info, 1);
    if (h.size != kIpcHandleBytes) ThrowInvalid(info.Env(), "an IPC handle is 64 bytes");
    CUipcMemHandle handle;
    std::memcpy(handle.reserved, h.data, kIpcHandleBytes);
    auto drv = cuda_;
    auto ptr = std::make_shared<CUdeviceptr>(0);
    return Queue(new CudaWorker(
        info.Env(), [drv, device, handle, ptr] { return drv->Import(device, handle, ptr.get()); },
        [ptr](Napi::Env env) -> Napi::Value { return Napi::BigInt::New(env, static_cast<uint64_t>(*ptr)); }));
  }

  Napi::Value CudaCloseImport(const Napi::CallbackInfo& info) {
    int device = DeviceArg(info, 0);
    CUdeviceptr p = U64Arg(info, 1);
    auto drv = cuda_;
    return Queue(new CudaWorker(info.Env(), [drv, device, p] { return drv->CloseImport(device, p); }, nullptr));
  }

  // cudaCopy(op, device, dst, src, length): op 'h2d' (dst bigint, src Uint8Array),
  // 'd2h' (dst Uint8Array, src bigint), 'd2d' (both bigint). Host buffers stay referenced
  // until the copy has completed on the stream.
  Napi::Value CudaCopy(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    std::string op = StrArg(info, 0);
    int device = DeviceArg(info, 1);
    uint64_t n = U64Arg(info, 4);
    auto drv = cuda_;
    CudaWorker* w = nullptr;
    if (op == "h2d") {
      CUdeviceptr dst = U64Arg(info, 2);
      Bytes src = U8Arg(info, 3);
      if (n > src.size) ThrowInvalid(env, "copy length exceeds the source buffer");
      const void* sp = src.data;
      w = new CudaWorker(env, [drv, device, dst, sp, n] { return drv->CopyHtoD(device, dst, sp, static_cast<size_t>(n)); }, nullptr);
      w->Keep(info[3]);
    } else if (op == "d2h") {
      Bytes dst = U8Arg(info, 2);
      CUdeviceptr src = U64Arg(info, 3);
      if (n > dst.size) ThrowInvalid(env, "copy length exceeds the destination buffer");
      void* dp = dst.data;
      w = new CudaWorker(env, [drv, device, dp, src, n] { return drv->CopyDtoH(device, dp, src, static_cast<size_t>(n)); }, nullptr);
      w->Keep(info[2]);
    } else if (op == "d2d") {
      CUdeviceptr dst = U64Arg(info, 2);
      CUdeviceptr src = U64Arg(info, 3);
      w = new CudaWorker(env, [drv, device, dst, src, n] { return drv->CopyDtoD(device, dst, src, static_cast<size_t>(n)); }, nullptr);
    } else {
      ThrowInvalid(env, "copy op must be h2d, d2h or d2d");
    }
    return Queue(w);
  }

  // cudaCopyRanges(device, table, count): `count` device-to-device copies, table a Float64Array
  // of (dst address, src address, length) triples, issued in order on the device's stream with
  // one sync at the end. Every number must be a whole number in [0, 2^53) and every length
  // positive, checked before anything is issued; the table is copied, so the caller may reuse it.
  Napi::Value CudaCopyRanges(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    int device = DeviceArg(info, 0);
    if (info.Length() < 3 || !info[1].IsTypedArray() || info[1].As<Napi::TypedArray>().TypedArrayType() != napi_float64_array) {
      ThrowInvalid(env, "table must be a Float64Array");
    }
    Napi::Float64Array table = info[1].As<Napi::Float64Array>();
    uint64_t count = U64Arg(info, 2);
    if (count == 0 || count > table.ElementLength() / 3) ThrowInvalid(env, "count must be between 1 and the table's triples");
    const double* t = table.Data();
    auto triples = std::make_shared<std::vector<uint64_t>>(static_cast<size_t>(count) * 3);
    constexpr double kMax = 9007199254740992.0;  // 2^53
    for (size_t i = 0; i < triples->size(); i++) {
      double v = t[i];
      if (!(v >= 0 && v < kMax) || v != static_cast<double>(static_cast<uint64_t>(v))) {
        ThrowInvalid(env, "range " + std::to_string(i / 3) + ": not a whole number in [0, 2^53)");
      }
      if (i % 3 == 2 && v == 0) ThrowInvalid(env, "range " + std::to_string(i / 3) + ": empty");
      (*triples)[i] = static_cast<uint64_t>(v);
    }
    auto drv = cuda_;
    return Queue(new CudaWorker(env, [drv, device, triples] { return drv->CopyDtoDRanges(device, *triples); }, nullptr));
  }

  Napi::Value CudaHostRegister(const Napi::CallbackInfo& info) {
    Bytes b = U8Arg(info, 0);
    cuda_->Probe();
    if (!cuda_->available()) Throw(info.Env(), Status::Fail(kBackendUnavailable, cuda_->reason()));
    auto drv = cuda_;
    void* p = b.data;
    size_t n = b.size;
    CudaWorker* w = new CudaWorker(info.Env(), [drv, p, n] { return drv->HostRegister(p, n); }, nullptr);
    w->Keep(info[0]);
    return Queue(w);
  }

  Napi::Value CudaHostUnregister(const Napi::CallbackInfo& info) {
    Bytes b = U8Arg(info, 0);
    cuda_->Probe();
    if (!cuda_->available()) Throw(info.Env(), Status::Fail(kBackendUnavailable, cuda_->reason()));
    auto drv = cuda_;
    void* p = b.data;
    CudaWorker* w = new CudaWorker(info.Env(), [drv, p] { return drv->HostUnregister(p); }, nullptr);
    w->Keep(info[0]);
    return Queue(w);
  }

  std::shared_ptr<CudaDriver> cuda_;
  // Segments this environment created and has not unlinked: name -> its memfd descriptor.
  std::map<std::string, int> created_;
  // Scratch of the copies run on this thread, kept between calls so a batch allocates nothing
  // once warm (a copy off this thread has its own).
  RunState scratch_;
  // Copy threads for copyBatch's `threads` (started on first use, joined on teardown).
  std::unique_ptr<CopyPool> copy_pool_;
};

}  // namespace
}  // namespace tw

using TensorwireCudaIpcAddon = tw::Addon;
NODE_API_ADDON(TensorwireCudaIpcAddon)
