/* The opening pass of fma (SPEC §6.4a), as an N-body code opens a far cell whose expansion is not
 * good enough: coarse to fine, each query opens the K candidates (its listed windows — fma/lists.c
 * decides those — and the children of what it opened above) with the most attention, down to
 * exact tokens; the opened windows' scores go source by source, each window's rows in cache for
 * every query that opened it. Nothing is O(n²) unless fma.open = all (exact attention). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "core/memory.h"
#include "core/timer.h"
#include "fma/open.h"
#include "nn/vecmath.h"

/* ---------------------------------------------------------------------------------------------
 * buffers */

/* Most candidates a query has at any level: its listed windows and two children of each window
 * opened above. */
static long max_candidates(const struct fma_state *st) {
  long most = FMA_LIST_MAX;
  for (int l = 1; l < st->tree.levels; l++) {
    const long c = FMA_LIST_MAX + 2L * st->open.slots[l + 1];
    if (c > most) most = c;
  }
  return most;
}

static void scratch_alloc(const struct fma_state *st, struct fma_open_scratch *s) {
  const long m = st->tree.m, d = st->d, listed = st->open.listed, cand = max_candidates(st);
  const size_t f = sizeof(float);
  s->bk.far_row = xmalloc(sizeof(long) * (size_t)(listed + 1));
  s->bk.far_logw = xmalloc(sizeof(float) * (size_t)(listed + 1));
  s->bk.far_level = xmalloc(sizeof(int) * (size_t)(listed + 1));
  s->S = mem_alloc(MEM_WORKSPACE, f * (size_t)(m * (3 * m + listed)));
  s->dP = mem_alloc(MEM_WORKSPACE, f * (size_t)(m * (3 * m + listed)));
  s->Kf = mem_alloc(MEM_WORKSPACE, f * (size_t)((listed + 1) * d));
  s->Vf = mem_alloc(MEM_WORKSPACE, f * (size_t)((listed + 1) * d));
  s->dKf = mem_alloc(MEM_WORKSPACE, f * (size_t)((listed + 1) * d));
  s->dVf = mem_alloc(MEM_WORKSPACE, f * (size_t)((listed + 1) * d));
  const long wide = m > 2L * st->tree.p ? m : 2L * st->tree.p;
  s->Qg = mem_alloc(MEM_WORKSPACE, f * (size_t)(FMA_OPEN_GROUP * d));
  s->Og = mem_alloc(MEM_WORKSPACE, f * (size_t)(FMA_OPEN_GROUP * d));
  s->Sg = mem_alloc(MEM_WORKSPACE, f * (size_t)(FMA_OPEN_GROUP * wide));
  s->Pg = mem_alloc(MEM_WORKSPACE, f * (size_t)(FMA_OPEN_GROUP * wide));
  s->cand_g = xmalloc(sizeof(float) * (size_t)cand);
  s->cand_c = xmalloc(sizeof(long) * (size_t)cand);
  s->cand_rows = xmalloc(sizeof(float *) * (size_t)cand);
}

static void scratch_free(struct fma_open_scratch *s) {
  free(s->bk.far_row);
  free(s->bk.far_logw);
  free(s->bk.far_level);
  mem_free(s->S);
  mem_free(s->dP);
  mem_free(s->Kf);
  mem_free(s->Vf);
  mem_free(s->dKf);
  mem_free(s->dVf);
  mem_free(s->Qg);
  mem_free(s->Og);
  mem_free(s->Sg);
  mem_free(s->Pg);
  free(s->cand_g);
  free(s->cand_c);
  free(s->cand_rows);
}

static int max_threads(void) {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

struct fma_open_work *fma_open_work_get(struct fma_state *st, long count) {
  struct fma_open_work *w = st->work;
  if (w && w->count >= count && w->threads >= max_threads()) return w;
  struct fma_open_fetch *fetch = w ? w->fetch : NULL;
  if (w) w->fetch = NULL;
  fma_open_work_free(w);
  const struct fma_open_layout *o = &st->open;
  const struct fma_tree *tr = &st->tree;
  const size_t T = (size_t)st->T, width = (size_t)o->width, ndec = (size_t)o->ndec;
  w = xcalloc(1, sizeof *w);
  w->count = count;
  w->fetch = fetch;
  w->F = mem_alloc(MEM_WORKSPACE, sizeof(float) * ((size_t)count * T * width + 1));
  w->starts = 0;
  for (int l = 1; l <= tr->levels; l++) {
    w->lvl_start[l] = w->starts;
    w->starts += tr->nwindows[l] + 1;
  }
  w->start = mem_alloc(MEM_WORKSPACE, sizeof(int32_t) * ((size_t)count * (size_t)w->starts + 1));
  w->who = mem_alloc(MEM_WORKSPACE, sizeof(int32_t) * ((size_t)count * T * ndec + 1));
  w->slot = mem_alloc(MEM_WORKSPACE, sizeof(int32_t) * ((size_t)count * T * ndec + 1));
  w->threads = max_threads();
  w->scratch = xcalloc((size_t)w->threads, sizeof *w->scratch);
  for (int t = 0; t < w->threads; t++) scratch_alloc(st, &w->scratch[t]);
  st->work = w;
  return w;
}

void fma_open_work_free(struct fma_open_work *w) {
  if (!w) return;
  mem_free(w->F);
  mem_free(w->G);
  mem_free(w->dec);
  mem_free(w->start);
  mem_free(w->who);
  mem_free(w->slot);
  for (int t = 0; t < w->threads; t++) scratch_free(&w->scratch[t]);
  free(w->scratch);
  fma_open_fetch_free(w->fetch);
  free(w);
}

/* ---------------------------------------------------------------------------------------------
 * the criterion */

/* g = logsumexp_r (q_i·K[row + r]/√d + logw) over a window's p summary rows, each dot product in
 * one fixed order, so that equal windows score bit for bit alike. The far row's scores come from
 * differently shaped products (a block's GEMM for listed windows, a query's dot products for
 * children), whose rounding may differ by an ulp or two; near a tie the criterion asks this. */
static float window_score(const float *qi, const float *rows, long p, long d, float scale,
                          float logw) {
  float s[FMA_OPEN_SCORE_ROWS];
  fma_open_dots(qi, rows, p, d, s);
  float mx = -INFINITY;
  for (long r = 0; r < p; r++) {
    s[r] = s[r] * scale + logw;
    mx = s[r] > mx ? s[r] : mx;
  }
  float sum = 0.0f;
  for (long r = 0; r < p; r++) sum += expf(s[r] - mx);
  return mx + logf(sum);
}

/* g[x] = log Σ_r exp rows[x][r] for nc candidates of p far-row scores each: the exponentials of
 * all of them in one vector pass. nc is small (the candidates of one level). */
static void far_scores(const float *const *rows, long nc, long p, float *g) {
  float e[(FMA_LIST_MAX + 64) * 8], mx[FMA_LIST_MAX + 64];
  const bool packed = nc <= FMA_LIST_MAX + 64 && p <= 8;
  for (long x = 0; x < nc && packed; x++) {
    mx[x] = -INFINITY;
    for (long r = 0; r < p; r++) mx[x] = rows[x][r] > mx[x] ? rows[x][r] : mx[x];
  }
  if (!packed) { /* many candidates, or wide windows: one at a time */
    for (long x = 0; x < nc; x++) {
      float top = -INFINITY, sum = 0.0f;
      for (long r = 0; r < p; r++) top = rows[x][r] > top ? rows[x][r] : top;
      for (long r = 0; r < p; r++) sum += expf(rows[x][r] - top);
      g[x] = top + logf(sum);
    }
    return;
  }
  for (long x = 0; x < nc; x++)
    for (long r = 0; r < p; r++) e[x * p + r] = rows[x][r] - mx[x];
#pragma omp simd
  for (long i = 0; i < nc * p; i++) e[i] = expf(e[i]);
  for (long x = 0; x < nc; x++) {
    float sum = 0.0f;
    for (long r = 0; r < p; r++) sum += e[x * p + r];
    g[x] = mx[x] + logf(sum);
  }
}

/* Candidate a ranks before candidate b: a larger score, or an equal one and a lower window. */
static bool ranks_before(float ga, long ca, float gb, long cb) {
  return ga > gb || (ga == gb && ca < cb);
}

/* The `take` best of nc candidates (scores cg, windows cc) moved to the front, best first. */
static void select_best(float *cg, long *cc, long nc, long take) {
  for (long t = 0; t < take; t++) {
    long best = t;
    for (long x = t + 1; x < nc; x++)
      if (ranks_before(cg[x], cc[x], cg[best], cc[best])) best = x;
    const float tg = cg[t];
    const long tc = cc[t];
    cg[t] = cg[best];
    cc[t] = cc[best];
    cg[best] = tg;
    cc[best] = tc;
  }
}

/* Whether the choice of `take` among nc sorted-front candidates is closer than rounding to going
 * the other way: a chosen and an unchosen score within tolerance of each other. */
static bool near_tie(const float *cg, long nc, long take) {
  float low = INFINITY, high = -INFINITY;
  for (long x = 0; x < take; x++) low = cg[x] < low ? cg[x] : low;
  for (long x = take; x < nc; x++) high = cg[x] > high ? cg[x] : high;
  const float tol = 1e-4f * (1.0f + fabsf(low));
  return !(low - high > tol);
}

void fma_open_select(const struct fma_state *st, int l, const struct fma_block_keys *bk,
                     const float *F, const float *qi, const float *K, int32_t *dec) {
  const struct fma_open_layout *o = &st->open;
  const long p = st->tree.p, d = st->d;
  /* the candidates: listed windows, then the children of what was opened at l + 1, each with its
   * columns in the far row */
  float cand_g_local[FMA_LIST_MAX + 64];
  long cand_c_local[FMA_LIST_MAX + 64];
  const float *cand_rows_local[FMA_LIST_MAX + 64];
  float *cg = cand_g_local;
  long *cc = cand_c_local;
  const float **rows = cand_rows_local;
  const long need = bk->level_count[l] + (l < st->tree.levels ? 2L * o->slots[l + 1] : 0);
  if (need > FMA_LIST_MAX + 64) { /* a large fma.open: the thread's scratch holds them */
    struct fma_open_scratch *s = &st->work->scratch[fma_open_thread()];
    cg = s->cand_g;
    cc = s->cand_c;
    rows = s->cand_rows;
  }
  const long Kl = o->slots[l];
  const bool all = o->K == FMA_OPEN_ALL || need <= Kl;
  long nc = 0;
  for (int k = 0; k < bk->level_count[l]; k++, nc++) {
    cc[nc] = bk->level_window[l][k];
    if (!all) rows[nc] = F + bk->level_col[l] + k * p;
  }
  if (l < st->tree.levels)
    for (int j = 0; j < o->slots[l + 1]; j++) {
      const int32_t c = dec[o->dec_off[l + 1] + j];
      if (c < 0) continue;
      for (int half = 0; half < 2; half++, nc++) {
        cc[nc] = 2L * c + half;
        if (!all) rows[nc] = F + o->col[l + 1] + (long)j * 2 * p + half * p;
      }
    }
  if (!all) far_scores(rows, nc, p, cg);
  /* the K_l best, best first (every one when they are no more than K_l) */
  const long take = nc < Kl ? nc : Kl;
  if (take < nc) {
    select_best(cg, cc, nc, take);
    if (near_tie(cg, nc, take)) { /* decide by scores that rank equal windows equal */
      const float scale = 1.0f / sqrtf((float)d);
      const float logw = st->multiplicity ? logf((float)(st->tree.window[l] / p)) : 0.0f;
      for (long x = 0; x < nc; x++)
        cg[x] = window_score(qi, K + (st->level_row[l] + cc[x] * p) * d, p, d, scale, logw);
      select_best(cg, cc, nc, take);
    }
  }
  int32_t *out = dec + o->dec_off[l];
  for (long t = 0; t < Kl; t++) out[t] = t < take ? (int32_t)cc[t] : -1;
}

/* ---------------------------------------------------------------------------------------------
 * one head: far rows, decisions, per-source lists, opened windows' scores, masks */

/* Head h's far rows of every query block: the listed summary rows' scores (M2P, one GEMM per
 * block), −inf everywhere else (the padding and every slot, until opened windows fill theirs). */
static void head_listed(const struct fma_state *st, struct fma_open_work *w,
                        const struct fma_open_args *a, long h) {
  const long m = st->tree.m, d = st->d, T = st->T, width = st->open.width;
  struct fma_open_scratch *s = &w->scratch[fma_open_thread()];
  const float *K = a->K + h * st->rows * d, *q = a->q + h * T * d;
  for (long qb = st->t0 / m; qb < (st->t0 + T) / m; qb++) {
    fma_block_keys(st, qb, &s->bk);
    const long nf = s->bk.nfar, i0 = qb * m - st->t0;
    float *F = w->F + (h * T + i0) * width;
    for (long f = 0; f < nf; f++)
      memcpy(s->Kf + f * d, K + s->bk.far_row[f] * d, sizeof(float) * (size_t)d);
    if (nf > 0) fma_M2P_scores(st, qb, q, s->Kf, &s->bk, F, width);
    for (long r = 0; r < m; r++)
      for (long c = nf; c < width; c++) F[r * width + c] = -INFINITY;
  }
}

/* Head h's level-l lists by source: the queries that opened each window, in query order (a
 * counting sort of the decisions). */
static void head_lists(const struct fma_state *st, struct fma_open_work *w,
                       const struct fma_open_args *a, long h, int l) {
  const long T = st->T, ndec = st->open.ndec, K = st->open.slots[l], off = st->open.dec_off[l];
  const long nw = st->tree.nwindows[l];
  int32_t *start = w->start + h * w->starts + w->lvl_start[l];
  int32_t *who = w->who + h * T * ndec + T * off, *slot = w->slot + h * T * ndec + T * off;
  const int32_t *dec = a->dec + h * T * ndec;
  memset(start, 0, sizeof(int32_t) * (size_t)(nw + 1));
  for (long i = 0; i < T; i++)
    for (long j = 0; j < K; j++) {
      const int32_t c = dec[i * ndec + off + j];
      if (c >= 0) start[c + 1]++;
    }
  for (long c = 0; c < nw; c++) start[c + 1] += start[c];
  for (long i = 0; i < T; i++)
    for (long j = 0; j < K; j++) {
      const int32_t c = dec[i * ndec + off + j];
      if (c < 0) continue;
      const int32_t at = start[c]++;
      who[at] = (int32_t)i;
      slot[at] = (int32_t)j;
    }
  for (long c = nw; c > 0; c--) start[c] = start[c - 1]; /* back to first members */
  start[0] = 0;
}

const float *fma_open_source_rows(const struct fma_state *st, const struct fma_open_work *w,
                                  const struct fma_open_args *a, long h, int l, long c,
                                  bool values) {
  if (l >= 2) {
    const float *X = values ? a->V : a->K;
    return X + (h * st->rows + st->level_row[l - 1] + 2 * c * st->tree.p) * st->d;
  }
  const float *k, *v;
  fma_open_block_rows(st, w, a, h, c, &k, &v, NULL, NULL, NULL, NULL);
  return values ? v : k;
}

/* Head h's scores of the windows opened at level l, source by source: for each window, its rows
 * — its children's 2p summary rows (l ≥ 2) or the fine block's m keys (l = 1) — stay in cache
 * while every query that opened it takes their dot products with its own row, into its slot.
 * Each dot product is computed alone (fma_open_dots), never by a GEMM shared by the queries:
 * OpenBLAS rounds a row by where it sits in the product (measured), so a later query's choice
 * would move an earlier query's output in its last bits, and causality would hold only to
 * rounding. */
static void head_score(const struct fma_state *st, struct fma_open_work *w,
                       const struct fma_open_args *a, long h, int l) {
  const long T = st->T, d = st->d, width = st->open.width, ndec = st->open.ndec;
  const long nr = st->open.slot_width[l], col = st->open.col[l];
  const float scale = 1.0f / sqrtf((float)d);
  const float logw =
      l >= 2 && st->multiplicity ? logf((float)(st->tree.window[l - 1] / st->tree.p)) : 0.0f;
  const int32_t *start = w->start + h * w->starts + w->lvl_start[l];
  const long base = h * T * ndec + T * st->open.dec_off[l];
  const float *q = a->q + h * T * d;
  for (long c = 0; c < st->tree.nwindows[l]; c++) {
    if (start[c + 1] == start[c]) continue;
    const float *R = fma_open_source_rows(st, w, a, h, l, c, false);
    for (long x = start[c]; x < start[c + 1]; x++) {
      const long i = w->who[base + x];
      float *dst = w->F + (h * T + i) * width + col + (long)w->slot[base + x] * nr;
      if (x + FMA_OPEN_AHEAD < start[c + 1]) { /* members are scattered: ask for a later one's */
        const long ia = w->who[base + x + FMA_OPEN_AHEAD];
        for (long f = 0; f < d; f += 16) __builtin_prefetch(q + ia * d + f);
        __builtin_prefetch(w->F + (h * T + ia) * width + col, 1);
      }
      fma_open_dots(q + i * d, R, nr, d, dst);
      for (long t = 0; t < nr; t++) dst[t] = dst[t] * scale + logw;
    }
  }
}

/* Level l's decisions of every query of head h (fma_open_select), from its far row scored down
 * to level l. */
static void head_decide(const struct fma_state *st, struct fma_open_work *w,
                        const struct fma_open_args *a, long h, int l) {
  const long m = st->tree.m, T = st->T, d = st->d, width = st->open.width, ndec = st->open.ndec;
  struct fma_open_scratch *s = &w->scratch[fma_open_thread()];
  const float *K = a->K + h * st->rows * d;
  for (long qb = st->t0 / m; qb < (st->t0 + T) / m; qb++) {
    fma_block_keys(st, qb, &s->bk);
    for (long i = qb * m - st->t0; i < (qb + 1) * m - st->t0; i++)
      fma_open_select(st, l, &s->bk, w->F + (h * T + i) * width, a->q + (h * T + i) * d, K,
                      a->dec + (h * T + i) * ndec);
  }
}

/* −inf over the rows of every window query i opened: a listed one's p columns, or the half of
 * its parent's slot that held it. The far row then has each allowed key exactly once. */
void fma_open_mask(const struct fma_state *st, const struct fma_block_keys *bk, float *F,
                   const int32_t *dec) {
  const struct fma_open_layout *o = &st->open;
  const long p = st->tree.p;
  for (int l = 1; l <= st->tree.levels; l++)
    for (int j = 0; j < o->slots[l]; j++) {
      const int32_t c = dec[o->dec_off[l] + j];
      if (c < 0) continue;
      float *cols = NULL;
      for (int k = 0; k < bk->level_count[l] && !cols; k++)
        if (bk->level_window[l][k] == c) cols = F + bk->level_col[l] + k * p;
      for (int jp = 0; l < st->tree.levels && jp < o->slots[l + 1] && !cols; jp++)
        if (dec[o->dec_off[l + 1] + jp] == c / 2)
          cols = F + o->col[l + 1] + (long)jp * 2 * p + (c % 2) * p;
      if (!cols) error("fma.open: window %d of level %d was opened but never a candidate", c, l);
      for (long r = 0; r < p; r++) cols[r] = -INFINITY;
    }
}

static void head_mask(const struct fma_state *st, struct fma_open_work *w,
                      const struct fma_open_args *a, long h) {
  const long m = st->tree.m, T = st->T, width = st->open.width, ndec = st->open.ndec;
  struct fma_open_scratch *s = &w->scratch[fma_open_thread()];
  for (long qb = st->t0 / m; qb < (st->t0 + T) / m; qb++) {
    fma_block_keys(st, qb, &s->bk);
    for (long i = qb * m - st->t0; i < (qb + 1) * m - st->t0; i++)
      fma_open_mask(st, &s->bk, w->F + (h * T + i) * width, a->dec + (h * T + i) * ndec);
  }
}

/* ---------------------------------------------------------------------------------------------
 * the pass */

static bool sequence_parallel(const struct fma_open_args *a) { return a->comm && a->comm->S > 1; }

/* What level l needs from other ranks before its opened windows can be scored. */
static void level_fetch(const struct fma_state *st, struct fma_open_work *w,
                        const struct fma_open_args *a, int l) {
  if (!sequence_parallel(a)) return;
  if (l >= 2)
    fma_open_let_children(st, w, a, l);
  else
    fma_open_let_tokens(st, w, a);
}

/* Level by level, every head: the decisions of level l (when decide), the lists, what other
 * ranks hold, the scores of what was opened. Forward decides; backward (decide false) scores the
 * same far rows again from the saved decisions, with the same calls. */
static void descend(const struct fma_state *st, struct fma_open_work *w,
                    const struct fma_open_args *a, bool decide) {
  const int L = st->tree.levels;
  if (!sequence_parallel(a)) { /* every head on its own, all levels at once */
#pragma omp parallel for schedule(dynamic, 1)
    for (long h = 0; h < a->count; h++) {
      head_listed(st, w, a, h);
      for (int l = L; l >= 1; l--) {
        if (decide) head_decide(st, w, a, h, l);
        head_lists(st, w, a, h, l);
        head_score(st, w, a, h, l);
      }
      head_mask(st, w, a, h);
    }
    return;
  }
#pragma omp parallel for schedule(dynamic, 1)
  for (long h = 0; h < a->count; h++) head_listed(st, w, a, h);
  for (int l = L; l >= 1; l--) {
#pragma omp parallel for schedule(dynamic, 1)
    for (long h = 0; h < a->count; h++) {
      if (decide) head_decide(st, w, a, h, l);
      head_lists(st, w, a, h, l);
    }
    level_fetch(st, w, a, l);
#pragma omp parallel for schedule(dynamic, 1)
    for (long h = 0; h < a->count; h++) head_score(st, w, a, h, l);
  }
#pragma omp parallel for schedule(dynamic, 1)
  for (long h = 0; h < a->count; h++) head_mask(st, w, a, h);
}

void fma_open_descend(const struct fma_state *st, struct fma_open_work *w,
                      const struct fma_open_args *a, struct fma_times *times) {
  const double t0 = timer_now();
  descend(st, w, a, true);
  times->m2p += timer_now() - t0;
}

void fma_open_rescore(const struct fma_state *st, struct fma_open_work *w,
                      const struct fma_open_args *a, struct fma_times *times) {
  const double t0 = timer_now();
  descend(st, w, a, false);
  times->m2p += timer_now() - t0;
}
