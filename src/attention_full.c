/* Exact softmax attention, whole or banded: `full` (SPEC §6.1), softmax(q kᵀ/√d + mask) v, and
 * `local` (SPEC §6.2), the same restricted to a band of keys. Computed tile by tile with an online
 * softmax (running max and sum per query row), so memory is O(n·d) and never O(n²); backward
 * recomputes score tiles from the saved log-sum-exp. The block kernels take the global offsets of
 * their query and key rows, so a ring exchange of key blocks can reuse them. `full` is the exact
 * reference every other variant is measured against. */
#include <cblas.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "attention.h"
#include "error.h"
#include "memory.h"
#include "vecmath.h"

/* Which keys a query may see: j ≤ i when causal; |i − j| < band when band > 0. */
struct key_mask {
  bool causal;
  long band;
};

/* Allowed global keys of query gi: [*lo, *hi], inclusive. */
static inline void key_range(struct key_mask mk, long gi, long *lo, long *hi) {
  *lo = mk.band > 0 ? gi - mk.band + 1 : LONG_MIN / 2;
  *hi = mk.causal ? gi : (mk.band > 0 ? gi + mk.band - 1 : LONG_MAX / 2);
}

/* Columns [c0, c1) of a key tile starting at global key kj0 (bj keys) that query gi may see. */
static inline void tile_columns(struct key_mask mk, long gi, long kj0, long bj, long *c0,
                                long *c1) {
  long lo, hi;
  key_range(mk, gi, &lo, &hi);
  *c0 = lo - kj0 > 0 ? lo - kj0 : 0;
  *c1 = hi - kj0 + 1 < bj ? hi - kj0 + 1 : bj;
  if (*c1 < *c0) *c1 = *c0;
}

/* Local key rows [*j0, *j1) that some query of [gi0, gi1] may see, for keys starting at global
 * koff (Tk of them), rounded out to whole tiles; the allowed ranges move forward with i. */
static inline void live_keys(struct key_mask mk, long gi0, long gi1, long koff, long Tk, int tile,
                             long *j0, long *j1) {
  long lo0, hi0, lo1, hi1;
  key_range(mk, gi0, &lo0, &hi0);
  key_range(mk, gi1, &lo1, &hi1);
  long a = lo0 - koff > 0 ? lo0 - koff : 0, b = hi1 - koff + 1 < Tk ? hi1 - koff + 1 : Tk;
  *j0 = a / tile * tile;
  *j1 = b > *j0 ? b : *j0;
}

/* Online-softmax state of a query slab: m (Tq) running max, l (Tq) running sum, acc (Tq, d). */
struct online_state {
  float *m, *l, *acc;
};

/* Accumulate keys [koff, koff + Tk) into the state of queries [i0, i1) of a slab whose row 0 is
 * global query qoff, for one (b, h). S: (tile, tile) scratch. Dead tiles are skipped. */
static void exact_block_forward(struct online_state st, const float *q, long qoff, const float *k,
                                const float *v, long Tk, long koff, int d, struct key_mask mk,
                                int tile, long i0, long i1, float *S) {
  const float scale = 1.0f / sqrtf((float)d);
  const long bi = i1 - i0;
  long jlo, jhi;
  live_keys(mk, qoff + i0, qoff + i1 - 1, koff, Tk, tile, &jlo, &jhi);
  for (long j0 = jlo; j0 < jhi; j0 += tile) {
    const long bj = Tk - j0 < tile ? Tk - j0 : tile;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)bi, (int)bj, d, scale, q + i0 * d, d,
                k + j0 * d, d, 0.0f, S, (int)bj);
    for (long r = 0; r < bi; r++) {
      float *s = S + r * bj;
      long c0, c1;
      tile_columns(mk, qoff + i0 + r, koff + j0, bj, &c0, &c1);
      float *mrow = st.m + i0 + r, *lrow = st.l + i0 + r, *arow = st.acc + (i0 + r) * d;
      if (c1 == c0) {
        memset(s, 0, sizeof(float) * (size_t)bj);
        continue;
      }
      for (long c = 0; c < c0; c++) s[c] = -INFINITY;
      for (long c = c1; c < bj; c++) s[c] = -INFINITY;
      float mx = *mrow;
      for (long c = c0; c < c1; c++) mx = s[c] > mx ? s[c] : mx;
      const float alpha = expf(*mrow - mx); /* exp(−inf) = 0 on the first live tile */
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (long c = 0; c < bj; c++) {
        s[c] = expf(s[c] - mx);
        sum += s[c];
      }
      *lrow = *lrow * alpha + sum;
      *mrow = mx;
      if (alpha != 1.0f)
        for (int c = 0; c < d; c++) arow[c] *= alpha;
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)bi, d, (int)bj, 1.0f, S, (int)bj,
                v + j0 * d, d, 1.0f, st.acc + i0 * d, d);
  }
}

/* Gradient contributions of keys [koff, koff + Tk) to queries [qoff, qoff + Tq) of one (b, h):
 * dq (Tq, d) += …, dk, dv (Tk, d) += …; lse and D (Tq) as saved and precomputed. */
static void exact_block_backward(float *dq, float *dk, float *dv, const float *dout, const float *q,
                                 const float *lse, const float *D, long Tq, long qoff,
                                 const float *k, const float *v, long Tk, long koff, int d,
                                 struct key_mask mk, int tile, float *S, float *dP) {
  const float scale = 1.0f / sqrtf((float)d);
  for (long i0 = 0; i0 < Tq; i0 += tile) {
    const long bi = Tq - i0 < tile ? Tq - i0 : tile;
    long jlo, jhi;
    live_keys(mk, qoff + i0, qoff + i0 + bi - 1, koff, Tk, tile, &jlo, &jhi);
    for (long j0 = jlo; j0 < jhi; j0 += tile) {
      const long bj = Tk - j0 < tile ? Tk - j0 : tile;
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)bi, (int)bj, d, scale, q + i0 * d,
                  d, k + j0 * d, d, 0.0f, S, (int)bj);
      for (long r = 0; r < bi; r++) {
        float *s = S + r * bj;
        const float L = lse[i0 + r];
        long c0, c1;
        tile_columns(mk, qoff + i0 + r, koff + j0, bj, &c0, &c1);
#pragma omp simd
        for (long c = 0; c < bj; c++) s[c] = expf(s[c] - L);
        for (long c = 0; c < c0; c++) s[c] = 0.0f;
        for (long c = c1; c < bj; c++) s[c] = 0.0f;
      }
      /* dv_j += Pᵀ dO_i */
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)bj, d, (int)bi, 1.0f, S, (int)bj,
                  dout + i0 * d, d, 1.0f, dv + j0 * d, d);
      /* dP = dO_i v_jᵀ */
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)bi, (int)bj, d, 1.0f, dout + i0 * d,
                  d, v + j0 * d, d, 0.0f, dP, (int)bj);
      /* dS = P ∘ (dP − D_i), stored in dP */
      for (long r = 0; r < bi; r++) {
        const float Di = D[i0 + r];
        const float *p = S + r * bj;
        float *g = dP + r * bj;
#pragma omp simd
        for (long c = 0; c < bj; c++) g[c] = p[c] * (g[c] - Di);
      }
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)bi, d, (int)bj, scale, dP,
                  (int)bj, k + j0 * d, d, 1.0f, dq + i0 * d, d);
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)bj, d, (int)bi, scale, dP, (int)bj,
                  q + i0 * d, d, 1.0f, dk + j0 * d, d);
    }
  }
}

/* ---------------------------------------------------------------------------------------------
 * the two variants */

extern const struct attn_variant attention_local;

static struct key_mask mask_of(const struct attn_ctx *ctx) {
  struct key_mask mk = {ctx->dims.causal, 0};
  if (ctx->variant == &attention_local) mk.band = ctx->cfg->attention.local_band;
  return mk;
}

static const char *exact_check(const struct config *cfg, long n, int seq_ranks, char *buf,
                               size_t len) {
  if (seq_ranks > 1) {
    snprintf(buf, len,
             "attention.variant = %s with parallel.seq_ranks = %d: sequence parallelism is not "
             "implemented yet (use parallel.seq_ranks = 1)",
             cfg->attention.variant, seq_ranks);
    return buf;
  }
  return NULL;
}

static int exact_tile(const struct attn_ctx *ctx) { return ctx->cfg->attention.full_block; }

static size_t exact_saved_floats(const struct attn_ctx *ctx) {
  return (size_t)(ctx->dims.B * ctx->dims.H * ctx->dims.T); /* log-sum-exp per query row */
}

static void exact_forward(struct attn_ctx *ctx, float *out, float *saved, const float *q,
                          const float *k, const float *v, const float *params) {
  const struct attn_dims *dm = &ctx->dims;
  const long T = dm->T, BH = dm->B * dm->H;
  const int d = (int)dm->d, tile = exact_tile(ctx);
  const long ntiles = (T + tile - 1) / tile;
  const struct key_mask mk = mask_of(ctx);
  float *lse = saved;                                                         /* (B, H, T) */
  float *ml = mem_alloc(MEM_WORKSPACE, sizeof(float) * 2 * (size_t)(BH * T)); /* m, l */
#pragma omp parallel
  {
    float *S = mem_alloc(MEM_WORKSPACE, sizeof(float) * (size_t)tile * tile);
#pragma omp for schedule(dynamic, 1) collapse(2)
    for (long bh = 0; bh < BH; bh++)
      for (long it = 0; it < ntiles; it++) {
        const long i0 = it * tile, i1 = i0 + tile < T ? i0 + tile : T;
        const size_t off = (size_t)bh * T * d;
        struct online_state st = {ml + bh * T, ml + BH * T + bh * T, out + off};
        for (long i = i0; i < i1; i++) {
          st.m[i] = -INFINITY;
          st.l[i] = 0.0f;
        }
        memset(out + off + i0 * d, 0, sizeof(float) * (size_t)((i1 - i0) * d));
        exact_block_forward(st, q + off, dm->t0, k + off, v + off, T, dm->t0, d, mk, tile, i0, i1,
                            S);
        for (long i = i0; i < i1; i++) {
          const float inv = 1.0f / st.l[i];
          for (int c = 0; c < d; c++) st.acc[i * d + c] *= inv;
          lse[bh * T + i] = st.m[i] + logf(st.l[i]);
        }
      }
    mem_free(S);
  }
  mem_free(ml);
}

static void exact_backward(struct attn_ctx *ctx, float *dq, float *dk, float *dv, float *dparams,
                           const float *dout, const float *q, const float *k, const float *v,
                           const float *params, const float *out, const float *saved) {
  const struct attn_dims *dm = &ctx->dims;
  const long T = dm->T, BH = dm->B * dm->H;
  const int d = (int)dm->d, tile = exact_tile(ctx);
  const struct key_mask mk = mask_of(ctx);
  const float *lse = saved;
  float *D = mem_alloc(MEM_WORKSPACE, sizeof(float) * (size_t)(BH * T));
#pragma omp parallel for schedule(static)
  for (long r = 0; r < BH * T; r++) {
    float s = 0.0f;
    for (int c = 0; c < d; c++) s += dout[r * d + c] * out[r * d + c];
    D[r] = s;
  }
#pragma omp parallel
  {
    float *S = mem_alloc(MEM_WORKSPACE, sizeof(float) * 2 * (size_t)tile * tile);
#pragma omp for schedule(dynamic, 1)
    for (long bh = 0; bh < BH; bh++) {
      const size_t off = (size_t)bh * T * d;
      exact_block_backward(dq + off, dk + off, dv + off, dout + off, q + off, lse + bh * T,
                           D + bh * T, T, dm->t0, k + off, v + off, T, dm->t0, d, mk, tile, S,
                           S + (size_t)tile * tile);
    }
    mem_free(S);
  }
  mem_free(D);
}

static bool exact_allowed(const struct attn_ctx *ctx, long i, long j) {
  long lo, hi;
  key_range(mask_of(ctx), i, &lo, &hi);
  return j >= lo && j <= hi;
}

static long exact_diagnostics(struct attn_ctx *ctx, double *mass, double *entropy, const float *q,
                              const float *k, const float *v, const float *params) {
  return attention_diag_rows(ctx, mass, entropy, q, k, 256, exact_allowed);
}

/* Forward FLOPs: 4·d per allowed (query, key) pair (scores and values), over the local share. */
static double exact_flops(const struct attn_ctx *ctx, double *p2p_flops) {
  const struct attn_dims *dm = &ctx->dims;
  const struct key_mask mk = mask_of(ctx);
  const double n = (double)dm->n;
  double pairs;
  if (mk.band <= 0) {
    pairs = dm->causal ? 0.5 * n * (n + 1) : n * n;
  } else {
    const double b = mk.band < dm->n ? (double)mk.band : n; /* keys per query, less the edges */
    pairs = dm->causal ? n * b - 0.5 * b * (b - 1) : n * (2 * b - 1) - b * (b - 1);
  }
  *p2p_flops = 0.0;
  return 4.0 * pairs * (double)dm->d * (double)(dm->B * dm->H) * ((double)dm->T / n);
}

const struct attn_variant attention_full = {
    .name = "full",
    .causal_ok = true,
    .bidir_ok = true,
    .check = exact_check,
    .saved_floats = exact_saved_floats,
    .forward = exact_forward,
    .backward = exact_backward,
    .diagnostics = exact_diagnostics,
    .flops = exact_flops,
};

const struct attn_variant attention_local = {
    .name = "local",
    .causal_ok = true,
    .bidir_ok = true,
    .check = exact_check,
    .saved_floats = exact_saved_floats,
    .forward = exact_forward,
    .backward = exact_backward,
    .diagnostics = exact_diagnostics,
    .flops = exact_flops,
};
