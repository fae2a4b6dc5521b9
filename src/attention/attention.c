/* The attention registry (deck/variants.h) and what variants share: the configuration checks, the
 * implementations by device, contexts, and the row-by-row diagnostics of exact variants, classified
 * by the FMA tree's distance bands so that `full` and `fma` report comparable level masses. */
#include "attention/attention.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "core/error.h"
#include "core/memory.h"
#include "deck/variants.h"
#include "fma/lists.h"

#define DECLARE(name) extern struct attn_variant attention_##name;
ATTENTION_REGISTRY(DECLARE)
#undef DECLARE
#define ENTRY(name) &attention_##name,
static struct attn_variant *const registry[] = {ATTENTION_REGISTRY(ENTRY)};
#undef ENTRY
#define NVARIANTS (sizeof registry / sizeof registry[0])

const struct attn_variant *attention_find(const char *name) {
  for (size_t i = 0; i < NVARIANTS; i++)
    if (strcmp(registry[i]->name, name) == 0) return registry[i];
  return NULL;
}

const struct attn_variant *attention_select(const struct config *cfg) {
  const struct attn_variant *v = attention_find(cfg->attention.variant);
  return v && cfg->attention.heads_mode == HEADS_FISH ? v->fish : v;
}

int attention_qk_heads(const struct config *cfg) {
  return cfg->attention.heads_mode == HEADS_FISH ? cfg->attention.fish_global_heads
                                                 : cfg->model.heads;
}

bool attention_refuse(struct attn_refusal *r, const char *keys, const char *fmt, ...) {
  snprintf(r->keys, sizeof r->keys, "%s", keys);
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(r->msg, sizeof r->msg, fmt, ap);
  va_end(ap);
  return true;
}

bool attention_refuses(const struct config *cfg, long n, int seq_ranks, struct attn_refusal *r) {
  const char *name = cfg->attention.variant;
  const struct attn_variant *v = attention_find(name);
  if (!v) /* the deck layer accepts registered names only */
    return attention_refuse(r, "attention.variant", "attention.variant = %s is unknown", name);
  if (cfg->attention.heads_mode == HEADS_FISH) {
    if (!v->fish)
      return attention_refuse(
          r, "attention.heads_mode attention.variant",
          "attention.heads_mode = fish composes with attention.variant = full or local, not %s "
          "(FiSH mixes the global heads' scores of every query-key pair; docs/nystrom_fish.md "
          "says why the other variants cannot)",
          name);
    v = v->fish;
  }
  /* the variant's own reasons first: they say more than the rules every variant shares */
  if (v->check && v->check(cfg, n, seq_ranks, r)) return true;
  const bool causal = cfg->model.objective == OBJECTIVE_CLM;
  if (causal && !v->causal_ok)
    return attention_refuse(r, "attention.variant model.objective",
                            "attention.variant = %s cannot run causally (model.objective = clm)",
                            name);
  if (!causal && !v->bidir_ok)
    return attention_refuse(
        r, "attention.variant model.objective",
        "attention.variant = %s cannot run bidirectionally (model.objective = mlm)", name);
  if (seq_ranks > 1 && n % seq_ranks != 0)
    return attention_refuse(r, "parallel.seq_ranks model.context",
                            "attention.variant = %s with parallel.seq_ranks = %d needs "
                            "model.context (%ld) divisible by parallel.seq_ranks",
                            name, seq_ranks, n);
  return false;
}

int attention_check(const struct config *cfg, long n, int seq_ranks, char *err, size_t len) {
  struct attn_refusal r;
  if (!attention_refuses(cfg, n, seq_ranks, &r)) return 0;
  snprintf(err, len, "%s", r.msg);
  return 1;
}

/* The bench sweep's configuration of one (variant, n): the deck with both replaced, and where
 * the variant refuses it, its fallback if that runs. */
static bool bench_refuses(const struct config *cfg, const char *variant, long n,
                          struct attn_refusal *r) {
  struct config c = *cfg;
  snprintf(c.attention.variant, sizeof c.attention.variant, "%s", variant);
  c.model.context = (int)n;
  if (!attention_refuses(&c, n, 1, r)) return false;
  const struct attn_variant *v = attention_find(variant);
  struct attn_refusal again;
  return !(v && v->fallback && v->fallback(&c) && !attention_refuses(&c, n, 1, &again));
}

bool attention_deck_rule(const struct config *cfg, char *keys, size_t keys_len, char *msg,
                         size_t msg_len) {
  struct attn_refusal r;
  if (attention_refuses(cfg, cfg->model.context, 1, &r)) {
    snprintf(keys, keys_len, "%s", r.keys);
    snprintf(msg, msg_len, "%s", r.msg);
    return true;
  }
  if (cfg->run.mode != MODE_BENCH) return false;
  /* a sweep refuses the lengths its variants cannot take (their refusals name model.context,
   * which bench.n_list stands for); what else a variant refuses skips its rows at run time */
  for (int v = 0; v < cfg->bench.variant_count; v++)
    for (int i = 0; i < cfg->bench.n_count; i++)
      if (bench_refuses(cfg, cfg->bench.variants[v], cfg->bench.n_list[i], &r) &&
          strstr(r.keys, "model.context")) {
        snprintf(keys, keys_len, "bench.n_list bench.variants");
        snprintf(msg, msg_len,
                 "bench.variants has %s, which cannot run at n = %ld of bench.n_list: %s",
                 cfg->bench.variants[v], cfg->bench.n_list[i], r.msg);
        return true;
      }
  return false;
}

void attention_register_impl(const char *name, enum device_kind dev, const struct attn_impl *impl) {
  for (size_t i = 0; i < NVARIANTS; i++) {
    if (strcmp(registry[i]->name, name) != 0) continue;
    if (dev == DEVICE_GPU)
      registry[i]->gpu = impl;
    else
      registry[i]->cpu = *impl;
    return;
  }
  error("a device back end registers an implementation of '%s', which is not a variant", name);
}

const struct attn_impl *attention_impl(const struct attn_variant *v, enum device_kind dev) {
  if (dev == DEVICE_GPU) return v->gpu;
  return v->cpu.forward ? &v->cpu : NULL;
}

int attention_impl_refuses(const struct attn_variant *v, enum device_kind dev,
                           const struct config *cfg, char *err, size_t len) {
  const struct attn_impl *impl = attention_impl(v, dev);
  struct attn_refusal r;
  if (!impl || !impl->refuses || !impl->refuses(cfg, &r)) return 0;
  snprintf(err, len, "%s", r.msg);
  return 1;
}

int attention_register_params(const struct config *cfg, const struct attn_variant *v, long n,
                              int layer, struct param_list *list) {
  if (!v->describe) return 0;
  struct param_list rel;
  param_list_init(&rel);
  v->describe(cfg, n, &rel);
  for (int i = 0; i < rel.count; i++) {
    const struct param_desc *p = &rel.p[i];
    char full[PARAM_NAME + 32];
    snprintf(full, sizeof full, "layer_%03d/attn/%s/%s", layer,
             v->params_name ? v->params_name : v->name, p->name);
    int k = param_list_add(list, full, p->ndim, p->shape, p->decay, p->init, p->std);
    list->p[k].layer = layer;
    list->p[k].owner = 1;
    list->p[k].lr_scale = p->lr_scale;
    if (p->frozen) param_list_freeze(list, k);
  }
  int added = rel.count;
  param_list_free(&rel);
  return added;
}

void attention_init_param(const struct config *cfg, const struct attn_variant *v,
                          const struct param_desc *p, float *data) {
  if (p->init != INIT_CUSTOM) {
    param_init(p, data, cfg->run.seed);
    return;
  }
  if (!v->init_param) error("%s: custom init without an init function", p->name);
  struct param_desc rel = *p;
  const char *s = strstr(p->name, "/attn/");
  if (s) s = strchr(s + 6, '/');
  snprintf(rel.name, sizeof rel.name, "%s", s ? s + 1 : p->name);
  v->init_param(cfg, &rel, data);
}

struct attn_ctx attention_open(const struct config *cfg, const struct attn_variant *v,
                               enum device_kind dev, struct comm *comm, int layer,
                               struct attn_dims dims) {
  struct attn_ctx ctx = {.variant = v, .dims = dims, .comm = comm, .layer = layer};
  ctx.opt = (struct attn_options){.diag_m = cfg->attention.fma_m,
                                  .diag_p = cfg->attention.fma_p,
                                  .diag_bands = attention_diag_bands(cfg, dims.n),
                                  .full_block = cfg->attention.full_block,
                                  .local_band = cfg->attention.local_band,
                                  .qk_heads = attention_qk_heads(cfg),
                                  .opens = v->opens && v->opens(cfg)};
  ctx.impl = attention_impl(v, dev);
  if (!ctx.impl) error("attention variant %s has no implementation on this device", v->name);
  ctx.state = v->setup ? v->setup(cfg, &ctx.dims) : NULL;
  ctx.impl_state = ctx.impl->open ? ctx.impl->open(&ctx) : NULL;
  return ctx;
}

void attention_close(struct attn_ctx *ctx) {
  if (ctx->impl->close) ctx->impl->close(ctx->impl_state);
  if (ctx->variant->teardown) ctx->variant->teardown(ctx->state);
  ctx->state = ctx->impl_state = NULL;
}

bool attention_takes_rows(const struct attn_ctx *ctx) {
  return ctx->impl->takes_rows && ctx->impl->takes_rows(ctx);
}

size_t attention_saved_floats(const struct attn_ctx *ctx) {
  return ctx->impl->saved_floats ? ctx->impl->saved_floats(ctx) : 0;
}

void attention_forward(struct attn_ctx *ctx, float *out, float *saved, const float *q,
                       const float *k, const float *v, const float *params) {
  ctx->impl->forward(ctx, out, saved, q, k, v, params);
}

void attention_backward(struct attn_ctx *ctx, float *dq, float *dk, float *dv, float *dparams,
                        const float *dout, const float *q, const float *k, const float *v,
                        const float *params, const float *out, const float *saved) {
  ctx->impl->backward(ctx, dq, dk, dv, dparams, dout, q, k, v, params, out, saved);
}

void attention_params_make(struct attn_params *ap, const struct config *cfg,
                           const struct attn_variant *v, long n) {
  param_list_init(&ap->list);
  attention_register_params(cfg, v, n, 0, &ap->list);
  ap->params = mem_alloc(MEM_PARAMS, sizeof(float) * (ap->list.total + 1));
  ap->dparams = mem_alloc(MEM_GRADS, sizeof(float) * (ap->list.total + 1));
  for (int i = 0; i < ap->list.count; i++)
    attention_init_param(cfg, v, &ap->list.p[i], ap->params + ap->list.p[i].offset);
}

void attention_params_free(struct attn_params *ap) {
  mem_free(ap->params);
  mem_free(ap->dparams);
  param_list_free(&ap->list);
}

int attention_diag_bands(const struct config *cfg, long n) {
  struct fma_tree tree;
  fma_tree_build(&tree, n, cfg->attention.fma_m, cfg->attention.fma_p);
  return tree.levels + 1;
}

/* Softmax statistics of one query's scores s_j against a set of keys, relative to their maximum
 * M: Z = Σ e^(s_j − M), Zs = Σ e^(s_j − M)·(s_j − M), and Z split by distance band. From them,
 * mass in band b = band_b / Z and entropy = log Z − Zs / Z; partial statistics from several ranks
 * combine after rescaling each by e^(M_r − M). */
enum { ROW_MAX, ROW_Z, ROW_ZS, ROW_BAND0 };

static void row_statistics(double *st, const float *qi, long gi, const float *k, long t0, long T,
                           long width, const struct attn_ctx *ctx, const struct fma_tree *tree,
                           double *row, attention_score_fn score, const void *user) {
  double mx = -INFINITY;
  for (long j = 0; j < T; j++) {
    row[j] = score(ctx, qi, gi, k + j * width, t0 + j, width, user);
    if (row[j] > mx) mx = row[j];
  }
  st[ROW_MAX] = mx;
  if (mx == -INFINITY) return; /* no key of this slab is visible: nothing to add */
  for (long j = 0; j < T; j++) {
    if (row[j] == -INFINITY) continue;
    const double e = exp(row[j] - mx);
    int band = fma_lists_band(tree, ctx->dims.causal, gi, t0 + j);
    if (band < 0) band = 0; /* an allowed pair outside every list cannot happen; be safe */
    st[ROW_Z] += e;
    st[ROW_ZS] += e * (row[j] - mx);
    st[ROW_BAND0 + band] += e;
  }
}

long attention_diag_rows(struct attn_ctx *ctx, double *mass, double *entropy, const float *q,
                         const float *k, long width, long max_queries, attention_score_fn score,
                         const void *user) {
  const struct attn_dims *dm = &ctx->dims;
  struct comm *cm = ctx->comm;
  const int S = cm ? cm->S : 1, me = cm ? cm->seq_rank : 0;
  struct fma_tree tree;
  fma_tree_build(&tree, dm->n, ctx->opt.diag_m, ctx->opt.diag_p);
  const int bands = tree.levels + 1;
  const long T = dm->T, nq = T < max_queries ? T : max_queries;
  const long nall = S * nq, w = ROW_BAND0 + bands; /* sampled queries of the group; stats each */
  float *mine = mem_alloc(MEM_WORKSPACE, sizeof(float) * (size_t)(nq * width));
  float *qs = mem_alloc(MEM_WORKSPACE, sizeof(float) * (size_t)(nall * width));
  double *st = mem_alloc(MEM_WORKSPACE, sizeof(double) * (size_t)(nall * w));
  double *top = mem_alloc(MEM_WORKSPACE, sizeof(double) * (size_t)nall);
  /* Query s of slab r is its row s·T/nq, at global position r·T + s·T/nq (contiguous slabs). */
  for (long s = 0; s < nq; s++)
    memcpy(mine + s * width, q + (s * T / nq) * width, sizeof(float) * (size_t)width);
  if (cm)
    comm_allgather_float(cm, COMM_SEQ, mine, (size_t)(nq * width), qs);
  else
    memcpy(qs, mine, sizeof(float) * (size_t)(nq * width));
#pragma omp parallel
  {
    double *row = mem_alloc(MEM_WORKSPACE, sizeof(double) * (size_t)T);
#pragma omp for schedule(dynamic, 4)
    for (long a = 0; a < nall; a++)
      row_statistics(st + a * w, qs + a * width, (a / nq) * T + (a % nq) * T / nq, k, dm->t0, T,
                     width, ctx, &tree, row, score, user);
    mem_free(row);
  }
  if (S > 1) { /* combine the ranks' partial statistics relative to the global maximum */
    for (long a = 0; a < nall; a++) top[a] = st[a * w + ROW_MAX];
    comm_allreduce_max_double(cm, COMM_SEQ, top, (size_t)nall);
    for (long a = 0; a < nall; a++) {
      double *sa = st + a * w;
      const double shift = sa[ROW_MAX] - top[a], f = sa[ROW_Z] > 0 ? exp(shift) : 0.0;
      sa[ROW_ZS] = f * (sa[ROW_ZS] + (sa[ROW_Z] > 0 ? shift * sa[ROW_Z] : 0.0));
      sa[ROW_Z] *= f;
      for (int b = 0; b < bands; b++) sa[ROW_BAND0 + b] *= f;
      sa[ROW_MAX] = 0.0;
    }
    comm_allreduce_sum_double(cm, COMM_SEQ, st, (size_t)(nall * w));
  }
  for (long a = me * nq; a < (me + 1) * nq; a++) { /* this rank reports its own queries */
    const double *sa = st + a * w, Z = sa[ROW_Z];
    if (!(Z > 0)) continue; /* every query may see at least itself: cannot happen */
    for (int b = 0; b < bands; b++) mass[b] += sa[ROW_BAND0 + b] / Z;
    entropy[0] += log(Z) - sa[ROW_ZS] / Z;
  }
  mem_free(top);
  mem_free(st);
  mem_free(qs);
  mem_free(mine);
  return nq;
}
