/* The FMA tree over a 1-D sequence (SPEC §6.4): fine blocks of m tokens (the near field) and
 * levels l = 1..L of windows of w_l = m·2^(l−1) tokens, each summarised by p coarse keys/values.
 * For fma itself n/m is a power of two and L = log2(n/m) − 1; for other n (the distance bands of
 * `full`'s diagnostics) the tree is that of the next power of two, and windows past n are absent.
 * This module only counts; it allocates nothing and decides nothing about interactions. */
#ifndef FMATTN_FMA_TREE_H
#define FMATTN_FMA_TREE_H

#include <stdbool.h>

#ifdef __cplusplus
extern "C" {
#endif

#define FMA_MAX_LEVELS 40

struct fma_tree {
  long n;                            /* sequence length */
  int m;                             /* fine block */
  int p;                             /* summaries per window */
  int levels;                        /* L */
  long nblocks;                      /* ⌈n/m⌉ */
  long window[FMA_MAX_LEVELS + 1];   /* w_l, l = 1..L (window[0] = m, the fine block) */
  long nwindows[FMA_MAX_LEVELS + 1]; /* windows at level l that exist: ⌈n / w_l⌉ */
};

void fma_tree_build(struct fma_tree *tree, long n, int m, int p);
/* True when n/m is a power of two ≥ 2 and p divides m: the exact tree fma requires. */
bool fma_tree_exact(long n, int m, int p);
/* Window of token i at level l (l = 0: its fine block). */
static inline long fma_tree_window_of(const struct fma_tree *tree, int l, long i) {
  return i / tree->window[l];
}

#ifdef __cplusplus
}
#endif

#endif
