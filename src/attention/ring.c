/* The ring layout and its moves (ring.h). */
#include "attention/ring.h"

#include <stdlib.h>
#include <string.h>

#include "error.h"
#include "memory.h"

/* Messages in pieces far below MPI's int counts. */
#define RING_PIECE ((size_t)1 << 26)

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
  float *sbuf = mem_alloc(MEM_COMM, sizeof(float) * 2 * chunk); /* every rank holds two chunks */
  float *rbuf = mem_alloc(MEM_COMM, sizeof(float) * 2 * chunk);
  for (long j = 0; j < 2L * S; j++) {
    if (chunk_rank(S, j, !to_zig) != me) continue;
    const long p = chunk_place(S, j, !to_zig);
    float *m = sbuf + sfill[chunk_rank(S, j, to_zig)];
    for (int i = 0; i < nt; i++)
      for (long row = 0; row < rows[i]; row++, m += c * w[i])
        memcpy(m, src[i] + (row * 2 * c + p * c) * w[i], sizeof(float) * (size_t)(c * w[i]));
    sfill[chunk_rank(S, j, to_zig)] += chunk;
  }
  comm_alltoallv_float(rg->cm, sbuf, sc, sd, rbuf, rc, rd);
  for (long j = 0; j < 2L * S; j++) {
    if (chunk_rank(S, j, to_zig) != me) continue;
    const long p = chunk_place(S, j, to_zig);
    const float *m = rbuf + rfill[chunk_rank(S, j, !to_zig)];
    for (int i = 0; i < nt; i++)
      for (long row = 0; row < rows[i]; row++, m += c * w[i])
        memcpy(dst[i] + (row * 2 * c + p * c) * w[i], m, sizeof(float) * (size_t)(c * w[i]));
    rfill[chunk_rank(S, j, !to_zig)] += chunk;
  }
  mem_free(sbuf);
  mem_free(rbuf);
  free(sc);
}

void ring_start(const struct ring *rg, const float *send, float *recv, size_t count, int tag,
                struct ring_xfer *x) {
  x->count = (count + RING_PIECE - 1) / RING_PIECE;
  x->req = xmalloc(sizeof *x->req * (x->count + 1));
  for (size_t i = 0; i < x->count; i++) {
    const size_t off = i * RING_PIECE, len = count - off < RING_PIECE ? count - off : RING_PIECE;
    comm_isendrecv_float(rg->cm, send + off, len, rg->next, recv + off, len, rg->prev, tag,
                         &x->req[i]);
  }
}

void ring_finish(struct ring_xfer *x) {
  for (size_t i = 0; i < x->count; i++) comm_wait(&x->req[i]);
  free(x->req);
}
