/* The back ends (backend.h): the CPU table — layers.c, memory.c's arenas and optimizer.c's loops —
 * and the choice of a table for parallel.device. This is the one file that knows which back ends
 * were built; nothing else in src/ asks. */
#include "backend.h"

#include <stdio.h>
#include <string.h>

#include "optimizer.h"

static void *cpu_alloc(enum mem_label label, size_t bytes) { return mem_alloc(label, bytes); }
static void cpu_zero(void *p, size_t bytes) { memset(p, 0, bytes); }
static void cpu_copy(void *dst, const void *src, size_t bytes) {
  if (dst != src) memcpy(dst, src, bytes);
}

static const struct backend cpu = {
    .name = "cpu",
    .device = DEVICE_CPU,
    .host_visible = true,
    .alloc = cpu_alloc,
    .free = mem_free,
    .zero = cpu_zero,
    .upload = cpu_copy,
    .download = cpu_copy,
    .linear_forward = linear_forward,
    .linear_backward = linear_backward,
    .layernorm_forward = layernorm_forward,
    .layernorm_backward = layernorm_backward,
    .gelu_forward = gelu_forward,
    .gelu_backward = gelu_backward,
    .embedding_forward = embedding_forward,
    .embedding_backward = embedding_backward,
    .sinusoidal_forward = sinusoidal_forward,
    .rope_forward = rope_forward,
    .rope_backward = rope_backward,
    .dropout_forward = dropout_forward,
    .dropout_backward = dropout_backward,
    .residual_dropout_forward = residual_dropout_forward,
    .residual_dropout_backward = residual_dropout_backward,
    .heads_split_forward = heads_split_forward,
    .heads_split_backward = heads_split_backward,
    .heads_merge_forward = heads_merge_forward,
    .heads_merge_backward = heads_merge_backward,
    .softmax_xent_forward_backward = softmax_xent_rows_forward_backward,
    .sum_squares = optimizer_cpu_sum_squares,
    .adamw = optimizer_cpu_adamw,
};

const struct backend *backend_cpu(void) { return &cpu; }

const struct backend *backend_for(enum device_kind device, char *err, size_t len) {
  if (device != DEVICE_GPU) return &cpu;
  snprintf(err, len,
           "parallel.device = gpu: this fmattn has no GPU back end yet (docs/gpu.md); use cpu "
           "or auto");
  return NULL;
}
