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
