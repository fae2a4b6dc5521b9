/* Counter-based generator of rng.h: the key is folded through the splitmix64 finaliser, a
 * bijective 64-bit mixer with full avalanche, once per key word. */
#include "core/rng.h"

#include <math.h>

static inline uint64_t mix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

uint64_t rng_prefix(uint64_t seed, uint64_t stream, uint64_t a, uint64_t b) {
  uint64_t h = mix64(seed ^ 0x5851F42D4C957F2Dull);
  h = mix64(h ^ stream);
  h = mix64(h ^ a);
  return mix64(h ^ (b * 0xD6E8FEB86659FD93ull));
}

uint64_t rng_bits(uint64_t seed, uint64_t stream, uint64_t a, uint64_t b, uint64_t c) {
  return rng_bits_last(rng_prefix(seed, stream, a, b), c);
}

float rng_uniform(uint64_t seed, uint64_t stream, uint64_t a, uint64_t b, uint64_t c) {
  return (float)(rng_bits(seed, stream, a, b, c) >> 40) * (1.0f / 16777216.0f);
}

double rng_uniform_double(uint64_t seed, uint64_t stream, uint64_t a, uint64_t b, uint64_t c) {
  return (double)(rng_bits(seed, stream, a, b, c) >> 11) * (1.0 / 9007199254740992.0);
}

double rng_normal(uint64_t seed, uint64_t stream, uint64_t a, uint64_t b, uint64_t c) {
  uint64_t r = rng_bits(seed, stream, a, b, c);
  double u1 = ((double)(r >> 11) + 1.0) * (1.0 / 9007199254740993.0); /* (0, 1] */
  double u2 = (double)(mix64(r) >> 11) * (1.0 / 9007199254740992.0);
  return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

uint64_t rng_below(uint64_t n, uint64_t seed, uint64_t stream, uint64_t a, uint64_t b, uint64_t c) {
  /* 128-bit multiply-shift: unbiased enough for n far below 2^64. */
  return (uint64_t)(((unsigned __int128)rng_bits(seed, stream, a, b, c) * n) >> 64);
}
