#!/usr/bin/python3
# Plot an fmattn bench run: reads runs/<name>/bench.h5 (SPEC section 11), prints its figures as text
# tables and writes attention_time.png, attention_scaled.png, attention_gflops.png, workspace.png,
# and train_mfu.png / comm_bytes.png when those groups exist. Read-only: it reports what the run
# measured, never times anything. Usage: scripts/plot_bench.py RUN_DIR_or_bench.h5 [-o OUT_DIR]
import argparse
import math
import os
import sys

# A reader's HDF5 lock could make a concurrent fmattn fail to open the file; never take one.
os.environ.setdefault("HDF5_USE_FILE_LOCKING", "FALSE")

from fmattn_h5 import h5py  # noqa: E402
import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from fmattn_deck import deck_values  # noqa: E402
from fmattn_h5 import group_columns, root_attrs, run_file  # noqa: E402
from fmattn_plot import byte_unit, log_ticks, save  # noqa: E402

PROG = "plot_bench.py"
MIB = 1024.0 * 1024.0


def note(msg):
    print(f"{PROG}: {msg}")


def die(msg):
    print(f"{PROG}: error: {msg}", file=sys.stderr)
    sys.exit(1)


def load(path):
    """{group: {name: 1-D array}} (strings decoded, numbers as float) and the root attributes."""
    groups, attrs = {}, {}
    try:
        with h5py.File(path, "r") as f:
            attrs = root_attrs(f)
            for g in ("attention", "train", "comm"):
                cols = group_columns(f, g)
                if cols is not None:
                    groups[g] = cols
    except OSError as e:
        die(f"cannot read {path}: {e}")
    return groups, attrs


def col(g, name, k):
    """Column `name` of group g, or k NaNs when the file lacks it."""
    c = g.get(name)
    return c if c is not None else np.full(k, np.nan)


def lines_by(g, label_cols):
    """Row indices grouped into one line per distinct label (variant, plus causal / seq_ranks when a
    file mixes them), each sorted by n; labels in order of first appearance."""
    k = len(g["n"])
    out = {}
    for i in range(k):
        parts = []
        for c, fmt in label_cols:
            if c in g:
                parts.append(fmt(g[c][i]))
        if parts:
            parts[0] += open_label(g, i)  # the variant: fma's rows at each fma.open apart
        label = " ".join(p for p in parts if p)
        out.setdefault(label, []).append(i)
    for label in out:
        out[label] = sorted(out[label], key=lambda i: g["n"][i])
    return out


def open_label(g, i):
    """fma's rows at fma.open = K (the bench.h5 column open; -1: all) read fma/oK, as the console."""
    if "open" not in g:
        return ""
    o = g["open"][i]
    return "" if not np.isfinite(o) or o == 0 else ("/all" if o < 0 else f"/o{int(o)}")


def attention_lines(a):
    k = len(a["n"])
    variant = a.get("variant", np.array(["?"] * k, dtype=object))
    causal = col(a, "causal", k)
    mixed = len({c for c in causal if np.isfinite(c)}) > 1
    labels = {}
    for i in range(k):
        lab = str(variant[i]) + open_label(a, i)
        if mixed:
            lab += " (causal)" if causal[i] == 1 else " (bidir)"
        labels.setdefault(lab, []).append(i)
    return {lab: sorted(ix, key=lambda i: a["n"][i]) for lab, ix in labels.items()}



def style(ax, xlabel, ylabel, title, logx=True, logy=False):
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
        log_ticks(ax)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)



def linear_from_zero(ax, v):
    top = np.nanmax(v) if len(v) else 0.0
    ax.set_ylim(0, 1.1 * top if np.isfinite(top) and top > 0 else 1.0)


def spans_decade(v):
    """Whether positive data cover more than a factor 10, the point of a log axis."""
    v = v[np.isfinite(v)]
    return bool(len(v) and v.min() > 0 and v.max() / v.min() > 10)


def n_ticks(ax, ns):
    ns = sorted(set(int(x) for x in ns if np.isfinite(x)))
    if 0 < len(ns) <= 12:
        ax.set_xticks(ns)
        ax.set_xticklabels([f"{x // 1024}K" if x >= 1024 and x % 1024 == 0 else str(x) for x in ns])
        ax.minorticks_off()



def plot_attention(a, attrs, title, out_dir, written):
    k = len(a["n"])
    n = a["n"]
    total = col(a, "fwd_ms", k) + col(a, "bwd_ms", k)
    lines = attention_lines(a)

    # Time, log-log, with O(n log n) and O(n^2) references through the first measured point.
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for lab, ix in lines.items():
        ax.plot(n[ix], total[ix], "o-", label=lab)
    i0 = next(iter(lines.values()))[0]
    n0, t0 = n[i0], total[i0]
    ns = np.array(sorted(set(n)))
    if np.isfinite(t0) and t0 > 0 and n0 > 1 and len(ns) > 1:
        ax.plot(ns, t0 * ns * np.log2(ns) / (n0 * math.log2(n0)), "k--", lw=1, alpha=0.6,
                label="∝ n·log₂n (through the first point)")
        ax.plot(ns, t0 * (ns / n0) ** 2, "k:", lw=1, alpha=0.6,
                label="∝ n² (through the first point)")
    style(ax, "sequence length n (tokens)", "forward + backward time (ms, median)",
          f"{title}\nattention forward + backward", logy=True)
    n_ticks(ax, n)
    save(fig, out_dir, "attention_time.png", written)

    # Time per n·log2 n: flat means O(n log n), the FMA paper's claim; rising like n means O(n^2).
    fig, ax = plt.subplots(figsize=(8, 5.5))
    scaled = total * 1e6 / (n * np.log2(n))  # ns per (n log2 n)
    for lab, ix in lines.items():
        ax.plot(n[ix], scaled[ix], "o-", label=lab)
    style(ax, "sequence length n (tokens)", "time / (n·log₂n)  (ns)",
          f"{title}\nattention time per n·log₂n (flat = O(n log n))", logy=True)
    ax.set_ylim(bottom=max(scaled.min() / 3, 1e-3))
    n_ticks(ax, n)
    save(fig, out_dir, "attention_scaled.png", written)

    # Achieved rate against the SGEMM rate measured in the same run.
    fig, ax = plt.subplots(figsize=(8, 5.5))
    gf, p2p = col(a, "gflops", k), col(a, "p2p_gflops", k)
    for lab, ix in lines.items():
        (ln,) = ax.plot(n[ix], gf[ix], "o-", label=lab)
        ok = [i for i in ix if np.isfinite(p2p[i])]
        if ok:
            ax.plot(n[ok], p2p[ok], "s:", color=ln.get_color(), label=f"{lab}: near field (P2P)")
    sg = attrs.get("sgemm_gflops_per_rank")
    if sg is not None and np.isfinite(float(sg)):
        ax.axhline(float(sg), color="k", ls="--", lw=1,
                   label=f"SGEMM {float(sg):.1f} GFLOP/s per rank")
    style(ax, "sequence length n (tokens)", "GFLOP/s (model FLOPs, fwd + bwd)",
          f"{title}\nattention throughput")
    ax.set_ylim(bottom=0)
    n_ticks(ax, n)
    save(fig, out_dir, "attention_gflops.png", written)

    if "workspace_bytes" in a:
        fig, ax = plt.subplots(figsize=(8, 5.5))
        div, unit = byte_unit(a["workspace_bytes"])
        ws = a["workspace_bytes"] / div
        for lab, ix in lines.items():
            ax.plot(n[ix], ws[ix], "o-", label=lab)
        style(ax, "sequence length n (tokens)", f"peak workspace, forward + backward ({unit})",
              f"{title}\nattention workspace", logy=spans_decade(ws))
        if not spans_decade(ws):
            linear_from_zero(ax, ws)
        n_ticks(ax, n)
        save(fig, out_dir, "workspace.png", written)
    else:
        note("no /attention/workspace_bytes: skipping workspace.png")


def plot_train(t, attrs, title, out_dir, written):
    k = len(t["n"])
    ix = sorted(range(k), key=lambda i: t["n"][i])
    n = t["n"][ix]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 5))
    a1.plot(n, 100.0 * col(t, "mfu", k)[ix], "o-", label="MFU")
    style(a1, "sequence length n (tokens)", "MFU (% of measured SGEMM rate)",
          f"{title}\nmodel FLOP utilisation, whole training step")
    a1.set_ylim(bottom=0)
    n_ticks(a1, n)
    a2.plot(n, col(t, "tokens_per_s", k)[ix], "o-", color="C1", label="tokens/s (all ranks)")
    style(a2, "sequence length n (tokens)", "tokens per second", "training throughput")
    a2.set_ylim(bottom=0)
    n_ticks(a2, n)
    save(fig, out_dir, "train_mfu.png", written)


def plot_comm(c, attrs, title, out_dir, written):
    k = len(c["n"])
    lines = lines_by(c, [("variant", str), ("seq_ranks", lambda s: f"S={int(s)}")])
    fig, ax = plt.subplots(figsize=(8, 5.5))
    div, unit = byte_unit(col(c, "bytes_per_rank_per_layer", k))
    b = col(c, "bytes_per_rank_per_layer", k) / div
    for lab, ix in lines.items():
        ax.plot(c["n"][ix], b[ix], "o-", label=lab)
    style(ax, "sequence length n (tokens)", f"{unit} sent per rank per layer",
          f"{title}\nattention communication (sequence parallel)",
          logy=spans_decade(b))
    if not spans_decade(b):
        linear_from_zero(ax, b)
    n_ticks(ax, c["n"])
    save(fig, out_dir, "comm_bytes.png", written)


def fmt(v, spec):
    """format(v, spec), or a right-aligned "-" of the same width for a missing (NaN) value."""
    if v is None or (isinstance(v, float) and not np.isfinite(v)):
        width = "".join(ch for ch in spec.split(".")[0] if ch.isdigit())
        return "-".rjust(int(width) if width else 1)
    return format(v, spec)


def print_tables(groups, attrs):
    sg = attrs.get("sgemm_gflops_per_rank")
    sg = float(sg) if sg is not None else float("nan")
    a = groups.get("attention")
    if a and len(a.get("n", [])):
        k = len(a["n"])
        print("\nattention forward + backward (medians)")
        print(f"{'variant':<12} {'n':>8} {'H':>3} {'d':>4} {'causal':>6} {'fwd ms':>10} "
              f"{'bwd ms':>10} {'total ms':>10} {'ns/nlogn':>9} {'GFLOP/s':>8} {'%SGEMM':>7} "
              f"{'P2P GF/s':>8} {'ws MiB':>9}")
        for lab, ix in attention_lines(a).items():
            for i in ix:
                n = a["n"][i]
                fw, bw = col(a, "fwd_ms", k)[i], col(a, "bwd_ms", k)[i]
                g = col(a, "gflops", k)[i]
                print(f"{lab:<12} {int(n):>8} {fmt(col(a, 'heads', k)[i], '3.0f')} "
                      f"{fmt(col(a, 'head_dim', k)[i], '4.0f')} "
                      f"{fmt(col(a, 'causal', k)[i], '6.0f')} "
                      f"{fmt(fw, '10.3f')} {fmt(bw, '10.3f')} {fmt(fw + bw, '10.3f')} "
                      f"{fmt((fw + bw) * 1e6 / (n * math.log2(n)), '9.3f')} {fmt(g, '8.1f')} "
                      f"{fmt(100 * g / sg, '7.1f')} {fmt(col(a, 'p2p_gflops', k)[i], '8.1f')} "
                      f"{fmt(col(a, 'workspace_bytes', k)[i] / MIB, '9.2f')}")
    t = groups.get("train")
    if t and len(t.get("n", [])):
        k = len(t["n"])
        print("\ntraining step (medians)")
        print(f"{'n':>8} {'step ms':>10} {'tokens/s':>12} {'MFLOP/token':>12} {'MFU %':>7}")
        for i in sorted(range(k), key=lambda i: t["n"][i]):
            print(f"{int(t['n'][i]):>8} {fmt(col(t, 'step_ms', k)[i], '10.2f')} "
                  f"{fmt(col(t, 'tokens_per_s', k)[i], '12.0f')} "
                  f"{fmt(col(t, 'flops_per_token', k)[i] / 1e6, '12.3f')} "
                  f"{fmt(100 * col(t, 'mfu', k)[i], '7.2f')}")
    c = groups.get("comm")
    if c and len(c.get("n", [])):
        k = len(c["n"])
        print("\nattention communication")
        print(f"{'variant':<12} {'S':>4} {'n':>8} {'bytes/rank/layer':>17}")
        for lab, ix in lines_by(c, [("variant", str)]).items():
            for i in ix:
                print(f"{lab:<12} {fmt(col(c, 'seq_ranks', k)[i], '4.0f')} {int(c['n'][i]):>8} "
                      f"{fmt(col(c, 'bytes_per_rank_per_layer', k)[i], '17.0f')}")
    print()


def main():
    ap = argparse.ArgumentParser(
        prog=PROG, description="Plot an fmattn bench run (bench.h5) as PNG files and text tables.")
    ap.add_argument("path", help="run directory (output.dir/run.name) or its bench.h5")
    ap.add_argument("-o", "--out", help="directory for the PNGs (default: next to bench.h5)")
    args = ap.parse_args()

    path = run_file(args.path, "bench.h5")
    if not os.path.isfile(path):
        die(f"{path} not found (give a run directory holding bench.h5, or the file)")
    out_dir = args.out or os.path.dirname(os.path.abspath(path))
    os.makedirs(out_dir, exist_ok=True)

    groups, attrs = load(path)
    name = deck_values(attrs.get("deck", "")).get("run.name") or \
        os.path.basename(os.path.dirname(os.path.abspath(path)))
    sg = attrs.get("sgemm_gflops_per_rank")
    title = (f"{name}: {attrs.get('ranks', '?')} rank(s) x {attrs.get('threads', '?')} thread(s)"
             + (f", SGEMM {float(sg):.0f} GFLOP/s/rank" if sg is not None else "")
             + (f", fmattn {attrs['version']}" if "version" in attrs else ""))
    print(f"{path}: {title}")
    if sg is None:
        note("root attribute sgemm_gflops_per_rank is missing: no SGEMM reference line")
    print_tables(groups, attrs)

    written = []
    a = groups.get("attention")
    if a and len(a.get("n", [])):
        plot_attention(a, attrs, title, out_dir, written)
    else:
        note("no /attention rows: skipping attention_time.png, attention_scaled.png, "
             "attention_gflops.png, workspace.png")
    t = groups.get("train")
    if t and len(t.get("n", [])):
        plot_train(t, attrs, title, out_dir, written)
    else:
        note("no /train rows: skipping train_mfu.png")
    c = groups.get("comm")
    if c and len(c.get("n", [])):
        plot_comm(c, attrs, title, out_dir, written)
    else:
        note("no /comm rows: skipping comm_bytes.png")
    for w in written:
        print(f"wrote {w}")
    if not written:
        die(f"nothing to plot in {path}")


if __name__ == "__main__":
    main()
