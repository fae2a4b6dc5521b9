// Matrix products of the CUDA back end (gpu.h gpu_gemm): row-major operands as cblas_sgemm takes
// them, handed to cuBLAS as the column-major transposed product; strided-batched. fp32 with no
// TF32, or bf16 operands (rounded-to-nearest-even copies in the pool) with fp32 accumulation.
// Tensor-core math lives here, behind cuBLAS: the kernels of gpu/ stay plain SIMT.
#include <cuda_bf16.h>

#include <algorithm>

#include "check.h"
#include "gpu.h"

namespace {

constexpr unsigned kThreads = 256;

__global__ void to_bf16(__nv_bfloat16 *out, const float *in, size_t n) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    out[i] = __float2bfloat16(in[i]);
}

// Floats a strided batch of row-major (rows × cols, ld) operands spans.
size_t span(long rows, long cols, long ld, long stride, long batch) {
  return (size_t)(stride * (batch - 1) + (rows - 1) * ld + cols);
}

// A bf16 copy of a span of floats, from the pool (the caller frees it).
__nv_bfloat16 *bf16_copy(const float *x, size_t n) {
  auto *y = static_cast<__nv_bfloat16 *>(gpu_alloc(MEM_WORKSPACE, sizeof(__nv_bfloat16) * n));
  const size_t blocks = gpu_blocks(n, kThreads);
  to_bf16<<<(unsigned)(blocks < 4096 ? blocks : 4096), kThreads, 0, gpu_stream()>>>(y, x, n);
  LAUNCH_CHECK();
  return y;
}

}  // namespace

extern "C" void gpu_gemm(bool ta, bool tb, long M, long N, long K, float alpha, const float *A,
                         long lda, long sA, const float *B, long ldb, long sB, float beta, float *C,
                         long ldc, long sC, long batch) {
  if (M == 0 || N == 0 || batch == 0) return;
  // row-major C (M × N) = op(A) op(B) is column-major Cᵀ (N × M) = op(B)ᵀ op(A)ᵀ
  const cublasOperation_t opB = tb ? CUBLAS_OP_T : CUBLAS_OP_N,
                          opA = ta ? CUBLAS_OP_T : CUBLAS_OP_N;
  const int m = gpu_int(N, "gemm N"), n = gpu_int(M, "gemm M"), k = gpu_int(K, "gemm K");
  const int la = gpu_int(ldb, "gemm ldb"), lb = gpu_int(lda, "gemm lda"), lc = gpu_int(ldc, "ldc");
  const int count = gpu_int(batch, "gemm batch");
  if (!gpu_bf16()) {
    if (batch == 1)
      CUBLAS_CHECK(
          cublasSgemm(gpu_cublas(), opB, opA, m, n, k, &alpha, B, la, A, lb, &beta, C, lc));
    else
      CUBLAS_CHECK(cublasSgemmStridedBatched(gpu_cublas(), opB, opA, m, n, k, &alpha, B, la, sB, A,
                                             lb, sA, &beta, C, lc, sC, count));
    return;
  }
  const long arows = ta ? K : M, acols = ta ? M : K, brows = tb ? N : K, bcols = tb ? K : N;
  __nv_bfloat16 *a16 = bf16_copy(A, span(arows, acols, lda, sA, batch));
  __nv_bfloat16 *b16 = bf16_copy(B, span(brows, bcols, ldb, sB, batch));
  CUBLAS_CHECK(cublasGemmStridedBatchedEx(gpu_cublas(), opB, opA, m, n, k, &alpha, b16, CUDA_R_16BF,
                                          la, sB, a16, CUDA_R_16BF, lb, sA, &beta, C, CUDA_R_32F,
                                          lc, sC, count, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  gpu_free(a16);
  gpu_free(b16);
}

extern "C" double gpu_gemm_gflops(bool bf16) {
  float *c = nullptr;
  void *a = nullptr, *b = nullptr;
  const float one = 1.0f, zero = 0.0f;
  const cudaDataType type = bf16 ? CUDA_R_16BF : CUDA_R_32F;
  const size_t elem = bf16 ? sizeof(__nv_bfloat16) : sizeof(float);
  double rate = 0.0;
  for (int n = 1024;; n *= 2) {
    a = gpu_alloc_zero(MEM_WORKSPACE, elem * n * n);
    b = gpu_alloc_zero(MEM_WORKSPACE, elem * n * n);
    c = static_cast<float *>(gpu_alloc(MEM_WORKSPACE, sizeof(float) * n * n));
    double t[5];
    cudaEvent_t e0, e1;
    CUDA_CHECK(cudaEventCreate(&e0));
    CUDA_CHECK(cudaEventCreate(&e1));
    for (int r = -1; r < 5; r++) {  // r = −1: warm-up
      CUDA_CHECK(cudaEventRecord(e0, gpu_stream()));
      CUBLAS_CHECK(cublasGemmEx(gpu_cublas(), CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &one, a, type, n,
                                b, type, n, &zero, c, CUDA_R_32F, n, CUBLAS_COMPUTE_32F,
                                CUBLAS_GEMM_DEFAULT));
      CUDA_CHECK(cudaEventRecord(e1, gpu_stream()));
      CUDA_CHECK(cudaEventSynchronize(e1));
      float ms = 0.0f;
      CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
      if (r >= 0) t[r] = ms;
    }
    CUDA_CHECK(cudaEventDestroy(e0));
    CUDA_CHECK(cudaEventDestroy(e1));
    gpu_free(a);
    gpu_free(b);
    gpu_free(c);
    std::sort(t, t + 5);
    rate = 2.0 * n * (double)n * n / (t[2] / 1e3) / 1e9;
    if (t[2] >= 20.0 || n >= 16384) return rate;
  }
}
