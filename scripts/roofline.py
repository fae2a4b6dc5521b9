#!/usr/bin/python3
"""A lower bound on the GPU time of every bench case, from the counts fmattn's CUDA back end keeps.

  roofline.py BENCH_H5 [--device h100-sxm|h200|a100] [--launch-us 2.5] [--plot roofline.png]
              [--json bounds.json]

bench.h5's /gpu table (run.mode = bench on the CUDA back end, or on its emulation) holds, per case
and repetition, the cuBLAS products' FLOPs and the bytes their operands read, the elements copied
into bf16, the kernel launches and the products' calls. On a device with peak rate F (dense, of
the run's precision: bf16 tensor cores, or fp32 CUDA cores for fp32), bandwidth W and a launch
costing at least L:

  bound = max(gemm_flops / F, (gemm_operand_bytes + 6 · (elements_converted − in_pass)
                               + 2 · in_pass) / W,
              (kernel_launches + gemm_calls) · L)

(an operand element is 2 bytes in bf16, 4 in fp32; a conversion in a pass of its own reads 4 bytes
and writes 2, one that a kernel makes beside its own output from an array it reads anyway,
elements_converted_in_pass, writes 2; a file from before gemm_operand_bytes counts 4 bytes per
operand element, one from before elements_converted_in_pass none in passes). It is a lower bound, not
an estimate: the element-wise kernels' traffic, the products' outputs and any imperfect overlap
only add to it. Each case's bound is printed beside the time bench measured
for it where there is one (the /attention row's forward + backward, the /train row's step), with
the measured time over the bound; --plot draws both against n, --json writes them. The device figures and their
sources are in docs/gpu.md.
"""
import argparse
import sys

from fmattn_h5 import h5py  # noqa: E402
from fmattn_deck import deck_values

# Published peaks, dense (no sparsity): bf16 tensor-core and fp32 CUDA-core FLOP/s, HBM bytes/s.
DEVICES = {
    "h100-sxm": {"name": "NVIDIA H100 SXM5 80 GB", "bf16": 989.4e12, "fp32": 66.9e12, "bw": 3.35e12},
    "h200": {"name": "NVIDIA H200 SXM 141 GB", "bf16": 989.4e12, "fp32": 66.9e12, "bw": 4.8e12},
    "a100": {"name": "NVIDIA A100 SXM4 80 GB", "bf16": 312e12, "fp32": 19.5e12, "bw": 2.039e12},
}


def die(msg):
    print(f"roofline.py: error: {msg}", file=sys.stderr)
    sys.exit(1)


def text(col):
    return [x.decode() if isinstance(x, bytes) else str(x) for x in col]


def measured_ms(f):
    """(kind, variant, n) -> milliseconds bench measured for the case (None where it did not)."""
    out = {}
    if "attention" in f:
        a = f["attention"]
        for v, n, fw, bw in zip(text(a["variant"][()]), a["n"][()], a["fwd_ms"][()], a["bwd_ms"][()]):
            out[("attention", v, int(n))] = float(fw + bw)
    if "train" in f:
        t = f["train"]
        deck = f.attrs.get("deck", b"")
        name = deck_values(deck.decode() if isinstance(deck, bytes) else str(deck)).get(
            "attention.variant", "")
        for n, ms in zip(t["n"][()], t["step_ms"][()]):
            out[("train", name, int(n))] = float(ms)
    return out


def bounds(f, dev, launch_s):
    g = f["gpu"]
    rows = []
    for i, (kind, variant, prec) in enumerate(zip(text(g["kind"][()]), text(g["variant"][()]),
                                                  text(g["precision"][()]))):
        flops = float(g["gemm_flops"][i])
        if "gemm_operand_bytes" in g:
            nbytes = float(g["gemm_operand_bytes"][i])
        else:  # written before the bytes were counted: every operand fp32
            nbytes = 4.0 * float(g["gemm_operand_elements"][i])
        in_pass = 0.0  # a file from before the column: none
        if "elements_converted_in_pass" in g:
            in_pass = float(g["elements_converted_in_pass"][i])
        nbytes += 6.0 * (float(g["elements_converted"][i]) - in_pass) + 2.0 * in_pass
        calls = float(g["gemm_calls"][i]) + float(g["kernel_launches"][i])
        parts = {"flops": flops / dev[prec], "bytes": nbytes / dev["bw"],
                 "launches": calls * launch_s}
        limit = max(parts, key=parts.get)
        rows.append({"kind": kind, "variant": variant, "n": int(g["n"][i]), "precision": prec,
                     "seq_ranks": int(g["seq_ranks"][i]), "bound_ms": 1e3 * parts[limit],
                     "limit": limit, **{f"{k}_ms": 1e3 * v for k, v in parts.items()}})
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bench_h5")
    ap.add_argument("--device", choices=sorted(DEVICES), default="h100-sxm")
    ap.add_argument("--launch-us", type=float, default=2.5,
                    help="the least time one launch or cuBLAS call takes, microseconds")
    ap.add_argument("--plot", help="draw bound and measured time against n into this PNG")
    ap.add_argument("--json", help="write every case's bound, its parts and the measured time")
    a = ap.parse_args()
    try:
        f = h5py.File(a.bench_h5, "r")
    except OSError as e:
        die(f"{a.bench_h5}: {e}")
    if "gpu" not in f:
        die(f"{a.bench_h5} has no /gpu table: run bench on the CUDA back end (or its emulation)")
    dev = DEVICES[a.device]
    rows = bounds(f, dev, a.launch_us * 1e-6)
    meas = measured_ms(f)
    print(f"# lower bounds on {dev['name']}: {dev['bf16'] / 1e12:.1f} TFLOP/s bf16, "
          f"{dev['fp32'] / 1e12:.1f} fp32, {dev['bw'] / 1e12:.2f} TB/s, {a.launch_us} us per launch")
    where = f.attrs.get("device", "?")
    print(f"# measured on: {where.decode() if isinstance(where, bytes) else where}")
    print(f"{'case':10} {'variant':10} {'n':>8} {'prec':5} {'S':>2} {'flops ms':>10} {'bytes ms':>10} "
          f"{'launch ms':>10} {'bound ms':>10} {'limit':8} {'measured':>10} {'meas/bound':>10}")
    for r in rows:
        m = meas.get((r["kind"], r["variant"], r["n"]))
        r["measured_ms"] = m
        ratio = f"{m / r['bound_ms']:10.2f}" if m and r["bound_ms"] > 0 else f"{'-':>10}"
        print(f"{r['kind']:10} {r['variant']:10} {r['n']:8d} {r['precision']:5} {r['seq_ranks']:2d} "
              f"{r['flops_ms']:10.4f} {r['bytes_ms']:10.4f} {r['launches_ms']:10.4f} "
              f"{r['bound_ms']:10.4f} {r['limit']:8} "
              f"{(f'{m:10.3f}' if m else f'{chr(45):>10}')} {ratio}")
    if a.json:
        import json
        with open(a.json, "w") as out:
            json.dump({"device": a.device, "launch_us": a.launch_us, "cases": rows}, out, indent=1)
    if a.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for key in sorted({(r["kind"], r["variant"], r["precision"]) for r in rows}):
            sel = sorted((r for r in rows if (r["kind"], r["variant"], r["precision"]) == key),
                         key=lambda r: r["n"])
            label = "/".join(key)
            line, = ax.plot([r["n"] for r in sel], [r["bound_ms"] for r in sel], "--", marker="o",
                            label=f"{label}: bound ({a.device})")
            pts = [(r["n"], r["measured_ms"]) for r in sel if r["measured_ms"]]
            if pts:
                ax.plot(*zip(*pts), "-", marker="s", color=line.get_color(),
                        label=f"{label}: measured")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens n")
        ax.set_ylabel("milliseconds per repetition")
        ax.set_title("fmattn on the GPU: lower bound from its own counts")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(a.plot, dpi=120)
        print(f"roofline.py: wrote {a.plot}")


if __name__ == "__main__":
    main()
