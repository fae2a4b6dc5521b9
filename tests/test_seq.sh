#!/bin/sh
# Sequence parallelism equals one rank (SPEC §7): test_seq (a C program) compares every variant's
# distributed forward and backward with the 1-rank result, for S = 1, 2, 4 and 8 ranks
# (oversubscribed on small machines), and the fma variants on 16, where two and three levels'
# windows span ranks (at n = 64, slabs of one fine block); each of its checks is reported here.
. "$TESTDIR/tap.sh"
cd "$WORK" || exit 1
for run in 1 2 4 8 16:fma 16:fma_linear 16:fma_open; do
  S=${run%%:*}
  only=
  case "$run" in *:*) only=${run#*:} ;; esac
  out=$("$MPI_RUN" "$S" "${BUILDDIR:-$TESTDIR}/test_seq" $only 2>&1)
  rc=$?
  printf '%s\n' "$out" | grep -E '^(ok|not ok) ' > results.txt
  while IFS= read -r line; do
    case "$line" in
      "not ok "*) not_ok "${line#not ok * - }" ;;
      "ok "*) ok "${line#ok * - }" ;;
    esac
  done < results.txt
  if [ "$rc" -ne 0 ] && ! grep -q '^not ok' results.txt; then
    not_ok "test_seq on $S ranks exited with status $rc" "$(printf '%s\n' "$out" | tail -n 20)"
  fi
done
tap_done
