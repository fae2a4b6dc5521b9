#!/usr/bin/python3
# Strong and weak scaling sweep of fmattn's sequence parallelism: runs `mpirun -n S fmattn DECK
# --set run.mode=bench ...` once per (kind, S, n), reads each run's bench.h5 (SPEC section 11) and
# collects one row per run into a single HDF5 (default runs/scaling/scaling.h5) for
# scripts/plot_scaling.py. Times nothing itself: every figure comes from fmattn's bench.h5.
# --simulate PLATFORM runs the same sweep under SimGrid SMPI (`smpirun`, an fmattn built with
# ./configure --enable-smpi) on a simulated cluster of scripts/simgrid/, and marks the results
# simulated.
import argparse
import configparser
import datetime
import glob
import os
import shlex
import socket
import subprocess
import sys

# A reader's HDF5 lock could make a concurrent fmattn fail to open the file; never take one.
os.environ.setdefault("HDF5_USE_FILE_LOCKING", "FALSE")

from fmattn_h5 import h5py  # noqa: E402
import numpy as np  # noqa: E402
from fmattn_deck import deck_values, read_deck  # noqa: E402
from fmattn_h5 import text  # noqa: E402

PROG = "scaling.py"
HERE = os.path.dirname(os.path.abspath(__file__))
PLATFORMS = os.path.join(HERE, "simgrid")
SMPI_MARK = b"(SimGrid SMPI build)"  # in the --version text of an --enable-smpi build
# The training step by phase, from bench.h5 /train (mean over ranks, per step).
PHASES = ("near_ms", "far_ms", "exchange_ms", "allreduce_ms", "optimizer_ms", "busy_max_ms",
          "busy_mean_ms")
# Keys the sweep sets on every run; --extra may not set them (its runs would not be the sweep's).
RESERVED = ("run.mode", "run.name", "output.dir", "bench.what", "bench.n_list", "bench.variants",
            "bench.batch", "train.batch", "model.context", "parallel.seq_ranks")


def note(msg):
    print(f"{PROG}: {msg}", flush=True)


def die(msg):
    print(f"{PROG}: error: {msg}", file=sys.stderr, flush=True)
    sys.exit(1)


def machine_cores():
    """(physical cores, logical CPUs) this process may run on. Physical cores are what Open MPI's
    --bind-to core and PE= count, and one OpenMP thread per core is what fmattn is tuned for."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:
        cpus = list(range(os.cpu_count() or 1))
    cores = set()
    for c in cpus:
        topo = f"/sys/devices/system/cpu/cpu{c}/topology"
        try:
            with open(f"{topo}/physical_package_id") as f1, open(f"{topo}/core_id") as f2:
                cores.add((f1.read().strip(), f2.read().strip()))
        except OSError:
            cores.add(("cpu", str(c)))  # no topology (some containers): count each CPU
    return max(1, len(cores)), max(1, len(cpus))


def damon_state():
    """The kernel's DAMON monitors on this host ("on", "off", or "" where the kernel has none):
    a monitor that samples pages (kdamond) slows the memory-streaming passes of a simulation that
    folds many ranks' memory into one process, and makes its steps irregular (docs/scaling.md,
    issue 53's sixth session)."""
    states = []
    for path in sorted(glob.glob("/sys/kernel/mm/damon/admin/kdamonds/*/state")):
        try:
            with open(path) as f:
                states.append(f.read().strip())
        except OSError:
            pass
    if not states:
        return ""
    return "on" if "on" in states else "off"


def int_list(s, what):
    try:
        v = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        die(f"{what} must be a comma list of positive integers, got '{s}'")
    if not v or min(v) < 1:
        die(f"{what} must be a comma list of positive integers, got '{s}'")
    return sorted(set(v))


def parse_extra(extra):
    """--extra "--set a.b=c ..." as a list of words: only --set key=value pairs, none reserved."""
    try:
        words = shlex.split(extra or "")
    except ValueError as e:
        die(f"--extra: {e}")
    out, i = [], 0
    while i < len(words):
        w = words[i]
        if w == "--set" and i + 1 < len(words):
            kv, i = words[i + 1], i + 2
        elif w.startswith("--set="):
            kv, i = w[len("--set="):], i + 1
        else:
            die(f"--extra: unexpected '{w}': expected --set section.key=value pairs")
        key = kv.split("=", 1)[0].strip()
        if "=" not in kv or "." not in key:
            die(f"--extra: '{kv}' is not section.key=value")
        if key in RESERVED:
            die(f"--extra sets {key}, which the sweep sets on every run ({', '.join(RESERVED)})")
        out += ["--set", kv]
    return out


def resolve_deck(args, extra):
    """(resolved deck text or None, attention variant). From `fmattn --check` (one rank: validates
    the deck and --extra); in a dry run without a built fmattn, from the deck file itself."""
    if os.access(args.fmattn, os.X_OK):
        pre = simulate_launch(args, 1)[0] if args.simulate else []
        cmd = pre + [args.fmattn, "--check", args.deck] + extra
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if p.returncode != 0:
            sys.stderr.write(p.stderr)
            die(f"`{shlex.join(cmd)}` rejected the deck (message above)")
        return p.stdout, deck_values(p.stdout).get("attention.variant") or "fma"
    if not args.dry_run:
        die(f"fmattn binary '{args.fmattn}' not found: build it (./bootstrap && ./configure && make)"
            " or give --fmattn")
    try:
        variant = read_deck(args.deck).get("attention.variant") or "fma"  # the default
    except (OSError, configparser.Error) as e:
        die(f"cannot read {args.deck}: {e}")
    variant = deck_values(sets=extra[1::2]).get("attention.variant", variant)  # --extra's --set
    note(f"dry run without {args.fmattn}: variant '{variant}' read from the deck, not checked")
    return None, variant


def sweep_points(args):
    """[(kind, S, n)] in run order: strong then weak, S ascending."""
    pts = []
    for kind in (("strong", "weak") if args.kind == "both" else (args.kind,)):
        for S in args.ranks:
            n = args.n if kind == "strong" else S * args.per_rank
            if n % S:
                die(f"{kind} scaling: n = {n} is not divisible by S = {S} ranks")
            pts.append((kind, S, n))
    return pts


def platform_path(name):
    """The SimGrid platform XML for --simulate: a name in scripts/simgrid/ or a path."""
    known = sorted(f[:-4] for f in os.listdir(PLATFORMS) if f.endswith(".xml"))
    if os.path.isfile(name):
        return os.path.abspath(name)
    if name in known:
        return os.path.join(PLATFORMS, name + ".xml")
    die(f"--simulate: unknown platform '{name}' (choose among {', '.join(known)}, or give the "
        "path of a SimGrid platform XML)")


def is_smpi_build(path):
    try:
        with open(path, "rb") as f:
            return SMPI_MARK in f.read()
    except OSError:
        return False


def simulate_launch(args, S):
    """(argv prefix, environment, threads) for S simulated ranks: one thread each (a simulated
    node is one core), every rank on its own host of the platform in order."""
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    if args.fold_memory:
        env["FMATTN_SMPI_FOLD"] = "1"  # src/core/memory.c: activations on shared pages
    if args.sample:
        env["FMATTN_SMPI_SAMPLE"] = str(args.sample)  # src/parallel/simsample.h
    if args.sample_rates:
        env["FMATTN_SMPI_SAMPLE_LOAD"] = os.path.abspath(args.sample_rates)
    cmd = list(args.mpirun_argv) + ["-np", str(S), "-platform", args.platform,
                                    "--cfg=smpi/display-timing:yes"]
    cmd += ["--cfg=" + c for c in args.smpi_cfg]
    if args.fold_memory:
        cmd += ["--cfg=smpi/shared-malloc:local"]
    return cmd, env, 1


def launch(args, S, cores, user_threads):
    """(argv prefix, environment, threads per rank) for S ranks under Open MPI's mpirun."""
    if args.simulate:
        return simulate_launch(args, S)
    threads = user_threads or max(1, cores // S)
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(threads)
    if os.geteuid() == 0:
        # Open MPI refuses root unless told; containers and fresh cloud nodes often run as root.
        env["OMPI_ALLOW_RUN_AS_ROOT"] = "1"
        env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] = "1"
    cmd = list(args.mpirun_argv) + ["-n", str(S)]
    if S * threads > cores:
        # More ranks x threads than cores: runs (useful to test layouts) but binding would pin
        # several ranks to one core, and the timings do not measure the machine.
        cmd += ["--oversubscribe", "--bind-to", "none"]
    else:
        # Each rank owns `threads` cores and its threads stay on them (Open MPI would otherwise
        # bind each rank to one core for np <= 2, serialising its threads).
        cmd += ["--map-by", f"slot:PE={threads}", "--bind-to", "core"]
    for v in ("OMP_NUM_THREADS", "OMP_PLACES", "OMP_PROC_BIND"):
        if v in env:
            cmd += ["-x", v]
    return cmd, env, threads


def fmattn_args(args, deck_extra, kind, S, n, run_name, out_dir):
    # The sweep's keys last, so that they win over the deck and --extra.
    sets = [("run.mode", "bench"), ("bench.what", "train,comm"), ("bench.variants", args.variant),
            ("parallel.seq_ranks", S), ("bench.n_list", n), ("model.context", n),
            ("bench.batch", 1), ("train.batch", 1), ("run.name", run_name),
            ("output.dir", out_dir)]
    words = [args.fmattn, args.deck] + deck_extra
    for k, v in sets:
        words += ["--set", f"{k}={v}"]
    return words


def show(cmd, env, keys=("OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "OMP_NUM_THREADS",
                         "FMATTN_SMPI_FOLD", "FMATTN_SMPI_SAMPLE", "FMATTN_SMPI_SAMPLE_SAVE",
                         "FMATTN_SMPI_SAMPLE_LOAD")):
    pre = " ".join(f"{k}={env[k]}" for k in keys if k in env)
    return (pre + " " if pre else "") + shlex.join(cmd)


def read_bench(path, variant, S, n):
    """One sweep row's figures from a run's bench.h5: the training step at n and the attention op
    (comm rows) of the deck's variant at (n, S)."""
    row = {}
    try:
        with h5py.File(path, "r") as f:
            for a in ("sgemm_gflops", "ranks", "threads"):
                row[a] = float(f.attrs[a]) if a in f.attrs else np.nan
            if "train" not in f:
                die(f"{path} has no /train rows: fmattn skipped the training step at n = {n} "
                    "(see its message above)")
            t = {k: np.asarray(f["train"][k][()], dtype=float).ravel()
                 for k in ("n", "step_ms", "tokens_per_s", "mfu") if k in f["train"]}
            t_all = {k: np.asarray(f["train"][k][()], dtype=float).ravel()
                     for k in PHASES if k in f["train"]}
            hit = np.nonzero(t["n"] == n)[0]
            if not len(hit):
                die(f"{path}: no /train row for n = {n}")
            i = hit[0]
            for k in ("step_ms", "tokens_per_s", "mfu"):
                row[k] = t[k][i] if k in t else np.nan
            for k in PHASES:
                row[k] = float(t_all[k][i]) if k in t_all else np.nan
            comm_ms = row["exchange_ms"] + row["allreduce_ms"]
            row["exposed_comm"] = comm_ms / row["step_ms"] if row["step_ms"] > 0 else np.nan
            row.update(attention_ms=np.nan, fwd_ms=np.nan, bwd_ms=np.nan, bytes=np.nan,
                       exchanges=np.nan)
            if "comm" in f and "n" in f["comm"]:
                c = f["comm"]
                cn = np.asarray(c["n"][()], dtype=float).ravel()
                cs = np.asarray(c["seq_ranks"][()], dtype=float).ravel()
                cv = [text(x) for x in np.ravel(c["variant"][()])]
                k = min(len(cn), len(cs), len(cv))
                hit = [j for j in range(k) if cn[j] == n and cs[j] == S and cv[j] == variant]
                if hit:
                    j = hit[0]
                    fw = float(np.ravel(c["fwd_ms"][()])[j])
                    bw = float(np.ravel(c["bwd_ms"][()])[j])
                    row.update(fwd_ms=fw, bwd_ms=bw, attention_ms=fw + bw,
                               bytes=float(np.ravel(c["bytes_per_rank_per_layer"][()])[j]))
                    if "exchanges_per_layer" in c:
                        row["exchanges"] = float(np.ravel(c["exchanges_per_layer"][()])[j])
            if not np.isfinite(row["attention_ms"]):
                note(f"warning: {path} has no /comm row for {variant} at n = {n}, S = {S} "
                     "(skipped by fmattn?): attention_ms and bytes are NaN")
    except (OSError, KeyError) as e:
        die(f"cannot read {path}: {e}")
    return row


def derive(rows):
    """speedup and efficiency per row, against the smallest S of the same kind (S = 1 normally).
    strong: speedup = S0 * t(S0) / t(S), efficiency = speedup / S.
    weak:   efficiency = t(S0) / t(S), speedup = S * efficiency / S0 (throughput ratio)."""
    base = {}
    for r in rows:
        if r["kind"] not in base or r["S"] < base[r["kind"]]["S"]:
            base[r["kind"]] = r
    for r in rows:
        b = base[r["kind"]]
        ratio = b["step_ms"] / r["step_ms"] if r["step_ms"] > 0 else np.nan
        if r["kind"] == "strong":
            r["speedup"] = b["S"] * ratio
            r["efficiency"] = r["speedup"] / r["S"]
        else:
            r["efficiency"] = ratio
            r["speedup"] = r["S"] * ratio / b["S"]
    return {k: b["S"] for k, b in base.items()}


def print_table(rows):
    print(f"\n{'kind':<6} {'S':>4} {'n':>8} {'thr':>3} {'step ms':>10} {'tokens/s':>10} "
          f"{'speedup':>7} {'eff %':>6} {'attn ms':>9} {'KiB/rank/layer':>14} {'MFU %':>6} "
          f"{'comm %':>6}")
    for r in rows:
        print(f"{r['kind']:<6} {r['S']:>4} {r['n']:>8} {r['threads']:>3} {r['step_ms']:>10.2f} "
              f"{r['tokens_per_s']:>10.0f} {r['speedup']:>7.2f} {100 * r['efficiency']:>6.1f} "
              f"{r['attention_ms']:>9.2f} {r['bytes'] / 1024:>14.1f} {100 * r['mfu']:>6.2f} "
              f"{100 * r['exposed_comm']:>6.1f}")
    print(flush=True)


def write_results(path, rows, meta):
    """One 1-D dataset per column, one row per run; written to a temporary file then renamed, so
    that an interrupted write never leaves a half file under the results' name."""
    cols = [  # (dataset, row key, dtype, attribute, text)
        ("kind", "kind", "str", "description", "strong (n fixed) or weak (n = S x per-rank tokens)"),
        ("run", "run", "str", "description", "fmattn run name; its bench.h5 is output.dir/run"),
        ("seq_ranks", "S", "i8", "units", "ranks sharing one sequence (parallel.seq_ranks = "
         "MPI ranks)"),
        ("n", "n", "i8", "units", "tokens per sequence"),
        ("threads", "threads", "i8", "units", "OpenMP threads per rank"),
        ("step_ms", "step_ms", "f8", "units", "milliseconds, median training step (slowest rank)"),
        ("tokens_per_s", "tokens_per_s", "f8", "units", "tokens per second, all ranks"),
        ("mfu", "mfu", "f8", "units", "fraction: achieved model FLOP rate / sgemm_gflops"),
        ("attention_ms", "attention_ms", "f8", "units",
         "milliseconds, median attention forward + backward of one layer (slowest rank)"),
        ("attention_fwd_ms", "fwd_ms", "f8", "units", "milliseconds, median attention forward"),
        ("attention_bwd_ms", "bwd_ms", "f8", "units", "milliseconds, median attention backward"),
        ("bytes_per_rank_per_layer", "bytes", "f8", "units",
         "bytes sent by the busiest rank in one attention forward + backward"),
        ("exchanges_per_layer", "exchanges", "f8", "units",
         "blocking exchanges between sequence ranks in one attention forward + backward, most on "
         "any rank (NaN: fmattn before this column)"),
        ("sgemm_gflops", "sgemm_gflops", "f8", "units",
         "GFLOP/s, SGEMM rate measured in the run, summed over its ranks"),
        ("speedup", "speedup", "f8", "units",
         "dimensionless; strong: S0 t(S0)/t(S); weak: S t(S0)/(S0 t(S)), the throughput ratio "
         "(S0 = baseline_ranks, normally 1; t = step_ms)"),
        ("efficiency", "efficiency", "f8", "units",
         "dimensionless; strong: speedup/S; weak: t(S0)/t(S) (1 = ideal)"),
        ("near_ms", "near_ms", "f8", "units", "milliseconds per step, mean over ranks: fma's "
         "near field (P2P; summed over threads)"),
        ("far_ms", "far_ms", "f8", "units", "milliseconds per step, mean over ranks: fma's far "
         "field (P2M + M2M + M2P; summed over threads)"),
        ("exchange_ms", "exchange_ms", "f8", "units", "milliseconds per step, mean over ranks: "
         "blocking exchanges between sequence ranks (halos, LET, ring; waits included)"),
        ("allreduce_ms", "allreduce_ms", "f8", "units",
         "milliseconds per step, mean over ranks: gradient allreduce"),
        ("optimizer_ms", "optimizer_ms", "f8", "units",
         "milliseconds per step, mean over ranks: gradient norm and AdamW"),
        ("busy_max_ms", "busy_max_ms", "f8", "units", "milliseconds per step outside blocking "
         "communication, the busiest rank (NaN: fmattn before this column)"),
        ("busy_mean_ms", "busy_mean_ms", "f8", "units", "milliseconds per step outside blocking "
         "communication, mean over ranks; busy_max_ms / busy_mean_ms is the load imbalance"),
        ("exposed_comm", "exposed_comm", "f8", "units", "fraction of the step inside blocking "
         "communication: (exchange_ms + allreduce_ms) / step_ms (nothing is overlapped)"),
    ]
    tmp = path + ".tmp"
    with h5py.File(tmp, "w") as f:
        for name, key, dt, attr, desc in cols:
            if dt == "str":
                ds = f.create_dataset(name, data=[r[key] for r in rows],
                                      dtype=h5py.string_dtype("utf-8"))
            else:
                ds = f.create_dataset(name, data=np.array([r[key] for r in rows], dtype=dt))
            ds.attrs[attr] = desc
        for k, v in meta.items():
            f.attrs[k] = v
    os.replace(tmp, path)


def finish(args, rows, resolved, cores, cpus, failed=""):
    """Derive, print and write the results of the runs done; failed names the run that stopped
    the sweep (the file then holds the runs before it, and says so)."""
    base = derive(rows)
    for kind, s0 in base.items():
        if s0 != 1:
            note(f"warning: no S = 1 run for {kind} scaling: speedup and efficiency are relative "
                 f"to S = {s0}")
    print_table(rows)
    meta = {
        "deck": args.deck,
        "deck_resolved": resolved or "",
        "variant": args.variant,
        "extra": args.extra,
        "machine": (f"simulated {os.path.basename(args.platform)[:-4]} (SimGrid SMPI; "
                    f"computation timed on {socket.gethostname()})" if args.simulate else
                    f"{socket.gethostname()} ({cores} cores, {cpus} CPUs)"),
        "simulated": int(bool(args.simulate)),
        "platform": args.platform if args.simulate else "",
        "platform_xml": open(args.platform).read() if args.simulate else "",
        "smpi_cfg": " ".join(args.smpi_cfg),
        "fold_memory": int(bool(args.simulate and args.fold_memory)),
        "sample": int(args.sample if args.simulate else 0),
        "sample_rates": (open(args.sample_rates).read() if args.simulate and args.sample_rates
                         else ""),
        "hostname": socket.gethostname(),
        "host_damon": args.host_damon,
        "cores": cores,
        "cpus": cpus,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": shlex.join([sys.argv[0]] + sys.argv[1:]),
        "baseline_ranks_strong": base.get("strong", 0),
        "baseline_ranks_weak": base.get("weak", 0),
        "incomplete": failed,
        "omp_num_threads": "1" if args.simulate else (os.environ.get("OMP_NUM_THREADS", "")
                                                       or "cores // S"),
    }
    write_results(args.out, rows, meta)
    note(f"wrote {args.out} ({len(rows)} runs{', incomplete: ' + failed + ' failed' if failed else ''}); "
         f"plot it with scripts/plot_scaling.py {args.out}")


def main():
    ap = argparse.ArgumentParser(
        prog=PROG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Strong and/or weak scaling sweep of fmattn's sequence parallelism "
        "(S = parallel.seq_ranks = MPI ranks); one HDF5 of results for scripts/plot_scaling.py.",
        epilog="Each run: MPIRUN -n S [binding] fmattn DECK [EXTRA] --set run.mode=bench "
        "--set bench.what=train,comm --set bench.variants=<the deck's attention.variant> "
        "--set parallel.seq_ranks=S --set bench.n_list=n --set model.context=n --set bench.batch=1 "
        "--set train.batch=1 --set run.name=scaling_<kind>_S<S>_n<n> --set output.dir=<dir of "
        "--out>.\nThreads per rank: $OMP_NUM_THREADS if set, else max(1, cores // S). Binding: "
        "--map-by slot:PE=<threads> --bind-to core when S x threads fits the cores, else "
        "--oversubscribe --bind-to none (timings then not meaningful). MPIRUN must take Open MPI's "
        "mpirun flags (-n, --map-by, --bind-to, --oversubscribe, -x).")
    ap.add_argument("--deck", default="inputs/scaling/fma-64K.in", help="fmattn deck (default "
                    "%(default)s)")
    ap.add_argument("--kind", choices=("strong", "weak", "both"), default="both",
                    help="strong: n fixed; weak: n = S x --per-rank (default %(default)s)")
    ap.add_argument("--ranks", default="1,2,4,8", help="comma list of S (default %(default)s)")
    ap.add_argument("--n", type=int, default=65536, help="strong scaling n (default %(default)s)")
    ap.add_argument("--per-rank", type=int, default=16384,
                    help="weak scaling tokens per rank (default %(default)s)")
    ap.add_argument("--out", default="runs/scaling/scaling.h5",
                    help="results HDF5; the runs go in its directory (default %(default)s)")
    ap.add_argument("--fmattn", default="src/fmattn", help="fmattn binary (default %(default)s)")
    ap.add_argument("--mpirun", default=None,
                    help="MPI launcher, may carry flags: \"mpirun --mca btl ^openib\" "
                    "(default mpirun; smpirun with --simulate)")
    ap.add_argument("--simulate", metavar="PLATFORM", default=None,
                    help="run under SimGrid SMPI on a simulated platform: a name in "
                    "scripts/simgrid/ (this_machine, ndr, eth25) or a platform XML; --fmattn "
                    "must be an ./configure --enable-smpi build. Results are marked simulated.")
    ap.add_argument("--smpi-cfg", action="append", default=[], metavar="KEY:VALUE",
                    help="with --simulate: a SimGrid setting for smpirun, repeatable, e.g. "
                    "smpi/coll-selector:ompi (the collectives' algorithms of Open MPI instead of "
                    "SimGrid's defaults); recorded in the results")
    ap.add_argument("--fold-memory", action="store_true",
                    help="with --simulate: every simulated rank's activations and workspaces of "
                    "1 MiB or more share the same physical pages (SimGrid's shared malloc, "
                    "FMATTN_SMPI_FOLD=1): a rank's memory is its parameters, optimizer and "
                    "buffers, so 64-128 ranks fit one machine; the values are garbage, the "
                    "timings are not. Recorded in the results")
    ap.add_argument("--sample", type=int, default=0, metavar="K",
                    help="with --simulate: sampled compute (FMATTN_SMPI_SAMPLE=K): once every "
                    "rank's warm-up step is done, each region of arithmetic (a model pass, an "
                    "fma operator) runs for real K times, on whichever ranks reach it first, and "
                    "is then skipped on every rank and charged its measured rate times the "
                    "rank's own work; the simulated ranks then cost what a few cost, not what 64 "
                    "sharing one process's caches cost, and a sweep runs many times faster. "
                    "Each run writes its rates to sampled_rates.txt in its directory. "
                    "Recorded in the results (0: off)")
    ap.add_argument("--sample-rates", metavar="FILE", default="",
                    help="with --sample: charge every run at the rates in FILE (a run's "
                    "sampled_rates.txt, e.g. the S = 1 run's), measuring only sites it lacks: "
                    "every rank then computes as fast as one rank alone did. Recorded in the "
                    "results")
    ap.add_argument("--extra", default="", help="more fmattn settings for every run, as one "
                    "string: \"--set a.b=c --set d.e=f\"")
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    ap.add_argument("--collect", action="store_true", help="run nothing: collect the bench.h5 "
                    "the sweep's runs left in the results' directory (after a sweep that stopped)")
    args = ap.parse_args()

    args.ranks = int_list(args.ranks, "--ranks")
    if args.n < 2 or args.per_rank < 1:
        die("--n must be >= 2 and --per-rank >= 1")
    if not os.path.isfile(args.deck):
        die(f"deck '{args.deck}' not found (run from the repository root, or give --deck)")
    if args.simulate:
        args.platform = platform_path(args.simulate)
    elif args.smpi_cfg or args.fold_memory or args.sample:
        die("--smpi-cfg, --fold-memory and --sample are for SimGrid's smpirun: give --simulate "
            "PLATFORM too")
    if args.sample < 0:
        die("--sample must be >= 0")
    if args.sample_rates and not args.sample:
        die("--sample-rates needs --sample K")
    if args.sample_rates and not os.path.isfile(args.sample_rates):
        die(f"--sample-rates: no file '{args.sample_rates}'")
    if args.mpirun is None:
        args.mpirun = "smpirun" if args.simulate else "mpirun"
    if not args.dry_run and os.path.isfile(args.fmattn):
        smpi_build = is_smpi_build(args.fmattn)
        if args.simulate and not smpi_build:
            die(f"--simulate needs an fmattn built for SimGrid SMPI, and {args.fmattn} is a native "
                "build: configure a second tree with ./configure --enable-smpi and give its "
                "src/fmattn as --fmattn")
        if smpi_build and not args.simulate:
            die(f"{args.fmattn} is a SimGrid SMPI build (./configure --enable-smpi): it runs "
                "only under smpirun; give --simulate PLATFORM, or a native build")
    args.mpirun_argv = shlex.split(args.mpirun)
    if not args.mpirun_argv:
        die("--mpirun is empty")
    if os.path.basename(args.mpirun_argv[0]) == "srun":
        die("--mpirun srun is not supported: the sweep passes Open MPI's mpirun flags; inside a "
            "SLURM allocation use mpirun (as scripts/slurm/scaling.sbatch does)")
    if not args.dry_run and subprocess.run(["sh", "-c", 'command -v "$1" >/dev/null', "sh",
                                            args.mpirun_argv[0]]).returncode != 0:
        die(f"'{args.mpirun_argv[0]}' is not on PATH (" + (
            "SimGrid is missing: apt-get install libsimgrid-dev" if args.simulate else
            "apt-get install openmpi-bin") + ", or --mpirun)")
    extra = parse_extra(args.extra)
    out_dir = os.path.dirname(args.out) or "."
    cores, cpus = machine_cores()
    user_threads = None
    if os.environ.get("OMP_NUM_THREADS"):
        try:
            user_threads = int(os.environ["OMP_NUM_THREADS"])
        except ValueError:
            die(f"OMP_NUM_THREADS must be a positive integer, got "
                f"'{os.environ['OMP_NUM_THREADS']}'")
        if user_threads < 1:
            die(f"OMP_NUM_THREADS must be a positive integer, got {user_threads}")

    resolved, args.variant = resolve_deck(args, extra)
    points = sweep_points(args)
    plan = []
    for kind, S, n in points:
        name = f"scaling_{kind}_S{S}_n{n}"
        pre, env, threads = launch(args, S, cores, user_threads)
        if args.simulate and args.sample:  # each run's measured rates, for --sample-rates
            env["FMATTN_SMPI_SAMPLE_SAVE"] = os.path.join(out_dir, name, "sampled_rates.txt")
        cmd = pre + fmattn_args(args, extra, kind, S, n, name, out_dir)
        plan.append((kind, S, n, name, cmd, env, threads))
    where = (f"simulated on {args.platform} (SimGrid SMPI; computation timed on "
             f"{socket.gethostname()})" if args.simulate else
             f"on {socket.gethostname()}, {cores} core(s)")
    note(f"{len(plan)} run(s) of {args.deck} ({args.variant}) {where}; results to {args.out}")
    args.host_damon = damon_state() if args.simulate else ""
    if args.host_damon == "on":
        note("warning: the kernel's DAMON monitor is on (/sys/kernel/mm/damon/admin/kdamonds/*/"
             "state): it charges the simulated ranks' memory passes more than a cluster would and "
             "makes steps irregular; for timings, as root: echo off > that file (docs/scaling.md)")
    if args.dry_run:
        for p in plan:
            print(show(p[4], p[5]))
        return

    if args.collect:  # the runs are done: read their bench.h5, run nothing
        rows = []
        for kind, S, n, name, cmd, env, threads in plan:
            bench = os.path.join(out_dir, name, "bench.h5")
            if not os.path.isfile(bench):
                note(f"{name}: no {bench}; the collection stops before it")
                break
            r = read_bench(bench, args.variant, S, n)
            r.update(kind=kind, S=S, n=n, run=name, threads=int(r["threads"]))
            rows.append(r)
        if not rows:
            die(f"--collect: no run of the sweep has a bench.h5 under {out_dir}")
        missing = [p[3] for p in plan[len(rows):]]
        finish(args, rows, resolved, cores, cpus, failed=missing[0] if missing else "")
        return

    # Pre-flight: check every point's deck under its own launcher (the layout for S ranks) before
    # the first run, so that a bad point fails in seconds, not after hours of the sweep.
    for kind, S, n, name, cmd, env, threads in plan:
        i = cmd.index(args.fmattn)
        chk = cmd[:i + 1] + ["--check"] + cmd[i + 1:]
        p = subprocess.run(chk, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           text=True)
        if p.returncode != 0:
            sys.stderr.write(p.stderr)
            die(f"{name}: fmattn --check rejected the run (message above); nothing was run.\n"
                f"  command: {show(chk, env)}")
    note(f"all {len(plan)} run(s) pass fmattn --check")

    os.makedirs(out_dir, exist_ok=True)
    rows, done = [], []
    for kind, S, n, name, cmd, env, threads in plan:
        bench = os.path.join(out_dir, name, "bench.h5")
        if os.path.exists(bench):
            os.remove(bench)  # a stale file must not pass for this run's result
        if S * threads > cores and not args.simulate:
            note(f"warning: {S} ranks x {threads} thread(s) > {cores} cores: oversubscribed, "
                 "the timings are not meaningful")
        print(f"\n{PROG}: [{len(done) + 1}/{len(plan)}] {show(cmd, env)}", flush=True)
        rc = subprocess.run(cmd, env=env).returncode  # fmattn's output streams through
        if rc != 0:
            why = f"killed by signal {-rc}" if rc < 0 else f"exit status {rc}"
            if rows:  # the runs before it are results: keep them, marked incomplete
                finish(args, rows, resolved, cores, cpus, failed=name)
            die(f"run {name} ({kind} scaling, S = {S}, n = {n}) failed ({why}); fmattn's "
                "messages are above.\n"
                f"  command: {show(cmd, env)}\n"
                f"  completed: {', '.join(done) or 'none'} (bench.h5 in {out_dir}/<run>/); "
                + (f"{args.out} holds them, marked incomplete" if rows else
                   f"{args.out} not written"))
        if not os.path.isfile(bench):
            die(f"run {name} finished but {bench} is missing")
        r = read_bench(bench, args.variant, S, n)
        ran = int(r["threads"]) if np.isfinite(r["threads"]) else threads
        if ran != threads:  # what fmattn reports wins: it is what ran
            note(f"warning: {name} ran {ran} thread(s) per rank, not {threads}")
        if np.isfinite(r["ranks"]) and int(r["ranks"]) != S:
            die(f"{bench} says {int(r['ranks'])} ranks ran, not {S}")
        r.update(kind=kind, S=S, n=n, run=name, threads=ran)
        rows.append(r)
        done.append(name)

    finish(args, rows, resolved, cores, cpus)


if __name__ == "__main__":
    main()
