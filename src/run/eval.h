/* `run.mode = eval` (SPEC §8): the validation and test loss of the output.restart checkpoint over
 * the evaluation windows, every rank taking part, and the task accuracies where the data is a
 * task. */
#ifndef FMATTN_EVAL_H
#define FMATTN_EVAL_H

#include "deck/config.h"
#include "parallel/comm.h"

/* Returns the process exit status; errors end the job on every rank. Collective. */
int eval_run(const struct config *cfg, struct comm *comm);

#endif
