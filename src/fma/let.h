/* The locally essential tree of distributed FMA (SPEC §7): what a rank's queries need from other
 * ranks and how it gets there — the near field's halo, the upward pass of windows that span
 * ranks (computed on every rank after one exchange), then exactly the summaries the rank's
 * interaction lists name that it does not hold; backward sends the transposes. Every rank can
 * compute every other's needs, so no request messages exist. */
#ifndef FMATTN_FMA_LET_H
#define FMATTN_FMA_LET_H

#include "fma/fma.h"
#include "parallel/comm.h"
#include "parallel/halo.h"

#ifdef __cplusplus
extern "C" {
#endif

struct fma_let {
  int S, s;
  int lspan;        /* first level whose windows span ranks (levels + 1: none) */
  struct halo near; /* the near field's keys and values around the slab */
  /* summary windows to send to / receive from each rank: (level, window) pairs in a fixed order,
   * [off[r], off[r + 1]) for rank r */
  int *send_level, *recv_level;
  long *send_window, *recv_window;
  size_t *send_off, *recv_off;
  struct fma_balance *bal; /* balanced causal work (fma/balance.h), NULL: none */
};

/* Plan for this layer's state (slab, tree, variant) on the sequence group, computed once per
 * layer shape. Per-rank traffic per layer is O(m·C + p·C·log n), independent of n/S. */
struct fma_let *fma_let_plan(const struct fma_state *st, const struct comm *c);
void fma_let_free(struct fma_let *let);
/* Whether rank r holds summary window c of level l once fma_let_upward has run, without the
 * fetch: its slab's windows, every window of the levels from lspan up (each rank computes them
 * all), and for m2m every rank's top window (level lspan − 1, gathered to compute them). */
bool fma_let_holds(const struct fma_state *st, int r, int l, long c);

/* The fetch of the listed summaries while it is in flight: started by fma_let_upward, completed
 * into X by fma_let_fetch_finish. Only the near field may run in between: it reads no summary. */
struct fma_let_fetch {
  struct comm_request req;
  struct comm *c;
  float *sbuf, *rbuf; /* c's kept LET buffers */
  size_t *counts;     /* 4·S: sent, their displacements, received, theirs */
  float *X[FMA_NSETS];
  int nsets;
  long count;
  bool active;
};

/* Forward, after the local upward pass of every set (X[set]: (count, rows, d) per set): complete
 * the windows that span ranks (M2M of spanning parents for m2m, the sums of the partial P2M
 * windows for conv and avg), then receive the listed summaries this rank does not own: before
 * returning when pending is NULL, else started into *pending (SPEC §7's overlap). */
void fma_let_upward(const struct fma_state *st, struct comm *c, float *const *X, int nsets,
                    long count, const struct fma_down_weights *w, struct fma_times *times,
                    struct fma_let_fetch *pending);
/* Wait for a started fetch and write what it received into its X (nothing if none is active). */
void fma_let_fetch_finish(const struct fma_state *st, struct fma_let_fetch *f,
                          struct fma_times *times);
/* Its transpose, before fma_upward_pass_backward: return the gradients of received summaries to
 * their owners (added there), then the transposes of the spanning windows, coarse to fine. X as
 * in forward (not read); dX[set]: (count, rows, d). */
void fma_let_upward_backward(const struct fma_state *st, struct comm *c, const float *const *X,
                             float *const *dX, int nsets, long count,
                             const struct fma_down_weights *w, struct fma_times *times);

#ifdef __cplusplus
}
#endif

#endif
