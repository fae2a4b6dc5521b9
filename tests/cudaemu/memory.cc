// Emulated device memory: every cudaMalloc its own pages in one arena, right-aligned against a
// 64 KiB guard gap (one element past the end faults), NaN-filled, never reused (a use after free
// faults), PROT_NONE while host code runs and opened only for device work (device_enter) — one
// mprotect where guard markers (MADV_GUARD_INSTALL) keep gaps faulting. The SIGSEGV handler names
// each violation. Memory the code under test owns is never touched.
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <map>

#include "core.h"
#include "scheduler.h"

namespace cudaemu {
namespace {

constexpr size_t kGap = 64 << 10;        // PROT_NONE bytes between allocations
constexpr unsigned char kCanary = 0xcd;  // fills the bytes before base on its first page
constexpr int kGuardInstall = 102;       // MADV_GUARD_INSTALL, which older headers lack

char *arena = nullptr;
size_t arena_bytes = 0;
uintptr_t next_free = 0;
std::map<uintptr_t, allocation> records;  // by data_begin: live and freed
std::map<uintptr_t, allocation *> live;
std::map<uintptr_t, size_t> pinned;  // cudaMallocHost blocks: base -> size
size_t in_use = 0, peak = 0;
unsigned long serial = 0;
int depth = 0;
bool guard_markers = false;  // gaps and freed ranges fault even inside an opened range

size_t page() {
  static const size_t p = (size_t)sysconf(_SC_PAGESIZE);
  return p;
}

void reserve_arena() {
  if (arena) return;
  // Addresses are never reused, so reserve much: 8 TiB of address space (no memory behind it)
  for (size_t bytes = (size_t)8 << 40; bytes >= ((size_t)64 << 30); bytes /= 2) {
    void *m = mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m != MAP_FAILED) {
      arena = static_cast<char *>(m);
      arena_bytes = bytes;
      next_free = (uintptr_t)arena + kGap;
      const char *g = getenv("CUDAEMU_GUARD_MARKERS");  // 0: per-allocation mprotect (measuring)
      guard_markers = !(g && !strcmp(g, "0")) && madvise(arena, kGap, kGuardInstall) == 0;
      return;
    }
  }
  fatal("cannot reserve address space for emulated device memory");
}

void protect(uintptr_t begin, uintptr_t end, int prot) {
  if (end > begin && mprotect(reinterpret_cast<void *>(begin), end - begin, prot))
    fatal("mprotect of emulated device memory failed: %s", strerror(errno));
}

// The record whose pages or following gap contain p (live or freed), or null.
const allocation *record_near(uintptr_t p) {
  auto it = records.upper_bound(p);
  if (it == records.begin()) return nullptr;
  --it;
  return p < it->second.data_end + kGap ? &it->second : nullptr;
}

}  // namespace

bool in_arena(const void *p) {
  return arena && (const char *)p >= arena && (const char *)p < arena + arena_bytes;
}

void *device_alloc(size_t bytes) {
  reserve_arena();
  if (bytes > config().capacity || in_use + bytes > config().capacity) return nullptr;
  const size_t span = (bytes + page() - 1) / page() * page();
  if (next_free + span + kGap > (uintptr_t)arena + arena_bytes) return nullptr;
  allocation a;
  a.data_begin = next_free;
  a.data_end = next_free + span;
  a.base = a.data_end - bytes;
  a.size = bytes;
  a.serial = ++serial;
  next_free = a.data_end + kGap;
  if (guard_markers && madvise(reinterpret_cast<void *>(a.data_end), kGap, kGuardInstall))
    fatal("MADV_GUARD_INSTALL failed: %s", strerror(errno));
  protect(a.data_begin, a.data_end, PROT_READ | PROT_WRITE);
  std::memset(reinterpret_cast<void *>(a.data_begin), kCanary, a.base - a.data_begin);
  std::memset(reinterpret_cast<void *>(a.base), 0xff, bytes);  // NaN as float and double
  if (depth == 0 && config().host_check) protect(a.data_begin, a.data_end, PROT_NONE);
  allocation &r = records[a.data_begin] = a;
  live[a.data_begin] = &r;
  in_use += bytes;
  if (in_use > peak) peak = in_use;
  return reinterpret_cast<void *>(a.base);
}

cudaError_t device_free(void *p) {
  const allocation *near = record_near((uintptr_t)p);
  if (!near || near->base != (uintptr_t)p)
    return fail(cudaErrorInvalidValue, "cudaFree(%p): not a pointer cudaMalloc returned (%s)", p,
                describe_address(p).c_str());
  if (near->freed)
    return fail(cudaErrorInvalidValue, "cudaFree(%p): allocation #%lu was freed already", p,
                near->serial);
  allocation &a = records[near->data_begin];
  if (depth == 0 && config().host_check) protect(a.data_begin, a.data_end, PROT_READ);
  for (uintptr_t b = a.data_begin; b < a.base; b++)
    if (*reinterpret_cast<const unsigned char *>(b) != kCanary)
      fatal(
          "cudaFree(%p): the %zu bytes before allocation #%lu (%zu bytes) were written: a "
          "device write %zu bytes before its start",
          p, (size_t)(a.base - a.data_begin), a.serial, a.size, (size_t)(a.base - b));
  if (depth == 0 || !guard_markers) protect(a.data_begin, a.data_end, PROT_NONE);
  // the pages go back to the system; with guard markers they fault even while device memory is
  // open (cudaFree inside a drain, or CUDAEMU_HOSTCHECK=0)
  madvise(reinterpret_cast<void *>(a.data_begin), a.data_end - a.data_begin,
          guard_markers ? kGuardInstall : MADV_DONTNEED);
  a.freed = true;
  live.erase(a.data_begin);
  in_use -= a.size;
  return cudaSuccess;
}

ptr_kind classify(const void *p, const allocation **out) {
  if (!p) return ptr_kind::null;
  const uintptr_t u = (uintptr_t)p;
  if (in_arena(p)) {
    const allocation *a = record_near(u);
    if (out) *out = a;
    if (!a || u < a->base || u > a->base + a->size) return ptr_kind::device_gap;
    return a->freed ? ptr_kind::device_freed : ptr_kind::device;
  }
  if (is_pinned(p, 0)) return ptr_kind::pinned;
  return ptr_kind::host;
}

bool device_range(const void *p, size_t n, bool pinned_ok) {
  const allocation *a = nullptr;
  switch (classify(p, &a)) {
    case ptr_kind::device:
      return (uintptr_t)p + n <= a->base + a->size;
    case ptr_kind::pinned:
      return pinned_ok && is_pinned(p, n);
    default:
      return false;
  }
}

std::string describe_address(const void *p) {
  char buf[512];
  const uintptr_t u = (uintptr_t)p;
  const allocation *a = in_arena(p) ? record_near(u) : nullptr;
  if (!in_arena(p)) {
    snprintf(buf, sizeof buf, "%p is %s", p,
             is_pinned(p, 0) ? "pinned host memory" : "not device memory (a host address)");
  } else if (!a) {
    snprintf(buf, sizeof buf, "%p is device address space outside every allocation", p);
  } else {
    const char *state = a->freed ? "freed " : "";
    if (u < a->base)
      snprintf(buf, sizeof buf,
               "%p is %zu bytes before the start of %sallocation #%lu (%zu "
               "bytes at %p)",
               p, (size_t)(a->base - u), state, a->serial, a->size, (void *)a->base);
    else if (u >= a->base + a->size)
      snprintf(buf, sizeof buf,
               "%p is byte %zu of %sallocation #%lu (%zu bytes at %p): past its "
               "end",
               p, (size_t)(u - a->base), state, a->serial, a->size, (void *)a->base);
    else
      snprintf(buf, sizeof buf, "%p is byte %zu of %sallocation #%lu (%zu bytes at %p)%s", p,
               (size_t)(u - a->base), state, a->serial, a->size, (void *)a->base,
               a->freed ? ": a use after free" : "");
  }
  return buf;
}

void device_enter() {
  if (depth++ > 0) return;
  install_fault_handler();
  if (!config().host_check || !arena) return;
  if (guard_markers)
    protect((uintptr_t)arena, next_free, PROT_READ | PROT_WRITE);
  else
    for (auto &kv : live)
      protect(kv.second->data_begin, kv.second->data_end, PROT_READ | PROT_WRITE);
}

void device_exit() {
  if (--depth > 0 || !config().host_check) return;
  // everything else in the arena is PROT_NONE already: one call closes it all
  if (arena) protect((uintptr_t)arena, next_free, PROT_NONE);
}

bool device_running() { return depth > 0; }
size_t bytes_in_use() { return in_use; }
size_t bytes_peak() { return peak; }

void *pinned_alloc(size_t bytes) {
  void *p = nullptr;
  if (posix_memalign(&p, page(), bytes ? bytes : 1)) return nullptr;
  pinned[(uintptr_t)p] = bytes ? bytes : 1;
  return p;
}

cudaError_t pinned_free(void *p) {
  auto it = pinned.find((uintptr_t)p);
  if (it == pinned.end())
    return fail(cudaErrorInvalidValue, "cudaFreeHost(%p): not a pointer cudaMallocHost returned",
                p);
  pinned.erase(it);
  std::free(p);
  return cudaSuccess;
}

bool is_pinned(const void *p, size_t n) {
  const uintptr_t u = (uintptr_t)p;
  auto it = pinned.upper_bound(u);
  if (it == pinned.begin()) return false;
  --it;
  return u >= it->first && u + n <= it->first + it->second && u < it->first + it->second;
}

// ---- the fault handler ----
namespace {

struct sigaction previous_segv, previous_bus;

void on_fault(int sig, siginfo_t *si, void *) {
  const void *p = si->si_addr;
  char where[768];
  int stack = 0;
  if (in_stack_guard(p, &stack))
    fatal("stack overflow of a CUDA thread in %s: each has %zu KiB (CUDAEMU_STACK_KB)",
          kernel_label().c_str(), config().stack_bytes >> 10);
  if (describe_shared(p, where, sizeof where)) fatal("%s in %s", where, kernel_label().c_str());
  if (in_arena(p)) {
    if (!device_running())
      fatal(
          "host code accessed device memory: %s. Device memory is open only to kernels, "
          "copies and library calls",
          describe_address(p).c_str());
    device_fault("illegal device memory access in %s: %s", activity(), describe_address(p).c_str());
  }
  if (device_running() && kernel_running())
    device_fault("illegal address in %s: %p is not device memory (a host pointer, or a wild one)",
                 activity(), p);
  // not the emulation's: the handler that was there before (MPI's, or the default action)
  sigaction(sig, sig == SIGBUS ? &previous_bus : &previous_segv, nullptr);
}

}  // namespace

void install_fault_handler() {
  static thread_local bool altstack = false;
  if (!altstack) {
    stack_t ss;
    ss.ss_size = 256 << 10;
    ss.ss_sp = std::malloc(ss.ss_size);
    ss.ss_flags = 0;
    if (!ss.ss_sp || sigaltstack(&ss, nullptr)) fatal("sigaltstack failed");
    altstack = true;
  }
  // Checked at every entry, not once: a test framework may put its own handler back between
  // calls (cmocka does, per test), and a fault in device work must reach this one. The handler
  // found is the one chained to for faults that are not the emulation's.
  struct sigaction cur, sa;
  if (sigaction(SIGSEGV, nullptr, &cur) == 0 && (cur.sa_flags & SA_SIGINFO) &&
      cur.sa_sigaction == on_fault)
    return;
  std::memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_fault;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGSEGV, &sa, &previous_segv);
  sigaction(SIGBUS, &sa, &previous_bus);
}

}  // namespace cudaemu
