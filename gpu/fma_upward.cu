// The upward pass of FMA on the GPU, the twin of src/fma/upward.c: P2M (tokens → a level's
// summaries) and M2M (two children → their parent) as GEMMs batched over the d channels — per
// channel the level is a (BH·windows × p) matrix — with the tokens transposed channel-outermost
// first; their transposes and the summary-parameter gradients (the GEMM over channels sums over
// heads and windows in its k dimension). Hand-written kernels here move data only (plain SIMT).
#include <cuda_bf16.h>

#include "check.h"
#include "core/timer.h"
#include "fma_gpu.h"
#include "gpu.h"

namespace {

constexpr unsigned kThreads = 256;
constexpr int kTile = 32;  // transpose tiles of 32 × 32 floats
constexpr int kPass = 8;   // tile rows each thread row handles per pass

unsigned grid_of(size_t n) {
  const size_t b = gpu_blocks(n, kThreads);
  return (unsigned)(b < 65535 ? b : 65535);
}

__device__ inline float as_float(float x) { return x; }
__device__ inline float as_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ inline void store(float *p, float x, bool add) { *p = add ? *p + x : x; }
__device__ inline void store(__nv_bfloat16 *p, float x, bool) { *p = __float2bfloat16(x); }

// out (cols × rows) = inᵀ of in (rows × cols), or out += inᵀ (add, fp32 out only): the
// channel-outermost copy of the tokens and its way back; In and Out fp32 or bf16 (rounded to
// nearest even as it is stored). copy, when given, receives in itself rounded to bf16: the bf16
// copy of the tokens the evaluation reads, made in the pass that reads them anyway. grid (tiles),
// block (32, 8): one 32 × 32 tile per block through shared memory. CPU twin: none (upward.c reads
// (T, d) rows directly).
template <class In, class Out>
__global__ void transpose_tiles(Out *out, const In *in, long rows, long cols, bool add,
                                __nv_bfloat16 *copy) {
  __shared__ float tile[kTile][kTile + 1];
  const unsigned ntc = (unsigned)((cols + kTile - 1) / kTile);  // tile indices in 32 bits
  const long r0 = (long)(blockIdx.x / ntc) * kTile, c0 = (long)(blockIdx.x % ntc) * kTile;
  for (int y = threadIdx.y; y < kTile; y += kPass) {
    const long r = r0 + y, c = c0 + threadIdx.x;
    if (r >= rows || c >= cols) continue;
    const float x = as_float(in[r * cols + c]);
    tile[y][threadIdx.x] = x;
    if (copy) copy[r * cols + c] = __float2bfloat16(x);
  }
  __syncthreads();
  for (int y = threadIdx.y; y < kTile; y += kPass) {
    const long c = c0 + y, r = r0 + threadIdx.x;
    if (r < rows && c < cols) store(&out[c * rows + r], tile[threadIdx.x][y], add);
  }
}

template <class In, class Out>
void transpose(Out *out, const In *in, long rows, long cols, bool add,
               __nv_bfloat16 *copy = nullptr) {
  const long tiles = ((rows + kTile - 1) / kTile) * ((cols + kTile - 1) / kTile);
  if (tiles == 0) return;
  transpose_tiles<In, Out>
      <<<gpu_int(tiles, "transpose tiles"), dim3(kTile, kPass), 0, gpu_stream()>>>(out, in, rows,
                                                                                   cols, add, copy);
  LAUNCH_CHECK(transpose_tiles<In, Out>);
  if (copy) gpu_count_convert_in_pass((size_t)(rows * cols));
}

// Rows of windows [c0, c0 + nwin) of level l, every channel, heads [h0, h0 + hn), set to their
// bias b[f·p + r] (b null: 0), before the GEMMs add their sums. grid (gpu_grid2): the (f, h)
// rows along y, each one's nwin·p contiguous elements along x.
// CPU twin: the memcpy of the bias in fma_P2M / fma_M2M_window.
__global__ void init_rows(float *Xt, gfma_levels lv, int l, int c0, int nwin, int h0, int hn,
                          const float *b) {
  const int P = lv.p, n = nwin * P, rows = lv.d * hn;
  for (int row = blockIdx.y; row < rows; row += gridDim.y) {
    const int f = row / hn, h = h0 + row % hn;
    float *x = Xt + gfma_window_at(lv, l, f, h, c0, 0);
    for (int cr = blockIdx.x * blockDim.x + threadIdx.x; cr < n; cr += gridDim.x * blockDim.x)
      x[cr] = b ? b[f * P + cr % P] : 0.0f;
  }
}

void set_rows(const gfma *g, float *Xt, int l, long c0, long nwin, long h0, long hn,
              const float *b) {
  if (g->d * hn * nwin * g->p == 0) return;
  init_rows<<<gpu_grid2(g->d * hn, nwin * g->p, kThreads), kThreads, 0, gpu_stream()>>>(
      Xt, g->lv, l, gpu_int(c0, "window"), (int)nwin, (int)h0, (int)hn, b);
  LAUNCH_CHECK(init_rows);
}

// The causal q_down of fma_linear: a copy of one level's weights (d, p, span) in which tap t of
// row r is 0 unless it lies in sub-segments ≤ r (m2m's M2M levels: child rows ≤ 2r + 1), or
// (add) dst += the gradient src at the used taps only. grid-stride. CPU twin: query_tap_used
// in params.c, through fma_weights_load / fma_weights_store_grad. grid (gpu_grid2): the (f, r)
// rows along y, their span taps along x.
__global__ void query_taps(float *dst, const float *src, int d, int P, int span, bool m2m,
                           bool add) {
  for (int row = blockIdx.y; row < d * P; row += gridDim.y) {
    const int r = row % P;
    for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < span; t += gridDim.x * blockDim.x) {
      const size_t e = (size_t)row * span + t;
      const bool used = m2m ? t <= 2 * r + 1 : t < (r + 1) * (span / P);
      if (add)
        dst[e] += used ? src[e] : 0.0f;
      else
        dst[e] = used ? src[e] : 0.0f;
    }
  }
}

void masked_taps(float *dst, const float *src, const gfma *g, int l, bool add) {
  const long span = g->st->layout.span[l];
  const bool m2m = g->st->down == FMA_DOWN_M2M && l > 1;
  query_taps<<<gpu_grid2(g->d * g->p, span, kThreads), kThreads, 0, gpu_stream()>>>(
      dst, src, (int)g->d, (int)g->p, (int)span, m2m, add);
  LAUNCH_CHECK(query_taps);
}

// avg's fixed weights of one level: (p, w), row r the mean over sub-segment r. grid
// (gpu_grid2): rows along y, taps along x. CPU twin: the avg branch of fma_P2M (sums of
// x·(1/seg)).
__global__ void avg_weights(float *w, int P, int win) {
  const int seg = win / P;
  for (int r = blockIdx.y; r < P; r += gridDim.y)
    for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < win; t += gridDim.x * blockDim.x)
      w[(size_t)r * win + t] = t / seg == r ? 1.0f / (float)seg : 0.0f;
}

__global__ void fill_ones(float *x, int n) {
  for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < n; e += gridDim.x * blockDim.x)
    x[e] = 1.0f;
}

// The rows (h, c) of a level, h < BH, c < nwin, of two operands at h·hs + c·cs, as the GEMMs
// take them: one index of rows when they fold into one with one stride per operand (one window
// per head: the head stride; every window of the level here: the window stride), else rows c
// batched over the heads (under sequence parallelism a slab's windows are not all of a level's).
// call(offset1, offset2, rows, stride1, stride2, heads, head stride1, head stride2).
template <class F>
void for_rows(long BH, long nwin, long hs1, long cs1, long hs2, long cs2, F call) {
  if (nwin == 1)
    call(0, 0, BH, hs1, hs2, 1, 0, 0);
  else if (hs1 == nwin * cs1 && hs2 == nwin * cs2)
    call(0, 0, BH * nwin, cs1, cs2, 1, 0, 0);
  else
    call(0, 0, nwin, cs1, cs2, BH, hs1, hs2);
}

// Taps [*a, *b) of window c of level l in this slab, and whether its bias is added here: the
// twin of upward.c's slab_taps.
void slab_taps(const fma_state *st, int l, long c, long *a, long *b, bool *bias) {
  const long w = st->tree.window[l];
  *a = st->t0 > c * w ? st->t0 - c * w : 0;
  *b = c * w + w < st->t0 + st->T ? w : st->t0 + st->T - c * w;
  *bias = c * w >= st->t0;
}

// Heads per group of the tokens transposed channel-outermost (xt, and in backward dxt: `copies`
// arrays of (d, heads·T)): as many as the workspace budget holds, at least one, so that no copy of
// every head's tokens is made at once.
long head_group(const gfma *g, int copies) {
  const size_t per_head = sizeof(float) * (size_t)(copies * g->T * g->d);
  const long hc = (long)(gfma_workspace_budget() / per_head);
  return hc < 1 ? 1 : hc < g->BH ? hc : g->BH;
}

// Level l's P2M on this slab: windows [c0, c0 + nwin), taps [a, b) of each (bias: whether this
// rank adds the windows' bias), the first token they read (off, from the slab's start) and head
// h0's first summary row of them in the channel-outermost layout (at, gfma_at).
struct p2m_slab {
  long c0, nwin, a, b, win, span, off;
  bool bias;
  size_t at;
};

p2m_slab slab_of(const gfma *g, int l, long h0) {
  const fma_state *st = g->st;
  p2m_slab s;
  long c1;
  fma_slab_windows(st, l, &s.c0, &c1);
  slab_taps(st, l, s.c0, &s.a, &s.b, &s.bias);
  s.nwin = c1 - s.c0;
  s.win = st->tree.window[l];
  s.span = st->layout.span[l];
  s.off = s.c0 * s.win + s.a - st->t0;
  s.at = gfma_window_at(g->lv, l, 0, h0, s.c0, 0);
  return s;
}

// P2M of level l, the slab's windows, heads [h0, h0 + hn) whose tokens xt holds as (d, hn·T),
// stored as `type` (bf16: with the weights' bf16 copies): Xt rows = bias + x·Wᵀ per channel
// (fma_P2M).
void p2m(const gfma *g, int l, float *Xt, const void *xt, gpu_elem type, const gfma_weights *w,
         long h0, long hn) {
  const gpu_op_time t(TIMER_P2M);
  const p2m_slab sl = slab_of(g, l, h0);
  const long P = g->p, T = g->T, nr = g->lv.nr[l], es = (long)gpu_elem_bytes(type);
  set_rows(g, Xt, l, sl.c0, sl.nwin, h0, hn, sl.bias ? w->b[l] : nullptr);
  const char *x0 = static_cast<const char *>(xt) + sl.off * es;
  const char *w0 = static_cast<const char *>(type == GPU_BF16 ? w->wb[l] : w->w[l]) + sl.a * es;
  float *y0 = Xt + sl.at;
  for_rows(hn, sl.nwin, T, sl.win, nr, P,
           [&](long ox, long oy, long M, long ldx, long ldy, long heads, long hx, long hy) {
             gpu_gemm2_as(type, false, true, M, P, sl.b - sl.a, 1.0f, x0 + ox * es, ldx, hn * T, hx,
                          w0, sl.span, w->stride[l], 0, 1.0f, y0 + oy, ldy, g->BH * nr, hy, g->d,
                          heads);
           });
}

// Whether level l's P2M windows tile the slab, each token read by one window: then the transpose
// of its P2M writes every token's gradient (beta 0) rather than adding to zeros.
bool tiles_slab(const gfma *g, int l) {
  const p2m_slab sl = slab_of(g, l, 0);
  return sl.off == 0 && sl.a == 0 && sl.b == sl.win && sl.nwin * sl.win == g->T;
}

// M2M of level l, parents [c0, c1): Xt rows = bias + children·Tᵀ per channel (fma_M2M_window).
void m2m(const gfma *g, int l, long c0, long c1, float *Xt, const gfma_weights *w) {
  const gpu_op_time t(TIMER_M2M);
  const long P = g->p, nwin = c1 - c0, nr = g->lv.nr[l], nc = g->lv.nr[l - 1];
  set_rows(g, Xt, l, c0, nwin, 0, g->BH, w->b[l]);
  const float *x0 = Xt + gfma_window_at(g->lv, l - 1, 0, 0, 2 * c0, 0);
  float *y0 = Xt + gfma_window_at(g->lv, l, 0, 0, c0, 0);
  for_rows(g->BH, nwin, nc, 2 * P, nr, P,
           [&](long ox, long oy, long M, long ldx, long ldy, long heads, long hx, long hy) {
             gpu_gemm2(false, true, M, P, 2 * P, 1.0f, x0 + ox, ldx, g->BH * nc, hx, w->w[l], 2 * P,
                       w->stride[l], 0, 1.0f, y0 + oy, ldy, g->BH * nr, hy, g->d, heads);
           });
}

// The transpose of m2m for parents [c0, c1): children += dparent·T per channel
// (fma_M2M_window_backward over both children).
void m2m_backward(const gfma *g, int l, long c0, long c1, float *dXt, const gfma_weights *w) {
  const gpu_op_time t(TIMER_M2M);
  const long P = g->p, nwin = c1 - c0, nr = g->lv.nr[l], nc = g->lv.nr[l - 1];
  const float *y0 = dXt + gfma_window_at(g->lv, l, 0, 0, c0, 0);
  float *x0 = dXt + gfma_window_at(g->lv, l - 1, 0, 0, 2 * c0, 0);
  for_rows(g->BH, nwin, nr, P, nc, 2 * P,
           [&](long oy, long ox, long M, long ldy, long ldx, long heads, long hy, long hx) {
             gpu_gemm2(false, false, M, 2 * P, P, 1.0f, y0 + oy, ldy, g->BH * nr, hy, w->w[l],
                       2 * P, w->stride[l], 0, 1.0f, x0 + ox, ldx, g->BH * nc, hx, g->d, heads);
           });
}

// Where level l's weight gradient of set `set` accumulates: dparams' tensor, or for the causal
// q_down a zeroed copy whose used taps store_grad adds (fma_weights_store_grad's mask).
float *grad_begin(const gfma *g, enum fma_set set, int l, float *dparams) {
  const fma_state *st = g->st;
  float *W = dparams + st->layout.weight[set][l];
  if (!(set == FMA_Q && st->causal)) return W;
  return static_cast<float *>(
      gpu_alloc_zero(MEM_WORKSPACE, sizeof(float) * g->d * g->p * st->layout.span[l]));
}

void grad_end(const gfma *g, enum fma_set set, int l, float *dparams, float *dW) {
  float *W = dparams + g->st->layout.weight[set][l];
  if (dW == W) return;
  masked_taps(W, dW, g, l, true);
  gpu_free(dW);
}

// The rows (h, c), h < heads, c < nwin, of one operand of every channel f: at p + f·fs + h·hs +
// c·cs, len floats each.
struct rows_of {
  const float *p;
  long hs, cs, fs;
};

// grid (gpu_grid2): rows (f, h, c) along y, their len floats along x: dst (d, heads·nwin, len) =
// the rows of src. 32-bit indices.
__global__ void gather_rows(float *dst, const float *src, int d, int heads, int nwin, int len,
                            long fs, long hs, long cs) {
  for (int row = blockIdx.y; row < d * heads * nwin; row += gridDim.y) {
    const int f = row / (heads * nwin), h = row / nwin % heads, c = row % nwin;
    const float *s = src + f * fs + h * hs + c * cs;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < len; i += gridDim.x * blockDim.x)
      dst[(size_t)row * len + i] = s[i];
  }
}

// The rows of r as one index k = h·nwin + c of stride *ld (channel stride *fs): r itself when its
// rows fold so, else a gathered copy in *scratch (the caller frees it).
const float *fold_rows(const gfma *g, rows_of r, long heads, long nwin, long len, long *ld,
                       long *fs, float **scratch) {
  *scratch = nullptr;
  *fs = r.fs;
  if (nwin == 1 || r.hs == nwin * r.cs) {
    *ld = nwin == 1 ? r.hs : r.cs;
    return r.p;
  }
  const long rows = g->d * heads * nwin;
  *scratch = static_cast<float *>(gpu_alloc(MEM_WORKSPACE, sizeof(float) * rows * len));
  gather_rows<<<gpu_grid2(rows, len, kThreads), kThreads, 0, gpu_stream()>>>(
      *scratch, r.p, (int)g->d, (int)heads, (int)nwin, (int)len, r.fs, r.hs, r.cs);
  LAUNCH_CHECK(gather_rows);
  *ld = len;
  *fs = heads * nwin * len;
  return *scratch;
}

// dW (p, span) += per channel Σ over the rows (h, c) of dY(h, c)ᵀ·X(h, c) for taps [a, a + N),
// and db += Σ dY(h, c) (when bias): one GEMM per term sums heads and windows in its k dimension,
// over copies of the rows that do not fold into one index (under sequence parallelism a slab's
// windows are not all of a level's: summaries, few).
void param_grads(const gfma *g, long heads, long nwin, rows_of dy, rows_of x, long N, float *dW,
                 long span, float *db, const float *ones) {
  const long P = g->p, K = heads * nwin;
  long ly, sy, lx, sx;
  float *cy, *cx;
  const float *Y = fold_rows(g, dy, heads, nwin, P, &ly, &sy, &cy);
  const float *X = fold_rows(g, x, heads, nwin, N, &lx, &sx, &cx);
  gpu_gemm(true, false, P, N, K, 1.0f, Y, ly, sy, X, lx, sx, 1.0f, dW, span, P * span, g->d);
  if (db) gpu_gemm(true, false, P, 1, K, 1.0f, Y, ly, sy, ones, 1, 0, 1.0f, db, 1, P, g->d);
  gpu_free(cy);
  gpu_free(cx);
}

// The transpose of p2m for level l, heads [h0, h0 + hn): dxt (d, hn·T) = dXt·W + beta·dxt per
// channel (fma_P2M_backward).
void p2m_backward(const gfma *g, int l, float *dxt, const float *dXt, const gfma_weights *w,
                  long h0, long hn, float beta) {
  const gpu_op_time t(TIMER_P2M);
  const p2m_slab sl = slab_of(g, l, h0);
  const long P = g->p, T = g->T, nr = g->lv.nr[l];
  const float *y0 = dXt + sl.at;
  for_rows(hn, sl.nwin, nr, P, T, sl.win,
           [&](long oy, long ox, long M, long ly, long lx, long heads, long hy, long hx) {
             gpu_gemm2(false, false, M, sl.b - sl.a, P, 1.0f, y0 + oy, ly, g->BH * nr, hy,
                       w->w[l] + sl.a, sl.span, w->stride[l], 0, beta, dxt + sl.off + ox, lx,
                       hn * T, hx, g->d, heads);
           });
}

// The gradients of level l's P2M weights (this slab's taps) and bias (on the window's first
// rank) for heads [h0, h0 + hn), whose tokens xt holds as (d, hn·T), summed onto those of earlier
// head groups: fma_upward_param_grads' P2M branch.
void p2m_grads(const gfma *g, enum fma_set set, int l, const float *dXt, const float *xt,
               float *dparams, const float *ones, long h0, long hn) {
  const gpu_op_time t(TIMER_P2M);
  const p2m_slab sl = slab_of(g, l, h0);
  const long P = g->p, T = g->T, nr = g->lv.nr[l];
  float *dW = grad_begin(g, set, l, dparams);
  param_grads(g, hn, sl.nwin, rows_of{dXt + sl.at, nr, P, g->BH * nr},
              rows_of{xt + sl.off, T, sl.win, hn * T}, sl.b - sl.a, dW + sl.a, sl.span,
              sl.bias ? dparams + g->st->layout.bias[set][l] : nullptr, ones);
  grad_end(g, set, l, dparams, dW);
}

// The M2M weights' and biases' gradients of level l over parents [c0, c1) (each rank's share of
// a spanning parent): fma_upward_param_grads' from_children branch.
void m2m_grads(const gfma *g, enum fma_set set, int l, long c0, long c1, const float *dXt,
               const float *Xt, float *dparams, const float *ones) {
  const gpu_op_time t(TIMER_M2M);
  const long P = g->p, nr = g->lv.nr[l], nc = g->lv.nr[l - 1];
  float *dW = grad_begin(g, set, l, dparams);
  param_grads(g, g->BH, c1 - c0,
              rows_of{dXt + gfma_window_at(g->lv, l, 0, 0, c0, 0), nr, P, g->BH * nr},
              rows_of{Xt + gfma_window_at(g->lv, l - 1, 0, 0, 2 * c0, 0), nc, 2 * P, g->BH * nc},
              2 * P, dW, 2 * P, dparams + g->st->layout.bias[set][l], ones);
  grad_end(g, set, l, dparams, dW);
}

}  // namespace

void gfma_avg_build(gfma *g) {
  for (int l = 1; l <= g->L && g->st->down == FMA_DOWN_AVG; l++) {
    const long win = g->st->tree.window[l];
    g->avg_w[l] = static_cast<float *>(gpu_alloc(MEM_WORKSPACE, sizeof(float) * g->p * win));
    avg_weights<<<gpu_grid2(g->p, win, kThreads), kThreads, 0, gpu_stream()>>>(
        g->avg_w[l], (int)g->p, gpu_int(win, "window"));
    LAUNCH_CHECK(avg_weights);
  }
}

void gfma_avg_free(gfma *g) {
  for (int l = 0; l <= FMA_MAX_LEVELS; l++) gpu_free(g->avg_w[l]);
}

void gfma_weights_get(const gfma *g, const float *params, enum fma_set set, gfma_weights *w) {
  *w = gfma_weights{};
  const fma_state *st = g->st;
  for (int l = 1; l <= g->L; l++) {
    if (st->down == FMA_DOWN_AVG) {
      w->w[l] = g->avg_w[l];  // one matrix for every channel
      continue;
    }
    const long span = st->layout.span[l];
    w->w[l] = params + st->layout.weight[set][l];
    w->b[l] = params + st->layout.bias[set][l];
    w->stride[l] = g->p * span;
    if (set == FMA_Q && st->causal) {  // the taps a causal query summary may not read: 0
      w->owned[l] =
          static_cast<float *>(gpu_alloc(MEM_WORKSPACE, sizeof(float) * g->d * g->p * span));
      masked_taps(w->owned[l], w->w[l], g, l, false);
      w->w[l] = w->owned[l];
    }
  }
  // bf16 products: the P2M levels' weights in bf16 too (cuBLAS takes both operands of one type)
  const int top = st->down == FMA_DOWN_M2M ? (g->L > 0 ? 1 : 0) : g->L;
  for (int l = 1; l <= top && gpu_bf16(); l++) {
    const size_t n = (size_t)(w->stride[l] ? g->d * w->stride[l] : g->p * st->layout.span[l]);
    w->owned_b[l] = gpu_alloc(MEM_WORKSPACE, sizeof(__nv_bfloat16) * (n + 1));
    gpu_to_bf16(w->owned_b[l], w->w[l], n);
    w->wb[l] = w->owned_b[l];
  }
}

void gfma_weights_release(gfma_weights *w) {
  for (int l = 0; l <= FMA_MAX_LEVELS; l++) {
    gpu_free(w->owned[l]);
    gpu_free(w->owned_b[l]);
  }
  *w = gfma_weights{};
}

bool gfma_upward_pass(const gfma *g, float *Xt, const float *x, const gfma_weights *w,
                      const void *x16, void *copy16) {
  const fma_state *st = g->st;
  const bool m2m_levels = st->down == FMA_DOWN_M2M;
  const int top = m2m_levels ? (g->L > 0 ? 1 : 0) : g->L;  // the P2M levels
  if (top == 0) return false;
  const gpu_elem type = w->wb[1] ? GPU_BF16 : GPU_F32;  // bf16 products: xt in bf16
  const long hc = head_group(g, 1);
  void *xt = gpu_alloc(MEM_WORKSPACE, gpu_elem_bytes(type) * (size_t)(hc * g->T * g->d));
  auto *xt16 = static_cast<__nv_bfloat16 *>(xt);
  for (long h0 = 0; h0 < g->BH; h0 += hc) {
    const long hn = g->BH - h0 < hc ? g->BH - h0 : hc;
    const size_t at = (size_t)(h0 * g->T * g->d);
    // (hn·T, d) → (d, hn·T)
    if (x16)
      transpose(xt16, static_cast<const __nv_bfloat16 *>(x16) + at, hn * g->T, g->d, false);
    else if (type == GPU_BF16)
      transpose(xt16, x + at, hn * g->T, g->d, false,
                copy16 ? static_cast<__nv_bfloat16 *>(copy16) + at : nullptr);
    else
      transpose(static_cast<float *>(xt), x + at, hn * g->T, g->d, false);
    for (int l = 1; l <= top; l++) p2m(g, l, Xt, xt, type, w, h0, hn);
  }
  gpu_free(xt);
  for (int l = 2; l <= g->L && m2m_levels; l++) {
    if (st->tree.window[l] > g->T) break;  // spanning: the LET's exchange of children
    long c0, c1;
    fma_slab_windows(st, l, &c0, &c1);
    m2m(g, l, c0, c1, Xt, w);
  }
  return type == GPU_BF16 && !x16 && copy16;
}

void gfma_M2M_spanning(const gfma *g, int l, float *Xt, const gfma_weights *w) {
  m2m(g, l, 0, g->st->tree.nwindows[l], Xt, w);
}

void gfma_M2M_spanning_backward(const gfma *g, int l, float *dXt, const gfma_weights *w) {
  m2m_backward(g, l, 0, g->st->tree.nwindows[l], dXt, w);
}

void gfma_upward_pass_backward(const gfma *g, float *dx, float *dXt, const gfma_weights *w) {
  const fma_state *st = g->st;
  if (g->L == 0) return;
  if (st->down == FMA_DOWN_M2M)  // coarse to fine: level l is complete before it is pushed down
    for (int l = g->L; l >= 2; l--) {
      if (st->tree.window[l] > g->T) continue;  // spanning: the LET's
      long c0, c1;
      fma_slab_windows(st, l, &c0, &c1);
      m2m_backward(g, l, c0, c1, dXt, w);
    }
  const int top = st->down == FMA_DOWN_M2M ? 1 : g->L;  // the P2M levels
  const long hc = head_group(g, 1);
  float *dxt = static_cast<float *>(gpu_alloc(MEM_WORKSPACE, sizeof(float) * (hc * g->T * g->d)));
  const bool whole = tiles_slab(g, 1);  // level 1 writes every token's gradient
  for (long h0 = 0; h0 < g->BH; h0 += hc) {
    const long hn = g->BH - h0 < hc ? g->BH - h0 : hc, rows = hn * g->T;
    if (!whole) gpu_memset0(dxt, sizeof(float) * (size_t)(rows * g->d));
    for (int l = 1; l <= top; l++)
      p2m_backward(g, l, dxt, dXt, w, h0, hn, l == 1 && whole ? 0.0f : 1.0f);
    transpose(dx + h0 * g->T * g->d, dxt, g->d, rows, true);  // dx (hn·T, d) += dxtᵀ
  }
  gpu_free(dxt);
}

void gfma_upward_param_grads(const gfma *g, enum fma_set set, float *dparams, const float *dXt,
                             const float *Xt, const float *x) {
  const fma_state *st = g->st;
  if (g->L == 0 || !dparams || st->down == FMA_DOWN_AVG) return;
  // rows (h, c) of a level, at most: the slab's windows, or every window of a spanning level
  const long most = g->BH * (g->T / g->m + 1 + st->tree.n / g->T);
  float *ones = static_cast<float *>(gpu_alloc(MEM_WORKSPACE, sizeof(float) * most));
  fill_ones<<<grid_of((size_t)most), kThreads, 0, gpu_stream()>>>(ones, gpu_int(most, "rows"));
  LAUNCH_CHECK(fill_ones);
  if (st->down == FMA_DOWN_M2M)
    for (int l = g->L; l >= 2; l--) {
      long c0, c1;
      fma_grad_windows(st, l, &c0, &c1);
      m2m_grads(g, set, l, c0, c1, dXt, Xt, dparams, ones);
    }
  const int top = st->down == FMA_DOWN_M2M ? 1 : g->L;  // the P2M levels
  const long hc = head_group(g, 1);
  float *xt = static_cast<float *>(gpu_alloc(MEM_WORKSPACE, sizeof(float) * (hc * g->T * g->d)));
  for (long h0 = 0; h0 < g->BH; h0 += hc) {
    const long hn = g->BH - h0 < hc ? g->BH - h0 : hc;
    transpose(xt, x + h0 * g->T * g->d, hn * g->T, g->d, false);  // (hn·T, d) → (d, hn·T)
    for (int l = 1; l <= top; l++) p2m_grads(g, set, l, dXt, xt, dparams, ones, h0, hn);
  }
  gpu_free(xt);
  gpu_free(ones);
}
