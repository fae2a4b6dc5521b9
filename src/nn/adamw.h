/* The optimizer's element-wise kernels on the CPU, below both the optimizer (which drives them
 * through a back end's table) and the back ends (which hold them): one AdamW step's scalars, the
 * AdamW update of one tensor, and the Σ x² of the gradient norm. gpu/optimizer.cu is the GPU's
 * twin. */
#ifndef FMATTN_ADAMW_H
#define FMATTN_ADAMW_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* One AdamW step's scalars (optimizer.c): lr already times the tensor's lr_scale; bc1, bc2 the
 * bias corrections 1 − β1ᵗ, 1 − β2ᵗ; grad_scale the clipping factor. */
struct adamw_step {
  float lr, wd, beta1, beta2, eps, bc1, bc2, grad_scale;
};

/* Σ x² over total floats in double (256 fixed chunks, so the sum does not depend on the thread
 * count). */
double adamw_cpu_sum_squares(const float *x, size_t total);
/* AdamW with decoupled weight decay on one tensor of n floats: w, m, v updated from g. */
void adamw_cpu(float *w, const float *g, float *m, float *v, size_t n, const struct adamw_step *s);

#ifdef __cplusplus
}
#endif

#endif
