/* Balanced causal work for fma under sequence parallelism (issue 53; docs/scaling.md): the levels
 * whose windows span ranks are held by every rank once the LET's upward pass is done, so their far
 * field can be evaluated by any rank that has the query. Under causal masking the last ranks'
 * tokens list those levels and the first ranks' do not; a rank whose counted work (near keys and
 * far rows of its lists) is above the mean hands the spanning levels' far field of the last blocks
 * of its slab to a rank below the mean, as a part of the softmax — (o, lse) of those columns,
 * merged like split-K attention — and in backward that part's transpose, which returns dq and adds
 * the summaries' gradients into the helper's own (summed over ranks by fma_let_upward_backward).
 * The plan is the same on every rank, from the lists' closed-form counts: no message. */
#ifndef FMATTN_FMA_BALANCE_H
#define FMATTN_FMA_BALANCE_H

#include "fma/fma.h"
#include "parallel/comm.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Query blocks [b0, b1) (global indices) of rank `rank`'s slab whose spanning far field moves. */
struct fma_balance_part {
  int rank;
  long b0, b1;
};

struct fma_balance {
  int S, lo; /* the far field of levels lo and up moves */
  int ngive, ntake;
  struct fma_balance_part *give; /* this rank's blocks, each part to its helper */
  struct fma_balance_part *take; /* other ranks' blocks this rank evaluates */
  long *take_qb, ntake_blocks;   /* take's blocks in order */
  long ngive_blocks;
  double rows_out, rows_in; /* summary rows per head moved away and taken on */
  double before, after;     /* the plan's busiest rank's counted work / the mean */
};

/* The plan for this layer's state on the sequence group (st->let planned): NULL when nothing
 * moves (not causal fma, no listed spanning level, or work already within 0.5 % of the mean).
 * Sets st->far_cut and st->far_top for the blocks this rank gives. */
struct fma_balance *fma_balance_plan(struct fma_state *st);
void fma_balance_free(struct fma_balance *b);

/* One exchange of the balance in flight: the buffers it sends from and receives into. */
struct fma_balance_xfer {
  struct comm_request req;
  struct comm *c;
  size_t *counts; /* 4·S: sent, their displacements, received, theirs */
  float *sbuf, *rbuf;
  enum comm_buffer_slot sslot, rslot;
  bool active;
};

/* Forward, for BH heads: start sending the given blocks' queries (q (BH, T, d)) to their helpers;
 * then (after the LET's summaries are complete: K, V (BH, rows, d)) evaluate the blocks taken and
 * start sending their parts back; last, wait for this rank's parts and merge them into out (BH,
 * T, d) and lse (BH, T). */
void fma_balance_forward_start(const struct fma_state *st, struct comm *c, const float *q, long BH,
                               struct fma_balance_xfer *x);
void fma_balance_forward_serve(const struct fma_state *st, const float *K, const float *V, long BH,
                               struct fma_balance_xfer *x, struct fma_balance_xfer *y,
                               struct fma_times *times);
void fma_balance_forward_finish(const struct fma_state *st, float *out, float *lse, long BH,
                                struct fma_balance_xfer *y);
/* Backward: the given blocks' queries, dout, D and lse to their helpers; the taken blocks'
 * transposes (dK, dV (BH, rows, d) +=) and their dq sent back; dq (BH, T, d) += this rank's. */
void fma_balance_backward_start(const struct fma_state *st, struct comm *c, const float *q,
                                const float *dout, const float *D, const float *lse, long BH,
                                struct fma_balance_xfer *x);
void fma_balance_backward_serve(const struct fma_state *st, const float *K, const float *V,
                                float *dK, float *dV, long BH, struct fma_balance_xfer *x,
                                struct fma_balance_xfer *y, struct fma_times *times);
void fma_balance_backward_finish(const struct fma_state *st, float *dq, long BH,
                                 struct fma_balance_xfer *y);

#ifdef __cplusplus
}
#endif

#endif
