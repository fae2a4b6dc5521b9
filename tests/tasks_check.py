#!/usr/bin/python3
"""An independent checker of fmattn's task files (docs/tasks.md), for tests/test_tasks.sh.

  tasks_check.py FILE     every row of a task file written by data.export: the answers,
                          scored positions and distances recomputed from the row's own tokens
                          and the deck stored in the file (ListOps evaluated by its own parser)

Written from the task definitions in docs/tasks.md, not from src/tasks/: a generator that puts a
wrong answer, scores the wrong position or mislabels a distance fails here. Exit status 0 when
every row holds; the first few problems on stderr otherwise.
"""
import configparser
import statistics
import sys

import h5py
import numpy as np

problems = []


def bad(row, msg):
    problems.append(f"row {row}: {msg}")


def deck(f):
    text = f.attrs["deck"]
    cp = configparser.ConfigParser(inline_comment_prefixes=(";", "#"))
    cp.read_string(text.decode() if isinstance(text, bytes) else text)
    return cp


def expect(row, tokens, scored, distance, want):
    """want: {position t: (target byte, distance)}; every other target unscored."""
    got = {int(t) for t in np.nonzero(scored)[0]}
    if got != set(want):
        bad(row, f"scored positions {sorted(got)} != {sorted(want)}")
        return
    for t, (target, d) in want.items():
        if tokens[t + 1] != target:
            bad(row, f"target at {t} is {tokens[t + 1]}, the task says {target}")
        if distance is not None and distance[t] != d:
            bad(row, f"distance at {t} is {distance[t]}, the task says {d}")


def check_mqar(row, tok, sc, dist, cfg):
    one = cfg.getboolean("data", "mqar.one_hop")
    P = cfg.getint("data", "mqar.pairs")
    Q = cfg.getint("data", "mqar.queries") or P
    pairs = {}  # key -> (value, position of the token holding the value)
    for i in range(P):
        if one:
            b = int(tok[i])
            if not 0x80 <= b <= 0xFF:
                return bad(row, f"pair {i} byte {b:#x} is not a pair")
            key, value, pos = (b - 0x80) // 8, (b - 0x80) % 8, i
        else:
            k, v = int(tok[2 * i]), int(tok[2 * i + 1])
            if not (0x80 <= k < 0xC0 and 0xC0 <= v <= 0xFF):
                return bad(row, f"pair {i} bytes {k:#x} {v:#x}")
            key, value, pos = k - 0x80, v - 0xC0, 2 * i + 1
        if key in pairs:
            return bad(row, f"key {key} given twice")
        pairs[key] = (value, pos)
    want, t = {}, P if one else 2 * P
    while t < len(tok) - 1:
        b = int(tok[t])
        if b == 0:
            t += 1
            continue
        key = b - 0x40 if one else b - 0x80
        if key not in pairs or (one and not 0x40 <= b < 0x50):
            return bad(row, f"byte {b:#x} at {t} in the query region is not a query of a key")
        value, pos = pairs[key]
        want[t] = (0x80 + 8 * key + value if one else 0xC0 + value, t - pos)
        t += 2
    if len(want) != Q:
        bad(row, f"{len(want)} queries, the deck asks for {Q}")
    keys = [int(tok[t]) for t in want]
    if len(set(keys)) != len(keys):
        bad(row, "a key is asked for twice")
    expect(row, tok, sc, dist, want)


def check_passkey(row, tok, sc, dist, cfg):
    k = cfg.getint("data", "passkey.digits")
    one = cfg.getboolean("data", "passkey.one_hop")
    H = len(tok)  # the haystack, then padding
    while tok[H - 1] == 0:
        H -= 1
    lo, hi = (float(x) for x in (cfg.get("data", "passkey.length").split(",") * 2)[:2])
    if H < len(tok) and not lo * len(tok) - 1 <= H <= hi * len(tok) + 1:
        bad(row, f"a haystack of {H} tokens, outside length {lo}..{hi}")
    if int(np.sum(tok[:H] == 0)):
        bad(row, "a padding byte inside the haystack")
    Q = H - 1 - (2 * k if one else k)
    needles = [int(i) for i in np.nonzero(tok == 0x02)[0]]
    if tok[Q] != 0x03 or len(needles) != 1 or int(np.sum(tok == 0x03)) != 1:
        return bad(row, f"markers: needle at {needles}, question at {np.nonzero(tok == 3)[0]}")
    p = needles[0]
    digits = [int(b) for b in tok[p + 1:p + 1 + k]]
    for i, b in enumerate(digits):
        ok = 0x80 + 10 * i <= b < 0x80 + 10 * (i + 1) if one else 0x30 <= b <= 0x39
        if not ok:
            return bad(row, f"needle digit {i} is byte {b:#x}")
    if one:
        queries = [int(b) for b in tok[Q + 1:H:2]]
        if queries != [0x10 + i for i in range(k)]:
            bad(row, f"the queries are {queries}")
        where = [Q + 1 + 2 * i for i in range(k)]  # query i predicts digit i
    else:
        where = [Q + i for i in range(k)]  # the question, then each digit, predicts the next
    if [int(tok[t + 1]) for t in where] != digits:
        bad(row, "the answer is not the needle's digits")
    lo, hi = (float(x) for x in (cfg.get("data", "passkey.depth").split(",") * 2)[:2])
    F = Q - (k + 1)
    if not round(lo * F) - 1 <= p <= round(hi * F) + 1:
        bad(row, f"needle at {p}, outside depth {lo}..{hi} of {F}")
    expect(row, tok, sc, dist, {t: (digits[i], t - (p + 1 + i)) for i, t in enumerate(where)})


OPS = {ord("X"): max, ord("N"): min, ord("D"): lambda v: int(statistics.median(v)),
       ord("S"): lambda v: sum(v) % 10}


def listops_eval(expr, cfg):
    """Parses and evaluates an expression of bytes; returns (value, depth) or raises."""
    max_args = cfg.getint("data", "listops.max_args")

    def node(i, depth):
        b = expr[i]
        if 0x30 <= b <= 0x39:
            return b - 0x30, i + 1, depth
        if b not in OPS:
            raise ValueError(f"byte {b:#x} at {i}")
        args, i, deepest = [], i + 1, depth
        while expr[i] != ord("]"):
            v, i, d = node(i, depth + 1)
            args.append(v)
            deepest = max(deepest, d)
        if not 2 <= len(args) <= max_args:
            raise ValueError(f"{len(args)} arguments")
        return OPS[b](args), i + 1, deepest

    value, end, depth = node(0, 1)
    if end != len(expr):
        raise ValueError("bytes after the expression")
    return value, depth


def check_listops(row, tok, sc, dist, cfg):
    n = len(tok) - 1
    eq = [int(i) for i in np.nonzero(tok == ord("="))[0]]
    if len(eq) != 1:
        return bad(row, f"'=' at {eq}")
    E = eq[0]
    if any(int(b) != ord(" ") for b in tok[E + 2:]):
        bad(row, "not padding after the answer")
    expr = bytes(int(b) for b in tok[:E])
    try:
        value, depth = listops_eval(expr, cfg)
    except (ValueError, IndexError) as e:
        return bad(row, f"not an expression: {e}: {expr[:60]!r}")
    if depth > cfg.getint("data", "listops.max_depth"):
        bad(row, f"depth {depth}")
    if not cfg.getint("data", "listops.min_length") <= len(expr) <= n - 1:
        bad(row, f"{len(expr)} bytes, outside min_length .. n - 1")
    expect(row, tok, sc, dist, {E: (0x30 + value, len(expr))})


def check_copy(row, tok, sc, dist, cfg):
    n = len(tok) - 1
    L = cfg.getint("data", "copy_len") or n // 2
    if 2 * L + 1 > n + 1:
        L = n // 2
    if tok[L] != 0 or list(tok[L + 1:2 * L + 1]) != list(tok[:L]):
        bad(row, "the second half is not a copy of the first")
    expect(row, tok, sc, dist, {t: (int(tok[t - L]), L) for t in range(L, 2 * L)})


def check_majority(row, tok, sc, dist, cfg):
    n, S = len(tok) - 1, cfg.getint("data", "symbols")
    step = max(n // 4, 1)
    markers = list(range(n // 2, n, step))
    want = {}
    for m in markers:
        if tok[m] != S + 1:
            return bad(row, f"no marker at {m}")
        data = [int(b) for i, b in enumerate(tok[:m]) if 1 <= b <= S and i - 1 not in markers]
        counts = [data.count(s) for s in range(1, S + 1)]
        want[m] = (1 + counts.index(max(counts)), m)
    expect(row, tok, sc, dist, want)


CHECKS = {"mqar": check_mqar, "passkey": check_passkey, "listops": check_listops,
          "copy": check_copy, "majority": check_majority}


def main():
    path = sys.argv[1]
    with h5py.File(path, "r") as f:
        tok, sc = f["tokens"][...], f["scored"][...]
        dist = f["distance"][...] if "distance" in f else None
        source = f.attrs["source"]
        source = source.decode() if isinstance(source, bytes) else source
        split = f.attrs["split"]
        split = split.decode() if isinstance(split, bytes) else split
        cfg = deck(f)
    rows = sum(int(x) for x in split.split(","))
    if rows != len(tok):
        problems.append(f"split {split} names {rows} rows; the file has {len(tok)}")
    if tok.shape[1] != cfg.getint("model", "context") + 1:
        problems.append(f"rows of {tok.shape[1]} tokens for model.context {cfg.get('model', 'context')}")
    check = CHECKS.get(source)
    if check is None:
        sys.exit(f"tasks_check: no checker for source {source}")
    for r in range(len(tok)):
        check(r, tok[r].astype(np.int64), sc[r], None if dist is None else dist[r], cfg)
        if len(problems) > 20:
            break
    if problems:
        sys.stderr.write("tasks_check: " + "\n  ".join(problems[:10]) + "\n")
        sys.exit(1)
    print(f"tasks_check: {len(tok)} {source} rows hold")


if __name__ == "__main__":
    main()
