// The locally essential tree on device buffers, the twin of src/fma/let.c driven by its plan:
// the windows spanning ranks computed on every rank after one exchange (m2m: every rank's top
// window gathered; conv, avg: one allreduce of the shares), then the listed summaries fetched
// with one alltoallv; backward the transposes. Packing is a device kernel; the traffic goes
// through the communicator's transport (NCCL), counted as the MPI path counts it.
#include <vector>

#include "check.h"
#include "fma_gpu.h"
#include "gpu.h"

// The plan's window lists on the device: (level, window) pairs.
struct gfma_let {
  int S, s, lspan;
  int *tops;         /* m2m: rank r's top window (lspan − 1, r) at 2r */
  int *span, *other; /* conv, avg: every spanning window; those this rank has no share of */
  long nspan, nother;
  int *send, *recv; /* the fetch: to each rank its windows, [send_off[r], send_off[r + 1]) */
};

namespace {

constexpr unsigned kThreads = 256;

struct gfma_sets {
  float *x[FMA_NSETS];
};

enum pack_mode { PACK, UNPACK, UNPACK_ADD, ZERO };

// A message of windows (set, head, window, r, f), let.c's order: PACK copies the windows of X
// into buf, UNPACK copies buf into them, UNPACK_ADD adds it, ZERO clears them. lw: (count, 2)
// level and window of each. grid (gpu_grid2): the (set, head) parts along y, each one's
// count·p·d floats along x. CPU twins: pack and unpack in let.c.
__global__ void pack_windows(float *buf, gfma_sets X, int nsets, const int *lw, int count,
                             gfma_levels lv, pack_mode mode) {
  const int d = lv.d, P = lv.p, per = count * P * d, BH = (int)lv.BH;
  for (int sh = blockIdx.y; sh < nsets * BH; sh += gridDim.y) {
    const int s = sh / BH, h = sh % BH;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < per; i += gridDim.x * blockDim.x) {
      const int f = i % d, r = i / d % P, k = i / (d * P);
      float *x = X.x[s] + gfma_window_at(lv, lw[2 * k], f, h, lw[2 * k + 1], r);
      const size_t e = (size_t)sh * per + i;
      if (mode == PACK)
        buf[e] = *x;
      else if (mode == UNPACK)
        *x = buf[e];
      else if (mode == UNPACK_ADD)
        *x += buf[e];
      else
        *x = 0.0f;
    }
  }
}

void pack(const gfma *g, float *buf, float *const *X, int nsets, const int *lw, long count,
          pack_mode mode) {
  const size_t total = (size_t)(nsets * g->BH * count * g->p * g->d);
  if (total == 0) return;
  gfma_sets sets = {};
  for (int s = 0; s < nsets; s++) sets.x[s] = X[s];
  pack_windows<<<gpu_grid2(nsets * g->BH, count * g->p * g->d, kThreads), kThreads, 0,
                 gpu_stream()>>>(buf, sets, nsets, lw, (int)count, g->lv, mode);
  LAUNCH_CHECK(pack_windows);
}

int *upload_pairs(const std::vector<int> &v) {
  int *d = static_cast<int *>(gpu_alloc(MEM_WORKSPACE, sizeof(int) * (v.size() + 1)));
  gpu_upload(d, v.data(), sizeof(int) * v.size());
  return d;
}

// conv, avg: every spanning window's sums over its ranks on every rank, one allreduce of the
// shares (let.c's spanning_sums); forward first clears the windows this rank has no share of.
void spanning_sums(const gfma *g, struct comm *c, float *const *X, int nsets, bool forward) {
  const gfma_let *let = g->let;
  if (forward) pack(g, nullptr, X, nsets, let->other, let->nother, ZERO);
  const size_t n = (size_t)(nsets * g->BH * let->nspan * g->p * g->d);
  float *buf = comm_buffer(c, COMM_BUF_SPAN_SEND, n + 1);
  pack(g, buf, X, nsets, let->span, let->nspan, PACK);
  comm_allreduce_sum_float(c, COMM_SEQ, buf, n);
  pack(g, buf, X, nsets, let->span, let->nspan, UNPACK);
  comm_buffer_release(c, COMM_BUF_SPAN_SEND);
}

// The listed summaries, owners → users (forward) or their gradients back, added (transpose):
// let.c's fetch, one alltoallv.
void fetch(const gfma *g, struct comm *c, float *const *X, int nsets, bool transpose) {
  const fma_let *plan = g->st->let;
  const gfma_let *let = g->let;
  const int S = let->S;
  const size_t per = (size_t)(nsets * g->BH * g->p * g->d);
  const size_t *out_off = transpose ? plan->recv_off : plan->send_off;
  const size_t *in_off = transpose ? plan->send_off : plan->recv_off;
  const int *out_lw = transpose ? let->recv : let->send, *in_lw = transpose ? let->send : let->recv;
  std::vector<size_t> cnt((size_t)S), sd((size_t)S), rc((size_t)S), rd((size_t)S);
  for (int r = 0; r < S; r++) {
    cnt[r] = per * (out_off[r + 1] - out_off[r]);
    sd[r] = per * out_off[r];
    rc[r] = per * (in_off[r + 1] - in_off[r]);
    rd[r] = per * in_off[r];
  }
  float *sbuf = comm_buffer(c, COMM_BUF_LET_SEND, per * out_off[S] + 1);
  float *rbuf = comm_buffer(c, COMM_BUF_LET_RECV, per * in_off[S] + 1);
  for (int r = 0; r < S; r++)
    pack(g, sbuf + sd[r], X, nsets, out_lw + 2 * out_off[r], (long)(out_off[r + 1] - out_off[r]),
         PACK);
  comm_alltoallv_float(c, sbuf, cnt.data(), sd.data(), rbuf, rc.data(), rd.data());
  for (int r = 0; r < S; r++)
    pack(g, rbuf + rd[r], X, nsets, in_lw + 2 * in_off[r], (long)(in_off[r + 1] - in_off[r]),
         transpose ? UNPACK_ADD : UNPACK);
  comm_buffer_release(c, COMM_BUF_LET_SEND);
  comm_buffer_release(c, COMM_BUF_LET_RECV);
}

}  // namespace

struct gfma_let *gfma_let_open(const gfma *g, const struct comm *c) {
  const fma_state *st = g->st;
  const fma_let *plan = st->let;
  auto *let = new gfma_let();
  let->S = plan->S;
  let->s = plan->s;
  let->lspan = plan->lspan;
  if (plan->lspan <= g->L && st->down == FMA_DOWN_M2M) {
    std::vector<int> tops;
    for (int r = 0; r < let->S; r++) tops.insert(tops.end(), {plan->lspan - 1, r});
    let->tops = upload_pairs(tops);
  } else if (plan->lspan <= g->L) {
    std::vector<int> span, other;
    for (int l = plan->lspan; l <= g->L; l++)
      for (long w = 0; w < st->tree.nwindows[l]; w++) {
        span.insert(span.end(), {l, (int)w});
        if (w != st->t0 / st->tree.window[l]) other.insert(other.end(), {l, (int)w});
      }
    let->span = upload_pairs(span);
    let->other = upload_pairs(other);
    let->nspan = (long)span.size() / 2;
    let->nother = (long)other.size() / 2;
  }
  std::vector<int> send, recv;
  for (size_t k = 0; k < plan->send_off[let->S]; k++)
    send.insert(send.end(), {plan->send_level[k], (int)plan->send_window[k]});
  for (size_t k = 0; k < plan->recv_off[let->S]; k++)
    recv.insert(recv.end(), {plan->recv_level[k], (int)plan->recv_window[k]});
  let->send = upload_pairs(send);
  let->recv = upload_pairs(recv);
  (void)c;
  return let;
}

void gfma_let_close(struct gfma_let *let) {
  if (!let) return;
  gpu_free(let->tops);
  gpu_free(let->span);
  gpu_free(let->other);
  gpu_free(let->send);
  gpu_free(let->recv);
  delete let;
}

void gfma_let_upward(const gfma *g, struct comm *c, float *const *X, int nsets,
                     const gfma_weights *w) {
  const fma_state *st = g->st;
  const gfma_let *let = g->let;
  if (let->lspan <= g->L && st->down == FMA_DOWN_M2M) {
    // every rank's top window to every rank, then every spanning window here
    const size_t per = (size_t)(nsets * g->BH * g->p * g->d);
    float *mine = comm_buffer(c, COMM_BUF_SPAN_SEND, per + 1);
    float *all = comm_buffer(c, COMM_BUF_SPAN_RECV, per * (size_t)let->S + 1);
    pack(g, mine, X, nsets, let->tops + 2 * let->s, 1, PACK);
    comm_allgather_float(c, COMM_SEQ, mine, per, all);
    for (int r = 0; r < let->S; r++)
      if (r != let->s) pack(g, all + per * (size_t)r, X, nsets, let->tops + 2 * r, 1, UNPACK);
    comm_buffer_release(c, COMM_BUF_SPAN_SEND);
    comm_buffer_release(c, COMM_BUF_SPAN_RECV);
    for (int l = let->lspan; l <= g->L; l++)
      for (int s = 0; s < nsets; s++) gfma_M2M_spanning(g, l, X[s], &w[s]);
  } else if (let->lspan <= g->L) {
    spanning_sums(g, c, X, nsets, true);
  }
  fetch(g, c, X, nsets, false);
}

void gfma_let_upward_backward(const gfma *g, struct comm *c, float *const *dX, int nsets,
                              const gfma_weights *w) {
  const fma_state *st = g->st;
  const gfma_let *let = g->let;
  const int S = let->S;
  fetch(g, c, dX, nsets, true);
  if (let->lspan <= g->L && st->down == FMA_DOWN_M2M) {
    // this rank's parts of the spanning gradients down to every top window, each sent to its
    // rank, which sums what every rank sent in rank order (let.c's order)
    for (int l = g->L; l >= let->lspan; l--)
      for (int s = 0; s < nsets; s++) gfma_M2M_spanning_backward(g, l, dX[s], &w[s]);
    const size_t per = (size_t)(nsets * g->BH * g->p * g->d);
    float *out = comm_buffer(c, COMM_BUF_SPAN_SEND, per * (size_t)S + 1);
    float *in = comm_buffer(c, COMM_BUF_SPAN_RECV, per * (size_t)S + 1);
    std::vector<size_t> cnt((size_t)S, per), displ((size_t)S);
    for (int r = 0; r < S; r++) {
      displ[r] = per * (size_t)r;
      pack(g, out + displ[r], dX, nsets, let->tops + 2 * r, 1, PACK);
    }
    comm_alltoallv_float(c, out, cnt.data(), displ.data(), in, cnt.data(), displ.data());
    pack(g, nullptr, dX, nsets, let->tops + 2 * let->s, 1, ZERO);
    for (int r = 0; r < S; r++)
      pack(g, in + displ[r], dX, nsets, let->tops + 2 * let->s, 1, UNPACK_ADD);
    comm_buffer_release(c, COMM_BUF_SPAN_SEND);
    comm_buffer_release(c, COMM_BUF_SPAN_RECV);
  } else if (let->lspan <= g->L) {
    spanning_sums(g, c, dX, nsets, false);
  }
}
