// Exact attention's fast path on the GPU, the blocked form of src/attention/full.c's tile loops: a
// chunk of query rows against the keys it may see by one strided-batched gpu_gemm (fp32, or bf16
// operands per gpu_bf16()), a masked online softmax in plain SIMT, P·V by gpu_gemm; backward
// recomputes P from lse and forms every gradient by a GEMM or a sum in fixed order (no float
// atomics). Chunks fit a workspace budget (no n × n buffer); a band reads only its keys' windows.
#include <algorithm>
#include <climits>
#include <cstdlib>

#include "attention_full.cuh"
#include "check.h"
#include "gpu.h"

namespace {

constexpr int kThreads = 128;  // the row kernels: one block of 4 warps per score row
constexpr int kWarp = 32;
constexpr unsigned kAll = 0xffffffffu;
constexpr unsigned kGridStride = 256;                    // the element-wise kernels' blocks
constexpr size_t kDefaultWorkspace = size_t(256) << 20;  // bytes per call

size_t workspace = kDefaultWorkspace;  // bytes: the deck's gpu.exact_workspace_mb

// Where a batch of G score tiles of R rows × C columns lies (the twin of full.c's exact_rows and
// tile_columns): tile t is block t % nb of head t / nb; its row r is query qbase + lr, where
// lr = (t % nb)·step + r (a padding row when lr ≥ qrows), and its column c is key
// kbase + (t % nb)·step + c, which exists when in [klo, khi). The per-row state (m, l, lse, D) of
// that row lies at (t / nb)·sh + lr, its accumulator row at (t / nb)·ash + lr.
struct Geo {
  exact_mask mk;
  long nb, step, qbase, qrows, kbase, klo, khi, sh, ash;
};

// Whether query i sees key j (global indices; full.c's key_range), j existing.
__device__ bool sees(const Geo &g, long i, long j) {
  if (j < g.klo || j >= g.khi) return false;
  if (g.mk.causal && j > i) return false;
  return g.mk.band <= 0 || (j > i - g.mk.band && j < i + g.mk.band);
}

__device__ float warp_max(float v) {
  for (int o = kWarp / 2; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(kAll, v, o));
  return v;
}

__device__ float warp_sum(float v) {
  for (int o = kWarp / 2; o > 0; o /= 2) v += __shfl_xor_sync(kAll, v, o);
  return v;
}

// The block's max (kMax) or sum of v, in every thread, the warps' partials taken in warp order;
// red: kThreads / kWarp floats of shared memory, free again on return.
template <bool kMax>
__device__ float block_reduce(float v, float *red) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  v = kMax ? warp_max(v) : warp_sum(v);
  if (lane == 0) red[warp] = v;
  __syncthreads();  // every warp's partial is written
  float r = red[0];
  for (int w = 1; w < kThreads / kWarp; w++) r = kMax ? fmaxf(r, red[w]) : r + red[w];
  __syncthreads();  // every thread has read them: red may be written again
  return r;
}

// grid R·G, block kThreads: one block per score row (full.c's online_row). The row's scores
// become its weights exp(S − m′) where the mask allows (0 elsewhere and on padding rows), and
// the running max m, sum l and accumulator row (rescaled by exp(m − m′)) take them in.
__global__ void fold_rows(float *S, float *m, float *l, float *acc, long R, long C, int d, Geo g) {
  __shared__ float red[kThreads / kWarp];
  const long t = blockIdx.x / R, lr = (t % g.nb) * g.step + blockIdx.x % R;
  const long i = g.qbase + lr, j0 = g.kbase + (t % g.nb) * g.step;
  const bool live = lr < g.qrows;
  const size_t st = (size_t)(t / g.nb) * g.sh + lr;
  float *s = S + (size_t)blockIdx.x * C;
  const float m0 = live ? m[st] : -INFINITY, l0 = live ? l[st] : 0.0f;  // read before any write
  float mx = -INFINITY;
  for (long c = threadIdx.x; c < C; c += blockDim.x)
    if (live && sees(g, i, j0 + c)) mx = fmaxf(mx, s[c]);
  const float mn = fmaxf(m0, block_reduce<true>(mx, red));
  float sum = 0.0f;
  for (long c = threadIdx.x; c < C; c += blockDim.x) {
    const float p = mn > -INFINITY && live && sees(g, i, j0 + c) ? expf(s[c] - mn) : 0.0f;
    s[c] = p;
    sum += p;
  }
  sum = block_reduce<false>(sum, red);
  if (mn == -INFINITY) return;        // no key seen yet (or a padding row): the state stays
  const float alpha = expf(m0 - mn);  // 0 on the first keys seen (m0 = −∞)
  float *a = acc + ((size_t)(t / g.nb) * g.ash + lr) * d;
  if (alpha != 1.0f)
    for (int e = threadIdx.x; e < d; e += blockDim.x) a[e] *= alpha;
  if (threadIdx.x == 0) {
    m[st] = mn;
    l[st] = l0 * alpha + sum;
  }
}

// grid R·G, block kThreads: one block per score row (full.c's softmax_tile_backward): the scores
// become the probabilities exp(S − lse) where the mask allows, 0 elsewhere and on padding rows.
__global__ void probs_rows(float *S, const float *lse, long R, long C, Geo g) {
  const long t = blockIdx.x / R, lr = (t % g.nb) * g.step + blockIdx.x % R;
  const long i = g.qbase + lr, j0 = g.kbase + (t % g.nb) * g.step;
  const bool live = lr < g.qrows;
  const float L = live ? lse[(size_t)(t / g.nb) * g.sh + lr] : 0.0f;
  float *s = S + (size_t)blockIdx.x * C;
  for (long c = threadIdx.x; c < C; c += blockDim.x)
    s[c] = live && sees(g, i, j0 + c) ? expf(s[c] - L) : 0.0f;
}

// grid R·G, block kThreads: one block per score row (full.c's softmax_tile_backward): dP becomes
// dS = P ∘ (dP − D), 0 on padding rows.
__global__ void dscores_rows(float *dP, const float *P, const float *D, long R, long C, Geo g) {
  const long t = blockIdx.x / R, lr = (t % g.nb) * g.step + blockIdx.x % R;
  const bool live = lr < g.qrows;
  const float Di = live ? D[(size_t)(t / g.nb) * g.sh + lr] : 0.0f;
  float *dp = dP + (size_t)blockIdx.x * C;
  const float *p = P + (size_t)blockIdx.x * C;
  for (long c = threadIdx.x; c < C; c += blockDim.x) dp[c] = live ? p[c] * (dp[c] - Di) : 0.0f;
}

// grid-stride over rows × d, block kGridStride: the state before any key (full.c's exact_fold,
// first step): m = −∞, l = 0, acc = 0.
__global__ void state_init_k(float *m, float *l, float *acc, size_t rows, int d) {
  for (size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x; e < rows * d;
       e += (size_t)gridDim.x * blockDim.x) {
    acc[e] = 0.0f;
    if (e % d == 0) {
      m[e / d] = -INFINITY;
      l[e / d] = 0.0f;
    }
  }
}

// grid-stride over rows × d, block kGridStride (full.c's exact_fold, last step): out = acc / l
// (in place when out = acc), lse = m + log l.
__global__ void state_finish_k(float *out, float *lse, const float *acc, const float *m,
                               const float *l, size_t rows, int d) {
  for (size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x; e < rows * d;
       e += (size_t)gridDim.x * blockDim.x) {
    const size_t r = e / d;
    out[e] = acc[e] * (1.0f / l[r]);
    if (e % d == 0) lse[r] = m[r] + logf(l[r]);
  }
}

// grid-stride over G × W × d, block kGridStride: window t (block t % nb of head t / nb) of W rows
// of src starting at row s0 + (t % nb)·step of its head (hs rows apart; rows [0, n) exist, zeros
// elsewhere). A band's keys for a query block (full.c reads them in place: x->k + j0·d).
__global__ void windows_gather(float *dst, const float *src, long hs, long G, long nb, long W,
                               long step, long s0, long n, int d) {
  const size_t total = (size_t)G * W * d;
  for (size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x; e < total;
       e += (size_t)gridDim.x * blockDim.x) {
    const long t = (long)(e / ((size_t)W * d)), w = (long)(e / d % W);
    const long s = s0 + (t % nb) * step + w;
    dst[e] = s >= 0 && s < n ? src[((size_t)(t / nb) * hs + s) * d + e % d] : 0.0f;
  }
}

// grid-stride over H × (hi − lo) × d, block kGridStride: the transpose of windows_gather, added —
// row s in [lo, hi) of head h of dst += the sum, in block order, of the rows of the windows of
// head h that are row s (one thread per element: no atomics, a fixed order). full.c adds a tile's
// dk, dv in place (g->dk + j0·d).
__global__ void windows_add(float *dst, long hs, const float *src, long H, long nb, long W,
                            long step, long s0, long lo, long hi, int d) {
  const size_t rows = (size_t)(hi - lo), total = (size_t)H * rows * d;
  for (size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x; e < total;
       e += (size_t)gridDim.x * blockDim.x) {
    const long h = (long)(e / (rows * d)), s = lo + (long)(e / d % rows), x = s - s0;
    const long b1 = min(nb - 1, x / step), b0 = x - W + 1 <= 0 ? 0 : (x - W + step) / step;
    float sum = 0.0f;
    for (long b = b0; b <= b1; b++)
      sum += src[((size_t)(h * nb + b) * W + x - b * step) * d + e % d];
    dst[((size_t)h * hs + s) * d + e % d] += sum;
  }
}

// grid-stride over G × R × d, block kGridStride: a band chunk's padded state (tile t, row r at
// t·R + r) finished into out and lse at row (t / nb)·hs + (t % nb)·R + r of its head when that
// row exists (< n); full.c's exact_fold, last step.
__global__ void band_finish(float *out, float *lse, const float *acc, const float *m,
                            const float *l, long G, long nb, long R, long hs, long n, int d) {
  const size_t total = (size_t)G * R * d;
  for (size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x; e < total;
       e += (size_t)gridDim.x * blockDim.x) {
    const size_t row = e / d;
    const long t = (long)(row / R), lr = (t % nb) * R + (long)(row % R);
    if (lr >= n) continue;
    const size_t o = (size_t)(t / nb) * hs + lr;
    out[o * d + e % d] = acc[e] * (1.0f / l[row]);
    if (e % d == 0) lse[o] = m[row] + logf(l[row]);
  }
}

// ------------------------------------------------------------------------------------------------
// host side: launches, chunk plans, the two forms

unsigned stride_blocks(size_t n) {
  const size_t b = gpu_blocks(n, kGridStride);
  return (unsigned)(b < 4096 ? b : 4096);
}

// One block per score row of G tiles of R rows: the 1-D grid's size.
unsigned row_blocks(long R, long G) {
  return (unsigned)gpu_int((long long)R * G, "exact attention: score rows per launch");
}

// The budget in floats (at most 2³⁰, so that a chunk's rows always fit a 1-D grid).
size_t budget_floats() {
  const size_t f = gpu_exact_workspace() / sizeof(float), cap = size_t(1) << 30;
  return std::max<size_t>(1, std::min(f, cap));
}

float *workspace_alloc(size_t floats) {
  return static_cast<float *>(gpu_alloc(MEM_WORKSPACE, sizeof(float) * floats));
}

// Chunks of `units` (query rows, or query blocks) × heads whose units × heads × per_unit floats
// fit the budget, at most cap units: every unit of several heads, or part of one head's units (in
// 64s when many).
struct Chunks {
  long units, heads;
};

Chunks chunks_plan(long BH, long units, size_t per_unit, long cap) {
  long fit = (long)std::max<size_t>(1, budget_floats() / std::max<size_t>(1, per_unit));
  if (fit >= units && cap >= units) return {units, std::min(BH, fit / units)};
  fit = std::min(fit, cap);
  return {fit > 64 ? fit / 64 * 64 : fit, 1};
}

// The full form's query rows per chunk, at most: a causal chunk of c rows computes c²/2 masked
// scores beside the ones it needs, so chunks of n/16 rows (64 at least) keep that under 1/16.
long rows_cap(const exact_job &job, long n) {
  return job.mk.causal ? std::max(64L, (n / 16 + 63) / 64 * 64) : LONG_MAX;
}

// Rows [*lo, *hi) of the key side that some query of [i0, i1] (global) may see (full.c's
// live_keys, without rounding to tiles).
void key_rows(exact_mask mk, long i0, long i1, exact_side ks, long *lo, long *hi) {
  const long a = mk.band > 0 ? i0 - mk.band + 1 : LONG_MIN / 2;
  const long b = mk.causal ? i1 : (mk.band > 0 ? i1 + mk.band - 1 : LONG_MAX / 2);
  *lo = std::max(a - ks.off, 0L);
  *hi = std::min(b - ks.off + 1, ks.n);
  if (*hi < *lo) *hi = *lo;
}

void gather(float *dst, const float *src, long hs, long G, long nb, long W, long step, long s0,
            long n, int d) {
  const size_t total = (size_t)G * W * d;
  if (total == 0) return;
  windows_gather<<<stride_blocks(total), kGridStride, 0, gpu_stream()>>>(dst, src, hs, G, nb, W,
                                                                         step, s0, n, d);
  LAUNCH_CHECK(windows_gather);
}

// dst (H heads, hs rows apart, rows [0, n)) += the windows of src, as gather laid them.
void scatter_add(float *dst, long hs, const float *src, long H, long nb, long W, long step, long s0,
                 long n, int d) {
  const long lo = std::max(s0, 0L), hi = std::min(s0 + (nb - 1) * step + W, n);
  if (H == 0 || hi <= lo) return;
  const size_t total = (size_t)H * (hi - lo) * d;
  windows_add<<<stride_blocks(total), kGridStride, 0, gpu_stream()>>>(dst, hs, src, H, nb, W, step,
                                                                      s0, lo, hi, d);
  LAUNCH_CHECK(windows_add);
}

// A band's query block: about half the band, 16 to 64 rows (full.c's exact_tile for full.block
// 64): a block then reads bq + 2(band − 1) keys (bq + band − 1 when causal), 80 % of them or more
// seen for a long band.
long band_tile(long band) {
  long t = 16;
  while (t < 64 && 2 * t < band) t *= 2;
  return t;
}

// The band form's layout: query blocks of bq rows, nb per head, each against a window of W keys
// whose first is band − 1 before the block's first query: key-side row shift + b·bq for block b.
struct Band {
  long bq, W, nb, shift;
};

Band band_layout(const exact_job &job, exact_side qs, exact_side ks) {
  const long b = job.mk.band, bq = band_tile(b);
  return {bq, bq + (b - 1) + (job.mk.causal ? 0 : b - 1), (qs.n + bq - 1) / bq,
          qs.off - ks.off - (b - 1)};
}

// The band form pays when a window is shorter than the keys: else the full form, with the mask.
bool banded(const exact_job &job, exact_side qs, exact_side ks) {
  return job.mk.band > 0 && band_layout(job, qs, ks).W < ks.n;
}

// The band form's forward: for each chunk of query blocks × heads, gather the blocks' queries and
// key/value windows, scores, the online softmax from a fresh state, P·V, finish into out and lse.
void band_forward(const exact_job &job, exact_side qs, const float *q, float *out, float *lse,
                  exact_side ks, const float *k, const float *v) {
  const Band bd = band_layout(job, qs, ks);
  const long bq = bd.bq, W = bd.W, d = job.d;
  const float scale = 1.0f / sqrtf((float)d);
  const size_t per = bq * W + 2 * bq * d + 2 * W * d + 2 * bq;  // S, Qp, acc, Kw, Vw, m, l
  const Chunks ch = chunks_plan(job.BH, bd.nb, per, LONG_MAX);
  float *ws = workspace_alloc(per * ch.units * ch.heads);
  for (long b0 = 0; b0 < bd.nb; b0 += ch.units) {
    const long nbc = std::min(ch.units, bd.nb - b0), sq = b0 * bq, sk = bd.shift + b0 * bq;
    for (long h0 = 0; h0 < job.BH; h0 += ch.heads) {
      const long hb = std::min(ch.heads, job.BH - h0), G = hb * nbc;
      float *S = ws, *Qp = S + G * bq * W, *acc = Qp + G * bq * d, *Kw = acc + G * bq * d;
      float *Vw = Kw + G * W * d, *m = Vw + G * W * d, *l = m + G * bq;
      gather(Qp, q + h0 * qs.stride * d, qs.stride, G, nbc, bq, bq, sq, qs.n, job.d);
      gather(Kw, k + h0 * ks.stride * d, ks.stride, G, nbc, W, bq, sk, ks.n, job.d);
      gather(Vw, v + h0 * ks.stride * d, ks.stride, G, nbc, W, bq, sk, ks.n, job.d);
      exact_state_init(m, l, acc, G * bq, job.d);
      gpu_gemm(false, true, bq, W, d, scale, Qp, d, bq * d, Kw, d, W * d, 0.0f, S, W, bq * W, G);
      const Geo g = {job.mk, nbc,           bq,       qs.off + sq, qs.n - sq, ks.off + sk,
                     ks.off, ks.off + ks.n, nbc * bq, nbc * bq};
      fold_rows<<<row_blocks(bq, G), kThreads, 0, gpu_stream()>>>(S, m, l, acc, bq, W, job.d, g);
      LAUNCH_CHECK(fold_rows);
      gpu_gemm(false, false, bq, d, W, 1.0f, S, W, bq * W, Vw, d, W * d, 1.0f, acc, d, bq * d, G);
      const size_t total = (size_t)G * bq * d;
      band_finish<<<stride_blocks(total), kGridStride, 0, gpu_stream()>>>(
          out + (h0 * qs.stride + sq) * d, lse + h0 * qs.stride + sq, acc, m, l, G, nbc, bq,
          qs.stride, qs.n - sq, job.d);
      LAUNCH_CHECK(band_finish);
    }
  }
  gpu_free(ws);
}

// The band form's backward, chunk by chunk as forward: P from lse, dV_w = Pᵀ dO, dP = dO V_wᵀ,
// dS, dQ = dS K_w/√d, dK_w = dSᵀ Q/√d, the windows' gradients added home in block order.
void band_backward(const exact_job &job, exact_side qs, const float *q, const float *dout,
                   const float *D, const float *lse, float *dq, exact_side ks, const float *k,
                   const float *v, float *dk, float *dv) {
  const Band bd = band_layout(job, qs, ks);
  const long bq = bd.bq, W = bd.W, d = job.d;
  const float scale = 1.0f / sqrtf((float)d);
  const size_t per = 2 * bq * W + 3 * bq * d + 4 * W * d;  // S, dP, Qp, dOp, dQp, Kw, Vw, dKw, dVw
  const Chunks ch = chunks_plan(job.BH, bd.nb, per, LONG_MAX);
  float *ws = workspace_alloc(per * ch.units * ch.heads);
  for (long b0 = 0; b0 < bd.nb; b0 += ch.units) {
    const long nbc = std::min(ch.units, bd.nb - b0), sq = b0 * bq, sk = bd.shift + b0 * bq;
    for (long h0 = 0; h0 < job.BH; h0 += ch.heads) {
      const long hb = std::min(ch.heads, job.BH - h0), G = hb * nbc;
      float *S = ws, *dP = S + G * bq * W, *Qp = dP + G * bq * W, *dOp = Qp + G * bq * d;
      float *dQp = dOp + G * bq * d, *Kw = dQp + G * bq * d, *Vw = Kw + G * W * d;
      float *dKw = Vw + G * W * d, *dVw = dKw + G * W * d;
      const long qh = h0 * qs.stride, kh = h0 * ks.stride;
      gather(Qp, q + qh * d, qs.stride, G, nbc, bq, bq, sq, qs.n, job.d);
      gather(dOp, dout + qh * d, qs.stride, G, nbc, bq, bq, sq, qs.n, job.d);
      gather(Kw, k + kh * d, ks.stride, G, nbc, W, bq, sk, ks.n, job.d);
      gather(Vw, v + kh * d, ks.stride, G, nbc, W, bq, sk, ks.n, job.d);
      gpu_gemm(false, true, bq, W, d, scale, Qp, d, bq * d, Kw, d, W * d, 0.0f, S, W, bq * W, G);
      const Geo g = {job.mk,        nbc,       bq, qs.off + sq, qs.n - sq, ks.off + sk, ks.off,
                     ks.off + ks.n, qs.stride, 0};
      probs_rows<<<row_blocks(bq, G), kThreads, 0, gpu_stream()>>>(S, lse + qh + sq, bq, W, g);
      LAUNCH_CHECK(probs_rows);
      gpu_gemm(true, false, W, d, bq, 1.0f, S, W, bq * W, dOp, d, bq * d, 0.0f, dVw, d, W * d, G);
      gpu_gemm(false, true, bq, W, d, 1.0f, dOp, d, bq * d, Vw, d, W * d, 0.0f, dP, W, bq * W, G);
      dscores_rows<<<row_blocks(bq, G), kThreads, 0, gpu_stream()>>>(dP, S, D + qh + sq, bq, W, g);
      LAUNCH_CHECK(dscores_rows);
      gpu_gemm(false, false, bq, d, W, scale, dP, W, bq * W, Kw, d, W * d, 0.0f, dQp, d, bq * d, G);
      gpu_gemm(true, false, W, d, bq, scale, dP, W, bq * W, Qp, d, bq * d, 0.0f, dKw, d, W * d, G);
      scatter_add(dq + qh * d, qs.stride, dQp, hb, nbc, bq, bq, sq, qs.n, job.d);
      scatter_add(dk + kh * d, ks.stride, dKw, hb, nbc, W, bq, sk, ks.n, job.d);
      scatter_add(dv + kh * d, ks.stride, dVw, hb, nbc, W, bq, sk, ks.n, job.d);
    }
  }
  gpu_free(ws);
}

}  // namespace

// ------------------------------------------------------------------------------------------------
// the blocked form's entry points (attention_full.cuh, gpu.h)

void exact_state_init(float *m, float *l, float *acc, long rows, int d) {
  const size_t total = (size_t)rows * d;
  if (total == 0) return;
  state_init_k<<<stride_blocks(total), kGridStride, 0, gpu_stream()>>>(m, l, acc, rows, d);
  LAUNCH_CHECK(state_init_k);
}

void exact_state_finish(float *out, float *lse, float *acc, const float *m, const float *l,
                        long rows, int d) {
  const size_t total = (size_t)rows * d;
  if (total == 0) return;
  state_finish_k<<<stride_blocks(total), kGridStride, 0, gpu_stream()>>>(out, lse, acc, m, l, rows,
                                                                         d);
  LAUNCH_CHECK(state_finish_k);
}

// The full form: query chunks (× heads) against the key rows they may see, batched over heads.
void exact_fold(const exact_job &job, exact_side qs, const float *q, float *m, float *l, float *acc,
                exact_side ks, const float *k, const float *v) {
  if (job.BH == 0 || qs.n == 0 || ks.n == 0) return;
  const long d = job.d;
  const float scale = 1.0f / sqrtf((float)d);
  const Chunks ch = chunks_plan(job.BH, qs.n, (size_t)ks.n, rows_cap(job, qs.n));
  float *S = workspace_alloc((size_t)ch.units * ch.heads * ks.n);
  for (long i0 = 0; i0 < qs.n; i0 += ch.units) {
    const long R = std::min(ch.units, qs.n - i0);
    long klo, khi;
    key_rows(job.mk, qs.off + i0, qs.off + i0 + R - 1, ks, &klo, &khi);
    const long C = khi - klo;
    for (long h0 = 0; C > 0 && h0 < job.BH; h0 += ch.heads) {
      const long G = std::min(ch.heads, job.BH - h0), qr = h0 * qs.stride + i0,
                 kr = h0 * ks.stride + klo;
      gpu_gemm(false, true, R, C, d, scale, q + qr * d, d, qs.stride * d, k + kr * d, d,
               ks.stride * d, 0.0f, S, C, R * C, G);
      const Geo g = {job.mk,       1,         0,        qs.off + i0, R, ks.off + klo, ks.off + klo,
                     ks.off + khi, qs.stride, qs.stride};
      fold_rows<<<row_blocks(R, G), kThreads, 0, gpu_stream()>>>(S, m + qr, l + qr, acc + qr * d, R,
                                                                 C, job.d, g);
      LAUNCH_CHECK(fold_rows);
      gpu_gemm(false, false, R, d, C, 1.0f, S, C, R * C, v + kr * d, d, ks.stride * d, 1.0f,
               acc + qr * d, d, qs.stride * d, G);
    }
  }
  gpu_free(S);
}

void exact_grad(const exact_job &job, exact_side qs, const float *q, const float *dout,
                const float *D, const float *lse, float *dq, exact_side ks, const float *k,
                const float *v, float *dk, float *dv) {
  if (job.BH == 0 || qs.n == 0 || ks.n == 0) return;
  const long d = job.d;
  const float scale = 1.0f / sqrtf((float)d);
  const Chunks ch = chunks_plan(job.BH, qs.n, 2 * (size_t)ks.n, rows_cap(job, qs.n));
  const size_t tile = (size_t)ch.units * ch.heads * ks.n;
  float *P = workspace_alloc(2 * tile), *dP = P + tile;
  for (long i0 = 0; i0 < qs.n; i0 += ch.units) {
    const long R = std::min(ch.units, qs.n - i0);
    long klo, khi;
    key_rows(job.mk, qs.off + i0, qs.off + i0 + R - 1, ks, &klo, &khi);
    const long C = khi - klo;
    for (long h0 = 0; C > 0 && h0 < job.BH; h0 += ch.heads) {
      const long G = std::min(ch.heads, job.BH - h0), qr = h0 * qs.stride + i0,
                 kr = h0 * ks.stride + klo, qst = qs.stride * d, kst = ks.stride * d;
      gpu_gemm(false, true, R, C, d, scale, q + qr * d, d, qst, k + kr * d, d, kst, 0.0f, P, C,
               R * C, G);
      const Geo g = {job.mk,       1,         0, qs.off + i0, R, ks.off + klo, ks.off + klo,
                     ks.off + khi, qs.stride, 0};
      probs_rows<<<row_blocks(R, G), kThreads, 0, gpu_stream()>>>(P, lse + qr, R, C, g);
      LAUNCH_CHECK(probs_rows);
      // dv += Pᵀ dO; dP = dO vᵀ; dS = P ∘ (dP − D); dq += dS k/√d; dk += dSᵀ q/√d
      gpu_gemm(true, false, C, d, R, 1.0f, P, C, R * C, dout + qr * d, d, qst, 1.0f, dv + kr * d, d,
               kst, G);
      gpu_gemm(false, true, R, C, d, 1.0f, dout + qr * d, d, qst, v + kr * d, d, kst, 0.0f, dP, C,
               R * C, G);
      dscores_rows<<<row_blocks(R, G), kThreads, 0, gpu_stream()>>>(dP, P, D + qr, R, C, g);
      LAUNCH_CHECK(dscores_rows);
      gpu_gemm(false, false, R, d, C, scale, dP, C, R * C, k + kr * d, d, kst, 1.0f, dq + qr * d, d,
               qst, G);
      gpu_gemm(true, false, C, d, R, scale, dP, C, R * C, q + qr * d, d, qst, 1.0f, dk + kr * d, d,
               kst, G);
    }
  }
  gpu_free(P);
}

void exact_keys_forward(const exact_job &job, exact_side qs, const float *q, float *out, float *lse,
                        exact_side ks, const float *k, const float *v) {
  if (job.BH == 0 || qs.n == 0) return;
  if (banded(job, qs, ks)) {
    band_forward(job, qs, q, out, lse, ks, k, v);
    return;
  }
  const long rows = job.BH * qs.n;
  float *ml = workspace_alloc(2 * (size_t)rows);  // m, l
  exact_state_init(ml, ml + rows, out, rows, job.d);
  exact_fold(job, qs, q, ml, ml + rows, out, ks, k, v);
  exact_state_finish(out, lse, out, ml, ml + rows, rows, job.d);
  gpu_free(ml);
}

void exact_keys_backward(const exact_job &job, exact_side qs, const float *q, const float *dout,
                         const float *out, const float *lse, float *dq, exact_side ks,
                         const float *k, const float *v, float *dk, float *dv) {
  if (job.BH == 0 || qs.n == 0) return;
  const long rows = job.BH * qs.n;
  float *D = workspace_alloc((size_t)rows);
  gpu_rows_dot(D, dout, out, rows, job.d);
  if (banded(job, qs, ks))
    band_backward(job, qs, q, dout, D, lse, dq, ks, k, v, dk, dv);
  else
    exact_grad(job, qs, q, dout, D, lse, dq, ks, k, v, dk, dv);
  gpu_free(D);
}

extern "C" size_t gpu_exact_workspace(void) { return workspace; }

extern "C" void gpu_set_exact_workspace(size_t bytes) {
  workspace = bytes ? bytes : kDefaultWorkspace;
}

extern "C" void gpu_exact_blocked_forward(float *out, float *lse, const float *q, const float *k,
                                          const float *v, long BH, long T, int d, int causal,
                                          long band) {
  const exact_job job = {BH, d, {causal != 0, band}};
  const exact_side slab = {T, T, 0};
  exact_keys_forward(job, slab, q, out, lse, slab, k, v);
}

extern "C" void gpu_exact_blocked_backward(float *dq, float *dk, float *dv, const float *dout,
                                           const float *q, const float *k, const float *v,
                                           const float *out, const float *lse, long BH, long T,
                                           int d, int causal, long band) {
  const exact_job job = {BH, d, {causal != 0, band}};
  const exact_side slab = {T, T, 0};
  exact_keys_backward(job, slab, q, dout, out, lse, dq, slab, k, v, dk, dv);
}
