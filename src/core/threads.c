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
static int cores_ = 1; /* the cores this rank is bound to */

/* The cores this process may run on (all online ones where the mask cannot be read). */
static void my_cores(cpu_set_t *set) {
  CPU_ZERO(set);
  if (sched_getaffinity(0, sizeof *set, set) != 0 || CPU_COUNT(set) == 0) {
    const long online = sysconf(_SC_NPROCESSORS_ONLN);
    for (long c = 0; c < online && c < CPU_SETSIZE; c++) CPU_SET(c, set);
  }
}

/* One warning on rank 0 when some rank runs more threads than the cores it is bound to: Open MPI
 * binds each rank to one core when it starts 2 ranks or fewer, and a rank's threads then share
 * that core, each at its share of the speed, while the bench's SGEMM rate falls with them. */
static void warn_oversubscribed(MPI_Comm world) {
  int rank, size;
  MPI_CHECK(MPI_Comm_rank(world, &rank));
  MPI_CHECK(MPI_Comm_size(world, &size));
  const int mine[2] = {threads_, cores_};
  int *all = rank == 0 ? xcalloc((size_t)2 * size, sizeof *all) : NULL;
  MPI_CHECK(MPI_Gather(mine, 2, MPI_INT, all, 2, MPI_INT, 0, world));
  if (rank != 0) return;
  int over = 0, first = -1;
  for (int r = 0; r < size; r++)
    if (all[2 * r] > all[2 * r + 1]) {
      over++;
      if (first < 0) first = r;
    }
  if (over)
    warning(
        "%d of %d rank(s) run more OpenMP threads than the cores they are bound to (rank %d: %d "
        "threads on %d core(s)): the threads share cores. Give each rank its cores (mpirun "
        "--map-by slot:PE=%d --bind-to core; srun --cpus-per-task=%d) or bind none (mpirun "
        "--bind-to none)",
        over, size, first, all[2 * first], all[2 * first + 1], all[2 * first], all[2 * first]);
  free(all);
}

int threads_default(int bound, int node_cores, int local_ranks) {
  const int share = node_cores / (local_ranks > 0 ? local_ranks : 1);
  const int want = share < bound ? share : bound;
  return want > 0 ? want : 1;
}

void threads_setup(MPI_Comm world) {
  MPI_Comm node;
  int local = 1;
  MPI_CHECK(MPI_Comm_split_type(world, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node));
  MPI_CHECK(MPI_Comm_size(node, &local));
  cpu_set_t set, any;
  my_cores(&set);
  cores_ = CPU_COUNT(&set);
  /* the cores of all the ranks on this node, which they share */
  any = set;
  MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, &any, (int)sizeof any, MPI_BYTE, MPI_BOR, node));
  const int node_cores = CPU_COUNT(&any);
  MPI_Comm_free(&node);
  const char *env = getenv("OMP_NUM_THREADS");
  const int want = env && atoi(env) > 0 ? atoi(env) : threads_default(cores_, node_cores, local);
  threads_ = want;
#ifdef _OPENMP
  omp_set_num_threads(want);
#else
  threads_ = 1;
#endif
#ifdef HAVE_OPENBLAS_GET_NUM_THREADS
  openblas_set_num_threads(threads_);
#endif
  warn_oversubscribed(world);
}

int threads_count(void) { return threads_; }

int threads_cores(void) { return cores_; }

const char *threads_blas_core(void) {
#ifdef HAVE_OPENBLAS_GET_CORENAME
  return openblas_get_corename();
#else
  return "unknown";
#endif
}
