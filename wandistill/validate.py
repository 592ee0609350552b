"""Every JSON file wandistill reads from outside goes through here, once, at the edge.

A file is checked in four steps before any code uses a value of it: its size against a cap
(before it is read), strict JSON (pydantic-core's parser: no NaN/Infinity literals, no lone
surrogates, invalid UTF-8 refused, nesting bounded), a depth and finiteness walk (no float is
NaN or +-inf, not even `1e999`, and nothing nests deeper than `MAX_DEPTH`), then a typed pydantic
schema declared once per file format. Any failure is one `WandistillError` line naming the file,
the field (a dotted path, with the shard/record name where the data has one) and the fix.

Schemas derive from `Schema` (strict types, finite floats, unknown keys refused). Files whose
bytes wandistill wrote itself are also sealed: `seal(obj)` returns the sha256 of their canonical
JSON, stored next to them and checked on every read (`check_seal`).

Other rooms use `load_json_file` (read + check), or `parse_json` + `check` when the bytes come
from somewhere else (a tar member, a safetensors header).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from functools import cache
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError
from pydantic_core import from_json

from wandistill.errors import UsageError, WandistillError

T = TypeVar("T")

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
MAX_DEPTH = 32
"""Deepest nesting of objects/lists any wandistill file may have (the deepest real one: ~6)."""
_SHOWN = 60
"""Characters of an offending value shown in an error line."""


class Schema(BaseModel):
    """Base of every file schema: no coercion ("3" is not 3), finite floats, no unknown keys."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")


class OpenSchema(Schema):
    """A schema whose unknown keys are kept (blocks other versions may extend; sealed files)."""

    model_config = ConfigDict(extra="allow")


def canonical_json(obj: Any) -> str:
    """The one serialisation digests are taken over (key order and spacing fixed)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def seal(obj: Any) -> str:
    """sha256 of an object's canonical JSON."""
    return hashlib.sha256(canonical_json(obj).encode()).hexdigest()


# ----------------------------------------------------------------------------- reading


def read_capped(
    path: str | Path,
    *,
    max_bytes: int,
    what: str,
    fix: str,
    error: type[WandistillError] = UsageError,
) -> bytes:
    """The bytes of `path`, refused (one line) when missing, not a file, or over `max_bytes`."""
    p = Path(path)
    if not p.exists():
        raise error(f"{what} {str(p)!r} does not exist", fix=fix)
    if not p.is_file():
        raise error(f"{what} {str(p)!r} is not a file", fix=fix)
    with open(p, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        data = f.read(min(size, max_bytes) + 1) if size <= max_bytes else b""
    if size > max_bytes or len(data) > max_bytes:
        raise error(
            f"{what} {str(p)!r} is larger than the {_size(max_bytes)} such a file may be "
            "(oversized or not the file wandistill expects)",
            fix=fix,
        )
    return data


def parse_json(
    data: bytes | str,
    where: str,
    *,
    fix: str,
    error: type[WandistillError] = UsageError,
    max_depth: int = MAX_DEPTH,
    walk: bool = True,
) -> Any:
    """Strict JSON -> Python objects, refusing non-finite numbers and deep nesting.

    `walk=False` skips the depth/finiteness walk, for hot paths whose schema types every value
    (a typed float refuses inf itself; the parser caps nesting at 200 levels regardless)."""
    try:
        obj = from_json(data, allow_inf_nan=False)
    except ValueError as e:
        raise error(f"{where}: not valid JSON ({e})", fix=fix) from None
    problem = json_problem(obj, max_depth) if walk else None
    if problem:
        raise error(f"{where}: {problem}", fix=fix)
    return obj


def json_problem(obj: Any, max_depth: int = MAX_DEPTH) -> str | None:
    """Why a parsed JSON value is unsafe to use (too deep, a non-finite float), or None.

    Iterative, so a hostile depth cannot exhaust the Python stack here."""
    stack: list[tuple[Any, int, tuple[Any, ...]]] = [(obj, 1, ())]
    while stack:
        node, depth, loc = stack.pop()
        if isinstance(node, float):
            if not math.isfinite(node):
                return f"{loc_text(loc) or 'the value'} is {node}, not a finite number"
            continue
        if not isinstance(node, dict | list):
            continue
        if depth > max_depth:
            return f"{loc_text(loc) or 'the top level'} nests deeper than {max_depth} levels"
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for k, v in items:
            if isinstance(v, dict | list | float):
                stack.append((v, depth + 1, (*loc, k)))
    return None


@cache
def _adapter(tp: Any) -> TypeAdapter[Any]:
    return TypeAdapter(tp)


def check(
    tp: type[T],
    obj: Any,
    where: str,
    *,
    fix: str,
    error: type[WandistillError] = UsageError,
) -> T:
    """Validate parsed JSON against schema `tp` (a `Schema` or any pydantic-able type)."""
    try:
        return _adapter(tp).validate_python(obj, strict=True)
    except ValidationError as e:
        raise error(f"{where}: {describe(e, obj)}", fix=fix) from None


def load_json_file(
    path: str | Path,
    tp: type[T],
    *,
    what: str,
    fix: str,
    error: type[WandistillError] = UsageError,
    max_bytes: int = MiB,
) -> tuple[T, Any]:
    """Read, parse and check one JSON file: (the typed object, the parsed JSON as read)."""
    where = f"{what} {str(path)!r}"
    data = read_capped(path, max_bytes=max_bytes, what=what, fix=fix, error=error)
    obj = parse_json(data, where, fix=fix, error=error)
    return check(tp, obj, where, fix=fix, error=error), obj


# ----------------------------------------------------------------------------- messages


def loc_text(loc: tuple[Any, ...], obj: Any = None) -> str:
    """`shards[2] (r00000-000002).offsets[0][1]`: a dotted path, naming named list items."""
    out = ""
    node = obj
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
            node = node[part] if isinstance(node, list) and 0 <= part < len(node) else None
            name = node.get("name") if isinstance(node, dict) else None
            if isinstance(name, str) and len(name) <= _SHOWN:
                out += f" ({name})"
        else:
            out += f".{part}" if out else str(part)
            node = node.get(part) if isinstance(node, dict) else None
    return out


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN else text[: _SHOWN - 3] + "..."


_WANTED = {
    "model_type": "a JSON object",
    "model_attributes_type": "a JSON object",
    "dataclass_type": "a JSON object",
    "dict_type": "a JSON object",
    "list_type": "a JSON array",
    "tuple_type": "a JSON array",
    "int_type": "an integer",
    "float_type": "a number",
    "string_type": "a string",
    "bool_type": "true or false",
}


def json_kind(value: Any) -> str:
    """What a JSON value is, for 'must be X, not Y' messages."""
    if isinstance(value, dict):
        return "a JSON object"
    if isinstance(value, list):
        return "a JSON array"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    kind = {str: "the string", int: "the integer", float: "the number"}.get(type(value), "")
    return f"{kind} {_shown(value)}".strip()


def describe(e: ValidationError, obj: Any = None) -> str:
    """The first problem of a validation error as one line (plus how many more there are)."""
    errors = e.errors(include_url=False)
    first = errors[0]
    loc = tuple(p for p in first["loc"] if not (isinstance(p, str) and p.startswith("function-")))
    where = loc_text(loc, obj) or "the top level"
    kind, value = first["type"], first.get("input")
    if kind == "missing":
        text = f"{where} is missing"
    elif kind == "extra_forbidden":
        text = f"{where} is not a known field"
    elif kind in _WANTED:
        text = f"{where} must be {_WANTED[kind]}, not {json_kind(value)}"
    else:
        msg = first["msg"].removeprefix("Value error, ").replace("Input should be", "must be")
        shown = f" = {_shown(value)}" if isinstance(value, str | int | float | None) else ""
        text = f"{where}{shown}: {msg[:1].lower()}{msg[1:]}"
    more = len(errors) - 1
    return text + (f" (and {more} more problem{'s' * (more > 1)})" if more else "")


def _size(n: int) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n} bytes"


# ----------------------------------------------------------------------------- paths


def rel_path_problem(rel: str) -> str | None:
    """Why `rel` is not a plain relative path inside a folder (absolute, `..`, odd bytes)."""
    if not rel:
        return "is empty"
    if rel.startswith(("/", "\\")) or (len(rel) > 1 and rel[1] == ":"):
        return "is an absolute path"
    if "\\" in rel or "\x00" in rel:
        return "contains a backslash or NUL"
    parts = rel.split("/")
    if any(p in ("", ".", "..") for p in parts):
        return "contains an empty, '.' or '..' part"
    return None


def inside(root: str | Path, rel: str, what: str, error: type[WandistillError]) -> Path:
    """`root / rel`, refused unless it stays inside `root` (symlinks resolved too)."""
    problem = rel_path_problem(rel)
    if problem is None:
        base = os.path.realpath(root)
        full = os.path.realpath(os.path.join(base, rel))
        if os.path.commonpath([base, full]) != base:
            problem = "leads outside its folder (a symlink?)"
    if problem:
        raise error(f"{what} {rel!r} {problem}; refused", fix="restore the file that names it")
    return Path(root) / rel
