#!/bin/sh
# Debug mode (gpu.debug) finds a faulting kernel: test_debug.cu plants a write past an allocation;
# run as a GPU runs it (deferred streams, the fault a sticky error), the job ends with one message
# naming the kernel when debug is on, and at a later call advising gpu.debug when it is off.
. "$TESTDIR/tap.sh"
D="$EMU_BUILD/test_debug"
export CUDAEMU_DEFER=1 CUDAEMU_FAULTS=sticky
check "no defect: the program runs to the end (control)" "$D" clean
expect_fail "debug on: the fault is reported naming its kernel" \
  "error: kernel planted_oob failed on the device: an illegal memory access" "$D" debug
out=$("$D" nodebug 2>&1); rc=$?
if [ "$rc" -ne 0 ] && printf '%s' "$out" | grep -q "error: .*illegal memory access.*gpu.debug = true" &&
  ! printf '%s' "$out" | grep -q "error: kernel planted_oob"; then
  ok "debug off: the fault surfaces at a later call, which advises gpu.debug"
else
  not_ok "debug off: the fault surfaces at a later call, which advises gpu.debug" "$out"
fi
# the emulation's default: the same defect ends the run at the faulting write itself
out=$(env CUDAEMU_FAULTS=abort "$D" nodebug 2>&1); rc=$?
if [ "$rc" -ne 0 ] && printf '%s' "$out" | grep -q "illegal device memory access in kernel .*planted_oob" &&
  ! printf '%s' "$out" | grep -q "error:"; then
  ok "without CUDAEMU_FAULTS=sticky the emulation stops at the fault"
else
  not_ok "without CUDAEMU_FAULTS=sticky the emulation stops at the fault" "$out"
fi
tap_done
