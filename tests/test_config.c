/* Unit tests of the deck module (src/deck/config.c): defaults as documented in SPEC §3, the
 * --print-defaults round trip, one test per error class with its file:line, key and expected
 * text, overrides, the resolved deck round trip, byte splits and the rank-layout checks.
 * Decks are written to a private directory under /tmp, removed at the end; no test needs MPI
 * beyond MPI_Init (config_load_collective runs on the one rank). */
#define _POSIX_C_SOURCE 200809L

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <mpi.h>

#include "attention/attention.h"
#include "deck/config.h"
#include "tasks/tasks.h"

#define ERR_LEN 4096

/* snprintf into an array, failing the test when the text does not fit. */
#define FORMAT(buf, ...) assert_true(snprintf(buf, sizeof buf, __VA_ARGS__) < (int)sizeof buf)

static char dir[256];       /* private temporary directory */
static char files[64][512]; /* files written there, removed at the end */
static int file_count;

/* Writes text (or `bytes` filler bytes when text is NULL) to dir/name; returns the path. */
static const char *write_file(const char *name, const char *text, long bytes) {
  char path[512];
  FORMAT(path, "%s/%s", dir, name);
  FILE *f = fopen(path, "wb");
  assert_non_null(f);
  if (text)
    fputs(text, f);
  else
    for (long i = 0; i < bytes; i++) fputc('a' + (int)(i % 26), f);
  fclose(f);
  for (int i = 0; i < file_count; i++)
    if (strcmp(files[i], path) == 0) return files[i];
  assert_true(file_count < 64);
  snprintf(files[file_count], sizeof files[0], "%s", path);
  return files[file_count++];
}

/* Loads deck text (written as dir/deck.in) with overrides (a NULL-terminated list, or NULL). */
static int load_deck(struct config *cfg, const char *text, const char *const *sets, char *err) {
  struct config_overrides ov = {0};
  for (int i = 0; sets && sets[i]; i++) ov.items[ov.count++] = sets[i];
  err[0] = '\0';
  const char *path = text ? write_file("deck.in", text, 0) : NULL;
  return config_load(cfg, path, &ov, err, ERR_LEN);
}

static const char *const copy_source[] = {"data.source=copy", NULL};

#define assert_has(msg, part)                                                         \
  do {                                                                                \
    if (!strstr((msg), (part))) fail_msg("message \"%s\"\n lacks \"%s\"", msg, part); \
  } while (0)

/* Loads a deck that must fail and checks the message holds every one of parts (NULL-ended). */
static void expect_error(const char *deck, const char *const *sets, ...) {
  struct config cfg;
  char err[ERR_LEN];
  int rc = load_deck(&cfg, deck, sets, err);
  if (rc == 0) fail_msg("deck was accepted:\n%s", deck ? deck : "(defaults)");
  assert_null(cfg.resolved);
  va_list ap;
  va_start(ap, sets);
  for (const char *part; (part = va_arg(ap, const char *));) assert_has(err, part);
  va_end(ap);
  config_free(&cfg);
}

static void expect_ok(struct config *cfg, const char *deck, const char *const *sets) {
  char err[ERR_LEN];
  int rc = load_deck(cfg, deck, sets, err);
  if (rc != 0) fail_msg("deck refused: %s", err);
  assert_non_null(cfg->resolved);
}

/* Two configs are identical apart from the resolved text and the deck path. */
static void assert_same_config(const struct config *a, const struct config *b) {
  struct config x, y;
  memcpy(&x, a, sizeof x);
  memcpy(&y, b, sizeof y);
  x.resolved = y.resolved = NULL;
  memset(x.deck_path, 0, sizeof x.deck_path);
  memset(y.deck_path, 0, sizeof y.deck_path);
  assert_string_equal(x.run.name, y.run.name);
  assert_string_equal(x.attention.variant, y.attention.variant);
  assert_true(x.train.lr == y.train.lr);
  assert_memory_equal(&x, &y, sizeof x);
}

static const char *deck_file(void) { return files[0]; } /* dir/deck.in: the first file written */

/* --------------------------------------------------------------------------------------------- */

static void test_defaults(void **state) {
  (void)state;
  struct config c;
  expect_ok(&c, NULL, copy_source);
  assert_string_equal(c.run.name, "fmattn");
  assert_int_equal(c.run.mode, MODE_TRAIN);
  assert_int_equal(c.run.seed, 1234);
  assert_int_equal(c.data.source, SOURCE_COPY);
  assert_string_equal(c.data.path, "");
  assert_true(c.data.split[0] == 0.9 && c.data.split[1] == 0.05 && c.data.split[2] == 0.05);
  assert_false(c.data.split_is_bytes);
  assert_int_equal(c.data.symbols, 16);
  assert_int_equal(c.data.copy_len, 0);
  assert_int_equal(c.model.layers, 6);
  assert_int_equal(c.model.dim, 256);
  assert_int_equal(c.model.heads, 4);
  assert_int_equal(c.model.mlp_ratio, 4);
  assert_int_equal(c.model.context, 1024);
  assert_int_equal(c.model.position, POSITION_LEARNED);
  assert_true(c.model.dropout == 0.1);
  assert_int_equal(c.model.objective, OBJECTIVE_CLM);
  assert_true(c.model.tie_embeddings);
  assert_string_equal(c.attention.variant, "fma");
  assert_int_equal(c.attention.heads_mode, HEADS_STANDARD);
  assert_int_equal(c.attention.full_block, 64);
  assert_int_equal(c.attention.fma_m, 64);
  assert_int_equal(c.attention.fma_p, 4);
  assert_int_equal(c.attention.fma_downsample, FMA_DOWN_CONV);
  assert_int_equal(c.attention.fma_init, FMA_INIT_MEAN);
  assert_true(c.attention.fma_multiplicity);
  assert_int_equal(c.attention.local_band, 128);
  assert_int_equal(c.attention.fmmformer_band, 64);
  assert_string_equal(c.attention.fmmformer_kernels, "elu");
  assert_int_equal(c.attention.nystrom_landmarks, 64);
  assert_int_equal(c.attention.nystrom_pinv_iters, 6);
  assert_int_equal(c.attention.nystrom_conv, 33);
  assert_string_equal(c.attention.rmfa_kernel, "exp");
  assert_int_equal(c.attention.rmfa_features, 64);
  assert_true(c.attention.rmfa_ppsbn);
  assert_int_equal(c.attention.fish_global_heads, 1);
  assert_string_equal(c.attention.fish_mix, "linear");
  assert_true(c.attention.fish_noise == 0);
  assert_int_equal(c.train.steps, 1000);
  assert_int_equal(c.train.batch, 8);
  assert_true(c.train.lr == 3e-4);
  assert_true(c.train.min_lr == 3e-5);
  assert_int_equal(c.train.warmup, 100);
  assert_int_equal(c.train.schedule, SCHEDULE_COSINE);
  assert_true(c.train.weight_decay == 0.01);
  assert_true(c.train.beta1 == 0.9);
  assert_true(c.train.beta2 == 0.99);
  assert_true(c.train.eps == 1e-8);
  assert_true(c.train.clip == 1.0);
  assert_int_equal(c.train.eval_every, 200);
  assert_int_equal(c.train.eval_windows, 64);
  assert_false(c.train.recompute);
  assert_string_equal(c.output.dir, "runs");
  assert_int_equal(c.output.log_every, 10);
  assert_int_equal(c.output.diag_every, 100);
  assert_int_equal(c.output.checkpoint_every, 500);
  assert_int_equal(c.output.keep, 3);
  assert_string_equal(c.output.restart, "");
  assert_int_equal(c.parallel.seq_ranks, 1);
  assert_int_equal(c.parallel.backend, BACKEND_AUTO);
  assert_int_equal(c.parallel.device, DEVICE_AUTO);
  assert_int_equal(c.bench.what, BENCH_ATTENTION | BENCH_TRAIN);
  assert_int_equal(c.bench.n_count, 3);
  assert_int_equal(c.bench.n_list[0], 1024);
  assert_int_equal(c.bench.n_list[1], 4096);
  assert_int_equal(c.bench.n_list[2], 16384);
  assert_int_equal(c.bench.variant_count, 2);
  assert_string_equal(c.bench.variants[0], "full");
  assert_string_equal(c.bench.variants[1], "fma");
  assert_int_equal(c.bench.repeats, 5);
  assert_int_equal(c.bench.batch, 1);
  assert_string_equal(c.generate.prompt, "");
  assert_int_equal(c.generate.length, 256);
  assert_true(c.generate.temperature == 1.0);
  assert_int_equal(c.generate.top_k, 0);
  assert_string_equal(c.deck_path, "");
  assert_has(c.resolved, "; fmattn resolved deck from the built-in defaults\n");
  assert_has(c.resolved, "; --set data.source=copy\n");
  assert_has(c.resolved, "[run]\nname = fmattn\nmode = train\nseed = 1234\n");
  assert_has(c.resolved, "\nsource = copy\n");
  assert_has(c.resolved, "\nfma.m = 64\n");
  assert_has(c.resolved, "\nlr = 0.0003\n");
  assert_has(c.resolved, "\nn_list = 1024,4096,16384\n");
  config_free(&c);
  assert_null(c.resolved);

  /* Plain defaults read a byte file, which defaults to none. */
  expect_error(NULL, NULL, "<defaults>: data.path is empty", "scripts/get_kjv.sh", NULL);
}

static void test_print_defaults_round_trip(void **state) {
  (void)state;
  const char *path = write_file("defaults.in", "", 0);
  FILE *f = fopen(path, "w");
  assert_non_null(f);
  config_print_defaults(f);
  fclose(f);

  f = fopen(path, "r");
  char text[32768];
  size_t n = fread(text, 1, sizeof text - 1, f);
  fclose(f);
  text[n] = '\0';
  assert_has(text, "[attention]\n");
  assert_has(text, ";   a number > 0\nlr = 3e-4\n");
  assert_has(text, ";   one of learned, sinusoidal, rope, none\nposition = learned\n");
  assert_has(text, "\nname =\n");
  assert_has(text, "\nfma.m = 64\n");

  struct config printed, defaults;
  char err[ERR_LEN];
  struct config_overrides ov = {1, {"data.source=copy"}};
  int rc = config_load(&printed, path, &ov, err, sizeof err);
  if (rc) fail_msg("printed defaults refused: %s", err);
  assert_string_equal(printed.run.name, "defaults"); /* the deck stem */
  assert_string_equal(printed.deck_path, path);
  expect_ok(&defaults, NULL, copy_source);
  memcpy(printed.run.name, defaults.run.name, sizeof printed.run.name);
  assert_same_config(&printed, &defaults);
  config_free(&printed);
  config_free(&defaults);

  /* As printed, data.source = file with an empty path: refused, at the deck. */
  rc = config_load(&printed, path, NULL, err, sizeof err);
  assert_int_not_equal(rc, 0);
  assert_has(err, "defaults.in:");
  assert_has(err, ": data.path is empty, but data.source = file needs a byte file");
}

static void test_deck_values_and_stem(void **state) {
  (void)state;
  struct config c;
  const char *deck =
      "; a comment\n"
      "# another\n"
      "[run]\n"
      "mode = bench\n"
      "seed = 18446744073709551615\n"
      "  [model]   ; indented, with a comment\n"
      "  dim = 128\n"
      "heads = 8   # an inline hash comment\n"
      "position = ROPE\n"
      "tie_embeddings = off\n"
      "[attention]\n"
      "variant = fma_linear\n"
      "fma.downsample = m2m\n"
      "fmmformer.kernels = elu , tanh\n"
      "[bench]\n"
      "what = comm, attention\n"
      "n_list = 256,512\n"
      "variants = local,fma,nystrom\n";
  expect_ok(&c, deck, copy_source);
  assert_string_equal(c.run.name, "deck"); /* dir/deck.in */
  assert_string_equal(c.deck_path, deck_file());
  assert_int_equal(c.run.mode, MODE_BENCH);
  assert_true(c.run.seed == UINT64_MAX);
  assert_int_equal(c.model.dim, 128);
  assert_int_equal(c.model.heads, 8);
  assert_int_equal(c.model.position, POSITION_ROPE);
  assert_false(c.model.tie_embeddings);
  assert_string_equal(c.attention.variant, "fma_linear");
  assert_int_equal(c.attention.fma_downsample, FMA_DOWN_M2M);
  assert_string_equal(c.attention.fmmformer_kernels, "elu,tanh");
  assert_int_equal(c.bench.what, BENCH_COMM | BENCH_ATTENTION);
  assert_int_equal(c.bench.n_count, 2);
  assert_int_equal(c.bench.n_list[1], 512);
  assert_int_equal(c.bench.variant_count, 3);
  assert_string_equal(c.bench.variants[2], "nystrom");
  assert_has(c.resolved, "; fmattn resolved deck from ");
  assert_has(c.resolved, "deck.in\n");
  assert_has(c.resolved, "\nwhat = attention,comm\n");
  config_free(&c);

  /* The stem of a deck named after its job, and an explicit name. */
  const char *quick = write_file("quickstart.in", "[train]\nsteps = 5\n", 0);
  struct config_overrides ov = {1, {"data.source=copy"}};
  char err[ERR_LEN];
  assert_int_equal(config_load(&c, quick, &ov, err, sizeof err), 0);
  assert_string_equal(c.run.name, "quickstart");
  assert_int_equal(c.train.steps, 5);
  config_free(&c);
  expect_ok(&c, "[run]\nname = my-run_2.b\n", copy_source);
  assert_string_equal(c.run.name, "my-run_2.b");
  config_free(&c);
}

static void test_overrides_beat_deck(void **state) {
  (void)state;
  struct config c;
  const char *sets[] = {"data.source=copy",
                        "train.lr=2e-3",
                        "attention.fma.m=32",
                        " model.context = 2048 ",
                        "generate.prompt=a b=c",
                        "train.steps=7",
                        "train.steps=9",
                        "run.name=",
                        NULL};
  expect_ok(&c, "[train]\nlr = 1e-3\nsteps = 3\n[run]\nname = fromdeck\n", sets);
  assert_true(c.train.lr == 2e-3);
  assert_int_equal(c.attention.fma_m, 32);
  assert_int_equal(c.model.context, 2048);
  assert_string_equal(c.generate.prompt, "a b=c");
  assert_int_equal(c.train.steps, 9);      /* the last --set wins */
  assert_string_equal(c.run.name, "deck"); /* empty: the deck stem again */
  assert_has(c.resolved, "; --set train.lr=2e-3\n");
  assert_has(c.resolved, "\nlr = 0.002\n");
  config_free(&c);
}

static void test_resolved_round_trip(void **state) {
  (void)state;
  char long_prompt[400];
  memset(long_prompt, 'x', sizeof long_prompt - 1);
  long_prompt[sizeof long_prompt - 1] = '\0';
  memcpy(long_prompt, "In the beginning ", 17);
  char deck[4096];
  FORMAT(deck,
         "[run]\nname = rt\nmode = generate\nseed = 99\n"
         "[data]\nsource = majority\nsplit = 1000,200,300\nsymbols = 7\ncopy_len = 5\n"
         "[model]\nlayers = 3\ndim = 96\nheads = 3\nmlp_ratio = 2\ncontext = 4096\n"
         "position = sinusoidal\ndropout = 0\nobjective = mlm\ntie_embeddings = no\n"
         "[attention]\nvariant = local\nheads_mode = fish\nfull.block = 32\nfma.m = 128\n"
         "fma.p = 8\nfma.init = random\nfma.multiplicity = false\nlocal.band = 17\n"
         "fmmformer.band = 9\nfmmformer.kernels = tanh,elu_neg\nnystrom.landmarks = 16\n"
         "nystrom.pinv_iters = 9\nnystrom.conv = 0\nrmfa.kernel = trigh\n"
         "rmfa.features = 33\nrmfa.ppsbn = 0\nfish.global_heads = 2\nfish.mix = mlp\n"
         "fish.noise = 0.125\n"
         "[train]\nsteps = 123456789012\nbatch = 12\nlr = 0.1\nmin_lr = 1e-7\n"
         "warmup = 0\nschedule = linear\nweight_decay = 0.3\nbeta1 = 0.8\nbeta2 = 0.95\n"
         "eps = 3.3e-9\nclip = 0\neval_every = 0\neval_windows = 5\nrecompute = yes\n"
         "[output]\ndir = /scratch/me/runs\nlog_every = 1\ndiag_every = 0\n"
         "checkpoint_every = 7\nkeep = 9\nrestart = latest\n"
         "[parallel]\nseq_ranks = 4\nbackend = nccl\ndevice = gpu\n"
         "[bench]\nwhat = train\nn_list = 2,3,5\nvariants = rmfa,full\nrepeats = 1000\n"
         "batch = 3\n"
         "[generate]\nprompt = %s\nlength = 1048576\ntemperature = 0.7\ntop_k = 40\n",
         long_prompt);
  struct config a, b;
  const char *sets[] = {"train.lr=0.1000000000000000055511151231257827", NULL};
  expect_ok(&a, deck, sets);
  assert_string_equal(a.generate.prompt, long_prompt);
  assert_true(a.data.split_is_bytes);
  assert_true(a.data.split[2] == 300);
  assert_int_equal(a.train.steps, 123456789012L);
  assert_true(a.attention.fish_noise == 0.125);

  char err[ERR_LEN];
  int rc = config_from_text(&b, a.resolved, err, sizeof err);
  if (rc) fail_msg("resolved deck refused: %s\n%s", err, a.resolved);
  assert_string_equal(b.resolved, a.resolved); /* every rank holds the same text */
  assert_same_config(&a, &b);
  config_free(&b);

  /* A resolved deck naming a byte file that is not here parses: the file was checked before. */
  expect_ok(&b, "[data]\nsource = majority\npath = /nonexistent/kjv.txt\n", NULL);
  char *text = strdup(b.resolved);
  config_free(&b);
  char *source = strstr(text, "source = majority");
  assert_non_null(source);
  memcpy(source, "source = file    ", 17);
  rc = config_from_text(&b, text, err, sizeof err);
  if (rc) fail_msg("resolved deck refused: %s", err);
  assert_int_equal(b.data.source, SOURCE_FILE);
  assert_string_equal(b.data.path, "/nonexistent/kjv.txt");
  config_free(&b);
  free(text);

  /* Errors in resolved text are located as such. */
  rc = config_from_text(&b, "[model]\ndim = wide\n", err, sizeof err);
  assert_int_not_equal(rc, 0);
  assert_has(err, "<resolved deck>:2: model.dim = 'wide': expected an integer in [1, 65536]");
  config_free(&a);
}

/* --------------------------------------------------------------------------------------------- */

static void test_unknown_section(void **state) {
  (void)state;
  expect_error("[run]\nmode = train\n\n[trian]\nlr = 1\n", copy_source, deck_file(),
               ":4: unknown section [trian]; did you mean [train]?", NULL);
  expect_error("[run]\n[xyzzy]\n", copy_source,
               ":2: unknown section [xyzzy]; valid sections: run, "
               "data, model, attention, train, output, parallel, gpu, bench, generate",
               NULL);
  expect_error("[Model]\n", copy_source, ":1: unknown section [Model]; did you mean [model]?",
               NULL);
  /* Two edits away is still close for a short name; a rewrite is not. */
  expect_error("[tarn]\n", copy_source, ":1: unknown section [tarn]; did you mean [train]?", NULL);
  expect_error("[ab]\n", copy_source, ":1: unknown section [ab]; valid sections:", NULL);
}

static void test_unknown_key(void **state) {
  (void)state;
  expect_error("[train]\nsteps = 10\nlerning_rate = 1e-3\n", copy_source, deck_file(),
               ":3: unknown key 'lerning_rate' in [train]; did you mean 'lr'?", NULL);
  expect_error("[train]\nstpes = 10\n", copy_source,
               ":2: unknown key 'stpes' in [train]; did you "
               "mean 'steps'?",
               NULL);
  expect_error("[train]\ndim = 64\n", copy_source,
               ":2: unknown key 'dim' in [train]; did you mean 'model.dim'?", NULL);
  expect_error("[model]\nn_head = 8\n", copy_source, "did you mean 'heads'?", NULL);
  expect_error("[attention]\nm = 32\n", copy_source, "did you mean 'fma.m'?", NULL);
  expect_error("[train]\nzzzzzzzzzz = 1\n", copy_source,
               ":2: unknown key 'zzzzzzzzzz' in [train]; valid keys in [train]: steps, batch, lr, "
               "min_lr, warmup",
               NULL);
  /* One letter is a whole rewrite away from anything: no guess. */
  expect_error("[train]\nx = 1\n", copy_source,
               ":2: unknown key 'x' in [train]; valid keys in [train]: steps", NULL);
  expect_error("lr = 1\n[train]\n", copy_source,
               ":1: key 'lr' comes before any [section]; did you mean 'train.lr'?", NULL);
}

static void test_given_twice(void **state) {
  (void)state;
  expect_error("[train]\n\n\nlr = 1e-3\nsteps = 5\nlr = 2e-3\n", copy_source, deck_file(),
               ":6: train.lr given twice (first at line 4)", NULL);
  /* A section may come back; its keys still count once. */
  expect_error("[model]\ndim = 64\n[train]\n[model]\ndim = 64\n", copy_source,
               ":5: model.dim given twice (first at line 2)", NULL);
}

static void test_bad_values(void **state) {
  (void)state;
  expect_error("[train]\n\nlr = abc\n", copy_source, deck_file(),
               ":3: train.lr = 'abc': expected a number > 0", NULL);
  expect_error("[train]\nlr = 0\n", copy_source,
               ":2: train.lr = 0 is out of range: expected a number > 0", NULL);
  expect_error("[model]\ndropout = 1.5\n", copy_source,
               ":2: model.dropout = 1.5 is out of range: expected a number in [0, 1)", NULL);
  expect_error("[model]\nlayers = 2.5\n", copy_source,
               ":2: model.layers = '2.5': expected an integer in [1, 1024]", NULL);
  expect_error("[model]\nlayers = 0\n", copy_source,
               "model.layers = 0 is out of range: expected an integer in [1, 1024]", NULL);
  expect_error("[model]\ncontext = 16777217\n", copy_source,
               "model.context = 16777217 is out of range: expected an integer in [2, 16777216]",
               NULL);
  expect_error("[train]\nbatch = 99999999999\n", copy_source,
               "train.batch = 99999999999 is out of range: expected an integer >= 1", NULL);
  expect_error("[train]\nsteps = -1\n", copy_source,
               "train.steps = -1 is out of range: expected an integer >= 0", NULL);
  expect_error("[model]\nposition = absolute\n", copy_source,
               ":2: model.position = 'absolute': expected one of learned, sinusoidal, rope, none",
               NULL);
  expect_error("[attention]\nvariant = nystroem\n", copy_source,
               "attention.variant = 'nystroem': expected one of full, local, linear, fma, "
               "fma_linear, fmmformer, nystrom, rmfa; did you mean 'nystrom'?",
               NULL);
  expect_error("[model]\nposition = rop\n", copy_source, "did you mean 'rope'?", NULL);
  expect_error("[model]\ntie_embeddings = maybe\n", copy_source,
               "model.tie_embeddings = 'maybe': expected true or false", NULL);
  expect_error("[run]\nseed = -1\n", copy_source, "run.seed = '-1': expected an integer >= 0",
               NULL);
  expect_error("[run]\nseed = 18446744073709551616\n", copy_source,
               "run.seed = 18446744073709551616 is out of range", NULL);
  expect_error("[run]\nname = my run\n", copy_source,
               "run.name = 'my run': expected up to 511 letters, digits, '.', '_' or '-'", NULL);
  expect_error("[run]\nname = ..\n", copy_source, "run.name = '..'", NULL);
  expect_error("[output]\ndir =\n", copy_source, "output.dir = '': expected a non-empty text",
               NULL);
  expect_error("[attention]\nnystrom.conv = 32\n", copy_source,
               "attention.nystrom.conv = '32': expected an integer in [0, 1025] that is odd or 0",
               NULL);
  expect_error("[attention]\nnystrom.conv = 1027\n", copy_source, "is out of range", NULL);
  expect_error("[train]\nlr = nan\n", copy_source, "train.lr = 'nan'", NULL);
  expect_error("[train]\nlr = 1e999\n", copy_source, "train.lr = 1e999 is out of range", NULL);

  struct config c;
  expect_ok(&c, "[attention]\nnystrom.conv = 1025\n[run]\nseed = 0\n", copy_source);
  assert_int_equal(c.attention.nystrom_conv, 1025);
  assert_true(c.run.seed == 0);
  config_free(&c);
}

static void test_syntax_error(void **state) {
  (void)state;
  expect_error("[train]\nsteps = 5\nthis line has no equals\n", copy_source, deck_file(),
               ":3: syntax error (expected 'key = value' or '[section]')", NULL);
  /* inih goes on after a bad line; the first error is the one reported. */
  expect_error("[train]\nbogus\nlr = abc\n", copy_source, ":2: syntax error", NULL);
  expect_error("[train\nlr = 1\n", copy_source, ":1: syntax error", NULL);
  expect_error("[train]\n = 3\n", copy_source, ":2: syntax error", NULL);
  /* A line the parser cannot hold is refused, not cut. */
  char deck[8192] = "[generate]\nprompt = ";
  size_t n = strlen(deck);
  memset(deck + n, 'y', 5000);
  deck[n + 5000] = '\0';
  expect_error(deck, copy_source, ":2: line is longer than", NULL);
  /* A comment that long is only cut, and the lines after it keep their numbers. */
  memcpy(deck, "; ", 2);
  memset(deck + 2, 'c', 5000);
  strcpy(deck + 5002, "\n[train]\nlr = abc\n");
  expect_error(deck, copy_source, ":3: train.lr = 'abc'", NULL);
}

static void test_missing_deck(void **state) {
  (void)state;
  struct config c;
  char err[ERR_LEN], path[512];
  FORMAT(path, "%s/nope.in", dir);
  assert_int_not_equal(config_load(&c, path, NULL, err, sizeof err), 0);
  char want[600];
  FORMAT(want, "cannot read deck '%s': No such file or directory", path);
  assert_string_equal(err, want);
  assert_int_not_equal(config_load(&c, dir, NULL, err, sizeof err), 0);
  assert_has(err, "cannot read deck");
  assert_has(err, "Is a directory");
  /* A small error buffer gets a cut message, never an overrun. */
  char small[16];
  memset(small, 'Z', sizeof small);
  assert_int_not_equal(config_load(&c, path, NULL, small, 12), 0);
  assert_int_equal(strlen(small), 11);
  assert_int_equal(small[12], 'Z');
}

static void test_data_file(void **state) {
  (void)state;
  expect_error("[run]\nseed = 1\n[data]\nsource = file\npath = /nonexistent/kjv.txt\n", NULL,
               deck_file(),
               ":5: data.path = '/nonexistent/kjv.txt': cannot open (No such file or directory); "
               "run scripts/get_kjv.sh (KJV) or scripts/get_enwik8.sh",
               NULL);
  const char *set_path[] = {"data.path=/nonexistent/x", NULL};
  expect_error("[data]\npath = ok\n", set_path,
               "--set data.path=/nonexistent/x: data.path = '/nonexistent/x': cannot open", NULL);
  expect_error("[data]\npath =\n", NULL, ":2: data.path is empty, but data.source = file", NULL);
  expect_error("[train]\nsteps = 1\n", NULL, "deck.in: data.path is empty", NULL);

  char deck[1024];
  FORMAT(deck, "[data]\npath = %s\n", dir);
  expect_error(deck, NULL, "is not a regular file", NULL);

  /* 3000 bytes: 0.05 of it is 150, fewer than a 1025-byte window. */
  const char *small = write_file("small.txt", NULL, 3000);
  FORMAT(deck, "[model]\ncontext = 1024\n[data]\n\npath = %s\n", small);
  char want[1024];
  FORMAT(want,
         ":5: data.path '%s' has 3000 bytes; split 0.9,0.05,0.05 gives valid 150 bytes, fewer "
         "than model.context+1 = 1025",
         small);
  expect_error(deck, NULL, want, NULL);

  /* Fractions of a long enough file. */
  const char *big = write_file("big.txt", NULL, 40000);
  struct config c;
  FORMAT(deck, "[data]\npath = %s\n", big);
  expect_ok(&c, deck, NULL);
  assert_int_equal(c.data.source, SOURCE_FILE);
  assert_string_equal(c.data.path, big);
  config_free(&c);
}

static void test_split(void **state) {
  (void)state;
  const char *file = write_file("bytes.txt", NULL, 5200);
  char deck[1024];
  struct config c;
  FORMAT(deck, "[data]\npath = %s\nsplit = 3000, 1100, 1100\n", file);
  expect_ok(&c, deck, NULL);
  assert_true(c.data.split_is_bytes);
  assert_true(c.data.split[0] == 3000 && c.data.split[1] == 1100 && c.data.split[2] == 1100);
  assert_has(c.resolved, "\nsplit = 3000,1100,1100\n");
  config_free(&c);

  FORMAT(deck, "[data]\npath = %s\nsplit = 3000,1100,1200\n", file);
  expect_error(deck, NULL, ":3: data.split = 3000,1100,1200 needs 5300 bytes, but data.path",
               "has 5200", NULL);
  /* The boundary: a split of exactly context+1 bytes is enough, one byte fewer is not. */
  FORMAT(deck, "[data]\npath = %s\nsplit = 3000,1025,1024\n", file);
  expect_error(deck, NULL, "gives test 1024 bytes, fewer than model.context+1 = 1025", NULL);
  FORMAT(deck, "[data]\npath = %s\nsplit = 3000,1025,1025\n", file);
  expect_ok(&c, deck, NULL);
  config_free(&c);

  expect_ok(&c, "[data]\nsplit = 1,0,0\n", copy_source);
  assert_false(c.data.split_is_bytes);
  config_free(&c);
  expect_error("[data]\nsplit = 0.5,0.3,0.1\n", copy_source,
               ":2: data.split = '0.5,0.3,0.1': expected three comma-separated numbers >= 0",
               "these fractions sum to 0.9, not 1", NULL);
  expect_error("[data]\nsplit = 0.5,2,3\n", copy_source, "mixes fractions and byte counts", NULL);
  expect_error("[data]\nsplit = 0.5,0.5\n", copy_source, "got 2 items", NULL);
  expect_error("[data]\nsplit = 0.5,,0.5\n", copy_source, "item 2 is empty", NULL);
  expect_error("[data]\nsplit = 0.5,-0.5,1\n", copy_source, "'-0.5' is not a number >= 0", NULL);
}

static void test_override_errors(void **state) {
  (void)state;
  const char *bad_number[] = {"data.source=copy", "train.lr=abc", NULL};
  expect_error("[train]\nlr = 1e-3\n", bad_number,
               "--set train.lr=abc: train.lr = 'abc': expected a number > 0", NULL);
  const char *no_equals[] = {"data.source=copy", "train.lr", NULL};
  expect_error(NULL, no_equals, "--set train.lr: expected section.key=value", NULL);
  const char *no_section[] = {"lr=1e-3", NULL};
  expect_error(NULL, no_section, "--set lr=1e-3: expected section.key=value",
               "did you mean 'train.lr'?", NULL);
  const char *misspelt[] = {"train.lerning_rate=1", NULL};
  expect_error(NULL, misspelt,
               "--set train.lerning_rate=1: unknown key 'lerning_rate' in [train]; did you mean "
               "'train.lr'?",
               NULL);
  const char *bad_section[] = {"trian.lr=1", NULL};
  expect_error(NULL, bad_section,
               "--set trian.lr=1: unknown section [trian]; did you mean [train]?", NULL);
  const char *bad_chars[] = {"train.[x=1", NULL};
  expect_error(NULL, bad_chars, "--set train.[x=1: expected section.key=value", NULL);
  struct config_overrides null_item = {1, {NULL}};
  struct config c0;
  char err[ERR_LEN];
  assert_int_not_equal(config_load(&c0, NULL, &null_item, err, sizeof err), 0);
  assert_has(err, "--set : expected section.key=value");
  const char *two_lines[] = {"generate.prompt=a\nb", NULL};
  expect_error(NULL, two_lines, "a value cannot hold a line break", NULL);
  const char *comment[] = {"generate.prompt=hi ; there", NULL};
  expect_error(NULL, comment,
               "--set generate.prompt=hi ; there: a value cannot hold ';' after a space", NULL);
  const char *leading[] = {"generate.prompt=#1", NULL};
  expect_error(NULL, leading, "a value cannot hold '#' after a space", NULL);
  /* Inside a word they are ordinary characters. */
  struct config c;
  const char *plain[] = {"data.source=copy", "generate.prompt=a;b#c", NULL};
  expect_ok(&c, NULL, plain);
  assert_string_equal(c.generate.prompt, "a;b#c");
  config_free(&c);
}

static void test_cross_key_rules(void **state) {
  (void)state;
  expect_error("[model]\ndim = 250\n\nheads = 4\n", copy_source, deck_file(),
               ":4: model.dim = 250 is not divisible by model.heads = 4", NULL);
  const char *heads5[] = {"data.source=copy", "model.heads=5", NULL};
  expect_error(NULL, heads5,
               "--set model.heads=5: model.dim = 256 is not divisible by "
               "model.heads = 5",
               NULL);
  expect_error("[model]\nposition = rope\ndim = 12\nheads = 4\n", copy_source,
               ":4: model.position = rope needs an even head size, but model.dim / model.heads = "
               "12 / 4 = 3",
               NULL);
  expect_error("[train]\nlr = 1e-3\nmin_lr = 0.01\n", copy_source,
               ":3: train.min_lr = 0.01 is larger than train.lr = 0.001", NULL);
  expect_error("[attention]\nfma.p = 3\n", copy_source,
               ":2: attention.fma.p = 3 does not divide attention.fma.m = 64", NULL);
  expect_error("[model]\ncontext = 1000\n", copy_source,
               ":2: attention.variant = fma needs model.context / attention.fma.m to be a power of "
               "two >= 2, but model.context = 1000 and attention.fma.m = 64",
               NULL);
  expect_error("[model]\ncontext = 64\n[attention]\nvariant = fma_linear\n", copy_source,
               ":4: attention.variant = fma_linear needs", NULL);
  expect_error("[model]\ncontext = 768\n", copy_source, "power of two", NULL);
  expect_error("[run]\nmode = bench\n[bench]\nn_list = 1024,1000\n", copy_source,
               ":4: bench.variants has fma, which cannot run at n = 1000 of bench.n_list",
               "power of two", NULL);
  expect_error("[attention]\nvariant = local\nheads_mode = fish\nfish.global_heads = 4\n",
               copy_source,
               ":4: attention.fish.global_heads = 4 must be fewer than model.heads = 4", NULL);
  expect_error("[attention]\nheads_mode = fish\n", copy_source,
               ":2: attention.heads_mode = fish composes with attention.variant = full or local, "
               "not fma",
               NULL);
  expect_error("[attention]\nvariant = nystrom\n", copy_source,
               ":2: attention.variant = nystrom is bidirectional only (segment means mix future "
               "tokens); use model.objective = mlm",
               NULL);
  expect_error("[model]\nobjective = mlm\n[attention]\nvariant = nystrom\nnystrom.landmarks = 60\n",
               copy_source, ":5: attention.nystrom.landmarks = 60 does not divide", NULL);
  expect_error("[run]\nmode = generate\n", copy_source,
               ":2: run.mode = generate needs output.restart", NULL);
  expect_error("[run]\nmode = eval\n", copy_source, "run.mode = eval needs output.restart", NULL);
  expect_error("[data]\ncopy_len = 513\n", copy_source, ":2: data.copy_len = 513 does not fit",
               NULL);

  /* fma.open (SPEC §6.4a): an integer >= 0 or all; fma only; all is the check of small contexts */
  expect_error("[attention]\nfma.open = -1\n", copy_source,
               ":2: attention.fma.open = '-1': expected an integer >= 0, or all", NULL);
  expect_error("[attention]\nfma.open = 1.5\n", copy_source,
               "attention.fma.open = '1.5': expected an integer >= 0, or all", NULL);
  expect_error("[attention]\nfma.open = every\n", copy_source,
               "'every' is neither an integer >= 0 nor all", NULL);
  expect_error("[attention]\nfma.open = 1,2\n", copy_source, "give one value, not 2", NULL);
  expect_error("[attention]\nvariant = fma_linear\nfma.open = 2\n", copy_source,
               ":3: attention.fma.open opens far windows of fma's single softmax; fma_linear "
               "normalises each level on its own and has no opening",
               NULL);
  expect_error("[model]\ncontext = 16384\n[attention]\nfma.open = all\n", copy_source,
               "attention.fma.open = all opens every window: it is exact attention at O(n^2) cost",
               "model.context = 16384", NULL);
  expect_error("[bench]\nfma_open = 0,x\n", copy_source,
               "bench.fma_open = '0,x': expected a comma list of fma.open values", NULL);

  /* The same keys, consistent, pass; a variant's rules apply to the variant the deck runs. */
  struct config c;
  expect_ok(&c, "[attention]\nfma.open = ALL\n[bench]\nfma_open = 0,2,all,deck\n", copy_source);
  assert_int_equal(c.attention.fma_open, FMA_OPEN_ALL);
  assert_int_equal(c.bench.fma_open_count, 4);
  assert_int_equal(c.bench.fma_open[1], 2);
  assert_int_equal(c.bench.fma_open[3], BENCH_OPEN_DECK);
  config_free(&c);
  expect_ok(&c, "[attention]\nfma.open = 3\n", copy_source);
  assert_int_equal(c.attention.fma_open, 3);
  assert_non_null(strstr(c.resolved, "fma.open = 3"));
  config_free(&c);
  expect_ok(&c,
            "[model]\nposition = rope\ndim = 16\nheads = 4\nobjective = mlm\ncontext = 128\n"
            "[attention]\nvariant = nystrom\nnystrom.landmarks = 32\n"
            "[run]\nmode = generate\n[output]\nrestart = latest\n[data]\ncopy_len = 64\n",
            copy_source);
  config_free(&c);
  expect_ok(&c,
            "[model]\nposition = rope\ndim = 16\nheads = 4\ncontext = 128\n"
            "[attention]\nvariant = full\nheads_mode = fish\nfish.global_heads = 3\n",
            copy_source);
  config_free(&c);
  expect_ok(&c, "[model]\ncontext = 1000\n[attention]\nvariant = full\nfish.global_heads = 9\n",
            copy_source);
  config_free(&c);
}

static void test_lists(void **state) {
  (void)state;
  expect_error("[bench]\nn_list = 1024,1\n", copy_source,
               ":2: bench.n_list = '1024,1': expected a comma list of up to 32 integers >= 2",
               "'1' is not an integer >= 2", NULL);
  expect_error("[bench]\nvariants = full,fmaa\n", copy_source,
               ":2: bench.variants = 'full,fmaa': expected a comma list of full, local, linear",
               "'fmaa' is not one; did you mean 'fma'?", NULL);
  expect_error("[bench]\nwhat = attention,gpu\n", copy_source,
               "bench.what = 'attention,gpu': expected a comma list of attention, train, comm",
               NULL);
  expect_error("[bench]\nwhat =\n", copy_source, "the list is empty", NULL);
  expect_error("[attention]\nfmmformer.kernels = elu,relu\n", copy_source,
               "expected a comma list of elu, elu_neg, tanh", NULL);
  expect_error("[attention]\nfmmformer.kernels = elu,ELU\n", copy_source, "'elu' is given twice",
               NULL);
  char many[512] = "[bench]\nn_list = 2";
  for (int i = 0; i < 32; i++) strcat(many, ",4");
  strcat(many, "\n");
  expect_error(many, copy_source, "more than 32 items", NULL);

  struct config c;
  expect_ok(&c, "[bench]\nwhat = comm\nn_list = 2,3\nvariants = FMA\n", copy_source);
  assert_int_equal(c.bench.what, BENCH_COMM);
  assert_int_equal(c.bench.variant_count, 1);
  assert_string_equal(c.bench.variants[0], "fma");
  config_free(&c);
}

static void test_layout(void **state) {
  (void)state;
  struct config c;
  char err[ERR_LEN];
  expect_ok(&c, NULL, copy_source);
  assert_int_equal(config_check_layout(&c, 1, err, sizeof err), 0);
  assert_int_equal(config_check_layout(&c, 8, err, sizeof err), 0);
  assert_int_not_equal(config_check_layout(&c, 3, err, sizeof err), 0);
  assert_string_equal(err,
                      "train.batch = 8 is not divisible by the 3 data-parallel replicas (world 3 / "
                      "seq_ranks 1)");
  config_free(&c);

  const char *seq4[] = {"data.source=copy", "parallel.seq_ranks=4", NULL};
  expect_ok(&c, NULL, seq4);
  assert_int_not_equal(config_check_layout(&c, 6, err, sizeof err), 0);
  assert_string_equal(err, "parallel.seq_ranks = 4 does not divide the 6 MPI ranks");
  assert_int_equal(config_check_layout(&c, 8, err, sizeof err), 0);
  config_free(&c);

  const char *batch6[] = {"data.source=copy", "parallel.seq_ranks=2", "train.batch=6", NULL};
  expect_ok(&c, NULL, batch6);
  assert_int_not_equal(config_check_layout(&c, 8, err, sizeof err), 0);
  assert_string_equal(err,
                      "train.batch = 6 is not divisible by the 4 data-parallel replicas (world 8 / "
                      "seq_ranks 2)");
  assert_int_equal(config_check_layout(&c, 6, err, sizeof err), 0);
  config_free(&c);

  const char *seq3[] = {"data.source=copy", "parallel.seq_ranks=3", NULL};
  expect_ok(&c, NULL, seq3);
  assert_int_not_equal(config_check_layout(&c, 3, err, sizeof err), 0);
  assert_string_equal(err, "model.context = 1024 is not divisible by parallel.seq_ranks = 3");
  config_free(&c);
}

static void test_names_and_vocab(void **state) {
  (void)state;
  assert_string_equal(config_mode_name(MODE_TRAIN), "train");
  assert_string_equal(config_mode_name(MODE_GENERATE), "generate");
  assert_string_equal(config_mode_name(MODE_BENCH), "bench");
  assert_string_equal(config_position_name(POSITION_ROPE), "rope");
  assert_string_equal(config_position_name(POSITION_NONE), "none");
  assert_string_equal(config_downsample_name(FMA_DOWN_M2M), "m2m");
  assert_string_equal(config_downsample_name(FMA_DOWN_AVG), "avg");
  struct config c;
  expect_ok(&c, NULL, copy_source);
  assert_int_equal(config_vocab(&c), 256);
  config_free(&c);
  const char *mlm[] = {"data.source=copy", "model.objective=mlm", NULL};
  expect_ok(&c, NULL, mlm);
  assert_int_equal(config_vocab(&c), 257);
  config_free(&c);
}

static void test_collective(void **state) {
  (void)state;
  const char *path = write_file("coll.in", "[train]\nsteps = 42\n", 0);
  struct config_overrides ov = {1, {"data.source=copy"}};
  struct config c;
  config_load_collective(&c, path, &ov);
  assert_int_equal(c.train.steps, 42);
  assert_string_equal(c.run.name, "coll");
  assert_string_equal(c.deck_path, path);
  assert_non_null(c.resolved);
  assert_has(c.resolved, "\nsteps = 42\n");
  config_free(&c);
}

static int setup(void **state) {
  (void)state;
  snprintf(dir, sizeof dir, "/tmp/fmattn_test_config_XXXXXX");
  if (!mkdtemp(dir)) return -1;
  write_file("deck.in", "", 0);    /* files[0]: the deck load_deck writes */
  config_add_rule(task_deck_rule); /* as fmattn's main adds them: the tasks' rules, the variants' */
  config_add_rule(attention_deck_rule);
  return 0;
}

static int teardown(void **state) {
  (void)state;
  for (int i = 0; i < file_count; i++) unlink(files[i]);
  return rmdir(dir);
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_defaults),
      cmocka_unit_test(test_print_defaults_round_trip),
      cmocka_unit_test(test_deck_values_and_stem),
      cmocka_unit_test(test_overrides_beat_deck),
      cmocka_unit_test(test_resolved_round_trip),
      cmocka_unit_test(test_unknown_section),
      cmocka_unit_test(test_unknown_key),
      cmocka_unit_test(test_given_twice),
      cmocka_unit_test(test_bad_values),
      cmocka_unit_test(test_syntax_error),
      cmocka_unit_test(test_missing_deck),
      cmocka_unit_test(test_data_file),
      cmocka_unit_test(test_split),
      cmocka_unit_test(test_override_errors),
      cmocka_unit_test(test_cross_key_rules),
      cmocka_unit_test(test_lists),
      cmocka_unit_test(test_layout),
      cmocka_unit_test(test_names_and_vocab),
      cmocka_unit_test(test_collective),
  };
  cmocka_set_message_output(CM_OUTPUT_TAP);
  int failed = cmocka_run_group_tests_name("config", tests, setup, teardown);
  MPI_Finalize();
  return failed ? 1 : 0;
}
