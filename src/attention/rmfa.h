/* Random Maclaurin features of `rmfa` (SPEC §6.8), exposed to the tests: the feature map of one
 * layer, built from the layer's stored degrees and Rademacher vectors, and the Maclaurin
 * coefficients of the kernels it estimates. Internal to src/attention/ otherwise. */
#ifndef FMATTN_ATTENTION_RMFA_H
#define FMATTN_ATTENTION_RMFA_H

#include <stdbool.h>

#include "attention/kernelized.h"
#include "deck/config.h"

#define RMFA_MAX_DEGREE 20

enum rmfa_kernel { RMFA_EXP, RMFA_INV, RMFA_LOG, RMFA_TRIGH, RMFA_SQRT };

/* The features of one layer: Φ(x) (D) = [√a0, c_j Π_{t<N_j} ω_{j,t}ᵀx for j = 1 .. D−1] with
 * x the ppSBN-normalised row over d^¼ (or the raw row over d^¼ without ppSBN). */
struct rmfa_features {
  int D, d;
  bool ppsbn;
  float scale;        /* d^−¼ */
  int rows;           /* Σ_j N_j: rows of omega */
  int *degree;        /* (D) N_j, degree[0] = 0 (the constant feature) */
  int *offset;        /* (D) first row of feature j in omega */
  float *coef;        /* (D) coef[0] = √a0, coef[j] = √(a_N/P(N)) / √(D − 1) */
  const float *omega; /* (rows, d) ±1 */
};

enum rmfa_kernel rmfa_kernel_parse(const char *name);
/* Maclaurin coefficient a_N of a kernel (N = 0 .. RMFA_MAX_DEGREE). */
double rmfa_coefficient(enum rmfa_kernel kernel, int N);

/* What rmfa reads of the deck, once per context (its setup) or per deck-level call: the
 * attention.rmfa.* keys and run.seed. */
struct rmfa_options {
  int features;            /* rmfa.features: D */
  enum rmfa_kernel kernel; /* rmfa.kernel */
  bool ppsbn;              /* rmfa.ppsbn: the learned per-channel scale gamma */
  int omega_rows;          /* rows of omega: rmfa.omega_rows, or Σ N_j of the seed's degrees */
  uint64_t seed;           /* run.seed: the degrees' and omega's draws */
};
struct rmfa_options rmfa_options_read(const struct config *cfg);

/* The features of one layer from its parameter block (as attention_params_make or the model lay
 * it out). Checks the stored degrees (a corrupt checkpoint is an error). */
void rmfa_features_open(struct rmfa_features *rf, const struct rmfa_options *o, const float *params,
                        int d);
void rmfa_features_close(struct rmfa_features *rf);
/* The kernelized.c map of these features. */
struct kz_map rmfa_map(const struct rmfa_features *rf);

#endif
