#!/usr/bin/env python3
"""Per-kernel device time from an Nsight Compute CSV (docs/gpu.md).

    python3 scripts/ncu_kernels.py NCU_CSV [--runs N] [--out TABLE.csv]

NCU_CSV is what `ncu --csv --metrics gpu__time_duration.sum --log-file NCU_CSV ...` wrote (the
lines ncu prints before the header are skipped). Each kernel's launches are summed under its
name without arguments or namespaces (`softmax_forward_held<8>`), divided by --runs (the passes
the profiled program made: bench mode's warm-up and timed repetitions, 2 with bench.repeats = 1),
and printed slowest first with their share of the whole. scripts/gpu_check.sh runs it on the
profile of fmattn's own kernels in the fma bench.
"""
import argparse
import csv
import re
import sys

UNITS = {"ns": 1e-6, "nsecond": 1e-6, "us": 1e-3, "usecond": 1e-3, "ms": 1.0, "msecond": 1.0,
         "s": 1e3, "second": 1e3}


def kernel_name(full):
    """`void <unnamed>::softmax_forward_held<8>(float *, ...)` -> `softmax_forward_held<8>`."""
    name = full.strip()
    if name.startswith("void "):
        name = name[len("void "):]
    depth, cut = 0, len(name)  # the argument list: the first '(' outside template brackets
    for i, ch in enumerate(name):
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0:
            cut = i
            break
    name = name[:cut]
    base = re.sub(r"<[^<>]*>$", "", name)  # the namespaces of the name, not of its template
    prefix = base.rsplit("::", 1)[0] + "::" if "::" in base else ""
    return name[len(prefix):]


def read(path):
    """{kernel: [launches, milliseconds]} of one ncu CSV."""
    with open(path, newline="") as f:
        lines = [line for line in f if line.startswith('"')]
    if not lines:
        sys.exit(f"ncu_kernels.py: {path} holds no CSV rows (did ncu profile any kernel?)")
    times = {}
    for row in csv.DictReader(lines):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        unit = row.get("Metric Unit", "")
        if unit not in UNITS:
            sys.exit(f"ncu_kernels.py: {path}: unknown time unit {unit!r}")
        ms = float(row["Metric Value"].replace(",", "")) * UNITS[unit]
        entry = times.setdefault(kernel_name(row["Kernel Name"]), [0, 0.0])
        entry[0] += 1
        entry[1] += ms
    if not times:
        sys.exit(f"ncu_kernels.py: {path} has no gpu__time_duration.sum rows")
    return times


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv", help="ncu --csv --log-file output")
    ap.add_argument("--runs", type=int, default=1,
                    help="passes the profiled program made (per-pass times are printed)")
    ap.add_argument("--out", help="write the table as CSV here too")
    a = ap.parse_args()
    if a.runs < 1:
        sys.exit("ncu_kernels.py: --runs must be at least 1")
    times = read(a.csv)
    total = sum(ms for _, ms in times.values())
    rows = sorted(((k, n, ms / a.runs) for k, (n, ms) in times.items()), key=lambda r: -r[2])
    width = min(48, max(len(k) for k, _, _ in rows))  # cuBLAS's names run to hundreds
    print(f"# {a.csv}: {len(rows)} kernels, {total / a.runs:.3f} ms per pass ({a.runs} passes)")
    print(f"{'kernel':{width}s} {'launches':>9s} {'ms/pass':>9s} {'share':>6s}")
    for k, n, ms in rows:
        shown = k if len(k) <= width else k[:width - 3] + "..."
        print(f"{shown:{width}s} {n:9d} {ms:9.3f} {100 * ms * a.runs / total:5.1f}%")
    if a.out:
        with open(a.out, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["kernel", "launches", "ms_per_pass"])
            for k, n, ms in rows:
                w.writerow([k, n, f"{ms:.6f}"])


if __name__ == "__main__":
    main()
