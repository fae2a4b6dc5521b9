/* The CPU optimizer kernels (adamw.h). */
#include "nn/adamw.h"

#include <math.h>

double adamw_cpu_sum_squares(const float *x, size_t total) {
  enum { CHUNKS = 256 };
  double part[CHUNKS] = {0};
#pragma omp parallel for schedule(static)
  for (int c = 0; c < CHUNKS; c++) {
    size_t lo = total * (size_t)c / CHUNKS, hi = total * (size_t)(c + 1) / CHUNKS;
    double s = 0.0;
    for (size_t i = lo; i < hi; i++) s += (double)x[i] * x[i];
    part[c] = s;
  }
  double s = 0.0;
  for (int c = 0; c < CHUNKS; c++) s += part[c];
  return s;
}

void adamw_cpu(float *w, const float *g, float *m, float *v, size_t n, const struct adamw_step *s) {
  const float b1 = s->beta1, b2 = s->beta2, eps = s->eps, bc1 = s->bc1, bc2 = s->bc2;
  const float plr = s->lr, wd = s->wd, grad_scale = s->grad_scale;
  const long count = (long)n;
#pragma omp parallel for simd schedule(static) if (count > 65536)
  for (long e = 0; e < count; e++) {
    float grad = g[e] * grad_scale;
    m[e] = b1 * m[e] + (1.0f - b1) * grad;
    v[e] = b2 * v[e] + (1.0f - b2) * grad * grad;
    float mhat = m[e] / bc1, vhat = v[e] / bc2;
    w[e] -= plr * (mhat / (sqrtf(vhat) + eps) + wd * w[e]);
  }
}
