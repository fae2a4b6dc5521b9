// The CUDA emulation's primitives against known answers: barriers and their reductions, warp
// shuffles (full and partial masks, widths, 64-bit values), votes, atomics, static and dynamic
// shared memory, the NaN fill, the thread and block orders, indices, intrinsics, the launch
// limits and the runtime API's error codes. Run in every thread order by test_primitives.sh.
#include <algorithm>
#include <cstdio>
#include <string>

#include "emu_test.h"

// ---- barriers ----
// grid 2, block 256: each thread reads what its neighbour wrote before the barrier.
__global__ void rotate(int *out) {
  __shared__ int s[256];
  const int t = threadIdx.x;
  s[t] = 2 * t + 1;
  __syncthreads();
  out[blockIdx.x * 256 + t] = s[(t + 1) % 256] + 1000 * (int)blockIdx.x;
}

__global__ void barrier_votes(int *out) {
  const int t = threadIdx.x;
  const int count = __syncthreads_count(t % 3 == 0);
  const int all_small = __syncthreads_and(t < 1000), all_tiny = __syncthreads_and(t < 100);
  const int any_last = __syncthreads_or(t == 255);
  if (t == 0) out[0] = count, out[1] = all_small, out[2] = all_tiny, out[3] = any_last;
}

static void test_barrier(void **) {
  int *d = dev_alloc<int>(512);
  rotate<<<2, 256>>>(d);
  CUDA_OK(cudaGetLastError());
  std::vector<int> h = download(d, 512);
  for (int b = 0; b < 2; b++)
    for (int t = 0; t < 256; t++)
      assert_int_equal(h[b * 256 + t], 2 * ((t + 1) % 256) + 1 + 1000 * b);
  barrier_votes<<<1, 256>>>(d);
  h = download(d, 4);
  assert_int_equal(h[0], 86);  // multiples of 3 in [0, 256)
  assert_int_equal(h[1], 1);
  assert_int_equal(h[2], 0);
  assert_int_equal(h[3], 1);
  CUDA_OK(cudaFree(d));
}

// ---- warp shuffles ----
// block 64 (two warps); out (64, 8)
__global__ void shuffles(int *out) {
  const int t = threadIdx.x, lane = t % 32;
  int *o = out + t * 8;
  o[0] = __shfl_sync(0xffffffffu, t, 5);
  int v = lane;
  for (int m = 16; m > 0; m /= 2) v += __shfl_xor_sync(0xffffffffu, v, m);
  o[1] = v;
  o[2] = __shfl_up_sync(0xffffffffu, lane, 1, 8);
  o[3] = __shfl_down_sync(0xffffffffu, lane, 2, 16);
  o[4] = __shfl_sync(0xffffffffu, lane, 33);  // srcLane modulo the width
  o[5] = lane % 2 == 0 ? __shfl_xor_sync(0x55555555u, lane, 2) : -1;
  // two groups of one warp at different primitives at once
  o[6] = lane < 16 ? __shfl_down_sync(0x0000ffffu, lane, 1) : __shfl_up_sync(0xffff0000u, lane, 1);
  const long long big = (1ll << 40) + lane;
  const double x = 0.5 + lane;
  o[7] = (__shfl_sync(0xffffffffu, big, 31) == (1ll << 40) + 31) +
         2 * (__shfl_xor_sync(0xffffffffu, x, 1) == 0.5 + (lane ^ 1));
}

static void test_shuffles(void **) {
  int *d = dev_alloc<int>(64 * 8);
  shuffles<<<1, 64>>>(d);
  CUDA_OK(cudaGetLastError());
  const std::vector<int> h = download(d, 64 * 8);
  for (int t = 0; t < 64; t++) {
    const int lane = t % 32, *o = &h[(size_t)t * 8];
    assert_int_equal(o[0], t / 32 * 32 + 5);
    assert_int_equal(o[1], 496);
    assert_int_equal(o[2], lane % 8 == 0 ? lane : lane - 1);
    assert_int_equal(o[3], lane % 16 + 2 < 16 ? lane + 2 : lane);
    assert_int_equal(o[4], 1);
    assert_int_equal(o[5], lane % 2 == 0 ? lane ^ 2 : -1);
    // lanes 15 and 16 read a lane outside their mask: undefined on a GPU, all ones here
    if (lane < 16)
      assert_int_equal(o[6], lane < 15 ? lane + 1 : -1);
    else
      assert_int_equal(o[6], lane > 16 ? lane - 1 : -1);
    assert_int_equal(o[7], 3);
  }
  CUDA_OK(cudaFree(d));
}

// ---- votes and warp reductions ----
__global__ void votes(unsigned *out) {
  const int lane = threadIdx.x % 32;
  unsigned *o = out + threadIdx.x * 8;
  o[0] = __ballot_sync(0xffffffffu, lane % 3 == 0);
  o[1] = lane < 16 ? __ballot_sync(0x0000ffffu, lane % 2) : 7u;
  o[2] = __any_sync(0xffffffffu, lane == 17);
  o[3] = __all_sync(0xffffffffu, lane < 31);
  o[4] = __reduce_add_sync(0xffffffffu, (unsigned)lane);
  o[5] = (unsigned)__reduce_min_sync(0xffffffffu, 3 - lane);
  o[6] = __reduce_max_sync(0xffffffffu, (unsigned)lane * 3u);
  __syncwarp(0xffffffffu);
  o[7] = __reduce_or_sync(0xffffffffu, 1u << (lane % 8));
}

static void test_votes(void **) {
  unsigned *d = dev_alloc<unsigned>(32 * 8);
  votes<<<1, 32>>>(d);
  CUDA_OK(cudaGetLastError());
  const std::vector<unsigned> h = download(d, 32 * 8);
  for (int lane = 0; lane < 32; lane++) {
    const unsigned *o = &h[(size_t)lane * 8];
    assert_int_equal(o[0], 0x49249249u);
    assert_int_equal(o[1], lane < 16 ? 0x0000aaaau : 7u);
    assert_int_equal(o[2], 1);
    assert_int_equal(o[3], 0);
    assert_int_equal(o[4], 496);
    assert_int_equal((int)o[5], 3 - 31);
    assert_int_equal(o[6], 93);
    assert_int_equal(o[7], 0xffu);
  }
  CUDA_OK(cudaFree(d));
}

// ---- atomics ----
struct counters {
  int n, mx, mn;
  unsigned inc, cas;
  float half;
  double third;
  unsigned long long big;
};

__global__ void atomics(counters *c, int *shared_out) {
  __shared__ int block_count;
  const int g = blockIdx.x * blockDim.x + threadIdx.x;
  if (threadIdx.x == 0) block_count = 0;
  __syncthreads();
  atomicAdd(&block_count, 2);
  atomicAdd(&c->n, 1);
  atomicMax(&c->mx, g);
  atomicMin(&c->mn, -g);
  atomicInc(&c->inc, 100u);
  atomicAdd(&c->half, 0.5f);
  atomicAdd(&c->third, 1.0 / 3.0);
  atomicAdd(&c->big, 1ull << 33);
  unsigned old = c->cas, seen;
  while ((seen = atomicCAS(&c->cas, old, old + 3u)) != old) old = seen;
  __syncthreads();
  if (threadIdx.x == 0) shared_out[blockIdx.x] = block_count;
}

static void test_atomics(void **) {
  counters zero{};
  counters *c = dev_alloc<counters>(1);
  int *s = dev_alloc<int>(8);
  CUDA_OK(cudaMemcpy(c, &zero, sizeof zero, cudaMemcpyHostToDevice));
  atomics<<<8, 128>>>(c, s);
  CUDA_OK(cudaGetLastError());
  counters h;
  CUDA_OK(cudaMemcpy(&h, c, sizeof h, cudaMemcpyDeviceToHost));
  assert_int_equal(h.n, 1024);
  assert_int_equal(h.mx, 1023);
  assert_int_equal(h.mn, -1023);
  assert_int_equal(h.inc, 1024 % 101);
  assert_int_equal(h.cas, 3 * 1024);
  assert_true(h.half == 512.0f);
  assert_true(std::fabs(h.third - 1024.0 / 3.0) < 1e-9);
  assert_true(h.big == 1024ull << 33);
  for (int v : download(s, 8)) assert_int_equal(v, 256);
  CUDA_OK(cudaFree(c));
  CUDA_OK(cudaFree(s));
}

// ---- shared memory ----
template <int N>
__device__ float *scratch() {
  __shared__ float x[4];
  return x;
}

// one __shared__ declaration, one object per block: two calls see the same; instances differ
__global__ void shared_identity(int *out) {
  float *a = scratch<1>(), *b = scratch<1>(), *c = scratch<2>();
  if (threadIdx.x == 0) a[0] = 7.0f;
  __syncthreads();
  out[threadIdx.x] = (a == b) + 2 * (a != c) + 4 * (b[0] == 7.0f);
}

// dynamic shared memory: two declarations alias it; the block reverses its input through it
__global__ void reverse_dynamic(float *out, const float *in, int n) {
  extern __shared__ float dyn[];
  extern __shared__ int dyn_int[];
  for (int i = threadIdx.x; i < n; i += blockDim.x) dyn[i] = in[i];
  __syncthreads();
  for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] = dyn[n - 1 - i];
  if (threadIdx.x == 0) out[n] = (void *)dyn == (void *)dyn_int ? 1.0f : 0.0f;
}

static void test_shared(void **) {
  int *d = dev_alloc<int>(64);
  shared_identity<<<3, 64>>>(d);
  CUDA_OK(cudaGetLastError());
  for (int v : download(d, 64)) assert_int_equal(v, 7);
  CUDA_OK(cudaFree(d));
  for (int n : {1000, 16000}) {  // 4 KB, and 64 KB with the attribute raised
    std::vector<float> h((size_t)n);
    for (int i = 0; i < n; i++) h[(size_t)i] = (float)i;
    float *in = upload(h), *out = dev_alloc<float>((size_t)n + 1);
    const size_t bytes = sizeof(float) * (size_t)n;
    if (bytes > (48 << 10))
      CUDA_OK(cudaFuncSetAttribute(reverse_dynamic, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   (int)bytes));
    reverse_dynamic<<<1, 128, bytes>>>(out, in, n);
    CUDA_OK(cudaGetLastError());
    const std::vector<float> r = download(out, (size_t)n + 1);
    for (int i = 0; i < n; i++) assert_true(r[(size_t)i] == (float)(n - 1 - i));
    assert_true(r[(size_t)n] == 1.0f);
    CUDA_OK(cudaFree(in));
    CUDA_OK(cudaFree(out));
  }
}

// ---- NaN fill ----
// Reads shared memory before any thread of the block wrote it, then writes it.
__global__ void read_unwritten(float *out) {
  __shared__ float s[64];
  extern __shared__ float dyn[];
  out[blockIdx.x * 128 + threadIdx.x] = s[threadIdx.x];
  out[blockIdx.x * 128 + 64 + threadIdx.x] = dyn[threadIdx.x];
  __syncthreads();
  s[threadIdx.x] = 1.0f;
  dyn[threadIdx.x] = 2.0f;
}

static void test_nan_fill(void **) {
  const size_t n = 1000;
  float *d = dev_alloc<float>(n);
  std::vector<unsigned char> raw(sizeof(float) * n);
  CUDA_OK(cudaMemcpy(raw.data(), d, raw.size(), cudaMemcpyDeviceToHost));
  for (unsigned char b : raw) assert_int_equal(b, 0xff);
  read_unwritten<<<3, 64, 64 * sizeof(float)>>>(d);  // every block sees fresh NaN
  CUDA_OK(cudaGetLastError());
  for (float v : download(d, 3 * 128)) assert_true(std::isnan(v));
  CUDA_OK(cudaFree(d));
}

// ---- thread and block orders ----
// One block of 64 threads, no barrier: each thread takes the next log slot as it runs; then
// once more after a barrier. Thread 0 of each of 8 blocks logs its block the same way.
__global__ void order_log(int *log, int *counter, int *blocks, int *block_counter) {
  log[atomicAdd(counter, 1)] = threadIdx.x;
  __syncthreads();
  log[atomicAdd(counter, 1)] = threadIdx.x;
  if (threadIdx.x == 0) blocks[atomicAdd(block_counter, 1)] = blockIdx.x;
}

static void test_orders(void **) {
  int *log = dev_alloc<int>(8 * 128), *blocks = dev_alloc<int>(8), *counters = dev_alloc<int>(2);
  CUDA_OK(cudaMemset(counters, 0, 2 * sizeof(int)));
  order_log<<<8, 64>>>(log, counters, blocks, counters + 1);
  CUDA_OK(cudaGetLastError());
  const std::vector<int> l = download(log, 128), b = download(blocks, 8);
  const std::string order = env_or("CUDAEMU_ORDER", "index");
  std::vector<int> first(l.begin(), l.begin() + 64), second(l.begin() + 64, l.end());
  std::vector<int> index(64), reversed(64), bindex(8), breversed(8);
  for (int i = 0; i < 64; i++) index[(size_t)i] = i, reversed[(size_t)i] = 63 - i;
  for (int i = 0; i < 8; i++) bindex[(size_t)i] = i, breversed[(size_t)i] = 7 - i;
  // the log of the block that ran first; every thread appears once in each phase
  std::vector<int> sorted = first;
  std::sort(sorted.begin(), sorted.end());
  assert_true(sorted == index);
  if (order == "index") {
    assert_true(first == index && second == index && b == bindex);
  } else if (order == "reverse") {
    assert_true(first == reversed && second == reversed && b == breversed);
  } else {  // shuffled: neither order, and the two phases differ; the blocks a permutation
    assert_true(first != index && first != reversed && first != second);
    std::vector<int> bs = b;
    std::sort(bs.begin(), bs.end());
    assert_true(bs == bindex);
  }
  CUDA_OK(cudaFree(log));
  CUDA_OK(cudaFree(blocks));
  CUDA_OK(cudaFree(counters));
}

// ---- indices and intrinsics ----
// grid (3,2,2), block (4,3,2): every thread writes its coordinates at its global index
__global__ void indices(int *out) {
  const int b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  const int t = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  const int g = b * blockDim.x * blockDim.y * blockDim.z + t;
  out[g] = blockIdx.x | blockIdx.y << 4 | blockIdx.z << 8 | threadIdx.x << 12 | threadIdx.y << 16 |
           threadIdx.z << 20;
}

__global__ void intrinsics(float *f, int *i) {
  f[0] = rsqrtf(4.0f);
  f[1] = __saturatef(2.0f);
  f[2] = __saturatef(NAN);
  f[3] = __int_as_float(0x3f800000);
  f[4] = max(1.5f, -2.0f);
  i[0] = __float_as_int(1.0f);
  i[1] = __popc(0xffu);
  i[2] = __clz(1);
  i[3] = (int)__brev(1u);
  i[4] = __ffs(8);
  i[5] = (int)min(-3L, 2L);
  i[6] = warpSize;
}

static void test_indices_intrinsics(void **) {
  int *d = dev_alloc<int>(12 * 24);
  indices<<<dim3(3, 2, 2), dim3(4, 3, 2)>>>(d);
  CUDA_OK(cudaGetLastError());
  const std::vector<int> h = download(d, 12 * 24);
  for (int bz = 0; bz < 2; bz++)
    for (int by = 0; by < 2; by++)
      for (int bx = 0; bx < 3; bx++)
        for (int tz = 0; tz < 2; tz++)
          for (int ty = 0; ty < 3; ty++)
            for (int tx = 0; tx < 4; tx++) {
              const int g = ((bz * 2 + by) * 3 + bx) * 24 + (tz * 3 + ty) * 4 + tx;
              assert_int_equal(h[(size_t)g],
                               bx | by << 4 | bz << 8 | tx << 12 | ty << 16 | tz << 20);
            }
  float *f = dev_alloc<float>(5);
  int *i = dev_alloc<int>(7);
  intrinsics<<<1, 1>>>(f, i);
  const std::vector<float> hf = download(f, 5);
  const std::vector<int> hi = download(i, 7);
  assert_true(hf[0] == 0.5f && hf[1] == 1.0f && hf[2] == 0.0f && hf[3] == 1.0f && hf[4] == 1.5f);
  assert_int_equal(hi[0], 0x3f800000);
  assert_int_equal(hi[1], 8);
  assert_int_equal(hi[2], 31);
  assert_int_equal((unsigned)hi[3], 0x80000000u);
  assert_int_equal(hi[4], 4);
  assert_int_equal(hi[5], -3);
  assert_int_equal(hi[6], 32);
  CUDA_OK(cudaFree(d));
  CUDA_OK(cudaFree(f));
  CUDA_OK(cudaFree(i));
}

// ---- launch limits: errors through cudaGetLastError, as CUDA reports them ----
__global__ void touch(int *p) {
  if (p) p[0] = 1;
}
__global__ void dynamic_user(int *p) {
  extern __shared__ int dyn[];
  dyn[threadIdx.x] = 1;
  if (p && threadIdx.x == 0) p[0] = dyn[0];
}

static void expect_launch_error(cudaError_t want) {
  assert_int_equal(cudaPeekAtLastError(), want);  // the peek keeps it,
  assert_int_equal(cudaGetLastError(), want);     // the get clears it
  assert_int_equal(cudaGetLastError(), cudaSuccess);
}

static void test_launch_limits(void **) {
  int *d = dev_alloc<int>(1);
  touch<<<0, 32>>>(d);  // an empty grid
  expect_launch_error(cudaErrorInvalidConfiguration);
  touch<<<dim3(4, 0), 32>>>(d);
  expect_launch_error(cudaErrorInvalidConfiguration);
  touch<<<1, 0>>>(d);
  expect_launch_error(cudaErrorInvalidConfiguration);
  touch<<<1, 1025>>>(d);
  expect_launch_error(cudaErrorInvalidConfiguration);
  touch<<<1, dim3(32, 32, 2)>>>(d);  // 2048 threads
  expect_launch_error(cudaErrorInvalidConfiguration);
  touch<<<1, dim3(1, 1, 65)>>>(d);
  expect_launch_error(cudaErrorInvalidConfiguration);
  touch<<<dim3(1, 65536), 1>>>(d);
  expect_launch_error(cudaErrorInvalidConfiguration);
  touch<<<dim3(1, 1, 65536), 1>>>(d);
  expect_launch_error(cudaErrorInvalidConfiguration);
  touch<<<1, 32, 0, (cudaStream_t)0x1234>>>(d);
  expect_launch_error(cudaErrorInvalidResourceHandle);
  dynamic_user<<<1, 32, 49 << 10>>>(d);  // over 48 KiB without the attribute
  expect_launch_error(cudaErrorInvalidValue);
  assert_int_equal(
      cudaFuncSetAttribute(dynamic_user, cudaFuncAttributeMaxDynamicSharedMemorySize, 228 << 10),
      cudaErrorInvalidValue);  // beyond sm_90's 227 KiB
  (void)cudaGetLastError();
  CUDA_OK(
      cudaFuncSetAttribute(dynamic_user, cudaFuncAttributeMaxDynamicSharedMemorySize, 100 << 10));
  dynamic_user<<<1, 32, 100 << 10>>>(d);
  CUDA_OK(cudaGetLastError());
  dynamic_user<<<1, 32, 101 << 10>>>(d);  // over the raised limit
  expect_launch_error(cudaErrorInvalidValue);
  touch<<<dim3(1, 65535, 1), 1>>>(nullptr);  // the largest y runs (65,535 blocks)
  CUDA_OK(cudaGetLastError());
  CUDA_OK(cudaFree(d));
}

// ---- the runtime API ----
static void test_memory_api(void **) {
  const size_t before = cudaemu_bytes_in_use();
  float *a = dev_alloc<float>(1000);
  assert_int_equal(cudaemu_bytes_in_use(), before + 4000);
  size_t free_b = 0, total = 0;
  CUDA_OK(cudaMemGetInfo(&free_b, &total));
  assert_int_equal(total - free_b, cudaemu_bytes_in_use());
  assert_true((uintptr_t)a % 32 == 0);  // 4000 bytes: aligned to 32, its largest power of two
  void *z = (void *)1;
  CUDA_OK(cudaMalloc(&z, 0));
  assert_null(z);
  std::vector<float> h(1001, 3.0f);
  assert_int_equal(cudaMemcpy(a, h.data(), 4004, cudaMemcpyHostToDevice), cudaErrorInvalidValue);
  assert_int_equal(cudaMemcpy(h.data(), h.data() + 1, 4, cudaMemcpyDeviceToHost),
                   cudaErrorInvalidValue);                    // the source is no device memory
  CUDA_OK(cudaMemcpy(a, h.data(), 4000, cudaMemcpyDefault));  // direction from the pointers
  float *b = dev_alloc<float>(1000);
  CUDA_OK(cudaMemcpy(b, a, 4000, cudaMemcpyDeviceToDevice));
  CUDA_OK(cudaMemset(b, 0, 8));
  const std::vector<float> r = download(b, 1000);
  assert_true(r[0] == 0.0f && r[1] == 0.0f && r[2] == 3.0f && r[999] == 3.0f);
  assert_int_equal(cudaMemsetAsync(b, 0, 4004, 0), cudaErrorInvalidValue);
  assert_int_equal(cudaFree(a + 1), cudaErrorInvalidValue);  // not what cudaMalloc returned
  CUDA_OK(cudaFree(a));
  assert_int_equal(cudaFree(a), cudaErrorInvalidValue);  // twice
  CUDA_OK(cudaFree(b));
  (void)cudaGetLastError();
  assert_int_equal(cudaemu_bytes_in_use(), before);
  assert_true(cudaemu_bytes_peak() >= before + 8000);
}

static void test_device_api(void **) {
  int n = 0, dev = -1;
  CUDA_OK(cudaGetDeviceCount(&n));
  assert_int_equal(n, atoi(env_or("CUDAEMU_DEVICES", "1")));
  assert_int_equal(cudaSetDevice(n), cudaErrorInvalidDevice);
  (void)cudaGetLastError();
  CUDA_OK(cudaSetDevice(n - 1));
  CUDA_OK(cudaGetDevice(&dev));
  assert_int_equal(dev, n - 1);
  cudaDeviceProp p;
  CUDA_OK(cudaGetDeviceProperties(&p, 0));
  assert_non_null(strstr(p.name, "emulated"));
  assert_int_equal(p.major, 9);
  assert_int_equal(p.maxThreadsPerBlock, 1024);
  assert_int_equal(p.maxGridSize[1], 65535);
  assert_int_equal(p.sharedMemPerBlockOptin, 227 << 10);
  cudaEvent_t e0, e1, nt;
  CUDA_OK(cudaEventCreate(&e0));
  CUDA_OK(cudaEventCreate(&e1));
  CUDA_OK(cudaEventCreateWithFlags(&nt, cudaEventDisableTiming));
  CUDA_OK(cudaEventRecord(e0));
  touch<<<64, 256>>>(nullptr);
  CUDA_OK(cudaEventRecord(e1));
  CUDA_OK(cudaEventRecord(nt));
  CUDA_OK(cudaEventSynchronize(e1));
  CUDA_OK(cudaEventSynchronize(nt));
  float ms = -1;
  CUDA_OK(cudaEventElapsedTime(&ms, e0, e1));
  assert_true(ms >= 0.0f);
  assert_int_equal(cudaEventElapsedTime(&ms, e0, nt), cudaErrorInvalidResourceHandle);
  (void)cudaGetLastError();
  assert_string_equal(cudaGetErrorString(cudaErrorInvalidConfiguration),
                      "invalid configuration argument");
  CUDA_OK(cudaEventDestroy(e0));
  CUDA_OK(cudaEventDestroy(e1));
  CUDA_OK(cudaEventDestroy(nt));
  CUDA_OK(cudaSetDevice(0));
}

static const struct CMUnitTest tests[] = {
    cmocka_unit_test(test_barrier),       cmocka_unit_test(test_shuffles),
    cmocka_unit_test(test_votes),         cmocka_unit_test(test_atomics),
    cmocka_unit_test(test_shared),        cmocka_unit_test(test_nan_fill),
    cmocka_unit_test(test_orders),        cmocka_unit_test(test_indices_intrinsics),
    cmocka_unit_test(test_launch_limits), cmocka_unit_test(test_memory_api),
    cmocka_unit_test(test_device_api),
};

EMU_MAIN(tests)
