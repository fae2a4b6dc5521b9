/* fmattn's CUDA back end as C sees it (SPEC §1 gpu/, §7): plain C declarations of extern "C"
 * launchers, built by ./configure --with-cuda into libfmattn_gpu.a.
 *
 * Status (issue 8): the building blocks only — device selection, device memory, the per-token
 * layers on the device (cuBLAS GEMMs and small kernels that mirror src/layers.c op for op), AdamW
 * and the gradient norm, exact attention (full, local) on one slab, and the NCCL communicator.
 * They compile and link on the development machine, which has no GPU; their tests
 * (tests/test_gpu.c: every op against the CPU op) say "skipped: no GPU" there and have never run.
 * The training step on the device, the other attention kernels and bf16 are not written yet, so
 * parallel.device = gpu is still refused at start.
 *
 * Conventions: every pointer is device memory unless named host; sizes and layouts are those of
 * the CPU op of the same name in layers.h, and backward ACCUMULATES (+=) as there. Work is queued
 * on the back end's one stream; gpu_sync waits for it. A CUDA, cuBLAS or NCCL failure ends the job
 * with the library's message (error.h). */
#ifndef FMATTN_GPU_H
#define FMATTN_GPU_H

#include <mpi.h>
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Devices this process can use: 0 when there is none, or no driver. Never fails. */
int gpu_device_count(void);

/* Select device local_rank mod count, create the stream and the cuBLAS handle. Returns 0, or 1
 * with a message in err when there is no device. */
int gpu_open(int local_rank, char *err, size_t err_len);
void gpu_close(void);
/* The selected device's name and memory, for the run header. */
void gpu_describe(char *out, size_t len);

void *gpu_malloc(size_t bytes);
void gpu_free(void *dev);
void gpu_upload(void *dev, const void *host, size_t bytes);
void gpu_download(void *host, const void *dev, size_t bytes);
void gpu_memset0(void *dev, size_t bytes);
void gpu_sync(void);

/* The per-token layers (layers.h), on device arrays. */
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
                            long B, long T, int C, long t0);
void gpu_gelu_forward(float *out, const float *inp, size_t count);
void gpu_gelu_backward(float *dinp, const float *dout, const float *inp, size_t count);
/* Fused softmax cross-entropy: logits become dlogits; returns Σ −log p(target) over counted rows
 * (targets < 0 are ignored), in double, as layers.h's. */
double gpu_softmax_xent_forward_backward(float *logits, const int *targets, long N, int V,
                                         float grad_scale);

/* AdamW on one tensor of n floats, the update of optimizer.c element for element: g scaled by
 * grad_scale, moments m, v updated, bias corrections bc1 = 1 − β1ᵗ, bc2 = 1 − β2ᵗ, then
 * w −= lr·(m̂/(√v̂ + eps) + wd·w) (lr already times the tensor's lr_scale). */
void gpu_adamw_update(float *w, const float *g, float *m, float *v, size_t n, float lr, float wd,
                      float beta1, float beta2, float eps, float bc1, float bc2, float grad_scale);
/* Σ x² over n floats, accumulated in double (the global gradient norm's square). */
double gpu_sum_squares(const float *x, size_t n);

/* Exact attention, `full` (band 0) and `local` (band > 0), on one slab of T tokens for B·H heads
 * (attention/exact.h, S = 1): out (BH, T, d) and lse (BH, T) as the CPU op saves them; backward
 * ACCUMULATES dq, dk, dv. fp32; head sizes 16, 32, 64 and 128 (gpu_exact_attention_supports). */
int gpu_exact_attention_supports(int d);
void gpu_exact_attention_forward(float *out, float *lse, const float *q, const float *k,
                                 const float *v, long BH, long T, int d, int causal, long band);
void gpu_exact_attention_backward(float *dq, float *dk, float *dv, const float *dout,
                                  const float *q, const float *k, const float *v, const float *out,
                                  const float *lse, long BH, long T, int d, int causal, long band);

/* NCCL communicator over the ranks of an MPI communicator: rank 0's unique id travels by
 * MPI_Bcast; one device per rank (gpu_open first). Collective. */
struct gpu_nccl;
struct gpu_nccl *gpu_nccl_open(MPI_Comm comm);
/* In-place sum over the communicator's ranks of a device float array, on the back end's stream;
 * bytes sent are counted as comm.c counts MPI's. */
void gpu_nccl_allreduce_sum(struct gpu_nccl *c, float *dev, size_t count);
unsigned long long gpu_nccl_bytes_sent(const struct gpu_nccl *c);
void gpu_nccl_close(struct gpu_nccl *c);

#ifdef __cplusplus
}
#endif
#endif
