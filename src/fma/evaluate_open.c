/* fma evaluation with opened windows (SPEC §6.4a), from the far rows the opening pass (fma/open.c)
 * left: one softmax per query over its near field (P2P) and its far row (listed summaries, opened
 * windows' children and tokens); forward's opened-window values source by source, each query's
 * products alone (its output never depends on who else opened a window); backward one GEMM per
 * group of the queries that opened a window. */
#include <cblas.h>
#include <math.h>
#include <string.h>

#include "core/error.h"
#include "core/memory.h"
#include "core/timer.h"
#include "fma/open.h"
#include "nn/vecmath.h"

/* Where the gradients of a level-l slot source's rows go (fma_open_source_rows' rows): the
 * summaries' dK or dV rows, or fine block c's dk or dv rows (local, or the fetched block's). */
static float *source_grad_rows(const struct fma_state *st, const struct fma_open_work *w,
                               const struct fma_open_args *a, const struct fma_open_grads *g,
                               long h, int l, long c, bool values) {
  if (l >= 2) {
    float *dX = values ? g->dV : g->dK;
    return dX + (h * st->rows + st->level_row[l - 1] + 2 * c * st->tree.p) * st->d;
  }
  const float *k, *v;
  float *dk, *dv;
  fma_open_block_rows(st, w, a, h, c, &k, &v, g->dk, g->dv, &dk, &dv);
  return values ? dv : dk;
}

/* A group of up to FMA_OPEN_GROUP members of one source: their queries (slab rows) and slots. */
struct group {
  const int32_t *who, *slot;
  long count;
  long col, width; /* the slot columns of level l: col + slot·width .. + width */
};

/* Gather each member's slot columns of rows (T, ld) into dst (count, width). */
static void group_gather_cols(float *dst, const float *rows, long ld, const struct group *gr) {
  for (long x = 0; x < gr->count; x++)
    memcpy(dst + x * gr->width, rows + (long)gr->who[x] * ld + gr->col + gr->slot[x] * gr->width,
           sizeof(float) * (size_t)gr->width);
}

/* Gather each member's row of x (T, d) into dst (count, d). */
static void group_gather_rows(float *dst, const float *x, long d, const struct group *gr) {
  for (long y = 0; y < gr->count; y++)
    memcpy(dst + y * d, x + (long)gr->who[y] * d, sizeof(float) * (size_t)d);
}

/* x (T, d) += src (count, d) at each member's row. */
static void group_add_rows(float *x, const float *src, long d, const struct group *gr) {
  for (long y = 0; y < gr->count; y++) {
    float *o = x + (long)gr->who[y] * d;
    const float *s = src + y * d;
#pragma omp simd
    for (long f = 0; f < d; f++) o[f] += s[f];
  }
}

/* Calls fn for every group of every window opened at every level, for head h. */
typedef void (*group_fn)(const struct fma_state *st, struct fma_open_work *w,
                         const struct fma_open_args *a, long h, int l, long c,
                         const struct group *gr, void *ctx);
static void for_each_group(const struct fma_state *st, struct fma_open_work *w,
                           const struct fma_open_args *a, long h, group_fn fn, void *ctx) {
  const long T = st->T, ndec = st->open.ndec;
  for (int l = st->tree.levels; l >= 1; l--) {
    const int32_t *start = w->start + h * w->starts + w->lvl_start[l];
    const long base = h * T * ndec + T * st->open.dec_off[l];
    for (long c = 0; c < st->tree.nwindows[l]; c++)
      for (long g0 = start[c]; g0 < start[c + 1]; g0 += FMA_OPEN_GROUP) {
        const long ns = start[c + 1] - g0 < FMA_OPEN_GROUP ? start[c + 1] - g0 : FMA_OPEN_GROUP;
        const struct group gr = {w->who + base + g0, w->slot + base + g0, ns, st->open.col[l],
                                 st->open.slot_width[l]};
        fn(st, w, a, h, l, c, &gr, ctx);
      }
  }
}

/* ---------------------------------------------------------------------------------------------
 * forward */

/* One softmax per row over the near scores S (m, ldS; nn columns) and the far row F (m, width);
 * both become probabilities, lse[r] = log Σ exp. */
static void rows_joint_softmax(float *S, long ldS, long nn, float *F, long width, long m,
                               float *lse) {
  for (long r = 0; r < m; r++) {
    float *s = S + r * ldS, *f = F + r * width;
    float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
    for (long c = 0; c < nn; c++) mx = s[c] > mx ? s[c] : mx;
#pragma omp simd reduction(max : mx)
    for (long c = 0; c < width; c++) mx = f[c] > mx ? f[c] : mx;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (long c = 0; c < nn; c++) {
      s[c] = expf(s[c] - mx);
      sum += s[c];
    }
#pragma omp simd reduction(+ : sum)
    for (long c = 0; c < width; c++) {
      f[c] = expf(f[c] - mx);
      sum += f[c];
    }
    const float inv = 1.0f / sum;
#pragma omp simd
    for (long c = 0; c < nn; c++) s[c] *= inv;
#pragma omp simd
    for (long c = 0; c < width; c++) f[c] *= inv;
    lse[r] = mx + logf(sum);
  }
}

/* Diagnostics of one block's probability rows (SPEC §8.1 and docs/fma.md): mass per band — the
 * near field; listed rows by their level; an opened window's children by theirs (level l − 1) —
 * and the token-level entropy (a summary row stands for e^logw tokens); the opening's own: mass
 * on opened exact tokens and windows opened per level. */
static void block_diagnostics(const struct fma_state *st, const struct fma_block_keys *bk,
                              const float *S, long ldS, const float *F, const int32_t *dec, long m,
                              double *mass, double *entropy, const struct fma_open_diag *diag) {
  const struct fma_open_layout *o = &st->open;
  const long nn = bk->near_count, width = o->width, p = st->tree.p;
  for (long r = 0; r < m; r++) {
    const float *s = S + r * ldS, *f = F + r * width;
    const int32_t *qd = dec + r * o->ndec;
    double ent = 0.0, opened_tokens = 0.0;
    for (long c = 0; c < nn; c++) {
      mass[0] += s[c];
      if (s[c] > 0) ent -= s[c] * log((double)s[c]);
    }
    for (long c = 0; c < bk->nfar; c++) {
      const double a = f[c];
      mass[bk->far_level[c]] += a;
      if (a > 0) ent -= a * (log(a) - bk->far_logw[c]);
    }
    for (int l = st->tree.levels; l >= 1; l--)
      for (int j = 0; j < o->slots[l]; j++) {
        if (qd[o->dec_off[l] + j] < 0) continue;
        if (diag && diag->opened) diag->opened[l] += 1.0;
        const float *cols = f + o->col[l] + (long)j * o->slot_width[l];
        const double logw =
            l >= 2 && st->multiplicity ? log((double)(st->tree.window[l - 1] / p)) : 0.0;
        for (long t = 0; t < o->slot_width[l]; t++) {
          const double a = cols[t];
          if (l >= 2)
            mass[l - 1] += a;
          else
            opened_tokens += a;
          if (a > 0) ent -= a * (log(a) - logw);
        }
      }
    *entropy += ent;
    if (diag && diag->open_mass) *diag->open_mass += opened_tokens;
  }
}

/* Head h's query blocks: near scores, the joint softmax with the far rows, and the values of the
 * near field (P2P) and the listed summaries (M2P); the opened windows' follow (group_values). */
static void forward_blocks(const struct fma_state *st, struct fma_open_work *w,
                           const struct fma_open_args *a, long h, float *out, float *lse,
                           struct fma_times *times, double *mass, double *entropy,
                           const struct fma_open_diag *diag) {
  const long m = st->tree.m, d = st->d, T = st->T, width = st->open.width;
  struct fma_open_scratch *s = &w->scratch[fma_open_thread()];
  const float *q = a->q + h * T * d, *k = a->k + h * a->kstride * d, *v = a->v + h * a->kstride * d;
  const float *V = a->V + h * st->rows * d;
  for (long qb = st->t0 / m; qb < (st->t0 + T) / m; qb++) {
    const long i0 = qb * m - st->t0;
    double t0 = timer_now();
    fma_block_keys(st, qb, &s->bk);
    const long nn = s->bk.near_count, nf = s->bk.nfar;
    for (long c = 0; c < nf; c++)
      memcpy(s->Vf + c * d, V + s->bk.far_row[c] * d, sizeof(float) * (size_t)d);
    fma_P2P_scores(st, qb, q, k, &s->bk, s->S, nn);
    float *F = w->F + (h * T + i0) * width;
    rows_joint_softmax(s->S, nn, nn, F, width, m, lse + h * T + i0);
    if (mass)
      block_diagnostics(st, &s->bk, s->S, nn, F, a->dec + (h * T + i0) * st->open.ndec, m, mass,
                        entropy, diag);
    float *o = out + (h * T + i0) * d;
    fma_P2P_values(st, o, s->S, nn, v, &s->bk);
    double t1 = timer_now();
    times->p2p += t1 - t0;
    if (nf > 0) fma_M2P_values(st, o, F, width, s->Vf, &s->bk);
    times->m2p += timer_now() - t1;
  }
}

/* out += a group's probabilities on its source's value rows, member by member with the rows in
 * cache: each output element sums its own products in a fixed order (not a GEMM shared by the
 * members, whose rounding would depend on who else opened the window: see open.c). */
static void group_values(const struct fma_state *st, struct fma_open_work *w,
                         const struct fma_open_args *a, long h, int l, long c,
                         const struct group *gr, void *ctx) {
  const long T = st->T, d = st->d, width = st->open.width;
  const float *Vr = fma_open_source_rows(st, w, a, h, l, c, true);
  for (long x = 0; x < gr->count; x++) {
    const float *P = w->F + (h * T + gr->who[x]) * width + gr->col + gr->slot[x] * gr->width;
    float *o = (float *)ctx + (h * T + gr->who[x]) * d;
    if (x + FMA_OPEN_AHEAD < gr->count) { /* members are scattered: ask for a later one's rows */
      const long ia = gr->who[x + FMA_OPEN_AHEAD];
      for (long f = 0; f < d; f += 16) __builtin_prefetch((float *)ctx + (h * T + ia) * d + f, 1);
      __builtin_prefetch(w->F + (h * T + ia) * width + gr->col +
                         gr->slot[x + FMA_OPEN_AHEAD] * gr->width);
    }
    for (long t = 0; t < gr->width; t++) {
      const float pt = P[t], *vr = Vr + t * d;
      if (pt == 0.0f) continue; /* a child opened in its turn */
#pragma omp simd
      for (long f = 0; f < d; f++) o[f] += pt * vr[f];
    }
  }
}

void fma_open_forward(const struct fma_state *st, struct fma_open_work *w,
                      const struct fma_open_args *a, float *out, float *lse,
                      struct fma_times *times, double *mass, double *entropy,
                      const struct fma_open_diag *diag) {
  const int bands = st->tree.levels + 1;
#pragma omp parallel
  {
    struct fma_times t = {0};
#pragma omp for schedule(dynamic, 1)
    for (long h = 0; h < a->count; h++) {
      forward_blocks(st, w, a, h, out, lse, &t, mass ? mass + h * bands : NULL,
                     entropy ? entropy + h : NULL, diag ? &diag[h] : NULL);
      const double t0 = timer_now();
      for_each_group(st, w, a, h, group_values, out);
      t.m2p += timer_now() - t0;
    }
#pragma omp critical(fma_open_times)
    {
      times->p2p += t.p2p;
      times->m2p += t.m2p;
    }
  }
}

/* ---------------------------------------------------------------------------------------------
 * backward */

/* Head h's far rows back to probabilities: exp(F − lse) per row. */
static void far_probabilities(const struct fma_state *st, struct fma_open_work *w, long h,
                              const float *lse) {
  const long T = st->T, width = st->open.width;
  for (long i = 0; i < T; i++) {
    float *f = w->F + (h * T + i) * width;
    const float L = lse[h * T + i];
#pragma omp simd
    for (long c = 0; c < width; c++) f[c] = expf(f[c] - L);
  }
}

struct backward_ctx {
  const struct fma_open_grads *g;
  const float *dout;
};

/* A group's value transposes: its slot columns of G = dout·V_rowsᵀ; dV_rows += Pᵀ·dout. */
static void group_values_backward(const struct fma_state *st, struct fma_open_work *w,
                                  const struct fma_open_args *a, long h, int l, long c,
                                  const struct group *gr, void *ctx) {
  const struct backward_ctx *b = ctx;
  const long T = st->T, d = st->d, sw = st->open.width - st->open.listed;
  struct fma_open_scratch *s = &w->scratch[fma_open_thread()];
  const float *Vr = fma_open_source_rows(st, w, a, h, l, c, true);
  float *dVr = source_grad_rows(st, w, a, b->g, h, l, c, true);
  group_gather_rows(s->Og, b->dout + h * T * d, d, gr);
  group_gather_cols(s->Pg, w->F + h * T * st->open.width, st->open.width, gr);
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)gr->width, (int)d, (int)gr->count, 1.0f,
              s->Pg, (int)gr->width, s->Og, (int)d, 1.0f, dVr, (int)d);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)gr->count, (int)gr->width, (int)d, 1.0f,
              s->Og, (int)d, Vr, (int)d, 0.0f, s->Sg, (int)gr->width);
  const long col = gr->col - st->open.listed; /* G holds the slot columns only */
  for (long x = 0; x < gr->count; x++)
    memcpy(w->G + (h * T + gr->who[x]) * sw + col + gr->slot[x] * gr->width, s->Sg + x * gr->width,
           sizeof(float) * (size_t)gr->width);
}

/* A group's score transposes: dq += dS·K_rows/√d; dK_rows += dSᵀ·q/√d. */
static void group_scores_backward(const struct fma_state *st, struct fma_open_work *w,
                                  const struct fma_open_args *a, long h, int l, long c,
                                  const struct group *gr, void *ctx) {
  const struct backward_ctx *b = ctx;
  const long T = st->T, d = st->d, sw = st->open.width - st->open.listed;
  const float scale = 1.0f / sqrtf((float)d);
  struct fma_open_scratch *s = &w->scratch[fma_open_thread()];
  const float *Kr = fma_open_source_rows(st, w, a, h, l, c, false);
  float *dKr = source_grad_rows(st, w, a, b->g, h, l, c, false);
  const struct group gs = {gr->who, gr->slot, gr->count, gr->col - st->open.listed, gr->width};
  group_gather_cols(s->Pg, w->G + h * T * sw, sw, &gs);
  group_gather_rows(s->Qg, a->q + h * T * d, d, gr);
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)gr->width, (int)d, (int)gr->count,
              scale, s->Pg, (int)gr->width, s->Qg, (int)d, 1.0f, dKr, (int)d);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)gr->count, (int)d, (int)gr->width,
              scale, s->Pg, (int)gr->width, Kr, (int)d, 0.0f, s->Og, (int)d);
  group_add_rows(b->g->dq + h * T * d, s->Og, d, gr);
}

/* Head h's query blocks: the near field and listed rows' transposes (as the two phases of
 * fma_evaluate_near_backward and fma_evaluate_far_backward), and the softmax's transpose over the
 * whole row — the opened windows' part in place in G. */
static void backward_blocks(const struct fma_state *st, struct fma_open_work *w,
                            const struct fma_open_args *a, long h, const struct fma_open_grads *g,
                            const float *dout, const float *D, const float *lse,
                            struct fma_times *times) {
  const long m = st->tree.m, d = st->d, T = st->T, width = st->open.width;
  const long listed = st->open.listed, sw = width - listed;
  struct fma_open_scratch *s = &w->scratch[fma_open_thread()];
  const float *q = a->q + h * T * d, *k = a->k + h * a->kstride * d, *v = a->v + h * a->kstride * d;
  const float *K = a->K + h * st->rows * d, *V = a->V + h * st->rows * d;
  float *dq = g->dq + h * T * d, *dk = g->dk + h * a->kstride * d, *dv = g->dv + h * a->kstride * d;
  float *dK = g->dK + h * st->rows * d, *dV = g->dV + h * st->rows * d;
  for (long qb = st->t0 / m; qb < (st->t0 + T) / m; qb++) {
    const long i0 = qb * m - st->t0;
    const double t0 = timer_now();
    fma_block_keys(st, qb, &s->bk);
    const long nn = s->bk.near_count, nf = s->bk.nfar, ld = nn + nf;
    for (long c = 0; c < nf; c++) {
      memcpy(s->Kf + c * d, K + s->bk.far_row[c] * d, sizeof(float) * (size_t)d);
      memcpy(s->Vf + c * d, V + s->bk.far_row[c] * d, sizeof(float) * (size_t)d);
    }
    fma_P2P_scores(st, qb, q, k, &s->bk, s->S, ld);
    for (long r = 0; r < m; r++) {
      float *row = s->S + r * ld;
      const float L = lse[h * T + i0 + r];
#pragma omp simd
      for (long c = 0; c < nn; c++) row[c] = expf(row[c] - L);
    }
    const float *F = w->F + (h * T + i0) * width, *go = dout + (h * T + i0) * d;
    /* dP of the near field and of the listed rows, side by side in dP (m, ld) */
    fma_P2P_values_backward(st, dv, s->dP, go, s->S, ld, v, &s->bk);
    const double t1 = timer_now();
    if (nf > 0)
      fma_M2P_values_backward(st, dV, s->dP + nn, ld, go, F, width, s->Vf, s->dVf, &s->bk);
    const double t2 = timer_now();
    for (long r = 0; r < m; r++) { /* dS = P ∘ (dP − D) */
      const float Di = D[h * T + i0 + r];
      const float *pn = s->S + r * ld, *pf = F + r * width;
      float *gp = s->dP + r * ld, *gs = w->G + (h * T + i0 + r) * sw;
      const float *ps = pf + listed;
      for (long c = 0; c < nn; c++) gp[c] = pn[c] * (gp[c] - Di);
      for (long c = 0; c < nf; c++) gp[nn + c] = pf[c] * (gp[nn + c] - Di);
      for (long c = 0; c < sw; c++) gs[c] = ps[c] * (gs[c] - Di);
    }
    fma_P2P_scores_backward(st, qb, dq, dk, s->dP, ld, q, k, &s->bk);
    const double t3 = timer_now();
    if (nf > 0) fma_M2P_scores_backward(st, qb, dq, dK, s->dP + nn, ld, q, s->Kf, s->dKf, &s->bk);
    times->p2p += (t1 - t0) + (t3 - t2);
    times->m2p += (t2 - t1) + (timer_now() - t3);
  }
}

void fma_open_backward(const struct fma_state *st, struct fma_open_work *w,
                       const struct fma_open_args *a, const struct fma_open_grads *g,
                       const float *dout, const float *D, const float *lse,
                       struct fma_times *times) {
  const long T = st->T, sw = st->open.width - st->open.listed;
  if (!w->G) w->G = mem_alloc(MEM_WORKSPACE, sizeof(float) * ((size_t)(w->count * T * sw) + 1));
  const struct backward_ctx b = {g, dout};
#pragma omp parallel
  {
    struct fma_times t = {0};
#pragma omp for schedule(dynamic, 1)
    for (long h = 0; h < a->count; h++) {
      double t0 = timer_now();
      far_probabilities(st, w, h, lse);
      memset(w->G + h * T * sw, 0, sizeof(float) * (size_t)(T * sw));
      for_each_group(st, w, a, h, group_values_backward, (void *)&b);
      t.m2p += timer_now() - t0;
      backward_blocks(st, w, a, h, g, dout, D, lse, &t);
      t0 = timer_now();
      for_each_group(st, w, a, h, group_scores_backward, (void *)&b);
      t.m2p += timer_now() - t0;
    }
#pragma omp critical(fma_open_times)
    {
      times->p2p += t.p2p;
      times->m2p += t.m2p;
    }
  }
}
