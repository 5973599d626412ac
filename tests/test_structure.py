"""Structure rules for ``tandem/``, checked on the source with ``ast`` (nothing is imported but in (d)).

(a) The module import graph has no cycle. Imports inside functions count (a lazy import is still a
    dependency, just a hidden one); imports under ``if TYPE_CHECKING:`` do not (they never run).
(b) Only ``tandem/config/env.py`` reads the environment (``os.environ``, ``os.getenv``, ``environ``).
(c) No file is over 500 lines unless its module docstring has a line ``Over 500 lines: <reason>``.
(d) The user-facing entry points import on a CPU install, where ``import triton`` fails.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tandem"
MAX_LINES = 500
ENV_MODULE = "tandem.config.env"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_files() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


# ---- (a) import graph -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_imports(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement under ``node`` (functions included) except in ``if TYPE_CHECKING:`` bodies."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.orelse:  # the else branch does run
                if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                    yield stmt
                yield from _runtime_imports(stmt)
            continue
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        yield from _runtime_imports(child)


def _containing(name: str, modules: set[str]) -> str | None:
    """``name`` if it is a module, else its longest prefix that is (``tandem.x.Class`` -> ``tandem.x``)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def _absolute(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    if node.level == 0:
        return node.module or ""
    base = importer.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def module_edges(mod: str, tree: ast.Module, is_package: bool, modules: set[str]) -> list[Edge]:
    """The tandem modules that ``mod`` imports when it runs (or when one of its functions does)."""
    edges = []
    for node in _runtime_imports(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = _absolute(node, mod, is_package)
            # `from tandem.x import y`: the module tandem.x.y if there is one, else tandem.x.
            targets = [f"{base}.{alias.name}" for alias in node.names if alias.name != "*"] or [base]
        for target in targets:
            resolved = _containing(target, modules) if target.split(".")[0] == "tandem" else None
            if resolved is not None and resolved != mod:
                edges.append(Edge(mod, resolved, node.lineno))
    return edges


def import_edges(files: dict[str, Path]) -> list[Edge]:
    modules = set(files)
    return [e for mod, path in files.items()
            for e in module_edges(mod, parse(path), path.name == "__init__.py", modules)]


def find_cycles(edges: list[Edge]) -> list[list[str]]:
    """A shortest cycle per strongly connected component of more than one module (Tarjan, iterative).

    Each cycle starts and ends at the component's first module; :func:`strongly_connected` gives
    every module of the component (breaking the cycle shown may leave others in it).
    """
    graph = _graph(edges)
    return [_one_cycle(comp, graph) for comp in strongly_connected(edges)]


def _graph(edges: list[Edge]) -> dict[str, list[str]]:
    graph: dict[str, list[str]] = {}
    for e in edges:
        graph.setdefault(e.source, []).append(e.target)
        graph.setdefault(e.target, [])
    return graph


def strongly_connected(edges: list[Edge]) -> list[list[str]]:
    """The strongly connected components of more than one module, each sorted."""
    graph = _graph(edges)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    comp.append(top)
                    if top == node:
                        break
                if len(comp) > 1:
                    components.append(sorted(comp))
    return components


def _one_cycle(component: list[str], graph: dict[str, list[str]]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first, inside the component)."""
    members = set(component)
    start = component[0]
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(graph[node]):
                if child not in members:
                    continue
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if child not in parent:
                    parent[child] = node
                    nxt.append(child)
        frontier = nxt
    return component  # unreachable for a true component


def describe_cycle(cycle: list[str], edges: list[Edge], files: dict[str, Path]) -> str:
    members = next(c for c in strongly_connected(edges) if cycle[0] in c)
    lines = [" -> ".join(cycle), f"    (modules importing each other here: {', '.join(members)})"]
    for a, b in zip(cycle, cycle[1:]):
        where = sorted({e.line for e in edges if e.source == a and e.target == b})
        rel = files[a].relative_to(ROOT)
        lines.append(f"    {rel}:{','.join(map(str, where))} imports {b}")
    return "\n".join(lines)


def test_import_graph_has_no_cycle() -> None:
    files = source_files()
    edges = import_edges(files)
    cycles = find_cycles(edges)
    assert not cycles, "import cycles in tandem/ (move the shared code to a lower module):\n" + "\n".join(
        describe_cycle(c, edges, files) for c in cycles)


def test_cycle_finder_finds_and_names_a_cycle() -> None:
    # The checker itself: a lazy import inside a function counts, a TYPE_CHECKING one does not.
    src = {
        "tandem.a": "from tandem.b import f\n",
        "tandem.b": "def f():\n    from tandem import c\n",
        "tandem.c": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from tandem.d import x\n"
                    "import tandem.a\n",
        "tandem.d": "import tandem.c\n",
    }
    edges = [e for mod, text in src.items() for e in module_edges(mod, ast.parse(text), False, set(src))]
    assert find_cycles(edges) == [["tandem.a", "tandem.b", "tandem.c", "tandem.a"]]


# ---- (b) environment ---------------------------------------------------------------------------------------

_ENV_ATTRS = frozenset({"environ", "environb", "getenv", "getenvb"})


def env_reads(tree: ast.Module) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in _ENV_ATTRS:
            lines.append(node.lineno)
        elif isinstance(node, ast.Name) and node.id in _ENV_ATTRS:
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "os" and any(
                a.name in _ENV_ATTRS for a in node.names):
            lines.append(node.lineno)
    return sorted(set(lines))


def test_only_config_env_reads_the_environment() -> None:
    bad = [f"{path.relative_to(ROOT)}:{line}" for mod, path in source_files().items() if mod != ENV_MODULE
           for line in env_reads(parse(path))]
    assert not bad, ("environment read outside tandem/config/env.py (add a function there and call it; "
                     "behaviour belongs in tandem/config/):\n  " + "\n  ".join(bad))


def test_env_checker_sees_every_spelling() -> None:
    src = "import os\nfrom os import getenv\na = os.environ.get('X')\nb = os.getenv('Y')\nc = environ['Z']\n"
    assert env_reads(ast.parse(src)) == [2, 3, 4, 5]


# ---- (c) file length ---------------------------------------------------------------------------------------


def over_limit_without_reason() -> dict[str, int]:
    out = {}
    for path in source_files().values():
        n = len(path.read_text(encoding="utf-8").splitlines())
        if n <= MAX_LINES:
            continue
        doc = ast.get_docstring(parse(path)) or ""
        if not any(line.strip().startswith("Over 500 lines:") for line in doc.splitlines()):
            out[str(path.relative_to(ROOT))] = n
    return out


def test_no_file_over_500_lines_without_a_reason() -> None:
    bad = over_limit_without_reason()
    listing = "\n  ".join(f"{p} ({n} lines)" for p, n in bad.items())
    assert not bad, ("files over 500 lines: split them along a seam, or give the reason in the module docstring "
                     f"on a line starting 'Over 500 lines:':\n  {listing}")


# ---- (d) CPU installs: no triton -----------------------------------------------------------------------------

ENTRY_POINTS = ("tandem", "tandem.engine.llm", "tandem.cli", "tandem.server.api", "tandem.bench.cli")


def test_entry_points_import_without_triton() -> None:
    code = textwrap.dedent(f"""
        import importlib, sys, traceback
        sys.modules["triton"] = None  # `import triton` now raises ImportError, as on a CPU-only install
        failed = []
        for name in {ENTRY_POINTS!r}:
            try:
                importlib.import_module(name)
            except Exception:
                failed.append(name + ":\\n" + traceback.format_exc())
        if not failed:
            try:
                sys.modules["tandem.cli"].build_parser().parse_args(["generate", "hi"])
            except Exception:
                failed.append("tandem.cli.build_parser:\\n" + traceback.format_exc())
        print("\\n".join(failed))
        sys.exit(1 if failed else 0)
        """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, (
        f"entry points need triton (CPU installs have none):\n{proc.stdout}{proc.stderr[-3000:]}")
