// The per-token layers on the device, mirroring src/layers.c op for op: the same contracts, fp32
// data, backward accumulating. GEMMs through cuBLAS (fp32, no TF32); rows reduced by one warp
// each; parameter gradients summed over rows by one thread per column, rows in order.
#include <vector>

#include "check.h"
#include "gpu.h"

namespace {

constexpr float kLayernormEps = 1e-5f;         // LAYERNORM_EPS of layers.c
constexpr float kGeluK = 0.7978845608028654f;  // √(2/π)
constexpr float kGeluA = 0.044715f;
constexpr unsigned kThreads = 256;
constexpr unsigned kWarp = 32;

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

__global__ void add_bias(float *out, const float *bias, long N, int C) {
  const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < (size_t)N * C) out[i] += bias[i % C];
}

// acc[c] += Σ_rows a[i, c], rows in order
__global__ void column_sums(float *acc, const float *a, long N, int C) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  float s = 0.0f;
  for (long i = 0; i < N; i++) s += a[i * C + c];
  acc[c] += s;
}

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

__global__ void layernorm_bwd_params(float *dw, float *db, const float *dout, const float *inp,
                                     const float *mean, const float *rstd, long N, int C) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  float sw = 0.0f, sb = 0.0f;
  for (long i = 0; i < N; i++) {
    const float g = dout[i * C + c];
    sw += g * (inp[i * C + c] - mean[i]) * rstd[i];
    sb += g;
  }
  dw[c] += sw;
  db[c] += sb;
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
  dinp[i] += grad * dout[i];
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

// Token and position gradients: one thread per channel, rows in order — the CPU op's additions
// in the CPU op's order (several positions share a token row, so no thread per row).
__global__ void embedding_bwd(float *dtoken, float *dposition, const float *dout, const int *tokens,
                              long B, long T, int C, long t0) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  for (long bt = 0; bt < B * T; bt++) dtoken[(size_t)tokens[bt] * C + c] += dout[bt * C + c];
  if (!dposition) return;
  for (long t = 0; t < T; t++) {
    float *p = dposition + (size_t)(t0 + t) * C + c;
    for (long b = 0; b < B; b++) *p += dout[(b * T + t) * C + c];
  }
}

// One block per row: logits become (softmax − onehot)·scale; row_loss[row] = −log p(target).
__global__ void softmax_xent(float *logits, const int *targets, double *row_loss, int V,
                             float scale) {
  const long row = blockIdx.x;
  float *z = logits + row * V;
  const int tgt = targets[row];
  if (tgt < 0) {
    for (int j = threadIdx.x; j < V; j += blockDim.x) z[j] = 0.0f;
    if (threadIdx.x == 0) row_loss[row] = 0.0;
    return;
  }
  const float zt = z[tgt];  // read before any thread overwrites it
  float mx = -INFINITY;
  for (int j = threadIdx.x; j < V; j += blockDim.x) mx = fmaxf(mx, z[j]);
  mx = block_reduce<true>(mx);
  float s = 0.0f;
  for (int j = threadIdx.x; j < V; j += blockDim.x) s += expf(z[j] - mx);
  s = block_reduce<false>(s);
  const float inv = 1.0f / s;
  for (int j = threadIdx.x; j < V; j += blockDim.x)
    z[j] = expf(z[j] - mx) * inv * scale - (j == tgt ? scale : 0.0f);
  if (threadIdx.x == 0) row_loss[row] = log((double)s) - (double)(zt - mx);
}

}  // namespace

extern "C" void gpu_linear_forward(float *out, const float *inp, const float *weight,
                                   const float *bias, long N, int IC, int OC) {
  // row-major out (N, OC) = inp (N, IC)·weightᵀ is column-major outᵀ = weightᵀᵀ·inpᵀ
  const float one = 1.0f, zero = 0.0f;
  CUBLAS_CHECK(cublasSgemm(gpu_cublas(), CUBLAS_OP_T, CUBLAS_OP_N, OC, (int)N, IC, &one, weight, IC,
                           inp, IC, &zero, out, OC));
  if (bias)
    add_bias<<<gpu_blocks((size_t)N * OC, kThreads), kThreads, 0, gpu_stream()>>>(out, bias, N, OC);
  CUDA_CHECK(cudaGetLastError());
}

extern "C" void gpu_linear_backward(float *dinp, float *dweight, float *dbias, const float *dout,
                                    const float *inp, const float *weight, long N, int IC, int OC) {
  const float one = 1.0f;
  if (dinp)  // dinp (N, IC) += dout (N, OC)·weight (OC, IC)
    CUBLAS_CHECK(cublasSgemm(gpu_cublas(), CUBLAS_OP_N, CUBLAS_OP_N, IC, (int)N, OC, &one, weight,
                             IC, dout, OC, &one, dinp, IC));
  if (dweight)  // dweight (OC, IC) += doutᵀ·inp
    CUBLAS_CHECK(cublasSgemm(gpu_cublas(), CUBLAS_OP_N, CUBLAS_OP_T, IC, OC, (int)N, &one, inp, IC,
                             dout, OC, &one, dweight, IC));
  if (dbias)
    column_sums<<<gpu_blocks(OC, kThreads), kThreads, 0, gpu_stream()>>>(dbias, dout, N, OC);
  CUDA_CHECK(cudaGetLastError());
}

extern "C" void gpu_embedding_forward(float *out, const int *tokens, const float *token,
                                      const float *position, long B, long T, int C, long t0) {
  embedding_fwd<<<gpu_blocks((size_t)B * T * C, kThreads), kThreads, 0, gpu_stream()>>>(
      out, tokens, token, position, B * T, T, C, t0);
  CUDA_CHECK(cudaGetLastError());
}

extern "C" void gpu_embedding_backward(float *dtoken, float *dposition, const float *dout,
                                       const int *tokens, long B, long T, int C, long t0) {
  embedding_bwd<<<gpu_blocks(C, kThreads), kThreads, 0, gpu_stream()>>>(dtoken, dposition, dout,
                                                                        tokens, B, T, C, t0);
  CUDA_CHECK(cudaGetLastError());
}

extern "C" void gpu_layernorm_forward(float *out, float *mean, float *rstd, const float *inp,
                                      const float *weight, const float *bias, long N, int C) {
  const unsigned rows_per_block = kThreads / kWarp;
  layernorm_fwd<<<gpu_blocks(N, rows_per_block), kThreads, 0, gpu_stream()>>>(out, mean, rstd, inp,
                                                                              weight, bias, N, C);
  CUDA_CHECK(cudaGetLastError());
}

extern "C" void gpu_layernorm_backward(float *dinp, float *dweight, float *dbias, const float *dout,
                                       const float *inp, const float *weight, const float *mean,
                                       const float *rstd, long N, int C) {
  const unsigned rows_per_block = kThreads / kWarp;
  layernorm_bwd_inp<<<gpu_blocks(N, rows_per_block), kThreads, 0, gpu_stream()>>>(
      dinp, dout, inp, weight, mean, rstd, N, C);
  layernorm_bwd_params<<<gpu_blocks(C, kThreads), kThreads, 0, gpu_stream()>>>(
      dweight, dbias, dout, inp, mean, rstd, N, C);
  CUDA_CHECK(cudaGetLastError());
}

extern "C" void gpu_gelu_forward(float *out, const float *inp, size_t count) {
  gelu_fwd<<<gpu_blocks(count, kThreads), kThreads, 0, gpu_stream()>>>(out, inp, count);
  CUDA_CHECK(cudaGetLastError());
}

extern "C" void gpu_gelu_backward(float *dinp, const float *dout, const float *inp, size_t count) {
  gelu_bwd<<<gpu_blocks(count, kThreads), kThreads, 0, gpu_stream()>>>(dinp, dout, inp, count);
  CUDA_CHECK(cudaGetLastError());
}

extern "C" double gpu_softmax_xent_forward_backward(float *logits, const int *targets, long N,
                                                    int V, float grad_scale) {
  double *row_loss = static_cast<double *>(gpu_malloc(sizeof(double) * (size_t)N));
  softmax_xent<<<(unsigned)N, kThreads, 0, gpu_stream()>>>(logits, targets, row_loss, V,
                                                           grad_scale);
  CUDA_CHECK(cudaGetLastError());
  std::vector<double> host((size_t)N);
  gpu_download(host.data(), row_loss, sizeof(double) * (size_t)N);
  gpu_free(row_loss);
  double total = 0.0;  // rows in order, as the CPU op's sum over rows
  for (double l : host) total += l;
  return total;
}
