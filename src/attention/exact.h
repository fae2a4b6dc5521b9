/* Exact softmax attention over a band of keys: the tiled kernels behind `full` and `local`
 * (full.c), for a variant whose near field is a band of exact attention (fmmformer's Band, SPEC
 * §6.6). Internal to src/attention/; the model never sees it. The band rules are SPEC §6.2's. */
#ifndef FMATTN_ATTENTION_EXACT_H
#define FMATTN_ATTENTION_EXACT_H

#include <limits.h>
#include <stdbool.h>

#include "attention/attention.h"

/* The band and causal rule as the tile kernels use it (full.c, and FiSH's kernels in fish.c). */
/* Which keys a query may see: j ≤ i when causal; |i − j| < band when band > 0. */
struct key_mask {
  bool causal;
  long band;
};

/* Allowed global keys of query gi: [*lo, *hi], inclusive. */
static inline void key_range(struct key_mask mk, long gi, long *lo, long *hi) {
  *lo = mk.band > 0 ? gi - mk.band + 1 : LONG_MIN / 2;
  *hi = mk.causal ? gi : (mk.band > 0 ? gi + mk.band - 1 : LONG_MAX / 2);
}

/* Columns [c0, c1) of a key tile starting at global key kj0 (bj keys) that query gi may see. */
static inline void tile_columns(struct key_mask mk, long gi, long kj0, long bj, long *c0,
                                long *c1) {
  long lo, hi;
  key_range(mk, gi, &lo, &hi);
  *c0 = lo - kj0 > 0 ? lo - kj0 : 0;
  *c1 = hi - kj0 + 1 < bj ? hi - kj0 + 1 : bj;
  if (*c1 < *c0) *c1 = *c0;
}

/* Local key rows [*j0, *j1) that some query of [gi0, gi1] may see, for keys starting at global
 * koff (Tk of them), rounded out to whole tiles; the allowed ranges move forward with i. */
static inline void live_keys(struct key_mask mk, long gi0, long gi1, long koff, long Tk, int tile,
                             long *j0, long *j1) {
  long lo0, hi0, lo1, hi1;
  key_range(mk, gi0, &lo0, &hi0);
  key_range(mk, gi1, &lo1, &hi1);
  long a = lo0 - koff > 0 ? lo0 - koff : 0, b = hi1 - koff + 1 < Tk ? hi1 - koff + 1 : Tk;
  *j0 = a / tile * tile;
  *j1 = b > *j0 ? b : *j0;
}

/* out (B, H, T, d) = softmax over the keys j that query i may see (|i − j| < band, and j ≤ i
 * when ctx->dims.causal; band 0: no band) of q kᵀ/√d, times v; lse (B, H, T) saved for backward.
 * Under sequence parallelism a band gathers its halo and band 0 runs the (zigzag) ring. */
void exact_attention_forward(struct attn_ctx *ctx, long band, float *out, float *lse,
                             const float *q, const float *k, const float *v);
/* dq, dk, dv += the gradients for the output gradient dout, scaled per head by head_scale (H)
 * when given (a variant that weighs this attention by a learned factor: fmmformer's σ(w1)); out
 * and lse as forward left them, with the same band. */
void exact_attention_backward(struct attn_ctx *ctx, long band, const float *head_scale, float *dq,
                              float *dk, float *dv, const float *dout, const float *q,
                              const float *k, const float *v, const float *out, const float *lse);
/* Whether query i may see key j (global indices). */
bool exact_attention_allows(bool causal, long band, long i, long j);
/* Forward model FLOPs of this rank's share: 4·d per allowed pair. */
double exact_attention_flops(const struct attn_ctx *ctx, long band);

/* Incremental decoding of a band (band 0: every earlier key) for generation: a cache of the keys
 * and values (a ring of the band's last `band` positions), and one position's step: its key and
 * value added, out (H, d) of its query. */
void *exact_decode_open_band(const struct attn_ctx *ctx, long band);
void exact_decode_step_band(const struct attn_ctx *ctx, void *cache, float *out, const float *q,
                            const float *k, const float *v, long pos);
void exact_decode_close(void *cache);

#endif
