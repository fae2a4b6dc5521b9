/* The long-range tasks (src/tasks/, docs/tasks.md): every generator gives the same samples for any
 * rank layout (replicas and sequence slabs) and for the evaluation sets; each scored target's
 * distance points at the token that holds its answer; distance buckets and accuracy sums; the
 * softmax's argmax; a generator's export read back as a task file gives the same batches; and
 * every bad task file and task deck is refused with its message. Files go to /tmp, removed at
 * the end. The answers themselves are recomputed independently by tests/tasks_check.py. */
#include <hdf5.h>
#include <unistd.h>

#include "testutil.h"

#include "../src/core/h5io.h"
#include "../src/io/data.h"
#include "../src/nn/layers.h"
#include "../src/tasks/tasks.h"

static char tmp_path[256];

/* A path under /tmp private to this process. */
static const char *tmp(const char *name) {
  snprintf(tmp_path, sizeof tmp_path, "/tmp/fmattn_test_tasks_%d_%s", (int)getpid(), name);
  return tmp_path;
}

/* Loads the defaults with the overrides (NULL-terminated); returns the status, err the message. */
static int load(struct config *cfg, const char *const *sets, char *err) {
  struct config_overrides ov = {0};
  for (int i = 0; sets[i]; i++) ov.items[ov.count++] = sets[i];
  err[0] = '\0';
  return config_load(cfg, NULL, &ov, err, CONFIG_ERR_LEN);
}

static void load_ok(struct config *cfg, const char *const *sets) {
  char err[CONFIG_ERR_LEN];
  if (load(cfg, sets, err)) fail_msg("config: %s", err);
}

/* A text file for passkey's filler: bytes that are a known function of the offset, with a few
 * marker bytes that must become spaces. */
static void write_text(const char *path, size_t size) {
  FILE *f = fopen(path, "wb");
  assert_non_null(f);
  for (size_t o = 0; o < size; o++) fputc(o % 97 == 5 ? PASSKEY_NEEDLE : 'a' + (int)(o % 23), f);
  fclose(f);
}

/* The configurations every layout test runs through (n = 64 unless set). */
#define N 64
static const char *const base[] = {"model.context=64", "train.batch=4", "train.eval_windows=6",
                                   "attention.variant=full", "train.steps=3"};

static void load_case(struct config *cfg, const char *const *extra) {
  const char *sets[32];
  int k = 0;
  for (size_t i = 0; i < sizeof base / sizeof base[0]; i++) sets[k++] = base[i];
  for (int i = 0; extra[i]; i++) sets[k++] = extra[i];
  sets[k] = NULL;
  load_ok(cfg, sets);
}

/* Whole batches against replicas' and sequence ranks' parts, for training and evaluation. */
static void check_layouts(const struct dataset *ds) {
  const long B = 4, n = N;
  int tok[4 * N], tgt[4 * N], dist[4 * N], again[4 * N], again_t[4 * N];
  data_train_batch(ds, 7, 0, B, 0, n, tok, tgt);
  data_train_batch(ds, 7, 0, B, 0, n, again, again_t);
  assert_memory_equal(tok, again, sizeof tok); /* a pure function of its key */
  assert_memory_equal(tgt, again_t, sizeof tgt);
  int scored = 0;
  for (long i = 0; i < B * n; i++) scored += tgt[i] >= 0;
  assert_true(scored > 0);
  for (int S = 1; S <= 4; S *= 2)
    for (long s = 0; s < S; s++)
      for (long D = 1; D <= 2; D++)
        for (long r = 0; r < D; r++) { /* replica r of D takes samples r·B/D .. (r+1)·B/D − 1 */
          const long b0 = r * B / D, nb = B / D, T = n / S, t0 = s * T;
          int pt[4 * N], pg[4 * N];
          data_train_batch(ds, 7, b0, nb, t0, T, pt, pg);
          for (long b = 0; b < nb; b++)
            for (long t = 0; t < T; t++) {
              assert_int_equal(pt[b * T + t], tok[(b0 + b) * n + t0 + t]);
              assert_int_equal(pg[b * T + t], tgt[(b0 + b) * n + t0 + t]);
            }
        }
  data_train_batch(ds, 8, 0, B, 0, n, again, again_t);
  assert_true(memcmp(tok, again, sizeof tok) != 0); /* another step, other samples */
  /* evaluation: rows first + b·stride, as replicas take them; with distances */
  const long windows = data_eval_windows(ds, SPLIT_VALID);
  data_eval_rows(ds, SPLIT_VALID, 0, 1, windows, B, 0, n, tok, tgt, dist);
  for (int S = 1; S <= 4; S *= 2)
    for (long s = 0; s < S; s++) {
      const long T = n / S, t0 = s * T;
      int pt[2 * N], pg[2 * N], pd[2 * N];
      data_eval_rows(ds, SPLIT_VALID, 1, 2, windows, 2, t0, T, pt, pg, pd); /* windows 1, 3 */
      for (long b = 0; b < 2; b++)
        for (long t = 0; t < T; t++) {
          const long w = (1 + 2 * b) * n + t0 + t;
          assert_int_equal(pt[b * T + t], tok[w]);
          assert_int_equal(pg[b * T + t], tgt[w]);
          assert_int_equal(pd[b * T + t], dist[w]);
        }
    }
  int vt[N], vg[N];
  data_eval_batch(ds, SPLIT_TEST, 0, 1, windows, 1, 0, n, vt, vg);
  assert_true(memcmp(vt, tok, sizeof vt) != 0); /* the test set is not the valid set */
}

static void test_layouts(void **state) {
  (void)state;
  const char *text = tmp("filler.txt");
  write_text(text, 20000);
  char path_set[300];
  snprintf(path_set, sizeof path_set, "data.path=%s", text);
  const char *const cases[][6] = {
      {"data.source=mqar", NULL},
      {"data.source=mqar", "data.mqar.one_hop=false", "data.mqar.spread=uniform", NULL},
      {"data.source=mqar", "data.mqar.spread=compact", "data.mqar.queries=3", NULL},
      {"data.source=passkey", NULL},
      {"data.source=passkey", path_set, "data.passkey.one_hop=false", NULL},
      {"data.source=listops", "data.listops.min_length=20", NULL},
      {"data.source=copy", NULL},
      {"data.source=majority", NULL},
  };
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
    struct config cfg;
    struct dataset ds;
    load_case(&cfg, cases[c]);
    data_open(&ds, &cfg);
    check_layouts(&ds);
    data_close(&ds);
    config_free(&cfg);
  }
  unlink(text);
}

/* The generators' options of cfg, as data_open reads them. */
static const struct task_options *opts(const struct config *cfg) {
  static struct task_options o;
  task_options_read(&o, cfg);
  return &o;
}

/* Every scored target of a retrieval task: distance d points at the token that holds it. */
static void check_retrieval(const struct task_sample *s, const struct config *cfg, int expect) {
  int scored = 0;
  for (long t = 0; t < s->n; t++) {
    if (!s->scored[t]) {
      assert_int_equal(s->distance[t], -1);
      continue;
    }
    scored++;
    const long d = s->distance[t];
    assert_true(d >= 0 && d <= t);
    assert_int_equal(s->tokens[t - d], s->tokens[t + 1]); /* the target copies that token */
    if (cfg->data.source == SOURCE_MQAR && cfg->data.mqar_one_hop) {
      /* a pair byte whose key is the query's */
      const int pair = s->tokens[t - d] - MQAR1_PAIR0;
      assert_true(pair >= 0 && pair < MQAR1_KEYS * MQAR1_VALUES && t - d < 16);
      assert_int_equal(s->tokens[t], MQAR1_QUERY0 + pair / MQAR1_VALUES);
    }
  }
  assert_int_equal(scored, expect);
}

static void test_generators(void **state) {
  (void)state;
  struct config cfg;
  struct task_sample s;
  const char *const mqar[] = {"data.source=mqar", "data.mqar.pairs=16", "data.mqar.queries=10",
                              NULL};
  load_case(&cfg, mqar);
  task_sample_alloc(&s, N);
  for (uint64_t b = 0; b < 50; b++) {
    task_mqar(opts(&cfg), 3, b, &s);
    check_retrieval(&s, &cfg, 10);
    for (int i = 0; i < 16; i++) /* distinct keys */
      for (int j = 0; j < i; j++)
        assert_int_not_equal(s.tokens[i] / MQAR1_VALUES, s.tokens[j] / MQAR1_VALUES);
  }
  config_free(&cfg);
  const char *const mqar2[] = {"data.source=mqar", "data.mqar.one_hop=false", NULL};
  load_case(&cfg, mqar2);
  for (uint64_t b = 0; b < 50; b++) {
    task_mqar(opts(&cfg), 3, b, &s);
    check_retrieval(&s, &cfg, 8);
    for (int i = 0; i < 8; i++) {
      assert_true(s.tokens[2 * i] >= MQAR_KEY0 && s.tokens[2 * i] < MQAR_KEY0 + MQAR_KEYS);
      assert_true(s.tokens[2 * i + 1] >= MQAR_VALUE0);
    }
  }
  config_free(&cfg);
  /* passkey: depth 0 puts the needle first, depth 1 right before the question */
  for (int depth = 0; depth <= 1; depth++) {
    char set[64];
    snprintf(set, sizeof set, "data.passkey.depth=%d", depth);
    const char *const pk[] = {"data.source=passkey", set, NULL};
    load_case(&cfg, pk);
    task_passkey(opts(&cfg), NULL, 0, 1, 2, &s);
    check_retrieval(&s, &cfg, 5);
    /* the question at Q = n − 2k, query i at Q + 1 + 2i; the needle at 0 or at F = Q − k − 1 */
    const long Q = N - 10, F = Q - 6;
    assert_int_equal(s.tokens[Q], PASSKEY_QUESTION);
    for (int i = 0; i < 5; i++) {
      assert_int_equal(s.tokens[Q + 1 + 2 * i], PASSKEY_INDEX0 + i);
      assert_int_equal((s.tokens[Q + 2 + 2 * i] - PASSKEY_TAGGED0) / 10, i); /* digit i, tagged */
      assert_int_equal(s.distance[Q + 1 + 2 * i], Q + 1 + 2 * i - ((depth ? F : 0) + 1 + i));
    }
    assert_int_equal(s.tokens[depth ? F : 0], PASSKEY_NEEDLE);
    config_free(&cfg);
  }
  /* the plain form: QUESTION then the digits, each predicted from the one before */
  {
    const char *const pk[] = {"data.source=passkey", "data.passkey.one_hop=false",
                              "data.passkey.depth=0.5", NULL};
    load_case(&cfg, pk);
    task_passkey(opts(&cfg), NULL, 0, 1, 2, &s);
    check_retrieval(&s, &cfg, 5);
    assert_int_equal(s.tokens[N - 5], PASSKEY_QUESTION);
    for (int i = 0; i < 5; i++)
      assert_true(s.tokens[N - 4 + i] >= '0' && s.tokens[N - 4 + i] <= '9');
    config_free(&cfg);
  }
  /* listops: the expression, '=', the answer digit, then padding; distance = its length */
  const char *const lo[] = {"data.source=listops", "data.listops.min_length=30", NULL};
  load_case(&cfg, lo);
  for (uint64_t b = 0; b < 20; b++) {
    task_listops(opts(&cfg), 0, b, &s);
    long E = -1;
    for (long t = 0; t < N; t++)
      if (s.scored[t]) {
        assert_int_equal(E, -1); /* one scored target */
        E = t;
      }
    assert_true(E >= 30 && E <= N - 1);
    assert_int_equal(s.distance[E], E);
    assert_int_equal(s.tokens[E], LISTOPS_ANSWER);
    assert_true(s.tokens[E + 1] >= '0' && s.tokens[E + 1] <= '9');
    for (long t = E + 2; t <= N; t++) assert_int_equal(s.tokens[t], LISTOPS_PAD);
    assert_non_null(strchr("XNDS", s.tokens[0])); /* an operator opens it */
    assert_int_equal(s.tokens[E - 1], LISTOPS_CLOSE);
  }
  task_sample_free(&s);
  config_free(&cfg);
}

static void test_buckets(void **state) {
  (void)state;
  assert_int_equal(task_buckets(1024), 11);
  assert_int_equal(task_buckets(1000), 11);
  assert_int_equal(task_buckets(2), 2);
  assert_int_equal(task_bucket(-1, 11), -1);
  assert_int_equal(task_bucket(0, 11), 0);
  assert_int_equal(task_bucket(1, 11), 1);
  assert_int_equal(task_bucket(3, 11), 2);
  assert_int_equal(task_bucket(1023, 11), 10);
  assert_int_equal(task_bucket(5000, 11), 10); /* past the context: the last bucket */
  const long ns[2] = {1024, 1000};
  for (int i = 0; i < 2; i++) {
    const long n = ns[i];
    const int nb = task_buckets(n);
    long prev_end = 0;
    for (int k = 0; k < nb; k++) {
      long a, b;
      task_bucket_edges(k, n, &a, &b);
      assert_int_equal(a, prev_end); /* contiguous, from 0 to n */
      prev_end = b;
      for (long d = a; d < b; d++) assert_int_equal(task_bucket(d, nb), k);
    }
    assert_int_equal(prev_end, n);
  }
}

static void test_score(void **state) {
  (void)state;
  /* windows 0..4 of n = 8; replica 0 of 2 takes windows 0, 2, 4 (and a padding row) */
  struct task_score s;
  task_score_open(&s, 8, 5);
  const int B = 4, T = 2;
  const int targets[8] = {5, -1, 6, 7, 1, 2, 9, 9};
  const int pred[8] = {5, 0, 0, 7, 1, 2, 9, 9};
  const int dist[8] = {0, -1, 3, 5, 1, -1, 2, 2};
  task_score_add(&s, 0, 2, B, T, targets, pred, dist); /* rows: windows 0, 2, 4, 6 (past) */
  struct task_accuracy r;
  double acc[4], cnt[4];
  task_score_result(&s, &r, acc, cnt);
  assert_true(r.scored == 5); /* window 6 does not exist */
  assert_true(fabs(r.accuracy - 4.0 / 5) < 1e-12);
  assert_true(r.samples == 3);                            /* windows 0, 2, 4 */
  assert_true(fabs(r.sample_accuracy - 2.0 / 3) < 1e-12); /* window 2 has a wrong target */
  assert_true(cnt[0] == 1 && acc[0] == 1);                /* d = 0 */
  assert_true(cnt[1] == 1 && acc[1] == 1);                /* d = 1 */
  assert_true(cnt[2] == 1 && acc[2] == 0);                /* d = 3 */
  assert_true(cnt[3] == 1 && acc[3] == 1);                /* d = 5: [4, 8) */
  task_score_close(&s);
}

static void test_softmax_pred(void **state) {
  (void)state;
  enum { NR = 4, V = 5 };
  float z[NR * V] = {0, 3, 1, 3, 2, /* a tie: the first */ 1, 0, 0, 0, 0, 5, 4, 3, 2, 9,
                     7, 7, 7, 7, 7};
  float z2[NR * V];
  memcpy(z2, z, sizeof z);
  const int tgt[NR] = {1, 0, -1, 3};
  int pred[NR];
  float loss_a[NR], loss_b[NR];
  const double a = softmax_xent_rows_forward_backward(z, tgt, NR, V, 0.5f, loss_a, pred);
  const double b = softmax_xent_forward_backward(z2, tgt, NR, V, 0.5f, loss_b);
  assert_int_equal(pred[0], 1);
  assert_int_equal(pred[1], 0);
  assert_int_equal(pred[2], -1); /* not counted */
  assert_int_equal(pred[3], 0);
  assert_true(a == b); /* the same loss and gradient, bit for bit */
  assert_memory_equal(z, z2, sizeof z);
  assert_memory_equal(loss_a, loss_b, sizeof loss_a);
}

/* A generator's export, read back as a task file with its split, gives the same batches. */
static void test_export_roundtrip(void **state) {
  (void)state;
  const char *file = tmp("export.h5");
  char export_set[300], path_set[300], split_set[64];
  snprintf(export_set, sizeof export_set, "data.export=%s", file);
  snprintf(path_set, sizeof path_set, "data.path=%s", file);
  const char *const gen[] = {"data.source=listops", "data.listops.min_length=16", export_set, NULL};
  struct config cg, ct;
  struct dataset dg, dt;
  load_case(&cg, gen);
  data_open(&dg, &cg); /* writes the file: 3 steps x 4 + 6 + 6 rows */
  hid_t f = H5Fopen(file, H5F_ACC_RDONLY, H5P_DEFAULT);
  assert_true(f >= 0);
  char *split = NULL;
  assert_true(h5_read_attr_string(f, "/", "split", &split));
  assert_string_equal(split, "12,6,6");
  H5Fclose(f);
  snprintf(split_set, sizeof split_set, "data.split=%s", split);
  free(split);
  const char *const task[] = {"data.source=task", path_set, split_set, NULL};
  load_case(&ct, task);
  data_open(&dt, &ct);
  assert_int_equal(dt.task->rows, 24);
  int a[4 * N], at[4 * N], b[4 * N], bt[4 * N], ad[4 * N], bd[4 * N];
  for (long step = 0; step < 3; step++) {
    data_train_batch(&dg, step, 0, 4, 0, N, a, at);
    data_train_batch(&dt, step, 0, 4, 0, N, b, bt);
    assert_memory_equal(a, b, sizeof a);
    assert_memory_equal(at, bt, sizeof at);
  }
  for (int split_i = SPLIT_VALID; split_i <= SPLIT_TEST; split_i++) {
    assert_int_equal(data_eval_windows(&dt, split_i), 6);
    data_eval_rows(&dg, split_i, 2, 1, 6, 4, 0, N, a, at, ad); /* windows 2..5 */
    data_eval_rows(&dt, split_i, 2, 1, 6, 4, 0, N, b, bt, bd);
    assert_memory_equal(a, b, sizeof a);
    assert_memory_equal(at, bt, sizeof at);
    assert_memory_equal(ad, bd, sizeof ad);
  }
  data_close(&dg);
  data_close(&dt);
  config_free(&cg);
  config_free(&ct);
  unlink(file);
}

/* ---------------------------------------------------------------------------------------------
 * bad task files */

/* Writes one 2-D dataset of long long values with the given HDF5 file type. */
static void put(hid_t f, const char *name, hid_t type, long rows, long cols, const long long *v) {
  hsize_t dims[2] = {(hsize_t)rows, (hsize_t)cols};
  hid_t space = H5Screate_simple(2, dims, NULL);
  hid_t ds = H5Dcreate2(f, name, type, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
  assert_true(ds >= 0);
  assert_true(H5Dwrite(ds, H5T_NATIVE_LLONG, H5S_ALL, H5S_ALL, H5P_DEFAULT, v) >= 0);
  H5Dclose(ds);
  H5Sclose(space);
}

enum fault {
  OK,
  NO_TOKENS,
  NO_SCORED,
  SCORED_SHAPE,
  DIST_SHAPE,
  TOKEN_300,
  TOKEN_NEG,
  SCORED_2,
  ROW_UNSCORED,
  FLOAT_TOKENS
};

/* A file of 3 rows of L tokens with one fault. */
static const char *bad_file(enum fault fault, long L) {
  const char *path = tmp("bad.h5");
  hid_t f = H5Fcreate(path, H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
  long long tok[3 * 70] = {0}, sc[3 * 70] = {0}, dist[3 * 70] = {0};
  for (long i = 0; i < 3 * L; i++) tok[i] = i % 256;
  for (long i = 0; i < 3 * (L - 1); i++) sc[i] = i % 5 == 0, dist[i] = i % 7 - 1;
  if (fault == TOKEN_300) tok[L + 4] = 300;
  if (fault == TOKEN_NEG) tok[2] = -1;
  if (fault == SCORED_2) sc[7] = 2;
  if (fault == ROW_UNSCORED)
    for (long t = 0; t < L - 1; t++) sc[(L - 1) + t] = 0;
  if (fault == FLOAT_TOKENS) {
    hsize_t dims[2] = {3, (hsize_t)L};
    double vals[3 * 70];
    for (long i = 0; i < 3 * L; i++) vals[i] = 1;
    hid_t space = H5Screate_simple(2, dims, NULL);
    hid_t ds =
        H5Dcreate2(f, "tokens", H5T_IEEE_F64LE, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    H5Dwrite(ds, H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT, vals);
    H5Dclose(ds);
    H5Sclose(space);
  } else if (fault != NO_TOKENS) {
    put(f, "tokens", H5T_STD_I32LE, 3, L, tok);
  }
  if (fault != NO_SCORED) put(f, "scored", H5T_STD_U8LE, 3, fault == SCORED_SHAPE ? L : L - 1, sc);
  put(f, "distance", H5T_STD_I32LE, fault == DIST_SHAPE ? 2 : 3, L - 1, dist);
  H5Fclose(f);
  return path;
}

static void expect_refused(enum fault fault, long L, long n, const char *needle) {
  const char *path = bad_file(fault, L);
  struct task_file tf;
  char err[2048] = "";
  const int rc = task_file_read(path, n, &tf, err, sizeof err);
  if (rc == 0) fail_msg("fault %d: the file was accepted", (int)fault);
  if (!strstr(err, needle)) fail_msg("fault %d: '%s' lacks '%s'", (int)fault, err, needle);
  unlink(path);
}

static void test_bad_files(void **state) {
  (void)state;
  H5Eset_auto2(H5E_DEFAULT, NULL, NULL);
  struct task_file tf;
  char err[2048];
  const char *good = bad_file(OK, 65);
  assert_int_equal(task_file_read(good, 64, &tf, err, sizeof err), 0);
  assert_int_equal(tf.rows, 3);
  assert_non_null(tf.distance);
  assert_int_equal(tf.tokens[70], 70 % 256);
  assert_int_equal(tf.distance[8], 8 % 7 - 1);
  task_file_free(&tf);
  unlink(good);
  expect_refused(NO_TOKENS, 65, 64, "has no dataset 'tokens'");
  expect_refused(NO_SCORED, 65, 64, "has no dataset 'scored'");
  expect_refused(SCORED_SHAPE, 65, 64,
                 "scored has shape (3, 65), but tokens (3, 65) needs (3, 64)");
  expect_refused(DIST_SHAPE, 65, 64, "distance has shape (2, 64)");
  expect_refused(TOKEN_300, 65, 64, "tokens[1, 4] = 300 is outside [0, 256)");
  expect_refused(TOKEN_NEG, 65, 64, "tokens[0, 2] = -1 is outside [0, 256)");
  expect_refused(SCORED_2, 65, 64, "scored[0, 7] = 2 is not 0 or 1");
  expect_refused(ROW_UNSCORED, 65, 64, "row 1 has no scored position");
  expect_refused(FLOAT_TOKENS, 65, 64, "tokens must be a 2-D integer dataset");
  expect_refused(OK, 33, 64, "a context of L-1 = 32, shorter than model.context = 64");
  expect_refused(OK, 65, 32, "longer than model.context = 32; set model.context = 64");
  char missing[300];
  snprintf(missing, sizeof missing, "%s", tmp("absent.h5"));
  assert_int_equal(task_file_read(missing, 64, &tf, err, sizeof err), 1);
  assert_non_null(strstr(err, "cannot open task file"));
}

/* ---------------------------------------------------------------------------------------------
 * deck rules */

static void expect_deck_error(const char *const *sets, const char *needle) {
  struct config cfg;
  char err[CONFIG_ERR_LEN];
  if (load(&cfg, sets, err) == 0) {
    config_free(&cfg);
    fail_msg("deck accepted; expected '%s'", needle);
  }
  if (!strstr(err, needle)) fail_msg("'%s' lacks '%s'", err, needle);
}

static void test_deck_rules(void **state) {
  (void)state;
  config_add_rule(task_deck_rule); /* as fmattn's main adds it */
  const char *const a[] = {"data.source=mqar", "data.mqar.pairs=17", NULL};
  expect_deck_error(a, "--set data.mqar.pairs=17: data.mqar.pairs = 17: the one-hop form has 16");
  const char *const b[] = {"data.source=mqar", "data.mqar.pairs=4", "data.mqar.queries=5", NULL};
  expect_deck_error(b, "data.mqar.queries = 5 is more than data.mqar.pairs = 4");
  const char *const c[] = {"data.source=mqar", "data.mqar.one_hop=false", "data.mqar.pairs=20",
                           "model.context=64", NULL};
  expect_deck_error(c,
                    "--set model.context=64: data.mqar.pairs = 20 with 20 queries needs "
                    "2*pairs + 2*queries = 80 tokens, but a sample has model.context+1 = 65");
  const char *const d[] = {"data.source=passkey", "data.passkey.digits=13", NULL};
  expect_deck_error(d, "data.passkey.digits = 13: the one-hop form tags at most 12 digits");
  const char *const e[] = {"data.source=passkey", "model.context=12", "data.passkey.digits=4",
                           NULL};
  expect_deck_error(e, "data.passkey.digits = 4 needs 3*digits+2 = 14 tokens");
  const char *const e2[] = {"data.source=passkey", "model.context=8", "data.passkey.digits=4",
                            "data.passkey.one_hop=false", NULL};
  expect_deck_error(e2, "data.passkey.digits = 4 needs 2*digits+2 = 10 tokens");
  const char *const f[] = {"data.source=listops", "model.context=64", "data.listops.min_length=64",
                           NULL};
  expect_deck_error(f,
                    "--set data.listops.min_length=64: data.listops.min_length = 64 does not "
                    "fit model.context = 64");
  const char *const g[] = {"data.source=task", NULL};
  expect_deck_error(g, "data.path is empty, but data.source = task needs a task file");
  const char *text = tmp("not_hdf5.txt");
  write_text(text, 1000);
  char path_set[300], export_set[300];
  snprintf(path_set, sizeof path_set, "data.path=%s", text);
  snprintf(export_set, sizeof export_set, "data.export=%s", text);
  const char *const h[] = {"data.source=task", path_set, NULL};
  expect_deck_error(h, "is not an HDF5 file, but data.source = task needs a task file");
  const char *const i[] = {"data.source=passkey", path_set, "model.context=1000", NULL};
  expect_deck_error(i, "fewer than model.context+1"); /* filler text too short for a split */
  unlink(text);
  const char *const j[] = {"data.passkey.depth=0.7,0.2", NULL};
  expect_deck_error(j, "data.passkey.depth = '0.7,0.2': expected a fraction in [0, 1], or two");
  /* a task file may not be overwritten by its own export */
  const char *file = bad_file(OK, 65);
  snprintf(path_set, sizeof path_set, "data.path=%s", file);
  snprintf(export_set, sizeof export_set, "data.export=%s", file);
  const char *const k[] = {"data.source=task", path_set, export_set, NULL};
  expect_deck_error(k, "is the task file being read (data.path)");
  unlink(file);
  /* and the good decks load, with the keys' values */
  struct config cfg;
  const char *const ok[] = {"data.source=passkey", "data.passkey.depth=0.25", NULL};
  load_ok(&cfg, ok);
  assert_true(cfg.data.passkey_depth[0] == 0.25 && cfg.data.passkey_depth[1] == 0.25);
  assert_int_equal(cfg.data.source, SOURCE_PASSKEY);
  assert_non_null(strstr(cfg.resolved, "passkey.depth = 0.25\n"));
  config_free(&cfg);
}

static const struct CMUnitTest tests[] = {
    cmocka_unit_test(test_layouts),      cmocka_unit_test(test_generators),
    cmocka_unit_test(test_buckets),      cmocka_unit_test(test_score),
    cmocka_unit_test(test_softmax_pred), cmocka_unit_test(test_export_roundtrip),
    cmocka_unit_test(test_bad_files),    cmocka_unit_test(test_deck_rules),
};

TU_MAIN(tests)
