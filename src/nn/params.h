/* The named-tensor registry: every trainable tensor has a path (its checkpoint name below
 * /model/), a shape, whether weight decay applies, and how it is initialised. Parameters, their
 * gradients and both AdamW moments are each one contiguous buffer with the same layout, so the
 * gradient allreduce and the optimizer step are single passes. */
#ifndef FMATTN_PARAMS_H
#define FMATTN_PARAMS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define PARAM_NAME   160
#define PARAM_MAXDIM 4

enum init_kind {
  INIT_NORMAL,  /* N(0, std²) from the counter-based stream keyed by (name, element) */
  INIT_UNIFORM, /* U(−std, std), keyed likewise */
  INIT_ZERO,
  INIT_ONE,
  INIT_CUSTOM /* the owner's init function (e.g. an attention variant's) */
};

struct param_desc {
  char name[PARAM_NAME]; /* e.g. "layer_003/attn/wqkv" */
  int ndim;
  long shape[PARAM_MAXDIM];
  size_t numel;
  size_t offset; /* into the contiguous buffers, in floats; 16-float aligned */
  bool decay;
  float lr_scale; /* this tensor's learning rate is lr × lr_scale (1 unless its owner says) */
  enum init_kind init;
  float std;
  bool frozen; /* a fixed tensor kept with the model (random features): no gradient, no update */
  int layer;   /* owning transformer block, or −1 */
  int owner;   /* 0: the model; 1: the layer's attention variant */
};

struct param_list {
  int count, cap;
  struct param_desc *p;
  size_t total; /* floats, including alignment padding */
};

void param_list_init(struct param_list *list);
void param_list_free(struct param_list *list);
/* Floats a tensor of numel elements occupies in the buffers: every tensor starts 64-byte aligned,
 * so the tensors of one owner (a variant's block) lie at these offsets from the first. */
static inline size_t param_aligned(size_t numel) { return (numel + 15) / 16 * 16; }

/* Append a tensor; returns its index. shape has ndim entries. */
int param_list_add(struct param_list *list, const char *name, int ndim, const long *shape,
                   bool decay, enum init_kind init, float std);
/* Mark tensor i as frozen: saved in checkpoints and restored from them like a parameter, but never
 * trained (the optimizer skips it; nothing accumulates a gradient into it). */
void param_list_freeze(struct param_list *list, int i);
/* Index of the tensor with this name, or −1. */
int param_list_find(const struct param_list *list, const char *name);
/* Initialise one tensor per its init kind (not INIT_CUSTOM, which the owner handles): normal
 * draws are keyed by a hash of the full name and the element index, so a tensor's initial values
 * do not depend on which other tensors exist or on the rank layout. */
void param_init(const struct param_desc *p, float *data, uint64_t seed);
/* "[3, 256, 256]" style shape text. */
void param_shape_text(const struct param_desc *p, char *buf, size_t len);

#ifdef __cplusplus
}
#endif

#endif
