#!/usr/bin/env python3
"""mutations.py: the CUDA emulation's mutation check (run by test_mutations.sh in make check).

Each mutant plants one defect in a copy of one gpu/*.cu file (a removed barrier, an off-by-one
tile or guard, a wrong causal or band mask, a wrong warp mask, a wrong cuBLAS leading dimension,
work on the wrong stream), compiles only that file through cu2cc.py at -O1, links it with the
unmutated objects of test_gpu_emu, runs test_gpu under the emulation and requires it to FAIL.
A mutant whose anchor or pattern is not found exactly once is itself a failure ("no longer
applies: update it"), so the check cannot go stale silently. Output: TAP, one line per mutant.
"""
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cu2cc  # noqa: E402  (its masking of comments and strings)

# (name, file, function anchor, old text, new text, what, tests to run, environment, ranks)
EXACT = "test_gpu_exact*"
MUTANTS = [
    ("fwd-barrier-before-restage", "attention.cu", "void exact_fwd(",
     "    __syncthreads();  // the previous tile is no longer read\n", "",
     "exact_fwd: the barrier before a tile is restaged removed", EXACT, {}, 1),
    ("fwd-barrier-after-stage", "attention.cu", "void exact_fwd(",
     "stage<D>(ks, k + head, vs, v + head, j0, bj);\n    __syncthreads();\n",
     "stage<D>(ks, k + head, vs, v + head, j0, bj);\n",
     "exact_fwd: the barrier after staging a tile removed", EXACT, {}, 1),
    ("dq-barrier-before-restage", "attention.cu", "void exact_bwd_dq(",
     "    __syncthreads();\n    stage<D>(ks", "    stage<D>(ks",
     "exact_bwd_dq: the barrier before a tile is restaged removed", EXACT, {}, 1),
    ("dq-barrier-after-stage", "attention.cu", "void exact_bwd_dq(",
     "stage<D>(ks, k + head, vs, v + head, j0, bj);\n    __syncthreads();\n",
     "stage<D>(ks, k + head, vs, v + head, j0, bj);\n",
     "exact_bwd_dq: the barrier after staging a tile removed", EXACT, {}, 1),
    ("dkv-barrier-before-restage", "attention.cu", "void exact_bwd_dkv(",
     "    __syncthreads();\n    stage<D>(qs", "    stage<D>(qs",
     "exact_bwd_dkv: the barrier before a tile is restaged removed", EXACT, {}, 1),
    ("dkv-barrier-after-stage", "attention.cu", "void exact_bwd_dkv(",
     "    }\n    __syncthreads();\n    if (!live) continue;", "    }\n    if (!live) continue;",
     "exact_bwd_dkv: the barrier after staging q, dout, lse, D removed", EXACT, {}, 1),
    ("fwd-live-off-by-one", "attention.cu", "void exact_fwd(",
     "const bool live = i < T;", "const bool live = i <= T;",
     "exact_fwd: query row T counted as live (off by one)", EXACT, {}, 1),
    ("fwd-tile-off-by-one", "attention.cu", "void exact_fwd(",
     "(int)min((long)kTile, hi + 1 - j0)", "(int)min((long)kTile, hi + 2 - j0)",
     "exact_fwd: a key tile one row too long", EXACT, {}, 1),
    ("stage-off-by-one", "attention.cu", "void stage(",
     "e < count * D;", "e <= count * D;",
     "stage: one element staged past the tile", EXACT, {}, 1),
    ("causal-mask-diagonal", "attention.cu", "bool allows(",
     "mk.causal && j > i", "mk.causal && j >= i",
     "allows: the causal mask hides the diagonal", EXACT, {}, 1),
    ("band-mask-wide", "attention.cu", "bool allows(",
     "j > i - mk.band", "j >= i - mk.band",
     "allows: the band one key wider on the left", EXACT, {}, 1),
    ("key-span-short", "attention.cu", "void key_span(",
     "i0 - mk.band + 1", "i0 - mk.band + 2",
     "key_span: the first key of a band left out", EXACT, {}, 1),
    ("query-span-short", "attention.cu", "void query_span(",
     "j1 + mk.band - 1", "j1 + mk.band - 2",
     "query_span: the last query of a band left out", EXACT, {}, 1),
    ("rowdot-off-by-one", "attention.cu", "void rowdot(",
     "if (r >= rows) return;", "if (r > rows) return;",
     "rowdot: one row past the end", EXACT, {}, 1),
    ("reduce-barrier-after-partials", "layers.cu", "float block_reduce(",
     "  if (lane == 0) part[warp] = v;\n  __syncthreads();\n", "  if (lane == 0) part[warp] = v;\n",
     "block_reduce (softmax_xent): the barrier after the warp partials removed",
     "test_gpu_softmax*", {}, 1),
    ("reduce-barrier-after-result", "layers.cu", "float block_reduce(",
     "  if (threadIdx.x == 0) result = r;\n  __syncthreads();\n",
     "  if (threadIdx.x == 0) result = r;\n",
     "block_reduce (softmax_xent): the barrier after the result removed", "test_gpu_softmax*", {}, 1),
    ("warp-sum-mask", "layers.cu", "float warp_sum(",
     "__shfl_xor_sync(0xffffffffu, v, o)", "__shfl_xor_sync(0x0000ffffu, v, o)",
     "warp_sum (layernorm): a shuffle mask of half the warp", "test_gpu_layernorm", {}, 1),
    ("warp-sum-half", "layers.cu", "float warp_sum(",
     "for (int o = kWarp / 2;", "for (int o = kWarp / 4;",
     "warp_sum (layernorm): the butterfly skips its first step", "test_gpu_layernorm", {}, 1),
    ("layernorm-row-off-by-one", "layers.cu", "void layernorm_fwd(",
     "if (row >= N) return;", "if (row > N) return;",
     "layernorm_fwd: one row past the end", "test_gpu_layernorm", {}, 1),
    ("column-sums-off-by-one", "layers.cu", "void column_sums(",
     "if (c >= C) return;", "if (c > C) return;",
     "column_sums (linear dbias): one column past the end", "test_gpu_linear", {}, 1),
    ("add-bias-off-by-one", "layers.cu", "void add_bias(",
     "if (i < (size_t)N * C)", "if (i <= (size_t)N * C)",
     "add_bias (linear): one element past the end", "test_gpu_linear", {}, 1),
    ("linear-forward-lda", "layers.cu", "void gpu_linear_forward(",
     "weight, IC,\n                           inp, IC", "weight, OC,\n                           inp, IC",
     "gpu_linear_forward: cuBLAS lda = OC instead of IC (valid, reads past weight)",
     "test_gpu_linear", {}, 1),
    ("linear-dinp-ldb", "layers.cu", "void gpu_linear_backward(",
     "dout, OC, &one, dinp, IC", "dout, IC, &one, dinp, IC",
     "gpu_linear_backward: cuBLAS ldb = IC < k (cuBLAS's argument check)", "test_gpu_linear", {}, 1),
    ("linear-dweight-ldc", "layers.cu", "void gpu_linear_backward(",
     "dout, OC, &one, dweight, IC", "dout, OC, &one, dweight, OC",
     "gpu_linear_backward: cuBLAS ldc = OC instead of IC (valid, writes past dweight)",
     "test_gpu_linear", {}, 1),
    ("upload-wrong-stream", "runtime.cu", "void gpu_upload(",
     "cudaMemcpyHostToDevice, stream_)", "cudaMemcpyHostToDevice, 0)",
     "gpu_upload: the copy on the legacy default stream, not the back end's (deferred mode)",
     "test_gpu_gelu", {"CUDAEMU_DEFER": "1"}, 1),
    ("bias-kernel-wrong-stream", "layers.cu", "void gpu_linear_forward(",
     "kThreads, 0, gpu_stream()>>>", "kThreads, 0, 0>>>",
     "gpu_linear_forward: add_bias on the legacy default stream (deferred mode)",
     "test_gpu_linear", {"CUDAEMU_DEFER": "1"}, 1),
    ("sumsq-barrier-after-store", "optimizer.cu", "void sum_squares(",
     "  s[threadIdx.x] = acc;\n  __syncthreads();\n", "  s[threadIdx.x] = acc;\n",
     "sum_squares: the barrier after the per-thread sums removed", "test_gpu_adamw", {}, 1),
    ("sumsq-barrier-in-tree", "optimizer.cu", "void sum_squares(",
     "s[threadIdx.x + o];\n    __syncthreads();\n", "s[threadIdx.x + o];\n",
     "sum_squares: the barrier inside the tree reduction removed", "test_gpu_adamw", {}, 1),
    ("adamw-off-by-one", "optimizer.cu", "void adamw(",
     "if (e >= n) return;", "if (e > n) return;",
     "adamw: one element past the end", "test_gpu_adamw", {}, 1),
    ("allreduce-wrong-op", "nccl.cu", "void gpu_nccl_allreduce_sum(",
     "ncclFloat32, ncclSum,", "ncclFloat32, ncclMax,",
     "gpu_nccl_allreduce_sum: max instead of sum (2 ranks)", "test_gpu_nccl*", {}, 2),
]


def function_span(masked, anchor_pos):
    """[start, end) of the function whose signature starts at anchor_pos: to its closing brace."""
    j = masked.find("{", anchor_pos)
    if j < 0:
        return None
    end = cu2cc.match_close(masked, j, "{", "}")
    return anchor_pos, end + 1


def apply(src, anchor, old, new):
    """The mutated source, or an explanation why the mutation no longer applies."""
    masked = cu2cc.mask(src)
    hits = [m.start() for m in re.finditer(re.escape(anchor), masked)]
    if len(hits) != 1:
        return None, "its anchor '%s' occurs %d times" % (anchor, len(hits))
    start, end = function_span(masked, hits[0])
    body = src[start:end]
    count = body.count(old)
    if count != 1:
        return None, "its pattern occurs %d times in the function of '%s'" % (count, anchor)
    return src[:start] + body.replace(old, new, 1) + src[end:], None


def run(cmd, cwd=None, env=None, timeout=300):
    p = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       timeout=timeout)
    return p.returncode, p.stdout.decode("utf-8", "replace")


def how_caught(out):
    """A short account of how the test run failed."""
    for line in out.splitlines():
        if line.startswith("cudaemu") and ("illegal" in line or "divergent" in line or
                                           "deadlock" in line or "warp" in line or
                                           "not inside" in line or "shared memory" in line):
            return line[:200]
    for line in out.splitlines():
        if "CUBLAS_STATUS" in line or "failed:" in line:
            return line[:200]
    failed = [l.split(" - ", 1)[-1] for l in out.splitlines() if l.startswith("not ok")]
    reasons = [l.strip("# ") for l in out.splitlines() if "relative error" in l or "differ" in l]
    if failed:
        return "test failed: %s%s" % (", ".join(failed), " (%s)" % reasons[0] if reasons else "")
    return "exit status non-zero"


class Harness:
    def __init__(self, work):
        e = os.environ
        self.work = work
        self.build = e["EMU_BUILD"]
        self.src = os.path.join(e["SRCDIR"], "gpu")
        self.rewriter = os.path.join(e["EMU_SRC"], "cu2cc.py")
        self.compile = shlex.split(e["CUDAEMU_COMPILE"])
        self.link = shlex.split(e["CUDAEMU_LINK"])
        self.libs = shlex.split(e["CUDAEMU_LINK_LIBS"])
        self.gpu_objects = shlex.split(e["CUDAEMU_GPU_OBJECTS"])
        self.test_objects = shlex.split(e["CUDAEMU_TEST_OBJECTS"])
        self.mpi_run = e["MPI_RUN"]
        self.python = e.get("PYTHON3") or sys.executable

    def program(self, name, cu_file, text):
        """test_gpu_emu with gpu/cu_file replaced by `text`; (path, None) or (None, log)."""
        d = os.path.join(self.work, name)
        os.makedirs(d, exist_ok=True)
        cu, cpp, obj = (os.path.join(d, cu_file + ext) for ext in ("", ".cpp", ".o"))
        with open(cu, "w") as f:
            f.write(text)
        rc, out = run([self.python, self.rewriter, cu, cpp])
        if rc == 0:
            rc, out = run(self.compile + ["-c", cpp, "-o", obj])
        if rc != 0:
            return None, out
        stem = "gpu_" + cu_file[:-3]
        objects = [obj if re.search(r"\b%s\.o" % re.escape(stem), o) else o for o in self.gpu_objects]
        if obj not in objects:
            return None, "no object of %s among %s" % (cu_file, self.gpu_objects)
        prog = os.path.join(d, "test_gpu_mutant")
        rc, out = run(self.link + ["-o", prog] + self.test_objects + objects + self.libs,
                      cwd=self.build)
        return (prog, None) if rc == 0 else (None, out)

    def test(self, prog, tests, env_extra, ranks):
        env = dict(os.environ)
        env.update(env_extra)
        env["CUDAEMU_TEST_FILTER"] = tests
        cmd = [prog] if ranks == 1 else [self.mpi_run, str(ranks), "env",
                                         "CUDAEMU_DEVICES=%d" % ranks, prog]
        try:
            return run(cmd, env=env, timeout=240)
        except subprocess.TimeoutExpired:
            return 124, "timed out after 240 s"


def main():
    work = tempfile.mkdtemp(prefix="fmattn-mutations-")
    h = Harness(work)
    n, failed, t0 = 0, 0, time.time()

    def tap(ok, what, detail=""):
        nonlocal n, failed
        n += 1
        failed += not ok
        print("%s %d - %s" % ("ok" if ok else "not ok", n, what))
        for line in detail.strip().splitlines()[-25:]:
            print("# " + line)
        sys.stdout.flush()

    # the unmutated test_gpu_emu passes every run the mutants get: their failures are theirs,
    # not the harness's
    seen = set()
    for name, cu_file, anchor, old, new, what, tests, env, ranks in MUTANTS:
        key = (tests, tuple(sorted(env.items())), ranks)
        if key in seen:
            continue
        seen.add(key)
        rc, out = h.test(os.path.join(h.build, "test_gpu_emu"), tests, env, ranks)
        tap(rc == 0, "control: the unmutated test_gpu passes %s%s%s" % (
            tests, " with %s" % env if env else "", " on %d ranks" % ranks if ranks > 1 else ""),
            out if rc else "")
    for i, (name, cu_file, anchor, old, new, what, tests, env, ranks) in enumerate(MUTANTS, 1):
        with open(os.path.join(h.src, cu_file)) as f:
            src = f.read()
        text, why = apply(src, anchor, old, new)
        if text is None:
            tap(False, "mutation %d (%s) no longer applies: update it in tests/cudaemu/mutations.py "
                "(%s)" % (i, name, why))
            continue
        prog, log = h.program(name, cu_file, text)
        if not prog:
            tap(False, "mutation %d (%s): the mutant does not build" % (i, name), log)
            continue
        rc, out = h.test(prog, tests, env, ranks)
        label = "mutation %d (%s) %s: %s" % (i, name, cu_file, what)
        if rc != 0:
            tap(True, label + " -- caught: " + how_caught(out))
        else:
            tap(False, label + " -- NOT caught: test_gpu passes with the defect", out)
    print("1..%d" % n)
    print("# %d mutants and controls in %.0f s" % (n, time.time() - t0))
    if failed == 0:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print("# work kept in " + work)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
