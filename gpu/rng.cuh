/* The counter-based random bits of src/core/rng.c on the device, the same function bit for bit
 * (64-bit integer arithmetic only), so a dropout mask drawn on the GPU equals the CPU's for the
 * same key. Header of device functions, included by the .cu files that draw. */
#ifndef FMATTN_GPU_RNG_CUH
#define FMATTN_GPU_RNG_CUH

#include <cstdint>

__device__ __forceinline__ uint64_t gpu_mix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/* rng_bits of src/core/rng.c: 64 random bits from the key (seed, stream, a, b, c). */
__device__ __forceinline__ uint64_t gpu_rng_bits(uint64_t seed, uint64_t stream, uint64_t a,
                                                 uint64_t b, uint64_t c) {
  uint64_t h = gpu_mix64(seed ^ 0x5851F42D4C957F2Dull);
  h = gpu_mix64(h ^ stream);
  h = gpu_mix64(h ^ a);
  h = gpu_mix64(h ^ (b * 0xD6E8FEB86659FD93ull));
  h = gpu_mix64(h ^ (c * 0xA0761D6478BD642Full));
  return h;
}

#endif
