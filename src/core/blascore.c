/* The BLAS core check (blascore.h). */
#include "core/blascore.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "core/threads.h"

/* OpenBLAS's x86-64 core names (driver/others/dynamic.c) whose kernels use neither AVX2 nor
 * AVX-512: what its dynamic dispatch falls back to on a CPU it does not know. */
static const char *const generic_cores[] = {
    "Katmai",      "Coppermine", "Northwood",    "Prescott",   "Banias",
    "Atom",        "Core2",      "Penryn",       "Dunnington", "Nehalem",
    "Athlon",      "Opteron",    "Opteron_SSE3", "Barcelona",  "Nano",
    "Sandybridge", "Bobcat",     "Bulldozer",    "Piledriver", NULL};

static bool listed(const char *core, const char *const *list) {
  for (int i = 0; list[i]; i++)
    if (strcasecmp(core, list[i]) == 0) return true;
  return false;
}

enum blas_verdict blas_core_verdict(const char *core, struct cpu_features cpu, const char *user,
                                    const char **better) {
  *better = NULL;
  if (!core || strcasecmp(core, "unknown") == 0) return BLAS_KEEP; /* not OpenBLAS */
  if (!listed(core, generic_cores)) return BLAS_KEEP; /* a core of AVX2 or AVX-512 kernels */
  if (cpu.avx512)
    *better = "SkylakeX";
  else if (cpu.avx2)
    *better = cpu.amd ? "Zen" : "Haswell";
  else
    return BLAS_KEEP; /* the generic kernels are this CPU's */
  return user && user[0] ? BLAS_WARN : BLAS_CORRECT;
}

static char note_[256];
static char from_[64];

const char *blas_core_note(void) { return note_; }
const char *blas_core_corrected_from(void) { return from_[0] ? from_ : NULL; }

static struct cpu_features cpu_features_here(void) {
  struct cpu_features f = {false, false, false};
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  f.avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512cd") &&
             __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
             __builtin_cpu_supports("avx512vl");
  f.avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  f.amd = __builtin_cpu_is("amd");
#endif
  return f;
}

/* The core OpenBLAS chose; FMATTN_FAULT = blas_core=NAME pretends it chose NAME (the test suite's
 * way to meet a fallback on a CPU the library knows; fault.h). */
static const char *core_here(void) {
  const char *f = getenv("FMATTN_FAULT");
  if (f && strncmp(f, "blas_core=", 10) == 0) return f + 10;
  return threads_blas_core();
}

void blas_core_check(char **argv) {
  const char *core = core_here();
  const char *user = getenv("OPENBLAS_CORETYPE");
  const char *was = getenv("FMATTN_BLAS_CORRECTED"); /* set by the re-execution below */
  if (was && was[0]) {
    snprintf(from_, sizeof from_, "%s", was);
    snprintf(note_, sizeof note_,
             "BLAS: OpenBLAS chose its generic %s kernels on this CPU; fmattn runs with "
             "OPENBLAS_CORETYPE=%s instead (set OPENBLAS_CORETYPE yourself to choose)",
             was, user ? user : "?");
    unsetenv("FMATTN_BLAS_CORRECTED");
    return;
  }
  const char *better;
  enum blas_verdict v = blas_core_verdict(core, cpu_features_here(), user, &better);
  if (v == BLAS_WARN) {
    snprintf(note_, sizeof note_,
             "BLAS: OPENBLAS_CORETYPE=%s selects generic kernels on a CPU that runs %s's: unset "
             "it, or set OPENBLAS_CORETYPE=%s",
             user, better, better);
    return;
  }
  if (v != BLAS_CORRECT) return;
#ifndef FMATTN_SMPI /* under SMPI the ranks share one simulating process: nothing to re-execute */
  char name[64];
  snprintf(name, sizeof name, "%s", core);
  if (setenv("OPENBLAS_CORETYPE", better, 1) == 0 &&
      setenv("FMATTN_BLAS_CORRECTED", name, 1) == 0) {
    const char *f = getenv("FMATTN_FAULT");
    if (f && strncmp(f, "blas_core=", 10) == 0) unsetenv("FMATTN_FAULT");
    /* the binary by its own path, so that the process keeps its name (ps, pgrep, top, a job
     * monitor: /proc/self/exe would rename it "exe"); the link itself where it cannot be read
     * (a binary replaced on disk since it started reads "… (deleted)" and fails) */
    char self[PATH_MAX];
    const ssize_t len = readlink("/proc/self/exe", self, sizeof self - 1);
    if (len > 0) {
      self[len] = '\0';
      execv(self, argv);
    }
    execv("/proc/self/exe", argv);
    unsetenv("OPENBLAS_CORETYPE"); /* execv failed: carry on, and say what to set */
    unsetenv("FMATTN_BLAS_CORRECTED");
  }
#endif
  snprintf(note_, sizeof note_,
           "BLAS: OpenBLAS chose its generic %s kernels on a CPU that runs %s's, and fmattn could "
           "not run itself again: set OPENBLAS_CORETYPE=%s",
           core, better, better);
}
