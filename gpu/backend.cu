// The CUDA back end's device and table, the twin of src/model/backend.c: the device this rank uses
// (its local rank on the node, mod the devices it sees), the one stream and cuBLAS handle every
// operation is queued on, the precision of the products, and struct backend filled with the
// gpu_* operations; opening it registers the attention implementations that exist on the GPU.
#include <mpi.h>

#include <cstdio>

#include "check.h"
#include "gpu.h"
#include "model/backend.h"

// The attention implementations of gpu/ (attention_*.cu), registered when the back end opens.
extern "C" void gpu_attention_full_register(void);
extern "C" void gpu_attention_fma_register(void);

namespace {

int device = -1;
cudaStream_t stream = nullptr;
cublasHandle_t cublas = nullptr;
void *cublas_workspace = nullptr;  // from the pool, so the pool's peak holds it
// cuBLAS's workspace: 32 MiB, what NVIDIA's cuBLAS documentation recommends on Hopper
constexpr size_t kCublasWorkspaceBytes = size_t(32) << 20;
bool bf16 = false;
bool debug = false;  // gpu.debug
struct backend table;

void cuda_zero(void *p, size_t bytes) { gpu_memset0(p, bytes); }

void *cuda_alloc(enum mem_label label, size_t bytes) { return gpu_alloc_zero(label, bytes); }

void fill_table() {
  table.name = "cuda";
  table.device = DEVICE_GPU;
  table.host_visible = false;
  table.describe = gpu_describe;
  table.sync = gpu_sync;
  table.gemm_gflops = gpu_gemm_gflops;
  table.counts_reset = gpu_counts_reset;
  table.counts_read = gpu_counts_read;
  table.trim = gpu_release_cache;
  table.fill_normal = gpu_fill_normal;
  table.alloc = cuda_alloc;
  table.free = gpu_free;
  table.zero = cuda_zero;
  table.upload = gpu_upload;
  table.download = gpu_download;
  table.linear_forward = gpu_linear_forward;
  table.linear_backward = gpu_linear_backward;
  table.layernorm_forward = gpu_layernorm_forward;
  table.layernorm_backward = gpu_layernorm_backward;
  table.gelu_forward = gpu_gelu_forward;
  table.gelu_backward = gpu_gelu_backward;
  table.embedding_forward = gpu_embedding_forward;
  table.embedding_backward = gpu_embedding_backward;
  table.sinusoidal_forward = gpu_sinusoidal_forward;
  table.rope_forward = gpu_rope_forward;
  table.rope_backward = gpu_rope_backward;
  table.dropout_forward = gpu_dropout_forward;
  table.dropout_backward = gpu_dropout_backward;
  table.residual_dropout_forward = gpu_residual_dropout_forward;
  table.residual_dropout_backward = gpu_residual_dropout_backward;
  table.heads_split_forward = gpu_heads_split_forward;
  table.heads_split_backward = gpu_heads_split_backward;
  table.heads_merge_forward = gpu_heads_merge_forward;
  table.heads_merge_backward = gpu_heads_merge_backward;
  table.softmax_xent_forward_backward = gpu_softmax_xent_forward_backward;
  table.sum_squares = gpu_sum_squares;
  table.adamw = gpu_adamw;
}

}  // namespace

cudaStream_t gpu_stream(void) { return stream; }
cublasHandle_t gpu_cublas(void) { return cublas; }

extern "C" bool gpu_bf16(void) { return bf16; }
extern "C" void gpu_set_bf16(bool on) { bf16 = on; }
extern "C" bool gpu_debug(void) { return debug; }
extern "C" void gpu_set_debug(bool on) { debug = on; }

// The faults a kernel leaves behind as the context's sticky error: reported by whichever call
// comes next, not by the launch.
extern "C" const char *gpu_fault_hint(cudaError_t e) {
  switch (e) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorMisalignedAddress:
    case cudaErrorIllegalInstruction:
    case cudaErrorHardwareStackError:
    case cudaErrorInvalidPc:
    case cudaErrorAssert:
    case cudaErrorLaunchTimeout:
      return debug ? ""
                   : " (a kernel queued before this call faulted; gpu.debug = true waits after "
                     "every launch and names the kernel)";
    default:
      return "";
  }
}

extern "C" void gpu_launch_check(const char *kernel, const char *file, const char *func, int line) {
  gpu_count_launch();
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    error_at(file, func, line, "launch of kernel %s failed: %s", kernel, cudaGetErrorString(e));
  if (!debug) return;
  e = gpu_stream_wait();
  if (e != cudaSuccess)
    error_at(file, func, line,
             "kernel %s failed on the device: %s (gpu.debug: found by waiting "
             "after its launch)",
             kernel, cudaGetErrorString(e));
}

extern "C" int gpu_device_count(void) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // no driver, or no device: not an error here
    return 0;
  }
  return n;
}

extern "C" int gpu_open(int local_rank, bool use_bf16, char *err, size_t err_len) {
  if (device >= 0) return 0;
  const int n = gpu_device_count();
  if (n == 0) {
    snprintf(err, err_len,
             "no CUDA device is visible to this process (CUDA_VISIBLE_DEVICES, --gpus-per-task, "
             "the driver?)");
    return 1;
  }
  device = local_rank % n;
  bf16 = use_bf16;
  CUDA_CHECK(cudaSetDevice(device));
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  CUBLAS_CHECK(cublasCreate(&cublas));
  CUBLAS_CHECK(cublasSetStream(cublas, stream));
  // fp32 products stay fp32 (no TF32): the comparisons with the CPU depend on it
  CUBLAS_CHECK(cublasSetMathMode(cublas, CUBLAS_DEFAULT_MATH));
  // cuBLAS's workspace from the pool rather than its own allocation beside it (counted, and
  // there before the step's peak)
  cublas_workspace = gpu_alloc(MEM_WORKSPACE, kCublasWorkspaceBytes);
  CUBLAS_CHECK(cublasSetWorkspace(cublas, cublas_workspace, kCublasWorkspaceBytes));
  return 0;
}

extern "C" void gpu_close(void) {
  if (device < 0) return;
  if (cublas) cublasDestroy(cublas);
  gpu_free(cublas_workspace);
  cublas_workspace = nullptr;
  gpu_release_cache();
  if (stream) cudaStreamDestroy(stream);
  cublas = nullptr;
  stream = nullptr;
  device = -1;
}

extern "C" void gpu_describe(char *out, size_t len) {
  cudaDeviceProp p;
  CUDA_CHECK(cudaGetDeviceProperties(&p, device));
  snprintf(out, len, "device %d: %s, %.1f GiB, compute capability %d.%d, %s products", device,
           p.name, (double)p.totalGlobalMem / (1u << 30), p.major, p.minor, bf16 ? "bf16" : "fp32");
}

extern "C" const struct backend *gpu_backend_open(const struct gpu_options *o, char *err,
                                                  size_t err_len) {
  gpu_options defaults = {};  // fp32, no debug mode, the blocked exact kernels
  defaults.exact = GPU_EXACT_BLOCKED;
  defaults.outside_reserve = size_t(1) << 30;
  defaults.nccl_timeout = kDefaultNcclTimeout;
  if (!o) o = &defaults;
  static bool registered = false;  // the table and the attention, once per process
  if (device < 0) {
    int local = 0, on_node = 1;  // this rank's index among the ranks of its node, and how many
    MPI_Comm node;
    if (MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node) ==
        MPI_SUCCESS) {
      MPI_Comm_rank(node, &local);
      MPI_Comm_size(node, &on_node);
      MPI_Comm_free(&node);
    }
    // one rank per GPU: NCCL refuses two ranks of a communicator on one device, late and
    // obscurely ("invalid usage"); say it here, before any device work
    const int n = gpu_device_count();
    if (n > 0 && on_node > n) {
      snprintf(err, err_len,
               "%d ranks on this node share %d GPU%s: fmattn runs one rank per GPU (launch at most "
               "%d ranks per node, e.g. srun --ntasks-per-node=%d --gpus-per-task=1)",
               on_node, n, n == 1 ? "" : "s", n, n);
      return nullptr;
    }
    if (gpu_open(local, o->bf16, err, err_len)) return nullptr;
  }
  bf16 = o->bf16;  // a device opened earlier (gpu_open) takes this run's options
  debug = o->debug;
  gpu_set_exact_kernels(o->exact);
  gpu_set_exact_workspace(o->exact_workspace);
  gpu_fma_set_workspace(o->fma_workspace);
  gpu_pool_set_reserve(o->outside_reserve);
  gpu_pool_set_outside_probe(o->outside_probe_mib);
  gpu_set_nccl_timeout(o->nccl_timeout);
  if (!registered) {
    fill_table();
    gpu_attention_full_register();
    gpu_attention_fma_register();
    registered = true;
  }
  return &table;
}
