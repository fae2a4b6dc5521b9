/* `nystrom` (SPEC §6.7) through its ops table against a float64 oracle written from the SPEC text
 * (landmark means, F, A, B, the pseudo-inverse iteration, the centred depthwise conv): out and
 * every gradient (q, k, v, the conv kernels) by its central differences, for several n, m, d, conv
 * lengths and iteration counts; clm is refused. (nystrom_pinv.c, a helper of
 * test_nystrom_pinv.sh, exposes the iteration to numpy.) */
#include "testutil.h"

#include "../src/attention/attention.h"
#include "../src/deck/config.h"

struct ny_case {
  long n, d;
  int m, iters, k;
};

/* ---------------------------------------------------------------------------------------------
 * the oracle, one head */

static void mm(double *c, const double *a, const double *b, long M, long N, long K) {
  for (long i = 0; i < M; i++)
    for (long j = 0; j < N; j++) {
      double s = 0;
      for (long t = 0; t < K; t++) s += a[i * K + t] * b[t * N + j];
      c[i * N + j] = s;
    }
}

/* rows of x (rows, cols) ← softmax of scale · (a bᵀ) */
static void softmax_scores(double *x, const double *a, const double *b, long rows, long cols,
                           long d, double scale) {
  for (long i = 0; i < rows; i++)
    for (long j = 0; j < cols; j++) {
      double s = 0;
      for (long c = 0; c < d; c++) s += a[i * d + c] * b[j * d + c];
      x[i * cols + j] = s * scale;
    }
  tu_softmax_rows(x, x, rows, cols);
}

/* Z ≈ pinv(A) after `iters` iterations of SPEC §6.7. */
static void oracle_pinv(double *Z, const double *A, long m, int iters) {
  double r = 0, c = 0;
  for (long i = 0; i < m; i++) {
    double rs = 0, cs = 0;
    for (long j = 0; j < m; j++) rs += A[i * m + j], cs += A[j * m + i];
    r = rs > r ? rs : r;
    c = cs > c ? cs : c;
  }
  for (long i = 0; i < m; i++)
    for (long j = 0; j < m; j++) Z[i * m + j] = A[j * m + i] / (r * c);
  double *AZ = malloc(sizeof(double) * m * m), *X = malloc(sizeof(double) * m * m),
         *Y = malloc(sizeof(double) * m * m);
  for (int t = 0; t < iters; t++) {
    mm(AZ, A, Z, m, m, m);
    for (long i = 0; i < m * m; i++) X[i] = (i % (m + 1) == 0 ? 7.0 : 0.0) - AZ[i];
    mm(Y, AZ, X, m, m, m);
    for (long i = 0; i < m * m; i++) X[i] = (i % (m + 1) == 0 ? 15.0 : 0.0) - Y[i];
    mm(Y, AZ, X, m, m, m);
    for (long i = 0; i < m * m; i++) X[i] = (i % (m + 1) == 0 ? 13.0 : 0.0) - Y[i];
    mm(Y, Z, X, m, m, m);
    for (long i = 0; i < m * m; i++) Z[i] = 0.25 * Y[i];
  }
  free(AZ);
  free(X);
  free(Y);
}

/* out (n, d) of one head; w (k) its conv kernel (ignored when k = 0). */
static void oracle_head(const struct ny_case *t, double *out, const double *q, const double *k,
                        const double *v, const double *w) {
  const long n = t->n, d = t->d, m = t->m, seg = n / m;
  const double scale = 1.0 / sqrt((double)d);
  double *qt = calloc(m * d, 8), *kt = calloc(m * d, 8), *F = calloc(n * m, 8),
         *A = calloc(m * m, 8), *B = calloc(m * n, 8), *Z = malloc(8 * m * m),
         *Bv = malloc(8 * m * d), *G = malloc(8 * m * d);
  for (long j = 0; j < m; j++)
    for (long s = 0; s < seg; s++)
      for (long c = 0; c < d; c++) {
        qt[j * d + c] += q[(j * seg + s) * d + c] / seg;
        kt[j * d + c] += k[(j * seg + s) * d + c] / seg;
      }
  softmax_scores(F, q, kt, n, m, d, scale);
  softmax_scores(A, qt, kt, m, m, d, scale);
  softmax_scores(B, qt, k, m, n, d, scale);
  oracle_pinv(Z, A, m, t->iters);
  mm(Bv, B, v, m, d, n);
  mm(G, Z, Bv, m, d, m);
  mm(out, F, G, n, d, m);
  for (long i = 0; i < n && t->k > 0; i++)
    for (int s = 0; s < t->k; s++) {
      const long j = i + s - (t->k - 1) / 2;
      if (j < 0 || j >= n) continue;
      for (long c = 0; c < d; c++) out[i * d + c] += w[s] * v[j * d + c];
    }
  free(qt), free(kt), free(F), free(A), free(B), free(Z), free(Bv), free(G);
}

static double oracle_dot(const struct ny_case *t, const double *g, const double *q, const double *k,
                         const double *v, const double *w) {
  double *out = malloc(8 * t->n * t->d), j = 0;
  oracle_head(t, out, q, k, v, w);
  for (long e = 0; e < t->n * t->d; e++) j += g[e] * out[e];
  free(out);
  return j;
}

/* ---------------------------------------------------------------------------------------------
 * the production op */

static void make_config(struct config *cfg, const struct ny_case *t, int H) {
  tu_config(cfg, "nystrom", t->n, H, (int)t->d, false,
            TU_SETS(tu_fmt("attention.nystrom.landmarks=%d", t->m),
                    tu_fmt("attention.nystrom.pinv_iters=%d", t->iters),
                    tu_fmt("attention.nystrom.conv=%d", t->k)));
}

static void check_case(const struct ny_case *t) {
  const long B = 2, H = 2, n = t->n, d = t->d, nd = n * d, count = B * H * nd;
  struct config cfg;
  make_config(&cfg, t, (int)H);
  float *q = malloc(4 * count), *k = malloc(4 * count), *v = malloc(4 * count),
        *g = malloc(4 * count);
  tu_randn(q, count, 500 + n, 1.0f);
  tu_randn(k, count, 600 + n, 1.0f);
  tu_randn(v, count, 700 + n, 1.0f);
  tu_randn(g, count, 800 + n, 1.0f);
  struct attn_params ap;
  attention_params_make(&ap, &cfg, attention_select(&cfg), n);
  struct attn_ctx ctx = tu_attn_open(&cfg, B);
  const bool has = ap.list.count > 0;
  struct tu_run r = tu_attn_run(&ctx, has ? ap.params : NULL, has ? ap.dparams : NULL, q, k, v, g);
  attention_close(&ctx);
  double *o = malloc(8 * count), *eq = malloc(8 * count), *ek = malloc(8 * count),
         *ev = malloc(8 * count), *ew = calloc(H * t->k + 1, 8);
  double *w = tu_to_double(ap.params, ap.list.count ? (size_t)(H * t->k) : 0);
  const double h = 1e-5;
  for (long bh = 0; bh < B * H; bh++) {
    const size_t off = (size_t)(bh * nd);
    double *qd = tu_to_double(q + off, nd), *kd = tu_to_double(k + off, nd),
           *vd = tu_to_double(v + off, nd), *gd = tu_to_double(g + off, nd);
    double *wh = w + (bh % H) * t->k;
    oracle_head(t, o + off, qd, kd, vd, wh);
    for (long e = 0; e < nd; e++) {
      TU_FD(eq[off + e], qd, e, h, oracle_dot(t, gd, qd, kd, vd, wh));
      TU_FD(ek[off + e], kd, e, h, oracle_dot(t, gd, qd, kd, vd, wh));
      TU_FD(ev[off + e], vd, e, h, oracle_dot(t, gd, qd, kd, vd, wh));
    }
    for (int s = 0; s < t->k; s++) {
      double fd;
      TU_FD(fd, wh, s, h, oracle_dot(t, gd, qd, kd, vd, wh));
      ew[(bh % H) * t->k + s] += fd;
    }
    free(qd), free(kd), free(vd), free(gd);
  }
  char what[160];
  snprintf(what, sizeof what, "nystrom n=%ld d=%ld m=%d iters=%d conv=%d", n, d, t->m, t->iters,
           t->k);
  TU_ASSERT_CLOSE(tu_rel_err(r.out, o, count), 1e-5, what);
  char w2[200];
  snprintf(w2, sizeof w2, "%s: dq", what);
  TU_ASSERT_CLOSE(tu_rel_err(r.dq, eq, count), 1e-4, w2);
  snprintf(w2, sizeof w2, "%s: dk", what);
  TU_ASSERT_CLOSE(tu_rel_err(r.dk, ek, count), 1e-4, w2);
  snprintf(w2, sizeof w2, "%s: dv", what);
  TU_ASSERT_CLOSE(tu_rel_err(r.dv, ev, count), 1e-4, w2);
  if (t->k > 0) {
    snprintf(w2, sizeof w2, "%s: dconv", what);
    TU_ASSERT_CLOSE(tu_rel_err(ap.dparams, ew, (size_t)(H * t->k)), 1e-4, w2);
  }
  tu_run_free(&r);
  free(q), free(k), free(v), free(g);
  free(o), free(eq), free(ek), free(ev), free(ew), free(w);
  attention_params_free(&ap);
  config_free(&cfg);
}

static void test_matches_oracle(void **state) {
  const struct ny_case cases[] = {
      {32, 4, 4, 6, 3},   {32, 4, 8, 6, 0},  {40, 4, 5, 1, 5}, {64, 8, 8, 6, 9},
      {130, 4, 2, 3, 33}, {16, 4, 16, 6, 1}, /* one token per segment: landmarks are q, k */
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) check_case(&cases[i]);
}

/* clm is refused with a message that says why; a conv length must be odd. */
static void test_refusals(void **state) {
  struct config cfg;
  char err[CONFIG_ERR_LEN];
  assert_int_not_equal(tu_config_try(&cfg, "nystrom", 64, 0, 0, true, NULL, err, sizeof err), 0);
  assert_non_null(strstr(err, "bidirectional only"));
  assert_non_null(strstr(err, "segment means mix future tokens"));
  assert_int_not_equal(tu_config_try(&cfg, "nystrom", 64, 0, 0, false,
                                     TU_SETS("attention.nystrom.conv=4"), err, sizeof err),
                       0);
  assert_non_null(strstr(err, "attention.nystrom.conv"));
  assert_non_null(strstr(err, "odd"));
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  cmocka_set_message_output(CM_OUTPUT_TAP);
  config_add_rule(attention_deck_rule); /* as main does: the variants refuse at their keys */
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_matches_oracle),
      cmocka_unit_test(test_refusals),
  };
  int rc = cmocka_run_group_tests(tests, NULL, NULL);
  MPI_Finalize();
  return rc;
}
