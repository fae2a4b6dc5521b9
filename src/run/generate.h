/* `run.mode = generate` (SPEC §8): bytes sampled after a prompt from the output.restart
 * checkpoint (one rank, causal). */
#ifndef FMATTN_GENERATE_H
#define FMATTN_GENERATE_H

#include "deck/config.h"
#include "parallel/comm.h"

/* Returns the process exit status; errors end the job on every rank. Collective. */
int generate_run(const struct config *cfg, struct comm *comm);

#endif
