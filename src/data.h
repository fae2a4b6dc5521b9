/* Data (SPEC §4): a byte-file corpus cut into train/valid/test, or a synthetic task generated
 * in-process from the seed. Every window is a pure function of (seed, step, global sample index)
 * or (split, window index), so any rank layout sees the same samples and a restart needs no data
 * cursor beyond the step. A sequence group shares a window; each rank takes its slab. */
#ifndef FMATTN_DATA_H
#define FMATTN_DATA_H

#include <stddef.h>
#include <stdint.h>

#include "config.h"

enum data_split { SPLIT_TRAIN = 0, SPLIT_VALID = 1, SPLIT_TEST = 2 };

struct dataset {
  const struct config *cfg;
  const uint8_t *bytes; /* the mapped file (NULL for synthetic tasks) */
  size_t size;
  size_t offset[3], length[3]; /* each split's bytes in the file */
  int mask_symbol;             /* mlm mask token (256) */
};

/* Map the corpus (read-only, shared by the page cache between ranks) or prepare a synthetic
 * task. Errors (missing or short file) are reported on this rank and end the job. */
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
/* How many evaluation windows a split provides (≤ train.eval_windows). */
long data_eval_windows(const struct dataset *ds, enum data_split split);

/* The bytes of one whole window (n + 1 bytes) of training step `step`, global sample g; used by
 * tests. */
void data_train_window(const struct dataset *ds, long step, long g, uint8_t *window);

#endif
