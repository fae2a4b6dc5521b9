// The CUDA emulation's cuda_bf16.h: __nv_bfloat16 (and __nv_bfloat162) as 16 bits of storage,
// converted from float with round-to-nearest-even (NaN stays NaN, quieted), arithmetic done in
// float and rounded back, as the hardware's bf16 instructions round. It must not pretend to
// more precision than bf16 has: every result passes through the 16-bit form.
#ifndef CUDAEMU_CUDA_BF16_H
#define CUDAEMU_CUDA_BF16_H

#include <cstdint>
#include <cstring>

namespace cudaemu {
inline uint16_t float_to_bf16_rn(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x0040u);  // NaN: quiet
  u += 0x7fffu + ((u >> 16) & 1u);  // ties to even; overflow carries into the exponent (to inf)
  return (uint16_t)(u >> 16);
}
inline uint16_t float_to_bf16_rz(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x0040u);
  return (uint16_t)(u >> 16);
}
inline float bf16_to_float(uint16_t h) {
  const uint32_t u = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
}  // namespace cudaemu

struct __nv_bfloat16_raw {
  unsigned short x;
};

struct __nv_bfloat16 {
  unsigned short __x;
  __nv_bfloat16() = default;  // uninitialised, as CUDA's
  __nv_bfloat16(float f) : __x(cudaemu::float_to_bf16_rn(f)) {}
  __nv_bfloat16(double d) : __x(cudaemu::float_to_bf16_rn((float)d)) {}
  __nv_bfloat16(const __nv_bfloat16_raw &r) : __x(r.x) {}
  operator float() const { return cudaemu::bf16_to_float(__x); }
  operator __nv_bfloat16_raw() const { return __nv_bfloat16_raw{__x}; }
};
typedef __nv_bfloat16 nv_bfloat16;

struct __nv_bfloat162 {
  __nv_bfloat16 x, y;
  __nv_bfloat162() = default;
  __nv_bfloat162(__nv_bfloat16 a, __nv_bfloat16 b) : x(a), y(b) {}
};
typedef __nv_bfloat162 nv_bfloat162;

inline __nv_bfloat16 __float2bfloat16(float f) { return __nv_bfloat16(f); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16(f); }
inline __nv_bfloat16 __float2bfloat16_rz(float f) {
  return __nv_bfloat16(__nv_bfloat16_raw{cudaemu::float_to_bf16_rz(f)});
}
inline float __bfloat162float(__nv_bfloat16 h) { return cudaemu::bf16_to_float(h.__x); }
inline __nv_bfloat16 __double2bfloat16(double d) { return __nv_bfloat16((float)d); }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.__x; }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short u) {
  return __nv_bfloat16(__nv_bfloat16_raw{u});
}
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) {
  return __nv_bfloat162(__nv_bfloat16(a), __nv_bfloat16(b));
}
inline __nv_bfloat162 __float2bfloat162_rn(float a) {
  return __nv_bfloat162(__nv_bfloat16(a), __nv_bfloat16(a));
}
inline float __low2float(__nv_bfloat162 v) { return __bfloat162float(v.x); }
inline float __high2float(__nv_bfloat162 v) { return __bfloat162float(v.y); }

// Arithmetic: each operation rounds its float result to bf16, as the hardware's do.
#define CUDAEMU_BF16_OP(op, fn)                                                \
  inline __nv_bfloat16 operator op(__nv_bfloat16 a, __nv_bfloat16 b) {         \
    return __nv_bfloat16(__bfloat162float(a) op __bfloat162float(b));          \
  }                                                                            \
  inline __nv_bfloat16 fn(__nv_bfloat16 a, __nv_bfloat16 b) { return a op b; } \
  inline __nv_bfloat16 &operator op##=(__nv_bfloat16 &a, __nv_bfloat16 b) { return a = a op b; }
CUDAEMU_BF16_OP(+, __hadd)
CUDAEMU_BF16_OP(-, __hsub)
CUDAEMU_BF16_OP(*, __hmul)
CUDAEMU_BF16_OP(/, __hdiv)
#undef CUDAEMU_BF16_OP
inline __nv_bfloat16 operator-(__nv_bfloat16 a) {
  return __nv_bfloat16(__nv_bfloat16_raw{(unsigned short)(a.__x ^ 0x8000u)});
}
inline __nv_bfloat16 __hneg(__nv_bfloat16 a) { return -a; }
inline __nv_bfloat16 __hfma(__nv_bfloat16 a, __nv_bfloat16 b, __nv_bfloat16 c) {
  // a·b is exact in float (8-bit significands); the sum is rounded to float and then to bf16,
  // a double rounding the hardware avoids (it can differ in the last bit, rarely)
  return __nv_bfloat16(
      __builtin_fmaf(__bfloat162float(a), __bfloat162float(b), __bfloat162float(c)));
}
#define CUDAEMU_BF16_CMP(op)                                  \
  inline bool operator op(__nv_bfloat16 a, __nv_bfloat16 b) { \
    return __bfloat162float(a) op __bfloat162float(b);        \
  }
CUDAEMU_BF16_CMP(==)
CUDAEMU_BF16_CMP(!=)
CUDAEMU_BF16_CMP(<)
CUDAEMU_BF16_CMP(<=)
CUDAEMU_BF16_CMP(>)
CUDAEMU_BF16_CMP(>=)
#undef CUDAEMU_BF16_CMP
inline __nv_bfloat16 __hmax(__nv_bfloat16 a, __nv_bfloat16 b) { return a < b ? b : a; }
inline __nv_bfloat16 __hmin(__nv_bfloat16 a, __nv_bfloat16 b) { return b < a ? b : a; }

#endif
