// Shared memory of the running block: every __shared__ object and the dynamic shared memory get
// their own pages in one arena, right-aligned against a PROT_NONE guard page (an index one past
// the end faults), NaN-filled (bytes 0xFF) when the block first touches them. The sm_90 limits
// on static and dynamic shared memory are checked here as the objects appear.
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <map>
#include <vector>

#include "scheduler.h"

namespace cudaemu {
namespace {

constexpr size_t kArenaBytes = 16 << 20;

struct object {
  uintptr_t region_begin, region_end;  // the opened pages; a guard page follows
  uintptr_t begin, end;                // the object
  const char *name, *file;
  int line;
};

char *arena = nullptr;
size_t used = 0;  // bytes of the arena in use in this launch (opened pages and guards)
std::vector<object> objects;
unsigned long long launch_serial = 0;
const kernel_run *cur = nullptr;
size_t static_bytes = 0;
shared_slot dynamic_slot;
std::map<const void *, size_t> static_known;
std::map<const void *, int> max_dynamic;

size_t page() {
  static const size_t p = (size_t)sysconf(_SC_PAGESIZE);
  return p;
}

void ensure_arena() {
  if (arena) return;
  void *m =
      mmap(nullptr, kArenaBytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) fatal("cannot reserve the shared-memory arena");
  arena = static_cast<char *>(m);
}

// New pages for an object of `size` bytes, the object ending where the guard page begins.
void *place(size_t size, size_t align, const char *name, const char *file, int line) {
  const size_t pages = (size + page() - 1) / page() * page();
  const size_t region = pages ? pages : page();
  if (used + page() + region + page() > kArenaBytes)
    fatal("shared memory: more __shared__ objects than the emulation's %zu-byte arena holds",
          kArenaBytes);
  const uintptr_t rb = (uintptr_t)arena + used + page(), re = rb + region;
  if (mprotect(reinterpret_cast<void *>(rb), region, PROT_READ | PROT_WRITE))
    fatal("shared memory: mprotect failed");
  used += page() + region;
  const uintptr_t b = (re - size) & ~(uintptr_t)(align - 1);
  objects.push_back(object{rb, re, b, b + size, name, file, line});
  return reinterpret_cast<void *>(b);
}

size_t limit_for(const void *func) {
  auto it = max_dynamic.find(func);
  return it == max_dynamic.end() ? kDefaultSmemMax : kOptinSmemMax;
}

void check_limits(const char *file, int line) {
  if (static_bytes > kStaticSmemMax)
    fatal(
        "%s uses %zu bytes of static shared memory (at %s:%d and before): sm_90 allows %zu; "
        "ptxas refuses such a kernel",
        kernel_label().c_str(), static_bytes, file, line, kStaticSmemMax);
  const size_t total = static_bytes + cur->dynamic_smem, limit = limit_for(cur->func);
  if (total > limit)
    fatal(
        "%s uses %zu bytes of static + %zu bytes of dynamic shared memory: more than the %zu "
        "bytes a block may have%s; on the GPU the launch fails (cudaErrorInvalidValue)",
        kernel_label().c_str(), static_bytes, cur->dynamic_smem, limit,
        limit == kDefaultSmemMax ? " without cudaFuncAttributeMaxDynamicSharedMemorySize" : "");
}

}  // namespace

void shared_begin_launch(const kernel_run &k) {
  ensure_arena();
  cur = &k;
  launch_serial++;
  static_bytes = 0;
  used = 0;
  objects.clear();
}

void shared_end_launch(const kernel_run &k) {
  if (used && mprotect(arena, used, PROT_NONE)) fatal("shared memory: mprotect failed");
  size_t &known = static_known[k.func];
  if (static_bytes > known) known = static_bytes;
  used = 0;
  objects.clear();
  cur = nullptr;
}

void *shared_place(shared_slot *slot, size_t size, size_t align, const char *name, const char *file,
                   int line) {
  if (!cur) fatal("__shared__ %s (%s:%d) used outside a kernel", name, file, line);
  if (slot->launch != launch_serial) {
    static_bytes += size;
    check_limits(file, line);
    slot->ptr = place(size, align, name, file, line);
    slot->launch = launch_serial;
  }
  std::memset(slot->ptr, 0xff, size);
  slot->block = g_block_serial;
  return slot->ptr;
}

void *dynamic_shared(size_t align, const char *file, int line) {
  if (!cur) fatal("extern __shared__ (%s:%d) used outside a kernel", file, line);
  const size_t a = align > 16 ? align : 16;  // CUDA aligns dynamic shared memory to 16 bytes
  shared_slot &s = dynamic_slot;
  if (s.launch != launch_serial) {
    check_limits(file, line);
    s.ptr = place(cur->dynamic_smem, a, "dynamic shared memory", file, line);
    s.launch = launch_serial;
  }
  if ((uintptr_t)s.ptr % a)
    fatal("extern __shared__ at %s:%d asks for %zu-byte alignment; the emulation gives 16", file,
          line, align);
  if (s.block != g_block_serial) {
    std::memset(s.ptr, 0xff, cur->dynamic_smem);
    s.block = g_block_serial;
  }
  return s.ptr;
}

size_t known_static_smem(const void *func) {
  auto it = static_known.find(func);
  return it == static_known.end() ? 0 : it->second;
}

int max_dynamic_smem(const void *func) {
  auto it = max_dynamic.find(func);
  return it == max_dynamic.end() ? -1 : it->second;
}

void set_max_dynamic_smem(const void *func, int bytes) { max_dynamic[func] = bytes; }

bool in_shared(const void *p) {
  return arena && (const char *)p >= arena && (const char *)p < arena + kArenaBytes;
}

bool describe_shared(const void *p, char *out, size_t len) {
  if (!in_shared(p)) return false;
  const uintptr_t a = (uintptr_t)p;
  for (const object &o : objects) {
    if (a >= o.region_end && a < o.region_end + page()) {
      snprintf(out, len,
               "shared memory: byte %zu of the %zu-byte __shared__ %s (declared at "
               "%s:%d), past its end",
               (size_t)(a - o.begin), (size_t)(o.end - o.begin), o.name, o.file, o.line);
      return true;
    }
    if (a + page() >= o.region_begin && a < o.region_begin) {
      snprintf(out, len, "shared memory: %zu bytes before the start of %s (declared at %s:%d)",
               (size_t)(o.begin - a), o.name, o.file, o.line);
      return true;
    }
  }
  snprintf(out, len, "shared memory at %p, outside every __shared__ object of the block", p);
  return true;
}

}  // namespace cudaemu
