"""Package exports that import their module on first use (PEP 562 `__getattr__`).

Importing any `wandistill.cache.x` or `wandistill.student.x` runs its package's `__init__`
first. When that `__init__` imported its re-exports eagerly, parsing a recipe (which needs one
constant of the cache room) loaded torch, webdataset and zarr, and a two-rank launch spent
seconds importing diffusers before it joined the job and could say which peer was missing. The
re-exports stay (`from wandistill.cache import open_cache` works), but load when named.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def exports(
    package: str, where: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """`__getattr__` and `__dir__` for `package`: attribute `name` is `where[name].name`,
    imported on first use and then kept on the package (later look-ups cost nothing)."""

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *where})

    return __getattr__, __dir__
