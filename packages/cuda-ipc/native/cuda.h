// The CUDA driver API, opened with dlopen("libcuda.so.1") at run time. No CUDA headers
// are needed to build: the handful of types used are declared here with the driver's ABI.
#pragma once
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace tw {

using CUresult = int;
using CUdevice = int;
using CUcontext = struct CUctx_st*;
using CUstream = struct CUstream_st*;
using CUdeviceptr = unsigned long long;  // 64-bit builds only (CUdeviceptr_v2)
struct CUipcMemHandle {
  char reserved[64];
};
static_assert(sizeof(CUipcMemHandle) == 64, "CUipcMemHandle is 64 bytes");
static_assert(sizeof(CUdeviceptr) == 8, "CUdeviceptr is 64-bit");

constexpr CUresult CUDA_SUCCESS = 0;
constexpr CUresult CUDA_ERROR_INVALID_VALUE = 1;
constexpr CUresult CUDA_ERROR_OUT_OF_MEMORY = 2;
constexpr CUresult CUDA_ERROR_NO_DEVICE = 100;
constexpr CUresult CUDA_ERROR_INVALID_DEVICE = 101;
constexpr CUresult CUDA_ERROR_INVALID_HANDLE = 400;
constexpr unsigned CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 0x1;
constexpr unsigned CU_STREAM_NON_BLOCKING = 0x1;
constexpr unsigned CU_MEMHOSTREGISTER_PORTABLE = 0x1;

// Result of a driver call, with the driver's own name and text for it.
struct CudaStatus {
  CUresult result = CUDA_SUCCESS;
  std::string call;
  std::string message;
  bool ok() const { return result == CUDA_SUCCESS; }
};

class CudaDriver {
 public:
  CudaDriver();
  ~CudaDriver();
  CudaDriver(const CudaDriver&) = delete;
  CudaDriver& operator=(const CudaDriver&) = delete;

  // dlopen + dlsym + cuInit + cuDeviceGetCount, once. Thread-safe.
  void Probe();
  bool available() const { return available_; }
  const std::string& reason() const { return reason_; }
  int driver_version() const { return driver_version_; }
  int device_count() const { return device_count_; }
  std::string DeviceName(int device);

  // All of these may run on worker threads; each makes the device's primary context current.
  CudaStatus Alloc(int device, size_t bytes, CUdeviceptr* out);
  CudaStatus Free(int device, CUdeviceptr ptr);
  CudaStatus Export(int device, CUdeviceptr ptr, CUipcMemHandle* handle, CUdeviceptr* base, size_t* alloc_size);
  CudaStatus Import(int device, const CUipcMemHandle& handle, CUdeviceptr* out);
  CudaStatus CloseImport(int device, CUdeviceptr ptr);
  CudaStatus CopyHtoD(int device, CUdeviceptr dst, const void* src, size_t n);
  CudaStatus CopyDtoH(int device, void* dst, CUdeviceptr src, size_t n);
  CudaStatus CopyDtoD(int device, CUdeviceptr dst, CUdeviceptr src, size_t n);
  // Many device-to-device copies (dst, src, length triples) issued on the device's stream in
  // order, then one stream sync. Stops issuing at the first failed issue; reports it first.
  CudaStatus CopyDtoDRanges(int device, const std::vector<uint64_t>& triples);
  CudaStatus HostRegister(void* p, size_t n);
  CudaStatus HostUnregister(void* p);

 private:
  CudaStatus Check(CUresult r, const char* call);
  CudaStatus MakeCurrent(int device, CUstream* stream);
  template <typename Issue>
  CudaStatus CopyOnStream(int device, const char* what, Issue issue);
  void* Sym(const char* const* names, std::string* missing);

  std::once_flag probe_once_;
  void* lib_ = nullptr;
  bool available_ = false;
  std::string reason_ = "not probed";
  int driver_version_ = 0;
  int device_count_ = 0;

  std::mutex mu_;
  std::map<int, CUcontext> contexts_;
  std::map<int, CUstream> streams_;

  // Driver entry points.
  CUresult (*cuInit_)(unsigned) = nullptr;
  CUresult (*cuDriverGetVersion_)(int*) = nullptr;
  CUresult (*cuDeviceGetCount_)(int*) = nullptr;
  CUresult (*cuDeviceGet_)(CUdevice*, int) = nullptr;
  CUresult (*cuDeviceGetName_)(char*, int, CUdevice) = nullptr;
  CUresult (*cuDevicePrimaryCtxRetain_)(CUcontext*, CUdevice) = nullptr;
  CUresult (*cuDevicePrimaryCtxRelease_)(CUdevice) = nullptr;
  CUresult (*cuCtxSetCurrent_)(CUcontext) = nullptr;
  CUresult (*cuMemAlloc_)(CUdeviceptr*, size_t) = nullptr;
  CUresult (*cuMemFree_)(CUdeviceptr) = nullptr;
  CUresult (*cuMemGetAddressRange_)(CUdeviceptr*, size_t*, CUdeviceptr) = nullptr;
  CUresult (*cuIpcGetMemHandle_)(CUipcMemHandle*, CUdeviceptr) = nullptr;
  CUresult (*cuIpcOpenMemHandle_)(CUdeviceptr*, CUipcMemHandle, unsigned) = nullptr;
  CUresult (*cuIpcCloseMemHandle_)(CUdeviceptr) = nullptr;
  CUresult (*cuStreamCreate_)(CUstream*, unsigned) = nullptr;
  CUresult (*cuStreamSynchronize_)(CUstream) = nullptr;
  CUresult (*cuStreamDestroy_)(CUstream) = nullptr;
  CUresult (*cuMemcpyHtoDAsync_)(CUdeviceptr, const void*, size_t, CUstream) = nullptr;
  CUresult (*cuMemcpyDtoHAsync_)(void*, CUdeviceptr, size_t, CUstream) = nullptr;
  CUresult (*cuMemcpyDtoDAsync_)(CUdeviceptr, CUdeviceptr, size_t, CUstream) = nullptr;
  CUresult (*cuMemHostRegister_)(void*, size_t, unsigned) = nullptr;
  CUresult (*cuMemHostUnregister_)(void*) = nullptr;
  CUresult (*cuGetErrorString_)(CUresult, const char**) = nullptr;
  CUresult (*cuGetErrorName_)(CUresult, const char**) = nullptr;
};

}  // namespace tw
