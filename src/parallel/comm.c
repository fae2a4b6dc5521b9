/* The communicator (comm.h): the rank layout, the host collectives, and the MPI transport of the
 * bulk float traffic behind the table the other transports fill. Large messages are sent in
 * pieces of at most COMM_PIECE elements so counts never overflow MPI's int arguments. Collective
 * byte counts use the ring-algorithm volume 2(P−1)/P · bytes, the usual cost model. */
#include "parallel/comm.h"

#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "core/memory.h"
#include "core/timer.h"

#define COMM_PIECE ((size_t)1 << 28)

void comm_init(struct comm *c, int seq_ranks) {
  MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &c->world_rank));
  MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &c->world_size));
  if (seq_ranks < 1 || c->world_size % seq_ranks != 0)
    error("parallel.seq_ranks = %d does not divide the %d ranks", seq_ranks, c->world_size);
  c->S = seq_ranks;
  c->D = c->world_size / seq_ranks;
  c->seq_rank = c->world_rank % seq_ranks;
  c->replica = c->world_rank / seq_ranks;
  c->world = MPI_COMM_WORLD;
  MPI_CHECK(MPI_Comm_split(MPI_COMM_WORLD, c->replica, c->seq_rank, &c->seq));
  MPI_CHECK(MPI_Comm_split(MPI_COMM_WORLD, c->seq_rank, c->replica, &c->data));
  c->bytes_sent = 0;
  c->exchanges = 0;
  c->nbx_calls = 0;
  c->transport = &comm_mpi_transport;
  c->overlap = true;
  c->balance = true;
  c->sparse = true;
  c->nbx = false;
  memset(c->kept, 0, sizeof c->kept);
}

void comm_free(struct comm *c) {
  comm_buffers_free(c);
  MPI_Comm_free(&c->seq);
  MPI_Comm_free(&c->data);
}

/* One more blocking point within the sequence group (comm.h), when there is a group. */
static void count_exchange(struct comm *c, enum comm_scope scope) {
  if (scope == COMM_SEQ && c->S > 1) c->exchanges++;
}

static MPI_Comm scope_comm(struct comm *c, enum comm_scope scope, int *size) {
  switch (scope) {
    case COMM_SEQ:
      *size = c->S;
      return c->seq;
    case COMM_DATA:
      *size = c->D;
      return c->data;
    default:
      *size = c->world_size;
      return c->world;
  }
}

static void allreduce(struct comm *c, enum comm_scope scope, void *buf, size_t count,
                      MPI_Datatype type, size_t elem, MPI_Op op) {
  int size;
  MPI_Comm comm = scope_comm(c, scope, &size);
  if (size == 1) return;
  for (size_t off = 0; off < count; off += COMM_PIECE) {
    size_t n = count - off < COMM_PIECE ? count - off : COMM_PIECE;
    MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, (char *)buf + off * elem, (int)n, type, op, comm));
  }
  c->bytes_sent += (uint64_t)(2.0 * (size - 1) / size * (double)(count * elem));
}

static void mpi_allreduce_sum_float(struct comm *c, enum comm_scope scope, float *buf,
                                    size_t count) {
  allreduce(c, scope, buf, count, MPI_FLOAT, sizeof(float), MPI_SUM);
}

void comm_allreduce_sum_double(struct comm *c, enum comm_scope scope, double *buf, size_t count) {
  count_exchange(c, scope);
  allreduce(c, scope, buf, count, MPI_DOUBLE, sizeof(double), MPI_SUM);
}

void comm_allreduce_max_int(struct comm *c, enum comm_scope scope, int *buf, size_t count) {
  count_exchange(c, scope);
  allreduce(c, scope, buf, count, MPI_INT, sizeof(int), MPI_MAX);
}

void comm_allreduce_max_double(struct comm *c, enum comm_scope scope, double *buf, size_t count) {
  count_exchange(c, scope);
  allreduce(c, scope, buf, count, MPI_DOUBLE, sizeof(double), MPI_MAX);
}

static void mpi_allgather_float(struct comm *c, enum comm_scope scope, const float *send,
                                size_t count, float *recv) {
  int size;
  MPI_Comm comm = scope_comm(c, scope, &size);
  if (size == 1) {
    memmove(recv, send, count * sizeof(float));
    return;
  }
  if (count > COMM_PIECE) error("allgather of %zu floats per rank is too large", count);
  MPI_CHECK(MPI_Allgather(send, (int)count, MPI_FLOAT, recv, (int)count, MPI_FLOAT, comm));
  c->bytes_sent += (uint64_t)(size - 1) * count * sizeof(float); /* ring estimate */
}

void comm_exscan_sum_float(struct comm *c, const float *mine, size_t count, float *before,
                           float *after) {
  const int S = c ? c->S : 1, me = c ? c->seq_rank : 0;
  if (before) memset(before, 0, sizeof(float) * count);
  if (after) memset(after, 0, sizeof(float) * count);
  if (S == 1) return;
  float *all = xmalloc(sizeof(float) * count * (size_t)S); /* (S, count) */
  comm_allgather_float(c, COMM_SEQ, mine, count, all);
  for (int r = 0; r < S; r++) {
    float *into = r < me ? before : r > me ? after : NULL;
    if (!into) continue;
    const float *from = all + (size_t)r * count;
    for (size_t i = 0; i < count; i++) into[i] += from[i];
  }
  free(all);
}

void comm_bcast_bytes(struct comm *c, enum comm_scope scope, void *buf, size_t bytes, int root) {
  count_exchange(c, scope);
  int size;
  MPI_Comm comm = scope_comm(c, scope, &size);
  if (size == 1) return;
  for (size_t off = 0; off < bytes; off += COMM_PIECE)
    MPI_CHECK(MPI_Bcast((char *)buf + off,
                        (int)(bytes - off < COMM_PIECE ? bytes - off : COMM_PIECE), MPI_BYTE, root,
                        comm));
}

void comm_barrier(struct comm *c, enum comm_scope scope) {
  count_exchange(c, scope);
  int size;
  MPI_Comm comm = scope_comm(c, scope, &size);
  if (size > 1) MPI_CHECK(MPI_Barrier(comm));
}

static void mpi_sendrecv_float(struct comm *c, const float *send, size_t count, int dest,
                               float *recv, size_t rcount, int src, int tag) {
  if (count > COMM_PIECE || rcount > COMM_PIECE)
    error("point-to-point message of %zu floats is too large", count > rcount ? count : rcount);
  MPI_CHECK(MPI_Sendrecv(send, (int)count, MPI_FLOAT, dest, tag, recv, (int)rcount, MPI_FLOAT, src,
                         tag, c->seq, MPI_STATUS_IGNORE));
  if (dest != MPI_PROC_NULL) c->bytes_sent += count * sizeof(float);
}

/* An alltoallv's size_t counts and displacements as MPI's int (4·S: sc, sd, rc, rd; the caller
 * frees them), each checked to fit; the off-rank bytes (elem each) are counted as sent. */
static int *int_counts(struct comm *c, const size_t *scount, const size_t *sdispl,
                       const size_t *rcount, const size_t *rdispl, size_t elem, const char *what) {
  const int S = c->S;
  int *sc = xmalloc(sizeof(int) * 4 * (size_t)S), *sd = sc + S, *rc = sc + 2 * S, *rd = sc + 3 * S;
  for (int r = 0; r < S; r++) {
    if (scount[r] > COMM_PIECE || rcount[r] > COMM_PIECE || sdispl[r] > (size_t)INT_MAX ||
        rdispl[r] > (size_t)INT_MAX)
      error("alltoallv of %zu %s is too large for one MPI call", scount[r] + sdispl[r], what);
    sc[r] = (int)scount[r];
    sd[r] = (int)sdispl[r];
    rc[r] = (int)rcount[r];
    rd[r] = (int)rdispl[r];
    if (r != c->seq_rank) c->bytes_sent += scount[r] * elem;
  }
  return sc;
}

/* The point-to-point form of an alltoallv (parallel.alltoallv = sparse, the default): a receive
 * from each rank with something for this one and a send to each rank this one has something for,
 * in rank order from the next rank round, its own part copied. An exchange among a few partners
 * (the halo's neighbours, the ranks a LET names, a balance's pairs) then costs their messages, not
 * the S − 1 an MPI_Alltoallv may post (SimGrid's non-blocking one posts them, empty or not). Every
 * rank posts its exchanges in the same order and MPI matches the messages between two ranks in
 * the order they were posted, so one tag serves every exchange, two in flight at once included.
 * The requests (at most 2(S − 1)) go to *req, which the caller frees; returns how many. */
#define COMM_SPARSE_TAG 7201
static int sparse_post(struct comm *c, const void *send, const size_t *scount, const size_t *sdispl,
                       void *recv, const size_t *rcount, const size_t *rdispl, MPI_Datatype type,
                       size_t elem, const char *what, MPI_Request **req) {
  const int S = c->S, me = c->seq_rank;
  MPI_Request *q = xmalloc(sizeof *q * 2 * (size_t)S);
  int n = 0;
  for (int i = 1; i < S; i++) {
    const int r = (me + S - i) % S; /* receive from the ranks before me, nearest first */
    if (!rcount[r]) continue;
    if (rcount[r] > COMM_PIECE)
      error("alltoallv of %zu %s is too large for one MPI call", rcount[r], what);
    MPI_CHECK(MPI_Irecv((char *)recv + rdispl[r] * elem, (int)rcount[r], type, r, COMM_SPARSE_TAG,
                        c->seq, &q[n++]));
  }
  for (int i = 1; i < S; i++) {
    const int r = (me + i) % S; /* send to the ranks after me, nearest first */
    if (!scount[r]) continue;
    if (scount[r] > COMM_PIECE)
      error("alltoallv of %zu %s is too large for one MPI call", scount[r], what);
    MPI_CHECK(MPI_Isend((const char *)send + sdispl[r] * elem, (int)scount[r], type, r,
                        COMM_SPARSE_TAG, c->seq, &q[n++]));
    c->bytes_sent += scount[r] * elem;
  }
  if (scount[me] != rcount[me])
    error("internal: alltoallv sends %zu %s to itself and receives %zu", scount[me], what,
          rcount[me]);
  if (scount[me])
    memmove((char *)recv + rdispl[me] * elem, (const char *)send + sdispl[me] * elem,
            scount[me] * elem);
  *req = q;
  return n;
}

/* MPI_Alltoallv of elements of `type` (elem bytes, `what` in messages) with size_t counts and
 * displacements, which must fit MPI's int; point to point unless parallel.alltoallv = mpi. */
static void alltoallv(struct comm *c, const void *send, const size_t *scount, const size_t *sdispl,
                      void *recv, const size_t *rcount, const size_t *rdispl, MPI_Datatype type,
                      size_t elem, const char *what) {
  const int S = c->S;
  if (c->sparse) {
    MPI_Request *q;
    const int n = sparse_post(c, send, scount, sdispl, recv, rcount, rdispl, type, elem, what, &q);
    MPI_CHECK(MPI_Waitall(n, q, MPI_STATUSES_IGNORE));
    free(q);
    return;
  }
  int *sc = int_counts(c, scount, sdispl, rcount, rdispl, elem, what);
  MPI_CHECK(MPI_Alltoallv(send, sc, sc + S, type, recv, sc + 2 * S, sc + 3 * S, type, c->seq));
  free(sc);
}

static void mpi_alltoallv_float(struct comm *c, const float *send, const size_t *scount,
                                const size_t *sdispl, float *recv, const size_t *rcount,
                                const size_t *rdispl) {
  alltoallv(c, send, scount, sdispl, recv, rcount, rdispl, MPI_FLOAT, sizeof(float), "floats");
}

/* The MPI_Alltoall of the counts, then the alltoallv (point to point unless parallel.alltoallv =
 * mpi): two exchanges. */
static void counts_then_alltoallv(struct comm *c, const long *send, const size_t *scount,
                                  const size_t *sdispl, long **recv, size_t *rcount,
                                  size_t *rdispl) {
  _Static_assert(sizeof(size_t) == sizeof(uint64_t), "size_t travels as uint64_t");
  count_exchange(c, COMM_SEQ);
  MPI_CHECK(MPI_Alltoall(scount, 1, MPI_UINT64_T, rcount, 1, MPI_UINT64_T, c->seq));
  c->bytes_sent += (uint64_t)(c->S - 1) * sizeof(uint64_t);
  size_t n = 0;
  for (int r = 0; r < c->S; r++) {
    rdispl[r] = n;
    n += rcount[r];
  }
  *recv = xmalloc(sizeof(long) * (n + 1));
  alltoallv(c, send, scount, sdispl, *recv, rcount, rdispl, MPI_LONG, sizeof(long), "longs");
}

/* NBX, the non-blocking consensus of Hoefler, Siebert and Lumsdaine (PPoPP 2010): a synchronous
 * send to each rank with a part, and, until every rank has had all its sends received, whatever
 * arrives is received; a rank whose sends completed enters a non-blocking barrier, and the
 * exchange is over when the barrier is. Each rank sends at most one message per partner and call.
 * A rank may start the next call's sends while another still receives this one's: the calls
 * alternate between two tags, and one two calls on cannot start before the other has left this
 * one's barrier. */
#define COMM_NBX_TAG 7202 /* and 7203 */

/* NBX's non-blocking barrier. SimGrid 3.32's MPI_Ibarrier is not one: its root posts the releases
 * with the arrivals, so every other rank leaves as soon as the root has entered, the last rank not
 * yet (scripts/simgrid/ibarrier.c, docs/scaling.md), and NBX would end an exchange before every
 * request was received. Under SMPI it is an MPI_Iallreduce of one int from a send buffer, which
 * cannot complete before every rank contributed. */
struct nbx_barrier {
  MPI_Request req;
  int one, sum;
};
static void barrier_enter(struct comm *c, struct nbx_barrier *b) {
#ifdef FMATTN_SMPI
  b->one = 1;
  MPI_CHECK(MPI_Iallreduce(&b->one, &b->sum, 1, MPI_INT, MPI_SUM, c->seq, &b->req));
#else
  MPI_CHECK(MPI_Ibarrier(c->seq, &b->req));
#endif
}

static void nbx(struct comm *c, const long *send, const size_t *scount, const size_t *sdispl,
                long **recv, size_t *rcount, size_t *rdispl) {
  const int S = c->S, me = c->seq_rank, tag = COMM_NBX_TAG + (int)(c->nbx_calls++ & 1);
  MPI_Request *q = xmalloc(sizeof *q * (size_t)S);
  struct nbx_barrier barrier = {MPI_REQUEST_NULL, 0, 0};
  long **part = xcalloc((size_t)S, sizeof *part);
  int n = 0;
  for (int i = 1; i < S; i++) {
    const int r = (me + i) % S;
    rcount[r] = 0;
    if (!scount[r]) continue;
    if (scount[r] > COMM_PIECE)
      error("exchange of %zu longs is too large for one MPI call", scount[r]);
    MPI_CHECK(MPI_Issend(send + sdispl[r], (int)scount[r], MPI_LONG, r, tag, c->seq, &q[n++]));
    c->bytes_sent += scount[r] * sizeof(long);
  }
  rcount[me] = scount[me];
  for (bool entered = false, done = false; !done;) {
    int arrived;
    MPI_Status status;
    MPI_CHECK(MPI_Iprobe(MPI_ANY_SOURCE, tag, c->seq, &arrived, &status));
    if (arrived) {
      const int r = status.MPI_SOURCE;
      int count;
      MPI_CHECK(MPI_Get_count(&status, MPI_LONG, &count));
      if (part[r]) error("internal: two requests from sequence rank %d in one exchange", r);
      part[r] = xmalloc(sizeof(long) * ((size_t)count + 1));
      MPI_CHECK(MPI_Recv(part[r], count, MPI_LONG, r, tag, c->seq, MPI_STATUS_IGNORE));
      rcount[r] = (size_t)count;
    } else if (!entered) {
      int sent;
      MPI_CHECK(MPI_Testall(n, q, &sent, MPI_STATUSES_IGNORE));
      if (sent) barrier_enter(c, &barrier);
      entered = sent;
    } else {
      int over;
      MPI_CHECK(MPI_Test(&barrier.req, &over, MPI_STATUS_IGNORE));
      done = over;
    }
  }
  size_t total = 0;
  for (int r = 0; r < S; r++) {
    rdispl[r] = total;
    total += rcount[r];
  }
  *recv = xmalloc(sizeof(long) * (total + 1));
  for (int r = 0; r < S; r++) {
    const long *from = r == me ? send + sdispl[me] : part[r];
    if (rcount[r]) memcpy(*recv + rdispl[r], from, sizeof(long) * rcount[r]);
    free(part[r]);
  }
  free(part);
  free(q);
}

void comm_alltoallv_long_any(struct comm *c, const long *send, const size_t *scount,
                             const size_t *sdispl, long **recv, size_t *rcount, size_t *rdispl) {
  count_exchange(c, COMM_SEQ);
  timer_start(TIMER_EXCHANGE);
  if (c->nbx && c->S > 1)
    nbx(c, send, scount, sdispl, recv, rcount, rdispl);
  else
    counts_then_alltoallv(c, send, scount, sdispl, recv, rcount, rdispl);
  timer_stop(TIMER_EXCHANGE);
}

static void mpi_isendrecv_float(struct comm *c, const float *send, size_t count, int dest,
                                float *recv, size_t rcount, int src, int tag,
                                struct comm_request *r) {
  if (count > COMM_PIECE || rcount > COMM_PIECE)
    error("point-to-point message of %zu floats is too large", count > rcount ? count : rcount);
  MPI_CHECK(MPI_Irecv(recv, (int)rcount, MPI_FLOAT, src, tag, c->seq, &r->req[0]));
  MPI_CHECK(MPI_Isend(send, (int)count, MPI_FLOAT, dest, tag, c->seq, &r->req[1]));
  if (dest != MPI_PROC_NULL) c->bytes_sent += count * sizeof(float);
}

static void mpi_ialltoallv_float(struct comm *c, const float *send, const size_t *scount,
                                 const size_t *sdispl, float *recv, const size_t *rcount,
                                 const size_t *rdispl, struct comm_request *r) {
  const int S = c->S;
  r->req[0] = r->req[1] = MPI_REQUEST_NULL;
  if (c->sparse) {
    r->nmany = sparse_post(c, send, scount, sdispl, recv, rcount, rdispl, MPI_FLOAT, sizeof(float),
                           "floats", &r->many);
    return;
  }
  int *sc = int_counts(c, scount, sdispl, rcount, rdispl, sizeof(float), "floats");
  MPI_CHECK(MPI_Ialltoallv(send, sc, sc + S, MPI_FLOAT, recv, sc + 2 * S, sc + 3 * S, MPI_FLOAT,
                           c->seq, &r->req[0]));
  r->req[1] = MPI_REQUEST_NULL;
  r->counts = sc;
}

static void mpi_iallreduce_sum_float(struct comm *c, enum comm_scope scope, float *buf,
                                     size_t count, struct comm_request *r) {
  int size;
  MPI_Comm comm = scope_comm(c, scope, &size);
  r->req[0] = r->req[1] = MPI_REQUEST_NULL;
  if (size <= 1 || count == 0) return;
  if (count > COMM_PIECE) { /* beyond one MPI call: blocking, in pieces */
    mpi_allreduce_sum_float(c, scope, buf, count);
    return;
  }
#ifdef FMATTN_SMPI
  /* SimGrid 3.32's MPI_Iallreduce with MPI_IN_PLACE returns garbage above about 20,000 floats
   * (right at 5,000, NaN at 20,000 and 100,000), where the same call from a send buffer of its own
   * is right, and so is the blocking in-place MPI_Allreduce: under SMPI the bucket is sent from a
   * copy, freed by comm_wait (docs/scaling.md) */
  r->send = xmalloc(sizeof(float) * count);
  memcpy(r->send, buf, sizeof(float) * count);
  MPI_CHECK(MPI_Iallreduce(r->send, buf, (int)count, MPI_FLOAT, MPI_SUM, comm, &r->req[0]));
#else
  MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, buf, (int)count, MPI_FLOAT, MPI_SUM, comm, &r->req[0]));
#endif
  c->bytes_sent += (uint64_t)(2.0 * (size - 1) / size * (double)(count * sizeof(float)));
}

static void mpi_wait(struct comm_request *r) {
  MPI_CHECK(MPI_Waitall(2, r->req, MPI_STATUSES_IGNORE));
  if (r->nmany) MPI_CHECK(MPI_Waitall(r->nmany, r->many, MPI_STATUSES_IGNORE));
}

static float *host_alloc(enum mem_label label, size_t floats) {
  return mem_alloc(label, sizeof(float) * floats);
}
static void host_zero(float *p, size_t floats) { memset(p, 0, sizeof(float) * floats); }
static void host_free(float *p) { mem_free(p); }

static void host_copy_rows(float *dst, size_t dst_stride, const float *src, size_t src_stride,
                           size_t rows, size_t len) {
  for (size_t r = 0; r < rows; r++)
    memcpy(dst + r * dst_stride, src + r * src_stride, sizeof(float) * len);
}

static void host_add_rows(float *dst, size_t dst_stride, const float *src, size_t src_stride,
                          size_t rows, size_t len) {
  if (rows == 1) { /* one long row (a ring's accumulators): split over the threads */
#pragma omp parallel for schedule(static) if (len > 65536)
    for (size_t i = 0; i < len; i++) dst[i] += src[i];
    return;
  }
  for (size_t r = 0; r < rows; r++) {
    float *out = dst + r * dst_stride;
    const float *in = src + r * src_stride;
    for (size_t i = 0; i < len; i++) out[i] += in[i];
  }
}

/* MPI moves host buffers: the transport of the CPU back end. */
const struct comm_transport comm_mpi_transport = {
    .name = "mpi",
    .allreduce_sum_float = mpi_allreduce_sum_float,
    .allgather_float = mpi_allgather_float,
    .sendrecv_float = mpi_sendrecv_float,
    .alltoallv_float = mpi_alltoallv_float,
    .isendrecv_float = mpi_isendrecv_float,
    .ialltoallv_float = mpi_ialltoallv_float,
    .iallreduce_sum_float = mpi_iallreduce_sum_float,
    .wait = mpi_wait,
    .alloc = host_alloc,
    .free = host_free,
    .zero = host_zero,
    .copy_rows = host_copy_rows,
    .add_rows = host_add_rows,
};

static const struct comm_transport *via(const struct comm *c) {
  return c ? c->transport : &comm_mpi_transport;
}

float *comm_alloc(const struct comm *c, enum mem_label label, size_t floats) {
  return via(c)->alloc(label, floats);
}

void comm_zero(const struct comm *c, float *p, size_t floats) {
  if (floats) via(c)->zero(p, floats);
}

void comm_free_buffer(const struct comm *c, float *p) {
  if (p) via(c)->free(p);
}

void comm_copy_rows(const struct comm *c, float *dst, size_t dst_stride, const float *src,
                    size_t src_stride, size_t rows, size_t len) {
  if (rows && len) via(c)->copy_rows(dst, dst_stride, src, src_stride, rows, len);
}

void comm_add_rows(const struct comm *c, float *dst, size_t dst_stride, const float *src,
                   size_t src_stride, size_t rows, size_t len) {
  if (rows && len) via(c)->add_rows(dst, dst_stride, src, src_stride, rows, len);
}

/* ---------------------------------------------------------------------------------------------
 * the bulk float traffic, through the transport chosen at comm_init */

void comm_allreduce_sum_float(struct comm *c, enum comm_scope scope, float *buf, size_t count) {
  count_exchange(c, scope);
  c->transport->allreduce_sum_float(c, scope, buf, count);
}

void comm_allgather_float(struct comm *c, enum comm_scope scope, const float *send, size_t count,
                          float *recv) {
  count_exchange(c, scope);
  if (scope == COMM_SEQ) timer_start(TIMER_EXCHANGE);
  c->transport->allgather_float(c, scope, send, count, recv);
  if (scope == COMM_SEQ) timer_stop(TIMER_EXCHANGE);
}

const struct comm_transport *comm_host_begin(struct comm *c) {
  if (!c) return NULL;
  const struct comm_transport *saved = c->transport;
  c->transport = &comm_mpi_transport;
  return saved;
}

void comm_host_end(struct comm *c, const struct comm_transport *saved) {
  if (c) c->transport = saved;
}

void comm_sendrecv_float(struct comm *c, const float *send, size_t count, int dest, float *recv,
                         size_t rcount, int src, int tag) {
  count_exchange(c, COMM_SEQ);
  timer_start(TIMER_EXCHANGE);
  c->transport->sendrecv_float(c, send, count, dest, recv, rcount, src, tag);
  timer_stop(TIMER_EXCHANGE);
}

void comm_alltoallv_float(struct comm *c, const float *send, const size_t *scount,
                          const size_t *sdispl, float *recv, const size_t *rcount,
                          const size_t *rdispl) {
  count_exchange(c, COMM_SEQ);
  timer_start(TIMER_EXCHANGE);
  c->transport->alltoallv_float(c, send, scount, sdispl, recv, rcount, rdispl);
  timer_stop(TIMER_EXCHANGE);
}

/* A request with nothing in flight yet: `transport` waits for it (NULL: nothing to wait for), and
 * its wait counts as an exchange's time or not. */
static void request_init(struct comm_request *r, const struct comm_transport *transport,
                         bool exchange) {
  *r = (struct comm_request){
      .transport = transport, .req = {MPI_REQUEST_NULL, MPI_REQUEST_NULL}, .exchange = exchange};
}

void comm_isendrecv_float(struct comm *c, const float *send, size_t count, int dest, float *recv,
                          size_t rcount, int src, int tag, struct comm_request *r) {
  count_exchange(c, COMM_SEQ);
  request_init(r, c->transport, true);
  c->transport->isendrecv_float(c, send, count, dest, recv, rcount, src, tag, r);
}

void comm_ialltoallv_float(struct comm *c, const float *send, const size_t *scount,
                           const size_t *sdispl, float *recv, const size_t *rcount,
                           const size_t *rdispl, struct comm_request *r) {
  request_init(r, NULL, true); /* nothing left for comm_wait unless the transport starts it */
  count_exchange(c, COMM_SEQ);
  timer_start(TIMER_EXCHANGE);
  if (c->transport->ialltoallv_float) {
    r->transport = c->transport;
    c->transport->ialltoallv_float(c, send, scount, sdispl, recv, rcount, rdispl, r);
  } else {
    c->transport->alltoallv_float(c, send, scount, sdispl, recv, rcount, rdispl);
  }
  timer_stop(TIMER_EXCHANGE);
}

void comm_iallreduce_sum_float(struct comm *c, enum comm_scope scope, float *buf, size_t count,
                               struct comm_request *r) {
  request_init(r, NULL, false);
  if (c->transport->iallreduce_sum_float) {
    r->transport = c->transport;
    c->transport->iallreduce_sum_float(c, scope, buf, count, r);
  } else {
    c->transport->allreduce_sum_float(c, scope, buf, count);
  }
}

bool comm_nonblocking(const struct comm *c) {
  return c && c->transport->iallreduce_sum_float && c->transport->ialltoallv_float;
}

void comm_test(struct comm_request *r) {
  if (r->transport != &comm_mpi_transport) return; /* another transport progresses by itself */
  int done;
  MPI_CHECK(MPI_Testall(2, r->req, &done, MPI_STATUSES_IGNORE));
  if (r->nmany) MPI_CHECK(MPI_Testall(r->nmany, r->many, &done, MPI_STATUSES_IGNORE));
}

void comm_wait(struct comm_request *r) {
  if (!r->transport) return;
  if (r->exchange) timer_start(TIMER_EXCHANGE);
  r->transport->wait(r);
  if (r->exchange) timer_stop(TIMER_EXCHANGE);
  free(r->counts);
  r->counts = NULL;
  free(r->send);
  r->send = NULL;
  free(r->many);
  r->many = NULL;
  r->nmany = 0;
  r->transport = NULL;
}

float *comm_buffer(struct comm *c, enum comm_buffer_slot slot, size_t floats) {
  struct comm_kept_buffer *b = &c->kept[slot];
  if (b->held) error("internal: exchange buffer %d asked for while in use", (int)slot);
  if (b->p && (b->cap < floats || b->transport != c->transport)) {
    b->transport->free(b->p);
    b->p = NULL;
  }
  if (!b->p) {
    b->cap = floats > b->cap ? floats : b->cap;
    b->transport = c->transport;
    b->p = c->transport->alloc(MEM_COMM, b->cap);
  }
  b->held = true;
  return b->p;
}

void comm_buffer_release(struct comm *c, enum comm_buffer_slot slot) { c->kept[slot].held = false; }

void comm_buffers_free(struct comm *c) {
  for (int s = 0; s < COMM_BUF_SLOTS; s++) {
    struct comm_kept_buffer *b = &c->kept[s];
    if (b->p) b->transport->free(b->p);
    memset(b, 0, sizeof *b);
  }
}
