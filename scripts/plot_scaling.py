#!/usr/bin/python3
# Plot a scaling sweep: reads the HDF5 that scripts/scaling.py writes and draws scaling_time.png,
# scaling_efficiency.png, scaling_bytes.png and (from runs that time the step by phase)
# scaling_phases.png; with --comm BENCH.h5 (a bench.what=comm sweep over n
# at fixed S) draws comm_bytes_vs_n.png. Read-only: it reports what the runs measured, times nothing.
# Usage: scripts/plot_scaling.py [RESULTS.h5] [--comm BENCH.h5_or_RUN_DIR] [-o OUT_DIR]
import argparse
import os
import sys

# A reader's HDF5 lock could make a concurrent fmattn fail to open the file; never take one.
os.environ.setdefault("HDF5_USE_FILE_LOCKING", "FALSE")

from fmattn_h5 import h5py  # noqa: E402
import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker as mticker  # noqa: E402
import numpy as np  # noqa: E402
from fmattn_h5 import group_columns, root_attrs, run_file  # noqa: E402
from fmattn_plot import byte_unit, log_ticks, save  # noqa: E402

PROG = "plot_scaling.py"
KIND_STYLE = {"strong": dict(color="C0", marker="o"), "weak": dict(color="C1", marker="s")}


def note(msg):
    print(f"{PROG}: {msg}")


def die(msg):
    print(f"{PROG}: error: {msg}", file=sys.stderr)
    sys.exit(1)


def read_columns(path, group="/"):
    """({name: 1-D array} of the group's datasets, or None; the root attributes)."""
    try:
        with h5py.File(path, "r") as f:
            return group_columns(f, group), root_attrs(f)
    except OSError as e:
        die(f"cannot read {path}: {e}")



def int_ticks(ax, xs, fmt=str):
    """Ticks exactly at the measured x values (S or n) on a log2 axis."""
    xs = sorted(set(int(x) for x in xs if np.isfinite(x)))
    ax.set_xscale("log", base=2)
    if xs:
        ax.set_xticks(xs)
        ax.set_xticklabels([fmt(x) for x in xs])
        ax.xaxis.set_minor_locator(mticker.NullLocator())
        if len(xs) == 1:
            ax.set_xlim(xs[0] / 1.5, xs[0] * 1.5)


def n_label(n):
    n = int(n)
    if n >= 1024 * 1024 and n % (1024 * 1024) == 0:
        return f"{n // (1024 * 1024)}M"
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


# ------------------------------------------------------------------------------------------------
# scaling.py results


def kinds_of(r):
    """{kind: row indices sorted by S}, strong first."""
    out = {}
    for kind in ("strong", "weak"):
        ix = [i for i in range(len(r["kind"])) if r["kind"][i] == kind]
        if ix:
            out[kind] = sorted(ix, key=lambda i: r["seq_ranks"][i])
    return out


def kind_label(r, kind, ix):
    if kind == "strong":
        return f"strong (n = {n_label(r['n'][ix[0]])})"
    per = {int(r["n"][i] // r["seq_ranks"][i]) for i in ix}
    return f"weak ({'/'.join(n_label(p) for p in sorted(per))} tokens per rank)"


def oversubscribed(r, attrs, i):
    cores = attrs.get("cores")
    if cores is None or "threads" not in r or attrs.get("simulated"):  # simulated: a core per rank
        return False
    return r["seq_ranks"][i] * r["threads"][i] > float(cores)


def plot_points(ax, x, y, over, label, **style):
    """A line through all points; oversubscribed points (S x threads > cores) drawn hollow."""
    (ln,) = ax.plot(x, y, "-", label=label, color=style["color"])
    full = [j for j in range(len(x)) if not over[j]]
    hollow = [j for j in range(len(x)) if over[j]]
    ax.plot(x[full], y[full], ls="none", marker=style["marker"], color=style["color"])
    ax.plot(x[hollow], y[hollow], ls="none", marker=style["marker"], mfc="white",
            color=style["color"])
    return ln


def results_title(attrs):
    deck = os.path.basename(str(attrs.get("deck", "?")))
    return (f"{deck} ({attrs.get('variant', '?')}) on {attrs.get('machine', '?')}, "
            f"{str(attrs.get('date', ''))[:10]}")


def plot_time(r, attrs, out_dir, written):
    kinds = kinds_of(r)
    fig, axes = plt.subplots(1, len(kinds), figsize=(6.5 * len(kinds), 5.5), squeeze=False)
    any_over = False
    for ax, (kind, ix) in zip(axes[0], kinds.items()):
        S = r["seq_ranks"][ix]
        t = r["step_ms"][ix]
        over = [oversubscribed(r, attrs, i) for i in ix]
        any_over |= any(over)
        plot_points(ax, S, t, over, f"training step, {kind_label(r, kind, ix)}",
                    **KIND_STYLE[kind])
        if "attention_ms" in r and np.isfinite(r["attention_ms"][ix]).any():
            a = r["attention_ms"][ix]
            ax.plot(S, a, ":", marker=KIND_STYLE[kind]["marker"], ms=4, alpha=0.7,
                    color=KIND_STYLE[kind]["color"], label="attention fwd + bwd, one layer")
        # Ideal: strong t(S0) S0 / S, weak t(S0), through the smallest S measured.
        S0, t0 = S[0], t[0]
        ideal = t0 * S0 / S if kind == "strong" else np.full(len(S), t0)
        ax.plot(S, ideal, "k--", lw=1, alpha=0.6,
                label="ideal: t(S₀)·S₀/S" if kind == "strong" else "ideal: t(S₀), flat")
        ax.set_yscale("log")
        int_ticks(ax, S)
        log_ticks(ax)
        ax.set_xlabel("sequence ranks S")
        ax.set_ylabel("time (ms, median)")
        ax.set_title(f"{kind} scaling: " + ("n fixed" if kind == "strong" else "n = S × tokens "
                                            "per rank"))
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.suptitle(results_title(attrs)
                 + ("\nhollow markers: oversubscribed (S × threads > cores), not a measurement"
                    if any_over else ""), fontsize=10)
    save(fig, out_dir, "scaling_time.png", written)


def plot_efficiency(r, attrs, out_dir, written):
    kinds = kinds_of(r)
    fig, ax = plt.subplots(figsize=(8, 5.5))
    top, any_over = 1.0, False
    for kind, ix in kinds.items():
        S = r["seq_ranks"][ix]
        e = 100.0 * r["efficiency"][ix]
        over = [oversubscribed(r, attrs, i) for i in ix]
        any_over |= any(over)
        plot_points(ax, S, e, over, kind_label(r, kind, ix), **KIND_STYLE[kind])
        for s, v in zip(S, e):
            if np.isfinite(v):
                ax.annotate(f"{v:.0f}%", (s, v), textcoords="offset points", xytext=(5, 5),
                            fontsize=7, color=KIND_STYLE[kind]["color"])
        if np.isfinite(e).any():
            top = max(top, np.nanmax(e) / 100.0)
    ax.axhline(100.0, color="k", ls="--", lw=1, alpha=0.6, label="ideal (100%)")
    int_ticks(ax, r["seq_ranks"])
    ax.set_ylim(0, 100.0 * max(1.15, 1.1 * top))
    ax.set_xlabel("sequence ranks S")
    ax.set_ylabel("parallel efficiency (%)")
    ax.set_title(results_title(attrs) + "\nstrong: t(S₀)·S₀ / (S·t(S));  weak: t(S₀) / t(S)"
                 + ("\nhollow markers: oversubscribed, not a measurement" if any_over else ""),
                 fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    save(fig, out_dir, "scaling_efficiency.png", written)


def plot_bytes(r, attrs, out_dir, written):
    kinds = kinds_of(r)
    b = r["bytes_per_rank_per_layer"]
    div, unit = byte_unit(b)
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for kind, ix in kinds.items():
        S, v = r["seq_ranks"][ix], b[ix] / div
        ax.plot(S, v, "-", label=kind_label(r, kind, ix), **KIND_STYLE[kind])
        if kind == "weak":  # the weak points each have their own n: say which
            for s, y, n in zip(S, v, r["n"][ix]):
                if np.isfinite(y):
                    ax.annotate(f"n={n_label(n)}", (s, y), textcoords="offset points",
                                xytext=(5, -12), fontsize=7, color=KIND_STYLE[kind]["color"])
    int_ticks(ax, r["seq_ranks"])
    top = np.nanmax(b / div) if np.isfinite(b).any() else 1.0
    ax.set_ylim(0, 1.15 * top if top > 0 else 1.0)  # linear from zero: S = 1 sends nothing
    ax.set_xlabel("sequence ranks S")
    ax.set_ylabel(f"{unit} sent per rank per layer (busiest rank, fwd + bwd)")
    ax.set_title(results_title(attrs) + "\nattention communication per rank (SPEC §7: "
                 "O(m·C + p·C·log n) for fma, independent of n/S)", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    save(fig, out_dir, "scaling_bytes.png", written)


PHASES = (("near_ms", "near field (P2P)"), ("far_ms", "far field (P2M, M2M, M2P)"),
          ("exchange_ms", "exchange between sequence ranks"),
          ("allreduce_ms", "gradient allreduce"), ("optimizer_ms", "optimizer"))


def plot_phases(r, attrs, out_dir, written):
    """The step by phase (mean over ranks) as shares of the step, stacked per S, the rest of the
    step on top; each bar labelled with the step's time."""
    kinds = kinds_of(r)
    fig, axes = plt.subplots(1, len(kinds), figsize=(6.5 * len(kinds), 5.5), squeeze=False)
    for ax, (kind, ix) in zip(axes[0], kinds.items()):
        x = np.arange(len(ix))
        bottom = np.zeros(len(ix))
        step = r["step_ms"][ix]
        for j, (k, label) in enumerate(PHASES):
            v = np.nan_to_num(r[k][ix]) / step
            ax.bar(x, v, bottom=bottom, color=f"C{j}", label=label)
            bottom += v
        rest = np.maximum(1 - bottom, 0)
        ax.bar(x, rest, bottom=bottom, color="0.8", label="rest (MLP, norms, embeddings, ...)")
        for xi, t in zip(x, step):
            ax.annotate(f"{t:.0f} ms" if t < 1e4 else f"{t / 1e3:.1f} s", (xi, 1.0), ha="center",
                        textcoords="offset points", xytext=(0, 3), fontsize=8)
        ax.set_xticks(x, [f"{int(r['seq_ranks'][i])}\n{n_label(r['n'][i])}" for i in ix])
        ax.set_xlabel("sequence ranks S and n")
        ax.set_ylabel("share of the step (phases: mean over ranks)")
        ax.set_ylim(0, 1.32)
        ax.set_title(f"{kind} scaling: the step by phase (exchange + allreduce: exposed)",
                     fontsize=10)
        ax.legend(fontsize=7, loc="upper center", ncol=3)
    fig.suptitle(results_title(attrs), fontsize=10)
    save(fig, out_dir, "scaling_phases.png", written)


def print_results(r):
    print(f"{'kind':<6} {'S':>4} {'n':>8} {'thr':>3} {'step ms':>10} {'speedup':>7} {'eff %':>6} "
          f"{'attn ms':>9} {'KiB/rank/layer':>14}")
    for kind, ix in kinds_of(r).items():
        for i in ix:
            print(f"{kind:<6} {int(r['seq_ranks'][i]):>4} {int(r['n'][i]):>8} "
                  f"{int(r['threads'][i]):>3} {r['step_ms'][i]:>10.2f} {r['speedup'][i]:>7.2f} "
                  f"{100 * r['efficiency'][i]:>6.1f} {r['attention_ms'][i]:>9.2f} "
                  f"{r['bytes_per_rank_per_layer'][i] / 1024:>14.1f}")
    print()


def plot_results(path, out_dir, written):
    r, attrs = read_columns(path)
    need = ("kind", "seq_ranks", "n", "threads", "step_ms", "efficiency", "speedup",
            "attention_ms", "bytes_per_rank_per_layer")
    missing = [c for c in need if c not in (r or {})]
    if missing:
        die(f"{path} lacks {', '.join(missing)}: is it a scripts/scaling.py result? (a bench.h5 "
            "goes with --comm)")
    if not len(r["kind"]):
        die(f"{path} has no rows")
    print(f"{path}: {results_title(attrs)}")
    print_results(r)
    plot_time(r, attrs, out_dir, written)
    plot_efficiency(r, attrs, out_dir, written)
    plot_bytes(r, attrs, out_dir, written)
    if all(k in r for k, _ in PHASES):
        plot_phases(r, attrs, out_dir, written)


# ------------------------------------------------------------------------------------------------
# bench.h5 /comm sweep over n


def plot_comm(path, out_dir, written):
    c, attrs = read_columns(path, "comm")
    if not c or "n" not in c or not len(c["n"]):
        die(f"{path} has no /comm rows (run fmattn with bench.what=comm)")
    k = len(c["n"])
    variant = c.get("variant", np.array(["?"] * k, dtype=object))
    S = c.get("seq_ranks", np.full(k, np.nan))
    several_s = len(set(S[np.isfinite(S)])) > 1
    lines = {}  # label -> row indices sorted by n, labels in order of first appearance
    for i in range(k):
        lab = str(variant[i]) + (f" S={int(S[i])}" if several_s else "")
        lines.setdefault(lab, []).append(i)
    lines = {lab: sorted(ix, key=lambda i: c["n"][i]) for lab, ix in lines.items()}
    b = c["bytes_per_rank_per_layer"]
    div, unit = byte_unit(b)
    y = b / div

    fig, ax = plt.subplots(figsize=(8, 5.5))
    print(f"{path}: attention communication, bytes per rank per layer")
    print(f"{'line':<16} {'n':>8} {'bytes/rank/layer':>17}")
    for lab, ix in lines.items():
        ok = [i for i in ix if b[i] > 0]  # log axis: S = 1 rows send nothing
        ax.plot(c["n"][ok], y[ok], "o-", label=lab)
        for i in ix:
            print(f"{lab:<16} {int(c['n'][i]):>8} {b[i]:>17.0f}")
    # Reference slope through the first line's first point: the traffic of a method whose
    # per-rank messages grow with n (a ring of k, v blocks: O(n)).
    first = [i for i in next(iter(lines.values())) if b[i] > 0]
    ns = np.array(sorted(set(c["n"])))
    if first and len(ns) > 1:
        n0, y0 = c["n"][first[0]], y[first[0]]
        ax.plot(ns, y0 * ns / n0, "k:", lw=1, alpha=0.5, label="∝ n (through the first point)")

    labs = list(lines)
    if len(labs) >= 2:
        a, bb = lines[labs[0]], lines[labs[1]]
        common = sorted(set(c["n"][a]) & set(c["n"][bb]))
        ia = {c["n"][i]: i for i in a}
        ib = {c["n"][i]: i for i in bb}
        common = [n for n in common if b[ia[n]] > 0 and b[ib[n]] > 0]
        if common:
            n = common[-1]
            ya, yb = y[ia[n]], y[ib[n]]
            ratio = b[ia[n]] / b[ib[n]]
            ax.annotate("", xy=(n, yb), xytext=(n, ya),
                        arrowprops=dict(arrowstyle="<->", color="k", lw=0.8))
            # Above and left of the higher point: the lines rise towards it from the left.
            ax.annotate(f"{labs[0]} / {labs[1]} = {ratio:.3g}×\nat n = {n_label(n)}",
                        (n, max(ya, yb)), textcoords="offset points", xytext=(-6, 12),
                        ha="right", va="bottom", fontsize=9,
                        bbox=dict(boxstyle="round", fc="white", ec="0.7", alpha=0.9))
            print(f"\n{labs[0]} / {labs[1]} at n = {int(n)}: {ratio:.4g}")
        else:
            note(f"{labs[0]} and {labs[1]} share no n with traffic: no ratio annotated")
    print()
    ax.set_yscale("log")
    int_ticks(ax, c["n"], n_label)
    log_ticks(ax)
    ax.set_xlabel("sequence length n (tokens)")
    ax.set_ylabel(f"{unit} sent per rank per layer (busiest rank, fwd + bwd)")
    s_txt = "several S" if several_s else (f"S = {int(S[0])}" if np.isfinite(S[0]) else "S = ?")
    ax.set_title(f"{os.path.basename(os.path.dirname(os.path.abspath(path)))}: sequence-parallel "
                 f"attention traffic, {s_txt}, {attrs.get('ranks', '?')} rank(s)", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    save(fig, out_dir, "comm_bytes_vs_n.png", written)


def main():
    ap = argparse.ArgumentParser(
        prog=PROG, description="Plot scripts/scaling.py results (scaling_time.png, "
        "scaling_efficiency.png, scaling_bytes.png) and/or a bench.h5 comm sweep over n "
        "(comm_bytes_vs_n.png).")
    ap.add_argument("results", nargs="?", help="HDF5 written by scripts/scaling.py")
    ap.add_argument("--comm", metavar="BENCH.h5",
                    help="a bench.h5 (or its run directory) with /comm rows at several n")
    ap.add_argument("-o", "--out", help="directory for the PNGs (default: next to each input)")
    args = ap.parse_args()
    if not args.results and not args.comm:
        ap.error("give RESULTS.h5, --comm BENCH.h5, or both")

    written = []
    for path, fn in ((args.results, plot_results), (args.comm, plot_comm)):
        if not path:
            continue
        if fn is plot_comm:
            path = run_file(path, "bench.h5")
        if not os.path.isfile(path):
            die(f"{path} not found")
        out_dir = args.out or os.path.dirname(os.path.abspath(path))
        os.makedirs(out_dir, exist_ok=True)
        fn(path, out_dir, written)
    for w in written:
        print(f"wrote {w}")


if __name__ == "__main__":
    main()
