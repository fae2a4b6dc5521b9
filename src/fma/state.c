/* The state of one FMA layer (fma.h): the tree, the settings the operators read, the slab, the
 * first summary row of every level and the parameters' layout, from struct fma_options and plain
 * sizes. Every implementation of the operators builds its state here. */
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "fma/fma.h"
#include "fma/let.h"
#include "fma/open.h"

/* fma.open's layout (fma.h): K_l at each level from the coarsest down — the candidates of level l
 * are at most its listed windows and the two children of each window opened at l + 1 — then the
 * columns of the far row and the decision entries, level L first. */
static void open_layout(struct fma_open_layout *o, const struct fma_tree *tr, bool causal, int K) {
  memset(o, 0, sizeof *o);
  o->K = K;
  if (K == 0) return;
  const int L = tr->levels, listmax = causal ? 2 : FMA_LIST_MAX;
  o->listed = (long)listmax * tr->p * L;
  long col = o->listed;
  int dec = 0, above = 0;
  for (int l = L; l >= 1; l--) {
    long cand = listmax + 2L * above;
    if (cand > tr->nwindows[l]) cand = tr->nwindows[l];
    o->slots[l] = (int)(K == FMA_OPEN_ALL || K > cand ? cand : K);
    o->slot_width[l] = l >= 2 ? 2 * tr->p : tr->m;
    o->col[l] = col;
    o->dec_off[l] = dec;
    col += (long)o->slots[l] * o->slot_width[l];
    dec += o->slots[l];
    above = o->slots[l];
  }
  o->ndec = dec;
  o->width = col;
}

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
  open_layout(&st->open, &st->tree, causal, linear ? 0 : opt->open);
  return st;
}

void fma_state_free(struct fma_state *st) {
  if (st) {
    fma_let_free(st->let);
    fma_open_work_free(st->work);
  }
  free(st);
}
