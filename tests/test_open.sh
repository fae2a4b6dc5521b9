#!/bin/sh
# fma.open end to end (SPEC §6.4a): a training run writes the opening's diagnostics to diag.h5 and
# eval.h5 (the layouts; level mass and opened-token mass add up to 1; at most K windows a level),
# plot_run.py draws opening.png, a restart continues bit for bit, the bench times fma at every
# value of bench.fma_open (attention and comm rows, the opened windows' bytes counted), and bad
# settings are refused with one message before anything is written. The numerical ladder is
# test_fma_open, test_seq and test_seqtrain.sh.
. "$TESTDIR/tap.sh"
need_h5py
cd "$WORK" || exit 1
F="$FMATTN"
D="$TESTDIR/decks/seq_parallel.in"
O="--set attention.fma.open=2"

check "fma.open = 2 trains" "$F" "$D" --set run.name=o2 $O
check "diag.h5 of an fma.open run has the SPEC layout" py "$TESTDIR/h5check.py" diag out/o2/diag.h5
check "diag.h5: open_mass [records, layers, heads], opened [records, layers, levels]; the shares add up to 1, at most 2 windows a level" py -c "
import h5py, numpy as np, sys
a = h5py.File('out/o2/diag.h5')['attention']
lm, om, op = a['level_mass'][...], a['open_mass'][...], a['opened'][...]
R, L, H, B = lm.shape
ok = om.shape == (R, L, H) and op.shape == (R, L, B - 1) and R >= 2
ok = ok and np.allclose(lm.sum(-1) + om, 1, atol=1e-5) and (om > 0).all()
ok = ok and (op >= 0).all() and (op <= 2 + 1e-9).all() and (op > 0).any()
ok = ok and all('units' in a[k].attrs or 'description' in a[k].attrs for k in ('open_mass', 'opened'))
sys.exit(0 if ok else 1)"
check "eval mode of an fma.open run" "$F" "$D" --set run.name=o2 $O --set run.mode=eval --set output.restart=latest
check "eval.h5 holds open_mass and opened" py -c "
import h5py, numpy as np, sys
a = h5py.File('out/o2/eval.h5')['attention']
ok = a['open_mass'].shape == a['entropy'].shape and a['opened'].shape[0] == a['entropy'].shape[0]
ok = ok and np.allclose(a['level_mass'][...].sum(-1) + a['open_mass'][...], 1, atol=1e-5)
sys.exit(0 if ok else 1)"
check "plot_run.py draws opening.png" sh -c "'${PYTHON3:-/usr/bin/python3}' '$SRCDIR/scripts/plot_run.py' out/o2 -o plots > /dev/null && test -s plots/opening.png && test -s plots/attention_mass.png"
check "a run without fma.open has no opening diagnostics" sh -c "'$F' '$D' --set run.name=o0 > o0.log 2>&1 && '${PYTHON3:-/usr/bin/python3}' -c \"
import h5py, sys
sys.exit(1 if 'open_mass' in h5py.File('out/o0/diag.h5')['attention'] else 0)\""

# a restart continues bit for bit on its layout (2 sequence ranks, dropout on): what a query
# opens is a function of the restored parameters and the data, nothing else
R="--set parallel.seq_ranks=2 --set output.checkpoint_every=5 --set output.diag_every=5"
check "S = 2: 10 steps straight" "$MPI_RUN" 2 "$F" "$D" --set run.name=straight $O $R
mkdir -p out/resumed && cp out/straight/ckpt_000005.h5 out/resumed/
check "S = 2: resumed from step 5" "$MPI_RUN" 2 "$F" "$D" --set run.name=resumed --set output.restart=latest $O $R
check "resumed losses and validation equal the uninterrupted run bit for bit" sh -c "'${PYTHON3:-/usr/bin/python3}' '$TESTDIR/h5check.py' same-series out/straight/diag.h5 out/resumed/diag.h5 train 5 0 && '${PYTHON3:-/usr/bin/python3}' '$TESTDIR/h5check.py' same-series out/straight/diag.h5 out/resumed/diag.h5 eval 5 0"
check "resumed final parameters and moments are identical" py "$TESTDIR/h5check.py" same-tensors out/straight/ckpt_000010.h5 out/resumed/ckpt_000010.h5 0

# the bench: fma at fma.open = 0, 1, 2 beside full, one run
B="--set run.mode=bench --set bench.n_list=128 --set bench.repeats=1"
check "bench: fma at bench.fma_open = 0,1,2" "$F" "$D" --set run.name=b $B --set bench.what=attention --set bench.variants=fma,full --set bench.fma_open=0,1,2
check "bench.h5: one fma row per fma.open, an open column" py -c "
import h5py, numpy as np, sys
a = h5py.File('out/b/bench.h5')['attention']
v = [x.decode() for x in a['variant'][...]]
ok = v == ['fma', 'fma', 'fma', 'full'] and list(a['open'][...]) == [0, 1, 2, 0]
ok = ok and (a['fwd_ms'][...] > 0).all() and 'units' in a['open'].attrs
sys.exit(0 if ok else 1)"
check "bench comm on 2 sequence ranks: fma at fma.open = 0 and 2" "$MPI_RUN" 2 "$F" "$D" --set run.name=bc $B --set bench.what=comm --set bench.variants=fma --set bench.fma_open=0,2 --set parallel.seq_ranks=2
check "bench.h5: the opened windows' and blocks' bytes are counted" py -c "
import h5py, sys
c = h5py.File('out/bc/bench.h5')['comm']
o, b = list(c['open'][...]), list(c['bytes_per_rank_per_layer'][...])
sys.exit(0 if o == [0, 2] and b[1] > b[0] > 0 else 1)"

# refusals: one message, nothing written
expect_fail "fma.open = -2 is refused" "attention.fma.open = '-2': expected an integer >= 0, or all" "$F" "$D" --set run.name=bad1 --set attention.fma.open=-2
expect_fail "fma.open with fma_linear is refused" "fma_linear normalises each level on its own and has no opening" "$F" "$D" --set run.name=bad2 --set attention.variant=fma_linear $O
expect_fail "fma.open = all at context 16384 is refused" "it is exact attention at O(n^2) cost" "$F" "$D" --set run.name=bad3 --set model.context=16384 --set attention.fma.open=all
check "nothing was written for the refused runs" sh -c "! ls out/bad1 out/bad2 out/bad3 2>/dev/null | grep -q ."
tap_done
