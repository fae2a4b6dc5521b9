/* The device seam (SPEC §7 "Devices"): where the model's buffers live and the implementations of
 * the per-token layers and of the optimizer that run on them, one table per device, chosen once
 * when a model is built. The model, the optimizer and the attention contexts call through it and
 * never ask which device it is; backend.c is the only file that knows whether a GPU back end was
 * built. Every pointer handed to a table's functions lives on that table's device. */
#ifndef FMATTN_BACKEND_H
#define FMATTN_BACKEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/memory.h"
#include "deck/config.h"
#include "nn/adamw.h"
#include "nn/layers.h"
#include "parallel/comm.h"

#ifdef __cplusplus
extern "C" {
#endif

/* What a device back end asked of its device (gpu/counts.cu counts it as it asks): bench.h5 /gpu,
 * and scripts/roofline.py's lower bound on the time. */
struct device_counts {
  double gemm_calls;            /* cuBLAS products (a strided batch counts once) */
  double gemm_flops;            /* 2·M·N·K·batch over them */
  double gemm_operand_elements; /* distinct elements they read: A and B (an operand of stride 0
                                 * in a batch once), and C where beta ≠ 0 */
  double gemm_operand_bytes;    /* the bytes of those elements: 2 for a bf16 operand, 4 for fp32 */
  double elements_converted;    /* elements copied into another precision: bf16 copies of fp32
                                 * arrays that bf16 products read (gpu_to_bf16, and those below) */
  double elements_converted_in_pass; /* of those, the copies a kernel wrote beside its own output
                                      * while it read the fp32 array anyway (the upward pass's
                                      * transposes): their only traffic is the bf16 write */
  double kernel_launches;            /* gpu/'s own kernels (cuBLAS's not included) */
  double mallocs;                    /* cudaMalloc calls of the pool */
  double pool_live_peak_bytes; /* the pool's blocks in use, and with its cache, at their peaks */
  double pool_reserved_peak_bytes;
  double device_bytes_outside_pool; /* in use on the device by others: context, cuBLAS, NCCL */
};

struct backend {
  const char *name;        /* "cpu", "cuda" */
  enum device_kind device; /* DEVICE_CPU or DEVICE_GPU: whose attention implementations run */
  bool host_visible;       /* its buffers are host memory: host code may read them directly */
  void (*describe)(char *out, size_t len); /* the device, for the run header */
  void (*sync)(void);                      /* wait for the work queued on the device (timing) */
  /* The device's measured matrix-product rate in GFLOP/s, fp32 or bf16 operands (bench's MFU
   * baseline); NULL on the CPU, whose rate bench measures itself. */
  double (*gemm_gflops)(bool bf16);
  /* The device's own counts since the last reset (NULL on the CPU, which keeps none). */
  void (*counts_reset)(void);
  void (*counts_read)(struct device_counts *out);
  /* Give the device back what the memory pool holds unused (NULL on the CPU): bench calls it
   * after each case, so that the next case's reserved peak is its own, not its predecessors'. */
  void (*trim)(void);

  /* x (rows of len floats) = (float)rng_normal(seed, stream, a, r·key_stride + key0 + j, 0) for
   * element j of row r, drawn where x lies (NULL on the CPU: the caller draws on the host). */
  void (*fill_normal)(float *x, long rows, long len, long key_stride, long key0, uint64_t seed,
                      uint64_t stream, uint64_t a);

  /* Memory on the device, zeroed, labelled as memory.c's arenas are. */
  void *(*alloc)(enum mem_label label, size_t bytes);
  void (*free)(void *p);
  void (*zero)(void *p, size_t bytes);
  void (*upload)(void *dev, const void *host, size_t bytes);
  void (*download)(void *host, const void *dev, size_t bytes);

  /* The per-token layers of layers.h, same contracts (row_loss and row_pred stay host arrays). */
  void (*linear_forward)(float *out, const float *inp, const float *weight, const float *bias,
                         long N, int IC, int OC);
  void (*linear_backward)(float *dinp, float *dweight, float *dbias, const float *dout,
                          const float *inp, const float *weight, long N, int IC, int OC);
  void (*layernorm_forward)(float *out, float *mean, float *rstd, const float *inp,
                            const float *weight, const float *bias, long N, int C);
  void (*layernorm_backward)(float *dinp, float *dweight, float *dbias, const float *dout,
                             const float *inp, const float *weight, const float *mean,
                             const float *rstd, long N, int C);
  void (*gelu_forward)(float *out, const float *inp, size_t count);
  void (*gelu_backward)(float *dinp, const float *dout, const float *inp, size_t count);
  void (*embedding_forward)(float *out, const int *tokens, const float *token,
                            const float *position, long B, long T, int C, long t0);
  void (*embedding_backward)(float *dtoken, float *dposition, const float *dout, const int *tokens,
                             long B, long T, int C, int V, long t0);
  void (*sinusoidal_forward)(float *x, long B, long T, int C, long t0, float scale);
  void (*rope_forward)(float *x, long BH, long T, int d, long t0);
  void (*rope_backward)(float *dx, long BH, long T, int d, long t0);
  void (*dropout_forward)(float *x, const struct dropout_key *key, long B, long T, int C);
  void (*dropout_backward)(float *dx, const struct dropout_key *key, long B, long T, int C);
  void (*residual_dropout_forward)(float *out, const float *res, const float *y,
                                   const struct dropout_key *key, long B, long T, int C);
  void (*residual_dropout_backward)(float *dres, float *dy, const float *dout,
                                    const struct dropout_key *key, long B, long T, int C);
  void (*heads_split_forward)(float *q, float *k, float *v, const float *qkv, long B, long T,
                              int Hqk, int H, int d);
  void (*heads_split_backward)(float *dqkv, const float *dq, const float *dk, const float *dv,
                               long B, long T, int Hqk, int H, int d);
  void (*heads_merge_forward)(float *y, const float *att, long B, long T, int H, int d);
  void (*heads_merge_backward)(float *datt, const float *dy, long B, long T, int H, int d);
  /* layers.h's softmax_xent_rows_forward_backward: row_loss and row_pred are host arrays */
  double (*softmax_xent_forward_backward)(float *logits, const int *targets, long N, int V,
                                          float grad_scale, float *row_loss, int *row_pred);

  /* The optimizer's element-wise work (optimizer.c): Σ x² in double over n floats, and AdamW
   * on one tensor of n floats. */
  double (*sum_squares)(const float *x, size_t n);
  void (*adamw)(float *w, const float *g, float *m, float *v, size_t n, const struct adamw_step *s);
};

/* The back end of parallel.device (auto: the GPU when this build has a real CUDA back end and
 * a device is visible, else the CPU), opened on first use (a device back end then registers its
 * attention implementations). NULL, with the reason in err, when there is none. */
const struct backend *backend_for(const struct config *cfg, char *err, size_t len);
/* The CPU back end (always there). */
const struct backend *backend_cpu(void);
/* Whether a run on be can take cfg's precision and communication backend on world ranks: 0, or
 * 1 with the reason in err. */
int backend_check(const struct backend *be, const struct config *cfg, int world, char *err,
                  size_t len);
/* The communicator's transport for a model on be: NCCL over device buffers for a GPU on more
 * than one rank, else MPI (backend_check first). backend_detach_comm undoes it before
 * comm_free. Collective. */
void backend_attach_comm(const struct backend *be, struct comm *comm);
void backend_detach_comm(struct comm *comm);

#ifdef __cplusplus
}
#endif

#endif
