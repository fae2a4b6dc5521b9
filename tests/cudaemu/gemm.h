// One GEMM as cuBLAS and cuBLASLt describe it, executed on the CPU by OpenBLAS (gemm.cc):
// column-major matrices of fp32 or bf16 elements, fp32 accumulation, optional rounding of fp32
// inputs (TF32, bf16) and a bias epilogue. Internal to libcudaemu.a.
#ifndef CUDAEMU_GEMM_H
#define CUDAEMU_GEMM_H

namespace cudaemu {

enum class gemm_elem { f32, bf16 };
enum class gemm_round { none, tf32, bf16 };

struct gemm_matrix {
  const void *p = nullptr;
  gemm_elem type = gemm_elem::f32;
  int ld = 0;
  long long stride = 0;  // elements from one batch entry to the next
};

struct gemm_call {
  const char *fn = "gemm";
  bool trans_a = false, trans_b = false;
  int m = 0, n = 0, k = 0, batch = 1;
  gemm_matrix a, b, c;
  gemm_matrix d;  // the output; d.p null: C itself (cuBLAS)
  float alpha = 1, beta = 0;
  const float *alpha_dev = nullptr, *beta_dev = nullptr;  // CUBLAS_POINTER_MODE_DEVICE
  gemm_round round = gemm_round::none;
  const void *const *a_array = nullptr, *const *b_array = nullptr;  // cublasGemmBatchedEx
  void *const *c_array = nullptr;
  const void *bias = nullptr;  // cuBLASLt's bias epilogue: one value per row of D
  gemm_elem bias_type = gemm_elem::f32;
};

// Every matrix inside one live device allocation, else the run ends (a GPU kernel would fault).
void gemm_check_extents(const gemm_call &g);
// The product, as stream work (device memory open).
void gemm_run(const gemm_call &g);

}  // namespace cudaemu

#endif
