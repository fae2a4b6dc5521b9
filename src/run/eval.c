/* `run.mode = eval`: the validation and test loss of the output.restart checkpoint over the
 * splits' evaluation windows (SPEC §4), printed and written to eval.h5 in the run directory with
 * what a user analyses next: the loss by position in the context (averaged over the windows in
 * position buckets: the curve of how much the model gains from more context), the attention
 * diagnostics (level mass and entropy) of the first validation batch, and on a task the accuracy
 * on its scored targets, per sample and by distance (docs/tasks.md). */
#include "run/eval.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/error.h"
#include "core/h5io.h"
#include "core/memory.h"
#include "core/timer.h"
#include "run/train.h"
#include "tasks/tasks.h"

#define EVAL_BUCKETS 32 /* position buckets over the context, at most */

/* Loss sums of one split: total and by position bucket, and their counts, summed over ranks; on a
 * task its accuracy sums too. */
struct split_loss {
  double sum, count;
  double *bsum, *bcount; /* (buckets) */
  bool task;
  struct task_score score;
};

/* As train_evaluate, keeping each position's loss; the first batch of the first split also
 * records the attention diagnostics when diag is set. Collective. */
static void evaluate_split(struct model *m, const struct dataset *ds, struct comm *comm,
                           enum data_split split, int buckets, struct split_loss *out, bool diag) {
  const long windows = data_eval_windows(ds, split), per_round = m->B * comm->D;
  const long T = m->T, n = m->n;
  memset(out->bsum, 0, sizeof(double) * (size_t)buckets);
  memset(out->bcount, 0, sizeof(double) * (size_t)buckets);
  out->sum = out->count = 0.0;
  out->task = data_is_task(ds);
  int *distance = NULL; /* (B, T) */
  if (out->task) {
    task_score_open(&out->score, n, windows);
    distance = xmalloc(sizeof(int) * (size_t)(m->B * T));
  }
  for (long first = 0; first < windows; first += per_round) {
    data_eval_rows(ds, split, first + comm->replica, comm->D, windows, m->B, m->t0, T, m->tokens,
                   m->targets, distance);
    m->diag_request = diag && first == 0 && m->attn->diagnostics;
    long c = 0;
    out->sum += model_forward(m, 0, false, 0.0f, &c);
    if (out->task)
      task_score_add(&out->score, first + comm->replica, comm->D, m->B, T, m->targets, m->row_pred,
                     distance);
    for (long b = 0; b < m->B; b++)
      for (long t = 0; t < T; t++) {
        if (m->targets[b * T + t] < 0) continue;
        const long k = (m->t0 + t) * buckets / n; /* the global position's bucket */
        out->bsum[k] += m->row_loss[b * T + t];
        out->bcount[k] += 1.0;
      }
    out->count += (double)c;
  }
  comm_allreduce_sum_double(comm, COMM_WORLD, &out->sum, 1);
  comm_allreduce_sum_double(comm, COMM_WORLD, &out->count, 1);
  comm_allreduce_sum_double(comm, COMM_WORLD, out->bsum, (size_t)buckets);
  comm_allreduce_sum_double(comm, COMM_WORLD, out->bcount, (size_t)buckets);
  if (out->task) comm_allreduce_sum_double(comm, COMM_WORLD, out->score.sums, out->score.count);
  free(distance);
}

/* A task's accuracy in eval.h5: /<split>/{accuracy, sample_accuracy, samples, accuracy_by_distance,
 * scored_by_distance}, and the bucket edges /distance/{start, end}. */
static void write_accuracy(hid_t f, const char *name, const struct task_score *score) {
  struct task_accuracy r;
  const int nb = score->buckets;
  double *acc = xmalloc(sizeof(double) * (size_t)nb), *cnt = xmalloc(sizeof(double) * (size_t)nb);
  task_score_result(score, &r, acc, cnt);
  char path[64];
  const long one[1] = {1}, shape[1] = {nb};
  const double vals[3] = {r.accuracy, r.sample_accuracy, r.samples};
  const char *cols[3] = {"accuracy", "sample_accuracy", "samples"};
  const char *what[3] = {"share of the scored targets whose argmax is the target",
                         "share of the samples with every scored target right",
                         "samples with a scored target"};
  for (int i = 0; i < 3; i++) {
    snprintf(path, sizeof path, "/%s/%s", name, cols[i]);
    h5_write_doubles(f, path, 1, one, &vals[i], what[i]);
  }
  snprintf(path, sizeof path, "/%s/accuracy_by_distance", name);
  h5_write_doubles(f, path, 1, shape, acc,
                   "accuracy of the scored targets in each distance bucket (/distance/start .. "
                   "end); NaN: none there");
  snprintf(path, sizeof path, "/%s/scored_by_distance", name);
  h5_write_doubles(f, path, 1, shape, cnt, "scored targets in each distance bucket");
  if (!h5_exists(f, "/distance/start")) {
    for (int k = 0; k < nb; k++) {
      long a, b;
      task_bucket_edges(k, score->n, &a, &b);
      acc[k] = (double)a;
      cnt[k] = (double)b;
    }
    h5_write_doubles(f, "/distance/start", 1, shape, acc,
                     "smallest distance (tokens back from the predicting position to the token "
                     "the target needs) of each bucket");
    h5_write_doubles(f, "/distance/end", 1, shape, cnt,
                     "distance after the largest of each bucket");
  }
  free(acc);
  free(cnt);
}

static void write_split(hid_t f, const char *name, const struct split_loss *s, int buckets) {
  char path[64];
  const double loss = s->count > 0 ? s->sum / s->count : NAN;
  const double vals[3] = {loss, loss / log(2.0), s->count};
  const char *cols[3] = {"loss", "bpc", "tokens"};
  const char *units[3] = {"nats per scored byte", "bits per scored byte",
                          "bytes scored (predicted positions; masked ones for mlm)"};
  const long one[1] = {1};
  for (int i = 0; i < 3; i++) {
    snprintf(path, sizeof path, "/%s/%s", name, cols[i]);
    h5_write_doubles(f, path, 1, one, &vals[i], units[i]);
  }
  double *bl = xmalloc(sizeof(double) * (size_t)buckets);
  for (int k = 0; k < buckets; k++) bl[k] = s->bcount[k] > 0 ? s->bsum[k] / s->bcount[k] : NAN;
  const long shape[1] = {buckets};
  snprintf(path, sizeof path, "/position/%s_loss", name);
  h5_write_doubles(f, path, 1, shape, bl, "mean loss (nats) of the scored bytes in each bucket");
  snprintf(path, sizeof path, "/position/%s_tokens", name);
  h5_write_doubles(f, path, 1, shape, s->bcount, "bytes scored in each bucket");
  free(bl);
}

int eval_run(const struct config *cfg, struct comm *comm) {
  const double wall0 = timer_now();
  struct run_state rs;
  const long step = train_open_run(&rs, cfg, comm, true);
  struct model *m = &rs.model;
  train_print_decomposition(cfg, comm, m, rs.dir);
  const int buckets = (int)(m->n < EVAL_BUCKETS ? m->n : EVAL_BUCKETS);
  m->row_loss = mem_alloc(MEM_ACTIVATIONS, sizeof(float) * (size_t)(m->B * m->T));
  m->row_pred = mem_alloc(MEM_ACTIVATIONS, sizeof(int) * (size_t)(m->B * m->T));
  struct split_loss sl[2];
  for (int s = 0; s < 2; s++) {
    sl[s].bsum = xcalloc((size_t)buckets, sizeof(double));
    sl[s].bcount = xcalloc((size_t)buckets, sizeof(double));
  }
  evaluate_split(m, &rs.ds, comm, SPLIT_VALID, buckets, &sl[0], true);
  const size_t nm = (size_t)(m->L * m->H * m->diag_bands), ne = (size_t)(m->L * m->H);
  const size_t nw = (size_t)(m->L * m->diag_bands);
  double *mass = xmalloc(sizeof(double) * nm), *entropy = xmalloc(sizeof(double) * ne);
  double *open_mass = xcalloc(ne, sizeof(double)), *opened = xcalloc(nw, sizeof(double));
  const bool have_diag =
      m->attn->diagnostics && train_attention_average(m, comm, mass, entropy, open_mass, opened);
  evaluate_split(m, &rs.ds, comm, SPLIT_TEST, buckets, &sl[1], false);
  const char *names[2] = {"valid", "test"};
  for (int s = 0; s < 2; s++) {
    const double loss = sl[s].count > 0 ? sl[s].sum / sl[s].count : NAN;
    char acc[128] = "";
    if (sl[s].task) {
      struct task_accuracy r;
      task_score_result(&sl[s].score, &r, NULL, NULL);
      snprintf(acc, sizeof acc, " | accuracy %.4f | samples all right %.4f", r.accuracy,
               r.sample_accuracy);
    }
    message("%s step %ld | %s loss %.4f | %s bpc %.4f | %.0f bytes%s", s ? "test" : "eval", step,
            names[s], loss, names[s], loss / log(2.0), sl[s].count, acc);
  }
  if (comm->world_rank == 0) {
    char path[1300];
    snprintf(path, sizeof path, "%s/eval.h5", rs.dir);
    hid_t f = h5_create(path);
    char started[64];
    const time_t now = time(NULL);
    strftime(started, sizeof started, "%Y-%m-%dT%H:%M:%S", localtime(&now));
    h5_attr_string(f, "/", "checkpoint", rs.restart);
    h5_attr_long(f, "/", "step", step);
    h5_attr_string(f, "/", "deck", cfg->resolved);
    h5_attr_string(f, "/", "version", PACKAGE_VERSION);
    h5_attr_string(f, "/", "created", started);
    h5_attr_long(f, "/", "ranks", comm->world_size);
    for (int s = 0; s < 2; s++) {
      write_split(f, names[s], &sl[s], buckets);
      if (sl[s].task) write_accuracy(f, names[s], &sl[s].score);
    }
    double *lo = xmalloc(sizeof(double) * (size_t)buckets), *hi = xmalloc(sizeof(double) * buckets);
    /* position t is in bucket t·buckets/n (rounded down), so bucket k holds the positions from
     * ⌈k·n/buckets⌉ up to, not including, ⌈(k+1)·n/buckets⌉ */
    for (int k = 0; k < buckets; k++) {
      lo[k] = (double)(((long)k * m->n + buckets - 1) / buckets);
      hi[k] = (double)(((long)(k + 1) * m->n + buckets - 1) / buckets);
    }
    const long shape[1] = {buckets};
    h5_write_doubles(f, "/position/start", 1, shape, lo, "first position of each bucket");
    h5_write_doubles(f, "/position/end", 1, shape, hi, "position after the last of each bucket");
    if (have_diag) {
      const long ms[3] = {m->L, m->H, m->diag_bands}, es[2] = {m->L, m->H};
      h5_write_doubles(f, "/attention/level_mass", 3, ms, mass,
                       "share of attention on the near field and each level, first valid batch");
      h5_write_doubles(f, "/attention/entropy", 2, es, entropy,
                       "attention entropy (nats), first valid batch");
      if (m->diag_open_mass) { /* fma.open */
        h5_write_doubles(f, "/attention/open_mass", 2, es, open_mass,
                         "share of attention on opened exact tokens (fma.open), first valid batch");
        const long os[2] = {m->L, m->diag_bands - 1};
        h5_write_doubles(f, "/attention/opened", 2, os, opened,
                         "windows opened per query at [level 1, ..., level L] (fma.open), first "
                         "valid batch");
      }
    }
    h5_close(f);
    free(lo);
    free(hi);
    message("wrote %s", path);
  }
  free(mass);
  free(entropy);
  free(open_mass);
  free(opened);
  for (int s = 0; s < 2; s++) {
    free(sl[s].bsum);
    free(sl[s].bcount);
    if (sl[s].task) task_score_close(&sl[s].score);
  }
  mem_free(m->row_loss);
  m->row_loss = NULL;
  mem_free(m->row_pred);
  m->row_pred = NULL;
  train_print_summary(cfg, comm, timer_now() - wall0,
                      sl[1].count > 0 ? sl[1].sum / sl[1].count : NAN);
  train_close_run(&rs);
  return 0;
}
