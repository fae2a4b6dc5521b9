/* `run.mode = bench` (SPEC §11): measures this machine's SGEMM rate, then times attention
 * forward+backward and whole training steps over bench.n_list, reporting medians, achieved
 * GFLOP/s against the SGEMM rate measured in the same run, workspace and bytes communicated. It
 * prints a table and writes runs/<name>/bench.h5. Figures, never pass/fail: that is the tests'. */
#include "run/bench.h"

#include <cblas.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attention/attention.h"
#include "core/blascore.h"
#include "core/error.h"
#include "core/h5io.h"
#include "core/memory.h"
#include "core/peak.h"
#include "core/rng.h"
#include "core/threads.h"
#include "core/tilegemm.h"
#include "core/timer.h"
#include "io/data.h"
#include "model/backend.h"
#include "model/model.h"
#include "model/optimizer.h"
#include "parallel/simsample.h"
#include "run/train.h"

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

/* The SGEMM probe: products of 2048² × 2048 on random operands, with this rank's threads. Its
 * buffers are the bench's instrument, not the model's: unlabelled, outside the reported peaks. */
#define SGEMM_PROBE_N 2048

struct sgemm_probe {
  float *a, *b, *c;
};

static void sgemm_probe_open(struct sgemm_probe *p) {
  const long N = SGEMM_PROBE_N;
  p->a = xmalloc(sizeof(float) * N * N);
  p->b = xmalloc(sizeof(float) * N * N);
  p->c = xmalloc(sizeof(float) * N * N);
  for (long i = 0; i < N * N; i++) {
    p->a[i] = rng_uniform(1, RNG_TEST, 1, (uint64_t)i, 0) - 0.5f;
    p->b[i] = rng_uniform(1, RNG_TEST, 2, (uint64_t)i, 0) - 0.5f;
  }
}

/* GFLOP/s of one product */
static double sgemm_probe_once(struct sgemm_probe *p) {
  const int N = SGEMM_PROBE_N;
  double t0 = timer_now();
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, N, N, 1.0f, p->a, N, p->b, N, 0.0f, p->c,
              N);
  return 2.0 * N * (double)N * N / (timer_now() - t0) / 1e9;
}

static void sgemm_probe_close(struct sgemm_probe *p) {
  free(p->a);
  free(p->b);
  free(p->c);
}

/* SGEMM rate of this rank with its threads (the median of 7 products, after one). */
double bench_sgemm_gflops(void) {
  struct sgemm_probe p;
  sgemm_probe_open(&p);
  double g[7];
  sgemm_probe_once(&p);
  for (int r = 0; r < 7; r++) g[r] = sgemm_probe_once(&p);
  sgemm_probe_close(&p);
  return median(g, 7);
}

/* ---------------------------------------------------------------------------------------------
 * attention */

/* The rows of bench.h5's tables: text columns first, then numbers (written as doubles). */
struct attn_row {
  char variant[64];
  char downsample[64]; /* the variant's option label (fma: conv, m2m or avg); "-" otherwise */
  double n, open, heads, head_dim, causal;
  double fwd_ms, bwd_ms, workspace_bytes, gflops, p2p_gflops;
  /* per forward + backward, mean over the repetitions: the FMM phases' timers (the device's time
   * of the operators on a GPU; thread-milliseconds on the CPU) */
  double p2p_ms, m2p_ms, p2m_ms, m2m_ms;
};

/* One attention op to time, on the back end of the deck's parallel.device: its context, its
 * parameters, and its tensors on that device — q, k (B, Hqk, T, d), v, dout, out (B, H, T, d),
 * the gradients and what forward saves — filled with normal draws keyed by global position, so
 * that the same sequence is timed on any layout. */
struct timed_op {
  const struct backend *be;
  struct attn_ctx ctx;
  struct attn_params ap;
  float *q, *k, *v, *g, *out, *dq, *dk, *dv, *saved, *params, *dparams;
  size_t qcount, count;
};

/* A device copy of n floats drawn from stream `which` for global positions: element (bh, t, f)
 * of a (BH, T, d) tensor whose slab starts at token t0 of n. A GPU draws them itself (at 1M
 * tokens the host took about 35 s for a case's four tensors); the CPU on its threads. */
static float *draw_tensor(const struct backend *be, int which, long BH, long T, long d, long n,
                          long t0) {
  const size_t count = (size_t)(BH * T * d);
  if (be->fill_normal) {
    float *dev = be->alloc(MEM_DATA, sizeof(float) * (count + 1));
    be->fill_normal(dev, BH, T * d, n * d, t0 * d, 7, RNG_TEST, (uint64_t)which);
    return dev;
  }
  float *host = mem_alloc(MEM_DATA, sizeof(float) * (count + 1));
#pragma omp parallel for schedule(static)
  for (long bh = 0; bh < BH; bh++)
    for (long i = 0; i < T * d; i++)
      host[bh * T * d + i] =
          (float)rng_normal(7, RNG_TEST, (uint64_t)which, (uint64_t)((bh * n + t0) * d + i), 0);
  float *dev = be->alloc(MEM_DATA, sizeof(float) * (count + 1));
  be->upload(dev, host, sizeof(float) * count);
  mem_free(host);
  return dev;
}

static void timed_op_open(struct timed_op *o, const struct config *cfg, struct comm *comm,
                          struct attn_dims dims) {
  char err[256];
  memset(o, 0, sizeof *o);
  o->be = backend_for(cfg, err, sizeof err);
  if (!o->be) error("%s", err);
  const struct attn_variant *v = attention_select(cfg);
  o->ctx = attention_open(cfg, v, o->be->device, comm, 0, dims);
  const long BHq = dims.B * attention_qk_heads(cfg), BH = dims.B * dims.H;
  o->qcount = (size_t)(BHq * dims.T * dims.d);
  o->count = (size_t)(BH * dims.T * dims.d);
  o->q = draw_tensor(o->be, 1, BHq, dims.T, dims.d, dims.n, dims.t0);
  o->k = draw_tensor(o->be, 2, BHq, dims.T, dims.d, dims.n, dims.t0);
  o->v = draw_tensor(o->be, 3, BH, dims.T, dims.d, dims.n, dims.t0);
  o->g = draw_tensor(o->be, 4, BH, dims.T, dims.d, dims.n, dims.t0);
  o->out = o->be->alloc(MEM_DATA, sizeof(float) * o->count);
  o->dq = o->be->alloc(MEM_DATA, sizeof(float) * o->qcount);
  o->dk = o->be->alloc(MEM_DATA, sizeof(float) * o->qcount);
  o->dv = o->be->alloc(MEM_DATA, sizeof(float) * o->count);
  o->saved = o->be->alloc(MEM_ACTIVATIONS, sizeof(float) * (attention_saved_floats(&o->ctx) + 1));
  attention_params_make(&o->ap, cfg, v, dims.n);
  if (o->ap.list.count) {
    const size_t bytes = sizeof(float) * o->ap.list.total;
    o->params = o->be->alloc(MEM_PARAMS, bytes);
    o->dparams = o->be->alloc(MEM_GRADS, bytes);
    o->be->upload(o->params, o->ap.params, bytes);
  }
}

/* One forward and one backward (gradients zeroed between), each timed to its end on the device. */
static void timed_op_run(struct timed_op *o, double *fwd_s, double *bwd_s) {
  const double t0 = timer_now();
  attention_forward(&o->ctx, o->out, o->saved, o->q, o->k, o->v, o->params);
  o->be->sync();
  const double t1 = timer_now();
  o->be->zero(o->dq, sizeof(float) * o->qcount);
  o->be->zero(o->dk, sizeof(float) * o->qcount);
  o->be->zero(o->dv, sizeof(float) * o->count);
  o->be->sync();
  const double t1b = timer_now();
  attention_backward(&o->ctx, o->dq, o->dk, o->dv, o->dparams, o->g, o->q, o->k, o->v, o->params,
                     o->out, o->saved);
  o->be->sync();
  *fwd_s = t1 - t0;
  *bwd_s = timer_now() - t1b;
}

static void timed_op_close(struct timed_op *o) {
  attention_close(&o->ctx);
  float *bufs[] = {o->q,  o->k,  o->v,     o->g,      o->out,    o->dq,
                   o->dk, o->dv, o->saved, o->params, o->dparams};
  for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
    if (bufs[i]) o->be->free(bufs[i]);
  attention_params_free(&o->ap);
}

/* Peak workspace bytes of the op's device since the last reset, and the reset. */
static size_t workspace_peak(const struct backend *be) {
  return be->host_visible ? mem_peak(MEM_WORKSPACE) : mem_device_peak(MEM_WORKSPACE);
}
static size_t workspace_reset(const struct backend *be) {
  if (be->host_visible) {
    mem_reset_peak(MEM_WORKSPACE);
    return mem_current(MEM_WORKSPACE);
  }
  mem_device_reset_peak(MEM_WORKSPACE);
  return mem_device_current(MEM_WORKSPACE);
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

/* The variant's name in the console's lines: fma with its fma.open when it opens windows. */
static const char *row_label(const struct config *cfg, const struct attn_variant *v, char *buf,
                             size_t len) {
  if (!(v->opens && v->opens(cfg))) return v->name;
  if (cfg->attention.fma_open == FMA_OPEN_ALL)
    snprintf(buf, len, "%s/all", v->name);
  else
    snprintf(buf, len, "%s/o%d", v->name, cfg->attention.fma_open);
  return buf;
}

/* The row's fma.open column: the value, −1 for all, 0 for a variant that does not open. */
/* ---------------------------------------------------------------------------------------------
 * the device's own counts per case (bench.h5 /gpu; a GPU back end keeps them, the CPU none) */

struct gpu_row {
  char kind[16], variant[64], precision[8];
  double n, seq_ranks;
  /* per repetition (an attention forward + backward, or a training step) */
  double gemm_calls, gemm_flops, gemm_operand_elements, gemm_operand_bytes, elements_converted;
  double elements_converted_in_pass, kernel_launches;
  double mallocs_after_first_step; /* over all timed repetitions, after the warm-up */
  double pool_live_peak_bytes, pool_reserved_peak_bytes, device_bytes_outside_pool;
};

static struct gpu_row gpu_rows_[2 * BENCH_ROWS];
static int gpu_nrows_ = 0;

/* A case's memory is freed: the device's pool gives back what it holds unused (a no-op on the
 * CPU), so that each case's reserved peak in /gpu is its own. */
static void case_done(const struct backend *be) {
  if (be->trim) be->trim();
}

/* Start counting a case's timed repetitions (after its warm-up): a no-op on the CPU. */
static void counts_begin(const struct backend *be) {
  if (be->counts_reset) {
    be->sync();
    be->counts_reset();
  }
}

/* The counts of a case's `repeats` timed repetitions as a /gpu row. */
static void counts_end(const struct backend *be, const struct config *cfg, const char *kind,
                       const char *variant, long n, int seq_ranks, int repeats) {
  if (!be->counts_read || gpu_nrows_ >= 2 * BENCH_ROWS) return;
  be->sync();
  struct device_counts c;
  be->counts_read(&c);
  struct gpu_row *r = &gpu_rows_[gpu_nrows_++];
  snprintf(r->kind, sizeof r->kind, "%s", kind);
  snprintf(r->variant, sizeof r->variant, "%s", variant);
  snprintf(r->precision, sizeof r->precision, "%s",
           cfg->parallel.precision == PRECISION_BF16 ? "bf16" : "fp32");
  r->n = (double)n;
  r->seq_ranks = seq_ranks;
  r->gemm_calls = c.gemm_calls / repeats;
  r->gemm_flops = c.gemm_flops / repeats;
  r->gemm_operand_elements = c.gemm_operand_elements / repeats;
  r->gemm_operand_bytes = c.gemm_operand_bytes / repeats;
  r->elements_converted = c.elements_converted / repeats;
  r->elements_converted_in_pass = c.elements_converted_in_pass / repeats;
  r->kernel_launches = c.kernel_launches / repeats;
  r->mallocs_after_first_step = c.mallocs;
  r->pool_live_peak_bytes = c.pool_live_peak_bytes;
  r->pool_reserved_peak_bytes = c.pool_reserved_peak_bytes;
  r->device_bytes_outside_pool = c.device_bytes_outside_pool;
  message(
      "  %-10s n = %8ld: device counts per %s: %.0f GEMMs (%.3g GFLOP, %.3g operand "
      "elements, %.3g GB), %.3g converted (%.3g in passes of their own), %.0f launches; %.0f "
      "allocations after the first; pool "
      "%.1f MiB live, %.1f MiB reserved at peak; %.1f MiB on the device outside it",
      variant, n, strcmp(kind, "train") ? "forward + backward" : "step", r->gemm_calls,
      r->gemm_flops / 1e9, r->gemm_operand_elements, r->gemm_operand_bytes / 1e9,
      r->elements_converted, r->elements_converted - r->elements_converted_in_pass,
      r->kernel_launches, r->mallocs_after_first_step, r->pool_live_peak_bytes / 1048576.0,
      r->pool_reserved_peak_bytes / 1048576.0, r->device_bytes_outside_pool / 1048576.0);
}

static double row_open(const struct config *cfg, const struct attn_variant *v) {
  return v->opens ? (double)cfg->attention.fma_open : 0.0;
}

static bool bench_attention_one(const struct config *cfg, long n, int repeats, double rate,
                                struct attn_row *row) {
  const struct attn_variant *v = attention_select(cfg);
  const long B = cfg->bench.batch, H = cfg->model.heads, d = cfg->model.dim / cfg->model.heads;
  const struct attn_dims dims = {B, H, n, d, n, 0, cfg->model.objective == OBJECTIVE_CLM};
  struct timed_op o;
  timed_op_open(&o, cfg, NULL, dims);
  double p2p = 0.0, flops = v->flops(&o.ctx, &p2p);
  const double est = 3.0 * flops / (0.5 * rate * 1e9);
  char label[64];
  if (est > BENCH_MAX_SECONDS) {
    message("  %-10s n = %8ld: skipped (estimated %.0f s per repetition)",
            row_label(cfg, v, label, sizeof label), n, est);
    timed_op_close(&o);
    return false;
  }
  const size_t ws0 = workspace_reset(o.be);
  double *tf = xmalloc(sizeof(double) * (size_t)repeats),
         *tb = xmalloc(sizeof(double) * (size_t)repeats);
  static const enum timer_id phases[4] = {TIMER_P2P, TIMER_M2P, TIMER_P2M, TIMER_M2M};
  double phase_ms[4] = {0};
  for (int r = -1; r < repeats; r++) { /* r = −1: warm-up */
    if (r == 0) counts_begin(o.be);
    double p0[4];
    for (int i = 0; i < 4; i++) p0[i] = timer_total_ms(phases[i]);
    double f, b;
    timed_op_run(&o, &f, &b);
    if (r >= 0) {
      tf[r] = 1e3 * f;
      tb[r] = 1e3 * b;
      for (int i = 0; i < 4; i++) phase_ms[i] += timer_total_ms(phases[i]) - p0[i];
    }
  }
  row->p2p_ms = phase_ms[0] / repeats;
  row->m2p_ms = phase_ms[1] / repeats;
  row->p2m_ms = phase_ms[2] / repeats;
  row->m2m_ms = phase_ms[3] / repeats;
  snprintf(row->variant, sizeof row->variant, "%s%s", v->name,
           cfg->attention.heads_mode == HEADS_FISH ? "+fish" : "");
  counts_end(o.be, cfg, "attention", row->variant, n, 1, repeats);
  snprintf(row->downsample, sizeof row->downsample, "%s",
           v->option_label ? v->option_label(cfg) : "-");
  row->n = n;
  row->open = row_open(cfg, v);
  row->heads = H;
  row->head_dim = d;
  row->causal = dims.causal;
  row->fwd_ms = median(tf, repeats);
  row->bwd_ms = median(tb, repeats);
  row->workspace_bytes = (double)(workspace_peak(o.be) - ws0);
  row->gflops = 3.0 * flops / ((row->fwd_ms + row->bwd_ms) / 1e3) / 1e9;
  /* The near field runs 2 GEMMs of its size forward and 5 backward (scores again, dV, dP, dQ,
   * dK): 3.5 × the forward's executed FLOPs. On the CPU its timer sums the threads' seconds, and
   * the threads run it side by side, so the rate of the whole rank is FLOPs / (thread-seconds /
   * threads); on the GPU the timer holds the device's time (events around the operator). */
  const double lanes = o.be->device == DEVICE_GPU ? 1.0 : (double)threads_count();
  row->p2p_gflops =
      p2p > 0 && row->p2p_ms > 0 ? 3.5 * p2p / (row->p2p_ms / 1e3 / lanes) / 1e9 : NAN;
  free(tf);
  free(tb);
  const struct backend *be = o.be;
  timed_op_close(&o);
  case_done(be);
  message(
      "  %-10s n = %8ld: fwd %10.2f ms | bwd %10.2f ms | %7.1f GFLOP/s (%4.1f%% of GEMM) | "
      "workspace %8.2f MiB",
      row_label(cfg, v, label, sizeof label), n, row->fwd_ms, row->bwd_ms, row->gflops,
      100.0 * row->gflops / rate, row->workspace_bytes / 1048576.0);
  if (!isnan(row->p2p_gflops))
    message("  %-10s             near field (P2P): %.1f GFLOP/s (%.1f%% of GEMM)", "",
            row->p2p_gflops, 100.0 * row->p2p_gflops / rate);
  /* on a GPU the phases are the device's time of their operators, in one stream: what they leave
   * of the forward + backward is the rest (head copies, zeroing, the kernels outside an operator)
   */
  const double phased = row->p2p_ms + row->m2p_ms + row->p2m_ms + row->m2m_ms;
  if (be->device == DEVICE_GPU && phased > 0)
    message(
        "  %-10s             per forward + backward: P2P %.2f ms, M2P %.2f, P2M %.2f, M2M %.2f, "
        "the rest %.2f",
        "", row->p2p_ms, row->m2p_ms, row->p2m_ms, row->m2m_ms, row->fwd_ms + row->bwd_ms - phased);
  return true;
}

/* ---------------------------------------------------------------------------------------------
 * sequence-parallel attention: traffic and time */

struct comm_row {
  char variant[64];
  double n, open, seq_ranks, bytes, exchanges, fwd_ms, bwd_ms;
  double work_imbalance; /* the busiest rank's attention FLOPs (the variant's count) / the mean */
};

static bool bench_comm_one(const struct config *cfg, struct comm *comm, long n, int repeats,
                           double rate, struct comm_row *row) {
  const struct attn_variant *v = attention_select(cfg);
  const long B = cfg->bench.batch, H = cfg->model.heads, d = cfg->model.dim / cfg->model.heads;
  const long S = comm->S, T = n / S, t0 = comm->seq_rank * T;
  struct timed_op o;
  timed_op_open(&o, cfg, comm,
                (struct attn_dims){B, H, T, d, n, t0, cfg->model.objective == OBJECTIVE_CLM});
  double p2p = 0.0, flops = v->flops(&o.ctx, &p2p), most = flops;
  /* judge the time by the whole job's FLOPs against the machine's rate (all ranks) */
  comm_allreduce_sum_double(comm, COMM_SEQ, &flops, 1);
  comm_allreduce_max_double(comm, COMM_SEQ, &most, 1);
  const double est = 3.0 * flops / (0.5 * rate * 1e9);
  char label[64];
  if (est > BENCH_MAX_SECONDS) {
    message("  %-10s n = %8ld: skipped (estimated %.0f s per repetition)",
            row_label(cfg, v, label, sizeof label), n, est);
    timed_op_close(&o);
    return false;
  }
  double *tf = xmalloc(sizeof(double) * (size_t)repeats),
         *tb = xmalloc(sizeof(double) * (size_t)repeats);
  double bytes = 0, exchanges = 0;
  for (int r = -1; r < repeats; r++) {
    comm_barrier(comm, COMM_SEQ);
    const uint64_t b0 = comm->bytes_sent, x0 = comm->exchanges;
    double t[4];
    timed_op_run(&o, &t[0], &t[1]);
    t[2] = (double)(comm->bytes_sent - b0); /* the busiest rank's bytes, the slowest rank's time */
    t[3] = (double)(comm->exchanges - x0);  /* and the most blocking points */
    comm_allreduce_max_double(comm, COMM_SEQ, t, 4);
    if (r >= 0) {
      tf[r] = 1e3 * t[0];
      tb[r] = 1e3 * t[1];
      bytes = t[2];
      exchanges = t[3];
    }
  }
  snprintf(row->variant, sizeof row->variant, "%s", v->name);
  row->n = n;
  row->open = row_open(cfg, v);
  row->seq_ranks = (int)S;
  row->bytes = bytes;
  row->exchanges = exchanges;
  row->fwd_ms = median(tf, repeats);
  row->bwd_ms = median(tb, repeats);
  /* counted again after the runs: a variant may plan how it shares the work at its first call
   * (fma's balanced causal work) */
  flops = v->flops(&o.ctx, &p2p);
  most = flops;
  comm_allreduce_sum_double(comm, COMM_SEQ, &flops, 1);
  comm_allreduce_max_double(comm, COMM_SEQ, &most, 1);
  row->work_imbalance = flops > 0 ? most * (double)S / flops : 1.0;
  message(
      "  %-10s n = %8ld: %12.0f bytes per rank per layer (%8.2f MiB) | %4.0f exchanges | fwd "
      "%9.2f ms | bwd %9.2f ms | work max/mean %.3f",
      row_label(cfg, v, label, sizeof label), n, row->bytes, row->bytes / 1048576.0, row->exchanges,
      row->fwd_ms, row->bwd_ms, row->work_imbalance);
  free(tf);
  free(tb);
  timed_op_close(&o);
  return true;
}

/* ---------------------------------------------------------------------------------------------
 * training steps */

struct train_row {
  double n, tokens_per_s, flops_per_token, mfu, step_ms, peak_bytes;
  /* per step, mean over the timed steps and over the ranks (thread-milliseconds for the fma
   * operators, which sum their OpenMP threads) */
  double near_ms, far_ms, exchange_ms, allreduce_ms, optimizer_ms;
  /* per step outside blocking communication (the step less exchange and allreduce): the largest
   * rank's and the mean; their ratio is the load imbalance that the exchanges wait out */
  double busy_max_ms, busy_mean_ms;
  double mfu_peak; /* achieved FLOP rate / the measured FMA peak of every rank (NaN on a GPU) */
  /* per step, mean over ranks, by kind of pass (timer.h): the linear layers' GEMMs, the attention
   * operators, the passes around them, and what no timer holds (the step less all the others) */
  double gemm_ms, attention_ms, norm_ms, activation_ms, dropout_ms, copy_ms, loss_ms, other_ms;
  /* on the CPU, the references measured again beside every timed step (all ranks at once, summed)
   * and the step's rate against them: medians over the steps (NaN on a GPU) */
  double sgemm_adjacent_gflops, peak_adjacent_gflops, mfu_adjacent, mfu_peak_adjacent;
};

/* The timers a training-step row reports, in the order of its per-step columns. */
static const enum timer_id train_timers[] = {
    TIMER_P2P,        TIMER_P2M,       TIMER_M2M,  TIMER_M2P,       TIMER_EXCHANGE,
    TIMER_COMM,       TIMER_OPTIMIZER, TIMER_GEMM, TIMER_ATTENTION, TIMER_NORM,
    TIMER_ACTIVATION, TIMER_DROPOUT,   TIMER_COPY, TIMER_LOSS};
#define NPHASES (sizeof train_timers / sizeof train_timers[0])

/* The machine's peak, every rank together: on the CPU the FMA peak of the ranks' threads (bench_run
 * measures it), on a GPU the devices' published dense peak for the run's precision (NaN for a
 * device the table below does not know). */
static double peak_machine_ = NAN;
static const char *peak_kind_ = "FMA peak";

/* A GPU's published dense peak in GFLOP/s (NVIDIA's datasheets, without sparsity; the figures of
 * scripts/roofline.py), found by name in its description; NAN when unknown. */
static double published_peak_gflops(const char *device, bool bf16) {
  static const struct {
    const char *name;
    double bf16, fp32;
  } peaks[] = {
      {"H100 PCIe", 756e3, 51.2e3}, /* first: "H100" alone is the SXM5 part */
      {"H100", 989.4e3, 66.9e3},
      {"H200", 989.4e3, 66.9e3},
      {"A100", 312e3, 19.5e3},
  };
  for (size_t i = 0; i < sizeof peaks / sizeof peaks[0]; i++)
    if (strstr(device, peaks[i].name)) return bf16 ? peaks[i].bf16 : peaks[i].fp32;
  return NAN;
}

static double pct(double part, double whole) { return 100.0 * part / whole; }

/* The phase timers a training-step row reports: their totals so far. */
static void train_phases(double out[NPHASES]) {
  for (size_t i = 0; i < NPHASES; i++) out[i] = timer_total_ms(train_timers[i]);
}

/* The CPU's references measured again after every timed step: on a shared host the clocks drift
 * by tens of percent within a minute (docs/perf.md), so a step against a rate measured seconds
 * earlier carries that drift; against one measured beside it, less. Each timed step is followed by
 * one SGEMM product and one FMA-peak probe, every rank at once; the ratios are per step, then the
 * median. A GPU back end measures its own rates, and under SMPI the start's stand: no adjacent
 * references (NaN). */
struct adjacent {
  bool on;
  int steps;
  struct sgemm_probe probe;
  double *sgemm, *peak, *mfu, *mfu_peak; /* per timed step, machine-wide */
};

static void adjacent_open(struct adjacent *a, const struct backend *be, int repeats) {
  memset(a, 0, sizeof *a);
  a->on = be->gemm_gflops == NULL;
#ifdef FMATTN_SMPI
  /* simulated ranks run one after another on the simulating core, so the rate measured at the
   * start stands for every one; per-rank probes would hold 48 MiB each in the one process */
  a->on = false;
#endif
  if (!a->on) return;
  sgemm_probe_open(&a->probe);
  sgemm_probe_once(&a->probe); /* warm */
  a->steps = repeats;
  a->sgemm = xmalloc(sizeof(double) * 4 * (size_t)repeats);
  a->peak = a->sgemm + repeats;
  a->mfu = a->peak + repeats;
  a->mfu_peak = a->mfu + repeats;
}

/* after timed step r, which ran at step_flops FLOP/s on all ranks */
static void adjacent_measure(struct adjacent *a, struct comm *comm, int r, double step_flops) {
  if (!a->on) return;
  comm_barrier(comm, COMM_WORLD);
  const char *isa;
  double rates[2] = {sgemm_probe_once(&a->probe),
                     fma_peak_gflops_per_thread(&isa) * threads_count()};
  comm_allreduce_sum_double(comm, COMM_WORLD, rates, 2);
  a->sgemm[r] = rates[0];
  a->peak[r] = rates[1];
  a->mfu[r] = step_flops / (rates[0] * 1e9);
  a->mfu_peak[r] = step_flops / (rates[1] * 1e9);
}

static void adjacent_close(struct adjacent *a, struct train_row *row) {
  row->sgemm_adjacent_gflops = row->peak_adjacent_gflops = NAN;
  row->mfu_adjacent = row->mfu_peak_adjacent = NAN;
  if (!a->on) return;
  sgemm_probe_close(&a->probe);
  row->sgemm_adjacent_gflops = median(a->sgemm, a->steps);
  row->peak_adjacent_gflops = median(a->peak, a->steps);
  row->mfu_adjacent = median(a->mfu, a->steps);
  row->mfu_peak_adjacent = median(a->mfu_peak, a->steps);
  free(a->sgemm);
}

static bool bench_train_one(const struct config *cfg, struct comm *comm, int repeats,
                            double machine_gflops, struct train_row *row) {
  struct model m;
  mem_reset_peaks();
  model_build(&m, cfg, comm, cfg->train.batch / comm->D);
  model_init_params(&m);
  const long N = m.B * m.T;
  for (long i = 0; i < N; i++) {
    m.tokens[i] = (int)rng_below(256, cfg->run.seed, RNG_TEST, 11, (uint64_t)i, 0);
    m.targets[i] = (int)rng_below(256, cfg->run.seed, RNG_TEST, 12, (uint64_t)i, 0);
  }
  const double fpt = model_flops_per_token(&m);
  double *ts = xmalloc(sizeof(double) * (size_t)repeats);
  struct adjacent adj;
  adjacent_open(&adj, m.be, repeats);
  double phase0[NPHASES] = {0}, phase1[NPHASES], own_s = 0.0;
  for (int r = -1; r < repeats; r++) {
    comm_barrier(comm, COMM_WORLD);
    if (r == 0) {
      train_phases(phase0);
      counts_begin(m.be);
      sim_sample_arm(); /* a sampled simulation measures from here (simsample.h) */
    }
    double t0 = timer_now();
    model_zero_grads(&m);
    long c;
    model_forward(&m, r + 1, true, 1.0f / (float)(N * comm->world_size), &c);
    model_backward(&m, r + 1);
    /* each phase's timer waits for the device's queue first: the backward's queued tail is not
     * the allreduce's time, nor the allreduce's the optimizer's (a no-op on the CPU) */
    m.be->sync();
    timer_start(TIMER_COMM);
    model_allreduce_grads(&m);
    m.be->sync();
    timer_stop(TIMER_COMM);
    timer_start(TIMER_OPTIMIZER);
    double norm = optimizer_grad_norm(&m);
    optimizer_step(&m, r + 2, 1e-4, norm > 1.0 ? (float)(1.0 / norm) : 1.0f);
    m.be->sync();
    timer_stop(TIMER_OPTIMIZER);
    double t = timer_now() - t0;
    if (r >= 0) own_s += t;
    MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, &t, 1, MPI_DOUBLE, MPI_MAX, comm->world));
    if (r >= 0) {
      ts[r] = t;
      adjacent_measure(&adj, comm, r, (double)cfg->train.batch * (double)m.n * fpt / t);
    }
  }
  double s = median(ts, repeats);
  free(ts);
  adjacent_close(&adj, row);
  counts_end(m.be, cfg, "train", cfg->attention.variant, m.n, comm->S, repeats);
  train_phases(phase1);
  for (size_t i = 0; i < NPHASES; i++) phase1[i] = (phase1[i] - phase0[i]) / repeats;
  /* phase1: P2P, P2M, M2M, M2P, exchange, allreduce, optimizer, then the passes (train_timers) */
  double busy = 1e3 * own_s / repeats - phase1[4] - phase1[5], busy_max = busy;
  double own_ms = 1e3 * own_s / repeats;
  for (size_t i = 0; i < NPHASES; i++) phase1[i] /= comm->world_size;
  own_ms /= comm->world_size;
  busy /= comm->world_size;
  comm_allreduce_sum_double(comm, COMM_WORLD, phase1, (int)NPHASES);
  comm_allreduce_sum_double(comm, COMM_WORLD, &busy, 1);
  comm_allreduce_sum_double(comm, COMM_WORLD, &own_ms, 1);
  comm_allreduce_max_double(comm, COMM_WORLD, &busy_max, 1);
  row->busy_max_ms = busy_max;
  row->busy_mean_ms = busy;
  row->near_ms = phase1[0];
  row->far_ms = phase1[1] + phase1[2] + phase1[3];
  row->exchange_ms = phase1[4];
  row->allreduce_ms = phase1[5];
  row->optimizer_ms = phase1[6];
  double *by_kind[] = {&row->gemm_ms,    &row->attention_ms, &row->norm_ms, &row->activation_ms,
                       &row->dropout_ms, &row->copy_ms,      &row->loss_ms};
  double timed = row->allreduce_ms + row->optimizer_ms;
  for (int i = 0; i < 7; i++) timed += *by_kind[i] = phase1[7 + i];
  /* the exchanges happen inside the attention operators: already in attention_ms */
  row->other_ms = own_ms - timed;
  /* the step's labelled memory on its device, the largest rank's */
  row->peak_bytes = (double)(m.be->host_visible ? mem_peak_total() : mem_device_peak_total());
  comm_allreduce_max_double(comm, COMM_WORLD, &row->peak_bytes, 1);
  row->n = m.n;
  row->step_ms = 1e3 * s;
  row->tokens_per_s = (double)cfg->train.batch * (double)m.n / s;
  row->flops_per_token = fpt;
  row->mfu = row->tokens_per_s * fpt / (machine_gflops * 1e9);
  row->mfu_peak = row->tokens_per_s * fpt / (peak_machine_ * 1e9);
  char of_peak[48] = "";
  if (isfinite(row->mfu_peak))
    snprintf(of_peak, sizeof of_peak, ", %.1f%% of the %s", 100.0 * row->mfu_peak, peak_kind_);
  message(
      "  train      n = %8ld: step %9.1f ms | %9.0f tok/s | %.1f MFLOP/token | %.1f GFLOP/s = "
      "%.1f%% of GEMM%s | peak %.1f MiB",
      m.n, row->step_ms, row->tokens_per_s, fpt / 1e6, row->tokens_per_s * fpt / 1e9,
      100.0 * row->mfu, of_peak, row->peak_bytes / 1048576.0);
  message(
      "  train      n = %8ld: near field %.1f ms, far field %.1f ms, exchange %.1f ms, "
      "gradient allreduce %.1f ms, optimizer %.1f ms per step (mean over ranks); outside "
      "communication %.1f ms on the busiest rank, %.1f on average",
      m.n, row->near_ms, row->far_ms, row->exchange_ms, row->allreduce_ms, row->optimizer_ms,
      row->busy_max_ms, row->busy_mean_ms);
  if (mem_folded_bytes() > 0)
    message(
        "  train      n = %8ld: %.1f MiB of rank 0's activations and workspaces folded onto "
        "pages every simulated rank shares (FMATTN_SMPI_FOLD): the times stand, the values "
        "do not",
        m.n, (double)mem_folded_bytes() / 1048576.0);
  long sampled_run, sampled_skipped;
  if (sim_sample_counts(&sampled_run, &sampled_skipped))
    message(
        "  train      n = %8ld: sampled compute (FMATTN_SMPI_SAMPLE): rank 0 ran %ld measured "
        "regions and was charged for %ld it skipped, at their sites' measured rates",
        m.n, sampled_run, sampled_skipped);
  sim_sample_report(8);
  const double passes = row->norm_ms + row->activation_ms + row->dropout_ms + row->copy_ms +
                        row->loss_ms + row->other_ms;
  /* on a GPU the kinds time the host's launches, not the device's work: /gpu counts it instead */
  if (m.be->host_visible)
    message(
        "  train      n = %8ld: by kind (%% of the step, mean over ranks): GEMM %.1f, attention "
        "%.1f, optimizer %.1f, allreduce %.1f | the passes around them %.1f: norms %.1f, "
        "activations %.1f, dropout %.1f, copies %.1f, loss %.1f, untimed %.1f",
        m.n, pct(row->gemm_ms, own_ms), pct(row->attention_ms, own_ms),
        pct(row->optimizer_ms, own_ms), pct(row->allreduce_ms, own_ms), pct(passes, own_ms),
        pct(row->norm_ms, own_ms), pct(row->activation_ms, own_ms), pct(row->dropout_ms, own_ms),
        pct(row->copy_ms, own_ms), pct(row->loss_ms, own_ms), pct(row->other_ms, own_ms));
  if (isfinite(row->mfu_adjacent)) {
    if (fabs(row->sgemm_adjacent_gflops / machine_gflops - 1.0) > 0.15)
      warning(
          "n = %ld: SGEMM ran at %.1f GFLOP/s beside the steps against %.1f at the start of the "
          "run: the machine's rate moved (a shared or throttled host); the ratios to the rates "
          "measured beside the steps are the ones to compare",
          m.n, row->sgemm_adjacent_gflops, machine_gflops);
    message(
        "  train      n = %8ld: beside each step, SGEMM %.1f and the FMA peak %.1f GFLOP/s: the "
        "step at %.1f%% of SGEMM, %.1f%% of the peak (medians over the steps)",
        m.n, row->sgemm_adjacent_gflops, row->peak_adjacent_gflops, 100.0 * row->mfu_adjacent,
        100.0 * row->mfu_peak_adjacent);
  }
  const struct backend *be = m.be;
  model_free(&m);
  case_done(be);
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
  model_build_on(&m, cfg, NULL, 1, backend_cpu()); /* one sequence on one rank: the decode
                                                        caches are host code */
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
/* The fma.open values to time variant name with: bench.fma_open's (deck: attention.fma.open)
 * for a variant that opens windows; 0 for any other (fma_linear refuses an opening). */
static int open_values(const struct config *cfg, const char *name, int *values) {
  const struct attn_variant *v = attention_find(name);
  if (!v || !v->opens) {
    values[0] = 0;
    return 1;
  }
  for (int i = 0; i < cfg->bench.fma_open_count; i++)
    values[i] = cfg->bench.fma_open[i] == BENCH_OPEN_DECK ? cfg->attention.fma_open
                                                          : cfg->bench.fma_open[i];
  return cfg->bench.fma_open_count;
}

/* bench_variant_config with fma.open = open, refused also where the implementation on the
 * deck's device does not take it (fma.open on the GPU). */
static int bench_open_config(const struct config *base, const char *variant, int open, long n,
                             int seq_ranks, struct config *cfg, char *err, size_t len) {
  struct config with = *base;
  with.attention.fma_open = open;
  if (bench_variant_config(&with, variant, n, seq_ranks, cfg, err, len)) return 1;
  const struct backend *be = backend_for(cfg, err, len);
  return !be || attention_impl_refuses(attention_select(cfg), be->device, cfg, err, len);
}

static int sweep_attention(const struct config *cfg, struct comm *comm, double rate,
                           struct attn_row *rows) {
  message("attention forward + backward (median of %d; batch %d, %d heads of %d, %s):",
          cfg->bench.repeats, cfg->bench.batch, cfg->model.heads, cfg->model.dim / cfg->model.heads,
          cfg->model.objective == OBJECTIVE_CLM ? "causal" : "bidirectional");
  int count = 0;
  char err[1024];
  int opens[CONFIG_LIST_MAX];
  for (int vi = 0; vi < cfg->bench.variant_count && comm->world_rank == 0; vi++) {
    const int no = open_values(cfg, cfg->bench.variants[vi], opens);
    for (int ni = 0; ni < cfg->bench.n_count; ni++)
      for (int oi = 0; oi < no && count < BENCH_ROWS; oi++) {
        struct config c;
        const long n = cfg->bench.n_list[ni];
        if (bench_open_config(cfg, cfg->bench.variants[vi], opens[oi], n, 1, &c, err, sizeof err))
          message("  %-10s n = %8ld: skipped (%s)", cfg->bench.variants[vi], n, err);
        else if (bench_attention_one(&c, n, cfg->bench.repeats, rate, &rows[count]))
          count++;
      }
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
  int opens[CONFIG_LIST_MAX];
  for (int vi = 0; vi < cfg->bench.variant_count; vi++) {
    const int no = open_values(cfg, cfg->bench.variants[vi], opens);
    for (int ni = 0; ni < cfg->bench.n_count; ni++)
      for (int oi = 0; oi < no && count < BENCH_ROWS; oi++) {
        struct config c;
        const long n = cfg->bench.n_list[ni];
        if (bench_open_config(cfg, cfg->bench.variants[vi], opens[oi], n, comm->S, &c, err,
                              sizeof err))
          message("  %-10s n = %8ld: skipped (%s)", cfg->bench.variants[vi], n, err);
        else if (bench_comm_one(&c, comm, n, cfg->bench.repeats, rate, &rows[count]))
          count++;
      }
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
    NUM(attn_row, open, "attention.fma.open of the row (-1: all; 0 for variants that do not open)"),
    NUM(attn_row, heads, "heads"),
    NUM(attn_row, head_dim, "channels per head"),
    NUM(attn_row, causal, "1 = causal, 0 = bidirectional"),
    NUM(attn_row, fwd_ms, "milliseconds, median forward"),
    NUM(attn_row, bwd_ms, "milliseconds, median backward"),
    NUM(attn_row, workspace_bytes, "bytes of peak workspace, forward+backward"),
    NUM(attn_row, gflops, "GFLOP/s: 3 x forward model FLOPs / (fwd + bwd time)"),
    NUM(attn_row, p2p_gflops, "GFLOP/s of the near field (NaN when none)"),
    NUM(attn_row, p2p_ms,
        "milliseconds of the near field (P2P) per forward + backward, mean: the device's time of "
        "its operators on a GPU, the threads' summed time on the CPU"),
    NUM(attn_row, m2p_ms, "milliseconds of the far field (M2P), as p2p_ms"),
    NUM(attn_row, p2m_ms, "milliseconds of the summaries' first level (P2M), as p2p_ms"),
    NUM(attn_row, m2m_ms, "milliseconds of the coarser levels (M2M), as p2p_ms"),
};
static const struct column train_columns[] = {
    NUM(train_row, n, "tokens per sequence"),
    NUM(train_row, tokens_per_s, "tokens per second, all ranks"),
    NUM(train_row, flops_per_token, "model FLOPs per token, forward + backward"),
    NUM(train_row, mfu, "achieved FLOP rate / sgemm_gflops (the GEMM rate of the run's precision)"),
    NUM(train_row, mfu_peak,
        "achieved FLOP rate / the machine's peak: fma_peak_gflops on the CPU, "
        "published_peak_gflops (every rank's) on a GPU; NaN where unknown"),
    NUM(train_row, step_ms, "milliseconds, median training step"),
    NUM(train_row, sgemm_adjacent_gflops,
        "GFLOP/s, all ranks: one SGEMM product (as sgemm_gflops') after each timed step, median "
        "(NaN on a GPU)"),
    NUM(train_row, peak_adjacent_gflops,
        "GFLOP/s, all ranks: the FMA peak measured after each timed step, median (NaN on a GPU)"),
    NUM(train_row, mfu_adjacent,
        "median over the timed steps of the step's FLOP rate / the SGEMM rate measured after it"),
    NUM(train_row, mfu_peak_adjacent,
        "median over the timed steps of the step's FLOP rate / the FMA peak measured after it"),
    NUM(train_row, peak_bytes, "bytes of peak labelled memory on the step's device, largest rank"),
    NUM(train_row, near_ms,
        "milliseconds per step, mean over ranks: fma's near field (P2P; thread-ms, 0 for others)"),
    NUM(train_row, far_ms,
        "milliseconds per step, mean over ranks: fma's far field (P2M + M2M + M2P; thread-ms)"),
    NUM(train_row, exchange_ms,
        "milliseconds per step, mean over ranks: blocking exchanges between sequence ranks "
        "(halos, LET, ring; waits included)"),
    NUM(train_row, allreduce_ms, "milliseconds per step, mean over ranks: gradient allreduce"),
    NUM(train_row, optimizer_ms, "milliseconds per step, mean over ranks: gradient norm and AdamW"),
    NUM(train_row, busy_max_ms,
        "milliseconds per step outside blocking communication, the busiest rank"),
    NUM(train_row, busy_mean_ms,
        "milliseconds per step outside blocking communication, mean over ranks"),
    NUM(train_row, gemm_ms,
        "milliseconds per step, mean over ranks: the linear layers' GEMMs (bias copies included)"),
    NUM(train_row, attention_ms,
        "milliseconds per step, mean over ranks: the attention operators (exchanges included)"),
    NUM(train_row, norm_ms, "milliseconds per step, mean over ranks: layer norms"),
    NUM(train_row, activation_ms, "milliseconds per step, mean over ranks: GELU"),
    NUM(train_row, dropout_ms,
        "milliseconds per step, mean over ranks: dropout and its residual adds"),
    NUM(train_row, copy_ms,
        "milliseconds per step, mean over ranks: head split/merge, positions, embedding, zeroing"),
    NUM(train_row, loss_ms, "milliseconds per step, mean over ranks: softmax cross-entropy"),
    NUM(train_row, other_ms,
        "milliseconds per step, mean over ranks: the step less every kind timed above"),
};
static const struct column gpu_columns[] = {
    TEXT(gpu_row, kind, "attention (one layer's forward + backward) or train (a step)"),
    TEXT(gpu_row, variant, "attention variant"),
    NUM(gpu_row, n, "tokens"),
    TEXT(gpu_row, precision, "fp32 or bf16 (the products' operands)"),
    NUM(gpu_row, seq_ranks, "ranks sharing the sequence"),
    NUM(gpu_row, gemm_calls, "cuBLAS products per repetition (a strided batch counts once)"),
    NUM(gpu_row, gemm_flops, "their FLOPs, 2·M·N·K·batch, per repetition"),
    NUM(gpu_row, gemm_operand_elements,
        "distinct elements they read (A, B: an operand of stride 0 in a batch once; C where beta "
        "is not 0), per repetition"),
    NUM(gpu_row, gemm_operand_bytes,
        "the bytes of those elements (2 per bf16 operand element, 4 per fp32), per repetition"),
    NUM(gpu_row, elements_converted,
        "elements copied into another precision (bf16 copies of fp32 arrays that bf16 products "
        "read), per repetition"),
    NUM(gpu_row, elements_converted_in_pass,
        "of those, the copies a kernel wrote beside its own output from an fp32 array it read "
        "anyway (only their bf16 write is traffic), per repetition"),
    NUM(gpu_row, kernel_launches,
        "gpu/'s own kernel launches per repetition (cuBLAS's not "
        "included)"),
    NUM(gpu_row, mallocs_after_first_step, "cudaMalloc calls over the timed repetitions"),
    NUM(gpu_row, pool_live_peak_bytes, "bytes of the pool's blocks in use, at their peak"),
    NUM(gpu_row, pool_reserved_peak_bytes, "bytes the pool holds (in use and cached), at the peak"),
    NUM(gpu_row, device_bytes_outside_pool,
        "bytes in use on the device outside the pool (context, cuBLAS, NCCL) at the end; -1: the "
        "driver did not say"),
};
static const struct column comm_columns[] = {
    TEXT(comm_row, variant, "attention variant"),
    NUM(comm_row, n, "tokens"),
    NUM(comm_row, open, "attention.fma.open of the row (-1: all; 0 for variants that do not open)"),
    NUM(comm_row, seq_ranks, "ranks sharing the sequence"),
    {"bytes_per_rank_per_layer", offsetof(struct comm_row, bytes), false,
     "bytes sent by the busiest rank in one attention forward + backward"},
    {"exchanges_per_layer", offsetof(struct comm_row, exchanges), false,
     "blocking exchanges between sequence ranks in one attention forward + backward (most on any "
     "rank): collectives, sendrecvs, alltoallvs, non-blocking exchanges"},
    NUM(comm_row, fwd_ms, "milliseconds, median forward (slowest rank)"),
    NUM(comm_row, bwd_ms, "milliseconds, median backward (slowest rank)"),
    NUM(comm_row, work_imbalance,
        "the busiest sequence rank's attention FLOPs over the mean (the variant's own count of its "
        "slab's work: near pairs and far rows from the interaction lists, the upward pass shared "
        "equally); 1 = balanced"),
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
  /* every rank measures at once, as they will run: the machine's rate is the sum; on a GPU the
   * device's products in both precisions, and the rate of the run's precision is the baseline */
  char err[256], device[256];
  const struct backend *be = backend_for(cfg, err, sizeof err);
  if (!be) error("%s", err);
  be->describe(device, sizeof device);
  comm_barrier(comm, COMM_WORLD);
  double rates[3] = {be->gemm_gflops ? be->gemm_gflops(false) : bench_sgemm_gflops(),
                     be->gemm_gflops ? be->gemm_gflops(true) : NAN, 0.0};
  case_done(be); /* the rate's matrices (4.3 GB at 16384) are not the first case's reserve */
  const bool bf16 = cfg->parallel.precision == PRECISION_BF16;
  double rank_rate = bf16 ? rates[1] : rates[0];
  rates[2] = rank_rate;
  comm_allreduce_sum_double(comm, COMM_WORLD, rates, 3);
  const double machine_rate = rates[2];
  message("bench on %s; %d rank(s); GEMM %.1f GFLOP/s per rank (%s), %.1f GFLOP/s in all", device,
          comm->world_size, rank_rate, bf16 ? "bf16 operands" : "fp32", machine_rate);
  if (be->gemm_gflops)
    message("bench: the device's GEMM rates, per rank: fp32 %.1f, bf16 %.1f GFLOP/s",
            rates[0] / comm->world_size, rates[1] / comm->world_size);
  const char *isa = "";
  double peak_thread = NAN, peak = NAN, published = NAN;
  if (be->gemm_gflops) { /* a GPU: its published peak, against which MFU is also reported */
    published = published_peak_gflops(device, bf16);
    peak_machine_ = published * comm->world_size;
    peak_kind_ = "published peak";
    if (isfinite(published))
      message(
          "bench: the device's published dense %s peak %.1f TFLOP/s; its GEMM runs at %.0f%% "
          "of it",
          bf16 ? "bf16" : "fp32", published / 1e3, 100.0 * rank_rate / published);
  } else { /* the CPU's own peak beside its SGEMM rate (docs/perf.md) */
    comm_barrier(comm, COMM_WORLD);
    peak_thread = fma_peak_gflops_per_thread(&isa);
    peak = peak_thread * threads_count();
    comm_allreduce_sum_double(comm, COMM_WORLD, &peak, 1);
    peak_machine_ = peak;
    message(
        "bench: fp32 FMA peak %.1f GFLOP/s per thread (%s), %.1f in all; SGEMM runs at %.0f%% "
        "of it",
        peak_thread, isa, peak, 100.0 * machine_rate / peak);
    if (machine_rate < 0.5 * peak)
      warning(
          "SGEMM runs at %.0f%% of the FMA peak (BLAS core %s): the BLAS kernels are not this "
          "CPU's best (docs/perf.md)",
          100.0 * machine_rate / peak, threads_blas_core());
  }
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
  h5_attr_string(f, "/", "device", device);
  h5_attr_string(f, "/", "precision", bf16 ? "bf16" : "fp32");
  if (be->gemm_gflops) { /* the device's rates, both precisions, all ranks */
    h5_attr_double(f, "/", "fp32_gemm_gflops", rates[0]);
    h5_attr_double(f, "/", "bf16_gemm_gflops", rates[1]);
  }
  h5_attr_long(f, "/", "threads", threads_count());
  h5_attr_long(f, "/", "ranks", comm->world_size);
  h5_attr_string(f, "/", "deck", cfg->resolved);
  h5_attr_string(f, "/", "version", PACKAGE_VERSION);
  h5_attr_string(f, "/", "blas_core", threads_blas_core());
  const char *from = blas_core_corrected_from();
  h5_attr_string(f, "/", "blas_core_corrected_from", from ? from : "");
  h5_attr_string(f, "/", "tile_gemm", tile_gemm_kernels());
  h5_attr_double(f, "/", "fma_peak_gflops", peak);
  h5_attr_double(f, "/", "published_peak_gflops", published);
  h5_attr_double(f, "/", "fma_peak_gflops_per_thread", peak_thread);
  h5_attr_string(f, "/", "fma_peak_isa", isa);
  write_table(f, "attention", arows, sizeof arows[0], na, attn_columns, NCOLS(attn_columns));
  write_table(f, "train", trows, sizeof trows[0], nt, train_columns, NCOLS(train_columns));
  write_table(f, "comm", crows, sizeof crows[0], nc, comm_columns, NCOLS(comm_columns));
  write_table(f, "generate", grows, sizeof grows[0], ng, gen_columns, NCOLS(gen_columns));
  write_table(f, "gpu", gpu_rows_, sizeof gpu_rows_[0], gpu_nrows_, gpu_columns,
              NCOLS(gpu_columns));
  h5_close(f);
  message("wrote %s", path);
  return 0;
}
