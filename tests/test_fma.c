/* The production `fma` and `fma_linear` through their ops table against the float64 oracle of
 * fma_oracle.c (checked itself by test_fma_oracle.c): out, dq, dk, dv and every parameter gradient
 * over downsample × causal × multiplicity × init × (n, m, p); parameter names, shapes and init;
 * v ≡ 1; causality by perturbation; the shifted causal query summary; float gradients against
 * float differences. It reads nothing of the production FMA code but the tree and the lists. */
#include "testutil.h"

#include "../src/attention/attention.h"
#include "../src/deck/config.h"
#include "../src/fma/lists.h"
#include "../src/fma/tree.h"
#include "../src/nn/params.h"
#include "fma_cases.h"
#include "fma_oracle.h"

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

/* fma.linear_zero_values in the next make_config: off for the oracle comparisons, which need the
 * value summaries live to test them (test_fma_linear_zero_values checks the start at 0). */
static bool zero_values = false;

static void make_config(struct config *cfg, const struct fma_case *t) {
  tu_config(
      cfg, t->linear ? "fma_linear" : "fma", t->n, (int)t->H, (int)t->d, t->causal,
      TU_SETS(tu_fmt("attention.fma.m=%d", t->m), tu_fmt("attention.fma.p=%d", t->p),
              tu_fmt("attention.fma.downsample=%s", down_name[t->down]),
              tu_fmt("attention.fma.init=%s", t->init == INIT_MODE_RANDOM ? "random" : "mean"),
              tu_fmt("attention.fma.multiplicity=%s", t->mult ? "true" : "false"),
              tu_fmt("attention.fma.linear_zero_values=%s", zero_values ? "true" : "false")));
  char err[CONFIG_ERR_LEN];
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

/* Forward (and backward when dout is given) of the production variant, exactly as the model
 * calls it; dparams is zeroed first since backward accumulates. */
static struct tu_run prod_run(struct prod *pr, const struct fma_case *t, const float *q,
                              const float *k, const float *v, const float *dout) {
  struct attn_ctx ctx = tu_attn_open(&pr->cfg, t->B);
  memset(pr->dparams, 0, sizeof(float) * (pr->list.total + 1));
  struct tu_run r = tu_attn_run(&ctx, pr->params, pr->dparams, q, k, v, dout);
  attention_close(&ctx);
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
  struct tu_run r = prod_run(&pr, t, q, k, v, g);

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
  tu_run_free(&r);
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

/* fma.linear_zero_values (the default; docs/fma.md): fma_linear's value summaries start at 0 —
 * every v_down bias, and the weights that read tokens (conv: every level; m2m: level 1, its M2M
 * levels keeping the mean init) — while its key and query summaries start as the avg ones; so a
 * fresh fma_linear is its near field alone. fma's value summaries are untouched. And every
 * summary weight learns at lr·p/taps (fma.down_lr = scaled), its biases at lr. */
static void test_fma_linear_zero_values(void **state) {
  (void)state;
  for (int linear = 0; linear < 2; linear++)
    for (int down = 0; down < 2; down++) {
      struct fma_case t =
          fma_case_make(linear, 1, 1, 512, 3, 8, 4, (enum fo_down)down, true, true, INIT_MODE_MEAN);
      char what[200];
      case_text(&t, what, sizeof what);
      zero_values = true;
      struct prod pr;
      prod_setup(&pr, &t);
      zero_values = false;
      double *x = malloc(sizeof(double) * t.n * t.d);
      tu_randn_d(x, t.n * t.d, 83, 1.0);
      for (int op = linear ? 0 : 1; op < 3; op++) {
        struct fo_params P;
        prod_to_oracle(&pr, op, &P);
        if (op < 2 || !linear) {
          check_summaries_are_avg(&pr.fc, &P, x, 1e-6, what);
        } else {
          for (int l = 1; l <= pr.fc.levels; l++) {
            const bool zero = down == FO_CONV || l == 1;
            double sum = 0.0;
            for (long e = 0; e < fo_weight_len(&pr.fc, l); e++) sum += fabs(P.weight[l][e]);
            if (zero != (sum == 0.0))
              fail_msg("%s: v_down level %d weight is %s", what, l, zero ? "not 0" : "0");
            for (long e = 0; e < fo_bias_len(&pr.fc, l); e++)
              if (P.bias[l][e] != 0.0) fail_msg("%s: v_down level %d bias not 0", what, l);
          }
        }
        fo_params_free(&pr.fc, &P);
      }
      for (int i = 0; i < pr.list.count; i++) {
        const struct param_desc *p = &pr.list.p[i];
        const bool weight = strstr(p->name, "/weight") != NULL;
        const float want = weight ? (float)t.p / (float)p->shape[2] : 1.0f;
        if (p->lr_scale != want)
          fail_msg("%s: %s lr_scale %g, expected %g", what, p->name, p->lr_scale, want);
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
          struct tu_run r = prod_run(&pr, &t, q, k, v, NULL);
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
          tu_run_free(&r);
          free(q), free(k), free(v);
          prod_free(&pr);
        }
}

/* The probe sees a summary that mixes in a later query: on the oracle, moving q alone at j = 37
 * leaves every earlier output as it was with the SPEC's shifted query summary ρ_l(i) − 1, and
 * changes one with the unshifted ρ_l(i) (i = 36 shares 37's level-1 sub-segment). Returns the
 * number of failures, each printed. */
static int shifted_query_is_seen(const struct prod *pr, const struct fma_case *t, const float *q,
                                 const float *k, const float *v, const char *what) {
  const long j = 37, nd = t->n * t->d;
  struct fo_params P[3];
  for (int op = 0; op < 3; op++) prod_to_oracle(pr, op, &P[op]);
  double *qa = tu_to_double(q, nd), *qb = tu_to_double(q, nd);
  double *kd = tu_to_double(k, nd), *vd = tu_to_double(v, nd);
  double *oa = malloc(8 * nd), *ob = malloc(8 * nd);
  for (long f = 0; f < t->d; f++) qb[j * t->d + f] += 3.0;
  struct fo_cfg fc = pr->fc;
  int failed = 0;
  for (int unshifted = 0; unshifted < 2; unshifted++) {
    fc.unshifted = unshifted;
    fo_fma_linear(&fc, oa, NULL, NULL, NULL, NULL, NULL, NULL, qa, kd, vd, &P[0], &P[1], &P[2],
                  NULL);
    fo_fma_linear(&fc, ob, NULL, NULL, NULL, NULL, NULL, NULL, qb, kd, vd, &P[0], &P[1], &P[2],
                  NULL);
    bool leaked = false;
    for (long e = 0; e < j * t->d; e++) leaked |= oa[e] != ob[e];
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
  for (int op = 0; op < 3; op++) fo_params_free(&pr->fc, &P[op]);
  return failed;
}

/* Causality by perturbation (testutil.c): change q (and unless only_q, k and v) at position j;
 * outputs at i < j must not change at all, outputs at j must. Returns the number of failed
 * probes, each printed. With only_q (fma_linear) the oracle shows the probe would see an
 * unshifted query summary (shifted_query_is_seen). */
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
  /* block and sub-segment boundaries, mid-segment positions (37: i = 36 shares its level-1
   * sub-segment and sees level 1), the last token; not 0 when q alone moves: out_0 = v_0 */
  const long at[] = {0, 7, 8, 37, 64, 70, 101, 127};
  const struct tu_probe probe = {at + only_q, sizeof at / sizeof at[0] - only_q,
                                 only_q ? TU_MOVE_Q : TU_MOVE_QKV, false};
  struct attn_ctx ctx = tu_attn_open(&pr.cfg, t.B);
  int failed = tu_causality(&ctx, pr.params, q, k, v, &probe, what);
  attention_close(&ctx);
  if (only_q) failed += shifted_query_is_seen(&pr, &t, q, k, v, what);
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
  attention_forward(ctx, out, saved, q, k, v, pr->params);
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
  struct tu_run r = prod_run(&pr, &t, q, k, v, g);
  struct attn_ctx ctx = tu_attn_open(&pr.cfg, t.B);
  float *out = calloc(count, 4), *saved = calloc(attention_saved_floats(&ctx) + 1, 4);
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
  attention_close(&ctx);
  free(out), free(saved);
  tu_run_free(&r);
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
      struct tu_run r = prod_run(&pr, &t, q, k, v, g); /* once, from zero */
      const long np = (long)pr.list.total;
      double *once[4] = {tu_to_double(r.dq, count), tu_to_double(r.dk, count),
                         tu_to_double(r.dv, count), tu_to_double(pr.dparams, np)};
      struct attn_ctx ctx = tu_attn_open(&pr.cfg, t.B);
      float *out = calloc(count, 4), *saved = calloc(attention_saved_floats(&ctx) + 1, 4);
      attention_forward(&ctx, out, saved, q, k, v, pr.params);
      attention_backward(&ctx, r.dq, r.dk, r.dv, pr.dparams, g, q, k, v, pr.params, out, saved);
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
      attention_close(&ctx);
      free(out), free(saved);
      tu_run_free(&r);
      free(q), free(k), free(v), free(g);
      prod_free(&pr);
    }
}

static const struct CMUnitTest tests[] = {
    cmocka_unit_test(test_fma_init),
    cmocka_unit_test(test_fma_linear_zero_values),
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
