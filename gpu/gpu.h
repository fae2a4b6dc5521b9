/* The CUDA back end as C sees it (SPEC §1 gpu/, §7): extern "C" functions over device arrays,
 * built by ./configure --with-cuda (nvcc) or --enable-cuda-emulation (on the CPU). Sizes and
 * layouts are those of the CPU op of the same name; backward writes or accumulates as there. Work
 * is queued on the back end's one stream; a CUDA, cuBLAS or NCCL failure ends the job. Every
 * pointer is device memory unless it is named host. */
#ifndef FMATTN_GPU_H
#define FMATTN_GPU_H

#include <mpi.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/memory.h"

#ifdef __cplusplus
extern "C" {
#endif

struct backend;
struct comm;
struct dropout_key;
struct adamw_step;
struct device_counts;

/* ---- the back end's own counts (counts.cu): what it asked of the device, counted as it asks */

/* backend.h's struct device_counts: zero them (the peaks restart from the pool as it is now);
 * read them. */
void gpu_counts_reset(void);
void gpu_counts_read(struct device_counts *out);
/* Called by the back end: one of its kernels launched; a product. */
void gpu_count_launch(void);
/* batch products reading nA distinct A matrices and nB distinct B matrices (an operand of
 * stride 0 is one matrix every product reads: counted once) of elem_bytes bytes per element (C,
 * read where reads_c, is fp32) */
void gpu_count_gemm(long M, long N, long K, long batch, long nA, long nB, bool reads_c,
                    size_t elem_bytes);
/* n elements converted to another precision (copies in bf16 of fp32 arrays) */
void gpu_count_convert(size_t n);
/* n of them converted by a kernel beside its own output, from an fp32 array it reads anyway */
void gpu_count_convert_in_pass(size_t n);
/* Called by the pool (memory.cu): a cudaMalloc, and the pool's bytes in use and cached now. */
void gpu_count_malloc(void);
void gpu_count_pool(size_t live_bytes, size_t cached_bytes);
/* The operators' device times measured so far (check.h gpu_op_time) added to their host timers;
 * gpu_sync and gpu_download call it after they wait. */
void gpu_op_flush(void);

/* ---- the device (backend.cu) */

/* Devices this process can use: 0 when there is none, or no driver. Never fails. */
int gpu_device_count(void);
/* Select device local_rank mod count, create the stream and the cuBLAS handle; bf16: GEMM
 * operands rounded to bf16 (fp32 accumulation). Returns 0, or 1 with the reason in err. */
int gpu_open(int local_rank, bool bf16, char *err, size_t err_len);
void gpu_close(void);
/* The selected device's name and memory, for the run header. */
void gpu_describe(char *out, size_t len);
bool gpu_bf16(void);
/* Change the products' precision (tests compare both on one device). */
void gpu_set_bf16(bool on);
/* Which kernels the `full`/`local` implementation runs (gpu.exact): the blocked form (cuBLAS) or
 * the SIMT reference. Under sequence parallelism (the ring, the halo) only the blocked form
 * runs. */
enum gpu_exact_kernels { GPU_EXACT_BLOCKED, GPU_EXACT_REFERENCE };
/* The back end's options: the deck's [gpu] section and parallel.precision (src/model/backend.c
 * reads them; nothing below it sees the deck). */
struct gpu_options {
  bool bf16;                    /* parallel.precision = bf16 */
  bool debug;                   /* gpu.debug: wait after every launch, name a faulting kernel */
  enum gpu_exact_kernels exact; /* gpu.exact */
  size_t exact_workspace;       /* gpu.exact_workspace_mb, in bytes */
  size_t fma_workspace;         /* gpu.fma_workspace_mb, in bytes */
  size_t outside_reserve;       /* gpu.outside_reserve_mb, in bytes */
  long outside_probe_mib;       /* FMATTN_FAULT = outside_alloc=MIB (a testing hook), or 0 */
  double nccl_timeout;          /* gpu.nccl_timeout: seconds (0: no watchdog) */
};
/* The back end's table (backend.h), its attention implementations registered, the options in
 * force (NULL: the defaults, fp32); NULL with the reason in err when there is no device. The
 * device is local rank mod count (MPI_COMM_TYPE_SHARED). */
const struct backend *gpu_backend_open(const struct gpu_options *o, char *err, size_t err_len);
/* Debug mode (gpu.debug): every launch is waited for and a fault names its kernel. */
void gpu_set_debug(bool on);
bool gpu_debug(void);

/* ---- device memory (memory.cu), counted by label in memory.c */

/* Uninitialised device memory (a reused block, or fresh) from the back end's pool; gpu_alloc_zero
 * zeroes it. gpu_free returns it to the pool without synchronising the device. */
void *gpu_alloc(enum mem_label label, size_t bytes);
void *gpu_alloc_zero(enum mem_label label, size_t bytes);
void gpu_free(void *dev);
/* Give the pool's free blocks back to the driver (at close, or when memory runs short). */
void gpu_release_cache(void);
/* Device memory the pool leaves to allocations outside it (gpu.outside_reserve_mb): before the
 * pool grows, if the driver would then have less than this free, the pool releases its cache
 * (gpu_release_cache) first. 0: never. */
void gpu_pool_set_reserve(size_t bytes);
/* A line "m WHAT" in the pool's trace (FMATTN_GPU_POOL_TRACE), where there is one. */
void gpu_pool_trace_mark(const char *what);
/* The testing hook FMATTN_FAULT = outside_alloc=MIB (core/fault.h), which src/ reads: after each
 * growth the pool checks that MIB MiB are free outside it, and allocates them at exit. 0: off. */
void gpu_pool_set_outside_probe(long mib);
void gpu_upload(void *dev, const void *host, size_t bytes);
void gpu_download(void *host, const void *dev, size_t bytes); /* waits for the copy */
void gpu_copy(void *dst, const void *src, size_t bytes);      /* device to device */
void gpu_memset0(void *dev, size_t bytes);
void gpu_sync(void);
/* rows of len floats between strided layouts, copied or added (dst += src). */
void gpu_copy_rows(float *dst, size_t dst_stride, const float *src, size_t src_stride, size_t rows,
                   size_t len);
void gpu_add_rows(float *dst, size_t dst_stride, const float *src, size_t src_stride, size_t rows,
                  size_t len);

/* ---- matrix products (blas.cu) */

/* C (M × N) = alpha · op(A) op(B) + beta · C, row-major as cblas_sgemm, over `batch` products
 * whose operands lie sA, sB, sC floats apart; in fp32 (no TF32), or with bf16 operands and fp32
 * accumulation when the back end was opened with bf16. */
void gpu_gemm(bool ta, bool tb, long M, long N, long K, float alpha, const float *A, long lda,
              long sA, const float *B, long ldb, long sB, float beta, float *C, long ldc, long sC,
              long batch);
/* How a product's A and B are stored (C is fp32 either way). */
typedef enum { GPU_F32 = 0, GPU_BF16 = 1 } gpu_elem;
size_t gpu_elem_bytes(gpu_elem type);
/* gpu_gemm on A and B stored as `type` (strides and leading dimensions in elements): GPU_F32 is
 * gpu_gemm; GPU_BF16 reads bf16 operands (a caller's copies, gpu_to_bf16) with fp32 accumulation
 * into fp32 C. */
void gpu_gemm_as(gpu_elem type, bool ta, bool tb, long M, long N, long K, float alpha,
                 const void *A, long lda, long sA, const void *B, long ldb, long sB, float beta,
                 float *C, long ldc, long sC, long batch);
/* x (rows of len floats) = normal draws keyed by position: x[r·len + j] =
 * (float)rng_normal(seed, stream, a, r·key_stride + key0 + j, 0), core/rng.c's function computed
 * on the device (its double log and cos may differ from the host's in the last bit of a double,
 * rarely of the float). */
void gpu_fill_normal(float *x, long rows, long len, long key_stride, long key0, uint64_t seed,
                     uint64_t stream, uint64_t a);
/* dst (n bf16 values) = src rounded to nearest even: a conversion pass (counted). */
void gpu_to_bf16(void *dst, const float *src, size_t n);
/* D[r] = Σ_f a[r, f]·b[r, f] over `rows` rows of d floats, f in order (the CPU's rows_dot): the
 * softmax backward's row correction rowsum(dout ∘ out) of the exact and FMA attentions. */
void gpu_rows_dot(float *D, const float *a, const float *b, long rows, long d);
/* gpu_rows_dot, and a16 (rows·d bf16) = a rounded to nearest even, written as the pass reads a
 * (counted as converted in pass). */
void gpu_rows_dot_copy(float *D, const float *a, const float *b, long rows, long d, void *a16);

/* The device's GEMM rate, GFLOP/s: square products of random operands, fp32 (fp32 math, as
 * gpu_gemm runs them) or bf16 (tensor-core math, as gpu_gemm_as runs bf16 operands), fp32
 * accumulation, sized up from 1024 until one takes 20 ms (at most 16384), then repeated until a
 * second of them is timed: the median. */
double gpu_gemm_gflops(bool bf16);
/* gpu_gemm batched over two indices: product (i, j), i < b1, j < b2, reads A + i·sA1 + j·sA2
 * and B likewise and writes C + i·sC1 + j·sC2 (a stride may be 0 for A and B; C's pairs must
 * differ). One cuBLAS call over a device table of the products' pointers (one kernel builds it)
 * where gpu_gemm would take b2 calls of b1; gpu_gemm's own call when b1 or b2 is 1. */
void gpu_gemm2(bool ta, bool tb, long M, long N, long K, float alpha, const float *A, long lda,
               long sA1, long sA2, const float *B, long ldb, long sB1, long sB2, float beta,
               float *C, long ldc, long sC1, long sC2, long b1, long b2);
/* gpu_gemm2 on A and B stored as `type` (strides and leading dimensions in elements). */
void gpu_gemm2_as(gpu_elem type, bool ta, bool tb, long M, long N, long K, float alpha,
                  const void *A, long lda, long sA1, long sA2, const void *B, long ldb, long sB1,
                  long sB2, float beta, float *C, long ldc, long sC1, long sC2, long b1, long b2);
/* gpu_gemm_as batched over a device table of the products' pointers that the caller's kernel
 * built: table[e], table[count + e], table[2·count + e] are product e's B, A (stored as `type`)
 * and C (fp32), cuBLAS's column-major order; nA, nB how many distinct A and B matrices the
 * products read (the counts, gpu.h). */
void gpu_gemm_table(gpu_elem type, bool ta, bool tb, long M, long N, long K, float alpha, long lda,
                    long ldb, float beta, long ldc, long count, void *const *table, long nA,
                    long nB);

/* ---- the per-token layers (layers.cu): layers.h's contracts on device arrays */

void gpu_linear_forward(float *out, const float *inp, const float *weight, const float *bias,
                        long N, int IC, int OC);
void gpu_linear_backward(float *dinp, float *dweight, float *dbias, const float *dout,
                         const float *inp, const float *weight, long N, int IC, int OC);
void gpu_layernorm_forward(float *out, float *mean, float *rstd, const float *inp,
                           const float *weight, const float *bias, long N, int C);
void gpu_layernorm_backward(float *dinp, float *dweight, float *dbias, const float *dout,
                            const float *inp, const float *weight, const float *mean,
                            const float *rstd, long N, int C);
void gpu_embedding_forward(float *out, const int *tokens, const float *token, const float *position,
                           long B, long T, int C, long t0);
void gpu_embedding_backward(float *dtoken, float *dposition, const float *dout, const int *tokens,
                            long B, long T, int C, int V, long t0);
void gpu_gelu_forward(float *out, const float *inp, size_t count);
void gpu_gelu_backward(float *dinp, const float *dout, const float *inp, size_t count);
void gpu_sinusoidal_forward(float *x, long B, long T, int C, long t0, float scale);
void gpu_rope_forward(float *x, long BH, long T, int d, long t0);
void gpu_rope_backward(float *dx, long BH, long T, int d, long t0);
void gpu_dropout_forward(float *x, const struct dropout_key *key, long B, long T, int C);
void gpu_dropout_backward(float *dx, const struct dropout_key *key, long B, long T, int C);
void gpu_residual_dropout_forward(float *out, const float *res, const float *y,
                                  const struct dropout_key *key, long B, long T, int C);
void gpu_residual_dropout_backward(float *dres, float *dy, const float *dout,
                                   const struct dropout_key *key, long B, long T, int C);
void gpu_heads_split_forward(float *q, float *k, float *v, const float *qkv, long B, long T,
                             int Hqk, int H, int d);
void gpu_heads_split_backward(float *dqkv, const float *dq, const float *dk, const float *dv,
                              long B, long T, int Hqk, int H, int d);
void gpu_heads_merge_forward(float *y, const float *att, long B, long T, int H, int d);
void gpu_heads_merge_backward(float *datt, const float *dy, long B, long T, int H, int d);
/* Fused softmax cross-entropy: logits become dlogits; returns Σ −log p(target) over counted rows
 * (targets < 0 ignored) in double; row_loss and row_pred (host, N: the argmax, −1 for ignored
 * rows) when given (layers.h's softmax_xent_rows_forward_backward). */
double gpu_softmax_xent_forward_backward(float *logits, const int *targets, long N, int V,
                                         float grad_scale, float *row_loss, int *row_pred);

/* ---- the optimizer (optimizer.cu) */

/* AdamW on one tensor of n floats, optimizer.c's update element for element. */
void gpu_adamw(float *w, const float *g, float *m, float *v, size_t n, const struct adamw_step *s);
/* Σ x² over n floats in double, in a fixed order (the global gradient norm's square). */
double gpu_sum_squares(const float *x, size_t n);

/* ---- exact attention, `full` (band 0) and `local` (attention_full*.cu, docs/gpu.md) */

/* The SIMT reference kernels on one slab of T tokens for BH heads (attention/exact.h, S = 1): out
 * (BH, T, d) and lse (BH, T) as the CPU op saves them; backward ACCUMULATES dq, dk, dv. fp32;
 * head sizes 16, 32, 64 and 128 (gpu_exact_attention_supports). */
int gpu_exact_attention_supports(int d);
void gpu_exact_attention_forward(float *out, float *lse, const float *q, const float *k,
                                 const float *v, long BH, long T, int d, int causal, long band);
void gpu_exact_attention_backward(float *dq, float *dk, float *dv, const float *dout,
                                  const float *q, const float *k, const float *v, const float *out,
                                  const float *lse, long BH, long T, int d, int causal, long band);
/* The blocked form (the fast path), same contract, any head size: scores of query chunks by
 * gpu_gemm (fp32, or bf16 operands when gpu_bf16()), a SIMT masked softmax, P·V by gpu_gemm; a
 * band reads only its keys. Memory per call: the workspace below, never an n × n buffer. */
void gpu_exact_blocked_forward(float *out, float *lse, const float *q, const float *k,
                               const float *v, long BH, long T, int d, int causal, long band);
void gpu_exact_blocked_backward(float *dq, float *dk, float *dv, const float *dout, const float *q,
                                const float *k, const float *v, const float *out, const float *lse,
                                long BH, long T, int d, int causal, long band);
/* The kernels of `full`/`local` (gpu.exact; gpu_backend_open sets them, tests change them). */
enum gpu_exact_kernels gpu_exact_kernels(void);
void gpu_set_exact_kernels(enum gpu_exact_kernels k);
/* The blocked form's workspace per call in bytes (gpu.exact_workspace_mb, default 256 MiB; the
 * setter's 0 restores the default). */
size_t gpu_exact_workspace(void);
void gpu_set_exact_workspace(size_t bytes);
/* Register full's and local's GPU implementation (gpu_backend_open does). */
void gpu_attention_full_register(void);

/* ---- Fast Multipole Attention, `fma` and `fma_linear` (attention_fma.cu, fma_*.cu) */

/* Register the GPU implementations of fma and fma_linear (gpu_backend_open calls it). */
void gpu_attention_fma_register(void);
/* The device workspace one chunk of query blocks may take in evaluate (scores, gathered
 * summaries and, in backward, their gradients), in bytes (gpu.fma_workspace_mb, default 1 GiB; 0
 * restores the default). */
void gpu_fma_set_workspace(size_t bytes);
/* The far field's backward scatter sums a summary row's gradient with one warp where the row has
 * at most `refs` references (default 32), with a block of 8 warps otherwise; the same sums in the
 * same order either way. For tables built after the call; negative: the default. Tests use 0
 * (every row to the blocks) and a large value (every row to the warps). */
void gpu_fma_set_light_refs(int refs);

/* ---- communication (comm.cu): the NCCL transport of the communicator (comm.h) */

/* Move c's bulk float traffic onto NCCL over device buffers: one NCCL communicator per scope,
 * unique ids broadcast over MPI. Collective over the world. */
void gpu_comm_attach(struct comm *c);
void gpu_comm_detach(struct comm *c);

#ifdef __cplusplus
}
#endif
#endif
