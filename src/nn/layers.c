/* CPU implementations of the per-token layers declared in layers.h. Matrix products go through
 * CBLAS; elementwise and row-wise loops through OpenMP with static schedules. Parameter-gradient
 * reductions over rows use LAYERS_CHUNKS fixed row ranges summed in order, so the result is the
 * same for any thread count (a restart on another machine size stays bit-for-bit on one rank). */
#include "nn/layers.h"

#include <cblas.h>
#include <math.h>
#include <string.h>

#include "core/error.h"
#include "core/memory.h"
#include "core/rng.h"
#include "core/tilegemm.h"
#include "nn/vecmath.h"

#ifdef _OPENMP
#include <omp.h>
#endif

#define LAYERS_CHUNKS 64
#define LAYERNORM_EPS 1e-5f

/* ---------------------------------------------------------------------------------------------
 * linear */

/* Pieces: on CBLAS, a linear product's output is cut into pieces fixed by the product's shape
 * alone, never by the thread count: each piece LINEAR_PIECE rows (and, for dW, columns) or more
 * and LINEAR_PIECE_MNK multiply-adds or more, one single-threaded BLAS call over the whole depth
 * (inside a parallel region OpenBLAS runs on the calling thread). The team takes whole pieces, and
 * backward forms dX's and dW's in one region with no wait between them (docs/perf.md). Every
 * piece is the same call on 1, 2 or 64 threads, so every element has the same bits on any thread
 * count, whatever kernels OpenBLAS runs. Cuts made by the thread count did not: on some of
 * OpenBLAS's cores an element's bits depend on where its row falls in the call (Haswell's and
 * Zen's kernels, in a pattern that repeats every 6 rows) or on the call's size, so a thread's
 * slice of rows gave other bits than the whole call on Haswell, Zen and Prescott, where SkylakeX
 * and Cooperlake gave the same (tests/test_blas_cores.sh runs the suite's bit-for-bit tests under
 * each core). A product of one piece too runs on one thread: OpenBLAS's own split of a call
 * among threads gave other bits on Haswell, Zen and Prescott (test_linear_pieces' second shape).
 * Only a product of fewer than LINEAR_ONE_CALL multiply-adds (a decoded token's) is called from
 * where it stands, without a team: OpenBLAS 0.3.21 runs a product of fewer than 4 · 65536 on one
 * thread by itself. */
#define LINEAR_PIECE     256
#define LINEAR_PIECE_MNK ((double)(8L << 20))
#define LINEAR_ONE_CALL  ((double)(128L << 10))

/* how many pieces `len` is cut into, where each piece's every unit of len costs `per` multiply-adds
 */
static long linear_cuts(long len, double per) {
  long by_len = len / LINEAR_PIECE, by_work = (long)((double)len * per / LINEAR_PIECE_MNK);
  long p = by_len < by_work ? by_len : by_work;
  return p > 1 ? p : 1;
}

/* piece p of P over len: [*a, *b) */
static void linear_cut(long len, long p, long P, long *a, long *b) {
  *a = len * p / P;
  *b = len * (p + 1) / P;
}

/* out (N, OC) = inp (N, IC) weightᵀ (+ bias), rows [r0, r1) */
static void linear_rows(float *out, const float *inp, const float *weight, const float *bias,
                        long r0, long r1, int IC, int OC) {
  if (r1 <= r0) return;
  if (bias)
    for (long i = r0; i < r1; i++) memcpy(out + i * OC, bias, sizeof(float) * (size_t)OC);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)(r1 - r0), OC, IC, 1.0f, inp + r0 * IC,
              IC, weight, IC, bias ? 1.0f : 0.0f, out + r0 * OC, OC);
}

/* this thread's rows [*r0, *r1) of `rows`, cut among the team (the blocks below) */
static void slice_rows(long rows, long *r0, long *r1) {
#ifdef _OPENMP
  const int t = omp_get_thread_num(), T = omp_get_num_threads();
#else
  const int t = 0, T = 1;
#endif
  linear_cut(rows, t, T, r0, r1);
}

/* dinp's rows [r0, r1) = dout's rows · weight */
static void linear_dinp_rows(float *dinp, const float *dout, const float *weight, int IC, int OC,
                             long r0, long r1) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)(r1 - r0), IC, OC, 1.0f,
              dout + r0 * OC, OC, weight, IC, 0.0f, dinp + r0 * IC, IC);
}

/* dweight's rows [o0, o1) × columns [c0, c1) += dout's columns [o0, o1)ᵀ · inp's [c0, c1) */
static void linear_dweight_piece(float *dweight, const float *dout, const float *inp, long N,
                                 int IC, int OC, long o0, long o1, long c0, long c1) {
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)(o1 - o0), (int)(c1 - c0), (int)N, 1.0f,
              dout + o0, OC, inp + c0, IC, 1.0f, dweight + o0 * IC + c0, IC);
}

/* ---- linear on libxsmm's kernels, in blocks (tilegemm.h) ----
 * Where the attention tiles run on libxsmm, a linear product of LINEAR_BLOCK rows or more runs on
 * them too, in LINEAR_BLOCK × LINEAR_BLOCK blocks of its output: each block one product over the
 * whole depth (forward, dX) or over LINEAR_DEPTH rows at a time (dW, whose depth is the rows).
 * OpenBLAS packs both operands of every call and zeroes C in a pass of its own; libxsmm's kernels
 * read the operands in place. The bench model's shapes on 2 threads (docs/perf.md): forward
 * 1.00–1.10× OpenBLAS's rate, backward 1.08–1.14×. The blocks are fixed from row 0 and from
 * column 0, whatever the thread count, and each block is one kernel over the same depths, so an
 * element is the same sum on any thread count. Forward and dX add nothing to C inside the kernel
 * (beta 0, the bias added after), as OpenBLAS's kernels do, so where OpenBLAS ran the depth in one
 * pass (256 here) they give its bits. */
#define LINEAR_BLOCK 64
#define LINEAR_DEPTH 512

static bool linear_on_blocks(long N) { return N >= LINEAR_BLOCK && tile_gemm_xsmm(); }

static int block_len(long len, long at) {
  return (int)(len - at < LINEAR_BLOCK ? len - at : LINEAR_BLOCK);
}

/* rows × LINEAR_BLOCK floats of src (rows ld apart) to a panel of rows LINEAR_BLOCK apart: the
 * kernels then read one operand contiguous, where rows 4 KiB apart (1024 floats) would all fall in
 * the same few sets of the L1 cache */
static void panel_copy(float *panel, const float *src, long ld, long rows, int cols) {
  for (long r = 0; r < rows; r++)
    memcpy(panel + r * LINEAR_BLOCK, src + r * ld, sizeof(float) * (size_t)cols);
}

/* out (N, OC) = inp (N, IC) weightᵀ (+ bias): this thread's blocks of rows, by panels of weightᵀ
 * (IC, LINEAR_BLOCK) that each thread lays out for itself (a copy of IC · 64 floats against
 * rows · IC · 64 multiply-adds) and reads across its rows. */
static void linear_forward_blocks(float *out, const float *inp, const float *weight,
                                  const float *bias, long N, int IC, int OC) {
  const long blocks = (N + LINEAR_BLOCK - 1) / LINEAR_BLOCK;
#pragma omp parallel
  {
    float *panel = mem_alloc(MEM_WORKSPACE, sizeof(float) * (size_t)IC * LINEAR_BLOCK);
    long b0, b1;
    slice_rows(blocks, &b0, &b1);
    for (int j0 = 0; b1 > b0 && j0 < OC; j0 += LINEAR_BLOCK) {
      const int bj = block_len(OC, j0);
      tile_transpose(bj, IC, weight + (long)j0 * IC, IC, panel, LINEAR_BLOCK);
      for (long b = b0; b < b1; b++) {
        const long i0 = b * LINEAR_BLOCK;
        const int bi = block_len(N, i0);
        float *o = out + i0 * OC + j0;
        tile_sgemm(false, false, bi, bj, IC, 1.0f, inp + i0 * IC, IC, panel, LINEAR_BLOCK, 0.0f, o,
                   OC);
        for (int r = 0; bias && r < bi; r++) {
#pragma omp simd
          for (int c = 0; c < bj; c++) o[r * OC + c] += bias[j0 + c];
        }
      }
    }
    mem_free(panel);
  }
}

/* The bias gradient's partial sums (bias_partials) inside dW's loop, where each of their chunks
 * of rows lies within one of dW's pieces of LINEAR_DEPTH rows: the thread forming the first block
 * of a row of dW's blocks sums the block of dout's columns the product has just read, not in a
 * pass over dout of its own (36 MiB a transformer block of the bench model). The same sums in the
 * same order as that pass's, so the same bits. */
static bool bias_in_blocks(long N) {
  return N % LAYERS_CHUNKS == 0 && LINEAR_DEPTH % (N / LAYERS_CHUNKS) == 0;
}

/* part (LAYERS_CHUNKS, OC) += dout's column sums over each chunk of rows [r0, r1), columns
 * [o0, o1): rows in order, from row 0 of the chunk */
static void bias_partials(float *part, const float *dout, long N, int OC, long r0, long r1, long o0,
                          long o1) {
  for (int c = (int)(r0 * LAYERS_CHUNKS / N); c < LAYERS_CHUNKS && N * c / LAYERS_CHUNKS < r1;
       c++) {
    float *p = part + (size_t)c * OC;
    const long c0 = N * c / LAYERS_CHUNKS, c1 = N * (c + 1) / LAYERS_CHUNKS;
    for (long r = c0 > r0 ? c0 : r0; r < (c1 < r1 ? c1 : r1); r++) {
      const float *g = dout + r * OC;
#pragma omp simd
      for (long o = o0; o < o1; o++) p[o] += g[o];
    }
  }
}

/* dinp = dout · weight, by blocks of rows, each thread reading its copy of weight's panel (OC,
 * LINEAR_BLOCK); dweight += doutᵀ · inp, by blocks of (OC, IC), each summed over the rows
 * LINEAR_DEPTH at a time from row 0; and where part is given (bias_in_blocks), the bias's
 * partial sums with them. One region, the two shared out. */
static void linear_backward_blocks(float *dinp, float *dweight, float *part, const float *dout,
                                   const float *inp, const float *weight, long N, int IC, int OC) {
  const long row_blocks = (N + LINEAR_BLOCK - 1) / LINEAR_BLOCK;
  const long ob = (OC + LINEAR_BLOCK - 1) / LINEAR_BLOCK,
             ib = (IC + LINEAR_BLOCK - 1) / LINEAR_BLOCK;
#pragma omp parallel
  {
    float *panel = mem_alloc(MEM_WORKSPACE, sizeof(float) * (size_t)OC * LINEAR_BLOCK);
    long b0, b1;
    slice_rows(row_blocks, &b0, &b1);
    for (int j0 = 0; dinp && b1 > b0 && j0 < IC; j0 += LINEAR_BLOCK) {
      const int bj = block_len(IC, j0);
      panel_copy(panel, weight + j0, IC, OC, bj);
      for (long b = b0; b < b1; b++) {
        const long i0 = b * LINEAR_BLOCK;
        tile_sgemm(false, false, block_len(N, i0), bj, OC, 1.0f, dout + i0 * OC, OC, panel,
                   LINEAR_BLOCK, 0.0f, dinp + i0 * IC + j0, IC);
      }
    }
    mem_free(panel);
    long w0, w1; /* this thread's blocks of dweight, row-major over (ob, ib) */
    slice_rows(dweight ? ob * ib : 0, &w0, &w1);
    for (long k0 = 0; k0 < N; k0 += LINEAR_DEPTH) {
      const int bk = (int)(N - k0 < LINEAR_DEPTH ? N - k0 : LINEAR_DEPTH);
      for (long w = w0; w < w1; w++) {
        const long o0 = w / ib * LINEAR_BLOCK, c0 = w % ib * LINEAR_BLOCK;
        tile_sgemm(true, false, block_len(OC, o0), block_len(IC, c0), bk, 1.0f, dout + k0 * OC + o0,
                   OC, inp + k0 * IC + c0, IC, 1.0f, dweight + o0 * IC + c0, IC);
        if (part && c0 == 0)
          bias_partials(part, dout, N, OC, k0, k0 + bk, o0, o0 + block_len(OC, o0));
      }
    }
  }
}

void linear_forward(float *out, const float *inp, const float *weight, const float *bias, long N,
                    int IC, int OC) {
  if (linear_on_blocks(N)) {
    linear_forward_blocks(out, inp, weight, bias, N, IC, OC);
    return;
  }
  if ((double)N * IC * OC < LINEAR_ONE_CALL) {
    linear_rows(out, inp, weight, bias, 0, N, IC, OC);
    return;
  }
  const long P = linear_cuts(N, (double)IC * OC);
#pragma omp parallel for schedule(dynamic, 1)
  for (long p = 0; p < P; p++) {
    long r0, r1;
    linear_cut(N, p, P, &r0, &r1);
    linear_rows(out, inp, weight, bias, r0, r1, IC, OC);
  }
}

void linear_backward(float *dinp, float *dweight, float *dbias, const float *dout, const float *inp,
                     const float *weight, long N, int IC, int OC) {
  if (N == 0) return;
  /* the bias's column sums in fixed chunks of rows, then the chunks in order */
  float *part = dbias ? mem_alloc(MEM_WORKSPACE, sizeof(float) * LAYERS_CHUNKS * (size_t)OC) : NULL;
  bool summed = false; /* part formed already */
  if (linear_on_blocks(N)) {
    summed = part && dweight && bias_in_blocks(N);
    linear_backward_blocks(dinp, dweight, summed ? part : NULL, dout, inp, weight, N, IC, OC);
  } else {
    /* dX by pieces of its rows; dW by pieces of its rows and columns, each over all N rows */
    const long P = dinp ? linear_cuts(N, (double)IC * OC) : 0;
    const long PO = dweight ? linear_cuts(OC, (double)N * IC) : 0;
    const long PC = dweight ? linear_cuts(IC, (double)N * (double)OC / (double)PO) : 0;
#pragma omp parallel
    {
#pragma omp for schedule(dynamic, 1) nowait
      for (long p = 0; p < P; p++) {
        long r0, r1;
        linear_cut(N, p, P, &r0, &r1);
        linear_dinp_rows(dinp, dout, weight, IC, OC, r0, r1);
      }
#pragma omp for schedule(dynamic, 1)
      for (long w = 0; w < PO * PC; w++) {
        long o0, o1, c0, c1;
        linear_cut(OC, w / PC, PO, &o0, &o1);
        linear_cut(IC, w % PC, PC, &c0, &c1);
        linear_dweight_piece(dweight, dout, inp, N, IC, OC, o0, o1, c0, c1);
      }
    }
  }
  if (dbias) {
    if (!summed) {
#pragma omp parallel for schedule(static)
      for (int c = 0; c < LAYERS_CHUNKS; c++)
        bias_partials(part, dout, N, OC, N * c / LAYERS_CHUNKS, N * (c + 1) / LAYERS_CHUNKS, 0, OC);
    }
    for (int c = 0; c < LAYERS_CHUNKS; c++) {
      const float *p = part + (size_t)c * OC;
      for (int o = 0; o < OC; o++) dbias[o] += p[o];
    }
    mem_free(part);
  }
}

/* ---------------------------------------------------------------------------------------------
 * layernorm */

void layernorm_forward(float *out, float *mean, float *rstd, const float *inp, const float *weight,
                       const float *bias, long N, int C) {
#pragma omp parallel for schedule(static)
  for (long i = 0; i < N; i++) {
    const float *x = inp + i * C;
    float *y = out + i * C;
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int c = 0; c < C; c++) s += x[c];
    float m = s / (float)C;
    float v = 0.0f;
#pragma omp simd reduction(+ : v)
    for (int c = 0; c < C; c++) v += (x[c] - m) * (x[c] - m);
    float r = 1.0f / sqrtf(v / (float)C + LAYERNORM_EPS);
#pragma omp simd
    for (int c = 0; c < C; c++) y[c] = (x[c] - m) * r * weight[c] + bias[c];
    mean[i] = m;
    rstd[i] = r;
  }
}

void layernorm_backward(float *dinp, float *dweight, float *dbias, const float *dout,
                        const float *inp, const float *weight, const float *mean, const float *rstd,
                        long N, int C) {
  float *part = mem_alloc(MEM_WORKSPACE, sizeof(float) * LAYERS_CHUNKS * 2 * (size_t)C);
#pragma omp parallel for schedule(static)
  for (int ch = 0; ch < LAYERS_CHUNKS; ch++) {
    float *pw = part + (size_t)ch * 2 * C, *pb = pw + C;
    long r0 = N * ch / LAYERS_CHUNKS, r1 = N * (ch + 1) / LAYERS_CHUNKS;
    for (long i = r0; i < r1; i++) {
      const float *x = inp + i * C, *g = dout + i * C;
      float *dx = dinp + i * C;
      float m = mean[i], r = rstd[i];
      /* dnorm = g·w; dx = (dnorm − mean(dnorm) − xhat·mean(dnorm·xhat))·rstd */
      float sum_dn = 0.0f, sum_dnx = 0.0f;
#pragma omp simd reduction(+ : sum_dn, sum_dnx)
      for (int c = 0; c < C; c++) {
        float xh = (x[c] - m) * r;
        float dn = g[c] * weight[c];
        sum_dn += dn;
        sum_dnx += dn * xh;
      }
      float mdn = sum_dn / (float)C, mdnx = sum_dnx / (float)C;
#pragma omp simd
      for (int c = 0; c < C; c++) {
        float xh = (x[c] - m) * r;
        float dn = g[c] * weight[c];
        dx[c] += (dn - mdn - xh * mdnx) * r;
        pw[c] += g[c] * xh;
        pb[c] += g[c];
      }
    }
  }
  for (int ch = 0; ch < LAYERS_CHUNKS; ch++) {
    const float *pw = part + (size_t)ch * 2 * C, *pb = pw + C;
    for (int c = 0; c < C; c++) {
      dweight[c] += pw[c];
      dbias[c] += pb[c];
    }
  }
  mem_free(part);
}

/* ---------------------------------------------------------------------------------------------
 * GELU (tanh form) */

#define GELU_K 0.7978845608028654f /* √(2/π) */
#define GELU_A 0.044715f

/* Every value goes through the vector loop, in tasks of GELU_TASK values and the last vector
 * padded: libmvec's vector tanhf and the scalar one differ in the last bit, and a `parallel for
 * simd` over the whole count ran each thread's ragged tail on the scalar one, so a value's bits
 * depended on the thread count (gelu_backward at 1 and 2 threads differed for counts that do not
 * split into whole vectors; test_gelu_threads). */
enum { GELU_LANES = 16, GELU_TASK = 64 * GELU_LANES };

/* GELU (tanh form) of x, and its derivative */
static inline float gelu_value(float x) {
  return 0.5f * x * (1.0f + tanhf(GELU_K * (x + GELU_A * x * x * x)));
}

static inline float gelu_slope(float x) {
  const float t = tanhf(GELU_K * (x + GELU_A * x * x * x)), sech2 = 1.0f - t * t;
  return 0.5f * (1.0f + t) + 0.5f * x * sech2 * GELU_K * (1.0f + 3.0f * GELU_A * x * x);
}

/* out[0, n) = gelu(in), or gelu'(in) · dout where dout is given: whole vectors, and the tail as
 * one more, padded */
static void gelu_span(float *out, const float *in, const float *dout, long n) {
  const long whole = n / GELU_LANES * GELU_LANES;
  if (dout) {
#pragma omp simd
    for (long i = 0; i < whole; i++) out[i] = gelu_slope(in[i]) * dout[i];
  } else {
#pragma omp simd
    for (long i = 0; i < whole; i++) out[i] = gelu_value(in[i]);
  }
  if (whole == n) return;
  float x[GELU_LANES] = {0}, g[GELU_LANES] = {0}, y[GELU_LANES];
  memcpy(x, in + whole, sizeof(float) * (size_t)(n - whole));
  if (dout) memcpy(g, dout + whole, sizeof(float) * (size_t)(n - whole));
  gelu_span(y, x, dout ? g : NULL, GELU_LANES);
  memcpy(out + whole, y, sizeof(float) * (size_t)(n - whole));
}

static void gelu_tasks(float *out, const float *in, const float *dout, size_t count) {
  const long n = (long)count;
#pragma omp parallel for schedule(static) if (n > GELU_TASK)
  for (long i0 = 0; i0 < n; i0 += GELU_TASK)
    gelu_span(out + i0, in + i0, dout ? dout + i0 : NULL, n - i0 < GELU_TASK ? n - i0 : GELU_TASK);
}

void gelu_forward(float *out, const float *inp, size_t count) { gelu_tasks(out, inp, NULL, count); }

void gelu_backward(float *dinp, const float *dout, const float *inp, size_t count) {
  gelu_tasks(dinp, inp, dout, count);
}

/* ---------------------------------------------------------------------------------------------
 * embeddings */

void embedding_forward(float *out, const int *tokens, const float *token, const float *position,
                       long B, long T, int C, long t0) {
#pragma omp parallel for schedule(static)
  for (long bt = 0; bt < B * T; bt++) {
    const float *e = token + (size_t)tokens[bt] * C;
    float *y = out + bt * C;
    if (position) {
      const float *p = position + (size_t)(t0 + bt % T) * C;
#pragma omp simd
      for (int c = 0; c < C; c++) y[c] = e[c] + p[c];
    } else {
      memcpy(y, e, sizeof(float) * (size_t)C);
    }
  }
}

void embedding_backward(float *dtoken, float *dposition, const float *dout, const int *tokens,
                        long B, long T, int C, int V, long t0) {
  /* Token rows are scattered (several positions share a token), so this loop is serial in the
   * token table but parallel over channels: each thread owns a channel range. */
#pragma omp parallel
  {
#ifdef _OPENMP
    int nth = omp_get_num_threads(), th = omp_get_thread_num();
#else
    int nth = 1, th = 0;
#endif
    int c0 = C * th / nth, c1 = C * (th + 1) / nth;
    for (long bt = 0; bt < B * T; bt++) {
      const float *g = dout + bt * C;
      float *e = dtoken + (size_t)tokens[bt] * C;
      for (int c = c0; c < c1; c++) e[c] += g[c];
    }
    if (dposition) {
      for (long t = 0; t < T; t++) {
        float *p = dposition + (size_t)(t0 + t) * C;
        for (long b = 0; b < B; b++) {
          const float *g = dout + (b * T + t) * C;
          for (int c = c0; c < c1; c++) p[c] += g[c];
        }
      }
    }
  }
}

void sinusoidal_forward(float *x, long B, long T, int C, long t0, float scale) {
  int half = C / 2;
#pragma omp parallel for schedule(static)
  for (long t = 0; t < T; t++) {
    double pos = (double)(t0 + t);
    for (int i = 0; i < half; i++) {
      double freq = pow(10000.0, -2.0 * i / (double)C);
      float s = scale * (float)sin(pos * freq), co = scale * (float)cos(pos * freq);
      for (long b = 0; b < B; b++) {
        float *row = x + (b * T + t) * C;
        row[2 * i] += s;
        row[2 * i + 1] += co;
      }
    }
  }
}

/* ---------------------------------------------------------------------------------------------
 * rotary position embedding */

static void rope_apply(float *x, long BH, long T, int d, long t0, float sign) {
  int half = d / 2;
  float *cs = mem_alloc(MEM_WORKSPACE, sizeof(float) * 2 * (size_t)T * half); /* (T, half, 2) */
#pragma omp parallel for schedule(static)
  for (long t = 0; t < T; t++) {
    for (int i = 0; i < half; i++) {
      double ang = (double)(t0 + t) * pow(10000.0, -2.0 * i / (double)d);
      cs[(t * half + i) * 2] = (float)cos(ang);
      cs[(t * half + i) * 2 + 1] = sign * (float)sin(ang);
    }
  }
#pragma omp parallel for schedule(static)
  for (long bh = 0; bh < BH; bh++) {
    for (long t = 0; t < T; t++) {
      float *row = x + (bh * T + t) * d;
      const float *c = cs + t * half * 2;
      for (int i = 0; i < half; i++) {
        float a = row[2 * i], b = row[2 * i + 1];
        row[2 * i] = a * c[2 * i] - b * c[2 * i + 1];
        row[2 * i + 1] = a * c[2 * i + 1] + b * c[2 * i];
      }
    }
  }
  mem_free(cs);
}

void rope_forward(float *x, long BH, long T, int d, long t0) { rope_apply(x, BH, T, d, t0, 1.0f); }

/* The rotation is orthogonal: its transpose (the inverse rotation) maps dy to dx. Used on a
 * gradient buffer that holds only this op's contribution. */
void rope_backward(float *dx, long BH, long T, int d, long t0) {
  rope_apply(dx, BH, T, d, t0, -1.0f);
}

/* ---------------------------------------------------------------------------------------------
 * dropout */

/* 16-bit words that may alias the 64-bit draws they are cut from (a GCC and Clang attribute) */
typedef uint16_t uint16_t_alias __attribute__((may_alias));
#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "dropout_row reads the draws' 16-bit words in little-endian order"
#endif

/* mask row (C) of 0 or 1/(1−p) for element (b, t, ·): 16 random bits per element, 4 elements per
 * rng_bits(seed, RNG_DROPOUT, step, site << 40 ^ sample, token · C4 + c4). The key's fold is shared
 * by the row (rng_prefix) and each group of 4 costs one finaliser, vectorised: the same bits. */
static void dropout_row(float *mask, const struct dropout_key *key, long b, long t, int C) {
  const int C4 = (C + 3) / 4;
  const uint32_t thresh = (uint32_t)(key->p * 65536.0f);
  const float scale = 1.0f / (1.0f - key->p);
  const uint64_t prefix = rng_prefix(key->seed, RNG_DROPOUT, (uint64_t)key->step,
                                     ((uint64_t)key->site << 40) ^ (uint64_t)(key->sample0 + b));
  const uint64_t c0 = (uint64_t)(key->t0 + t) * (uint64_t)C4;
  uint64_t r[C4];
#pragma omp simd
  for (int c4 = 0; c4 < C4; c4++) r[c4] = rng_bits_last(prefix, c0 + (uint64_t)c4);
  /* element c's 16 bits are bits 16·(c mod 4) … of r[c / 4]: on a little-endian CPU, the c-th
   * 16-bit word of r, read as such so that the loop vectorises */
  const uint16_t_alias *u = (const uint16_t_alias *)r;
#pragma omp simd
  for (int c = 0; c < C; c++) mask[c] = u[c] >= thresh ? scale : 0.0f;
}

void dropout_forward(float *x, const struct dropout_key *key, long B, long T, int C) {
  if (key->p <= 0.0f) return;
#pragma omp parallel
  {
    float mask[C];
#pragma omp for schedule(static)
    for (long bt = 0; bt < B * T; bt++) {
      dropout_row(mask, key, bt / T, bt % T, C);
      float *row = x + bt * C;
      for (int c = 0; c < C; c++) row[c] *= mask[c];
    }
  }
}

void dropout_backward(float *dx, const struct dropout_key *key, long B, long T, int C) {
  dropout_forward(dx, key, B, T, C); /* the same mask scales the gradient */
}

void residual_dropout_forward(float *out, const float *res, const float *y,
                              const struct dropout_key *key, long B, long T, int C) {
  if (key->p <= 0.0f) {
#pragma omp parallel for simd schedule(static)
    for (long i = 0; i < B * T * C; i++) out[i] = res[i] + y[i];
    return;
  }
#pragma omp parallel
  {
    float mask[C];
#pragma omp for schedule(static)
    for (long bt = 0; bt < B * T; bt++) {
      dropout_row(mask, key, bt / T, bt % T, C);
      for (int c = 0; c < C; c++) out[bt * C + c] = res[bt * C + c] + y[bt * C + c] * mask[c];
    }
  }
}

void residual_dropout_backward(float *dres, float *dy, const float *dout,
                               const struct dropout_key *key, long B, long T, int C) {
  if (dres != dout) memcpy(dres, dout, sizeof(float) * (size_t)(B * T * C));
  if (key->p <= 0.0f) {
#pragma omp parallel for simd schedule(static)
    for (long i = 0; i < B * T * C; i++) dy[i] = dout[i];
    return;
  }
#pragma omp parallel
  {
    float mask[C];
#pragma omp for schedule(static)
    for (long bt = 0; bt < B * T; bt++) {
      dropout_row(mask, key, bt / T, bt % T, C);
      for (int c = 0; c < C; c++) dy[bt * C + c] = dout[bt * C + c] * mask[c];
    }
  }
}

/* ---------------------------------------------------------------------------------------------
 * head layout */

void heads_split_forward(float *q, float *k, float *v, const float *qkv, long B, long T, int Hqk,
                         int H, int d) {
  const int Cqk = Hqk * d, W = (2 * Hqk + H) * d; /* a row of qkv: q (Cqk) | k (Cqk) | v (H·d) */
#pragma omp parallel for collapse(2) schedule(static)
  for (long b = 0; b < B; b++)
    for (long t = 0; t < T; t++) {
      const float *src = qkv + (b * T + t) * W;
      for (int h = 0; h < Hqk; h++) {
        const size_t dst = (((size_t)b * Hqk + h) * T + t) * d;
        memcpy(q + dst, src + h * d, sizeof(float) * d);
        memcpy(k + dst, src + Cqk + h * d, sizeof(float) * d);
      }
      for (int h = 0; h < H; h++)
        memcpy(v + (((size_t)b * H + h) * T + t) * d, src + 2 * Cqk + h * d, sizeof(float) * d);
    }
}

void heads_split_backward(float *dqkv, const float *dq, const float *dk, const float *dv, long B,
                          long T, int Hqk, int H, int d) {
  const int Cqk = Hqk * d, W = (2 * Hqk + H) * d;
#pragma omp parallel for collapse(2) schedule(static)
  for (long b = 0; b < B; b++)
    for (long t = 0; t < T; t++) {
      float *dst = dqkv + (b * T + t) * W;
      for (int h = 0; h < Hqk; h++) {
        const size_t src = (((size_t)b * Hqk + h) * T + t) * d;
        memcpy(dst + h * d, dq + src, sizeof(float) * d);
        memcpy(dst + Cqk + h * d, dk + src, sizeof(float) * d);
      }
      for (int h = 0; h < H; h++)
        memcpy(dst + 2 * Cqk + h * d, dv + (((size_t)b * H + h) * T + t) * d, sizeof(float) * d);
    }
}

void heads_merge_forward(float *y, const float *att, long B, long T, int H, int d) {
  int C = H * d;
#pragma omp parallel for collapse(2) schedule(static)
  for (long b = 0; b < B; b++)
    for (long t = 0; t < T; t++)
      for (int h = 0; h < H; h++)
        memcpy(y + (b * T + t) * C + h * d, att + (((size_t)b * H + h) * T + t) * d,
               sizeof(float) * d);
}

void heads_merge_backward(float *datt, const float *dy, long B, long T, int H, int d) {
  int C = H * d;
#pragma omp parallel for collapse(2) schedule(static)
  for (long b = 0; b < B; b++)
    for (long t = 0; t < T; t++)
      for (int h = 0; h < H; h++)
        memcpy(datt + (((size_t)b * H + h) * T + t) * d, dy + (b * T + t) * C + h * d,
               sizeof(float) * d);
}

/* ---------------------------------------------------------------------------------------------
 * softmax cross-entropy */

double softmax_xent_rows_forward_backward(float *logits, const int *targets, long N, int V,
                                          float grad_scale, float *row_loss, int *row_pred) {
  double total = 0.0;
#pragma omp parallel for schedule(static) reduction(+ : total)
  for (long i = 0; i < N; i++) {
    float *z = logits + i * V;
    int tgt = targets[i];
    if (tgt < 0) {
      memset(z, 0, sizeof(float) * (size_t)V);
      if (row_loss) row_loss[i] = 0.0f;
      if (row_pred) row_pred[i] = -1;
      continue;
    }
    float mx = z[0], zt = z[tgt];
    int arg = 0;
    for (int j = 1; j < V; j++)
      if (z[j] > mx) mx = z[j], arg = j;
    if (row_pred) row_pred[i] = arg;
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int j = 0; j < V; j++) {
      z[j] = expf(z[j] - mx);
      s += z[j];
    }
    float inv = 1.0f / s;
    const double loss = log((double)s) - (double)(zt - mx);
    total += loss;
    if (row_loss) row_loss[i] = (float)loss;
#pragma omp simd
    for (int j = 0; j < V; j++) z[j] *= inv * grad_scale;
    z[tgt] -= grad_scale;
  }
  return total;
}

double softmax_xent_forward_backward(float *logits, const int *targets, long N, int V,
                                     float grad_scale, float *row_loss) {
  return softmax_xent_rows_forward_backward(logits, targets, N, V, grad_scale, row_loss, NULL);
}
