// The CUDA emulation's internals, shared by its runtime files (not seen by the code under test):
// settings, messages, device memory, the task queue of the streams, and the block scheduler.
// Everything here runs on the one host thread that calls CUDA; nothing in it is thread-safe,
// and it must not be: the emulated device is one coroutine scheduler, never several threads.
#ifndef CUDAEMU_CORE_H
#define CUDAEMU_CORE_H

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#include "include/cuda_runtime.h"

namespace cudaemu {

// ---- settings (settings.cc), read once from the environment ----
enum class order_kind { index, reverse, shuffle };
enum class defer_kind { immediate, last_first, shuffle };
struct settings {
  order_kind order = order_kind::index;
  defer_kind defer = defer_kind::immediate;
  uint64_t seed = 1;        // CUDAEMU_ORDER=shuffle:SEED
  uint64_t defer_seed = 1;  // CUDAEMU_DEFER=shuffle:SEED
  int devices = 1;          // CUDAEMU_DEVICES
  size_t stack_bytes = 256 << 10;
  bool host_check = true;   // CUDAEMU_HOSTCHECK=0: device memory stays readable by host code
  bool pinned_all = false;  // CUDAEMU_PAGEABLE=pinned: async copies treat all host memory as pinned
  bool trace = false;       // CUDAEMU_TRACE=1: one line per launch and library call
  size_t capacity = 0;      // bytes of device memory (CUDAEMU_MEMORY_GB)
  bool sticky_faults = false;  // CUDAEMU_FAULTS=sticky: a kernel's fault, the sticky error
  int nccl_hang_rank = -1;     // CUDAEMU_NCCL_HANG=RANK:N: on world rank RANK, the N-th NCCL
  long nccl_hang_op = 0;       // operation (collective or group) never completes
};
const settings &config();
const char *order_name();

// ---- messages (report.cc) ----
// A failure that a GPU turns into a crash or a sticky error: message, context, abort().
[[noreturn]] void fatal(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
// An explanation printed beside an error code returned through the normal CUDA error path.
void note(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void trace(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
// What the device is doing, for messages: "kernel exact_fwd<64> (attention.cu:212)", a library
// call, a copy; empty while host code runs.
void set_activity(const std::string &what);
const char *activity();
// Thread ranges as text: "0-31, 40".
std::string ranges(const std::vector<int> &ids);
void set_last_error(cudaError_t e);
// CUDAEMU_FAULTS=sticky: a kernel's illegal address is reported as a GPU reports it — the rest of
// the kernel and all work queued after it never run, and every later call returns
// cudaErrorIllegalAddress (the context is lost) — instead of ending the run at the fault.
// device_fault prints the message and, in that mode inside a kernel, abandons the kernel; else
// it is fatal. sticky_error(): cudaSuccess until then.
[[noreturn]] void device_fault(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
cudaError_t sticky_error();
cudaError_t fail(cudaError_t e, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

// ---- device memory (memory.cc) ----
struct allocation {
  uintptr_t base = 0;  // what cudaMalloc returned; base + size is the first guard byte
  size_t size = 0;
  uintptr_t data_begin = 0, data_end = 0;  // the pages opened while the device runs
  unsigned long serial = 0;                // allocation #serial, for messages
  bool freed = false;
};
enum class ptr_kind { null, device, device_freed, device_gap, pinned, host };
// Which memory p points into; `a` the device allocation when there is one. A pointer to one
// past the end of an allocation is `device` (pointer arithmetic may form it).
ptr_kind classify(const void *p, const allocation **a = nullptr);
// The bytes [p, p + n) inside one live device allocation (or pinned host memory when allowed).
bool device_range(const void *p, size_t n, bool pinned_ok);
void *device_alloc(size_t bytes);
cudaError_t device_free(void *p);
void *pinned_alloc(size_t bytes);
cudaError_t pinned_free(void *p);
bool is_pinned(const void *p, size_t n);
// Device memory is PROT_NONE while host code runs; these open and close it (nesting).
void device_enter();
void device_exit();
bool device_running();
size_t bytes_in_use();
size_t bytes_peak();
void install_fault_handler();
std::string describe_address(const void *p);

// ---- streams (streams.cc) ----
// Work for the device, run now (immediate mode) or at a synchronisation point (deferred).
void submit(cudaStream_t s, const char *what, std::function<void()> work);
// Work that never completes (CUDAEMU_NCCL_HANG, deferred mode): the stream stops at it, a query
// of the stream or of an event after it answers cudaErrorNotReady for ever, and a call that would
// wait for it ends the run (on a GPU it would never return) until release_hangs(owner), as
// ncclCommAbort ends NCCL's kernels, makes it a task that does nothing.
void submit_hang(cudaStream_t s, const char *what, const void *owner);
void release_hangs(const void *owner);
// Run everything queued on s (and what it waits for).
void drain_stream(cudaStream_t s);
void drain_all();
bool valid_stream(cudaStream_t s);

// ---- the block scheduler (scheduler.cc) ----
// One launch, as the scheduler runs it: `body` runs one CUDA thread (every thread of every block).
struct kernel_run {
  launch_site site;
  const void *func;
  dim3 grid, block;
  size_t dynamic_smem;
  std::function<void()> body;
};
void run_kernel(const kernel_run &k);
// Static shared memory of a kernel as far as measured (0 until it ran once).
size_t known_static_smem(const void *func);
int max_dynamic_smem(const void *func);  // cudaFuncAttributeMaxDynamicSharedMemorySize

// ---- coroutines (context.cc) ----
struct context {
  void *sp = nullptr;  // saved stack pointer (x86-64) or ucontext_t* (portable fallback)
};
// A pool of coroutine stacks with guard pages, reused from block to block.
void *stack_base(int i);  // lowest usable byte of stack i
bool in_stack_guard(const void *p, int *which);
void context_init(context *c, int stack, void (*entry)());
void context_switch(context *from, context *to);
const char *context_kind();

// ---- one emulated device per process (runtime.cc) ----
int current_device();
const char *host_name();

}  // namespace cudaemu

#endif
