#!/usr/bin/python3
"""Replay the CUDA back end's device-pool requests under a placement policy, without a GPU.

  pool_replay.py TRACE [--policy oldest|best|first] [--json out.json]

TRACE is what FMATTN_GPU_POOL_TRACE=TRACE makes fmattn (its CUDA build, or the emulation) write:
one line per request of gpu/memory.cu's pool, in order,

  a BYTES LABEL ADDRESS SIZE GREW   a block of BYTES asked for (SIZE given; GREW 1: from the driver)
  f ADDRESS                         the block at ADDRESS freed
  r                                 the pool gave back what it held unused (gpu_release_cache)
  m counts_reset | m counts_read    a bench case's counted repetitions begin | end

The replay models the pool (docs/gpu.md, "The pool's steady state"): blocks up to 1 MiB by size
class (512-byte steps), reused whole; larger ones rounded to whole MiB and cut from segments, a
rest of 1 MiB or more split off, free neighbours merged; a request no free piece holds makes a
segment of its own size. The policies differ only in which free piece a large request takes:

  oldest  the best fit in the oldest segment where one fits (fmattn's pool)
  best    the best fit over all segments (the pool before 2026-11-27)
  first   the lowest address in the oldest segment where one fits

For each counted section (counts_reset to counts_read: a bench case's timed repetitions, after
its warm-up) it prints the requests that grew the pool, the most in use and the most reserved, as
bench.h5 /gpu counts them (mallocs_after_first_step, pool_live_peak_bytes,
pool_reserved_peak_bytes); with --policy oldest these are the pool's own counts, which
tests/cudaemu/test_gpu_counts.sh checks. Addresses in the trace serve only to pair each free with
its request: the replay places blocks itself.
"""
import argparse
import json
import sys

MIB = 1 << 20


def size_class(nbytes):
    """The pool's size class: 512-byte steps up to 1 MiB, whole MiB above."""
    nbytes = max(nbytes, 1)
    step = 512 if nbytes <= MIB else MIB
    return (nbytes + step - 1) // step * step


class Pool:
    """The pool's state: small blocks free by class, segments of pieces [offset, size, used]."""

    def __init__(self, policy):
        self.policy = policy
        self.segments = {}  # number (in the order made) -> pieces in address order
        self.made = 0
        self.small = {}  # class -> free blocks of it
        self.blocks = {}  # request id -> ("small", size) or ("large", segment, offset, size)
        self.live = self.cached = 0
        self.growths = 0

    def _take(self, size):
        """A free piece of at least size bytes, split; (segment, offset, size) or None."""
        chosen = None
        for seg in sorted(self.segments):
            fits = [(p[1], p[0], i) for i, p in enumerate(self.segments[seg])
                    if not p[2] and p[1] >= size]
            if not fits:
                continue
            key = fits[0] if self.policy == "first" else min(fits)  # fits in address order
            if self.policy != "best":  # the oldest segment where one fits
                chosen = (seg, key)
                break
            if chosen is None or key[0] < chosen[1][0]:
                chosen = (seg, key)  # by size, then the older segment (for the address)
        if chosen is None:
            return None
        seg, (_, _, i) = chosen
        pieces = self.segments[seg]
        offset, have, _ = pieces[i]
        if have - size >= MIB:
            pieces[i] = [offset, size, True]
            pieces.insert(i + 1, [offset + size, have - size, False])
        else:
            pieces[i] = [offset, have, True]
            size = have
        self.cached -= size
        return seg, offset, size

    def _give(self, seg, offset):
        pieces = self.segments[seg]
        i = next(j for j, p in enumerate(pieces) if p[0] == offset)
        pieces[i][2] = False
        self.cached += pieces[i][1]
        if i + 1 < len(pieces) and not pieces[i + 1][2]:
            pieces[i][1] += pieces.pop(i + 1)[1]
        if i > 0 and not pieces[i - 1][2]:
            pieces[i - 1][1] += pieces.pop(i)[1]

    def alloc(self, rid, nbytes):
        size = size_class(nbytes)
        if size <= MIB:
            if self.small.get(size, 0):
                self.small[size] -= 1
                self.cached -= size
            else:
                self.growths += 1
            self.blocks[rid] = ("small", size)
        else:
            got = self._take(size)
            if got is None:
                self.growths += 1
                self.segments[self.made] = [[0, size, True]]
                got = (self.made, 0, size)
                self.made += 1
            self.blocks[rid] = ("large",) + got
            size = got[2]
        self.live += size

    def free(self, rid):
        b = self.blocks.pop(rid)
        if b[0] == "small":
            self.small[b[1]] = self.small.get(b[1], 0) + 1
            self.cached += b[1]
            self.live -= b[1]
        else:
            self.live -= b[3]
            self._give(b[1], b[2])

    def release(self):
        self.small.clear()
        self.segments = {s: p for s, p in self.segments.items() if not (len(p) == 1 and not p[0][2])}
        self.cached = sum(p[1] for ps in self.segments.values() for p in ps if not p[2])


def replay(path, policy):
    """The counted sections of the trace at path, replayed under policy (a section the trace
    ends within ends with it)."""
    pool, ids, nid = Pool(policy), {}, 0
    sections, cur = [], None

    def close():
        sections.append({"mallocs": pool.growths - cur["growths0"],
                         "pool_live_peak_bytes": cur["live_peak"],
                         "pool_reserved_peak_bytes": cur["reserved_peak"]})

    with open(path) as f:
        for line in f:
            w = line.split()
            if not w:
                continue
            if w[0] == "a":
                nid += 1
                ids[w[3]] = nid
                pool.alloc(nid, int(w[1]))
            elif w[0] == "f":
                pool.free(ids.pop(w[1]))
            elif w[0] == "r":
                pool.release()
            elif w == ["m", "counts_reset"]:
                cur = {"growths0": pool.growths, "live_peak": pool.live,
                       "reserved_peak": pool.live + pool.cached}
            elif w == ["m", "counts_read"]:
                if cur is not None:
                    close()
                cur = None
            else:
                sys.exit(f"pool_replay.py: {path}: not a pool trace line: {line.rstrip()}")
            if cur is not None:
                cur["live_peak"] = max(cur["live_peak"], pool.live)
                cur["reserved_peak"] = max(cur["reserved_peak"], pool.live + pool.cached)
    if cur is not None:
        close()
    return sections


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--policy", choices=("oldest", "best", "first"), default="oldest")
    ap.add_argument("--json", help="write the sections' figures here")
    a = ap.parse_args()
    sections = replay(a.trace, a.policy)
    print(f"{a.trace}, policy {a.policy}: {len(sections)} counted sections")
    print(f"{'section':>7} {'growths':>7} {'live peak MiB':>14} {'reserved peak MiB':>18} {'ratio':>6}")
    for i, s in enumerate(sections):
        live, res = s["pool_live_peak_bytes"], s["pool_reserved_peak_bytes"]
        print(f"{i:7d} {s['mallocs']:7d} {live / MIB:14.1f} {res / MIB:18.1f} "
              f"{res / live if live else float('nan'):6.3f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"policy": a.policy, "sections": sections}, f, indent=1)


if __name__ == "__main__":
    main()
