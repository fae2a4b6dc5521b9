/* Token halos (halo.h). Messages hold, for each row, the contiguous tokens one rank sends
 * another; ranges come from the plan both sides compute alike. */
#include "halo.h"

#include <stdlib.h>
#include <string.h>

#include "error.h"
#include "memory.h"

static long max_l(long a, long b) { return a > b ? a : b; }
static long min_l(long a, long b) { return a < b ? a : b; }

/* Extended range of rank r. */
static void ext_range(long n, long T, long before, long after, int r, long *lo, long *hi) {
  *lo = max_l(0, (long)r * T - before);
  *hi = min_l(n, (long)(r + 1) * T + after);
}

void halo_plan(struct halo *h, const struct comm *c, long n, long T, long before, long after) {
  memset(h, 0, sizeof *h);
  const int S = c ? c->S : 1, s = c ? c->seq_rank : 0;
  h->n = n;
  h->T = T;
  h->S = S;
  h->t0 = (long)s * T;
  ext_range(n, T, before, after, s, &h->lo, &h->hi);
  h->send_a = xcalloc((size_t)(4 * S), sizeof(long));
  h->send_b = h->send_a + S;
  h->recv_a = h->send_a + 2 * S;
  h->recv_b = h->send_a + 3 * S;
  for (int r = 0; r < S; r++) {
    if (r == s) continue;
    long lo, hi;
    ext_range(n, T, before, after, r, &lo, &hi);
    /* what r needs of my slab */
    long a = max_l(lo, h->t0), b = min_l(hi, h->t0 + T);
    h->send_a[r] = a;
    h->send_b[r] = b > a ? b : a;
    /* what I need of r's slab */
    a = max_l(h->lo, (long)r * T);
    b = min_l(h->hi, (long)(r + 1) * T);
    h->recv_a[r] = a;
    h->recv_b[r] = b > a ? b : a;
  }
}

void halo_free(struct halo *h) {
  free(h->send_a);
  memset(h, 0, sizeof *h);
}

bool halo_local(const struct halo *h) { return h->lo == h->t0 && h->hi == h->t0 + h->T; }

/* Counts and displacements in floats for one direction. */
static void layout(const struct halo *h, const long *a, const long *b, long rows, long d,
                   size_t *count, size_t *displ) {
  size_t off = 0;
  for (int r = 0; r < h->S; r++) {
    count[r] = (size_t)((b[r] - a[r]) * rows * d);
    displ[r] = off;
    off += count[r];
  }
}

void halo_gather(const struct halo *h, struct comm *c, float *ext, const float *local, long rows,
                 long d) {
  const long E = h->hi - h->lo, T = h->T;
  for (long row = 0; row < rows; row++) /* my own slab */
    memcpy(ext + (row * E + (h->t0 - h->lo)) * d, local + row * T * d,
           sizeof(float) * (size_t)(T * d));
  if (h->S == 1) return;
  const int S = h->S;
  size_t *sc = xmalloc(sizeof(size_t) * 4 * (size_t)S), *sd = sc + S, *rc = sc + 2 * S,
         *rd = sc + 3 * S;
  layout(h, h->send_a, h->send_b, rows, d, sc, sd);
  layout(h, h->recv_a, h->recv_b, rows, d, rc, rd);
  const size_t stotal = sd[S - 1] + sc[S - 1], rtotal = rd[S - 1] + rc[S - 1];
  float *sbuf = mem_alloc(MEM_COMM, sizeof(float) * (stotal + 1));
  float *rbuf = mem_alloc(MEM_COMM, sizeof(float) * (rtotal + 1));
  for (int r = 0; r < S; r++) {
    const long len = h->send_b[r] - h->send_a[r];
    for (long row = 0; row < rows && len > 0; row++)
      memcpy(sbuf + sd[r] + (size_t)(row * len * d), local + (row * T + h->send_a[r] - h->t0) * d,
             sizeof(float) * (size_t)(len * d));
  }
  comm_alltoallv_float(c, sbuf, sc, sd, rbuf, rc, rd);
  for (int r = 0; r < S; r++) {
    const long len = h->recv_b[r] - h->recv_a[r];
    for (long row = 0; row < rows && len > 0; row++)
      memcpy(ext + (row * E + h->recv_a[r] - h->lo) * d, rbuf + rd[r] + (size_t)(row * len * d),
             sizeof(float) * (size_t)(len * d));
  }
  mem_free(sbuf);
  mem_free(rbuf);
  free(sc);
}

void halo_scatter_add(const struct halo *h, struct comm *c, float *local, const float *ext,
                      long rows, long d) {
  const long E = h->hi - h->lo, T = h->T;
  for (long row = 0; row < rows; row++) {
    float *dst = local + row * T * d;
    const float *src = ext + (row * E + (h->t0 - h->lo)) * d;
    for (long i = 0; i < T * d; i++) dst[i] += src[i];
  }
  if (h->S == 1) return;
  const int S = h->S;
  size_t *sc = xmalloc(sizeof(size_t) * 4 * (size_t)S), *sd = sc + S, *rc = sc + 2 * S,
         *rd = sc + 3 * S;
  /* the transpose: what I received in gather, I now send back; what I sent, I receive */
  layout(h, h->recv_a, h->recv_b, rows, d, sc, sd);
  layout(h, h->send_a, h->send_b, rows, d, rc, rd);
  const size_t stotal = sd[S - 1] + sc[S - 1], rtotal = rd[S - 1] + rc[S - 1];
  float *sbuf = mem_alloc(MEM_COMM, sizeof(float) * (stotal + 1));
  float *rbuf = mem_alloc(MEM_COMM, sizeof(float) * (rtotal + 1));
  for (int r = 0; r < S; r++) {
    const long len = h->recv_b[r] - h->recv_a[r];
    for (long row = 0; row < rows && len > 0; row++)
      memcpy(sbuf + sd[r] + (size_t)(row * len * d), ext + (row * E + h->recv_a[r] - h->lo) * d,
             sizeof(float) * (size_t)(len * d));
  }
  comm_alltoallv_float(c, sbuf, sc, sd, rbuf, rc, rd);
  for (int r = 0; r < S; r++) {
    const long len = h->send_b[r] - h->send_a[r];
    for (long row = 0; row < rows && len > 0; row++) {
      float *dst = local + (row * T + h->send_a[r] - h->t0) * d;
      const float *src = rbuf + rd[r] + (size_t)(row * len * d);
      for (long i = 0; i < len * d; i++) dst[i] += src[i];
    }
  }
  mem_free(sbuf);
  mem_free(rbuf);
  free(sc);
}
