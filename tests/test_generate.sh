#!/bin/sh
# Generation with the decode caches (issue 11): cached and recomputed generation from a checkpoint
# give the same 300 bytes (several passes of the 64-byte context) and logits within 1e-4, for full,
# local, fma (also with fma.open = 2) and the running-sum variants; fma_linear, without a cache, says so and recomputes;
# prompt files, samples, generate.txt, the bytes/s line; eval mode's eval.h5 and its plot; bench
# mode's generate rows.
. "$TESTDIR/tap.sh"
need_h5py
cd "$WORK" || exit 1
F="$FMATTN"
G="$TESTDIR/decks/generate.in"

# cached_equals_recomputed NAME SETTINGS: train run NAME, then generate from its checkpoint with
# and without the decode cache
cached_equals_recomputed() {
  v=$1
  shift
  if ! "$F" "$G" --set run.name=$v "$@" > train-$v.log 2>&1; then
    not_ok "$v: trains" "$(tail -n 5 train-$v.log)"
    return
  fi
  gen="--set run.name=$v --set run.mode=generate --set output.restart=latest --set generate.record=true"
  # shellcheck disable=SC2086 # $gen is a list of options
  "$F" "$G" "$@" $gen --set generate.cache=true > cached-$v.log 2>&1 && mv out/$v/generate.h5 cached-$v.h5
  # shellcheck disable=SC2086
  "$F" "$G" "$@" $gen --set generate.cache=false > plain-$v.log 2>&1 && mv out/$v/generate.h5 plain-$v.h5
  check "$v: cached and recomputed generation give the same 300 bytes, logits within 1e-4" py -c "
import h5py, numpy as np, sys
a, b = h5py.File('cached-$v.h5'), h5py.File('plain-$v.h5')
same = np.array_equal(a['byte'][...], b['byte'][...]) and len(a['byte']) == 300
diff = np.abs(a['logits'][...] - b['logits'][...]).max()
print('max logit difference', diff)
sys.exit(0 if same and diff <= 1e-4 and int(a.attrs['cache']) == 1 and int(b.attrs['cache']) == 0 else 1)"
}
for v in full local fma linear fmmformer rmfa; do
  cached_equals_recomputed $v --set attention.variant=$v
done
# fma.open (SPEC §6.4a): the cache keeps every key and value; each byte opens its own windows
cached_equals_recomputed fma_open2 --set attention.variant=fma --set attention.fma.open=2
check "the bytes/s line names the decode cache" grep -q "bytes/s (decode cache)" cached-fma.log
check "generate.txt holds the prompt and the bytes" sh -c "head -c 21 out/fma/generate.txt | grep -q 'Everyone is permitted' && test \$(wc -c < out/fma/generate.txt) -ge 321"

# no cache: one line says so, and generation still runs
"$F" "$G" --set run.name=fl --set attention.variant=fma_linear > train-fl.log 2>&1
check "fma_linear (no decode cache) generates, recomputing" sh -c "'$F' '$G' --set run.name=fl --set attention.variant=fma_linear --set run.mode=generate --set output.restart=latest --set generate.length=20 > gen-fl.log 2>&1 && grep -q 'has no decode cache' gen-fl.log"

# a prompt file and several samples
printf 'This License' > prompt.txt
check "a prompt file and 3 samples" sh -c "'$F' '$G' --set run.name=fma --set attention.variant=fma --set run.mode=generate --set output.restart=latest --set generate.prompt_file=prompt.txt --set generate.samples=3 --set generate.length=40 > gen3.log 2>&1 && test \$(grep -c -- '--- sample' out/fma/generate.txt) -eq 3 && grep -q '^This License' out/fma/generate.txt"
check "a prompt read from a pipe (generate.prompt_file = /dev/stdin)" sh -c "printf 'This License' | '$F' '$G' --set run.name=fma --set attention.variant=fma --set run.mode=generate --set output.restart=latest --set generate.prompt_file=/dev/stdin --set generate.length=10 > genpipe.log 2>&1 && grep -q '^This License' out/fma/generate.txt && test \$(wc -c < out/fma/generate.txt) -eq 23"
expect_fail "a missing prompt file is a deck error" "generate.prompt_file = 'absent.txt': cannot open" "$F" "$G" --set run.mode=generate --set output.restart=latest --set generate.prompt_file=absent.txt

# eval.h5
"$F" "$G" --set run.name=fma --set attention.variant=fma --set run.mode=eval --set output.restart=latest > eval.log 2>&1
check "eval mode writes eval.h5 with the SPEC layout" py -c "
import h5py, numpy as np, sys
f = h5py.File('out/fma/eval.h5')
d = h5py.File('out/fma/diag.h5')
ok = abs(f['valid/loss'][0] - d['eval/valid_loss'][-1]) < 1e-5
ok = ok and abs(f['valid/bpc'][0] - f['valid/loss'][0] / np.log(2)) < 1e-9
ok = ok and f['valid/tokens'][0] == 16 * 64 and f['test/tokens'][0] > 0
ok = ok and int(f.attrs['step']) == 60 and str(f.attrs['checkpoint']).endswith('ckpt_000060.h5')
pl, pt = f['position/valid_loss'][...], f['position/valid_tokens'][...]
ok = ok and len(pl) == 32 and pt.sum() == f['valid/tokens'][0] and np.isfinite(pl).all()
ok = ok and abs((pl * pt).sum() / pt.sum() - f['valid/loss'][0]) < 1e-5
ok = ok and (f['position/start'][...] == np.arange(32) * 2).all()
ok = ok and f['attention/level_mass'].shape == (2, 2, 3) and np.allclose(f['attention/level_mass'][...].sum(-1), 1, atol=1e-4)
ok = ok and all('units' in o.attrs or 'description' in o.attrs for o in (f['valid/loss'], f['position/valid_loss']))
# the test split: the training run's final test loss, from the same checkpoint by another path
ok = ok and abs(f['test/loss'][0] - d['test/loss'][-1]) < 1e-5 and abs(f['test/bpc'][0] - d['test/bpc'][-1]) < 1e-5
tl, tt = f['position/test_loss'][...], f['position/test_tokens'][...]
ok = ok and len(tl) == 32 and tt.sum() == f['test/tokens'][0] and abs((tl * tt).sum() / tt.sum() - f['test/loss'][0]) < 1e-5
ok = ok and (f['position/end'][...] == np.arange(1, 33) * 2).all() and (pt == 16 * 2).all()
ok = ok and f['attention/entropy'].shape == (2, 2) and (f['attention/entropy'][...] > 0).all()
sys.exit(0 if ok else 1)"
# a context that 32 buckets do not divide: each bucket's label is the positions it scored
"$F" "$G" --set run.name=odd --set attention.variant=full --set model.context=100 --set train.steps=2 > odd.log 2>&1
"$F" "$G" --set run.name=odd --set attention.variant=full --set model.context=100 --set run.mode=eval --set output.restart=latest > odd-eval.log 2>&1
check "eval.h5 at context 100: buckets labelled [start, end) hold exactly those positions" py -c "
import h5py, numpy as np, sys
f = h5py.File('out/odd/eval.h5')
s, e, t = f['position/start'][...], f['position/end'][...], f['position/valid_tokens'][...]
ok = s[0] == 0 and e[-1] == 100 and (s[1:] == e[:-1]).all() and (t == 16 * (e - s)).all()
sys.exit(0 if ok else 1)"

# bench.what = generate: a decode-cache and a recompute time per context
"$F" "$G" --set run.name=bgen --set run.mode=bench --set bench.what=generate --set bench.n_list=64,128 --set bench.repeats=1 > bgen.log 2>&1
check "bench.what = generate writes /generate/ rows to bench.h5" py -c "
import h5py, numpy as np, sys
g = h5py.File('out/bgen/bench.h5')['generate']
v = [x.decode() if isinstance(x, bytes) else x for x in g['variant'][...]]
ok = v == ['fma', 'fma'] and list(g['n'][...]) == [64, 128]
ok = ok and (g['decode_ms'][...] > 0).all() and (g['recompute_ms'][...] > 0).all()
sys.exit(0 if ok else 1)"
check "plot_run.py draws the loss by position" sh -c "'${PYTHON3:-/usr/bin/python3}' '$SRCDIR/scripts/plot_run.py' out/fma -o plots > /dev/null && test -s plots/loss_vs_position.png"
tap_done
