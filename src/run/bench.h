/* Benchmark mode (SPEC §11): attention and training-step sweeps with figures relative to the
 * SGEMM rate measured in the same run; writes runs/<name>/bench.h5. */
#ifndef FMATTN_BENCH_H
#define FMATTN_BENCH_H

#include "deck/config.h"
#include "parallel/comm.h"

int bench_run(const struct config *cfg, struct comm *comm);
/* This rank's SGEMM rate with its threads, GFLOP/s. */
double bench_sgemm_gflops(void);

#endif
