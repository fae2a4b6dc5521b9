/* The attention tiles' products (tilegemm.h): libxsmm's generated kernels where it has one, else
 * cblas_sgemm. libxsmm is column-major: the row-major C = op(A)·op(B) is the column-major
 * Cᵀ = op(B)ᵀ·op(A)ᵀ, so B is its first operand and A its second, and a transposed A is its
 * TRANS_B. Its version 1.17 generates no kernel for a transposed first operand (our tb), and takes
 * alpha = 1 only: an alpha other than 1 is applied to C afterwards, where beta = 0. */
#include "core/tilegemm.h"

#include <cblas.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef HAVE_LIBXSMM
#include <libxsmm.h>
#endif

static int use_xsmm = -1; /* -1: not decided yet */
static char kernels[96];

/* the kernels from now on: libxsmm where asked for and built with it, else CBLAS */
static bool choose(bool xsmm) {
#ifdef HAVE_LIBXSMM
  if (xsmm) {
    libxsmm_init();
    snprintf(kernels, sizeof kernels, "libxsmm %d.%d (%s)", LIBXSMM_VERSION_MAJOR,
             LIBXSMM_VERSION_MINOR, libxsmm_get_target_arch());
#pragma omp atomic write
    use_xsmm = 1;
    return true;
  }
#endif
  snprintf(kernels, sizeof kernels, "blas");
#pragma omp atomic write
  use_xsmm = 0;
  return !xsmm;
}

const char *tile_gemm_kernels(void) {
  int u;
#pragma omp atomic read
  u = use_xsmm;
  if (u < 0) {
#pragma omp critical(tile_gemm_decide)
    if (use_xsmm < 0) {
      const char *env = getenv("FMATTN_TILE_GEMM");
      choose(!(env && strcmp(env, "blas") == 0));
    }
  }
  return kernels;
}

bool tile_gemm_select(bool xsmm) { return choose(xsmm); }

bool tile_gemm_xsmm(void) {
  tile_gemm_kernels();
  int u;
#pragma omp atomic read
  u = use_xsmm;
  return u == 1;
}

#ifdef HAVE_LIBXSMM
/* libxsmm's kernel for the call, or false where it has none. */
static bool xsmm_gemm(bool ta, bool tb, int M, int N, int K, float alpha, const float *A, int lda,
                      const float *B, int ldb, float beta, float *C, int ldc) {
  if (tb || !(beta == 0.0f || beta == 1.0f) || (alpha != 1.0f && beta != 0.0f)) return false;
  /* the thread's last kernels, by shape (64 slots: the linear layers' and the tiles'): libxsmm's
   * own lookup costs about 7 % of a 64³ product */
  static _Thread_local struct {
    int key[7];
    libxsmm_smmfunction f;
  } cache[64];
  const int key[7] = {ta, M, N, K, lda, ldb, ldc + (beta != 0.0f ? 1 << 30 : 0)};
  unsigned h = 0;
  for (int i = 0; i < 7; i++) h = h * 31u + (unsigned)key[i];
  const unsigned slot = (h ^ h >> 7) % 64u;
  libxsmm_smmfunction f = cache[slot].f;
  if (!f || memcmp(cache[slot].key, key, sizeof key) != 0) {
    const int flags = ta ? LIBXSMM_GEMM_FLAG_TRANS_B : LIBXSMM_GEMM_FLAG_NONE;
    const libxsmm_blasint m = N, n = M, k = K, la = ldb, lb = lda, lc = ldc;
    const float one = 1.0f;
    f = libxsmm_smmdispatch(m, n, k, &la, &lb, &lc, &one, &beta, &flags, NULL);
    if (!f) return false;
    memcpy(cache[slot].key, key, sizeof key);
    cache[slot].f = f;
  }
  f(B, A, C);
  if (alpha != 1.0f)
    for (int i = 0; i < M; i++) {
      float *c = C + (long)i * ldc;
#pragma omp simd
      for (int j = 0; j < N; j++) c[j] *= alpha;
    }
  return true;
}
#endif

void tile_sgemm(bool ta, bool tb, int M, int N, int K, float alpha, const float *A, int lda,
                const float *B, int ldb, float beta, float *C, int ldc) {
  if (M <= 0 || N <= 0) return;
#ifdef HAVE_LIBXSMM
  int u;
#pragma omp atomic read
  u = use_xsmm;
  if (u < 0) {
    tile_gemm_kernels();
    u = use_xsmm;
  }
  if (u && K > 0 && xsmm_gemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc)) return;
#endif
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, M, N,
              K, alpha, A, lda, B, ldb, beta, C, ldc);
}

void tile_transpose(long rows, long cols, const float *in, long ldi, float *out, long ldo) {
  enum { B = 16 }; /* blocks of B × B: both sides' lines stay in L1 */
  for (long r0 = 0; r0 < rows; r0 += B)
    for (long c0 = 0; c0 < cols; c0 += B) {
      const long r1 = r0 + B < rows ? r0 + B : rows, c1 = c0 + B < cols ? c0 + B : cols;
      for (long c = c0; c < c1; c++) {
        float *o = out + c * ldo;
#pragma omp simd
        for (long r = r0; r < r1; r++) o[r] = in[r * ldi + c];
      }
    }
}
