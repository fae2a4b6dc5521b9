/* The BLAS core check's decision (src/core/blascore.h, docs/perf.md): for every generic core name
 * OpenBLAS reports, on CPUs with AVX-512, with AVX2 (Intel and AMD) and with neither, with and
 * without the user's OPENBLAS_CORETYPE: keep, correct (to which core) or warn. And the other
 * choice made for the CPU at start-up, the default thread count (src/core/threads.h). */
#include "testutil.h"

#include <string.h>

#include "../src/core/blascore.h"
#include "../src/core/threads.h"

static const char *const generic[] = {
    "Katmai", "Coppermine",  "Northwood", "Prescott",  "Banias",    "Atom",         "Core2",
    "Penryn", "Dunnington",  "Nehalem",   "Athlon",    "Opteron",   "Opteron_SSE3", "Barcelona",
    "Nano",   "Sandybridge", "Bobcat",    "Bulldozer", "Piledriver"};
static const char *const good[] = {"Haswell",        "Zen",         "SkylakeX", "Cooperlake",
                                   "SapphireRapids", "Steamroller", "Excavator"};

static const struct cpu_features avx512 = {true, true, false}, avx2_intel = {false, true, false},
                                 avx2_amd = {false, true, true}, sse = {false, false, false},
                                 avx512_amd = {true, true, true};

static void expect(const char *core, struct cpu_features cpu, const char *user,
                   enum blas_verdict want, const char *want_core) {
  const char *better = "untouched";
  enum blas_verdict got = blas_core_verdict(core, cpu, user, &better);
  if (got != want || (want_core ? !better || strcmp(better, want_core) : better != NULL))
    fail_msg("core %s, avx512 %d avx2 %d amd %d, user %s: verdict %d (%s), expected %d (%s)",
             core ? core : "(null)", cpu.avx512, cpu.avx2, cpu.amd, user ? user : "(unset)", got,
             better ? better : "none", want, want_core ? want_core : "none");
}

static void test_generic_cores(void **state) {
  (void)state;
  for (size_t i = 0; i < sizeof generic / sizeof *generic; i++) {
    const char *c = generic[i];
    expect(c, avx512, NULL, BLAS_CORRECT, "SkylakeX");
    expect(c, avx512_amd, NULL, BLAS_CORRECT, "SkylakeX");
    expect(c, avx2_intel, NULL, BLAS_CORRECT, "Haswell");
    expect(c, avx2_amd, NULL, BLAS_CORRECT, "Zen");
    expect(c, sse, NULL, BLAS_KEEP, NULL); /* the generic kernels are that CPU's */
    /* the user's setting is kept: a warning with the fix */
    expect(c, avx512, c, BLAS_WARN, "SkylakeX");
    expect(c, avx2_amd, "Prescott", BLAS_WARN, "Zen");
    expect(c, sse, "Prescott", BLAS_KEEP, NULL);
  }
  /* the names in any case, as users type them in OPENBLAS_CORETYPE */
  expect("PRESCOTT", avx2_intel, NULL, BLAS_CORRECT, "Haswell");
}

static void test_good_cores(void **state) {
  (void)state;
  for (size_t i = 0; i < sizeof good / sizeof *good; i++) {
    expect(good[i], avx512, NULL, BLAS_KEEP, NULL);
    expect(good[i], avx2_amd, NULL, BLAS_KEEP, NULL);
    expect(good[i], avx512, good[i], BLAS_KEEP, NULL);
  }
}

static void test_not_openblas(void **state) {
  (void)state;
  expect(NULL, avx512, NULL, BLAS_KEEP, NULL);
  expect("unknown", avx2_intel, NULL, BLAS_KEEP, NULL);
}

/* threads_default(bound, node_cores, local_ranks) for the layouts mpirun and srun make */
static void test_thread_default(void **state) {
  (void)state;
  assert_int_equal(threads_default(32, 32, 1), 32); /* one rank, not bound */
  assert_int_equal(threads_default(32, 32, 8), 4);  /* 8 ranks, not bound */
  assert_int_equal(threads_default(16, 32, 8), 4);  /* 8 ranks bound to a socket each */
  assert_int_equal(threads_default(4, 32, 8), 4);   /* --map-by slot:PE=4 --bind-to core */
  assert_int_equal(threads_default(1, 2, 2), 1);    /* mpirun -n 2: a core each */
  assert_int_equal(threads_default(1, 1, 1), 1);    /* mpirun -n 1: bound to one core */
  assert_int_equal(threads_default(8, 8, 2), 4);    /* a job's 8 cores (cgroup), 2 ranks */
  assert_int_equal(threads_default(2, 2, 4), 1);    /* more ranks than cores: 1, not 0 */
  assert_int_equal(threads_default(3, 0, 0), 1);    /* nothing known: 1 */
}

static const struct CMUnitTest tests[] = {
    cmocka_unit_test(test_thread_default),
    cmocka_unit_test(test_generic_cores),
    cmocka_unit_test(test_good_cores),
    cmocka_unit_test(test_not_openblas),
};

TU_MAIN(tests)
