// What cu2cc.py turns CUDA syntax into: kernel<<<grid, block, smem, stream>>>(args) becomes
// cudaemu::launch(...), and a __shared__ declaration becomes a reference into the running block's
// shared memory. Only generated code calls these; hand-written code launches with <<<>>> too.
#ifndef CUDAEMU_LAUNCH_H
#define CUDAEMU_LAUNCH_H

#include <cstddef>
#include <functional>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>

namespace cudaemu {

struct launch_site {
  const char *name;  // the kernel expression as written: "exact_fwd<D>"
  const char *file;
  int line;
};

struct launch_config {
  dim3 grid, block;
  size_t smem;
  cudaStream_t stream;
  launch_config(dim3 g, dim3 b, size_t s = 0, cudaStream_t st = 0)
      : grid(g), block(b), smem(s), stream(st) {}
};

// Checks the configuration and the pointer arguments (`pointers`, one per parameter, null for a
// parameter that is no pointer), then queues `body` (one CUDA thread) on the stream.
void launch_kernel(const launch_site &site, const void *func, const launch_config &cfg,
                   const void *const *pointers, const bool *is_pointer, int nparams,
                   std::function<void()> body);

template <class T>
inline const void *pointer_of(const T &v, bool *is_ptr) {
  if constexpr (std::is_pointer<T>::value) {
    *is_ptr = true;
    return reinterpret_cast<const void *>(v);
  } else {
    *is_ptr = false;
    return nullptr;
  }
}

template <class Tuple, size_t... I>
inline void pointers_of(const Tuple &t, const void **out, bool *is_ptr, std::index_sequence<I...>) {
  ((out[I] = pointer_of(std::get<I>(t), &is_ptr[I])), ...);
}

// Kernel parameters are copied once at launch (converted to the parameter types, as CUDA does)
// and again into every CUDA thread's by-value parameters.
template <class... P, class... A>
void launch(void (*kernel)(P...), const launch_site &site, const launch_config &cfg, A &&...args) {
  static_assert(sizeof...(P) == sizeof...(A), "kernel launched with the wrong number of arguments");
  using params_t = std::tuple<std::remove_cv_t<std::remove_reference_t<P>>...>;
  auto params = std::make_shared<params_t>(std::forward<A>(args)...);
  constexpr size_t n = sizeof...(P);
  const void *ptrs[n + 1] = {};
  bool is_ptr[n + 1] = {};
  pointers_of(*params, ptrs, is_ptr, std::make_index_sequence<n>{});
  launch_kernel(site, reinterpret_cast<const void *>(kernel), cfg, ptrs, is_ptr, (int)n,
                [kernel, params] { std::apply(kernel, *params); });
}

// ---- shared memory ----
// One per __shared__ declaration (a function-local static, so one per template instance, as
// on the GPU): where the declaration's object lives in the current block.
struct shared_slot {
  unsigned long long block = 0;   // the block whose object `ptr` is
  unsigned long long launch = 0;  // the launch that placed it
  void *ptr = nullptr;
};
extern unsigned long long g_block_serial;
void *shared_place(shared_slot *slot, size_t size, size_t align, const char *name, const char *file,
                   int line);
template <class T>
inline T &shared(shared_slot &slot, size_t align, const char *name, const char *file, int line) {
  if (slot.block != g_block_serial)
    shared_place(&slot, sizeof(T), alignof(T) > align ? alignof(T) : align, name, file, line);
  return *static_cast<T *>(slot.ptr);
}
// extern __shared__ T name[]: the block's dynamic shared memory.
void *dynamic_shared(size_t align, const char *file, int line);

}  // namespace cudaemu

#endif
