/* The interface of Fast Multipole Attention's machinery (SPEC §6.4–6.5): the state (state.c), the
 * summary parameters (params.c), the upward pass P2M/M2M (upward.c), evaluation P2P/M2P
 * (evaluate.c), decoding (decode.c); the LET is let.h. It takes struct fma_options and plain
 * sizes, never the deck: the ops tables that drive it are attention/fma.c. Which keys a query
 * sees is decided in fma/lists.c only. */
#ifndef FMATTN_FMA_H
#define FMATTN_FMA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "fma/lists.h"
#include "fma/options.h"
#include "fma/tree.h"
#include "nn/params.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Per-thread timings of the operators, in seconds. */
struct fma_times {
  double p2p, m2p, p2m, m2m;
};

/* Summary sets: the coarse keys, values and (fma_linear) queries each have their own weights. */
enum fma_set { FMA_K = 0, FMA_V = 1, FMA_Q = 2, FMA_NSETS = 3 };

/* Where each summary tensor lives in the variant's parameter block (floats), and the length of
 * its last axis (the taps one summary reads): conv and avg level l: w_l; m2m level 1: m, level
 * l ≥ 2: 2p. avg has no tensors: weight and bias stay 0. */
struct fma_layout {
  size_t weight[FMA_NSETS][FMA_MAX_LEVELS + 1];
  size_t bias[FMA_NSETS][FMA_MAX_LEVELS + 1];
  long span[FMA_MAX_LEVELS + 1];
  size_t total; /* floats of the block, padding included */
};

struct fma_let;
struct fma_open_work;

/* fma.open's layout (SPEC §6.4a): how many windows a query opens at most at each level, where its
 * decisions go, and its far row — the columns of its scores beyond the near field: the summary
 * rows its block lists (fma_block_keys order, padded with −inf to `listed`), then one slot per
 * window it may open: level l ≥ 2 a slot of 2p columns (the opened window's two children's
 * summary rows), level 1 a slot of m columns (the opened fine block's exact tokens). */
struct fma_open_layout {
  int K;                              /* fma.open; FMA_OPEN_ALL: every candidate */
  int slots[FMA_MAX_LEVELS + 2];      /* K_l: windows a query opens at most at level l */
  int dec_off[FMA_MAX_LEVELS + 2];    /* first decision entry of level l in a query's decisions */
  int ndec;                           /* Σ_l K_l: decision entries per query */
  int slot_width[FMA_MAX_LEVELS + 2]; /* 2p for l ≥ 2, m for l = 1 */
  long col[FMA_MAX_LEVELS + 2];       /* first far-row column of level l's slots */
  long listed;                        /* far-row columns of the listed summary rows */
  long width;                         /* far-row columns in all */
};

/* Everything the operators read about one layer on this rank: the tree, the settings they depend
 * on, the slab, and the layout of the summary rows and of the parameters. Built by
 * fma_state_create from options and plain sizes, so any implementation builds the same one. */
struct fma_state {
  struct fma_tree tree;
  enum fma_downsample down;
  bool causal, linear, multiplicity;
  int d;
  long t0, T; /* this rank's slab of queries and tokens: [t0, t0 + T) (the whole sequence: 0, n) */
  long klo;   /* global index of row 0 of the key/value arrays evaluate reads (slab or halo) */
  struct fma_let *let; /* the locally essential tree under sequence parallelism, else NULL */
  /* The summary rows per (batch, head): level by level, the windows [win_lo[l], win_hi[l]) of
   * each (every window, or — fma_state_compact — those this rank touches), p rows each. Window c
   * of level l starts at row level_row[l] + c·p for c in that range, so a compact level's
   * level_row lies before its first row; level_row[L + 1] = rows. */
  long rows;
  long level_row[FMA_MAX_LEVELS + 2];
  long win_lo[FMA_MAX_LEVELS + 1], win_hi[FMA_MAX_LEVELS + 1];
  struct fma_layout layout;
  struct fma_open_layout open; /* open.K == 0: the paper's fma, no opening */
  /* Balanced causal work (fma/balance.c): the blocks of the slab from far_cut on evaluate the far
   * field of levels up to far_top here, a helper rank the rest. LONG_MAX: every level here. */
  long far_cut;
  int far_top;
  struct fma_open_work *work; /* the opening pass's buffers, kept between calls (open.c) */
};

/* ---- state.c ---- */

/* The state of one layer: sequence length n, head size d, causal (clm) or not, fma_linear
 * (linear) or fma, this rank's slab [t0, t0 + T) (klo = t0 until the LET sets a halo). The LET
 * is planned later, by the driver, when there is a sequence group. fma_state_free frees both. */
struct fma_state *fma_state_create(const struct fma_options *opt, long n, long d, bool causal,
                                   bool linear, long t0, long T);
void fma_state_free(struct fma_state *st);
/* The first level whose windows span ranks (w_l > T); levels + 1 when none does. */
int fma_spanning_level(const struct fma_state *st);
/* Whether every rank holds every window of level l once the spanning levels are complete (see
 * fma_let_holds): the spanning levels, and for m2m the level below them (every rank's top). */
bool fma_level_everywhere(const struct fma_state *st, int l);
/* Windows [*lo, *hi) of level l that the rank whose slab starts at t0 (of length st->T) touches:
 * every window where fma_level_everywhere, else its slab's windows and those its interaction
 * lists (and fma_linear's query rows) name. Computed from lists.c in O(T/w_l). */
void fma_touched_windows(const struct fma_state *st, long t0, int l, long *lo, long *hi);
/* Index the summary rows by the windows this rank touches (O(n/S + S) rows, not O(n)): every
 * level's [win_lo, win_hi) becomes fma_touched_windows'. The identity on one rank. The layout of
 * the paper's fma, fma_linear and their CPU operators; fma.open and the GPU keep every window. */
void fma_state_compact(struct fma_state *st);

/* ---- params.c: the summary parameters ---- */

/* Describe one layer's summary tensors (names relative to attn/<variant>/, shapes, lr scale) for
 * sequence length n and head size d; fma_linear (linear) adds q_down. avg adds none. */
void fma_params_describe(const struct fma_options *opt, long n, long d, bool linear,
                         struct param_list *list);
/* Where fma_params_describe puts each tensor in the variant's block, and each level's span. */
void fma_params_layout(const struct fma_options *opt, long n, long d, bool linear,
                       struct fma_layout *layout);
/* Initialise one described tensor p (its name relative to attn/<variant>/): the mean
 * (avg-equivalent) or random (from seed) init; for fma_linear (linear) with
 * opt->linear_zero_values, the value summaries' token-reading weights and biases start at 0. */
void fma_params_init(const struct fma_options *opt, uint64_t seed, bool linear,
                     const struct param_desc *p, float *data);

/* Summary weights of one set, transposed for channel-contiguous loops:
 * wt[level] (p, span, d) = weight[f][r][t] at wt[(r·span + t)·d + f], bt[level] (p, d). In causal
 * fma_linear the q_down taps a row may not read are 0 here (params.c, query_tap_used). */
struct fma_down_weights {
  float *wt[FMA_MAX_LEVELS + 1];
  float *bt[FMA_MAX_LEVELS + 1];
};
/* Allocate w and fill it from this layer's parameter block (params NULL: zeros). avg: none. */
void fma_weights_load(const struct fma_state *st, const float *params, enum fma_set set,
                      struct fma_down_weights *w);
/* dparams += the transposed gradients in dw (same layout as w). */
void fma_weights_store_grad(const struct fma_state *st, float *dparams, enum fma_set set,
                            const struct fma_down_weights *dw);
void fma_weights_free(const struct fma_state *st, struct fma_down_weights *w);
/* Allocate w, zeroed (a gradient accumulator). */
void fma_weights_zero(const struct fma_state *st, struct fma_down_weights *w);

/* ---- upward.c: P2M, M2M, the upward pass and its transpose ---- */

/* Windows [*c0, *c1) of level l this rank computes: those inside its slab, or the one spanning
 * window that contains it. */
void fma_slab_windows(const struct fma_state *st, int l, long *c0, long *c1);
/* Windows [*c0, *c1) of level l whose parameter gradients this rank forms: fma_slab_windows',
 * except an m2m level whose windows span ranks: every window (each rank holds its part of every
 * one's gradient, fma_let_upward_backward). */
void fma_grad_windows(const struct fma_state *st, int l, long *c0, long *c1);
/* M2M for one parent window c of level l, in X (rows, d), and its transpose in dX (rows, d):
 * the children's rows j in [j0, j1) (both children: 0, 2p) += from the parent's. */
void fma_M2M_window(const struct fma_state *st, int l, long c, float *X,
                    const struct fma_down_weights *w);
void fma_M2M_window_backward(const struct fma_state *st, int l, long c, float *dX, long j0, long j1,
                             const struct fma_down_weights *w);

/* Upward pass of one head over this rank's slab: summaries X (rows, d), indexed by global window,
 * from the slab's tokens x (T, d). P2M makes level 1 from tokens (every level, for conv and avg;
 * for a window spanning ranks, the slab's share of its sums); M2M makes level l + 1 from level l
 * (m2m, up to the first level whose windows span ranks: fma_let completes those). */
void fma_upward_pass(const struct fma_state *st, float *X, const float *x,
                     const struct fma_down_weights *w, struct fma_times *times);
/* Its transpose, one head over this rank's slab: dx (T, d) += the contribution of dX (rows, d),
 * which is consumed — for m2m, coarser levels are pushed into finer ones in place (M2M backward,
 * coarse to fine; windows that span ranks are fma_let_upward_backward's), then P2M backward.
 * Parameter gradients are NOT formed here. */
void fma_upward_pass_backward(const struct fma_state *st, float *dx, float *dX,
                              const struct fma_down_weights *w, struct fma_times *times);
/* dw += the gradients of the P2M and M2M weights and biases, summed over `count` heads in a fixed
 * order, over this rank's windows (fma_grad_windows): x, X, dX (after fma_upward_pass_backward) of
 * head h at x + h·T·d, X + h·rows·d, dX + h·rows·d. */
void fma_upward_param_grads(const struct fma_state *st, struct fma_down_weights *dw, const float *x,
                            const float *X, const float *dX, long count);

/* ---- evaluate.c: P2P and M2P ---- */

/* Near and far keys of one query block, as evaluate needs them. */
struct fma_block_keys {
  long near_lo, near_count; /* near keys: global rows [near_lo, near_lo + near_count) */
  int nfar;                 /* listed summary rows */
  long *far_row;            /* (nfar) row of each in the summary arrays */
  float *far_logw;          /* (nfar) log(w_l / p) or 0 */
  int *far_level;           /* (nfar) level of each */
  /* the listed windows level by level: level l's k-th is level_window[l][k], its p rows the far
   * columns [level_col[l] + k·p, + p) */
  int level_count[FMA_MAX_LEVELS + 1];
  long level_window[FMA_MAX_LEVELS + 1][FMA_LIST_MAX];
  int level_col[FMA_MAX_LEVELS + 1];
};
/* Fill the lists of query block qb (the caller's far arrays hold FMA_LIST_MAX·p·L rows). */
void fma_block_keys(const struct fma_state *st, long qb, struct fma_block_keys *bk);
/* The same with the far field of levels [lo, hi] only (the others list nothing). */
void fma_block_keys_levels(const struct fma_state *st, long qb, int lo, int hi,
                           struct fma_block_keys *bk);

/* The operators on one query block qb (queries i0 = qb·m .. i0 + m − 1), for evaluate and for the
 * opening's evaluation (evaluate_open.c). q, dq from slab row i0 − t0; k, v, dk, dv from global row
 * st->klo. Score rows have leading dimension ld; the near part S (m, nn) and the far part Sf
 * (m, nf) — the listed summaries, gathered into Kf, Vf (nf, d) — may live in different arrays. */
/* P2P scores: S[:, 0:nn) = q·k_nearᵀ/√d, the near field exact; keys after i masked (−inf). */
void fma_P2P_scores(const struct fma_state *st, long qb, const float *q, const float *k,
                    const struct fma_block_keys *bk, float *S, long ld);
/* M2P scores: Sf (m, nf) = q·Kfᵀ/√d + log(w_l/p). */
void fma_M2P_scores(const struct fma_state *st, long qb, const float *q, const float *Kf,
                    const struct fma_block_keys *bk, float *Sf, long ld);
/* P2P values: o (m, d) = P[:, 0:nn)·v_near (o overwritten). */
void fma_P2P_values(const struct fma_state *st, float *o, const float *P, long ld, const float *v,
                    const struct fma_block_keys *bk);
/* M2P values: o (m, d) += Pf·Vf. */
void fma_M2P_values(const struct fma_state *st, float *o, const float *Pf, long ld, const float *Vf,
                    const struct fma_block_keys *bk);
/* The transpose of fma_P2P_values for dO = g (m, d): dv_near += P_nᵀ·g; dP[:, 0:nn) = g·v_nearᵀ. */
void fma_P2P_values_backward(const struct fma_state *st, float *dv, float *dP, const float *g,
                             const float *P, long ld, const float *v,
                             const struct fma_block_keys *bk);
/* The transpose of fma_M2P_values: dV += Pfᵀ·g at the listed rows (through dVf (nf, d));
 * dPf (leading dimension ldd) = g·Vfᵀ. */
void fma_M2P_values_backward(const struct fma_state *st, float *dV, float *dPf, long ldd,
                             const float *g, const float *Pf, long ld, const float *Vf, float *dVf,
                             const struct fma_block_keys *bk);
/* The transpose of fma_P2P_scores for the score gradient dS (m, ld): dq (m, d) += dS_n·k_near/√d;
 * dk_near += dS_nᵀ·q/√d. */
void fma_P2P_scores_backward(const struct fma_state *st, long qb, float *dq, float *dk,
                             const float *dS, long ld, const float *q, const float *k,
                             const struct fma_block_keys *bk);
/* The transpose of fma_M2P_scores: dq += dSf·Kf/√d; dK += dSfᵀ·q/√d at the listed rows (through
 * dKf (nf, d)). */
void fma_M2P_scores_backward(const struct fma_state *st, long qb, float *dq, float *dK,
                             const float *dSf, long ld, const float *q, const float *Kf, float *dKf,
                             const struct fma_block_keys *bk);
/* dst[rows[i]] += src[i] for count rows of d floats. */
void fma_scatter_add_rows(float *dst, const float *src, const long *rows, int count, long d);

/* fma evaluation of one head (SPEC §6.4) for query blocks [qb0, qb1) of the slab: q, out (T, d)
 * and lse (T) saved, from slab row 0; k, v from global row st->klo; K, V: summaries (rows, d).
 * mass (may be NULL; then entropy is not touched): mass (L + 1) per band and entropy, summed over
 * the blocks' queries. */
void fma_evaluate_forward(const struct fma_state *st, float *out, float *lse, const float *q,
                          const float *k, const float *v, const float *K, const float *V, long qb0,
                          long qb1, struct fma_times *times, double *mass, double *entropy);
/* The same in two phases, so that the summaries may arrive between them (the LET's overlap,
 * SPEC §7): the near field (P2P) under its own softmax, which leaves out and lse the near part's;
 * then the far field (M2P), merged into one softmax over both. Equal to fma_evaluate_forward up to
 * rounding. */
void fma_evaluate_near_forward(const struct fma_state *st, float *out, float *lse, const float *q,
                               const float *k, const float *v, long qb0, long qb1,
                               struct fma_times *times);
void fma_evaluate_far_forward(const struct fma_state *st, float *out, float *lse, const float *q,
                              const float *K, const float *V, long qb0, long qb1,
                              struct fma_times *times);
/* The transpose, every query block of the slab, near then far: dq (T, d), dk, dv (from row
 * st->klo) and dK, dV (rows, d) += the gradients of one head for dout (T, d); D (T) holds
 * Σ_c dout·out per row; lse as forward saved. The near phase reads no summary. */
void fma_evaluate_near_backward(const struct fma_state *st, float *dq, float *dk, float *dv,
                                const float *dout, const float *D, const float *q, const float *k,
                                const float *v, const float *lse, struct fma_times *times);
void fma_evaluate_far_backward(const struct fma_state *st, float *dq, float *dK, float *dV,
                               const float *dout, const float *D, const float *q, const float *K,
                               const float *V, const float *lse, struct fma_times *times);
/* The far field of levels [lo, levels] for nb query blocks of another rank (qb: their global
 * indices), one head: block i's queries (m, d) at q + i·qstride; its part of the softmax (o
 * (m, d) normalised over these columns, and their log-sum-exp (m), −inf when it lists none) at
 * o + i·ostride and lse + i·ostride. Its transpose: block i's queries, dout (m, d), D and the
 * whole softmax's lse (m each) in that order at in + i·stride; dK, dV (rows, d) += the listed
 * summaries' gradients; dq (m, d) of block i written at dq + i·dqstride. */
void fma_evaluate_far_part(const struct fma_state *st, int lo, const long *qb, long nb,
                           const float *q, long qstride, const float *K, const float *V, float *o,
                           float *lse, long ostride, struct fma_times *times);
void fma_evaluate_far_part_backward(const struct fma_state *st, int lo, const long *qb, long nb,
                                    const float *in, long stride, const float *K, const float *V,
                                    float *dK, float *dV, float *dq, long dqstride,
                                    struct fma_times *times);

/* fma_linear (SPEC §6.5), one head over the slab (arrays as fma_evaluate_forward's): the near
 * field with its own softmax, then each level's sub-segment query summaries Q attending to the
 * level's list with their own softmax. lse_near (T); lse_far (rows): that of sub-segment rho of
 * level l at level_row[l] + rho.
 * band_norms (may be NULL; then entropy is not touched): (T, L + 1) the L1 norm of each band's
 * contribution to each query's output (the bands are normalised apart, so this — not a
 * probability — is what their shares mean); entropy: the near-field softmax's, summed. */
void fma_linear_forward(const struct fma_state *st, float *out, float *lse_near, float *lse_far,
                        const float *q, const float *k, const float *v, const float *Q,
                        const float *K, const float *V, struct fma_times *times, float *band_norms,
                        double *entropy);
/* dq, dk, dv, dQ, dK, dV += the gradients of one head for dout; out is not read. */
void fma_linear_backward(const struct fma_state *st, float *dq, float *dk, float *dv, float *dQ,
                         float *dK, float *dV, const float *dout, const float *out, const float *q,
                         const float *k, const float *v, const float *Q, const float *K,
                         const float *V, const float *lse_near, const float *lse_far,
                         struct fma_times *times);

/* The query-summary row (within its level) whose level-l term the queries of sub-segment rho of
 * level l receive: rho bidirectional, rho − 1 causal (the sub-segment before theirs, so that no
 * later query leaks in); −1: none. */
long fma_linear_query_row(const struct fma_state *st, long rho);

/* ---- decode.c ---- */

/* Incremental decoding of causal fma for generation: a cache of one sequence's last 2m keys and
 * values and of every level's summaries, kept up to date token by token; each step adds position
 * pos's key and value (k, v (H, d)) and writes out (H, d) of its query q (H, d). st must outlive
 * the decoder. */
struct fma_decoder;
struct fma_decoder *fma_decode_open(struct fma_state *st, const float *params, long H);
void fma_decode_step(struct fma_decoder *dec, float *out, const float *q, const float *k,
                     const float *v, long pos);
void fma_decode_close(struct fma_decoder *dec);

#ifdef __cplusplus
}
#endif

#endif
