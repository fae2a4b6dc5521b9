// The device tables of FMA on the GPU, built on the host once per context from the interaction
// lists of src/fma/lists.c (the one place that decides which keys a query sees) and uploaded:
// each slab query block's far slots and their log-weights (fma), each fma_linear item's query and
// key rows, and the transposes of both (the references of each summary row, in source order).
// No kernel here; nothing decides anything the CPU's lists do not.
#include <cmath>
#include <cstdlib>
#include <vector>

#include "check.h"
#include "fma_gpu.h"
#include "gpu.h"

namespace {

template <class T>
T *upload_vector(const std::vector<T> &v) {
  T *d = static_cast<T *>(gpu_alloc(MEM_WORKSPACE, sizeof(T) * (v.size() ? v.size() : 1)));
  gpu_upload(d, v.data(), sizeof(T) * v.size());
  return d;
}

constexpr int kLightRefs = 32;  // gpu_fma_set_light_refs's default
int light_refs = kLightRefs;    // the most references of a row the scatter sums with one warp

// The transposes of table (sources × slots) of global summary rows (−1: none), over `rows` rows.
gfma_refs build_refs(const std::vector<int> &table, long sources, int slots, long rows) {
  std::vector<int> count((size_t)rows + 1, 0);
  for (long e = 0; e < sources * slots; e++)
    if (table[(size_t)e] >= 0) count[(size_t)table[(size_t)e]]++;
  std::vector<int> row, off(1, 0);
  std::vector<long> start((size_t)rows, -1);
  for (long R = 0; R < rows; R++)
    if (count[(size_t)R] > 0) {
      start[(size_t)R] = (long)row.size();
      row.push_back((int)R);
      off.push_back(off.back() + count[(size_t)R]);
    }
  std::vector<int> ref((size_t)off.back()), fill(row.size(), 0);
  for (long e = 0; e < sources * slots; e++) {  // sources ascending: each row's refs in order
    const int R = table[(size_t)e];
    if (R < 0) continue;
    const long k = start[(size_t)R];
    ref[(size_t)(off[(size_t)k] + fill[(size_t)k]++)] = (int)e;
  }
  std::vector<int> light, heavy;  // the rows a warp sums, and those a block does
  for (size_t k = 0; k < row.size(); k++)
    (off[k + 1] - off[k] <= light_refs ? light : heavy).push_back((int)k);
  gfma_refs refs;
  refs.nrows = (long)row.size();
  refs.row = upload_vector(row);
  refs.off = upload_vector(off);
  refs.ref = upload_vector(ref);
  refs.nlight = (long)light.size();
  refs.nheavy = (long)heavy.size();
  refs.light = upload_vector(light);
  refs.heavy = upload_vector(heavy);
  return refs;
}

void free_refs(gfma_refs *r) {
  for (int *p : {r->row, r->off, r->ref, r->light, r->heavy}) gpu_free(p);
}

// fma: the far slots of every slab query block — level l's windows from fma_lists_level, p rows
// each, in the level's nlist·p slots; the rest −1 — and each slot's log-weight (fma_block_keys'
// log(w_l/p) when fma.multiplicity is on).
void build_far(gfma *g) {
  const fma_state *st = g->st;
  const fma_tree *tr = &st->tree;
  g->nfmax = g->L * g->nlist * (int)g->p;
  std::vector<int> far((size_t)(g->nbs * g->nfmax > 0 ? g->nbs * g->nfmax : 0), -1);
  std::vector<float> logw((size_t)g->nfmax, 0.0f);
  for (int l = 1; l <= g->L; l++) {
    const float lw = st->multiplicity ? logf((float)(tr->window[l] / tr->p)) : 0.0f;
    for (long e = 0; e < g->nlist * g->p; e++) logw[(size_t)((l - 1) * g->nlist * g->p + e)] = lw;
  }
  for (long lb = 0; lb < g->nbs; lb++) {
    const long qb = g->b0 + lb;
    for (int l = 1; l <= g->L; l++) {
      long windows[FMA_LIST_MAX];
      const int nw = fma_lists_level(tr, st->causal, l, qb * tr->m / tr->window[l], windows);
      int *slot = far.data() + lb * g->nfmax + (l - 1) * g->nlist * g->p;
      for (int k = 0; k < nw; k++)
        for (long r = 0; r < g->p; r++)
          slot[k * g->p + r] = (int)(st->level_row[l] + windows[k] * g->p + r);
    }
  }
  g->far_row = upload_vector(far);
  g->far_logw = upload_vector(logw);
  g->far_refs = build_refs(far, g->nbs, g->nfmax, st->rows);
}

// fma_linear: every level's query sub-segments that have a query in the slab (evaluate.c's
// linear_level_forward loop), each with its query row (fma_linear_query_row) and the p rows of
// each window fma_lists_level lists for its window.
void build_items(gfma *g) {
  const fma_state *st = g->st;
  const fma_tree *tr = &st->tree;
  const long P = g->p, t0 = st->t0, T = st->T;
  gfma_items &it = g->items;
  it.count = 0;
  for (int l = 1; l <= g->L; l++) {
    it.seg[l] = tr->window[l] / P;
    it.rho0[l] = t0 / it.seg[l];
    it.off[l] = it.count;
    it.count += (t0 + T - 1) / it.seg[l] - it.rho0[l] + 1;
  }
  it.off[g->L + 1] = it.count;
  std::vector<int> qrow((size_t)it.count, -1), key((size_t)(it.count * 3 * P), -1);
  std::vector<int> span((size_t)(2 * it.count)), row((size_t)it.count);
  for (int l = 1; l <= g->L; l++)
    for (long e = it.off[l]; e < it.off[l + 1]; e++) {
      const long rho = it.rho0[l] + e - it.off[l], seg = it.seg[l];
      const long i0 = rho * seg > t0 ? rho * seg : t0;
      const long i1 = (rho + 1) * seg < t0 + T ? (rho + 1) * seg : t0 + T;
      span[(size_t)(2 * e)] = (int)(i0 - t0);
      span[(size_t)(2 * e + 1)] = (int)(i1 - t0);
      row[(size_t)e] = (int)(st->level_row[l] + rho);
      const long q = fma_linear_query_row(st, rho);
      if (q < 0) continue;  // no term: linear_keys lists nothing
      qrow[(size_t)e] = (int)(st->level_row[l] + q);
      long windows[FMA_LIST_MAX];
      const int nw = fma_lists_level(tr, st->causal, l, rho / P, windows);
      for (int k = 0; k < nw; k++)
        for (long r = 0; r < P; r++)
          key[(size_t)(e * 3 * P + k * P + r)] = (int)(st->level_row[l] + windows[k] * P + r);
    }
  g->item_qrow = upload_vector(qrow);
  g->item_key = upload_vector(key);
  g->item_span = upload_vector(span);
  g->item_row = upload_vector(row);
  g->lin_refs = build_refs(key, it.count, (int)(3 * P), st->rows);
}

}  // namespace

extern "C" void gpu_fma_set_light_refs(int refs) { light_refs = refs < 0 ? kLightRefs : refs; }

void gfma_tables_build(gfma *g) {
  const fma_state *st = g->st;
  gfma_levels &lv = g->lv;
  lv.L = g->L;
  lv.p = (int)g->p;
  lv.d = (int)g->d;
  lv.BH = g->BH;
  for (int l = 1; l <= g->L; l++) {
    lv.c0[l] = st->win_lo[l];
    lv.row[l] = st->level_row[l] + st->win_lo[l] * g->p;
    lv.nr[l] = (st->win_hi[l] - st->win_lo[l]) * g->p;
  }
  lv.row[g->L + 1] = st->rows;
  lv.row[0] = lv.nr[0] = lv.nr[g->L + 1] = lv.c0[0] = lv.c0[g->L + 1] = 0;
  if (g->linear) {
    g->nfmax = 0;  // the near field has its own softmax: no far slots in it
    build_items(g);
  } else {
    build_far(g);
  }
}

void gfma_tables_free(gfma *g) {
  gpu_free(g->far_row);
  gpu_free(g->far_logw);
  gpu_free(g->item_qrow);
  gpu_free(g->item_key);
  gpu_free(g->item_span);
  gpu_free(g->item_row);
  if (g->linear)
    free_refs(&g->lin_refs);
  else
    free_refs(&g->far_refs);
}
