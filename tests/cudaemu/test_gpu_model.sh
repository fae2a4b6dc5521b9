#!/bin/sh
# tests/test_gpu_model.c under the CUDA emulation: the whole model on the emulated GPU equals the
# CPU's in index and shuffled thread order, deferred and without the memory pool, and on 2 ranks
# over NCCL on 2 emulated devices. A skip is a failure: under the emulation there is a GPU.
. "$TESTDIR/tap.sh"
. "$EMU_SRC/tap_cmocka.sh"
G="$EMU_BUILD/test_gpu_model"
cmocka_tap "index order" env CUDAEMU_ORDER=index "$G"
cmocka_tap "shuffled order (seed 99)" env CUDAEMU_ORDER=shuffle:99 "$G"
cmocka_tap "deferred streams, no memory pool" env CUDAEMU_DEFER=1 FMATTN_GPU_POOL=0 "$G"
cmocka_tap "2 ranks on 2 emulated devices (NCCL)" "$MPI_RUN" 2 env CUDAEMU_DEVICES=2 "$G"
tap_done
