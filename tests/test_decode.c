/* The decode caches of generation (ops decode_open/step/close) against the batched causal
 * forward: one position at a time gives every position's forward row within 1e-5, for full, local
 * (a ring of the band), linear, fmmformer (band ring and running sums), rmfa, and fma with conv,
 * m2m and avg summaries, multiplicity on and off (summaries accumulated token by token, M2M on
 * completed windows); the variants without a cache say so by a NULL decode_open. */
#include "testutil.h"

#include "../src/attention/attention.h"
#include "../src/deck/config.h"

static void check_decode(const char *variant, long n, const char *extra[]) {
  const long H = 2, d = 8, X = H * n * d;
  struct config cfg;
  tu_config(&cfg, variant, n, (int)H, (int)d, true, extra);
  const struct attn_variant *var = attention_select(&cfg);
  assert_non_null(var);
  assert_non_null(var->decode_open);
  struct attn_params ap;
  attention_params_make(&ap, &cfg, var, n);
  for (int i = 0; i < ap.list.count; i++) /* trainable parameters off their initial values */
    for (size_t e = 0; e < ap.list.p[i].numel && !ap.list.p[i].frozen; e++)
      ap.params[ap.list.p[i].offset + e] += 0.1f * (float)rng_normal(8, RNG_TEST, 3, i, e);
  const float *pp = ap.list.count ? ap.params : NULL;
  float *q = malloc(4 * X), *k = malloc(4 * X), *v = malloc(4 * X), *out = calloc(X, 4);
  tu_randn(q, X, 41, 1.0f);
  tu_randn(k, X, 42, 1.0f);
  tu_randn(v, X, 43, 1.0f);
  struct attn_ctx ctx = tu_attn_open(&cfg, 1);
  float *saved = calloc(attention_saved_floats(&ctx) + 1, 4);
  attention_forward(&ctx, out, saved, q, k, v, pp);
  void *cache = var->decode_open(&ctx, pp);
  float *qi = malloc(4 * H * d), *ki = malloc(4 * H * d), *vi = malloc(4 * H * d);
  float *oi = malloc(4 * H * d);
  double worst = 0, top = 1e-30;
  for (long i = 0; i < n; i++) {
    for (long h = 0; h < H; h++) { /* position i of every head */
      memcpy(qi + h * d, q + (h * n + i) * d, 4 * d);
      memcpy(ki + h * d, k + (h * n + i) * d, 4 * d);
      memcpy(vi + h * d, v + (h * n + i) * d, 4 * d);
    }
    var->decode_step(&ctx, cache, oi, qi, ki, vi, i, pp);
    for (long h = 0; h < H; h++)
      for (long f = 0; f < d; f++) {
        const double ref = out[(h * n + i) * d + f], e = fabs(oi[h * d + f] - ref);
        worst = e > worst ? e : worst;
        top = fabs(ref) > top ? fabs(ref) : top;
      }
  }
  var->decode_close(cache);
  attention_close(&ctx);
  char what[200];
  snprintf(what, sizeof what, "decode %s n=%ld%s%s", variant, n, extra && extra[0] ? " " : "",
           extra && extra[0] ? extra[0] : "");
  TU_ASSERT_CLOSE(worst / top, 1e-5, what);
  free(q), free(k), free(v), free(out), free(saved), free(qi), free(ki), free(vi), free(oi);
  attention_params_free(&ap);
  config_free(&cfg);
}

static void test_exact(void **state) {
  check_decode("full", 70, NULL);
  const char *band[] = {"attention.local.band=9", NULL};
  check_decode("local", 70, band);
  const char *wide[] = {"attention.local.band=200", NULL};
  check_decode("local", 50, wide);
}

static void test_kernelized(void **state) {
  check_decode("linear", 70, NULL);
  const char *f[] = {"attention.fmmformer.kernels=elu,elu_neg,tanh", "attention.fmmformer.band=7",
                     NULL};
  check_decode("fmmformer", 70, f);
  const char *r[] = {"attention.rmfa.features=16", "attention.rmfa.kernel=log", NULL};
  check_decode("rmfa", 70, r);
  const char *r2[] = {"attention.rmfa.ppsbn=false", "attention.rmfa.features=8", NULL};
  check_decode("rmfa", 40, r2);
}

static void test_fma(void **state) {
  const char *downs[] = {"conv", "m2m", "avg"};
  for (int i = 0; i < 3; i++)
    for (int mult = 0; mult < 2; mult++) {
      char a[64], b[64];
      snprintf(a, sizeof a, "attention.fma.downsample=%s", downs[i]);
      snprintf(b, sizeof b, "attention.fma.multiplicity=%s", mult ? "true" : "false");
      const char *x[] = {a, b, "attention.fma.m=4", "attention.fma.p=2", NULL};
      check_decode("fma", 64, x); /* 16 blocks, 3 levels */
      const char *y[] = {a, b, "attention.fma.m=8", "attention.fma.p=4", NULL};
      check_decode("fma", 256, y); /* 32 blocks, 4 levels */
    }
}

/* fma.open (SPEC §6.4a): the cache keeps every key and value, and each token opens its windows
 * as the batched forward's row does; conv and m2m with parameters off their init, K = 1, 2, all. */
static void test_fma_open(void **state) {
  const char *downs[] = {"conv", "m2m", "avg"}, *opens[] = {"1", "2", "all"};
  for (int i = 0; i < 3; i++)
    for (int o = 0; o < 3; o++) {
      char a[64], b[64];
      snprintf(a, sizeof a, "attention.fma.downsample=%s", downs[i]);
      snprintf(b, sizeof b, "attention.fma.open=%s", opens[o]);
      const char *x[] = {
          a, b, "attention.fma.m=4", "attention.fma.p=2", "attention.fma.init=random", NULL};
      check_decode("fma", 64, x);
      const char *y[] = {a, b, "attention.fma.m=8", "attention.fma.p=4", NULL};
      check_decode("fma", 256, y);
    }
}

/* Variants without a cache say so (generation then recomputes, with a note). */
static void test_without_cache(void **state) {
  struct config cfg;
  tu_config(&cfg, "fma_linear", 128, 2, 8, true, NULL);
  assert_null(attention_select(&cfg)->decode_open);
  config_free(&cfg);
  const char *fish[] = {"attention.heads_mode=fish", NULL};
  tu_config(&cfg, "full", 64, 2, 8, true, fish);
  assert_null(attention_select(&cfg)->decode_open);
  config_free(&cfg);
}

static const struct CMUnitTest tests[] = {
    cmocka_unit_test(test_exact),         cmocka_unit_test(test_kernelized),
    cmocka_unit_test(test_fma),           cmocka_unit_test(test_fma_open),
    cmocka_unit_test(test_without_cache),
};

TU_MAIN(tests)
