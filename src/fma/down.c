/* FMA summaries (SPEC §6.4 "Summaries"): the downsampling parameters (names, shapes, mean or
 * random initialisation), the upward pass — P2M (tokens → a level's summaries, for conv and avg
 * every level; for m2m level 1) and M2M (two children → parent, m2m) — and its transpose, the
 * downward pass, with the parameter gradients summed over heads in a fixed order. Loops run over
 * channels innermost (weights are transposed to (p, span, d)) so they vectorise. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "error.h"
#include "fma/fma.h"
#include "memory.h"
#include "rng.h"
#include "timer.h"

static const char *set_names[FMA_NSETS] = {"k_down", "v_down", "q_down"};

static int set_count(bool linear) { return linear ? 3 : 2; }

/* Length of the last axis of level l's weight. */
static long level_span(enum fma_downsample down, const struct fma_tree *tree, int l) {
  if (down == FMA_DOWN_M2M) return l == 1 ? tree->m : 2L * tree->p;
  return tree->window[l];
}

void fma_describe(const struct config *cfg, long n, bool linear, struct param_list *list) {
  if (cfg->attention.fma_downsample == FMA_DOWN_AVG) return; /* fixed means: nothing to learn */
  struct fma_tree tree;
  fma_tree_build(&tree, n, cfg->attention.fma_m, cfg->attention.fma_p);
  const long d = cfg->model.dim / cfg->model.heads, p = tree.p;
  for (int s = 0; s < set_count(linear); s++)
    for (int l = 1; l <= tree.levels; l++) {
      char name[PARAM_NAME];
      long wshape[3] = {d, p, level_span(cfg->attention.fma_downsample, &tree, l)};
      long bshape[2] = {d, p};
      snprintf(name, sizeof name, "%s/level_%02d/weight", set_names[s], l);
      const int k = param_list_add(list, name, 3, wshape, true, INIT_CUSTOM, 0.0f);
      /* Adam moves every tap by about lr a step, whatever the gradient's size: a summary that
       * sums `span` taps then moves by up to span·lr, which grows with the window (1024 taps at
       * n = 4096, n/4 at the top level). Scaled, the rate is lr·p/span (the mean init's tap
       * value), so a step moves a summary by about lr of its size at every level (docs/fma.md). */
      if (cfg->attention.fma_down_lr == FMA_LR_SCALED)
        list->p[k].lr_scale = (float)p / (float)wshape[2];
      snprintf(name, sizeof name, "%s/level_%02d/bias", set_names[s], l);
      param_list_add(list, name, 2, bshape, false, INIT_CUSTOM, 0.0f);
    }
}

void fma_layout_build(const struct config *cfg, long n, bool linear, struct fma_layout *layout) {
  memset(layout, 0, sizeof *layout);
  struct param_list list;
  param_list_init(&list);
  fma_describe(cfg, n, linear, &list);
  struct fma_tree tree;
  fma_tree_build(&tree, n, cfg->attention.fma_m, cfg->attention.fma_p);
  int i = 0;
  if (list.count > 0)
    for (int s = 0; s < set_count(linear); s++)
      for (int l = 1; l <= tree.levels; l++) {
        layout->weight[s][l] = list.p[i++].offset;
        layout->bias[s][l] = list.p[i++].offset;
      }
  for (int l = 1; l <= tree.levels; l++)
    layout->span[l] = level_span(cfg->attention.fma_downsample, &tree, l);
  layout->total = list.total;
  param_list_free(&list);
}

/* "k_down/level_03/weight" → set, level, is_bias. */
static void parse_name(const char *name, int *set, int *level, bool *bias) {
  *set = -1;
  for (int s = 0; s < FMA_NSETS; s++)
    if (strncmp(name, set_names[s], strlen(set_names[s])) == 0) *set = s;
  const char *lv = strstr(name, "level_");
  if (*set < 0 || !lv) error("not an fma parameter: %s", name);
  *level = atoi(lv + 6);
  *bias = strstr(name, "/bias") != NULL;
}

static uint64_t init_key(const struct param_desc *p) {
  uint64_t h = 1469598103934665603ull;
  for (const char *s = p->name; *s; s++) h = (h ^ (uint8_t)*s) * 1099511628211ull;
  return h ^ ((uint64_t)(p->layer + 1) << 48);
}

void fma_init_param(const struct config *cfg, const struct param_desc *p, float *data,
                    bool linear) {
  int set, level;
  bool bias;
  parse_name(p->name, &set, &level, &bias);
  const long d = p->shape[0], P = p->shape[1];
  /* inputs each summary sums over: w_l tokens (conv), m tokens (m2m level 1), 2p children */
  const long m = cfg->attention.fma_m;
  const long span =
      cfg->attention.fma_downsample == FMA_DOWN_M2M ? (level > 1 ? 2 * P : m) : m << (level - 1);
  /* fma_linear adds every level's output at full weight, so with value summaries at the mean a
   * fresh model's output is the near field plus L window averages; starting the value summaries
   * at 0 (biases, and the weights that read tokens: conv every level, m2m its P2M level 1 — its
   * M2M levels keep their init and sum zeros, so their gradients are not stuck at 0) lets it
   * learn as a local model first and turn the levels on as they help (docs/fma.md). */
  const bool zero_values = linear && set == FMA_V && cfg->attention.fma_linear_zero_values &&
                           (bias || cfg->attention.fma_downsample != FMA_DOWN_M2M || level == 1);
  if (zero_values) {
    memset(data, 0, sizeof(float) * p->numel);
    return;
  }
  if (cfg->attention.fma_init == FMA_INIT_RANDOM) {
    /* uniform ±1/√fan_in, as the paper's code (and PyTorch's conv default) does */
    const double bound = 1.0 / sqrt((double)span);
    const uint64_t key = init_key(p);
    for (size_t e = 0; e < p->numel; e++)
      data[e] =
          (float)(bound * (2.0 * rng_uniform_double(cfg->run.seed, RNG_INIT, key, e, 1) - 1.0));
    return;
  }
  /* mean: every learned summary starts as the avg one, bias 0 */
  memset(data, 0, sizeof(float) * p->numel);
  if (bias) return;
  for (long f = 0; f < d; f++)
    for (long r = 0; r < P; r++) {
      float *row = data + (f * P + r) * span;
      if (cfg->attention.fma_downsample == FMA_DOWN_M2M && level > 1) {
        row[2 * r] = row[2 * r + 1] = 0.5f; /* parent sub-segment r = child sub-segments 2r, 2r+1 */
      } else {
        const long seg = span / P;
        for (long t = r * seg; t < (r + 1) * seg; t++) row[t] = 1.0f / (float)seg;
      }
    }
}

/* ---------------------------------------------------------------------------------------------
 * weights in the transposed, channel-contiguous layout */

/* Causal fma_linear attends with the query summary of the sub-segment before i's (ρ − 1). That is
 * causal only if summary row r of a window reads nothing after sub-segment r, which learned conv
 * or m2m weights would otherwise do: in causal mode, tap t of q_down row r is used only when it
 * lies in sub-segments ≤ r (m2m: child rows ≤ 2r + 1). The mean init already has this form. */
static bool query_tap_used(const struct fma_state *st, enum fma_set set, int l, long r, long t) {
  if (set != FMA_Q || !st->causal) return true;
  const long P = st->tree.p, span = st->layout.span[l];
  if (st->down == FMA_DOWN_M2M && l > 1) return t <= 2 * r + 1;
  return t < (r + 1) * (span / P);
}

void fma_weights_load(const struct fma_state *st, const float *params, enum fma_set set,
                      struct fma_down_weights *w) {
  memset(w, 0, sizeof *w);
  if (st->down == FMA_DOWN_AVG) return;
  const long d = st->d, P = st->tree.p;
  for (int l = 1; l <= st->tree.levels; l++) {
    const long span = st->layout.span[l];
    w->wt[l] = mem_alloc(MEM_WORKSPACE, sizeof(float) * (size_t)(P * span * d));
    w->bt[l] = mem_alloc(MEM_WORKSPACE, sizeof(float) * (size_t)(P * d));
    if (!params) continue;
    const float *W = params + st->layout.weight[set][l], *b = params + st->layout.bias[set][l];
    for (long f = 0; f < d; f++)
      for (long r = 0; r < P; r++) {
        for (long t = 0; t < span; t++)
          w->wt[l][(r * span + t) * d + f] =
              query_tap_used(st, set, l, r, t) ? W[(f * P + r) * span + t] : 0.0f;
        w->bt[l][r * d + f] = b[f * P + r];
      }
  }
}

void fma_weights_zero(const struct fma_state *st, struct fma_down_weights *w) {
  fma_weights_load(st, NULL, FMA_K, w);
}

void fma_weights_store_grad(const struct fma_state *st, float *dparams, enum fma_set set,
                            const struct fma_down_weights *dw) {
  if (st->down == FMA_DOWN_AVG) return;
  const long d = st->d, P = st->tree.p;
  for (int l = 1; l <= st->tree.levels; l++) {
    const long span = st->layout.span[l];
    float *W = dparams + st->layout.weight[set][l], *b = dparams + st->layout.bias[set][l];
    for (long f = 0; f < d; f++)
      for (long r = 0; r < P; r++) {
        for (long t = 0; t < span; t++)
          if (query_tap_used(st, set, l, r, t))
            W[(f * P + r) * span + t] += dw->wt[l][(r * span + t) * d + f];
        b[f * P + r] += dw->bt[l][r * d + f];
      }
  }
}

void fma_weights_free(const struct fma_state *st, struct fma_down_weights *w) {
  for (int l = 0; l <= FMA_MAX_LEVELS; l++) {
    mem_free(w->wt[l]);
    mem_free(w->bt[l]);
  }
  memset(w, 0, sizeof *w);
}

/* ---------------------------------------------------------------------------------------------
 * the slab: under sequence parallelism this rank holds tokens [t0, t0 + T) of x. A level whose
 * windows fit in a slab (w_l ≤ T) has whole windows here; a coarser level's one window that
 * contains the slab spans several ranks: for conv and avg this rank computes the part of its sums
 * over its own tokens (the bias on the window's first rank only), which fma_let adds up; for m2m
 * fma_let brings the sibling child, and the parent is computed on every rank of the window. */

/* Windows [*c0, *c1) of level l that this rank computes (whole, or its share of a spanning one). */
void fma_slab_windows(const struct fma_state *st, int l, long *c0, long *c1) {
  const long w = st->tree.window[l];
  *c0 = st->t0 / w;
  *c1 = w <= st->T ? (st->t0 + st->T) / w : *c0 + 1;
}

/* Taps [*a, *b) of window c of level l that lie in this slab, and whether the bias is added here
 * (once per window: on the rank holding its first token). */
static void slab_taps(const struct fma_state *st, int l, long c, long *a, long *b, bool *bias) {
  const long w = st->tree.window[l];
  *a = st->t0 > c * w ? st->t0 - c * w : 0;
  *b = c * w + w < st->t0 + st->T ? w : st->t0 + st->T - c * w;
  *bias = c * w >= st->t0;
}

/* Taps per chunk of a conv level: p·chunk·d weights of 256 KiB, about half an L2. */
static long tap_chunk(long P, long d) {
  long c = 65536 / (P * d);
  return c > 0 ? c : 1;
}

/* Level l summaries from tokens: X_l[c·p + r] = b_r + Σ_t W[r, t] ∘ x[c·w + t] (conv, and level 1
 * of m2m), or the mean of sub-segment r (avg); over this slab's taps. x: the slab's tokens. */
static void fma_P2M(const struct fma_state *st, int l, float *Xl, const float *x,
                    const struct fma_down_weights *w) {
  const long d = st->d, P = st->tree.p, win = st->tree.window[l], seg = win / P;
  long c0, c1;
  fma_slab_windows(st, l, &c0, &c1);
  for (long c = c0; c < c1; c++) {
    long a, b;
    bool bias;
    slab_taps(st, l, c, &a, &b, &bias);
    float *out = Xl + c * P * d;
    const float *xw = x + (c * win - st->t0) * d; /* tap t is xw + t·d (a ≤ t < b) */
    if (st->down == FMA_DOWN_AVG) {
      const float inv = 1.0f / (float)seg;
      memset(out, 0, sizeof(float) * (size_t)(P * d));
      for (long t = a; t < b; t++) {
        float *o = out + (t / seg) * d;
        const float *xr = xw + t * d;
#pragma omp simd
        for (long f = 0; f < d; f++) o[f] += xr[f] * inv;
      }
      continue;
    }
    if (bias)
      memcpy(out, w->bt[l], sizeof(float) * (size_t)(P * d));
    else
      memset(out, 0, sizeof(float) * (size_t)(P * d));
  }
  if (st->down == FMA_DOWN_AVG) return;
  /* conv: taps in chunks whose weights stay in cache while every window uses them (a coarse
   * level's weights span w_l taps: streaming them once per window would be memory-bound) */
  const long chunk = tap_chunk(P, d);
  for (long t0 = 0; t0 < win; t0 += chunk) {
    const long t1 = t0 + chunk < win ? t0 + chunk : win;
    for (long c = c0; c < c1; c++) {
      long a, b;
      bool bias;
      slab_taps(st, l, c, &a, &b, &bias);
      const long ta = t0 > a ? t0 : a, tb = t1 < b ? t1 : b;
      float *out = Xl + c * P * d;
      const float *xw = x + (c * win - st->t0) * d;
      for (long t = ta; t < tb; t++) {
        const float *xr = xw + t * d;
        for (long r = 0; r < P; r++) {
          const float *wr = w->wt[l] + (r * win + t) * d;
          float *o = out + r * d;
#pragma omp simd
          for (long f = 0; f < d; f++) o[f] += wr[f] * xr[f];
        }
      }
    }
  }
}

/* Parent window c of level l from its children at level l − 1 (m2m):
 * X_l[c·p + r] = b_r + Σ_{j<2p} T[r, j] ∘ X_{l−1}[2c·p + j]. */
void fma_M2M_window(const struct fma_state *st, int l, long c, float *X,
                    const struct fma_down_weights *w) {
  const long d = st->d, P = st->tree.p;
  float *out = X + (st->level_row[l] + c * P) * d;
  memcpy(out, w->bt[l], sizeof(float) * (size_t)(P * d));
  const float *child = X + (st->level_row[l - 1] + 2 * c * P) * d; /* 2p contiguous rows */
  for (long r = 0; r < P; r++)
    for (long j = 0; j < 2 * P; j++) {
      const float *wr = w->wt[l] + (r * 2 * P + j) * d, *cr = child + j * d;
      float *o = out + r * d;
#pragma omp simd
      for (long f = 0; f < d; f++) o[f] += wr[f] * cr[f];
    }
}

/* The transpose for one parent window: dX_{l−1}[2c·p + j] += Σ_r T[r, j] ∘ dX_l[c·p + r], for
 * children j in [j0, j1) (both children: 0, 2p). */
void fma_M2M_window_backward(const struct fma_state *st, int l, long c, float *dX, long j0, long j1,
                             const struct fma_down_weights *w) {
  const long d = st->d, P = st->tree.p;
  const float *g0 = dX + (st->level_row[l] + c * P) * d;
  float *dc = dX + (st->level_row[l - 1] + 2 * c * P) * d;
  for (long r = 0; r < P; r++)
    for (long j = j0; j < j1; j++) {
      const float *wr = w->wt[l] + (r * 2 * P + j) * d, *g = g0 + r * d;
      float *o = dc + j * d;
#pragma omp simd
      for (long f = 0; f < d; f++) o[f] += wr[f] * g[f];
    }
}

void fma_upward_pass(const struct fma_state *st, float *X, const float *x,
                     const struct fma_down_weights *w, struct fma_times *times) {
  const long d = st->d;
  for (int l = 1; l <= st->tree.levels; l++) {
    double t0 = timer_now();
    if (st->down == FMA_DOWN_M2M && l > 1) {
      if (st->tree.window[l] > st->T) break; /* spanning: fma_let's hypercube exchange */
      long c0, c1;
      fma_slab_windows(st, l, &c0, &c1);
      for (long c = c0; c < c1; c++) fma_M2M_window(st, l, c, X, w);
      times->m2m += timer_now() - t0;
    } else {
      fma_P2M(st, l, X + st->level_row[l] * d, x, w);
      times->p2m += timer_now() - t0;
    }
  }
}

/* ---------------------------------------------------------------------------------------------
 * downward pass: the transposes */

void fma_downward_pass(const struct fma_state *st, float *dX, float *dx,
                       const struct fma_down_weights *w, struct fma_times *times) {
  const long d = st->d, P = st->tree.p;
  double t0 = timer_now();
  if (st->down == FMA_DOWN_M2M) /* coarse to fine: level l is complete before it is pushed down */
    for (int l = st->tree.levels; l >= 2; l--) {
      if (st->tree.window[l] > st->T) continue; /* spanning: done by fma_let */
      long c0, c1;
      fma_slab_windows(st, l, &c0, &c1);
      for (long c = c0; c < c1; c++) fma_M2M_window_backward(st, l, c, dX, 0, 2 * P, w);
    }
  double t1 = timer_now();
  times->m2m += t1 - t0;
  const int top = st->down == FMA_DOWN_M2M && st->tree.levels > 0 ? 1 : st->tree.levels;
  const long chunk = tap_chunk(P, d);
  for (int l = 1; l <= top; l++) {
    const float *dXl = dX + st->level_row[l] * d;
    const long win = st->tree.window[l], seg = win / P;
    long c0, c1;
    fma_slab_windows(st, l, &c0, &c1);
    if (st->down == FMA_DOWN_AVG) {
      const float inv = 1.0f / (float)seg;
      for (long c = c0; c < c1; c++) {
        long a, b;
        bool bias;
        slab_taps(st, l, c, &a, &b, &bias);
        for (long t = a; t < b; t++) {
          float *o = dx + (c * win + t - st->t0) * d;
          const float *g = dXl + (c * P + t / seg) * d;
#pragma omp simd
          for (long f = 0; f < d; f++) o[f] += g[f] * inv;
        }
      }
      continue;
    }
    for (long tc = 0; tc < win; tc += chunk) { /* as in P2M: a chunk of weights stays in cache */
      const long tc1 = tc + chunk < win ? tc + chunk : win;
      for (long c = c0; c < c1; c++) {
        long a, b;
        bool bias;
        slab_taps(st, l, c, &a, &b, &bias);
        const long ta = tc > a ? tc : a, tb = tc1 < b ? tc1 : b;
        for (long t = ta; t < tb; t++) {
          float *o = dx + (c * win + t - st->t0) * d;
          for (long r = 0; r < P; r++) {
            const float *g = dXl + (c * P + r) * d, *wr = w->wt[l] + (r * win + t) * d;
#pragma omp simd
            for (long f = 0; f < d; f++) o[f] += wr[f] * g[f];
          }
        }
      }
    }
  }
  times->p2m += timer_now() - t1;
}

void fma_param_grads(const struct fma_state *st, struct fma_down_weights *dw, const float *x,
                     const float *X, const float *dX, long count) {
  if (st->down == FMA_DOWN_AVG) return;
  const long d = st->d, P = st->tree.p, T = st->T, rows = st->rows;
  for (int l = 1; l <= st->tree.levels; l++) {
    long c0, c1;
    fma_slab_windows(st, l, &c0, &c1);
    const bool from_children = st->down == FMA_DOWN_M2M && l > 1;
    const long span = st->layout.span[l], win = st->tree.window[l];
    /* weights: tap t's slots (every r) are owned by one iteration, which reads each source row
     * once for all p summaries; heads and windows in a fixed order */
#pragma omp parallel for schedule(static)
    for (long t = 0; t < span; t++) {
      for (long h = 0; h < count; h++) {
        const float *dXl = dX + h * rows * d + st->level_row[l] * d;
        for (long c = c0; c < c1; c++) {
          long a = 0, b = span;
          bool bias;
          if (!from_children) slab_taps(st, l, c, &a, &b, &bias);
          if (t < a || t >= b) continue;
          const float *src = from_children
                                 ? X + h * rows * d + (st->level_row[l - 1] + 2 * c * P + t) * d
                                 : x + h * T * d + (c * win + t - st->t0) * d;
          for (long r = 0; r < P; r++) {
            const float *g = dXl + (c * P + r) * d;
            float *acc = dw->wt[l] + (r * span + t) * d;
#pragma omp simd
            for (long f = 0; f < d; f++) acc[f] += g[f] * src[f];
          }
        }
      }
    }
    /* bias: once per window; for a conv window shared by several ranks, on its first rank (the
     * others hold the same total gradient); an m2m parent's gradient is this rank's share */
    for (long h = 0; h < count; h++) {
      const float *dXl = dX + h * rows * d + st->level_row[l] * d;
      for (long c = c0; c < c1; c++) {
        long a, b;
        bool bias = true;
        if (!from_children) slab_taps(st, l, c, &a, &b, &bias);
        if (!bias) continue;
        for (long r = 0; r < P; r++) {
          const float *g = dXl + (c * P + r) * d;
          float *acc = dw->bt[l] + r * d;
#pragma omp simd
          for (long f = 0; f < d; f++) acc[f] += g[f];
        }
      }
    }
  }
}
