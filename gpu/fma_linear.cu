// fma_linear on the GPU, the twin of fma_linear in src/fma/evaluate.c: the near field under its
// own softmax (fma_evaluate.cu's chunks), then one item (level, query sub-segment) per block
// against the ≤ 3p key rows its window lists, added to every query of the sub-segment. Backward
// gathers key and value gradients per target row in item order (no float atomics). Plain SIMT.
#include "check.h"
#include "core/timer.h"
#include "fma_gpu.h"
#include "gpu.h"

namespace {

constexpr unsigned kThreads = 256;
constexpr unsigned kLin = 64;  // threads per item
constexpr unsigned kRow = 32;  // threads per summary row in the gather

// The dot product of rows Ra and Rb (level l) of two summary arrays, head h.
__device__ float row_dot(const gfma_levels &lv, int l, long h, const float *X, int Ra,
                         const float *Y, int Rb) {
  float s = 0.0f;
  for (long f = 0; f < lv.d; f++)
    s += X[gfma_at(lv, l, f, h, Ra - lv.row[l])] * Y[gfma_at(lv, l, f, h, Rb - lv.row[l])];
  return s;
}

// grid (items, BH), block kLin, P3 floats of dynamic shared memory: item `item` of head h — the
// softmax of its query row Q[qrow] against its key rows (the first ones of its P3 slots), times
// V: O (items, BH, d) and lse_far[h·rows + its sub-segment's row]. An item without a term gets 0.
// CPU twin: linear_level_forward.
__global__ void level_forward(float *O, float *lse_far, const float *XQ, const float *XK,
                              const float *XV, const int *qrow, const int *key, const int *item_row,
                              gfma_levels lv, long rows, int P3, float scale) {
  extern __shared__ float a[];
  const long item = blockIdx.x, h = blockIdx.y, d = lv.d;
  float *o = O + ((size_t)item * lv.BH + h) * d;
  const int Rq = qrow[item], *keys = key + item * P3;
  float *lse = lse_far + h * rows + item_row[item];
  if (Rq < 0 || keys[0] < 0) {  // linear_keys lists nothing: no term
    for (long f = threadIdx.x; f < d; f += kLin) o[f] = 0.0f;
    if (threadIdx.x == 0) *lse = 0.0f;
    return;
  }
  const int l = gfma_level_of(lv, Rq);
  for (int j = threadIdx.x; j < P3; j += kLin)
    if (keys[j] >= 0) a[j] = row_dot(lv, l, h, XQ, Rq, XK, keys[j]) * scale;
  __syncthreads();
  if (threadIdx.x == 0) {  // ≤ 3p scores, in key order as the CPU sums them
    int nk = 0;
    float mx = -INFINITY, sum = 0.0f;
    while (nk < P3 && keys[nk] >= 0) mx = fmaxf(mx, a[nk++]);
    for (int j = 0; j < nk; j++) {
      a[j] = expf(a[j] - mx);
      sum += a[j];
    }
    for (int j = 0; j < nk; j++) a[j] /= sum;
    *lse = mx + logf(sum);
  }
  __syncthreads();
  for (long f = threadIdx.x; f < d; f += kLin) {
    float acc = 0.0f;
    for (int j = 0; j < P3 && keys[j] >= 0; j++)
      acc += a[j] * XV[gfma_at(lv, l, f, h, keys[j] - lv.row[l])];
    o[f] = acc;
  }
}

// out (BH, T, d) += each level's term of the query's sub-segment, levels in order (the CPU adds
// them one after the other). grid (gpu_grid2): heads along y, each one's T·d floats along x. CPU
// twin: the adds of linear_level_forward.
__global__ void level_add(float *out, const float *O, gfma_items it, int L, int BH, int T, int d,
                          int t0) {
  for (int h = blockIdx.y; h < BH; h += gridDim.y) {
    float *o = out + (size_t)h * T * d;
    for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < T * d; e += gridDim.x * blockDim.x) {
      const int f = e % d, i = e / d;
      float acc = o[e];
      for (int l = 1; l <= L; l++) {
        const long item = it.off[l] + (t0 + i) / (int)it.seg[l] - it.rho0[l];
        acc += O[((size_t)item * BH + h) * d + f];
      }
      o[e] = acc;
    }
  }
}

// grid (items, BH), block kLin, (2d + 2·P3 + 1) floats of dynamic shared memory: the transpose
// of item `item`'s term for head h — g = Σ dout over its queries in the slab, the probabilities
// a again from lse, D = g·o, ds = a (g·V − D)/√d — dQ[qrow] += Σ ds K (its own row: no other item
// writes it); G (items, BH, d), A and DS (items, BH, P3) kept for level_scatter. CPU twin:
// linear_level_backward.
__global__ void level_backward(float *G, float *A, float *DS, float *dXQ, const float *dout,
                               const float *XQ, const float *XK, const float *XV,
                               const float *lse_far, const int *qrow, const int *key,
                               const int *item_row, const int *span, gfma_levels lv, long rows,
                               long T, int P3, float scale) {
  extern __shared__ float sh[];
  const long item = blockIdx.x, h = blockIdx.y, d = lv.d, at = (long)item * lv.BH + h;
  float *gs = sh, *os = sh + d, *a = os + d, *ds = a + P3, *Dsh = ds + P3;
  const int Rq = qrow[item], *keys = key + item * P3;
  if (Rq < 0 || keys[0] < 0) return;  // no term; nothing refers to its G, A, DS
  const int l = gfma_level_of(lv, Rq), i0 = span[2 * item], i1 = span[2 * item + 1];
  const float L = lse_far[h * rows + item_row[item]];
  for (long f = threadIdx.x; f < d; f += kLin) {
    float s = 0.0f;
    for (long i = i0; i < i1; i++) s += dout[(h * T + i) * d + f];
    gs[f] = G[at * d + f] = s;
  }
  for (int j = threadIdx.x; j < P3; j += kLin)
    a[j] = keys[j] >= 0 ? expf(row_dot(lv, l, h, XQ, Rq, XK, keys[j]) * scale - L) : 0.0f;
  __syncthreads();
  for (long f = threadIdx.x; f < d; f += kLin) {
    float o = 0.0f;
    for (int j = 0; j < P3 && keys[j] >= 0; j++)
      o += a[j] * XV[gfma_at(lv, l, f, h, keys[j] - lv.row[l])];
    os[f] = o;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float D = 0.0f;
    for (long f = 0; f < d; f++) D += gs[f] * os[f];
    Dsh[0] = D;
  }
  __syncthreads();
  for (int j = threadIdx.x; j < P3; j += kLin) {
    float dp = 0.0f;
    for (long f = 0; keys[j] >= 0 && f < d; f++)
      dp += gs[f] * XV[gfma_at(lv, l, f, h, keys[j] - lv.row[l])];
    ds[j] = keys[j] >= 0 ? a[j] * (dp - Dsh[0]) * scale : 0.0f;
    A[at * P3 + j] = a[j];
    DS[at * P3 + j] = ds[j];
  }
  __syncthreads();
  for (long f = threadIdx.x; f < d; f += kLin) {
    float acc = 0.0f;
    for (int j = 0; j < P3 && keys[j] >= 0; j++)
      acc += ds[j] * XK[gfma_at(lv, l, f, h, keys[j] - lv.row[l])];
    dXQ[gfma_at(lv, l, f, h, Rq - lv.row[l])] += acc;
  }
}

// grid (referenced key rows, BH), block kRow: dXV += Σ a·g and dXK += Σ ds·Q[qrow] over the
// items that list the row, in item order. CPU twin: the dv, dk updates of linear_level_backward.
__global__ void level_scatter(float *dXK, float *dXV, const float *G, const float *A,
                              const float *DS, const float *XQ, const int *qrow, gfma_refs refs,
                              gfma_levels lv, int P3) {
  const long k = blockIdx.x, h = blockIdx.y, R = refs.row[k];
  const int l = gfma_level_of(lv, R);
  for (long f = threadIdx.x; f < lv.d; f += kRow) {
    float ak = 0.0f, av = 0.0f;
    for (int e = refs.off[k]; e < refs.off[k + 1]; e++) {
      const long item = refs.ref[e] / P3, at = item * lv.BH + h;
      const int j = refs.ref[e] % P3;
      av += A[at * P3 + j] * G[at * lv.d + f];
      ak += DS[at * P3 + j] * XQ[gfma_at(lv, l, f, h, qrow[item] - lv.row[l])];
    }
    const size_t at = gfma_at(lv, l, f, h, R - lv.row[l]);
    dXK[at] += ak;
    dXV[at] += av;
  }
}

float *alloc_floats(size_t n) {
  return static_cast<float *>(gpu_alloc(MEM_WORKSPACE, sizeof(float) * (n + 1)));
}

}  // namespace

void gfma_linear_forward(const gfma *g, float *out, float *lse_near, float *lse_far, const float *q,
                         const float *k, const float *v, long klo, long kstride, const float *XQ,
                         const float *XK, const float *XV, const gfma_copies *made) {
  gfma_evaluate_forward(g, out, lse_near, q, k, v, klo, kstride, nullptr, nullptr, made);
  const long items = g->items.count, P3 = 3 * g->p;
  if (items == 0) return;
  const gpu_op_time t(TIMER_M2P);  // the levels' terms: fma_linear's far field
  float *O = alloc_floats((size_t)(items * g->BH * g->d));
  const dim3 grid(gpu_int(items, "fma_linear items"), (unsigned)g->BH);
  level_forward<<<grid, kLin, sizeof(float) * P3, gpu_stream()>>>(
      O, lse_far, XQ, XK, XV, g->item_qrow, g->item_key, g->item_row, g->lv, g->st->rows, (int)P3,
      1.0f / sqrtf((float)g->d));
  LAUNCH_CHECK(level_forward);
  gpu_int(g->st->t0 + g->T, "tokens");
  level_add<<<gpu_grid2(g->BH, g->T * g->d, kThreads), kThreads, 0, gpu_stream()>>>(
      out, O, g->items, g->L, (int)g->BH, (int)g->T, (int)g->d, (int)g->st->t0);
  LAUNCH_CHECK(level_add);
  gpu_free(O);
}

void gfma_linear_backward(const gfma *g, float *dq, float *dk, float *dv, float *dXQ, float *dXK,
                          float *dXV, const float *dout, const float *q, const float *k,
                          const float *v, long klo, long kstride, const float *XQ, const float *XK,
                          const float *XV, const float *lse_near, const float *lse_far,
                          const gfma_copies *made) {
  gfma_evaluate_backward(g, dq, dk, dv, nullptr, nullptr, dout, nullptr, q, k, v, klo, kstride,
                         nullptr, nullptr, lse_near, made);
  const long items = g->items.count, P3 = 3 * g->p, BH = g->BH;
  if (items == 0) return;
  const gpu_op_time t(TIMER_M2P);
  float *G = alloc_floats((size_t)(items * BH * g->d));
  float *A = alloc_floats((size_t)(items * BH * P3)), *DS = alloc_floats((size_t)(items * BH * P3));
  const dim3 grid(gpu_int(items, "fma_linear items"), (unsigned)BH);
  level_backward<<<grid, kLin, sizeof(float) * (2 * g->d + 2 * P3 + 1), gpu_stream()>>>(
      G, A, DS, dXQ, dout, XQ, XK, XV, lse_far, g->item_qrow, g->item_key, g->item_row,
      g->item_span, g->lv, g->st->rows, g->T, (int)P3, 1.0f / sqrtf((float)g->d));
  LAUNCH_CHECK(level_backward);
  if (g->lin_refs.nrows) {
    level_scatter<<<dim3(gpu_int(g->lin_refs.nrows, "summary rows"), (unsigned)BH), kRow, 0,
                    gpu_stream()>>>(dXK, dXV, G, A, DS, XQ, g->item_qrow, g->lin_refs, g->lv,
                                    (int)P3);
    LAUNCH_CHECK(level_scatter);
  }
  gpu_free(G);
  gpu_free(A);
  gpu_free(DS);
}
