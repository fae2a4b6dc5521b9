/* The registry of attention variants: one X(name) line per variant, in the order decks and help
 * texts list them. attention.c turns it into the table of ops tables (attention_<name>), the deck
 * module into the words attention.variant and bench.variants accept; it lives with the deck,
 * which sits below the variants it names. Adding a variant is a new file under src/attention/
 * defining `struct attn_variant attention_<name>`, and one line here. */
#ifndef FMATTN_DECK_VARIANTS_H
#define FMATTN_DECK_VARIANTS_H

#define ATTENTION_REGISTRY(X) \
  X(full)                     \
  X(local)                    \
  X(linear)                   \
  X(fma)                      \
  X(fma_linear)               \
  X(fmmformer)                \
  X(nystrom)                  \
  X(rmfa)

#endif
