#include "cuda.h"

#include <dlfcn.h>

#include <cstring>

namespace tw {

CudaDriver::CudaDriver() = default;

CudaDriver::~CudaDriver() {
  // Streams and primary contexts are released only when the driver was usable. The library
  // itself stays loaded (dlclose of libcuda at teardown is known to crash some drivers).
  if (!available_) return;
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [device, stream] : streams_) {
    auto ctx = contexts_.find(device);
    if (ctx != contexts_.end() && cuCtxSetCurrent_ != nullptr) cuCtxSetCurrent_(ctx->second);
    if (cuStreamDestroy_ != nullptr) cuStreamDestroy_(stream);
  }
  streams_.clear();
  for (auto& [device, ctx] : contexts_) {
    (void)ctx;
    if (cuDevicePrimaryCtxRelease_ != nullptr) cuDevicePrimaryCtxRelease_(device);
  }
  contexts_.clear();
}

void* CudaDriver::Sym(const char* const* names, std::string* missing) {
  for (const char* const* n = names; *n != nullptr; n++) {
    void* p = dlsym(lib_, *n);
    if (p != nullptr) return p;
  }
  if (missing->empty()) *missing = names[0];
  return nullptr;
}

template <typename F>
static void Bind(F*& slot, void* p) {
  slot = reinterpret_cast<F*>(p);
}

void CudaDriver::Probe() {
  std::call_once(probe_once_, [this] {
    dlerror();
    lib_ = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib_ == nullptr) {
      const char* e = dlerror();
      reason_ = std::string("CUDA driver not found: dlopen(libcuda.so.1) failed: ") + (e != nullptr ? e : "unknown error");
      return;
    }
    std::string missing;
#define TW_SYM(field, ...)                                   \
  do {                                                       \
    static const char* const names[] = {__VA_ARGS__, nullptr}; \
    Bind(field, Sym(names, &missing));                       \
  } while (0)
    TW_SYM(cuInit_, "cuInit");
    TW_SYM(cuDriverGetVersion_, "cuDriverGetVersion");
    TW_SYM(cuDeviceGetCount_, "cuDeviceGetCount");
    TW_SYM(cuDeviceGet_, "cuDeviceGet");
    TW_SYM(cuDeviceGetName_, "cuDeviceGetName");
    TW_SYM(cuDevicePrimaryCtxRetain_, "cuDevicePrimaryCtxRetain");
    TW_SYM(cuDevicePrimaryCtxRelease_, "cuDevicePrimaryCtxRelease_v2", "cuDevicePrimaryCtxRelease");
    TW_SYM(cuCtxSetCurrent_, "cuCtxSetCurrent");
    TW_SYM(cuMemAlloc_, "cuMemAlloc_v2");
    TW_SYM(cuMemFree_, "cuMemFree_v2");
    TW_SYM(cuMemGetAddressRange_, "cuMemGetAddressRange_v2");
    TW_SYM(cuIpcGetMemHandle_, "cuIpcGetMemHandle");
    TW_SYM(cuIpcOpenMemHandle_, "cuIpcOpenMemHandle_v2", "cuIpcOpenMemHandle");
    TW_SYM(cuIpcCloseMemHandle_, "cuIpcCloseMemHandle");
    TW_SYM(cuStreamCreate_, "cuStreamCreate");
    TW_SYM(cuStreamSynchronize_, "cuStreamSynchronize");
    TW_SYM(cuStreamDestroy_, "cuStreamDestroy_v2", "cuStreamDestroy");
    TW_SYM(cuMemcpyHtoDAsync_, "cuMemcpyHtoDAsync_v2");
    TW_SYM(cuMemcpyDtoHAsync_, "cuMemcpyDtoHAsync_v2");
    TW_SYM(cuMemcpyDtoDAsync_, "cuMemcpyDtoDAsync_v2");
    TW_SYM(cuMemHostRegister_, "cuMemHostRegister_v2", "cuMemHostRegister");
    TW_SYM(cuMemHostUnregister_, "cuMemHostUnregister");
    TW_SYM(cuGetErrorString_, "cuGetErrorString");
    TW_SYM(cuGetErrorName_, "cuGetErrorName");
#undef TW_SYM
    if (!missing.empty()) {
      reason_ = "CUDA driver libcuda.so.1 lacks the entry point " + missing + " (driver too old?)";
      return;
    }
    CUresult r = cuInit_(0);
    if (r != CUDA_SUCCESS) {
      reason_ = "CUDA driver present but cuInit failed: " + Check(r, "cuInit").message;
      return;
    }
    cuDriverGetVersion_(&driver_version_);
    int count = 0;
    r = cuDeviceGetCount_(&count);
    if (r != CUDA_SUCCESS) {
      reason_ = "CUDA driver present but cuDeviceGetCount failed: " + Check(r, "cuDeviceGetCount").message;
      return;
    }
    if (count <= 0) {
      reason_ = "CUDA driver present (version " + std::to_string(driver_version_) + ") but cuDeviceGetCount reports no devices";
      return;
    }
    device_count_ = count;
    available_ = true;
    reason_ = "";
  });
}

CudaStatus CudaDriver::Check(CUresult r, const char* call) {
  CudaStatus s;
  s.result = r;
  s.call = call;
  if (r == CUDA_SUCCESS) return s;
  const char* name = nullptr;
  const char* text = nullptr;
  if (cuGetErrorName_ == nullptr || cuGetErrorName_(r, &name) != CUDA_SUCCESS) name = nullptr;
  if (cuGetErrorString_ == nullptr || cuGetErrorString_(r, &text) != CUDA_SUCCESS) text = nullptr;
  s.message = std::string(call) + " returned " + std::to_string(r) + (name != nullptr ? std::string(" ") + name : "") +
              (text != nullptr ? std::string(": ") + text : "");
  return s;
}

std::string CudaDriver::DeviceName(int device) {
  if (!available_ || device < 0 || device >= device_count_) return "";
  CUdevice dev = 0;
  if (cuDeviceGet_(&dev, device) != CUDA_SUCCESS) return "";
  char name[256] = {0};
  if (cuDeviceGetName_(name, sizeof(name) - 1, dev) != CUDA_SUCCESS) return "";
  return name;
}

CudaStatus CudaDriver::MakeCurrent(int device, CUstream* stream) {
  if (!available_) {
    CudaStatus s;
    s.result = CUDA_ERROR_NO_DEVICE;
    s.call = "probe";
    s.message = reason_;
    return s;
  }
  if (device < 0 || device >= device_count_) {
    CudaStatus s;
    s.result = CUDA_ERROR_INVALID_DEVICE;
    s.call = "device";
    s.message = "cuda:" + std::to_string(device) + " does not exist (" + std::to_string(device_count_) + " devices)";
    return s;
  }
  CUcontext ctx = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = contexts_.find(device);
    if (it == contexts_.end()) {
      CUdevice dev = 0;
      CudaStatus s = Check(cuDeviceGet_(&dev, device), "cuDeviceGet");
      if (!s.ok()) return s;
      s = Check(cuDevicePrimaryCtxRetain_(&ctx, dev), "cuDevicePrimaryCtxRetain");
      if (!s.ok()) return s;
      contexts_[device] = ctx;
    } else {
      ctx = it->second;
    }
  }
  CudaStatus s = Check(cuCtxSetCurrent_(ctx), "cuCtxSetCurrent");
  if (!s.ok() || stream == nullptr) return s;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = streams_.find(device);
  if (it == streams_.end()) {
    CUstream st = nullptr;
    s = Check(cuStreamCreate_(&st, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
    if (!s.ok()) return s;
    streams_[device] = st;
    *stream = st;
  } else {
    *stream = it->second;
  }
  return s;
}

CudaStatus CudaDriver::Alloc(int device, size_t bytes, CUdeviceptr* out) {
  CudaStatus s = MakeCurrent(device, nullptr);
  if (!s.ok()) return s;
  return Check(cuMemAlloc_(out, bytes), "cuMemAlloc");
}

CudaStatus CudaDriver::Free(int device, CUdeviceptr ptr) {
  CudaStatus s = MakeCurrent(device, nullptr);
  if (!s.ok()) return s;
  return Check(cuMemFree_(ptr), "cuMemFree");
}

CudaStatus CudaDriver::Export(int device, CUdeviceptr ptr, CUipcMemHandle* handle, CUdeviceptr* base, size_t* alloc_size) {
  CudaStatus s = MakeCurrent(device, nullptr);
  if (!s.ok()) return s;
  s = Check(cuMemGetAddressRange_(base, alloc_size, ptr), "cuMemGetAddressRange");
  if (!s.ok()) return s;
  // The handle names the whole allocation; the importer adds (ptr - base).
  return Check(cuIpcGetMemHandle_(handle, *base), "cuIpcGetMemHandle");
}

CudaStatus CudaDriver::Import(int device, const CUipcMemHandle& handle, CUdeviceptr* out) {
  CudaStatus s = MakeCurrent(device, nullptr);
  if (!s.ok()) return s;
  return Check(cuIpcOpenMemHandle_(out, handle, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS), "cuIpcOpenMemHandle");
}

CudaStatus CudaDriver::CloseImport(int device, CUdeviceptr ptr) {
  CudaStatus s = MakeCurrent(device, nullptr);
  if (!s.ok()) return s;
  return Check(cuIpcCloseMemHandle_(ptr), "cuIpcCloseMemHandle");
}

// One copy on the device's stream, then wait for it: the caller's memory is free to reuse
// only after the copy is done. Reports the copy's error first, else the sync's.
template <typename Issue>
CudaStatus CudaDriver::CopyOnStream(int device, const char* what, Issue issue) {
  CUstream st = nullptr;
  CudaStatus s = MakeCurrent(device, &st);
  if (!s.ok()) return s;
  s = Check(issue(st), what);
  CudaStatus sync = Check(cuStreamSynchronize_(st), "cuStreamSynchronize");
  return s.ok() ? sync : s;
}

CudaStatus CudaDriver::CopyHtoD(int device, CUdeviceptr dst, const void* src, size_t n) {
  return CopyOnStream(device, "cuMemcpyHtoDAsync", [&](CUstream st) { return cuMemcpyHtoDAsync_(dst, src, n, st); });
}

CudaStatus CudaDriver::CopyDtoH(int device, void* dst, CUdeviceptr src, size_t n) {
  return CopyOnStream(device, "cuMemcpyDtoHAsync", [&](CUstream st) { return cuMemcpyDtoHAsync_(dst, src, n, st); });
}

CudaStatus CudaDriver::CopyDtoD(int device, CUdeviceptr dst, CUdeviceptr src, size_t n) {
  return CopyOnStream(device, "cuMemcpyDtoDAsync", [&](CUstream st) { return cuMemcpyDtoDAsync_(dst, src, n, st); });
}

CudaStatus CudaDriver::CopyDtoDRanges(int device, const std::vector<uint64_t>& t) {
  return CopyOnStream(device, "cuMemcpyDtoDAsync", [&](CUstream st) {
    for (size_t i = 0; i + 2 < t.size(); i += 3) {
      CUresult r = cuMemcpyDtoDAsync_(static_cast<CUdeviceptr>(t[i]), static_cast<CUdeviceptr>(t[i + 1]), static_cast<size_t>(t[i + 2]), st);
      if (r != CUDA_SUCCESS) return r;
    }
    return CUDA_SUCCESS;
  });
}

CudaStatus CudaDriver::HostRegister(void* p, size_t n) {
  CudaStatus s = MakeCurrent(0, nullptr);
  if (!s.ok()) return s;
  return Check(cuMemHostRegister_(p, n, CU_MEMHOSTREGISTER_PORTABLE), "cuMemHostRegister");
}

CudaStatus CudaDriver::HostUnregister(void* p) {
  CudaStatus s = MakeCurrent(0, nullptr);
  if (!s.ok()) return s;
  return Check(cuMemHostUnregister_(p), "cuMemHostUnregister");
}

}  // namespace tw
