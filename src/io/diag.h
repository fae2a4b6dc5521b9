/* diag.h5 (SPEC §8.1): the run's diagnostics, written by rank 0 only, opened, appended to and
 * closed at each record so that a reader (h5py, scripts/plot_run.py) sees a consistent file at
 * any moment and a crash loses at most the record being written. On restart, records after the
 * restart step are dropped so the series continue without duplicates. */
#ifndef FMATTN_DIAG_H
#define FMATTN_DIAG_H

#include <stdbool.h>

#include "core/timer.h"
#include "deck/config.h"
#include "parallel/comm.h"

struct diag {
  char path[1024];
  bool active; /* rank 0 */
};

struct diag_train_record {
  long step;
  double loss, bpc, lr, grad_norm, step_ms, tokens_per_s;
  double phase_ms[TIMER_DIAG_COUNT];
  double comm_bytes; /* bytes sent per rank in this step (max over ranks) */
  /* blocking exchanges between sequence ranks in this step's forward and backward, per block
   * (comm.h's count, max over ranks) */
  double exchanges_per_layer;
  double peak_bytes; /* peak labelled memory, max over ranks */
};

/* Create (or, restarting at step restart_step ≥ 0, reopen and trim) runs/<name>/diag.h5. */
void diag_open(struct diag *diag, const struct config *cfg, const struct comm *comm,
               const char *run_dir, long restart_step);
void diag_train(struct diag *diag, const struct diag_train_record *r);
void diag_eval(struct diag *diag, long step, double loss);
/* The test split at the end; on a task (score not NULL) also its accuracy (/test/accuracy, ...). */
struct task_score;
void diag_test(struct diag *diag, long step, double loss, const struct task_score *score);
/* A task's validation accuracy (/task): overall, per sample and by distance bucket. */
void diag_task(struct diag *diag, long step, const struct task_score *score);
/* mass (L, H, bands) and entropy (L, H), already averaged over queries; when the attention opens
 * windows (fma.open; else NULL), open_mass (L, H) per query and opened (L, bands − 1) windows
 * opened per query at levels 1 .. bands − 1. */
void diag_attention(struct diag *diag, long step, int L, int H, int bands, const double *mass,
                    const double *entropy, const double *open_mass, const double *opened);
/* Final per-label peak memory (attributes on /memory). */
void diag_memory_summary(struct diag *diag, const double *label_peaks, int count,
                         const char *const *names);

/* The process's peak resident memory (max over ranks), an attribute of /memory at the end. */
void diag_resident_peak(struct diag *diag, double bytes);

#endif
