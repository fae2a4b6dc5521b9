/* The key table's header, shared by the deck module's files: src/deck/config.c (parsing, rules,
 * loading), src/deck/config_keys.c (the key table and what is done with one value) and
 * src/deck/config_text.c (the text of values). Private to the deck module: not installed, and no
 * other module or test includes it; everyone else sees config.h only. */
#ifndef FMATTN_CONFIG_KEYS_H
#define FMATTN_CONFIG_KEYS_H

#include <stdbool.h>
#include <stddef.h>

#include "deck/config.h"

#define LIST_ITEM 64 /* one item of a comma list (bench.variants stores char[64]) */

/* Entries of config_keys. A constant, not a sizeof, because src/deck/config.c sizes its per-key
 * parse state with it; config_keys.c asserts that it counts the table. */
#define CONFIG_NKEYS 99

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

/* The key table, grouped by section in config_section_names order (the resolved deck and
 * --print-defaults follow it), and the section names (NULL-ended). */
extern const struct key_def config_keys[];
extern const char *const config_section_names[];

/* Index of word in a NULL-ended list, ignoring case; -1 when it is not there. */
int config_name_index(const char *const *names, const char *word);

/* Index of a key in config_keys, or -1: by section and name, or by "section.key". */
int config_key_find(const char *section, const char *name);
int config_key_find_qualified(const char *qualified);

/* What config_key_convert returns. */
enum { CONVERT_OK, CONVERT_BAD, CONVERT_RANGE };

/* Deck text into k's field of cfg; on failure the message, less its location, goes to msg. */
int config_key_convert(const struct key_def *k, const char *text, struct config *cfg, char *msg,
                       size_t len);

/* What k accepts, for messages and --print-defaults ("an integer in [1, 65536]"). */
void config_expected_text(const struct key_def *k, char *out, size_t len);

/* k's field of cfg as deck text, as the resolved deck holds it. */
void config_key_format(const struct key_def *k, const struct config *cfg, char *out, size_t len);

/* The shortest text that reads back as v; data.split as deck text. */
void config_format_double(double v, char *out, size_t len);
void config_format_split(const struct config *cfg, char *out, size_t len);

/* Strips leading and trailing white space in place; returns the first kept character. */
char *config_trim(char *s);
/* Strict decimal integer (no trailing text, hex or exponent) and finite number: 0, 1 when out of
 * the type's range, −1 when the text is not one (config_text.c). */
int config_parse_integer(const char *s, long long *out);
int config_parse_number(const char *s, double *out);
/* "; did you mean 'rope'?" when word is near one of words, else "". */
void config_suggest_word(const char *const *words, const char *word, char *out, size_t len);

/* Suggestions: case-blind edit distance, whether a distance is close enough to suggest, words
 * joined with ", ", and the "did you mean" or list-of-keys text for an unknown key (section < 0:
 * the name came without a section; qualify: always name the section). */
int config_edit_distance(const char *a, const char *b);
bool config_is_close(const char *given, int distance);
void config_join_words(const char *const *words, char *out, size_t len);
void config_suggest_key(int section, const char *name, bool qualify, char *out, size_t len);

#endif
