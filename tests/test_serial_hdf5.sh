#!/bin/sh
# The serial-HDF5 build (issue 24): a copy of the source tree configured --with-hdf5=serial builds
# fmattn without MPI-IO (rank 0 writes each checkpoint alone, every rank reads it independently),
# and on 4 ranks (2 sequence × 2 data) it must equal this suite's parallel-HDF5 build: losses,
# validation and attention diagnostics bit for bit, the same checkpoint tensors and checksums, and
# a checkpoint of either build restarts in the other, continuing bit for bit. A damaged checkpoint
# is refused by every rank alike (each reads it on its own), and `latest` falls back past it.
. "$TESTDIR/tap.sh"
need_h5py
cd "$WORK" || exit 1
pkg-config --exists hdf5-serial 2> /dev/null ||
  skip_all "./configure --with-hdf5=serial && make # SKIP no serial HDF5 (pkg-config hdf5-serial); install libhdf5-dev"
# A clean copy of the tracked files; only the program is built (the tests are this suite's).
copy_source_tree "./configure --with-hdf5=serial && make"
cd tree || exit 1
unset MAKEFLAGS MFLAGS MAKELEVEL
check "./bootstrap" sh -c "./bootstrap > bootstrap.log 2>&1 || { cat bootstrap.log; exit 1; }"
check "./configure --with-hdf5=serial says serial HDF5" sh -c \
  "./configure --with-hdf5=serial > configure.log 2>&1 && grep -q 'HDF5 *: serial' configure.log || { tail -n 20 configure.log; exit 1; }"
check "make -C src fmattn" sh -c "make -C src -j2 fmattn > make.log 2>&1 || { tail -n 30 make.log; exit 1; }"
S="$WORK/tree/src/fmattn"
P="$FMATTN"
check "the serial build links serial HDF5, the suite's build parallel HDF5" sh -c \
  "ldd '$S' | grep -q 'libhdf5_serial' && ! ldd '$P' | grep -q 'libhdf5_serial'"
cd "$WORK" || exit 1

D="$TESTDIR/decks/seq_parallel.in"
R="--set parallel.seq_ranks=2 --set output.checkpoint_every=5 --set output.diag_every=5"
same_run() { # same_run A B START: train, eval and attention series of two runs, bit for bit
  py "$TESTDIR/h5check.py" same-series "out/$1/diag.h5" "out/$2/diag.h5" train "$3" 0 &&
    py "$TESTDIR/h5check.py" same-series "out/$1/diag.h5" "out/$2/diag.h5" eval "$3" 0 &&
    py "$TESTDIR/h5check.py" same-series "out/$1/diag.h5" "out/$2/diag.h5" attention "$3" 0
}
check "parallel HDF5: 10 steps on 4 ranks" "$MPI_RUN" 4 "$P" "$D" --set run.name=par $R
check "serial HDF5: 10 steps on 4 ranks" "$MPI_RUN" 4 "$S" "$D" --set run.name=ser $R
check "diag.h5: losses, validation and attention diagnostics equal bit for bit" same_run par ser 0
check "the serial build's checkpoint has the SPEC layout" py "$TESTDIR/h5check.py" ckpt out/ser/ckpt_000010.h5
check "checkpoints: the same tensors, checksums and run attributes (the deck's run.name aside)" py -c "
import h5py, sys
import numpy as np
a, b = h5py.File('out/par/ckpt_000010.h5', 'r'), h5py.File('out/ser/ckpt_000010.h5', 'r')
def datasets(f):
    names = []
    f.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) else None)
    return sorted(names)
names = datasets(a)
ok = len(names) > 0 and names == datasets(b)
for n in names:
    ok = ok and n in b and np.array_equal(a[n][...], b[n][...]) and a[n].attrs['crc32'] == b[n].attrs['crc32']
deck = lambda f: f.attrs['deck'].replace('=par', '=ser').replace('= par', '= ser')
ok = ok and sorted(a.attrs) == sorted(b.attrs) and deck(a) == deck(b)
ok = ok and all(str(a.attrs[k]) == str(b.attrs[k]) for k in a.attrs if k != 'deck')
sys.exit(0 if ok else 1)"

# cross-restarts from step 5: each build resumes the other's checkpoint
mkdir -p out/ser_from_par out/par_from_ser
cp out/par/ckpt_000005.h5 out/ser_from_par/ && cp out/ser/ckpt_000005.h5 out/par_from_ser/
check "serial HDF5 resumes the parallel build's checkpoint" "$MPI_RUN" 4 "$S" "$D" --set run.name=ser_from_par --set output.restart=latest $R
check "parallel HDF5 resumes the serial build's checkpoint" "$MPI_RUN" 4 "$P" "$D" --set run.name=par_from_ser --set output.restart=latest $R
check "both resumed runs continue bit for bit (series after step 5, final tensors)" sh -c "
  for r in ser_from_par par_from_ser; do
    '${PYTHON3:-/usr/bin/python3}' '$TESTDIR/h5check.py' same-series out/par/diag.h5 out/\$r/diag.h5 train 5 0 &&
    '${PYTHON3:-/usr/bin/python3}' '$TESTDIR/h5check.py' same-series out/par/diag.h5 out/\$r/diag.h5 eval 5 0 &&
    '${PYTHON3:-/usr/bin/python3}' '$TESTDIR/h5check.py' same-tensors out/par/ckpt_000010.h5 out/\$r/ckpt_000010.h5 0 || exit 1
  done"

# a damaged checkpoint: every rank of the serial build reads it itself and they agree
mkdir -p out/damaged && cp out/ser/ckpt_000005.h5 out/ser/ckpt_000010.h5 out/damaged/
check "a bit flipped in the step-10 checkpoint" py "$TESTDIR/h5check.py" flip out/damaged/ckpt_000010.h5 /model/layer_001/attn/wqkv
check "serial HDF5: latest falls back past a damaged checkpoint on every rank" sh -c "
  '$MPI_RUN' 4 '$S' '$D' --set run.name=damaged --set output.restart=latest $R > damaged.log 2>&1 &&
  grep -q 'ckpt_000010.h5 is damaged: dataset /model/layer_001/attn/wqkv fails its checksum' damaged.log && grep -q 'restarting from out/damaged/ckpt_000005.h5 at step 5' damaged.log"
check "and then continues bit for bit" py "$TESTDIR/h5check.py" same-series out/par/diag.h5 out/damaged/diag.h5 train 5 0
tap_done
