/* Threads per rank: OpenMP threads for fmattn's loops and BLAS's threads for matrix products,
 * kept equal. Without OMP_NUM_THREADS the default is the cores of the node's ranks divided by the
 * ranks, and no more than the cores this rank is bound to, so `mpirun -n 8` on a 16-core node runs
 * 8 × 2 threads, not 8 × 16, whether the ranks are bound to a socket each or not bound at all. Rank
 * 0 warns when a rank runs more threads than the cores it is bound to. */
#ifndef FMATTN_THREADS_H
#define FMATTN_THREADS_H

#include <mpi.h>

/* The thread count without OMP_NUM_THREADS: the node_cores that the node's local_ranks may use
 * (the union of their masks) shared among them, no more than the `bound` cores of this rank's
 * mask, and at least 1. Ranks bound to a socket each (Open MPI's default above 2 ranks) share the
 * socket's cores: 8 ranks on a 2 × 16-core node get 4 threads each, not 16. */
int threads_default(int bound, int node_cores, int local_ranks);
/* Decide and apply the thread count; collective over world (it counts ranks per node). */
void threads_setup(MPI_Comm world);
int threads_count(void);
/* The cores this rank is bound to (its affinity mask). */
int threads_cores(void);
/* Name of the BLAS kernel set in use (e.g. "Haswell"), or "unknown". */
const char *threads_blas_core(void);

#endif
