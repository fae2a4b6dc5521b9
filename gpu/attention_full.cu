// Exact attention's REFERENCE kernels on the device (gpu.exact = reference): `full` and
// `local` on one slab (S = 1), fp32 SIMT, the one-slab path of src/attention/full.c tile by tile
// with an online softmax (memory O(n·d)); lse saved, backward recomputing from it. The fast path
// is the blocked form (attention_full_blocked.cu); tests/test_gpu_full.c checks both against the
// CPU.
#include "attention_full.cuh"
#include "check.h"
#include "gpu.h"

// One thread owns one query row (forward, dq) or one key row (dk, dv) and keeps it in registers;
// the other side's rows pass through shared memory a tile at a time. dq and dk/dv are two kernels,
// so no atomics: every output row is summed by one thread in key (or query) order.
//
// Register pressure (nvcc 13.0, -O3 -arch=sm_90, -Xptxas -v): at d = 128 every kernel hits the
// 255-register cap and spills — exact_fwd<128> 4708 B of spill stores / 25008 B of loads,
// exact_bwd_dq<128> 1404 / 3468, exact_bwd_dkv<128> 3080 / 4104; at d = 64 exact_bwd_dq 76 / 180
// and exact_bwd_dkv 424 / 848 (exact_fwd<64> 254 registers, none); d ≤ 32 none. Acceptable for a
// reference; the blocked form's kernels use 20–40 registers.

namespace {

constexpr int kRows = 64;  // rows owned per block, one per thread
constexpr int kTile = 32;  // rows of the other side per shared-memory tile

struct Mask {
  bool causal;
  long band;  // 0: no band
};

__device__ bool allows(Mask mk, long i, long j) {
  if (mk.causal && j > i) return false;
  return mk.band <= 0 || (j > i - mk.band && j < i + mk.band);
}

// The keys [*lo, *hi] that some query of [i0, i1] may see (T keys).
__device__ void key_span(Mask mk, long i0, long i1, long T, long *lo, long *hi) {
  *lo = mk.band > 0 ? max(0L, i0 - mk.band + 1) : 0;
  *hi = mk.causal ? i1 : (mk.band > 0 ? min(T - 1, i1 + mk.band - 1) : T - 1);
}

// The queries [*lo, *hi] that may see some key of [j0, j1] (T queries).
__device__ void query_span(Mask mk, long j0, long j1, long T, long *lo, long *hi) {
  *lo = mk.causal ? j0 : (mk.band > 0 ? max(0L, j0 - mk.band + 1) : 0);
  *hi = mk.band > 0 ? min(T - 1, j1 + mk.band - 1) : T - 1;
}

template <int D>
__device__ float dot(const float *a, const float *b) {
  float s = 0.0f;
#pragma unroll
  for (int e = 0; e < D; e++) s += a[e] * b[e];
  return s;
}

// One row of a (T, D) array into registers; zeros for a row past the end.
template <int D>
__device__ void load_row(float *dst, const float *row, bool live) {
#pragma unroll
  for (int e = 0; e < D; e++) dst[e] = live ? row[e] : 0.0f;
}

// Stage rows [r0, r0 + count) of up to two (T, D) arrays into shared tiles.
template <int D>
__device__ void stage(float (*a_s)[D], const float *a, float (*b_s)[D], const float *b, long r0,
                      int count) {
  for (int e = threadIdx.x; e < count * D; e += blockDim.x) {
    a_s[e / D][e % D] = a[r0 * D + e];
    b_s[e / D][e % D] = b[r0 * D + e];
  }
}

// grid (query blocks, B·H): out, lse of queries [blockIdx.x·kRows, +kRows) of head blockIdx.y.
template <int D>
__global__ void exact_fwd(float *out, float *lse, const float *q, const float *k, const float *v,
                          long T, Mask mk, float scale) {
  __shared__ float ks[kTile][D], vs[kTile][D];
  const size_t head = (size_t)blockIdx.y * T * D;
  const long r0 = (long)blockIdx.x * kRows, i = r0 + threadIdx.x;
  const bool live = i < T;
  float qi[D], acc[D] = {};
  load_row<D>(qi, q + head + i * D, live);
  float m = -INFINITY, l = 0.0f;
  long lo, hi;
  key_span(mk, r0, min(r0 + kRows, T) - 1, T, &lo, &hi);
  for (long j0 = lo; j0 <= hi; j0 += kTile) {
    const int bj = (int)min((long)kTile, hi + 1 - j0);
    __syncthreads();  // the previous tile is no longer read
    stage<D>(ks, k + head, vs, v + head, j0, bj);
    __syncthreads();
    if (!live) continue;
    float s[kTile];
    float mx = m;
#pragma unroll
    for (int c = 0; c < kTile; c++) {
      s[c] = c < bj && allows(mk, i, j0 + c) ? dot<D>(qi, ks[c]) * scale : -INFINITY;
      mx = fmaxf(mx, s[c]);
    }
    if (mx == -INFINITY) continue;     // no key of this tile, none before it
    const float alpha = expf(m - mx);  // 0 on the first live tile (m = −∞)
    float sum = 0.0f;
#pragma unroll
    for (int c = 0; c < kTile; c++) {
      s[c] = expf(s[c] - mx);
      sum += s[c];
    }
    l = l * alpha + sum;
    m = mx;
#pragma unroll
    for (int e = 0; e < D; e++) {
      float a = acc[e] * alpha;
#pragma unroll
      for (int c = 0; c < kTile; c++)  // s[c] = 0 past bj, but the tile's rows there are stale
        if (c < bj) a += s[c] * vs[c][e];
      acc[e] = a;
    }
  }
  if (!live) return;
  const float inv = 1.0f / l;  // l > 0: every query sees itself
#pragma unroll
  for (int e = 0; e < D; e++) out[head + i * D + e] = acc[e] * inv;
  lse[(size_t)blockIdx.y * T + i] = m + logf(l);
}

// grid (query blocks, B·H): dq of queries [blockIdx.x·kRows, +kRows) += Σ_j dS_ij k_j / √d.
template <int D>
__global__ void exact_bwd_dq(float *dq, const float *dout, const float *q, const float *k,
                             const float *v, const float *lse, const float *Drow, long T, Mask mk,
                             float scale) {
  __shared__ float ks[kTile][D], vs[kTile][D];
  const size_t head = (size_t)blockIdx.y * T * D;
  const long r0 = (long)blockIdx.x * kRows, i = r0 + threadIdx.x;
  const bool live = i < T;
  float qi[D], gi[D], acc[D] = {};
  load_row<D>(qi, q + head + i * D, live);
  load_row<D>(gi, dout + head + i * D, live);
  const float L = live ? lse[(size_t)blockIdx.y * T + i] : 0.0f;
  const float Di = live ? Drow[(size_t)blockIdx.y * T + i] : 0.0f;
  long lo, hi;
  key_span(mk, r0, min(r0 + kRows, T) - 1, T, &lo, &hi);
  for (long j0 = lo; j0 <= hi; j0 += kTile) {
    const int bj = (int)min((long)kTile, hi + 1 - j0);
    __syncthreads();
    stage<D>(ks, k + head, vs, v + head, j0, bj);
    __syncthreads();
    if (!live) continue;
    for (int c = 0; c < bj; c++) {
      if (!allows(mk, i, j0 + c)) continue;
      const float p = expf(dot<D>(qi, ks[c]) * scale - L);
      const float ds = p * (dot<D>(gi, vs[c]) - Di) * scale;
#pragma unroll
      for (int e = 0; e < D; e++) acc[e] += ds * ks[c][e];
    }
  }
  if (!live) return;
#pragma unroll
  for (int e = 0; e < D; e++) dq[head + i * D + e] += acc[e];
}

// grid (key blocks, B·H): dk, dv of keys [blockIdx.x·kRows, +kRows) += Σ_i over the queries that
// see them: dv_j += P_ij dout_i, dk_j += dS_ij q_i / √d.
template <int D>
__global__ void exact_bwd_dkv(float *dk, float *dv, const float *dout, const float *q,
                              const float *k, const float *v, const float *lse, const float *Drow,
                              long T, Mask mk, float scale) {
  __shared__ float qs[kTile][D], gs[kTile][D];
  __shared__ float Ls[kTile], Ds[kTile];
  const size_t head = (size_t)blockIdx.y * T * D;
  const long r0 = (long)blockIdx.x * kRows, j = r0 + threadIdx.x;
  const bool live = j < T;
  float kj[D], vj[D], dkj[D] = {}, dvj[D] = {};
  load_row<D>(kj, k + head + j * D, live);
  load_row<D>(vj, v + head + j * D, live);
  long lo, hi;
  query_span(mk, r0, min(r0 + kRows, T) - 1, T, &lo, &hi);
  for (long i0 = lo; i0 <= hi; i0 += kTile) {
    const int bi = (int)min((long)kTile, hi + 1 - i0);
    __syncthreads();
    stage<D>(qs, q + head, gs, dout + head, i0, bi);
    if (threadIdx.x < bi) {
      Ls[threadIdx.x] = lse[(size_t)blockIdx.y * T + i0 + threadIdx.x];
      Ds[threadIdx.x] = Drow[(size_t)blockIdx.y * T + i0 + threadIdx.x];
    }
    __syncthreads();
    if (!live) continue;
    for (int c = 0; c < bi; c++) {
      if (!allows(mk, i0 + c, j)) continue;
      const float p = expf(dot<D>(qs[c], kj) * scale - Ls[c]);
      const float ds = p * (dot<D>(gs[c], vj) - Ds[c]) * scale;
#pragma unroll
      for (int e = 0; e < D; e++) {
        dvj[e] += p * gs[c][e];
        dkj[e] += ds * qs[c][e];
      }
    }
  }
  if (!live) return;
#pragma unroll
  for (int e = 0; e < D; e++) {
    dk[head + j * D + e] += dkj[e];
    dv[head + j * D + e] += dvj[e];
  }
}

template <int D>
void forward_d(float *out, float *lse, const float *q, const float *k, const float *v, long BH,
               long T, Mask mk) {
  const dim3 grid(gpu_blocks((size_t)T, kRows), (unsigned)BH);
  exact_fwd<D><<<grid, kRows, 0, gpu_stream()>>>(out, lse, q, k, v, T, mk, 1.0f / sqrtf((float)D));
  LAUNCH_CHECK(exact_fwd<D>);
}

template <int D>
void backward_d(float *dq, float *dk, float *dv, const float *dout, const float *q, const float *k,
                const float *v, const float *lse, const float *Drow, long BH, long T, Mask mk) {
  const dim3 grid(gpu_blocks((size_t)T, kRows), (unsigned)BH);
  const float scale = 1.0f / sqrtf((float)D);
  exact_bwd_dq<D><<<grid, kRows, 0, gpu_stream()>>>(dq, dout, q, k, v, lse, Drow, T, mk, scale);
  LAUNCH_CHECK(exact_bwd_dq<D>);
  exact_bwd_dkv<D>
      <<<grid, kRows, 0, gpu_stream()>>>(dk, dv, dout, q, k, v, lse, Drow, T, mk, scale);
  LAUNCH_CHECK(exact_bwd_dkv<D>);
}

// Heads run along grid y, which holds at most 65,535 blocks.
void check_heads(long BH) {
  if (BH > 65535)
    error_at(__FILE__, __func__, __LINE__,
             "exact attention on the GPU: %ld heads × batch exceed the grid's 65,535", BH);
}

}  // namespace

extern "C" int gpu_exact_attention_supports(int d) {
  return d == 16 || d == 32 || d == 64 || d == 128;
}

extern "C" void gpu_exact_attention_forward(float *out, float *lse, const float *q, const float *k,
                                            const float *v, long BH, long T, int d, int causal,
                                            long band) {
  const Mask mk{causal != 0, band};
  check_heads(BH);
  if (BH * T == 0) return;
  switch (d) {
    case 16:
      forward_d<16>(out, lse, q, k, v, BH, T, mk);
      break;
    case 32:
      forward_d<32>(out, lse, q, k, v, BH, T, mk);
      break;
    case 64:
      forward_d<64>(out, lse, q, k, v, BH, T, mk);
      break;
    case 128:
      forward_d<128>(out, lse, q, k, v, BH, T, mk);
      break;
    default:
      error_at(__FILE__, __func__, __LINE__,
               "exact attention on the GPU: head size %d is not one of 16, 32, 64, 128", d);
  }
}

extern "C" void gpu_exact_attention_backward(float *dq, float *dk, float *dv, const float *dout,
                                             const float *q, const float *k, const float *v,
                                             const float *out, const float *lse, long BH, long T,
                                             int d, int causal, long band) {
  const Mask mk{causal != 0, band};
  check_heads(BH);
  const size_t rows = (size_t)BH * T;
  if (rows == 0) return;
  float *Drow = static_cast<float *>(gpu_alloc(MEM_WORKSPACE, sizeof(float) * rows));
  gpu_rows_dot(Drow, dout, out, (long)rows, d);
  switch (d) {
    case 16:
      backward_d<16>(dq, dk, dv, dout, q, k, v, lse, Drow, BH, T, mk);
      break;
    case 32:
      backward_d<32>(dq, dk, dv, dout, q, k, v, lse, Drow, BH, T, mk);
      break;
    case 64:
      backward_d<64>(dq, dk, dv, dout, q, k, v, lse, Drow, BH, T, mk);
      break;
    case 128:
      backward_d<128>(dq, dk, dv, dout, q, k, v, lse, Drow, BH, T, mk);
      break;
    default:
      error_at(__FILE__, __func__, __LINE__,
               "exact attention on the GPU: head size %d is not one of 16, 32, 64, 128", d);
  }
  gpu_free(Drow);  // back to the pool: work queued later on the stream runs after its readers
}
