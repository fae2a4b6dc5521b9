// AdamW and the gradient norm on the device, the twin of src/model/optimizer.c's element work: the
// same update element for element (fp32), and the sum of squares in double in a fixed order
// (partial sums of fixed slices, added on the host in order), so the norm does not depend on the
// launch.
#include <vector>

#include "check.h"
#include "gpu.h"
#include "model/backend.h"

namespace {

constexpr unsigned kThreads = 256;
constexpr unsigned kBlocks = 1024;  // partial sums of gpu_sum_squares

__global__ void adamw(float *w, const float *g, float *m, float *v, size_t n, adamw_step s) {
  const size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= n) return;
  const float grad = g[e] * s.grad_scale;
  const float me = s.beta1 * m[e] + (1.0f - s.beta1) * grad;
  const float ve = s.beta2 * v[e] + (1.0f - s.beta2) * grad * grad;
  m[e] = me;
  v[e] = ve;
  const float mhat = me / s.bc1, vhat = ve / s.bc2;
  w[e] -= s.lr * (mhat / (sqrtf(vhat) + s.eps) + s.wd * w[e]);
}

// grid kBlocks, block kThreads: part[block] = Σ x² over the block's contiguous slice, in double.
__global__ void sum_squares(double *part, const float *x, size_t n) {
  __shared__ double s[kThreads];
  const size_t lo = n * blockIdx.x / gridDim.x, hi = n * (blockIdx.x + 1) / gridDim.x;
  double acc = 0.0;
  for (size_t i = lo + threadIdx.x; i < hi; i += blockDim.x) acc += (double)x[i] * x[i];
  s[threadIdx.x] = acc;
  __syncthreads();
  for (unsigned o = blockDim.x / 2; o > 0; o /= 2) {
    if (threadIdx.x < o) s[threadIdx.x] += s[threadIdx.x + o];
    __syncthreads();
  }
  if (threadIdx.x == 0) part[blockIdx.x] = s[0];
}

}  // namespace

extern "C" void gpu_adamw(float *w, const float *g, float *m, float *v, size_t n,
                          const struct adamw_step *s) {
  if (n == 0) return;
  adamw<<<gpu_blocks(n, kThreads), kThreads, 0, gpu_stream()>>>(w, g, m, v, n, *s);
  LAUNCH_CHECK(adamw);
}

extern "C" double gpu_sum_squares(const float *x, size_t n) {
  if (n == 0) return 0.0;
  double *part = static_cast<double *>(gpu_alloc(MEM_WORKSPACE, sizeof(double) * kBlocks));
  sum_squares<<<kBlocks, kThreads, 0, gpu_stream()>>>(part, x, n);
  LAUNCH_CHECK(sum_squares);
  std::vector<double> host(kBlocks);
  gpu_download(host.data(), part, sizeof(double) * kBlocks);
  gpu_free(part);
  double total = 0.0;
  for (double p : host) total += p;
  return total;
}
