/* fma's content-based opening (SPEC §6.4a, `fma.open`): the opening pass and the evaluation that
 * uses its decisions, for one group of heads at a time. open.c holds the opening criterion and the
 * traversal (coarse to fine, the decisions, the per-source lists of who opened what, the scores of
 * opened windows); evaluate_open.c the softmax over near field, listed summaries and opened
 * windows; open_let.c what other ranks must send when a query opens a window it does not hold. */
#ifndef FMATTN_FMA_OPEN_H
#define FMATTN_FMA_OPEN_H

#include <stdint.h>
#include <string.h>

#include "fma/fma.h"
#include "parallel/comm.h"

#ifdef _OPENMP
#include <omp.h>
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Eight floats as one value (GCC and clang vector extensions: a SIMD register where there is one,
 * plain code elsewhere); loads and stores through memcpy, so any alignment will do. */
typedef float fma_open_v8 __attribute__((vector_size(32)));
static inline fma_open_v8 fma_open_load8(const float *p) {
  fma_open_v8 v;
  memcpy(&v, p, sizeof v);
  return v;
}

/* The sum of eight partial sums, in one fixed order. */
static inline float fma_open_lanes(fma_open_v8 a) {
  return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

/* out[t] = x·R_t for the nr rows R_t (d each, contiguous) — the dot products of the opening (a
 * window's summary rows, its children's, a fine block's keys). Every one is summed the same way,
 * whatever nr and wherever the rows come from: eight partial sums over f mod 8, then
 * fma_open_lanes (a tail of d mod 8 is added into the first partial sums); four rows at a time,
 * so that x is loaded once for four. Equal rows give bit-equal results, and a query's result
 * never depends on what else is computed beside it (as a GEMM's rounding can). */
static inline void fma_open_dots(const float *x, const float *R, long nr, long d, float *out) {
  const long body = d - d % 8;
  long t = 0;
  for (; t + 4 <= nr; t += 4) {
    const float *r0 = R + t * d, *r1 = r0 + d, *r2 = r1 + d, *r3 = r2 + d;
    fma_open_v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    for (long f = 0; f < body; f += 8) {
      const fma_open_v8 xv = fma_open_load8(x + f);
      a0 += xv * fma_open_load8(r0 + f);
      a1 += xv * fma_open_load8(r1 + f);
      a2 += xv * fma_open_load8(r2 + f);
      a3 += xv * fma_open_load8(r3 + f);
    }
    for (long f = body; f < d; f++) {
      a0[f - body] += x[f] * r0[f];
      a1[f - body] += x[f] * r1[f];
      a2[f - body] += x[f] * r2[f];
      a3[f - body] += x[f] * r3[f];
    }
    out[t] = fma_open_lanes(a0);
    out[t + 1] = fma_open_lanes(a1);
    out[t + 2] = fma_open_lanes(a2);
    out[t + 3] = fma_open_lanes(a3);
  }
  for (; t < nr; t++) { /* the same sums, one row at a time */
    const float *r0 = R + t * d;
    fma_open_v8 a0 = {0};
    for (long f = 0; f < body; f += 8) a0 += fma_open_load8(x + f) * fma_open_load8(r0 + f);
    for (long f = body; f < d; f++) a0[f - body] += x[f] * r0[f];
    out[t] = fma_open_lanes(a0);
  }
}

/* What the opening pass and its evaluation read and write for `count` heads (each array from the
 * group's first head; per head: q (T, d), k and v (kstride, d) from global row st->klo, K and V
 * summaries (rows, d), decisions dec (T, ndec): the window opened at level l in entry
 * dec_off[l] + j, or −1). */
struct fma_open_args {
  long count;
  const float *q, *k, *v;
  float *K, *V; /* rows fetched from other ranks are written in place */
  long kstride;
  int32_t *dec;
  struct comm *comm; /* the sequence group (S > 1), or NULL */
};

/* Gradients that the backward accumulates into, laid out as the inputs (dk, dv as k, v). */
struct fma_open_grads {
  float *dq, *dk, *dv, *dK, *dV;
};

/* Diagnostics of the opening, summed over the queries of one head (each may be NULL): the
 * probability on opened exact tokens, and windows opened per level (L + 1 entries, [0] unused). */
struct fma_open_diag {
  double *open_mass;
  double *opened;
};

/* Most summary rows per window (fma.p) the opening supports: the criterion scores a window's rows
 * on the stack. */
#define FMA_OPEN_SCORE_ROWS 4096

/* The calling thread's index among OpenMP's (its scratch). */
static inline int fma_open_thread(void) {
#ifdef _OPENMP
  return omp_get_thread_num();
#else
  return 0;
#endif
}

/* Members of a source are processed in query order but lie scattered: their rows are prefetched
 * this many members ahead. */
#define FMA_OPEN_AHEAD 8

/* Members of one group GEMM: at most this many queries share one product with a source. */
#define FMA_OPEN_GROUP 128

/* One thread's scratch: a query block's lists and score rows, and a group's gathered rows. */
struct fma_open_scratch {
  struct fma_block_keys bk;
  float *S, *dP;              /* (m, 3m + listed): near scores, score gradients */
  float *Kf, *Vf, *dKf, *dVf; /* (listed, d) the block's listed summary rows */
  float *Qg, *Og;             /* (FMA_OPEN_GROUP, d) gathered query or output rows */
  float *Sg, *Pg;             /* (FMA_OPEN_GROUP, m) gathered score rows */
  float *cand_g;              /* (candidates) the criterion's scores */
  long *cand_c;               /* (candidates) and windows */
  const float **cand_rows;    /* (candidates) and their far-row scores */
};

struct fma_open_fetch; /* open_let.c: what was fetched from other ranks */

/* The traversal's buffers for this layer, sized at first use for `count` heads and kept, so a
 * training step allocates nothing: far rows F, slot gradients G, the per-source lists, each
 * thread's scratch and, under sequence parallelism, what was fetched from other ranks. */
struct fma_open_work {
  long count;   /* heads the buffers hold */
  float *F;     /* (count, T, width) far rows: scores, then probabilities */
  float *G;     /* (count, T, width − listed) slot score gradients (backward) */
  int32_t *dec; /* (count, T, ndec) decisions when the caller keeps none */
  long lvl_start[FMA_MAX_LEVELS + 2]; /* first entry of level l in a head's start (per window) */
  long starts;                        /* start entries per head: Σ_l (windows_l + 1) */
  int32_t *start;      /* (count, starts): level l window c's members [start[c], start[c+1]) */
  int32_t *who, *slot; /* (count, T·ndec): a member's query (slab row) and slot; level l's
                          members from T·dec_off[l] */
  int threads;
  struct fma_open_scratch *scratch; /* (threads) */
  struct fma_open_fetch *fetch;     /* NULL until a sequence group fetches */
};
struct fma_open_work *fma_open_work_get(struct fma_state *st, long count);
void fma_open_work_free(struct fma_open_work *w);
void fma_open_fetch_free(struct fma_open_fetch *f);

/* The opening pass (forward): far rows of every query (listed summaries, then opened windows'
 * rows and tokens) into the work's F, the decisions into a->dec, level by level from the
 * coarsest, fetching what other ranks hold (open_let.c) as the descent needs it. */
void fma_open_descend(const struct fma_state *st, struct fma_open_work *w,
                      const struct fma_open_args *a, struct fma_times *times);
/* The far rows again from the decisions a->dec (backward; under sequence parallelism, fetching
 * again every window and token the decisions name). */
void fma_open_rescore(const struct fma_state *st, struct fma_open_work *w,
                      const struct fma_open_args *a, struct fma_times *times);

/* The criterion for one query at level l: its lists bk, its far row F scored down to level l
 * (listed rows, and the children of what it opened at l + 1), its query qi (d), its head's key
 * summaries K (rows, d), its decisions dec (ndec) holding levels > l; writes level l's. */
void fma_open_select(const struct fma_state *st, int l, const struct fma_block_keys *bk,
                     const float *F, const float *qi, const float *K, int32_t *dec);

/* −inf over the rows of every window a query opened (decisions dec, its block's lists bk): a
 * listed one's p columns of its far row F, or the half of its parent's slot that held it. The far
 * row then has each allowed key exactly once. */
void fma_open_mask(const struct fma_state *st, const struct fma_block_keys *bk, float *F,
                   const int32_t *dec);

/* Evaluation with the decisions (evaluate_open.c), after fma_open_descend or fma_open_rescore:
 * forward writes out (count, T, d) and lse (count, T); diag (may be NULL) per head; mass (count,
 * L + 1) and entropy (count) as fma_evaluate_forward's, when not NULL. */
void fma_open_forward(const struct fma_state *st, struct fma_open_work *w,
                      const struct fma_open_args *a, float *out, float *lse,
                      struct fma_times *times, double *mass, double *entropy,
                      const struct fma_open_diag *diag);
/* Backward: g += the gradients for dout (count, T, d), D (count, T) = Σ dout·out per row. */
void fma_open_backward(const struct fma_state *st, struct fma_open_work *w,
                       const struct fma_open_args *a, const struct fma_open_grads *g,
                       const float *dout, const float *D, const float *lse,
                       struct fma_times *times);

/* The rows of the source of a level-l slot, window c of head h: its two children's 2p summary
 * rows at level l − 1 (keys K, or values V when values), or fine block c's m tokens (level 1). */
const float *fma_open_source_rows(const struct fma_state *st, const struct fma_open_work *w,
                                  const struct fma_open_args *a, long h, int l, long c,
                                  bool values);

/* ---- open_let.c: what other ranks hold ---- */

/* Bring the level l − 1 rows (K and V) of both children of every window opened at level l ≥ 2
 * that this rank lacks, from their owners, into a->K, a->V (request and reply, deduplicated). */
void fma_open_let_children(const struct fma_state *st, struct fma_open_work *w,
                           const struct fma_open_args *a, int l);
/* Bring the exact keys and values of every opened fine block outside [klo, klo + kstride). */
void fma_open_let_tokens(const struct fma_state *st, struct fma_open_work *w,
                         const struct fma_open_args *a);
/* Backward: return the gradients of every fetched summary row and token to its owner, added there
 * (g's arrays laid out as a's: dK, dV as the summaries, dk, dv as k, v). */
void fma_open_let_return(const struct fma_state *st, struct fma_open_work *w,
                         const struct fma_open_args *a, const struct fma_open_grads *g);
/* Key and value rows of fine block c of head h (local or fetched), and where their gradients go
 * (dk, dv as a's k, v, or the fetched block's gradient rows); dk, dv may be NULL. */
void fma_open_block_rows(const struct fma_state *st, const struct fma_open_work *w,
                         const struct fma_open_args *a, long h, long c, const float **k,
                         const float **v, float *dk, float *dv, float **dk_out, float **dv_out);

#ifdef __cplusplus
}
#endif

#endif
