/* Level and window counts of the FMA tree (fma/tree.h). */
#include "fma/tree.h"

#include "core/error.h"

bool fma_tree_exact(long n, int m, int p) {
  if (m < 1 || p < 1 || m % p != 0 || n % m != 0) return false;
  long r = n / m;
  return r >= 2 && (r & (r - 1)) == 0;
}

void fma_tree_build(struct fma_tree *tree, long n, int m, int p) {
  if (n < 1 || m < 1 || p < 1) error("fma tree: n = %ld, m = %d, p = %d", n, m, p);
  tree->n = n;
  tree->m = m;
  tree->p = p;
  tree->nblocks = (n + m - 1) / m;
  long pow2 = 1;
  int log2r = 0;
  while (pow2 < tree->nblocks) {
    pow2 *= 2;
    log2r++;
  }
  tree->levels = log2r >= 1 ? log2r - 1 : 0;
  if (tree->levels > FMA_MAX_LEVELS) error("fma tree: %d levels is too many", tree->levels);
  tree->window[0] = m;
  tree->nwindows[0] = tree->nblocks;
  for (int l = 1; l <= tree->levels; l++) {
    tree->window[l] = (long)m << (l - 1);
    tree->nwindows[l] = (n + tree->window[l] - 1) / tree->window[l];
  }
}
