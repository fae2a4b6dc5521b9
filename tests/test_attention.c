/* Attention variants through their ops table against dense references in double precision:
 * `full` against materialised softmax(q kᵀ/√d + mask) v, with gradients from the dense formulas
 * (themselves checked against central finite differences), for n that is and is not a multiple of
 * the tile, causal and bidirectional; causality by perturbation; the attention diagnostics (mass
 * per distance band and entropy of sampled softmax rows) against the dense rows. */
#include "testutil.h"

#include "../src/attention/attention.h"
#include "../src/config.h"
#include "../src/fma/lists.h"
#include "../src/memory.h"

/* Whether query i may see key j: j ≤ i when causal, |i − j| < band when band > 0. */
static bool allowed(long i, long j, bool causal, long band) {
  if (causal && j > i) return false;
  return band <= 0 || (j > i - band && j < i + band);
}

/* Dense attention of one head in double: out (n, d); with dout, also dq, dk, dv. */
static void dense_attention_band(double *out, double *dq, double *dk, double *dv, const double *q,
                                 const double *k, const double *v, const double *dout, long n,
                                 long d, bool causal, long band) {
  double *P = calloc((size_t)(n * n), sizeof(double));
  const double scale = 1.0 / sqrt((double)d);
  for (long i = 0; i < n; i++) {
    double mx = -INFINITY;
    for (long j = 0; j < n; j++) {
      if (!allowed(i, j, causal, band)) continue;
      double s = 0.0;
      for (long c = 0; c < d; c++) s += q[i * d + c] * k[j * d + c];
      P[i * n + j] = s * scale;
      if (P[i * n + j] > mx) mx = P[i * n + j];
    }
    double z = 0.0;
    for (long j = 0; j < n; j++) {
      P[i * n + j] = allowed(i, j, causal, band) ? exp(P[i * n + j] - mx) : 0.0;
      z += P[i * n + j];
    }
    for (long j = 0; j < n; j++) P[i * n + j] /= z;
    for (long c = 0; c < d; c++) {
      double s = 0.0;
      for (long j = 0; j < n; j++) s += P[i * n + j] * v[j * d + c];
      out[i * d + c] = s;
    }
  }
  if (dout) {
    memset(dq, 0, sizeof(double) * n * d);
    memset(dk, 0, sizeof(double) * n * d);
    memset(dv, 0, sizeof(double) * n * d);
    for (long i = 0; i < n; i++) {
      double Di = 0.0;
      for (long c = 0; c < d; c++) Di += dout[i * d + c] * out[i * d + c];
      for (long j = 0; j < n; j++) {
        double p = P[i * n + j];
        if (p == 0.0) continue;
        double dp = 0.0;
        for (long c = 0; c < d; c++) {
          dp += dout[i * d + c] * v[j * d + c];
          dv[j * d + c] += p * dout[i * d + c];
        }
        double ds = p * (dp - Di) * scale;
        for (long c = 0; c < d; c++) {
          dq[i * d + c] += ds * k[j * d + c];
          dk[j * d + c] += ds * q[i * d + c];
        }
      }
    }
  }
  free(P);
}

static void dense_attention(double *out, double *dq, double *dk, double *dv, const double *q,
                            const double *k, const double *v, const double *dout, long n, long d,
                            bool causal) {
  dense_attention_band(out, dq, dk, dv, q, k, v, dout, n, d, causal, 0);
}

static double dense_j(const double *q, const double *k, const double *v, const double *g, long n,
                      long d, bool causal) {
  double *o = malloc(sizeof(double) * n * d);
  dense_attention(o, NULL, NULL, NULL, q, k, v, NULL, n, d, causal);
  double j = 0.0;
  for (long i = 0; i < n * d; i++) j += g[i] * o[i];
  free(o);
  return j;
}

/* The dense reference's gradients are right: central differences on a tiny case. */
static void test_dense_reference_gradients(void **state) {
  for (int causal = 0; causal < 2; causal++) {
    const long n = 7, d = 3, N = n * d;
    double q[N], k[N], v[N], g[N], o[N], dq[N], dk[N], dv[N], f[N];
    tu_randn_d(q, N, 1, 1.0);
    tu_randn_d(k, N, 2, 1.0);
    tu_randn_d(v, N, 3, 1.0);
    tu_randn_d(g, N, 4, 1.0);
    dense_attention(o, dq, dk, dv, q, k, v, g, n, d, causal);
    for (long i = 0; i < N; i++) TU_FD(f[i], q, i, 1e-6, dense_j(q, k, v, g, n, d, causal));
    TU_ASSERT_CLOSE(tu_rel_err_dd(dq, f, N), 1e-7, "dense dq");
    for (long i = 0; i < N; i++) TU_FD(f[i], k, i, 1e-6, dense_j(q, k, v, g, n, d, causal));
    TU_ASSERT_CLOSE(tu_rel_err_dd(dk, f, N), 1e-7, "dense dk");
    for (long i = 0; i < N; i++) TU_FD(f[i], v, i, 1e-6, dense_j(q, k, v, g, n, d, causal));
    TU_ASSERT_CLOSE(tu_rel_err_dd(dv, f, N), 1e-7, "dense dv");
  }
}

/* The band of `local` in the next make_config. */
static int local_band = 128;

/* A configuration with the given variant and tile, from the built-in defaults. */
static void make_config(struct config *cfg, const char *variant, long n, int H, int d, bool causal,
                        int tile) {
  char items[9][96];
  struct config_overrides ov = {0};
  snprintf(items[0], 96, "attention.variant=%s", variant);
  snprintf(items[1], 96, "model.context=%ld", n);
  snprintf(items[2], 96, "model.heads=%d", H);
  snprintf(items[3], 96, "model.dim=%d", H * d);
  snprintf(items[4], 96, "model.objective=%s", causal ? "clm" : "mlm");
  snprintf(items[5], 96, "attention.full.block=%d", tile);
  snprintf(items[6], 96, "data.source=copy");
  snprintf(items[7], 96, "model.position=none");
  snprintf(items[8], 96, "attention.local.band=%d", local_band > 0 ? local_band : 128);
  for (int i = 0; i < 9; i++) ov.items[ov.count++] = items[i];
  char err[4096];
  if (config_load(cfg, NULL, &ov, err, sizeof err)) fail_msg("config: %s", err);
}

struct run_out {
  float *out, *dq, *dk, *dv;
};

static struct run_out run_variant(const struct config *cfg, long B, long H, long n, long d,
                                  bool causal, const float *q, const float *k, const float *v,
                                  const float *dout) {
  const struct attn_variant *var = attention_find(cfg->attention.variant);
  assert_non_null(var);
  struct attn_ctx ctx =
      attention_open(cfg, var, DEVICE_CPU, NULL, 0, (struct attn_dims){B, H, n, d, n, 0, causal});
  size_t count = (size_t)(B * H * n * d);
  struct run_out r = {calloc(count, 4), calloc(count, 4), calloc(count, 4), calloc(count, 4)};
  float *saved = calloc(attention_saved_floats(&ctx) + 1, sizeof(float));
  attention_forward(&ctx, r.out, saved, q, k, v, NULL);
  if (dout) attention_backward(&ctx, r.dq, r.dk, r.dv, NULL, dout, q, k, v, NULL, r.out, saved);
  attention_close(&ctx);
  free(saved);
  return r;
}

static void free_run(struct run_out *r) {
  free(r->out);
  free(r->dq);
  free(r->dk);
  free(r->dv);
}

static void check_exact(const char *variant, long band, long n, long d, int tile, bool causal) {
  const long B = 2, H = 2, count = B * H * n * d;
  struct config cfg;
  local_band = (int)band;
  make_config(&cfg, variant, n, (int)H, (int)d, causal, tile);
  float *q = malloc(4 * count), *k = malloc(4 * count), *v = malloc(4 * count),
        *g = malloc(4 * count);
  tu_randn(q, count, 10 + n, 1.0f);
  tu_randn(k, count, 20 + n, 1.0f);
  tu_randn(v, count, 30 + n, 1.0f);
  tu_randn(g, count, 40 + n, 1.0f);
  struct run_out r = run_variant(&cfg, B, H, n, d, causal, q, k, v, g);
  double *o = malloc(8 * count), *dq = malloc(8 * count), *dk = malloc(8 * count),
         *dv = malloc(8 * count);
  for (long bh = 0; bh < B * H; bh++) {
    size_t off = (size_t)(bh * n * d);
    double *qd = tu_to_double(q + off, n * d), *kd = tu_to_double(k + off, n * d);
    double *vd = tu_to_double(v + off, n * d), *gd = tu_to_double(g + off, n * d);
    dense_attention_band(o + off, dq + off, dk + off, dv + off, qd, kd, vd, gd, n, d, causal,
                         strcmp(variant, "local") == 0 ? band : 0);
    free(qd);
    free(kd);
    free(vd);
    free(gd);
  }
  char what[128];
  snprintf(what, sizeof what, "%s band=%ld n=%ld d=%ld tile=%d %s", variant, band, n, d, tile,
           causal ? "causal" : "bidir");
  TU_ASSERT_CLOSE(tu_rel_err(r.out, o, count), 1e-5, what);
  if (band == 1) { /* one key per query: the softmax is constant, dq and dk are exactly zero */
    for (long i = 0; i < count; i++)
      if (fabsf(r.dq[i]) > 1e-6f || fabsf(r.dk[i]) > 1e-6f) fail_msg("%s: dq, dk not zero", what);
  } else {
    TU_ASSERT_CLOSE(tu_rel_err(r.dq, dq, count), 1e-4, what);
    TU_ASSERT_CLOSE(tu_rel_err(r.dk, dk, count), 1e-4, what);
  }
  TU_ASSERT_CLOSE(tu_rel_err(r.dv, dv, count), 1e-4, what);
  free_run(&r);
  free(q);
  free(k);
  free(v);
  free(g);
  free(o);
  free(dq);
  free(dk);
  free(dv);
  config_free(&cfg);
}

static void check_full(long n, long d, int tile, bool causal) {
  check_exact("full", 0, n, d, tile, causal);
}

static void test_full_matches_dense(void **state) {
  const long sizes[] = {2, 5, 16, 17, 64, 100, 257};
  for (int c = 0; c < 2; c++)
    for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) check_full(sizes[s], 8, 16, c);
  check_full(200, 64, 64, true); /* the default tile and head size */
  check_full(130, 32, 128, false);
}

/* `local`: bands narrower than, equal to and wider than a tile, and wider than the sequence. */
static void test_local_matches_dense(void **state) {
  const long bands[] = {1, 5, 16, 23, 40, 300};
  for (int c = 0; c < 2; c++)
    for (size_t b = 0; b < sizeof bands / sizeof bands[0]; b++) {
      check_exact("local", bands[b], 100, 8, 16, c);
      check_exact("local", bands[b], 64, 8, 16, c);
    }
}

/* Outputs before position j must not change when anything at j changes. */
static void check_causality(const char *variant) {
  const long B = 1, H = 2, n = 90, d = 8, count = B * H * n * d;
  struct config cfg;
  local_band = 20;
  make_config(&cfg, variant, n, (int)H, (int)d, true, 16);
  float *q = malloc(4 * count), *k = malloc(4 * count), *v = malloc(4 * count);
  tu_randn(q, count, 1, 1.0f);
  tu_randn(k, count, 2, 1.0f);
  tu_randn(v, count, 3, 1.0f);
  struct run_out base = run_variant(&cfg, B, H, n, d, true, q, k, v, NULL);
  const long probes[] = {0, 15, 16, 47, 89};
  for (size_t p = 0; p < sizeof probes / sizeof probes[0]; p++) {
    long j = probes[p];
    float *q2 = malloc(4 * count), *k2 = malloc(4 * count), *v2 = malloc(4 * count);
    memcpy(q2, q, 4 * count);
    memcpy(k2, k, 4 * count);
    memcpy(v2, v, 4 * count);
    for (long h = 0; h < H; h++)
      for (long c = 0; c < d; c++) {
        size_t at = (size_t)((h * n + j) * d + c);
        q2[at] += 3.0f;
        k2[at] -= 2.0f;
        v2[at] += 5.0f;
      }
    struct run_out r = run_variant(&cfg, B, H, n, d, true, q2, k2, v2, NULL);
    bool changed_at_j = false;
    (void)variant;
    for (long h = 0; h < H; h++)
      for (long i = 0; i < n; i++)
        for (long c = 0; c < d; c++) {
          size_t at = (size_t)((h * n + i) * d + c);
          if (i < j && r.out[at] != base.out[at])
            fail_msg("output %ld changed when position %ld changed", i, j);
          if (i == j && r.out[at] != base.out[at]) changed_at_j = true;
        }
    assert_true(changed_at_j); /* the perturbation is visible where it is allowed */
    free_run(&r);
    free(q2);
    free(k2);
    free(v2);
  }
  free_run(&base);
  free(q);
  free(k);
  free(v);
  config_free(&cfg);
}

static void test_causality(void **state) {
  check_causality("full");
  check_causality("local");
}

/* Memory stays O(n·d): the workspace of n = 2048 is a few tiles, not n². */
static void test_full_workspace(void **state) {
  const long B = 1, H = 1, n = 2048, d = 16, count = B * H * n * d;
  struct config cfg;
  make_config(&cfg, "full", n, (int)H, (int)d, true, 64);
  float *q = malloc(4 * count), *k = malloc(4 * count), *v = malloc(4 * count),
        *g = malloc(4 * count);
  tu_randn(q, count, 1, 1.0f);
  tu_randn(k, count, 2, 1.0f);
  tu_randn(v, count, 3, 1.0f);
  tu_randn(g, count, 4, 1.0f);
  size_t base = mem_current(MEM_WORKSPACE);
  mem_reset_peak(MEM_WORKSPACE);
  struct run_out r = run_variant(&cfg, B, H, n, d, true, q, k, v, g);
  size_t used = mem_peak(MEM_WORKSPACE) - base;
  if (used > (size_t)(64 * n * sizeof(float))) /* n² floats would be 16 MiB */
    fail_msg("full attention used %zu bytes of workspace at n = %ld", used, n);
  free_run(&r);
  free(q);
  free(k);
  free(v);
  free(g);
  config_free(&cfg);
}

/* The diagnostics of full and local: for the sampled queries (every one when n ≤ 256, else 256
 * evenly spaced), the dense softmax row's mass in each distance band of the fma.m tree and its
 * entropy, summed over the queries. */
static void check_diagnostics(const char *variant, long band, long n, bool causal) {
  const long H = 2, d = 8, count = H * n * d, nq = n < 256 ? n : 256;
  struct config cfg;
  local_band = (int)band;
  make_config(&cfg, variant, n, (int)H, (int)d, causal, 16);
  const struct attn_variant *var = attention_find(variant);
  struct attn_ctx ctx =
      attention_open(&cfg, var, DEVICE_CPU, NULL, 0, (struct attn_dims){1, H, n, d, n, 0, causal});
  struct fma_tree tree;
  fma_tree_build(&tree, n, cfg.attention.fma_m, cfg.attention.fma_p);
  const int bands = tree.levels + 1;
  float *q = malloc(4 * count), *k = malloc(4 * count);
  tu_randn(q, count, 50 + n, 2.0f); /* peaked rows: the entropy is far from log n */
  tu_randn(k, count, 60 + n, 1.0f);
  double *mass = calloc((size_t)(H * bands), sizeof(double)), entropy[2] = {0, 0};
  double *ref = calloc((size_t)(H * bands), sizeof(double)), ref_entropy[2] = {0, 0};
  long got = var->diagnostics(&ctx, mass, entropy, q, k, NULL, NULL);
  char what[96];
  snprintf(what, sizeof what, "%s diagnostics n=%ld band=%ld %s", variant, n, band,
           causal ? "causal" : "bidir");
  if (got != nq) fail_msg("%s: %ld queries sampled, expected %ld", what, got, nq);
  double *p = malloc(sizeof(double) * (size_t)n);
  for (long h = 0; h < H; h++)
    for (long s = 0; s < nq; s++) {
      const long i = s * n / nq;
      double mx = -INFINITY, z = 0.0;
      for (long j = 0; j < n; j++) {
        p[j] = -INFINITY;
        if (!allowed(i, j, causal, band)) continue;
        double dot = 0.0;
        for (long c = 0; c < d; c++) dot += (double)q[(h * n + i) * d + c] * k[(h * n + j) * d + c];
        p[j] = dot / sqrt((double)d);
        mx = fmax(mx, p[j]);
      }
      for (long j = 0; j < n; j++) z += p[j] > -INFINITY ? exp(p[j] - mx) : 0.0;
      for (long j = 0; j < n; j++) {
        if (p[j] == -INFINITY) continue;
        const double pj = exp(p[j] - mx) / z;
        const int b = fma_lists_band(&tree, causal, i, j);
        if (b < 0 || b >= bands) fail_msg("%s: pair (%ld, %ld) has band %d", what, i, j, b);
        ref[h * bands + b] += pj;
        if (pj > 0) ref_entropy[h] -= pj * log(pj);
      }
    }
  double total = 0.0;
  for (long i = 0; i < H * bands; i++) {
    total += mass[i];
    TU_ASSERT_CLOSE(fabs(mass[i] - ref[i]) / nq, 1e-5, what);
  }
  TU_ASSERT_CLOSE(fabs(total - (double)(H * nq)) / (double)(H * nq), 1e-6, what);
  for (long h = 0; h < H; h++)
    TU_ASSERT_CLOSE(fabs(entropy[h] - ref_entropy[h]) / ref_entropy[h], 1e-5, what);
  attention_close(&ctx);
  free(p);
  free(q);
  free(k);
  free(mass);
  free(ref);
  config_free(&cfg);
}

static void test_diagnostics(void **state) {
  for (int c = 0; c <= 1; c++) {
    check_diagnostics("full", 0, 100, c);
    check_diagnostics("full", 0, 700, c); /* 256 of 700 queries sampled */
    check_diagnostics("local", 24, 300, c);
  }
}

static const struct CMUnitTest tests[] = {
    cmocka_unit_test(test_dense_reference_gradients),
    cmocka_unit_test(test_full_matches_dense),
    cmocka_unit_test(test_local_matches_dense),
    cmocka_unit_test(test_causality),
    cmocka_unit_test(test_full_workspace),
    cmocka_unit_test(test_diagnostics),
};

TU_MAIN(tests)
