/* The ring (ring.h): its layout, the zigzag moves, and the schedule of a pass — who sends which
 * buffer to whom at which step, the double buffers, the accumulators one step behind. It moves
 * and adds whole buffers only; it must not know what the tensors mean or what a step computes. */
#include "parallel/ring.h"

#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "core/memory.h"

/* Messages in pieces far below MPI's int counts. */
#define RING_PIECE ((size_t)1 << 26)

#define RING_TAG_KV  7301 /* the travelling tensors */
#define RING_TAG_ACC 7302 /* their gradients' accumulators */

struct ring ring_plan(struct comm *cm, long T, bool causal) {
  struct ring rg = {.cm = cm, .S = cm->S, .me = cm->seq_rank, .T = T};
  rg.next = (rg.me + 1) % rg.S;
  rg.prev = (rg.me + rg.S - 1) % rg.S;
  rg.pieces = causal && T % 2 == 0 ? 2 : 1;
  rg.L = T / rg.pieces;
  return rg;
}

long ring_offset(const struct ring *rg, int r, int p) {
  if (rg->pieces == 1) return (long)r * rg->T;
  return (p == 0 ? (long)r : 2L * rg->S - 1 - r) * rg->L;
}

int ring_source(const struct ring *rg, int t) { return (rg->me - t + rg->S) % rg->S; }

/* Where chunk j of the 2S lives: its rank and its place (0 or 1) there. */
static int chunk_rank(int S, long j, bool zig) {
  return zig ? (int)(j < S ? j : 2L * S - 1 - j) : (int)(j / 2);
}
static long chunk_place(int S, long j, bool zig) { return zig ? (j < S ? 0 : 1) : j % 2; }

/* The message from rank a to rank b holds, for each chunk that moves from a to b in ascending
 * order, each tensor's (rows[i], c, w[i]) block, so both ends walk one order. */
void ring_move(const struct ring *rg, bool to_zig, int nt, const float *const *src,
               float *const *dst, const long *rows, const long *w) {
  const int S = rg->S, me = rg->me;
  const long c = rg->L;
  size_t chunk = 0; /* floats per chunk, all tensors */
  for (int i = 0; i < nt; i++) chunk += (size_t)(rows[i] * c * w[i]);
  size_t *sc = xcalloc(6 * (size_t)S, sizeof(size_t)), *sd = sc + S, *rc = sc + 2 * S,
         *rd = sc + 3 * S, *sfill = sc + 4 * S, *rfill = sc + 5 * S;
  for (long j = 0; j < 2L * S; j++) {
    if (chunk_rank(S, j, !to_zig) == me) sc[chunk_rank(S, j, to_zig)] += chunk;
    if (chunk_rank(S, j, to_zig) == me) rc[chunk_rank(S, j, !to_zig)] += chunk;
  }
  for (int r = 1; r < S; r++) {
    sd[r] = sd[r - 1] + sc[r - 1];
    rd[r] = rd[r - 1] + rc[r - 1];
  }
  memcpy(sfill, sd, sizeof(size_t) * (size_t)S);
  memcpy(rfill, rd, sizeof(size_t) * (size_t)S);
  float *sbuf = comm_alloc(rg->cm, MEM_COMM, 2 * chunk); /* every rank holds two chunks */
  float *rbuf = comm_alloc(rg->cm, MEM_COMM, 2 * chunk);
  for (long j = 0; j < 2L * S; j++) {
    if (chunk_rank(S, j, !to_zig) != me) continue;
    const long p = chunk_place(S, j, !to_zig);
    float *m = sbuf + sfill[chunk_rank(S, j, to_zig)];
    for (int i = 0; i < nt; m += rows[i] * c * w[i], i++)
      comm_copy_rows(rg->cm, m, (size_t)(c * w[i]), src[i] + p * c * w[i], (size_t)(2 * c * w[i]),
                     (size_t)rows[i], (size_t)(c * w[i]));
    sfill[chunk_rank(S, j, to_zig)] += chunk;
  }
  comm_alltoallv_float(rg->cm, sbuf, sc, sd, rbuf, rc, rd);
  for (long j = 0; j < 2L * S; j++) {
    if (chunk_rank(S, j, to_zig) != me) continue;
    const long p = chunk_place(S, j, to_zig);
    const float *m = rbuf + rfill[chunk_rank(S, j, !to_zig)];
    for (int i = 0; i < nt; m += rows[i] * c * w[i], i++)
      comm_copy_rows(rg->cm, dst[i] + p * c * w[i], (size_t)(2 * c * w[i]), m, (size_t)(c * w[i]),
                     (size_t)rows[i], (size_t)(c * w[i]));
    rfill[chunk_rank(S, j, !to_zig)] += chunk;
  }
  comm_free_buffer(rg->cm, sbuf);
  comm_free_buffer(rg->cm, rbuf);
  free(sc);
}

/* ---------------------------------------------------------------------------------------------
 * the passes */

/* One transfer round the ring: send count floats to the next rank, receive as many from the
 * previous one; ring_finish waits for both. */
struct ring_xfer {
  struct comm_request *req;
  size_t count;
};

static void ring_start(const struct ring *rg, const float *send, float *recv, size_t count, int tag,
                       struct ring_xfer *x) {
  x->count = (count + RING_PIECE - 1) / RING_PIECE;
  x->req = xmalloc(sizeof *x->req * (x->count + 1));
  for (size_t i = 0; i < x->count; i++) {
    const size_t off = i * RING_PIECE, len = count - off < RING_PIECE ? count - off : RING_PIECE;
    comm_isendrecv_float(rg->cm, send + off, len, rg->next, recv + off, len, rg->prev, tag,
                         &x->req[i]);
  }
}

static void ring_finish(struct ring_xfer *x) {
  for (size_t i = 0; i < x->count; i++) comm_wait(&x->req[i]);
  free(x->req);
}

/* The buffer work of a pass, on the transport's memory (host or device): copy, zero, and
 * a += b over n floats. */
static void ring_copy(const struct ring *rg, float *dst, const float *src, size_t n) {
  comm_copy_rows(rg->cm, dst, n, src, n, 1, n);
}
static void ring_zero(const struct ring *rg, float *a, size_t n) { comm_zero(rg->cm, a, n); }
static void ring_add(const struct ring *rg, float *a, const float *b, size_t n) {
  comm_add_rows(rg->cm, a, n, b, n, 1, n);
}

static size_t tensor_floats(const struct ring_tensors *ts, int i, long T) {
  return (size_t)(ts->rows[i] * T * ts->w[i]);
}

static size_t tensors_floats(const struct ring_tensors *ts, long T) {
  size_t n = 0;
  for (int i = 0; i < ts->n; i++) n += tensor_floats(ts, i, T);
  return n;
}

/* p[i]: tensor i of ts in a block that holds them one after another from base. */
static void tensors_point(const struct ring_tensors *ts, long T, float *base, float **p) {
  for (int i = 0; i < ts->n; i++) {
    p[i] = base;
    base += tensor_floats(ts, i, T);
  }
}

/* The step's view of the travelling block cur (and, backward, of the accumulator part). */
static void step_point(const struct ring *rg, const struct ring_pass *ps, int t, float *cur,
                       float *part, struct ring_step *s) {
  float *p[RING_MAX];
  s->t = t;
  s->src = ring_source(rg, t);
  tensors_point(&ps->travel, rg->T, cur, p);
  for (int i = 0; i < ps->travel.n; i++) s->travel[i] = p[i];
  if (part) tensors_point(&ps->travel, rg->T, part, s->dtravel);
}

/* The tensors of one ring_move, gathered as a pass names them. */
struct ring_moves {
  int n;
  const float *src[2 * RING_MAX];
  float *dst[2 * RING_MAX];
  long rows[2 * RING_MAX], w[2 * RING_MAX];
};

static void moves_add(struct ring_moves *m, const struct ring_tensors *ts, int i, const float *src,
                      float *dst) {
  m->src[m->n] = src;
  m->dst[m->n] = dst;
  m->rows[m->n] = ts->rows[i];
  m->w[m->n++] = ts->w[i];
}

/* Into the pass: my staying tensors and my outputs in the ring's layout (in a zeroed buffer,
 * returned, when it is the zigzag; the caller's own otherwise) and the travelling ones in cur,
 * with one alltoallv for everything that moves. */
static float *ring_enter(const struct ring *rg, const struct ring_pass *ps, float *cur,
                         struct ring_step *s) {
  const bool zig = rg->pieces == 2;
  struct ring_moves m = {0};
  float *zbuf = NULL, *z = NULL;
  if (zig)
    z = zbuf = comm_alloc(rg->cm, MEM_WORKSPACE,
                          tensors_floats(&ps->stay, rg->T) + tensors_floats(&ps->out, rg->T));
  for (int i = 0; i < ps->stay.n; i++) {
    s->stay[i] = zig ? z : ps->stay_in[i];
    if (!zig) continue;
    moves_add(&m, &ps->stay, i, ps->stay_in[i], z);
    z += tensor_floats(&ps->stay, i, rg->T);
  }
  for (int i = 0; i < ps->out.n; i++) {
    s->out[i] = zig ? z : ps->out_io[i];
    if (zig) z += tensor_floats(&ps->out, i, rg->T);
  }
  for (int i = 0; i < ps->travel.n; cur += tensor_floats(&ps->travel, i, rg->T), i++)
    if (zig)
      moves_add(&m, &ps->travel, i, ps->travel_in[i], cur);
    else
      ring_copy(rg, cur, ps->travel_in[i], tensor_floats(&ps->travel, i, rg->T));
  if (zig) ring_move(rg, true, m.n, m.src, m.dst, m.rows, m.w);
  return zbuf;
}

/* Out of a backward pass: the travelling tensors' gradients, home in `in`, added to the caller's;
 * with the zigzag, they and my outputs go back to the contiguous slab first, through acc[0, 2K)
 * (free by now: `in` is acc + 2K), and the outputs are added to the caller's too. */
static void ring_leave(const struct ring *rg, const struct ring_pass *ps, const struct ring_step *s,
                       float *acc, float *in) {
  float *home[RING_MAX], *outs[RING_MAX];
  tensors_point(&ps->travel, rg->T, in, home);
  if (rg->pieces == 2) {
    const size_t K = tensors_floats(&ps->travel, rg->T), O = tensors_floats(&ps->out, rg->T);
    if (O > K) error("ring outputs (%zu floats) exceed the travelling tensors (%zu)", O, K);
    struct ring_moves m = {0};
    float *a = acc;
    for (int i = 0; i < ps->out.n; a += tensor_floats(&ps->out, i, rg->T), i++)
      moves_add(&m, &ps->out, i, s->out[i], outs[i] = a);
    for (int i = 0; i < ps->travel.n; a += tensor_floats(&ps->travel, i, rg->T), i++) {
      moves_add(&m, &ps->travel, i, home[i], a);
      home[i] = a;
    }
    ring_move(rg, false, m.n, m.src, m.dst, m.rows, m.w);
    for (int i = 0; i < ps->out.n; i++)
      ring_add(rg, ps->out_io[i], outs[i], tensor_floats(&ps->out, i, rg->T));
  }
  for (int i = 0; i < ps->travel.n; i++)
    ring_add(rg, ps->dtravel[i], home[i], tensor_floats(&ps->travel, i, rg->T));
}

/* At step t rank z folds the travelling tensors of rank z − t in while sending them on to z + 1
 * and receiving those of z − t − 1 (double buffering, so the transfer overlaps the step). */
void ring_forward(const struct ring *rg, const struct ring_pass *ps) {
  const size_t K = tensors_floats(&ps->travel, rg->T);
  float *kv = comm_alloc(rg->cm, MEM_COMM, 2 * K), *cur = kv, *nxt = kv + K;
  struct ring_step s = {.rg = rg};
  float *zbuf = ring_enter(rg, ps, cur, &s);
  for (int t = 0; t < rg->S; t++) {
    struct ring_xfer x = {0};
    if (t < rg->S - 1) ring_start(rg, cur, nxt, K, RING_TAG_KV, &x);
    step_point(rg, ps, t, cur, NULL, &s);
    ps->step(&s, ps->user);
    if (t < rg->S - 1) {
      ring_finish(&x);
      float *tmp = cur;
      cur = nxt;
      nxt = tmp;
    }
  }
  comm_free_buffer(rg->cm, kv);
  if (zbuf) {
    ring_move(rg, false, ps->out.n, (const float *const *)s.out, ps->out_io, ps->out.rows,
              ps->out.w);
    comm_free_buffer(rg->cm, zbuf);
  }
}

/* The ring again, with each rank's accumulators of the travelling tensors' gradients following
 * their tensors one step behind: at step t a rank forms the contributions of its queries in a
 * fresh buffer while the accumulator of the same keys arrives from the previous rank and the one
 * it completed at step t − 1 leaves for the next, so both transfers overlap the step; after the S
 * steps one last pass takes every accumulator home. */
void ring_backward(const struct ring *rg, const struct ring_pass *ps) {
  const size_t K = tensors_floats(&ps->travel, rg->T);
  float *kv = comm_alloc(rg->cm, MEM_COMM, 2 * K), *cur = kv, *nxt = kv + K;
  float *acc = comm_alloc(rg->cm, MEM_COMM, 3 * K);
  float *part = acc, *done = acc + K, *in = acc + 2 * K;
  struct ring_step s = {.rg = rg};
  float *zbuf = ring_enter(rg, ps, cur, &s);
  for (int t = 0; t < rg->S; t++) {
    struct ring_xfer xkv = {0}, xacc = {0};
    if (t < rg->S - 1) ring_start(rg, cur, nxt, K, RING_TAG_KV, &xkv);
    if (t > 0) ring_start(rg, done, in, K, RING_TAG_ACC, &xacc);
    ring_zero(rg, part, K);
    step_point(rg, ps, t, cur, part, &s);
    ps->step(&s, ps->user);
    if (t > 0) {
      ring_finish(&xacc);
      ring_add(rg, part, in, K);
    }
    if (t < rg->S - 1) {
      ring_finish(&xkv);
      float *tmp = cur;
      cur = nxt;
      nxt = tmp;
    }
    float *tmp = done;
    done = part;
    part = tmp;
  }
  struct ring_xfer xacc;
  ring_start(rg, done, in, K, RING_TAG_ACC, &xacc); /* home: my travel's gradients in `in` */
  ring_finish(&xacc);
  comm_free_buffer(rg->cm, kv);
  ring_leave(rg, ps, &s, acc, in);
  comm_free_buffer(rg->cm, zbuf);
  comm_free_buffer(rg->cm, acc);
}
