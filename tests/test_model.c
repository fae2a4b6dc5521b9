/* The whole model's gradient: the loss's directional derivative along the gradient, for all
 * parameters at once and for each tensor alone, by central differences, for every position kind,
 * both objectives, tied and untied heads, with and without dropout; recomputation must give the
 * same gradient bit for bit. The per-layer references are in test_layers.c; this checks that the
 * layers are wired together correctly. */
#include "testutil.h"

#include "../src/model/model.h"
#include "../src/model/optimizer.h"

/* Two layers of width 16 (2 heads of 8) over 32 tokens. */
static void make_config(struct config *cfg, const char *variant, const char *position,
                        const char *objective, bool tied, double dropout, bool recompute) {
  tu_config(cfg, variant, 32, 2, 8, strcmp(objective, "clm") == 0,
            TU_SETS(tu_fmt("model.position=%s", position),
                    tu_fmt("model.tie_embeddings=%s", tied ? "true" : "false"),
                    tu_fmt("model.dropout=%g", dropout),
                    tu_fmt("train.recompute=%s", recompute ? "true" : "false"), "model.layers=2",
                    "attention.full.block=8", "attention.fma.m=8", "attention.fma.p=2",
                    "attention.local.band=12"));
}

static void fill_batch(struct model *m) {
  const long N = m->B * m->T;
  for (long i = 0; i < N; i++) {
    m->tokens[i] = (int)rng_below((uint64_t)m->V, 5, RNG_TEST, 1, (uint64_t)i, 0);
    m->targets[i] = i % 7 == 3 ? -1 : (int)rng_below(256, 5, RNG_TEST, 2, (uint64_t)i, 0);
  }
}

static double loss_at(struct model *m, long step) {
  long c;
  double s = model_forward(m, step, true, 1.0f, &c);
  return s / (double)c;
}

/* Gradient of the mean loss at the current parameters (into m->grads). */
static double grad_at(struct model *m, long step) {
  long c = 0;
  for (long i = 0; i < m->B * m->T; i++) c += m->targets[i] >= 0;
  model_zero_grads(m);
  long c2;
  double s = model_forward(m, step, true, 1.0f / (float)c, &c2);
  model_backward(m, step);
  return s / (double)c;
}

/* d/dε L(θ + ε u) at 0, by central differences with step eps; u over [lo, hi) floats. */
static double directional(struct model *m, long step, const float *u, size_t lo, size_t hi,
                          double eps) {
  float *saved = malloc(sizeof(float) * (hi - lo));
  memcpy(saved, m->params + lo, sizeof(float) * (hi - lo));
  for (size_t i = lo; i < hi; i++) m->params[i] = saved[i - lo] + (float)(eps * u[i - lo]);
  double lp = loss_at(m, step);
  for (size_t i = lo; i < hi; i++) m->params[i] = saved[i - lo] - (float)(eps * u[i - lo]);
  double lm = loss_at(m, step);
  memcpy(m->params + lo, saved, sizeof(float) * (hi - lo));
  free(saved);
  return (lp - lm) / (2 * eps);
}

static void check_gradient(const char *variant, const char *position, const char *objective,
                           bool tied, double dropout) {
  struct config cfg;
  make_config(&cfg, variant, position, objective, tied, dropout, false);
  struct model m;
  model_build(&m, &cfg, NULL, 2);
  model_init_params(&m);
  /* move away from the initial point so that every tensor (biases, norms) carries gradient */
  for (size_t i = 0; i < m.plist.total; i++)
    m.params[i] += 0.05f * (float)rng_normal(3, RNG_TEST, 9, i, 0);
  /* and make attention far from uniform, so the paths through q and k carry real gradient */
  for (int t = 0; t < m.plist.count; t++)
    if (strstr(m.plist.p[t].name, "attn/wqkv"))
      for (size_t i = 0; i < m.plist.p[t].numel; i++)
        m.params[m.plist.p[t].offset + i] += 0.5f * (float)rng_normal(3, RNG_TEST, 10, i, 0);
  fill_batch(&m);
  const long step = 4;
  double L = grad_at(&m, step);
  float *g = malloc(sizeof(float) * m.plist.total);
  memcpy(g, m.grads, sizeof(float) * m.plist.total);
  char what[256];

  /* all parameters along the gradient: the derivative is |g| */
  double gn = 0.0;
  for (size_t i = 0; i < m.plist.total; i++) gn += (double)g[i] * g[i];
  gn = sqrt(gn);
  float *u = malloc(sizeof(float) * m.plist.total);
  for (size_t i = 0; i < m.plist.total; i++) u[i] = (float)(g[i] / gn);
  /* the loss moves by 6·10⁻⁵ of itself: above rounding (clm's error grows to ~10⁻⁴ at 10⁻⁵),
   * small enough for the truncation error, which grows as eps² and is largest for mlm (measured,
   * mlm: 1.3·10⁻⁴ here, 10⁻³ at 10⁻⁴, 8.5·10⁻³ at 3·10⁻⁴) */
  double eps = 3e-5 * L / gn;
  double fd = directional(&m, step, u, 0, m.plist.total, eps);
  snprintf(what, sizeof what, "%s/%s/%s/%s/dropout %g: all parameters", variant, position,
           objective, tied ? "tied" : "untied", dropout);
  TU_ASSERT_CLOSE(fabs(fd - gn) / gn, 1e-3, what);

  /* each tensor alone; the packed q|k|v projections in their three row blocks */
  for (int t = 0; t < m.plist.count; t++) {
    const struct param_desc *p = &m.plist.p[t];
    const int parts = strstr(p->name, "qkv") ? 3 : 1;
    for (int part = 0; part < parts; part++) {
      const size_t lo = p->offset + p->numel * part / parts;
      const size_t hi = p->offset + p->numel * (part + 1) / parts;
      double tn = 0.0;
      for (size_t i = lo; i < hi; i++) tn += (double)g[i] * g[i];
      tn = sqrt(tn);
      snprintf(what, sizeof what, "%s/%s/%s/%s/dropout %g: %s part %d (|g| %.2e)", variant,
               position, objective, tied ? "tied" : "untied", dropout, p->name, part, tn);
      if (strstr(p->name, "bqkv") && part == 1 && strcmp(position, "rope") != 0) {
        /* softmax is invariant to q·b_k, the same for every key: the key bias has no gradient
         * (rope rotates it differently per position, so there it does) */
        if (tn > 1e-5 * gn) fail_msg("%s: the key bias must have zero gradient", what);
        continue;
      }
      if (tn < 1e-6 * gn) fail_msg("%s: no gradient reaches this tensor", what);
      for (size_t i = lo; i < hi; i++) u[i - lo] = (float)(g[i] / tn);
      double e = 1e-4 * L / tn;
      if (e > 0.01) e = 0.01;
      double f = directional(&m, step, u, lo, hi, e);
      TU_ASSERT_CLOSE(fabs(f - tn) / tn, 2e-2, what);
    }
  }
  free(u);
  free(g);
  model_free(&m);
  config_free(&cfg);
}

static void test_gradient_positions(void **state) {
  check_gradient("full", "learned", "clm", true, 0.0);
  check_gradient("full", "sinusoidal", "clm", true, 0.0);
  check_gradient("full", "rope", "clm", true, 0.0);
  check_gradient("full", "none", "clm", true, 0.0);
}

static void test_gradient_head_and_objective(void **state) {
  check_gradient("full", "learned", "clm", false, 0.0);
  check_gradient("full", "learned", "mlm", true, 0.0);
}

static void test_gradient_dropout(void **state) {
  check_gradient("full", "learned", "clm", true, 0.2); /* masks are a function of the step */
}

/* train.recompute keeps only block inputs; the gradient must be bit-identical (for fma and
 * fma_linear also when the recomputed forward keeps its summaries for the backward). */
/* The mean loss and a copy of the gradient of cfg's model on the test batch at step 3 (batch 2);
 * *in_place: whether the model read q, k, v in place (model.heads_in_place). */
static float *gradient_copy(const struct config *cfg, double *loss, size_t *total, bool *in_place) {
  struct model m;
  model_build(&m, cfg, NULL, 2);
  *in_place = m.heads_in_place;
  model_init_params(&m);
  fill_batch(&m);
  *loss = grad_at(&m, 3);
  *total = m.plist.total;
  float *g = malloc(sizeof(float) * *total);
  memcpy(g, m.grads, sizeof(float) * *total);
  model_free(&m);
  return g;
}

static void test_recompute_identical(void **state) {
  const char *variants[] = {"full", "fma", "fma_linear"};
  for (size_t c = 0; c < sizeof variants / sizeof *variants; c++) {
    float *grads[2];
    size_t total = 0;
    double loss[2];
    bool in_place;
    for (int r = 0; r < 2; r++) {
      struct config cfg;
      make_config(&cfg, variants[c], "learned", "clm", true, 0.1, r == 1);
      grads[r] = gradient_copy(&cfg, &loss[r], &total, &in_place);
      config_free(&cfg);
    }
    assert_true(loss[0] == loss[1]);
    assert_memory_equal(grads[0], grads[1], sizeof(float) * total);
    free(grads[0]);
    free(grads[1]);
  }
}

/* q, k, v read in place from the q|k|v product and the output written where the projection reads
 * it (model.heads_in_place): the same loss and gradient bit for bit as with the head split and
 * merge copies (FMATTN_HEAD_COPIES=1), for full, both objectives, with recomputation; local,
 * rope and fma keep the copies. */
static void test_heads_in_place_identical(void **state) {
  const struct {
    const char *variant, *position, *objective;
    bool recompute, in_place;
  } cases[] = {{"full", "learned", "clm", false, true},   {"full", "sinusoidal", "mlm", true, true},
               {"local", "learned", "clm", false, false}, {"local", "learned", "mlm", false, false},
               {"full", "rope", "clm", false, false},     {"fma", "learned", "clm", false, false}};
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
    float *grads[2];
    size_t total = 0;
    double loss[2];
    for (int r = 0; r < 2; r++) {
      if (r == 1) setenv("FMATTN_HEAD_COPIES", "1", 1);
      struct config cfg;
      make_config(&cfg, cases[c].variant, cases[c].position, cases[c].objective, true, 0.1,
                  cases[c].recompute);
      bool in_place;
      grads[r] = gradient_copy(&cfg, &loss[r], &total, &in_place);
      assert_int_equal(in_place, r == 0 && cases[c].in_place);
      config_free(&cfg);
      unsetenv("FMATTN_HEAD_COPIES");
    }
    assert_true(loss[0] == loss[1]);
    assert_memory_equal(grads[0], grads[1], sizeof(float) * total);
    free(grads[0]);
    free(grads[1]);
  }
}

/* More rows than one MLP chunk (8192): the chunked MLP of backward, and of forward under
 * recomputation, gives the same gradient bit for bit either way, and the right one. */
static void test_chunked_mlp(void **state) {
  float *grads[2];
  size_t total = 0;
  double loss[2];
  for (int r = 0; r < 2; r++) {
    struct config cfg;
    make_config(&cfg, "local", "learned", "clm", true, 0.1, r == 1);
    cfg.model.context = 8320; /* 2 × 8320 rows: chunks of 8192, 8192, 256 */
    cfg.attention.local_band = 8;
    struct model m;
    model_build(&m, &cfg, NULL, 2);
    model_init_params(&m);
    fill_batch(&m);
    loss[r] = grad_at(&m, 3);
    total = m.plist.total;
    grads[r] = malloc(sizeof(float) * total);
    memcpy(grads[r], m.grads, sizeof(float) * total);
    if (r == 1) { /* the gradient itself: the directional derivative along it */
      double gn = 0.0;
      for (size_t i = 0; i < total; i++) gn += (double)grads[r][i] * grads[r][i];
      gn = sqrt(gn);
      float *u = malloc(sizeof(float) * total);
      for (size_t i = 0; i < total; i++) u[i] = (float)(grads[r][i] / gn);
      /* |g| is small over 16K positions: a step of 1e-5·L/|g| (measured: error 2e-5 there, 5e-3
       * at 1e-4·L/|g| from truncation) */
      double fd = directional(&m, 3, u, 0, total, 1e-5 * loss[r] / gn);
      TU_ASSERT_CLOSE(fabs(fd - gn) / gn, 1e-3, "chunked MLP: all parameters");
      free(u);
    }
    model_free(&m);
    config_free(&cfg);
  }
  assert_true(loss[0] == loss[1]);
  assert_memory_equal(grads[0], grads[1], sizeof(float) * total);
  free(grads[0]);
  free(grads[1]);
}

/* Initial parameters follow SPEC §5: norms 1/0, biases 0, weights N(0, 0.02), residual outputs
 * N(0, 0.02/√(2L)). */
static void test_init(void **state) {
  struct config cfg;
  make_config(&cfg, "full", "learned", "clm", true, 0.0, false);
  cfg.model.dim = 64;
  cfg.model.layers = 3;
  struct model m;
  model_build(&m, &cfg, NULL, 1);
  model_init_params(&m);
  for (int t = 0; t < m.plist.count; t++) {
    const struct param_desc *p = &m.plist.p[t];
    const float *x = m.params + p->offset;
    double s = 0.0, s2 = 0.0;
    for (size_t i = 0; i < p->numel; i++) {
      s += x[i];
      s2 += (double)x[i] * x[i];
    }
    double mean = s / p->numel, sd = sqrt(s2 / p->numel - mean * mean);
    bool resid = strstr(p->name, "attn/wo") || strstr(p->name, "mlp/w2");
    if (strstr(p->name, "norm") && strstr(p->name, "weight")) {
      if (mean != 1.0 || sd != 0.0) fail_msg("%s is not all ones", p->name);
    } else if (strstr(p->name, "bias") || strstr(p->name, "/b")) {
      if (s2 != 0.0) fail_msg("%s is not zero", p->name);
    } else {
      double want = resid ? 0.02 / sqrt(2.0 * m.L) : 0.02;
      if (fabs(sd - want) > 0.1 * want) fail_msg("%s: std %.4f, expected %.4f", p->name, sd, want);
    }
  }
  model_free(&m);
  config_free(&cfg);
}

/* AdamW's first step moves an element by lr·lr_scale·m̂/(√v̂ + ε) = ±lr·lr_scale (no decay here):
 * the fma summary weights at lr·p/taps with fma.down_lr = scaled (docs/fma.md), every other
 * tensor — and every tensor with plain — at lr, each against its gradient's sign. */
static void test_optimizer_lr_scale(void **state) {
  (void)state;
  for (int plain = 0; plain < 2; plain++) {
    struct config cfg;
    make_config(&cfg, "fma", "learned", "clm", true, 0.0, false);
    cfg.attention.fma_down_lr = plain ? FMA_LR_PLAIN : FMA_LR_SCALED;
    cfg.train.weight_decay = 0.0;
    struct model m;
    model_build(&m, &cfg, NULL, 1);
    model_init_params(&m);
    const size_t total = m.plist.total;
    float *before = malloc(sizeof(float) * total);
    memcpy(before, m.params, sizeof(float) * total);
    for (size_t e = 0; e < total; e++) m.grads[e] = (e % 2 ? 1.0f : -1.0f) * (float)(1 + e % 3);
    const double lr = 1e-3;
    optimizer_step(&m, 1, lr, 1.0f);
    int scaled = 0;
    for (int t = 0; t < m.plist.count; t++) {
      const struct param_desc *p = &m.plist.p[t];
      const bool down_weight = strstr(p->name, "_down/") && strstr(p->name, "/weight");
      const double want = lr * (down_weight && !plain ? (double)p->shape[1] / p->shape[2] : 1.0);
      scaled += down_weight && !plain;
      for (size_t e = 0; e < p->numel; e++) {
        const size_t i = p->offset + e;
        const double step = (double)m.params[i] - before[i];
        if (fabs(fabs(step) - want) > 1e-3 * want || step * m.grads[i] > 0)
          fail_msg("%s (down_lr %s) element %zu moved by %g, expected %g against the gradient",
                   p->name, plain ? "plain" : "scaled", e, step, want);
      }
    }
    if (!plain && scaled == 0) fail_msg("no fma summary weight was found to check");
    free(before);
    model_free(&m);
    config_free(&cfg);
  }
}

static const struct CMUnitTest tests[] = {
    cmocka_unit_test(test_gradient_positions), cmocka_unit_test(test_gradient_head_and_objective),
    cmocka_unit_test(test_gradient_dropout),   cmocka_unit_test(test_recompute_identical),
    cmocka_unit_test(test_chunked_mlp),        cmocka_unit_test(test_init),
    cmocka_unit_test(test_optimizer_lr_scale), cmocka_unit_test(test_heads_in_place_identical),
};

TU_MAIN(tests)
