/* Balanced causal work for fma under sequence parallelism (fma/balance.h). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "fma/balance.h"
#include "fma/let.h"
#include "parallel/simsample.h"

/* A rank within this fraction of the mean counted work is not helped: an exchange each way in
 * forward and backward costs more than it saves. */
#define BALANCE_TOLERANCE 0.005

/* ---------------------------------------------------------------------------------------------
 * the counted work, from the lists in closed form: O(levels) per rank, never O(n) */

static int list_len(const struct fma_tree *tr, bool causal, int l, long c) {
  long w[FMA_LIST_MAX];
  return fma_lists_level(tr, causal, l, c, w);
}

/* Σ of the list lengths of windows [a, b) of level l: the three windows at either end from the
 * lists themselves, the interior (where a list depends on c's parity alone) by counting. */
static double list_sum(const struct fma_tree *tr, bool causal, int l, long a, long b) {
  const long N = tr->nwindows[l], ia = a > 3 ? a : 3, ib = b < N - 3 ? b : N - 3;
  double sum = 0.0;
  if (ib <= ia) { /* b − a ≤ 6 here */
    for (long c = a; c < b; c++) sum += list_len(tr, causal, l, c);
    return sum;
  }
  for (long c = a; c < ia; c++) sum += list_len(tr, causal, l, c);
  for (long c = ib; c < b; c++) sum += list_len(tr, causal, l, c);
  const long n = ib - ia, even = (n + (ia % 2 == 0)) / 2, first_even = ia + ia % 2;
  const long first_odd = ia + 1 - ia % 2;
  if (even > 0) sum += (double)even * list_len(tr, causal, l, first_even);
  if (n - even > 0) sum += (double)(n - even) * list_len(tr, causal, l, first_odd);
  return sum;
}

/* Summary rows (per head) the query blocks [B0, B1) list at level l. */
static double level_rows(const struct fma_state *st, int l, long B0, long B1) {
  const struct fma_tree *tr = &st->tree;
  const long m = tr->m, w = tr->window[l], per = w / m;
  const long c0 = B0 * m / w, c1 = (B1 * m - 1) / w;
  const bool causal = st->causal;
  if (c0 == c1) return (double)tr->p * (double)(B1 - B0) * list_len(tr, causal, l, c0);
  const long first = (c0 + 1) * per - B0, last = B1 - c1 * per;
  return (double)tr->p *
         ((double)first * list_len(tr, causal, l, c0) + (double)last * list_len(tr, causal, l, c1) +
          (double)per * list_sum(tr, causal, l, c0 + 1, c1));
}

/* Near keys of blocks [B0, B1): two blocks each under causal masking, the first block one. */
static double near_keys(const struct fma_state *st, long B0, long B1) {
  const struct fma_tree *tr = &st->tree;
  const double blocks =
      (double)(B1 - B0) * (st->causal ? 2 : 3) - (B0 == 0) - (!st->causal && B1 == tr->nblocks);
  return blocks * (double)tr->m;
}

/* The spanning levels' rows of one block: the part of its work a helper can take. */
static double movable_rows(const struct fma_state *st, int lspan, long b) {
  double rows = 0.0;
  for (int l = lspan; l <= st->tree.levels; l++)
    rows += (double)st->tree.p *
            list_len(&st->tree, st->causal, l, b * st->tree.m / st->tree.window[l]);
  return rows;
}

/* ---------------------------------------------------------------------------------------------
 * the plan */

struct transfer {
  int from, to;
  double rows;
};

/* The blocks donor gives in each of its k transfers (in order), from the end of its slab
 * backward, each part as many whole blocks as reach its cumulative amount. */
static void walk(const struct fma_state *st, int lspan, int donor, const struct transfer *t, int k,
                 struct fma_balance_part *parts, double *rows) {
  const long per = st->T / st->tree.m, B0 = donor * per;
  long b = B0 + per - 1;
  double cum = 0.0, target = 0.0;
  for (int j = 0; j < k; j++) {
    const long hi = b + 1;
    double part = 0.0;
    target += t[j].rows;
    while (b >= B0) { /* the nearest whole block to the target */
      const double r = movable_rows(st, lspan, b);
      if (cum + 0.5 * r >= target) break;
      cum += r;
      part += r;
      b--;
    }
    parts[j] = (struct fma_balance_part){t[j].to, b + 1, hi};
    rows[j] = part;
  }
}

struct fma_balance *fma_balance_plan(struct fma_state *st) {
  const struct fma_let *let = st->let;
  if (!let || !st->causal || st->linear || st->open.K != 0) return NULL;
  const int S = let->S, me = let->s, L = st->tree.levels;
  int lspan = let->lspan; /* the first level every rank holds whole: from it on, the work moves */
  if (lspan > L) return NULL;
  while (lspan > 1 && fma_level_everywhere(st, lspan - 1)) lspan--;
  const long per = st->T / st->tree.m;
  double *W = xcalloc(4 * (size_t)S, sizeof(double)), *M = W + S, *cap = W + 2 * S,
         *need = W + 3 * S;
  double total = 0.0, most = 0.0;
  for (int r = 0; r < S; r++) {
    const long B0 = r * per, B1 = B0 + per;
    W[r] = near_keys(st, B0, B1);
    for (int l = 1; l <= L; l++) {
      const double rows = level_rows(st, l, B0, B1);
      W[r] += rows;
      if (l >= lspan) M[r] += rows;
    }
    total += W[r];
    most = W[r] > most ? W[r] : most;
  }
  const double mean = total / S;
  struct fma_balance *b = NULL;
  if (most > (1.0 + BALANCE_TOLERANCE) * mean) {
    for (int r = 0; r < S; r++) {
      cap[r] = W[r] > mean ? fmin(W[r] - mean, M[r]) : 0.0;
      need[r] = W[r] < mean ? mean - W[r] : 0.0;
    }
    /* the heaviest ranks (the last) give to the lightest (the first), in rank order */
    struct transfer *t = xmalloc(sizeof *t * 2 * (size_t)S);
    int nt = 0;
    for (int d = S - 1, h = 0; d >= 0 && h < S;) {
      if (cap[d] <= 0.0) {
        d--;
      } else if (need[h] <= 0.0) {
        h++;
      } else {
        const double a = fmin(cap[d], need[h]);
        t[nt++] = (struct transfer){d, h, a};
        cap[d] -= a;
        need[h] -= a;
        if (cap[d] <= 1e-9 * mean) cap[d] = 0.0;
        if (need[h] <= 1e-9 * mean) need[h] = 0.0;
      }
    }
    b = xcalloc(1, sizeof *b);
    b->S = S;
    b->lo = lspan;
    b->give = xcalloc((size_t)nt + 1, sizeof *b->give);
    b->take = xcalloc((size_t)nt + 1, sizeof *b->take);
    double *rows = xcalloc((size_t)nt + 1, sizeof(double));
    for (int i = 0; i < nt;) { /* one donor's transfers are consecutive */
      int j = i;
      while (j < nt && t[j].from == t[i].from) j++;
      const int donor = t[i].from;
      struct fma_balance_part *parts = xcalloc((size_t)(j - i), sizeof *parts);
      walk(st, lspan, donor, t + i, j - i, parts, rows);
      for (int k = 0; k < j - i; k++) {
        W[donor] -= rows[k];
        W[parts[k].rank] += rows[k];
        if (donor == me) {
          b->give[b->ngive++] = parts[k];
          b->ngive_blocks += parts[k].b1 - parts[k].b0;
          b->rows_out += rows[k];
        } else if (parts[k].rank == me) {
          b->take[b->ntake++] = (struct fma_balance_part){donor, parts[k].b0, parts[k].b1};
          b->ntake_blocks += parts[k].b1 - parts[k].b0;
          b->rows_in += rows[k];
        }
      }
      free(parts);
      i = j;
    }
    double after = 0.0;
    for (int r = 0; r < S; r++) after = W[r] > after ? W[r] : after;
    b->before = most / mean;
    b->after = after / mean;
    b->take_qb = xmalloc(sizeof(long) * (size_t)(b->ntake_blocks + 1));
    long k = 0;
    for (int i = 0; i < b->ntake; i++)
      for (long q = b->take[i].b0; q < b->take[i].b1; q++) b->take_qb[k++] = q;
    for (int i = 0; i < b->ngive; i++)
      if (b->give[i].b1 > b->give[i].b0 && b->give[i].b0 < st->far_cut) st->far_cut = b->give[i].b0;
    st->far_top = lspan - 1;
    free(rows);
    free(t);
  }
  free(W);
  return b;
}

void fma_balance_free(struct fma_balance *b) {
  if (!b) return;
  free(b->give);
  free(b->take);
  free(b->take_qb);
  free(b);
}

/* ---------------------------------------------------------------------------------------------
 * the exchanges: per part, heads outermost, then its blocks, `unit` floats per block and head */

static long blocks_of(const struct fma_balance_part *p) { return p->b1 - p->b0; }

/* Start x: send `out`'s parts (packed in sbuf by the caller, in part order) and receive `in`'s,
 * unit_out and unit_in floats per block and head. */
static void start(struct comm *c, struct fma_balance_xfer *x, const struct fma_balance_part *out,
                  int nout, long unit_out, const struct fma_balance_part *in, int nin, long unit_in,
                  long BH) {
  const int S = c->S;
  size_t *cnt = xcalloc(4 * (size_t)S, sizeof(size_t)), *sd = cnt + S, *rc = cnt + 2 * S,
         *rd = cnt + 3 * S;
  size_t off = 0;
  for (int i = 0; i < nout; i++) {
    cnt[out[i].rank] = (size_t)(blocks_of(&out[i]) * BH * unit_out);
    sd[out[i].rank] = off;
    off += cnt[out[i].rank];
  }
  off = 0;
  for (int i = 0; i < nin; i++) {
    rc[in[i].rank] = (size_t)(blocks_of(&in[i]) * BH * unit_in);
    rd[in[i].rank] = off;
    off += rc[in[i].rank];
  }
  x->counts = cnt;
  x->c = c;
  x->active = true;
  comm_ialltoallv_float(c, x->sbuf, cnt, sd, x->rbuf, rc, rd, &x->req);
}

static void take_buffers(struct comm *c, struct fma_balance_xfer *x, enum comm_buffer_slot s,
                         enum comm_buffer_slot r, size_t send, size_t recv) {
  x->sslot = s;
  x->rslot = r;
  x->sbuf = comm_buffer(c, s, send + 1);
  x->rbuf = comm_buffer(c, r, recv + 1);
}

static void finish(struct fma_balance_xfer *x) {
  if (!x->active) return;
  comm_wait(&x->req);
}

static void release(struct fma_balance_xfer *x) {
  comm_buffer_release(x->c, x->sslot);
  comm_buffer_release(x->c, x->rslot);
  free(x->counts);
  x->active = false;
}

/* One array a block's rows are packed from: (BH, T, width), `head` floats per head. */
struct field {
  const float *a;
  long width; /* floats per row */
  long head;  /* floats per head */
};

/* The given parts' blocks of each field into buf: per part, per head, per block, the fields' m rows
 * one after another. */
static void pack(const struct fma_state *st, float *buf, const struct fma_balance_part *parts,
                 int np, long BH, const struct field *f, int nf) {
  const long m = st->tree.m;
  long width = 0, blocks = 0;
  for (int k = 0; k < nf; k++) width += f[k].width;
  for (int i = 0; i < np; i++) blocks += blocks_of(&parts[i]);
  if (blocks == 0) return; /* a sampled site measures only regions with work */
  struct sim_sample smp;
  if (!sim_sample_begin(&smp, "fma balance pack", (double)(blocks * BH * m * width))) return;
  for (int i = 0; i < np; i++)
    for (long bh = 0; bh < BH; bh++)
      for (long qb = parts[i].b0; qb < parts[i].b1; qb++)
        for (int k = 0; k < nf; k++) {
          const long n = m * f[k].width;
          memcpy(buf, f[k].a + bh * f[k].head + (qb * m - st->t0) * f[k].width,
                 sizeof(float) * (size_t)n);
          buf += n;
        }
  sim_sample_end(&smp);
}

static void merge_times(struct fma_times *into, const struct fma_times *t) {
#pragma omp critical(fma_balance_times)
  { into->m2p += t->m2p; }
}

/* Evaluate the blocks taken (forward: their parts of the softmax; backward: the transposes) from
 * x's received buffer into y's send buffer, heads in parallel. */
static void serve(const struct fma_state *st, const float *K, const float *V, float *dK, float *dV,
                  long BH, const float *in, long unit_in, float *out, long unit_out, bool backward,
                  struct fma_times *times) {
  const struct fma_balance *b = st->let->bal;
  const long m = st->tree.m, d = st->d, rows = st->rows;
  if (b->ntake_blocks == 0) return;
  struct sim_sample smp;
  if (!sim_sample_begin(&smp, backward ? "fma balance backward" : "fma balance forward",
                        (double)BH * b->rows_in)) {
    times->m2p += smp.charged;
    return;
  }
#pragma omp parallel
  {
    struct fma_times t = {0};
#pragma omp for schedule(dynamic, 1)
    for (long bh = 0; bh < BH; bh++) {
      long ioff = 0, ooff = 0, k = 0;
      for (int i = 0; i < b->ntake; i++) {
        const long nb = blocks_of(&b->take[i]);
        const float *src = in + ioff + bh * nb * unit_in;
        float *dst = out + ooff + bh * nb * unit_out;
        if (backward)
          fma_evaluate_far_part_backward(st, b->lo, b->take_qb + k, nb, src, unit_in,
                                         K + bh * rows * d, V + bh * rows * d, dK + bh * rows * d,
                                         dV + bh * rows * d, dst, unit_out, &t);
        else
          fma_evaluate_far_part(st, b->lo, b->take_qb + k, nb, src, unit_in, K + bh * rows * d,
                                V + bh * rows * d, dst, dst + m * d, unit_out, &t);
        ioff += BH * nb * unit_in;
        ooff += BH * nb * unit_out;
        k += nb;
      }
    }
    merge_times(times, &t);
  }
  sim_sample_end(&smp);
}

/* ---------------------------------------------------------------------------------------------
 * forward */

void fma_balance_forward_start(const struct fma_state *st, struct comm *c, const float *q, long BH,
                               struct fma_balance_xfer *x) {
  const struct fma_balance *b = st->let->bal;
  const long m = st->tree.m, d = st->d, unit = m * d;
  take_buffers(c, x, COMM_BUF_BAL_SEND, COMM_BUF_BAL_RECV, (size_t)(b->ngive_blocks * BH * unit),
               (size_t)(b->ntake_blocks * BH * unit));
  const struct field f = {q, d, st->T * d};
  pack(st, x->sbuf, b->give, b->ngive, BH, &f, 1);
  start(c, x, b->give, b->ngive, unit, b->take, b->ntake, unit, BH);
}

/* The helper's turn, forward or backward: wait for x (the given blocks' inputs), evaluate the
 * blocks taken into y's send buffer, start y (the parts back to their owners), free x. */
static void serve_and_return(const struct fma_state *st, const float *K, const float *V, float *dK,
                             float *dV, long BH, struct fma_balance_xfer *x, long unit_in,
                             struct fma_balance_xfer *y, long unit_out, bool backward,
                             struct fma_times *times) {
  const struct fma_balance *b = st->let->bal;
  finish(x);
  take_buffers(x->c, y, COMM_BUF_BAL_RET_SEND, COMM_BUF_BAL_RET_RECV,
               (size_t)(b->ntake_blocks * BH * unit_out),
               (size_t)(b->ngive_blocks * BH * unit_out));
  serve(st, K, V, dK, dV, BH, x->rbuf, unit_in, y->sbuf, unit_out, backward, times);
  start(x->c, y, b->take, b->ntake, unit_out, b->give, b->ngive, unit_out, BH);
  release(x);
}

void fma_balance_forward_serve(const struct fma_state *st, const float *K, const float *V, long BH,
                               struct fma_balance_xfer *x, struct fma_balance_xfer *y,
                               struct fma_times *times) {
  const long m = st->tree.m, d = st->d;
  serve_and_return(st, K, V, NULL, NULL, BH, x, m * d, y, m * d + m, false, times);
}

/* o, lse: the rows so far; op, lp: a part of the same softmax over other columns. */
static void merge_row(float *o, float *lse, const float *op, float lp, long d) {
  if (lp == -INFINITY) return;
  const float a = *lse, top = a > lp ? a : lp;
  const float L = top + logf(expf(a - top) + expf(lp - top));
  const float wa = expf(a - L), wb = expf(lp - L);
#pragma omp simd
  for (long f = 0; f < d; f++) o[f] = o[f] * wa + op[f] * wb;
  *lse = L;
}

void fma_balance_forward_finish(const struct fma_state *st, float *out, float *lse, long BH,
                                struct fma_balance_xfer *y) {
  const struct fma_balance *b = st->let->bal;
  const long m = st->tree.m, d = st->d, T = st->T, unit = m * d + m;
  finish(y);
  const float *p = y->rbuf;
  struct sim_sample smp;
  if (b->ngive_blocks > 0 &&
      sim_sample_begin(&smp, "fma balance merge forward", (double)(b->ngive_blocks * BH))) {
    for (int i = 0; i < b->ngive; i++)
      for (long bh = 0; bh < BH; bh++)
        for (long qb = b->give[i].b0; qb < b->give[i].b1; qb++, p += unit)
          for (long r = 0; r < m; r++) {
            const long row = bh * T + qb * m - st->t0 + r;
            merge_row(out + row * d, lse + row, p + r * d, p[m * d + r], d);
          }
    sim_sample_end(&smp);
  }
  release(y);
}

/* ---------------------------------------------------------------------------------------------
 * backward */

void fma_balance_backward_start(const struct fma_state *st, struct comm *c, const float *q,
                                const float *dout, const float *D, const float *lse, long BH,
                                struct fma_balance_xfer *x) {
  const struct fma_balance *b = st->let->bal;
  const long m = st->tree.m, d = st->d, T = st->T, unit = 2 * m * d + 2 * m;
  take_buffers(c, x, COMM_BUF_BAL_SEND, COMM_BUF_BAL_RECV, (size_t)(b->ngive_blocks * BH * unit),
               (size_t)(b->ntake_blocks * BH * unit));
  const struct field f[4] = {{q, d, T * d}, {dout, d, T * d}, {D, 1, T}, {lse, 1, T}};
  pack(st, x->sbuf, b->give, b->ngive, BH, f, 4);
  start(c, x, b->give, b->ngive, unit, b->take, b->ntake, unit, BH);
}

void fma_balance_backward_serve(const struct fma_state *st, const float *K, const float *V,
                                float *dK, float *dV, long BH, struct fma_balance_xfer *x,
                                struct fma_balance_xfer *y, struct fma_times *times) {
  const long m = st->tree.m, d = st->d;
  serve_and_return(st, K, V, dK, dV, BH, x, 2 * m * d + 2 * m, y, m * d, true, times);
}

void fma_balance_backward_finish(const struct fma_state *st, float *dq, long BH,
                                 struct fma_balance_xfer *y) {
  const struct fma_balance *b = st->let->bal;
  const long m = st->tree.m, d = st->d, T = st->T, unit = m * d;
  finish(y);
  const float *p = y->rbuf;
  struct sim_sample smp;
  if (b->ngive_blocks > 0 &&
      sim_sample_begin(&smp, "fma balance merge backward", (double)(b->ngive_blocks * BH))) {
    for (int i = 0; i < b->ngive; i++)
      for (long bh = 0; bh < BH; bh++)
        for (long qb = b->give[i].b0; qb < b->give[i].b1; qb++, p += unit) {
          float *o = dq + (bh * T + qb * m - st->t0) * d;
#pragma omp simd
          for (long f = 0; f < unit; f++) o[f] += p[f];
        }
    sim_sample_end(&smp);
  }
  release(y);
}
