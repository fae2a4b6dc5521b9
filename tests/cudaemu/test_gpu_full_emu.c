/* tests/test_gpu_full.c run under the CUDA emulation: linked against gpu/ compiled through cu2cc.py
 * and libcudaemu.a instead of nvcc's objects; its main (TU_GPU_MAIN, testutil.h) then also applies
 * the test filter CUDAEMU_TEST_FILTER (the scripts' and the mutation check's) and fails a run
 * that leaves device memory allocated. It must not change what a test checks. */
#define TU_GPU_EMULATED
#include "../test_gpu_full.c"
