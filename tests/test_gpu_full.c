/* Exact attention on the GPU (gpu/attention_full*.cu) against the CPU op of src/attention/full.c:
 * the SIMT reference and the blocked cuBLAS form, `full` and `local`, causal and bidirectional,
 * one slab and S ranks over NCCL (the ring, the halo, with MPI's byte counts), fp32 and bf16,
 * causality by perturbation on the device. Natively on a GPU (--with-cuda), or through
 * tests/cudaemu (test_gpu_full_emu); with no GPU the whole program is one TAP skip. */
#include "testutil.h"

#include "../gpu/gpu.h"
#include "../src/attention/attention.h"
#include "../src/deck/config.h"
#include "../src/model/backend.h"
#include "../src/parallel/comm.h"

/* fp32 on both sides, other summation orders; relative to the largest entry (tu_rel_err). The
 * emulation measures at most 1.1e-6 (out, lse) and 6e-7 (dq, dk, dv) */
#define TOL_OUT  2e-5 /* out and lse */
#define TOL_GRAD 2e-5 /* dq, dk, dv */
/* bf16 operands (8 significant bits) with fp32 accumulation, against the fp32 CPU op: measured
 * at most 4.7e-3 (out), 1.4e-3 (lse), 3.7e-3 (dq, dk, dv) */
#define TOL_BF16 1e-2

/* The kernels the program started with: GPU_TEST_EXACT = blocked (unset) or reference, as the
 * deck's gpu.exact would choose them (gpu_full_open sets them). */
static enum gpu_exact_kernels env_kernels;

static float *up(const float *h, size_t n) {
  float *d = gpu_alloc(MEM_WORKSPACE, sizeof(float) * n);
  gpu_upload(d, h, sizeof(float) * n);
  return d;
}

/* Uninitialised device memory (NaN under the emulation, so a value never written shows). */
static float *dev(size_t n) { return gpu_alloc(MEM_WORKSPACE, sizeof(float) * n); }

static float *randn(size_t n, uint64_t key) {
  float *x = malloc(sizeof(float) * (n ? n : 1));
  tu_randn(x, n, key, 1.0f);
  return x;
}

static float *down(const float *d, size_t n) {
  float *h = malloc(sizeof(float) * (n ? n : 1));
  gpu_download(h, d, sizeof(float) * n);
  return h;
}

/* The device array d against the host array h (relative to h's largest entry). */
static double diff(const float *d, const float *h, size_t n) {
  float *back = down(d, n);
  double *ref = tu_to_double(h, n);
  const double e = tu_rel_err(back, ref, n);
  free(back);
  free(ref);
  return e;
}

static const char *kind_name(enum gpu_exact_kernels k) {
  return k == GPU_EXACT_REFERENCE ? "reference" : "blocked";
}

/* One exact-attention case: local's band (0: full), the mask, the head size. */
struct exact_case {
  long band;
  bool causal;
  int d;
};

static void case_config(struct config *cfg, struct exact_case c, long n, long H) {
  tu_config(cfg, c.band > 0 ? "local" : "full", n, (int)H, c.d, c.causal,
            TU_SETS(tu_fmt("attention.local.band=%ld", c.band > 0 ? c.band : 128)));
}

static void case_name(char *s, size_t len, enum gpu_exact_kernels k, struct exact_case c, long n) {
  if (c.band > 0)
    snprintf(s, len, "%s local band %ld %s d=%d n=%ld", kind_name(k), c.band,
             c.causal ? "causal" : "bidirectional", c.d, n);
  else
    snprintf(s, len, "%s full %s d=%d n=%ld", kind_name(k), c.causal ? "causal" : "bidirectional",
             c.d, n);
}

/* The five comparisons of a run: out, lse, dq, dk, dv. */
struct errs {
  double e[5];
};
static const char *const errs_what[5] = {"out", "lse", "dq (accumulated)", "dk (accumulated)",
                                         "dv (accumulated)"};

static void errs_assert(const struct errs *x, double tol_out, double tol_grad, const char *name) {
  for (int i = 0; i < 5; i++) {
    char what[200];
    snprintf(what, sizeof what, "%s: %s", name, errs_what[i]);
    TU_ASSERT_CLOSE(x->e[i], i < 2 ? tol_out : tol_grad, what);
  }
}

/* The CPU op and the GPU op (kernels k, through its attn_impl) on one slab of n tokens, B·H heads
 * of the same random inputs; dq, dk, dv accumulate onto the same non-zero buffers. */
static struct errs run_slab(enum gpu_exact_kernels k, struct exact_case c, long B, long H, long n) {
  struct config cfg;
  case_config(&cfg, c, n, H);
  const long BH = B * H, d = c.d;
  const size_t count = (size_t)(BH * n * d), rows = (size_t)(BH * n);
  struct attn_ctx cpu = tu_attn_open(&cfg, B);
  struct attn_ctx gpu = attention_open(&cfg, cpu.variant, DEVICE_GPU, NULL, 0, cpu.dims);
  assert_true(attention_saved_floats(&gpu) == rows); /* lse alone, as the CPU saves */
  float *q = randn(count, 51), *kk = randn(count, 52), *v = randn(count, 53), *g = randn(count, 54);
  float *dq = randn(count, 55), *dk = randn(count, 56), *dv = randn(count, 57);
  float *out = malloc(4 * count), *lse = malloc(4 * rows);
  float *gq = up(q, count), *gk = up(kk, count), *gv = up(v, count), *gg = up(g, count);
  float *gdq = up(dq, count), *gdk = up(dk, count), *gdv = up(dv, count);
  float *gout = dev(count), *glse = dev(rows);
  gpu_set_exact_kernels(k);
  attention_forward(&cpu, out, lse, q, kk, v, NULL);
  attention_forward(&gpu, gout, glse, gq, gk, gv, NULL);
  attention_backward(&cpu, dq, dk, dv, NULL, g, q, kk, v, NULL, out, lse);
  attention_backward(&gpu, gdq, gdk, gdv, NULL, gg, gq, gk, gv, NULL, gout, glse);
  struct errs x = {{diff(gout, out, count), diff(glse, lse, rows), diff(gdq, dq, count),
                    diff(gdk, dk, count), diff(gdv, dv, count)}};
  gpu_set_exact_kernels(env_kernels);
  attention_close(&gpu);
  attention_close(&cpu);
  float *host[] = {q, kk, v, g, dq, dk, dv, out, lse},
        *devs[] = {gq, gk, gv, gg, gdq, gdk, gdv, gout, glse};
  for (int i = 0; i < 9; i++) free(host[i]), gpu_free(devs[i]);
  gpu_release_cache(); /* under the emulation every launch costs as much as the resident memory */
  return x;
}

static void check_slab(enum gpu_exact_kernels k, struct exact_case c, long n, double tol_out,
                       double tol_grad) {
  char name[160];
  case_name(name, sizeof name, k, c, n);
  const struct errs x = run_slab(k, c, 2, 3, n);
  if (getenv("FMATTN_TEST_VERBOSE"))
    print_message("# %s: out %.2e lse %.2e dq %.2e dk %.2e dv %.2e\n", name, x.e[0], x.e[1], x.e[2],
                  x.e[3], x.e[4]);
  errs_assert(&x, tol_out, tol_grad, name);
}

/* {full, local with a band shorter than a tile (12 < 16), longer (70 > 32), and one so long that
 * the blocked form takes the full form with the band mask (150: windows ≥ n)} × {causal,
 * bidirectional}, head sizes 16 to 128 among them; n = 203 lies on no tile boundary. */
static const struct exact_case slab_cases[] = {
    {0, true, 16},   {0, true, 128}, {0, false, 64},   {0, false, 32},  {12, true, 32},
    {12, false, 16}, {70, true, 64}, {70, false, 128}, {150, true, 16}, {150, false, 32},
};
#define NSLAB (sizeof slab_cases / sizeof *slab_cases)

static void test_gpu_full_reference(void **state) {
  for (size_t i = 0; i < NSLAB; i++)
    check_slab(GPU_EXACT_REFERENCE, slab_cases[i], 203, TOL_OUT, TOL_GRAD);
}

static void test_gpu_full_blocked(void **state) {
  for (size_t i = 0; i < NSLAB; i++)
    check_slab(GPU_EXACT_BLOCKED, slab_cases[i], 203, TOL_OUT, TOL_GRAD);
  /* any head size: the reference's four and others */
  check_slab(GPU_EXACT_BLOCKED, (struct exact_case){0, true, 48}, 203, TOL_OUT, TOL_GRAD);
  check_slab(GPU_EXACT_BLOCKED, (struct exact_case){40, false, 80}, 203, TOL_OUT, TOL_GRAD);
  check_slab(GPU_EXACT_BLOCKED, (struct exact_case){0, false, 16}, 3, TOL_OUT, TOL_GRAD);
}

/* Workspace budgets that force chunks: several chunks of heads, of query rows within one head,
 * of a band's query blocks (one per chunk, then a few). */
static void test_gpu_full_chunks(void **state) {
  const size_t budgets[] = {340 << 10, 16 << 10, 40 << 10};
  const struct exact_case cases[] = {
      {0, true, 32}, {0, false, 16}, {12, true, 32}, {70, false, 16}};
  for (size_t b = 0; b < 3; b++) {
    gpu_set_exact_workspace(budgets[b]);
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++)
      check_slab(GPU_EXACT_BLOCKED, cases[i], 203, TOL_OUT, TOL_GRAD);
  }
  gpu_set_exact_workspace(0);
}

/* bf16 in every product of the blocked form (gpu_set_bf16): within TOL_BF16 of the fp32 CPU op.
 * Its products take fp32 operands with bf16 math permitted (CUBLAS_COMPUTE_32F_FAST_16BF), which
 * cuBLAS may keep in fp32 for a shape (on an H200: d = 16); under the emulation, which always
 * rounds, the result must also be measurably not the fp32 one (the products did round). */
static void test_gpu_full_bf16(void **state) {
  const struct exact_case cases[] = {
      {0, true, 64}, {0, false, 32}, {12, true, 16}, {70, false, 64}};
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    char name[160];
    case_name(name, sizeof name, GPU_EXACT_BLOCKED, cases[i], 203);
    strcat(name, " bf16");
    gpu_set_bf16(true);
    const struct errs x = run_slab(GPU_EXACT_BLOCKED, cases[i], 2, 3, 203);
    gpu_set_bf16(false);
    if (getenv("FMATTN_TEST_VERBOSE"))
      print_message("# %s: out %.2e lse %.2e dq %.2e dk %.2e dv %.2e\n", name, x.e[0], x.e[1],
                    x.e[2], x.e[3], x.e[4]);
    errs_assert(&x, TOL_BF16, TOL_BF16, name);
    if (TU_GPU_EMU && !(x.e[0] > 10 * TOL_OUT))
      fail_msg("%s: out within fp32's tolerance: were the operands bf16?", name);
  }
}

/* The blocked backward is deterministic: no float atomics, sums in a fixed order. Two runs on the
 * same inputs give the same bits. */
static void test_gpu_full_deterministic(void **state) {
  const long BH = 6, n = 203, d = 32;
  const size_t count = (size_t)(BH * n * d), rows = (size_t)(BH * n);
  float *q = randn(count, 71), *k = randn(count, 72), *v = randn(count, 73), *g = randn(count, 74);
  float *gq = up(q, count), *gk = up(k, count), *gv = up(v, count), *gg = up(g, count);
  float *gout = dev(count), *glse = dev(rows), *gd = dev(3 * count);
  float *first = NULL;
  for (int run = 0; run < 2; run++) {
    gpu_memset0(gd, 4 * 3 * count);
    gpu_exact_blocked_forward(gout, glse, gq, gk, gv, BH, n, d, 1, 0);
    gpu_exact_blocked_backward(gd, gd + count, gd + 2 * count, gg, gq, gk, gv, gout, glse, BH, n, d,
                               1, 0);
    float *now = down(gd, 3 * count);
    if (first) assert_memory_equal(first, now, 4 * 3 * count);
    free(first);
    first = now;
  }
  free(first), free(q), free(k), free(v), free(g);
  gpu_free(gq), gpu_free(gk), gpu_free(gv), gpu_free(gg), gpu_free(gout), gpu_free(glse);
  gpu_free(gd);
}

/* ---------------------------------------------------------------------------------------------
 * causality on the device, by the probe of testutil.c */

struct gpu_forward {
  enum gpu_exact_kernels kind;
  long BH, n, d, band;
  float *q, *k, *v, *out, *lse; /* device buffers */
};

static void gpu_forward(void *user, float *out, const float *q, const float *k, const float *v) {
  struct gpu_forward *g = user;
  const size_t bytes = sizeof(float) * (size_t)(g->BH * g->n * g->d);
  gpu_upload(g->q, q, bytes);
  gpu_upload(g->k, k, bytes);
  gpu_upload(g->v, v, bytes);
  if (g->kind == GPU_EXACT_REFERENCE)
    gpu_exact_attention_forward(g->out, g->lse, g->q, g->k, g->v, g->BH, g->n, (int)g->d, 1,
                                g->band);
  else
    gpu_exact_blocked_forward(g->out, g->lse, g->q, g->k, g->v, g->BH, g->n, (int)g->d, 1, g->band);
  gpu_download(out, g->out, bytes);
}

/* Changing the keys and values after position p leaves the outputs of positions ≤ p bit for bit
 * as they were and changes output p + 1: both kernels, full and local, at positions on and off
 * the blocks' boundaries. */
static void test_gpu_full_causality(void **state) {
  const long BH = 2, n = 150, d = 32, bands[] = {0, 12, 70};
  const size_t count = (size_t)(BH * n * d);
  float *q = randn(count, 61), *k = randn(count, 62), *v = randn(count, 63);
  const long at[] = {1, 16, 64, 77, 149};
  const struct tu_probe probe = {at, 5, TU_MOVE_K | TU_MOVE_V, true};
  const struct tu_heads shape = {1, BH, BH, n, d};
  for (int kind = 0; kind < 2; kind++)
    for (int b = 0; b < 3; b++) {
      struct gpu_forward g = {
          kind,       BH,         n,          d,          bands[b],
          dev(count), dev(count), dev(count), dev(count), dev((size_t)(BH * n))};
      char what[96];
      snprintf(what, sizeof what, "GPU exact attention, %s, band %ld", kind_name(kind), bands[b]);
      if (tu_causality_fn(gpu_forward, &g, &shape, q, k, v, &probe, what))
        fail_msg("%s: the causality probe failed (listed above)", what);
      gpu_free(g.q), gpu_free(g.k), gpu_free(g.v), gpu_free(g.out), gpu_free(g.lse);
    }
  free(q), free(k), free(v);
}

/* The options chose the kernels the program started with; the setter changes them. */
static void test_gpu_full_selection(void **state) {
  const char *e = getenv("GPU_TEST_EXACT");
  const bool ref = e && strcmp(e, "reference") == 0;
  assert_int_equal(env_kernels, ref ? GPU_EXACT_REFERENCE : GPU_EXACT_BLOCKED);
  gpu_set_exact_kernels(GPU_EXACT_REFERENCE);
  assert_int_equal(gpu_exact_kernels(), GPU_EXACT_REFERENCE);
  gpu_set_exact_kernels(env_kernels);
}

/* ---------------------------------------------------------------------------------------------
 * S ranks: the GPU op over NCCL against the CPU op over MPI on the same layout */

/* Rows [t0, t0 + T) of every head of a global (BH, n, d) array. */
static float *slab_of(const float *x, long BH, long n, long T, long t0, long d) {
  float *s = malloc(sizeof(float) * (size_t)(BH * T * d));
  for (long h = 0; h < BH; h++)
    memcpy(s + h * T * d, x + (h * n + t0) * d, sizeof(float) * (size_t)(T * d));
  return s;
}

static double world_max(double e) {
  if (!(e <= INFINITY)) e = INFINITY; /* NaN: MPI_MAX need not see it */
  MPI_Allreduce(MPI_IN_PLACE, &e, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return e;
}

/* One case on S = every rank: slabs of T tokens, the CPU op on the MPI communicator and the GPU
 * op on the NCCL one; every rank's errors (the world's largest) and bytes sent compared. */
static void check_seq(struct comm *mpi, struct comm *nccl, struct exact_case c, long T) {
  const long B = 2, H = 2, BH = B * H, S = mpi->S, n = S * T, t0 = mpi->seq_rank * T, d = c.d;
  const size_t gcount = (size_t)(BH * n * d), count = (size_t)(BH * T * d), rows = (size_t)(BH * T);
  struct config cfg;
  case_config(&cfg, c, n, H);
  const struct attn_variant *var = attention_select(&cfg);
  const struct attn_dims dims = {B, H, T, d, n, t0, c.causal};
  struct attn_ctx cpu = attention_open(&cfg, var, DEVICE_CPU, mpi, 0, dims);
  struct attn_ctx gpu = attention_open(&cfg, var, DEVICE_GPU, nccl, 0, dims);
  float *all[7], *x[7], *gx[7]; /* q, k, v, dout, dq, dk, dv */
  for (int i = 0; i < 7; i++) {
    all[i] = randn(gcount, 81 + (uint64_t)i);
    x[i] = slab_of(all[i], BH, n, T, t0, d);
    gx[i] = up(x[i], count);
  }
  float *out = malloc(4 * count), *lse = malloc(4 * rows), *gout = dev(count), *glse = dev(rows);
  const uint64_t c0 = mpi->bytes_sent, n0 = nccl->bytes_sent;
  attention_forward(&cpu, out, lse, x[0], x[1], x[2], NULL);
  attention_forward(&gpu, gout, glse, gx[0], gx[1], gx[2], NULL);
  const uint64_t cf = mpi->bytes_sent - c0, nf = nccl->bytes_sent - n0;
  attention_backward(&cpu, x[4], x[5], x[6], NULL, x[3], x[0], x[1], x[2], NULL, out, lse);
  attention_backward(&gpu, gx[4], gx[5], gx[6], NULL, gx[3], gx[0], gx[1], gx[2], NULL, gout, glse);
  const uint64_t cb = mpi->bytes_sent - c0 - cf, nb = nccl->bytes_sent - n0 - nf;
  struct errs e = {{diff(gout, out, count), diff(glse, lse, rows), diff(gx[4], x[4], count),
                    diff(gx[5], x[5], count), diff(gx[6], x[6], count)}};
  for (int i = 0; i < 5; i++) e.e[i] = world_max(e.e[i]);
  const double bytes_differ = world_max(cf != nf || cb != nb);
  char name[200];
  case_name(name, sizeof name, GPU_EXACT_BLOCKED, c, n);
  snprintf(name + strlen(name), sizeof name - strlen(name), ", %ld ranks of %ld tokens", S, T);
  if (getenv("FMATTN_TEST_VERBOSE"))
    print_message("# %s: out %.2e lse %.2e dq %.2e dk %.2e dv %.2e; bytes %lu/%lu %lu/%lu\n", name,
                  e.e[0], e.e[1], e.e[2], e.e[3], e.e[4], (unsigned long)cf, (unsigned long)nf,
                  (unsigned long)cb, (unsigned long)nb);
  errs_assert(&e, TOL_OUT, TOL_GRAD, name);
  if (bytes_differ > 0)
    fail_msg("%s: bytes sent forward %lu (MPI) and %lu (NCCL), backward %lu and %lu", name,
             (unsigned long)cf, (unsigned long)nf, (unsigned long)cb, (unsigned long)nb);
  if (S > 1 && world_max((double)(cf + cb)) == 0) fail_msg("%s: nothing was exchanged", name);
  attention_close(&gpu);
  attention_close(&cpu);
  for (int i = 0; i < 7; i++) free(all[i]), free(x[i]), gpu_free(gx[i]);
  free(out), free(lse), gpu_free(gout), gpu_free(glse);
  gpu_release_cache();
}

/* full causal over the zigzag ring (T even) and the contiguous one (T odd), bidirectional; local
 * with a band shorter than a slab and one longer (the halo is the whole neighbouring slab), causal
 * and bidirectional; one case again with chunks in every ring step. On one rank, the one slab. */
static void test_gpu_full_seq(void **state) {
  int size;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  struct comm mpi, nccl;
  comm_init(&mpi, size);
  comm_init(&nccl, size);
  gpu_comm_attach(&nccl);
  if (size > 1) assert_string_equal(nccl.transport->name, "nccl");
  check_seq(&mpi, &nccl, (struct exact_case){0, true, 32}, 40);
  check_seq(&mpi, &nccl, (struct exact_case){0, true, 16}, 41);
  check_seq(&mpi, &nccl, (struct exact_case){0, false, 64}, 37);
  check_seq(&mpi, &nccl, (struct exact_case){12, true, 32}, 40);
  check_seq(&mpi, &nccl, (struct exact_case){12, false, 16}, 43);
  check_seq(&mpi, &nccl, (struct exact_case){50, false, 32}, 40);
  check_seq(&mpi, &nccl, (struct exact_case){50, true, 16}, 40);
  gpu_set_exact_workspace(8 << 10);
  check_seq(&mpi, &nccl, (struct exact_case){0, true, 32}, 40);
  check_seq(&mpi, &nccl, (struct exact_case){12, false, 16}, 43);
  gpu_set_exact_workspace(0);
  gpu_comm_detach(&nccl);
  comm_free(&nccl);
  comm_free(&mpi);
}

static const struct CMUnitTest gpu_full_tests[] = {
    cmocka_unit_test(test_gpu_full_reference),     cmocka_unit_test(test_gpu_full_blocked),
    cmocka_unit_test(test_gpu_full_chunks),        cmocka_unit_test(test_gpu_full_bf16),
    cmocka_unit_test(test_gpu_full_deterministic), cmocka_unit_test(test_gpu_full_causality),
    cmocka_unit_test(test_gpu_full_selection),     cmocka_unit_test(test_gpu_full_seq),
};

/* Open the device of this rank with its attention implementations registered: 0, or 1 with the
 * reason in err. */
static int gpu_full_open(char *err, size_t len) {
  const char *e = getenv("GPU_TEST_EXACT");
  const struct gpu_options o = {.exact = e && strcmp(e, "reference") == 0 ? GPU_EXACT_REFERENCE
                                                                          : GPU_EXACT_BLOCKED};
  if (!gpu_backend_open(&o, err, len)) return 1;
  env_kernels = gpu_exact_kernels();
  return 0;
}

/* main: the tests on the device of this rank, or one TAP skip when there is none. The emulation's
 * harness (tests/cudaemu/test_gpu_full_emu.c) brings its own, which also checks for leaks. */
TU_GPU_MAIN("test_gpu_full", gpu_full_tests, gpu_full_open, gpu_close)
