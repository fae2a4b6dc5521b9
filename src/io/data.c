/* Corpus windows, task-file rows, evaluation windows and synthetic tasks (data.h). A sample is n +
 * 1 bytes with, for each of its n targets, whether it is scored and how far back its information
 * lies (tasks.h); unscored targets are masked (−1). This file must stay free of MPI: which samples
 * a rank takes is decided by the caller. */
#include "io/data.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/error.h"
#include "core/rng.h"
#include "tasks/tasks.h"

#define MLM_RATE 0.15f

/* Cut `total` (bytes or rows) into the three splits of data.split. */
static void split_lengths(struct dataset *ds, size_t total) {
  const double *s = ds->opt.split;
  if (ds->opt.split_is_bytes) {
    for (int i = 0; i < 3; i++) ds->length[i] = (size_t)s[i];
  } else {
    ds->length[0] = (size_t)(s[0] * (double)total);
    ds->length[1] = (size_t)(s[1] * (double)total);
    ds->length[2] = total - ds->length[0] - ds->length[1];
    if (s[2] == 0.0) ds->length[2] = 0;
  }
  ds->offset[0] = 0;
  ds->offset[1] = ds->length[0];
  ds->offset[2] = ds->length[0] + ds->length[1];
}

static void map_file(struct dataset *ds) {
  const struct data_options *o = &ds->opt;
  int fd = open(o->path, O_RDONLY);
  if (fd < 0) error("cannot open data.path '%s': %s", o->path, strerror(errno));
  struct stat st;
  if (fstat(fd, &st) != 0) error("cannot stat '%s': %s", o->path, strerror(errno));
  ds->size = (size_t)st.st_size;
  if (ds->size == 0) error("data.path '%s' is empty", o->path);
  void *p = mmap(NULL, ds->size, PROT_READ, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) error("cannot map '%s': %s", o->path, strerror(errno));
  ds->bytes = p;
  split_lengths(ds, ds->size);
  if (ds->offset[2] + ds->length[2] > ds->size)
    error("data.split asks for %zu bytes but '%s' has %zu", ds->offset[2] + ds->length[2], o->path,
          ds->size);
  const size_t need = (size_t)o->n + 1;
  const char *names[3] = {"train", "valid", "test"};
  for (int i = 0; i < 3; i++)
    if (ds->length[i] < need)
      error("the %s split of '%s' has %zu bytes, fewer than model.context + 1 = %zu", names[i],
            o->path, ds->length[i], need);
}

/* data.source = task: the file is read whole and checked; every rank reads the same file and
 * comes to the same verdict, so a bad file ends the job with one message. */
static void read_task_file(struct dataset *ds) {
  const struct data_options *o = &ds->opt;
  char err[2048];
  ds->task = xcalloc(1, sizeof *ds->task);
  if (task_file_read(o->path, o->n, ds->task, err, sizeof err)) error_collective(err);
  const size_t rows = (size_t)ds->task->rows;
  split_lengths(ds, rows);
  const char *names[3] = {"train", "valid", "test"};
  if (ds->offset[2] + ds->length[2] > rows) {
    snprintf(err, sizeof err, "data.split asks for %zu rows but task file '%s' has %zu",
             ds->offset[2] + ds->length[2], o->path, rows);
    error_collective(err);
  }
  for (int i = 0; i < 3; i++)
    if (ds->length[i] == 0) {
      snprintf(err, sizeof err,
               "the %s split of task file '%s' has no rows (%zu rows, data.split as fractions); "
               "give data.split as row counts, e.g. %zu,%zu,%zu",
               names[i], o->path, rows, rows > 2 ? rows - 2 : 1, (size_t)1, (size_t)1);
      error_collective(err);
    }
}

void data_open(struct dataset *ds, const struct config *cfg) {
  memset(ds, 0, sizeof *ds);
  const struct config_data *dc = &cfg->data;
  struct data_options *o = &ds->opt;
  *o = (struct data_options){.source = dc->source,
                             .split_is_bytes = dc->split_is_bytes,
                             .n = cfg->model.context,
                             .batch = cfg->train.batch,
                             .steps = cfg->train.steps,
                             .eval_windows = cfg->train.eval_windows,
                             .mlm = cfg->model.objective == OBJECTIVE_MLM,
                             .seed = cfg->run.seed,
                             .deck = cfg->resolved};
  snprintf(o->path, sizeof o->path, "%s", dc->path);
  snprintf(o->export_path, sizeof o->export_path, "%s", dc->export_path);
  memcpy(o->split, dc->split, sizeof o->split);
  task_options_read(&ds->task_opt, cfg);
  ds->mask_symbol = 256;
  if (o->source == SOURCE_FILE || (o->source == SOURCE_PASSKEY && o->path[0]))
    map_file(ds);
  else if (o->source == SOURCE_TASK)
    read_task_file(ds);
  /* rank 0 writes it (error_rank is −1 before MPI is up: a test's single process) */
  if (o->export_path[0] && error_rank() <= 0) data_export(ds, o->export_path);
}

void data_close(struct dataset *ds) {
  if (ds->bytes) munmap((void *)ds->bytes, ds->size);
  ds->bytes = NULL;
  if (ds->task) task_file_free(ds->task);
  free(ds->task);
  ds->task = NULL;
}

bool data_is_task(const struct dataset *ds) { return ds->opt.source != SOURCE_FILE; }

/* ---------------------------------------------------------------------------------------------
 * windows */

/* The task-file row of sample key (a, b): evaluation window k is row k of its split; training
 * sample g of step s is row s·train.batch + g of the train split, cycling (an epoch in file
 * order), so that a file written by data_export reproduces the run it came from. */
static void task_row(const struct dataset *ds, enum data_split split, uint64_t a, uint64_t b,
                     long eval_index, struct task_sample *s) {
  const struct task_file *tf = ds->task;
  size_t row;
  if (eval_index >= 0)
    row = ds->offset[split] + (size_t)eval_index;
  else
    row = ds->offset[SPLIT_TRAIN] +
          (size_t)((a * (uint64_t)ds->opt.batch + b) % ds->length[SPLIT_TRAIN]);
  const long n = s->n;
  memcpy(s->tokens, tf->tokens + row * (size_t)(n + 1), (size_t)n + 1);
  memcpy(s->scored, tf->scored + row * (size_t)n, (size_t)n);
  if (tf->distance)
    memcpy(s->distance, tf->distance + row * (size_t)n, sizeof(int32_t) * (size_t)n);
  else
    for (long t = 0; t < n; t++) s->distance[t] = -1;
}

/* The sample of key (a, b): for a file, the window at an offset drawn in the split (eval_index
 * < 0) or evaluation window eval_index, every target scored; for a task file, its row; for a
 * generated task, the generated sequence. */
static void make_sample(const struct dataset *ds, enum data_split split, uint64_t a, uint64_t b,
                        long eval_index, struct task_sample *s) {
  const struct data_options *o = &ds->opt;
  const long n = o->n;
  switch (o->source) {
    case SOURCE_COPY:
      task_copy(&ds->task_opt, a, b, s);
      return;
    case SOURCE_MAJORITY:
      task_majority(&ds->task_opt, a, b, s);
      return;
    case SOURCE_TASK:
      task_row(ds, split, a, b, eval_index, s);
      return;
    case SOURCE_MQAR:
      task_mqar(&ds->task_opt, a, b, s);
      return;
    case SOURCE_PASSKEY:
      task_passkey(&ds->task_opt, ds->bytes ? ds->bytes + ds->offset[split] : NULL,
                   ds->bytes ? ds->length[split] : 0, a, b, s);
      return;
    case SOURCE_LISTOPS:
      task_listops(&ds->task_opt, a, b, s);
      return;
    case SOURCE_FILE:
      break;
  }
  size_t off;
  if (eval_index >= 0) {
    off = ds->offset[split] + (size_t)eval_index * (size_t)n;
  } else {
    uint64_t range = ds->length[split] - (size_t)n; /* offsets 0 .. len − n − 1 */
    off = ds->offset[split] + rng_below(range, o->seed, RNG_DATA, a, b, 0);
  }
  memcpy(s->tokens, ds->bytes + off, (size_t)n + 1);
  memset(s->scored, 1, (size_t)n);
  for (long t = 0; t < n; t++) s->distance[t] = -1;
}

/* Inputs/targets (and distances, unless NULL) of local tokens [t0, t0 + T) of one sample. */
static void fill_row(const struct dataset *ds, const struct task_sample *s, uint64_t a, uint64_t b,
                     long t0, long T, int *tokens, int *targets, int *distance) {
  const struct data_options *o = &ds->opt;
  const uint8_t *w = s->tokens;
  for (long t = 0; t < T; t++) {
    long g = t0 + t;
    if (o->mlm) {
      bool masked = rng_uniform(o->seed, RNG_MASK, a, b, (uint64_t)g) < MLM_RATE;
      /* the masked byte g is target g − 1; the first byte counts only in a corpus */
      const bool counts = g > 0 ? s->scored[g - 1] : o->source == SOURCE_FILE;
      tokens[t] = masked ? ds->mask_symbol : w[g];
      targets[t] = masked && counts ? w[g] : -1;
      if (distance) distance[t] = targets[t] >= 0 && g > 0 ? s->distance[g - 1] : -1;
    } else {
      tokens[t] = w[g];
      targets[t] = s->scored[g] ? w[g + 1] : -1;
      if (distance) distance[t] = targets[t] >= 0 ? s->distance[g] : -1;
    }
  }
}

void data_train_window(const struct dataset *ds, long step, long g, uint8_t *window) {
  struct task_sample s;
  task_sample_alloc(&s, ds->opt.n);
  make_sample(ds, SPLIT_TRAIN, (uint64_t)step, (uint64_t)g, -1, &s);
  memcpy(window, s.tokens, (size_t)s.n + 1);
  task_sample_free(&s);
}

void data_train_batch(const struct dataset *ds, long step, long sample0, long B, long t0, long T,
                      int *tokens, int *targets) {
  struct task_sample s;
  task_sample_alloc(&s, ds->opt.n);
  for (long b = 0; b < B; b++) {
    uint64_t ka = (uint64_t)step, kb = (uint64_t)(sample0 + b);
    make_sample(ds, SPLIT_TRAIN, ka, kb, -1, &s);
    fill_row(ds, &s, ka, kb, t0, T, tokens + b * T, targets + b * T, NULL);
  }
  task_sample_free(&s);
}

long data_eval_windows(const struct dataset *ds, enum data_split split) {
  const struct data_options *o = &ds->opt;
  long want = o->eval_windows;
  long have = want;
  if (o->source == SOURCE_FILE)
    have = (long)((ds->length[split] - 1) / (size_t)o->n);
  else if (o->source == SOURCE_TASK)
    have = (long)ds->length[split];
  return have < want ? have : want;
}

/* The key of evaluation window k of a split: apart from every training step's. */
static void eval_key(enum data_split split, long k, uint64_t *a, uint64_t *b) {
  *a = ~(uint64_t)split;
  *b = (uint64_t)k;
}

void data_eval_rows(const struct dataset *ds, enum data_split split, long first, long stride,
                    long count, long B, long t0, long T, int *tokens, int *targets, int *distance) {
  struct task_sample s;
  task_sample_alloc(&s, ds->opt.n);
  for (long b = 0; b < B; b++) {
    long k = first + b * stride;
    if (k >= count) {
      for (long t = 0; t < T; t++) {
        tokens[b * T + t] = 0;
        targets[b * T + t] = -1;
        if (distance) distance[b * T + t] = -1;
      }
      continue;
    }
    uint64_t ka, kb;
    eval_key(split, k, &ka, &kb);
    make_sample(ds, split, ka, kb, k, &s);
    fill_row(ds, &s, ka, kb, t0, T, tokens + b * T, targets + b * T,
             distance ? distance + b * T : NULL);
  }
  task_sample_free(&s);
}

void data_eval_batch(const struct dataset *ds, enum data_split split, long first, long stride,
                     long count, long B, long t0, long T, int *tokens, int *targets) {
  data_eval_rows(ds, split, first, stride, count, B, t0, T, tokens, targets, NULL);
}

/* ---------------------------------------------------------------------------------------------
 * export */

void data_export(const struct dataset *ds, const char *path) {
  const struct data_options *o = &ds->opt;
  const long n = o->n, batch = o->batch;
  const long train_rows = o->steps * batch;
  const long valid = data_eval_windows(ds, SPLIT_VALID), test = data_eval_windows(ds, SPLIT_TEST);
  const long rows = train_rows + valid + test;
  if (rows < 1 || train_rows < 1)
    error("data.export: the run has no training rows to write (train.steps = %ld)", o->steps);
  char split[96];
  snprintf(split, sizeof split, "%ld,%ld,%ld", train_rows, valid, test);
  message(
      "data.export: writing %ld rows of %ld tokens (%s: train.steps x train.batch, valid, "
      "test) to %s",
      rows, n + 1, split, path);
  struct task_writer *w =
      task_writer_open(path, rows, n, config_source_name(o->source), o->deck, split);
  struct task_sample s;
  task_sample_alloc(&s, n);
  for (long step = 0; step < o->steps; step++)
    for (long g = 0; g < batch; g++) {
      make_sample(ds, SPLIT_TRAIN, (uint64_t)step, (uint64_t)g, -1, &s);
      task_writer_add(w, &s);
    }
  for (int split_i = SPLIT_VALID; split_i <= SPLIT_TEST; split_i++)
    for (long k = 0; k < (split_i == SPLIT_VALID ? valid : test); k++) {
      uint64_t ka, kb;
      eval_key((enum data_split)split_i, k, &ka, &kb);
      make_sample(ds, (enum data_split)split_i, ka, kb, k, &s);
      task_writer_add(w, &s);
    }
  task_sample_free(&s);
  task_writer_close(w);
}
