#!/usr/bin/env python3
"""cu2cc.py IN.cu OUT.cc: rewrite one CUDA source into C++ for the CUDA emulation.

Only what C++ cannot express changes: kernel<<<grid, block[, smem[, stream]]>>>(args) becomes
cudaemu::launch(...), each __shared__ declaration inside a function becomes a reference into the
running block's shared memory, and every __global__ body starts by telling the emulation its
name. Everything else is left to the emulation's headers. The rewriter is narrow and loud: a
construct it does not understand, or one the emulation cannot execute, is an error naming the
file and line, never silently different code. Line numbers are kept (#line), so compiler errors
and the emulation's messages point at the .cu file.
"""
import os
import re
import sys


class RewriteError(Exception):
    def __init__(self, pos, msg):
        super().__init__(msg)
        self.pos = pos


# Constructs the emulation cannot execute (docs/cudaemu.md): a clear error instead of a wrong
# translation or a compiler error far from the cause.
UNSUPPORTED = [
    (r"\b(?:asm|__asm__)\b", "inline PTX (asm) cannot be emulated; write plain SIMT code"),
    (r"\b__constant__\b", "__constant__ memory is not emulated"),
    (r"\b__managed__\b", "__managed__ memory is not emulated"),
    (r"\b__activemask\b", "__activemask() depends on the hardware's divergence; not emulated"),
    (r"\b(?:__shfl|__shfl_up|__shfl_down|__shfl_xor|__ballot|__any|__all)\s*\(",
     "warp-synchronous intrinsics without _sync (pre-Volta) are not emulated; use the _sync forms"),
    (r"\bwmma\b|\bwgmma\b|\bmma_sync\b", "tensor-core mma/wgmma cannot be emulated; use cuBLAS"),
    (r"\b__pipeline_\w+|\bcp\.async\b|\bmemcpy_async\b|\bcuda::barrier\b",
     "asynchronous copies (cp.async, TMA, cuda::barrier) are not emulated"),
    (r"\bcooperative_groups\b", "cooperative groups are not emulated"),
    (r"\btexture\s*<|\btex[123]D\w*\s*\(|\bsurf[123]D\w*\s*\(", "textures are not emulated"),
    (r"\b__cvta_\w+", "address-space conversions are not emulated"),
]

CODE_BRACE_BEFORE = re.compile(r"(?:\)|\b(?:const|noexcept|override|final|mutable|else|do|try))\s*$")


def mask(src):
    """src with comments and the insides of string and character literals blanked (newlines
    kept), so that searches see code only; offsets are those of src."""
    out = list(src)
    i, n = 0, len(src)

    def blank(a, b):
        for k in range(a, b):
            if out[k] != "\n":
                out[k] = " "

    while i < n:
        c = src[i]
        if src.startswith("//", i):
            j = src.find("\n", i)
            j = n if j < 0 else j
            blank(i, j)
            i = j
        elif src.startswith("/*", i):
            j = src.find("*/", i + 2)
            if j < 0:
                raise RewriteError(i, "unterminated comment")
            blank(i, j + 2)
            i = j + 2
        elif c == '"':
            m = re.match(r'R"([^(\s]*)\(', src[i - 1:i + 20]) if i > 0 and src[i - 1] == "R" else None
            if m:
                end = src.find(")" + m.group(1) + '"', i)
                if end < 0:
                    raise RewriteError(i, "unterminated raw string")
                blank(i + 1, end + len(m.group(1)) + 1)
                i = end + len(m.group(1)) + 2
                continue
            j = i + 1
            while j < n and src[j] != '"':
                if src[j] == "\\":
                    j += 1
                elif src[j] == "\n":
                    raise RewriteError(i, "unterminated string literal")
                j += 1
            blank(i + 1, j)
            i = j + 1
        elif c == "'":
            k = i - 1
            while k >= 0 and (src[k].isalnum() or src[k] in "'._"):
                k -= 1
            if k + 1 < i and src[k + 1].isdigit():  # a digit separator: 1'000'000
                i += 1
                continue
            j = i + 1
            while j < n and src[j] != "'":
                if src[j] == "\\":
                    j += 1
                j += 1
            blank(i + 1, j)
            i = j + 1
        else:
            i += 1
    return "".join(out)


def match_close(m, i, open_c, close_c):
    """Index of the bracket closing the one at m[i], skipping nested brackets of all kinds."""
    pairs = {"(": ")", "[": "]", "{": "}"}
    stack = [close_c]
    j = i + 1
    while j < len(m):
        c = m[j]
        if c in pairs:
            stack.append(pairs[c])
        elif c in ")]}":
            if c != stack[-1]:
                raise RewriteError(j, "unbalanced brackets")
            stack.pop()
            if not stack:
                return j
        j += 1
    raise RewriteError(i, "no closing '%s'" % close_c)


def split_top(m, a, b):
    """Split m[a:b] at commas outside brackets: list of (start, end)."""
    parts, depth, start = [], 0, a
    for j in range(a, b):
        c = m[j]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append((start, j))
            start = j + 1
    parts.append((start, b))
    return parts


def brace_contexts(m):
    """For each '{' offset: True when it opens code (a function body or a block in one)."""
    ctx, stack = {}, []
    for j, c in enumerate(m):
        if c == "{":
            before = m[max(0, j - 40):j]
            code = bool(stack and stack[-1]) or bool(CODE_BRACE_BEFORE.search(before))
            ctx[j] = code
            stack.append(code)
        elif c == "}" and stack:
            stack.pop()
    return ctx


def in_code(m, ctx, pos):
    depth_code = []
    for j in range(pos):
        c = m[j]
        if c == "{":
            depth_code.append(ctx[j])
        elif c == "}" and depth_code:
            depth_code.pop()
    return any(depth_code)


def kernel_expr_start(m, pos):
    """Start of the kernel expression that ends before the '<<<' at pos."""
    j = pos - 1
    while j >= 0 and m[j].isspace():
        j -= 1
    if j >= 0 and m[j] == ">":  # template arguments
        depth = 0
        while j >= 0:
            if m[j] == ">":
                depth += 1
            elif m[j] == "<":
                depth -= 1
                if depth == 0:
                    break
            j -= 1
        j -= 1
        while j >= 0 and m[j].isspace():
            j -= 1
    while True:
        end = j
        while j >= 0 and (m[j].isalnum() or m[j] == "_"):
            j -= 1
        if j == end or m[j + 1].isdigit():
            raise RewriteError(pos, "cannot find the kernel's name before <<<; launch a named "
                                    "kernel (kernel<<<...>>> or ns::kernel<T><<<...>>>)")
        if j >= 1 and m[j - 1:j + 1] == "::":
            j -= 2
            continue
        return j + 1


def rewrite_launch(src, m, pos):
    """(start, end, replacement) for the launch whose '<<<' is at pos."""
    start = kernel_expr_start(m, pos)
    cfg_end = m.find(">>>", pos + 3)
    if cfg_end < 0:
        raise RewriteError(pos, "<<< without >>>")
    cfg = split_top(m, pos + 3, cfg_end)
    if not 2 <= len(cfg) <= 4 or any(not m[a:b].strip() for a, b in cfg):
        raise RewriteError(pos, "a launch configuration has 2 to 4 parts: grid, block[, shared "
                                "bytes[, stream]]")
    j = cfg_end + 3
    while j < len(m) and m[j].isspace():
        j += 1
    if j >= len(m) or m[j] != "(":
        raise RewriteError(cfg_end, "expected the kernel's arguments after >>>")
    close = match_close(m, j, "(", ")")
    name = re.sub(r"\s+", "", m[start:pos])
    no_args = not m[j + 1:close].strip()
    text = "::cudaemu::launch(%s, ::cudaemu::launch_site{\"%s\", __FILE__, __LINE__}, " \
           "::cudaemu::launch_config(%s)%s" % (
               src[start:pos], name, src[pos + 3:cfg_end], "" if no_args else ", ")
    return start, j + 1, text


DECLARATOR = re.compile(r"^\s*(\**)\s*([A-Za-z_]\w*)\s*((?:\[[^\[\]]*\]\s*)*)$")
ALIGN = re.compile(r"\b(?:__align__|alignas)\s*\(([^()]*)\)")


def rewrite_shared(src, m, pos, line):
    """(start, end, replacement) for the __shared__ declaration at pos."""
    k = pos - 1
    while k >= 0 and m[k] not in ";{}":
        k -= 1
    start = k + 1
    while src[start].isspace():
        start += 1
    end = start
    depth = 0
    while end < len(m):
        c = m[end]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == ";" and depth == 0:
            break
        end += 1
    stmt = m[start:end]
    if "\n" in stmt.strip() and "#" in stmt:
        raise RewriteError(pos, "a preprocessor directive inside a __shared__ declaration")
    if "=" in m[start:end]:
        raise RewriteError(pos, "__shared__ variables cannot have an initializer")
    aligns = ALIGN.findall(stmt)
    align = aligns[0] if aligns else "1"
    body = ALIGN.sub(" ", stmt)
    words = body.split()
    extern = "extern" in words
    body = re.sub(r"\b(?:extern|static|__shared__)\b", " ", body)
    parts = split_top(body, 0, len(body))
    first = parts[0]
    fm = re.search(r"(\**)\s*([A-Za-z_]\w*)\s*((?:\[[^\[\]]*\]\s*)*)$", body[first[0]:first[1]])
    if not fm:
        raise RewriteError(pos, "cannot parse this __shared__ declaration")
    base = body[first[0]:first[0] + fm.start()].strip()
    if not base:
        raise RewriteError(pos, "a __shared__ declaration without a type")
    decls = [(fm.group(1), fm.group(2), fm.group(3))]
    for a, b in parts[1:]:
        d = DECLARATOR.match(body[a:b])
        if not d:
            raise RewriteError(pos, "cannot parse the declarator '%s'" % body[a:b].strip())
        decls.append((d.group(1), d.group(2), d.group(3)))
    out = []
    for stars, name, dims in decls:
        dims = re.sub(r"\s+", "", dims)
        typ = ("%s %s" % (base, stars)).strip()
        if extern:
            if dims != "[]":
                raise RewriteError(pos, "extern __shared__ must be an unsized array: T name[]")
            out.append("%s *const %s = static_cast<%s *>(::cudaemu::dynamic_shared((size_t)(%s) > "
                       "alignof(%s) ? (size_t)(%s) : alignof(%s), __FILE__, __LINE__));"
                       % (typ, name, typ, align, typ, align, typ))
            continue
        if "[]" in dims:
            raise RewriteError(pos, "a __shared__ array needs a size (or extern for dynamic "
                                    "shared memory)")
        slot = "cudaemu_shared_%s_%d" % (name, line)
        out.append("static ::cudaemu::shared_slot %s; auto &%s = ::cudaemu::shared<%s%s>(%s, %s, "
                   "\"%s\", __FILE__, __LINE__);" % (slot, name, typ, dims, slot, align, name))
    newlines = src.count("\n", start, end + 1)
    return start, end + 1, " ".join(out) + "\n" * newlines


def kernel_body_start(m, pos):
    """Offset just after the '{' of the __global__ function at pos, or None (a declaration)."""
    j = pos + len("__global__")
    while j < len(m):
        lb = re.match(r"\s*__launch_bounds__\s*\(", m[j:])
        if lb:
            j = match_close(m, j + lb.end() - 1, "(", ")") + 1
            continue
        if m[j] == "(":
            close = match_close(m, j, "(", ")")
            k = close + 1
            while k < len(m) and m[k].isspace():
                k += 1
            if k < len(m) and m[k] == "{":
                return k + 1
            if k < len(m) and m[k] == ";":
                return None
            raise RewriteError(pos, "cannot find the body of this __global__ function")
        if m[j] in ";{}":
            raise RewriteError(pos, "cannot parse this __global__ function")
        j += 1
    raise RewriteError(pos, "unterminated __global__ function")


def rewrite(src):
    m = mask(src)
    for pattern, why in UNSUPPORTED:
        hit = re.search(pattern, m)
        if hit:
            raise RewriteError(hit.start(), why)
    edits = []
    for hit in re.finditer(r"\b__global__\b", m):
        body = kernel_body_start(m, hit.start())
        if body is not None:
            edits.append((body, body, " CUDAEMU_KERNEL_ENTRY();"))
    ctx = brace_contexts(m)
    for hit in re.finditer(r"\b__shared__\b", m):
        if not in_code(m, ctx, hit.start()):
            raise RewriteError(hit.start(), "__shared__ outside a function (a file-scope shared "
                                            "variable) is not supported; declare it in the kernel")
        line = src.count("\n", 0, hit.start()) + 1
        edits.append(rewrite_shared(src, m, hit.start(), line))
    for hit in re.finditer(r"<<<", m):
        edits.append(rewrite_launch(src, m, hit.start()))
    edits.sort()
    for (a0, b0, _), (a1, _, _) in zip(edits, edits[1:]):
        if a1 < b0:
            raise RewriteError(a1, "overlapping constructs (a launch inside a __shared__ "
                                   "declaration?)")
    out, last = [], 0
    for a, b, text in edits:
        out.append(src[last:a])
        out.append(text)
        last = b
    out.append(src[last:])
    return "".join(out)


def main(argv):
    if len(argv) != 3:
        sys.stderr.write("usage: cu2cc.py IN.cu OUT.cc\n")
        return 2
    path, dest = argv[1], argv[2]
    with open(path, encoding="utf-8") as f:
        src = f.read()
    try:
        body = rewrite(src)
    except RewriteError as e:
        line = src.count("\n", 0, e.pos) + 1
        col = e.pos - (src.rfind("\n", 0, e.pos) + 1) + 1
        sys.stderr.write("%s:%d:%d: error: cu2cc: %s\n" % (path, line, col, e))
        return 1
    text = ("// Generated from %s by tests/cudaemu/cu2cc.py for the CUDA emulation: do not edit.\n"
            "#line 1 \"%s\"\n%s" % (path, path, body))
    tmp = dest + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, dest)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
