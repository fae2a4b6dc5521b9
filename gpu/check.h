/* Error checks for the CUDA back end: a failing CUDA, cuBLAS or NCCL call ends the job through
 * error.h's error_at with the call, the library's message, file and line. (error.h itself is C11;
 * its one function is declared here for C++.) */
#ifndef FMATTN_GPU_CHECK_H
#define FMATTN_GPU_CHECK_H

#include <cublas_v2.h>
#include <cuda_runtime.h>

extern "C" [[noreturn]] void error_at(const char *file, const char *func, int line, const char *fmt,
                                      ...);

#define CUDA_CHECK(call)                                                                      \
  do {                                                                                        \
    cudaError_t e_ = (call);                                                                  \
    if (e_ != cudaSuccess)                                                                    \
      error_at(__FILE__, __func__, __LINE__, "%s failed: %s", #call, cudaGetErrorString(e_)); \
  } while (0)

#define CUBLAS_CHECK(call)                                                                       \
  do {                                                                                           \
    cublasStatus_t s_ = (call);                                                                  \
    if (s_ != CUBLAS_STATUS_SUCCESS)                                                             \
      error_at(__FILE__, __func__, __LINE__, "%s failed: %s", #call, cublasGetStatusString(s_)); \
  } while (0)

/* The back end's stream and cuBLAS handle (runtime.cu). */
cudaStream_t gpu_stream(void);
cublasHandle_t gpu_cublas(void);

/* Launch geometry: blocks of `threads` covering n items. */
static inline unsigned gpu_blocks(size_t n, unsigned threads) {
  return (unsigned)((n + threads - 1) / threads);
}

#endif
