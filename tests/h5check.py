#!/usr/bin/python3
"""HDF5 checks for the shell tests: file layouts against SPEC §8, and comparisons of two runs.

  h5check.py diag FILE                    diag.h5 has every series of SPEC §8.1, with units
  h5check.py ckpt FILE                    a checkpoint has every tensor of SPEC §8.2, shaped
                                          as its own deck says, each matching its crc32
  h5check.py flip FILE DATASET            flip one bit in the middle of DATASET's stored bytes
  h5check.py value FILE DATASET [INDEX]   print one value (default: the last)
  h5check.py same-series A B GROUP FROM RTOL
                                          the series of GROUP in A and B agree for records with
                                          step > FROM (RTOL 0: bit for bit)
  h5check.py same-tensors A B RTOL        every /model and /optimizer tensor agrees
  h5check.py same-params A B RTOL         every /model tensor agrees, except the key third of
                                          attn/bqkv: its true gradient is exactly zero (softmax
                                          ignores a shift shared by all keys), so AdamW turns
                                          rounding noise into lr-sized steps that differ between
                                          rank layouts
Exit status 0 when the check holds; a message on stderr otherwise.
"""
import configparser
import sys
import zlib

import h5py
import numpy as np


def fail(msg):
    sys.stderr.write("h5check: " + msg + "\n")
    sys.exit(1)


def deck_of(f):
    text = f.attrs["deck"]
    if isinstance(text, bytes):
        text = text.decode()
    cp = configparser.ConfigParser(inline_comment_prefixes=(";", "#"))
    cp.read_string(text)
    return cp


def check_diag(path):
    with h5py.File(path, "r") as f:
        for a in ("deck", "version", "ranks", "seq_ranks", "started"):
            if a not in f.attrs:
                fail(f"{path}: root attribute {a} missing")
        deck = deck_of(f)
        L, H = deck.getint("model", "layers"), deck.getint("model", "heads")
        need = ["/train/" + s for s in ("step", "loss", "bpc", "lr", "grad_norm", "step_ms", "tokens_per_s")]
        need += ["/eval/step", "/eval/valid_loss", "/eval/valid_bpc", "/test/bpc"]
        need += ["/timing/%s_ms" % p for p in ("forward", "backward", "attention", "comm", "optimizer", "io")]
        need += ["/comm/bytes_per_step", "/comm/exchanges_per_layer", "/memory/peak_bytes"]
        need += ["/attention/step", "/attention/level_mass", "/attention/entropy"]
        for name in need:
            if name not in f:
                fail(f"{path}: {name} missing")
            d = f[name]
            if "units" not in d.attrs and "description" not in d.attrs:
                fail(f"{path}: {name} has no units or description attribute")
        n = f["/train/step"].shape[0]
        for name in need:
            if name.startswith("/train/") or name.startswith("/timing/"):
                if f[name].shape[0] != n:
                    fail(f"{name} has {f[name].shape[0]} records, /train/step has {n}")
        lm = f["/attention/level_mass"]
        if lm.ndim != 4 or lm.shape[1] != L or lm.shape[2] != H:
            fail(f"/attention/level_mass has shape {lm.shape}, expected [records, {L}, {H}, bands]")
        mass = lm[...].sum(axis=3)
        if "/attention/open_mass" in f:  # fma.open: the share on opened exact tokens is the rest
            om = f["/attention/open_mass"]
            if om.shape != lm.shape[:3]:
                fail(f"/attention/open_mass has shape {om.shape}, expected {lm.shape[:3]}")
            op = f["/attention/opened"]
            if op.shape != lm.shape[:2] + (lm.shape[3] - 1,):
                fail(f"/attention/opened has shape {op.shape}, expected {lm.shape[:2]} + (levels,)")
            mass = mass + om[...]
        if not np.allclose(mass, 1.0, atol=1e-6):
            fail(f"attention mass does not sum to 1 over bands: {mass.min()}..{mass.max()}")
        if f["/attention/entropy"].shape != lm.shape[:3]:
            fail("/attention/entropy shape differs from level_mass[..., 0]")
        steps = f["/train/step"][...]
        if np.any(np.diff(steps) <= 0):
            fail(f"/train/step is not increasing: {steps}")


def check_ckpt(path):
    with h5py.File(path, "r") as f:
        for a in ("step", "deck", "version", "rng", "data_cursor"):
            if a not in f.attrs:
                fail(f"{path}: attribute {a} missing")
        deck = deck_of(f)
        L, C = deck.getint("model", "layers"), deck.getint("model", "dim")
        R = C * deck.getint("model", "mlp_ratio")
        n = deck.getint("model", "context")
        V = 257 if deck.get("model", "objective") == "mlm" else 256
        shapes = {"embed/token": (V, C), "norm_f/weight": (C,), "norm_f/bias": (C,)}
        if deck.get("model", "position") == "learned":
            shapes["embed/position"] = (n, C)
        if deck.get("model", "tie_embeddings") == "false":
            shapes["head/weight"] = (V, C)
        for l in range(L):
            p = "layer_%03d/" % l
            shapes.update({p + "norm1/weight": (C,), p + "norm1/bias": (C,),
                           p + "attn/wqkv": (3 * C, C), p + "attn/bqkv": (3 * C,),
                           p + "attn/wo": (C, C), p + "attn/bo": (C,),
                           p + "norm2/weight": (C,), p + "norm2/bias": (C,),
                           p + "mlp/w1": (R, C), p + "mlp/b1": (R,),
                           p + "mlp/w2": (C, R), p + "mlp/b2": (C,)})
        for prefix in ("/model/", "/optimizer/m/", "/optimizer/v/"):
            for name, shape in shapes.items():
                if prefix + name not in f:
                    fail(f"{path}: {prefix}{name} missing")
                if f[prefix + name].shape != shape or f[prefix + name].dtype != np.float32:
                    fail(f"{path}: {prefix}{name} is {f[prefix + name].shape} {f[prefix + name].dtype}, expected {shape} float32")
        def crc(name, obj):
            if isinstance(obj, h5py.Dataset):
                if "crc32" not in obj.attrs:
                    fail(f"{path}: {name} has no crc32 attribute")
                if zlib.crc32(obj[...].tobytes()) != int(obj.attrs["crc32"]) & 0xFFFFFFFF:
                    fail(f"{path}: {name} does not match its crc32")
        f.visititems(crc)


def flip_bit(path, dataset):
    with h5py.File(path, "r") as f:
        d = f[dataset]
        offset, size = d.id.get_offset(), d.id.get_storage_size()
    with open(path, "r+b") as b:
        b.seek(offset + size // 2)
        byte = b.read(1)[0]
        b.seek(offset + size // 2)
        b.write(bytes([byte ^ 0x10]))


def tensors(f):
    out = {}
    def visit(name, obj):
        if isinstance(obj, h5py.Dataset):
            out[name] = obj[...]
    f.visititems(visit)
    return out


def same_bits(x, y):
    """Equal arrays, NaN equal to NaN (an accuracy of an empty distance bucket is NaN)."""
    if x.dtype.kind == "f" and y.dtype.kind == "f":
        return np.array_equal(x, y, equal_nan=True)
    return np.array_equal(x, y)


def rel_diff(x, y, floor):
    """The largest |x − y| / max(|y|, floor) where both are numbers; inf where only one is NaN."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if x.shape != y.shape or not np.array_equal(np.isnan(x), np.isnan(y)):
        return np.inf
    m = ~np.isnan(x)
    return float(np.max(np.abs(x[m] - y[m]) / np.maximum(np.abs(y[m]), floor), initial=0.0))


def same_series(a, b, group, start, rtol):
    with h5py.File(a, "r") as fa, h5py.File(b, "r") as fb:
        key = {"train": "/train/step", "eval": "/eval/step", "test": "/test/step",
               "attention": "/attention/step"}[group]
        # level masses can be tiny in far bands: judge them against a floor, not their own size
        floor = 1e-4 if group == "attention" else 1e-12
        sa, sb = fa[key][...], fb[key][...]
        ia, ib = np.where(sa > start)[0], np.where(sb > start)[0]
        if len(ia) == 0 or not np.array_equal(sa[ia], sb[ib]):
            fail(f"{key}: steps after {start} differ: {sa[ia]} vs {sb[ib]}")
        for name in fa[group]:
            if name in ("step", "step_ms", "tokens_per_s"):
                continue
            x, y = fa[group][name][...][ia], fb[group][name][...][ib]
            if rtol == 0:
                if not same_bits(x, y):
                    fail(f"/{group}/{name} differs: {x} vs {y}")
            else:
                err = rel_diff(x, y, floor)
                if err > rtol:
                    fail(f"/{group}/{name}: relative difference {err:.3e} > {rtol}: {x} vs {y}")


def same_tensors(a, b, rtol, params_only=False):
    with h5py.File(a, "r") as fa, h5py.File(b, "r") as fb:
        ta, tb = tensors(fa), tensors(fb)
        if params_only:
            ta = {k: v for k, v in ta.items() if k.startswith("model/")}
            tb = {k: v for k, v in tb.items() if k.startswith("model/")}
            for k in ta:
                if k.endswith("attn/bqkv"):
                    C = ta[k].shape[0] // 3
                    ta[k] = np.concatenate([ta[k][:C], ta[k][2 * C:]])
                    tb[k] = np.concatenate([tb[k][:C], tb[k][2 * C:]])
        if sorted(ta) != sorted(tb):
            fail(f"tensor names differ: {sorted(set(ta) ^ set(tb))}")
        for name in ta:
            x, y = ta[name], tb[name]
            if rtol == 0:
                if not same_bits(x, y):
                    fail(f"{name} differs (max |diff| {np.max(np.abs(x - y)):.3e})")
            else:
                scale = max(np.max(np.abs(y)), 1e-30)
                err = np.max(np.abs(x - y)) / scale
                if err > rtol:
                    fail(f"{name}: relative difference {err:.3e} > {rtol}")


def main(argv):
    if len(argv) < 3:
        fail(__doc__)
    cmd = argv[1]
    if cmd == "diag":
        check_diag(argv[2])
    elif cmd == "ckpt":
        check_ckpt(argv[2])
    elif cmd == "flip":
        flip_bit(argv[2], argv[3])
    elif cmd == "value":
        with h5py.File(argv[2], "r") as f:
            d = f[argv[3]][...]
            idx = int(argv[4]) if len(argv) > 4 else -1
            print(repr(float(d.reshape(-1)[idx])))
    elif cmd == "same-series":
        same_series(argv[2], argv[3], argv[4], float(argv[5]), float(argv[6]))
    elif cmd == "same-tensors":
        same_tensors(argv[2], argv[3], float(argv[4]))
    elif cmd == "same-params":
        same_tensors(argv[2], argv[3], float(argv[4]), params_only=True)
    else:
        fail("unknown command " + cmd)


if __name__ == "__main__":
    main(sys.argv)
