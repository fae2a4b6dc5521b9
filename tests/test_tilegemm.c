/* The attention tiles' products (src/core/tilegemm.h) against a product in double precision: every
 * transpose, alpha and beta the callers use and some they do not (those go to CBLAS), shapes of
 * the tile loops and ragged ones, leading dimensions wider than the rows, a NaN in C where beta is
 * 0, and the columns past N untouched; the transpose; and where fmattn was built with libxsmm,
 * that libxsmm runs them. */
#include "testutil.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../src/core/tilegemm.h"

static void check_product(bool ta, bool tb, int M, int N, int K, float alpha, float beta) {
  const int pad = 3, lda = (ta ? M : K) + pad, ldb = (tb ? K : N) + pad, ldc = N + pad;
  const int arows = ta ? K : M, brows = tb ? N : K;
  float *A = malloc(sizeof(float) * (size_t)arows * lda),
        *B = malloc(sizeof(float) * (size_t)brows * ldb),
        *C = malloc(sizeof(float) * (size_t)M * ldc), *C0 = malloc(sizeof(float) * (size_t)M * ldc);
  tu_randn(A, (long)arows * lda, 11, 1.0f);
  tu_randn(B, (long)brows * ldb, 12, 1.0f);
  tu_randn(C0, (long)M * ldc, 13, 1.0f);
  if (beta == 0.0f) C0[0] = NAN; /* beta = 0: C is not read */
  memcpy(C, C0, sizeof(float) * (size_t)M * ldc);
  tile_sgemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  double worst = 0.0;
  for (int i = 0; i < M; i++)
    for (int j = 0; j < ldc; j++) {
      const float got = C[(long)i * ldc + j];
      if (j >= N) { /* past the product's columns: untouched */
        if (memcmp(&got, &C0[(long)i * ldc + j], sizeof got) != 0)
          fail_msg("ta %d tb %d %dx%dx%d: C[%d][%d] past N was written", ta, tb, M, N, K, i, j);
        continue;
      }
      double ref = 0.0, mag = 0.0;
      for (int k = 0; k < K; k++) {
        const double a = ta ? A[(long)k * lda + i] : A[(long)i * lda + k];
        const double b = tb ? B[(long)j * ldb + k] : B[(long)k * ldb + j];
        ref += a * b;
        mag += fabs(a * b);
      }
      ref *= alpha;
      mag *= fabs(alpha);
      if (beta != 0.0f) ref += beta * (double)C0[(long)i * ldc + j];
      const double err = fabs(got - ref) / (mag + 1.0);
      if (!(err <= worst)) worst = isnan(err) ? INFINITY : err;
    }
  /* float accumulation over K terms: a few ulps of the sum of magnitudes */
  if (!(worst <= 4e-7 * (K + 8)))
    fail_msg("ta %d tb %d %dx%dx%d alpha %g beta %g: error %.3e of the magnitudes", ta, tb, M, N, K,
             alpha, beta, worst);
  free(A);
  free(B);
  free(C);
  free(C0);
}

static void test_products(void **state) {
  static const int shapes[][3] = {{64, 512, 64}, {64, 64, 512}, {512, 64, 64}, {37, 19, 64},
                                  {64, 100, 16}, {1, 5, 3},     {16, 16, 1}};
  static const float alphas[] = {1.0f, 0.125f, -0.7f}, betas[] = {0.0f, 1.0f, 0.5f};
  for (int s = 0; s < (int)(sizeof shapes / sizeof shapes[0]); s++)
    for (int t = 0; t < 4; t++)
      for (int a = 0; a < 3; a++)
        for (int b = 0; b < 3; b++)
          check_product(t & 1, t & 2, shapes[s][0], shapes[s][1], shapes[s][2], alphas[a],
                        betas[b]);
}

static void test_transpose(void **state) {
  static const long shapes[][2] = {{512, 64}, {37, 19}, {1, 33}, {70, 1}};
  for (int s = 0; s < 4; s++) {
    const long rows = shapes[s][0], cols = shapes[s][1], ldi = cols + 2, ldo = rows + 5;
    float *in = malloc(sizeof(float) * (size_t)(rows * ldi)),
          *out = malloc(sizeof(float) * (size_t)(cols * ldo));
    tu_randn(in, rows * ldi, 21, 1.0f);
    for (long i = 0; i < cols * ldo; i++) out[i] = -1.0f;
    tile_transpose(rows, cols, in, ldi, out, ldo);
    for (long c = 0; c < cols; c++)
      for (long r = 0; r < ldo; r++) {
        const float want = r < rows ? in[r * ldi + c] : -1.0f;
        if (out[c * ldo + r] != want)
          fail_msg("%ldx%ld: out[%ld][%ld] = %g, expected %g", rows, cols, c, r, out[c * ldo + r],
                   want);
      }
    free(in);
    free(out);
  }
}

/* Built with libxsmm, the products run on it (unless FMATTN_TILE_GEMM=blas): a build that lost it
 * silently would pass the products above on CBLAS. */
static void test_kernels(void **state) {
  const char *k = tile_gemm_kernels(), *env = getenv("FMATTN_TILE_GEMM");
#ifdef HAVE_LIBXSMM
  const bool want_xsmm = !(env && strcmp(env, "blas") == 0);
#else
  const bool want_xsmm = false;
#endif
  if (want_xsmm != (strncmp(k, "libxsmm ", 8) == 0))
    fail_msg("the tiles run on \"%s\"; expected %s", k, want_xsmm ? "libxsmm" : "blas");
}

static const struct CMUnitTest tests[] = {
    cmocka_unit_test(test_products),
    cmocka_unit_test(test_transpose),
    cmocka_unit_test(test_kernels),
};

TU_MAIN(tests)
