// The emulated cuBLAS and cuBLASLt against a reference GEMM in double (column-major, as cuBLAS):
// every transpose combination, padded leading dimensions, alpha and beta (beta = 0 never reads
// C, even NaN), strided and pointer-array batches, fp32 and bf16 operands and outputs, TF32 and
// bf16 input rounding, device pointer mode; cuBLAS's argument checks and status codes; and
// __nv_bfloat16's round-to-nearest-even on exact values.
#include <cuda_bf16.h>
#include <cublasLt.h>
#include <cublas_v2.h>

#include "emu_test.h"

// Deterministic values with short significands, so fp32 sums of products are nearly exact.
static std::vector<float> values(size_t n, int seed) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; i++)
    v[i] = (float)((int)((i * 7919 + (size_t)seed * 104729) % 17) - 8) / 4.0f;
  return v;
}

static float tf32(float x) {
  uint32_t u = bits_of(x);
  u = (u + 0xfffu + ((u >> 13) & 1u)) & 0xffffe000u;
  float r;
  std::memcpy(&r, &u, 4);
  return r;
}

// C (m x n, ldc) = alpha op(A) op(B) + beta C in double, inputs passed through `in` first.
template <class F>
static std::vector<double> reference(bool ta, bool tb, int m, int n, int k, float alpha,
                                     const std::vector<float> &A, int lda,
                                     const std::vector<float> &B, int ldb, float beta,
                                     const std::vector<float> &C, int ldc, F in) {
  std::vector<double> out(C.begin(), C.end());
  for (int j = 0; j < n; j++)
    for (int i = 0; i < m; i++) {
      double s = 0;
      for (int p = 0; p < k; p++) {
        const double a = in(ta ? A[(size_t)i * lda + p] : A[(size_t)p * lda + i]);
        const double b = in(tb ? B[(size_t)p * ldb + j] : B[(size_t)j * ldb + p]);
        s += a * b;
      }
      const double c = beta == 0.0f ? 0.0 : (double)beta * C[(size_t)j * ldc + i];
      out[(size_t)j * ldc + i] = alpha * s + c;
    }
  return out;
}

static double max_err(const std::vector<float> &got, const std::vector<double> &want) {
  double e = 0;
  for (size_t i = 0; i < got.size(); i++) {
    const double d = std::fabs((double)got[i] - want[i]);
    if (!(d <= e)) e = d;  // NaN propagates
  }
  return e;
}

static cublasHandle_t handle() {
  cublasHandle_t h;
  assert_int_equal(cublasCreate(&h), CUBLAS_STATUS_SUCCESS);
  return h;
}

static void test_sgemm_transposes(void **) {
  cublasHandle_t h = handle();
  const int m = 13, n = 7, k = 11;
  for (int ta = 0; ta < 2; ta++)
    for (int tb = 0; tb < 2; tb++)
      for (float beta : {0.0f, 0.5f}) {
        const int ra = ta ? k : m, ca = ta ? m : k, rb = tb ? n : k, cb = tb ? k : n;
        const int lda = ra + 3, ldb = rb + 1, ldc = m + 2;
        std::vector<float> A = values((size_t)lda * ca, 1), B = values((size_t)ldb * cb, 2),
                           C = values((size_t)ldc * n, 3);
        float *dA = upload(A), *dB = upload(B), *dC = dev_alloc<float>(C.size());
        if (beta != 0.0f)
          CUDA_OK(cudaMemcpy(dC, C.data(), 4 * C.size(), cudaMemcpyHostToDevice));
        else
          for (float &c : C) c = NAN;  // dC is NaN-filled and must not be read
        const float alpha = 1.5f;
        assert_int_equal(
            cublasSgemm(h, ta ? CUBLAS_OP_T : CUBLAS_OP_N, tb ? CUBLAS_OP_T : CUBLAS_OP_N, m, n, k,
                        &alpha, dA, lda, dB, ldb, &beta, dC, ldc),
            CUBLAS_STATUS_SUCCESS);
        const std::vector<float> got = download(dC, C.size());
        const std::vector<double> want = reference(ta, tb, m, n, k, alpha, A, lda, B, ldb, beta, C,
                                                   ldc, [](float x) { return x; });
        double err = 0;
        for (int j = 0; j < n; j++)
          for (int i = 0; i < ldc; i++) {
            const size_t at = (size_t)j * ldc + i;
            if (i < m)
              err = std::fmax(err, std::fabs(got[at] - want[at]) + (std::isnan(got[at]) ? 1 : 0));
            else if (!(std::isnan(C[at]) ? std::isnan(got[at]) : got[at] == C[at]))
              fail_msg("the padding row %d of C was written", i);
          }
        if (!(err < 1e-4)) fail_msg("ta %d tb %d beta %g: error %g", ta, tb, beta, err);
        CUDA_OK(cudaFree(dA));
        CUDA_OK(cudaFree(dB));
        CUDA_OK(cudaFree(dC));
      }
  assert_int_equal(cublasDestroy(h), CUBLAS_STATUS_SUCCESS);
}

static void test_batched(void **) {
  cublasHandle_t h = handle();
  const int m = 5, n = 6, k = 4, batch = 3;
  const long long sa = m * k + 2, sb = k * n, sc = m * n + 1;
  std::vector<float> A = values((size_t)sa * batch, 4), B = values((size_t)sb * batch, 5),
                     C = values((size_t)sc * batch, 6);
  float *dA = upload(A), *dB = upload(B), *dC = upload(C);
  const float alpha = 1.0f, beta = 1.0f;
  assert_int_equal(cublasSgemmStridedBatched(h, CUBLAS_OP_N, CUBLAS_OP_N, m, n, k, &alpha, dA, m,
                                             sa, dB, k, sb, &beta, dC, m, sc, batch),
                   CUBLAS_STATUS_SUCCESS);
  std::vector<float> got = download(dC, C.size());
  for (int e = 0; e < batch; e++) {
    std::vector<float> a(A.begin() + sa * e, A.begin() + sa * e + m * k),
        b(B.begin() + sb * e, B.begin() + sb * e + k * n),
        c(C.begin() + sc * e, C.begin() + sc * e + m * n);
    const std::vector<double> want =
        reference(false, false, m, n, k, alpha, a, m, b, k, beta, c, m, [](float x) { return x; });
    std::vector<float> g(got.begin() + sc * e, got.begin() + sc * e + m * n);
    assert_true(max_err(g, want) < 1e-5);
  }
  assert_true(got[(size_t)sc - 1] == C[(size_t)sc - 1]);  // the gap between matrices untouched
  // the same through cublasGemmBatchedEx (pointer arrays in device memory)
  CUDA_OK(cudaMemcpy(dC, C.data(), 4 * C.size(), cudaMemcpyHostToDevice));
  std::vector<const void *> pa, pb;
  std::vector<void *> pc;
  for (int e = 0; e < batch; e++)
    pa.push_back(dA + sa * e), pb.push_back(dB + sb * e), pc.push_back(dC + sc * e);
  const void **dpa = upload(pa), **dpb = upload(pb);
  void **dpc = upload(pc);
  assert_int_equal(cublasGemmBatchedEx(h, CUBLAS_OP_N, CUBLAS_OP_N, m, n, k, &alpha, dpa,
                                       CUDA_R_32F, m, dpb, CUDA_R_32F, k, &beta, dpc, CUDA_R_32F, m,
                                       batch, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                   CUBLAS_STATUS_SUCCESS);
  assert_true(download(dC, C.size()) == got);
  for (void *p : {(void *)dA, (void *)dB, (void *)dC, (void *)dpa, (void *)dpb, (void *)dpc})
    CUDA_OK(cudaFree(p));
  cublasDestroy(h);
}

static void test_gemm_ex_bf16(void **) {
  cublasHandle_t h = handle();
  const int m = 9, n = 8, k = 33;
  std::vector<float> Af = values((size_t)m * k, 7), Bf = values((size_t)k * n, 8);
  for (float &x : Af) x *= 1.0f + 1.0f / 256.0f + 1.0f / 1024.0f;  // not exact in bf16
  std::vector<__nv_bfloat16> A(Af.begin(), Af.end()), B(Bf.begin(), Bf.end());
  __nv_bfloat16 *dA = upload(A), *dB = upload(B), *dC = dev_alloc<__nv_bfloat16>((size_t)m * n);
  float *dCf = dev_alloc<float>((size_t)m * n);
  const float alpha = 1.0f, beta = 0.0f;
  assert_int_equal(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &alpha, dA, CUDA_R_16BF, k,
                                dB, CUDA_R_16BF, k, &beta, dCf, CUDA_R_32F, m, CUBLAS_COMPUTE_32F,
                                CUBLAS_GEMM_DEFAULT),
                   CUBLAS_STATUS_SUCCESS);
  assert_int_equal(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &alpha, dA, CUDA_R_16BF, k,
                                dB, CUDA_R_16BF, k, &beta, dC, CUDA_R_16BF, m, CUBLAS_COMPUTE_32F,
                                CUBLAS_GEMM_DEFAULT),
                   CUBLAS_STATUS_SUCCESS);
  std::vector<float> Ar(A.begin(), A.end()), Br(B.begin(), B.end()), none((size_t)m * n, 0.0f);
  const std::vector<double> want = reference(true, false, m, n, k, alpha, Ar, k, Br, k, beta, none,
                                             m, [](float x) { return x; });
  const std::vector<float> got = download(dCf, (size_t)m * n);
  assert_true(max_err(got, want) < 1e-4);  // bf16 inputs exact in fp32; fp32 accumulation
  const std::vector<__nv_bfloat16> gb = download(dC, (size_t)m * n);
  for (size_t i = 0; i < gb.size(); i++)  // the bf16 output: the fp32 result rounded once
    assert_int_equal(gb[i].__x, __float2bfloat16(got[i]).__x);
  // fp32 operands rounded to bf16 (FAST_16BF) and to TF32 (the math mode) before the product
  float *fA = upload(Af), *fB = upload(Bf);
  assert_int_equal(
      cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &alpha, fA, CUDA_R_32F, k, fB, CUDA_R_32F,
                   k, &beta, dCf, CUDA_R_32F, m, CUBLAS_COMPUTE_32F_FAST_16BF, CUBLAS_GEMM_DEFAULT),
      CUBLAS_STATUS_SUCCESS);
  assert_true(max_err(download(dCf, (size_t)m * n), want) < 1e-4);
  assert_int_equal(cublasSetMathMode(h, CUBLAS_TF32_TENSOR_OP_MATH), CUBLAS_STATUS_SUCCESS);
  assert_int_equal(
      cublasSgemm(h, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &alpha, fA, k, fB, k, &beta, dCf, m),
      CUBLAS_STATUS_SUCCESS);
  const std::vector<double> want_tf32 = reference(true, false, m, n, k, alpha, Af, k, Bf, k, beta,
                                                  none, m, [](float x) { return tf32(x); });
  assert_true(max_err(download(dCf, (size_t)m * n), want_tf32) < 1e-4);
  assert_true(max_err(download(dCf, (size_t)m * n), want) > 1e-3);  // TF32 is visibly not bf16
  for (void *p : {(void *)dA, (void *)dB, (void *)dC, (void *)dCf, (void *)fA, (void *)fB})
    CUDA_OK(cudaFree(p));
  cublasDestroy(h);
}

static void test_pointer_mode_and_k0(void **) {
  cublasHandle_t h = handle();
  const std::vector<float> C = values(12, 9);
  float *dC = upload(C), *scal = upload(std::vector<float>{2.0f, 3.0f});
  assert_int_equal(cublasSetPointerMode(h, CUBLAS_POINTER_MODE_DEVICE), CUBLAS_STATUS_SUCCESS);
  // k = 0: C = beta C, A and B never read (null is fine)
  assert_int_equal(cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, 3, 4, 0, scal, nullptr, 3, nullptr, 1,
                               scal + 1, dC, 3),
                   CUBLAS_STATUS_SUCCESS);
  const std::vector<float> got = download(dC, 12);
  for (size_t i = 0; i < 12; i++) assert_true(got[i] == 3.0f * C[i]);
  cublasDestroy(h);
  CUDA_OK(cudaFree(dC));
  CUDA_OK(cudaFree(scal));
}

static void test_argument_checks(void **) {
  cublasHandle_t h = handle();
  float *d = dev_alloc<float>(64);
  const float one = 1.0f;
  const cublasOperation_t N = CUBLAS_OP_N, T = CUBLAS_OP_T;
  assert_int_equal(cublasSgemm(nullptr, N, N, 4, 4, 4, &one, d, 4, d, 4, &one, d, 4),
                   CUBLAS_STATUS_NOT_INITIALIZED);
  assert_int_equal(cublasSgemm(h, N, N, -1, 4, 4, &one, d, 4, d, 4, &one, d, 4),
                   CUBLAS_STATUS_INVALID_VALUE);
  assert_int_equal(cublasSgemm(h, N, N, 4, 4, -2, &one, d, 4, d, 4, &one, d, 4),
                   CUBLAS_STATUS_INVALID_VALUE);
  assert_int_equal(cublasSgemm(h, N, N, 4, 4, 5, &one, d, 3, d, 5, &one, d, 4),
                   CUBLAS_STATUS_INVALID_VALUE);  // lda < m
  assert_int_equal(cublasSgemm(h, T, N, 4, 4, 5, &one, d, 4, d, 5, &one, d, 4),
                   CUBLAS_STATUS_INVALID_VALUE);  // transposed: lda < k
  assert_int_equal(cublasSgemm(h, N, T, 4, 4, 5, &one, d, 4, d, 3, &one, d, 4),
                   CUBLAS_STATUS_INVALID_VALUE);  // transposed B: ldb < n
  assert_int_equal(cublasSgemm(h, N, N, 4, 4, 4, &one, d, 4, d, 4, &one, d, 3),
                   CUBLAS_STATUS_INVALID_VALUE);  // ldc < m
  assert_int_equal(cublasSgemm(h, (cublasOperation_t)7, N, 4, 4, 4, &one, d, 4, d, 4, &one, d, 4),
                   CUBLAS_STATUS_INVALID_VALUE);
  assert_int_equal(cublasSgemm(h, N, N, 0, 0, 0, &one, d, 1, d, 1, &one, d, 1),
                   CUBLAS_STATUS_SUCCESS);  // empty: nothing to do
  assert_int_equal(cublasGemmEx(h, N, N, 4, 4, 4, &one, d, CUDA_R_16F, 4, d, CUDA_R_16F, 4, &one, d,
                                CUDA_R_32F, 4, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                   CUBLAS_STATUS_NOT_SUPPORTED);
  assert_string_equal(cublasGetStatusName(CUBLAS_STATUS_INVALID_VALUE),
                      "CUBLAS_STATUS_INVALID_VALUE");
  assert_non_null(strstr(cublasGetStatusString(CUBLAS_STATUS_INVALID_VALUE), "invalid"));
  assert_int_equal(cublasDestroy(h), CUBLAS_STATUS_SUCCESS);
  assert_int_equal(cublasSgemm(h, N, N, 4, 4, 4, &one, d, 4, d, 4, &one, d, 4),
                   CUBLAS_STATUS_NOT_INITIALIZED);  // a destroyed handle
  CUDA_OK(cudaFree(d));
}

// cuBLASLt: D (bf16) = A (bf16)ᵀ B + bias, two strided batches; C read with beta = 1.
static void test_cublaslt(void **) {
  cublasLtHandle_t lt;
  assert_int_equal(cublasLtCreate(&lt), CUBLAS_STATUS_SUCCESS);
  const int m = 6, n = 5, k = 7, batch = 2;
  std::vector<float> Af = values((size_t)k * m * batch, 11), Bf = values((size_t)k * n * batch, 12),
                     Cf = values((size_t)m * n * batch, 13), bias = values(m, 14);
  std::vector<__nv_bfloat16> A(Af.begin(), Af.end()), B(Bf.begin(), Bf.end());
  __nv_bfloat16 *dA = upload(A), *dB = upload(B), *dD = dev_alloc<__nv_bfloat16>(Cf.size());
  float *dC = upload(Cf), *dbias = upload(bias);
  cublasLtMatmulDesc_t desc;
  assert_int_equal(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F),
                   CUBLAS_STATUS_SUCCESS);
  const int32_t trans = CUBLAS_OP_T;
  const uint32_t epi = CUBLASLT_EPILOGUE_BIAS;
  const int32_t bias_type = CUDA_R_32F;
  cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &trans, sizeof trans);
  cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi);
  const void *bp = dbias;
  cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bp, sizeof bp);
  cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type,
                                 sizeof bias_type);
  cublasLtMatrixLayout_t la, lb, lc, ld;
  cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, k, m, k);
  cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, k, n, k);
  cublasLtMatrixLayoutCreate(&lc, CUDA_R_32F, m, n, m);
  cublasLtMatrixLayoutCreate(&ld, CUDA_R_16BF, m, n, m);
  const int32_t b = batch;
  const int64_t strides[4] = {k * m, k * n, m * n, m * n};
  cublasLtMatrixLayout_t ls[4] = {la, lb, lc, ld};
  for (int i = 0; i < 4; i++) {
    cublasLtMatrixLayoutSetAttribute(ls[i], CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &b, sizeof b);
    cublasLtMatrixLayoutSetAttribute(ls[i], CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                     &strides[i], sizeof strides[i]);
  }
  // C is fp32 and D bf16: refused (C and D share a type)
  const float alpha = 1.0f, beta = 1.0f;
  assert_int_equal(cublasLtMatmul(lt, desc, &alpha, dA, la, dB, lb, &beta, dC, lc, dD, ld, nullptr,
                                  nullptr, 0, 0),
                   CUBLAS_STATUS_NOT_SUPPORTED);
  cublasLtMatrixLayoutDestroy(lc);
  cublasLtMatrixLayoutCreate(&lc, CUDA_R_16BF, m, n, m);
  cublasLtMatrixLayoutSetAttribute(lc, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &b, sizeof b);
  cublasLtMatrixLayoutSetAttribute(lc, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &strides[2],
                                   sizeof strides[2]);
  std::vector<__nv_bfloat16> C(Cf.begin(), Cf.end());
  __nv_bfloat16 *dCb = upload(C);
  assert_int_equal(cublasLtMatmul(lt, desc, &alpha, dA, la, dB, lb, &beta, dCb, lc, dD, ld, nullptr,
                                  nullptr, 0, 0),
                   CUBLAS_STATUS_SUCCESS);
  const std::vector<__nv_bfloat16> got = download(dD, Cf.size());
  for (int e = 0; e < batch; e++) {
    std::vector<float> a(Af.begin() + k * m * e, Af.begin() + k * m * (e + 1)),
        bb(Bf.begin() + k * n * e, Bf.begin() + k * n * (e + 1)),
        c(C.begin() + m * n * e, C.begin() + m * n * (e + 1));
    const std::vector<double> want =
        reference(true, false, m, n, k, alpha, a, k, bb, k, beta, c, m,
                  [](float x) { return __bfloat162float(__float2bfloat16(x)); });
    for (int j = 0; j < n; j++)
      for (int i = 0; i < m; i++)
        assert_int_equal(
            got[(size_t)(m * n * e + j * m + i)].__x,
            __float2bfloat16((float)(want[(size_t)(j * m + i)] + bias[(size_t)i])).__x);
  }
  // shapes that do not agree
  cublasLtMatrixLayout_t bad;
  cublasLtMatrixLayoutCreate(&bad, CUDA_R_16BF, k + 1, n, k + 1);
  assert_int_equal(cublasLtMatmul(lt, desc, &alpha, dA, la, dB, bad, &beta, dCb, lc, dD, ld,
                                  nullptr, nullptr, 0, 0),
                   CUBLAS_STATUS_INVALID_VALUE);
  for (cublasLtMatrixLayout_t l : {la, lb, lc, ld, bad}) cublasLtMatrixLayoutDestroy(l);
  cublasLtMatmulDescDestroy(desc);
  cublasLtDestroy(lt);
  for (void *p : {(void *)dA, (void *)dB, (void *)dC, (void *)dD, (void *)dbias, (void *)dCb})
    CUDA_OK(cudaFree(p));
}

// ---- bf16 ----
__global__ void bf16_roundtrip(__nv_bfloat16 *out, const float *in, int n) {
  const int i = threadIdx.x;
  if (i < n) out[i] = __float2bfloat16(in[i]);
}

static float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

static void test_bf16(void **) {
  struct {
    uint32_t in;
    uint16_t out;
  } cases[] = {
      {0x3f800000u, 0x3f80},  // 1
      {0x3f808000u, 0x3f80},  // 1 + 2^-8: a tie, to even (down)
      {0x3f818000u, 0x3f82},  // 1 + 3·2^-8: a tie, to even (up)
      {0x3f808001u, 0x3f81},  // just above the tie: up
      {0x3f807fffu, 0x3f80},  // just below: down
      {0xbf818000u, 0xbf82},  // negative ties the same way
      {0x7f7fffffu, 0x7f80},  // FLT_MAX rounds to infinity
      {0x7f800000u, 0x7f80},  // infinity stays
      {0x80000000u, 0x8000},  // -0 stays
      {0x00010000u, 0x0001},  // a denormal, exact
      {0x7fc00001u, 0x7fc0},  // a quiet NaN stays NaN
      {0x7f800001u, 0x7fc0},  // a signalling NaN whose payload is below bf16: quiet NaN
  };
  std::vector<float> in;
  for (auto &c : cases) {
    const __nv_bfloat16 b = __float2bfloat16(from_bits(c.in));
    assert_int_equal(__bfloat16_as_ushort(b), c.out);
    assert_int_equal(__float2bfloat16_rn(from_bits(c.in)).__x, c.out);
    assert_int_equal(bits_of(__bfloat162float(b)), (uint32_t)c.out << 16);  // exact back to float
    in.push_back(from_bits(c.in));
  }
  assert_int_equal(__float2bfloat16_rz(from_bits(0x3f81ffffu)).__x, 0x3f81);
  const __nv_bfloat16 a = __float2bfloat16(1.0f), e = __float2bfloat16(1.0f / 256.0f);
  assert_int_equal((a + e).__x, 0x3f80);  // 1 + 2^-8 rounds back to 1: bf16 arithmetic
  assert_int_equal((a * __float2bfloat16(3.0f)).__x, 0x4040);
  // the same conversions in a kernel
  float *din = upload(in);
  __nv_bfloat16 *dout = dev_alloc<__nv_bfloat16>(in.size());
  bf16_roundtrip<<<1, 32>>>(dout, din, (int)in.size());
  const std::vector<__nv_bfloat16> got = download(dout, in.size());
  for (size_t i = 0; i < in.size(); i++) assert_int_equal(got[i].__x, cases[i].out);
  CUDA_OK(cudaFree(din));
  CUDA_OK(cudaFree(dout));
}

static const struct CMUnitTest tests[] = {
    cmocka_unit_test(test_sgemm_transposes),
    cmocka_unit_test(test_batched),
    cmocka_unit_test(test_gemm_ex_bf16),
    cmocka_unit_test(test_pointer_mode_and_k0),
    cmocka_unit_test(test_argument_checks),
    cmocka_unit_test(test_cublaslt),
    cmocka_unit_test(test_bf16),
};

EMU_MAIN(tests)
