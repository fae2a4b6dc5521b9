#!/usr/bin/python3
"""PyTorch's scaled_dot_product_attention, timed as fmattn's bench times attention (gpu_check.sh).

  sdpa_bench.py --n 4096,8192 [--heads 12] [--dim 64] [--dtype bf16] [--repeats 5]
                [--device cuda] --out sdpa.json

Forward and backward of causal SDPA on (1, heads, n, dim) tensors, medians of `repeats` runs
after a warm-up, each timed to the end of the device's work; one JSON object per n (variant
"sdpa", its backend's name, the torch version). A length that does not fit in memory is
reported as such, not as a time.
"""
import argparse
import json
import statistics
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", required=True, help="comma list of sequence lengths")
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import torch  # imported here: --help works without it
    import torch.nn.functional as F

    dev = torch.device(a.device)
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    rows = []
    for n in (int(x) for x in a.n.split(",")):
        row = {"device": name, "variant": "sdpa", "n": n, "precision": a.dtype,
               "heads": a.heads, "head_dim": a.dim, "torch": torch.__version__}
        try:
            q, k, v = (torch.randn(1, a.heads, n, a.dim, device=dev, dtype=dtype,
                                   requires_grad=True) for _ in range(3))
            g = torch.randn(1, a.heads, n, a.dim, device=dev, dtype=dtype)
            fwd, bwd = [], []
            for r in range(a.repeats + 1):  # r = 0: warm-up
                sync()
                t0 = time.perf_counter()
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                sync()
                t1 = time.perf_counter()
                out.backward(g)
                sync()
                t2 = time.perf_counter()
                q.grad = k.grad = v.grad = None
                if r:
                    fwd.append(1e3 * (t1 - t0))
                    bwd.append(1e3 * (t2 - t1))
            row.update(fwd_ms=statistics.median(fwd), bwd_ms=statistics.median(bwd))
            if dev.type == "cuda":
                row["peak_bytes"] = torch.cuda.max_memory_allocated(dev)
                torch.cuda.reset_peak_memory_stats(dev)
        except RuntimeError as e:  # out of memory, most likely: say so in the row
            row["note"] = str(e).splitlines()[0][:200]
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        rows.append(row)
        print(json.dumps(row), flush=True)
    with open(a.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
