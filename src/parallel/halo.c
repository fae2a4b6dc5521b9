/* Token halos (halo.h). Messages hold, for each row, the contiguous tokens one rank sends
 * another; ranges come from the plan both sides compute alike. Buffers and packing are the
 * transport's (comm.h), so a halo works on host or device memory alike. */
#include "parallel/halo.h"

#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "core/memory.h"

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

/* One side of an exchange: rows of `stride` tokens starting at global token `lo`, and per rank r
 * the global token range [a[r], b[r]) that goes to (or comes from) r. */
struct side {
  long stride, lo;
  const long *a, *b;
};

/* Counts and displacements in floats of a side's messages. */
static void layout(int S, struct side x, long rows, long d, size_t *count, size_t *displ) {
  size_t off = 0;
  for (int r = 0; r < S; r++) {
    count[r] = (size_t)((x.b[r] - x.a[r]) * rows * d);
    displ[r] = off;
    off += count[r];
  }
}

/* Send each rank its range of src, and copy (or add) what arrives into dst. */
static void exchange(const struct halo *h, struct comm *c, float *dst, struct side to,
                     const float *src, struct side from, long rows, long d, bool add) {
  const int S = h->S;
  size_t *sc = xmalloc(sizeof(size_t) * 4 * (size_t)S), *sd = sc + S, *rc = sc + 2 * S,
         *rd = sc + 3 * S;
  layout(S, from, rows, d, sc, sd);
  layout(S, to, rows, d, rc, rd);
  float *sbuf = comm_alloc(c, MEM_COMM, sd[S - 1] + sc[S - 1] + 1);
  float *rbuf = comm_alloc(c, MEM_COMM, rd[S - 1] + rc[S - 1] + 1);
  for (int r = 0; r < S; r++) {
    const long len = from.b[r] - from.a[r];
    if (len > 0)
      comm_copy_rows(c, sbuf + sd[r], (size_t)(len * d), src + (from.a[r] - from.lo) * d,
                     (size_t)(from.stride * d), (size_t)rows, (size_t)(len * d));
  }
  comm_alltoallv_float(c, sbuf, sc, sd, rbuf, rc, rd);
  for (int r = 0; r < S; r++) {
    const long len = to.b[r] - to.a[r];
    if (len <= 0) continue;
    float *out = dst + (to.a[r] - to.lo) * d;
    const float *in = rbuf + rd[r];
    if (add)
      comm_add_rows(c, out, (size_t)(to.stride * d), in, (size_t)(len * d), (size_t)rows,
                    (size_t)(len * d));
    else
      comm_copy_rows(c, out, (size_t)(to.stride * d), in, (size_t)(len * d), (size_t)rows,
                     (size_t)(len * d));
  }
  comm_free_buffer(c, sbuf);
  comm_free_buffer(c, rbuf);
  free(sc);
}

void halo_gather(const struct halo *h, struct comm *c, float *ext, const float *local, long rows,
                 long d) {
  const long E = h->hi - h->lo, T = h->T; /* my own slab, then the halos */
  comm_copy_rows(c, ext + (h->t0 - h->lo) * d, (size_t)(E * d), local, (size_t)(T * d),
                 (size_t)rows, (size_t)(T * d));
  if (h->S == 1) return;
  exchange(h, c, ext, (struct side){E, h->lo, h->recv_a, h->recv_b}, local,
           (struct side){T, h->t0, h->send_a, h->send_b}, rows, d, false);
}

void halo_scatter_add(const struct halo *h, struct comm *c, float *local, const float *ext,
                      long rows, long d) {
  const long E = h->hi - h->lo, T = h->T;
  comm_add_rows(c, local, (size_t)(T * d), ext + (h->t0 - h->lo) * d, (size_t)(E * d), (size_t)rows,
                (size_t)(T * d));
  if (h->S == 1) return;
  /* the transpose: what I received in gather, I now send back; what I sent, I receive */
  exchange(h, c, local, (struct side){T, h->t0, h->send_a, h->send_b}, ext,
           (struct side){E, h->lo, h->recv_a, h->recv_b}, rows, d, true);
}
