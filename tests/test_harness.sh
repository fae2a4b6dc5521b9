#!/bin/sh
# The test harness's own paths that a normal run does not take: tap_program (tap.sh) on the TAP
# a cmocka program writes when it passes, fails or skips, and every script that reads HDF5 through
# h5py ends as one TAP skip, with the reason, where configure found no h5py (HAVE_H5PY=no).
. "$TESTDIR/tap.sh"
cd "$WORK" || exit 1

# report STATUS TEXT: tap_program's lines for a program that exited STATUS and wrote TEXT
report() {
  printf '%s\n' "$2" > program.tap
  (tap_n=0 tap_failed=0; tap_program "prog" "$1" program.tap "no GPU")
}
# expect "what" STATUS TEXT WANT: tap_program's report is exactly WANT
expect() {
  got=$(report "$2" "$3")
  if [ "$got" = "$4" ]; then ok "$1"; else not_ok "$1" "got:
$got
wanted:
$4"; fi
}
pass=$(printf '1..2\nok 1 - a\nok 2 - b\n# ok - tests')
expect "every test passed: ok, counting them" 0 "$pass" "ok 1 - prog: 2 tests ran and passed"
expect "a skip-all plan: a skip with its reason" 0 "1..0 # SKIP no GPU: no device" \
  "ok 1 - prog # SKIP no GPU: no device"
cm=$(printf '1..2\nskipped: no GPU\nnot ok 1 # SKIP a\nskipped: no GPU\nnot ok 2 # SKIP b\n# ok - t')
expect "cmocka's skipped tests (not ok, a SKIP directive): a skip, not a pass, not a failure" 0 "$cm" \
  "ok 1 - prog # SKIP no GPU"
mixed=$(printf '1..2\nok 1 - a\nnot ok 2 # SKIP b\n')
expect "one passed, one skipped: the skipped one is not counted as run" 0 "$mixed" \
  "$(printf 'ok 1 - prog: 1 tests ran and passed\nok 2 - prog: 1 more tests # SKIP no GPU')"
case "$(report 1 "$(printf '1..2\nok 1 - a\nnot ok 2 - b\n')")" in
  "not ok 1 - prog: 1 of 2 tests failed, status 1"*) ok "a failed test: not ok" ;;
  *) not_ok "a failed test: not ok" "$(report 1 "$(printf '1..2\nok 1 - a\nnot ok 2 - b\n')")" ;;
esac
case "$(report 139 "$(printf '1..2\nok 1 - a\n')")" in
  "not ok 1 - prog: 0 of 1 tests failed, status 139"*) ok "a crash after passing tests: not ok" ;;
  *) not_ok "a crash after passing tests: not ok" "$(report 139 "$(printf '1..2\nok 1 - a\n')")" ;;
esac
case "$(report 0 "")" in
  "not ok 1 - "*) ok "no TAP at all: not ok" ;;
  *) not_ok "no TAP at all: not ok" "$(report 0 "")" ;;
esac

# Every script that reads HDF5 through Python calls need_h5py, and without h5py says so.
uses=""
for t in "$TESTDIR"/test_*.sh; do
  [ "$t" = "$TESTDIR/test_harness.sh" ] && continue
  grep -q 'h5check.py\|kernel_files.py\|torch_reference.py\|h5py\|scripts/[a-z_]*\.py' "$t" || continue
  name=$(basename "$t")
  uses="$uses $name"
  if ! grep -q '^need_h5py$' "$t"; then
    not_ok "$name reads HDF5 through Python: it calls need_h5py"
    continue
  fi
  out=$(HAVE_H5PY=no FMATTN=/nonexistent/fmattn sh "$t" 2>&1)
  rc=$?
  if [ "$rc" -eq 0 ] && [ "$out" = "1..0 # SKIP configure found no python3 with h5py and numpy (Debian: python3-h5py)" ]; then
    ok "$name without h5py: one TAP skip with the reason"
  else
    not_ok "$name without h5py: one TAP skip with the reason (status $rc)" "$out"
  fi
done
check "the scripts that read HDF5 through Python were found ($uses)" test -n "$uses"
tap_done
