// FMA evaluation on the GPU, the twin of src/fma/evaluate.c: query blocks in chunks sized to a
// budget; per chunk the near (P2P) and far (M2P: the listed summaries read where they lie, level by
// level) scores as batched GEMMs, one fused SIMT softmax over [near | far], then the value GEMMs.
// Backward recomputes the scores from lse; gradients several blocks touch are summed per target
// row in a fixed order.
#include <vector>

#include "check.h"
#include "fma/lists.h"
#include "fma_gpu.h"
#include "gpu.h"
#include "timer.h"

namespace {

constexpr unsigned kThreads = 256;
constexpr unsigned kSoft = 64;  // threads per score row in the softmax

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

// grid-stride over (slice, chunk block) pairs: the pointer tables of the far field's products, one
// per slice s = (l − 1)·nlist + k (level l's k-th listed window), at table + 3·nc·s laid out as
// gpu_gemm_table takes them. Block e of the chunk (flattened g0 + e) reads as B its window of X
// where it lies: the p rows of that window in channel f are contiguous and the channels
// BH·nr[l] apart, a row-major (d × p) matrix of that leading dimension. A slot with no window
// (−1) reads window 0 of its level, whose columns the softmax masks (its P and dS are 0). A and C
// are the chunk's arrays, block e at e·sA (e·sC), plus the slice's first score column where they
// are scores (a_slot, c_slot). CPU twin: the gather of block_keys, then fma_M2P_*.
__global__ void far_pointers(float **table, const float *X, gfma_levels lv, const int *far_row,
                             int nbs, int nfmax, int nlist, int g0, int nc, const float *A, long sA,
                             bool a_slot, float *C, long sC, bool c_slot) {
  const int slices = lv.L * nlist, p = lv.p;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < slices * nc;
       i += gridDim.x * blockDim.x) {
    const int sl = i / nc, e = i % nc, l = sl / nlist + 1, g = g0 + e, slot0 = sl * p;
    const int R0 = far_row[(g % nbs) * nfmax + slot0];
    float **t = table + (size_t)3 * nc * sl;
    t[e] = const_cast<float *>(X + gfma_at(lv, l, 0, g / nbs, R0 < 0 ? 0 : R0 - lv.row[l]));
    t[nc + e] = const_cast<float *>(A + e * sA + (a_slot ? slot0 : 0));
    t[2 * nc + e] = C + e * sC + (c_slot ? slot0 : 0);
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
  float *S;  // (blocks, m, ld)
  long ld;
  const float *XK, *XV;  // the summaries, read where they lie
};

// The far field's products of a chunk, slice by slice (far_pointers): one table kernel and one
// batched product per slice. X: the summaries B reads; A, C as far_pointers takes them; the
// product (M, N, K, alpha, lda, beta, ldc, tb) as gpu_gemm_table's, B's leading dimension the
// level's BH·nr[l]. The distinct summary windows a slice reads are counted on the host: the
// chunk's (head, level-l window) pairs.
struct far_product {
  bool tb;
  long M, N, K;
  float alpha;
  long lda;
  float beta;
  long ldc;
};

void far_products(const gfma *g, const chunk &c, const float *X, const float *A, long sA,
                  bool a_slot, float *C, long sC, bool c_slot, far_product f) {
  const long nc = c.g1 - c.g0, slices = (long)g->L * g->nlist;
  if (g->nfmax == 0 || nc == 0) return;
  auto **table = static_cast<float **>(gpu_alloc(MEM_WORKSPACE, 3 * sizeof(float *) * nc * slices));
  const size_t blocks = gpu_blocks((size_t)(nc * slices), kThreads);
  far_pointers<<<(unsigned)(blocks < 1024 ? blocks : 1024), kThreads, 0, gpu_stream()>>>(
      table, X, g->lv, g->far_row, (int)g->nbs, g->nfmax, g->nlist, (int)c.g0,
      gpu_int(nc, "chunk blocks"), A, sA, a_slot, C, sC, c_slot);
  LAUNCH_CHECK(far_pointers);
  for (int l = 1; l <= g->L; l++) {
    long windows = 0;  // distinct (head, window of level l) among the chunk's blocks
    for (long e = 0, last = -1; e < nc; e++) {
      const long gl = c.g0 + e, w = gl / g->nbs * g->lv.nr[l] +
                                    (g->b0 + gl % g->nbs) * g->m / g->st->tree.window[l];
      windows += w != last;
      last = w;
    }
    for (int k = 0; k < g->nlist; k++) {
      float *const *t = table + (size_t)3 * nc * ((l - 1) * g->nlist + k);
      gpu_gemm_table(false, f.tb, f.M, f.N, f.K, f.alpha, f.lda, g->BH * g->lv.nr[l], f.beta, f.ldc,
                     t, nc, a_slot ? nc : (sA ? nc : 1), windows);
    }
  }
  gpu_free(table);
}

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
  if (g->nfmax) {  // level by level, q against the listed windows' key summaries
    const gpu_op_time t(TIMER_M2P);
    far_products(g, c, c.XK, c.q + c.g0 * m * d, m * d, false, c.S + g->ns * m, m * ld, true,
                 far_product{false, m, g->p, d, scale, d, 0.0f, ld});
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
  if (g->nfmax) {  // o += P_far · the listed windows' value summaries, level by level
    const gpu_op_time t(TIMER_M2P);
    far_products(g, c, c.XV, c.S + g->ns * m, m * ld, true, o, m * d, false,
                 far_product{true, m, d, g->p, 1.0f, ld, 1.0f, d});
  }
}

void launch_softmax(const gfma *g, const chunk &c, float *lse) {
  const gpu_op_time t(TIMER_P2P);  // the fused softmax over [near | far] counts as near field
  const long rows = (c.g1 - c.g0) * g->m;
  softmax_forward<<<gpu_int(rows, "softmax rows"), kSoft, 0, gpu_stream()>>>(c.S, lse, (int)c.ld,
                                                                             mask_of(g), (int)c.g0);
  LAUNCH_CHECK(softmax_forward);
}

// The chunk's workspace: scores (and in backward their gradients).
struct workspace {
  long blocks;  // query blocks per chunk
  float *S, *dP, *o, *D;
};

workspace workspace_open(const gfma *g, bool backward) {
  const long m = g->m, d = g->d, ld = g->ns * m + g->nfmax;
  // per query block: S (m·ld); backward: dP too, and for fma_linear the near field's own output
  // and D (m·d + m)
  const size_t per = sizeof(float) * (backward ? 2 * m * ld + m * d + m : m * ld);
  workspace w = {};
  w.blocks = chunk_size(g, per);
  auto get = [&](long floats) {
    return static_cast<float *>(gpu_alloc(MEM_WORKSPACE, sizeof(float) * (w.blocks * floats + 1)));
  };
  w.S = get(m * ld);
  if (!backward) return w;
  w.dP = get(m * ld);
  if (g->linear) {
    w.o = get(m * d);
    w.D = get(m);
  }
  return w;
}

void workspace_close(workspace *w) {
  for (float *p : {w->S, w->dP, w->o, w->D}) gpu_free(p);
}

chunk chunk_of(const gfma *g, const workspace &w, long g0, const float *q, const float *k,
               const float *v, long klo, long kstride, const float *XK, const float *XV) {
  const long g1 = g0 + w.blocks < total_blocks(g) ? g0 + w.blocks : total_blocks(g);
  return chunk{g0, g1, q, k, v, klo, kstride, w.S, g->ns * g->m + g->nfmax, XK, XV};
}

void launch_rowdot(float *D, const float *a, const float *b, long rows, long d) {
  if (rows == 0) return;
  rowdot<<<grid_of((size_t)rows), kThreads, 0, gpu_stream()>>>(D, a, b, gpu_int(rows, "rows"),
                                                               (int)d);
  LAUNCH_CHECK(rowdot);
}

// The gradients of the listed summaries, where they lie (the transposes of far_products for the
// keys and values): the chunk's blocks in runs of one (head, level-l window c) — their rows
// consecutive in q, dout and the scores — and for each offset k whose window t = c + off_k level l
// lists for c, dXK[t] += scale·q_runᵀ·dS_run and dXV[t] += dout_runᵀ·P_run over the run's rows and
// group k's columns, window t being a row-major (d × p) matrix of leading dimension BH·nr[l]. For
// one k the windows of different runs differ (gfma_far_offset), so one batched product per
// (level, k, run length) writes each once: no scatter, no atomics, a fixed order (levels, offsets,
// run lengths, chunks). The pointer tables are built on the host and uploaded once per chunk.
// CPU twin: fma_M2P_scores_backward and fma_M2P_values_backward, then scatter_add.
void far_grads(const gfma *g, const chunk &c, const workspace &w, float *dXK, float *dXV,
               const float *dout0, float scale) {
  const long m = g->m, d = g->d, p = g->p, ld = c.ld, nc = c.g1 - c.g0;
  const fma_tree *tr = &g->st->tree;
  struct group {
    int l, k;
    long rows;                   // the runs' rows: the products' K
    std::vector<long> e0, t, h;  // each run's first chunk block, its window t, its head
  };
  std::vector<group> groups;
  for (int l = 1; l <= g->L; l++) {
    const size_t first = groups.size();
    for (long e0 = 0, e1; e0 < nc; e0 = e1) {
      const long g0 = c.g0 + e0, h = g0 / g->nbs;
      const long cw = (g->b0 + g0 % g->nbs) * m / tr->window[l];
      for (e1 = e0 + 1; e1 < nc && (c.g0 + e1) / g->nbs == h &&
                        (g->b0 + (c.g0 + e1) % g->nbs) * m / tr->window[l] == cw;
           e1++) {
      }
      long listed[FMA_LIST_MAX];
      const int nw = fma_lists_level(tr, g->st->causal, l, cw, listed);
      for (int k = 0; k < g->nlist; k++) {
        const long t = cw + gfma_far_offset(g->st->causal, k);
        bool found = false;
        for (int i = 0; i < nw; i++) found = found || listed[i] == t;
        if (!found) continue;
        size_t gi = first;
        while (gi < groups.size() && (groups[gi].k != k || groups[gi].rows != (e1 - e0) * m)) gi++;
        if (gi == groups.size()) groups.push_back(group{l, k, (e1 - e0) * m, {}, {}, {}});
        groups[gi].e0.push_back(e0);
        groups[gi].t.push_back(t);
        groups[gi].h.push_back(h);
      }
    }
  }
  size_t total = 0;
  for (const group &gr : groups) total += gr.e0.size();
  if (total == 0) return;
  // per group: the dK table then the dV table, each [B | A | C] as gpu_gemm_table takes them
  std::vector<float *> host(6 * total);
  size_t at = 0;
  for (const group &gr : groups) {
    const size_t n = gr.e0.size();
    const long col = g->ns * m + ((gr.l - 1) * g->nlist + gr.k) * p;
    for (size_t i = 0; i < n; i++) {
      const long e0 = gr.e0[i];
      const size_t win = gfma_at(g->lv, gr.l, 0, gr.h[i], gr.t[i] * p);
      host[at + i] = w.dP + e0 * m * ld + col;                            // B: dS
      host[at + n + i] = const_cast<float *>(c.q + (c.g0 + e0) * m * d);  // A: q
      host[at + 2 * n + i] = dXK + win;                                   // C
      host[at + 3 * n + i] = c.S + e0 * m * ld + col;                     // B: P
      host[at + 4 * n + i] = const_cast<float *>(dout0 + e0 * m * d);     // A: dout
      host[at + 5 * n + i] = dXV + win;                                   // C
    }
    at += 6 * n;
  }
  auto **table = static_cast<float **>(gpu_alloc(MEM_WORKSPACE, sizeof(float *) * host.size()));
  gpu_upload(table, host.data(), sizeof(float *) * host.size());
  at = 0;
  for (const group &gr : groups) {
    const long n = (long)gr.e0.size(), ldw = g->BH * g->lv.nr[gr.l];
    gpu_gemm_table(true, false, d, p, gr.rows, scale, d, ld, 1.0f, ldw, table + at, n, n, n);
    gpu_gemm_table(true, false, d, p, gr.rows, 1.0f, d, ld, 1.0f, ldw, table + at + 3 * n, n, n, n);
    at += 6 * n;
  }
  gpu_free(table);
}

// The chunk's transposes after its scores are in c.S (fma_evaluate_backward's block loop): P from
// lse, dP = dout·[v_near | V_far]ᵀ, dv += P_nᵀ·dout, dS from D (the chunk's rows),
// dq += dS·[k_near | K_far]/√d, dk += dS_nᵀ·q/√d, and the listed summaries' dXK, dXV (far_grads).
void chunk_backward(const gfma *g, const chunk &c, const workspace &w, float *dq, float *dk,
                    float *dv, float *dXK, float *dXV, const float *dout, const float *lse,
                    const float *D) {
  const long m = g->m, d = g->d, ld = c.ld, nc = c.g1 - c.g0, nf = g->nfmax;
  const float scale = 1.0f / sqrtf((float)d);
  const unsigned rows = gpu_int(nc * m, "score rows");
  // device time: the near field's products and the fused softmax's passes TIMER_P2P, the far
  // field's products TIMER_M2P
  int span = gpu_op_begin(TIMER_P2P);
  probabilities<<<rows, kSoft, 0, gpu_stream()>>>(c.S, lse, (int)ld, mask_of(g), (int)c.g0);
  LAUNCH_CHECK(probabilities);
  gpu_op_end(span);
  const float *dout0 = dout + c.g0 * m * d;
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
  if (nf) {  // dP_far = dout · the listed value summaries, where they lie
    const gpu_op_time t(TIMER_M2P);
    far_products(g, c, c.XV, dout0, m * d, false, w.dP + g->ns * m, m * ld, true,
                 far_product{false, m, g->p, d, 1.0f, d, 0.0f, ld});
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
  if (nf) {  // dq += dS_far · the listed key summaries; their gradients, where they lie
    const gpu_op_time t(TIMER_M2P);
    far_products(g, c, c.XK, w.dP + g->ns * m, m * ld, true, dq + c.g0 * m * d, m * d, false,
                 far_product{true, m, d, g->p, scale, ld, 1.0f, d});
    far_grads(g, c, w, dXK, dXV, dout0, scale);
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
    const chunk c = chunk_of(g, w, g0, q, k, v, klo, kstride, XK, XV);
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
    const chunk c = chunk_of(g, w, g0, q, k, v, klo, kstride, XK, XV);
    scores(g, c);
    chunk_backward(g, c, w, dq, dk, dv, dXK, dXV, dout, lse, D ? D + g0 * g->m : nullptr);
  }
  workspace_close(&w);
  gpu_free(D);
}
