/* The `fma` (O(n log n)) and `fma_linear` (O(n)) attention variants (SPEC §6.4–6.5): their ops
 * tables — the only fma code that reads struct config (into struct fma_options) — and the driver
 * that runs fma/'s operators over batch and heads: the upward pass, evaluate, and in backward
 * their transposes and the summary-parameter gradients summed over heads in a fixed order.
 * Summaries are recomputed in backward, not saved: the upward pass is a small share of evaluate. */
#include <math.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>

#include "attention/attention.h"
#include "core/error.h"
#include "core/memory.h"
#include "core/timer.h"
#include "fma/balance.h"
#include "fma/fma.h"
#include "fma/let.h"
#include "fma/open.h"
#include "parallel/halo.h"
#include "parallel/simsample.h"

#ifdef _OPENMP
#include <omp.h>
#endif

/* Query blocks per forward task: enough work to amortise a task's scratch. */
#define FMA_CHUNK 32
/* conv parameters grow like d·p·n/2 per layer; past this many floats, ask for m2m. */
#define FMA_CONV_MAX_FLOATS (128L << 20)
/* fma.open = all is exact attention at O(n²) work and far rows of O(n) per query: the check of
 * the opening against full, not a way to train; refused beyond this context. */
#define FMA_OPEN_ALL_MAX_CONTEXT 8192L

/* The deck's attention.fma.* section as fma/ takes it. */
static struct fma_options fma_options_read(const struct config *cfg) {
  const struct config_attention *at = &cfg->attention;
  return (struct fma_options){.m = at->fma_m,
                              .p = at->fma_p,
                              .down = at->fma_downsample,
                              .init = at->fma_init,
                              .down_lr = at->fma_down_lr,
                              .linear_zero_values = at->fma_linear_zero_values,
                              .multiplicity = at->fma_multiplicity,
                              .open = at->fma_open};
}

/* The head size the parameters are described for. */
static long fma_head_dim(const struct config *cfg) { return cfg->model.dim / cfg->model.heads; }

/* fma's rules (SPEC §6.4): n = m·2^k with k ≥ 1, whole fine blocks per slab, and conv
 * parameters that fit (they grow like d·p·n per layer). p dividing m is the deck's own rule: every
 * variant's diagnostics use the fma.m tree. */
static bool fma_check(const struct config *cfg, long n, int seq_ranks, struct attn_refusal *r) {
  const struct fma_options opt = fma_options_read(cfg);
  const int m = opt.m, p = opt.p;
  const char *name = cfg->attention.variant;
  if (!fma_tree_exact(n, m, p))
    return attention_refuse(r, "attention.variant model.context attention.fma.m",
                            "attention.variant = %s needs model.context / attention.fma.m to be a "
                            "power of two >= 2, but model.context = %ld and attention.fma.m = %d",
                            name, n, m);
  if (seq_ranks > 1 && (n / seq_ranks) % m != 0)
    return attention_refuse(
        r, "parallel.seq_ranks attention.fma.m",
        "attention.variant = %s with parallel.seq_ranks = %d: each rank's slab (model.context / "
        "seq_ranks = %ld / %d) must be a whole number of fine blocks of fma.m = %d tokens",
        name, seq_ranks, n, seq_ranks, m);
  if (opt.open != 0 && strcmp(name, "fma_linear") == 0)
    return attention_refuse(r, "attention.variant attention.fma.open",
                            "attention.fma.open opens far windows of fma's single softmax; "
                            "fma_linear normalises each level on its own and has no opening: set "
                            "attention.fma.open = 0 or attention.variant = fma");
  if (opt.open == FMA_OPEN_ALL && n > FMA_OPEN_ALL_MAX_CONTEXT)
    return attention_refuse(r, "attention.fma.open model.context",
                            "attention.fma.open = all opens every window: it is exact attention "
                            "at O(n^2) cost, a check for contexts up to %ld (model.context = %ld); "
                            "use attention.variant = full, or an integer fma.open",
                            FMA_OPEN_ALL_MAX_CONTEXT, n);
  if (opt.down == FMA_DOWN_CONV) {
    const long d = fma_head_dim(cfg);
    const double floats = 2.0 * (double)d * p * (double)(n / 2 - m / 2);
    if (floats > (double)FMA_CONV_MAX_FLOATS)
      return attention_refuse(r, "attention.fma.downsample model.context",
                              "fma.downsample = conv needs %.0f parameters per layer at context "
                              "%ld (they grow like d·p·n); use fma.downsample = m2m, which scales "
                              "to 1M tokens",
                              floats, n);
  }
  return false;
}

/* conv summaries that would not fit become m2m (SPEC §6.4: m2m is the one that scales). */
static bool fma_fallback(struct config *cfg) {
  if (cfg->attention.fma_downsample != FMA_DOWN_CONV) return false;
  cfg->attention.fma_downsample = FMA_DOWN_M2M;
  return true;
}

static const char *fma_option_label(const struct config *cfg) {
  return config_downsample_name(fma_options_read(cfg).down);
}

static void fma_describe_params(const struct config *cfg, long n, struct param_list *list) {
  const struct fma_options opt = fma_options_read(cfg);
  fma_params_describe(&opt, n, fma_head_dim(cfg), false, list);
}

static void fma_linear_describe_params(const struct config *cfg, long n, struct param_list *list) {
  const struct fma_options opt = fma_options_read(cfg);
  fma_params_describe(&opt, n, fma_head_dim(cfg), true, list);
}

static void fma_init_params(const struct config *cfg, const struct param_desc *p, float *data) {
  const struct fma_options opt = fma_options_read(cfg);
  fma_params_init(&opt, cfg->run.seed, false, p, data);
}

static void fma_linear_init_params(const struct config *cfg, const struct param_desc *p,
                                   float *data) {
  const struct fma_options opt = fma_options_read(cfg);
  fma_params_init(&opt, cfg->run.seed, true, p, data);
}

static void *setup_common(const struct config *cfg, const struct attn_dims *dims, bool linear) {
  const struct fma_options opt = fma_options_read(cfg);
  return fma_state_create(&opt, dims->n, dims->d, dims->causal, linear, dims->t0, dims->T);
}

static void *fma_setup(const struct config *cfg, const struct attn_dims *dims) {
  return setup_common(cfg, dims, false);
}

static void *fma_linear_setup(const struct config *cfg, const struct attn_dims *dims) {
  return setup_common(cfg, dims, true);
}

static void fma_teardown(void *state) { fma_state_free(state); }

/* lse (BH, T); fma_linear's far lse (BH, rows); fma.open's decisions (BH, T, ndec) as int32. */
static size_t fma_saved_floats(const struct attn_ctx *ctx) {
  const struct fma_state *st = ctx->state;
  const size_t BH = (size_t)(ctx->dims.B * ctx->dims.H);
  _Static_assert(sizeof(int32_t) == sizeof(float), "decisions are saved in float slots");
  return BH * (size_t)ctx->dims.T + (st->linear ? BH * (size_t)st->rows : 0) +
         BH * (size_t)ctx->dims.T * (size_t)st->open.ndec;
}

/* ---------------------------------------------------------------------------------------------
 * timing across threads: each thread keeps its own, the sums go to the global timers */

static void add_times(const struct fma_times *t) {
  timer_add_ms(TIMER_P2P, 1e3 * t->p2p);
  timer_add_ms(TIMER_M2P, 1e3 * t->m2p);
  timer_add_ms(TIMER_P2M, 1e3 * t->p2m);
  timer_add_ms(TIMER_M2M, 1e3 * t->m2m);
}

static void merge_times(struct fma_times *into, const struct fma_times *t) {
#pragma omp critical(fma_times)
  {
    into->p2p += t->p2p;
    into->m2p += t->m2p;
    into->p2m += t->p2m;
    into->m2m += t->m2m;
  }
}

static int nsets(const struct fma_state *st) { return st->linear ? 3 : 2; }

/* The summary rows this rank's query blocks list (windows times p, every level but those a
 * helper evaluates: fma/balance.h): the far field's work per head, by which a sampled simulation
 * charges it (simsample.h) and the FLOPs count it. */
static double far_rows(const struct fma_state *st) {
  const struct fma_tree *tr = &st->tree;
  long windows[FMA_LIST_MAX];
  double rows = 0.0;
  for (long b = st->t0 / tr->m; b < (st->t0 + st->T) / tr->m; b++)
    for (int l = 1; l <= (b >= st->far_cut ? st->far_top : tr->levels); l++)
      rows +=
          (double)fma_lists_level(tr, st->causal, l, b * tr->m / tr->window[l], windows) * tr->p;
  return rows;
}

/* Everything evaluate reads, for `count` heads: the summaries of every set (under sequence
 * parallelism, completed and fetched by the locally essential tree) and the keys and values from
 * global row st->klo (the slab itself, or a copy with the near-field halo). */
struct fma_inputs {
  struct fma_down_weights w[FMA_NSETS];
  float *X[FMA_NSETS]; /* (count, rows, d) */
  const float *k, *v;  /* (count, kstride, d) */
  float *kext, *vext;  /* the halo copies, when there are any */
  long kstride;
  struct fma_let_fetch fetch; /* the LET's summaries in flight, when overlapped */
};

/* Under sequence parallelism: the near field's halo (keys and values in one exchange) posted
 * first and completed last, the upward pass and the LET's spanning exchange in between.
 * overlap: leave the fetch of the listed summaries in flight (in->fetch) for the near field to
 * hide; fma_let_fetch_finish completes it before the far field. */
static void prepare(struct attn_ctx *ctx, struct fma_inputs *in, const float *q, const float *k,
                    const float *v, const float *params, long count, bool overlap,
                    struct fma_times *times) {
  struct fma_state *st = ctx->state;
  const long T = st->T, d = st->d, rows = st->rows;
  if (ctx->comm && ctx->comm->S > 1 && !st->let) { /* planned once per layer */
    st->let = fma_let_plan(st, ctx->comm);
    if (ctx->comm->balance) st->let->bal = fma_balance_plan(st);
    st->klo = st->let->near.lo;
  }
  memset(in, 0, sizeof *in);
  in->k = k;
  in->v = v;
  in->kstride = T;
  /* the near field's halo, posted first: the upward pass hides it */
  struct halo_exchange near = {0};
  if (st->let) {
    const struct halo *h = &st->let->near;
    in->kstride = h->hi - h->lo;
    in->kext = mem_alloc(MEM_WORKSPACE, sizeof(float) * (size_t)(count * in->kstride * d + 1));
    in->vext = mem_alloc(MEM_WORKSPACE, sizeof(float) * (size_t)(count * in->kstride * d + 1));
    float *ext[2] = {in->kext, in->vext};
    const float *slab[2] = {k, v};
    halo_gather_start(h, ctx->comm, &near, ext, slab, 2, count, d);
    in->k = in->kext;
    in->v = in->vext;
  }
  const float *src[FMA_NSETS] = {k, v, q};
  for (int s = 0; s < nsets(st); s++) {
    fma_weights_load(st, params, (enum fma_set)s, &in->w[s]);
    in->X[s] = mem_alloc(MEM_WORKSPACE, sizeof(float) * (size_t)(count * rows * d + 1));
    float *X = in->X[s];
    const struct fma_down_weights *w = &in->w[s];
    struct sim_sample smp;
    if (!sim_sample_begin(&smp, "fma upward", (double)count)) {
      times->p2m += smp.charged;
      continue;
    }
#pragma omp parallel
    {
      struct fma_times t = {0};
#pragma omp for schedule(dynamic, 1)
      for (long h = 0; h < count; h++)
        fma_upward_pass(st, X + h * rows * d, src[s] + h * T * d, w, &t);
      merge_times(times, &t);
    }
    sim_sample_end(&smp);
  }
  if (st->let) {
    fma_let_upward(st, ctx->comm, in->X, nsets(st), count, in->w, times,
                   overlap && ctx->comm->overlap ? &in->fetch : NULL);
    halo_finish(&near);
  }
}

static void release(const struct fma_state *st, struct fma_inputs *in) {
  for (int s = 0; s < nsets(st); s++) {
    fma_weights_free(st, &in->w[s]);
    mem_free(in->X[s]);
  }
  mem_free(in->kext);
  mem_free(in->vext);
}

/* What a forward followed at once by its backward (attn_ctx.backward_next: the recomputation)
 * keeps for it: prepare's result, for the same q, k, v and parameters — one upward pass, LET and
 * halo per layer fewer, the same bits. The CPU implementation's state. */
struct fma_kept {
  const struct fma_state *st;
  bool valid;
  const float *q, *k, *v, *params;
  struct fma_inputs in;
};

static void *fma_cpu_open(const struct attn_ctx *ctx) {
  struct fma_state *st = ctx->state;
  if (st->open.K == 0) fma_state_compact(st); /* O(n/S) summary rows; one rank: every window */
  struct fma_kept *kept = xcalloc(1, sizeof *kept);
  kept->st = st;
  return kept;
}

static void forget(struct fma_kept *kept) {
  if (kept->valid) release(kept->st, &kept->in);
  kept->valid = false;
}

static void fma_cpu_close(void *impl_state) {
  if (!impl_state) return;
  forget(impl_state);
  free(impl_state);
}

/* prepare's result for backward: what forward kept for these inputs, or prepared again. */
static void prepare_backward(struct attn_ctx *ctx, struct fma_inputs *in, const float *q,
                             const float *k, const float *v, const float *params, long count,
                             bool overlap, struct fma_times *times) {
  struct fma_kept *kept = ctx->impl_state;
  if (!kept) {
    prepare(ctx, in, q, k, v, params, count, overlap, times);
    return;
  }
  if (kept->valid && kept->q == q && kept->k == k && kept->v == v && kept->params == params) {
    *in = kept->in;
    kept->valid = false;
    return;
  }
  forget(kept);
  prepare(ctx, in, q, k, v, params, count, overlap, times);
}

/* The end of forward: keep in for the backward that follows (attn_ctx.backward_next), or free it.
 */
static void keep_or_release(struct attn_ctx *ctx, struct fma_inputs *in, const float *q,
                            const float *k, const float *v, const float *params) {
  struct fma_kept *kept = ctx->impl_state;
  if (kept) forget(kept);
  if (!kept || !ctx->backward_next) {
    release(ctx->state, in);
    return;
  }
  *kept = (struct fma_kept){ctx->state, true, q, k, v, params, *in};
}

/* ---------------------------------------------------------------------------------------------
 * fma.open: the opening pass and its evaluation (fma/open.h), a group of heads at a time: every
 * head at once under sequence parallelism, so that each level's exchange carries them all;
 * otherwise as many heads as threads, which bounds the far rows' memory. */

static long open_group(const struct attn_ctx *ctx, long count) {
  if (ctx->comm && ctx->comm->S > 1) return count;
#ifdef _OPENMP
  const long g = omp_get_max_threads();
#else
  const long g = 1;
#endif
  return g < count ? g : count;
}

/* The opening's view of heads [h0, h0 + count) of what prepare left. */
static struct fma_open_args open_args(const struct attn_ctx *ctx, const struct fma_inputs *in,
                                      const float *q, int32_t *dec, long h0, long count) {
  const struct fma_state *st = ctx->state;
  const long T = st->T, d = st->d, ks = in->kstride, rows = st->rows;
  return (struct fma_open_args){.count = count,
                                .q = q + h0 * T * d,
                                .k = in->k + h0 * ks * d,
                                .v = in->v + h0 * ks * d,
                                .K = in->X[FMA_K] + h0 * rows * d,
                                .V = in->X[FMA_V] + h0 * rows * d,
                                .kstride = ks,
                                .dec = dec + h0 * T * st->open.ndec,
                                .comm = ctx->comm};
}

/* out, lse and the decisions dec (BH, T, ndec) of BH heads; mass, entropy and diag (per head) as
 * fma_open_forward's, or NULL. */
static void open_forward(struct attn_ctx *ctx, float *out, float *lse, int32_t *dec, const float *q,
                         const struct fma_inputs *in, long BH, struct fma_times *times,
                         double *mass, double *entropy, const struct fma_open_diag *diag) {
  struct fma_state *st = ctx->state;
  const long T = st->T, d = st->d, G = open_group(ctx, BH), bands = st->tree.levels + 1;
  for (long h0 = 0; h0 < BH; h0 += G) {
    const long count = BH - h0 < G ? BH - h0 : G;
    struct fma_open_work *w = fma_open_work_get(st, G);
    const struct fma_open_args a = open_args(ctx, in, q, dec, h0, count);
    fma_open_descend(st, w, &a, times);
    fma_open_forward(st, w, &a, out + h0 * T * d, lse + h0 * T, times,
                     mass ? mass + h0 * bands : NULL, entropy ? entropy + h0 : NULL,
                     diag ? diag + h0 : NULL);
  }
}

/* dq and the gradients of the keys, values and summaries evaluate read (dk, dv as in->k, in->v;
 * dK, dV (BH, rows, d)) += for dout, from the decisions forward saved. */
static void open_backward(struct attn_ctx *ctx, const struct fma_inputs *in, float *dq, float *dk,
                          float *dv, float *dK, float *dV, const float *dout, const float *D,
                          const float *q, const float *lse, const int32_t *dec, long BH,
                          struct fma_times *times) {
  struct fma_state *st = ctx->state;
  const long T = st->T, d = st->d, ks = in->kstride, rows = st->rows, G = open_group(ctx, BH);
  for (long h0 = 0; h0 < BH; h0 += G) {
    const long count = BH - h0 < G ? BH - h0 : G;
    struct fma_open_work *w = fma_open_work_get(st, G);
    const struct fma_open_args a = open_args(ctx, in, q, (int32_t *)dec, h0, count);
    const struct fma_open_grads g = {dq + h0 * T * d, dk + h0 * ks * d, dv + h0 * ks * d,
                                     dK + h0 * rows * d, dV + h0 * rows * d};
    fma_open_rescore(st, w, &a, times);
    fma_open_backward(st, w, &a, &g, dout + h0 * T * d, D + h0 * T, lse + h0 * T, times);
    if (st->let) fma_open_let_return(st, w, &a, &g);
  }
}

/* fma's evaluation of every (batch, head) and chunk of query blocks: the near field while the
 * LET's fetch is in flight, then the far field. */
static void evaluate_forward(const struct fma_state *st, struct comm *c, struct fma_inputs *in,
                             float *out, float *lse, const float *q, long BH,
                             struct fma_times *times) {
  const long T = st->T, d = st->d, rows = st->rows, ks = in->kstride;
  const long b0 = st->t0 / st->tree.m, nblocks = T / st->tree.m;
  const long chunks = (nblocks + FMA_CHUNK - 1) / FMA_CHUNK;
  const bool bal = st->let && st->let->bal;
  struct fma_balance_xfer qx = {0}, px = {0};
  if (bal) fma_balance_forward_start(st, c, q, BH, &qx); /* the given blocks' queries */
  for (int far = 0; far <= 1; far++) {
    if (far) fma_let_fetch_finish(st, &in->fetch, times);
    if (far && bal) /* the taken blocks' parts first: their owners wait for them */
      fma_balance_forward_serve(st, in->X[FMA_K], in->X[FMA_V], BH, &qx, &px, times);
    struct sim_sample smp;
    if (!sim_sample_begin(&smp, far ? "fma far forward" : "fma near forward",
                          far && sim_sampling() ? (double)BH * far_rows(st) : (double)BH)) {
      *(far ? &times->m2p : &times->p2p) += smp.charged;
      continue;
    }
#pragma omp parallel
    {
      struct fma_times t = {0};
#pragma omp for schedule(dynamic, 1) collapse(2)
      for (long bh = 0; bh < BH; bh++)
        for (long ch = 0; ch < chunks; ch++) {
          const long c0 = b0 + ch * FMA_CHUNK;
          const long c1 = c0 + FMA_CHUNK < b0 + nblocks ? c0 + FMA_CHUNK : b0 + nblocks;
          if (far)
            fma_evaluate_far_forward(st, out + bh * T * d, lse + bh * T, q + bh * T * d,
                                     in->X[FMA_K] + bh * rows * d, in->X[FMA_V] + bh * rows * d, c0,
                                     c1, &t);
          else
            fma_evaluate_near_forward(st, out + bh * T * d, lse + bh * T, q + bh * T * d,
                                      in->k + bh * ks * d, in->v + bh * ks * d, c0, c1, &t);
        }
      merge_times(times, &t);
    }
    sim_sample_end(&smp);
  }
  if (bal) fma_balance_forward_finish(st, out, lse, BH, &px);
}

static void fma_forward(struct attn_ctx *ctx, float *out, float *saved, const float *q,
                        const float *k, const float *v, const float *params) {
  const struct fma_state *st = ctx->state;
  const long BH = ctx->dims.B * ctx->dims.H, T = st->T, d = st->d, rows = st->rows;
  const bool plain = !st->linear && st->open.K == 0;
  struct fma_times times = {0};
  struct fma_inputs in;
  prepare(ctx, &in, q, k, v, params, BH, plain, &times);
  const long ks = in.kstride;
  float *lse = saved, *lse_far = saved + BH * T;
  if (st->open.K != 0) {
    open_forward(ctx, out, lse, (int32_t *)(saved + BH * T), q, &in, BH, &times, NULL, NULL, NULL);
  } else if (st->linear) {
#pragma omp parallel
    {
      struct fma_times t = {0};
#pragma omp for schedule(dynamic, 1)
      for (long bh = 0; bh < BH; bh++)
        fma_linear_forward(st, out + bh * T * d, lse + bh * T, lse_far + bh * rows, q + bh * T * d,
                           in.k + bh * ks * d, in.v + bh * ks * d, in.X[FMA_Q] + bh * rows * d,
                           in.X[FMA_K] + bh * rows * d, in.X[FMA_V] + bh * rows * d, &t, NULL,
                           NULL);
      merge_times(&times, &t);
    }
  } else {
    evaluate_forward(st, ctx->comm, &in, out, lse, q, BH, &times);
  }
  keep_or_release(ctx, &in, q, k, v, params);
  add_times(&times);
}

/* D (rows) = dout·out per row: the softmax transpose's correction (fma). */
static void rows_dot(float *D, const float *dout, const float *out, long rows, long d) {
#pragma omp parallel for schedule(static)
  for (long r = 0; r < rows; r++) {
    float acc = 0.0f;
    for (long f = 0; f < d; f++) acc += dout[r * d + f] * out[r * d + f];
    D[r] = acc;
  }
}

/* The transpose of the upward pass for every (batch, head) and set — dX (BH, rows, d) consumed
 * into dsrc (BH, T, d): dk, dv, dq — then the summary-parameter gradients, summed over every
 * (batch, head) in a fixed order (dparams NULL: none). Frees dX. */
static void upward_backward(const struct fma_state *st, const struct fma_inputs *in,
                            float *const *dsrc, const float *const *src, float *const *dX,
                            float *dparams, long BH, struct fma_times *times) {
  const long T = st->T, d = st->d, rows = st->rows;
  struct sim_sample smp;
  const bool run = sim_sample_begin(&smp, "fma upward backward", (double)BH);
  if (run) {
#pragma omp parallel
    {
      struct fma_times t = {0};
#pragma omp for schedule(dynamic, 1)
      for (long bh = 0; bh < BH; bh++)
        for (int s = 0; s < nsets(st); s++)
          fma_upward_pass_backward(st, dsrc[s] + bh * T * d, dX[s] + bh * rows * d, &in->w[s], &t);
      merge_times(times, &t);
    }
  }
  double t0 = timer_now();
  for (int s = 0; s < nsets(st); s++) {
    if (run && dparams && st->down != FMA_DOWN_AVG) {
      struct fma_down_weights dw;
      fma_weights_zero(st, &dw);
      fma_upward_param_grads(st, &dw, src[s], in->X[s], dX[s], BH);
      fma_weights_store_grad(st, dparams, (enum fma_set)s, &dw);
      fma_weights_free(st, &dw);
    }
    mem_free(dX[s]);
  }
  if (run) sim_sample_end(&smp);
  times->p2m += timer_now() - t0 + smp.charged;
}

/* evaluate's transposes for every (batch, head), one per task so that scattered updates never
 * race: dq, dk, dv (as in->k, in->v) and dX (the summaries' gradients) += for dout. fma runs the
 * near field for every head while the LET's fetch is in flight, then the far field. */
static void evaluate_backward(const struct fma_state *st, struct comm *c, struct fma_inputs *in,
                              float *dq, float *dkx, float *dvx, float *const *dX,
                              const float *dout, const float *out, const float *q, const float *D,
                              const float *lse, const float *lse_far, long BH,
                              struct fma_times *times) {
  const long T = st->T, d = st->d, rows = st->rows, ks = in->kstride;
  const bool bal = st->let && st->let->bal;
  struct fma_balance_xfer qx = {0}, px = {0};
  if (bal) fma_balance_backward_start(st, c, q, dout, D, lse, BH, &qx);
  for (int far = 0; far <= (st->linear ? 0 : 1); far++) {
    if (far) fma_let_fetch_finish(st, &in->fetch, times);
    if (far && bal)
      fma_balance_backward_serve(st, in->X[FMA_K], in->X[FMA_V], dX[FMA_K], dX[FMA_V], BH, &qx, &px,
                                 times);
    struct sim_sample smp;
    if (!st->linear &&
        !sim_sample_begin(&smp, far ? "fma far backward" : "fma near backward",
                          far && sim_sampling() ? (double)BH * far_rows(st) : (double)BH)) {
      *(far ? &times->m2p : &times->p2p) += smp.charged;
      continue;
    }
#pragma omp parallel
    {
      struct fma_times t = {0};
#pragma omp for schedule(dynamic, 1)
      for (long bh = 0; bh < BH; bh++) {
        const long o = bh * T * d, os = bh * rows * d, ok = bh * ks * d;
        if (st->linear)
          fma_linear_backward(st, dq + o, dkx + ok, dvx + ok, dX[FMA_Q] + os, dX[FMA_K] + os,
                              dX[FMA_V] + os, dout + o, out + o, q + o, in->k + ok, in->v + ok,
                              in->X[FMA_Q] + os, in->X[FMA_K] + os, in->X[FMA_V] + os, lse + bh * T,
                              lse_far + bh * rows, &t);
        else if (far)
          fma_evaluate_far_backward(st, dq + o, dX[FMA_K] + os, dX[FMA_V] + os, dout + o,
                                    D + bh * T, q + o, in->X[FMA_K] + os, in->X[FMA_V] + os,
                                    lse + bh * T, &t);
        else
          fma_evaluate_near_backward(st, dq + o, dkx + ok, dvx + ok, dout + o, D + bh * T, q + o,
                                     in->k + ok, in->v + ok, lse + bh * T, &t);
      }
      merge_times(times, &t);
    }
    if (!st->linear) sim_sample_end(&smp);
  }
  if (bal) fma_balance_backward_finish(st, dq, BH, &px);
}

static void fma_backward(struct attn_ctx *ctx, float *dq, float *dk, float *dv, float *dparams,
                         const float *dout, const float *q, const float *k, const float *v,
                         const float *params, const float *out, const float *saved) {
  const struct fma_state *st = ctx->state;
  const long BH = ctx->dims.B * ctx->dims.H, T = st->T, d = st->d, rows = st->rows;
  const float *src[FMA_NSETS] = {k, v, q};
  float *dsrc[FMA_NSETS] = {dk, dv, dq};
  struct fma_times times = {0};
  struct fma_inputs in;
  prepare_backward(ctx, &in, q, k, v, params, BH, !st->linear && st->open.K == 0, &times);
  const long ks = in.kstride;
  float *dX[FMA_NSETS] = {NULL, NULL, NULL};
  for (int s = 0; s < nsets(st); s++)
    dX[s] = mem_alloc(MEM_WORKSPACE, sizeof(float) * (size_t)(BH * rows * d + 1));
  /* gradients of the keys and values evaluate read: the slab, or the halo copies */
  float *dkx = dk, *dvx = dv;
  if (st->let) {
    dkx = mem_alloc(MEM_WORKSPACE, sizeof(float) * (size_t)(BH * ks * d + 1));
    dvx = mem_alloc(MEM_WORKSPACE, sizeof(float) * (size_t)(BH * ks * d + 1));
  }
  const float *lse = saved, *lse_far = saved + BH * T;
  float *D = st->linear ? NULL : mem_alloc(MEM_WORKSPACE, sizeof(float) * (size_t)(BH * T));
  if (D) rows_dot(D, dout, out, BH * T, d);
  if (st->open.K != 0)
    open_backward(ctx, &in, dq, dkx, dvx, dX[FMA_K], dX[FMA_V], dout, D, q, lse,
                  (const int32_t *)(saved + BH * T), BH, &times);
  else
    evaluate_backward(st, ctx->comm, &in, dq, dkx, dvx, dX, dout, out, q, D, lse, lse_far, BH,
                      &times);
  if (st->let) { /* the transposes of the exchanges, then of the local upward pass */
    float *slab[2] = {dk, dv};
    const float *ext[2] = {dkx, dvx};
    halo_scatter_add_arrays(&st->let->near, ctx->comm, slab, ext, 2, BH, d);
    fma_let_upward_backward(st, ctx->comm, (const float *const *)in.X, dX, nsets(st), BH, in.w,
                            &times);
  }
  upward_backward(st, &in, dsrc, src, dX, dparams, BH, &times);
  if (st->let) {
    mem_free(dkx);
    mem_free(dvx);
  }
  mem_free(D);
  release(st, &in);
  add_times(&times);
}

/* ---------------------------------------------------------------------------------------------
 * diagnostics and FLOPs */

/* fma.open's diagnostics of `count` heads: the forward with its decisions kept in the work, mass
 * and entropy per head as fma_evaluate_forward's, and ctx->open_diag's when the caller asks. */
static void open_diagnostics(struct attn_ctx *ctx, const struct fma_inputs *in, const float *q,
                             long count, double *mass, double *entropy, struct fma_times *times) {
  struct fma_state *st = ctx->state;
  const long T = st->T, d = st->d, L = st->tree.levels;
  struct fma_open_work *w = fma_open_work_get(st, open_group(ctx, count));
  int32_t *dec =
      mem_alloc(MEM_WORKSPACE, sizeof(int32_t) * (size_t)(count * T * st->open.ndec + 1));
  float *out = mem_alloc(MEM_WORKSPACE, sizeof(float) * (size_t)(count * T * d));
  float *lse = mem_alloc(MEM_WORKSPACE, sizeof(float) * (size_t)(count * T));
  double *opened = xcalloc((size_t)(count * (L + 1)), sizeof(double));
  double *open_mass = xcalloc((size_t)count, sizeof(double));
  struct fma_open_diag *diag = xcalloc((size_t)count, sizeof *diag);
  for (long h = 0; h < count; h++)
    diag[h] = (struct fma_open_diag){open_mass + h, opened + h * (L + 1)};
  open_forward(ctx, out, lse, dec, q, in, count, times, mass, entropy, diag);
  const struct attn_open_diag *want = &ctx->open_diag;
  for (long h = 0; h < count; h++) {
    if (want->open_mass) want->open_mass[h] += open_mass[h];
    for (long l = 1; want->opened && l <= L; l++) want->opened[l] += opened[h * (L + 1) + l];
  }
  (void)w;
  free(diag);
  free(open_mass);
  free(opened);
  mem_free(dec);
  mem_free(out);
  mem_free(lse);
}

static long fma_diagnostics(struct attn_ctx *ctx, double *mass, double *entropy, const float *q,
                            const float *k, const float *v, const float *params) {
  const struct fma_state *st = ctx->state;
  long H = ctx->dims.H;
  const long T = st->T, d = st->d, rows = st->rows;
  const int bands = st->tree.levels + 1;
  struct fma_times times = {0};
  struct fma_inputs in;
  prepare(ctx, &in, q, k, v, params, H, false, &times); /* batch element 0: its H heads first */
  const long ks = in.kstride;
  float *out = mem_alloc(MEM_WORKSPACE, sizeof(float) * (size_t)(T * d));
  float *lse = mem_alloc(MEM_WORKSPACE, sizeof(float) * (size_t)(T + rows));
  float *norms = st->linear ? mem_alloc(MEM_WORKSPACE, sizeof(float) * (size_t)(T * bands)) : NULL;
  if (st->open.K != 0) {
    open_diagnostics(ctx, &in, q, H, mass, entropy, &times);
    H = 0; /* done */
  }
  for (long h = 0; h < H; h++) {
    const long o = h * T * d, os = h * rows * d, ok = h * ks * d;
    if (st->linear) {
      fma_linear_forward(st, out, lse, lse + T, q + o, in.k + ok, in.v + ok, in.X[FMA_Q] + os,
                         in.X[FMA_K] + os, in.X[FMA_V] + os, &times, norms, entropy + h);
      for (long i = 0; i < T; i++) {
        double total = 0.0;
        for (int b = 0; b < bands; b++) total += norms[i * bands + b];
        for (int b = 0; b < bands && total > 0; b++)
          mass[h * bands + b] += norms[i * bands + b] / total;
      }
    } else {
      const long b0 = st->t0 / st->tree.m;
      fma_evaluate_forward(st, out, lse, q + o, in.k + ok, in.v + ok, in.X[FMA_K] + os,
                           in.X[FMA_V] + os, b0, b0 + T / st->tree.m, &times, mass + h * bands,
                           entropy + h);
    }
  }
  release(st, &in);
  mem_free(out);
  mem_free(lse);
  mem_free(norms);
  return T;
}

/* Forward FLOPs of this rank's share: 4·d per (query, key) pair the lists allow for its queries
 * (scores and values; with fma.open every column of the far row's slots), plus its upward pass.
 * *p2p_flops: its near-field GEMMs as executed (whole blocks, masked entries included). */
static double fma_flops(const struct attn_ctx *ctx, double *p2p_flops) {
  const struct fma_state *st = ctx->state;
  const struct fma_tree *tr = &st->tree;
  const double BH = (double)(ctx->dims.B * ctx->dims.H), d = (double)st->d, m = tr->m;
  const double share = (double)st->T / (double)tr->n; /* of the upward pass's work */
  double near_pairs = 0.0, near_exec = 0.0, far = 0.0;
  long blocks[FMA_LIST_MAX], windows[FMA_LIST_MAX];
  for (long b = st->t0 / tr->m; b < (st->t0 + st->T) / tr->m; b++) {
    int cnt = fma_lists_near(tr, st->causal, b, blocks);
    near_exec += m * m * cnt;
    near_pairs += st->causal ? m * m * (cnt - 1) + m * (m + 1) / 2 : m * m * cnt;
    /* fma.open: every slot of the far row as if used (the opened windows' children and fine
     * blocks; random inputs fill nearly all) — what the opening executes, an upper bound of the
     * pairs a query's softmax keeps */
    far += m * (double)(st->open.width - st->open.listed);
  }
  double up = 0.0;
  for (int l = 1; l <= tr->levels; l++) {
    double summaries = (double)tr->nwindows[l] * tr->p;
    if (st->down == FMA_DOWN_AVG)
      up += (double)tr->n;
    else if (st->down == FMA_DOWN_M2M && l > 1)
      up += 2.0 * summaries * 2 * tr->p;
    else
      up += 2.0 * (double)tr->n * tr->p;
  }
  if (st->linear) /* each query sub-segment against its list, per level, shared by the ranks */
    for (int l = 1; l <= tr->levels; l++)
      for (long rho = 0; rho < tr->nwindows[l] * tr->p; rho++) {
        int nw = fma_lists_level(tr, st->causal, l, rho / tr->p, windows);
        far += (double)nw * tr->p * share;
      }
  if (!st->linear)
    far += m * (far_rows(st) + (st->let && st->let->bal ? st->let->bal->rows_in : 0));
  *p2p_flops = 4.0 * d * near_exec * BH;
  return BH * (4.0 * d * (near_pairs + far) + up * share * d * nsets(st));
}

static bool fma_opens(const struct config *cfg) { return fma_options_read(cfg).open != 0; }

static void *fma_decode_open_ops(const struct attn_ctx *ctx, const float *params) {
  return fma_decode_open(ctx->state, params, ctx->dims.H);
}

static void fma_decode_step_ops(struct attn_ctx *ctx, void *cache, float *out, const float *q,
                                const float *k, const float *v, long pos, const float *params) {
  fma_decode_step(cache, out, q, k, v, pos);
}

static void fma_decode_close_ops(void *cache) { fma_decode_close(cache); }

struct attn_variant attention_fma = {
    .name = "fma",
    .fallback = fma_fallback,
    .option_label = fma_option_label,
    .decode_open = fma_decode_open_ops,
    .decode_step = fma_decode_step_ops,
    .decode_close = fma_decode_close_ops,
    .causal_ok = true,
    .bidir_ok = true,
    .check = fma_check,
    .describe = fma_describe_params,
    .init_param = fma_init_params,
    .setup = fma_setup,
    .teardown = fma_teardown,
    .diagnostics = fma_diagnostics,
    .opens = fma_opens,
    .flops = fma_flops,
    .cpu = {.open = fma_cpu_open,
            .close = fma_cpu_close,
            .saved_floats = fma_saved_floats,
            .forward = fma_forward,
            .backward = fma_backward},
};

struct attn_variant attention_fma_linear = {
    .name = "fma_linear",
    .keys_prefix = "fma",
    .fallback = fma_fallback,
    .option_label = fma_option_label,
    .causal_ok = true,
    .bidir_ok = true,
    .check = fma_check,
    .describe = fma_linear_describe_params,
    .init_param = fma_linear_init_params,
    .setup = fma_linear_setup,
    .teardown = fma_teardown,
    .diagnostics = fma_diagnostics,
    .flops = fma_flops,
    .cpu = {.open = fma_cpu_open,
            .close = fma_cpu_close,
            .saved_floats = fma_saved_floats,
            .forward = fma_forward,
            .backward = fma_backward},
};
