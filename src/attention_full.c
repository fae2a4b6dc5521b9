/* `full` attention (SPEC §6.1): exact softmax(q kᵀ/√d + mask) v, computed tile by tile with an
 * online softmax (running max and sum per query row), so memory is O(n·d) and never O(n²); the
 * backward recomputes score tiles from the saved log-sum-exp. The block kernels take the global
 * offsets of their query and key rows, so the ring exchange of the distributed path reuses them.
 * This is the exact reference every other variant is measured against. */
#include <cblas.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "attention.h"
#include "error.h"
#include "memory.h"
#include "vecmath.h"

#ifdef _OPENMP
#include <omp.h>
#endif

/* Online-softmax state of a query slab: m (Tq) running max, l (Tq) running sum, acc (Tq, d). */
struct full_state {
  float *m, *l, *acc;
};

/* Accumulate keys [koff, koff+Tk) into the state of queries [qoff, qoff+Tq) for one (b, h).
 * S: (tile, tile) scratch. Rows or tiles entirely masked by causality are skipped. */
static void full_block_forward(struct full_state st, const float *q, long Tq, long qoff,
                               const float *k, const float *v, long Tk, long koff, int d,
                               bool causal, int tile, long i0, long i1, float *S) {
  const float scale = 1.0f / sqrtf((float)d);
  long bi = i1 - i0;
  for (long j0 = 0; j0 < Tk; j0 += tile) {
    long bj = Tk - j0 < tile ? Tk - j0 : tile;
    if (causal && koff + j0 > qoff + i1 - 1) break; /* every later key is in the future */
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)bi, (int)bj, d, scale, q + i0 * d, d,
                k + j0 * d, d, 0.0f, S, (int)bj);
    bool diag = causal && koff + j0 + bj - 1 > qoff + i0;
    for (long r = 0; r < bi; r++) {
      float *s = S + r * bj;
      long gi = qoff + i0 + r;
      long nvalid = bj;
      if (diag) {
        nvalid = gi - (koff + j0) + 1; /* keys ≤ gi */
        if (nvalid < 0) nvalid = 0;
        if (nvalid > bj) nvalid = bj;
        for (long c = nvalid; c < bj; c++) s[c] = -INFINITY;
      }
      float *mrow = st.m + i0 + r, *lrow = st.l + i0 + r, *arow = st.acc + (i0 + r) * d;
      if (nvalid == 0) {
        memset(s, 0, sizeof(float) * (size_t)bj);
        continue;
      }
      float mx = *mrow;
      for (long c = 0; c < nvalid; c++) mx = s[c] > mx ? s[c] : mx;
      float alpha = expf(*mrow - mx); /* exp(−inf) = 0 on the first block */
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

/* Gradient contributions of keys [koff, koff+Tk) to queries [qoff, qoff+Tq) of one (b, h):
 * dq (Tq, d) += …, dk, dv (Tk, d) += …; lse and D (Tq) as saved and precomputed. */
static void full_block_backward(float *dq, float *dk, float *dv, const float *dout, const float *q,
                                const float *lse, const float *D, long Tq, long qoff,
                                const float *k, const float *v, long Tk, long koff, int d,
                                bool causal, int tile, float *S, float *dP) {
  const float scale = 1.0f / sqrtf((float)d);
  for (long i0 = 0; i0 < Tq; i0 += tile) {
    long bi = Tq - i0 < tile ? Tq - i0 : tile;
    for (long j0 = 0; j0 < Tk; j0 += tile) {
      long bj = Tk - j0 < tile ? Tk - j0 : tile;
      if (causal && koff + j0 > qoff + i0 + bi - 1) break;
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)bi, (int)bj, d, scale, q + i0 * d,
                  d, k + j0 * d, d, 0.0f, S, (int)bj);
      bool diag = causal && koff + j0 + bj - 1 > qoff + i0;
      for (long r = 0; r < bi; r++) {
        float *s = S + r * bj;
        float L = lse[i0 + r];
        long nvalid = bj;
        if (diag) {
          nvalid = qoff + i0 + r - (koff + j0) + 1;
          if (nvalid < 0) nvalid = 0;
          if (nvalid > bj) nvalid = bj;
        }
#pragma omp simd
        for (long c = 0; c < bj; c++) s[c] = expf(s[c] - L);
        for (long c = nvalid; c < bj; c++) s[c] = 0.0f;
      }
      /* dv_j += Pᵀ dO_i */
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)bj, d, (int)bi, 1.0f, S, (int)bj,
                  dout + i0 * d, d, 1.0f, dv + j0 * d, d);
      /* dP = dO_i v_jᵀ */
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)bi, (int)bj, d, 1.0f, dout + i0 * d,
                  d, v + j0 * d, d, 0.0f, dP, (int)bj);
      /* dS = P ∘ (dP − D_i), stored in dP */
      for (long r = 0; r < bi; r++) {
        float Di = D[i0 + r];
        float *p = S + r * bj, *g = dP + r * bj;
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

static const char *full_check(const struct config *cfg, long n, int seq_ranks, char *buf,
                              size_t len) {
  if (seq_ranks > 1) {
    snprintf(buf, len,
             "attention.variant = full with parallel.seq_ranks = %d: sequence parallelism is not "
             "implemented yet (use parallel.seq_ranks = 1)",
             seq_ranks);
    return buf;
  }
  return NULL;
}

static int full_tile(const struct attn_ctx *ctx) { return ctx->cfg->attention.full_block; }

static size_t full_saved_floats(const struct attn_ctx *ctx) {
  return (size_t)(ctx->dims.B * ctx->dims.H * ctx->dims.T); /* log-sum-exp per query row */
}

static void full_forward(struct attn_ctx *ctx, float *out, float *saved, const float *q,
                         const float *k, const float *v, const float *params) {
  const struct attn_dims *dm = &ctx->dims;
  if (ctx->comm && ctx->comm->S > 1)
    error("full attention across %d sequence ranks is not available yet", ctx->comm->S);
  const long T = dm->T, BH = dm->B * dm->H;
  const int d = (int)dm->d, tile = full_tile(ctx);
  const long ntiles = (T + tile - 1) / tile;
  float *lse = saved;                                                         /* (B, H, T) */
  float *ml = mem_alloc(MEM_WORKSPACE, sizeof(float) * 2 * (size_t)(BH * T)); /* m, l */
#pragma omp parallel
  {
    float *S = mem_alloc(MEM_WORKSPACE, sizeof(float) * (size_t)tile * tile);
#pragma omp for schedule(dynamic, 1) collapse(2)
    for (long bh = 0; bh < BH; bh++)
      for (long it = 0; it < ntiles; it++) {
        long i0 = it * tile, i1 = i0 + tile < T ? i0 + tile : T;
        size_t off = (size_t)bh * T * d;
        struct full_state st = {ml + bh * T, ml + BH * T + bh * T, out + off};
        for (long i = i0; i < i1; i++) {
          st.m[i] = -INFINITY;
          st.l[i] = 0.0f;
        }
        memset(out + off + i0 * d, 0, sizeof(float) * (size_t)((i1 - i0) * d));
        full_block_forward(st, q + off, T, dm->t0, k + off, v + off, T, dm->t0, d, dm->causal, tile,
                           i0, i1, S);
        for (long i = i0; i < i1; i++) {
          float inv = 1.0f / st.l[i];
          for (int c = 0; c < d; c++) st.acc[i * d + c] *= inv;
          lse[bh * T + i] = st.m[i] + logf(st.l[i]);
        }
      }
    mem_free(S);
  }
  mem_free(ml);
}

static void full_backward(struct attn_ctx *ctx, float *dq, float *dk, float *dv, float *dparams,
                          const float *dout, const float *q, const float *k, const float *v,
                          const float *params, const float *out, const float *saved) {
  const struct attn_dims *dm = &ctx->dims;
  const long T = dm->T, BH = dm->B * dm->H;
  const int d = (int)dm->d, tile = full_tile(ctx);
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
      size_t off = (size_t)bh * T * d;
      full_block_backward(dq + off, dk + off, dv + off, dout + off, q + off, lse + bh * T,
                          D + bh * T, T, dm->t0, k + off, v + off, T, dm->t0, d, dm->causal, tile,
                          S, S + (size_t)tile * tile);
    }
    mem_free(S);
  }
  mem_free(D);
}

static bool full_allowed(const struct attn_ctx *ctx, long i, long j) {
  return !ctx->dims.causal || j <= i;
}

static long full_diagnostics(struct attn_ctx *ctx, double *mass, double *entropy, const float *q,
                             const float *k, const float *v, const float *params) {
  return attention_diag_rows(ctx, mass, entropy, q, k, 256, full_allowed);
}

static double full_flops(const struct attn_ctx *ctx, double *p2p_flops) {
  const struct attn_dims *dm = &ctx->dims;
  double pairs = dm->causal ? 0.5 * (double)dm->n * (double)(dm->n + 1) : (double)dm->n * dm->n;
  *p2p_flops = 0.0;
  /* q·k and p·v: 2 FLOPs per multiply-add each, per allowed (i, j) pair, over the local share */
  return 4.0 * pairs * (double)dm->d * (double)(dm->B * dm->H) * ((double)dm->T / (double)dm->n);
}

const struct attn_variant attention_full = {
    .name = "full",
    .causal_ok = true,
    .bidir_ok = true,
    .check = full_check,
    .saved_floats = full_saved_floats,
    .forward = full_forward,
    .backward = full_backward,
    .diagnostics = full_diagnostics,
    .flops = full_flops,
};
