// Streams, events and deferred mode: what the host sees after asynchronous work with and without
// synchronisation as CUDA defines it (pinned memory touched when the copy runs, pageable staged
// or waited for), events between streams, the legacy default stream, queries, cuBLAS on a stream.
// test_streams.sh runs it immediate and deferred; the expectations differ exactly where a missing
// synchronisation leaves the result undefined on a GPU.
#include <string>

#include <cublas_v2.h>

#include "emu_test.h"

static bool deferred() { return std::string(env_or("CUDAEMU_DEFER", "0")) != "0"; }
static bool last_first() {
  const std::string d = env_or("CUDAEMU_DEFER", "0");
  return d == "1" || d == "last";
}

// grid covering n: p[i] = v
__global__ void fill(float *p, int n, float v) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) p[i] = v;
}

// dst[i] = src[i] + 1
__global__ void add_one(float *dst, const float *src, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) dst[i] = src[i] + 1.0f;
}

constexpr int kN = 1000;
constexpr int kBlocks = (kN + 255) / 256;

static float *pinned(float v) {
  float *h = nullptr;
  CUDA_OK(cudaMallocHost(&h, sizeof(float) * kN));
  for (int i = 0; i < kN; i++) h[i] = v;
  return h;
}

static cudaStream_t stream(unsigned flags) {
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, flags));
  return s;
}

// A host read after an asynchronous copy into pinned memory, without a sync: old data in deferred
// mode (and possibly on a GPU); the sync makes it right.
static void test_missing_sync(void **) {
  float *d = dev_alloc<float>(kN), *h = pinned(7.0f);
  cudaStream_t s = stream(cudaStreamNonBlocking);
  fill<<<kBlocks, 256, 0, s>>>(d, kN, 3.0f);
  CUDA_OK(cudaMemcpyAsync(h, d, sizeof(float) * kN, cudaMemcpyDeviceToHost, s));
  assert_true(h[0] == (deferred() ? 7.0f : 3.0f));
  CUDA_OK(cudaStreamSynchronize(s));
  assert_true(h[0] == 3.0f && h[kN - 1] == 3.0f);
  // a kernel writing pinned host memory: visible after cudaFree, which waits for the device
  fill<<<kBlocks, 256, 0, s>>>(h, kN, 8.0f);
  assert_true(h[5] == (deferred() ? 3.0f : 8.0f));
  CUDA_OK(cudaFree(d));
  assert_true(h[5] == 8.0f);
  CUDA_OK(cudaFreeHost(h));
  CUDA_OK(cudaStreamDestroy(s));
}

// Pageable host memory: an upload is staged at the call (the caller may reuse the buffer), a
// download returns only when done.
static void test_pageable(void **) {
  float *d = dev_alloc<float>(kN);
  cudaStream_t s = stream(cudaStreamNonBlocking);
  std::vector<float> v(kN, 5.0f), w(kN, 0.0f);
  CUDA_OK(cudaMemcpyAsync(d, v.data(), sizeof(float) * kN, cudaMemcpyHostToDevice, s));
  for (float &x : v) x = 9.0f;
  CUDA_OK(cudaMemcpyAsync(w.data(), d, sizeof(float) * kN, cudaMemcpyDeviceToHost, s));
  assert_true(w[0] == 5.0f && w[kN - 1] == 5.0f);
  CUDA_OK(cudaFree(d));
  CUDA_OK(cudaStreamDestroy(s));
}

// Work on stream 2 that reads what stream 1 writes: without an event the order is undefined
// (deferred, last-queued first: stream 2 runs first and reads NaN); with one it is right.
static void test_cross_stream(void **) {
  float *x = dev_alloc<float>(kN), *y = dev_alloc<float>(kN);
  cudaStream_t s1 = stream(cudaStreamNonBlocking), s2 = stream(cudaStreamNonBlocking);
  fill<<<kBlocks, 256, 0, s1>>>(x, kN, 1.0f);
  add_one<<<kBlocks, 256, 0, s2>>>(y, x, kN);
  CUDA_OK(cudaDeviceSynchronize());
  const float missing = download(y, 1)[0];
  if (!deferred()) assert_true(missing == 2.0f);
  if (last_first()) assert_true(std::isnan(missing));
  cudaEvent_t e;
  CUDA_OK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  fill<<<kBlocks, 256, 0, s1>>>(x, kN, 4.0f);
  CUDA_OK(cudaEventRecord(e, s1));
  CUDA_OK(cudaStreamWaitEvent(s2, e, 0));
  add_one<<<kBlocks, 256, 0, s2>>>(y, x, kN);
  CUDA_OK(cudaStreamSynchronize(s2));  // runs s1 up to the event first
  const std::vector<float> r = download(y, kN);
  assert_true(r[0] == 5.0f && r[kN - 1] == 5.0f);
  CUDA_OK(cudaEventDestroy(e));
  CUDA_OK(cudaStreamDestroy(s1));
  CUDA_OK(cudaStreamDestroy(s2));
  CUDA_OK(cudaFree(x));
  CUDA_OK(cudaFree(y));
}

// cudaMemcpy runs on the legacy default stream: it waits for blocking streams' work, not for
// non-blocking streams'.
static void test_legacy_stream(void **) {
  float *x = dev_alloc<float>(kN), *z = dev_alloc<float>(kN), h = 0;
  cudaStream_t sb = stream(cudaStreamDefault), sn = stream(cudaStreamNonBlocking);
  fill<<<kBlocks, 256, 0, sb>>>(x, kN, 4.0f);
  CUDA_OK(cudaMemcpy(&h, x, sizeof h, cudaMemcpyDeviceToHost));
  assert_true(h == 4.0f);
  fill<<<kBlocks, 256, 0, sn>>>(z, kN, 6.0f);
  CUDA_OK(cudaMemcpy(&h, z, sizeof h, cudaMemcpyDeviceToHost));
  if (deferred())
    assert_true(std::isnan(h));
  else
    assert_true(h == 6.0f);
  CUDA_OK(cudaStreamDestroy(sb));
  CUDA_OK(cudaStreamDestroy(sn));
  CUDA_OK(cudaFree(x));
  CUDA_OK(cudaFree(z));
}

// A stream sync runs that stream only; queries say "not ready" while work is queued.
static void test_queries(void **) {
  float *x = dev_alloc<float>(kN), *w = dev_alloc<float>(kN);
  cudaStream_t s1 = stream(cudaStreamNonBlocking), s2 = stream(cudaStreamNonBlocking);
  cudaEvent_t e;
  CUDA_OK(cudaEventCreate(&e));
  fill<<<kBlocks, 256, 0, s1>>>(x, kN, 1.0f);
  fill<<<kBlocks, 256, 0, s2>>>(w, kN, 2.0f);
  CUDA_OK(cudaEventRecord(e, s2));
  CUDA_OK(cudaStreamSynchronize(s1));
  assert_int_equal(cudaStreamQuery(s2), deferred() ? cudaErrorNotReady : cudaSuccess);
  assert_int_equal(cudaStreamQuery(s2), cudaSuccess);
  assert_int_equal(cudaEventQuery(e), cudaSuccess);
  fill<<<kBlocks, 256, 0, s2>>>(w, kN, 3.0f);
  CUDA_OK(cudaEventRecord(e, s2));
  assert_int_equal(cudaEventQuery(e), deferred() ? cudaErrorNotReady : cudaSuccess);
  assert_int_equal(cudaEventQuery(e), cudaSuccess);
  assert_true(download(w, 1)[0] == 3.0f);
  assert_int_equal(cudaGetLastError(), cudaSuccess);  // "not ready" is no error
  CUDA_OK(cudaEventDestroy(e));
  CUDA_OK(cudaStreamDestroy(s1));
  CUDA_OK(cudaStreamDestroy(s2));
  CUDA_OK(cudaFree(x));
  CUDA_OK(cudaFree(w));
}

// cuBLAS work is queued on the handle's stream like a kernel.
static void test_cublas_on_stream(void **) {
  cublasHandle_t h;
  assert_int_equal(cublasCreate(&h), CUBLAS_STATUS_SUCCESS);
  cudaStream_t s = stream(cudaStreamNonBlocking);
  assert_int_equal(cublasSetStream(h, s), CUBLAS_STATUS_SUCCESS);
  float *a = upload(std::vector<float>(16, 1.0f)), *c = dev_alloc<float>(16), *hc = pinned(-1.0f);
  const float one = 1.0f, zero = 0.0f;
  assert_int_equal(cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, 4, 4, 4, &one, a, 4, a, 4, &zero, c, 4),
                   CUBLAS_STATUS_SUCCESS);
  CUDA_OK(cudaMemcpyAsync(hc, c, sizeof(float) * 16, cudaMemcpyDeviceToHost, s));
  assert_true(hc[0] == (deferred() ? -1.0f : 4.0f));
  CUDA_OK(cudaStreamSynchronize(s));
  assert_true(hc[0] == 4.0f && hc[15] == 4.0f);
  assert_int_equal(cublasDestroy(h), CUBLAS_STATUS_SUCCESS);
  CUDA_OK(cudaStreamDestroy(s));
  CUDA_OK(cudaFreeHost(hc));
  CUDA_OK(cudaFree(a));
  CUDA_OK(cudaFree(c));
}

static const struct CMUnitTest tests[] = {
    cmocka_unit_test(test_missing_sync), cmocka_unit_test(test_pageable),
    cmocka_unit_test(test_cross_stream), cmocka_unit_test(test_legacy_stream),
    cmocka_unit_test(test_queries),      cmocka_unit_test(test_cublas_on_stream),
};

EMU_MAIN(tests)
