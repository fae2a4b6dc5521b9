/* SimGrid's MPI_Iallreduce against its MPI_Allreduce, on the sizes fmattn's gradient buckets
 * have: every rank contributes rank + 1 + i/count to element i, so the sum is known in closed
 * form. For each count (floats, the arguments; default 5000 20000 100000 500000) it prints one
 * line per form — blocking, non-blocking from a send buffer, non-blocking in place — with the
 * largest relative error over the ranks and the slowest rank's simulated seconds. A report for
 * SimGrid's maintainers (docs/scaling.md): run it under smpirun on 8 to 128 ranks. */
#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

enum form { BLOCKING, NONBLOCKING, NONBLOCKING_IN_PLACE };
static const char *const form_names[] = {"MPI_Allreduce (in place)", "MPI_Iallreduce",
                                         "MPI_Iallreduce (in place)"};

/* The largest relative error of buf against the closed-form sum, and the seconds it took. */
static void one(enum form f, long count, int rank, int size, double *err, double *secs) {
  float *buf = malloc(sizeof(float) * (size_t)count), *send = malloc(sizeof(float) * (size_t)count);
  for (long i = 0; i < count; i++) send[i] = buf[i] = (float)(rank + 1) + (float)i / (float)count;
  MPI_Barrier(MPI_COMM_WORLD);
  const double t0 = MPI_Wtime();
  MPI_Request req;
  switch (f) {
    case BLOCKING:
      MPI_Allreduce(MPI_IN_PLACE, buf, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      break;
    case NONBLOCKING:
      MPI_Iallreduce(send, buf, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD, &req);
      MPI_Wait(&req, MPI_STATUS_IGNORE);
      break;
    case NONBLOCKING_IN_PLACE:
      MPI_Iallreduce(MPI_IN_PLACE, buf, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD, &req);
      MPI_Wait(&req, MPI_STATUS_IGNORE);
      break;
  }
  *secs = MPI_Wtime() - t0;
  const double ranks = (double)size * (size + 1) / 2;
  *err = 0;
  for (long i = 0; i < count; i++) {
    const double want = ranks + (double)size * (double)i / (double)count;
    double e = fabs(buf[i] - want) / want;
    if (isnan(e)) e = INFINITY; /* a NaN shows as inf */
    if (e > *err) *err = e;
  }
  free(buf);
  free(send);
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int rank, size;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  long defaults[] = {5000, 20000, 100000, 500000};
  const int ncounts = argc > 1 ? argc - 1 : 4;
  if (rank == 0) printf("# %d ranks: count form max_relative_error slowest_rank_seconds\n", size);
  for (int c = 0; c < ncounts; c++) {
    const long count = argc > 1 ? atol(argv[c + 1]) : defaults[c];
    if (count < 1 || count > 1L << 28) {
      if (rank == 0) fprintf(stderr, "iallreduce: a count of %s floats is out of range\n",
                             argv[c + 1]);
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
    for (int f = BLOCKING; f <= NONBLOCKING_IN_PLACE; f++) {
      double err, secs, worst, slowest;
      one((enum form)f, count, rank, size, &err, &secs);
      MPI_Reduce(&err, &worst, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
      MPI_Reduce(&secs, &slowest, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
      if (rank == 0)
        printf("%ld\t%s\t%.3g\t%.6g\n", count, form_names[f], worst, slowest);
    }
  }
  MPI_Finalize();
  return 0;
}
