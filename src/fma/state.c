/* The state of one FMA layer (fma.h): the tree, the settings the operators read, the slab, the
 * first summary row of every level and the parameters' layout, from struct fma_options and plain
 * sizes. Every implementation of the operators builds its state here. */
#include <limits.h>
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

/* Summary rows of level l: the p rows of each of its windows [win_lo, win_hi), levels one after
 * the other. */
static void lay_out_rows(struct fma_state *st) {
  long row = 0;
  for (int l = 1; l <= st->tree.levels; l++) {
    st->level_row[l] = row - st->win_lo[l] * st->tree.p;
    row += (st->win_hi[l] - st->win_lo[l]) * st->tree.p;
  }
  st->level_row[st->tree.levels + 1] = row;
  st->rows = row;
}

int fma_spanning_level(const struct fma_state *st) {
  int lspan = st->tree.levels + 1;
  for (int l = st->tree.levels; l >= 1; l--)
    if (st->tree.window[l] > st->T) lspan = l;
  return lspan;
}

bool fma_level_everywhere(const struct fma_state *st, int l) {
  const int lspan = fma_spanning_level(st);
  return l >= lspan || (l == lspan - 1 && lspan <= st->tree.levels && st->down == FMA_DOWN_M2M);
}

void fma_touched_windows(const struct fma_state *st, long t0, int l, long *lo, long *hi) {
  const struct fma_tree *tr = &st->tree;
  if (fma_level_everywhere(st, l)) {
    *lo = 0;
    *hi = tr->nwindows[l];
    return;
  }
  const long w = tr->window[l], c0 = t0 / w, c1 = (t0 + st->T) / w; /* w ≤ T: whole windows */
  long a = c0, b = c1;
  for (long c = c0; c < c1; c++) {
    long list[FMA_LIST_MAX];
    const int nw = fma_lists_level(tr, st->causal, l, c, list);
    for (int k = 0; k < nw; k++) {
      a = list[k] < a ? list[k] : a;
      b = list[k] + 1 > b ? list[k] + 1 : b;
    }
  }
  if (st->linear) { /* the query rows of the slab's sub-segments */
    const long seg = w / tr->p;
    for (long rho = t0 / seg; rho <= (t0 + st->T - 1) / seg; rho++) {
      const long qrow = fma_linear_query_row(st, rho);
      if (qrow < 0) continue;
      a = qrow / tr->p < a ? qrow / tr->p : a;
      b = qrow / tr->p + 1 > b ? qrow / tr->p + 1 : b;
    }
  }
  *lo = a;
  *hi = b;
}

void fma_state_compact(struct fma_state *st) {
  for (int l = 1; l <= st->tree.levels; l++)
    fma_touched_windows(st, st->t0, l, &st->win_lo[l], &st->win_hi[l]);
  lay_out_rows(st);
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
  st->far_cut = LONG_MAX; /* every level evaluated here until fma_balance_plan says otherwise */
  st->far_top = st->tree.levels;
  for (int l = 1; l <= st->tree.levels; l++) st->win_hi[l] = st->tree.nwindows[l];
  lay_out_rows(st);
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
