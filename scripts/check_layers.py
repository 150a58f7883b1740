#!/usr/bin/env python3
"""Check Shoal's import graph and layers (stdlib only): `python scripts/check_layers.py [--json]`.

Every .py file under shoal/, peer/ and coordinator/ is parsed (peer/x.py is shoal.peer.x,
coordinator/x.py is shoal.coordinator.x, as pyproject.toml maps them), and EVERY import
statement is collected, at module level or inside functions and branches: a lazy import is
still a dependency, so it must not dodge the check. `importlib.import_module("...")` and
`__import__("...")` with a literal name count too. Rules:

- layers: base (shoal.v1.*, shoal.common.*) imports only base; the shared protocols
  (SHARED_PROTOCOLS: the relay's wire protocol, which the peer and the relay daemon both speak)
  import only base, and every layer but base may import them; shoal.peer.* (with its workloads
  and testing packages) imports base, the shared protocols and shoal.peer.*; shoal.coordinator.*
  imports base, the shared protocols and shoal.coordinator.*. The top layers may import anything:
  the relay daemon (shoal.relay.*) except the peer and the coordinator, the test beds
  (shoal.testbeds.*), the benchmarks (shoal.bench.*) and the rest of shoal.* (the CLI, config,
  plots). The namespace root `shoal` (shoal/__init__.py) imports no shoal module, so anyone may
  import it.
- no import cycles among shoal modules (a package's __init__ is an edge only where a file
  imports it by name; the parent packages Python loads implicitly are not edges);
- the coordinator's engine (ENGINE_MODULES) imports, also transitively through shoal modules,
  no grpc and no data-plane module;
- no function or method (nested ones count inside their parent too) longer than
  MAX_FUNCTION_LINES lines in LENGTH_CHECKED_MODULES (modules not written yet are skipped).

Prints one line per violation and the longest functions of the length-checked modules; exits 1
on any violation, 0 when clean. `--root DIR` checks another tree (the tests use it).
"""

from __future__ import annotations

import argparse
import ast
import json
import pathlib
import sys
from dataclasses import asdict, dataclass, field

MAX_FUNCTION_LINES = 80
# The coordinator's engine: pure decisions, driven by and tested without the network.
ENGINE_MODULES = (
    "shoal.coordinator.rounds",
    "shoal.coordinator.member_table",
    "shoal.coordinator.sync_orders",
    "shoal.coordinator.attempt",
    "shoal.coordinator.settings",
    "shoal.coordinator.planner",
)
LENGTH_CHECKED_MODULES = (
    "shoal.peer.rounds",  # the peer-side round protocol
    "shoal.peer.agent",
    "shoal.peer.collectives",
    *ENGINE_MODULES,
    # the data plane's lanes (peer/lanes)
    "shoal.peer.lanes.base",
    "shoal.peer.lanes.network",
    "shoal.peer.lanes.streams",
    "shoal.peer.lanes.shm",
    "shoal.peer.lanes.bulk",
    "shoal.peer.lanes.relay",
    "shoal.peer.lanes.memory",
)
LONGEST_SHOWN = 5
# Third-party top-level names the engine must not reach: grpc itself and its grpc_* companions.
ENGINE_FORBIDDEN_PREFIX = "grpc"
# Data-plane modules (tensor payloads, peer to peer): the peer package and the wire format of
# tensors. The coordinator "never touches tensor payloads".
DATA_PLANE = ("shoal.peer", "shoal.common.tensors")
# Source folder (relative to the repository root) -> the package it holds.
SOURCE_ROOTS = {"shoal": "shoal", "peer": "shoal.peer", "coordinator": "shoal.coordinator"}
ROOT_PACKAGE = "shoal"
BASE = ("shoal.v1", "shoal.common")
# Wire protocols of a top-layer daemon that a side speaks too: modules (and the bare package they
# sit in, whose __init__ imports nothing), importing only base.
SHARED_PROTOCOLS = ("shoal.relay", "shoal.relay.protocol")
SIDES = ("shoal.peer", "shoal.coordinator")
# Named top layers: package -> the layers it must not import (every other top module: "top").
TOP_LAYERS = {
    "shoal.relay": ("shoal.peer", "shoal.coordinator"),  # the relay daemon
    "shoal.testbeds": (),  # swarm, scenario, netbed
    "shoal.bench": (),  # benchmarks and their worker processes
}


def _under(module: str, prefixes: tuple[str, ...] | str) -> bool:
    if isinstance(prefixes, str):
        prefixes = (prefixes,)
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def layer_of(module: str) -> str:
    if module == ROOT_PACKAGE:
        return "root"
    if _under(module, BASE):
        return "base"
    if module in SHARED_PROTOCOLS:
        return "protocol"
    for side in SIDES:
        if _under(module, side):
            return side
    for top in TOP_LAYERS:
        if _under(module, top):
            return top
    return "top"


def allowed(importer: str, imported: str) -> bool:
    """Whether the layer of `importer` may import `imported` (both shoal modules)."""
    src, dst = layer_of(importer), layer_of(imported)
    if src == "root":
        return False  # the namespace root imports nothing of shoal
    if dst == "root":
        return True
    if src == "base":
        return dst == "base"
    if src == "protocol":
        return dst in ("base", "protocol")
    if src in SIDES:
        return dst in ("base", "protocol", src)  # a side: base, the shared protocols and itself
    return dst not in TOP_LAYERS.get(src, ())  # a top layer: anything but what it must not reach


@dataclass
class Import:
    module: str  # the resolved module (shoal) or the dotted name (third party)
    line: int
    lazy: bool  # inside a function


@dataclass
class ModuleInfo:
    name: str
    path: str
    imports: list[Import] = field(default_factory=list)
    functions: list[tuple[str, int, int]] = field(default_factory=list)  # (qualname, first line, length)


@dataclass
class Violation:
    rule: str  # layer | root | cycle | engine | length | unresolved | syntax
    module: str
    detail: str
    line: int = 0


def discover(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """Module name -> file, for every .py file under the source roots."""
    found: dict[str, pathlib.Path] = {}
    for folder, package in SOURCE_ROOTS.items():
        base = root / folder
        if not base.is_dir():
            continue
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(base).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join([package, *parts])
            # shoal/peer/x.py would shadow peer/x.py: setuptools maps shoal.peer to peer/ only.
            if folder == ROOT_PACKAGE and any(_under(name, p) for p in SOURCE_ROOTS.values() if p != ROOT_PACKAGE):
                continue
            found[name] = path
    return found


class _Collector(ast.NodeVisitor):
    """Every import (with its line and whether it sits in a function) and every function length."""

    def __init__(self, module: str, is_package: bool, modules: set[str]):
        self.package = module if is_package else module.rpartition(".")[0]
        self.modules = modules
        self.imports: list[Import] = []
        self.functions: list[tuple[str, int, int]] = []
        self.unresolved: list[tuple[int, str]] = []
        self._scope: list[str] = []
        self._depth = 0  # functions enclosing the current node

    def _add(self, name: str, line: int) -> None:
        self.imports.append(Import(name, line, self._depth > 0))

    def _absolute(self, level: int, name: str | None, line: int) -> str | None:
        if level == 0:
            return name
        parts = self.package.split(".") if self.package else []
        if level - 1 >= len(parts):  # Python: "attempted relative import beyond top-level package"
            self.unresolved.append((line, "." * level + (name or "")))
            return None
        base = parts[: len(parts) - (level - 1)]
        return ".".join([*base, *([name] if name else [])])

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        source = self._absolute(node.level, node.module, node.lineno)
        if source is None:
            return
        for alias in node.names:
            sub = f"{source}.{alias.name}"
            # `from a.b import c` is a dependency on module a.b.c if there is one, else on a.b.
            self._add(sub if alias.name != "*" and sub in self.modules else source, node.lineno)

    def visit_Call(self, node: ast.Call) -> None:
        f = node.func
        dynamic = (isinstance(f, ast.Name) and f.id in ("__import__", "import_module")) or (
            isinstance(f, ast.Attribute) and f.attr == "import_module")
        if dynamic and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            self._add(node.args[0].value, node.lineno)
        self.generic_visit(node)

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self._scope.append(node.name)
        assert node.end_lineno is not None
        self.functions.append((".".join(self._scope), node.lineno, node.end_lineno - node.lineno + 1))
        self._depth += 1
        self.generic_visit(node)
        self._depth -= 1
        self._scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = _function

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self._scope.append(node.name)
        self.generic_visit(node)
        self._scope.pop()


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative (no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        m = stack.pop()
                        on_stack.discard(m)
                        component.append(m)
                        if m == node:
                            break
                    out.append(sorted(component))
    return out


def _chain(parents: dict[str, str | None], module: str) -> list[str]:
    path = [module]
    while (p := parents[path[-1]]) is not None:
        path.append(p)
    return path[::-1]


def check(root: pathlib.Path) -> dict:
    """The report for the tree at `root`: modules, violations, longest functions."""
    files = discover(root)
    names = set(files)
    infos: dict[str, ModuleInfo] = {}
    violations: list[Violation] = []
    for name, path in files.items():
        info = ModuleInfo(name, str(path.relative_to(root)))
        infos[name] = info
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        except SyntaxError as e:
            violations.append(Violation("syntax", name, f"does not parse: {e.msg}", e.lineno or 0))
            continue
        c = _Collector(name, path.name == "__init__.py", names)
        c.visit(tree)
        info.imports, info.functions = c.imports, c.functions
        for line, text in c.unresolved:
            violations.append(Violation("unresolved", name, f"relative import {text} goes above the top package", line))

    graph: dict[str, set[str]] = {n: set() for n in infos}
    for name, info in infos.items():
        for imp in info.imports:
            if not _under(imp.module, ROOT_PACKAGE):
                continue
            how = "lazily imports" if imp.lazy else "imports"
            if imp.module not in names:
                violations.append(Violation("unresolved", name, f"{how} {imp.module}, which is no module here",
                                            imp.line))
                continue
            graph[name].add(imp.module)  # a module importing itself is a self-loop, reported below
            if layer_of(name) == "root":
                violations.append(Violation("root", name, f"the namespace root {how} {imp.module}", imp.line))
            elif not allowed(name, imp.module):
                violations.append(Violation(
                    "layer", name, f"{how} {imp.module} ({layer_of(name)} may not import {layer_of(imp.module)})",
                    imp.line))

    for component in _strongly_connected(graph):
        if len(component) > 1 or component[0] in graph[component[0]]:
            violations.append(Violation("cycle", component[0], "import cycle: " + " <-> ".join(component)))

    for engine in ENGINE_MODULES:
        if engine not in infos:
            continue
        parents: dict[str, str | None] = {engine: None}
        queue = [engine]
        while queue:
            m = queue.pop(0)
            for imp in infos[m].imports:
                top = imp.module.split(".")[0]
                if top == ENGINE_FORBIDDEN_PREFIX or top.startswith(ENGINE_FORBIDDEN_PREFIX + "_"):
                    via = " -> ".join(_chain(parents, m))
                    violations.append(Violation("engine", engine, f"reaches {imp.module} ({via}, line {imp.line})"))
                    break  # one line per offending module is enough
            for dep in sorted(graph[m]):
                if dep not in parents:
                    parents[dep] = m
                    queue.append(dep)
                    if _under(dep, DATA_PLANE):
                        violations.append(Violation(
                            "engine", engine, f"reaches data-plane module {dep} ({' -> '.join(_chain(parents, dep))})"))

    longest: dict[str, list[dict]] = {}
    skipped = [m for m in LENGTH_CHECKED_MODULES if m not in infos]  # not written yet
    for module in LENGTH_CHECKED_MODULES:
        if module in skipped:
            continue
        fns = infos[module].functions
        for qualname, line, length in fns:
            if length > MAX_FUNCTION_LINES:
                violations.append(Violation(
                    "length", module, f"{qualname} is {length} lines (limit {MAX_FUNCTION_LINES})", line))
        top = sorted(fns, key=lambda f: (-f[2], f[1]))[:LONGEST_SHOWN]
        longest[module] = [{"function": q, "line": ln, "lines": n} for q, ln, n in top]

    return {
        "modules": len(infos),
        "imports": sum(len(i.imports) for i in infos.values()),
        "violations": [asdict(v) for v in violations],
        "longest_functions": longest,
        "length_check_skipped": skipped,
    }


def render(report: dict) -> str:
    lines = [f"check_layers: {report['modules']} modules, {report['imports']} imports"]
    for v in report["violations"]:
        where = f"{v['module']}:{v['line']}" if v["line"] else v["module"]
        lines.append(f"{v['rule'].upper():10} {where}: {v['detail']}")
    lines.append(f"longest functions (limit {MAX_FUNCTION_LINES} lines):")
    for module, fns in report["longest_functions"].items():
        lines.append(f"  {module}: " + ", ".join(f"{f['function']} {f['lines']}" for f in fns))
    for module in report["length_check_skipped"]:
        lines.append(f"  {module}: not present, skipped")
    n = len(report["violations"])
    lines.append(f"{n} violation{'s' if n != 1 else ''}" if n else "clean")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--root", type=pathlib.Path, default=pathlib.Path(__file__).resolve().parent.parent,
                        help="repository root (default: this script's repository)")
    args = parser.parse_args(argv)
    report = check(args.root)
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 1 if report["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
