/* FiSH heads (SPEC §6.9) on `full` and `local` through their ops tables against a float64 oracle
 * written from the SPEC text (G global scores per pair, the keyed training noise, the linear or
 * MLP mix, the mask, a softmax per value head): the output and every gradient of q, k, v and the
 * mixing parameters by central differences of the oracle, causal and bidirectional, with and
 * without noise; causality by perturbation; the variants FiSH cannot compose with are refused. */
#include "testutil.h"

#include "../src/attention/attention.h"
#include "../src/deck/config.h"

struct fcase {
  const char *variant, *mix;
  long n, d;
  int G, H, band;
  bool causal;
  double noise;
};

/* The mixing parameters of one layer, in the test's own (double) copies. */
struct fparams {
  int G, H, R;
  bool mlp;
  double *P, *W1, *b1, *W2, *b2;
};

/* ℓ_h of one pair from its global scores s (G). */
static double mix_logit(const struct fparams *p, const double *s, int h) {
  if (!p->mlp) {
    double l = 0;
    for (int k = 0; k < p->G; k++) l += p->P[h * p->G + k] * s[k];
    return l;
  }
  double l = p->b2[h];
  for (int r = 0; r < p->R; r++) {
    double z = p->b1[r];
    for (int k = 0; k < p->G; k++) z += p->W1[r * p->G + k] * s[k];
    l += p->W2[h * p->R + r] * (z > 0 ? z : 0);
  }
  return l;
}

/* out (H, n, d) of batch element `sample`: q, k (G, n, d), v (H, n, d). The mixed logits of
 * each value head, masked, through the shared dense softmax (testutil.c). */
static void oracle(const struct fcase *t, const struct fparams *p, long step, int layer,
                   long sample, double *out, const double *q, const double *k, const double *v) {
  const long n = t->n, d = t->d;
  const struct tu_mask mask = {t->causal, t->band};
  double *L = malloc(sizeof(double) * n * n), s[8]; /* (n, n) one head's logits */
  for (int h = 0; h < t->H; h++) {
    for (long i = 0; i < n; i++)
      for (long j = 0; j < n; j++) {
        L[i * n + j] = -INFINITY;
        if (!tu_mask_allowed(i, j, &mask)) continue;
        for (int g = 0; g < t->G; g++) {
          double dot = 0;
          for (long c = 0; c < d; c++) dot += q[(g * n + i) * d + c] * k[(g * n + j) * d + c];
          if (t->noise > 0) { /* SPEC §6.9's key, by layer and sample (docs/nystrom_fish.md) */
            const uint64_t head = ((uint64_t)(layer * t->G + g) << 40) | (uint64_t)sample;
            dot += t->noise * (double)(float)rng_normal(1234, RNG_NOISE, (uint64_t)step, head,
                                                        (uint64_t)(i * n + j));
          }
          s[g] = dot;
        }
        L[i * n + j] = mix_logit(p, s, h) / sqrt((double)d);
      }
    tu_dense_softmax(out + h * n * d, NULL, NULL, L, v + h * n * d, NULL, n, n, d);
  }
  free(L);
}

static double oracle_dot(const struct fcase *t, const struct fparams *p, long sample,
                         const double *g, const double *q, const double *k, const double *v) {
  const long X = t->H * t->n * t->d;
  double *o = malloc(sizeof(double) * X), j = 0;
  oracle(t, p, 17, 0, sample, o, q, k, v);
  for (long e = 0; e < X; e++) j += g[e] * o[e];
  free(o);
  return j;
}

static void make_config(struct config *cfg, const struct fcase *t) {
  tu_config(
      cfg, t->variant, t->n, t->H, (int)t->d, t->causal,
      TU_SETS("attention.heads_mode=fish", tu_fmt("attention.fish.global_heads=%d", t->G),
              tu_fmt("attention.fish.mix=%s", t->mix), tu_fmt("attention.fish.noise=%g", t->noise),
              tu_fmt("attention.local.band=%d", t->band > 0 ? t->band : 8),
              "attention.full.block=16"));
}

/* The test's double copy of the parameter block (laid out as fish.c registers it). */
static struct fparams copy_params(const struct fcase *t, const struct attn_params *ap) {
  struct fparams p = {.G = t->G, .H = t->H, .R = t->H, .mlp = strcmp(t->mix, "mlp") == 0};
  double *all = tu_to_double(ap->params, ap->list.total);
  if (!p.mlp) {
    p.P = all + ap->list.p[0].offset;
  } else {
    p.W1 = all + ap->list.p[0].offset;
    p.b1 = all + ap->list.p[1].offset;
    p.W2 = all + ap->list.p[2].offset;
    p.b2 = all + ap->list.p[3].offset;
  }
  return p;
}

static double *params_base(const struct fparams *p) { return p->mlp ? p->W1 : p->P; }

static void check_case(const struct fcase *t) {
  const long B = 2, n = t->n, d = t->d, G = t->G, H = t->H;
  const long XQ = B * G * n * d, XV = B * H * n * d;
  struct config cfg;
  make_config(&cfg, t);
  const struct attn_variant *var = attention_select(&cfg);
  assert_non_null(var);
  char err[CONFIG_ERR_LEN];
  if (attention_check(&cfg, n, 1, err, sizeof err)) fail_msg("check: %s", err);
  float *q = malloc(4 * XQ), *k = malloc(4 * XQ), *v = malloc(4 * XV), *g = malloc(4 * XV);
  tu_randn(q, XQ, 900 + n, 1.0f);
  tu_randn(k, XQ, 910 + n, 1.0f);
  tu_randn(v, XV, 920 + n, 1.0f);
  tu_randn(g, XV, 930 + n, 1.0f);
  struct attn_params ap;
  attention_params_make(&ap, &cfg, var, n);
  for (size_t e = 0; e < ap.list.total; e++) /* off their initial values */
    ap.params[e] += 0.2f * (float)rng_normal(5, RNG_TEST, 71, e, 0);
  struct attn_ctx ctx = tu_attn_open(&cfg, B);
  ctx.step = 17;
  ctx.train = true;
  ctx.sample0 = 5;
  struct tu_run r = tu_attn_run(&ctx, ap.params, ap.dparams, q, k, v, g);
  attention_close(&ctx);
  struct fparams fp = copy_params(t, &ap);
  double *base = params_base(&fp) - ap.list.p[0].offset; /* the whole block, as copied */
  double *o = malloc(8 * XV), *eq = malloc(8 * XQ), *ek = malloc(8 * XQ), *ev = malloc(8 * XV);
  double *ep = calloc(ap.list.total + 1, 8);
  const double h = 1e-5;
  for (long b = 0; b < B; b++) {
    double *qd = tu_to_double(q + b * G * n * d, G * n * d),
           *kd = tu_to_double(k + b * G * n * d, G * n * d);
    double *vd = tu_to_double(v + b * H * n * d, H * n * d),
           *gd = tu_to_double(g + b * H * n * d, H * n * d);
    oracle(t, &fp, 17, 0, 5 + b, o + b * H * n * d, qd, kd, vd);
    for (long e = 0; e < G * n * d; e++) {
      TU_FD(eq[b * G * n * d + e], qd, e, h, oracle_dot(t, &fp, 5 + b, gd, qd, kd, vd));
      TU_FD(ek[b * G * n * d + e], kd, e, h, oracle_dot(t, &fp, 5 + b, gd, qd, kd, vd));
    }
    for (long e = 0; e < H * n * d; e++)
      TU_FD(ev[b * H * n * d + e], vd, e, h, oracle_dot(t, &fp, 5 + b, gd, qd, kd, vd));
    for (int i = 0; i < ap.list.count; i++) /* every mixing parameter, summed over the batch */
      for (size_t e = 0; e < ap.list.p[i].numel; e++) {
        double fd;
        double *x = base + ap.list.p[i].offset;
        TU_FD(fd, x, e, h, oracle_dot(t, &fp, 5 + b, gd, qd, kd, vd));
        ep[ap.list.p[i].offset + e] += fd;
      }
    free(qd), free(kd), free(vd), free(gd);
  }
  char what[200], w2[420];
  snprintf(what, sizeof what, "fish %s %s n=%ld d=%ld G=%d H=%d band=%d %s noise=%g", t->variant,
           t->mix, n, d, t->G, t->H, t->band, t->causal ? "causal" : "bidir", t->noise);
  TU_ASSERT_CLOSE(tu_rel_err(r.out, o, XV), 1e-5, what);
  snprintf(w2, sizeof w2, "%s: dq", what);
  TU_ASSERT_CLOSE(tu_rel_err(r.dq, eq, XQ), 1e-4, w2);
  snprintf(w2, sizeof w2, "%s: dk", what);
  TU_ASSERT_CLOSE(tu_rel_err(r.dk, ek, XQ), 1e-4, w2);
  snprintf(w2, sizeof w2, "%s: dv", what);
  TU_ASSERT_CLOSE(tu_rel_err(r.dv, ev, XV), 1e-4, w2);
  /* relative to the largest parameter gradient of the layer: b2 shifts all of a head's logits
   * alike, which its softmax ignores, so its true gradient is exactly 0 */
  double scale = 1e-30;
  for (size_t e = 0; e < ap.list.total; e++) scale = fabs(ep[e]) > scale ? fabs(ep[e]) : scale;
  for (int i = 0; i < ap.list.count; i++) {
    const struct param_desc *p = &ap.list.p[i];
    double worst = 0;
    for (size_t e = 0; e < p->numel; e++) {
      const double diff = fabs((double)ap.dparams[p->offset + e] - ep[p->offset + e]);
      worst = diff > worst ? diff : worst;
    }
    snprintf(w2, sizeof w2, "%s: d%s", what, p->name);
    TU_ASSERT_CLOSE(worst / scale, 1e-4, w2);
  }
  tu_run_free(&r);
  free(q), free(k), free(v), free(g);
  free(o), free(eq), free(ek), free(ev), free(ep), free(base);
  attention_params_free(&ap);
  config_free(&cfg);
}

static void test_matches_oracle(void **state) {
  const struct fcase cases[] = {
      {"full", "linear", 37, 4, 2, 3, 0, true, 0},   {"full", "linear", 37, 4, 2, 3, 0, false, 0},
      {"full", "mlp", 40, 4, 2, 4, 0, true, 0},      {"full", "mlp", 40, 4, 1, 3, 0, false, 0},
      {"local", "linear", 45, 4, 2, 3, 7, true, 0},  {"local", "mlp", 45, 4, 3, 4, 20, false, 0},
      {"full", "linear", 33, 4, 2, 3, 0, true, 0.5}, {"local", "mlp", 33, 4, 2, 3, 5, false, 0.7},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) check_case(&cases[i]);
}

/* Causality by perturbation (testutil.c), with the training noise on: outputs before j stay
 * put when the global q, k and the values at j move, and output j moves. */
static void test_causality(void **state) {
  const char *mixes[] = {"linear", "mlp"};
  for (int mi = 0; mi < 2; mi++) {
    const struct fcase t = {"full", mixes[mi], 70, 4, 2, 3, 0, true, 0.3};
    const long B = 1, n = t.n, d = t.d, XQ = B * t.G * n * d, XV = B * t.H * n * d;
    struct config cfg;
    make_config(&cfg, &t);
    struct attn_params ap;
    attention_params_make(&ap, &cfg, attention_select(&cfg), n);
    float *q = malloc(4 * XQ), *k = malloc(4 * XQ), *v = malloc(4 * XV);
    tu_randn(q, XQ, 1, 1.0f);
    tu_randn(k, XQ, 2, 1.0f);
    tu_randn(v, XV, 3, 1.0f);
    struct attn_ctx ctx = tu_attn_open(&cfg, B);
    ctx.train = true;
    const long at[] = {0, 40, 69};
    const struct tu_probe probe = {at, sizeof at / sizeof at[0], TU_MOVE_QKV, false};
    char what[64];
    snprintf(what, sizeof what, "fish %s", t.mix);
    if (tu_causality(&ctx, ap.params, q, k, v, &probe, what))
      fail_msg("%s: causality probes failed (listed above)", what);
    attention_close(&ctx);
    free(q), free(k), free(v);
    attention_params_free(&ap);
    config_free(&cfg);
  }
}

/* FiSH composes with full and local only: the others are refused with a reason. */
static void test_refusals(void **state) {
  const char *others[] = {"fma", "fma_linear", "linear", "fmmformer", "rmfa"};
  for (size_t i = 0; i < sizeof others / sizeof others[0]; i++) {
    struct config cfg;
    const struct fcase t = {others[i], "linear", 128, 4, 1, 2, 0, true, 0};
    make_config(&cfg, &t);
    char err[CONFIG_ERR_LEN];
    assert_int_not_equal(attention_check(&cfg, 128, 1, err, sizeof err), 0);
    if (!strstr(err, "composes with attention.variant = full or local"))
      fail_msg("%s: %s", others[i], err);
    config_free(&cfg);
  }
}

static const struct CMUnitTest tests[] = {
    cmocka_unit_test(test_matches_oracle),
    cmocka_unit_test(test_causality),
    cmocka_unit_test(test_refusals),
};

TU_MAIN(tests)
