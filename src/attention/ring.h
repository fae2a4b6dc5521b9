/* The ring of exact attention under sequence parallelism (SPEC §7), shared by `full` (full.c)
 * and FiSH heads on full (fish.c): the layout (zigzag pieces when causal, so every rank gets the
 * same share of the causal triangle), the moves between the model's contiguous slabs and that
 * layout, and the non-blocking transfer to the next rank. What a rank computes at each step is the
 * caller's. Internal to src/attention/. */
#ifndef FMATTN_ATTENTION_RING_H
#define FMATTN_ATTENTION_RING_H

#include <stdbool.h>
#include <stddef.h>

#include "comm.h"

#define RING_TAG_KV  7301
#define RING_TAG_ACC 7302

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
/* Move nt tensors between the contiguous and the zigzag layout with one alltoallv: tensor i is
 * (rows[i], T, w[i]) on both sides. Only for pieces = 2. */
void ring_move(const struct ring *rg, bool to_zig, int nt, const float *const *src,
               float *const *dst, const long *rows, const long *w);

/* One transfer round the ring: send count floats to the next rank, receive as many from the
 * previous one; ring_finish waits for both. */
struct ring_xfer {
  struct comm_request *req;
  size_t count;
};
void ring_start(const struct ring *rg, const float *send, float *recv, size_t count, int tag,
                struct ring_xfer *x);
void ring_finish(struct ring_xfer *x);

#endif
