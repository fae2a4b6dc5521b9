/* The input deck (SPEC §3): parsing with libinih, --set overrides, cross-key rules, loading, and
 * writing the resolved deck and --print-defaults, all from the one key table in config_keys.c so
 * they cannot disagree. Reports the first error with file:line, key, what was expected and the
 * nearest valid name. Must not print errors or call MPI (only config_load_collective does), read a
 * data file beyond checking it is there and long enough, or judge if a variant is implemented. */
#define _POSIX_C_SOURCE 200809L

#include "deck/config.h"

#include <ctype.h>
#include <errno.h>
#include <ini.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "core/error.h"
#include "deck/config_keys.h"

/* Debian's libinih exposes its line limit as a variable; upstream fixes it at build time (200
 * bytes). A weak reference links against either: with the variable we raise the limit while we
 * parse (a prompt or a path may be long), without it the reader refuses longer lines clearly. */
extern int ini_max_line;
#pragma weak ini_max_line

#define LINE_MAX_BYTES 4096 /* the longest deck line we accept, when inih lets us choose */
#define MSG_LEN        CONFIG_ERR_LEN /* one error message */

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
  struct key_state state[CONFIG_NKEYS];
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
    int k = config_key_find_qualified(name);
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

static void check_section(struct parse_ctx *c, const char *line) {
  const char *close = strchr(line, ']');
  if (!close) return; /* inih reports it as a syntax error */
  char name[256];
  snprintf(name, sizeof name, "%.*s", (int)(close - line - 1), line + 1);
  char *section = config_trim(name);
  int best = -1, best_d = INT_MAX;
  for (int i = 0; config_section_names[i]; i++) {
    if (strcmp(section, config_section_names[i]) == 0) return;
    int d = config_edit_distance(section, config_section_names[i]);
    if (d < best_d) best = i, best_d = d;
  }
  char loc[CONFIG_STR + 64];
  here(c, loc, sizeof loc);
  if (config_is_close(section, best_d)) {
    fail(c, loc, "unknown section [%s]; did you mean [%s]?", section, config_section_names[best]);
  } else {
    char valid[256];
    config_join_words(config_section_names, valid, sizeof valid);
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
  char *section = config_trim(section_buf);
  if (!*name) {
    fail(c, loc, "syntax error (expected 'key = value' or '[section]')");
    return 1;
  }
  if (!*section) {
    char hint[1024];
    config_suggest_key(-1, name, true, hint, sizeof hint);
    fail(c, loc, "key '%s' comes before any [section]; %s", name, hint);
    return 1;
  }
  int k = config_key_find(section, name);
  if (k < 0) {
    char hint[1024];
    config_suggest_key(config_name_index(config_section_names, section), name, c->override != NULL,
                       hint, sizeof hint);
    fail(c, loc, "unknown key '%s' in [%s]; %s", name, section, hint);
    return 1;
  }
  struct key_state *s = &c->state[k];
  if (!c->override && s->origin == FROM_DECK) {
    fail(c, loc, "%s.%s given twice (first at line %d)", section, name, s->line);
    return 1;
  }
  char msg[MSG_LEN];
  if (config_key_convert(&config_keys[k], value, &c->scratch, msg, sizeof msg) != CONVERT_OK) {
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
  char *lhs = config_trim(lhs_buf);
  bool plain = *lhs != '\0';
  for (const char *p = lhs; *p; p++)
    if (!isalnum((unsigned char)*p) && !strchr("._-", *p)) plain = false;
  char *dot = strchr(lhs, '.');
  if (!eq || !plain || !dot) {
    char hint[1024] = "";
    if (plain && !dot) {
      config_suggest_key(-1, lhs, true, hint + 2, sizeof hint - 2);
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

/* Rules owned by other modules (the tasks', the attention variants'), added by config_add_rule. */
#define MAX_MODULE_RULES 8
static config_rule_fn module_rule[MAX_MODULE_RULES];
static int module_rules = 0;

void config_add_rule(config_rule_fn rule) {
  for (int i = 0; i < module_rules; i++)
    if (module_rule[i] == rule) return;
  if (module_rules == MAX_MODULE_RULES)
    error("config_add_rule: more than %d rules", MAX_MODULE_RULES);
  module_rule[module_rules++] = rule;
}

bool config_key_exists(const char *qualified) { return config_key_find_qualified(qualified) >= 0; }

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
    config_format_double(cfg->train.min_lr, min_lr, sizeof min_lr);
    config_format_double(cfg->train.lr, lr, sizeof lr);
    fail_keys(c, "train.min_lr train.lr", "train.min_lr = %s is larger than train.lr = %s", min_lr,
              lr);
  }
  /* every variant's attention diagnostics band by the tree of fma.m and fma.p, so this pair must
   * agree whatever the variant; the rules of a variant itself are its own (config_add_rule) */
  if (at->fma_m % at->fma_p)
    fail_keys(c, "attention.fma.p attention.fma.m",
              "attention.fma.p = %d does not divide attention.fma.m = %d", at->fma_p, at->fma_m);
  if (cfg->run.mode == MODE_GENERATE && cfg->generate.prompt_file[0]) {
    FILE *pf = fopen(cfg->generate.prompt_file, "rb");
    if (!pf)
      fail_keys(c, "generate.prompt_file", "generate.prompt_file = '%s': cannot open (%s)",
                cfg->generate.prompt_file, strerror(errno));
    else
      fclose(pf);
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
  const struct config_data *d = &cfg->data;
  if (d->export_path[0] && d->source == SOURCE_TASK && strcmp(d->export_path, d->path) == 0)
    fail_keys(c, "data.export data.path",
              "data.export = '%s' is the task file being read (data.path): choose another path",
              d->export_path);
  char keys[256], msg[MSG_LEN - 600];
  for (int i = 0; i < module_rules && !c->failed; i++)
    if (module_rule[i](cfg, keys, sizeof keys, msg, sizeof msg)) fail_keys(c, keys, "%s", msg);
}

static const char *const fetch_hint = "run scripts/get_kjv.sh (KJV) or scripts/get_enwik8.sh";

/* Whether f starts with the HDF5 signature, at 0 or at a user-block offset (512, 1024, ...): a
 * task file is read with the HDF5 library when the data is opened; this only catches a file that
 * is plainly not one, while nothing has been written. */
static bool hdf5_signature(FILE *f, long long size) {
  static const unsigned char sig[8] = {0x89, 'H', 'D', 'F', '\r', '\n', 0x1a, '\n'};
  for (long long at = 0; at + 8 <= size; at = at ? 2 * at : 512) {
    unsigned char buf[8];
    if (fseek(f, (long)at, SEEK_SET) != 0 || fread(buf, 1, 8, f) != 8) return false;
    if (memcmp(buf, sig, 8) == 0) return true;
  }
  return false;
}

/* data.source = task: data.path names a readable HDF5 file (its datasets are checked when the
 * data is opened: src/tasks/file.c). */
static void check_task_file(struct parse_ctx *c, const struct config *cfg) {
  const char *path = cfg->data.path;
  if (!path[0]) {
    fail_keys(c, "data.path data.source",
              "data.path is empty, but data.source = task needs a task file (HDF5: tokens, scored; "
              "docs/tasks.md)");
    return;
  }
  FILE *f = fopen(path, "rb");
  if (!f) {
    fail_keys(c, "data.path", "data.path = '%s': cannot open (%s)", path, strerror(errno));
    return;
  }
  struct stat st;
  const bool regular = fstat(fileno(f), &st) == 0 && S_ISREG(st.st_mode);
  const bool hdf5 = regular && hdf5_signature(f, (long long)st.st_size);
  fclose(f);
  if (!hdf5)
    fail_keys(c, "data.path",
              "data.path = '%s' is not an HDF5 file, but data.source = task needs a task file "
              "(docs/tasks.md)",
              path);
}

static void check_data_file(struct parse_ctx *c, const struct config *cfg) {
  if (c->failed) return;
  if (cfg->data.source == SOURCE_TASK) {
    check_task_file(c, cfg);
    return;
  }
  /* passkey's filler text is optional (random bytes without it); when given, it is split and
   * must hold a context in every split, as a corpus does */
  const bool passkey_text = cfg->data.source == SOURCE_PASSKEY && cfg->data.path[0];
  if (cfg->data.source != SOURCE_FILE && !passkey_text) return;
  const char *path = cfg->data.path;
  if (!path[0]) {
    fail_keys(c, "data.path data.source",
              "data.path is empty, but data.source = file needs a byte file; %s, or set "
              "data.source = copy or majority (or another task: docs/tasks.md)",
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
  config_format_split(cfg, split, sizeof split);
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
  for (int k = 0; k < CONFIG_NKEYS; k++) {
    if (strcmp(config_keys[k].section, section) != 0) {
      section = config_keys[k].section;
      buf_printf(&b, "%s[%s]\n", k ? "\n" : "", section);
    }
    char value[CONFIG_LIST_MAX * LIST_ITEM + CONFIG_STR];
    config_key_format(&config_keys[k], cfg, value, sizeof value);
    buf_printf(&b, "%s = %s\n", config_keys[k].name, value);
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
  for (int k = 0; k < CONFIG_NKEYS && !c->failed; k++) {
    const char *value = c->state[k].text ? c->state[k].text : config_keys[k].def;
    if (config_keys[k].flags & NAME_CHARS && !value[0]) value = stem;
    char msg[MSG_LEN], loc[CONFIG_STR + 64];
    if (config_key_convert(&config_keys[k], value, cfg, msg, sizeof msg) != CONVERT_OK) {
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
  for (int k = 0; k < CONFIG_NKEYS; k++) free(c->state[k].text);
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
  for (int k = 0; k < CONFIG_NKEYS; k++) {
    if (strcmp(config_keys[k].section, section) != 0) {
      section = config_keys[k].section;
      fprintf(out, "\n[%s]\n", section);
    }
    char expected[600];
    config_expected_text(&config_keys[k], expected, sizeof expected);
    fprintf(out, "; %s\n;   %s\n%s =%s%s\n", config_keys[k].help, expected, config_keys[k].name,
            config_keys[k].def[0] ? " " : "", config_keys[k].def);
  }
}

void config_free(struct config *cfg) {
  free(cfg->resolved);
  cfg->resolved = NULL;
}
int config_vocab(const struct config *cfg) {
  return cfg->model.objective == OBJECTIVE_MLM ? 257 : 256;
}
