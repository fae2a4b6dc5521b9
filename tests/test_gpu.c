/* The CUDA back end against the CPU: the layers of src/layers.c and exact attention (full, local)
 * on the same inputs, forward and every gradient (accumulated onto non-zero buffers), fp32;
 * causality by perturbation; the NCCL allreduce against MPI_Allreduce. Built with --with-cuda; on
 * a machine without a GPU the whole program is one TAP skip ("1..0 # SKIP no GPU"), never a pass
 * (it has not yet run on one). */
#include "testutil.h"

#include "../gpu/gpu.h"
#include "../src/attention/attention.h"
#include "../src/config.h"
#include "../src/layers.h"

/* fp32 on both sides, different summation orders: relative to the largest entry */
#define TOL 2e-5

/* A device copy of a host array. */
static float *up(const float *h, size_t n) {
  float *d = gpu_malloc(sizeof(float) * n);
  gpu_upload(d, h, sizeof(float) * n);
  return d;
}

/* Free count host arrays and their device copies. */
static void free_both(float **host, float **dev, int count) {
  for (int i = 0; i < count; i++) {
    free(host[i]);
    gpu_free(dev[i]);
  }
}

/* The device array d against the host array h, as the CPU op left it. */
static double diff(const float *d, const float *h, size_t n) {
  float *back = malloc(sizeof(float) * n);
  gpu_download(back, d, sizeof(float) * n);
  double *ref = tu_to_double(h, n);
  double e = tu_rel_err(back, ref, n);
  free(back);
  free(ref);
  return e;
}

static float *randn(size_t n, uint64_t key) {
  float *x = malloc(sizeof(float) * n);
  tu_randn(x, n, key, 1.0f);
  return x;
}

static void test_gpu_linear(void **state) {
  const long N = 37;
  const int IC = 48, OC = 80; /* not multiples of anything in particular */
  float *x = randn((size_t)N * IC, 1), *w = randn((size_t)OC * IC, 2), *b = randn(OC, 3);
  float *dy = randn((size_t)N * OC, 4), *y = malloc(sizeof(float) * N * OC);
  float *dx = randn((size_t)N * IC, 5), *dw = randn((size_t)OC * IC, 6), *db = randn(OC, 7);
  float *gx = up(x, N * IC), *gw = up(w, OC * IC), *gb = up(b, OC), *gdy = up(dy, N * OC);
  float *gy = gpu_malloc(sizeof(float) * N * OC);
  float *gdx = up(dx, N * IC), *gdw = up(dw, OC * IC), *gdb = up(db, OC);
  linear_forward(y, x, w, b, N, IC, OC);
  gpu_linear_forward(gy, gx, gw, gb, N, IC, OC);
  TU_ASSERT_CLOSE(diff(gy, y, N * OC), TOL, "linear forward");
  linear_backward(dx, dw, db, dy, x, w, N, IC, OC);
  gpu_linear_backward(gdx, gdw, gdb, gdy, gx, gw, N, IC, OC);
  TU_ASSERT_CLOSE(diff(gdx, dx, N * IC), TOL, "linear dinp (accumulated)");
  TU_ASSERT_CLOSE(diff(gdw, dw, OC * IC), TOL, "linear dweight (accumulated)");
  TU_ASSERT_CLOSE(diff(gdb, db, OC), TOL, "linear dbias (accumulated)");
  float *all[] = {x, w, b, dy, y, dx, dw, db}, *gall[] = {gx, gw, gb, gdy, gy, gdx, gdw, gdb};
  free_both(all, gall, (int)(sizeof all / sizeof *all));
}

static void test_gpu_layernorm(void **state) {
  const long N = 29;
  const int C = 96;
  float *x = randn((size_t)N * C, 11), *w = randn(C, 12), *b = randn(C, 13);
  float *dy = randn((size_t)N * C, 14), *y = malloc(sizeof(float) * N * C);
  float *mean = malloc(sizeof(float) * N), *rstd = malloc(sizeof(float) * N);
  float *dx = randn((size_t)N * C, 15), *dw = randn(C, 16), *db = randn(C, 17);
  float *gx = up(x, N * C), *gw = up(w, C), *gb = up(b, C), *gdy = up(dy, N * C);
  float *gy = gpu_malloc(sizeof(float) * N * C), *gmean = gpu_malloc(sizeof(float) * N),
        *grstd = gpu_malloc(sizeof(float) * N);
  float *gdx = up(dx, N * C), *gdw = up(dw, C), *gdb = up(db, C);
  layernorm_forward(y, mean, rstd, x, w, b, N, C);
  gpu_layernorm_forward(gy, gmean, grstd, gx, gw, gb, N, C);
  TU_ASSERT_CLOSE(diff(gy, y, N * C), TOL, "layernorm forward");
  TU_ASSERT_CLOSE(diff(gmean, mean, N), TOL, "layernorm mean");
  TU_ASSERT_CLOSE(diff(grstd, rstd, N), TOL, "layernorm rstd");
  layernorm_backward(dx, dw, db, dy, x, w, mean, rstd, N, C);
  gpu_layernorm_backward(gdx, gdw, gdb, gdy, gx, gw, gmean, grstd, N, C);
  TU_ASSERT_CLOSE(diff(gdx, dx, N * C), TOL, "layernorm dinp (accumulated)");
  TU_ASSERT_CLOSE(diff(gdw, dw, C), TOL, "layernorm dweight (accumulated)");
  TU_ASSERT_CLOSE(diff(gdb, db, C), TOL, "layernorm dbias (accumulated)");
  float *all[] = {x, w, b, dy, y, mean, rstd, dx, dw, db};
  float *gall[] = {gx, gw, gb, gdy, gy, gmean, grstd, gdx, gdw, gdb};
  free_both(all, gall, (int)(sizeof all / sizeof *all));
}

static void test_gpu_gelu(void **state) {
  const size_t n = 1000;
  float *x = randn(n, 21), *dy = randn(n, 22), *dx = randn(n, 23), *y = malloc(sizeof(float) * n);
  float *gx = up(x, n), *gdy = up(dy, n), *gdx = up(dx, n), *gy = gpu_malloc(sizeof(float) * n);
  gelu_forward(y, x, n);
  gpu_gelu_forward(gy, gx, n);
  TU_ASSERT_CLOSE(diff(gy, y, n), TOL, "gelu forward");
  gelu_backward(dx, dy, x, n);
  gpu_gelu_backward(gdx, gdy, gx, n);
  TU_ASSERT_CLOSE(diff(gdx, dx, n), TOL, "gelu dinp (accumulated)");
  free(x), free(dy), free(dx), free(y);
  gpu_free(gx), gpu_free(gdy), gpu_free(gdx), gpu_free(gy);
}

static void test_gpu_embedding(void **state) {
  const long B = 2, T = 5, n = 10, t0 = 3;
  const int C = 37, V = 11;
  int tokens[B * T];
  for (long i = 0; i < B * T; i++) tokens[i] = (int)((i * 7) % 4); /* rows repeat: a scatter */
  float *tok = randn((size_t)V * C, 71), *pos = randn((size_t)n * C, 72);
  float *dy = randn((size_t)B * T * C, 73), *y = malloc(sizeof(float) * B * T * C);
  float *dtok = randn((size_t)V * C, 74), *dpos = randn((size_t)n * C, 75);
  float *gtok = up(tok, V * C), *gpos = up(pos, n * C), *gdy = up(dy, B * T * C);
  float *gy = gpu_malloc(sizeof(float) * B * T * C);
  float *gdtok = up(dtok, V * C), *gdpos = up(dpos, n * C);
  int *gtokens = gpu_malloc(sizeof tokens);
  gpu_upload(gtokens, tokens, sizeof tokens);
  embedding_forward(y, tokens, tok, pos, B, T, C, t0);
  gpu_embedding_forward(gy, gtokens, gtok, gpos, B, T, C, t0);
  TU_ASSERT_CLOSE(diff(gy, y, B * T * C), TOL, "embedding forward");
  embedding_backward(dtok, dpos, dy, tokens, B, T, C, t0);
  gpu_embedding_backward(gdtok, gdpos, gdy, gtokens, B, T, C, t0);
  TU_ASSERT_CLOSE(diff(gdtok, dtok, V * C), TOL, "embedding dtoken (accumulated, shared rows)");
  TU_ASSERT_CLOSE(diff(gdpos, dpos, n * C), TOL, "embedding dposition (accumulated, offset t0)");
  embedding_forward(y, tokens, tok, NULL, B, T, C, t0);
  gpu_embedding_forward(gy, gtokens, gtok, NULL, B, T, C, t0);
  TU_ASSERT_CLOSE(diff(gy, y, B * T * C), TOL, "embedding forward without positions");
  free(tok), free(pos), free(dy), free(y), free(dtok), free(dpos);
  gpu_free(gtok), gpu_free(gpos), gpu_free(gdy), gpu_free(gy), gpu_free(gdtok), gpu_free(gdpos);
  gpu_free(gtokens);
}

/* AdamW against the update of optimizer.c written out in double, three steps in a row, and the
 * sum of squares against a double sum on the host. */
static void test_gpu_adamw(void **state) {
  const size_t n = 5003;
  const float lr = 1e-3f, wd = 0.01f, b1 = 0.9f, b2 = 0.99f, eps = 1e-8f, scale = 0.5f;
  float *w = randn(n, 81), *g = randn(n, 82), *mv = calloc(2 * n, sizeof(float));
  double *rw = tu_to_double(w, n), *rm = calloc(n, sizeof(double)), *rv = calloc(n, sizeof(double));
  float *gw = up(w, n), *gg = up(g, n), *gm = up(mv, n), *gv = up(mv + n, n);
  for (int t = 1; t <= 3; t++) {
    const double bc1 = 1.0 - pow(b1, t), bc2 = 1.0 - pow(b2, t);
    gpu_adamw_update(gw, gg, gm, gv, n, lr, wd, b1, b2, eps, (float)bc1, (float)bc2, scale);
    for (size_t e = 0; e < n; e++) {
      const double grad = (double)g[e] * scale;
      rm[e] = b1 * rm[e] + (1.0 - b1) * grad;
      rv[e] = b2 * rv[e] + (1.0 - b2) * grad * grad;
      rw[e] -= lr * (rm[e] / bc1 / (sqrt(rv[e] / bc2) + eps) + wd * rw[e]);
    }
  }
  float *back = malloc(sizeof(float) * n);
  gpu_download(back, gw, sizeof(float) * n);
  TU_ASSERT_CLOSE(tu_rel_err(back, rw, n), 1e-6, "AdamW, three steps");
  double ss = 0.0;
  for (size_t e = 0; e < n; e++) ss += (double)g[e] * g[e];
  TU_ASSERT_CLOSE(fabs(gpu_sum_squares(gg, n) - ss) / ss, 1e-12, "sum of squares");
  free(w), free(g), free(mv), free(rw), free(rm), free(rv), free(back);
  gpu_free(gw), gpu_free(gg), gpu_free(gm), gpu_free(gv);
}

static void test_gpu_softmax_xent(void **state) {
  const long N = 33;
  const int V = 257; /* the mlm vocabulary: not a multiple of the block */
  float *z = randn((size_t)N * V, 31);
  int *tgt = malloc(sizeof(int) * N);
  for (long i = 0; i < N; i++) tgt[i] = i % 7 == 3 ? -1 : (int)((i * 97) % V); /* some ignored */
  float *gz = up(z, N * V);
  int *gt = gpu_malloc(sizeof(int) * N);
  gpu_upload(gt, tgt, sizeof(int) * N);
  const double cpu = softmax_xent_forward_backward(z, tgt, N, V, 0.25f, NULL);
  const double gpu = gpu_softmax_xent_forward_backward(gz, gt, N, V, 0.25f);
  TU_ASSERT_CLOSE(fabs(gpu - cpu) / fabs(cpu), TOL, "softmax cross-entropy loss");
  TU_ASSERT_CLOSE(diff(gz, z, N * V), TOL, "softmax cross-entropy dlogits");
  free(z), free(tgt);
  gpu_free(gz), gpu_free(gt);
}

/* The configuration of a CPU exact-attention op: variant full or local (band), n tokens. */
static void exact_config(struct config *cfg, long band, long n, int H, int d, bool causal) {
  tu_config(cfg, band > 0 ? "local" : "full", n, H, d, causal,
            TU_SETS(tu_fmt("attention.local.band=%ld", band > 0 ? band : 128)));
}

/* One comparison of check_exact: its relative error within TOL, named "<variant ...>: <what>". */
static void assert_exact(double err, const char *variant, const char *what) {
  char name[160];
  snprintf(name, sizeof name, "%s%s", variant, what);
  TU_ASSERT_CLOSE(err, TOL, name);
}

/* GPU exact attention against the CPU op of the same variant: out, the saved log-sum-exp, and
 * dq, dk, dv accumulated onto non-zero buffers. n is no multiple of the kernels' tiles. */
static void check_exact(long band, bool causal, int d) {
  const long B = 2, H = 3, n = 203, BH = B * H;
  const size_t count = (size_t)(BH * n * d);
  struct config cfg;
  exact_config(&cfg, band, n, (int)H, d, causal);
  struct attn_ctx ctx = tu_attn_open(&cfg, B);
  assert_true(attention_saved_floats(&ctx) == (size_t)(BH * n)); /* the saved state is lse alone */
  float *q = randn(count, 51), *k = randn(count, 52), *v = randn(count, 53), *g = randn(count, 54);
  float *out = malloc(4 * count), *lse = malloc(4 * (size_t)(BH * n));
  float *dq = randn(count, 55), *dk = randn(count, 56), *dv = randn(count, 57);
  float *gq = up(q, count), *gk = up(k, count), *gv = up(v, count), *gg = up(g, count);
  float *gout = gpu_malloc(4 * count), *glse = gpu_malloc(4 * (size_t)(BH * n));
  float *gdq = up(dq, count), *gdk = up(dk, count), *gdv = up(dv, count);
  attention_forward(&ctx, out, lse, q, k, v, NULL);
  gpu_exact_attention_forward(gout, glse, gq, gk, gv, BH, n, d, causal, band);
  char what[96];
  snprintf(what, sizeof what, "%s d=%d %s: ", ctx.variant->name, d,
           causal ? "causal" : "bidirectional");
  assert_exact(diff(gout, out, count), what, "out");
  assert_exact(diff(glse, lse, (size_t)(BH * n)), what, "lse");
  attention_backward(&ctx, dq, dk, dv, NULL, g, q, k, v, NULL, out, lse);
  gpu_exact_attention_backward(gdq, gdk, gdv, gg, gq, gk, gv, gout, glse, BH, n, d, causal, band);
  assert_exact(diff(gdq, dq, count), what, "dq (accumulated)");
  assert_exact(diff(gdk, dk, count), what, "dk (accumulated)");
  assert_exact(diff(gdv, dv, count), what, "dv (accumulated)");
  attention_close(&ctx);
  float *all[] = {q, k, v, g, out, lse, dq, dk, dv};
  float *gall[] = {gq, gk, gv, gg, gout, glse, gdq, gdk, gdv};
  free_both(all, gall, (int)(sizeof all / sizeof *all));
}

static void test_gpu_exact_attention(void **state) {
  for (int d = 16; d <= 128; d *= 2)
    if (gpu_exact_attention_supports(d)) check_exact(0, true, d);
  check_exact(0, false, 64);
  check_exact(40, true, 32);   /* local: a band shorter than a tile of the kernels */
  check_exact(100, false, 64); /* and one longer, both sides */
  assert_false(gpu_exact_attention_supports(48));
}

/* The GPU's exact attention as the causality probe runs it: host arrays in and out. */
struct gpu_forward {
  long BH, n, d, band;
  float *q, *k, *v, *out, *lse; /* device buffers */
};

static void gpu_forward(void *user, float *out, const float *q, const float *k, const float *v) {
  struct gpu_forward *g = user;
  const size_t bytes = sizeof(float) * (size_t)(g->BH * g->n * g->d);
  gpu_upload(g->q, q, bytes);
  gpu_upload(g->k, k, bytes);
  gpu_upload(g->v, v, bytes);
  gpu_exact_attention_forward(g->out, g->lse, g->q, g->k, g->v, g->BH, g->n, g->d, 1, g->band);
  gpu_download(out, g->out, bytes);
}

/* Causal mode on the GPU, by the probe of testutil.c: changing the keys and values after position
 * p leaves the outputs of positions ≤ p bit for bit as they were, and changes output p + 1. */
static void test_gpu_exact_causality(void **state) {
  const long BH = 2, n = 150, d = 32, p = 77;
  const size_t count = (size_t)(BH * n * d);
  struct gpu_forward g = {BH,
                          n,
                          d,
                          0,
                          gpu_malloc(4 * count),
                          gpu_malloc(4 * count),
                          gpu_malloc(4 * count),
                          gpu_malloc(4 * count),
                          gpu_malloc(4 * (size_t)(BH * n))};
  float *q = randn(count, 61), *k = randn(count, 62), *v = randn(count, 63);
  const long at[] = {p + 1};
  const struct tu_probe probe = {at, 1, TU_MOVE_K | TU_MOVE_V, true};
  const struct tu_heads shape = {1, BH, BH, n, d};
  if (tu_causality_fn(gpu_forward, &g, &shape, q, k, v, &probe, "GPU exact attention"))
    fail_msg("GPU exact attention: the causality probe failed (listed above)");
  free(q), free(k), free(v);
  gpu_free(g.q), gpu_free(g.k), gpu_free(g.v), gpu_free(g.out), gpu_free(g.lse);
}

static void test_gpu_nccl_allreduce(void **state) {
  int rank, size;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  const size_t n = 4099;
  float *x = randn(n, 41 + (uint64_t)rank), *sum = malloc(sizeof(float) * n);
  MPI_Allreduce(x, sum, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  struct gpu_nccl *c = gpu_nccl_open(MPI_COMM_WORLD);
  float *gx = up(x, n);
  gpu_nccl_allreduce_sum(c, gx, n);
  TU_ASSERT_CLOSE(diff(gx, sum, n), 1e-6, "NCCL allreduce against MPI_Allreduce");
  const unsigned long long want = (unsigned long long)(2.0 * (size - 1) / size * (double)(n * 4));
  assert_true(gpu_nccl_bytes_sent(c) == want);
  gpu_nccl_close(c);
  free(x), free(sum);
  gpu_free(gx);
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  char err[256];
  if (gpu_open(rank, err, sizeof err) != 0) { /* TAP's skip-all plan, with the reason */
    err[strcspn(err, "\n")] = '\0';
    printf("1..0 # SKIP no GPU: %s\n", err);
    MPI_Finalize();
    return 0;
  }
  cmocka_set_message_output(CM_OUTPUT_TAP);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_gpu_linear),
      cmocka_unit_test(test_gpu_layernorm),
      cmocka_unit_test(test_gpu_gelu),
      cmocka_unit_test(test_gpu_embedding),
      cmocka_unit_test(test_gpu_adamw),
      cmocka_unit_test(test_gpu_softmax_xent),
      cmocka_unit_test(test_gpu_exact_attention),
      cmocka_unit_test(test_gpu_exact_causality),
      cmocka_unit_test(test_gpu_nccl_allreduce),
  };
  const int rc = cmocka_run_group_tests(tests, NULL, NULL);
  gpu_close();
  MPI_Finalize();
  return rc;
}
