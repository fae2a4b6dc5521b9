// The locally essential tree on device buffers, the twin of src/fma/let.c driven by its plan:
// windows spanning ranks completed by a hypercube exchange, then the listed summaries fetched
// with one alltoallv; backward the transposes. Packing is a device kernel; the traffic goes
// through the communicator's transport (NCCL), counted as the MPI path counts it.
#include <vector>

#include "check.h"
#include "fma_gpu.h"
#include "gpu.h"

// The plan's window lists on the device: (level, window) pairs.
struct gfma_let {
  int S, s, lspan;
  int *mine[FMA_MAX_LEVELS + 1], *sibling[FMA_MAX_LEVELS + 1]; /* m2m: the child at l − 1 */
  std::vector<int *> stage;                                    /* conv, avg: recursive doubling */
  std::vector<long> stage_count;
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
      float *x = X.x[s] + gfma_at(lv, lw[2 * k], f, h, (long)lw[2 * k + 1] * P + r);
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

// Exchange the windows ws with rank partner (the same count on both sides); overwrite or add
// what arrives into the windows rs (let.c's swap_windows).
void swap_windows(const gfma *g, struct comm *c, int partner, float *const *X, int nsets,
                  const int *ws, const int *rs, long count, bool add) {
  const size_t nf = (size_t)(nsets * g->BH * g->p * g->d * count);
  float *sbuf = comm_alloc(c, MEM_COMM, nf + 1), *rbuf = comm_alloc(c, MEM_COMM, nf + 1);
  pack(g, sbuf, X, nsets, ws, count, PACK);
  comm_sendrecv_float(c, sbuf, nf, partner, rbuf, nf, partner, 71);
  pack(g, rbuf, X, nsets, rs, count, add ? UNPACK_ADD : UNPACK);
  comm_free_buffer(c, sbuf);
  comm_free_buffer(c, rbuf);
}

// The sums over each spanning window's ranks (let.c's spanning_allreduce): partners s XOR j.
void spanning_allreduce(const gfma *g, struct comm *c, float *const *X, int nsets) {
  const gfma_let *let = g->let;
  for (size_t k = 0; k < let->stage.size(); k++)
    swap_windows(g, c, let->s ^ (1 << k), X, nsets, let->stage[k], let->stage[k],
                 let->stage_count[k], true);
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
  float *sbuf = comm_alloc(c, MEM_COMM, per * out_off[S] + 1);
  float *rbuf = comm_alloc(c, MEM_COMM, per * in_off[S] + 1);
  for (int r = 0; r < S; r++)
    pack(g, sbuf + sd[r], X, nsets, out_lw + 2 * out_off[r], (long)(out_off[r + 1] - out_off[r]),
         PACK);
  comm_alltoallv_float(c, sbuf, cnt.data(), sd.data(), rbuf, rc.data(), rd.data());
  for (int r = 0; r < S; r++)
    pack(g, rbuf + rd[r], X, nsets, in_lw + 2 * in_off[r], (long)(in_off[r + 1] - in_off[r]),
         transpose ? UNPACK_ADD : UNPACK);
  comm_free_buffer(c, sbuf);
  comm_free_buffer(c, rbuf);
}

}  // namespace

struct gfma_let *gfma_let_open(const gfma *g, const struct comm *c) {
  const fma_state *st = g->st;
  const fma_let *plan = st->let;
  auto *let = new gfma_let();
  let->S = plan->S;
  let->s = plan->s;
  let->lspan = plan->lspan;
  for (int l = plan->lspan; l <= g->L && st->down == FMA_DOWN_M2M; l++) {
    const int cc = (int)(st->t0 / st->tree.window[l - 1]);
    let->mine[l] = upload_pairs({l - 1, cc});
    let->sibling[l] = upload_pairs({l - 1, cc ^ 1});
  }
  for (int j = 1; j < let->S && st->down != FMA_DOWN_M2M && plan->lspan <= g->L; j <<= 1) {
    std::vector<int> lw;  // the levels whose window's group has more than j ranks
    for (int l = plan->lspan; l <= g->L; l++)
      if (st->tree.window[l] / st->T > j)
        lw.insert(lw.end(), {l, (int)(st->t0 / st->tree.window[l])});
    if (lw.empty()) break;
    let->stage.push_back(upload_pairs(lw));
    let->stage_count.push_back((long)lw.size() / 2);
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
  for (int l = 0; l <= FMA_MAX_LEVELS; l++) {
    gpu_free(let->mine[l]);
    gpu_free(let->sibling[l]);
  }
  for (int *p : let->stage) gpu_free(p);
  gpu_free(let->send);
  gpu_free(let->recv);
  delete let;
}

void gfma_let_upward(const gfma *g, struct comm *c, float *const *X, int nsets,
                     const gfma_weights *w) {
  const fma_state *st = g->st;
  const gfma_let *let = g->let;
  if (st->down == FMA_DOWN_M2M) {
    // each spanning level: swap the child window with the sibling's rank, make the parent
    for (int l = let->lspan; l <= g->L; l++) {
      const long gsize = st->tree.window[l] / st->T, cp = st->t0 / st->tree.window[l];
      swap_windows(g, c, let->s ^ (int)(gsize / 2), X, nsets, let->mine[l], let->sibling[l], 1,
                   false);
      for (int s = 0; s < nsets; s++) gfma_M2M_spanning(g, l, cp, X[s], &w[s]);
    }
  } else if (let->lspan <= g->L) {
    spanning_allreduce(g, c, X, nsets);
  }
  fetch(g, c, X, nsets, false);
}

void gfma_let_upward_backward(const gfma *g, struct comm *c, float *const *dX, int nsets,
                              const gfma_weights *w) {
  const fma_state *st = g->st;
  const gfma_let *let = g->let;
  fetch(g, c, dX, nsets, true);
  if (st->down == FMA_DOWN_M2M) {
    // coarse to fine: this rank's share of each spanning parent's gradient goes to both children;
    // the sibling's part travels to the sibling's rank, whose part for this child comes back
    for (int l = g->L; l >= let->lspan; l--) {
      const long gsize = st->tree.window[l] / st->T, cp = st->t0 / st->tree.window[l];
      pack(g, nullptr, dX, nsets, let->sibling[l], 1, ZERO);
      for (int s = 0; s < nsets; s++) gfma_M2M_spanning_backward(g, l, cp, dX[s], &w[s]);
      swap_windows(g, c, let->s ^ (int)(gsize / 2), dX, nsets, let->sibling[l], let->mine[l], 1,
                   true);
      pack(g, nullptr, dX, nsets, let->sibling[l], 1, ZERO);
    }
  } else if (let->lspan <= g->L) {
    spanning_allreduce(g, c, dX, nsets);
  }
}
