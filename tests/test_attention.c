/* Attention variants through their ops table against dense references in double precision:
 * `full` against materialised softmax(q kᵀ/√d + mask) v, with gradients from the dense formulas
 * (themselves checked against central finite differences), for n that is and is not a multiple of
 * the tile, causal and bidirectional; causality by perturbation; the attention diagnostics (mass
 * per distance band and entropy of sampled softmax rows) against the dense rows. */
#include <omp.h>

#include "testutil.h"

#include "../src/attention/attention.h"
#include "../src/core/memory.h"
#include "../src/deck/config.h"
#include "../src/fma/lists.h"

static void dense_attention(double *out, double *dq, double *dk, double *dv, const double *q,
                            const double *k, const double *v, const double *dout, long n, long d,
                            bool causal, long band) {
  const struct tu_mask mask = {causal, band};
  tu_dense_attention(out, dq, dk, dv, q, k, v, dout, n, d, tu_mask_allowed, &mask);
}

static double dense_j(const double *q, const double *k, const double *v, const double *g, long n,
                      long d, bool causal, long band) {
  double *o = malloc(sizeof(double) * n * d);
  dense_attention(o, NULL, NULL, NULL, q, k, v, NULL, n, d, causal, band);
  double j = 0.0;
  for (long i = 0; i < n * d; i++) j += g[i] * o[i];
  free(o);
  return j;
}

/* The shared dense reference (testutil.c) is right: central differences on tiny cases, causal or
 * not, with and without a band. */
static void test_dense_reference_gradients(void **state) {
  for (int causal = 0; causal < 2; causal++)
    for (long band = 0; band <= 3; band += 3) {
      const long n = 7, d = 3, N = n * d;
      double q[N], k[N], v[N], g[N], o[N], dq[N], dk[N], dv[N], f[N];
      tu_randn_d(q, N, 1, 1.0);
      tu_randn_d(k, N, 2, 1.0);
      tu_randn_d(v, N, 3, 1.0);
      tu_randn_d(g, N, 4, 1.0);
      dense_attention(o, dq, dk, dv, q, k, v, g, n, d, causal, band);
      for (long i = 0; i < N; i++) TU_FD(f[i], q, i, 1e-6, dense_j(q, k, v, g, n, d, causal, band));
      TU_ASSERT_CLOSE(tu_rel_err_dd(dq, f, N), 1e-7, "dense dq");
      for (long i = 0; i < N; i++) TU_FD(f[i], k, i, 1e-6, dense_j(q, k, v, g, n, d, causal, band));
      TU_ASSERT_CLOSE(tu_rel_err_dd(dk, f, N), 1e-7, "dense dk");
      for (long i = 0; i < N; i++) TU_FD(f[i], v, i, 1e-6, dense_j(q, k, v, g, n, d, causal, band));
      TU_ASSERT_CLOSE(tu_rel_err_dd(dv, f, N), 1e-7, "dense dv");
    }
}

/* full or local (band) with n tokens, H heads of d, the query/key tile. */
static void make_config(struct config *cfg, const char *variant, long n, long H, long d,
                        bool causal, int tile, long band) {
  tu_config(cfg, variant, n, (int)H, (int)d, causal,
            TU_SETS(tu_fmt("attention.full.block=%d", tile),
                    tu_fmt("attention.local.band=%ld", band > 0 ? band : 128)));
}

static struct tu_run run_variant(const struct config *cfg, long B, const float *q, const float *k,
                                 const float *v, const float *dout) {
  struct attn_ctx ctx = tu_attn_open(cfg, B);
  struct tu_run r = tu_attn_run(&ctx, NULL, NULL, q, k, v, dout);
  attention_close(&ctx);
  return r;
}

static void check_exact(const char *variant, long band, long n, long d, int tile, bool causal) {
  const long B = 2, H = 2, count = B * H * n * d;
  struct config cfg;
  make_config(&cfg, variant, n, H, d, causal, tile, band);
  float *q = malloc(4 * count), *k = malloc(4 * count), *v = malloc(4 * count),
        *g = malloc(4 * count);
  tu_randn(q, count, 10 + n, 1.0f);
  tu_randn(k, count, 20 + n, 1.0f);
  tu_randn(v, count, 30 + n, 1.0f);
  tu_randn(g, count, 40 + n, 1.0f);
  struct tu_run r = run_variant(&cfg, B, q, k, v, g);
  double *o = malloc(8 * count), *dq = malloc(8 * count), *dk = malloc(8 * count),
         *dv = malloc(8 * count);
  for (long bh = 0; bh < B * H; bh++) {
    size_t off = (size_t)(bh * n * d);
    double *qd = tu_to_double(q + off, n * d), *kd = tu_to_double(k + off, n * d);
    double *vd = tu_to_double(v + off, n * d), *gd = tu_to_double(g + off, n * d);
    dense_attention(o + off, dq + off, dk + off, dv + off, qd, kd, vd, gd, n, d, causal,
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
  tu_run_free(&r);
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
  /* causal tiles of 32 and 64 whose diagonal blocks run in halves (full.c's tile_parts): the
   * halves of 16 rows, and of 32 against key tiles 8 query tiles wide */
  check_full(256, 16, 32, true);
  check_full(640, 16, 64, true);
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

/* Causality by perturbation (testutil.c): outputs before position j must not change when q, k
 * and v at j change, and output j must. */
static void check_causality(const char *variant) {
  const long B = 1, H = 2, n = 90, d = 8, count = B * H * n * d;
  struct config cfg;
  make_config(&cfg, variant, n, H, d, true, 16, 20);
  float *q = malloc(4 * count), *k = malloc(4 * count), *v = malloc(4 * count);
  tu_randn(q, count, 1, 1.0f);
  tu_randn(k, count, 2, 1.0f);
  tu_randn(v, count, 3, 1.0f);
  const long at[] = {0, 15, 16, 47, 89};
  struct attn_ctx ctx = tu_attn_open(&cfg, B);
  const struct tu_probe probe = {at, sizeof at / sizeof at[0], TU_MOVE_QKV, false};
  if (tu_causality(&ctx, NULL, q, k, v, &probe, variant))
    fail_msg("%s: causality probes failed (listed above)", variant);
  attention_close(&ctx);
  free(q);
  free(k);
  free(v);
  config_free(&cfg);
}

/* The probe can fail: it reports a leak for `full` opened bidirectional, and blindness for an op
 * whose output ignores its inputs. */
struct probe_op {
  struct attn_ctx *ctx; /* NULL: the output is count zeros */
  float *saved;
  size_t count;
};

static void probe_forward(void *user, float *out, const float *q, const float *k, const float *v) {
  struct probe_op *op = user;
  if (op->ctx)
    attention_forward(op->ctx, out, op->saved, q, k, v, NULL);
  else
    memset(out, 0, sizeof(float) * op->count);
}

static void test_causality_probe_can_fail(void **state) {
  const long H = 2, n = 40, d = 8, count = H * n * d;
  struct config cfg;
  make_config(&cfg, "full", n, H, d, false, 16, 0);
  float *q = malloc(4 * count), *k = malloc(4 * count), *v = malloc(4 * count);
  tu_randn(q, count, 4, 1.0f);
  tu_randn(k, count, 5, 1.0f);
  tu_randn(v, count, 6, 1.0f);
  struct attn_ctx ctx = tu_attn_open(&cfg, 1);
  struct probe_op bidir = {&ctx, calloc(attention_saved_floats(&ctx) + 1, 4), count};
  struct probe_op zero = {NULL, NULL, count};
  const long at[] = {5, 20};
  const struct tu_probe probe = {at, 2, TU_MOVE_QKV, false};
  const struct tu_heads shape = {1, H, H, n, d};
  print_message("# expected: two leaks, then two blind probes\n");
  assert_int_equal(tu_causality_fn(probe_forward, &bidir, &shape, q, k, v, &probe, "bidir"), 2);
  assert_int_equal(tu_causality_fn(probe_forward, &zero, &shape, q, k, v, &probe, "zero"), 2);
  attention_close(&ctx);
  free(bidir.saved), free(q), free(k), free(v);
  config_free(&cfg);
}

static void test_causality(void **state) {
  check_causality("full");
  check_causality("local");
}

/* The arrays by token (attn_ctx.rows): q, k, v read in place from a (B, T, 3C) buffer, the
 * output written into a (B, T, C) one and the gradients written (not added) into a (B, T, 3C)
 * one, which holds 7s before, give what the head-split arrays give, bit for bit (the same
 * products over other strides): 3 heads, ragged tiles, both masks. */
static void check_rows(const char *variant, long band, bool causal) {
  const long B = 2, H = 3, d = 16, n = 70, C = H * d, N = B * n, count = N * C;
  struct config cfg;
  make_config(&cfg, variant, n, H, d, causal, 16, band);
  float *qkv = malloc(sizeof(float) * 3 * count), *dy = malloc(sizeof(float) * count);
  tu_randn(qkv, (size_t)(3 * count), 71, 1.0f);
  tu_randn(dy, (size_t)count, 72, 1.0f);
  /* the same values by head: (B, H, T, d) */
  float *q = malloc(sizeof(float) * count), *k = malloc(sizeof(float) * count),
        *v = malloc(sizeof(float) * count), *dout = malloc(sizeof(float) * count);
  for (long b = 0; b < B; b++)
    for (long h = 0; h < H; h++)
      for (long t = 0; t < n; t++)
        for (long c = 0; c < d; c++) {
          const long by_head = ((b * H + h) * n + t) * d + c, row = (b * n + t);
          q[by_head] = qkv[row * 3 * C + h * d + c];
          k[by_head] = qkv[row * 3 * C + C + h * d + c];
          v[by_head] = qkv[row * 3 * C + 2 * C + h * d + c];
          dout[by_head] = dy[row * C + h * d + c];
        }
  struct tu_run ref = run_variant(&cfg, B, q, k, v, dout);

  struct attn_ctx ctx = tu_attn_open(&cfg, B);
  assert_true(attention_takes_rows(&ctx));
  ctx.rows = (struct attn_rows){3 * C, C};
  float *saved = calloc(attention_saved_floats(&ctx) + 1, sizeof(float));
  float *y = malloc(sizeof(float) * count), *dqkv = malloc(sizeof(float) * 3 * count);
  for (long e = 0; e < 3 * count; e++) dqkv[e] = 7.0f; /* written over, or the test fails */
  attention_forward(&ctx, y, saved, qkv, qkv + C, qkv + 2 * C, NULL);
  attention_backward(&ctx, dqkv, dqkv + C, dqkv + 2 * C, NULL, dy, qkv, qkv + C, qkv + 2 * C, NULL,
                     y, saved);
  /* finite, so that a NaN both layouts formed alike (a workspace read unwritten) cannot pass */
  for (long e = 0; e < 3 * count; e++)
    if (!isfinite(dqkv[e]) || (e < count && !isfinite(y[e])))
      fail_msg("rows in place: a value not finite at %ld", e);
  for (long b = 0; b < B; b++)
    for (long h = 0; h < H; h++)
      for (long t = 0; t < n; t++) {
        const long by_head = ((b * H + h) * n + t) * d, row = b * n + t;
        assert_memory_equal(y + row * C + h * d, ref.out + by_head, sizeof(float) * d);
        assert_memory_equal(dqkv + row * 3 * C + h * d, ref.dq + by_head, sizeof(float) * d);
        assert_memory_equal(dqkv + row * 3 * C + C + h * d, ref.dk + by_head, sizeof(float) * d);
        assert_memory_equal(dqkv + row * 3 * C + 2 * C + h * d, ref.dv + by_head,
                            sizeof(float) * d);
      }
  attention_close(&ctx);
  tu_run_free(&ref);
  free(saved), free(y), free(dqkv), free(q), free(k), free(v), free(dout), free(qkv), free(dy);
  config_free(&cfg);
}

static void test_rows_in_place(void **state) {
  for (int causal = 0; causal < 2; causal++) check_rows("full", 0, causal);
  /* local keeps the layout by head: its backward would gather whole units for a band's tiles */
  struct config cfg;
  make_config(&cfg, "local", 70, 3, 16, true, 16, 20);
  struct attn_ctx ctx = tu_attn_open(&cfg, 2);
  assert_false(attention_takes_rows(&ctx));
  attention_close(&ctx);
  config_free(&cfg);
}

/* Memory stays O(n·d): the workspace of n = 2048 is a few tiles, not n². */
static void test_full_workspace(void **state) {
  const long B = 1, H = 1, n = 2048, d = 16, count = B * H * n * d;
  struct config cfg;
  make_config(&cfg, "full", n, H, d, true, 64, 0);
  float *q = malloc(4 * count), *k = malloc(4 * count), *v = malloc(4 * count),
        *g = malloc(4 * count);
  tu_randn(q, count, 1, 1.0f);
  tu_randn(k, count, 2, 1.0f);
  tu_randn(v, count, 3, 1.0f);
  tu_randn(g, count, 4, 1.0f);
  size_t base = mem_current(MEM_WORKSPACE);
  mem_reset_peak(MEM_WORKSPACE);
  struct tu_run r = run_variant(&cfg, B, q, k, v, g);
  size_t used = mem_peak(MEM_WORKSPACE) - base;
  /* n² floats would be 16 MiB; the tiles take a few 64 × 512 tiles per thread, the keys and
   * values transposed once per unit (core/tilegemm.h) 2·n·d floats per thread, and the rows' max,
   * sum and D a few n floats (which the bound left out: it failed at 2 threads by n floats) */
  const size_t bound = sizeof(float) * (size_t)(64 * n + 4 * n + 2 * n * d * omp_get_max_threads());
  if (used > bound)
    fail_msg("full attention used %zu bytes of workspace at n = %ld (bound %zu)", used, n, bound);
  tu_run_free(&r);
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
  make_config(&cfg, variant, n, H, d, causal, 16, band);
  const struct attn_variant *var = attention_find(variant);
  struct attn_ctx ctx = tu_attn_open(&cfg, 1);
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
  const struct tu_mask mask = {causal, band};
  double *p = malloc(sizeof(double) * (size_t)n); /* (n) one query's logits, then its row */
  for (long h = 0; h < H; h++)
    for (long s = 0; s < nq; s++) {
      const long i = s * n / nq;
      for (long j = 0; j < n; j++) {
        double dot = 0.0;
        for (long c = 0; c < d; c++) dot += (double)q[(h * n + i) * d + c] * k[(h * n + j) * d + c];
        p[j] = tu_mask_allowed(i, j, &mask) ? dot / sqrt((double)d) : -INFINITY;
      }
      tu_softmax_rows(p, p, 1, n);
      for (long j = 0; j < n; j++) {
        if (!tu_mask_allowed(i, j, &mask)) continue;
        const int b = fma_lists_band(&tree, causal, i, j);
        if (b < 0 || b >= bands) fail_msg("%s: pair (%ld, %ld) has band %d", what, i, j, b);
        ref[h * bands + b] += p[j];
        if (p[j] > 0) ref_entropy[h] -= p[j] * log(p[j]);
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

/* The exact attention's workspaces allocated without zeroing (mem_alloc_uninit in full.c: the
 * keys and values transposed, the packed rows, D, the running max and sum) are written before they
 * are read: with FMATTN_FAULT=uninit_nan each comes filled with NaN, and full (by head and in the
 * caller's rows) and local still match the dense reference. */
static void test_uninit_workspaces_written(void **state) {
  setenv("FMATTN_FAULT", "uninit_nan", 1);
  float *probe = mem_alloc_uninit(MEM_WORKSPACE, sizeof(float) * 16);
  const bool poisoned = isnan(probe[0]) && isnan(probe[15]); /* the hook itself */
  mem_free(probe);
  assert_true(poisoned);
  for (int c = 0; c < 2; c++) {
    check_full(200, 64, 64, c);
    check_rows("full", 0, c);
    check_exact("local", 23, 100, 8, 16, c);
  }
  check_full(640, 16, 64, true);
  unsetenv("FMATTN_FAULT");
}

static const struct CMUnitTest tests[] = {
    cmocka_unit_test(test_dense_reference_gradients),
    cmocka_unit_test(test_full_matches_dense),
    cmocka_unit_test(test_local_matches_dense),
    cmocka_unit_test(test_causality_probe_can_fail),
    cmocka_unit_test(test_causality),
    cmocka_unit_test(test_full_workspace),
    cmocka_unit_test(test_diagnostics),
    cmocka_unit_test(test_rows_in_place),
    cmocka_unit_test(test_uninit_workspaces_written),
};

TU_MAIN(tests)
