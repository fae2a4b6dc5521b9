// `fma` and `fma_linear` on the GPU (struct attn_impl), the twin of src/attention/fma.c: the
// variant's host state and lists as device tables (fma_lists.cu), the upward pass (fma_upward.cu),
// the locally essential tree over the device transport (fma_let.cu), evaluation in chunks
// (fma_evaluate.cu, fma_linear.cu); backward recomputes the summaries as the CPU does.
#include <cstdio>
#include <cstring>
#include <string>

#include <cuda_bf16.h>

#include "check.h"
#include "fma_gpu.h"
#include "gpu.h"

namespace {

int nsets(const gfma *g) { return g->linear ? 3 : 2; }

void *fma_open(const struct attn_ctx *ctx) {
  auto *g = new gfma();
  auto *st = static_cast<fma_state *>(ctx->state);
  if (st->open.K == 0) fma_state_compact(st);  // O(n/S) summary rows, as the CPU's
  g->st = st;
  g->linear = st->linear;
  g->causal = st->causal;
  g->copies = gpu_bf16();
  g->B = ctx->dims.B;
  g->H = ctx->dims.H;
  g->BH = g->B * g->H;
  g->T = st->T;
  g->d = st->d;
  g->m = st->tree.m;
  g->p = st->tree.p;
  g->L = st->tree.levels;
  g->ns = g->nlist = st->causal ? 2 : 3;
  g->b0 = st->t0 / g->m;
  g->nbs = g->T / g->m;
  g->nb = st->tree.nblocks;
  gfma_tables_build(g);
  gfma_avg_build(g);
  return g;
}

void fma_close(void *impl_state) {
  auto *g = static_cast<gfma *>(impl_state);
  if (!g) return;
  gfma_tables_free(g);
  gfma_avg_free(g);
  gfma_let_close(g->let);
  delete g;
}

// The saved state: lse (BH·T) and fma_linear's lse_far (BH·rows), as the CPU saves; with bf16
// products when the context opened (g->copies) then, from a 256-byte boundary, the bf16 copies
// of q, k, v (BH·T·d each) that forward made (the upward pass's transposes write k's and v's)
// and backward reads: nothing is converted twice. (A context opened in fp32 and run in bf16,
// as a test may, has no room for them: its evaluation copies what it reads, as it did before.)
size_t state_floats(const struct attn_ctx *ctx) {
  const auto *st = static_cast<const fma_state *>(ctx->state);
  const size_t BH = (size_t)(ctx->dims.B * ctx->dims.H);
  return BH * (size_t)st->T + (st->linear ? BH * (size_t)st->rows : 0);
}

size_t copies_at(const struct attn_ctx *ctx) { return (state_floats(ctx) + 63) / 64 * 64; }

size_t fma_saved_floats(const struct attn_ctx *ctx) {
  if (!static_cast<const gfma *>(ctx->impl_state)->copies) return state_floats(ctx);
  const auto *st = static_cast<const fma_state *>(ctx->state);
  const size_t n = (size_t)(ctx->dims.B * ctx->dims.H) * (size_t)st->T * (size_t)st->d;
  return copies_at(ctx) + (3 * n + 1) / 2;
}

// The bf16 copies in the saved state (all null with fp32 products, or without room for them).
struct copies {
  __nv_bfloat16 *x[FMA_NSETS];  // k, v, q: fma_set's order
  size_t n;                     // elements each
};

copies copies_of(const struct attn_ctx *ctx, const gfma *g, const float *saved) {
  copies c = {};
  if (!g->copies || !gpu_bf16()) return c;
  c.n = (size_t)(g->BH * g->T * g->d);
  auto *base = reinterpret_cast<__nv_bfloat16 *>(const_cast<float *>(saved) + copies_at(ctx));
  for (int s = 0; s < FMA_NSETS; s++) c.x[s] = base + s * c.n;
  return c;
}

// What evaluate reads, as attention/fma.c's struct fma_inputs: the weights and summaries of every
// set, and the keys and values from global row klo (the slab, or the halo copies).
struct inputs {
  gfma_weights w[FMA_NSETS];
  float *X[FMA_NSETS]; /* (d·BH·rows) each, gfma_levels' layout */
  const float *k, *v;
  float *kx, *vx;
  long klo, kstride;
};

// The sequence group, when there is one: its LET planned once per layer (on the host, by
// src/fma/let.c) and its lists uploaded. The exchanges move device buffers, so the transport
// must be the device's (NCCL: gpu_comm_attach).
struct comm *sequence_group(struct attn_ctx *ctx, gfma *g) {
  struct comm *c = ctx->comm;
  if (!c || c->S == 1) return nullptr;
  if (!c->transport || strcmp(c->transport->name, "nccl") != 0)
    error_at(__FILE__, __func__, __LINE__,
             "attention.variant = %s on the GPU with parallel.seq_ranks = %d needs the NCCL "
             "transport on device buffers (gpu_comm_attach), not %s",
             ctx->variant->name, c->S, c->transport ? c->transport->name : "none");
  auto *st = static_cast<fma_state *>(ctx->state);
  if (!st->let) {  // as attention/fma.c's prepare: planned once per layer
    st->let = fma_let_plan(st, c);
    st->klo = st->let->near.lo;
  }
  if (!g->let) g->let = gfma_let_open(g, c);
  return c;
}

float *device_floats(size_t n) {
  return static_cast<float *>(gpu_alloc(MEM_WORKSPACE, sizeof(float) * (n + 1)));
}

// The upward pass of each set, then (under sequence parallelism) the LET and the halo. With bf16
// products forward (make) fills the bf16 copies of q, k, v, and backward reads them.
void prepare(struct attn_ctx *ctx, gfma *g, inputs *in, const float *q, const float *k,
             const float *v, const float *params, const copies &cp, bool make) {
  struct comm *c = sequence_group(ctx, g);
  *in = inputs{};
  const float *src[FMA_NSETS] = {k, v, q};
  for (int s = 0; s < FMA_NSETS; s++) {
    const bool set = s < nsets(g);
    bool made = !make || !cp.x[s];
    if (set) {
      gfma_weights_get(g, params, (enum fma_set)s, &in->w[s]);
      in->X[s] = static_cast<float *>(
          gpu_alloc_zero(MEM_WORKSPACE, sizeof(float) * (g->d * g->BH * g->st->rows + 1)));
      made |= gfma_upward_pass(g, in->X[s], src[s], &in->w[s], make ? nullptr : cp.x[s],
                               make ? cp.x[s] : nullptr);
    }
    if (!made) gpu_to_bf16(cp.x[s], src[s], cp.n);  // no upward pass of this set wrote it
  }
  in->k = k;
  in->v = v;
  in->klo = g->st->t0;
  in->kstride = g->T;
  if (!c) return;
  gfma_let_upward(g, c, in->X, nsets(g), in->w);
  const struct halo *h = &g->st->let->near;
  in->klo = h->lo;
  in->kstride = h->hi - h->lo;
  in->kx = device_floats((size_t)(g->BH * in->kstride * g->d));
  in->vx = device_floats((size_t)(g->BH * in->kstride * g->d));
  float *ext[2] = {in->kx, in->vx};
  const float *slab[2] = {k, v};
  halo_gather_arrays(h, c, ext, slab, 2, g->BH, g->d);  // keys and values in one exchange
  in->k = in->kx;
  in->v = in->vx;
}

// What evaluate reads of the copies: q, and k and v unless it reads the halo's.
gfma_copies made_of(const copies &cp, const inputs &in) {
  return gfma_copies{cp.x[FMA_Q], in.kx ? nullptr : cp.x[FMA_K], in.kx ? nullptr : cp.x[FMA_V],
                     nullptr};
}

void release(gfma *g, inputs *in) {
  for (int s = 0; s < nsets(g); s++) {
    gfma_weights_release(&in->w[s]);
    gpu_free(in->X[s]);
  }
  gpu_free(in->kx);
  gpu_free(in->vx);
}

void fma_forward(struct attn_ctx *ctx, float *out, float *saved, const float *q, const float *k,
                 const float *v, const float *params) {
  auto *g = static_cast<gfma *>(ctx->impl_state);
  inputs in;
  const copies cp = copies_of(ctx, g, saved);
  prepare(ctx, g, &in, q, k, v, params, cp, true);
  const gfma_copies made = made_of(cp, in);
  float *lse = saved, *lse_far = saved + g->BH * g->T;
  if (g->linear)
    gfma_linear_forward(g, out, lse, lse_far, q, in.k, in.v, in.klo, in.kstride, in.X[FMA_Q],
                        in.X[FMA_K], in.X[FMA_V], &made);
  else
    gfma_evaluate_forward(g, out, lse, q, in.k, in.v, in.klo, in.kstride, in.X[FMA_K], in.X[FMA_V],
                          &made);
  release(g, &in);
}

void fma_backward(struct attn_ctx *ctx, float *dq, float *dk, float *dv, float *dparams,
                  const float *dout, const float *q, const float *k, const float *v,
                  const float *params, const float *out, const float *saved) {
  auto *g = static_cast<gfma *>(ctx->impl_state);
  inputs in;
  const copies cp = copies_of(ctx, g, saved);
  prepare(ctx, g, &in, q, k, v, params, cp, false);
  const gfma_copies made = made_of(cp, in);
  const size_t nx = (size_t)(g->d * g->BH * g->st->rows + 1),
               ne = (size_t)(g->BH * in.kstride * g->d);
  float *dX[FMA_NSETS] = {nullptr, nullptr, nullptr};
  for (int s = 0; s < nsets(g); s++)
    dX[s] = static_cast<float *>(gpu_alloc_zero(MEM_WORKSPACE, sizeof(float) * nx));
  float *dkx = dk, *dvx = dv;  // the gradients of the keys evaluate read: the slab, or halo copies
  if (in.kx) {
    dkx = static_cast<float *>(gpu_alloc_zero(MEM_WORKSPACE, sizeof(float) * (ne + 1)));
    dvx = static_cast<float *>(gpu_alloc_zero(MEM_WORKSPACE, sizeof(float) * (ne + 1)));
  }
  const float *lse = saved, *lse_far = saved + g->BH * g->T;
  if (g->linear)
    gfma_linear_backward(g, dq, dkx, dvx, dX[FMA_Q], dX[FMA_K], dX[FMA_V], dout, q, in.k, in.v,
                         in.klo, in.kstride, in.X[FMA_Q], in.X[FMA_K], in.X[FMA_V], lse, lse_far,
                         &made);
  else
    gfma_evaluate_backward(g, dq, dkx, dvx, dX[FMA_K], dX[FMA_V], dout, out, q, in.k, in.v, in.klo,
                           in.kstride, in.X[FMA_K], in.X[FMA_V], lse, &made);
  if (in.kx) {  // the transposes of the exchanges, then of the local upward pass
    const struct halo *h = &g->st->let->near;
    float *slab[2] = {dk, dv};
    const float *ext[2] = {dkx, dvx};
    halo_scatter_add_arrays(h, ctx->comm, slab, ext, 2, g->BH, g->d);
    gfma_let_upward_backward(g, ctx->comm, dX, nsets(g), in.w);
    gpu_free(dkx);
    gpu_free(dvx);
  }
  const float *src[FMA_NSETS] = {k, v, q};
  float *dsrc[FMA_NSETS] = {dk, dv, dq};
  for (int s = 0; s < nsets(g); s++) {
    gfma_upward_pass_backward(g, dsrc[s], dX[s], &in.w[s]);
    gfma_upward_param_grads(g, (enum fma_set)s, dparams, dX[s], in.X[s], src[s]);
    gpu_free(dX[s]);
  }
  release(g, &in);
}

// fma.open (SPEC §6.4a) has no GPU implementation yet: refused before anything is allocated.
bool fma_refuses(const struct config *cfg, struct attn_refusal *r) {
  if (cfg->attention.fma_open == 0) return false;
  snprintf(r->keys, sizeof r->keys, "attention.fma.open parallel.device");
  snprintf(r->msg, sizeof r->msg,
           "attention.fma.open = %s opens far windows by content, which runs on the CPU only: the "
           "GPU back end has no opening pass yet (set parallel.device = cpu, or "
           "attention.fma.open = 0)",
           cfg->attention.fma_open == FMA_OPEN_ALL
               ? "all"
               : std::to_string(cfg->attention.fma_open).c_str());
  return true;
}

struct attn_impl make_fma() {
  struct attn_impl impl = {};
  impl.refuses = fma_refuses;
  impl.open = fma_open;
  impl.close = fma_close;
  impl.saved_floats = fma_saved_floats;
  impl.forward = fma_forward;
  impl.backward = fma_backward;
  return impl;
}

const struct attn_impl fma_impl = make_fma();

}  // namespace

extern "C" void gpu_attention_fma_register(void) {
  attention_register_impl("fma", DEVICE_GPU, &fma_impl);
  attention_register_impl("fma_linear", DEVICE_GPU, &fma_impl);
}
