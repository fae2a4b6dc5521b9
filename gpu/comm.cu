// The NCCL transport of the communicator, the twin of src/comm.c's MPI one: the bulk float traffic
// of a run on GPUs (the gradient allreduce, halos, the ring, the locally essential tree) on device
// buffers, one NCCL communicator per scope (unique ids broadcast over MPI), queued on the back
// end's stream, bytes counted as comm.c counts MPI's. Host scalars stay on MPI (comm.c).
#include <cstdlib>

#include <mpi.h>

#include "check.h"
#include "comm.h"
#include "gpu.h"

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
  // one collective now, so NCCL's buffers exist before the step's memory peak rather than being
  // allocated inside it (where the first allreduce could meet a full device)
  float *one = static_cast<float *>(gpu_alloc_zero(MEM_WORKSPACE, sizeof(float)));
  NCCL_CHECK(ncclAllReduce(one, one, 1, ncclFloat, ncclSum, st->comm[scope], gpu_stream()));
  CUDA_CHECK(cudaStreamSynchronize(gpu_stream()));
  gpu_free(one);
}

void allreduce_sum_float(struct comm *c, enum comm_scope scope, float *buf, size_t count) {
  int size;
  ncclComm_t nc = nccl_of(c, scope, &size);
  if (size == 1 || count == 0) return;
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
  NCCL_CHECK(ncclAllGather(send, recv, count, ncclFloat32, nc, gpu_stream()));
  c->bytes_sent += (uint64_t)(size - 1) * count * sizeof(float);
}

void sendrecv_float(struct comm *c, const float *send, size_t count, int dest, float *recv,
                    size_t rcount, int src, int tag) {
  int size;
  ncclComm_t nc = nccl_of(c, COMM_SEQ, &size);
  (void)tag;  // NCCL orders messages between a pair of ranks; there are no tags
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
  for (ncclComm_t nc : st->comm)
    if (nc) ncclCommDestroy(nc);
  delete st;
  c->transport_state = nullptr;
  c->transport = &comm_mpi_transport;
}
