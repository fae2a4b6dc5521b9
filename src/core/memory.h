/* Labelled memory arenas: every large allocation names what it is for (params, grads, optimizer
 * state, activations, workspace, data, communication buffers), so that current and peak bytes can
 * be reported per label in the console summary and in diag.h5. Allocations are 64-byte aligned and
 * zeroed. Device memory is allocated by a device back end and only counted here. */
#ifndef FMATTN_MEMORY_H
#define FMATTN_MEMORY_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

enum mem_label {
  MEM_PARAMS,
  MEM_GRADS,
  MEM_OPTIMIZER,
  MEM_ACTIVATIONS,
  MEM_WORKSPACE,
  MEM_DATA,
  MEM_COMM,
  MEM_NLABELS
};

/* A zeroed block of `bytes`, 64-byte aligned, counted under `label`; out of memory ends the job. */
void *mem_alloc(enum mem_label label, size_t bytes);
/* The same, not zeroed: for a workspace whose every element the caller writes before reading it
 * (a transpose's output, a product's with beta = 0), where zeroing would write it twice, serially
 * where the caller allocates outside a parallel region. */
void *mem_alloc_uninit(enum mem_label label, size_t bytes);
void mem_free(void *ptr);
size_t mem_current(enum mem_label label);
size_t mem_peak(enum mem_label label);
size_t mem_peak_total(void);
void mem_reset_peak(enum mem_label label);
const char *mem_label_name(enum mem_label label);

/* Device memory, counted by label apart from host memory: a device back end allocates it and
 * reports each allocation (+bytes) and release (−bytes) here, so that summaries show both. */
void mem_device_account(enum mem_label label, long long delta);
size_t mem_device_current(enum mem_label label);
size_t mem_device_peak(enum mem_label label);
size_t mem_device_peak_total(void);
void mem_device_reset_peak(enum mem_label label);
/* Every peak, host and device, by label and in all, back to what is in use now. */
void mem_reset_peaks(void);

/* Bytes of this rank's blocks folded onto pages shared by every simulated rank (an SMPI build run
 * with FMATTN_SMPI_FOLD=1; memory.c): 0 otherwise. */
size_t mem_folded_bytes(void);

/* Resident set size high-water mark of this process (from getrusage), bytes. */
size_t mem_process_peak_rss(void);

#ifdef __cplusplus
}
#endif

#endif
