#!/bin/sh
# tests/test_gpu_full.c under the CUDA emulation (test_gpu_full_emu): exact attention on the GPU
# against the CPU op; every test must run and pass (a skip is a failure) in index, shuffled and
# reversed thread order, with deferred stream work, without the memory pool, with
# GPU_TEST_EXACT=reference, and its S-rank test on 2 MPI ranks with 2 emulated devices over
# NCCL (immediate, and deferred + shuffled without the pool).
. "$TESTDIR/tap.sh"
. "$EMU_SRC/tap_cmocka.sh"
F="$EMU_BUILD/test_gpu_full_emu"
cmocka_tap "exact attention, index order" env CUDAEMU_ORDER=index "$F"
cmocka_tap "exact attention, shuffled order (seed 2024), no memory pool" \
  env CUDAEMU_ORDER=shuffle:2024 FMATTN_GPU_POOL=0 "$F"
cmocka_tap "exact attention, deferred streams, reversed order" \
  env CUDAEMU_DEFER=1 CUDAEMU_ORDER=reverse "$F"
cmocka_tap "exact attention, GPU_TEST_EXACT=reference" \
  env GPU_TEST_EXACT=reference CUDAEMU_TEST_FILTER='test_gpu_full_se*' "$F"
cmocka_tap "exact attention on 2 ranks over NCCL" \
  "$MPI_RUN" 2 env CUDAEMU_DEVICES=2 CUDAEMU_TEST_FILTER='test_gpu_full_seq' "$F"
cmocka_tap "exact attention on 2 ranks over NCCL, deferred, shuffled (seed 5), no memory pool" \
  "$MPI_RUN" 2 env CUDAEMU_DEVICES=2 CUDAEMU_DEFER=1 CUDAEMU_ORDER=shuffle:5 FMATTN_GPU_POOL=0 \
  CUDAEMU_TEST_FILTER='test_gpu_full_seq' "$F"
tap_done
