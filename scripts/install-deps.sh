#!/bin/sh
# Install, as root on Debian 12, the packages needed to build, run and test fmattn (compilers and
# Autotools, Open MPI, parallel and serial HDF5, SimGrid, OpenBLAS, libxsmm, libinih, cmocka, clang-format,
# clang's libFuzzer, SLURM and munge for the cluster test, the KJV corpus, and Debian's Python 3
# with h5py, numpy, matplotlib and torch for the scripts and reference tests).
# Idempotent: when every package is already installed it does not touch apt at all (and needs no
# root). Usage: sh scripts/install-deps.sh. CUDA, cuBLAS and NCCL (--with-cuda) are not installed.
set -eu

me="install-deps.sh"

# One package a line; the comment says who needs it.
packages="
build-essential
autoconf
automake
libtool
pkg-config
libopenmpi-dev
openmpi-bin
libhdf5-openmpi-dev
libhdf5-dev
libsimgrid-dev
zlib1g-dev
hdf5-tools
libopenblas-dev
libopenblas-openmp-dev
libxsmm-dev
libinih-dev
libcmocka-dev
clang-format
clang
libclang-rt-14-dev
slurm-wlm
munge
bible-kjv
python3
python3-h5py
python3-numpy
python3-matplotlib
python3-torch
"
# build-essential .. pkg-config: compile and ./bootstrap; libopenmpi-dev, openmpi-bin: MPI and
# mpirun; libhdf5-openmpi-dev: parallel HDF5; libhdf5-dev: serial HDF5 (--with-hdf5=serial, and
# SimGrid SMPI); libsimgrid-dev: smpicc/smpirun for the simulated clusters; hdf5-tools: h5dump/h5ls
# in tests; libopenblas-*: CBLAS (the OpenMP build, so OMP_NUM_THREADS sets BLAS threads);
# libinih-dev: deck parser; zlib1g-dev: checkpoint checksums (CRC-32); libcmocka-dev: unit tests;
# clang-format: `make check` format gate; clang, libclang-rt-14-dev: the libFuzzer deck fuzzer
# (tests/test_fuzz.sh); slurm-wlm, munge: the one-node SLURM cluster of tests/test_slurm.sh;
# bible-kjv: scripts/get_kjv.sh; python3-*: scripts/plot_*.py, scripts/scaling.py and the PyTorch
# reference tests.

# The same list on one line, and its length, for messages (no external tools: PATH may be bare).
all=""
count=0
for p in $packages; do
  all="$all $p"
  count=$((count + 1))
done

if ! command -v dpkg-query >/dev/null 2>&1 || ! command -v apt-get >/dev/null 2>&1; then
  echo "$me: this needs an apt-based system (Debian 12): dpkg-query or apt-get not found." >&2
  echo "$me: on other systems install the equivalents of:$all" >&2
  exit 1
fi

# Which packages are missing? dpkg-query prints "install ok installed" only for a complete install.
missing=""
for p in $packages; do
  status=$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)
  if [ "$status" != "install ok installed" ]; then
    missing="$missing $p"
  fi
done

if [ -z "$missing" ]; then
  echo "$me: all $count packages are already installed; nothing to do."
  exit 0
fi

if [ "$(id -u)" -ne 0 ]; then
  echo "$me: must run as root to install:$missing" >&2
  echo "$me: try: sudo sh $0" >&2
  exit 1
fi

if [ -r /etc/os-release ]; then
  # shellcheck disable=SC1091
  . /etc/os-release
  if [ "${ID:-}" != "debian" ] || [ "${VERSION_ID:-}" != "12" ]; then
    echo "$me: warning: written for Debian 12, this is ${PRETTY_NAME:-unknown};" \
      "package names may differ." >&2
  fi
fi

echo "$me: installing:$missing"
export DEBIAN_FRONTEND=noninteractive
apt-get update
# shellcheck disable=SC2086 # $missing is a word list on purpose
apt-get install -y --no-install-recommends $missing
echo "$me: done; installed:$missing"
