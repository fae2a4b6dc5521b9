/* `fmattn kernel IN.h5 OUT.h5` (SPEC §8.3), one rank: one attention op forward and backward on
 * tensors a user supplies, so any prototype can be checked against fmattn. IN: q, k, v, dout
 * (H, n, d), optional params/<name> below attn/<variant>/ (a frozen tensor such as rmfa's omega
 * may carry its own draw), attributes variant, causal and the variant keys without prefix; OUT:
 * out, dq, dk, dv, dparams/<name> of the trainable parameters and diagnostics/. */
#include "run/kernel_file.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attention/attention.h"
#include "core/error.h"
#include "core/h5io.h"
#include "core/memory.h"
#include "core/timer.h"
#include "deck/config.h"

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

/* The deck of the op: the variant, objective and sizes, and every other attribute as a key below
 * [attention] — by the variant's key prefix (fma_linear's are fma.*), or its FiSH form's
 * (fish.*); heads_mode is attention's own. Refused as a deck would be. */
static void kernel_config(const struct kernel_attrs *ka, long H, long n, long d,
                          struct config *cfg) {
  const struct attn_variant *named = attention_find(ka->variant);
  const char *prefix = named && named->keys_prefix ? named->keys_prefix : ka->variant;
  const char *fish = named && named->fish ? named->fish->keys_prefix : NULL;
  char items[KERNEL_MAX_KEYS + 6][200];
  struct config_overrides ov = {0};
  snprintf(items[0], sizeof items[0], "attention.variant=%s", ka->variant);
  snprintf(items[1], sizeof items[1], "model.objective=%s", ka->causal ? "clm" : "mlm");
  snprintf(items[2], sizeof items[2], "model.context=%ld", n);
  snprintf(items[3], sizeof items[3], "model.heads=%ld", H);
  snprintf(items[4], sizeof items[4], "model.dim=%ld", H * d);
  snprintf(items[5], sizeof items[5], "data.source=copy");
  int ni = 6;
  for (int i = 0; i < ka->count; i++) {
    const char *key = ka->items[i];
    const int klen = (int)strcspn(key, "=");
    char name[200];
    snprintf(name, sizeof name, "attention.%.*s", klen, key);
    const char *group = config_key_exists(name) ? NULL : prefix;
    snprintf(name, sizeof name, "attention.%s.%.*s", fish ? fish : "", klen, key);
    if (group && fish && config_key_exists(name)) group = fish;
    int len = group ? snprintf(items[ni++], sizeof items[0], "attention.%s.%s", group, key)
                    : snprintf(items[ni++], sizeof items[0], "attention.%s", key);
    if (len >= (int)sizeof items[0]) error("%s: attribute %s is too long", ka->path, key);
  }
  for (int i = 0; i < ni; i++) ov.items[ov.count++] = items[i];
  char err[1024];
  if (config_load(cfg, NULL, &ov, err, sizeof err)) error("%s: %s", ka->path, err);
  if (attention_check(cfg, n, 1, err, sizeof err)) error("%s: %s", ka->path, err);
}

/* The name of parameter p relative to attn/<variant>/ (what params/ and dparams/ hold). */
static const char *relative_name(const struct attn_variant *v, const struct param_desc *p) {
  return p->name + strlen("layer_000/attn/") + strlen(v->params_name ? v->params_name : v->name) +
         1;
}

/* A frozen tensor the file gives with another shape (its own random-feature draw): the variant
 * adopts it into cfg, or the file is refused. */
static void adopt_file_shapes(hid_t in, struct config *cfg, const struct attn_variant *v, long n,
                              const char *in_path) {
  struct param_list list;
  param_list_init(&list);
  attention_register_params(cfg, v, n, 0, &list);
  for (int i = 0; i < list.count; i++) {
    const struct param_desc *p = &list.p[i];
    char path[PARAM_NAME + 16];
    long shape[PARAM_MAXDIM];
    snprintf(path, sizeof path, "params/%s", relative_name(v, p));
    if (!p->frozen || !h5_exists(in, path)) continue;
    const int ndim = h5_dataset_shape(in, path, shape, PARAM_MAXDIM);
    bool same = ndim == p->ndim;
    for (int k = 0; same && k < ndim; k++) same = shape[k] == p->shape[k];
    if (!same && !(v->adopt_shape && v->adopt_shape(cfg, relative_name(v, p), ndim, shape)))
      error("%s: %s does not have the shape %s needs", in_path, path, v->name);
  }
  param_list_free(&list);
}

/* The op's parameters: initialised as in training, then replaced by those the file gives. */
static void kernel_params(hid_t in, struct config *cfg, const struct attn_variant *v, long n,
                          const char *in_path, struct attn_params *ap) {
  adopt_file_shapes(in, cfg, v, n, in_path);
  attention_params_make(ap, cfg, v, n);
  for (int i = 0; i < ap->list.count; i++) {
    const struct param_desc *p = &ap->list.p[i];
    char path[PARAM_NAME + 16];
    snprintf(path, sizeof path, "params/%s", relative_name(v, p));
    if (h5_exists(in, path))
      h5_read_floats(in, path, p->ndim, p->shape, ap->params + p->offset, in_path);
  }
}

/* The op's tensors, as one block: q, k (Hq, n, d); v, dout, out, dv (H, n, d); dq, dk. */
struct kernel_tensors {
  float *q, *k, *v, *dout, *out, *dq, *dk, *dv;
};

/* The attention diagnostics of the op (SPEC §8.1's, for this one op; when the variant has them):
 * diagnostics/level_mass [H, bands] and entropy [H] averaged over queries; with fma.open also
 * open_mass [H] and opened [levels] (windows opened per query and head at levels 1 .. L). */
static void write_diagnostics(hid_t f, struct attn_ctx *ctx, const struct kernel_tensors *x,
                              const float *params, long H, long n) {
  const struct attn_variant *v = ctx->variant;
  if (!v->diagnostics) return;
  const int bands = ctx->opt.diag_bands;
  double *mass = xcalloc((size_t)(H * bands), sizeof(double));
  double *entropy = xcalloc((size_t)H, sizeof(double));
  double *open_mass = xcalloc((size_t)H, sizeof(double));
  double *opened = xcalloc((size_t)bands, sizeof(double));
  const bool opens = ctx->opt.opens;
  if (opens) ctx->open_diag = (struct attn_open_diag){open_mass, opened};
  const double q = (double)v->diagnostics(ctx, mass, entropy, x->q, x->k, x->v, params);
  ctx->open_diag = (struct attn_open_diag){NULL, NULL};
  for (long i = 0; i < H * bands; i++) mass[i] /= q;
  for (long h = 0; h < H; h++) entropy[h] /= q, open_mass[h] /= q;
  for (int b = 1; b < bands; b++) opened[b] /= q * (double)H;
  const long ms[2] = {H, bands}, hs[1] = {H}, ls[1] = {bands - 1};
  h5_write_doubles(f, "diagnostics/level_mass", 2, ms, mass,
                   "share of attention probability on [near field, level 1, ..., level L], "
                   "averaged over queries");
  h5_write_doubles(f, "diagnostics/entropy", 1, hs, entropy,
                   "nats: entropy of the attention distribution, averaged over queries");
  if (opens) {
    h5_write_doubles(f, "diagnostics/open_mass", 1, hs, open_mass,
                     "share of attention probability on opened exact tokens, averaged over "
                     "queries");
    if (bands > 1)
      h5_write_doubles(f, "diagnostics/opened", 1, ls, opened + 1,
                       "windows opened per query at [level 1, ..., level L], averaged over "
                       "queries and heads");
  }
  free(mass);
  free(entropy);
  free(open_mass);
  free(opened);
}

static void write_outputs(const char *out_path, const struct kernel_tensors *x,
                          const struct attn_params *ap, const struct attn_variant *v,
                          const struct config *cfg, const long *dims3, const long *qdims3,
                          int causal, double fwd_ms, double bwd_ms, struct attn_ctx *ctx) {
  hid_t f = h5_create(out_path);
  h5_write_floats(f, "out", 3, dims3, x->out, false, true);
  h5_write_floats(f, "dq", 3, qdims3, x->dq, false, true);
  h5_write_floats(f, "dk", 3, qdims3, x->dk, false, true);
  h5_write_floats(f, "dv", 3, dims3, x->dv, false, true);
  for (int i = 0; i < ap->list.count; i++) {
    const struct param_desc *p = &ap->list.p[i];
    if (p->frozen) continue; /* fixed tensors (rmfa's random features) have no gradient */
    char path[PARAM_NAME + 16];
    snprintf(path, sizeof path, "dparams/%s", relative_name(v, p));
    h5_write_floats(f, path, p->ndim, p->shape, ap->dparams + p->offset, false, true);
  }
  write_diagnostics(f, ctx, x, ap->list.count ? ap->params : NULL, dims3[0], dims3[1]);
  h5_attr_string(f, "/", "variant", v->name);
  h5_attr_long(f, "/", "causal", causal);
  h5_attr_string(f, "/", "deck", cfg->resolved);
  h5_attr_string(f, "/", "version", PACKAGE_VERSION);
  h5_attr_double(f, "/", "forward_ms", fwd_ms);
  h5_attr_double(f, "/", "backward_ms", bwd_ms);
  h5_close(f);
}

int kernel_file_run(const char *in_path, const char *out_path) {
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
  struct config cfg;
  kernel_config(&ka, H, n, d, &cfg);
  const struct attn_variant *v = attention_select(&cfg);
  if (Hq != attention_qk_heads(&cfg))
    error("%s: q and k have %ld heads, but %s needs %d (v has %ld)", in_path, Hq, v->name,
          attention_qk_heads(&cfg), H);

  const size_t count = (size_t)(H * n * d), qcount = (size_t)(Hq * n * d);
  const long dims3[3] = {H, n, d}, qdims3[3] = {Hq, n, d};
  float *all = mem_alloc(MEM_DATA, sizeof(float) * (4 * qcount + 4 * count));
  struct kernel_tensors x = {.q = all, .k = all + qcount, .v = all + 2 * qcount};
  x.dout = x.v + count, x.out = x.dout + count, x.dv = x.out + count, x.dq = x.dv + count;
  x.dk = x.dq + qcount;
  h5_read_floats(in, "q", 3, qdims3, x.q, in_path);
  h5_read_floats(in, "k", 3, qdims3, x.k, in_path);
  h5_read_floats(in, "v", 3, dims3, x.v, in_path);
  h5_read_floats(in, "dout", 3, dims3, x.dout, in_path);
  struct attn_params ap;
  kernel_params(in, &cfg, v, n, in_path, &ap);
  h5_close(in);

  struct attn_ctx ctx = attention_open(&cfg, v, DEVICE_CPU, NULL, 0,
                                       (struct attn_dims){1, H, n, d, n, 0, ka.causal != 0});
  float *saved = mem_alloc(MEM_ACTIVATIONS, sizeof(float) * (attention_saved_floats(&ctx) + 1));
  const float *pp = ap.list.count ? ap.params : NULL;
  const double t0 = timer_now();
  attention_forward(&ctx, x.out, saved, x.q, x.k, x.v, pp);
  const double t1 = timer_now();
  attention_backward(&ctx, x.dq, x.dk, x.dv, ap.list.count ? ap.dparams : NULL, x.dout, x.q, x.k,
                     x.v, pp, x.out, saved);
  const double t2 = timer_now();
  write_outputs(out_path, &x, &ap, v, &cfg, dims3, qdims3, ka.causal, 1e3 * (t1 - t0),
                1e3 * (t2 - t1), &ctx);
  printf("fmattn kernel: %s %s, H %ld, n %ld, d %ld: forward %.2f ms, backward %.2f ms -> %s\n",
         v->name, ka.causal ? "causal" : "bidirectional", H, n, d, 1e3 * (t1 - t0), 1e3 * (t2 - t1),
         out_path);
  attention_close(&ctx);
  mem_free(saved);
  mem_free(all);
  attention_params_free(&ap);
  config_free(&cfg);
  return 0;
}
