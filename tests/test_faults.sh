#!/bin/sh
# Faults that lose nothing (SPEC §10, docs/operations.md): damaged checkpoints are refused naming
# file and problem, `latest` falling back to the one before; another model's checkpoint is refused
# naming the mismatch; a NaN or Inf loss or gradient stops the run before the step; a rank killed
# by SIGKILL ends the job within 60 s; a full or read-only disk during a checkpoint write gives a
# clear error and keeps the earlier checkpoints; a data file shorter than one window is refused; a
# generic BLAS core is corrected (docs/perf.md).
. "$TESTDIR/tap.sh"
need_h5py
cd "$WORK" || exit 1
F="$FMATTN"
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
H5C="$TESTDIR/h5check.py"
T="$TESTDIR/decks/faults.in"

# ---- checksums, damaged files, and the fallback of `latest` ------------------------------------
check "a run writes a checkpoint every 5 steps" "$F" "$T"
check "every tensor of a checkpoint carries its crc32, and matches it" py "$H5C" ckpt out/t/ckpt_000020.h5
check "an uninterrupted 25-step run, for comparison" "$F" "$T" --set run.name=straight --set train.steps=25
cp -r out/t pristine

check "a bit flipped in a tensor's bytes" py "$H5C" flip out/t/ckpt_000020.h5 /model/layer_001/attn/wqkv
expect_fail "a bit-flipped checkpoint named by path is refused, naming the file and the tensor" \
  "checkpoint out/t/ckpt_000020.h5 is refused: dataset /model/layer_001/attn/wqkv fails its checksum" \
  "$F" "$T" --set run.name=x --set train.steps=25 --set output.restart=out/t/ckpt_000020.h5
"$F" "$T" --set train.steps=25 --set output.restart=latest > flip.log 2>&1
check "latest: the damaged file is reported" grep -q "warning: checkpoint out/t/ckpt_000020.h5 is damaged: dataset /model/layer_001/attn/wqkv fails its checksum" flip.log
check "latest: the run resumes from the checkpoint before it" grep -q "restarting from out/t/ckpt_000015.h5" flip.log
check "latest: only the checkpoint it resumes from is announced as the restart" sh -c \
  "grep -q 'reading checkpoint out/t/ckpt_000020.h5' flip.log && ! grep -q 'restarting from out/t/ckpt_000020' flip.log"
check "latest: the resumed run ends as the uninterrupted one, bit for bit" py "$H5C" same-tensors out/t/ckpt_000025.h5 out/straight/ckpt_000025.h5 0
check "the damaged checkpoint was rewritten whole when the run passed its step" py "$H5C" ckpt out/t/ckpt_000020.h5

rm -rf out/t && cp -r pristine out/t
truncate -s 700000 out/t/ckpt_000020.h5
expect_fail "a truncated checkpoint named by path is refused, naming the file and the problem" \
  "checkpoint out/t/ckpt_000020.h5 is refused: HDF5 cannot open it: truncated" \
  "$F" "$T" --set run.name=x --set train.steps=25 --set output.restart=out/t/ckpt_000020.h5
"$F" "$T" --set train.steps=25 --set output.restart=latest > trunc.log 2>&1
check "latest: a truncated newest checkpoint falls back to the one before it" sh -c \
  "grep -q 'ckpt_000020.h5 is damaged: HDF5 cannot open it' trunc.log && grep -q 'restarting from out/t/ckpt_000015.h5' trunc.log && grep -q 'step 25/25' trunc.log"

rm -rf out/t && cp -r pristine out/t
for c in out/t/ckpt_*.h5; do truncate -s 1000 "$c"; done
expect_fail "latest: when every checkpoint is damaged, the oldest is refused and the run stops" \
  "checkpoint out/t/ckpt_000005.h5 is refused" "$F" "$T" --set train.steps=25 --set output.restart=latest

# ---- a checkpoint of another model --------------------------------------------------------------
rm -rf out/t && cp -r pristine out/t
expect_fail "another variant is refused naming both" "it holds attention variant full, but the deck asks for local" \
  "$F" "$T" --set attention.variant=local --set train.steps=25 --set output.restart=latest
expect_fail "another shape is refused naming the tensor and both shapes" \
  "dataset /model/embed/token has shape [256, 64], the model's is [256, 32]" \
  "$F" "$T" --set model.dim=32 --set train.steps=25 --set output.restart=latest
expect_fail "another depth is refused naming the missing tensor" "dataset /model/layer_002/norm1/weight is missing" \
  "$F" "$T" --set model.layers=3 --set train.steps=25 --set output.restart=latest
check "a mismatch does not fall back to an older checkpoint" sh -c \
  "'$F' '$T' --set model.dim=32 --set train.steps=25 --set output.restart=latest 2>&1 | grep -c 'reading checkpoint' | grep -qx 1"

# ---- a NaN gradient: the step is not applied, the last good checkpoint is intact ----------------
FMATTN_FAULT=nan_grad@7 "$F" "$T" --set run.name=nan --set output.checkpoint_every=1 > nan.log 2>&1
rc=$?
if [ "$rc" -eq 1 ] && grep -q "the gradient norm is nan at step 7: the step is not applied" nan.log; then
  ok "a NaN gradient at step 7 stops the run with status 1 and a message"
else not_ok "a NaN gradient at step 7 stops the run with status 1 and a message (rc $rc)" "$(cat nan.log)"; fi
check "no checkpoint of step 7, no temporary" sh -c "test -f out/nan/ckpt_000006.h5 && ! ls out/nan/ckpt_000007.h5* 2>/dev/null"
check "a clean 6-step run, for comparison" "$F" "$T" --set run.name=six --set train.steps=6
check "the checkpoint of step 6 is intact: the clean run's, bit for bit" py "$H5C" same-tensors out/nan/ckpt_000006.h5 out/six/ckpt_000006.h5 0
FMATTN_FAULT=nan_grad@3 "$MPI_RUN" 2 "$F" "$T" --set run.name=nan2 > nan2.log 2>&1
rc=$?
n=$(grep -c "the gradient norm is nan at step 3" nan2.log)
if [ "$rc" -ne 0 ] && [ "$n" -eq 1 ]; then ok "2 ranks: a NaN gradient stops both ranks, one message"
else not_ok "2 ranks: a NaN gradient stops both ranks, one message (rc $rc, $n messages)" "$(cat nan2.log)"; fi

# ---- a NaN or Inf loss, an Inf gradient: the same refusal, named -------------------------------
expect_fail "a NaN loss at step 7 stops the run with a message" "training loss is nan at step 7: the step is not applied" \
  env FMATTN_FAULT=nan_loss@7 "$F" "$T" --set run.name=nanloss --set output.checkpoint_every=1
check "NaN loss: the checkpoint of step 6 is the clean run's, bit for bit, and there is none of step 7" sh -c \
  "! ls out/nanloss/ckpt_000007.h5* 2>/dev/null && '${PYTHON3:-/usr/bin/python3}' '$H5C' same-tensors out/nanloss/ckpt_000006.h5 out/six/ckpt_000006.h5 0"
for fault in inf_loss inf_grad; do
  FMATTN_FAULT=$fault@4 "$MPI_RUN" 2 "$F" "$T" --set run.name=$fault > $fault.log 2>&1
  rc=$?
  if [ $fault = inf_loss ]; then want="training loss is inf at step 4"; else want="the gradient norm is inf at step 4"; fi
  n=$(grep -c "$want: the step is not applied" $fault.log)
  if [ "$rc" -ne 0 ] && [ "$n" -eq 1 ]; then ok "2 ranks: $fault at step 4 stops both ranks, one message"
  else not_ok "2 ranks: $fault at step 4 stops both ranks, one message (rc $rc, $n messages)" "$(cat $fault.log)"; fi
done
expect_fail "an unknown FMATTN_FAULT is refused" "FMATTN_FAULT must be" env FMATTN_FAULT=nan_grads@1 "$F" "$T" --set run.name=badfault
# the workspaces allocated unzeroed (mem_alloc_uninit) filled with NaN: every one is written before
# it is read, so six steps end as the clean run's, bit for bit
check "FMATTN_FAULT=uninit_nan: a run with its unzeroed workspaces filled with NaN" \
  env FMATTN_FAULT=uninit_nan "$F" "$T" --set run.name=uninit --set train.steps=6
check "uninit_nan: its checkpoint of step 6 is the clean run's, bit for bit" py "$H5C" same-tensors \
  out/uninit/ckpt_000006.h5 out/six/ckpt_000006.h5 0

# ---- one rank killed: the job ends, it never hangs ----------------------------------------------
for N in 2 4; do
  "$MPI_RUN" "$N" "$F" "$T" --set run.name="kill$N" --set train.batch=4 --set train.steps=100000000 --set output.checkpoint_every=0 --set output.log_every=1 > "kill$N.log" 2>&1 &
  mp=$!
  waited=0
  while ! grep -q "step 3/" "kill$N.log" 2>/dev/null && [ "$waited" -lt 600 ]; do sleep 0.1; waited=$((waited + 1)); done
  victim=$(pgrep -P "$mp" fmattn | tail -n 1)
  start=$(date +%s)
  [ -n "$victim" ] && kill -9 "$victim"
  while kill -0 "$mp" 2>/dev/null && [ $(($(date +%s) - start)) -lt 60 ]; do sleep 0.2; done
  if kill -0 "$mp" 2>/dev/null; then
    not_ok "$N ranks: rank killed with SIGKILL, the job still runs after 60 s" "$(tail -n 20 "kill$N.log")"
    pkill -9 -P "$mp" fmattn; kill -9 "$mp"; wait "$mp"
  else
    wait "$mp"; rc=$?
    took=$(($(date +%s) - start))
    if [ -n "$victim" ] && [ "$rc" -ne 0 ]; then ok "$N ranks: one rank killed with SIGKILL, the job ended in ${took} s with status $rc"
    else not_ok "$N ranks: one rank killed with SIGKILL (victim '$victim', status $rc)" "$(tail -n 20 "kill$N.log")"; fi
  fi
done

# ---- a full or read-only file system during a checkpoint write ----------------------------------
mkdir mnt
if mount -t tmpfs -o size=4m fmattn-test mnt 2>/dev/null; then
  # 1.5 MB a checkpoint: the first fits in 4 MB, the second does not
  expect_fail "a full disk: the checkpoint is refused before writing, saying what it needs and what is free" \
    "cannot write checkpoint mnt/t/ckpt_000010.h5: it needs about" "$F" "$T" --set output.dir=mnt
  check "the checkpoint before it is intact, and no temporary is left" sh -c \
    "py() { '${PYTHON3:-/usr/bin/python3}' \"\$@\"; }; py '$H5C' ckpt mnt/t/ckpt_000005.h5 && ! ls mnt/t/*.tmp 2>/dev/null"
  umount mnt
  # the disk fills during the write itself (as when another job fills it after the check): the
  # testing hook skips the free-space check, and a 2 MB tmpfs holds one checkpoint, not two
  mount -t tmpfs -o size=2m fmattn-test mnt
  expect_fail "a disk that fills during the write: the failed write says what it was writing" \
    "(while writing checkpoint mnt/t/ckpt_000010.h5.tmp: is its file system full or read-only? The earlier checkpoints are intact)" \
    env FMATTN_FAULT=no_space_check "$F" "$T" --set output.dir=mnt
  check "the checkpoint before it is intact, and the temporary is removed" sh -c \
    "py() { '${PYTHON3:-/usr/bin/python3}' \"\$@\"; }; py '$H5C' ckpt mnt/t/ckpt_000005.h5 && ! ls mnt/t/*.tmp 2>/dev/null"
  umount mnt
  mount -t tmpfs -o size=64m fmattn-test mnt
  check "a run on the tmpfs writes its checkpoint of step 10" "$F" "$T" --set output.dir=mnt --set train.steps=10
  # resume; once it is training the file system turns read-only and SIGUSR1 asks for a checkpoint
  "$F" "$T" --set output.dir=mnt --set train.steps=100000000 --set output.restart=latest \
    --set output.log_every=100000000 --set output.diag_every=0 --set output.checkpoint_every=0 > ro.log 2>&1 &
  pid=$!
  waited=0
  while ! grep -q "step 11/" ro.log 2>/dev/null && [ "$waited" -lt 600 ]; do sleep 0.1; waited=$((waited + 1)); done
  mount -o remount,ro mnt
  kill -USR1 "$pid"
  wait "$pid"; rc=$?
  if [ "$rc" -ne 0 ] && grep -q "(while writing checkpoint mnt/t/ckpt_.*\.h5\.tmp: is its file system full or read-only? The earlier checkpoints are intact)" ro.log; then
    ok "a read-only file system mid-run: the failed checkpoint write says what it was writing (status $rc)"
  else not_ok "a read-only file system mid-run: the failed checkpoint write says what it was writing (status $rc)" "$(tail -n 20 ro.log)"; fi
  mount -o remount,rw mnt
  check "the checkpoint of step 10 is intact" py "$H5C" ckpt mnt/t/ckpt_000010.h5
  check "and the run resumes from it" sh -c "'$F' '$T' --set output.dir=mnt --set train.steps=12 --set output.restart=latest > again.log 2>&1 && grep -q 'restarting from mnt/t/ckpt_000010.h5' again.log && grep -q 'step 12/12' again.log"
  umount mnt
else
  for what in "a full disk before a checkpoint write" "a disk that fills during a checkpoint write" "a read-only file system during a checkpoint write"; do
    ok "$what # SKIP cannot mount a tmpfs here (needs root with CAP_SYS_ADMIN)"
  done
fi

# ---- a layout that cannot be: 3 ranks cannot hold sequence groups of 2 ---------------------------
"$MPI_RUN" 3 "$F" "$T" --set run.name=three --set parallel.seq_ranks=2 > three.log 2>&1
rc=$?
n=$(grep -c "parallel.seq_ranks = 2 does not divide the 3 MPI ranks" three.log)
if [ "$rc" -ne 0 ] && [ "$n" -eq 1 ] && ! test -e out/three; then
  ok "mpirun -n 3 with seq_ranks = 2: every rank stops, one message, nothing written"
else not_ok "mpirun -n 3 with seq_ranks = 2: every rank stops, one message (rc $rc, $n messages)" "$(cat three.log)"; fi

# ---- data too short for one window -------------------------------------------------------------
printf 'far too short' > short.txt
expect_fail "a data file shorter than one window is refused, with the sizes" \
  "data.path 'short.txt' has 13 bytes; split 0.9,0.05,0.05 gives train 11 bytes, fewer than model.context+1 = 33" \
  "$F" "$T" --set run.name=short --set data.source=file --set data.path=short.txt

# ---- the BLAS core check (docs/perf.md): OpenBLAS's generic fallback is corrected by running ----
# again with OPENBLAS_CORETYPE set; a user's own setting is kept, with a warning and the fix. The
# hook FMATTN_FAULT=blas_core=NAME stands for a library that does not know this CPU. The checks
# set OpenBLAS's variables themselves: a site's OPENBLAS_CORETYPE (kept by design) would leave
# nothing to correct, and its OPENBLAS_L2_SIZE goes with it.
blas_env() { env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE "$@"; }
if ! grep -qw avx2 /proc/cpuinfo || ! grep -qw fma /proc/cpuinfo; then
  ok "the BLAS core check # SKIP this CPU has no AVX2 and FMA: generic kernels are its own"
elif blas_env "$F" "$T" --set run.name=core --set train.steps=1 2>&1 | grep -q "BLAS core unknown"; then
  ok "the BLAS core check # SKIP fmattn's BLAS is not OpenBLAS (no core to check)"
else
  FMATTN_FAULT=blas_core=Prescott blas_env "$F" "$T" --set run.name=blas1 --set train.steps=1 > blas1.log 2>&1
  check "a generic BLAS core is corrected, and the device line says so" grep -q "BLAS core [A-Za-z]* (corrected from Prescott)" blas1.log
  FMATTN_FAULT=blas_core=Prescott blas_env "$MPI_RUN" 2 "$F" "$T" --set run.name=blas2 --set train.steps=1 > blas2.log 2>&1
  check "on 2 ranks: both corrected, said once" sh -c "test \$(grep -c 'fmattn runs with OPENBLAS_CORETYPE=' blas2.log) -eq 1 && grep -q 'corrected from Prescott' blas2.log"
  # the corrected process keeps its name: run again through /proc/self/exe, it was called "exe",
  # and pgrep, ps and job monitors (this file's kill test on such a CPU) no longer found it
  FMATTN_FAULT=blas_core=Prescott env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE "$F" "$T" --set run.name=blas4 --set train.steps=100000000 \
    --set output.checkpoint_every=0 --set output.log_every=1 > blas4.log 2>&1 &
  bp=$!
  waited=0
  while ! grep -q "step 2/" blas4.log 2>/dev/null && [ "$waited" -lt 600 ]; do sleep 0.1; waited=$((waited + 1)); done
  comm=$(cat "/proc/$bp/comm" 2>/dev/null)
  kill -9 "$bp" 2>/dev/null
  wait "$bp" 2>/dev/null
  check "the corrected process keeps its name ('$comm')" sh -c "grep -q 'corrected from Prescott' blas4.log && test '$comm' = '$(basename "$F")'"
  blas_env OPENBLAS_CORETYPE=Prescott "$F" "$T" --set run.name=blas3 --set train.steps=1 > blas3.log 2>&1
  check "a user's OPENBLAS_CORETYPE is kept, with a warning and the fix" sh -c "grep -q 'BLAS core Prescott, small products on ' blas3.log && grep -q 'unset it, or set OPENBLAS_CORETYPE=' blas3.log"
fi
# ---- threads and the cores a rank is bound to (threads.c) --------------------------------------
if ! command -v taskset > /dev/null || [ "$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)" -lt 2 ]; then
  ok "threads against bound cores # SKIP needs taskset and 2 cores"
else
  OMP_NUM_THREADS=2 taskset -c 0 "$F" "$T" --set run.name=bind1 --set train.steps=1 > bind1.log 2>&1
  check "2 threads bound to 1 core: one warning with the fix, and the device line says so" sh -c \
    "test \$(grep -c 'run more OpenMP threads than the cores' bind1.log) -eq 1 && grep -q 'rank 0: 2 threads on 1 core(s)' bind1.log && grep -q 'bind-to none' bind1.log && grep -q '2 thread(s) per rank on 1 core(s),' bind1.log"
  OMP_NUM_THREADS=2 taskset -c 0,1 "$F" "$T" --set run.name=bind2 --set train.steps=1 > bind2.log 2>&1
  check "2 threads bound to 2 cores: no warning" sh -c \
    "! grep -q 'threads than the cores' bind2.log && grep -q '2 thread(s) per rank,' bind2.log"
  env -u OMP_NUM_THREADS taskset -c 0,1 "$F" "$T" --set run.name=bind3 --set train.steps=1 > bind3.log 2>&1
  check "OMP_NUM_THREADS unset: one rank on 2 cores runs 2 threads" grep -q "2 thread(s) per rank," bind3.log
  env -u OMP_NUM_THREADS taskset -c 0,1 "$MPI_RUN" 2 "$F" "$T" --set run.name=bind4 --set train.steps=1 > bind4.log 2>&1
  check "OMP_NUM_THREADS unset: two ranks on those 2 cores run 1 each, unwarned" sh -c \
    "grep -q '1 thread(s) per rank,' bind4.log && ! grep -q 'threads than the cores' bind4.log"
fi
tap_done
