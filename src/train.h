/* The run modes that use a model on data: train (with periodic validation, diagnostics,
 * checkpoints and a final test), eval (valid and test of a checkpoint) and generate (sample bytes
 * from a checkpoint). Each returns the process exit status; errors end the job on every rank. */
#ifndef FMATTN_TRAIN_H
#define FMATTN_TRAIN_H

#include "comm.h"
#include "config.h"
#include "data.h"
#include "model.h"

int train_run(const struct config *cfg, struct comm *comm);
int eval_run(const struct config *cfg, struct comm *comm);
int generate_run(const struct config *cfg, struct comm *comm);

/* Mean loss (nats per predicted byte) over a split's evaluation windows, dropout off, every rank
 * taking part; *count receives the number of predicted positions. Collective. */
double train_evaluate(struct model *model, const struct dataset *ds, struct comm *comm,
                      enum data_split split, long *count);

/* Create output.dir/run.name (rank 0) and agree on success; fills dir. Collective. */
void train_make_run_dir(const struct config *cfg, struct comm *comm, char *dir, size_t len);

#endif
