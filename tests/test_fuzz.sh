#!/bin/sh
# The deck loader and the --set parser under libFuzzer with ASan + UBSan (tests/fuzz_deck.c): the
# regression inputs of tests/fuzz/ (hand-made hostile decks, and any input a fuzzing run ever
# crashed on) run once each, then a fuzzing run seeded with inputs/ (60 s; FUZZ_SECONDS=600 for the
# 10-minute run of docs/operations.md). Skipped where configure found no clang with libFuzzer.
. "$TESTDIR/tap.sh"
cd "$WORK" || exit 1
if [ -z "$FUZZ_DECK" ] || [ ! -x "$FUZZ_DECK" ]; then
  ok "deck fuzzing # SKIP no clang with libFuzzer (install clang and libclang-rt-14-dev, then configure)"
  tap_done
  exit 0
fi
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
# The seed decks name data files relative to the source tree.
[ -d "$SRCDIR/data" ] && ln -s "$SRCDIR/data" data

for input in "$SRCDIR"/tests/fuzz/*; do
  check "regression input $(basename "$input")" "$FUZZ_DECK" "$input"
done

# A dictionary of the deck's words: every section and key, from the program itself.
"$FMATTN" --print-defaults | sed -n 's/^\[\([a-z_.]*\)\]$/"[\1]"/p; s/^\([a-z_.]*\) = .*/"\1"/p' | sort -u > deck.dict
check "the dictionary holds the deck's keys" grep -q '"checkpoint_every"' deck.dict

mkdir corpus
secs="${FUZZ_SECONDS:-60}"
"$FUZZ_DECK" -max_total_time="$secs" -rss_limit_mb=2048 -timeout=10 -dict=deck.dict \
  -artifact_prefix="$WORK/" -print_final_stats=1 corpus "$SRCDIR/inputs" "$SRCDIR/tests/fuzz" > fuzz.log 2>&1
rc=$?
runs=$(sed -n 's/^stat::number_of_executed_units: *//p' fuzz.log)
if [ "$rc" -eq 0 ] && ! ls "$WORK"/crash-* "$WORK"/leak-* "$WORK"/timeout-* > /dev/null 2>&1; then
  ok "$secs s of fuzzing: $runs inputs, no crash, no leak, no undefined behaviour"
else
  not_ok "$secs s of fuzzing (status $rc): the input is kept in $WORK; run $FUZZ_DECK on it to reproduce, then add it to tests/fuzz/" \
    "$(tail -n 40 fuzz.log)"
fi
tap_done
