#!/bin/sh
# The CUDA back end's own counts (gpu/counts.cu; bench.h5 /gpu, one row per case) under the
# emulation: they are the code's own, so they must equal what the emulation's trace counts
# independently (CUDAEMU_TRACE=1: one line per launch, cuBLAS call and cudaMalloc). A bench of 2
# repetitions less one of 1 is one repetition of every case: its traced products and launches
# equal the rows' per-repetition counts summed (the trace read from bench's first line on: the
# GEMM-rate probe before it runs for a time, not a count). In bf16 only fma converts (its
# evaluation's operands, into bf16 copies made once) and its products read fewer bytes; a step
# allocates nothing after the first.
. "$TESTDIR/tap.sh"
need_h5py "the checks read bench.h5"
cd "$WORK" || exit 1
G="$EMU_BUILD/fmattn_emu" DECK="$TESTDIR/decks/gpu_train.in"
# bench NAME REPEATS [--set ...]: a traced bench of attention and training at n = 64 on the GPU
bench() {
  name=$1 reps=$2
  shift 2
  CUDAEMU_TRACE=1 FMATTN_GPU_POOL_TRACE="$name.pool" "$G" "$DECK" --set run.mode=bench \
    --set run.name="$name" --set bench.what=attention,train --set bench.n_list=64 --set bench.variants=full,fma \
    --set bench.repeats="$reps" --set bench.batch=2 --set parallel.device=gpu "$@" > "$name.log" 2>&1
}
check "bench on the emulated GPU, 1 repetition, traced" bench r1 1
check "bench on the emulated GPU, 2 repetitions, traced" bench r2 2
check "bench in bf16, 2 repetitions" bench bf 2 --set parallel.precision=bf16
check "/gpu: a row per case (attention full and fma, a training step), every count set" py - <<'PY'
import h5py
g = h5py.File("out/r2/bench.h5", "r")["gpu"]
kinds = [k.decode() for k in g["kind"][()]]
variants = [v.decode() for v in g["variant"][()]]
assert kinds == ["attention", "attention", "train"], kinds
assert variants == ["full", "fma", "full"], variants
for c in ("gemm_calls", "gemm_flops", "gemm_operand_elements", "kernel_launches",
          "pool_live_peak_bytes"):
    assert all(g[c][()] > 0), (c, g[c][()])
assert all(g["pool_reserved_peak_bytes"][()] >= g["pool_live_peak_bytes"][()])
assert list(g["seq_ranks"][()]) == [1, 1, 1] and list(g["n"][()]) == [64, 64, 64]
PY
# each FMA operator is an NVTX range named for its timer (gpu_op_begin/end), opened and closed in
# pairs, the emulation tracing them
check "the FMA operators are NVTX ranges (P2M, M2P, P2P), each one closed" py - <<'PY'
import re
text = open("r1.log").read()
opened = re.findall(r"^cudaemu: nvtx range (\S+) opened", text, re.M)
closed = re.findall(r"^cudaemu: nvtx range (\S+) closed", text, re.M)
assert {"P2M", "M2P", "P2P"} <= set(opened), sorted(set(opened))
assert sorted(opened) == sorted(closed) and len(opened) > 10, (len(opened), len(closed))
PY
# the trace's own count: gpu/'s kernel launches ("cudaemu: kernel NAME ...") and cuBLAS
# products ("cudaemu: cublasSgemm m=..."); the emulated cuBLAS runs no traced kernel
check "one repetition of every case: the trace's launches and products equal the counts" py - <<'PY'
import re, h5py
def seen(log):
    # after the GEMM-rate probe (its products run for a time, not a count): from bench's first line
    text = open(log).read()
    text = text[text.index("bench on "):]
    return (len(re.findall(r"^cudaemu: kernel \S", text, re.M)),
            len(re.findall(r"^cudaemu: cublas\w+ m=", text, re.M)))
(l1, g1), (l2, g2) = seen("r1.log"), seen("r2.log")
g = h5py.File("out/r2/bench.h5", "r")["gpu"]
launches, gemms = sum(g["kernel_launches"][()]), sum(g["gemm_calls"][()])
assert l2 - l1 == launches and g2 - g1 == gemms, (l2 - l1, launches, g2 - g1, gemms)
assert launches > 0 and gemms > 0
PY
check "every launch in gpu/ is followed by its own LAUNCH_CHECK naming its kernel (which counts it)" py - "$SRCDIR/gpu" <<'PY'
import glob, os, re, sys
bad, n = [], 0
for path in sorted(glob.glob(os.path.join(sys.argv[1], "*.cu"))):
    s = open(path).read()
    for m in re.finditer(r"([A-Za-z_][A-Za-z_0-9:]*(?:<[^<>;]*>)?)\s*<<<", s):
        i = s.index(">>>(", m.end()) + 4
        depth = 1
        while depth:
            depth += (s[i] == "(") - (s[i] == ")")
            i += 1
        rest = s[s.index(";", i - 1) + 1:].lstrip()
        n += 1
        if not rest.startswith(f"LAUNCH_CHECK({m.group(1)});"):
            bad.append(f"{os.path.basename(path)}:{s[:m.start()].count(chr(10)) + 1} ({m.group(1)})")
assert n > 50 and not bad, "launches without their own LAUNCH_CHECK(kernel): " + ", ".join(bad)
PY
check "bf16: the same products; fma alone converts, nothing twice (q, k, v forward, dout backward, its summaries), and reads bf16" py - <<'PY'
import h5py
a, b = (h5py.File(f"out/{r}/bench.h5", "r")["gpu"] for r in ("r2", "bf"))
assert [p.decode() for p in b["precision"][()]] == ["bf16"] * 3
assert list(b["gemm_calls"][()]) == list(a["gemm_calls"][()])
assert list(b["gemm_operand_elements"][()]) == list(a["gemm_operand_elements"][()])
assert all(a["elements_converted"][()] == 0) and all(a["elements_converted_in_pass"][()] == 0)
conv, ab, bb = b["elements_converted"][()], a["gemm_operand_bytes"][()], b["gemm_operand_bytes"][()]
inp = b["elements_converted_in_pass"][()]
# full (attention, training) reads its fp32 operands as they lie; fma's evaluation reads bf16
# copies made once: q forward, k and v by the upward pass's transposes (in pass), kept in the
# saved state for backward, dout backward by the pass that sums D (in pass) (B = 2, T = 64,
# C = 32); and its summaries
btc = 2 * 64 * 32
assert conv[0] == 0 and conv[2] == 0 and inp[0] == 0 and inp[2] == 0, (conv, inp)
assert inp[1] == 3 * btc, inp / btc
# before: 7 B·T·C and the summaries (q, k, v again backward); the summaries here 2.25 B·T·C
assert 4 * btc < conv[1] < 7 * btc, conv / btc
assert list(ab) == [4 * e for e in a["gemm_operand_elements"][()]], ab
assert bb[0] == ab[0] and bb[2] == ab[2] and bb[1] < 0.8 * ab[1], (ab, bb)
PY
check "a training step allocates nothing after the first, nor (fp32 and bf16) an attention case after its warm-up" py - <<'PY'
import h5py
for run in ("r2", "bf"):
    g = h5py.File(f"out/{run}/bench.h5", "r")["gpu"]
    assert all(g["mallocs_after_first_step"][()] == 0), (run, g["mallocs_after_first_step"][()])
PY
# the pool's trace (FMATTN_GPU_POOL_TRACE: every request, in order) replayed by
# scripts/pool_replay.py, which models the pool apart from gpu/memory.cu, gives each case's counts
check "the pool's counts are its trace's, replayed (pool_replay.py): growths, live and reserved peaks" py - "$SRCDIR/scripts" <<'PY'
import sys, h5py
sys.path.insert(0, sys.argv[1])
from pool_replay import replay
for run in ("r2", "bf"):
    g = h5py.File(f"out/{run}/bench.h5", "r")["gpu"]
    got = replay(f"{run}.pool", "oldest")
    assert len(got) == len(g["kind"][()]) == 3, (run, got)
    for i, s in enumerate(got):
        for c in ("mallocs", "pool_live_peak_bytes", "pool_reserved_peak_bytes"):
            h5c = "mallocs_after_first_step" if c == "mallocs" else c
            assert s[c] == g[h5c][i], (run, i, c, s[c], g[h5c][i])
    assert max(s["pool_live_peak_bytes"] for s in got) > 0
PY
check "roofline.py bounds every case from the counts, beside the measured time, and plots them" \
  sh -c "'${PYTHON3:-/usr/bin/python3}' '$SRCDIR/scripts/roofline.py' out/r2/bench.h5 --device h100-sxm --plot roof.png > roof.txt && head -c 8 roof.png | grep -q PNG"
check "roofline.py: three cases bounded, each with its measured time" py - <<'PY'
rows = [l.split() for l in open("roof.txt") if l.split() and l.split()[0] in ("attention", "train")]
assert len(rows) == 3, rows
for r in rows:
    bound, measured = float(r[8]), float(r[10])
    assert bound > 0 and measured > 0 and r[9] in ("flops", "bytes", "launches"), r
PY
check "bf16's bound: the FLOP term 989/66.9 times fp32's; full's bytes fp32's, fma's its bf16 operands and its conversions" py - <<'PY'
import json, os, subprocess, sys
def bounds(run):
    subprocess.run([sys.executable, os.environ["SRCDIR"] + "/scripts/roofline.py",
                    f"out/{run}/bench.h5", "--json", f"{run}.json"], check=True,
                   stdout=subprocess.DEVNULL)
    return {(c["kind"], c["variant"]): c for c in json.load(open(f"{run}.json"))["cases"]}
a, b = bounds("r2"), bounds("bf")
assert a.keys() == b.keys() and len(a) == 3, (a.keys(), b.keys())
for k in a:
    ratio = b[k]["flops_ms"] / a[k]["flops_ms"]
    assert abs(ratio - 66.9 / 989.4) < 1e-9, (k, ratio)
    if k[1] == "full":
        assert b[k]["bytes_ms"] == a[k]["bytes_ms"] and b[k]["bound_ms"] <= a[k]["bound_ms"], (k, a[k], b[k])
import h5py
g = h5py.File("out/bf/bench.h5", "r")["gpu"]
i = [v.decode() for v in g["variant"][()]].index("fma")
inp = g["elements_converted_in_pass"][i]
want = (g["gemm_operand_bytes"][i] + 6 * (g["elements_converted"][i] - inp) + 2 * inp) / 3.35e12 * 1e3
got = b[("attention", "fma")]["bytes_ms"]
assert abs(got - want) <= 1e-9 * want, (got, want)
PY
# issue 27 §4: the near field's products per chunk (at most 4 forward and 12 backward): one
# product for the scores, one for the values, dP and dq each over every near offset, and one per
# offset for dv and dk, wherever the chunk lies (the sequence's first and last query blocks read
# padded copies of the key array's ends). At n = 64 one chunk holds both ends, where the products
# were 4 and 10 causal, 6 and 15 bidirectional. Counted from the trace: the cuBLAS calls inside
# the near field's NVTX ranges (P2P), next to the softmax kernels that tell forward from backward
nearbench() {
  CUDAEMU_TRACE=1 "$G" "$DECK" --set run.mode=bench --set run.name="$1" --set bench.what=attention \
    --set bench.n_list=64 --set bench.variants=fma --set bench.repeats=1 --set bench.batch=2 \
    --set parallel.device=gpu --set model.objective="$2" > "$1.log" 2>&1
}
check "fma attention in bench, causal, traced" nearbench nc clm
check "fma attention in bench, bidirectional (mlm), traced" nearbench nb mlm
check "near-field products per chunk: 2 forward, 3 + 2 ns backward (causal 7, bidirectional 9)" py - <<'PY'
import re
def per_chunk(log):
    ranges, cur = [], None  # the P2P ranges in order: [products, kernels]
    for line in open(log):
        if line.startswith("cudaemu: nvtx range P2P opened"):
            cur = [0, set()]
        elif line.startswith("cudaemu: nvtx range P2P closed"):
            ranges.append(cur)
            cur = None
        elif cur is not None:
            cur[0] += bool(re.match(r"cudaemu: cublas\w+ m=", line))
            k = re.match(r"cudaemu: kernel (\w+)", line)
            if k:
                cur[1].add(k.group(1))
    fwd, bwd = [], []  # per chunk evaluated: the scores' range, the softmax's, then the values'
    for i, (n, kernels) in enumerate(ranges):
        if any(k.startswith("softmax_forward") for k in kernels):  # held in registers or not
            fwd.append(ranges[i - 1][0] + n + ranges[i + 1][0])
        if any(k.startswith("probabilities") for k in kernels):  # the scores again; dP, dv; dq, dk
            bwd.append(ranges[i - 1][0] + n + ranges[i + 1][0] + ranges[i + 2][0])
    return fwd, bwd
for run, ns in (("nc", 2), ("nb", 3)):
    fwd, bwd = per_chunk(f"{run}.log")
    assert fwd and len(bwd) == len(fwd), (run, fwd, bwd)
    assert set(fwd) == {2} and set(bwd) == {3 + 2 * ns}, (run, fwd, bwd)
PY
# issue 27 §4: sequence parallelism multiplies no products. A training step of fma on S = 2 ranks
# issues at most 1.2x the GEMMs per rank of S = 1 (the upward pass's and the near field's per-head
# products batched over the heads, the weight gradients over gathered summary rows)
seqbench() {
  name=$1 S=$2
  "$MPI_RUN" "$S" env CUDAEMU_DEVICES="$S" "$G" "$DECK" --set run.mode=bench --set run.name="$name" \
    --set bench.what=train --set bench.n_list=512 --set bench.repeats=1 --set bench.batch=2 \
    --set parallel.device=gpu --set parallel.seq_ranks="$S" --set attention.variant=fma \
    --set model.context=512 --set model.dim=64 --set model.heads=4 > "$name.log" 2>&1
}
check "fma trains in bench on S = 1" seqbench s1 1
check "fma trains in bench on S = 2 ranks (2 emulated devices)" seqbench s2 2
check "S = 2: GEMMs per rank and step at most 1.2x those of S = 1" py - <<'PY'
import h5py
a, b = (h5py.File(f"out/{r}/bench.h5", "r")["gpu"] for r in ("s1", "s2"))
assert list(b["seq_ranks"][()]) == [2], b["seq_ranks"][()]
g1, g2 = a["gemm_calls"][()][0], b["gemm_calls"][()][0]
assert 0 < g2 <= 1.2 * g1, (g1, g2)
PY
check "the FMA operators' device times fill bench's columns (near field rate, the phases of an attention row; near and far per step)" py - <<'PY'
import math, h5py
a = h5py.File("out/r2/bench.h5", "r")["attention"]
variants = [v.decode() for v in a["variant"][()]]
i = variants.index("fma")
p2p = a["p2p_gflops"][()][i]
assert math.isfinite(p2p) and p2p > 0, p2p
# the phases per forward + backward: filled (M2M may be 0: at this n summaries have one level),
# together within the forward + backward's time
phases = [a[c][()][i] for c in ("p2p_ms", "m2p_ms", "p2m_ms", "m2m_ms")]
assert all(x > 0 for x in phases[:3]) and phases[3] >= 0, phases
assert sum(phases) < a["fwd_ms"][()][i] + a["bwd_ms"][()][i], (phases, a["fwd_ms"][()][i], a["bwd_ms"][()][i])
t = h5py.File("out/s1/bench.h5", "r")["train"]
near, far, step = t["near_ms"][()][0], t["far_ms"][()][0], t["step_ms"][()][0]
assert 0 < near and 0 < far and near + far < step, (near, far, step)
PY
check "MFU also against the device's published peak (H100 SXM: 66.9 fp32, 989.4 bf16 TFLOP/s)" py - <<'PY'
import math, h5py
for run, peak in (("r2", 66.9e3), ("bf", 989.4e3)):
    f = h5py.File(f"out/{run}/bench.h5", "r")
    assert f.attrs["published_peak_gflops"] == peak, (run, f.attrs["published_peak_gflops"])
    assert math.isnan(f.attrs["fma_peak_gflops"]), f.attrs["fma_peak_gflops"]
    t = f["train"]
    assert abs(t["mfu_peak"][0] / t["mfu"][0] - f.attrs["sgemm_gflops"] / peak) < 1e-9 * t["mfu_peak"][0] / t["mfu"][0]
PY
tap_done
