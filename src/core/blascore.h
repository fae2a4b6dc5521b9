/* The BLAS core check (docs/perf.md): OpenBLAS picks its kernels by CPU model, and on a CPU newer
 * than the library it falls back to generic ones (Prescott's SSE3 kernels on a recent AVX-512
 * Xeon: SGEMM at a fifth of its speed). Before MPI starts, fmattn compares the core OpenBLAS chose
 * with what the CPU supports, and where the choice is a generic fallback it runs itself again with
 * OPENBLAS_CORETYPE set to a core of the CPU's class. A value the user set is kept, with a warning
 * and the exact fix when it is such a fallback. */
#ifndef FMATTN_BLASCORE_H
#define FMATTN_BLASCORE_H

#include <stdbool.h>

#ifdef __cplusplus
extern "C" {
#endif

/* What the CPU's vector units can run (cpuid, through the compiler's builtins). */
struct cpu_features {
  bool avx512; /* AVX-512 F, CD, BW, DQ and VL: OpenBLAS's SkylakeX kernels */
  bool avx2;   /* AVX2 and FMA: its Haswell and Zen kernels */
  bool amd;
};

enum blas_verdict {
  BLAS_KEEP,    /* the core suits the CPU, or the library is not one the check knows */
  BLAS_CORRECT, /* a generic fallback: run again with OPENBLAS_CORETYPE = *better */
  BLAS_WARN     /* a generic fallback the check may not correct (the user's setting): *better */
};

/* The decision alone (unit-tested): core as openblas_get_corename reports it (NULL or "unknown":
 * not OpenBLAS), the CPU's features, the user's OPENBLAS_CORETYPE (NULL: unset). *better is set
 * to the core to use for BLAS_CORRECT and BLAS_WARN. */
enum blas_verdict blas_core_verdict(const char *core, struct cpu_features cpu, const char *user,
                                    const char **better);

/* Before MPI_Init: check, and correct by re-executing the binary (its path read from
 * /proc/self/exe, so that the process keeps its name) with argv (the process keeps
 * its pid, so mpirun and srun still see their rank). Nothing is printed here: rank 0 prints
 * blas_core_note() once MPI is up. */
void blas_core_check(char **argv);
/* "" when nothing was done; else the sentence saying what was corrected or what to set. */
const char *blas_core_note(void);
/* The core OpenBLAS had chosen before the correction, or NULL when none was made. */
const char *blas_core_corrected_from(void);

#ifdef __cplusplus
}
#endif

#endif
