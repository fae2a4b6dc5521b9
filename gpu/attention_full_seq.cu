// `full` and `local` as attention implementations on the GPU (attention.h struct attn_impl), the
// twin of src/attention/full.c's three paths: one slab (the blocked form, or the SIMT reference
// with gpu.exact = reference), and under sequence parallelism `full`'s ring (ring.c, zigzag
// when causal) and `local`'s halo (halo.c) on device buffers that the communicator's NCCL
// transport moves. No host code here reads device memory; saved = lse (B·H·T), as full.c lays it.
#include <cstring>

#include "attention/attention.h"
#include "attention_full.cuh"
#include "check.h"
#include "gpu.h"
#include "parallel/halo.h"
#include "parallel/ring.h"

namespace {

int kernels = GPU_EXACT_BLOCKED;  // enum gpu_exact_kernels: the deck's gpu.exact

long band_of(const attn_ctx *ctx) {
  return ctx->variant == attention_find("local") ? ctx->opt.local_band : 0;
}

exact_job job_of(const attn_ctx *ctx) {
  const attn_dims *dm = &ctx->dims;
  return {dm->B * dm->H, (int)dm->d, {dm->causal, band_of(ctx)}};
}

bool distributed(const attn_ctx *ctx) { return ctx->comm && ctx->comm->S > 1; }

float *device_floats(enum mem_label label, size_t floats) {
  return static_cast<float *>(gpu_alloc(label, sizeof(float) * floats));
}

// What this build can run: the reference on one slab at its head sizes; the sequence group's
// exchanges on a transport that moves device buffers.
void check_ctx(const attn_ctx *ctx) {
  const char *name = ctx->variant->name;
  const bool ref = gpu_exact_kernels() == GPU_EXACT_REFERENCE;
  if (ref && distributed(ctx))
    error_at(__FILE__, __func__, __LINE__,
             "gpu.exact = reference runs attention.variant = %s on one sequence rank; "
             "parallel.seq_ranks = %d runs the blocked form (gpu.exact = blocked)",
             name, ctx->comm->S);
  if (ref && !gpu_exact_attention_supports((int)ctx->dims.d))
    error_at(__FILE__, __func__, __LINE__,
             "gpu.exact = reference: attention.variant = %s needs a head size of 16, 32, 64 "
             "or 128, not %ld (the blocked form takes any)",
             name, ctx->dims.d);
  if (distributed(ctx) && strcmp(ctx->comm->transport->name, "nccl") != 0)
    error_at(__FILE__, __func__, __LINE__,
             "attention.variant = %s on the GPU over %d sequence ranks: the exchanges move device "
             "buffers, but the communicator's transport is %s (gpu_comm_attach gives NCCL)",
             name, ctx->comm->S, ctx->comm->transport->name);
}

// ------------------------------------------------------------------------------------------------
// `full` under sequence parallelism: the ring carries k and v round the group and calls these at
// each step (full.c's ring_fold, ring_grad); m, l and lse stay in the ring's layout.

struct RingOp {
  exact_job job;
  float *ml;         // forward: m, l (BH, T) each
  float *lse_out;    // forward
  const float *lse;  // backward
};

// Piece p of rank r's slab in the ring's layout: L rows of T per head, from ring_offset.
exact_side ring_side(const struct ring *rg, int r, int p) {
  return {rg->T, rg->L, ring_offset(rg, r, p)};
}

void ring_fold(const struct ring_step *s, void *user) {
  const auto *op = static_cast<const RingOp *>(user);
  const struct ring *rg = s->rg;
  const long rows = op->job.BH * rg->T, d = op->job.d;
  float *m = op->ml, *l = op->ml + rows, *acc = s->out[0];
  if (s->t == 0) exact_state_init(m, l, acc, rows, op->job.d);
  for (int p = 0; p < rg->pieces; p++)
    for (int kp = 0; kp < rg->pieces; kp++) {
      const long qo = p * rg->L, ko = kp * rg->L;
      exact_fold(op->job, ring_side(rg, rg->me, p), s->stay[0] + qo * d, m + qo, l + qo,
                 acc + qo * d, ring_side(rg, s->src, kp), s->travel[0] + ko * d,
                 s->travel[1] + ko * d);
    }
  if (s->t == rg->S - 1) exact_state_finish(acc, op->lse_out, acc, m, l, rows, op->job.d);
}

void ring_grad(const struct ring_step *s, void *user) {
  const auto *op = static_cast<const RingOp *>(user);
  const struct ring *rg = s->rg;
  const long d = op->job.d;
  for (int p = 0; p < rg->pieces; p++)
    for (int kp = 0; kp < rg->pieces; kp++) {
      const long qo = p * rg->L, ko = kp * rg->L;
      exact_grad(op->job, ring_side(rg, rg->me, p), s->stay[0] + qo * d, s->stay[1] + qo * d,
                 s->stay[2] + qo, op->lse + qo, s->out[0] + qo * d, ring_side(rg, s->src, kp),
                 s->travel[0] + ko * d, s->travel[1] + ko * d, s->dtravel[0] + ko * d,
                 s->dtravel[1] + ko * d);
    }
}

void full_ring_forward(attn_ctx *ctx, float *out, float *lse, const float *q, const float *k,
                       const float *v) {
  const struct ring rg = ring_plan(ctx->comm, ctx->dims.T, ctx->dims.causal);
  RingOp op = {job_of(ctx), nullptr, lse, nullptr};
  const long BH = op.job.BH, d = op.job.d;
  op.ml = device_floats(MEM_WORKSPACE, 2 * (size_t)(BH * rg.T));
  struct ring_pass ps = {};
  ps.stay = {1, {BH}, {d}};
  ps.travel = {2, {BH, BH}, {d, d}};
  ps.out = {1, {BH}, {d}};
  ps.stay_in[0] = q;
  ps.travel_in[0] = k;
  ps.travel_in[1] = v;
  ps.out_io[0] = out;
  ps.step = ring_fold;
  ps.user = &op;
  ring_forward(&rg, &ps);
  gpu_free(op.ml);
}

void full_ring_backward(attn_ctx *ctx, float *dq, float *dk, float *dv, const float *dout,
                        const float *q, const float *k, const float *v, const float *out,
                        const float *lse) {
  const struct ring rg = ring_plan(ctx->comm, ctx->dims.T, ctx->dims.causal);
  RingOp op = {job_of(ctx), nullptr, nullptr, lse};
  const long BH = op.job.BH, d = op.job.d;
  float *D = device_floats(MEM_WORKSPACE, (size_t)(BH * rg.T));  // per row: 1/d of the traffic
  gpu_rows_dot(D, dout, out, BH * rg.T, op.job.d);
  struct ring_pass ps = {};
  ps.stay = {3, {BH, BH, BH}, {d, d, 1}};
  ps.travel = {2, {BH, BH}, {d, d}};
  ps.out = {1, {BH}, {d}};
  ps.stay_in[0] = q;
  ps.stay_in[1] = dout;
  ps.stay_in[2] = D;
  ps.travel_in[0] = k;
  ps.travel_in[1] = v;
  ps.out_io[0] = dq;
  ps.dtravel[0] = dk;
  ps.dtravel[1] = dv;
  ps.step = ring_grad;
  ps.user = &op;
  ring_backward(&rg, &ps);
  gpu_free(D);
}

// ------------------------------------------------------------------------------------------------
// `local` under sequence parallelism: the band's halo (full.c's halo_keys) gathered into extended
// k then v, (BH, E, d) each, E = hi − lo; they travel stacked, so one alltoallv moves both.

float *halo_keys(const attn_ctx *ctx, struct halo *h, const float *k, const float *v) {
  const attn_dims *dm = &ctx->dims;
  const long BH = dm->B * dm->H, reach = band_of(ctx) - 1;
  const size_t slab = (size_t)(BH * dm->T * dm->d);
  halo_plan(h, ctx->comm, dm->n, dm->T, reach, dm->causal ? 0 : reach);
  float *kv = device_floats(MEM_COMM, 2 * slab);  // k then v
  gpu_copy(kv, k, sizeof(float) * slab);
  gpu_copy(kv + slab, v, sizeof(float) * slab);
  float *ext = device_floats(MEM_WORKSPACE, (size_t)(2 * BH * (h->hi - h->lo) * dm->d));
  halo_gather(h, ctx->comm, ext, kv, 2 * BH, dm->d);
  gpu_free(kv);
  return ext;
}

void local_forward(attn_ctx *ctx, float *out, float *lse, const float *q, const float *k,
                   const float *v) {
  const attn_dims *dm = &ctx->dims;
  struct halo h;
  float *ext = halo_keys(ctx, &h, k, v);
  const long E = h.hi - h.lo, BH = dm->B * dm->H;
  exact_keys_forward(job_of(ctx), {dm->T, dm->T, dm->t0}, q, out, lse, {E, E, h.lo}, ext,
                     ext + BH * E * dm->d);
  gpu_free(ext);
  halo_free(&h);
}

// Backward gathers the halo again (saved holds only lse), forms dk, dv over the extended range
// and sends the halo parts home to be added there (halo_scatter_add).
void local_backward(attn_ctx *ctx, float *dq, float *dk, float *dv, const float *dout,
                    const float *q, const float *k, const float *v, const float *out,
                    const float *lse) {
  const attn_dims *dm = &ctx->dims;
  const long BH = dm->B * dm->H;
  const size_t slab = (size_t)(BH * dm->T * dm->d);
  struct halo h;
  float *ext = halo_keys(ctx, &h, k, v);
  const long E = h.hi - h.lo, XE = BH * E * dm->d;
  float *dext = static_cast<float *>(gpu_alloc_zero(MEM_WORKSPACE, sizeof(float) * 2 * XE));
  exact_keys_backward(job_of(ctx), {dm->T, dm->T, dm->t0}, q, dout, out, lse, dq, {E, E, h.lo}, ext,
                      ext + XE, dext, dext + XE);
  gpu_free(ext);
  float *dkv = static_cast<float *>(gpu_alloc_zero(MEM_COMM, sizeof(float) * 2 * slab));
  halo_scatter_add(&h, ctx->comm, dkv, dext, 2 * BH, dm->d);
  gpu_add_rows(dk, slab, dkv, slab, 1, slab);
  gpu_add_rows(dv, slab, dkv + slab, slab, 1, slab);
  gpu_free(dkv);
  gpu_free(dext);
  halo_free(&h);
}

// ------------------------------------------------------------------------------------------------
// the implementation of both variants

size_t exact_saved_floats(const attn_ctx *ctx) {
  return (size_t)(ctx->dims.B * ctx->dims.H * ctx->dims.T);  // lse
}

void exact_forward(attn_ctx *ctx, float *out, float *saved, const float *q, const float *k,
                   const float *v, const float *params) {
  check_ctx(ctx);
  const attn_dims *dm = &ctx->dims;
  const long band = band_of(ctx);
  if (distributed(ctx) && band > 0)
    local_forward(ctx, out, saved, q, k, v);
  else if (distributed(ctx))
    full_ring_forward(ctx, out, saved, q, k, v);
  else if (gpu_exact_kernels() == GPU_EXACT_REFERENCE)
    gpu_exact_attention_forward(out, saved, q, k, v, dm->B * dm->H, dm->T, (int)dm->d, dm->causal,
                                band);
  else
    gpu_exact_blocked_forward(out, saved, q, k, v, dm->B * dm->H, dm->T, (int)dm->d, dm->causal,
                              band);
}

void exact_backward(attn_ctx *ctx, float *dq, float *dk, float *dv, float *dparams,
                    const float *dout, const float *q, const float *k, const float *v,
                    const float *params, const float *out, const float *saved) {
  check_ctx(ctx);
  const attn_dims *dm = &ctx->dims;
  const long band = band_of(ctx), BH = dm->B * dm->H;
  if (distributed(ctx) && band > 0)
    local_backward(ctx, dq, dk, dv, dout, q, k, v, out, saved);
  else if (distributed(ctx))
    full_ring_backward(ctx, dq, dk, dv, dout, q, k, v, out, saved);
  else if (gpu_exact_kernels() == GPU_EXACT_REFERENCE)
    gpu_exact_attention_backward(dq, dk, dv, dout, q, k, v, out, saved, BH, dm->T, (int)dm->d,
                                 dm->causal, band);
  else
    gpu_exact_blocked_backward(dq, dk, dv, dout, q, k, v, out, saved, BH, dm->T, (int)dm->d,
                               dm->causal, band);
}

struct attn_impl make_exact() {
  struct attn_impl impl = {};
  impl.saved_floats = exact_saved_floats;
  impl.forward = exact_forward;
  impl.backward = exact_backward;
  return impl;
}

const struct attn_impl exact_impl = make_exact();

}  // namespace

extern "C" enum gpu_exact_kernels gpu_exact_kernels(void) {
  return static_cast<enum gpu_exact_kernels>(kernels);
}

extern "C" void gpu_set_exact_kernels(enum gpu_exact_kernels k) { kernels = k; }

extern "C" void gpu_attention_full_register(void) {
  attention_register_impl("full", DEVICE_GPU, &exact_impl);
  attention_register_impl("local", DEVICE_GPU, &exact_impl);
}
