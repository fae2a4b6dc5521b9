#!/bin/sh
# The one command to run on a GPU node (docs/gpu.md): build fmattn --with-cuda in a scratch copy
# of this checkout, run the GPU tests natively and under compute-sanitizer (memcheck with the pool
# off, racecheck, synccheck, initcheck; where it is installed), time inputs/bench_gpu.in (fma and
# full attention n = 4K ... 1M in bf16, fma in fp32, the enwik8 model's step, a 1M-token fma step)
# with the clocks logged beside each run, per-kernel times of fma at 128K (nsys where it is
# installed, else ncu: the operators' kernels, then every kernel of fmattn's own, summed by
# scripts/ncu_kernels.py), PyTorch's SDPA with each backend pinned, and write
# docs/gpu/<device>.csv, the roofline bound beside the measured times (<device>-roofline.txt) and
# the device pool's requests replayed (<device>-pool.txt).
# Usage, from the repository root: sh scripts/gpu_check.sh [--quick] [--lease]
#   --quick  the pipeline at toy sizes (minutes, and no claim worth keeping)
#   --lease  sized for a lent GPU's 15 minutes (about 5 of running): fma at 16K, 128K and 1M in bf16
#            and fp32, full attention at 16K, 3 repetitions (the long step 2), every sanitizer and
#            benchmark step under a time limit, SDPA with Flash and cuDNN pinned
# FMATTN=path: a program built --with-cuda elsewhere (no build here); GPU_TESTS=dir: its test
# programs (test_gpu, test_gpu_model, test_gpu_full, test_gpu_fma), run natively and under the
# sanitizers as a build here would.
set -eu

me=gpu_check.sh
say() { echo "$me: $*"; }
die() {
  echo "$me: $*" >&2
  exit 1
}

QUICK=0 LEASE=0
for a in "$@"; do
  case $a in
    --quick) QUICK=1 ;;
    --lease) LEASE=1 ;;
    *) die "unknown option $a (usage: sh scripts/gpu_check.sh [--quick] [--lease])" ;;
  esac
done
# --lease: the whole run's seconds (LEASE_SECS, default 420: a lent GPU's 15 minutes less its
# start, the transfers and a margin). Each sanitizer run, profile and benchmark runs under a limit
# where `timeout` exists: its own, or what is left of LEASE_SECS if less; with nothing left it is
# not started (status 124, as `timeout` gives). Without --lease, unbounded.
LEASE_SECS=${LEASE_SECS:-420}
exec 3>&2
START=$(date +%s)
left() { echo $((LEASE_SECS - ($(date +%s) - START))); }
limit() {
  secs=$1
  shift
  if [ "$LEASE" = 1 ] && command -v timeout >/dev/null 2>&1; then
    rest=$(left)
    [ "$rest" -lt "$secs" ] && secs=$rest
    if [ "$secs" -le 0 ]; then # to the script's own stderr (fd 3), not the run's redirection
      say "the lease's $LEASE_SECS s are spent: not run: $*" >&3
      return 124
    fi
    timeout "$secs" "$@"
  else
    "$@"
  fi
}
WORK=${WORK:-build-gpu}               # the scratch build and the runs
FMATTN=${FMATTN:-}                    # a built fmattn to use instead of building one
OUT_DIR=${OUT_DIR:-docs/gpu}
EXTRA=${EXTRA:-} # more --set arguments for every fmattn run, one string
if [ ! -f configure.ac ] || [ ! -f inputs/bench_gpu.in ]; then die "run me from the repository root"; fi
# the first python3 that imports what a step needs (PYTHON, else python3 on PATH, else Debian's)
python_with() {
  for p in ${PYTHON:-} python3 /usr/bin/python3; do
    command -v "$p" >/dev/null 2>&1 && "$p" -c "$1" 2>/dev/null && { echo "$p"; return 0; }
  done
  return 1
}
H5_PYTHON=$(python_with 'import h5py, numpy') || die "no python3 with h5py and numpy (set PYTHON)"
mkdir -p "$WORK" "$OUT_DIR"
WORK=$(cd "$WORK" && pwd)
# the device's clocks, power and temperature now, one CSV row tagged $1 (a GEMM rate or an MFU
# means little without them: a throttled clock is a slower device)
clocks() {
  command -v nvidia-smi >/dev/null 2>&1 || return 0
  nvidia-smi --query-gpu=index,name,clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu \
    --format=csv,noheader | sed "s/^/$1, /" >> "$WORK/clocks.csv"
}
rm -f "$WORK/clocks.csv"
command -v nvidia-smi >/dev/null 2>&1 || say "no nvidia-smi: clocks not logged"

# ---- build (skipped when FMATTN names a program already built with a GPU back end) -------------
GPU_TESTS=${GPU_TESTS:-}
if [ -z "$FMATTN" ]; then
  CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
  [ -x "$CUDA_HOME/bin/nvcc" ] || die "no nvcc under CUDA_HOME=$CUDA_HOME (set CUDA_HOME)"
  say "building --with-cuda=$CUDA_HOME in $WORK/tree (log: $WORK/build.log)"
  rm -rf "$WORK/tree" && mkdir -p "$WORK/tree"
  git ls-files -z | xargs -0 tar -cf - | tar -xf - -C "$WORK/tree"
  [ -e data/kjv.txt ] && mkdir -p "$WORK/tree/data" && cp data/kjv.txt "$WORK/tree/data/"
  (cd "$WORK/tree" && ./bootstrap && ./configure --with-cuda="$CUDA_HOME" &&
    make -j"$(nproc)" &&
    make -C tests -j"$(nproc)" test_gpu test_gpu_model test_gpu_full test_gpu_fma) \
    > "$WORK/build.log" 2>&1 || die "the build failed: tail $WORK/build.log"
  FMATTN="$WORK/tree/src/fmattn"
  GPU_TESTS="$WORK/tree/tests"
fi
# ---- the GPU tests, natively: every op, the whole model, the attentions; 2 ranks on 2 GPUs -----
if [ -n "$GPU_TESTS" ]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=4
  gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
  for t in test_gpu test_gpu_model test_gpu_full test_gpu_fma; do
    say "tests/$t"
    "$GPU_TESTS/$t" > "$WORK/$t.tap" 2>&1 || die "tests/$t failed: $WORK/$t.tap"
    grep -c '^ok' "$WORK/$t.tap" | sed "s/^/$me:   passed: /"
  done
  if [ "$gpus" -ge 2 ]; then
    mpirun -n 2 "$GPU_TESTS/test_gpu_model" > "$WORK/test_gpu_model_2.tap" 2>&1 ||
      die "tests/test_gpu_model on 2 ranks failed: $WORK/test_gpu_model_2.tap"
    say "tests/test_gpu_model on 2 GPUs (NCCL): passed"
  fi
else
  say "FMATTN given without GPU_TESTS: the native tests and the sanitizer runs are skipped"
fi

# ---- benchmarks ---------------------------------------------------------------------------------
NS=4096,8192,16384,32768,65536,131072,262144,524288,1048576
STEP_N=1024 LONG_N=1048576 BATCH=32 REPEATS=5
VARIANTS=full,fma LONG_REPEATS=$REPEATS
if [ "$LEASE" = 1 ]; then # full attention only at the first n (it is the correctness path)
  NS=16384,131072,1048576 REPEATS=3 LONG_REPEATS=2 VARIANTS=fma
fi
if [ "$QUICK" = 1 ]; then
  NS=256,512 STEP_N=128 LONG_N=1024 BATCH=2 REPEATS=1 LONG_REPEATS=1
fi
small=""
[ "$QUICK" = 1 ] && small="--set model.layers=2 --set model.dim=64 --set model.heads=2"
bench() { # name, then --set arguments
  name=$1
  shift
  say "bench $name"
  clocks "before $name"
  # shellcheck disable=SC2086 # $small and $EXTRA are lists of words
  # the pool's requests (FMATTN_GPU_POOL_TRACE), replayed by scripts/pool_replay.py below
  limit 300 env FMATTN_GPU_POOL_TRACE="$WORK/$name.pool" "$FMATTN" inputs/bench_gpu.in \
    --set run.name="$name" --set output.dir="$WORK/runs" \
    --set bench.repeats=$REPEATS $small "$@" $EXTRA > "$WORK/$name.log" 2>&1 ||
    die "fmattn bench $name failed: $WORK/$name.log"
  clocks "after $name"
}
bench attention --set bench.n_list=$NS --set bench.variants=$VARIANTS
if [ "$LEASE" = 1 ] && [ "$QUICK" = 0 ]; then
  bench attention_full --set bench.n_list=16384 --set bench.variants=full
fi
bench attention_fp32 --set bench.n_list=$NS --set bench.variants=fma --set parallel.precision=fp32
bench step --set bench.what=train --set bench.n_list=$STEP_N --set train.batch=$BATCH
# 1M tokens: the enwik8 model's 28 activation buffers of T x dim floats are 84 GiB at dim 768, so
# the long step runs at dim 512, 8 heads (d = 64 as above): 56 GiB of them (docs/gpu.md)
long_width="--set model.dim=512 --set model.heads=8"
[ "$QUICK" = 1 ] && long_width=""
# shellcheck disable=SC2086 # $long_width is a list of words
bench long --set bench.what=train --set bench.n_list=$LONG_N --set train.batch=1 \
  --set train.recompute=true --set model.position=sinusoidal --set bench.repeats=$LONG_REPEATS \
  $long_width

# ---- PyTorch's SDPA on the same device, where torch imports and sees a GPU: each backend pinned --
sdpa=""
if TORCH_PYTHON=$(python_with 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'); then
  say "PyTorch scaled_dot_product_attention, Flash, cuDNN and memory-efficient ($TORCH_PYTHON)"
  clocks "before sdpa"
  sdpa_ns=$NS sdpa_backends=flash,cudnn,efficient
  [ "$LEASE" = 1 ] && [ "$QUICK" = 0 ] && sdpa_ns=16384,131072 sdpa_backends=flash,cudnn
  limit 180 "$TORCH_PYTHON" scripts/sdpa_bench.py --n "$sdpa_ns" --dtype bf16 --repeats $REPEATS \
    --backends "$sdpa_backends" --out "$WORK/sdpa.json" > "$WORK/sdpa.log" 2>&1 ||
    die "sdpa_bench.py failed: $WORK/sdpa.log"
  sdpa="--sdpa $WORK/sdpa.json"
else
  say "no PyTorch with CUDA here: no SDPA rows"
fi

# ---- the CSV ------------------------------------------------------------------------------------
device=$(grep -o 'bench on device [0-9]*: [^,]*' "$WORK/attention.log" | head -n 1 |
  sed 's/^bench on device [0-9]*: //; s/[^A-Za-z0-9._-]/_/g')
[ -n "$device" ] || die "$WORK/attention.log does not name a GPU: was fmattn built --with-cuda?"
[ "$QUICK" = 1 ] && device="$device-quick"
full=""
[ -f "$WORK/runs/attention_full/bench.h5" ] && full="$WORK/runs/attention_full/bench.h5"
# shellcheck disable=SC2086 # $full is one file or nothing, $sdpa one option and its value or nothing
"$H5_PYTHON" scripts/gpu_csv.py "$OUT_DIR/$device.csv" "$WORK/runs/attention/bench.h5" $full \
  "$WORK/runs/attention_fp32/bench.h5" "$WORK/runs/step/bench.h5" "$WORK/runs/long/bench.h5" $sdpa
# the roofline bound from the code's own counts beside each measured time (scripts/roofline.py)
case "$device" in
  *H200*) kind=h200 ;;
  *A100*) kind=a100 ;;
  *) kind=h100-sxm ;;
esac
for run in attention attention_fp32 step; do
  "$H5_PYTHON" scripts/roofline.py "$WORK/runs/$run/bench.h5" --device $kind
done > "$OUT_DIR/$device-roofline.txt" || die "roofline.py failed"
# the pool's requests of each bench run replayed under its policy and the old one: the growths
# after each case's warm-up and its peaks, beside what the pool counted (bench.h5 /gpu)
for run in attention attention_fp32 step long; do
  [ -s "$WORK/$run.pool" ] || continue
  for policy in oldest best; do
    "$H5_PYTHON" scripts/pool_replay.py "$WORK/$run.pool" --policy $policy
  done
done > "$OUT_DIR/$device-pool.txt" || die "pool_replay.py failed"
if [ -n "$GPU_TESTS" ]; then
  # ---- compute-sanitizer, after the figures (a lease cut short keeps them): memcheck without the
  # pool (every block exactly its size), then the synchronisation, initialisation and race
  # checkers; their error counts in sanitizer.txt. With --lease each run has 90 s, racecheck (the
  # slow one: test_gpu_fma took about 150 s on an H200) 180; a run out of time says so, and how
  # many tests it finished, in its row, and one the lease left no time for says that. ----
  if command -v compute-sanitizer >/dev/null 2>&1; then
    : > "$WORK/sanitizer.txt"
    for tool in memcheck synccheck initcheck racecheck; do
      secs=90
      [ "$tool" = racecheck ] && secs=180
      for t in test_gpu test_gpu_fma; do
        log="$WORK/sanitizer_${tool}_$t.log"
        say "compute-sanitizer --tool $tool tests/$t"
        rc=0
        limit "$secs" env FMATTN_GPU_POOL=0 compute-sanitizer --tool "$tool" --error-exitcode 0 \
          "$GPU_TESTS/$t" > "$log" 2>&1 || rc=$?
        if [ "$rc" = 124 ] && [ ! -s "$log" ]; then # limit started nothing
          summary="not run: the lease's time was spent"
        elif [ "$rc" = 124 ]; then # stopped: no summary, but each error is printed as found
          summary="out of time after $(grep -c '^ok' "$log") tests, \
$(grep -cE '^========= (Invalid|Error|Race|Barrier|Uninitialized)' "$log") errors printed"
        else
          summary=$(grep -oE '(ERROR SUMMARY: [0-9]* error|RACECHECK SUMMARY: [0-9]* hazard)' \
            "$log" | tail -n 1)
        fi
        echo "$tool $t: ${summary:-no summary (see $(basename "$log"))}" >> "$WORK/sanitizer.txt"
      done
    done
    sed "s/^/$me:   /" "$WORK/sanitizer.txt"
  else
    say "no compute-sanitizer on PATH: the sanitizer runs are skipped"
  fi
fi

# ---- per-kernel times: fma forward + backward at 128K under Nsight Systems, where installed ------
PROFILE_N=131072
[ "$QUICK" = 1 ] && PROFILE_N=512
if command -v nsys >/dev/null 2>&1; then
  say "nsys: per-kernel times of fma at n = $PROFILE_N"
  # shellcheck disable=SC2086 # $small and $EXTRA are lists of words
  if nsys profile --force-overwrite true --output "$WORK/fma_kernels" "$FMATTN" inputs/bench_gpu.in \
    --set run.name=profile --set output.dir="$WORK/runs" --set bench.n_list=$PROFILE_N \
    --set bench.variants=fma --set bench.repeats=1 $small $EXTRA > "$WORK/nsys.log" 2>&1 &&
    nsys stats --report cuda_gpu_kern_sum --format csv --output "$WORK/fma_kernels" \
      "$WORK/fma_kernels.nsys-rep" >> "$WORK/nsys.log" 2>&1; then
    say "nsys: $WORK/fma_kernels_cuda_gpu_kern_sum.csv"
  else
    say "nsys failed (see $WORK/nsys.log); no per-kernel times"
  fi
elif NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1) &&
  [ -n "$NCU" ]; then
  # Nsight Compute instead (the lent machines have no nsys): each kernel's device time inside the
  # FMA operators' NVTX ranges, clocks as they are
  say "ncu: per-kernel times of fma at n = $PROFILE_N (the operators' NVTX ranges)"
  # shellcheck disable=SC2086 # $small and $EXTRA are lists of words
  if limit 180 "$NCU" --clock-control none --metrics gpu__time_duration.sum --nvtx \
    --nvtx-include "P2P/" --nvtx-include "M2P/" --nvtx-include "P2M/" --nvtx-include "M2M/" --csv \
    --log-file "$WORK/fma_kernels_ncu.csv" "$FMATTN" inputs/bench_gpu.in --set run.name=profile \
    --set output.dir="$WORK/runs" --set bench.n_list=$PROFILE_N --set bench.variants=fma \
    --set bench.repeats=1 $small $EXTRA > "$WORK/ncu.log" 2>&1; then
    say "ncu: $WORK/fma_kernels_ncu.csv"
  else
    say "ncu failed (see $WORK/ncu.log); no per-kernel times"
  fi
  # and every kernel of fmattn's own (none of cuBLAS's), inside the operators or not: the
  # conversions, transposes and row sums that the ranges leave out, summed per kernel over the
  # bench's two passes (warm-up and one repetition; fill_normal is the inputs' draw, once)
  own=$(sed -n 's/^__global__ void \([A-Za-z0-9_]*\).*/\1/p; s/^template <[^>]*> *__global__ void \([A-Za-z0-9_]*\).*/\1/p' \
    gpu/*.cu | sort -u | paste -sd'|' -)
  say "ncu: fmattn's own kernels of fma at n = $PROFILE_N"
  # shellcheck disable=SC2086 # $small and $EXTRA are lists of words
  if limit 120 "$NCU" --clock-control none --metrics gpu__time_duration.sum -k "regex:($own)" \
    --csv --log-file "$WORK/fma_own_kernels_ncu.csv" "$FMATTN" inputs/bench_gpu.in \
    --set run.name=profile_own --set output.dir="$WORK/runs" --set bench.n_list=$PROFILE_N \
    --set bench.variants=fma --set bench.repeats=1 $small $EXTRA > "$WORK/ncu_own.log" 2>&1 &&
    "$H5_PYTHON" scripts/ncu_kernels.py "$WORK/fma_own_kernels_ncu.csv" --runs 2 \
      > "$WORK/fma_own_kernels.txt"; then
    say "ncu: $WORK/fma_own_kernels.txt"
  else
    say "ncu of the own kernels failed (see $WORK/ncu_own.log); no table of them"
  fi
else
  say "no nsys or ncu on PATH: no per-kernel times"
fi

[ -s "$WORK/clocks.csv" ] && cp "$WORK/clocks.csv" "$OUT_DIR/$device-clocks.csv"
[ -s "$WORK/sanitizer.txt" ] && cp "$WORK/sanitizer.txt" "$OUT_DIR/$device-sanitizer.txt"
[ -s "$WORK/fma_kernels_cuda_gpu_kern_sum.csv" ] &&
  cp "$WORK/fma_kernels_cuda_gpu_kern_sum.csv" "$OUT_DIR/$device-fma-kernels.csv"
[ -s "$WORK/fma_kernels_ncu.csv" ] &&
  grep '^"' "$WORK/fma_kernels_ncu.csv" > "$OUT_DIR/$device-fma-kernels-ncu.csv"  || true
[ -s "$WORK/fma_own_kernels.txt" ] &&
  cp "$WORK/fma_own_kernels.txt" "$OUT_DIR/$device-fma-own-kernels.txt"  || true
say "done: $OUT_DIR/$device.csv and $device-roofline.txt (logs and bench.h5 files in $WORK)"
