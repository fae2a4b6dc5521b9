// cuBLAS on OpenBLAS: the handle, its stream and modes, and the GEMMs (fp32 and bf16 operands,
// fp32 accumulation), column-major exactly as cuBLAS. Arguments are checked at the call as
// cuBLAS checks them (status codes, with a "cudaemu:" line); the product itself is stream work,
// so deferred mode applies. A matrix reaching past its device allocation ends the run, as the
// GPU's kernel would fault. bf16 and TF32 inputs are rounded as the tensor cores take them.
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <vector>

#include "core.h"
#include "gemm.h"
#include "include/cublas_v2.h"

struct cublasContext {
  cudaStream_t stream = nullptr;
  cublasMath_t math = CUBLAS_DEFAULT_MATH;
  cublasPointerMode_t pointer_mode = CUBLAS_POINTER_MODE_HOST;
  void *workspace = nullptr;  // cublasSetWorkspace's (the emulated products need none)
  size_t workspace_bytes = 0;
  bool destroyed = false;
};

namespace cudaemu {
namespace {

bool live(cublasHandle_t h) { return h && !h->destroyed; }

cublasStatus_t invalid(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
cublasStatus_t invalid(const char *fmt, ...) {
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  note("%s: CUBLAS_STATUS_INVALID_VALUE", msg);
  return CUBLAS_STATUS_INVALID_VALUE;
}

// cuBLAS's checks of a GEMM's shape arguments, in its order.
cublasStatus_t check_shape(const char *fn, cublasHandle_t h, cublasOperation_t ta,
                           cublasOperation_t tb, int m, int n, int k, int lda, int ldb, int ldc,
                           int batch) {
  if (!live(h)) {
    note("%s: null or destroyed handle: CUBLAS_STATUS_NOT_INITIALIZED", fn);
    return CUBLAS_STATUS_NOT_INITIALIZED;
  }
  if ((ta != CUBLAS_OP_N && ta != CUBLAS_OP_T && ta != CUBLAS_OP_C) ||
      (tb != CUBLAS_OP_N && tb != CUBLAS_OP_T && tb != CUBLAS_OP_C))
    return invalid("%s: transa %d, transb %d are no cublasOperation_t", fn, (int)ta, (int)tb);
  if (m < 0 || n < 0 || k < 0 || batch < 0)
    return invalid("%s: m = %d, n = %d, k = %d, batchCount = %d: none may be negative", fn, m, n, k,
                   batch);
  const int rows_a = ta == CUBLAS_OP_N ? m : k, rows_b = tb == CUBLAS_OP_N ? k : n;
  if (lda < (rows_a > 1 ? rows_a : 1))
    return invalid("%s: lda = %d < max(1, %d), the rows of A as stored (%s)", fn, lda, rows_a,
                   ta == CUBLAS_OP_N ? "m" : "k");
  if (ldb < (rows_b > 1 ? rows_b : 1))
    return invalid("%s: ldb = %d < max(1, %d), the rows of B as stored (%s)", fn, ldb, rows_b,
                   tb == CUBLAS_OP_N ? "k" : "n");
  if (ldc < (m > 1 ? m : 1)) return invalid("%s: ldc = %d < max(1, m = %d)", fn, ldc, m);
  return CUBLAS_STATUS_SUCCESS;
}

// The rounding of fp32 inputs the handle's math mode or the compute type asks for.
gemm_round input_rounding(cublasHandle_t h, cublasComputeType_t ct, bool ex) {
  if (ex && ct == CUBLAS_COMPUTE_32F_FAST_16BF) return gemm_round::bf16;
  if (ex && ct == CUBLAS_COMPUTE_32F_FAST_TF32) return gemm_round::tf32;
  if (ex && ct == CUBLAS_COMPUTE_32F_PEDANTIC) return gemm_round::none;
  return h->math == CUBLAS_TF32_TENSOR_OP_MATH ? gemm_round::tf32 : gemm_round::none;
}

bool elem_of(cudaDataType t, gemm_elem *e) {
  if (t == CUDA_R_32F)
    *e = gemm_elem::f32;
  else if (t == CUDA_R_16BF)
    *e = gemm_elem::bf16;
  else
    return false;
  return true;
}

// Check, then queue the GEMM on the handle's stream.
cublasStatus_t enqueue(const char *fn, cublasHandle_t h, gemm_call g, const void *alpha,
                       const void *beta) {
  if (!alpha || !beta) return invalid("%s: null alpha or beta", fn);
  if (h->pointer_mode == CUBLAS_POINTER_MODE_HOST) {
    std::memcpy(&g.alpha, alpha, sizeof(float));  // read at the call, as cuBLAS does
    std::memcpy(&g.beta, beta, sizeof(float));
  } else {
    if (!device_range(alpha, 4, true) || !device_range(beta, 4, true))
      return invalid("%s: CUBLAS_POINTER_MODE_DEVICE with alpha or beta not in device memory", fn);
    g.alpha_dev = static_cast<const float *>(alpha);
    g.beta_dev = static_cast<const float *>(beta);
  }
  g.fn = fn;
  gemm_check_extents(g);
  trace("%s m=%d n=%d k=%d batch=%d", fn, g.m, g.n, g.k, g.batch);
  submit(h->stream, fn, [g] { gemm_run(g); });
  return CUBLAS_STATUS_SUCCESS;
}

gemm_call make_call(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k) {
  gemm_call g;
  g.trans_a = ta != CUBLAS_OP_N;
  g.trans_b = tb != CUBLAS_OP_N;
  g.m = m;
  g.n = n;
  g.k = k;
  return g;
}

}  // namespace
}  // namespace cudaemu

using namespace cudaemu;

extern "C" {

cublasStatus_t cublasCreate(cublasHandle_t *handle) {
  if (!handle) return CUBLAS_STATUS_INVALID_VALUE;
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    (void)cudaGetLastError();
    return CUBLAS_STATUS_NOT_INITIALIZED;
  }
  *handle = new cublasContext;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasDestroy(cublasHandle_t h) {
  if (!live(h)) return CUBLAS_STATUS_NOT_INITIALIZED;
  drain_all();          // cublasDestroy synchronises the device
  h->destroyed = true;  // kept: a later use reports NOT_INITIALIZED instead of reading freed memory
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetStream(cublasHandle_t h, cudaStream_t s) {
  if (!live(h)) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (!valid_stream(s)) return invalid("cublasSetStream: no such stream %p", (void *)s);
  h->stream = s;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetWorkspace(cublasHandle_t h, void *ws, size_t bytes) {
  if (!live(h)) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (bytes && (!ws || !device_range(ws, bytes, false)))
    return invalid("cublasSetWorkspace: %p is not device memory of %zu bytes", ws, bytes);
  if (reinterpret_cast<uintptr_t>(ws) % 256)
    return invalid("cublasSetWorkspace: %p is not aligned to 256 bytes", ws);
  h->workspace = ws;
  h->workspace_bytes = bytes;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGetStream(cublasHandle_t h, cudaStream_t *s) {
  if (!live(h)) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (!s) return CUBLAS_STATUS_INVALID_VALUE;
  *s = h->stream;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetMathMode(cublasHandle_t h, cublasMath_t mode) {
  if (!live(h)) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (mode < CUBLAS_DEFAULT_MATH || mode > CUBLAS_TF32_TENSOR_OP_MATH)
    return invalid("cublasSetMathMode: mode %d", (int)mode);
  h->math = mode;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGetMathMode(cublasHandle_t h, cublasMath_t *mode) {
  if (!live(h)) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (!mode) return CUBLAS_STATUS_INVALID_VALUE;
  *mode = h->math;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetPointerMode(cublasHandle_t h, cublasPointerMode_t mode) {
  if (!live(h)) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (mode != CUBLAS_POINTER_MODE_HOST && mode != CUBLAS_POINTER_MODE_DEVICE)
    return invalid("cublasSetPointerMode: mode %d", (int)mode);
  h->pointer_mode = mode;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGetPointerMode(cublasHandle_t h, cublasPointerMode_t *mode) {
  if (!live(h)) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (!mode) return CUBLAS_STATUS_INVALID_VALUE;
  *mode = h->pointer_mode;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSgemmStridedBatched(cublasHandle_t h, cublasOperation_t ta,
                                         cublasOperation_t tb, int m, int n, int k,
                                         const float *alpha, const float *A, int lda, long long sa,
                                         const float *B, int ldb, long long sb, const float *beta,
                                         float *C, int ldc, long long sc, int batch) {
  const char *fn = "cublasSgemmStridedBatched";
  if (cublasStatus_t s = check_shape(fn, h, ta, tb, m, n, k, lda, ldb, ldc, batch)) return s;
  gemm_call g = make_call(ta, tb, m, n, k);
  g.a = {A, gemm_elem::f32, lda, sa};
  g.b = {B, gemm_elem::f32, ldb, sb};
  g.c = {C, gemm_elem::f32, ldc, sc};
  g.batch = batch;
  g.round = input_rounding(h, CUBLAS_COMPUTE_32F, false);
  return enqueue(fn, h, g, alpha, beta);
}

cublasStatus_t cublasSgemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m,
                           int n, int k, const float *alpha, const float *A, int lda,
                           const float *B, int ldb, const float *beta, float *C, int ldc) {
  const char *fn = "cublasSgemm";
  if (cublasStatus_t s = check_shape(fn, h, ta, tb, m, n, k, lda, ldb, ldc, 1)) return s;
  gemm_call g = make_call(ta, tb, m, n, k);
  g.a = {A, gemm_elem::f32, lda, 0};
  g.b = {B, gemm_elem::f32, ldb, 0};
  g.c = {C, gemm_elem::f32, ldc, 0};
  g.round = input_rounding(h, CUBLAS_COMPUTE_32F, false);
  return enqueue(fn, h, g, alpha, beta);
}

cublasStatus_t cublasGemmStridedBatchedEx(cublasHandle_t h, cublasOperation_t ta,
                                          cublasOperation_t tb, int m, int n, int k,
                                          const void *alpha, const void *A, cudaDataType at,
                                          int lda, long long sa, const void *B, cudaDataType bt,
                                          int ldb, long long sb, const void *beta, void *C,
                                          cudaDataType ct, int ldc, long long sc, int batch,
                                          cublasComputeType_t compute, cublasGemmAlgo_t) {
  const char *fn = "cublasGemmEx";
  if (cublasStatus_t s = check_shape(fn, h, ta, tb, m, n, k, lda, ldb, ldc, batch)) return s;
  gemm_elem ea, eb, ec;
  if (compute == CUBLAS_COMPUTE_32F_FAST_16F || compute < CUBLAS_COMPUTE_32F ||
      compute > CUBLAS_COMPUTE_32F_FAST_TF32 || !elem_of(at, &ea) || !elem_of(bt, &eb) ||
      !elem_of(ct, &ec) || ea != eb) {
    note(
        "%s: types A %d, B %d, C %d with compute type %d are not emulated (fp32 or bf16 "
        "operands, fp32 compute): CUBLAS_STATUS_NOT_SUPPORTED",
        fn, (int)at, (int)bt, (int)ct, (int)compute);
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  gemm_call g = make_call(ta, tb, m, n, k);
  g.a = {A, ea, lda, sa};
  g.b = {B, eb, ldb, sb};
  g.c = {C, ec, ldc, sc};
  g.batch = batch;
  g.round = ea == gemm_elem::f32 ? input_rounding(h, compute, true) : gemm_round::none;
  return enqueue(fn, h, g, alpha, beta);
}

cublasStatus_t cublasGemmEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m,
                            int n, int k, const void *alpha, const void *A, cudaDataType at,
                            int lda, const void *B, cudaDataType bt, int ldb, const void *beta,
                            void *C, cudaDataType ct, int ldc, cublasComputeType_t compute,
                            cublasGemmAlgo_t algo) {
  return cublasGemmStridedBatchedEx(h, ta, tb, m, n, k, alpha, A, at, lda, 0, B, bt, ldb, 0, beta,
                                    C, ct, ldc, 0, 1, compute, algo);
}

cublasStatus_t cublasGemmBatchedEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb,
                                   int m, int n, int k, const void *alpha,
                                   const void *const Aarray[], cudaDataType at, int lda,
                                   const void *const Barray[], cudaDataType bt, int ldb,
                                   const void *beta, void *const Carray[], cudaDataType ct, int ldc,
                                   int batch, cublasComputeType_t compute, cublasGemmAlgo_t) {
  const char *fn = "cublasGemmBatchedEx";
  if (cublasStatus_t s = check_shape(fn, h, ta, tb, m, n, k, lda, ldb, ldc, batch)) return s;
  gemm_elem ea, eb, ec;
  if (compute == CUBLAS_COMPUTE_32F_FAST_16F || !elem_of(at, &ea) || !elem_of(bt, &eb) ||
      !elem_of(ct, &ec) || ea != eb)
    return CUBLAS_STATUS_NOT_SUPPORTED;
  const size_t bytes = sizeof(void *) * (size_t)batch;
  if (batch > 0 && (!device_range(Aarray, bytes, true) || !device_range(Barray, bytes, true) ||
                    !device_range(Carray, bytes, true)))
    return invalid("%s: the pointer arrays must be device memory", fn);
  gemm_call g = make_call(ta, tb, m, n, k);
  g.a = {nullptr, ea, lda, 0};
  g.b = {nullptr, eb, ldb, 0};
  g.c = {nullptr, ec, ldc, 0};
  g.batch = batch;
  g.a_array = Aarray;
  g.b_array = Barray;
  g.c_array = Carray;
  g.round = ea == gemm_elem::f32 ? input_rounding(h, compute, true) : gemm_round::none;
  return enqueue(fn, h, g, alpha, beta);
}

const char *cublasGetStatusName(cublasStatus_t s) {
  switch (s) {
#define NAME(x) \
  case x:       \
    return #x;
    NAME(CUBLAS_STATUS_SUCCESS)
    NAME(CUBLAS_STATUS_NOT_INITIALIZED)
    NAME(CUBLAS_STATUS_ALLOC_FAILED)
    NAME(CUBLAS_STATUS_INVALID_VALUE)
    NAME(CUBLAS_STATUS_ARCH_MISMATCH)
    NAME(CUBLAS_STATUS_MAPPING_ERROR)
    NAME(CUBLAS_STATUS_EXECUTION_FAILED)
    NAME(CUBLAS_STATUS_INTERNAL_ERROR)
    NAME(CUBLAS_STATUS_NOT_SUPPORTED)
    NAME(CUBLAS_STATUS_LICENSE_ERROR)
#undef NAME
  }
  return "CUBLAS_STATUS_UNKNOWN";
}

const char *cublasGetStatusString(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_SUCCESS:
      return "success";
    case CUBLAS_STATUS_NOT_INITIALIZED:
      return "the library was not initialized";
    case CUBLAS_STATUS_ALLOC_FAILED:
      return "the resource allocation failed";
    case CUBLAS_STATUS_INVALID_VALUE:
      return "an invalid numeric value was used as an argument";
    case CUBLAS_STATUS_ARCH_MISMATCH:
      return "an absent device architectural feature is required";
    case CUBLAS_STATUS_MAPPING_ERROR:
      return "an access to GPU memory space failed";
    case CUBLAS_STATUS_EXECUTION_FAILED:
      return "the GPU program failed to execute";
    case CUBLAS_STATUS_INTERNAL_ERROR:
      return "an internal operation failed";
    case CUBLAS_STATUS_NOT_SUPPORTED:
      return "the functionality requested is not supported";
    case CUBLAS_STATUS_LICENSE_ERROR:
      return "error detected trying to check the license";
  }
  return "unknown error";
}

}  // extern "C"
