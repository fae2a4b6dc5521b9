// The per-token layers on the device, the twin of src/nn/layers.c op for op: the same contracts,
// fp32 data, backward accumulating. GEMMs through gpu_gemm (cuBLAS); rows reduced by one warp each;
// sums over many rows (bias, layer-norm and embedding gradients) in two stages — fixed chunks of
// rows in parallel, then the chunks in order — so they are deterministic and never one thread's
// walk over every row. Every launcher returns before an empty launch.
#include <climits>
#include <vector>

#include "core/rng.h"
#include "nn/layers.h"

#include "check.h"
#include "gpu.h"
#include "rng.cuh"

namespace {

constexpr float kLayernormEps = 1e-5f;         // LAYERNORM_EPS of layers.c
constexpr float kGeluK = 0.7978845608028654f;  // √(2/π)
constexpr float kGeluA = 0.044715f;
constexpr unsigned kThreads = 256;
constexpr unsigned kWarp = 32;
constexpr long kChunks = 64;  // row chunks of the two-stage sums (LAYERS_CHUNKS of layers.c)

__device__ float warp_sum(float v) {
  for (int o = kWarp / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ float warp_max(float v) {
  for (int o = kWarp / 2; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Block-wide reduction through shared memory (blockDim.x a multiple of 32, at most 1024).
template <bool kMax>
__device__ float block_reduce(float v) {
  __shared__ float part[32];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  v = kMax ? warp_max(v) : warp_sum(v);
  if (lane == 0) part[warp] = v;
  __syncthreads();
  const int nwarps = blockDim.x / kWarp;
  float r = threadIdx.x < nwarps ? part[threadIdx.x] : (kMax ? -INFINITY : 0.0f);
  if (warp == 0) r = kMax ? warp_max(r) : warp_sum(r);
  __shared__ float result;
  if (threadIdx.x == 0) result = r;
  __syncthreads();
  const float out = result;
  __syncthreads();  // part and result may be reused by the next call
  return out;
}

// grid (C / kThreads, kChunks): part[chunk, c] = Σ a[i, c] over the chunk's rows, in row order.
__global__ void chunk_sums(float *part, const float *a, long N, int C) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  const long r0 = N * blockIdx.y / kChunks, r1 = N * (blockIdx.y + 1) / kChunks;
  float s = 0.0f;
  for (long i = r0; i < r1; i++) s += a[i * C + c];
  part[(size_t)blockIdx.y * C + c] = s;
}

// acc[c] += Σ_chunk part[chunk, c], the chunks in order (the second stage of every row sum).
__global__ void chunks_add(float *acc, const float *part, long chunks, int C) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  float s = 0.0f;
  for (long k = 0; k < chunks; k++) s += part[(size_t)k * C + c];
  acc[c] += s;
}

// acc (C) += Σ_rows a (N, C): the two stages.
void column_sums(float *acc, const float *a, long N, int C) {
  float *part = static_cast<float *>(gpu_alloc(MEM_WORKSPACE, sizeof(float) * kChunks * C));
  chunk_sums<<<dim3(gpu_blocks(C, kThreads), kChunks), kThreads, 0, gpu_stream()>>>(part, a, N, C);
  LAUNCH_CHECK(chunk_sums);
  chunks_add<<<gpu_blocks(C, kThreads), kThreads, 0, gpu_stream()>>>(acc, part, kChunks, C);
  LAUNCH_CHECK(chunks_add);
  gpu_free(part);
}

__global__ void add_bias(float *out, const float *bias, long N, int C) {
  const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < (size_t)N * C) out[i] += bias[i % C];
}

// grid (N / rows per block): one warp per row.
__global__ void layernorm_fwd(float *out, float *mean, float *rstd, const float *inp,
                              const float *w, const float *b, long N, int C) {
  const long row = (long)blockIdx.x * (blockDim.x / kWarp) + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (row >= N) return;
  const float *x = inp + row * C;
  float s = 0.0f;
  for (int c = lane; c < C; c += kWarp) s += x[c];
  const float m = warp_sum(s) / (float)C;
  float v = 0.0f;
  for (int c = lane; c < C; c += kWarp) v += (x[c] - m) * (x[c] - m);
  const float r = rsqrtf(warp_sum(v) / (float)C + kLayernormEps);
  float *y = out + row * C;
  for (int c = lane; c < C; c += kWarp) y[c] = (x[c] - m) * r * w[c] + b[c];
  if (lane == 0) {
    mean[row] = m;
    rstd[row] = r;
  }
}

__global__ void layernorm_bwd_inp(float *dinp, const float *dout, const float *inp, const float *w,
                                  const float *mean, const float *rstd, long N, int C) {
  const long row = (long)blockIdx.x * (blockDim.x / kWarp) + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (row >= N) return;
  const float *x = inp + row * C, *g = dout + row * C;
  const float m = mean[row], r = rstd[row];
  float sdn = 0.0f, sdnx = 0.0f;
  for (int c = lane; c < C; c += kWarp) {
    const float dn = g[c] * w[c];
    sdn += dn;
    sdnx += dn * (x[c] - m) * r;
  }
  const float mdn = warp_sum(sdn) / (float)C, mdnx = warp_sum(sdnx) / (float)C;
  float *dx = dinp + row * C;
  for (int c = lane; c < C; c += kWarp) {
    const float xh = (x[c] - m) * r;
    dx[c] += (g[c] * w[c] - mdn - xh * mdnx) * r;
  }
}

// grid (C / kThreads, kChunks): the chunk's Σ dout·x̂ and Σ dout per channel (first stage).
__global__ void layernorm_bwd_params(float *pw, float *pb, const float *dout, const float *inp,
                                     const float *mean, const float *rstd, long N, int C) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  const long r0 = N * blockIdx.y / kChunks, r1 = N * (blockIdx.y + 1) / kChunks;
  float sw = 0.0f, sb = 0.0f;
  for (long i = r0; i < r1; i++) {
    const float g = dout[i * C + c];
    sw += g * (inp[i * C + c] - mean[i]) * rstd[i];
    sb += g;
  }
  pw[(size_t)blockIdx.y * C + c] = sw;
  pb[(size_t)blockIdx.y * C + c] = sb;
}

__global__ void gelu_fwd(float *out, const float *inp, size_t n) {
  const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float x = inp[i];
  out[i] = 0.5f * x * (1.0f + tanhf(kGeluK * (x + kGeluA * x * x * x)));
}

__global__ void gelu_bwd(float *dinp, const float *dout, const float *inp, size_t n) {
  const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float x = inp[i];
  const float t = tanhf(kGeluK * (x + kGeluA * x * x * x));
  const float grad =
      0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * kGeluK * (1.0f + 3.0f * kGeluA * x * x);
  dinp[i] = grad * dout[i];
}

// out (B·T, C) = token[tokens] + position[t0 + t]: one thread per element.
__global__ void embedding_fwd(float *out, const int *tokens, const float *token,
                              const float *position, long BT, long T, int C, long t0) {
  const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (size_t)BT * C) return;
  const long bt = (long)(i / C);
  const int c = (int)(i % C);
  const float e = token[(size_t)tokens[bt] * C + c];
  out[i] = position ? e + position[(size_t)(t0 + bt % T) * C + c] : e;
}

// grid (C / kThreads, kChunks): part[chunk, v, c] = Σ dout[bt, c] over the chunk's rows whose
// token is v, rows in order (several rows share a token row: each thread owns one channel).
__global__ void embedding_bwd_token(float *part, const float *dout, const int *tokens, long BT,
                                    int C, int V) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  const long r0 = BT * blockIdx.y / kChunks, r1 = BT * (blockIdx.y + 1) / kChunks;
  float *p = part + (size_t)blockIdx.y * V * C;
  for (long bt = r0; bt < r1; bt++) p[(size_t)tokens[bt] * C + c] += dout[bt * C + c];
}

// dposition[t0 + t, c] += Σ_b dout[b, t, c], the batch in order: one thread per (t, c).
__global__ void embedding_bwd_position(float *dposition, const float *dout, long B, long T, int C,
                                       long t0) {
  const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (size_t)T * C) return;
  const long t = (long)(i / C);
  const int c = (int)(i % C);
  float s = 0.0f;
  for (long b = 0; b < B; b++) s += dout[(b * T + t) * C + c];
  dposition[(size_t)(t0 + t) * C + c] += s;
}

// x (B, T, C) += scale · PE(t0 + t): sin at even, cos at odd channels, in double as the CPU op.
__global__ void sinusoidal(float *x, long B, long T, int C, long t0, float scale) {
  const size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  const int half = C / 2;
  if (e >= (size_t)T * half) return;
  const long t = (long)(e / half);
  const int i = (int)(e % half);
  const double ang = (double)(t0 + t) * pow(10000.0, -2.0 * i / (double)C);
  const float s = scale * (float)sin(ang), co = scale * (float)cos(ang);
  for (long b = 0; b < B; b++) {
    float *row = x + (b * T + t) * C;
    row[2 * i] += s;
    row[2 * i + 1] += co;
  }
}

// Rotate pairs (2i, 2i+1) of x (BH, T, d) by (t0 + t)·10000^(−2i/d), sign −1 for the transpose.
__global__ void rope(float *x, long BH, long T, int d, long t0, float sign) {
  const int half = d / 2;
  const size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= (size_t)BH * T * half) return;
  const int i = (int)(e % half);
  const long t = (long)(e / half % T);
  const double ang = (double)(t0 + t) * pow(10000.0, -2.0 * i / (double)d);
  const float c = (float)cos(ang), s = sign * (float)sin(ang);
  float *row = x + (e / half) * d;
  const float a = row[2 * i], b = row[2 * i + 1];
  row[2 * i] = a * c - b * s;
  row[2 * i + 1] = a * s + b * c;
}

// The dropout mask of element (b, t, c): layers.c's dropout_row, element by element.
__device__ float dropout_mask(const struct dropout_key &key, long b, long t, int c, int C) {
  const int C4 = (C + 3) / 4, c4 = c / 4, j = c % 4;
  const uint64_t r = gpu_rng_bits(key.seed, RNG_DROPOUT, (uint64_t)key.step,
                                  ((uint64_t)key.site << 40) ^ (uint64_t)(key.sample0 + b),
                                  (uint64_t)(key.t0 + t) * (uint64_t)C4 + (uint64_t)c4);
  const uint32_t u = (uint32_t)(r >> (16 * j)) & 0xFFFFu;
  return u >= (uint32_t)(key.p * 65536.0f) ? 1.0f / (1.0f - key.p) : 0.0f;
}

// mode 0: x *= mask (dropout and its backward); 1: out = res + y·mask; 2: dres = g, dy = g·mask.
// The product and the sum are rounded apart (__fmul_rn, __fadd_rn), as the CPU rounds them: nvcc
// would contract them into one fused multiply-add, whose single rounding differs in the last bit
// (seen on an H200; the emulation, compiled by gcc without FMA, cannot see it).
__global__ void dropout_apply(int mode, float *a, float *b, const float *c, const float *g,
                              struct dropout_key key, long B, long T, int C) {
  const size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= (size_t)B * T * C) return;
  const long bt = (long)(e / C);
  const int ch = (int)(e % C);
  const float mask = key.p > 0.0f ? dropout_mask(key, bt / T, bt % T, ch, C) : 1.0f;
  if (mode == 0) {
    a[e] *= mask;
  } else if (mode == 1) {
    a[e] = __fadd_rn(c[e], __fmul_rn(g[e], mask));
  } else {
    if (a != g) a[e] = g[e];  // a may be g: the residual gradient added into in place
    b[e] = __fmul_rn(g[e], mask);
  }
}

// qkv rows (B, T, W) ↔ q, k (B, Hqk, T, d) and v (B, H, T, d): one thread per element of a row.
__global__ void heads_split(float *q, float *k, float *v, float *qkv, long B, long T, int Hqk,
                            int H, int d, bool backward) {
  const int W = (2 * Hqk + H) * d, Cqk = Hqk * d;
  const size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= (size_t)B * T * W) return;
  const long bt = (long)(e / W), b = bt / T, t = bt % T;
  const int w = (int)(e % W);
  float *x;
  if (w < Cqk)
    x = q + (((size_t)b * Hqk + w / d) * T + t) * d + w % d;
  else if (w < 2 * Cqk)
    x = k + (((size_t)b * Hqk + (w - Cqk) / d) * T + t) * d + (w - Cqk) % d;
  else
    x = v + (((size_t)b * H + (w - 2 * Cqk) / d) * T + t) * d + (w - 2 * Cqk) % d;
  if (backward)
    qkv[e] = *x;
  else
    *x = qkv[e];
}

// y (B, T, C) ↔ att (B, H, T, d).
__global__ void heads_merge(float *y, float *att, long B, long T, int H, int d, bool backward) {
  const int C = H * d;
  const size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= (size_t)B * T * C) return;
  const long bt = (long)(e / C), b = bt / T, t = bt % T;
  const int c = (int)(e % C);
  float *a = att + (((size_t)b * H + c / d) * T + t) * d + c % d;
  if (backward)
    *a = y[e];
  else
    y[e] = *a;
}

// One block per row: logits become (softmax − onehot)·scale; row_loss[row] = −log p(target).
// The lowest value over the block (blockDim.x a multiple of 32, at most 1024).
__device__ int block_min(int v) {
  __shared__ int part[32];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  for (int o = kWarp / 2; o > 0; o /= 2) v = min(v, __shfl_xor_sync(0xffffffffu, v, o));
  if (lane == 0) part[warp] = v;
  __syncthreads();
  const int nwarps = blockDim.x / kWarp;
  int r = threadIdx.x < nwarps ? part[threadIdx.x] : INT_MAX;
  if (warp == 0)
    for (int o = kWarp / 2; o > 0; o /= 2) r = min(r, __shfl_xor_sync(0xffffffffu, r, o));
  __shared__ int result;
  if (threadIdx.x == 0) result = r;
  __syncthreads();
  const int out = result;
  __syncthreads();  // part and result may be reused by the next call
  return out;
}

// grid N rows, block kThreads: one row's softmax cross-entropy (layers.c's
// softmax_xent_rows_forward_backward); row_pred (when given) the lowest index of the row's maximum,
// read before the logits are overwritten, −1 for ignored rows.
__global__ void softmax_xent(float *logits, const int *targets, double *row_loss, int *row_pred,
                             int V, float scale) {
  const long row = blockIdx.x;
  float *z = logits + row * V;
  const int tgt = targets[row];
  if (tgt < 0) {
    for (int j = threadIdx.x; j < V; j += blockDim.x) z[j] = 0.0f;
    if (threadIdx.x == 0) {
      row_loss[row] = 0.0;
      if (row_pred) row_pred[row] = -1;
    }
    return;
  }
  const float zt = z[tgt];  // read before any thread overwrites it
  float mx = -INFINITY;
  for (int j = threadIdx.x; j < V; j += blockDim.x) mx = fmaxf(mx, z[j]);
  mx = block_reduce<true>(mx);
  if (row_pred) {  // every thread reads only the entries it will overwrite itself
    int arg = INT_MAX;
    for (int j = threadIdx.x; j < V && arg == INT_MAX; j += blockDim.x)
      if (z[j] == mx) arg = j;
    arg = block_min(arg);
    if (threadIdx.x == 0) row_pred[row] = arg;
  }
  float s = 0.0f;
  for (int j = threadIdx.x; j < V; j += blockDim.x) s += expf(z[j] - mx);
  s = block_reduce<false>(s);
  const float inv = 1.0f / s;
  for (int j = threadIdx.x; j < V; j += blockDim.x)
    z[j] = expf(z[j] - mx) * inv * scale - (j == tgt ? scale : 0.0f);
  if (threadIdx.x == 0) row_loss[row] = log((double)s) - (double)(zt - mx);
}

unsigned elementwise_blocks(size_t n) { return gpu_blocks(n, kThreads); }

}  // namespace

extern "C" void gpu_linear_forward(float *out, const float *inp, const float *weight,
                                   const float *bias, long N, int IC, int OC) {
  if (N == 0) return;
  gpu_gemm(false, true, N, OC, IC, 1.0f, inp, IC, 0, weight, IC, 0, 0.0f, out, OC, 0, 1);
  if (bias) {
    add_bias<<<elementwise_blocks((size_t)N * OC), kThreads, 0, gpu_stream()>>>(out, bias, N, OC);
    LAUNCH_CHECK(add_bias);
  }
}

extern "C" void gpu_linear_backward(float *dinp, float *dweight, float *dbias, const float *dout,
                                    const float *inp, const float *weight, long N, int IC, int OC) {
  if (N == 0) return;
  if (dinp)  // dinp (N, IC) = dout (N, OC) · weight (OC, IC)
    gpu_gemm(false, false, N, IC, OC, 1.0f, dout, OC, 0, weight, IC, 0, 0.0f, dinp, IC, 0, 1);
  if (dweight)  // dweight (OC, IC) += doutᵀ · inp
    gpu_gemm(true, false, OC, IC, N, 1.0f, dout, OC, 0, inp, IC, 0, 1.0f, dweight, IC, 0, 1);
  if (dbias) column_sums(dbias, dout, N, OC);
}

extern "C" void gpu_layernorm_forward(float *out, float *mean, float *rstd, const float *inp,
                                      const float *weight, const float *bias, long N, int C) {
  if (N == 0) return;
  const unsigned rows_per_block = kThreads / kWarp;
  layernorm_fwd<<<gpu_blocks(N, rows_per_block), kThreads, 0, gpu_stream()>>>(out, mean, rstd, inp,
                                                                              weight, bias, N, C);
  LAUNCH_CHECK(layernorm_fwd);
}

extern "C" void gpu_layernorm_backward(float *dinp, float *dweight, float *dbias, const float *dout,
                                       const float *inp, const float *weight, const float *mean,
                                       const float *rstd, long N, int C) {
  if (N == 0) return;
  const unsigned rows_per_block = kThreads / kWarp;
  layernorm_bwd_inp<<<gpu_blocks(N, rows_per_block), kThreads, 0, gpu_stream()>>>(
      dinp, dout, inp, weight, mean, rstd, N, C);
  LAUNCH_CHECK(layernorm_bwd_inp);
  float *part = static_cast<float *>(gpu_alloc(MEM_WORKSPACE, sizeof(float) * 2 * kChunks * C));
  layernorm_bwd_params<<<dim3(gpu_blocks(C, kThreads), kChunks), kThreads, 0, gpu_stream()>>>(
      part, part + kChunks * C, dout, inp, mean, rstd, N, C);
  LAUNCH_CHECK(layernorm_bwd_params);
  chunks_add<<<gpu_blocks(C, kThreads), kThreads, 0, gpu_stream()>>>(dweight, part, kChunks, C);
  LAUNCH_CHECK(chunks_add);
  chunks_add<<<gpu_blocks(C, kThreads), kThreads, 0, gpu_stream()>>>(dbias, part + kChunks * C,
                                                                     kChunks, C);
  LAUNCH_CHECK(chunks_add);
  gpu_free(part);
}

extern "C" void gpu_embedding_forward(float *out, const int *tokens, const float *token,
                                      const float *position, long B, long T, int C, long t0) {
  if (B * T == 0) return;
  embedding_fwd<<<elementwise_blocks((size_t)B * T * C), kThreads, 0, gpu_stream()>>>(
      out, tokens, token, position, B * T, T, C, t0);
  LAUNCH_CHECK(embedding_fwd);
}

extern "C" void gpu_embedding_backward(float *dtoken, float *dposition, const float *dout,
                                       const int *tokens, long B, long T, int C, int V, long t0) {
  if (B * T == 0) return;
  const size_t pn = (size_t)kChunks * V * C;
  float *part = static_cast<float *>(gpu_alloc_zero(MEM_WORKSPACE, sizeof(float) * pn));
  embedding_bwd_token<<<dim3(gpu_blocks(C, kThreads), kChunks), kThreads, 0, gpu_stream()>>>(
      part, dout, tokens, B * T, C, V);
  LAUNCH_CHECK(embedding_bwd_token);
  // the second stage: token rows (V·C values) summed over the chunks in order
  chunks_add<<<elementwise_blocks((size_t)V * C), kThreads, 0, gpu_stream()>>>(dtoken, part,
                                                                               kChunks, V * C);
  LAUNCH_CHECK(chunks_add);
  gpu_free(part);
  if (!dposition) return;
  embedding_bwd_position<<<elementwise_blocks((size_t)T * C), kThreads, 0, gpu_stream()>>>(
      dposition, dout, B, T, C, t0);
  LAUNCH_CHECK(embedding_bwd_position);
}

extern "C" void gpu_gelu_forward(float *out, const float *inp, size_t count) {
  if (count == 0) return;
  gelu_fwd<<<elementwise_blocks(count), kThreads, 0, gpu_stream()>>>(out, inp, count);
  LAUNCH_CHECK(gelu_fwd);
}

extern "C" void gpu_gelu_backward(float *dinp, const float *dout, const float *inp, size_t count) {
  if (count == 0) return;
  gelu_bwd<<<elementwise_blocks(count), kThreads, 0, gpu_stream()>>>(dinp, dout, inp, count);
  LAUNCH_CHECK(gelu_bwd);
}

extern "C" void gpu_sinusoidal_forward(float *x, long B, long T, int C, long t0, float scale) {
  if (T * (C / 2) == 0 || B == 0) return;
  sinusoidal<<<elementwise_blocks((size_t)T * (C / 2)), kThreads, 0, gpu_stream()>>>(x, B, T, C, t0,
                                                                                     scale);
  LAUNCH_CHECK(sinusoidal);
}

extern "C" void gpu_rope_forward(float *x, long BH, long T, int d, long t0) {
  if (BH * T * (d / 2) == 0) return;
  rope<<<elementwise_blocks((size_t)BH * T * (d / 2)), kThreads, 0, gpu_stream()>>>(x, BH, T, d, t0,
                                                                                    1.0f);
  LAUNCH_CHECK(rope);
}

extern "C" void gpu_rope_backward(float *dx, long BH, long T, int d, long t0) {
  if (BH * T * (d / 2) == 0) return;
  rope<<<elementwise_blocks((size_t)BH * T * (d / 2)), kThreads, 0, gpu_stream()>>>(dx, BH, T, d,
                                                                                    t0, -1.0f);
  LAUNCH_CHECK(rope);
}

static void dropout_launch(int mode, float *a, float *b, const float *c, const float *g,
                           const struct dropout_key *key, long B, long T, int C) {
  if (B * T * C == 0) return;
  dropout_apply<<<elementwise_blocks((size_t)B * T * C), kThreads, 0, gpu_stream()>>>(
      mode, a, b, c, g, *key, B, T, C);
  LAUNCH_CHECK(dropout_apply);
}

extern "C" void gpu_dropout_forward(float *x, const struct dropout_key *key, long B, long T,
                                    int C) {
  if (key->p > 0.0f) dropout_launch(0, x, nullptr, nullptr, nullptr, key, B, T, C);
}

extern "C" void gpu_dropout_backward(float *dx, const struct dropout_key *key, long B, long T,
                                     int C) {
  gpu_dropout_forward(dx, key, B, T, C);  // the same mask scales the gradient
}

extern "C" void gpu_residual_dropout_forward(float *out, const float *res, const float *y,
                                             const struct dropout_key *key, long B, long T, int C) {
  dropout_launch(1, out, nullptr, res, y, key, B, T, C);
}

extern "C" void gpu_residual_dropout_backward(float *dres, float *dy, const float *dout,
                                              const struct dropout_key *key, long B, long T,
                                              int C) {
  dropout_launch(2, dres, dy, nullptr, dout, key, B, T, C);
}

extern "C" void gpu_heads_split_forward(float *q, float *k, float *v, const float *qkv, long B,
                                        long T, int Hqk, int H, int d) {
  const size_t n = (size_t)B * T * (2 * Hqk + H) * d;
  if (n == 0) return;
  heads_split<<<elementwise_blocks(n), kThreads, 0, gpu_stream()>>>(
      q, k, v, const_cast<float *>(qkv), B, T, Hqk, H, d, false);
  LAUNCH_CHECK(heads_split);
}

extern "C" void gpu_heads_split_backward(float *dqkv, const float *dq, const float *dk,
                                         const float *dv, long B, long T, int Hqk, int H, int d) {
  const size_t n = (size_t)B * T * (2 * Hqk + H) * d;
  if (n == 0) return;
  heads_split<<<elementwise_blocks(n), kThreads, 0, gpu_stream()>>>(
      const_cast<float *>(dq), const_cast<float *>(dk), const_cast<float *>(dv), dqkv, B, T, Hqk, H,
      d, true);
  LAUNCH_CHECK(heads_split);
}

extern "C" void gpu_heads_merge_forward(float *y, const float *att, long B, long T, int H, int d) {
  const size_t n = (size_t)B * T * H * d;
  if (n == 0) return;
  heads_merge<<<elementwise_blocks(n), kThreads, 0, gpu_stream()>>>(y, const_cast<float *>(att), B,
                                                                    T, H, d, false);
  LAUNCH_CHECK(heads_merge);
}

extern "C" void gpu_heads_merge_backward(float *datt, const float *dy, long B, long T, int H,
                                         int d) {
  const size_t n = (size_t)B * T * H * d;
  if (n == 0) return;
  heads_merge<<<elementwise_blocks(n), kThreads, 0, gpu_stream()>>>(const_cast<float *>(dy), datt,
                                                                    B, T, H, d, true);
  LAUNCH_CHECK(heads_merge);
}

extern "C" double gpu_softmax_xent_forward_backward(float *logits, const int *targets, long N,
                                                    int V, float grad_scale, float *row_loss,
                                                    int *row_pred) {
  if (N == 0) return 0.0;
  double *dloss = static_cast<double *>(gpu_alloc(MEM_WORKSPACE, sizeof(double) * (size_t)N));
  int *dpred =
      row_pred ? static_cast<int *>(gpu_alloc(MEM_WORKSPACE, sizeof(int) * (size_t)N)) : nullptr;
  softmax_xent<<<gpu_int(N, "softmax rows"), kThreads, 0, gpu_stream()>>>(logits, targets, dloss,
                                                                          dpred, V, grad_scale);
  LAUNCH_CHECK(softmax_xent);
  std::vector<double> host((size_t)N);
  gpu_download(host.data(), dloss, sizeof(double) * (size_t)N);
  gpu_free(dloss);
  if (dpred) {
    gpu_download(row_pred, dpred, sizeof(int) * (size_t)N);
    gpu_free(dpred);
  }
  double total = 0.0;  // rows in order, as the CPU op's sum over rows
  for (long i = 0; i < N; i++) {
    total += host[(size_t)i];
    if (row_loss) row_loss[i] = (float)host[(size_t)i];
  }
  return total;
}
