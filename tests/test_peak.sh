#!/bin/sh
# Per-rank memory does not grow with the number of sequence ranks at fixed tokens per rank
# (issue 53): one training step at 512 tokens per rank on S = 1, 2, 4, 8 and 16 ranks (n = 512·S),
# for fma and fma_linear with m2m summaries, and diag.h5's /memory/peak_bytes (labelled bytes,
# max over ranks) within 10 % of one rank's. The summary rows are indexed by the windows a rank
# touches (fma_state_compact); before that they covered the whole tree and the same runs grew by
# 32 % (fma) and 46 % (fma_linear) at S = 16. What still grows: the near field's halo copies of
# k and v (O(n/S), absent on one rank) and the spanning levels' O(S) windows. The deck keeps
# nothing else that grows with n: rotary positions (learned ones are an (n, C) parameter) and
# m2m (a conv level's weights read all w_l taps of its window, so conv's parameters grow with n).
. "$TESTDIR/tap.sh"
need_h5py
cd "$WORK" || exit 1
D="$TESTDIR/decks/seq_parallel.in"
for v in fma fma_linear; do
  for S in 1 2 4 8 16; do
    check "$v: one step of 512 tokens per rank on $S sequence ranks" "$MPI_RUN" "$S" "$FMATTN" "$D" \
      --set run.name="${v}_$S" --set attention.variant="$v" --set parallel.seq_ranks="$S" \
      --set model.context=$((512 * S)) --set model.position=rope --set model.layers=4 \
      --set train.steps=1 --set train.batch=1 --set train.eval_every=0 \
      --set output.checkpoint_every=0 --set output.diag_every=1
  done
  check "$v: peak labelled bytes per rank at S = 2, 4, 8, 16 within 10 % of S = 1's" py -c "
import h5py, sys
peak = {S: float(h5py.File('out/${v}_%d/diag.h5' % S)['/memory/peak_bytes'][-1])
        for S in (1, 2, 4, 8, 16)}
print({S: '%.3f' % (peak[S] / peak[1]) for S in peak})
sys.exit(0 if all(0 < peak[S] <= 1.10 * peak[1] for S in peak) else 1)"
done
tap_done
