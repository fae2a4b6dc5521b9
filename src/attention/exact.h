/* Exact softmax attention over a band of keys: the tiled kernels behind `full` and `local`
 * (full.c), for a variant whose near field is a band of exact attention (fmmformer's Band, SPEC
 * §6.6). Internal to src/attention/; the model never sees it. The band rules are SPEC §6.2's. */
#ifndef FMATTN_ATTENTION_EXACT_H
#define FMATTN_ATTENTION_EXACT_H

#include <stdbool.h>

#include "attention/attention.h"

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
