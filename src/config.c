/* The input deck (SPEC §3): one table of every key, from which parsing, validation, the resolved
 * deck and --print-defaults all come, so they cannot disagree. config_load validates a deck and its
 * --set overrides and reports the first error with file:line, key, what was expected and the
 * nearest valid name. It must not print, call MPI (only config_load_collective does), read a data
 * file beyond checking that it is there and long enough, or judge whether a variant is implemented.
 */
#define _POSIX_C_SOURCE 200809L

#include "config.h"

#include <ctype.h>
#include <errno.h>
#include <ini.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>

#include "error.h"

/* Debian's libinih exposes its line limit as a variable; upstream fixes it at build time (200
 * bytes). A weak reference links against either: with the variable we raise the limit while we
 * parse (a prompt or a path may be long), without it the reader refuses longer lines clearly. */
extern int ini_max_line;
#pragma weak ini_max_line

#define LINE_MAX_BYTES 4096 /* the longest deck line we accept, when inih lets us choose */
#define MSG_LEN        4096 /* one error message */
#define LIST_ITEM      64   /* one item of a comma list (bench.variants stores char[64]) */

/* Enums are written through an int pointer; that is only sound while they are int-sized. */
_Static_assert(sizeof(enum run_mode) == sizeof(int), "enum storage");
_Static_assert(sizeof(enum position_kind) == sizeof(int), "enum storage");
_Static_assert(sizeof(enum fma_downsample) == sizeof(int), "enum storage");

/* ---------------------------------------------------------------------------------------------
 * Names. Each list is in enum order: the index of a word is the enum value it stands for. */

static const char *const section_names[] = {"run",    "data",     "model", "attention", "train",
                                            "output", "parallel", "bench", "generate",  NULL};
static const char *const mode_names[] = {"train", "eval", "generate", "bench", NULL};
static const char *const source_names[] = {"file", "copy", "majority", NULL};
static const char *const position_names[] = {"learned", "sinusoidal", "rope", "none", NULL};
static const char *const objective_names[] = {"clm", "mlm", NULL};
static const char *const schedule_names[] = {"cosine", "linear", "constant", NULL};
static const char *const backend_names[] = {"auto", "mpi", "nccl", NULL};
static const char *const device_names[] = {"auto", "cpu", "gpu", NULL};
static const char *const downsample_names[] = {"conv", "m2m", "avg", NULL};
static const char *const init_names[] = {"mean", "random", NULL};
static const char *const heads_mode_names[] = {"standard", "fish", NULL};
static const char *const variant_names[] = {"full",      "local",   "linear", "fma", "fma_linear",
                                            "fmmformer", "nystrom", "rmfa",   NULL};
static const char *const rmfa_kernel_names[] = {"exp", "inv", "log", "trigh", "sqrt", NULL};
static const char *const fish_mix_names[] = {"linear", "mlp", NULL};
static const char *const kernel_names[] = {"elu", "elu_neg", "tanh", NULL};
/* In bit order of enum bench_what. */
static const char *const bench_what_names[] = {"attention", "train", "comm", NULL};

static int name_index(const char *const *names, const char *word) {
  for (int i = 0; names[i]; i++)
    if (strcasecmp(names[i], word) == 0) return i;
  return -1;
}

/* ---------------------------------------------------------------------------------------------
 * The key table. */

enum key_type {
  KEY_INT,
  KEY_LONG,
  KEY_UINT64,
  KEY_DOUBLE,
  KEY_BOOL,
  KEY_STRING,
  KEY_CHOICE,
  KEY_LIST
};

enum key_flag {
  HAS_LO = 1 << 0,
  HAS_HI = 1 << 1,
  LO_OPEN = 1 << 2,     /* lo itself is not allowed */
  HI_OPEN = 1 << 3,     /* hi itself is not allowed */
  ODD_OR_ZERO = 1 << 4, /* nystrom.conv: a centred kernel needs an odd length */
  NONEMPTY = 1 << 5,    /* strings that may not be "" */
  NAME_CHARS = 1 << 6,  /* run.name becomes a directory name: [A-Za-z0-9._-], "" = deck stem */
};

/* A comma list: the words it may hold (or NULL for numbers), and how it is stored and printed. */
struct list_kind {
  const char *const *words;
  const char *expected; /* when words is NULL */
  int (*store)(struct config *cfg, char items[][LIST_ITEM], int n, char *detail, size_t len);
  void (*format)(const struct config *cfg, char *out, size_t len);
};

struct key_def {
  const char *section, *name;
  enum key_type type;
  const char *def; /* default, as deck text */
  double lo, hi;   /* range, as flagged */
  unsigned flags;
  const char *const *choices;   /* KEY_CHOICE: words in enum order */
  const struct list_kind *list; /* KEY_LIST */
  size_t offset;                /* of the field in struct config (unused for lists) */
  size_t size;                  /* KEY_STRING, and a KEY_CHOICE kept as text: buffer bytes */
  const char *aliases;          /* names other codes use, space separated: only for suggestions */
  const char *help;
};

static int store_split(struct config *cfg, char items[][LIST_ITEM], int n, char *detail,
                       size_t len);
static int store_what(struct config *cfg, char items[][LIST_ITEM], int n, char *detail, size_t len);
static int store_n_list(struct config *cfg, char items[][LIST_ITEM], int n, char *detail,
                        size_t len);
static int store_variants(struct config *cfg, char items[][LIST_ITEM], int n, char *detail,
                          size_t len);
static int store_kernels(struct config *cfg, char items[][LIST_ITEM], int n, char *detail,
                         size_t len);
static void format_split(const struct config *cfg, char *out, size_t len);
static void format_what(const struct config *cfg, char *out, size_t len);
static void format_n_list(const struct config *cfg, char *out, size_t len);
static void format_variants(const struct config *cfg, char *out, size_t len);
static void format_kernels(const struct config *cfg, char *out, size_t len);

static const struct list_kind split_list = {
    NULL,
    "three comma-separated numbers >= 0 (train,valid,test): fractions summing to 1, or whole "
    "byte counts",
    store_split, format_split};
static const struct list_kind what_list = {bench_what_names, NULL, store_what, format_what};
static const struct list_kind n_list = {NULL, "a comma list of up to 32 integers >= 2",
                                        store_n_list, format_n_list};
static const struct list_kind variants_list = {variant_names, NULL, store_variants,
                                               format_variants};
static const struct list_kind kernels_list = {kernel_names, NULL, store_kernels, format_kernels};

#define FIELD(f)      offsetof(struct config, f)
#define FIELD_SIZE(f) sizeof(((struct config *)0)->f)
#define K_NUM(sec, key, type, def, lo, hi, flags, f, aliases, help) \
  { sec, key, type, def, lo, hi, flags, NULL, NULL, FIELD(f), 0, aliases, help }
#define K_BOOL(sec, key, def, f, aliases, help) \
  { sec, key, KEY_BOOL, def, 0, 0, 0, NULL, NULL, FIELD(f), 0, aliases, help }
#define K_TEXT(sec, key, def, flags, f, aliases, help) \
  { sec, key, KEY_STRING, def, 0, 0, flags, NULL, NULL, FIELD(f), FIELD_SIZE(f), aliases, help }
#define K_ENUM(sec, key, def, words, f, aliases, help) \
  { sec, key, KEY_CHOICE, def, 0, 0, 0, words, NULL, FIELD(f), 0, aliases, help }
/* A choice the struct keeps as its word (attention.variant and friends). */
#define K_WORD(sec, key, def, words, f, aliases, help) \
  { sec, key, KEY_CHOICE, def, 0, 0, 0, words, NULL, FIELD(f), FIELD_SIZE(f), aliases, help }
#define K_LIST(sec, key, def, kind, aliases, help) \
  { sec, key, KEY_LIST, def, 0, 0, 0, NULL, &kind, 0, 0, aliases, help }

#define LO1  HAS_LO
#define LOHI (HAS_LO | HAS_HI)

/* Grouped by section, in section_names order: the resolved deck and --print-defaults follow it. */
static const struct key_def keys[] = {
    K_TEXT(
        "run", "name", "", NAME_CHARS, run.name, "run_name experiment",
        "run name; outputs go to output.dir/name/ (empty: the deck file name without extension)"),
    K_ENUM("run", "mode", "train", mode_names, run.mode, "",
           "train; eval (valid and test loss of the output.restart checkpoint); generate; bench"),
    K_NUM("run", "seed", KEY_UINT64, "1234", 0, 0, LO1, run.seed, "random_seed",
          "seed of every random stream"),

    K_ENUM("data", "source", "file", source_names, data.source, "task",
           "file: the byte file data.path; copy, majority: synthetic tasks made in-process"),
    K_TEXT("data", "path", "", 0, data.path, "file data_path dataset",
           "byte file (data.source = file): scripts/get_kjv.sh or scripts/get_enwik8.sh write one"),
    K_LIST("data", "split", "0.9,0.05,0.05", split_list, "splits",
           "train,valid,test in file order: fractions, or byte counts (enwik8: "
           "90000000,5000000,5000000)"),
    K_NUM("data", "symbols", KEY_INT, "16", 2, 255, LOHI, data.symbols, "alphabet vocab",
          "alphabet size of the synthetic tasks"),
    K_NUM("data", "copy_len", KEY_INT, "0", 0, 0, LO1, data.copy_len, "copy_length",
          "copy task: symbols before the separator (0: as many as fit)"),

    K_NUM("model", "layers", KEY_INT, "6", 1, 1024, LOHI, model.layers,
          "n_layer n_layers num_layers depth", "transformer blocks"),
    K_NUM("model", "dim", KEY_INT, "256", 1, 65536, LOHI, model.dim,
          "n_embd d_model hidden_size embed_dim width", "model width C"),
    K_NUM("model", "heads", KEY_INT, "4", 1, 1024, LOHI, model.heads, "n_head n_heads num_heads",
          "attention heads H (head size dim/heads)"),
    K_NUM("model", "mlp_ratio", KEY_INT, "4", 1, 64, LOHI, model.mlp_ratio, "ffn_ratio mlp_mult",
          "MLP hidden width = mlp_ratio * dim"),
    K_NUM("model", "context", KEY_INT, "1024", 2, 16777216, LOHI, model.context,
          "block_size seq_len sequence_length n_ctx max_seq_len ctx n",
          "sequence length n per sample"),
    K_ENUM("model", "position", "learned", position_names, model.position,
           "pos_emb positional_encoding pos_encoding", "position encoding"),
    K_NUM("model", "dropout", KEY_DOUBLE, "0.1", 0, 1, LOHI | HI_OPEN, model.dropout, "p_drop",
          "residual and MLP dropout"),
    K_ENUM("model", "objective", "clm", objective_names, model.objective, "loss",
           "clm: causal next byte; mlm: bidirectional, 15% of the bytes masked"),
    K_BOOL("model", "tie_embeddings", "true", model.tie_embeddings, "tie_weights weight_tying",
           "the output head shares the token embedding"),

    K_WORD("attention", "variant", "fma", variant_names, attention.variant, "type kind attention",
           "attention of every layer"),
    K_ENUM("attention", "heads_mode", "standard", heads_mode_names, attention.heads_mode, "fish",
           "standard, or fish (global query/key heads shared by the value heads)"),
    K_NUM("attention", "full.block", KEY_INT, "64", 8, 4096, LOHI, attention.full_block, "tile",
          "full: query/key tile size"),
    K_NUM("attention", "fma.m", KEY_INT, "64", 1, 65536, LOHI, attention.fma_m, "",
          "fma: fine block size m (model.context / m a power of two >= 2)"),
    K_NUM("attention", "fma.p", KEY_INT, "4", 1, 4096, LOHI, attention.fma_p, "rank",
          "fma: summaries per window p (divides fma.m)"),
    K_ENUM("attention", "fma.downsample", "conv", downsample_names, attention.fma_downsample, "",
           "fma: how windows are summarised (conv: the paper; m2m: hierarchical; avg: fixed)"),
    K_ENUM("attention", "fma.init", "mean", init_names, attention.fma_init, "",
           "fma: initial summary weights (mean: start as avg; random: uniform)"),
    K_BOOL("attention", "fma.multiplicity", "true", attention.fma_multiplicity, "",
           "fma: add log(w/p) to coarse scores (a summary stands for w/p tokens)"),
    K_NUM("attention", "local.band", KEY_INT, "128", 1, 0, LO1, attention.local_band, "window",
          "local: band width in tokens"),
    K_NUM("attention", "fmmformer.band", KEY_INT, "64", 1, 0, LO1, attention.fmmformer_band, "",
          "fmmformer: band width of the near field"),
    K_LIST("attention", "fmmformer.kernels", "elu", kernels_list, "",
           "fmmformer: feature maps of the far field"),
    K_NUM("attention", "nystrom.landmarks", KEY_INT, "64", 1, 0, LO1, attention.nystrom_landmarks,
          "landmarks", "nystrom: landmarks, means of equal segments (divides model.context)"),
    K_NUM("attention", "nystrom.pinv_iters", KEY_INT, "6", 1, 100, LOHI,
          attention.nystrom_pinv_iters, "", "nystrom: iterations of the pseudo-inverse"),
    K_NUM("attention", "nystrom.conv", KEY_INT, "33", 0, 1025, LOHI | ODD_OR_ZERO,
          attention.nystrom_conv, "", "nystrom: depthwise convolution length on v (0: none)"),
    K_WORD("attention", "rmfa.kernel", "exp", rmfa_kernel_names, attention.rmfa_kernel, "",
           "rmfa: kernel whose Maclaurin series is sampled"),
    K_NUM("attention", "rmfa.features", KEY_INT, "64", 2, 65536, LOHI, attention.rmfa_features, "",
          "rmfa: random features D"),
    K_BOOL("attention", "rmfa.ppsbn", "true", attention.rmfa_ppsbn, "",
           "rmfa: pre- and post-scaling batch normalisation"),
    K_NUM("attention", "fish.global_heads", KEY_INT, "1", 1, 0, LO1, attention.fish_global_heads,
          "", "fish: global query/key heads G (< model.heads)"),
    K_WORD("attention", "fish.mix", "linear", fish_mix_names, attention.fish_mix, "",
           "fish: linear (hard FiSH) or mlp (GFiSH) mixing of global scores"),
    K_NUM("attention", "fish.noise", KEY_DOUBLE, "0", 0, 0, LO1, attention.fish_noise, "",
          "fish: noise scale on global scores, training only"),

    K_NUM("train", "steps", KEY_LONG, "1000", 0, 0, LO1, train.steps,
          "max_steps max_iters iters num_steps", "optimizer steps"),
    K_NUM("train", "batch", KEY_INT, "8", 1, 0, LO1, train.batch, "batch_size bs",
          "sequences per step, global (all ranks)"),
    K_NUM("train", "lr", KEY_DOUBLE, "3e-4", 0, 0, LO1 | LO_OPEN, train.lr, "learning_rate",
          "peak learning rate"),
    K_NUM("train", "min_lr", KEY_DOUBLE, "3e-5", 0, 0, LO1, train.min_lr,
          "min_learning_rate lr_min final_lr", "final learning rate (<= lr)"),
    K_NUM("train", "warmup", KEY_LONG, "100", 0, 0, LO1, train.warmup, "warmup_steps warmup_iters",
          "linear warm-up steps"),
    K_ENUM("train", "schedule", "cosine", schedule_names, train.schedule,
           "lr_schedule decay scheduler", "learning-rate decay after warm-up"),
    K_NUM("train", "weight_decay", KEY_DOUBLE, "0.01", 0, 0, LO1, train.weight_decay, "wd",
          "AdamW weight decay"),
    K_NUM("train", "beta1", KEY_DOUBLE, "0.9", 0, 1, LOHI | HI_OPEN, train.beta1, "",
          "AdamW beta1"),
    K_NUM("train", "beta2", KEY_DOUBLE, "0.99", 0, 1, LOHI | HI_OPEN, train.beta2, "",
          "AdamW beta2"),
    K_NUM("train", "eps", KEY_DOUBLE, "1e-8", 0, 0, LO1 | LO_OPEN, train.eps, "epsilon adam_eps",
          "AdamW epsilon"),
    K_NUM("train", "clip", KEY_DOUBLE, "1.0", 0, 0, LO1, train.clip,
          "grad_clip clip_grad max_grad_norm", "global gradient-norm clip (0: off)"),
    K_NUM("train", "eval_every", KEY_LONG, "200", 0, 0, LO1, train.eval_every, "eval_interval",
          "validation cadence in steps (0: only at the end)"),
    K_NUM("train", "eval_windows", KEY_INT, "64", 1, 0, LO1, train.eval_windows, "eval_iters",
          "contiguous windows per evaluation"),
    K_BOOL("train", "recompute", "false", train.recompute, "checkpointing activation_checkpointing",
           "recompute activations in backward (needed for very long n)"),

    K_TEXT("output", "dir", "runs", NONEMPTY, output.dir, "out_dir output_dir", "output directory"),
    K_NUM("output", "log_every", KEY_LONG, "10", 1, 0, LO1, output.log_every, "log_interval",
          "console and diag.h5 cadence in steps"),
    K_NUM("output", "diag_every", KEY_LONG, "100", 0, 0, LO1, output.diag_every, "",
          "attention diagnostics cadence (0: off)"),
    K_NUM("output", "checkpoint_every", KEY_LONG, "500", 0, 0, LO1, output.checkpoint_every,
          "save_every checkpoint_interval",
          "checkpoint cadence (0: only at the end and on SIGTERM/SIGUSR1)"),
    K_NUM("output", "keep", KEY_INT, "3", 1, 0, LO1, output.keep, "", "checkpoints kept"),
    K_TEXT("output", "restart", "", 0, output.restart, "resume init_from",
           "checkpoint to start from: a path, or latest (empty: a fresh start)"),

    K_NUM("parallel", "seq_ranks", KEY_INT, "1", 1, 0, LO1, parallel.seq_ranks, "sp",
          "ranks sharing one sequence; the world size must be a multiple"),
    K_ENUM("parallel", "backend", "auto", backend_names, parallel.backend, "",
           "communication (auto: nccl on GPUs, else mpi)"),
    K_ENUM("parallel", "device", "auto", device_names, parallel.device, "", "where to compute"),

    K_LIST("bench", "what", "attention,train", what_list, "", "what to time"),
    K_LIST("bench", "n_list", "1024,4096,16384", n_list, "n lengths",
           "sequence lengths of the sweep"),
    K_LIST("bench", "variants", "full,fma", variants_list, "", "attention variants of the sweep"),
    K_NUM("bench", "repeats", KEY_INT, "5", 1, 1000, LOHI, bench.repeats, "",
          "timed repetitions after one warm-up (the median is reported)"),
    K_NUM("bench", "batch", KEY_INT, "1", 1, 0, LO1, bench.batch, "",
          "sequences per timed attention call and per timed training step"),

    K_TEXT("generate", "prompt", "", 0, generate.prompt, "",
           "text the generation continues (a space before ; or # starts a comment)"),
    K_NUM("generate", "length", KEY_INT, "256", 1, 1048576, LOHI, generate.length, "max_new_tokens",
          "bytes to generate"),
    K_NUM("generate", "temperature", KEY_DOUBLE, "1.0", 0, 0, LO1 | LO_OPEN, generate.temperature,
          "temp", "sampling temperature"),
    K_NUM("generate", "top_k", KEY_INT, "0", 0, 0, LO1, generate.top_k, "topk",
          "sample among the k likeliest bytes (0: all)"),
};

enum { NKEYS = sizeof keys / sizeof keys[0] };

static int key_find(const char *section, const char *name) {
  for (int k = 0; k < NKEYS; k++)
    if (strcmp(keys[k].section, section) == 0 && strcmp(keys[k].name, name) == 0) return k;
  return -1;
}

/* "model.dim" → its index; only the first dot separates section and key (attention.fma.m). */
static int key_find_qualified(const char *qualified) {
  const char *dot = strchr(qualified, '.');
  if (!dot) return -1;
  char section[64];
  snprintf(section, sizeof section, "%.*s", (int)(dot - qualified), qualified);
  return key_find(section, dot + 1);
}

/* ---------------------------------------------------------------------------------------------
 * Small text helpers. */

/* A growing heap string for the resolved deck. */
struct text_buf {
  char *s;
  size_t len, cap;
};

__attribute__((format(printf, 2, 3))) static void buf_printf(struct text_buf *b, const char *fmt,
                                                             ...) {
  for (;;) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(b->s ? b->s + b->len : NULL, b->s ? b->cap - b->len : 0, fmt, ap);
    va_end(ap);
    if (b->s && b->len + (size_t)n < b->cap) {
      b->len += (size_t)n;
      return;
    }
    size_t cap = 2 * (b->cap + (size_t)n) + 256;
    char *s = xmalloc(cap);
    if (b->s) memcpy(s, b->s, b->len + 1);
    free(b->s);
    b->s = s;
    b->cap = cap;
  }
}

static char *trim(char *s) {
  while (isspace((unsigned char)*s)) s++;
  size_t n = strlen(s);
  while (n > 0 && isspace((unsigned char)s[n - 1])) s[--n] = '\0';
  return s;
}

/* Edit distance with transpositions (optimal string alignment), ignoring case, so that "trian"
 * is one step from "train". Names are short; longer inputs are cut at 63 characters. */
static int edit_distance(const char *a, const char *b) {
  int n = (int)strlen(a), m = (int)strlen(b);
  if (n > 63) n = 63;
  if (m > 63) m = 63;
  int rows[3][64]; /* rows i-2, i-1, i */
  for (int j = 0; j <= m; j++) rows[1][j] = j;
  for (int i = 1; i <= n; i++) {
    int *cur = rows[(i + 1) % 3], *prev = rows[i % 3], *prev2 = rows[(i + 2) % 3];
    cur[0] = i;
    for (int j = 1; j <= m; j++) {
      int ca = tolower((unsigned char)a[i - 1]), cb = tolower((unsigned char)b[j - 1]);
      int d = prev[j - 1] + (ca != cb);
      if (prev[j] + 1 < d) d = prev[j] + 1;
      if (cur[j - 1] + 1 < d) d = cur[j - 1] + 1;
      if (i > 1 && j > 1 && ca == tolower((unsigned char)b[j - 2]) &&
          tolower((unsigned char)a[i - 2]) == cb && prev2[j - 2] + 1 < d)
        d = prev2[j - 2] + 1;
      cur[j] = d;
    }
  }
  return rows[(n + 1) % 3][m];
}

/* Close enough to suggest: a few edits, and never a rewrite of the whole word. */
static bool is_close(const char *given, int distance) {
  int n = (int)strlen(given), limit = n / 3 > 2 ? n / 3 : 2;
  return distance <= limit && distance < n;
}

static void join_words(const char *const *words, char *out, size_t len) {
  size_t used = 0;
  out[0] = '\0';
  for (int i = 0; words[i] && used < len; i++)
    used += (size_t)snprintf(out + used, len - used, "%s%s", i ? ", " : "", words[i]);
}

/* "; did you mean 'rope'?" when word is near one of words, else "". */
static void suggest_word(const char *const *words, const char *word, char *out, size_t len) {
  int best = -1, best_d = INT_MAX;
  for (int i = 0; words[i]; i++) {
    int d = edit_distance(word, words[i]);
    if (d < best_d) best = i, best_d = d;
  }
  if (best >= 0 && is_close(word, best_d))
    snprintf(out, len, "; did you mean '%s'?", words[best]);
  else
    out[0] = '\0';
}

/* The shortest %g text that reads back as the same double, so the resolved deck is exact; whole
 * numbers in full, so byte counts read as such (3000, not 3e+03). */
static void format_double(double v, char *out, size_t len) {
  if (v == floor(v) && fabs(v) < 1e15) {
    snprintf(out, len, "%.0f", v);
    return;
  }
  for (int digits = 1; digits <= 17; digits++) {
    snprintf(out, len, "%.*g", digits, v);
    if (strtod(out, NULL) == v) return;
  }
}

/* Strict decimal integer: no trailing text, no hex, no exponent. 1 = overflow, -1 = not one. */
static int parse_integer(const char *s, long long *out) {
  if (!*s || isspace((unsigned char)*s)) return -1;
  char *end;
  errno = 0;
  *out = strtoll(s, &end, 10);
  if (end == s || *end) return -1;
  return errno == ERANGE ? 1 : 0;
}

/* A finite number; 1 = too large for a double, -1 = not a number. */
static int parse_number(const char *s, double *out) {
  if (!*s || isspace((unsigned char)*s)) return -1;
  char *end;
  errno = 0;
  *out = strtod(s, &end);
  if (end == s || *end) return -1;
  if (isnan(*out)) return -1;
  if (isinf(*out) || (errno == ERANGE && fabs(*out) > 1)) return 1;
  return 0;
}

/* ---------------------------------------------------------------------------------------------
 * Converting one value. */

enum { CONVERT_OK, CONVERT_BAD, CONVERT_RANGE };

static void expected_text(const struct key_def *k, char *out, size_t len) {
  switch (k->type) {
    case KEY_INT:
    case KEY_LONG:
    case KEY_UINT64:
    case KEY_DOUBLE: {
      const char *noun = k->type == KEY_DOUBLE ? "a number" : "an integer";
      if ((k->flags & HAS_LO) && (k->flags & HAS_HI))
        snprintf(out, len, "%s in %c%.15g, %.15g%c%s", noun, k->flags & LO_OPEN ? '(' : '[', k->lo,
                 k->hi, k->flags & HI_OPEN ? ')' : ']',
                 k->flags & ODD_OR_ZERO ? " that is odd or 0" : "");
      else if (k->flags & HAS_LO)
        snprintf(out, len, "%s %s %.15g", noun, k->flags & LO_OPEN ? ">" : ">=", k->lo);
      else
        snprintf(out, len, "%s", noun);
      break;
    }
    case KEY_BOOL:
      snprintf(out, len, "true or false (or yes/no, on/off, 1/0)");
      break;
    case KEY_STRING:
      if (k->flags & NAME_CHARS)
        snprintf(out, len, "up to %zu letters, digits, '.', '_' or '-'", k->size - 1);
      else
        snprintf(out, len, "%s of at most %zu characters",
                 k->flags & NONEMPTY ? "a non-empty text" : "a text", k->size - 1);
      break;
    case KEY_CHOICE: {
      char words[512];
      join_words(k->choices, words, sizeof words);
      snprintf(out, len, "one of %s", words);
      break;
    }
    case KEY_LIST:
      if (k->list->words) {
        char words[512];
        join_words(k->list->words, words, sizeof words);
        snprintf(out, len, "a comma list of %s", words);
      } else {
        snprintf(out, len, "%s", k->list->expected);
      }
      break;
  }
}

static bool outside(const struct key_def *k, double v) {
  if (k->flags & HAS_LO && ((k->flags & LO_OPEN) ? v <= k->lo : v < k->lo)) return true;
  if (k->flags & HAS_HI && ((k->flags & HI_OPEN) ? v >= k->hi : v > k->hi)) return true;
  return false;
}

/* Splits a comma list into trimmed items. Returns the count, or -1 with the reason in detail. */
static int list_split(const char *text, char items[][LIST_ITEM], char *detail, size_t len) {
  char copy[CONFIG_LIST_MAX * LIST_ITEM + 64];
  if (strlen(text) >= sizeof copy) {
    snprintf(detail, len, "; the list is too long");
    return -1;
  }
  strcpy(copy, text);
  if (!*trim(copy)) {
    snprintf(detail, len, "; the list is empty");
    return -1;
  }
  int n = 0;
  for (char *item = copy;;) {
    char *comma = strchr(item, ',');
    if (comma) *comma = '\0';
    char *word = trim(item);
    if (!*word) {
      snprintf(detail, len, "; item %d is empty", n + 1);
      return -1;
    }
    if (n == CONFIG_LIST_MAX) {
      snprintf(detail, len, "; more than %d items", CONFIG_LIST_MAX);
      return -1;
    }
    if (strlen(word) >= LIST_ITEM) {
      snprintf(detail, len, "; item '%.20s...' is too long", word);
      return -1;
    }
    strcpy(items[n++], word);
    if (!comma) return n;
    item = comma + 1;
  }
}

/* Converts text into k's field of cfg. On failure returns CONVERT_BAD or CONVERT_RANGE and writes
 * the message after the location ("train.lr = 'abc': expected a number > 0") into msg. */
static int key_convert(const struct key_def *k, const char *text, struct config *cfg, char *msg,
                       size_t len) {
  void *field = (char *)cfg + k->offset;
  char detail[256] = "";
  int status = CONVERT_OK;
  switch (k->type) {
    case KEY_INT:
    case KEY_LONG: {
      long long v;
      int rc = parse_integer(text, &v);
      long long top = k->type == KEY_INT ? INT_MAX : LONG_MAX;
      if (rc < 0) {
        status = CONVERT_BAD;
      } else if (rc > 0 || outside(k, (double)v) || v > top || v < -top) {
        status = CONVERT_RANGE;
        if (!(k->flags & HAS_HI) && rc == 0 && !outside(k, (double)v))
          snprintf(detail, sizeof detail, " (at most %lld)", top);
      } else if (k->flags & ODD_OR_ZERO && v != 0 && v % 2 == 0) {
        status = CONVERT_BAD;
      } else if (k->type == KEY_INT) {
        *(int *)field = (int)v;
      } else {
        *(long *)field = (long)v;
      }
      break;
    }
    case KEY_UINT64: {
      /* strtoull would take "-1" as 2^64-1: refuse any sign. */
      char *end;
      errno = 0;
      unsigned long long v = strtoull(text, &end, 10);
      if (!isdigit((unsigned char)text[0]) || *end)
        status = CONVERT_BAD;
      else if (errno == ERANGE)
        status = CONVERT_RANGE;
      else
        *(uint64_t *)field = (uint64_t)v;
      break;
    }
    case KEY_DOUBLE: {
      double v;
      int rc = parse_number(text, &v);
      if (rc < 0)
        status = CONVERT_BAD;
      else if (rc > 0 || outside(k, v))
        status = CONVERT_RANGE;
      else
        *(double *)field = v;
      break;
    }
    case KEY_BOOL: {
      static const char *const yes[] = {"true", "yes", "on", "1", NULL};
      static const char *const no[] = {"false", "no", "off", "0", NULL};
      if (name_index(yes, text) >= 0)
        *(bool *)field = true;
      else if (name_index(no, text) >= 0)
        *(bool *)field = false;
      else
        status = CONVERT_BAD;
      break;
    }
    case KEY_STRING: {
      size_t n = strlen(text);
      bool ok = n < k->size && !(k->flags & NONEMPTY && n == 0);
      if (ok && k->flags & NAME_CHARS) {
        for (size_t i = 0; i < n; i++)
          if (!isalnum((unsigned char)text[i]) && !strchr("._-", text[i])) ok = false;
        /* "." and ".." would put outputs beside or above output.dir. */
        if (strcmp(text, ".") == 0 || strcmp(text, "..") == 0) ok = false;
      }
      if (!ok) {
        status = CONVERT_BAD;
      } else {
        memset(field, 0, k->size); /* zeroed tails keep configs comparable with memcmp */
        memcpy(field, text, n);
      }
      break;
    }
    case KEY_CHOICE: {
      int i = name_index(k->choices, text);
      if (i < 0) {
        status = CONVERT_BAD;
        suggest_word(k->choices, text, detail, sizeof detail);
      } else if (k->size) {
        memset(field, 0, k->size);
        snprintf(field, k->size, "%s", k->choices[i]);
      } else {
        *(int *)field = i;
      }
      break;
    }
    case KEY_LIST: {
      char items[CONFIG_LIST_MAX][LIST_ITEM];
      int n = list_split(text, items, detail, sizeof detail);
      if (n < 0) {
        status = CONVERT_BAD;
        break;
      }
      for (int i = 0; k->list->words && i < n; i++) {
        if (name_index(k->list->words, items[i]) >= 0) continue;
        char hint[128];
        suggest_word(k->list->words, items[i], hint, sizeof hint);
        snprintf(detail, sizeof detail, "; '%s' is not one%s", items[i], hint);
        status = CONVERT_BAD;
        break;
      }
      if (status == CONVERT_OK && k->list->store(cfg, items, n, detail, sizeof detail))
        status = CONVERT_BAD;
      break;
    }
  }
  if (status == CONVERT_OK) return CONVERT_OK;
  char expected[600];
  expected_text(k, expected, sizeof expected);
  if (status == CONVERT_BAD)
    snprintf(msg, len, "%s.%s = '%s': expected %s%s", k->section, k->name, text, expected, detail);
  else
    snprintf(msg, len, "%s.%s = %s is out of range: expected %s%s", k->section, k->name, text,
             expected, detail);
  return status;
}

/* The value of k in cfg as deck text: the resolved deck writes this, config_from_text reads it. */
static void key_format(const struct key_def *k, const struct config *cfg, char *out, size_t len) {
  const void *field = (const char *)cfg + k->offset;
  switch (k->type) {
    case KEY_INT:
      snprintf(out, len, "%d", *(const int *)field);
      break;
    case KEY_LONG:
      snprintf(out, len, "%ld", *(const long *)field);
      break;
    case KEY_UINT64:
      snprintf(out, len, "%llu", (unsigned long long)*(const uint64_t *)field);
      break;
    case KEY_DOUBLE:
      format_double(*(const double *)field, out, len);
      break;
    case KEY_BOOL:
      snprintf(out, len, "%s", *(const bool *)field ? "true" : "false");
      break;
    case KEY_STRING:
      snprintf(out, len, "%s", (const char *)field);
      break;
    case KEY_CHOICE:
      snprintf(out, len, "%s", k->size ? (const char *)field : k->choices[*(const int *)field]);
      break;
    case KEY_LIST:
      k->list->format(cfg, out, len);
      break;
  }
}

/* ---------------------------------------------------------------------------------------------
 * Comma lists. */

static int store_split(struct config *cfg, char items[][LIST_ITEM], int n, char *detail,
                       size_t len) {
  if (n != 3) {
    snprintf(detail, len, "; got %d item%s", n, n == 1 ? "" : "s");
    return 1;
  }
  double v[3], sum = 0;
  bool fractions = true, whole = true;
  for (int i = 0; i < 3; i++) {
    if (parse_number(items[i], &v[i]) != 0 || v[i] < 0) {
      snprintf(detail, len, "; '%s' is not a number >= 0", items[i]);
      return 1;
    }
    sum += v[i];
    if (v[i] > 1) fractions = false;
    if (v[i] != floor(v[i]) || v[i] > 9007199254740992.0) whole = false; /* exact up to 2^53 */
  }
  fractions = fractions && fabs(sum - 1) <= 1e-6;
  if (!fractions && !whole) {
    if (sum <= 3 && v[0] <= 1 && v[1] <= 1 && v[2] <= 1)
      snprintf(detail, len, "; these fractions sum to %.15g, not 1", sum);
    else
      snprintf(detail, len, "; it mixes fractions and byte counts");
    return 1;
  }
  for (int i = 0; i < 3; i++) cfg->data.split[i] = v[i];
  cfg->data.split_is_bytes = !fractions;
  return 0;
}

static void format_split(const struct config *cfg, char *out, size_t len) {
  char v[3][32];
  for (int i = 0; i < 3; i++) format_double(cfg->data.split[i], v[i], sizeof v[i]);
  snprintf(out, len, "%s,%s,%s", v[0], v[1], v[2]);
}

static int store_what(struct config *cfg, char items[][LIST_ITEM], int n, char *detail,
                      size_t len) {
  (void)detail, (void)len;
  cfg->bench.what = 0;
  for (int i = 0; i < n; i++) cfg->bench.what |= 1u << name_index(bench_what_names, items[i]);
  return 0;
}

static void format_what(const struct config *cfg, char *out, size_t len) {
  size_t used = 0;
  out[0] = '\0';
  for (int i = 0; bench_what_names[i]; i++)
    if (cfg->bench.what & (1u << i))
      used +=
          (size_t)snprintf(out + used, len - used, "%s%s", used ? "," : "", bench_what_names[i]);
}

static int store_n_list(struct config *cfg, char items[][LIST_ITEM], int n, char *detail,
                        size_t len) {
  for (int i = 0; i < n; i++) {
    long long v;
    if (parse_integer(items[i], &v) != 0 || v < 2 || v > LONG_MAX) {
      snprintf(detail, len, "; '%s' is not an integer >= 2", items[i]);
      return 1;
    }
    cfg->bench.n_list[i] = (long)v;
  }
  cfg->bench.n_count = n;
  for (int i = n; i < CONFIG_LIST_MAX; i++) cfg->bench.n_list[i] = 0;
  return 0;
}

static void format_n_list(const struct config *cfg, char *out, size_t len) {
  size_t used = 0;
  out[0] = '\0';
  for (int i = 0; i < cfg->bench.n_count && used < len; i++)
    used += (size_t)snprintf(out + used, len - used, "%s%ld", i ? "," : "", cfg->bench.n_list[i]);
}

/* The canonical spelling of each word, and no word twice. */
static int canonical_words(const char *const *words, char items[][LIST_ITEM], int n, char *detail,
                           size_t len) {
  for (int i = 0; i < n; i++) {
    snprintf(items[i], LIST_ITEM, "%s", words[name_index(words, items[i])]);
    for (int j = 0; j < i; j++)
      if (strcmp(items[i], items[j]) == 0) {
        snprintf(detail, len, "; '%s' is given twice", items[i]);
        return 1;
      }
  }
  return 0;
}

static int store_variants(struct config *cfg, char items[][LIST_ITEM], int n, char *detail,
                          size_t len) {
  if (canonical_words(variant_names, items, n, detail, len)) return 1;
  memset(cfg->bench.variants, 0, sizeof cfg->bench.variants);
  for (int i = 0; i < n; i++) memcpy(cfg->bench.variants[i], items[i], strlen(items[i]));
  cfg->bench.variant_count = n;
  return 0;
}

static void format_variants(const struct config *cfg, char *out, size_t len) {
  size_t used = 0;
  out[0] = '\0';
  for (int i = 0; i < cfg->bench.variant_count && used < len; i++)
    used += (size_t)snprintf(out + used, len - used, "%s%s", i ? "," : "", cfg->bench.variants[i]);
}

static int store_kernels(struct config *cfg, char items[][LIST_ITEM], int n, char *detail,
                         size_t len) {
  if (canonical_words(kernel_names, items, n, detail, len)) return 1;
  char *out = cfg->attention.fmmformer_kernels;
  size_t size = sizeof cfg->attention.fmmformer_kernels, used = 0;
  memset(out, 0, size);
  for (int i = 0; i < n; i++)
    used += (size_t)snprintf(out + used, size - used, "%s%s", i ? "," : "", items[i]);
  return 0;
}

static void format_kernels(const struct config *cfg, char *out, size_t len) {
  snprintf(out, len, "%s", cfg->attention.fmmformer_kernels);
}

/* ---------------------------------------------------------------------------------------------
 * Parsing: a deck, overrides and resolved text all go through ini_parse_stream with our reader,
 * which counts lines (Debian builds inih without line numbers in the handler), checks section
 * names where they appear, and stops the parse at the first error. */

enum origin { FROM_DEFAULT, FROM_DECK, FROM_OVERRIDE };

struct key_state {
  char *text; /* the value as given (owned); NULL: the default */
  enum origin origin;
  int line;             /* FROM_DECK */
  const char *override; /* FROM_OVERRIDE: the --set item */
  long order;           /* when it was set: deck lines, then overrides in order */
};

struct parse_ctx {
  const char *where;    /* deck path or "<resolved deck>"; NULL for built-in defaults */
  const char *text;     /* what is being parsed */
  size_t pos;           /* next unread byte of text */
  int line;             /* lines handed to inih so far */
  const char *override; /* the --set item being parsed, or NULL for the deck */
  long order;
  struct key_state state[NKEYS];
  struct config scratch; /* single values are converted here to validate them as they come */
  bool failed;
  int fail_line; /* deck line of the error, to compare with inih's syntax errors */
  char msg[MSG_LEN];
};

__attribute__((format(printf, 3, 4))) static void fail(struct parse_ctx *c, const char *loc,
                                                       const char *fmt, ...) {
  if (c->failed) return; /* one message: the first */
  c->failed = true;
  c->fail_line = c->override ? 0 : c->line;
  int n = snprintf(c->msg, sizeof c->msg, "%s: ", loc);
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(c->msg + n, sizeof c->msg - (size_t)n, fmt, ap);
  va_end(ap);
}

/* Where the line being parsed comes from: "deck.in:12" or "--set train.lr=abc". */
static void here(const struct parse_ctx *c, char *out, size_t len) {
  if (c->override)
    snprintf(out, len, "--set %s", c->override);
  else
    snprintf(out, len, "%s:%d", c->where, c->line);
}

/* Where key k got its value; a default is located at the deck as a whole. */
static void key_where(const struct parse_ctx *c, int k, char *out, size_t len) {
  const struct key_state *s = &c->state[k];
  if (s->origin == FROM_DECK)
    snprintf(out, len, "%s:%d", c->where, s->line);
  else if (s->origin == FROM_OVERRIDE)
    snprintf(out, len, "--set %s", s->override);
  else
    snprintf(out, len, "%s", c->where ? c->where : "<defaults>");
}

/* Fails at the most recently set of the named keys ("model.dim model.heads"): the line a user most
 * likely just edited. Keys at their default give the deck as the location. */
__attribute__((format(printf, 3, 4))) static void fail_keys(struct parse_ctx *c, const char *names,
                                                            const char *fmt, ...) {
  if (c->failed) return;
  int best = -1;
  char copy[256];
  snprintf(copy, sizeof copy, "%s", names);
  for (char *save, *name = strtok_r(copy, " ", &save); name; name = strtok_r(NULL, " ", &save)) {
    int k = key_find_qualified(name);
    if (k >= 0 && (best < 0 || c->state[k].order > c->state[best].order)) best = k;
  }
  char loc[CONFIG_STR + 64], text[MSG_LEN];
  if (best >= 0)
    key_where(c, best, loc, sizeof loc);
  else
    snprintf(loc, sizeof loc, "%s", c->where ? c->where : "<defaults>");
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(text, sizeof text, fmt, ap);
  va_end(ap);
  fail(c, loc, "%s", text);
}

/* "did you mean 'lr'?" (or 'model.dim' for a key of another section, always qualified for --set),
 * else the valid keys of the section. section < 0: the name came without a section. */
static void suggest_key(int section, const char *name, bool qualify, char *out, size_t len) {
  int best = -1, best_d = INT_MAX;
  for (int k = 0; k < NKEYS; k++) {
    char qualified[128], aliases[256];
    snprintf(qualified, sizeof qualified, "%s.%s", keys[k].section, keys[k].name);
    int d = edit_distance(name, keys[k].name);
    int dq = edit_distance(name, qualified);
    if (dq < d) d = dq;
    const char *dot = strchr(keys[k].name, '.'); /* "m" for "fma.m" */
    if (dot && edit_distance(name, dot + 1) < d) d = edit_distance(name, dot + 1);
    snprintf(aliases, sizeof aliases, "%s", keys[k].aliases);
    for (char *save, *a = strtok_r(aliases, " ", &save); a; a = strtok_r(NULL, " ", &save))
      if (edit_distance(name, a) < d) d = edit_distance(name, a);
    bool same = section >= 0 && strcmp(keys[k].section, section_names[section]) == 0;
    bool best_same =
        best >= 0 && section >= 0 && strcmp(keys[best].section, section_names[section]) == 0;
    if (d < best_d || (d == best_d && same && !best_same)) best = k, best_d = d;
  }
  if (best >= 0 && is_close(name, best_d)) {
    bool same = section >= 0 && strcmp(keys[best].section, section_names[section]) == 0;
    if (same && !qualify)
      snprintf(out, len, "did you mean '%s'?", keys[best].name);
    else
      snprintf(out, len, "did you mean '%s.%s'?", keys[best].section, keys[best].name);
    return;
  }
  if (section < 0) {
    snprintf(out, len, "see fmattn --print-defaults for every key");
    return;
  }
  size_t used = (size_t)snprintf(out, len, "valid keys in [%s]: ", section_names[section]);
  bool first = true;
  for (int k = 0; k < NKEYS && used < len; k++) {
    if (strcmp(keys[k].section, section_names[section]) != 0) continue;
    used += (size_t)snprintf(out + used, len - used, "%s%s", first ? "" : ", ", keys[k].name);
    first = false;
  }
}

static void check_section(struct parse_ctx *c, const char *line) {
  const char *close = strchr(line, ']');
  if (!close) return; /* inih reports it as a syntax error */
  char name[256];
  snprintf(name, sizeof name, "%.*s", (int)(close - line - 1), line + 1);
  char *section = trim(name);
  int best = -1, best_d = INT_MAX;
  for (int i = 0; section_names[i]; i++) {
    if (strcmp(section, section_names[i]) == 0) return;
    int d = edit_distance(section, section_names[i]);
    if (d < best_d) best = i, best_d = d;
  }
  char loc[CONFIG_STR + 64];
  here(c, loc, sizeof loc);
  if (is_close(section, best_d)) {
    fail(c, loc, "unknown section [%s]; did you mean [%s]?", section, section_names[best]);
  } else {
    char valid[256];
    join_words(section_names, valid, sizeof valid);
    fail(c, loc, "unknown section [%s]; valid sections: %s", section, valid);
  }
}

/* An fgets-like reader over c->text, called once per line. */
static char *deck_reader(char *str, int num, void *stream) {
  struct parse_ctx *c = stream;
  if (c->failed || !c->text[c->pos]) return NULL; /* NULL ends the parse */
  const char *start = c->text + c->pos;
  const char *newline = strchr(start, '\n');
  size_t n = newline ? (size_t)(newline - start) : strlen(start);
  c->pos += n + (newline ? 1 : 0);
  c->line++;
  if (c->line == 1 && n >= 3 && memcmp(start, "\xEF\xBB\xBF", 3) == 0) start += 3, n -= 3;
  /* Indented lines are ordinary lines here: to inih they would continue the previous value. */
  while (n > 0 && isspace((unsigned char)*start)) start++, n--;
  bool comment = n > 0 && (*start == ';' || *start == '#');
  if (comment && n + 2 > (size_t)num) n = (size_t)num - 2; /* a comment may be cut, not a value */
  if (n + 2 > (size_t)num) {
    char loc[CONFIG_STR + 64];
    here(c, loc, sizeof loc);
    fail(c, loc, "line is longer than %d characters", num - 3);
    return NULL;
  }
  memcpy(str, start, n);
  str[n] = '\n';
  str[n + 1] = '\0';
  /* inih strips inline ';' comments after a space; do the same for '#', the other comment mark. */
  if (!comment)
    for (char *p = str + 1; *p; p++)
      if (*p == '#' && isspace((unsigned char)p[-1])) {
        p[0] = '\n';
        p[1] = '\0';
        break;
      }
  if (str[0] == '[') check_section(c, str);
  return c->failed ? NULL : str;
}

static int deck_handler(void *user, const char *section_in, const char *name, const char *value) {
  struct parse_ctx *c = user;
  if (c->failed) return 1;
  char loc[CONFIG_STR + 64], section_buf[256];
  here(c, loc, sizeof loc);
  snprintf(section_buf, sizeof section_buf, "%s", section_in);
  char *section = trim(section_buf);
  if (!*name) {
    fail(c, loc, "syntax error (expected 'key = value' or '[section]')");
    return 1;
  }
  if (!*section) {
    char hint[1024];
    suggest_key(-1, name, true, hint, sizeof hint);
    fail(c, loc, "key '%s' comes before any [section]; %s", name, hint);
    return 1;
  }
  int k = key_find(section, name);
  if (k < 0) {
    char hint[1024];
    suggest_key(name_index(section_names, section), name, c->override != NULL, hint, sizeof hint);
    fail(c, loc, "unknown key '%s' in [%s]; %s", name, section, hint);
    return 1;
  }
  struct key_state *s = &c->state[k];
  if (!c->override && s->origin == FROM_DECK) {
    fail(c, loc, "%s.%s given twice (first at line %d)", section, name, s->line);
    return 1;
  }
  char msg[MSG_LEN];
  if (key_convert(&keys[k], value, &c->scratch, msg, sizeof msg) != CONVERT_OK) {
    fail(c, loc, "%s", msg);
    return 1;
  }
  free(s->text);
  s->text = xstrdup(value);
  s->origin = c->override ? FROM_OVERRIDE : FROM_DECK;
  s->line = c->line;
  s->override = c->override;
  s->order = c->override ? c->order : c->line;
  return 1;
}

static void parse_text(struct parse_ctx *c, const char *text) {
  c->text = text;
  c->pos = 0;
  c->line = 0;
  int saved = 0;
  bool adjustable = &ini_max_line != NULL;
  if (adjustable) saved = ini_max_line, ini_max_line = LINE_MAX_BYTES;
  int rc = ini_parse_stream(deck_reader, c, deck_handler, c);
  if (adjustable) ini_max_line = saved;
  if (rc > 0 && (!c->failed || (!c->override && rc < c->fail_line))) {
    /* inih goes on after a bad line; its first one may come before our error. */
    c->failed = false;
    c->line = rc;
    char loc[CONFIG_STR + 64];
    here(c, loc, sizeof loc);
    fail(c, loc, "syntax error (expected 'key = value' or '[section]')");
  } else if (rc < 0 && !c->failed) {
    fail(c, c->where ? c->where : "<defaults>", "out of memory while parsing");
  }
}

/* "section.key=value", as text "[section]\nkey = value\n" through the same parser. */
static void apply_override(struct parse_ctx *c, const char *item, long order) {
  if (!item) item = "";
  c->override = item;
  c->order = order;
  char loc[CONFIG_STR + 64];
  here(c, loc, sizeof loc);
  const char *eq = strchr(item, '=');
  size_t lhs_len = eq ? (size_t)(eq - item) : strlen(item);
  char lhs_buf[256];
  snprintf(lhs_buf, sizeof lhs_buf, "%.*s", (int)(lhs_len < 255 ? lhs_len : 255), item);
  char *lhs = trim(lhs_buf);
  bool plain = *lhs != '\0';
  for (const char *p = lhs; *p; p++)
    if (!isalnum((unsigned char)*p) && !strchr("._-", *p)) plain = false;
  char *dot = strchr(lhs, '.');
  if (!eq || !plain || !dot) {
    char hint[1024] = "";
    if (plain && !dot) {
      suggest_key(-1, lhs, true, hint + 2, sizeof hint - 2);
      memcpy(hint, "; ", 2);
    }
    fail(c, loc, "expected section.key=value (e.g. --set train.lr=1e-3)%s", hint);
    return;
  }
  /* In a deck these would end the value; refusing them here keeps the resolved deck (which
   * holds the value) reading back the same on every rank. */
  if (strchr(eq + 1, '\n')) {
    fail(c, loc, "a value cannot hold a line break");
    return;
  }
  for (const char *p = eq + 1; *p; p++)
    if ((*p == ';' || *p == '#') && (p == eq + 1 || isspace((unsigned char)p[-1]))) {
      fail(c, loc, "a value cannot hold '%c' after a space (in a deck it starts a comment)", *p);
      return;
    }
  *dot = '\0';
  struct text_buf text = {0};
  buf_printf(&text, "[%s]\n%s = %s\n", lhs, dot + 1, eq + 1);
  parse_text(c, text.s);
  free(text.s);
  c->override = NULL;
}

/* run.name when the deck does not give one: the deck's file name without its extension, made
 * safe for a directory name. */
static void deck_stem(const char *deck_path, char *out, size_t len) {
  out[0] = '\0';
  if (deck_path) {
    const char *base = strrchr(deck_path, '/');
    base = base ? base + 1 : deck_path;
    const char *ext = strrchr(base, '.');
    size_t n = ext && ext > base ? (size_t)(ext - base) : strlen(base);
    if (n >= len) n = len - 1;
    for (size_t i = 0; i < n; i++)
      out[i] = isalnum((unsigned char)base[i]) || strchr("._-", base[i]) ? base[i] : '_';
    out[n] = '\0';
  }
  if (!out[0] || strcmp(out, ".") == 0 || strcmp(out, "..") == 0) snprintf(out, len, "fmattn");
}

/* ---------------------------------------------------------------------------------------------
 * Rules across keys, and the data file. */

static bool is_fma(const char *variant) {
  return strcmp(variant, "fma") == 0 || strcmp(variant, "fma_linear") == 0;
}

/* fma needs n = m·2^k with k >= 1 (SPEC §6.4). */
static bool fma_fits(long n, int m) {
  if (n % m) return false;
  long ratio = n / m;
  return ratio >= 2 && (ratio & (ratio - 1)) == 0;
}

static void check_rules(struct parse_ctx *c, const struct config *cfg) {
  const struct config_model *mo = &cfg->model;
  const struct config_attention *at = &cfg->attention;
  if (mo->dim % mo->heads)
    fail_keys(c, "model.dim model.heads", "model.dim = %d is not divisible by model.heads = %d",
              mo->dim, mo->heads);
  else if (mo->position == POSITION_ROPE && (mo->dim / mo->heads) % 2)
    fail_keys(c, "model.position model.dim model.heads",
              "model.position = rope needs an even head size, but model.dim / model.heads = "
              "%d / %d = %d",
              mo->dim, mo->heads, mo->dim / mo->heads);
  if (cfg->train.min_lr > cfg->train.lr) {
    char min_lr[32], lr[32];
    format_double(cfg->train.min_lr, min_lr, sizeof min_lr);
    format_double(cfg->train.lr, lr, sizeof lr);
    fail_keys(c, "train.min_lr train.lr", "train.min_lr = %s is larger than train.lr = %s", min_lr,
              lr);
  }
  if (at->fma_m % at->fma_p)
    fail_keys(c, "attention.fma.p attention.fma.m",
              "attention.fma.p = %d does not divide attention.fma.m = %d", at->fma_p, at->fma_m);
  if (is_fma(at->variant) && !fma_fits(mo->context, at->fma_m))
    fail_keys(c, "attention.variant model.context attention.fma.m",
              "attention.variant = %s needs model.context / attention.fma.m to be a power of two "
              ">= 2, but model.context = %d and attention.fma.m = %d",
              at->variant, mo->context, at->fma_m);
  if (cfg->run.mode == MODE_BENCH)
    for (int v = 0; v < cfg->bench.variant_count; v++) {
      if (!is_fma(cfg->bench.variants[v])) continue;
      for (int i = 0; i < cfg->bench.n_count; i++)
        if (!fma_fits(cfg->bench.n_list[i], at->fma_m))
          fail_keys(c, "bench.n_list bench.variants attention.fma.m",
                    "bench.variants has %s, which needs every n of bench.n_list to be "
                    "attention.fma.m = %d times a power of two >= 2, but n = %ld is not",
                    cfg->bench.variants[v], at->fma_m, cfg->bench.n_list[i]);
    }
  if (at->heads_mode == HEADS_FISH && at->fish_global_heads >= mo->heads)
    fail_keys(c, "attention.fish.global_heads model.heads attention.heads_mode",
              "attention.fish.global_heads = %d must be fewer than model.heads = %d",
              at->fish_global_heads, mo->heads);
  if (strcmp(at->variant, "nystrom") == 0) {
    if (mo->objective == OBJECTIVE_CLM)
      fail_keys(c, "attention.variant model.objective",
                "attention.variant = nystrom is bidirectional only (segment means mix future "
                "tokens); use model.objective = mlm");
    else if (mo->context % at->nystrom_landmarks)
      fail_keys(c, "attention.nystrom.landmarks model.context",
                "attention.nystrom.landmarks = %d does not divide model.context = %d (landmarks "
                "are means of equal segments)",
                at->nystrom_landmarks, mo->context);
  }
  if ((cfg->run.mode == MODE_GENERATE || cfg->run.mode == MODE_EVAL) && !cfg->output.restart[0])
    fail_keys(c, "run.mode output.restart",
              "run.mode = %s needs output.restart (a checkpoint path, or latest)",
              config_mode_name(cfg->run.mode));
  /* A copy sample is the symbols, a separator and the symbols again, within context+1 tokens. */
  if (cfg->data.source == SOURCE_COPY && 2L * cfg->data.copy_len + 1 > (long)mo->context + 1)
    fail_keys(c, "data.copy_len model.context",
              "data.copy_len = %d does not fit model.context = %d: a copy sample needs "
              "2*copy_len+1 = %ld of the context+1 tokens",
              cfg->data.copy_len, mo->context, 2L * cfg->data.copy_len + 1);
}

static const char *const fetch_hint = "run scripts/get_kjv.sh (KJV) or scripts/get_enwik8.sh";

static void check_data_file(struct parse_ctx *c, const struct config *cfg) {
  if (cfg->data.source != SOURCE_FILE || c->failed) return;
  const char *path = cfg->data.path;
  if (!path[0]) {
    fail_keys(c, "data.path data.source",
              "data.path is empty, but data.source = file needs a byte file; %s, or set "
              "data.source = copy or majority",
              fetch_hint);
    return;
  }
  FILE *f = fopen(path, "rb");
  if (!f) {
    fail_keys(c, "data.path", "data.path = '%s': cannot open (%s); %s", path, strerror(errno),
              fetch_hint);
    return;
  }
  struct stat st;
  int rc = fstat(fileno(f), &st);
  fclose(f);
  if (rc != 0 || !S_ISREG(st.st_mode)) {
    fail_keys(c, "data.path", "data.path = '%s' is not a regular file; %s", path, fetch_hint);
    return;
  }
  long long size = (long long)st.st_size, part[3];
  char split[128];
  format_split(cfg, split, sizeof split);
  if (cfg->data.split_is_bytes) {
    double need = cfg->data.split[0] + cfg->data.split[1] + cfg->data.split[2];
    if (need > (double)size) {
      fail_keys(c, "data.split", "data.split = %s needs %.0f bytes, but data.path '%s' has %lld",
                split, need, path, size);
      return;
    }
    for (int i = 0; i < 3; i++) part[i] = (long long)cfg->data.split[i];
  } else {
    /* Rounded down: the smallest size any reading of the fractions can give. */
    for (int i = 0; i < 3; i++) part[i] = (long long)floor(cfg->data.split[i] * (double)size);
  }
  static const char *const part_names[] = {"train", "valid", "test"};
  for (int i = 0; i < 3; i++)
    if (part[i] < (long long)cfg->model.context + 1) {
      fail_keys(c, "data.path",
                "data.path '%s' has %lld bytes; split %s gives %s %lld bytes, fewer than "
                "model.context+1 = %d",
                path, size, split, part_names[i], part[i], cfg->model.context + 1);
      return;
    }
}

/* ---------------------------------------------------------------------------------------------
 * Loading. */

/* A comment line; control characters become '?' so that a strange deck path cannot start a
 * line of its own in the resolved deck. */
static void buf_comment(struct text_buf *b, const char *prefix, const char *text) {
  buf_printf(b, "; %s", prefix);
  for (const char *p = text; *p; p++) buf_printf(b, "%c", iscntrl((unsigned char)*p) ? '?' : *p);
  buf_printf(b, "\n");
}

static char *resolved_text(const struct config *cfg, const char *deck_path,
                           const struct config_overrides *ov) {
  struct text_buf b = {0};
  buf_comment(&b, "fmattn resolved deck from ", deck_path ? deck_path : "the built-in defaults");
  for (int i = 0; ov && i < ov->count; i++) buf_comment(&b, "--set ", ov->items[i]);
  const char *section = "";
  for (int k = 0; k < NKEYS; k++) {
    if (strcmp(keys[k].section, section) != 0) {
      section = keys[k].section;
      buf_printf(&b, "%s[%s]\n", k ? "\n" : "", section);
    }
    char value[CONFIG_LIST_MAX * LIST_ITEM + CONFIG_STR];
    key_format(&keys[k], cfg, value, sizeof value);
    buf_printf(&b, "%s = %s\n", keys[k].name, value);
  }
  return b.s;
}

static void write_error(char *err, size_t err_len, const char *msg) {
  if (err && err_len) snprintf(err, err_len, "%s", msg);
}

/* The common path of config_load and config_from_text. where: the location name of text;
 * from_resolved: text is a resolved deck, kept as it is, and the data file is not checked again. */
static int load(struct config *cfg, const char *text, const char *where, const char *deck_path,
                const struct config_overrides *ov, bool from_resolved, char *err, size_t err_len) {
  memset(cfg, 0, sizeof *cfg);
  struct parse_ctx *c = xcalloc(1, sizeof *c);
  c->where = where;
  if (text) parse_text(c, text);
  for (int i = 0; ov && i < ov->count && !c->failed; i++)
    apply_override(c, ov->items[i], 1000000000L + i);

  /* Every key from its final text, in table order; values given were checked as they came. */
  char stem[CONFIG_STR];
  deck_stem(deck_path, stem, sizeof stem);
  for (int k = 0; k < NKEYS && !c->failed; k++) {
    const char *value = c->state[k].text ? c->state[k].text : keys[k].def;
    if (keys[k].flags & NAME_CHARS && !value[0]) value = stem;
    char msg[MSG_LEN], loc[CONFIG_STR + 64];
    if (key_convert(&keys[k], value, cfg, msg, sizeof msg) != CONVERT_OK) {
      key_where(c, k, loc, sizeof loc);
      fail(c, loc, "%s", msg);
    }
  }
  if (!c->failed) check_rules(c, cfg);
  if (!from_resolved) check_data_file(c, cfg);

  int status = c->failed;
  if (status) {
    write_error(err, err_len, c->msg);
  } else {
    cfg->resolved = from_resolved ? xstrdup(text) : resolved_text(cfg, deck_path, ov);
    if (deck_path) snprintf(cfg->deck_path, sizeof cfg->deck_path, "%s", deck_path);
  }
  for (int k = 0; k < NKEYS; k++) free(c->state[k].text);
  free(c);
  return status;
}

int config_load(struct config *cfg, const char *deck_path, const struct config_overrides *ov,
                char *err, size_t err_len) {
  memset(cfg, 0, sizeof *cfg);
  if (ov && (ov->count < 0 || ov->count > (int)(sizeof ov->items / sizeof ov->items[0]))) {
    write_error(err, err_len, "too many --set overrides");
    return 1;
  }
  if (!deck_path) return load(cfg, NULL, NULL, NULL, ov, false, err, err_len);

  char msg[MSG_LEN];
  if (strlen(deck_path) >= sizeof cfg->deck_path) {
    snprintf(msg, sizeof msg, "deck path '%.64s...' is longer than %zu characters", deck_path,
             sizeof cfg->deck_path - 1);
    write_error(err, err_len, msg);
    return 1;
  }
  /* Decks are small; read it whole, refusing what is clearly not a deck. */
  enum { DECK_MAX = 1 << 20 };
  FILE *f = fopen(deck_path, "rb");
  if (!f) {
    snprintf(msg, sizeof msg, "cannot read deck '%s': %s", deck_path, strerror(errno));
    write_error(err, err_len, msg);
    return 1;
  }
  char *text = xmalloc(DECK_MAX + 1);
  size_t n = fread(text, 1, DECK_MAX + 1, f);
  int read_errno = ferror(f) ? errno : 0;
  fclose(f);
  const char *why = NULL;
  if (read_errno)
    why = strerror(read_errno);
  else if (n > DECK_MAX)
    why = "it is larger than 1 MiB (is it really a deck?)";
  else if (memchr(text, '\0', n))
    why = "it holds NUL bytes (is it really a deck?)";
  if (why) {
    snprintf(msg, sizeof msg, "cannot read deck '%s': %s", deck_path, why);
    write_error(err, err_len, msg);
    free(text);
    return 1;
  }
  text[n] = '\0';
  int status = load(cfg, text, deck_path, deck_path, ov, false, err, err_len);
  free(text);
  return status;
}

int config_from_text(struct config *cfg, const char *text, char *err, size_t err_len) {
  /* The data file was checked where the text was made (rank 0, or the run that wrote the
   * checkpoint); this rank may not even see that file system path the same way. */
  return load(cfg, text, "<resolved deck>", NULL, NULL, true, err, err_len);
}

void config_load_collective(struct config *cfg, const char *deck_path,
                            const struct config_overrides *ov) {
  int rank = 0;
  MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &rank));
  char err[MSG_LEN] = "";
  int status = 0;
  memset(cfg, 0, sizeof *cfg);
  if (rank == 0) status = config_load(cfg, deck_path, ov, err, sizeof err);
  MPI_CHECK(MPI_Bcast(&status, 1, MPI_INT, 0, MPI_COMM_WORLD));
  if (status) {
    MPI_CHECK(MPI_Bcast(err, (int)sizeof err, MPI_CHAR, 0, MPI_COMM_WORLD));
    config_free(cfg);
    error_collective(err);
  }
  long long len = rank == 0 ? (long long)strlen(cfg->resolved) + 1 : 0;
  MPI_CHECK(MPI_Bcast(&len, 1, MPI_LONG_LONG, 0, MPI_COMM_WORLD));
  char *text = rank == 0 ? cfg->resolved : xmalloc((size_t)len);
  MPI_CHECK(MPI_Bcast(text, (int)len, MPI_CHAR, 0, MPI_COMM_WORLD));
  if (rank != 0) {
    /* Rank 0 validated this very text: failing here is a bug, not a user error. */
    if (config_from_text(cfg, text, err, sizeof err) != 0)
      error("the resolved deck from rank 0 does not parse here: %s", err);
    free(text);
    if (deck_path) snprintf(cfg->deck_path, sizeof cfg->deck_path, "%s", deck_path);
  }
}

int config_check_layout(const struct config *cfg, int world_size, char *err, size_t err_len) {
  char msg[MSG_LEN];
  int s = cfg->parallel.seq_ranks;
  if (world_size < 1 || world_size % s) {
    snprintf(msg, sizeof msg, "parallel.seq_ranks = %d does not divide the %d MPI ranks", s,
             world_size);
  } else if (cfg->train.batch % (world_size / s)) {
    snprintf(msg, sizeof msg,
             "train.batch = %d is not divisible by the %d data-parallel replicas (world %d / "
             "seq_ranks %d)",
             cfg->train.batch, world_size / s, world_size, s);
  } else if (cfg->model.context % s) {
    snprintf(msg, sizeof msg, "model.context = %d is not divisible by parallel.seq_ranks = %d",
             cfg->model.context, s);
  } else {
    return 0;
  }
  write_error(err, err_len, msg);
  return 1;
}

void config_print_defaults(FILE *out) {
  fprintf(out,
          "; fmattn input deck with every key at its default (fmattn --print-defaults).\n"
          "; [section] starts a section; key = value sets a key; ';' or '#' starts a comment\n"
          "; (after a space when it follows a value). Any key can also be set on the command\n"
          "; line: fmattn DECK.in --set section.key=value\n");
  const char *section = "";
  for (int k = 0; k < NKEYS; k++) {
    if (strcmp(keys[k].section, section) != 0) {
      section = keys[k].section;
      fprintf(out, "\n[%s]\n", section);
    }
    char expected[600];
    expected_text(&keys[k], expected, sizeof expected);
    fprintf(out, "; %s\n;   %s\n%s =%s%s\n", keys[k].help, expected, keys[k].name,
            keys[k].def[0] ? " " : "", keys[k].def);
  }
}

void config_free(struct config *cfg) {
  free(cfg->resolved);
  cfg->resolved = NULL;
}

const char *config_mode_name(enum run_mode m) {
  return (unsigned)m < sizeof mode_names / sizeof mode_names[0] - 1 ? mode_names[m] : "?";
}

const char *config_position_name(enum position_kind p) {
  return (unsigned)p < sizeof position_names / sizeof position_names[0] - 1 ? position_names[p]
                                                                            : "?";
}

const char *config_downsample_name(enum fma_downsample d) {
  return (unsigned)d < sizeof downsample_names / sizeof downsample_names[0] - 1
             ? downsample_names[d]
             : "?";
}

int config_vocab(const struct config *cfg) {
  return cfg->model.objective == OBJECTIVE_MLM ? 257 : 256;
}
