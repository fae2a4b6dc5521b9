// Device memory of the CUDA back end, the twin of src/core/memory.c: a pool, so that a step's
// workspace is reused and cudaMalloc/cudaFree (which synchronises the device) run only while the
// pool grows; every block in use is counted by label in memory.c. Small blocks (up to 1 MiB) are
// kept by size class; large ones are cut from segments (what cudaMalloc gave), the best fit in the
// oldest segment where one fits, split when the rest is worth keeping and merged with free
// neighbours when freed, so that memory freed by one phase of a step serves another phase's
// requests of other sizes, and a step that repeats the previous one allocates nothing.
// FMATTN_GPU_POOL=0 gives every free back to the driver at once (for memory checkers);
// FMATTN_GPU_POOL_TRACE=FILE writes every request to FILE (scripts/pool_replay.py replays it).
// Also the copies and the row packing that exchanges do on device memory.
#include <cstdio>
#include <cstdlib>
#include <map>
#include <set>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "check.h"
#include "gpu.h"

namespace {

struct Block {
  size_t bytes;
  enum mem_label label;
};

std::unordered_map<void *, Block> live;   // blocks in use
std::multimap<size_t, void *> cached;     // free small blocks of the pool, by size
size_t cached_bytes = 0, live_bytes = 0;  // free in the pool (small blocks and segments), in use
size_t live_peak = 0;                     // the most ever in use
size_t reserve = size_t(1) << 30;         // gpu.outside_reserve_mb
long outside_mib = 0;                     // FMATTN_FAULT = outside_alloc=MIB (core/fault.h)
int pool_on = -1;                         // −1: not read yet
FILE *trace = nullptr;                    // FMATTN_GPU_POOL_TRACE: every request, one a line

constexpr size_t kSmallMax = size_t(1) << 20;  // larger: cut from segments
constexpr size_t kSplitMin = size_t(1) << 20;  // a rest this large becomes a free block of its own

// A large block: a piece of a segment, the pieces of a segment in address order. Segments are
// numbered in the order the pool asked the driver for them.
struct Piece {
  char *p;
  size_t bytes;
  bool used;
  Piece *prev, *next;  // neighbours in the segment, or null
  long seg;            // its segment's number
};
std::unordered_map<void *, Piece *> pieces;  // every large block, by address
long segments = 0;                           // segments ever made: the next one's number
// The free pieces by (segment, size, address). A request takes the best fit in the oldest
// segment where one fits, not the best fit of all: so a step that repeats the previous one's
// requests from the same state repeats its choices, and finds each segment that step had to add,
// free and of the size it was made for, where that step added it. The pool stops growing after
// one step (docs/gpu.md, "The pool's steady state"); a best fit over all segments could place a
// block, in the second step, in a segment the first made later, and need one more.
std::set<std::tuple<long, size_t, char *>> free_large;

void free_insert(const Piece *b) { free_large.insert({b->seg, b->bytes, b->p}); }
void free_erase(const Piece *b) { free_large.erase({b->seg, b->bytes, b->p}); }

// A free piece of at least sz bytes, split to sz when the rest is large enough; null if none.
Piece *take_large(size_t sz) {
  auto it = free_large.begin();  // the oldest segment with a free piece
  while (it != free_large.end()) {
    const long seg = std::get<0>(*it);
    it = free_large.lower_bound({seg, sz, nullptr});  // its best fit, or a later segment's piece
    if (it != free_large.end() && std::get<0>(*it) == seg) break;
  }
  if (it == free_large.end()) return nullptr;
  Piece *b = pieces.at(std::get<2>(*it));
  free_large.erase(it);
  if (b->bytes - sz >= kSplitMin) {
    Piece *rest = new Piece{b->p + sz, b->bytes - sz, false, b, b->next, b->seg};
    if (b->next) b->next->prev = rest;
    b->next = rest;
    b->bytes = sz;
    pieces[rest->p] = rest;
    free_insert(rest);
  }
  b->used = true;
  cached_bytes -= b->bytes;
  return b;
}

// The piece freed, merged with its free neighbours.
void give_large(Piece *b) {
  b->used = false;
  cached_bytes += b->bytes;
  for (Piece *n : {b->next, b->prev}) {
    if (!n || n->used) continue;
    free_erase(n);
    Piece *lo = n == b->next ? b : n, *hi = n == b->next ? n : b;
    lo->bytes += hi->bytes;
    lo->next = hi->next;
    if (hi->next) hi->next->prev = lo;
    pieces.erase(hi->p);
    delete hi;
    b = lo;
  }
  free_insert(b);
}

bool pooling() {
  if (pool_on < 0) {
    const char *e = std::getenv("FMATTN_GPU_POOL");
    pool_on = !(e && e[0] == '0');
    const char *t = std::getenv("FMATTN_GPU_POOL_TRACE");
    if (t && t[0] && !(trace = std::fopen(t, "w")))
      error_at(__FILE__, __func__, __LINE__, "FMATTN_GPU_POOL_TRACE: cannot write %s", t);
  }
  return pool_on;
}

// FMATTN_FAULT = outside_alloc=MIB (core/fault.h, passed on by gpu_pool_set_outside_probe): can MIB
// MiB be had outside the pool, as NCCL or another library would ask for them, at the pool's peak?
// The device's use is highest right after a growth of the pool, whose reservation never shrinks
// (but for a failed allocation's release), so each growth checks that the driver has MIB MiB free,
// and at exit, where the reservation is still the run's peak, MIB MiB are allocated for real and
// given back (one allocation: under the emulation every allocation is filled, and hundreds of 512
// MiB would take minutes). The figures at the largest reservation, said at exit.
extern "C" void message_all(const char *fmt, ...);  // core/error.h, which C++ cannot include

struct {
  bool refused = false;  // the run ends on the refusal's message alone
  long growths = 0;
  size_t reserved = 0, live = 0, least_free = SIZE_MAX, total = 0;
} outside;

[[noreturn]] void outside_refused(const char *when, long mib, size_t free_b, size_t total_b) {
  outside.refused = true;
  error_at(__FILE__, __func__, __LINE__,
           "FMATTN_FAULT=outside_alloc: %ld MiB outside the pool %s, with %.1f MiB reserved by the "
           "pool (%.1f MiB in use) and %.1f of %.1f MiB free on the device",
           mib, when, (double)(live_bytes + cached_bytes) / 1048576.0,
           (double)live_bytes / 1048576.0, (double)free_b / 1048576.0, (double)total_b / 1048576.0);
}

void outside_at_exit() {
  if (outside.refused) return;
  const long mib = outside_mib;
  size_t free_b = 0, total_b = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  void *p = nullptr;
  if (cudaMalloc(&p, (size_t)mib << 20) != cudaSuccess) {
    (void)cudaGetLastError();
    outside_refused("could not be allocated at exit", mib, free_b, total_b);
  }
  CUDA_CHECK(cudaFree(p));
  message_all(
      "FMATTN_FAULT=outside_alloc: %ld MiB outside the pool were free at each of its %ld "
      "growths (%.1f MiB free at the least, at its peak of %.1f MiB reserved, %.1f MiB in "
      "use, on a device of %.1f MiB) and allocated at exit with %.1f MiB reserved; at most "
      "%.1f MiB were in use",
      mib, outside.growths, (double)outside.least_free / 1048576.0,
      (double)outside.reserved / 1048576.0, (double)outside.live / 1048576.0,
      (double)outside.total / 1048576.0, (double)(live_bytes + cached_bytes) / 1048576.0,
      (double)live_peak / 1048576.0);
}

void outside_check() {
  const long mib = outside_mib;
  if (mib == 0) return;
  size_t free_b = 0, total_b = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  if (free_b < ((size_t)mib << 20))
    outside_refused("would not fit after a growth", mib, free_b, total_b);
  if (outside.growths++ == 0) std::atexit(outside_at_exit);
  outside.total = total_b;
  if (free_b < outside.least_free) {
    outside.least_free = free_b;
    outside.reserved = live_bytes + cached_bytes;
    outside.live = live_bytes;
  }
}

// Size classes: 512-byte steps up to 1 MiB, then whole MiB: a block serves requests of its class,
// wasting less than 512 bytes of a small one and less than a MiB of a large one.
size_t size_class(size_t bytes) {
  const size_t small = 512, big = size_t(1) << 20;
  if (bytes == 0) bytes = 1;
  return bytes <= big ? (bytes + small - 1) / small * small : (bytes + big - 1) / big * big;
}

constexpr unsigned kThreads = 256;

// dst[r·ds + i] = src[r·ss + i] (add: +=), grid-stride over rows × len.
__global__ void rows_kernel(float *dst, size_t ds, const float *src, size_t ss, size_t rows,
                            size_t len, bool add) {
  const size_t total = rows * len;
  for (size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x; e < total;
       e += (size_t)gridDim.x * blockDim.x) {
    const size_t r = e / len, i = e % len;
    if (add)
      dst[r * ds + i] += src[r * ss + i];
    else
      dst[r * ds + i] = src[r * ss + i];
  }
}

void rows(float *dst, size_t ds, const float *src, size_t ss, size_t nrows, size_t len, bool add) {
  const size_t total = nrows * len;
  if (total == 0) return;
  const size_t blocks = gpu_blocks(total, kThreads);
  rows_kernel<<<(unsigned)(blocks < 65535 ? blocks : 65535), kThreads, 0, gpu_stream()>>>(
      dst, ds, src, ss, nrows, len, add);
  LAUNCH_CHECK(rows_kernel);
}

}  // namespace

extern "C" void *gpu_alloc(enum mem_label label, size_t bytes) {
  // without the pool, exactly what was asked: a memory checker then sees the first byte past it
  size_t sz = pooling() ? size_class(bytes) : (bytes ? bytes : 1);
  void *p = nullptr;
  auto it = pooling() && sz <= kSmallMax ? cached.find(sz) : cached.end();
  Piece *piece = pooling() && sz > kSmallMax ? take_large(sz) : nullptr;
  bool grew = false;  // the pool asked the driver for more
  if (it != cached.end()) {
    p = it->second;
    cached.erase(it);
    cached_bytes -= sz;
  } else if (piece) {
    p = piece->p;
    sz = piece->bytes;  // a rest too small to keep stays with it
  } else {
    if (pooling() && reserve > 0 && cached_bytes > 0) {  // leave the reserve to the others
      size_t free_b = 0, total_b = 0;
      CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
      if (free_b < sz + reserve) gpu_release_cache();
    }
    gpu_count_malloc();
    if (cudaMalloc(&p, sz) != cudaSuccess) {
      (void)cudaGetLastError();  // out of memory: give the pool back and try once more
      gpu_release_cache();
      gpu_count_malloc();
      if (cudaMalloc(&p, sz) != cudaSuccess) {
        (void)cudaGetLastError();
        size_t in_use = 0;
        for (const auto &b : live) in_use += b.second.bytes;
        error_at(__FILE__, __func__, __LINE__,
                 "out of device memory: %zu bytes for %s (%zu bytes in use); lower train.batch or "
                 "model.context, or set train.recompute = true",
                 bytes, mem_label_name(label), in_use);
      }
    }
    if (pooling() && sz > kSmallMax) {  // a new segment, in use whole
      Piece *b = new Piece{static_cast<char *>(p), sz, true, nullptr, nullptr, segments++};
      pieces[p] = b;
    }
    grew = true;
  }
  live[p] = Block{sz, label};
  live_bytes += sz;
  if (trace) std::fprintf(trace, "a %zu %s %p %zu %d\n", bytes, mem_label_name(label), p, sz, grew);
  if (live_bytes > live_peak) live_peak = live_bytes;
  if (grew) outside_check();
  gpu_count_pool(live_bytes, cached_bytes);
  mem_device_account(label, (long long)sz);
  return p;
}

extern "C" void *gpu_alloc_zero(enum mem_label label, size_t bytes) {
  void *p = gpu_alloc(label, bytes);
  CUDA_CHECK(cudaMemsetAsync(p, 0, bytes ? bytes : 1, gpu_stream()));
  return p;
}

extern "C" void gpu_free(void *dev) {
  if (!dev) return;
  auto it = live.find(dev);
  if (it == live.end())
    error_at(__FILE__, __func__, __LINE__, "gpu_free of %p, which gpu_alloc did not give", dev);
  const Block b = it->second;
  live.erase(it);
  if (trace) std::fprintf(trace, "f %p\n", dev);
  live_bytes -= b.bytes;
  mem_device_account(b.label, -(long long)b.bytes);
  // work queued on the stream finishes before the block's next use is queued
  if (pooling() && b.bytes > kSmallMax) {
    give_large(pieces.at(dev));
  } else if (pooling()) {
    cached.emplace(b.bytes, dev);
    cached_bytes += b.bytes;
  } else {
    CUDA_CHECK(cudaFree(dev));
  }
  gpu_count_pool(live_bytes, cached_bytes);
}

extern "C" void gpu_pool_trace_mark(const char *what) {
  if (trace) {
    std::fprintf(trace, "m %s\n", what);
    std::fflush(trace);  // what a run that ends in error wrote is there
  }
}

extern "C" void gpu_pool_set_reserve(size_t bytes) { reserve = bytes; }

extern "C" void gpu_pool_set_outside_probe(long mib) { outside_mib = mib; }

extern "C" void gpu_release_cache(void) {
  // the segments wholly free (one free piece: no neighbour), and the small blocks
  std::vector<Piece *> whole;
  for (const auto &f : free_large) {
    Piece *b = pieces.at(std::get<2>(f));
    if (!b->prev && !b->next) whole.push_back(b);
  }
  if (cached.empty() && whole.empty()) return;
  if (trace) std::fprintf(trace, "r\n");
  CUDA_CHECK(gpu_stream_wait());
  for (auto &c : cached) CUDA_CHECK(cudaFree(c.second));
  cached.clear();
  cached_bytes = 0;
  for (Piece *b : whole) {
    free_erase(b);
    pieces.erase(b->p);
    CUDA_CHECK(cudaFree(b->p));
    delete b;
  }
  for (const auto &f : free_large) cached_bytes += std::get<1>(f);
  gpu_count_pool(live_bytes, cached_bytes);
}

extern "C" void gpu_upload(void *dev, const void *host, size_t bytes) {
  if (bytes) CUDA_CHECK(cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, gpu_stream()));
}

extern "C" void gpu_download(void *host, const void *dev, size_t bytes) {
  // a copy to pageable memory waits for the stream inside cudaMemcpyAsync, where no watchdog
  // looks: the work before it (NCCL's among it) is waited for first
  CUDA_CHECK(gpu_stream_wait());
  if (bytes) CUDA_CHECK(cudaMemcpyAsync(host, dev, bytes, cudaMemcpyDeviceToHost, gpu_stream()));
  CUDA_CHECK(gpu_stream_wait());
  gpu_op_flush();
}

extern "C" void gpu_copy(void *dst, const void *src, size_t bytes) {
  if (bytes && dst != src)
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, gpu_stream()));
}

extern "C" void gpu_memset0(void *dev, size_t bytes) {
  if (bytes) CUDA_CHECK(cudaMemsetAsync(dev, 0, bytes, gpu_stream()));
}

extern "C" void gpu_sync(void) {
  CUDA_CHECK(gpu_stream_wait());
  gpu_op_flush();
}

extern "C" void gpu_copy_rows(float *dst, size_t dst_stride, const float *src, size_t src_stride,
                              size_t nrows, size_t len) {
  if (nrows == 1 || (dst_stride == len && src_stride == len))
    gpu_copy(dst, src, sizeof(float) * nrows * len);
  else
    rows(dst, dst_stride, src, src_stride, nrows, len, false);
}

extern "C" void gpu_add_rows(float *dst, size_t dst_stride, const float *src, size_t src_stride,
                             size_t nrows, size_t len) {
  rows(dst, dst_stride, src, src_stride, nrows, len, true);
}
