/* The back ends (backend.h): the CPU table (layers.c, memory.c's arenas, optimizer.c's loops),
 * the choice of a table for parallel.device, and of the communicator's transport. This is the one
 * file that knows whether a GPU back end was built (FMATTN_GPU); nothing else in src/ asks. */
#include "model/backend.h"

#include <stdio.h>
#include <string.h>

#include "core/blascore.h"
#include "core/fault.h"
#include "core/threads.h"
#include "core/tilegemm.h"
#include "nn/adamw.h"

#ifdef FMATTN_GPU /* built --with-cuda, or --enable-cuda-emulation (FMATTN_GPU_EMULATED too) */
#include "../../gpu/gpu.h"
#endif

static void *cpu_alloc(enum mem_label label, size_t bytes) { return mem_alloc(label, bytes); }
static void cpu_sync(void) {}
/* Zeroing of the gradient buffers the attention accumulates into (3 N·C floats per layer): split
 * over the threads where it is large, as the passes around it are, not one thread's memset while
 * the others wait. */
#define CPU_ZERO_PIECE ((size_t)1 << 18)
static void cpu_zero(void *p, size_t bytes) {
  if (bytes < 4 * CPU_ZERO_PIECE) {
    memset(p, 0, bytes);
    return;
  }
  const long pieces = (long)((bytes + CPU_ZERO_PIECE - 1) / CPU_ZERO_PIECE);
#pragma omp parallel for schedule(static)
  for (long i = 0; i < pieces; i++) {
    const size_t at = (size_t)i * CPU_ZERO_PIECE;
    memset((char *)p + at, 0, bytes - at < CPU_ZERO_PIECE ? bytes - at : CPU_ZERO_PIECE);
  }
}
static void cpu_copy(void *dst, const void *src, size_t bytes) {
  if (dst != src) memcpy(dst, src, bytes);
}

static void cpu_describe(char *out, size_t len) {
  const char *from = blas_core_corrected_from();
  char cores[48] = ""; /* said where the threads share cores (threads.c warns) */
  if (threads_cores() < threads_count())
    snprintf(cores, sizeof cores, " on %d core(s)", threads_cores());
  snprintf(out, len, "CPU, %d thread(s) per rank%s, BLAS core %s%s%s%s, small products on %s",
           threads_count(), cores, threads_blas_core(), from ? " (corrected from " : "",
           from ? from : "", from ? ")" : "", tile_gemm_kernels());
}

static const struct backend cpu = {
    .name = "cpu",
    .device = DEVICE_CPU,
    .host_visible = true,
    .describe = cpu_describe,
    .sync = cpu_sync,
    .alloc = cpu_alloc,
    .free = mem_free,
    .zero = cpu_zero,
    .upload = cpu_copy,
    .download = cpu_copy,
    .linear_forward = linear_forward,
    .linear_backward = linear_backward,
    .layernorm_forward = layernorm_forward,
    .layernorm_backward = layernorm_backward,
    .gelu_forward = gelu_forward,
    .gelu_backward = gelu_backward,
    .embedding_forward = embedding_forward,
    .embedding_backward = embedding_backward,
    .sinusoidal_forward = sinusoidal_forward,
    .rope_forward = rope_forward,
    .rope_backward = rope_backward,
    .dropout_forward = dropout_forward,
    .dropout_backward = dropout_backward,
    .residual_dropout_forward = residual_dropout_forward,
    .residual_dropout_backward = residual_dropout_backward,
    .heads_split_forward = heads_split_forward,
    .heads_split_backward = heads_split_backward,
    .heads_merge_forward = heads_merge_forward,
    .heads_merge_backward = heads_merge_backward,
    .softmax_xent_forward_backward = softmax_xent_rows_forward_backward,
    .sum_squares = adamw_cpu_sum_squares,
    .adamw = adamw_cpu,
};

const struct backend *backend_cpu(void) { return &cpu; }

/* Whether parallel.device = auto means the GPU: a build with a real CUDA back end (not the
 * emulation, which is a test harness) and a device this process can see. */
static bool auto_is_gpu(void) {
#if defined(FMATTN_GPU) && !defined(FMATTN_GPU_EMULATED)
  return gpu_device_count() > 0;
#else
  return false;
#endif
}

const struct backend *backend_for(const struct config *cfg, char *err, size_t len) {
  const enum device_kind want = cfg->parallel.device;
  if (want == DEVICE_CPU || (want == DEVICE_AUTO && !auto_is_gpu())) return &cpu;
#ifdef FMATTN_GPU
  const struct gpu_options o = {
      .bf16 = cfg->parallel.precision == PRECISION_BF16,
      .debug = cfg->gpu.debug,
      .exact = cfg->gpu.exact == EXACT_REFERENCE ? GPU_EXACT_REFERENCE : GPU_EXACT_BLOCKED,
      .exact_workspace = (size_t)cfg->gpu.exact_workspace_mb << 20,
      .fma_workspace = (size_t)cfg->gpu.fma_workspace_mb << 20,
      .outside_reserve = (size_t)cfg->gpu.outside_reserve_mb << 20,
      .outside_probe_mib = fault_outside_alloc_mib(),
      .nccl_timeout = cfg->gpu.nccl_timeout,
  };
  return gpu_backend_open(&o, err, len);
#else
  snprintf(err, len,
           "parallel.device = gpu: this fmattn was built without a GPU back end; configure it "
           "--with-cuda (or --enable-cuda-emulation, to run gpu/ on the CPU) and build again");
  return NULL;
#endif
}

int backend_check(const struct backend *be, const struct config *cfg, int world, char *err,
                  size_t len) {
  const enum backend_kind want = cfg->parallel.backend;
  if (cfg->parallel.precision == PRECISION_BF16 && be->device != DEVICE_GPU)
    snprintf(err, len,
             "parallel.precision = bf16 is for the GPU's matrix products; the CPU back "
             "end computes in fp32 (set parallel.device = gpu, or precision = fp32)");
  else if (be->device != DEVICE_GPU && want == BACKEND_NCCL)
    snprintf(err, len,
             "parallel.backend = nccl moves device buffers: it needs parallel.device = "
             "gpu (the CPU runs over mpi)");
  else if (be->device == DEVICE_GPU && world > 1 && want == BACKEND_MPI)
    snprintf(err, len,
             "parallel.backend = mpi with parallel.device = gpu: the GPU back end's "
             "exchanges run over NCCL; use parallel.backend = nccl (or auto)");
  else
    return 0;
  return 1;
}

void backend_attach_comm(const struct backend *be, struct comm *comm) {
#ifdef FMATTN_GPU
  if (be->device == DEVICE_GPU && comm->world_size > 1) gpu_comm_attach(comm);
#else
  (void)be;
  (void)comm;
#endif
}

void backend_detach_comm(struct comm *comm) {
#ifdef FMATTN_GPU
  if (comm->transport_state) gpu_comm_detach(comm);
#else
  (void)comm;
#endif
}
