#!/usr/bin/python3
"""Kernel-file helpers for test_kernel.sh (SPEC §8.3).

  kernel_files.py make IN.h5 VARIANT CAUSAL H N D [key=value ...] [param=NAME:SHAPE:VALUE ...]
                                               [--ones-v] [--bad-attr] [--qk-heads=G]
                                               (param=gamma:2,8:2.0 stores params/gamma, 2x8, all 2.0)
  kernel_files.py close A.h5 B.h5 TOL          out, dq, dk, dv of two OUT files agree
  kernel_files.py ones OUT.h5 TOL              every output equals 1
  kernel_files.py dparams OUT.h5 NAME SHAPE    dparams/NAME exists with SHAPE (e.g. 8,2,16)
  kernel_files.py nodparams OUT.h5 NAME        dparams/NAME is absent (a frozen tensor)
  kernel_files.py scaled A.h5 B.h5 FACTOR TOL  out of A equals FACTOR times out of B
  kernel_files.py draw IN.h5 SEED               give IN its own rmfa draw: params/degree, omega
  kernel_files.py rmfa OUT.h5 IN.h5 TOL         out of OUT equals rmfa (exp kernel) on IN's draw
"""
import math
import sys

import h5py
import numpy as np


def make(path, variant, causal, H, n, d, extra):
    rng = np.random.default_rng(7)
    hq = H  # FiSH: --qk-heads=G gives q and k G heads
    for kv in extra:
        if kv.startswith("--qk-heads="):
            hq = int(kv.split("=", 1)[1])
    with h5py.File(path, "w") as f:
        for name in ("q", "k", "v", "dout"):
            f[name] = rng.standard_normal((hq if name in "qk" else H, n, d)).astype(np.float32)
        if "--ones-v" in extra:
            f["v"][...] = 1.0
        f.attrs["variant"] = variant
        f.attrs["causal"] = np.bool_(causal == "1")
        for kv in extra:
            if kv.startswith("param="):
                name, shape, value = kv[len("param="):].split(":")
                shape = tuple(int(x) for x in shape.split(","))
                f["params/" + name] = np.full(shape, float(value), dtype=np.float32)
            elif "=" in kv and not kv.startswith("--"):
                key, value = kv.split("=", 1)
                f.attrs[key] = int(value) if value.isdigit() else value
        if "--bad-attr" in extra:
            f.attrs["m"] = np.arange(4)


def draw(path, seed):
    """An rmfa feature draw of the file's own: degrees 1..4 and Rademacher rows, not fmattn's."""
    rng = np.random.default_rng(int(seed))
    with h5py.File(path, "a") as f:
        D, d = int(f.attrs["features"]), f["q"].shape[2]
        degree = np.concatenate([[0], rng.integers(1, 5, D - 1)]).astype(np.float32)
        f["params/degree"] = degree
        f["params/omega"] = rng.choice([-1.0, 1.0], (int(degree.sum()), d)).astype(np.float32)


def rmfa_reference(f):
    """SPEC 6.8 in float64 with the exp kernel (a_N = 1/N!) and ppSBN, on the file's draw."""
    q, k, v = (f[x][...].astype(np.float64) for x in ("q", "k", "v"))
    degree = f["params/degree"][...].astype(int)
    omega = f["params/omega"][...].astype(np.float64)
    D, d, causal = len(degree), q.shape[2], bool(f.attrs["causal"])
    z = sum(2.0 ** -(i + 1) for i in range(1, 21))
    coef = [1.0] + [np.sqrt((1.0 / math.factorial(N)) / (2.0 ** -(N + 1) / z)) / np.sqrt(D - 1)
                    for N in degree[1:]]
    offset = np.concatenate([[0], np.cumsum(degree)])

    def features(x):  # (n, d) -> (n, D)
        u = x - x.mean(axis=1, keepdims=True)
        u = u / np.sqrt((u * u).mean(axis=1, keepdims=True) + 1e-12)
        u = u / np.linalg.norm(u, axis=1, keepdims=True) * d ** -0.25
        proj = u @ omega.T
        phi = np.empty((x.shape[0], D))
        phi[:, 0] = coef[0]
        for j in range(1, D):
            phi[:, j] = coef[j] * np.prod(proj[:, offset[j]:offset[j] + degree[j]], axis=1)
        return phi

    out = np.empty_like(v)
    for h in range(v.shape[0]):
        pq, pk = features(q[h]), features(k[h])
        w = pq @ pk.T
        if causal:
            w = np.tril(w)
        out[h] = (w @ v[h]) / np.maximum(1.0, w.sum(axis=1))[:, None]
    return out


def main(argv):
    cmd = argv[1]
    if cmd == "make":
        make(argv[2], argv[3], argv[4], int(argv[5]), int(argv[6]), int(argv[7]), argv[8:])
    elif cmd == "close":
        with h5py.File(argv[2], "r") as a, h5py.File(argv[3], "r") as b:
            for name in ("out", "dq", "dk", "dv"):
                x, y = a[name][...], b[name][...]
                err = np.max(np.abs(x - y)) / max(np.max(np.abs(y)), 1e-30)
                if err > float(argv[4]):
                    sys.exit(f"{name}: relative difference {err:.3e}")
    elif cmd == "ones":
        with h5py.File(argv[2], "r") as f:
            err = np.max(np.abs(f["out"][...] - 1.0))
            if err > float(argv[3]):
                sys.exit(f"out differs from 1 by {err:.3e}")
    elif cmd == "nodparams":
        with h5py.File(argv[2], "r") as f:
            if "dparams/" + argv[3] in f:
                sys.exit(f"dparams/{argv[3]} is present")
    elif cmd == "scaled":
        with h5py.File(argv[2], "r") as a, h5py.File(argv[3], "r") as b:
            x, y = a["out"][...], float(argv[4]) * b["out"][...]
            err = np.max(np.abs(x - y)) / max(np.max(np.abs(y)), 1e-30)
            if err > float(argv[5]):
                sys.exit(f"out differs from {argv[4]} x the other by {err:.3e}")
    elif cmd == "draw":
        draw(argv[2], argv[3])
    elif cmd == "rmfa":
        with h5py.File(argv[2], "r") as a, h5py.File(argv[3], "r") as b:
            ref = rmfa_reference(b)
            err = np.max(np.abs(a["out"][...] - ref)) / max(np.max(np.abs(ref)), 1e-30)
            if err > float(argv[4]):
                sys.exit(f"out differs from rmfa on the file's draw by {err:.3e}")
    elif cmd == "diagnostics":  # the op's attention diagnostics: shares that add up to 1
        with h5py.File(argv[2], "r") as f:
            g = f["diagnostics"]
            mass = g["level_mass"][...]
            total = mass.sum(-1) + (g["open_mass"][...] if "open_mass" in g else 0.0)
            if not np.allclose(total, 1.0, atol=1e-5):
                sys.exit(f"level_mass + open_mass add up to {total}, not 1")
            if (g["entropy"][...] <= 0).any():
                sys.exit("an entropy is not positive")
            if len(argv) > 3:  # fma.open: the expected opened-mass side and the windows opened
                want = argv[3]
                opened, om = g["opened"][...], g["open_mass"][...]
                if want == "all" and not (np.allclose(mass[:, 1:], 0) and (opened > 0).all()):
                    sys.exit(f"fma.open = all left summaries: level_mass {mass}, opened {opened}")
                if want != "all" and not ((om > 0).all() and (opened <= int(want) + 1e-9).all()):
                    sys.exit(f"fma.open = {want}: open_mass {om}, opened {opened}")
    elif cmd == "dparams":
        with h5py.File(argv[2], "r") as f:
            name, shape = "dparams/" + argv[3], tuple(int(x) for x in argv[4].split(","))
            if name not in f or f[name].shape != shape:
                sys.exit(f"{name}: {f[name].shape if name in f else 'missing'}, expected {shape}")
            if not np.all(np.isfinite(f[name][...])) or not np.any(f[name][...] != 0):
                sys.exit(f"{name} is not a finite, non-zero gradient")


if __name__ == "__main__":
    main(sys.argv)
