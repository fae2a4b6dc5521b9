#!/bin/sh
# The hardware checks fire: each defect of test_faults.cu, run as its own process, must end it
# with a non-zero status and a "cudaemu:" message naming the violation; the defect-free run
# must pass (so the failures are the defects', not the harness's).
. "$TESTDIR/tap.sh"
F="$EMU_BUILD/test_faults"
check "a correct kernel runs (control)" "$F" none
expect_fail "a write one float past the end of an allocation" "past its end" "$F" oob_write
expect_fail "a write 20 KB past the end" "past its end" "$F" oob_far
expect_fail "a write before the start (canary, at cudaFree)" "bytes before its start" "$F" write_before
expect_fail "a read of freed memory through a struct" "use after free" "$F" use_after_free
expect_fail "a freed pointer as kernel argument" "points into freed device memory" "$F" freed_argument
expect_fail "a host pointer as kernel argument" "is a host pointer" "$F" host_pointer_argument
expect_fail "an atomic on host memory" "atomics need device or shared memory" "$F" atomic_on_host
expect_fail "host code reading device memory" "host code accessed device memory" "$F" host_reads_device
# the same with device memory opened allocation by allocation (kernels without guard markers)
expect_fail "past the end, without guard markers" "past its end" env CUDAEMU_GUARD_MARKERS=0 "$F" oob_write
expect_fail "use after free, without guard markers" "use after free" env CUDAEMU_GUARD_MARKERS=0 "$F" use_after_free
expect_fail "host reading device memory, without guard markers" "host code accessed device memory" \
  env CUDAEMU_GUARD_MARKERS=0 "$F" host_reads_device
for order in index reverse shuffle:3; do
  expect_fail "threads exit before a barrier others wait at ($order)" "divergent barrier" \
    env CUDAEMU_ORDER=$order "$F" exit_before_barrier
done
expect_fail "barriers at two call sites" "different __syncthreads" "$F" barrier_sites
expect_fail "a full-mask shuffle that lanes 16-31 never reach" "of mask 0xffffffff" "$F" missing_lanes
expect_fail "a lane calling with a mask that excludes it" "not in its mask" "$F" lane_outside_mask
expect_fail "a warp shuffle waiting for a lane at a barrier" "deadlock" "$F" deadlock
expect_fail "a kernel overflowing its thread's stack" "stack overflow" "$F" stack_overflow
expect_fail "shared memory one row past a __shared__ array" "of the 4224-byte __shared__ tile" "$F" shared_past_end
expect_fail "64 KiB of static shared memory" "ptxas refuses" "$F" static_smem
expect_fail "32 KiB static + 20 KiB dynamic shared memory" "cudaErrorInvalidValue" "$F" static_plus_dynamic_smem
expect_fail "__trap()" "__trap() at" "$F" trap
expect_fail "a GEMM whose A reaches past its allocation" "not inside one device allocation" "$F" cublas_past_end
tap_done
