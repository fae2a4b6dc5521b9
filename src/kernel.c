/* `fmattn kernel IN.h5 OUT.h5` (SPEC §8.3): one attention op, forward and backward, on tensors a
 * user supplies, so any prototype can be checked against fmattn. IN holds q, k, v, dout (H, n, d)
 * float32, optional params/<name> below attn/<variant>/, and attributes variant, causal and the
 * variant keys without prefix; OUT receives out, dq, dk, dv and dparams/<name> (of the trainable
 * parameters; a frozen tensor such as rmfa's omega may be given in params/ but has no gradient).
 * One rank. */
#include "kernel.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attention/attention.h"
#include "config.h"
#include "error.h"
#include "h5io.h"
#include "memory.h"
#include "timer.h"

/* Attributes of IN turned into deck overrides (six more are fixed: variant, objective, sizes). */
#define KERNEL_MAX_KEYS 48

struct kernel_attrs {
  const char *path;
  char variant[64];
  int causal; /* −1 until read */
  int count;
  char items[KERNEL_MAX_KEYS][160];
};

static herr_t read_attr(hid_t loc, const char *name, const H5A_info_t *info, void *data) {
  struct kernel_attrs *ka = data;
  hid_t a = H5_CHECK(H5Aopen(loc, name, H5P_DEFAULT));
  hid_t space = H5_CHECK(H5Aget_space(a));
  const bool scalar = H5Sget_simple_extent_npoints(space) == 1;
  H5Sclose(space);
  hid_t t = H5_CHECK(H5Aget_type(a));
  H5T_class_t cls = H5Tget_class(t);
  H5Tclose(t);
  H5Aclose(a);
  if (!scalar) error("%s: attribute '%s' must hold one value", ka->path, name);
  char value[128] = "";
  int len = 0;
  if (cls == H5T_INTEGER) {
    long v = 0;
    h5_read_attr_long(loc, ".", name, &v);
    len = snprintf(value, sizeof value, "%ld", v);
  } else if (cls == H5T_FLOAT) {
    double v = 0;
    h5_read_attr_double(loc, ".", name, &v);
    len = snprintf(value, sizeof value, "%.17g", v);
  } else if (cls == H5T_ENUM) { /* numpy bool as written by h5py: FALSE = 0, TRUE = 1 */
    long v = 0;
    if (!h5_read_attr_bool(loc, ".", name, &v))
      error("%s: attribute '%s' is an enum other than a boolean", ka->path, name);
    len = snprintf(value, sizeof value, "%s", v ? "true" : "false");
  } else if (cls == H5T_STRING) {
    char *s = NULL;
    h5_read_attr_string(loc, ".", name, &s);
    len = snprintf(value, sizeof value, "%s", s);
    free(s);
  } else {
    error("%s: attribute '%s' has an unsupported type", ka->path, name);
  }
  if (len < 0 || (size_t)len >= sizeof value)
    error("%s: attribute '%s' is too long", ka->path, name);
  if (strcmp(name, "variant") == 0) {
    snprintf(ka->variant, sizeof ka->variant, "%s", value);
  } else if (strcmp(name, "causal") == 0) {
    ka->causal = strcmp(value, "true") == 0 || strcmp(value, "1") == 0;
  } else {
    if (ka->count == KERNEL_MAX_KEYS)
      error("%s: more than %d variant attributes", ka->path, KERNEL_MAX_KEYS);
    snprintf(ka->items[ka->count++], sizeof ka->items[0], "%s=%s", name, value);
  }
  return 0;
}

int kernel_run(const char *in_path, const char *out_path) {
  int world;
  MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &world));
  if (world != 1) error_collective("fmattn kernel runs on one rank");

  hid_t in = h5_open(in_path, false);
  struct kernel_attrs ka = {.path = in_path, .causal = -1};
  H5_CHECK(H5Aiterate2(in, H5_INDEX_NAME, H5_ITER_NATIVE, NULL, read_attr, &ka));
  if (!ka.variant[0]) error("%s: root attribute 'variant' is missing", in_path);
  if (ka.causal < 0) error("%s: root attribute 'causal' is missing", in_path);
  long shape[3], vshape[3];
  if (h5_dataset_shape(in, "q", shape, 3) != 3)
    error("%s: dataset q [H, n, d] is missing or not 3-D", in_path);
  if (h5_dataset_shape(in, "v", vshape, 3) != 3)
    error("%s: dataset v [H, n, d] is missing or not 3-D", in_path);
  /* v and dout have the H value heads; q and k as many (or FiSH's G global heads) */
  const long Hq = shape[0], H = vshape[0], n = vshape[1], d = vshape[2];
  if (shape[1] != n || shape[2] != d)
    error("%s: q has shape [%ld, %ld, %ld], v [%ld, %ld, %ld]: n and d must agree", in_path,
          shape[0], shape[1], shape[2], H, n, d);

  /* A variant attribute names a deck key below [attention] by the variant's key prefix
   * (fma_linear's are fma.*), or by its FiSH form's (fish.*); heads_mode is attention's own. */
  const struct attn_variant *named = attention_find(ka.variant);
  const char *prefix = named && named->keys_prefix ? named->keys_prefix : ka.variant;
  const char *fish = named && named->fish ? named->fish->keys_prefix : NULL;
  char items[KERNEL_MAX_KEYS + 6][200];
  struct config_overrides ov = {0};
  snprintf(items[0], sizeof items[0], "attention.variant=%s", ka.variant);
  snprintf(items[1], sizeof items[1], "model.objective=%s", ka.causal ? "clm" : "mlm");
  snprintf(items[2], sizeof items[2], "model.context=%ld", n);
  snprintf(items[3], sizeof items[3], "model.heads=%ld", H);
  snprintf(items[4], sizeof items[4], "model.dim=%ld", H * d);
  snprintf(items[5], sizeof items[5], "data.source=copy");
  int ni = 6;
  for (int i = 0; i < ka.count; i++) {
    const char *key = ka.items[i];
    char name[200];
    snprintf(name, sizeof name, "attention.%.*s", (int)strcspn(key, "="), key);
    const char *group = config_key_exists(name) ? NULL : prefix;
    snprintf(name, sizeof name, "attention.%s.%.*s", fish ? fish : "", (int)strcspn(key, "="), key);
    if (group && fish && config_key_exists(name)) group = fish;
    int len = group ? snprintf(items[ni++], sizeof items[0], "attention.%s.%s", group, key)
                    : snprintf(items[ni++], sizeof items[0], "attention.%s", key);
    if (len >= (int)sizeof items[0]) error("%s: attribute %s is too long", in_path, key);
  }
  for (int i = 0; i < ni; i++) ov.items[ov.count++] = items[i];
  struct config cfg;
  char err[1024];
  if (config_load(&cfg, NULL, &ov, err, sizeof err)) error("%s: %s", in_path, err);
  if (attention_check(&cfg, n, 1, err, sizeof err)) error("%s: %s", in_path, err);
  const struct attn_variant *v = attention_select(&cfg);
  if (Hq != attention_qk_heads(&cfg))
    error("%s: q and k have %ld heads, but %s needs %d (v has %ld)", in_path, Hq, v->name,
          attention_qk_heads(&cfg), H);

  const size_t count = (size_t)(H * n * d), qcount = (size_t)(Hq * n * d);
  const long dims3[3] = {H, n, d}, qdims3[3] = {Hq, n, d};
  float *q = mem_alloc(MEM_DATA, sizeof(float) * qcount),
        *k = mem_alloc(MEM_DATA, sizeof(float) * qcount);
  float *vv = mem_alloc(MEM_DATA, sizeof(float) * count),
        *dout = mem_alloc(MEM_DATA, sizeof(float) * count);
  h5_read_floats(in, "q", 3, qdims3, q, in_path);
  h5_read_floats(in, "k", 3, qdims3, k, in_path);
  h5_read_floats(in, "v", 3, dims3, vv, in_path);
  h5_read_floats(in, "dout", 3, dims3, dout, in_path);

  /* parameters the file gives replace the initial ones */
  struct attn_params ap;
  attention_params_make(&ap, &cfg, v, n);
  const struct param_list *list = &ap.list;
  const size_t skip =
      strlen("layer_000/attn/") + strlen(v->params_name ? v->params_name : v->name) + 1;
  for (int i = 0; i < list->count; i++) {
    const struct param_desc *p = &list->p[i];
    char path[PARAM_NAME + 16];
    snprintf(path, sizeof path, "params/%s", p->name + skip);
    if (h5_exists(in, path))
      h5_read_floats(in, path, p->ndim, p->shape, ap.params + p->offset, in_path);
  }
  h5_close(in);

  struct attn_ctx ctx = attention_open(&cfg, v, DEVICE_CPU, NULL, 0,
                                       (struct attn_dims){1, H, n, d, n, 0, ka.causal != 0});
  size_t saved_n = attention_saved_floats(&ctx);
  float *saved = mem_alloc(MEM_ACTIVATIONS, sizeof(float) * (saved_n + 1));
  float *out = mem_alloc(MEM_DATA, sizeof(float) * count),
        *dq = mem_alloc(MEM_DATA, sizeof(float) * qcount);
  float *dk = mem_alloc(MEM_DATA, sizeof(float) * qcount),
        *dv = mem_alloc(MEM_DATA, sizeof(float) * count);
  const float *pp = list->count ? ap.params : NULL;
  double t0 = timer_now();
  attention_forward(&ctx, out, saved, q, k, vv, pp);
  double t1 = timer_now();
  attention_backward(&ctx, dq, dk, dv, list->count ? ap.dparams : NULL, dout, q, k, vv, pp, out,
                     saved);
  double t2 = timer_now();

  hid_t f = h5_create(out_path);
  h5_write_floats(f, "out", 3, dims3, out, false, true);
  h5_write_floats(f, "dq", 3, qdims3, dq, false, true);
  h5_write_floats(f, "dk", 3, qdims3, dk, false, true);
  h5_write_floats(f, "dv", 3, dims3, dv, false, true);
  for (int i = 0; i < list->count; i++) {
    const struct param_desc *p = &list->p[i];
    if (p->frozen) continue; /* fixed tensors (rmfa's random features) have no gradient */
    char path[PARAM_NAME + 16];
    snprintf(path, sizeof path, "dparams/%s", p->name + skip);
    h5_write_floats(f, path, p->ndim, p->shape, ap.dparams + p->offset, false, true);
  }
  h5_attr_string(f, "/", "variant", v->name);
  h5_attr_long(f, "/", "causal", ka.causal);
  h5_attr_string(f, "/", "deck", cfg.resolved);
  h5_attr_string(f, "/", "version", PACKAGE_VERSION);
  h5_attr_double(f, "/", "forward_ms", 1e3 * (t1 - t0));
  h5_attr_double(f, "/", "backward_ms", 1e3 * (t2 - t1));
  h5_close(f);
  printf("fmattn kernel: %s %s, H %ld, n %ld, d %ld: forward %.2f ms, backward %.2f ms -> %s\n",
         v->name, ka.causal ? "causal" : "bidirectional", H, n, d, 1e3 * (t1 - t0), 1e3 * (t2 - t1),
         out_path);

  attention_close(&ctx);
  float *bufs[] = {q, k, vv, dout, saved, out, dq, dk, dv};
  for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) mem_free(bufs[i]);
  attention_params_free(&ap);
  config_free(&cfg);
  return 0;
}
