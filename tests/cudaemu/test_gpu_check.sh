#!/bin/sh
# scripts/gpu_check.sh, the command a GPU node runs, end to end at toy sizes on the emulated GPU
# (FMATTN=fmattn_emu, --quick): the benchmarks run and docs/gpu/<device>.csv gets its columns and
# rows (GEMM rates, attention, the two training steps with their peak memory); gpu_csv.py takes
# SDPA rows; sdpa_bench.py runs where PyTorch has scaled_dot_product_attention.
. "$TESTDIR/tap.sh"
need_h5py "gpu_csv.py reads bench.h5"
cd "$WORK" || exit 1
ln -s "$SRCDIR/inputs" inputs && ln -s "$SRCDIR/scripts" scripts && touch configure.ac
check "gpu_check.sh --quick runs on the emulated GPU" env FMATTN="$EMU_BUILD/fmattn_emu" \
  WORK="$WORK/gc" OUT_DIR="$WORK/csv" PYTHON="$PYTHON3" sh "$SRCDIR/scripts/gpu_check.sh" --quick
# --lease's deadline: with LEASE_SECS spent, a run that would start under a limit is not started,
# says so, and the script stops there (a benchmark's failure ends it)
check "--lease starts nothing once LEASE_SECS is spent, and says so" sh -c "! env \
  FMATTN='$EMU_BUILD/fmattn_emu' WORK='$WORK/gl' OUT_DIR='$WORK/csvl' PYTHON='$PYTHON3' LEASE_SECS=0 \
  sh '$SRCDIR/scripts/gpu_check.sh' --quick --lease > lease.out 2>&1 &&
  grep -q \"the lease's 0 s are spent: not run: env FMATTN_GPU_POOL_TRACE\" lease.out &&
  grep -q 'fmattn bench attention failed' lease.out && ! ls '$WORK'/gl/runs/attention/bench.h5"
csv=$(ls "$WORK"/csv/*-quick.csv 2>/dev/null | head -n 1)
check "it writes docs/gpu/<device>.csv (here: $(basename "${csv:-none}"))" test -s "${csv:-none}"
check "the CSV has the columns and rows the issue names" py - "$csv" <<'PY'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
need = {"device", "variant", "n", "precision", "fwd_ms", "bwd_ms"}
assert need <= set(rows[0]), rows[0].keys()
gemm = {r["precision"]: float(r["tflops"]) for r in rows if r["variant"] == "gemm"}
assert set(gemm) == {"fp32", "bf16"} and min(gemm.values()) > 0, gemm
att = [r for r in rows if r["variant"] in ("fma", "full") and r["fwd_ms"]]
assert {r["variant"] for r in att} == {"fma", "full"}, att
assert {int(r["n"]) for r in att} == {256, 512} and all(float(r["bwd_ms"]) > 0 for r in att), att
steps = sorted(int(r["n"]) for r in rows if r["variant"] == "train:fma")
assert steps == [128, 1024], steps
assert all(int(r["peak_bytes"]) > 0 for r in rows if r["variant"].startswith("train:"))
assert {r["precision"] for r in att} == {"bf16", "fp32"}, att
assert {r["variant"] for r in att if r["precision"] == "fp32"} == {"fma"}, att
PY
check "the roofline bound beside each measured case (<device>-roofline.txt)" py - "$csv" <<'PY'
import sys
text = open(sys.argv[1][:-len(".csv")] + "-roofline.txt").read()
rows = [l.split() for l in text.splitlines() if l.split() and l.split()[0] in ("attention", "train")]
assert {(r[0], r[1], r[3]) for r in rows} >= {("attention", "fma", "bf16"), ("attention", "fma", "fp32"),
                                              ("attention", "full", "bf16"), ("train", "fma", "bf16")}, rows
assert all(float(r[8]) > 0 and float(r[10]) > 0 for r in rows), rows
PY
check "the pool's requests replayed, each run under both policies (<device>-pool.txt)" py - "$csv" <<'PY'
import re, sys
text = open(sys.argv[1][:-len(".csv")] + "-pool.txt").read()
runs = re.findall(r"^\S+/(\w+)\.pool, policy (\w+): (\d+) counted sections", text, re.M)
assert [(r, p) for r, p, _ in runs] == [(r, p) for r in ("attention", "attention_fp32", "step", "long")
                                        for p in ("oldest", "best")], runs
assert all(int(n) > 0 for _, _, n in runs), runs
PY
cat > sdpa.json <<'EOF2'
[{"device": "X", "variant": "sdpa", "n": 256, "precision": "bf16", "fwd_ms": 1.5, "bwd_ms": 3.0, "torch": "2.5"}]
EOF2
check "gpu_csv.py adds one row per SDPA run" sh -c "'$PYTHON3' '$SRCDIR/scripts/gpu_csv.py' s.csv $WORK/gc/runs/attention/bench.h5 --sdpa sdpa.json > /dev/null && grep -q '^X,sdpa,256,bf16' s.csv"
# sdpa_bench.py on the CPU; a PyTorch older than 2.0 (Debian's 1.13) is given the causal
# softmax attention SDPA computes, so the script's timing and its rows are exercised either way
if "$PYTHON3" -c 'import torch' 2>/dev/null; then
  cat > sdpa_run.py <<'EOF2'
import math, runpy, sys
import torch, torch.nn.functional as F
if not hasattr(F, "scaled_dot_product_attention"):
    def sdpa(q, k, v, is_causal=False):
        s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        if is_causal:
            n = s.shape[-1]
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        return torch.softmax(s, -1) @ v
    F.scaled_dot_product_attention = sdpa
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
EOF2
  check "sdpa_bench.py times SDPA forward and backward (here on the CPU)" sh -c "'$PYTHON3' sdpa_run.py '$SRCDIR/scripts/sdpa_bench.py' --n 32,64 --device cpu --dtype fp32 --repeats 2 --out sd.json > /dev/null && '$PYTHON3' -c 'import json; r = json.load(open(\"sd.json\")); assert [x[\"n\"] for x in r] == [32, 64] and all(x[\"fwd_ms\"] > 0 and x[\"bwd_ms\"] > 0 for x in r), r'"
  # a pinned backend: a row each, named; timed where this PyTorch can pin it, else a note
  check "sdpa_bench.py pins a backend per row and records the software" sh -c "'$PYTHON3' sdpa_run.py '$SRCDIR/scripts/sdpa_bench.py' --n 32 --device cpu --dtype fp32 --repeats 1 --backends default,math --out sm.json > /dev/null && '$PYTHON3' -c 'import json; r = json.load(open(\"sm.json\")); assert [x[\"variant\"] for x in r] == [\"sdpa\", \"sdpa:math\"] and all(x[\"software\"].startswith(\"torch \") for x in r) and all(\"fwd_ms\" in x or \"note\" in x for x in r), r'"
  check "sdpa_bench.py refuses a backend it does not know" sh -c "! '$PYTHON3' '$SRCDIR/scripts/sdpa_bench.py' --n 32 --device cpu --backends fastest --out x.json 2> bad.err && grep -q 'is not one of' bad.err"
else
  ok "sdpa_bench.py times SDPA # SKIP no PyTorch here"
fi
check "sdpa_bench.py --help works without a GPU" "$PYTHON3" "$SRCDIR/scripts/sdpa_bench.py" --help
tap_done
