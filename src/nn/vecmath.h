/* Vector math from glibc's libmvec. glibc ships SIMD variants of expf, tanhf, logf, but its
 * <math.h> announces them only under -ffast-math; we announce the ones we use here so that
 * `#pragma omp simd` loops vectorise while keeping IEEE semantics elsewhere (exp(-inf) = 0,
 * NaN propagates). Without glibc on x86-64 the loops simply stay scalar. */
#ifndef FMATTN_VECMATH_H
#define FMATTN_VECMATH_H

#include <math.h>

#if defined(__x86_64__) && defined(__GLIBC__) && defined(HAVE_LIBMVEC)
extern float expf(float) __attribute__((__simd__("notinbranch")));
extern float tanhf(float) __attribute__((__simd__("notinbranch")));
extern float logf(float) __attribute__((__simd__("notinbranch")));
#endif

#endif
