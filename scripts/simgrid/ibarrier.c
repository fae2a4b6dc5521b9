/* SimGrid's MPI_Ibarrier against a barrier's contract: no rank leaves before every rank entered.
 * The last rank enters `delay` simulated seconds late (the argument; default 0.5) after computing
 * that long; every rank prints when it left, after a blocking MPI_Barrier lined them up, for
 * MPI_Ibarrier and for an MPI_Iallreduce of one int from a send buffer (what parallel/comm.c's NBX
 * uses under SMPI in its place). A correct barrier lets no rank leave before `delay`. A report
 * for SimGrid's maintainers (docs/scaling.md): run it under smpirun, and natively for comparison. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

/* computation until `seconds` have passed on this rank's clock (simulated under SMPI) */
static void busy(double seconds) {
  const double t0 = MPI_Wtime();
  volatile double x = 0.0;
  while (MPI_Wtime() - t0 < seconds)
    for (int i = 0; i < 100000; i++) x += i;
}

/* When this rank left a non-blocking barrier (allreduce: the allreduce form), from the line-up. */
static double leave_time(int allreduce, int last, double delay) {
  int one = 1, sum = 0, done = 0;
  MPI_Request req;
  MPI_Barrier(MPI_COMM_WORLD);
  const double t0 = MPI_Wtime();
  if (last) busy(delay);
  if (allreduce)
    MPI_Iallreduce(&one, &sum, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD, &req);
  else
    MPI_Ibarrier(MPI_COMM_WORLD, &req);
  while (!done) MPI_Test(&req, &done, MPI_STATUS_IGNORE);
  return MPI_Wtime() - t0;
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int rank, size;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  const double delay = argc > 1 ? atof(argv[1]) : 0.5;
  if (rank == 0) printf("# form\tfirst rank to leave (s)\tlast rank entered at (s)\n");
  for (int allreduce = 0; allreduce <= 1; allreduce++) {
    double left = leave_time(allreduce, rank == size - 1, delay), first;
    MPI_Reduce(&left, &first, 1, MPI_DOUBLE, MPI_MIN, 0, MPI_COMM_WORLD);
    if (rank == 0)
      printf("%s\t%.6f\t%.6f\n", allreduce ? "MPI_Iallreduce (1 int)" : "MPI_Ibarrier", first,
             delay);
  }
  MPI_Finalize();
  return 0;
}
