#!/bin/sh
# Write an English corpus for offline machines: the King James Bible as plain text, from Debian's
# bible-kjv package (about 4.3 MB), to data/kjv.txt (or the path given). Idempotent.
set -eu
out="${1:-data/kjv.txt}"
if [ -s "$out" ]; then
  echo "get_kjv.sh: $out already exists ($(wc -c < "$out") bytes)"
  exit 0
fi
if ! command -v bible >/dev/null 2>&1; then
  echo "get_kjv.sh: the 'bible' program is missing; install it with: apt-get install bible-kjv" >&2
  exit 1
fi
mkdir -p "$(dirname "$out")"
# Non-interactive: the whole canon as one verse range, wrapped at 80 columns.
COLUMNS=80 bible Genesis1:1-Revelation22:21 < /dev/null > "$out.tmp"
size=$(wc -c < "$out.tmp")
if [ "$size" -lt 4000000 ]; then
  echo "get_kjv.sh: expected about 4.3 MB of text, got $size bytes" >&2
  rm -f "$out.tmp"
  exit 1
fi
mv "$out.tmp" "$out"
echo "get_kjv.sh: wrote $out ($size bytes)"
