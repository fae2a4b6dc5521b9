/* An independent double-precision reference of Fast Multipole Attention (SPEC §6.4 fma, §6.5
 * fma_linear), one head at a time, written from the SPEC text alone so the tests can hold the
 * production float kernels to it. It shares no code with src/: it even derives its own
 * interaction lists (a test compares them with fma_lists). Clarity over speed; test code only,
 * never linked into the program. */
#ifndef FMATTN_FMA_ORACLE_H
#define FMATTN_FMA_ORACLE_H

#include <stdbool.h>
#include <stddef.h>

#define FO_MAX_LEVELS 24
#define FO_LIST_MAX   3

enum fo_down { FO_CONV, FO_M2M, FO_AVG };

struct fo_cfg {
  long n;                    /* sequence length; n/m a power of two >= 2 */
  long d;                    /* head size */
  int m;                     /* fine block */
  int p;                     /* summaries per window (divides m) */
  int levels;                /* L = log2(n/m) − 1 */
  long w[FO_MAX_LEVELS + 1]; /* w[l] = m·2^(l−1) for l = 1..L; w[0] = m */
  enum fo_down down;
  bool causal;
  bool multiplicity; /* fma: + log(w_l/p) on coarse scores */
  bool unshifted;    /* fma_linear causal only: use ρ_l(i), NOT ρ_l(i) − 1 (deliberately wrong:
                        the causality test shows it would catch this) */
};

/* One summary operator (k_down, v_down or q_down): per level l = 1..L a weight and a bias, in the
 * storage layout of SPEC §6.4 (row-major, weight[f][r][t] at f·p·w + r·w + t). NULL for avg. */
struct fo_params {
  double *weight[FO_MAX_LEVELS + 1]; /* conv (d, p, w_l); m2m l = 1 (d, p, m), l >= 2 (d, p, 2p) */
  double *bias[FO_MAX_LEVELS + 1];   /* (d, p) */
};

/* Fill the sizes; aborts on an n, m, p that fma does not accept. */
void fo_cfg_init(struct fo_cfg *c, long n, long d, int m, int p, enum fo_down down, bool causal,
                 bool multiplicity);
/* Floats of level l's weight and bias (0 for avg). */
long fo_weight_len(const struct fo_cfg *c, int l);
long fo_bias_len(const struct fo_cfg *c, int l);
/* Window length that level l's weight spans in its last axis (conv w_l; m2m m or 2p). */
long fo_weight_taps(const struct fo_cfg *c, int l);
/* Rows of level l's summaries: (n / w_l)·p. */
long fo_rows(const struct fo_cfg *c, int l);

/* Zeroed parameters (nothing for avg); free with fo_params_free. */
void fo_params_alloc(const struct fo_cfg *c, struct fo_params *P);
void fo_params_free(const struct fo_cfg *c, struct fo_params *P);
/* The `fma.init = mean` values: each learned summary equals the avg one, bias 0. */
void fo_params_init_mean(const struct fo_cfg *c, struct fo_params *P);
/* Every parameter as one flat sequence (level 1 weight, level 1 bias, level 2 weight, ...):
 * count, and the address of element idx (for finite-difference loops). */
size_t fo_params_count(const struct fo_cfg *c);
double *fo_params_at(const struct fo_cfg *c, struct fo_params *P, size_t idx);

/* Interaction lists from the SPEC text: near blocks of fine block b, level-l windows of a query in
 * window cw, in increasing order, existing ones only; band of (i, j): 0 near, l level, −1 none. */
int fo_near(const struct fo_cfg *c, long b, long *blocks);
int fo_level(const struct fo_cfg *c, int l, long cw, long *windows);
int fo_band(const struct fo_cfg *c, long i, long j);

/* Summaries S[l] (fo_rows(l), d), l = 1..L, of x (n, d) by the downsample scheme. */
void fo_summaries_alloc(const struct fo_cfg *c, double *S[FO_MAX_LEVELS + 1]);
void fo_summaries_free(const struct fo_cfg *c, double *S[FO_MAX_LEVELS + 1]);
void fo_summaries_forward(const struct fo_cfg *c, double *const S[FO_MAX_LEVELS + 1],
                          const double *x, const struct fo_params *P);
/* dx (n, d) += and dP += the gradients for dS (all levels, not modified). dP may be NULL. */
void fo_summaries_backward(const struct fo_cfg *c, double *dx, struct fo_params *dP,
                           double *const dS[FO_MAX_LEVELS + 1], const double *x,
                           const struct fo_params *P);

/* fma in summary form: one softmax per query over its near keys and the coarse keys of every
 * level's listed windows. out (n, d); when dout is non-NULL, dq, dk, dv (n, d) and dkp, dvp (may
 * be NULL for avg) ACCUMULATE (+=) the exact gradients of Σ dout·out. */
void fo_fma(const struct fo_cfg *c, double *out, double *dq, double *dk, double *dv,
            struct fo_params *dkp, struct fo_params *dvp, const double *q, const double *k,
            const double *v, const struct fo_params *kp, const struct fo_params *vp,
            const double *dout);

/* fma by the dense equivalent of SPEC §6.4: the n×n matrix C̃ (near q_i·k_j, level q_i·K_l[row
 * of j], the rest masked), softmax(C̃/√d), times the per-query value rows. Multiplicity is
 * implicit (each coarse column repeats w_l/p times), so it matches fo_fma with multiplicity on. */
void fo_fma_dense(const struct fo_cfg *c, double *out, const double *q, const double *k,
                  const double *v, const struct fo_params *kp, const struct fo_params *vp);

/* fma_linear (SPEC §6.5): near softmax plus, per level, a softmax of its own for the query
 * summary Q_l[ρ_l(i)] (ρ_l(i) − 1 when causal) over the level's listed coarse keys. Gradients as
 * fo_fma, with dqp for the q_down parameters. */
void fo_fma_linear(const struct fo_cfg *c, double *out, double *dq, double *dk, double *dv,
                   struct fo_params *dqp, struct fo_params *dkp, struct fo_params *dvp,
                   const double *q, const double *k, const double *v, const struct fo_params *qp,
                   const struct fo_params *kp, const struct fo_params *vp, const double *dout);

/* Row of Q_l that query i uses at level l (−1 when the causal shift leaves none). */
long fo_linear_query_row(const struct fo_cfg *c, int l, long i);

#endif
