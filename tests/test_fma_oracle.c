/* The first rungs of the FMA test ladder (STYLE rule 10): the interaction lists (what SPEC §6.4
 * says, and every allowed pair covered exactly once), then the double-precision oracle of
 * fma_oracle.c against itself — central finite differences of every gradient, the dense n×n form
 * equal to the summary form, the full-attention limit, the mean init equal to avg — and its
 * content-based opening (SPEC §6.4a `fma.open`): the choice, coverage, exactness with `all`,
 * causality, gradients. test_fma.c then holds the production variants to this oracle. */
#include "testutil.h"

#include "../src/attention/attention.h"
#include "../src/deck/config.h"
#include "../src/fma/lists.h"
#include "../src/fma/tree.h"
#include "../src/nn/params.h"
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
            for (int e = 0; e < nx; e++) {
              assert_int_equal(x[e], y[e]);
              if (labs(x[e] - cw) > FMA_LIST_REACH) /* what the LET plan's search relies on */
                fail_msg("level %d window %ld lists %ld: beyond FMA_LIST_REACH", l, cw, x[e]);
            }
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
  /* fma.open only: the opening decisions at the unperturbed inputs (open_decisions), and whether
   * an evaluation since `flipped` was last cleared saw different ones (a near tie crossed) */
  unsigned char *dec;
  bool flipped;
  long skipped; /* finite differences left out because the choice flipped */
};

static size_t open_flag_count(const struct fo_cfg *c);
static void open_decisions(const struct fo_cfg *c, unsigned char *flags, const double *q,
                           const double *k, const struct fo_params *kp);

/* Random inputs for t->c (set first): q, k, v, g ~ N(0, 1) and random q/k/v_down parameters,
 * all drawn from key. */
static void case_alloc(struct fd_case *t, uint64_t key) {
  const long N = t->c.n * t->c.d;
  t->q = malloc(sizeof(double) * N);
  t->k = malloc(sizeof(double) * N);
  t->v = malloc(sizeof(double) * N);
  t->g = malloc(sizeof(double) * N);
  tu_randn_d(t->q, N, key + 1, 1.0);
  tu_randn_d(t->k, N, key + 2, 1.0);
  tu_randn_d(t->v, N, key + 3, 1.0);
  tu_randn_d(t->g, N, key + 4, 1.0);
  fo_params_alloc(&t->c, &t->qp);
  fo_params_alloc(&t->c, &t->kp);
  fo_params_alloc(&t->c, &t->vp);
  random_params(&t->c, &t->qp, key + 5);
  random_params(&t->c, &t->kp, key + 6);
  random_params(&t->c, &t->vp, key + 7);
}

/* Release case_alloc's inputs and parameters. */
static void case_free(struct fd_case *t) {
  fo_params_free(&t->c, &t->qp);
  fo_params_free(&t->c, &t->kp);
  fo_params_free(&t->c, &t->vp);
  free(t->q);
  free(t->k);
  free(t->v);
  free(t->g);
}

/* J = Σ g·out at the case's current inputs; with t->dec, also flags a changed opening choice. */
static double fd_objective(struct fd_case *t) {
  const long N = t->c.n * t->c.d;
  if (t->dec) {
    size_t nf = open_flag_count(&t->c);
    unsigned char *now = malloc(nf);
    open_decisions(&t->c, now, t->q, t->k, &t->kp);
    if (memcmp(now, t->dec, nf)) t->flipped = true;
    free(now);
  }
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
  for (size_t i = 0; i < N; i++) {
    t->flipped = false;
    TU_FD(f[i], x, i, 1e-6, fd_objective(t));
    if (t->flipped) f[i] = grad[i], t->skipped++; /* the step crossed a choice: not comparable */
  }
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
    t->flipped = false;
    TU_FD(f[i], x, 0, 1e-6, fd_objective(t));
    if (t->flipped) f[i] = grad[i], t->skipped++;
  }
  char msg[256];
  snprintf(msg, sizeof msg, "%s: oracle %s vs finite differences", what, name);
  TU_ASSERT_CLOSE(tu_rel_err_dd(grad, f, N), 1e-6, msg);
  free(grad);
  free(f);
}

/* One random case (inputs, parameters, output weights g all N(0, 1)-ish): the analytic gradients
 * of J = Σ g·out, inputs and summary parameters, against central differences. open ≠ 0 (fma only)
 * sets fma.open; an entry whose ±h step changes any query's opening choice is left out (counted
 * in t.skipped, which must stay under 1% of the entries). */
static void fd_case_run(long n, long d, int m, int p, enum fo_down down, bool causal, bool mult,
                        bool linear, int open) {
  struct fd_case t = {.linear = linear};
  fo_cfg_init(&t.c, n, d, m, p, down, causal, mult);
  t.c.open = open;
  const long N = n * d;
  case_alloc(&t, (uint64_t)(n * 1000 + down * 100 + causal * 10 + mult * 2 + linear +
                            (open ? 40 + 4 * open : 0)));
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
  snprintf(what, sizeof what, "%s n=%ld m=%d p=%d %s %s multiplicity %s open %d",
           linear ? "fma_linear" : "fma", n, m, p, down_name[down], causal ? "causal" : "bidir",
           mult ? "on" : "off", open);
  if (open) {
    /* a real mix: some exact tokens opened, some summaries kept */
    struct fo_open_stats st;
    fo_fma_open_stats(&t.c, &st, t.q, t.k, t.v, &t.kp, &t.vp);
    if (!(st.open_mass > 0.0 && st.summary_mass > 0.0))
      fail_msg("%s: opening is trivial (open mass %g, summary mass %g)", what, st.open_mass,
               st.summary_mass);
    t.dec = malloc(open_flag_count(&t.c));
    open_decisions(&t.c, t.dec, t.q, t.k, &t.kp);
  }
  fd_check_tensor(&t, t.q, N, dq, what, "dq");
  fd_check_tensor(&t, t.k, N, dk, what, "dk");
  fd_check_tensor(&t, t.v, N, dv, what, "dv");
  if (linear) fd_check_params(&t, &t.qp, &dqp, what, "dq_down");
  fd_check_params(&t, &t.kp, &dkp, what, "dk_down");
  fd_check_params(&t, &t.vp, &dvp, what, "dv_down");
  if (open) {
    const long entries = 3 * N + 2 * (long)fo_params_count(&t.c);
    if (t.skipped)
      print_message("# %s: %ld of %ld differences skipped (choice flipped)\n", what, t.skipped,
                    entries);
    if (t.skipped * 100 > entries) fail_msg("%s: %ld near ties skipped", what, t.skipped);
    free(t.dec);
  }
  case_free(&t);
  fo_params_free(&t.c, &dqp);
  fo_params_free(&t.c, &dkp);
  fo_params_free(&t.c, &dvp);
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
                      causal, mult, false, 0);
}

static void test_oracle_fma_linear_gradients(void **state) {
  const long sizes[][3] = {{8, 4, 2}, {16, 4, 2}, {32, 4, 2}, {64, 8, 4}};
  for (int down = 0; down < 3; down++)
    for (int causal = 0; causal < 2; causal++)
      for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++)
        fd_case_run(sizes[s][0], 3, (int)sizes[s][1], (int)sizes[s][2], (enum fo_down)down, causal,
                    true, true, 0);
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

/* ================================================================================================
 * fma.open (SPEC §6.4a): the choice, coverage, exactness with `all`, causality, gradients
 * ============================================================================================== */

/* One query's whole opening, through the oracle's public API: per level l its candidates and the
 * windows it opens (arrays of n/m, enough for any level). */
struct open_walk {
  long *cand[FO_MAX_LEVELS + 1], *open[FO_MAX_LEVELS + 1];
  int ncand[FO_MAX_LEVELS + 1], nopen[FO_MAX_LEVELS + 1];
};

/* Room for one walk under c. */
static void open_walk_alloc(const struct fo_cfg *c, struct open_walk *w) {
  memset(w, 0, sizeof *w);
  for (int l = 1; l <= c->levels; l++) {
    w->cand[l] = malloc(sizeof(long) * (size_t)(c->n / c->m));
    w->open[l] = malloc(sizeof(long) * (size_t)(c->n / c->m));
  }
}

/* Release open_walk_alloc's arrays. */
static void open_walk_free(const struct fo_cfg *c, struct open_walk *w) {
  for (int l = 1; l <= c->levels; l++) {
    free(w->cand[l]);
    free(w->open[l]);
  }
}

/* Walk query i (query vector qi, key summaries K) from level L down to 1, each level's opened
 * windows feeding the next level's candidates. */
static void open_walk(const struct fo_cfg *c, struct open_walk *w, long i, const double *qi,
                      double *const K[FO_MAX_LEVELS + 1]) {
  for (int l = c->levels; l >= 1; l--) {
    const long *above = l < c->levels ? w->open[l + 1] : NULL;
    const int na = l < c->levels ? w->nopen[l + 1] : 0;
    w->ncand[l] = fo_open_candidates(c, i, l, above, na, w->cand[l]);
    w->nopen[l] = fo_open_choice(c, i, qi, K, l, above, na, w->open[l]);
  }
}

/* Size of open_decisions' flags: n queries times every window of every level. */
static size_t open_flag_count(const struct fo_cfg *c) {
  size_t s = 0;
  for (int l = 1; l <= c->levels; l++) s += (size_t)(c->n / c->w[l]);
  return s * (size_t)c->n;
}

/* Every opening decision of fo_fma on (q, k): flag 1 where query i opens level-l window win, at
 * i·(windows of all levels) + (windows of levels below l) + win; 0 elsewhere. */
static void open_decisions(const struct fo_cfg *c, unsigned char *flags, const double *q,
                           const double *k, const struct fo_params *kp) {
  const size_t per = open_flag_count(c) / (size_t)c->n;
  memset(flags, 0, open_flag_count(c));
  double *K[FO_MAX_LEVELS + 1];
  fo_summaries_alloc(c, K);
  fo_summaries_forward(c, K, k, kp);
  struct open_walk w;
  open_walk_alloc(c, &w);
  for (long i = 0; i < c->n; i++) {
    open_walk(c, &w, i, q + i * c->d, K);
    size_t off = 0;
    for (int l = 1; l <= c->levels; l++) {
      for (int x = 0; x < w.nopen[l]; x++) flags[(size_t)i * per + off + (size_t)w.open[l][x]] = 1;
      off += (size_t)(c->n / c->w[l]);
    }
  }
  open_walk_free(c, &w);
  fo_summaries_free(c, K);
}

/* SPEC §6.4a's score of level-l window win for query qi, written here from the text: the log of
 * the softmax mass its p rows would get, log Σ_r exp(qi·K_l[win·p + r]/√d + log(w_l/p)) (the log
 * term with multiplicity only). */
static double open_score_spec(const struct fo_cfg *c, const double *qi, const double *Kl, int l,
                              long win) {
  double z = 0.0;
  for (long r = 0; r < c->p; r++) {
    double dot = 0.0;
    for (long f = 0; f < c->d; f++) dot += qi[f] * Kl[(win * c->p + r) * c->d + f];
    z += exp(dot / sqrt((double)c->d)) * (c->multiplicity ? (double)c->w[l] / (double)c->p : 1.0);
  }
  return log(z);
}

/* The selection rule on q, k (already in t) for every query and level: fo_open_score is the SPEC
 * score (open_score_spec, to 1e-13); exactly min(K, candidates) windows opened (all with
 * FO_OPEN_ALL); each opened window's score above every unopened one's, or equal with a lower
 * index (scores by open_score_spec, so exact ties are ties of equal summary rows). Returns how
 * many (opened, unopened) pairs had exactly equal scores. */
static long check_open_rule(const struct fd_case *t, const char *what) {
  const struct fo_cfg *c = &t->c;
  double *K[FO_MAX_LEVELS + 1];
  fo_summaries_alloc(c, K);
  fo_summaries_forward(c, K, t->k, &t->kp);
  struct open_walk w;
  open_walk_alloc(c, &w);
  long ties = 0;
  for (long i = 0; i < c->n; i++) {
    const double *qi = t->q + i * c->d;
    open_walk(c, &w, i, qi, K);
    for (int l = c->levels; l >= 1; l--) {
      int want = c->open == FO_OPEN_ALL || c->open > w.ncand[l] ? w.ncand[l] : c->open;
      if (w.nopen[l] != want)
        fail_msg("%s: query %ld level %d opens %d of %d candidates, want %d", what, i, l,
                 w.nopen[l], w.ncand[l], want);
      for (int a = 0; a < w.nopen[l]; a++) {
        const long o = w.open[l][a];
        bool is_cand = false;
        for (int b = 0; b < w.ncand[l]; b++) is_cand |= w.cand[l][b] == o;
        if (!is_cand) fail_msg("%s: query %ld opens non-candidate window %ld", what, i, o);
        const double go = open_score_spec(c, qi, K[l], l, o);
        if (!(fabs(fo_open_score(c, qi, K[l], l, o) - go) <= 1e-13 * (1.0 + fabs(go))))
          fail_msg("%s: query %ld level %d window %ld: fo_open_score %.17g, SPEC %.17g", what, i, l,
                   o, fo_open_score(c, qi, K[l], l, o), go);
        for (int b = 0; b < w.ncand[l]; b++) {
          const long u = w.cand[l][b];
          bool opened = false;
          for (int e = 0; e < w.nopen[l]; e++) opened |= w.open[l][e] == u;
          if (opened) continue;
          const double gu = open_score_spec(c, qi, K[l], l, u);
          if (go == gu) ties++;
          if (!(go > gu || (go == gu && o < u)))
            fail_msg("%s: query %ld level %d opens window %ld (g %.17g) over %ld (g %.17g)", what,
                     i, l, o, go, u, gu);
        }
      }
    }
  }
  open_walk_free(c, &w);
  fo_summaries_free(c, K);
  return ties;
}

/* fma.open = 0 (fo_cfg_init's default) is §6.4 bit for bit: fo_fma equals itself under a copy of
 * the cfg with open explicitly 0 (output and every gradient, memcmp) and SPEC's dense form, and a
 * non-zero open does change the output (the field is read). */
static void test_oracle_open_zero_unchanged(void **state) {
  for (int down = 0; down < 3; down++)
    for (int causal = 0; causal < 2; causal++) {
      struct fd_case t = {0};
      const long n = 64, d = 3, N = n * d;
      fo_cfg_init(&t.c, n, d, 4, 2, (enum fo_down)down, causal, true);
      assert_int_equal(t.c.open, 0);
      case_alloc(&t, 7000 + 10 * down + causal);
      struct fo_cfg c0 = t.c;
      c0.open = 0;
      double *o[3], *dq[2], *dk[2], *dv[2];
      struct fo_params dkp[2], dvp[2];
      for (int r = 0; r < 3; r++) o[r] = malloc(sizeof(double) * N);
      for (int r = 0; r < 2; r++) {
        dq[r] = calloc(N, sizeof(double));
        dk[r] = calloc(N, sizeof(double));
        dv[r] = calloc(N, sizeof(double));
        fo_params_alloc(&t.c, &dkp[r]);
        fo_params_alloc(&t.c, &dvp[r]);
      }
      fo_fma(&t.c, o[0], dq[0], dk[0], dv[0], &dkp[0], &dvp[0], t.q, t.k, t.v, &t.kp, &t.vp, t.g);
      fo_fma(&c0, o[1], dq[1], dk[1], dv[1], &dkp[1], &dvp[1], t.q, t.k, t.v, &t.kp, &t.vp, t.g);
      assert_memory_equal(o[0], o[1], sizeof(double) * N);
      assert_memory_equal(dq[0], dq[1], sizeof(double) * N);
      assert_memory_equal(dk[0], dk[1], sizeof(double) * N);
      assert_memory_equal(dv[0], dv[1], sizeof(double) * N);
      for (size_t e = 0; e < fo_params_count(&t.c); e++) {
        assert_true(*fo_params_at(&t.c, &dkp[0], e) == *fo_params_at(&t.c, &dkp[1], e));
        assert_true(*fo_params_at(&t.c, &dvp[0], e) == *fo_params_at(&t.c, &dvp[1], e));
      }
      fo_fma_dense(&c0, o[2], t.q, t.k, t.v, &t.kp, &t.vp);
      TU_ASSERT_CLOSE(tu_rel_err_dd(o[0], o[2], N), 1e-12, "open = 0 vs SPEC §6.4 dense form");
      struct fo_cfg c1 = t.c;
      c1.open = 1;
      fo_fma(&c1, o[2], NULL, NULL, NULL, NULL, NULL, t.q, t.k, t.v, &t.kp, &t.vp, NULL);
      assert_true(tu_rel_err_dd(o[0], o[2], N) > 1e-6);
      for (int r = 0; r < 3; r++) free(o[r]);
      for (int r = 0; r < 2; r++) {
        free(dq[r]), free(dk[r]), free(dv[r]);
        fo_params_free(&t.c, &dkp[r]);
        fo_params_free(&t.c, &dvp[r]);
      }
      case_free(&t);
    }
}

/* fma.open = all is exact softmax attention (SPEC §6.4a): out, dq, dk, dv equal the dense float64
 * reference (tu_dense_attention, causal mask in causal mode) to 1e-12 whatever the summaries, and
 * no gradient reaches the summary parameters (exactly 0). */
static void test_oracle_open_all_is_exact(void **state) {
  const long sizes[][3] = {{32, 4, 2}, {64, 8, 4}, {128, 8, 2}};
  for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++)
    for (int down = 0; down < 3; down++)
      for (int causal = 0; causal < 2; causal++)
        for (int mult = 0; mult < 2; mult++) {
          struct fd_case t = {0};
          const long n = sizes[s][0], d = 4, N = n * d;
          fo_cfg_init(&t.c, n, d, (int)sizes[s][1], (int)sizes[s][2], (enum fo_down)down, causal,
                      mult);
          t.c.open = FO_OPEN_ALL;
          case_alloc(&t, 7100 + 100 * s + 10 * down + 2 * causal + mult);
          double *o1 = malloc(8 * N), *dq1 = calloc(N, 8), *dk1 = calloc(N, 8), *dv1 = calloc(N, 8);
          double *o2 = malloc(8 * N), *dq2 = calloc(N, 8), *dk2 = calloc(N, 8), *dv2 = calloc(N, 8);
          struct fo_params dkp, dvp;
          fo_params_alloc(&t.c, &dkp);
          fo_params_alloc(&t.c, &dvp);
          fo_fma(&t.c, o1, dq1, dk1, dv1, &dkp, &dvp, t.q, t.k, t.v, &t.kp, &t.vp, t.g);
          const struct tu_mask mask = {causal, 0};
          tu_dense_attention(o2, dq2, dk2, dv2, t.q, t.k, t.v, t.g, n, d, tu_mask_allowed, &mask);
          char what[160];
          snprintf(what, sizeof what, "fma.open = all, n=%ld m=%ld p=%ld %s %s mult %d vs exact", n,
                   sizes[s][1], sizes[s][2], down_name[down], causal ? "causal" : "bidir", mult);
          TU_ASSERT_CLOSE(tu_rel_err_dd(o1, o2, N), 1e-12, what);
          TU_ASSERT_CLOSE(tu_rel_err_dd(dq1, dq2, N), 1e-12, what);
          TU_ASSERT_CLOSE(tu_rel_err_dd(dk1, dk2, N), 1e-12, what);
          TU_ASSERT_CLOSE(tu_rel_err_dd(dv1, dv2, N), 1e-12, what);
          for (size_t e = 0; e < fo_params_count(&t.c); e++)
            if (*fo_params_at(&t.c, &dkp, e) != 0.0 || *fo_params_at(&t.c, &dvp, e) != 0.0)
              fail_msg("%s: summary parameter %zu has a gradient", what, e);
          fo_params_free(&t.c, &dkp);
          fo_params_free(&t.c, &dvp);
          free(o1), free(dq1), free(dk1), free(dv1);
          free(o2), free(dq2), free(dk2), free(dv2);
          case_free(&t);
        }
}

/* The analytic backward with the choice held fixed against central differences, fma.open = 1, 2,
 * 3: every input and summary-parameter gradient, L = 2 and 3, causal and bidirectional. */
static void test_oracle_open_gradients(void **state) {
  const long sizes[][3] = {{32, 4, 2}, {64, 4, 2}};
  for (int open = 1; open <= 3; open++)
    for (int down = 0; down < 3; down++)
      for (int causal = 0; causal < 2; causal++)
        for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++)
          fd_case_run(sizes[s][0], 3, (int)sizes[s][1], (int)sizes[s][2], (enum fo_down)down,
                      causal, true, false, open);
}

/* The opening score and the selection rule. Exact ties first: avg summaries of a key sequence of
 * period 16 make windows 16 tokens apart identical, so their scores are bitwise equal; the lower
 * window must win (the two level-3 list windows of a query, named explicitly, and every tied pair
 * of every query and level). Then the rule (K best by fo_open_score, lower window on ties, min(K,
 * count) opened) on random inputs and learned summaries. */
static void test_oracle_open_choice(void **state) {
  for (int causal = 0; causal < 2; causal++)
    for (int open = 1; open <= 2; open++) {
      struct fd_case t = {0};
      const long n = 64, d = 4;
      fo_cfg_init(&t.c, n, d, 4, 2, FO_AVG, causal, true); /* L = 3: w = 4, 8, 16 */
      t.c.open = open;
      case_alloc(&t, 7200 + 10 * causal + open);
      for (long j = 16; j < n; j++)
        for (long f = 0; f < d; f++) t.k[j * d + f] = t.k[(j % 16) * d + f];
      double *K[FO_MAX_LEVELS + 1];
      fo_summaries_alloc(&t.c, K);
      fo_summaries_forward(&t.c, K, t.k, NULL);
      /* bidirectional query 0: level-3 list {2, 3}; causal query 50: {0, 1} */
      const long i = causal ? 50 : 0, lo = causal ? 0 : 2, qi_off = i * d;
      long cand[4], opened[4];
      assert_int_equal(fo_open_candidates(&t.c, i, 3, NULL, 0, cand), 2);
      assert_int_equal(cand[0], lo);
      assert_int_equal(cand[1], lo + 1);
      const double g0 = open_score_spec(&t.c, t.q + qi_off, K[3], 3, lo),
                   g1 = open_score_spec(&t.c, t.q + qi_off, K[3], 3, lo + 1);
      assert_true(g0 == g1);
      struct fo_cfg c1 = t.c;
      c1.open = 1;
      assert_int_equal(fo_open_choice(&c1, i, t.q + qi_off, K, 3, NULL, 0, opened), 1);
      assert_int_equal(opened[0], lo);
      char what[96];
      snprintf(what, sizeof what, "periodic keys, %s, open %d", causal ? "causal" : "bidir", open);
      if (check_open_rule(&t, what) == 0) fail_msg("%s: no tie was exercised", what);
      fo_summaries_free(&t.c, K);
      case_free(&t);
    }
  for (int causal = 0; causal < 2; causal++)
    for (int down = 0; down < 3; down++)
      for (int open = 1; open <= 3; open++) {
        struct fd_case t = {0};
        const bool mult = open != 3; /* the score without the log term too */
        fo_cfg_init(&t.c, 128, 4, 4, 2, (enum fo_down)down, causal, mult);
        t.c.open = open;
        case_alloc(&t, 7300 + 100 * causal + 10 * down + open);
        char what[96];
        snprintf(what, sizeof what, "random, %s %s, open %d, multiplicity %d", down_name[down],
                 causal ? "causal" : "bidir", open, mult);
        check_open_rule(&t, what);
        case_free(&t);
      }
}

/* SPEC §6.4a's dense oracle, built here from the decisions alone (fo_open_candidates and
 * fo_open_choice): per query the n keys each get exactly one column — near and opened level-1
 * tokens their own key, tokens of an unopened level-l candidate the key summary row of their
 * sub-segment (multiplicity implicit, as in §6.4's C̃) — every allowed key exactly once, nothing
 * else; softmax over them times the matching values equals fo_fma to 1e-12. */
static void test_oracle_open_dense(void **state) {
  const long sizes[][4] = {{64, 4, 2, 3}, {128, 8, 4, 4}};
  const int opens[] = {1, 2, 3, FO_OPEN_ALL};
  for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++)
    for (int down = 0; down < 3; down++)
      for (int causal = 0; causal < 2; causal++)
        for (size_t a = 0; a < sizeof opens / sizeof opens[0]; a++) {
          struct fd_case t = {0};
          const long n = sizes[s][0], d = sizes[s][3], N = n * d, p = sizes[s][2];
          struct fo_cfg *c = &t.c;
          fo_cfg_init(c, n, d, (int)sizes[s][1], (int)p, (enum fo_down)down, causal, true);
          c->open = opens[a];
          case_alloc(&t, 7400 + 100 * s + 10 * down + 2 * causal + a);
          double *K[FO_MAX_LEVELS + 1], *V[FO_MAX_LEVELS + 1];
          fo_summaries_alloc(c, K);
          fo_summaries_alloc(c, V);
          fo_summaries_forward(c, K, t.k, &t.kp);
          fo_summaries_forward(c, V, t.v, &t.vp);
          double *o1 = malloc(8 * N), *o2 = calloc(N, 8), *row = malloc(8 * n);
          const double **key = malloc(sizeof(double *) * n), **val = malloc(sizeof(double *) * n);
          int *cover = malloc(sizeof(int) * n);
          fo_fma(c, o1, NULL, NULL, NULL, NULL, NULL, t.q, t.k, t.v, &t.kp, &t.vp, NULL);
          struct open_walk w;
          open_walk_alloc(c, &w);
          char what[160];
          snprintf(what, sizeof what, "fma.open = %d, n=%ld %s %s: dense form", opens[a], n,
                   down_name[down], causal ? "causal" : "bidir");
          for (long i = 0; i < n; i++) {
            const double *qi = t.q + i * d;
            for (long j = 0; j < n; j++) cover[j] = 0;
            long blocks[FO_LIST_MAX];
            int nb = fo_near(c, i / c->m, blocks);
            for (int x = 0; x < nb; x++)
              for (long j = blocks[x] * c->m; j < (blocks[x] + 1) * c->m; j++)
                if (!causal || j <= i) cover[j]++, key[j] = t.k + j * d, val[j] = t.v + j * d;
            open_walk(c, &w, i, qi, K);
            for (int l = 1; l <= c->levels; l++)
              for (int x = 0; x < w.ncand[l]; x++) {
                const long win = w.cand[l][x], wl = c->w[l];
                bool opened = false;
                for (int e = 0; e < w.nopen[l]; e++) opened |= w.open[l][e] == win;
                if (opened && l > 1) continue; /* its children are level l − 1's candidates */
                for (long j = win * wl; j < (win + 1) * wl; j++) {
                  cover[j]++;
                  const long r = win * p + (j % wl) * p / wl;
                  key[j] = opened ? t.k + j * d : K[l] + r * d;
                  val[j] = opened ? t.v + j * d : V[l] + r * d;
                }
              }
            double mx = -INFINITY, z = 0.0;
            for (long j = 0; j < n; j++) {
              if (cover[j] != (!causal || j <= i))
                fail_msg("%s: query %ld covers key %ld %d times", what, i, j, cover[j]);
              row[j] = -INFINITY;
              if (!cover[j]) continue;
              double sc = 0.0;
              for (long f = 0; f < d; f++) sc += qi[f] * key[j][f];
              row[j] = sc / sqrt((double)d);
              if (row[j] > mx) mx = row[j];
            }
            for (long j = 0; j < n; j++) z += exp(row[j] - mx);
            for (long j = 0; j < n; j++)
              for (long f = 0; f < d && cover[j]; f++)
                o2[i * d + f] += exp(row[j] - mx) / z * val[j][f];
          }
          TU_ASSERT_CLOSE(tu_rel_err_dd(o1, o2, N), 1e-12, what);
          open_walk_free(c, &w);
          fo_summaries_free(c, K);
          fo_summaries_free(c, V);
          free(o1), free(o2), free(row), free(key), free(val), free(cover);
          case_free(&t);
        }
}

/* Causal mode stays causal under fma.open = 1, 2, all (SPEC §6.4a): moving q, k and v at every
 * position after i leaves out[0..i] bit for bit unchanged, for every i (and does move out[i + 1]).
 */
static void test_oracle_open_causal(void **state) {
  const int opens[] = {1, 2, FO_OPEN_ALL};
  for (int down = 0; down < 3; down++)
    for (size_t a = 0; a < sizeof opens / sizeof opens[0]; a++) {
      struct fd_case t = {0};
      const long n = 64, d = 3, N = n * d;
      fo_cfg_init(&t.c, n, d, 4, 2, (enum fo_down)down, true, true);
      t.c.open = opens[a];
      case_alloc(&t, 7500 + 10 * down + a);
      double *o0 = malloc(8 * N), *o1 = malloc(8 * N), *q = malloc(8 * N), *k = malloc(8 * N),
             *v = malloc(8 * N), *noise = malloc(8 * 3 * N);
      tu_randn_d(noise, 3 * N, 7599, 2.0);
      fo_fma(&t.c, o0, NULL, NULL, NULL, NULL, NULL, t.q, t.k, t.v, &t.kp, &t.vp, NULL);
      for (long i = 0; i + 1 < n; i++) {
        memcpy(q, t.q, 8 * N), memcpy(k, t.k, 8 * N), memcpy(v, t.v, 8 * N);
        for (long e = (i + 1) * d; e < N; e++)
          q[e] += noise[e], k[e] += noise[N + e], v[e] += noise[2 * N + e];
        fo_fma(&t.c, o1, NULL, NULL, NULL, NULL, NULL, q, k, v, &t.kp, &t.vp, NULL);
        if (memcmp(o0, o1, 8 * (i + 1) * d))
          fail_msg("fma.open = %d %s causal: out[0..%ld] moved with inputs after %ld", opens[a],
                   down_name[down], i, i);
        if (!memcmp(o0 + (i + 1) * d, o1 + (i + 1) * d, 8 * d))
          fail_msg("fma.open = %d: out[%ld] did not move with its own inputs", opens[a], i + 1);
      }
      free(o0), free(o1), free(q), free(k), free(v), free(noise);
      case_free(&t);
    }
}

/* fma.open = K with K at least any level's candidate count (n/m, every window of level 1) is
 * fma.open = all, bit for bit: output and every gradient. */
static void test_oracle_open_k_large_is_all(void **state) {
  for (int down = 0; down < 3; down++)
    for (int causal = 0; causal < 2; causal++) {
      struct fd_case t = {0};
      const long n = 64, d = 3, N = n * d;
      fo_cfg_init(&t.c, n, d, 4, 2, (enum fo_down)down, causal, true);
      case_alloc(&t, 7600 + 10 * down + causal);
      const int opens[2] = {(int)(n / t.c.m), FO_OPEN_ALL};
      double *o[2], *dq[2], *dk[2], *dv[2];
      for (int r = 0; r < 2; r++) {
        struct fo_cfg c = t.c;
        c.open = opens[r];
        o[r] = malloc(8 * N), dq[r] = calloc(N, 8), dk[r] = calloc(N, 8), dv[r] = calloc(N, 8);
        fo_fma(&c, o[r], dq[r], dk[r], dv[r], NULL, NULL, t.q, t.k, t.v, &t.kp, &t.vp, t.g);
      }
      assert_memory_equal(o[0], o[1], 8 * N);
      assert_memory_equal(dq[0], dq[1], 8 * N);
      assert_memory_equal(dk[0], dk[1], 8 * N);
      assert_memory_equal(dv[0], dv[1], 8 * N);
      for (int r = 0; r < 2; r++) free(o[r]), free(dq[r]), free(dk[r]), free(dv[r]);
      case_free(&t);
    }
}

/* fo_fma_open_stats. The number opened at level l follows from counts alone (SPEC §6.4a): a
 * query's candidates are its level-l list (fo_level) plus two per window opened at l + 1, and
 * it opens min(K, candidates) (all with `all`, none with 0); the stats must equal that sum over
 * queries. The three masses add up to n; with `all` the summary mass is exactly 0 and the near
 * field plus the opened level-1 windows are every allowed key; with 0 nothing is opened. */
static void test_oracle_open_stats(void **state) {
  const long sizes[][3] = {{64, 4, 2}, {128, 8, 2}};
  const int opens[] = {0, 1, 2, 3, FO_OPEN_ALL};
  for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++)
    for (int causal = 0; causal < 2; causal++)
      for (size_t a = 0; a < sizeof opens / sizeof opens[0]; a++) {
        struct fd_case t = {0};
        const long n = sizes[s][0], m = sizes[s][1];
        struct fo_cfg *c = &t.c;
        fo_cfg_init(c, n, 3, (int)m, (int)sizes[s][2], FO_CONV, causal, true);
        const int K = opens[a];
        c->open = K;
        case_alloc(&t, 7700 + 100 * s + 10 * causal + a);
        struct fo_open_stats st;
        memset(&st, 0x55, sizeof st); /* must be zeroed by the call */
        fo_fma_open_stats(c, &st, t.q, t.k, t.v, &t.kp, &t.vp);
        double want[FO_MAX_LEVELS + 1] = {0};
        for (long i = 0; i < n; i++) {
          long list[FO_LIST_MAX], opened_above = 0;
          for (int l = c->levels; l >= 1; l--) {
            const long cand = fo_level(c, l, i / c->w[l], list) + 2 * opened_above;
            opened_above = K == FO_OPEN_ALL ? cand : (cand < K ? cand : K);
            want[l] += (double)opened_above;
          }
          if (K == FO_OPEN_ALL) { /* near field + opened level-1 windows = every allowed key */
            long near = 0, blocks[FO_LIST_MAX];
            int nb = fo_near(c, i / m, blocks);
            for (int x = 0; x < nb; x++)
              for (long j = blocks[x] * m; j < (blocks[x] + 1) * m; j++) near += !causal || j <= i;
            assert_int_equal(near + m * opened_above, causal ? i + 1 : n);
          }
        }
        char what[96];
        snprintf(what, sizeof what, "stats, n=%ld %s open %d", n, causal ? "causal" : "bidir", K);
        assert_true(st.opened[0] == 0.0);
        for (int l = 1; l <= c->levels; l++)
          if (st.opened[l] != want[l])
            fail_msg("%s: level %d opened %g windows, want %g", what, l, st.opened[l], want[l]);
        TU_ASSERT_CLOSE(fabs(st.open_mass + st.near_mass + st.summary_mass - n) / n, 1e-12, what);
        if (K == FO_OPEN_ALL) assert_true(st.summary_mass == 0.0);
        if (K == 0) assert_true(st.open_mass == 0.0);
        if (K != 0) assert_true(st.open_mass > 0.0);
        case_free(&t);
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
    cmocka_unit_test(test_oracle_open_zero_unchanged),
    cmocka_unit_test(test_oracle_open_all_is_exact),
    cmocka_unit_test(test_oracle_open_gradients),
    cmocka_unit_test(test_oracle_open_choice),
    cmocka_unit_test(test_oracle_open_dense),
    cmocka_unit_test(test_oracle_open_causal),
    cmocka_unit_test(test_oracle_open_k_large_is_all),
    cmocka_unit_test(test_oracle_open_stats),
};

TU_MAIN(tests)
