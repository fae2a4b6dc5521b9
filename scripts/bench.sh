#!/bin/sh
# Run fmattn's benchmark mode on a deck (default inputs/bench.in) and plot the result: runs
# `fmattn DECK --set ... --set run.mode=bench`, under mpirun when NP > 1, then
# scripts/plot_bench.py on output.dir/run.name. Times nothing itself; figures come from bench.h5.
# Usage: [NP=4] [OMP_NUM_THREADS=t] scripts/bench.sh [DECK] [--set key=value ...]  (see --help)
set -eu

me="bench.sh"
here=$(cd "$(dirname "$0")" && pwd)
fmattn="${FMATTN:-src/fmattn}"
mpirun="${MPIRUN:-mpirun}"
python="${PYTHON:-/usr/bin/python3}" # Debian's, which has h5py and matplotlib
np="${NP:-1}"

die() {
  echo "$me: $*" >&2
  exit 1
}

usage() {
  cat <<EOF
usage: [NP=P] scripts/bench.sh [DECK] [--set section.key=value ...]
  Runs \`fmattn DECK --set ... --set run.mode=bench\` (DECK defaults to inputs/bench.in), with
  \`mpirun -n P\` when NP > 1, then scripts/plot_bench.py on the run directory
  (output.dir/run.name), which prints a table and writes the PNG plots next to bench.h5.
environment:
  NP               MPI ranks (default 1: no mpirun)
  OMP_NUM_THREADS  threads per rank (default: the cores divided among the ranks)
  FMATTN           the fmattn binary (default src/fmattn)
  MPIRUN           the MPI launcher (default mpirun); MPIRUN_FLAGS extra flags for it
  PYTHON           the interpreter for plot_bench.py (default /usr/bin/python3)
EOF
}

deck="inputs/bench.in"
case "${1:-}" in
  -h | --help)
    usage
    exit 0
    ;;
  "" | --set | --set=*) ;;
  -*) die "unknown option '$1' (see scripts/bench.sh --help)" ;;
  *)
    deck="$1"
    shift
    ;;
esac
# Validate the rest: only `--set key=value` pairs, passed on to fmattn unchanged.
n=$#
i=0
while [ "$i" -lt "$n" ]; do
  case "$1" in
    --set)
      [ $((n - i)) -ge 2 ] || die "--set needs a section.key=value after it"
      set -- "$@" "$1" "$2"
      shift 2
      i=$((i + 2))
      ;;
    --set=*)
      set -- "$@" --set "${1#--set=}"
      shift
      i=$((i + 1))
      ;;
    *) die "unexpected argument '$1': expected [DECK] [--set section.key=value ...]" ;;
  esac
done
# Last, so that it wins over any run.mode in the deck or the --set list.
set -- "$@" --set run.mode=bench

[ -f "$deck" ] || die "deck '$deck' not found (run from the repository root, or give a deck)"
if [ ! -x "$fmattn" ]; then
  die "fmattn binary '$fmattn' not found: build it (./bootstrap && ./configure && make)" \
    "or set FMATTN"
fi
case "$np" in
  '' | *[!0-9]*) die "NP must be a positive integer, got '$np'" ;;
esac
[ "$np" -ge 1 ] || die "NP must be a positive integer, got '$np'"

# Threads: share the cores among the ranks unless the user chose.
cores=$(getconf _NPROCESSORS_ONLN 2>/dev/null || nproc 2>/dev/null || echo 1)
if [ -z "${OMP_NUM_THREADS:-}" ]; then
  t=$((cores / np))
  [ "$t" -ge 1 ] || t=1
  OMP_NUM_THREADS=$t
fi
export OMP_NUM_THREADS

# The launcher: nothing for one rank, else mpirun (Open MPI's flags).
launch=""
if [ "$np" -gt 1 ]; then
  command -v "$mpirun" >/dev/null 2>&1 ||
    die "NP=$np but '$mpirun' is not on PATH (apt-get install openmpi-bin)"
  if [ "$(id -u)" -eq 0 ]; then
    # Open MPI refuses root unless told; containers and fresh cloud nodes often run as root.
    OMPI_ALLOW_RUN_AS_ROOT=1
    OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    export OMPI_ALLOW_RUN_AS_ROOT OMPI_ALLOW_RUN_AS_ROOT_CONFIRM
  fi
  if [ $((np * OMP_NUM_THREADS)) -gt "$cores" ]; then
    # More ranks x threads than cores: let it run (useful to test layouts) but say the timings
    # are not a measurement of the machine; binding would pin several ranks to one core.
    echo "$me: warning: $np ranks x $OMP_NUM_THREADS thread(s) > $cores cores:" \
      "oversubscribed, the timings are not meaningful" >&2
    bind="--oversubscribe --bind-to none"
  else
    # One rank per OMP_NUM_THREADS cores, its threads kept on them (Open MPI binds each rank to
    # a single core by default for np <= 2, which would serialise its threads).
    bind="--map-by slot:PE=$OMP_NUM_THREADS --bind-to core"
  fi
  launch="$mpirun -n $np $bind${MPIRUN_FLAGS:+ $MPIRUN_FLAGS} -x OMP_NUM_THREADS"
fi

# Where will bench.h5 go? Ask fmattn for the resolved deck, under the same launcher so that the
# deck is checked for this rank count before the benchmark starts, and read [output] dir and
# [run] name from it.
# shellcheck disable=SC2086 # $launch is a word list on purpose
resolved=$($launch "$fmattn" --check "$deck" "$@") ||
  die "fmattn --check rejected the deck (message above)"
ini_value() { # section key: the value of `key = value` in [section] of $resolved
  printf '%s\n' "$resolved" | awk -v s="[$1]" -v k="$2" '
    /^[ \t]*\[/ { gsub(/[ \t]/, ""); sec = $0; next }
    sec == s {
      line = $0; sub(/^[ \t]*/, "", line)
      if (index(line, k) == 1) {
        rest = substr(line, length(k) + 1)
        if (rest ~ /^[ \t]*=/) {
          sub(/^[ \t]*=[ \t]*/, "", rest); sub(/[ \t\r]*$/, "", rest); print rest; exit
        }
      }
    }'
}
outdir=$(ini_value output dir)
name=$(ini_value run name)
[ -n "$name" ] || die "could not read [run] name from \`fmattn --check\`"
rundir="${outdir:-runs}/$name"

echo "$me: ${launch:+$launch }$fmattn $deck $* (OMP_NUM_THREADS=$OMP_NUM_THREADS)"
# shellcheck disable=SC2086
$launch "$fmattn" "$deck" "$@" || die "fmattn failed (exit $?)"

[ -f "$rundir/bench.h5" ] || die "fmattn finished but $rundir/bench.h5 is missing"
echo "$me: plotting $rundir/bench.h5"
"$python" "$here/plot_bench.py" "$rundir" ||
  die "plot_bench.py failed; the figures are in $rundir/bench.h5"
