// cuBLASLt on the emulation's GEMM engine: matmul descriptors and column-major matrix layouts
// (optionally strided-batched), D = alpha·op(A)·op(B) + beta·C (+ bias per row of D), checked as
// cuBLASLt checks shapes and queued on the given stream. What is not listed in cublasLt.h
// (row-major orders, other epilogues, device pointer mode) is refused, never approximated.
#include <cstring>

#include "core.h"
#include "gemm.h"
#include "include/cublasLt.h"

struct cublasLtContext {
  bool destroyed = false;
};
struct cublasLtMatmulDescOpaque_t {
  cublasComputeType_t compute;
  cudaDataType_t scale;
  cublasOperation_t ta = CUBLAS_OP_N, tb = CUBLAS_OP_N;
  uint32_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  const void *bias = nullptr;
  cudaDataType_t bias_type = CUDA_R_32F;
  bool bias_type_set = false;
};
struct cublasLtMatrixLayoutOpaque_t {
  cudaDataType type;
  uint64_t rows, cols;
  int64_t ld;
  int32_t batch = 1;
  int64_t stride = 0;
};
struct cublasLtMatmulPreferenceOpaque_t {
  uint64_t workspace = 0;
};

namespace cudaemu {
namespace {

cublasStatus_t refuse(cublasStatus_t s, const char *what) {
  note("cublasLt: %s: %s", what,
       s == CUBLAS_STATUS_NOT_SUPPORTED ? "CUBLAS_STATUS_NOT_SUPPORTED"
                                        : "CUBLAS_STATUS_INVALID_VALUE");
  return s;
}

template <class T>
bool read_attr(const void *buf, size_t size, T *out) {
  if (!buf || size != sizeof(T)) return false;
  std::memcpy(out, buf, sizeof(T));
  return true;
}

bool elem(cudaDataType t, gemm_elem *e) {
  if (t == CUDA_R_32F)
    *e = gemm_elem::f32;
  else if (t == CUDA_R_16BF)
    *e = gemm_elem::bf16;
  else
    return false;
  return true;
}

// The layouts' shapes against each other, as cuBLASLt checks them.
cublasStatus_t check_shapes(cublasLtMatmulDesc_t d, cublasLtMatrixLayout_t A,
                            cublasLtMatrixLayout_t B, cublasLtMatrixLayout_t C,
                            cublasLtMatrixLayout_t D) {
  const uint64_t m = D->rows, n = D->cols;
  const uint64_t am = d->ta == CUBLAS_OP_N ? A->rows : A->cols,
                 ak = d->ta == CUBLAS_OP_N ? A->cols : A->rows;
  const uint64_t bk = d->tb == CUBLAS_OP_N ? B->rows : B->cols,
                 bn = d->tb == CUBLAS_OP_N ? B->cols : B->rows;
  if (am != m || bn != n || ak != bk || C->rows != m || C->cols != n)
    return refuse(CUBLAS_STATUS_INVALID_VALUE, "cublasLtMatmul: the layouts' shapes do not agree");
  for (cublasLtMatrixLayout_t l : {A, B, C, D})
    if (l->ld < (int64_t)(l->rows > 1 ? l->rows : 1) || l->rows > INT32_MAX || l->cols > INT32_MAX)
      return refuse(CUBLAS_STATUS_INVALID_VALUE,
                    "cublasLtMatmul: a leading dimension below the rows");
  if (A->batch != D->batch || B->batch != D->batch || C->batch != D->batch || D->batch < 1)
    return refuse(CUBLAS_STATUS_INVALID_VALUE, "cublasLtMatmul: batch counts differ");
  return CUBLAS_STATUS_SUCCESS;
}

}  // namespace
}  // namespace cudaemu

using namespace cudaemu;

extern "C" {

cublasStatus_t cublasLtCreate(cublasLtHandle_t *h) {
  if (!h) return CUBLAS_STATUS_INVALID_VALUE;
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    (void)cudaGetLastError();
    return CUBLAS_STATUS_NOT_INITIALIZED;
  }
  *h = new cublasLtContext;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtDestroy(cublasLtHandle_t h) {
  if (!h || h->destroyed) return CUBLAS_STATUS_NOT_INITIALIZED;
  drain_all();
  h->destroyed = true;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t *d, cublasComputeType_t compute,
                                        cudaDataType_t scale) {
  if (!d) return CUBLAS_STATUS_INVALID_VALUE;
  if (compute != CUBLAS_COMPUTE_32F && compute != CUBLAS_COMPUTE_32F_PEDANTIC &&
      compute != CUBLAS_COMPUTE_32F_FAST_TF32 && compute != CUBLAS_COMPUTE_32F_FAST_16BF)
    return refuse(CUBLAS_STATUS_NOT_SUPPORTED, "cublasLtMatmulDescCreate: compute type");
  if (scale != CUDA_R_32F)
    return refuse(CUBLAS_STATUS_NOT_SUPPORTED, "cublasLtMatmulDescCreate: scale type not fp32");
  *d = new cublasLtMatmulDescOpaque_t{compute, scale};
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t d) {
  delete d;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t d,
                                              cublasLtMatmulDescAttributes_t attr, const void *buf,
                                              size_t size) {
  if (!d) return CUBLAS_STATUS_INVALID_VALUE;
  int32_t i32 = 0;
  uint32_t u32 = 0;
  switch (attr) {
    case CUBLASLT_MATMUL_DESC_TRANSA:
    case CUBLASLT_MATMUL_DESC_TRANSB:
      if (!read_attr(buf, size, &i32) || i32 < CUBLAS_OP_N || i32 > CUBLAS_OP_C)
        return refuse(CUBLAS_STATUS_INVALID_VALUE, "TRANSA/TRANSB");
      (attr == CUBLASLT_MATMUL_DESC_TRANSA ? d->ta : d->tb) = (cublasOperation_t)i32;
      return CUBLAS_STATUS_SUCCESS;
    case CUBLASLT_MATMUL_DESC_EPILOGUE:
      if (!read_attr(buf, size, &u32)) return refuse(CUBLAS_STATUS_INVALID_VALUE, "EPILOGUE");
      if (u32 != CUBLASLT_EPILOGUE_DEFAULT && u32 != CUBLASLT_EPILOGUE_BIAS)
        return refuse(CUBLAS_STATUS_NOT_SUPPORTED, "EPILOGUE other than DEFAULT or BIAS");
      d->epilogue = u32;
      return CUBLAS_STATUS_SUCCESS;
    case CUBLASLT_MATMUL_DESC_BIAS_POINTER:
      return read_attr(buf, size, &d->bias) ? CUBLAS_STATUS_SUCCESS
                                            : refuse(CUBLAS_STATUS_INVALID_VALUE, "BIAS_POINTER");
    case CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE:
      if (!read_attr(buf, size, &i32)) return refuse(CUBLAS_STATUS_INVALID_VALUE, "BIAS_DATA_TYPE");
      d->bias_type = (cudaDataType_t)i32;
      d->bias_type_set = true;
      return CUBLAS_STATUS_SUCCESS;
    case CUBLASLT_MATMUL_DESC_POINTER_MODE:
      if (!read_attr(buf, size, &i32)) return refuse(CUBLAS_STATUS_INVALID_VALUE, "POINTER_MODE");
      return i32 == CUBLASLT_POINTER_MODE_HOST
                 ? CUBLAS_STATUS_SUCCESS
                 : refuse(CUBLAS_STATUS_NOT_SUPPORTED, "POINTER_MODE other than HOST");
    case CUBLASLT_MATMUL_DESC_SCALE_TYPE:
      if (!read_attr(buf, size, &i32)) return refuse(CUBLAS_STATUS_INVALID_VALUE, "SCALE_TYPE");
      return i32 == CUDA_R_32F ? CUBLAS_STATUS_SUCCESS
                               : refuse(CUBLAS_STATUS_NOT_SUPPORTED, "SCALE_TYPE not fp32");
    case CUBLASLT_MATMUL_DESC_COMPUTE_TYPE:
      if (!read_attr(buf, size, &i32)) return refuse(CUBLAS_STATUS_INVALID_VALUE, "COMPUTE_TYPE");
      d->compute = (cublasComputeType_t)i32;
      return CUBLAS_STATUS_SUCCESS;
  }
  return refuse(CUBLAS_STATUS_NOT_SUPPORTED, "cublasLtMatmulDescSetAttribute: attribute");
}

cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t *l, cudaDataType type,
                                          uint64_t rows, uint64_t cols, int64_t ld) {
  if (!l) return CUBLAS_STATUS_INVALID_VALUE;
  *l = new cublasLtMatrixLayoutOpaque_t{type, rows, cols, ld};
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t l) {
  delete l;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatrixLayoutSetAttribute(cublasLtMatrixLayout_t l,
                                                cublasLtMatrixLayoutAttribute_t attr,
                                                const void *buf, size_t size) {
  if (!l) return CUBLAS_STATUS_INVALID_VALUE;
  int32_t i32 = 0;
  switch (attr) {
    case CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT:
      return read_attr(buf, size, &l->batch) ? CUBLAS_STATUS_SUCCESS
                                             : refuse(CUBLAS_STATUS_INVALID_VALUE, "BATCH_COUNT");
    case CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET:
      return read_attr(buf, size, &l->stride)
                 ? CUBLAS_STATUS_SUCCESS
                 : refuse(CUBLAS_STATUS_INVALID_VALUE, "STRIDED_BATCH_OFFSET");
    case CUBLASLT_MATRIX_LAYOUT_ORDER:
      if (!read_attr(buf, size, &i32)) return refuse(CUBLAS_STATUS_INVALID_VALUE, "ORDER");
      return i32 == CUBLASLT_ORDER_COL
                 ? CUBLAS_STATUS_SUCCESS
                 : refuse(CUBLAS_STATUS_NOT_SUPPORTED, "ORDER other than COL");
    case CUBLASLT_MATRIX_LAYOUT_LD:
      return read_attr(buf, size, &l->ld) ? CUBLAS_STATUS_SUCCESS
                                          : refuse(CUBLAS_STATUS_INVALID_VALUE, "LD");
    case CUBLASLT_MATRIX_LAYOUT_ROWS:
      return read_attr(buf, size, &l->rows) ? CUBLAS_STATUS_SUCCESS
                                            : refuse(CUBLAS_STATUS_INVALID_VALUE, "ROWS");
    case CUBLASLT_MATRIX_LAYOUT_COLS:
      return read_attr(buf, size, &l->cols) ? CUBLAS_STATUS_SUCCESS
                                            : refuse(CUBLAS_STATUS_INVALID_VALUE, "COLS");
    case CUBLASLT_MATRIX_LAYOUT_TYPE:
      if (!read_attr(buf, size, &i32)) return refuse(CUBLAS_STATUS_INVALID_VALUE, "TYPE");
      l->type = (cudaDataType)i32;
      return CUBLAS_STATUS_SUCCESS;
  }
  return refuse(CUBLAS_STATUS_NOT_SUPPORTED, "cublasLtMatrixLayoutSetAttribute: attribute");
}

cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t *p) {
  if (!p) return CUBLAS_STATUS_INVALID_VALUE;
  *p = new cublasLtMatmulPreferenceOpaque_t;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t p) {
  delete p;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t p,
                                                    cublasLtMatmulPreferenceAttributes_t attr,
                                                    const void *buf, size_t size) {
  if (!p || attr != CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES ||
      !read_attr(buf, size, &p->workspace))
    return refuse(CUBLAS_STATUS_INVALID_VALUE, "cublasLtMatmulPreferenceSetAttribute");
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t h, cublasLtMatmulDesc_t d,
                                              cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                                              cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t dl,
                                              cublasLtMatmulPreference_t, int requested,
                                              cublasLtMatmulHeuristicResult_t results[],
                                              int *returned) {
  if (!h || h->destroyed) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (!d || !a || !b || !c || !dl || requested < 1 || !results || !returned)
    return CUBLAS_STATUS_INVALID_VALUE;
  if (cublasStatus_t s = check_shapes(d, a, b, c, dl)) return s;
  std::memset(results, 0, sizeof *results);  // one algorithm: OpenBLAS, no workspace
  results[0].state = CUBLAS_STATUS_SUCCESS;
  results[0].wavesCount = 1.0f;
  *returned = 1;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmul(cublasLtHandle_t h, cublasLtMatmulDesc_t d, const void *alpha,
                              const void *A, cublasLtMatrixLayout_t Al, const void *B,
                              cublasLtMatrixLayout_t Bl, const void *beta, const void *C,
                              cublasLtMatrixLayout_t Cl, void *D, cublasLtMatrixLayout_t Dl,
                              const cublasLtMatmulAlgo_t *, void *, size_t, cudaStream_t stream) {
  if (!h || h->destroyed) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (!d || !Al || !Bl || !Cl || !Dl || !alpha || !beta) return CUBLAS_STATUS_INVALID_VALUE;
  if (cublasStatus_t s = check_shapes(d, Al, Bl, Cl, Dl)) return s;
  gemm_call g;
  gemm_elem ea, eb, ec, ed, ebias = gemm_elem::f32;
  if (!elem(Al->type, &ea) || !elem(Bl->type, &eb) || !elem(Cl->type, &ec) ||
      !elem(Dl->type, &ed) || ea != eb || ec != ed ||
      (d->bias && !elem(d->bias_type_set ? d->bias_type : Dl->type, &ebias)))
    return refuse(CUBLAS_STATUS_NOT_SUPPORTED, "cublasLtMatmul: data types (fp32 or bf16 only)");
  if (d->epilogue == CUBLASLT_EPILOGUE_BIAS && !d->bias)
    return refuse(CUBLAS_STATUS_INVALID_VALUE, "cublasLtMatmul: EPILOGUE_BIAS without a bias");
  if (!valid_stream(stream)) return refuse(CUBLAS_STATUS_INVALID_VALUE, "cublasLtMatmul: stream");
  g.fn = "cublasLtMatmul";
  g.trans_a = d->ta != CUBLAS_OP_N, g.trans_b = d->tb != CUBLAS_OP_N;
  g.m = (int)Dl->rows, g.n = (int)Dl->cols;
  g.k = (int)(d->ta == CUBLAS_OP_N ? Al->cols : Al->rows);
  g.batch = Dl->batch;
  g.a = {A, ea, (int)Al->ld, Al->stride};
  g.b = {B, eb, (int)Bl->ld, Bl->stride};
  g.c = {C, ec, (int)Cl->ld, Cl->stride};
  g.d = {D, ed, (int)Dl->ld, Dl->stride};
  std::memcpy(&g.alpha, alpha, 4);
  std::memcpy(&g.beta, beta, 4);
  g.round = d->compute == CUBLAS_COMPUTE_32F_FAST_TF32   ? gemm_round::tf32
            : d->compute == CUBLAS_COMPUTE_32F_FAST_16BF ? gemm_round::bf16
                                                         : gemm_round::none;
  if (ea != gemm_elem::f32) g.round = gemm_round::none;
  if (d->epilogue == CUBLASLT_EPILOGUE_BIAS) g.bias = d->bias, g.bias_type = ebias;
  gemm_check_extents(g);
  submit(stream, "cublasLtMatmul", [g] { gemm_run(g); });
  return CUBLAS_STATUS_SUCCESS;
}

}  // extern "C"
