/* The communicator: the world as data-parallel replicas × sequence groups of consecutive ranks
 * (SPEC §7; rank w is replica w / S, slab w % S), and the operations the model needs, counted in
 * bytes sent. Bulk float traffic goes through a transport chosen at comm_init (MPI on host
 * buffers; a device back end's NCCL on device buffers); host scalars always through MPI. */
#ifndef FMATTN_COMM_H
#define FMATTN_COMM_H

#include <mpi.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/memory.h"

#ifdef __cplusplus
extern "C" {
#endif

enum comm_scope { COMM_WORLD, COMM_SEQ, COMM_DATA };
struct comm_request;

struct comm_transport;

/* The exchange buffers a run keeps (comm_buffer): one per use that can be in flight at once. */
enum comm_buffer_slot {
  COMM_BUF_HALO_SEND,
  COMM_BUF_HALO_RECV,
  COMM_BUF_LET_SEND, /* the LET's fetch */
  COMM_BUF_LET_RECV,
  COMM_BUF_SPAN_SEND, /* the spanning levels' exchange */
  COMM_BUF_SPAN_RECV,
  COMM_BUF_OPEN_SEND, /* fma.open's descent */
  COMM_BUF_OPEN_RECV,
  COMM_BUF_BAL_SEND, /* balanced causal work: the queries to their helpers (fma/balance.c) */
  COMM_BUF_BAL_RECV,
  COMM_BUF_BAL_RET_SEND, /* and the parts back */
  COMM_BUF_BAL_RET_RECV,
  COMM_BUF_SLOTS
};

struct comm_kept_buffer {
  float *p;
  size_t cap;                             /* floats */
  const struct comm_transport *transport; /* whose memory p is */
  bool held;
};

struct comm {
  const struct comm_transport *transport; /* the bulk float traffic: MPI (host buffers) */
  void *transport_state;                  /* what another transport keeps (NCCL communicators) */
  int world_rank, world_size;
  int S, seq_rank; /* ranks sharing one sequence, and my slab index */
  int D, replica;  /* data-parallel replicas, and mine */
  MPI_Comm world, seq, data;
  uint64_t bytes_sent; /* by this rank since comm_init (estimates for collectives) */
  /* blocking points within the sequence group since comm_init: each collective of COMM_SEQ,
   * each sendrecv or alltoallv, each non-blocking exchange (counted once, at its start) — what
   * bench.h5 and diag.h5 report as exchanges per layer */
  uint64_t exchanges;
  uint64_t nbx_calls; /* comm_alltoallv_long_any's calls: their tags alternate (comm.c) */
  bool overlap;       /* parallel.overlap: exchanges overlap computation where they can (default) */
  bool balance;       /* parallel.balance: causal fma's work balanced across the ranks (default) */
  bool sparse; /* parallel.alltoallv = sparse or nbx: alltoallvs as messages to the ranks with a
                * part (default); false: MPI_Alltoallv and MPI_Ialltoallv */
  bool nbx;    /* parallel.alltoallv = nbx: comm_alltoallv_long_any by NBX (comm.c), not after an
                * exchange of counts */
  struct comm_kept_buffer kept[COMM_BUF_SLOTS];
};

/* Split MPI_COMM_WORLD; world size must be a multiple of seq_ranks (checked by the deck layer). */
void comm_init(struct comm *c, int seq_ranks);
void comm_free(struct comm *c);

void comm_allreduce_sum_float(struct comm *c, enum comm_scope scope, float *buf, size_t count);
/* comm_allreduce_sum_float started (a bucket of the gradient, summed during the backward): buf
 * stays untouched until comm_wait, whose time is the caller's to count (not an exchange's). A
 * transport without a non-blocking form completes it here. comm_test lets MPI progress it. */
void comm_iallreduce_sum_float(struct comm *c, enum comm_scope scope, float *buf, size_t count,
                               struct comm_request *r);
void comm_test(struct comm_request *r);
/* Whether the transport has the non-blocking collectives (MPI's does; NCCL's are already
 * asynchronous on the device's stream). */
bool comm_nonblocking(const struct comm *c);
void comm_allreduce_sum_double(struct comm *c, enum comm_scope scope, double *buf, size_t count);
void comm_allreduce_max_int(struct comm *c, enum comm_scope scope, int *buf, size_t count);
void comm_allreduce_max_double(struct comm *c, enum comm_scope scope, double *buf, size_t count);
/* Every rank of the scope contributes count floats; recv gets them in rank order (size × count). */
void comm_allgather_float(struct comm *c, enum comm_scope scope, const float *send, size_t count,
                          float *recv);
/* Within the sequence group, every rank contributes count floats: before (count) receives the sum
 * of the contributions of ranks < mine, after (count) that of ranks > mine (zeros at the ends);
 * either may be NULL. Sums run in rank order, so every rank sees the same rounding. The exclusive
 * scans of the kernelized variants' running sums (SPEC §7); one allgather, which NCCL has too. */
void comm_exscan_sum_float(struct comm *c, const float *mine, size_t count, float *before,
                           float *after);
void comm_bcast_bytes(struct comm *c, enum comm_scope scope, void *buf, size_t bytes, int root);
void comm_barrier(struct comm *c, enum comm_scope scope);

/* Within the sequence group: send count floats to rank dest and receive rcount floats from src
 * (either may be MPI_PROC_NULL). */
void comm_sendrecv_float(struct comm *c, const float *send, size_t count, int dest, float *recv,
                         size_t rcount, int src, int tag);

/* Within the sequence group: every rank sends scount[r] floats from send + sdispl[r] to rank r and
 * receives rcount[r] floats into recv + rdispl[r] (counts and displacements in floats, one entry
 * per sequence rank). Only the off-rank traffic is counted as sent. */
void comm_alltoallv_float(struct comm *c, const float *send, const size_t *scount,
                          const size_t *sdispl, float *recv, const size_t *rcount,
                          const size_t *rdispl);

/* Within the sequence group, host memory, always over MPI (requests, not bulk data): every rank
 * sends scount[r] longs from send + sdispl[r] to rank r and receives what each rank sends it, not
 * known in advance: rcount[r] and rdispl[r] are set and *recv (allocated, the parts in rank
 * order; the caller frees it) holds them. With parallel.alltoallv = nbx one exchange among the
 * ranks with a part (NBX: no exchange of counts first), else MPI_Alltoall of the counts and then
 * the alltoallv (two). Counted as sent. */
void comm_alltoallv_long_any(struct comm *c, const long *send, const size_t *scount,
                             const size_t *sdispl, long **recv, size_t *rcount, size_t *rdispl);

/* Non-blocking exchange within the sequence group (for rings that overlap compute): start sending
 * count floats to dest and receiving rcount floats from src; comm_wait completes both. */
struct comm_request {
  const struct comm_transport *transport; /* NULL: nothing to wait for */
  MPI_Request req[2];
  int *counts; /* an alltoallv's int counts and displacements, alive until comm_wait */
  float *send; /* SMPI: an allreduce's copy of its buffer, sent from until comm_wait (comm.c) */
  MPI_Request *many; /* a point-to-point alltoallv's requests (nmany), alive until comm_wait */
  int nmany;
  bool exchange; /* comm_wait's time counts as TIMER_EXCHANGE */
};
void comm_isendrecv_float(struct comm *c, const float *send, size_t count, int dest, float *recv,
                          size_t rcount, int src, int tag, struct comm_request *r);
/* comm_alltoallv_float started (the LET's fetch, overlapped with the near field); the buffers
 * stay untouched until comm_wait. A transport without a non-blocking form completes it here. */
void comm_ialltoallv_float(struct comm *c, const float *send, const size_t *scount,
                           const size_t *sdispl, float *recv, const size_t *rcount,
                           const size_t *rdispl, struct comm_request *r);
void comm_wait(struct comm_request *r);

/* How the bulk float traffic moves (the functions above that take float buffers): one table
 * per transport, chosen once at comm_init — MPI on host buffers here; a device back end adds one
 * that moves device buffers (NCCL). Same contracts and byte counting as the functions above. */
struct comm_transport {
  const char *name;
  void (*allreduce_sum_float)(struct comm *c, enum comm_scope scope, float *buf, size_t count);
  void (*allgather_float)(struct comm *c, enum comm_scope scope, const float *send, size_t count,
                          float *recv);
  void (*sendrecv_float)(struct comm *c, const float *send, size_t count, int dest, float *recv,
                         size_t rcount, int src, int tag);
  void (*alltoallv_float)(struct comm *c, const float *send, const size_t *scount,
                          const size_t *sdispl, float *recv, const size_t *rcount,
                          const size_t *rdispl);
  void (*isendrecv_float)(struct comm *c, const float *send, size_t count, int dest, float *recv,
                          size_t rcount, int src, int tag, struct comm_request *r);
  /* may be NULL: comm_ialltoallv_float then runs alltoallv_float and the wait is empty */
  void (*ialltoallv_float)(struct comm *c, const float *send, const size_t *scount,
                           const size_t *sdispl, float *recv, const size_t *rcount,
                           const size_t *rdispl, struct comm_request *r);
  /* may be NULL: comm_iallreduce_sum_float then runs allreduce_sum_float */
  void (*iallreduce_sum_float)(struct comm *c, enum comm_scope scope, float *buf, size_t count,
                               struct comm_request *r);
  void (*wait)(struct comm_request *r);
  /* Buffers of the transport's memory (host for MPI, device for NCCL; zeroed, labelled as
   * memory.c's), and the packing that exchanges do on them: rows of len floats between strided
   * layouts, copied or added, and zeroing. */
  float *(*alloc)(enum mem_label label, size_t floats);
  void (*free)(float *p);
  void (*zero)(float *p, size_t floats);
  void (*copy_rows)(float *dst, size_t dst_stride, const float *src, size_t src_stride, size_t rows,
                    size_t len);
  void (*add_rows)(float *dst, size_t dst_stride, const float *src, size_t src_stride, size_t rows,
                   size_t len);
};
extern const struct comm_transport comm_mpi_transport;

/* Host code exchanging host arrays (the diagnostics) on a comm whose transport moves device
 * memory: comm_host_begin switches the bulk traffic to MPI, comm_host_end(c, what it returned)
 * switches it back. Bytes are counted as ever; c may be NULL. */
const struct comm_transport *comm_host_begin(struct comm *c);
void comm_host_end(struct comm *c, const struct comm_transport *saved);

/* The transport's buffers and packing (c may be NULL: one rank, host memory). A halo, a ring or
 * a tree exchange written with these works on whichever memory its transport moves. */
float *comm_alloc(const struct comm *c, enum mem_label label, size_t floats);
void comm_free_buffer(const struct comm *c, float *p);
void comm_zero(const struct comm *c, float *p, size_t floats);
void comm_copy_rows(const struct comm *c, float *dst, size_t dst_stride, const float *src,
                    size_t src_stride, size_t rows, size_t len);
void comm_add_rows(const struct comm *c, float *dst, size_t dst_stride, const float *src,
                   size_t src_stride, size_t rows, size_t len);

/* An exchange buffer of at least floats floats in the transport's memory (not zeroed), kept by c
 * for the run: allocated at the first use of its slot and again only when a larger one is asked
 * for, so a layer's exchanges allocate nothing once the first step has run. The slot is held until
 * comm_buffer_release; asking for a held slot is an error (two exchanges of one kind in flight).
 * comm_buffers_free (comm_free, and a transport before it detaches) returns them all. */
float *comm_buffer(struct comm *c, enum comm_buffer_slot slot, size_t floats);
void comm_buffer_release(struct comm *c, enum comm_buffer_slot slot);
void comm_buffers_free(struct comm *c);

#ifdef __cplusplus
}
#endif

#endif
