/* `run.mode = bench` (SPEC §11): measures this machine's SGEMM rate, then times attention
 * forward+backward and whole training steps over bench.n_list, reporting medians, achieved
 * GFLOP/s against the SGEMM rate measured in the same run, workspace and bytes communicated. It
 * prints a table and writes runs/<name>/bench.h5. Figures, never pass/fail: that is the tests'. */
#include "bench.h"

#include <cblas.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attention/attention.h"
#include "data.h"
#include "error.h"
#include "h5io.h"
#include "memory.h"
#include "model.h"
#include "optimizer.h"
#include "rng.h"
#include "threads.h"
#include "timer.h"
#include "train.h"

#define BENCH_ROWS 256
/* Skip a measurement whose estimated time per repetition (at half the SGEMM rate) exceeds this
 * many seconds. */
#define BENCH_MAX_SECONDS 300.0

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static double median(double *v, int n) {
  qsort(v, (size_t)n, sizeof(double), cmp_double);
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* SGEMM rate of this rank with its threads (median of 7 products of 2048² × 2048). */
double bench_sgemm_gflops(void) {
  const int N = 2048;
  float *a = mem_alloc(MEM_WORKSPACE, sizeof(float) * N * N);
  float *b = mem_alloc(MEM_WORKSPACE, sizeof(float) * N * N);
  float *c = mem_alloc(MEM_WORKSPACE, sizeof(float) * N * N);
  for (long i = 0; i < (long)N * N; i++) {
    a[i] = rng_uniform(1, RNG_TEST, 1, (uint64_t)i, 0) - 0.5f;
    b[i] = rng_uniform(1, RNG_TEST, 2, (uint64_t)i, 0) - 0.5f;
  }
  double t[7];
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, N, N, 1.0f, a, N, b, N, 0.0f, c, N);
  for (int r = 0; r < 7; r++) {
    double t0 = timer_now();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, N, N, 1.0f, a, N, b, N, 0.0f, c, N);
    t[r] = timer_now() - t0;
  }
  double s = median(t, 7);
  mem_free(a);
  mem_free(b);
  mem_free(c);
  return 2.0 * N * (double)N * N / s / 1e9;
}

/* ---------------------------------------------------------------------------------------------
 * attention */

/* The rows of bench.h5's tables: text columns first, then numbers (written as doubles). */
struct attn_row {
  char variant[64];
  char downsample[64]; /* the variant's option label (fma: conv, m2m or avg); "-" otherwise */
  double n, heads, head_dim, causal;
  double fwd_ms, bwd_ms, workspace_bytes, gflops, p2p_gflops;
};

static void fill_normal(float *x, size_t count, uint64_t key) {
#pragma omp parallel for schedule(static)
  for (size_t i = 0; i < count; i++) x[i] = (float)rng_normal(7, RNG_TEST, key, i, 0);
}

/* Configuration for one measurement: the deck with variant and context replaced. */
static int bench_config(const struct config *base, const char *variant, long n, int seq_ranks,
                        struct config *cfg, char *err, size_t len) {
  *cfg = *base;
  snprintf(cfg->attention.variant, sizeof cfg->attention.variant, "%s", variant);
  cfg->model.context = (int)n;
  return attention_check(cfg, n, seq_ranks, err, len);
}

/* bench_config, and where the variant refuses it, its fallback (fma: conv parameters that would
 * not fit become m2m, as SPEC §6.4 says). */
static int bench_variant_config(const struct config *base, const char *variant, long n,
                                int seq_ranks, struct config *cfg, char *err, size_t len) {
  int bad = bench_config(base, variant, n, seq_ranks, cfg, err, len);
  const struct attn_variant *v = attention_find(variant);
  struct config alt = *base;
  if (bad && v && v->fallback && v->fallback(&alt) &&
      !bench_config(&alt, variant, n, seq_ranks, cfg, err, len)) {
    const char *label = v->option_label ? v->option_label(cfg) : "";
    message("  %-10s n = %8ld: the deck's configuration would not run; using its fallback %s",
            variant, n, label);
    bad = 0;
  }
  return bad;
}

static bool bench_attention_one(const struct config *cfg, long n, int repeats, double sgemm,
                                struct attn_row *row) {
  const struct attn_variant *v = attention_select(cfg);
  const long B = cfg->bench.batch, H = cfg->model.heads, d = cfg->model.dim / cfg->model.heads;
  struct attn_ctx ctx =
      attention_open(cfg, v, DEVICE_CPU, NULL, 0,
                     (struct attn_dims){B, H, n, d, n, 0, cfg->model.objective == OBJECTIVE_CLM});
  double p2p = 0.0, flops = v->flops(&ctx, &p2p);
  double est = 3.0 * flops / (0.5 * sgemm * 1e9);
  if (est > BENCH_MAX_SECONDS) {
    message("  %-10s n = %8ld: skipped (estimated %.0f s per repetition)", v->name, n, est);
    attention_close(&ctx);
    return false;
  }
  const size_t count = (size_t)(B * H * n * d),
               qcount = (size_t)(B * attention_qk_heads(cfg) * n * d);
  float *q = mem_alloc(MEM_DATA, sizeof(float) * qcount),
        *k = mem_alloc(MEM_DATA, sizeof(float) * qcount);
  float *vv = mem_alloc(MEM_DATA, sizeof(float) * count),
        *dout = mem_alloc(MEM_DATA, sizeof(float) * count);
  float *out = mem_alloc(MEM_DATA, sizeof(float) * count),
        *dq = mem_alloc(MEM_DATA, sizeof(float) * qcount);
  float *dk = mem_alloc(MEM_DATA, sizeof(float) * qcount),
        *dv = mem_alloc(MEM_DATA, sizeof(float) * count);
  fill_normal(q, qcount, 1);
  fill_normal(k, qcount, 2);
  fill_normal(vv, count, 3);
  fill_normal(dout, count, 4);
  struct attn_params ap;
  attention_params_make(&ap, cfg, v, n);
  const float *pp = ap.list.count ? ap.params : NULL;
  float *dpp = ap.list.count ? ap.dparams : NULL;
  size_t saved_n = attention_saved_floats(&ctx);
  float *saved = mem_alloc(MEM_ACTIVATIONS, sizeof(float) * (saved_n + 1));

  const size_t ws0 = mem_current(MEM_WORKSPACE);
  mem_reset_peak(MEM_WORKSPACE);
  double *tf = xmalloc(sizeof(double) * (size_t)repeats),
         *tb = xmalloc(sizeof(double) * (size_t)repeats);
  double p2p_ms = 0.0;
  for (int r = -1; r < repeats; r++) { /* r = −1: warm-up */
    double p0 = timer_total_ms(TIMER_P2P);
    double t0 = timer_now();
    attention_forward(&ctx, out, saved, q, k, vv, pp);
    double t1 = timer_now();
    memset(dq, 0, sizeof(float) * qcount);
    memset(dk, 0, sizeof(float) * qcount);
    memset(dv, 0, sizeof(float) * count);
    double t1b = timer_now();
    attention_backward(&ctx, dq, dk, dv, dpp, dout, q, k, vv, pp, out, saved);
    double t2 = timer_now();
    if (r >= 0) {
      tf[r] = 1e3 * (t1 - t0);
      tb[r] = 1e3 * (t2 - t1b);
      p2p_ms += timer_total_ms(TIMER_P2P) - p0;
    }
  }
  snprintf(row->variant, sizeof row->variant, "%s%s", v->name,
           cfg->attention.heads_mode == HEADS_FISH ? "+fish" : "");
  snprintf(row->downsample, sizeof row->downsample, "%s",
           v->option_label ? v->option_label(cfg) : "-");
  row->n = n;
  row->heads = H;
  row->head_dim = d;
  row->causal = ctx.dims.causal;
  row->fwd_ms = median(tf, repeats);
  row->bwd_ms = median(tb, repeats);
  row->workspace_bytes = (double)(mem_peak(MEM_WORKSPACE) - ws0);
  row->gflops = 3.0 * flops / ((row->fwd_ms + row->bwd_ms) / 1e3) / 1e9;
  /* The near field runs 2 GEMMs of its size forward and 5 backward (scores again, dV, dP, dQ,
   * dK): 3.5 × the forward's executed FLOPs. Its timer sums the threads' seconds, and the threads
   * run it side by side, so the rate of the whole rank is FLOPs / (thread-seconds / threads). */
  row->p2p_gflops =
      p2p > 0 && p2p_ms > 0 ? 3.5 * p2p / (p2p_ms / repeats / 1e3 / threads_count()) / 1e9 : NAN;
  free(tf);
  free(tb);
  attention_close(&ctx);
  float *bufs[] = {q, k, vv, dout, out, dq, dk, dv, saved};
  for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) mem_free(bufs[i]);
  attention_params_free(&ap);
  message(
      "  %-10s n = %8ld: fwd %10.2f ms | bwd %10.2f ms | %7.1f GFLOP/s (%4.1f%% of SGEMM) | "
      "workspace %8.2f MiB%s",
      row->variant, n, row->fwd_ms, row->bwd_ms, row->gflops, 100.0 * row->gflops / sgemm,
      row->workspace_bytes / 1048576.0, "");
  if (!isnan(row->p2p_gflops))
    message("  %-10s             near field (P2P): %.1f GFLOP/s (%.1f%% of SGEMM)", "",
            row->p2p_gflops, 100.0 * row->p2p_gflops / sgemm);
  return true;
}

/* ---------------------------------------------------------------------------------------------
 * sequence-parallel attention: traffic and time */

struct comm_row {
  char variant[64];
  double n, seq_ranks, bytes, fwd_ms, bwd_ms;
};

static bool bench_comm_one(const struct config *cfg, struct comm *comm, long n, int repeats,
                           double sgemm, struct comm_row *row) {
  const struct attn_variant *v = attention_select(cfg);
  const long B = cfg->bench.batch, H = cfg->model.heads, d = cfg->model.dim / cfg->model.heads;
  const long S = comm->S, T = n / S, t0 = comm->seq_rank * T;
  struct attn_ctx ctx =
      attention_open(cfg, v, DEVICE_CPU, comm, 0,
                     (struct attn_dims){B, H, T, d, n, t0, cfg->model.objective == OBJECTIVE_CLM});
  double p2p = 0.0, flops = v->flops(&ctx, &p2p);
  /* judge the time by the whole job's FLOPs against the machine's rate (all ranks) */
  MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, &flops, 1, MPI_DOUBLE, MPI_SUM, comm->seq));
  double est = 3.0 * flops / (0.5 * sgemm * 1e9);
  if (est > BENCH_MAX_SECONDS) {
    message("  %-10s n = %8ld: skipped (estimated %.0f s per repetition)", v->name, n, est);
    attention_close(&ctx);
    return false;
  }
  const size_t count = (size_t)(B * H * T * d);
  float *buf = mem_alloc(MEM_DATA, sizeof(float) * count * 8);
  float *q = buf, *k = q + count, *vv = k + count, *g = vv + count, *out = g + count;
  float *dq = out + count, *dk = dq + count, *dv = dk + count;
  /* inputs keyed by global position: the same sequence on any layout */
  for (long bh = 0; bh < B * H; bh++)
    for (long i = 0; i < T * d; i++) {
      const uint64_t key = (uint64_t)((bh * n + t0) * d + i);
      q[bh * T * d + i] = (float)rng_normal(7, RNG_TEST, 1, key, 0);
      k[bh * T * d + i] = (float)rng_normal(7, RNG_TEST, 2, key, 0);
      vv[bh * T * d + i] = (float)rng_normal(7, RNG_TEST, 3, key, 0);
      g[bh * T * d + i] = (float)rng_normal(7, RNG_TEST, 4, key, 0);
    }
  struct attn_params ap;
  attention_params_make(&ap, cfg, v, n);
  const float *pp = ap.list.count ? ap.params : NULL;
  float *dpp = ap.list.count ? ap.dparams : NULL;
  float *saved = mem_alloc(MEM_ACTIVATIONS, sizeof(float) * (attention_saved_floats(&ctx) + 1));
  double *tf = xmalloc(sizeof(double) * (size_t)repeats),
         *tb = xmalloc(sizeof(double) * (size_t)repeats);
  uint64_t bytes = 0;
  for (int r = -1; r < repeats; r++) {
    comm_barrier(comm, COMM_SEQ);
    const uint64_t b0 = comm->bytes_sent;
    double t0s = timer_now();
    attention_forward(&ctx, out, saved, q, k, vv, pp);
    double t1 = timer_now();
    attention_backward(&ctx, dq, dk, dv, dpp, g, q, k, vv, pp, out, saved);
    double t2 = timer_now();
    double t[2] = {t1 - t0s, t2 - t1};
    MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, t, 2, MPI_DOUBLE, MPI_MAX, comm->seq));
    if (r >= 0) {
      tf[r] = 1e3 * t[0];
      tb[r] = 1e3 * t[1];
      bytes = comm->bytes_sent - b0;
    }
  }
  unsigned long long maxbytes = bytes;
  MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, &maxbytes, 1, MPI_UNSIGNED_LONG_LONG, MPI_MAX, comm->seq));
  snprintf(row->variant, sizeof row->variant, "%s", v->name);
  row->n = n;
  row->seq_ranks = (int)S;
  row->bytes = (double)maxbytes;
  row->fwd_ms = median(tf, repeats);
  row->bwd_ms = median(tb, repeats);
  message(
      "  %-10s n = %8ld: %12.0f bytes per rank per layer (%8.2f MiB) | fwd %9.2f ms | bwd "
      "%9.2f ms",
      v->name, n, row->bytes, row->bytes / 1048576.0, row->fwd_ms, row->bwd_ms);
  free(tf);
  free(tb);
  attention_close(&ctx);
  mem_free(buf);
  mem_free(saved);
  attention_params_free(&ap);
  return true;
}

/* ---------------------------------------------------------------------------------------------
 * training steps */

struct train_row {
  double n, tokens_per_s, flops_per_token, mfu, step_ms;
};

static bool bench_train_one(const struct config *cfg, struct comm *comm, int repeats,
                            double machine_gflops, struct train_row *row) {
  struct model m;
  model_build(&m, cfg, comm, cfg->train.batch / comm->D);
  model_init_params(&m);
  const long N = m.B * m.T;
  for (long i = 0; i < N; i++) {
    m.tokens[i] = (int)rng_below(256, cfg->run.seed, RNG_TEST, 11, (uint64_t)i, 0);
    m.targets[i] = (int)rng_below(256, cfg->run.seed, RNG_TEST, 12, (uint64_t)i, 0);
  }
  const double fpt = model_flops_per_token(&m);
  double *ts = xmalloc(sizeof(double) * (size_t)repeats);
  for (int r = -1; r < repeats; r++) {
    comm_barrier(comm, COMM_WORLD);
    double t0 = timer_now();
    model_zero_grads(&m);
    long c;
    model_forward(&m, r + 1, true, 1.0f / (float)(N * comm->world_size), &c);
    model_backward(&m, r + 1);
    model_allreduce_grads(&m);
    double norm = optimizer_grad_norm(&m);
    optimizer_step(&m, r + 2, 1e-4, norm > 1.0 ? (float)(1.0 / norm) : 1.0f);
    double t = timer_now() - t0;
    MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, &t, 1, MPI_DOUBLE, MPI_MAX, comm->world));
    if (r >= 0) ts[r] = t;
  }
  double s = median(ts, repeats);
  free(ts);
  row->n = m.n;
  row->step_ms = 1e3 * s;
  row->tokens_per_s = (double)cfg->train.batch * (double)m.n / s;
  row->flops_per_token = fpt;
  row->mfu = row->tokens_per_s * fpt / (machine_gflops * 1e9);
  message(
      "  train      n = %8ld: step %9.1f ms | %9.0f tok/s | %.1f MFLOP/token | %.1f GFLOP/s = "
      "%.1f%% of SGEMM",
      m.n, row->step_ms, row->tokens_per_s, fpt / 1e6, row->tokens_per_s * fpt / 1e9,
      100.0 * row->mfu);
  model_free(&m);
  return true;
}

/* ---------------------------------------------------------------------------------------------
 * generation: one new token with the decode caches, against recomputing the context */

#define GEN_TIMED 32 /* decode steps timed at the end of the context */

struct gen_row {
  char variant[64];
  double n, decode_ms, recompute_ms; /* per new token; NaN when not measured */
};

static bool bench_generate_one(const struct config *cfg, struct comm *comm, int repeats,
                               double sgemm, struct gen_row *row) {
  struct model m;
  model_build(&m, cfg, NULL, 1); /* one sequence, one rank */
  model_init_params(&m);
  const long n = m.n;
  snprintf(row->variant, sizeof row->variant, "%s", m.attn->name);
  row->n = n;
  row->decode_ms = row->recompute_ms = NAN;
  float *logits = xmalloc(sizeof(float) * (size_t)m.V);
  struct model_decoder dec;
  if (model_decode_open(&m, &dec)) { /* fill the cache to n − GEN_TIMED, then time the rest */
    const long timed = n > 2 * GEN_TIMED ? GEN_TIMED : n / 2, fill = n - timed;
    double *t = xmalloc(sizeof(double) * (size_t)timed);
    for (long pos = 0; pos < n; pos++) {
      const int byte = (int)rng_below(256, cfg->run.seed, RNG_TEST, 13, (uint64_t)pos, 0);
      const double t0 = timer_now();
      model_decode_step(&m, &dec, byte, pos, logits);
      if (pos >= fill) t[pos - fill] = 1e3 * (timer_now() - t0);
    }
    row->decode_ms = median(t, (int)timed);
    free(t);
    model_decode_close(&m, &dec);
  }
  /* recompute: one forward over the context per new token, unless it would take too long */
  const double est = model_flops_per_token(&m) / 3.0 * (double)n / (0.5 * sgemm * 1e9);
  if (est < BENCH_MAX_SECONDS / 10) {
    for (long t = 0; t < n; t++) {
      m.tokens[t] = (int)rng_below(256, cfg->run.seed, RNG_TEST, 13, (uint64_t)t, 0);
      m.targets[t] = -1;
    }
    double *t = xmalloc(sizeof(double) * (size_t)repeats);
    model_forward_logits(&m); /* warm-up */
    for (int r = 0; r < repeats; r++) {
      const double t0 = timer_now();
      model_forward_logits(&m);
      t[r] = 1e3 * (timer_now() - t0);
    }
    row->recompute_ms = median(t, repeats);
    free(t);
  }
  message(
      "  generate   n = %8ld: decode cache %9.3f ms/token | recompute %10.2f ms/token | "
      "%7.1fx",
      n, row->decode_ms, row->recompute_ms, row->recompute_ms / row->decode_ms);
  free(logits);
  model_free(&m);
  (void)comm;
  return true;
}

/* ---------------------------------------------------------------------------------------------
 * the sweeps: each fills its rows and returns how many */

/* Attention forward + backward of every variant of bench.variants at every n (rank 0 alone). */
static int sweep_attention(const struct config *cfg, struct comm *comm, double rate,
                           struct attn_row *rows) {
  message("attention forward + backward (median of %d; batch %d, %d heads of %d, %s):",
          cfg->bench.repeats, cfg->bench.batch, cfg->model.heads, cfg->model.dim / cfg->model.heads,
          cfg->model.objective == OBJECTIVE_CLM ? "causal" : "bidirectional");
  int count = 0;
  char err[1024];
  for (int vi = 0; vi < cfg->bench.variant_count && comm->world_rank == 0; vi++)
    for (int ni = 0; ni < cfg->bench.n_count && count < BENCH_ROWS; ni++) {
      struct config c;
      const long n = cfg->bench.n_list[ni];
      if (bench_variant_config(cfg, cfg->bench.variants[vi], n, 1, &c, err, sizeof err))
        message("  %-10s n = %8ld: skipped (%s)", cfg->bench.variants[vi], n, err);
      else if (bench_attention_one(&c, n, cfg->bench.repeats, rate, &rows[count]))
        count++;
    }
  comm_barrier(comm, COMM_WORLD);
  return count;
}

/* Whole training steps of attention.variant at every n, on every rank. */
static int sweep_train(const struct config *cfg, struct comm *comm, double rate,
                       struct train_row *rows) {
  message("training steps (median of %d; %s, batch %d, %d layers, dim %d):", cfg->bench.repeats,
          cfg->attention.variant, cfg->train.batch, cfg->model.layers, cfg->model.dim);
  int count = 0;
  char err[1024];
  for (int ni = 0; ni < cfg->bench.n_count && count < BENCH_ROWS; ni++) {
    struct config c;
    const long n = cfg->bench.n_list[ni];
    int bad = bench_config(cfg, cfg->attention.variant, n, comm->S, &c, err, sizeof err);
    if (!bad) bad = config_check_layout(&c, comm->world_size, err, sizeof err);
    if (bad)
      message("  train      n = %8ld: skipped (%s)", n, err);
    else if (bench_train_one(&c, comm, cfg->bench.repeats, rate, &rows[count]))
      count++;
  }
  return count;
}

/* Sequence-parallel attention (traffic and time) of every variant at every n, on every rank. */
static int sweep_comm(const struct config *cfg, struct comm *comm, double rate,
                      struct comm_row *rows) {
  message(
      "sequence-parallel attention, forward + backward on %d sequence rank(s) (median of %d; "
      "bytes sent per rank, max over ranks):",
      comm->S, cfg->bench.repeats);
  int count = 0;
  char err[1024];
  for (int vi = 0; vi < cfg->bench.variant_count; vi++)
    for (int ni = 0; ni < cfg->bench.n_count && count < BENCH_ROWS; ni++) {
      struct config c;
      const long n = cfg->bench.n_list[ni];
      if (bench_variant_config(cfg, cfg->bench.variants[vi], n, comm->S, &c, err, sizeof err))
        message("  %-10s n = %8ld: skipped (%s)", cfg->bench.variants[vi], n, err);
      else if (bench_comm_one(&c, comm, n, cfg->bench.repeats, rate, &rows[count]))
        count++;
    }
  return count;
}

/* One new token with the decode caches against recomputing the context (rank 0 alone). */
static int sweep_generate(const struct config *cfg, struct comm *comm, double rate,
                          struct gen_row *rows) {
  message(
      "generation, one new token at the end of the context (%s; decode: median of the last "
      "%d of n steps; recompute: median of %d forwards over the context):",
      cfg->attention.variant, GEN_TIMED, cfg->bench.repeats);
  int count = 0;
  char err[1024];
  for (int ni = 0; ni < cfg->bench.n_count && count < BENCH_ROWS && comm->world_rank == 0; ni++) {
    struct config c;
    const long n = cfg->bench.n_list[ni];
    if (bench_config(cfg, cfg->attention.variant, n, 1, &c, err, sizeof err)) {
      message("  generate   n = %8ld: skipped (%s)", n, err);
      continue;
    }
    c.model.objective = OBJECTIVE_CLM;
    if (bench_generate_one(&c, comm, cfg->bench.repeats, rate, &rows[count])) count++;
  }
  comm_barrier(comm, COMM_WORLD);
  return count;
}

/* ---------------------------------------------------------------------------------------------
 * bench.h5: one writer for every table */

/* A column of a table: a text field (char[64]) or a double of the row struct. */
struct column {
  const char *name;
  size_t offset;
  bool text;
  const char *units; /* or the description of a text column */
};
#define TEXT(row, f, d) \
  { #f, offsetof(struct row, f), true, d }
#define NUM(row, f, u) \
  { #f, offsetof(struct row, f), false, u }

static const struct column attn_columns[] = {
    TEXT(attn_row, variant, "attention variant"),
    TEXT(attn_row, downsample, "the variant's option (fma: fma.downsample; - when it has none)"),
    NUM(attn_row, n, "tokens"),
    NUM(attn_row, heads, "heads"),
    NUM(attn_row, head_dim, "channels per head"),
    NUM(attn_row, causal, "1 = causal, 0 = bidirectional"),
    NUM(attn_row, fwd_ms, "milliseconds, median forward"),
    NUM(attn_row, bwd_ms, "milliseconds, median backward"),
    NUM(attn_row, workspace_bytes, "bytes of peak workspace, forward+backward"),
    NUM(attn_row, gflops, "GFLOP/s: 3 x forward model FLOPs / (fwd + bwd time)"),
    NUM(attn_row, p2p_gflops, "GFLOP/s of the near field (NaN when none)"),
};
static const struct column train_columns[] = {
    NUM(train_row, n, "tokens per sequence"),
    NUM(train_row, tokens_per_s, "tokens per second, all ranks"),
    NUM(train_row, flops_per_token, "model FLOPs per token, forward + backward"),
    NUM(train_row, mfu, "achieved FLOP rate / sgemm_gflops"),
    NUM(train_row, step_ms, "milliseconds, median training step"),
};
static const struct column comm_columns[] = {
    TEXT(comm_row, variant, "attention variant"),
    NUM(comm_row, n, "tokens"),
    NUM(comm_row, seq_ranks, "ranks sharing the sequence"),
    {"bytes_per_rank_per_layer", offsetof(struct comm_row, bytes), false,
     "bytes sent by the busiest rank in one attention forward + backward"},
    NUM(comm_row, fwd_ms, "milliseconds, median forward (slowest rank)"),
    NUM(comm_row, bwd_ms, "milliseconds, median backward (slowest rank)"),
};
static const struct column gen_columns[] = {
    TEXT(gen_row, variant, "attention variant"),
    NUM(gen_row, n, "tokens of context"),
    NUM(gen_row, decode_ms,
        "milliseconds per new token with the decode caches, cache filled to the context's end"),
    NUM(gen_row, recompute_ms,
        "milliseconds per new token recomputing the context (one forward over n tokens)"),
};
#undef TEXT
#undef NUM
#define NCOLS(c) (int)(sizeof c / sizeof c[0])

/* The group's columns, one 1-D dataset each, one entry per row. */
static void write_table(hid_t f, const char *group, const void *rows, size_t row_size, int count,
                        const struct column *cols, int ncols) {
  char path[128];
  for (int c = 0; c < ncols && count > 0; c++) {
    snprintf(path, sizeof path, "/%s/%s", group, cols[c].name);
    for (int i = 0; i < count; i++) {
      const char *field = (const char *)rows + (size_t)i * row_size + cols[c].offset;
      if (cols[c].text)
        h5_append_string(f, path, field, cols[c].units);
      else
        h5_append_doubles(f, path, 0, NULL, (const double *)field, cols[c].units);
    }
  }
}

int bench_run(const struct config *cfg, struct comm *comm) {
  char dir[1024];
  train_make_run_dir(cfg, comm, dir, sizeof dir);
  /* every rank measures at once, as they will run: the machine's rate is the sum */
  comm_barrier(comm, COMM_WORLD);
  double rank_rate = bench_sgemm_gflops(), machine_rate = rank_rate;
  comm_allreduce_sum_double(comm, COMM_WORLD, &machine_rate, 1);
  message(
      "bench: %d rank(s) x %d thread(s), BLAS core %s; SGEMM %.1f GFLOP/s per rank, %.1f "
      "GFLOP/s in all",
      comm->world_size, threads_count(), threads_blas_core(), rank_rate, machine_rate);
  static struct attn_row arows[BENCH_ROWS];
  static struct train_row trows[BENCH_ROWS];
  static struct comm_row crows[BENCH_ROWS];
  static struct gen_row grows[BENCH_ROWS];
  const unsigned what = cfg->bench.what;
  const int na = what & BENCH_ATTENTION ? sweep_attention(cfg, comm, rank_rate, arows) : 0;
  const int nt = what & BENCH_TRAIN ? sweep_train(cfg, comm, machine_rate, trows) : 0;
  const int nc = what & BENCH_COMM ? sweep_comm(cfg, comm, machine_rate, crows) : 0;
  const int ng = what & BENCH_GENERATE ? sweep_generate(cfg, comm, rank_rate, grows) : 0;
  if (comm->world_rank != 0) return 0;
  char path[1100];
  snprintf(path, sizeof path, "%s/bench.h5", dir);
  hid_t f = h5_create(path);
  h5_attr_double(f, "/", "sgemm_gflops", machine_rate);
  h5_attr_double(f, "/", "sgemm_gflops_per_rank", rank_rate);
  h5_attr_long(f, "/", "threads", threads_count());
  h5_attr_long(f, "/", "ranks", comm->world_size);
  h5_attr_string(f, "/", "deck", cfg->resolved);
  h5_attr_string(f, "/", "version", PACKAGE_VERSION);
  h5_attr_string(f, "/", "blas_core", threads_blas_core());
  write_table(f, "attention", arows, sizeof arows[0], na, attn_columns, NCOLS(attn_columns));
  write_table(f, "train", trows, sizeof trows[0], nt, train_columns, NCOLS(train_columns));
  write_table(f, "comm", crows, sizeof crows[0], nc, comm_columns, NCOLS(comm_columns));
  write_table(f, "generate", grows, sizeof grows[0], ng, gen_columns, NCOLS(gen_columns));
  h5_close(f);
  message("wrote %s", path);
  return 0;
}
