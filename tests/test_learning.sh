#!/bin/sh
# The kernelized variants learn (issue 9): on the majority task (the answer is a statistic of
# everything before, which a far field carries) and on the copy task (an exact copy 16 tokens
# back), linear, fmmformer and rmfa each get at least 2/3 of the margin below chance that `full`
# reaches in the same test, and full itself must get below a quarter of chance. Full trains for
# 600 steps on copy; the kernelized variants get 2000 (copying through a low-rank far field is
# slow to learn, as the FMMformer paper's copy experiments show). fmmformer's band (4) is shorter
# than the copy distance, so its far field has to carry the copy; it uses the paper's three
# kernels: with elu alone it stays on a plateau near chance for 2000 steps here
# (docs/kernelized.md). Two runs at a time, one thread each.
. "$TESTDIR/tap.sh"
cd "$WORK" || exit 1
F="$FMATTN"

cat > maj.in <<'DECK'
[run]
name = maj
[data]
source = majority
symbols = 2
[model]
layers = 2
dim = 64
heads = 2
context = 256
dropout = 0
[attention]
fmmformer.band = 16
rmfa.features = 64
[train]
steps = 400
batch = 16
lr = 3e-3
warmup = 20
eval_every = 0
eval_windows = 256
[output]
dir = out
log_every = 100
diag_every = 200
checkpoint_every = 0
DECK

cat > copy.in <<'DECK'
[run]
name = copy
[data]
source = copy
symbols = 8
[model]
layers = 2
dim = 64
heads = 2
context = 32
dropout = 0
[attention]
full.block = 16
fmmformer.band = 4
fmmformer.kernels = elu,elu_neg,tanh
[train]
steps = 2000
batch = 32
lr = 3e-3
warmup = 20
eval_every = 0
eval_windows = 8
[output]
dir = out
log_every = 200
diag_every = 0
checkpoint_every = 0
DECK

train() { # task variant [settings...]: one run into out/<task>-<variant>, its status in .rc
  task=$1 v=$2
  shift 2
  "$F" "$task.in" --set attention.variant="$v" --set run.name="$task-$v" "$@" > "$task-$v.log" 2>&1
  echo $? > "$task-$v.rc"
}
train maj full & train maj linear & wait
train maj fmmformer & train maj rmfa & wait
train copy full --set train.steps=600 & train copy linear & wait
train copy fmmformer & train copy rmfa & wait

for task in maj copy; do
  if [ "$task" = maj ]; then chance=0.6931; else chance=2.0794; fi # ln 2, ln 8
  for v in full linear fmmformer rmfa; do
    if [ "$(cat "$task-$v.rc")" != 0 ]; then
      not_ok "$task: $v trains" "$(tail -n 5 "$task-$v.log")"
    else
      ok "$task: $v trains"
    fi
  done
  full=$(py "$TESTDIR/h5check.py" value "out/$task-full/diag.h5" /eval/valid_loss)
  # the yardstick itself must have learnt, or 2/3 of its margin would ask for nothing
  check "$task: full learns the task (valid loss $full <= chance/4 = $chance/4)" \
    py -c "import sys; sys.exit(0 if $full <= $chance / 4 else 1)"
  for v in linear fmmformer rmfa; do
    loss=$(py "$TESTDIR/h5check.py" value "out/$task-$v/diag.h5" /eval/valid_loss)
    echo "# $task: valid loss $v $loss, full $full, chance $chance"
    check "$task: $v gets 2/3 of full's margin below chance ($loss <= $chance - 2/3 ($chance - $full))" \
      py -c "import sys; sys.exit(0 if $loss <= $chance - 2 / 3 * ($chance - $full) else 1)"
  done
done
check "linear's attention diagnostics are recorded" py -c "
import h5py, numpy as np, sys
m = h5py.File('out/maj-linear/diag.h5')['/attention/level_mass'][-1]
sys.exit(0 if np.allclose(m.sum(axis=-1), 1, atol=1e-4) and m[..., 1:].sum() > 0 else 1)"
tap_done
