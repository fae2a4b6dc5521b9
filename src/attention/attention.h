/* The attention interface (SPEC §1, §6): one ops table per variant, the only seam between the
 * model and a variant; adding one is a new file plus one line in deck/variants.h. v and the output
 * are (B, H, T, d) over the LOCAL tokens, q and k (B, Hqk, T, d), Hqk = H or FiSH's G global heads
 * (or all of them by token, where the implementation takes it: attn_ctx.rows). Under sequence
 * parallelism a variant reaches the rest of the sequence through ctx->comm; the exchange it needs
 * is its own business, behind forward/backward. */
#ifndef FMATTN_ATTENTION_H
#define FMATTN_ATTENTION_H

#include <stdbool.h>
#include <stddef.h>

#include "deck/config.h"
#include "nn/params.h"
#include "parallel/comm.h"

#ifdef __cplusplus
extern "C" {
#endif

struct attn_dims {
  long B;      /* local batch */
  long H;      /* heads */
  long T;      /* local tokens */
  long d;      /* head size */
  long n;      /* global sequence length */
  long t0;     /* global index of local token 0 */
  bool causal; /* clm: output i depends on inputs ≤ i only */
};

struct attn_variant;
struct attn_impl;

/* Where a variant that opens far windows by content (fma.open, SPEC §6.4a) adds its diagnostics
 * when the caller asks (both NULL: not wanted): open_mass (H) — the probability on opened exact
 * tokens, summed over the queries examined; opened (levels + 1; [0] unused) — the windows opened
 * at each level, summed over the queries examined and the heads. */
struct attn_open_diag {
  double *open_mass;
  double *opened;
};

/* What a context's implementations read of the deck, once, when it is opened (attention_open, the
 * set-up): below it nothing sees struct config. A variant's own options beyond these live in its
 * state (setup: fma's struct fma_options, rmfa's struct rmfa_options, ...). */
struct attn_options {
  int diag_m, diag_p; /* attention.fma.m, fma.p: the tree every variant's diagnostics band by */
  int diag_bands;     /* that tree's levels + 1 at dims.n */
  int full_block;     /* attention.full.block: the exact loops' tile (full, local, FiSH) */
  int local_band;     /* attention.local.band (local, FiSH-local) */
  int qk_heads;       /* heads of q and k: model.heads, or FiSH's global heads */
  bool opens;         /* the variant opens far windows by content (fma.open) */
};

struct attn_ctx {
  struct attn_options opt;
  const struct attn_variant *variant;
  const struct attn_impl *impl; /* the implementation for the device the context was opened on */
  struct attn_dims dims;
  struct comm *comm; /* sequence group for exchanges; S = 1 means the slab is the sequence */
  void *state;       /* the variant's host state (tree, lists, scratch sizes), from setup */
  void *impl_state;  /* the implementation's own state (device buffers), from impl->open */
  int layer;
  /* Set by the caller before forward (backward sees the same): the training step, whether this is
   * training (dropout-like noise on), and the global index of local batch element 0 — the keys of
   * counter-based noise (FiSH), so that it is the same on any rank layout. */
  long step;
  bool train;
  long sample0;
  struct attn_open_diag open_diag; /* set by the caller of diagnostics, or zeroed */
  /* Set by the caller before forward: this layer's backward follows at once, on the same q, k, v
   * and parameters (the recomputation in backward), so the variant may keep for it what it would
   * otherwise rebuild (fma: the summaries, the LET and the halo). Else false. */
  bool backward_next;
  /* Set by the caller where attention_takes_rows allows it, else zeroed: the arrays by token rather
   * than by head. ld_qkv > 0: q, k, v, dq, dk, dv are (B, T, ·) with rows of ld_qkv floats, head h
   * of token t of batch element b at (b·T + t)·ld_qkv + h·d (q, k, v read in place from the
   * (B, T, 3C) product that makes them); out, dout likewise with rows of ld_out floats (the
   * (B, T, C) input of the output projection). The model then skips its head split and merge.
   * Backward then writes dq, dk, dv (every head's columns of every row) where by head it adds to
   * them: the caller zeroes nothing. */
  struct attn_rows {
    long ld_qkv, ld_out;
  } rows;
};

/* Why a variant refuses a configuration: the deck keys at fault, space separated ("model.context
 * attention.fma.m"; the deck layer reports the refusal where the last of them was set), and the
 * reason. */
struct attn_refusal {
  char keys[192];
  char msg[1024];
};

/* One device's implementation of a variant's numerics. Arrays live on that device: q, k
 * (B, Hqk, T, d), v, out, dout (B, H, T, d), saved and params as the implementation lays them. */
struct attn_impl {
  /* State of the implementation for one context (NULL when it needs none); close frees it. */
  void *(*open)(const struct attn_ctx *ctx);
  void (*close)(void *impl_state);
  /* Whether this implementation refuses cfg — a setting of the variant it does not implement —
   * and why (keys and message in *r). NULL: it takes whatever the variant takes. Called before
   * anything is allocated. */
  bool (*refuses)(const struct config *cfg, struct attn_refusal *r);
  /* Floats that forward saves for backward (per layer). */
  size_t (*saved_floats)(const struct attn_ctx *ctx);
  /* Whether forward and backward take the arrays by token (attn_ctx.rows) for this context. NULL:
   * never (the caller splits q, k, v by head and merges out). */
  bool (*takes_rows)(const struct attn_ctx *ctx);
  /* out (B, H, T, d) = attention(q, k, v); params: this layer's variant parameters (or NULL). */
  void (*forward)(struct attn_ctx *ctx, float *out, float *saved, const float *q, const float *k,
                  const float *v, const float *params);
  /* dq, dk, dv, dparams += the gradients for dout (dq, dk, dv = by token: attn_ctx.rows); out
   * and saved as forward left them. */
  void (*backward)(struct attn_ctx *ctx, float *dq, float *dk, float *dv, float *dparams,
                   const float *dout, const float *q, const float *k, const float *v,
                   const float *params, const float *out, const float *saved);
};

struct attn_variant {
  const char *name;
  const char *params_name; /* the group of its parameters below attn/ (NULL: name) */
  const char *keys_prefix; /* the prefix of its deck keys in [attention] (NULL: name) */
  bool causal_ok;          /* may run in clm mode */
  bool bidir_ok;           /* may run in mlm mode */
  /* The form this variant takes under attention.heads_mode = fish (SPEC §6.9), or NULL: none. */
  const struct attn_variant *fish;
  /* Whether this variant refuses cfg at sequence length n on seq_ranks ranks, and why (keys and
   * message in *r). Called before anything is allocated. NULL: it takes any layout of equal
   * slabs (attention_check refuses n not divisible by seq_ranks for every variant). */
  bool (*check)(const struct config *cfg, long n, int seq_ranks, struct attn_refusal *r);
  /* A nearby configuration to try when check refuses cfg (bench sweeps): changes cfg and returns
   * true, or false when there is none (fma: conv summaries that would not fit become m2m). */
  bool (*fallback)(struct config *cfg);
  /* The variant's main option as a short label for tables (fma: fma.downsample), or NULL. */
  const char *(*option_label)(const struct config *cfg);
  /* Parameters of ONE layer, appended with names relative to "attn/<name>/" (may add none). */
  void (*describe)(const struct config *cfg, long n, struct param_list *list);
  /* A frozen tensor given with another shape than describe's (a kernel file carrying its own
   * random-feature draw): adjusts cfg so that describe gives that shape and returns true, or
   * returns false when the variant cannot take it. NULL: shapes are fixed. */
  bool (*adopt_shape)(struct config *cfg, const char *name, int ndim, const long *shape);
  /* Initialise a parameter that describe registered with INIT_CUSTOM. */
  void (*init_param)(const struct config *cfg, const struct param_desc *p, float *data);
  /* Host state for these dimensions, shared by every implementation (NULL if none); teardown
   * frees it. */
  void *(*setup)(const struct config *cfg, const struct attn_dims *dims);
  void (*teardown)(void *state);
  /* The implementations, side by side: the CPU one is the variant file's own; a device back end
   * adds its own when it is opened (attention_register_impl), else gpu stays NULL. */
  struct attn_impl cpu;
  const struct attn_impl *gpu;
  /* Attention diagnostics over the local queries of batch element 0 (host arrays): mass (H,
   * bands) — the share of attention probability on the near field and on each level of the FMA
   * tree built with fma.m, fma.p (bands = levels + 1) — and entropy (H), both summed over the
   * queries examined; returns how many queries were examined per head. */
  long (*diagnostics)(struct attn_ctx *ctx, double *mass, double *entropy, const float *q,
                      const float *k, const float *v, const float *params);
  /* Whether cfg opens far windows by content (fma.open, SPEC §6.4a): then diagnostics also fills
   * ctx->open_diag when the caller sets it. NULL: never. */
  bool (*opens)(const struct config *cfg);
  /* Incremental decoding of one causal sequence (generation; B = 1, positions 0 .. n − 1 of the
   * context, host arrays): decode_open makes an empty cache of what later positions need;
   * decode_step adds position pos's key and value and writes the output (H, d) of its query (q, k
   * (Hqk, d), v (H, d), after rope), equal within rounding to forward's row pos. NULL: no cache
   * (the caller recomputes the whole context for every token). */
  void *(*decode_open)(const struct attn_ctx *ctx, const float *params);
  void (*decode_step)(struct attn_ctx *ctx, void *cache, float *out, const float *q, const float *k,
                      const float *v, long pos, const float *params);
  void (*decode_close)(void *cache);
  /* Forward floating-point operations for these dims (model FLOPs: the pairs the variant allows,
   * no recomputation); when the variant has a near field, *p2p_flops receives the FLOPs its
   * near-field GEMMs execute in forward (whole blocks, masked entries included), else 0. */
  double (*flops)(const struct attn_ctx *ctx, double *p2p_flops);
};

/* The registry (deck/variants.h). NULL when the name is unknown. */
const struct attn_variant *attention_find(const char *name);
/* The ops the configuration asks for: attention.variant, under attention.heads_mode = fish its
 * FiSH form; NULL when there is none (attention_check says why). */
const struct attn_variant *attention_select(const struct config *cfg);
/* Query/key heads of the configuration: model.heads, or fish.global_heads under FiSH. */
int attention_qk_heads(const struct config *cfg);
/* Whether the configuration's variant can run at sequence length n on seq_ranks sequence ranks
 * (objective, FiSH form, equal slabs, and the variant's own check): false, with the keys at
 * fault and the reason in *r, when it cannot. */
bool attention_refuses(const struct config *cfg, long n, int seq_ranks, struct attn_refusal *r);
/* attention_refuses as a status: 0 when runnable, else 1 with the reason in err. */
int attention_check(const struct config *cfg, long n, int seq_ranks, char *err, size_t len);
/* The deck's variant rules, for config_add_rule: the configured variant at model.context on
 * one rank, and in bench mode every variant of bench.variants at every n of bench.n_list (after
 * its fallback) where the refusal is about the length. Layout rules wait for the rank count
 * (attention_check at start). */
bool attention_deck_rule(const struct config *cfg, char *keys, size_t keys_len, char *msg,
                         size_t msg_len);
/* Record dev's implementation of the variant called name (a device back end, when it opens). */
void attention_register_impl(const char *name, enum device_kind dev, const struct attn_impl *impl);
/* Whether v's implementation on dev refuses cfg (attn_impl.refuses): 1 with the reason in err,
 * else 0 (also when there is no implementation: attention_impl says so). */
int attention_impl_refuses(const struct attn_variant *v, enum device_kind dev,
                           const struct config *cfg, char *err, size_t len);
/* The implementation of v on dev (DEVICE_CPU or DEVICE_GPU), or NULL when there is none. */
const struct attn_impl *attention_impl(const struct attn_variant *v, enum device_kind dev);

/* A refusal for a check hook: keys and the formatted message into *r; returns true. */
bool attention_refuse(struct attn_refusal *r, const char *keys, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Register the variant's parameters of block `layer` into list under their checkpoint names
 * "layer_NNN/attn/<variant>/<name>" (owner 1, layer set). Returns how many were added. */
int attention_register_params(const struct config *cfg, const struct attn_variant *v, long n,
                              int layer, struct param_list *list);
/* Initialise one registered tensor: the variant's own init for INIT_CUSTOM (it sees the name
 * relative to attn/<variant>/), param_init otherwise. */
void attention_init_param(const struct config *cfg, const struct attn_variant *v,
                          const struct param_desc *p, float *data);

/* The context of variant v for block `layer` on dims, its state set up, with v's implementation
 * for dev (which must exist: attention_impl); attention_close tears it down. The model opens one
 * per block; the bench, kernel files and tests open one alone. */
struct attn_ctx attention_open(const struct config *cfg, const struct attn_variant *v,
                               enum device_kind dev, struct comm *comm, int layer,
                               struct attn_dims dims);
void attention_close(struct attn_ctx *ctx);
/* Whether the context's implementation takes its arrays by token (attn_ctx.rows, attn_impl). */
bool attention_takes_rows(const struct attn_ctx *ctx);
/* The entry points of the context's implementation (struct attn_impl). */
size_t attention_saved_floats(const struct attn_ctx *ctx);
void attention_forward(struct attn_ctx *ctx, float *out, float *saved, const float *q,
                       const float *k, const float *v, const float *params);
void attention_backward(struct attn_ctx *ctx, float *dq, float *dk, float *dv, float *dparams,
                        const float *dout, const float *q, const float *k, const float *v,
                        const float *params, const float *out, const float *saved);

/* One attention op's own parameters outside a model (bench, kernel files, tests): registered as
 * block 0 and initialised as the model would; dparams zeroed. A variant without parameters
 * gets list.count = 0 (and is given NULL for them). */
struct attn_params {
  struct param_list list;
  float *params, *dparams;
};
void attention_params_make(struct attn_params *ap, const struct config *cfg,
                           const struct attn_variant *v, long n);
void attention_params_free(struct attn_params *ap);

/* Number of diagnostic bands for a sequence of n tokens (levels of the fma.m tree + 1). */
int attention_diag_bands(const struct config *cfg, long n);

/* Query rows each rank examines per head for diagnostics, at most. */
#define ATTENTION_DIAG_QUERIES 256

/* Log-weight of the attention of global query i on global key j, from their rows (width floats,
 * as the caller gave them: raw q and k, or feature maps): the share of j in i's attention is
 * e^score / Σ_j e^score; −INFINITY when i may not see j. */
typedef double (*attention_score_fn)(const struct attn_ctx *ctx, const float *qi, long i,
                                     const float *kj, long j, long width, const void *user);

/* Diagnostics of one head whose attention weights can be formed row by row (full, local, and the
 * kernelized variants through their feature maps): for up to `max_queries` evenly spaced local
 * queries of q (T, width), the normalised row over the keys of k (T, width), classified into the
 * distance bands of the fma.m tree: mass (bands) and entropy (1) summed over the queries examined,
 * which are returned. With S > 1 sequence ranks each rank samples its own queries; the sampled
 * rows go round the group and every rank scores them against its own keys, so no rank ever holds
 * more than its slab of k. user is passed to score. Collective over the sequence group. */
long attention_diag_rows(struct attn_ctx *ctx, double *mass, double *entropy, const float *q,
                         const float *k, long width, long max_queries, attention_score_fn score,
                         const void *user);

#ifdef __cplusplus
}
#endif

#endif
