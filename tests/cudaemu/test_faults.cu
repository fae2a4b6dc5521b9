// The hardware checks of the CUDA emulation, one defect per subcommand: `test_faults NAME` must
// end the process with a non-zero status and a "cudaemu:" message naming the violation
// (test_faults.sh asserts both). Each defect is one a GPU turns into a fault, a hang or a
// compile error; a subcommand that returns normally means the emulation missed it.
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <cublas_v2.h>
#include <cuda_runtime.h>

#define CHECK(call)                                                      \
  do {                                                                   \
    const cudaError_t e_ = (call);                                       \
    if (e_ != cudaSuccess) {                                             \
      fprintf(stderr, "%s failed: %s\n", #call, cudaGetErrorString(e_)); \
      exit(3);                                                           \
    }                                                                    \
  } while (0)

static float *dev(size_t n) {
  float *p = nullptr;
  CHECK(cudaMalloc(&p, n * sizeof(float)));
  return p;
}

struct holder {
  float *p;  // a pointer the launch cannot see
};

__global__ void write_at(float *p, long i) { p[i] = 1.0f; }
__global__ void read_through(holder h, float *out) { out[0] = h.p[0]; }
__global__ void atomic_through(holder h) { atomicAdd(h.p, 1.0f); }

// threads 32.. return before the barrier the others wait at
__global__ void exit_before_barrier(float *p) {
  if (threadIdx.x >= 32) return;
  __syncthreads();
  p[threadIdx.x] = 1.0f;
}

__global__ void barriers_at_two_sites(float *p) {
  if (threadIdx.x < 32) {
    p[threadIdx.x] = 1.0f;
    __syncthreads();
  } else {
    p[threadIdx.x] = 2.0f;
    __syncthreads();
  }
}

// lanes 16-31 never reach the full-mask shuffle
__global__ void missing_lanes(float *p) {
  if (threadIdx.x % 32 >= 16) return;
  p[threadIdx.x] = __shfl_sync(0xffffffffu, 1.0f, 0);
}

// every lane calls with a mask naming lanes 0-15 only
__global__ void lane_outside_mask(float *p) {
  p[threadIdx.x] = __shfl_xor_sync(0x0000ffffu, 1.0f, 1);
}

// lane 0 waits at a barrier while lanes 1-31 wait for it at a shuffle: neither can go on
__global__ void warp_vs_barrier(float *p) {
  if (threadIdx.x == 0) {
    __syncthreads();
  } else if (threadIdx.x < 32) {
    p[threadIdx.x] = __shfl_sync(0xffffffffu, 1.0f, 0);
  } else {
    __syncthreads();
  }
}

__device__ float deep(int n, float *p) {
  volatile float pad[512];
  pad[n % 512] = (float)n;
  return n == 0 ? pad[0] : deep(n - 1, p) + pad[n % 512];
}
__global__ void overflow_stack(float *p, int n) { p[0] = deep(n, p); }

#pragma GCC diagnostic ignored "-Warray-bounds"  // the defect below is deliberate
__global__ void shared_past_end(float *p) {
  __shared__ float tile[32][33];
  tile[threadIdx.x][32] = 1.0f;
  tile[32][threadIdx.x] = 2.0f;  // row 32 of 32: one row past the end
  p[threadIdx.x] = tile[0][0];
}

__global__ void static_smem_too_big(float *p) {
  __shared__ float big[16 * 1024];  // 64 KiB of static shared memory
  big[threadIdx.x] = 1.0f;
  p[threadIdx.x] = big[threadIdx.x];
}

__global__ void dynamic_plus_static(float *p) {
  __shared__ float s[8 * 1024];  // 32 KiB static + 20 KiB dynamic > 48 KiB
  extern __shared__ float dyn[];
  s[threadIdx.x] = 1.0f;
  dyn[threadIdx.x] = 1.0f;
  p[threadIdx.x] = s[threadIdx.x] + dyn[threadIdx.x];
}

__global__ void trapping(float *p) {
  if (threadIdx.x == 3) __trap();
  p[threadIdx.x] = 1.0f;
}

static int run(const char *what) {
  const size_t n = 100;
  float *a = dev(n);
  if (!strcmp(what, "none")) {
    write_at<<<1, 1>>>(a, (long)n - 1);  // the last element: no defect
  } else if (!strcmp(what, "oob_write")) {
    write_at<<<1, 1>>>(a, (long)n);  // one float past the end
  } else if (!strcmp(what, "oob_far")) {
    write_at<<<1, 1>>>(a, 5000);  // past the end by more than a page
  } else if (!strcmp(what, "write_before")) {
    write_at<<<1, 1>>>(a, -1);  // no guard there: the canary shows it at cudaFree
    CHECK(cudaFree(a));
  } else if (!strcmp(what, "use_after_free")) {
    float *b = dev(n);
    CHECK(cudaFree(b));
    read_through<<<1, 1>>>(holder{b}, a);
  } else if (!strcmp(what, "freed_argument")) {
    float *b = dev(n);
    CHECK(cudaFree(b));
    write_at<<<1, 1>>>(b, 0);
  } else if (!strcmp(what, "host_pointer_argument")) {
    float *h = static_cast<float *>(malloc(n * sizeof(float)));
    write_at<<<1, 1>>>(h, 0);
  } else if (!strcmp(what, "atomic_on_host")) {
    float host_value = 0.0f;
    read_through<<<1, 1>>>(holder{&host_value}, a);  // a kernel reading host memory: no fault
    atomic_through<<<1, 1>>>(holder{&host_value});   // an atomic on it is caught
  } else if (!strcmp(what, "host_reads_device")) {
    CHECK(cudaMemset(a, 0, n * sizeof(float)));
    CHECK(cudaDeviceSynchronize());
    volatile float x = a[3];  // host code dereferencing device memory
    (void)x;
  } else if (!strcmp(what, "exit_before_barrier")) {
    exit_before_barrier<<<1, 64>>>(a);
  } else if (!strcmp(what, "barrier_sites")) {
    barriers_at_two_sites<<<1, 64>>>(a);
  } else if (!strcmp(what, "missing_lanes")) {
    missing_lanes<<<1, 32>>>(a);
  } else if (!strcmp(what, "lane_outside_mask")) {
    lane_outside_mask<<<1, 32>>>(a);
  } else if (!strcmp(what, "deadlock")) {
    warp_vs_barrier<<<1, 64>>>(a);
  } else if (!strcmp(what, "stack_overflow")) {
    overflow_stack<<<1, 2>>>(a, 1 << 20);
  } else if (!strcmp(what, "shared_past_end")) {
    shared_past_end<<<1, 32>>>(a);
  } else if (!strcmp(what, "static_smem")) {
    static_smem_too_big<<<1, 32>>>(a);
  } else if (!strcmp(what, "static_plus_dynamic_smem")) {
    dynamic_plus_static<<<1, 32, 20 << 10>>>(a);
  } else if (!strcmp(what, "trap")) {
    trapping<<<1, 32>>>(a);
  } else if (!strcmp(what, "cublas_past_end")) {
    cublasHandle_t h;
    cublasCreate(&h);
    const float one = 1.0f, zero = 0.0f;
    float *c = dev(n);
    // 10 x 10 GEMM with lda = 11: valid arguments, but A reaches 10 floats past its 100
    const cublasStatus_t s =
        cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, 10, 10, 10, &one, a, 11, a, 10, &zero, c, 10);
    fprintf(stderr, "cublasSgemm returned %d\n", (int)s);
  } else {
    fprintf(stderr, "test_faults: unknown defect %s\n", what);
    return 2;
  }
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());
  printf("test_faults %s: no error reported\n", what);
  return 0;
}

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: test_faults DEFECT\n");
    return 2;
  }
  return run(argv[1]);
}
