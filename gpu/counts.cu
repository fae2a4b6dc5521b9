// The CUDA back end's own counts (backend.h struct device_counts): every product, launch,
// conversion and allocation it asks of the device, counted where it asks (gpu_gemm, LAUNCH_CHECK,
// the pool). bench writes them per case (bench.h5 /gpu) and scripts/roofline.py turns them into a
// lower bound on the time. Host-side arithmetic only: nothing here touches the device but the one
// cudaMemGetInfo of gpu_counts_read.
#include <map>
#include <vector>

#include <nvtx3/nvToolsExt.h>

#include "check.h"
#include "core/timer.h"
#include "gpu.h"
#include "model/backend.h"

namespace {

device_counts counts;
size_t live_now = 0, cached_now = 0;

// The operators' event pairs not yet added to their timers, and events to reuse.
struct span_rec {
  int timer;
  cudaEvent_t begin, end;
};
std::map<int, span_rec> spans;  // by number, in order
int next_span = 0;
std::vector<cudaEvent_t> spare;

cudaEvent_t event_record() {
  cudaEvent_t e;
  if (spare.empty()) {
    CUDA_CHECK(cudaEventCreate(&e));
  } else {
    e = spare.back();
    spare.pop_back();
  }
  CUDA_CHECK(cudaEventRecord(e, gpu_stream()));
  return e;
}

}  // namespace

// Each operator is also an NVTX range named for its timer, so that a profile (nsys) shows it.
extern "C" int gpu_op_begin(int timer) {
  nvtxRangePushA(timer_name(static_cast<enum timer_id>(timer)));
  spans[next_span] = span_rec{timer, event_record(), nullptr};
  return next_span++;
}

extern "C" void gpu_op_end(int span) {
  spans.at(span).end = event_record();
  nvtxRangePop();
}

extern "C" void gpu_op_flush(void) {
  for (auto it = spans.begin(); it != spans.end();) {
    const span_rec &s = it->second;
    if (!s.end) {  // still open (a wait inside an operator): the next flush takes it
      ++it;
      continue;
    }
    float ms = 0.0f;
    CUDA_CHECK(cudaEventSynchronize(s.end));
    CUDA_CHECK(cudaEventElapsedTime(&ms, s.begin, s.end));
    timer_add_ms(static_cast<enum timer_id>(s.timer), (double)ms);
    spare.push_back(s.begin);
    spare.push_back(s.end);
    it = spans.erase(it);
  }
}

extern "C" void gpu_counts_reset(void) {
  gpu_pool_trace_mark("counts_reset");
  counts = device_counts{};
  counts.pool_live_peak_bytes = (double)live_now;
  counts.pool_reserved_peak_bytes = (double)(live_now + cached_now);
}

extern "C" void gpu_counts_read(struct device_counts *out) {
  gpu_pool_trace_mark("counts_read");
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

extern "C" void gpu_count_gemm(long M, long N, long K, long batch, long nA, long nB, bool reads_c,
                               size_t elem_bytes) {
  const double b = (double)batch;
  counts.gemm_calls += 1.0;
  counts.gemm_flops += 2.0 * (double)M * (double)N * (double)K * b;
  // distinct elements: an operand of stride 0 is one matrix, read by every product of the batch
  const double ab = (double)M * (double)K * (double)nA + (double)K * (double)N * (double)nB,
               c = reads_c ? (double)M * (double)N * b : 0.0;
  counts.gemm_operand_elements += ab + c;
  counts.gemm_operand_bytes += ab * (double)elem_bytes + c * sizeof(float);
}

extern "C" void gpu_count_convert(size_t n) { counts.elements_converted += (double)n; }

extern "C" void gpu_count_convert_in_pass(size_t n) {
  counts.elements_converted += (double)n;
  counts.elements_converted_in_pass += (double)n;
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
