/* Sequence parallelism against one rank (SPEC §7), under mpirun with S ranks: every rank computes
 * an attention op's 1-rank result on the whole sequence, then the distributed op on its slab
 * through the sequence communicator; out, dq, dk, dv of the slab and the parameter gradients
 * (summed over ranks) must agree within 1e-5, down to slabs shorter than a list's reach and windows
 * spanning ranks. Prints TAP from rank 0 (test_seq.sh runs it for S = 1, 2, 4, 8). */
#include "testutil.h"

#include "../src/core/error.h"
#include "../src/parallel/comm.h"

static int tap_count = 0, tap_failed = 0;

static void tap(bool ok, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void tap(bool ok, const char *fmt, ...) {
  tap_count++;
  if (!ok) tap_failed++;
  if (error_rank() != 0) return;
  va_list ap;
  va_start(ap, fmt);
  printf("%sok %d - ", ok ? "" : "not ", tap_count);
  vprintf(fmt, ap);
  printf("\n");
  va_end(ap);
  fflush(stdout);
}

struct seq_case {
  const char *variant;
  bool causal;
  const char *down; /* fma variants */
  long n;
  int m, p, band, tile;
  const char *extra; /* one more setting, as section.key=value */
};

static void make_config(struct config *cfg, const struct seq_case *t, int H, int d, int S) {
  char extra[3][96] = {"", "", ""}; /* up to three settings, separated by spaces */
  if (t->extra) sscanf(t->extra, "%95s %95s %95s", extra[0], extra[1], extra[2]);
  const char *sets[] = {tu_fmt("attention.full.block=%d", t->tile ? t->tile : 8),
                        tu_fmt("attention.local.band=%d", t->band ? t->band : 8),
                        tu_fmt("attention.fmmformer.band=%d", t->band ? t->band : 8),
                        tu_fmt("attention.fma.m=%d", t->m ? t->m : 4),
                        tu_fmt("attention.fma.p=%d", t->p ? t->p : 2),
                        tu_fmt("attention.fma.downsample=%s", t->down ? t->down : "conv"),
                        tu_fmt("parallel.seq_ranks=%d", S),
                        extra[0][0] ? extra[0] : NULL,
                        extra[1][0] ? extra[1] : NULL,
                        extra[2][0] ? extra[2] : NULL,
                        NULL};
  char err[CONFIG_ERR_LEN];
  if (tu_config_try(cfg, t->variant, t->n, H, d, t->causal, sets, err, sizeof err))
    error("config: %s", err);
}

/* Run one op on rows [t0, t0 + T) of the global (B, H, n, d) tensors; outputs are slab-sized. */
struct result {
  float *out, *dq, *dk, *dv, *dparams;
  size_t nparams;
};

static struct result run(const struct config *cfg, struct comm *comm, long B, long H, long n,
                         long d, long t0, long T, bool causal, const float *q, const float *k,
                         const float *v, const float *g) {
  const struct attn_variant *var = attention_select(cfg);
  if (!var) error("variant %s is not registered", cfg->attention.variant);
  const long Hq = attention_qk_heads(cfg); /* q, k heads: H, or FiSH's global heads */
  struct attn_ctx ctx =
      attention_open(cfg, var, DEVICE_CPU, comm, 0, (struct attn_dims){B, H, T, d, n, t0, causal});
  ctx.step = 3; /* training: FiSH's noise on, keyed by global (sample, i, j) */
  ctx.train = true;
  ctx.sample0 = 0;
  struct param_list list;
  param_list_init(&list);
  attention_register_params(cfg, var, n, 0, &list);
  float *params = calloc(list.total + 1, sizeof(float));
  struct result r = {0};
  r.nparams = list.total;
  r.dparams = calloc(list.total + 1, sizeof(float));
  for (int i = 0; i < list.count; i++) {
    attention_init_param(cfg, var, &list.p[i], params + list.p[i].offset);
    /* move the trainable parameters off their initial values, identically on every rank */
    for (size_t e = 0; e < list.p[i].numel && !list.p[i].frozen; e++)
      params[list.p[i].offset + e] += 0.1f * (float)rng_normal(3, RNG_TEST, 77, (uint64_t)i, e);
  }
  const size_t count = (size_t)(B * H * T * d), qcount = (size_t)(B * Hq * T * d);
  float *ql = malloc(4 * qcount), *kl = malloc(4 * qcount), *vl = malloc(4 * count),
        *gl = malloc(4 * count);
  for (long bh = 0; bh < B * H; bh++) { /* rows of the global (B, ·, n, d) tensors */
    const size_t src = (size_t)((bh * n + t0) * d), dst = (size_t)(bh * T * d);
    if (bh < B * Hq) {
      memcpy(ql + dst, q + src, 4 * (size_t)(T * d));
      memcpy(kl + dst, k + src, 4 * (size_t)(T * d));
    }
    memcpy(vl + dst, v + src, 4 * (size_t)(T * d));
    memcpy(gl + dst, g + src, 4 * (size_t)(T * d));
  }
  const struct tu_run t =
      tu_attn_run(&ctx, list.count ? params : NULL, list.count ? r.dparams : NULL, ql, kl, vl, gl);
  r.out = t.out, r.dq = t.dq, r.dk = t.dk, r.dv = t.dv;
  attention_close(&ctx);
  free(ql);
  free(kl);
  free(vl);
  free(gl);
  free(params);
  param_list_free(&list);
  return r;
}

static void free_result(struct result *r) {
  free(r->out);
  free(r->dq);
  free(r->dk);
  free(r->dv);
  free(r->dparams);
}

/* max |a − b| over the slab and max |ref| over the whole reference, combined over ranks. */
static double slab_error(const float *a, const float *ref_global, long B, long H, long n, long d,
                         long t0, long T, MPI_Comm comm) {
  double num = 0.0, den = 1e-30;
  for (long bh = 0; bh < B * H; bh++)
    for (long i = 0; i < T * d; i++) {
      double x = a[bh * T * d + i], y = ref_global[(bh * n + t0) * d + i];
      double e = fabs(x - y);
      if (!(e <= num)) num = e;
    }
  for (long i = 0; i < B * H * n * d; i++)
    if (fabs(ref_global[i]) > den) den = fabs(ref_global[i]);
  MPI_Allreduce(MPI_IN_PLACE, &num, 1, MPI_DOUBLE, MPI_MAX, comm);
  return num / den;
}

static void check_case(const struct seq_case *t, struct comm *comm) {
  const long B = 2, H = 2, d = 8, n = t->n, S = comm->S, T = n / S, t0 = comm->seq_rank * T;
  struct config cfg1, cfgS;
  make_config(&cfg1, t, (int)H, (int)d, 1);
  make_config(&cfgS, t, (int)H, (int)d, (int)S);
  char err[CONFIG_ERR_LEN];
  char what[200];
  snprintf(what, sizeof what, "S=%ld %s %s%s%s n=%ld m=%d p=%d band=%d%s%s", S, t->variant,
           t->causal ? "causal" : "bidir", t->down ? " " : "", t->down ? t->down : "", n, t->m,
           t->p, t->band, t->extra ? " " : "", t->extra ? t->extra : "");
  if (attention_check(&cfgS, n, (int)S, err, sizeof err)) {
    tap(false, "%s: refused: %s", what, err);
    return;
  }
  const size_t count = (size_t)(B * H * n * d);
  float *q = malloc(4 * count), *k = malloc(4 * count), *v = malloc(4 * count),
        *g = malloc(4 * count);
  for (size_t i = 0; i < count; i++) {
    q[i] = (float)rng_normal(11, RNG_TEST, 1, i, 0);
    k[i] = (float)rng_normal(11, RNG_TEST, 2, i, 0);
    v[i] = (float)rng_normal(11, RNG_TEST, 3, i, 0);
    g[i] = (float)rng_normal(11, RNG_TEST, 4, i, 0);
  }
  struct result ref = run(&cfg1, NULL, B, H, n, d, 0, n, t->causal, q, k, v, g);
  const uint64_t bytes0 = comm->bytes_sent;
  struct result dist = run(&cfgS, comm, B, H, n, d, t0, T, t->causal, q, k, v, g);
  const uint64_t sent = comm->bytes_sent - bytes0;
  if (dist.nparams) /* the model sums parameter gradients over ranks */
    MPI_Allreduce(MPI_IN_PLACE, dist.dparams, (int)dist.nparams, MPI_FLOAT, MPI_SUM, comm->seq);
  const long Hq = attention_qk_heads(&cfg1);
  double e_out = slab_error(dist.out, ref.out, B, H, n, d, t0, T, comm->seq);
  double e_dq = slab_error(dist.dq, ref.dq, B, Hq, n, d, t0, T, comm->seq);
  double e_dk = slab_error(dist.dk, ref.dk, B, Hq, n, d, t0, T, comm->seq);
  double e_dv = slab_error(dist.dv, ref.dv, B, H, n, d, t0, T, comm->seq);
  double e_dp = 0.0;
  if (ref.nparams) {
    double num = 0.0, den = 1e-30;
    for (size_t i = 0; i < ref.nparams; i++) {
      double e = fabs((double)dist.dparams[i] - ref.dparams[i]);
      if (!(e <= num)) num = e;
      if (fabs(ref.dparams[i]) > den) den = fabs(ref.dparams[i]);
    }
    e_dp = num / den;
  }
  const double tol = 1e-5;
  bool ok = e_out <= tol && e_dq <= tol && e_dk <= tol && e_dv <= tol && e_dp <= tol;
  unsigned long long maxsent = sent;
  MPI_Allreduce(MPI_IN_PLACE, &maxsent, 1, MPI_UNSIGNED_LONG_LONG, MPI_MAX, comm->seq);
  tap(ok, "%s: out %.1e dq %.1e dk %.1e dv %.1e dparams %.1e (max bytes sent per rank %llu)", what,
      e_out, e_dq, e_dk, e_dv, e_dp, maxsent);
  free_result(&ref);
  free_result(&dist);
  free(q);
  free(k);
  free(v);
  free(g);
  config_free(&cfg1);
  config_free(&cfgS);
}

/* The alltoallv exchanges (parallel.alltoallv): rank r sends (r + s) % 3 floats to rank s (none
 * for a third of the pairs), valued by sender, receiver and place; the sparse form, blocking and
 * two non-blocking exchanges in flight at once, must deliver exactly what MPI_Alltoallv does. */
static void check_alltoallv(struct comm *c) {
  const int S = c->S, me = c->seq_rank;
  size_t sc[64], sd[64], rc[64], rd[64], ns = 0, nr = 0;
  if (S > 64) return;
  for (int r = 0; r < S; r++) {
    sc[r] = (size_t)((me + r) % 3);
    rc[r] = (size_t)((r + me) % 3);
    sd[r] = ns;
    rd[r] = nr;
    ns += sc[r];
    nr += rc[r];
  }
  float *snd = xmalloc(sizeof(float) * (ns + 1)), *want = xmalloc(sizeof(float) * (nr + 1));
  float *got[3];
  for (int k = 0; k < 3; k++) got[k] = xcalloc(nr + 1, sizeof(float));
  for (int r = 0; r < S; r++)
    for (size_t i = 0; i < sc[r]; i++) snd[sd[r] + i] = (float)(1000 * me + 10 * r + (int)i);
  int isc[64], isd[64], irc[64], ird[64];
  for (int r = 0; r < S; r++) {
    isc[r] = (int)sc[r], isd[r] = (int)sd[r], irc[r] = (int)rc[r], ird[r] = (int)rd[r];
  }
  MPI_Alltoallv(snd, isc, isd, MPI_FLOAT, want, irc, ird, MPI_FLOAT, c->seq);
  const bool saved = c->sparse;
  c->sparse = true;
  comm_alltoallv_float(c, snd, sc, sd, got[0], rc, rd);
  struct comm_request a, b;
  comm_ialltoallv_float(c, snd, sc, sd, got[1], rc, rd, &a);
  comm_ialltoallv_float(c, snd, sc, sd, got[2], rc, rd, &b);
  comm_wait(&b);
  comm_wait(&a);
  c->sparse = saved;
  bool ok = true;
  for (size_t i = 0; i < nr; i++)
    for (int k = 0; k < 3; k++) ok = ok && got[k][i] == want[i];
  int all = ok;
  MPI_Allreduce(MPI_IN_PLACE, &all, 1, MPI_INT, MPI_LAND, c->seq);
  tap(all,
      "parallel.alltoallv = sparse: blocking and two non-blocking in flight deliver what "
      "MPI_Alltoallv does on %d ranks",
      S);
  free(snd);
  free(want);
  for (int k = 0; k < 3; k++) free(got[k]);
}

/* The exchange whose receive counts are not known in advance (fma.open's requests): rank r sends
 * (r + s + k) % 3 longs to rank s in call k (none for a third of the pairs, a different third each
 * call), valued by call, sender, receiver and place; five calls in a row in each form (NBX's two
 * alternating tags: a rank may start the next call while another still receives this one), the
 * counts and the longs what MPI_Alltoall and MPI_Alltoallv deliver, and the nbx form one
 * exchange where the other is two. */
static void check_alltoallv_any(struct comm *c) {
  const int S = c->S, me = c->seq_rank;
  if (S > 64) return;
  bool ok = true, counted = true;
  const bool saved = c->nbx;
  for (int form = 0; form < 2; form++) {
    c->nbx = form == 0;
    for (int k = 0; k < 5; k++) {
      size_t sc[64], sd[64], rc[64], rd[64], want_rc[64], ns = 0;
      for (int r = 0; r < S; r++) {
        sc[r] = (size_t)((me + r + k) % 3);
        sd[r] = ns;
        ns += sc[r];
      }
      long *snd = xmalloc(sizeof(long) * (ns + 1)), *got;
      for (int r = 0; r < S; r++)
        for (size_t i = 0; i < sc[r]; i++)
          snd[sd[r] + i] = 100000L * k + 1000 * me + 10 * r + (long)i;
      const uint64_t before = c->exchanges;
      comm_alltoallv_long_any(c, snd, sc, sd, &got, rc, rd);
      counted = counted && c->exchanges - before == (uint64_t)(S > 1 ? (form == 0 ? 1 : 2) : 0);
      MPI_Alltoall(sc, 1, MPI_UINT64_T, want_rc, 1, MPI_UINT64_T, c->seq);
      int isc[64], isd[64], irc[64], ird[64], nr = 0;
      for (int r = 0; r < S; r++) {
        isc[r] = (int)sc[r], isd[r] = (int)sd[r], irc[r] = (int)want_rc[r], ird[r] = nr;
        nr += irc[r];
      }
      long *want = xmalloc(sizeof(long) * ((size_t)nr + 1));
      MPI_Alltoallv(snd, isc, isd, MPI_LONG, want, irc, ird, MPI_LONG, c->seq);
      for (int r = 0; r < S; r++) ok = ok && rc[r] == want_rc[r] && rd[r] == (size_t)ird[r];
      for (int i = 0; ok && i < nr; i++) ok = got[i] == want[i];
      free(snd);
      free(got);
      free(want);
    }
  }
  c->nbx = saved;
  int all = ok && counted;
  MPI_Allreduce(MPI_IN_PLACE, &all, 1, MPI_INT, MPI_LAND, c->seq);
  tap(all,
      "requests of unknown size: NBX (nbx) and counts-then-alltoallv (sparse), five calls each, "
      "deliver what MPI_Alltoallv does on %d ranks, in 1 and 2 exchanges",
      S);
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int rank, world;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  error_set_rank(rank, world);
  struct comm comm;
  comm_init(&comm, world); /* every rank shares the one sequence */
  const char *only = argc > 1 ? argv[1] : NULL;
  const char *downs[] = {"conv", "m2m", "avg"};
  if (!only) check_alltoallv(&comm);
  if (!only) check_alltoallv_any(&comm);
  for (int causal = 1; causal >= 0; causal--) {
    if (!only || strcmp(only, "full") == 0) {
      check_case(&(struct seq_case){"full", causal, NULL, 64, 0, 0, 0, 8, NULL}, &comm);
      check_case(&(struct seq_case){"full", causal, NULL, 128, 0, 0, 0, 16, NULL}, &comm);
    }
    if (!only || strcmp(only, "local") == 0) {
      check_case(&(struct seq_case){"local", causal, NULL, 64, 0, 0, 5, 8, NULL}, &comm);
      check_case(&(struct seq_case){"local", causal, NULL, 64, 0, 0, 20, 8, NULL}, &comm);
    }
    /* FiSH heads (one global head for two value heads) with training noise: the ring and the
     * halo carry the global key heads; the noise is keyed by global positions */
    if (!only || strcmp(only, "fish") == 0) {
      check_case(&(struct seq_case){"full", causal, NULL, 64, 0, 0, 0, 8,
                                    "attention.heads_mode=fish attention.fish.noise=0.4"},
                 &comm);
      check_case(
          &(struct seq_case){
              "local", causal, NULL, 64, 0, 0, 20, 8,
              "attention.heads_mode=fish attention.fish.mix=mlp attention.fish.noise=0.3"},
          &comm);
    }
    /* the kernelized variants: exclusive scans of the running sums (and fmmformer's band halo,
     * here wider than a slab at S = 8) */
    if (!only || strcmp(only, "linear") == 0) {
      check_case(&(struct seq_case){"linear", causal, NULL, 64, 0, 0, 0, 0, NULL}, &comm);
      check_case(&(struct seq_case){"linear", causal, NULL, 256, 0, 0, 0, 0, NULL}, &comm);
    }
    if (!only || strcmp(only, "fmmformer") == 0) {
      check_case(&(struct seq_case){"fmmformer", causal, NULL, 64, 0, 0, 5, 8,
                                    "attention.fmmformer.kernels=elu,elu_neg,tanh"},
                 &comm);
      check_case(&(struct seq_case){"fmmformer", causal, NULL, 128, 0, 0, 20, 8,
                                    "attention.fmmformer.kernels=tanh"},
                 &comm);
    }
    if (!only || strcmp(only, "rmfa") == 0) {
      check_case(
          &(struct seq_case){"rmfa", causal, NULL, 64, 0, 0, 0, 0, "attention.rmfa.features=32"},
          &comm);
      check_case(
          &(struct seq_case){"rmfa", causal, NULL, 256, 0, 0, 0, 0, "attention.rmfa.kernel=log"},
          &comm);
    }
    /* nystrom, bidirectional only: landmarks gathered, B·v and the backward sums allreduced,
     * the conv's halo (here 16 tokens, half a slab at S = 8) */
    if ((!only || strcmp(only, "nystrom") == 0) && !causal) {
      check_case(&(struct seq_case){"nystrom", false, NULL, 64, 0, 0, 0, 0,
                                    "attention.nystrom.landmarks=8"},
                 &comm);
      check_case(&(struct seq_case){"nystrom", false, NULL, 256, 0, 0, 0, 0,
                                    "attention.nystrom.landmarks=16"},
                 &comm);
    }
    /* fma.open (SPEC §6.4a): opened windows and fine blocks on other ranks, fetched as the
     * descent needs them; at S = 8 the n = 64 slabs hold 2 fine blocks, and a window opened at
     * level 3 spans 2 ranks */
    if (!only || strcmp(only, "fma_open") == 0)
      for (int dn = 0; dn < 3; dn++) {
        const char *opens[] = {"attention.fma.open=1", "attention.fma.open=2",
                               "attention.fma.open=all"};
        for (int o = 0; o < 3; o++)
          check_case(&(struct seq_case){"fma", causal, downs[dn], 64, 4, 2, 0, 0, opens[o]}, &comm);
        check_case(&(struct seq_case){"fma", causal, downs[dn], 256, 8, 4, 0, 0, opens[1]}, &comm);
      }
    for (int v = 0; v < 2; v++) {
      const char *name = v ? "fma_linear" : "fma";
      if (only && strcmp(only, name) != 0) continue;
      for (int dn = 0; dn < 3; dn++) {
        /* n/m = 16, 3 levels: at S = 8 slabs of 8 tokens, level-3 windows of 16 span 2 ranks;
         * at S = 16 (test_seq.sh) slabs of one fine block, levels 2 and 3 span */
        check_case(&(struct seq_case){name, causal, downs[dn], 64, 4, 2, 0, 0, NULL}, &comm);
        /* n/m = 32, 4 levels, windows up to 64 tokens: at S = 8 (slabs of 32) they span 2; at
         * S = 16 levels 3 and 4 span */
        check_case(&(struct seq_case){name, causal, downs[dn], 256, 8, 4, 0, 0, NULL}, &comm);
      }
    }
  }
  if (rank == 0) {
    printf("1..%d\n", tap_count);
    fflush(stdout);
  }
  comm_free(&comm);
  MPI_Finalize();
  return tap_failed ? 1 : 0;
}
