/* What every .cu file of the CUDA back end shares: the checker macros (a failing CUDA, cuBLAS or
 * NCCL call ends the job through error.h's error_at with the call, the library's message, file
 * and line), the back end's stream and handles, and launch geometry. C++ only; C sees gpu.h. */
#ifndef FMATTN_GPU_CHECK_H
#define FMATTN_GPU_CHECK_H

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include <climits>
#include <cstddef>

extern "C" [[noreturn]] void error_at(const char *file, const char *func, int line, const char *fmt,
                                      ...);

/* A device fault (an illegal address, a trap, ...) is sticky and surfaces at whichever call comes
 * next, far from its kernel: the message then says how to find the kernel (gpu.debug). */
extern "C" const char *gpu_fault_hint(cudaError_t e);

#define CUDA_CHECK(call)                                                                       \
  do {                                                                                         \
    cudaError_t e_ = (call);                                                                   \
    if (e_ != cudaSuccess)                                                                     \
      error_at(__FILE__, __func__, __LINE__, "%s failed: %s%s", #call, cudaGetErrorString(e_), \
               gpu_fault_hint(e_));                                                            \
  } while (0)

#define CUBLAS_CHECK(call)                                                                       \
  do {                                                                                           \
    cublasStatus_t s_ = (call);                                                                  \
    if (s_ != CUBLAS_STATUS_SUCCESS)                                                             \
      error_at(__FILE__, __func__, __LINE__, "%s failed: %s", #call, cublasGetStatusString(s_)); \
  } while (0)

#define NCCL_CHECK(call)                                                                          \
  do {                                                                                            \
    ncclResult_t r_ = (call);                                                                     \
    if (r_ != ncclSuccess)                                                                        \
      error_at(__FILE__, __func__, __LINE__, "%s failed: %s (%s)", #call, ncclGetErrorString(r_), \
               ncclGetLastError(nullptr));                                                        \
  } while (0)

/* After each launch, once, naming the kernel: LAUNCH_CHECK(kernel_name). The launch's own error
 * (bad geometry, too much shared memory) ends the job naming the kernel; the launch is counted
 * (backend.h struct device_counts). In debug mode (deck key gpu.debug) it also waits for the
 * kernel, so that a fault in it is reported with its name rather than at a later call. */
extern "C" void gpu_launch_check(const char *kernel, const char *file, const char *func, int line);
#define LAUNCH_CHECK(...) gpu_launch_check(#__VA_ARGS__, __FILE__, __func__, __LINE__)

/* Device time of an operator, for the host timer `timer` (timer.h's TIMER_P2P, TIMER_P2M, …): a
 * pair of events around the work a scope queues (gpu_op_time), added to the timer when the stream
 * is next waited for (gpu_sync, gpu_download), so that the operators' columns of bench are
 * device time on the GPU as they are thread time on the CPU. */
extern "C" int gpu_op_begin(int timer);
extern "C" void gpu_op_end(int span);
struct gpu_op_time {
  int span;
  explicit gpu_op_time(int timer) : span(gpu_op_begin(timer)) {}
  ~gpu_op_time() { gpu_op_end(span); }
  gpu_op_time(const gpu_op_time &) = delete;
  gpu_op_time &operator=(const gpu_op_time &) = delete;
};

/* The back end's stream and cuBLAS handle (backend.cu); all its work is queued on the stream. */
cudaStream_t gpu_stream(void);
cublasHandle_t gpu_cublas(void);

/* Every wait of the host for the stream (gpu_sync, gpu_download, ...): the stream's status, as
 * cudaStreamSynchronize returns it. While NCCL operations are in flight it polls instead, as a
 * watchdog (comm.cu): an operation running longer than gpu.nccl_timeout seconds once started, or
 * an error NCCL reports asynchronously, aborts the communicators and ends the job with one
 * message; a hung peer never hangs this rank. */
cudaError_t gpu_stream_wait(void);
constexpr double kDefaultNcclTimeout = 45.0;
void gpu_set_nccl_timeout(double seconds); /* 0: no watchdog */

/* Launch geometry: blocks of `threads` covering n items (n > 0: an empty grid is an error on a
 * GPU, so launchers return before launching nothing). */
static inline unsigned gpu_blocks(size_t n, unsigned threads) {
  return (unsigned)((n + threads - 1) / threads);
}

/* A size handed to cuBLAS or a launch as an int, refused with a message when it does not fit. */
static inline int gpu_int(long long v, const char *what);
/* The grid of a kernel that loops over rows × elements in 32-bit indices: rows along y, elements
 * along x, both grid-stride; about 1024 blocks in all (at least one per row, up to 65535 rows). */
static inline dim3 gpu_grid2(long rows, long elements, unsigned threads) {
  const unsigned gy = (unsigned)gpu_int(rows < 65535 ? rows : 65535, "rows");
  size_t gx = gpu_blocks((size_t)gpu_int(elements, "elements per row"), threads);
  const size_t cap = (1024 + gy - 1) / gy;
  return dim3((unsigned)(gx < cap ? gx : cap), gy);
}

static inline int gpu_int(long long v, const char *what) {
  if (v < 0 || v > INT_MAX)
    error_at(__FILE__, __func__, __LINE__,
             "%s = %lld does not fit in 32 bits (cuBLAS's int, the kernels' indices)", what, v);
  return (int)v;
}

#endif
