/* `linear` attention (SPEC §6.3, Katharopoulos et al.): φ(x) = elu(x) + 1 on the raw q and k (no
 * 1/√d: the feature map replaces the softmax, so there is no score to scale), out_i =
 * φ(q_i)ᵀ S_i / φ(q_i)ᵀ z_i over keys j ≤ i (causal, running sums) or every key. The running sums
 * are kernelized.c's; this file is the feature map and the ops table. Also the feature maps of
 * fmmformer's far field (elu, elu_neg, tanh), which share this file's derivative rules. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "attention/kernelized.h"
#include "attention/linear.h"
#include "nn/vecmath.h"

/* φ of the three kernels of SPEC §6.6 and its derivative, element by element. The exponentials
 * run in loops of their own over libmvec's vector expf (GCC does not vectorise a loop that mixes
 * the call with a select), e = e^min(x, 0) for elu and e^min(−x, 0) for elu_neg, then the select.
 * 1 + tanh(x) is computed as 2σ(2x), which keeps its tiny values for very negative x instead of
 * rounding them to 0; its derivative 1 − tanh² is φ(2 − φ). */
static void exponentials(enum linear_kernel kind, float *e, const float *x, long count) {
  if (kind == LINEAR_ELU)
    for (long i = 0; i < count; i++) e[i] = x[i] < 0.0f ? x[i] : 0.0f;
  else if (kind == LINEAR_ELU_NEG)
    for (long i = 0; i < count; i++) e[i] = x[i] > 0.0f ? -x[i] : 0.0f;
  else
    for (long i = 0; i < count; i++) e[i] = -2.0f * x[i];
#pragma omp simd
  for (long i = 0; i < count; i++) e[i] = expf(e[i]);
}

/* The exponentials stay in scratch (rows, d) for a primed backward on the same rows. */
static void map_forward(const struct kz_map *map, float *phi, const float *x, long rows,
                        float *scratch) {
  const enum linear_kernel kind = *(const enum linear_kernel *)map->data;
  const long count = rows * map->d;
  const float *e = scratch;
  exponentials(kind, scratch, x, count);
  if (kind == LINEAR_ELU) /* elu(x) + 1: x + 1 above 0, e^x below */
    for (long i = 0; i < count; i++) phi[i] = x[i] > 0.0f ? x[i] + 1.0f : e[i];
  else if (kind == LINEAR_ELU_NEG) /* elu(−x) + 1: 1 − x below 0, e^−x above */
    for (long i = 0; i < count; i++) phi[i] = x[i] < 0.0f ? 1.0f - x[i] : e[i];
  else
    for (long i = 0; i < count; i++) phi[i] = 2.0f / (1.0f + e[i]);
}

static void map_backward(const struct kz_map *map, float *dx, const float *dphi, const float *x,
                         long rows, float *scratch, bool primed) {
  const enum linear_kernel kind = *(const enum linear_kernel *)map->data;
  const long count = rows * map->d;
  float *e = scratch; /* (rows, d) */
  if (!primed) exponentials(kind, e, x, count);
  if (kind == LINEAR_ELU)
    for (long i = 0; i < count; i++) dx[i] += dphi[i] * (x[i] > 0.0f ? 1.0f : e[i]);
  else if (kind == LINEAR_ELU_NEG)
    for (long i = 0; i < count; i++) dx[i] += dphi[i] * (x[i] < 0.0f ? -1.0f : -e[i]);
  else
    for (long i = 0; i < count; i++) {
      const float p = 2.0f / (1.0f + e[i]);
      dx[i] += dphi[i] * p * (2.0f - p);
    }
}

static const enum linear_kernel kinds[LINEAR_NKERNELS] = {LINEAR_ELU, LINEAR_ELU_NEG, LINEAR_TANH};
static const char *const kind_names[LINEAR_NKERNELS] = {"elu", "elu_neg", "tanh"};

struct kz_map linear_map(enum linear_kernel kind, int d) {
  return (struct kz_map){.F = d,
                         .d = d,
                         .scratch_floats = (size_t)KZ_BLOCK * (size_t)d,
                         .forward = map_forward,
                         .backward = map_backward,
                         .flops_per_row = 2.0 * d,
                         .data = &kinds[kind]};
}

int linear_kernels_parse(const char *list, enum linear_kernel *out) {
  int count = 0;
  char buf[256];
  snprintf(buf, sizeof buf, "%s", list);
  for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save))
    for (int i = 0; i < LINEAR_NKERNELS; i++)
      if (strcmp(tok, kind_names[i]) == 0 && count < LINEAR_NKERNELS) out[count++] = kinds[i];
  return count;
}

/* ---------------------------------------------------------------------------------------------
 * the ops table */

static size_t linear_saved_floats(const struct attn_ctx *ctx) {
  const struct kz_map map = linear_map(LINEAR_ELU, (int)ctx->dims.d);
  return kz_saved_floats(ctx, &map);
}

static void linear_forward(struct attn_ctx *ctx, float *out, float *saved, const float *q,
                           const float *k, const float *v, const float *params) {
  const struct kz_map map = linear_map(LINEAR_ELU, (int)ctx->dims.d);
  kz_forward(ctx, &map, KZ_PLAIN, out, saved, q, k, v);
}

static void linear_backward(struct attn_ctx *ctx, float *dq, float *dk, float *dv, float *dparams,
                            const float *dout, const float *q, const float *k, const float *v,
                            const float *params, const float *out, const float *saved) {
  const struct kz_map map = linear_map(LINEAR_ELU, (int)ctx->dims.d);
  kz_backward(ctx, &map, KZ_PLAIN, NULL, dq, dk, dv, dout, q, k, v, out, saved);
}

static long linear_diagnostics(struct attn_ctx *ctx, double *mass, double *entropy, const float *q,
                               const float *k, const float *v, const float *params) {
  const struct kz_map map = linear_map(LINEAR_ELU, (int)ctx->dims.d);
  return kz_diagnostics(ctx, &map, KZ_PLAIN, mass, entropy, q, k);
}

static double linear_flops(const struct attn_ctx *ctx, double *p2p_flops) {
  const struct kz_map map = linear_map(LINEAR_ELU, (int)ctx->dims.d);
  *p2p_flops = 0.0;
  return kz_flops(ctx, &map);
}

static void *linear_decode_open(const struct attn_ctx *ctx, const float *params) {
  const struct kz_map map = linear_map(LINEAR_ELU, (int)ctx->dims.d);
  return kz_decode_open(ctx, &map);
}

static void linear_decode_step(struct attn_ctx *ctx, void *cache, float *out, const float *q,
                               const float *k, const float *v, long pos, const float *params) {
  kz_decode_step(ctx, cache, KZ_PLAIN, out, q, k, v);
}

struct attn_variant attention_linear = {
    .name = "linear",
    .causal_ok = true,
    .bidir_ok = true,
    .diagnostics = linear_diagnostics,
    .flops = linear_flops,
    .decode_open = linear_decode_open,
    .decode_step = linear_decode_step,
    .decode_close = kz_decode_close,
    .cpu = {.saved_floats = linear_saved_floats,
            .forward = linear_forward,
            .backward = linear_backward},
};
