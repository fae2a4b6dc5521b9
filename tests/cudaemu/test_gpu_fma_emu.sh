#!/bin/sh
# tests/test_gpu_fma.c under the CUDA emulation (test_gpu_fma_emu): every test must run and pass
# (a skip is a failure: under the emulation there is a GPU) in index, reversed and shuffled thread
# order, with deferred stream work, without the memory pool, and its sequence-parallel test on 2
# ranks (2 emulated devices, NCCL; also deferred) and on 8, where windows span ranks.
. "$TESTDIR/tap.sh"
. "$EMU_SRC/tap_cmocka.sh"
G="$EMU_BUILD/test_gpu_fma_emu"
SEQ="test_gpu_fma_seq*"  # fp32 and bf16
cmocka_tap "index order" env CUDAEMU_ORDER=index "$G"
cmocka_tap "reversed order, no memory pool (every block exactly its size)" env CUDAEMU_ORDER=reverse FMATTN_GPU_POOL=0 "$G"
cmocka_tap "shuffled order (seed 12345)" env CUDAEMU_ORDER=shuffle:12345 "$G"
cmocka_tap "deferred streams, shuffled order (seed 7), no memory pool" env CUDAEMU_DEFER=1 CUDAEMU_ORDER=shuffle:7 FMATTN_GPU_POOL=0 "$G"
cmocka_tap "2 ranks on 2 emulated devices" "$MPI_RUN" 2 env CUDAEMU_DEVICES=2 CUDAEMU_TEST_FILTER="$SEQ" "$G"
cmocka_tap "2 ranks on 2 emulated devices, deferred, shuffled (seed 3), no memory pool" \
  "$MPI_RUN" 2 env CUDAEMU_DEVICES=2 CUDAEMU_DEFER=1 CUDAEMU_ORDER=shuffle:3 FMATTN_GPU_POOL=0 CUDAEMU_TEST_FILTER="$SEQ" "$G"
cmocka_tap "8 ranks on 8 emulated devices (windows spanning ranks)" \
  "$MPI_RUN" 8 env CUDAEMU_DEVICES=8 CUDAEMU_ORDER=shuffle:5 CUDAEMU_TEST_FILTER="$SEQ" "$G"
tap_done
