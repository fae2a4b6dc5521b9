/* fma with content-based opening (SPEC §6.4a, `attention.fma.open`) through its ops table: open =
 * all against exact attention (the FMM's "open everything = direct sum"), open = 1, 2, 3 against
 * the float64 oracle of fma_oracle.c, which applies the criterion with its own traversal, ties
 * included; causality by perturbation for every K; the diagnostics against the oracle's; float
 * gradients against float differences. It reads nothing of the production opening code. */
#include "testutil.h"

#include "../src/attention/attention.h"
#include "../src/deck/config.h"
#include "../src/nn/params.h"
#include "fma_cases.h"
#include "fma_oracle.h"

/* One configuration of the tests: sizes, summaries, mask and fma.open (-1: all). */
struct open_case {
  long B, H, n, d;
  int m, p;
  enum fo_down down;
  bool causal;
  int open;
};

static void case_text(const struct open_case *t, char *buf, size_t len) {
  char k[16];
  if (t->open < 0)
    snprintf(k, sizeof k, "all");
  else
    snprintf(k, sizeof k, "%d", t->open);
  snprintf(buf, len, "fma.open=%s n=%ld m=%d p=%d d=%ld %s %s", k, t->n, t->m, t->p, t->d,
           down_name[t->down], t->causal ? "causal" : "bidir");
}

/* The production layer of a case: its deck, parameters (random, away from the mean init, so
 * the summaries differ from window means) and their gradients. */
struct layer {
  struct config cfg;
  struct param_list list;
  float *params, *dparams;
};

static void layer_setup(struct layer *ly, const struct open_case *t) {
  memset(ly, 0, sizeof *ly);
  tu_config(
      &ly->cfg, "fma", t->n, (int)t->H, (int)t->d, t->causal,
      TU_SETS(tu_fmt("attention.fma.m=%d", t->m), tu_fmt("attention.fma.p=%d", t->p),
              tu_fmt("attention.fma.downsample=%s", down_name[t->down]),
              "attention.fma.init=random",
              t->open < 0 ? "attention.fma.open=all" : tu_fmt("attention.fma.open=%d", t->open)));
  char err[CONFIG_ERR_LEN];
  if (attention_check(&ly->cfg, t->n, 1, err, sizeof err))
    fail_msg("attention_check refuses a valid fma.open configuration: %s", err);
  param_list_init(&ly->list);
  const struct attn_variant *var = attention_find("fma");
  attention_register_params(&ly->cfg, var, t->n, 0, &ly->list);
  ly->params = calloc(ly->list.total + 1, sizeof(float));
  ly->dparams = calloc(ly->list.total + 1, sizeof(float));
  for (int i = 0; i < ly->list.count; i++)
    attention_init_param(&ly->cfg, var, &ly->list.p[i], ly->params + ly->list.p[i].offset);
}

static void layer_free(struct layer *ly) {
  free(ly->params);
  free(ly->dparams);
  param_list_free(&ly->list);
  config_free(&ly->cfg);
}

static struct tu_run layer_run(struct layer *ly, const struct open_case *t, const float *q,
                               const float *k, const float *v, const float *dout) {
  struct attn_ctx ctx = tu_attn_open(&ly->cfg, t->B);
  memset(ly->dparams, 0, sizeof(float) * (ly->list.total + 1));
  struct tu_run r = tu_attn_run(&ctx, ly->params, ly->dparams, q, k, v, dout);
  attention_close(&ctx);
  return r;
}

/* ================================================================================================
 * open = all is exact attention
 * ============================================================================================== */

/* out, dq, dk, dv equal softmax attention in float64 (causal mask in causal mode) to float
 * rounding; the summaries take no part, so their parameters get no gradient at all. */
static int all_is_full(const struct open_case *t) {
  char what[200];
  case_text(t, what, sizeof what);
  struct layer ly;
  layer_setup(&ly, t);
  const long nd = t->n * t->d, count = t->B * t->H * nd;
  float *q = malloc(4 * count), *k = malloc(4 * count), *v = malloc(4 * count),
        *g = malloc(4 * count);
  const uint64_t key = (uint64_t)(t->n * 7 + t->m * 131 + t->down * 17 + t->causal * 3);
  tu_randn(q, count, key * 4, 1.0f);
  tu_randn(k, count, key * 4 + 1, 1.0f);
  tu_randn(v, count, key * 4 + 2, 1.0f);
  tu_randn(g, count, key * 4 + 3, 1.0f);
  struct tu_run r = layer_run(&ly, t, q, k, v, g);
  int failed = 0;
  double *o = malloc(8 * nd), *dq = malloc(8 * nd), *dk = malloc(8 * nd), *dv = malloc(8 * nd);
  const struct tu_mask mask = {t->causal, 0};
  for (long bh = 0; bh < t->B * t->H; bh++) {
    const size_t off = (size_t)(bh * nd);
    double *qd = tu_to_double(q + off, nd), *kd = tu_to_double(k + off, nd),
           *vd = tu_to_double(v + off, nd), *gd = tu_to_double(g + off, nd);
    tu_dense_attention(o, dq, dk, dv, qd, kd, vd, gd, t->n, t->d, tu_mask_allowed, &mask);
    const double e[4] = {tu_rel_err(r.out + off, o, nd), tu_rel_err(r.dq + off, dq, nd),
                         tu_rel_err(r.dk + off, dk, nd), tu_rel_err(r.dv + off, dv, nd)};
    const char *names[4] = {"out", "dq", "dk", "dv"};
    for (int x = 0; x < 4; x++)
      if (!(e[x] < 2e-5)) {
        printf("# %s head %ld: %s differs from full attention by %.3g (relative)\n", what, bh,
               names[x], e[x]);
        failed++;
      }
    free(qd), free(kd), free(vd), free(gd);
  }
  for (size_t i = 0; i < ly.list.total; i++)
    if (ly.dparams[i] != 0.0f) {
      printf("# %s: summary parameter %zu has gradient %g; every window is opened\n", what, i,
             ly.dparams[i]);
      failed++;
      break;
    }
  free(o), free(dq), free(dk), free(dv);
  free(q), free(k), free(v), free(g);
  tu_run_free(&r);
  layer_free(&ly);
  return failed;
}

static void test_open_all_is_full(void **state) {
  const struct {
    long n;
    int m, p;
    enum fo_down down;
  } sizes[] = {{32, 8, 2, FO_CONV},  {64, 8, 4, FO_M2M},   {128, 8, 2, FO_AVG},
               {256, 16, 4, FO_M2M}, {128, 4, 2, FO_CONV}, {16, 8, 8, FO_M2M}};
  int failed = 0;
  for (int causal = 0; causal < 2; causal++)
    for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
      const struct open_case t = {2,      2, sizes[s].n, 8, sizes[s].m, sizes[s].p, sizes[s].down,
                                  causal, -1};
      failed += all_is_full(&t);
    }
  if (failed) fail_msg("fma.open = all differs from exact attention in %d places (above)", failed);
}

/* ================================================================================================
 * open = K against the float64 oracle
 * ============================================================================================== */

/* The oracle's copy of one summary operator's parameters (k_down or v_down; nothing for avg). */
static void to_oracle(const struct layer *ly, const struct fo_cfg *fc, const char *op,
                      struct fo_params *P) {
  fo_params_alloc(fc, P);
  if (fc->down == FO_AVG) return;
  for (int l = 1; l <= fc->levels; l++)
    for (int wb = 0; wb < 2; wb++) {
      const int i = param_list_find(
          &ly->list, tu_fmt("layer_000/attn/fma/%s/level_%02d/%s", op, l, wb ? "bias" : "weight"));
      if (i < 0) fail_msg("%s level %d: not registered", op, l);
      const struct param_desc *pd = &ly->list.p[i];
      double *dst = wb ? P->bias[l] : P->weight[l];
      for (size_t e = 0; e < pd->numel; e++) dst[e] = ly->params[pd->offset + e];
    }
}

/* The largest relative difference between the production parameter gradients of one operator
 * and the oracle's. */
static double param_grad_error(const struct layer *ly, const struct fo_cfg *fc, const char *op,
                               const struct fo_params *dP) {
  if (fc->down == FO_AVG) return 0.0;
  double num = 0.0, den = 1e-30;
  for (int l = 1; l <= fc->levels; l++)
    for (int wb = 0; wb < 2; wb++) {
      const int i = param_list_find(
          &ly->list, tu_fmt("layer_000/attn/fma/%s/level_%02d/%s", op, l, wb ? "bias" : "weight"));
      const struct param_desc *pd = &ly->list.p[i];
      const double *ref = wb ? dP->bias[l] : dP->weight[l];
      for (size_t e = 0; e < pd->numel; e++) {
        const double diff = fabs(ly->dparams[pd->offset + e] - ref[e]);
        if (diff > num) num = diff;
        if (fabs(ref[e]) > den) den = fabs(ref[e]);
      }
    }
  return num / den;
}

/* Production against fo_fma with the same fma.open: out, dq, dk, dv and the k_down, v_down
 * gradients, within tol. The inputs (scale 1, d = 8) keep the candidates' scores apart, so float
 * and double choose the same windows; a near tie would show as an error of order 1. With
 * periodic keys (k repeating every `period` tokens, 0: none) windows tie exactly. */
static int matches_oracle(const struct open_case *t, bool mult, long period, double tol) {
  char what[240];
  case_text(t, what, sizeof what);
  snprintf(what + strlen(what), sizeof what - strlen(what), " multiplicity=%s%s",
           mult ? "on" : "off", period ? tu_fmt(" keys of period %ld", period) : "");
  struct layer ly;
  layer_setup(&ly, t);
  if (!mult) { /* the deck's default is on: rebuild the layer with it off */
    layer_free(&ly);
    memset(&ly, 0, sizeof ly);
    tu_config(&ly.cfg, "fma", t->n, (int)t->H, (int)t->d, t->causal,
              TU_SETS(tu_fmt("attention.fma.m=%d", t->m), tu_fmt("attention.fma.p=%d", t->p),
                      tu_fmt("attention.fma.downsample=%s", down_name[t->down]),
                      "attention.fma.init=random", "attention.fma.multiplicity=false",
                      tu_fmt("attention.fma.open=%d", t->open)));
    param_list_init(&ly.list);
    const struct attn_variant *var = attention_find("fma");
    attention_register_params(&ly.cfg, var, t->n, 0, &ly.list);
    ly.params = calloc(ly.list.total + 1, sizeof(float));
    ly.dparams = calloc(ly.list.total + 1, sizeof(float));
    for (int i = 0; i < ly.list.count; i++)
      attention_init_param(&ly.cfg, var, &ly.list.p[i], ly.params + ly.list.p[i].offset);
  }
  const long nd = t->n * t->d, count = t->B * t->H * nd;
  float *q = malloc(4 * count), *k = malloc(4 * count), *v = malloc(4 * count),
        *g = malloc(4 * count);
  const uint64_t key = (uint64_t)(t->n * 7 + t->m * 131 + t->down * 17 + t->causal * 3 +
                                  t->open * 1001 + mult * 5 + period * 13);
  tu_randn(q, count, key * 4, 1.0f);
  tu_randn(k, count, key * 4 + 1, 1.0f);
  tu_randn(v, count, key * 4 + 2, 1.0f);
  tu_randn(g, count, key * 4 + 3, 1.0f);
  for (long bh = 0; period && bh < t->B * t->H; bh++)
    for (long i = period; i < t->n; i++)
      memcpy(k + (bh * t->n + i) * t->d, k + (bh * t->n + i % period) * t->d, 4 * (size_t)t->d);
  struct tu_run r = layer_run(&ly, t, q, k, v, g);
  struct fo_cfg fc;
  fo_cfg_init(&fc, t->n, t->d, t->m, t->p, t->down, t->causal, mult);
  fc.open = t->open;
  struct fo_params kp, vp, dkp, dvp;
  to_oracle(&ly, &fc, "k_down", &kp);
  to_oracle(&ly, &fc, "v_down", &vp);
  fo_params_alloc(&fc, &dkp);
  fo_params_alloc(&fc, &dvp);
  int failed = 0;
  double *o = malloc(8 * nd), *dq = malloc(8 * nd), *dk = malloc(8 * nd), *dv = malloc(8 * nd);
  for (long bh = 0; bh < t->B * t->H; bh++) {
    const size_t off = (size_t)(bh * nd);
    double *qd = tu_to_double(q + off, nd), *kd = tu_to_double(k + off, nd),
           *vd = tu_to_double(v + off, nd), *gd = tu_to_double(g + off, nd);
    memset(dq, 0, 8 * nd), memset(dk, 0, 8 * nd), memset(dv, 0, 8 * nd);
    fo_fma(&fc, o, dq, dk, dv, &dkp, &dvp, qd, kd, vd, &kp, &vp, gd);
    const double e[4] = {tu_rel_err(r.out + off, o, nd), tu_rel_err(r.dq + off, dq, nd),
                         tu_rel_err(r.dk + off, dk, nd), tu_rel_err(r.dv + off, dv, nd)};
    const char *names[4] = {"out", "dq", "dk", "dv"};
    for (int x = 0; x < 4; x++)
      if (!(e[x] < tol)) {
        printf("# %s head %ld: %s differs from the oracle by %.3g (relative)\n", what, bh, names[x],
               e[x]);
        failed++;
      }
    free(qd), free(kd), free(vd), free(gd);
  }
  const double ek = param_grad_error(&ly, &fc, "k_down", &dkp),
               ev = param_grad_error(&ly, &fc, "v_down", &dvp);
  if (!(ek < tol && ev < tol)) {
    printf("# %s: k_down gradients differ by %.3g, v_down by %.3g (relative)\n", what, ek, ev);
    failed++;
  }
  fo_params_free(&fc, &kp), fo_params_free(&fc, &vp);
  fo_params_free(&fc, &dkp), fo_params_free(&fc, &dvp);
  free(o), free(dq), free(dk), free(dv);
  free(q), free(k), free(v), free(g);
  tu_run_free(&r);
  layer_free(&ly);
  return failed;
}

/* K = 1, 2, 3 × conv, m2m, avg × causal, bidirectional × three trees, and multiplicity off. */
static void test_open_matches_oracle(void **state) {
  const struct {
    long n;
    int m, p;
  } sizes[] = {{64, 8, 2}, {128, 8, 4}, {256, 16, 4}};
  int failed = 0;
  for (int K = 1; K <= 3; K++)
    for (int down = 0; down < 3; down++)
      for (int causal = 0; causal < 2; causal++)
        for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
          const struct open_case t = {
              2, 2, sizes[s].n, 8, sizes[s].m, sizes[s].p, (enum fo_down)down, causal, K};
          failed += matches_oracle(&t, true, 0, 1e-4);
          if (s == 0) failed += matches_oracle(&t, false, 0, 1e-4);
        }
  if (failed) fail_msg("fma.open differs from the float64 oracle in %d places (above)", failed);
}

/* Exact ties: keys repeating every 16 tokens make windows 16 apart identical (avg summaries of
 * identical tokens are bitwise identical, and so are their scores), and the lower window must
 * win, as in the oracle. */
static void test_open_ties(void **state) {
  int failed = 0;
  for (int K = 1; K <= 2; K++)
    for (int causal = 0; causal < 2; causal++) {
      const struct open_case t = {1, 2, 128, 8, 4, 2, FO_AVG, causal, K};
      failed += matches_oracle(&t, true, 16, 1e-4);
    }
  if (failed) fail_msg("fma.open breaks ties unlike the oracle in %d places (above)", failed);
}

/* ================================================================================================
 * causality, and the diagnostics against the oracle
 * ============================================================================================== */

/* Causality by perturbation (testutil.c) for K = 1, 2, 3 and all, conv and m2m with parameters off
 * their init and avg: a change at j moves nothing before j — neither directly nor through what a
 * query opens. */
static void test_open_causality(void **state) {
  const long at[] = {0, 7, 8, 37, 64, 70, 101, 127};
  const struct tu_probe probe = {at, sizeof at / sizeof at[0], TU_MOVE_QKV, false};
  int failed = 0;
  for (int K = -1; K <= 3; K++)
    for (int down = 0; down < 3; down++) {
      if (K == 0) continue;
      const struct open_case t = {1, 2, 128, 8, 8, 2, (enum fo_down)down, true, K};
      char what[200];
      case_text(&t, what, sizeof what);
      struct layer ly;
      layer_setup(&ly, &t);
      const long count = t.B * t.H * t.n * t.d;
      float *q = malloc(4 * count), *k = malloc(4 * count), *v = malloc(4 * count);
      tu_randn(q, count, 201, 1.0f);
      tu_randn(k, count, 202, 1.0f);
      tu_randn(v, count, 203, 1.0f);
      struct attn_ctx ctx = tu_attn_open(&ly.cfg, t.B);
      failed += tu_causality(&ctx, ly.params, q, k, v, &probe, what);
      attention_close(&ctx);
      free(q), free(k), free(v);
      layer_free(&ly);
    }
  if (failed) fail_msg("fma.open causal: %d probes broke causality (listed above)", failed);
}

/* The variant's diagnostics (attn_ctx.open_diag) against the oracle's statistics of the same
 * forward: the probability on opened exact tokens per head, and the windows opened per level. */
static void test_open_diagnostics(void **state) {
  int failed = 0;
  for (int K = -1; K <= 2; K++)
    for (int causal = 0; causal < 2; causal++) {
      if (K == 0) continue;
      const struct open_case t = {1, 2, 128, 8, 8, 2, FO_M2M, causal, K};
      char what[200];
      case_text(&t, what, sizeof what);
      struct layer ly;
      layer_setup(&ly, &t);
      const long nd = t.n * t.d, count = t.H * nd;
      float *q = malloc(4 * count), *k = malloc(4 * count), *v = malloc(4 * count);
      tu_randn(q, count, 301 + K, 1.0f);
      tu_randn(k, count, 302 + K, 1.0f);
      tu_randn(v, count, 303 + K, 1.0f);
      struct attn_ctx ctx = tu_attn_open(&ly.cfg, t.B);
      const int bands = attention_diag_bands(&ly.cfg, t.n);
      double mass[2 * 8] = {0}, entropy[2] = {0}, open_mass[2] = {0}, opened[8] = {0};
      assert_true(bands <= 8 && ctx.variant->opens && ctx.variant->opens(&ly.cfg));
      ctx.open_diag = (struct attn_open_diag){open_mass, opened};
      const long queries = ctx.variant->diagnostics(&ctx, mass, entropy, q, k, v, ly.params);
      attention_close(&ctx);
      assert_int_equal(queries, t.n);
      struct fo_cfg fc;
      fo_cfg_init(&fc, t.n, t.d, t.m, t.p, t.down, t.causal, true);
      fc.open = t.open;
      struct fo_params kp, vp;
      to_oracle(&ly, &fc, "k_down", &kp);
      to_oracle(&ly, &fc, "v_down", &vp);
      double want_opened[8] = {0};
      for (long h = 0; h < t.H; h++) {
        double *qd = tu_to_double(q + h * nd, nd), *kd = tu_to_double(k + h * nd, nd),
               *vd = tu_to_double(v + h * nd, nd);
        struct fo_open_stats os;
        fo_fma_open_stats(&fc, &os, qd, kd, vd, &kp, &vp);
        if (!(fabs(os.open_mass - open_mass[h]) <= 1e-4 * t.n)) {
          printf("# %s head %ld: mass on opened tokens %.6f, oracle %.6f\n", what, h, open_mass[h],
                 os.open_mass);
          failed++;
        }
        for (int l = 1; l < bands; l++) want_opened[l] += os.opened[l];
        free(qd), free(kd), free(vd);
      }
      for (int l = 1; l < bands; l++)
        if (opened[l] != want_opened[l]) {
          printf("# %s: %g windows opened at level %d, oracle %g\n", what, opened[l], l,
                 want_opened[l]);
          failed++;
        }
      fo_params_free(&fc, &kp), fo_params_free(&fc, &vp);
      free(q), free(k), free(v);
      layer_free(&ly);
    }
  if (failed) fail_msg("fma.open's diagnostics differ from the oracle in %d places", failed);
}

/* Float gradients against float central differences of J = Σ g·out (loose tolerance; an
 * oracle-free check). A step that changes what some query opens makes J jump: such a coordinate
 * shows a second difference far above a smooth function's, and is left out (at most a quarter may
 * be). */
static int float_fd_case(const struct open_case *t) {
  char what[200];
  case_text(t, what, sizeof what);
  struct layer ly;
  layer_setup(&ly, t);
  const long count = t->B * t->H * t->n * t->d;
  float *q = malloc(4 * count), *k = malloc(4 * count), *v = malloc(4 * count),
        *g = malloc(4 * count);
  tu_randn(q, count, 411 + t->open, 1.0f);
  tu_randn(k, count, 412 + t->open, 1.0f);
  tu_randn(v, count, 413 + t->open, 1.0f);
  tu_randn(g, count, 414 + t->open, 1.0f);
  struct tu_run r = layer_run(&ly, t, q, k, v, g);
  struct attn_ctx ctx = tu_attn_open(&ly.cfg, t->B);
  float *out = calloc(count, 4), *saved = calloc(attention_saved_floats(&ctx) + 1, 4);
  const float h = 2e-3f;
  float *xs[4] = {q, k, v, ly.params};
  const float *grads[4] = {r.dq, r.dk, r.dv, ly.dparams};
  const char *names[4] = {"dq", "dk", "dv", "dparams"};
  int failed = 0;
  for (int x = 0; x < 4; x++) {
    const long len = x < 3 ? count : (long)ly.list.total;
    double num = 0.0, den = 1e-30;
    long skipped = 0;
    for (long e = 0; e < len; e++) {
      double J[5];
      const float s0 = xs[x][e], steps[5] = {0.0f, h, -h, h / 2, -h / 2};
      for (int z = 0; z < 5; z++) {
        xs[x][e] = s0 + steps[z];
        attention_forward(&ctx, out, saved, q, k, v, ly.params);
        J[z] = 0.0;
        for (long i = 0; i < count; i++) J[z] += (double)g[i] * out[i];
      }
      xs[x][e] = s0;
      /* a smooth J has second differences of order h²; a changed choice, of the jump's size */
      const double kink = 1e-4 * (1.0 + fabs(J[0]));
      if (fabs(J[1] - 2 * J[0] + J[2]) > kink || fabs(J[3] - 2 * J[0] + J[4]) > kink) {
        skipped++;
        continue;
      }
      const double fd = (J[1] - J[2]) / (2.0 * h);
      num = fmax(num, fabs(grads[x][e] - fd));
      den = fmax(den, fabs(fd));
    }
    if (!(num / den < 2e-2) || skipped > len / 4) {
      printf(
          "# %s: float %s vs float central differences: %.3g relative, %ld of %ld steps "
          "changed a choice\n",
          what, names[x], num / den, skipped, len);
      failed++;
    }
  }
  attention_close(&ctx);
  free(out), free(saved);
  tu_run_free(&r);
  free(q), free(k), free(v), free(g);
  layer_free(&ly);
  return failed;
}

static void test_open_float_gradients(void **state) {
  int failed = 0;
  for (int K = 1; K <= 2; K++)
    for (int down = 0; down < 2; down++) /* conv, m2m: their parameters have gradients */
      for (int causal = 0; causal < 2; causal++) {
        const struct open_case t = {1, 2, 32, 4, 4, 2, (enum fo_down)down, causal, K};
        failed += float_fd_case(&t);
      }
  if (failed) fail_msg("fma.open's float gradients differ from central differences (above)");
}

static const struct CMUnitTest tests[] = {
    cmocka_unit_test(test_open_all_is_full), cmocka_unit_test(test_open_matches_oracle),
    cmocka_unit_test(test_open_ties),        cmocka_unit_test(test_open_causality),
    cmocka_unit_test(test_open_diagnostics), cmocka_unit_test(test_open_float_gradients),
};

TU_MAIN(tests)
