/* The data module (SPEC §4): splits in fractions and bytes, training windows inside the train
 * split and independent of the rank layout, evaluation windows exactly as SPEC §4 defines them,
 * the copy task's layout and scored positions, and mlm masking. */
#include <unistd.h>

#include "testutil.h"

#include "../src/io/data.h"

/* A byte file whose byte at offset o is a known function of o. */
static char *make_file(size_t size) {
  static char path[64];
  snprintf(path, sizeof path, "/tmp/fmattn_test_data_%d.bin", (int)getpid());
  FILE *f = fopen(path, "wb");
  assert_non_null(f);
  for (size_t o = 0; o < size; o++) fputc((int)((o * 7 + o / 251) & 0xFF), f);
  fclose(f);
  return path;
}

static uint8_t byte_at(size_t o) { return (uint8_t)((o * 7 + o / 251) & 0xFF); }

static void load(struct config *cfg, const char *path, const char *split, int context,
                 const char *source, const char *objective) {
  tu_config(cfg, "full", context, 0, 0, strcmp(objective, "clm") == 0,
            TU_SETS(tu_fmt("data.source=%s", source), tu_fmt("data.split=%s", split),
                    "train.eval_windows=1000", path ? tu_fmt("data.path=%s", path) : NULL));
}

static void test_splits(void **state) {
  const size_t size = 100000;
  char *path = make_file(size);
  struct config cfg;
  struct dataset ds;
  load(&cfg, path, "0.9,0.05,0.05", 64, "file", "clm");
  data_open(&ds, &cfg);
  assert_int_equal(ds.length[0], 90000);
  assert_int_equal(ds.length[1], 5000);
  assert_int_equal(ds.length[2], 5000);
  assert_int_equal(ds.offset[1], 90000);
  assert_int_equal(ds.offset[2], 95000);
  data_close(&ds);
  config_free(&cfg);
  load(&cfg, path, "60000,3000,2000", 64, "file", "clm");
  data_open(&ds, &cfg);
  assert_true(cfg.data.split_is_bytes);
  assert_int_equal(ds.length[0], 60000);
  assert_int_equal(ds.offset[1], 60000);
  assert_int_equal(ds.length[1], 3000);
  assert_int_equal(ds.offset[2], 63000);
  assert_int_equal(ds.length[2], 2000);
  /* evaluation windows: as many as fit, at most train.eval_windows */
  assert_int_equal(data_eval_windows(&ds, SPLIT_VALID), (3000 - 1) / 64);
  data_close(&ds);
  config_free(&cfg);
  unlink(path);
}

static void test_windows(void **state) {
  const size_t size = 50000;
  char *path = make_file(size);
  struct config cfg;
  struct dataset ds;
  const int n = 32;
  load(&cfg, path, "0.8,0.1,0.1", n, "file", "clm");
  data_open(&ds, &cfg);
  /* SPEC §4: window k has inputs split[k·n, k·n + n) and targets one byte later */
  const long B = 3, windows = data_eval_windows(&ds, SPLIT_VALID);
  int tok[3 * 32], tgt[3 * 32];
  data_eval_batch(&ds, SPLIT_VALID, 5, 2, windows, B, 0, n, tok, tgt);
  for (long b = 0; b < B; b++) {
    long k = 5 + 2 * b;
    for (long t = 0; t < n; t++) {
      size_t o = ds.offset[1] + (size_t)(k * n + t);
      assert_int_equal(tok[b * n + t], byte_at(o));
      assert_int_equal(tgt[b * n + t], byte_at(o + 1));
    }
  }
  /* rows past the last window are not counted */
  data_eval_batch(&ds, SPLIT_TEST, windows - 1, 1, windows, 2, 0, n, tok, tgt);
  for (long t = 0; t < n; t++) assert_int_equal(tgt[n + t], -1);
  /* training windows: inside the train split, targets one byte on, the same bytes whichever
   * rank (slab t0) or replica (sample0) draws them */
  int whole_tok[4 * 32], whole_tgt[4 * 32];
  data_train_batch(&ds, 17, 0, 4, 0, n, whole_tok, whole_tgt);
  for (long b = 0; b < 4; b++) {
    /* find the window's offset from its first bytes, then check it lies in the split */
    uint8_t w[33];
    data_train_window(&ds, 17, b, w);
    for (long t = 0; t < n; t++) {
      assert_int_equal(whole_tok[b * n + t], w[t]);
      assert_int_equal(whole_tgt[b * n + t], w[t + 1]);
    }
    bool found = false;
    for (size_t o = 0; o + n < ds.length[0] && !found; o++)
      found = memcmp(ds.bytes + o, w, (size_t)n + 1) == 0;
    assert_true(found);
  }
  int part_tok[2 * 16], part_tgt[2 * 16];
  data_train_batch(&ds, 17, 2, 2, 16, 16, part_tok, part_tgt); /* replica of samples 2, 3; slab 1 */
  for (long b = 0; b < 2; b++)
    for (long t = 0; t < 16; t++) {
      assert_int_equal(part_tok[b * 16 + t], whole_tok[(b + 2) * n + 16 + t]);
      assert_int_equal(part_tgt[b * 16 + t], whole_tgt[(b + 2) * n + 16 + t]);
    }
  /* another step draws other windows */
  int other[4 * 32], other_t[4 * 32];
  data_train_batch(&ds, 18, 0, 4, 0, n, other, other_t);
  assert_true(memcmp(other, whole_tok, sizeof other) != 0);
  data_close(&ds);
  config_free(&cfg);
  unlink(path);
}

static void test_copy_task(void **state) {
  struct config cfg;
  struct dataset ds;
  const int n = 40;
  load(&cfg, NULL, "0.9,0.05,0.05", n, "copy", "clm");
  data_open(&ds, &cfg);
  uint8_t w[41];
  data_train_window(&ds, 3, 1, w);
  const int L = n / 2; /* copy_len 0: as many as fit */
  for (int t = 0; t < L; t++) {
    assert_true(w[t] >= 1 && w[t] <= cfg.data.symbols);
    assert_int_equal(w[L + 1 + t], w[t]);
  }
  assert_int_equal(w[L], 0);
  int tok[40], tgt[40];
  data_train_batch(&ds, 3, 1, 1, 0, n, tok, tgt);
  int scored = 0;
  for (int t = 0; t < n; t++) {
    if (t >= L && t < 2 * L) {
      assert_int_equal(tgt[t], w[t + 1]); /* the copy half is scored */
      scored++;
    } else {
      assert_int_equal(tgt[t], -1);
    }
  }
  assert_int_equal(scored, L);
  /* evaluation windows of a task are generated too, and differ from training ones */
  int et[40], eg[40];
  data_eval_batch(&ds, SPLIT_VALID, 0, 1, 8, 1, 0, n, et, eg);
  assert_true(memcmp(et, tok, sizeof et) != 0);
  data_close(&ds);
  config_free(&cfg);
}

static void test_mlm_masking(void **state) {
  const size_t size = 200000;
  char *path = make_file(size);
  struct config cfg;
  struct dataset ds;
  const int n = 256, B = 16;
  load(&cfg, path, "0.9,0.05,0.05", n, "file", "mlm");
  data_open(&ds, &cfg);
  int *tok = malloc(sizeof(int) * B * n), *tgt = malloc(sizeof(int) * B * n);
  data_train_batch(&ds, 1, 0, B, 0, n, tok, tgt);
  int masked = 0;
  for (int b = 0; b < B; b++) {
    uint8_t w[257];
    data_train_window(&ds, 1, b, w);
    for (int t = 0; t < n; t++) {
      int i = b * n + t;
      if (tok[i] == 256) {
        masked++;
        assert_int_equal(tgt[i], w[t]); /* the masked byte itself is the target */
      } else {
        assert_int_equal(tok[i], w[t]);
        assert_int_equal(tgt[i], -1);
      }
    }
  }
  double rate = (double)masked / (B * n);
  if (fabs(rate - 0.15) > 0.02) fail_msg("mlm masked %.3f of positions, expected 0.15", rate);
  free(tok);
  free(tgt);
  data_close(&ds);
  config_free(&cfg);
  unlink(path);
}

static const struct CMUnitTest tests[] = {
    cmocka_unit_test(test_splits),
    cmocka_unit_test(test_windows),
    cmocka_unit_test(test_copy_task),
    cmocka_unit_test(test_mlm_masking),
};

TU_MAIN(tests)
