/* Threads per rank: OpenMP threads for fmattn's loops and BLAS's threads for matrix products,
 * kept equal. Without OMP_NUM_THREADS the default is the cores this rank may use divided by the
 * ranks sharing its node, so `mpirun -n 8` on a 16-core node runs 8 × 2 threads, not 8 × 16. */
#ifndef FMATTN_THREADS_H
#define FMATTN_THREADS_H

#include <mpi.h>

/* Decide and apply the thread count; collective over world (it counts ranks per node). */
void threads_setup(MPI_Comm world);
int threads_count(void);
/* Name of the BLAS kernel set in use (e.g. "Haswell"), or "unknown". */
const char *threads_blas_core(void);

#endif
