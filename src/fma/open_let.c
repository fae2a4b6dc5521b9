/* The opened windows' share of the locally essential tree (SPEC §6.4a, §7): no rank knows in
 * advance what another's queries will open, so each level of the descent is a request and a reply
 * — children's summaries, then opened fine blocks' keys and values, each asked for once per call
 * — and backward returns the gradients of everything fetched to its owner, added there. An owner
 * holds a window's first token; the spanning windows (and for m2m every top window) are held by
 * every rank after the LET. */
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "core/memory.h"
#include "fma/let.h"
#include "fma/open.h"

/* Item codes (longs) of one kind, per rank. */
struct item_list {
  long *code;
  size_t n, cap;
};

struct fma_open_fetch {
  long count, starts, nblocks;
  long lvl_start[FMA_MAX_LEVELS + 2]; /* the work's: first window entry of level l */
  unsigned char *local;               /* (starts) summary windows this rank holds for every head */
  unsigned char *have; /* (count, starts) held now: local, or fetched during this call */
  int S;
  /* per rank, in the order of the rounds of one call: the summary windows (code h·starts + level
   * start + window) and the fine blocks (h·nblocks + block) fetched from it and served to it */
  struct item_list *win_from, *win_to, *tok_from, *tok_to;
  int32_t *block_slot;        /* (count, nblocks): a fetched block's place in the store, or −1 */
  float *tk, *tv, *dtk, *dtv; /* (tok_cap, m, d): fetched keys, values and their gradients */
  long ntok, tok_cap;
};

static void list_push(struct item_list *l, long code) {
  if (l->n == l->cap) {
    l->cap = l->cap ? 2 * l->cap : 64;
    l->code = xrealloc(l->code, sizeof(long) * l->cap);
  }
  l->code[l->n++] = code;
}

void fma_open_fetch_free(struct fma_open_fetch *f) {
  if (!f) return;
  for (int r = 0; r < f->S; r++) {
    free(f->win_from[r].code);
    free(f->win_to[r].code);
    free(f->tok_from[r].code);
    free(f->tok_to[r].code);
  }
  free(f->win_from);
  free(f->win_to);
  free(f->tok_from);
  free(f->tok_to);
  free(f->local);
  free(f->have);
  free(f->block_slot);
  mem_free(f->tk);
  mem_free(f->tv);
  mem_free(f->dtk);
  mem_free(f->dtv);
  free(f);
}

/* Whether this rank holds summary window c of level l after fma_let_upward without its fetch:
 * one of its own, or one every rank computes (fma_let_holds). */
static bool held_here(const struct fma_state *st, int l, long c) {
  return fma_let_holds(st, st->let->s, l, c);
}

static struct fma_open_fetch *fetch_open(const struct fma_state *st, struct fma_open_work *w,
                                         const struct fma_open_args *a) {
  struct fma_open_fetch *f = w->fetch;
  if (!f || f->count < a->count) {
    fma_open_fetch_free(f);
    f = xcalloc(1, sizeof *f);
    f->count = a->count;
    f->starts = w->starts;
    memcpy(f->lvl_start, w->lvl_start, sizeof f->lvl_start);
    f->nblocks = st->tree.nblocks;
    f->S = a->comm->S;
    f->local = xcalloc((size_t)f->starts, 1);
    for (int l = 1; l <= st->tree.levels; l++)
      for (long c = 0; c < st->tree.nwindows[l]; c++)
        f->local[w->lvl_start[l] + c] = held_here(st, l, c);
    const struct fma_let *let = st->let;
    for (size_t k = 0; let && k < let->recv_off[let->S]; k++)
      f->local[w->lvl_start[let->recv_level[k]] + let->recv_window[k]] = 1;
    f->have = xmalloc((size_t)(f->count * f->starts));
    f->block_slot = xmalloc(sizeof(int32_t) * (size_t)(f->count * f->nblocks));
    f->win_from = xcalloc((size_t)f->S, sizeof(struct item_list));
    f->win_to = xcalloc((size_t)f->S, sizeof(struct item_list));
    f->tok_from = xcalloc((size_t)f->S, sizeof(struct item_list));
    f->tok_to = xcalloc((size_t)f->S, sizeof(struct item_list));
    w->fetch = f;
  }
  return f;
}

/* A new call (forward's descent or backward's rescore): nothing fetched yet. */
static void fetch_reset(struct fma_open_fetch *f) {
  for (long h = 0; h < f->count; h++) memcpy(f->have + h * f->starts, f->local, (size_t)f->starts);
  for (long i = 0; i < f->count * f->nblocks; i++) f->block_slot[i] = -1;
  for (int r = 0; r < f->S; r++) f->win_from[r].n = f->win_to[r].n = 0;
  for (int r = 0; r < f->S; r++) f->tok_from[r].n = f->tok_to[r].n = 0;
  f->ntok = 0;
}

/* ---------------------------------------------------------------------------------------------
 * one round: requests (need[r]: codes to fetch from rank r) out, requests in, replies back */

typedef void (*pack_fn)(const struct fma_state *st, const struct fma_open_fetch *f,
                        const struct fma_open_args *a, long code, float *buf);
typedef void (*unpack_fn)(const struct fma_state *st, struct fma_open_fetch *f,
                          const struct fma_open_args *a, long code, const float *buf);

static void round_trip(const struct fma_state *st, struct fma_open_fetch *f,
                       const struct fma_open_args *a, struct item_list *need,
                       struct item_list *from, struct item_list *to, size_t per, pack_fn pack,
                       unpack_fn unpack) {
  struct comm *c = a->comm;
  const int S = c->S;
  size_t *cnt = xcalloc(8 * (size_t)S, sizeof(size_t));
  size_t *sc = cnt, *sd = cnt + S, *rc = cnt + 2 * S, *rd = cnt + 3 * S;
  size_t *fc = cnt + 4 * S, *fd = cnt + 5 * S, *gc = cnt + 6 * S, *gd = cnt + 7 * S;
  size_t ns = 0, nr = 0;
  for (int r = 0; r < S; r++) {
    sc[r] = need[r].n;
    sd[r] = ns;
    ns += sc[r];
  }
  long *sbuf = xmalloc(sizeof(long) * (ns + 1)), *rbuf;
  for (int r = 0; r < S; r++) memcpy(sbuf + sd[r], need[r].code, sizeof(long) * need[r].n);
  comm_alltoallv_long_any(c, sbuf, sc, sd, &rbuf, rc, rd); /* no exchange of counts first */
  for (int r = 0; r < S; r++) nr += rc[r];
  /* replies: what each rank asked of me, in its order */
  float *reply = comm_buffer(c, COMM_BUF_OPEN_SEND, nr * per + 1);
  float *got = comm_buffer(c, COMM_BUF_OPEN_RECV, ns * per + 1);
  for (int r = 0; r < S; r++) {
    for (size_t i = 0; i < rc[r]; i++) {
      pack(st, f, a, rbuf[rd[r] + i], reply + (rd[r] + i) * per);
      list_push(&to[r], rbuf[rd[r] + i]);
    }
    fc[r] = rc[r] * per;
    fd[r] = rd[r] * per;
    gc[r] = sc[r] * per;
    gd[r] = sd[r] * per;
  }
  comm_alltoallv_float(c, reply, fc, fd, got, gc, gd);
  for (int r = 0; r < S; r++)
    for (size_t i = 0; i < sc[r]; i++) {
      unpack(st, f, a, sbuf[sd[r] + i], got + (sd[r] + i) * per);
      list_push(&from[r], sbuf[sd[r] + i]);
    }
  comm_buffer_release(c, COMM_BUF_OPEN_SEND);
  comm_buffer_release(c, COMM_BUF_OPEN_RECV);
  free(sbuf);
  free(rbuf);
  free(cnt);
}

/* ---------------------------------------------------------------------------------------------
 * summary windows: a code is h·starts + lvl_start[l] + c; p rows of keys, then p of values */

static void window_of(const struct fma_state *st, const struct fma_open_fetch *f, long code,
                      long *h, int *l, long *c) {
  const long idx = code % f->starts;
  *h = code / f->starts;
  *l = 1;
  while (*l < st->tree.levels && idx >= f->lvl_start[*l + 1]) (*l)++;
  *c = idx - f->lvl_start[*l];
}

static long window_row(const struct fma_state *st, long h, int l, long c) {
  return (h * st->rows + st->level_row[l] + c * st->tree.p) * st->d;
}

static void pack_window(const struct fma_state *st, const struct fma_open_fetch *f,
                        const struct fma_open_args *a, long code, float *buf) {
  long h, c;
  int l;
  window_of(st, f, code, &h, &l, &c);
  const size_t n = (size_t)(st->tree.p * st->d);
  memcpy(buf, a->K + window_row(st, h, l, c), sizeof(float) * n);
  memcpy(buf + n, a->V + window_row(st, h, l, c), sizeof(float) * n);
}

static void unpack_window(const struct fma_state *st, struct fma_open_fetch *f,
                          const struct fma_open_args *a, long code, const float *buf) {
  long h, c;
  int l;
  window_of(st, f, code, &h, &l, &c);
  const size_t n = (size_t)(st->tree.p * st->d);
  memcpy(a->K + window_row(st, h, l, c), buf, sizeof(float) * n);
  memcpy(a->V + window_row(st, h, l, c), buf + n, sizeof(float) * n);
}

static int window_owner(const struct fma_state *st, int l, long c) {
  return (int)(c * st->tree.window[l] / st->T);
}

void fma_open_let_children(const struct fma_state *st, struct fma_open_work *w,
                           const struct fma_open_args *a, int l) {
  struct fma_open_fetch *f = fetch_open(st, w, a);
  if (l == st->tree.levels) fetch_reset(f); /* the first round of a call */
  const int S = f->S;
  struct item_list *need = xcalloc((size_t)S, sizeof *need);
  for (long h = 0; h < a->count; h++) {
    const int32_t *start = w->start + h * w->starts + w->lvl_start[l];
    unsigned char *have = f->have + h * f->starts + w->lvl_start[l - 1];
    for (long c = 0; c < st->tree.nwindows[l]; c++) {
      if (start[c + 1] == start[c]) continue;
      for (long ch = 2 * c; ch <= 2 * c + 1; ch++) {
        if (have[ch]) continue;
        have[ch] = 1;
        list_push(&need[window_owner(st, l - 1, ch)], h * f->starts + w->lvl_start[l - 1] + ch);
      }
    }
  }
  round_trip(st, f, a, need, f->win_from, f->win_to, 2 * (size_t)(st->tree.p * st->d), pack_window,
             unpack_window);
  for (int r = 0; r < S; r++) free(need[r].code);
  free(need);
}

/* ---------------------------------------------------------------------------------------------
 * fine blocks: a code is h·nblocks + c; m rows of keys, then m of values */

static bool block_local(const struct fma_state *st, const struct fma_open_args *a, long c) {
  const long lo = c * st->tree.m;
  return lo >= st->klo && lo + st->tree.m <= st->klo + a->kstride;
}

static void pack_block(const struct fma_state *st, const struct fma_open_fetch *f,
                       const struct fma_open_args *a, long code, float *buf) {
  const long h = code / f->nblocks, c = code % f->nblocks, m = st->tree.m, d = st->d;
  const size_t n = (size_t)(m * d), at = (size_t)((h * a->kstride + c * m - st->klo) * d);
  memcpy(buf, a->k + at, sizeof(float) * n);
  memcpy(buf + n, a->v + at, sizeof(float) * n);
}

static void unpack_block(const struct fma_state *st, struct fma_open_fetch *f,
                         const struct fma_open_args *a, long code, const float *buf) {
  const long h = code / f->nblocks, c = code % f->nblocks, m = st->tree.m, d = st->d;
  const int32_t slot = f->block_slot[h * f->nblocks + c];
  const size_t n = (size_t)(m * d);
  memcpy(f->tk + (size_t)slot * n, buf, sizeof(float) * n);
  memcpy(f->tv + (size_t)slot * n, buf + n, sizeof(float) * n);
  (void)a;
}

/* Room in the store for `more` blocks beyond those held (the store only grows). */
static void store_reserve(const struct fma_state *st, struct fma_open_fetch *f, long more) {
  if (f->ntok + more <= f->tok_cap) return;
  long cap = f->tok_cap ? f->tok_cap : 16;
  while (cap < f->ntok + more) cap *= 2;
  const size_t n = (size_t)(st->tree.m * st->d);
  float **arrays[4] = {&f->tk, &f->tv, &f->dtk, &f->dtv};
  for (int i = 0; i < 4; i++) {
    float *grown = mem_alloc(MEM_WORKSPACE, sizeof(float) * (size_t)cap * n);
    if (*arrays[i]) memcpy(grown, *arrays[i], sizeof(float) * (size_t)f->ntok * n);
    mem_free(*arrays[i]);
    *arrays[i] = grown;
  }
  f->tok_cap = cap;
}

void fma_open_let_tokens(const struct fma_state *st, struct fma_open_work *w,
                         const struct fma_open_args *a) {
  struct fma_open_fetch *f = fetch_open(st, w, a);
  if (st->tree.levels == 1) fetch_reset(f); /* no children rounds came first */
  const int S = f->S;
  struct item_list *need = xcalloc((size_t)S, sizeof *need);
  long more = 0;
  for (long h = 0; h < a->count; h++) {
    const int32_t *start = w->start + h * w->starts + w->lvl_start[1];
    for (long c = 0; c < st->tree.nwindows[1]; c++)
      if (start[c + 1] > start[c] && !block_local(st, a, c) &&
          f->block_slot[h * f->nblocks + c] < 0)
        more++;
  }
  store_reserve(st, f, more);
  for (long h = 0; h < a->count; h++) {
    const int32_t *start = w->start + h * w->starts + w->lvl_start[1];
    for (long c = 0; c < st->tree.nwindows[1]; c++) {
      int32_t *slot = &f->block_slot[h * f->nblocks + c];
      if (start[c + 1] == start[c] || block_local(st, a, c) || *slot >= 0) continue;
      *slot = (int32_t)f->ntok++;
      memset(f->dtk + (size_t)*slot * (size_t)(st->tree.m * st->d), 0,
             sizeof(float) * (size_t)(st->tree.m * st->d));
      memset(f->dtv + (size_t)*slot * (size_t)(st->tree.m * st->d), 0,
             sizeof(float) * (size_t)(st->tree.m * st->d));
      list_push(&need[window_owner(st, 1, c)], h * f->nblocks + c);
    }
  }
  round_trip(st, f, a, need, f->tok_from, f->tok_to, 2 * (size_t)(st->tree.m * st->d), pack_block,
             unpack_block);
  for (int r = 0; r < S; r++) free(need[r].code);
  free(need);
}

void fma_open_block_rows(const struct fma_state *st, const struct fma_open_work *w,
                         const struct fma_open_args *a, long h, long c, const float **k,
                         const float **v, float *dk, float *dv, float **dk_out, float **dv_out) {
  const long m = st->tree.m, d = st->d;
  if (block_local(st, a, c)) {
    const long at = (h * a->kstride + c * m - st->klo) * d;
    *k = a->k + at;
    *v = a->v + at;
    if (dk_out) *dk_out = dk + at;
    if (dv_out) *dv_out = dv + at;
    return;
  }
  const struct fma_open_fetch *f = w->fetch;
  const int32_t slot = f ? f->block_slot[h * f->nblocks + c] : -1;
  if (slot < 0) error("fma.open: fine block %ld of head %ld was opened but not fetched", c, h);
  const size_t at = (size_t)slot * (size_t)(m * d);
  *k = f->tk + at;
  *v = f->tv + at;
  if (dk_out) *dk_out = f->dtk + at;
  if (dv_out) *dv_out = f->dtv + at;
}

/* ---------------------------------------------------------------------------------------------
 * backward: what was fetched returns to its owner as a gradient, added there */

static void send_back(struct comm *c, const struct item_list *from, const struct item_list *to,
                      size_t per, float **sbuf, float **rbuf, size_t *cnt) {
  const int S = c->S;
  size_t *sc = cnt, *sd = cnt + S, *rc = cnt + 2 * S, *rd = cnt + 3 * S, ns = 0, nr = 0;
  for (int r = 0; r < S; r++) {
    sc[r] = from[r].n * per;
    rc[r] = to[r].n * per;
    sd[r] = ns;
    rd[r] = nr;
    ns += sc[r];
    nr += rc[r];
  }
  *sbuf = comm_buffer(c, COMM_BUF_OPEN_SEND, ns + 1);
  *rbuf = comm_buffer(c, COMM_BUF_OPEN_RECV, nr + 1);
}

static void add(float *dst, const float *src, size_t n) {
  for (size_t i = 0; i < n; i++) dst[i] += src[i];
}

void fma_open_let_return(const struct fma_state *st, struct fma_open_work *w,
                         const struct fma_open_args *a, const struct fma_open_grads *g) {
  struct fma_open_fetch *f = w->fetch;
  if (!f) return;
  struct comm *c = a->comm;
  const int S = f->S;
  size_t *cnt = xcalloc(4 * (size_t)S, sizeof(size_t));
  float *sbuf, *rbuf;
  /* summary windows: p rows of dK then p of dV each */
  const size_t pw = (size_t)(st->tree.p * st->d);
  send_back(c, f->win_from, f->win_to, 2 * pw, &sbuf, &rbuf, cnt);
  for (int r = 0; r < S; r++)
    for (size_t i = 0; i < f->win_from[r].n; i++) {
      long h, wc;
      int l;
      window_of(st, f, f->win_from[r].code[i], &h, &l, &wc);
      float *o = sbuf + cnt[S + r] + i * 2 * pw;
      memcpy(o, g->dK + window_row(st, h, l, wc), sizeof(float) * pw);
      memcpy(o + pw, g->dV + window_row(st, h, l, wc), sizeof(float) * pw);
    }
  comm_alltoallv_float(c, sbuf, cnt, cnt + S, rbuf, cnt + 2 * S, cnt + 3 * S);
  for (int r = 0; r < S; r++)
    for (size_t i = 0; i < f->win_to[r].n; i++) {
      long h, wc;
      int l;
      window_of(st, f, f->win_to[r].code[i], &h, &l, &wc);
      const float *in = rbuf + cnt[3 * S + r] + i * 2 * pw;
      add(g->dK + window_row(st, h, l, wc), in, pw);
      add(g->dV + window_row(st, h, l, wc), in + pw, pw);
    }
  comm_buffer_release(c, COMM_BUF_OPEN_SEND);
  comm_buffer_release(c, COMM_BUF_OPEN_RECV);
  /* fine blocks: m rows of dk then m of dv each */
  const size_t bw = (size_t)(st->tree.m * st->d);
  send_back(c, f->tok_from, f->tok_to, 2 * bw, &sbuf, &rbuf, cnt);
  for (int r = 0; r < S; r++)
    for (size_t i = 0; i < f->tok_from[r].n; i++) {
      const long code = f->tok_from[r].code[i], h = code / f->nblocks, bc = code % f->nblocks;
      const size_t at = (size_t)f->block_slot[h * f->nblocks + bc] * bw;
      float *o = sbuf + cnt[S + r] + i * 2 * bw;
      memcpy(o, f->dtk + at, sizeof(float) * bw);
      memcpy(o + bw, f->dtv + at, sizeof(float) * bw);
    }
  comm_alltoallv_float(c, sbuf, cnt, cnt + S, rbuf, cnt + 2 * S, cnt + 3 * S);
  for (int r = 0; r < S; r++)
    for (size_t i = 0; i < f->tok_to[r].n; i++) {
      const long code = f->tok_to[r].code[i], h = code / f->nblocks, bc = code % f->nblocks;
      const size_t at = (size_t)((h * a->kstride + bc * st->tree.m - st->klo) * st->d);
      const float *in = rbuf + cnt[3 * S + r] + i * 2 * bw;
      add(g->dk + at, in, bw);
      add(g->dv + at, in + bw, bw);
    }
  comm_buffer_release(c, COMM_BUF_OPEN_SEND);
  comm_buffer_release(c, COMM_BUF_OPEN_RECV);
  free(cnt);
}
