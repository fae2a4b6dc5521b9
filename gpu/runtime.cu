// Device selection, the stream and cuBLAS handle, and device memory for the CUDA back end.
#include <cstdio>

#include "check.h"
#include "gpu.h"

static int device_ = -1;
static cudaStream_t stream_ = nullptr;
static cublasHandle_t cublas_ = nullptr;

cudaStream_t gpu_stream(void) { return stream_; }
cublasHandle_t gpu_cublas(void) { return cublas_; }

extern "C" int gpu_device_count(void) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // no driver, or no device: not an error here
    return 0;
  }
  return n;
}

extern "C" int gpu_open(int local_rank, char *err, size_t err_len) {
  const int n = gpu_device_count();
  if (n == 0) {
    snprintf(err, err_len,
             "no CUDA device is visible to this process (CUDA_VISIBLE_DEVICES, "
             "--gpus-per-task, the driver?)");
    return 1;
  }
  device_ = local_rank % n;
  CUDA_CHECK(cudaSetDevice(device_));
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  CUBLAS_CHECK(cublasCreate(&cublas_));
  CUBLAS_CHECK(cublasSetStream(cublas_, stream_));
  // fp32 GEMMs stay fp32 (no TF32): the CPU comparison of the tests depends on it
  CUBLAS_CHECK(cublasSetMathMode(cublas_, CUBLAS_DEFAULT_MATH));
  return 0;
}

extern "C" void gpu_close(void) {
  if (cublas_) cublasDestroy(cublas_);
  if (stream_) cudaStreamDestroy(stream_);
  cublas_ = nullptr;
  stream_ = nullptr;
  device_ = -1;
}

extern "C" void gpu_describe(char *out, size_t len) {
  cudaDeviceProp p;
  CUDA_CHECK(cudaGetDeviceProperties(&p, device_));
  snprintf(out, len, "device %d: %s, %.1f GiB, compute capability %d.%d", device_, p.name,
           (double)p.totalGlobalMem / (1u << 30), p.major, p.minor);
}

extern "C" void *gpu_malloc(size_t bytes) {
  void *p = nullptr;
  CUDA_CHECK(cudaMalloc(&p, bytes ? bytes : 1));
  return p;
}

extern "C" void gpu_free(void *dev) {
  if (dev) CUDA_CHECK(cudaFree(dev));
}

extern "C" void gpu_upload(void *dev, const void *host, size_t bytes) {
  CUDA_CHECK(cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, stream_));
}

extern "C" void gpu_download(void *host, const void *dev, size_t bytes) {
  CUDA_CHECK(cudaMemcpyAsync(host, dev, bytes, cudaMemcpyDeviceToHost, stream_));
  CUDA_CHECK(cudaStreamSynchronize(stream_));
}

extern "C" void gpu_memset0(void *dev, size_t bytes) {
  CUDA_CHECK(cudaMemsetAsync(dev, 0, bytes, stream_));
}

extern "C" void gpu_sync(void) { CUDA_CHECK(cudaStreamSynchronize(stream_)); }
