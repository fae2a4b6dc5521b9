// Shared by the CUDA emulation's own tests (test_*.cu, rewritten by cu2cc.py like gpu/): cmocka
// in TAP mode, a CUDA_CHECK that fails the test, and device-array helpers. Test code only; it
// must not reach into the emulation's internals beyond its two test hooks.
#ifndef CUDAEMU_EMU_TEST_H
#define CUDAEMU_EMU_TEST_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

extern "C" {  // cmocka 1.1's header declares C functions without saying so
#include <cmocka.h>
}
#include <cuda_runtime.h>

extern "C" size_t cudaemu_bytes_in_use(void);
extern "C" size_t cudaemu_bytes_peak(void);

#define CUDA_OK(call)                                                                \
  do {                                                                               \
    const cudaError_t e_ = (call);                                                   \
    if (e_ != cudaSuccess) fail_msg("%s failed: %s", #call, cudaGetErrorString(e_)); \
  } while (0)

// A fresh device array of n elements (NaN-filled by the emulation).
template <class T>
T *dev_alloc(size_t n) {
  void *p = nullptr;
  CUDA_OK(cudaMalloc(&p, sizeof(T) * n));
  return static_cast<T *>(p);
}

template <class T>
T *upload(const std::vector<T> &h) {
  T *d = dev_alloc<T>(h.size());
  CUDA_OK(cudaMemcpy(d, h.data(), sizeof(T) * h.size(), cudaMemcpyHostToDevice));
  return d;
}

template <class T>
std::vector<T> download(const T *d, size_t n) {
  std::vector<T> h(n);
  CUDA_OK(cudaMemcpy(h.data(), d, sizeof(T) * n, cudaMemcpyDeviceToHost));
  return h;
}

inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// What CUDAEMU_ORDER / CUDAEMU_DEFER say, as the test programs need to know it.
inline const char *env_or(const char *name, const char *dflt) {
  const char *v = std::getenv(name);
  return v && *v ? v : dflt;
}

#define EMU_MAIN(tests)                                     \
  int main(void) {                                          \
    cmocka_set_message_output(CM_OUTPUT_TAP);               \
    return cmocka_run_group_tests(tests, nullptr, nullptr); \
  }

#endif
