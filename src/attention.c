/* The attention registry (one line per variant) and what variants share: the configuration check
 * and the row-by-row diagnostics of exact variants, classified by the FMA tree's distance bands so
 * that `full` and `fma` report comparable level masses. */
#include "attention.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "error.h"
#include "fma_lists.h"
#include "memory.h"

extern const struct attn_variant attention_full;
extern const struct attn_variant attention_local;
extern const struct attn_variant attention_fma;
extern const struct attn_variant attention_fma_linear;

static const struct attn_variant *const registry[] = {
    &attention_full,
    &attention_local,
    &attention_fma,
    &attention_fma_linear,
};

/* Variants named by SPEC §6 that a deck may select; those not in the registry are refused with a
 * clear message rather than an "unknown variant" one. */
static const char *const spec_variants[] = {"full",       "local",     "linear",  "fma",
                                            "fma_linear", "fmmformer", "nystrom", "rmfa"};

const struct attn_variant *attention_find(const char *name) {
  for (size_t i = 0; i < sizeof registry / sizeof registry[0]; i++)
    if (strcmp(registry[i]->name, name) == 0) return registry[i];
  return NULL;
}

bool attention_implemented(const char *name) { return attention_find(name) != NULL; }

int attention_check(const struct config *cfg, long n, int seq_ranks, char *err, size_t len) {
  const char *name = cfg->attention.variant;
  const struct attn_variant *v = attention_find(name);
  if (!v) {
    bool known = false;
    for (size_t i = 0; i < sizeof spec_variants / sizeof spec_variants[0]; i++)
      known |= strcmp(spec_variants[i], name) == 0;
    char avail[256] = "";
    for (size_t i = 0; i < sizeof registry / sizeof registry[0]; i++)
      snprintf(avail + strlen(avail), sizeof avail - strlen(avail), "%s%s", i ? ", " : "",
               registry[i]->name);
    snprintf(err, len, "attention.variant = %s %s; available: %s", name,
             known ? "is not implemented in this version of fmattn" : "is unknown", avail);
    return 1;
  }
  bool causal = cfg->model.objective == OBJECTIVE_CLM;
  if (causal && !v->causal_ok) {
    snprintf(err, len, "attention.variant = %s cannot run causally (model.objective = clm)", name);
    return 1;
  }
  if (!causal && !v->bidir_ok) {
    snprintf(err, len, "attention.variant = %s cannot run bidirectionally (model.objective = mlm)",
             name);
    return 1;
  }
  if (cfg->attention.heads_mode != HEADS_STANDARD) {
    snprintf(err, len, "attention.heads_mode = fish is not implemented in this version of fmattn");
    return 1;
  }
  if (v->check) {
    const char *why = v->check(cfg, n, seq_ranks, err, len);
    if (why) return 1;
  }
  return 0;
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
    snprintf(full, sizeof full, "layer_%03d/attn/%s/%s", layer, v->name, p->name);
    int k = param_list_add(list, full, p->ndim, p->shape, p->decay, p->init, p->std);
    list->p[k].layer = layer;
    list->p[k].owner = 1;
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

int attention_diag_bands(const struct config *cfg, long n) {
  struct fma_tree tree;
  fma_tree_build(&tree, n, cfg->attention.fma_m, cfg->attention.fma_p);
  return tree.levels + 1;
}

long attention_diag_rows(struct attn_ctx *ctx, double *mass, double *entropy, const float *q,
                         const float *k, long max_queries,
                         bool (*allowed)(const struct attn_ctx *ctx, long i, long j)) {
  const struct attn_dims *dm = &ctx->dims;
  if (ctx->comm && ctx->comm->S > 1) return 0; /* needs every key: single slab only */
  struct fma_tree tree;
  fma_tree_build(&tree, dm->n, ctx->cfg->attention.fma_m, ctx->cfg->attention.fma_p);
  const int bands = tree.levels + 1;
  const long T = dm->T, d = dm->d, nq = T < max_queries ? T : max_queries;
  const float scale = 1.0f / sqrtf((float)d);
  for (long h = 0; h < dm->H; h++) {
    const float *qh = q + h * T * d, *kh = k + h * T * d; /* batch element 0 */
    double ent = 0.0;
    double *mh = mass + h * bands;
#pragma omp parallel reduction(+ : ent)
    {
      double *row = mem_alloc(MEM_WORKSPACE, sizeof(double) * (size_t)T);
      double *local = mem_alloc(MEM_WORKSPACE, sizeof(double) * (size_t)bands);
#pragma omp for schedule(dynamic, 4)
      for (long s = 0; s < nq; s++) {
        long i = nq == T ? s : s * T / nq;
        long gi = dm->t0 + i;
        double mx = -INFINITY;
        for (long j = 0; j < T; j++) {
          if (!allowed(ctx, gi, dm->t0 + j)) {
            row[j] = -INFINITY;
            continue;
          }
          double dot = 0.0;
          for (long c = 0; c < d; c++) dot += (double)qh[i * d + c] * kh[j * d + c];
          row[j] = dot * scale;
          if (row[j] > mx) mx = row[j];
        }
        double z = 0.0;
        for (long j = 0; j < T; j++) z += row[j] == -INFINITY ? 0.0 : exp(row[j] - mx);
        for (long j = 0; j < T; j++) {
          if (row[j] == -INFINITY) continue;
          double p = exp(row[j] - mx) / z;
          int band = fma_lists_band(&tree, dm->causal, gi, dm->t0 + j);
          if (band < 0) band = 0; /* an allowed pair outside every list cannot happen; be safe */
          local[band] += p;
          if (p > 0.0) ent -= p * log(p);
        }
      }
#pragma omp critical(attention_diag)
      for (int b = 0; b < bands; b++) mh[b] += local[b];
      mem_free(local);
      mem_free(row);
    }
    entropy[h] += ent;
  }
  return nq;
}
