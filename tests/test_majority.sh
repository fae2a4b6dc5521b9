#!/bin/sh
# Training on the majority task (SPEC §4), whose answers lie beyond the near field: fma clearly
# beats a near-field-only model (`local` with a band of 2m, at least fma's near field) and
# approaches `full`. A far copy would not be a fair test: fma's far field is coarse by design;
# a majority is exactly what coarse summaries carry.
. "$TESTDIR/tap.sh"
need_h5py
cd "$WORK" || exit 1
F="$FMATTN"
MAJ="$TESTDIR/decks/majority.in"

for v in full fma local; do
  check "$v trains on the majority task" "$F" "$MAJ" --set attention.variant=$v --set run.name=$v
done
full=$(py "$TESTDIR/h5check.py" value out/full/diag.h5 /eval/valid_loss)
fma=$(py "$TESTDIR/h5check.py" value out/fma/diag.h5 /eval/valid_loss)
loc=$(py "$TESTDIR/h5check.py" value out/local/diag.h5 /eval/valid_loss)
echo "# valid loss (nats): full $full, fma $fma, local $loc (chance ln 2 = 0.693)"
check "the task needs the far field: local stays poor ($loc > 0.3)" py -c "import sys; sys.exit(0 if $loc > 0.3 else 1)"
check "fma clearly beats local ($fma < local / 2)" py -c "import sys; sys.exit(0 if $fma < $loc / 2 else 1)"
check "fma approaches full ($fma < full + 0.15)" py -c "import sys; sys.exit(0 if $fma < $full + 0.15 else 1)"
check "fma's diagnostics put attention mass on the far levels" py -c "
import h5py, sys
m = h5py.File('out/fma/diag.h5')['/attention/level_mass'][-1]
sys.exit(0 if m[..., 1:].sum(axis=-1).mean() > 0.05 else 1)"
check "the fma checkpoint holds the downsampling tensors under SPEC 8.2 names" py -c "
import h5py, sys
f = h5py.File('out/fma/ckpt_000400.h5')
want = {'k_down/level_01/weight': (32, 4, 16), 'k_down/level_03/weight': (32, 4, 64),
        'v_down/level_02/bias': (32, 4)}
for name, shape in want.items():
    for prefix in ('/model/', '/optimizer/m/', '/optimizer/v/'):
        path = prefix + 'layer_001/attn/fma/' + name
        if path not in f or f[path].shape != shape:
            sys.exit(path + ' missing or misshapen')"
tap_done
