// A probe for docs/gpu.md (2026-11-28), not built with fmattn: does compute-sanitizer's
// initcheck see every element that cuBLAS's products write? mode "poison": C filled with NaN
// bytes first, then the product, then the elements still NaN are counted (0: the product wrote
// all of C). mode "plain": C fresh from cudaMalloc, the product, then a kernel reads every
// element (initcheck reports a read of an element it thinks unwritten). The products
// fmattn's gpu/blas.cu calls, at fma's score shapes.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cstdio>
#include <cstring>
#include <vector>
#define CK(x) do { auto e_ = (x); if ((int)e_ != 0) { printf("fail %s: %d\n", #x, (int)e_); return 1; } } while (0)
__global__ void reader(const float *c, float *o, size_t n) {
  size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
  if (i < n) o[i] = 2.0f * c[i];
}
__global__ void nans(const float *c, size_t n, unsigned long long *cnt) {
  size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
  if (i < n && c[i] != c[i]) atomicAdd(cnt, 1ull);
}
__global__ void fill(float *a, size_t n, float s) {
  size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
  if (i < n) a[i] = s * (float)((i * 2654435761u) % 1000) / 1000.0f - 0.5f * s;
}
__global__ void tobf(const float *a, __nv_bfloat16 *b, size_t n) {
  size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
  if (i < n) b[i] = __float2bfloat16(a[i]);
}
int main(int argc, char **argv) {
  const bool poison = argc > 1 && !strcmp(argv[1], "poison");
  cublasHandle_t h;
  CK(cublasCreate(&h));
  struct shape { int M, N, K, batch; } shapes[] = {
      {256, 128, 8, 16}, {40, 128, 8, 16}, {256, 128, 64, 96}, {512, 128, 64, 64}, {2048, 2048, 64, 1}};
  const char *kinds[] = {"SgemmStridedBatched", "StridedEx bf16 in", "StridedEx fp32 FAST_16BF",
                         "BatchedEx bf16 in", "BatchedEx fp32 FAST_16BF", "BatchedEx fp32 32F"};
  for (auto s : shapes)
    for (int kind = 0; kind < 6; kind++) {
      const size_t na = (size_t)s.K * s.M * s.batch, nb = (size_t)s.K * s.N * s.batch,
                   nc = (size_t)s.M * s.N * s.batch;
      float *A, *B, *C, *O;
      __nv_bfloat16 *Ab, *Bb;
      unsigned long long *cnt;
      CK(cudaMalloc(&A, na * 4)); CK(cudaMalloc(&B, nb * 4)); CK(cudaMalloc(&C, nc * 4));
      CK(cudaMalloc(&O, nc * 4)); CK(cudaMalloc(&Ab, na * 2)); CK(cudaMalloc(&Bb, nb * 2));
      CK(cudaMalloc(&cnt, 8)); CK(cudaMemset(cnt, 0, 8));
      fill<<<(na + 255) / 256, 256>>>(A, na, 1.0f);
      fill<<<(nb + 255) / 256, 256>>>(B, nb, 2.0f);
      tobf<<<(na + 255) / 256, 256>>>(A, Ab, na);
      tobf<<<(nb + 255) / 256, 256>>>(B, Bb, nb);
      if (poison) CK(cudaMemset(C, 0xff, nc * 4));
      CK(cudaDeviceSynchronize());
      printf("BEGIN %s M=%d N=%d K=%d batch=%d\n", kinds[kind], s.M, s.N, s.K, s.batch);
      fflush(stdout);
      const float one = 1.0f, zero = 0.0f;
      const long long sa = (long long)s.K * s.M, sb = (long long)s.K * s.N, sc = (long long)s.M * s.N;
      const bool bf = kind == 1 || kind == 3;
      const void *a = bf ? (const void *)Ab : (const void *)A, *b = bf ? (const void *)Bb : (const void *)B;
      const cudaDataType_t in = bf ? CUDA_R_16BF : CUDA_R_32F;
      const cublasComputeType_t ct = (kind == 2 || kind == 4) ? CUBLAS_COMPUTE_32F_FAST_16BF : CUBLAS_COMPUTE_32F;
      const size_t es = bf ? 2 : 4;
      if (kind == 0)
        CK(cublasSgemmStridedBatched(h, CUBLAS_OP_T, CUBLAS_OP_N, s.M, s.N, s.K, &one, A, s.K, sa, B,
                                     s.K, sb, &zero, C, s.M, sc, s.batch));
      else if (kind <= 2)
        CK(cublasGemmStridedBatchedEx(h, CUBLAS_OP_T, CUBLAS_OP_N, s.M, s.N, s.K, &one, a, in, s.K, sa, b,
                                      in, s.K, sb, &zero, C, CUDA_R_32F, s.M, sc, s.batch, ct,
                                      CUBLAS_GEMM_DEFAULT));
      else {
        std::vector<const void *> pa(s.batch), pb(s.batch);
        std::vector<void *> pc(s.batch);
        for (int i = 0; i < s.batch; i++) {
          pa[i] = (const char *)a + i * sa * es;
          pb[i] = (const char *)b + i * sb * es;
          pc[i] = C + i * sc;
        }
        void **d;
        CK(cudaMalloc(&d, 3 * s.batch * sizeof(void *)));
        CK(cudaMemcpy(d, pa.data(), s.batch * 8, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(d + s.batch, pb.data(), s.batch * 8, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(d + 2 * s.batch, pc.data(), s.batch * 8, cudaMemcpyHostToDevice));
        CK(cublasGemmBatchedEx(h, CUBLAS_OP_T, CUBLAS_OP_N, s.M, s.N, s.K, &one, (const void **)d, in,
                               s.K, (const void **)(d + s.batch), in, s.K, &zero, d + 2 * s.batch,
                               CUDA_R_32F, s.M, s.batch, ct, CUBLAS_GEMM_DEFAULT));
        CK(cudaDeviceSynchronize());
        CK(cudaFree(d));
      }
      if (poison) {
        nans<<<(nc + 255) / 256, 256>>>(C, nc, cnt);
        unsigned long long u = 0;
        CK(cudaMemcpy(&u, cnt, 8, cudaMemcpyDeviceToHost));
        printf("  unwritten (still NaN): %llu of %zu\n", u, nc);
      } else {
        reader<<<(nc + 255) / 256, 256>>>(C, O, nc);
      }
      CK(cudaDeviceSynchronize());
      printf("END\n");
      fflush(stdout);
      for (void *p : {(void *)A, (void *)B, (void *)C, (void *)O, (void *)Ab, (void *)Bb, (void *)cnt}) cudaFree(p);
    }
  cublasDestroy(h);
  return 0;
}
