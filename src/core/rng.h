/* Counter-based random numbers: every draw is a pure function of (seed, stream, counters), so a
 * result never depends on how many ranks or threads computed it, and a restart needs no RNG state
 * beyond the seed and the step. Not a cryptographic generator. */
#ifndef FMATTN_RNG_H
#define FMATTN_RNG_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Independent streams: one per purpose, so that adding draws to one never shifts another. */
enum rng_stream {
  RNG_INIT = 1, /* parameter initialisation: (param index, element) */
  RNG_DATA,     /* training window offsets: (step, global sample) */
  RNG_DROPOUT,  /* dropout masks: (step, sample, site, token, channel) */
  RNG_MASK,     /* mlm masking: (step, sample, token) */
  RNG_TASK,     /* synthetic task symbols: (sample id, token) */
  RNG_GENERATE, /* sampling in generate mode */
  RNG_FEATURES, /* random features drawn once per run */
  RNG_NOISE,    /* training-time noise on logits */
  RNG_TEST      /* tests and benchmarks */
};

/* 64 random bits from the key (seed, stream, a, b, c). */
uint64_t rng_bits(uint64_t seed, uint64_t stream, uint64_t a, uint64_t b, uint64_t c);

/* rng_bits in two steps, for a run of keys that differ in c alone (a dropout row): the fold of
 * (seed, stream, a, b) once, then one splitmix64 finaliser per c, inline so that a loop over c
 * vectorises. rng_bits_last(rng_prefix(seed, stream, a, b), c) == rng_bits(seed, stream, a, b, c),
 * bit for bit. */
uint64_t rng_prefix(uint64_t seed, uint64_t stream, uint64_t a, uint64_t b);
static inline uint64_t rng_bits_last(uint64_t prefix, uint64_t c) {
  uint64_t z = prefix ^ (c * 0xA0761D6478BD642Full);
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
/* Uniform in [0, 1) with 24 random bits (exactly representable as float). */
float rng_uniform(uint64_t seed, uint64_t stream, uint64_t a, uint64_t b, uint64_t c);
/* Uniform in [0, 1) with 53 random bits. */
double rng_uniform_double(uint64_t seed, uint64_t stream, uint64_t a, uint64_t b, uint64_t c);
/* Standard normal (Box-Muller on two independent draws of the same key). */
double rng_normal(uint64_t seed, uint64_t stream, uint64_t a, uint64_t b, uint64_t c);
/* Uniform integer in [0, n). */
uint64_t rng_below(uint64_t n, uint64_t seed, uint64_t stream, uint64_t a, uint64_t b, uint64_t c);

#ifdef __cplusplus
}
#endif

#endif
