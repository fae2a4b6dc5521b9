/* FMA evaluation (SPEC §6.4–6.5): every query block of m queries shares its interaction lists,
 * so its scores are two GEMMs — P2P against the contiguous near keys, M2P against the gathered
 * summary rows of every level — followed by ONE row softmax over both (fma), or by separate
 * softmaxes (fma_linear). Backward recomputes the scores from the saved log-sum-exp. One head per
 * call; the caller parallelises over heads and blocks. Nothing here is O(n²) or O(n·n/m). */
#include <cblas.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "core/memory.h"
#include "core/timer.h"
#include "fma/fma.h"
#include "nn/vecmath.h"

void fma_block_keys_levels(const struct fma_state *st, long qb, int lo, int hi,
                           struct fma_block_keys *bk) {
  const struct fma_tree *tree = &st->tree;
  long blocks[FMA_LIST_MAX];
  int nb = fma_lists_near(tree, st->causal, qb, blocks);
  bk->near_lo = blocks[0] * tree->m; /* the near blocks are consecutive */
  bk->near_count = (long)nb * tree->m;
  bk->nfar = 0;
  for (int l = 1; l <= tree->levels; l++) {
    long windows[FMA_LIST_MAX];
    const long c = qb * tree->m / tree->window[l];
    const int nw = l < lo || l > hi ? 0 : fma_lists_level(tree, st->causal, l, c, windows);
    const float logw = st->multiplicity ? logf((float)(tree->window[l] / tree->p)) : 0.0f;
    bk->level_count[l] = nw;
    bk->level_col[l] = bk->nfar;
    for (int k = 0; k < nw; k++) bk->level_window[l][k] = windows[k];
    for (int k = 0; k < nw; k++)
      for (long r = 0; r < tree->p; r++) {
        bk->far_row[bk->nfar] = st->level_row[l] + windows[k] * tree->p + r;
        bk->far_logw[bk->nfar] = logw;
        bk->far_level[bk->nfar] = l;
        bk->nfar++;
      }
  }
}

void fma_block_keys(const struct fma_state *st, long qb, struct fma_block_keys *bk) {
  fma_block_keys_levels(st, qb, 1, st->tree.levels, bk);
}

/* The highest level whose listed summaries block qb of this rank's slab evaluates here: every
 * level, except for the blocks whose spanning levels a helper evaluates (fma/balance.c). */
static int local_top(const struct fma_state *st, long qb) {
  return qb >= st->far_cut ? st->far_top : st->tree.levels;
}

/* Per-call scratch for one block at a time. */
struct block_scratch {
  struct fma_block_keys bk;
  float *S, *dP;              /* (m, ncols) */
  float *Kf, *Vf, *dKf, *dVf; /* (nfar, d) */
  long ncols;
};

static void scratch_init(struct block_scratch *s, const struct fma_state *st) {
  const long m = st->tree.m, d = st->d, farmax = (long)FMA_LIST_MAX * st->tree.p * st->tree.levels;
  s->ncols = 3 * m + farmax;
  s->bk.far_row = xmalloc(sizeof(long) * (size_t)(farmax + 1));
  s->bk.far_logw = xmalloc(sizeof(float) * (size_t)(farmax + 1));
  s->bk.far_level = xmalloc(sizeof(int) * (size_t)(farmax + 1));
  s->S = mem_alloc(MEM_WORKSPACE, sizeof(float) * (size_t)(m * s->ncols));
  s->dP = mem_alloc(MEM_WORKSPACE, sizeof(float) * (size_t)(m * s->ncols));
  s->Kf = mem_alloc(MEM_WORKSPACE, sizeof(float) * (size_t)((farmax + 1) * d));
  s->Vf = mem_alloc(MEM_WORKSPACE, sizeof(float) * (size_t)((farmax + 1) * d));
  s->dKf = mem_alloc(MEM_WORKSPACE, sizeof(float) * (size_t)((farmax + 1) * d));
  s->dVf = mem_alloc(MEM_WORKSPACE, sizeof(float) * (size_t)((farmax + 1) * d));
}

static void scratch_free(struct block_scratch *s) {
  free(s->bk.far_row);
  free(s->bk.far_logw);
  free(s->bk.far_level);
  mem_free(s->S);
  mem_free(s->dP);
  mem_free(s->Kf);
  mem_free(s->Vf);
  mem_free(s->dKf);
  mem_free(s->dVf);
}

static void gather(float *dst, const float *src, const long *rows, int count, long d) {
  for (int i = 0; i < count; i++) memcpy(dst + i * d, src + rows[i] * d, sizeof(float) * (size_t)d);
}

void fma_scatter_add_rows(float *dst, const float *src, const long *rows, int count, long d) {
  for (int i = 0; i < count; i++) {
    float *o = dst + rows[i] * d;
    const float *g = src + i * d;
#pragma omp simd
    for (long f = 0; f < d; f++) o[f] += g[f];
  }
}

/* ---------------------------------------------------------------------------------------------
 * the operators on one query block (fma.h): fma_evaluate's score matrix S (m, ld) holds the near
 * columns [0, nn) (P2P) and the far columns [nn, nn + nf) (M2P). */

void fma_P2P_scores(const struct fma_state *st, long qb, const float *q, const float *k,
                    const struct fma_block_keys *bk, float *S, long ld) {
  const long m = st->tree.m, d = st->d, i0 = qb * m, nn = bk->near_count;
  const float scale = 1.0f / sqrtf((float)d);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)m, (int)nn, (int)d, scale,
              q + (i0 - st->t0) * d, (int)d, k + (bk->near_lo - st->klo) * d, (int)d, 0.0f, S,
              (int)ld);
  if (st->causal)
    for (long r = 0; r < m; r++) {
      float *row = S + r * ld;
      for (long c = i0 + r + 1 - bk->near_lo; c < nn; c++) row[c] = -INFINITY; /* keys after i */
    }
}

void fma_M2P_scores(const struct fma_state *st, long qb, const float *q, const float *Kf,
                    const struct fma_block_keys *bk, float *Sf, long ld) {
  const long m = st->tree.m, d = st->d, i0 = qb * m, nf = bk->nfar;
  const float scale = 1.0f / sqrtf((float)d);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)m, (int)nf, (int)d, scale,
              q + (i0 - st->t0) * d, (int)d, Kf, (int)d, 0.0f, Sf, (int)ld);
  for (long r = 0; r < m; r++) {
    float *row = Sf + r * ld;
    for (long c = 0; c < nf; c++) row[c] += bk->far_logw[c];
  }
}

void fma_P2P_values(const struct fma_state *st, float *o, const float *P, long ld, const float *v,
                    const struct fma_block_keys *bk) {
  const long m = st->tree.m, d = st->d, nn = bk->near_count;
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)m, (int)d, (int)nn, 1.0f, P, (int)ld,
              v + (bk->near_lo - st->klo) * d, (int)d, 0.0f, o, (int)d);
}

void fma_M2P_values(const struct fma_state *st, float *o, const float *Pf, long ld, const float *Vf,
                    const struct fma_block_keys *bk) {
  const long m = st->tree.m, d = st->d, nf = bk->nfar;
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)m, (int)d, (int)nf, 1.0f, Pf, (int)ld,
              Vf, (int)d, 1.0f, o, (int)d);
}

void fma_P2P_values_backward(const struct fma_state *st, float *dv, float *dP, const float *g,
                             const float *P, long ld, const float *v,
                             const struct fma_block_keys *bk) {
  const long m = st->tree.m, d = st->d, nn = bk->near_count;
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)nn, (int)d, (int)m, 1.0f, P, (int)ld, g,
              (int)d, 1.0f, dv + (bk->near_lo - st->klo) * d, (int)d);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)m, (int)nn, (int)d, 1.0f, g, (int)d,
              v + (bk->near_lo - st->klo) * d, (int)d, 0.0f, dP, (int)ld);
}

void fma_M2P_values_backward(const struct fma_state *st, float *dV, float *dPf, long ldd,
                             const float *g, const float *Pf, long ld, const float *Vf, float *dVf,
                             const struct fma_block_keys *bk) {
  const long m = st->tree.m, d = st->d, nf = bk->nfar;
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)nf, (int)d, (int)m, 1.0f, Pf, (int)ld,
              g, (int)d, 0.0f, dVf, (int)d);
  fma_scatter_add_rows(dV, dVf, bk->far_row, (int)nf, d);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)m, (int)nf, (int)d, 1.0f, g, (int)d, Vf,
              (int)d, 0.0f, dPf, (int)ldd);
}

void fma_P2P_scores_backward(const struct fma_state *st, long qb, float *dq, float *dk,
                             const float *dS, long ld, const float *q, const float *k,
                             const struct fma_block_keys *bk) {
  const long m = st->tree.m, d = st->d, i0 = qb * m, nn = bk->near_count;
  const float scale = 1.0f / sqrtf((float)d);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)m, (int)d, (int)nn, scale, dS,
              (int)ld, k + (bk->near_lo - st->klo) * d, (int)d, 1.0f, dq + (i0 - st->t0) * d,
              (int)d);
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)nn, (int)d, (int)m, scale, dS, (int)ld,
              q + (i0 - st->t0) * d, (int)d, 1.0f, dk + (bk->near_lo - st->klo) * d, (int)d);
}

void fma_M2P_scores_backward(const struct fma_state *st, long qb, float *dq, float *dK,
                             const float *dSf, long ld, const float *q, const float *Kf, float *dKf,
                             const struct fma_block_keys *bk) {
  const long m = st->tree.m, d = st->d, i0 = qb * m, nf = bk->nfar;
  const float scale = 1.0f / sqrtf((float)d);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)m, (int)d, (int)nf, scale, dSf,
              (int)ld, Kf, (int)d, 1.0f, dq + (i0 - st->t0) * d, (int)d);
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)nf, (int)d, (int)m, scale, dSf, (int)ld,
              q + (i0 - st->t0) * d, (int)d, 0.0f, dKf, (int)d);
  fma_scatter_add_rows(dK, dKf, bk->far_row, (int)nf, d);
}

/* Scores of block qb into s->S, P2P then (with_far) M2P, each timed as its own. Returns nn. */
static long block_scores(const struct fma_state *st, long qb, const float *q, const float *k,
                         struct block_scratch *s, bool with_far, struct fma_times *times) {
  const struct fma_block_keys *bk = &s->bk;
  const long nn = bk->near_count, nf = with_far ? bk->nfar : 0, ld = nn + nf;
  double t0 = timer_now();
  fma_P2P_scores(st, qb, q, k, bk, s->S, ld);
  double t1 = timer_now();
  times->p2p += t1 - t0;
  if (nf > 0) {
    fma_M2P_scores(st, qb, q, s->Kf, bk, s->S + nn, ld);
    times->m2p += timer_now() - t1;
  }
  return nn;
}

/* Softmax of each row of S (m, ld) in place; lse[r] = log Σ exp. */
static void rows_softmax(float *S, long m, long ld, float *lse) {
  for (long r = 0; r < m; r++) {
    float *row = S + r * ld;
    float mx = -INFINITY;
    for (long c = 0; c < ld; c++) mx = row[c] > mx ? row[c] : mx;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (long c = 0; c < ld; c++) {
      row[c] = expf(row[c] - mx);
      sum += row[c];
    }
    const float inv = 1.0f / sum;
#pragma omp simd
    for (long c = 0; c < ld; c++) row[c] *= inv;
    lse[r] = mx + logf(sum);
  }
}

/* P = exp(S − lse) per row for the nc columns of rows ld apart, in place. */
static void rows_probabilities(float *S, long m, long nc, long ld, const float *lse) {
  for (long r = 0; r < m; r++) {
    float *row = S + r * ld;
    const float L = lse[r];
#pragma omp simd
    for (long c = 0; c < nc; c++) row[c] = expf(row[c] - L);
  }
}

/* Diagnostics of one block's probability rows: mass per band and entropy (each coarse key stands
 * for e^{logw} tokens with equal shares, so entropy is that of the token-level distribution). */
static void block_diagnostics(const struct fma_state *st, const float *P, long m, long nn, long nf,
                              const struct fma_block_keys *bk, double *mass, double *entropy) {
  const long ld = nn + nf;
  for (long r = 0; r < m; r++) {
    const float *row = P + r * ld;
    double near = 0.0, ent = 0.0;
    for (long c = 0; c < nn; c++) {
      near += row[c];
      if (row[c] > 0) ent -= row[c] * log((double)row[c]);
    }
    mass[0] += near;
    for (long c = 0; c < nf; c++) {
      const double a = row[nn + c];
      mass[bk->far_level[c]] += a;
      if (a > 0) ent -= a * (log(a) - bk->far_logw[c]);
    }
    *entropy += ent;
  }
  (void)st;
}

/* Query block qb's keys (fma_block_keys) and the rows of its listed summaries K, V gathered into
 * the scratch (timed as M2P). */
static void block_keys(const struct fma_state *st, long qb, int lo, int hi, struct block_scratch *s,
                       const float *K, const float *V, struct fma_times *times) {
  fma_block_keys_levels(st, qb, lo, hi, &s->bk);
  const double t0 = timer_now();
  gather(s->Kf, K, s->bk.far_row, (int)s->bk.nfar, st->d);
  gather(s->Vf, V, s->bk.far_row, (int)s->bk.nfar, st->d);
  times->m2p += timer_now() - t0;
}

/* dS = P ∘ (dP − D) of each row, in place in dP (m, ld): the softmax's transpose over both parts
 * at once (fma) or over the near field alone (fma_linear). */
static void rows_softmax_backward(float *dP, const float *P, long m, long nc, long ld,
                                  const float *D) {
  for (long r = 0; r < m; r++) {
    const float Di = D[r];
    const float *p = P + r * ld;
    float *gp = dP + r * ld;
#pragma omp simd
    for (long c = 0; c < nc; c++) gp[c] = p[c] * (gp[c] - Di);
  }
}

/* ---------------------------------------------------------------------------------------------
 * fma: P2P and M2P under one softmax */

void fma_evaluate_forward(const struct fma_state *st, float *out, float *lse, const float *q,
                          const float *k, const float *v, const float *K, const float *V, long qb0,
                          long qb1, struct fma_times *times, double *mass, double *entropy) {
  const long m = st->tree.m, d = st->d;
  struct block_scratch s;
  scratch_init(&s, st);
  for (long qb = qb0; qb < qb1; qb++) {
    block_keys(st, qb, 1, st->tree.levels, &s, K, V, times);
    const long nf = s.bk.nfar;
    const long nn = block_scores(st, qb, q, k, &s, true, times);
    const long ld = nn + nf;
    double t0 = timer_now();
    rows_softmax(s.S, m, ld, lse + (qb * m - st->t0));
    if (mass) block_diagnostics(st, s.S, m, nn, nf, &s.bk, mass, entropy);
    float *o = out + (qb * m - st->t0) * d;
    fma_P2P_values(st, o, s.S, ld, v, &s.bk);
    double t1 = timer_now();
    times->p2p += t1 - t0;
    if (nf > 0) {
      fma_M2P_values(st, o, s.S + nn, ld, s.Vf, &s.bk);
      times->m2p += timer_now() - t1;
    }
  }
  scratch_free(&s);
}

/* ---------------------------------------------------------------------------------------------
 * fma in two phases, so that the locally essential tree's fetch runs during the first (SPEC §7):
 * the near field, which reads no summary, then the far field. Forward, the near field has its own
 * softmax (out, lse: the near part's), which the far phase rescales into the softmax over both
 * parts: its rounding is not fma_evaluate_forward's. Backward, each phase takes its columns of
 * the same rows as one softmax would, operation for operation. */

void fma_evaluate_near_forward(const struct fma_state *st, float *out, float *lse, const float *q,
                               const float *k, const float *v, long qb0, long qb1,
                               struct fma_times *times) {
  const long m = st->tree.m, d = st->d;
  struct block_scratch s;
  scratch_init(&s, st);
  for (long qb = qb0; qb < qb1; qb++) {
    fma_block_keys(st, qb, &s.bk);
    const long nn = block_scores(st, qb, q, k, &s, false, times);
    double t0 = timer_now();
    rows_softmax(s.S, m, nn, lse + (qb * m - st->t0));
    fma_P2P_values(st, out + (qb * m - st->t0) * d, s.S, nn, v, &s.bk);
    times->p2p += timer_now() - t0;
  }
  scratch_free(&s);
}

/* Row r of the far scores Sf (nf columns) joins the near part's softmax (lse[r], o normalised
 * over the near field): o is rescaled, Sf becomes the probabilities, lse that of both parts. */
static void merge_far_row(float *o, long d, float *Sf, long nf, float *lse) {
  float mx = -INFINITY;
  for (long c = 0; c < nf; c++) mx = Sf[c] > mx ? Sf[c] : mx;
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (long c = 0; c < nf; c++) sum += expf(Sf[c] - mx);
  const float near = *lse, far = mx + logf(sum);
  const float top = near > far ? near : far;
  const float L = top + logf(expf(near - top) + expf(far - top));
  const float a = expf(near - L);
#pragma omp simd
  for (long f = 0; f < d; f++) o[f] *= a;
#pragma omp simd
  for (long c = 0; c < nf; c++) Sf[c] = expf(Sf[c] - L);
  *lse = L;
}

void fma_evaluate_far_forward(const struct fma_state *st, float *out, float *lse, const float *q,
                              const float *K, const float *V, long qb0, long qb1,
                              struct fma_times *times) {
  const long m = st->tree.m, d = st->d;
  struct block_scratch s;
  scratch_init(&s, st);
  for (long qb = qb0; qb < qb1; qb++) {
    block_keys(st, qb, 1, local_top(st, qb), &s, K, V, times);
    const long nf = s.bk.nfar;
    if (nf == 0) continue;
    double t0 = timer_now();
    fma_M2P_scores(st, qb, q, s.Kf, &s.bk, s.S, nf);
    float *o = out + (qb * m - st->t0) * d;
    for (long r = 0; r < m; r++)
      merge_far_row(o + r * d, d, s.S + r * nf, nf, lse + (qb * m - st->t0) + r);
    fma_M2P_values(st, o, s.S, nf, s.Vf, &s.bk);
    times->m2p += timer_now() - t0;
  }
  scratch_free(&s);
}

void fma_evaluate_near_backward(const struct fma_state *st, float *dq, float *dk, float *dv,
                                const float *dout, const float *D, const float *q, const float *k,
                                const float *v, const float *lse, struct fma_times *times) {
  const long m = st->tree.m;
  struct block_scratch s;
  scratch_init(&s, st);
  for (long qb = st->t0 / m; qb < (st->t0 + st->T) / m; qb++) {
    fma_block_keys(st, qb, &s.bk);
    const long i0 = qb * m, nn = s.bk.near_count, ld = nn + s.bk.nfar;
    const float *g = dout + (i0 - st->t0) * st->d;
    double t0 = timer_now();
    fma_P2P_scores(st, qb, q, k, &s.bk, s.S, ld);
    rows_probabilities(s.S, m, nn, ld, lse + (i0 - st->t0));
    fma_P2P_values_backward(st, dv, s.dP, g, s.S, ld, v, &s.bk);
    rows_softmax_backward(s.dP, s.S, m, nn, ld, D + (i0 - st->t0));
    fma_P2P_scores_backward(st, qb, dq, dk, s.dP, ld, q, k, &s.bk);
    times->p2p += timer_now() - t0;
  }
  scratch_free(&s);
}

void fma_evaluate_far_backward(const struct fma_state *st, float *dq, float *dK, float *dV,
                               const float *dout, const float *D, const float *q, const float *K,
                               const float *V, const float *lse, struct fma_times *times) {
  const long m = st->tree.m;
  struct block_scratch s;
  scratch_init(&s, st);
  for (long qb = st->t0 / m; qb < (st->t0 + st->T) / m; qb++) {
    block_keys(st, qb, 1, local_top(st, qb), &s, K, V, times);
    const long i0 = qb * m, nn = s.bk.near_count, nf = s.bk.nfar, ld = nn + nf;
    if (nf == 0) continue;
    const float *g = dout + (i0 - st->t0) * st->d;
    double t0 = timer_now();
    fma_M2P_scores(st, qb, q, s.Kf, &s.bk, s.S + nn, ld);
    rows_probabilities(s.S + nn, m, nf, ld, lse + (i0 - st->t0));
    fma_M2P_values_backward(st, dV, s.dP + nn, ld, g, s.S + nn, ld, s.Vf, s.dVf, &s.bk);
    rows_softmax_backward(s.dP + nn, s.S + nn, m, nf, ld, D + (i0 - st->t0));
    fma_M2P_scores_backward(st, qb, dq, dK, s.dP + nn, ld, q, s.Kf, s.dKf, &s.bk);
    times->m2p += timer_now() - t0;
  }
  scratch_free(&s);
}

/* ---------------------------------------------------------------------------------------------
 * fma's far field of levels [lo, levels] for another rank's query blocks (fma/balance.c): a part
 * of the single softmax, returned as (o, lse) of its own columns, and its transpose. The block's
 * operators run on a view of the state whose slab is that one block. */

static struct fma_state block_view(const struct fma_state *st, long qb) {
  struct fma_state v = *st;
  v.t0 = qb * st->tree.m;
  v.T = st->tree.m;
  return v;
}

void fma_evaluate_far_part(const struct fma_state *st, int lo, const long *qb, long nb,
                           const float *q, long qstride, const float *K, const float *V, float *o,
                           float *lse, long ostride, struct fma_times *times) {
  const long m = st->tree.m, d = st->d;
  struct block_scratch s;
  scratch_init(&s, st);
  for (long i = 0; i < nb; i++) {
    const struct fma_state v = block_view(st, qb[i]);
    float *oi = o + i * ostride, *li = lse + i * ostride;
    block_keys(st, qb[i], lo, st->tree.levels, &s, K, V, times);
    const long nf = s.bk.nfar;
    memset(oi, 0, sizeof(float) * (size_t)(m * d));
    if (nf == 0) {
      for (long r = 0; r < m; r++) li[r] = -INFINITY; /* no columns: no mass */
      continue;
    }
    double t0 = timer_now();
    fma_M2P_scores(&v, qb[i], q + i * qstride, s.Kf, &s.bk, s.S, nf);
    rows_softmax(s.S, m, nf, li);
    fma_M2P_values(&v, oi, s.S, nf, s.Vf, &s.bk);
    times->m2p += timer_now() - t0;
  }
  scratch_free(&s);
}

void fma_evaluate_far_part_backward(const struct fma_state *st, int lo, const long *qb, long nb,
                                    const float *in, long stride, const float *K, const float *V,
                                    float *dK, float *dV, float *dq, long dqstride,
                                    struct fma_times *times) {
  const long m = st->tree.m, d = st->d;
  struct block_scratch s;
  scratch_init(&s, st);
  for (long i = 0; i < nb; i++) {
    const struct fma_state v = block_view(st, qb[i]);
    const float *q = in + i * stride, *g = q + m * d, *D = g + m * d, *L = D + m;
    float *dqi = dq + i * dqstride;
    block_keys(st, qb[i], lo, st->tree.levels, &s, K, V, times);
    const long nf = s.bk.nfar;
    memset(dqi, 0, sizeof(float) * (size_t)(m * d));
    if (nf == 0) continue;
    double t0 = timer_now();
    fma_M2P_scores(&v, qb[i], q, s.Kf, &s.bk, s.S, nf);
    rows_probabilities(s.S, m, nf, nf, L);
    fma_M2P_values_backward(&v, dV, s.dP, nf, g, s.S, nf, s.Vf, s.dVf, &s.bk);
    rows_softmax_backward(s.dP, s.S, m, nf, nf, D);
    fma_M2P_scores_backward(&v, qb[i], dqi, dK, s.dP, nf, q, s.Kf, s.dKf, &s.bk);
    times->m2p += timer_now() - t0;
  }
  scratch_free(&s);
}

/* ---------------------------------------------------------------------------------------------
 * fma_linear: the near field (P2P) under its own softmax; then, per level, each query
 * sub-segment's summary against the level's list under a softmax of its own, added to the
 * sub-segment's queries */

long fma_linear_query_row(const struct fma_state *st, long rho) {
  return st->causal ? rho - 1 : rho;
}

/* Query positions of [a, b) that lie in this rank's slab: [slab_lo(a), slab_hi(b)). A query
 * sub-segment may be longer than a slab; each rank adds the shared term to its own queries. */
static long slab_lo(const struct fma_state *st, long a) { return a > st->t0 ? a : st->t0; }
static long slab_hi(const struct fma_state *st, long b) {
  return b < st->t0 + st->T ? b : st->t0 + st->T;
}

/* The level-l term of query sub-segment rho: its key rows (≤ 3p) and query row. */
static int linear_keys(const struct fma_state *st, int l, long rho, long *rows, long *qrow) {
  const long P = st->tree.p, c = rho / P;
  *qrow = fma_linear_query_row(st, rho);
  if (*qrow < 0) return 0;
  long windows[FMA_LIST_MAX];
  const int nw = fma_lists_level(&st->tree, st->causal, l, c, windows);
  int count = 0;
  for (int k = 0; k < nw; k++)
    for (long r = 0; r < P; r++) rows[count++] = windows[k] * P + r; /* within level l */
  return count;
}

/* The near field: out = softmax(P2P scores)·v_near block by block; band 0 of band_norms and the
 * entropy when band_norms is given. */
static void linear_near_forward(const struct fma_state *st, float *out, float *lse_near,
                                const float *q, const float *k, const float *v,
                                struct block_scratch *s, struct fma_times *times, float *band_norms,
                                double *entropy) {
  const long m = st->tree.m, d = st->d;
  for (long qb = st->t0 / m; qb < (st->t0 + st->T) / m; qb++) {
    fma_block_keys(st, qb, &s->bk);
    const long nn = block_scores(st, qb, q, k, s, false, times);
    double t0 = timer_now();
    rows_softmax(s->S, m, nn, lse_near + (qb * m - st->t0));
    if (band_norms) {
      double unused[1] = {0.0};
      block_diagnostics(st, s->S, m, nn, 0, &s->bk, unused, entropy); /* near-field entropy */
    }
    fma_P2P_values(st, out + (qb * m - st->t0) * d, s->S, nn, v, &s->bk);
    if (band_norms)
      for (long r = 0; r < m; r++) {
        float norm = 0.0f;
        for (long f = 0; f < d; f++) norm += fabsf(out[(qb * m - st->t0 + r) * d + f]);
        band_norms[(qb * m - st->t0 + r) * (st->tree.levels + 1)] = norm;
      }
    times->p2p += timer_now() - t0;
  }
}

/* Level l: out += each sub-segment's term; lse_far of the level; band l of band_norms. Scratch: o
 * (d), a and rows (3p). */
static void linear_level_forward(const struct fma_state *st, int l, float *out, float *lse_far,
                                 const float *Q, const float *K, const float *V, float *band_norms,
                                 float *o, float *a, long *rows) {
  const long d = st->d, P = st->tree.p;
  const float scale = 1.0f / sqrtf((float)d);
  const long base = st->level_row[l], seg = st->tree.window[l] / P;
  const float *Ql = Q + base * d, *Kl = K + base * d, *Vl = V + base * d;
  for (long rho = st->t0 / seg; rho <= (st->t0 + st->T - 1) / seg; rho++) {
    long qrow;
    const int nk = linear_keys(st, l, rho, rows, &qrow);
    lse_far[base + rho] = 0.0f;
    if (nk == 0) continue;
    float mx = -INFINITY;
    for (int j = 0; j < nk; j++) {
      float sdot = 0.0f;
      const float *kr = Kl + rows[j] * d, *qr = Ql + qrow * d;
#pragma omp simd reduction(+ : sdot)
      for (long f = 0; f < d; f++) sdot += qr[f] * kr[f];
      a[j] = sdot * scale;
      mx = a[j] > mx ? a[j] : mx;
    }
    float sum = 0.0f;
    for (int j = 0; j < nk; j++) {
      a[j] = expf(a[j] - mx);
      sum += a[j];
    }
    memset(o, 0, sizeof(float) * (size_t)d);
    for (int j = 0; j < nk; j++) {
      a[j] /= sum;
      const float *vr = Vl + rows[j] * d;
#pragma omp simd
      for (long f = 0; f < d; f++) o[f] += a[j] * vr[f];
    }
    lse_far[base + rho] = mx + logf(sum);
    for (long i = slab_lo(st, rho * seg); i < slab_hi(st, (rho + 1) * seg); i++) {
      float *oi = out + (i - st->t0) * d;
#pragma omp simd
      for (long f = 0; f < d; f++) oi[f] += o[f];
    }
    if (band_norms) {
      float norm = 0.0f;
      for (long f = 0; f < d; f++) norm += fabsf(o[f]);
      for (long i = slab_lo(st, rho * seg); i < slab_hi(st, (rho + 1) * seg); i++)
        band_norms[(i - st->t0) * (st->tree.levels + 1) + l] = norm;
    }
  }
}

void fma_linear_forward(const struct fma_state *st, float *out, float *lse_near, float *lse_far,
                        const float *q, const float *k, const float *v, const float *Q,
                        const float *K, const float *V, struct fma_times *times, float *band_norms,
                        double *entropy) {
  const long d = st->d, P = st->tree.p;
  struct block_scratch s;
  scratch_init(&s, st);
  if (band_norms) memset(band_norms, 0, sizeof(float) * (size_t)(st->T * (st->tree.levels + 1)));
  linear_near_forward(st, out, lse_near, q, k, v, &s, times, band_norms, entropy);
  double t0 = timer_now();
  float *o = xmalloc(sizeof(float) * (size_t)d);
  float *a = xmalloc(sizeof(float) * (size_t)(FMA_LIST_MAX * P));
  long *rows = xmalloc(sizeof(long) * (size_t)(FMA_LIST_MAX * P));
  for (int l = 1; l <= st->tree.levels; l++)
    linear_level_forward(st, l, out, lse_far, Q, K, V, band_norms, o, a, rows);
  free(o);
  free(a);
  free(rows);
  times->m2p += timer_now() - t0;
  scratch_free(&s);
}

/* The near field's transpose: its probabilities and its own output (for D = dO·o_near) again. */
static void linear_near_backward(const struct fma_state *st, float *dq, float *dk, float *dv,
                                 const float *dout, const float *q, const float *k, const float *v,
                                 const float *lse_near, struct block_scratch *s,
                                 struct fma_times *times) {
  const long m = st->tree.m, d = st->d;
  float *onear = mem_alloc(MEM_WORKSPACE, sizeof(float) * (size_t)(m * d));
  float *Dn = xmalloc(sizeof(float) * (size_t)m);
  for (long qb = st->t0 / m; qb < (st->t0 + st->T) / m; qb++) {
    fma_block_keys(st, qb, &s->bk);
    const long nn = block_scores(st, qb, q, k, s, false, times);
    const long i0 = qb * m;
    const float *g = dout + (i0 - st->t0) * d;
    double t0 = timer_now();
    rows_probabilities(s->S, m, nn, nn, lse_near + (i0 - st->t0));
    fma_P2P_values(st, onear, s->S, nn, v, &s->bk);
    for (long r = 0; r < m; r++) {
      float acc = 0.0f;
      for (long f = 0; f < d; f++) acc += g[r * d + f] * onear[r * d + f];
      Dn[r] = acc;
    }
    fma_P2P_values_backward(st, dv, s->dP, g, s->S, nn, v, &s->bk);
    rows_softmax_backward(s->dP, s->S, m, nn, nn, Dn);
    fma_P2P_scores_backward(st, qb, dq, dk, s->dP, nn, q, k, &s->bk);
    times->p2p += timer_now() - t0;
  }
  mem_free(onear);
  free(Dn);
}

/* Level l's transpose: dQ, dK, dV += from the sub-segments' output gradients (the sums of dout
 * over their queries). Scratch: g, o (d), a and rows (3p). */
static void linear_level_backward(const struct fma_state *st, int l, float *dQ, float *dK,
                                  float *dV, const float *dout, const float *Q, const float *K,
                                  const float *V, const float *lse_far, float *g, float *o,
                                  float *a, long *rows) {
  const long d = st->d, P = st->tree.p;
  const float scale = 1.0f / sqrtf((float)d);
  const long base = st->level_row[l], seg = st->tree.window[l] / P;
  const float *Ql = Q + base * d, *Kl = K + base * d, *Vl = V + base * d;
  float *dQl = dQ + base * d, *dKl = dK + base * d, *dVl = dV + base * d;
  for (long rho = st->t0 / seg; rho <= (st->t0 + st->T - 1) / seg; rho++) {
    long qrow;
    const int nk = linear_keys(st, l, rho, rows, &qrow);
    if (nk == 0) continue;
    /* the gradient of the sub-segment's output: the sum over its queries */
    memset(g, 0, sizeof(float) * (size_t)d);
    for (long i = slab_lo(st, rho * seg); i < slab_hi(st, (rho + 1) * seg); i++)
      for (long f = 0; f < d; f++) g[f] += dout[(i - st->t0) * d + f];
    const float *qr = Ql + qrow * d;
    const float L = lse_far[base + rho];
    memset(o, 0, sizeof(float) * (size_t)d);
    for (int j = 0; j < nk; j++) {
      float sdot = 0.0f;
      const float *kr = Kl + rows[j] * d;
      for (long f = 0; f < d; f++) sdot += qr[f] * kr[f];
      a[j] = expf(sdot * scale - L);
      const float *vr = Vl + rows[j] * d;
      for (long f = 0; f < d; f++) o[f] += a[j] * vr[f];
    }
    float D = 0.0f;
    for (long f = 0; f < d; f++) D += g[f] * o[f];
    for (int j = 0; j < nk; j++) {
      const float *vr = Vl + rows[j] * d, *kr = Kl + rows[j] * d;
      float *dvr = dVl + rows[j] * d, *dkr = dKl + rows[j] * d, *dqr = dQl + qrow * d;
      float dp = 0.0f;
      for (long f = 0; f < d; f++) {
        dvr[f] += a[j] * g[f];
        dp += g[f] * vr[f];
      }
      const float ds = a[j] * (dp - D) * scale;
      for (long f = 0; f < d; f++) {
        dqr[f] += ds * kr[f];
        dkr[f] += ds * qr[f];
      }
    }
  }
}

void fma_linear_backward(const struct fma_state *st, float *dq, float *dk, float *dv, float *dQ,
                         float *dK, float *dV, const float *dout, const float *out, const float *q,
                         const float *k, const float *v, const float *Q, const float *K,
                         const float *V, const float *lse_near, const float *lse_far,
                         struct fma_times *times) {
  const long d = st->d, P = st->tree.p;
  struct block_scratch s;
  scratch_init(&s, st);
  linear_near_backward(st, dq, dk, dv, dout, q, k, v, lse_near, &s, times);
  double t0 = timer_now();
  float *g = xmalloc(sizeof(float) * (size_t)d), *o = xmalloc(sizeof(float) * (size_t)d);
  float *a = xmalloc(sizeof(float) * (size_t)(FMA_LIST_MAX * P));
  long *rows = xmalloc(sizeof(long) * (size_t)(FMA_LIST_MAX * P));
  for (int l = 1; l <= st->tree.levels; l++)
    linear_level_backward(st, l, dQ, dK, dV, dout, Q, K, V, lse_far, g, o, a, rows);
  free(g);
  free(o);
  free(a);
  free(rows);
  times->m2p += timer_now() - t0;
  scratch_free(&s);
  (void)out;
}
