/* An independent double-precision reference of Fast Multipole Attention (SPEC §6.4 fma, §6.4a
 * fma with content-based opening, §6.5 fma_linear), one head at a time, written from the SPEC
 * text alone so the tests can hold the production float kernels to it. It shares no code with
 * src/: it even derives its own interaction lists (a test compares them with fma_lists) and its
 * own opening decisions. Clarity over speed; test code only, never linked into the program. */
#ifndef FMATTN_FMA_ORACLE_H
#define FMATTN_FMA_ORACLE_H

#include <stdbool.h>
#include <stddef.h>

#define FO_MAX_LEVELS 24
#define FO_LIST_MAX   3
#define FO_OPEN_ALL   (-1) /* fo_cfg.open: open every candidate (`fma.open = all`) */

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
  int open;          /* fma only, SPEC §6.4a `fma.open`: 0 (fo_cfg_init's default) = §6.4 bit for
                        bit; K > 0 opens the K best candidates per level; FO_OPEN_ALL opens all.
                        Set it after fo_cfg_init. fo_fma_dense and fo_fma_linear refuse open ≠ 0. */
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
 * level's listed windows; with c->open ≠ 0 (SPEC §6.4a, below) over its near keys, the exact keys
 * of its opened level-1 windows and the coarse keys of its unopened candidates, the choice held
 * fixed in the backward. out (n, d); when dout is non-NULL, dq, dk, dv (n, d) and dkp, dvp (may
 * be NULL for avg) ACCUMULATE (+=) the exact gradients of Σ dout·out. */
void fo_fma(const struct fo_cfg *c, double *out, double *dq, double *dk, double *dv,
            struct fo_params *dkp, struct fo_params *dvp, const double *q, const double *k,
            const double *v, const struct fo_params *kp, const struct fo_params *vp,
            const double *dout);

/* ---- fma.open (SPEC §6.4a) ----
 * Query i walks the levels from L down to 1. Its candidates at level l are the windows of its
 * level-l list (fo_level) plus the children 2c, 2c + 1 of every window c it opened at level l + 1.
 * A candidate's score is g = logsumexp over its p rows of q_i·K_l[c·p + r]/√d (+ log(w_l/p) with
 * multiplicity). The c->open candidates of largest g are opened (ties: lower c; FO_OPEN_ALL or
 * open ≥ count: all); an opened level-1 window gives its m exact keys and values instead of its
 * summaries, an unopened candidate gives its p summary rows as in §6.4. */

/* Query i's candidate windows at level l (1..L), given the windows it opened at level l + 1
 * (opened_above, n_above of them; n_above must be 0 at l = L): written to cand in increasing
 * order, count returned. cand needs room for n / w_l windows (every window of the level). */
int fo_open_candidates(const struct fo_cfg *c, long i, int l, const long *opened_above, int n_above,
                       long *cand);
/* The opening score g of level-l window win for the query qi (d): logsumexp over the window's p
 * rows of qi·Kl[win·p + r]/√d + log(w_l/p) (the log term only with multiplicity). Kl = K[l], the
 * level's key summaries (fo_summaries_forward). */
double fo_open_score(const struct fo_cfg *c, const double *qi, const double *Kl, int l, long win);
/* The windows query i (query vector qi) opens at level l, given what it opened at level l + 1:
 * the c->open best of fo_open_candidates by fo_open_score (ties: lower window), or all of them
 * when c->open is FO_OPEN_ALL or at least their count; 0 when c->open is 0. K: the key summaries
 * of every level. Written to opened in increasing order (room for n / w_l), count returned. Walk
 * l = L..1 feeding each level's result to the next to get a query's whole opening. */
int fo_open_choice(const struct fo_cfg *c, long i, const double *qi,
                   double *const K[FO_MAX_LEVELS + 1], int l, const long *opened_above, int n_above,
                   long *opened);

/* Diagnostics of one forward, summed over the queries: softmax mass on exact tokens of opened
 * level-1 windows, on the near field and on summary rows (the three add up to n), and the number
 * of windows opened at each level l (opened[l], l = 1..L; opened[0] unused, 0). */
struct fo_open_stats {
  double open_mass, near_mass, summary_mass;
  double opened[FO_MAX_LEVELS + 1];
};
/* fo_fma's forward (any c->open, 0 included) collecting st (zeroed first); no gradients. */
void fo_fma_open_stats(const struct fo_cfg *c, struct fo_open_stats *st, const double *q,
                       const double *k, const double *v, const struct fo_params *kp,
                       const struct fo_params *vp);

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
