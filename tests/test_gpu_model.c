/* The whole model on the GPU back end against the CPU: loss and every parameter gradient within
 * 1e-4 relative for every variant with a GPU implementation, causal and bidirectional; bf16
 * within a stated tolerance; causal logits on the device; D = 2 and S = 2 over NCCL on 2 ranks.
 * Runs where a GPU back end is linked (natively, or in tests/cudaemu). */
#include "testutil.h"

#include "../gpu/gpu.h"
#include "../src/attention/attention.h"
#include "../src/model/backend.h"
#include "../src/model/model.h"
#include "../src/parallel/comm.h"

/* fp32 on both sides, the same operations in other orders (cuBLAS, two-stage sums) */
#define TOL 1e-4
/* bf16 operands (8 bits of mantissa) in every product of this small model: measured 4e-6 on
 * the loss and 8e-3 on the worst gradient tensor (fp32: 5e-9 and 7e-7); the bounds leave room */
#define TOL_BF16_LOSS 1e-3
#define TOL_BF16_GRAD 5e-2

static const struct backend *gpu;

/* A small model of every kind of layer: 2 blocks, learned positions, dropout on. */
static void model_config(struct config *cfg, const char *variant, bool causal, const char *extra) {
  tu_config(cfg, variant, 64, 2, 16, causal,
            TU_SETS("model.layers=2", "model.dropout=0.1", "model.mlp_ratio=2", "attention.fma.m=8",
                    "attention.fma.p=2", "attention.local.band=24", "train.batch=2",
                    extra ? extra : "run.seed=11"));
}

/* The batch: tokens and next-byte targets (or mlm's masks) from the seed, the same on both. */
static void fill_batch(struct model *m, uint64_t key) {
  const long N = m->B * m->T;
  for (long i = 0; i < N; i++) {
    m->tokens[i] = (int)rng_below(256, 5, RNG_TEST, key, (uint64_t)(m->t0 + i), 0);
    m->targets[i] = m->causal || i % 7 == 3
                        ? (int)rng_below(256, 5, RNG_TEST, key + 1, (uint64_t)(m->t0 + i), 0)
                        : -1;
  }
}

/* One step's loss (summed over counted rows) and gradients of a model. */
static double step(struct model *m, long *count) {
  model_zero_grads(m);
  const double loss = model_forward(m, 3, true, 1.0f / 64.0f, count);
  model_backward(m, 3);
  return loss;
}

/* The GPU model's gradients against the CPU's, tensor by tensor: the worst relative error. */
static double grad_error(const struct model *cpu, const struct model *dev, const char **worst) {
  float *g = malloc(sizeof(float) * dev->plist.total);
  dev->be->download(g, dev->grads, sizeof(float) * dev->plist.total);
  double err = 0.0;
  for (int i = 0; i < cpu->plist.count; i++) {
    const struct param_desc *p = &cpu->plist.p[i];
    if (p->frozen) continue;
    double *ref = tu_to_double(cpu->grads + p->offset, p->numel);
    const double e = tu_rel_err(g + p->offset, ref, p->numel);
    free(ref);
    if (!(e <= err)) err = e, *worst = p->name;
  }
  free(g);
  return err;
}

/* Build the pair, give the GPU model the CPU model's parameters, and compare one step. */
static void compare(const char *variant, bool causal, bool bf16, const char *extra) {
  struct config cfg;
  model_config(&cfg, variant, causal, extra);
  struct model c, g;
  model_build_on(&c, &cfg, NULL, 2, backend_cpu());
  model_build_on(&g, &cfg, NULL, 2, gpu);
  model_init_params(&c);
  memcpy(g.host_params, c.host_params, sizeof(float) * c.plist.total);
  model_sync_to_device(&g);
  fill_batch(&c, 21);
  fill_batch(&g, 21);
  gpu_set_bf16(bf16);
  long nc, ng;
  const double lc = step(&c, &nc), lg = step(&g, &ng);
  gpu_set_bf16(false);
  const char *worst = "";
  const double ge = grad_error(&c, &g, &worst);
  char what[256];
  snprintf(what, sizeof what, "%s %s%s%s%s%s: loss", variant, causal ? "clm" : "mlm",
           bf16 ? " bf16" : "", extra ? " (" : "", extra ? extra : "", extra ? ")" : "");
  print_message("%s %.2e (%.6f), gradients %.2e relative\n", what, fabs(lg - lc) / fabs(lc), lc,
                ge);
  assert_true(nc == ng);
  TU_ASSERT_CLOSE(fabs(lg - lc) / fabs(lc), bf16 ? TOL_BF16_LOSS : TOL, what);
  snprintf(what + strlen(what) - 4, sizeof what - strlen(what) + 4, "gradients (worst: %s)", worst);
  TU_ASSERT_CLOSE(ge, bf16 ? TOL_BF16_GRAD : TOL, what);
  model_free(&c);
  model_free(&g);
  config_free(&cfg);
}

static void test_model_full(void **state) {
  compare("full", true, false, NULL);
  compare("full", false, false, NULL);
  compare("full", true, false, "model.position=rope");
}

static void test_model_local(void **state) {
  compare("local", true, false, NULL);
  compare("local", false, false, "model.position=sinusoidal");
}

/* fma with each downsampling, and fma_linear, causal and bidirectional */
static void test_model_fma(void **state) {
  const char *down[] = {"attention.fma.downsample=conv", "attention.fma.downsample=avg",
                        "attention.fma.downsample=m2m"};
  for (int i = 0; i < 3; i++) {
    compare("fma", true, false, down[i]);
    compare("fma", false, false, down[i]);
  }
  compare("fma_linear", true, false, NULL);
  compare("fma_linear", false, false, "attention.fma.downsample=m2m");
}

static void test_model_bf16(void **state) {
  compare("full", true, true, NULL);
  compare("fma", true, true, NULL);
}

/* Causal on the device: the logits of positions ≤ p do not move, bit for bit, when the tokens
 * after p change; those of p + 1 do (so the probe can fail). */
static void test_model_causal(void **state) {
  struct config cfg;
  model_config(&cfg, "full", true, NULL);
  struct model g;
  model_build_on(&g, &cfg, NULL, 1, gpu);
  model_init_params(&g);
  fill_batch(&g, 31);
  const long T = g.T, V = g.V, p = 40;
  float *a = malloc(sizeof(float) * T * V), *b = malloc(sizeof(float) * T * V);
  model_forward_logits(&g);
  gpu_download(a, g.logits, sizeof(float) * T * V);
  for (long t = p + 1; t < T; t++) g.tokens[t] = (g.tokens[t] + 1) % 256;
  model_forward_logits(&g);
  gpu_download(b, g.logits, sizeof(float) * T * V);
  assert_memory_equal(a, b, sizeof(float) * (p + 1) * V);
  assert_memory_not_equal(a + (p + 1) * V, b + (p + 1) * V, sizeof(float) * V);
  free(a), free(b);
  model_free(&g);
  config_free(&cfg);
}

/* Under MPI: the CPU model over MPI and the GPU model over NCCL on the same layout (S sequence
 * ranks, D replicas of the batch), after the gradient allreduce. */
static void compare_parallel(const char *variant, bool causal, int S) {
  int world;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  struct config cfg;
  model_config(&cfg, variant, causal, tu_fmt("parallel.seq_ranks=%d", S));
  struct comm cm, gm;
  comm_init(&cm, S);
  comm_init(&gm, S);
  gpu_comm_attach(&gm);
  const long B = 2 / (world / S);
  struct model c, g;
  model_build_on(&c, &cfg, &cm, B, backend_cpu());
  model_build_on(&g, &cfg, &gm, B, gpu);
  model_init_params(&c);
  memcpy(g.host_params, c.host_params, sizeof(float) * c.plist.total);
  model_sync_to_device(&g);
  fill_batch(&c, 41 + (uint64_t)cm.replica);
  fill_batch(&g, 41 + (uint64_t)gm.replica);
  long nc, ng;
  double l[2] = {step(&c, &nc), step(&g, &ng)};
  model_allreduce_grads(&c);
  model_allreduce_grads(&g);
  comm_allreduce_sum_double(&cm, COMM_WORLD, l, 2);
  const char *worst = "";
  const double ge = grad_error(&c, &g, &worst);
  char what[160];
  snprintf(what, sizeof what, "%s %s, S = %d of %d ranks: loss", variant, causal ? "clm" : "mlm", S,
           world);
  TU_ASSERT_CLOSE(fabs(l[1] - l[0]) / fabs(l[0]), TOL, what);
  snprintf(what + strlen(what) - 4, sizeof what - strlen(what) + 4, "gradients (worst: %s)", worst);
  TU_ASSERT_CLOSE(ge, TOL, what);
  model_free(&c);
  model_free(&g);
  gpu_comm_detach(&gm);
  comm_free(&gm);
  comm_free(&cm);
  config_free(&cfg);
}

/* D = 2: each rank its own samples, the gradient allreduce over NCCL. */
static void test_model_data_parallel(void **state) {
  compare_parallel("full", true, 1);
  compare_parallel("fma", true, 1);
}

/* S = 2: one sequence on two ranks, the attention's exchanges over NCCL. */
static void test_model_seq_parallel(void **state) {
  compare_parallel("full", true, 2); /* the ring, zigzag */
  compare_parallel("full", false, 2);
  compare_parallel("local", true, 2); /* the band's halo */
  compare_parallel("local", false, 2);
  compare_parallel("fma", true, 2);
  compare_parallel("fma", false, 2);
  compare_parallel("fma_linear", true, 2);
}

/* The GPU back end, kept for the tests. */
static int open_backend(char *err, size_t len) {
  gpu = gpu_backend_open(NULL, err, len);
  return gpu ? 0 : 1;
}

int main(int argc, char **argv) {
  int rc = 0;
  if (!tu_gpu_begin(&argc, &argv, "test_gpu_model", open_backend, TU_GPU_EMU, &rc)) return rc;
  int world = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  /* one rank: the single-device comparisons; several: the distributed ones */
  const struct CMUnitTest one[] = {
      cmocka_unit_test(test_model_full),   cmocka_unit_test(test_model_local),
      cmocka_unit_test(test_model_fma),    cmocka_unit_test(test_model_bf16),
      cmocka_unit_test(test_model_causal),
  };
  const struct CMUnitTest many[] = {
      cmocka_unit_test(test_model_data_parallel),
      cmocka_unit_test(test_model_seq_parallel),
  };
  rc = world == 1 ? cmocka_run_group_tests(one, NULL, NULL)
                  : cmocka_run_group_tests(many, NULL, NULL);
  return tu_gpu_end(rc, gpu_close, TU_GPU_LEAKED);
}
