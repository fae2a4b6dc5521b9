#!/bin/sh
# The emulation's primitives (test_primitives.cu) in every thread order: index, reversed, and two
# seeded shuffles; the order test inside checks that the order asked for is the one that ran.
# Also with 3 emulated devices, and built with the portable (ucontext) coroutine switch.
. "$TESTDIR/tap.sh"
. "$EMU_SRC/tap_cmocka.sh"
for order in index reverse shuffle:1 shuffle:2024; do
  cmocka_tap "order $order" env CUDAEMU_ORDER=$order "$EMU_BUILD/test_primitives"
done
cmocka_tap "3 emulated devices" env CUDAEMU_DEVICES=3 "$EMU_BUILD/test_primitives"
cmocka_tap "ucontext switch, shuffle:5" env CUDAEMU_ORDER=shuffle:5 "$EMU_BUILD/test_primitives_uc"
tap_done
