// The block scheduler: every CUDA thread of a block is a coroutine run in the chosen order
// (index, reversed, seeded shuffle) until it exits or waits at __syncthreads or at a _sync warp
// primitive; blocks run one after another. Divergent barriers, warp masks naming lanes that
// never arrive and deadlocks end the run with a message naming kernel, block and threads; it
// must never guess a result a GPU would not produce.
#include <csetjmp>

#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <deque>
#include <numeric>
#include <string>
#include <vector>

#include "core.h"
#include "scheduler.h"

namespace cudaemu {

uint3 g_threadIdx, g_blockIdx;
dim3 g_blockDim, g_gridDim;
unsigned long long g_block_serial = 0;

namespace {

enum class tstate { runnable, barrier, warp, exited };

struct thread_rec {
  context ctx;
  uint3 idx;
  int tid;  // linear index in the block
  tstate state;
  const char *file;  // where it waits
  int line;
  warp_kind wkind;
  unsigned wmask;
  int warg, wwidth;
  uint64_t wvalue, wresult;
  int bkind, bpred, bresult;
};

struct block_state {
  const kernel_run *k = nullptr;
  const char *pretty = nullptr;  // the kernel's __PRETTY_FUNCTION__, once a thread ran
  std::vector<thread_rec> threads;
  int n = 0, at_barrier = 0, exited = 0;
  std::deque<int> queue;
  context sched;
  thread_rec *cur = nullptr;
  uint64_t rng = 0;
};
block_state B;

uint64_t splitmix(uint64_t *s) {
  uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Append `ids` to the run queue in the configured order (a fresh shuffle every time).
void enqueue(std::vector<int> &ids) {
  switch (config().order) {
    case order_kind::index:
      std::sort(ids.begin(), ids.end());
      break;
    case order_kind::reverse:
      std::sort(ids.begin(), ids.end(), [](int a, int b) { return a > b; });
      break;
    case order_kind::shuffle:
      for (size_t i = ids.size(); i > 1; i--) std::swap(ids[i - 1], ids[splitmix(&B.rng) % i]);
      break;
  }
  for (int t : ids) {
    B.threads[(size_t)t].state = tstate::runnable;
    B.queue.push_back(t);
  }
}

[[noreturn]] void thread_fatal(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void thread_fatal(const char *fmt, ...) {
  char msg[2048];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  fatal("%s in %s", msg, kernel_label().c_str());
}

std::string site(const char *file, int line) {
  const char *slash = file ? strrchr(file, '/') : nullptr;
  return std::string(slash ? slash + 1 : (file ? file : "?")) + ":" + std::to_string(line);
}

// Who waits where, grouped: "threads 0-31 at attention.cu:88; threads 32-63 exited".
std::string who_waits() {
  std::vector<std::pair<std::string, std::vector<int>>> groups;
  for (int i = 0; i < B.n; i++) {
    const thread_rec &t = B.threads[(size_t)i];
    std::string where;
    switch (t.state) {
      case tstate::exited:
        where = "exited";
        break;
      case tstate::barrier:
        where = "at __syncthreads " + site(t.file, t.line);
        break;
      case tstate::warp:
        where = "at a warp primitive " + site(t.file, t.line);
        break;
      case tstate::runnable:
        where = "runnable";
        break;
    }
    auto g = std::find_if(groups.begin(), groups.end(), [&](auto &p) { return p.first == where; });
    if (g == groups.end())
      groups.push_back({where, {t.tid}});
    else
      g->second.push_back(t.tid);
  }
  std::string s;
  for (auto &g : groups) {
    const bool one = g.second.size() == 1;
    const char *verb = g.first == "exited" ? "" : one ? "is " : "are ";
    s += std::string(s.empty() ? "" : "; ") + (one ? "thread " : "threads ") + ranges(g.second) +
         " " + verb + g.first;
  }
  return s;
}

void yield() { context_switch(&B.cur->ctx, &B.sched); }

void thread_entry() {
  B.k->body();
  thread_rec &t = *B.cur;
  t.state = tstate::exited;
  B.exited++;
  if (B.at_barrier > 0)
    thread_fatal("divergent barrier: thread %d exited while others wait at __syncthreads (%s)",
                 t.tid, who_waits().c_str());
  const int base = t.tid / 32 * 32, lane = t.tid % 32;
  for (int l = 0; l < 32 && base + l < B.n; l++) {
    const thread_rec &o = B.threads[(size_t)(base + l)];
    if (o.state == tstate::warp && (o.wmask >> lane & 1u))
      thread_fatal("warp primitive at %s: lane %d of mask 0x%08x exited without arriving (%s)",
                   site(o.file, o.line).c_str(), lane, o.wmask, who_waits().c_str());
  }
  yield();
  fatal("an exited CUDA thread was resumed");  // the scheduler never does this
}

void release_barrier() {
  const thread_rec &t0 = B.threads[0];
  int count = 0;
  for (int t = 0; t < B.n; t++) {
    const thread_rec &t1 = B.threads[(size_t)t];
    if (t1.line != t0.line || strcmp(t1.file, t0.file) != 0 || t1.bkind != t0.bkind)
      thread_fatal("divergent barrier: threads wait at different __syncthreads (%s)",
                   who_waits().c_str());
    count += t1.bpred != 0;
  }
  std::vector<int> ids((size_t)B.n);
  for (int t = 0; t < B.n; t++) {
    thread_rec &t1 = B.threads[(size_t)t];
    t1.bresult = t0.bkind == 1 ? count : t0.bkind == 2 ? count == B.n : count > 0;
    ids[(size_t)t] = t;
  }
  B.at_barrier = 0;
  enqueue(ids);
}

thread_rec &current(const char *what) {
  if (!B.cur) fatal("%s called outside a kernel", what);
  return *B.cur;
}

}  // namespace

std::string kernel_label() {
  if (!B.k) return "no kernel";
  char buf[1024];
  std::string s = "kernel " + std::string(B.pretty ? B.pretty : B.k->site.name);
  snprintf(buf, sizeof buf, " (launched at %s), block (%u,%u,%u)",
           site(B.k->site.file, B.k->site.line).c_str(), g_blockIdx.x, g_blockIdx.y, g_blockIdx.z);
  s += buf;
  if (B.cur) {
    snprintf(buf, sizeof buf, ", thread (%u,%u,%u)", B.cur->idx.x, B.cur->idx.y, B.cur->idx.z);
    s += buf;
  }
  return s;
}

void kernel_entry(const char *pretty) {
  if (!B.pretty) B.pretty = pretty;
}

int block_barrier(int kind, int pred, const char *file, int line) {
  thread_rec &t = current("__syncthreads");
  t.state = tstate::barrier;
  t.file = file;
  t.line = line;
  t.bkind = kind;
  t.bpred = pred;
  B.at_barrier++;
  if (B.exited > 0)
    thread_fatal(
        "divergent barrier: thread %d reached __syncthreads at %s after others exited (%s)", t.tid,
        site(file, line).c_str(), who_waits().c_str());
  if (B.at_barrier == B.n) release_barrier();
  yield();
  return t.bresult;
}

namespace {

// The result for `lane` of a complete warp operation of the lanes of `mask` from warp `base`.
uint64_t warp_result(int base, int lane, unsigned mask) {
  const thread_rec &t = B.threads[(size_t)(base + lane)];
  const int w = t.wwidth, seg = lane & ~(w - 1);
  auto value_of = [&](int src) -> uint64_t {
    if (!(mask >> src & 1u)) return ~0ull;  // an inactive source lane: undefined, so poison
    return B.threads[(size_t)(base + src)].wvalue;
  };
  uint64_t acc = 0;
  switch (t.wkind) {
    case warp_kind::shfl:
      return value_of(seg + (t.warg & (w - 1)));
    case warp_kind::shfl_up:
      return lane - t.warg >= seg ? value_of(lane - t.warg) : t.wvalue;
    case warp_kind::shfl_down:
      return lane + t.warg < seg + w ? value_of(lane + t.warg) : t.wvalue;
    case warp_kind::shfl_xor: {
      const int src = lane ^ t.warg;
      return src >= seg && src < seg + w ? value_of(src) : t.wvalue;
    }
    case warp_kind::syncwarp:
      return 0;
    default:
      break;
  }
  bool first = true;
  for (int l = 0; l < 32; l++) {
    if (!(mask >> l & 1u)) continue;
    const uint64_t v = B.threads[(size_t)(base + l)].wvalue;
    const int32_t iv = (int32_t)(uint32_t)v, ia = (int32_t)(uint32_t)acc;
    switch (t.wkind) {
      case warp_kind::ballot:
        acc |= v ? 1ull << l : 0;
        break;
      case warp_kind::any:
        acc |= v != 0;
        break;
      case warp_kind::all:
        acc = (first || acc) && v != 0;
        break;
      case warp_kind::reduce_add_u:
      case warp_kind::reduce_add_i:
        acc = (uint32_t)(acc + v);
        break;
      case warp_kind::reduce_min_u:
        acc = first || v < acc ? v : acc;
        break;
      case warp_kind::reduce_max_u:
        acc = first || v > acc ? v : acc;
        break;
      case warp_kind::reduce_min_i:
        acc = first || iv < ia ? v : acc;
        break;
      case warp_kind::reduce_max_i:
        acc = first || iv > ia ? v : acc;
        break;
      case warp_kind::reduce_and:
        acc = first ? v : (acc & v);
        break;
      case warp_kind::reduce_or:
        acc |= v;
        break;
      case warp_kind::reduce_xor:
        acc ^= v;
        break;
      default:
        break;
    }
    first = false;
  }
  return acc;
}

void resolve_warp(int base, unsigned mask) {
  std::vector<int> ids;
  for (int l = 0; l < 32; l++)
    if (mask >> l & 1u) ids.push_back(base + l);
  for (int t : ids) B.threads[(size_t)t].wresult = warp_result(base, t - base, mask);
  enqueue(ids);
}

}  // namespace

uint64_t warp_sync_op(warp_kind kind, unsigned mask, uint64_t value, int arg, int width,
                      const char *file, int line) {
  thread_rec &t = current("a warp primitive");
  const int base = t.tid / 32 * 32, lane = t.tid % 32, lanes = std::min(32, B.n - base);
  if (!(mask >> lane & 1u))
    thread_fatal("warp primitive at %s: the calling lane %d is not in its mask 0x%08x",
                 site(file, line).c_str(), lane, mask);
  if (lanes < 32 && (mask >> lanes) != 0)
    thread_fatal(
        "warp primitive at %s: mask 0x%08x names lanes %d-31, which this block of %d "
        "threads does not have",
        site(file, line).c_str(), mask, lanes, B.n);
  if (width < 1 || width > 32 || (width & (width - 1)))
    thread_fatal("warp shuffle at %s: width %d is not a power of two in [1, 32]",
                 site(file, line).c_str(), width);
  t.state = tstate::warp;
  t.file = file;
  t.line = line;
  t.wkind = kind;
  t.wmask = mask;
  t.wvalue = value;
  t.warg = arg;
  t.wwidth = width;
  bool complete = true;
  for (int l = 0; l < 32; l++) {
    if (!(mask >> l & 1u)) continue;
    const thread_rec &o = B.threads[(size_t)(base + l)];
    if (o.state == tstate::exited)
      thread_fatal("warp primitive at %s: lane %d of mask 0x%08x has exited (%s)",
                   site(file, line).c_str(), l, mask, who_waits().c_str());
    // a lane waiting at another warp operation (of another mask) is not part of this one yet:
    // if it never comes, the block ends in a deadlock report naming both
    complete = complete && o.state == tstate::warp && o.wkind == kind && o.wmask == mask &&
               o.wwidth == width;
  }
  if (complete) resolve_warp(base, mask);
  yield();
  return t.wresult;
}

namespace {

void run_block(int n) {
  B.n = n;
  B.at_barrier = B.exited = 0;
  B.queue.clear();
  std::vector<int> ids((size_t)n);
  for (int t = 0; t < n; t++) {
    thread_rec &r = B.threads[(size_t)t];
    r.tid = t;
    r.idx =
        uint3{t % g_blockDim.x, t / g_blockDim.x % g_blockDim.y, t / (g_blockDim.x * g_blockDim.y)};
    r.file = nullptr;
    r.line = 0;
    context_init(&r.ctx, t, thread_entry);
    ids[(size_t)t] = t;
  }
  enqueue(ids);
  while (!B.queue.empty()) {
    const int t = B.queue.front();
    B.queue.pop_front();
    B.cur = &B.threads[(size_t)t];
    g_threadIdx = B.cur->idx;
    context_switch(&B.sched, &B.cur->ctx);
  }
  B.cur = nullptr;
  if (B.exited != n) thread_fatal("deadlock: %s", who_waits().c_str());
}

// Block number i of the launch order: index (x fastest), reversed, or an affine permutation
// i -> (a·i + c) mod total with gcd(a, total) = 1, which needs no table for huge grids.
struct block_order {
  uint64_t total, a = 1, c = 0;
  bool reverse = false;
  explicit block_order(uint64_t n) : total(n) {
    if (config().order == order_kind::reverse) reverse = true;
    if (config().order != order_kind::shuffle || n < 2) return;
    uint64_t s = B.rng;
    a = splitmix(&s) % n | 1;
    while (std::gcd(a, n) != 1) a += 2;
    c = splitmix(&s) % n;
  }
  uint64_t operator()(uint64_t i) const {
    if (reverse) return total - 1 - i;
    return (uint64_t)(((unsigned __int128)a * i + c) % total);
  }
};

}  // namespace

static sigjmp_buf escape_point;  // CUDAEMU_FAULTS=sticky: where a faulting kernel is left
static bool escape_armed = false;

void run_kernel(const kernel_run &k) {
  if (config().sticky_faults) {
    if (sigsetjmp(escape_point, 1)) {  // the kernel faulted (device_fault): it ends here
      escape_armed = false;
      B.k = nullptr;
      return;
    }
    escape_armed = true;
  }
  B.k = &k;
  B.pretty = nullptr;
  // a fresh stream of shuffles for every launch, reproducible from the seed
  static uint64_t launches = 0;
  uint64_t mix = config().seed * 0x2545f4914f6cdd1dull + ++launches;
  B.rng = splitmix(&mix);
  g_gridDim = k.grid;
  g_blockDim = k.block;
  const int n = (int)(k.block.x * k.block.y * k.block.z);
  if (B.threads.size() < (size_t)n) B.threads.resize((size_t)n);
  shared_begin_launch(k);
  const uint64_t gx = k.grid.x, gy = k.grid.y, total = gx * gy * k.grid.z;
  const block_order order(total);
  for (uint64_t i = 0; i < total; i++) {
    const uint64_t b = order(i);
    g_blockIdx = uint3{(unsigned)(b % gx), (unsigned)(b / gx % gy), (unsigned)(b / (gx * gy))};
    g_block_serial++;
    run_block(n);
  }
  shared_end_launch(k);
  B.k = nullptr;
  escape_armed = false;
}

bool kernel_running() { return B.k != nullptr; }

bool escape_kernel() {
  if (!escape_armed || !B.k) return false;
  escape_armed = false;
  siglongjmp(escape_point, 1);
}

}  // namespace cudaemu
