/* tests/test_gpu_fma.c run under the CUDA emulation, as test_gpu_emu.c runs test_gpu.c: the gpu/
 * sources compiled through cu2cc.py and libcudaemu.a, a test filter (CUDAEMU_TEST_FILTER, for
 * the scripts and the mutation check) and a device-memory leak check at the end. It must not
 * change what a test checks. */
#define TEST_GPU_OWN_MAIN
#include "../test_gpu_fma.c"

size_t cudaemu_bytes_in_use(void);

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank != 0 && !freopen("/dev/null", "w", stdout)) return 1; /* one TAP stream */
  char err[256];
  if (!gpu_backend_open(NULL, err, sizeof err)) {
    fprintf(stderr, "test_gpu_fma_emu: no emulated device: %s\n", err);
    return 1; /* under the emulation there is a GPU: a skip would be a failure */
  }
  cmocka_set_message_output(CM_OUTPUT_TAP);
  const char *filter = getenv("CUDAEMU_TEST_FILTER");
  if (filter && *filter) cmocka_set_test_filter(filter);
  int rc = cmocka_run_group_tests(gpu_fma_tests, NULL, NULL);
  gpu_close();
  const size_t leaked = cudaemu_bytes_in_use();
  if (leaked) {
    fprintf(stderr, "cudaemu: %zu bytes of device memory still allocated at exit\n", leaked);
    if (!rc) rc = 1;
  }
  MPI_Finalize();
  return rc;
}
