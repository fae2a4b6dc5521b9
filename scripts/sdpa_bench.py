#!/usr/bin/python3
"""PyTorch's scaled_dot_product_attention, timed as fmattn's bench times attention (gpu_check.sh).

  sdpa_bench.py --n 4096,8192 [--heads 12] [--dim 64] [--dtype bf16] [--repeats 5]
                [--device cuda] [--backends flash,cudnn,efficient] --out sdpa.json

Forward and backward of causal SDPA on (1, heads, n, dim) tensors, medians of `repeats` runs
after a warm-up, each timed to the end of the device's work; one JSON object per backend and n
(variant "sdpa:<backend>", or "sdpa" for PyTorch's own choice; the software's versions). Each
backend is pinned (torch.nn.attention.sdpa_kernel, PyTorch >= 2.3; torch.backends.cuda.sdp_kernel
before, which has no cuDNN): Flash and cuDNN differ about 2x on Hopper, so a row must say which
ran. A backend that cannot run a shape, or a length that does not fit in memory, is reported as
such in the row's note, not as a time.
"""
import argparse
import contextlib
import json
import statistics
import time

BACKENDS = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION",
            "efficient": "EFFICIENT_ATTENTION", "math": "MATH"}


def pinned(torch, backend):
    """A context in which SDPA may use only `backend` ("default": PyTorch's own choice)."""
    if backend == "default":
        return contextlib.nullcontext()
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel  # PyTorch >= 2.3
    except ImportError:
        sdp_kernel = getattr(getattr(torch.backends, "cuda", None), "sdp_kernel", None)
        if sdp_kernel is None or backend == "cudnn":
            raise RuntimeError(f"PyTorch {torch.__version__} cannot pin the {backend} backend")
        try:  # PyTorch 2.0 - 2.2 (1.13's prototype takes other arguments)
            return sdp_kernel(enable_flash=backend == "flash", enable_math=backend == "math",
                              enable_mem_efficient=backend == "efficient")
        except TypeError as e:
            raise RuntimeError(f"PyTorch {torch.__version__} cannot pin the {backend} backend: {e}")
    if not hasattr(SDPBackend, BACKENDS[backend]):
        raise RuntimeError(f"PyTorch {torch.__version__} has no {backend} backend")
    return sdpa_kernel(getattr(SDPBackend, BACKENDS[backend]))


def software(torch):
    """The versions a row's time depends on."""
    parts = [f"torch {torch.__version__}"]
    if getattr(torch.version, "cuda", None):
        parts.append(f"CUDA {torch.version.cuda}")
    cudnn = getattr(torch.backends, "cudnn", None)
    if cudnn is not None and cudnn.is_available():
        parts.append(f"cuDNN {cudnn.version()}")
    return ", ".join(parts)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", required=True, help="comma list of sequence lengths")
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--backends", help="comma list of " + ", ".join(BACKENDS) + ", default "
                    "(PyTorch's choice); default: flash,cudnn,efficient on cuda, default elsewhere")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import torch  # imported here: --help works without it
    import torch.nn.functional as F

    dev = torch.device(a.device)
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    backends = (a.backends or ("flash,cudnn,efficient" if dev.type == "cuda" else "default"))
    backends = backends.split(",")
    for b in backends:
        if b != "default" and b not in BACKENDS:
            ap.error(f"--backends: {b} is not one of {', '.join(BACKENDS)}, default")
    rows = []
    for b in backends:
        for n in (int(x) for x in a.n.split(",")):
            rows.append(run(torch, F, a, dev, dtype, sync, name, b, n))
    with open(a.out, "w") as f:
        json.dump(rows, f, indent=1)


def run(torch, F, a, dev, dtype, sync, name, backend, n):
    """One row: SDPA forward and backward at n with `backend` pinned."""
    row = {"device": name, "variant": "sdpa" if backend == "default" else "sdpa:" + backend,
           "backend": backend, "n": n, "precision": a.dtype, "heads": a.heads,
           "head_dim": a.dim, "torch": torch.__version__, "software": software(torch)}
    try:
        q, k, v = (torch.randn(1, a.heads, n, a.dim, device=dev, dtype=dtype,
                               requires_grad=True) for _ in range(3))
        g = torch.randn(1, a.heads, n, a.dim, device=dev, dtype=dtype)
        fwd, bwd = [], []
        for r in range(a.repeats + 1):  # r = 0: warm-up
            sync()
            t0 = time.perf_counter()
            with pinned(torch, backend):
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
    except RuntimeError as e:  # out of memory, or no kernel of the pinned backend
        row["note"] = str(e).splitlines()[0][:200]
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    print(json.dumps(row), flush=True)
    return row


if __name__ == "__main__":
    main()
