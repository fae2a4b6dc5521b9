/* The first rungs of the FMA test ladder (STYLE rule 10): the interaction lists (what SPEC §6.4
 * says, and every allowed pair covered exactly once), then the double-precision oracle of
 * fma_oracle.c against itself — central finite differences of every gradient, the dense n×n form
 * equal to the summary form, the full-attention limit, the mean init equal to avg. test_fma.c
 * then holds the production variants to this oracle. */
#include "testutil.h"

#include "../src/attention/attention.h"
#include "../src/config.h"
#include "../src/fma/lists.h"
#include "../src/fma/tree.h"
#include "../src/params.h"
#include "fma_cases.h"
#include "fma_oracle.h"

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

/* n = 4m and p = m: one level whose windows are single-token summaries with multiplicity
 * log(1) = 0, so fma (avg, and conv with the mean init) is exact softmax attention: the shared
 * dense reference (testutil.c), the anchor of the ladder. */
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
        const struct tu_mask mask = {causal, 0};
        tu_dense_attention(o2, dq2, dk2, dv2, q, k, v, g, n, d, tu_mask_allowed, &mask);
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

static const struct CMUnitTest tests[] = {
    cmocka_unit_test(test_lists_match_spec),
    cmocka_unit_test(test_lists_cover_exactly_once),
    cmocka_unit_test(test_oracle_summary_gradients),
    cmocka_unit_test(test_oracle_fma_gradients),
    cmocka_unit_test(test_oracle_fma_linear_gradients),
    cmocka_unit_test(test_oracle_dense_equals_summary),
    cmocka_unit_test(test_oracle_full_attention_limit),
    cmocka_unit_test(test_oracle_mean_init_is_avg),
};

TU_MAIN(tests)
