/* The CUDA back end's operations against the CPU's on the same inputs: every layer of
 * src/nn/layers.c (forward and every gradient, accumulated onto non-zero buffers), the products
 * of gpu_gemm (fp32 and bf16), AdamW and the norm, exact attention and its causality, the device
 * memory pool and row packing, and the NCCL transport against MPI. Natively on a GPU (--with-cuda),
 * or through tests/cudaemu; with no GPU the whole program is one TAP skip, never a pass. */
#include "testutil.h"

#include <cblas.h>

#include "../gpu/gpu.h"
#include "../src/attention/attention.h"
#include "../src/core/rng.h"
#include "../src/deck/config.h"
#include "../src/model/backend.h"
#include "../src/nn/layers.h"
#include "../src/parallel/comm.h"

/* fp32 on both sides, different summation orders: relative to the largest entry */
#define TOL 2e-5

/* A device copy of a host array. */
static float *up(const float *h, size_t n) {
  float *d = gpu_alloc(MEM_WORKSPACE, sizeof(float) * n);
  gpu_upload(d, h, sizeof(float) * n);
  return d;
}

/* Uninitialised device memory (NaN under the emulation, so a value never written shows). */
static void *dev(size_t bytes) { return gpu_alloc(MEM_WORKSPACE, bytes); }

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
  float *gy = dev(sizeof(float) * N * OC);
  float *gdx = up(dx, N * IC), *gdw = up(dw, OC * IC), *gdb = up(db, OC);
  linear_forward(y, x, w, b, N, IC, OC);
  gpu_linear_forward(gy, gx, gw, gb, N, IC, OC);
  TU_ASSERT_CLOSE(diff(gy, y, N * OC), TOL, "linear forward");
  linear_backward(dx, dw, db, dy, x, w, N, IC, OC);
  gpu_linear_backward(gdx, gdw, gdb, gdy, gx, gw, N, IC, OC);
  TU_ASSERT_CLOSE(diff(gdx, dx, N * IC), TOL, "linear dinp (written)");
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
  float *gy = dev(sizeof(float) * N * C), *gmean = dev(sizeof(float) * N),
        *grstd = dev(sizeof(float) * N);
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
  float *gx = up(x, n), *gdy = up(dy, n), *gdx = up(dx, n), *gy = dev(sizeof(float) * n);
  gelu_forward(y, x, n);
  gpu_gelu_forward(gy, gx, n);
  TU_ASSERT_CLOSE(diff(gy, y, n), TOL, "gelu forward");
  gelu_backward(dx, dy, x, n);
  gpu_gelu_backward(gdx, gdy, gx, n);
  TU_ASSERT_CLOSE(diff(gdx, dx, n), TOL, "gelu dinp (written)");
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
  float *gy = dev(sizeof(float) * B * T * C);
  float *gdtok = up(dtok, V * C), *gdpos = up(dpos, n * C);
  int *gtokens = dev(sizeof tokens);
  gpu_upload(gtokens, tokens, sizeof tokens);
  embedding_forward(y, tokens, tok, pos, B, T, C, t0);
  gpu_embedding_forward(gy, gtokens, gtok, gpos, B, T, C, t0);
  TU_ASSERT_CLOSE(diff(gy, y, B * T * C), TOL, "embedding forward");
  embedding_backward(dtok, dpos, dy, tokens, B, T, C, V, t0);
  gpu_embedding_backward(gdtok, gdpos, gdy, gtokens, B, T, C, V, t0);
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
    const struct adamw_step st = {lr, wd, b1, b2, eps, (float)bc1, (float)bc2, scale};
    gpu_adamw(gw, gg, gm, gv, n, &st);
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
  for (size_t i = 0; i < (size_t)N * V; i += 37) z[i] *= 100.0f; /* large logits: the max matters */
  int *tgt = malloc(sizeof(int) * N);
  for (long i = 0; i < N; i++) tgt[i] = i % 7 == 3 ? -1 : (int)((i * 97) % V); /* some ignored */
  z[5 * V + 200] = z[5 * V + 10] = z[5 * V + 250] = 1000.0f; /* a tie: the lowest index wins */
  float *gz = up(z, N * V);
  int *gt = dev(sizeof(int) * N);
  gpu_upload(gt, tgt, sizeof(int) * N);
  float *rows = malloc(sizeof(float) * N), *grows = malloc(sizeof(float) * N);
  int *pred = malloc(sizeof(int) * N), *gpred = malloc(sizeof(int) * N);
  gpu_sync(); /* the upload has read z before the CPU op overwrites it in place */
  const double cpu = softmax_xent_rows_forward_backward(z, tgt, N, V, 0.25f, rows, pred);
  const double gpu = gpu_softmax_xent_forward_backward(gz, gt, N, V, 0.25f, grows, gpred);
  assert_memory_equal(gpred, pred, sizeof(int) * N); /* the argmax, −1 where ignored */
  TU_ASSERT_CLOSE(fabs(gpu - cpu) / fabs(cpu), TOL, "softmax cross-entropy loss");
  TU_ASSERT_CLOSE(diff(gz, z, N * V), TOL, "softmax cross-entropy dlogits");
  double *rref = tu_to_double(rows, N);
  TU_ASSERT_CLOSE(tu_rel_err(grows, rref, N), TOL, "softmax cross-entropy row losses");
  free(z), free(tgt), free(rows), free(grows), free(rref), free(pred), free(gpred);
  gpu_free(gz), gpu_free(gt);
}

/* gpu_gemm against cblas_sgemm for every transpose pair, with leading dimensions wider than the
 * matrices, beta = 1 onto non-zero C, and three strided products. */
static void test_gpu_gemm(void **state) {
  const long M = 19, N = 23, K = 17, batch = 3, ld = 31, s = 32 * ld, sb = 24 * ld;
  float *a = randn((size_t)(batch * s), 91), *b = randn((size_t)(batch * sb), 92);
  float *c = randn((size_t)(batch * s), 93);
  float *ga = up(a, batch * s), *gb = up(b, batch * sb), *gc = dev(sizeof(float) * batch * s);
  for (int ta = 0; ta < 2; ta++)
    for (int tb = 0; tb < 2; tb++) {
      float *ref = malloc(sizeof(float) * batch * s);
      memcpy(ref, c, sizeof(float) * batch * s);
      gpu_upload(gc, c, sizeof(float) * batch * s);
      for (long i = 0; i < batch; i++)
        cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
                    (int)M, (int)N, (int)K, 0.75f, a + i * s, (int)ld, b + i * sb, (int)ld, 1.0f,
                    ref + i * s, (int)ld);
      gpu_gemm(ta, tb, M, N, K, 0.75f, ga, ld, s, gb, ld, sb, 1.0f, gc, ld, s, batch);
      char what[64];
      snprintf(what, sizeof what, "gemm op(A)=%c op(B)=%c, 3 strided products", ta ? 'T' : 'N',
               tb ? 'T' : 'N');
      TU_ASSERT_CLOSE(diff(gc, ref, batch * s), TOL, what);
      free(ref);
    }
  free(a), free(b), free(c);
  gpu_free(ga), gpu_free(gb), gpu_free(gc);
}

/* bf16 in products. gpu_gemm's fp32 operands in bf16 mode (CUBLAS_COMPUTE_32F_FAST_16BF) permit
 * cuBLAS bf16 tensor-core math, not require it: on an H200 it kept this shape in fp32. So
 * natively the product is held to bf16's error bound against the exact one (each operand rounded
 * by up to 2^-8 relative, to nearest, or 2^-7, truncated: |c - c_exact| <= 2^-6 (|A||B|) with room
 * for fp32's sums); the emulation rounds to nearest even, and there it must equal that product.
 * gpu_gemm_as on operands gpu_to_bf16 rounded is bf16 arithmetic everywhere: the rounded
 * operands' product, fp32 accumulation, and not the fp32 product. */
static float round_bf16(float x) {
  uint32_t u;
  memcpy(&u, &x, 4);
  u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  memcpy(&x, &u, 4);
  return x;
}

static void test_gpu_gemm_bf16(void **state) {
  const long M = 33, N = 20, K = 45;
  float *a = randn((size_t)(M * K), 94), *b = randn((size_t)(K * N), 95);
  float *ar = malloc(sizeof(float) * M * K), *br = malloc(sizeof(float) * K * N);
  for (long i = 0; i < M * K; i++) ar[i] = round_bf16(a[i]);
  for (long i = 0; i < K * N; i++) br[i] = round_bf16(b[i]);
  float *ref = calloc((size_t)(M * N), sizeof(float)), *plain = calloc((size_t)(M * N), 4);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)M, (int)N, (int)K, 1.0f, ar, (int)K,
              br, (int)N, 0.0f, ref, (int)N);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)M, (int)N, (int)K, 1.0f, a, (int)K, b,
              (int)N, 0.0f, plain, (int)N);
  float *ga = up(a, M * K), *gb = up(b, K * N), *gc = dev(sizeof(float) * M * N);
  gpu_set_bf16(true);
  gpu_gemm(false, false, M, N, K, 1.0f, ga, K, 0, gb, N, 0, 0.0f, gc, N, 0, 1);
  gpu_set_bf16(false);
  if (TU_GPU_EMU) {
    TU_ASSERT_CLOSE(diff(gc, ref, M * N), 1e-5, "bf16 gemm: rounded operands, fp32 accumulation");
    assert_true(diff(gc, plain, M * N) > 1e-4); /* and not the fp32 product */
  } else {
    float *c = malloc(sizeof(float) * M * N);
    gpu_download(c, gc, sizeof(float) * M * N);
    double worst = 0.0; /* |c - c_exact| / (|A||B|), the exact product in double */
    for (long i = 0; i < M; i++)
      for (long j = 0; j < N; j++) {
        double exact = 0.0, mag = 0.0;
        for (long k = 0; k < K; k++) {
          exact += (double)a[i * K + k] * b[k * N + j];
          mag += fabs((double)a[i * K + k] * b[k * N + j]);
        }
        worst = fmax(worst, fabs(c[i * N + j] - exact) / mag);
      }
    if (getenv("FMATTN_TEST_VERBOSE"))
      print_message("# bf16 gemm on fp32 operands: worst |c - exact| / (|A||B|) %.2e\n", worst);
    if (!(worst <= 0x1p-6)) fail_msg("bf16 gemm: %.3e of |A||B| exceeds bf16's 2^-6", worst);
    free(c);
  }
  /* bf16 operands: the rounded operands' product everywhere */
  void *ha = dev(2 * (size_t)(M * K)), *hb = dev(2 * (size_t)(K * N));
  gpu_to_bf16(ha, ga, (size_t)(M * K));
  gpu_to_bf16(hb, gb, (size_t)(K * N));
  gpu_gemm_as(GPU_BF16, false, false, M, N, K, 1.0f, ha, K, 0, hb, N, 0, 0.0f, gc, N, 0, 1);
  TU_ASSERT_CLOSE(diff(gc, ref, M * N), 1e-5, "bf16 operands: rounded operands, fp32 accumulation");
  assert_true(diff(gc, plain, M * N) > 1e-4); /* and not the fp32 product */
  free(a), free(b), free(ar), free(br), free(ref), free(plain);
  gpu_free(ga), gpu_free(gb), gpu_free(gc), gpu_free(ha), gpu_free(hb);
}

/* Normal draws on the device (bench's inputs): row r, element j keyed r·key_stride + key0 + j,
 * the host's rng_normal rounded to float; natively within a rounding of it (the device's double
 * log and cos), under the emulation the same bits. Rows of 1000 and a stride of 1500 keys. */
static void test_gpu_fill_normal(void **state) {
  const long rows = 3, len = 1000, key_stride = 1500, key0 = 77;
  float *g = dev(sizeof(float) * rows * len), *x = malloc(sizeof(float) * rows * len);
  gpu_fill_normal(g, rows, len, key_stride, key0, 7, RNG_TEST, 3);
  gpu_download(x, g, sizeof(float) * rows * len);
  double worst = 0.0;
  for (long r = 0; r < rows; r++)
    for (long j = 0; j < len; j++) {
      const float want =
          (float)rng_normal(7, RNG_TEST, 3, (uint64_t)(r * key_stride + key0 + j), 0);
      const double e = fabs((double)x[r * len + j] - want) / fmax(fabs((double)want), 1e-30);
      worst = fmax(worst, e);
    }
  if (TU_GPU_EMU && worst != 0.0) fail_msg("fill_normal: %.3e from the host's draws", worst);
  if (!(worst <= 2e-7))
    fail_msg("fill_normal: %.3e from the host's draws, above a rounding", worst);
  free(x);
  gpu_free(g);
}

/* Sinusoidal positions and rope (forward and its transpose) against the CPU ops. */
static void test_gpu_positions(void **state) {
  const long B = 2, T = 9, t0 = 1000, H = 3;
  const int C = 24, d = 8;
  float *x = randn((size_t)(B * T * C), 96), *gx = up(x, B * T * C);
  sinusoidal_forward(x, B, T, C, t0, 0.03f);
  gpu_sinusoidal_forward(gx, B, T, C, t0, 0.03f);
  TU_ASSERT_CLOSE(diff(gx, x, B * T * C), TOL, "sinusoidal positions at t0 = 1000");
  float *r = randn((size_t)(B * H * T * d), 97), *gr = up(r, B * H * T * d);
  rope_forward(r, B * H, T, d, t0);
  gpu_rope_forward(gr, B * H, T, d, t0);
  TU_ASSERT_CLOSE(diff(gr, r, B * H * T * d), TOL, "rope forward");
  rope_backward(r, B * H, T, d, t0);
  gpu_rope_backward(gr, B * H, T, d, t0);
  TU_ASSERT_CLOSE(diff(gr, r, B * H * T * d), TOL, "rope backward");
  free(x), free(r);
  gpu_free(gx), gpu_free(gr);
}

/* Dropout draws the CPU's masks bit for bit (the same counter-based bits): the outputs agree
 * exactly, for the embedding's in-place form and the residual form, forward and backward. */
static void test_gpu_dropout(void **state) {
  const long B = 3, T = 11;
  const int C = 21; /* not a multiple of the 4 masks a draw gives */
  const size_t n = (size_t)(B * T * C);
  const struct dropout_key key = {77, 5, 3, 40, 128, 0.3f};
  float *x = randn(n, 101), *y = randn(n, 102), *res = randn(n, 103), *out = malloc(4 * n);
  float *gx = up(x, n), *gy = up(y, n), *gres = up(res, n), *gout = dev(4 * n);
  dropout_forward(x, &key, B, T, C);
  gpu_dropout_forward(gx, &key, B, T, C);
  TU_ASSERT_CLOSE(diff(gx, x, n), 0.0, "dropout: the CPU's mask, bit for bit");
  residual_dropout_forward(out, res, y, &key, B, T, C);
  gpu_residual_dropout_forward(gout, gres, gy, &key, B, T, C);
  TU_ASSERT_CLOSE(diff(gout, out, n), 0.0, "residual dropout forward");
  residual_dropout_backward(res, y, x, &key, B, T, C); /* dres, dy = from dout = x */
  gpu_residual_dropout_backward(gres, gy, gx, &key, B, T, C);
  TU_ASSERT_CLOSE(diff(gres, res, n), 0.0, "residual dropout dres (written)");
  TU_ASSERT_CLOSE(diff(gy, y, n), 0.0, "residual dropout dy (written)");
  free(x), free(y), free(res), free(out);
  gpu_free(gx), gpu_free(gy), gpu_free(gres), gpu_free(gout);
}

/* The head layouts: q|k|v rows into heads and back (FiSH's Hqk < H too), heads merged and back. */
static void test_gpu_heads(void **state) {
  const long B = 2, T = 7;
  const int Hqk = 2, H = 3, d = 5, W = (2 * Hqk + H) * d;
  const size_t nq = (size_t)(B * Hqk * T * d), nv = (size_t)(B * H * T * d),
               nw = (size_t)(B * T * W);
  float *qkv = randn(nw, 111), *q = malloc(4 * nq), *k = malloc(4 * nq), *v = malloc(4 * nv);
  float *gqkv = up(qkv, nw), *gq = dev(4 * nq), *gk = dev(4 * nq), *gv = dev(4 * nv);
  heads_split_forward(q, k, v, qkv, B, T, Hqk, H, d);
  gpu_heads_split_forward(gq, gk, gv, gqkv, B, T, Hqk, H, d);
  TU_ASSERT_CLOSE(diff(gq, q, nq) + diff(gk, k, nq) + diff(gv, v, nv), 0.0, "heads split");
  heads_split_backward(qkv, q, k, v, B, T, Hqk, H, d);
  gpu_heads_split_backward(gqkv, gq, gk, gv, B, T, Hqk, H, d);
  TU_ASSERT_CLOSE(diff(gqkv, qkv, nw), 0.0, "heads split backward (written)");
  float *y = malloc(4 * nv), *gy = dev(4 * nv);
  heads_merge_forward(y, v, B, T, H, d);
  gpu_heads_merge_forward(gy, gv, B, T, H, d);
  TU_ASSERT_CLOSE(diff(gy, y, nv), 0.0, "heads merge");
  heads_merge_backward(v, y, B, T, H, d);
  gpu_heads_merge_backward(gv, gy, B, T, H, d);
  TU_ASSERT_CLOSE(diff(gv, v, nv), 0.0, "heads merge backward (written)");
  float *all[] = {qkv, q, k, v, y}, *gall[] = {gqkv, gq, gk, gv, gy};
  free_both(all, gall, 5);
}

/* The pool: a freed block serves the next request of its size class without the driver (large
 * ones split and merged), every block in use is counted by label, and the row packing of
 * exchanges copies and adds. */
static void test_gpu_memory(void **state) {
  gpu_release_cache(); /* an empty pool: the next free block of a class is the one freed below */
  const size_t before = mem_device_current(MEM_COMM);
  float *a = gpu_alloc(MEM_COMM, 1000 * sizeof(float));
  assert_true(mem_device_current(MEM_COMM) >= before + 4000);
  gpu_free(a);
  assert_true(mem_device_current(MEM_COMM) == before);
  float *b = gpu_alloc(MEM_COMM, 990 * sizeof(float));
  if (getenv("FMATTN_GPU_POOL") == NULL || getenv("FMATTN_GPU_POOL")[0] != '0')
    assert_ptr_equal(a, b); /* the same class: the pool's block again */
  gpu_free(b);
  if (getenv("FMATTN_GPU_POOL") == NULL || getenv("FMATTN_GPU_POOL")[0] != '0') {
    /* large blocks are cut from segments: a freed 8 MiB block serves 3 MiB and 5 MiB from its own
     * memory (split), and the two, freed, serve 8 MiB again (merged) */
    gpu_release_cache();
    char *big = gpu_alloc(MEM_COMM, 8u << 20);
    gpu_free(big);
    char *x3 = gpu_alloc(MEM_COMM, 3u << 20), *x5 = gpu_alloc(MEM_COMM, 5u << 20);
    assert_ptr_equal(x3, big);
    assert_ptr_equal(x5, big + (3u << 20));
    gpu_free(x5);
    gpu_free(x3);
    char *again = gpu_alloc(MEM_COMM, (8u << 20) - 100);
    assert_ptr_equal(again, big);
    gpu_free(again);
    gpu_release_cache();
  }
  float *z = gpu_alloc_zero(MEM_COMM, 77 * sizeof(float)), zh[77];
  gpu_download(zh, z, sizeof zh);
  for (int i = 0; i < 77; i++) assert_true(zh[i] == 0.0f);
  const size_t rows = 4, len = 6, ss = 10, ds = 8;
  float *src = randn(rows * ss, 121), *dst = randn(rows * ds, 122);
  float *gsrc = up(src, rows * ss), *gdst = up(dst, rows * ds);
  gpu_add_rows(gdst, ds, gsrc, ss, rows, len);
  for (size_t r = 0; r < rows; r++)
    for (size_t i = 0; i < len; i++) dst[r * ds + i] += src[r * ss + i];
  TU_ASSERT_CLOSE(diff(gdst, dst, rows * ds), 0.0, "rows added between strided layouts");
  gpu_copy_rows(gdst, ds, gsrc, ss, rows, len);
  for (size_t r = 0; r < rows; r++) memcpy(dst + r * ds, src + r * ss, sizeof(float) * len);
  TU_ASSERT_CLOSE(diff(gdst, dst, rows * ds), 0.0, "rows copied between strided layouts");
  free(src), free(dst);
  gpu_free(z), gpu_free(gsrc), gpu_free(gdst);
}

/* The pool's steady state: a step that repeats the previous one's requests needs no new
 * memory. The first step below adds a segment for C (a 16 MiB request that the 12 MiB left of A's
 * segment cannot hold); a best fit over all segments would put B in that segment in the second
 * step (its tightest fit), C in A's segment, and find no room for D. The pool takes the best fit in
 * the oldest segment where one fits, and repeats the first step's choices. Without the pool
 * every request is the driver's. */
static void test_gpu_pool_steady(void **state) {
  const bool pool = getenv("FMATTN_GPU_POOL") == NULL || getenv("FMATTN_GPU_POOL")[0] != '0';
  gpu_release_cache();
  for (int step = 0; step < 3; step++) {
    gpu_counts_reset();
    char *a = gpu_alloc(MEM_WORKSPACE, 20u << 20);
    gpu_free(a);
    char *b = gpu_alloc(MEM_WORKSPACE, 8u << 20), *c = gpu_alloc(MEM_WORKSPACE, 16u << 20),
         *d = gpu_alloc(MEM_WORKSPACE, 12u << 20);
    gpu_free(b), gpu_free(c), gpu_free(d);
    struct device_counts n;
    gpu_counts_read(&n);
    /* A's segment and C's; without the pool, every request */
    const double want = !pool ? 4.0 : step == 0 ? 2.0 : 0.0;
    if (n.mallocs != want)
      fail_msg("step %d: the pool asked the driver %.0f times, not %.0f", step + 1, n.mallocs,
               want);
  }
  gpu_release_cache();
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
  float *gout = dev(4 * count), *glse = dev(4 * (size_t)(BH * n));
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
                          dev(4 * count),
                          dev(4 * count),
                          dev(4 * count),
                          dev(4 * count),
                          dev(4 * (size_t)(BH * n))};
  float *q = randn(count, 61), *k = randn(count, 62), *v = randn(count, 63);
  const long at[] = {p + 1};
  const struct tu_probe probe = {at, 1, TU_MOVE_K | TU_MOVE_V, true};
  const struct tu_heads shape = {1, BH, BH, n, d};
  if (tu_causality_fn(gpu_forward, &g, &shape, q, k, v, &probe, "GPU exact attention"))
    fail_msg("GPU exact attention: the causality probe failed (listed above)");
  free(q), free(k), free(v);
  gpu_free(g.q), gpu_free(g.k), gpu_free(g.v), gpu_free(g.out), gpu_free(g.lse);
}

/* The NCCL transport of the communicator against MPI on every rank of the run: allreduce,
 * allgather and alltoallv on device buffers, with the byte counts comm.c's MPI transport keeps. */
static void test_gpu_nccl_transport(void **state) {
  int rank, size;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  struct comm c;
  comm_init(&c, size); /* one sequence group of every rank: the seq scope is the world too */
  gpu_comm_attach(&c);
  const size_t n = 4099;
  float *x = randn(n, 41 + (uint64_t)rank), *sum = malloc(sizeof(float) * n);
  MPI_Allreduce(x, sum, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  float *gx = up(x, n);
  const uint64_t b0 = c.bytes_sent;
  comm_allreduce_sum_float(&c, COMM_WORLD, gx, n);
  TU_ASSERT_CLOSE(diff(gx, sum, n), 1e-6, "NCCL allreduce against MPI_Allreduce");
  assert_true(c.bytes_sent - b0 == (uint64_t)(2.0 * (size - 1) / size * (double)(n * 4)));
  float *all = malloc(sizeof(float) * n * (size_t)size), *gall = dev(sizeof(float) * n * size);
  MPI_Allgather(x, (int)n, MPI_FLOAT, all, (int)n, MPI_FLOAT, MPI_COMM_WORLD);
  gpu_upload(gx, x, sizeof(float) * n);
  comm_allgather_float(&c, COMM_SEQ, gx, n, gall);
  TU_ASSERT_CLOSE(diff(gall, all, n * (size_t)size), 0.0, "NCCL allgather against MPI");
  /* alltoallv: rank r sends r + s + 1 floats to rank s */
  size_t sc[64], sd[64], rc[64], rd[64], so = 0, ro = 0;
  for (int r = 0; r < size; r++) {
    sc[r] = (size_t)(rank + r + 1), sd[r] = so, so += sc[r];
    rc[r] = (size_t)(r + rank + 1), rd[r] = ro, ro += rc[r];
  }
  float *snd = randn(so, 47 + (uint64_t)rank), *rcv = malloc(sizeof(float) * ro);
  int isc[64], isd[64], irc[64], ird[64];
  for (int r = 0; r < size; r++)
    isc[r] = (int)sc[r], isd[r] = (int)sd[r], irc[r] = (int)rc[r], ird[r] = (int)rd[r];
  MPI_Alltoallv(snd, isc, isd, MPI_FLOAT, rcv, irc, ird, MPI_FLOAT, MPI_COMM_WORLD);
  float *gsnd = up(snd, so), *grcv = dev(sizeof(float) * ro);
  comm_alltoallv_float(&c, gsnd, sc, sd, grcv, rc, rd);
  TU_ASSERT_CLOSE(diff(grcv, rcv, ro), 0.0, "NCCL alltoallv against MPI_Alltoallv");
  gpu_comm_detach(&c);
  comm_free(&c);
  free(x), free(sum), free(all), free(snd), free(rcv);
  gpu_free(gx), gpu_free(gall), gpu_free(gsnd), gpu_free(grcv);
}

static const struct CMUnitTest gpu_tests[] = {
    cmocka_unit_test(test_gpu_linear),
    cmocka_unit_test(test_gpu_layernorm),
    cmocka_unit_test(test_gpu_gelu),
    cmocka_unit_test(test_gpu_embedding),
    cmocka_unit_test(test_gpu_adamw),
    cmocka_unit_test(test_gpu_softmax_xent),
    cmocka_unit_test(test_gpu_gemm),
    cmocka_unit_test(test_gpu_gemm_bf16),
    cmocka_unit_test(test_gpu_fill_normal),
    cmocka_unit_test(test_gpu_positions),
    cmocka_unit_test(test_gpu_dropout),
    cmocka_unit_test(test_gpu_heads),
    cmocka_unit_test(test_gpu_memory),
    cmocka_unit_test(test_gpu_pool_steady),
    cmocka_unit_test(test_gpu_exact_attention),
    cmocka_unit_test(test_gpu_exact_causality),
    cmocka_unit_test(test_gpu_nccl_transport),
};

/* main: the tests on the device of this rank, or one TAP skip when there is none. The emulation's
 * harness (tests/cudaemu/test_gpu_emu.c) brings its own, which also checks for leaks. */
/* The device of this rank (the tests run on one). */
static int open_device(char *err, size_t len) {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return gpu_open(rank, false, err, len);
}

TU_GPU_MAIN("test_gpu", gpu_tests, open_device, gpu_close)
