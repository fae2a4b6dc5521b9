/* The FMA test ladder (STYLE rule 10): the interaction lists (every allowed pair covered exactly
 * once), the double-precision oracle of fma_oracle.c checked against central finite differences,
 * its dense n×n form and the full-attention limit, then the production `fma` and `fma_linear`
 * through their ops table against the oracle (out, dq, dk, dv and every parameter gradient) over
 * downsample × causal × multiplicity × init × (n, m, p), unit values with v ≡ 1, causality by
 * perturbation, the shifted causal query summary, and float gradients against float differences.
 * It reads nothing of the production FMA code but the tree and the lists. */
#include "testutil.h"

#include "../src/attention.h"
#include "../src/config.h"
#include "../src/fma_lists.h"
#include "../src/fma_tree.h"
#include "../src/params.h"
#include "fma_oracle.h"

static const char *const down_name[] = {"conv", "m2m", "avg"};

/* ================================================================================================
 * Interaction lists
 * ============================================================================================== */

/* fma_lists says what SPEC §6.4 says, window by window (the oracle's lists are the SPEC text). */
static void test_lists_match_spec(void **state) {
  const long ratios[] = {2, 4, 8, 16, 32, 128};
  const int ms[] = {1, 3, 8};
  for (int causal = 0; causal < 2; causal++)
    for (size_t a = 0; a < sizeof ratios / sizeof ratios[0]; a++)
      for (size_t b = 0; b < sizeof ms / sizeof ms[0]; b++) {
        const long n = ratios[a] * ms[b];
        struct fma_tree tree;
        fma_tree_build(&tree, n, ms[b], 1);
        struct fo_cfg c;
        fo_cfg_init(&c, n, 1, ms[b], 1, FO_AVG, causal, true);
        assert_int_equal(tree.levels, c.levels);
        for (long blk = 0; blk < n / ms[b]; blk++) {
          long x[FMA_LIST_MAX + 2], y[FO_LIST_MAX];
          int nx = fma_lists_near(&tree, causal, blk, x), ny = fo_near(&c, blk, y);
          assert_int_equal(nx, ny);
          for (int e = 0; e < nx; e++) assert_int_equal(x[e], y[e]);
        }
        for (int l = 1; l <= c.levels; l++) {
          assert_int_equal(tree.window[l], c.w[l]);
          for (long cw = 0; cw < n / c.w[l]; cw++) {
            long x[FMA_LIST_MAX + 2], y[FO_LIST_MAX];
            int nx = fma_lists_level(&tree, causal, l, cw, x), ny = fo_level(&c, l, cw, y);
            if (nx != ny)
              fail_msg("n=%ld m=%d %s level %d window %ld: fma_lists gives %d windows, SPEC %d", n,
                       ms[b], causal ? "causal" : "bidir", l, cw, nx, ny);
            for (int e = 0; e < nx; e++) assert_int_equal(x[e], y[e]);
          }
        }
      }
}

/* Counting coverage from the lists themselves (fma_lists_near / fma_lists_level, not band): every
 * allowed (i, j) exactly once, nothing disallowed. In causal mode the caller masks j > i inside
 * block b only, so a listed block after b would show up as a disallowed pair. */
static void test_lists_cover_exactly_once(void **state) {
  const long ratios[] = {2, 4, 8, 16, 64, 256};
  const int ms[] = {1, 2, 4};
  for (int causal = 0; causal < 2; causal++)
    for (size_t a = 0; a < sizeof ratios / sizeof ratios[0]; a++)
      for (size_t b = 0; b < sizeof ms / sizeof ms[0]; b++) {
        const int m = ms[b];
        const long n = ratios[a] * m;
        struct fma_tree tree;
        fma_tree_build(&tree, n, m, 1);
        unsigned char *cover = calloc((size_t)(n * n), 1);
        signed char *band = malloc((size_t)(n * n));
        memset(band, -1, (size_t)(n * n));
        for (long i = 0; i < n; i++) {
          long list[FMA_LIST_MAX + 2];
          long bi = i / m;
          int cnt = fma_lists_near(&tree, causal, bi, list);
          for (int e = 0; e < cnt; e++)
            for (long j = list[e] * m; j < (list[e] + 1) * m; j++) {
              if (causal && list[e] == bi && j > i) continue;
              cover[i * n + j]++;
              band[i * n + j] = 0;
            }
          for (int l = 1; l <= tree.levels; l++) {
            long w = tree.window[l];
            cnt = fma_lists_level(&tree, causal, l, i / w, list);
            for (int e = 0; e < cnt; e++)
              for (long j = list[e] * w; j < (list[e] + 1) * w; j++) {
                cover[i * n + j]++;
                band[i * n + j] = (signed char)l;
              }
          }
        }
        for (long i = 0; i < n; i++)
          for (long j = 0; j < n; j++) {
            bool allowed = !causal || j <= i;
            int want = allowed ? 1 : 0;
            if (cover[i * n + j] != want)
              fail_msg("n=%ld m=%d %s: pair (%ld, %ld) covered %d times, expected %d", n, m,
                       causal ? "causal" : "bidir", i, j, cover[i * n + j], want);
            /* fma_lists_band agrees with the lists (what the diagnostics of `full` rely on) */
            if (fma_lists_band(&tree, causal, i, j) != band[i * n + j])
              fail_msg("n=%ld m=%d: fma_lists_band(%ld, %ld) = %d, the lists say %d", n, m, i, j,
                       fma_lists_band(&tree, causal, i, j), band[i * n + j]);
          }
        free(cover);
        free(band);
      }
}

/* ================================================================================================
 * The oracle against itself: finite differences, dense form, full-attention limit, mean init
 * ============================================================================================== */

/* Random parameters of a size that keeps summaries O(1): weight ~ N(0, 1/taps), bias ~ N(0, 0.1).
 */
static void random_params(const struct fo_cfg *c, struct fo_params *P, uint64_t key) {
  for (int l = 1; l <= c->levels; l++) {
    if (!P->weight[l]) continue;
    tu_randn_d(P->weight[l], (size_t)fo_weight_len(c, l), key * 100 + 2 * l,
               1.0 / sqrt((double)fo_weight_taps(c, l)));
    tu_randn_d(P->bias[l], (size_t)fo_bias_len(c, l), key * 100 + 2 * l + 1, 0.3);
  }
}

struct fd_case {
  struct fo_cfg c;
  bool linear;
  double *q, *k, *v, *g;
  struct fo_params qp, kp, vp;
};

static double fd_objective(struct fd_case *t) {
  const long N = t->c.n * t->c.d;
  double *o = malloc(sizeof(double) * (size_t)N);
  if (t->linear)
    fo_fma_linear(&t->c, o, NULL, NULL, NULL, NULL, NULL, NULL, t->q, t->k, t->v, &t->qp, &t->kp,
                  &t->vp, NULL);
  else
    fo_fma(&t->c, o, NULL, NULL, NULL, NULL, NULL, t->q, t->k, t->v, &t->kp, &t->vp, NULL);
  double J = 0.0;
  for (long i = 0; i < N; i++) J += t->g[i] * o[i];
  free(o);
  return J;
}

static void fd_check_tensor(struct fd_case *t, double *x, size_t N, const double *grad,
                            const char *what, const char *name) {
  double *f = malloc(sizeof(double) * (N ? N : 1));
  for (size_t i = 0; i < N; i++) TU_FD(f[i], x, i, 1e-6, fd_objective(t));
  char msg[256];
  snprintf(msg, sizeof msg, "%s: oracle %s vs finite differences", what, name);
  TU_ASSERT_CLOSE(tu_rel_err_dd(grad, f, N), 1e-6, msg);
  free(f);
}

static void fd_check_params(struct fd_case *t, struct fo_params *P, struct fo_params *dP,
                            const char *what, const char *name) {
  size_t N = fo_params_count(&t->c);
  if (!N) return;
  double *grad = malloc(sizeof(double) * N), *f = malloc(sizeof(double) * N);
  for (size_t i = 0; i < N; i++) {
    grad[i] = *fo_params_at(&t->c, dP, i);
    double *x = fo_params_at(&t->c, P, i);
    TU_FD(f[i], x, 0, 1e-6, fd_objective(t));
  }
  char msg[256];
  snprintf(msg, sizeof msg, "%s: oracle %s vs finite differences", what, name);
  TU_ASSERT_CLOSE(tu_rel_err_dd(grad, f, N), 1e-6, msg);
  free(grad);
  free(f);
}

static void fd_case_run(long n, long d, int m, int p, enum fo_down down, bool causal, bool mult,
                        bool linear) {
  struct fd_case t = {.linear = linear};
  fo_cfg_init(&t.c, n, d, m, p, down, causal, mult);
  const long N = n * d;
  uint64_t key = (uint64_t)(n * 1000 + down * 100 + causal * 10 + mult * 2 + linear);
  t.q = malloc(sizeof(double) * N);
  t.k = malloc(sizeof(double) * N);
  t.v = malloc(sizeof(double) * N);
  t.g = malloc(sizeof(double) * N);
  tu_randn_d(t.q, N, key + 1, 1.0);
  tu_randn_d(t.k, N, key + 2, 1.0);
  tu_randn_d(t.v, N, key + 3, 1.0);
  tu_randn_d(t.g, N, key + 4, 1.0);
  fo_params_alloc(&t.c, &t.qp);
  fo_params_alloc(&t.c, &t.kp);
  fo_params_alloc(&t.c, &t.vp);
  random_params(&t.c, &t.qp, key + 5);
  random_params(&t.c, &t.kp, key + 6);
  random_params(&t.c, &t.vp, key + 7);
  struct fo_params dqp, dkp, dvp;
  fo_params_alloc(&t.c, &dqp);
  fo_params_alloc(&t.c, &dkp);
  fo_params_alloc(&t.c, &dvp);
  double *o = malloc(sizeof(double) * N), *dq = calloc(N, sizeof(double)),
         *dk = calloc(N, sizeof(double)), *dv = calloc(N, sizeof(double));
  if (linear)
    fo_fma_linear(&t.c, o, dq, dk, dv, &dqp, &dkp, &dvp, t.q, t.k, t.v, &t.qp, &t.kp, &t.vp, t.g);
  else
    fo_fma(&t.c, o, dq, dk, dv, &dkp, &dvp, t.q, t.k, t.v, &t.kp, &t.vp, t.g);
  char what[160];
  snprintf(what, sizeof what, "%s n=%ld m=%d p=%d %s %s multiplicity %s",
           linear ? "fma_linear" : "fma", n, m, p, down_name[down], causal ? "causal" : "bidir",
           mult ? "on" : "off");
  fd_check_tensor(&t, t.q, N, dq, what, "dq");
  fd_check_tensor(&t, t.k, N, dk, what, "dk");
  fd_check_tensor(&t, t.v, N, dv, what, "dv");
  if (linear) fd_check_params(&t, &t.qp, &dqp, what, "dq_down");
  fd_check_params(&t, &t.kp, &dkp, what, "dk_down");
  fd_check_params(&t, &t.vp, &dvp, what, "dv_down");
  fo_params_free(&t.c, &t.qp);
  fo_params_free(&t.c, &t.kp);
  fo_params_free(&t.c, &t.vp);
  fo_params_free(&t.c, &dqp);
  fo_params_free(&t.c, &dkp);
  fo_params_free(&t.c, &dvp);
  free(t.q);
  free(t.k);
  free(t.v);
  free(t.g);
  free(o);
  free(dq);
  free(dk);
  free(dv);
}

/* The summaries alone: J = Σ_l G_l·S_l against the backward, for every scheme and depth. */
static void test_oracle_summary_gradients(void **state) {
  const long sizes[][3] = {{16, 4, 2}, {32, 4, 2}, {64, 4, 4}, {64, 8, 2}};
  for (int down = 0; down < 3; down++)
    for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
      struct fo_cfg c;
      const long n = sizes[s][0], d = 3;
      fo_cfg_init(&c, n, d, (int)sizes[s][1], (int)sizes[s][2], (enum fo_down)down, false, true);
      double *x = malloc(sizeof(double) * n * d), *dx = calloc(n * d, sizeof(double));
      tu_randn_d(x, n * d, 7 + s, 1.0);
      struct fo_params P, dP;
      fo_params_alloc(&c, &P);
      fo_params_alloc(&c, &dP);
      random_params(&c, &P, 11 + s);
      double *S[FO_MAX_LEVELS + 1], *G[FO_MAX_LEVELS + 1];
      fo_summaries_alloc(&c, S);
      fo_summaries_alloc(&c, G);
      for (int l = 1; l <= c.levels; l++) tu_randn_d(G[l], fo_rows(&c, l) * d, 50 + l, 1.0);
      fo_summaries_backward(&c, dx, &dP, G, x, &P);
#define SUMMARY_J(J)                                                                \
  do {                                                                              \
    fo_summaries_forward(&c, S, x, &P);                                             \
    J = 0.0;                                                                        \
    for (int l_ = 1; l_ <= c.levels; l_++)                                          \
      for (long e_ = 0; e_ < fo_rows(&c, l_) * d; e_++) J += G[l_][e_] * S[l_][e_]; \
  } while (0)
      double *f = malloc(sizeof(double) * n * d);
      for (long i = 0; i < n * d; i++) {
        double s0 = x[i], jp, jm;
        x[i] = s0 + 1e-6;
        SUMMARY_J(jp);
        x[i] = s0 - 1e-6;
        SUMMARY_J(jm);
        x[i] = s0;
        f[i] = (jp - jm) / 2e-6;
      }
      char what[128];
      snprintf(what, sizeof what, "summaries %s n=%ld m=%ld p=%ld dx", down_name[down], n,
               sizes[s][1], sizes[s][2]);
      if (c.levels) TU_ASSERT_CLOSE(tu_rel_err_dd(dx, f, n * d), 1e-6, what);
      size_t NP = fo_params_count(&c);
      double *fp = malloc(sizeof(double) * (NP + 1)), *gp = malloc(sizeof(double) * (NP + 1));
      for (size_t i = 0; i < NP; i++) {
        double *e = fo_params_at(&c, &P, i), s0 = *e, jp, jm;
        *e = s0 + 1e-6;
        SUMMARY_J(jp);
        *e = s0 - 1e-6;
        SUMMARY_J(jm);
        *e = s0;
        fp[i] = (jp - jm) / 2e-6;
        gp[i] = *fo_params_at(&c, &dP, i);
      }
#undef SUMMARY_J
      snprintf(what, sizeof what, "summaries %s n=%ld m=%ld p=%ld dparams", down_name[down], n,
               sizes[s][1], sizes[s][2]);
      if (NP) TU_ASSERT_CLOSE(tu_rel_err_dd(gp, fp, NP), 1e-6, what);
      free(fp);
      free(gp);
      free(f);
      free(x);
      free(dx);
      fo_summaries_free(&c, S);
      fo_summaries_free(&c, G);
      fo_params_free(&c, &P);
      fo_params_free(&c, &dP);
    }
}

/* fma's analytic backward, every mode, against central differences (L = 0, 1, 2, 3). */
static void test_oracle_fma_gradients(void **state) {
  const long sizes[][3] = {{8, 4, 2}, {16, 4, 2}, {32, 4, 2}, {64, 8, 4}};
  for (int down = 0; down < 3; down++)
    for (int causal = 0; causal < 2; causal++)
      for (int mult = 0; mult < 2; mult++)
        for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++)
          fd_case_run(sizes[s][0], 3, (int)sizes[s][1], (int)sizes[s][2], (enum fo_down)down,
                      causal, mult, false);
}

static void test_oracle_fma_linear_gradients(void **state) {
  const long sizes[][3] = {{8, 4, 2}, {16, 4, 2}, {32, 4, 2}, {64, 8, 4}};
  for (int down = 0; down < 3; down++)
    for (int causal = 0; causal < 2; causal++)
      for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++)
        fd_case_run(sizes[s][0], 3, (int)sizes[s][1], (int)sizes[s][2], (enum fo_down)down, causal,
                    true, true);
}

/* The summary form with multiplicity on is SPEC's dense n×n equivalent. */
static void test_oracle_dense_equals_summary(void **state) {
  const long sizes[][4] = {{8, 4, 2, 3},   {16, 4, 2, 3},   {32, 4, 2, 3},   {64, 8, 2, 4},
                           {128, 8, 4, 5}, {256, 16, 4, 4}, {128, 16, 16, 3}};
  for (int down = 0; down < 3; down++)
    for (int causal = 0; causal < 2; causal++)
      for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
        const long n = sizes[s][0], d = sizes[s][3];
        struct fo_cfg c;
        fo_cfg_init(&c, n, d, (int)sizes[s][1], (int)sizes[s][2], (enum fo_down)down, causal, true);
        double *q = malloc(sizeof(double) * n * d), *k = malloc(sizeof(double) * n * d),
               *v = malloc(sizeof(double) * n * d), *o1 = malloc(sizeof(double) * n * d),
               *o2 = malloc(sizeof(double) * n * d);
        tu_randn_d(q, n * d, 21 + s, 1.5);
        tu_randn_d(k, n * d, 22 + s, 1.0);
        tu_randn_d(v, n * d, 23 + s, 1.0);
        struct fo_params kp, vp;
        fo_params_alloc(&c, &kp);
        fo_params_alloc(&c, &vp);
        random_params(&c, &kp, 31 + s);
        random_params(&c, &vp, 41 + s);
        fo_fma(&c, o1, NULL, NULL, NULL, NULL, NULL, q, k, v, &kp, &vp, NULL);
        fo_fma_dense(&c, o2, q, k, v, &kp, &vp);
        char what[128];
        snprintf(what, sizeof what, "dense vs summary form, n=%ld %s %s", n, down_name[down],
                 causal ? "causal" : "bidir");
        TU_ASSERT_CLOSE(tu_rel_err_dd(o1, o2, n * d), 1e-12, what);
        fo_params_free(&c, &kp);
        fo_params_free(&c, &vp);
        free(q);
        free(k);
        free(v);
        free(o1);
        free(o2);
      }
}

/* Dense softmax attention of one head in double with its backward (as in test_attention.c): the
 * anchor that fma reaches when every summary is a single token. */
static void dense_attention(double *out, double *dq, double *dk, double *dv, const double *q,
                            const double *k, const double *v, const double *dout, long n, long d,
                            bool causal) {
  double *P = calloc((size_t)(n * n), sizeof(double));
  const double scale = 1.0 / sqrt((double)d);
  for (long i = 0; i < n; i++) {
    double mx = -INFINITY, z = 0.0;
    for (long j = 0; j <= (causal ? i : n - 1); j++) {
      double s = 0.0;
      for (long c = 0; c < d; c++) s += q[i * d + c] * k[j * d + c];
      P[i * n + j] = s * scale;
      if (P[i * n + j] > mx) mx = P[i * n + j];
    }
    for (long j = 0; j <= (causal ? i : n - 1); j++) {
      P[i * n + j] = exp(P[i * n + j] - mx);
      z += P[i * n + j];
    }
    for (long c = 0; c < d; c++) out[i * d + c] = 0.0;
    for (long j = 0; j <= (causal ? i : n - 1); j++) {
      P[i * n + j] /= z;
      for (long c = 0; c < d; c++) out[i * d + c] += P[i * n + j] * v[j * d + c];
    }
  }
  for (long i = 0; dout && i < n; i++) {
    double Di = 0.0;
    for (long c = 0; c < d; c++) Di += dout[i * d + c] * out[i * d + c];
    for (long j = 0; j <= (causal ? i : n - 1); j++) {
      double p = P[i * n + j], dp = 0.0;
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
  free(P);
}

/* n = 4m and p = m: one level whose windows are single-token summaries with multiplicity
 * log(1) = 0, so fma (avg, and conv with the mean init) is exact softmax attention. */
static void test_oracle_full_attention_limit(void **state) {
  const int ms[] = {1, 2, 4, 16};
  for (int causal = 0; causal < 2; causal++)
    for (int down = 0; down < 3; down++)
      for (size_t s = 0; s < sizeof ms / sizeof ms[0]; s++) {
        const int m = ms[s];
        const long n = 4L * m, d = 4, N = n * d;
        struct fo_cfg c;
        fo_cfg_init(&c, n, d, m, m, (enum fo_down)down, causal, true);
        double *q = malloc(8 * N), *k = malloc(8 * N), *v = malloc(8 * N), *g = malloc(8 * N);
        tu_randn_d(q, N, 61, 1.5);
        tu_randn_d(k, N, 62, 1.0);
        tu_randn_d(v, N, 63, 1.0);
        tu_randn_d(g, N, 64, 1.0);
        double *o1 = malloc(8 * N), *dq1 = calloc(N, 8), *dk1 = calloc(N, 8), *dv1 = calloc(N, 8);
        double *o2 = malloc(8 * N), *dq2 = calloc(N, 8), *dk2 = calloc(N, 8), *dv2 = calloc(N, 8);
        struct fo_params kp, vp;
        fo_params_alloc(&c, &kp);
        fo_params_alloc(&c, &vp);
        fo_params_init_mean(&c, &kp);
        fo_params_init_mean(&c, &vp);
        fo_fma(&c, o1, dq1, dk1, dv1, NULL, NULL, q, k, v, &kp, &vp, g);
        dense_attention(o2, dq2, dk2, dv2, q, k, v, g, n, d, causal);
        char what[128];
        snprintf(what, sizeof what, "fma(n=4m, p=m, %s %s) vs full attention", down_name[down],
                 causal ? "causal" : "bidir");
        TU_ASSERT_CLOSE(tu_rel_err_dd(o1, o2, N), 1e-12, what);
        TU_ASSERT_CLOSE(tu_rel_err_dd(dq1, dq2, N), 1e-12, what);
        TU_ASSERT_CLOSE(tu_rel_err_dd(dk1, dk2, N), 1e-12, what);
        TU_ASSERT_CLOSE(tu_rel_err_dd(dv1, dv2, N), 1e-12, what);
        fo_params_free(&c, &kp);
        fo_params_free(&c, &vp);
        free(q), free(k), free(v), free(g);
        free(o1), free(dq1), free(dk1), free(dv1);
        free(o2), free(dq2), free(dk2), free(dv2);
      }
}

/* Summaries of `fo_params_init_mean` equal the fixed avg ones (conv and m2m, every level). */
static void check_summaries_are_avg(const struct fo_cfg *c, const struct fo_params *P,
                                    const double *x, double tol, const char *what) {
  struct fo_cfg ca = *c;
  ca.down = FO_AVG;
  double *S[FO_MAX_LEVELS + 1], *A[FO_MAX_LEVELS + 1];
  fo_summaries_alloc(c, S);
  fo_summaries_alloc(c, A);
  fo_summaries_forward(c, S, x, P);
  fo_summaries_forward(&ca, A, x, NULL);
  for (int l = 1; l <= c->levels; l++) {
    char msg[200];
    snprintf(msg, sizeof msg, "%s: level %d summaries of the mean init vs avg", what, l);
    TU_ASSERT_CLOSE(tu_rel_err_dd(S[l], A[l], fo_rows(c, l) * c->d), tol, msg);
  }
  fo_summaries_free(c, S);
  fo_summaries_free(c, A);
}

static void test_oracle_mean_init_is_avg(void **state) {
  for (int down = 0; down < 2; down++) {
    struct fo_cfg c;
    fo_cfg_init(&c, 256, 3, 8, 4, (enum fo_down)down, false, true);
    double *x = malloc(sizeof(double) * 256 * 3);
    tu_randn_d(x, 256 * 3, 71, 1.0);
    struct fo_params P;
    fo_params_alloc(&c, &P);
    fo_params_init_mean(&c, &P);
    check_summaries_are_avg(&c, &P, x, 1e-14, down_name[down]);
    fo_params_free(&c, &P);
    free(x);
  }
}

/* ================================================================================================
 * The production variants through their ops table
 * ============================================================================================== */

static const struct attn_variant *need_variant(const char *name) {
  const struct attn_variant *v = attention_find(name);
  if (!v)
    fail_msg(
        "attention variant \"%s\" is not registered: attention_find(\"%s\") returned NULL, so "
        "the production %s cannot be tested",
        name, name, name);
  return v;
}

enum init_mode { INIT_MODE_MEAN, INIT_MODE_RANDOM, INIT_MODE_PERTURBED };
static const char *const init_mode_name[] = {"mean", "random", "mean+perturbed"};

struct fma_case {
  bool linear;
  long B, H, n, d;
  int m, p;
  enum fo_down down;
  bool causal, mult;
  enum init_mode init;
};

/* A case, by every field in order (linear, B, H, n, d, m, p, down, causal, mult, init). */
static struct fma_case fma_case_make(bool linear, long B, long H, long n, long d, int m, int p,
                                     enum fo_down down, bool causal, bool mult,
                                     enum init_mode init) {
  return (struct fma_case){linear, B, H, n, d, m, p, down, causal, mult, init};
}

static void case_text(const struct fma_case *t, char *buf, size_t len) {
  snprintf(buf, len, "%s n=%ld m=%d p=%d d=%ld %s %s multiplicity=%s init=%s",
           t->linear ? "fma_linear" : "fma", t->n, t->m, t->p, t->d, down_name[t->down],
           t->causal ? "causal" : "bidir", t->mult ? "on" : "off", init_mode_name[t->init]);
}

static void make_config(struct config *cfg, const struct fma_case *t) {
  char items[12][96];
  struct config_overrides ov = {0};
  snprintf(items[0], 96, "attention.variant=%s", t->linear ? "fma_linear" : "fma");
  snprintf(items[1], 96, "model.context=%ld", t->n);
  snprintf(items[2], 96, "model.heads=%ld", t->H);
  snprintf(items[3], 96, "model.dim=%ld", t->H * t->d);
  snprintf(items[4], 96, "model.objective=%s", t->causal ? "clm" : "mlm");
  snprintf(items[5], 96, "data.source=copy");
  snprintf(items[6], 96, "model.position=none");
  snprintf(items[7], 96, "attention.fma.m=%d", t->m);
  snprintf(items[8], 96, "attention.fma.p=%d", t->p);
  snprintf(items[9], 96, "attention.fma.downsample=%s", down_name[t->down]);
  snprintf(items[10], 96, "attention.fma.init=%s", t->init == INIT_MODE_RANDOM ? "random" : "mean");
  snprintf(items[11], 96, "attention.fma.multiplicity=%s", t->mult ? "true" : "false");
  for (int i = 0; i < 12; i++) ov.items[ov.count++] = items[i];
  char err[CONFIG_ERR_LEN];
  if (config_load(cfg, NULL, &ov, err, sizeof err)) fail_msg("config: %s", err);
  if (attention_check(cfg, t->n, 1, err, sizeof err))
    fail_msg("attention_check refuses a valid fma configuration: %s", err);
}

/* The production parameters of one layer, and where each SPEC tensor lives in them. */
struct prod {
  const struct attn_variant *var;
  bool linear; /* q_down exists */
  struct config cfg;
  struct fo_cfg fc;
  struct param_list list;
  float *params, *dparams;          /* list.total floats each */
  int idx[3][FO_MAX_LEVELS + 1][2]; /* [q_down, k_down, v_down][level][weight, bias] → list index */
};

static const char *const op_name[3] = {"q_down", "k_down", "v_down"};

static void prod_setup(struct prod *pr, const struct fma_case *t) {
  memset(pr, 0, sizeof *pr);
  pr->var = need_variant(t->linear ? "fma_linear" : "fma");
  pr->linear = t->linear;
  make_config(&pr->cfg, t);
  fo_cfg_init(&pr->fc, t->n, t->d, t->m, t->p, t->down, t->causal, t->mult);
  param_list_init(&pr->list);
  attention_register_params(&pr->cfg, pr->var, t->n, 0, &pr->list);
  pr->params = calloc(pr->list.total + 1, sizeof(float));
  pr->dparams = calloc(pr->list.total + 1, sizeof(float));
  int expected = 0;
  for (int op = t->linear ? 0 : 1; op < 3; op++)
    for (int l = 1; l <= pr->fc.levels; l++)
      for (int wb = 0; wb < 2; wb++) {
        pr->idx[op][l][wb] = -1;
        if (t->down == FO_AVG) continue;
        char name[PARAM_NAME];
        snprintf(name, sizeof name, "layer_000/attn/%s/%s/level_%02d/%s", pr->var->name,
                 op_name[op], l, wb ? "bias" : "weight");
        int i = param_list_find(&pr->list, name);
        if (i < 0) fail_msg("%s is not registered (SPEC §6.4 storage)", name);
        const struct param_desc *pd = &pr->list.p[i];
        long want[3] = {t->d, t->p, fo_weight_taps(&pr->fc, l)};
        int ndim = wb ? 2 : 3;
        bool ok = pd->ndim == ndim;
        for (int a = 0; ok && a < ndim; a++) ok = pd->shape[a] == want[a];
        if (!ok) {
          char got[64], spec[64];
          param_shape_text(pd, got, sizeof got);
          if (wb)
            snprintf(spec, sizeof spec, "[%ld, %ld]", want[0], want[1]);
          else
            snprintf(spec, sizeof spec, "[%ld, %ld, %ld]", want[0], want[1], want[2]);
          fail_msg("%s has shape %s; SPEC §6.4 says %s", name, got, spec);
        }
        pr->idx[op][l][wb] = i;
        expected++;
      }
  if (pr->list.count != expected)
    fail_msg("%s registers %d parameter tensors; SPEC §6.4 names %d", pr->var->name, pr->list.count,
             expected);
  for (int i = 0; i < pr->list.count; i++) {
    const struct param_desc *pd = &pr->list.p[i];
    float *x = pr->params + pd->offset;
    attention_init_param(&pr->cfg, pr->var, pd, x);
    if (t->init == INIT_MODE_PERTURBED) {
      /* away from the init: weight += N(0, (0.5/√taps)²), bias += N(0, 0.3²) */
      double sd = pd->ndim == 3 ? 0.5 / sqrt((double)pd->shape[2]) : 0.3;
      for (size_t e = 0; e < pd->numel; e++)
        x[e] += (float)(sd * rng_normal(99, RNG_TEST, 7000 + (uint64_t)i, e, 1));
    }
  }
}

static void prod_free(struct prod *pr) {
  free(pr->params);
  free(pr->dparams);
  param_list_free(&pr->list);
  config_free(&pr->cfg);
}

/* The oracle's view of one summary operator's production parameters (doubles, copied); zeros for
 * q_down of fma, which has none. */
static void prod_to_oracle(const struct prod *pr, int op, struct fo_params *P) {
  fo_params_alloc(&pr->fc, P);
  if (pr->fc.down == FO_AVG || (op == 0 && !pr->linear)) return;
  for (int l = 1; l <= pr->fc.levels; l++) {
    const struct param_desc *w = &pr->list.p[pr->idx[op][l][0]],
                            *b = &pr->list.p[pr->idx[op][l][1]];
    for (size_t e = 0; e < w->numel; e++) P->weight[l][e] = pr->params[w->offset + e];
    for (size_t e = 0; e < b->numel; e++) P->bias[l][e] = pr->params[b->offset + e];
  }
}

struct run_out {
  float *out, *dq, *dk, *dv;
};

static void free_run(struct run_out *r) {
  free(r->out);
  free(r->dq);
  free(r->dk);
  free(r->dv);
}

/* Forward (and backward when dout is given) of the production variant, exactly as the model
 * calls it; dparams is zeroed first since backward accumulates. */
static struct run_out prod_run(struct prod *pr, const struct fma_case *t, const float *q,
                               const float *k, const float *v, const float *dout) {
  const struct attn_variant *var = pr->var;
  struct attn_ctx ctx = {.cfg = &pr->cfg, .variant = var, .comm = NULL, .layer = 0};
  ctx.dims = (struct attn_dims){t->B, t->H, t->n, t->d, t->n, 0, t->causal};
  ctx.state = var->setup ? var->setup(&pr->cfg, &ctx.dims) : NULL;
  size_t count = (size_t)(t->B * t->H * t->n * t->d);
  struct run_out r = {calloc(count, 4), calloc(count, 4), calloc(count, 4), calloc(count, 4)};
  float *saved = calloc(var->saved_floats(&ctx) + 1, sizeof(float));
  var->forward(&ctx, r.out, saved, q, k, v, pr->params);
  if (dout) {
    memset(pr->dparams, 0, sizeof(float) * (pr->list.total + 1));
    var->backward(&ctx, r.dq, r.dk, r.dv, pr->dparams, dout, q, k, v, pr->params, r.out, saved);
  }
  if (var->teardown) var->teardown(ctx.state);
  free(saved);
  return r;
}

static int failures_shown;
static double worst_err; /* over the cases of one matrix test, reported with the case */
static char worst_what[300];

/* One case of the matrix: production vs oracle, every tensor within tol. Returns false (and
 * prints what differs) on a mismatch, so one run reports every failing case. */
static bool check_case(const struct fma_case *t, double tol) {
  char what[200];
  case_text(t, what, sizeof what);
  struct prod pr;
  prod_setup(&pr, t);
  const long nd = t->n * t->d, count = t->B * t->H * nd;
  uint64_t key = (uint64_t)(t->n * 7 + t->m * 131 + t->p * 1009 + t->down * 17 + t->causal * 3 +
                            t->mult * 5 + t->init * 11 + t->linear * 13);
  float *q = malloc(4 * count), *k = malloc(4 * count), *v = malloc(4 * count),
        *g = malloc(4 * count);
  tu_randn(q, count, key * 4 + 0, 1.0f);
  tu_randn(k, count, key * 4 + 1, 1.0f);
  tu_randn(v, count, key * 4 + 2, 1.0f);
  tu_randn(g, count, key * 4 + 3, 1.0f);
  struct run_out r = prod_run(&pr, t, q, k, v, g);

  double *o = malloc(8 * count), *dq = calloc(count, 8), *dk = calloc(count, 8),
         *dv = calloc(count, 8);
  struct fo_params P[3], dP[3];
  for (int op = 0; op < 3; op++) {
    prod_to_oracle(&pr, op, &P[op]);
    fo_params_alloc(&pr.fc, &dP[op]);
  }
  for (long bh = 0; bh < t->B * t->H; bh++) {
    size_t off = (size_t)(bh * nd);
    double *qd = tu_to_double(q + off, nd), *kd = tu_to_double(k + off, nd),
           *vd = tu_to_double(v + off, nd), *gd = tu_to_double(g + off, nd);
    if (t->linear)
      fo_fma_linear(&pr.fc, o + off, dq + off, dk + off, dv + off, &dP[0], &dP[1], &dP[2], qd, kd,
                    vd, &P[0], &P[1], &P[2], gd);
    else
      fo_fma(&pr.fc, o + off, dq + off, dk + off, dv + off, &dP[1], &dP[2], qd, kd, vd, &P[1],
             &P[2], gd);
    free(qd), free(kd), free(vd), free(gd);
  }
  bool ok = true;
  char bad[1024] = "";
#define CHECK_TENSOR(name, a, b, len)                                                 \
  do {                                                                                \
    double e_ = tu_rel_err((a), (b), (len));                                          \
    if (e_ > worst_err) {                                                             \
      worst_err = e_;                                                                 \
      snprintf(worst_what, sizeof worst_what, "%s in %s", (name), what);              \
    }                                                                                 \
    if (!(e_ <= tol)) {                                                               \
      ok = false;                                                                     \
      snprintf(bad + strlen(bad), sizeof bad - strlen(bad), " %s %.2e;", (name), e_); \
    }                                                                                 \
  } while (0)
  CHECK_TENSOR("out", r.out, o, count);
  CHECK_TENSOR("dq", r.dq, dq, count);
  CHECK_TENSOR("dk", r.dk, dk, count);
  CHECK_TENSOR("dv", r.dv, dv, count);
  for (int op = t->linear ? 0 : 1; op < 3 && t->down != FO_AVG; op++)
    for (int l = 1; l <= pr.fc.levels; l++) {
      const struct param_desc *w = &pr.list.p[pr.idx[op][l][0]];
      const struct param_desc *b = &pr.list.p[pr.idx[op][l][1]];
      char name[64];
      snprintf(name, sizeof name, "d%s/level_%02d/weight", op_name[op], l);
      CHECK_TENSOR(name, pr.dparams + w->offset, dP[op].weight[l], w->numel);
      snprintf(name, sizeof name, "d%s/level_%02d/bias", op_name[op], l);
      CHECK_TENSOR(name, pr.dparams + b->offset, dP[op].bias[l], b->numel);
    }
#undef CHECK_TENSOR
  if (!ok && failures_shown++ < 40) print_message("# MISMATCH %s:%s\n", what, bad);
  for (int op = 0; op < 3; op++) {
    fo_params_free(&pr.fc, &P[op]);
    fo_params_free(&pr.fc, &dP[op]);
  }
  free_run(&r);
  free(q), free(k), free(v), free(g);
  free(o), free(dq), free(dk), free(dv);
  prod_free(&pr);
  return ok;
}

/* Every downsample × causal × multiplicity × init on small trees (L = 0, 1, 3, and p = m). */
static void matrix_small(bool linear) {
  const int sizes[][3] = {{16, 8, 2}, {32, 8, 2}, {128, 8, 2}, {256, 16, 4}, {64, 16, 16}};
  int cases = 0, failed = 0;
  failures_shown = 0;
  worst_err = 0.0;
  need_variant(linear ? "fma_linear" : "fma");
  for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++)
    for (int down = 0; down < 3; down++)
      for (int causal = 0; causal < 2; causal++)
        for (int mult = 0; mult < 2; mult++)
          for (int init = 0; init < 3; init++) {
            if (down == FO_AVG && init) continue; /* avg has no parameters */
            struct fma_case t =
                fma_case_make(linear, 2, 2, sizes[s][0], 8, sizes[s][1], sizes[s][2],
                              (enum fo_down)down, causal, mult, (enum init_mode)init);
            cases++;
            if (!check_case(&t, 1e-4)) failed++;
          }
  print_message("# %s: %d cases, worst relative error %.2e (%s)\n", linear ? "fma_linear" : "fma",
                cases, worst_err, worst_what);
  if (failed)
    fail_msg("%s: %d of %d cases differ from the oracle by more than 1e-4 (listed above)",
             linear ? "fma_linear" : "fma", failed, cases);
}

/* Deep trees up to n = 2048 with several (m, p), perturbed parameters; multiplicity both ways. */
static void matrix_large(bool linear) {
  const int sizes[][4] = {{1024, 8, 2, 8},   {2048, 16, 4, 16}, {512, 16, 16, 8},
                          {1024, 32, 4, 16}, {2048, 64, 4, 8},  {256, 64, 4, 16}};
  int cases = 0, failed = 0;
  failures_shown = 0;
  worst_err = 0.0;
  need_variant(linear ? "fma_linear" : "fma");
  for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++)
    for (int down = 0; down < 3; down++)
      for (int causal = 0; causal < 2; causal++)
        for (int mult = 0; mult < 2; mult++) {
          if (linear && !mult) continue; /* it cancels inside a level; matrix_small shows it */
          if (!mult && s % 2) continue;
          struct fma_case t = fma_case_make(linear, 2, 2, sizes[s][0], sizes[s][3], sizes[s][1],
                                            sizes[s][2], (enum fo_down)down, causal, mult,
                                            down == FO_AVG ? INIT_MODE_MEAN : INIT_MODE_PERTURBED);
          cases++;
          if (!check_case(&t, 1e-4)) failed++;
        }
  print_message("# %s: %d large cases, worst relative error %.2e (%s)\n",
                linear ? "fma_linear" : "fma", cases, worst_err, worst_what);
  if (failed)
    fail_msg("%s: %d of %d large cases differ from the oracle by more than 1e-4 (listed above)",
             linear ? "fma_linear" : "fma", failed, cases);
}

static void test_fma_matches_oracle(void **state) { matrix_small(false); }
static void test_fma_matches_oracle_large(void **state) { matrix_large(false); }
static void test_fma_linear_matches_oracle(void **state) { matrix_small(true); }
static void test_fma_linear_matches_oracle_large(void **state) { matrix_large(true); }

/* SPEC §6.4 init: `mean` makes every learned summary the avg one (bias 0); `random` draws
 * uniform in ±1/√fan_in (fan_in: the taps of the weight's last axis). */
static void test_fma_init(void **state) {
  for (int linear = 0; linear < 2; linear++)
    for (int down = 0; down < 2; down++)
      for (int init = 0; init < 2; init++) {
        struct fma_case t = fma_case_make(linear, 1, 1, 512, 3, 8, 4, (enum fo_down)down, false,
                                          true, (enum init_mode)init);
        char what[200];
        case_text(&t, what, sizeof what);
        struct prod pr;
        prod_setup(&pr, &t);
        double *x = malloc(sizeof(double) * t.n * t.d);
        tu_randn_d(x, t.n * t.d, 81, 1.0);
        for (int op = linear ? 0 : 1; op < 3; op++) {
          struct fo_params P;
          prod_to_oracle(&pr, op, &P);
          if (init == INIT_MODE_MEAN) {
            check_summaries_are_avg(&pr.fc, &P, x, 1e-6, what);
            for (int l = 1; l <= pr.fc.levels; l++)
              for (long e = 0; e < fo_bias_len(&pr.fc, l); e++)
                if (P.bias[l][e] != 0.0) fail_msg("%s: %s bias not 0", what, op_name[op]);
          } else {
            for (int l = 1; l <= pr.fc.levels; l++) {
              double bound = 1.0 / sqrt((double)fo_weight_taps(&pr.fc, l)), mx = 0.0;
              for (long e = 0; e < fo_weight_len(&pr.fc, l); e++) {
                double a = fabs(P.weight[l][e]);
                if (a > bound * (1 + 1e-6))
                  fail_msg("%s: %s level %d weight %g outside ±1/√fan_in = %g", what, op_name[op],
                           l, P.weight[l][e], bound);
                if (a > mx) mx = a;
              }
              if (mx < 0.5 * bound)
                fail_msg("%s: %s level %d weights span only ±%g of ±%g: not uniform ±1/√fan_in",
                         what, op_name[op], l, mx, bound);
              for (long e = 0; e < fo_bias_len(&pr.fc, l); e++)
                if (fabs(P.bias[l][e]) > bound * (1 + 1e-6))
                  fail_msg("%s: %s level %d bias outside ±1/√fan_in", what, op_name[op], l);
            }
          }
          fo_params_free(&pr.fc, &P);
        }
        free(x);
        prod_free(&pr);
      }
}

/* The unit-charge run: with v ≡ 1 and avg summaries every V_l row is 1, so every fma output is 1
 * (multiplicity on or off); fma_linear's is 1 + the number of levels whose list is non-empty. */
static void test_fma_unit_values(void **state) {
  const int sizes[][3] = {{16, 8, 2}, {64, 8, 4}, {1024, 16, 4}, {512, 8, 8}};
  for (int linear = 0; linear < 2; linear++)
    for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++)
      for (int causal = 0; causal < 2; causal++)
        for (int mult = 0; mult < 2; mult++) {
          struct fma_case t = fma_case_make(linear, 2, 2, sizes[s][0], 8, sizes[s][1], sizes[s][2],
                                            FO_AVG, causal, mult, INIT_MODE_MEAN);
          char what[200];
          case_text(&t, what, sizeof what);
          struct prod pr;
          prod_setup(&pr, &t);
          const long count = t.B * t.H * t.n * t.d;
          float *q = malloc(4 * count), *k = malloc(4 * count), *v = malloc(4 * count);
          tu_randn(q, count, 91 + s, 2.0f);
          tu_randn(k, count, 92 + s, 2.0f);
          for (long e = 0; e < count; e++) v[e] = 1.0f;
          struct run_out r = prod_run(&pr, &t, q, k, v, NULL);
          for (long bh = 0; bh < t.B * t.H; bh++)
            for (long i = 0; i < t.n; i++) {
              double want = 1.0;
              if (linear)
                for (int l = 1; l <= pr.fc.levels; l++) {
                  long wins[FO_LIST_MAX];
                  if (fo_level(&pr.fc, l, i / pr.fc.w[l], wins) > 0) want += 1.0;
                }
              for (long f = 0; f < t.d; f++) {
                float got = r.out[(bh * t.n + i) * t.d + f];
                if (!(fabs(got - want) <= 1e-5 * want))
                  fail_msg("%s: v = 1 gives output %.8g at token %ld, expected %g", what, got, i,
                           want);
              }
            }
          free_run(&r);
          free(q), free(k), free(v);
          prod_free(&pr);
        }
}

/* Causality by perturbation: change q (and unless only_q, k and v) at position j; outputs at i < j
 * must not change at all, outputs at j must. Returns the number of failed probes, each printed.
 * With only_q (fma_linear) the oracle is run on the same probe twice: with the SPEC's shifted
 * query summary ρ_l(i) − 1 and with the unshifted ρ_l(i), to show the probe does see a summary
 * that mixes in a later query (the unshifted oracle must leak). */
static int causality_probe(bool linear, enum fo_down down, enum init_mode init, bool only_q) {
  struct fma_case t = fma_case_make(linear, 1, 2, 128, 8, 8, 2, down, true, true, init);
  char what[200];
  case_text(&t, what, sizeof what);
  struct prod pr;
  prod_setup(&pr, &t);
  const long count = t.B * t.H * t.n * t.d;
  float *q = malloc(4 * count), *k = malloc(4 * count), *v = malloc(4 * count);
  tu_randn(q, count, 101, 1.0f);
  tu_randn(k, count, 102, 1.0f);
  tu_randn(v, count, 103, 1.0f);
  struct run_out base = prod_run(&pr, &t, q, k, v, NULL);
  /* block and sub-segment boundaries, mid-segment positions (37: i = 36 shares its level-1
   * sub-segment and sees level 1), the last token */
  const long probes[] = {0, 7, 8, 37, 64, 70, 101, 127};
  struct fo_params P[3];
  for (int op = 0; op < 3; op++) prod_to_oracle(&pr, op, &P[op]);
  int failed = 0;
  for (size_t pi = 0; pi < sizeof probes / sizeof probes[0]; pi++) {
    long j = probes[pi];
    if (only_q && j == 0) continue; /* out_0 = v_0 whatever q_0 is */
    float *q2 = malloc(4 * count), *k2 = malloc(4 * count), *v2 = malloc(4 * count);
    memcpy(q2, q, 4 * count);
    memcpy(k2, k, 4 * count);
    memcpy(v2, v, 4 * count);
    for (long h = 0; h < t.H; h++)
      for (long f = 0; f < t.d; f++) {
        size_t at = (size_t)((h * t.n + j) * t.d + f);
        q2[at] += 3.0f;
        if (!only_q) {
          k2[at] -= 2.0f;
          v2[at] += 5.0f;
        }
      }
    struct run_out r = prod_run(&pr, &t, q2, k2, v2, NULL);
    long first_leak = -1;
    bool changed_at_j = false;
    for (long h = 0; h < t.H; h++)
      for (long i = 0; i <= j; i++)
        for (long f = 0; f < t.d; f++) {
          size_t at = (size_t)((h * t.n + i) * t.d + f);
          if (i < j && r.out[at] != base.out[at] && first_leak < 0) first_leak = i;
          if (i == j && r.out[at] != base.out[at]) changed_at_j = true;
        }
    if (first_leak >= 0) {
      print_message("# CAUSALITY %s: output %ld changed when %s at position %ld changed\n", what,
                    first_leak, only_q ? "q" : "q, k, v", j);
      failed++;
    }
    if (!changed_at_j) {
      print_message("# %s: changing position %ld did not change output %ld\n", what, j, j);
      failed++;
    }
    if (only_q && j == 37) {
      struct fo_cfg fc = pr.fc;
      double *qa = tu_to_double(q, t.n * t.d), *qb = tu_to_double(q2, t.n * t.d);
      double *kd = tu_to_double(k, t.n * t.d), *vd = tu_to_double(v, t.n * t.d);
      double *oa = malloc(8 * t.n * t.d), *ob = malloc(8 * t.n * t.d);
      for (int unshifted = 0; unshifted < 2; unshifted++) {
        fc.unshifted = unshifted;
        fo_fma_linear(&fc, oa, NULL, NULL, NULL, NULL, NULL, NULL, qa, kd, vd, &P[0], &P[1], &P[2],
                      NULL);
        fo_fma_linear(&fc, ob, NULL, NULL, NULL, NULL, NULL, NULL, qb, kd, vd, &P[0], &P[1], &P[2],
                      NULL);
        bool leaked = false;
        for (long e = 0; e < j * t.d; e++) leaked |= oa[e] != ob[e];
        if (unshifted && !leaked) {
          print_message("# %s: the unshifted oracle did not leak at j = 37: the probe is blind\n",
                        what);
          failed++;
        }
        if (!unshifted && leaked) {
          print_message(
              "# CAUSALITY %s: the SPEC §6.5 oracle itself (query row ρ_l(i) − 1) leaks "
              "q_37 into an earlier output: a learned summary row spans its whole "
              "window, not only its sub-segment\n",
              what);
          failed++;
        }
      }
      free(qa), free(qb), free(kd), free(vd), free(oa), free(ob);
    }
    free_run(&r);
    free(q2), free(k2), free(v2);
  }
  for (int op = 0; op < 3; op++) fo_params_free(&pr.fc, &P[op]);
  free_run(&base);
  free(q), free(k), free(v);
  prod_free(&pr);
  return failed;
}

/* avg, and conv/m2m both at the mean init and with parameters away from it (as after training). */
static void causality_all(bool linear, bool only_q) {
  int failed = 0;
  need_variant(linear ? "fma_linear" : "fma");
  for (int down = 0; down < 3; down++)
    for (int init = 0; init < 3; init += 2) {
      if (down == FO_AVG && init) continue;
      failed += causality_probe(linear, (enum fo_down)down, (enum init_mode)init, only_q);
    }
  if (failed)
    fail_msg("%s causal: %d probes broke causality (listed above)", linear ? "fma_linear" : "fma",
             failed);
}

static void test_fma_causality(void **state) { causality_all(false, false); }
static void test_fma_linear_causality(void **state) { causality_all(true, false); }

/* fma_linear causal summarises the sub-segment BEFORE i's: a change of q alone at j never reaches
 * an output before j (a summary of i's own sub-segment would mix in q_j for j > i). */
static void test_fma_linear_shifted_query(void **state) { causality_all(true, true); }

/* The float kernel's backward against central differences of the float forward itself, on tiny
 * trees (n = 4m and 8m, m = 4), loose tolerance: an oracle-free sanity check. */
static double float_objective(struct prod *pr, struct attn_ctx *ctx, float *out, float *saved,
                              const float *q, const float *k, const float *v, const float *g,
                              long count) {
  pr->var->forward(ctx, out, saved, q, k, v, pr->params);
  double J = 0.0;
  for (long e = 0; e < count; e++) J += (double)g[e] * out[e];
  return J;
}

static void float_fd_case(bool linear, enum fo_down down, bool causal, long n) {
  struct fma_case t = fma_case_make(linear, 1, 2, n, 4, 4, 2, down, causal, true,
                                    down == FO_AVG ? INIT_MODE_MEAN : INIT_MODE_PERTURBED);
  char what[200];
  case_text(&t, what, sizeof what);
  struct prod pr;
  prod_setup(&pr, &t);
  const long count = t.B * t.H * t.n * t.d;
  float *q = malloc(4 * count), *k = malloc(4 * count), *v = malloc(4 * count),
        *g = malloc(4 * count);
  tu_randn(q, count, 111, 1.0f);
  tu_randn(k, count, 112, 1.0f);
  tu_randn(v, count, 113, 1.0f);
  tu_randn(g, count, 114, 1.0f);
  struct run_out r = prod_run(&pr, &t, q, k, v, g);
  struct attn_ctx ctx = {.cfg = &pr.cfg, .variant = pr.var, .comm = NULL, .layer = 0};
  ctx.dims = (struct attn_dims){t.B, t.H, t.n, t.d, t.n, 0, t.causal};
  ctx.state = pr.var->setup ? pr.var->setup(&pr.cfg, &ctx.dims) : NULL;
  float *out = calloc(count, 4), *saved = calloc(pr.var->saved_floats(&ctx) + 1, 4);
  const float h = 1e-2f;
  float *xs[4] = {q, k, v, pr.params};
  const float *grads[4] = {r.dq, r.dk, r.dv, pr.dparams};
  const char *names[4] = {"dq", "dk", "dv", "dparams"};
  for (int x = 0; x < 4; x++) {
    long len = x < 3 ? count : (long)pr.list.total;
    if (len == 0) continue;
    double *fd = malloc(8 * len);
    for (long e = 0; e < len; e++) {
      float s0 = xs[x][e];
      xs[x][e] = s0 + h;
      double jp = float_objective(&pr, &ctx, out, saved, q, k, v, g, count);
      xs[x][e] = s0 - h;
      double jm = float_objective(&pr, &ctx, out, saved, q, k, v, g, count);
      xs[x][e] = s0;
      fd[e] = (jp - jm) / (2.0 * h);
    }
    char msg[256];
    snprintf(msg, sizeof msg, "%s: float %s vs float central differences", what, names[x]);
    TU_ASSERT_CLOSE(tu_rel_err(grads[x], fd, len), 1e-2, msg);
    free(fd);
  }
  if (pr.var->teardown) pr.var->teardown(ctx.state);
  free(out), free(saved);
  free_run(&r);
  free(q), free(k), free(v), free(g);
  prod_free(&pr);
}

static void test_fma_float_gradients(void **state) {
  for (int linear = 0; linear < 2; linear++)
    for (int down = 0; down < 3; down++)
      for (int causal = 0; causal < 2; causal++)
        for (long n = 16; n <= 32; n *= 2) float_fd_case(linear, (enum fo_down)down, causal, n);
}

/* Backward accumulates (SPEC §1): a second backward into the same buffers doubles dq, dk, dv and
 * every dparam. */
static void test_fma_backward_accumulates(void **state) {
  for (int linear = 0; linear < 2; linear++)
    for (int down = 0; down < 3; down++) {
      struct fma_case t = fma_case_make(linear, 2, 2, 64, 4, 8, 2, (enum fo_down)down, true, true,
                                        down == FO_AVG ? INIT_MODE_MEAN : INIT_MODE_PERTURBED);
      char what[200];
      case_text(&t, what, sizeof what);
      struct prod pr;
      prod_setup(&pr, &t);
      const long count = t.B * t.H * t.n * t.d;
      float *q = malloc(4 * count), *k = malloc(4 * count), *v = malloc(4 * count),
            *g = malloc(4 * count);
      tu_randn(q, count, 121, 1.0f);
      tu_randn(k, count, 122, 1.0f);
      tu_randn(v, count, 123, 1.0f);
      tu_randn(g, count, 124, 1.0f);
      struct run_out r = prod_run(&pr, &t, q, k, v, g); /* once, from zero */
      const long np = (long)pr.list.total;
      double *once[4] = {tu_to_double(r.dq, count), tu_to_double(r.dk, count),
                         tu_to_double(r.dv, count), tu_to_double(pr.dparams, np)};
      struct attn_ctx ctx = {.cfg = &pr.cfg, .variant = pr.var, .comm = NULL, .layer = 0};
      ctx.dims = (struct attn_dims){t.B, t.H, t.n, t.d, t.n, 0, t.causal};
      ctx.state = pr.var->setup ? pr.var->setup(&pr.cfg, &ctx.dims) : NULL;
      float *out = calloc(count, 4), *saved = calloc(pr.var->saved_floats(&ctx) + 1, 4);
      pr.var->forward(&ctx, out, saved, q, k, v, pr.params);
      pr.var->backward(&ctx, r.dq, r.dk, r.dv, pr.dparams, g, q, k, v, pr.params, out, saved);
      const float *twice[4] = {r.dq, r.dk, r.dv, pr.dparams};
      const long len[4] = {count, count, count, np};
      const char *names[4] = {"dq", "dk", "dv", "dparams"};
      for (int x = 0; x < 4; x++) {
        for (long e = 0; e < len[x]; e++) once[x][e] *= 2.0;
        char msg[256];
        snprintf(msg, sizeof msg, "%s: %s after two backwards vs twice one", what, names[x]);
        if (len[x]) TU_ASSERT_CLOSE(tu_rel_err(twice[x], once[x], len[x]), 1e-6, msg);
        free(once[x]);
      }
      if (pr.var->teardown) pr.var->teardown(ctx.state);
      free(out), free(saved);
      free_run(&r);
      free(q), free(k), free(v), free(g);
      prod_free(&pr);
    }
}

static const struct CMUnitTest tests[] = {
    cmocka_unit_test(test_lists_match_spec),
    cmocka_unit_test(test_lists_cover_exactly_once),
    cmocka_unit_test(test_oracle_summary_gradients),
    cmocka_unit_test(test_oracle_fma_gradients),
    cmocka_unit_test(test_oracle_fma_linear_gradients),
    cmocka_unit_test(test_oracle_dense_equals_summary),
    cmocka_unit_test(test_oracle_full_attention_limit),
    cmocka_unit_test(test_oracle_mean_init_is_avg),
    cmocka_unit_test(test_fma_init),
    cmocka_unit_test(test_fma_matches_oracle),
    cmocka_unit_test(test_fma_matches_oracle_large),
    cmocka_unit_test(test_fma_linear_matches_oracle),
    cmocka_unit_test(test_fma_linear_matches_oracle_large),
    cmocka_unit_test(test_fma_unit_values),
    cmocka_unit_test(test_fma_causality),
    cmocka_unit_test(test_fma_linear_causality),
    cmocka_unit_test(test_fma_linear_shifted_query),
    cmocka_unit_test(test_fma_float_gradients),
    cmocka_unit_test(test_fma_backward_accumulates),
};

TU_MAIN(tests)
