"""Lines per module and the longest functions of a package folder (docs/architecture.md).

    python tests/bench/code_size.py wandistill/teacher [--top 8]

Counts physical lines per .py file and, per function (methods included), the lines from its
`def` to its last line (docstring included), via `ast` (end_lineno).
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path


def functions(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.append((node.end_lineno - node.lineno + 1, f"{path.name}:{node.name}"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("folders", nargs="+", type=Path)
    ap.add_argument("--top", type=int, default=8)
    args = ap.parse_args()
    files = sorted(p for f in args.folders for p in ([f] if f.is_file() else f.rglob("*.py")))
    total = 0
    print("| module | lines |\n|---|---|")
    for p in files:
        n = len(p.read_text(encoding="utf-8").splitlines())
        total += n
        print(f"| {p} | {n} |")
    print(f"| total | {total} |\n")
    fns = sorted((f for p in files for f in functions(p)), reverse=True)
    lengths = sorted(n for n, _ in fns)
    median = lengths[len(lengths) // 2] if lengths else 0
    print(f"{len(fns)} functions, median {median} lines; longest:\n")
    print("| function | lines |\n|---|---|")
    for n, name in fns[: args.top]:
        print(f"| {name} | {n} |")


if __name__ == "__main__":
    main()
