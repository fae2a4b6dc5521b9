/* The feature maps of `linear` and of fmmformer's far field (SPEC §6.3, §6.6), as kernelized.c
 * maps: elu (elu(x) + 1), elu_neg (elu(−x) + 1) and tanh (tanh(x) + 1), element by element, so
 * F = d. Internal to src/attention/. */
#ifndef FMATTN_ATTENTION_LINEAR_H
#define FMATTN_ATTENTION_LINEAR_H

#include "attention/kernelized.h"

enum linear_kernel { LINEAR_ELU, LINEAR_ELU_NEG, LINEAR_TANH, LINEAR_NKERNELS };

/* The map of one kernel on rows of d floats. */
struct kz_map linear_map(enum linear_kernel kind, int d);
/* The kernels of a comma list (fmmformer.kernels, already validated by the deck): their count. */
int linear_kernels_parse(const char *list, enum linear_kernel *out);

#endif
