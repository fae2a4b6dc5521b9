/* The interaction lists of FMA (SPEC §6.4): the ONE place that decides which keys a query sees,
 * exactly (near field) or through which level's summaries (far field). The operators, decoding,
 * the diagnostics of other variants and the locally essential tree ask here (the tests' oracle
 * keeps its own, from the SPEC text, to compare). Windows or blocks outside [0, n) are never
 * listed. */
#ifndef FMATTN_FMA_LISTS_H
#define FMATTN_FMA_LISTS_H

#include <stdbool.h>

#include "fma/tree.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FMA_LIST_MAX 3
/* A listed window is at most this many windows from the query's own (the LET plan relies on it). */
#define FMA_LIST_REACH 3

/* Near-field blocks of fine block b: causal b−1, b; bidirectional b−1, b, b+1. Returns the count;
 * blocks[] receives the existing ones in increasing order. In causal mode block b itself is seen
 * only up to the query (the caller masks j > i). */
int fma_lists_near(const struct fma_tree *tree, bool causal, long b, long *blocks);

/* Level-l windows in the list of a query whose level-l window is c: causal c even → c−2, c odd →
 * c−3, c−2; bidirectional c even → c−2, c+2, c+3, c odd → c−3, c−2, c+2. Returns the count of
 * existing windows, written in increasing order. */
int fma_lists_level(const struct fma_tree *tree, bool causal, int l, long c, long *windows);

/* The band through which query i sees key j: 0 = near field, l ≥ 1 = level l, −1 = not seen
 * (masked by causality). Every allowed pair is covered exactly once (tested). */
int fma_lists_band(const struct fma_tree *tree, bool causal, long i, long j);

#ifdef __cplusplus
}
#endif

#endif
