// The GEMM engine behind the emulated cuBLAS and cuBLASLt: D = alpha·op(A)·op(B) + beta·C (+ bias)
// by OpenBLAS's sgemm in fp32. fp32 operands go to OpenBLAS in place; bf16 operands (and fp32
// ones rounded to TF32 or bf16) are converted exactly into packed fp32 copies first, and a bf16
// output is rounded to nearest even once at the end. beta = 0 never reads C, as in cuBLAS.
#include <cblas.h>

#include <cstring>
#include <vector>

#include "core.h"
#include "gemm.h"
#include "include/cuda_bf16.h"

namespace cudaemu {
namespace {

size_t elem_size(gemm_elem e) { return e == gemm_elem::f32 ? 4 : 2; }

float round_input(float x, gemm_round r) {
  if (r == gemm_round::bf16) return bf16_to_float(float_to_bf16_rn(x));
  if (r == gemm_round::tf32) {  // 10 explicit significand bits, nearest even
    uint32_t u;
    std::memcpy(&u, &x, 4);
    if ((u & 0x7f800000u) != 0x7f800000u) u = (u + 0xfffu + ((u >> 13) & 1u)) & 0xffffe000u;
    std::memcpy(&x, &u, 4);
  }
  return x;
}

float load(const void *p, gemm_elem e, size_t i) {
  if (e == gemm_elem::f32) return static_cast<const float *>(p)[i];
  return bf16_to_float(static_cast<const uint16_t *>(p)[i]);
}

// A rows x cols matrix (leading dimension ld) as packed fp32, rounded as asked.
std::vector<float> packed(const void *p, gemm_elem e, int rows, int cols, int ld, gemm_round r) {
  std::vector<float> out((size_t)rows * cols);
  for (int j = 0; j < cols; j++)
    for (int i = 0; i < rows; i++)
      out[(size_t)j * rows + i] = round_input(load(p, e, (size_t)j * ld + i), r);
  return out;
}

const char *offset(const void *p, gemm_elem e, long long elems) {
  return static_cast<const char *>(p) + elems * (long long)elem_size(e);
}

void check_one(const char *fn, const char *what, const void *p, gemm_elem e, int rows, int cols,
               int ld, long long stride, int batch) {
  if (rows == 0 || cols == 0 || batch == 0) return;
  const long long span = ((long long)cols - 1) * ld + rows;
  const long long lo = stride < 0 ? stride * (batch - 1) : 0;
  const long long hi = span + (stride > 0 ? stride * (batch - 1) : 0);
  const char *first = offset(p, e, lo);
  const size_t bytes = (size_t)(hi - lo) * elem_size(e);
  if (!device_range(first, bytes, true))
    fatal(
        "%s: %s (%d x %d, ld %d%s) spans %zu bytes from %p, which is not inside one device "
        "allocation: %s. On the GPU the GEMM faults (cudaErrorIllegalAddress)",
        fn, what, rows, cols, ld, batch > 1 ? ", batched" : "", bytes, (const void *)first,
        describe_address(first + bytes - 1).c_str());
}

void one_gemm(const gemm_call &g, const void *A, const void *B, const void *C, void *D, float alpha,
              float beta) {
  const int m = g.m, n = g.n, k = g.k;
  const gemm_matrix &dm = g.d.p ? g.d : g.c;
  const bool direct = !g.d.p && g.c.type == gemm_elem::f32 && !g.bias;
  // the output in fp32: C itself when it can be, else a packed copy
  std::vector<float> work;
  float *W = static_cast<float *>(D);
  int ldw = g.c.ld;
  if (!direct) {
    work.assign((size_t)m * n, 0.0f);
    if (beta != 0.0f) work = packed(C, g.c.type, m, n, g.c.ld, gemm_round::none);
    W = work.data();
    ldw = m;
  } else if (beta == 0.0f) {
    for (int j = 0; j < n; j++) std::memset(W + (size_t)j * ldw, 0, sizeof(float) * (size_t)m);
  }
  if (k > 0 && alpha != 0.0f) {
    const int ra = g.trans_a ? k : m, ca = g.trans_a ? m : k;
    const int rb = g.trans_b ? n : k, cb = g.trans_b ? k : n;
    std::vector<float> pa, pb;
    const float *a = static_cast<const float *>(A), *b = static_cast<const float *>(B);
    int lda = g.a.ld, ldb = g.b.ld;
    if (g.a.type != gemm_elem::f32 || g.round != gemm_round::none)
      pa = packed(A, g.a.type, ra, ca, g.a.ld, g.round), a = pa.data(), lda = ra;
    if (g.b.type != gemm_elem::f32 || g.round != gemm_round::none)
      pb = packed(B, g.b.type, rb, cb, g.b.ld, g.round), b = pb.data(), ldb = rb;
    cblas_sgemm(CblasColMajor, g.trans_a ? CblasTrans : CblasNoTrans,
                g.trans_b ? CblasTrans : CblasNoTrans, m, n, k, alpha, a, lda, b, ldb,
                beta == 0.0f ? 0.0f : beta, W, ldw);
  } else if (beta != 0.0f && beta != 1.0f) {
    for (int j = 0; j < n; j++)
      for (int i = 0; i < m; i++) W[(size_t)j * ldw + i] *= beta;
  }
  if (direct) return;
  for (int j = 0; j < n; j++)
    for (int i = 0; i < m; i++) {
      float x = W[(size_t)j * m + i];
      if (g.bias) x += load(g.bias, g.bias_type, (size_t)i);
      const size_t at = (size_t)j * dm.ld + i;
      if (dm.type == gemm_elem::f32)
        static_cast<float *>(D)[at] = x;
      else
        static_cast<uint16_t *>(D)[at] = float_to_bf16_rn(x);
    }
}

}  // namespace

void gemm_check_extents(const gemm_call &g) {
  if (g.a_array) return;  // the pointers live in device memory: checked as they are read
  const bool reads_ab = g.k > 0 && g.m > 0 && g.n > 0;
  if (reads_ab) {
    check_one(g.fn, "A", g.a.p, g.a.type, g.trans_a ? g.k : g.m, g.trans_a ? g.m : g.k, g.a.ld,
              g.a.stride, g.batch);
    check_one(g.fn, "B", g.b.p, g.b.type, g.trans_b ? g.n : g.k, g.trans_b ? g.k : g.n, g.b.ld,
              g.b.stride, g.batch);
  }
  check_one(g.fn, "C", g.c.p, g.c.type, g.m, g.n, g.c.ld, g.c.stride, g.batch);
  if (g.d.p) check_one(g.fn, "D", g.d.p, g.d.type, g.m, g.n, g.d.ld, g.d.stride, g.batch);
  if (g.bias && !device_range(g.bias, elem_size(g.bias_type) * (size_t)g.m, true))
    fatal("%s: the bias vector (%d elements) is not inside one device allocation: %s", g.fn, g.m,
          describe_address(g.bias).c_str());
}

void gemm_run(const gemm_call &g) {
  const float alpha = g.alpha_dev ? *g.alpha_dev : g.alpha;
  const float beta = g.beta_dev ? *g.beta_dev : g.beta;
  if (g.m == 0 || g.n == 0) return;
  for (int e = 0; e < g.batch; e++) {
    const void *A, *B, *C;
    void *D;
    if (g.a_array) {
      A = g.a_array[e], B = g.b_array[e], C = D = g.c_array[e];
      gemm_call one = g;
      one.a_array = nullptr, one.batch = 1;
      one.a.p = A, one.b.p = B, one.c.p = C;
      gemm_check_extents(one);
    } else {
      A = offset(g.a.p, g.a.type, g.a.stride * e);
      B = offset(g.b.p, g.b.type, g.b.stride * e);
      C = offset(g.c.p, g.c.type, g.c.stride * e);
      D = g.d.p ? const_cast<char *>(offset(g.d.p, g.d.type, g.d.stride * e))
                : const_cast<void *>(C);
    }
    one_gemm(g, A, B, C, D, alpha, beta);
  }
}

}  // namespace cudaemu
