// FMA evaluation on the GPU, the twin of src/fma/evaluate.c: query blocks in chunks sized to a
// budget; per chunk the near (P2P) and far (M2P, gathered listed summaries) scores as batched
// GEMMs, one fused SIMT softmax over [near | far], then the value GEMMs. Backward recomputes the
// scores from lse; gradients several blocks touch are summed per target row in a fixed order.
// With bf16 products the products read bf16 operands: k, v and the summaries copied into bf16
// once per evaluation, q and dout per chunk, the probabilities and their gradients written in bf16
// by the softmax kernels themselves (the products' fp32 outputs, the scores, stay fp32).
#include <cuda_bf16.h>

#include "check.h"
#include "core/timer.h"
#include "fma_gpu.h"
#include "gpu.h"

namespace {

constexpr unsigned kThreads = 256;
constexpr unsigned kLanes = 32;    // a warp: one score row in the softmax kernels
constexpr unsigned kSoftRows = 8;  // score rows (warps) per block of the softmax kernels
constexpr unsigned kRow = 32;      // threads per summary row in the gathers
constexpr unsigned kWarps = 8;     // warps per summary row in scatter_far, each a share of its refs
constexpr unsigned kGather = 8;    // listed windows per block in gather_far

size_t budget_bytes = 0;  // 0: kDefaultBudget
constexpr size_t kDefaultBudget = size_t(1) << 30;

unsigned grid_of(size_t n) {
  const size_t b = gpu_blocks(n, kThreads);
  return (unsigned)(b < 65535 ? b : 65535);
}

// What the softmax kernels need to know which score columns a query row may see: query block
// qb = b0 + lb of the slab, near columns [0, ns·m) (key block qb − 1 + s in column s·m + j),
// far columns [ns·m, ns·m + nfmax) (a listed summary slot, or −1).
// Indices in 32 bits: blocks, rows and columns of one rank's slab fit (the host checks, mask_of).
struct gfma_mask {
  int m, nb, b0, nbs;
  int ns, nfmax;
  bool causal;
  const int *far_row;
  const float *far_logw;
};

// Whether query row r of slab block lb sees column c, and the log-weight added to its score: the
// lists of src/fma/lists.c as fma_block_keys lays them out (near blocks b − 1 .. b (+ 1) that
// exist, keys after the query masked in causal mode; listed far slots with log(w_l/p)).
// Near column c of query block qb is key (qb − 1)·m + c, of key block qb − 1 + ⌊c/m⌋: that block
// exists when (1 − qb)·m ≤ c < (nb + 1 − qb)·m, and the key is not after query qb·m + r when
// c ≤ m + r; compares where ⌊c/m⌋ and c mod m were two integer divisions a column (some 40
// instructions each, in kernels that evaluate this for every score).
__device__ inline bool visible(const gfma_mask &mk, int lb, int r, int c, float *add) {
  *add = 0.0f;
  if (c < mk.ns * mk.m) {
    const int qb = mk.b0 + lb;
    if (c < (1 - qb) * mk.m || c >= (mk.nb + 1 - qb) * mk.m) return false;
    return !mk.causal || c <= mk.m + r;
  }
  const int slot = c - mk.ns * mk.m;
  if (mk.far_row[lb * mk.nfmax + slot] < 0) return false;
  *add = mk.far_logw[slot];
  return true;
}

// Max and sum over a warp's lanes; every lane gets it.
__device__ inline float warp_max(float v) {
  for (unsigned o = kLanes / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ inline float warp_sum(float v) {
  for (unsigned o = kLanes / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// The softmax kernels: grid (rows / kSoftRows, rounded up), block (kLanes, kSoftRows), one score
// row of ld columns per warp, its lanes along the row (no block barrier; a warp past the last
// row leaves whole). Chunk row `row` is query r of flattened block g0 + row/m (head h, slab block
// lb); which columns it sees, and their log-weights, `visible` says, in every pass.
struct soft_row {
  int row, gl, lb, r;
};
__device__ inline bool soft_row_of(const gfma_mask &mk, int g0, int rows, soft_row *x) {
  x->row = (int)(blockIdx.x * kSoftRows + threadIdx.y);
  if (x->row >= rows) return false;
  x->gl = g0 + x->row / mk.m;
  x->lb = x->gl % mk.nbs;
  x->r = x->row % mk.m;
  return true;
}

// One query row's scores S become probabilities, masked columns 0, in place or (bf16 products)
// into Pb (S then left as it is), and lse = max + log Σ. Three passes over the row (the max, the
// sum, the probabilities), the re-reads from cache. CPU twin: rows_softmax (evaluate.c), with the
// masks and log-weights of fma_P2P_scores and fma_M2P_scores.
__global__ void softmax_forward(float *S, float *lse, int ld, gfma_mask mk, int g0, int rows,
                                __nv_bfloat16 *Pb) {
  soft_row x;
  if (!soft_row_of(mk, g0, rows, &x)) return;
  float *s = S + (size_t)x.row * ld;
  float mx = -INFINITY, add;
  for (int c = threadIdx.x; c < ld; c += kLanes)
    if (visible(mk, x.lb, x.r, c, &add)) mx = fmaxf(mx, s[c] + add);
  mx = warp_max(mx);
  float sum = 0.0f;
  for (int c = threadIdx.x; c < ld; c += kLanes)
    if (visible(mk, x.lb, x.r, c, &add)) sum += expf(s[c] + add - mx);
  sum = warp_sum(sum);
  const float inv = 1.0f / sum;  // sum ≥ 1: the query sees itself
  for (int c = threadIdx.x; c < ld; c += kLanes) {
    const float pr = visible(mk, x.lb, x.r, c, &add) ? expf(s[c] + add - mx) * inv : 0.0f;
    if (Pb)
      Pb[(size_t)x.row * ld + c] = __float2bfloat16(pr);
    else
      s[c] = pr;
  }
  if (threadIdx.x == 0) lse[(size_t)x.gl * mk.m + x.r] = mx + logf(sum);
}

// softmax_forward with the row in registers, K columns per lane (ld ≤ K·kLanes): the scores, the
// mask and the log-weights read once, one expf per column, where softmax_forward reads them in
// each of its three passes and evaluates expf twice. The same arithmetic in the same order (the
// lanes' columns in turn, then the warp's reduction), so the same bits; a masked column is held
// as −inf, whose probability is 0 either way.
template <int K>
__global__ void softmax_forward_held(float *S, float *lse, int ld, gfma_mask mk, int g0, int rows,
                                     __nv_bfloat16 *Pb) {
  soft_row x;
  if (!soft_row_of(mk, g0, rows, &x)) return;
  float *s = S + (size_t)x.row * ld;
  float e[K], mx = -INFINITY;
#pragma unroll
  for (int i = 0; i < K; i++) {
    const int c = (int)threadIdx.x + i * (int)kLanes;
    float add;
    e[i] = c < ld && visible(mk, x.lb, x.r, c, &add) ? s[c] + add : -INFINITY;
    mx = fmaxf(mx, e[i]);
  }
  mx = warp_max(mx);
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < K; i++) {
    e[i] = e[i] == -INFINITY ? 0.0f : expf(e[i] - mx);
    sum += e[i];
  }
  sum = warp_sum(sum);
  const float inv = 1.0f / sum;  // sum ≥ 1: the query sees itself
#pragma unroll
  for (int i = 0; i < K; i++) {
    const int c = (int)threadIdx.x + i * (int)kLanes;
    if (c >= ld) break;
    if (Pb)
      Pb[(size_t)x.row * ld + c] = __float2bfloat16(e[i] * inv);
    else
      s[c] = e[i] * inv;
  }
  if (threadIdx.x == 0) lse[(size_t)x.gl * mk.m + x.r] = mx + logf(sum);
}

// P = exp(S + log-weight − lse) of one score row, masked 0, in place or (bf16 products) into Pb,
// S left as it is. CPU twin: rows_probabilities.
__global__ void probabilities(float *S, const float *lse, int ld, gfma_mask mk, int g0, int rows,
                              __nv_bfloat16 *Pb) {
  soft_row x;
  if (!soft_row_of(mk, g0, rows, &x)) return;
  const float L = lse[(size_t)x.gl * mk.m + x.r];
  float *s = S + (size_t)x.row * ld;
  for (int c = threadIdx.x; c < ld; c += kLanes) {
    float add;
    const float pr = visible(mk, x.lb, x.r, c, &add) ? expf(s[c] + add - L) : 0.0f;
    if (Pb)
      Pb[(size_t)x.row * ld + c] = __float2bfloat16(pr);
    else
      s[c] = pr;
  }
}

// dS = P ∘ (dP − D) of one row, masked 0: in place in dP with P the probabilities; or (bf16
// products) into dSb, with P the scores, whose probabilities it recomputes from lse as
// `probabilities` did (the same bits). D: the chunk's rows. CPU twin: rows_softmax_backward.
__global__ void softmax_backward(float *dP, const float *P, const float *D, int ld, gfma_mask mk,
                                 int g0, int rows, const float *lse, __nv_bfloat16 *dSb) {
  soft_row x;
  if (!soft_row_of(mk, g0, rows, &x)) return;
  const size_t at = (size_t)x.row * ld;
  const float L = dSb ? lse[(size_t)x.gl * mk.m + x.r] : 0.0f;
  for (int c = threadIdx.x; c < ld; c += kLanes) {
    float add, ds = 0.0f;
    if (visible(mk, x.lb, x.r, c, &add)) {
      const float pr = dSb ? expf(P[at + c] + add - L) : P[at + c];
      ds = pr * (dP[at + c] - D[x.row]);
    }
    if (dSb)
      dSb[at + c] = __float2bfloat16(ds);
    else
      dP[at + c] = ds;
  }
}

// grid-stride over the chunk's (block, listed window) pairs, kGather per block, one warp each:
// Kf, Vf (blocks, nfmax, d) = the window's p summary rows of XK, XV (0 where its slots are
// empty), fp32 or bf16 (T). A window's rows are contiguous within a channel (the channels
// B·H·nr_l apart), so the lanes run along its rows first (element t: row t % p, channel t / p):
// each channel's p values are read together, each row's channels written together. CPU twin:
// gather in block_keys.
template <class T>
__global__ void gather_far(T *Kf, T *Vf, const T *XK, const T *XV, const int *far_row,
                           gfma_levels lv, int nbs, int nfmax, int g0, int pairs) {
  const int d = lv.d, p = lv.p, groups = nfmax / p;
  for (int bw = blockIdx.x * blockDim.y + threadIdx.y; bw < pairs; bw += gridDim.x * blockDim.y) {
    const int gl = g0 + bw / groups, slot0 = bw % groups * p;
    const int R0 = far_row[(gl % nbs) * nfmax + slot0];
    T *kf = Kf + ((size_t)(bw / groups) * nfmax + slot0) * d;
    T *vf = Vf + ((size_t)(bw / groups) * nfmax + slot0) * d;
    if (R0 < 0) {
      for (int t = threadIdx.x; t < p * d; t += kRow) kf[t] = vf[t] = T(0.0f);
      continue;
    }
    const int l = gfma_level_of(lv, R0);
    const size_t base = gfma_at(lv, l, 0, gl / nbs, R0 - lv.row[l]);
    const size_t channel = (size_t)lv.BH * lv.nr[l];
    // element t = f·p + r, stepped by kRow without a division per element
    const int dr = (int)kRow % p, df = (int)kRow / p;
    int r = (int)threadIdx.x % p, f = (int)threadIdx.x / p;
    for (int t = threadIdx.x; t < p * d; t += kRow) {
      kf[r * d + f] = XK[base + f * channel + r];
      vf[r * d + f] = XV[base + f * channel + r];
      r += dr, f += df;
      if (r >= p) r -= p, f++;
    }
  }
}

// The first of the references [lo, hi) (sorted by source) whose source is ≥ s.
__device__ int first_source(const gfma_refs &refs, int lo, int hi, int slots, int s) {
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (refs.ref[mid] / slots < s)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

// The references of summary row k that head h's sources [s0, s1) make: [*a, *b) in refs.ref
// (binary searches: a coarse row has thousands; none where the chunk holds all of the head's
// sources, [0, nbs), the row's whole range)
__device__ void ref_range(const gfma_refs &refs, int k, int slots, int s0, int s1, int nbs, int *a,
                          int *b) {
  *a = s0 == 0 ? refs.off[k] : first_source(refs, refs.off[k], refs.off[k + 1], slots, s0);
  *b = s1 == nbs ? refs.off[k + 1] : first_source(refs, *a, refs.off[k + 1], slots, s1);
}

// The head and the slab's sources [s0, s1) of the chunk's blocks [g0, g1) that blockIdx.y
// stands for, in the scatter kernels.
struct scatter_head {
  int h, s0, s1;
};
__device__ inline scatter_head scatter_head_of(int nbs, int g0, int g1) {
  scatter_head x;
  x.h = g0 / nbs + (int)blockIdx.y;
  x.s0 = g0 - x.h * nbs > 0 ? g0 - x.h * nbs : 0;
  x.s1 = g1 - x.h * nbs < nbs ? g1 - x.h * nbs : nbs;
  return x;
}

// Where reference e's gradient row lies in dKf, dVf (chunk blocks, nfmax, d).
__device__ inline size_t far_grad_row(const gfma_refs &refs, int e, int h, int nbs, int nfmax,
                                      int g0, int d) {
  return ((size_t)(h * nbs + refs.ref[e] / nfmax - g0) * nfmax + refs.ref[e] % nfmax) * d;
}

// grid (refs.heavy, heads of the chunk), block (kRow, kWarps): dXK, dXV += the far gradients dKf,
// dVf (chunk blocks, nfmax, d) of every reference to a summary row with many (a coarse level's)
// from the chunk's blocks: the transpose of the gather, per target row. The references are cut
// into kWarps consecutive shares, one per warp (lanes along f), and the shares' sums are added in
// warp order: a fixed order, so no atomics and no dependence on scheduling. CPU twin:
// scatter_add.
__global__ void scatter_far(float *dXK, float *dXV, const float *dKf, const float *dVf,
                            gfma_refs refs, gfma_levels lv, int nbs, int nfmax, int g0, int g1) {
  __shared__ float part[2][kWarps][kRow];
  const int k = refs.heavy[blockIdx.x], R = refs.row[k];
  const scatter_head x = scatter_head_of(nbs, g0, g1);
  int a, b;
  ref_range(refs, k, nfmax, x.s0, x.s1, nbs, &a, &b);
  if (a == b) return;  // the whole block: a and b are the same for every thread
  const int l = gfma_level_of(lv, R), share = (b - a + kWarps - 1) / kWarps;
  const int e0 = a + threadIdx.y * share, e1 = e0 + share < b ? e0 + share : b;
  for (int f0 = 0; f0 < lv.d; f0 += kRow) {
    const int f = f0 + threadIdx.x;
    float ak = 0.0f, av = 0.0f;
    for (int e = e0; e < e1 && f < lv.d; e++) {
      const size_t src = far_grad_row(refs, e, x.h, nbs, nfmax, g0, lv.d);
      ak += dKf[src + f];
      av += dVf[src + f];
    }
    part[0][threadIdx.y][threadIdx.x] = ak;
    part[1][threadIdx.y][threadIdx.x] = av;
    __syncthreads();
    if (threadIdx.y == 0 && f < lv.d) {
      float sk = 0.0f, sv = 0.0f;
      for (int w = 0; w < (int)kWarps; w++) {
        sk += part[0][w][threadIdx.x];
        sv += part[1][w][threadIdx.x];
      }
      const size_t at = gfma_at(lv, l, f, x.h, R - lv.row[l]);
      dXK[at] += sk;
      dXV[at] += sv;
    }
    __syncthreads();  // part is written again for the next channels
  }
}

// scatter_far for the summary rows with few references (refs.light: the fine levels', most
// rows), one warp each, kWarps rows a block: grid (refs.light / kWarps rounded up, heads of the
// chunk), block (kRow, kWarps). The warp forms scatter_far's kWarps shares one after another
// and adds their sums in the same order: the same bits, where a block of 8 warps per row spent
// most of its time starting and waiting on rows of a few references.
__global__ void scatter_far_light(float *dXK, float *dXV, const float *dKf, const float *dVf,
                                  gfma_refs refs, gfma_levels lv, int nbs, int nfmax, int g0,
                                  int g1) {
  const int i = (int)(blockIdx.x * kWarps + threadIdx.y);
  if (i >= refs.nlight) return;  // the whole warp
  const int k = refs.light[i], R = refs.row[k];
  const scatter_head x = scatter_head_of(nbs, g0, g1);
  int a, b;
  ref_range(refs, k, nfmax, x.s0, x.s1, nbs, &a, &b);
  if (a == b) return;
  const int l = gfma_level_of(lv, R), share = (b - a + kWarps - 1) / kWarps;
  for (int f = threadIdx.x; f < lv.d; f += kRow) {
    float sk = 0.0f, sv = 0.0f;
    for (int w = 0; w < (int)kWarps; w++) {
      const int e0 = a + w * share, e1 = e0 + share < b ? e0 + share : b;
      float ak = 0.0f, av = 0.0f;
      for (int e = e0; e < e1; e++) {
        const size_t src = far_grad_row(refs, e, x.h, nbs, nfmax, g0, lv.d);
        ak += dKf[src + f];
        av += dVf[src + f];
      }
      sk += ak;
      sv += av;
    }
    const size_t at = gfma_at(lv, l, f, x.h, R - lv.row[l]);
    dXK[at] += sk;
    dXV[at] += sv;
  }
}

// ------------------------------------------------------------------------------------------------
// the chunk loop

long total_blocks(const gfma *g) { return g->BH * g->nbs; }

gfma_mask mask_of(const gfma *g) {
  // the kernels index blocks, rows and score columns in 32 bits
  gpu_int(g->BH * g->nbs * g->m, "query rows of the slab");
  gpu_int(g->nb * g->m, "tokens of the sequence");
  return gfma_mask{(int)g->m, (int)g->nb, (int)g->b0, (int)g->nbs, g->ns,
                   g->nfmax,  g->causal,  g->far_row, g->far_logw};
}

// Query blocks per chunk: as many as the budget holds (at least one), whose workspace is
// per_block bytes each.
long chunk_size(const gfma *g, size_t per_block) {
  long c = (long)(gfma_workspace_budget() / (per_block ? per_block : 1));
  if (c < 1) c = 1;
  return c < total_blocks(g) ? c : total_blocks(g);
}

// The near field's products: one per chunk and kind, whatever blocks the chunk holds. Block g of
// the chunk (flattened over heads: head g / nbs, slab block g % nbs) reads the key rows of its near
// offsets in place, from key block b − 1 + lo of its head on; the products' pointers are built on
// the device (near_pointers, one table per product), or, without a halo and away from the ends,
// follow one stride (a strided product). Within the key array a key block outside the
// sequence is another head's rows (or, without a halo, the neighbouring block of the flattened
// array), masked by the softmax whatever it holds; only the array's two ends can be passed, by
// the sequence's first query block (offset 0) and, bidirectional, its last (offset 2). Those read
// a copy of the end, padded with a zero block (near_ends). So a chunk runs 2 near products forward
// and 3 + 2·ns backward (scores, dP and dq over all offsets at once; dv and dk, whose outputs are
// the key blocks, one per offset).
struct near_geom {
  long m, d, nbs, b0, kstride, klo, rows;  // rows: of the whole key array, BH·kstride
  bool flat;                               // no halo: heads' keys follow one another as queries do
};

near_geom geom_of(const gfma *g, long klo, long kstride) {
  return near_geom{g->m,    g->d, g->nbs,          g->b0,
                   kstride, klo,  g->BH * kstride, kstride == g->T && klo == g->st->t0};
}

// Block g's first key row for offset lo, in the key array (< 0 or past its end at its ends).
// Blocks and their heads in 32 bits (the host checks the slab's rows, mask_of): no 64-bit
// division on the device.
__host__ __device__ inline long near_row(const near_geom &k, long g, int lo) {
  if (k.flat) return (g - 1 + lo) * k.m;
  const int h = (int)g / (int)k.nbs, b = (int)g % (int)k.nbs;
  return h * k.kstride + (k.b0 + b - 1 + lo) * k.m - k.klo;
}

// Where a product's operand lies for block g = ga + e: on the query side at q + e·stride; on the
// key side (key) at the key rows of offset lo in `keys` (first, last: its padded ends). Elements
// of es bytes (a bf16 operand, or fp32), offsets in elements.
struct near_operand {
  const char *q;
  long stride;
  bool key;
  const char *keys, *first, *last;
  long es;
};

__device__ inline void *near_at(const near_operand &o, const near_geom &k, long g, long e, int lo,
                                long keys, int ns) {
  if (!o.key) return const_cast<char *>(o.q + e * o.stride * o.es);
  const long r = near_row(k, g, lo);
  const char *p = o.keys + r * k.d * o.es;
  if (r < 0) p = o.first + (r + k.m) * k.d * o.es;
  if (r + keys > k.rows) p = o.last + (r - k.rows + (ns - 1) * k.m) * k.d * o.es;
  return const_cast<char *>(p);
}

// The pointer table (B, A, C, as gpu_gemm_table takes it) of blocks ga … ga + count − 1.
__global__ void near_pointers(void **table, int count, near_operand A, near_operand B,
                              near_operand C, near_geom k, long ga, int lo, long keys, int ns) {
  for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < count; e += gridDim.x * blockDim.x) {
    table[e] = near_at(B, k, ga + e, e, lo, keys, ns);
    table[count + e] = near_at(A, k, ga + e, e, lo, keys, ns);
    table[2 * count + e] = near_at(C, k, ga + e, e, lo, keys, ns);
  }
}

// One near product over blocks [ga, gb) (as gpu_gemm_as: row-major, C = alpha·op(A)·op(B) +
// beta·C, A and B stored as `type`, C fp32), its key side the `keys` rows from offset lo.
void near_gemm(gpu_elem type, const near_geom &k, void **table, bool ta, bool tb, long M, long N,
               long K, float alpha, const near_operand &A, long lda, const near_operand &B,
               long ldb, float beta, const near_operand &C, long ldc, long ga, long gb, int lo,
               long keys, int ns) {
  const long count = gb - ga;
  if (count <= 0) return;
  // without a halo, blocks that pass no end of the keys read them at one stride (m·d, as their
  // queries): a strided product, no table to build
  if (k.flat && near_row(k, ga, lo) >= 0 && near_row(k, gb - 1, lo) + keys <= k.rows) {
    auto at = [&](const near_operand &o) {
      return o.key ? o.keys + near_row(k, ga, lo) * k.d * o.es : o.q;
    };
    auto stride = [&](const near_operand &o) { return o.key ? k.m * k.d : o.stride; };
    gpu_gemm_as(type, ta, tb, M, N, K, alpha, at(A), lda, stride(A), at(B), ldb, stride(B), beta,
                reinterpret_cast<float *>(const_cast<char *>(at(C))), ldc, stride(C), count);
    return;
  }
  near_pointers<<<grid_of((size_t)count), kThreads, 0, gpu_stream()>>>(
      table, gpu_int(count, "near blocks"), A, B, C, k, ga, lo, keys, ns);
  LAUNCH_CHECK(near_pointers);
  gpu_gemm_table(type, ta, tb, M, N, K, alpha, lda, ldb, beta, ldc, count, table, count, count);
}

// The key array's ends padded with a zero block, as near_at reads them: first holds rows
// −m … (ns − 1)·m − 1, last rows R − (ns − 1)·m … R + m − 1 (R the array's rows). Filled, in buf
// (2·ns·m·d elements of es bytes, in the workspace), only where the chunk's blocks [g0, g1) pass
// an end.
struct near_ends {
  char *first = nullptr, *last = nullptr;
};

near_ends ends_of(const gfma *g, const near_geom &k, const char *keys, long es, long g0, long g1,
                  char *buf) {
  near_ends e;
  const long blk = k.m * k.d, tail = (g->ns - 1) * blk;  // elements
  if (near_row(k, g0, 0) < 0) {
    e.first = buf;
    gpu_memset0(e.first, es * blk);
    gpu_copy(e.first + es * blk, keys, es * tail);
  }
  if (near_row(k, g1 - 1, 0) + g->ns * k.m > k.rows) {
    e.last = buf + es * (blk + tail);
    gpu_copy(e.last, keys + es * (k.rows * k.d - tail), es * tail);
    gpu_memset0(e.last + es * tail, es * blk);
  }
  return e;
}

// The query side of a near product: block ga's matrix at p, the next block's stride elements on.
near_operand query_side(const void *p, long stride, long es) {
  return near_operand{static_cast<const char *>(p), stride, false, nullptr, nullptr, nullptr, es};
}

// The key side read over all offsets (scores, values, dP, dq): keys, and its padded ends.
near_operand key_side(const void *keys, const near_ends &e, long es) {
  return near_operand{nullptr, 0, true, static_cast<const char *>(keys), e.first, e.last, es};
}

// The blocks of [g0, g1) whose key block of offset s lies in the key array (those of dv and dk
// for offset s; only the array's ends fall out): [*ga, *gb).
void blocks_in_keys(const near_geom &k, long g0, long g1, int s, long *ga, long *gb) {
  *ga = g0;
  *gb = g1;
  while (*ga < *gb && near_row(k, *ga, s) < 0) ++*ga;
  while (*gb > *ga && near_row(k, *gb - 1, s) + k.m > k.rows) --*gb;
}

// What the products of an evaluation read: q, k, v (and dout in backward) and the summaries XK,
// XV, as they lie (fp32 products), or bf16 copies (bf16 products: cuBLAS takes no mix of the two,
// and the probabilities the softmax writes are bf16). The caller's copies of q, k, v where it
// made them (gfma_copies); else k, v and the summaries are copied once per evaluation (a block's
// near keys and far summaries lie anywhere), q and dout per chunk, only the chunk's rows
// (chunk_of, into the chunk's workspace).
struct operands {
  gpu_elem type;
  long es;                   // bytes per element
  const float *q, *dout;     // fp32, copied per chunk with bf16 products
  const char *q16, *dout16;  // bf16 copies of q and dout, every row (gfma_copies), or nullptr
  const char *k, *v, *XK, *XV;
  void *copies;  // the bf16 copies this evaluation made (nullptr with fp32 products)
};

operands operands_open(const gfma *g, const float *q, const float *k, const float *v,
                       const float *dout, long kstride, const float *XK, const float *XV,
                       const gfma_copies *made) {
  operands o = {};
  o.q = q, o.dout = dout;
  auto fp32 = [](const float *x) { return reinterpret_cast<const char *>(x); };
  if (!gpu_bf16()) {
    o.type = GPU_F32;
    o.es = sizeof(float);
    o.k = fp32(k), o.v = fp32(v), o.XK = fp32(XK), o.XV = fp32(XV);
    return o;
  }
  o.type = GPU_BF16;
  o.es = sizeof(__nv_bfloat16);
  const gfma_copies none = {};
  if (!made) made = &none;
  o.q16 = static_cast<const char *>(made->q);
  o.dout16 = static_cast<const char *>(made->dout);
  const size_t nk = (size_t)(g->BH * kstride * g->d),
               nx = XK ? (size_t)(g->d * g->BH * g->st->rows) : 0;
  const size_t n[4] = {made->k ? 0 : nk, made->v ? 0 : nk, nx, XV ? nx : 0};
  o.k = static_cast<const char *>(made->k), o.v = static_cast<const char *>(made->v);
  const float *src[4] = {k, v, XK, XV};
  const char **dst[4] = {&o.k, &o.v, &o.XK, &o.XV};
  auto *buf = static_cast<char *>(gpu_alloc(MEM_WORKSPACE, o.es * (n[0] + n[1] + n[2] + n[3] + 1)));
  o.copies = buf;
  for (int i = 0; i < 4; i++) {
    if (!n[i]) continue;
    gpu_to_bf16(buf, src[i], n[i]);
    *dst[i] = buf;
    buf += o.es * n[i];
  }
  return o;
}

// The inputs of one chunk's evaluation.
struct chunk {
  long g0, g1;
  const operands *x;     // k and v from their array's row 0
  const char *q, *dout;  // the chunk's rows, from block g0 on (bf16: the workspace's copies)
  long klo, kstride;
  float *S;       // (blocks, m, ld): the scores
  void *P;        // their probabilities: S itself, or (bf16 products) a bf16 array
  char *Kf, *Vf;  // (blocks, nfmax, d), as the operands
  long ld;
  near_geom geo;           // where the blocks' near keys lie
  void **table;            // the near products' pointer table (workspace)
  near_ends kends, vends;  // k's and v's ends, padded, where the chunk's blocks pass them
};

// Block g's rows (rows_per_block) of the chunk's query-side operand `base` (c.q, c.dout: block
// c.g0's rows).
const char *rows_at(const chunk &c, const char *base, long g, long rows_per_block) {
  return base + (g - c.g0) * rows_per_block * c.x->es;
}

// S = the chunk's scores, P2P then M2P (block_scores): unmasked, unweighted.
void scores(const gfma *g, const chunk &c) {
  const long m = g->m, d = g->d, ld = c.ld, es = c.x->es;
  const float scale = 1.0f / sqrtf((float)d);
  const int ns = g->ns;
  // one product over the chunk's blocks and every near key block they read (key block b − 1 + s
  // at column s·m of block b's scores)
  {
    const gpu_op_time t(TIMER_P2P);
    near_gemm(c.x->type, c.geo, c.table, false, true, m, ns * m, d, scale,
              query_side(c.q, m * d, es), d, key_side(c.x->k, c.kends, es), d, 0.0f,
              query_side(c.S, m * ld, sizeof(float)), ld, c.g0, c.g1, 0, ns * m, ns);
  }
  if (g->nfmax) {
    const gpu_op_time t(TIMER_M2P);
    gpu_gemm_as(c.x->type, false, true, m, g->nfmax, d, scale, c.q, d, m * d, c.Kf, d, g->nfmax * d,
                0.0f, c.S + g->ns * m, ld, m * ld, c.g1 - c.g0);
  }
}

// o (chunk rows, d) = P·[v_near | V_far] (fma_P2P_values, fma_M2P_values): the near product
// writes o, the far one adds to it.
void values(const gfma *g, const chunk &c, float *o) {
  const long m = g->m, d = g->d, ld = c.ld, es = c.x->es;
  const int ns = g->ns;
  {
    const gpu_op_time t(TIMER_P2P);
    near_gemm(c.x->type, c.geo, c.table, false, false, m, d, ns * m, 1.0f,
              query_side(c.P, m * ld, es), ld, key_side(c.x->v, c.vends, es), d, 0.0f,
              query_side(o, m * d, sizeof(float)), d, c.g0, c.g1, 0, ns * m, ns);
  }
  if (g->nfmax) {
    const gpu_op_time t(TIMER_M2P);
    gpu_gemm_as(c.x->type, false, false, m, d, g->nfmax, 1.0f,
                static_cast<const char *>(c.P) + g->ns * m * es, ld, m * ld, c.Vf, d, g->nfmax * d,
                1.0f, o, d, m * d, c.g1 - c.g0);
  }
}

// The probabilities' bf16 array, where the products read one (nullptr: in place in S).
__nv_bfloat16 *bf16_of(const chunk &c) {
  return c.P == c.S ? nullptr : static_cast<__nv_bfloat16 *>(c.P);
}

unsigned soft_grid(long rows) {
  return gpu_int((rows + kSoftRows - 1) / kSoftRows, "softmax row groups");
}
dim3 soft_block() { return dim3(kLanes, kSoftRows); }

void launch_softmax(const gfma *g, const chunk &c, float *lse) {
  const gpu_op_time t(TIMER_P2P);  // the fused softmax over [near | far] counts as near field
  const long rows = (c.g1 - c.g0) * g->m;
  const int nrows = gpu_int(rows, "softmax rows"), ld = (int)c.ld;
  const gfma_mask mk = mask_of(g);
  if (ld <= 8 * (int)kLanes) {  // rows up to 256 columns, or 512, held in registers
    softmax_forward_held<8><<<soft_grid(rows), soft_block(), 0, gpu_stream()>>>(
        c.S, lse, ld, mk, (int)c.g0, nrows, bf16_of(c));
    LAUNCH_CHECK(softmax_forward_held<8>);
  } else if (ld <= 16 * (int)kLanes) {
    softmax_forward_held<16><<<soft_grid(rows), soft_block(), 0, gpu_stream()>>>(
        c.S, lse, ld, mk, (int)c.g0, nrows, bf16_of(c));
    LAUNCH_CHECK(softmax_forward_held<16>);
  } else {
    softmax_forward<<<soft_grid(rows), soft_block(), 0, gpu_stream()>>>(c.S, lse, ld, mk, (int)c.g0,
                                                                        nrows, bf16_of(c));
    LAUNCH_CHECK(softmax_forward);
  }
}

template <class T>
void gather_as(const gfma *g, const chunk &c, long pairs) {
  const size_t blocks = gpu_blocks((size_t)pairs, kGather);
  gather_far<T>
      <<<(unsigned)(blocks < 65535 ? blocks : 65535), dim3(kRow, kGather), 0, gpu_stream()>>>(
          reinterpret_cast<T *>(c.Kf), reinterpret_cast<T *>(c.Vf),
          reinterpret_cast<const T *>(c.x->XK), reinterpret_cast<const T *>(c.x->XV), g->far_row,
          g->lv, (int)g->nbs, g->nfmax, (int)c.g0, gpu_int(pairs, "far pairs"));
  LAUNCH_CHECK(gather_far<T>);
}

void launch_gather(const gfma *g, const chunk &c) {
  const long pairs = (c.g1 - c.g0) * (g->nfmax / g->p);  // (block, listed window)
  if (pairs == 0) return;
  const gpu_op_time t(TIMER_M2P);
  if (c.x->type == GPU_BF16)
    gather_as<__nv_bfloat16>(g, c, pairs);
  else
    gather_as<float>(g, c, pairs);
}

// The chunk's workspace: scores (and in backward their gradients), the gathered summaries (and
// the gradients of their rows); with bf16 products, the probabilities (and later their gradients)
// in bf16.
struct workspace {
  long blocks;  // query blocks per chunk
  float *S, *dP, *dKf, *dVf, *o, *D;
  char *Kf, *Vf;     // as the operands
  void *Pb;          // bf16 products: (blocks, m, ld) bf16
  char *qb, *doutb;  // bf16 products: the chunk's q and dout rows, (blocks, m, d) bf16, in Pb's
                     // block after P
  void **table;      // the near products' pointers (3 per block), reused in stream order
  char *ends;        // k's and v's padded ends (near_ends), 2·ns·m·d elements each
};

workspace workspace_open(const gfma *g, const operands &x, bool backward) {
  const long m = g->m, d = g->d, ld = g->ns * m + g->nfmax, nf = g->nfmax * d;
  const bool bf16 = x.type == GPU_BF16;
  // per query block: S (m·ld) and Kf, Vf (nfmax·d each); backward: dP, dKf, dVf too, and for
  // fma_linear the near field's own output and D (m·d + m); bf16 products: P (m·ld) and the
  // copies of q (and dout) (m·d), bf16, unless whole copies exist; and 3 pointers of the near
  // products
  const long copies = (x.q16 ? 0 : 1) + (backward && !x.dout16 ? 1 : 0);
  const size_t per =
      sizeof(float) * (backward ? 2 * m * ld + 2 * nf + m * d + m : m * ld) + x.es * 2 * nf +
      (bf16 ? sizeof(__nv_bfloat16) * (m * ld + copies * m * d) : 0) + 3 * sizeof(void *);
  workspace w = {};
  w.blocks = chunk_size(g, per);
  auto bytes = [&](size_t n) { return static_cast<char *>(gpu_alloc(MEM_WORKSPACE, n)); };
  auto get = [&](long floats) {
    return reinterpret_cast<float *>(bytes(sizeof(float) * (w.blocks * floats + 1)));
  };
  w.table = reinterpret_cast<void **>(bytes(3 * sizeof(void *) * w.blocks));
  w.ends = bytes(x.es * 4 * g->ns * m * d);
  w.S = get(m * ld);
  w.Kf = bytes(x.es * (w.blocks * nf + 1));
  w.Vf = bytes(x.es * (w.blocks * nf + 1));
  if (bf16) {  // P, then the chunk's copies of q and dout, in one block (fewer for the pool)
    const size_t np = w.blocks * m * ld, nq = w.blocks * m * d;
    w.Pb = bytes(sizeof(__nv_bfloat16) * (np + copies * nq + 1));
    char *next = static_cast<char *>(w.Pb) + sizeof(__nv_bfloat16) * np;
    if (!x.q16) w.qb = next, next += sizeof(__nv_bfloat16) * nq;
    if (backward && !x.dout16) w.doutb = next;
  }
  if (!backward) return w;
  w.dP = get(m * ld);
  w.dKf = get(nf);
  w.dVf = get(nf);
  if (g->linear) {
    w.o = get(m * d);
    w.D = get(m);
  }
  return w;
}

void workspace_close(workspace *w) {
  for (void *p :
       {(void *)w->S, (void *)w->dP, (void *)w->Kf, (void *)w->Vf, (void *)w->dKf, (void *)w->dVf,
        (void *)w->o, (void *)w->D, (void *)w->ends, w->Pb, (void *)w->table})
    gpu_free(p);
}

chunk chunk_of(const gfma *g, const workspace &w, long g0, const operands *x, long klo,
               long kstride) {
  chunk c = {};
  c.g0 = g0;
  c.g1 = g0 + w.blocks < total_blocks(g) ? g0 + w.blocks : total_blocks(g);
  c.x = x;
  c.klo = klo, c.kstride = kstride;
  c.S = w.S, c.Kf = w.Kf, c.Vf = w.Vf;
  c.P = w.Pb ? w.Pb : static_cast<void *>(w.S);
  // the chunk's q and dout rows: in place, or copied into bf16
  const size_t at = (size_t)(c.g0 * g->m * g->d), rows = (size_t)((c.g1 - c.g0) * g->m * g->d);
  auto chunk_rows = [&](const float *src, char *copy) -> const char * {
    if (!src) return nullptr;
    if (!copy) return reinterpret_cast<const char *>(src + at);
    gpu_to_bf16(copy, src + at, rows);
    return copy;
  };
  c.q = x->q16 ? x->q16 + at * x->es : chunk_rows(x->q, w.qb);
  c.dout = x->dout16 ? x->dout16 + at * x->es : chunk_rows(x->dout, w.doutb);
  c.ld = g->ns * g->m + g->nfmax;
  c.geo = geom_of(g, klo, kstride);
  c.table = w.table;
  const long half = 2 * g->ns * g->m * g->d;  // k's ends, then v's
  c.kends = ends_of(g, c.geo, x->k, x->es, c.g0, c.g1, w.ends);
  c.vends = ends_of(g, c.geo, x->v, x->es, c.g0, c.g1, w.ends + x->es * half);
  return c;
}

// The chunk's transposes after its scores are in c.S (fma_evaluate_backward's block loop): P from
// lse, dP = dout·[v_near | V_far]ᵀ, dv += P_nᵀ·dout, dVf = P_fᵀ·dout, dS from D (the chunk's
// rows), dq += dS·[k_near | K_far]/√d, dk += dS_nᵀ·q/√d, dKf = dS_fᵀ·q/√d. With bf16 products P
// and then dS are the bf16 array c.P (dS written once dv and dVf have read P, in stream order).
void chunk_backward(const gfma *g, const chunk &c, const workspace &w, float *dq, float *dk,
                    float *dv, const float *dout, const float *lse, const float *D) {
  const long m = g->m, d = g->d, ld = c.ld, nc = c.g1 - c.g0, nf = g->nfmax, es = c.x->es;
  const float scale = 1.0f / sqrtf((float)d);
  const unsigned rows = gpu_int(nc * m, "score rows");
  const gpu_elem type = c.x->type;
  const long f4 = sizeof(float);
  // device time: the near field's products and the fused softmax's passes TIMER_P2P, the far
  // field's products TIMER_M2P
  // (the backward's two softmax kernels read each column once either way; holding the row in
  // registers, as the forward does, measured slower on the H200: docs/gpu.md)
  int span = gpu_op_begin(TIMER_P2P);
  probabilities<<<soft_grid(rows), soft_block(), 0, gpu_stream()>>>(
      c.S, lse, (int)ld, mask_of(g), (int)c.g0, (int)rows, bf16_of(c));
  LAUNCH_CHECK(probabilities);
  gpu_op_end(span);
  const char *P = static_cast<const char *>(c.P);
  if (!D) {  // fma_linear: D of the near field's own output (linear_near_backward)
    values(g, c, w.o);
    gpu_rows_dot(w.D, dout + c.g0 * m * d, w.o, nc * m, d);
    D = w.D;
  }
  span = gpu_op_begin(TIMER_P2P);
  const int ns = g->ns;
  // dP of the near columns, every offset at once; dv key block by key block (one product per
  // offset over the blocks whose key block it is in the array: outputs of one product must differ)
  near_gemm(type, c.geo, c.table, false, true, m, ns * m, d, 1.0f, query_side(c.dout, m * d, es), d,
            key_side(c.x->v, c.vends, es), d, 0.0f, query_side(w.dP, m * ld, f4), ld, c.g0, c.g1, 0,
            ns * m, ns);
  const near_operand dv_side = {nullptr, 0,       true, reinterpret_cast<char *>(dv),
                                nullptr, nullptr, f4};
  for (int s = 0; s < ns; s++) {
    long ga, gb;
    blocks_in_keys(c.geo, c.g0, c.g1, s, &ga, &gb);
    near_gemm(type, c.geo, c.table, true, false, m, d, m, 1.0f,
              query_side(P + ((ga - c.g0) * m * ld + s * m) * es, m * ld, es), ld,
              query_side(rows_at(c, c.dout, ga, m * d), m * d, es), d, 1.0f, dv_side, d, ga, gb, s,
              m, ns);
  }
  gpu_op_end(span);
  if (nf) {
    const gpu_op_time t(TIMER_M2P);
    gpu_gemm_as(type, false, true, m, nf, d, 1.0f, c.dout, d, m * d, c.Vf, d, nf * d, 0.0f,
                w.dP + g->ns * m, ld, m * ld, nc);
    gpu_gemm_as(type, true, false, nf, d, m, 1.0f, P + g->ns * m * es, ld, m * ld, c.dout, d, m * d,
                0.0f, w.dVf, d, nf * d, nc);
  }
  span = gpu_op_begin(TIMER_P2P);
  // dS: in place in dP, or (bf16 products) into c.P from the scores in c.S
  const char *dS = w.Pb ? P : reinterpret_cast<const char *>(w.dP);
  softmax_backward<<<soft_grid(rows), soft_block(), 0, gpu_stream()>>>(
      w.dP, c.S, D, (int)ld, mask_of(g), (int)c.g0, (int)rows, lse, bf16_of(c));
  LAUNCH_CHECK(softmax_backward);
  // dq from every near key block at once; dk key block by key block
  near_gemm(type, c.geo, c.table, false, false, m, d, ns * m, scale, query_side(dS, m * ld, es), ld,
            key_side(c.x->k, c.kends, es), d, 1.0f, query_side(dq + c.g0 * m * d, m * d, f4), d,
            c.g0, c.g1, 0, ns * m, ns);
  const near_operand dk_side = {nullptr, 0,       true, reinterpret_cast<char *>(dk),
                                nullptr, nullptr, f4};
  for (int s = 0; s < ns; s++) {
    long ga, gb;
    blocks_in_keys(c.geo, c.g0, c.g1, s, &ga, &gb);
    near_gemm(type, c.geo, c.table, true, false, m, d, m, scale,
              query_side(dS + ((ga - c.g0) * m * ld + s * m) * es, m * ld, es), ld,
              query_side(rows_at(c, c.q, ga, m * d), m * d, es), d, 1.0f, dk_side, d, ga, gb, s, m,
              ns);
  }
  gpu_op_end(span);
  if (nf) {
    const gpu_op_time t(TIMER_M2P);
    gpu_gemm_as(type, false, false, m, d, nf, scale, dS + g->ns * m * es, ld, m * ld, c.Kf, d,
                nf * d, 1.0f, dq + c.g0 * m * d, d, m * d, nc);
    gpu_gemm_as(type, true, false, nf, d, m, scale, dS + g->ns * m * es, ld, m * ld, c.q, d, m * d,
                0.0f, w.dKf, d, nf * d, nc);
  }
}

// dXK, dXV += the chunk's far gradients (w.dKf, w.dVf), row by referenced summary row: the
// rows of few references a warp each, the others a block each.
void launch_scatter(const gfma *g, const chunk &c, const workspace &w, float *dXK, float *dXV) {
  const gfma_refs &refs = g->far_refs;
  const unsigned heads = (unsigned)((c.g1 - 1) / g->nbs - c.g0 / g->nbs + 1);
  const gpu_op_time t(TIMER_M2P);
  if (refs.nlight) {
    const dim3 grid(gpu_int((refs.nlight + kWarps - 1) / kWarps, "light summary rows"), heads);
    scatter_far_light<<<grid, dim3(kRow, kWarps), 0, gpu_stream()>>>(
        dXK, dXV, w.dKf, w.dVf, refs, g->lv, (int)g->nbs, g->nfmax, (int)c.g0, (int)c.g1);
    LAUNCH_CHECK(scatter_far_light);
  }
  if (refs.nheavy) {
    const dim3 grid(gpu_int(refs.nheavy, "summary rows"), heads);
    scatter_far<<<grid, dim3(kRow, kWarps), 0, gpu_stream()>>>(
        dXK, dXV, w.dKf, w.dVf, refs, g->lv, (int)g->nbs, g->nfmax, (int)c.g0, (int)c.g1);
    LAUNCH_CHECK(scatter_far);
  }
}

void check_heads(const gfma *g) {
  if (g->BH > 65535)
    error_at(__FILE__, __func__, __LINE__,
             "fma on the GPU: %ld heads × batch exceed the grid's 65,535", g->BH);
}

}  // namespace

size_t gfma_workspace_budget(void) { return budget_bytes ? budget_bytes : kDefaultBudget; }

extern "C" void gpu_fma_set_workspace(size_t bytes) { budget_bytes = bytes; }

void gfma_evaluate_forward(const gfma *g, float *out, float *lse, const float *q, const float *k,
                           const float *v, long klo, long kstride, const float *XK, const float *XV,
                           const gfma_copies *made) {
  check_heads(g);
  const operands x = operands_open(g, q, k, v, nullptr, kstride, XK, XV, made);
  workspace w = workspace_open(g, x, false);
  for (long g0 = 0; g0 < total_blocks(g); g0 += w.blocks) {
    const chunk c = chunk_of(g, w, g0, &x, klo, kstride);
    launch_gather(g, c);
    scores(g, c);
    launch_softmax(g, c, lse);
    values(g, c, out + g0 * g->m * g->d);
  }
  workspace_close(&w);
  gpu_free(x.copies);
}

void gfma_evaluate_backward(const gfma *g, float *dq, float *dk, float *dv, float *dXK, float *dXV,
                            const float *dout, const float *out, const float *q, const float *k,
                            const float *v, long klo, long kstride, const float *XK,
                            const float *XV, const float *lse, const gfma_copies *made) {
  check_heads(g);
  const long rows = g->BH * g->T;
  float *D = nullptr;  // fma: Σ dout·out per row; fma_linear: per chunk, of the near field alone
  gfma_copies all = made ? *made : gfma_copies{};
  void *dout16 = nullptr;  // fma, bf16 products: dout's copy, made by the pass that sums D
  if (!g->linear) {
    D = static_cast<float *>(gpu_alloc(MEM_WORKSPACE, sizeof(float) * (rows + 1)));
    if (gpu_bf16())
      dout16 = gpu_alloc(MEM_WORKSPACE, sizeof(__nv_bfloat16) * (size_t)(rows * g->d + 1));
    gpu_rows_dot_copy(D, dout, out, rows, g->d, dout16);
    all.dout = dout16;
  }
  const operands x = operands_open(g, q, k, v, dout, kstride, XK, XV, &all);
  workspace w = workspace_open(g, x, true);
  for (long g0 = 0; g0 < total_blocks(g); g0 += w.blocks) {
    const chunk c = chunk_of(g, w, g0, &x, klo, kstride);
    launch_gather(g, c);
    scores(g, c);
    chunk_backward(g, c, w, dq, dk, dv, dout, lse, D ? D + g0 * g->m : nullptr);
    if (g->nfmax) launch_scatter(g, c, w, dXK, dXV);
  }
  workspace_close(&w);
  gpu_free(x.copies);
  gpu_free(dout16);
  gpu_free(D);
}
