/* Test helper for test_nystrom_pinv.sh: reads matrices A (count, m, m) from IN.h5 and writes
 * every iterate of nystrom's pseudo-inverse, Z (count, iters + 1, m, m), to OUT.h5, so that
 * numpy can set them against its pinv. Usage: nystrom_pinv IN.h5 OUT.h5 ITERS. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

#include "../src/attention/nystrom.h"
#include "../src/core/error.h"
#include "../src/core/h5io.h"

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  if (argc != 4) {
    fprintf(stderr, "usage: nystrom_pinv IN.h5 OUT.h5 ITERS\n");
    return 2;
  }
  const int iters = atoi(argv[3]);
  hid_t in = h5_open(argv[1], false);
  long shape[3];
  if (h5_dataset_shape(in, "A", shape, 3) != 3 || shape[1] != shape[2])
    error("%s: dataset A must be (count, m, m)", argv[1]);
  const long count = shape[0], m = shape[1];
  float *A = xmalloc(sizeof(float) * (size_t)(count * m * m));
  float *Z = xmalloc(sizeof(float) * (size_t)(count * (iters + 1) * m * m));
  float *work = xmalloc(sizeof(float) * (size_t)(4 * m * m));
  h5_read_floats(in, "A", 3, shape, A, argv[1]);
  h5_close(in);
  for (long b = 0; b < count; b++)
    nystrom_pinv(Z + b * (iters + 1) * m * m, A + b * m * m, m, iters, work);
  hid_t out = h5_create(argv[2]);
  const long zshape[4] = {count, iters + 1, m, m};
  h5_write_floats(out, "Z", 4, zshape, Z, false, true);
  h5_close(out);
  free(A), free(Z), free(work);
  MPI_Finalize();
  return 0;
}
