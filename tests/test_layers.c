/* Rung 1 of the test ladder: every per-token layer of src/nn/layers.c against a double-precision
 * reference written here, forward to 1e-5 and backward against central finite differences of the
 * reference (J = Σ dout · y), so both the float kernels and the formulas are checked. */
#include "testutil.h"

#ifdef _OPENMP
#include <omp.h>
#endif

#include "../src/core/rng.h"
#include "../src/core/tilegemm.h"
#include "../src/nn/layers.h"

#define FWD_TOL 2e-5
#define BWD_TOL 1e-4

/* ---------------------------------------------------------------------------------------------
 * linear */

static void ref_linear(double *y, const double *x, const double *w, const double *b, int N, int I,
                       int O) {
  for (int n = 0; n < N; n++)
    for (int o = 0; o < O; o++) {
      double s = b ? b[o] : 0.0;
      for (int i = 0; i < I; i++) s += x[n * I + i] * w[o * I + i];
      y[n * O + o] = s;
    }
}

static double j_linear(const double *x, const double *w, const double *b, const double *g, int N,
                       int I, int O) {
  double *y = malloc(sizeof(double) * N * O);
  ref_linear(y, x, w, b, N, I, O);
  double j = 0.0;
  for (int k = 0; k < N * O; k++) j += g[k] * y[k];
  free(y);
  return j;
}

static void test_linear(void **state) {
  const int N = 37, I = 24, O = 19; /* odd sizes on purpose */
  float x[N * I], w[O * I], b[O], g[N * O], y[N * O];
  tu_randn(x, N * I, 1, 1.0f);
  tu_randn(w, O * I, 2, 0.5f);
  tu_randn(b, O, 3, 0.5f);
  tu_randn(g, N * O, 4, 1.0f);
  linear_forward(y, x, w, b, N, I, O);
  double *xd = tu_to_double(x, N * I), *wd = tu_to_double(w, O * I), *bd = tu_to_double(b, O);
  double *gd = tu_to_double(g, N * O), yd[N * O];
  ref_linear(yd, xd, wd, bd, N, I, O);
  TU_ASSERT_CLOSE(tu_rel_err(y, yd, N * O), FWD_TOL, "linear forward");

  /* parameter gradients accumulate: start from a non-zero value and subtract it afterwards; the
   * input gradient is written: start it from NaN */
  float dx[N * I], dw[O * I], db[O];
  for (int k = 0; k < N * I; k++) dx[k] = NAN;
  for (int k = 0; k < O * I; k++) dw[k] = 2.0f;
  for (int k = 0; k < O; k++) db[k] = 3.0f;
  linear_backward(dx, dw, db, g, x, w, N, I, O);
  for (int k = 0; k < O * I; k++) dw[k] -= 2.0f;
  for (int k = 0; k < O; k++) db[k] -= 3.0f;
  double fx[N * I], fw[O * I], fb[O];
  for (int k = 0; k < N * I; k++) TU_FD(fx[k], xd, k, 1e-6, j_linear(xd, wd, bd, gd, N, I, O));
  for (int k = 0; k < O * I; k++) TU_FD(fw[k], wd, k, 1e-6, j_linear(xd, wd, bd, gd, N, I, O));
  for (int k = 0; k < O; k++) TU_FD(fb[k], bd, k, 1e-6, j_linear(xd, wd, bd, gd, N, I, O));
  TU_ASSERT_CLOSE(tu_rel_err(dx, fx, N * I), BWD_TOL, "linear dinp");
  TU_ASSERT_CLOSE(tu_rel_err(dw, fw, O * I), BWD_TOL, "linear dweight");
  TU_ASSERT_CLOSE(tu_rel_err(db, fb, O), BWD_TOL, "linear dbias");
  free(xd);
  free(wd);
  free(bd);
  free(gd);
}

/* The kernels linear runs on: CBLAS (row slices where each keeps LINEAR_SLICE_MNK multiply-adds)
 * and, built with libxsmm, its kernels in 64 × 64 blocks (products of 64 rows or more). Returns
 * how many there are; selects kernel `which` (0: CBLAS, 1: libxsmm). */
static int select_kernels(int which) {
#ifdef HAVE_LIBXSMM
  const int kinds = 2;
#else
  const int kinds = 1;
#endif
  if (which >= 0 && !tile_gemm_select(which == 1)) fail_msg("tile_gemm_select(%d) refused", which);
  return kinds;
}

/* Linear on CBLAS, in pieces fixed by the shape (one single-threaded product each, dX's and dW's
 * in one region), and in libxsmm's blocks give every element bit for bit as on one thread, at 2
 * and 3 threads. Two shapes: one of several pieces each way (785 rows: 3 pieces of forward and dX;
 * dW of 517 × 640: 2 × 2), one of a single piece (209 rows: one call on OpenBLAS's own threads);
 * odd on purpose, so the blocks are ragged. tests/test_blas_cores.sh runs this under every
 * OpenBLAS core the CPU can run. */
#ifdef _OPENMP
static void linear_pieces_shape(int N, int I, int O) {
  float *x = malloc(sizeof(float) * N * I), *w = malloc(sizeof(float) * O * I);
  float *b = malloc(sizeof(float) * O), *g = malloc(sizeof(float) * N * O);
  tu_randn(x, (size_t)N * I, 11, 1.0f);
  tu_randn(w, (size_t)O * I, 12, 0.5f);
  tu_randn(b, O, 13, 0.5f);
  tu_randn(g, (size_t)N * O, 14, 1.0f);
  float *y[2], *dx[2], *dw[2], *db[2];
  for (int r = 0; r < 2; r++) {
    y[r] = malloc(sizeof(float) * N * O), dx[r] = malloc(sizeof(float) * N * I);
    dw[r] = malloc(sizeof(float) * O * I), db[r] = malloc(sizeof(float) * O);
  }
  const int threads[] = {2, 3}, kinds = select_kernels(-1);
  const bool was_xsmm = tile_gemm_xsmm();
  for (int kind = 0; kind < kinds; kind++) {
    select_kernels(kind);
    for (int t = 0; t < 3; t++) { /* t = 0: one thread, the reference */
      const int r = t > 0;
      omp_set_num_threads(t ? threads[t - 1] : 1);
      for (int k = 0; k < O * I; k++) dw[r][k] = 0.25f; /* accumulated into */
      for (int k = 0; k < O; k++) db[r][k] = 0.5f;
      linear_forward(y[r], x, w, b, N, I, O);
      linear_backward(dx[r], dw[r], db[r], g, x, w, N, I, O);
      if (t == 0) continue;
      assert_memory_equal(y[1], y[0], sizeof(float) * N * O);
      assert_memory_equal(dx[1], dx[0], sizeof(float) * N * I);
      assert_memory_equal(dw[1], dw[0], sizeof(float) * O * I);
      assert_memory_equal(db[1], db[0], sizeof(float) * O);
    }
  }
  tile_gemm_select(was_xsmm);
  omp_set_num_threads(1);
  for (int r = 0; r < 2; r++) {
    free(y[r]);
    free(dx[r]);
    free(dw[r]);
    free(db[r]);
  }
  free(x);
  free(w);
  free(b);
  free(g);
}
#endif

static void test_linear_pieces(void **state) {
  (void)state;
#ifndef _OPENMP
  skip(); /* one thread only */
#else
  linear_pieces_shape(3 * 256 + 17, 640, 2 * 256 + 5);
  linear_pieces_shape(3 * 64 + 17, 640, 3 * 64 + 5);
#endif
}

/* Linear on each kernel against the double products, at sizes that make every block ragged (rows,
 * both feature counts) and dW's depth run in pieces of up to 512 rows; the parameter gradients
 * accumulate onto values already there. N rows: 2 · 512 + 37, the last piece short; 2 · 512, where
 * libxsmm's blocks sum the bias gradient inside dW's loop, and every kernel's dbias is the same
 * bits (the same chunks of rows, each summed in order). */
static void check_linear_blocks(const int N) {
  const int I = 70, O = 131;
  float *x = malloc(sizeof(float) * N * I), *w = malloc(sizeof(float) * O * I);
  float *b = malloc(sizeof(float) * O), *g = malloc(sizeof(float) * N * O);
  float *y = malloc(sizeof(float) * N * O), *dx = malloc(sizeof(float) * N * I);
  float *dw = malloc(sizeof(float) * O * I), *db = malloc(sizeof(float) * O);
  tu_randn(x, (size_t)N * I, 21, 1.0f);
  tu_randn(w, (size_t)O * I, 22, 0.5f);
  tu_randn(b, O, 23, 0.5f);
  tu_randn(g, (size_t)N * O, 24, 1.0f);
  double *xd = tu_to_double(x, (size_t)N * I), *wd = tu_to_double(w, (size_t)O * I);
  double *bd = tu_to_double(b, O), *gd = tu_to_double(g, (size_t)N * O);
  double *yd = malloc(sizeof(double) * N * O), *dxd = calloc((size_t)N * I, sizeof(double));
  double *dwd = malloc(sizeof(double) * O * I), *dbd = malloc(sizeof(double) * O);
  ref_linear(yd, xd, wd, bd, N, I, O);
  for (int k = 0; k < O * I; k++) dwd[k] = 0.25;
  for (int o = 0; o < O; o++) dbd[o] = 0.5;
  for (int n = 0; n < N; n++)
    for (int o = 0; o < O; o++) {
      const double go = gd[n * O + o];
      dbd[o] += go;
      for (int i = 0; i < I; i++) {
        dxd[n * I + i] += go * wd[o * I + i];
        dwd[o * I + i] += go * xd[n * I + i];
      }
    }
  const int kinds = select_kernels(-1);
  const bool was_xsmm = tile_gemm_xsmm();
  float db0[O];
  for (int kind = 0; kind < kinds; kind++) {
    select_kernels(kind);
    for (int k = 0; k < N * I; k++) dx[k] = NAN; /* written */
    for (int k = 0; k < O * I; k++) dw[k] = 0.25f;
    for (int k = 0; k < O; k++) db[k] = 0.5f;
    linear_forward(y, x, w, b, N, I, O);
    linear_backward(dx, dw, db, g, x, w, N, I, O);
    TU_ASSERT_CLOSE(tu_rel_err(y, yd, (size_t)N * O), FWD_TOL, "linear forward");
    TU_ASSERT_CLOSE(tu_rel_err(dx, dxd, (size_t)N * I), FWD_TOL, "linear dinp");
    TU_ASSERT_CLOSE(tu_rel_err(dw, dwd, (size_t)O * I), FWD_TOL, "linear dweight");
    TU_ASSERT_CLOSE(tu_rel_err(db, dbd, O), FWD_TOL, "linear dbias");
    if (kind == 0) memcpy(db0, db, sizeof db0);
    assert_memory_equal(db, db0, sizeof db0);
  }
  tile_gemm_select(was_xsmm);
  free(x), free(w), free(b), free(g), free(y), free(dx), free(dw), free(db);
  free(xd), free(wd), free(bd), free(gd), free(yd), free(dxd), free(dwd), free(dbd);
}

static void test_linear_blocks(void **state) {
  (void)state;
  check_linear_blocks(2 * 512 + 37);
  check_linear_blocks(2 * 512);
}

/* ---------------------------------------------------------------------------------------------
 * layernorm */

static void ref_layernorm(double *y, const double *x, const double *w, const double *b, int N,
                          int C) {
  for (int n = 0; n < N; n++) {
    double m = 0.0, v = 0.0;
    for (int c = 0; c < C; c++) m += x[n * C + c];
    m /= C;
    for (int c = 0; c < C; c++) v += (x[n * C + c] - m) * (x[n * C + c] - m);
    v /= C;
    double r = 1.0 / sqrt(v + 1e-5);
    for (int c = 0; c < C; c++) y[n * C + c] = (x[n * C + c] - m) * r * w[c] + b[c];
  }
}

static double j_layernorm(const double *x, const double *w, const double *b, const double *g, int N,
                          int C) {
  double *y = malloc(sizeof(double) * N * C);
  ref_layernorm(y, x, w, b, N, C);
  double j = 0.0;
  for (int k = 0; k < N * C; k++) j += g[k] * y[k];
  free(y);
  return j;
}

static void test_layernorm(void **state) {
  const int N = 70, C = 33; /* N > the 64 reduction chunks */
  float x[N * C], w[C], b[C], g[N * C], y[N * C], mean[N], rstd[N];
  tu_randn(x, N * C, 5, 2.0f);
  for (int k = 0; k < N * C; k++) x[k] += 0.7f; /* non-zero mean */
  tu_randn(w, C, 6, 1.0f);
  tu_randn(b, C, 7, 1.0f);
  tu_randn(g, N * C, 8, 1.0f);
  layernorm_forward(y, mean, rstd, x, w, b, N, C);
  double *xd = tu_to_double(x, N * C), *wd = tu_to_double(w, C), *bd = tu_to_double(b, C);
  double *gd = tu_to_double(g, N * C), yd[N * C];
  ref_layernorm(yd, xd, wd, bd, N, C);
  TU_ASSERT_CLOSE(tu_rel_err(y, yd, N * C), FWD_TOL, "layernorm forward");
  float dx[N * C], dw[C], db[C];
  memset(dx, 0, sizeof dx);
  memset(dw, 0, sizeof dw);
  memset(db, 0, sizeof db);
  layernorm_backward(dx, dw, db, g, x, w, mean, rstd, N, C);
  double fx[N * C], fw[C], fb[C];
  for (int k = 0; k < N * C; k++) TU_FD(fx[k], xd, k, 1e-6, j_layernorm(xd, wd, bd, gd, N, C));
  for (int k = 0; k < C; k++) TU_FD(fw[k], wd, k, 1e-6, j_layernorm(xd, wd, bd, gd, N, C));
  for (int k = 0; k < C; k++) TU_FD(fb[k], bd, k, 1e-6, j_layernorm(xd, wd, bd, gd, N, C));
  TU_ASSERT_CLOSE(tu_rel_err(dx, fx, N * C), BWD_TOL, "layernorm dinp");
  TU_ASSERT_CLOSE(tu_rel_err(dw, fw, C), BWD_TOL, "layernorm dweight");
  TU_ASSERT_CLOSE(tu_rel_err(db, fb, C), BWD_TOL, "layernorm dbias");
  free(xd);
  free(wd);
  free(bd);
  free(gd);
}

/* ---------------------------------------------------------------------------------------------
 * GELU */

static double ref_gelu(double x) {
  return 0.5 * x * (1.0 + tanh(sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x)));
}

static void test_gelu(void **state) {
  const int N = 1001;
  float x[N], y[N], g[N], dx[N];
  tu_randn(x, N, 9, 3.0f);
  tu_randn(g, N, 10, 1.0f);
  gelu_forward(y, x, N);
  double yd[N], fd[N];
  for (int k = 0; k < N; k++) {
    yd[k] = ref_gelu(x[k]);
    double h = 1e-6;
    fd[k] = g[k] * (ref_gelu((double)x[k] + h) - ref_gelu((double)x[k] - h)) / (2 * h);
  }
  TU_ASSERT_CLOSE(tu_rel_err(y, yd, N), FWD_TOL, "gelu forward");
  for (int k = 0; k < N; k++) dx[k] = NAN; /* written, not accumulated */
  gelu_backward(dx, g, x, N);
  TU_ASSERT_CLOSE(tu_rel_err(dx, fd, N), BWD_TOL, "gelu backward");
}

/* GELU forward and backward give every value the same bits on 1, 2 and 3 threads, for counts that
 * do not split into whole vectors among the threads (before: each thread's ragged tail went
 * through the scalar tanhf, whose last bit differs from the vector one's). */
static void test_gelu_threads(void **state) {
  (void)state;
#ifndef _OPENMP
  skip();
#else
  enum { MAX = 5000 };
  float *x = malloc(sizeof(float) * MAX), *g = malloc(sizeof(float) * MAX);
  float *y[2], *dx[2];
  for (int r = 0; r < 2; r++)
    y[r] = malloc(sizeof(float) * MAX), dx[r] = malloc(sizeof(float) * MAX);
  tu_randn(x, MAX, 41, 2.0f);
  tu_randn(g, MAX, 42, 1.0f);
  const int was = omp_get_max_threads();
  for (int count = 1000; count < MAX; count += 397)
    for (int t = 1; t <= 3; t++) {
      const int r = t > 1;
      omp_set_num_threads(t);
      gelu_forward(y[r], x, (size_t)count);
      gelu_backward(dx[r], g, x, (size_t)count);
      if (!r) continue;
      assert_memory_equal(y[1], y[0], sizeof(float) * count);
      assert_memory_equal(dx[1], dx[0], sizeof(float) * count);
    }
  omp_set_num_threads(was);
  for (int r = 0; r < 2; r++) free(y[r]), free(dx[r]);
  free(x), free(g);
#endif
}

/* ---------------------------------------------------------------------------------------------
 * embeddings */

static void test_embedding(void **state) {
  const int B = 3, T = 11, C = 8, V = 5, n = 40;
  const long t0 = 13; /* a slab that does not start at 0 */
  int tok[B * T];
  for (int k = 0; k < B * T; k++) tok[k] = (k * 7 + 3) % V;
  float wte[V * C], wpe[n * C], y[B * T * C], g[B * T * C];
  tu_randn(wte, V * C, 11, 1.0f);
  tu_randn(wpe, n * C, 12, 1.0f);
  tu_randn(g, B * T * C, 13, 1.0f);
  embedding_forward(y, tok, wte, wpe, B, T, C, t0);
  double yd[B * T * C];
  for (int b = 0; b < B; b++)
    for (int t = 0; t < T; t++)
      for (int c = 0; c < C; c++)
        yd[(b * T + t) * C + c] = (double)wte[tok[b * T + t] * C + c] + wpe[(t0 + t) * C + c];
  TU_ASSERT_CLOSE(tu_rel_err(y, yd, B * T * C), 1e-7, "embedding forward");
  float dwte[V * C], dwpe[n * C];
  memset(dwte, 0, sizeof dwte);
  memset(dwpe, 0, sizeof dwpe);
  embedding_backward(dwte, dwpe, g, tok, B, T, C, V, t0);
  double ewte[V * C], ewpe[n * C];
  memset(ewte, 0, sizeof ewte);
  memset(ewpe, 0, sizeof ewpe);
  for (int b = 0; b < B; b++)
    for (int t = 0; t < T; t++)
      for (int c = 0; c < C; c++) {
        ewte[tok[b * T + t] * C + c] += g[(b * T + t) * C + c];
        ewpe[(t0 + t) * C + c] += g[(b * T + t) * C + c];
      }
  TU_ASSERT_CLOSE(tu_rel_err(dwte, ewte, V * C), 1e-6, "embedding dtoken");
  TU_ASSERT_CLOSE(tu_rel_err(dwpe, ewpe, n * C), 1e-6, "embedding dposition");
}

static void test_sinusoidal(void **state) {
  const int B = 2, T = 5, C = 6;
  const long t0 = 1000;
  float x[B * T * C];
  memset(x, 0, sizeof x);
  sinusoidal_forward(x, B, T, C, t0, 0.5f);
  double e[B * T * C];
  for (int b = 0; b < B; b++)
    for (int t = 0; t < T; t++)
      for (int i = 0; i < C / 2; i++) {
        double ang = (double)(t0 + t) / pow(10000.0, 2.0 * i / C);
        e[(b * T + t) * C + 2 * i] = 0.5 * sin(ang);
        e[(b * T + t) * C + 2 * i + 1] = 0.5 * cos(ang);
      }
  TU_ASSERT_CLOSE(tu_rel_err(x, e, B * T * C), 1e-6, "sinusoidal table");
}

/* ---------------------------------------------------------------------------------------------
 * rotary embedding */

static void ref_rope(double *y, const double *x, int BH, int T, int d, long t0) {
  for (int bh = 0; bh < BH; bh++)
    for (int t = 0; t < T; t++)
      for (int i = 0; i < d / 2; i++) {
        double ang = (double)(t0 + t) * pow(10000.0, -2.0 * i / d);
        const double *r = x + (bh * T + t) * d;
        double *o = y + (bh * T + t) * d;
        o[2 * i] = r[2 * i] * cos(ang) - r[2 * i + 1] * sin(ang);
        o[2 * i + 1] = r[2 * i] * sin(ang) + r[2 * i + 1] * cos(ang);
      }
}

static void test_rope(void **state) {
  const int BH = 3, T = 9, d = 8;
  const long t0 = 50;
  float x[BH * T * d], g[BH * T * d];
  tu_randn(x, BH * T * d, 14, 1.0f);
  tu_randn(g, BH * T * d, 15, 1.0f);
  double *xd = tu_to_double(x, BH * T * d), yd[BH * T * d];
  ref_rope(yd, xd, BH, T, d, t0);
  rope_forward(x, BH, T, d, t0);
  TU_ASSERT_CLOSE(tu_rel_err(x, yd, BH * T * d), FWD_TOL, "rope forward");
  /* the gradient of J = Σ g·rope(x) is rope⁻¹(g): check it by finite differences */
  double fd[BH * T * d], *gd = tu_to_double(g, BH * T * d);
  for (int k = 0; k < BH * T * d; k++) {
    double s = xd[k], jp, jm;
    xd[k] = s + 1e-6;
    ref_rope(yd, xd, BH, T, d, t0);
    jp = 0;
    for (int q = 0; q < BH * T * d; q++) jp += gd[q] * yd[q];
    xd[k] = s - 1e-6;
    ref_rope(yd, xd, BH, T, d, t0);
    jm = 0;
    for (int q = 0; q < BH * T * d; q++) jm += gd[q] * yd[q];
    xd[k] = s;
    fd[k] = (jp - jm) / 2e-6;
  }
  rope_backward(g, BH, T, d, t0);
  TU_ASSERT_CLOSE(tu_rel_err(g, fd, BH * T * d), BWD_TOL, "rope backward");
  free(xd);
  free(gd);
}

/* ---------------------------------------------------------------------------------------------
 * dropout */

static void test_dropout(void **state) {
  const int B = 4, T = 64, C = 37;
  const size_t N = (size_t)B * T * C;
  float *res = malloc(sizeof(float) * N), *y = malloc(sizeof(float) * N);
  float *out = malloc(sizeof(float) * N), *g = malloc(sizeof(float) * N);
  float *dres = malloc(sizeof(float) * N), *dy = malloc(sizeof(float) * N);
  for (size_t i = 0; i < N; i++) dres[i] = dy[i] = NAN; /* both written, not accumulated */
  tu_randn(res, N, 16, 1.0f);
  tu_randn(y, N, 17, 1.0f);
  tu_randn(g, N, 18, 1.0f);
  struct dropout_key key = {1234, 7, 3, 5, 100, 0.25f};
  residual_dropout_forward(out, res, y, &key, B, T, C);
  size_t dropped = 0;
  float *mask = malloc(sizeof(float) * N);
  for (size_t i = 0; i < N; i++) {
    const double tol = 1e-6 * (fabs(res[i]) + fabs(y[i]));
    if (fabs((double)out[i] - res[i]) <= tol) {
      dropped++;
      mask[i] = 0.0f;
    } else if (fabs((double)out[i] - (res[i] + y[i] / 0.75)) <= tol) {
      mask[i] = 1.0f / 0.75f;
    } else {
      fail_msg("element %zu is neither dropped nor scaled by 1/(1-p)", i);
    }
  }
  double rate = (double)dropped / (double)N;
  if (fabs(rate - 0.25) > 0.02) fail_msg("drop rate %.4f, expected 0.25", rate);
  /* the mask is its definition's, bit for bit: 16 bits per element, 4 elements per rng_bits of
   * (seed, RNG_DROPOUT, step, site << 40 ^ sample, token · ⌈C/4⌉ + c/4), kept when ≥ p·65536 */
  const int C4 = (C + 3) / 4;
  for (int b = 0; b < B; b++)
    for (int t = 0; t < T; t++)
      for (int c = 0; c < C; c++) {
        const uint64_t r = rng_bits(key.seed, RNG_DROPOUT, (uint64_t)key.step,
                                    ((uint64_t)key.site << 40) ^ (uint64_t)(key.sample0 + b),
                                    (uint64_t)(key.t0 + t) * (uint64_t)C4 + (uint64_t)(c / 4));
        const bool keep = ((r >> (16 * (c % 4))) & 0xFFFFu) >= (uint64_t)(0.25f * 65536.0f);
        if (keep != (mask[((size_t)b * T + t) * C + c] != 0.0f))
          fail_msg("element (%d, %d, %d): the mask is not its definition's", b, t, c);
      }
  residual_dropout_backward(dres, dy, g, &key, B, T, C);
  for (size_t i = 0; i < N; i++) {
    if (dres[i] != g[i]) fail_msg("residual gradient changed at %zu", i);
    if (fabs(dy[i] - g[i] * mask[i]) > 1e-6 * (1 + fabs(g[i]))) fail_msg("dy differs at %zu", i);
  }
  /* in place, as the model adds into the residual stream's gradient: dres = dout is left as it is
   * and dy is the same, bit for bit */
  float *dy2 = malloc(sizeof(float) * N);
  memcpy(dres, g, sizeof(float) * N);
  residual_dropout_backward(dres, dy2, dres, &key, B, T, C);
  for (size_t i = 0; i < N; i++)
    if (dres[i] != g[i] || dy2[i] != dy[i]) fail_msg("in place: element %zu differs", i);
  free(dy2);
  /* the mask depends on the global sample and token, not on the local layout */
  struct dropout_key shifted = key;
  shifted.sample0 = key.sample0 + 1;
  shifted.t0 = key.t0 + 10;
  float *out2 = malloc(sizeof(float) * N);
  residual_dropout_forward(out2, res + (size_t)T * C + 10 * C, y + (size_t)T * C + 10 * C, &shifted,
                           1, T - 10, C);
  for (size_t i = 0; i < (size_t)(T - 10) * C; i++)
    if (out2[i] != out[(size_t)T * C + 10 * C + i]) fail_msg("mask depends on layout at %zu", i);
  free(res);
  free(y);
  free(out);
  free(g);
  free(dres);
  free(dy);
  free(out2);
  free(mask);
}

/* ---------------------------------------------------------------------------------------------
 * head layout */

static void test_heads(void **state) {
  const int B = 2, T = 5, H = 3, d = 4, C = H * d;
  float qkv[B * T * 3 * C], q[B * H * T * d], k[B * H * T * d], v[B * H * T * d];
  tu_randn(qkv, B * T * 3 * C, 19, 1.0f);
  heads_split_forward(q, k, v, qkv, B, T, H, H, d);
  for (int b = 0; b < B; b++)
    for (int h = 0; h < H; h++)
      for (int t = 0; t < T; t++)
        for (int i = 0; i < d; i++) {
          int dst = ((b * H + h) * T + t) * d + i, src = (b * T + t) * 3 * C + h * d + i;
          assert_true(q[dst] == qkv[src] && k[dst] == qkv[src + C] && v[dst] == qkv[src + 2 * C]);
        }
  float back[B * T * 3 * C];
  memset(back, 0xff, sizeof back); /* NaN: written, not accumulated */
  heads_split_backward(back, q, k, v, B, T, H, H, d);
  assert_memory_equal(back, qkv, sizeof back);
  float y[B * T * C], att2[B * H * T * d];
  heads_merge_forward(y, q, B, T, H, d);
  memset(att2, 0xff, sizeof att2);
  heads_merge_backward(att2, y, B, T, H, d);
  assert_memory_equal(att2, q, sizeof att2);
  /* FiSH heads: G = 2 query/key heads for H = 3 value heads, rows q (2d) | k (2d) | v (3d) */
  enum { G = 2, W = (2 * G + H) * d };
  float x[B * T * W], fq[B * G * T * d], fk[B * G * T * d], fv[B * H * T * d], fb[B * T * W];
  tu_randn(x, B * T * W, 20, 1.0f);
  heads_split_forward(fq, fk, fv, x, B, T, G, H, d);
  for (int b = 0; b < B; b++)
    for (int t = 0; t < T; t++)
      for (int i = 0; i < d; i++) {
        for (int h = 0; h < G; h++) {
          const int dst = ((b * G + h) * T + t) * d + i, src = (b * T + t) * W + h * d + i;
          assert_true(fq[dst] == x[src] && fk[dst] == x[src + G * d]);
        }
        for (int h = 0; h < H; h++)
          assert_true(fv[((b * H + h) * T + t) * d + i] ==
                      x[(b * T + t) * W + 2 * G * d + h * d + i]);
      }
  memset(fb, 0xff, sizeof fb);
  heads_split_backward(fb, fq, fk, fv, B, T, G, H, d);
  assert_memory_equal(fb, x, sizeof fb);
}

/* ---------------------------------------------------------------------------------------------
 * softmax cross-entropy */

static void test_xent(void **state) {
  const int N = 9, V = 13;
  float z[N * V];
  int tgt[N];
  tu_randn(z, N * V, 20, 3.0f);
  z[2 * V + 4] = 80.0f; /* a dominant logit must not overflow */
  for (int i = 0; i < N; i++) tgt[i] = (i * 5) % V;
  tgt[3] = -1; /* not counted */
  double *zd = tu_to_double(z, N * V);
  const float scale = 0.125f;
  double expect = 0.0, rows[N];
  double fd[N * V];
  for (int i = 0; i < N; i++) {
    rows[i] = 0.0;
    if (tgt[i] < 0) {
      for (int j = 0; j < V; j++) fd[i * V + j] = 0.0;
      continue;
    }
    double mx = -1e300, s = 0.0;
    for (int j = 0; j < V; j++) mx = zd[i * V + j] > mx ? zd[i * V + j] : mx;
    for (int j = 0; j < V; j++) s += exp(zd[i * V + j] - mx);
    rows[i] = log(s) + mx - zd[i * V + tgt[i]];
    expect += rows[i];
    for (int j = 0; j < V; j++)
      fd[i * V + j] = scale * (exp(zd[i * V + j] - mx) / s - (j == tgt[i]));
  }
  float row_loss[N];
  double got = softmax_xent_forward_backward(z, tgt, N, V, scale, row_loss);
  TU_ASSERT_CLOSE(fabs(got - expect) / fabs(expect), 1e-6, "cross-entropy loss");
  TU_ASSERT_CLOSE(tu_rel_err(row_loss, rows, N), 1e-6, "cross-entropy loss per row");
  TU_ASSERT_CLOSE(tu_rel_err(z, fd, N * V), 1e-5, "cross-entropy gradient");
  free(zd);
}

static const struct CMUnitTest tests[] = {
    cmocka_unit_test(test_linear),        cmocka_unit_test(test_linear_pieces),
    cmocka_unit_test(test_linear_blocks), cmocka_unit_test(test_layernorm),
    cmocka_unit_test(test_gelu),          cmocka_unit_test(test_gelu_threads),
    cmocka_unit_test(test_embedding),     cmocka_unit_test(test_sinusoidal),
    cmocka_unit_test(test_rope),          cmocka_unit_test(test_dropout),
    cmocka_unit_test(test_heads),         cmocka_unit_test(test_xent),
};

TU_MAIN(tests)
