// What the CUDA emulation costs (docs/cudaemu.md's figures): a coroutine switch (barriers and
// warp shuffles), a launch, the opening and closing of device memory around a launch as the
// number of live allocations grows, and a memory-bound kernel. A benchmark, not a test: it
// reports figures and checks nothing (`make -C tests/cudaemu bench_cudaemu`).
#include <chrono>
#include <cstdio>
#include <vector>

#include <cuda_runtime.h>

static double now() {
  using namespace std::chrono;
  return duration<double>(steady_clock::now().time_since_epoch()).count();
}

__global__ void barriers(int *out, int rounds) {
  int x = threadIdx.x;
  for (int r = 0; r < rounds; r++) {
    x += r;
    __syncthreads();
  }
  if (threadIdx.x == 0) out[0] = x;
}

__global__ void shuffles(int *out, int rounds) {
  int x = threadIdx.x;
  for (int r = 0; r < rounds; r++) x += __shfl_xor_sync(0xffffffffu, x, 1);
  if (threadIdx.x == 0) out[0] = x;
}

__global__ void nothing(int *out) {
  if (out && threadIdx.x == 1000) out[0] = 1;
}

__global__ void axpy(float *y, const float *x, float a, size_t n) {
  const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] += a * x[i];
}

int main() {
  int *d = nullptr;
  cudaMalloc(&d, 64);
  const int threads = 1024, rounds = 200;
  double t = now();
  barriers<<<1, threads>>>(d, rounds);
  cudaDeviceSynchronize();
  t = now() - t;
  // each thread switches out and back in at every barrier
  printf("barrier: %.1f ns per thread per __syncthreads (%d threads, %d barriers)\n",
         t / ((double)threads * rounds) * 1e9, threads, rounds);
  t = now();
  shuffles<<<1, threads>>>(d, rounds);
  cudaDeviceSynchronize();
  t = now() - t;
  printf("shuffle: %.1f ns per lane per __shfl_xor_sync\n", t / ((double)threads * rounds) * 1e9);
  const int launches = 2000;
  t = now();
  for (int i = 0; i < launches; i++) nothing<<<1, 32>>>(d);
  cudaDeviceSynchronize();
  t = now() - t;
  printf("launch: %.1f us per launch of one block of 32 threads that do nothing\n",
         t / launches * 1e6);
  t = now();
  nothing<<<4096, 256>>>(d);
  cudaDeviceSynchronize();
  t = now() - t;
  printf("threads that meet no barrier: %.1f ns per thread (4096 blocks of 256)\n",
         t / (4096.0 * 256) * 1e9);
  std::vector<void *> live;
  for (int count : {10, 100, 1000, 5000}) {
    while ((int)live.size() < count) {
      void *p = nullptr;
      cudaMalloc(&p, 4096);
      live.push_back(p);
    }
    t = now();
    for (int i = 0; i < 200; i++) nothing<<<1, 32>>>(d);
    cudaDeviceSynchronize();
    t = now() - t;
    printf("launch with %5d live allocations: %.1f us (opening and closing device memory)\n", count,
           t / 200 * 1e6);
  }
  for (void *p : live) cudaFree(p);
  const size_t n = 1 << 22;
  float *x = nullptr, *y = nullptr;
  cudaMalloc(&x, n * 4);
  cudaMalloc(&y, n * 4);
  cudaMemset(x, 0, n * 4);
  cudaMemset(y, 0, n * 4);
  t = now();
  axpy<<<(unsigned)(n / 256), 256>>>(y, x, 2.0f, n);
  cudaDeviceSynchronize();
  t = now() - t;
  printf("axpy over %zu floats: %.1f ns per element (%.3f s)\n", n, t / n * 1e9, t);
  cudaFree(x);
  cudaFree(y);
  cudaFree(d);
  return 0;
}
