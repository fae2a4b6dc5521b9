/* `fmmformer` (SPEC §6.6): out = σ(w1)·Band(q, k, v) + σ(w2)·Σ_φ LowRank_φ(q, k, v) per head,
 * Band = `local` with fmmformer.band (full.c's kernels and halo), LowRank_φ = `linear` with a
 * feature map of fmmformer.kernels (kernelized.c's running sums); w1, w2 [H] (attn/fmmformer/)
 * start at 0, so both parts start at ½. This file combines the parts; it computes none of them. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attention/exact.h"
#include "attention/kernelized.h"
#include "attention/linear.h"
#include "core/error.h"
#include "core/memory.h"

struct fmm_state {
  long band;
  int nk; /* kernels */
  struct kz_map map[LINEAR_NKERNELS];
};

static void fmm_describe(const struct config *cfg, long n, struct param_list *list) {
  const long H = cfg->model.heads;
  param_list_add(list, "w1", 1, &H, false, INIT_ZERO, 0.0f);
  param_list_add(list, "w2", 1, &H, false, INIT_ZERO, 0.0f);
}

static void *fmm_setup(const struct config *cfg, const struct attn_dims *dims) {
  struct fmm_state *st = xcalloc(1, sizeof *st);
  st->band = cfg->attention.fmmformer_band;
  enum linear_kernel kinds[LINEAR_NKERNELS];
  st->nk = linear_kernels_parse(cfg->attention.fmmformer_kernels, kinds);
  if (st->nk < 1)
    error("fmmformer.kernels = '%s' names no kernel", cfg->attention.fmmformer_kernels);
  for (int i = 0; i < st->nk; i++) st->map[i] = linear_map(kinds[i], (int)dims->d);
  return st;
}

static void fmm_teardown(void *state) { free(state); }

static float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

/* saved: the band's log-sum-exp (B·H·T) and output (B·H·T·d), then per kernel its running-sum
 * state (kz_saved_floats) and output (B·H·T·d). */
struct fmm_saved {
  float *lse, *band_out;
  float *kz[LINEAR_NKERNELS], *core[LINEAR_NKERNELS];
};

static struct fmm_saved saved_layout(const struct attn_ctx *ctx, float *saved) {
  const struct fmm_state *st = ctx->state;
  const size_t BH = (size_t)(ctx->dims.B * ctx->dims.H),
               X = BH * (size_t)(ctx->dims.T * ctx->dims.d);
  struct fmm_saved s = {0};
  s.lse = saved;
  s.band_out = s.lse + BH * (size_t)ctx->dims.T;
  float *p = s.band_out + X;
  for (int i = 0; i < st->nk; i++) {
    s.kz[i] = p;
    p += kz_saved_floats(ctx, &st->map[i]);
    s.core[i] = p;
    p += X;
  }
  return s;
}

static size_t fmm_saved_floats(const struct attn_ctx *ctx) {
  const struct fmm_state *st = ctx->state;
  const size_t BH = (size_t)(ctx->dims.B * ctx->dims.H),
               X = BH * (size_t)(ctx->dims.T * ctx->dims.d);
  size_t total = BH * (size_t)ctx->dims.T + X;
  for (int i = 0; i < st->nk; i++) total += kz_saved_floats(ctx, &st->map[i]) + X;
  return total;
}

static void fmm_forward(struct attn_ctx *ctx, float *out, float *saved, const float *q,
                        const float *k, const float *v, const float *params) {
  const struct fmm_state *st = ctx->state;
  const struct attn_dims *dm = &ctx->dims;
  const long H = dm->H, Td = dm->T * dm->d;
  const float *w1 = params, *w2 = params + param_aligned(H);
  struct fmm_saved s = saved_layout(ctx, saved);
  exact_attention_forward(ctx, st->band, s.band_out, s.lse, q, k, v);
  for (int i = 0; i < st->nk; i++)
    kz_forward(ctx, &st->map[i], KZ_PLAIN, s.core[i], s.kz[i], q, k, v);
#pragma omp parallel for schedule(static)
  for (long bh = 0; bh < dm->B * H; bh++) {
    const float a1 = sigmoid(w1[bh % H]), a2 = sigmoid(w2[bh % H]);
    for (long e = bh * Td; e < (bh + 1) * Td; e++) {
      float far = 0.0f;
      for (int i = 0; i < st->nk; i++) far += s.core[i][e];
      out[e] = a1 * s.band_out[e] + a2 * far;
    }
  }
}

static void fmm_backward(struct attn_ctx *ctx, float *dq, float *dk, float *dv, float *dparams,
                         const float *dout, const float *q, const float *k, const float *v,
                         const float *params, const float *out, const float *saved) {
  const struct fmm_state *st = ctx->state;
  const struct attn_dims *dm = &ctx->dims;
  const long H = dm->H, BH = dm->B * H, Td = dm->T * dm->d;
  const float *w1 = params, *w2 = params + param_aligned(H);
  struct fmm_saved s = saved_layout(ctx, (float *)saved);
  double *g = xcalloc(2 * (size_t)BH, sizeof(double)); /* Σ dout·band, Σ dout·far per (b, h) */
#pragma omp parallel for schedule(static)
  for (long bh = 0; bh < BH; bh++) {
    double gb = 0.0, gf = 0.0;
    for (long e = bh * Td; e < (bh + 1) * Td; e++) {
      float far = 0.0f;
      for (int i = 0; i < st->nk; i++) far += s.core[i][e];
      gb += (double)dout[e] * s.band_out[e];
      gf += (double)dout[e] * far;
    }
    g[2 * bh] = gb;
    g[2 * bh + 1] = gf;
  }
  /* each part's backward takes dout scaled by its weight: σ(w1) per head for the band, σ(w2)
   * per head and channel for the low-rank parts */
  float *band_scale = xmalloc(sizeof(float) * (size_t)H);          /* (H) */
  float *far_scale = xmalloc(sizeof(float) * (size_t)(H * dm->d)); /* (H, d) */
  for (long h = 0; h < H; h++) band_scale[h] = sigmoid(w1[h]);
  for (long e = 0; e < H * dm->d; e++) far_scale[e] = sigmoid(w2[e / dm->d]);
  exact_attention_backward(ctx, st->band, band_scale, dq, dk, dv, dout, q, k, v, s.band_out, s.lse);
  for (int i = 0; i < st->nk; i++)
    kz_backward(ctx, &st->map[i], KZ_PLAIN, far_scale, dq, dk, dv, dout, q, k, v, s.core[i],
                s.kz[i]);
  free(far_scale);
  free(band_scale);
  if (dparams) { /* dσ(w)/dw = σ(1 − σ); summed over the batch in order */
    float *dw1 = dparams, *dw2 = dparams + param_aligned(H);
    for (long bh = 0; bh < BH; bh++) {
      const float a1 = sigmoid(w1[bh % H]), a2 = sigmoid(w2[bh % H]);
      dw1[bh % H] += (float)(a1 * (1.0 - a1) * g[2 * bh]);
      dw2[bh % H] += (float)(a2 * (1.0 - a2) * g[2 * bh + 1]);
    }
  }
  free(g);
}

/* ---------------------------------------------------------------------------------------------
 * diagnostics and FLOPs */

static double band_score(const struct attn_ctx *ctx, const float *qi, long i, const float *kj,
                         long j, long width, const void *user) {
  const struct fmm_state *st = ctx->state;
  if (!exact_attention_allows(ctx->dims.causal, st->band, i, j)) return -INFINITY;
  double dot = 0.0;
  for (long c = 0; c < width; c++) dot += (double)qi[c] * kj[c];
  return dot / sqrt((double)width);
}

/* The output mixes normalised rows: σ(w1)·(band's softmax row) + σ(w2)·Σ_φ (φ's normalised row).
 * Its mass per distance band is that mixture of the parts' masses (divided by σ(w1) + nk·σ(w2));
 * the entropy reported is the same mixture of the parts' entropies (a lower bound of the mixed
 * row's entropy). */
static long fmm_diagnostics(struct attn_ctx *ctx, double *mass, double *entropy, const float *q,
                            const float *k, const float *v, const float *params) {
  const struct fmm_state *st = ctx->state;
  const struct attn_dims *dm = &ctx->dims;
  const long H = dm->H, T = dm->T, d = dm->d;
  const int bands = ctx->opt.diag_bands;
  const float *w1 = params, *w2 = params + param_aligned(H);
  double *pm = xcalloc((size_t)(H * bands), sizeof(double)),
         *pe = xcalloc((size_t)H, sizeof(double));
  long nq = 0;
  for (long h = 0; h < H; h++) {
    nq = attention_diag_rows(ctx, pm + h * bands, pe + h, q + h * T * d, k + h * T * d, d,
                             ATTENTION_DIAG_QUERIES, band_score, NULL);
    const double a1 = sigmoid(w1[h]), a2 = sigmoid(w2[h]), total = a1 + st->nk * a2;
    for (int b = 0; b < bands; b++) mass[h * bands + b] += a1 / total * pm[h * bands + b];
    entropy[h] += a1 / total * pe[h];
  }
  for (int i = 0; i < st->nk; i++) {
    memset(pm, 0, sizeof(double) * (size_t)(H * bands));
    memset(pe, 0, sizeof(double) * (size_t)H);
    kz_diagnostics(ctx, &st->map[i], KZ_PLAIN, pm, pe, q, k);
    for (long h = 0; h < H; h++) {
      const double a1 = sigmoid(w1[h]), a2 = sigmoid(w2[h]), total = a1 + st->nk * a2;
      for (int b = 0; b < bands; b++) mass[h * bands + b] += a2 / total * pm[h * bands + b];
      entropy[h] += a2 / total * pe[h];
    }
  }
  free(pm);
  free(pe);
  return nq;
}

static double fmm_flops(const struct attn_ctx *ctx, double *p2p_flops) {
  const struct fmm_state *st = ctx->state;
  double f = exact_attention_flops(ctx, st->band);
  for (int i = 0; i < st->nk; i++) f += kz_flops(ctx, &st->map[i]);
  *p2p_flops = 0.0;
  return f;
}

/* The decode cache: local's ring of the band, the sums of every kernel, scratch for the parts. */
struct fmm_cache {
  void *band;
  void *kz[LINEAR_NKERNELS];
  float *part; /* (H, d) */
};

static void *fmm_decode_open(const struct attn_ctx *ctx, const float *params) {
  const struct fmm_state *st = ctx->state;
  struct fmm_cache *c = xcalloc(1, sizeof *c);
  c->band = exact_decode_open_band(ctx, st->band);
  for (int i = 0; i < st->nk; i++) c->kz[i] = kz_decode_open(ctx, &st->map[i]);
  c->part = xmalloc(sizeof(float) * (size_t)(ctx->dims.H * ctx->dims.d));
  return c;
}

static void fmm_decode_step(struct attn_ctx *ctx, void *cache, float *out, const float *q,
                            const float *k, const float *v, long pos, const float *params) {
  const struct fmm_state *st = ctx->state;
  struct fmm_cache *c = cache;
  const long H = ctx->dims.H, d = ctx->dims.d;
  const float *w1 = params, *w2 = params + param_aligned(H);
  exact_decode_step_band(ctx, c->band, out, q, k, v, pos);
  for (long e = 0; e < H * d; e++) out[e] *= sigmoid(w1[e / d]);
  for (int i = 0; i < st->nk; i++) {
    kz_decode_step(ctx, c->kz[i], KZ_PLAIN, c->part, q, k, v);
    for (long e = 0; e < H * d; e++) out[e] += sigmoid(w2[e / d]) * c->part[e];
  }
}

static void fmm_decode_close(void *cache) {
  struct fmm_cache *c = cache;
  if (!c) return;
  exact_decode_close(c->band);
  for (int i = 0; i < LINEAR_NKERNELS; i++) kz_decode_close(c->kz[i]);
  free(c->part);
  free(c);
}

struct attn_variant attention_fmmformer = {
    .name = "fmmformer",
    .causal_ok = true,
    .bidir_ok = true,
    .describe = fmm_describe,
    .setup = fmm_setup,
    .teardown = fmm_teardown,
    .diagnostics = fmm_diagnostics,
    .flops = fmm_flops,
    .decode_open = fmm_decode_open,
    .decode_step = fmm_decode_step,
    .decode_close = fmm_decode_close,
    .cpu = {.saved_floats = fmm_saved_floats, .forward = fmm_forward, .backward = fmm_backward},
};
