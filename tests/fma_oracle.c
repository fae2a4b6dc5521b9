/* The double-precision FMA reference (fma_oracle.h), from SPEC §6.4/§6.4a/§6.5 only: summaries
 * by conv, m2m and avg with their backward, fma in summary form with its analytic backward (also
 * with content-based opening, `fma.open`), fma's dense n×n equivalent, and fma_linear. Loops are
 * the formulas written out, never optimised; the tests check every gradient here against central
 * finite differences before trusting it. */
#include "fma_oracle.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void fo_die(const char *what) {
  fprintf(stderr, "fma_oracle: %s\n", what);
  abort();
}

void fo_cfg_init(struct fo_cfg *c, long n, long d, int m, int p, enum fo_down down, bool causal,
                 bool multiplicity) {
  memset(c, 0, sizeof *c);
  if (m < 1 || p < 1 || m % p || n % m) fo_die("need p | m and m | n");
  long r = n / m;
  if (r < 2 || (r & (r - 1))) fo_die("n/m must be a power of two >= 2");
  int log2r = 0;
  while ((1L << log2r) < r) log2r++;
  c->n = n;
  c->d = d;
  c->m = m;
  c->p = p;
  c->levels = log2r - 1;
  if (c->levels > FO_MAX_LEVELS) fo_die("too many levels");
  c->w[0] = m;
  for (int l = 1; l <= c->levels; l++) c->w[l] = (long)m << (l - 1);
  c->down = down;
  c->causal = causal;
  c->multiplicity = multiplicity;
}

long fo_weight_taps(const struct fo_cfg *c, int l) {
  if (c->down == FO_CONV) return c->w[l];
  if (c->down == FO_M2M) return l == 1 ? c->m : 2L * c->p;
  return 0;
}

long fo_weight_len(const struct fo_cfg *c, int l) { return c->d * c->p * fo_weight_taps(c, l); }

long fo_bias_len(const struct fo_cfg *c, int l) {
  (void)l;
  return c->down == FO_AVG ? 0 : c->d * c->p;
}

long fo_rows(const struct fo_cfg *c, int l) { return c->n / c->w[l] * c->p; }

void fo_params_alloc(const struct fo_cfg *c, struct fo_params *P) {
  memset(P, 0, sizeof *P);
  if (c->down == FO_AVG) return;
  for (int l = 1; l <= c->levels; l++) {
    P->weight[l] = calloc((size_t)fo_weight_len(c, l), sizeof(double));
    P->bias[l] = calloc((size_t)fo_bias_len(c, l), sizeof(double));
  }
}

void fo_params_free(const struct fo_cfg *c, struct fo_params *P) {
  for (int l = 1; l <= c->levels; l++) {
    free(P->weight[l]);
    free(P->bias[l]);
  }
  memset(P, 0, sizeof *P);
}

/* Mean init. A window of w taps read as p sub-segments of w/p: weight 1/(w/p) on the taps of
 * sub-segment r. For m2m's M2M step the 2p child rows are the parent's 2p half-segments in order,
 * so parent row r is the mean of child rows 2r and 2r + 1. */
void fo_params_init_mean(const struct fo_cfg *c, struct fo_params *P) {
  if (c->down == FO_AVG) return;
  const long d = c->d, p = c->p;
  for (int l = 1; l <= c->levels; l++) {
    long taps = fo_weight_taps(c, l);
    bool m2m_step = c->down == FO_M2M && l >= 2;
    for (long f = 0; f < d; f++)
      for (long r = 0; r < p; r++) {
        for (long t = 0; t < taps; t++) {
          double wt;
          if (m2m_step)
            wt = (t == 2 * r || t == 2 * r + 1) ? 0.5 : 0.0;
          else
            wt = (t * p / taps == r) ? (double)p / (double)taps : 0.0;
          P->weight[l][(f * p + r) * taps + t] = wt;
        }
        P->bias[l][f * p + r] = 0.0;
      }
  }
}

size_t fo_params_count(const struct fo_cfg *c) {
  size_t s = 0;
  for (int l = 1; l <= c->levels; l++) s += (size_t)(fo_weight_len(c, l) + fo_bias_len(c, l));
  return s;
}

double *fo_params_at(const struct fo_cfg *c, struct fo_params *P, size_t idx) {
  for (int l = 1; l <= c->levels; l++) {
    size_t wl = (size_t)fo_weight_len(c, l), bl = (size_t)fo_bias_len(c, l);
    if (idx < wl) return P->weight[l] + idx;
    idx -= wl;
    if (idx < bl) return P->bias[l] + idx;
    idx -= bl;
  }
  fo_die("parameter index out of range");
  return NULL;
}

/* ---- interaction lists, transcribed from SPEC §6.4 ---- */

int fo_near(const struct fo_cfg *c, long b, long *blocks) {
  long cand[3] = {b - 1, b, b + 1};
  int nc = c->causal ? 2 : 3, count = 0;
  for (int k = 0; k < nc; k++)
    if (cand[k] >= 0 && cand[k] < c->n / c->m) blocks[count++] = cand[k];
  return count;
}

int fo_level(const struct fo_cfg *c, int l, long cw, long *windows) {
  long cand[3];
  int nc;
  bool even = cw % 2 == 0;
  if (c->causal) {
    if (even) {
      cand[0] = cw - 2;
      nc = 1;
    } else {
      cand[0] = cw - 3;
      cand[1] = cw - 2;
      nc = 2;
    }
  } else if (even) {
    cand[0] = cw - 2;
    cand[1] = cw + 2;
    cand[2] = cw + 3;
    nc = 3;
  } else {
    cand[0] = cw - 3;
    cand[1] = cw - 2;
    cand[2] = cw + 2;
    nc = 3;
  }
  int count = 0;
  for (int k = 0; k < nc; k++)
    if (cand[k] >= 0 && cand[k] < c->n / c->w[l]) windows[count++] = cand[k];
  return count;
}

int fo_band(const struct fo_cfg *c, long i, long j) {
  if (c->causal && j > i) return -1;
  long list[FO_LIST_MAX];
  int cnt = fo_near(c, i / c->m, list);
  for (int k = 0; k < cnt; k++)
    if (list[k] == j / c->m) return 0;
  for (int l = 1; l <= c->levels; l++) {
    cnt = fo_level(c, l, i / c->w[l], list);
    for (int k = 0; k < cnt; k++)
      if (list[k] == j / c->w[l]) return l;
  }
  return -1;
}

/* ---- summaries (SPEC §6.4 "Summaries") ---- */

void fo_summaries_alloc(const struct fo_cfg *c, double *S[FO_MAX_LEVELS + 1]) {
  S[0] = NULL;
  for (int l = 1; l <= c->levels; l++)
    S[l] = calloc((size_t)(fo_rows(c, l) * c->d), sizeof(double));
}

void fo_summaries_free(const struct fo_cfg *c, double *S[FO_MAX_LEVELS + 1]) {
  for (int l = 1; l <= c->levels; l++) free(S[l]);
}

/* Depthwise window operator: S[(cw·p + r), f] = Σ_t W[f, r, t]·x[cw·w + t, f] + b[f, r]. */
static void conv_forward(const struct fo_cfg *c, double *S, const double *x, long w,
                         const double *W, const double *b) {
  const long d = c->d, p = c->p, nw = c->n / w;
  for (long cw = 0; cw < nw; cw++)
    for (long r = 0; r < p; r++)
      for (long f = 0; f < d; f++) {
        double s = b[f * p + r];
        for (long t = 0; t < w; t++) s += W[(f * p + r) * w + t] * x[(cw * w + t) * d + f];
        S[(cw * p + r) * d + f] = s;
      }
}

static void conv_backward(const struct fo_cfg *c, double *dx, double *dW, double *db,
                          const double *dS, const double *x, long w, const double *W) {
  const long d = c->d, p = c->p, nw = c->n / w;
  for (long cw = 0; cw < nw; cw++)
    for (long r = 0; r < p; r++)
      for (long f = 0; f < d; f++) {
        double g = dS[(cw * p + r) * d + f];
        if (db) db[f * p + r] += g;
        for (long t = 0; t < w; t++) {
          dx[(cw * w + t) * d + f] += W[(f * p + r) * w + t] * g;
          if (dW) dW[(f * p + r) * w + t] += g * x[(cw * w + t) * d + f];
        }
      }
}

/* M2M: parent window cw of level l from children 2cw, 2cw + 1 at level l − 1:
 * S_l[cw·p + r, f] = Σ_s Σ_r' T[f, r, s·p + r']·S_{l−1}[(2cw + s)·p + r', f] + b[f, r]. */
static void m2m_forward(const struct fo_cfg *c, double *S, const double *child, int l,
                        const double *T, const double *b) {
  const long d = c->d, p = c->p, nw = c->n / c->w[l];
  for (long cw = 0; cw < nw; cw++)
    for (long r = 0; r < p; r++)
      for (long f = 0; f < d; f++) {
        double s = b[f * p + r];
        for (long s2 = 0; s2 < 2; s2++)
          for (long r2 = 0; r2 < p; r2++)
            s += T[(f * p + r) * 2 * p + s2 * p + r2] * child[((2 * cw + s2) * p + r2) * d + f];
        S[(cw * p + r) * d + f] = s;
      }
}

static void m2m_backward(const struct fo_cfg *c, double *dchild, double *dT, double *db,
                         const double *dS, const double *child, int l, const double *T) {
  const long d = c->d, p = c->p, nw = c->n / c->w[l];
  for (long cw = 0; cw < nw; cw++)
    for (long r = 0; r < p; r++)
      for (long f = 0; f < d; f++) {
        double g = dS[(cw * p + r) * d + f];
        if (db) db[f * p + r] += g;
        for (long s2 = 0; s2 < 2; s2++)
          for (long r2 = 0; r2 < p; r2++) {
            long ci = ((2 * cw + s2) * p + r2) * d + f, ti = (f * p + r) * 2 * p + s2 * p + r2;
            dchild[ci] += T[ti] * g;
            if (dT) dT[ti] += g * child[ci];
          }
      }
}

/* avg: summary r of a window is the mean of its r-th of p equal sub-segments. */
static void avg_forward(const struct fo_cfg *c, double *S, const double *x, long w) {
  const long d = c->d, p = c->p, seg = w / p, rows = c->n / w * p;
  for (long row = 0; row < rows; row++)
    for (long f = 0; f < d; f++) {
      double s = 0.0;
      for (long t = 0; t < seg; t++) s += x[(row * seg + t) * d + f];
      S[row * d + f] = s / (double)seg;
    }
}

static void avg_backward(const struct fo_cfg *c, double *dx, const double *dS, long w) {
  const long d = c->d, p = c->p, seg = w / p, rows = c->n / w * p;
  for (long row = 0; row < rows; row++)
    for (long f = 0; f < d; f++)
      for (long t = 0; t < seg; t++) dx[(row * seg + t) * d + f] += dS[row * d + f] / (double)seg;
}

void fo_summaries_forward(const struct fo_cfg *c, double *const S[FO_MAX_LEVELS + 1],
                          const double *x, const struct fo_params *P) {
  for (int l = 1; l <= c->levels; l++) {
    if (c->down == FO_AVG)
      avg_forward(c, S[l], x, c->w[l]);
    else if (c->down == FO_CONV || l == 1)
      conv_forward(c, S[l], x, c->w[l], P->weight[l], P->bias[l]);
    else
      m2m_forward(c, S[l], S[l - 1], l, P->weight[l], P->bias[l]);
  }
}

void fo_summaries_backward(const struct fo_cfg *c, double *dx, struct fo_params *dP,
                           double *const dS[FO_MAX_LEVELS + 1], const double *x,
                           const struct fo_params *P) {
  const int L = c->levels;
  if (L == 0) return;
  if (c->down == FO_AVG) {
    for (int l = 1; l <= L; l++) avg_backward(c, dx, dS[l], c->w[l]);
    return;
  }
  if (c->down == FO_CONV) {
    for (int l = 1; l <= L; l++)
      conv_backward(c, dx, dP ? dP->weight[l] : NULL, dP ? dP->bias[l] : NULL, dS[l], x, c->w[l],
                    P->weight[l]);
    return;
  }
  /* m2m: the children's summaries are needed again; the gradient flows top-down, each level's
   * total (its own dS plus what its parents send) reaching the level below. */
  double *S[FO_MAX_LEVELS + 1] = {0}, *G[FO_MAX_LEVELS + 1] = {0};
  fo_summaries_alloc(c, S);
  fo_summaries_alloc(c, G);
  fo_summaries_forward(c, S, x, P);
  for (int l = 1; l <= L; l++) memcpy(G[l], dS[l], sizeof(double) * fo_rows(c, l) * c->d);
  for (int l = L; l >= 2; l--)
    m2m_backward(c, G[l - 1], dP ? dP->weight[l] : NULL, dP ? dP->bias[l] : NULL, G[l], S[l - 1], l,
                 P->weight[l]);
  conv_backward(c, dx, dP ? dP->weight[1] : NULL, dP ? dP->bias[1] : NULL, G[1], x, c->w[1],
                P->weight[1]);
  fo_summaries_free(c, S);
  fo_summaries_free(c, G);
}

/* ---- attention over a list of columns ---- */

/* What a column is, for the statistics of fo_fma_open_stats. */
enum { COL_NEAR, COL_SUMMARY, COL_OPENED };

/* One softmax over a query's columns: key and value rows (d each) and an additive score term. */
struct fo_cols {
  long count, cap;
  const double **key, **val;
  double **dkey, **dval; /* where their gradients go (NULL entries when not wanted) */
  double *bias, *prob;
  unsigned char *kind; /* COL_* */
};

/* Room for cap columns, none yet. */
static void cols_alloc(struct fo_cols *C, long cap) {
  C->count = 0;
  C->cap = cap;
  C->key = malloc(sizeof(double *) * (size_t)cap);
  C->val = malloc(sizeof(double *) * (size_t)cap);
  C->dkey = malloc(sizeof(double *) * (size_t)cap);
  C->dval = malloc(sizeof(double *) * (size_t)cap);
  C->bias = malloc(sizeof(double) * (size_t)cap);
  C->prob = malloc(sizeof(double) * (size_t)cap);
  C->kind = malloc((size_t)cap);
}

/* Release cols_alloc's arrays. */
static void cols_free(struct fo_cols *C) {
  free(C->key);
  free(C->val);
  free(C->dkey);
  free(C->dval);
  free(C->bias);
  free(C->prob);
  free(C->kind);
}

/* Append one column of the given kind (COL_*); aborts past the capacity. */
static void cols_add(struct fo_cols *C, const double *key, const double *val, double *dkey,
                     double *dval, double bias, int kind) {
  if (C->count >= C->cap) fo_die("too many columns for one query");
  C->kind[C->count] = (unsigned char)kind;
  C->key[C->count] = key;
  C->val[C->count] = val;
  C->dkey[C->count] = dkey;
  C->dval[C->count] = dval;
  C->bias[C->count] = bias;
  C->count++;
}

/* o (d) = Σ softmax(query·key/√d + bias)·val, probabilities kept in C->prob. */
static void cols_forward(struct fo_cols *C, double *o, const double *query, long d) {
  const double scale = 1.0 / sqrt((double)d);
  double mx = -INFINITY;
  for (long a = 0; a < C->count; a++) {
    double s = 0.0;
    for (long f = 0; f < d; f++) s += query[f] * C->key[a][f];
    C->prob[a] = s * scale + C->bias[a];
    if (C->prob[a] > mx) mx = C->prob[a];
  }
  double z = 0.0;
  for (long a = 0; a < C->count; a++) {
    C->prob[a] = exp(C->prob[a] - mx);
    z += C->prob[a];
  }
  for (long f = 0; f < d; f++) o[f] = 0.0;
  for (long a = 0; a < C->count; a++) {
    C->prob[a] /= z;
    for (long f = 0; f < d; f++) o[f] += C->prob[a] * C->val[a][f];
  }
}

/* Backward of cols_forward for the output gradient g (d), given its output o: dquery, and every
 * column's dkey/dval, accumulate. */
static void cols_backward(const struct fo_cols *C, double *dquery, const double *g, const double *o,
                          const double *query, long d) {
  const double scale = 1.0 / sqrt((double)d);
  double D = 0.0;
  for (long f = 0; f < d; f++) D += g[f] * o[f];
  for (long a = 0; a < C->count; a++) {
    double P = C->prob[a], dp = 0.0;
    for (long f = 0; f < d; f++) dp += g[f] * C->val[a][f];
    double ds = P * (dp - D) * scale;
    for (long f = 0; f < d; f++) {
      if (C->dval[a]) C->dval[a][f] += P * g[f];
      if (C->dkey[a]) C->dkey[a][f] += ds * query[f];
      dquery[f] += ds * C->key[a][f];
    }
  }
}

/* The near field of query i: blocks b − 1, b (causal, up to i) or b − 1, b, b + 1. */
static void add_near(const struct fo_cfg *c, struct fo_cols *C, long i, const double *k,
                     const double *v, double *dk, double *dv) {
  const long d = c->d;
  long blocks[FO_LIST_MAX];
  int nb = fo_near(c, i / c->m, blocks);
  for (int x = 0; x < nb; x++)
    for (long j = blocks[x] * c->m; j < (blocks[x] + 1) * c->m; j++) {
      if (c->causal && j > i) continue;
      cols_add(C, k + j * d, v + j * d, dk ? dk + j * d : NULL, dv ? dv + j * d : NULL, 0.0,
               COL_NEAR);
    }
}

/* The p coarse columns (key rows of K, value rows of V, score term bias) of window win. */
static void add_window(const struct fo_cfg *c, struct fo_cols *C, long win, const double *K,
                       const double *V, double *dK, double *dV, double bias) {
  const long d = c->d, p = c->p;
  for (long r = 0; r < p; r++) {
    long row = win * p + r;
    cols_add(C, K + row * d, V + row * d, dK ? dK + row * d : NULL, dV ? dV + row * d : NULL, bias,
             COL_SUMMARY);
  }
}

/* Level l's coarse columns of query i: the p rows of every listed window. */
static void add_level(const struct fo_cfg *c, struct fo_cols *C, long i, int l, const double *K,
                      const double *V, double *dK, double *dV, double bias) {
  long wins[FO_LIST_MAX];
  int nw = fo_level(c, l, i / c->w[l], wins);
  for (int x = 0; x < nw; x++) add_window(c, C, wins[x], K, V, dK, dV, bias);
}

/* Columns one query can have. §6.4: near field and three windows a level. With opening, every
 * column stands for at least one distinct allowed key (a summary row for w_l/p ≥ 1 tokens), so n
 * more always suffice. */
static long cols_cap(const struct fo_cfg *c) {
  return 3L * c->m + 3L * c->p * c->levels + 1 + (c->open ? c->n : 0);
}

/* ---- fma.open (SPEC §6.4a): candidates, scores, choice, and a query's columns ---- */

/* The multiplicity term of level l's coarse scores. */
static double level_bias(const struct fo_cfg *c, int l) {
  return c->multiplicity ? log((double)c->w[l] / (double)c->p) : 0.0;
}

int fo_open_candidates(const struct fo_cfg *c, long i, int l, const long *opened_above, int n_above,
                       long *cand) {
  if (l < 1 || l > c->levels) fo_die("fo_open_candidates: no such level");
  if (l == c->levels && n_above) fo_die("fo_open_candidates: nothing is above the top level");
  const long nwin = c->n / c->w[l]; /* the caller's room */
  long list[FO_LIST_MAX];
  int nl = fo_level(c, l, i / c->w[l], list), count = 0;
  for (int x = 0; x < nl; x++) cand[count++] = list[x];
  for (int x = 0; x < n_above; x++) {
    if (opened_above[x] < 0 || 2 * opened_above[x] + 1 >= nwin || count + 2 > nwin)
      fo_die("fo_open_candidates: bad window opened above");
    cand[count++] = 2 * opened_above[x];
    cand[count++] = 2 * opened_above[x] + 1;
  }
  /* insertion sort; a window twice would be a key covered twice */
  for (int a = 1; a < count; a++)
    for (int b = a; b > 0 && cand[b - 1] > cand[b]; b--) {
      long t = cand[b];
      cand[b] = cand[b - 1];
      cand[b - 1] = t;
    }
  for (int a = 1; a < count; a++)
    if (cand[a] == cand[a - 1]) fo_die("fo_open_candidates: a window is a candidate twice");
  return count;
}

double fo_open_score(const struct fo_cfg *c, const double *qi, const double *Kl, int l, long win) {
  const long d = c->d, p = c->p;
  const double scale = 1.0 / sqrt((double)d), bias = level_bias(c, l);
  double *s = malloc(sizeof(double) * (size_t)p), mx = -INFINITY, z = 0.0;
  for (long r = 0; r < p; r++) {
    const double *key = Kl + (win * p + r) * d;
    double dot = 0.0;
    for (long f = 0; f < d; f++) dot += qi[f] * key[f]; /* as cols_forward scores a column */
    s[r] = dot * scale + bias;
    if (s[r] > mx) mx = s[r];
  }
  for (long r = 0; r < p; r++) z += exp(s[r] - mx);
  free(s);
  return mx + log(z);
}

int fo_open_choice(const struct fo_cfg *c, long i, const double *qi,
                   double *const K[FO_MAX_LEVELS + 1], int l, const long *opened_above, int n_above,
                   long *opened) {
  if (c->open == 0) return 0;
  if (c->open < 0 && c->open != FO_OPEN_ALL) fo_die("fma.open must be >= 0 or FO_OPEN_ALL");
  const long nwin = c->n / c->w[l];
  long *cand = malloc(sizeof(long) * (size_t)nwin);
  int nc = fo_open_candidates(c, i, l, opened_above, n_above, cand), no = 0;
  if (c->open == FO_OPEN_ALL || c->open >= nc) {
    for (int x = 0; x < nc; x++) opened[no++] = cand[x];
    free(cand);
    return no;
  }
  double *g = malloc(sizeof(double) * (size_t)nc);
  unsigned char *pick = calloc((size_t)nc, 1);
  for (int x = 0; x < nc; x++) g[x] = fo_open_score(c, qi, K[l], l, cand[x]);
  /* K rounds of "the largest unpicked g": candidates run in increasing window order and only a
   * strictly larger g displaces the best so far, so among equal scores the lower window wins. */
  for (int round = 0; round < c->open; round++) {
    int best = -1;
    for (int x = 0; x < nc; x++)
      if (!pick[x] && (best < 0 || g[x] > g[best])) best = x;
    if (best < 0) break; /* cannot happen: open < nc here */
    pick[best] = 1;
  }
  for (int x = 0; x < nc; x++)
    if (pick[x]) opened[no++] = cand[x];
  free(g);
  free(pick);
  free(cand);
  return no;
}

/* Query i's columns beyond the near field under fma.open: walk l = L..1; every candidate is
 * either opened (level 1: its m exact keys k_j, values v_j, no score term; higher: nothing here,
 * its children are the next level's candidates) or gives its p summary rows (K_l, V_l, the
 * multiplicity term) as in §6.4. dk, dv, dK, dV: where gradients go (entries may be NULL). When
 * opened_count is non-NULL, opened_count[l] += the windows opened at level l. */
static void fo_open_columns(const struct fo_cfg *c, struct fo_cols *C, long i, const double *qi,
                            const double *k, const double *v, double *const K[FO_MAX_LEVELS + 1],
                            double *const V[FO_MAX_LEVELS + 1], double *dk, double *dv,
                            double *const dK[FO_MAX_LEVELS + 1],
                            double *const dV[FO_MAX_LEVELS + 1], double *opened_count) {
  const long d = c->d, nmax = c->n / c->m; /* level 1 has the most windows */
  long *above = malloc(sizeof(long) * (size_t)nmax), *cur = malloc(sizeof(long) * (size_t)nmax),
       *cand = malloc(sizeof(long) * (size_t)nmax);
  int n_above = 0;
  for (int l = c->levels; l >= 1; l--) {
    int nc = fo_open_candidates(c, i, l, above, n_above, cand);
    int no = fo_open_choice(c, i, qi, K, l, above, n_above, cur), o = 0;
    for (int x = 0; x < nc; x++) {
      const long win = cand[x];
      if (o < no && cur[o] == win) { /* opened: both lists are in increasing order */
        o++;
        if (l > 1) continue;
        for (long j = win * c->m; j < (win + 1) * c->m; j++) {
          if (c->causal && j > i) fo_die("fma.open: an opened window holds a future key");
          cols_add(C, k + j * d, v + j * d, dk ? dk + j * d : NULL, dv ? dv + j * d : NULL, 0.0,
                   COL_OPENED);
        }
      } else {
        add_window(c, C, win, K[l], V[l], dK[l], dV[l], level_bias(c, l));
      }
    }
    if (o != no) fo_die("fma.open: an opened window is not a candidate");
    if (opened_count) opened_count[l] += no;
    long *t = above;
    above = cur;
    cur = t;
    n_above = no;
  }
  free(above);
  free(cur);
  free(cand);
}

/* ---- fma ---- */

/* fo_fma, and with st non-NULL the statistics of fo_fma_open_stats (accumulated). */
static void fma_run(const struct fo_cfg *c, double *out, double *dq, double *dk, double *dv,
                    struct fo_params *dkp, struct fo_params *dvp, const double *q, const double *k,
                    const double *v, const struct fo_params *kp, const struct fo_params *vp,
                    const double *dout, struct fo_open_stats *st) {
  const long n = c->n, d = c->d;
  const int L = c->levels;
  double *K[FO_MAX_LEVELS + 1], *V[FO_MAX_LEVELS + 1], *dK[FO_MAX_LEVELS + 1],
      *dV[FO_MAX_LEVELS + 1];
  fo_summaries_alloc(c, K);
  fo_summaries_alloc(c, V);
  fo_summaries_alloc(c, dK);
  fo_summaries_alloc(c, dV);
  fo_summaries_forward(c, K, k, kp);
  fo_summaries_forward(c, V, v, vp);
  struct fo_cols C;
  cols_alloc(&C, cols_cap(c));
  for (long i = 0; i < n; i++) {
    C.count = 0;
    add_near(c, &C, i, k, v, dout ? dk : NULL, dout ? dv : NULL);
    if (c->open) {
      fo_open_columns(c, &C, i, q + i * d, k, v, K, V, dout ? dk : NULL, dout ? dv : NULL, dK, dV,
                      st ? st->opened : NULL);
    } else {
      for (int l = 1; l <= L; l++) {
        double bias = c->multiplicity ? log((double)c->w[l] / (double)c->p) : 0.0;
        add_level(c, &C, i, l, K[l], V[l], dK[l], dV[l], bias);
      }
    }
    cols_forward(&C, out + i * d, q + i * d, d);
    if (dout) cols_backward(&C, dq + i * d, dout + i * d, out + i * d, q + i * d, d);
    if (st)
      for (long a = 0; a < C.count; a++) {
        double *mass = C.kind[a] == COL_NEAR     ? &st->near_mass
                       : C.kind[a] == COL_OPENED ? &st->open_mass
                                                 : &st->summary_mass;
        *mass += C.prob[a];
      }
  }
  cols_free(&C);
  if (dout) {
    fo_summaries_backward(c, dk, dkp, dK, k, kp);
    fo_summaries_backward(c, dv, dvp, dV, v, vp);
  }
  fo_summaries_free(c, K);
  fo_summaries_free(c, V);
  fo_summaries_free(c, dK);
  fo_summaries_free(c, dV);
}

void fo_fma(const struct fo_cfg *c, double *out, double *dq, double *dk, double *dv,
            struct fo_params *dkp, struct fo_params *dvp, const double *q, const double *k,
            const double *v, const struct fo_params *kp, const struct fo_params *vp,
            const double *dout) {
  fma_run(c, out, dq, dk, dv, dkp, dvp, q, k, v, kp, vp, dout, NULL);
}

void fo_fma_open_stats(const struct fo_cfg *c, struct fo_open_stats *st, const double *q,
                       const double *k, const double *v, const struct fo_params *kp,
                       const struct fo_params *vp) {
  memset(st, 0, sizeof *st);
  double *out = malloc(sizeof(double) * (size_t)(c->n * c->d));
  fma_run(c, out, NULL, NULL, NULL, NULL, NULL, q, k, v, kp, vp, NULL, st);
  free(out);
}

/* SPEC §6.4's dense n×n form (fma_oracle.h). */
void fo_fma_dense(const struct fo_cfg *c, double *out, const double *q, const double *k,
                  const double *v, const struct fo_params *kp, const struct fo_params *vp) {
  if (c->open) fo_die("fo_fma_dense is SPEC §6.4 only (fma.open = 0)");
  const long n = c->n, d = c->d, p = c->p;
  const double scale = 1.0 / sqrt((double)d);
  double *K[FO_MAX_LEVELS + 1], *V[FO_MAX_LEVELS + 1];
  fo_summaries_alloc(c, K);
  fo_summaries_alloc(c, V);
  fo_summaries_forward(c, K, k, kp);
  fo_summaries_forward(c, V, v, vp);
  double *Ct = malloc(sizeof(double) * (size_t)(n * n)); /* (n, n) C̃, −inf where masked */
  double *Vi = malloc(sizeof(double) * (size_t)(n * d)); /* (n, d) value rows of one query */
  for (long i = 0; i < n; i++)
    for (long j = 0; j < n; j++) {
      int band = fo_band(c, i, j);
      const double *key = NULL;
      if (band == 0) {
        key = k + j * d;
      } else if (band > 0) {
        long w = c->w[band];
        key = K[band] + ((j / w) * p + (j % w) * p / w) * d;
      }
      double s = 0.0;
      if (key)
        for (long f = 0; f < d; f++) s += q[i * d + f] * key[f];
      Ct[i * n + j] = key ? s : -INFINITY;
    }
  for (long i = 0; i < n; i++) {
    for (long j = 0; j < n; j++) {
      int band = fo_band(c, i, j);
      const double *val = NULL;
      if (band == 0) {
        val = v + j * d;
      } else if (band > 0) {
        long w = c->w[band];
        val = V[band] + ((j / w) * p + (j % w) * p / w) * d;
      }
      for (long f = 0; f < d; f++) Vi[j * d + f] = val ? val[f] : 0.0;
    }
    double mx = -INFINITY, z = 0.0;
    for (long j = 0; j < n; j++)
      if (Ct[i * n + j] * scale > mx) mx = Ct[i * n + j] * scale;
    for (long f = 0; f < d; f++) out[i * d + f] = 0.0;
    for (long j = 0; j < n; j++) z += exp(Ct[i * n + j] * scale - mx);
    for (long j = 0; j < n; j++) {
      double a = exp(Ct[i * n + j] * scale - mx) / z;
      for (long f = 0; f < d; f++) out[i * d + f] += a * Vi[j * d + f];
    }
  }
  free(Ct);
  free(Vi);
  fo_summaries_free(c, K);
  fo_summaries_free(c, V);
}

/* ---- fma_linear ---- */

/* Causal query summaries: row r of a window may read only sub-segments ≤ r (m2m: child rows
 * ≤ 2r + 1), so that the summary of the sub-segment before i's holds no query after i. Zero every
 * other tap of P (weights only). */
static void causal_query_mask(const struct fo_cfg *c, struct fo_params *P) {
  const long d = c->d, p = c->p;
  for (int l = 1; l <= c->levels; l++) {
    const long taps = fo_weight_taps(c, l);
    for (long f = 0; f < d; f++)
      for (long r = 0; r < p; r++)
        for (long t = 0; t < taps; t++) {
          bool used = c->down == FO_M2M && l > 1 ? t <= 2 * r + 1 : t < (r + 1) * (taps / p);
          if (!used) P->weight[l][(f * p + r) * taps + t] = 0.0;
        }
  }
}

long fo_linear_query_row(const struct fo_cfg *c, int l, long i) {
  long w = c->w[l];
  long rho = (i / w) * c->p + (i % w) * c->p / w;
  if (c->causal && !c->unshifted) rho -= 1; /* the sub-segment before i's: no query after i */
  return rho;
}

void fo_fma_linear(const struct fo_cfg *c, double *out, double *dq, double *dk, double *dv,
                   struct fo_params *dqp, struct fo_params *dkp, struct fo_params *dvp,
                   const double *q, const double *k, const double *v, const struct fo_params *qp,
                   const struct fo_params *kp, const struct fo_params *vp, const double *dout) {
  if (c->open) fo_die("fma.open is fma's (SPEC §6.4a), not fma_linear's");
  const long n = c->n, d = c->d;
  const int L = c->levels;
  double *Q[FO_MAX_LEVELS + 1], *K[FO_MAX_LEVELS + 1], *V[FO_MAX_LEVELS + 1];
  double *dQ[FO_MAX_LEVELS + 1], *dK[FO_MAX_LEVELS + 1], *dV[FO_MAX_LEVELS + 1];
  fo_summaries_alloc(c, Q);
  fo_summaries_alloc(c, K);
  fo_summaries_alloc(c, V);
  fo_summaries_alloc(c, dQ);
  fo_summaries_alloc(c, dK);
  fo_summaries_alloc(c, dV);
  /* causal: the query summaries use masked weights W∘M, whose gradient is dW∘M */
  const bool masked = c->causal && !c->unshifted && c->down != FO_AVG;
  struct fo_params qm, dqm;
  if (masked) {
    fo_params_alloc(c, &qm);
    fo_params_alloc(c, &dqm);
    for (size_t e = 0; e < fo_params_count(c); e++)
      *fo_params_at(c, &qm, e) = *fo_params_at(c, (struct fo_params *)qp, e);
    causal_query_mask(c, &qm);
    qp = &qm;
  }
  fo_summaries_forward(c, Q, q, qp);
  fo_summaries_forward(c, K, k, kp);
  fo_summaries_forward(c, V, v, vp);
  double *o = malloc(sizeof(double) * (size_t)d);
  struct fo_cols C;
  cols_alloc(&C, cols_cap(c));
  for (long i = 0; i < n; i++) {
    C.count = 0;
    add_near(c, &C, i, k, v, dout ? dk : NULL, dout ? dv : NULL);
    cols_forward(&C, out + i * d, q + i * d, d);
    if (dout) cols_backward(&C, dq + i * d, dout + i * d, out + i * d, q + i * d, d);
    for (int l = 1; l <= L; l++) {
      C.count = 0;
      /* The multiplicity log(w_l/p) is the same for every column of one level's softmax, so it
       * cancels: none is added. */
      add_level(c, &C, i, l, K[l], V[l], dK[l], dV[l], 0.0);
      if (C.count == 0) continue; /* an empty list adds nothing */
      long rho = fo_linear_query_row(c, l, i);
      if (rho < 0) fo_die("fma_linear: a non-empty list without a query summary");
      cols_forward(&C, o, Q[l] + rho * d, d);
      for (long f = 0; f < d; f++) out[i * d + f] += o[f];
      if (dout) cols_backward(&C, dQ[l] + rho * d, dout + i * d, o, Q[l] + rho * d, d);
    }
  }
  cols_free(&C);
  free(o);
  if (dout) {
    fo_summaries_backward(c, dq, masked ? &dqm : dqp, dQ, q, qp);
    if (masked && dqp) {
      causal_query_mask(c, &dqm);
      for (size_t e = 0; e < fo_params_count(c); e++)
        *fo_params_at(c, dqp, e) += *fo_params_at(c, &dqm, e);
    }
    fo_summaries_backward(c, dk, dkp, dK, k, kp);
    fo_summaries_backward(c, dv, dvp, dV, v, vp);
  }
  if (masked) {
    fo_params_free(c, &qm);
    fo_params_free(c, &dqm);
  }
  fo_summaries_free(c, Q);
  fo_summaries_free(c, K);
  fo_summaries_free(c, V);
  fo_summaries_free(c, dQ);
  fo_summaries_free(c, dK);
  fo_summaries_free(c, dV);
}
