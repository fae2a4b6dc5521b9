/* linear, fmmformer and rmfa (SPEC §6.3, §6.6, §6.8) through their ops tables against a float64
 * oracle written from the SPEC text (explicit n × n weights; rmfa's feature matrices from the same
 * stored degrees and Rademacher vectors): out and every gradient (q, k, v, each trainable
 * parameter) by its central differences, causal and bidirectional, several n, d and D; v ≡ 1;
 * causality by perturbation; rmfa's estimate converging as D^−½; its frozen tensors' names. */
#include "testutil.h"

#include "../src/attention/attention.h"
#include "../src/attention/rmfa.h"
#include "../src/core/memory.h"
#include "../src/deck/config.h"

/* ---------------------------------------------------------------------------------------------
 * the oracle: one head, float64, from the SPEC's formulas */

enum okind { O_LINEAR, O_FMM, O_RMFA };

struct oracle {
  enum okind kind;
  bool causal;
  long n, d;
  /* fmmformer */
  long band;
  int nk;
  char kernels[3][16];
  double w1, w2; /* this head's */
  /* rmfa */
  int D, rows, kernel; /* kernel: enum rmfa_kernel */
  bool ppsbn;
  const double *degree, *omega; /* (D), (rows, d) as stored */
  const double *gamma;          /* (d) this head's, or NULL */
};

static double phi_named(const char *name, double x) {
  if (strcmp(name, "elu") == 0) return x > 0 ? x + 1.0 : exp(x);
  if (strcmp(name, "elu_neg") == 0) return -x > 0 ? -x + 1.0 : exp(-x);
  return tanh(x) + 1.0; /* tanh */
}

/* Maclaurin coefficients from their series, written independently of the production table. */
static double maclaurin(int kernel, int N) {
  switch (kernel) {
    case RMFA_EXP:
    case RMFA_TRIGH:
      return 1.0 / tgamma(N + 1.0);
    case RMFA_INV:
      return 1.0;
    case RMFA_LOG:
      return N == 0 ? 1.0 : 1.0 / N;
    default: { /* 2 − √(1 − t) = 2 − Σ C(½, N)(−t)^N */
      if (N == 0) return 1.0;
      double c = 1.0;
      for (int i = 0; i < N; i++) c *= (0.5 - i) / (i + 1.0);
      return -c * (N % 2 ? -1.0 : 1.0);
    }
  }
}

/* Φ (D) of one row x (d) per SPEC §6.8. */
static void rmfa_phi(const struct oracle *o, double *phi, const double *x) {
  const long d = o->d;
  double u[64];
  const double s = pow((double)d, -0.25);
  if (o->ppsbn) {
    double mean = 0, var = 0, len = 0;
    for (long c = 0; c < d; c++) mean += x[c] / d;
    for (long c = 0; c < d; c++) var += (x[c] - mean) * (x[c] - mean) / d;
    for (long c = 0; c < d; c++) {
      u[c] = (x[c] - mean) / sqrt(var + 1e-12);
      len += u[c] * u[c];
    }
    for (long c = 0; c < d; c++) u[c] *= s / sqrt(len);
  } else {
    for (long c = 0; c < d; c++) u[c] = x[c] * s;
  }
  double z = 0;
  for (int N = 1; N <= 20; N++) z += pow(2.0, -(N + 1));
  phi[0] = sqrt(maclaurin(o->kernel, 0));
  long row = 0;
  for (int j = 1; j < o->D; j++) {
    const int N = (int)o->degree[j];
    double f = sqrt(maclaurin(o->kernel, N) / (pow(2.0, -(N + 1)) / z)) / sqrt(o->D - 1.0);
    for (int t = 0; t < N; t++, row++) {
      double p = 0;
      for (long c = 0; c < d; c++) p += o->omega[row * d + c] * u[c];
      f *= p;
    }
    phi[j] = f;
  }
}

/* Σ_j A_ij v_j / den_i with A_ij = φ(q_i)·φ(k_j) over the allowed j: kernel `name` (linear,
 * fmmformer) or the random features (rmfa, with max(1, ·)). */
static void oracle_kernelized(const struct oracle *o, const char *name, double *out,
                              const double *q, const double *k, const double *v) {
  const long n = o->n, d = o->d, F = o->kind == O_RMFA ? o->D : d;
  double *fq = malloc(sizeof(double) * n * F), *fk = malloc(sizeof(double) * n * F);
  for (long i = 0; i < n; i++) {
    if (o->kind == O_RMFA) {
      rmfa_phi(o, fq + i * F, q + i * d);
      rmfa_phi(o, fk + i * F, k + i * d);
    } else {
      for (long c = 0; c < d; c++) {
        fq[i * F + c] = phi_named(name, q[i * d + c]);
        fk[i * F + c] = phi_named(name, k[i * d + c]);
      }
    }
  }
  for (long i = 0; i < n; i++) {
    double den = 0;
    for (long c = 0; c < d; c++) out[i * d + c] = 0;
    for (long j = 0; j < n; j++) {
      if (o->causal && j > i) continue;
      double a = 0;
      for (long f = 0; f < F; f++) a += fq[i * F + f] * fk[j * F + f];
      den += a;
      for (long c = 0; c < d; c++) out[i * d + c] += a * v[j * d + c];
    }
    if (o->kind == O_RMFA && den < 1) den = 1;
    for (long c = 0; c < d; c++) out[i * d + c] /= den;
  }
  free(fq);
  free(fk);
}

/* softmax over |i − j| < band (and j ≤ i causal) of q·k/√d, times v: the shared dense
 * reference (testutil.c). */
static void oracle_band(const struct oracle *o, double *out, const double *q, const double *k,
                        const double *v) {
  const struct tu_mask mask = {o->causal, o->band};
  tu_dense_attention(out, NULL, NULL, NULL, q, k, v, NULL, o->n, o->d, tu_mask_allowed, &mask);
}

static double sig(double x) { return 1.0 / (1.0 + exp(-x)); }

/* The variant's output of one head. */
static void oracle_head(const struct oracle *o, double *out, const double *q, const double *k,
                        const double *v) {
  const long nd = o->n * o->d;
  if (o->kind == O_LINEAR) {
    oracle_kernelized(o, "elu", out, q, k, v);
  } else if (o->kind == O_RMFA) {
    oracle_kernelized(o, NULL, out, q, k, v);
    if (o->gamma)
      for (long e = 0; e < nd; e++) out[e] *= o->gamma[e % o->d];
  } else {
    double *part = malloc(sizeof(double) * nd);
    oracle_band(o, out, q, k, v);
    for (long e = 0; e < nd; e++) out[e] *= sig(o->w1);
    for (int i = 0; i < o->nk; i++) {
      oracle_kernelized(o, o->kernels[i], part, q, k, v);
      for (long e = 0; e < nd; e++) out[e] += sig(o->w2) * part[e];
    }
    free(part);
  }
}

static double oracle_dot(const struct oracle *o, const double *g, const double *q, const double *k,
                         const double *v) {
  const long nd = o->n * o->d;
  double *out = malloc(sizeof(double) * nd), j = 0;
  oracle_head(o, out, q, k, v);
  for (long e = 0; e < nd; e++) j += g[e] * out[e];
  free(out);
  return j;
}

/* ---------------------------------------------------------------------------------------------
 * the production op */

struct run {
  struct tu_run t; /* out, dq, dk, dv */
  struct attn_params ap;
};

/* The op's parameters, the trainable ones moved off their initial values (the same way on every
 * call) so that every gradient is exercised. */
static void make_params(struct attn_params *ap, const struct config *cfg) {
  attention_params_make(ap, cfg, attention_select(cfg), cfg->model.context);
  for (int i = 0; i < ap->list.count; i++) {
    const struct param_desc *p = &ap->list.p[i];
    if (p->frozen) continue;
    for (size_t e = 0; e < p->numel; e++)
      ap->params[p->offset + e] += 0.3f * (float)rng_normal(5, RNG_TEST, 40 + i, e, 0);
  }
}

/* Forward and (with g) backward through the ops table, on make_params' parameters. */
static struct run run_op(const struct config *cfg, long B, const float *q, const float *k,
                         const float *v, const float *g) {
  struct run r;
  make_params(&r.ap, cfg);
  struct attn_ctx ctx = tu_attn_open(cfg, B);
  const bool has = r.ap.list.count > 0;
  r.t = tu_attn_run(&ctx, has ? r.ap.params : NULL, has ? r.ap.dparams : NULL, q, k, v, g);
  attention_close(&ctx);
  return r;
}

static void free_run(struct run *r) {
  tu_run_free(&r->t);
  attention_params_free(&r->ap);
}

static const float *tensor(const struct run *r, const char *rel) {
  for (int i = 0; i < r->ap.list.count; i++) {
    const char *name = r->ap.list.p[i].name, *tail = strrchr(name, '/');
    if (tail && strcmp(tail + 1, rel) == 0) return r->ap.params + r->ap.list.p[i].offset;
  }
  return NULL;
}

static size_t tensor_numel(const struct run *r, const char *rel) {
  for (int i = 0; i < r->ap.list.count; i++) {
    const char *name = r->ap.list.p[i].name, *tail = strrchr(name, '/');
    if (tail && strcmp(tail + 1, rel) == 0) return r->ap.list.p[i].numel;
  }
  return 0;
}

/* The oracle of head (b, h), with this run's parameters. */
static struct oracle oracle_for(const struct config *cfg, const struct run *r, long h, long n,
                                long d, bool causal, double **keep) {
  struct oracle o = {.causal = causal, .n = n, .d = d};
  const char *v = cfg->attention.variant;
  if (strcmp(v, "linear") == 0) {
    o.kind = O_LINEAR;
  } else if (strcmp(v, "fmmformer") == 0) {
    o.kind = O_FMM;
    o.band = cfg->attention.fmmformer_band;
    char buf[CONFIG_STR];
    snprintf(buf, sizeof buf, "%s", cfg->attention.fmmformer_kernels);
    for (char *s = NULL, *t = strtok_r(buf, ",", &s); t; t = strtok_r(NULL, ",", &s))
      snprintf(o.kernels[o.nk++], 16, "%s", t);
    o.w1 = tensor(r, "w1")[h];
    o.w2 = tensor(r, "w2")[h];
  } else {
    o.kind = O_RMFA;
    o.D = cfg->attention.rmfa_features;
    o.kernel = (int)rmfa_kernel_parse(cfg->attention.rmfa_kernel);
    o.ppsbn = cfg->attention.rmfa_ppsbn;
    o.rows = (int)(tensor_numel(r, "omega") / (size_t)d);
    keep[0] = tu_to_double(tensor(r, "degree"), (size_t)o.D);
    keep[1] = tu_to_double(tensor(r, "omega"), (size_t)o.rows * d);
    o.degree = keep[0];
    o.omega = keep[1];
    if (o.ppsbn) {
      keep[2] = tu_to_double(tensor(r, "gamma") + h * d, (size_t)d);
      o.gamma = keep[2];
    }
  }
  return o;
}

/* ---------------------------------------------------------------------------------------------
 * the ladder */

/* Output and every gradient of one configuration against the oracle and its central differences. */
static void check_case(const char *variant, const char *extra[], long n, long d, bool causal) {
  const long B = 2, H = 2, count = B * H * n * d, nd = n * d;
  struct config cfg;
  tu_config(&cfg, variant, n, (int)H, (int)d, causal, extra);
  float *q = malloc(4 * count), *k = malloc(4 * count), *v = malloc(4 * count),
        *g = malloc(4 * count);
  tu_randn(q, count, 100 + n, 1.0f);
  tu_randn(k, count, 200 + n, 1.0f);
  tu_randn(v, count, 300 + n, 1.0f);
  tu_randn(g, count, 400 + n, 1.0f);
  struct run r = run_op(&cfg, B, q, k, v, g);
  double *o = malloc(8 * count), *dq = malloc(8 * count), *dk = malloc(8 * count),
         *dv = malloc(8 * count);
  /* trainable parameter gradients, by central differences on every head at once */
  double *dpar = calloc(r.ap.list.total + 1, sizeof(double));
  const double h = 1e-5;
  char what[700];
  snprintf(what, sizeof what, "%s%s%s%s n=%ld d=%ld %s", variant, extra && extra[0] ? " " : "",
           extra && extra[0] ? extra[0] : "", extra && extra[0] && extra[1] ? " ..." : "", n, d,
           causal ? "causal" : "bidir");
  for (long bh = 0; bh < B * H; bh++) {
    double *keep[3] = {NULL, NULL, NULL};
    struct oracle orc = oracle_for(&cfg, &r, bh % H, n, d, causal, keep);
    const size_t off = (size_t)(bh * nd);
    double *qd = tu_to_double(q + off, nd), *kd = tu_to_double(k + off, nd),
           *vd = tu_to_double(v + off, nd), *gd = tu_to_double(g + off, nd);
    oracle_head(&orc, o + off, qd, kd, vd);
    for (long e = 0; e < nd; e++) {
      TU_FD(dq[off + e], qd, e, h, oracle_dot(&orc, gd, qd, kd, vd));
      TU_FD(dk[off + e], kd, e, h, oracle_dot(&orc, gd, qd, kd, vd));
      TU_FD(dv[off + e], vd, e, h, oracle_dot(&orc, gd, qd, kd, vd));
    }
    /* this head's share of the gradient of its parameters (w1, w2 or gamma rows) */
    for (int i = 0; i < r.ap.list.count; i++) {
      const struct param_desc *p = &r.ap.list.p[i];
      if (p->frozen) continue;
      const char *tail = strrchr(p->name, '/') + 1;
      double *slot = NULL;
      long width = 1;
      if (strcmp(tail, "w1") == 0) slot = &orc.w1;
      if (strcmp(tail, "w2") == 0) slot = &orc.w2;
      if (strcmp(tail, "gamma") == 0) width = d;
      for (long c = 0; c < width; c++) {
        double fd;
        if (slot) {
          TU_FD(fd, slot, 0, h, oracle_dot(&orc, gd, qd, kd, vd));
          dpar[p->offset + bh % H] += fd;
        } else {
          double *gam = (double *)orc.gamma;
          TU_FD(fd, gam, c, h, oracle_dot(&orc, gd, qd, kd, vd));
          dpar[p->offset + (bh % H) * d + c] += fd;
        }
      }
    }
    free(qd);
    free(kd);
    free(vd);
    free(gd);
    for (int i = 0; i < 3; i++) free(keep[i]);
  }
  TU_ASSERT_CLOSE(tu_rel_err(r.t.out, o, count), 1e-5, what);
  char w2[900];
  snprintf(w2, sizeof w2, "%s: dq", what);
  TU_ASSERT_CLOSE(tu_rel_err(r.t.dq, dq, count), 1e-4, w2);
  snprintf(w2, sizeof w2, "%s: dk", what);
  TU_ASSERT_CLOSE(tu_rel_err(r.t.dk, dk, count), 1e-4, w2);
  snprintf(w2, sizeof w2, "%s: dv", what);
  TU_ASSERT_CLOSE(tu_rel_err(r.t.dv, dv, count), 1e-4, w2);
  int trainable = 0;
  for (int i = 0; i < r.ap.list.count; i++) {
    const struct param_desc *p = &r.ap.list.p[i];
    if (p->frozen) {
      for (size_t e = 0; e < p->numel; e++)
        if (r.ap.dparams[p->offset + e] != 0.0f)
          fail_msg("%s: frozen %s got a gradient", what, p->name);
      continue;
    }
    trainable++;
    snprintf(w2, sizeof w2, "%s: d%s", what, p->name);
    TU_ASSERT_CLOSE(tu_rel_err(r.ap.dparams + p->offset, dpar + p->offset, p->numel), 1e-4, w2);
  }
  const bool expect = strcmp(variant, "fmmformer") == 0 ||
                      (strcmp(variant, "rmfa") == 0 && cfg.attention.rmfa_ppsbn);
  if (expect != (trainable > 0)) fail_msg("%s: %d trainable parameters", what, trainable);
  free_run(&r);
  free(dpar);
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

static void test_linear(void **state) {
  const long sizes[] = {2, 7, 64, 70, 130};
  for (int c = 0; c < 2; c++) {
    for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++)
      check_case("linear", NULL, sizes[s], 4, c);
    check_case("linear", NULL, 40, 8, c);
  }
}

static void test_fmmformer(void **state) {
  const char *a[] = {"attention.fmmformer.kernels=elu", "attention.fmmformer.band=5", NULL};
  const char *b[] = {"attention.fmmformer.kernels=elu,elu_neg,tanh", "attention.fmmformer.band=1",
                     NULL};
  const char *c[] = {"attention.fmmformer.kernels=tanh", "attention.fmmformer.band=200", NULL};
  const char *e[] = {"attention.fmmformer.kernels=elu_neg,tanh", "attention.fmmformer.band=16",
                     NULL};
  for (int causal = 0; causal < 2; causal++) {
    check_case("fmmformer", a, 70, 4, causal);
    check_case("fmmformer", b, 70, 4, causal);
    check_case("fmmformer", c, 33, 4, causal);
    check_case("fmmformer", e, 130, 4, causal);
    check_case("fmmformer", b, 40, 8, causal);
  }
}

static void test_rmfa(void **state) {
  const char *kernels[] = {"exp", "inv", "log", "trigh", "sqrt"};
  char kopt[64];
  for (int causal = 0; causal < 2; causal++) {
    for (int i = 0; i < 5; i++) {
      snprintf(kopt, sizeof kopt, "attention.rmfa.kernel=%s", kernels[i]);
      const char *x[] = {kopt, "attention.rmfa.features=16", NULL};
      check_case("rmfa", x, 70, 4, causal);
    }
    const char *off[] = {"attention.rmfa.ppsbn=false", "attention.rmfa.features=8", NULL};
    check_case("rmfa", off, 33, 4, causal);
    const char *two[] = {"attention.rmfa.features=2", NULL};
    check_case("rmfa", two, 20, 4, causal);
    const char *wide[] = {"attention.rmfa.features=64", "attention.rmfa.kernel=inv", NULL};
    check_case("rmfa", wide, 33, 8, causal);
    /* past the feature map's block of 128 rows, where its forward scratch is reused */
    const char *long_[] = {"attention.rmfa.features=8", "attention.rmfa.kernel=log", NULL};
    check_case("rmfa", long_, 140, 4, causal);
  }
}

/* v ≡ 1: linear gives exactly 1 (every weight is positive), fmmformer σ(w1) + nk·σ(w2). */
static void test_unit_values(void **state) {
  const long B = 1, H = 2, n = 150, d = 8, count = B * H * n * d;
  float *q = malloc(4 * count), *k = malloc(4 * count), *v = malloc(4 * count);
  tu_randn(q, count, 1, 1.5f);
  tu_randn(k, count, 2, 1.5f);
  for (long i = 0; i < count; i++) v[i] = 1.0f;
  for (int causal = 0; causal < 2; causal++) {
    struct config cfg;
    tu_config(&cfg, "linear", n, (int)H, (int)d, causal, NULL);
    struct run r = run_op(&cfg, B, q, k, v, NULL);
    for (long i = 0; i < count; i++)
      if (fabsf(r.t.out[i] - 1.0f) > 1e-6f)
        fail_msg("linear v = 1: out[%ld] = %.9g", i, r.t.out[i]);
    free_run(&r);
    config_free(&cfg);
    const char *x[] = {"attention.fmmformer.kernels=elu,tanh", "attention.fmmformer.band=9", NULL};
    tu_config(&cfg, "fmmformer", n, (int)H, (int)d, causal, x);
    r = run_op(&cfg, B, q, k, v, NULL);
    for (long i = 0; i < count; i++) {
      const long h = i / (n * d) % H;
      const double want = sig(tensor(&r, "w1")[h]) + 2 * sig(tensor(&r, "w2")[h]);
      if (fabs(r.t.out[i] - want) > 1e-6 * want)
        fail_msg("fmmformer v = 1: out[%ld] = %.9g, want %.9g", i, r.t.out[i], want);
    }
    free_run(&r);
    config_free(&cfg);
  }
  free(q);
  free(k);
  free(v);
}

/* Causality by perturbation (testutil.c), on trained-looking parameters: outputs before position
 * j do not move when q, k, v at j move, and output j does (clm mode). */
static void check_causality(const char *variant, const char *extra[]) {
  const long B = 1, H = 2, n = 150, d = 8, count = B * H * n * d;
  struct config cfg;
  tu_config(&cfg, variant, n, (int)H, (int)d, true, extra);
  float *q = malloc(4 * count), *k = malloc(4 * count), *v = malloc(4 * count);
  tu_randn(q, count, 11, 1.0f);
  tu_randn(k, count, 12, 1.0f);
  tu_randn(v, count, 13, 1.0f);
  struct attn_params ap;
  make_params(&ap, &cfg);
  struct attn_ctx ctx = tu_attn_open(&cfg, B);
  const long at[] = {0, 63, 64, 100, 149};
  const struct tu_probe probe = {at, sizeof at / sizeof at[0], TU_MOVE_QKV, false};
  if (tu_causality(&ctx, ap.list.count ? ap.params : NULL, q, k, v, &probe, variant))
    fail_msg("%s: causality probes failed (listed above)", variant);
  attention_close(&ctx);
  attention_params_free(&ap);
  free(q);
  free(k);
  free(v);
  config_free(&cfg);
}

static void test_causality(void **state) {
  check_causality("linear", NULL);
  const char *f[] = {"attention.fmmformer.kernels=elu,elu_neg,tanh", "attention.fmmformer.band=7",
                     NULL};
  check_causality("fmmformer", f);
  check_causality("rmfa", NULL);
  const char *r[] = {"attention.rmfa.kernel=sqrt", "attention.rmfa.ppsbn=false", NULL};
  check_causality("rmfa", r);
}

/* The kernels of SPEC §6.8 in closed form (the sums of their Maclaurin series), written here
 * apart from rmfa.c: exp and trigh e^t, inv 1/(1 − t), log 1 − ln(1 − t), sqrt 2 − √(1 − t). */
static double exact_kernel(int kernel_index, double t) {
  switch (kernel_index) {
    case 1:
      return 1.0 / (1.0 - t);
    case 2:
      return 1.0 - log(1.0 - t);
    case 4:
      return 2.0 - sqrt(1.0 - t);
    default:
      return exp(t);
  }
}

/* Mean |Φ(x)·Φ(y) − K(x̂·ŷ)| over random pairs, for D features drawn with `seed`. */
static double feature_error(int D, int kernel_index, uint64_t seed) {
  const char *kernels[] = {"exp", "inv", "log", "trigh", "sqrt"};
  const int d = 16, pairs = 256;
  char o1[64], o2[64], o3[64];
  snprintf(o1, sizeof o1, "attention.rmfa.features=%d", D);
  snprintf(o2, sizeof o2, "attention.rmfa.kernel=%s", kernels[kernel_index]);
  snprintf(o3, sizeof o3, "run.seed=%llu", (unsigned long long)seed);
  const char *x[] = {o1, o2, o3, NULL};
  struct config cfg;
  tu_config(&cfg, "rmfa", 64, 1, d, false, x);
  struct attn_params ap;
  attention_params_make(&ap, &cfg, attention_find("rmfa"), 64);
  struct rmfa_features rf;
  const struct rmfa_options ro = rmfa_options_read(&cfg);
  rmfa_features_open(&rf, &ro, ap.params, d);
  struct kz_map map = rmfa_map(&rf);
  float *rows = malloc(sizeof(float) * 2 * pairs * d), *phi = malloc(sizeof(float) * 2 * pairs * D);
  float *scratch = malloc(sizeof(float) * (map.scratch_floats + 1));
  tu_randn(rows, (size_t)(2 * pairs * d), 7000 + seed, 1.0f);
  kz_features(&map, phi, rows, 2 * pairs, scratch);
  double err = 0;
  for (int p = 0; p < pairs; p++) {
    double est = 0, xs[16], ys[16], xh = 0;
    for (int f = 0; f < D; f++) est += (double)phi[(2 * p) * D + f] * phi[(2 * p + 1) * D + f];
    /* x̂·ŷ: the SPEC's inputs (unit rows over d^¼), formed here independently */
    for (int c = 0; c < d; c++) {
      xs[c] = rows[(2 * p) * d + c];
      ys[c] = rows[(2 * p + 1) * d + c];
    }
    double mx = 0, my = 0, vx = 0, vy = 0; /* vx, vy: sums of squared deviations */
    for (int c = 0; c < d; c++) mx += xs[c] / d, my += ys[c] / d;
    for (int c = 0; c < d; c++)
      vx += (xs[c] - mx) * (xs[c] - mx), vy += (ys[c] - my) * (ys[c] - my);
    for (int c = 0; c < d; c++) xh += (xs[c] - mx) / sqrt(vx) * (ys[c] - my) / sqrt(vy);
    xh /= sqrt((double)d); /* unit rows over d^¼ each */
    err += fabs(est - exact_kernel(kernel_index, xh));
  }
  free(rows);
  free(phi);
  free(scratch);
  rmfa_features_close(&rf);
  attention_params_free(&ap);
  config_free(&cfg);
  return err / pairs;
}

/* The estimate is unbiased with variance ∝ 1/D: its mean error falls as D^−½. Averaged over
 * four seeds per D; each D's error, scaled by √D, must stay within a factor 2 of D = 16's. */
static void test_rmfa_convergence(void **state) {
  const int Ds[] = {16, 64, 256, 1024, 4096};
  for (int kernel = 0; kernel < 5; kernel++) {
    double base = 0;
    for (size_t i = 0; i < sizeof Ds / sizeof Ds[0]; i++) {
      double e = 0;
      for (uint64_t seed = 1; seed <= 4; seed++) e += feature_error(Ds[i], kernel, seed) / 4;
      const double scaled = e * sqrt((double)Ds[i]);
      if (i == 0) base = scaled;
      print_message("# rmfa kernel %d D %5d: mean |error| %.4e, x sqrt(D) %.4f\n", kernel, Ds[i], e,
                    scaled);
      if (!(scaled < 2 * base && scaled > base / 2))
        fail_msg("kernel %d: error at D = %d is %.3e, not within 2x of D^-1/2 from D = 16 (%.3e)",
                 kernel, Ds[i], e, base / sqrt((double)Ds[i]));
    }
  }
}

/* attn/rmfa/{degree [D], omega [Σ N, d]} are frozen; gamma [H, d] is trainable and starts at 1;
 * the degrees lie in [1, 20] and follow the seed, omega is ±1. */
static void test_rmfa_tensors(void **state) {
  const char *x[] = {"attention.rmfa.features=32", NULL};
  struct config cfg;
  tu_config(&cfg, "rmfa", 64, 2, 8, true, x);
  struct param_list list;
  param_list_init(&list);
  attention_register_params(&cfg, attention_find("rmfa"), 64, 3, &list);
  assert_int_equal(list.count, 3);
  assert_string_equal(list.p[0].name, "layer_003/attn/rmfa/degree");
  assert_true(list.p[0].frozen);
  assert_int_equal(list.p[0].shape[0], 32);
  assert_string_equal(list.p[1].name, "layer_003/attn/rmfa/omega");
  assert_true(list.p[1].frozen);
  assert_int_equal(list.p[1].shape[1], 8);
  assert_string_equal(list.p[2].name, "layer_003/attn/rmfa/gamma");
  assert_false(list.p[2].frozen);
  float *buf = calloc(list.total, sizeof(float));
  long rows = 0;
  for (int i = 0; i < list.count; i++)
    attention_init_param(&cfg, attention_find("rmfa"), &list.p[i], buf + list.p[i].offset);
  for (long j = 1; j < 32; j++) {
    const float N = buf[list.p[0].offset + j];
    assert_true(N >= 1 && N <= 20 && N == floorf(N));
    rows += (long)N;
  }
  assert_int_equal(rows, list.p[1].shape[0]);
  for (size_t e = 0; e < list.p[1].numel; e++)
    assert_true(fabsf(buf[list.p[1].offset + e]) == 1.0f);
  for (size_t e = 0; e < list.p[2].numel; e++) assert_true(buf[list.p[2].offset + e] == 1.0f);
  free(buf);
  param_list_free(&list);
  config_free(&cfg);
}

static const struct CMUnitTest tests[] = {
    cmocka_unit_test(test_linear),       cmocka_unit_test(test_fmmformer),
    cmocka_unit_test(test_rmfa),         cmocka_unit_test(test_unit_values),
    cmocka_unit_test(test_causality),    cmocka_unit_test(test_rmfa_convergence),
    cmocka_unit_test(test_rmfa_tensors),
};

TU_MAIN(tests)
