#!/bin/sh
# End to end on one rank: a short run learns the copy task; diag.h5 and checkpoints have the
# layouts of SPEC §8; a restart continues bit for bit; SIGTERM writes a checkpoint and stops
# cleanly; eval and generate modes run from a checkpoint; rmfa (random features) restarts bit for
# bit from its stored features.
. "$TESTDIR/tap.sh"
need_h5py
cd "$WORK" || exit 1
F="$FMATTN"
COPY="$TESTDIR/decks/copy.in"

check "the copy task trains" "$F" "$COPY"
loss=$(py "$TESTDIR/h5check.py" value out/copy/diag.h5 /test/loss)
# chance is ln 8 = 2.079 nats on the copy half
check "copy-half test loss $loss is far below chance (< 0.3 ln 8)" py -c "import sys, math; sys.exit(0 if $loss < 0.3 * math.log(8) else 1)"
check "diag.h5 has the layout of SPEC 8.1" py "$TESTDIR/h5check.py" diag out/copy/diag.h5
check "the checkpoint has the layout of SPEC 8.2" py "$TESTDIR/h5check.py" ckpt out/copy/ckpt_000600.h5
check "h5dump shows the checkpoint tensors" sh -c "${H5DUMP:-h5dump} -H out/copy/ckpt_000600.h5 | grep -q 'DATASET \"wqkv\"'"
check "checkpoints at cadence and at the end" test -s out/copy/ckpt_000300.h5

# eval mode reproduces the final validation loss from the checkpoint
"$F" "$COPY" --set run.mode=eval --set output.restart=out/copy/ckpt_000600.h5 > eval.log 2>&1
ev=$(sed -n 's/.*valid loss \([0-9.]*\).*/\1/p' eval.log | head -n 1)
trained=$(py "$TESTDIR/h5check.py" value out/copy/diag.h5 /eval/valid_loss)
check "eval mode gives the training run's final valid loss ($ev vs $trained)" py -c "import sys; sys.exit(0 if abs($ev - $trained) < 5e-5 else 1)"
check "generate mode samples bytes" sh -c "'$F' '$COPY' --set run.mode=generate --set output.restart=latest --set generate.length=16 --set 'generate.prompt=abc' > gen.log 2>&1 && grep -q '^abc' gen.log"

# restart bit for bit: 40 steps straight, and 20 + 20 from the step-20 checkpoint (dropout on)
common="--set train.steps=40 --set model.dropout=0.1 --set output.checkpoint_every=20 --set output.log_every=1 --set train.eval_every=10 --set output.diag_every=0"
check "uninterrupted 40-step run" "$F" "$COPY" $common --set run.name=straight
mkdir -p out/resumed && cp out/straight/ckpt_000020.h5 out/resumed/
check "run resumed from step 20" "$F" "$COPY" $common --set run.name=resumed --set output.restart=latest
check "resumed losses equal the uninterrupted run bit for bit" py "$TESTDIR/h5check.py" same-series out/straight/diag.h5 out/resumed/diag.h5 train 20 0
check "resumed validation equals the uninterrupted run bit for bit" py "$TESTDIR/h5check.py" same-series out/straight/diag.h5 out/resumed/diag.h5 eval 20 0
check "resumed final parameters and moments are identical" py "$TESTDIR/h5check.py" same-tensors out/straight/ckpt_000040.h5 out/resumed/ckpt_000040.h5 0

# full reads q, k, v in place from the q|k|v product (model.heads_in_place): losses, attention
# diagnostics and the final tensors are those of the head split and merge copies, bit for bit
inplace="$common --set train.steps=20 --set output.diag_every=5"
check "heads in place: 20-step run with diagnostics" "$F" "$COPY" $inplace --set run.name=in-place
check "heads copied (FMATTN_HEAD_COPIES=1): the same run" env FMATTN_HEAD_COPIES=1 "$F" "$COPY" $inplace --set run.name=copied
for g in train eval attention; do
  check "heads in place: the $g series equal the copies' bit for bit" py "$TESTDIR/h5check.py" same-series out/in-place/diag.h5 out/copied/diag.h5 $g 0 0
done
check "heads in place: the final parameters and moments equal the copies'" py "$TESTDIR/h5check.py" same-tensors out/in-place/ckpt_000020.h5 out/copied/ckpt_000020.h5 0

# rmfa restarts bit for bit too: its random features come back from the checkpoint (frozen
# tensors attn/rmfa/{degree, omega}), not from a new draw
rm="$common --set attention.variant=rmfa --set attention.rmfa.features=16"
check "rmfa: uninterrupted 40-step run" "$F" "$COPY" $rm --set run.name=rm-straight
mkdir -p out/rm-resumed && cp out/rm-straight/ckpt_000020.h5 out/rm-resumed/
check "rmfa: run resumed from step 20" "$F" "$COPY" $rm --set run.name=rm-resumed --set output.restart=latest
check "rmfa: resumed losses equal the uninterrupted run bit for bit" py "$TESTDIR/h5check.py" same-series out/rm-straight/diag.h5 out/rm-resumed/diag.h5 train 20 0
check "rmfa: resumed final parameters, moments and features are identical" py "$TESTDIR/h5check.py" same-tensors out/rm-straight/ckpt_000040.h5 out/rm-resumed/ckpt_000040.h5 0
check "rmfa: the checkpoint holds the frozen features under attn/rmfa/" py -c "
import h5py, numpy as np, sys
f = h5py.File('out/rm-straight/ckpt_000040.h5')
d, w = f['/model/layer_001/attn/rmfa/degree'][...], f['/model/layer_001/attn/rmfa/omega'][...]
ok = d.shape == (16,) and d[0] == 0 and w.shape == (int(d.sum()), 32) and set(np.unique(w)) == {-1.0, 1.0}
ok = ok and np.array_equal(d, f['/model/layer_000/attn/rmfa/degree'][...])
ok = ok and not np.array_equal(w, f['/model/layer_000/attn/rmfa/omega'][...])
sys.exit(0 if ok else 1)"
# a checkpoint whose stored degrees were altered is refused, not used (its checksum rewritten to
# match, so that the degrees' own validation is what refuses it)
cp out/rm-straight/ckpt_000040.h5 bad_features.h5
py -c "
import h5py, zlib
with h5py.File('bad_features.h5', 'r+') as f:
    d = f['/model/layer_000/attn/rmfa/degree']
    d[1] = 2.5
    d.attrs['crc32'] = zlib.crc32(d[...].tobytes())"
expect_fail "rmfa: a checkpoint with corrupt features is refused" "not a whole number" "$F" "$COPY" $rm --set run.name=rm-bad --set output.restart=bad_features.h5
# the Rademacher vectors are read back too, not drawn again from the seed: a restart from a copy
# whose layer-0 omega has its first column negated (still ±1; negating whole rows would not do, a
# feature's sign cancels in Φ(q)·Φ(k)) carries that omega to its next checkpoint, and its losses
# leave the uninterrupted run's
mkdir -p out/rm-flip && cp out/rm-straight/ckpt_000020.h5 out/rm-flip/
py -c "
import h5py, zlib
with h5py.File('out/rm-flip/ckpt_000020.h5', 'r+') as f:
    w = f['/model/layer_000/attn/rmfa/omega']
    x = w[...]
    x[:, 0] = -x[:, 0]
    w[...] = x
    w.attrs['crc32'] = zlib.crc32(w[...].tobytes())"
check "rmfa: a run resumed from altered omega" "$F" "$COPY" $rm --set run.name=rm-flip --set output.restart=latest
check "rmfa: omega comes from the checkpoint: the altered one is carried on, the losses differ" py -c "
import h5py, numpy as np, sys
a = h5py.File('out/rm-straight/ckpt_000040.h5')['/model/layer_000/attn/rmfa/omega'][...]
b = h5py.File('out/rm-flip/ckpt_000040.h5')['/model/layer_000/attn/rmfa/omega'][...]
def after20(path):
    t = h5py.File(path)['/train']
    return {int(s): l for s, l in zip(t['step'][...], t['loss'][...]) if s > 20}
la, lb = after20('out/rm-straight/diag.h5'), after20('out/rm-flip/diag.h5')
differ = sum(la[s] != lb[s] for s in la if s in lb)
print('steps after 20 whose loss differs:', differ)
a[:, 0] = -a[:, 0]
sys.exit(0 if np.array_equal(b, a) and len(lb) == 20 and differ > 0 else 1)"

# FiSH heads with training noise restart bit for bit too (the noise is keyed by the step), and a
# checkpoint of FiSH heads is refused by a deck of standard heads
fi="$common --set attention.heads_mode=fish --set attention.fish.noise=0.5"
check "fish: uninterrupted 40-step run" "$F" "$COPY" $fi --set run.name=fi-straight
mkdir -p out/fi-resumed && cp out/fi-straight/ckpt_000020.h5 out/fi-resumed/
check "fish: run resumed from step 20" "$F" "$COPY" $fi --set run.name=fi-resumed --set output.restart=latest
check "fish: resumed losses equal the uninterrupted run bit for bit" py "$TESTDIR/h5check.py" same-series out/fi-straight/diag.h5 out/fi-resumed/diag.h5 train 20 0
check "fish: the checkpoint holds attn/fish/mix [H, G] and wqkv [(2G + H) d, C]" py -c "
import h5py, sys
f = h5py.File('out/fi-straight/ckpt_000040.h5')
ok = f['/model/layer_000/attn/fish/mix'].shape == (2, 1) and f['/model/layer_000/attn/wqkv'].shape == (4 * 32, 64)
sys.exit(0 if ok and f.attrs['heads_mode'] in (b'fish', 'fish') else 1)"
expect_fail "a FiSH checkpoint is refused by a deck of standard heads" "heads_mode = fish, but the deck asks for standard" "$F" "$COPY" $common --set run.name=fi-std --set output.restart=out/fi-straight/ckpt_000040.h5

# SIGTERM (SLURM pre-emption): checkpoint at the current step, exit 0, resume with latest
"$F" "$COPY" --set run.name=sig --set train.steps=1000000 --set output.log_every=1 --set output.checkpoint_every=0 > sig.log 2>&1 &
pid=$!
i=0
while [ $i -lt 300 ] && ! grep -q "step 5/" sig.log; do sleep 0.1; i=$((i + 1)); done
kill -TERM $pid
wait $pid
rc=$?
check "SIGTERM stops the run with status 0 (was $rc)" test "$rc" -eq 0
check "SIGTERM writes a checkpoint" sh -c "grep -q 'received signal 15' sig.log && ls out/sig/ckpt_*.h5 > /dev/null"
stop=$(ls out/sig/ckpt_*.h5 | sed 's/.*ckpt_0*\([0-9]*\)\.h5/\1/' | tail -n 1)
check "the run resumes after SIGTERM from step $stop" sh -c "'$F' '$COPY' --set run.name=sig --set train.steps=$((stop + 3)) --set output.restart=latest --set output.log_every=1 > resume.log 2>&1 && grep -q 'step $((stop + 3))/$((stop + 3))' resume.log"
check "diag.h5 series continue without duplicates after the restart" py "$TESTDIR/h5check.py" diag out/sig/diag.h5
tap_done
