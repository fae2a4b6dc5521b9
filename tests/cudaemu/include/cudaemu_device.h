// The device side of the CUDA emulation: what a kernel body sees (threadIdx and friends,
// __syncthreads, the _sync warp primitives, atomics, CUDA's math intrinsics), each CUDA thread
// being a coroutine of libcudaemu.a. Included by cuda_runtime.h; it must not offer what the
// emulation cannot execute faithfully (no __activemask, no pre-Volta non-_sync warp functions).
#ifndef CUDAEMU_DEVICE_H
#define CUDAEMU_DEVICE_H

#include <math.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

// Function qualifiers: every function is a host function here.
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
// cu2cc.py rewrites every __shared__ declaration it understands; one left over is an error.
#define __shared__   _Pragma("GCC error \"__shared__ that cu2cc.py did not rewrite\"")
#define __constant__ _Pragma("GCC error \"__constant__ memory is not emulated\"")
#define __managed__  _Pragma("GCC error \"__managed__ memory is not emulated\"")

namespace cudaemu {
// The running CUDA thread's coordinates, set by the scheduler before every switch into it.
extern uint3 g_threadIdx, g_blockIdx;
extern dim3 g_blockDim, g_gridDim;

enum class warp_kind {
  shfl,
  shfl_up,
  shfl_down,
  shfl_xor,
  ballot,
  any,
  all,
  syncwarp,
  reduce_add_u,
  reduce_add_i,
  reduce_min_u,
  reduce_min_i,
  reduce_max_u,
  reduce_max_i,
  reduce_and,
  reduce_or,
  reduce_xor
};
// One lane's part in a warp-synchronous operation over the lanes of `mask`: blocks until every
// lane of the mask arrived at an operation of the same kind, then returns this lane's result.
uint64_t warp_sync_op(warp_kind kind, unsigned mask, uint64_t value, int arg, int width,
                      const char *file, int line);
// __syncthreads and its reducing forms (kind 0 plain, 1 count, 2 and, 3 or).
int block_barrier(int kind, int pred, const char *file, int line);
void kernel_entry(const char *pretty_name);
[[noreturn]] void device_trap(const char *file, int line);
void check_atomic(const void *p, const char *what);

template <class T>
inline uint64_t to_bits(T v) {
  static_assert(std::is_trivially_copyable<T>::value && sizeof(T) <= 8,
                "warp shuffles move values of at most 8 bytes");
  uint64_t b = 0;
  std::memcpy(&b, &v, sizeof(T));
  return b;
}
template <class T>
inline T from_bits(uint64_t b) {
  T v;
  std::memcpy(&v, &b, sizeof(T));
  return v;
}
}  // namespace cudaemu

#define threadIdx (static_cast<const uint3 &>(::cudaemu::g_threadIdx))
#define blockIdx  (static_cast<const uint3 &>(::cudaemu::g_blockIdx))
#define blockDim  (static_cast<const dim3 &>(::cudaemu::g_blockDim))
#define gridDim   (static_cast<const dim3 &>(::cudaemu::g_gridDim))
constexpr int warpSize = 32;

// Injected by cu2cc.py at the top of every __global__ body: the kernel's full name (template
// arguments included) for messages.
#define CUDAEMU_KERNEL_ENTRY() ::cudaemu::kernel_entry(__PRETTY_FUNCTION__)

// ---- barriers ----
inline void __syncthreads(const char *file = __builtin_FILE(), int line = __builtin_LINE()) {
  cudaemu::block_barrier(0, 0, file, line);
}
inline int __syncthreads_count(int pred, const char *file = __builtin_FILE(),
                               int line = __builtin_LINE()) {
  return cudaemu::block_barrier(1, pred, file, line);
}
inline int __syncthreads_and(int pred, const char *file = __builtin_FILE(),
                             int line = __builtin_LINE()) {
  return cudaemu::block_barrier(2, pred, file, line);
}
inline int __syncthreads_or(int pred, const char *file = __builtin_FILE(),
                            int line = __builtin_LINE()) {
  return cudaemu::block_barrier(3, pred, file, line);
}
// Coroutines never overlap and see every store at once: fences have nothing to order.
inline void __threadfence() {}
inline void __threadfence_block() {}
inline void __threadfence_system() {}

// ---- warp primitives (CUDA 9 _sync forms only) ----
inline void __syncwarp(unsigned mask = 0xffffffffu, const char *file = __builtin_FILE(),
                       int line = __builtin_LINE()) {
  cudaemu::warp_sync_op(cudaemu::warp_kind::syncwarp, mask, 0, 0, 32, file, line);
}
#define CUDAEMU_SHFL(fn, kind)                                                                    \
  template <class T>                                                                              \
  inline T fn(unsigned mask, T var, int arg, int width = 32, const char *file = __builtin_FILE(), \
              int line = __builtin_LINE()) {                                                      \
    return cudaemu::from_bits<T>(cudaemu::warp_sync_op(                                           \
        cudaemu::warp_kind::kind, mask, cudaemu::to_bits(var), arg, width, file, line));          \
  }
CUDAEMU_SHFL(__shfl_sync, shfl)
CUDAEMU_SHFL(__shfl_up_sync, shfl_up)
CUDAEMU_SHFL(__shfl_down_sync, shfl_down)
CUDAEMU_SHFL(__shfl_xor_sync, shfl_xor)
#undef CUDAEMU_SHFL

inline unsigned __ballot_sync(unsigned mask, int pred, const char *file = __builtin_FILE(),
                              int line = __builtin_LINE()) {
  return (unsigned)cudaemu::warp_sync_op(cudaemu::warp_kind::ballot, mask, pred != 0, 0, 32, file,
                                         line);
}
inline int __any_sync(unsigned mask, int pred, const char *file = __builtin_FILE(),
                      int line = __builtin_LINE()) {
  return (int)cudaemu::warp_sync_op(cudaemu::warp_kind::any, mask, pred != 0, 0, 32, file, line);
}
inline int __all_sync(unsigned mask, int pred, const char *file = __builtin_FILE(),
                      int line = __builtin_LINE()) {
  return (int)cudaemu::warp_sync_op(cudaemu::warp_kind::all, mask, pred != 0, 0, 32, file, line);
}
#define CUDAEMU_REDUCE(fn, T, kind)                                                               \
  inline T fn(unsigned mask, T v, const char *file = __builtin_FILE(),                            \
              int line = __builtin_LINE()) {                                                      \
    return (T)cudaemu::warp_sync_op(cudaemu::warp_kind::kind, mask, (uint64_t)(uint32_t)v, 0, 32, \
                                    file, line);                                                  \
  }
CUDAEMU_REDUCE(__reduce_add_sync, unsigned, reduce_add_u)
CUDAEMU_REDUCE(__reduce_add_sync, int, reduce_add_i)
CUDAEMU_REDUCE(__reduce_min_sync, unsigned, reduce_min_u)
CUDAEMU_REDUCE(__reduce_min_sync, int, reduce_min_i)
CUDAEMU_REDUCE(__reduce_max_sync, unsigned, reduce_max_u)
CUDAEMU_REDUCE(__reduce_max_sync, int, reduce_max_i)
CUDAEMU_REDUCE(__reduce_and_sync, unsigned, reduce_and)
CUDAEMU_REDUCE(__reduce_or_sync, unsigned, reduce_or)
CUDAEMU_REDUCE(__reduce_xor_sync, unsigned, reduce_xor)
#undef CUDAEMU_REDUCE

// ---- atomics: a read-modify-write is atomic because coroutines never overlap ----
#define CUDAEMU_ATOMIC(fn, T, expr)      \
  inline T fn(T *address, T val) {       \
    cudaemu::check_atomic(address, #fn); \
    const T old = *address;              \
    *address = (expr);                   \
    return old;                          \
  }
#define CUDAEMU_ATOMIC_INT(fn, expr)     \
  CUDAEMU_ATOMIC(fn, int, expr)          \
  CUDAEMU_ATOMIC(fn, unsigned int, expr) \
  CUDAEMU_ATOMIC(fn, unsigned long long int, expr)
CUDAEMU_ATOMIC_INT(atomicAdd, old + val)
CUDAEMU_ATOMIC(atomicAdd, float, old + val)
CUDAEMU_ATOMIC(atomicAdd, double, old + val)
CUDAEMU_ATOMIC(atomicSub, int, old - val)
CUDAEMU_ATOMIC(atomicSub, unsigned int, old - val)
CUDAEMU_ATOMIC_INT(atomicExch, val)
CUDAEMU_ATOMIC(atomicExch, float, val)
CUDAEMU_ATOMIC_INT(atomicMin, val < old ? val : old)
CUDAEMU_ATOMIC(atomicMin, long long int, val < old ? val : old)
CUDAEMU_ATOMIC_INT(atomicMax, val > old ? val : old)
CUDAEMU_ATOMIC(atomicMax, long long int, val > old ? val : old)
CUDAEMU_ATOMIC_INT(atomicAnd, old &val)
CUDAEMU_ATOMIC_INT(atomicOr, old | val)
CUDAEMU_ATOMIC_INT(atomicXor, old ^ val)
CUDAEMU_ATOMIC(atomicInc, unsigned int, old >= val ? 0u : old + 1u)
CUDAEMU_ATOMIC(atomicDec, unsigned int, (old == 0u || old > val) ? val : old - 1u)
#undef CUDAEMU_ATOMIC_INT
#undef CUDAEMU_ATOMIC
#define CUDAEMU_CAS(T)                               \
  inline T atomicCAS(T *address, T compare, T val) { \
    cudaemu::check_atomic(address, "atomicCAS");     \
    const T old = *address;                          \
    if (old == compare) *address = val;              \
    return old;                                      \
  }
CUDAEMU_CAS(int)
CUDAEMU_CAS(unsigned int)
CUDAEMU_CAS(unsigned long long int)
CUDAEMU_CAS(unsigned short int)
#undef CUDAEMU_CAS

// ---- math: CUDA's device functions beyond the C library ----
#define CUDAEMU_MINMAX(T)                          \
  inline T min(T a, T b) { return b < a ? b : a; } \
  inline T max(T a, T b) { return a < b ? b : a; }
CUDAEMU_MINMAX(int)
CUDAEMU_MINMAX(unsigned int)
CUDAEMU_MINMAX(long)
CUDAEMU_MINMAX(unsigned long)
CUDAEMU_MINMAX(long long)
CUDAEMU_MINMAX(unsigned long long)
#undef CUDAEMU_MINMAX
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }
inline double min(double a, double b) { return fmin(a, b); }
inline double max(double a, double b) { return fmax(a, b); }

inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline double rsqrt(double x) { return 1.0 / sqrt(x); }
// The fast intrinsics are computed accurately: the emulation does not model their error.
inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }
inline float __log2f(float x) { return log2f(x); }
inline float __sinf(float x) { return sinf(x); }
inline float __cosf(float x) { return cosf(x); }
inline float __tanf(float x) { return tanf(x); }
inline float __powf(float x, float y) { return powf(x, y); }
inline float __exp10f(float x) { return powf(10.0f, x); }
inline float __fdividef(float x, float y) { return x / y; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return sqrtf(x); }
inline float __fadd_rn(float x, float y) { return x + y; }
inline float __fmul_rn(float x, float y) { return x * y; }
inline float __fmaf_rn(float x, float y, float z) { return fmaf(x, y, z); }
inline float __saturatef(float x) { return x != x ? 0.0f : fminf(fmaxf(x, 0.0f), 1.0f); }
inline int __float_as_int(float x) { return cudaemu::from_bits<int>(cudaemu::to_bits(x)); }
inline unsigned __float_as_uint(float x) {
  return cudaemu::from_bits<unsigned>(cudaemu::to_bits(x));
}
inline float __int_as_float(int x) { return cudaemu::from_bits<float>(cudaemu::to_bits(x)); }
inline float __uint_as_float(unsigned x) { return cudaemu::from_bits<float>(cudaemu::to_bits(x)); }
inline long long __double_as_longlong(double x) {
  return cudaemu::from_bits<long long>(cudaemu::to_bits(x));
}
inline double __longlong_as_double(long long x) {
  return cudaemu::from_bits<double>(cudaemu::to_bits(x));
}
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned)x); }
inline int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll((unsigned long long)x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline unsigned __brev(unsigned x) {
  unsigned r = 0;
  for (int i = 0; i < 32; i++) r |= ((x >> i) & 1u) << (31 - i);
  return r;
}
template <class T>
inline T __ldg(const T *p) {
  return *p;
}
long long clock64();
inline void __nanosleep(unsigned) {}
#define __trap() ::cudaemu::device_trap(__FILE__, __LINE__)

#endif
