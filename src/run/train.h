/* `run.mode = train` (with periodic validation, diagnostics, checkpoints and a final test), and
 * what the modes that run a model on data share (eval.h, generate.h): the run's directory, data
 * and model opened and closed, evaluation over a split, the start-up and summary lines. The modes
 * return the process exit status; errors end the job on every rank. */
#ifndef FMATTN_TRAIN_H
#define FMATTN_TRAIN_H

#include "deck/config.h"
#include "io/data.h"
#include "io/diag.h"
#include "model/model.h"
#include "parallel/comm.h"

int train_run(const struct config *cfg, struct comm *comm);

/* What a mode that runs a model on data holds: its directory, data, model and diagnostics file. */
struct run_state {
  const struct config *cfg;
  struct comm *comm;
  char dir[1024];
  struct dataset ds;
  struct model model;
  struct diag diag;
  char restart[1200]; /* the checkpoint loaded, or "" */
};
/* Make the run directory, open the data, build the model (a local batch of train.batch / D) and
 * load output.restart, or initialise the parameters (an error when need_restart). Returns the
 * checkpoint's step (0 on a fresh start). Collective. */
long train_open_run(struct run_state *rs, const struct config *cfg, struct comm *comm,
                    bool need_restart);
void train_close_run(struct run_state *rs);
/* The final summary of SPEC §9: test bpc (when test_loss is a number), wall time, peak memory per
 * label, time by phase. Collective. */
void train_print_summary(const struct config *cfg, struct comm *comm, double wall,
                         double test_loss);
/* The attention diagnostics of the last forward (model.h diag_request), averaged over every
 * rank's examined queries: mass (L, H, bands) and entropy (L, H); when the model has them
 * (fma.open) open_mass (L, H) and opened (L, bands − 1): windows opened at levels 1 .. L per query
 * and head (each may be NULL to skip). False when none were examined. Collective. */
bool train_attention_average(struct model *m, struct comm *comm, double *mass, double *entropy,
                             double *open_mass, double *opened);
/* The start-up lines of SPEC §9: ranks, model, attention, batch, output directory. */
void train_print_decomposition(const struct config *cfg, const struct comm *comm,
                               const struct model *m, const char *run_dir);

/* Mean loss (nats per predicted byte) over a split's evaluation windows, dropout off, every rank
 * taking part; *count receives the number of predicted positions. With score, also the accuracy
 * sums of the split (task_score_open'ed here, reduced over ranks; the caller closes it).
 * Collective. */
struct task_score;
double train_evaluate(struct model *model, const struct dataset *ds, struct comm *comm,
                      enum data_split split, long *count, struct task_score *score);

/* Create output.dir/run.name (rank 0) and agree on success; fills dir. Collective. */
void train_make_run_dir(const struct config *cfg, struct comm *comm, char *dir, size_t len);

#endif
