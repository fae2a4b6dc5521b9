/* Exact softmax attention over a band of keys (full.c): the op behind `full` and `local`, for a
 * variant whose near field is a band of it (fmmformer's Band, SPEC §6.6), and the logits hook by
 * which a variant on it (FiSH heads, fish.c) forms its own logits inside full.c's tile loops.
 * Internal to src/attention/; the model never sees it. The band rules are SPEC §6.2's. */
#ifndef FMATTN_ATTENTION_EXACT_H
#define FMATTN_ATTENTION_EXACT_H

#include <limits.h>
#include <stdbool.h>

#include "attention/attention.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The band and causal rule as the tile loops use it. Which keys a query may see: j ≤ i when causal;
 * |i − j| < band when band > 0. */
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

/* The key rows [*j0, *jend) the tile loops cover for queries [gi0, gi1]: live_keys' range with
 * its end rounded up to a whole tile (and cut at Tk), so a wide key tile covers what square tiles
 * of the same size did. */
static inline void live_key_tiles(struct key_mask mk, long gi0, long gi1, long koff, long Tk,
                                  int tile, long *j0, long *jend) {
  long j1;
  live_keys(mk, gi0, gi1, koff, Tk, tile, j0, &j1);
  const long e = (j1 - *j0 + tile - 1) / tile * tile + *j0;
  *jend = e < Tk ? e : Tk;
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

/* ---------------------------------------------------------------------------------------------
 * Logits hooks. The tile loops, the mask, the online softmax, P·V, the softmax backward
 * (dV, dP, dS = P ∘ (dP − D)) and the three paths (one slab, the band's halo, the ring) are
 * full.c's; a hook says only how one tile's logits are formed and how their gradient flows back.
 * Tensors come in units of `heads` value heads that share one logits computation over `qk_heads`
 * query/key heads: q, k (units·qk_heads, T, d); v, out, dout (units·heads, T, d); lse
 * (units·heads, T). full: a unit is one (b, h); FiSH: one batch element's H heads over G. */

/* Where one call reads: one unit's q (qk_heads, qstride, d) from global query qoff, and its k
 * (qk_heads, kstride, d) and v (heads, kstride, d) from global key koff, each row ld floats after
 * the last (head h's row i at h·stride·d + i·ld: ld = d, or the caller's rows with one head per
 * unit, attn_ctx.rows); and the loops' tile. */
struct exact_rows {
  const float *q, *k, *v;
  long ld;
  long qstride, kstride, qoff, koff;
  int d, tile;
  int ktile; /* keys per tile: a multiple of tile (wider key tiles make larger GEMMs) */
  long unit; /* which unit: b·H + h (full), b (FiSH) */
  /* Where the hook asks for them (transposed_kv): this range's keys and values transposed, (d, ld)
   * from its key 0, so that the scores and dP are NN products (core/tilegemm.h); else NULL. The
   * forward has kt only; where backward has vt, v is NULL (read only as vt). */
  const float *kt, *vt;
  long kt_ld;
};

/* What one unit's backward adds to: dq, dk as q, k; dv as v (rows of exact_rows' ld); dpar the
 * hook's parameter gradients of this unit (param_floats); dout (rows of ld_dout floats), lse and
 * D = scale·rowsum(dout ∘ out) as (heads, qstride[, d]); scale (heads) the output gradient's factor
 * per head (NULL: 1). */
struct exact_grads {
  float *dq, *dk, *dv, *dpar;
  const float *dout, *lse, *D, *scale;
  long ld_dout;
};

struct exact_hook {
  int heads, qk_heads;
  /* Key tiles this many query tiles wide when there is no band (0 or 1: square tiles). */
  int key_tiles;
  /* One thread's scratch, in tiles of tile × ktile floats, for the forward and the backward loop:
   * the loop's own tiles come first (the heads' logits, and in backward one dP tile), a hook's
   * own start at tile heads + 1. */
  int scratch_forward, scratch_backward;
  /* Where 1/√d enters the softmax backward: dS = P ∘ ((dP − D) · ds_scale). 1/√d for both hooks:
   * full's dq and dk products then have alpha 1, which libxsmm's kernels need (core/tilegemm.h);
   * FiSH applies it before the mixing's transpose. */
  float ds_scale;
  /* Lay k and v out transposed once per unit and key range (exact_rows kt, vt): one head per unit
   * and qk head only. */
  bool transposed_kv;
  size_t param_floats; /* parameter gradient floats per unit, summed in unit order; 0: none */
  /* Keep the gathered halo keys until their gradients have gone home (FiSH) rather than freeing
   * them first (full): no numerical effect, but it sets FiSH-local's memory high-water mark under
   * sequence parallelism (diag.h5 /memory/peak_bytes), kept as it was. */
  bool keep_halo;
  /* L (heads, bi, bj): the logits, 1/√d applied, unmasked, of queries i0 … i0 + bi − 1 against
   * keys j0 … j0 + bj − 1 of x (rows relative to x's q and k). */
  void (*logits)(const struct exact_hook *hk, const struct exact_rows *x, long i0, long bi, long j0,
                 long bj, float *L, float *scratch);
  /* g's dq, dk, dpar += the gradients through the same tile's logits, from dS (heads, bi, bj). */
  void (*grad)(const struct exact_hook *hk, const struct exact_rows *x, const struct exact_grads *g,
               long i0, long bi, long j0, long bj, const float *dS, float *scratch);
  const void *user;
};

/* exact_attention_forward / _backward with hk's logits; dparams (param_floats) += the hook's
 * parameter gradients (may be NULL). */
void exact_hooked_forward(struct attn_ctx *ctx, const struct exact_hook *hk, long band, float *out,
                          float *lse, const float *q, const float *k, const float *v);
void exact_hooked_backward(struct attn_ctx *ctx, const struct exact_hook *hk, long band,
                           const float *head_scale, float *dq, float *dk, float *dv, float *dparams,
                           const float *dout, const float *q, const float *k, const float *v,
                           const float *out, const float *lse);

/* Incremental decoding of a band (band 0: every earlier key) for generation: a cache of the keys
 * and values (a ring of the band's last `band` positions), and one position's step: its key and
 * value added, out (H, d) of its query. */
void *exact_decode_open_band(const struct attn_ctx *ctx, long band);
void exact_decode_step_band(const struct attn_ctx *ctx, void *cache, float *out, const float *q,
                            const float *k, const float *v, long pos);
void exact_decode_close(void *cache);

#ifdef __cplusplus
}
#endif

#endif
