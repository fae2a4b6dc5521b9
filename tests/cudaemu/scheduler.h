// Between the block scheduler, the shared memory of a block and the launch checks (internal to
// libcudaemu.a). Shared memory lives in one arena whose objects each end at a guard page.
#ifndef CUDAEMU_SCHEDULER_H
#define CUDAEMU_SCHEDULER_H

#include <string>

#include "core.h"

namespace cudaemu {

// sm_90 (H100) limits
constexpr size_t kStaticSmemMax = 48 << 10;   // static shared memory per block
constexpr size_t kDefaultSmemMax = 48 << 10;  // static + dynamic without the attribute
constexpr size_t kOptinSmemMax = 227 << 10;   // sharedMemPerBlockOptin

// "kernel exact_fwd<64> (launched at attention.cu:212), block (1,0,0), thread (3,0,0)"
std::string kernel_label();
bool kernel_running();
// CUDAEMU_FAULTS=sticky: leave the running kernel for the launch that started it (never returns;
// false when no kernel is running).
bool escape_kernel();

void shared_begin_launch(const kernel_run &k);
void shared_end_launch(const kernel_run &k);
// For the fault handler: a description of p when it lies in the shared-memory arena.
bool describe_shared(const void *p, char *out, size_t len);
bool in_shared(const void *p);
void set_max_dynamic_smem(const void *func, int bytes);

}  // namespace cudaemu

#endif
