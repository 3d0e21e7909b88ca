#!/usr/bin/env python3
"""Fails when modules import each other in a circle (issues 26 and 40).

Three packages, each read on its own:

- the Rust crate, `src/`: every file's paths (`crate::a::b`, `super::x`,
  `self::y`, in `use` lines and in code), each resolved to the module file that
  defines it. Test modules (`#[cfg(test)] mod ... { ... }` at the end of a
  file) are left out: a unit test may use what it likes. The crate root
  (lib.rs, main.rs) only declares modules and is no one's import. A module's
  use of its own children (`use child::X`, `child::f()`, a re-export) counts;
  a child's use of its parent (`super::X`) does not: an import through a
  re-export is an import of the re-exporting module, and of the file behind it
  (issue 44: a 12-file circle closed through `queue/mod.rs` using `deliver`).
- the Python client, `clients/python/src/`: every `import` and `from ... import`
  of the package's own modules, relative (`from .x import y`, `from . import x`)
  or absolute (`from fencegate_client.x import y`), wherever it stands: inside a
  function, or under `if TYPE_CHECKING:`. A package's `__init__.py` is a module
  like the others (a submodule importing the package imports it back).
- the TypeScript client, `clients/typescript/src/`: every relative module
  specifier (`"./x"`, `"../x"`, with or without `.js`) in `import … from`,
  `export … from`, `import "…"`, `import(…)` and `require(…)`. Type-only imports
  (`import type`, `import { type X }`) count as well: they do not make a runtime
  circle, but the modules still cannot be read or changed one without the
  other.

Each strongly connected component of more than one file is reported, under the
package it is in.

    python3 scripts/module-cycles.py          # exit 1 and the circles, or 0
    python3 scripts/module-cycles.py --graph  # every file's imports, per package
"""
import ast
import os
import re
import sys

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")

# ---- Rust: src/


def rust_graph(root):
    def module_of(path):
        """src/a/b.rs -> ('a', 'b'); src/a/mod.rs -> ('a',); src/lib.rs -> ()."""
        rel = os.path.relpath(path, root)[:-3].split(os.sep)
        if rel[-1] == "mod":
            rel = rel[:-1]
        if rel in (["lib"], ["main"]):
            return ()
        return tuple(rel)

    files = {}
    for dirpath, _, names in os.walk(root):
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
        elif here + (segs[0],) in modules:
            # A child module named without `self::` (`use routes::Route`).
            base = here
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
            text = rust_strip_comments(rust_strip_tests(f.read()))
        paths = []
        for u in re.finditer(r"\buse\s+([^;]+);", text):
            paths.extend(rust_expand_use(u.group(1)))
        paths.extend(re.findall(r"\b((?:crate|super|self)(?:::\w+)+)", text))
        # A child module named in code without `self::` (`deliver::run(…)`).
        paths.extend(
            p
            for p in re.findall(r"(?<![:\w])([a-z_]\w*(?:::\w+)+)", text)
            if m + (p.split("::")[0],) in modules
        )
        for path in paths:
            t = resolve(m, path)
            # Itself and its ancestors are not imports (a child using its
            # parent's items is the parent's own code spread over files); its
            # descendants are: a parent that uses or re-exports a child needs
            # it, so an import of a name through a re-export (`proxy::Route`
            # for `proxy::routes::Route`) reaches the defining file through the
            # re-exporting one, and a circle closing that way is found.
            if t is None or t == m or m[: len(t)] == t:
                continue
            # The crate root (lib.rs) only declares modules.
            if t == ():
                continue
            graph[m].add(t)
    return {"::".join(m) or "lib": {"::".join(t) for t in ts} for m, ts in graph.items()}


def rust_strip_tests(text):
    m = re.search(r"^#\[cfg\(test\)\]\s*\n\s*(pub(\(crate\))? )?mod \w+\s*\{", text, re.M)
    return text[: m.start()] if m else text


def rust_strip_comments(text):
    text = re.sub(r"//[^\n]*", "", text)
    return re.sub(r"/\*.*?\*/", "", text, flags=re.S)


def rust_expand_use(body):
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


# ---- Python: clients/python/src/


def python_graph(root):
    """Modules are the .py files of the packages under `root` (directories with
    an __init__.py, all the way down from `root`), named `pkg.sub.mod`."""
    files = {}  # name -> (path, is a package's __init__)
    for dirpath, dirnames, names in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        parts = () if rel == "." else tuple(rel.split(os.sep))
        if parts and "__init__.py" not in names:
            dirnames[:] = []
            continue
        dirnames[:] = sorted(d for d in dirnames if d.isidentifier())
        for n in names:
            if not n.endswith(".py"):
                continue
            if n == "__init__.py":
                if parts:
                    files[parts] = (os.path.join(dirpath, n), True)
            else:
                files[parts + (n[:-3],)] = (os.path.join(dirpath, n), False)
    modules = set(files)

    def ours(segs):
        """The longest prefix of `segs` that is one of the modules."""
        for k in range(len(segs), 0, -1):
            if segs[:k] in modules:
                return segs[:k]
        return None

    graph = {m: set() for m in modules}
    for m, (p, is_init) in files.items():
        with open(p, encoding="utf-8") as f:
            tree = ast.parse(f.read(), p)
        targets = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets.extend(ours(tuple(a.name.split("."))) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    package = m if is_init else m[:-1]
                    if node.level - 1 >= len(package):  # beyond the top-level package
                        continue
                    base = package[: len(package) - (node.level - 1)]
                else:
                    base = ()
                base += tuple(node.module.split(".")) if node.module else ()
                for a in node.names:
                    # `from pkg import mod` names a module; `from pkg import name` the package.
                    targets.append(ours(base + (a.name,)) or ours(base))
        graph[m] = {t for t in targets if t is not None and t != m}
    return {".".join(m): {".".join(t) for t in ts} for m, ts in graph.items()}


# ---- TypeScript: clients/typescript/src/

TS_EXTS = (".ts", ".tsx", ".mts", ".cts")
# After these (the previous non-blank character of code), a `/` starts a regular expression.
REGEX_BEFORE = set("(,=:[!&|?{};+-*%<>~^") | {""}
REGEX_AFTER_WORD = {"return", "typeof", "case", "do", "else", "in", "of", "new", "delete", "void", "throw", "yield", "await"}


def ts_code(text):
    """The code with comments removed and each string or template literal
    replaced by `\\0<n>\\0`; returns (code, the literals' contents)."""
    out, strings, i, n = [], [], 0, len(text)

    def prev():
        s = "".join(out[-64:]).rstrip()
        if not s:
            return ""
        w = re.search(r"[A-Za-z_$][\w$]*$", s)
        return w.group(0) if w else s[-1]

    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            i = n if j < 0 else j + 2
            out.append(" ")
        elif c in "\"'`":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            strings.append(text[i + 1: j])
            out.append(f"\0{len(strings) - 1}\0")
            i = j + 1
        elif c == "/" and (prev() in REGEX_BEFORE or prev() in REGEX_AFTER_WORD):
            j, in_class = i + 1, False
            while j < n and text[j] != "\n" and (in_class or text[j] != "/"):
                if text[j] == "\\":
                    j += 1
                elif text[j] == "[":
                    in_class = True
                elif text[j] == "]":
                    in_class = False
                j += 1
            out.append("/regex/")
            i = j + 1
        else:
            out.append(c)
            i += 1
    return "".join(out), strings


TS_SPECIFIERS = [
    # import x from "…", import { a, type B } from "…", import type X from "…",
    # export { a } from "…", export * as ns from "…"
    re.compile(r"\b(?:import|export)\s+(?:type\s+)?[\w$\s{},*]*?\bfrom\s*\0(\d+)\0"),
    re.compile(r"\bimport\s*\0(\d+)\0"),  # import "…" (for its effects)
    re.compile(r"\b(?:import|require)\s*\(\s*\0(\d+)\0\s*\)"),  # import("…"), require("…")
]


def ts_graph(root):
    """Modules are the .ts files under `root`, named by their path from it
    without the extension (`lease`, `sub/index`)."""
    files = {}
    for dirpath, dirnames, names in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != "node_modules" and not d.startswith("."))
        for n in names:
            if n.endswith(TS_EXTS):
                p = os.path.normpath(os.path.join(dirpath, n))
                name = os.path.relpath(p, root)
                name = name[:-5] if name.endswith(".d.ts") else os.path.splitext(name)[0]
                files[p] = name.replace(os.sep, "/")

    def resolve(here, spec):
        if not spec.startswith(("./", "../")) and spec not in (".", ".."):
            return None
        base = os.path.normpath(os.path.join(os.path.dirname(here), spec))
        stem = re.sub(r"\.(?:[mc]?js|[mc]?ts|tsx|jsx)$", "", base)
        for cand in [base] + [stem + e for e in TS_EXTS + (".d.ts",)] + [
                os.path.join(base, "index" + e) for e in TS_EXTS]:
            if cand in files:
                return files[cand]
        return None

    graph = {name: set() for name in files.values()}
    for p, name in files.items():
        with open(p, encoding="utf-8") as f:
            code, strings = ts_code(f.read())
        for pattern in TS_SPECIFIERS:
            for m in pattern.finditer(code):
                t = resolve(p, strings[int(m.group(1))])
                if t is not None and t != name:
                    graph[name].add(t)
    return graph


# ---- the circles


def circles(graph):
    """Tarjan's strongly connected components of more than one module."""
    index, low, on, stack, comps, counter = {}, {}, set(), [], [], [0]
    sys.setrecursionlimit(10000)

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
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
                comps.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return comps


PACKAGES = [
    ("src/ (the crate)", "src", rust_graph),
    ("clients/python", os.path.join("clients", "python", "src"), python_graph),
    ("clients/typescript", os.path.join("clients", "typescript", "src"), ts_graph),
]


def main():
    failed = False
    for label, rel, build in PACKAGES:
        root = os.path.normpath(os.path.join(REPO, rel))
        if not os.path.isdir(root):
            print(f"module-cycles: {label}: no {rel}/", file=sys.stderr)
            failed = True
            continue
        graph = build(root)
        if "--graph" in sys.argv:
            print(f"# {label}")
            for m in sorted(graph):
                print(f"{m}: {', '.join(sorted(graph[m]))}")
            continue
        comps = circles(graph)
        if not comps:
            print(f"module-cycles: {label}: {len(graph)} modules, no import circle")
            continue
        failed = True
        for c in comps:
            print(f"module-cycles: {label}: import circle of {len(c)} modules: {', '.join(c)}")
            for m in c:
                print(f"  {m} -> {', '.join(sorted(t for t in graph[m] if t in c))}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
