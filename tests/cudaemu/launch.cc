// Kernel launches: the sm_90 (H100) launch limits checked as the hardware checks them, failing
// through cudaGetLastError as CUDA does (the launch does not run); pointer arguments checked to
// be device memory (a host pointer, a freed or out-of-range one ends the run, as the GPU's
// illegal-address fault would); then the kernel queued on its stream.
#include <chrono>
#include <memory>

#include "core.h"
#include "scheduler.h"

namespace cudaemu {
namespace {

cudaError_t check_config(const launch_site &site, const void *func, const launch_config &c) {
  const dim3 g = c.grid, b = c.block;
  const unsigned long long threads = (unsigned long long)b.x * b.y * b.z;
  if (!g.x || !g.y || !g.z || !b.x || !b.y || !b.z)
    return fail(cudaErrorInvalidConfiguration,
                "launch of %s at %s:%d: an empty grid (%u,%u,%u) or block (%u,%u,%u)", site.name,
                site.file, site.line, g.x, g.y, g.z, b.x, b.y, b.z);
  if (b.x > 1024 || b.y > 1024 || b.z > 64 || threads > 1024)
    return fail(cudaErrorInvalidConfiguration,
                "launch of %s at %s:%d: block (%u,%u,%u) exceeds sm_90's 1024 threads per block "
                "(dimensions at most 1024, 1024, 64)",
                site.name, site.file, site.line, b.x, b.y, b.z);
  if (g.x > 2147483647u || g.y > 65535 || g.z > 65535)
    return fail(cudaErrorInvalidConfiguration,
                "launch of %s at %s:%d: grid (%u,%u,%u) exceeds (2^31 - 1, 65535, 65535)",
                site.name, site.file, site.line, g.x, g.y, g.z);
  const size_t stat = known_static_smem(func);
  const int attr = max_dynamic_smem(func);
  const size_t limit = attr >= 0 ? (size_t)attr : kDefaultSmemMax - stat;
  if (c.smem > limit || c.smem + stat > kOptinSmemMax)
    return fail(cudaErrorInvalidValue,
                "launch of %s at %s:%d: %zu bytes of dynamic shared memory (with %zu static) "
                "exceed the %zu allowed%s",
                site.name, site.file, site.line, c.smem, stat, limit,
                attr >= 0 ? "" : " without cudaFuncAttributeMaxDynamicSharedMemorySize");
  if (!valid_stream(c.stream))
    return fail(cudaErrorInvalidResourceHandle, "launch of %s at %s:%d: no such stream %p",
                site.name, site.file, site.line, (void *)c.stream);
  return cudaSuccess;
}

void check_pointers(const launch_site &site, const void *const *ptrs, const bool *is_ptr, int n) {
  for (int i = 0; i < n; i++) {
    if (!is_ptr[i]) continue;
    const char *why = nullptr;
    switch (classify(ptrs[i])) {
      case ptr_kind::null:
      case ptr_kind::device:
      case ptr_kind::pinned:
        continue;
      case ptr_kind::device_freed:
        why = "points into freed device memory";
        break;
      case ptr_kind::device_gap:
        why = "points outside every device allocation";
        break;
      case ptr_kind::host:
        why = "is a host pointer";
        break;
    }
    fatal(
        "launch of %s at %s:%d: argument %d %s (%s); on the GPU the kernel faults with "
        "cudaErrorIllegalAddress",
        site.name, site.file, site.line, i + 1, why, describe_address(ptrs[i]).c_str());
  }
}

}  // namespace

void launch_kernel(const launch_site &site, const void *func, const launch_config &cfg,
                   const void *const *pointers, const bool *is_pointer, int nparams,
                   std::function<void()> body) {
  if (config().devices == 0) {
    set_last_error(cudaErrorNoDevice);
    return;
  }
  install_fault_handler();  // the alternate signal stack of this thread
  // after a fault the context is lost: nothing launches
  if (sticky_error() != cudaSuccess) {
    set_last_error(sticky_error());
    return;
  }
  if (check_config(site, func, cfg) != cudaSuccess) return;
  check_pointers(site, pointers, is_pointer, nparams);
  auto run = std::make_shared<kernel_run>(
      kernel_run{site, func, cfg.grid, cfg.block, cfg.smem, std::move(body)});
  char what[512];
  snprintf(what, sizeof what, "kernel %s grid (%u,%u,%u) block (%u,%u,%u) at %s:%d", site.name,
           cfg.grid.x, cfg.grid.y, cfg.grid.z, cfg.block.x, cfg.block.y, cfg.block.z, site.file,
           site.line);
  submit(cfg.stream, what, [run] { run_kernel(*run); });
}

void device_trap(const char *file, int line) {
  fatal("__trap() at %s:%d in %s", file, line, activity());
}

void check_atomic(const void *p, const char *what) {
  if (in_shared(p) || classify(p) == ptr_kind::device) return;
  fatal("%s on %s in %s: atomics need device or shared memory", what, describe_address(p).c_str(),
        activity());
}

}  // namespace cudaemu

// The device clock: nanoseconds of the host's steady clock.
long long clock64() {
  using namespace std::chrono;
  return (long long)duration_cast<nanoseconds>(steady_clock::now().time_since_epoch()).count();
}
