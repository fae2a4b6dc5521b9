// Device memory of the CUDA back end, the twin of src/memory.c: a pool of blocks by size class, so
// that a step's workspace is reused and cudaMalloc/cudaFree (which synchronises the device) run
// only while the pool grows; every block in use is counted by label in memory.c. FMATTN_GPU_POOL=0
// gives every free back to the driver at once (for memory checkers). Also the copies and the row
// packing that exchanges do on device memory.
#include <cstdlib>
#include <map>
#include <unordered_map>

#include "check.h"
#include "gpu.h"

namespace {

struct Block {
  size_t bytes;
  enum mem_label label;
};

std::unordered_map<void *, Block> live;  // blocks in use
std::multimap<size_t, void *> cached;    // free blocks of the pool, by size
size_t cached_bytes = 0, live_bytes = 0;
int pool_on = -1;  // −1: not read yet

bool pooling() {
  if (pool_on < 0) {
    const char *e = std::getenv("FMATTN_GPU_POOL");
    pool_on = !(e && e[0] == '0');
  }
  return pool_on;
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
  const size_t sz = pooling() ? size_class(bytes) : (bytes ? bytes : 1);
  void *p = nullptr;
  auto it = cached.find(sz);
  if (it != cached.end()) {
    p = it->second;
    cached.erase(it);
    cached_bytes -= sz;
  } else {
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
  }
  live[p] = Block{sz, label};
  live_bytes += sz;
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
  live_bytes -= b.bytes;
  mem_device_account(b.label, -(long long)b.bytes);
  if (pooling()) {  // work queued on the stream finishes before the block's next use is queued
    cached.emplace(b.bytes, dev);
    cached_bytes += b.bytes;
  } else {
    CUDA_CHECK(cudaFree(dev));
  }
  gpu_count_pool(live_bytes, cached_bytes);
}

extern "C" void gpu_release_cache(void) {
  if (cached.empty()) return;
  CUDA_CHECK(cudaStreamSynchronize(gpu_stream()));
  for (auto &c : cached) CUDA_CHECK(cudaFree(c.second));
  cached.clear();
  cached_bytes = 0;
  gpu_count_pool(live_bytes, cached_bytes);
}

extern "C" void gpu_upload(void *dev, const void *host, size_t bytes) {
  if (bytes) CUDA_CHECK(cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, gpu_stream()));
}

extern "C" void gpu_download(void *host, const void *dev, size_t bytes) {
  if (bytes) CUDA_CHECK(cudaMemcpyAsync(host, dev, bytes, cudaMemcpyDeviceToHost, gpu_stream()));
  CUDA_CHECK(cudaStreamSynchronize(gpu_stream()));
}

extern "C" void gpu_copy(void *dst, const void *src, size_t bytes) {
  if (bytes && dst != src)
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, gpu_stream()));
}

extern "C" void gpu_memset0(void *dev, size_t bytes) {
  if (bytes) CUDA_CHECK(cudaMemsetAsync(dev, 0, bytes, gpu_stream()));
}

extern "C" void gpu_sync(void) { CUDA_CHECK(cudaStreamSynchronize(gpu_stream())); }

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
