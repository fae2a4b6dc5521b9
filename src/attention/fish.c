/* FiSH heads (SPEC §6.9, Nguyen et al., "finite admixture of shared heads") on `full` and `local`:
 * G = fish.global_heads query/key heads give global scores s_k(i, j) = q_k,i·k_k,j, k < G; each of
 * the H value heads takes its logits as a mixture of them — fish.mix = linear (hard FiSH):
 * ℓ_h = Σ_k P[h, k] s_k; mlp (GFiSH): ℓ_h = (W2·ReLU(W1·s + b1) + b2)_h with R = H hidden units —
 * after adding σ·ε to every s_k during training (σ = fish.noise; ε a standard normal keyed by
 * (step, layer, global head, global sample, i, j), so the same on any rank layout). Then 1/√d, the
 * mask (causal, band), softmax, times the head's values. Tile by tile with an online softmax, as
 * full.c does, so memory stays O(n·d); backward recomputes the score tiles. Under sequence
 * parallelism `local` gathers the band's halo and `full` runs the ring (ring.c), carrying the G
 * key heads and H value heads. Parameters (attn/fish/): mix [H, G], or w1 [R, G], b1 [R],
 * w2 [H, R], b2 [H]. fma and the kernelized variants cannot take FiSH heads
 * (docs/nystrom_fish.md). */
#include <cblas.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attention/attention.h"
#include "attention/exact.h"
#include "attention/ring.h"
#include "error.h"
#include "halo.h"
#include "memory.h"
#include "rng.h"
#include "vecmath.h"

enum fish_mix { FISH_LINEAR, FISH_MLP };

struct fish_state {
  int G, H, R; /* global heads, value heads, MLP hidden units */
  enum fish_mix mix;
  float sigma; /* fish.noise */
  long band;   /* 0: full */
  int tile;
  uint64_t seed;
};

/* The mixing parameters, resolved to pointers into the variant's block (floats; NULL unused). */
struct fish_params {
  const float *P;                 /* (H, G) linear */
  const float *W1, *b1, *W2, *b2; /* (R, G), (R), (H, R), (H) mlp */
};

static size_t n_params(const struct fish_state *st) {
  if (st->mix == FISH_LINEAR) return param_aligned((size_t)(st->H * st->G));
  return param_aligned((size_t)(st->R * st->G)) + param_aligned((size_t)st->R) +
         param_aligned((size_t)(st->H * st->R)) + param_aligned((size_t)st->H);
}

static struct fish_params params_view(const struct fish_state *st, const float *p) {
  struct fish_params fp = {0};
  if (st->mix == FISH_LINEAR) {
    fp.P = p;
  } else {
    fp.W1 = p;
    fp.b1 = fp.W1 + param_aligned((size_t)(st->R * st->G));
    fp.W2 = fp.b1 + param_aligned((size_t)st->R);
    fp.b2 = fp.W2 + param_aligned((size_t)(st->H * st->R));
  }
  return fp;
}

/* ---------------------------------------------------------------------------------------------
 * parameters */

static enum fish_mix mix_of(const struct config *cfg) {
  return strcmp(cfg->attention.fish_mix, "mlp") == 0 ? FISH_MLP : FISH_LINEAR;
}

static void fish_describe(const struct config *cfg, long n, struct param_list *list) {
  const long G = cfg->attention.fish_global_heads, H = cfg->model.heads, R = H;
  if (mix_of(cfg) == FISH_LINEAR) {
    const long shape[2] = {H, G};
    param_list_add(list, "mix", 2, shape, false, INIT_CUSTOM, 0.0f);
    return;
  }
  /* PyTorch's Linear default, U(±1/√fan_in), for the two layers of the head-mixing MLP */
  const long w1[2] = {R, G}, w2[2] = {H, R};
  param_list_add(list, "w1", 2, w1, true, INIT_UNIFORM, (float)(1.0 / sqrt((double)G)));
  param_list_add(list, "b1", 1, &R, false, INIT_UNIFORM, (float)(1.0 / sqrt((double)G)));
  param_list_add(list, "w2", 2, w2, true, INIT_UNIFORM, (float)(1.0 / sqrt((double)R)));
  param_list_add(list, "b2", 1, &H, false, INIT_UNIFORM, (float)(1.0 / sqrt((double)R)));
}

/* mix [H, G]: each local head starts as the average of the global ones (the admixture's uniform
 * weights 1/G), plus U(±½/G) so that the heads do not start identical. */
static void fish_init_param(const struct config *cfg, const struct param_desc *p, float *data) {
  const long G = p->shape[1];
  uint64_t key = 1469598103934665603ull;
  for (const char *s = p->name; *s; s++) key = (key ^ (uint8_t)*s) * 1099511628211ull;
  key ^= (uint64_t)(p->layer + 1) << 48;
  for (size_t e = 0; e < p->numel; e++)
    data[e] = (float)((1.0 + (rng_uniform_double(cfg->run.seed, RNG_INIT, key, e, 2) - 0.5)) / G);
}

static void *fish_setup(const struct config *cfg, const struct attn_dims *dims) {
  struct fish_state *st = xcalloc(1, sizeof *st);
  st->G = cfg->attention.fish_global_heads;
  st->H = (int)dims->H;
  st->R = st->H;
  st->mix = mix_of(cfg);
  st->sigma = (float)cfg->attention.fish_noise;
  st->seed = cfg->run.seed;
  return st;
}

static void fish_teardown(void *state) { free(state); }

/* ---------------------------------------------------------------------------------------------
 * the tile kernels: one batch element, a tile of queries against a tile of keys */

/* Where one call reads: batch element b's G query heads (rows of qstride tokens from global
 * qoff), G key heads and H value heads (rows of kstride tokens from global koff). */
struct fish_rows {
  const float *q, *k, *v; /* (G, qstride, d), (G, kstride, d), (H, kstride, d) */
  long qstride, kstride, qoff, koff;
  long sample; /* global sample index: the noise key */
};

/* Scratch of one thread: score tiles Sg and their gradients dS (G each), the MLP's Z and dZ (R
 * each), the logits L (H), and dP. */
static size_t tile_scratch(const struct fish_state *st, int tile) {
  return (size_t)(2 * st->G + 2 * st->R + st->H + 1) * (size_t)tile * tile;
}

/* Sg (G, bi, bj) = q_k k_kᵀ (+ noise), then L (H, bi, bj) = the mixed logits before 1/√d;
 * Z (R, bi, bj) keeps the MLP's pre-activations for backward. Rows i0.., columns j0.. . */
static void tile_logits(const struct fish_state *st, const struct fish_params *fp,
                        const struct attn_ctx *ctx, const struct fish_rows *x, long i0, long bi,
                        long j0, long bj, int d, float *Sg, float *Z, float *L) {
  const long tt = bi * bj;
  for (int k = 0; k < st->G; k++) {
    float *s = Sg + k * tt;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)bi, (int)bj, d, 1.0f,
                x->q + (k * x->qstride + i0) * d, d, x->k + (k * x->kstride + j0) * d, d, 0.0f, s,
                (int)bj);
    if (st->sigma > 0.0f && ctx->train) {
      const uint64_t head = ((uint64_t)(ctx->layer * st->G + k) << 40) | (uint64_t)x->sample;
      const uint64_t n = (uint64_t)ctx->dims.n;
      for (long r = 0; r < bi; r++)
        for (long c = 0; c < bj; c++) {
          const uint64_t gi = (uint64_t)(x->qoff + i0 + r), gj = (uint64_t)(x->koff + j0 + c);
          s[r * bj + c] += st->sigma * (float)rng_normal(st->seed, RNG_NOISE, (uint64_t)ctx->step,
                                                         head, gi * n + gj);
        }
    }
  }
  if (st->mix == FISH_LINEAR) {
    for (int h = 0; h < st->H; h++) {
      float *l = L + h * tt;
      memset(l, 0, sizeof(float) * (size_t)tt);
      for (int k = 0; k < st->G; k++) {
        const float p = fp->P[h * st->G + k], *s = Sg + k * tt;
#pragma omp simd
        for (long e = 0; e < tt; e++) l[e] += p * s[e];
      }
    }
    return;
  }
  for (int r = 0; r < st->R; r++) { /* Z_r = W1[r]·s + b1[r] */
    float *z = Z + r * tt;
    for (long e = 0; e < tt; e++) z[e] = fp->b1[r];
    for (int k = 0; k < st->G; k++) {
      const float w = fp->W1[r * st->G + k], *s = Sg + k * tt;
#pragma omp simd
      for (long e = 0; e < tt; e++) z[e] += w * s[e];
    }
  }
  for (int h = 0; h < st->H; h++) { /* L_h = W2[h]·ReLU(Z) + b2[h] */
    float *l = L + h * tt;
    for (long e = 0; e < tt; e++) l[e] = fp->b2[h];
    for (int r = 0; r < st->R; r++) {
      const float w = fp->W2[h * st->R + r], *z = Z + r * tt;
#pragma omp simd
      for (long e = 0; e < tt; e++) l[e] += w * (z[e] > 0.0f ? z[e] : 0.0f);
    }
  }
}

/* Online-softmax state of H heads × the queries of a slab: m, l (H, T) and acc (H, T, d) rows of
 * qstride tokens, for one batch element. */
struct fish_online {
  float *m, *l, *acc;
  long stride;
};

/* Fold keys [0, Tk) into the state of queries [i0, i1). */
static void fish_fold(const struct fish_state *st, const struct fish_params *fp,
                      const struct attn_ctx *ctx, const struct fish_rows *x, struct fish_online o,
                      long Tk, struct key_mask mk, int d, long i0, long i1, float *scratch) {
  const int tile = st->tile;
  const float scale = 1.0f / sqrtf((float)d);
  const long bi = i1 - i0;
  float *Sg = scratch, *Z = Sg + (size_t)st->G * tile * tile, *L = Z + (size_t)st->R * tile * tile;
  long jlo, jhi;
  live_keys(mk, x->qoff + i0, x->qoff + i1 - 1, x->koff, Tk, tile, &jlo, &jhi);
  for (long j0 = jlo; j0 < jhi; j0 += tile) {
    const long bj = Tk - j0 < tile ? Tk - j0 : tile, tt = bi * bj;
    tile_logits(st, fp, ctx, x, i0, bi, j0, bj, d, Sg, Z, L);
    for (int h = 0; h < st->H; h++) {
      float *l = L + h * tt;
      for (long r = 0; r < bi; r++) {
        float *s = l + r * bj, *mrow = o.m + h * o.stride + i0 + r,
              *lrow = o.l + h * o.stride + i0 + r;
        float *arow = o.acc + (h * o.stride + i0 + r) * d;
        long c0, c1;
        tile_columns(mk, x->qoff + i0 + r, x->koff + j0, bj, &c0, &c1);
        if (c1 == c0) {
          memset(s, 0, sizeof(float) * (size_t)bj);
          continue;
        }
        for (long c = 0; c < bj; c++) s[c] = c >= c0 && c < c1 ? s[c] * scale : -INFINITY;
        float mx = *mrow;
        for (long c = c0; c < c1; c++) mx = s[c] > mx ? s[c] : mx;
        const float alpha = expf(*mrow - mx);
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (long c = 0; c < bj; c++) {
          s[c] = expf(s[c] - mx);
          sum += s[c];
        }
        *lrow = *lrow * alpha + sum;
        *mrow = mx;
        if (alpha != 1.0f)
          for (int f = 0; f < d; f++) arow[f] *= alpha;
      }
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)bi, d, (int)bj, 1.0f, l, (int)bj,
                  x->v + (h * x->kstride + j0) * d, d, 1.0f, o.acc + (h * o.stride + i0) * d, d);
    }
  }
}

/* Gradients of the queries [0, Tq) of one batch element against keys [0, Tk): dq (G, qstride, d),
 * dk (G, kstride, d), dv (H, kstride, d) and the mixing parameters' dpar (n_params) +=; dout, lse
 * and D (H, qstride[, d]) as saved and precomputed. */
struct fish_grads {
  float *dq, *dk, *dv, *dpar;
  const float *dout, *lse, *D;
};

static void fish_grad(const struct fish_state *st, const struct fish_params *fp,
                      const struct attn_ctx *ctx, const struct fish_rows *x, struct fish_grads g,
                      long Tq, long Tk, struct key_mask mk, int d, float *scratch) {
  const int tile = st->tile, G = st->G, H = st->H, R = st->R;
  const float scale = 1.0f / sqrtf((float)d);
  const size_t t2 = (size_t)tile * tile;
  float *Sg = scratch, *Z = Sg + G * t2, *dZ = Z + R * t2, *L = dZ + R * t2, *dP = L + H * t2;
  float *dS = dP + t2;
  const struct fish_params dfp = params_view(st, g.dpar);
  for (long i0 = 0; i0 < Tq; i0 += tile) {
    const long bi = Tq - i0 < tile ? Tq - i0 : tile;
    long jlo, jhi;
    live_keys(mk, x->qoff + i0, x->qoff + i0 + bi - 1, x->koff, Tk, tile, &jlo, &jhi);
    for (long j0 = jlo; j0 < jhi; j0 += tile) {
      const long bj = Tk - j0 < tile ? Tk - j0 : tile, tt = bi * bj;
      tile_logits(st, fp, ctx, x, i0, bi, j0, bj, d, Sg, Z, L);
      /* per head: P, dv += Pᵀ dO, dP = dO vᵀ, dL = P ∘ (dP − D) / √d, written over L */
      for (int h = 0; h < H; h++) {
        float *l = L + h * tt;
        for (long r = 0; r < bi; r++) {
          const float lse = g.lse[h * x->qstride + i0 + r];
          long c0, c1;
          tile_columns(mk, x->qoff + i0 + r, x->koff + j0, bj, &c0, &c1);
          float *s = l + r * bj;
          for (long c = 0; c < bj; c++) s[c] = c >= c0 && c < c1 ? s[c] * scale - lse : -INFINITY;
#pragma omp simd
          for (long c = 0; c < bj; c++) s[c] = expf(s[c]);
        }
        const float *dO = g.dout + (h * x->qstride + i0) * d;
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)bj, d, (int)bi, 1.0f, l, (int)bj,
                    dO, d, 1.0f, g.dv + (h * x->kstride + j0) * d, d);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)bi, (int)bj, d, 1.0f, dO, d,
                    x->v + (h * x->kstride + j0) * d, d, 0.0f, dP, (int)bj);
        for (long r = 0; r < bi; r++) {
          const float Dr = g.D[h * x->qstride + i0 + r];
          for (long c = 0; c < bj; c++) l[r * bj + c] *= (dP[r * bj + c] - Dr) * scale;
        }
      }
      /* the mixing's transpose: dL (H tiles) → dS_k (G tiles) and the parameters' gradients */
      for (int k = 0; k < G; k++) memset(dS + k * tt, 0, sizeof(float) * (size_t)tt);
      if (st->mix == FISH_LINEAR) {
        for (int h = 0; h < H; h++)
          for (int k = 0; k < G; k++) {
            const float p = fp->P[h * G + k], *dl = L + h * tt, *s = Sg + k * tt;
            float *ds = dS + k * tt, acc = 0.0f;
#pragma omp simd reduction(+ : acc)
            for (long e = 0; e < tt; e++) {
              ds[e] += p * dl[e];
              acc += dl[e] * s[e];
            }
            g.dpar[h * G + k] += acc;
          }
      } else {
        float *dW1 = (float *)dfp.W1, *db1 = (float *)dfp.b1, *dW2 = (float *)dfp.W2,
              *db2 = (float *)dfp.b2;
        for (int r = 0; r < R; r++) { /* dZ_r = Σ_h W2[h, r] dL_h ∘ [Z_r > 0] */
          float *dz = dZ + r * tt;
          const float *z = Z + r * tt;
          memset(dz, 0, sizeof(float) * (size_t)tt);
          for (int h = 0; h < H; h++) {
            const float w = fp->W2[h * R + r], *dl = L + h * tt;
            float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
            for (long e = 0; e < tt; e++) {
              dz[e] += w * dl[e];
              acc += dl[e] * (z[e] > 0.0f ? z[e] : 0.0f);
            }
            dW2[h * R + r] += acc;
          }
          float acc = 0.0f;
          for (long e = 0; e < tt; e++) {
            dz[e] = z[e] > 0.0f ? dz[e] : 0.0f;
            acc += dz[e];
          }
          db1[r] += acc;
          for (int k = 0; k < G; k++) {
            const float w = fp->W1[r * G + k], *s = Sg + k * tt;
            float *ds = dS + k * tt, a2 = 0.0f;
#pragma omp simd reduction(+ : a2)
            for (long e = 0; e < tt; e++) {
              ds[e] += w * dz[e];
              a2 += dz[e] * s[e];
            }
            dW1[r * G + k] += a2;
          }
        }
        for (int h = 0; h < H; h++) {
          float acc = 0.0f;
          for (long e = 0; e < tt; e++) acc += L[h * tt + e];
          db2[h] += acc;
        }
      }
      /* dq_k += dS_k k_k, dk_k += dS_kᵀ q_k (the noise is additive: no gradient of its own) */
      for (int k = 0; k < G; k++) {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)bi, d, (int)bj, 1.0f,
                    dS + k * tt, (int)bj, x->k + (k * x->kstride + j0) * d, d, 1.0f,
                    g.dq + (k * x->qstride + i0) * d, d);
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)bj, d, (int)bi, 1.0f, dS + k * tt,
                    (int)bj, x->q + (k * x->qstride + i0) * d, d, 1.0f,
                    g.dk + (k * x->kstride + j0) * d, d);
      }
    }
  }
}

/* ---------------------------------------------------------------------------------------------
 * one slab of queries against one contiguous range of keys, for every batch element */

static struct key_mask mask_of(const struct attn_ctx *ctx) {
  const struct fish_state *st = ctx->state;
  return (struct key_mask){ctx->dims.causal, st->band};
}

/* out (B, H, T, d) and lse (B, H, T) of the queries q (B, G, T, d) at global qoff against the keys
 * k (B, G, Tk, d), v (B, H, Tk, d) at global koff. */
static void slab_forward(const struct attn_ctx *ctx, const struct fish_params *fp, float *out,
                         float *lse, const float *q, long qoff, const float *k, const float *v,
                         long Tk, long koff) {
  const struct fish_state *st = ctx->state;
  const struct attn_dims *dm = &ctx->dims;
  const long B = dm->B, T = dm->T, G = st->G, H = st->H, ntiles = (T + st->tile - 1) / st->tile;
  const int d = (int)dm->d;
  float *ml = mem_alloc(MEM_WORKSPACE, sizeof(float) * 2 * (size_t)(B * H * T)); /* m, l */
  memset(out, 0, sizeof(float) * (size_t)(B * H * T * d));
#pragma omp parallel
  {
    float *scratch = mem_alloc(MEM_WORKSPACE, sizeof(float) * tile_scratch(st, st->tile));
#pragma omp for schedule(dynamic, 1) collapse(2)
    for (long b = 0; b < B; b++)
      for (long it = 0; it < ntiles; it++) {
        const long i0 = it * st->tile, i1 = i0 + st->tile < T ? i0 + st->tile : T;
        const struct fish_rows x = {
            q + b * G * T * d, k + b * G * Tk * d, v + b * H * Tk * d, T, Tk, qoff, koff,
            ctx->sample0 + b};
        const struct fish_online o = {ml + b * H * T, ml + (B + b) * H * T, out + b * H * T * d, T};
        for (long h = 0; h < H; h++)
          for (long i = i0; i < i1; i++) o.m[h * T + i] = -INFINITY, o.l[h * T + i] = 0.0f;
        fish_fold(st, fp, ctx, &x, o, Tk, mask_of(ctx), d, i0, i1, scratch);
        for (long h = 0; h < H; h++)
          for (long i = i0; i < i1; i++) {
            const float inv = 1.0f / o.l[h * T + i];
            for (int f = 0; f < d; f++) o.acc[(h * T + i) * d + f] *= inv;
            lse[(b * H + h) * T + i] = o.m[h * T + i] + logf(o.l[h * T + i]);
          }
      }
    mem_free(scratch);
  }
  mem_free(ml);
}

/* D (rows) = rowsum(dout ∘ out), the softmax backward's per-row correction. */
static void rowdot(float *D, const float *dout, const float *out, long rows, int d) {
#pragma omp parallel for schedule(static)
  for (long r = 0; r < rows; r++) {
    float s = 0.0f;
    for (int c = 0; c < d; c++) s += dout[r * d + c] * out[r * d + c];
    D[r] = s;
  }
}

/* Sum per-batch-element parameter gradients dpb (B, np) into dparams in batch order. */
static void add_param_grads(float *dparams, const float *dpb, long B, size_t np) {
  if (!dparams) return;
  for (long b = 0; b < B; b++)
    for (size_t e = 0; e < np; e++) dparams[e] += dpb[b * np + e];
}

/* dq (B, G, T, d), dk (B, G, Tk, d), dv (B, H, Tk, d), dparams += the gradients of
 * slab_forward's op; one batch element per task, so no update races. */
static void slab_backward(const struct attn_ctx *ctx, const struct fish_params *fp, float *dq,
                          float *dk, float *dv, float *dparams, const float *dout, const float *q,
                          long qoff, const float *k, const float *v, long Tk, long koff,
                          const float *out, const float *lse) {
  const struct fish_state *st = ctx->state;
  const struct attn_dims *dm = &ctx->dims;
  const long B = dm->B, T = dm->T, G = st->G, H = st->H;
  const int d = (int)dm->d;
  const size_t np = n_params(st);
  float *D = mem_alloc(MEM_WORKSPACE, sizeof(float) * (size_t)(B * H * T));
  float *dpb = mem_alloc(MEM_WORKSPACE, sizeof(float) * np * (size_t)B);
  rowdot(D, dout, out, B * H * T, d);
#pragma omp parallel
  {
    float *scratch = mem_alloc(MEM_WORKSPACE, sizeof(float) * tile_scratch(st, st->tile));
#pragma omp for schedule(dynamic, 1)
    for (long b = 0; b < B; b++) {
      const struct fish_rows x = {
          q + b * G * T * d, k + b * G * Tk * d, v + b * H * Tk * d, T, Tk, qoff, koff,
          ctx->sample0 + b};
      const struct fish_grads g = {dq + b * G * T * d, dk + b * G * Tk * d,  dv + b * H * Tk * d,
                                   dpb + b * np,       dout + b * H * T * d, lse + b * H * T,
                                   D + b * H * T};
      fish_grad(st, fp, ctx, &x, g, T, Tk, mask_of(ctx), d, scratch);
    }
    mem_free(scratch);
  }
  add_param_grads(dparams, dpb, B, np);
  mem_free(dpb);
  mem_free(D);
}

/* ---------------------------------------------------------------------------------------------
 * `local` under sequence parallelism: the band's halo of the G key heads and H value heads */

static float *band_halo(const struct attn_ctx *ctx, struct halo *h, const float *k,
                        const float *v) {
  const struct fish_state *st = ctx->state;
  const struct attn_dims *dm = &ctx->dims;
  const long rk = dm->B * st->G, rv = dm->B * st->H, reach = st->band - 1, d = dm->d;
  halo_plan(h, ctx->comm, dm->n, dm->T, reach, dm->causal ? 0 : reach);
  float *kv = mem_alloc(MEM_COMM, sizeof(float) * (size_t)((rk + rv) * dm->T * d));
  memcpy(kv, k, sizeof(float) * (size_t)(rk * dm->T * d));
  memcpy(kv + rk * dm->T * d, v, sizeof(float) * (size_t)(rv * dm->T * d));
  float *ext = mem_alloc(MEM_WORKSPACE, sizeof(float) * (size_t)((rk + rv) * (h->hi - h->lo) * d));
  halo_gather(h, ctx->comm, ext, kv, rk + rv, d);
  mem_free(kv);
  return ext; /* k (B, G, E, d) then v (B, H, E, d) */
}

/* ---------------------------------------------------------------------------------------------
 * `full` under sequence parallelism: the ring (ring.c) with G key heads and H value heads */

/* Fold the keys kv (k (B, G, T, d) then v (B, H, T, d), of rank src) into my queries' states. */
static void ring_fold_step(const struct attn_ctx *ctx, const struct fish_params *fp,
                           const struct ring *rg, float *ml, float *oz, const float *qz,
                           const float *kv, int src) {
  const struct fish_state *st = ctx->state;
  const long B = ctx->dims.B, T = rg->T, L = rg->L, G = st->G, H = st->H;
  const int d = (int)ctx->dims.d;
  const long ntp = (L + st->tile - 1) / st->tile, XK = B * G * T * d;
#pragma omp parallel
  {
    float *scratch = mem_alloc(MEM_WORKSPACE, sizeof(float) * tile_scratch(st, st->tile));
#pragma omp for schedule(dynamic, 1) collapse(2)
    for (long b = 0; b < B; b++)
      for (long it = 0; it < rg->pieces * ntp; it++) {
        const int p = (int)(it / ntp);
        const long i0 = it % ntp * st->tile, i1 = i0 + st->tile < L ? i0 + st->tile : L;
        const struct fish_online o = {ml + b * H * T + p * L, ml + (B + b) * H * T + p * L,
                                      oz + (b * H * T + p * L) * d, T};
        for (int kp = 0; kp < rg->pieces; kp++) {
          const struct fish_rows x = {qz + (b * G * T + p * L) * d,
                                      kv + (b * G * T + kp * L) * d,
                                      kv + XK + (b * H * T + kp * L) * d,
                                      T,
                                      T,
                                      ring_offset(rg, rg->me, p),
                                      ring_offset(rg, src, kp),
                                      ctx->sample0 + b};
          fish_fold(st, fp, ctx, &x, o, L, mask_of(ctx), d, i0, i1, scratch);
        }
      }
    mem_free(scratch);
  }
}

static void ring_forward(const struct attn_ctx *ctx, const struct fish_params *fp, float *out,
                         float *lse, const float *q, const float *k, const float *v) {
  const struct fish_state *st = ctx->state;
  const struct ring rg = ring_plan(ctx->comm, ctx->dims.T, ctx->dims.causal);
  const bool zig = rg.pieces == 2;
  const long B = ctx->dims.B, T = rg.T, G = st->G, H = st->H, d = ctx->dims.d;
  const long XQ = B * G * T * d, XV = B * H * T * d, XKV = XQ + XV;
  float *kv = mem_alloc(MEM_COMM, sizeof(float) * 2 * (size_t)XKV), *cur = kv, *nxt = kv + XKV;
  float *ml = mem_alloc(MEM_WORKSPACE, sizeof(float) * 2 * (size_t)(B * H * T));
  float *qz = (float *)q, *oz = out;
  if (zig) {
    qz = mem_alloc(MEM_WORKSPACE, sizeof(float) * (size_t)XQ);
    oz = mem_alloc(MEM_WORKSPACE, sizeof(float) * (size_t)XV);
    ring_move(&rg, true, 3, (const float *[]){q, k, v}, (float *[]){qz, cur, cur + XQ},
              (const long[]){B * G, B * G, B * H}, (const long[]){d, d, d});
  } else {
    memcpy(cur, k, sizeof(float) * (size_t)XQ);
    memcpy(cur + XQ, v, sizeof(float) * (size_t)XV);
  }
  memset(oz, 0, sizeof(float) * (size_t)XV);
  for (long i = 0; i < B * H * T; i++) ml[i] = -INFINITY;
  for (int t = 0; t < rg.S; t++) {
    struct ring_xfer x = {0};
    if (t < rg.S - 1) ring_start(&rg, cur, nxt, (size_t)XKV, RING_TAG_KV, &x);
    ring_fold_step(ctx, fp, &rg, ml, oz, qz, cur, (rg.me - t + rg.S) % rg.S);
    if (t < rg.S - 1) {
      ring_finish(&x);
      float *tmp = cur;
      cur = nxt;
      nxt = tmp;
    }
  }
  for (long i = 0; i < B * H * T; i++) { /* lse saved in the ring's layout */
    const float inv = 1.0f / ml[B * H * T + i];
    for (long c = 0; c < d; c++) oz[i * d + c] *= inv;
    lse[i] = ml[i] + logf(ml[B * H * T + i]);
  }
  mem_free(kv);
  mem_free(ml);
  if (zig) {
    ring_move(&rg, false, 1, (const float *[]){oz}, (float *[]){out}, (const long[]){B * H},
              (const long[]){d});
    mem_free(qz);
    mem_free(oz);
  }
}

/* The ring again for the gradients, each rank's dk, dv accumulators following its k, v one step
 * behind (as full.c does); the mixing parameters' gradients stay on the rank that forms them. */
static void ring_backward(const struct attn_ctx *ctx, const struct fish_params *fp, float *dq,
                          float *dk, float *dv, float *dparams, const float *dout, const float *q,
                          const float *k, const float *v, const float *out, const float *lse) {
  const struct fish_state *st = ctx->state;
  const struct ring rg = ring_plan(ctx->comm, ctx->dims.T, ctx->dims.causal);
  const bool zig = rg.pieces == 2;
  const long B = ctx->dims.B, T = rg.T, L = rg.L, G = st->G, H = st->H, d = ctx->dims.d;
  const long XQ = B * G * T * d, XV = B * H * T * d, XKV = XQ + XV;
  const size_t np = n_params(st);
  float *kv = mem_alloc(MEM_COMM, sizeof(float) * 2 * (size_t)XKV), *cur = kv, *nxt = kv + XKV;
  float *acc = mem_alloc(MEM_COMM, sizeof(float) * 3 * (size_t)XKV); /* 3 × (dk, dv) */
  float *part = acc, *done = acc + XKV, *in = acc + 2 * XKV;
  float *D = mem_alloc(MEM_WORKSPACE, sizeof(float) * (size_t)(B * H * T));
  float *dpb = mem_alloc(MEM_WORKSPACE, sizeof(float) * np * (size_t)B);
  rowdot(D, dout, out, B * H * T, (int)d);
  const float *qz = q, *doz = dout, *Dz = D;
  float *dqz = dq, *zbuf = NULL;
  if (zig) {
    zbuf = mem_alloc(MEM_WORKSPACE, sizeof(float) * (size_t)(2 * XQ + XV + B * H * T));
    float *qw = zbuf, *dow = zbuf + XQ, *Dw = zbuf + XQ + XV;
    dqz = Dw + B * H * T; /* zeroed */
    ring_move(&rg, true, 5, (const float *[]){q, k, v, dout, D},
              (float *[]){qw, cur, cur + XQ, dow, Dw},
              (const long[]){B * G, B * G, B * H, B * H, B * H}, (const long[]){d, d, d, d, 1});
    qz = qw, doz = dow, Dz = Dw;
  } else {
    memcpy(cur, k, sizeof(float) * (size_t)XQ);
    memcpy(cur + XQ, v, sizeof(float) * (size_t)XV);
  }
  for (int t = 0; t < rg.S; t++) {
    struct ring_xfer xkv = {0}, xacc = {0};
    if (t < rg.S - 1) ring_start(&rg, cur, nxt, (size_t)XKV, RING_TAG_KV, &xkv);
    if (t > 0) ring_start(&rg, done, in, (size_t)XKV, RING_TAG_ACC, &xacc);
    memset(part, 0, sizeof(float) * (size_t)XKV);
    const int src = (rg.me - t + rg.S) % rg.S;
#pragma omp parallel
    {
      float *scratch = mem_alloc(MEM_WORKSPACE, sizeof(float) * tile_scratch(st, st->tile));
#pragma omp for schedule(dynamic, 1)
      for (long b = 0; b < B; b++)
        for (int p = 0; p < rg.pieces; p++)
          for (int kp = 0; kp < rg.pieces; kp++) {
            const struct fish_rows x = {qz + (b * G * T + p * L) * d,
                                        cur + (b * G * T + kp * L) * d,
                                        cur + XQ + (b * H * T + kp * L) * d,
                                        T,
                                        T,
                                        ring_offset(&rg, rg.me, p),
                                        ring_offset(&rg, src, kp),
                                        ctx->sample0 + b};
            const struct fish_grads g = {dqz + (b * G * T + p * L) * d,
                                         part + (b * G * T + kp * L) * d,
                                         part + XQ + (b * H * T + kp * L) * d,
                                         dpb + b * np,
                                         doz + (b * H * T + p * L) * d,
                                         lse + b * H * T + p * L,
                                         Dz + b * H * T + p * L};
            fish_grad(st, fp, ctx, &x, g, L, L, mask_of(ctx), (int)d, scratch);
          }
      mem_free(scratch);
    }
    if (t > 0) {
      ring_finish(&xacc);
      for (long i = 0; i < XKV; i++) part[i] += in[i];
    }
    if (t < rg.S - 1) {
      ring_finish(&xkv);
      float *tmp = cur;
      cur = nxt;
      nxt = tmp;
    }
    float *tmp = done;
    done = part;
    part = tmp;
  }
  struct ring_xfer xacc;
  ring_start(&rg, done, in, (size_t)XKV, RING_TAG_ACC, &xacc); /* home: my dk, dv */
  ring_finish(&xacc);
  add_param_grads(dparams, dpb, B, np);
  const float *hq = NULL, *hk = in, *hv = in + XQ;
  if (zig) { /* back to the contiguous slab, into acc[0, …) (free by now: `in` is acc + 2 XKV) */
    ring_move(&rg, false, 3, (const float *[]){dqz, in, in + XQ},
              (float *[]){acc, acc + XQ, acc + 2 * XQ}, (const long[]){B * G, B * G, B * H},
              (const long[]){d, d, d});
    hq = acc, hk = acc + XQ, hv = acc + 2 * XQ;
  }
  for (long i = 0; i < XQ; i++) {
    if (hq) dq[i] += hq[i];
    dk[i] += hk[i];
  }
  for (long i = 0; i < XV; i++) dv[i] += hv[i];
  mem_free(zbuf);
  mem_free(dpb);
  mem_free(D);
  mem_free(acc);
  mem_free(kv);
}

/* ---------------------------------------------------------------------------------------------
 * the ops */

static bool distributed(const struct attn_ctx *ctx) { return ctx->comm && ctx->comm->S > 1; }

static size_t fish_saved_floats(const struct attn_ctx *ctx) {
  return (size_t)(ctx->dims.B * ctx->dims.H * ctx->dims.T); /* lse */
}

static void fish_forward(struct attn_ctx *ctx, float *out, float *saved, const float *q,
                         const float *k, const float *v, const float *params) {
  const struct fish_state *st = ctx->state;
  const struct attn_dims *dm = &ctx->dims;
  const struct fish_params fp = params_view(st, params);
  if (!distributed(ctx)) {
    slab_forward(ctx, &fp, out, saved, q, dm->t0, k, v, dm->T, dm->t0);
  } else if (st->band > 0) {
    struct halo h;
    float *ext = band_halo(ctx, &h, k, v);
    const long E = h.hi - h.lo;
    slab_forward(ctx, &fp, out, saved, q, dm->t0, ext, ext + dm->B * st->G * E * dm->d, E, h.lo);
    mem_free(ext);
    halo_free(&h);
  } else {
    ring_forward(ctx, &fp, out, saved, q, k, v);
  }
}

static void fish_backward(struct attn_ctx *ctx, float *dq, float *dk, float *dv, float *dparams,
                          const float *dout, const float *q, const float *k, const float *v,
                          const float *params, const float *out, const float *saved) {
  const struct fish_state *st = ctx->state;
  const struct attn_dims *dm = &ctx->dims;
  const struct fish_params fp = params_view(st, params);
  if (!distributed(ctx)) {
    slab_backward(ctx, &fp, dq, dk, dv, dparams, dout, q, dm->t0, k, v, dm->T, dm->t0, out, saved);
  } else if (st->band > 0) {
    struct halo h;
    float *ext = band_halo(ctx, &h, k, v);
    const long E = h.hi - h.lo, rk = dm->B * st->G, rv = dm->B * st->H, d = dm->d;
    float *dext = mem_alloc(MEM_WORKSPACE, sizeof(float) * (size_t)((rk + rv) * E * d));
    slab_backward(ctx, &fp, dq, dext, dext + rk * E * d, dparams, dout, q, dm->t0, ext,
                  ext + rk * E * d, E, h.lo, out, saved);
    float *dkv = mem_alloc(MEM_COMM, sizeof(float) * (size_t)((rk + rv) * dm->T * d));
    halo_scatter_add(&h, ctx->comm, dkv, dext, rk + rv, d);
    for (long i = 0; i < rk * dm->T * d; i++) dk[i] += dkv[i];
    for (long i = 0; i < rv * dm->T * d; i++) dv[i] += dkv[rk * dm->T * d + i];
    mem_free(dkv);
    mem_free(dext);
    mem_free(ext);
    halo_free(&h);
  } else {
    ring_backward(ctx, &fp, dq, dk, dv, dparams, dout, q, k, v, out, saved);
  }
}

/* ---------------------------------------------------------------------------------------------
 * diagnostics, FLOPs, set-up and the ops tables */

/* The score of head h for rows that hold every global head's q (resp. k), G·d wide. */
struct fish_score_user {
  const struct fish_state *st;
  const struct fish_params *fp;
  int h;
};

static double fish_score(const struct attn_ctx *ctx, const float *qi, long i, const float *kj,
                         long j, long width, const void *user) {
  const struct fish_score_user *u = user;
  const struct fish_state *st = u->st;
  long lo, hi;
  key_range(mask_of(ctx), i, &lo, &hi);
  if (j < lo || j > hi) return -INFINITY;
  const long d = width / st->G;
  double s[64], l = 0.0; /* G < H ≤ 1024 heads, but G is small: checked at setup */
  for (int k = 0; k < st->G; k++) {
    double dot = 0.0;
    for (long c = 0; c < d; c++) dot += (double)qi[k * d + c] * kj[k * d + c];
    s[k] = dot;
  }
  if (st->mix == FISH_LINEAR) {
    for (int k = 0; k < st->G; k++) l += u->fp->P[u->h * st->G + k] * s[k];
  } else {
    l = u->fp->b2[u->h];
    for (int r = 0; r < st->R; r++) {
      double z = u->fp->b1[r];
      for (int k = 0; k < st->G; k++) z += u->fp->W1[r * st->G + k] * s[k];
      l += u->fp->W2[u->h * st->R + r] * (z > 0 ? z : 0);
    }
  }
  return l / sqrt((double)d);
}

/* Each value head's softmax rows over the keys it may see (no noise: diagnostics are not
 * training), sampled and banded as `full`'s are. */
static long fish_diagnostics(struct attn_ctx *ctx, double *mass, double *entropy, const float *q,
                             const float *k, const float *v, const float *params) {
  const struct fish_state *st = ctx->state;
  const struct attn_dims *dm = &ctx->dims;
  const struct fish_params fp = params_view(st, params);
  const long T = dm->T, d = dm->d, G = st->G;
  const int bands = attention_diag_bands(ctx->cfg, dm->n);
  float *qc = mem_alloc(MEM_WORKSPACE, sizeof(float) * (size_t)(T * G * d));
  float *kc = mem_alloc(MEM_WORKSPACE, sizeof(float) * (size_t)(T * G * d));
  for (long t = 0; t < T; t++) /* batch element 0: rows of the G heads side by side */
    for (long g = 0; g < G; g++) {
      memcpy(qc + (t * G + g) * d, q + (g * T + t) * d, sizeof(float) * (size_t)d);
      memcpy(kc + (t * G + g) * d, k + (g * T + t) * d, sizeof(float) * (size_t)d);
    }
  long nq = 0;
  for (int h = 0; h < st->H; h++) {
    const struct fish_score_user u = {st, &fp, h};
    nq = attention_diag_rows(ctx, mass + h * bands, entropy + h, qc, kc, G * d,
                             ATTENTION_DIAG_QUERIES, fish_score, &u);
  }
  mem_free(qc);
  mem_free(kc);
  return nq;
}

/* Forward FLOPs of this rank's share: per allowed (query, key) pair, the G global scores (2·d
 * each), the mixing, and the H heads' values (2·d each). */
static double fish_flops(const struct attn_ctx *ctx, double *p2p_flops) {
  const struct fish_state *st = ctx->state;
  const double G = st->G, H = st->H, R = st->R, d = (double)ctx->dims.d;
  const double mix = st->mix == FISH_LINEAR ? 2.0 * H * G : 2.0 * R * G + 2.0 * H * R;
  /* exact_attention_flops counts 4·d per pair per head over B·H heads */
  const double pairs = exact_attention_flops(ctx, st->band) / (4.0 * d * (double)ctx->dims.H);
  *p2p_flops = 0.0;
  return pairs * (2.0 * d * G + mix + 2.0 * d * H);
}

/* FiSH's own rules: fewer global heads than value heads, and at most 64 (fish_score's array). */
static bool fish_check(const struct config *cfg, long n, int seq_ranks, struct attn_refusal *r) {
  const int G = cfg->attention.fish_global_heads, H = cfg->model.heads;
  if (G >= H)
    return attention_refuse(r, "attention.fish.global_heads model.heads attention.heads_mode",
                            "attention.fish.global_heads = %d must be fewer than model.heads = %d",
                            G, H);
  if (G > 64)
    return attention_refuse(r, "attention.fish.global_heads",
                            "attention.fish.global_heads = %d: at most 64 are supported", G);
  return false;
}

static void *setup_common(const struct config *cfg, const struct attn_dims *dims, long band) {
  struct fish_state *st = fish_setup(cfg, dims);
  st->band = band;
  const int block = cfg->attention.full_block;
  int tile = block;
  if (band > 0) { /* about half the band, as local's tiles (full.c) */
    tile = 16;
    while (tile < block && 2 * tile < band) tile *= 2;
    tile = tile < block ? tile : block;
  }
  st->tile = tile;
  return st;
}

static void *fish_full_setup(const struct config *cfg, const struct attn_dims *dims) {
  return setup_common(cfg, dims, 0);
}

static void *fish_local_setup(const struct config *cfg, const struct attn_dims *dims) {
  return setup_common(cfg, dims, cfg->attention.local_band);
}

struct attn_variant attention_fish_full = {
    .name = "full",
    .params_name = "fish",
    .keys_prefix = "fish",
    .causal_ok = true,
    .bidir_ok = true,
    .check = fish_check,
    .describe = fish_describe,
    .init_param = fish_init_param,
    .setup = fish_full_setup,
    .teardown = fish_teardown,
    .diagnostics = fish_diagnostics,
    .flops = fish_flops,
    .cpu = {.saved_floats = fish_saved_floats, .forward = fish_forward, .backward = fish_backward},
};

struct attn_variant attention_fish_local = {
    .name = "local",
    .params_name = "fish",
    .keys_prefix = "fish",
    .causal_ok = true,
    .bidir_ok = true,
    .check = fish_check,
    .describe = fish_describe,
    .init_param = fish_init_param,
    .setup = fish_local_setup,
    .teardown = fish_teardown,
    .diagnostics = fish_diagnostics,
    .flops = fish_flops,
    .cpu = {.saved_floats = fish_saved_floats, .forward = fish_forward, .backward = fish_backward},
};
