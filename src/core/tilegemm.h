/* The small matrix products of the attention tiles (a 64-row query tile against a few hundred
 * keys, depth d = 64) and of the linear layers' 64 × 64 blocks (nn/layers.c), row-major like
 * cblas_sgemm. OpenBLAS packs both operands on every call and
 * runs such products at 45–65 % of its large-matrix rate; libxsmm (Debian's libxsmm-dev) generates
 * a kernel for each shape at run time and reads the operands in place (docs/perf.md, "The
 * attention tiles"). Where fmattn was built without libxsmm, or libxsmm has no kernel for a call
 * (op(B) transposed, an alpha other than 1 with beta 1, a beta other than 0 or 1), the call goes
 * to cblas_sgemm. */
#ifndef FMATTN_TILEGEMM_H
#define FMATTN_TILEGEMM_H

#include <stdbool.h>

#ifdef __cplusplus
extern "C" {
#endif

/* C (M, N) = alpha·op(A)·op(B) + beta·C, row-major; op(A) = Aᵀ when ta (A stored (K, M)), op(B) =
 * Bᵀ when tb (B stored (N, K)). */
void tile_sgemm(bool ta, bool tb, int M, int N, int K, float alpha, const float *A, int lda,
                const float *B, int ldb, float beta, float *C, int ldc);

/* out (cols, rows) = inᵀ, in (rows, cols); leading dimensions ldi, ldo. */
void tile_transpose(long rows, long cols, const float *in, long ldi, float *out, long ldo);

/* Which kernels tile_sgemm runs: "libxsmm <version> (<its target>)", or "blas" (fmattn built
 * without libxsmm, or FMATTN_TILE_GEMM=blas in the environment: the comparison's switch). */
const char *tile_gemm_kernels(void);

/* Run the products on libxsmm (true) or on CBLAS (false) from now on, whatever FMATTN_TILE_GEMM
 * said; false where libxsmm was asked for in a build without it (the products then run on CBLAS).
 * The tests run both kernels in one program. Not inside a parallel region. */
bool tile_gemm_select(bool xsmm);

/* Whether the products run on libxsmm now (tile_gemm_kernels' choice, as a flag). */
bool tile_gemm_xsmm(void);

#ifdef __cplusplus
}
#endif

#endif
