/* Data (SPEC §4): a byte-file corpus cut into train/valid/test, a task file's rows cut likewise, or
 * a synthetic task generated in-process from the seed (copy, majority and the long-range tasks,
 * by src/tasks/). Every window is a pure function of (seed, step, global sample index) or (split,
 * window index), so any rank layout sees the same samples and a restart needs no data cursor
 * beyond the step. A sequence group shares a window; each rank takes its slab. */
#ifndef FMATTN_DATA_H
#define FMATTN_DATA_H

#include <stddef.h>
#include <stdint.h>

#include "deck/config.h"
#include "tasks/tasks.h"

enum data_split { SPLIT_TRAIN = 0, SPLIT_VALID = 1, SPLIT_TEST = 2 };

struct task_file;

/* What the data reads of the deck (data.*, model.context, train.batch, steps and eval_windows,
 * model.objective, run.seed), once, in data_open. */
struct data_options {
  enum data_source source;
  char path[CONFIG_STR]; /* data.path */
  double split[3];       /* data.split: fractions or byte counts */
  bool split_is_bytes;
  char export_path[CONFIG_STR]; /* data.export ("") */
  long n;                       /* model.context: a window is n + 1 bytes */
  long batch, steps;            /* train.batch, train.steps: the rows data.export writes */
  long eval_windows;            /* train.eval_windows: at most this many per split */
  bool mlm;                     /* model.objective = mlm: inputs masked */
  uint64_t seed;                /* run.seed */
  const char *deck;             /* the resolved deck, stored with an export */
};

struct dataset {
  struct data_options opt;
  const uint8_t *bytes; /* the mapped file (NULL for synthetic tasks; passkey's filler text) */
  size_t size;
  size_t offset[3], length[3];  /* each split's bytes in the file, or rows of the task file */
  int mask_symbol;              /* mlm mask token (256) */
  struct task_file *task;       /* data.source = task: its rows, read whole (else NULL) */
  struct task_options task_opt; /* the generators' options (tasks.h) */
};

/* Map the corpus (read-only, shared by the page cache between ranks), read a task file, or
 * prepare a synthetic task; with data.export, rank 0 then writes the run's samples as a task
 * file. Errors (missing or short file) are reported on this rank and end the job; a task file that
 * is wrong is refused with one message, every rank reading the same file. */
void data_open(struct dataset *ds, const struct config *cfg);
void data_close(struct dataset *ds);

/* Inputs and targets of a local batch of training step `step`: global samples
 * sample0 .. sample0 + B − 1, tokens [t0, t0 + T) of each. tokens/targets: (B, T). */
void data_train_batch(const struct dataset *ds, long step, long sample0, long B, long t0, long T,
                      int *tokens, int *targets);

/* Evaluation windows (SPEC §4): window k of a split has inputs split[k·n, k·n + n) and targets one
 * byte later. Fills B rows for windows first, first + stride, ...; rows past `count` windows get
 * targets −1 (not counted). */
void data_eval_batch(const struct dataset *ds, enum data_split split, long first, long stride,
                     long count, long B, long t0, long T, int *tokens, int *targets);
/* As data_eval_batch, with each target's distance (tasks.h; −1 when unknown or not scored) into
 * distance (B, T) unless it is NULL. */
void data_eval_rows(const struct dataset *ds, enum data_split split, long first, long stride,
                    long count, long B, long t0, long T, int *tokens, int *targets, int *distance);
/* How many evaluation windows a split provides (≤ train.eval_windows). */
long data_eval_windows(const struct dataset *ds, enum data_split split);

/* The bytes of one whole window (n + 1 bytes) of training step `step`, global sample g; used by
 * tests. */
void data_train_window(const struct dataset *ds, long step, long g, uint8_t *window);

/* Whether the data is a task (every source but a byte file): evaluation then reports accuracy on
 * the scored targets. */
bool data_is_task(const struct dataset *ds);

/* Write what this run trains and evaluates on as a task file (docs/tasks.md): the training rows
 * of every step in order (global sample g of step s is row s·train.batch + g), then the valid and
 * the test windows, with data.split's row counts as the `split` attribute, so that a run on the
 * file with that split sees exactly these samples. */
void data_export(const struct dataset *ds, const char *path);

#endif
