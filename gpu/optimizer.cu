// AdamW and the gradient norm on the device, mirroring src/optimizer.c: the same update element
// for element (fp32), and the sum of squares in double. The caller walks the parameter tensors
// (each with its own weight decay and learning-rate scale) as optimizer_step does.
#include "check.h"
#include "gpu.h"

namespace {

constexpr unsigned kThreads = 256;
constexpr unsigned kBlocks = 1024;  // partial sums of gpu_sum_squares, added on the host in order

__global__ void adamw(float *w, const float *g, float *m, float *v, size_t n, float lr, float wd,
                      float b1, float b2, float eps, float bc1, float bc2, float grad_scale) {
  const size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= n) return;
  const float grad = g[e] * grad_scale;
  const float me = b1 * m[e] + (1.0f - b1) * grad;
  const float ve = b2 * v[e] + (1.0f - b2) * grad * grad;
  m[e] = me;
  v[e] = ve;
  const float mhat = me / bc1, vhat = ve / bc2;
  w[e] -= lr * (mhat / (sqrtf(vhat) + eps) + wd * w[e]);
}

// part[block] = Σ x² over a grid-stride slice, in double.
__global__ void sum_squares(double *part, const float *x, size_t n) {
  __shared__ double s[kThreads];
  double acc = 0.0;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    acc += (double)x[i] * x[i];
  s[threadIdx.x] = acc;
  __syncthreads();
  for (unsigned o = blockDim.x / 2; o > 0; o /= 2) {
    if (threadIdx.x < o) s[threadIdx.x] += s[threadIdx.x + o];
    __syncthreads();
  }
  if (threadIdx.x == 0) part[blockIdx.x] = s[0];
}

}  // namespace

extern "C" void gpu_adamw_update(float *w, const float *g, float *m, float *v, size_t n, float lr,
                                 float wd, float beta1, float beta2, float eps, float bc1,
                                 float bc2, float grad_scale) {
  if (n == 0) return;
  adamw<<<gpu_blocks(n, kThreads), kThreads, 0, gpu_stream()>>>(w, g, m, v, n, lr, wd, beta1, beta2,
                                                                eps, bc1, bc2, grad_scale);
  CUDA_CHECK(cudaGetLastError());
}

extern "C" double gpu_sum_squares(const float *x, size_t n) {
  double *part = static_cast<double *>(gpu_malloc(sizeof(double) * kBlocks));
  sum_squares<<<kBlocks, kThreads, 0, gpu_stream()>>>(part, x, n);
  CUDA_CHECK(cudaGetLastError());
  double host[kBlocks];
  gpu_download(host, part, sizeof host);
  gpu_free(part);
  double total = 0.0;
  for (double p : host) total += p;
  return total;
}
