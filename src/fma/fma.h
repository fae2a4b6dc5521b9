/* Internal interface of Fast Multipole Attention (SPEC §6.4–6.5), shared by the operator files:
 * fma/down.c (P2M, M2M and their transposes: the upward and downward passes that make and unmake
 * the coarse summaries), fma/evaluate.c (P2P and M2P: queries against near keys and listed
 * summaries), and attention/fma.c (the ops tables of `fma` and `fma_linear`). Not for the model:
 * the model sees only the ops table. Which keys a query sees is decided in fma/lists.c only. */
#ifndef FMATTN_FMA_H
#define FMATTN_FMA_H

#include <stdbool.h>
#include <stddef.h>

#include "config.h"
#include "fma/lists.h"
#include "fma/tree.h"
#include "params.h"

/* Per-thread timings of the operators, in seconds. */
struct fma_times {
  double p2p, m2p, p2m, m2m;
};

/* Summary sets: the coarse keys, values and (fma_linear) queries each have their own weights. */
enum fma_set { FMA_K = 0, FMA_V = 1, FMA_Q = 2, FMA_NSETS = 3 };

/* Where each downsampling tensor lives in the variant's parameter block (floats), and the length
 * of its last axis: conv level l: w_l; m2m level 1: m, level l ≥ 2: 2p. */
struct fma_layout {
  size_t weight[FMA_NSETS][FMA_MAX_LEVELS + 1];
  size_t bias[FMA_NSETS][FMA_MAX_LEVELS + 1];
  long span[FMA_MAX_LEVELS + 1];
  size_t total; /* floats of the block, padding included */
};

struct fma_let;

struct fma_state {
  struct fma_tree tree;
  enum fma_downsample down;
  bool causal, linear, multiplicity;
  int d;
  long t0, T; /* this rank's slab of queries and tokens: [t0, t0 + T) (the whole sequence: 0, n) */
  long klo;   /* global index of row 0 of the key/value arrays evaluate reads (slab or halo) */
  struct fma_let *let; /* the locally essential tree under sequence parallelism, else NULL */
  long rows;           /* summary rows per (batch, head): Σ_l windows_l · p */
  long level_row[FMA_MAX_LEVELS + 2]; /* first row of level l; level_row[L + 1] = rows */
  struct fma_layout layout;
};

/* Describe the downsampling parameters (names relative to attn/<variant>/), and find them. */
void fma_describe(const struct config *cfg, long n, bool linear, struct param_list *list);
void fma_layout_build(const struct config *cfg, long n, bool linear, struct fma_layout *layout);
/* The mean (avg-equivalent) or random initialisation of one downsampling tensor; for fma_linear
 * (linear) with fma.linear_zero_values, the value summaries' token-reading weights start at 0. */
void fma_init_param(const struct config *cfg, const struct param_desc *p, float *data, bool linear);

/* Downsampling weights of one set, transposed for channel-contiguous loops:
 * wt[level] (p, span, d) = weight[f][r][t] at wt[(r·span + t)·d + f], bt[level] (p, d). */
struct fma_down_weights {
  float *wt[FMA_MAX_LEVELS + 1];
  float *bt[FMA_MAX_LEVELS + 1];
};
void fma_weights_load(const struct fma_state *st, const float *params, enum fma_set set,
                      struct fma_down_weights *w);
/* dparams += the transposed gradients in dw (same layout as w). */
void fma_weights_store_grad(const struct fma_state *st, float *dparams, enum fma_set set,
                            const struct fma_down_weights *dw);
void fma_weights_free(const struct fma_state *st, struct fma_down_weights *w);
void fma_weights_zero(const struct fma_state *st, struct fma_down_weights *w);

/* Windows [*c0, *c1) of level l this rank computes: those inside its slab, or the one spanning
 * window that contains it. */
void fma_slab_windows(const struct fma_state *st, int l, long *c0, long *c1);
/* M2M for one parent window c of level l, and its transpose restricted to children [j0, j1). */
void fma_M2M_window(const struct fma_state *st, int l, long c, float *X,
                    const struct fma_down_weights *w);
void fma_M2M_window_backward(const struct fma_state *st, int l, long c, float *dX, long j0, long j1,
                             const struct fma_down_weights *w);

/* Upward pass of one head over this rank's slab: summaries X (rows, d), indexed by global window,
 * from the slab's tokens x (T, d). P2M makes level 1 from tokens (every level, for conv and avg;
 * for a window spanning ranks, the slab's share of its sums); M2M makes level l + 1 from level l
 * (m2m, up to the first level whose windows span ranks). */
void fma_upward_pass(const struct fma_state *st, float *X, const float *x,
                     const struct fma_down_weights *w, struct fma_times *times);
/* Downward pass (the transpose) of one head over this rank's slab: dX (rows, d) is consumed —
 * for m2m, coarser levels are pushed into finer ones in place — and dx (T, d) += its
 * contribution. Parameter gradients are NOT formed here (see fma_param_grads). */
void fma_downward_pass(const struct fma_state *st, float *dX, float *dx,
                       const struct fma_down_weights *w, struct fma_times *times);
/* Parameter gradients summed over `count` heads in a fixed order, over this rank's windows: x, X,
 * dX (after the downward pass) of head h at x + h·T·d, X + h·rows·d, dX + h·rows·d. dw += . */
void fma_param_grads(const struct fma_state *st, struct fma_down_weights *dw, const float *x,
                     const float *X, const float *dX, long count);

/* Near and far keys of one query block, as evaluate needs them. */
struct fma_block_keys {
  long near_lo, near_count; /* near keys: global rows [near_lo, near_lo + near_count) */
  int nfar;                 /* listed summary rows */
  long *far_row;            /* (nfar) row of each in the summary arrays */
  float *far_logw;          /* (nfar) log(w_l / p) or 0 */
  int *far_level;           /* (nfar) level of each */
};
/* Fill the lists of query block qb (capacity: 3·p·L far rows). */
void fma_block_keys(const struct fma_state *st, long qb, struct fma_block_keys *bk);

/* fma evaluation of one head (SPEC §6.4): out (n, d), lse (n) saved. K, V: summaries (rows, d).
 * diag (may be NULL): mass (L + 1) and entropy sums over this head's queries. */
void fma_evaluate_forward(const struct fma_state *st, float *out, float *lse, const float *q,
                          const float *k, const float *v, const float *K, const float *V, long qb0,
                          long qb1, struct fma_times *times, double *mass, double *entropy);
/* dq, dk, dv (n, d) and dK, dV (rows, d) += the gradients of one head for dout; D (n) holds
 * Σ_c dout·out per row. */
void fma_evaluate_backward(const struct fma_state *st, float *dq, float *dk, float *dv, float *dK,
                           float *dV, const float *dout, const float *D, const float *q,
                           const float *k, const float *v, const float *K, const float *V,
                           const float *lse, struct fma_times *times);

/* fma_linear (SPEC §6.5), one head: the near field with its own softmax, then each level's
 * sub-segment summaries attending to the level's list with their own softmax. lse: (n) near and
 * (rows) per summary row of queries. band_norms (may be NULL): (n, L + 1) the L1 norm of each
 * band's contribution to each query's output (the bands are normalised apart, so this — not a
 * probability — is what their shares mean); entropy: the near-field softmax's, summed. */
void fma_linear_forward(const struct fma_state *st, float *out, float *lse_near, float *lse_far,
                        const float *q, const float *k, const float *v, const float *Q,
                        const float *K, const float *V, struct fma_times *times, float *band_norms,
                        double *entropy);
void fma_linear_backward(const struct fma_state *st, float *dq, float *dk, float *dv, float *dQ,
                         float *dK, float *dV, const float *dout, const float *out, const float *q,
                         const float *k, const float *v, const float *Q, const float *K,
                         const float *V, const float *lse_near, const float *lse_far,
                         struct fma_times *times);

/* The query sub-segment summary row that query i's level-l term uses: ρ_l(i) bidirectional,
 * ρ_l(i) − 1 causal (the sub-segment before i's, so that no later query leaks in); −1: none. */
long fma_linear_query_row(const struct fma_state *st, int l, long i);

/* Incremental decoding of causal fma for generation (fma/decode.c): a cache of one sequence's
 * last 2m keys and values and of every level's summaries, kept up to date token by token; each step
 * adds position pos's key and value (k, v (H, d)) and writes out (H, d) of its query q (H, d). */
struct fma_decoder;
struct fma_decoder *fma_decode_open(const struct fma_state *st, const float *params, long H);
void fma_decode_step(struct fma_decoder *dec, float *out, const float *q, const float *k,
                     const float *v, long pos);
void fma_decode_close(struct fma_decoder *dec);

#endif
