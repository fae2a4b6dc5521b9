/* `rmfa` (SPEC §6.8, Macformer): ppSBN rows over d^¼ through D random Maclaurin features Φ, then
 * kernelized.c's sums with the max(1, ·) denominator, and ppSBN's γ [H, d] after. The degrees
 * (P(N) ∝ 2^−(N+1), N = 1..20; per run) and the Rademacher vectors ω (per layer) are drawn from the
 * run seed once and kept as frozen tensors attn/rmfa/{degree [D], omega [Σ N_j, d]}, which a
 * restart (or a kernel file's own draw) supplies. Φ is made per chunk of rows: O(n·D + D·d). */
#include "attention/rmfa.h"

#include <cblas.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "core/memory.h"
#include "core/rng.h"

#define PPSBN_EPS 1e-12

static const char *const kernel_names[] = {"exp", "inv", "log", "trigh", "sqrt"};

enum rmfa_kernel rmfa_kernel_parse(const char *name) {
  for (int i = 0; i < 5; i++)
    if (strcmp(name, kernel_names[i]) == 0) return (enum rmfa_kernel)i;
  error("rmfa.kernel = %s is not a kernel", name);
}

double rmfa_coefficient(enum rmfa_kernel kernel, int N) {
  switch (kernel) {
    case RMFA_EXP:
    case RMFA_TRIGH: { /* cosh + sinh = exp: 1/N! */
      double a = 1.0;
      for (int i = 2; i <= N; i++) a /= i;
      return a;
    }
    case RMFA_INV:
      return 1.0;
    case RMFA_LOG:
      return N == 0 ? 1.0 : 1.0 / N;
    case RMFA_SQRT: { /* 2 − √(1−t) = 1 + t/2 + t²/8 + t³/16 + …: a_{N+1} = a_N (2N−1)/(2N+2) */
      if (N == 0) return 1.0;
      double a = 0.5;
      for (int i = 1; i < N; i++) a *= (2.0 * i - 1.0) / (2.0 * i + 2.0);
      return a;
    }
  }
  return 0.0;
}

/* P(N) ∝ 2^−(N+1) on N = 1 .. 20. */
static double degree_probability(int N) {
  double z = 0.0;
  for (int i = 1; i <= RMFA_MAX_DEGREE; i++) z += ldexp(1.0, -(i + 1));
  return ldexp(1.0, -(N + 1)) / z;
}

/* The degree of feature j ≥ 1, by inverse CDF of one uniform keyed by (seed, j). */
static int draw_degree(uint64_t seed, int j) {
  const double u = rng_uniform_double(seed, RNG_FEATURES, 0, (uint64_t)j, 0);
  double cdf = 0.0;
  for (int N = 1; N < RMFA_MAX_DEGREE; N++) {
    cdf += degree_probability(N);
    if (u < cdf) return N;
  }
  return RMFA_MAX_DEGREE;
}

struct rmfa_options rmfa_options_read(const struct config *cfg) {
  const struct config_attention *at = &cfg->attention;
  struct rmfa_options o = {.features = at->rmfa_features,
                           .kernel = rmfa_kernel_parse(at->rmfa_kernel),
                           .ppsbn = at->rmfa_ppsbn,
                           .omega_rows = at->rmfa_omega_rows,
                           .seed = cfg->run.seed};
  if (o.omega_rows <= 0) {
    o.omega_rows = 0;
    for (int j = 1; j < o.features; j++) o.omega_rows += draw_degree(o.seed, j);
  }
  return o;
}

/* ---------------------------------------------------------------------------------------------
 * parameters: degree [D] and omega [Σ N_j, d] (frozen), gamma [H, d] with ppSBN */

static void rmfa_describe(const struct config *cfg, long n, struct param_list *list) {
  const struct rmfa_options o = rmfa_options_read(cfg);
  const long D = o.features, d = cfg->model.dim / cfg->model.heads;
  const long omega[2] = {o.omega_rows, d}, gamma[2] = {cfg->model.heads, d};
  param_list_freeze(list, param_list_add(list, "degree", 1, &D, false, INIT_CUSTOM, 0.0f));
  param_list_freeze(list, param_list_add(list, "omega", 2, omega, false, INIT_CUSTOM, 0.0f));
  if (o.ppsbn) param_list_add(list, "gamma", 2, gamma, false, INIT_ONE, 0.0f);
}

/* Another draw than the seed's: omega [Σ N_j, d] with as many rows as its degrees ask for (1 to
 * 20 per feature); rmfa_features_open checks them against the degrees. */
static bool rmfa_adopt_shape(struct config *cfg, const char *name, int ndim, const long *shape) {
  const long D = cfg->attention.rmfa_features, d = cfg->model.dim / cfg->model.heads;
  if (strcmp(name, "omega") != 0 || ndim != 2 || shape[1] != d || shape[0] < D - 1 ||
      shape[0] > RMFA_MAX_DEGREE * (D - 1))
    return false;
  cfg->attention.rmfa_omega_rows = (int)shape[0];
  return true;
}

static void rmfa_init_param(const struct config *cfg, const struct param_desc *p, float *data) {
  const uint64_t seed = rmfa_options_read(cfg).seed;
  if (strcmp(p->name, "degree") == 0) {
    data[0] = 0.0f;
    for (long j = 1; j < p->shape[0]; j++) data[j] = (float)draw_degree(seed, (int)j);
  } else if (strcmp(p->name, "omega") == 0) {
    const long rows = p->shape[0], d = p->shape[1];
    for (long r = 0; r < rows; r++)
      for (long c = 0; c < d; c++)
        data[r * d + c] =
            rng_bits(seed, RNG_FEATURES, 1 + (uint64_t)p->layer, (uint64_t)r, (uint64_t)c) & 1
                ? 1.0f
                : -1.0f;
  } else {
    error("rmfa has no custom initialisation for %s", p->name);
  }
}

void rmfa_features_open(struct rmfa_features *rf, const struct rmfa_options *o, const float *params,
                        int d) {
  memset(rf, 0, sizeof *rf);
  const int D = o->features;
  const enum rmfa_kernel kernel = o->kernel;
  rf->D = D;
  rf->d = d;
  rf->ppsbn = o->ppsbn;
  rf->scale = (float)pow((double)d, -0.25);
  rf->degree = xcalloc((size_t)D, sizeof(int));
  rf->offset = xcalloc((size_t)D, sizeof(int));
  rf->coef = xcalloc((size_t)D, sizeof(float));
  rf->coef[0] = (float)sqrt(rmfa_coefficient(kernel, 0));
  const int expected = o->omega_rows;
  for (int j = 1; j < D; j++) {
    const float g = params[j];
    const int N = (int)g;
    if (g != (float)N || N < 1 || N > RMFA_MAX_DEGREE)
      error("rmfa: stored degree %d is %g, not a whole number in [1, %d] (corrupt checkpoint?)", j,
            (double)g, RMFA_MAX_DEGREE);
    rf->degree[j] = N;
    rf->offset[j] = rf->rows;
    rf->rows += N;
    rf->coef[j] =
        (float)(sqrt(rmfa_coefficient(kernel, N) / degree_probability(N)) / sqrt((double)(D - 1)));
  }
  if (rf->rows != expected)
    error("rmfa: the stored degrees need %d rows of omega, the tensor has %d", rf->rows, expected);
  rf->omega = params + param_aligned((size_t)D);
}

void rmfa_features_close(struct rmfa_features *rf) {
  free(rf->degree);
  free(rf->offset);
  free(rf->coef);
  memset(rf, 0, sizeof *rf);
}

/* ---------------------------------------------------------------------------------------------
 * the feature map */

/* u (rows, d) = the rows the features read: ppSBN (standardise, unit L2) or raw, over d^¼;
 * norm (rows, 2) keeps rstd and the L2 norm of the standardised row for backward. */
static void input_rows(const struct rmfa_features *rf, float *u, float *norm, const float *x,
                       long rows) {
  const int d = rf->d;
  const float s = rf->scale;
  for (long i = 0; i < rows; i++) {
    const float *xi = x + i * d;
    float *ui = u + i * d;
    if (!rf->ppsbn) {
      for (int c = 0; c < d; c++) ui[c] = xi[c] * s;
      continue;
    }
    float mean = 0.0f, var = 0.0f;
#pragma omp simd reduction(+ : mean)
    for (int c = 0; c < d; c++) mean += xi[c];
    mean /= (float)d;
#pragma omp simd reduction(+ : var)
    for (int c = 0; c < d; c++) var += (xi[c] - mean) * (xi[c] - mean);
    var /= (float)d;
    const float rstd = 1.0f / sqrtf(var + (float)PPSBN_EPS);
    float l2 = 0.0f;
#pragma omp simd reduction(+ : l2)
    for (int c = 0; c < d; c++) {
      ui[c] = (xi[c] - mean) * rstd;
      l2 += ui[c] * ui[c];
    }
    const float len = sqrtf(l2), inv = len > 0.0f ? s / len : 0.0f;
    for (int c = 0; c < d; c++) ui[c] *= inv;
    norm[2 * i] = rstd;
    norm[2 * i + 1] = len;
  }
}

/* dx (rows, d) += the transpose of input_rows for du (rows, d), which it overwrites; u as
 * input_rows made it. */
static void input_rows_backward(const struct rmfa_features *rf, float *dx, float *du,
                                const float *u, const float *norm, long rows) {
  const int d = rf->d;
  const float s = rf->scale;
  for (long i = 0; i < rows; i++) {
    float *dy = du + i * d, *dxi = dx + i * d;
    const float *ui = u + i * d;
    if (!rf->ppsbn) {
      for (int c = 0; c < d; c++) dxi[c] += dy[c] * s;
      continue;
    }
    const float rstd = norm[2 * i], len = norm[2 * i + 1];
    if (!(len > 0.0f)) continue; /* a constant row maps to 0: no gradient */
    /* u = s·w with w = y/len the unit row and y the standardised row: first dy, the gradient of
     * y (written over du), then the standardisation's transpose, as a layer norm's */
    const float to_w = 1.0f / s, to_y = len / s; /* w = u/s, y = u·len/s */
    float wdu = 0.0f;
#pragma omp simd reduction(+ : wdu)
    for (int c = 0; c < d; c++) wdu += ui[c] * to_w * dy[c];
    float mdy = 0.0f, mdyy = 0.0f;
#pragma omp simd reduction(+ : mdy, mdyy)
    for (int c = 0; c < d; c++) {
      dy[c] = (dy[c] - ui[c] * to_w * wdu) * (s / len);
      mdy += dy[c];
      mdyy += dy[c] * ui[c] * to_y;
    }
    mdy /= (float)d;
    mdyy /= (float)d;
    for (int c = 0; c < d; c++) dxi[c] += rstd * (dy[c] - mdy - ui[c] * to_y * mdyy);
  }
}

/* scratch: u (c, d), norm (c, 2), P (c, rows), dP (c, rows), du (c, d) */
struct map_scratch {
  float *u, *norm, *P, *dP, *du;
};

static struct map_scratch scratch_layout(const struct rmfa_features *rf, float *s) {
  const size_t c = KZ_BLOCK, d = (size_t)rf->d, R = (size_t)rf->rows;
  struct map_scratch m;
  m.u = s, s += c * d;
  m.norm = s, s += 2 * c;
  m.P = s, s += c * R;
  m.dP = s, s += c * R;
  m.du = s;
  return m;
}

/* P (rows, Σ N) = u Ωᵀ: every projection ω_{j,t}ᵀ u_i. */
static void projections(const struct rmfa_features *rf, struct map_scratch *m, const float *x,
                        long rows) {
  input_rows(rf, m->u, m->norm, x, rows);
  if (rf->rows > 0)
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)rows, rf->rows, rf->d, 1.0f, m->u,
                rf->d, rf->omega, rf->d, 0.0f, m->P, rf->rows);
}

static void map_forward(const struct kz_map *map, float *phi, const float *x, long rows,
                        float *scratch) {
  const struct rmfa_features *rf = map->data;
  struct map_scratch m = scratch_layout(rf, scratch);
  projections(rf, &m, x, rows);
  for (long i = 0; i < rows; i++) {
    const float *P = m.P + i * rf->rows;
    float *f = phi + i * rf->D;
    f[0] = rf->coef[0];
    for (int j = 1; j < rf->D; j++) {
      float prod = rf->coef[j];
      for (int t = 0; t < rf->degree[j]; t++) prod *= P[rf->offset[j] + t];
      f[j] = prod;
    }
  }
}

static void map_backward(const struct kz_map *map, float *dx, const float *dphi, const float *x,
                         long rows, float *scratch, bool primed) {
  const struct rmfa_features *rf = map->data;
  struct map_scratch m = scratch_layout(rf, scratch);
  if (!primed) projections(rf, &m, x, rows); /* else map_forward left u, norm and P */
  for (long i = 0; i < rows; i++) {
    const float *P = m.P + i * rf->rows, *g = dphi + i * rf->D;
    float *dP = m.dP + i * rf->rows;
    for (int j = 1; j < rf->D; j++) { /* d/dP_t of c Π_t P_t = c Π_{t' ≠ t} P_t' */
      const int N = rf->degree[j], o = rf->offset[j];
      float before[RMFA_MAX_DEGREE + 1];
      before[0] = g[j] * rf->coef[j];
      for (int t = 0; t < N; t++) before[t + 1] = before[t] * P[o + t];
      float after = 1.0f;
      for (int t = N - 1; t >= 0; t--) {
        dP[o + t] = before[t] * after;
        after *= P[o + t];
      }
    }
  }
  if (rf->rows > 0)
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)rows, rf->d, rf->rows, 1.0f, m.dP,
                rf->rows, rf->omega, rf->d, 0.0f, m.du, rf->d);
  else
    memset(m.du, 0, sizeof(float) * (size_t)(rows * rf->d));
  input_rows_backward(rf, dx, m.du, m.u, m.norm, rows);
}

struct kz_map rmfa_map(const struct rmfa_features *rf) {
  const size_t c = KZ_BLOCK;
  return (struct kz_map){
      .F = rf->D,
      .d = rf->d,
      .scratch_floats = 2 * c * (size_t)rf->d + 2 * c + 2 * c * (size_t)rf->rows,
      .forward = map_forward,
      .backward = map_backward,
      .flops_per_row = 2.0 * rf->d * rf->rows + rf->rows + (rf->ppsbn ? 8.0 * rf->d : rf->d),
      .data = rf};
}

/* ---------------------------------------------------------------------------------------------
 * the ops table */

/* The options of a context (setup): rmfa_options_read's, once per context. */
static void *rmfa_setup(const struct config *cfg, const struct attn_dims *dims) {
  (void)dims;
  struct rmfa_options *o = xmalloc(sizeof *o);
  *o = rmfa_options_read(cfg);
  return o;
}

static void rmfa_teardown(void *state) { free(state); }

static const struct rmfa_options *options_of(const struct attn_ctx *ctx) { return ctx->state; }

/* Where gamma starts in a layer's parameters: after degree (D) and omega (rows, d). */
static size_t gamma_offset(const struct attn_ctx *ctx) {
  const struct rmfa_options *o = options_of(ctx);
  return param_aligned((size_t)o->features) +
         param_aligned((size_t)o->omega_rows * (size_t)ctx->dims.d);
}

/* The map's size does not depend on the features' values: for saved_floats and FLOPs. */
static struct kz_map shape_map(const struct attn_ctx *ctx) {
  return (struct kz_map){.F = options_of(ctx)->features, .d = (int)ctx->dims.d};
}

static size_t rmfa_saved_floats(const struct attn_ctx *ctx) {
  const struct kz_map map = shape_map(ctx);
  const size_t X = (size_t)(ctx->dims.B * ctx->dims.H * ctx->dims.T * ctx->dims.d);
  return kz_saved_floats(ctx, &map) + (options_of(ctx)->ppsbn ? X : 0);
}

/* y (B, H, T, d) = x · γ (H, d): the output from the core's. */
static void scale_by_gamma(const struct attn_ctx *ctx, float *y, const float *x,
                           const float *gamma) {
  const struct attn_dims *dm = &ctx->dims;
  const long H = dm->H, T = dm->T, d = dm->d;
#pragma omp parallel for schedule(static)
  for (long bh = 0; bh < dm->B * H; bh++) {
    const float *g = gamma + (bh % H) * d;
    for (long t = 0; t < T; t++)
      for (long c = 0; c < d; c++) y[(bh * T + t) * d + c] = x[(bh * T + t) * d + c] * g[c];
  }
}

static void rmfa_forward(struct attn_ctx *ctx, float *out, float *saved, const float *q,
                         const float *k, const float *v, const float *params) {
  struct rmfa_features rf;
  rmfa_features_open(&rf, options_of(ctx), params, (int)ctx->dims.d);
  const struct kz_map map = rmfa_map(&rf);
  if (!rf.ppsbn) {
    kz_forward(ctx, &map, KZ_CLAMP1, out, saved, q, k, v);
  } else {
    float *core = saved + kz_saved_floats(ctx, &map);
    kz_forward(ctx, &map, KZ_CLAMP1, core, saved, q, k, v);
    scale_by_gamma(ctx, out, core, params + gamma_offset(ctx));
  }
  rmfa_features_close(&rf);
}

static void rmfa_backward(struct attn_ctx *ctx, float *dq, float *dk, float *dv, float *dparams,
                          const float *dout, const float *q, const float *k, const float *v,
                          const float *params, const float *out, const float *saved) {
  const struct attn_dims *dm = &ctx->dims;
  struct rmfa_features rf;
  rmfa_features_open(&rf, options_of(ctx), params, (int)dm->d);
  const struct kz_map map = rmfa_map(&rf);
  if (!rf.ppsbn) {
    kz_backward(ctx, &map, KZ_CLAMP1, NULL, dq, dk, dv, dout, q, k, v, out, saved);
  } else {
    const float *core = saved + kz_saved_floats(ctx, &map), *gamma = params + gamma_offset(ctx);
    const long H = dm->H, T = dm->T, d = dm->d;
    if (dparams) { /* dγ (H, d) += Σ_{b, t} dout · core, row by row in order */
      float *dgamma = dparams + gamma_offset(ctx);
      double *acc = xcalloc((size_t)d, sizeof(double));
      for (long bh = 0; bh < dm->B * H; bh++) {
        memset(acc, 0, sizeof(double) * (size_t)d);
        for (long t = 0; t < T; t++) {
          const float *g = dout + (bh * T + t) * d, *x = core + (bh * T + t) * d;
          for (long c = 0; c < d; c++) acc[c] += (double)g[c] * x[c];
        }
        for (long c = 0; c < d; c++) dgamma[(bh % H) * d + c] += (float)acc[c];
      }
      free(acc);
    }
    kz_backward(ctx, &map, KZ_CLAMP1, gamma, dq, dk, dv, dout, q, k, v, core, saved);
  }
  rmfa_features_close(&rf);
}

static long rmfa_diagnostics(struct attn_ctx *ctx, double *mass, double *entropy, const float *q,
                             const float *k, const float *v, const float *params) {
  struct rmfa_features rf;
  rmfa_features_open(&rf, options_of(ctx), params, (int)ctx->dims.d);
  const struct kz_map map = rmfa_map(&rf);
  long nq = kz_diagnostics(ctx, &map, KZ_CLAMP1, mass, entropy, q, k);
  rmfa_features_close(&rf);
  return nq;
}

static double rmfa_flops(const struct attn_ctx *ctx, double *p2p_flops) {
  const struct rmfa_options *o = options_of(ctx);
  const double d = (double)ctx->dims.d, rows = o->omega_rows;
  struct kz_map map = shape_map(ctx);
  map.flops_per_row = 2.0 * d * rows + rows + (o->ppsbn ? 8.0 * d : d);
  *p2p_flops = 0.0;
  return kz_flops(ctx, &map);
}

/* The decode cache holds the layer's features (the map points into them) and the sums. */
struct rmfa_cache {
  struct rmfa_features rf;
  void *kz;
  const float *gamma; /* (H, d), or NULL without ppSBN */
};

static void *rmfa_decode_open(const struct attn_ctx *ctx, const float *params) {
  struct rmfa_cache *c = xcalloc(1, sizeof *c);
  rmfa_features_open(&c->rf, options_of(ctx), params, (int)ctx->dims.d);
  const struct kz_map map = rmfa_map(&c->rf);
  c->kz = kz_decode_open(ctx, &map);
  c->gamma = c->rf.ppsbn ? params + gamma_offset(ctx) : NULL;
  return c;
}

static void rmfa_decode_step(struct attn_ctx *ctx, void *cache, float *out, const float *q,
                             const float *k, const float *v, long pos, const float *params) {
  struct rmfa_cache *c = cache;
  kz_decode_step(ctx, c->kz, KZ_CLAMP1, out, q, k, v);
  if (c->gamma)
    for (long e = 0; e < ctx->dims.H * ctx->dims.d; e++) out[e] *= c->gamma[e];
}

static void rmfa_decode_close(void *cache) {
  struct rmfa_cache *c = cache;
  if (!c) return;
  kz_decode_close(c->kz);
  rmfa_features_close(&c->rf);
  free(c);
}

struct attn_variant attention_rmfa = {
    .name = "rmfa",
    .causal_ok = true,
    .bidir_ok = true,
    .describe = rmfa_describe,
    .adopt_shape = rmfa_adopt_shape,
    .init_param = rmfa_init_param,
    .setup = rmfa_setup,
    .teardown = rmfa_teardown,
    .diagnostics = rmfa_diagnostics,
    .flops = rmfa_flops,
    .decode_open = rmfa_decode_open,
    .decode_step = rmfa_decode_step,
    .decode_close = rmfa_decode_close,
    .cpu = {.saved_floats = rmfa_saved_floats, .forward = rmfa_forward, .backward = rmfa_backward},
};
