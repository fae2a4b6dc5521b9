#!/bin/sh
# The long-range tasks end to end (docs/tasks.md): every generator's export holds the answers that
# tests/tasks_check.py recomputes from the tokens (ListOps by its own parser), and the checker
# catches a wrong answer, position or distance; a generator's export trains bit for bit as the
# generator; every bad task file is refused with one message, on 1 and 2 ranks; S x D layouts give
# the 1-rank losses and accuracies; diag.h5 and eval.h5 hold the accuracy by distance, plot_run.py
# draws it; and learning: full attention solves far recall, local with a shorter band stays at
# chance beyond its band. Two runs at a time, one thread each.
. "$TESTDIR/tap.sh"
need_h5py
cd "$WORK" || exit 1
F="$FMATTN"
CHK="$TESTDIR/tasks_check.py"

cat > t.in <<'DECK'
[run]
name = t
[data]
source = mqar
[model]
layers = 1
dim = 32
heads = 2
context = 64
dropout = 0
[attention]
variant = full
full.block = 16
fma.m = 8
fma.p = 2
[train]
steps = 6
batch = 4
lr = 3e-3
warmup = 2
eval_every = 3
eval_windows = 8
[output]
dir = out
log_every = 1
diag_every = 0
checkpoint_every = 0
DECK
# filler text for passkey: a corpus from the source tree, long enough for every split
cat "$SRCDIR/README.md" "$SRCDIR/README.md" "$SRCDIR/README.md" > text.txt

# ---- generators: the checker recomputes every answer, position and distance ------------------
ex() { # name settings...: a short run exporting its samples to name.h5
  name=$1
  shift
  "$F" t.in --set run.name="$name" --set data.export="$name.h5" "$@" > "$name.log" 2>&1
}
for gen in "mqar" "mqar2 --set data.mqar.one_hop=false --set data.mqar.spread=uniform" \
  "mqarc --set data.mqar.spread=compact --set data.mqar.pairs=16 --set data.mqar.queries=5" \
  "passkey" "passkey2 --set data.passkey.one_hop=false --set data.passkey.depth=0.2,0.7" \
  "listops --set model.context=256 --set data.listops.min_length=40" "copy" "majority"; do
  # shellcheck disable=SC2086 # the settings are words on purpose
  set -- $gen
  name=$1
  shift
  src=$(echo "$name" | sed 's/[0-9c]*$//')
  [ "$src" = passkey ] && set -- "$@" --set data.path=text.txt
  if ex "$name" --set data.source="$src" "$@"; then
    check "$name: the export's answers, scored positions and distances hold" py "$CHK" "$name.h5"
  else
    not_ok "$name: a run exporting its samples" "$(tail -n 5 "$name.log")"
  fi
done
check "passkey's filler is a window of data.path's text around the needle (reserved bytes as spaces)" py -c "
import h5py, sys
t = h5py.File('passkey.h5')['tokens'][...]
reserved = {0, 2, 3} | set(range(0x10, 0x1C)) | set(range(0x80, 0x100))
text = bytes(32 if b in reserved else b for b in open('text.txt', 'rb').read())
for r in t:
    p, q = list(r).index(2), len(r) - 1 - 10  # the one-hop question takes 1 + 2 * 5 tokens
    if bytes(r[:p].tolist() + r[p + 6:q].tolist()) not in text:
        sys.exit('a row whose filler is not a window of the text')"

# the checker is not vacuous: a wrong answer, a wrong distance, a wrong scored position
corrupt() { # file what: a copy of file with one thing wrong
  py - "$1" "$2" <<'PY'
import h5py, shutil, sys
src, what = sys.argv[1], sys.argv[2]
shutil.copy(src, "bad_" + src)
with h5py.File("bad_" + src, "r+") as f:
    sc = f["scored"][0]
    t = int(sc.nonzero()[0][0])
    if what == "answer":
        tok = f["tokens"][0]
        tok[t + 1] = ord("0") + (tok[t + 1] - ord("0") + 1) % 10
        f["tokens"][0] = tok
    elif what == "distance":
        d = f["distance"][0]
        d[t] += 1
        f["distance"][0] = d
    else:
        sc[t] = 0
        sc[t + 1 if t + 1 < len(sc) else t - 1] = 1
        f["scored"][0] = sc
PY
}
corrupt listops.h5 answer
expect_fail "the checker refuses a ListOps row with a wrong answer" "row 0" py "$CHK" bad_listops.h5
corrupt mqar.h5 distance
expect_fail "the checker refuses an MQAR row with a wrong distance" "row 0: distance" py "$CHK" bad_mqar.h5
corrupt passkey.h5 scored
expect_fail "the checker refuses a passkey row scoring the wrong target" "row 0: scored" py "$CHK" bad_passkey.h5

# ---- round trip: a generator's export trains as the generator did ------------------------------
split=$(py -c "import h5py; print(h5py.File('mqar.h5').attrs['split'])")
check "the task file trains bit for bit as its generator (split $split)" \
  "$F" t.in --set run.name=mqar-file --set data.source=task --set data.path=mqar.h5 --set data.split="$split"
check "same training losses and validation accuracy, bit for bit" py -c "
import h5py, numpy as np, sys
a, b = h5py.File('out/mqar/diag.h5'), h5py.File('out/mqar-file/diag.h5')
for k in ('/train/loss', '/train/grad_norm', '/eval/valid_loss', '/task/valid_accuracy',
          '/task/valid_accuracy_by_distance', '/test/accuracy', '/test/sample_accuracy'):
    if not np.array_equal(a[k][...], b[k][...], equal_nan=True):
        sys.exit(k + ' differs')
sys.exit(0 if len(a['/train/loss']) == 6 else 'no training records')"

# ---- bad task files: one message each, on 1 and 2 ranks ---------------------------------------
py - <<'PY'
import h5py, numpy as np
L, N = 65, 6
tok = np.arange(N * L).reshape(N, L) % 256
sc = np.zeros((N, L - 1), np.uint8)
sc[:, 10] = 1
def write(name, **d):
    with h5py.File(name + ".h5", "w") as f:
        for k, v in d.items():
            f[k] = v
write("good", tokens=tok.astype(np.uint8), scored=sc.astype(bool), distance=np.full((N, L - 1), 3))
write("notokens", scored=sc)
write("noscored", tokens=tok)
write("shape", tokens=tok, scored=sc[:, :-1])
big = tok.copy(); big[2, 5] = 256
write("range", tokens=big, scored=sc)
none = sc.copy(); none[4] = 0
write("unscored", tokens=tok, scored=none)
write("short", tokens=tok[:, :33], scored=sc[:, :32])
PY
check "a well-formed task file (bool scored, uint8 tokens) trains" \
  "$F" t.in --set run.name=good --set data.source=task --set data.path=good.h5 --set data.split=4,1,1
for r in 1 2; do
  run="$F"
  [ $r = 2 ] && run="$MPI_RUN 2 $F"
  for bad in "notokens:has no dataset 'tokens'" "noscored:has no dataset 'scored'" \
    "shape:scored has shape (6, 63), but tokens (6, 65) needs (6, 64)" \
    "range:tokens[2, 5] = 256 is outside [0, 256)" "unscored:row 4 has no scored position" \
    "short:a context of L-1 = 32, shorter than model.context = 64"; do
    file=${bad%%:*}
    msg=${bad#*:}
    # shellcheck disable=SC2086 # $run is a command and its arguments
    out=$($run t.in --set run.name="bad-$file" --set data.source=task --set data.path="$file.h5" \
      --set data.split=4,1,1 2>&1)
    rc=$?
    count=$(printf '%s\n' "$out" | grep -cF "$msg")
    if [ "$rc" -ne 0 ] && printf '%s' "$out" | grep -qF "$msg" && [ "$count" -eq 1 ]; then
      ok "$r rank(s): $file.h5 refused with one message: $msg"
    else
      not_ok "$r rank(s): $file.h5 refused with one message (status $rc, $count errors)" "$out"
    fi
  done
done
expect_fail "a file that is not HDF5 is refused at the deck, naming data.path" \
  "data.path = 'text.txt' is not an HDF5 file" "$F" t.in --set data.source=task --set data.path=text.txt
expect_fail "fractions that leave a split without rows are refused" \
  "the valid split of task file 'good.h5' has no rows" "$F" t.in --set data.source=task --set data.path=good.h5

# ---- rank layouts: S x D gives the 1-rank losses and accuracies ---------------------------------
for gen in mqar "listops --set data.listops.min_length=16"; do
  # shellcheck disable=SC2086
  set -- $gen
  name=$1
  shift
  "$F" t.in --set run.name="$name-1" --set data.source="$name" "$@" > /dev/null 2>&1
  for layout in "2 2" "4 2" "4 4"; do
    set -- $layout
    P=$1 S=$2
    shift 2
    # shellcheck disable=SC2086
    set -- $gen
    shift
    "$MPI_RUN" "$P" "$F" t.in --set run.name="$name-$P-$S" --set data.source="$name" \
      --set parallel.seq_ranks="$S" "$@" > "$name-$P-$S.log" 2>&1
    # an argmax may flip at a near-tie between layouts (logits agree to rounding): one target
    check "$name on $P ranks, S = $S: training losses and accuracies equal 1 rank" py -c "
import h5py, numpy as np, sys
a, b = h5py.File('out/$name-1/diag.h5'), h5py.File('out/$name-$P-$S/diag.h5')
if not np.allclose(a['/train/loss'][...], b['/train/loss'][...], rtol=1e-5, atol=0):
    sys.exit('losses differ')
n = a['/task/valid_scored_by_distance'][...]
if not np.array_equal(n, b['/task/valid_scored_by_distance'][...]):
    sys.exit('scored targets by distance differ')
for k, count in (('/task/valid_accuracy', n[0].sum()), ('/test/accuracy', n[0].sum()),
                 ('/task/valid_sample_accuracy', 8), ('/test/sample_accuracy', 8)):
    if np.max(np.abs(a[k][...] - b[k][...])) > 1.001 / count:
        sys.exit(k + ' differs by more than one target')"
  done
done

# ---- diag.h5, eval.h5 and the plot -------------------------------------------------------------
check "diag.h5 /task: a record per validation, buckets with edges, units on every dataset" py -c "
import h5py, numpy as np, sys
f = h5py.File('out/mqar/diag.h5')
g = f['task']
steps = list(g['step'][...])
ok = steps == list(f['eval/step'][...]) == [3, 6]
ok = ok and g['valid_accuracy_by_distance'].shape == (2, 7) == g['valid_scored_by_distance'].shape
ok = ok and list(g['distance_start'][...]) == [0, 1, 2, 4, 8, 16, 32]
ok = ok and list(g['distance_end'][...]) == [1, 2, 4, 8, 16, 32, 64]
ok = ok and g['valid_scored_by_distance'][-1].sum() == 64  # 8 windows x 8 queries
ok = ok and all('units' in d.attrs or 'description' in d.attrs for d in list(g.values()) + [f['test/accuracy']])
sys.exit(0 if ok else 1)"
"$F" t.in --set run.name=mqar --set run.mode=eval --set output.restart=latest > eval.log 2>&1
check "eval mode writes the accuracy of the checkpoint, equal to the run's final one" py -c "
import h5py, numpy as np, sys
e, d = h5py.File('out/mqar/eval.h5'), h5py.File('out/mqar/diag.h5')
ok = e['valid/accuracy'][0] == d['task/valid_accuracy'][-1]
ok = ok and e['test/sample_accuracy'][0] == d['test/sample_accuracy'][-1]
ok = ok and np.array_equal(e['valid/accuracy_by_distance'][...], d['task/valid_accuracy_by_distance'][-1], equal_nan=True)
ok = ok and e['valid/scored_by_distance'][...].sum() == e['valid/samples'][0] * 8
ok = ok and list(e['distance/end'][...])[-1] == 64
ok = ok and all('units' in x.attrs or 'description' in x.attrs for x in (e['valid/accuracy'], e['distance/start'], e['test/accuracy_by_distance']))
sys.exit(0 if ok else 1)"
check "the eval console line gives the accuracy" grep -q "valid loss .* | accuracy " eval.log
check "plot_run.py draws accuracy against step and by distance" \
  py "$SRCDIR/scripts/plot_run.py" out/mqar -o plots
for png in accuracy accuracy_by_distance; do
  check "$png.png is a PNG" sh -c "head -c 8 plots/$png.png | grep -q PNG"
done

# ---- learning: full recalls from far away; local with a shorter band stays at chance there -----
cat > far.in <<'DECK'
[run]
name = far
[data]
source = mqar
mqar.pairs = 8
mqar.spread = uniform
[model]
layers = 1
dim = 128
heads = 4
mlp_ratio = 2
context = 64
dropout = 0
[attention]
full.block = 16
local.band = 8
[train]
steps = 200
batch = 32
lr = 1e-3
warmup = 20
eval_every = 0
eval_windows = 128
[output]
dir = out
log_every = 100
diag_every = 0
checkpoint_every = 0
DECK
"$F" far.in --set attention.variant=full --set run.name=far-full > far-full.log 2>&1 &
"$F" far.in --set attention.variant=local --set run.name=far-local > far-local.log 2>&1
wait
for v in full local; do
  check "far recall: $v trains" test -f "out/far-$v/diag.h5"
done
# accuracy over the buckets from distance 16 on (twice local's band): chance is 1/8
far() { py -c "
import h5py, numpy as np
f = h5py.File('out/far-$1/diag.h5')
lo, acc, n = f['task/distance_start'][...], f['test/accuracy_by_distance'][-1], f['test/scored_by_distance'][-1]
m = (lo >= 16) & (n > 0)
print('%.3f' % (np.sum(acc[m] * n[m]) / np.sum(n[m])))"; }
af=$(far full)
al=$(far local)
echo "# far recall (distance >= 16): full $af, local (band 8) $al, chance 0.125"
check "full recalls from distance 16 and beyond (accuracy $af >= 0.9)" py -c "import sys; sys.exit(0 if $af >= 0.9 else 1)"
check "local with band 8 stays near chance there (accuracy $al <= 0.25)" py -c "import sys; sys.exit(0 if $al <= 0.25 else 1)"

# ---- the study script on a tiny case -------------------------------------------------------------
check "tasks.py --check: every run's deck is valid, nothing written" \
  py "$SRCDIR/scripts/tasks.py" --check --fmattn "$F" --out study-check
check "tasks.py --check wrote nothing" test ! -e study-check
check "tasks.py --quick: 4 variants (fma.open = 2 among them) x 2 tasks, tasks.h5, plots and a table" \
  py "$SRCDIR/scripts/tasks.py" --quick --fmattn "$F" --out study
check "tasks.h5 holds every run with its accuracy by distance and units" py -c "
import h5py, numpy as np, sys
f = h5py.File('study/tasks.h5')
r = f['runs']
names = sorted(x.decode() if isinstance(x, bytes) else x for x in r['name'][...])
ok = names == sorted('%s-64-%s' % (t, v) for t in ('mqar', 'copy') for v in ('full', 'local', 'fma', 'fma_o2'))
ok = ok and all(np.isfinite(r[c][...]).all() for c in ('accuracy', 'sample_accuracy', 'train_s', 'wall_s'))
ok = ok and all('units' in d.attrs or 'description' in d.attrs for d in r.values())
ok = ok and all(len(f['by_distance/%s/accuracy' % n]) == 7 for n in names)
ok = ok and f.attrs['wall_s'] > 0
sys.exit(0 if ok else 1)"
for png in accuracy accuracy_by_distance_mqar accuracy_by_distance_copy; do
  check "study: $png.png is a PNG" sh -c "head -c 8 study/$png.png | grep -q PNG"
done
check "tasks.py --list numbers the runs for a SLURM array" sh -c \
  "'${PYTHON3:-/usr/bin/python3}' '$SRCDIR/scripts/tasks.py' --quick --list --fmattn '$F' --out study | grep -c '' | grep -qx 8"
tap_done
