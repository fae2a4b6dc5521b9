#!/bin/sh
# Streams and events (test_streams.cu) immediate and deferred: the stream whose work was queued
# last drained first, and a seeded drain order.
. "$TESTDIR/tap.sh"
. "$EMU_SRC/tap_cmocka.sh"
cmocka_tap "immediate" env -u CUDAEMU_DEFER "$EMU_BUILD/test_streams"
cmocka_tap "deferred, last queued first" env CUDAEMU_DEFER=1 "$EMU_BUILD/test_streams"
cmocka_tap "deferred, shuffled" env CUDAEMU_DEFER=shuffle:7 "$EMU_BUILD/test_streams"
tap_done
