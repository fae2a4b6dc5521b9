// FMA evaluation on the GPU, the twin of src/fma/evaluate.c: query blocks in chunks sized to a
// budget; per chunk the near (P2P) and far (M2P, gathered listed summaries) scores as batched
// GEMMs, one fused SIMT softmax over [near | far], then the value GEMMs. Backward recomputes the
// scores from lse; gradients several blocks touch are summed per target row in a fixed order.
#include "check.h"
#include "core/timer.h"
#include "fma_gpu.h"
#include "gpu.h"

namespace {

constexpr unsigned kThreads = 256;
constexpr unsigned kSoft = 64;   // threads per score row in the softmax
constexpr unsigned kRow = 32;    // threads per summary row in the gathers
constexpr unsigned kWarps = 8;   // warps per summary row in scatter_far, each a share of its refs
constexpr unsigned kGather = 8;  // listed windows per block in gather_far

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
__device__ inline bool visible(const gfma_mask &mk, int lb, int r, int c, float *add) {
  *add = 0.0f;
  if (c < mk.ns * mk.m) {
    const int kb = mk.b0 + lb - 1 + c / mk.m;
    if (kb < 0 || kb >= mk.nb) return false;
    return !mk.causal || kb * mk.m + c % mk.m <= (mk.b0 + lb) * mk.m + r;
  }
  const int slot = c - mk.ns * mk.m;
  if (mk.far_row[lb * mk.nfmax + slot] < 0) return false;
  *add = mk.far_logw[slot];
  return true;
}

// Block-wide max or sum of v over kSoft threads through red (kSoft floats); every thread gets it.
__device__ float block_reduce(float v, float *red, bool take_max) {
  red[threadIdx.x] = v;
  __syncthreads();
  for (unsigned o = kSoft / 2; o > 0; o >>= 1) {
    if (threadIdx.x < o)
      red[threadIdx.x] = take_max ? fmaxf(red[threadIdx.x], red[threadIdx.x + o])
                                  : red[threadIdx.x] + red[threadIdx.x + o];
    __syncthreads();
  }
  const float r = red[0];
  __syncthreads();  // red is written again by the next reduction
  return r;
}

// grid (rows of the chunk), block kSoft: one query row per block — its scores S (ld columns) become
// probabilities in place, masked columns 0, and lse = max + log Σ. Chunk row `row` is query r of
// flattened block g0 + row/m (head h, slab block lb). CPU twin: rows_softmax (evaluate.c), with
// the masks and log-weights of fma_P2P_scores and fma_M2P_scores.
__global__ void softmax_forward(float *S, float *lse, int ld, gfma_mask mk, int g0) {
  __shared__ float red[kSoft];
  const int row = blockIdx.x, gl = g0 + row / mk.m, lb = gl % mk.nbs, r = row % mk.m;
  float *s = S + (size_t)row * ld;
  float mx = -INFINITY;
  for (int c = threadIdx.x; c < ld; c += kSoft) {
    float add;
    const float v = visible(mk, lb, r, c, &add) ? s[c] + add : -INFINITY;
    s[c] = v;
    mx = fmaxf(mx, v);
  }
  mx = block_reduce(mx, red, true);
  float sum = 0.0f;
  for (int c = threadIdx.x; c < ld; c += kSoft) sum += expf(s[c] - mx);
  sum = block_reduce(sum, red, false);
  const float inv = 1.0f / sum;  // sum ≥ 1: the query sees itself
  for (int c = threadIdx.x; c < ld; c += kSoft) s[c] = expf(s[c] - mx) * inv;
  if (threadIdx.x == 0) lse[(size_t)gl * mk.m + r] = mx + logf(sum);
}

// grid (rows of the chunk), block kSoft: P = exp(S + log-weight − lse) of one score row, masked
// 0. CPU twin: rows_probabilities.
__global__ void probabilities(float *S, const float *lse, int ld, gfma_mask mk, int g0) {
  const int row = blockIdx.x, gl = g0 + row / mk.m, lb = gl % mk.nbs, r = row % mk.m;
  const float L = lse[(size_t)gl * mk.m + r];
  float *s = S + (size_t)row * ld;
  for (int c = threadIdx.x; c < ld; c += kSoft) {
    float add;
    s[c] = visible(mk, lb, r, c, &add) ? expf(s[c] + add - L) : 0.0f;
  }
}

// grid (rows of the chunk), block kSoft: dS = P ∘ (dP − D) of one row in place in dP, masked 0
// (never read there). D: the chunk's rows. CPU twin: rows_softmax_backward.
__global__ void softmax_backward(float *dP, const float *P, const float *D, int ld, gfma_mask mk,
                                 int g0) {
  const int row = blockIdx.x, gl = g0 + row / mk.m, lb = gl % mk.nbs, r = row % mk.m;
  const size_t at = (size_t)row * ld;
  for (int c = threadIdx.x; c < ld; c += kSoft) {
    float add;
    dP[at + c] = visible(mk, lb, r, c, &add) ? P[at + c] * (dP[at + c] - D[row]) : 0.0f;
  }
}

// grid-stride: D[r] = Σ_f a[r, f]·b[r, f] over rows of d. CPU twin: rows_dot (attention/fma.c).
__global__ void rowdot(float *D, const float *a, const float *b, int rows, int d) {
  for (int r = blockIdx.x * blockDim.x + threadIdx.x; r < rows; r += gridDim.x * blockDim.x) {
    const float *x = a + (size_t)r * d, *y = b + (size_t)r * d;
    float acc = 0.0f;
    for (int f = 0; f < d; f++) acc += x[f] * y[f];
    D[r] = acc;
  }
}

// grid-stride over the chunk's (block, listed window) pairs, kGather per block, one warp each:
// Kf, Vf (blocks, nfmax, d) = the window's p summary rows of XK, XV (0 where its slots are
// empty). A window's rows are contiguous within a channel (the channels B·H·nr_l apart), so the
// lanes run along its rows first (element t: row t % p, channel t / p): each channel's p floats
// are read together, each row's channels written together. CPU twin: gather in block_keys.
__global__ void gather_far(float *Kf, float *Vf, const float *XK, const float *XV,
                           const int *far_row, gfma_levels lv, int nbs, int nfmax, int g0,
                           int pairs) {
  const int d = lv.d, p = lv.p, groups = nfmax / p;
  for (int bw = blockIdx.x * blockDim.y + threadIdx.y; bw < pairs; bw += gridDim.x * blockDim.y) {
    const int gl = g0 + bw / groups, slot0 = bw % groups * p;
    const int R0 = far_row[(gl % nbs) * nfmax + slot0];
    float *kf = Kf + ((size_t)(bw / groups) * nfmax + slot0) * d;
    float *vf = Vf + ((size_t)(bw / groups) * nfmax + slot0) * d;
    if (R0 < 0) {
      for (int t = threadIdx.x; t < p * d; t += kRow) kf[t] = vf[t] = 0.0f;
      continue;
    }
    const int l = gfma_level_of(lv, R0);
    const size_t base = gfma_at(lv, l, 0, gl / nbs, R0 - lv.row[l]);
    const size_t channel = (size_t)lv.BH * lv.nr[l];
    for (int t = threadIdx.x; t < p * d; t += kRow) {
      const int r = t % p, f = t / p;
      kf[r * d + f] = XK[base + f * channel + r];
      vf[r * d + f] = XV[base + f * channel + r];
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
// (binary searches: a coarse row has thousands).
__device__ void ref_range(const gfma_refs &refs, int k, int slots, int s0, int s1, int *a, int *b) {
  *a = first_source(refs, refs.off[k], refs.off[k + 1], slots, s0);
  *b = first_source(refs, *a, refs.off[k + 1], slots, s1);
}

// grid (referenced summary rows, heads of the chunk), block (kRow, kWarps): dXK, dXV += the far
// gradients dKf, dVf (chunk blocks, nfmax, d) of every reference to the row from the chunk's
// blocks: the transpose of the gather, per target row. The references are cut into kWarps
// consecutive shares, one per warp (lanes along f), and the shares' sums are added in warp
// order: a fixed order, so no atomics and no dependence on scheduling. CPU twin: scatter_add.
__global__ void scatter_far(float *dXK, float *dXV, const float *dKf, const float *dVf,
                            gfma_refs refs, gfma_levels lv, int nbs, int nfmax, int g0, int g1) {
  __shared__ float part[2][kWarps][kRow];
  const int k = blockIdx.x, h = g0 / nbs + blockIdx.y, R = refs.row[k];
  const int s0 = g0 - h * nbs > 0 ? g0 - h * nbs : 0, s1 = g1 - h * nbs < nbs ? g1 - h * nbs : nbs;
  int a, b;
  ref_range(refs, k, nfmax, s0, s1, &a, &b);
  if (a == b) return;  // the whole block: a and b are the same for every thread
  const int l = gfma_level_of(lv, R), share = (b - a + kWarps - 1) / kWarps;
  const int e0 = a + threadIdx.y * share, e1 = e0 + share < b ? e0 + share : b;
  for (int f0 = 0; f0 < lv.d; f0 += kRow) {
    const int f = f0 + threadIdx.x;
    float ak = 0.0f, av = 0.0f;
    for (int e = e0; e < e1 && f < lv.d; e++) {
      const size_t src =
          ((size_t)(h * nbs + refs.ref[e] / nfmax - g0) * nfmax + refs.ref[e] % nfmax) * lv.d;
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
      const size_t at = gfma_at(lv, l, f, h, R - lv.row[l]);
      dXK[at] += sk;
      dXV[at] += sv;
    }
    __syncthreads();  // part is written again for the next channels
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

// Near key blocks b − 1 + s of query block b for the offsets s in [lo, hi] (lo > hi: none). A
// block's near keys are its key blocks' rows one after the other, so that offsets together are
// one product's columns.
struct near_offsets {
  int lo, hi;
  bool none() const { return lo > hi; }
};

// The query blocks of flattened blocks [g0, g1) whose near key blocks of offsets o all lie in the
// key array, less those whose key blocks of offsets skip1 (or skip2) all do, as segments of it:
// call(ga, gb, koff, heads) for blocks [ga, gb) of `heads` consecutive heads (the next head's
// blocks nbs further, its keys kstride rows further), koff the float offset of ga's key block of
// offset o.lo. One segment per piece when the heads' key rows follow one another as their queries
// do (no halo); otherwise the heads whose pieces are the same, together (the chunk's first and
// last head may differ). A key block outside the sequence is masked by the softmax whatever it
// holds.
template <class F>
void near_segments(const gfma *g, long g0, long g1, near_offsets o, near_offsets skip1,
                   near_offsets skip2, long klo, long kstride, F call) {
  const long m = g->m, d = g->d, nbs = g->nbs, nt = total_blocks(g);
  const bool flat = kstride == g->T && klo == g->st->t0;
  // [*a, *b): the blocks of head h (flat: of the whole chunk) whose offsets w all lie in the
  // keys, relative to the head's first block (flat: block 0). Offsets in an interval: the blocks
  // of a wider one are an interval inside
  auto range = [&](long h, near_offsets w, long *a, long *b) {
    if (flat) {
      *a = g0 > 1 - w.lo ? g0 : 1 - w.lo;
      *b = g1 < nt + 1 - w.hi ? g1 : nt + 1 - w.hi;
      return;
    }
    const long kmin = klo / m - g->b0 + 1 - w.lo, kmax = (klo + kstride) / m - g->b0 + 1 - w.hi;
    *a = g0 - h * nbs > 0 ? g0 - h * nbs : 0;
    *b = g1 - h * nbs < nbs ? g1 - h * nbs : nbs;
    *a = *a > kmin ? *a : kmin;
    *b = *b < kmax ? *b : kmax;
  };
  // head h's blocks for o less those for skip1 and skip2: at most three pieces
  struct pieces {
    long a[3], b[3];
    bool operator==(const pieces &x) const {
      for (int i = 0; i < 3; i++)
        if (a[i] != x.a[i] || b[i] != x.b[i]) return false;
      return true;
    }
  };
  auto pieces_of = [&](long h) {
    pieces p = {};
    long a, b;
    range(h, o, &a, &b);
    p.a[0] = a, p.b[0] = b;
    int n = 1;
    for (const near_offsets &sk : {skip1, skip2}) {
      if (sk.none()) continue;
      long sa, sb;
      range(h, sk, &sa, &sb);
      if (sb <= sa) continue;
      int k = 0;
      pieces q = {};
      for (int i = 0; i < n; i++) {  // piece i less [sa, sb)
        if (p.b[i] <= p.a[i]) continue;
        if (sa > p.a[i]) q.a[k] = p.a[i], q.b[k++] = sa < p.b[i] ? sa : p.b[i];
        if (sb < p.b[i]) q.a[k] = sb > p.a[i] ? sb : p.a[i], q.b[k++] = p.b[i];
      }
      p = q;
      n = k;
    }
    return p;
  };
  auto emit = [&](long h, const pieces &p, long heads) {
    for (int i = 0; i < 3; i++) {
      if (p.b[i] <= p.a[i]) continue;
      const long base = flat ? 0 : h * nbs, ga = base + p.a[i];
      const long koff = flat ? (ga - 1 + o.lo) * m * d
                             : (h * kstride + (g->b0 + p.a[i] - 1 + o.lo) * m - klo) * d;
      call(ga, base + p.b[i], koff, heads);
    }
  };
  if (flat) {
    emit(0, pieces_of(0), 1);
    return;
  }
  for (long h = g0 / nbs, n; h * nbs < g1; h += n) {
    const pieces p = pieces_of(h);
    for (n = 1; (h + n) * nbs < g1 && pieces_of(h + n) == p; n++) {
    }
    emit(h, p, n);
  }
}

// The near field's products over query blocks [g0, g1), one per set of blocks that read the same
// near key blocks: call(ga, gb, koff, heads, column, keys) with the key rows of offsets [lo, hi]
// at koff (keys = (hi − lo + 1)·m of them), the score columns from column = lo·m. Away from the
// edges of the sequence and of the keys that is one product over every offset; a block at an
// edge joins those that read what it reads.
template <class F>
void near_products(const gfma *g, long g0, long g1, long klo, long kstride, F call) {
  const int ns = g->ns;
  const near_offsets none = {1, 0};
  for (int lo = 0; lo < ns; lo++)
    for (int hi = ns - 1; hi >= lo; hi--) {
      // the blocks whose offsets in the keys are exactly [lo, hi]
      const near_offsets left = lo > 0 ? near_offsets{lo - 1, hi} : none,
                         right = hi < ns - 1 ? near_offsets{lo, hi + 1} : none;
      near_segments(g, g0, g1, near_offsets{lo, hi}, left, right, klo, kstride,
                    [&](long ga, long gb, long ko, long heads) {
                      call(ga, gb, ko, heads, lo * g->m, (hi - lo + 1) * g->m);
                    });
    }
}

// Offset s alone over every block whose key block s lies in the keys (products whose outputs are
// the key blocks: blocks b and b + 1 of one product would write the same rows together).
template <class F>
void near_each(const gfma *g, long g0, long g1, int s, long klo, long kstride, F call) {
  const near_offsets none = {1, 0};
  near_segments(g, g0, g1, near_offsets{s, s}, none, none, klo, kstride, call);
}

// The inputs of one chunk's evaluation.
struct chunk {
  long g0, g1;
  const float *q, *k, *v;  // q from flattened block 0, k and v from their array's row 0
  long klo, kstride;
  float *S, *Kf, *Vf;  // (blocks, m, ld), (blocks, nfmax, d)
  long ld;
};

// S = the chunk's scores, P2P then M2P (block_scores): unmasked, unweighted.
void scores(const gfma *g, const chunk &c) {
  const long m = g->m, d = g->d, ld = c.ld;
  const float scale = 1.0f / sqrtf((float)d);
  const long hq = g->nbs * m * d, hk = c.kstride * d, hs = g->nbs * m * ld;
  // one product per block over the columns of every near key block it reads (key block b − 1 + s
  // at column s·m of its scores)
  auto near = [&](long ga, long gb, long ko, long heads, long col, long keys) {
    gpu_gemm2(false, true, m, keys, d, scale, c.q + ga * m * d, d, m * d, hq, c.k + ko, d, m * d,
              hk, 0.0f, c.S + (ga - c.g0) * m * ld + col, ld, m * ld, hs, gb - ga, heads);
  };
  {
    const gpu_op_time t(TIMER_P2P);
    near_products(g, c.g0, c.g1, c.klo, c.kstride, near);
  }
  if (g->nfmax) {
    const gpu_op_time t(TIMER_M2P);
    gpu_gemm(false, true, m, g->nfmax, d, scale, c.q + c.g0 * m * d, d, m * d, c.Kf, d,
             g->nfmax * d, 0.0f, c.S + g->ns * m, ld, m * ld, c.g1 - c.g0);
  }
}

// o (chunk rows, d) = P·[v_near | V_far] (fma_P2P_values, fma_M2P_values); o zeroed first.
void values(const gfma *g, const chunk &c, float *o) {
  const long m = g->m, d = g->d, ld = c.ld;
  gpu_memset0(o, sizeof(float) * (size_t)((c.g1 - c.g0) * m * d));
  const long hq = g->nbs * m * d, hk = c.kstride * d, hs = g->nbs * m * ld;
  auto near = [&](long ga, long gb, long ko, long heads, long col, long keys) {
    gpu_gemm2(false, false, m, d, keys, 1.0f, c.S + (ga - c.g0) * m * ld + col, ld, m * ld, hs,
              c.v + ko, d, m * d, hk, 1.0f, o + (ga - c.g0) * m * d, d, m * d, hq, gb - ga, heads);
  };
  {
    const gpu_op_time t(TIMER_P2P);
    near_products(g, c.g0, c.g1, c.klo, c.kstride, near);
  }
  if (g->nfmax) {
    const gpu_op_time t(TIMER_M2P);
    gpu_gemm(false, false, m, d, g->nfmax, 1.0f, c.S + g->ns * m, ld, m * ld, c.Vf, d, g->nfmax * d,
             1.0f, o, d, m * d, c.g1 - c.g0);
  }
}

void launch_softmax(const gfma *g, const chunk &c, float *lse) {
  const gpu_op_time t(TIMER_P2P);  // the fused softmax over [near | far] counts as near field
  const long rows = (c.g1 - c.g0) * g->m;
  softmax_forward<<<gpu_int(rows, "softmax rows"), kSoft, 0, gpu_stream()>>>(c.S, lse, (int)c.ld,
                                                                             mask_of(g), (int)c.g0);
  LAUNCH_CHECK(softmax_forward);
}

void launch_gather(const gfma *g, const chunk &c, const float *XK, const float *XV) {
  const long pairs = (c.g1 - c.g0) * (g->nfmax / g->p);  // (block, listed window)
  if (pairs == 0) return;
  const gpu_op_time t(TIMER_M2P);
  const size_t blocks = gpu_blocks((size_t)pairs, kGather);
  gather_far<<<(unsigned)(blocks < 65535 ? blocks : 65535), dim3(kRow, kGather), 0, gpu_stream()>>>(
      c.Kf, c.Vf, XK, XV, g->far_row, g->lv, (int)g->nbs, g->nfmax, (int)c.g0,
      gpu_int(pairs, "far pairs"));
  LAUNCH_CHECK(gather_far);
}

// The chunk's workspace: scores (and in backward their gradients), the gathered summaries (and
// the gradients of their rows).
struct workspace {
  long blocks;  // query blocks per chunk
  float *S, *dP, *Kf, *Vf, *dKf, *dVf, *o, *D;
};

workspace workspace_open(const gfma *g, bool backward) {
  const long m = g->m, d = g->d, ld = g->ns * m + g->nfmax, nf = g->nfmax * d;
  // per query block: S (m·ld) and Kf, Vf (nfmax·d each); backward: dP, dKf, dVf too, and for
  // fma_linear the near field's own output and D (m·d + m)
  const size_t per = sizeof(float) * (backward ? 2 * m * ld + 4 * nf + m * d + m : m * ld + 2 * nf);
  workspace w = {};
  w.blocks = chunk_size(g, per);
  auto get = [&](long floats) {
    return static_cast<float *>(gpu_alloc(MEM_WORKSPACE, sizeof(float) * (w.blocks * floats + 1)));
  };
  w.S = get(m * ld);
  w.Kf = get(nf);
  w.Vf = get(nf);
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
  for (float *p : {w->S, w->dP, w->Kf, w->Vf, w->dKf, w->dVf, w->o, w->D}) gpu_free(p);
}

chunk chunk_of(const gfma *g, const workspace &w, long g0, const float *q, const float *k,
               const float *v, long klo, long kstride) {
  const long g1 = g0 + w.blocks < total_blocks(g) ? g0 + w.blocks : total_blocks(g);
  return chunk{g0, g1, q, k, v, klo, kstride, w.S, w.Kf, w.Vf, g->ns * g->m + g->nfmax};
}

void launch_rowdot(float *D, const float *a, const float *b, long rows, long d) {
  if (rows == 0) return;
  rowdot<<<grid_of((size_t)rows), kThreads, 0, gpu_stream()>>>(D, a, b, gpu_int(rows, "rows"),
                                                               (int)d);
  LAUNCH_CHECK(rowdot);
}

// The chunk's transposes after its scores are in c.S (fma_evaluate_backward's block loop): P from
// lse, dP = dout·[v_near | V_far]ᵀ, dv += P_nᵀ·dout, dVf = P_fᵀ·dout, dS from D (the chunk's
// rows), dq += dS·[k_near | K_far]/√d, dk += dS_nᵀ·q/√d, dKf = dS_fᵀ·q/√d.
void chunk_backward(const gfma *g, const chunk &c, const workspace &w, float *dq, float *dk,
                    float *dv, const float *dout, const float *lse, const float *D) {
  const long m = g->m, d = g->d, ld = c.ld, nc = c.g1 - c.g0, nf = g->nfmax;
  const float scale = 1.0f / sqrtf((float)d);
  const unsigned rows = gpu_int(nc * m, "score rows");
  // device time: the near field's products and the fused softmax's passes TIMER_P2P, the far
  // field's products TIMER_M2P
  int span = gpu_op_begin(TIMER_P2P);
  probabilities<<<rows, kSoft, 0, gpu_stream()>>>(c.S, lse, (int)ld, mask_of(g), (int)c.g0);
  LAUNCH_CHECK(probabilities);
  gpu_op_end(span);
  const float *dout0 = dout + c.g0 * m * d, *q0 = c.q + c.g0 * m * d;
  if (!D) {  // fma_linear: D of the near field's own output (linear_near_backward)
    values(g, c, w.o);
    launch_rowdot(w.D, dout0, w.o, nc * m, d);
    D = w.D;
  }
  span = gpu_op_begin(TIMER_P2P);
  const long hq = g->nbs * m * d, hk = c.kstride * d, hs = g->nbs * m * ld;
  // dP of the near columns, offsets together where they can be; dv key block by key block
  auto near_dP = [&](long ga, long gb, long ko, long heads, long col, long keys) {
    gpu_gemm2(false, true, m, keys, d, 1.0f, dout + ga * m * d, d, m * d, hq, c.v + ko, d, m * d,
              hk, 0.0f, w.dP + (ga - c.g0) * m * ld + col, ld, m * ld, hs, gb - ga, heads);
  };
  near_products(g, c.g0, c.g1, c.klo, c.kstride, near_dP);
  for (int s = 0; s < g->ns; s++)
    near_each(g, c.g0, c.g1, s, c.klo, c.kstride, [&](long ga, long gb, long ko, long heads) {
      gpu_gemm2(true, false, m, d, m, 1.0f, c.S + (ga - c.g0) * m * ld + s * m, ld, m * ld, hs,
                dout + ga * m * d, d, m * d, hq, 1.0f, dv + ko, d, m * d, hk, gb - ga, heads);
    });
  gpu_op_end(span);
  if (nf) {
    const gpu_op_time t(TIMER_M2P);
    gpu_gemm(false, true, m, nf, d, 1.0f, dout0, d, m * d, c.Vf, d, nf * d, 0.0f, w.dP + g->ns * m,
             ld, m * ld, nc);
    gpu_gemm(true, false, nf, d, m, 1.0f, c.S + g->ns * m, ld, m * ld, dout0, d, m * d, 0.0f, w.dVf,
             d, nf * d, nc);
  }
  span = gpu_op_begin(TIMER_P2P);
  softmax_backward<<<rows, kSoft, 0, gpu_stream()>>>(w.dP, c.S, D, (int)ld, mask_of(g), (int)c.g0);
  LAUNCH_CHECK(softmax_backward);
  // dq from every near key block together where it can be; dk key block by key block
  auto near_dq = [&](long ga, long gb, long ko, long heads, long col, long keys) {
    gpu_gemm2(false, false, m, d, keys, scale, w.dP + (ga - c.g0) * m * ld + col, ld, m * ld, hs,
              c.k + ko, d, m * d, hk, 1.0f, dq + ga * m * d, d, m * d, hq, gb - ga, heads);
  };
  near_products(g, c.g0, c.g1, c.klo, c.kstride, near_dq);
  for (int s = 0; s < g->ns; s++)
    near_each(g, c.g0, c.g1, s, c.klo, c.kstride, [&](long ga, long gb, long ko, long heads) {
      gpu_gemm2(true, false, m, d, m, scale, w.dP + (ga - c.g0) * m * ld + s * m, ld, m * ld, hs,
                c.q + ga * m * d, d, m * d, hq, 1.0f, dk + ko, d, m * d, hk, gb - ga, heads);
    });
  gpu_op_end(span);
  if (nf) {
    const gpu_op_time t(TIMER_M2P);
    gpu_gemm(false, false, m, d, nf, scale, w.dP + g->ns * m, ld, m * ld, c.Kf, d, nf * d, 1.0f,
             dq + c.g0 * m * d, d, m * d, nc);
    gpu_gemm(true, false, nf, d, m, scale, w.dP + g->ns * m, ld, m * ld, q0, d, m * d, 0.0f, w.dKf,
             d, nf * d, nc);
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
                           const float *v, long klo, long kstride, const float *XK,
                           const float *XV) {
  check_heads(g);
  workspace w = workspace_open(g, false);
  for (long g0 = 0; g0 < total_blocks(g); g0 += w.blocks) {
    const chunk c = chunk_of(g, w, g0, q, k, v, klo, kstride);
    launch_gather(g, c, XK, XV);
    scores(g, c);
    launch_softmax(g, c, lse);
    values(g, c, out + g0 * g->m * g->d);
  }
  workspace_close(&w);
}

void gfma_evaluate_backward(const gfma *g, float *dq, float *dk, float *dv, float *dXK, float *dXV,
                            const float *dout, const float *out, const float *q, const float *k,
                            const float *v, long klo, long kstride, const float *XK,
                            const float *XV, const float *lse) {
  check_heads(g);
  const long rows = g->BH * g->T;
  float *D = nullptr;  // fma: Σ dout·out per row; fma_linear: per chunk, of the near field alone
  if (!g->linear) {
    D = static_cast<float *>(gpu_alloc(MEM_WORKSPACE, sizeof(float) * (rows + 1)));
    launch_rowdot(D, dout, out, rows, g->d);
  }
  workspace w = workspace_open(g, true);
  for (long g0 = 0; g0 < total_blocks(g); g0 += w.blocks) {
    const chunk c = chunk_of(g, w, g0, q, k, v, klo, kstride);
    launch_gather(g, c, XK, XV);
    scores(g, c);
    chunk_backward(g, c, w, dq, dk, dv, dout, lse, D ? D + g0 * g->m : nullptr);
    if (g->far_refs.nrows && g->nfmax) {
      const gpu_op_time t(TIMER_M2P);
      const dim3 grid(gpu_int(g->far_refs.nrows, "summary rows"),
                      (unsigned)((c.g1 - 1) / g->nbs - c.g0 / g->nbs + 1));
      scatter_far<<<grid, dim3(kRow, kWarps), 0, gpu_stream()>>>(
          dXK, dXV, w.dKf, w.dVf, g->far_refs, g->lv, (int)g->nbs, g->nfmax, (int)c.g0, (int)c.g1);
      LAUNCH_CHECK(scatter_far);
    }
  }
  workspace_close(&w);
  gpu_free(D);
}
