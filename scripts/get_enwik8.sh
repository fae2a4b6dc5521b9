#!/bin/sh
# Fetch enwik8 (the first 10^8 bytes of an English Wikipedia dump, the byte-level LM benchmark) and
# write it to data/enwik8 (or the path given as $1), checked for size and MD5. Needs internet: on
# an offline machine use scripts/get_kjv.sh. Idempotent; never leaves a partial file as OUT.
# Usage: sh scripts/get_enwik8.sh [OUT]  (fetches with curl, wget or python3; unpacks with unzip or
# python3; ENWIK8_URL names a local mirror)
set -eu

me="get_enwik8.sh"
url="${ENWIK8_URL:-http://mattmahoney.net/dc/enwik8.zip}" # a local mirror may be given
size_want=100000000
md5_want="a1fa5ffddb56f4953e226637dabbb36a"
out="${1:-data/enwik8}"

die() {
  echo "$me: $*" >&2
  exit 1
}

# Debian's interpreter first, then whatever python3 is on PATH (only its standard library is used).
python=""
for p in /usr/bin/python3 python3; do
  if command -v "$p" >/dev/null 2>&1; then
    python="$p"
    break
  fi
done

file_size() {
  wc -c < "$1" | tr -d ' '
}

file_md5() {
  if command -v md5sum >/dev/null 2>&1; then
    md5sum "$1" | cut -d ' ' -f 1
  elif [ -n "$python" ]; then
    "$python" -c 'import hashlib, sys
h = hashlib.md5()
with open(sys.argv[1], "rb") as f:
    for b in iter(lambda: f.read(1 << 20), b""):
        h.update(b)
print(h.hexdigest())' "$1"
  else
    echo "unchecked"
  fi
}

# Checks a file against the known size and MD5; prints what is wrong and fails if anything is.
verify() {
  size=$(file_size "$1")
  if [ "$size" != "$size_want" ]; then
    echo "$1 has $size bytes, expected $size_want"
    return 1
  fi
  md5=$(file_md5 "$1")
  if [ "$md5" != "unchecked" ] && [ "$md5" != "$md5_want" ]; then
    echo "$1 has MD5 $md5, expected $md5_want"
    return 1
  fi
  return 0
}

# Already there and correct: nothing to do. Something else under that name: do not overwrite it.
if [ -e "$out" ]; then
  if why=$(verify "$out"); then
    echo "$me: $out already exists and is enwik8 ($size_want bytes, MD5 $md5_want); nothing to do."
    exit 0
  fi
  die "$why; remove it and run again to fetch a fresh copy."
fi

dir=$(dirname "$out")
mkdir -p "$dir" || die "cannot create directory $dir"
[ -w "$dir" ] || die "directory $dir is not writable"
zip="$out.zip.part"
tmp="$out.part"
trap 'rm -f "$zip" "$tmp"' EXIT
trap 'exit 1' HUP INT TERM

offline_hint="no network?
$me: on a machine without internet access use scripts/get_kjv.sh instead: it writes an English
$me: corpus from Debian's bible-kjv package to data/kjv.txt (see inputs/quickstart.in); or copy
$me: enwik8 ($size_want bytes) from a machine that has it to $out."

# A progress bar for a person at a terminal; in batch logs only errors.
if [ -t 2 ]; then quiet=""; else quiet="-q"; fi

echo "$me: downloading $url"
if command -v curl >/dev/null 2>&1; then
  if [ -n "$quiet" ]; then cflags="-sS"; else cflags="--progress-bar"; fi
  curl -fL $cflags --retry 2 --connect-timeout 30 -o "$zip" "$url" ||
    die "download of $url with curl failed (exit $?): $offline_hint"
elif command -v wget >/dev/null 2>&1; then
  wget $quiet --tries=3 --timeout=30 -O "$zip" "$url" ||
    die "download of $url with wget failed (exit $?): $offline_hint"
elif [ -n "$python" ]; then
  "$python" -c 'import sys, shutil, urllib.request
try:
    with urllib.request.urlopen(sys.argv[1], timeout=30) as r, open(sys.argv[2], "wb") as f:
        shutil.copyfileobj(r, f)
except Exception as e:
    sys.exit(str(e))' "$url" "$zip" ||
    die "download of $url with python3 failed: $offline_hint"
else
  die "neither curl, wget nor python3 is installed (apt-get install curl)"
fi

echo "$me: unpacking $(file_size "$zip") bytes of zip"
if command -v unzip >/dev/null 2>&1; then
  unzip -p "$zip" enwik8 > "$tmp" || die "unzip of $zip failed: is the download complete?"
elif [ -n "$python" ]; then
  "$python" -c 'import sys, shutil, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open("enwik8") as r, open(sys.argv[2], "wb") as f:
    shutil.copyfileobj(r, f)' "$zip" "$tmp" ||
    die "unpacking $zip with python3 failed: is the download complete?"
else
  die "neither unzip nor python3 is installed (apt-get install unzip)"
fi

why=$(verify "$tmp") || die "the download is not enwik8: $why"
mv "$tmp" "$out"
echo "$me: wrote $out ($size_want bytes, MD5 $md5_want)"
