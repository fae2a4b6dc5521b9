// The CUDA runtime API of the emulation: devices (CUDAEMU_DEVICES of them, H100-like, each
// process using the one cudaSetDevice chose), device and pinned memory, copies and memsets as
// stream work, error strings. Arguments are checked as CUDA checks them, and failures return
// CUDA's codes (with a "cudaemu:" line saying why); nothing here runs kernels.
#include <unistd.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "core.h"
#include "scheduler.h"

namespace cudaemu {
namespace {

int device = 0;

// Every entry point begins here: the fault handler in place, the device count known.
cudaError_t start() {
  install_fault_handler();  // again at every call: see install_fault_handler
  if (config().devices == 0) return cudaErrorNoDevice;
  return sticky_error();  // a kernel faulted: the context is lost
}

#define START()                     \
  do {                              \
    const cudaError_t s_ = start(); \
    if (s_ != cudaSuccess) {        \
      set_last_error(s_);           \
      return s_;                    \
    }                               \
  } while (0)

bool host_side(const void *p) {
  const ptr_kind k = classify(p);
  return k == ptr_kind::host || k == ptr_kind::pinned;
}

// The direction of a copy, checked against where the pointers point (UVA, as CUDA does).
cudaError_t check_copy(void *dst, const void *src, size_t n, cudaMemcpyKind *kind, const char *fn) {
  if (*kind == cudaMemcpyDefault)
    *kind = host_side(src) ? (host_side(dst) ? cudaMemcpyHostToHost : cudaMemcpyHostToDevice)
                           : (host_side(dst) ? cudaMemcpyDeviceToHost : cudaMemcpyDeviceToDevice);
  if (*kind < 0 || *kind > cudaMemcpyDefault)
    return fail(cudaErrorInvalidMemcpyDirection, "%s: kind %d is no cudaMemcpyKind", fn,
                (int)*kind);
  const bool dst_dev = *kind == cudaMemcpyHostToDevice || *kind == cudaMemcpyDeviceToDevice;
  const bool src_dev = *kind == cudaMemcpyDeviceToHost || *kind == cudaMemcpyDeviceToDevice;
  if (!dst || !src) return fail(cudaErrorInvalidValue, "%s: a null pointer", fn);
  if (dst_dev ? !device_range(dst, n, false) : !host_side(dst))
    return fail(cudaErrorInvalidValue, "%s: the %zu-byte destination is not %s memory: %s", fn, n,
                dst_dev ? "device" : "host", describe_address(dst).c_str());
  if (src_dev ? !device_range(src, n, false) : !host_side(src))
    return fail(cudaErrorInvalidValue, "%s: the %zu-byte source is not %s memory: %s", fn, n,
                src_dev ? "device" : "host", describe_address(src).c_str());
  return cudaSuccess;
}

}  // namespace

int current_device() { return device; }

const char *host_name() {
  static char name[256] = "";
  if (!name[0]) gethostname(name, sizeof name - 1);
  return name;
}

}  // namespace cudaemu

using namespace cudaemu;

extern "C" {

cudaError_t cudaGetDeviceCount(int *count) {
  if (!count) return fail(cudaErrorInvalidValue, "cudaGetDeviceCount: null count");
  *count = 0;
  START();
  *count = config().devices;
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int d) {
  START();
  if (d < 0 || d >= config().devices)
    return fail(cudaErrorInvalidDevice, "cudaSetDevice(%d): there are %d emulated devices", d,
                config().devices);
  device = d;
  return cudaSuccess;
}

cudaError_t cudaGetDevice(int *d) {
  START();
  if (!d) return fail(cudaErrorInvalidValue, "cudaGetDevice: null pointer");
  *d = device;
  return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp *p, int d) {
  START();
  if (!p) return fail(cudaErrorInvalidValue, "cudaGetDeviceProperties: null pointer");
  if (d < 0 || d >= config().devices)
    return fail(cudaErrorInvalidDevice, "cudaGetDeviceProperties(%d): no such device", d);
  std::memset(p, 0, sizeof *p);
  snprintf(p->name, sizeof p->name, "cudaemu H100 (emulated on the CPU, %s order)", order_name());
  p->totalGlobalMem = config().capacity;
  p->sharedMemPerBlock = kDefaultSmemMax;
  p->sharedMemPerBlockOptin = kOptinSmemMax;
  p->sharedMemPerMultiprocessor = 228 << 10;
  p->regsPerBlock = 65536;
  p->warpSize = 32;
  p->maxThreadsPerBlock = 1024;
  p->maxThreadsDim[0] = 1024, p->maxThreadsDim[1] = 1024, p->maxThreadsDim[2] = 64;
  p->maxGridSize[0] = 2147483647, p->maxGridSize[1] = 65535, p->maxGridSize[2] = 65535;
  p->maxThreadsPerMultiProcessor = 2048;
  p->multiProcessorCount = 132;
  p->major = 9;
  p->minor = 0;
  p->l2CacheSize = 50 << 20;
  p->totalConstMem = 64 << 10;
  p->unifiedAddressing = 1;
  p->concurrentKernels = 1;
  p->pciBusID = d;
  return cudaSuccess;
}

cudaError_t cudaDeviceReset(void) {
  START();
  drain_all();
  return cudaSuccess;
}

cudaError_t cudaMalloc(void **p, size_t size) {
  START();
  if (!p) return fail(cudaErrorInvalidValue, "cudaMalloc: null devPtr");
  *p = nullptr;
  if (size == 0) return cudaSuccess;
  *p = device_alloc(size);
  if (!*p)
    return fail(cudaErrorMemoryAllocation,
                "cudaMalloc(%zu): out of emulated device memory (%zu of %zu bytes in use; "
                "CUDAEMU_MEMORY_GB or _MB)",
                size, bytes_in_use(), config().capacity);
  trace("cudaMalloc(%zu) = %p", size, *p);
  return cudaSuccess;
}

cudaError_t cudaFree(void *p) {
  START();
  if (!p) return cudaSuccess;
  drain_all();  // cudaFree waits for the device, as on the GPU
  return device_free(p);
}

cudaError_t cudaMallocHost(void **p, size_t size) {
  START();
  if (!p) return fail(cudaErrorInvalidValue, "cudaMallocHost: null ptr");
  *p = pinned_alloc(size);
  return *p ? cudaSuccess : fail(cudaErrorMemoryAllocation, "cudaMallocHost(%zu) failed", size);
}

cudaError_t cudaHostAlloc(void **p, size_t size, unsigned int flags) {
  if (flags & ~15u) return fail(cudaErrorInvalidValue, "cudaHostAlloc: unknown flags 0x%x", flags);
  return cudaMallocHost(p, size);
}

cudaError_t cudaFreeHost(void *p) {
  START();
  if (!p) return cudaSuccess;
  drain_all();
  return pinned_free(p);
}

cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total) {
  START();
  if (!free_bytes || !total) return fail(cudaErrorInvalidValue, "cudaMemGetInfo: null pointer");
  *total = config().capacity;
  *free_bytes = config().capacity - bytes_in_use();
  return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t n, cudaMemcpyKind kind,
                            cudaStream_t stream) {
  START();
  if (!valid_stream(stream))
    return fail(cudaErrorInvalidResourceHandle, "cudaMemcpyAsync: no such stream %p",
                (void *)stream);
  if (n == 0) return cudaSuccess;
  if (cudaError_t e = check_copy(dst, src, n, &kind, "cudaMemcpyAsync")) return e;
  const bool pinned_rule = config().pinned_all;
  if (kind == cudaMemcpyHostToDevice && !pinned_rule && !is_pinned(src, n)) {
    // pageable source: CUDA stages it before returning, so the caller may reuse it at once
    auto staged = std::make_shared<std::vector<char>>((const char *)src, (const char *)src + n);
    submit(stream, "cudaMemcpyAsync (host to device)",
           [dst, staged, n] { std::memcpy(dst, staged->data(), n); });
    return cudaSuccess;
  }
  submit(stream, "cudaMemcpyAsync", [dst, src, n] { std::memcpy(dst, src, n); });
  // pageable destination: CUDA returns only once the copy is done
  if (kind == cudaMemcpyDeviceToHost && !pinned_rule && !is_pinned(dst, n)) drain_stream(stream);
  return cudaSuccess;
}

cudaError_t cudaMemcpy(void *dst, const void *src, size_t n, cudaMemcpyKind kind) {
  START();
  if (n == 0) return cudaSuccess;
  if (cudaError_t e = check_copy(dst, src, n, &kind, "cudaMemcpy")) return e;
  // on the legacy default stream, and the host waits for it (not for non-blocking streams)
  submit(nullptr, "cudaMemcpy", [dst, src, n] { std::memcpy(dst, src, n); });
  drain_stream(nullptr);
  return sticky_error();
}

cudaError_t cudaMemsetAsync(void *p, int value, size_t n, cudaStream_t stream) {
  START();
  if (!valid_stream(stream))
    return fail(cudaErrorInvalidResourceHandle, "cudaMemsetAsync: no such stream %p",
                (void *)stream);
  if (n == 0) return cudaSuccess;
  if (!device_range(p, n, false))
    return fail(cudaErrorInvalidValue, "cudaMemsetAsync(%p, %d, %zu): not device memory: %s", p,
                value, n, describe_address(p).c_str());
  submit(stream, "cudaMemsetAsync", [p, value, n] { std::memset(p, value, n); });
  return cudaSuccess;
}

cudaError_t cudaMemset(void *p, int value, size_t n) { return cudaMemsetAsync(p, value, n, 0); }

cudaError_t cudaFuncSetAttribute(const void *func, cudaFuncAttribute attr, int value) {
  START();
  if (!func) return fail(cudaErrorInvalidDeviceFunction, "cudaFuncSetAttribute: null function");
  if (attr == cudaFuncAttributePreferredSharedMemoryCarveout)
    return value >= -1 && value <= 100
               ? cudaSuccess
               : fail(cudaErrorInvalidValue, "cudaFuncSetAttribute: carveout %d", value);
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize)
    return fail(cudaErrorInvalidValue, "cudaFuncSetAttribute: attribute %d is not emulated",
                (int)attr);
  const size_t stat = known_static_smem(func);
  if (value < 0 || (size_t)value + stat > kOptinSmemMax)
    return fail(cudaErrorInvalidValue,
                "cudaFuncSetAttribute: %d bytes of dynamic shared memory (+ %zu static) exceed "
                "sm_90's %zu",
                value, stat, kOptinSmemMax);
  set_max_dynamic_smem(func, value);
  return cudaSuccess;
}

const char *cudaGetErrorName(cudaError_t e) {
  switch (e) {
#define NAME(x) \
  case x:       \
    return #x;
    NAME(cudaSuccess)
    NAME(cudaErrorInvalidValue)
    NAME(cudaErrorMemoryAllocation)
    NAME(cudaErrorInitializationError)
    NAME(cudaErrorInvalidConfiguration)
    NAME(cudaErrorInvalidDevicePointer)
    NAME(cudaErrorInvalidMemcpyDirection)
    NAME(cudaErrorInvalidDeviceFunction)
    NAME(cudaErrorNoDevice)
    NAME(cudaErrorInvalidDevice)
    NAME(cudaErrorInvalidResourceHandle)
    NAME(cudaErrorNotReady)
    NAME(cudaErrorIllegalAddress)
    NAME(cudaErrorLaunchOutOfResources)
    NAME(cudaErrorLaunchTimeout)
    NAME(cudaErrorAssert)
    NAME(cudaErrorHardwareStackError)
    NAME(cudaErrorIllegalInstruction)
    NAME(cudaErrorMisalignedAddress)
    NAME(cudaErrorInvalidPc)
    NAME(cudaErrorLaunchFailure)
    NAME(cudaErrorNotSupported)
    NAME(cudaErrorUnknown)
#undef NAME
  }
  return "cudaErrorUnknown";
}

const char *cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess:
      return "no error";
    case cudaErrorInvalidValue:
      return "invalid argument";
    case cudaErrorMemoryAllocation:
      return "out of memory";
    case cudaErrorInitializationError:
      return "initialization error";
    case cudaErrorInvalidConfiguration:
      return "invalid configuration argument";
    case cudaErrorInvalidDevicePointer:
      return "invalid device pointer";
    case cudaErrorInvalidMemcpyDirection:
      return "invalid copy direction for memcpy";
    case cudaErrorInvalidDeviceFunction:
      return "invalid device function";
    case cudaErrorNoDevice:
      return "no CUDA-capable device is detected";
    case cudaErrorInvalidDevice:
      return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle:
      return "invalid resource handle";
    case cudaErrorNotReady:
      return "device not ready";
    case cudaErrorIllegalAddress:
      return "an illegal memory access was encountered";
    case cudaErrorLaunchOutOfResources:
      return "too many resources requested for launch";
    case cudaErrorLaunchTimeout:
      return "the launch timed out and was terminated";
    case cudaErrorAssert:
      return "device-side assert triggered";
    case cudaErrorHardwareStackError:
      return "hardware stack error";
    case cudaErrorIllegalInstruction:
      return "an illegal instruction was encountered";
    case cudaErrorMisalignedAddress:
      return "misaligned address";
    case cudaErrorInvalidPc:
      return "invalid program counter";
    case cudaErrorLaunchFailure:
      return "unspecified launch failure";
    case cudaErrorNotSupported:
      return "operation not supported";
    default:
      return "unknown error";
  }
}

}  // extern "C"

// Not CUDA: what the emulation's own tests ask of it.
extern "C" size_t cudaemu_bytes_in_use(void) { return bytes_in_use(); }
extern "C" size_t cudaemu_bytes_peak(void) { return bytes_peak(); }

// ---- NVTX ranges (include/nvtx3/nvToolsExt.h)

namespace {
thread_local std::vector<std::string> nvtx_ranges;
}  // namespace

extern "C" int nvtxRangePushA(const char *message) {
  nvtx_ranges.emplace_back(message ? message : "");
  trace("nvtx range %s opened (depth %zu)", nvtx_ranges.back().c_str(), nvtx_ranges.size() - 1);
  return (int)nvtx_ranges.size() - 1;
}

extern "C" int nvtxRangePop(void) {
  if (nvtx_ranges.empty()) return -1;
  trace("nvtx range %s closed", nvtx_ranges.back().c_str());
  nvtx_ranges.pop_back();
  return (int)nvtx_ranges.size();
}
