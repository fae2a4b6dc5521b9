/* The upward pass of FMA (SPEC §6.4 "Summaries"), in FMM terms: P2M (tokens → a level's
 * summaries: every level for conv and avg, level 1 for m2m) and M2M (two child windows → their
 * parent, m2m), over this rank's slab; its transpose, and the parameter gradients summed over
 * heads in a fixed order. Loops run over channels innermost (weights transposed to (p, span, d)
 * by params.c) so they vectorise. FMA has no downward pass (M2L, L2L, L2P). */
#include <stdbool.h>
#include <string.h>

#include "core/timer.h"
#include "fma/fma.h"

/* ---------------------------------------------------------------------------------------------
 * the slab: under sequence parallelism this rank holds tokens [t0, t0 + T) of x. A level whose
 * windows fit in a slab (w_l ≤ T) has whole windows here; a coarser level's one window that
 * contains the slab spans several ranks: for conv and avg this rank computes the part of its sums
 * over its own tokens (the bias on the window's first rank only), which fma_let adds up; for m2m
 * fma_let gathers every rank's top window and computes every spanning window on every rank. */

/* Windows [*c0, *c1) of level l that this rank computes (whole, or its share of a spanning one). */
void fma_slab_windows(const struct fma_state *st, int l, long *c0, long *c1) {
  const long w = st->tree.window[l];
  *c0 = st->t0 / w;
  *c1 = w <= st->T ? (st->t0 + st->T) / w : *c0 + 1;
}

void fma_grad_windows(const struct fma_state *st, int l, long *c0, long *c1) {
  if (st->down == FMA_DOWN_M2M && l > 1 && st->tree.window[l] > st->T) {
    *c0 = 0;
    *c1 = st->tree.nwindows[l];
  } else {
    fma_slab_windows(st, l, c0, c1);
  }
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
      if (st->tree.window[l] > st->T) break; /* spanning: fma_let's, after its exchange */
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
 * the transposes */

/* The transpose of fma_P2M for level l: dx (the slab's tokens) += from dXl, level l's rows. */
static void fma_P2M_backward(const struct fma_state *st, int l, float *dx, const float *dXl,
                             const struct fma_down_weights *w) {
  const long d = st->d, P = st->tree.p, win = st->tree.window[l], seg = win / P;
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
    return;
  }
  const long chunk = tap_chunk(P, d);
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

void fma_upward_pass_backward(const struct fma_state *st, float *dx, float *dX,
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
  /* P2M levels: m2m's level 1, or every level */
  const int top = st->down == FMA_DOWN_M2M && st->tree.levels > 0 ? 1 : st->tree.levels;
  for (int l = 1; l <= top; l++) fma_P2M_backward(st, l, dx, dX + st->level_row[l] * d, w);
  times->p2m += timer_now() - t1;
}

void fma_upward_param_grads(const struct fma_state *st, struct fma_down_weights *dw, const float *x,
                            const float *X, const float *dX, long count) {
  if (st->down == FMA_DOWN_AVG) return;
  const long d = st->d, P = st->tree.p, T = st->T, rows = st->rows;
  for (int l = 1; l <= st->tree.levels; l++) {
    long c0, c1;
    fma_grad_windows(st, l, &c0, &c1);
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
