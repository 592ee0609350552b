"""The tree shows the architecture: no import cycle between modules, and the map in
docs/architecture.md names exactly the modules that exist.

Both module-level and function-level imports count: a function-level import defers a cost but
still couples the two modules both ways (the cycle is only hidden until the function runs).
Imports under `if TYPE_CHECKING:` do not count: they never run.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).parents[2]
PACKAGE = ROOT / "wandistill"


def _modules() -> dict[str, Path]:
    """Dotted name -> file, for every module and package of wandistill."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _type_checking_only(tree: ast.Module) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(x) for stmt in node.body for x in ast.walk(stmt)}
    return skip


def _imported(node: ast.Import | ast.ImportFrom, package: str) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:  # relative: resolve against the importing module's package
        up = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join([*up, base] if base else up)
    return [base, *(f"{base}.{a.name}" for a in node.names)]


def import_graph() -> dict[str, set[str]]:
    """Module -> the wandistill modules it imports anywhere in its body (a package's
    `__init__` counts for every import of something under it, as Python runs it first)."""
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skip = _type_checking_only(tree)
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(tree):
            if not isinstance(node, ast.Import | ast.ImportFrom) or id(node) in skip:
                continue
            for name in _imported(node, package):
                parts = name.split(".")
                for k in range(2, len(parts) + 1):
                    target = ".".join(parts[:k])
                    own_parent = mod.startswith(target + ".")
                    if target in mods and target != mod and not own_parent:
                        graph[mod].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    top = stack.pop()
                    on.discard(top)
                    comp.append(top)
                    if top == node:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_cycle_finder_sees_a_cycle_through_a_function_level_import() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_counts_function_level_imports_and_skips_type_checking_ones() -> None:
    graph = import_graph()
    # cli imports the footprint report inside a function; config names Encoding for types only
    assert "wandistill.cache.footprint" in graph["wandistill.cli.cache"]
    assert "wandistill.runtime.faults" in graph["wandistill.runtime.dist"]


def test_no_import_cycle_between_modules_of_the_package() -> None:
    found = cycles(import_graph())
    assert found == [], "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def _map_paths() -> set[str]:
    """Paths the map block of docs/architecture.md names, from its indentation."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    block = re.search(r"```\nwandistill/\n(.*?)```", text, re.S)
    assert block, "docs/architecture.md has no map block starting with 'wandistill/'"
    named: set[str] = set()
    folders: list[str] = ["wandistill"]
    for line in block.group(1).splitlines():
        m = re.match(r"( *)(\S+)", line)
        if not m or not line.strip():
            continue
        depth = len(m.group(1)) // 2
        name = m.group(2)
        del folders[depth:]
        path = "/".join([*folders, name.rstrip("/")])
        if name.endswith("/"):
            folders.append(name.rstrip("/"))
            named.add(path + "/__init__.py")
        elif name.endswith(".py"):
            named.add(path)
    return named


def test_the_architecture_map_names_every_module_and_only_modules_that_exist() -> None:
    on_disk = {str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py")} - {"wandistill/__init__.py"}
    named = _map_paths()
    assert sorted(named - on_disk) == [], "the map names modules that do not exist"
    assert sorted(on_disk - named) == [], "modules missing from docs/architecture.md's map"
