#!/bin/sh
# Every C source under src/ and tests/, and every CUDA source and header under gpu/, is formatted
# as the checked-in .clang-format says (STYLE.md rule 12); `make format` fixes what this reports.
. "$TESTDIR/tap.sh"
if ! command -v clang-format >/dev/null 2>&1; then
  not_ok "clang-format is installed (scripts/install-deps.sh installs it)"
  tap_done; exit 1
fi
for f in "$SRCDIR"/src/*.[ch] "$SRCDIR"/src/*/*.[ch] "$SRCDIR"/gpu/*.cu "$SRCDIR"/gpu/*.h \
  "$SRCDIR"/tests/*.c "$SRCDIR"/tests/*.h; do
  [ -e "$f" ] || continue
  if out=$(clang-format --style=file --dry-run --Werror "$f" 2>&1); then :; else
    not_ok "${f#"$SRCDIR"/} is clang-formatted (run make format)" "$(printf '%s\n' "$out" | head -n 6)"
    bad=1
  fi
done
[ -z "${bad:-}" ] && ok "every C and CUDA source is clang-formatted"
tap_done
