/* Kernelized attention, the core of `linear` (SPEC §6.3), fmmformer's far field (§6.6) and `rmfa`
 * (§6.8): with F features φ per token, out_i = φ(q_i)ᵀ S_i / den_i, S_i = Σ_{j∈J(i)} φ(k_j) v_jᵀ,
 * den_i = φ(q_i)ᵀ Σ_{j∈J(i)} φ(k_j) (rmfa: max(1, ·)), J(i) = {j ≤ i} causal, else every j;
 * O(n·F·d) time, O(n·d + F·d) memory. Internal to src/attention/; variants supply the map and ops
 * tables. */
#ifndef FMATTN_ATTENTION_KERNELIZED_H
#define FMATTN_ATTENTION_KERNELIZED_H

#include <stdbool.h>
#include <stddef.h>

#include "attention/attention.h"

/* Rows per chunk of the running sums: within a chunk the causal terms are small masked GEMMs
 * (32 measured fastest: the masked products grow with the chunk, GEMM efficiency shrinks). */
#define KZ_CHUNK 32
/* Rows per call of a feature map (a whole number of chunks): larger GEMMs in the maps. */
#define KZ_BLOCK (4 * KZ_CHUNK)

/* A feature map φ: R^d → R^F applied row by row (the same map for every batch element and head). */
struct kz_map {
  int F;                 /* features per token */
  int d;                 /* width of the rows it maps (the head size) */
  size_t scratch_floats; /* workspace of one call on up to KZ_BLOCK rows */
  /* phi (rows, F) = φ(x) for x (rows, d); what backward needs of x stays in scratch */
  void (*forward)(const struct kz_map *map, float *phi, const float *x, long rows, float *scratch);
  /* dx (rows, d) += dphi (rows, F) · ∂φ/∂x at x; primed: scratch holds what forward left for
   * these same rows, which backward may reuse instead of recomputing */
  void (*backward)(const struct kz_map *map, float *dx, const float *dphi, const float *x,
                   long rows, float *scratch, bool primed);
  double flops_per_row; /* forward FLOPs of the map for one row (for the FLOP counts) */
  const void *data;     /* the variant's own (the kernel's choice, random features) */
};

/* How den_i is formed: the plain sum (linear, fmmformer), or max(1, ·) (rmfa, whose random
 * features may make the sum small or negative). */
enum kz_norm { KZ_PLAIN, KZ_CLAMP1 };

/* Floats kz_forward saves for kz_backward, per layer: den (B, H, T) and the sums of the keys
 * outside the slab that the slab's queries see (B, H, F·d + F). */
size_t kz_saved_floats(const struct attn_ctx *ctx, const struct kz_map *map);

/* out (B, H, T, d) = the kernelized attention of q, k, v (B, H, T, d) over the whole sequence:
 * the local slab of ctx->dims, and under sequence parallelism the running sums of the other
 * ranks (one exclusive scan over the sequence group). Collective when S > 1. */
void kz_forward(struct attn_ctx *ctx, const struct kz_map *map, enum kz_norm norm, float *out,
                float *saved, const float *q, const float *k, const float *v);
/* dq, dk, dv += the gradients for dout · dscale; out and saved exactly as kz_forward left them
 * (out is the op's own output, before any scaling the variant applies). dscale (H, d) scales the
 * output gradient per head and channel (the variant's scaling of the output: rmfa's γ,
 * fmmformer's σ(w2)), or NULL for none. Collective when S > 1. */
void kz_backward(struct attn_ctx *ctx, const struct kz_map *map, enum kz_norm norm,
                 const float *dscale, float *dq, float *dk, float *dv, const float *dout,
                 const float *q, const float *k, const float *v, const float *out,
                 const float *saved);

/* Forward model FLOPs of this rank's share: per token and head, the numerator, denominator and
 * state updates of the prefix-sum form (4·F·d + 4·F) and the feature maps of q and k. The chunked
 * GEMM form executes about twice that (the masked intra-chunk products); the rate reported
 * against these FLOPs is what the algorithm, not the kernel, achieves. */
double kz_flops(const struct attn_ctx *ctx, const struct kz_map *map);

/* phi (T, F) = φ(x) of x (T, d), in chunks; scratch of map->scratch_floats. */
void kz_features(const struct kz_map *map, float *phi, const float *x, long T, float *scratch);

/* Diagnostics (the ops table's) of the kernelized attention alone: for every head of batch
 * element 0 the weights φ(q_i)·φ(k_j) of sampled rows, normalised per row, in the fma.m tree's
 * distance bands. With KZ_CLAMP1 the weights may be negative and their magnitudes are used.
 * Adds into mass (H, bands) and entropy (H); returns the queries examined per head. */
long kz_diagnostics(struct attn_ctx *ctx, const struct kz_map *map, enum kz_norm norm, double *mass,
                    double *entropy, const float *q, const float *k);

/* Incremental decoding (generation): the running sums of every head, and one position's step (its
 * key joins the sums, then out (H, d) of its query). The map is copied; what its data points to
 * must outlive the cache. */
void *kz_decode_open(const struct attn_ctx *ctx, const struct kz_map *map);
void kz_decode_step(const struct attn_ctx *ctx, void *cache, enum kz_norm norm, float *out,
                    const float *q, const float *k, const float *v);
void kz_decode_close(void *cache);

#endif
