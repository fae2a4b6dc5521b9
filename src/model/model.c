/* The transformer of model.h: parameter registration (the checkpoint names of SPEC §8.2),
 * initialisation, activation buffers, and the forward and backward passes over the local batch.
 * Per-token layers run on local tokens; attention reaches other ranks only through its ops table.
 * This file must not know any variant by name. */
#include "model/model.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "core/memory.h"
#include "core/timer.h"
#include "nn/layers.h"
#include "parallel/simsample.h"

#include "model/backend.h"

#define INIT_STD 0.02f
/* Rows of the MLP processed at once in backward (and in forward under recomputation). */
#define MODEL_MLP_CHUNK 8192

/* ---------------------------------------------------------------------------------------------
 * parameters */

static int add(struct model *m, const char *name, int ndim, long d0, long d1, bool decay,
               enum init_kind init, float std, int layer) {
  long shape[2] = {d0, d1};
  int i = param_list_add(&m->plist, name, ndim, shape, decay, init, std);
  m->plist.p[i].layer = layer;
  return i;
}

static void register_params(struct model *m) {
  const struct config *cfg = m->cfg;
  char name[PARAM_NAME];
  const float resid_std = INIT_STD / sqrtf(2.0f * (float)m->L);
  param_list_init(&m->plist);
  add(m, "embed/token", 2, m->V, m->C, true, INIT_NORMAL, INIT_STD, -1);
  if (cfg->model.position == POSITION_LEARNED)
    add(m, "embed/position", 2, m->n, m->C, true, INIT_NORMAL, INIT_STD, -1);
  for (int l = 0; l < m->L; l++) {
#define BLOCK(fmt) (snprintf(name, sizeof name, "layer_%03d/" fmt, l), name)
    add(m, BLOCK("norm1/weight"), 1, m->C, 0, false, INIT_ONE, 0, l);
    add(m, BLOCK("norm1/bias"), 1, m->C, 0, false, INIT_ZERO, 0, l);
    add(m, BLOCK("attn/wqkv"), 2, m->QKV, m->C, true, INIT_NORMAL, INIT_STD, l);
    add(m, BLOCK("attn/bqkv"), 1, m->QKV, 0, false, INIT_ZERO, 0, l);
    add(m, BLOCK("attn/wo"), 2, m->C, m->C, true, INIT_NORMAL, resid_std, l);
    add(m, BLOCK("attn/bo"), 1, m->C, 0, false, INIT_ZERO, 0, l);
    attention_register_params(cfg, m->attn, m->n, l, &m->plist);
    add(m, BLOCK("norm2/weight"), 1, m->C, 0, false, INIT_ONE, 0, l);
    add(m, BLOCK("norm2/bias"), 1, m->C, 0, false, INIT_ZERO, 0, l);
    add(m, BLOCK("mlp/w1"), 2, m->R, m->C, true, INIT_NORMAL, INIT_STD, l);
    add(m, BLOCK("mlp/b1"), 1, m->R, 0, false, INIT_ZERO, 0, l);
    add(m, BLOCK("mlp/w2"), 2, m->C, m->R, true, INIT_NORMAL, resid_std, l);
    add(m, BLOCK("mlp/b2"), 1, m->C, 0, false, INIT_ZERO, 0, l);
#undef BLOCK
  }
  add(m, "norm_f/weight", 1, m->C, 0, false, INIT_ONE, 0, -1);
  add(m, "norm_f/bias", 1, m->C, 0, false, INIT_ZERO, 0, -1);
  if (!cfg->model.tie_embeddings)
    add(m, "head/weight", 2, m->V, m->C, true, INIT_NORMAL, INIT_STD, -1);
}

static float *view(struct model *m, float *base, const char *name) {
  int i = param_list_find(&m->plist, name);
  return i < 0 ? NULL : base + m->plist.p[i].offset;
}

static void make_views(struct model *m, float *base, struct model_tensors *t) {
  char name[PARAM_NAME];
  t->token = view(m, base, "embed/token");
  t->position = view(m, base, "embed/position");
  t->lnfw = view(m, base, "norm_f/weight");
  t->lnfb = view(m, base, "norm_f/bias");
  t->head = m->tie_embeddings ? t->token : view(m, base, "head/weight");
  t->block = xcalloc((size_t)m->L, sizeof(struct block_tensors));
  for (int l = 0; l < m->L; l++) {
    struct block_tensors *b = &t->block[l];
#define V(fmt) (snprintf(name, sizeof name, "layer_%03d/" fmt, l), view(m, base, name))
    b->ln1w = V("norm1/weight");
    b->ln1b = V("norm1/bias");
    b->wqkv = V("attn/wqkv");
    b->bqkv = V("attn/bqkv");
    b->wo = V("attn/wo");
    b->bo = V("attn/bo");
    b->ln2w = V("norm2/weight");
    b->ln2b = V("norm2/bias");
    b->w1 = V("mlp/w1");
    b->b1 = V("mlp/b1");
    b->w2 = V("mlp/w2");
    b->b2 = V("mlp/b2");
#undef V
    b->attn = NULL;
    for (int i = 0; i < m->plist.count; i++)
      if (m->plist.p[i].layer == l && m->plist.p[i].owner == 1) {
        b->attn = base + m->plist.p[i].offset; /* the first of the block's variant tensors */
        break;
      }
  }
}

void model_init_params(struct model *m) {
  for (int i = 0; i < m->plist.count; i++)
    attention_init_param(m->cfg, m->attn, &m->plist.p[i], m->host_params + m->plist.p[i].offset);
  model_sync_to_device(m); /* the moments start at zero, on both sides */
}

size_t model_param_count(const struct model *m) {
  size_t total = 0;
  for (int i = 0; i < m->plist.count; i++)
    if (!m->plist.p[i].frozen) total += m->plist.p[i].numel;
  return total;
}

double model_flops_per_token(struct model *m) {
  double matmul = (double)m->V * m->C; /* head (tied or not) */
  for (int l = 0; l < m->L; l++)
    matmul += (double)(m->QKV + m->C) * m->C + 2.0 * m->C * (double)m->R;
  double attn = 0.0;
  for (int l = 0; l < m->L; l++) {
    double p2p;
    attn += m->attn->flops(&m->actx[l], &p2p);
  }
  /* forward: 2 per multiply-add; forward + backward = 3 × forward */
  return 6.0 * matmul + 3.0 * attn / (double)(m->B * m->T);
}

/* ---------------------------------------------------------------------------------------------
 * buffers */

/* A buffer of the model on its back end's device, zeroed. */
static void *buf(const struct model *m, enum mem_label label, size_t bytes) {
  return m->be->alloc(label, bytes);
}
#define act(count) ((float *)buf(m, MEM_ACTIVATIONS, sizeof(float) * (count)))

void model_build(struct model *m, const struct config *cfg, struct comm *comm, long B) {
  char err[256];
  const struct backend *be = backend_for(cfg, err, sizeof err);
  if (!be) error("%s", err);
  model_build_on(m, cfg, comm, B, be);
}

/* The parameters, gradients and AdamW moments (one contiguous buffer each) and their views. */
static void alloc_params(struct model *m) {
  const struct backend *be = m->be;
  register_params(m);
  const size_t total = m->plist.total;
  m->params = buf(m, MEM_PARAMS, sizeof(float) * total);
  m->grads = buf(m, MEM_GRADS, sizeof(float) * total);
  m->m = buf(m, MEM_OPTIMIZER, sizeof(float) * total);
  m->v = buf(m, MEM_OPTIMIZER, sizeof(float) * total);
  /* what host code reads and writes (initialisation, checkpoints): the buffers themselves on a
   * host back end, else host copies that model_sync_* keep in step */
  m->host_params = be->host_visible ? m->params : mem_alloc(MEM_PARAMS, sizeof(float) * total);
  m->host_m = be->host_visible ? m->m : mem_alloc(MEM_OPTIMIZER, sizeof(float) * total);
  m->host_v = be->host_visible ? m->v : mem_alloc(MEM_OPTIMIZER, sizeof(float) * total);
  make_views(m, m->params, &m->P);
  make_views(m, m->grads, &m->G);
  for (int i = 0; i < m->plist.count; i++) /* block 0's variant tensors, padding included */
    if (m->plist.p[i].layer == 0 && m->plist.p[i].owner == 1)
      m->attn_params_per_block =
          m->plist.p[i].offset + m->plist.p[i].numel - (size_t)(m->P.block[0].attn - m->params);
}

/* The batch, the saved activations of every block (or of one, with recomputation), and the
 * activation gradients of one block. */
static void alloc_activations(struct model *m) {
  const struct backend *be = m->be;
  const size_t BT = (size_t)(m->B * m->T), C = (size_t)m->C, R = (size_t)m->R;
  const size_t saved = attention_saved_floats(&m->actx[0]);
  m->tokens = mem_alloc(MEM_ACTIVATIONS, sizeof(int) * BT);
  m->targets = mem_alloc(MEM_ACTIVATIONS, sizeof(int) * BT);
  m->dev_tokens = be->host_visible ? m->tokens : buf(m, MEM_ACTIVATIONS, sizeof(int) * BT);
  m->dev_targets = be->host_visible ? m->targets : buf(m, MEM_ACTIVATIONS, sizeof(int) * BT);
  m->residual = act((size_t)(m->L + 1) * BT * C);
  m->nacts = m->recompute ? 1 : m->L;
  m->acts = xcalloc((size_t)m->nacts, sizeof(struct block_acts));
  for (int a = 0; a < m->nacts; a++) {
    struct block_acts *x = &m->acts[a];
    x->ln1 = act(BT * C);
    x->ln1_mean = act(BT);
    x->ln1_rstd = act(BT);
    if (m->heads_in_place) {
      x->qkv = act(BT * 3 * C);
    } else {
      x->q = act(BT * C);
      x->k = act(BT * C);
      x->v = act(BT * C);
      x->att = act(BT * C);
    }
    x->att_saved = act(saved);
    x->atty = act(BT * C);
    x->res2 = act(BT * C);
    const size_t hid = m->recompute ? (size_t)m->mlp_chunk : BT; /* rows of MLP activations */
    x->ln2 = act(hid * C);
    x->ln2_mean = act(BT);
    x->ln2_rstd = act(BT);
    x->fch = act(hid * R);
    x->fch_gelu = act(hid * R);
  }
  m->lnf = act(BT * C);
  m->lnf_mean = act(BT);
  m->lnf_rstd = act(BT);
  m->logits = act(BT * (size_t)m->V);
  m->qkv = act(BT * 3 * C);
  m->proj = act(BT * C);
  m->dres = act(BT * C);
  /* Gradient buffers that share memory with forward scratch: a layer's forward (or its
   * recomputation) is done with qkv and proj before its backward needs dqkv and dproj. */
  m->dproj = m->proj;
  m->dfch_gelu = act((size_t)m->mlp_chunk * R);
  m->dln = act(BT * C);
  m->dqkv = m->qkv;
  if (!m->heads_in_place) {
    m->dq = act(BT * C);
    m->dk = act(BT * C);
    m->dv = act(BT * C);
    m->datt = act(BT * C);
  }
  m->datty = act(BT * C);
}

static void plan_buckets(struct model *m);

void model_build_on(struct model *m, const struct config *cfg, struct comm *comm, long B,
                    const struct backend *be) {
  memset(m, 0, sizeof *m);
  m->be = be;
  m->cfg = cfg;
  m->comm = comm;
  m->L = cfg->model.layers;
  m->C = cfg->model.dim;
  m->H = cfg->model.heads;
  m->d = m->C / m->H;
  m->V = config_vocab(cfg);
  m->R = cfg->model.mlp_ratio * m->C;
  m->Hqk = attention_qk_heads(cfg);
  m->QKV = (2 * m->Hqk + m->H) * m->d;
  m->n = cfg->model.context;
  m->B = B;
  int S = comm ? comm->S : 1, s = comm ? comm->seq_rank : 0;
  m->T = m->n / S;
  m->t0 = (long)s * m->T;
  m->causal = cfg->model.objective == OBJECTIVE_CLM;
  m->recompute = cfg->train.recompute;
  m->position = cfg->model.position;
  m->tie_embeddings = cfg->model.tie_embeddings;
  m->dropout = (float)cfg->model.dropout;
  m->seed = cfg->run.seed;
  m->mlp_chunk = B * m->T < MODEL_MLP_CHUNK ? B * m->T : MODEL_MLP_CHUNK;
  m->attn = attention_select(cfg);
  if (!m->attn) error("attention variant %s is not available", cfg->attention.variant);
  alloc_params(m);
  m->actx = xcalloc((size_t)m->L, sizeof(struct attn_ctx));
  struct attn_dims dims = {B, m->H, m->T, m->d, m->n, m->t0, m->causal};
  for (int l = 0; l < m->L; l++)
    m->actx[l] = attention_open(cfg, m->attn, be->device, comm, l, dims);
  const char *copies = getenv("FMATTN_HEAD_COPIES");
  m->heads_in_place = m->position != POSITION_ROPE && m->Hqk == m->H &&
                      attention_takes_rows(&m->actx[0]) && !(copies && strcmp(copies, "1") == 0);
  for (int l = 0; l < m->L && m->heads_in_place; l++)
    m->actx[l].rows = (struct attn_rows){3L * m->C, m->C};
  alloc_activations(m);
  m->diag_bands = attention_diag_bands(cfg, m->n);
  m->diag_mass = xcalloc((size_t)(m->L * m->H * m->diag_bands), sizeof(double));
  m->diag_entropy = xcalloc((size_t)(m->L * m->H), sizeof(double));
  if (m->attn->opens && m->attn->opens(cfg)) {
    m->diag_open_mass = xcalloc((size_t)(m->L * m->H), sizeof(double));
    m->diag_opened = xcalloc((size_t)(m->L * m->diag_bands), sizeof(double));
  }
  plan_buckets(m);
}

void model_free(struct model *m) {
  for (int l = 0; l < m->L; l++) attention_close(&m->actx[l]);
  free(m->actx);
  for (int a = 0; a < m->nacts; a++) {
    struct block_acts *x = &m->acts[a];
    float *bufs[] = {x->ln1,      x->ln1_mean, x->ln1_rstd,  x->q,       x->k,    x->v,
                     x->att,      x->qkv,      x->att_saved, x->atty,    x->res2, x->ln2,
                     x->ln2_mean, x->ln2_rstd, x->fch,       x->fch_gelu};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
      if (bufs[i]) m->be->free(bufs[i]);
  }
  free(m->acts);
  float *bufs[] = {m->residual, m->lnf,       m->lnf_mean, m->lnf_rstd, m->logits, m->qkv, m->proj,
                   m->dres,     m->dfch_gelu, m->dln,      m->dq,       m->dk,     m->dv,  m->datt,
                   m->datty,    m->params,    m->grads,    m->m,        m->v};
  for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
    if (bufs[i]) m->be->free(bufs[i]);
  if (!m->be->host_visible) {
    mem_free(m->host_params);
    mem_free(m->host_m);
    mem_free(m->host_v);
    m->be->free(m->dev_tokens);
    m->be->free(m->dev_targets);
  }
  mem_free(m->tokens);
  mem_free(m->targets);
  free(m->P.block);
  free(m->G.block);
  free(m->diag_mass);
  free(m->diag_entropy);
  free(m->diag_open_mass);
  free(m->diag_opened);
  free(m->bucket_lo); /* bucket_hi is its second half */
  free(m->bucket_req);
  param_list_free(&m->plist);
}

void model_zero_grads(struct model *m) { m->be->zero(m->grads, sizeof(float) * m->plist.total); }

/* The buckets of the gradient allreduce: each block's tensors, which register_params lays out
 * contiguously, block after block. Left off (NULL) on one rank, without parallel.overlap, on a
 * transport without non-blocking collectives, or if a block's tensors are not contiguous. */
static void plan_buckets(struct model *m) {
  if (!m->comm || m->comm->world_size < 2 || !m->comm->overlap || !comm_nonblocking(m->comm))
    return;
  size_t *lo = xmalloc(sizeof(size_t) * 2 * (size_t)m->L), *hi = lo + m->L;
  for (int l = 0; l < m->L; l++) lo[l] = SIZE_MAX, hi[l] = 0;
  size_t in_blocks = 0;
  for (int i = 0; i < m->plist.count; i++) {
    const struct param_desc *p = &m->plist.p[i];
    if (p->layer < 0) continue;
    const size_t end = p->offset + param_aligned(p->numel);
    if (p->offset < lo[p->layer]) lo[p->layer] = p->offset;
    if (end > hi[p->layer]) hi[p->layer] = end;
    in_blocks += param_aligned(p->numel);
  }
  bool contiguous = in_blocks == hi[m->L - 1] - lo[0];
  for (int l = 0; l + 1 < m->L; l++) contiguous = contiguous && hi[l] == lo[l + 1];
  if (!contiguous) {
    free(lo);
    return;
  }
  m->bucket_lo = lo;
  m->bucket_hi = hi;
  m->bucket_req = xcalloc((size_t)m->L, sizeof(struct comm_request));
}

/* Block l's backward is done: start summing its gradients, and let the buckets already started
 * progress (MPI moves a non-blocking collective only inside MPI calls). */
static void bucket_start(struct model *m, int l) {
  if (!m->bucket_lo) return;
  comm_iallreduce_sum_float(m->comm, COMM_WORLD, m->grads + m->bucket_lo[l],
                            m->bucket_hi[l] - m->bucket_lo[l], &m->bucket_req[l]);
  for (int j = m->L - 1; j > l; j--) comm_test(&m->bucket_req[j]);
}

void model_allreduce_grads(struct model *m) {
  if (!m->bucket_lo) {
    comm_allreduce_sum_float(m->comm, COMM_WORLD, m->grads, m->plist.total);
    return;
  }
  const size_t first = m->bucket_lo[0], last = m->bucket_hi[m->L - 1];
  comm_allreduce_sum_float(m->comm, COMM_WORLD, m->grads, first);
  comm_allreduce_sum_float(m->comm, COMM_WORLD, m->grads + last, m->plist.total - last);
  for (int l = m->L - 1; l >= 0; l--) comm_wait(&m->bucket_req[l]);
}

void model_poison_grad(struct model *m, float value) {
  m->be->upload(m->grads, &value, sizeof value);
}

void model_sync_to_host(struct model *m) {
  const size_t bytes = sizeof(float) * m->plist.total;
  m->be->download(m->host_params, m->params, bytes);
  m->be->download(m->host_m, m->m, bytes);
  m->be->download(m->host_v, m->v, bytes);
}

void model_sync_to_device(struct model *m) {
  const size_t bytes = sizeof(float) * m->plist.total;
  m->be->upload(m->params, m->host_params, bytes);
  m->be->upload(m->m, m->host_m, bytes);
  m->be->upload(m->v, m->host_v, bytes);
}

/* ---------------------------------------------------------------------------------------------
 * forward */

/* One back-end call timed under its phase (timer.h): bench's per-phase breakdown of a step. On a
 * GPU the phases measure the host's launches, not the kernels (the queue is not drained). In a
 * sampled simulation each call site is a site of its own, charged its measured mean once
 * measured (simsample.h). */
#define PHASE_STR_(x) #x
#define PHASE_STR(x)  PHASE_STR_(x)
#define PHASE(id, call)                                                                    \
  do {                                                                                     \
    timer_start(id);                                                                       \
    struct sim_sample phase_sample_;                                                       \
    if (sim_sample_begin(&phase_sample_, "model.c:" PHASE_STR(__LINE__) " " #call, 1.0)) { \
      call;                                                                                \
      sim_sample_end(&phase_sample_);                                                      \
    }                                                                                      \
    timer_stop(id);                                                                        \
  } while (0)

static struct dropout_key drop_key(const struct model *m, long step, int site, bool train) {
  struct dropout_key k = {m->seed, step, site, 0, m->t0, 0.0f};
  k.sample0 = (long)(m->comm ? m->comm->replica : 0) * m->B;
  k.p = train ? m->dropout : 0.0f;
  return k;
}

static float *stream(const struct model *m, int l) {
  return m->residual + (size_t)l * (size_t)(m->B * m->T) * (size_t)m->C;
}

/* The MLP's hidden activations of rows [r0, r0 + rows): ln2 = LN(res2), fch = ln2·W1ᵀ + b1,
 * fch_gelu = gelu(fch), written from row 0 of the given buffers. */
static void mlp_hidden_forward(struct model *m, const struct block_tensors *w,
                               const struct block_acts *a, long r0, long rows, float *ln2,
                               float *fch, float *fch_gelu) {
  const int C = m->C, R = m->R;
  PHASE(TIMER_NORM, m->be->layernorm_forward(ln2, a->ln2_mean + r0, a->ln2_rstd + r0,
                                             a->res2 + r0 * C, w->ln2w, w->ln2b, rows, C));
  PHASE(TIMER_GEMM, m->be->linear_forward(fch, ln2, w->w1, w->b1, rows, C, R));
  PHASE(TIMER_ACTIVATION, m->be->gelu_forward(fch_gelu, fch, (size_t)rows * R));
}

/* Block l's attention diagnostics (host code) from what its forward left in a: batch element 0's
 * q, k, v and the block's variant parameters, copied to the host first when the back end's
 * buffers are not host memory; their exchanges between ranks go over MPI, on host arrays. */
static void block_diagnostics(struct model *m, int l, const struct block_acts *a) {
  const size_t qk = (size_t)m->Hqk * m->T * m->d, vv = (size_t)m->H * m->T * m->d;
  const size_t np = m->attn_params_per_block;
  const float *q = a->q, *k = a->k, *v = a->v, *params = m->P.block[l].attn;
  float *split = NULL; /* q, k, v by head, where the attention read them in place */
  if (m->heads_in_place) {
    const size_t all = (size_t)(m->B * m->T) * m->C;
    split = buf(m, MEM_WORKSPACE, sizeof(float) * 3 * all);
    m->be->heads_split_forward(split, split + all, split + 2 * all, a->qkv, m->B, m->T, m->Hqk,
                               m->H, m->d);
    q = split, k = split + all, v = split + 2 * all;
  }
  struct attn_rows rows = m->actx[l].rows; /* the diagnostics read by head */
  m->actx[l].rows = (struct attn_rows){0, 0};
  float *host = NULL;
  if (!m->be->host_visible) {
    host = mem_alloc(MEM_WORKSPACE, sizeof(float) * (2 * qk + vv + np + 1));
    m->be->download(host, a->q, sizeof(float) * qk);
    m->be->download(host + qk, a->k, sizeof(float) * qk);
    m->be->download(host + 2 * qk, a->v, sizeof(float) * vv);
    if (params) m->be->download(host + 2 * qk + vv, params, sizeof(float) * np);
    q = host, k = host + qk, v = host + 2 * qk, params = params ? host + 2 * qk + vv : NULL;
  }
  const struct comm_transport *transport = comm_host_begin(m->comm);
  struct attn_ctx *ctx = &m->actx[l];
  if (m->diag_open_mass)
    ctx->open_diag = (struct attn_open_diag){m->diag_open_mass + (size_t)l * m->H,
                                             m->diag_opened + (size_t)l * m->diag_bands};
  m->diag_queries = m->attn->diagnostics(ctx, m->diag_mass + (size_t)l * m->H * m->diag_bands,
                                         m->diag_entropy + (size_t)l * m->H, q, k, v, params);
  ctx->open_diag = (struct attn_open_diag){NULL, NULL};
  comm_host_end(m->comm, transport);
  mem_free(host);
  ctx->rows = rows;
  if (split) m->be->free(split);
}

/* Block l's forward from residual[l], leaving its activations in a and, when write_out, its
 * output in residual[l+1] (a recompute in backward needs only the saved activations). */
static void block_forward(struct model *m, int l, struct block_acts *a, long step, bool train,
                          bool write_out) {
  const long B = m->B, T = m->T, N = B * T;
  const int C = m->C, H = m->H, d = m->d, R = m->R;
  const struct block_tensors *w = &m->P.block[l];
  const float *x = stream(m, l);

  PHASE(TIMER_NORM,
        m->be->layernorm_forward(a->ln1, a->ln1_mean, a->ln1_rstd, x, w->ln1w, w->ln1b, N, C));
  if (m->heads_in_place) { /* q, k, v read from the product, the output written as atty */
    PHASE(TIMER_GEMM, m->be->linear_forward(a->qkv, a->ln1, w->wqkv, w->bqkv, N, C, m->QKV));
  } else {
    PHASE(TIMER_GEMM, m->be->linear_forward(m->qkv, a->ln1, w->wqkv, w->bqkv, N, C, m->QKV));
    PHASE(TIMER_COPY, m->be->heads_split_forward(a->q, a->k, a->v, m->qkv, B, T, m->Hqk, H, d));
  }
  if (m->position == POSITION_ROPE) {
    PHASE(TIMER_COPY, m->be->rope_forward(a->q, B * m->Hqk, T, d, m->t0));
    PHASE(TIMER_COPY, m->be->rope_forward(a->k, B * m->Hqk, T, d, m->t0));
  }
  timer_start(TIMER_ATTENTION);
  struct attn_ctx *ctx = &m->actx[l];
  ctx->step = step; /* the keys of any noise the variant draws (FiSH), the same in backward */
  ctx->train = train;
  ctx->sample0 = (long)(m->comm ? m->comm->replica : 0) * m->B;
  ctx->backward_next = !write_out; /* the recomputation: this block's backward comes next */
  if (m->heads_in_place)
    attention_forward(ctx, a->atty, a->att_saved, a->qkv, a->qkv + C, a->qkv + 2 * C, w->attn);
  else
    attention_forward(ctx, a->att, a->att_saved, a->q, a->k, a->v, w->attn);
  if (m->diag_request && m->attn->diagnostics) block_diagnostics(m, l, a);
  timer_stop(TIMER_ATTENTION);
  if (!m->heads_in_place)
    PHASE(TIMER_COPY, m->be->heads_merge_forward(a->atty, a->att, B, T, H, d));
  PHASE(TIMER_GEMM, m->be->linear_forward(m->proj, a->atty, w->wo, w->bo, N, C, C));
  struct dropout_key k1 = drop_key(m, step, 1 + 2 * l, train);
  PHASE(TIMER_DROPOUT, m->be->residual_dropout_forward(a->res2, x, m->proj, &k1, B, T, C));
  if (m->recompute && !write_out) return; /* backward recomputes the MLP chunk by chunk */
  /* The MLP is per token and runs in row chunks: with recomputation its R-wide activations exist
   * for one chunk only (a long slab would otherwise hold 3 of them for every token); without it
   * they are kept whole, but chunked the same way, so both modes round alike (a GEMM's rounding
   * can depend on how many rows it is given). */
  const long chunk = m->mlp_chunk;
  for (long r0 = 0; r0 < N; r0 += chunk) {
    const long rows = N - r0 < chunk ? N - r0 : chunk;
    const long o = m->recompute ? 0 : r0;
    mlp_hidden_forward(m, w, a, r0, rows, a->ln2 + o * C, a->fch + o * R, a->fch_gelu + o * R);
    PHASE(TIMER_GEMM,
          m->be->linear_forward(m->proj + r0 * C, a->fch_gelu + o * R, w->w2, w->b2, rows, R, C));
  }
  struct dropout_key k2 = drop_key(m, step, 2 + 2 * l, train);
  PHASE(TIMER_DROPOUT,
        m->be->residual_dropout_forward(stream(m, l + 1), a->res2, m->proj, &k2, B, T, C));
}

/* Embedding, blocks, final norm and head: logits (B,T,V) of the local tokens. */
static void forward_logits(struct model *m, long step, bool train) {
  const long B = m->B, T = m->T, N = B * T;
  const int C = m->C;
  m->last_train = train;
  float *x0 = stream(m, 0);
  /* the batch's one upload (a no-op on a host back end); backward reuses it */
  m->be->upload(m->dev_tokens, m->tokens, sizeof(int) * (size_t)N);
  m->be->upload(m->dev_targets, m->targets, sizeof(int) * (size_t)N);
  PHASE(TIMER_COPY,
        m->be->embedding_forward(x0, m->dev_tokens, m->P.token, m->P.position, B, T, C, m->t0));
  if (m->position == POSITION_SINUSOIDAL)
    PHASE(TIMER_COPY, m->be->sinusoidal_forward(x0, B, T, C, m->t0, INIT_STD * sqrtf(2.0f)));
  struct dropout_key k0 = drop_key(m, step, 0, train);
  PHASE(TIMER_DROPOUT, m->be->dropout_forward(x0, &k0, B, T, C));
  if (m->diag_request) {
    memset(m->diag_mass, 0, sizeof(double) * (size_t)(m->L * m->H * m->diag_bands));
    memset(m->diag_entropy, 0, sizeof(double) * (size_t)(m->L * m->H));
    if (m->diag_open_mass) {
      memset(m->diag_open_mass, 0, sizeof(double) * (size_t)(m->L * m->H));
      memset(m->diag_opened, 0, sizeof(double) * (size_t)(m->L * m->diag_bands));
    }
    m->diag_queries = 0;
  }
  for (int l = 0; l < m->L; l++)
    block_forward(m, l, &m->acts[m->recompute ? 0 : l], step, train, true);
  m->diag_request = false;
  PHASE(TIMER_NORM, m->be->layernorm_forward(m->lnf, m->lnf_mean, m->lnf_rstd, stream(m, m->L),
                                             m->P.lnfw, m->P.lnfb, N, C));
  PHASE(TIMER_GEMM, m->be->linear_forward(m->logits, m->lnf, m->P.head, NULL, N, C, m->V));
}

void model_forward_logits(struct model *m) {
  timer_start(TIMER_FORWARD);
  forward_logits(m, 0, false);
  timer_stop(TIMER_FORWARD);
}

double model_forward(struct model *m, long step, bool train, float grad_scale, long *count) {
  timer_start(TIMER_FORWARD);
  forward_logits(m, step, train);
  const long N = m->B * m->T;
  long cnt = 0;
  for (long i = 0; i < N; i++) cnt += m->targets[i] >= 0;
  *count = cnt;
  timer_start(TIMER_LOSS);
  double loss = m->be->softmax_xent_forward_backward(m->logits, m->dev_targets, N, m->V, grad_scale,
                                                     m->row_loss, m->row_pred);
  timer_stop(TIMER_LOSS);
  timer_stop(TIMER_FORWARD);
  return loss;
}

/* ---------------------------------------------------------------------------------------------
 * backward */

#define zero(p, count) PHASE(TIMER_COPY, m->be->zero((p), sizeof(float) * (count)))

void model_backward(struct model *m, long step) {
  timer_start(TIMER_BACKWARD);
  const long B = m->B, T = m->T, N = B * T;
  const int C = m->C, H = m->H, d = m->d, R = m->R;
  const size_t NC = (size_t)N * C;

  /* head and final norm */
  PHASE(TIMER_GEMM,
        m->be->linear_backward(m->dln, m->G.head, NULL, m->logits, m->lnf, m->P.head, N, C, m->V));
  /* the residual stream's gradient, one buffer that each block's two branches add into in place */
  float *dres = m->dres;
  zero(dres, NC);
  PHASE(TIMER_NORM, m->be->layernorm_backward(dres, m->G.lnfw, m->G.lnfb, m->dln, stream(m, m->L),
                                              m->P.lnfw, m->lnf_mean, m->lnf_rstd, N, C));

  for (int l = m->L - 1; l >= 0; l--) {
    struct block_acts *a = &m->acts[m->recompute ? 0 : l];
    if (m->recompute) block_forward(m, l, a, step, m->last_train, false);
    const struct block_tensors *w = &m->P.block[l];
    struct block_tensors *g = &m->G.block[l];
    const float *x = stream(m, l);

    /* MLP half: residual[l+1] = res2 + dropout(fc2(gelu(fc1(ln2(res2))))) */
    struct dropout_key k2 = drop_key(m, step, 2 + 2 * l, m->last_train);
    PHASE(TIMER_DROPOUT, m->be->residual_dropout_backward(dres, m->dproj, dres, &k2, B, T, C));
    /* in row chunks in both modes, so parameter gradients sum in the same order whether the
     * activations were kept or are recomputed here */
    for (long r0 = 0; r0 < N; r0 += m->mlp_chunk) {
      const long rows = N - r0 < m->mlp_chunk ? N - r0 : m->mlp_chunk;
      const long o = m->recompute ? 0 : r0;
      float *ln2 = a->ln2 + o * C, *fch = a->fch + o * R, *fch_gelu = a->fch_gelu + o * R;
      if (m->recompute) mlp_hidden_forward(m, w, a, r0, rows, ln2, fch, fch_gelu);
      PHASE(TIMER_GEMM, m->be->linear_backward(m->dfch_gelu, g->w2, g->b2, m->dproj + r0 * C,
                                               fch_gelu, w->w2, rows, R, C));
      /* the gradient of fch over that of fch_gelu, in place: the pass reads and writes one
       * buffer, which the product above has just written, where a third would stream */
      float *dfch = m->dfch_gelu;
      PHASE(TIMER_ACTIVATION, m->be->gelu_backward(dfch, dfch, fch, (size_t)rows * R));
      PHASE(TIMER_GEMM,
            m->be->linear_backward(m->dln + r0 * C, g->w1, g->b1, dfch, ln2, w->w1, rows, C, R));
      PHASE(TIMER_NORM, m->be->layernorm_backward(dres + r0 * C, g->ln2w, g->ln2b, m->dln + r0 * C,
                                                  a->res2 + r0 * C, w->ln2w, a->ln2_mean + r0,
                                                  a->ln2_rstd + r0, rows, C));
    }

    /* attention half: res2 = x + dropout(wo(attn(ln1(x)))) */
    struct dropout_key k1 = drop_key(m, step, 1 + 2 * l, m->last_train);
    PHASE(TIMER_DROPOUT, m->be->residual_dropout_backward(dres, m->dproj, dres, &k1, B, T, C));
    PHASE(TIMER_GEMM,
          m->be->linear_backward(m->datty, g->wo, g->bo, m->dproj, a->atty, w->wo, N, C, C));
    if (m->heads_in_place) { /* the gradients of q, k, v written into dqkv, read from datty */
      timer_start(TIMER_ATTENTION);
      attention_backward(&m->actx[l], m->dqkv, m->dqkv + C, m->dqkv + 2 * C, g->attn, m->datty,
                         a->qkv, a->qkv + C, a->qkv + 2 * C, w->attn, a->atty, a->att_saved);
      timer_stop(TIMER_ATTENTION);
    } else {
      PHASE(TIMER_COPY, m->be->heads_merge_backward(m->datt, m->datty, B, T, H, d));
      zero(m->dq, NC);
      zero(m->dk, NC);
      zero(m->dv, NC);
      timer_start(TIMER_ATTENTION);
      attention_backward(&m->actx[l], m->dq, m->dk, m->dv, g->attn, m->datt, a->q, a->k, a->v,
                         w->attn, a->att, a->att_saved);
      timer_stop(TIMER_ATTENTION);
    }
    if (m->position == POSITION_ROPE) {
      PHASE(TIMER_COPY, m->be->rope_backward(m->dq, B * m->Hqk, T, d, m->t0));
      PHASE(TIMER_COPY, m->be->rope_backward(m->dk, B * m->Hqk, T, d, m->t0));
    }
    if (!m->heads_in_place)
      PHASE(TIMER_COPY,
            m->be->heads_split_backward(m->dqkv, m->dq, m->dk, m->dv, B, T, m->Hqk, H, d));
    PHASE(TIMER_GEMM,
          m->be->linear_backward(m->dln, g->wqkv, g->bqkv, m->dqkv, a->ln1, w->wqkv, N, C, m->QKV));
    PHASE(TIMER_NORM, m->be->layernorm_backward(dres, g->ln1w, g->ln1b, m->dln, x, w->ln1w,
                                                a->ln1_mean, a->ln1_rstd, N, C));
    bucket_start(m, l);
  }

  struct dropout_key k0 = drop_key(m, step, 0, m->last_train);
  PHASE(TIMER_DROPOUT, m->be->dropout_backward(dres, &k0, B, T, C));
  PHASE(TIMER_COPY, m->be->embedding_backward(m->G.token, m->G.position, dres, m->dev_tokens, B, T,
                                              C, m->V, m->t0));
  timer_stop(TIMER_BACKWARD);
}

/* ---------------------------------------------------------------------------------------------
 * incremental decoding */

bool model_decode_open(struct model *m, struct model_decoder *dec) {
  memset(dec, 0, sizeof *dec);
  if (!m->attn->decode_open) return false;
  const size_t C = (size_t)m->C, R = (size_t)m->R;
  dec->cache = xcalloc((size_t)m->L, sizeof(void *));
  for (int l = 0; l < m->L; l++)
    dec->cache[l] = m->attn->decode_open(&m->actx[l], m->P.block[l].attn);
  float *p = mem_alloc(MEM_ACTIVATIONS, sizeof(float) * (8 * C + 2 * (size_t)m->QKV + 2 * R + 2));
  dec->x = p, p += C;
  dec->ln = p, p += C;
  dec->qkv = p, p += m->QKV;
  dec->q = p, p += m->QKV; /* q, k, v of the token: Hqk·d, Hqk·d, C */
  dec->k = dec->q + (size_t)m->Hqk * m->d;
  dec->v = dec->k + (size_t)m->Hqk * m->d;
  dec->att = p, p += C;
  dec->proj = p, p += C;
  dec->res2 = p, p += C;
  dec->fch = p, p += R;
  dec->fchg = p, p += R;
  dec->mean = p, p += 1;
  dec->rstd = p;
  return true;
}

void model_decode_step(struct model *m, struct model_decoder *dec, int token, long pos,
                       float *logits) {
  const int C = m->C, H = m->H, d = m->d, R = m->R;
  embedding_forward(dec->x, &token, m->P.token, m->P.position, 1, 1, C, pos);
  if (m->position == POSITION_SINUSOIDAL)
    sinusoidal_forward(dec->x, 1, 1, C, pos, INIT_STD * sqrtf(2.0f));
  for (int l = 0; l < m->L; l++) { /* as block_forward, one token, dropout off */
    const struct block_tensors *w = &m->P.block[l];
    struct attn_ctx *ctx = &m->actx[l];
    layernorm_forward(dec->ln, dec->mean, dec->rstd, dec->x, w->ln1w, w->ln1b, 1, C);
    linear_forward(dec->qkv, dec->ln, w->wqkv, w->bqkv, 1, C, m->QKV);
    heads_split_forward(dec->q, dec->k, dec->v, dec->qkv, 1, 1, m->Hqk, H, d);
    if (m->position == POSITION_ROPE) {
      rope_forward(dec->q, m->Hqk, 1, d, pos);
      rope_forward(dec->k, m->Hqk, 1, d, pos);
    }
    ctx->train = false;
    m->attn->decode_step(ctx, dec->cache[l], dec->att, dec->q, dec->k, dec->v, pos, w->attn);
    linear_forward(dec->proj, dec->att, w->wo, w->bo, 1, C, C); /* (H, 1, d) is (1, C) */
    for (int c = 0; c < C; c++) dec->res2[c] = dec->x[c] + dec->proj[c];
    layernorm_forward(dec->ln, dec->mean, dec->rstd, dec->res2, w->ln2w, w->ln2b, 1, C);
    linear_forward(dec->fch, dec->ln, w->w1, w->b1, 1, C, R);
    gelu_forward(dec->fchg, dec->fch, (size_t)R);
    linear_forward(dec->proj, dec->fchg, w->w2, w->b2, 1, R, C);
    for (int c = 0; c < C; c++) dec->x[c] = dec->res2[c] + dec->proj[c];
  }
  layernorm_forward(dec->ln, dec->mean, dec->rstd, dec->x, m->P.lnfw, m->P.lnfb, 1, C);
  linear_forward(logits, dec->ln, m->P.head, NULL, 1, C, m->V);
}

void model_decode_close(struct model *m, struct model_decoder *dec) {
  if (!dec->cache) return;
  for (int l = 0; l < m->L; l++) m->attn->decode_close(dec->cache[l]);
  free(dec->cache);
  mem_free(dec->x);
  memset(dec, 0, sizeof *dec);
}
