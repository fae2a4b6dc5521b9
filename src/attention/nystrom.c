/* `nystrom` (SPEC §6.7): landmarks are segment means, out = F·pinv(A)·(B v) + DepthwiseConv_k(v)
 * with the iterative pinv; bidirectional only. F and B are never formed whole (the B-pass streams
 * keys with an online softmax per landmark, the F-pass streams queries): O(n·d + m·d + m²) memory
 * per head. Under sequence parallelism every rank holds whole segments: the landmarks are gathered,
 * the m × m work is alike on every rank, the landmark sums are allreduced, the conv takes a halo.
 */
#include <cblas.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attention/attention.h"
#include "attention/nystrom.h"
#include "core/error.h"
#include "core/memory.h"
#include "nn/vecmath.h"
#include "parallel/halo.h"

#define NY_CHUNK 64 /* query or key rows per streamed chunk */

struct ny_state {
  int m, iters, k; /* landmarks, pinv iterations, conv length (0: none) */
  long seg;        /* tokens per segment, n / m */
  long mloc, s0;   /* segments in this rank's slab, and the first one's index */
  float scale;     /* 1/√d */
};

static bool ny_check(const struct config *cfg, long n, int seq_ranks, struct attn_refusal *r) {
  const long m = cfg->attention.nystrom_landmarks;
  if (cfg->model.objective == OBJECTIVE_CLM)
    return attention_refuse(r, "attention.variant model.objective",
                            "attention.variant = nystrom is bidirectional only (segment means mix "
                            "future tokens); use model.objective = mlm");
  if (n % m != 0)
    return attention_refuse(r, "attention.nystrom.landmarks model.context",
                            "attention.nystrom.landmarks = %ld does not divide model.context = %ld "
                            "(landmarks are means of equal segments)",
                            m, n);
  if (seq_ranks > 1 && (n % seq_ranks != 0 || (n / seq_ranks) % (n / m) != 0))
    return attention_refuse(
        r, "parallel.seq_ranks attention.nystrom.landmarks",
        "attention.variant = nystrom with parallel.seq_ranks = %d: each rank's slab "
        "(model.context / seq_ranks = %ld / %d) must hold whole segments of model.context / "
        "nystrom.landmarks = %ld tokens",
        seq_ranks, n, seq_ranks, n / m);
  return false;
}

static void ny_describe(const struct config *cfg, long n, struct param_list *list) {
  const long k = cfg->attention.nystrom_conv;
  if (k == 0) return;
  const long shape[2] = {cfg->model.heads, k};
  /* PyTorch's conv default, as the reference code uses: U(±1/√fan_in), fan_in = k */
  param_list_add(list, "conv", 2, shape, true, INIT_UNIFORM, (float)(1.0 / sqrt((double)k)));
}

static void *ny_setup(const struct config *cfg, const struct attn_dims *dims) {
  struct ny_state *st = xcalloc(1, sizeof *st);
  st->m = cfg->attention.nystrom_landmarks;
  st->iters = cfg->attention.nystrom_pinv_iters;
  st->k = cfg->attention.nystrom_conv;
  st->seg = dims->n / st->m;
  st->mloc = dims->T / st->seg;
  st->s0 = dims->t0 / st->seg;
  st->scale = 1.0f / sqrtf((float)dims->d);
  return st;
}

static void ny_teardown(void *state) { free(state); }

/* ---------------------------------------------------------------------------------------------
 * small dense pieces: softmax rows, the pseudo-inverse iteration and its transpose */

/* x (rows, cols) ← softmax of each row; lse (rows) receives log Σ e^x when given. */
static void softmax_rows(float *x, long rows, long cols, float *lse) {
  for (long r = 0; r < rows; r++) {
    float *row = x + r * cols, mx = -INFINITY, sum = 0.0f;
    for (long c = 0; c < cols; c++) mx = row[c] > mx ? row[c] : mx;
#pragma omp simd reduction(+ : sum)
    for (long c = 0; c < cols; c++) {
      row[c] = expf(row[c] - mx);
      sum += row[c];
    }
    const float inv = 1.0f / sum;
    for (long c = 0; c < cols; c++) row[c] *= inv;
    if (lse) lse[r] = mx + logf(sum);
  }
}

/* dS (rows, cols) = P ∘ (dP − rowsum(dP ∘ P)): a row softmax's transpose, in place on dP. */
static void softmax_rows_backward(float *dP, const float *P, long rows, long cols) {
  for (long r = 0; r < rows; r++) {
    float dot = 0.0f;
    for (long c = 0; c < cols; c++) dot += dP[r * cols + c] * P[r * cols + c];
    for (long c = 0; c < cols; c++) dP[r * cols + c] = P[r * cols + c] * (dP[r * cols + c] - dot);
  }
}

static void gemm(bool ta, bool tb, long M, long N, long K, float alpha, const float *a,
                 const float *b, float beta, float *c) {
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, (int)M,
              (int)N, (int)K, alpha, a, ta ? (int)M : (int)K, b, tb ? (int)K : (int)N, beta, c,
              (int)N);
}

/* x (m, m) = alpha·I − y */
static void identity_minus(float *x, float alpha, const float *y, long m) {
  for (long i = 0; i < m * m; i++) x[i] = -y[i];
  for (long i = 0; i < m; i++) x[i * m + i] += alpha;
}

/* The largest row sum and column sum of A (m, m), and where they are. */
static void row_col_max(const float *A, long m, float *r, long *ri, float *c, long *ci) {
  *r = *c = -INFINITY;
  *ri = *ci = 0;
  for (long i = 0; i < m; i++) {
    float rs = 0.0f, cs = 0.0f;
    for (long j = 0; j < m; j++) {
      rs += A[i * m + j];
      cs += A[j * m + i];
    }
    if (rs > *r) *r = rs, *ri = i;
    if (cs > *c) *c = cs, *ci = i;
  }
}

/* Z (iters + 1, m, m): Z_0 = Aᵀ/(r·c), then Z_{t+1} = ¼ Z_t (13I − P(15I − P(7I − P))), P = A Z_t.
 * work: 4 m². */
void nystrom_pinv(float *Z, const float *A, long m, int iters, float *work) {
  float r, c;
  long ri, ci;
  row_col_max(A, m, &r, &ri, &c, &ci);
  for (long i = 0; i < m; i++)
    for (long j = 0; j < m; j++) Z[i * m + j] = A[j * m + i] / (r * c);
  float *P = work, *M = work + m * m, *N = work + 2 * m * m, *Q = work + 3 * m * m;
  for (int t = 0; t < iters; t++) {
    const float *Zt = Z + (size_t)t * m * m;
    gemm(false, false, m, m, m, 1.0f, A, Zt, 0.0f, P);
    identity_minus(M, 7.0f, P, m);                    /* M1 = 7I − P */
    gemm(false, false, m, m, m, 1.0f, P, M, 0.0f, Q); /* P M1 */
    identity_minus(N, 15.0f, Q, m);                   /* M2 = 15I − P M1 */
    gemm(false, false, m, m, m, 1.0f, P, N, 0.0f, Q); /* P M2 */
    identity_minus(M, 13.0f, Q, m);                   /* M3 = 13I − P M2 */
    gemm(false, false, m, m, m, 0.25f, Zt, M, 0.0f, Z + (size_t)(t + 1) * m * m);
  }
}

/* dA (m, m) += the transpose of nystrom_pinv for dW = dL/dZ_iters (consumed). work: 8 m². */
static void pinv_backward(float *dA, float *dW, const float *A, const float *Z, long m, int iters,
                          float *work) {
  const size_t mm = (size_t)(m * m);
  float *P = work, *M1 = work + mm, *M2 = work + 2 * mm, *M3 = work + 3 * mm, *Q = work + 4 * mm;
  float *dM = work + 5 * mm, *dM2 = work + 6 * mm, *dP = work + 7 * mm;
  float *dZ = dW; /* dL/dZ_t, carried down in place */
  for (int t = iters - 1; t >= 0; t--) {
    const float *Zt = Z + (size_t)t * mm;
    /* the forward step again */
    gemm(false, false, m, m, m, 1.0f, A, Zt, 0.0f, P);
    identity_minus(M1, 7.0f, P, m);
    gemm(false, false, m, m, m, 1.0f, P, M1, 0.0f, Q);
    identity_minus(M2, 15.0f, Q, m);
    gemm(false, false, m, m, m, 1.0f, P, M2, 0.0f, Q);
    identity_minus(M3, 13.0f, Q, m);
    /* Z_{t+1} = ¼ Z_t M3: dM3 = ¼ Z_tᵀ dZ, dZ_t = ¼ dZ M3ᵀ */
    gemm(true, false, m, m, m, 0.25f, Zt, dZ, 0.0f, dM);
    gemm(false, true, m, m, m, 0.25f, dZ, M3, 0.0f, Q);
    /* M3 = 13I − P M2: dP = −dM3 M2ᵀ, dM2 = −Pᵀ dM3 */
    gemm(false, true, m, m, m, -1.0f, dM, M2, 0.0f, dP);
    gemm(true, false, m, m, m, -1.0f, P, dM, 0.0f, dM2);
    /* M2 = 15I − P M1: dP −= dM2 M1ᵀ, dM1 = −Pᵀ dM2 */
    gemm(false, true, m, m, m, -1.0f, dM2, M1, 1.0f, dP);
    gemm(true, false, m, m, m, -1.0f, P, dM2, 0.0f, dM);
    /* M1 = 7I − P: dP −= dM1 */
    for (size_t i = 0; i < mm; i++) dP[i] -= dM[i];
    /* P = A Z_t: dA += dP Z_tᵀ, dZ_t += Aᵀ dP */
    gemm(false, true, m, m, m, 1.0f, dP, Zt, 1.0f, dA);
    gemm(true, false, m, m, m, 1.0f, A, dP, 1.0f, Q);
    memcpy(dZ, Q, sizeof(float) * mm);
  }
  /* Z_0 = Aᵀ/(r c): dA += dZ_0ᵀ/(r c), and through r, c (the largest row and column sums) */
  float r, c;
  long ri, ci;
  row_col_max(A, m, &r, &ri, &c, &ci);
  double g = 0.0; /* Σ dZ_0 ∘ Aᵀ: dL/d(1/(r c)) */
  for (long i = 0; i < m; i++)
    for (long j = 0; j < m; j++) {
      dA[j * m + i] += dZ[i * m + j] / (r * c);
      g += (double)dZ[i * m + j] * A[j * m + i];
    }
  const float dr = (float)(-g / ((double)r * r * c)), dc = (float)(-g / ((double)r * c * c));
  for (long j = 0; j < m; j++) {
    dA[ri * m + j] += dr;
    dA[j * m + ci] += dc;
  }
}

/* ---------------------------------------------------------------------------------------------
 * one layer */

static int seq_ranks(const struct attn_ctx *ctx) { return ctx->comm ? ctx->comm->S : 1; }

/* What forward saves per (batch, head) row, all the same on every rank: the landmarks qt, kt
 * (m, d), the iterates Z (iters + 1, m, m), U = B·v (m, d) and B's log-sum-exp (m). */
struct ny_saved {
  float *qt, *kt, *Z, *U, *lse;
};

static size_t row_floats(const struct ny_state *st, long d) {
  const size_t m = (size_t)st->m;
  return 3 * m * (size_t)d + (size_t)(st->iters + 1) * m * m + m;
}

static struct ny_saved saved_row(const struct ny_state *st, long d, float *saved, long bh) {
  const size_t m = (size_t)st->m;
  float *p = saved + (size_t)bh * row_floats(st, d);
  struct ny_saved s;
  s.qt = p, p += m * d;
  s.kt = p, p += m * d;
  s.Z = p, p += (size_t)(st->iters + 1) * m * m;
  s.U = p, p += m * d;
  s.lse = p;
  return s;
}

static size_t ny_saved_floats(const struct attn_ctx *ctx) {
  return (size_t)(ctx->dims.B * ctx->dims.H) * row_floats(ctx->state, ctx->dims.d);
}

/* qt, kt of every row: the means of this rank's segments, gathered from the group in rank order
 * (rank r holds segments [r·mloc, (r + 1)·mloc)). */
static void landmarks(struct attn_ctx *ctx, float *saved, const float *q, const float *k) {
  const struct ny_state *st = ctx->state;
  const long BH = ctx->dims.B * ctx->dims.H, T = ctx->dims.T, d = ctx->dims.d;
  const long mloc = st->mloc, seg = st->seg, S = seq_ranks(ctx);
  const size_t part = (size_t)(BH * mloc * d); /* floats of q̃ (or k̃) on one rank */
  float *mine = mem_alloc(MEM_WORKSPACE, sizeof(float) * 2 * part);
#pragma omp parallel for schedule(static)
  for (long bh = 0; bh < BH; bh++)
    for (int which = 0; which < 2; which++) {
      const float *x = (which ? k : q) + bh * T * d;
      float *y = mine + which * part + bh * mloc * d;
      for (long j = 0; j < mloc; j++)
        for (long c = 0; c < d; c++) {
          float s = 0.0f;
          for (long t = 0; t < seg; t++) s += x[(j * seg + t) * d + c];
          y[j * d + c] = s / (float)seg;
        }
    }
  float *all = mine;
  if (S > 1) {
    all = mem_alloc(MEM_COMM, sizeof(float) * 2 * part * (size_t)S);
    comm_allgather_float(ctx->comm, COMM_SEQ, mine, 2 * part, all);
  }
  for (long r = 0; r < S; r++)
    for (long bh = 0; bh < BH; bh++) {
      struct ny_saved sv = saved_row(st, d, saved, bh);
      const float *from = all + (size_t)r * 2 * part + bh * mloc * d;
      memcpy(sv.qt + r * mloc * d, from, sizeof(float) * (size_t)(mloc * d));
      memcpy(sv.kt + r * mloc * d, from + part, sizeof(float) * (size_t)(mloc * d));
    }
  if (all != mine) mem_free(all);
  mem_free(mine);
}

/* A = softmax(qt ktᵀ/√d) (m, m) of one row. */
static void landmark_softmax(const struct ny_state *st, float *A, const struct ny_saved *sv,
                             long d) {
  gemm(false, true, st->m, st->m, d, st->scale, sv->qt, sv->kt, 0.0f, A);
  softmax_rows(A, st->m, st->m, NULL);
}

/* U = B·v and lse over this rank's keys, by an online softmax per landmark: partial statistics
 * (max, Σ e, Σ e·v), combined over the sequence group. stats (BH, m, d + 2) is the workspace. */
static void b_pass(struct attn_ctx *ctx, float *saved, const float *k, const float *v) {
  const struct ny_state *st = ctx->state;
  const long BH = ctx->dims.B * ctx->dims.H, T = ctx->dims.T, d = ctx->dims.d, m = st->m;
  const long w = d + 2; /* per landmark: Σ e·v (d), Σ e, max */
  float *stats = mem_alloc(MEM_WORKSPACE, sizeof(float) * (size_t)(BH * m * w));
#pragma omp parallel
  {
    float *s = mem_alloc(MEM_WORKSPACE, sizeof(float) * (size_t)(m * NY_CHUNK));
#pragma omp for schedule(dynamic, 1)
    for (long bh = 0; bh < BH; bh++) {
      const struct ny_saved sv = saved_row(st, d, saved, bh);
      float *row = stats + bh * m * w;
      for (long i = 0; i < m; i++) row[i * w + d + 1] = -INFINITY;
      for (long j0 = 0; j0 < T; j0 += NY_CHUNK) {
        const long c = T - j0 < NY_CHUNK ? T - j0 : NY_CHUNK;
        const float *kc = k + (bh * T + j0) * d, *vc = v + (bh * T + j0) * d;
        gemm(false, true, m, c, d, st->scale, sv.qt, kc, 0.0f, s);
        for (long i = 0; i < m; i++) {
          float *si = s + i * c, *acc = row + i * w, mx = acc[d + 1];
          for (long j = 0; j < c; j++) mx = si[j] > mx ? si[j] : mx;
          const float alpha = expf(acc[d + 1] - mx); /* 0 on the first chunk */
          float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
          for (long j = 0; j < c; j++) {
            si[j] = expf(si[j] - mx);
            sum += si[j];
          }
          for (long f = 0; f < d; f++) acc[f] *= alpha;
          acc[d] = acc[d] * alpha + sum;
          acc[d + 1] = mx;
        }
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)m, (int)d, (int)c, 1.0f, s,
                    (int)c, vc, (int)d, 1.0f, row, (int)w); /* Σ e·v, rows of stride w */
      }
    }
    mem_free(s);
  }
  if (seq_ranks(ctx) > 1) { /* rescale to the group's maximum, then sum */
    double *top = mem_alloc(MEM_COMM, sizeof(double) * (size_t)(BH * m));
    for (long i = 0; i < BH * m; i++) top[i] = stats[i * w + d + 1];
    comm_allreduce_max_double(ctx->comm, COMM_SEQ, top, (size_t)(BH * m));
    for (long i = 0; i < BH * m; i++) {
      float *acc = stats + i * w;
      const float f = acc[d] > 0.0f ? expf(acc[d + 1] - (float)top[i]) : 0.0f;
      for (long c = 0; c <= d; c++) acc[c] *= f;
      acc[d + 1] = (float)top[i];
    }
    float *sums = mem_alloc(MEM_COMM, sizeof(float) * (size_t)(BH * m * (d + 1)));
    for (long i = 0; i < BH * m; i++)
      memcpy(sums + i * (d + 1), stats + i * w, sizeof(float) * (size_t)(d + 1));
    comm_allreduce_sum_float(ctx->comm, COMM_SEQ, sums, (size_t)(BH * m * (d + 1)));
    for (long i = 0; i < BH * m; i++)
      memcpy(stats + i * w, sums + i * (d + 1), sizeof(float) * (size_t)(d + 1));
    mem_free(sums);
    mem_free(top);
  }
  for (long bh = 0; bh < BH; bh++) {
    const struct ny_saved sv = saved_row(st, d, saved, bh);
    for (long i = 0; i < m; i++) {
      const float *acc = stats + (bh * m + i) * w;
      for (long f = 0; f < d; f++) sv.U[i * d + f] = acc[f] / acc[d];
      sv.lse[i] = acc[d + 1] + logf(acc[d]);
    }
  }
  mem_free(stats);
}

/* The depthwise convolution over the sequence, one kernel w (k) per head, centred and
 * zero-padded: y[i] += Σ_t w[t] · v[i + t − r], r = (k − 1)/2, for v given over global tokens
 * [lo, lo + E) (the slab and its halo) and outputs at [t0, t0 + T). */
static void conv_forward(float *y, const float *vext, long lo, long E, long t0, long T, long d,
                         const float *w, int k) {
  const long r = (k - 1) / 2;
  for (long i = 0; i < T; i++)
    for (int t = 0; t < k; t++) {
      const long j = t0 + i + t - r - lo; /* row of vext */
      if (j < 0 || j >= E) continue;      /* outside [0, n): zero padding */
      const float wt = w[t];
      for (long c = 0; c < d; c++) y[i * d + c] += wt * vext[j * d + c];
    }
}

/* Its transpose: dvext (E, d) += Σ_t w[t]·dy[i], dw (k) += Σ_i dy[i]·v[i + t − r]. */
static void conv_backward(float *dvext, float *dw, const float *dy, const float *vext, long lo,
                          long E, long t0, long T, long d, const float *w, int k) {
  const long r = (k - 1) / 2;
  for (int t = 0; t < k; t++) {
    double acc = 0.0;
    for (long i = 0; i < T; i++) {
      const long j = t0 + i + t - r - lo;
      if (j < 0 || j >= E) continue;
      float dot = 0.0f;
      for (long c = 0; c < d; c++) {
        dvext[j * d + c] += w[t] * dy[i * d + c];
        dot += dy[i * d + c] * vext[j * d + c];
      }
      acc += dot;
    }
    if (dw) dw[t] += (float)acc;
  }
}

/* The convolution's halo: (k − 1)/2 tokens each side, gathered for v (B·H rows). */
static float *conv_halo(struct attn_ctx *ctx, struct halo *h, const float *v) {
  const struct ny_state *st = ctx->state;
  const struct attn_dims *dm = &ctx->dims;
  const long r = (st->k - 1) / 2, rows = dm->B * dm->H;
  halo_plan(h, ctx->comm, dm->n, dm->T, r, r);
  float *ext = mem_alloc(MEM_WORKSPACE, sizeof(float) * (size_t)(rows * (h->hi - h->lo) * dm->d));
  halo_gather(h, ctx->comm, ext, v, rows, dm->d);
  return ext;
}

static void ny_forward(struct attn_ctx *ctx, float *out, float *saved, const float *q,
                       const float *k, const float *v, const float *params) {
  const struct ny_state *st = ctx->state;
  const struct attn_dims *dm = &ctx->dims;
  const long BH = dm->B * dm->H, T = dm->T, d = dm->d, m = st->m;
  landmarks(ctx, saved, q, k);
#pragma omp parallel
  {
    float *A = mem_alloc(MEM_WORKSPACE, sizeof(float) * (size_t)(5 * m * m));
#pragma omp for schedule(dynamic, 1)
    for (long bh = 0; bh < BH; bh++) {
      struct ny_saved sv = saved_row(st, d, saved, bh);
      landmark_softmax(st, A, &sv, d);
      nystrom_pinv(sv.Z, A, m, st->iters, A + m * m);
    }
    mem_free(A);
  }
  b_pass(ctx, saved, k, v);
#pragma omp parallel
  {
    float *G = mem_alloc(MEM_WORKSPACE, sizeof(float) * (size_t)(m * d + NY_CHUNK * m));
    float *F = G + m * d;
#pragma omp for schedule(dynamic, 1)
    for (long bh = 0; bh < BH; bh++) { /* out = F (pinv(A) U), query chunk by query chunk */
      const struct ny_saved sv = saved_row(st, d, saved, bh);
      gemm(false, false, m, d, m, 1.0f, sv.Z + (size_t)st->iters * m * m, sv.U, 0.0f, G);
      for (long i0 = 0; i0 < T; i0 += NY_CHUNK) {
        const long c = T - i0 < NY_CHUNK ? T - i0 : NY_CHUNK;
        gemm(false, true, c, m, d, st->scale, q + (bh * T + i0) * d, sv.kt, 0.0f, F);
        softmax_rows(F, c, m, NULL);
        gemm(false, false, c, d, m, 1.0f, F, G, 0.0f, out + (bh * T + i0) * d);
      }
    }
    mem_free(G);
  }
  if (st->k > 0) {
    struct halo h;
    float *vext = conv_halo(ctx, &h, v);
    const long E = h.hi - h.lo;
#pragma omp parallel for schedule(static)
    for (long bh = 0; bh < BH; bh++)
      conv_forward(out + bh * T * d, vext + bh * E * d, h.lo, E, dm->t0, T, d,
                   params + (bh % dm->H) * st->k, st->k);
    mem_free(vext);
    halo_free(&h);
  }
}

/* The F-pass transposed, over this rank's queries: dq += its share, and per row gk = [dG; dkt]
 * (2, m, d), the sums over the queries of dG = Fᵀ dout and of the keys' landmark gradient. */
static void f_pass_backward(const struct attn_ctx *ctx, float *gk, float *dq, const float *dout,
                            const float *q, float *saved) {
  const struct ny_state *st = ctx->state;
  const long BH = ctx->dims.B * ctx->dims.H, T = ctx->dims.T, d = ctx->dims.d, m = st->m;
  const size_t md = (size_t)(m * d);
#pragma omp parallel
  {
    float *G = mem_alloc(MEM_WORKSPACE, sizeof(float) * (size_t)(m * d + 2 * NY_CHUNK * m));
    float *F = G + m * d, *dF = F + NY_CHUNK * m;
#pragma omp for schedule(dynamic, 1)
    for (long bh = 0; bh < BH; bh++) {
      const struct ny_saved sv = saved_row(st, d, saved, bh);
      float *dG = gk + 2 * md * bh, *dkt = dG + md;
      gemm(false, false, m, d, m, 1.0f, sv.Z + (size_t)st->iters * m * m, sv.U, 0.0f, G);
      for (long i0 = 0; i0 < T; i0 += NY_CHUNK) {
        const long c = T - i0 < NY_CHUNK ? T - i0 : NY_CHUNK;
        const float *qc = q + (bh * T + i0) * d, *gc = dout + (bh * T + i0) * d;
        gemm(false, true, c, m, d, st->scale, qc, sv.kt, 0.0f, F);
        softmax_rows(F, c, m, NULL);
        gemm(true, false, m, d, c, 1.0f, F, gc, 1.0f, dG); /* dG += Fᵀ dout */
        gemm(false, true, c, m, d, 1.0f, gc, G, 0.0f, dF); /* dF = dout Gᵀ */
        softmax_rows_backward(dF, F, c, m);
        gemm(false, false, c, d, m, st->scale, dF, sv.kt, 1.0f, dq + (bh * T + i0) * d);
        gemm(true, false, m, d, c, st->scale, dF, qc, 1.0f, dkt);
      }
    }
    mem_free(G);
  }
}

/* The m × m part, alike on every rank: from dG (gk, summed over the group), dU = Wᵀ dG, the
 * pinv's and A's transposes into dqtA (m, d) and the keys' landmark gradient dkt (in gk). */
static void landmark_backward(const struct attn_ctx *ctx, float *gk, float *dU, float *dqtA,
                              float *saved) {
  const struct ny_state *st = ctx->state;
  const long BH = ctx->dims.B * ctx->dims.H, d = ctx->dims.d, m = st->m;
  const size_t md = (size_t)(m * d);
#pragma omp parallel
  {
    float *A = mem_alloc(MEM_WORKSPACE, sizeof(float) * (size_t)(11 * m * m));
    float *dA = A + m * m, *dW = A + 2 * m * m, *work = A + 3 * m * m;
#pragma omp for schedule(dynamic, 1)
    for (long bh = 0; bh < BH; bh++) {
      struct ny_saved sv = saved_row(st, d, saved, bh);
      const float *W = sv.Z + (size_t)st->iters * m * m;
      float *dG = gk + 2 * md * bh, *dkt = dG + md;
      landmark_softmax(st, A, &sv, d);
      gemm(false, true, m, m, d, 1.0f, dG, sv.U, 0.0f, dW);        /* dW = dG Uᵀ */
      gemm(true, false, m, d, m, 1.0f, W, dG, 0.0f, dU + md * bh); /* dU = Wᵀ dG */
      memset(dA, 0, sizeof(float) * (size_t)(m * m));
      pinv_backward(dA, dW, A, sv.Z, m, st->iters, work);
      softmax_rows_backward(dA, A, m, m);
      gemm(false, false, m, d, m, st->scale, dA, sv.kt, 0.0f, dqtA + md * bh);
      gemm(true, false, m, d, m, st->scale, dA, sv.qt, 1.0f, dkt);
    }
    mem_free(A);
  }
}

/* The B-pass transposed, over this rank's keys: dv += Bᵀ dU, dk += its share, and the queries'
 * landmark gradient dqt (m, d) per row (this rank's keys' part). */
static void b_pass_backward(const struct attn_ctx *ctx, float *dqt, float *dk, float *dv,
                            const float *dU, const float *k, const float *v, float *saved) {
  const struct ny_state *st = ctx->state;
  const long BH = ctx->dims.B * ctx->dims.H, T = ctx->dims.T, d = ctx->dims.d, m = st->m;
  const size_t md = (size_t)(m * d);
#pragma omp parallel
  {
    float *P = mem_alloc(MEM_WORKSPACE, sizeof(float) * (size_t)(2 * m * NY_CHUNK + m));
    float *dP = P + m * NY_CHUNK, *D = dP + m * NY_CHUNK;
#pragma omp for schedule(dynamic, 1)
    for (long bh = 0; bh < BH; bh++) {
      const struct ny_saved sv = saved_row(st, d, saved, bh);
      const float *dUb = dU + md * bh;
      float *dqtb = dqt + md * bh;
      for (long i = 0; i < m; i++) { /* D_i = Σ_j B_ij dP_ij = dU_i · U_i */
        float s = 0.0f;
        for (long f = 0; f < d; f++) s += dUb[i * d + f] * sv.U[i * d + f];
        D[i] = s;
      }
      for (long j0 = 0; j0 < T; j0 += NY_CHUNK) {
        const long c = T - j0 < NY_CHUNK ? T - j0 : NY_CHUNK;
        const float *kc = k + (bh * T + j0) * d, *vc = v + (bh * T + j0) * d;
        gemm(false, true, m, c, d, st->scale, sv.qt, kc, 0.0f, P);
        for (long i = 0; i < m; i++)
          for (long j = 0; j < c; j++) P[i * c + j] = expf(P[i * c + j] - sv.lse[i]);
        gemm(true, false, c, d, m, 1.0f, P, dUb, 1.0f, dv + (bh * T + j0) * d); /* dv += Bᵀ dU */
        gemm(false, true, m, c, d, 1.0f, dUb, vc, 0.0f, dP);                    /* dP = dU vᵀ */
        for (long i = 0; i < m; i++)
          for (long j = 0; j < c; j++) dP[i * c + j] = P[i * c + j] * (dP[i * c + j] - D[i]);
        gemm(false, false, m, d, c, st->scale, dP, kc, 1.0f, dqtb);
        gemm(true, false, c, d, m, st->scale, dP, sv.qt, 1.0f, dk + (bh * T + j0) * d);
      }
    }
    mem_free(P);
  }
}

/* Landmarks are segment means: each of this rank's tokens gets 1/seg of its segment's landmark
 * gradients (dqt + dqtA for q, dkt for k). */
static void segment_means_backward(const struct attn_ctx *ctx, float *dq, float *dk,
                                   const float *gk, const float *dqt, const float *dqtA) {
  const struct ny_state *st = ctx->state;
  const long BH = ctx->dims.B * ctx->dims.H, T = ctx->dims.T, d = ctx->dims.d;
  const size_t md = (size_t)(st->m * d);
#pragma omp parallel for schedule(static)
  for (long bh = 0; bh < BH; bh++) {
    const float *dkt = gk + 2 * md * bh + md, *dqk = dqt + md * bh, *dqa = dqtA + md * bh;
    for (long j = 0; j < st->mloc; j++) {
      const long g = st->s0 + j; /* the segment's global index */
      for (long t = 0; t < st->seg; t++)
        for (long f = 0; f < d; f++) {
          const long at = (bh * T + j * st->seg + t) * d + f;
          dq[at] += (dqk[g * d + f] + dqa[g * d + f]) / (float)st->seg;
          dk[at] += dkt[g * d + f] / (float)st->seg;
        }
    }
  }
}

/* The depthwise convolution's transpose over the slab and its halo: dv and dparams (H, k). */
static void conv_layer_backward(struct attn_ctx *ctx, float *dv, float *dparams, const float *dout,
                                const float *v, const float *params) {
  const struct ny_state *st = ctx->state;
  const struct attn_dims *dm = &ctx->dims;
  const long BH = dm->B * dm->H, T = dm->T, d = dm->d;
  struct halo h;
  float *vext = conv_halo(ctx, &h, v);
  const long E = h.hi - h.lo;
  float *dvext = mem_alloc(MEM_WORKSPACE, sizeof(float) * (size_t)(BH * E * d));
  float *dwp = dparams ? mem_alloc(MEM_WORKSPACE, sizeof(float) * (size_t)(BH * st->k)) : NULL;
#pragma omp parallel for schedule(static)
  for (long bh = 0; bh < BH; bh++)
    conv_backward(dvext + bh * E * d, dwp ? dwp + bh * st->k : NULL, dout + bh * T * d,
                  vext + bh * E * d, h.lo, E, dm->t0, T, d, params + (bh % dm->H) * st->k, st->k);
  for (long bh = 0; bh < BH && dwp; bh++) /* dw (H, k), summed over the batch in order */
    for (int t = 0; t < st->k; t++) dparams[(bh % dm->H) * st->k + t] += dwp[bh * st->k + t];
  halo_scatter_add(&h, ctx->comm, dv, dvext, BH, d);
  mem_free(dwp);
  mem_free(dvext);
  mem_free(vext);
  halo_free(&h);
}

/* Backward, the forward's passes transposed in reverse: the F-pass (queries), the m × m part, the
 * B-pass (keys), the segment means, and the convolution; the sums that span the sequence group
 * (over queries, then over keys) are allreduced between them. */
static void ny_backward(struct attn_ctx *ctx, float *dq, float *dk, float *dv, float *dparams,
                        const float *dout, const float *q, const float *k, const float *v,
                        const float *params, const float *out, const float *saved) {
  const struct ny_state *st = ctx->state;
  const long BH = ctx->dims.B * ctx->dims.H;
  const size_t md = (size_t)(st->m * ctx->dims.d);
  float *sv = (float *)saved;
  /* Per row: gk = [dG; dkt] (2, m, d), the sums over this rank's queries, then over the group;
   * dqt (m, d), the keys' share of dqt, likewise; dqtA (m, d), A's share (alike on every rank). */
  float *gk = mem_alloc(MEM_WORKSPACE, sizeof(float) * 2 * md * (size_t)BH);
  float *dqt = mem_alloc(MEM_WORKSPACE, sizeof(float) * md * (size_t)BH);
  float *dqtA = mem_alloc(MEM_WORKSPACE, sizeof(float) * md * (size_t)BH);
  float *dU = mem_alloc(MEM_WORKSPACE, sizeof(float) * md * (size_t)BH);
  f_pass_backward(ctx, gk, dq, dout, q, sv);
  if (seq_ranks(ctx) > 1) comm_allreduce_sum_float(ctx->comm, COMM_SEQ, gk, 2 * md * (size_t)BH);
  landmark_backward(ctx, gk, dU, dqtA, sv);
  b_pass_backward(ctx, dqt, dk, dv, dU, k, v, sv);
  if (seq_ranks(ctx) > 1) comm_allreduce_sum_float(ctx->comm, COMM_SEQ, dqt, md * (size_t)BH);
  segment_means_backward(ctx, dq, dk, gk, dqt, dqtA);
  mem_free(dU);
  mem_free(dqtA);
  mem_free(dqt);
  mem_free(gk);
  if (st->k > 0) conv_layer_backward(ctx, dv, dparams, dout, v, params);
}

/* ---------------------------------------------------------------------------------------------
 * diagnostics, FLOPs and the ops table */

/* Diagnostics: the rows of the approximate attention matrix F·pinv(A)·B are not a distribution
 * (pinv makes them signed), so they are not classified into distance bands; the entropy and mass
 * reported are those of F, each query's softmax over the landmarks, placed at the landmark
 * segments' centres. */
static double landmark_score(const struct attn_ctx *ctx, const float *qi, long i, const float *kj,
                             long j, long width, const void *user) {
  const struct ny_state *st = ctx->state;
  if (j % st->seg != st->seg / 2) return -INFINITY; /* one key per segment: its centre */
  double dot = 0.0;
  for (long c = 0; c < width; c++) dot += (double)qi[c] * kj[c];
  return dot * st->scale;
}

static long ny_diagnostics(struct attn_ctx *ctx, double *mass, double *entropy, const float *q,
                           const float *k, const float *v, const float *params) {
  const struct ny_state *st = ctx->state;
  const struct attn_dims *dm = &ctx->dims;
  const long T = dm->T, d = dm->d;
  const int bands = ctx->opt.diag_bands;
  float *kc = mem_alloc(MEM_WORKSPACE, sizeof(float) * (size_t)(T * d));
  long nq = 0;
  for (long h = 0; h < dm->H; h++) { /* batch element 0: each segment centre carries its mean key */
    const float *kh = k + h * T * d;
    for (long j = 0; j < st->mloc; j++)
      for (long f = 0; f < d; f++) {
        float s = 0.0f;
        for (long t = 0; t < st->seg; t++) s += kh[(j * st->seg + t) * d + f];
        for (long t = 0; t < st->seg; t++) kc[(j * st->seg + t) * d + f] = s / (float)st->seg;
      }
    nq = attention_diag_rows(ctx, mass + h * bands, entropy + h, q + h * T * d, kc, d,
                             ATTENTION_DIAG_QUERIES, landmark_score, NULL);
  }
  mem_free(kc);
  return nq;
}

/* Forward FLOPs of this rank's share, per (batch, head): the F- and B-passes (4·d per query ×
 * landmark and landmark × key), the m × m work (A, the iterations' 6 products, W·U), the landmark
 * means and the convolution. */
static double ny_flops(const struct attn_ctx *ctx, double *p2p_flops) {
  const struct ny_state *st = ctx->state;
  const struct attn_dims *dm = &ctx->dims;
  const double T = (double)dm->T, d = (double)dm->d, m = st->m, S = ctx->comm ? ctx->comm->S : 1;
  const double small = (2.0 * m * m * d + st->iters * 6.0 * 2.0 * m * m * m + 2.0 * m * m * d) / S;
  *p2p_flops = 0.0;
  return (double)(dm->B * dm->H) * (8.0 * T * m * d + small + 2.0 * T * d + 2.0 * T * st->k * d);
}

struct attn_variant attention_nystrom = {
    .name = "nystrom",
    .causal_ok = false,
    .bidir_ok = true,
    .check = ny_check,
    .describe = ny_describe,
    .setup = ny_setup,
    .teardown = ny_teardown,
    .diagnostics = ny_diagnostics,
    .flops = ny_flops,
    .cpu = {.saved_floats = ny_saved_floats, .forward = ny_forward, .backward = ny_backward},
};
