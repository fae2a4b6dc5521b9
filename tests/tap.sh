# TAP helpers for the shell tests (sourced). Each check prints one "ok N - what" or
# "not ok N - what" line; tap_done prints the plan and exits non-zero when any check failed.
# Work happens in a fresh directory under the build tree, removed on success.
tap_n=0
tap_failed=0
WORK="${TMPDIR:-/tmp}/fmattn-test-$(basename "$0" .sh)-$$"
rm -rf "$WORK" && mkdir -p "$WORK"

ok() { tap_n=$((tap_n + 1)); echo "ok $tap_n - $1"; }
not_ok() {
  tap_n=$((tap_n + 1)); tap_failed=$((tap_failed + 1))
  echo "not ok $tap_n - $1"
  [ -n "${2:-}" ] && printf '%s\n' "$2" | sed 's/^/# /'
  return 0
}
# check "what" command...: ok when the command succeeds
check() {
  what="$1"; shift
  if out=$("$@" 2>&1); then ok "$what"; else not_ok "$what" "$out"; fi
}
# expect_fail "what" "needle" command...: the command must exit non-zero and print needle
expect_fail() {
  what="$1"; needle="$2"; shift 2
  out=$("$@" 2>&1); rc=$?
  if [ "$rc" -eq 0 ]; then not_ok "$what (exit status 0)" "$out"
  elif ! printf '%s' "$out" | grep -qF -- "$needle"; then not_ok "$what (no '$needle')" "$out"
  else ok "$what"; fi
}
tap_done() {
  echo "1..$tap_n"
  if [ "$tap_failed" -eq 0 ]; then rm -rf "$WORK"; else echo "# work kept in $WORK"; fi
  [ "$tap_failed" -eq 0 ]
}
# py SCRIPT args...: Debian's python3 with h5py
py() { "${PYTHON3:-/usr/bin/python3}" "$@"; }
