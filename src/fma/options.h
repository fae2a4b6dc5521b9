/* FMA's own settings (SPEC §6.4–6.5), as plain values: the deck's attention.fma.* section, read
 * once into struct fma_options by the adapter (attention/fma.c). Nothing under src/fma/ includes
 * config.h; config.h includes this file only to type its fma fields with these enums. */
#ifndef FMATTN_FMA_OPTIONS_H
#define FMATTN_FMA_OPTIONS_H

#include <stdbool.h>

#ifdef __cplusplus
extern "C" {
#endif

/* fma.downsample: how a window is summarised (conv: the paper; m2m: hierarchical; avg: fixed). */
enum fma_downsample { FMA_DOWN_CONV, FMA_DOWN_M2M, FMA_DOWN_AVG };
/* fma.init: learned summaries start as the avg one (mean), or uniform ±1/√fan_in (random). */
enum fma_init_kind { FMA_INIT_MEAN, FMA_INIT_RANDOM };
/* fma.down_lr: summary weights learn at lr·p/taps (scaled) or at lr (plain); docs/fma.md. */
enum fma_down_lr { FMA_LR_SCALED, FMA_LR_PLAIN };

/* fma.open = all: every candidate window is opened (SPEC §6.4a; fma then equals full attention). */
#define FMA_OPEN_ALL (-1)

struct fma_options {
  int m;                    /* fma.m: fine block, tokens */
  int p;                    /* fma.p: summaries per window (divides m) */
  enum fma_downsample down; /* fma.downsample */
  enum fma_init_kind init;  /* fma.init */
  enum fma_down_lr down_lr; /* fma.down_lr */
  bool linear_zero_values;  /* fma.linear_zero_values: fma_linear's value summaries start at 0 */
  bool multiplicity;        /* fma.multiplicity: add log(w_l/p) to coarse scores */
  int open; /* fma.open: far windows a query opens per level by content (0: none; FMA_OPEN_ALL) */
};

#ifdef __cplusplus
}
#endif

#endif
