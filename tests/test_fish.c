/* FiSH heads (SPEC §6.9) on `full` and `local` through their ops tables against an independent
 * float64 implementation written from the SPEC text: G global scores s_k = q_k·k_k per pair, the
 * training noise σ·ε with ε keyed by (step, layer, global head, global sample, i, j), the linear
 * (ℓ_h = Σ_k P[h,k] s_k) or MLP (ℓ_h = W2·ReLU(W1·s + b1) + b2) mixing, 1/√d, the mask and a
 * softmax over each value head's keys; the output and every gradient (q, k, v and each mixing
 * parameter) by central differences of the oracle; causal and bidirectional, with and without
 * noise; causality by perturbation; refusal of variants FiSH cannot compose with. */
#include "testutil.h"

#include "../src/attention/attention.h"
#include "../src/config.h"

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

/* out (H, n, d) of batch element `sample`: q, k (G, n, d), v (H, n, d). */
static void oracle(const struct fcase *t, const struct fparams *p, long step, int layer,
                   long sample, double *out, const double *q, const double *k, const double *v) {
  const long n = t->n, d = t->d;
  double *L = malloc(sizeof(double) * n), s[8];
  for (int h = 0; h < t->H; h++)
    for (long i = 0; i < n; i++) {
      double mx = -INFINITY, z = 0;
      for (long j = 0; j < n; j++) {
        L[j] = -INFINITY;
        if ((t->causal && j > i) || (t->band > 0 && labs(i - j) >= t->band)) continue;
        for (int g = 0; g < t->G; g++) {
          double dot = 0;
          for (long c = 0; c < d; c++) dot += q[(g * n + i) * d + c] * k[(g * n + j) * d + c];
          if (t->noise >
              0) { /* SPEC §6.9's key, extended by layer and sample (docs/nystrom_fish.md) */
            const uint64_t head = ((uint64_t)(layer * t->G + g) << 40) | (uint64_t)sample;
            dot += t->noise * (double)(float)rng_normal(1234, RNG_NOISE, (uint64_t)step, head,
                                                        (uint64_t)(i * n + j));
          }
          s[g] = dot;
        }
        L[j] = mix_logit(p, s, h) / sqrt((double)d);
        if (L[j] > mx) mx = L[j];
      }
      for (long c = 0; c < d; c++) out[(h * n + i) * d + c] = 0;
      for (long j = 0; j < n; j++) {
        if (L[j] == -INFINITY) continue;
        const double e = exp(L[j] - mx);
        z += e;
        for (long c = 0; c < d; c++) out[(h * n + i) * d + c] += e * v[(h * n + j) * d + c];
      }
      for (long c = 0; c < d; c++) out[(h * n + i) * d + c] /= z;
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
  char items[12][96];
  struct config_overrides ov = {0};
  int c = 0;
  snprintf(items[c++], 96, "attention.variant=%s", t->variant);
  snprintf(items[c++], 96, "attention.heads_mode=fish");
  snprintf(items[c++], 96, "attention.fish.global_heads=%d", t->G);
  snprintf(items[c++], 96, "attention.fish.mix=%s", t->mix);
  snprintf(items[c++], 96, "attention.fish.noise=%g", t->noise);
  snprintf(items[c++], 96, "model.context=%ld", t->n);
  snprintf(items[c++], 96, "model.heads=%d", t->H);
  snprintf(items[c++], 96, "model.dim=%ld", t->H * t->d);
  snprintf(items[c++], 96, "model.objective=%s", t->causal ? "clm" : "mlm");
  snprintf(items[c++], 96, "data.source=copy");
  snprintf(items[c++], 96, "attention.local.band=%d", t->band > 0 ? t->band : 8);
  snprintf(items[c++], 96, "attention.full.block=16");
  for (int i = 0; i < c; i++) ov.items[ov.count++] = items[i];
  char err[CONFIG_ERR_LEN];
  if (config_load(cfg, NULL, &ov, err, sizeof err)) fail_msg("config: %s", err);
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
  struct attn_ctx ctx = attention_open(&cfg, var, DEVICE_CPU, NULL, 0,
                                       (struct attn_dims){B, H, n, d, n, 0, t->causal});
  ctx.step = 17;
  ctx.train = true;
  ctx.sample0 = 5;
  float *out = calloc(XV, 4), *dq = calloc(XQ, 4), *dk = calloc(XQ, 4), *dv = calloc(XV, 4);
  float *saved = calloc(attention_saved_floats(&ctx) + 1, 4);
  attention_forward(&ctx, out, saved, q, k, v, ap.params);
  attention_backward(&ctx, dq, dk, dv, ap.dparams, g, q, k, v, ap.params, out, saved);
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
  TU_ASSERT_CLOSE(tu_rel_err(out, o, XV), 1e-5, what);
  snprintf(w2, sizeof w2, "%s: dq", what);
  TU_ASSERT_CLOSE(tu_rel_err(dq, eq, XQ), 1e-4, w2);
  snprintf(w2, sizeof w2, "%s: dk", what);
  TU_ASSERT_CLOSE(tu_rel_err(dk, ek, XQ), 1e-4, w2);
  snprintf(w2, sizeof w2, "%s: dv", what);
  TU_ASSERT_CLOSE(tu_rel_err(dv, ev, XV), 1e-4, w2);
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
  free(q), free(k), free(v), free(g), free(out), free(dq), free(dk), free(dv), free(saved);
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

/* Outputs before j stay put when q, k, v at j move. */
static void test_causality(void **state) {
  const char *mixes[] = {"linear", "mlp"};
  for (int mi = 0; mi < 2; mi++) {
    const struct fcase t = {"full", mixes[mi], 70, 4, 2, 3, 0, true, 0.3};
    const long B = 1, n = t.n, d = t.d, XQ = B * t.G * n * d, XV = B * t.H * n * d;
    struct config cfg;
    make_config(&cfg, &t);
    const struct attn_variant *var = attention_select(&cfg);
    struct attn_params ap;
    attention_params_make(&ap, &cfg, var, n);
    float *q = malloc(4 * XQ), *k = malloc(4 * XQ), *v = malloc(4 * XV);
    float *o1 = calloc(XV, 4), *o2 = calloc(XV, 4), *sv = calloc(B * t.H * n + 1, 4);
    tu_randn(q, XQ, 1, 1.0f);
    tu_randn(k, XQ, 2, 1.0f);
    tu_randn(v, XV, 3, 1.0f);
    struct attn_ctx ctx = attention_open(&cfg, var, DEVICE_CPU, NULL, 0,
                                         (struct attn_dims){B, t.H, n, d, n, 0, true});
    ctx.train = true;
    attention_forward(&ctx, o1, sv, q, k, v, ap.params);
    const long j = 40;
    for (long g = 0; g < t.G; g++)
      for (long c = 0; c < d; c++) q[(g * n + j) * d + c] += 2, k[(g * n + j) * d + c] -= 1;
    for (long h = 0; h < t.H; h++)
      for (long c = 0; c < d; c++) v[(h * n + j) * d + c] += 3;
    attention_forward(&ctx, o2, sv, q, k, v, ap.params);
    for (long h = 0; h < t.H; h++)
      for (long i = 0; i < j * d; i++)
        if (o1[h * n * d + i] != o2[h * n * d + i])
          fail_msg("fish %s: output %ld moved", t.mix, i / d);
    attention_close(&ctx);
    free(q), free(k), free(v), free(o1), free(o2), free(sv);
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

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  cmocka_set_message_output(CM_OUTPUT_TAP);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_matches_oracle),
      cmocka_unit_test(test_causality),
      cmocka_unit_test(test_refusals),
  };
  int rc = cmocka_run_group_tests(tests, NULL, NULL);
  MPI_Finalize();
  return rc;
}
