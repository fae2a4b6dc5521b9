/* The locally essential tree of distributed FMA (fma/let.h). Rank s holds tokens [s·T, (s+1)·T)
 * (S and T/m are powers of two). A level's windows are whole on one rank while w_l ≤ T; a coarser
 * level's windows span ranks, and every rank computes every one of them after one exchange: for
 * m2m each rank's top window (level lspan − 1, its whole slab) gathered to all, then M2M of the
 * few spanning levels (S − 1 windows); for conv and avg one allreduce of every rank's shares of
 * the spanning windows' sums. A window's owner is the rank holding its first token; the LET's
 * fetch moves only what a rank's lists name and does not hold. */
#include "fma/let.h"

#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "core/memory.h"
#include "core/timer.h"
#include "fma/balance.h"

/* ---------------------------------------------------------------------------------------------
 * the plan */

bool fma_let_holds(const struct fma_state *st, int r, int l, long c) {
  const long w = st->tree.window[l], T = st->T;
  if (fma_level_everywhere(st, l)) return true;
  return c * w >= (long)r * T && c * w < (long)(r + 1) * T;
}

static int owner(const struct fma_state *st, int l, long c) {
  return (int)(c * st->tree.window[l] / st->T);
}

/* mark[c − lo] = 1 for every window of level l in [lo, hi) that rank r's queries list (and, for
 * fma_linear, whose query rows its sub-segments read); l is a level whose windows fit a slab.
 * Only r's windows whose lists can reach [lo, hi) are visited. */
static void mark_needs(const struct fma_state *st, int r, int l, long lo, long hi,
                       unsigned char *mark) {
  const struct fma_tree *tr = &st->tree;
  const long T = st->T, w = tr->window[l];
  memset(mark, 0, (size_t)(hi - lo));
  long c0 = (long)r * T / w, c1 = (long)(r + 1) * T / w;
  c0 = c0 > lo - FMA_LIST_REACH ? c0 : lo - FMA_LIST_REACH;
  c1 = c1 < hi + FMA_LIST_REACH ? c1 : hi + FMA_LIST_REACH;
  for (long c = c0; c < c1; c++) {
    long list[FMA_LIST_MAX];
    const int nw = fma_lists_level(tr, st->causal, l, c, list);
    for (int k = 0; k < nw; k++)
      if (list[k] >= lo && list[k] < hi) mark[list[k] - lo] = 1;
  }
  if (st->linear) {
    const long seg = w / tr->p;
    long rho0 = (long)r * T / seg, rho1 = ((long)(r + 1) * T - 1) / seg;
    rho0 = rho0 > lo * tr->p ? rho0 : lo * tr->p;
    rho1 = rho1 < hi * tr->p ? rho1 : hi * tr->p;
    for (long rho = rho0; rho <= rho1; rho++) {
      const long qrow = fma_linear_query_row(st, rho);
      if (qrow >= 0 && qrow / tr->p >= lo && qrow / tr->p < hi) mark[qrow / tr->p - lo] = 1;
    }
  }
}

/* The (level, window) lists of one direction, [off[r], off[r + 1]) for rank r: counted in a first
 * pass (level, window NULL), filled in a second. */
struct list_builder {
  int *level;
  long *window;
  size_t *off, *fill;
};

static void add_window(struct list_builder *b, int r, int l, long c) {
  if (b->level) {
    b->level[b->off[r] + b->fill[r]] = l;
    b->window[b->off[r] + b->fill[r]] = c;
  }
  b->fill[r]++;
}

/* What this rank receives at level l (the windows its lists name that it does not hold, from
 * their owners) and sends (its windows that rank r's lists name and r does not hold, to every r
 * whose lists can reach them): window order within a level, levels in order, on both sides. */
static void plan_level(const struct fma_state *st, const struct fma_let *let, int l,
                       struct list_builder *recv, struct list_builder *send) {
  const long T = st->T, w = st->tree.window[l];
  const int s = let->s;
  long lo, hi;
  fma_touched_windows(st, st->t0, l, &lo, &hi);
  unsigned char *mark = xmalloc((size_t)(hi - lo) + 1);
  mark_needs(st, s, l, lo, hi, mark);
  for (long c = lo; c < hi; c++)
    if (mark[c - lo] && !fma_let_holds(st, s, l, c)) add_window(recv, owner(st, l, c), l, c);
  free(mark);
  const long mine0 = (long)s * T / w, mine1 = (long)(s + 1) * T / w; /* the windows I own */
  mark = xmalloc((size_t)(mine1 - mine0) + 1);
  for (int r = 0; r < let->S; r++) {
    const long r0 = (long)r * T / w, r1 = (long)(r + 1) * T / w;
    if (r == s || r1 + FMA_LIST_REACH < mine0 || r0 - FMA_LIST_REACH > mine1) continue;
    mark_needs(st, r, l, mine0, mine1, mark);
    for (long c = mine0; c < mine1; c++)
      if (mark[c - mine0] && !fma_let_holds(st, r, l, c)) add_window(send, r, l, c);
  }
  free(mark);
}

struct fma_let *fma_let_plan(const struct fma_state *st, const struct comm *c) {
  const struct fma_tree *tr = &st->tree;
  struct fma_let *let = xcalloc(1, sizeof *let);
  let->S = c->S;
  let->s = c->seq_rank;
  const int S = c->S, L = tr->levels;
  let->lspan = fma_spanning_level(st);
  halo_plan(&let->near, c, tr->n, st->T, tr->m, st->causal ? 0 : tr->m);
  let->send_off = xcalloc((size_t)S + 1, sizeof(size_t));
  let->recv_off = xcalloc((size_t)S + 1, sizeof(size_t));
  struct list_builder recv = {.off = let->recv_off}, send = {.off = let->send_off};
  for (int pass = 0; pass < 2; pass++) { /* count, then fill */
    recv.fill = xcalloc((size_t)S, sizeof(size_t));
    send.fill = xcalloc((size_t)S, sizeof(size_t));
    for (int l = 1; l <= L; l++)
      if (!fma_level_everywhere(st, l)) plan_level(st, let, l, &recv, &send);
    if (pass == 0) {
      for (int r = 0; r < S; r++) {
        let->send_off[r + 1] = let->send_off[r] + send.fill[r];
        let->recv_off[r + 1] = let->recv_off[r] + recv.fill[r];
      }
      send.level = let->send_level = xcalloc(let->send_off[S] + 1, sizeof(int));
      send.window = let->send_window = xcalloc(let->send_off[S] + 1, sizeof(long));
      recv.level = let->recv_level = xcalloc(let->recv_off[S] + 1, sizeof(int));
      recv.window = let->recv_window = xcalloc(let->recv_off[S] + 1, sizeof(long));
    }
    free(recv.fill);
    free(send.fill);
  }
  return let;
}

void fma_let_free(struct fma_let *let) {
  if (!let) return;
  halo_free(&let->near);
  free(let->send_level);
  free(let->send_window);
  free(let->recv_level);
  free(let->recv_window);
  free(let->send_off);
  free(let->recv_off);
  fma_balance_free(let->bal);
  free(let);
}

/* ---------------------------------------------------------------------------------------------
 * moving windows: p rows of d floats per (set, head, window) */

struct windows {
  const int *level;
  const long *window;
  size_t count;
};

static size_t window_floats(const struct fma_state *st, int nsets, long count) {
  return (size_t)nsets * (size_t)count * (size_t)(st->tree.p * st->d);
}

static void pack(const struct fma_state *st, float *buf, const float *const *X, int nsets,
                 long count, struct windows ws) {
  const long P = st->tree.p, d = st->d;
  for (int s = 0; s < nsets; s++)
    for (long h = 0; h < count; h++)
      for (size_t k = 0; k < ws.count; k++) {
        const long row = st->level_row[ws.level[k]] + ws.window[k] * P;
        memcpy(buf, X[s] + (h * st->rows + row) * d, sizeof(float) * (size_t)(P * d));
        buf += P * d;
      }
}

static void unpack(const struct fma_state *st, const float *buf, float *const *X, int nsets,
                   long count, struct windows ws, bool add) {
  const long P = st->tree.p, d = st->d;
  for (int s = 0; s < nsets; s++)
    for (long h = 0; h < count; h++)
      for (size_t k = 0; k < ws.count; k++) {
        const long row = st->level_row[ws.level[k]] + ws.window[k] * P;
        float *dst = X[s] + (h * st->rows + row) * d;
        if (add)
          for (long i = 0; i < P * d; i++) dst[i] += buf[i];
        else
          memcpy(dst, buf, sizeof(float) * (size_t)(P * d));
        buf += P * d;
      }
}

/* The rows of levels [l0, L] of every (set, head), consecutive (the spanning levels: all their
 * windows; they end the summary rows): packed from X into buf, or buf unpacked into X. */
static size_t span_floats(const struct fma_state *st, int l0) {
  return (size_t)(st->level_row[st->tree.levels + 1] - st->level_row[l0]) * (size_t)st->d;
}

static void span_rows(const struct fma_state *st, int l0, float *const *X, float *buf, int nsets,
                      long count, bool to_buf) {
  const size_t per = span_floats(st, l0);
  for (int s = 0; s < nsets; s++)
    for (long h = 0; h < count; h++) {
      float *x = X[s] + ((size_t)h * st->rows + st->level_row[l0]) * st->d;
      if (to_buf)
        memcpy(buf, x, sizeof(float) * per);
      else
        memcpy(x, buf, sizeof(float) * per);
      buf += per;
    }
}

/* conv and avg: every spanning window's sums over its ranks, on every rank — one allreduce of
 * every rank's shares (zero where it holds no tokens of a window); forward the summaries, backward
 * their gradients (each rank's part from its own queries, summed into the total). */
static void spanning_sums(const struct fma_state *st, struct comm *c, float *const *X, int nsets,
                          long count, bool forward) {
  const int lspan = st->let->lspan, L = st->tree.levels;
  const long P = st->tree.p, d = st->d;
  if (forward) /* the windows this rank has no share of */
    for (int l = lspan; l <= L; l++) {
      const long mine = st->t0 / st->tree.window[l];
      for (int s = 0; s < nsets; s++)
        for (long h = 0; h < count; h++)
          for (long w = 0; w < st->tree.nwindows[l]; w++)
            if (w != mine)
              memset(X[s] + (h * st->rows + st->level_row[l] + w * P) * d, 0,
                     sizeof(float) * (size_t)(P * d));
    }
  const size_t n = span_floats(st, lspan) * (size_t)(nsets * count);
  float *buf = comm_buffer(c, COMM_BUF_SPAN_SEND, n + 1);
  span_rows(st, lspan, X, buf, nsets, count, true);
  comm_allreduce_sum_float(c, COMM_SEQ, buf, n);
  span_rows(st, lspan, X, buf, nsets, count, false);
  comm_buffer_release(c, COMM_BUF_SPAN_SEND);
}

/* M2M of every window of the spanning levels, coarse after fine, each (set, head) a task. */
static void spanning_m2m(const struct fma_state *st, float *const *X, int nsets, long count,
                         const struct fma_down_weights *w) {
  const int lspan = st->let->lspan;
#pragma omp parallel for schedule(dynamic, 1)
  for (long sh = 0; sh < nsets * count; sh++) {
    const int s = (int)(sh / count);
    float *Xh = X[s] + (sh % count) * st->rows * st->d;
    for (int l = lspan; l <= st->tree.levels; l++)
      for (long c = 0; c < st->tree.nwindows[l]; c++) fma_M2M_window(st, l, c, Xh, &w[s]);
  }
}

/* Its transpose: each rank pushes its part of every spanning window's gradient down to the top
 * level (fine after coarse), where rank r's window collects every rank's part. */
static void spanning_m2m_backward(const struct fma_state *st, float *const *dX, int nsets,
                                  long count, const struct fma_down_weights *w) {
  const int lspan = st->let->lspan;
  const long P = st->tree.p;
#pragma omp parallel for schedule(dynamic, 1)
  for (long sh = 0; sh < nsets * count; sh++) {
    const int s = (int)(sh / count);
    float *dXh = dX[s] + (sh % count) * st->rows * st->d;
    for (int l = st->tree.levels; l >= lspan; l--)
      for (long c = 0; c < st->tree.nwindows[l]; c++)
        fma_M2M_window_backward(st, l, c, dXh, 0, 2 * P, &w[s]);
  }
}

/* The top level's window of rank r, (set, head) by (set, head), to or from buf. */
static void top_window(const struct fma_state *st, float *const *X, float *buf, int nsets,
                       long count, int r, bool to_buf) {
  const int lev[1] = {st->let->lspan - 1};
  const long win[1] = {r};
  struct windows ws = {lev, win, 1};
  if (to_buf)
    pack(st, buf, (const float *const *)X, nsets, count, ws);
  else
    unpack(st, buf, X, nsets, count, ws, false);
}

/* Start exchanging the listed summaries (forward: owners → users) or their gradients (backward:
 * users → owners) with one alltoallv into f; fetch_finish unpacks them (added when transposed). */
static void fetch_start(const struct fma_state *st, struct comm *c, float *const *X, int nsets,
                        long count, bool transpose, struct fma_let_fetch *f) {
  const struct fma_let *let = st->let;
  const int S = let->S;
  const size_t per = window_floats(st, nsets, count);
  const size_t *out_off = transpose ? let->recv_off : let->send_off;
  const size_t *in_off = transpose ? let->send_off : let->recv_off;
  const int *out_level = transpose ? let->recv_level : let->send_level;
  const long *out_window = transpose ? let->recv_window : let->send_window;
  size_t *cnt = xmalloc(sizeof(size_t) * 4 * (size_t)S), *sd = cnt + S, *rc = cnt + 2 * S,
         *rd = cnt + 3 * S;
  for (int r = 0; r < S; r++) {
    cnt[r] = per * (out_off[r + 1] - out_off[r]);
    sd[r] = per * out_off[r];
    rc[r] = per * (in_off[r + 1] - in_off[r]);
    rd[r] = per * in_off[r];
  }
  f->sbuf = comm_buffer(c, COMM_BUF_LET_SEND, per * out_off[S] + 1);
  f->rbuf = comm_buffer(c, COMM_BUF_LET_RECV, per * in_off[S] + 1);
  for (int r = 0; r < S; r++) {
    struct windows ws = {out_level + out_off[r], out_window + out_off[r],
                         out_off[r + 1] - out_off[r]};
    pack(st, f->sbuf + sd[r], (const float *const *)X, nsets, count, ws);
  }
  comm_ialltoallv_float(c, f->sbuf, cnt, sd, f->rbuf, rc, rd, &f->req);
  f->counts = cnt;
  f->c = c;
  for (int s = 0; s < nsets; s++) f->X[s] = X[s];
  f->nsets = nsets;
  f->count = count;
  f->active = true;
}

static void fetch_finish(const struct fma_state *st, struct fma_let_fetch *f, bool transpose) {
  const struct fma_let *let = st->let;
  const int S = let->S;
  const size_t *in_off = transpose ? let->send_off : let->recv_off;
  const int *in_level = transpose ? let->send_level : let->recv_level;
  const long *in_window = transpose ? let->send_window : let->recv_window;
  const size_t *rd = f->counts + 3 * (size_t)S;
  comm_wait(&f->req);
  for (int r = 0; r < S; r++) {
    struct windows ws = {in_level + in_off[r], in_window + in_off[r], in_off[r + 1] - in_off[r]};
    unpack(st, f->rbuf + rd[r], f->X, f->nsets, f->count, ws, transpose);
  }
  comm_buffer_release(f->c, COMM_BUF_LET_SEND);
  comm_buffer_release(f->c, COMM_BUF_LET_RECV);
  free(f->counts);
  f->active = false;
}

/* The exchange of fetch_start and fetch_finish, blocking. */
static void fetch(const struct fma_state *st, struct comm *c, float *const *X, int nsets,
                  long count, bool transpose) {
  struct fma_let_fetch f;
  fetch_start(st, c, X, nsets, count, transpose, &f);
  fetch_finish(st, &f, transpose);
}

/* ---------------------------------------------------------------------------------------------
 * forward and backward */

/* Seconds spent so far in the exchanges between sequence ranks (TIMER_EXCHANGE): the spanning
 * levels' M2M time is charged without them, which the exchange timer reports. */
static double exchange_s(void) { return 1e-3 * timer_total_ms(TIMER_EXCHANGE); }

void fma_let_upward(const struct fma_state *st, struct comm *c, float *const *X, int nsets,
                    long count, const struct fma_down_weights *w, struct fma_times *times,
                    struct fma_let_fetch *pending) {
  const struct fma_let *let = st->let;
  double t0 = timer_now() - exchange_s();
  if (let->lspan <= st->tree.levels && st->down == FMA_DOWN_M2M) {
    /* every rank's top window to every rank, then the spanning levels here */
    const size_t per = window_floats(st, nsets, count);
    float *mine = comm_buffer(c, COMM_BUF_SPAN_SEND, per + 1);
    float *all = comm_buffer(c, COMM_BUF_SPAN_RECV, per * (size_t)let->S + 1);
    top_window(st, X, mine, nsets, count, let->s, true);
    comm_allgather_float(c, COMM_SEQ, mine, per, all);
    for (int r = 0; r < let->S; r++)
      if (r != let->s) top_window(st, X, all + per * (size_t)r, nsets, count, r, false);
    comm_buffer_release(c, COMM_BUF_SPAN_SEND);
    comm_buffer_release(c, COMM_BUF_SPAN_RECV);
    spanning_m2m(st, X, nsets, count, w);
  } else if (let->lspan <= st->tree.levels) {
    spanning_sums(st, c, X, nsets, count, true);
  }
  if (pending)
    fetch_start(st, c, X, nsets, count, false, pending);
  else
    fetch(st, c, X, nsets, count, false);
  times->m2m += timer_now() - exchange_s() - t0;
}

void fma_let_fetch_finish(const struct fma_state *st, struct fma_let_fetch *f,
                          struct fma_times *times) {
  if (!f->active) return;
  double t0 = timer_now() - exchange_s();
  fetch_finish(st, f, false);
  times->m2m += timer_now() - exchange_s() - t0;
}

void fma_let_upward_backward(const struct fma_state *st, struct comm *c, const float *const *X,
                             float *const *dX, int nsets, long count,
                             const struct fma_down_weights *w, struct fma_times *times) {
  const struct fma_let *let = st->let;
  const int S = let->S;
  double t0 = timer_now() - exchange_s();
  fetch(st, c, dX, nsets, count, true);
  if (let->lspan <= st->tree.levels && st->down == FMA_DOWN_M2M) {
    /* this rank's parts of the spanning gradients down to every top window, each sent to its
     * rank, which sums what every rank sent in rank order */
    spanning_m2m_backward(st, dX, nsets, count, w);
    const size_t per = window_floats(st, nsets, count);
    float *out = comm_buffer(c, COMM_BUF_SPAN_SEND, per * (size_t)S + 1);
    float *in = comm_buffer(c, COMM_BUF_SPAN_RECV, per * (size_t)S + 1);
    size_t *cnt = xmalloc(sizeof(size_t) * 2 * (size_t)S), *displ = cnt + S;
    for (int r = 0; r < S; r++) {
      top_window(st, dX, out + per * (size_t)r, nsets, count, r, true);
      cnt[r] = per;
      displ[r] = per * (size_t)r;
    }
    comm_alltoallv_float(c, out, cnt, displ, in, cnt, displ);
    for (size_t i = 0; i < per; i++) {
      float acc = in[i];
      for (int r = 1; r < S; r++) acc += in[per * (size_t)r + i];
      out[i] = acc;
    }
    top_window(st, dX, out, nsets, count, let->s, false);
    free(cnt);
    comm_buffer_release(c, COMM_BUF_SPAN_SEND);
    comm_buffer_release(c, COMM_BUF_SPAN_RECV);
  } else if (let->lspan <= st->tree.levels) {
    spanning_sums(st, c, dX, nsets, count, false);
  }
  times->m2m += timer_now() - exchange_s() - t0;
  (void)X;
}
