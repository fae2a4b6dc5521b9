/* Train, eval and generate modes (train.h): the step loop (data → forward → backward → gradient
 * allreduce → clip → AdamW), the console line of SPEC §9, validation and test, attention
 * diagnostics, checkpoints at cadence, at the end and on SIGTERM/SIGUSR1, and the final summary.
 * Every decision that ends or branches the loop is agreed by all ranks first. */
#include "run/train.h"

#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "core/error.h"
#include "core/fault.h"
#include "core/memory.h"
#include "core/rng.h"
#include "core/threads.h"
#include "core/timer.h"
#include "io/checkpoint.h"
#include "io/diag.h"
#include "model/optimizer.h"
#include "tasks/tasks.h"

static volatile sig_atomic_t stop_signal = 0;

static void on_signal(int sig) { stop_signal = sig; }

static void install_signals(void) {
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGTERM, &sa, NULL);
  sigaction(SIGUSR1, &sa, NULL);
}

/* mkdir -p */
static int make_dirs(const char *path) {
  char buf[1024];
  snprintf(buf, sizeof buf, "%s", path);
  for (char *p = buf + 1; *p; p++) {
    if (*p != '/') continue;
    *p = '\0';
    if (mkdir(buf, 0775) != 0 && errno != EEXIST) return errno;
    *p = '/';
  }
  if (mkdir(buf, 0775) != 0 && errno != EEXIST) return errno;
  return 0;
}

void train_make_run_dir(const struct config *cfg, struct comm *comm, char *dir, size_t len) {
  snprintf(dir, len, "%s/%s", cfg->output.dir, cfg->run.name);
  int rc = 0;
  if (comm->world_rank == 0) {
    rc = make_dirs(dir);
    if (!rc) {
      char probe[1100];
      snprintf(probe, sizeof probe, "%s/.fmattn_write_test", dir);
      FILE *f = fopen(probe, "w");
      if (!f)
        rc = errno;
      else {
        fclose(f);
        remove(probe);
      }
    }
  }
  comm_allreduce_max_int(comm, COMM_WORLD, &rc, 1);
  if (rc) {
    char msg[1400];
    snprintf(msg, sizeof msg, "cannot write to output directory '%s': %s (check output.dir)", dir,
             strerror(rc));
    error_collective(msg);
  }
}

/* ---------------------------------------------------------------------------------------------
 * evaluation */

double train_evaluate(struct model *m, const struct dataset *ds, struct comm *comm,
                      enum data_split split, long *count, struct task_score *score) {
  timer_start(TIMER_EVAL);
  const long windows = data_eval_windows(ds, split);
  const long per_round = m->B * comm->D, BT = m->B * m->T;
  double sums[2] = {0.0, 0.0}; /* loss, count */
  int *distance = NULL;        /* (B, T) each target's distance, for the accuracy by distance */
  int *own_pred = NULL;        /* the argmax buffer, when the caller has not set one */
  if (score) {
    task_score_open(score, m->n, windows);
    distance = xmalloc(sizeof(int) * (size_t)BT);
    if (!m->row_pred) m->row_pred = own_pred = mem_alloc(MEM_ACTIVATIONS, sizeof(int) * (size_t)BT);
  }
  for (long first = 0; first < windows; first += per_round) {
    data_eval_rows(ds, split, first + comm->replica, comm->D, windows, m->B, m->t0, m->T, m->tokens,
                   m->targets, distance);
    long c = 0;
    sums[0] += model_forward(m, 0, false, 0.0f, &c);
    sums[1] += (double)c;
    if (score)
      task_score_add(score, first + comm->replica, comm->D, m->B, m->T, m->targets, m->row_pred,
                     distance);
  }
  comm_allreduce_sum_double(comm, COMM_WORLD, sums, 2);
  if (score) comm_allreduce_sum_double(comm, COMM_WORLD, score->sums, score->count);
  if (own_pred) {
    mem_free(own_pred);
    m->row_pred = NULL;
  }
  free(distance);
  timer_stop(TIMER_EVAL);
  *count = (long)sums[1];
  return sums[1] > 0 ? sums[0] / sums[1] : NAN;
}

/* ---------------------------------------------------------------------------------------------
 * console */

static void format_eta(double seconds, char *buf, size_t len) {
  if (!(seconds >= 0) || seconds > 1e8) {
    snprintf(buf, len, "--:--:--");
    return;
  }
  long s = (long)(seconds + 0.5);
  snprintf(buf, len, "%02ld:%02ld:%02ld", s / 3600, (s / 60) % 60, s % 60);
}

void train_print_decomposition(const struct config *cfg, const struct comm *comm,
                               const struct model *m, const char *run_dir) {
  message(
      "run %s: mode %s, %d rank(s) = %d data replica(s) x %d sequence rank(s), %d thread(s) "
      "per rank",
      cfg->run.name, config_mode_name(cfg->run.mode), comm->world_size, comm->D, comm->S,
      threads_count());
  if (comm->world_size > 1 && m->bucket_lo)
    message("communication overlapped: the gradient allreduce in %d buckets behind the backward%s",
            m->L, comm->S > 1 ? "; fma's LET fetch behind the near field" : "");
  else if (comm->world_size > 1)
    message("communication blocking (%s)", comm->overlap ? "the transport's collectives are "
                                                           "asynchronous already"
                                                         : "parallel.overlap = false");
  message(
      "model: %d layers, dim %d, %d heads (size %d), mlp %d, vocab %d, context %ld, %s "
      "positions, %zu parameters",
      m->L, m->C, m->H, m->d, m->R, m->V, m->n, config_position_name(cfg->model.position),
      model_param_count(m));
  char heads[96] = "";
  if (cfg->attention.heads_mode == HEADS_FISH)
    snprintf(heads, sizeof heads, " with FiSH heads (%d global, %s mix, noise %g)", m->Hqk,
             cfg->attention.fish_mix, cfg->attention.fish_noise);
  message("attention: %s%s, %s; diagnostics in %d distance bands (fma.m = %d tree)", m->attn->name,
          heads, m->causal ? "causal" : "bidirectional", m->diag_bands, cfg->attention.fma_m);
  message(
      "batch: %d sequences per step (%ld per replica), slab of %ld tokens per rank "
      "(tokens [%ld, %ld) on sequence rank %d)",
      cfg->train.batch, m->B, m->T, m->t0, m->t0 + m->T, comm->seq_rank);
  char device[256];
  m->be->describe(device, sizeof device);
  message("device: %s", device);
#ifdef FMATTN_SMPI
  message(
      "SimGrid SMPI: every rank runs in one process on the simulated platform; the times and "
      "rates printed are simulated");
#endif
  message("output: %s", run_dir);
}

/* The final summary of SPEC §9 from the peaks already reduced over ranks: (MEM_NLABELS) host
 * labels, as many device labels, then the resident peak. */
static void print_summary(double test_loss, double wall, const double *peaks) {
  enum { N = MEM_NLABELS };
  message("---- summary ----");
  if (!isnan(test_loss)) message("test: loss %.4f | bpc %.4f", test_loss, test_loss / log(2.0));
  char w[32];
  format_eta(wall, w, sizeof w);
  message("wall time %s (%.1f s)", w, wall);
  message("peak memory per rank (max over ranks): %.1f MiB resident", peaks[2 * N] / 1048576.0);
  for (int i = 0; i < N; i++)
    if (peaks[i] > 0)
      message("  %-12s %10.1f MiB", mem_label_name((enum mem_label)i), peaks[i] / 1048576.0);
  for (int i = 0; i < N; i++)
    if (peaks[N + i] > 0)
      message("  device %-12s %10.1f MiB", mem_label_name((enum mem_label)i),
              peaks[N + i] / 1048576.0);
  message("time by phase (rank 0, inclusive):");
  for (int i = 0; i < TIMER_COUNT; i++)
    if (timer_total_ms((enum timer_id)i) > 0)
      message("  %-12s %10.1f s", timer_name((enum timer_id)i),
              timer_total_ms((enum timer_id)i) / 1e3);
}

void train_print_summary(const struct config *cfg, struct comm *comm, double wall,
                         double test_loss) {
  enum { N = MEM_NLABELS };
  double peaks[2 * N + 1];
  for (int i = 0; i < N; i++) {
    peaks[i] = (double)mem_peak((enum mem_label)i);
    peaks[N + i] = (double)mem_device_peak((enum mem_label)i);
  }
  peaks[2 * N] = (double)mem_process_peak_rss();
  comm_allreduce_max_double(comm, COMM_WORLD, peaks, 2 * N + 1);
  print_summary(test_loss, wall, peaks);
}

bool train_attention_average(struct model *m, struct comm *comm, double *mass, double *entropy,
                             double *open_mass, double *opened) {
  const int L = m->L, H = m->H, bands = m->diag_bands;
  const size_t nm = (size_t)(L * H * bands), ne = (size_t)(L * H);
  const size_t no = m->diag_open_mass ? ne : 0, nw = m->diag_open_mass ? (size_t)(L * bands) : 0;
  const size_t n = nm + ne + no + nw;
  double *buf = xmalloc(sizeof(double) * (n + 1));
  memcpy(buf, m->diag_mass, sizeof(double) * nm);
  memcpy(buf + nm, m->diag_entropy, sizeof(double) * ne);
  if (no) memcpy(buf + nm + ne, m->diag_open_mass, sizeof(double) * no);
  if (nw) memcpy(buf + nm + ne + no, m->diag_opened, sizeof(double) * nw);
  buf[n] = (double)m->diag_queries;
  /* only replica 0's batch element 0 is examined; its sequence ranks hold disjoint queries */
  if (comm->replica != 0) memset(buf, 0, sizeof(double) * (n + 1));
  comm_allreduce_sum_double(comm, COMM_WORLD, buf, n + 1);
  const double q = buf[n];
  for (size_t i = 0; i < n && q > 0; i++) buf[i] /= i < nm + ne + no ? q : q * H; /* per query */
  memcpy(mass, buf, sizeof(double) * nm);
  memcpy(entropy, buf + nm, sizeof(double) * ne);
  if (no && open_mass) memcpy(open_mass, buf + nm + ne, sizeof(double) * no);
  for (int l = 0; nw && opened && l < L; l++) /* levels 1 .. L (the sums' index 0 is unused) */
    memcpy(opened + l * (bands - 1), buf + nm + ne + no + l * bands + 1,
           sizeof(double) * (size_t)(bands - 1));
  free(buf);
  return q > 0;
}

/* Diagnostics of the last forward, averaged over the queries of every rank, into diag.h5. */
static void record_attention(struct model *m, struct comm *comm, struct diag *diag, long step) {
  double *mass = xmalloc(sizeof(double) * (size_t)(m->L * m->H * m->diag_bands));
  double *entropy = xmalloc(sizeof(double) * (size_t)(m->L * m->H));
  double *open_mass = m->diag_open_mass ? xmalloc(sizeof(double) * (size_t)(m->L * m->H)) : NULL;
  double *opened =
      m->diag_open_mass ? xmalloc(sizeof(double) * (size_t)(m->L * m->diag_bands)) : NULL;
  if (train_attention_average(m, comm, mass, entropy, open_mass, opened))
    diag_attention(diag, step, m->L, m->H, m->diag_bands, mass, entropy, open_mass, opened);
  free(mass);
  free(entropy);
  free(open_mass);
  free(opened);
}

/* ---------------------------------------------------------------------------------------------
 * train */

long train_open_run(struct run_state *rs, const struct config *cfg, struct comm *comm,
                    bool need_restart) {
  rs->cfg = cfg;
  rs->comm = comm;
  rs->restart[0] = '\0';
  train_make_run_dir(cfg, comm, rs->dir, sizeof rs->dir);
  data_open(&rs->ds, cfg);
  model_build(&rs->model, cfg, comm, cfg->train.batch / comm->D);
  long step = 0;
  if (cfg->output.restart[0]) {
    step = checkpoint_restore(&rs->model, comm, cfg->output.restart, rs->dir, rs->restart,
                              sizeof rs->restart);
  } else if (need_restart) {
    error_collective("this mode needs a checkpoint: set output.restart = latest or a path");
  } else {
    model_init_params(&rs->model);
  }
  return step;
}

void train_close_run(struct run_state *rs) {
  model_free(&rs->model);
  data_close(&rs->ds);
}

/* One training step's figures, for the console line and diag.h5. */
struct step_stats {
  double loss, norm, lr, step_ms;
  uint64_t bytes0;  /* this rank's bytes sent before the step */
  double exchanges; /* blocking exchanges between sequence ranks per block, forward + backward */
};

/* The global batch of `step`: each replica's local windows; returns the number of predicted
 * positions over all ranks (the loss is their mean). */
static double train_batch(struct run_state *rs, long step) {
  struct model *m = &rs->model;
  struct comm *comm = rs->comm;
  timer_start(TIMER_DATA);
  data_train_batch(&rs->ds, step, (long)comm->replica * m->B, m->B, m->t0, m->T, m->tokens,
                   m->targets);
  double counted = 0.0;
  for (long i = 0; i < m->B * m->T; i++) counted += m->targets[i] >= 0;
  comm_allreduce_sum_double(comm, COMM_WORLD, &counted, 1);
  timer_stop(TIMER_DATA);
  return counted;
}

/* Ends the run on a loss or gradient norm that is not a number, before the step is applied. */
static void refuse_nonfinite(const char *what, double value, long step) {
  char msg[512];
  snprintf(msg, sizeof msg,
           "%s is %f at step %ld: the step is not applied and the run stops without writing a "
           "checkpoint (the last good one is kept); try a lower train.lr or a tighter train.clip",
           what, value, step + 1);
  error_collective(msg);
}

/* The training step of SPEC §1: forward and backward of the global batch, the gradient
 * allreduce, the checks of loss and gradient norm, clipping, and the AdamW step. */
static struct step_stats train_step(struct run_state *rs, long step, bool diag_now) {
  const struct config *cfg = rs->cfg;
  struct model *m = &rs->model;
  struct comm *comm = rs->comm;
  struct step_stats st = {.bytes0 = comm->bytes_sent};
  const double t0 = timer_now();
  const double counted = train_batch(rs, step);
  m->diag_request = diag_now && m->attn->diagnostics;
  model_zero_grads(m);
  long c = 0;
  double sums[2];
  const uint64_t x0 = comm->exchanges;
  sums[0] = model_forward(m, step, true, counted > 0 ? (float)(1.0 / counted) : 0.0f, &c);
  sums[1] = (double)c;
  model_backward(m, step);
  st.exchanges = (double)(comm->exchanges - x0) / m->L;

  /* the phase timers wait for the device's queue (a no-op on the CPU): the backward's queued tail
   * is neither the allreduce's time nor the optimizer's */
  m->be->sync();
  timer_start(TIMER_COMM);
  model_allreduce_grads(m);
  comm_allreduce_sum_double(comm, COMM_WORLD, sums, 2);
  m->be->sync();
  timer_stop(TIMER_COMM);
  float poison; /* the test suite's faults (fault.h) */
  if (fault_poison(FAULT_GRAD, step + 1, &poison)) model_poison_grad(m, poison);
  if (fault_poison(FAULT_LOSS, step + 1, &poison)) sums[0] = poison;
  /* a batch can hold no predicted position (a masked objective on a sparse task): its loss is
   * undefined and its gradient zero, which is not a divergence */
  st.loss = sums[1] > 0 ? sums[0] / sums[1] : 0.0;
  if (sums[1] == 0 && comm->world_rank == 0)
    warning("step %ld: the batch has no predicted positions; its loss is reported as 0", step + 1);
  if (!isfinite(st.loss)) refuse_nonfinite("training loss", st.loss, step);

  timer_start(TIMER_OPTIMIZER);
  st.norm = optimizer_grad_norm(m);
  if (!isfinite(st.norm)) { /* the loss can be finite while a gradient overflows */
    timer_stop(TIMER_OPTIMIZER);
    refuse_nonfinite("the gradient norm", st.norm, step);
  }
  st.lr = optimizer_lr(cfg, step);
  const float clip =
      cfg->train.clip > 0 && st.norm > cfg->train.clip ? (float)(cfg->train.clip / st.norm) : 1.0f;
  optimizer_step(m, step + 1, st.lr, clip);
  timer_stop(TIMER_OPTIMIZER);
  st.step_ms = 1e3 * (timer_now() - t0);
  return st;
}

/* Write the checkpoint of `step`, keep the output.keep newest, and say so. */
static void train_checkpoint(struct run_state *rs, long step) {
  const double s = checkpoint_write(&rs->model, rs->comm, step, rs->dir);
  if (rs->comm->world_rank == 0) checkpoint_prune(rs->dir, rs->cfg->output.keep);
  message("checkpoint %s/ckpt_%06ld.h5 (%.2f s)", rs->dir, step, s);
}

/* The console line of SPEC §9 for the step just done, and its diag.h5 record (phase times are
 * filled in at the end of the iteration, so that they include its checkpoint and I/O). */
static struct diag_train_record train_log(struct run_state *rs, long done,
                                          const struct step_stats *st, double per_step) {
  const struct config *cfg = rs->cfg;
  const double tokens = (double)cfg->train.batch * (double)rs->model.n;
  const double tok_s = tokens / (st->step_ms / 1e3);
  char eta[32];
  format_eta(per_step * (double)(cfg->train.steps - done), eta, sizeof eta);
  message(
      "step %ld/%ld | loss %.4f | bpc %.3f | lr %.1e | norm %.2f | %.0f ms | %.0f tok/s | "
      "eta %s",
      done, cfg->train.steps, st->loss, st->loss / log(2.0), st->lr, st->norm, st->step_ms, tok_s,
      eta);
  /* bytes sent since the step began, its diagnostics included */
  double rec[3] = {(double)(rs->comm->bytes_sent - st->bytes0), (double)mem_peak_total(),
                   st->exchanges};
  comm_allreduce_max_double(rs->comm, COMM_WORLD, rec, 3);
  struct diag_train_record r = {.step = done,
                                .loss = st->loss,
                                .bpc = st->loss / log(2.0),
                                .lr = st->lr,
                                .grad_norm = st->norm,
                                .step_ms = st->step_ms,
                                .tokens_per_s = tok_s,
                                .comm_bytes = rec[0],
                                .exchanges_per_layer = rec[2],
                                .peak_bytes = rec[1]};
  return r;
}

/* Validation (or the test split) of the current parameters: console line and diag.h5; on a task
 * also the accuracy on its scored targets (/task for validation, /test for the test split). */
static double train_validate(struct run_state *rs, long step, enum data_split split) {
  long cnt;
  const bool task = data_is_task(&rs->ds);
  struct task_score score;
  const double l = train_evaluate(&rs->model, &rs->ds, rs->comm, split, &cnt, task ? &score : NULL);
  char acc[128] = "";
  if (task) {
    struct task_accuracy r;
    task_score_result(&score, &r, NULL, NULL);
    snprintf(acc, sizeof acc, " | accuracy %.4f | samples all right %.4f", r.accuracy,
             r.sample_accuracy);
  }
  if (split == SPLIT_VALID) {
    message("eval step %ld | valid loss %.4f | valid bpc %.4f | %ld bytes%s", step, l, l / log(2.0),
            cnt, acc);
    diag_eval(&rs->diag, step, l);
    if (task) diag_task(&rs->diag, step, &score);
  } else {
    message("test  step %ld | test loss %.4f | test bpc %.4f | %ld bytes%s", step, l, l / log(2.0),
            cnt, acc);
    diag_test(&rs->diag, step, l, task ? &score : NULL);
  }
  if (task) task_score_close(&score);
  return l;
}

/* Peak memory per label (host, then device) and resident, the maxima over ranks, into diag.h5 and
 * the summary. Device labels are written only when a device back end counted any. */
static void train_report_memory(struct run_state *rs, double wall, double test_loss) {
  enum { N = MEM_NLABELS };
  double peaks[2 * N + 1];
  char device_names[N][64];
  const char *names[2 * N];
  for (int i = 0; i < N; i++) {
    peaks[i] = (double)mem_peak((enum mem_label)i);
    peaks[N + i] = (double)mem_device_peak((enum mem_label)i);
    names[i] = mem_label_name((enum mem_label)i);
    snprintf(device_names[i], sizeof device_names[i], "device_%s", names[i]);
    names[N + i] = device_names[i];
  }
  peaks[2 * N] = (double)mem_process_peak_rss();
  comm_allreduce_max_double(rs->comm, COMM_WORLD, peaks, 2 * N + 1);
  bool device = false;
  for (int i = 0; i < N; i++) device |= peaks[N + i] > 0;
  diag_memory_summary(&rs->diag, peaks, device ? 2 * N : N, names);
  diag_resident_peak(&rs->diag, peaks[2 * N]);
  print_summary(test_loss, wall, peaks);
}

/* Whether a signal on any rank asks every rank to stop before `step`: then the checkpoint of this
 * step is written (unless it just was). */
static int train_signalled(struct run_state *rs, long step, long last_ckpt) {
  int sig = (int)stop_signal;
  comm_allreduce_max_int(rs->comm, COMM_WORLD, &sig, 1);
  if (!sig) return 0;
  message("received signal %d: writing a checkpoint at step %ld and stopping", sig, step);
  if (last_ckpt != step) train_checkpoint(rs, step);
  return sig;
}

int train_run(const struct config *cfg, struct comm *comm) {
  const double wall0 = timer_now();
  fault_check();
  struct run_state rs;
  const long step0 = train_open_run(&rs, cfg, comm, false), steps = cfg->train.steps;
  struct model *m = &rs.model;
  diag_open(&rs.diag, cfg, comm, rs.dir, cfg->output.restart[0] ? step0 : -1);
  train_print_decomposition(cfg, comm, m, rs.dir);
  install_signals();

  long last_ckpt = cfg->output.restart[0] ? step0 : -1, steps_timed = 0;
  double time_timed = 0.0;
  int stopped = 0;
  for (long step = step0; step < steps && !stopped; step++) {
    if ((stopped = train_signalled(&rs, step, last_ckpt))) break;
    timer_step_reset();
    const bool diag_now = cfg->output.diag_every > 0 && step % cfg->output.diag_every == 0;
    const struct step_stats st = train_step(&rs, step, diag_now);
    const long done = step + 1;
    if (step > step0) { /* the first step carries start-up costs */
      steps_timed++;
      time_timed += st.step_ms / 1e3;
    }
    if (diag_now) record_attention(m, comm, &rs.diag, step);
    struct diag_train_record record;
    const bool logged = done % cfg->output.log_every == 0 || done == steps || done == step0 + 1;
    if (logged)
      record = train_log(&rs, done, &st,
                         steps_timed > 0 ? time_timed / (double)steps_timed : st.step_ms / 1e3);
    if (cfg->train.eval_every > 0 && done % cfg->train.eval_every == 0 && done != steps)
      train_validate(&rs, done, SPLIT_VALID);
    if (cfg->output.checkpoint_every > 0 && done % cfg->output.checkpoint_every == 0 &&
        done != steps) {
      train_checkpoint(&rs, done);
      last_ckpt = done;
    }
    if (logged) {
      for (int p = 0; p < TIMER_DIAG_COUNT; p++)
        record.phase_ms[p] = timer_step_ms((enum timer_id)p);
      diag_train(&rs.diag, &record);
    }
  }

  double test_loss = NAN;
  if (!stopped) { /* the end: a checkpoint of the final parameters, validation and test */
    const long final = steps > step0 ? steps : step0;
    if (last_ckpt != final) train_checkpoint(&rs, final);
    train_validate(&rs, final, SPLIT_VALID);
    test_loss = train_validate(&rs, final, SPLIT_TEST);
  } else {
    message("stopped by signal %d; resume with output.restart = latest", stopped);
  }
  train_report_memory(&rs, timer_now() - wall0, test_loss);
  train_close_run(&rs);
  return 0;
}
