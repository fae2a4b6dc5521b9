#!/bin/sh
# The CUDA build as a compile check (issue 8): where nvcc is installed, a copy of the source tree
# is configured --with-cuda and built, GPU back end and its tests included, and the GPU test
# program runs: on a machine without a GPU that is a TAP skip, never a pass (tap_program).
. "$TESTDIR/tap.sh"
cd "$WORK" || exit 1
# CUDA_HOME: as set, else /usr/local/cuda, else the toolkit that nvcc on PATH belongs to (nvcc may
# be a wrapper script elsewhere, so ask nvcc for its TOP rather than taking its bin/'s parent).
cuda_ok() { [ -x "$1/bin/nvcc" ] && [ -f "$1/include/cuda_runtime.h" ]; }
if [ -z "${CUDA_HOME:-}" ]; then
  if cuda_ok /usr/local/cuda; then
    CUDA_HOME=/usr/local/cuda
  elif command -v nvcc > /dev/null; then
    top=$(nvcc --dryrun -x cu -c /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -n 1)
    [ -n "$top" ] && CUDA_HOME=$(cd "$top" 2> /dev/null && pwd)
  fi
fi
if [ -z "${CUDA_HOME:-}" ] || ! cuda_ok "$CUDA_HOME"; then
  ok "./configure --with-cuda && make # SKIP no CUDA toolkit (nvcc and cuda_runtime.h) found; install it, or set CUDA_HOME"
  tap_done
  exit 0
fi
if ! git -C "$SRCDIR" rev-parse --git-dir > /dev/null 2>&1; then
  ok "./configure --with-cuda && make # SKIP the source tree is not a git checkout to copy from"
  tap_done
  exit 0
fi
# A clean copy of the tracked files (the source tree itself is configured for the CPU build).
mkdir tree
git -C "$SRCDIR" ls-files -z | (cd "$SRCDIR" && xargs -0 tar -cf -) | tar -xf - -C tree
[ -e "$SRCDIR/data/kjv.txt" ] && mkdir -p tree/data && ln -s "$SRCDIR/data/kjv.txt" tree/data/kjv.txt
cd tree || exit 1
# The build here is its own: not the enclosing `make check`'s (whose MAKEFLAGS carry its
# TEST_LOGS, the whole suite's logs, which would make `check TESTS=` below run every test again).
unset MAKEFLAGS MFLAGS MAKELEVEL
gpu_tests="test_gpu test_gpu_model test_gpu_full test_gpu_fma"
check "./bootstrap" ./bootstrap
check "./configure --with-cuda=$CUDA_HOME" ./configure --with-cuda="$CUDA_HOME"
check "make: the program, gpu/libfmattn_gpu.a, and every test program (the GPU tests with them)" sh -c \
  "make -j2 > make.log 2>&1 && make -C tests -j2 check TESTS= TEST_LOGS= >> make.log 2>&1 && test -f gpu/libfmattn_gpu.a || { tail -n 30 make.log; exit 1; }"
check "the CPU program still runs" sh -c "src/fmattn --version"
# the CUDA objects follow their headers (nvcc -MD): a struct of src/ changed under them rebuilds
# them, where they once kept the old layout and the program faulted on a GPU
check "a header of src/ changed: make rebuilds the CUDA objects that include it" sh -c \
  "touch src/attention/attention.h && make -C gpu -n libfmattn_gpu.a | grep -q 'fma_evaluate\.cu'"
# issue 27 §4: the FMA kernels index in 32 bits (a 64-bit division is ~20 instructions on a GPU)
check "no 64-bit division or remainder in the PTX of the FMA kernels" sh -c \
  "make -C gpu ptx > ptx.log 2>&1 || { tail -n 20 ptx.log; exit 1; }; ! grep -nE '(div|rem)\.[su]64' gpu/*.ptx"
# the GPU tests on this machine: passed where they ran on a GPU, a skip where they could not
for t in $gpu_tests; do
  tests/$t > $t.tap 2>&1
  tap_program "tests/$t" $? $t.tap "no GPU"
done
tap_done
