/* Exact softmax attention, whole or banded: `full` (SPEC §6.1) and `local` (SPEC §6.2), tile by
 * tile with an online softmax (memory O(n·d), never O(n²)); backward recomputes the tiles from the
 * saved log-sum-exp. The tile loops take a logits hook (exact.h), so FiSH heads run on them too.
 * Under sequence parallelism `local` gathers its band's halo and `full` runs the ring (ring.c): no
 * rank may hold the whole sequence's k, v. `full` is the reference every variant is measured by. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "attention/attention.h"
#include "attention/exact.h"
#include "core/error.h"
#include "core/memory.h"
#include "core/tilegemm.h"
#include "nn/vecmath.h" /* SIMD expf for the softmax loops: it sets the rounding */
#include "parallel/halo.h"
#include "parallel/ring.h"

/* ---------------------------------------------------------------------------------------------
 * the tile loops: one unit (exact.h), a tile of queries against the live tiles of a key range */

/* Online-softmax state of a unit's queries: m, l (heads, stride) the running max and sum, acc
 * (heads, stride, d) in rows of ld floats (head h's row i at acc + h·stride·d + i·ld): the output,
 * accumulated in place. */
struct online_state {
  float *m, *l, *acc;
  long stride, ld;
};

/* One row's update by a tile of logits s (bj): the columns [c0, c1) the mask allows join the
 * running max and sum, s becomes the row's weights (0 where masked), acc is rescaled. A masked
 * column's exp is taken of 0 and its weight multiplied by 0, where the columns were set to −inf:
 * libmvec's vector expf takes a slow path for a whole vector with −inf in it (the causal
 * diagonal's). The softmax's share of the forward fell by a fifth at n = 512 (docs/perf.md); the
 * weights and their sum are what they were, bit for bit. */
static void online_row(float *s, long bj, long c0, long c1, float *mrow, float *lrow, float *arow,
                       int d) {
  if (c1 == c0) {
    memset(s, 0, sizeof(float) * (size_t)bj);
    return;
  }
  float mx = *mrow;
#pragma omp simd reduction(max : mx)
  for (long c = c0; c < c1; c++) mx = s[c] > mx ? s[c] : mx;
  const float alpha = expf(*mrow - mx);              /* exp(−inf) = 0 on the first live tile */
  const int n = (int)bj, lo = (int)c0, hi = (int)c1; /* 32-bit lanes, as the floats' */
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int c = 0; c < n; c++) {
    const float live = (float)((c >= lo) & (c < hi)); /* 1, or 0 where masked */
    s[c] = expf((s[c] - mx) * live) * live;
    sum += s[c];
  }
  *lrow = *lrow * alpha + sum;
  *mrow = mx;
  if (alpha != 1.0f)
    for (int c = 0; c < d; c++) arow[c] *= alpha;
}

/* Where a tile of queries and keys runs in parts: rows [r0, r0 + rows) of the query tile against
 * the first `width` keys of the key tile. */
struct tile_part {
  long r0, rows, width;
};

/* The parts of the query tile i0 (bi rows) against the key tile j0 (bj keys): the whole, or under
 * a causal mask with no band, where the key tile holds the query tile's diagonal block, its halves,
 * the upper of which sees width − bi/2 keys. The skipped corner is masked: what the whole tile gave
 * there was a weight of 0, whose products added zeros after the live terms (or, summed over query
 * rows in dv and dk, before them), so on libxsmm's kernels, which sum over the depth in order,
 * the parts give the same bits (on CBLAS's, which may block a depth otherwise, the last bits can
 * move); the vector sum of a row's weights (online_row) keeps its lanes where both widths are
 * whole vectors (of 16), which the split requires. It saves a quarter of each diagonal block's
 * work: with tiles of 64 the causal tiles covered 1.125 times the live scores at n = 512, and
 * cover 1.0625 times them. One head per unit only, so a hook's logits and gradient run on each
 * part as on a tile of its own. */
static int tile_parts(const struct exact_hook *hk, const struct exact_rows *x, struct key_mask mk,
                      long i0, long bi, long j0, long bj, struct tile_part part[2]) {
  part[0] = (struct tile_part){0, bi, bj};
  const long h = bi / 2, top = x->qoff + i0 + h - (x->koff + j0); /* the upper half's keys */
  if (hk->heads != 1 || hk->qk_heads != 1 || !mk.causal || mk.band > 0 || bi % 32 != 0 ||
      top <= 0 || top >= bj || top % 16 != 0)
    return 1;
  part[0] = (struct tile_part){0, h, top};
  part[1] = (struct tile_part){h, bi - h, bj};
  return 2;
}

/* Accumulate the keys [0, Tk) of x into the state of its queries [i0, i1); scratch: the thread's
 * (hk->scratch_forward tiles). Dead tiles are skipped. */
static void exact_block_forward(const struct exact_hook *hk, const struct exact_rows *x,
                                struct online_state o, long Tk, struct key_mask mk, long i0,
                                long i1, float *scratch) {
  const int d = x->d;
  float *L = scratch; /* (heads, rows, width) */
  long jlo, jend;
  live_key_tiles(mk, x->qoff + i0, x->qoff + i1 - 1, x->koff, Tk, x->tile, &jlo, &jend);
  for (long j0 = jlo; j0 < jend; j0 += x->ktile) {
    struct tile_part part[2];
    const int parts =
        tile_parts(hk, x, mk, i0, i1 - i0, j0, jend - j0 < x->ktile ? jend - j0 : x->ktile, part);
    for (int pt = 0; pt < parts; pt++) {
      const long pi = i0 + part[pt].r0, bi = part[pt].rows, bj = part[pt].width, tt = bi * bj;
      hk->logits(hk, x, pi, bi, j0, bj, L, scratch);
      for (int h = 0; h < hk->heads; h++) {
        float *S = L + h * tt;
        for (long r = 0; r < bi; r++) {
          const long row = h * o.stride + pi + r;
          long c0, c1;
          tile_columns(mk, x->qoff + pi + r, x->koff + j0, bj, &c0, &c1);
          online_row(S + r * bj, bj, c0, c1, o.m + row, o.l + row,
                     o.acc + h * o.stride * d + (pi + r) * o.ld, d);
        }
        tile_sgemm(false, false, (int)bi, d, (int)bj, 1.0f, S, (int)bj,
                   x->v + h * x->kstride * d + j0 * x->ld, (int)x->ld, 1.0f,
                   o.acc + h * o.stride * d + pi * o.ld, (int)o.ld);
      }
    }
  }
}

/* Head h's share of a backward tile, its logits in P (bi, bj): P = exp(L − lse) where the mask
 * allows, dv += alpha·Pᵀ dO, dP = alpha·dO vᵀ, and dS = P ∘ ((dP − D) · ds_scale) over P. */
static void softmax_tile_backward(const struct exact_hook *hk, const struct exact_rows *x,
                                  const struct exact_grads *g, int h, long i0, long bi, long j0,
                                  long bj, struct key_mask mk, float *P, float *dP) {
  const int d = x->d;
  const float alpha = g->scale ? g->scale[h] : 1.0f, f = hk->ds_scale;
  const float *lse = g->lse + h * x->qstride + i0, *D = g->D + h * x->qstride + i0;
  const float *dO = g->dout + h * x->qstride * d + i0 * g->ld_dout;
  const int ldo = (int)g->ld_dout, ld = (int)x->ld;
  for (long r = 0; r < bi; r++) {
    float *s = P + r * bj;
    const float L = lse[r];
    long c0, c1;
    tile_columns(mk, x->qoff + i0 + r, x->koff + j0, bj, &c0, &c1);
    const int n = (int)bj, lo = (int)c0, hi = (int)c1; /* masked columns as online_row's */
#pragma omp simd
    for (int c = 0; c < n; c++) {
      const float live = (float)((c >= lo) & (c < hi));
      s[c] = expf((s[c] - L) * live) * live;
    }
  }
  /* dv_j += Pᵀ dO_i */
  tile_sgemm(true, false, (int)bj, d, (int)bi, alpha, P, (int)bj, dO, ldo, 1.0f,
             g->dv + h * x->kstride * d + j0 * ld, ld);
  /* dP = dO_i v_jᵀ */
  if (x->vt)
    tile_sgemm(false, false, (int)bi, (int)bj, d, alpha, dO, ldo, x->vt + j0, (int)x->kt_ld, 0.0f,
               dP, (int)bj);
  else
    tile_sgemm(false, true, (int)bi, (int)bj, d, alpha, dO, ldo,
               x->v + h * x->kstride * d + j0 * ld, ld, 0.0f, dP, (int)bj);
  for (long r = 0; r < bi; r++) {
    const float Di = D[r], *dp = dP + r * bj;
    float *p = P + r * bj;
#pragma omp simd
    for (long c = 0; c < bj; c++) p[c] = p[c] * ((dp[c] - Di) * f);
  }
}

/* Gradient contributions of the keys [0, Tk) of x to its queries [0, Tq): g's dq, dk, dv, dpar
 * +=; scratch: the thread's (hk->scratch_backward tiles). */
static void exact_block_backward(const struct exact_hook *hk, const struct exact_rows *x,
                                 const struct exact_grads *g, long Tq, long Tk, struct key_mask mk,
                                 float *scratch) {
  const int tile = x->tile;
  float *P = scratch,
        *dP = scratch + (size_t)hk->heads * tile * x->ktile; /* (heads, bi, bj), (bi, bj) */
  for (long i0 = 0; i0 < Tq; i0 += tile) {
    const long bi = Tq - i0 < tile ? Tq - i0 : tile;
    long jlo, jend;
    live_key_tiles(mk, x->qoff + i0, x->qoff + i0 + bi - 1, x->koff, Tk, tile, &jlo, &jend);
    for (long j0 = jlo; j0 < jend; j0 += x->ktile) {
      struct tile_part part[2]; /* the upper half first: dv and dk sum over rows in order */
      const int parts =
          tile_parts(hk, x, mk, i0, bi, j0, jend - j0 < x->ktile ? jend - j0 : x->ktile, part);
      for (int pt = 0; pt < parts; pt++) {
        const long pi = i0 + part[pt].r0, pr = part[pt].rows, bj = part[pt].width;
        hk->logits(hk, x, pi, pr, j0, bj, P, scratch);
        for (int h = 0; h < hk->heads; h++)
          softmax_tile_backward(hk, x, g, h, pi, pr, j0, bj, mk, P + h * pr * bj, dP);
        hk->grad(hk, x, g, pi, pr, j0, bj, P, scratch);
      }
    }
  }
}

/* full's hook: one head's scores q kᵀ/√d (1/√d as the GEMM's alpha), and back through them. Its
 * key tiles are 8 query tiles wide (512 keys with full.block = 64): each GEMM then has 512 rows or
 * columns or a depth of 512 where square tiles had 64, and the per-call costs of the BLAS (packing,
 * the beta pass) are spread over 8 times the work. Attention forward + backward at n = 1024,
 * batch 8, 2 threads: 75 → 88 GFLOP/s (medians of 4 alternating runs; 4 tiles wide gave 88 too).
 * The masked waste is unchanged by the width: the key range still ends at the query tile's last
 * whole tile, whose masked corner tile_parts leaves out in part. */
static void full_logits(const struct exact_hook *hk, const struct exact_rows *x, long i0, long bi,
                        long j0, long bj, float *L, float *scratch) {
  const int d = x->d, ld = (int)x->ld;
  const float scale = 1.0f / sqrtf((float)d);
  if (x->kt)
    tile_sgemm(false, false, (int)bi, (int)bj, d, scale, x->q + i0 * ld, ld, x->kt + j0,
               (int)x->kt_ld, 0.0f, L, (int)bj);
  else
    tile_sgemm(false, true, (int)bi, (int)bj, d, scale, x->q + i0 * ld, ld, x->k + j0 * ld, ld,
               0.0f, L, (int)bj);
}

static void full_grad(const struct exact_hook *hk, const struct exact_rows *x,
                      const struct exact_grads *g, long i0, long bi, long j0, long bj,
                      const float *dS, float *scratch) {
  const int d = x->d, ld = (int)x->ld; /* 1/√d is in dS already (the hook's ds_scale) */
  tile_sgemm(false, false, (int)bi, d, (int)bj, 1.0f, dS, (int)bj, x->k + j0 * ld, ld, 1.0f,
             g->dq + i0 * ld, ld);
  tile_sgemm(true, false, (int)bj, d, (int)bi, 1.0f, dS, (int)bj, x->q + i0 * ld, ld, 1.0f,
             g->dk + j0 * ld, ld);
}

static const struct exact_hook full_hook = {.heads = 1,
                                            .qk_heads = 1,
                                            .key_tiles = 8,
                                            .scratch_forward = 1,
                                            .scratch_backward = 2,
                                            .ds_scale = 1.0f, /* 1/√d: backward's copy */
                                            .transposed_kv = true,
                                            .logits = full_logits,
                                            .grad = full_grad};

/* ---------------------------------------------------------------------------------------------
 * the op on this rank, and its step (my queries against one range of keys) that the three paths
 * share: one slab, the band's halo, each step of the ring */

/* Query/key tile: full.block, or for a band a tile of about half the band (at least 16): a query
 * tile then reads (tile + band − 1) keys rounded up to whole tiles, and a smaller tile wastes fewer
 * masked entries (band 64: 96 keys per query with tiles of 32, 128 with tiles of 64), which pays
 * for the smaller GEMMs (measured in bench, docs/kernelized.md). */
static int exact_tile(int block, long band) {
  if (band <= 0) return block;
  int tile = 16;
  while (tile < block && 2 * tile < band) tile *= 2;
  return tile < block ? tile : block;
}

/* One call of the op on this rank: the hook, the mask and tile, the unit layout, and what the
 * paths and their steps share. */
struct exact_op {
  const struct exact_hook *hk;
  struct key_mask mk;
  int d, tile, ktile;
  long units, T, H;        /* units (exact.h), local tokens, model heads */
  const float *head_scale; /* (H) the output gradient's factor per head, or NULL */
  float *ml;               /* forward: m, l (units·heads, T) */
  float *lse_out;          /* forward: (units·heads, T) */
  const float *lse;        /* backward: as forward left it */
  float *dpar, *dparams;   /* backward: (units, param_floats); the caller's += */
  /* The caller's layout (attn_ctx.rows): false, q, k, v, out and their gradients (units·heads,
   * stride, d); true, by token (B, T, H, d) in rows of ldi floats (q, k, v, dq, dk, dv) and of ldo
   * floats (out, dout), read and written in place. ldi = ldo = d when false. */
  bool rows;
  long ldi, ldo;
};

/* Where row `row` of unit u's block starts: in the (units·heads, stride, d) layout, per_unit rows
 * to a unit; in the caller's rows (one head per unit, u = b·H + h), at row pitch ld. */
static long unit_row(const struct exact_op *op, long u, long per_unit, long row, long ld) {
  if (!op->rows) return (u * per_unit + row) * op->d;
  return (u / op->H * op->T + row) * ld + u % op->H * op->d;
}

static struct exact_op exact_op_make(const struct attn_ctx *ctx, const struct exact_hook *hk,
                                     long band, const float *head_scale) {
  const struct attn_dims *dm = &ctx->dims;
  const bool rows = ctx->rows.ld_qkv > 0;
  if (rows &&
      !(hk->heads == 1 && hk->qk_heads == 1 && band <= 0 && !(ctx->comm && ctx->comm->S > 1)))
    error("exact attention: rows in place need one head per unit, no band, one sequence rank");
  return (struct exact_op){.hk = hk,
                           .rows = rows,
                           .ldi = rows ? ctx->rows.ld_qkv : dm->d,
                           .ldo = rows ? ctx->rows.ld_out : dm->d,
                           .mk = {dm->causal, band},
                           .d = (int)dm->d,
                           .tile = exact_tile(ctx->opt.full_block, band),
                           .ktile = exact_tile(ctx->opt.full_block, band) *
                                    (band > 0 || hk->key_tiles < 1 ? 1 : hk->key_tiles),
                           .units = dm->B * dm->H / hk->heads,
                           .T = dm->T,
                           .H = dm->H,
                           .head_scale = head_scale};
}

/* Whether the loops lay k and v out transposed: where the hook asks, with one head per unit; where
 * tile_sgemm has kernels that pay for the transposes (CBLAS runs an NT product as fast); and not
 * for a band, whose query tiles read only tile + band − 1 keys each: the whole range transposed
 * would cost a workspace the size of k (a gigabyte at 1M tokens) for products that small. */
static bool transposed_kv(const struct exact_op *op) {
  const struct exact_hook *hk = op->hk;
  return hk->transposed_kv && hk->heads == 1 && hk->qk_heads == 1 && op->mk.band <= 0 &&
         tile_gemm_xsmm();
}

/* Where a step's query or key rows lie: `pieces` pieces of `len` tokens in rows of `stride`
 * tokens, piece p from global token off[p]. */
struct exact_span {
  int pieces;
  long len, stride, off[2];
};

static struct exact_span slab_span(long T, long off) { return (struct exact_span){1, T, T, {off}}; }

/* Fold the keys k (units·qk_heads, ks.stride, d), v (units·heads, ks.stride, d) into the online
 * state of the queries q (units·qk_heads, qs.stride, d) with output out (units·heads, qs.stride,
 * d); first: start the state, last: finish it (out = acc / l, lse). One task per (unit, query
 * piece and tile), so no updates race. */
static void exact_fold(const struct exact_op *op, struct exact_span qs, const float *q, float *out,
                       struct exact_span ks, const float *k, const float *v, bool first,
                       bool last) {
  const struct exact_hook *hk = op->hk;
  const long nh = hk->heads, ng = hk->qk_heads, ntp = (qs.len + op->tile - 1) / op->tile;
  const long lrows = op->units * nh * qs.stride; /* where l starts in ml */
  const int d = op->d, tile = op->tile;
  /* the keys transposed, (d, ks.len) per (unit, piece), shared by the unit's query tiles */
  const size_t kt_piece = (size_t)ks.len * d;
  float *kt = transposed_kv(op)
                  ? mem_alloc_uninit(MEM_WORKSPACE,
                                     sizeof(float) * (size_t)op->units * ks.pieces * kt_piece)
                  : NULL; /* every piece transposed below */
#pragma omp parallel
  {
    float *scratch =
        mem_alloc(MEM_WORKSPACE, sizeof(float) * (size_t)hk->scratch_forward * tile * op->ktile);
    if (kt) {
#pragma omp for schedule(static) collapse(2)
      for (long u = 0; u < op->units; u++)
        for (int kp = 0; kp < ks.pieces; kp++)
          tile_transpose(ks.len, d, k + unit_row(op, u, ks.stride, kp * ks.len, op->ldi), op->ldi,
                         kt + (u * ks.pieces + kp) * kt_piece, ks.len);
    }
#pragma omp for schedule(dynamic, 1) collapse(2)
    for (long u = 0; u < op->units; u++)
      for (long it = 0; it < qs.pieces * ntp; it++) {
        const int p = (int)(it / ntp);
        const long i0 = it % ntp * tile, i1 = i0 + tile < qs.len ? i0 + tile : qs.len;
        const long qr = u * nh * qs.stride + p * qs.len; /* head 0's row in (units·heads, stride) */
        const struct online_state o = {op->ml + qr, op->ml + lrows + qr,
                                       out + unit_row(op, u, nh * qs.stride, p * qs.len, op->ldo),
                                       qs.stride, op->ldo};
        for (long h = 0; first && h < nh; h++)
          for (long i = i0; i < i1; i++) {
            o.m[h * o.stride + i] = -INFINITY, o.l[h * o.stride + i] = 0.0f;
            memset(o.acc + h * o.stride * d + i * o.ld, 0, sizeof(float) * (size_t)d);
          }
        for (int kp = 0; kp < ks.pieces; kp++) {
          const struct exact_rows x = {
              .q = q + unit_row(op, u, ng * qs.stride, p * qs.len, op->ldi),
              .k = k + unit_row(op, u, ng * ks.stride, kp * ks.len, op->ldi),
              .v = v + unit_row(op, u, nh * ks.stride, kp * ks.len, op->ldi),
              .ld = op->ldi,
              .qstride = qs.stride,
              .kstride = ks.stride,
              .qoff = qs.off[p],
              .koff = ks.off[kp],
              .d = d,
              .tile = tile,
              .ktile = op->ktile,
              .unit = u,
              .kt = kt ? kt + (u * ks.pieces + kp) * kt_piece : NULL,
              .kt_ld = ks.len};
          exact_block_forward(hk, &x, o, ks.len, op->mk, i0, i1, scratch);
        }
        for (long h = 0; last && h < nh; h++)
          for (long i = i0; i < i1; i++) {
            const long row = h * o.stride + i;
            const float inv = 1.0f / o.l[row];
            float *acc = o.acc + h * o.stride * d + i * o.ld;
            for (int c = 0; c < d; c++) acc[c] *= inv;
            op->lse_out[qr + row] = o.m[row] + logf(o.l[row]);
          }
      }
    mem_free(scratch);
  }
  mem_free(kt);
}

/* rows × d floats from src (rows ld_src apart) to dst (ld_dst apart) */
static void rows_copy(float *dst, long ld_dst, const float *src, long ld_src, long rows, int d) {
  for (long r = 0; r < rows; r++) memcpy(dst + r * ld_dst, src + r * ld_src, sizeof(float) * d);
}

/* Gradients of the queries q (as exact_fold's) against the keys k, v: dq (as q), dk, dv (as k, v)
 * and the hook's parameters +=, but dq, dk, dv written (=) by token (op->rows, one slab, so a
 * unit's gradient is whole after its task); dout, D (units·heads, qs.stride[, d]) as saved and
 * formed. One task per unit, so no updates race. */
static void exact_grad_step(const struct exact_op *op, struct exact_span qs, const float *q,
                            const float *dout, const float *D, float *dq, struct exact_span ks,
                            const float *k, const float *v, float *dk, float *dv) {
  const struct exact_hook *hk = op->hk;
  const long nh = hk->heads, ng = hk->qk_heads;
  const int d = op->d, tile = op->tile;
  const bool tr = transposed_kv(op);
#pragma omp parallel
  {
    float *scratch =
        mem_alloc(MEM_WORKSPACE, sizeof(float) * (size_t)hk->scratch_backward * tile * op->ktile);
    /* this unit's keys and values transposed, (d, ks.len) each, at each key piece's first use */
    float *kvt =
        tr ? mem_alloc_uninit(MEM_WORKSPACE, sizeof(float) * 2 * (size_t)ks.len * d) : NULL;
    /* By token (op->rows, one slab): the unit's q, k, v, dout gathered by head and its dq, dk, dv
     * formed so, then copied to the caller's rows, in the thread's buffers (T, d) each: products
     * that read and accumulate rows ld floats apart ran backward a third slower. Copied or
     * zeroed per unit below. */
    float *pack =
        op->rows ? mem_alloc_uninit(MEM_WORKSPACE, sizeof(float) * 7 * (size_t)ks.len * d) : NULL;
#pragma omp for schedule(dynamic, 1)
    for (long u = 0; u < op->units; u++)
      for (int kp = 0; kp < ks.pieces; kp++)
        for (int p = 0; p < qs.pieces; p++) {
          const long qr = u * nh * qs.stride + p * qs.len,
                     qg = unit_row(op, u, ng * qs.stride, p * qs.len, op->ldi);
          const long kg = unit_row(op, u, ng * ks.stride, kp * ks.len, op->ldi);
          const long vg = unit_row(op, u, nh * ks.stride, kp * ks.len, op->ldi);
          const long og = unit_row(op, u, nh * qs.stride, p * qs.len, op->ldo);
          /* where the unit's rows are read and formed: in place, or packed */
          const float *uq = q + qg, *uk = k + kg, *uv = v + vg, *udo = dout + og;
          float *udq = dq + qg, *udk = dk + kg, *udv = dv + vg;
          long ld = op->ldi, ldo = op->ldo;
          const long Td = ks.len * d;
          if (pack) {
            rows_copy(pack, d, uq, op->ldi, qs.len, d);
            rows_copy(pack + Td, d, uk, op->ldi, ks.len, d);
            if (!kvt)
              rows_copy(pack + 2 * Td, d, uv, op->ldi, ks.len, d); /* else read as vt only */
            rows_copy(pack + 3 * Td, d, udo, op->ldo, qs.len, d);
            memset(pack + 4 * Td, 0, sizeof(float) * 3 * (size_t)Td);
            uq = pack, uk = pack + Td, uv = pack + 2 * Td, udo = pack + 3 * Td;
            udq = pack + 4 * Td, udk = pack + 5 * Td, udv = pack + 6 * Td;
            ld = ldo = d;
          }
          if (kvt && p == 0) {
            tile_transpose(ks.len, d, uk, ld, kvt, ks.len);
            tile_transpose(ks.len, d, v + vg, op->ldi, kvt + ks.len * d, ks.len); /* the caller's */
          }
          const struct exact_rows x = {.q = uq,
                                       .k = uk,
                                       .v = kvt ? NULL : uv, /* backward reads v only as vt then */
                                       .ld = ld,
                                       .qstride = qs.stride,
                                       .kstride = ks.stride,
                                       .qoff = qs.off[p],
                                       .koff = ks.off[kp],
                                       .d = d,
                                       .tile = tile,
                                       .ktile = op->ktile,
                                       .unit = u,
                                       .kt = kvt,
                                       .vt = kvt ? kvt + ks.len * d : NULL,
                                       .kt_ld = ks.len};
          const struct exact_grads g = {
              .dq = udq,
              .dk = udk,
              .dv = udv,
              .dpar = op->dpar ? op->dpar + u * hk->param_floats : NULL,
              .dout = udo,
              .lse = op->lse + qr,
              .D = D + qr,
              .scale = op->head_scale ? op->head_scale + (u * nh) % op->H : NULL,
              .ld_dout = ldo};
          exact_block_backward(hk, &x, &g, qs.len, ks.len, op->mk, scratch);
          if (pack) { /* one slab: the unit's whole gradient, written (attn_ctx.rows) */
            rows_copy(dq + qg, op->ldi, udq, d, qs.len, d);
            rows_copy(dk + kg, op->ldi, udk, d, ks.len, d);
            rows_copy(dv + vg, op->ldi, udv, d, ks.len, d);
          }
        }
    mem_free(pack);
    mem_free(kvt);
    mem_free(scratch);
  }
}

/* The scale of the output gradient of row block bh (rows of T tokens, heads cycling fastest
 * after batch): head_scale[bh % H], or 1. */
static float head_alpha(const float *head_scale, long bh, long H) {
  return head_scale ? head_scale[bh % H] : 1.0f;
}

/* D (B·H·T) = rowsum(alpha·dout ∘ out), the softmax backward's per-row correction. Each row's sum
 * runs over its d columns in order (so D is the same bits however rows are grouped), ROWDOT_ROWS
 * rows at once: one row's chain of dependent adds took 5.9 % of the attention's backward at
 * n = 512 (docs/perf.md). */
enum { ROWDOT_ROWS = 8 };
static void exact_rowdot(const struct exact_op *op, float *D, const float *dout, const float *out,
                         long BH) {
  const long T = op->T, rows = BH * T;
  const int d = op->d;
#pragma omp parallel for schedule(static)
  for (long r0 = 0; r0 < rows; r0 += ROWDOT_ROWS) {
    const float *a[ROWDOT_ROWS], *b[ROWDOT_ROWS];
    float s[ROWDOT_ROWS] = {0};
    const int g = rows - r0 < ROWDOT_ROWS ? (int)(rows - r0) : ROWDOT_ROWS;
    for (int i = 0; i < ROWDOT_ROWS; i++) { /* a short group repeats its last row */
      const long r = r0 + (i < g ? i : g - 1), at = unit_row(op, r / T, T, r % T, op->ldo);
      a[i] = dout + at, b[i] = out + at;
    }
    for (int c = 0; c < d; c++)
      for (int i = 0; i < ROWDOT_ROWS; i++) s[i] += a[i][c] * b[i][c];
    for (int i = 0; i < g; i++) D[r0 + i] = head_alpha(op->head_scale, (r0 + i) / T, op->H) * s[i];
  }
}

/* What backward forms before its step: D (returned) and the hook's per-unit parameter gradients;
 * grads_close adds those up in unit order and frees both. */
static float *grads_open(struct exact_op *op, const float *dout, const float *out) {
  const long rows = op->units * op->hk->heads;
  float *D = mem_alloc_uninit(MEM_WORKSPACE, sizeof(float) * (size_t)(rows * op->T)); /* rowdot */
  const size_t np = op->hk->param_floats;
  if (np) op->dpar = mem_alloc(MEM_WORKSPACE, sizeof(float) * np * (size_t)op->units);
  exact_rowdot(op, D, dout, out, rows);
  return D;
}

static void grads_close(struct exact_op *op, float *D) {
  const size_t np = op->hk->param_floats;
  if (op->dpar && op->dparams)
    for (long u = 0; u < op->units; u++)
      for (size_t e = 0; e < np; e++) op->dparams[e] += op->dpar[u * np + e];
  mem_free(op->dpar);
  op->dpar = NULL;
  mem_free(D);
}

/* ---------------------------------------------------------------------------------------------
 * the paths: one slab of queries against one contiguous range of keys (the whole op on one rank,
 * and `local` against its halo-extended keys), and `full`'s ring */

/* out, lse for my queries at global qoff against keys k (units·qk_heads, Tk, d), v
 * (units·heads, Tk, d) at global koff. */
static void slab_forward(struct exact_op *op, float *out, const float *q, long qoff, const float *k,
                         const float *v, long Tk, long koff) {
  op->ml = mem_alloc_uninit(MEM_WORKSPACE, /* every row started by the fold (first) */
                            sizeof(float) * 2 * (size_t)(op->units * op->hk->heads * op->T));
  exact_fold(op, slab_span(op->T, qoff), q, out, slab_span(Tk, koff), k, v, true, true);
  mem_free(op->ml);
}

/* dq and dk, dv (as k, v) += the gradients of slab_forward's op. */
static void slab_backward(struct exact_op *op, float *dq, float *dk, float *dv, const float *dout,
                          const float *q, long qoff, const float *k, const float *v, long Tk,
                          long koff, const float *out) {
  float *D = grads_open(op, dout, out);
  exact_grad_step(op, slab_span(op->T, qoff), q, dout, D, dq, slab_span(Tk, koff), k, v, dk, dv);
  grads_close(op, D);
}

/* `local` under sequence parallelism: the band's halo (band − 1 tokens before the slab, and after
 * it when bidirectional, clipped to [0, n), possibly from several ranks) gathered into extended
 * k (units·qk_heads, E, d) then v (units·heads, E, d), E = hi − lo; they travel stacked, so one
 * alltoallv moves both. */
static float *halo_keys(const struct attn_ctx *ctx, const struct exact_op *op, struct halo *h,
                        const float *k, const float *v) {
  const struct attn_dims *dm = &ctx->dims;
  const long rk = op->units * op->hk->qk_heads, rv = op->units * op->hk->heads, d = dm->d;
  const long T = dm->T, reach = op->mk.band - 1;
  halo_plan(h, ctx->comm, dm->n, T, reach, dm->causal ? 0 : reach);
  float *kv = mem_alloc(MEM_COMM, sizeof(float) * (size_t)((rk + rv) * T * d)); /* k then v */
  memcpy(kv, k, sizeof(float) * (size_t)(rk * T * d));
  memcpy(kv + rk * T * d, v, sizeof(float) * (size_t)(rv * T * d));
  float *ext = mem_alloc(MEM_WORKSPACE, sizeof(float) * (size_t)((rk + rv) * (h->hi - h->lo) * d));
  halo_gather(h, ctx->comm, ext, kv, rk + rv, d);
  mem_free(kv);
  return ext;
}

static void local_forward(struct attn_ctx *ctx, struct exact_op *op, float *out, const float *q,
                          const float *k, const float *v) {
  struct halo h;
  float *ext = halo_keys(ctx, op, &h, k, v);
  const long E = h.hi - h.lo, XK = op->units * op->hk->qk_heads * E * op->d;
  slab_forward(op, out, q, ctx->dims.t0, ext, ext + XK, E, h.lo);
  mem_free(ext);
  halo_free(&h);
}

/* Backward gathers the halo again (saved holds only the log-sum-exp), forms dk, dv over the
 * extended range and sends the halo parts back to their owners. */
static void local_backward(struct attn_ctx *ctx, struct exact_op *op, float *dq, float *dk,
                           float *dv, const float *dout, const float *q, const float *k,
                           const float *v, const float *out) {
  const long rk = op->units * op->hk->qk_heads, rv = op->units * op->hk->heads, d = op->d;
  const long XK = rk * op->T * d, XV = rv * op->T * d;
  struct halo h;
  float *ext = halo_keys(ctx, op, &h, k, v);
  const long E = h.hi - h.lo;
  float *dext = mem_alloc(MEM_WORKSPACE, sizeof(float) * (size_t)((rk + rv) * E * d)); /* as ext */
  slab_backward(op, dq, dext, dext + rk * E * d, dout, q, ctx->dims.t0, ext, ext + rk * E * d, E,
                h.lo, out);
  if (!op->hk->keep_halo) {
    mem_free(ext);
    ext = NULL;
  }
  float *dkv = mem_alloc(MEM_COMM, sizeof(float) * (size_t)(XK + XV)); /* dk then dv */
  halo_scatter_add(&h, ctx->comm, dkv, dext, rk + rv, d);
#pragma omp parallel for schedule(static)
  for (long i = 0; i < XK; i++) dk[i] += dkv[i];
#pragma omp parallel for schedule(static)
  for (long i = 0; i < XV; i++) dv[i] += dkv[XK + i];
  mem_free(dkv);
  mem_free(dext);
  mem_free(ext);
  halo_free(&h);
}

/* `full` under sequence parallelism: the ring (ring.c) carries k and v round the sequence group
 * (zigzag pieces when causal, SPEC §7) and calls these at each step; m, l and lse stay in the
 * ring's layout (saved so: backward runs the same ring). */
static struct exact_span ring_span(const struct ring *rg, int r) {
  return (struct exact_span){rg->pieces,
                             rg->L,
                             rg->T,
                             {ring_offset(rg, r, 0), rg->pieces == 2 ? ring_offset(rg, r, 1) : 0}};
}

static void ring_fold(const struct ring_step *s, void *user) {
  const struct ring *rg = s->rg;
  exact_fold(user, ring_span(rg, rg->me), s->stay[0], s->out[0], ring_span(rg, s->src),
             s->travel[0], s->travel[1], s->t == 0, s->t == rg->S - 1);
}

static void ring_grad(const struct ring_step *s, void *user) {
  const struct ring *rg = s->rg;
  exact_grad_step(user, ring_span(rg, rg->me), s->stay[0], s->stay[1], s->stay[2], s->out[0],
                  ring_span(rg, s->src), s->travel[0], s->travel[1], s->dtravel[0], s->dtravel[1]);
}

static void full_ring_forward(struct attn_ctx *ctx, struct exact_op *op, float *out, const float *q,
                              const float *k, const float *v) {
  const struct ring rg = ring_plan(ctx->comm, op->T, ctx->dims.causal);
  const long nq = op->units * op->hk->qk_heads, nv = op->units * op->hk->heads, d = op->d;
  op->ml = mem_alloc(MEM_WORKSPACE, sizeof(float) * 2 * (size_t)(nv * op->T));
  const struct ring_pass ps = {.stay = {1, {nq}, {d}},
                               .travel = {2, {nq, nv}, {d, d}},
                               .out = {1, {nv}, {d}},
                               .stay_in = {q},
                               .travel_in = {k, v},
                               .out_io = {out},
                               .step = ring_fold,
                               .user = op};
  ring_forward(&rg, &ps);
  mem_free(op->ml);
}

static void full_ring_backward(struct attn_ctx *ctx, struct exact_op *op, float *dq, float *dk,
                               float *dv, const float *dout, const float *q, const float *k,
                               const float *v, const float *out) {
  const struct ring rg = ring_plan(ctx->comm, op->T, ctx->dims.causal);
  const long nq = op->units * op->hk->qk_heads, nv = op->units * op->hk->heads, d = op->d;
  float *D = grads_open(op, dout, out); /* per row, so formed before the move: 1/d the traffic */
  const struct ring_pass ps = {.stay = {3, {nq, nv, nv}, {d, d, 1}},
                               .travel = {2, {nq, nv}, {d, d}},
                               .out = {1, {nq}, {d}},
                               .stay_in = {q, dout, D},
                               .travel_in = {k, v},
                               .out_io = {dq},
                               .dtravel = {dk, dv},
                               .step = ring_grad,
                               .user = op};
  ring_backward(&rg, &ps);
  grads_close(op, D);
}

/* ---------------------------------------------------------------------------------------------
 * the entry points */

static bool exact_distributed(const struct attn_ctx *ctx) { return ctx->comm && ctx->comm->S > 1; }

void exact_hooked_forward(struct attn_ctx *ctx, const struct exact_hook *hk, long band, float *out,
                          float *lse, const float *q, const float *k, const float *v) {
  struct exact_op op = exact_op_make(ctx, hk, band, NULL);
  op.lse_out = lse;
  if (!exact_distributed(ctx))
    slab_forward(&op, out, q, ctx->dims.t0, k, v, ctx->dims.T, ctx->dims.t0);
  else if (band > 0)
    local_forward(ctx, &op, out, q, k, v);
  else
    full_ring_forward(ctx, &op, out, q, k, v);
}

void exact_hooked_backward(struct attn_ctx *ctx, const struct exact_hook *hk, long band,
                           const float *head_scale, float *dq, float *dk, float *dv, float *dparams,
                           const float *dout, const float *q, const float *k, const float *v,
                           const float *out, const float *lse) {
  struct exact_op op = exact_op_make(ctx, hk, band, head_scale);
  op.lse = lse;
  op.dparams = dparams;
  if (!exact_distributed(ctx))
    slab_backward(&op, dq, dk, dv, dout, q, ctx->dims.t0, k, v, ctx->dims.T, ctx->dims.t0, out);
  else if (band > 0)
    local_backward(ctx, &op, dq, dk, dv, dout, q, k, v, out);
  else
    full_ring_backward(ctx, &op, dq, dk, dv, dout, q, k, v, out);
}

void exact_attention_forward(struct attn_ctx *ctx, long band, float *out, float *lse,
                             const float *q, const float *k, const float *v) {
  exact_hooked_forward(ctx, &full_hook, band, out, lse, q, k, v);
}

void exact_attention_backward(struct attn_ctx *ctx, long band, const float *head_scale, float *dq,
                              float *dk, float *dv, const float *dout, const float *q,
                              const float *k, const float *v, const float *out, const float *lse) {
  struct exact_hook hk = full_hook; /* 1/√d in dS, so that dq and dk's products have alpha 1 */
  hk.ds_scale = 1.0f / sqrtf((float)ctx->dims.d);
  exact_hooked_backward(ctx, &hk, band, head_scale, dq, dk, dv, NULL, dout, q, k, v, out, lse);
}

bool exact_attention_allows(bool causal, long band, long i, long j) {
  long lo, hi;
  key_range((struct key_mask){causal, band}, i, &lo, &hi);
  return j >= lo && j <= hi;
}

/* ---------------------------------------------------------------------------------------------
 * the two variants */

extern struct attn_variant attention_local;
extern struct attn_variant attention_fish_full, attention_fish_local;

/* The band of the two variants of this file: local.band for `local`, none for `full`. */
static long variant_band(const struct attn_ctx *ctx) {
  return ctx->variant == &attention_local ? ctx->opt.local_band : 0;
}

static size_t exact_saved_floats(const struct attn_ctx *ctx) {
  /* log-sum-exp per query row; in the ring's (zigzag) order when the causal ring ran */
  return (size_t)(ctx->dims.B * ctx->dims.H * ctx->dims.T);
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

/* By token on one sequence rank (the halo and the ring move slabs by head), without a band: the
 * backward gathers a whole unit by head (7·T·d floats per thread), where a band's query tile needs
 * only tile + band − 1 keys, so at long n `local` would spend more on the gathers than the copies
 * cost. */
static bool exact_takes_rows(const struct attn_ctx *ctx) {
  return !exact_distributed(ctx) && variant_band(ctx) <= 0;
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
  const int bands = ctx->opt.diag_bands;
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
            .takes_rows = exact_takes_rows,
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
            .takes_rows = exact_takes_rows,
            .forward = exact_forward,
            .backward = exact_backward},
};
