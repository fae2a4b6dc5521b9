#!/usr/bin/python3
"""fmattn's training step against PyTorch eager's, the same model on the same BLAS kernels.

  torch_bench.py [--fmattn src/fmattn] [--deck inputs/bench.in] [--n 512] [--rounds 3]
                 [--steps 5] [--threads 2] [--torch-blas-threads best] [--out torch_bench.json]

The model is the deck's (fmattn --check resolves it): GPT-2 blocks, full causal attention, learned
positions, dropout, tied or separate head, AdamW with clipping; fp32 on the CPU. fmattn runs in
bench mode (bench.what = train) and reports its median step; PyTorch runs the same model eagerly
(attention as q·kᵀ, mask, softmax, ·v: torch 1.13 has no fused SDPA), median of --steps steps
after a warm-up. The two alternate --rounds times in one run, so a drift of the machine's clocks
touches both alike; the figures are the medians over rounds, and each round's own ratio is
printed and saved with their median (the two medians part where the host changes speed between
the halves of a round).

PyTorch runs --threads threads of its own, and its OpenBLAS the number of threads that makes its
step fastest: OpenBLAS reads OPENBLAS_NUM_THREADS once, when numpy (through h5py) loads it before
PyTorch is imported, so the caller's setting would otherwise decide, and on a 2-core AMD EPYC
PyTorch's step was 14 % faster with OpenBLAS on 1 thread under its own 2 than on 2 (docs/perf.md).
Before the rounds, PyTorch's step is timed with OpenBLAS on 1 thread and on --threads, alternately
(--torch-blas-threads best, the default), and the faster is kept; or give the number. That needs
OpenBLAS's pthreads build (Debian's PyTorch links it): an OpenMP build's thread count is PyTorch's
too, so there the threads are left as loaded, and said so.

Both link OpenBLAS: the BLAS core each one runs is printed (fmattn's from bench.h5, PyTorch's by
asking the OpenBLAS libraries loaded in this process), so a comparison on different kernels shows.
OPENBLAS_CORETYPE, when set, reaches both. When it is not set and fmattn corrected a generic
fallback (its first round's bench.h5 says `blas_core_corrected_from`), the script runs itself again
with OPENBLAS_CORETYPE set to fmattn's core, so PyTorch runs the same kernels: OpenBLAS picks its
core when it is loaded, and numpy (through h5py) has loaded it before PyTorch is imported.
"""
import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from fmattn_h5 import h5py  # noqa: E402
from fmattn_deck import deck_values

HERE = os.path.dirname(os.path.abspath(__file__))


def die(msg):
    print(f"torch_bench.py: error: {msg}", file=sys.stderr, flush=True)
    sys.exit(1)


def resolved_deck(fmattn, deck, sets):
    """The deck as fmattn resolves it (fmattn --check): {"section.key": "value"}."""
    cmd = [fmattn, "--check", deck] + [x for s in sets for x in ("--set", s)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        die(f"fmattn rejected the deck: {r.stderr.strip()}")
    return deck_values(r.stdout)


def blas_libs():
    """Every OpenBLAS library this process has loaded (PyTorch's BLAS), by path."""
    libs = {}
    with open("/proc/self/maps") as f:
        paths = {w[-1] for w in map(str.split, f) if "blas" in w[-1] and w[-1].startswith("/")}
    for p in sorted(paths):
        try:
            lib = ctypes.CDLL(p)
            lib.openblas_get_corename.restype = ctypes.c_char_p
            for name in ("openblas_set_num_threads", "openblas_get_num_threads",
                         "openblas_get_parallel"):
                getattr(lib, name)
        except (OSError, AttributeError):
            continue
        libs[p] = lib
    return libs


def blas_threads_settable(libs):
    """Why PyTorch's OpenBLAS threads cannot be set apart from PyTorch's own, or None where they
    can: OpenBLAS loaded, and all of it the pthreads build (openblas_get_parallel() 1; a serial
    build has 1 thread only, and an OpenMP build's setting is PyTorch's thread count too)."""
    if not libs:
        return "no OpenBLAS loaded"
    kinds = {lib.openblas_get_parallel() for lib in libs.values()}
    if kinds != {1}:
        return "OpenBLAS not the pthreads build (openblas_get_parallel: %s)" % sorted(kinds)
    return None


def set_blas_threads(libs, threads):
    """Run every loaded OpenBLAS on `threads` threads, and check that it does."""
    for p, lib in libs.items():
        lib.openblas_set_num_threads(threads)
        if lib.openblas_get_num_threads() != threads:
            die(f"{p} runs {lib.openblas_get_num_threads()} threads where {threads} were set")


def blas_threads_now(libs):
    """The threads every loaded OpenBLAS runs now: one number, or None."""
    got = {lib.openblas_get_num_threads() for lib in libs.values()}
    return got.pop() if len(got) == 1 else None


def build_model(torch, cfg):
    nn, F = torch.nn, torch.nn.functional
    C, H, L = int(cfg["model.dim"]), int(cfg["model.heads"]), int(cfg["model.layers"])
    n, p = int(cfg["model.context"]), float(cfg["model.dropout"])
    tied = cfg["model.tie_embeddings"] == "true"  # fmattn resolves a switch to true or false
    R = int(cfg["model.mlp_ratio"]) * C
    V = 256  # bytes
    for key, want in (("position", "learned"), ("objective", "clm")):
        if cfg[f"model.{key}"] != want:
            die(f"model.{key} = {cfg[f'model.{key}']}: this comparison builds {key} {want} only")
    if cfg["attention.heads_mode"] != "standard":
        die("attention.heads_mode must be standard for this comparison")

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(C), nn.LayerNorm(C)
            self.qkv, self.proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
            self.fc1, self.fc2 = nn.Linear(C, R), nn.Linear(R, C)

        def forward(self, x, mask):
            B, T, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
            q, k, v = (t.view(B, T, H, C // H).transpose(1, 2) for t in (q, k, v))
            s = (q @ k.transpose(-2, -1)) * (1.0 / (C // H) ** 0.5)
            a = F.softmax(s.masked_fill(mask[:T, :T], float("-inf")), dim=-1) @ v
            x = x + F.dropout(self.proj(a.transpose(1, 2).reshape(B, T, C)), p)
            h = F.gelu(self.fc1(self.ln2(x)), approximate="tanh")
            return x + F.dropout(self.fc2(h), p)

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok, self.pos = nn.Embedding(V, C), nn.Embedding(n, C)
            self.blocks = nn.ModuleList(Block() for _ in range(L))
            self.lnf = nn.LayerNorm(C)
            self.head = None if tied else nn.Linear(C, V, bias=False)
            self.register_buffer("mask", torch.triu(torch.ones(n, n, dtype=torch.bool), 1))

        def forward(self, idx, targets):
            T = idx.shape[1]
            x = F.dropout(self.tok(idx) + self.pos(torch.arange(T)), p)
            for b in self.blocks:
                x = b(x, self.mask)
            x = self.lnf(x)
            logits = x @ self.tok.weight.t() if self.head is None else self.head(x)
            return F.cross_entropy(logits.view(-1, V), targets.view(-1))

    return GPT(), V


def torch_steps(torch, model, V, batch, n, steps, seed):
    """Median milliseconds of a training step (zero_grad, forward, backward, clip, AdamW)."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, V, (batch, n), generator=g)
    tgt = torch.randint(0, V, (batch, n), generator=g)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    times = []
    for s in range(steps + 1):  # s = 0: warm-up
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        model(idx, tgt).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if s:
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def torch_blas_threads(torch, model, V, batch, n, a, libs):
    """The OpenBLAS threads PyTorch runs on (--torch-blas-threads; with 'best', the faster of 1 and
    --threads, each timed twice alternately), and the probe's steps (ms) by thread count."""
    if a.torch_blas_threads != "best":
        return int(a.torch_blas_threads), {}
    candidates = sorted({1, a.threads})
    if len(candidates) == 1:
        return 1, {}
    probe = {t: [] for t in candidates}
    for r in range(2):
        for t in candidates:
            set_blas_threads(libs, t)
            steps = max(1, a.steps // 2)
            probe[t].append(torch_steps(torch, model, V, batch, n, steps, seed=100 + r))
    best = min(candidates, key=lambda t: statistics.median(probe[t]))
    print("torch_bench.py: PyTorch's step with its OpenBLAS on " +
          ", ".join(f"{t} thread(s) {statistics.median(probe[t]):.1f} ms" for t in candidates) +
          f" (medians of 2, alternately): {best} kept", flush=True)
    return best, {str(t): v for t, v in probe.items()}


def attr_text(v):
    return v.decode() if isinstance(v, bytes) else str(v)


def fmattn_step(fmattn, deck, sets, workdir, env):
    """fmattn's median step (ms), tokens/s, FLOPs per token, BLAS core and SGEMM rate."""
    cmd = [fmattn, deck] + [x for s in sets for x in ("--set", s)]
    cmd += ["--set", "bench.what=train", "--set", f"output.dir={workdir}"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode:
        die(f"fmattn failed: {r.stderr.strip()[-400:]}")
    path = os.path.join(workdir, "bench", "bench.h5")
    with h5py.File(path, "r") as f:
        t = f["train"]
        core = f.attrs.get("blas_core", b"")
        fallback = f.attrs.get("blas_core_corrected_from", b"")
        return {"step_ms": float(t["step_ms"][0]), "tokens_per_s": float(t["tokens_per_s"][0]),
                "flops_per_token": float(t["flops_per_token"][0]),
                "blas_core": attr_text(core), "corrected_from": attr_text(fallback),
                "sgemm_gflops": float(f.attrs["sgemm_gflops"])}


def same_kernels_for_torch(first):
    """Run this script again with fmattn's core for PyTorch's OpenBLAS, where fmattn corrected a
    fallback and the user chose no core (see the module's docstring)."""
    if "OPENBLAS_CORETYPE" in os.environ or not first["corrected_from"]:
        return
    print(f"torch_bench.py: fmattn corrected OpenBLAS's {first['corrected_from']} to "
          f"{first['blas_core']}; running again with OPENBLAS_CORETYPE={first['blas_core']} so "
          "that PyTorch runs the same kernels", flush=True)
    os.environ["OPENBLAS_CORETYPE"] = first["blas_core"]
    os.environ["TORCH_BENCH_CORE_FROM"] = first["corrected_from"]
    sys.stdout.flush()
    os.execv(sys.executable, [sys.executable] + sys.argv)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fmattn", default=os.path.join(HERE, "..", "src", "fmattn"))
    ap.add_argument("--deck", default=os.path.join(HERE, "..", "inputs", "bench.in"))
    ap.add_argument("--n", type=int, default=512, help="tokens per sequence (model.context)")
    ap.add_argument("--rounds", type=int, default=3, help="fmattn and PyTorch alternate this often")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per round, each side")
    ap.add_argument("--threads", type=int, default=2, help="threads for both")
    ap.add_argument("--torch-blas-threads", default="best",
                    help="PyTorch's OpenBLAS threads: a number, or best (the faster of 1 and "
                         "--threads, timed before the rounds)")
    ap.add_argument("--out", help="write the figures as JSON")
    a = ap.parse_args()
    if a.torch_blas_threads != "best" and not (a.torch_blas_threads.isdecimal() and
                                               int(a.torch_blas_threads) > 0):
        die(f"--torch-blas-threads {a.torch_blas_threads}: give a positive number or best")
    if not os.access(a.fmattn, os.X_OK):
        die(f"{a.fmattn} is not an executable fmattn (build it, or pass --fmattn)")
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), OPENBLAS_NUM_THREADS=str(a.threads))
    os.environ.update(OMP_NUM_THREADS=str(a.threads), OPENBLAS_NUM_THREADS=str(a.threads))
    sets = [f"model.context={a.n}", "bench.n_list=%d" % a.n, f"bench.repeats={a.steps}",
            "attention.variant=full", "run.mode=bench", "run.name=bench"]
    cfg = resolved_deck(a.fmattn, a.deck, sets)
    batch = int(cfg["train.batch"])
    fm = []
    with tempfile.TemporaryDirectory(prefix="torch_bench.") as tmp:
        fm.append(fmattn_step(a.fmattn, a.deck, sets, os.path.join(tmp, "0"), env))
    same_kernels_for_torch(fm[0])
    import torch  # after OMP_NUM_THREADS and OPENBLAS_CORETYPE are set

    torch.set_num_threads(a.threads)
    torch.manual_seed(1)
    model, V = build_model(torch, cfg)
    model.train()
    libs = blas_libs()
    cores = {p: lib.openblas_get_corename().decode() for p, lib in libs.items()}
    print(f"torch_bench.py: torch {torch.__version__}, {a.threads} thread(s); its OpenBLAS "
          f"core(s): {', '.join(f'{c} ({p})' for p, c in cores.items()) or 'none found'}",
          flush=True)
    why = blas_threads_settable(libs)
    if why and a.torch_blas_threads != "best":
        die(f"--torch-blas-threads {a.torch_blas_threads}: {why}")
    if why:
        print(f"torch_bench.py: PyTorch's OpenBLAS threads left as loaded: {why}", flush=True)
        blas_threads, probe = None, {}
    else:
        blas_threads, probe = torch_blas_threads(torch, model, V, batch, a.n, a, libs)
        set_blas_threads(libs, blas_threads)
    if torch.get_num_threads() != a.threads:
        die(f"PyTorch runs {torch.get_num_threads()} threads where --threads {a.threads} was set")
    tt = []
    with tempfile.TemporaryDirectory(prefix="torch_bench.") as tmp:
        for r in range(a.rounds):
            if r:  # round 1's fmattn ran above, before PyTorch was loaded
                fm.append(fmattn_step(a.fmattn, a.deck, sets, os.path.join(tmp, str(r)), env))
            tt.append(torch_steps(torch, model, V, batch, a.n, a.steps, seed=r))
            print(f"  round {r + 1}: fmattn {fm[-1]['step_ms']:.1f} ms/step "
                  f"(BLAS core {fm[-1]['blas_core']}), PyTorch eager {tt[-1]:.1f} ms/step",
                  flush=True)
    fm_round = [x["step_ms"] for x in fm]
    ratios = [t / f for f, t in zip(fm_round, tt)]  # each round's own
    fm_ms = statistics.median(fm_round)
    th_ms = statistics.median(tt)
    tokens = batch * a.n
    fpt = fm[0]["flops_per_token"]
    res = {"n": a.n, "batch": batch, "threads": a.threads, "rounds": a.rounds,
           "fmattn_step_ms": fm_ms, "torch_step_ms": th_ms,
           "fmattn_tokens_per_s": tokens / fm_ms * 1e3, "torch_tokens_per_s": tokens / th_ms * 1e3,
           "speedup": th_ms / fm_ms, "flops_per_token": fpt,
           "fmattn_round_ms": fm_round, "torch_round_ms": tt,
           "round_speedups": ratios, "round_speedup_median": statistics.median(ratios),
           "fmattn_blas_core": fm[0]["blas_core"], "torch_blas_cores": cores,
           "sgemm_gflops": statistics.median(x["sgemm_gflops"] for x in fm),
           "torch": torch.__version__, "torch_blas_threads": blas_threads,
           "torch_blas_threads_after": blas_threads_now(libs), "torch_blas_probe_ms": probe,
           "OPENBLAS_CORETYPE": os.environ.get("OPENBLAS_CORETYPE", ""),
           "OPENBLAS_CORETYPE_corrects": os.environ.get("TORCH_BENCH_CORE_FROM", "")}
    print(f"torch_bench.py: n = {a.n}, batch {batch}: fmattn {res['fmattn_tokens_per_s']:.0f} "
          f"tok/s ({fpt * tokens / fm_ms / 1e6:.1f} GFLOP/s), PyTorch eager "
          f"{res['torch_tokens_per_s']:.0f} tok/s ({fpt * tokens / th_ms / 1e6:.1f} GFLOP/s): "
          f"fmattn {res['speedup']:.2f}x (medians of {a.rounds} alternating rounds); the rounds' "
          f"own ratios {min(ratios):.2f}-{max(ratios):.2f}x, median "
          f"{res['round_speedup_median']:.2f}x; PyTorch on {a.threads} thread(s), its OpenBLAS on "
          f"{res['torch_blas_threads_after'] or '?'}")
    same = set(cores.values()) == {fm[0]["blas_core"]}
    print(f"torch_bench.py: BLAS core: fmattn {fm[0]['blas_core']}, PyTorch "
          f"{'/'.join(sorted(set(cores.values()))) or '?'}"
          f"{'' if same else ' -- NOT the same kernels'}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
