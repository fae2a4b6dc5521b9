// Streams and events. Immediate mode runs device work when it is queued; deferred mode
// (CUDAEMU_DEFER) queues it per stream and runs it only at synchronisation points, draining the
// stream given work last first (or a seeded order) to expose missing cross-stream ordering, while
// honouring cudaStreamWaitEvent and the legacy default stream's implicit ordering. It must never
// run work earlier than a GPU could, nor reorder work within one stream.
#include <algorithm>
#include <chrono>
#include <deque>
#include <vector>

#include "core.h"

struct CUstream_st;
struct CUevent_st;

namespace cudaemu {
namespace {

struct dependency {
  CUstream_st *stream;
  uint64_t seq;  // that stream's work up to this task must have run
};

struct task {
  uint64_t seq;
  std::string what;
  std::function<void()> work;
  std::vector<dependency> deps;
  const void *hang = nullptr;  // submit_hang: never runs until release_hangs(hang)
};

}  // namespace
}  // namespace cudaemu

struct CUstream_st {
  bool blocking = true;  // synchronises with the legacy default stream
  bool destroyed = false;
  uint64_t last = 0, done = 0;  // sequence numbers of the last queued and last run task
  std::deque<cudaemu::task> queue;
};

struct CUevent_st {
  unsigned flags = 0;
  bool recorded = false, done = false, destroyed = false;
  CUstream_st *stream = nullptr;
  uint64_t seq = 0;
  double ms = 0;  // emulated time when it ran
};

namespace cudaemu {
namespace {

CUstream_st legacy;
std::vector<CUstream_st *> streams;  // created and not destroyed
uint64_t next_seq = 0;
uint64_t drain_rng = 0;

bool deferred() { return config().defer != defer_kind::immediate; }

double now_ms() {
  using namespace std::chrono;
  static const auto t0 = steady_clock::now();
  return duration<double, std::milli>(steady_clock::now() - t0).count();
}

CUstream_st *resolve(cudaStream_t s) {
  if (s == nullptr || s == cudaStreamLegacy || s == cudaStreamPerThread) return &legacy;
  return s;
}

void run_task(task &t) {
  if (sticky_error() != cudaSuccess) return;  // after a fault nothing more runs
  device_enter();
  set_activity(t.what);
  t.work();
  set_activity("");
  device_exit();
}

// Run s's queued tasks up to sequence number `upto`, first what each of them waits for; whether
// it got there. A task that never completes (submit_hang) stops the drain: a query (wait false)
// leaves the rest queued, a wait ends the run, as the GPU's would never return.
bool drain_to(CUstream_st *s, uint64_t upto, bool wait = true) {
  bool reached = true;
  device_enter();  // once for the whole drain, not per task
  while (reached && !s->queue.empty() && s->queue.front().seq <= upto) {
    const task &next = s->queue.front();
    if (next.hang) {
      if (wait)
        fatal(
            "a wait for the device met %s, which never completes (CUDAEMU_NCCL_HANG): on a GPU "
            "this call would never return",
            next.what.c_str());
      reached = false;
      break;
    }
    for (const dependency &d : next.deps)
      if (d.stream->done < d.seq && !drain_to(d.stream, d.seq, wait)) reached = false;
    if (!reached) break;
    task t = std::move(s->queue.front());
    s->queue.pop_front();
    run_task(t);
    s->done = t.seq;
  }
  device_exit();
  return reached;
}

uint64_t splitmix(uint64_t *x) {
  uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// The legacy default stream waits for the blocking streams' queued work, and they for its.
std::vector<dependency> implicit_deps(CUstream_st *s) {
  std::vector<dependency> deps;
  if (s == &legacy) {
    for (CUstream_st *b : streams)
      if (b->blocking && b->done < b->last) deps.push_back({b, b->last});
  } else if (s->blocking && legacy.done < legacy.last) {
    deps.push_back({&legacy, legacy.last});
  }
  return deps;
}

}  // namespace

bool valid_stream(cudaStream_t s) {
  CUstream_st *r = resolve(s);
  return r == &legacy || std::find(streams.begin(), streams.end(), r) != streams.end();
}

void submit(cudaStream_t handle, const char *what, std::function<void()> work) {
  CUstream_st *s = resolve(handle);
  trace("%s on stream %p%s", what, (void *)s, deferred() ? " (deferred)" : "");
  if (!deferred()) {
    task t{0, what, std::move(work), {}};
    run_task(t);
    return;
  }
  task t{++next_seq, what, std::move(work), implicit_deps(s)};
  s->last = t.seq;
  s->queue.push_back(std::move(t));
}

void submit_hang(cudaStream_t handle, const char *what, const void *owner) {
  CUstream_st *s = resolve(handle);
  trace("%s on stream %p never completes (CUDAEMU_NCCL_HANG)", what, (void *)s);
  task t{++next_seq, what, [] {}, implicit_deps(s), owner};
  s->last = t.seq;
  s->queue.push_back(std::move(t));
}

void release_hangs(const void *owner) {
  std::vector<CUstream_st *> all(streams);
  all.push_back(&legacy);
  for (CUstream_st *s : all)
    for (task &t : s->queue)
      if (t.hang == owner) t.hang = nullptr;  // its work does nothing
}

void drain_stream(cudaStream_t s) {
  CUstream_st *r = resolve(s);
  // waiting for the legacy default stream waits for the blocking streams' work before it too
  if (r == &legacy)
    for (const dependency &d : implicit_deps(r)) drain_to(d.stream, d.seq);
  drain_to(r, r->last);
}

void drain_all() {
  std::vector<CUstream_st *> order(streams);
  order.push_back(&legacy);
  if (config().defer == defer_kind::shuffle) {
    if (!drain_rng) drain_rng = config().defer_seed * 0x9e3779b97f4a7c15ull + 1;
    for (size_t i = order.size(); i > 1; i--)
      std::swap(order[i - 1], order[splitmix(&drain_rng) % i]);
  } else {
    // the stream given work last runs first: work queued later elsewhere, that should have
    // waited for it, runs before it
    std::stable_sort(order.begin(), order.end(),
                     [](CUstream_st *a, CUstream_st *b) { return a->last > b->last; });
  }
  for (CUstream_st *s : order) drain_to(s, s->last);
}

// Queue a marker on s that waits for nothing and does nothing: its sequence number is where an
// event recorded now stands, or a point to drain to.
static uint64_t mark(CUstream_st *s, std::vector<dependency> deps, std::function<void()> work) {
  for (const dependency &d : implicit_deps(s)) deps.push_back(d);
  task t{++next_seq, "event", std::move(work), std::move(deps)};
  s->last = t.seq;
  s->queue.push_back(std::move(t));
  return s->last;
}

}  // namespace cudaemu

using namespace cudaemu;

extern "C" {

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *stream, unsigned int flags) {
  if (!stream || (flags & ~1u))
    return fail(cudaErrorInvalidValue, "cudaStreamCreateWithFlags: bad arguments");
  CUstream_st *s = new CUstream_st;
  s->blocking = !(flags & cudaStreamNonBlocking);
  streams.push_back(s);
  *stream = s;
  return cudaSuccess;
}

cudaError_t cudaStreamCreate(cudaStream_t *stream) {
  return cudaStreamCreateWithFlags(stream, cudaStreamDefault);
}

cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  CUstream_st *s = resolve(stream);
  if (s == &legacy || !valid_stream(stream))
    return fail(cudaErrorInvalidResourceHandle, "cudaStreamDestroy(%p): no such stream",
                (void *)stream);
  drain_to(s, s->last);  // queued work still runs, as on the GPU
  s->destroyed = true;   // kept: tasks elsewhere may name it in a dependency
  streams.erase(std::find(streams.begin(), streams.end(), s));
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  if (!valid_stream(stream))
    return fail(cudaErrorInvalidResourceHandle, "cudaStreamSynchronize(%p): no such stream",
                (void *)stream);
  drain_stream(stream);
  return sticky_error();
}

cudaError_t cudaStreamQuery(cudaStream_t stream) {
  if (!valid_stream(stream))
    return fail(cudaErrorInvalidResourceHandle, "cudaStreamQuery(%p): no such stream",
                (void *)stream);
  CUstream_st *s = resolve(stream);
  if (s->done >= s->last) return cudaSuccess;
  drain_to(s, s->last, false);  // not ready now; it will be when asked again (unless it hangs)
  return cudaErrorNotReady;
}

cudaError_t cudaDeviceSynchronize(void) {
  drain_all();
  return sticky_error();
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t *event, unsigned int flags) {
  if (!event || (flags & ~7u))
    return fail(cudaErrorInvalidValue, "cudaEventCreateWithFlags: bad arguments");
  *event = new CUevent_st;
  (*event)->flags = flags;
  return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t *event) {
  return cudaEventCreateWithFlags(event, cudaEventDefault);
}

cudaError_t cudaEventDestroy(cudaEvent_t event) {
  if (!event || event->destroyed)
    return fail(cudaErrorInvalidResourceHandle, "cudaEventDestroy: no such event");
  event->destroyed = true;  // kept: a queued record may still write it
  return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  if (!event || event->destroyed)
    return fail(cudaErrorInvalidResourceHandle, "cudaEventRecord: no such event");
  if (!valid_stream(stream))
    return fail(cudaErrorInvalidResourceHandle, "cudaEventRecord: no such stream %p",
                (void *)stream);
  CUstream_st *s = resolve(stream);
  event->recorded = true;
  event->stream = s;
  if (!deferred()) {
    event->done = true;
    event->ms = now_ms();
    return cudaSuccess;
  }
  event->done = false;
  event->seq = mark(s, {}, [event] {
    event->done = true;
    event->ms = now_ms();
  });
  return cudaSuccess;
}

cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags) {
  if (!event || event->destroyed || !valid_stream(stream))
    return fail(cudaErrorInvalidResourceHandle, "cudaStreamWaitEvent: no such stream or event");
  if (flags) return fail(cudaErrorInvalidValue, "cudaStreamWaitEvent: flags must be 0");
  if (!deferred() || !event->recorded || event->done) return cudaSuccess;
  mark(resolve(stream), {{event->stream, event->seq}}, [] {});
  return cudaSuccess;
}

cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  if (!event || event->destroyed)
    return fail(cudaErrorInvalidResourceHandle, "cudaEventSynchronize: no such event");
  if (event->recorded && !event->done) drain_to(event->stream, event->seq);
  return sticky_error();
}

cudaError_t cudaEventQuery(cudaEvent_t event) {
  if (!event || event->destroyed)
    return fail(cudaErrorInvalidResourceHandle, "cudaEventQuery: no such event");
  if (!event->recorded || event->done) return cudaSuccess;
  drain_to(event->stream, event->seq, false);  // not ready now; it will be when asked again
  return cudaErrorNotReady;
}

cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end) {
  if (!ms || !start || !end || start->destroyed || end->destroyed)
    return fail(cudaErrorInvalidResourceHandle, "cudaEventElapsedTime: no such event");
  if ((start->flags | end->flags) & cudaEventDisableTiming)
    return fail(cudaErrorInvalidResourceHandle,
                "cudaEventElapsedTime: an event was created with cudaEventDisableTiming");
  if (!start->recorded || !end->recorded)
    return fail(cudaErrorInvalidResourceHandle,
                "cudaEventElapsedTime: an event was never recorded");
  if (!start->done || !end->done) return cudaErrorNotReady;
  *ms = (float)(end->ms - start->ms);
  return cudaSuccess;
}

}  // extern "C"
