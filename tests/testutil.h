/* Helpers shared by the unit tests (test code only, never linked into the program): random
 * tensors, float/double conversions, relative errors; and, in testutil.c, a configuration through
 * the deck loader, one attention op run, the float64 dense softmax-attention reference, and the
 * causality probe. Each is written once here; a test keeps only its own cases. */
#ifndef FMATTN_TESTUTIL_H
#define FMATTN_TESTUTIL_H

#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <mpi.h>

#include "../src/attention/attention.h"
#include "../src/core/rng.h"
#include "../src/deck/config.h"

/* x[i] = scale · N(0, 1), keyed by `key`. */
static inline void tu_randn(float *x, size_t n, uint64_t key, float scale) {
  for (size_t i = 0; i < n; i++) x[i] = scale * (float)rng_normal(99, RNG_TEST, key, i, 0);
}

static inline void tu_randn_d(double *x, size_t n, uint64_t key, double scale) {
  for (size_t i = 0; i < n; i++) x[i] = scale * rng_normal(99, RNG_TEST, key, i, 0);
}

static inline double *tu_to_double(const float *x, size_t n) {
  double *y = malloc(sizeof(double) * (n ? n : 1));
  for (size_t i = 0; i < n; i++) y[i] = x[i];
  return y;
}

static inline float *tu_to_float(const double *x, size_t n) {
  float *y = malloc(sizeof(float) * (n ? n : 1));
  for (size_t i = 0; i < n; i++) y[i] = (float)x[i];
  return y;
}

/* max_i |a_i − b_i| / (max_i |b_i| + tiny): a relative error that is not fooled by entries
 * near zero. */
static inline double tu_rel_err(const float *a, const double *b, size_t n) {
  double num = 0.0, den = 1e-30;
  for (size_t i = 0; i < n; i++) {
    double d = fabs((double)a[i] - b[i]);
    if (!(d <= num)) num = d; /* NaN propagates */
    if (fabs(b[i]) > den) den = fabs(b[i]);
  }
  return num / den;
}

static inline double tu_rel_err_dd(const double *a, const double *b, size_t n) {
  double num = 0.0, den = 1e-30;
  for (size_t i = 0; i < n; i++) {
    double d = fabs(a[i] - b[i]);
    if (!(d <= num)) num = d;
    if (fabs(b[i]) > den) den = fabs(b[i]);
  }
  return num / den;
}

/* Fail with the measured error when it exceeds tol. */
#define TU_ASSERT_CLOSE(err, tol, what)                                               \
  do {                                                                                \
    double tu_e_ = (err);                                                             \
    if (!(tu_e_ <= (tol)))                                                            \
      fail_msg("%s: relative error %.3e exceeds %.1e", (what), tu_e_, (double)(tol)); \
  } while (0)

/* Central finite difference of a scalar function of x[i] (double), step h. */
#define TU_FD(result, x, i, h, expr)        \
  do {                                      \
    double tu_s_ = (x)[i];                  \
    (x)[i] = tu_s_ + (h);                   \
    double tu_p_ = (expr);                  \
    (x)[i] = tu_s_ - (h);                   \
    double tu_m_ = (expr);                  \
    (x)[i] = tu_s_;                         \
    (result) = (tu_p_ - tu_m_) / (2 * (h)); \
  } while (0)

/* ---------------------------------------------------------------------------------------------
 * Configurations (testutil.c): through config_load with --set overrides, as `fmattn kernel` makes
 * one (src/run/kernel_file.c) */

/* A NULL-terminated list of overrides in place: TU_SETS("attention.local.band=9", ...). */
#define TU_SETS(...) ((const char *const[]){__VA_ARGS__, NULL})

/* printf into one of TU_FMT_POOL rotating buffers, for building one override list in place
 * (TU_SETS(tu_fmt("attention.fma.m=%d", m), ...)); a string stays valid for the next
 * TU_FMT_POOL − 1 calls. Aborts when the text does not fit. */
#define TU_FMT_POOL 64
const char *tu_fmt(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* Load the built-in defaults with the common fields of an attention test — attention.variant,
 * model.context = n, model.heads = H, model.dim = H·d (both left at their defaults when H <= 0),
 * model.objective clm (causal) or mlm, data.source = copy — then the overrides sets (NULL or
 * NULL-terminated, applied after the common fields, so they may change them). Returns
 * config_load's status, its message in err. */
int tu_config_try(struct config *cfg, const char *variant, long n, int H, int d, bool causal,
                  const char *const sets[], char *err, size_t err_len);
/* tu_config_try, failing the test with the loader's message when the deck is refused. */
void tu_config(struct config *cfg, const char *variant, long n, int H, int d, bool causal,
               const char *const sets[]);

/* ---------------------------------------------------------------------------------------------
 * One attention op outside a model (testutil.c) */

/* The CPU context of cfg's variant (attention_select: its FiSH form under heads_mode = fish) on
 * one rank, B sequences of model.context tokens, H = model.heads, d = dim/heads, causal when
 * the objective is clm; fails the test when the variant is unknown. Close with attention_close. */
struct attn_ctx tu_attn_open(const struct config *cfg, long B);

struct tu_run {
  float *out, *dq, *dk, *dv; /* out, dv (B, H, T, d); dq, dk (B, Hqk, T, d) */
};
/* Forward, and with dout backward, through an opened context: dq, dk, dv start from zero,
 * dparams (NULL when there are none) accumulates as backward's contract says. */
struct tu_run tu_attn_run(struct attn_ctx *ctx, const float *params, float *dparams, const float *q,
                          const float *k, const float *v, const float *dout);
void tu_run_free(struct tu_run *r);

/* ---------------------------------------------------------------------------------------------
 * The float64 dense reference of softmax attention, one head (testutil.c) */

/* Whether query i may see key j; user is the caller's. */
typedef bool (*tu_allowed_fn)(long i, long j, const void *user);
/* The common masks: j ≤ i when causal; |i − j| < band when band > 0. */
struct tu_mask {
  bool causal;
  long band;
};
bool tu_mask_allowed(long i, long j, const void *mask); /* mask: a const struct tu_mask * */

/* P (rows, cols) = the softmax of each row of L (rows, cols) over its finite entries (−INFINITY:
 * masked, probability 0); every row needs one finite entry. P may be L. */
void tu_softmax_rows(double *P, const double *L, long rows, long cols);
/* Attention from given logits: out (n, d) = softmax_rows(L) v, L (n, nk), v (nk, d). With dout
 * (n, d) also the gradients of Σ dout·out: dL (n, nk; may be NULL) and dv (nk, d), overwritten. */
void tu_dense_softmax(double *out, double *dL, double *dv, const double *L, const double *v,
                      const double *dout, long n, long nk, long d);
/* Softmax attention with logits q_i·k_j/√d where allowed(i, j, user), the rest masked: out
 * (n, d), and with dout also dq, dk, dv (n, d), overwritten. */
void tu_dense_attention(double *out, double *dq, double *dk, double *dv, const double *q,
                        const double *k, const double *v, const double *dout, long n, long d,
                        tu_allowed_fn allowed, const void *user);

/* ---------------------------------------------------------------------------------------------
 * Causality by perturbation (testutil.c) */

/* What a probe moves: q += 3, k −= 2, v += 5 at the probed positions, in every batch element and
 * head. */
enum { TU_MOVE_Q = 1, TU_MOVE_K = 2, TU_MOVE_V = 4, TU_MOVE_QKV = 7 };
struct tu_probe {
  const long *at; /* positions j, one probe each */
  int count;
  unsigned moves; /* TU_MOVE_* */
  bool to_end;    /* move positions j .. n − 1, not j alone */
};
/* Sizes of the tensors a forward takes: q, k (B, Hqk, n, d), v and out (B, H, n, d). */
struct tu_heads {
  long B, Hqk, H, n, d;
};
/* out from q, k, v (host arrays) by the op under test. */
typedef void (*tu_forward_fn)(void *user, float *out, const float *q, const float *k,
                              const float *v);

/* For each probe j: the outputs of positions i < j must stay bit for bit as they were, and the
 * output row j of every batch element and head must change — so the probe could see a leak.
 * Prints a "# " line for each failure and returns their number. */
int tu_causality_fn(tu_forward_fn forward, void *user, const struct tu_heads *shape, const float *q,
                    const float *k, const float *v, const struct tu_probe *probe, const char *what);
/* The same through an opened causal context on one rank (params: its parameters, or NULL). */
int tu_causality(struct attn_ctx *ctx, const float *params, const float *q, const float *k,
                 const float *v, const struct tu_probe *probe, const char *what);

/* main() for a cmocka test program that links MPI. */
#define TU_MAIN(tests)                                      \
  int main(int argc, char **argv) {                         \
    MPI_Init(&argc, &argv);                                 \
    cmocka_set_message_output(CM_OUTPUT_TAP);               \
    int tu_rc_ = cmocka_run_group_tests(tests, NULL, NULL); \
    MPI_Finalize();                                         \
    return tu_rc_;                                          \
  }

/* GPU test programs (tests/test_gpu*.c, and their twins under the CUDA emulation in
 * tests/cudaemu/, which define TU_GPU_EMULATED and include them). tu_gpu_begin: MPI up, rank 0's
 * TAP stream, the device opened by open (0, or the reason in err); true to go on, else *rc is the
 * exit status: 0 with TAP's skip-all plan natively (no GPU here), 1 under the emulation (there is
 * always a device: a skip would hide a failure). The test filter applies: CUDAEMU_TEST_FILTER
 * emulated (the mutation check's), FMATTN_TEST_FILTER natively (a sanitizer run of a few tests).
 * tu_gpu_end: the device closed, device memory still allocated (leaked; NULL natively) a failure,
 * MPI down; returns the exit status. */
typedef int (*tu_gpu_open_fn)(char *err, size_t len);
bool tu_gpu_begin(int *argc, char ***argv, const char *name, tu_gpu_open_fn open, bool emulated,
                  int *rc);
int tu_gpu_end(int rc, void (*close)(void), size_t (*leaked)(void));

#ifdef TU_GPU_EMULATED
size_t cudaemu_bytes_in_use(void);
#define TU_GPU_EMU    true
#define TU_GPU_LEAKED cudaemu_bytes_in_use
#else
#define TU_GPU_EMU    false
#define TU_GPU_LEAKED NULL
#endif

/* main() for a GPU test program: one group of tests on the device open opens and close closes. */
#define TU_GPU_MAIN(name, tests, open, close)                                        \
  int main(int argc, char **argv) {                                                  \
    int tu_rc_ = 0;                                                                  \
    if (!tu_gpu_begin(&argc, &argv, name, open, TU_GPU_EMU, &tu_rc_)) return tu_rc_; \
    tu_rc_ = cmocka_run_group_tests(tests, NULL, NULL);                              \
    return tu_gpu_end(tu_rc_, close, TU_GPU_LEAKED);                                 \
  }

#endif
