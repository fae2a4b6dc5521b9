/* What the files of FMA on the GPU share (attention_fma.cu, fma_lists.cu, fma_upward.cu,
 * fma_evaluate.cu, fma_let.cu): the layouts of the device arrays, the device tables built once
 * per context from src/fma/'s lists, and the entry points between the files. C++ only; C sees
 * gpu.h. Nothing here decides which keys a query sees: that is src/fma/lists.c, read on the host.
 */
#ifndef FMATTN_GPU_FMA_GPU_H
#define FMATTN_GPU_FMA_GPU_H

#include <cstddef>

#include "attention/attention.h"
#include "fma/fma.h"
#include "fma/let.h"

/* Summaries live channel-outermost, level by level: set s's array Xt holds level l's rows for
 * every channel and head as (d, BH, nr[l]), element (l, f, h, r) at d·BH·row[l] + (f·BH + h)·nr[l]
 * + r. A level holds the windows [c0[l], c0[l] + nr[l]/p) the state's layout gives it (every
 * window on one rank; under sequence parallelism those the rank touches, fma_state_compact): row
 * r of window c at r + (c − c0[l])·p, and a summary row R of the state's layout (fma_state.rows)
 * at R − row[l] within its level. Per channel a level is a row-major matrix of (BH·windows) × p,
 * so P2M and M2M are GEMMs batched over channels. Passed to kernels by value. */
struct gfma_levels {
  int L, p, d;
  long BH;
  long row[FMA_MAX_LEVELS + 2]; /* level l's first row in the state's layout; row[L + 1] = rows */
  long nr[FMA_MAX_LEVELS + 2];  /* rows of level l: windows held · p */
  long c0[FMA_MAX_LEVELS + 2];  /* level l's first window held (fma_state.win_lo) */
};

__host__ __device__ inline size_t gfma_at(const gfma_levels &lv, int l, long f, long h, long r) {
  return (size_t)lv.d * lv.BH * lv.row[l] + ((size_t)f * lv.BH + h) * lv.nr[l] + r;
}

/* Element (f, h) of row r of window c of level l: gfma_at of the window's row within its level. */
__host__ __device__ inline size_t gfma_window_at(const gfma_levels &lv, int l, long f, long h,
                                                 long c, long r) {
  return gfma_at(lv, l, f, h, (c - lv.c0[l]) * lv.p + r);
}

/* The level of global summary row R (row[l] ≤ R < row[l + 1]). */
__host__ __device__ inline int gfma_level_of(const gfma_levels &lv, long R) {
  int l = 1;
  while (l < lv.L && R >= lv.row[l + 1]) l++;
  return l;
}

/* The transposes of a table of references (source item, slot) → summary row: for each summary
 * row some source names, its references (source · slots + slot) in increasing source order, so
 * that a gradient is gathered per target row in a fixed order (no float atomics). */
struct gfma_refs {
  long nrows; /* summary rows referenced */
  int *row;   /* (nrows) their global row */
  int *off;   /* (nrows + 1) where each one's references start in ref */
  int *ref;   /* (off[nrows]) source · slots + slot */
  /* the rows (indices into row) with at most gpu_fma_set_light_refs's number of references, and
   * the others: the far field's scatter sums the first a warp each, the others a block each */
  long nlight, nheavy;
  int *light, *heavy;
};

/* fma_linear's far field: items are (level l, query sub-segment rho) with a query in the slab,
 * level by level; item_off[l] is level l's first item, rho0[l] its first sub-segment. */
struct gfma_items {
  long count;
  long off[FMA_MAX_LEVELS + 2];
  long rho0[FMA_MAX_LEVELS + 2];
  long seg[FMA_MAX_LEVELS + 2]; /* tokens per sub-segment: w_l / p */
};

/* One context's device state (attn_ctx.impl_state). */
struct gfma {
  const struct fma_state *st; /* the variant's host state: tree, slab, layout, LET plan */
  bool linear, causal;
  bool copies; /* bf16 products when the context opened: its saved state holds bf16 copies of q,
                * k, v (attention_fma.cu); used while the products are bf16 */
  long B, H, BH, T, d, m, p;
  int L;
  int ns;           /* near blocks a query block reads: 2 causal (b − 1, b), 3 bidirectional */
  int nlist;        /* windows a level lists at most: 2 causal, 3 bidirectional */
  long b0, nbs, nb; /* the slab's first fine block, its blocks, the sequence's blocks */
  gfma_levels lv;
  /* fma: per slab query block lb, its nfmax far slots (level l's at (l − 1)·nlist·p, p rows per
   * listed window, unused slots −1) and their log-weights; the slots' transposes */
  int nfmax;
  int *far_row;    /* (nbs, nfmax) global summary row, or −1 */
  float *far_logw; /* (nfmax) log(w_l/p) with fma.multiplicity, else 0 */
  gfma_refs far_refs;
  /* fma_linear: the items, each one's query row and its 3p key rows (−1: none), transposes */
  gfma_items items;
  int *item_qrow; /* (items) global row of the query summary, or −1 */
  int *item_key;  /* (items, 3p) global key rows, or −1 */
  int *item_row;  /* (items) global row of its sub-segment (where lse_far keeps its lse) */
  int *item_span; /* (items, 2) the item's queries in the slab: local [i0, i1) */
  gfma_refs lin_refs;
  /* the locally essential tree on the device (fma_let.cu), planned at the first call */
  struct gfma_let *let;
  float *avg_w[FMA_MAX_LEVELS + 1]; /* avg: the fixed (p, w_l) weights, shared by channels */
};

/* ---- fma_lists.cu: the tables, from src/fma/lists.c on the host */
void gfma_tables_build(gfma *g);
void gfma_tables_free(gfma *g);

/* ---- fma_upward.cu: P2M, M2M and their transposes over all heads of one set */

/* avg's fixed weights, level by level (g->avg_w), at open; freed at close. */
void gfma_avg_build(gfma *g);
void gfma_avg_free(gfma *g);

/* The weights of one set as the GEMMs read them: level l's (p, span) matrix of channel f at
 * w[l] + f·stride[l]; bias b[l] (d, p) or null (avg). fma_linear's causal q_down taps that a row
 * may not read are zero in a masked copy (owned, freed by gfma_weights_release). With bf16
 * products the P2M levels' matrices also in bf16, laid out alike (wb, in owned_b); null else. */
struct gfma_weights {
  const float *w[FMA_MAX_LEVELS + 1];
  const float *b[FMA_MAX_LEVELS + 1];
  long stride[FMA_MAX_LEVELS + 1];
  float *owned[FMA_MAX_LEVELS + 1];
  const void *wb[FMA_MAX_LEVELS + 1];
  void *owned_b[FMA_MAX_LEVELS + 1];
};
void gfma_weights_get(const gfma *g, const float *params, enum fma_set set, gfma_weights *w);
void gfma_weights_release(gfma_weights *w);
/* Xt (d·BH·rows, zeroed by the caller) ← the upward pass of x (BH, T, d) over the slab
 * (fma_upward_pass). With bf16 products (w's bf16 copies) the tokens are read from x16, their bf16
 * copy, when given, else from x, and then copy16 (when given) receives that bf16 copy, made by
 * the pass that reads x anyway: returns whether it did (false: the caller converts). */
bool gfma_upward_pass(const gfma *g, float *Xt, const float *x, const gfma_weights *w,
                      const void *x16, void *copy16);
/* Every window of spanning level l from its children (M2M, every head), and its transpose (the
 * children += from the parents' gradients), for the LET. */
void gfma_M2M_spanning(const gfma *g, int l, float *Xt, const gfma_weights *w);
void gfma_M2M_spanning_backward(const gfma *g, int l, float *dXt, const gfma_weights *w);
/* dx (BH, T, d) += the transpose of the upward pass for dXt, whose coarse levels are pushed into
 * the fine ones in place (each level final once done; fma_upward_pass_backward). */
void gfma_upward_pass_backward(const gfma *g, float *dx, float *dXt, const gfma_weights *w);
/* dparams += the weight and bias gradients of set `set`, from dXt as the pass backward left it
 * and the inputs Xt, x (fma_upward_param_grads); nothing for avg or without dparams. */
void gfma_upward_param_grads(const gfma *g, enum fma_set set, float *dparams, const float *dXt,
                             const float *Xt, const float *x);

/* ---- fma_evaluate.cu: P2P and M2P in chunks of query blocks */

/* bf16 copies of q, k, v (BH, T, d) that the caller made (with bf16 products: attention_fma.cu
 * keeps them in the saved state from forward to backward), and of dout (backward's own, made by
 * the pass that sums D); a null member is copied by evaluate, chunk by chunk for q and dout. */
struct gfma_copies {
  const void *q, *k, *v, *dout;
};

/* The workspace budget of one chunk, in bytes (gpu_fma_set_workspace). */
size_t gfma_workspace_budget(void);
/* fma: out (BH, T, d), lse (BH, T); k, v from global row klo, kstride rows per head. For
 * fma_linear (no far slots) the near field alone, under its own softmax. */
void gfma_evaluate_forward(const gfma *g, float *out, float *lse, const float *q, const float *k,
                           const float *v, long klo, long kstride, const float *XK, const float *XV,
                           const gfma_copies *made);
/* fma backward: dq, dk, dv (k's layout), dXK, dXV += the gradients for dout; for fma_linear the
 * near field's (out, XK, XV, dXK, dXV not read). */
void gfma_evaluate_backward(const gfma *g, float *dq, float *dk, float *dv, float *dXK, float *dXV,
                            const float *dout, const float *out, const float *q, const float *k,
                            const float *v, long klo, long kstride, const float *XK,
                            const float *XV, const float *lse, const gfma_copies *made);
/* ---- fma_linear.cu */

/* fma_linear: the near field under its own softmax (lse_near (BH, T)), then every level's term;
 * lse_far (BH, rows). */
void gfma_linear_forward(const gfma *g, float *out, float *lse_near, float *lse_far, const float *q,
                         const float *k, const float *v, long klo, long kstride, const float *XQ,
                         const float *XK, const float *XV, const gfma_copies *made);
void gfma_linear_backward(const gfma *g, float *dq, float *dk, float *dv, float *dXQ, float *dXK,
                          float *dXV, const float *dout, const float *q, const float *k,
                          const float *v, long klo, long kstride, const float *XQ, const float *XK,
                          const float *XV, const float *lse_near, const float *lse_far,
                          const gfma_copies *made);

/* ---- fma_let.cu: the locally essential tree on device buffers (src/fma/let.c's plan) */
struct gfma_let;
struct gfma_let *gfma_let_open(const gfma *g, const struct comm *c);
void gfma_let_close(struct gfma_let *let);
/* After the local upward pass of each set X[s] (Xt layout): complete the spanning windows and
 * fetch the listed summaries, as fma_let_upward. */
void gfma_let_upward(const gfma *g, struct comm *c, float *const *X, int nsets,
                     const gfma_weights *w);
/* Its transpose, as fma_let_upward_backward. */
void gfma_let_upward_backward(const gfma *g, struct comm *c, float *const *dX, int nsets,
                              const gfma_weights *w);

#endif
