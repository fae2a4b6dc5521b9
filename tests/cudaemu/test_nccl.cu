// The emulated NCCL on several MPI ranks (test_nccl.sh: 2 ranks on 2 emulated devices) against
// MPI's own results: allreduce (sum, max, avg; float, double, int, bf16; in place and not),
// broadcast, reduce, allgather, reduce-scatter, grouped send/recv around a ring, a communicator
// that not every world rank joins, and the queries and argument checks. `test_nccl refuse`
// (every rank on device 0) checks that two ranks on one device are refused as NCCL refuses;
// `test_nccl longer-recv` / `longer-send` plant a send and receive of different counts, which
// the emulation must refuse (NCCL would hang).
#include <mpi.h>
#include <nccl.h>

#include <cstdio>
#include <string>

#include <cuda_bf16.h>

#include "emu_test.h"

static int rank_, size_;
static ncclComm_t comm_;
static std::string failure_;

// A check on this rank; every test ends by agreeing over all ranks (a cmocka failure on one rank
// alone would leave the others waiting in a collective).
#define EXPECT(cond)                                                                               \
  do {                                                                                             \
    if (!(cond) && failure_.empty())                                                               \
      failure_ =                                                                                   \
          "rank " + std::to_string(rank_) + ": " #cond " (line " + std::to_string(__LINE__) + ")"; \
  } while (0)

static void agree() {
  int ok = failure_.empty(), all = 0;
  MPI_Allreduce(&ok, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  const std::string f = failure_;
  failure_.clear();
  if (!all) fail_msg("%s", f.empty() ? "another rank failed" : f.c_str());
}

#define NCCL_OK(call) EXPECT((call) == ncclSuccess)

static std::vector<float> mine(size_t n, int salt) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; i++)
    v[i] = (float)((int)((i * 31 + (size_t)rank_ * 7 + (size_t)salt) % 23) - 11) / 8.0f;
  return v;
}

static void test_allreduce(void **) {
  const size_t n = 1001;
  const std::vector<float> x = mine(n, 1);
  std::vector<float> sum(n), mx(n);
  MPI_Allreduce(x.data(), sum.data(), (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  MPI_Allreduce(x.data(), mx.data(), (int)n, MPI_FLOAT, MPI_MAX, MPI_COMM_WORLD);
  float *d = upload(x), *out = dev_alloc<float>(n);
  NCCL_OK(ncclAllReduce(d, out, n, ncclFloat, ncclSum, comm_, 0));  // out of place
  EXPECT(download(out, n) == sum);
  NCCL_OK(ncclAllReduce(d, d, n, ncclFloat, ncclMax, comm_, 0));  // in place
  EXPECT(download(d, n) == mx);
  CUDA_OK(cudaMemcpy(d, x.data(), 4 * n, cudaMemcpyHostToDevice));
  NCCL_OK(ncclAllReduce(d, out, n, ncclFloat, ncclAvg, comm_, 0));
  const std::vector<float> avg = download(out, n);
  for (size_t i = 0; i < n; i++) EXPECT(avg[i] == sum[i] / (float)size_);
  // double and int
  std::vector<double> xd(x.begin(), x.end()), sd(n);
  MPI_Allreduce(xd.data(), sd.data(), (int)n, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
  double *dd = upload(xd);
  NCCL_OK(ncclAllReduce(dd, dd, n, ncclDouble, ncclSum, comm_, 0));
  EXPECT(download(dd, n) == sd);
  std::vector<int> xi(n), si(n);
  for (size_t i = 0; i < n; i++) xi[i] = (int)i * (rank_ + 1);
  MPI_Allreduce(xi.data(), si.data(), (int)n, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  int *di = upload(xi);
  NCCL_OK(ncclAllReduce(di, di, n, ncclInt32, ncclSum, comm_, 0));
  EXPECT(download(di, n) == si);
  // bf16: the sum of every rank's bf16 values, rounded to bf16 (exact here: few, short values)
  std::vector<__nv_bfloat16> xb(x.begin(), x.end());
  __nv_bfloat16 *db = upload(xb);
  NCCL_OK(ncclAllReduce(db, db, n, ncclBfloat16, ncclSum, comm_, 0));
  const std::vector<__nv_bfloat16> gb = download(db, n);
  for (size_t i = 0; i < n; i++) EXPECT(gb[i].__x == __float2bfloat16(sum[i]).__x);
  for (void *p : {(void *)d, (void *)out, (void *)dd, (void *)di, (void *)db}) CUDA_OK(cudaFree(p));
  agree();
}

static void test_rooted(void **) {
  const size_t n = 257;
  const int root = size_ - 1;
  const std::vector<float> x = mine(n, 2);
  std::vector<float> want = x, sum(n);
  MPI_Bcast(want.data(), (int)n, MPI_FLOAT, root, MPI_COMM_WORLD);
  MPI_Reduce(x.data(), sum.data(), (int)n, MPI_FLOAT, MPI_SUM, 0, MPI_COMM_WORLD);
  float *d = upload(x), *r = dev_alloc<float>(n);
  NCCL_OK(ncclBroadcast(d, r, n, ncclFloat, root, comm_, 0));
  EXPECT(download(r, n) == want);
  NCCL_OK(ncclReduce(d, r, n, ncclFloat, ncclSum, 0, comm_, 0));
  if (rank_ == 0) EXPECT(download(r, n) == sum);
  CUDA_OK(cudaFree(d));
  CUDA_OK(cudaFree(r));
  agree();
}

static void test_gather_scatter(void **) {
  const size_t n = 100;
  const std::vector<float> x = mine(n, 3);
  std::vector<float> all(n * (size_t)size_), part(n), full = mine(n * (size_t)size_, 4);
  MPI_Allgather(x.data(), (int)n, MPI_FLOAT, all.data(), (int)n, MPI_FLOAT, MPI_COMM_WORLD);
  MPI_Reduce_scatter_block(full.data(), part.data(), (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  float *d = upload(x), *g = dev_alloc<float>(all.size()), *f = upload(full),
        *p = dev_alloc<float>(n);
  NCCL_OK(ncclAllGather(d, g, n, ncclFloat, comm_, 0));
  EXPECT(download(g, all.size()) == all);
  CUDA_OK(cudaMemcpy(g + (size_t)rank_ * n, x.data(), 4 * n, cudaMemcpyHostToDevice));
  NCCL_OK(ncclAllGather(g + (size_t)rank_ * n, g, n, ncclFloat, comm_, 0));  // in place
  EXPECT(download(g, all.size()) == all);
  NCCL_OK(ncclReduceScatter(f, p, n, ncclFloat, ncclSum, comm_, 0));
  EXPECT(download(p, n) == part);
  NCCL_OK(
      ncclReduceScatter(f, f + (size_t)rank_ * n, n, ncclFloat, ncclSum, comm_, 0));  // in place
  EXPECT(download(f + (size_t)rank_ * n, n) == part);
  for (void *q : {(void *)d, (void *)g, (void *)f, (void *)p}) CUDA_OK(cudaFree(q));
  agree();
}

// Around the ring: each rank sends to the next and receives from the previous, in one group.
static void test_send_recv(void **) {
  const size_t n = 333;
  const int next = (rank_ + 1) % size_, prev = (rank_ + size_ - 1) % size_;
  const std::vector<float> x = mine(n, 5);
  std::vector<float> want(n);
  MPI_Sendrecv(x.data(), (int)n, MPI_FLOAT, next, 9, want.data(), (int)n, MPI_FLOAT, prev, 9,
               MPI_COMM_WORLD, MPI_STATUS_IGNORE);
  float *d = upload(x), *r = dev_alloc<float>(n);
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  NCCL_OK(ncclGroupStart());
  NCCL_OK(ncclSend(d, n, ncclFloat, next, comm_, s));
  NCCL_OK(ncclRecv(r, n, ncclFloat, prev, comm_, s));
  NCCL_OK(ncclGroupEnd());
  CUDA_OK(cudaStreamSynchronize(s));
  EXPECT(download(r, n) == want);
  CUDA_OK(cudaStreamDestroy(s));
  CUDA_OK(cudaFree(d));
  CUDA_OK(cudaFree(r));
  agree();
}

// A communicator of the last world rank alone: rank 0 takes no part in making it.
static void test_subset(void **) {
  if (rank_ == size_ - 1) {
    ncclUniqueId id;
    ncclComm_t solo;
    NCCL_OK(ncclGetUniqueId(&id));
    NCCL_OK(ncclCommInitRank(&solo, 1, id, 0));
    int count = 0;
    NCCL_OK(ncclCommCount(solo, &count));
    EXPECT(count == 1);
    const std::vector<float> x = mine(10, 6);
    float *d = upload(x);
    NCCL_OK(ncclAllReduce(d, d, 10, ncclFloat, ncclSum, solo, 0));
    EXPECT(download(d, 10) == x);
    NCCL_OK(ncclCommDestroy(solo));
    CUDA_OK(cudaFree(d));
  }
  agree();
}

static void test_queries(void **) {
  int count = 0, r = -1, dev = -1, version = 0, cur = -1;
  NCCL_OK(ncclCommCount(comm_, &count));
  NCCL_OK(ncclCommUserRank(comm_, &r));
  NCCL_OK(ncclCommCuDevice(comm_, &dev));
  NCCL_OK(ncclGetVersion(&version));
  CUDA_OK(cudaGetDevice(&cur));
  EXPECT(count == size_ && r == rank_ && dev == cur && version == NCCL_VERSION_CODE);
  float host[4] = {0, 0, 0, 0};
  float *d = dev_alloc<float>(4);
  EXPECT(ncclAllReduce(host, host, 4, ncclFloat, ncclSum, comm_, 0) == ncclInvalidArgument);
  EXPECT(ncclAllReduce(d, d, 5, ncclFloat, ncclSum, comm_, 0) == ncclInvalidArgument);  // too long
  EXPECT(ncclAllReduce(d, d, 4, ncclFloat, ncclSum, nullptr, 0) == ncclInvalidArgument);
  EXPECT(ncclBroadcast(d, d, 4, ncclFloat, size_, comm_, 0) == ncclInvalidArgument);   // root
  EXPECT(ncclAllReduce(d, d, 4, ncclHalf, ncclSum, comm_, 0) == ncclInvalidArgument);  // fp16
  EXPECT(std::string(ncclGetErrorString(ncclInvalidUsage)) == "invalid usage");
  CUDA_OK(cudaFree(d));
  agree();
}

static const struct CMUnitTest tests[] = {
    cmocka_unit_test(test_allreduce),      cmocka_unit_test(test_rooted),
    cmocka_unit_test(test_gather_scatter), cmocka_unit_test(test_send_recv),
    cmocka_unit_test(test_subset),         cmocka_unit_test(test_queries),
};

// Every rank on device 0: ncclCommInitRank must fail with ncclInvalidUsage on every rank.
static int refuse() {
  CUDA_OK(cudaSetDevice(0));
  ncclUniqueId id;
  if (rank_ == 0) ncclGetUniqueId(&id);
  MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, MPI_COMM_WORLD);
  ncclComm_t c;
  const ncclResult_t r = ncclCommInitRank(&c, size_, id, rank_);
  const bool refused = r == ncclInvalidUsage && strstr(ncclGetLastError(nullptr), "Duplicate GPU");
  int ok = refused, all = 0;
  MPI_Allreduce(&ok, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (rank_ == 0)
    printf("%s: %s\n", all ? "refused on every rank" : "NOT refused", ncclGetLastError(nullptr));
  return all ? 0 : 1;
}

// A planted defect: rank 1 receives `recv` floats where rank 0 sends `send` (on a GPU, a hang).
// The emulation must end the job with a message; returning means it did not.
static int mismatch(size_t send, size_t recv) {
  float *d = dev_alloc<float>(send > recv ? send : recv);
  if (rank_ == 0) NCCL_OK(ncclSend(d, send, ncclFloat, 1, comm_, 0));
  if (rank_ == 1) NCCL_OK(ncclRecv(d, recv, ncclFloat, 0, comm_, 0));
  CUDA_OK(cudaStreamSynchronize(0));
  CUDA_OK(cudaFree(d));
  if (rank_ == 0) printf("a send of %zu and a receive of %zu were NOT refused\n", send, recv);
  return 1;
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
  MPI_Comm_size(MPI_COMM_WORLD, &size_);
  int rc;
  if (argc > 1 && !strcmp(argv[1], "refuse")) {
    rc = refuse();
  } else {
    int ndev = 0;
    CUDA_OK(cudaGetDeviceCount(&ndev));
    CUDA_OK(cudaSetDevice(rank_ % ndev));
    ncclUniqueId id;
    if (rank_ == 0) ncclGetUniqueId(&id);
    MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, MPI_COMM_WORLD);
    if (ncclCommInitRank(&comm_, size_, id, rank_) != ncclSuccess) {
      fprintf(stderr, "rank %d: ncclCommInitRank failed: %s\n", rank_, ncclGetLastError(nullptr));
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
    if (argc > 1 && !strcmp(argv[1], "longer-recv")) {
      rc = mismatch(4, 8);
    } else if (argc > 1 && !strcmp(argv[1], "longer-send")) {
      rc = mismatch(8, 4);
    } else {
      if (rank_ != 0 && !freopen("/dev/null", "w", stdout)) return 1;  // one TAP stream
      cmocka_set_message_output(CM_OUTPUT_TAP);
      rc = cmocka_run_group_tests(tests, nullptr, nullptr);
    }
    ncclCommDestroy(comm_);
  }
  MPI_Finalize();
  return rc;
}
