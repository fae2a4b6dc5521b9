// The CUDA back end's own counts (backend.h struct device_counts): every product, launch,
// conversion and allocation it asks of the device, counted where it asks (gpu_gemm, LAUNCH_CHECK,
// the pool). bench writes them per case (bench.h5 /gpu) and scripts/roofline.py turns them into a
// lower bound on the time. Host-side arithmetic only: nothing here touches the device but the one
// cudaMemGetInfo of gpu_counts_read.
#include "backend.h"
#include "check.h"
#include "gpu.h"

namespace {

device_counts counts;
size_t live_now = 0, cached_now = 0;

}  // namespace

extern "C" void gpu_counts_reset(void) {
  counts = device_counts{};
  counts.pool_live_peak_bytes = (double)live_now;
  counts.pool_reserved_peak_bytes = (double)(live_now + cached_now);
}

extern "C" void gpu_counts_read(struct device_counts *out) {
  *out = counts;
  size_t free_b = 0, total_b = 0;
  if (cudaMemGetInfo(&free_b, &total_b) == cudaSuccess && total_b >= free_b) {
    const double used = (double)(total_b - free_b), pool = (double)(live_now + cached_now);
    out->device_bytes_outside_pool = used > pool ? used - pool : 0.0;
  } else {
    (void)cudaGetLastError();
    out->device_bytes_outside_pool = -1.0;  // the driver did not say
  }
}

extern "C" void gpu_count_launch(void) { counts.kernel_launches += 1.0; }

extern "C" void gpu_count_gemm(long M, long N, long K, long batch, long nA, long nB, bool reads_c) {
  const double b = (double)batch;
  counts.gemm_calls += 1.0;
  counts.gemm_flops += 2.0 * (double)M * (double)N * (double)K * b;
  // distinct elements: an operand of stride 0 is one matrix, read by every product of the batch
  counts.gemm_operand_elements += (double)M * (double)K * (double)nA +
                                  (double)K * (double)N * (double)nB +
                                  (reads_c ? (double)M * (double)N * b : 0.0);
}

extern "C" void gpu_count_malloc(void) { counts.mallocs += 1.0; }

extern "C" void gpu_count_pool(size_t live_bytes, size_t cached_bytes) {
  live_now = live_bytes;
  cached_now = cached_bytes;
  if ((double)live_bytes > counts.pool_live_peak_bytes)
    counts.pool_live_peak_bytes = (double)live_bytes;
  if ((double)(live_bytes + cached_bytes) > counts.pool_reserved_peak_bytes)
    counts.pool_reserved_peak_bytes = (double)(live_bytes + cached_bytes);
}
