# TAP helper for the CUDA emulation's scripts (sourced after tests/tap.sh): run a cmocka program
# and re-emit each of its tests as one "ok"/"not ok" line labelled with the configuration, so that
# one script can run a program in several thread orders or stream modes. A skipped test, a
# crash or a non-zero status is a failure: under the emulation there is always a GPU.
cmocka_tap() {
  label="$1"; shift
  out=$("$@" 2>&1); rc=$?
  results=$(printf '%s\n' "$out" | grep -E '^(not )?ok [0-9]+')
  if [ -z "$results" ]; then
    not_ok "$label: no test ran (status $rc)" "$(printf '%s\n' "$out" | tail -n 30)"
    return 0
  fi
  printf '%s\n' "$results" | {
    while IFS= read -r line; do
      case "$line" in
        *"# SKIP"*) echo "not ok - $label: ${line#*- } (skipped: under the emulation there is a GPU)" ;;
        "not ok"*) echo "not ok - $label: ${line#*- }" ;;
        *) echo "ok - $label: ${line#*- }" ;;
      esac
    done
  } > "$WORK/results.$$"
  while IFS= read -r line; do
    case "$line" in
      "not ok"*) not_ok "${line#not ok - }" "$(printf '%s\n' "$out" | grep -v '^ok ' | tail -n 25)" ;;
      *) ok "${line#ok - }" ;;
    esac
  done < "$WORK/results.$$"
  if [ "$rc" -ne 0 ] && ! printf '%s\n' "$results" | grep -q '^not ok'; then
    not_ok "$label: exited with status $rc" "$(printf '%s\n' "$out" | tail -n 25)"
  fi
  return 0
}
