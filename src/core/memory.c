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

#ifdef FMATTN_SMPI
#include <smpi/smpi.h>
#endif

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

static void count_block(enum mem_label label, size_t bytes) {
#pragma omp critical(fmattn_memory)
  {
    mem_cur_[label] += bytes;
    if (mem_cur_[label] > mem_peak_[label]) mem_peak_[label] = mem_cur_[label];
    mem_total_cur_ += bytes;
    if (mem_total_cur_ > mem_total_peak_) mem_total_peak_ = mem_total_cur_;
  }
}

static void uncount_block(enum mem_label label, size_t bytes) {
#pragma omp critical(fmattn_memory)
  {
    mem_cur_[label] -= bytes;
    mem_total_cur_ -= bytes;
  }
}

#ifdef FMATTN_SMPI
/* Folded memory, for simulations only (FMATTN_SMPI_FOLD=1 in the environment of the SMPI build,
 * run with --cfg=smpi/shared-malloc:local): the activations' and workspaces' blocks of FOLD_MIN
 * bytes or more come from SimGrid's shared malloc, keyed by the block's ordinal on its rank, so
 * the k-th block of every simulated rank lies on the same physical pages while a rank's own
 * blocks never overlap. (SimGrid's global mode maps every block of every rank onto one 1 MiB
 * file: a rank's operands then alias each other and its arithmetic ran 3-8x slower.) The values
 * are garbage where ranks overwrite each other between their bursts; the timings are not: every
 * rank runs its arithmetic on distinct memory of the right size. A folded block is never given
 * back: freed, it waits here for the next request it fits (at most twice its size), so a step's
 * blocks are mapped and faulted once per run, not at every allocation (which made shared malloc
 * 7x slower per step on this VM). Sizes and labels live in this table, never in the shared pages;
 * under SMPI's privatisation each simulated rank has its own. */
#define FOLD_MIN ((size_t)1 << 20)
struct fold_block {
  char *p;
  size_t cap, bytes;
  int label;
  bool used;
};
static struct fold_block *fold_;
static size_t fold_n_, fold_cap_;
static int fold_on_ = -1;

static bool fold_wanted(enum mem_label label, size_t bytes) {
  if (fold_on_ < 0) {
    const char *e = getenv("FMATTN_SMPI_FOLD");
    fold_on_ = e && strcmp(e, "1") == 0;
  }
  return fold_on_ && bytes >= FOLD_MIN && (label == MEM_ACTIVATIONS || label == MEM_WORKSPACE);
}

static void *fold_alloc(enum mem_label label, size_t bytes, bool zero) {
  struct fold_block *best = NULL;
  for (size_t i = 0; i < fold_n_; i++) {
    struct fold_block *b = &fold_[i];
    if (!b->used && b->cap >= bytes && b->cap / 2 <= bytes && (!best || b->cap < best->cap))
      best = b;
  }
  if (!best) {
    if (fold_n_ == fold_cap_) {
      fold_cap_ = fold_cap_ ? 2 * fold_cap_ : 64;
      fold_ = realloc(fold_, sizeof *fold_ * fold_cap_);
      if (!fold_) error("out of memory: the folded blocks' table");
    }
    best = &fold_[fold_n_];
    best->p = smpi_shared_malloc(bytes, "fmattn-fold", (int)fold_n_);
    fold_n_++;
    if (!best->p) error("out of memory: %zu bytes of SimGrid shared memory", bytes);
    best->cap = bytes;
  }
  best->used = true;
  best->bytes = bytes;
  best->label = (int)label;
  if (zero) memset(best->p, 0, bytes);
  count_block(label, bytes);
  return best->p;
}

static bool fold_free(void *ptr) {
  for (size_t i = 0; i < fold_n_; i++)
    if (fold_[i].p == ptr && fold_[i].used) {
      fold_[i].used = false;
      uncount_block((enum mem_label)fold_[i].label, fold_[i].bytes);
      return true;
    }
  return false;
}
#endif

static void *mem_block(enum mem_label label, size_t bytes, bool zero) {
#ifdef FMATTN_SMPI
  if (fold_wanted(label, bytes)) return fold_alloc(label, bytes, zero);
#endif
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
  count_block(label, bytes);
  return (char *)raw + MEM_ALIGN;
}

void *mem_alloc(enum mem_label label, size_t bytes) { return mem_block(label, bytes, true); }

void *mem_alloc_uninit(enum mem_label label, size_t bytes) {
  return mem_block(label, bytes, false);
}

void mem_free(void *ptr) {
  if (!ptr) return;
#ifdef FMATTN_SMPI
  if (fold_on_ > 0 && fold_free(ptr)) return;
#endif
  struct mem_header *h = (struct mem_header *)((char *)ptr - MEM_ALIGN);
  if (h->magic != 0xF3A77E11u) error("mem_free of a pointer not from mem_alloc");
  h->magic = 0;
  uncount_block((enum mem_label)h->label, h->bytes);
  if (h->mapped)
    munmap(h, h->mapped);
  else
    free(h);
}

size_t mem_folded_bytes(void) {
  size_t bytes = 0;
#ifdef FMATTN_SMPI
  for (size_t i = 0; i < fold_n_; i++) bytes += fold_[i].cap;
#endif
  return bytes;
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
