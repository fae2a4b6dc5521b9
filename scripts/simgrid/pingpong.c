/* Ping-pong between ranks 0 and 1: the one-way time of a message of each size (half the median
 * round trip), printed as "bytes seconds" lines. scripts/simgrid/calibrate.sh runs it natively
 * (the figures platform this_machine.xml is given) and under smpirun (the platform's answer). */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int cmp(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int rank, size;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (size != 2) {
    if (rank == 0) fprintf(stderr, "pingpong: run it on 2 ranks\n");
    MPI_Finalize();
    return 1;
  }
  enum { REPS = 31, MAXB = 1 << 24 };
  char *buf = malloc(MAXB);
  memset(buf, 1, MAXB);
  double t[REPS];
  for (long bytes = 8; bytes <= MAXB; bytes *= 8) {
    for (int r = -2; r < REPS; r++) { /* two warm-up round trips */
      MPI_Barrier(MPI_COMM_WORLD);
      double t0 = MPI_Wtime();
      if (rank == 0) {
        MPI_Send(buf, (int)bytes, MPI_BYTE, 1, 0, MPI_COMM_WORLD);
        MPI_Recv(buf, (int)bytes, MPI_BYTE, 1, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
      } else {
        MPI_Recv(buf, (int)bytes, MPI_BYTE, 0, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        MPI_Send(buf, (int)bytes, MPI_BYTE, 0, 0, MPI_COMM_WORLD);
      }
      if (r >= 0) t[r] = (MPI_Wtime() - t0) / 2;
    }
    qsort(t, REPS, sizeof t[0], cmp);
    if (rank == 0) printf("%ld %.9f\n", bytes, t[REPS / 2]);
  }
  free(buf);
  MPI_Finalize();
  return 0;
}
