/* Corpus windows, evaluation windows and synthetic tasks (data.h). A window is n + 1 bytes; its
 * targets are masked (−1) where a task does not score a prediction. This file must stay free of
 * MPI: which samples a rank takes is decided by the caller. */
#include "data.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "error.h"
#include "rng.h"

#define MLM_RATE 0.15f

void data_open(struct dataset *ds, const struct config *cfg) {
  memset(ds, 0, sizeof *ds);
  ds->cfg = cfg;
  ds->mask_symbol = 256;
  if (cfg->data.source != SOURCE_FILE) return;
  int fd = open(cfg->data.path, O_RDONLY);
  if (fd < 0) error("cannot open data.path '%s': %s", cfg->data.path, strerror(errno));
  struct stat st;
  if (fstat(fd, &st) != 0) error("cannot stat '%s': %s", cfg->data.path, strerror(errno));
  ds->size = (size_t)st.st_size;
  if (ds->size == 0) error("data.path '%s' is empty", cfg->data.path);
  void *p = mmap(NULL, ds->size, PROT_READ, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) error("cannot map '%s': %s", cfg->data.path, strerror(errno));
  ds->bytes = p;
  const double *s = cfg->data.split;
  if (cfg->data.split_is_bytes) {
    for (int i = 0; i < 3; i++) ds->length[i] = (size_t)s[i];
  } else {
    ds->length[0] = (size_t)(s[0] * (double)ds->size);
    ds->length[1] = (size_t)(s[1] * (double)ds->size);
    ds->length[2] = ds->size - ds->length[0] - ds->length[1];
    if (s[2] == 0.0) ds->length[2] = 0;
  }
  ds->offset[0] = 0;
  ds->offset[1] = ds->length[0];
  ds->offset[2] = ds->length[0] + ds->length[1];
  if (ds->offset[2] + ds->length[2] > ds->size)
    error("data.split asks for %zu bytes but '%s' has %zu", ds->offset[2] + ds->length[2],
          cfg->data.path, ds->size);
  const size_t need = (size_t)cfg->model.context + 1;
  const char *names[3] = {"train", "valid", "test"};
  for (int i = 0; i < 3; i++)
    if (ds->length[i] < need)
      error("the %s split of '%s' has %zu bytes, fewer than model.context + 1 = %zu", names[i],
            cfg->data.path, ds->length[i], need);
}

void data_close(struct dataset *ds) {
  if (ds->bytes) munmap((void *)ds->bytes, ds->size);
  ds->bytes = NULL;
}

/* ---------------------------------------------------------------------------------------------
 * windows */

/* Copy task: L symbols from 1..symbols, a separator 0, the same L symbols, then separators. */
static long copy_length(const struct config *cfg) {
  long L = cfg->data.copy_len > 0 ? cfg->data.copy_len : cfg->model.context / 2;
  if (2 * L + 1 > cfg->model.context + 1) L = cfg->model.context / 2;
  return L;
}

static void copy_window(const struct config *cfg, uint64_t a, uint64_t b, uint8_t *w) {
  const long n = cfg->model.context, L = copy_length(cfg);
  memset(w, 0, (size_t)n + 1);
  for (long t = 0; t < L; t++) {
    uint8_t sym = (uint8_t)(1 + rng_below((uint64_t)cfg->data.symbols, cfg->run.seed, RNG_TASK, a,
                                          b, (uint64_t)t));
    w[t] = sym;
    w[L + 1 + t] = sym;
  }
}

/* Majority task: data symbols 1..S, each the sequence's dominant symbol with probability
 * MAJORITY_BIAS and uniform otherwise; at the marker positions n/2, n/2 + n/4, ... the byte is
 * S + 1, and the byte after it — the scored target — is the majority symbol of every data symbol
 * before the marker (ties: the smallest). The markers are n/4 apart, farther than any near field
 * or local band this task is meant to test, so an earlier answer is never in a near-field window
 * of a later marker: only a model that summarises the whole prefix can answer. */
#define MAJORITY_BIAS 0.1

static bool majority_marker(long n, long t) {
  const long Q = n / 4 > 0 ? n / 4 : 1;
  return t >= n / 2 && t < n && (t - n / 2) % Q == 0;
}

static void majority_window(const struct config *cfg, uint64_t a, uint64_t b, uint8_t *w) {
  const long n = cfg->model.context;
  const int S = cfg->data.symbols;
  const uint64_t seed = cfg->run.seed;
  const int dom = 1 + (int)rng_below((uint64_t)S, seed, RNG_TASK, a, b, ~0ull);
  long counts[256] = {0};
  for (long t = 0; t <= n; t++) {
    if (t > 0 && majority_marker(n, t - 1)) { /* the answer */
      int best = 1;
      for (int s = 2; s <= S; s++)
        if (counts[s] > counts[best]) best = s;
      w[t] = (uint8_t)best;
      continue;
    }
    if (majority_marker(n, t)) {
      w[t] = (uint8_t)(S + 1);
      continue;
    }
    const bool biased = rng_uniform(seed, RNG_TASK, a, b, 2 * (uint64_t)t) < MAJORITY_BIAS;
    const int sym =
        biased ? dom : 1 + (int)rng_below((uint64_t)S, seed, RNG_TASK, a, b, 2 * (uint64_t)t + 1);
    w[t] = (uint8_t)sym;
    counts[sym]++;
  }
}

/* Whether the prediction made at position t (of window[t + 1]) is scored. */
static bool scored(const struct config *cfg, long t) {
  if (cfg->data.source == SOURCE_COPY) {
    long L = copy_length(cfg);
    return t >= L && t < 2 * L;
  }
  if (cfg->data.source == SOURCE_MAJORITY) return majority_marker(cfg->model.context, t);
  return true;
}

/* Window bytes for sample key (a, b): for a file, an offset drawn in the split; for a task, the
 * generated sequence. */
static void window_bytes(const struct dataset *ds, enum data_split split, uint64_t a, uint64_t b,
                         long eval_index, uint8_t *w) {
  const struct config *cfg = ds->cfg;
  const long n = cfg->model.context;
  switch (cfg->data.source) {
    case SOURCE_COPY:
      copy_window(cfg, a, b, w);
      return;
    case SOURCE_MAJORITY:
      majority_window(cfg, a, b, w);
      return;
    case SOURCE_FILE:
      break;
  }
  size_t off;
  if (eval_index >= 0) {
    off = ds->offset[split] + (size_t)eval_index * (size_t)n;
  } else {
    uint64_t range = ds->length[split] - (size_t)n; /* offsets 0 .. len − n − 1 */
    off = ds->offset[split] + rng_below(range, cfg->run.seed, RNG_DATA, a, b, 0);
  }
  memcpy(w, ds->bytes + off, (size_t)n + 1);
}

/* Inputs/targets of local tokens [t0, t0 + T) of one window. */
static void fill_row(const struct dataset *ds, const uint8_t *w, uint64_t a, uint64_t b, long t0,
                     long T, int *tokens, int *targets) {
  const struct config *cfg = ds->cfg;
  for (long t = 0; t < T; t++) {
    long g = t0 + t;
    if (cfg->model.objective == OBJECTIVE_MLM) {
      bool masked = rng_uniform(cfg->run.seed, RNG_MASK, a, b, (uint64_t)g) < MLM_RATE;
      tokens[t] = masked ? ds->mask_symbol : w[g];
      targets[t] = masked && scored(cfg, g - 1) ? w[g] : -1;
    } else {
      tokens[t] = w[g];
      targets[t] = scored(cfg, g) ? w[g + 1] : -1;
    }
  }
}

void data_train_window(const struct dataset *ds, long step, long g, uint8_t *window) {
  window_bytes(ds, SPLIT_TRAIN, (uint64_t)step, (uint64_t)g, -1, window);
}

void data_train_batch(const struct dataset *ds, long step, long sample0, long B, long t0, long T,
                      int *tokens, int *targets) {
  const long n = ds->cfg->model.context;
  uint8_t *w = xmalloc((size_t)n + 1);
  for (long b = 0; b < B; b++) {
    uint64_t ka = (uint64_t)step, kb = (uint64_t)(sample0 + b);
    window_bytes(ds, SPLIT_TRAIN, ka, kb, -1, w);
    fill_row(ds, w, ka, kb, t0, T, tokens + b * T, targets + b * T);
  }
  free(w);
}

long data_eval_windows(const struct dataset *ds, enum data_split split) {
  const struct config *cfg = ds->cfg;
  long want = cfg->train.eval_windows;
  if (cfg->data.source != SOURCE_FILE) return want;
  long have = (long)((ds->length[split] - 1) / (size_t)cfg->model.context);
  return have < want ? have : want;
}

void data_eval_batch(const struct dataset *ds, enum data_split split, long first, long stride,
                     long count, long B, long t0, long T, int *tokens, int *targets) {
  const long n = ds->cfg->model.context;
  uint8_t *w = xmalloc((size_t)n + 1);
  for (long b = 0; b < B; b++) {
    long k = first + b * stride;
    if (k >= count) {
      for (long t = 0; t < T; t++) {
        tokens[b * T + t] = 0;
        targets[b * T + t] = -1;
      }
      continue;
    }
    /* keys of evaluation samples live apart from every training step's */
    uint64_t ka = ~(uint64_t)split, kb = (uint64_t)k;
    window_bytes(ds, split, ka, kb, k, w);
    fill_row(ds, w, ka, kb, t0, T, tokens + b * T, targets + b * T);
  }
  free(w);
}
