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

/* Counts and displacements in floats of one side's messages: narr arrays of rows × len × d floats
 * per rank r, len = b[r] − a[r]. */
static void layout(int S, const long *a, const long *b, int narr, long rows, long d, size_t *count,
                   size_t *displ) {
  size_t off = 0;
  for (int r = 0; r < S; r++) {
    count[r] = (size_t)((b[r] - a[r]) * rows * d * narr);
    displ[r] = off;
    off += count[r];
  }
}

/* Start sending each rank its range of every src[j] (rows of src_stride tokens from global token
 * src_lo); halo_finish copies (or adds) what arrives into the dst arrays (rows of x->stride tokens
 * from global token x->lo, ranges x->a, x->b). */
static void exchange_start(const struct halo *h, struct comm *c, struct halo_exchange *x,
                           const long *send_a, const long *send_b, const float *const *src,
                           long src_stride, long src_lo, int narr, long rows, long d) {
  const int S = h->S;
  if (narr > HALO_MAX_ARRAYS)
    error("halo: %d arrays in one exchange (at most %d)", narr, HALO_MAX_ARRAYS);
  size_t *sc = xmalloc(sizeof(size_t) * 4 * (size_t)S), *sd = sc + S, *rc = sc + 2 * S,
         *rd = sc + 3 * S;
  layout(S, send_a, send_b, narr, rows, d, sc, sd);
  layout(S, x->a, x->b, narr, rows, d, rc, rd);
  x->sbuf = comm_buffer(c, COMM_BUF_HALO_SEND, sd[S - 1] + sc[S - 1] + 1);
  x->rbuf = comm_buffer(c, COMM_BUF_HALO_RECV, rd[S - 1] + rc[S - 1] + 1);
  for (int r = 0; r < S; r++) {
    const long len = send_b[r] - send_a[r];
    for (int j = 0; j < narr && len > 0; j++)
      comm_copy_rows(c, x->sbuf + sd[r] + (size_t)(j * rows * len * d), (size_t)(len * d),
                     src[j] + (send_a[r] - src_lo) * d, (size_t)(src_stride * d), (size_t)rows,
                     (size_t)(len * d));
  }
  comm_ialltoallv_float(c, x->sbuf, sc, sd, x->rbuf, rc, rd, &x->req);
  x->counts = sc;
  x->narr = narr;
  x->rows = rows;
  x->d = d;
  x->c = c;
  x->active = true;
}

void halo_finish(struct halo_exchange *x) {
  if (!x->active) return;
  struct comm *c = x->c;
  const int S = c->S;
  const size_t *rd = x->counts + 3 * (size_t)S;
  const long rows = x->rows, d = x->d;
  comm_wait(&x->req);
  for (int r = 0; r < S; r++) {
    const long len = x->b[r] - x->a[r];
    for (int j = 0; j < x->narr && len > 0; j++) {
      float *out = x->dst[j] + (x->a[r] - x->lo) * d;
      const float *in = x->rbuf + rd[r] + (size_t)(j * rows * len * d);
      if (x->add)
        comm_add_rows(c, out, (size_t)(x->stride * d), in, (size_t)(len * d), (size_t)rows,
                      (size_t)(len * d));
      else
        comm_copy_rows(c, out, (size_t)(x->stride * d), in, (size_t)(len * d), (size_t)rows,
                       (size_t)(len * d));
    }
  }
  comm_buffer_release(c, COMM_BUF_HALO_SEND);
  comm_buffer_release(c, COMM_BUF_HALO_RECV);
  free(x->counts);
  x->active = false;
}

void halo_gather_start(const struct halo *h, struct comm *c, struct halo_exchange *x,
                       float *const *ext, const float *const *local, int narr, long rows, long d) {
  const long E = h->hi - h->lo, T = h->T; /* my own slab, then the halos */
  memset(x, 0, sizeof *x);
  for (int j = 0; j < narr; j++)
    comm_copy_rows(c, ext[j] + (h->t0 - h->lo) * d, (size_t)(E * d), local[j], (size_t)(T * d),
                   (size_t)rows, (size_t)(T * d));
  if (h->S == 1) return;
  for (int j = 0; j < narr; j++) x->dst[j] = ext[j];
  x->stride = E;
  x->lo = h->lo;
  x->a = h->recv_a;
  x->b = h->recv_b;
  x->add = false;
  exchange_start(h, c, x, h->send_a, h->send_b, local, T, h->t0, narr, rows, d);
}

void halo_gather_arrays(const struct halo *h, struct comm *c, float *const *ext,
                        const float *const *local, int narr, long rows, long d) {
  struct halo_exchange x;
  halo_gather_start(h, c, &x, ext, local, narr, rows, d);
  halo_finish(&x);
}

void halo_gather(const struct halo *h, struct comm *c, float *ext, const float *local, long rows,
                 long d) {
  halo_gather_arrays(h, c, &ext, &local, 1, rows, d);
}

void halo_scatter_add_arrays(const struct halo *h, struct comm *c, float *const *local,
                             const float *const *ext, int narr, long rows, long d) {
  const long E = h->hi - h->lo, T = h->T;
  for (int j = 0; j < narr; j++)
    comm_add_rows(c, local[j], (size_t)(T * d), ext[j] + (h->t0 - h->lo) * d, (size_t)(E * d),
                  (size_t)rows, (size_t)(T * d));
  if (h->S == 1) return;
  /* the transpose: what I received in gather, I now send back; what I sent, I receive */
  struct halo_exchange x = {0};
  for (int j = 0; j < narr; j++) x.dst[j] = local[j];
  x.stride = T;
  x.lo = h->t0;
  x.a = h->send_a;
  x.b = h->send_b;
  x.add = true;
  exchange_start(h, c, &x, h->recv_a, h->recv_b, ext, E, h->lo, narr, rows, d);
  halo_finish(&x);
}

void halo_scatter_add(const struct halo *h, struct comm *c, float *local, const float *ext,
                      long rows, long d) {
  halo_scatter_add_arrays(h, c, &local, &ext, 1, rows, d);
}
