/* The in-process task generators (tasks.h): copy, majority, mqar, passkey and listops. Every draw
 * comes from the counter-based stream keyed by (run.seed, RNG_TASK, a, b, draw number), so a sample
 * depends on its key alone. Must not read files (passkey's filler text is handed in) or know about
 * ranks. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "core/rng.h"
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
 * copy and majority */

/* Copy task: L symbols from 1..symbols, a separator 0, the same L symbols, then separators. */
static long copy_length(const struct task_options *o) {
  long L = o->copy_len > 0 ? o->copy_len : o->n / 2;
  if (2 * L + 1 > o->n + 1) L = o->n / 2;
  return L;
}

void task_copy(const struct task_options *o, uint64_t a, uint64_t b, struct task_sample *s) {
  const long n = o->n, L = copy_length(o);
  uint8_t *w = s->tokens;
  memset(w, 0, (size_t)n + 1);
  for (long t = 0; t < L; t++) {
    uint8_t sym =
        (uint8_t)(1 + rng_below((uint64_t)o->symbols, o->seed, RNG_TASK, a, b, (uint64_t)t));
    w[t] = sym;
    w[L + 1 + t] = sym;
  }
  for (long t = 0; t < n; t++) { /* target t is the symbol L back */
    s->scored[t] = t >= L && t < 2 * L;
    s->distance[t] = s->scored[t] ? (int32_t)L : -1;
  }
}

/* Majority task: data symbols 1..S, each the sequence's dominant symbol with probability
 * MAJORITY_BIAS and uniform otherwise; at the marker positions n/2, n/2 + n/4, ... the byte is
 * S + 1, and the byte after it — the scored target — is the majority symbol of every data symbol
 * before the marker (ties: the smallest). The markers are n/4 apart, farther than any near field
 * or local band this task is meant to test, so an earlier answer is never in a near-field window
 * of a later marker: only a model that summarises the whole prefix can answer. */
#define MAJORITY_BIAS 0.1

static bool majority_marker(long n, long t) {
  const long Q = n / 4 > 0 ? n / 4 : 1;
  return t >= n / 2 && t < n && (t - n / 2) % Q == 0;
}

void task_majority(const struct task_options *o, uint64_t a, uint64_t b, struct task_sample *s) {
  const long n = o->n;
  const int S = o->symbols;
  const uint64_t seed = o->seed;
  uint8_t *w = s->tokens;
  const int dom = 1 + (int)rng_below((uint64_t)S, seed, RNG_TASK, a, b, ~0ull);
  long counts[256] = {0};
  for (long t = 0; t <= n; t++) {
    if (t > 0 && majority_marker(n, t - 1)) { /* the answer */
      int best = 1;
      for (int s = 2; s <= S; s++)
        if (counts[s] > counts[best]) best = s;
      w[t] = (uint8_t)best;
      continue;
    }
    if (majority_marker(n, t)) {
      w[t] = (uint8_t)(S + 1);
      continue;
    }
    const bool biased = rng_uniform(seed, RNG_TASK, a, b, 2 * (uint64_t)t) < MAJORITY_BIAS;
    const int sym =
        biased ? dom : 1 + (int)rng_below((uint64_t)S, seed, RNG_TASK, a, b, 2 * (uint64_t)t + 1);
    w[t] = (uint8_t)sym;
    counts[sym]++;
  }
  for (long t = 0; t < n; t++) { /* an answer needs the whole prefix, back to position 0 */
    s->scored[t] = majority_marker(n, t);
    s->distance[t] = s->scored[t] ? (int32_t)t : -1;
  }
}

/* ---------------------------------------------------------------------------------------------
 * mqar: P pairs (P distinct keys) at the start, then filler in which Q queries appear at query
 * slots, each a key followed by the scored target: the value byte (two-token form, Zoology: pair i
 * is "key value" at 2i, 2i + 1) or the pair byte (one-hop form: pair i is one byte at i). The
 * queries ask for Q ≤ P of the keys in random order, each once (a key asked for twice would find
 * its first answer nearer than its pair). A query slot is two tokens; slot s starts right after
 * the pairs, at span + 2s. */

/* Q distinct slots of S, ascending, placed as data.mqar.spread says. */
static void mqar_slots(const struct task_options *o, struct draws *d, long S, int Q, long *slot) {
  uint8_t *used = xcalloc((size_t)S, 1);
  for (int i = 0; i < Q; i++) {
    long s = i;
    if (o->mqar_spread != MQAR_COMPACT) {
      if (o->mqar_spread == MQAR_UNIFORM) {
        s = (long)draw_below(d, (uint64_t)S);
      } else { /* a gap of g slots, log-uniform in [1, S] */
        s = (long)floor(exp(draw_uniform(d) * log((double)S + 1.0))) - 1;
        s = s < 0 ? 0 : s >= S ? S - 1 : s;
      }
      while (used[s]) s = (s + 1) % S; /* taken: the next free slot (Q ≤ S) */
    }
    used[s] = 1;
  }
  long k = 0;
  for (long s = 0; s < S; s++)
    if (used[s]) slot[k++] = s;
  free(used);
}

/* order[i] for i < Q ≤ P: which pairs are asked for, in what order (a partial Fisher-Yates). */
static void mqar_order(struct draws *d, int P, int Q, int *order) {
  int perm[MQAR_KEYS];
  for (int i = 0; i < P; i++) perm[i] = i;
  for (int i = 0; i < Q; i++) {
    const int j = i + (int)draw_below(d, (uint64_t)(P - i));
    const int t = perm[i];
    perm[i] = perm[j];
    perm[j] = t;
    order[i] = perm[i];
  }
}

void task_mqar(const struct task_options *o, uint64_t a, uint64_t b, struct task_sample *s) {
  struct draws d = {o->seed, a, b, 0};
  const long n = s->n;
  const bool one = o->mqar_one_hop;
  const int P = o->mqar_pairs, Q = o->mqar_queries ? o->mqar_queries : P;
  const int nkeys = one ? MQAR1_KEYS : MQAR_KEYS, nvalues = one ? MQAR1_VALUES : MQAR_VALUES;
  const long span = one ? P : 2L * P; /* tokens the pairs take */
  task_sample_clear(s);
  memset(s->tokens, MQAR_FILL, (size_t)n + 1);
  int keys[MQAR_KEYS], value[MQAR_KEYS];
  for (int i = 0; i < nkeys; i++) keys[i] = i;
  for (int i = 0; i < P; i++) { /* P distinct keys: a partial Fisher-Yates shuffle */
    const int j = i + (int)draw_below(&d, (uint64_t)(nkeys - i));
    const int t = keys[i];
    keys[i] = keys[j];
    keys[j] = t;
    value[i] = (int)draw_below(&d, (uint64_t)nvalues);
    if (one) {
      s->tokens[i] = (uint8_t)(MQAR1_PAIR0 + MQAR1_VALUES * keys[i] + value[i]);
    } else {
      s->tokens[2 * i] = (uint8_t)(MQAR_KEY0 + keys[i]);
      s->tokens[2 * i + 1] = (uint8_t)(MQAR_VALUE0 + value[i]);
    }
  }
  int order[MQAR_KEYS];
  long slot[MQAR_KEYS];
  mqar_order(&d, P, Q, order);
  mqar_slots(o, &d, (n + 1 - span) / 2, Q, slot);
  for (int i = 0; i < Q; i++) {
    const long q = span + 2 * slot[i]; /* the query key; its value follows */
    const int pair = order[i];
    s->tokens[q] = (uint8_t)(one ? MQAR1_QUERY0 + keys[pair] : MQAR_KEY0 + keys[pair]);
    s->tokens[q + 1] = (uint8_t)(one ? MQAR1_PAIR0 + MQAR1_VALUES * keys[pair] + value[pair]
                                     : MQAR_VALUE0 + value[pair]);
    s->scored[q] = 1;
    /* back to the token the target copies: the pair byte, or the value byte */
    s->distance[q] = (int32_t)(q - (one ? pair : 2L * pair + 1));
  }
}

/* ---------------------------------------------------------------------------------------------
 * passkey: a haystack of H tokens starts the sample (padding after it): filler with the needle
 * NEEDLE d0..dk−1 at a depth, and the question at its end (tasks.h gives both forms), the digits
 * scored. The question takes the haystack's last 1 + k tokens (plain) or 1 + 2k (one-hop), from Q
 * on; the needle starts at p ≤ F, the filler's length. A causal model's question sees the haystack
 * only, so a short haystack is a short problem whatever the context. */

static bool passkey_reserved(uint8_t c, bool one_hop) {
  return c == PASSKEY_PAD || c == PASSKEY_NEEDLE || c == PASSKEY_QUESTION ||
         (c >= PASSKEY_INDEX0 && c < PASSKEY_INDEX0 + PASSKEY_TAGGED) ||
         (one_hop && c >= PASSKEY_TAGGED0);
}

void task_passkey(const struct task_options *o, const uint8_t *text, size_t len, uint64_t a,
                  uint64_t b, struct task_sample *s) {
  struct draws d = {o->seed, a, b, 0};
  const bool one = o->passkey_one_hop;
  const long n = s->n, k = o->passkey_digits, question = one ? 1 + 2 * k : 1 + k;
  const double *len_range = o->passkey_length, *depth_range = o->passkey_depth;
  const double share = len_range[0] + (len_range[1] - len_range[0]) * draw_uniform(&d);
  long H = lround(share * (double)(n + 1)); /* at least the needle and the question */
  H = H < question + k + 1 ? question + k + 1 : H > n + 1 ? n + 1 : H;
  const long Q = H - question, F = Q - (k + 1);
  task_sample_clear(s);
  memset(s->tokens + H, PASSKEY_PAD, (size_t)(n + 1 - H));
  const double depth = depth_range[0] + (depth_range[1] - depth_range[0]) * draw_uniform(&d);
  long p = lround(depth * (double)F);
  if (p > F) p = F;
  uint8_t digits[64];
  for (long i = 0; i < k; i++) {
    const int v = (int)draw_below(&d, 10);
    digits[i] = (uint8_t)(one ? PASSKEY_TAGGED0 + 10 * i + v : '0' + v);
  }
  const uint64_t off =
      text && len > (size_t)F ? draw_below(&d, (uint64_t)(len - (size_t)F) + 1) : 0;
  for (long f = 0; f < F; f++) { /* filler byte f goes before the needle or after it */
    uint8_t c = text ? text[off + (size_t)f] : (uint8_t)(0x20 + draw_below(&d, 0x7F - 0x20));
    if (passkey_reserved(c, one)) c = ' ';
    s->tokens[f < p ? f : f + k + 1] = c;
  }
  s->tokens[p] = PASSKEY_NEEDLE;
  s->tokens[Q] = PASSKEY_QUESTION;
  for (long i = 0; i < k; i++) {
    s->tokens[p + 1 + i] = digits[i];
    /* the position that predicts digit i: the question or digit i − 1 (plain), or query i */
    const long t = one ? Q + 1 + 2 * i : Q + i;
    if (one) s->tokens[t] = (uint8_t)(PASSKEY_INDEX0 + i);
    s->tokens[t + 1] = digits[i];
    s->scored[t] = 1;
    s->distance[t] = (int32_t)(t - (p + 1 + i)); /* back to the needle's digit i */
  }
}

/* ---------------------------------------------------------------------------------------------
 * listops: the LRA generator (lra_benchmarks/data/listops.py): a node below max_depth is an
 * operator with probability 1/4 (else a value 0..9), an operator has 2..max_args arguments;
 * expressions are drawn until one is min_length .. n − 1 bytes long, then '=', the answer and
 * padding (after the answer, as LRA pads, so that the answer sees the expression only). */

struct listops_gen {
  const struct task_options *o;
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
  const double r = depth < g->o->listops_max_depth ? draw_uniform(g->d) : 1.0;
  if (g->len >= g->cap) return -1;
  if (r > 0.25) {
    const int v = (int)draw_below(g->d, 10);
    g->out[g->len++] = (uint8_t)('0' + v);
    return v;
  }
  static const uint8_t ops[4] = {LISTOPS_MIN, LISTOPS_MAX, LISTOPS_MED, LISTOPS_SM};
  const int k = 2 + (int)draw_below(g->d, (uint64_t)g->o->listops_max_args - 1);
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

void task_listops(const struct task_options *o, uint64_t a, uint64_t b, struct task_sample *s) {
  struct draws d = {o->seed, a, b, 0};
  const long n = s->n, cap = n - 1; /* the expression, '=' and the answer fill n + 1 tokens */
  task_sample_clear(s);
  uint8_t *expr = xmalloc((size_t)cap);
  struct listops_gen g = {o, &d, expr, 0, cap};
  int value = -1;
  for (long tries = 0; tries < LISTOPS_TRIES; tries++) {
    g.len = 0;
    value = listops_node(&g, 1);
    if (value >= 0 && g.len >= o->listops_min_length) break;
    value = -1;
  }
  if (value < 0)
    error(
        "data.source = listops: no expression of %d to %ld bytes in %d draws; lower "
        "data.listops.min_length or raise data.listops.max_args or data.listops.max_depth",
        o->listops_min_length, cap, LISTOPS_TRIES);
  const long E = g.len; /* expression, '=', answer, then padding as LRA pads */
  memcpy(s->tokens, expr, (size_t)E);
  s->tokens[E] = LISTOPS_ANSWER;
  s->tokens[E + 1] = (uint8_t)('0' + value);
  memset(s->tokens + E + 2, LISTOPS_PAD, (size_t)(n - 1 - E));
  s->scored[E] = 1;
  s->distance[E] = (int32_t)E; /* back to the expression's first token */
  free(expr);
}
