# TAP helpers for the shell tests (sourced). Each check prints one "ok N - what" or
# "not ok N - what" line; tap_done prints the plan and exits non-zero when any check failed.
# Work happens in a fresh directory under $TMPDIR (default /tmp), removed on success.
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
# need_h5py: for a script whose checks read HDF5 files with h5py. Where configure found no python3
# with h5py and numpy (HAVE_H5PY=no), the whole script is one TAP skip saying so, and it ends.
need_h5py() {
  [ "${HAVE_H5PY:-yes}" = yes ] && return 0
  echo "1..0 # SKIP configure found no python3 with h5py and numpy (Debian: python3-h5py)"
  rm -rf "$WORK"
  exit 0
}
# tap_program "what" STATUS FILE [REASON]: one check for a TAP program (a cmocka test) that exited
# with STATUS and wrote FILE. Not ok on a non-zero status, a "not ok" without "# SKIP" or no plan;
# a TAP skip when nothing ran — a plan "1..0 # SKIP why", or every test skipped (cmocka writes
# "not ok N # SKIP name") — for why or REASON; else ok for the tests that ran, and a skip for the
# rest. A skipped test never counts as run.
tap_program() {
  what="$1" status="$2" file="$3" reason="${4:-}"
  total=$(grep -c '^\(not \)\{0,1\}ok [0-9]' "$file")
  skipped=$(grep '^\(not \)\{0,1\}ok [0-9]' "$file" | grep -c '# *SKIP')
  failed=$(grep '^not ok [0-9]' "$file" | grep -vc '# *SKIP')
  why=$(sed -n 's/^1\.\.0 *# *SKIP[: ]*//p' "$file" | head -n 1)
  ran=$((total - skipped))
  if [ "$status" -ne 0 ] || [ "$failed" -gt 0 ] || ! grep -q '^1\.\.[0-9]' "$file"; then
    not_ok "$what: $failed of $total tests failed, status $status" "$(tail -n 40 "$file")"
  elif [ "$ran" -eq 0 ]; then
    ok "$what # SKIP ${why:-${reason:-all $total tests skipped}}"
  else
    ok "$what: $ran tests ran and passed"
    [ "$skipped" -eq 0 ] || ok "$what: $skipped more tests # SKIP ${reason:-skipped}"
  fi
}
# skip_all "what # SKIP why": the whole script is this one skipped check, and it ends.
skip_all() {
  ok "$1"
  tap_done
  exit 0
}
# copy_source_tree WHAT: the tracked files of $SRCDIR copied into $WORK/tree, a clean tree for a
# build of its own; without a git checkout to copy from, the script is one skip of WHAT.
copy_source_tree() {
  git -C "$SRCDIR" rev-parse --git-dir > /dev/null 2>&1 ||
    skip_all "$1 # SKIP the source tree is not a git checkout to copy from"
  mkdir "$WORK/tree"
  git -C "$SRCDIR" ls-files -z | (cd "$SRCDIR" && xargs -0 tar -cf -) | tar -xf - -C "$WORK/tree"
}
