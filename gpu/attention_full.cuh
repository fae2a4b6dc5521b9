/* Exact attention's blocked form as gpu/attention_full*.cu call it (internal to gpu/, host code
 * only: no kernel here). Tensors are per head, (BH, stride, width): a side names how the rows of
 * one head lie and which global tokens they are, so one call serves the whole slab, a zigzag
 * piece of the ring, or a halo-extended range of keys. Backward ACCUMULATES, as the CPU op does. */
#ifndef FMATTN_GPU_ATTENTION_FULL_CUH
#define FMATTN_GPU_ATTENTION_FULL_CUH

/* Which keys query i may see (global indices): j ≤ i when causal, |i − j| < band when band > 0. */
struct exact_mask {
  bool causal;
  long band;
};

/* The problem: BH heads of size d under one mask. */
struct exact_job {
  long BH;
  int d;
  exact_mask mk;
};

/* One side's rows: head h's row i at (h·stride + i)·width floats from the tensor's start; rows
 * [0, n) are the global tokens off … off + n − 1. Every tensor of a side shares it: q, dout, out,
 * dq and the per-row m, l, lse, D (width 1) on the query side; k, v, dk, dv on the key side. */
struct exact_side {
  long stride, n, off;
};

/* Online-softmax state of the query side: the running max m and sum l (as lse), the accumulator
 * acc (as out). */
void exact_state_init(float *m, float *l, float *acc, long rows, int d);
/* out = acc / l (in place when out = acc), lse = m + log l, over rows contiguous rows. */
void exact_state_finish(float *out, float *lse, float *acc, const float *m, const float *l,
                        long rows, int d);

/* Fold the keys k, v (key side ks) into the state of the queries (query side qs): the full form,
 * every query chunk against the contiguous range of keys it may see. */
void exact_fold(const exact_job &job, exact_side qs, const float *q, float *m, float *l, float *acc,
                exact_side ks, const float *k, const float *v);
/* dq (as q), dk, dv (as k) += the gradients of exact_fold's keys for the output gradient dout
 * (lse and D as the query side). */
void exact_grad(const exact_job &job, exact_side qs, const float *q, const float *dout,
                const float *D, const float *lse, float *dq, exact_side ks, const float *k,
                const float *v, float *dk, float *dv);

/* The whole op of one query slab against one range of keys (one slab, or local's halo-extended
 * keys): out, lse; with a band, each query block against its band alone (gathered windows). The
 * query side must be contiguous (stride = n). */
void exact_keys_forward(const exact_job &job, exact_side qs, const float *q, float *out, float *lse,
                        exact_side ks, const float *k, const float *v);
void exact_keys_backward(const exact_job &job, exact_side qs, const float *q, const float *dout,
                         const float *out, const float *lse, float *dq, exact_side ks,
                         const float *k, const float *v, float *dk, float *dv);

#endif
