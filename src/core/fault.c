/* Fault injection for the test suite (fault.h): parses FMATTN_FAULT. Only the test suite sets it,
 * so nothing here may change a run in which it is unset. */
#include "core/fault.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"

static const char *fault_text(void) {
  const char *f = getenv("FMATTN_FAULT");
  return f && f[0] ? f : NULL;
}

/* FMATTN_FAULT as <what>_<target>@<step>: the target and step, and the value to inject. */
static bool fault_parse(const char *f, enum fault_target *target, long *step, float *value) {
  char what[8], where[8];
  char tail;
  if (sscanf(f, "%3[a-z]_%4[a-z]@%ld%c", what, where, step, &tail) != 3 || *step < 1) return false;
  if (strcmp(what, "nan") == 0)
    *value = NAN;
  else if (strcmp(what, "inf") == 0)
    *value = INFINITY;
  else
    return false;
  if (strcmp(where, "grad") == 0)
    *target = FAULT_GRAD;
  else if (strcmp(where, "loss") == 0)
    *target = FAULT_LOSS;
  else
    return false;
  return true;
}

void fault_check(void) {
  const char *f = fault_text();
  enum fault_target t;
  long k;
  float v;
  if (f && !fault_no_space_check() && !fault_uninit_nan() && strncmp(f, "blas_core=", 10) != 0 &&
      fault_outside_alloc_mib() == 0 && !fault_parse(f, &t, &k, &v))
    error_collective(
        "FMATTN_FAULT must be nan_grad@K, inf_grad@K, nan_loss@K, inf_loss@K (K >= 1), "
        "no_space_check, uninit_nan, blas_core=NAME or outside_alloc=MIB (MIB >= 1) (a testing "
        "hook)");
}

long fault_outside_alloc_mib(void) {
  const char *f = fault_text();
  long mib;
  char tail;
  if (!f || sscanf(f, "outside_alloc=%ld%c", &mib, &tail) != 1 || mib < 1) return 0;
  return mib;
}

bool fault_poison(enum fault_target target, long step, float *value) {
  const char *f = fault_text();
  enum fault_target t;
  long k;
  return f && fault_parse(f, &t, &k, value) && t == target && k == step;
}

bool fault_no_space_check(void) {
  const char *f = fault_text();
  return f && strcmp(f, "no_space_check") == 0;
}

bool fault_uninit_nan(void) {
  const char *f = fault_text();
  return f && strcmp(f, "uninit_nan") == 0;
}
