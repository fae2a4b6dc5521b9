/* Thread-count policy (threads.h). */
#include "core/threads.h"

#include <cblas.h>
#include <sched.h>
#include <stdlib.h>
#include <unistd.h>

#include "core/error.h"

#ifdef _OPENMP
#include <omp.h>
#endif

#ifdef HAVE_OPENBLAS_GET_NUM_THREADS
void openblas_set_num_threads(int);
#endif
#ifdef HAVE_OPENBLAS_GET_CORENAME
char *openblas_get_corename(void);
#endif

static int threads_ = 1;

void threads_setup(MPI_Comm world) {
  MPI_Comm node;
  int local = 1;
  MPI_CHECK(MPI_Comm_split_type(world, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node));
  MPI_CHECK(MPI_Comm_size(node, &local));
  MPI_Comm_free(&node);
  int want = 0;
  const char *env = getenv("OMP_NUM_THREADS");
  if (env && atoi(env) > 0) {
    want = atoi(env);
  } else {
    cpu_set_t set;
    int cores = 1;
    long online = sysconf(_SC_NPROCESSORS_ONLN);
    if (sched_getaffinity(0, sizeof set, &set) == 0) cores = CPU_COUNT(&set);
    /* a rank bound to a subset of the cores (mpirun --bind-to ...) already has its share;
     * an unbound rank divides the node with the other ranks on it */
    want = cores < online ? cores : cores / local;
    if (want < 1) want = 1;
  }
  threads_ = want;
#ifdef _OPENMP
  omp_set_num_threads(want);
#else
  threads_ = 1;
#endif
#ifdef HAVE_OPENBLAS_GET_NUM_THREADS
  openblas_set_num_threads(threads_);
#endif
}

int threads_count(void) { return threads_; }

const char *threads_blas_core(void) {
#ifdef HAVE_OPENBLAS_GET_CORENAME
  return openblas_get_corename();
#else
  return "unknown";
#endif
}
