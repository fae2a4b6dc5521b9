#!/bin/sh
# fmattn against an independent implementation: a PyTorch (float64) model loads fmattn's
# checkpoint and recomputes the validation loss over the evaluation windows of SPEC §4; the two
# agree within 1e-5 relative, for each position kind and for an untied head. Data: the KJV text.
. "$TESTDIR/tap.sh"
need_h5py
cd "$WORK" || exit 1
F="$FMATTN"
if ! py -c "import torch" 2>/dev/null; then
  not_ok "python3-torch is installed (scripts/install-deps.sh installs it)"
  tap_done; exit 1
fi
check "KJV corpus" "$SRCDIR/scripts/get_kjv.sh" kjv.txt
REF="$TESTDIR/decks/reference.in"

for variant in learned sinusoidal rope none untied; do
  if [ "$variant" = untied ]; then extra="--set model.tie_embeddings=false"; position=learned
  else extra=""; position=$variant; fi
  check "train 30 steps ($variant)" "$F" "$REF" --set run.name=$variant --set model.position=$position $extra
  ours=$(py "$TESTDIR/h5check.py" value out/$variant/diag.h5 /eval/valid_loss)
  theirs=$(py "$TESTDIR/torch_reference.py" out/$variant/ckpt_000030.h5 kjv.txt)
  check "$variant: valid loss $ours equals PyTorch's $theirs within 1e-5" py -c "import sys; sys.exit(0 if abs($ours - $theirs) <= 1e-5 * abs($theirs) else 1)"
done
tap_done
