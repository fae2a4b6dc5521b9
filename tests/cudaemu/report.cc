// The emulation's settings (environment variables, read once) and its messages: "cudaemu: ..."
// on stderr, stamped with the MPI rank when there are several; fatal() ends the process with
// abort() as a GPU fault ends a CUDA program. The last-error state of the runtime lives here.
#include <sys/sysinfo.h>

#include <csignal>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "core.h"
#include "scheduler.h"

namespace cudaemu {
namespace {

[[noreturn]] void bad_setting(const char *var, const char *value, const char *want) {
  fprintf(stderr, "cudaemu: %s=%s: expected %s\n", var, value, want);
  exit(2);
}

// "NAME" or "NAME:SEED"
bool parse_seeded(const char *v, const char *name, uint64_t *seed) {
  const size_t n = strlen(name);
  if (strncmp(v, name, n) != 0) return false;
  if (v[n] == '\0') return true;
  if (v[n] != ':') return false;
  char *end = nullptr;
  *seed = strtoull(v + n + 1, &end, 10);
  return end && *end == '\0' && end != v + n + 1;
}

long parse_long(const char *var, long lo, long hi, long dflt) {
  const char *v = getenv(var);
  if (!v || !*v) return dflt;
  char *end = nullptr;
  const long x = strtol(v, &end, 10);
  if (*end || x < lo || x > hi) {
    char want[96];
    snprintf(want, sizeof want, "an integer in [%ld, %ld]", lo, hi);
    bad_setting(var, v, want);
  }
  return x;
}

settings read_settings() {
  settings s;
  if (const char *v = getenv("CUDAEMU_ORDER"); v && *v) {
    if (!strcmp(v, "index"))
      s.order = order_kind::index;
    else if (!strcmp(v, "reverse"))
      s.order = order_kind::reverse;
    else if (parse_seeded(v, "shuffle", &s.seed))
      s.order = order_kind::shuffle;
    else
      bad_setting("CUDAEMU_ORDER", v, "index, reverse or shuffle[:SEED]");
  }
  if (const char *v = getenv("CUDAEMU_DEFER"); v && *v) {
    if (!strcmp(v, "0"))
      s.defer = defer_kind::immediate;
    else if (!strcmp(v, "1") || !strcmp(v, "last"))
      s.defer = defer_kind::last_first;
    else if (parse_seeded(v, "shuffle", &s.defer_seed))
      s.defer = defer_kind::shuffle;
    else
      bad_setting("CUDAEMU_DEFER", v, "0, 1 (= last) or shuffle[:SEED]");
  }
  s.devices = (int)parse_long("CUDAEMU_DEVICES", 0, 64, 1);
  s.stack_bytes = (size_t)parse_long("CUDAEMU_STACK_KB", 16, 1 << 20, 256) << 10;
  s.host_check = parse_long("CUDAEMU_HOSTCHECK", 0, 1, 1) != 0;
  s.trace = parse_long("CUDAEMU_TRACE", 0, 1, 0) != 0;
  if (const char *v = getenv("CUDAEMU_FAULTS"); v && *v) {
    if (!strcmp(v, "sticky"))
      s.sticky_faults = true;
    else if (strcmp(v, "abort"))
      bad_setting("CUDAEMU_FAULTS", v, "abort (the default) or sticky");
  }
  if (const char *v = getenv("CUDAEMU_NCCL_HANG"); v && *v) {
    char *end = nullptr;
    s.nccl_hang_rank = (int)strtol(v, &end, 10);
    if (end == v || *end != ':' || s.nccl_hang_rank < 0 ||
        (s.nccl_hang_op = strtol(end + 1, &end, 10)) < 1 || *end)
      bad_setting("CUDAEMU_NCCL_HANG", v, "RANK:N (world rank, N-th NCCL operation from 1)");
    if (s.defer == defer_kind::immediate)
      bad_setting("CUDAEMU_NCCL_HANG", v, "deferred streams as well (CUDAEMU_DEFER=1)");
  }
  if (const char *v = getenv("CUDAEMU_PAGEABLE"); v && *v) {
    if (!strcmp(v, "pinned"))
      s.pinned_all = true;
    else if (strcmp(v, "pageable"))
      bad_setting("CUDAEMU_PAGEABLE", v, "pageable or pinned");
  }
  // an H100 has 80 GB; the emulation gives at most half the machine's memory
  struct sysinfo si;
  long dflt = 80;
  if (sysinfo(&si) == 0) {
    const long half = (long)((double)si.totalram * si.mem_unit / 2 / (1 << 30));
    if (half < dflt) dflt = half > 1 ? half : 1;
  }
  s.capacity = (size_t)parse_long("CUDAEMU_MEMORY_GB", 1, 80, dflt) << 30;
  // a finer size, for a device that is nearly full (it wins over CUDAEMU_MEMORY_GB)
  if (const char *mb = getenv("CUDAEMU_MEMORY_MB"); mb && *mb)
    s.capacity = (size_t)parse_long("CUDAEMU_MEMORY_MB", 1, 80 << 10, 0) << 20;
  return s;
}

std::string activity_now;
cudaError_t last_error = cudaSuccess;
cudaError_t sticky = cudaSuccess;  // CUDAEMU_FAULTS=sticky: set by a kernel's fault

void vprint(const char *fmt, va_list ap) {
  char msg[4096];
  vsnprintf(msg, sizeof msg, fmt, ap);
  const char *rank = getenv("OMPI_COMM_WORLD_RANK");
  if (!rank) rank = getenv("PMI_RANK");
  const char *size = getenv("OMPI_COMM_WORLD_SIZE");
  if (rank && size && strcmp(size, "1") != 0)
    fprintf(stderr, "cudaemu (rank %s): %s\n", rank, msg);
  else
    fprintf(stderr, "cudaemu: %s\n", msg);
  fflush(stderr);
}

}  // namespace

const settings &config() {
  static const settings s = read_settings();
  return s;
}

const char *order_name() {
  switch (config().order) {
    case order_kind::index:
      return "index";
    case order_kind::reverse:
      return "reverse";
    case order_kind::shuffle:
      return "shuffle";
  }
  return "?";
}

void fatal(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vprint(fmt, ap);
  va_end(ap);
  signal(SIGABRT, SIG_DFL);
  abort();
}

void note(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vprint(fmt, ap);
  va_end(ap);
}

void trace(const char *fmt, ...) {
  if (!config().trace) return;
  va_list ap;
  va_start(ap, fmt);
  vprint(fmt, ap);
  va_end(ap);
}

void set_activity(const std::string &what) { activity_now = what; }

const char *activity() {
  if (kernel_running()) {
    static std::string label;
    label = kernel_label();
    return label.c_str();
  }
  return activity_now.empty() ? "host code" : activity_now.c_str();
}

std::string ranges(const std::vector<int> &ids) {
  std::string s;
  for (size_t i = 0; i < ids.size();) {
    size_t j = i;
    while (j + 1 < ids.size() && ids[j + 1] == ids[j] + 1) j++;
    if (!s.empty()) s += ", ";
    s += std::to_string(ids[i]);
    if (j > i) s += "-" + std::to_string(ids[j]);
    i = j + 1;
  }
  return s;
}

void device_fault(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vprint(fmt, ap);
  va_end(ap);
  if (config().sticky_faults && kernel_running()) {
    note(
        "CUDAEMU_FAULTS=sticky: the kernel stops here; the context is lost (every later call "
        "returns cudaErrorIllegalAddress)");
    sticky = cudaErrorIllegalAddress;
    escape_kernel();
  }
  signal(SIGABRT, SIG_DFL);
  abort();
}

cudaError_t sticky_error() { return sticky; }

void set_last_error(cudaError_t e) {
  if (e != cudaSuccess) last_error = e;
}

cudaError_t fail(cudaError_t e, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vprint(fmt, ap);
  va_end(ap);
  set_last_error(e);
  return e;
}

}  // namespace cudaemu

extern "C" cudaError_t cudaGetLastError(void) {
  if (cudaemu::sticky != cudaSuccess) return cudaemu::sticky;  // not cleared: the context is lost
  const cudaError_t e = cudaemu::last_error;
  cudaemu::last_error = cudaSuccess;
  return e;
}

extern "C" cudaError_t cudaPeekAtLastError(void) {
  return cudaemu::sticky != cudaSuccess ? cudaemu::sticky : cudaemu::last_error;
}
