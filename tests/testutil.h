/* Helpers shared by the cmocka unit tests: deterministic random tensors, float/double
 * conversions, relative-error comparison with a readable failure message, and the cmocka +
 * MPI boilerplate (TAP output so the harness counts each test). Test code only. */
#ifndef FMATTN_TESTUTIL_H
#define FMATTN_TESTUTIL_H

#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <mpi.h>

#include "../src/rng.h"

/* x[i] = scale · N(0, 1), keyed by `key`. */
static inline void tu_randn(float *x, size_t n, uint64_t key, float scale) {
  for (size_t i = 0; i < n; i++) x[i] = scale * (float)rng_normal(99, RNG_TEST, key, i, 0);
}

static inline void tu_randn_d(double *x, size_t n, uint64_t key, double scale) {
  for (size_t i = 0; i < n; i++) x[i] = scale * rng_normal(99, RNG_TEST, key, i, 0);
}

static inline double *tu_to_double(const float *x, size_t n) {
  double *y = malloc(sizeof(double) * (n ? n : 1));
  for (size_t i = 0; i < n; i++) y[i] = x[i];
  return y;
}

static inline float *tu_to_float(const double *x, size_t n) {
  float *y = malloc(sizeof(float) * (n ? n : 1));
  for (size_t i = 0; i < n; i++) y[i] = (float)x[i];
  return y;
}

/* max_i |a_i − b_i| / (max_i |b_i| + tiny): a relative error that is not fooled by entries
 * near zero. */
static inline double tu_rel_err(const float *a, const double *b, size_t n) {
  double num = 0.0, den = 1e-30;
  for (size_t i = 0; i < n; i++) {
    double d = fabs((double)a[i] - b[i]);
    if (!(d <= num)) num = d; /* NaN propagates */
    if (fabs(b[i]) > den) den = fabs(b[i]);
  }
  return num / den;
}

static inline double tu_rel_err_dd(const double *a, const double *b, size_t n) {
  double num = 0.0, den = 1e-30;
  for (size_t i = 0; i < n; i++) {
    double d = fabs(a[i] - b[i]);
    if (!(d <= num)) num = d;
    if (fabs(b[i]) > den) den = fabs(b[i]);
  }
  return num / den;
}

/* Fail with the measured error when it exceeds tol. */
#define TU_ASSERT_CLOSE(err, tol, what)                                               \
  do {                                                                                \
    double tu_e_ = (err);                                                             \
    if (!(tu_e_ <= (tol)))                                                            \
      fail_msg("%s: relative error %.3e exceeds %.1e", (what), tu_e_, (double)(tol)); \
  } while (0)

/* Central finite difference of a scalar function of x[i] (double), step h. */
#define TU_FD(result, x, i, h, expr)        \
  do {                                      \
    double tu_s_ = (x)[i];                  \
    (x)[i] = tu_s_ + (h);                   \
    double tu_p_ = (expr);                  \
    (x)[i] = tu_s_ - (h);                   \
    double tu_m_ = (expr);                  \
    (x)[i] = tu_s_;                         \
    (result) = (tu_p_ - tu_m_) / (2 * (h)); \
  } while (0)

/* main() for a cmocka test program that links MPI. */
#define TU_MAIN(tests)                                      \
  int main(int argc, char **argv) {                         \
    MPI_Init(&argc, &argv);                                 \
    cmocka_set_message_output(CM_OUTPUT_TAP);               \
    int tu_rc_ = cmocka_run_group_tests(tests, NULL, NULL); \
    MPI_Finalize();                                         \
    return tu_rc_;                                          \
  }

#endif
