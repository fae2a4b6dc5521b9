// Matrix products of the CUDA back end (gpu.h gpu_gemm): row-major operands as cblas_sgemm takes
// them, handed to cuBLAS as the column-major transposed product; strided-batched. Operands fp32
// with no TF32, fp32 with bf16 tensor-core math (CUBLAS_COMPUTE_32F_FAST_16BF: cuBLAS rounds them
// as it loads them), or stored in bf16 (gpu_gemm_as, where a caller keeps bf16 copies); fp32
// accumulation and fp32 results in every case.
// Tensor-core math lives here, behind cuBLAS: the kernels of gpu/ stay plain SIMT.
#include <algorithm>
#include <cstdint>
#include <vector>

#include <cuda_bf16.h>

#include "check.h"
#include "gpu.h"
#include "rng.cuh"

namespace {

// A row-major product as cuBLAS's column-major call takes it: row-major C (M × N) = op(A) op(B)
// is column-major Cᵀ (N × M) = op(B)ᵀ op(A)ᵀ, so cuBLAS's first operand is our B. The dimensions
// checked before they become cuBLAS's int; the operands' type and the compute type.
struct colmajor {
  cublasOperation_t op1, op2;  // of B, then A
  int m, n, k, ld1, ld2, ldc, count;
  cudaDataType in;
  cublasComputeType_t compute;
};

colmajor colmajor_of(gpu_elem type, bool ta, bool tb, long M, long N, long K, long lda, long ldb,
                     long ldc, long batch) {
  colmajor c;
  c.op1 = tb ? CUBLAS_OP_T : CUBLAS_OP_N;
  c.op2 = ta ? CUBLAS_OP_T : CUBLAS_OP_N;
  c.m = gpu_int(N, "gemm N"), c.n = gpu_int(M, "gemm M"), c.k = gpu_int(K, "gemm K");
  c.ld1 = gpu_int(ldb, "gemm ldb"), c.ld2 = gpu_int(lda, "gemm lda"), c.ldc = gpu_int(ldc, "ldc");
  c.count = gpu_int(batch, "gemm batch");
  c.in = type == GPU_BF16 ? CUDA_R_16BF : CUDA_R_32F;
  // bf16 operands: fp32 compute; fp32 operands of a bf16 run: bf16 math as cuBLAS loads them
  c.compute = type == GPU_F32 && gpu_bf16() ? CUBLAS_COMPUTE_32F_FAST_16BF : CUBLAS_COMPUTE_32F;
  return c;
}

}  // namespace

extern "C" size_t gpu_elem_bytes(gpu_elem type) { return type == GPU_BF16 ? 2 : 4; }

extern "C" void gpu_gemm(bool ta, bool tb, long M, long N, long K, float alpha, const float *A,
                         long lda, long sA, const float *B, long ldb, long sB, float beta, float *C,
                         long ldc, long sC, long batch) {
  gpu_gemm_as(GPU_F32, ta, tb, M, N, K, alpha, A, lda, sA, B, ldb, sB, beta, C, ldc, sC, batch);
}

extern "C" void gpu_gemm_as(gpu_elem type, bool ta, bool tb, long M, long N, long K, float alpha,
                            const void *A, long lda, long sA, const void *B, long ldb, long sB,
                            float beta, float *C, long ldc, long sC, long batch) {
  if (M == 0 || N == 0 || batch == 0) return;
  const colmajor c = colmajor_of(type, ta, tb, M, N, K, lda, ldb, ldc, batch);
  gpu_count_gemm(M, N, K, batch, sA ? batch : 1, sB ? batch : 1, beta != 0.0f,
                 gpu_elem_bytes(type));
  if (c.in == CUDA_R_32F && c.compute == CUBLAS_COMPUTE_32F) {
    const auto *a = static_cast<const float *>(A), *b = static_cast<const float *>(B);
    if (batch == 1)
      CUBLAS_CHECK(cublasSgemm(gpu_cublas(), c.op1, c.op2, c.m, c.n, c.k, &alpha, b, c.ld1, a,
                               c.ld2, &beta, C, c.ldc));
    else
      CUBLAS_CHECK(cublasSgemmStridedBatched(gpu_cublas(), c.op1, c.op2, c.m, c.n, c.k, &alpha, b,
                                             c.ld1, sB, a, c.ld2, sA, &beta, C, c.ldc, sC,
                                             c.count));
    return;
  }
  CUBLAS_CHECK(cublasGemmStridedBatchedEx(gpu_cublas(), c.op1, c.op2, c.m, c.n, c.k, &alpha, B,
                                          c.in, c.ld1, sB, A, c.in, c.ld2, sA, &beta, C, CUDA_R_32F,
                                          c.ldc, sC, c.count, c.compute, CUBLAS_GEMM_DEFAULT));
}

namespace {

// The pointer table of gpu_gemm2_as: for product e = i·b2 + j, (B, A, C) + i·s1 + j·s2 elements
// as cuBLAS's column-major call takes them (B first); A and B of es bytes an element, C fp32.
// 32-bit indices (gpu_int checks b1·b2).
__global__ void gemm_pointers(void **table, const char *A, long sA1, long sA2, const char *B,
                              long sB1, long sB2, long es, float *C, long sC1, long sC2, int b1,
                              int b2) {
  const int n = b1 * b2;
  for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < n; e += gridDim.x * blockDim.x) {
    const long i = e / b2, j = e % b2;
    table[e] = const_cast<char *>(B + (i * sB1 + j * sB2) * es);  // cuBLAS only reads A and B
    table[n + e] = const_cast<char *>(A + (i * sA1 + j * sA2) * es);
    table[2 * n + e] = C + i * sC1 + j * sC2;
  }
}

}  // namespace

extern "C" void gpu_gemm2(bool ta, bool tb, long M, long N, long K, float alpha, const float *A,
                          long lda, long sA1, long sA2, const float *B, long ldb, long sB1,
                          long sB2, float beta, float *C, long ldc, long sC1, long sC2, long b1,
                          long b2) {
  gpu_gemm2_as(GPU_F32, ta, tb, M, N, K, alpha, A, lda, sA1, sA2, B, ldb, sB1, sB2, beta, C, ldc,
               sC1, sC2, b1, b2);
}

extern "C" void gpu_gemm2_as(gpu_elem type, bool ta, bool tb, long M, long N, long K, float alpha,
                             const void *A, long lda, long sA1, long sA2, const void *B, long ldb,
                             long sB1, long sB2, float beta, float *C, long ldc, long sC1, long sC2,
                             long b1, long b2) {
  if (b2 == 1 || b1 == 1) {
    const bool inner = b1 == 1;
    gpu_gemm_as(type, ta, tb, M, N, K, alpha, A, lda, inner ? sA2 : sA1, B, ldb, inner ? sB2 : sB1,
                beta, C, ldc, inner ? sC2 : sC1, inner ? b2 : b1);
    return;
  }
  if (M == 0 || N == 0 || b1 == 0 || b2 == 0) return;
  const int count = gpu_int(b1 * b2, "gemm batch");
  auto **table = static_cast<void **>(gpu_alloc(MEM_WORKSPACE, 3 * sizeof(void *) * count));
  const size_t blocks = gpu_blocks((size_t)count, 256);
  gemm_pointers<<<(unsigned)(blocks < 1024 ? blocks : 1024), 256, 0, gpu_stream()>>>(
      table, static_cast<const char *>(A), sA1, sA2, static_cast<const char *>(B), sB1, sB2,
      (long)gpu_elem_bytes(type), C, sC1, sC2, (int)b1, (int)b2);
  LAUNCH_CHECK(gemm_pointers);
  gpu_gemm_table(type, ta, tb, M, N, K, alpha, lda, ldb, beta, ldc, count, table,
                 (sA1 ? b1 : 1) * (sA2 ? b2 : 1), (sB1 ? b1 : 1) * (sB2 ? b2 : 1));
  gpu_free(table);  // the pool reuses it in stream order, after the product
}

extern "C" void gpu_gemm_table(gpu_elem type, bool ta, bool tb, long M, long N, long K, float alpha,
                               long lda, long ldb, float beta, long ldc, long count,
                               void *const *table, long nA, long nB) {
  if (M == 0 || N == 0 || count == 0) return;
  const colmajor c = colmajor_of(type, ta, tb, M, N, K, lda, ldb, ldc, count);
  gpu_count_gemm(M, N, K, count, nA, nB, beta != 0.0f, gpu_elem_bytes(type));
  const void *const *in = table;
  CUBLAS_CHECK(cublasGemmBatchedEx(gpu_cublas(), c.op1, c.op2, c.m, c.n, c.k, &alpha, in, c.in,
                                   c.ld1, in + c.count, c.in, c.ld2, &beta, table + 2 * c.count,
                                   CUDA_R_32F, c.ldc, c.count, c.compute, CUBLAS_GEMM_DEFAULT));
}

namespace {

// grid-stride: dst = src rounded to bf16 (nearest even)
__global__ void to_bf16(__nv_bfloat16 *dst, const float *src, size_t n) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    dst[i] = __float2bfloat16(src[i]);
}

// to_bf16 four elements at a time, a 16-byte load and an 8-byte store each (src 16-byte and dst
// 8-byte aligned): the same roundings, with the bytes in flight that a copy at the memory's rate
// needs, where one float at a time reached half of it (H200, 128K)
__global__ void to_bf16_x4(uint2 *dst, const float4 *src, size_t groups) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < groups;
       i += (size_t)gridDim.x * blockDim.x) {
    const float4 v = src[i];
    const __nv_bfloat162 lo = __floats2bfloat162_rn(v.x, v.y), hi = __floats2bfloat162_rn(v.z, v.w);
    uint2 o;
    memcpy(&o.x, &lo, sizeof o.x);
    memcpy(&o.y, &hi, sizeof o.y);
    dst[i] = o;
  }
}

unsigned stride_grid(size_t n) {
  const size_t blocks = gpu_blocks(n, 256);
  return (unsigned)(blocks < 4096 ? blocks : 4096);
}

}  // namespace

extern "C" void gpu_to_bf16(void *dst, const float *src, size_t n) {
  if (n == 0) return;
  size_t done = 0;  // the elements the four-wide kernel converted
  if ((uintptr_t)src % 16 == 0 && (uintptr_t)dst % 8 == 0 && n >= 4) {
    const size_t groups = n / 4;
    to_bf16_x4<<<stride_grid(groups), 256, 0, gpu_stream()>>>(
        static_cast<uint2 *>(dst), reinterpret_cast<const float4 *>(src), groups);
    LAUNCH_CHECK(to_bf16_x4);
    done = 4 * groups;
  }
  if (done < n) {
    to_bf16<<<stride_grid(n - done), 256, 0, gpu_stream()>>>(
        static_cast<__nv_bfloat16 *>(dst) + done, src + done, n - done);
    LAUNCH_CHECK(to_bf16);
  }
  gpu_count_convert(n);
}

namespace {

constexpr int kDotRows = 128;  // rows (threads) per block of rows_dot
constexpr int kDotCols = 32;   // columns staged per pass

// grid (rows / kDotRows, rounded up), block (kDotRows): D[r] = Σ_f a[r, f]·b[r, f], one thread
// per row adding its products in f order; the rows staged through shared memory 32 columns at a
// time, each warp reading a row's columns together (whole lines), where a thread reading its own
// row met lines 4·d bytes apart; a16, when given, receives a rounded to bf16 as it is read.
// CPU twin: rows_dot (attention/fma.c).
__global__ void rows_dot(float *D, const float *a, const float *b, int rows, int d,
                         __nv_bfloat16 *a16) {
  __shared__ float ta[kDotRows][kDotCols + 1], tb[kDotRows][kDotCols + 1];
  const int r0 = (int)blockIdx.x * kDotRows, r = r0 + (int)threadIdx.x;
  const int lane = (int)threadIdx.x % 32, warp = (int)threadIdx.x / 32;
  float acc = 0.0f;
  for (int f0 = 0; f0 < d; f0 += kDotCols) {
    const int nf = d - f0 < kDotCols ? d - f0 : kDotCols;
    for (int y = warp; y < kDotRows; y += kDotRows / 32)
      if (r0 + y < rows && lane < nf) {
        const size_t at = (size_t)(r0 + y) * d + f0 + lane;
        ta[y][lane] = a[at];
        tb[y][lane] = b[at];
        if (a16) a16[at] = __float2bfloat16(ta[y][lane]);
      }
    __syncthreads();
    if (r < rows)
      for (int f = 0; f < nf; f++) acc += ta[threadIdx.x][f] * tb[threadIdx.x][f];
    __syncthreads();  // the tiles are written again for the next columns
  }
  if (r < rows) D[r] = acc;
}

}  // namespace

extern "C" void gpu_rows_dot(float *D, const float *a, const float *b, long rows, long d) {
  gpu_rows_dot_copy(D, a, b, rows, d, nullptr);
}

extern "C" void gpu_rows_dot_copy(float *D, const float *a, const float *b, long rows, long d,
                                  void *a16) {
  if (rows == 0) return;
  const int n = gpu_int(rows, "rows of rows_dot");
  rows_dot<<<gpu_int((rows + kDotRows - 1) / kDotRows, "rows_dot blocks"), kDotRows, 0,
             gpu_stream()>>>(D, a, b, n, (int)d, static_cast<__nv_bfloat16 *>(a16));
  LAUNCH_CHECK(rows_dot);
  if (a16) gpu_count_convert_in_pass((size_t)(rows * d));
}

namespace {

// x[i] uniform in [−1, 1) from the counter-based bits (a product of zeros draws less power and
// runs faster than one of data: the rate must be measured on numbers)
__global__ void fill_uniform(float *x, size_t n, uint64_t seed) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    x[i] = (float)(gpu_rng_bits(seed, 0, i, 0, 0) >> 40) * (2.0f / 16777216.0f) - 1.0f;
}

float *random_matrix(size_t n, uint64_t seed) {
  auto *x = static_cast<float *>(gpu_alloc(MEM_WORKSPACE, sizeof(float) * n));
  const size_t blocks = gpu_blocks(n, 256);
  fill_uniform<<<(unsigned)(blocks < 4096 ? blocks : 4096), 256, 0, gpu_stream()>>>(x, n, seed);
  LAUNCH_CHECK(fill_uniform);
  return x;
}

constexpr double kProbeSeconds = 1.0;  // of timed products per rate, at least 5 of them

// x[r·len + j] = rng_normal(seed, stream, a, r·key_stride + key0 + j, 0) of core/rng.c, its
// Box–Muller in double rounded to float: rows along y, each row grid-stride along x (no division)
__global__ void fill_normal(float *x, long rows, long len, long key_stride, long key0,
                            uint64_t seed, uint64_t stream, uint64_t a) {
  for (long r = blockIdx.y; r < rows; r += gridDim.y)
    for (long j = (long)blockIdx.x * blockDim.x + threadIdx.x; j < len;
         j += (long)gridDim.x * blockDim.x) {
      const uint64_t bits = gpu_rng_bits(seed, stream, a, (uint64_t)(r * key_stride + key0 + j), 0);
      const double u1 = ((double)(bits >> 11) + 1.0) * (1.0 / 9007199254740993.0); /* (0, 1] */
      const double u2 = (double)(gpu_mix64(bits) >> 11) * (1.0 / 9007199254740992.0);
      x[r * len + j] = (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
    }
}

}  // namespace

extern "C" void gpu_fill_normal(float *x, long rows, long len, long key_stride, long key0,
                                uint64_t seed, uint64_t stream, uint64_t a) {
  if (rows <= 0 || len <= 0) return;
  const size_t bx = gpu_blocks((size_t)len, 256);
  const dim3 grid((unsigned)(bx < 1024 ? bx : 1024), (unsigned)(rows < 65535 ? rows : 65535));
  fill_normal<<<grid, 256, 0, gpu_stream()>>>(x, rows, len, key_stride, key0, seed, stream, a);
  LAUNCH_CHECK(fill_normal);
}

extern "C" double gpu_gemm_gflops(bool bf16) {
  const float one = 1.0f, zero = 0.0f;
  // fp32: fp32 operands and math, as gpu_gemm runs them. bf16: bf16 operands (gpu_gemm_as's), the
  // device's tensor-core rate. gpu_gemm's fp32 operands with bf16 math (COMPUTE_32F_FAST_16BF)
  // ran at 0.45x that rate on an H200 (docs/gpu.md): not the machine's ceiling.
  const cudaDataType_t in = bf16 ? CUDA_R_16BF : CUDA_R_32F;
  cudaEvent_t e0, e1;
  CUDA_CHECK(cudaEventCreate(&e0));
  CUDA_CHECK(cudaEventCreate(&e1));
  double rate = 0.0;
  // the size: from 1024 up until one product takes 20 ms (at most 16384); at that size, products
  // on random operands until kProbeSeconds are timed (at least 5): the median's rate
  for (int n = 1024; rate == 0.0; n *= 2) {
    const size_t nn = (size_t)n * n;
    float *a = random_matrix(nn, 1), *b = random_matrix(nn, 2);
    void *a16 = nullptr, *b16 = nullptr;
    if (bf16) {
      a16 = gpu_alloc(MEM_WORKSPACE, 2 * nn);
      b16 = gpu_alloc(MEM_WORKSPACE, 2 * nn);
      gpu_to_bf16(a16, a, nn);
      gpu_to_bf16(b16, b, nn);
    }
    const void *A = bf16 ? a16 : a, *B = bf16 ? b16 : b;
    auto *c = static_cast<float *>(gpu_alloc(MEM_WORKSPACE, sizeof(float) * nn));
    auto product_ms = [&] {
      CUDA_CHECK(cudaEventRecord(e0, gpu_stream()));
      CUBLAS_CHECK(cublasGemmEx(gpu_cublas(), CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &one, A, in, n, B,
                                in, n, &zero, c, CUDA_R_32F, n, CUBLAS_COMPUTE_32F,
                                CUBLAS_GEMM_DEFAULT));
      CUDA_CHECK(cudaEventRecord(e1, gpu_stream()));
      CUDA_CHECK(cudaEventSynchronize(e1));
      float ms = 0.0f;
      CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
      return ms;
    };
    product_ms();  // warm-up
    if (product_ms() >= 20.0f || n >= 16384) {
      std::vector<float> t;
      for (double total = 0.0; t.size() < 5 || total < 1e3 * kProbeSeconds;) {
        t.push_back(product_ms());
        total += t.back();
      }
      std::sort(t.begin(), t.end());
      rate = 2.0 * n * (double)n * n / (t[t.size() / 2] / 1e3) / 1e9;
    }
    gpu_free(a);
    gpu_free(b);
    gpu_free(a16);
    gpu_free(b16);
    gpu_free(c);
  }
  CUDA_CHECK(cudaEventDestroy(e0));
  CUDA_CHECK(cudaEventDestroy(e1));
  return rate;
}
