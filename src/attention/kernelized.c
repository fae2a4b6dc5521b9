/* The kernelized-attention core (kernelized.h): causal sums as running sums chunk by chunk, and a
 * backward that stores no per-token state (a forward scan rebuilds S, a reverse scan carries
 * R = Σ_{i later} φ(q_i) dnum_iᵀ). Features are made per chunk, so the workspace is O(c·F + F·d)
 * per thread; one (batch, head) per OpenMP task, every sum in a fixed order. Must not allocate
 * anything of size n·F or n·n. */
#include "attention/kernelized.h"

#include <cblas.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "core/memory.h"

/* Per-thread workspace of the row functions. Features are made KZ_BLOCK rows at a time (larger
 * GEMMs in the maps); the running sums advance KZ_CHUNK rows at a time within a block. */
struct kz_work {
  float *fq, *fk;   /* (KZ_BLOCK, F) features of the block's queries and keys */
  float *dfq, *dfk; /* (KZ_BLOCK, F) their gradients */
  float *A, *G;     /* (c, c) masked φq·φk, and masked dnum·v + dden, of one chunk */
  float *dnum;      /* (KZ_BLOCK, d) */
  float *dden;      /* (KZ_BLOCK) */
  float *state;     /* (F·d + F): S then z, or R then r */
  float *sq, *sk;   /* the map's scratch for the block's queries and for its keys */
};

static size_t state_floats(const struct kz_map *map) {
  return (size_t)map->F * (size_t)map->d + (size_t)map->F;
}

static struct kz_work work_alloc(const struct kz_map *map) {
  const size_t c = KZ_CHUNK, b = KZ_BLOCK, F = (size_t)map->F, d = (size_t)map->d;
  const size_t total =
      4 * b * F + 2 * c * c + b * d + b + state_floats(map) + 2 * map->scratch_floats;
  float *p = mem_alloc(MEM_WORKSPACE, sizeof(float) * total);
  struct kz_work w;
  w.fq = p, p += b * F;
  w.fk = p, p += b * F;
  w.dfq = p, p += b * F;
  w.dfk = p, p += b * F;
  w.A = p, p += c * c;
  w.G = p, p += c * c;
  w.dnum = p, p += b * d;
  w.dden = p, p += b;
  w.state = p, p += state_floats(map);
  w.sq = p, p += map->scratch_floats;
  w.sk = p;
  return w;
}

static void work_free(struct kz_work *w) { mem_free(w->fq); }

static long min_l(long a, long b) { return a < b ? a : b; }

/* Zero the entries of a (c, c) row-major matrix above the diagonal: key j > query i. */
static void mask_future(float *A, long c) {
  for (long i = 0; i < c; i++) memset(A + i * c + i + 1, 0, sizeof(float) * (size_t)(c - 1 - i));
}

/* z (F) += column sums of phi (c, F). */
static void add_colsum(float *z, const float *phi, long c, int F) {
  for (long i = 0; i < c; i++)
    for (int a = 0; a < F; a++) z[a] += phi[i * F + a];
}

/* dnum (c, d) = g / den_i and dden (c) = −g·out / den_i per row, with g = dout·scale (scale (d)
 * per channel, or none): the gradients of out = num / den with respect to the numerator and the
 * denominator (zero for a clamped den). */
static void normaliser_grads(float *dnum, float *dden, const float *dout, const float *scale,
                             const float *out, const float *den, long c, int d, enum kz_norm norm) {
  for (long i = 0; i < c; i++) {
    const bool clamped = norm == KZ_CLAMP1 && den[i] < 1.0f;
    const float e = clamped ? 1.0f : den[i], inv = 1.0f / e;
    const float *g = dout + i * d, *o = out + i * d;
    float *dn = dnum + i * d, dot = 0.0f;
    if (scale)
      for (int f = 0; f < d; f++) dn[f] = g[f] * scale[f];
    else
      memcpy(dn, g, sizeof(float) * (size_t)d);
    for (int f = 0; f < d; f++) {
      dot += dn[f] * o[f];
      dn[f] *= inv;
    }
    dden[i] = clamped ? 0.0f : -dot * inv;
  }
}

/* ---------------------------------------------------------------------------------------------
 * one (batch, head) row: T tokens of q, k, v (T, d) */

/* S (F, d) += Σ φ(k) vᵀ and z (F) += Σ φ(k) over the slab: the sums its keys contribute. */
static void row_key_sums(const struct kz_map *map, float *Sz, const float *k, const float *v,
                         long T, struct kz_work *w) {
  const int F = map->F, d = map->d;
  for (long b0 = 0; b0 < T; b0 += KZ_BLOCK) {
    const long rows = min_l(KZ_BLOCK, T - b0);
    map->forward(map, w->fk, k + b0 * d, rows, w->sk);
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, F, d, (int)rows, 1.0f, w->fk, F,
                v + b0 * d, d, 1.0f, Sz, d);
    add_colsum(Sz + (size_t)F * d, w->fk, rows, F);
  }
}

/* R (F, d) += Σ φ(q) dnumᵀ and r (F) += Σ φ(q) dden over the slab: what its queries send back
 * to the keys they saw. */
static void row_query_sums(const struct kz_map *map, enum kz_norm norm, const float *scale,
                           float *Rr, const float *q, const float *dout, const float *out,
                           const float *den, long T, struct kz_work *w) {
  const int F = map->F, d = map->d;
  for (long b0 = 0; b0 < T; b0 += KZ_BLOCK) {
    const long rows = min_l(KZ_BLOCK, T - b0);
    map->forward(map, w->fq, q + b0 * d, rows, w->sq);
    normaliser_grads(w->dnum, w->dden, dout + b0 * d, scale, out + b0 * d, den + b0, rows, d, norm);
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, F, d, (int)rows, 1.0f, w->fq, F, w->dnum,
                d, 1.0f, Rr, d);
    cblas_sgemv(CblasRowMajor, CblasTrans, (int)rows, F, 1.0f, w->fq, F, w->dden, 1, 1.0f,
                Rr + (size_t)F * d, 1);
  }
}

/* out (T, d), den (T): Sz0 holds the sums the slab's first query sees from outside the slab
 * (causal: the keys before it; bidirectional: every key). */
static void row_forward(const struct kz_map *map, enum kz_norm norm, bool causal, float *out,
                        float *den, const float *q, const float *k, const float *v, long T,
                        const float *Sz0, struct kz_work *w) {
  const int F = map->F, d = map->d;
  float *S = w->state, *z = w->state + (size_t)F * d;
  memcpy(S, Sz0, sizeof(float) * state_floats(map));
  for (long b0 = 0; b0 < T; b0 += KZ_BLOCK) {
    const long rows = min_l(KZ_BLOCK, T - b0);
    map->forward(map, w->fq, q + b0 * d, rows, w->sq);
    if (!causal) { /* every query sees the same sums: the block at once */
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)rows, d, F, 1.0f, w->fq, F, S, d,
                  0.0f, out + b0 * d, d);
      cblas_sgemv(CblasRowMajor, CblasNoTrans, (int)rows, F, 1.0f, w->fq, F, z, 1, 0.0f, den + b0,
                  1);
    } else {
      map->forward(map, w->fk, k + b0 * d, rows, w->sk);
      for (long i0 = 0; i0 < rows; i0 += KZ_CHUNK) { /* sums so far, the chunk's own, fold */
        const long c = min_l(KZ_CHUNK, rows - i0);
        const float *fq = w->fq + i0 * F, *fk = w->fk + i0 * F, *vc = v + (b0 + i0) * d;
        float *o = out + (b0 + i0) * d, *e = den + b0 + i0;
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)c, d, F, 1.0f, fq, F, S, d,
                    0.0f, o, d);
        cblas_sgemv(CblasRowMajor, CblasNoTrans, (int)c, F, 1.0f, fq, F, z, 1, 0.0f, e, 1);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)c, (int)c, F, 1.0f, fq, F, fk, F,
                    0.0f, w->A, (int)c);
        mask_future(w->A, c);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)c, d, (int)c, 1.0f, w->A,
                    (int)c, vc, d, 1.0f, o, d);
        for (long i = 0; i < c; i++)
          for (long j = 0; j <= i; j++) e[i] += w->A[i * c + j];
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, F, d, (int)c, 1.0f, fk, F, vc, d, 1.0f,
                    S, d);
        add_colsum(z, fk, c, F);
      }
    }
    for (long i = b0; i < b0 + rows; i++) {
      const float inv = 1.0f / (norm == KZ_CLAMP1 && den[i] < 1.0f ? 1.0f : den[i]);
      for (int f = 0; f < d; f++) out[i * d + f] *= inv;
    }
  }
}

/* G (c, c) = mask(dnum vᵀ + dden 1ᵀ): G_ij = dL/d(φq_i·φk_j) for a chunk's own pairs. */
static void chunk_pair_grads(float *G, const float *dnum, const float *dden, const float *v, long c,
                             int d) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)c, (int)c, d, 1.0f, dnum, d, v, d, 0.0f,
              G, (int)c);
  for (long i = 0; i < c; i++)
    for (long j = 0; j <= i; j++) G[i * c + j] += dden[i];
  mask_future(G, c);
}

/* Causal backward, first pass: the forward scan again, forming dφ(q) chunk by chunk and pushing
 * it through the map a block at a time. */
static void row_backward_queries(const struct kz_map *map, enum kz_norm norm, const float *scale,
                                 float *dq, const float *dout, const float *q, const float *k,
                                 const float *v, const float *out, const float *den, long T,
                                 const float *Sz0, struct kz_work *w) {
  const int F = map->F, d = map->d;
  float *S = w->state, *z = w->state + (size_t)F * d;
  memcpy(S, Sz0, sizeof(float) * state_floats(map));
  for (long b0 = 0; b0 < T; b0 += KZ_BLOCK) {
    const long rows = min_l(KZ_BLOCK, T - b0);
    map->forward(map, w->fk, k + b0 * d, rows, w->sk);
    normaliser_grads(w->dnum, w->dden, dout + b0 * d, scale, out + b0 * d, den + b0, rows, d, norm);
    for (long i0 = 0; i0 < rows; i0 += KZ_CHUNK) {
      const long c = min_l(KZ_CHUNK, rows - i0);
      const float *fk = w->fk + i0 * F, *vc = v + (b0 + i0) * d, *dnum = w->dnum + i0 * d;
      float *dfq = w->dfq + i0 * F;
      chunk_pair_grads(w->G, dnum, w->dden + i0, vc, c, d);
      /* dφq = dnum Sᵀ + dden zᵀ + G φk */
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)c, F, d, 1.0f, dnum, d, S, d, 0.0f,
                  dfq, F);
      cblas_sger(CblasRowMajor, (int)c, F, 1.0f, w->dden + i0, 1, z, 1, dfq, F);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)c, F, (int)c, 1.0f, w->G, (int)c,
                  fk, F, 1.0f, dfq, F);
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, F, d, (int)c, 1.0f, fk, F, vc, d, 1.0f,
                  S, d);
      add_colsum(z, fk, c, F);
    }
    map->backward(map, dq + b0 * d, w->dfq, q + b0 * d, rows, w->sq, false);
  }
}

/* Causal backward, second pass: a reverse scan carrying R = Σ_{i later} φq_i dnum_iᵀ and
 * r = Σ φq_i dden_i from Rr0 (the later ranks' queries), forming dφ(k) and dv. */
static void row_backward_keys(const struct kz_map *map, enum kz_norm norm, const float *scale,
                              float *dk, float *dv, const float *dout, const float *q,
                              const float *k, const float *v, const float *out, const float *den,
                              long T, const float *Rr0, struct kz_work *w) {
  const int F = map->F, d = map->d;
  float *R = w->state, *r = w->state + (size_t)F * d;
  memcpy(R, Rr0, sizeof(float) * state_floats(map));
  for (long b0 = T == 0 ? -1 : (T - 1) / KZ_BLOCK * KZ_BLOCK; b0 >= 0; b0 -= KZ_BLOCK) {
    const long rows = min_l(KZ_BLOCK, T - b0);
    map->forward(map, w->fq, q + b0 * d, rows, w->sq);
    map->forward(map, w->fk, k + b0 * d, rows, w->sk);
    normaliser_grads(w->dnum, w->dden, dout + b0 * d, scale, out + b0 * d, den + b0, rows, d, norm);
    for (long i0 = (rows - 1) / KZ_CHUNK * KZ_CHUNK; i0 >= 0; i0 -= KZ_CHUNK) {
      const long c = min_l(KZ_CHUNK, rows - i0);
      const float *fq = w->fq + i0 * F, *fk = w->fk + i0 * F, *vc = v + (b0 + i0) * d;
      const float *dnum = w->dnum + i0 * d, *dden = w->dden + i0;
      float *dfk = w->dfk + i0 * F, *dvc = dv + (b0 + i0) * d;
      chunk_pair_grads(w->G, dnum, dden, vc, c, d);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)c, (int)c, F, 1.0f, fq, F, fk, F,
                  0.0f, w->A, (int)c);
      mask_future(w->A, c);
      /* dφk = v Rᵀ + 1 rᵀ + Gᵀ φq;  dv += φk R + Aᵀ dnum */
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)c, F, d, 1.0f, vc, d, R, d, 0.0f,
                  dfk, F);
      for (long j = 0; j < c; j++)
        for (int a = 0; a < F; a++) dfk[j * F + a] += r[a];
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)c, F, (int)c, 1.0f, w->G, (int)c,
                  fq, F, 1.0f, dfk, F);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)c, d, F, 1.0f, fk, F, R, d, 1.0f,
                  dvc, d);
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)c, d, (int)c, 1.0f, w->A, (int)c,
                  dnum, d, 1.0f, dvc, d);
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, F, d, (int)c, 1.0f, fq, F, dnum, d, 1.0f,
                  R, d);
      cblas_sgemv(CblasRowMajor, CblasTrans, (int)c, F, 1.0f, fq, F, dden, 1, 1.0f, r, 1);
    }
    map->backward(map, dk + b0 * d, w->dfk, k + b0 * d, rows, w->sk, true);
  }
}

/* Bidirectional backward: every query saw the same sums Sz (all keys) and every key is seen by
 * the same sums Rr (all queries), so one pass forms dq, dk and dv. */
static void row_backward_bidir(const struct kz_map *map, enum kz_norm norm, const float *scale,
                               float *dq, float *dk, float *dv, const float *dout, const float *q,
                               const float *k, const float *v, const float *out, const float *den,
                               long T, const float *Sz, const float *Rr, struct kz_work *w) {
  const int F = map->F, d = map->d;
  const float *S = Sz, *z = Sz + (size_t)F * d, *R = Rr, *r = Rr + (size_t)F * d;
  for (long b0 = 0; b0 < T; b0 += KZ_BLOCK) {
    const long rows = min_l(KZ_BLOCK, T - b0);
    normaliser_grads(w->dnum, w->dden, dout + b0 * d, scale, out + b0 * d, den + b0, rows, d, norm);
    /* dφq = dnum Sᵀ + dden zᵀ */
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)rows, F, d, 1.0f, w->dnum, d, S, d,
                0.0f, w->dfq, F);
    cblas_sger(CblasRowMajor, (int)rows, F, 1.0f, w->dden, 1, z, 1, w->dfq, F);
    map->backward(map, dq + b0 * d, w->dfq, q + b0 * d, rows, w->sq, false);
    /* dφk = v Rᵀ + 1 rᵀ;  dv += φk R */
    map->forward(map, w->fk, k + b0 * d, rows, w->sk);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)rows, F, d, 1.0f, v + b0 * d, d, R, d,
                0.0f, w->dfk, F);
    for (long j = 0; j < rows; j++)
      for (int a = 0; a < F; a++) w->dfk[j * F + a] += r[a];
    map->backward(map, dk + b0 * d, w->dfk, k + b0 * d, rows, w->sk, true);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)rows, d, F, 1.0f, w->fk, F, R, d,
                1.0f, dv + b0 * d, d);
  }
}

/* ---------------------------------------------------------------------------------------------
 * one layer: every (batch, head) of the slab, and the sums of the other ranks */

static int seq_ranks(const struct attn_ctx *ctx) { return ctx->comm ? ctx->comm->S : 1; }

/* The sums each row needs from outside the slab, given every row's own sums mine (count floats):
 * those of the ranks before this one (exclusive scan: causal forward, whose rows see earlier
 * keys), of the ranks after it (causal backward, whose rows see later queries), or everyone's
 * (bidirectional). into (count). */
enum outside { OUTSIDE_BEFORE, OUTSIDE_AFTER, OUTSIDE_ALL };

static void outside_sums(struct attn_ctx *ctx, enum outside side, float *into, const float *mine,
                         size_t count) {
  if (seq_ranks(ctx) == 1) {
    if (side == OUTSIDE_ALL)
      memcpy(into, mine, sizeof(float) * count);
    else
      memset(into, 0, sizeof(float) * count);
    return;
  }
  float *other = mem_alloc(MEM_COMM, sizeof(float) * count);
  float *before = side == OUTSIDE_AFTER ? other : into,
        *after = side == OUTSIDE_AFTER ? into : other;
  comm_exscan_sum_float(ctx->comm, mine, count, before, after);
  if (side == OUTSIDE_ALL)
    for (size_t i = 0; i < count; i++) into[i] += mine[i] + after[i];
  mem_free(other);
}

size_t kz_saved_floats(const struct attn_ctx *ctx, const struct kz_map *map) {
  const size_t BH = (size_t)(ctx->dims.B * ctx->dims.H);
  return BH * (size_t)ctx->dims.T + BH * state_floats(map);
}

void kz_forward(struct attn_ctx *ctx, const struct kz_map *map, enum kz_norm norm, float *out,
                float *saved, const float *q, const float *k, const float *v) {
  const struct attn_dims *dm = &ctx->dims;
  const long BH = dm->B * dm->H, T = dm->T, d = dm->d;
  const size_t W = state_floats(map);
  float *den = saved, *Sz0 = saved + BH * T; /* (BH, T), (BH, W) */
  if (dm->causal && seq_ranks(ctx) == 1) {
    memset(Sz0, 0, sizeof(float) * (size_t)BH * W);
  } else {
    float *mine = mem_alloc(MEM_WORKSPACE, sizeof(float) * (size_t)BH * W);
#pragma omp parallel
    {
      struct kz_work w = work_alloc(map);
#pragma omp for schedule(dynamic, 1)
      for (long bh = 0; bh < BH; bh++)
        row_key_sums(map, mine + bh * W, k + bh * T * d, v + bh * T * d, T, &w);
      work_free(&w);
    }
    outside_sums(ctx, dm->causal ? OUTSIDE_BEFORE : OUTSIDE_ALL, Sz0, mine, (size_t)BH * W);
    mem_free(mine);
  }
#pragma omp parallel
  {
    struct kz_work w = work_alloc(map);
#pragma omp for schedule(dynamic, 1)
    for (long bh = 0; bh < BH; bh++)
      row_forward(map, norm, dm->causal, out + bh * T * d, den + bh * T, q + bh * T * d,
                  k + bh * T * d, v + bh * T * d, T, Sz0 + bh * W, &w);
    work_free(&w);
  }
}

void kz_backward(struct attn_ctx *ctx, const struct kz_map *map, enum kz_norm norm,
                 const float *dscale, float *dq, float *dk, float *dv, const float *dout,
                 const float *q, const float *k, const float *v, const float *out,
                 const float *saved) {
  const struct attn_dims *dm = &ctx->dims;
  const long BH = dm->B * dm->H, T = dm->T, d = dm->d;
  const size_t W = state_floats(map);
  const float *den = saved, *Sz0 = saved + BH * T;
  float *Rr0 = mem_alloc(MEM_WORKSPACE, sizeof(float) * (size_t)BH * W); /* zeroed */
  if (!dm->causal || seq_ranks(ctx) > 1) {
    float *mine = mem_alloc(MEM_WORKSPACE, sizeof(float) * (size_t)BH * W);
#pragma omp parallel
    {
      struct kz_work w = work_alloc(map);
#pragma omp for schedule(dynamic, 1)
      for (long bh = 0; bh < BH; bh++)
        row_query_sums(map, norm, dscale ? dscale + bh % dm->H * d : NULL, mine + bh * W,
                       q + bh * T * d, dout + bh * T * d, out + bh * T * d, den + bh * T, T, &w);
      work_free(&w);
    }
    outside_sums(ctx, dm->causal ? OUTSIDE_AFTER : OUTSIDE_ALL, Rr0, mine, (size_t)BH * W);
    mem_free(mine);
  }
#pragma omp parallel
  {
    struct kz_work w = work_alloc(map);
#pragma omp for schedule(dynamic, 1)
    for (long bh = 0; bh < BH; bh++) {
      const size_t o = (size_t)(bh * T * d);
      const float *sc = dscale ? dscale + bh % dm->H * d : NULL;
      if (dm->causal) {
        row_backward_queries(map, norm, sc, dq + o, dout + o, q + o, k + o, v + o, out + o,
                             den + bh * T, T, Sz0 + bh * W, &w);
        row_backward_keys(map, norm, sc, dk + o, dv + o, dout + o, q + o, k + o, v + o, out + o,
                          den + bh * T, T, Rr0 + bh * W, &w);
      } else {
        row_backward_bidir(map, norm, sc, dq + o, dk + o, dv + o, dout + o, q + o, k + o, v + o,
                           out + o, den + bh * T, T, Sz0 + bh * W, Rr0 + bh * W, &w);
      }
    }
    work_free(&w);
  }
  mem_free(Rr0);
}

double kz_flops(const struct attn_ctx *ctx, const struct kz_map *map) {
  const struct attn_dims *dm = &ctx->dims;
  const double F = map->F, d = map->d;
  const double per_token = 4.0 * F * d + 4.0 * F + 2.0 * map->flops_per_row;
  return per_token * (double)(dm->B * dm->H) * (double)dm->T;
}

void kz_features(const struct kz_map *map, float *phi, const float *x, long T, float *scratch) {
  for (long b0 = 0; b0 < T; b0 += KZ_BLOCK)
    map->forward(map, phi + b0 * map->F, x + b0 * map->d, min_l(KZ_BLOCK, T - b0), scratch);
}

/* log of the weight φq_i·φk_j (its magnitude for signed features); −∞ for a future key. */
static double weight_score(const struct attn_ctx *ctx, const float *qi, long i, const float *kj,
                           long j, long width, bool magnitude) {
  if (ctx->dims.causal && j > i) return -INFINITY;
  double dot = 0.0;
  for (long a = 0; a < width; a++) dot += (double)qi[a] * kj[a];
  if (magnitude) dot = fabs(dot);
  return dot > 0 ? log(dot) : -INFINITY;
}

static double score_positive(const struct attn_ctx *ctx, const float *qi, long i, const float *kj,
                             long j, long width, const void *user) {
  return weight_score(ctx, qi, i, kj, j, width, false);
}

static double score_magnitude(const struct attn_ctx *ctx, const float *qi, long i, const float *kj,
                              long j, long width, const void *user) {
  return weight_score(ctx, qi, i, kj, j, width, true);
}

long kz_diagnostics(struct attn_ctx *ctx, const struct kz_map *map, enum kz_norm norm, double *mass,
                    double *entropy, const float *q, const float *k) {
  const struct attn_dims *dm = &ctx->dims;
  const int bands = ctx->opt.diag_bands;
  const long T = dm->T, d = dm->d, F = map->F;
  float *fq = mem_alloc(MEM_WORKSPACE, sizeof(float) * (size_t)(T * F));
  float *fk = mem_alloc(MEM_WORKSPACE, sizeof(float) * (size_t)(T * F));
  float *scratch = mem_alloc(MEM_WORKSPACE, sizeof(float) * (map->scratch_floats + 1));
  long nq = 0;
  for (long h = 0; h < dm->H; h++) { /* batch element 0 */
    kz_features(map, fq, q + h * T * d, T, scratch);
    kz_features(map, fk, k + h * T * d, T, scratch);
    nq = attention_diag_rows(ctx, mass + h * bands, entropy + h, fq, fk, F, ATTENTION_DIAG_QUERIES,
                             norm == KZ_CLAMP1 ? score_magnitude : score_positive, NULL);
  }
  mem_free(scratch);
  mem_free(fk);
  mem_free(fq);
  return nq;
}

/* ---------------------------------------------------------------------------------------------
 * incremental decoding: the running sums S, z of every head */

struct kz_cache {
  struct kz_map map;
  float *Sz;      /* (H, F·d + F) */
  float *fq, *fk; /* (F) */
  float *scratch; /* the map's */
};

void *kz_decode_open(const struct attn_ctx *ctx, const struct kz_map *map) {
  struct kz_cache *c = xcalloc(1, sizeof *c);
  c->map = *map;
  c->Sz = mem_alloc(MEM_ACTIVATIONS, sizeof(float) * state_floats(map) * (size_t)ctx->dims.H);
  c->fq = mem_alloc(MEM_WORKSPACE, sizeof(float) * 2 * (size_t)map->F);
  c->fk = c->fq + map->F;
  c->scratch = mem_alloc(MEM_WORKSPACE, sizeof(float) * (map->scratch_floats + 1));
  return c;
}

void kz_decode_step(const struct attn_ctx *ctx, void *cache, enum kz_norm norm, float *out,
                    const float *q, const float *k, const float *v) {
  struct kz_cache *c = cache;
  const struct kz_map *map = &c->map;
  const int F = map->F, d = map->d;
  for (long h = 0; h < ctx->dims.H; h++) {
    float *S = c->Sz + (size_t)h * state_floats(map), *z = S + (size_t)F * d, *o = out + h * d;
    map->forward(map, c->fk, k + h * d, 1, c->scratch);
    map->forward(map, c->fq, q + h * d, 1, c->scratch);
    for (int a = 0; a < F; a++) { /* the key joins the sums first: J(i) = {j ≤ i} */
      for (int f = 0; f < d; f++) S[a * d + f] += c->fk[a] * v[h * d + f];
      z[a] += c->fk[a];
    }
    float den = 0.0f;
    for (int a = 0; a < F; a++) den += c->fq[a] * z[a];
    if (norm == KZ_CLAMP1 && den < 1.0f) den = 1.0f;
    for (int f = 0; f < d; f++) {
      float num = 0.0f;
      for (int a = 0; a < F; a++) num += c->fq[a] * S[a * d + f];
      o[f] = num / den;
    }
  }
}

void kz_decode_close(void *cache) {
  struct kz_cache *c = cache;
  if (!c) return;
  mem_free(c->Sz);
  mem_free(c->fq);
  mem_free(c->scratch);
  free(c);
}
