/* The state of one FMA layer (fma.h): the tree, the settings the operators read, the slab, the
 * first summary row of every level and the parameters' layout, from struct fma_options and plain
 * sizes. Every implementation of the operators builds its state here. */
#include <stdlib.h>

#include "error.h"
#include "fma/fma.h"
#include "fma/let.h"

struct fma_state *fma_state_create(const struct fma_options *opt, long n, long d, bool causal,
                                   bool linear, long t0, long T) {
  struct fma_state *st = xcalloc(1, sizeof *st);
  fma_tree_build(&st->tree, n, opt->m, opt->p);
  st->down = opt->down;
  st->causal = causal;
  st->linear = linear;
  st->multiplicity = opt->multiplicity;
  st->d = (int)d;
  st->t0 = t0;
  st->T = T;
  st->klo = t0;
  /* summary rows of level l: its windows' p rows each, levels one after the other */
  long row = 0;
  for (int l = 1; l <= st->tree.levels; l++) {
    st->level_row[l] = row;
    row += st->tree.nwindows[l] * st->tree.p;
  }
  st->level_row[st->tree.levels + 1] = row;
  st->rows = row;
  fma_params_layout(opt, n, d, linear, &st->layout);
  return st;
}

void fma_state_free(struct fma_state *st) {
  if (st) fma_let_free(st->let);
  free(st);
}
