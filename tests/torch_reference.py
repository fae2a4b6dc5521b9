#!/usr/bin/python3
"""An independent implementation of fmattn's model (SPEC §5, `full` attention) in PyTorch,
float64, for the reference test: it loads an fmattn checkpoint and a byte file and prints the
mean validation loss over the evaluation windows of SPEC §4, which fmattn must reproduce.

usage: torch_reference.py CHECKPOINT DATA_FILE
"""
import configparser
import math
import sys

import h5py
import numpy as np
import torch

torch.set_default_dtype(torch.float64)


def main(ckpt_path, data_path):
    f = h5py.File(ckpt_path, "r")
    deck = configparser.ConfigParser(inline_comment_prefixes=(";", "#"))
    text = f.attrs["deck"]
    deck.read_string(text.decode() if isinstance(text, bytes) else text)
    L = deck.getint("model", "layers")
    C = deck.getint("model", "dim")
    H = deck.getint("model", "heads")
    n = deck.getint("model", "context")
    pos = deck.get("model", "position")
    tied = deck.get("model", "tie_embeddings") == "true"
    assert deck.get("model", "objective") == "clm" and deck.get("attention", "variant") == "full"
    d = C // H
    W = lambda name: torch.from_numpy(f["/model/" + name][...].astype(np.float64))

    data = np.fromfile(data_path, dtype=np.uint8)
    split = [float(x) for x in deck.get("data", "split").split(",")]
    if all(s <= 1 for s in split):
        lengths = [int(split[0] * len(data)), int(split[1] * len(data))]
    else:
        lengths = [int(split[0]), int(split[1])]
    valid = data[lengths[0]:lengths[0] + lengths[1]]
    windows = min(deck.getint("train", "eval_windows"), (len(valid) - 1) // n)
    x = torch.tensor(np.stack([valid[k * n:k * n + n] for k in range(windows)]).astype(np.int64))
    y = torch.tensor(np.stack([valid[k * n + 1:k * n + n + 1] for k in range(windows)]).astype(np.int64))

    def layernorm(h, prefix):
        return torch.nn.functional.layer_norm(h, (C,), W(prefix + "/weight"), W(prefix + "/bias"), 1e-5)

    def rope(t):  # (B, H, n, d): pairs (2i, 2i+1) rotated by position · 10000^(−2i/d)
        ang = torch.arange(n)[:, None] * torch.pow(10000.0, -2.0 * torch.arange(d // 2) / d)[None, :]
        c, s = torch.cos(ang), torch.sin(ang)
        a, b = t[..., 0::2], t[..., 1::2]
        out = torch.empty_like(t)
        out[..., 0::2] = a * c - b * s
        out[..., 1::2] = a * s + b * c
        return out

    h = W("embed/token")[x]
    if pos == "learned":
        h = h + W("embed/position")[None]
    elif pos == "sinusoidal":  # scaled to the token embeddings' init std (fmattn layers.c)
        ang = torch.arange(n)[:, None] / torch.pow(10000.0, 2.0 * torch.arange(C // 2) / C)[None, :]
        pe = torch.zeros(n, C)
        pe[:, 0::2], pe[:, 1::2] = torch.sin(ang), torch.cos(ang)
        h = h + 0.02 * math.sqrt(2.0) * pe[None]
    mask = torch.triu(torch.ones(n, n, dtype=torch.bool), 1)
    for l in range(L):
        p = "layer_%03d/" % l
        qkv = layernorm(h, p + "norm1") @ W(p + "attn/wqkv").T + W(p + "attn/bqkv")
        q, k, v = [t.reshape(windows, n, H, d).transpose(1, 2) for t in qkv.split(C, dim=2)]
        if pos == "rope":
            q, k = rope(q), rope(k)
        s = (q @ k.transpose(-1, -2)) / math.sqrt(d)
        a = torch.softmax(s.masked_fill(mask, -math.inf), dim=-1) @ v
        h = h + a.transpose(1, 2).reshape(windows, n, C) @ W(p + "attn/wo").T + W(p + "attn/bo")
        m = layernorm(h, p + "norm2") @ W(p + "mlp/w1").T + W(p + "mlp/b1")
        m = torch.nn.functional.gelu(m, approximate="tanh")
        h = h + m @ W(p + "mlp/w2").T + W(p + "mlp/b2")
    logits = layernorm(h, "norm_f") @ (W("embed/token") if tied else W("head/weight")).T
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    print(repr(loss.item()))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
