/* The text of deck values (config_keys.h): trimming, strict numbers, the shortest exact text
 * of a double, and the "did you mean" suggestions of a word among words and of a key among the
 * key table's (names, qualified names and aliases). Pure text: no parsing of decks, no files. */
#define _POSIX_C_SOURCE 200809L

#include <ctype.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "deck/config_keys.h"

char *config_trim(char *s) {
  while (isspace((unsigned char)*s)) s++;
  size_t n = strlen(s);
  while (n > 0 && isspace((unsigned char)s[n - 1])) s[--n] = '\0';
  return s;
}

/* Edit distance with transpositions (optimal string alignment), ignoring case, so that "trian"
 * is one step from "train". Names are short; longer inputs are cut at 63 characters. */
int config_edit_distance(const char *a, const char *b) {
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
bool config_is_close(const char *given, int distance) {
  int n = (int)strlen(given), limit = n / 3 > 2 ? n / 3 : 2;
  return distance <= limit && distance < n;
}

void config_join_words(const char *const *words, char *out, size_t len) {
  size_t used = 0;
  out[0] = '\0';
  for (int i = 0; words[i] && used < len; i++)
    used += (size_t)snprintf(out + used, len - used, "%s%s", i ? ", " : "", words[i]);
}

/* "; did you mean 'rope'?" when word is near one of words, else "". */
void config_suggest_word(const char *const *words, const char *word, char *out, size_t len) {
  int best = -1, best_d = INT_MAX;
  for (int i = 0; words[i]; i++) {
    int d = config_edit_distance(word, words[i]);
    if (d < best_d) best = i, best_d = d;
  }
  if (best >= 0 && config_is_close(word, best_d))
    snprintf(out, len, "; did you mean '%s'?", words[best]);
  else
    out[0] = '\0';
}

/* The shortest %g text that reads back as the same double, so the resolved deck is exact; whole
 * numbers in full, so byte counts read as such (3000, not 3e+03). */
void config_format_double(double v, char *out, size_t len) {
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
int config_parse_integer(const char *s, long long *out) {
  if (!*s || isspace((unsigned char)*s)) return -1;
  char *end;
  errno = 0;
  *out = strtoll(s, &end, 10);
  if (end == s || *end) return -1;
  return errno == ERANGE ? 1 : 0;
}

/* A finite number; 1 = too large for a double, -1 = not a number. */
int config_parse_number(const char *s, double *out) {
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
 * Suggestions. */

/* "did you mean 'lr'?" (or 'model.dim' for a key of another section, always qualified for --set),
 * else the valid keys of the section. section < 0: the name came without a section. */
void config_suggest_key(int section, const char *name, bool qualify, char *out, size_t len) {
  int best = -1, best_d = INT_MAX;
  for (int k = 0; k < CONFIG_NKEYS; k++) {
    char qualified[128], aliases[256];
    snprintf(qualified, sizeof qualified, "%s.%s", config_keys[k].section, config_keys[k].name);
    int d = config_edit_distance(name, config_keys[k].name);
    int dq = config_edit_distance(name, qualified);
    if (dq < d) d = dq;
    const char *dot = strchr(config_keys[k].name, '.'); /* "m" for "fma.m" */
    if (dot && config_edit_distance(name, dot + 1) < d) d = config_edit_distance(name, dot + 1);
    snprintf(aliases, sizeof aliases, "%s", config_keys[k].aliases);
    for (char *save, *a = strtok_r(aliases, " ", &save); a; a = strtok_r(NULL, " ", &save))
      if (config_edit_distance(name, a) < d) d = config_edit_distance(name, a);
    bool same = section >= 0 && strcmp(config_keys[k].section, config_section_names[section]) == 0;
    bool best_same = best >= 0 && section >= 0 &&
                     strcmp(config_keys[best].section, config_section_names[section]) == 0;
    if (d < best_d || (d == best_d && same && !best_same)) best = k, best_d = d;
  }
  if (best >= 0 && config_is_close(name, best_d)) {
    bool same =
        section >= 0 && strcmp(config_keys[best].section, config_section_names[section]) == 0;
    if (same && !qualify)
      snprintf(out, len, "did you mean '%s'?", config_keys[best].name);
    else
      snprintf(out, len, "did you mean '%s.%s'?", config_keys[best].section,
               config_keys[best].name);
    return;
  }
  if (section < 0) {
    snprintf(out, len, "see fmattn --print-defaults for every key");
    return;
  }
  size_t used = (size_t)snprintf(out, len, "valid keys in [%s]: ", config_section_names[section]);
  bool first = true;
  for (int k = 0; k < CONFIG_NKEYS && used < len; k++) {
    if (strcmp(config_keys[k].section, config_section_names[section]) != 0) continue;
    used +=
        (size_t)snprintf(out + used, len - used, "%s%s", first ? "" : ", ", config_keys[k].name);
    first = false;
  }
}
