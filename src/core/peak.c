/* The FMA peak probe (peak.h). Each variant keeps 12 independent accumulators in vector registers
 * (enough to cover an FMA latency of 4 cycles on 2 ports and more) and updates each with a = a·x +
 * y per iteration, x just below 1 and y small so that the values stay near 1: no denormals, no
 * overflow. The compiler may not reorder or fuse iterations (each depends on the last), so the
 * loop runs 12 vector FMAs per iteration and nothing else worth counting. */
#include "core/peak.h"

#include <immintrin.h>

#include "core/timer.h"

#ifdef _OPENMP
#include <omp.h>
#endif

#define CHAINS 12

__attribute__((target("avx512f"))) static float run_avx512(long iters) {
  __m512 a[CHAINS];
  const __m512 x = _mm512_set1_ps(0.9999999f), y = _mm512_set1_ps(1e-7f);
  for (int c = 0; c < CHAINS; c++) a[c] = _mm512_set1_ps(1.0f + 0.01f * (float)c);
  for (long i = 0; i < iters; i++)
#pragma GCC unroll 12
    for (int c = 0; c < CHAINS; c++) a[c] = _mm512_fmadd_ps(a[c], x, y);
  __m512 s = a[0];
  for (int c = 1; c < CHAINS; c++) s = _mm512_add_ps(s, a[c]);
  return _mm512_reduce_add_ps(s);
}

__attribute__((target("avx2,fma"))) static float run_avx2(long iters) {
  __m256 a[CHAINS];
  const __m256 x = _mm256_set1_ps(0.9999999f), y = _mm256_set1_ps(1e-7f);
  for (int c = 0; c < CHAINS; c++) a[c] = _mm256_set1_ps(1.0f + 0.01f * (float)c);
  for (long i = 0; i < iters; i++)
#pragma GCC unroll 12
    for (int c = 0; c < CHAINS; c++) a[c] = _mm256_fmadd_ps(a[c], x, y);
  __m256 s = a[0];
  for (int c = 1; c < CHAINS; c++) s = _mm256_add_ps(s, a[c]);
  float v[8];
  _mm256_storeu_ps(v, s);
  return v[0] + v[1] + v[2] + v[3] + v[4] + v[5] + v[6] + v[7];
}

/* Without FMA: a multiply and an add per element, 2 FLOPs as an FMA counts them. */
static float run_sse(long iters) {
  __m128 a[CHAINS];
  const __m128 x = _mm_set1_ps(0.9999999f), y = _mm_set1_ps(1e-7f);
  for (int c = 0; c < CHAINS; c++) a[c] = _mm_set1_ps(1.0f + 0.01f * (float)c);
  for (long i = 0; i < iters; i++)
#pragma GCC unroll 12
    for (int c = 0; c < CHAINS; c++) a[c] = _mm_add_ps(_mm_mul_ps(a[c], x), y);
  __m128 s = a[0];
  for (int c = 1; c < CHAINS; c++) s = _mm_add_ps(s, a[c]);
  float v[4];
  _mm_storeu_ps(v, s);
  return v[0] + v[1] + v[2] + v[3];
}

static volatile float sink_; /* keeps the probe's results alive */

double fma_peak_gflops_per_thread(const char **isa) {
  __builtin_cpu_init();
  int lanes = 4;
  float (*run)(long) = run_sse;
  *isa = "sse";
  if (__builtin_cpu_supports("avx512f")) {
    run = run_avx512, lanes = 16, *isa = "avx512";
  } else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    run = run_avx2, lanes = 8, *isa = "avx2+fma";
  }
  const long iters = 2000000; /* 12 · 2·10⁶ vector FMAs: about 20 ms per thread */
  double sum = 0.0;
  float keep = 0.0f;
  int threads = 1;
#pragma omp parallel reduction(+ : sum, keep)
  {
#ifdef _OPENMP
#pragma omp single
    threads = omp_get_num_threads();
#endif
    double best = 0.0;
    keep += run(iters / 10); /* warm-up: clocks up, code in cache */
    for (int r = 0; r < 3; r++) {
      double t0 = timer_now();
      keep += run(iters);
      double t = timer_now() - t0;
      double rate = 2.0 * lanes * CHAINS * (double)iters / t / 1e9;
      if (rate > best) best = rate;
    }
    sum += best;
  }
  sink_ = keep;
  return sum / threads;
}
