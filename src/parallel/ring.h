/* The ring of exact attention under sequence parallelism (SPEC §7), written once for `full` and
 * the FiSH heads on it: the layout (zigzag pieces when causal), the moves into it and back, and
 * the S steps of a pass, forward and backward. What a step computes is the caller's callback;
 * ring.c never looks inside a tensor. Internal to src/attention/. */
#ifndef FMATTN_ATTENTION_RING_H
#define FMATTN_ATTENTION_RING_H

#include <stdbool.h>
#include <stddef.h>

#include "parallel/comm.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Causal: the sequence is cut into 2S chunks of T/2 tokens and rank z works on chunks z and
 * 2S−1−z (pieces 0 and 1); bidirectional, or T odd: on its own slab (one piece). */
struct ring {
  struct comm *cm;
  int S, me, next, prev;
  int pieces; /* 2 (zigzag) or 1 (the contiguous slab) */
  long L, T;  /* tokens per piece, per slab */
};

struct ring ring_plan(struct comm *cm, long T, bool causal);
/* Global index of token 0 of piece p of rank r. */
long ring_offset(const struct ring *rg, int r, int p);
/* The rank whose travelling tensors a rank holds at step t of a pass: me − t. */
int ring_source(const struct ring *rg, int t);
/* Move nt tensors between the contiguous and the zigzag layout with one alltoallv: tensor i is
 * (rows[i], T, w[i]) on both sides. Only for pieces = 2. */
void ring_move(const struct ring *rg, bool to_zig, int nt, const float *const *src,
               float *const *dst, const long *rows, const long *w);

/* ---------------------------------------------------------------------------------------------
 * A pass: S steps; at step t every rank holds the travelling tensors (k, v, …) of rank
 * ring_source(t), in a double buffer, while the next ones arrive from the previous rank. */

#define RING_MAX 4 /* tensors per role */

/* Tensors of one role: tensor i is (rows[i], T, w[i]) floats. */
struct ring_tensors {
  int n;
  long rows[RING_MAX], w[RING_MAX];
};

/* What one step of a pass hands its callback, every tensor in the ring's layout. */
struct ring_step {
  const struct ring *rg;
  int t, src;                    /* the step, and the rank whose travelling tensors these are */
  const float *stay[RING_MAX];   /* mine, read only (q; backward also dout and its row dots) */
  float *out[RING_MAX];          /* my results (forward out, backward dq) */
  const float *travel[RING_MAX]; /* src's (k, v) */
  float *dtravel[RING_MAX];      /* backward: zeroed; += the gradients of src's travel */
};

/* A pass: the tensors by role, as the model lays them out (contiguous slabs), and the callback.
 * Forward: out is the callback's to write (the caller's own buffer when the layout is contiguous,
 * else a zeroed one that goes back over out_io after the last step). Backward: out accumulates (in
 * out_io itself when contiguous, else zeroed and added to out_io after the pass), and the
 * gradients of travel follow their tensors one step behind and go home to be added to dtravel. */
struct ring_pass {
  struct ring_tensors stay, travel, out;
  const float *stay_in[RING_MAX], *travel_in[RING_MAX];
  float *out_io[RING_MAX];
  float *dtravel[RING_MAX]; /* backward only; as travel */
  void (*step)(const struct ring_step *s, void *user);
  void *user;
};

void ring_forward(const struct ring *rg, const struct ring_pass *ps);
/* Needs out no larger than travel (in floats): the outputs come home through the accumulators. */
void ring_backward(const struct ring *rg, const struct ring_pass *ps);

#ifdef __cplusplus
}
#endif

#endif
