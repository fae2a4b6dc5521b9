// The NCCL communicator of the CUDA back end (SPEC §7 backend = nccl): rank 0 creates the unique
// id and MPI_Bcast carries it to the others; every rank joins with its own device (gpu_open).
#include <mpi.h>
#include <nccl.h>

#include <cstdlib>

#include "check.h"
#include "gpu.h"

#define NCCL_CHECK(call)                                                                      \
  do {                                                                                        \
    ncclResult_t r_ = (call);                                                                 \
    if (r_ != ncclSuccess)                                                                    \
      error_at(__FILE__, __func__, __LINE__, "%s failed: %s", #call, ncclGetErrorString(r_)); \
  } while (0)

struct gpu_nccl {
  ncclComm_t comm;
  int size;
  unsigned long long bytes_sent;
};

extern "C" struct gpu_nccl *gpu_nccl_open(MPI_Comm comm) {
  int rank = 0, size = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  ncclUniqueId id;
  if (rank == 0) NCCL_CHECK(ncclGetUniqueId(&id));
  MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, comm);
  auto *c = static_cast<gpu_nccl *>(std::calloc(1, sizeof(gpu_nccl)));
  if (!c) error_at(__FILE__, __func__, __LINE__, "out of host memory for the NCCL communicator");
  c->size = size;
  NCCL_CHECK(ncclCommInitRank(&c->comm, size, id, rank));
  return c;
}

extern "C" void gpu_nccl_allreduce_sum(struct gpu_nccl *c, float *dev, size_t count) {
  NCCL_CHECK(ncclAllReduce(dev, dev, count, ncclFloat32, ncclSum, c->comm, gpu_stream()));
  // the ring's traffic, as comm.c counts an MPI allreduce: 2(S − 1)/S of the array per rank
  c->bytes_sent +=
      (unsigned long long)(2.0 * (c->size - 1) / c->size * (double)(count * sizeof(float)));
}

extern "C" unsigned long long gpu_nccl_bytes_sent(const struct gpu_nccl *c) {
  return c->bytes_sent;
}

extern "C" void gpu_nccl_close(struct gpu_nccl *c) {
  if (!c) return;
  ncclCommDestroy(c->comm);
  std::free(c);
}
