// The CUDA emulation's nvtx3/nvToolsExt.h: the push/pop ranges a profiler shows, kept as a
// per-thread stack by libcudaemu.a (runtime.cc) and traced under CUDAEMU_TRACE=1. As NVTX, a push
// returns the depth it opened at, a pop the depth it closed, and a pop with nothing open −1.
#ifndef CUDAEMU_NVTOOLSEXT_H
#define CUDAEMU_NVTOOLSEXT_H

#ifdef __cplusplus
extern "C" {
#endif

int nvtxRangePushA(const char *message);
int nvtxRangePop(void);

#ifdef __cplusplus
}
#endif

#endif
