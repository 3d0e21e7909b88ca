#!/usr/bin/env python3
"""Fails when the crate's modules import each other in a circle (issue 26).

Reads every file under src/, takes the paths it names (`crate::a::b`,
`super::x`, `self::y` in `use` lines and in code), resolves each to the module
file that defines it, and reports every strongly connected component of more
than one file. Test modules (`#[cfg(test)] mod ... { ... }` at the end of a
file) are left out: a unit test may use what it likes.

    python3 scripts/module-cycles.py          # exit 1 and the circles, or 0
    python3 scripts/module-cycles.py --graph  # every file's imports
"""
import os
import re
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")


def module_of(path):
    """src/a/b.rs -> ('a', 'b'); src/a/mod.rs -> ('a',); src/lib.rs -> ()."""
    rel = os.path.relpath(path, ROOT)[:-3].split(os.sep)
    if rel[-1] == "mod":
        rel = rel[:-1]
    if rel in (["lib"], ["main"]):
        return ()
    return tuple(rel)


def strip_tests(text):
    m = re.search(r"^#\[cfg\(test\)\]\s*\n\s*(pub(\(crate\))? )?mod \w+\s*\{", text, re.M)
    return text[: m.start()] if m else text


def strip_comments(text):
    text = re.sub(r"//[^\n]*", "", text)
    return re.sub(r"/\*.*?\*/", "", text, flags=re.S)


def expand_use(body):
    """`a::{b, c::{d, e}}` -> ['a::b', 'a::c::d', 'a::c::e'] (enough for paths)."""
    body = re.sub(r"\s+", "", body)
    out = []

    def walk(prefix, s):
        depth, start, parts = 0, 0, []
        for i, ch in enumerate(s):
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
            elif ch == "," and depth == 0:
                parts.append(s[start:i])
                start = i + 1
        parts.append(s[start:])
        for p in parts:
            if not p:
                continue
            if "{" in p:
                head, rest = p.split("{", 1)
                walk(prefix + head, rest[: rest.rfind("}")])
            else:
                out.append(prefix + p)

    walk("", body)
    return out


def main():
    files = {}
    for dirpath, _, names in os.walk(ROOT):
        for n in names:
            if n.endswith(".rs"):
                p = os.path.join(dirpath, n)
                files[module_of(p)] = p
    modules = set(files)

    def resolve(here, path):
        segs = [s for s in path.split("::") if s]
        if not segs:
            return None
        if segs[0] == "crate":
            base, segs = (), segs[1:]
        elif segs[0] in ("super", "self"):
            base = here
            while segs and segs[0] in ("super", "self"):
                if segs[0] == "super":
                    base = base[:-1]
                segs = segs[1:]
        else:
            return None
        # The longest prefix that is a module file.
        best = None
        for k in range(len(segs) + 1):
            cand = base + tuple(segs[:k])
            if cand in modules:
                best = cand
        return best

    graph = {m: set() for m in modules}
    for m, p in files.items():
        with open(p, encoding="utf-8") as f:
            text = strip_comments(strip_tests(f.read()))
        paths = []
        for u in re.finditer(r"\buse\s+([^;]+);", text):
            paths.extend(expand_use(u.group(1)))
        paths.extend(re.findall(r"\b((?:crate|super|self)(?:::\w+)+)", text))
        for path in paths:
            t = resolve(m, path)
            # A module's own children and itself are not imports of it.
            if t is None or t == m or t[: len(m)] == m and m != ():
                continue
            # The crate root (lib.rs) only declares modules.
            if t == ():
                continue
            graph[m].add(t)

    name = lambda m: "::".join(m) or "lib"
    if "--graph" in sys.argv:
        for m in sorted(graph):
            print(f"{name(m)}: {', '.join(sorted(name(t) for t in graph[m]))}")
        return 0

    # Tarjan's strongly connected components.
    index, low, on, stack, comps, counter = {}, {}, set(), [], [], [0]
    sys.setrecursionlimit(10000)

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    if not comps:
        print(f"module-cycles: {len(graph)} modules, no import circle")
        return 0
    for c in comps:
        members = sorted(c)
        print(f"import circle of {len(members)} modules: {', '.join(name(m) for m in members)}")
        for m in members:
            inside = sorted(name(t) for t in graph[m] if t in c)
            print(f"  {name(m)} -> {', '.join(inside)}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
