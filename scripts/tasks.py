#!/usr/bin/python3
# The long-range task study of docs/tasks.md: trains every causal attention of fmattn on the same
# synthetic tasks (inputs/tasks/<task>.in: mqar, passkey, copy, majority; listops with --listops)
# at two lengths, with the same model (inputs/tasks/base.in), seed, steps and tokens per step, and
# collects every run's accuracy on the scored targets, overall and by distance, into one HDF5
# (runs/tasks/tasks.h5) with PNG plots and a markdown table. Times nothing itself: every figure
# comes from fmattn's own diag.h5 files and the runs' wall clocks. Runs already complete are
# reused (delete the run directory, or --force, to redo one). On a cluster, --list and --index
# run one run per SLURM array task (scripts/slurm/tasks.sbatch) and --collect gathers them.
import argparse
import concurrent.futures
import datetime
import os
import shlex
import subprocess
import sys
import time

os.environ.setdefault("HDF5_USE_FILE_LOCKING", "FALSE")

from fmattn_h5 import h5py  # noqa: E402
import numpy as np  # noqa: E402
from fmattn_h5 import group_columns  # noqa: E402
from fmattn_plot import plt, save  # noqa: E402
from fmattn_deck import deck_values  # noqa: E402
from fmattn_runs import check_decks, deck_sets, die, log_wall, note, run_one  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DECKS = os.path.join(ROOT, "inputs", "tasks")
# every variant that runs causally (nystrom is bidirectional only); fma/oK is fma with
# attention.fma.open = K (SPEC 6.4a: far windows opened by content)
VARIANTS = ["full", "local", "linear", "fmmformer", "rmfa", "fma", "fma/o1", "fma/o2",
            "fma_linear"]


def variant_sets(v):
    """The deck settings of a study variant: attention.variant, and fma.open for fma/oK."""
    base, _, k = v.partition("/o")
    return [f"attention.variant={base}"] + ([f"attention.fma.open={k}"] if k else [])
TASKS = ["mqar", "passkey", "copy", "majority"]






def chance(deck):
    """Accuracy of a guess that knows the answer's alphabet but not the sample (deck: a run's
    settings as deck_values gives them): 1 / its size."""
    source = deck.get("data.source", "file")
    symbols = int(deck.get("data.symbols", "16"))
    if source == "mqar":
        return 1 / 8 if deck.get("data.mqar.one_hop", "true") == "true" else 1 / 64
    return {"passkey": 0.1, "listops": 0.1, "copy": 1 / symbols, "majority": 1 / symbols}.get(
        source, float("nan"))


def complete(run_dir, steps):
    """Whether a run directory holds a finished run of exactly `steps` steps (its test accuracy
    written)."""
    path = os.path.join(run_dir, "diag.h5")
    if not os.path.exists(path):
        return False
    try:
        with h5py.File(path, "r") as f:
            tr = group_columns(f, "train")
            return ("test/accuracy" in f and tr is not None and len(tr["step"]) > 0
                    and tr["step"][-1] == steps)
    except OSError:
        return False




def read_run(run_dir):
    """What tasks.h5 keeps of one run's diag.h5."""
    with h5py.File(os.path.join(run_dir, "diag.h5"), "r") as f:
        tr = group_columns(f, "train")
        task = f["task"]
        return {"accuracy": float(f["test/accuracy"][-1]),
                "sample_accuracy": float(f["test/sample_accuracy"][-1]),
                "valid_accuracy": float(task["valid_accuracy"][-1]),
                "by_distance": np.asarray(f["test/accuracy_by_distance"][-1], dtype=float),
                "scored": np.asarray(f["test/scored_by_distance"][-1], dtype=float),
                "start": np.asarray(task["distance_start"][...], dtype=float),
                "end": np.asarray(task["distance_end"][...], dtype=float),
                "curve_step": np.asarray(task["step"][...], dtype=float),
                "curve": np.asarray(task["valid_accuracy"][...], dtype=float),
                "train_s": float(np.sum(tr["step_ms"]) / 1e3),
                "tokens_per_s": float(np.median(tr["tokens_per_s"]))}


def read_previous(path):
    """The runs of an earlier study's tasks.h5, by name, as read_run and plan give them."""
    rows = {}
    with h5py.File(path, "r") as f:
        g = f["runs"]
        text = lambda c: [x.decode() if isinstance(x, bytes) else x for x in g[c][...]]
        names = text("name")
        cols = {c: text(c) for c in ("variant", "task")}
        for c in g:
            if c not in ("name", "variant", "task"):
                cols[c] = g[c][...]
        for i, name in enumerate(names):
            r = {c: v[i] for c, v in cols.items()}
            r["context"], r["steps"], r["batch"] = (int(r["context"]), int(r["steps"]),
                                                    int(r["batch"]))
            h, c = f[f"by_distance/{name}"], f[f"curves/{name}"]
            r.update(start=h["start"][...], end=h["end"][...], by_distance=h["accuracy"][...],
                     scored=h["scored"][...], curve_step=c["step"][...],
                     curve=c["valid_accuracy"][...])
            rows[name] = r
    return rows


def plan(a):
    """Every run of the study: (meta, command) in a fixed order (--index counts in it)."""
    base = os.path.join(DECKS, "base.in")
    base_sets = deck_sets(base)
    runs = []
    for task in a.tasks:
        path = os.path.join(DECKS, f"{task}.in")
        if not os.path.exists(path):
            die(f"no deck {path}")
        sets = base_sets + deck_sets(path)
        steps = a.steps or int(deck_values(sets=sets).get("train.steps", "300"))
        for n in a.lengths:
            if a.tokens_per_step % n:
                die(f"{a.tokens_per_step} tokens per step is not a whole number of contexts of {n}")
            for v in a.variants:
                name = f"{task}-{n}-{v.replace('/', '_')}"
                runtime = variant_sets(v) + [f"model.context={n}",
                           f"train.batch={a.tokens_per_step // n}", f"train.steps={steps}",
                           f"train.eval_every={max(1, steps // a.evals)}",
                           f"train.eval_windows={a.eval_samples}", f"run.name={name}",
                           f"output.dir={os.path.abspath(a.runs_dir)}", "output.log_every=1"]
                if task == "passkey" and a.corpus:
                    runtime.append(f"data.path={os.path.abspath(a.corpus)}")
                runtime += a.extra.split()
                cmd = [a.fmattn, base] + [w for s in deck_sets(path) + runtime
                                          for w in ("--set", s)]
                every = deck_values(sets=sets + runtime)
                meta = {"name": name, "variant": v, "task": task, "context": n, "steps": steps,
                        "batch": a.tokens_per_step // n, "chance": chance(every),
                        "band": int(every.get("attention.local.band", "128")),
                        "fma_m": int(every.get("attention.fma.m", "64"))}
                runs.append((meta, cmd))
    return runs


def check_runs(runs):
    """Resolve every run's deck with fmattn --check (nothing is trained or written)."""
    check_decks([(meta["name"], cmd) for meta, cmd in runs])
    note(f"{len(runs)} deck(s) valid")


def attention_marks(r):
    """Distances at which the variants' reach changes: local's band, fma's near field (exact up to
    m always, never beyond 2m)."""
    band, m = r["band"], r["fma_m"]
    return [(band, f"local.band {band}", "C1"), (m, f"fma: exact below m = {m}", "C5"),
            (2 * m, f"fma: none exact from 2m = {2 * m}", "C5")]


def plots(out, rows):
    written = []
    colors = {v: f"C{i}" for i, v in enumerate(VARIANTS)}
    for task in dict.fromkeys(r["task"] for r in rows):
        ns = sorted({r["context"] for r in rows if r["task"] == task})
        fig, axes = plt.subplots(1, len(ns), figsize=(6.5 * len(ns), 4.8), squeeze=False)
        for ax, n in zip(axes[0], ns):
            rs = [r for r in rows if r["task"] == task and r["context"] == n]
            for r in rs:
                m = r["scored"] > 0
                x = np.sqrt(np.maximum(r["start"][m], 0.5) * np.maximum(r["end"][m] - 1, 0.5))
                ls = "-" if r["variant"] in ("full", "fma", "local", "fma/o2") else "--"
                ax.plot(x, r["by_distance"][m], ls, marker="o", ms=3,
                        color=colors.get(r["variant"]), label=f"{r['variant']} ({r['accuracy']:.2f})")
            if rs:
                ax.axhline(rs[0]["chance"], color="0.5", lw=1, ls=":", label="chance")
            for d, label, c in attention_marks(rs[0]) if rs else []:
                if d < n:
                    ax.axvline(d, color=c, lw=0.8, ls="-.", alpha=0.6)
                    ax.text(d, 0.02, " " + label, rotation=90, fontsize=7, color=c, va="bottom")
            ax.set_xscale("log", base=2)
            ax.set_ylim(-0.02, 1.02)
            ax.set_xlabel("distance back to the token the answer copies or needs")
            ax.set_ylabel("test accuracy")
            ax.set_title(f"{task}, context {n}")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, loc="upper right")
        save(fig, out, f"accuracy_by_distance_{task}.png", written)
    cols = [(t, n) for t in dict.fromkeys(r["task"] for r in rows)
            for n in sorted({r["context"] for r in rows if r["task"] == t})]
    vs = list(dict.fromkeys(r["variant"] for r in rows))
    grid = np.full((len(vs), len(cols)), np.nan)
    for r in rows:
        grid[vs.index(r["variant"]), cols.index((r["task"], r["context"]))] = r["accuracy"]
    fig, ax = plt.subplots(figsize=(1.3 * len(cols) + 2.5, 0.5 * len(vs) + 1.8))
    im = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto")
    for i in range(len(vs)):
        for j in range(len(cols)):
            if np.isfinite(grid[i, j]):
                ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=8,
                        color="w" if grid[i, j] < 0.6 else "k")
    ax.set_xticks(range(len(cols)))
    ax.set_xticklabels([f"{t}\n{n}" for t, n in cols], fontsize=8)
    ax.set_yticks(range(len(vs)))
    ax.set_yticklabels(vs)
    ax.set_title("test accuracy on the scored targets")
    fig.colorbar(im, ax=ax)
    save(fig, out, "accuracy.png", written)
    return written


def write_h5(path, rows, meta):
    with h5py.File(path, "w") as f:
        for k, v in meta.items():
            f.attrs[k] = v
        g = f.create_group("runs")
        text = {"name": "run name: task-context-variant",
                "variant": "attention.variant (fma/oK: fma with attention.fma.open = K)",
                "task": "data.source (inputs/tasks/<task>.in)"}
        for c, d in text.items():
            g.create_dataset(c, data=np.array([r[c] for r in rows], dtype=h5py.string_dtype()))
            g[c].attrs["description"] = d
        num = {"context": "tokens", "steps": "optimizer steps", "batch": "sequences per step",
               "accuracy": "share of the test set's scored targets whose argmax is the target",
               "sample_accuracy": "share of the test set's samples with every scored target right",
               "valid_accuracy": "accuracy on the validation set at the end of training",
               "chance": "accuracy of a guess from the answer's alphabet alone",
               "train_s": "seconds of training steps (evaluations excluded)",
               "wall_s": "seconds of wall time of the whole run (start-up and evaluations "
                         "included; nan when not run by this invocation's log)",
               "tokens_per_s": "training tokens per second, median over steps"}
        for c, u in num.items():
            g.create_dataset(c, data=np.array([r[c] for r in rows], dtype=float))
            g[c].attrs["units" if c in ("context", "steps") else "description"] = u
        for r in rows:
            h = f.create_group(f"by_distance/{r['name']}")
            h["start"], h["end"] = r["start"], r["end"]
            h["accuracy"], h["scored"] = r["by_distance"], r["scored"]
            h["start"].attrs["description"] = "smallest distance of each bucket (tokens)"
            h["end"].attrs["description"] = "distance after the largest of each bucket (tokens)"
            h["accuracy"].attrs["description"] = "test accuracy in each bucket; nan: no target"
            h["scored"].attrs["description"] = "scored test targets in each bucket"
            c = f.create_group(f"curves/{r['name']}")
            c["step"], c["valid_accuracy"] = r["curve_step"], r["curve"]
            c["step"].attrs["units"] = "optimizer steps"
            c["valid_accuracy"].attrs["description"] = "validation accuracy at that step"


def markdown(rows):
    cols = [(t, n) for t in dict.fromkeys(r["task"] for r in rows)
            for n in sorted({r["context"] for r in rows if r["task"] == t})]
    by = {(r["variant"], r["task"], r["context"]): r for r in rows}
    lines = ["| variant | " + " | ".join(f"{t} {n}" for t, n in cols) + " |",
             "|---|" + "---:|" * len(cols)]
    for v in dict.fromkeys(r["variant"] for r in rows):
        cells = []
        for t, n in cols:
            r = by.get((v, t, n))
            cells.append("-" if r is None else f"{r['accuracy']:.3f}")
        lines.append(f"| {v} | " + " | ".join(cells) + " |")
    chances = [next(r["chance"] for r in rows if (r["task"], r["context"]) == c) for c in cols]
    lines.append("| *chance* | " + " | ".join(f"*{c:.3f}*" for c in chances) + " |")
    return "\n".join(lines)


def parse_args():
    ap = argparse.ArgumentParser(
        description="Train every causal attention of fmattn on long-range tasks (docs/tasks.md).")
    ap.add_argument("--out", default="runs/tasks", help="output directory (runs and tasks.h5)")
    ap.add_argument("--fmattn", default=os.path.join(ROOT, "src", "fmattn"), help="the binary")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--tasks", default=",".join(TASKS),
                    help="decks of inputs/tasks/ (mqar, passkey, copy, majority, listops)")
    ap.add_argument("--listops", action="store_true", help="add listops to the tasks")
    ap.add_argument("--lengths", default="1024,4096", help="context lengths")
    ap.add_argument("--steps", type=int, default=0,
                    help="optimizer steps of every run (default: each task deck's train.steps)")
    ap.add_argument("--tokens-per-step", type=int, default=8192,
                    help="train.batch = this / context: the same tokens per step at every length")
    ap.add_argument("--eval-samples", type=int, default=64,
                    help="validation and test samples (train.eval_windows)")
    ap.add_argument("--evals", type=int, default=2, help="validations per run")
    ap.add_argument("--corpus", default=os.path.join(ROOT, "data", "kjv.txt"),
                    help="passkey's filler text (scripts/get_kjv.sh); '' or missing: random bytes")
    ap.add_argument("--extra", default="",
                    help="more fmattn settings for every run: 'section.key=value ...'")
    ap.add_argument("--jobs", type=int, default=2, help="runs at once")
    ap.add_argument("--threads", type=int, default=0,
                    help="OMP threads per run (default: cores / jobs)")
    ap.add_argument("--quick", action="store_true",
                    help="four variants, two tasks, one short context, a few steps: the tests'")
    ap.add_argument("--force", action="store_true", help="run again even if a run is complete")
    ap.add_argument("--check", action="store_true",
                    help="validate every run's deck with fmattn --check, run nothing")
    ap.add_argument("--list", action="store_true", help="print the runs, one per line, numbered")
    ap.add_argument("--index", type=int, default=-1,
                    help="run only run INDEX of --list (a SLURM array task), then stop")
    ap.add_argument("--collect", action="store_true",
                    help="train nothing: gather the complete runs into tasks.h5, plots, table")
    ap.add_argument("--reuse", default="",
                    help="an earlier study's tasks.h5: its runs (same name, steps, batch) are "
                         "taken from it instead of trained again")
    a = ap.parse_args()
    if a.quick:
        a.variants, a.tasks, a.lengths = "full,local,fma,fma/o2", "mqar,copy", "64"
        a.steps, a.tokens_per_step, a.eval_samples, a.evals = 20, 512, 8, 2
        a.extra = ("attention.fma.m=8 attention.fma.p=2 attention.local.band=8 "
                   "attention.full.block=16 " + a.extra)
    a.variants = [v for v in a.variants.split(",") if v]
    a.tasks = [t for t in a.tasks.split(",") if t] + (["listops"] if a.listops else [])
    a.lengths = sorted({int(x) for x in a.lengths.split(",") if x})
    a.runs_dir = os.path.join(a.out, "runs")
    if a.corpus and not os.path.exists(a.corpus):
        if not a.list:  # --list output is counted by scripts/slurm/tasks.sbatch
            note(f"{a.corpus} is missing (scripts/get_kjv.sh writes it): passkey's filler is "
                 "random bytes")
        a.corpus = ""
    return a


def main():
    a = parse_args()
    if not os.access(a.fmattn, os.X_OK):
        die(f"{a.fmattn} is not an executable fmattn (build it, or give --fmattn)")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = a.threads or max(1, cores // max(1, a.jobs))
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS=str(threads))
    runs = plan(a)
    if a.list:
        for i, (meta, cmd) in enumerate(runs):
            print(f"{i} {meta['name']} " + " ".join(shlex.quote(c) for c in cmd))
        return
    if a.check:
        check_runs(runs)
        return
    os.makedirs(a.runs_dir, exist_ok=True)
    if a.index >= 0:
        if a.index >= len(runs):
            die(f"--index {a.index}: the study has {len(runs)} runs (0 .. {len(runs) - 1})")
        runs = [runs[a.index]]
    previous = read_previous(a.reuse) if a.reuse else {}
    reused = {}
    for meta, _ in runs:
        p = previous.get(meta["name"])
        if p and not a.force and (p["steps"], p["batch"]) == (meta["steps"], meta["batch"]) and \
                not complete(os.path.join(a.runs_dir, meta["name"]), meta["steps"]):
            reused[meta["name"]] = p
    if reused:
        note(f"{len(reused)} run(s) taken from {a.reuse}")
    jobs = []
    for meta, cmd in runs:
        run_dir = os.path.join(a.runs_dir, meta["name"])
        if meta["name"] in reused:
            continue
        if not a.collect and (a.force or not complete(run_dir, meta["steps"])):
            jobs.append((meta["name"], cmd, env, os.path.join(a.runs_dir, meta["name"] + ".log")))
    note(f"{len(runs)} run(s), {len(jobs)} to do, {a.jobs} at a time x {threads} thread(s); "
         f"logs in {a.runs_dir}")
    failed = []
    t_all = time.time()
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, a.jobs)) as pool:
        for name, rc, secs, log in pool.map(run_one, jobs):
            note(f"{name}: {'done' if rc == 0 else 'FAILED (status %d)' % rc} in {secs:.0f} s"
                 + ("" if rc == 0 else f"; see {log}"))
            if rc:
                failed.append(name)
    wall = time.time() - t_all
    if failed:
        die(f"{len(failed)} run(s) failed: {', '.join(failed)}")
    if a.index >= 0:
        return
    rows, missing = [], []
    for meta, _ in runs:
        run_dir = os.path.join(a.runs_dir, meta["name"])
        if meta["name"] in reused:
            r = dict(meta)
            r.update({k: v for k, v in reused[meta["name"]].items() if k not in meta})
            rows.append(r)
            continue
        if not complete(run_dir, meta["steps"]):
            missing.append(meta["name"])
            continue
        r = dict(meta)
        r.update(read_run(run_dir))
        r["wall_s"] = log_wall(os.path.join(a.runs_dir, meta["name"] + ".log"))
        rows.append(r)
    if missing:
        note(f"{len(missing)} run(s) not complete, left out: {', '.join(missing)}")
    if not rows:
        die("no complete run to collect")
    version = subprocess.run([a.fmattn, "--version"], capture_output=True, text=True).stdout
    meta = {"command": " ".join(sys.argv), "fmattn_version": version.strip(),
            "created": datetime.datetime.now().isoformat(timespec="seconds"),
            "base_deck": open(os.path.join(DECKS, "base.in")).read(),
            "task_decks": "\n".join(f"[{t}.in]\n" + open(os.path.join(DECKS, f"{t}.in")).read()
                                    for t in a.tasks),
            "threads_per_run": threads, "runs_at_once": a.jobs,
            "reused_from": a.reuse, "runs_reused": len(reused),
            "wall_s": wall, "runs_trained": len(jobs),
            "run_seconds": float(np.nansum([r["wall_s"] for r in rows]))}
    out_h5 = os.path.join(a.out, "tasks.h5")
    write_h5(out_h5, rows, meta)
    note(f"wrote {out_h5}")
    for p in plots(a.out, rows):
        note(f"wrote {p}")
    note(f"wall time {wall:.0f} s for {len(jobs)} run(s); their own times sum to "
         f"{meta['run_seconds']:.0f} s")
    print(markdown(rows))


if __name__ == "__main__":
    main()
