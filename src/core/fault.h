/* Fault injection for the test suite (tests/test_faults.sh, docs/operations.md): the environment
 * variable FMATTN_FAULT makes a run meet one failure the way a real one arrives. Users never set
 * it; unset, nothing here changes what a run does. */
#ifndef FMATTN_FAULT_H
#define FMATTN_FAULT_H

#include <stdbool.h>

#ifdef __cplusplus
extern "C" {
#endif

enum fault_target { FAULT_GRAD, FAULT_LOSS };

/* Refuse (collectively) an FMATTN_FAULT that names no known fault. */
void fault_check(void);

/* True when FMATTN_FAULT asks for a non-finite value in `target` at step `step` (1-based):
 * nan_grad@K, inf_grad@K (one reduced gradient entry, as an overflow in backward), nan_loss@K,
 * inf_loss@K (the reduced training loss); *value is then NaN or +Inf. */
bool fault_poison(enum fault_target target, long step, float *value);

/* True when FMATTN_FAULT = no_space_check: checkpoints skip the free-space check, so that a full
 * file system is met by the write itself (as when another job fills the disk after the check). */
bool fault_no_space_check(void);

/* FMATTN_FAULT = outside_alloc=MIB: each time the CUDA back end's pool grows (so at its peak on
 * the device too), the back end asks the driver for MIB MiB outside the pool, as NCCL or another
 * library would, and gives them back; a refusal ends the run with one message, and each rank says
 * at exit how many such allocations succeeded and at what pool size. Returns MIB, or 0
 * when FMATTN_FAULT asks for something else. */
long fault_outside_alloc_mib(void);

/* True when FMATTN_FAULT = uninit_nan: mem_alloc_uninit fills each block with NaN (all bits
 * set), so that a workspace read before it is written shows as NaN in what is computed from it
 * (tests/test_attention.c runs the exact attention so). */
bool fault_uninit_nan(void);

/* FMATTN_FAULT = blas_core=NAME: the BLAS core check (blascore.h) takes NAME for the core
 * OpenBLAS chose, so that the test suite meets a generic fallback on a CPU the library knows. */

#ifdef __cplusplus
}
#endif

#endif
