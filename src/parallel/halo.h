/* Token halos within a sequence group (SPEC §7): rank s holds tokens [s·T, (s+1)·T) of `rows`
 * rows (batch × heads) of d floats and needs `before` tokens before its slab and `after` after it
 * (clipped to [0, n); several ranks' worth when slabs are short). The plan is a pure function of
 * the rank, so one alltoallv moves everything (of several arrays at once, and started early when
 * the caller has work to hide it behind); scatter_add is its transpose (backward). */
#ifndef FMATTN_HALO_H
#define FMATTN_HALO_H

#include <stdbool.h>
#include <stddef.h>

#include "parallel/comm.h"

#ifdef __cplusplus
extern "C" {
#endif

struct halo {
  long n, T, t0;
  long lo, hi; /* my extended range [lo, hi): the slab and its halos */
  int S;
  long *send_a, *send_b; /* (S) tokens [a, b) of my slab that rank r needs */
  long *recv_a, *recv_b; /* (S) tokens [a, b) of rank r's slab that I need */
};

void halo_plan(struct halo *h, const struct comm *c, long n, long T, long before, long after);
void halo_free(struct halo *h);
/* True when no token comes from another rank (one rank, or nothing reaches past the slab). */
bool halo_local(const struct halo *h);
/* ext (rows, hi − lo, d) ← the local slab (rows, T, d) and the halos from their owners. */
void halo_gather(const struct halo *h, struct comm *c, float *ext, const float *local, long rows,
                 long d);
/* local (rows, T, d) += the slab part of ext (rows, hi − lo, d), and the halo parts of ext go back
 * to their owners and are added there. */
void halo_scatter_add(const struct halo *h, struct comm *c, float *local, const float *ext,
                      long rows, long d);

/* The same for narr arrays of the same shape (keys and values) in one exchange, and the gather
 * started without waiting: halo_gather_start copies the slabs and posts the exchange (one
 * non-blocking alltoallv); halo_finish waits and writes the halos. The sources are not read and
 * ext's halo parts not written in between. */
#define HALO_MAX_ARRAYS 4
struct halo_exchange {
  struct comm_request req;
  struct comm *c;
  float *sbuf, *rbuf;
  size_t *counts; /* 4·S: sent, their displacements, received, theirs */
  float *dst[HALO_MAX_ARRAYS];
  long stride, lo;   /* dst rows: stride tokens from global token lo */
  const long *a, *b; /* (S) tokens [a, b) from rank r */
  int narr;
  long rows, d;
  bool add, active;
};
void halo_gather_start(const struct halo *h, struct comm *c, struct halo_exchange *x,
                       float *const *ext, const float *const *local, int narr, long rows, long d);
void halo_finish(struct halo_exchange *x);
void halo_gather_arrays(const struct halo *h, struct comm *c, float *const *ext,
                        const float *const *local, int narr, long rows, long d);
void halo_scatter_add_arrays(const struct halo *h, struct comm *c, float *const *local,
                             const float *const *ext, int narr, long rows, long d);

#ifdef __cplusplus
}
#endif

#endif
