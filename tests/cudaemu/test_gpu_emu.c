/* tests/test_gpu.c, unchanged, run under the CUDA emulation: linked against the gpu/ sources
 * compiled through cu2cc.py and libcudaemu.a instead of nvcc's objects. main() is the one of
 * testutil.h plus a test filter (CUDAEMU_TEST_FILTER, for the mutation check) and a device-memory
 * leak check at the end. It must not change what a test checks. */
#include "../testutil.h"

size_t cudaemu_bytes_in_use(void);

#undef TU_MAIN
#define TU_MAIN(tests)                                                                          \
  int main(int argc, char **argv) {                                                             \
    MPI_Init(&argc, &argv);                                                                     \
    int rank_ = 0;                                                                              \
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);                                                      \
    if (rank_ != 0 && !freopen("/dev/null", "w", stdout)) return 1; /* one TAP stream */        \
    cmocka_set_message_output(CM_OUTPUT_TAP);                                                   \
    const char *filter = getenv("CUDAEMU_TEST_FILTER");                                         \
    if (filter && *filter) cmocka_set_test_filter(filter);                                      \
    int rc = cmocka_run_group_tests(tests, NULL, NULL);                                         \
    gpu_close();                                                                                \
    const size_t leaked = cudaemu_bytes_in_use();                                               \
    if (leaked) {                                                                               \
      fprintf(stderr, "cudaemu: %zu bytes of device memory still allocated at exit\n", leaked); \
      if (!rc) rc = 1;                                                                          \
    }                                                                                           \
    MPI_Finalize();                                                                             \
    return rc;                                                                                  \
  }

#include "../test_gpu.c"
