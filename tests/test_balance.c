/* fma's balanced causal work (fma/balance.c), its plan on every rank of a sequence group built
 * here without MPI: the plan's closed-form counts against the lists read block by block, the
 * parts one rank gives against those its helpers take, the work conserved, and the busiest rank
 * within 5 % of the mean wherever the levels every rank holds carry enough work (the scaling
 * decks: m = 64, p = 4, 8K and 16K tokens per rank, to S = 128). The table of before and after
 * is printed (docs/scaling.md). That the moved work is evaluated right is test_seq's. */
#include "testutil.h"

#include "../src/core/error.h"
#include "../src/fma/balance.h"
#include "../src/fma/let.h"
#include "../src/fma/lists.h"

struct group {
  int S;
  struct fma_state **st;
};

static struct group group_make(long n, int m, int p, enum fma_downsample down, int S) {
  const struct fma_options opt = {.m = m, .p = p, .down = down};
  struct group g = {S, xcalloc((size_t)S, sizeof(struct fma_state *))};
  const long T = n / S;
  for (int r = 0; r < S; r++) {
    struct fma_state *st = fma_state_create(&opt, n, 16, true, false, r * T, T);
    st->let = xcalloc(1, sizeof *st->let);
    st->let->S = S;
    st->let->s = r;
    st->let->lspan = fma_spanning_level(st);
    st->let->bal = fma_balance_plan(st);
    g.st[r] = st;
  }
  return g;
}

static void group_free(struct group *g) {
  for (int r = 0; r < g->S; r++) fma_state_free(g->st[r]);
  free(g->st);
}

/* Near keys and far rows block b lists at levels [lo, hi] (near keys only when near). */
static double block_work(const struct fma_state *st, long b, int lo, int hi, bool near) {
  const struct fma_tree *tr = &st->tree;
  long list[FMA_LIST_MAX];
  double w = near ? (double)fma_lists_near(tr, true, b, list) * tr->m : 0.0;
  for (int l = lo; l <= hi; l++)
    w += (double)fma_lists_level(tr, true, l, b * tr->m / tr->window[l], list) * tr->p;
  return w;
}

/* Each rank's counted work before and after the plan, read block by block; max / mean of each. */
static void counted(const struct group *g, double *before, double *after) {
  double tb = 0, ta = 0, mb = 0, ma = 0;
  for (int r = 0; r < g->S; r++) {
    const struct fma_state *st = g->st[r];
    const struct fma_balance *bal = st->let->bal;
    const int L = st->tree.levels;
    double wb = 0, wa = 0;
    for (long b = st->t0 / st->tree.m; b < (st->t0 + st->T) / st->tree.m; b++) {
      wb += block_work(st, b, 1, L, true);
      wa += block_work(st, b, 1, b >= st->far_cut ? st->far_top : L, true);
    }
    for (long i = 0; bal && i < bal->ntake_blocks; i++)
      wa += block_work(st, bal->take_qb[i], bal->lo, L, false);
    tb += wb;
    ta += wa;
    mb = wb > mb ? wb : mb;
    ma = wa > ma ? wa : ma;
  }
  assert_true(fabs(ta - tb) <= 1e-9 * tb); /* nothing lost, nothing twice */
  *before = mb * g->S / tb;
  *after = ma * g->S / ta;
}

/* What rank r gives to h is what h takes from r, block for block; only the last blocks of a
 * slab are given, whole, at the same levels everywhere. */
static void parts_match(const struct group *g) {
  for (int r = 0; r < g->S; r++) {
    const struct fma_balance *b = g->st[r]->let->bal;
    if (!b) continue;
    for (int i = 0; i < b->ngive; i++) {
      const struct fma_balance_part *give = &b->give[i];
      const struct fma_balance *h = g->st[give->rank]->let->bal;
      assert_non_null(h);
      assert_int_equal(h->lo, b->lo);
      bool found = false;
      for (int j = 0; j < h->ntake; j++)
        if (h->take[j].rank == r) {
          assert_int_equal(h->take[j].b0, give->b0);
          assert_int_equal(h->take[j].b1, give->b1);
          found = true;
        }
      assert_true(found);
      assert_true(give->b0 >= g->st[r]->far_cut || give->b0 == give->b1);
    }
    assert_int_equal(g->st[r]->far_top, b->lo - 1);
    assert_true(b->ngive == 0 || b->ntake == 0);
  }
}

static void check(long per_rank, int m, int p, enum fma_downsample down, int S, double bound) {
  struct group g = group_make(per_rank * S, m, p, down, S);
  double before, after;
  counted(&g, &before, &after);
  parts_match(&g);
  const struct fma_balance *any = NULL;
  for (int r = 0; r < S && !any; r++) any = g.st[r]->let->bal;
  if (any) { /* the plan's own closed-form figures are the counts read block by block */
    assert_true(fabs(any->before - before) <= 1e-9 * before);
    assert_true(fabs(any->after - after) <= 1e-9 * after);
  }
  print_message(
      "  %6ld tokens per rank, m = %d, p = %d, %s, S = %3d: busiest / mean %.3f -> "
      "%.3f%s\n",
      per_rank, m, p, down == FMA_DOWN_M2M ? "m2m " : "conv", S, before, after,
      any ? "" : " (nothing moves)");
  assert_true(after <= before + 1e-12);
  assert_true(after <= bound);
  group_free(&g);
}

static void test_scaling_decks(void **state) {
  (void)state;
  for (int S = 2; S <= 128; S *= 2) check(16384, 64, 4, FMA_DOWN_M2M, S, 1.05);
  for (int S = 2; S <= 128; S *= 2) check(8192, 64, 4, FMA_DOWN_M2M, S, 1.05);
  for (int S = 8; S <= 64; S *= 2) check(16384, 64, 4, FMA_DOWN_CONV, S, 1.05);
}

/* the test decks of test_seq and test_exchanges: few blocks per rank */
static void test_small(void **state) {
  (void)state;
  check(128, 8, 2, FMA_DOWN_M2M, 8, 1.05);
  check(64, 8, 2, FMA_DOWN_M2M, 16, 1.05);
  check(128, 8, 2, FMA_DOWN_M2M, 4, 1.2); /* no level every rank holds lists anything */
  check(8, 4, 2, FMA_DOWN_M2M, 8, 1.5);
  check(4, 4, 2, FMA_DOWN_M2M, 16, 1.5);
  check(32, 8, 4, FMA_DOWN_M2M, 8, 1.5);
}

/* non-causal lists and the other variants do not move anything */
static void test_nothing_moves(void **state) {
  (void)state;
  const struct fma_options opt = {.m = 8, .p = 2, .down = FMA_DOWN_M2M};
  struct fma_state *st = fma_state_create(&opt, 1024, 16, false, false, 896, 128);
  st->let = xcalloc(1, sizeof *st->let);
  st->let->S = 8;
  st->let->s = 7;
  st->let->lspan = fma_spanning_level(st);
  assert_null(fma_balance_plan(st));
  st->causal = true;
  st->linear = true;
  assert_null(fma_balance_plan(st));
  st->linear = false;
  st->open.K = 2;
  assert_null(fma_balance_plan(st));
  st->open.K = 0;
  struct fma_balance *b = fma_balance_plan(st);
  assert_non_null(b);
  assert_true(b->ngive > 0);
  st->let->bal = b;
  fma_state_free(st);
}

static const struct CMUnitTest tests[] = {
    cmocka_unit_test(test_scaling_decks),
    cmocka_unit_test(test_small),
    cmocka_unit_test(test_nothing_moves),
};

TU_MAIN(tests)
