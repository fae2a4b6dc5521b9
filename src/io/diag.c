/* diag.h5 writer (diag.h). */
#include "io/diag.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "core/error.h"
#include "core/h5io.h"
#include "tasks/tasks.h"

static const char *phase_units =
    "milliseconds in this step on rank 0; inclusive: attention time is also in forward and "
    "backward, comm time in the phase that communicates, io holds this step's checkpoint and "
    "diagnostics writes";

void diag_open(struct diag *diag, const struct config *cfg, const struct comm *comm,
               const char *run_dir, long restart_step) {
  memset(diag, 0, sizeof *diag);
  diag->active = comm->world_rank == 0;
  snprintf(diag->path, sizeof diag->path, "%s/diag.h5", run_dir);
  if (!diag->active) return;
  hid_t f;
  if (restart_step >= 0 && access(diag->path, F_OK) == 0) {
    f = h5_open(diag->path, true);
    h5_truncate_series(f, "/train", "/train/step", (double)restart_step);
    h5_truncate_series(f, "/timing", "/train/step", (double)restart_step);
    h5_truncate_series(f, "/comm", "/train/step", (double)restart_step);
    h5_truncate_series(f, "/memory", "/train/step", (double)restart_step);
    h5_truncate_series(f, "/eval", "/eval/step", (double)restart_step);
    h5_truncate_series(f, "/attention", "/attention/step", (double)restart_step);
    h5_truncate_series(f, "/task", "/task/step", (double)restart_step);
    h5_attr_long(f, "/", "restarted_at", restart_step);
  } else {
    f = h5_create(diag->path);
  }
  char started[64];
  time_t now = time(NULL);
  strftime(started, sizeof started, "%Y-%m-%dT%H:%M:%S%z", localtime(&now));
  h5_attr_string(f, "/", "deck", cfg->resolved);
  h5_attr_string(f, "/", "version", PACKAGE_VERSION);
  h5_attr_long(f, "/", "ranks", comm->world_size);
  h5_attr_long(f, "/", "seq_ranks", comm->S);
  h5_attr_string(f, "/", "started", started);
  h5_close(f);
}

/* Every append opens and closes the file (a reader never sees a half-written record); the time
 * counts as I/O. */
static hid_t diag_file_open(const struct diag *diag) {
  timer_start(TIMER_IO);
  return h5_open(diag->path, true);
}

static void diag_file_close(hid_t f) {
  h5_close(f);
  timer_stop(TIMER_IO);
}

static void scalar(hid_t f, const char *path, double v, const char *units) {
  h5_append_doubles(f, path, 0, NULL, &v, units);
}

void diag_train(struct diag *diag, const struct diag_train_record *r) {
  if (!diag->active) return;
  hid_t f = diag_file_open(diag);
  scalar(f, "/train/step", (double)r->step, "optimizer steps completed");
  scalar(f, "/train/loss", r->loss, "nats per predicted byte (training batch, dropout on)");
  scalar(f, "/train/bpc", r->bpc, "bits per byte (loss / ln 2)");
  scalar(f, "/train/lr", r->lr, "learning rate of this step");
  scalar(f, "/train/grad_norm", r->grad_norm, "global L2 norm of the gradient before clipping");
  scalar(f, "/train/step_ms", r->step_ms,
         "milliseconds of wall time for this step's data, forward, backward, allreduce and update");
  scalar(f, "/train/tokens_per_s", r->tokens_per_s, "tokens per second, all ranks");
  for (int p = 0; p < TIMER_DIAG_COUNT; p++) {
    char path[64];
    snprintf(path, sizeof path, "/timing/%s_ms", timer_name((enum timer_id)p));
    scalar(f, path, r->phase_ms[p], phase_units);
  }
  scalar(f, "/comm/bytes_per_step", r->comm_bytes,
         "bytes sent per rank in this step (max over ranks)");
  scalar(f, "/comm/exchanges_per_layer", r->exchanges_per_layer,
         "blocking exchanges between sequence ranks (collectives, sendrecvs, alltoallvs, "
         "non-blocking exchanges) in this step's forward and backward, per block, its diagnostics "
         "included (max over ranks)");
  scalar(f, "/memory/peak_bytes", r->peak_bytes,
         "peak labelled memory per rank so far (max over ranks), bytes");
  diag_file_close(f);
}

void diag_eval(struct diag *diag, long step, double loss) {
  if (!diag->active) return;
  hid_t f = diag_file_open(diag);
  scalar(f, "/eval/step", (double)step, "optimizer steps completed");
  scalar(f, "/eval/valid_loss", loss, "nats per predicted byte on the validation windows");
  scalar(f, "/eval/valid_bpc", loss / log(2.0), "bits per byte on the validation windows");
  diag_file_close(f);
}

/* A task's accuracy as record series under prefix ("/task/valid_", "/test/"). */
static void task_records(hid_t f, const char *prefix, const char *split,
                         const struct task_score *score) {
  struct task_accuracy r;
  const int nb = score->buckets;
  double *acc = xmalloc(sizeof(double) * (size_t)nb), *cnt = xmalloc(sizeof(double) * (size_t)nb);
  task_score_result(score, &r, acc, cnt);
  char path[96], what[256];
  snprintf(path, sizeof path, "%saccuracy", prefix);
  snprintf(what, sizeof what, "share of the %s set's scored targets whose argmax is the target",
           split);
  scalar(f, path, r.accuracy, what);
  snprintf(path, sizeof path, "%ssample_accuracy", prefix);
  snprintf(what, sizeof what, "share of the %s set's samples with every scored target right",
           split);
  scalar(f, path, r.sample_accuracy, what);
  const long shape[1] = {nb};
  snprintf(path, sizeof path, "%saccuracy_by_distance", prefix);
  h5_append_doubles(f, path, 1, shape, acc,
                    "accuracy of the scored targets in each distance bucket (/task/distance_start "
                    ".. distance_end); NaN: none there");
  snprintf(path, sizeof path, "%sscored_by_distance", prefix);
  h5_append_doubles(f, path, 1, shape, cnt, "scored targets in each distance bucket");
  free(acc);
  free(cnt);
  if (!h5_exists(f, "/task/distance_start")) { /* fixed: not a record series */
    double *lo = xmalloc(sizeof(double) * (size_t)nb), *hi = xmalloc(sizeof(double) * (size_t)nb);
    for (int k = 0; k < nb; k++) {
      long a, b;
      task_bucket_edges(k, score->n, &a, &b);
      lo[k] = (double)a;
      hi[k] = (double)b;
    }
    h5_write_doubles(f, "/task/distance_start", 1, shape, lo,
                     "smallest distance (tokens back) of each distance bucket");
    h5_write_doubles(f, "/task/distance_end", 1, shape, hi,
                     "distance after the largest of each distance bucket");
    free(lo);
    free(hi);
  }
}

void diag_test(struct diag *diag, long step, double loss, const struct task_score *score) {
  if (!diag->active) return;
  hid_t f = diag_file_open(diag);
  scalar(f, "/test/step", (double)step, "optimizer steps completed");
  scalar(f, "/test/loss", loss, "nats per predicted byte on the test windows");
  scalar(f, "/test/bpc", loss / log(2.0), "bits per byte on the test windows");
  if (score) task_records(f, "/test/", "test", score);
  diag_file_close(f);
}

void diag_task(struct diag *diag, long step, const struct task_score *score) {
  if (!diag->active) return;
  hid_t f = diag_file_open(diag);
  scalar(f, "/task/step", (double)step, "optimizer steps completed");
  task_records(f, "/task/valid_", "validation", score);
  diag_file_close(f);
}

void diag_attention(struct diag *diag, long step, int L, int H, int bands, const double *mass,
                    const double *entropy, const double *open_mass, const double *opened) {
  if (!diag->active) return;
  hid_t f = diag_file_open(diag);
  scalar(f, "/attention/step", (double)step,
         "optimizer steps completed before the forward pass that was examined");
  long ms[3] = {L, H, bands}, es[2] = {L, H};
  h5_append_doubles(f, "/attention/level_mass", 3, ms, mass,
                    "share of attention probability on [near field, level 1, ..., level L], "
                    "averaged over queries");
  h5_append_doubles(f, "/attention/entropy", 2, es, entropy,
                    "nats: entropy of the attention distribution, averaged over queries");
  if (open_mass) { /* fma.open: what the opening gave, and how much it opened */
    h5_append_doubles(f, "/attention/open_mass", 2, es, open_mass,
                      "share of attention probability on the exact tokens of opened fine blocks "
                      "(fma.open), averaged over queries; level_mass holds the rest");
    const long os[2] = {L, bands - 1};
    h5_append_doubles(f, "/attention/opened", 2, os, opened,
                      "windows opened per query at [level 1, ..., level L] (fma.open), averaged "
                      "over queries and heads");
  }
  diag_file_close(f);
}

void diag_memory_summary(struct diag *diag, const double *label_peaks, int count,
                         const char *const *names) {
  if (!diag->active) return;
  hid_t f = diag_file_open(diag);
  for (int i = 0; i < count; i++) {
    char name[64];
    snprintf(name, sizeof name, "%s_peak_bytes", names[i]);
    if (h5_exists(f, "/memory")) h5_attr_double(f, "/memory", name, label_peaks[i]);
  }
  diag_file_close(f);
}

void diag_resident_peak(struct diag *diag, double bytes) {
  if (!diag->active) return;
  hid_t f = diag_file_open(diag);
  if (h5_exists(f, "/memory")) h5_attr_double(f, "/memory", "resident_peak_bytes", bytes);
  diag_file_close(f);
}
