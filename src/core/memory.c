/* Labelled allocation with per-label current/peak accounting (memory.h). Each block carries a
 * 64-byte header recording its label and size, so mem_free needs only the pointer. Blocks of
 * MEM_MAP_MIN bytes or more are anonymous mappings: the kernel zeroes a page when it is first
 * touched, so a large buffer of which a rank uses a part (fma.open's summary rows: every window of
 * the tree, of which a sequence rank fills its slab's and what it fetches) costs that part, not a
 * memset of the whole. That holds for workspaces and communication buffers, which keep small pages;
 * the model's own mappings (parameters, gradients, moments, activations, data), used whole, ask
 * for transparent huge pages, which a kernel set to `madvise` grants only on request: the passes
 * around the GEMMs then stream across a page every 2 MiB, not every 4 KiB (the bench model's step
 * at n = 512: 771 → 764 ms, medians of 6 alternating runs; docs/perf.md). */
#include "core/memory.h"

#include <malloc.h>
#include <stdbool.h>
#include <limits.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>

#include "core/error.h"
#include "core/fault.h"

#define MEM_ALIGN   64
#define MEM_MAP_MIN ((size_t)16 << 20)

struct mem_header {
  size_t bytes;
  size_t mapped; /* the mapping's length, or 0: from posix_memalign */
  int label;
  uint32_t magic;
};

static size_t mem_cur_[MEM_NLABELS];
static size_t mem_peak_[MEM_NLABELS];
static size_t mem_total_cur_;
static size_t mem_total_peak_;

static const char *mem_names_[MEM_NLABELS] = {"params",    "grads", "optimizer", "activations",
                                              "workspace", "data",  "comm"};

/* glibc's malloc serves blocks from 128 KiB up (a threshold it raises as such blocks are freed, to
 * 32 MiB at most) with fresh mappings, and returns the top of the heap to the kernel once 128 KiB
 * of it are free: every such block then faults its pages in again at each use. On a virtual
 * machine whose page faults are dear this was most of the extra per-rank time of fma under
 * sequence parallelism (n = 32K on 2 ranks: attention forward 112 → 36–44 ms, one rank's
 * 16K; docs/scaling.md). Blocks below MEM_MAP_MIN stay on the heap, and the heap keeps what it
 * has held; blocks from MEM_MAP_MIN up are mem_block's own mappings. */
__attribute__((constructor)) static void mem_malloc_settings(void) {
#ifdef M_MMAP_THRESHOLD
  (void)mallopt(M_MMAP_THRESHOLD, (int)MEM_MAP_MIN);
  (void)mallopt(M_TRIM_THRESHOLD, INT_MAX);
#endif
}

static void *mem_block(enum mem_label label, size_t bytes, bool zero) {
  void *raw = NULL;
  size_t mapped = 0;
  if (MEM_ALIGN + bytes >= MEM_MAP_MIN) {
    mapped = MEM_ALIGN + bytes;
    raw = mmap(NULL, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) raw = NULL;
#ifdef MADV_HUGEPAGE
    if (raw && label != MEM_WORKSPACE && label != MEM_COMM)
      (void)madvise(raw, mapped, MADV_HUGEPAGE); /* advice: refused, the pages stay small */
#endif
  } else if (posix_memalign(&raw, MEM_ALIGN, MEM_ALIGN + bytes) == 0) {
    memset(raw, 0, zero ? MEM_ALIGN + bytes : MEM_ALIGN);
  } else {
    raw = NULL;
  }
  if (raw && !zero && fault_uninit_nan()) memset((char *)raw + MEM_ALIGN, 0xff, bytes);
  if (!raw)
    error("out of memory: %zu bytes for %s (in use: %zu bytes in all)", bytes, mem_names_[label],
          mem_total_cur_);
  struct mem_header *h = raw;
  h->bytes = bytes;
  h->mapped = mapped;
  h->label = (int)label;
  h->magic = 0xF3A77E11u;
#pragma omp critical(fmattn_memory)
  {
    mem_cur_[label] += bytes;
    if (mem_cur_[label] > mem_peak_[label]) mem_peak_[label] = mem_cur_[label];
    mem_total_cur_ += bytes;
    if (mem_total_cur_ > mem_total_peak_) mem_total_peak_ = mem_total_cur_;
  }
  return (char *)raw + MEM_ALIGN;
}

void *mem_alloc(enum mem_label label, size_t bytes) { return mem_block(label, bytes, true); }

void *mem_alloc_uninit(enum mem_label label, size_t bytes) {
  return mem_block(label, bytes, false);
}

void mem_free(void *ptr) {
  if (!ptr) return;
  struct mem_header *h = (struct mem_header *)((char *)ptr - MEM_ALIGN);
  if (h->magic != 0xF3A77E11u) error("mem_free of a pointer not from mem_alloc");
  h->magic = 0;
#pragma omp critical(fmattn_memory)
  {
    mem_cur_[h->label] -= h->bytes;
    mem_total_cur_ -= h->bytes;
  }
  if (h->mapped)
    munmap(h, h->mapped);
  else
    free(h);
}

size_t mem_current(enum mem_label label) { return mem_cur_[label]; }
size_t mem_peak(enum mem_label label) { return mem_peak_[label]; }
size_t mem_peak_total(void) { return mem_total_peak_; }
void mem_reset_peak(enum mem_label label) { mem_peak_[label] = mem_cur_[label]; }
const char *mem_label_name(enum mem_label label) { return mem_names_[label]; }

/* Device bytes by label: counted for a device back end, never allocated here. */
static size_t dev_cur_[MEM_NLABELS];
static size_t dev_peak_[MEM_NLABELS];
static size_t dev_total_cur_, dev_total_peak_;

void mem_device_account(enum mem_label label, long long delta) {
#pragma omp critical(fmattn_memory)
  {
    dev_cur_[label] = (size_t)((long long)dev_cur_[label] + delta);
    if (dev_cur_[label] > dev_peak_[label]) dev_peak_[label] = dev_cur_[label];
    dev_total_cur_ = (size_t)((long long)dev_total_cur_ + delta);
    if (dev_total_cur_ > dev_total_peak_) dev_total_peak_ = dev_total_cur_;
  }
}

size_t mem_device_current(enum mem_label label) { return dev_cur_[label]; }
size_t mem_device_peak(enum mem_label label) { return dev_peak_[label]; }
size_t mem_device_peak_total(void) { return dev_total_peak_; }
void mem_device_reset_peak(enum mem_label label) { dev_peak_[label] = dev_cur_[label]; }

void mem_reset_peaks(void) {
  for (int i = 0; i < MEM_NLABELS; i++) mem_peak_[i] = mem_cur_[i], dev_peak_[i] = dev_cur_[i];
  mem_total_peak_ = mem_total_cur_;
  dev_total_peak_ = dev_total_cur_;
}

size_t mem_process_peak_rss(void) {
  struct rusage ru;
  if (getrusage(RUSAGE_SELF, &ru) != 0) return 0;
  return (size_t)ru.ru_maxrss * 1024; /* Linux reports kilobytes */
}
