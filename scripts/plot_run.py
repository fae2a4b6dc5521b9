#!/usr/bin/python3
# Plot a training run's diagnostics: reads runs/<name>/diag.h5 (SPEC section 8.1) and writes
# loss.png, lr.png, timing.png, attention_mass.png and entropy.png; with fma.open, opening.png
# (the share of attention on opened exact tokens, the windows opened per level); on a task (docs/tasks.md)
# accuracy.png (validation accuracy against step) and accuracy_by_distance.png (accuracy on the
# scored targets by how far back their answer lies: from eval.h5 when there is one, else the last
# validation and the test split of diag.h5); when the run directory also holds eval.h5
# (run.mode = eval), loss_vs_position.png: the loss by position in the context.
# Read-only: it never opens a file for writing nor holds an HDF5 lock, so it is safe to run on a
# job that is still writing.
# Usage: scripts/plot_run.py RUN_DIR_or_diag.h5 [-o OUT_DIR] (Debian's python3-h5py, -matplotlib)
import argparse
import math
import os
import sys
import time

# fmattn opens diag.h5 for each append; a reader's shared lock would make that open fail and stop
# the run, so never take one (must be set before h5py loads HDF5).
os.environ.setdefault("HDF5_USE_FILE_LOCKING", "FALSE")

from fmattn_h5 import h5py  # noqa: E402
import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from fmattn_deck import deck_values  # noqa: E402
from fmattn_h5 import run_file  # noqa: E402
from fmattn_plot import save  # noqa: E402

PROG = "plot_run.py"
PHASES = ["forward", "backward", "attention", "comm", "optimizer", "io"]


def note(msg):
    print(f"{PROG}: {msg}")


def die(msg):
    print(f"{PROG}: error: {msg}", file=sys.stderr)
    sys.exit(1)


def load(path):
    """Every dataset into memory as {"/group/name": array} plus root attributes; the file is closed
    again at once. Retried a few times: a writer may be in the middle of an append."""
    for attempt in range(5):
        try:
            data, units, attrs = {}, {}, {}
            with h5py.File(path, "r") as f:
                for k, v in f.attrs.items():
                    attrs[k] = v.decode() if isinstance(v, bytes) else v

                def visit(name, obj):
                    if isinstance(obj, h5py.Dataset):
                        try:
                            data["/" + name] = np.asarray(obj[()], dtype=float)
                        except (TypeError, ValueError):  # not numeric: not one of ours to plot
                            return
                        u = obj.attrs.get("units", obj.attrs.get("description", ""))
                        units["/" + name] = u.decode() if isinstance(u, bytes) else str(u)

                f.visititems(visit)
            return data, units, attrs
        except OSError as e:
            if attempt == 4 or not os.path.exists(path):
                die(f"cannot read {path}: {e}")
            time.sleep(0.5)
    return None


def series(data, group, name):
    """A 1-D series and its steps, trimmed to a common length (a run killed mid-append may leave
    one dataset a record longer than its step dataset)."""
    y, s = data.get(f"/{group}/{name}"), data.get(f"/{group}/step")
    if y is None or s is None:
        return None, None
    k = min(len(y), len(s))
    return s[:k], y[:k]


def mark_restart(ax, attrs):
    if "restarted_at" in attrs:
        r = float(attrs["restarted_at"])
        ax.axvline(r, color="0.5", lw=0.8, ls=":")
        ax.text(r, 1.0, " restart", transform=ax.get_xaxis_transform(), va="top", fontsize=8,
                color="0.4")



def plot_loss(data, attrs, title, out_dir, written):
    step, bpc = series(data, "train", "bpc")
    estep, vbpc = series(data, "eval", "valid_bpc")
    test = data.get("/test/bpc")
    if (bpc is None or len(bpc) == 0) and (vbpc is None or len(vbpc) == 0):
        note("no /train or /eval records: skipping loss.png")
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    if bpc is not None and len(bpc):
        ax.plot(step, bpc, lw=1, alpha=0.8, label="train (batch, dropout on)")
    if vbpc is not None and len(vbpc):
        ax.plot(estep, vbpc, "o-", ms=4, label="valid")
    else:
        note("no /eval records: loss.png has no validation curve")
    if test is not None and len(test):
        t = float(test[-1])
        tstep = data.get("/test/step")
        at = f" at step {int(tstep[-1])}" if tstep is not None and len(tstep) else ""
        ax.axhline(t, color="C3", ls="--", lw=1, label=f"test {t:.4f}{at}")
    else:
        note("no /test/bpc (written at the end of a run): loss.png has no test line")
    mark_restart(ax, attrs)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("bits per byte (bpc)")
    ax.set_title(f"{title}: loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    save(fig, out_dir, "loss.png", written, tight=False)


def plot_lr(data, attrs, title, out_dir, written):
    step, lr = series(data, "train", "lr")
    gstep, gn = series(data, "train", "grad_norm")
    if lr is None and gn is None:
        note("no /train/lr or /train/grad_norm: skipping lr.png")
        return
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    if lr is not None:
        a1.plot(step, lr, color="C0")
        a1.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
    a1.set_ylabel("learning rate")
    a1.set_title(f"{title}: learning rate and gradient norm")
    if gn is not None:
        a2.plot(gstep, gn, color="C1", label="before clipping")
        clip = attrs.get("_deck", {}).get("train.clip")
        try:
            if clip is not None and float(clip) > 0:
                a2.axhline(float(clip), color="0.4", ls="--", lw=1, label=f"train.clip = {clip}")
        except ValueError:
            pass
        a2.legend()
        if len(gn) and np.nanmin(gn) > 0 and np.nanmax(gn) / np.nanmin(gn) > 50:
            a2.set_yscale("log")
    a2.set_ylabel("global gradient L2 norm")
    a2.set_xlabel("optimizer step")
    for a in (a1, a2):
        a.grid(alpha=0.3)
        mark_restart(a, attrs)
    fig.tight_layout()
    save(fig, out_dir, "lr.png", written, tight=False)


def plot_timing(data, attrs, title, out_dir, written):
    ph = {p: data[f"/timing/{p}_ms"] for p in PHASES if f"/timing/{p}_ms" in data}
    if not ph:
        note("no /timing group: skipping timing.png")
        return
    step = data.get("/train/step")
    k = min(len(v) for v in ph.values())
    if step is not None:
        k = min(k, len(step))
    if k == 0:
        note("/timing is empty: skipping timing.png")
        return
    x = step[:k] if step is not None else np.arange(k)
    z = np.zeros(k)
    g = {p: ph.get(p, z)[:k] for p in PHASES}
    # The timers are inclusive (src/core/timer.h): attention time is also forward or backward time, so
    # it is carved out of them here to make the stack add up to the step.
    layers = np.maximum(g["forward"] + g["backward"] - g["attention"], 0.0)
    bands = [
        ("attention (fwd + bwd)", g["attention"]),
        ("other layers (fwd + bwd)", layers),
        ("comm", g["comm"]),
        ("optimizer", g["optimizer"]),
        ("io", g["io"]),
    ]
    fig, ax = plt.subplots(figsize=(10, 5))
    ax.stackplot(x, *[b[1] for b in bands], labels=[b[0] for b in bands], alpha=0.85)
    sstep, sms = series(data, "train", "step_ms")
    if sms is not None:
        ax.plot(sstep[:k], sms[:k], color="k", lw=1, label="whole step (step_ms)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("ms per step (rank 0)")
    ax.set_title(f"{title}: time per step by phase")
    # The first record carries start-up costs; do not let it flatten the rest.
    rest = (sms[1:k] if sms is not None and k > 2 else sum(b[1] for b in bands)[1:])
    if len(rest) and np.isfinite(rest).all() and rest.max() > 0:
        ax.set_ylim(0, 1.3 * float(np.max(rest)))
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.text(0.01, 0.01, "comm inside attention (sequence-parallel runs) is counted in both; "
             "data loading and eval are in step_ms only", fontsize=7, color="0.4")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    save(fig, out_dir, "timing.png", written, tight=False)


def band_names(nb):
    return ["near field"] + [f"level {i}" for i in range(1, nb)]


def band_colors(nb):
    lv = plt.get_cmap("viridis")(np.linspace(0.15, 0.95, max(nb - 1, 1)))
    return ["#d62728"] + [lv[i] for i in range(nb - 1)]


def plot_attention_mass(data, attrs, title, out_dir, written):
    mass, astep = data.get("/attention/level_mass"), data.get("/attention/step")
    if mass is None or mass.ndim != 4 or mass.shape[0] == 0:
        note("no /attention/level_mass records: skipping attention_mass.png")
        return
    R, L, H, nb = mass.shape
    astep = astep[:R] if astep is not None and len(astep) >= R else np.arange(R)
    last = mass[-1]  # (L, H, bands)
    names, colors = band_names(nb), band_colors(nb)
    opened = data.get("/attention/open_mass")  # fma.open: the rest of each query's attention
    if opened is not None and opened.shape[:3] == (R, L, H):
        last = np.concatenate([last, opened[-1][:, :, None]], axis=2)
        names, colors, nb = names + ["opened tokens"], colors + ["#ff7f0e"], nb + 1

    fig, (a1, a2) = plt.subplots(2, 1, figsize=(max(8, 0.35 * L * (H + 1) + 2), 8),
                                 gridspec_kw={"height_ratios": [3, 2]})
    gap = 1
    xs = np.array([l_ * (H + gap) + h for l_ in range(L) for h in range(H)], dtype=float)
    vals = last.reshape(L * H, nb)
    bottom = np.zeros(L * H)
    for b in range(nb):
        a1.bar(xs, vals[:, b], bottom=bottom, width=0.85, color=colors[b], label=names[b])
        bottom += vals[:, b]
    a1.set_xticks(xs)
    a1.set_xticklabels([str(h) for _ in range(L) for h in range(H)], fontsize=7)
    top = a1.secondary_xaxis("top")
    top.set_xticks([l_ * (H + gap) + (H - 1) / 2 for l_ in range(L)])
    top.set_xticklabels([f"layer {l_}" for l_ in range(L)], fontsize=8)
    top.tick_params(length=0)
    a1.set_ylim(0, 1.0)
    a1.set_ylabel("share of attention probability")
    a1.set_xlabel("head")
    extra = "" if nb > 1 else " (this variant has no far-field levels)"
    a1.set_title(f"{title}\nattention mass by band at step {int(astep[-1])}{extra}")
    a1.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)

    near = mass[:, :, :, 0].mean(axis=2)  # (R, L)
    for l_ in range(L):
        a2.plot(astep, near[:, l_], "o-", ms=3, label=f"layer {l_}")
    a2.set_xlabel("optimizer step")
    a2.set_ylabel("near-field share\n(mean over heads)")
    a2.set_ylim(-0.02, 1.02)
    a2.grid(alpha=0.3)
    a2.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    mark_restart(a2, attrs)
    fig.tight_layout()
    save(fig, out_dir, "attention_mass.png", written, tight=False)


def plot_opening(data, attrs, title, out_dir, written):
    """fma.open (SPEC 6.4a): what the opening gave and how much it opened."""
    om, opened, astep = (data.get("/attention/open_mass"), data.get("/attention/opened"),
                         data.get("/attention/step"))
    if om is None or opened is None or om.ndim != 3 or om.shape[0] == 0:
        return
    R, L, H = om.shape
    astep = astep[:R] if astep is not None and len(astep) >= R else np.arange(R)
    levels = opened.shape[2]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for l_ in range(L):
        a1.plot(astep, om[:, l_, :].mean(axis=1), "o-", ms=3, label=f"layer {l_}")
    a1.set_xlabel("optimizer step")
    a1.set_ylabel("share of attention on opened exact tokens\n(mean over heads and queries)")
    a1.set_ylim(bottom=0)
    a1.grid(alpha=0.3)
    a1.legend(fontsize=8)
    mark_restart(a1, attrs)
    lv = np.arange(1, levels + 1)
    for l_ in range(L):
        a2.plot(lv, opened[-1, l_], "o-", ms=4, label=f"layer {l_}")
    a2.set_xlabel("level (window = fma.m x 2^(level-1) tokens)")
    a2.set_ylabel(f"windows opened per query at step {int(astep[-1])}")
    a2.set_xticks(lv)
    a2.set_ylim(bottom=0)
    a2.grid(alpha=0.3)
    a2.legend(fontsize=8)
    fig.suptitle(f"{title}: the opening (fma.open = {attrs['_deck'].get('attention.fma.open', '?')})")
    fig.tight_layout()
    save(fig, out_dir, "opening.png", written, tight=False)


def uniform_entropy(deck):
    """Mean over queries of the entropy of uniform attention over all allowed keys of full
    attention: a reference line (nats). None when the deck does not say n."""
    try:
        n = int(deck.get("model.context", ""))
    except ValueError:
        return None
    if n <= 0:
        return None
    if deck.get("model.objective", "clm") == "mlm":
        return math.log(n), "uniform over all n keys (full attention)"
    return math.lgamma(n + 1) / n, "uniform over keys j <= i (causal full attention)"


def plot_entropy(data, attrs, title, out_dir, written):
    ent, astep = data.get("/attention/entropy"), data.get("/attention/step")
    if ent is None or ent.ndim != 3 or ent.shape[0] == 0:
        note("no /attention/entropy records: skipping entropy.png")
        return
    R, L, H = ent.shape
    astep = astep[:R] if astep is not None and len(astep) >= R else np.arange(R)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 6), gridspec_kw={"width_ratios": [3, 2]})
    for l_ in range(L):
        m = ent[:, l_, :].mean(axis=1)
        (ln,) = a1.plot(astep, m, "o-", ms=3, label=f"layer {l_}")
        if H > 1 and L <= 4:  # more bands than that hide each other
            a1.fill_between(astep, ent[:, l_, :].min(axis=1), ent[:, l_, :].max(axis=1),
                            color=ln.get_color(), alpha=0.15)
    ref = uniform_entropy(attrs.get("_deck", {}))
    if ref is not None:
        a1.axhline(ref[0], color="0.3", ls="--", lw=1, label=f"{ref[1]}: {ref[0]:.2f}")
    # From 0 (one key takes everything) up to the uniform reference, so how peaked attention is
    # reads at a glance and runs compare; an offset axis would magnify noise around uniform.
    top = max(float(np.nanmax(ent)), ref[0] if ref is not None else 0.0)
    a1.set_ylim(0, 1.08 * top if top > 0 else 1.0)
    a1.ticklabel_format(axis="y", useOffset=False)
    a1.set_xlabel("optimizer step")
    a1.set_ylabel("entropy (nats), mean over heads" + ("; band = min..max" if L <= 4 else ""))
    a1.set_title(f"{title}: attention entropy")
    a1.grid(alpha=0.3)
    a1.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=4, frameon=False)
    mark_restart(a1, attrs)
    im = a2.imshow(ent[-1], aspect="auto", cmap="magma", origin="lower", vmin=0, vmax=top)
    a2.set_xlabel("head")
    a2.set_ylabel("layer")
    a2.set_xticks(range(H))
    a2.set_yticks(range(L))
    a2.set_title(f"per head at step {int(astep[-1])}")
    for l_ in range(L):
        for h in range(H):
            if L * H <= 64:
                a2.text(h, l_, f"{ent[-1, l_, h]:.2f}", ha="center", va="center", fontsize=7,
                        color="w" if ent[-1, l_, h] < 0.6 * top else "k")
    fig.colorbar(im, ax=a2, label="entropy (nats)")
    fig.tight_layout()
    save(fig, out_dir, "entropy.png", written, tight=False)


def plot_position(eval_path, title, out_dir, written):
    """eval.h5's loss by position bucket: how much a byte's prediction gains from more context."""
    with h5py.File(eval_path, "r") as f:
        if "position" not in f:
            return
        lo, hi = f["position/start"][...], f["position/end"][...]
        step = int(f.attrs.get("step", -1))
        curves = {s: (f[f"position/{s}_loss"][...], f[f"{s}/bpc"][0])
                  for s in ("valid", "test") if f"position/{s}_loss" in f}
    mid = 0.5 * (lo + hi)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for split, (loss, bpc) in curves.items():
        ax.plot(mid, loss / math.log(2), marker="o", ms=3, label=f"{split} (mean {bpc:.3f} bpc)")
    ax.set_xlabel("position in the context (bucket centre)")
    ax.set_ylabel("bits per byte")
    ax.set_title(f"{title}\nloss by position, checkpoint step {step}")
    ax.grid(alpha=0.3)
    ax.legend()
    save(fig, out_dir, "loss_vs_position.png", written)


def plot_accuracy(data, attrs, title, out_dir, written):
    """A task's validation accuracy against step (diag.h5 /task), with the test split's."""
    step, acc = series(data, "task", "valid_accuracy")
    if acc is None or len(acc) == 0:
        return
    _, sample = series(data, "task", "valid_sample_accuracy")
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(step, acc, "o-", ms=4, label="scored targets right")
    if sample is not None:
        ax.plot(step, sample, "s--", ms=3, label="samples with every scored target right")
    test = data.get("/test/accuracy")
    if test is not None and len(test):
        ax.axhline(float(test[-1]), color="C3", ls=":", lw=1, label=f"test {float(test[-1]):.3f}")
    mark_restart(ax, attrs)
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("validation accuracy")
    ax.set_title(f"{title}: accuracy ({attrs['_deck'].get('data.source', '?')})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save(fig, out_dir, "accuracy.png", written)


def distance_curves(data, eval_path):
    """(start, end, {label: (accuracy, scored)}) of the accuracy by distance: eval.h5's valid and
    test splits when there is one, else the last validation record and the test split of
    diag.h5; None when the run is not a task."""
    if eval_path and os.path.isfile(eval_path):
        with h5py.File(eval_path, "r") as f:
            if "distance" in f:
                step = int(f.attrs.get("step", -1))
                return (f["distance/start"][...], f["distance/end"][...],
                        {f"{s} (checkpoint step {step})": (f[f"{s}/accuracy_by_distance"][...],
                                                          f[f"{s}/scored_by_distance"][...])
                         for s in ("valid", "test") if f"{s}/accuracy_by_distance" in f})
    lo, hi = data.get("/task/distance_start"), data.get("/task/distance_end")
    acc, cnt = data.get("/task/valid_accuracy_by_distance"), data.get("/task/valid_scored_by_distance")
    if lo is None or acc is None or acc.ndim != 2 or len(acc) == 0:
        return None
    step = data.get("/task/step")
    curves = {f"valid, step {int(step[-1]) if step is not None and len(step) else '?'}":
              (acc[-1], cnt[-1])}
    tacc, tcnt = data.get("/test/accuracy_by_distance"), data.get("/test/scored_by_distance")
    if tacc is not None and tacc.ndim == 2 and len(tacc):
        curves["test (end of training)"] = (tacc[-1], tcnt[-1])
    return lo, hi, curves


def plot_accuracy_by_distance(data, eval_path, title, out_dir, written):
    got = distance_curves(data, eval_path)
    if got is None:
        return
    lo, hi, curves = got
    fig, ax = plt.subplots(figsize=(8, 4.5))
    any_points = False
    for label, (acc, cnt) in curves.items():
        m = np.asarray(cnt) > 0
        if not m.any():
            continue
        any_points = True
        x = np.sqrt(np.maximum(lo[m], 0.5) * np.maximum(hi[m] - 1, 0.5))  # geometric bucket centre
        ax.plot(x, acc[m], "o-", ms=4, label=f"{label}: {int(np.sum(cnt))} targets")
    if not any_points:
        plt.close(fig)
        note("no scored target has a distance: skipping accuracy_by_distance.png")
        return
    ax.set_xscale("log", base=2)
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("distance: tokens back to the token the answer needs (bucket centre)")
    ax.set_ylabel("accuracy")
    ax.set_title(f"{title}\naccuracy by distance")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save(fig, out_dir, "accuracy_by_distance.png", written)


def main():
    ap = argparse.ArgumentParser(
        prog=PROG, description="Plot the diagnostics of an fmattn run (diag.h5) as PNG files.")
    ap.add_argument("path", help="run directory (output.dir/run.name) or its diag.h5")
    ap.add_argument("-o", "--out", help="directory for the PNGs (default: next to diag.h5)")
    args = ap.parse_args()

    path = run_file(args.path, "diag.h5")
    if not os.path.isfile(path):
        die(f"{path} not found (give a run directory holding diag.h5, or the file)")
    out_dir = args.out or os.path.dirname(os.path.abspath(path))
    os.makedirs(out_dir, exist_ok=True)

    data, _units, attrs = load(path)
    deck = deck_values(attrs.get("deck", ""))
    attrs["_deck"] = deck
    name = deck.get("run.name") or os.path.basename(os.path.dirname(os.path.abspath(path)))
    variant = deck.get("attention.variant", "?")
    ranks = attrs.get("ranks", "?")
    title = f"{name} ({variant}, n={deck.get('model.context', '?')}, {ranks} rank(s))"

    written = []
    plot_loss(data, attrs, title, out_dir, written)
    plot_lr(data, attrs, title, out_dir, written)
    plot_timing(data, attrs, title, out_dir, written)
    plot_attention_mass(data, attrs, title, out_dir, written)
    plot_entropy(data, attrs, title, out_dir, written)
    plot_opening(data, attrs, title, out_dir, written)
    eval_path = os.path.join(os.path.dirname(os.path.abspath(path)), "eval.h5")
    plot_accuracy(data, attrs, title, out_dir, written)
    plot_accuracy_by_distance(data, eval_path, title, out_dir, written)
    if os.path.isfile(eval_path):
        plot_position(eval_path, title, out_dir, written)
    for w in written:
        print(f"wrote {w}")
    if not written:
        die(f"nothing to plot in {path}")


if __name__ == "__main__":
    main()
