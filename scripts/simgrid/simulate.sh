#!/bin/sh
# The simulated scaling study on one SimGrid platform, without SLURM (docs/scaling.md):
#   scripts/simgrid/simulate.sh PLATFORM [OUT]      (run from the repository root)
# PLATFORM: this_machine, ndr, eth25 (scripts/simgrid/*.xml) or a platform XML. Builds fmattn for
# SMPI in build-smpi/ once (./configure --enable-smpi; a copy of the tracked sources), then runs
# scripts/scaling.py --simulate for fma: strong scaling at n = 64K (S = 1 ... 64), weak scaling
# at 16K tokens per rank (S = 1 ... 64, n up to 1M), strong scaling at n = 1M (S = 1, 8, 64), and
# full's ring at n = 16K for contrast. Each sweep writes OUT/<sweep>/scaling.h5 and its plots
# (OUT defaults to runs/simulated/PLATFORM). Every rank's memory lives in this one process: the
# 1M-token sweeps need about 20 GB. Environment: SWEEPS (default "strong64K weak16K strong1M
# full16K") picks sweeps; REPEATS (default 1) timed steps per run after a warm-up.
set -eu
PLATFORM="${1:?usage: scripts/simgrid/simulate.sh PLATFORM [OUT] (PLATFORM: this_machine, ndr, eth25 or an XML)}"
NAME=$(basename "$PLATFORM" .xml)
OUT="${2:-runs/simulated/$NAME}"
SWEEPS="${SWEEPS:-strong64K weak16K strong1M full16K}"
REPEATS="${REPEATS:-1}"
PY="${PYTHON3:-/usr/bin/python3}"
die() { echo "simulate.sh: error: $*" >&2; exit 1; }
[ -f scripts/scaling.py ] || die "run it from the repository root"
command -v smpirun > /dev/null 2>&1 || die "SimGrid is missing: apt-get install libsimgrid-dev"
if [ ! -x build-smpi/src/fmattn ]; then
  echo "simulate.sh: building fmattn for SMPI in build-smpi/"
  mkdir -p build-smpi
  git ls-files -z | xargs -0 tar -cf - | tar -xf - -C build-smpi
  (cd build-smpi && ./bootstrap > bootstrap.log 2>&1 && ./configure --enable-smpi > configure.log 2>&1 &&
    make -C src -j"$(nproc)" fmattn > make.log 2>&1) || die "the SMPI build failed: see build-smpi/*.log"
fi
sweep() { # sweep NAME scaling.py-options...
  name="$1"; shift
  echo "simulate.sh: $NAME $name"
  "$PY" scripts/scaling.py --simulate "$PLATFORM" --fmattn build-smpi/src/fmattn \
    --out "$OUT/$name/scaling.h5" --extra "--set bench.repeats=$REPEATS" "$@"
  "$PY" scripts/plot_scaling.py "$OUT/$name/scaling.h5" -o "$OUT/$name"
}
for s in $SWEEPS; do
  case "$s" in
    strong64K) sweep strong64K --kind strong --n 65536 --ranks 1,2,4,8,16,32,64 ;;
    weak16K) sweep weak16K --kind weak --per-rank 16384 --ranks 1,2,4,8,16,32,64 ;;
    strong1M) sweep strong1M --kind strong --n 1048576 --ranks 1,8,64 ;;
    full16K) sweep full16K --kind strong --n 16384 --ranks 1,2,4,8,16 --deck inputs/scaling/full-16K.in ;;
    *) die "unknown sweep '$s' (strong64K, weak16K, strong1M, full16K)" ;;
  esac
done
