/* The machine's fp32 FMA peak, measured (docs/perf.md): independent chains of fused multiply-adds
 * held in registers, in the widest vectors the CPU runs, on every thread of the rank at once. The
 * honest denominator for MFU: an SGEMM rate measured on the same BLAS kernels as the model shares
 * their faults (a generic fallback core halves both). */
#ifndef FMATTN_PEAK_H
#define FMATTN_PEAK_H

#ifdef __cplusplus
extern "C" {
#endif

/* GFLOP/s per thread (the mean of the rank's threads, each the best of 3 runs of about 20 ms),
 * and in *isa the instructions it ran ("avx512", "avx2+fma", "sse"). */
double fma_peak_gflops_per_thread(const char **isa);

#ifdef __cplusplus
}
#endif

#endif
