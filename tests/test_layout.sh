#!/bin/sh
# The house's rules (docs/architecture.md): src/'s folders include one another without a circle
# (a planted circle is caught); src/fma/ never sees the deck, src/tasks/ reads it only in its
# set-up (options.c), and no attention implementation reaches the deck through its context.
. "$TESTDIR/tap.sh"
cd "$WORK" || exit 1
check "src/'s folders include one another without a circle" py "$TESTDIR/include_graph.py" "$SRCDIR/src"
mkdir -p planted/low planted/high
printf '#include "high/b.h"\n' > planted/low/a.h
printf '#include "low/a.h"\n' > planted/high/b.h
expect_fail "a planted circle is reported" "circle: high -> low" py "$TESTDIR/include_graph.py" planted
# none "what" grep-args...: ok when grep finds nothing
none() {
  what="$1"; shift
  if out=$(grep -n "$@"); then not_ok "$what" "$out"; else ok "$what"; fi
}
none "src/fma/ does not read the deck" -e 'cfg->' -e '#include "deck/' "$SRCDIR"/src/fma/*.[ch]
for f in "$SRCDIR"/src/tasks/*.c; do [ "${f##*/}" = options.c ] || set -- "$@" "$f"; done
none "src/tasks/ reads the deck only in options.c" -e 'cfg->' "$@"
none "no attention implementation reaches the deck through its context" -e 'ctx->cfg' -e 'ctx\.cfg' \
  "$SRCDIR"/src/attention/*.c "$SRCDIR"/gpu/*.cu "$SRCDIR"/src/run/*.c
tap_done
