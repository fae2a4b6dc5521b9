// NCCL on MPI: each process is one emulated device; a communicator is an MPI communicator built
// from what ncclCommInitRank receives (the unique id names the root's world rank and a serial;
// the members report to the root, which checks them and answers with the member list; then
// MPI_Comm_create_group, so ranks outside the communicator take no part). Two ranks on one
// device of one host are refused as NCCL refuses them. Collectives and grouped send/recv are
// stream work (deferred mode applies). It must never assume that every world rank joins.
#include <mpi.h>
#include <unistd.h>

#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "core.h"
#include "include/cuda_bf16.h"
#include "include/nccl.h"

struct ncclComm {
  MPI_Comm mpi = MPI_COMM_NULL;
  int nranks = 0, rank = 0, device = 0;
  bool destroyed = false;
  std::string last_error;
};

namespace cudaemu {
namespace {

constexpr uint64_t kMagic = 0x4e43434c454d5531ull;  // "NCCLEMU1"
constexpr int kTagBase = 32000;                     // MPI guarantees tags up to 32767

struct id_contents {
  uint64_t magic;
  uint64_t serial;
  int root_world;
  int root_pid;
};

struct member {
  int world, rank, nranks, device;
  char host[64];
};

uint64_t id_serial = 0;
std::string last_error;
int group_depth = 0;

struct op {
  enum kind_t { allreduce, reduce, broadcast, allgather, reducescatter, send, recv } kind;
  ncclComm_t comm;
  const void *send_buf;
  void *recv_buf;
  size_t count;
  ncclDataType_t type;
  ncclRedOp_t red;
  int peer;  // root or peer
  cudaStream_t stream;
};
std::vector<op> group_ops;

ncclResult_t error(ncclResult_t r, ncclComm_t comm, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
ncclResult_t error(ncclResult_t r, ncclComm_t comm, const char *fmt, ...) {
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  last_error = msg;
  if (comm) comm->last_error = msg;
  note("NCCL: %s", msg);
  return r;
}

size_t type_size(ncclDataType_t t) {
  switch (t) {
    case ncclInt8:
    case ncclUint8:
      return 1;
    case ncclFloat16:
    case ncclBfloat16:
      return 2;
    case ncclInt32:
    case ncclUint32:
    case ncclFloat32:
      return 4;
    case ncclInt64:
    case ncclUint64:
    case ncclFloat64:
      return 8;
  }
  return 0;
}

MPI_Datatype mpi_type(ncclDataType_t t) {
  switch (t) {
    case ncclInt8:
      return MPI_INT8_T;
    case ncclUint8:
      return MPI_UINT8_T;
    case ncclInt32:
      return MPI_INT32_T;
    case ncclUint32:
      return MPI_UINT32_T;
    case ncclInt64:
      return MPI_INT64_T;
    case ncclUint64:
      return MPI_UINT64_T;
    case ncclFloat32:
      return MPI_FLOAT;
    case ncclFloat64:
      return MPI_DOUBLE;
    case ncclBfloat16:
      return MPI_UINT16_T;
    default:
      return MPI_DATATYPE_NULL;
  }
}

// bf16 reductions: each combination rounded to bf16 (NCCL's ring order differs; sums may differ
// in the last bit from a GPU's)
template <int R>
void bf16_reduce(void *in, void *inout, int *len, MPI_Datatype *) {
  const uint16_t *a = static_cast<const uint16_t *>(in);
  uint16_t *b = static_cast<uint16_t *>(inout);
  for (int i = 0; i < *len; i++) {
    const float x = bf16_to_float(a[i]), y = bf16_to_float(b[i]);
    const float r = R == 0 ? x + y : R == 1 ? x * y : R == 2 ? (x > y ? x : y) : (x < y ? x : y);
    b[i] = float_to_bf16_rn(r);
  }
}

MPI_Op mpi_op(ncclRedOp_t r, ncclDataType_t t) {
  if (t == ncclBfloat16) {
    static MPI_Op ops[4] = {MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL};
    static MPI_User_function *fns[4] = {bf16_reduce<0>, bf16_reduce<1>, bf16_reduce<2>,
                                        bf16_reduce<3>};
    const int i = r == ncclAvg ? 0 : (int)r;
    if (ops[i] == MPI_OP_NULL) MPI_Op_create(fns[i], 1, &ops[i]);
    return ops[i];
  }
  switch (r) {
    case ncclSum:
    case ncclAvg:
      return MPI_SUM;
    case ncclProd:
      return MPI_PROD;
    case ncclMax:
      return MPI_MAX;
    case ncclMin:
      return MPI_MIN;
  }
  return MPI_OP_NULL;
}

void divide(void *buf, size_t count, ncclDataType_t t, int n) {
  for (size_t i = 0; i < count; i++) switch (t) {
      case ncclFloat32:
        static_cast<float *>(buf)[i] /= (float)n;
        break;
      case ncclFloat64:
        static_cast<double *>(buf)[i] /= n;
        break;
      case ncclInt32:
        static_cast<int32_t *>(buf)[i] /= n;
        break;
      case ncclUint32:
        static_cast<uint32_t *>(buf)[i] /= (uint32_t)n;
        break;
      case ncclInt64:
        static_cast<int64_t *>(buf)[i] /= n;
        break;
      case ncclUint64:
        static_cast<uint64_t *>(buf)[i] /= (uint64_t)n;
        break;
      case ncclInt8:
        static_cast<int8_t *>(buf)[i] /= n;
        break;
      case ncclUint8:
        static_cast<uint8_t *>(buf)[i] /= n;
        break;
      case ncclBfloat16: {
        uint16_t *h = static_cast<uint16_t *>(buf);
        h[i] = float_to_bf16_rn(bf16_to_float(h[i]) / (float)n);
        break;
      }
      default:
        break;
    }
}

void run_collective(const op &o) {
  MPI_Comm c = o.comm->mpi;
  const MPI_Datatype t = mpi_type(o.type);
  const size_t sz = type_size(o.type);
  const int n = o.comm->nranks, me = o.comm->rank, cnt = (int)o.count;
  switch (o.kind) {
    case op::allreduce:
      MPI_Allreduce(o.send_buf == o.recv_buf ? MPI_IN_PLACE : o.send_buf, o.recv_buf, cnt, t,
                    mpi_op(o.red, o.type), c);
      if (o.red == ncclAvg) divide(o.recv_buf, o.count, o.type, n);
      break;
    case op::reduce:
      if (me == o.peer) {
        MPI_Reduce(o.send_buf == o.recv_buf ? MPI_IN_PLACE : o.send_buf, o.recv_buf, cnt, t,
                   mpi_op(o.red, o.type), o.peer, c);
        if (o.red == ncclAvg) divide(o.recv_buf, o.count, o.type, n);
      } else {
        MPI_Reduce(o.send_buf, nullptr, cnt, t, mpi_op(o.red, o.type), o.peer, c);
      }
      break;
    case op::broadcast:
      if (me == o.peer && o.send_buf != o.recv_buf)
        std::memcpy(o.recv_buf, o.send_buf, o.count * sz);
      MPI_Bcast(o.recv_buf, cnt, t, o.peer, c);
      break;
    case op::allgather: {
      const bool in_place =
          o.send_buf == static_cast<char *>(o.recv_buf) + (size_t)me * o.count * sz;
      MPI_Allgather(in_place ? MPI_IN_PLACE : o.send_buf, cnt, t, o.recv_buf, cnt, t, c);
      break;
    }
    case op::reducescatter: {
      // NCCL's in-place form puts this rank's block inside the send buffer: reduce from a copy
      std::vector<char> copy(static_cast<const char *>(o.send_buf),
                             static_cast<const char *>(o.send_buf) + o.count * sz * (size_t)n);
      MPI_Reduce_scatter_block(copy.data(), o.recv_buf, cnt, t, mpi_op(o.red, o.type), c);
      if (o.red == ncclAvg) divide(o.recv_buf, o.count, o.type, n);
      break;
    }
    default:
      break;
  }
}

// One group (or one call): point-to-point posted first (the sends, then each receive once its
// message is there and has the receive's size), collectives in order, then the wait. A receive
// whose matching send has another size is fatal: on a GPU, NCCL's receive waits for the count it
// was given, and the job hangs.
void run_ops(const std::vector<op> &ops) {
  std::vector<MPI_Request> reqs;
  for (const op &o : ops) {
    if (o.kind != op::send) continue;
    MPI_Request r;
    MPI_Isend(o.send_buf, (int)(o.count * type_size(o.type)), MPI_BYTE, o.peer, 0, o.comm->mpi, &r);
    reqs.push_back(r);
  }
  for (const op &o : ops) {
    if (o.kind != op::recv) continue;
    const int want = (int)(o.count * type_size(o.type));
    MPI_Status st;
    int got = -1;
    MPI_Probe(o.peer, 0, o.comm->mpi, &st);  // every rank's sends are posted: no wait on a cycle
    MPI_Get_count(&st, MPI_BYTE, &got);
    if (got != want)
      fatal(
          "ncclRecv of %zu elements (%d bytes) from rank %d met an ncclSend of %d bytes: a send "
          "and its receive must have one count (NCCL would hang)",
          o.count, want, o.peer, got);
    MPI_Request r;
    MPI_Irecv(o.recv_buf, want, MPI_BYTE, o.peer, 0, o.comm->mpi, &r);
    reqs.push_back(r);
  }
  for (const op &o : ops)
    if (o.kind != op::send && o.kind != op::recv) run_collective(o);
  if (!reqs.empty()) MPI_Waitall((int)reqs.size(), reqs.data(), MPI_STATUSES_IGNORE);
}

const char *op_name(op::kind_t k) {
  static const char *names[] = {"ncclAllReduce",     "ncclReduce", "ncclBroadcast", "ncclAllGather",
                                "ncclReduceScatter", "ncclSend",   "ncclRecv"};
  return names[k];
}

// CUDAEMU_NCCL_HANG: whether this operation is the one that never completes on this rank.
bool hangs_here() {
  static long count = 0;
  if (config().nccl_hang_rank < 0) return false;
  int world = -1;
  MPI_Comm_rank(MPI_COMM_WORLD, &world);
  return world == config().nccl_hang_rank && ++count == config().nccl_hang_op;
}

void enqueue(const std::vector<op> &ops) {
  if (ops.empty()) return;
  // the group runs at the first operation's stream's turn; the other streams' earlier work is
  // run first (a conservative ordering, docs/cudaemu.md)
  for (const op &o : ops)
    if (o.stream != ops[0].stream) drain_stream(o.stream);
  const char *what = ops.size() == 1 ? op_name(ops[0].kind) : "NCCL group";
  if (hangs_here()) {  // this rank never takes part: its peers wait in MPI for it
    submit_hang(ops[0].stream, what, ops[0].comm);
    return;
  }
  submit(ops[0].stream, what, [ops] { run_ops(ops); });
}

bool buffer_ok(const void *p, size_t bytes) { return bytes == 0 || device_range(p, bytes, false); }

ncclResult_t check_and_queue(const op &o, size_t send_elems, size_t recv_elems) {
  const char *fn = op_name(o.kind);
  if (!o.comm || o.comm->destroyed)
    return error(ncclInvalidArgument, nullptr, "%s: null or destroyed communicator", fn);
  if (type_size(o.type) == 0 || mpi_type(o.type) == MPI_DATATYPE_NULL)
    return error(ncclInvalidArgument, o.comm, "%s: data type %d is not emulated", fn, (int)o.type);
  if ((unsigned)o.red > ncclAvg)
    return error(ncclInvalidArgument, o.comm, "%s: reduction %d", fn, (int)o.red);
  if ((o.kind == op::reduce || o.kind == op::broadcast || o.kind == op::send ||
       o.kind == op::recv) &&
      (o.peer < 0 || o.peer >= o.comm->nranks))
    return error(ncclInvalidArgument, o.comm, "%s: rank %d outside the communicator of %d", fn,
                 o.peer, o.comm->nranks);
  if (!valid_stream(o.stream))
    return error(ncclInvalidArgument, o.comm, "%s: no such stream %p", fn, (void *)o.stream);
  const size_t sz = type_size(o.type);
  if (!buffer_ok(o.send_buf, send_elems * sz) || !buffer_ok(o.recv_buf, recv_elems * sz))
    return error(ncclInvalidArgument, o.comm,
                 "%s: a buffer is not device memory of the size the call needs (%s; %s)", fn,
                 describe_address(o.send_buf).c_str(), describe_address(o.recv_buf).c_str());
  if (o.count > (size_t)INT32_MAX)
    return error(ncclInvalidArgument, o.comm,
                 "%s: count %zu exceeds what the emulation's MPI "
                 "calls take",
                 fn, o.count);
  trace("%s count=%zu", fn, o.count);
  if (group_depth > 0)
    group_ops.push_back(o);
  else
    enqueue({o});
  return ncclSuccess;
}

}  // namespace
}  // namespace cudaemu

using namespace cudaemu;

namespace {

// The root's side of ncclCommInitRank: gather the members, check them, answer with the world
// ranks in communicator order (reply[0] is the status, reply[1..2] a duplicated pair).
std::vector<int> root_gather(const member &me, int nranks, int tag) {
  std::vector<member> all((size_t)nranks);
  std::vector<int> seen((size_t)nranks, 0), reply((size_t)nranks + 3, 0);
  all[(size_t)me.rank] = me;
  seen[(size_t)me.rank] = 1;
  std::vector<int> from{me.world};
  for (int i = 1; i < nranks; i++) {
    member m;
    MPI_Recv(&m, (int)sizeof m, MPI_BYTE, MPI_ANY_SOURCE, tag, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    from.push_back(m.world);
    if (m.nranks != nranks || m.rank < 0 || m.rank >= nranks || seen[(size_t)m.rank]++) {
      reply[0] = 2;  // inconsistent arguments
      continue;
    }
    all[(size_t)m.rank] = m;
  }
  for (int a = 0; a < nranks && !reply[0]; a++)
    for (int b = 0; b < a && !reply[0]; b++)
      if (all[(size_t)a].device == all[(size_t)b].device &&
          !strcmp(all[(size_t)a].host, all[(size_t)b].host))
        reply[0] = 1, reply[1] = a, reply[2] = b;
  for (int r = 0; r < nranks; r++) reply[(size_t)r + 3] = all[(size_t)r].world;
  for (int w : from)
    if (w != me.world)
      MPI_Send(reply.data(), (int)reply.size(), MPI_INT, w, tag + 1, MPI_COMM_WORLD);
  return reply;
}

}  // namespace

extern "C" {

ncclResult_t ncclGetVersion(int *version) {
  if (!version) return ncclInvalidArgument;
  *version = NCCL_VERSION_CODE;
  return ncclSuccess;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId *uid) {
  if (!uid) return error(ncclInvalidArgument, nullptr, "ncclGetUniqueId: null id");
  int init = 0;
  MPI_Initialized(&init);
  if (!init)
    return error(ncclSystemError, nullptr, "the emulated NCCL runs over MPI: call MPI_Init first");
  id_contents c{kMagic, ++id_serial, 0, (int)getpid()};
  MPI_Comm_rank(MPI_COMM_WORLD, &c.root_world);
  std::memset(uid, 0, sizeof *uid);
  std::memcpy(uid->internal, &c, sizeof c);
  return ncclSuccess;
}

ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId uid, int rank) {
  id_contents c;
  std::memcpy(&c, uid.internal, sizeof c);
  if (!comm || nranks < 1 || rank < 0 || rank >= nranks || c.magic != kMagic)
    return error(ncclInvalidArgument, nullptr, "ncclCommInitRank: nranks %d, rank %d%s", nranks,
                 rank, c.magic != kMagic ? ", an id ncclGetUniqueId did not make" : "");
  int init = 0, ndev = 0;
  MPI_Initialized(&init);
  if (!init)
    return error(ncclSystemError, nullptr, "the emulated NCCL runs over MPI: call MPI_Init first");
  if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0)
    return error(ncclUnhandledCudaError, nullptr, "ncclCommInitRank: no CUDA device");
  member me{};
  MPI_Comm_rank(MPI_COMM_WORLD, &me.world);
  me.rank = rank, me.nranks = nranks, me.device = current_device();
  snprintf(me.host, sizeof me.host, "%s", host_name());
  const int tag = kTagBase + (int)(c.serial % 300) * 2;
  std::vector<int> reply((size_t)nranks + 3);
  if (me.world == c.root_world) {
    reply = root_gather(me, nranks, tag);
  } else {
    MPI_Send(&me, (int)sizeof me, MPI_BYTE, c.root_world, tag, MPI_COMM_WORLD);
    MPI_Recv(reply.data(), (int)reply.size(), MPI_INT, c.root_world, tag + 1, MPI_COMM_WORLD,
             MPI_STATUS_IGNORE);
  }
  if (reply[0] == 1)
    return error(ncclInvalidUsage, nullptr,
                 "Duplicate GPU detected : rank %d and rank %d both on CUDA device %d of host %s "
                 "(NCCL refuses two ranks of one communicator on one device)",
                 reply[1], reply[2], me.device, me.host);
  if (reply[0] == 2)
    return error(ncclInvalidUsage, nullptr,
                 "ncclCommInitRank: the members disagree on nranks or hold the same rank");
  MPI_Group world, members;
  MPI_Comm_group(MPI_COMM_WORLD, &world);
  MPI_Group_incl(world, nranks, reply.data() + 3, &members);
  ncclComm *cm = new ncclComm;
  MPI_Comm_create_group(MPI_COMM_WORLD, members, tag, &cm->mpi);
  MPI_Group_free(&members);
  MPI_Group_free(&world);
  cm->nranks = nranks, cm->rank = rank, cm->device = me.device;
  *comm = cm;
  return ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  if (!comm || comm->destroyed) return ncclInvalidArgument;
  drain_all();  // its queued operations still run
  MPI_Comm_free(&comm->mpi);
  comm->destroyed = true;  // kept, so a later use is reported rather than undefined
  return ncclSuccess;
}

// Ends the communicator's operations in flight (those that never complete among them) without
// waiting for them, as NCCL's abort does, then frees it.
ncclResult_t ncclCommAbort(ncclComm_t comm) {
  if (!comm || comm->destroyed) return ncclInvalidArgument;
  release_hangs(comm);
  MPI_Comm_free(&comm->mpi);
  comm->destroyed = true;
  return ncclSuccess;
}

// The emulation's operations fail at their call or end the run: no error is ever pending.
ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *asyncError) {
  if (!comm || comm->destroyed || !asyncError) return ncclInvalidArgument;
  *asyncError = ncclSuccess;
  return ncclSuccess;
}

ncclResult_t ncclCommCount(const ncclComm_t comm, int *count) {
  if (!comm || comm->destroyed || !count) return ncclInvalidArgument;
  *count = comm->nranks;
  return ncclSuccess;
}

ncclResult_t ncclCommUserRank(const ncclComm_t comm, int *rank) {
  if (!comm || comm->destroyed || !rank) return ncclInvalidArgument;
  *rank = comm->rank;
  return ncclSuccess;
}

ncclResult_t ncclCommCuDevice(const ncclComm_t comm, int *device) {
  if (!comm || comm->destroyed || !device) return ncclInvalidArgument;
  *device = comm->device;
  return ncclSuccess;
}

const char *ncclGetErrorString(ncclResult_t r) {
  switch (r) {
    case ncclSuccess:
      return "no error";
    case ncclUnhandledCudaError:
      return "unhandled cuda error";
    case ncclSystemError:
      return "unhandled system error";
    case ncclInternalError:
      return "internal error";
    case ncclInvalidArgument:
      return "invalid argument";
    case ncclInvalidUsage:
      return "invalid usage";
    case ncclRemoteError:
      return "remote process exited or there was a network error";
    case ncclInProgress:
      return "NCCL operation in progress";
    default:
      return "unknown result code";
  }
}

const char *ncclGetLastError(ncclComm_t comm) {
  return comm ? comm->last_error.c_str() : cudaemu::last_error.c_str();
}

ncclResult_t ncclAllReduce(const void *s, void *r, size_t count, ncclDataType_t t, ncclRedOp_t red,
                           ncclComm_t comm, cudaStream_t stream) {
  return check_and_queue({op::allreduce, comm, s, r, count, t, red, 0, stream}, count, count);
}

ncclResult_t ncclReduce(const void *s, void *r, size_t count, ncclDataType_t t, ncclRedOp_t red,
                        int root, ncclComm_t comm, cudaStream_t stream) {
  const bool at_root = comm && root == comm->rank;
  return check_and_queue({op::reduce, comm, s, r, count, t, red, root, stream}, count,
                         at_root ? count : 0);
}

ncclResult_t ncclBroadcast(const void *s, void *r, size_t count, ncclDataType_t t, int root,
                           ncclComm_t comm, cudaStream_t stream) {
  const bool at_root = comm && root == comm->rank;
  return check_and_queue({op::broadcast, comm, s, r, count, t, ncclSum, root, stream},
                         at_root ? count : 0, count);
}

ncclResult_t ncclAllGather(const void *s, void *r, size_t count, ncclDataType_t t, ncclComm_t comm,
                           cudaStream_t stream) {
  const size_t n = comm ? (size_t)comm->nranks : 0;
  return check_and_queue({op::allgather, comm, s, r, count, t, ncclSum, 0, stream}, count,
                         count * n);
}

ncclResult_t ncclReduceScatter(const void *s, void *r, size_t count, ncclDataType_t t,
                               ncclRedOp_t red, ncclComm_t comm, cudaStream_t stream) {
  const size_t n = comm ? (size_t)comm->nranks : 0;
  return check_and_queue({op::reducescatter, comm, s, r, count, t, red, 0, stream}, count * n,
                         count);
}

ncclResult_t ncclSend(const void *s, size_t count, ncclDataType_t t, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
  return check_and_queue({op::send, comm, s, nullptr, count, t, ncclSum, peer, stream}, count, 0);
}

ncclResult_t ncclRecv(void *r, size_t count, ncclDataType_t t, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
  return check_and_queue({op::recv, comm, nullptr, r, count, t, ncclSum, peer, stream}, 0, count);
}

ncclResult_t ncclGroupStart(void) {
  group_depth++;
  return ncclSuccess;
}

ncclResult_t ncclGroupEnd(void) {
  if (group_depth == 0)
    return error(ncclInvalidUsage, nullptr, "ncclGroupEnd without ncclGroupStart");
  if (--group_depth == 0) {
    std::vector<op> ops;
    ops.swap(group_ops);
    enqueue(ops);
  }
  return ncclSuccess;
}

}  // extern "C"
