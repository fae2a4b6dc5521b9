/* The in-process task generators (tasks.h): mqar, passkey and listops. Every draw comes from the
 * counter-based stream keyed by (run.seed, RNG_TASK, a, b, draw number), so a sample depends on
 * its key alone. Must not read files (passkey's filler text is handed in) or know about ranks. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "error.h"
#include "rng.h"
#include "tasks/tasks.h"

/* The draws of one sample, numbered in order. */
struct draws {
  uint64_t seed, a, b, c;
};

static uint64_t draw_below(struct draws *d, uint64_t n) {
  return rng_below(n, d->seed, RNG_TASK, d->a, d->b, d->c++);
}

static double draw_uniform(struct draws *d) {
  return rng_uniform_double(d->seed, RNG_TASK, d->a, d->b, d->c++);
}

void task_sample_alloc(struct task_sample *s, long n) {
  s->n = n;
  s->tokens = xmalloc((size_t)n + 1);
  s->scored = xmalloc((size_t)n);
  s->distance = xmalloc(sizeof(int32_t) * (size_t)n);
  task_sample_clear(s);
}

void task_sample_free(struct task_sample *s) {
  free(s->tokens);
  free(s->scored);
  free(s->distance);
  memset(s, 0, sizeof *s);
}

void task_sample_clear(struct task_sample *s) {
  memset(s->tokens, 0, (size_t)s->n + 1);
  memset(s->scored, 0, (size_t)s->n);
  for (long t = 0; t < s->n; t++) s->distance[t] = -1;
}

/* ---------------------------------------------------------------------------------------------
 * mqar: P pairs "key value" at positions 0 .. 2P − 1 (P distinct keys), then filler in which Q
 * of the keys (random order, each once) appear at query slots, each followed by its value: the
 * scored target. A slot is two tokens; slot s starts at 2P + 2s. */

/* Q distinct slots of S, ascending, placed as data.mqar.spread says. */
static void mqar_slots(const struct config *cfg, struct draws *d, long S, int Q, long *slot) {
  int have = 0;
  for (int i = 0; i < Q; i++) {
    long s = i;
    if (cfg->data.mqar_spread != MQAR_COMPACT) {
      for (int tries = 0;; tries++) {
        if (cfg->data.mqar_spread == MQAR_UNIFORM) {
          s = (long)draw_below(d, (uint64_t)S);
        } else { /* a gap of g slots, log-uniform in [1, S] */
          const double g = floor(exp(draw_uniform(d) * log((double)S + 1.0)));
          s = (long)g - 1;
          if (s < 0) s = 0;
          if (s >= S) s = S - 1;
        }
        bool taken = false;
        for (int j = 0; j < have; j++) taken = taken || slot[j] == s;
        if (!taken) break;
        if (tries == 64) { /* a crowded context: the next free slot after s */
          for (;; s = (s + 1) % S) {
            bool used = false;
            for (int j = 0; j < have; j++) used = used || slot[j] == s;
            if (!used) break;
          }
          break;
        }
      }
    }
    slot[have++] = s;
  }
  for (int i = 1; i < Q; i++) /* insertion sort: Q ≤ 64 */
    for (int j = i; j > 0 && slot[j - 1] > slot[j]; j--) {
      long t = slot[j];
      slot[j] = slot[j - 1];
      slot[j - 1] = t;
    }
}

void task_mqar(const struct config *cfg, uint64_t a, uint64_t b, struct task_sample *s) {
  struct draws d = {cfg->run.seed, a, b, 0};
  const long n = s->n;
  const int P = cfg->data.mqar_pairs;
  const int Q = cfg->data.mqar_queries ? cfg->data.mqar_queries : P;
  task_sample_clear(s);
  memset(s->tokens, MQAR_FILL, (size_t)n + 1);
  int keys[MQAR_KEYS], value[MQAR_KEYS], order[MQAR_KEYS];
  for (int i = 0; i < MQAR_KEYS; i++) keys[i] = i;
  for (int i = 0; i < P; i++) { /* P distinct keys: a partial Fisher-Yates shuffle */
    const int j = i + (int)draw_below(&d, (uint64_t)(MQAR_KEYS - i));
    const int t = keys[i];
    keys[i] = keys[j];
    keys[j] = t;
    value[i] = (int)draw_below(&d, MQAR_VALUES);
    s->tokens[2 * i] = (uint8_t)(MQAR_KEY0 + keys[i]);
    s->tokens[2 * i + 1] = (uint8_t)(MQAR_VALUE0 + value[i]);
    order[i] = i;
  }
  for (int i = 0; i < Q; i++) { /* which pairs are asked for, in what order */
    const int j = i + (int)draw_below(&d, (uint64_t)(P - i));
    const int t = order[i];
    order[i] = order[j];
    order[j] = t;
  }
  long slot[MQAR_KEYS];
  mqar_slots(cfg, &d, (n + 1 - 2L * P) / 2, Q, slot);
  for (int i = 0; i < Q; i++) {
    const long q = 2L * P + 2 * slot[i]; /* the query key; its value follows */
    const int pair = order[i];
    s->tokens[q] = (uint8_t)(MQAR_KEY0 + keys[pair]);
    s->tokens[q + 1] = (uint8_t)(MQAR_VALUE0 + value[pair]);
    s->scored[q] = 1;
    s->distance[q] = (int32_t)(q - (2L * pair + 1)); /* back to the pair's value */
  }
}

/* ---------------------------------------------------------------------------------------------
 * passkey: filler with the needle NEEDLE d1..dk at a depth, and at the end QUESTION d1..dk, the
 * digits scored. Q = n − k is the question's position; the needle starts at p ≤ Q − k − 1. */

void task_passkey(const struct config *cfg, const uint8_t *text, size_t len, uint64_t a,
                  uint64_t b, struct task_sample *s) {
  struct draws d = {cfg->run.seed, a, b, 0};
  const long n = s->n, k = cfg->data.passkey_digits, Q = n - k, F = Q - (k + 1);
  task_sample_clear(s);
  const double lo = cfg->data.passkey_depth[0], hi = cfg->data.passkey_depth[1];
  const double depth = lo + (hi - lo) * draw_uniform(&d);
  long p = lround(depth * (double)F);
  if (p > F) p = F;
  uint8_t digits[64];
  for (long i = 0; i < k; i++) digits[i] = (uint8_t)('0' + draw_below(&d, 10));
  const uint64_t off = text && len > (size_t)F ? draw_below(&d, (uint64_t)(len - (size_t)F) + 1) : 0;
  for (long f = 0; f < F; f++) { /* filler byte f goes before the needle or after it */
    uint8_t c = text ? text[off + (size_t)f] : (uint8_t)(0x20 + draw_below(&d, 0x7F - 0x20));
    if (c == PASSKEY_NEEDLE || c == PASSKEY_QUESTION) c = ' ';
    s->tokens[f < p ? f : f + k + 1] = c;
  }
  s->tokens[p] = PASSKEY_NEEDLE;
  s->tokens[Q] = PASSKEY_QUESTION;
  for (long i = 0; i < k; i++) {
    s->tokens[p + 1 + i] = digits[i];
    s->tokens[Q + 1 + i] = digits[i];
    s->scored[Q + i] = 1;
    s->distance[Q + i] = (int32_t)(Q - p - 1); /* from Q + i back to p + 1 + i */
  }
}

/* ---------------------------------------------------------------------------------------------
 * listops: the LRA generator (lra_benchmarks/data/listops.py): a node below max_depth is an
 * operator with probability 1/4 (else a value 0..9), an operator has 2..max_args arguments;
 * expressions are drawn until one is min_length .. n − 1 bytes long. */

struct listops_gen {
  const struct config *cfg;
  struct draws *d;
  uint8_t *out; /* the expression so far */
  long len, cap;
};

static int median_floor(int *v, int k) {
  for (int i = 1; i < k; i++) /* insertion sort: k ≤ 20 */
    for (int j = i; j > 0 && v[j - 1] > v[j]; j--) {
      int t = v[j];
      v[j] = v[j - 1];
      v[j - 1] = t;
    }
  return k % 2 ? v[k / 2] : (v[k / 2 - 1] + v[k / 2]) / 2; /* LRA: int(np.median) */
}

/* Appends one node at `depth` (1 for the root) and returns its value, or −1 once the expression
 * is longer than cap (the draw is then abandoned). */
static int listops_node(struct listops_gen *g, int depth) {
  const double r = depth < g->cfg->data.listops_max_depth ? draw_uniform(g->d) : 1.0;
  if (g->len >= g->cap) return -1;
  if (r > 0.25) {
    const int v = (int)draw_below(g->d, 10);
    g->out[g->len++] = (uint8_t)('0' + v);
    return v;
  }
  static const uint8_t ops[4] = {LISTOPS_MIN, LISTOPS_MAX, LISTOPS_MED, LISTOPS_SM};
  const int k = 2 + (int)draw_below(g->d, (uint64_t)g->cfg->data.listops_max_args - 1);
  const uint8_t op = ops[draw_below(g->d, 4)];
  g->out[g->len++] = op;
  int v[20], sum = 0, lo = 9, hi = 0;
  for (int i = 0; i < k; i++) {
    if ((v[i] = listops_node(g, depth + 1)) < 0) return -1;
    sum += v[i];
    lo = v[i] < lo ? v[i] : lo;
    hi = v[i] > hi ? v[i] : hi;
  }
  if (g->len >= g->cap) return -1;
  g->out[g->len++] = LISTOPS_CLOSE;
  switch (op) {
    case LISTOPS_MIN:
      return lo;
    case LISTOPS_MAX:
      return hi;
    case LISTOPS_MED:
      return median_floor(v, k);
    default:
      return sum % 10;
  }
}

#define LISTOPS_TRIES 1000000

void task_listops(const struct config *cfg, uint64_t a, uint64_t b, struct task_sample *s) {
  struct draws d = {cfg->run.seed, a, b, 0};
  const long n = s->n, cap = n - 1; /* the expression, '=' and the answer fill n + 1 tokens */
  task_sample_clear(s);
  uint8_t *expr = xmalloc((size_t)cap);
  struct listops_gen g = {cfg, &d, expr, 0, cap};
  int value = -1;
  for (long tries = 0; tries < LISTOPS_TRIES; tries++) {
    g.len = 0;
    value = listops_node(&g, 1);
    if (value >= 0 && g.len >= cfg->data.listops_min_length) break;
    value = -1;
  }
  if (value < 0)
    error(
        "data.source = listops: no expression of %d to %ld bytes in %d draws; lower "
        "data.listops.min_length or raise data.listops.max_args or data.listops.max_depth",
        cfg->data.listops_min_length, cap, LISTOPS_TRIES);
  const long pad = n + 1 - (g.len + 2);
  memset(s->tokens, LISTOPS_PAD, (size_t)pad);
  memcpy(s->tokens + pad, expr, (size_t)g.len);
  s->tokens[n - 1] = LISTOPS_ANSWER;
  s->tokens[n] = (uint8_t)('0' + value);
  s->scored[n - 1] = 1;
  s->distance[n - 1] = (int32_t)(n - 1 - pad); /* back to the expression's first token */
  free(expr);
}
