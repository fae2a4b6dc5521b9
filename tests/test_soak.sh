#!/bin/sh
# Long-run soak: a run stopped by SIGUSR1 every EVERY steps and resumed each time from latest (a
# SLURM --requeue loop) ends where the uninterrupted run ends, every logged loss, validation and test
# loss and final tensor bit for bit. Default: a small fma model, 200 steps, a signal every 20;
# SOAK=1: the quickstart deck, 2,000 steps, every 200 (about 10 minutes on 2 cores; data/kjv.txt).
. "$TESTDIR/tap.sh"
need_h5py
cd "$WORK" || exit 1
F="$FMATTN"
H5C="$TESTDIR/h5check.py"
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1

if [ "${SOAK:-0}" = 1 ]; then
  if [ ! -s "$SRCDIR/data/kjv.txt" ]; then
    ok "soak # SKIP SOAK=1 trains the quickstart on data/kjv.txt: run scripts/get_kjv.sh first"
    tap_done
    exit 0
  fi
  ln -s "$SRCDIR/data" data
  DECK="$SRCDIR/inputs/quickstart.in"
  STEPS=2000 EVERY=200
  # every step logged: a resumed run always logs its first step, which a run logging every 10
  # would have skipped, and the comparison below is record for record
  ARGS="--set train.steps=$STEPS --set output.log_every=1 --set output.checkpoint_every=400"
else
  DECK="$TESTDIR/decks/soak.in"
  STEPS=200 EVERY=20
  ARGS="--set train.steps=$STEPS --set output.log_every=1"
fi
# The uninterrupted run, on the other core while the interrupted one goes through its segments.
# shellcheck disable=SC2086 # ARGS is a list of words
"$F" "$DECK" $ARGS --set run.name=straight > straight.log 2>&1 &
straight=$!

# The interrupted run: start, wait for the step, SIGUSR1, wait for the exit, resume from latest.
seg=0 target=$EVERY restart="" finished=0 bad=""
while [ "$seg" -lt $((2 * STEPS / EVERY + 5)) ]; do
  seg=$((seg + 1))
  : > "seg$seg.log"
  # shellcheck disable=SC2086
  "$F" "$DECK" $ARGS --set run.name=soak $restart > "seg$seg.log" 2>&1 &
  pid=$!
  while kill -0 "$pid" 2>/dev/null && ! grep -q "step $target/$STEPS " "seg$seg.log"; do sleep 0.05; done
  kill -USR1 "$pid" 2>/dev/null
  wait "$pid"
  rc=$?
  restart="--set output.restart=latest"
  [ "$rc" -eq 0 ] || bad="$bad segment $seg ended with status $rc;"
  [ "$seg" -eq 1 ] || grep -q "restarting from runs/soak/ckpt_" "seg$seg.log" || bad="$bad segment $seg did not restart;"
  if grep -q "^.*test  step $STEPS " "seg$seg.log"; then finished=1; break; fi
  grep -q "writing a checkpoint at step" "seg$seg.log" || bad="$bad segment $seg did not stop on SIGUSR1;"
  last=$(sed -n 's/.*writing a checkpoint at step \([0-9]*\).*/\1/p' "seg$seg.log" | tail -n 1)
  target=$(( ${last:-$target} + EVERY ))
  [ "$target" -lt "$STEPS" ] || target=$STEPS
done
wait "$straight"
rc=$?
if [ "$rc" -eq 0 ]; then ok "the uninterrupted run"; else not_ok "the uninterrupted run (status $rc)" "$(tail -n 5 straight.log)"; fi
stops=$((seg - 1))
if [ "$finished" = 1 ] && [ -z "$bad" ] && [ "$stops" -ge $((STEPS / EVERY / 3)) ]; then
  ok "$STEPS steps in $seg segments: stopped by SIGUSR1 $stops times, resumed from latest each time"
else
  not_ok "$STEPS steps with a SIGUSR1 every $EVERY (finished $finished, $seg segments):$bad" "$(tail -n 5 "seg$seg.log")"
fi
check "every logged loss and gradient norm equals the uninterrupted run's, bit for bit" \
  py "$H5C" same-series runs/straight/diag.h5 runs/soak/diag.h5 train 0 0
check "every validation loss equals the uninterrupted run's, bit for bit" \
  py "$H5C" same-series runs/straight/diag.h5 runs/soak/diag.h5 eval 0 0
check "the test loss equals the uninterrupted run's, bit for bit" \
  py "$H5C" same-series runs/straight/diag.h5 runs/soak/diag.h5 test 0 0
check "and its log line is the same" sh -c \
  "grep -o 'test loss .*' straight.log > a && grep -o 'test loss .*' 'seg$seg.log' > b && test -s a && cmp a b"
check "the final checkpoint equals the uninterrupted run's, every tensor bit for bit" \
  py "$H5C" same-tensors "runs/soak/ckpt_$(printf %06d "$STEPS").h5" "runs/straight/ckpt_$(printf %06d "$STEPS").h5" 0
tap_done
