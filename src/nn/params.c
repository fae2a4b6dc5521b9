/* Named-tensor registry (params.h): appending, lookup, and offsets into the shared buffers. */
#include "nn/params.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "core/rng.h"

void param_list_init(struct param_list *list) { memset(list, 0, sizeof *list); }

void param_list_free(struct param_list *list) {
  free(list->p);
  memset(list, 0, sizeof *list);
}

int param_list_add(struct param_list *list, const char *name, int ndim, const long *shape,
                   bool decay, enum init_kind init, float std) {
  if (ndim < 1 || ndim > PARAM_MAXDIM) error("parameter %s: %d dimensions", name, ndim);
  if (strlen(name) >= PARAM_NAME) error("parameter name too long: %s", name);
  if (param_list_find(list, name) >= 0) error("parameter %s registered twice", name);
  if (list->count == list->cap) {
    list->cap = list->cap ? 2 * list->cap : 64;
    list->p = realloc(list->p, sizeof(struct param_desc) * (size_t)list->cap);
    if (!list->p) error("out of memory growing the parameter list");
  }
  struct param_desc *p = &list->p[list->count];
  memset(p, 0, sizeof *p);
  snprintf(p->name, sizeof p->name, "%s", name);
  p->ndim = ndim;
  p->numel = 1;
  for (int i = 0; i < ndim; i++) {
    if (shape[i] < 1) error("parameter %s: dimension %d is %ld", name, i, shape[i]);
    p->shape[i] = shape[i];
    p->numel *= (size_t)shape[i];
  }
  p->offset = list->total;
  p->decay = decay;
  p->lr_scale = 1.0f;
  p->init = init;
  p->std = std;
  p->layer = -1;
  list->total += param_aligned(p->numel);
  return list->count++;
}

void param_list_freeze(struct param_list *list, int i) {
  list->p[i].frozen = true;
  list->p[i].decay = false;
}

int param_list_find(const struct param_list *list, const char *name) {
  for (int i = 0; i < list->count; i++)
    if (strcmp(list->p[i].name, name) == 0) return i;
  return -1;
}

void param_shape_text(const struct param_desc *p, char *buf, size_t len) {
  size_t used = (size_t)snprintf(buf, len, "[");
  for (int i = 0; i < p->ndim && used < len; i++)
    used += (size_t)snprintf(buf + used, len - used, i ? ", %ld" : "%ld", p->shape[i]);
  if (used < len) snprintf(buf + used, len - used, "]");
}

static uint64_t name_hash(const char *s) {
  uint64_t h = 1469598103934665603ull; /* FNV-1a */
  for (; *s; s++) h = (h ^ (uint8_t)*s) * 1099511628211ull;
  return h;
}

void param_init(const struct param_desc *p, float *data, uint64_t seed) {
  switch (p->init) {
    case INIT_ZERO:
      memset(data, 0, sizeof(float) * p->numel);
      break;
    case INIT_ONE:
      for (size_t e = 0; e < p->numel; e++) data[e] = 1.0f;
      break;
    case INIT_NORMAL: {
      const uint64_t key = name_hash(p->name);
      const float std = p->std;
      const long count = (long)p->numel;
#pragma omp parallel for schedule(static)
      for (long e = 0; e < count; e++)
        data[e] = std * (float)rng_normal(seed, RNG_INIT, key, (uint64_t)e, 0);
      break;
    }
    case INIT_UNIFORM: {
      const uint64_t key = name_hash(p->name);
      const long count = (long)p->numel;
#pragma omp parallel for schedule(static)
      for (long e = 0; e < count; e++)
        data[e] =
            p->std * (float)(2.0 * rng_uniform_double(seed, RNG_INIT, key, (uint64_t)e, 1) - 1.0);
      break;
    }
    case INIT_CUSTOM:
      error("%s: param_init cannot do a custom initialisation", p->name);
  }
}
