#!/bin/sh
# The scripts run end to end on tiny cases: scripts/scaling.py launches fmattn in bench mode for
# S = 1, 2 (strong and weak) and collects one HDF5 row per run with the traffic fmattn counted;
# scripts/plot_scaling.py, plot_bench.py and plot_run.py draw their PNGs from the sweep and from a
# short training run; bad arguments get one message; the SLURM scripts parse.
. "$TESTDIR/tap.sh"
need_h5py
cd "$SRCDIR" || exit 1
P="${PYTHON3:-/usr/bin/python3}"
R="$WORK/sweep/scaling.h5"
check "scaling.py runs a strong and weak sweep over S = 1, 2" \
  "$P" scripts/scaling.py --fmattn "$FMATTN" --ranks 1,2 --n 1024 --per-rank 512 --out "$R" \
  --extra "--set bench.repeats=1"
check "scaling.h5: 4 rows; S = 1 sends nothing, S = 2 sends; times and efficiencies are set" \
  "$P" - "$R" <<'PY'
import sys, h5py, numpy as np
with h5py.File(sys.argv[1], "r") as f:
    kind = [k.decode() if isinstance(k, bytes) else k for k in f["kind"][()]]
    S, n, b = f["seq_ranks"][()], f["n"][()], f["bytes_per_rank_per_layer"][()]
    t, e = f["step_ms"][()], f["efficiency"][()]
    assert kind == ["strong", "strong", "weak", "weak"], kind
    assert list(S) == [1, 2, 1, 2] and list(n) == [1024, 1024, 512, 1024], (S, n)
    assert b[0] == 0 and b[2] == 0 and b[1] > 0 and b[3] > 0, b
    assert np.all(t > 0) and e[0] == 1 and e[2] == 1 and np.all(e > 0), (t, e)
    assert f.attrs["variant"] == "fma", f.attrs["variant"]
    # the step by phase: S = 1 exchanges nothing, S = 2 does; the phases fit in the step
    x, busy = f["exchange_ms"][()], f["busy_mean_ms"][()]
    assert x[0] == 0 and x[2] == 0 and x[1] > 0 and x[3] > 0, x
    assert np.all(f["near_ms"][()] > 0) and np.all(f["far_ms"][()] > 0), "near/far"
    assert np.all(busy > 0) and np.all(f["busy_max_ms"][()] >= busy - 1e-9), busy
    assert f.attrs["simulated"] == 0 and f.attrs["incomplete"] == "", "simulated/incomplete"
PY
check "plot_scaling.py draws time, efficiency, bytes and phases" \
  "$P" scripts/plot_scaling.py "$R" -o "$WORK/plots"
for png in scaling_time scaling_efficiency scaling_bytes scaling_phases; do
  check "$png.png is a PNG" sh -c "head -c 8 '$WORK/plots/$png.png' | grep -q PNG"
done
check "plot_bench.py draws a run's bench.h5" \
  "$P" scripts/plot_bench.py "$WORK/sweep/scaling_strong_S2_n1024" -o "$WORK/bplots"
check "plot_bench.py: train_mfu.png" test -s "$WORK/bplots/train_mfu.png"
check "bench.h5 /train: the step by kind of pass within the step; SGEMM and the peak beside each step" \
  "$P" - "$WORK/sweep/scaling_strong_S2_n1024/bench.h5" <<'PY'
import sys, h5py
with h5py.File(sys.argv[1], "r") as f:
    t = f["train"]
    kinds = ["gemm_ms", "attention_ms", "norm_ms", "activation_ms", "dropout_ms", "copy_ms", "loss_ms"]
    for k in kinds + ["optimizer_ms", "allreduce_ms"]:
        assert t[k][0] > 0, (k, t[k][0])
    timed = sum(t[k][0] for k in kinds) + t["optimizer_ms"][0] + t["allreduce_ms"][0]
    step = t["step_ms"][0]
    assert timed < 1.05 * step and timed + t["other_ms"][0] > 0.9 * step, (timed, step)
    # the references measured beside the steps (2 ranks at once): rates of this machine, and the
    # step's ratio to them in the range the run-start reference gives (the same model, one run)
    sg, pk = t["sgemm_adjacent_gflops"][0], t["peak_adjacent_gflops"][0]
    assert 0 < sg < pk, (sg, pk)
    m, ma, mpa = t["mfu"][0], t["mfu_adjacent"][0], t["mfu_peak_adjacent"][0]
    assert 0 < mpa < ma and 0.2 * m < ma < 5 * m, (m, ma, mpa)
PY
# fmattn against PyTorch eager on a tiny model: both run, alternately, on OpenBLAS's same core
TINY="$TESTDIR/decks/scripts_train.in"
check "torch_bench.py times fmattn and PyTorch eager alternately" \
  "$P" scripts/torch_bench.py --fmattn "$FMATTN" --deck "$TINY" --n 64 \
  --rounds 2 --steps 1 --threads 1 --out "$WORK/torch_bench.json"
check "torch_bench.json: both timed, on the same BLAS core" "$P" - "$WORK/torch_bench.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
assert r["fmattn_tokens_per_s"] > 0 and r["torch_tokens_per_s"] > 0 and r["rounds"] == 2, r
assert r["fmattn_blas_core"] and set(r["torch_blas_cores"].values()) == {r["fmattn_blas_core"]}, r
rs = r["round_speedups"]
assert len(rs) == len(r["fmattn_round_ms"]) == len(r["torch_round_ms"]) == 2, r
assert all(abs(x - t / f) < 1e-9 for x, f, t in zip(rs, r["fmattn_round_ms"], r["torch_round_ms"])), r
assert min(rs) <= r["round_speedup_median"] <= max(rs), r
assert r["torch_blas_threads"] == 1 and r["torch_blas_probe_ms"] == {}, r  # --threads 1: no choice
assert r["torch_blas_threads_after"] == 1, r
PY
# on 2 threads PyTorch's OpenBLAS gets the faster of 1 and 2 threads, whatever the caller's
# OPENBLAS_NUM_THREADS said when numpy loaded it
check "torch_bench.py times PyTorch with its OpenBLAS on 1 and 2 threads, keeps the faster" \
  env OPENBLAS_NUM_THREADS=3 "$P" scripts/torch_bench.py --fmattn "$FMATTN" --deck "$TINY" \
  --n 64 --rounds 1 --steps 2 --threads 2 --out "$WORK/torch_bench2.json"
check "torch_bench2.json: the faster of the two probed" "$P" - "$WORK/torch_bench2.json" <<'PY'
import json, statistics, sys
r = json.load(open(sys.argv[1]))
probe = r["torch_blas_probe_ms"]
assert sorted(probe) == ["1", "2"] and all(len(v) == 2 for v in probe.values()), r
med = {int(t): statistics.median(v) for t, v in probe.items()}
assert r["torch_blas_threads"] == min(med, key=med.get) == r["torch_blas_threads_after"], r
PY
expect_fail "torch_bench.py refuses --torch-blas-threads 0" "positive number or best" \
  "$P" scripts/torch_bench.py --fmattn "$FMATTN" --torch-blas-threads 0
check "a 6-step training run" "$FMATTN" "$TINY" --set output.dir="$WORK/out"
check "plot_run.py draws the run's diag.h5" "$P" scripts/plot_run.py "$WORK/out/tiny" -o "$WORK/rplots"
for png in loss attention_mass entropy; do
  check "plot_run.py: $png.png" test -s "$WORK/rplots/$png.png"
done
expect_fail "scaling.py refuses --extra that sets a key the sweep owns" "parallel.seq_ranks" \
  "$P" scripts/scaling.py --fmattn "$FMATTN" --dry-run --extra "--set parallel.seq_ranks=4"
expect_fail "scaling.py refuses a deck fmattn rejects" "rejected the deck" \
  "$P" scripts/scaling.py --fmattn "$FMATTN" --dry-run --extra "--set attention.fma.m=3"
expect_fail "scaling.py refuses --sample without --simulate" "give --simulate PLATFORM too" \
  "$P" scripts/scaling.py --fmattn "$FMATTN" --dry-run --sample 3
expect_fail "scaling.py refuses --sample-rates without --sample" "--sample-rates needs --sample K" \
  "$P" scripts/scaling.py --fmattn "$FMATTN" --dry-run --simulate ndr --sample-rates /dev/null
expect_fail "plot_scaling.py names a missing file" "absent.h5 not found" \
  "$P" scripts/plot_scaling.py "$WORK/absent.h5" -o "$WORK/plots"
# the variant comparison, --quick: two variants, a few steps, on a text Debian always ships
check "compare.py --quick trains two variants and collects them" "$P" scripts/compare.py --quick \
  --fmattn "$FMATTN" --out "$WORK/cmp" --corpus /usr/share/common-licenses/GPL-3
check "compare.h5 has a row per run and each run's validation curve" "$P" -c "
import h5py, numpy as np, sys
f = h5py.File('$WORK/cmp/compare.h5')
r = f['runs']
names = [x.decode() if isinstance(x, bytes) else x for x in r['name'][...]]
ok = sorted(names) == ['full-256', 'linear-256'] and len(r['final_valid_bpc']) == 2
ok = ok and all(np.isfinite(r[c][...]).all() for c in ('final_valid_bpc', 'test_bpc', 'peak_bytes', 'train_s'))
ok = ok and all(len(f['curves/%s/valid_bpc' % n]) == len(f['curves/%s/step' % n]) >= 2 for n in names)
ok = ok and 'corpus' in f.attrs and 'base_deck' in f.attrs
sys.exit(0 if ok else 1)"
for png in valid_bpc_vs_step valid_bpc_vs_time bpc_vs_context memory_vs_context; do
  check "compare.py: $png.png is a PNG" sh -c "head -c 8 '$WORK/cmp/$png.png' | grep -q PNG"
done
check "compare.py reuses complete runs" sh -c "'$P' scripts/compare.py --quick --fmattn '$FMATTN' --out '$WORK/cmp' --corpus /usr/share/common-licenses/GPL-3 | grep -q '0 to do'"
expect_fail "compare.py names a missing corpus" "corpus $WORK/absent.txt is missing" \
  "$P" scripts/compare.py --quick --fmattn "$FMATTN" --out "$WORK/cmp2" --corpus "$WORK/absent.txt"
# every deck of the comparison and of Table 1 resolves (fmattn --check), before anyone spends an hour
for i in 1 2 3 4 5 6 7 8 9 10; do cat /usr/share/common-licenses/GPL-3; done > "$WORK/gpl10.txt"
GPL="$WORK/gpl10.txt" # 350 KB: a valid split that holds one window of 8192
check "compare.py --check: every run of the default comparison has a valid deck" sh -c \
  "'$P' scripts/compare.py --check --fmattn '$FMATTN' --out '$WORK/cmpcheck' --corpus $GPL --eval-tokens 1024 | grep -q '50 deck(s) valid'"
check "compare.py --table1 --check: every Table 1 configuration has a valid deck" sh -c \
  "'$P' scripts/compare.py --table1 --check --fmattn '$FMATTN' --out '$WORK/cmpcheck' --corpus $GPL --eval-tokens 2048 | grep -q '6 deck(s) valid'"
check "compare.py --check runs and writes nothing" test ! -e "$WORK/cmpcheck"
expect_fail "compare.py --check names a refused run and quotes fmattn" "nystrom-96: " \
  "$P" scripts/compare.py --check --fmattn "$FMATTN" --out "$WORK/cmpcheck" --corpus $GPL \
  --variants full,nystrom --contexts 96 --tokens-per-step 960 --eval-tokens 960
# ncu_kernels.py: an Nsight Compute CSV (its lines before the header, units, thousands' commas,
# templates, namespaces, a metric that is not a time) summed per kernel and per pass
N="$WORK/ncu.csv"
cat > "$N" <<'CSV'
==PROF== Connected to process 1 (fmattn)
"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"
"0","void <unnamed>::softmax_forward_held<8>(float *, float *, int, <unnamed>::gfma_mask)","gpu__time_duration.sum","ns","1,500,000"
"1","void <unnamed>::softmax_forward_held<8>(float *, float *, int, <unnamed>::gfma_mask)","gpu__time_duration.sum","us","500"
"2","<unnamed>::scatter_far(float *, const float *, gfma_refs)","gpu__time_duration.sum","ms","1.25"
"3","void <unnamed>::gather_far<__nv_bfloat16>(T1 *, const T1 *)","gpu__time_duration.sum","ns","250,000"
"4","<unnamed>::scatter_far(float *, const float *, gfma_refs)","sm__cycles_elapsed.avg","cycle","99"
CSV
check "ncu_kernels.py sums each kernel's launches per pass, slowest first" sh -c \
  "'$P' scripts/ncu_kernels.py '$N' --runs 2 --out '$WORK/ncu_table.csv' > '$WORK/ncu.txt'"
check "ncu_kernels.py: the names, launches and times" "$P" - "$WORK/ncu.txt" "$WORK/ncu_table.csv" <<'PY'
import csv, sys
text = open(sys.argv[1]).read()
assert "3 kernels, 1.750 ms per pass (2 passes)" in text, text
rows = list(csv.DictReader(open(sys.argv[2])))
got = [(r["kernel"], int(r["launches"]), round(float(r["ms_per_pass"]), 6)) for r in rows]
assert got == [("softmax_forward_held<8>", 2, 1.0), ("scatter_far", 1, 0.625),
               ("gather_far<__nv_bfloat16>", 1, 0.125)], got
PY
printf '"Kernel Name","Metric Name","Metric Unit","Metric Value"\n"k()","gpu__time_duration.sum","hour","1"\n' > "$WORK/ncu_bad.csv"
expect_fail "ncu_kernels.py names a time unit it does not know" "unknown time unit 'hour'" \
  "$P" scripts/ncu_kernels.py "$WORK/ncu_bad.csv"
echo "==PROF== nothing profiled" > "$WORK/ncu_empty.csv"
expect_fail "ncu_kernels.py says when ncu profiled no kernel" "holds no CSV rows" \
  "$P" scripts/ncu_kernels.py "$WORK/ncu_empty.csv"
# another Python than Debian's (pyenv's, a venv) has no h5py: each script that reads HDF5 says in
# one line what to do, where a bare ImportError told the user nothing
check "a Python without h5py: each HDF5 script ends with one line naming /usr/bin/python3" "$P" - <<'PY'
import os, runpy, subprocess, sys
code = ("import runpy, sys; sys.modules['h5py'] = None; sys.path.insert(0, 'scripts'); "
        "sys.argv = [sys.argv[1], '--help']; runpy.run_path(sys.argv[0], run_name='__main__')")
for name in ("compare", "gpu_csv", "plot_bench", "plot_run", "plot_scaling", "roofline", "scaling",
             "tasks", "torch_bench"):
    p = subprocess.run([sys.executable, "-c", code, f"scripts/{name}.py"], capture_output=True,
                       text=True)
    err = p.stderr.strip().splitlines()
    assert p.returncode != 0 and len(err) == 1, (name, p.returncode, p.stderr)
    assert err[0].startswith(f"{name}.py: h5py is not installed") and "/usr/bin/python3" in err[0], err
PY
for s in scripts/slurm/*.sbatch; do
  check "$(basename "$s") parses" bash -n "$s"
done
cd "$WORK" || exit 1
tap_done
