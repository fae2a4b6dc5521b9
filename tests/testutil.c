/* The shared helpers of testutil.h that are more than a line: configurations through the deck
 * loader, one attention op run, the float64 dense softmax-attention reference and the causality
 * probe. Test code only; it reads nothing of an op's internals, only its ops table. */
#include "testutil.h"

const char *tu_fmt(const char *fmt, ...) {
  enum { LEN = 192 };
  static char pool[TU_FMT_POOL][LEN];
  static unsigned next;
  char *s = pool[next++ % TU_FMT_POOL];
  va_list ap;
  va_start(ap, fmt);
  const int len = vsnprintf(s, LEN, fmt, ap);
  va_end(ap);
  if (len < 0 || len >= LEN) {
    fprintf(stderr, "tu_fmt: \"%s\" does not fit in %d bytes\n", fmt, LEN);
    abort();
  }
  return s;
}

int tu_config_try(struct config *cfg, const char *variant, long n, int H, int d, bool causal,
                  const char *const sets[], char *err, size_t err_len) {
  char common[5][96]; /* the caller's sets may be tu_fmt strings: none is used here */
  struct config_overrides ov = {0};
  int c = 0;
  snprintf(common[c++], sizeof common[0], "attention.variant=%s", variant);
  snprintf(common[c++], sizeof common[0], "model.context=%ld", n);
  if (H > 0) {
    snprintf(common[c++], sizeof common[0], "model.heads=%d", H);
    snprintf(common[c++], sizeof common[0], "model.dim=%ld", (long)H * d);
  }
  snprintf(common[c++], sizeof common[0], "model.objective=%s", causal ? "clm" : "mlm");
  for (int i = 0; i < c; i++) ov.items[ov.count++] = common[i];
  ov.items[ov.count++] = "data.source=copy";
  const int max = (int)(sizeof ov.items / sizeof ov.items[0]);
  for (int i = 0; sets && sets[i]; i++) {
    if (ov.count == max) {
      snprintf(err, err_len, "tu_config: more than %d overrides", max);
      return 1;
    }
    ov.items[ov.count++] = sets[i];
  }
  return config_load(cfg, NULL, &ov, err, err_len);
}

void tu_config(struct config *cfg, const char *variant, long n, int H, int d, bool causal,
               const char *const sets[]) {
  char err[CONFIG_ERR_LEN];
  if (tu_config_try(cfg, variant, n, H, d, causal, sets, err, sizeof err))
    fail_msg("config (%s, n = %ld): %s", variant, n, err);
}

struct attn_ctx tu_attn_open(const struct config *cfg, long B) {
  const struct attn_variant *var = attention_select(cfg);
  if (!var) fail_msg("attention variant %s: none registered", cfg->attention.variant);
  const long n = cfg->model.context, H = cfg->model.heads, d = cfg->model.dim / H;
  const bool causal = cfg->model.objective == OBJECTIVE_CLM;
  return attention_open(cfg, var, DEVICE_CPU, NULL, 0,
                        (struct attn_dims){B, H, n, d, n, 0, causal});
}

struct tu_run tu_attn_run(struct attn_ctx *ctx, const float *params, float *dparams, const float *q,
                          const float *k, const float *v, const float *dout) {
  const struct attn_dims *D = &ctx->dims;
  const size_t count = (size_t)(D->B * D->H * D->T * D->d);
  const size_t qcount = (size_t)(D->B * ctx->opt.qk_heads * D->T * D->d);
  struct tu_run r = {calloc(count, 4), calloc(qcount, 4), calloc(qcount, 4), calloc(count, 4)};
  float *saved = calloc(attention_saved_floats(ctx) + 1, sizeof(float));
  attention_forward(ctx, r.out, saved, q, k, v, params);
  if (dout) attention_backward(ctx, r.dq, r.dk, r.dv, dparams, dout, q, k, v, params, r.out, saved);
  free(saved);
  return r;
}

void tu_run_free(struct tu_run *r) {
  free(r->out);
  free(r->dq);
  free(r->dk);
  free(r->dv);
}

/* ---------------------------------------------------------------------------------------------
 * the dense reference */

bool tu_mask_allowed(long i, long j, const void *mask) {
  const struct tu_mask *m = mask;
  if (m->causal && j > i) return false;
  return m->band <= 0 || labs(i - j) < m->band;
}

void tu_softmax_rows(double *P, const double *L, long rows, long cols) {
  for (long i = 0; i < rows; i++) {
    const double *l = L + i * cols;
    double *p = P + i * cols, mx = -INFINITY, z = 0.0;
    for (long j = 0; j < cols; j++) mx = l[j] > mx ? l[j] : mx;
    for (long j = 0; j < cols; j++) z += p[j] = l[j] == -INFINITY ? 0.0 : exp(l[j] - mx);
    for (long j = 0; j < cols; j++) p[j] /= z;
  }
}

void tu_dense_softmax(double *out, double *dL, double *dv, const double *L, const double *v,
                      const double *dout, long n, long nk, long d) {
  double *P = malloc(sizeof(double) * (size_t)(n * nk)); /* (n, nk) probabilities */
  tu_softmax_rows(P, L, n, nk);
  for (long i = 0; i < n; i++)
    for (long c = 0; c < d; c++) {
      double s = 0.0;
      for (long j = 0; j < nk; j++) s += P[i * nk + j] * v[j * d + c];
      out[i * d + c] = s;
    }
  if (dout) { /* dL_ij = P_ij (dout_i·v_j − dout_i·out_i), dv_j = Σ_i P_ij dout_i */
    memset(dv, 0, sizeof(double) * (size_t)(nk * d));
    for (long i = 0; i < n; i++) {
      double Di = 0.0;
      for (long c = 0; c < d; c++) Di += dout[i * d + c] * out[i * d + c];
      for (long j = 0; j < nk; j++) {
        const double p = P[i * nk + j];
        double dp = 0.0;
        for (long c = 0; c < d; c++) {
          dp += dout[i * d + c] * v[j * d + c];
          dv[j * d + c] += p * dout[i * d + c];
        }
        if (dL) dL[i * nk + j] = p * (dp - Di);
      }
    }
  }
  free(P);
}

void tu_dense_attention(double *out, double *dq, double *dk, double *dv, const double *q,
                        const double *k, const double *v, const double *dout, long n, long d,
                        tu_allowed_fn allowed, const void *user) {
  const double scale = 1.0 / sqrt((double)d);
  double *L = calloc((size_t)(n * n), sizeof(double)); /* (n, n) logits */
  for (long i = 0; i < n; i++)
    for (long j = 0; j < n; j++) {
      L[i * n + j] = -INFINITY;
      if (!allowed(i, j, user)) continue;
      double s = 0.0;
      for (long c = 0; c < d; c++) s += q[i * d + c] * k[j * d + c];
      L[i * n + j] = s * scale;
    }
  double *dL = dout ? malloc(sizeof(double) * (size_t)(n * n)) : NULL;
  tu_dense_softmax(out, dL, dv, L, v, dout, n, n, d);
  if (dout) {
    memset(dq, 0, sizeof(double) * (size_t)(n * d));
    memset(dk, 0, sizeof(double) * (size_t)(n * d));
    for (long i = 0; i < n; i++)
      for (long j = 0; j < n; j++) {
        const double ds = dL[i * n + j] * scale;
        if (ds == 0.0) continue;
        for (long c = 0; c < d; c++) {
          dq[i * d + c] += ds * k[j * d + c];
          dk[j * d + c] += ds * q[i * d + c];
        }
      }
  }
  free(L);
  free(dL);
}

/* ---------------------------------------------------------------------------------------------
 * the causality probe */

/* x (rows, n, d) += by at positions [j, end) of every row. */
static void move(float *x, long rows, long n, long d, long j, long end, float by) {
  for (long r = 0; r < rows; r++)
    for (long i = j; i < end; i++)
      for (long c = 0; c < d; c++) x[(r * n + i) * d + c] += by;
}

int tu_causality_fn(tu_forward_fn forward, void *user, const struct tu_heads *s, const float *q,
                    const float *k, const float *v, const struct tu_probe *probe,
                    const char *what) {
  const long n = s->n, d = s->d, BHq = s->B * s->Hqk, BH = s->B * s->H;
  const size_t nq = (size_t)(BHq * n * d), nv = (size_t)(BH * n * d);
  float *base = malloc(4 * nv), *out = malloc(4 * nv);
  float *q2 = malloc(4 * nq), *k2 = malloc(4 * nq), *v2 = malloc(4 * nv);
  forward(user, base, q, k, v);
  int failed = 0;
  for (int p = 0; p < probe->count; p++) {
    const long j = probe->at[p], end = probe->to_end ? n : j + 1;
    if (j < 0 || j >= n) {
      print_message("# %s: probe position %ld outside [0, %ld)\n", what, j, n);
      failed++;
      continue;
    }
    memcpy(q2, q, 4 * nq);
    memcpy(k2, k, 4 * nq);
    memcpy(v2, v, 4 * nv);
    if (probe->moves & TU_MOVE_Q) move(q2, BHq, n, d, j, end, 3.0f);
    if (probe->moves & TU_MOVE_K) move(k2, BHq, n, d, j, end, -2.0f);
    if (probe->moves & TU_MOVE_V) move(v2, BH, n, d, j, end, 5.0f);
    forward(user, out, q2, k2, v2);
    long leak = -1, blind = -1; /* the first earlier output that moved, the first head that not */
    for (long bh = 0; bh < BH; bh++) {
      const float *a = base + bh * n * d, *b = out + bh * n * d;
      for (long i = 0; i < j && leak < 0; i++)
        if (memcmp(a + i * d, b + i * d, 4 * (size_t)d) != 0) leak = i;
      if (blind < 0 && memcmp(a + j * d, b + j * d, 4 * (size_t)d) == 0) blind = bh;
    }
    const char *moved = probe->moves == TU_MOVE_QKV ? "q, k, v" : "inputs";
    if (leak >= 0) {
      print_message("# CAUSALITY %s: output %ld changed when the %s at position %ld%s moved\n",
                    what, leak, moved, j, probe->to_end ? " and after" : "");
      failed++;
    }
    if (blind >= 0) {
      print_message(
          "# %s: moving the %s at position %ld left output %ld of head %ld as it was: the probe "
          "could not see a leak there\n",
          what, moved, j, j, blind);
      failed++;
    }
  }
  free(base), free(out), free(q2), free(k2), free(v2);
  return failed;
}

struct ctx_forward {
  struct attn_ctx *ctx;
  const float *params;
  float *saved;
};

static void ctx_forward(void *user, float *out, const float *q, const float *k, const float *v) {
  struct ctx_forward *f = user;
  attention_forward(f->ctx, out, f->saved, q, k, v, f->params);
}

int tu_causality(struct attn_ctx *ctx, const float *params, const float *q, const float *k,
                 const float *v, const struct tu_probe *probe, const char *what) {
  if (!ctx->dims.causal) fail_msg("%s: the causality probe needs a causal context", what);
  struct ctx_forward f = {ctx, params, calloc(attention_saved_floats(ctx) + 1, sizeof(float))};
  const struct tu_heads shape = {ctx->dims.B, ctx->opt.qk_heads, ctx->dims.H, ctx->dims.T,
                                 ctx->dims.d};
  const int failed = tu_causality_fn(ctx_forward, &f, &shape, q, k, v, probe, what);
  free(f.saved);
  return failed;
}

bool tu_gpu_begin(int *argc, char ***argv, const char *name, tu_gpu_open_fn open, bool emulated,
                  int *rc) {
  MPI_Init(argc, argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  *rc = 1;
  if (rank != 0 && !freopen("/dev/null", "w", stdout)) return false; /* one TAP stream */
  char err[256];
  if (open(err, sizeof err) != 0) {
    err[strcspn(err, "\n")] = '\0';
    if (emulated) {
      fprintf(stderr, "%s_emu: no emulated device: %s\n", name, err);
      return false;
    }
    printf("1..0 # SKIP no GPU: %s\n", err); /* TAP's skip-all plan, with the reason */
    MPI_Finalize();
    *rc = 0;
    return false;
  }
  cmocka_set_message_output(CM_OUTPUT_TAP);
  const char *filter = getenv(emulated ? "CUDAEMU_TEST_FILTER" : "FMATTN_TEST_FILTER");
  if (filter && *filter) cmocka_set_test_filter(filter);
  *rc = 0;
  return true;
}

int tu_gpu_end(int rc, void (*close)(void), size_t (*leaked)(void)) {
  close();
  const size_t left = leaked ? leaked() : 0;
  if (left) {
    fprintf(stderr, "cudaemu: %zu bytes of device memory still allocated at exit\n", left);
    if (!rc) rc = 1;
  }
  MPI_Finalize();
  return rc;
}
