#!/usr/bin/python3
"""Collect gpu_check.sh's figures into one CSV (docs/gpu/<device>.csv).

  gpu_csv.py OUT.csv BENCH.h5 [BENCH.h5 ...] [--sdpa sdpa.json]

One row per measurement: fmattn's attention rows (variant, n, precision, fwd_ms, bwd_ms,
tflops, workspace), its training-step rows (variant "train:<attention variant>", step_ms,
tokens_per_s, mfu, peak_bytes), the device's GEMM rates (variant "gemm", tflops), and one row
per SDPA run of sdpa_bench.py. Every column is named in the header; a cell that does not apply
is empty.
"""
import argparse
import csv
import json
import re

from fmattn_h5 import h5py  # noqa: E402
import numpy as np
from fmattn_deck import deck_values

COLUMNS = ["device", "variant", "n", "precision", "heads", "head_dim", "fwd_ms", "bwd_ms",
           "step_ms", "tokens_per_s", "tflops", "mfu", "workspace_bytes", "peak_bytes", "software",
           "note"]


def text(x):
    return x.decode() if isinstance(x, bytes) else str(x)


def device_name(described):
    """The GPU's name from the run header's description ("device 0: NAME, 80.0 GiB, ...")."""
    return re.sub(r"^device \d+: ", "", described).split(",")[0]


def bench_rows(path, gemm):
    rows = []
    with h5py.File(path, "r") as f:
        device, deck = device_name(text(f.attrs["device"])), text(f.attrs["deck"])
        precision = text(f.attrs.get("precision", "fp32"))
        variant = deck_values(deck).get("attention.variant", "")
        for p, name in (("fp32_gemm_gflops", "fp32"), ("bf16_gemm_gflops", "bf16")):
            if gemm and p in f.attrs:
                rows.append({"device": device, "variant": "gemm", "precision": name,
                             "tflops": f.attrs[p] / 1e3 / f.attrs["ranks"],
                             "note": "cuBLAS, square products, per rank"})
        if "attention" in f:
            a = f["attention"]
            for i in range(len(a["n"])):
                rows.append({"device": device, "variant": text(a["variant"][i]),
                             "n": int(a["n"][i]), "precision": precision,
                             "heads": int(a["heads"][i]), "head_dim": int(a["head_dim"][i]),
                             "fwd_ms": a["fwd_ms"][i], "bwd_ms": a["bwd_ms"][i],
                             "tflops": a["gflops"][i] / 1e3,
                             "workspace_bytes": int(a["workspace_bytes"][i])})
        if "train" in f:
            t = f["train"]
            for i in range(len(t["n"])):
                row = {"device": device, "variant": "train:" + variant, "n": int(t["n"][i]),
                       "precision": precision, "step_ms": t["step_ms"][i],
                       "tokens_per_s": t["tokens_per_s"][i], "mfu": t["mfu"][i],
                       "tflops": t["tokens_per_s"][i] * t["flops_per_token"][i] / 1e12}
                if "peak_bytes" in t:
                    row["peak_bytes"] = int(t["peak_bytes"][i])
                rows.append(row)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("bench", nargs="+")
    ap.add_argument("--sdpa")
    a = ap.parse_args()
    # the GEMM rates of the first file (every bench run measures them again)
    rows = [r for i, p in enumerate(a.bench) for r in bench_rows(p, i == 0)]
    if a.sdpa:
        with open(a.sdpa) as f:
            rows += [{k: v for k, v in r.items() if k in COLUMNS} for r in json.load(f)]
    with open(a.out, "w", newline="") as f:
        w = csv.DictWriter(f, COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, (float, np.floating)) else v)
                        for k, v in r.items()})
    print(f"wrote {a.out}: {len(rows)} rows")


if __name__ == "__main__":
    main()
