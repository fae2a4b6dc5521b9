/* The tasks' set-up (tasks.h): their deck keys read once into struct task_options, and their
 * rules on the deck. The one file of src/tasks/ that sees struct config. */
#include <stdio.h>
#include <string.h>

#include "tasks/tasks.h"

void task_options_read(struct task_options *o, const struct config *cfg) {
  const struct config_data *d = &cfg->data;
  *o = (struct task_options){.n = cfg->model.context,
                             .seed = cfg->run.seed,
                             .symbols = d->symbols,
                             .copy_len = d->copy_len,
                             .mqar_pairs = d->mqar_pairs,
                             .mqar_queries = d->mqar_queries,
                             .mqar_spread = d->mqar_spread,
                             .mqar_one_hop = d->mqar_one_hop,
                             .passkey_digits = d->passkey_digits,
                             .passkey_one_hop = d->passkey_one_hop,
                             .listops_max_args = d->listops_max_args,
                             .listops_max_depth = d->listops_max_depth,
                             .listops_min_length = d->listops_min_length};
  memcpy(o->passkey_depth, d->passkey_depth, sizeof o->passkey_depth);
  memcpy(o->passkey_length, d->passkey_length, sizeof o->passkey_length);
}

/* The keys to blame and the message, for task_deck_rule. */
#define REFUSE(KEYS, ...)                 \
  do {                                    \
    snprintf(keys, keys_len, "%s", KEYS); \
    snprintf(msg, msg_len, __VA_ARGS__);  \
    return true;                          \
  } while (0)

/* The in-process tasks must fit one sample of model.context + 1 tokens (docs/tasks.md). */
bool task_deck_rule(const struct config *cfg, char *keys, size_t keys_len, char *msg,
                    size_t msg_len) {
  const struct config_data *d = &cfg->data;
  const long room = (long)cfg->model.context + 1;
  if (d->source == SOURCE_MQAR) {
    const int q = d->mqar_queries ? d->mqar_queries : d->mqar_pairs;
    const long span = d->mqar_one_hop ? d->mqar_pairs : 2L * d->mqar_pairs;
    if (d->mqar_one_hop && d->mqar_pairs > MQAR1_KEYS)
      REFUSE("data.mqar.pairs data.mqar.one_hop",
             "data.mqar.pairs = %d: the one-hop form has %d keys (set data.mqar.one_hop = "
             "false for up to 64)",
             d->mqar_pairs, MQAR1_KEYS);
    if (d->mqar_queries > d->mqar_pairs)
      REFUSE("data.mqar.pairs data.mqar.queries",
             "data.mqar.queries = %d is more than data.mqar.pairs = %d: each key is asked for "
             "once (a second query would find the first one's answer nearer than the pair)",
             d->mqar_queries, d->mqar_pairs);
    if (span + 2L * q > room)
      REFUSE("data.mqar.pairs data.mqar.queries model.context",
             "data.mqar.pairs = %d with %d queries needs %s + 2*queries = %ld tokens, but a "
             "sample has model.context+1 = %ld",
             d->mqar_pairs, q, d->mqar_one_hop ? "pairs" : "2*pairs", span + 2L * q, room);
  }
  if (d->source == SOURCE_PASSKEY && d->passkey_one_hop && d->passkey_digits > PASSKEY_TAGGED)
    REFUSE("data.passkey.digits data.passkey.one_hop",
           "data.passkey.digits = %d: the one-hop form tags at most %d digits (set "
           "data.passkey.one_hop = false for more)",
           d->passkey_digits, PASSKEY_TAGGED);
  if (d->source == SOURCE_PASSKEY) {
    const long k = d->passkey_digits, need = d->passkey_one_hop ? 3 * k + 2 : 2 * k + 2;
    if (need > room)
      REFUSE("data.passkey.digits model.context",
             "data.passkey.digits = %ld needs %s = %ld tokens (the needle and the question), "
             "but a sample has model.context+1 = %ld",
             k, d->passkey_one_hop ? "3*digits+2" : "2*digits+2", need, room);
  }
  if (d->source == SOURCE_LISTOPS && d->listops_min_length + 2L > room)
    REFUSE("data.listops.min_length model.context",
           "data.listops.min_length = %d does not fit model.context = %d: an expression, '=' "
           "and its answer need min_length+2 = %ld of the context+1 tokens",
           d->listops_min_length, cfg->model.context, d->listops_min_length + 2L);
  return false;
}
