/* The locally essential tree of distributed FMA (fma/let.h). Rank s holds tokens [s·T, (s+1)·T).
 * A level's windows are whole on one rank while w_l ≤ T; a coarser window spans w_l/T ranks, an
 * aligned power-of-two group (S and n/m are powers of two), so recursive doubling between ranks
 * s and s XOR j completes it. A window's owner is the rank holding its first token. */
#include "fma/let.h"

#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "core/memory.h"
#include "core/timer.h"

/* ---------------------------------------------------------------------------------------------
 * the plan */

static bool present(const struct fma_state *st, int r, int l, long c) {
  const long w = st->tree.window[l], T = st->T;
  if (w <= T) return c * w >= (long)r * T && c * w < (long)(r + 1) * T;
  return c == (long)r * T / w; /* the spanning window that contains the slab */
}

static int owner(const struct fma_state *st, int l, long c) {
  return (int)(c * st->tree.window[l] / st->T);
}

/* mark[l][c] = 1 for every window rank r's queries list (and, for fma_linear, whose query
 * summaries they use). */
static void mark_needs(const struct fma_state *st, int r, unsigned char **mark) {
  const struct fma_tree *tr = &st->tree;
  const long T = st->T, m = tr->m;
  for (int l = 1; l <= tr->levels; l++) memset(mark[l], 0, (size_t)tr->nwindows[l]);
  for (long qb = (long)r * T / m; qb < (long)(r + 1) * T / m; qb++)
    for (int l = 1; l <= tr->levels; l++) {
      long list[FMA_LIST_MAX];
      const int nw = fma_lists_level(tr, st->causal, l, qb * m / tr->window[l], list);
      for (int k = 0; k < nw; k++) mark[l][list[k]] = 1;
    }
  if (st->linear)
    for (int l = 1; l <= tr->levels; l++) {
      const long seg = tr->window[l] / tr->p;
      for (long rho = (long)r * T / seg; rho <= ((long)(r + 1) * T - 1) / seg; rho++) {
        const long qrow = fma_linear_query_row(st, rho);
        if (qrow >= 0) mark[l][qrow / tr->p] = 1;
      }
    }
}

struct list_builder {
  int *level;
  long *window;
  size_t *off;
};

struct fma_let *fma_let_plan(const struct fma_state *st, const struct comm *c) {
  const struct fma_tree *tr = &st->tree;
  struct fma_let *let = xcalloc(1, sizeof *let);
  let->S = c->S;
  let->s = c->seq_rank;
  const int S = c->S, s = c->seq_rank, L = tr->levels;
  let->lspan = L + 1;
  for (int l = L; l >= 1; l--)
    if (tr->window[l] > st->T) let->lspan = l;
  halo_plan(&let->near, c, tr->n, st->T, tr->m, st->causal ? 0 : tr->m);

  unsigned char *mark[FMA_MAX_LEVELS + 1] = {NULL};
  for (int l = 1; l <= L; l++) mark[l] = xmalloc((size_t)tr->nwindows[l]);
  /* two passes over the same loops: count, then fill */
  let->send_off = xcalloc((size_t)S + 1, sizeof(size_t));
  let->recv_off = xcalloc((size_t)S + 1, sizeof(size_t));
  for (int pass = 0; pass < 2; pass++) {
    size_t *sfill = xcalloc((size_t)S, sizeof(size_t)), *rfill = xcalloc((size_t)S, sizeof(size_t));
    for (int r = 0; r < S; r++) {
      mark_needs(st, r, mark);
      for (int l = 1; l <= L; l++)
        for (long w = 0; w < tr->nwindows[l]; w++) {
          if (!mark[l][w] || present(st, r, l, w)) continue;
          const int o = owner(st, l, w);
          if (r == s) { /* I receive it from its owner */
            if (pass == 1) {
              size_t k = let->recv_off[o] + rfill[o];
              let->recv_level[k] = l;
              let->recv_window[k] = w;
            }
            rfill[o]++;
          } else if (o == s) { /* I send it to r */
            if (pass == 1) {
              size_t k = let->send_off[r] + sfill[r];
              let->send_level[k] = l;
              let->send_window[k] = w;
            }
            sfill[r]++;
          }
        }
    }
    if (pass == 0) {
      for (int r = 0; r < S; r++) {
        let->send_off[r + 1] = let->send_off[r] + sfill[r];
        let->recv_off[r + 1] = let->recv_off[r] + rfill[r];
      }
      let->send_level = xcalloc(let->send_off[S] + 1, sizeof(int));
      let->send_window = xcalloc(let->send_off[S] + 1, sizeof(long));
      let->recv_level = xcalloc(let->recv_off[S] + 1, sizeof(int));
      let->recv_window = xcalloc(let->recv_off[S] + 1, sizeof(long));
    }
    free(sfill);
    free(rfill);
  }
  for (int l = 1; l <= L; l++) free(mark[l]);
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

/* Exchange the windows ws with rank partner (the same list on both sides); add or overwrite the
 * received ones into X at the windows rs. */
static void swap_windows(const struct fma_state *st, struct comm *c, int partner,
                         const float *const *Xsend, float *const *Xrecv, int nsets, long count,
                         struct windows ws, struct windows rs, bool add) {
  const size_t nf = window_floats(st, nsets, count) * ws.count;
  float *sbuf = mem_alloc(MEM_COMM, sizeof(float) * (nf + 1));
  float *rbuf = mem_alloc(MEM_COMM, sizeof(float) * (nf + 1));
  pack(st, sbuf, Xsend, nsets, count, ws);
  comm_sendrecv_float(c, sbuf, nf, partner, rbuf, nf, partner, 71);
  unpack(st, rbuf, Xrecv, nsets, count, rs, add);
  mem_free(sbuf);
  mem_free(rbuf);
}

/* Sum, over the ranks of each spanning window's group, the rows of that window (conv and avg
 * partial sums forward; the gradients backward): recursive doubling over partners s XOR j. */
static void spanning_allreduce(const struct fma_state *st, struct comm *c, float *const *X,
                               int nsets, long count) {
  const struct fma_let *let = st->let;
  int level[FMA_MAX_LEVELS + 1];
  long window[FMA_MAX_LEVELS + 1];
  for (int j = 1; j < let->S; j <<= 1) {
    size_t k = 0;
    for (int l = let->lspan; l <= st->tree.levels; l++)
      if (st->tree.window[l] / st->T > j) { /* the group of this level's window has 2j+ ranks */
        level[k] = l;
        window[k] = st->t0 / st->tree.window[l];
        k++;
      }
    if (k == 0) break;
    struct windows ws = {level, window, k};
    swap_windows(st, c, let->s ^ j, (const float *const *)X, X, nsets, count, ws, ws, true);
  }
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
  f->sbuf = mem_alloc(MEM_COMM, sizeof(float) * (per * out_off[S] + 1));
  f->rbuf = mem_alloc(MEM_COMM, sizeof(float) * (per * in_off[S] + 1));
  for (int r = 0; r < S; r++) {
    struct windows ws = {out_level + out_off[r], out_window + out_off[r],
                         out_off[r + 1] - out_off[r]};
    pack(st, f->sbuf + sd[r], (const float *const *)X, nsets, count, ws);
  }
  comm_ialltoallv_float(c, f->sbuf, cnt, sd, f->rbuf, rc, rd, &f->req);
  f->counts = cnt;
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
  mem_free(f->sbuf);
  mem_free(f->rbuf);
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
  const long d = st->d;
  double t0 = timer_now() - exchange_s();
  if (st->down == FMA_DOWN_M2M) {
    /* each spanning level: swap the child window with the sibling's rank, make the parent */
    for (int l = let->lspan; l <= st->tree.levels; l++) {
      const long g = st->tree.window[l] / st->T, cc = st->t0 / st->tree.window[l - 1];
      const int lev[1] = {l - 1};
      const long mine[1] = {cc}, sibling[1] = {cc ^ 1};
      struct windows ws = {lev, mine, 1}, rs = {lev, sibling, 1};
      swap_windows(st, c, let->s ^ (int)(g / 2), (const float *const *)X, X, nsets, count, ws, rs,
                   false);
      const long cp = st->t0 / st->tree.window[l];
      for (int s = 0; s < nsets; s++)
        for (long h = 0; h < count; h++) fma_M2M_window(st, l, cp, X[s] + h * st->rows * d, &w[s]);
    }
  } else if (let->lspan <= st->tree.levels) {
    spanning_allreduce(st, c, X, nsets, count);
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
  const long d = st->d, P = st->tree.p;
  double t0 = timer_now() - exchange_s();
  fetch(st, c, dX, nsets, count, true);
  if (st->down == FMA_DOWN_M2M) {
    /* coarse to fine: this rank's share of each spanning parent's gradient goes to both children;
     * the sibling's part travels to the sibling's rank, whose part for this child comes back */
    for (int l = st->tree.levels; l >= let->lspan; l--) {
      const long g = st->tree.window[l] / st->T, cc = st->t0 / st->tree.window[l - 1];
      const long cp = st->t0 / st->tree.window[l], sib = cc ^ 1;
      const long sib_row = st->level_row[l - 1] + sib * P;
      for (int s = 0; s < nsets; s++)
        for (long h = 0; h < count; h++) {
          float *dXh = dX[s] + h * st->rows * d;
          memset(dXh + sib_row * d, 0, sizeof(float) * (size_t)(P * d));
          fma_M2M_window_backward(st, l, cp, dXh, 0, 2 * P, &w[s]);
        }
      const int lev[1] = {l - 1};
      const long mine[1] = {cc}, sibling[1] = {sib};
      struct windows ws = {lev, sibling, 1}, rs = {lev, mine, 1};
      swap_windows(st, c, let->s ^ (int)(g / 2), (const float *const *)dX, dX, nsets, count, ws, rs,
                   true);
      for (int s = 0; s < nsets; s++)
        for (long h = 0; h < count; h++)
          memset(dX[s] + (h * st->rows + sib_row) * d, 0, sizeof(float) * (size_t)(P * d));
    }
  } else if (let->lspan <= st->tree.levels) {
    spanning_allreduce(st, c, dX, nsets, count);
  }
  times->m2m += timer_now() - exchange_s() - t0;
  (void)X;
}
