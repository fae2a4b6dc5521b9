// The CUDA back end's debug mode (deck key gpu.debug, gpu/check.h LAUNCH_CHECK) on a planted
// defect, run as a GPU runs it: streams deferred (work runs when the host waits) and a fault made
// the context's sticky error (CUDAEMU_DEFER=1 CUDAEMU_FAULTS=sticky). argv[1]:
//   clean    no defect: the program prints "ok" and exits 0
//   debug    a kernel writes past its allocation, debug on: the job ends naming that kernel
//   nodebug  the same, debug off: the job ends at the next call that waits, advising gpu.debug
#include <mpi.h>

#include <cstdio>
#include <cstring>

#include "check.h"
#include "gpu.h"

namespace {

__global__ void planted_oob(float *x, int n) { x[n + threadIdx.x] = 1.0f; }  // past the end

__global__ void fill(float *x, int n) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) x[i] = 2.0f;
}

}  // namespace

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  const char *mode = argc > 1 ? argv[1] : "clean";
  char err[256];
  if (gpu_open(0, false, err, sizeof err)) {
    fprintf(stderr, "%s\n", err);
    return 2;
  }
  gpu_set_debug(strcmp(mode, "nodebug") != 0);
  const int n = 256;
  float *x = nullptr, h[256];
  CUDA_CHECK(cudaMalloc(&x, n * sizeof(float)));  // exactly n floats: the next one faults
  if (strcmp(mode, "clean") != 0) {
    planted_oob<<<1, 32, 0, gpu_stream()>>>(x, n);
    LAUNCH_CHECK(planted_oob);
  }
  fill<<<1, 64, 0, gpu_stream()>>>(x, n);
  LAUNCH_CHECK(fill);
  gpu_download(h, x, sizeof h);
  printf("ok %g\n", (double)h[n - 1]);
  CUDA_CHECK(cudaFree(x));
  gpu_close();
  MPI_Finalize();
  return 0;
}
