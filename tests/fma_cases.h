/* Helpers shared by the FMA test programs (test_fma_oracle.c, test_fma.c): the names of the
 * downsampling modes, random oracle parameters of a sensible size, and the check that the mean
 * initialisation gives exactly the avg summaries. Test code only. */
#ifndef FMATTN_FMA_CASES_H
#define FMATTN_FMA_CASES_H

#include "fma_oracle.h"
#include "testutil.h"

static const char *const down_name[] = {"conv", "m2m", "avg"};

/* Random parameters of a size that keeps summaries O(1): weight ~ N(0, 1/taps), bias ~ N(0, 0.1).
 */
static inline void random_params(const struct fo_cfg *c, struct fo_params *P, uint64_t key) {
  for (int l = 1; l <= c->levels; l++) {
    if (!P->weight[l]) continue;
    tu_randn_d(P->weight[l], (size_t)fo_weight_len(c, l), key * 100 + 2 * l,
               1.0 / sqrt((double)fo_weight_taps(c, l)));
    tu_randn_d(P->bias[l], (size_t)fo_bias_len(c, l), key * 100 + 2 * l + 1, 0.3);
  }
}

/* Summaries of `fo_params_init_mean` equal the fixed avg ones (conv and m2m, every level). */
static inline void check_summaries_are_avg(const struct fo_cfg *c, const struct fo_params *P,
                                           const double *x, double tol, const char *what) {
  struct fo_cfg ca = *c;
  ca.down = FO_AVG;
  double *S[FO_MAX_LEVELS + 1], *A[FO_MAX_LEVELS + 1];
  fo_summaries_alloc(c, S);
  fo_summaries_alloc(c, A);
  fo_summaries_forward(c, S, x, P);
  fo_summaries_forward(&ca, A, x, NULL);
  for (int l = 1; l <= c->levels; l++) {
    char msg[300];
    snprintf(msg, sizeof msg, "%s: level %d summaries of the mean init vs avg", what, l);
    TU_ASSERT_CLOSE(tu_rel_err_dd(S[l], A[l], fo_rows(c, l) * c->d), tol, msg);
  }
  fo_summaries_free(c, S);
  fo_summaries_free(c, A);
}

#endif
