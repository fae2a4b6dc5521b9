#!/bin/sh
# The emulated NCCL over MPI: the collectives of test_nccl.cu on 2 ranks with 2 emulated devices
# (and 3 ranks on 3), then the refusal of 2 ranks on one device, and of a send and its receive
# of different counts (planted: NCCL would hang).
. "$TESTDIR/tap.sh"
. "$EMU_SRC/tap_cmocka.sh"
cmocka_tap "2 ranks, 2 devices" "$MPI_RUN" 2 env CUDAEMU_DEVICES=2 "$EMU_BUILD/test_nccl"
cmocka_tap "3 ranks, 3 devices" "$MPI_RUN" 3 env CUDAEMU_DEVICES=3 "$EMU_BUILD/test_nccl"
check "2 ranks on one device: ncclCommInitRank refuses (ncclInvalidUsage, Duplicate GPU)" \
  "$MPI_RUN" 2 env CUDAEMU_DEVICES=1 "$EMU_BUILD/test_nccl" refuse
expect_fail "a receive longer than its send is refused (NCCL would hang)" "must have one count" \
  "$MPI_RUN" 2 env CUDAEMU_DEVICES=2 "$EMU_BUILD/test_nccl" longer-recv
expect_fail "a send longer than its receive is refused" "met an ncclSend of 32 bytes" \
  "$MPI_RUN" 2 env CUDAEMU_DEVICES=2 "$EMU_BUILD/test_nccl" longer-send
tap_done
