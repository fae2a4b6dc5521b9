/* Interaction lists of FMA (fma/lists.h). */
#include "fma/lists.h"

int fma_lists_near(const struct fma_tree *tree, bool causal, long b, long *blocks) {
  int count = 0;
  long last = causal ? b : b + 1;
  for (long x = b - 1; x <= last; x++)
    if (x >= 0 && x < tree->nblocks) blocks[count++] = x;
  return count;
}

int fma_lists_level(const struct fma_tree *tree, bool causal, int l, long c, long *windows) {
  long cand[FMA_LIST_MAX];
  int nc = 0;
  if (causal) {
    if (c % 2 == 1) cand[nc++] = c - 3;
    cand[nc++] = c - 2;
  } else if (c % 2 == 0) {
    cand[nc++] = c - 2;
    cand[nc++] = c + 2;
    cand[nc++] = c + 3;
  } else {
    cand[nc++] = c - 3;
    cand[nc++] = c - 2;
    cand[nc++] = c + 2;
  }
  int count = 0;
  for (int k = 0; k < nc; k++)
    if (cand[k] >= 0 && cand[k] < tree->nwindows[l]) windows[count++] = cand[k];
  return count;
}

int fma_lists_band(const struct fma_tree *tree, bool causal, long i, long j) {
  if (causal && j > i) return -1;
  long bi = i / tree->m, bj = j / tree->m;
  long d = bj - bi;
  if (d == 0 || d == -1 || (!causal && d == 1)) return 0;
  for (int l = 1; l <= tree->levels; l++) {
    long list[FMA_LIST_MAX];
    int cnt = fma_lists_level(tree, causal, l, i / tree->window[l], list);
    long cj = j / tree->window[l];
    for (int k = 0; k < cnt; k++)
      if (list[k] == cj) return l;
  }
  return -1;
}
