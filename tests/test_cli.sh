#!/bin/sh
# The command line and bad input (SPEC §2, §3, §10): every bad deck, missing data file, bad
# option or unwritable output gives one clear message and a non-zero status, on one rank and on
# several; nothing is written before the deck is valid.
. "$TESTDIR/tap.sh"
cd "$WORK" || exit 1
F="$FMATTN"
GOOD="$TESTDIR/decks/cli.in"

check "--version prints the version" sh -c "$F --version | grep -q '^fmattn '"
check "--help prints usage" sh -c "$F --help | grep -q 'fmattn DECK.in'"
check "--print-defaults lists every section" sh -c "$F --print-defaults > defaults.in && for s in run data model attention train output parallel gpu bench generate; do grep -q \"^\[\$s\]\" defaults.in || exit 1; done"
check "the printed defaults are a valid deck" "$F" --check defaults.in --set data.source=copy --set attention.variant=full
check "the README's deck reference is --print-defaults" sh -c "sed -n '/^\`\`\`ini\$/,/^\`\`\`\$/p' '$SRCDIR/README.md' | sed '1d;\$d' > readme_deck.in && $F --print-defaults | diff -u - readme_deck.in"
check "--check prints the resolved deck" sh -c "$F --check $GOOD | grep -q '^context = 16'"
check "--check writes nothing" sh -c "! test -e out"

printf '[trian]\nsteps = 3\n' > bad_section.in
expect_fail "unknown section names the nearest" "bad_section.in:1: unknown section [trian]; did you mean [train]?" "$F" bad_section.in
printf '[train]\nsteps = 3\nlerning_rate = 1e-3\n' > bad_key.in
expect_fail "misspelt key gets a suggestion with file:line" "bad_key.in:3: unknown key 'lerning_rate' in [train]; did you mean 'lr'?" "$F" bad_key.in
printf '[train]\nlr = fast\n' > bad_type.in
expect_fail "bad type says what was expected" "bad_type.in:2: train.lr = 'fast': expected a number > 0" "$F" bad_type.in
printf '[model]\ndropout = 1.5\n' > bad_range.in
expect_fail "out of range says the range" "bad_range.in:2: model.dropout = 1.5 is out of range: expected a number in [0, 1)" "$F" bad_range.in
printf '[model]\nposition = absolute\n' > bad_choice.in
expect_fail "bad choice lists the choices" "expected one of learned, sinusoidal, rope, none" "$F" bad_choice.in
printf '[model]\ndim = 30\nheads = 4\n' > bad_combo.in
expect_fail "inconsistent combination is refused" "model.dim = 30" "$F" bad_combo.in --set data.source=copy
printf '[data]\npath = no/such/file.txt\n' > no_data.in
expect_fail "missing data file" "data.path = 'no/such/file.txt': cannot open" "$F" no_data.in
expect_fail "missing deck" "cannot read deck 'absent.in'" "$F" absent.in
expect_fail "bad override" "did you mean" "$F" "$GOOD" --set train.stpes=4
many=""
for i in $(seq 70); do many="$many --set=train.steps=1"; done
expect_fail "more than 64 --set= options are refused" "too many --set options" "$F" "$GOOD" $many
expect_fail "unknown option" "unknown option '--frobnicate'" "$F" "$GOOD" --frobnicate
expect_fail "FiSH heads on a kernelized variant are refused with the reason" "composes with attention.variant = full or local" "$F" "$GOOD" --set attention.heads_mode=fish --set attention.variant=linear
expect_fail "nystrom: a slab that does not hold whole segments is refused" "must hold whole segments of model.context / nystrom.landmarks = 4 tokens" "$F" --check "$GOOD" --set model.objective=mlm --set attention.variant=nystrom --set attention.nystrom.landmarks=4 --set attention.nystrom.conv=3 --set parallel.seq_ranks=8
check "nothing was written by the failed runs" sh -c "! test -e out"

# the README's decks take any variant with one --set (nystrom, bidirectional only, refused in clm)
mkdir -p data && head -c 300000 /usr/share/common-licenses/GPL-3 > data/kjv.txt && truncate -s 100000000 data/enwik8 # sparse: the size enwik8.in splits
for deck in quickstart.in enwik8.in scaling/fma-64K.in scaling/fma-1M.in; do
  bad=""
  for v in full local linear fma fma_linear fmmformer rmfa; do
    "$F" --check "$SRCDIR/inputs/$deck" --set attention.variant=$v > /dev/null 2> check.err || bad="$bad $v($(tail -n 1 check.err))"
  done
  check "inputs/$deck takes every causal variant by one --set${bad:+:$bad}" test -z "$bad"
  expect_fail "inputs/$deck with nystrom: refused in clm, with the reason" "nystrom is bidirectional only" "$F" --check "$SRCDIR/inputs/$deck" --set attention.variant=nystrom
done

# a file in place of the output directory
touch blocker
expect_fail "unwritable output directory" "cannot write to output directory 'blocker/good'" "$F" "$GOOD" --set output.dir=blocker
# a checkpoint that is not HDF5, and one of another model
echo "not hdf5" > corrupt.h5
expect_fail "corrupt checkpoint" "corrupt.h5" "$F" "$GOOD" --set output.restart=corrupt.h5
expect_fail "restart latest without checkpoints" "holds no checkpoint" "$F" "$GOOD" --set output.dir=fresh --set output.restart=latest
check "a valid run writes a checkpoint" "$F" "$GOOD"
expect_fail "checkpoint of another model shape" "the model's is [256, 32]" "$F" "$GOOD" --set model.dim=32 --set output.restart=out/good/ckpt_000002.h5 --set run.name=other

# several ranks: one message, every rank exits non-zero, no hang
out=$("$MPI_RUN" 2 "$F" bad_key.in 2>&1); rc=$?
n=$(printf '%s\n' "$out" | grep -c "unknown key 'lerning_rate'")
if [ "$rc" -ne 0 ] && [ "$n" -eq 1 ]; then ok "2 ranks: one message and a non-zero status"; else not_ok "2 ranks: one message and a non-zero status (rc $rc, $n messages)" "$out"; fi
expect_fail "2 ranks: batch not divisible by replicas" "train.batch = 3 is not divisible" "$MPI_RUN" 2 "$F" "$GOOD" --set train.batch=3
expect_fail "3 ranks: seq_ranks must divide the world" "parallel.seq_ranks = 2 does not divide" "$MPI_RUN" 3 "$F" "$GOOD" --set parallel.seq_ranks=2

# a diverging run stops with a message and keeps its last good checkpoint
expect_fail "NaN loss stops the run" "training loss is" "$F" "$GOOD" --set run.name=nan --set train.lr=1e4 --set train.clip=0 --set train.warmup=0 --set train.steps=50 --set output.checkpoint_every=1 --set model.dropout=0
last=$(ls out/nan/ckpt_*.h5 2>/dev/null | tail -n 1)
check "the last good checkpoint survives a diverging run ($last)" sh -c "test -n '$last' && ${H5DUMP:-h5dump} -H '$last' > /dev/null && ! ls out/nan/*.tmp 2>/dev/null"
tap_done
