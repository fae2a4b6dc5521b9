#!/bin/sh
# Distributed runs against the 1-rank result (SPEC §7): data parallelism over 2 and 4 ranks with
# the same global batch gives the same losses and gradient norms within 1e-5 relative, and a
# checkpoint written by 2 ranks restarts on 1 rank with the same losses within rounding.
. "$TESTDIR/tap.sh"
need_h5py
cd "$WORK" || exit 1
F="$FMATTN"
DP="$TESTDIR/decks/data_parallel.in"

check "1 rank" "$MPI_RUN" 1 "$F" "$DP" --set run.name=r1
check "2 ranks, data parallel" "$MPI_RUN" 2 "$F" "$DP" --set run.name=r2
check "4 ranks, data parallel (oversubscribed)" "$MPI_RUN" 4 "$F" "$DP" --set run.name=r4
for r in 2 4; do
  check "$r ranks: training losses and gradient norms equal 1 rank within 1e-5" py "$TESTDIR/h5check.py" same-series out/r1/diag.h5 out/r$r/diag.h5 train 0 1e-5
  check "$r ranks: validation losses equal 1 rank within 1e-5" py "$TESTDIR/h5check.py" same-series out/r1/diag.h5 out/r$r/diag.h5 eval 0 1e-5
  check "$r ranks: final parameters equal 1 rank within 1e-4" py "$TESTDIR/h5check.py" same-params out/r1/ckpt_000012.h5 out/r$r/ckpt_000012.h5 1e-4
done
check "diag.h5 of a 2-rank run has the SPEC layout" py "$TESTDIR/h5check.py" diag out/r2/diag.h5

mkdir -p out/x1 && cp out/r2/ckpt_000006.h5 out/x1/
check "a 2-rank checkpoint restarts on 1 rank" "$MPI_RUN" 1 "$F" "$DP" --set run.name=x1 --set output.restart=latest
check "restarted on another layout: same losses within 1e-5" py "$TESTDIR/h5check.py" same-series out/r2/diag.h5 out/x1/diag.h5 train 6 1e-5
tap_done
