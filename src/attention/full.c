/* Exact softmax attention, whole or banded: `full` (SPEC §6.1), softmax(q kᵀ/√d + mask) v, and
 * `local` (SPEC §6.2), the same restricted to a band of keys. Computed tile by tile with an online
 * softmax (running max and sum per query row), so memory is O(n·d) and never O(n²); backward
 * recomputes score tiles from the saved log-sum-exp. The block kernels take the global offsets of
 * their query and key rows, so the sequence-parallel paths (SPEC §7) reuse them: `full` passes
 * key/value blocks round a ring (zigzag order when causal), `local` gathers the band's halo; they
 * must never hold the whole sequence's k, v on one rank (the ring holds two slabs' worth at a time,
 * `local` its band). `full` is the reference every variant is measured against. */
#include <cblas.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attention/attention.h"
#include "attention/exact.h"
#include "attention/ring.h"
#include "error.h"
#include "halo.h"
#include "memory.h"
#include "vecmath.h"

/* Online-softmax state of a query slab: m (Tq) running max, l (Tq) running sum, acc (Tq, d). */
struct online_state {
  float *m, *l, *acc;
};

/* Accumulate keys [koff, koff + Tk) into the state of queries [i0, i1) of a slab whose row 0 is
 * global query qoff, for one (b, h). S: (tile, tile) scratch. Dead tiles are skipped. */
static void exact_block_forward(struct online_state st, const float *q, long qoff, const float *k,
                                const float *v, long Tk, long koff, int d, struct key_mask mk,
                                int tile, long i0, long i1, float *S) {
  const float scale = 1.0f / sqrtf((float)d);
  const long bi = i1 - i0;
  long jlo, jhi;
  live_keys(mk, qoff + i0, qoff + i1 - 1, koff, Tk, tile, &jlo, &jhi);
  for (long j0 = jlo; j0 < jhi; j0 += tile) {
    const long bj = Tk - j0 < tile ? Tk - j0 : tile;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)bi, (int)bj, d, scale, q + i0 * d, d,
                k + j0 * d, d, 0.0f, S, (int)bj);
    for (long r = 0; r < bi; r++) {
      float *s = S + r * bj;
      long c0, c1;
      tile_columns(mk, qoff + i0 + r, koff + j0, bj, &c0, &c1);
      float *mrow = st.m + i0 + r, *lrow = st.l + i0 + r, *arow = st.acc + (i0 + r) * d;
      if (c1 == c0) {
        memset(s, 0, sizeof(float) * (size_t)bj);
        continue;
      }
      for (long c = 0; c < c0; c++) s[c] = -INFINITY;
      for (long c = c1; c < bj; c++) s[c] = -INFINITY;
      float mx = *mrow;
      for (long c = c0; c < c1; c++) mx = s[c] > mx ? s[c] : mx;
      const float alpha = expf(*mrow - mx); /* exp(−inf) = 0 on the first live tile */
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (long c = 0; c < bj; c++) {
        s[c] = expf(s[c] - mx);
        sum += s[c];
      }
      *lrow = *lrow * alpha + sum;
      *mrow = mx;
      if (alpha != 1.0f)
        for (int c = 0; c < d; c++) arow[c] *= alpha;
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)bi, d, (int)bj, 1.0f, S, (int)bj,
                v + j0 * d, d, 1.0f, st.acc + i0 * d, d);
  }
}

/* Gradient contributions of keys [koff, koff + Tk) to queries [qoff, qoff + Tq) of one (b, h)
 * for the output gradient alpha·dout: dq (Tq, d) += …, dk, dv (Tk, d) += …; lse and D (Tq) as
 * saved and precomputed (D already scaled by alpha). */
static void exact_block_backward(float *dq, float *dk, float *dv, const float *dout, float alpha,
                                 const float *q, const float *lse, const float *D, long Tq,
                                 long qoff, const float *k, const float *v, long Tk, long koff,
                                 int d, struct key_mask mk, int tile, float *S, float *dP) {
  const float scale = 1.0f / sqrtf((float)d);
  for (long i0 = 0; i0 < Tq; i0 += tile) {
    const long bi = Tq - i0 < tile ? Tq - i0 : tile;
    long jlo, jhi;
    live_keys(mk, qoff + i0, qoff + i0 + bi - 1, koff, Tk, tile, &jlo, &jhi);
    for (long j0 = jlo; j0 < jhi; j0 += tile) {
      const long bj = Tk - j0 < tile ? Tk - j0 : tile;
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)bi, (int)bj, d, scale, q + i0 * d,
                  d, k + j0 * d, d, 0.0f, S, (int)bj);
      for (long r = 0; r < bi; r++) {
        float *s = S + r * bj;
        const float L = lse[i0 + r];
        long c0, c1;
        tile_columns(mk, qoff + i0 + r, koff + j0, bj, &c0, &c1);
#pragma omp simd
        for (long c = 0; c < bj; c++) s[c] = expf(s[c] - L);
        for (long c = 0; c < c0; c++) s[c] = 0.0f;
        for (long c = c1; c < bj; c++) s[c] = 0.0f;
      }
      /* dv_j += Pᵀ dO_i */
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)bj, d, (int)bi, alpha, S, (int)bj,
                  dout + i0 * d, d, 1.0f, dv + j0 * d, d);
      /* dP = dO_i v_jᵀ */
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)bi, (int)bj, d, alpha,
                  dout + i0 * d, d, v + j0 * d, d, 0.0f, dP, (int)bj);
      /* dS = P ∘ (dP − D_i), stored in dP */
      for (long r = 0; r < bi; r++) {
        const float Di = D[i0 + r];
        const float *p = S + r * bj;
        float *g = dP + r * bj;
#pragma omp simd
        for (long c = 0; c < bj; c++) g[c] = p[c] * (g[c] - Di);
      }
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)bi, d, (int)bj, scale, dP,
                  (int)bj, k + j0 * d, d, 1.0f, dq + i0 * d, d);
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)bj, d, (int)bi, scale, dP, (int)bj,
                  q + i0 * d, d, 1.0f, dk + j0 * d, d);
    }
  }
}

/* ---------------------------------------------------------------------------------------------
 * one slab of queries against one contiguous range of keys: the whole op on one rank, and `local`
 * against its halo-extended keys */

extern struct attn_variant attention_local;
extern struct attn_variant attention_fish_full, attention_fish_local;

static struct key_mask mask_of(const struct attn_ctx *ctx, long band) {
  return (struct key_mask){ctx->dims.causal, band};
}

/* The band of the two variants of this file: local.band for `local`, none for `full`. */
static long variant_band(const struct attn_ctx *ctx) {
  return ctx->variant == &attention_local ? ctx->cfg->attention.local_band : 0;
}

/* Query/key tile: full.block, or for a band a tile of about half the band (at least 16): a query
 * tile then reads (tile + band − 1) keys rounded up to whole tiles, and a smaller tile wastes fewer
 * masked entries (band 64: 96 keys per query with tiles of 32, 128 with tiles of 64), which pays
 * for the smaller GEMMs (measured in bench, docs/kernelized.md). */
static int exact_tile(const struct attn_ctx *ctx, struct key_mask mk) {
  const int block = ctx->cfg->attention.full_block;
  if (mk.band <= 0) return block;
  int tile = 16;
  while (tile < block && 2 * tile < mk.band) tile *= 2;
  return tile < block ? tile : block;
}

/* The scale of the output gradient of row block bh (rows of T tokens, heads cycling fastest
 * after batch): head_scale[bh % H], or 1. */
static float head_alpha(const float *head_scale, long bh, long H) {
  return head_scale ? head_scale[bh % H] : 1.0f;
}

/* D (B·H·T) = rowsum(alpha·dout ∘ out), the softmax backward's per-row correction. */
static void exact_rowdot(float *D, const float *dout, const float *out, long BH, long T, long H,
                         int d, const float *head_scale) {
#pragma omp parallel for schedule(static)
  for (long r = 0; r < BH * T; r++) {
    float s = 0.0f;
    for (int c = 0; c < d; c++) s += dout[r * d + c] * out[r * d + c];
    D[r] = head_alpha(head_scale, r / T, H) * s;
  }
}

/* out (B, H, T, d), lse (B, H, T) for queries at global qoff against keys k, v (B, H, Tk, d) at
 * global koff. */
static void slab_forward(const struct attn_ctx *ctx, struct key_mask mk, float *out, float *lse,
                         const float *q, long qoff, const float *k, const float *v, long Tk,
                         long koff) {
  const struct attn_dims *dm = &ctx->dims;
  const long T = dm->T, BH = dm->B * dm->H;
  const int d = (int)dm->d, tile = exact_tile(ctx, mk);
  const long ntiles = (T + tile - 1) / tile;
  float *ml = mem_alloc(MEM_WORKSPACE, sizeof(float) * 2 * (size_t)(BH * T)); /* m, l */
#pragma omp parallel
  {
    float *S = mem_alloc(MEM_WORKSPACE, sizeof(float) * (size_t)tile * tile);
#pragma omp for schedule(dynamic, 1) collapse(2)
    for (long bh = 0; bh < BH; bh++)
      for (long it = 0; it < ntiles; it++) {
        const long i0 = it * tile, i1 = i0 + tile < T ? i0 + tile : T;
        const size_t off = (size_t)bh * T * d, koff_bh = (size_t)bh * Tk * d;
        struct online_state st = {ml + bh * T, ml + BH * T + bh * T, out + off};
        for (long i = i0; i < i1; i++) {
          st.m[i] = -INFINITY;
          st.l[i] = 0.0f;
        }
        memset(out + off + i0 * d, 0, sizeof(float) * (size_t)((i1 - i0) * d));
        exact_block_forward(st, q + off, qoff, k + koff_bh, v + koff_bh, Tk, koff, d, mk, tile, i0,
                            i1, S);
        for (long i = i0; i < i1; i++) {
          const float inv = 1.0f / st.l[i];
          for (int c = 0; c < d; c++) st.acc[i * d + c] *= inv;
          lse[bh * T + i] = st.m[i] + logf(st.l[i]);
        }
      }
    mem_free(S);
  }
  mem_free(ml);
}

/* dq (B, H, T, d) and dk, dv (B, H, Tk, d) += the gradients of slab_forward's op. */
static void slab_backward(const struct attn_ctx *ctx, struct key_mask mk, const float *head_scale,
                          float *dq, float *dk, float *dv, const float *dout, const float *q,
                          long qoff, const float *k, const float *v, long Tk, long koff,
                          const float *out, const float *lse) {
  const struct attn_dims *dm = &ctx->dims;
  const long T = dm->T, BH = dm->B * dm->H;
  const int d = (int)dm->d, tile = exact_tile(ctx, mk);
  float *D = mem_alloc(MEM_WORKSPACE, sizeof(float) * (size_t)(BH * T));
  exact_rowdot(D, dout, out, BH, T, dm->H, d, head_scale);
#pragma omp parallel
  {
    float *S = mem_alloc(MEM_WORKSPACE, sizeof(float) * 2 * (size_t)tile * tile);
#pragma omp for schedule(dynamic, 1)
    for (long bh = 0; bh < BH; bh++) {
      const size_t off = (size_t)bh * T * d, koff_bh = (size_t)bh * Tk * d;
      exact_block_backward(dq + off, dk + koff_bh, dv + koff_bh, dout + off,
                           head_alpha(head_scale, bh, dm->H), q + off, lse + bh * T, D + bh * T, T,
                           qoff, k + koff_bh, v + koff_bh, Tk, koff, d, mk, tile, S,
                           S + (size_t)tile * tile);
    }
    mem_free(S);
  }
  mem_free(D);
}

/* `local` under sequence parallelism: the band's halo (band − 1 tokens before the slab, and after
 * it when bidirectional, clipped to [0, n), possibly from several ranks) gathered into extended
 * k, v (B, H, hi − lo, d); k and v travel stacked as 2·B·H rows so one alltoallv moves both. */
static float *local_halo(const struct attn_ctx *ctx, long band, struct halo *h, const float *k,
                         const float *v) {
  const struct attn_dims *dm = &ctx->dims;
  const long BH = dm->B * dm->H, X = BH * dm->T * dm->d, reach = band - 1;
  halo_plan(h, ctx->comm, dm->n, dm->T, reach, dm->causal ? 0 : reach);
  float *kv = mem_alloc(MEM_COMM, sizeof(float) * 2 * (size_t)X); /* (2, B, H, T, d) */
  memcpy(kv, k, sizeof(float) * (size_t)X);
  memcpy(kv + X, v, sizeof(float) * (size_t)X);
  float *ext = mem_alloc(MEM_WORKSPACE, sizeof(float) * 2 * (size_t)(BH * (h->hi - h->lo) * dm->d));
  halo_gather(h, ctx->comm, ext, kv, 2 * BH, dm->d);
  mem_free(kv);
  return ext; /* (2, B, H, hi − lo, d) */
}

static void local_forward(struct attn_ctx *ctx, long band, float *out, float *lse, const float *q,
                          const float *k, const float *v) {
  const struct attn_dims *dm = &ctx->dims;
  struct halo h;
  float *ext = local_halo(ctx, band, &h, k, v);
  const long E = h.hi - h.lo;
  slab_forward(ctx, mask_of(ctx, band), out, lse, q, dm->t0, ext, ext + dm->B * dm->H * E * dm->d,
               E, h.lo);
  mem_free(ext);
  halo_free(&h);
}

/* Backward gathers the halo again (saved holds only the log-sum-exp), forms dk, dv over the
 * extended range and sends the halo parts back to their owners. */
static void local_backward(struct attn_ctx *ctx, long band, const float *head_scale, float *dq,
                           float *dk, float *dv, const float *dout, const float *q, const float *k,
                           const float *v, const float *out, const float *lse) {
  const struct attn_dims *dm = &ctx->dims;
  const long BH = dm->B * dm->H, X = BH * dm->T * dm->d;
  struct halo h;
  float *ext = local_halo(ctx, band, &h, k, v);
  const long E = h.hi - h.lo, XE = BH * E * dm->d;
  float *dext = mem_alloc(MEM_WORKSPACE, sizeof(float) * 2 * (size_t)XE); /* (2, B, H, E, d) */
  slab_backward(ctx, mask_of(ctx, band), head_scale, dq, dext, dext + XE, dout, q, dm->t0, ext,
                ext + XE, E, h.lo, out, lse);
  mem_free(ext);
  float *dkv = mem_alloc(MEM_COMM, sizeof(float) * 2 * (size_t)X); /* (2, B, H, T, d) */
  halo_scatter_add(&h, ctx->comm, dkv, dext, 2 * BH, dm->d);
#pragma omp parallel for schedule(static)
  for (long i = 0; i < X; i++) {
    dk[i] += dkv[i];
    dv[i] += dkv[X + i];
  }
  mem_free(dkv);
  mem_free(dext);
  halo_free(&h);
}

/* ---------------------------------------------------------------------------------------------
 * `full` under sequence parallelism: a ring of S steps. At step t rank z holds the k, v of rank
 * z − t and folds them into the online softmax of its queries, while sending them on to z + 1 and
 * receiving those of z − t − 1 (double buffering, so the transfer overlaps the block GEMMs).
 *
 * Causal: the sequence is cut into 2S chunks of c = T/2 tokens and, inside the op only, rank z
 * works on chunks z and 2S−1−z (zigzag), so every rank has the same share of the causal triangle;
 * one alltoallv moves the inputs from the model's contiguous slabs (rank s: chunks 2s, 2s+1) and
 * one moves the results back. When T is odd the causal ring runs on the contiguous slabs instead
 * (exact, but rank S − 1 then does about twice the average work). Bidirectional: contiguous. */

/* The ring's layout and what exact attention adds to it. */
struct exact_ring {
  struct ring lay;
  long BH, H;
  int d, tile;
  struct key_mask mk;
};

static struct exact_ring exact_ring_plan(const struct attn_ctx *ctx) {
  const struct attn_dims *dm = &ctx->dims;
  struct exact_ring rg = {.lay = ring_plan(ctx->comm, dm->T, dm->causal)};
  rg.BH = dm->B * dm->H;
  rg.H = dm->H;
  rg.d = (int)dm->d;
  rg.mk = mask_of(ctx, 0);
  rg.tile = exact_tile(ctx, rg.mk);
  return rg;
}

/* Fold the keys kv (k then v, each (BH, T, d), of rank src) into the online state of my queries
 * q (BH, T, d); OpenMP over (b, h, query piece and tile). */
static void ring_forward_step(const struct exact_ring *rg, struct online_state st, const float *q,
                              const float *kv, int src) {
  const long L = rg->lay.L, T = rg->lay.T, ntp = (L + rg->tile - 1) / rg->tile,
             X = rg->BH * T * rg->d;
  const int d = rg->d;
#pragma omp parallel
  {
    float *S = mem_alloc(MEM_WORKSPACE, sizeof(float) * (size_t)rg->tile * rg->tile);
#pragma omp for schedule(dynamic, 1) collapse(2)
    for (long bh = 0; bh < rg->BH; bh++)
      for (long it = 0; it < rg->lay.pieces * ntp; it++) {
        const int p = (int)(it / ntp);
        const long i0 = it % ntp * rg->tile, i1 = i0 + rg->tile < L ? i0 + rg->tile : L;
        const long qo = bh * T + p * L;
        struct online_state s = {st.m + qo, st.l + qo, st.acc + qo * d};
        for (int kp = 0; kp < rg->lay.pieces; kp++) {
          const long ko = (bh * T + kp * L) * d;
          exact_block_forward(s, q + qo * d, ring_offset(&rg->lay, rg->lay.me, p), kv + ko,
                              kv + X + ko, L, ring_offset(&rg->lay, src, kp), d, rg->mk, rg->tile,
                              i0, i1, S);
        }
      }
    mem_free(S);
  }
}

static void ring_forward(struct attn_ctx *ctx, float *out, float *lse, const float *q,
                         const float *k, const float *v) {
  const struct exact_ring rg = exact_ring_plan(ctx);
  const bool zig = rg.lay.pieces == 2;
  const long BH = rg.BH, T = rg.lay.T, X = BH * T * rg.d;
  const int d = rg.d;
  float *kv = mem_alloc(MEM_COMM, sizeof(float) * 4 * (size_t)X); /* 2 × (k, v) (BH, T, d) */
  float *cur = kv, *nxt = kv + 2 * X;
  float *ml = mem_alloc(MEM_WORKSPACE, sizeof(float) * 2 * (size_t)(BH * T)); /* m, l (BH, T) */
  float *qz = (float *)q, *oz = out; /* my queries and their output, in the ring's layout */
  if (zig) {
    qz = mem_alloc(MEM_WORKSPACE, sizeof(float) * (size_t)X);
    oz = mem_alloc(MEM_WORKSPACE, sizeof(float) * (size_t)X);
    const long w[3] = {d, d, d}, rows[3] = {BH, BH, BH};
    ring_move(&rg.lay, true, 3, (const float *[]){q, k, v}, (float *[]){qz, cur, cur + X}, rows, w);
  } else {
    memcpy(cur, k, sizeof(float) * (size_t)X);
    memcpy(cur + X, v, sizeof(float) * (size_t)X);
    memset(out, 0, sizeof(float) * (size_t)X);
  }
  for (long i = 0; i < BH * T; i++) ml[i] = -INFINITY;
  const struct online_state st = {ml, ml + BH * T, oz};
  for (int t = 0; t < rg.lay.S; t++) {
    struct ring_xfer x = {0};
    if (t < rg.lay.S - 1) ring_start(&rg.lay, cur, nxt, 2 * (size_t)X, RING_TAG_KV, &x);
    ring_forward_step(&rg, st, qz, cur, (rg.lay.me - t + rg.lay.S) % rg.lay.S);
    if (t < rg.lay.S - 1) {
      ring_finish(&x);
      float *tmp = cur;
      cur = nxt;
      nxt = tmp;
    }
  }
#pragma omp parallel for schedule(static)
  for (long i = 0; i < BH * T; i++) {
    const float inv = 1.0f / st.l[i];
    for (int c = 0; c < d; c++) oz[i * d + c] *= inv;
    lse[i] = st.m[i] + logf(st.l[i]); /* saved in the ring's layout */
  }
  mem_free(kv);
  mem_free(ml);
  if (zig) {
    ring_move(&rg.lay, false, 1, (const float *[]){oz}, (float *[]){out}, (const long[]){BH},
              (const long[]){d});
    mem_free(qz);
    mem_free(oz);
  }
}

/* Gradients of my queries against the keys kv of rank src: dq (BH, T, d) and dkv (dk then dv,
 * each (BH, T, d), src's accumulators) +=; OpenMP over (b, h) as in slab_backward. */
static void ring_backward_step(const struct exact_ring *rg, const float *head_scale, float *dq,
                               float *dkv, const float *dout, const float *q, const float *lse,
                               const float *D, const float *kv, int src) {
  const long L = rg->lay.L, T = rg->lay.T, X = rg->BH * T * rg->d;
  const int d = rg->d, tile = rg->tile;
#pragma omp parallel
  {
    float *S = mem_alloc(MEM_WORKSPACE, sizeof(float) * 2 * (size_t)tile * tile);
#pragma omp for schedule(dynamic, 1)
    for (long bh = 0; bh < rg->BH; bh++)
      for (int p = 0; p < rg->lay.pieces; p++)
        for (int kp = 0; kp < rg->lay.pieces; kp++) {
          const long qo = bh * T + p * L, ko = (bh * T + kp * L) * d;
          exact_block_backward(dq + qo * d, dkv + ko, dkv + X + ko, dout + qo * d,
                               head_alpha(head_scale, bh, rg->H), q + qo * d, lse + qo, D + qo, L,
                               ring_offset(&rg->lay, rg->lay.me, p), kv + ko, kv + X + ko, L,
                               ring_offset(&rg->lay, src, kp), d, rg->mk, tile, S,
                               S + (size_t)tile * tile);
        }
    mem_free(S);
  }
}

/* The ring again, with each rank's dk, dv accumulators following its k, v one step behind: at
 * step t a rank forms the contributions of its queries in a fresh buffer while the accumulator of
 * the same keys arrives from the previous rank and the one it completed at step t − 1 leaves for
 * the next, so both transfers overlap the GEMMs; after the S steps one last pass takes every
 * accumulator home. */
static void ring_backward(struct attn_ctx *ctx, const float *head_scale, float *dq, float *dk,
                          float *dv, const float *dout, const float *q, const float *k,
                          const float *v, const float *out, const float *lse) {
  const struct exact_ring rg = exact_ring_plan(ctx);
  const bool zig = rg.lay.pieces == 2;
  const long BH = rg.BH, T = rg.lay.T, X = BH * T * rg.d;
  const int d = rg.d;
  float *kv = mem_alloc(MEM_COMM, sizeof(float) * 4 * (size_t)X); /* 2 × (k, v) (BH, T, d) */
  float *cur = kv, *nxt = kv + 2 * X;
  float *acc = mem_alloc(MEM_COMM, sizeof(float) * 6 * (size_t)X); /* 3 × (dk, dv) (BH, T, d) */
  float *part = acc, *done = acc + 2 * X, *in = acc + 4 * X;
  float *D = mem_alloc(MEM_WORKSPACE, sizeof(float) * (size_t)(BH * T)); /* (BH, T) */
  /* per row, so formed before the move: 1/d the traffic */
  exact_rowdot(D, dout, out, BH, T, rg.H, d, head_scale);
  const float *qz = q, *doz = dout, *Dz = D;
  float *dqz = dq; /* contiguous: dq accumulates in place */
  float *zbuf = NULL;
  if (zig) {
    zbuf = mem_alloc(MEM_WORKSPACE, sizeof(float) * (size_t)(3 * X + BH * T));
    float *qw = zbuf, *dow = zbuf + X, *Dw = zbuf + 3 * X;
    dqz = zbuf + 2 * X; /* zeroed */
    const long w[5] = {d, d, d, d, 1}, rows[5] = {BH, BH, BH, BH, BH};
    ring_move(&rg.lay, true, 5, (const float *[]){q, k, v, dout, D},
              (float *[]){qw, cur, cur + X, dow, Dw}, rows, w);
    qz = qw, doz = dow, Dz = Dw;
  } else {
    memcpy(cur, k, sizeof(float) * (size_t)X);
    memcpy(cur + X, v, sizeof(float) * (size_t)X);
  }
  for (int t = 0; t < rg.lay.S; t++) {
    struct ring_xfer xkv = {0}, xacc = {0};
    if (t < rg.lay.S - 1) ring_start(&rg.lay, cur, nxt, 2 * (size_t)X, RING_TAG_KV, &xkv);
    if (t > 0) ring_start(&rg.lay, done, in, 2 * (size_t)X, RING_TAG_ACC, &xacc);
    memset(part, 0, sizeof(float) * 2 * (size_t)X);
    ring_backward_step(&rg, head_scale, dqz, part, doz, qz, lse, Dz, cur,
                       (rg.lay.me - t + rg.lay.S) % rg.lay.S);
    if (t > 0) {
      ring_finish(&xacc);
#pragma omp parallel for schedule(static)
      for (long i = 0; i < 2 * X; i++) part[i] += in[i];
    }
    if (t < rg.lay.S - 1) {
      ring_finish(&xkv);
      float *tmp = cur;
      cur = nxt;
      nxt = tmp;
    }
    float *tmp = done;
    done = part;
    part = tmp;
  }
  struct ring_xfer xacc;
  ring_start(&rg.lay, done, in, 2 * (size_t)X, RING_TAG_ACC, &xacc); /* home: my dk, dv in `in` */
  ring_finish(&xacc);
  mem_free(kv);
  mem_free(D);
  const float *hq = NULL, *hk = in, *hv = in + X; /* what to add into the caller's dq, dk, dv */
  if (zig) { /* back to the contiguous slab, into acc[0, 3X), free by now (`in` is acc + 4X) */
    const long w[3] = {d, d, d}, rows[3] = {BH, BH, BH};
    ring_move(&rg.lay, false, 3, (const float *[]){dqz, in, in + X},
              (float *[]){acc, acc + X, acc + 2 * X}, rows, w);
    hq = acc, hk = acc + X, hv = acc + 2 * X;
    mem_free(zbuf);
  }
#pragma omp parallel for schedule(static)
  for (long i = 0; i < X; i++) {
    if (hq) dq[i] += hq[i];
    dk[i] += hk[i];
    dv[i] += hv[i];
  }
  mem_free(acc);
}

/* ---------------------------------------------------------------------------------------------
 * the two variants */

static size_t exact_saved_floats(const struct attn_ctx *ctx) {
  /* log-sum-exp per query row; in the ring's (zigzag) order when the causal ring ran */
  return (size_t)(ctx->dims.B * ctx->dims.H * ctx->dims.T);
}

static bool exact_distributed(const struct attn_ctx *ctx) { return ctx->comm && ctx->comm->S > 1; }

void exact_attention_forward(struct attn_ctx *ctx, long band, float *out, float *lse,
                             const float *q, const float *k, const float *v) {
  const struct attn_dims *dm = &ctx->dims;
  if (!exact_distributed(ctx))
    slab_forward(ctx, mask_of(ctx, band), out, lse, q, dm->t0, k, v, dm->T, dm->t0);
  else if (band > 0)
    local_forward(ctx, band, out, lse, q, k, v);
  else
    ring_forward(ctx, out, lse, q, k, v);
}

void exact_attention_backward(struct attn_ctx *ctx, long band, const float *head_scale, float *dq,
                              float *dk, float *dv, const float *dout, const float *q,
                              const float *k, const float *v, const float *out, const float *lse) {
  const struct attn_dims *dm = &ctx->dims;
  if (!exact_distributed(ctx))
    slab_backward(ctx, mask_of(ctx, band), head_scale, dq, dk, dv, dout, q, dm->t0, k, v, dm->T,
                  dm->t0, out, lse);
  else if (band > 0)
    local_backward(ctx, band, head_scale, dq, dk, dv, dout, q, k, v, out, lse);
  else
    ring_backward(ctx, head_scale, dq, dk, dv, dout, q, k, v, out, lse);
}

bool exact_attention_allows(bool causal, long band, long i, long j) {
  long lo, hi;
  key_range((struct key_mask){causal, band}, i, &lo, &hi);
  return j >= lo && j <= hi;
}

/* Forward FLOPs: 4·d per allowed (query, key) pair (scores and values), over the local share. */
double exact_attention_flops(const struct attn_ctx *ctx, long band) {
  const struct attn_dims *dm = &ctx->dims;
  const double n = (double)dm->n;
  double pairs;
  if (band <= 0) {
    pairs = dm->causal ? 0.5 * n * (n + 1) : n * n;
  } else {
    const double b = band < dm->n ? (double)band : n; /* keys per query, less the edges */
    pairs = dm->causal ? n * b - 0.5 * b * (b - 1) : n * (2 * b - 1) - b * (b - 1);
  }
  return 4.0 * pairs * (double)dm->d * (double)(dm->B * dm->H) * ((double)dm->T / n);
}

static void exact_forward(struct attn_ctx *ctx, float *out, float *saved, const float *q,
                          const float *k, const float *v, const float *params) {
  exact_attention_forward(ctx, variant_band(ctx), out, saved, q, k, v);
}

static void exact_backward(struct attn_ctx *ctx, float *dq, float *dk, float *dv, float *dparams,
                           const float *dout, const float *q, const float *k, const float *v,
                           const float *params, const float *out, const float *saved) {
  exact_attention_backward(ctx, variant_band(ctx), NULL, dq, dk, dv, dout, q, k, v, out, saved);
}

static double exact_score(const struct attn_ctx *ctx, const float *qi, long i, const float *kj,
                          long j, long width, const void *user) {
  if (!exact_attention_allows(ctx->dims.causal, variant_band(ctx), i, j)) return -INFINITY;
  double dot = 0.0;
  for (long c = 0; c < width; c++) dot += (double)qi[c] * kj[c];
  return dot / sqrt((double)width);
}

static long exact_diagnostics(struct attn_ctx *ctx, double *mass, double *entropy, const float *q,
                              const float *k, const float *v, const float *params) {
  const struct attn_dims *dm = &ctx->dims;
  const int bands = attention_diag_bands(ctx->cfg, dm->n);
  long nq = 0;
  for (long h = 0; h < dm->H; h++) /* batch element 0 */
    nq = attention_diag_rows(ctx, mass + h * bands, entropy + h, q + h * dm->T * dm->d,
                             k + h * dm->T * dm->d, dm->d, ATTENTION_DIAG_QUERIES, exact_score,
                             NULL);
  return nq;
}

static double exact_flops(const struct attn_ctx *ctx, double *p2p_flops) {
  *p2p_flops = 0.0;
  return exact_attention_flops(ctx, variant_band(ctx));
}

/* ---------------------------------------------------------------------------------------------
 * incremental decoding: the keys and values so far (full), or a ring of the last band (local) */

struct exact_cache {
  long band, slots; /* slots: n (full) or band (local), per head */
  float *k, *v;     /* (H, slots, d): position p in slot p % slots */
  float *s;         /* (slots) scores of one head */
};

void *exact_decode_open_band(const struct attn_ctx *ctx, long band) {
  const struct attn_dims *dm = &ctx->dims;
  struct exact_cache *c = xcalloc(1, sizeof *c);
  c->band = band;
  c->slots = band > 0 && band < dm->n ? band : dm->n;
  c->k = mem_alloc(MEM_ACTIVATIONS, sizeof(float) * (size_t)(dm->H * c->slots * dm->d));
  c->v = mem_alloc(MEM_ACTIVATIONS, sizeof(float) * (size_t)(dm->H * c->slots * dm->d));
  c->s = mem_alloc(MEM_WORKSPACE, sizeof(float) * (size_t)c->slots);
  return c;
}

void exact_decode_step_band(const struct attn_ctx *ctx, void *cache, float *out, const float *q,
                            const float *k, const float *v, long pos) {
  struct exact_cache *c = cache;
  const long H = ctx->dims.H, d = ctx->dims.d, slots = c->slots, slot = pos % slots;
  const long lo = c->band > 0 && pos - c->band + 1 > 0 ? pos - c->band + 1 : 0;
  const float scale = 1.0f / sqrtf((float)d);
  for (long h = 0; h < H; h++) {
    float *kh = c->k + h * slots * d, *vh = c->v + h * slots * d, *o = out + h * d;
    memcpy(kh + slot * d, k + h * d, sizeof(float) * (size_t)d);
    memcpy(vh + slot * d, v + h * d, sizeof(float) * (size_t)d);
    float mx = -INFINITY, sum = 0.0f;
    for (long j = lo; j <= pos; j++) { /* scores of the visible keys, oldest first */
      const float *kj = kh + (j % slots) * d;
      float dot = 0.0f;
      for (long f = 0; f < d; f++) dot += q[h * d + f] * kj[f];
      c->s[j - lo] = dot * scale;
      mx = c->s[j - lo] > mx ? c->s[j - lo] : mx;
    }
    memset(o, 0, sizeof(float) * (size_t)d);
    for (long j = lo; j <= pos; j++) {
      const float e = expf(c->s[j - lo] - mx), *vj = vh + (j % slots) * d;
      sum += e;
      for (long f = 0; f < d; f++) o[f] += e * vj[f];
    }
    for (long f = 0; f < d; f++) o[f] /= sum;
  }
}

void exact_decode_close(void *cache) {
  struct exact_cache *c = cache;
  if (!c) return;
  mem_free(c->k);
  mem_free(c->v);
  mem_free(c->s);
  free(c);
}

static void *exact_decode_open(const struct attn_ctx *ctx, const float *params) {
  return exact_decode_open_band(ctx, variant_band(ctx));
}

static void exact_decode_step(struct attn_ctx *ctx, void *cache, float *out, const float *q,
                              const float *k, const float *v, long pos, const float *params) {
  exact_decode_step_band(ctx, cache, out, q, k, v, pos);
}

struct attn_variant attention_full = {
    .name = "full",
    .causal_ok = true,
    .bidir_ok = true,
    .fish = &attention_fish_full,
    .diagnostics = exact_diagnostics,
    .flops = exact_flops,
    .decode_open = exact_decode_open,
    .decode_step = exact_decode_step,
    .decode_close = exact_decode_close,
    .cpu = {.saved_floats = exact_saved_floats,
            .forward = exact_forward,
            .backward = exact_backward},
};

struct attn_variant attention_local = {
    .name = "local",
    .causal_ok = true,
    .bidir_ok = true,
    .fish = &attention_fish_local,
    .diagnostics = exact_diagnostics,
    .flops = exact_flops,
    .decode_open = exact_decode_open,
    .decode_step = exact_decode_step,
    .decode_close = exact_decode_close,
    .cpu = {.saved_floats = exact_saved_floats,
            .forward = exact_forward,
            .backward = exact_backward},
};
