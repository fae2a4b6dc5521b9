/* The summary parameters of FMA (SPEC §6.4 "Summaries", "Storage"): their names, shapes and
 * learning-rate scale, where they lie in a layer's block, their mean or random initialisation,
 * and their transposed, channel-contiguous copies that the operators read (fma_down_weights).
 * The operators themselves are in upward.c. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "core/memory.h"
#include "core/rng.h"
#include "fma/fma.h"

static const char *set_names[FMA_NSETS] = {"k_down", "v_down", "q_down"};

static int set_count(bool linear) { return linear ? 3 : 2; }

/* Length of the last axis of level l's weight. */
static long level_span(enum fma_downsample down, const struct fma_tree *tree, int l) {
  if (down == FMA_DOWN_M2M) return l == 1 ? tree->m : 2L * tree->p;
  return tree->window[l];
}

void fma_params_describe(const struct fma_options *opt, long n, long d, bool linear,
                         struct param_list *list) {
  if (opt->down == FMA_DOWN_AVG) return; /* fixed means: nothing to learn */
  struct fma_tree tree;
  fma_tree_build(&tree, n, opt->m, opt->p);
  const long p = tree.p;
  for (int s = 0; s < set_count(linear); s++)
    for (int l = 1; l <= tree.levels; l++) {
      char name[PARAM_NAME];
      long wshape[3] = {d, p, level_span(opt->down, &tree, l)};
      long bshape[2] = {d, p};
      snprintf(name, sizeof name, "%s/level_%02d/weight", set_names[s], l);
      const int k = param_list_add(list, name, 3, wshape, true, INIT_CUSTOM, 0.0f);
      /* Adam moves every tap by about lr a step, whatever the gradient's size: a summary that
       * sums `span` taps then moves by up to span·lr, which grows with the window (1024 taps at
       * n = 4096, n/4 at the top level). Scaled, the rate is lr·p/span (the mean init's tap
       * value), so a step moves a summary by about lr of its size at every level (docs/fma.md). */
      if (opt->down_lr == FMA_LR_SCALED) list->p[k].lr_scale = (float)p / (float)wshape[2];
      snprintf(name, sizeof name, "%s/level_%02d/bias", set_names[s], l);
      param_list_add(list, name, 2, bshape, false, INIT_CUSTOM, 0.0f);
    }
}

void fma_params_layout(const struct fma_options *opt, long n, long d, bool linear,
                       struct fma_layout *layout) {
  memset(layout, 0, sizeof *layout);
  struct param_list list;
  param_list_init(&list);
  fma_params_describe(opt, n, d, linear, &list);
  struct fma_tree tree;
  fma_tree_build(&tree, n, opt->m, opt->p);
  int i = 0;
  if (list.count > 0)
    for (int s = 0; s < set_count(linear); s++)
      for (int l = 1; l <= tree.levels; l++) {
        layout->weight[s][l] = list.p[i++].offset;
        layout->bias[s][l] = list.p[i++].offset;
      }
  for (int l = 1; l <= tree.levels; l++) layout->span[l] = level_span(opt->down, &tree, l);
  layout->total = list.total;
  param_list_free(&list);
}

/* "k_down/level_03/weight" → set, level, is_bias. */
static void parse_name(const char *name, int *set, int *level, bool *bias) {
  *set = -1;
  for (int s = 0; s < FMA_NSETS; s++)
    if (strncmp(name, set_names[s], strlen(set_names[s])) == 0) *set = s;
  const char *lv = strstr(name, "level_");
  if (*set < 0 || !lv) error("not an fma parameter: %s", name);
  *level = atoi(lv + 6);
  *bias = strstr(name, "/bias") != NULL;
}

static uint64_t init_key(const struct param_desc *p) {
  uint64_t h = 1469598103934665603ull;
  for (const char *s = p->name; *s; s++) h = (h ^ (uint8_t)*s) * 1099511628211ull;
  return h ^ ((uint64_t)(p->layer + 1) << 48);
}

void fma_params_init(const struct fma_options *opt, uint64_t seed, bool linear,
                     const struct param_desc *p, float *data) {
  int set, level;
  bool bias;
  parse_name(p->name, &set, &level, &bias);
  const long d = p->shape[0], P = p->shape[1];
  /* inputs each summary sums over: w_l tokens (conv), m tokens (m2m level 1), 2p children */
  const long m = opt->m;
  const long span = opt->down == FMA_DOWN_M2M ? (level > 1 ? 2 * P : m) : m << (level - 1);
  /* fma_linear adds every level's output at full weight, so with value summaries at the mean a
   * fresh model's output is the near field plus L window averages; starting the value summaries
   * at 0 (biases, and the weights that read tokens: conv every level, m2m its P2M level 1 — its
   * M2M levels keep their init and sum zeros, so their gradients are not stuck at 0) lets it
   * learn as a local model first and turn the levels on as they help (docs/fma.md). */
  const bool zero_values = linear && set == FMA_V && opt->linear_zero_values &&
                           (bias || opt->down != FMA_DOWN_M2M || level == 1);
  if (zero_values) {
    memset(data, 0, sizeof(float) * p->numel);
    return;
  }
  if (opt->init == FMA_INIT_RANDOM) {
    /* uniform ±1/√fan_in, as the paper's code (and PyTorch's conv default) does */
    const double bound = 1.0 / sqrt((double)span);
    const uint64_t key = init_key(p);
    for (size_t e = 0; e < p->numel; e++)
      data[e] = (float)(bound * (2.0 * rng_uniform_double(seed, RNG_INIT, key, e, 1) - 1.0));
    return;
  }
  /* mean: every learned summary starts as the avg one, bias 0 */
  memset(data, 0, sizeof(float) * p->numel);
  if (bias) return;
  for (long f = 0; f < d; f++)
    for (long r = 0; r < P; r++) {
      float *row = data + (f * P + r) * span;
      if (opt->down == FMA_DOWN_M2M && level > 1) {
        row[2 * r] = row[2 * r + 1] = 0.5f; /* parent sub-segment r = child sub-segments 2r, 2r+1 */
      } else {
        const long seg = span / P;
        for (long t = r * seg; t < (r + 1) * seg; t++) row[t] = 1.0f / (float)seg;
      }
    }
}

/* ---------------------------------------------------------------------------------------------
 * weights in the transposed, channel-contiguous layout */

/* Causal fma_linear attends with the query summary of the sub-segment before i's (ρ − 1). That is
 * causal only if summary row r of a window reads nothing after sub-segment r, which learned conv
 * or m2m weights would otherwise do: in causal mode, tap t of q_down row r is used only when it
 * lies in sub-segments ≤ r (m2m: child rows ≤ 2r + 1). The mean init already has this form. */
static bool query_tap_used(const struct fma_state *st, enum fma_set set, int l, long r, long t) {
  if (set != FMA_Q || !st->causal) return true;
  const long P = st->tree.p, span = st->layout.span[l];
  if (st->down == FMA_DOWN_M2M && l > 1) return t <= 2 * r + 1;
  return t < (r + 1) * (span / P);
}

void fma_weights_load(const struct fma_state *st, const float *params, enum fma_set set,
                      struct fma_down_weights *w) {
  memset(w, 0, sizeof *w);
  if (st->down == FMA_DOWN_AVG) return;
  const long d = st->d, P = st->tree.p;
  for (int l = 1; l <= st->tree.levels; l++) {
    const long span = st->layout.span[l];
    w->wt[l] = mem_alloc(MEM_WORKSPACE, sizeof(float) * (size_t)(P * span * d));
    w->bt[l] = mem_alloc(MEM_WORKSPACE, sizeof(float) * (size_t)(P * d));
    if (!params) continue;
    const float *W = params + st->layout.weight[set][l], *b = params + st->layout.bias[set][l];
    for (long f = 0; f < d; f++)
      for (long r = 0; r < P; r++) {
        for (long t = 0; t < span; t++)
          w->wt[l][(r * span + t) * d + f] =
              query_tap_used(st, set, l, r, t) ? W[(f * P + r) * span + t] : 0.0f;
        w->bt[l][r * d + f] = b[f * P + r];
      }
  }
}

void fma_weights_zero(const struct fma_state *st, struct fma_down_weights *w) {
  fma_weights_load(st, NULL, FMA_K, w);
}

void fma_weights_store_grad(const struct fma_state *st, float *dparams, enum fma_set set,
                            const struct fma_down_weights *dw) {
  if (st->down == FMA_DOWN_AVG) return;
  const long d = st->d, P = st->tree.p;
  for (int l = 1; l <= st->tree.levels; l++) {
    const long span = st->layout.span[l];
    float *W = dparams + st->layout.weight[set][l], *b = dparams + st->layout.bias[set][l];
    for (long f = 0; f < d; f++)
      for (long r = 0; r < P; r++) {
        for (long t = 0; t < span; t++)
          if (query_tap_used(st, set, l, r, t))
            W[(f * P + r) * span + t] += dw->wt[l][(r * span + t) * d + f];
        b[f * P + r] += dw->bt[l][r * d + f];
      }
  }
}

void fma_weights_free(const struct fma_state *st, struct fma_down_weights *w) {
  for (int l = 0; l <= FMA_MAX_LEVELS; l++) {
    mem_free(w->wt[l]);
    mem_free(w->bt[l]);
  }
  memset(w, 0, sizeof *w);
}
