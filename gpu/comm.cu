// The NCCL transport of the communicator, the twin of src/parallel/comm.c's MPI one: the bulk float
// traffic of a run on GPUs (the gradient allreduce, halos, the ring, the locally essential tree) on
// device buffers, one NCCL communicator per scope (unique ids broadcast over MPI), queued on the
// back end's stream, bytes counted as comm.c counts MPI's. Host scalars stay on MPI (comm.c).
#include <time.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

#include <mpi.h>

#include "check.h"
#include "gpu.h"
#include "parallel/comm.h"

namespace {

// ------------------------------------------------------------------------------------------------
// the watchdog: each NCCL operation between two events, its start seen by the host's waits

const char *const scope_names[] = {"world", "sequence", "data"};

struct inflight {
  cudaEvent_t start, end;
  const char *what;
  enum comm_scope scope;
  size_t bytes;
  double started;  // when a wait first saw it start (monotonic seconds), or < 0
};

double timeout_s = kDefaultNcclTimeout;
std::vector<inflight> flight;    // in stream order
std::vector<cudaEvent_t> spare;  // events to reuse
std::vector<ncclComm_t> live;    // every communicator open, for the abort

double now_s() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

cudaEvent_t event_get() {
  if (spare.empty()) {
    cudaEvent_t e;
    CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    return e;
  }
  cudaEvent_t e = spare.back();
  spare.pop_back();
  return e;
}

void retire_front() {
  spare.push_back(flight.front().start);
  spare.push_back(flight.front().end);
  flight.erase(flight.begin());
}

// The NCCL calls of one operation (one call, or one group) between its two events; without a
// watchdog (gpu.nccl_timeout = 0) nothing is recorded.
class watched {
 public:
  watched(const char *what, enum comm_scope scope, size_t bytes) {
    if (timeout_s <= 0.0) return;
    while (!flight.empty() && cudaEventQuery(flight.front().end) == cudaSuccess) retire_front();
    rec_ = inflight{event_get(), event_get(), what, scope, bytes, -1.0};
    CUDA_CHECK(cudaEventRecord(rec_.start, gpu_stream()));
  }
  ~watched() {
    if (!rec_.end) return;
    CUDA_CHECK(cudaEventRecord(rec_.end, gpu_stream()));
    flight.push_back(rec_);
  }
  watched(const watched &) = delete;
  watched &operator=(const watched &) = delete;

 private:
  inflight rec_ = {};
};

[[noreturn]] void abort_all(const char *file, const char *func, int line, const char *why) {
  for (ncclComm_t c : live) (void)ncclCommAbort(c);
  live.clear();
  error_at(file, func, line, "%s; its NCCL communicators were aborted", why);
}

// One look at what is in flight: ends the job on an NCCL error or an operation over its time.
void watch() {
  for (ncclComm_t c : live) {
    ncclResult_t r = ncclSuccess;
    if (ncclCommGetAsyncError(c, &r) == ncclSuccess && r != ncclSuccess && r != ncclInProgress) {
      char why[512];
      snprintf(why, sizeof why, "NCCL reported an error while operations were in flight: %s (%s)",
               ncclGetErrorString(r), ncclGetLastError(c));
      abort_all(__FILE__, __func__, __LINE__, why);
    }
  }
  while (!flight.empty() && cudaEventQuery(flight.front().end) == cudaSuccess) retire_front();
  if (flight.empty()) return;
  inflight &f = flight.front();
  const double t = now_s();
  if (f.started < 0.0) {
    if (cudaEventQuery(f.start) == cudaSuccess) f.started = t;
    return;
  }
  if (t - f.started > timeout_s) {
    char why[512];
    snprintf(why, sizeof why,
             "%s of %.3g MB over the %s ranks did not complete within %g s of starting: a peer "
             "rank has stopped, died or cannot be reached (gpu.nccl_timeout sets the limit)",
             f.what, (double)f.bytes / 1e6, scope_names[f.scope], timeout_s);
    abort_all(__FILE__, __func__, __LINE__, why);
  }
}

}  // namespace

void gpu_set_nccl_timeout(double seconds) { timeout_s = seconds; }

cudaError_t gpu_stream_wait(void) {
  if (flight.empty()) return cudaStreamSynchronize(gpu_stream());
  for (long polls = 0;; polls++) {
    const cudaError_t e = cudaStreamQuery(gpu_stream());
    if (e != cudaErrorNotReady) {
      while (!flight.empty()) retire_front();
      return e;
    }
    watch();
    // 0.1 ms between looks for the first 10 ms, then 1 ms
    const timespec pause = {0, polls < 100 ? 100000L : 1000000L};
    nanosleep(&pause, nullptr);
  }
}

namespace {

struct nccl_state {
  ncclComm_t comm[3];  // by enum comm_scope: world, seq, data (null when the scope is one rank)
  int size[3], rank[3];
};

nccl_state *state(const struct comm *c) { return static_cast<nccl_state *>(c->transport_state); }

ncclComm_t nccl_of(struct comm *c, enum comm_scope scope, int *size) {
  *size = state(c)->size[scope];
  return state(c)->comm[scope];
}

void open_scope(nccl_state *st, enum comm_scope scope, MPI_Comm m) {
  MPI_Comm_size(m, &st->size[scope]);
  MPI_Comm_rank(m, &st->rank[scope]);
  st->comm[scope] = nullptr;
  if (st->size[scope] == 1) return;
  ncclUniqueId id;
  if (st->rank[scope] == 0) NCCL_CHECK(ncclGetUniqueId(&id));
  MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, m);
  NCCL_CHECK(ncclCommInitRank(&st->comm[scope], st->size[scope], id, st->rank[scope]));
  live.push_back(st->comm[scope]);
  // one collective now, so NCCL's buffers exist before the step's memory peak rather than being
  // allocated inside it (where the first allreduce could meet a full device)
  float *one = static_cast<float *>(gpu_alloc_zero(MEM_WORKSPACE, sizeof(float)));
  {
    const watched w("the start-up allreduce", scope, sizeof(float));
    NCCL_CHECK(ncclAllReduce(one, one, 1, ncclFloat, ncclSum, st->comm[scope], gpu_stream()));
  }
  CUDA_CHECK(gpu_stream_wait());
  gpu_free(one);
}

void allreduce_sum_float(struct comm *c, enum comm_scope scope, float *buf, size_t count) {
  int size;
  ncclComm_t nc = nccl_of(c, scope, &size);
  if (size == 1 || count == 0) return;
  const watched w("an allreduce", scope, count * sizeof(float));
  NCCL_CHECK(ncclAllReduce(buf, buf, count, ncclFloat32, ncclSum, nc, gpu_stream()));
  c->bytes_sent += (uint64_t)(2.0 * (size - 1) / size * (double)(count * sizeof(float)));
}

void allgather_float(struct comm *c, enum comm_scope scope, const float *send, size_t count,
                     float *recv) {
  int size;
  ncclComm_t nc = nccl_of(c, scope, &size);
  if (size == 1) {
    gpu_copy(recv, send, sizeof(float) * count);
    return;
  }
  const watched w("an allgather", scope, count * sizeof(float) * (size_t)size);
  NCCL_CHECK(ncclAllGather(send, recv, count, ncclFloat32, nc, gpu_stream()));
  c->bytes_sent += (uint64_t)(size - 1) * count * sizeof(float);
}

void sendrecv_float(struct comm *c, const float *send, size_t count, int dest, float *recv,
                    size_t rcount, int src, int tag) {
  int size;
  ncclComm_t nc = nccl_of(c, COMM_SEQ, &size);
  (void)tag;  // NCCL orders messages between a pair of ranks; there are no tags
  const watched w(
      "a send and receive", COMM_SEQ,
      sizeof(float) * ((dest != MPI_PROC_NULL ? count : 0) + (src != MPI_PROC_NULL ? rcount : 0)));
  NCCL_CHECK(ncclGroupStart());
  if (dest != MPI_PROC_NULL && count)
    NCCL_CHECK(ncclSend(send, count, ncclFloat32, dest, nc, gpu_stream()));
  if (src != MPI_PROC_NULL && rcount)
    NCCL_CHECK(ncclRecv(recv, rcount, ncclFloat32, src, nc, gpu_stream()));
  NCCL_CHECK(ncclGroupEnd());
  if (dest != MPI_PROC_NULL) c->bytes_sent += count * sizeof(float);
}

void alltoallv_float(struct comm *c, const float *send, const size_t *scount, const size_t *sdispl,
                     float *recv, const size_t *rcount, const size_t *rdispl) {
  int size;
  ncclComm_t nc = nccl_of(c, COMM_SEQ, &size);
  const int me = c->seq_rank;
  gpu_copy(recv + rdispl[me], send + sdispl[me], sizeof(float) * scount[me]);
  if (size == 1) return;
  size_t total = 0;
  for (int r = 0; r < size; r++) total += r == me ? 0 : scount[r] + rcount[r];
  const watched w("an all-to-all exchange", COMM_SEQ, sizeof(float) * total);
  NCCL_CHECK(ncclGroupStart());
  for (int r = 0; r < size; r++) {
    if (r == me) continue;
    if (scount[r])
      NCCL_CHECK(ncclSend(send + sdispl[r], scount[r], ncclFloat32, r, nc, gpu_stream()));
    if (rcount[r])
      NCCL_CHECK(ncclRecv(recv + rdispl[r], rcount[r], ncclFloat32, r, nc, gpu_stream()));
    c->bytes_sent += scount[r] * sizeof(float);
  }
  NCCL_CHECK(ncclGroupEnd());
}

// Queued on the stream like every kernel, so whatever is queued after it sees the transfer done:
// waiting asks nothing more (the ring's overlap of transfer and compute needs a second stream).
void isendrecv_float(struct comm *c, const float *send, size_t count, int dest, float *recv,
                     size_t rcount, int src, int tag, struct comm_request *r) {
  (void)r;
  sendrecv_float(c, send, count, dest, recv, rcount, src, tag);
}

void wait_request(struct comm_request *r) { (void)r; }

float *alloc(enum mem_label label, size_t floats) {
  return static_cast<float *>(gpu_alloc_zero(label, sizeof(float) * floats));
}

void free_buffer(float *p) { gpu_free(p); }

void zero(float *p, size_t floats) { gpu_memset0(p, sizeof(float) * floats); }

struct comm_transport make_transport() {
  struct comm_transport t = {};
  t.name = "nccl";
  t.allreduce_sum_float = allreduce_sum_float;
  t.allgather_float = allgather_float;
  t.sendrecv_float = sendrecv_float;
  t.alltoallv_float = alltoallv_float;
  t.isendrecv_float = isendrecv_float;
  t.wait = wait_request;
  t.alloc = alloc;
  t.free = free_buffer;
  t.zero = zero;
  t.copy_rows = gpu_copy_rows;
  t.add_rows = gpu_add_rows;
  return t;
}

const struct comm_transport nccl_transport = make_transport();

}  // namespace

extern "C" void gpu_comm_attach(struct comm *c) {
  // NCCL connects its channels at initialisation rather than lazily at first use (2.22's
  // default), unless the user chose otherwise
  setenv("NCCL_RUNTIME_CONNECT", "0", 0);
  auto *st = new nccl_state();
  open_scope(st, COMM_WORLD, c->world);
  open_scope(st, COMM_SEQ, c->seq);
  open_scope(st, COMM_DATA, c->data);
  c->transport_state = st;
  c->transport = &nccl_transport;
}

extern "C" void gpu_comm_detach(struct comm *c) {
  nccl_state *st = state(c);
  if (!st) return;
  comm_buffers_free(c);  // the kept exchange buffers are device memory
  for (ncclComm_t nc : st->comm) {
    if (!nc) continue;
    for (auto it = live.begin(); it != live.end(); ++it)
      if (*it == nc) {
        live.erase(it);
        break;
      }
    ncclCommDestroy(nc);
  }
  delete st;
  c->transport_state = nullptr;
  c->transport = &comm_mpi_transport;
}
