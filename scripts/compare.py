#!/usr/bin/python3
# The variant comparison of docs/results.md: trains every attention of fmattn on the same offline
# corpus with the same model, seed, steps and tokens per step, at several context lengths, and
# collects every run's diag.h5 into one HDF5 (runs/compare/compare.h5) with PNG plots: validation
# bpc against step and against wall time, bpc against context length, peak memory against context.
# With --table1, the FMA paper's Table 1 configurations instead (inputs/compare/table1/). Times
# nothing itself: every figure comes from fmattn's own diag.h5 files. Runs already complete are
# reused (delete the run directory, or --force, to redo one).
import argparse
import concurrent.futures
import datetime
import os
import subprocess
import sys
import time

os.environ.setdefault("HDF5_USE_FILE_LOCKING", "FALSE")

from fmattn_h5 import h5py  # noqa: E402
import numpy as np  # noqa: E402
from fmattn_h5 import group_columns  # noqa: E402
from fmattn_plot import byte_unit, plt, save  # noqa: E402
from fmattn_deck import deck_values  # noqa: E402
from fmattn_runs import check_decks, deck_sets, die, note, run_one  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
VARIANTS = ["full", "local", "linear", "fmmformer", "rmfa", "fish", "fma", "fma_linear",
            "nystrom", "full_mlm"]
TABLE1 = ["full-512", "fma-m64-3lev-512", "full-1024", "fma-m64-4lev-1024", "full-2048",
          "fma-m128-4lev-2048"]
# the paper's Table 1 (enwik8 test bpc, GPU memory) for the FMA configurations
PAPER = {"fma-m64-3lev-512": (1.353, 11.6), "fma-m64-4lev-1024": (1.256, 21.6),
         "fma-m128-4lev-2048": (1.220, 48.2)}


def complete(run_dir, steps):
    """Whether a run directory holds a finished run of exactly `steps` steps (its test bpc written;
    a longer run is another run: its learning-rate schedule differs)."""
    path = os.path.join(run_dir, "diag.h5")
    if not os.path.exists(path):
        return False
    try:
        with h5py.File(path, "r") as f:
            tr = group_columns(f, "train")
            return "test" in f and tr is not None and len(tr["step"]) and tr["step"][-1] == steps
    except OSError:
        return False


def read_run(run_dir):
    """What compare.h5 keeps of one run's diag.h5."""
    with h5py.File(os.path.join(run_dir, "diag.h5"), "r") as f:
        tr, ev, te = group_columns(f, "train"), group_columns(f, "eval"), group_columns(f, "test")
        mem = group_columns(f, "memory")
        attrs = dict(f["/memory"].attrs) if "memory" in f else {}
    wall = np.cumsum(tr["step_ms"]) / 1e3  # training seconds at each step (log_every = 1)
    step_wall = dict(zip(tr["step"].astype(int), wall))
    ev_wall = np.array([step_wall.get(int(s), np.nan) for s in ev["step"]])
    return {"step": ev["step"], "valid_bpc": ev["valid_bpc"], "wall_s": ev_wall,
            "train_s": float(wall[-1]), "final_valid_bpc": float(ev["valid_bpc"][-1]),
            "test_bpc": float(te["bpc"][-1]) if te is not None else float("nan"),
            "peak_bytes": float(np.max(mem["peak_bytes"])) if mem is not None else float("nan"),
            "resident_bytes": float(attrs.get("resident_peak_bytes", np.nan)),
            "activations_bytes": float(attrs.get("activations_peak_bytes", np.nan)),
            "tokens_per_s": float(np.median(tr["tokens_per_s"]))}


def plots(out, runs, ref_context):
    written = []
    by = {}
    for r in runs:
        by.setdefault(r["variant"], []).append(r)
    # bpc against step and wall time at the reference context
    for key, xlabel, name in (("step", "optimizer step", "valid_bpc_vs_step.png"),
                              ("wall_s", "training time (s)", "valid_bpc_vs_time.png")):
        fig, ax = plt.subplots(figsize=(8, 5))
        for v, rs in by.items():
            for r in rs:
                if r["context"] == ref_context:
                    style = "--" if r["objective"] == "mlm" else "-"
                    ax.plot(r[key], r["valid_bpc"], style, marker="o", ms=3,
                            label=f"{v} ({r['objective']})")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("validation bpc")
        ax.set_title(f"validation bpc, context {ref_context} (dashed: masked bytes, mlm)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        save(fig, out, name, written)
    for key, ylabel, name in (("final_valid_bpc", "final validation bpc", "bpc_vs_context.png"),
                              ("peak_bytes", "peak labelled memory per rank", "memory_vs_context.png")):
        fig, ax = plt.subplots(figsize=(8, 5))
        vals = [r[key] for r in runs]
        div, unit = byte_unit(vals) if key == "peak_bytes" else (1.0, "")
        for v, rs in by.items():
            rs = sorted(rs, key=lambda r: r["context"])
            style = "--" if rs[0]["objective"] == "mlm" else "-"
            ax.plot([r["context"] for r in rs], [r[key] / div for r in rs], style, marker="o",
                    label=f"{v} ({rs[0]['objective']})")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel(ylabel + (f" ({unit})" if unit else ""))
        if key == "peak_bytes":
            ax.set_yscale("log")
        ax.set_title("same tokens per step and steps at every context")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        save(fig, out, name, written)
    return written


def write_h5(path, runs, meta):
    with h5py.File(path, "w") as f:
        for k, v in meta.items():
            f.attrs[k] = v
        g = f.create_group("runs")
        cols = {"name": "run name", "variant": "variant (inputs/compare/<variant>.in)",
                "objective": "clm or mlm (bpc of the masked bytes)"}
        for c, d in cols.items():
            g.create_dataset(c, data=np.array([r[c] for r in runs], dtype=h5py.string_dtype()))
            g[c].attrs["description"] = d
        num = {"context": "tokens", "steps": "optimizer steps", "tokens": "training tokens",
               "final_valid_bpc": "bits per byte, validation, end of training",
               "test_bpc": "bits per byte, test split, end of training",
               "train_s": "seconds of training steps (evaluations excluded)",
               "tokens_per_s": "training tokens per second, median over steps",
               "peak_bytes": "peak labelled memory per rank (params, grads, optimizer, activations,"
                             " workspace, data, comm), bytes",
               "resident_bytes": "peak resident memory of the process, bytes",
               "activations_bytes": "peak activations, bytes"}
        for c, u in num.items():
            g.create_dataset(c, data=np.array([r[c] for r in runs], dtype=float))
            g[c].attrs["units" if c in ("context", "steps", "tokens") else "description"] = u
        for r in runs:
            h = f.create_group(f"curves/{r['name']}")
            for c in ("step", "valid_bpc", "wall_s"):
                h.create_dataset(c, data=np.asarray(r[c], dtype=float))
            h["valid_bpc"].attrs["units"] = "bits per byte"
            h["wall_s"].attrs["units"] = "seconds of training at that step"


def markdown(runs, table1):
    lines = []
    if table1:
        lines.append("| configuration | context | steps | valid bpc | test bpc | paper test bpc | "
                     "labelled peak | paper memory | tokens/s |")
        lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in runs:
            pb, pm = PAPER.get(r["name"], (float("nan"), float("nan")))
            lines.append(f"| {r['name']} | {r['context']} | {r['steps']} | "
                         f"{r['final_valid_bpc']:.3f} | {r['test_bpc']:.3f} | "
                         f"{'%.3f' % pb if pb == pb else '-'} | "
                         f"{r['peak_bytes'] / 2**30:.2f} GiB | "
                         f"{'%.1f GB' % pm if pm == pm else '-'} | {r['tokens_per_s']:.0f} |")
        return "\n".join(lines)
    contexts = sorted({r["context"] for r in runs})
    lines.append("| variant | objective | " + " | ".join(f"bpc @{c}" for c in contexts) +
                 " | " + " | ".join(f"labelled MiB @{c}" for c in contexts) + " | tok/s @" +
                 str(contexts[len(contexts) // 2]) + " |")
    lines.append("|---|---|" + "---:|" * (2 * len(contexts) + 1))
    for v in dict.fromkeys(r["variant"] for r in runs):
        rs = {r["context"]: r for r in runs if r["variant"] == v}
        obj = next(iter(rs.values()))["objective"]
        bpc = " | ".join(f"{rs[c]['final_valid_bpc']:.3f}" if c in rs else "-" for c in contexts)
        mem = " | ".join(f"{rs[c]['peak_bytes'] / 2**20:.0f}" if c in rs else "-"
                         for c in contexts)
        mid = contexts[len(contexts) // 2]
        tps = f"{rs[mid]['tokens_per_s']:.0f}" if mid in rs else "-"
        lines.append(f"| {v} | {obj} | {bpc} | {mem} | {tps} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(
        description="Train every attention of fmattn alike and compare them (docs/results.md).")
    ap.add_argument("--out", default="runs/compare", help="output directory (runs and compare.h5)")
    ap.add_argument("--fmattn", default=os.path.join(ROOT, "src", "fmattn"), help="the binary")
    ap.add_argument("--corpus", default="data/kjv.txt",
                    help="byte file (default data/kjv.txt: scripts/get_kjv.sh writes it)")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help="decks of inputs/compare/ to run (default: all)")
    ap.add_argument("--contexts", default="512,1024,2048,4096,8192")
    ap.add_argument("--ref-context", type=int, default=1024,
                    help="context of the bpc-vs-step and -time plots")
    ap.add_argument("--steps", type=int, default=0,
                    help="optimizer steps of every run (default 150; --table1: 120)")
    ap.add_argument("--tokens-per-step", type=int, default=8192,
                    help="train.batch = this / context, the same token budget at every context")
    ap.add_argument("--eval-tokens", type=int, default=32768,
                    help="train.eval_windows = this / context")
    ap.add_argument("--evals", type=int, default=6, help="validations per run")
    ap.add_argument("--jobs", type=int, default=2, help="runs at once")
    ap.add_argument("--threads", type=int, default=0,
                    help="OMP threads per run (default: cores / jobs)")
    ap.add_argument("--table1", action="store_true",
                    help="the FMA paper's Table 1 configurations (inputs/compare/table1/)")
    ap.add_argument("--quick", action="store_true",
                    help="two variants, one short context, a few steps: the test suite's check")
    ap.add_argument("--force", action="store_true", help="run again even if a run is complete")
    ap.add_argument("--check", action="store_true",
                    help="validate every run's deck with fmattn --check, run nothing")
    a = ap.parse_args()
    if a.quick:
        a.variants, a.contexts, a.ref_context = "full,linear", "256", 256
        a.steps, a.tokens_per_step, a.eval_tokens, a.evals = 8, 512, 1024, 2
    if not os.access(a.fmattn, os.X_OK):
        die(f"{a.fmattn} is not an executable fmattn (build it, or give --fmattn)")
    if not os.path.exists(a.corpus):
        die(f"corpus {a.corpus} is missing: run scripts/get_kjv.sh (or give --corpus)")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = a.threads or max(1, cores // max(1, a.jobs))
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS=str(threads))

    decks = os.path.join(ROOT, "inputs", "compare", "table1" if a.table1 else "")
    names = TABLE1 if a.table1 else [v for v in a.variants.split(",") if v]
    contexts = [None] if a.table1 else sorted({int(c) for c in a.contexts.split(",") if c})
    base = os.path.join(decks, "base.in")
    steps = a.steps or (120 if a.table1 else 150)
    every = max(1, steps // a.evals)
    # Table 1's runs have their own directory: its full-512 is not the comparison's full-512
    runs_dir = os.path.join(a.out, "table1" if a.table1 else "runs")
    if not a.check:
        os.makedirs(runs_dir, exist_ok=True)
    jobs, runs, checks = [], [], []
    for name in names:
        path = os.path.join(decks, f"{name}.in")
        if not os.path.exists(path):
            die(f"no deck {path} (choose among {', '.join(TABLE1 if a.table1 else VARIANTS)})")
        sets = deck_sets(path)
        deck = deck_values(sets=sets)
        for c in contexts:
            ctx = c or int(deck.get("model.context", "1024"))
            tokens = 4096 if a.table1 else a.tokens_per_step
            if tokens % ctx:
                die(f"{tokens} tokens per step is not a whole number of contexts of {ctx}")
            run = name if a.table1 else f"{name}-{ctx}"
            runtime = [f"model.context={ctx}", f"train.batch={tokens // ctx}",
                       f"train.steps={steps}", f"train.eval_every={every}",
                       f"train.eval_windows={max(1, a.eval_tokens // ctx)}",
                       f"data.path={os.path.abspath(a.corpus)}", f"run.name={run}",
                       f"output.dir={os.path.abspath(runs_dir)}"]
            cmd = [a.fmattn, base] + [w for s in sets + runtime for w in ("--set", s)]
            meta = {"name": run, "variant": name, "context": ctx, "steps": steps,
                    "tokens": steps * tokens,
                    "objective": deck.get("model.objective", "clm")}
            run_dir = os.path.join(runs_dir, run)
            runs.append((meta, run_dir))
            checks.append((run, cmd))
            if a.force or not complete(run_dir, steps):
                jobs.append((run, cmd, env, os.path.join(runs_dir, f"{run}.log")))
    if a.check:
        check_decks(checks)
        return
    note(f"{len(runs)} run(s), {len(jobs)} to do, {a.jobs} at a time x {threads} thread(s); "
         f"logs in {runs_dir}")
    failed = []
    t_all = time.time()
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, a.jobs)) as pool:
        for name, rc, secs, log in pool.map(run_one, jobs):
            note(f"{name}: {'done' if rc == 0 else 'FAILED (status %d)' % rc} in {secs:.0f} s"
                 + ("" if rc == 0 else f"; see {log}"))
            if rc:
                failed.append(name)
    if failed:
        die(f"{len(failed)} run(s) failed: {', '.join(failed)}")
    rows = []
    for meta, run_dir in runs:
        r = dict(meta)
        r.update(read_run(run_dir))
        rows.append(r)
    version = subprocess.run([a.fmattn, "--version"], capture_output=True, text=True).stdout
    meta = {"corpus": os.path.abspath(a.corpus), "command": " ".join(sys.argv),
            "created": datetime.datetime.now().isoformat(timespec="seconds"),
            "fmattn_version": version.strip(), "base_deck": open(base).read(),
            "threads_per_run": threads, "runs_at_once": a.jobs,
            "wall_s": time.time() - t_all, "table1": int(a.table1)}
    out_h5 = os.path.join(a.out, "table1.h5" if a.table1 else "compare.h5")
    write_h5(out_h5, rows, meta)
    note(f"wrote {out_h5}")
    if not a.table1:
        for p in plots(a.out, rows, a.ref_context):
            note(f"wrote {p}")
    print(markdown(rows, a.table1))


if __name__ == "__main__":
    main()
