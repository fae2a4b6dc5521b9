"""The include graph of src/'s folders (docs/architecture.md): which folder's files include which
other folder's headers. Prints one line per folder and exits 1 when the graph has a circle (two
folders that reach each other), naming the includes on it.

usage: include_graph.py SRC_DIR
"""
import collections
import os
import re
import sys


def folder_graph(src):
    """{folder: {folder it includes from}} and, per (from, to), the includes that make the edge."""
    deps, why = collections.defaultdict(set), collections.defaultdict(list)
    for root, _, names in os.walk(src):
        for name in sorted(names):
            if not name.endswith((".c", ".h")):
                continue
            path = os.path.join(root, name)
            here = os.path.relpath(root, src)
            here = "main" if here == "." else here
            with open(path, encoding="utf-8") as f:
                for inc in re.findall(r'#include "([^"]+)"', f.read()):
                    to = "gpu" if inc.split("/")[-2:-1] == ["gpu"] else os.path.dirname(inc)
                    if to and to != here:
                        deps[here].add(to)
                        why[(here, to)].append(f"{os.path.relpath(path, src)} includes {inc}")
    return deps, why


def reaches(deps, a, b):
    seen, todo = set(), [a]
    while todo:
        for n in deps.get(todo.pop(), ()):
            if n == b:
                return True
            if n not in seen:
                seen.add(n)
                todo.append(n)
    return False


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__.strip())
    deps, why = folder_graph(sys.argv[1])
    for d in sorted(deps):
        print(f"{d:10s} -> {' '.join(sorted(deps[d]))}")
    circles = [(a, b) for a in sorted(deps) for b in sorted(deps[a]) if reaches(deps, b, a)]
    for a, b in circles:
        print(f"circle: {a} -> {b} ({'; '.join(why[(a, b)][:3])})")
    return 1 if circles else 0


if __name__ == "__main__":
    sys.exit(main())
