/* Synthetic and long-range tasks (SPEC §4, docs/tasks.md): the in-process generators copy,
 * majority, mqar, passkey and listops, HDF5 task files (read, checked and written), and the
 * accuracy sums of an evaluation on scored targets, bucketed by distance. A sample is a pure
 * function of (run.seed, sample key), never of the rank layout. No MPI here: callers reduce the
 * sums; nothing here decides which rank takes which sample. The deck is read once, by
 * task_options_read (options.c); below it the generators see only struct task_options. */
#ifndef FMATTN_TASKS_H
#define FMATTN_TASKS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "deck/config.h"

/* The alphabets (bytes). MQAR, two-token form (Zoology): key bytes and value bytes from disjoint
 * ranges, filler between the queries; a query is the key byte, its target the value byte. */
#define MQAR_KEY0   0x80 /* keys 0x80 .. 0xBF */
#define MQAR_KEYS   64
#define MQAR_VALUE0 0xC0 /* values 0xC0 .. 0xFF */
#define MQAR_VALUES 64
#define MQAR_FILL   0x00
/* MQAR, one-hop form: a pair is one byte PAIR0 + key·8 + value (16 keys, 8 values); a query is
 * the byte QUERY0 + key, its target the pair byte itself: the stored item, fetched by its key (the
 * key is known from the query, so chance is one in 8). */
#define MQAR1_PAIR0  0x80
#define MQAR1_KEYS   16
#define MQAR1_VALUES 8
#define MQAR1_QUERY0 0x40 /* '@' .. 'O' */
/* passkey: the needle NEEDLE d0..dk−1 lies inside the filler. Plain form: the sample ends with
 * QUESTION d0..dk−1, digits '0'..'9'. One-hop form: digit i of value v is the byte
 * TAGGED0 + 10·i + v (in the needle and in the answer alike) and the sample ends with QUESTION,
 * then for each i the query byte INDEX0 + i followed by digit i: a query names the digit it
 * fetches. Filler bytes that are padding, markers, query bytes or (one-hop) tagged bytes become
 * spaces.
 * A haystack (filler, needle, question) shorter than the sample (data.passkey.length) starts the
 * sample; PAD bytes follow it. */
#define PASSKEY_PAD      0x00 /* after a haystack shorter than the sample */
#define PASSKEY_NEEDLE   0x02
#define PASSKEY_QUESTION 0x03
#define PASSKEY_INDEX0   0x10 /* query bytes 0x10 .. 0x1B */
#define PASSKEY_TAGGED0  0x80
#define PASSKEY_TAGGED   12 /* digits the one-hop form can tag: 0x80 + 10·12 = 0xF8 */
/* ListOps, one byte per LRA token: "[MAX" is 'X', "[MIN" 'N', "[MED" 'D', "[SM" 'S', "]" is ']',
 * values '0'..'9'; the expression is followed by '=', the answer, and spaces up to the end. */
#define LISTOPS_MAX    'X'
#define LISTOPS_MIN    'N'
#define LISTOPS_MED    'D'
#define LISTOPS_SM     'S'
#define LISTOPS_CLOSE  ']'
#define LISTOPS_ANSWER '='
#define LISTOPS_PAD    ' '

/* One sample: n + 1 tokens; target t (t = 0 .. n − 1) is tokens[t + 1], predicted at position t. */
struct task_sample {
  long n;
  uint8_t *tokens;   /* (n + 1) */
  uint8_t *scored;   /* (n) 1 when target t counts */
  int32_t *distance; /* (n) how far back from t lies the token target t needs (t − its
                        position); −1: no single place (or not known) */
};
void task_sample_alloc(struct task_sample *s, long n);
void task_sample_free(struct task_sample *s);
/* Tokens 0, nothing scored, every distance −1. */
void task_sample_clear(struct task_sample *s);

/* What the generators read of the deck (data.*, model.context, run.seed). */
struct task_options {
  long n;                       /* model.context: a sample is n + 1 tokens */
  uint64_t seed;                /* run.seed */
  int symbols;                  /* copy, majority: the alphabet 1 .. symbols */
  int copy_len;                 /* copy: symbols before the separator (0: as many as fit) */
  int mqar_pairs, mqar_queries; /* mqar: key-value pairs, keys asked for (0: every pair) */
  enum mqar_spread mqar_spread; /* mqar: where the queries lie */
  bool mqar_one_hop;            /* mqar: a pair is one byte */
  int passkey_digits;           /* passkey: the needle's digits */
  bool passkey_one_hop;         /* passkey: digits carry their index */
  double passkey_depth[2];      /* passkey: the needle's depth drawn in [lo, hi] */
  double passkey_length[2];     /* passkey: the haystack's share of the sample */
  int listops_max_args, listops_max_depth, listops_min_length;
};
/* The set-up: cfg's data.*, model.context and run.seed into o. */
void task_options_read(struct task_options *o, const struct config *cfg);
/* The deck's rules of the in-process tasks (config_add_rule): a sample must fit model.context + 1
 * tokens, the one-hop forms their alphabets. False when cfg keeps them; else true with the keys
 * to blame (space-separated) and the message. */
bool task_deck_rule(const struct config *cfg, char *keys, size_t keys_len, char *msg,
                    size_t msg_len);

/* The generators, for sample key (a, b). passkey's filler is a window of text (len bytes, at
 * least the filler's length) or, text NULL, random printable bytes. copy: L symbols, a separator
 * 0, the same L symbols, then separators (targets L back scored); majority: data symbols with
 * markers whose next byte is the majority of every data symbol before it (see generators.c). */
void task_copy(const struct task_options *o, uint64_t a, uint64_t b, struct task_sample *s);
void task_majority(const struct task_options *o, uint64_t a, uint64_t b, struct task_sample *s);
void task_mqar(const struct task_options *o, uint64_t a, uint64_t b, struct task_sample *s);
void task_passkey(const struct task_options *o, const uint8_t *text, size_t len, uint64_t a,
                  uint64_t b, struct task_sample *s);
void task_listops(const struct task_options *o, uint64_t a, uint64_t b, struct task_sample *s);

/* ---------------------------------------------------------------------------------------------
 * Task files: `tokens` (N, L) integers in [0, 256), `scored` (N, L − 1) 0/1, optional `distance`
 * (N, L − 1) integers (negative: unknown). Context L − 1. */
struct task_file {
  long rows, L;
  uint8_t *tokens;   /* (rows, L) */
  uint8_t *scored;   /* (rows, L − 1) */
  int32_t *distance; /* (rows, L − 1), or NULL when the file has none */
};
/* Read and check path for model.context = n. Returns 0, or 1 with one message in err (missing
 * dataset, shapes that disagree, tokens out of range, scored not 0/1, a row with no scored
 * position, rows shorter or longer than the context). */
int task_file_read(const char *path, long n, struct task_file *tf, char *err, size_t len);
void task_file_free(struct task_file *tf);

/* Writing one, row by row (rows known in advance); errors end the job. Attributes: source, deck,
 * split (the rows of train,valid,test as data.split text), version. */
struct task_writer;
struct task_writer *task_writer_open(const char *path, long rows, long n, const char *source,
                                     const char *deck, const char *split);
void task_writer_add(struct task_writer *w, const struct task_sample *s);
void task_writer_close(struct task_writer *w);

/* ---------------------------------------------------------------------------------------------
 * Accuracy. Distance buckets: [0, 1), [1, 2), [2, 4), …, [2^(k−1), 2^k), the last ending at n;
 * a distance of n or more counts in the last. */
int task_buckets(long n);
int task_bucket(long distance, int buckets); /* −1 for a negative (unknown) distance */
void task_bucket_edges(int k, long n, long *start, long *end);

/* The sums of one split's evaluation over its `windows` samples, in one buffer so that a single
 * allreduce adds them over ranks (sequence ranks hold parts of a sample; replicas other samples).
 */
struct task_score {
  long n, windows;
  int buckets;
  size_t count; /* doubles in sums */
  double *sums; /* scored, correct, by bucket: scored (buckets), correct (buckets); by window:
                   scored (windows), wrong (windows) */
};
void task_score_open(struct task_score *s, long n, long windows);
void task_score_close(struct task_score *s);
/* One evaluation batch: row b (of B) holds window first + b·stride (none at or past windows);
 * targets (−1: not scored), pred (argmax) and distance (or NULL) are (B, T). */
void task_score_add(struct task_score *s, long first, long stride, long B, long T,
                    const int *targets, const int *pred, const int *distance);

/* What the sums say, once reduced. */
struct task_accuracy {
  double scored;          /* scored targets */
  double accuracy;        /* share whose argmax is the target (NaN: none scored) */
  double samples;         /* samples with a scored target */
  double sample_accuracy; /* share of those with every scored target right */
};
/* by_bucket and scored_by_bucket (buckets each) may be NULL; an empty bucket's accuracy is NaN. */
void task_score_result(const struct task_score *s, struct task_accuracy *r, double *by_bucket,
                       double *scored_by_bucket);

#endif
