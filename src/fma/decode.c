/* Incremental decoding of causal `fma` (generation; docs/generate.md): a cache of the last 2m
 * keys and values and of every level's summaries, kept up to date token by token — P2M taps added
 * as each token arrives, M2M once both children are complete — so a token costs O(m + p·L)
 * attention work instead of O(n log n). With fma.open the cache keeps every key and value (an
 * opened fine block may lie anywhere before the query) and a token's opening runs the criterion
 * of fma/open.c on its own far row: O(m + p·L + K·(p·L + m)). Equal within rounding to the
 * batched forward's row. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "core/memory.h"
#include "fma/fma.h"
#include "fma/open.h"

struct fma_decoder {
  const struct fma_state *st;
  long H;
  struct fma_down_weights w[2]; /* K, V */
  float *X[2];                  /* (H, rows, d) summaries of keys and values */
  long hist;                    /* keys and values kept: 2m, or n with fma.open */
  float *rk, *rv;               /* (H, hist, d) the last keys and values; position j in j % hist */
  float *s;                     /* (2m + 3pL) scores */
  long *row;                    /* (3pL) summary rows of the far keys */
  float *logw;                  /* (3pL) their multiplicity terms */
  /* fma.open: the query's block lists, far row (open.width) and decisions (open.ndec) */
  struct fma_block_keys bk;
  float *F;
  int32_t *dec;
};

struct fma_decoder *fma_decode_open(struct fma_state *st, const float *params, long H) {
  if (!st->causal || st->linear) error("fma decoding is for causal fma");
  struct fma_decoder *dec = xcalloc(1, sizeof *dec);
  const bool open = st->open.K != 0;
  const long d = st->d, far = 3L * st->tree.p * st->tree.levels;
  const long ring = open ? st->tree.n : 2L * st->tree.m;
  dec->st = st;
  dec->H = H;
  dec->hist = ring;
  if (open) {
    fma_open_work_get(st, 1); /* the criterion's scratch, for a large fma.open */
    dec->bk.far_row = xcalloc((size_t)(far + 1), sizeof(long));
    dec->bk.far_logw = xcalloc((size_t)(far + 1), sizeof(float));
    dec->bk.far_level = xcalloc((size_t)(far + 1), sizeof(int));
    dec->F = mem_alloc(MEM_WORKSPACE, sizeof(float) * (size_t)(st->open.width + 1));
    dec->dec = xcalloc((size_t)st->open.ndec + 1, sizeof(int32_t));
  }
  for (int s = 0; s < 2; s++) {
    fma_weights_load(st, params, (enum fma_set)s, &dec->w[s]);
    dec->X[s] = mem_alloc(MEM_ACTIVATIONS, sizeof(float) * (size_t)(H * st->rows * d + 1));
  }
  dec->rk = mem_alloc(MEM_ACTIVATIONS, sizeof(float) * (size_t)(H * ring * d));
  dec->rv = mem_alloc(MEM_ACTIVATIONS, sizeof(float) * (size_t)(H * ring * d));
  dec->s = mem_alloc(MEM_WORKSPACE, sizeof(float) * (size_t)(ring + far + 1));
  dec->row = xcalloc((size_t)(far + 1), sizeof(long));
  dec->logw = xcalloc((size_t)(far + 1), sizeof(float));
  return dec;
}

void fma_decode_close(struct fma_decoder *dec) {
  if (!dec) return;
  for (int s = 0; s < 2; s++) {
    fma_weights_free(dec->st, &dec->w[s]);
    mem_free(dec->X[s]);
  }
  mem_free(dec->rk);
  mem_free(dec->rv);
  mem_free(dec->s);
  free(dec->row);
  free(dec->logw);
  free(dec->bk.far_row);
  free(dec->bk.far_logw);
  free(dec->bk.far_level);
  mem_free(dec->F);
  free(dec->dec);
  free(dec);
}

/* Fold token x (d) at position i into the summaries X (rows, d) of one head and one set. */
static void summaries_add(const struct fma_state *st, const struct fma_down_weights *w, float *X,
                          const float *x, long i) {
  const long d = st->d, P = st->tree.p;
  for (int l = 1; l <= st->tree.levels; l++) {
    const long win = st->tree.window[l], c = i / win, tau = i % win;
    float *rows = X + (st->level_row[l] + c * P) * d;
    if (st->down == FMA_DOWN_M2M && l > 1) { /* from the two children, once they are complete */
      if (tau == win - 1) fma_M2M_window(st, l, c, X, w);
      continue;
    }
    if (tau == 0) { /* a window begins: its bias (conv, m2m), or nothing (avg) */
      if (st->down == FMA_DOWN_AVG)
        memset(rows, 0, sizeof(float) * (size_t)(P * d));
      else
        memcpy(rows, w->bt[l], sizeof(float) * (size_t)(P * d));
    }
    if (st->down == FMA_DOWN_AVG) { /* the mean of sub-segment r */
      const long seg = win / P;
      float *o = rows + (tau / seg) * d;
      for (long f = 0; f < d; f++) o[f] += x[f] / (float)seg;
      continue;
    }
    const long span = st->layout.span[l];
    for (long r = 0; r < P; r++) { /* tap tau of every summary row */
      const float *wr = w->wt[l] + (r * span + tau) * d;
      float *o = rows + r * d;
      for (long f = 0; f < d; f++) o[f] += wr[f] * x[f];
    }
  }
}

static float dot(const float *a, const float *b, long d) {
  float acc = 0.0f;
  for (long f = 0; f < d; f++) acc += a[f] * b[f];
  return acc;
}

/* fma.open, one head at position i: the query's far row — its listed summary rows, then level by
 * level the criterion (fma_open_select) and the scores of what it opened: the children's summary
 * rows, or an opened fine block's keys from the history — masked, then one softmax with the near
 * field (the last keys up to i) and the values. XK, XV: the head's summaries; rk, rv its
 * history (every position). */
static void open_step(struct fma_decoder *dec, float *o, const float *qh, const float *XK,
                      const float *XV, const float *rk, const float *rv, long i) {
  const struct fma_state *st = dec->st;
  const struct fma_open_layout *ol = &st->open;
  const struct fma_tree *tr = &st->tree;
  const long d = st->d, m = tr->m, p = tr->p, width = ol->width;
  const float scale = 1.0f / sqrtf((float)d);
  const struct fma_block_keys *bk = &dec->bk;
  float *F = dec->F;
  for (long c = 0; c < width; c++)
    F[c] = c < bk->nfar ? dot(qh, XK + bk->far_row[c] * d, d) * scale + bk->far_logw[c] : -INFINITY;
  for (int l = tr->levels; l >= 1; l--) {
    fma_open_select(st, l, bk, F, qh, XK, dec->dec);
    const float logw = l >= 2 && st->multiplicity ? logf((float)(tr->window[l - 1] / p)) : 0.0f;
    for (int j = 0; j < ol->slots[l]; j++) {
      const int32_t c = dec->dec[ol->dec_off[l] + j];
      if (c < 0) continue;
      const float *R = l >= 2 ? XK + (st->level_row[l - 1] + 2L * c * p) * d : rk + c * m * d;
      for (long t = 0; t < ol->slot_width[l]; t++)
        F[ol->col[l] + j * ol->slot_width[l] + t] = dot(qh, R + t * d, d) * scale + logw;
    }
  }
  fma_open_mask(st, bk, F, dec->dec);
  const long lo = i / m * m - m > 0 ? i / m * m - m : 0, nnear = i - lo + 1;
  float mx = -INFINITY, sum = 0.0f;
  for (long j = 0; j < nnear; j++) {
    dec->s[j] = dot(qh, rk + (lo + j) * d, d) * scale;
    mx = dec->s[j] > mx ? dec->s[j] : mx;
  }
  for (long c = 0; c < width; c++) mx = F[c] > mx ? F[c] : mx;
  memset(o, 0, sizeof(float) * (size_t)d);
  for (long j = 0; j < nnear; j++) {
    const float e = expf(dec->s[j] - mx);
    sum += e;
    for (long f = 0; f < d; f++) o[f] += e * rv[(lo + j) * d + f];
  }
  for (long c = 0; c < width; c++) {
    if (F[c] == -INFINITY) continue;
    const float e = expf(F[c] - mx);
    const float *val = NULL;
    sum += e;
    if (c < bk->nfar) {
      val = XV + bk->far_row[c] * d;
    } else {
      int l;
      for (l = tr->levels; l >= 1; l--) /* the level whose slots hold column c */
        if (c >= ol->col[l] && c < ol->col[l] + (long)ol->slots[l] * ol->slot_width[l]) break;
      const long j = (c - ol->col[l]) / ol->slot_width[l], t = (c - ol->col[l]) % ol->slot_width[l];
      const int32_t w = dec->dec[ol->dec_off[l] + j];
      val = l >= 2 ? XV + (st->level_row[l - 1] + 2L * w * p + t) * d : rv + (w * m + t) * d;
    }
    for (long f = 0; f < d; f++) o[f] += e * val[f];
  }
  for (long f = 0; f < d; f++) o[f] /= sum;
}

void fma_decode_step(struct fma_decoder *dec, float *out, const float *q, const float *k,
                     const float *v, long i) {
  const struct fma_state *st = dec->st;
  const struct fma_tree *tr = &st->tree;
  const long d = st->d, m = tr->m, ring = dec->hist, rows = st->rows;
  const float scale = 1.0f / sqrtf((float)d);
  /* the far keys of position i: every level's listed windows (complete, earlier than i's own) */
  long windows[FMA_LIST_MAX], nfar = 0;
  for (int l = 1; l <= tr->levels; l++) {
    const int nw = fma_lists_level(tr, true, l, i / tr->window[l], windows);
    const float logw = st->multiplicity ? logf((float)(tr->window[l] / tr->p)) : 0.0f;
    for (int a = 0; a < nw; a++)
      for (long r = 0; r < tr->p; r++, nfar++) {
        dec->row[nfar] = st->level_row[l] + windows[a] * tr->p + r;
        dec->logw[nfar] = logw;
      }
  }
  if (st->open.K != 0) fma_block_keys(st, i / m, &dec->bk);
  const long lo = i / m * m - m > 0 ? i / m * m - m : 0; /* block b − 1, then b up to i */
  const long nnear = i - lo + 1;
  for (long h = 0; h < dec->H; h++) {
    const float *qh = q + h * d;
    float *rk = dec->rk + h * ring * d, *rv = dec->rv + h * ring * d;
    float *XK = dec->X[FMA_K] + h * rows * d, *XV = dec->X[FMA_V] + h * rows * d;
    memcpy(rk + (i % ring) * d, k + h * d, sizeof(float) * (size_t)d);
    memcpy(rv + (i % ring) * d, v + h * d, sizeof(float) * (size_t)d);
    summaries_add(st, &dec->w[FMA_K], XK, k + h * d, i);
    summaries_add(st, &dec->w[FMA_V], XV, v + h * d, i);
    if (st->open.K != 0) {
      open_step(dec, out + h * d, qh, XK, XV, rk, rv, i);
      continue;
    }
    /* one softmax over the near keys and the far summaries */
    float mx = -INFINITY, sum = 0.0f;
    for (long j = 0; j < nnear + nfar; j++) {
      const float *key = j < nnear ? rk + ((lo + j) % ring) * d : XK + dec->row[j - nnear] * d;
      float dot = 0.0f;
      for (long f = 0; f < d; f++) dot += qh[f] * key[f];
      dec->s[j] = dot * scale + (j < nnear ? 0.0f : dec->logw[j - nnear]);
      mx = dec->s[j] > mx ? dec->s[j] : mx;
    }
    float *o = out + h * d;
    memset(o, 0, sizeof(float) * (size_t)d);
    for (long j = 0; j < nnear + nfar; j++) {
      const float e = expf(dec->s[j] - mx);
      const float *val = j < nnear ? rv + ((lo + j) % ring) * d : XV + dec->row[j - nnear] * d;
      sum += e;
      for (long f = 0; f < d; f++) o[f] += e * val[f];
    }
    for (long f = 0; f < d; f++) o[f] /= sum;
  }
}
