#!/bin/sh
# MLM end to end (SPEC §4, §5) for every bidirectional variant: full, local, fma, fma_linear,
# linear, fmmformer, rmfa, nystrom and FiSH heads on full and local train with model.objective =
# mlm (15 % of the bytes masked, the loss on the masked positions only) on a text whose every
# byte is fixed by its neighbours ("abcdefg" repeated; rope positions); eval mode on the final
# checkpoint reproduces the run's last validation loss (the same deterministic masks); generate
# refuses an mlm model. Every variant that can single out a neighbour learns the task to below
# half of ln 7 (guessing among the 7 letters); linear and rmfa cannot, and are not asked to: their
# weights φ(q)·φ(k) are smooth in position (rope's relative rotation does not survive the feature
# map, and rmfa's ppSBN bounds every logit by 1/√d), which is why FMMformer adds a band. Their
# losses are printed. Two runs at a time, one thread each.
. "$TESTDIR/tap.sh"
cd "$WORK" || exit 1
F="$FMATTN"
py -c "open('abc.txt', 'w').write('abcdefg' * 5000)"

cat > mlm.in <<'DECK'
[run]
name = mlm
[data]
path = abc.txt
[model]
layers = 2
dim = 32
heads = 2
context = 64
dropout = 0
objective = mlm
position = rope
[attention]
fma.m = 8
fma.p = 2
local.band = 64
fmmformer.band = 8
nystrom.landmarks = 16
nystrom.conv = 5
rmfa.features = 32
full.block = 16
[train]
steps = 300
batch = 16
lr = 3e-3
warmup = 20
eval_every = 0
eval_windows = 8
[output]
dir = out
log_every = 100
diag_every = 100
checkpoint_every = 0
DECK

settings() { # the variant's --set options
  case $1 in
    fish) echo "--set attention.variant=full --set attention.heads_mode=fish" ;;
    fish-local) echo "--set attention.variant=local --set attention.heads_mode=fish --set attention.fish.mix=mlp" ;;
    *) echo "--set attention.variant=$1" ;;
  esac
}
train() { "$F" mlm.in --set run.name=$1 $(settings $1) > train-$1.log 2>&1; echo $? > $1.rc; }
for pair in "full local" "fma fma_linear" "linear fmmformer" "rmfa nystrom" "fish fish-local"; do
  set -- $pair
  train $1 & train $2 & wait
done

for v in full local fma fma_linear linear fmmformer rmfa nystrom fish fish-local; do
  if [ "$(cat $v.rc)" != 0 ]; then
    not_ok "$v: trains with model.objective = mlm" "$(tail -n 5 train-$v.log)"
    continue
  fi
  ok "$v: trains with model.objective = mlm"
  trained=$(py "$TESTDIR/h5check.py" value out/$v/diag.h5 /eval/valid_loss)
  "$F" mlm.in --set run.name=$v $(settings $v) --set run.mode=eval --set output.restart=latest > eval-$v.log 2>&1
  ev=$(sed -n 's/.*valid loss \([0-9.]*\).*/\1/p' eval-$v.log | head -n 1)
  check "$v: eval mode reproduces the final validation loss ($ev vs $trained)" py -c "import sys; sys.exit(0 if abs(float('$ev' or 'nan') - $trained) < 5e-5 else 1)"
  case $v in
    linear | rmfa) echo "# $v: masked-byte loss $trained nats (ln 7 = 1.946; not asserted, see above)" ;;
    *) check "$v: the masked bytes are learnt from their neighbours ($trained < ln 7 / 2)" py -c "import sys, math; sys.exit(0 if $trained < math.log(7) / 2 else 1)" ;;
  esac
done
expect_fail "generate mode refuses an mlm model" "needs a causal model" "$F" mlm.in --set run.name=full --set run.mode=generate --set output.restart=latest
tap_done
