/* libFuzzer harness for the deck loader (config_load) and the --set parser, under ASan, UBSan and
 * LeakSanitizer: besides no crash, no leak and no undefined behaviour, a refusal always carries a
 * message and an accepted deck's resolved text is accepted again and resolves to the same
 * settings. Built by `make check` when configure finds clang with libFuzzer; run by
 * tests/test_fuzz.sh. Test code only: it links the deck loader's sources, not libfmattn.a. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "deck/config.h"

static char deck_path[64], again_path[64];

/* The text without its comment lines, in a new string. */
static char *settings_of(const char *text) {
  char *out = malloc(strlen(text) + 1), *o = out;
  for (const char *p = text; *p;) {
    const char *end = strchr(p, '\n');
    size_t len = end ? (size_t)(end - p) + 1 : strlen(p);
    if (*p != '#' && *p != ';') {
      memcpy(o, p, len);
      o += len;
    }
    p += len;
  }
  *o = '\0';
  return out;
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc;
  (void)argv;
  snprintf(deck_path, sizeof deck_path, "fuzz-deck-%ld.in", (long)getpid());
  snprintf(again_path, sizeof again_path, "fuzz-again-%ld.in", (long)getpid());
  return 0;
}

/* One input is a deck file's bytes, optionally followed by a line "%%" and then one --set override
 * per line ("section.key=value", at most 70 lines, so that the 64-override limit is reached too).
 * The deck goes the command line's way: written to a file, read by config_load with the overrides.
 * An accepted deck's resolved text (what runs record in their files) must be accepted again, by
 * config_from_text and as a deck file of its own, and that file must resolve to the same settings,
 * line for line (comment lines, # or ;, aside: they name the deck it came from). */
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  /* The deck is everything before a line "%%"; the overrides, NUL-terminated copies, follow. */
  const char *sep = NULL;
  for (size_t i = 0; i + 3 <= size; i++)
    if ((i == 0 || data[i - 1] == '\n') && data[i] == '%' && data[i + 1] == '%' &&
        (i + 2 == size || data[i + 2] == '\n')) {
      sep = (const char *)data + i;
      break;
    }
  size_t deck_len = sep ? (size_t)(sep - (const char *)data) : size;

  FILE *f = fopen(deck_path, "wb");
  if (!f) abort();
  if (deck_len && fwrite(data, 1, deck_len, f) != deck_len) abort();
  fclose(f);

  char *tail = NULL;
  struct config_overrides ov = {0};
  if (sep) {
    size_t tail_len = size - deck_len - 2;
    tail = malloc(tail_len + 1);
    memcpy(tail, sep + 2, tail_len);
    tail[tail_len] = '\0';
    char *save = NULL;
    for (char *line = strtok_r(tail, "\n", &save); line && ov.count < 70;
         line = strtok_r(NULL, "\n", &save)) {
      if (ov.count < 64) ov.items[ov.count] = line;
      ov.count++;
    }
  }

  struct config cfg;
  char err[1024] = "";
  if (config_load(&cfg, deck_path, sep ? &ov : NULL, err, sizeof err) != 0) {
    if (!err[0]) abort(); /* a refusal without a message */
  } else {
    struct config again;
    char err2[1024] = "";
    if (config_from_text(&again, cfg.resolved, err2, sizeof err2) != 0) {
      fprintf(stderr, "resolved deck refused: %s\n%s\n", err2, cfg.resolved);
      abort();
    }
    config_free(&again);
    f = fopen(again_path, "wb");
    if (!f || fputs(cfg.resolved, f) < 0) abort();
    fclose(f);
    if (config_load(&again, again_path, NULL, err2, sizeof err2) != 0) {
      fprintf(stderr, "resolved deck refused as a deck file: %s\n%s\n", err2, cfg.resolved);
      abort();
    }
    char *a = settings_of(cfg.resolved), *b = settings_of(again.resolved);
    if (strcmp(a, b) != 0) {
      fprintf(stderr, "the resolved deck resolves differently:\n%s\n---\n%s\n", a, b);
      abort();
    }
    free(a);
    free(b);
    config_free(&again);
    config_free(&cfg);
  }
  free(tail);
  return 0;
}
