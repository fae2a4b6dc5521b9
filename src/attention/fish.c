/* FiSH heads (SPEC §6.9, Nguyen et al., "finite admixture of shared heads") on `full` and `local`:
 * a logits hook (exact.h) in full.c's tile loops, which own the mask, the online softmax, the
 * values and the three paths (one slab, the band's halo, the ring); this file forms the mixed
 * logits and their gradients and must not copy those loops. fma and the kernelized variants cannot
 * take FiSH heads (docs/nystrom_fish.md). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "attention/attention.h"
#include "attention/exact.h"
#include "core/error.h"
#include "core/memory.h"
#include "core/tilegemm.h"
#include "core/rng.h"

/* G = fish.global_heads query/key heads give global scores s_k(i, j) = q_k,i·k_k,j, k < G; each of
 * the H value heads takes its logits as a mixture of them — fish.mix = linear (hard FiSH):
 * ℓ_h = Σ_k P[h, k] s_k; mlp (GFiSH): ℓ_h = (W2·ReLU(W1·s + b1) + b2)_h with R = H hidden units —
 * after adding σ·ε to every s_k during training (σ = fish.noise; ε a standard normal keyed by
 * (step, layer, global head, global sample, i, j), so the same on any rank layout). Then 1/√d, the
 * mask (causal, band), softmax, times the head's values; under sequence parallelism `local`'s halo
 * and `full`'s ring carry the G key heads and the H value heads. Parameters (attn/fish/): mix
 * [H, G], or w1 [R, G], b1 [R], w2 [H, R], b2 [H]. */

enum fish_mix { FISH_LINEAR, FISH_MLP };

struct fish_state {
  int G, H, R; /* global heads, value heads, MLP hidden units */
  enum fish_mix mix;
  float sigma; /* fish.noise */
  long band;   /* 0: full */
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

static void *fish_setup(const struct config *cfg, const struct attn_dims *dims, long band) {
  struct fish_state *st = xcalloc(1, sizeof *st);
  st->G = cfg->attention.fish_global_heads;
  st->H = (int)dims->H;
  st->R = st->H;
  st->mix = mix_of(cfg);
  st->sigma = (float)cfg->attention.fish_noise;
  st->seed = cfg->run.seed;
  st->band = band;
  return st;
}

static void fish_teardown(void *state) { free(state); }

/* ---------------------------------------------------------------------------------------------
 * the logits hook: one batch element (a unit of H value heads over G global heads), a tile of
 * queries against a tile of keys */

struct fish_hook_ctx {
  const struct fish_state *st;
  struct fish_params fp;
  const struct attn_ctx *ctx; /* the noise's keys: step, layer, training, n, sample0 */
};

/* The hook's scratch tiles, after the loop's H + 1: score tiles Sg and their gradients dS (G
 * each), the MLP's pre-activations Z and their gradients dZ (R each). */
struct fish_scratch {
  float *Sg, *Z, *dZ, *dS;
};

static struct fish_scratch scratch_of(const struct fish_state *st, const struct exact_rows *x,
                                      float *scratch) {
  const size_t t2 = (size_t)x->tile * x->ktile;
  struct fish_scratch w = {.Sg = scratch + (size_t)(st->H + 1) * t2};
  w.Z = w.Sg + st->G * t2;
  w.dZ = w.Z + st->R * t2;
  w.dS = w.dZ + st->R * t2;
  return w;
}

/* Sg (G, bi, bj) = q_k k_kᵀ (+ noise), then L (H, bi, bj) = the mixed logits before 1/√d;
 * Z (R, bi, bj) keeps the MLP's pre-activations for backward. Rows i0.., columns j0.. . */
static void tile_logits(const struct fish_state *st, const struct fish_params *fp,
                        const struct attn_ctx *ctx, const struct exact_rows *x, long i0, long bi,
                        long j0, long bj, float *Sg, float *Z, float *L) {
  const long tt = bi * bj;
  const int d = x->d;
  for (int k = 0; k < st->G; k++) {
    float *s = Sg + k * tt;
    tile_sgemm(false, true, (int)bi, (int)bj, d, 1.0f, x->q + (k * x->qstride + i0) * d, d,
               x->k + (k * x->kstride + j0) * d, d, 0.0f, s, (int)bj);
    if (st->sigma > 0.0f && ctx->train) {
      const uint64_t b = (uint64_t)(ctx->sample0 + x->unit); /* a unit is a batch element */
      const uint64_t head = ((uint64_t)(ctx->layer * st->G + k) << 40) | b;
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

/* The hook's logits: the mixed logits times 1/√d (after the mixing, as FiSH has always scaled). */
static void fish_logits(const struct exact_hook *hk, const struct exact_rows *x, long i0, long bi,
                        long j0, long bj, float *L, float *scratch) {
  const struct fish_hook_ctx *f = hk->user;
  const struct fish_scratch w = scratch_of(f->st, x, scratch);
  tile_logits(f->st, &f->fp, f->ctx, x, i0, bi, j0, bj, w.Sg, w.Z, L);
  const float scale = 1.0f / sqrtf((float)x->d);
  const long n = f->st->H * bi * bj;
  for (long e = 0; e < n; e++) L[e] *= scale;
}

/* The MLP's transpose: dL (H tiles) → dZ → dS_k (G tiles, +=), and dW1, db1, dW2, db2 +=. */
static void mlp_backward(const struct fish_state *st, const struct fish_params *fp,
                         const struct fish_params *dfp, const struct fish_scratch *w,
                         const float *L, long tt) {
  const int G = st->G, H = st->H, R = st->R;
  const float *Sg = w->Sg, *Z = w->Z;
  float *dZ = w->dZ, *dS = w->dS;
  float *dW1 = (float *)dfp->W1, *db1 = (float *)dfp->b1, *dW2 = (float *)dfp->W2,
        *db2 = (float *)dfp->b2;
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

/* The hook's gradients: dL (H tiles, 1/√d applied by the loop's ds_scale) back through the
 * mixing into dS_k (G tiles) and the mixing parameters' gradients (this batch element's slot),
 * then dq_k += dS_k k_k, dk_k += dS_kᵀ q_k (the noise is additive: no gradient of its own). */
static void fish_grad(const struct exact_hook *hk, const struct exact_rows *x,
                      const struct exact_grads *g, long i0, long bi, long j0, long bj,
                      const float *L, float *scratch) {
  const struct fish_hook_ctx *f = hk->user;
  const struct fish_state *st = f->st;
  const struct fish_params *fp = &f->fp, dfp = params_view(st, g->dpar);
  const struct fish_scratch w = scratch_of(st, x, scratch);
  const int G = st->G, H = st->H, d = x->d;
  const long tt = bi * bj;
  const float *Sg = w.Sg;
  float *dS = w.dS;
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
        g->dpar[h * G + k] += acc;
      }
  } else {
    mlp_backward(st, fp, &dfp, &w, L, tt);
  }
  for (int k = 0; k < G; k++) {
    tile_sgemm(false, false, (int)bi, d, (int)bj, 1.0f, dS + k * tt, (int)bj,
               x->k + (k * x->kstride + j0) * d, d, 1.0f, g->dq + (k * x->qstride + i0) * d, d);
    tile_sgemm(true, false, (int)bj, d, (int)bi, 1.0f, dS + k * tt, (int)bj,
               x->q + (k * x->qstride + i0) * d, d, 1.0f, g->dk + (k * x->kstride + j0) * d, d);
  }
}

/* The hook for this context and these parameters (f lives as long as the hook is used). The
 * scratch is one size in both directions (forward needs only H + G + R tiles of it): the
 * workspace high-water mark in diag.h5 has always counted it so. */
static struct exact_hook fish_hook(const struct fish_hook_ctx *f) {
  const struct fish_state *st = f->st;
  const int scratch = 2 * st->G + 2 * st->R + st->H + 1;
  return (struct exact_hook){.heads = st->H,
                             .qk_heads = st->G,
                             .scratch_forward = scratch,
                             .scratch_backward = scratch,
                             .ds_scale = 1.0f / sqrtf((float)f->ctx->dims.d),
                             .param_floats = n_params(st),
                             .keep_halo = true,
                             .logits = fish_logits,
                             .grad = fish_grad,
                             .user = f};
}

/* ---------------------------------------------------------------------------------------------
 * the ops */

static struct key_mask mask_of(const struct attn_ctx *ctx) {
  const struct fish_state *st = ctx->state;
  return (struct key_mask){ctx->dims.causal, st->band};
}

static size_t fish_saved_floats(const struct attn_ctx *ctx) {
  return (size_t)(ctx->dims.B * ctx->dims.H * ctx->dims.T); /* lse */
}

static void fish_forward(struct attn_ctx *ctx, float *out, float *saved, const float *q,
                         const float *k, const float *v, const float *params) {
  const struct fish_state *st = ctx->state;
  const struct fish_hook_ctx f = {st, params_view(st, params), ctx};
  const struct exact_hook hk = fish_hook(&f);
  exact_hooked_forward(ctx, &hk, st->band, out, saved, q, k, v);
}

static void fish_backward(struct attn_ctx *ctx, float *dq, float *dk, float *dv, float *dparams,
                          const float *dout, const float *q, const float *k, const float *v,
                          const float *params, const float *out, const float *saved) {
  const struct fish_state *st = ctx->state;
  const struct fish_hook_ctx f = {st, params_view(st, params), ctx};
  const struct exact_hook hk = fish_hook(&f);
  exact_hooked_backward(ctx, &hk, st->band, NULL, dq, dk, dv, dparams, dout, q, k, v, out, saved);
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
  const int bands = ctx->opt.diag_bands;
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

static void *fish_full_setup(const struct config *cfg, const struct attn_dims *dims) {
  return fish_setup(cfg, dims, 0);
}

static void *fish_local_setup(const struct config *cfg, const struct attn_dims *dims) {
  return fish_setup(cfg, dims, cfg->attention.local_band);
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
