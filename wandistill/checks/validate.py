"""Every JSON file wandistill reads from outside goes through here, once, at the edge.

One mechanism for every such file (cache manifests and journals, checkpoint state, student and
teacher configs, safetensors headers, index files). A file is checked in four steps before any
code uses a value of it:

* size: `read_capped` refuses a file over its cap before reading it (stat, then a capped read);
* syntax: strict JSON (`parse_json`): invalid UTF-8, duplicate keys (`json` would keep the last
  silently), lone surrogates, integers beyond Python's digit limit are refused;
* shape: a walk refuses nesting deeper than `MAX_DEPTH` and any float that is not finite (`NaN`,
  `Infinity`, `1e400`), naming the field;
* types and ranges: a pydantic v2 schema declared once per format (`check`), derived from
  `Schema` (strict types, finite floats, unknown keys refused) or `OpenSchema` (unknown keys kept:
  library configs, blocks other versions may extend).

Any failure is one `WandistillError` line (UsageError unless the caller picks another class:
CacheError for caches, ...) naming the file (`label`: `teacher file '/t/vae/config.json'`), the
field (a dotted path, with the shard/record name where the data has one: `shards[2]
(r00000-000002).offsets[0]`) and the fix: the field's own where the schema declares one
(`Field(json_schema_extra={"fix": ...})`), else the caller's.

Files whose bytes wandistill wrote itself are also sealed: `seal(obj)` returns the sha256 of
their canonical JSON, stored next to them and checked on every read. `inside` keeps relative
paths read from a file inside their folder.

Use `load_json_file` (read + parse + check) for a file, or `read_capped` / `parse_json` / `check`
when the bytes come from elsewhere (a tar member, a safetensors header) or are read once and
validated against several schemas.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections import Counter
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
"""Deepest nesting of objects/lists any file may have (real configs: 3, tokenizer.json: ~6)."""
_SHOWN = 60
"""Characters of an offending value shown in an error line."""
_SURROGATE = re.compile(r"\\u[dD][89abcdefABCDEF]")
"""A `\\uD800`-`\\uDFFF` escape: the only way a lone surrogate gets into decoded UTF-8 text."""


class Schema(BaseModel):
    """Base of every file schema: no coercion ("3" is not 3), finite floats, no unknown keys."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")


class OpenSchema(Schema):
    """A schema whose unknown keys are kept (library configs, blocks other versions may extend)."""

    model_config = ConfigDict(extra="allow")


def canonical_json(obj: Any) -> str:
    """The one serialisation digests are taken over (key order and spacing fixed)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def seal(obj: Any) -> str:
    """sha256 of an object's canonical JSON."""
    return hashlib.sha256(canonical_json(obj).encode()).hexdigest()


def label(what: str, path: str | Path) -> str:
    """How every message names a file: `teacher file '/t/vae/config.json'`."""
    return f"{what} {str(path)!r}"


# ----------------------------------------------------------------------------- reading


def read_capped(
    path: str | Path,
    *,
    max_bytes: int,
    what: str,
    fix: str,
    error: type[WandistillError] = UsageError,
) -> bytes:
    """The bytes of `path`, refused (one line) when missing, not a file, unreadable, or over
    `max_bytes` (by its size before reading, and by a capped read in case it grows)."""
    p, name = Path(path), label(what, path)
    if not p.exists():
        raise error(f"{name} does not exist", fix=fix)
    if not p.is_file():  # checked before open: opening a FIFO would block
        raise error(f"{name} is not a file", fix=fix)
    try:
        with open(p, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            data = f.read(max_bytes + 1) if size <= max_bytes else b""
    except OSError as e:
        raise error(f"cannot read {name}: {e.strerror or e}", fix=fix) from None
    if size > max_bytes or len(data) > max_bytes:
        raise error(
            f"{name} is larger than the {_size(max_bytes)} such a file may be "
            "(oversized or not the file wandistill expects)",
            fix=fix,
        )
    return data


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """The JSON object of `pairs`, refusing a key given twice (`json` keeps the last)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        key = next(k for k, n in Counter(k for k, _ in pairs).items() if n > 1)
        raise ValueError(f"duplicate key {key!r}")
    return out


def parse_json(
    data: bytes | str,
    where: str,
    *,
    fix: str,
    error: type[WandistillError] = UsageError,
    max_depth: int = MAX_DEPTH,
    walk: bool = True,
) -> Any:
    """Strict JSON -> Python objects; `where` names the source (`label(what, path)`).

    `walk=False` is for hot paths only: bytes pinned by a checksum of the writer's own output
    whose schema types every value (record headers). They are parsed by pydantic-core's parser
    (about 3x faster on small documents; `NaN`/`Infinity` literals and lone surrogates refused,
    nesting capped at 200), with no duplicate-key check and no walk."""
    if not walk:
        try:
            return from_json(data, allow_inf_nan=False)
        except ValueError as e:
            raise error(f"{where}: not valid JSON ({e})", fix=fix) from None
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
        obj = json.loads(text, object_pairs_hook=_no_duplicates)
        if _SURROGATE.search(text):  # rare: let the strict parser find a lone one
            from_json(text)
    except UnicodeDecodeError as e:
        problem = f"not valid JSON (not UTF-8 text at byte {e.start})"
        raise error(f"{where}: {problem}", fix=fix) from None
    except RecursionError:
        raise error(f"{where}: nests deeper than {max_depth} levels", fix=fix) from None
    except ValueError as e:  # syntax, duplicate keys, integer digit limit, lone surrogates
        raise error(f"{where}: not valid JSON ({e})", fix=fix) from None
    problem = json_problem(obj, max_depth)
    if problem:
        raise error(f"{where}: {problem}", fix=fix)
    return obj


def json_problem(obj: Any, max_depth: int = MAX_DEPTH) -> str | None:
    """Why a parsed JSON value is unsafe to use (too deep, a non-finite float), or None.

    Iterative (a hostile depth cannot exhaust the Python stack) and without building field
    names: tokenizer.json has ~1e6 nodes; names are built only once a problem is found."""
    stack: list[tuple[Any, int]] = [([obj], 0)]  # the top level as an item, checked like all
    while stack:
        node, depth = stack.pop()
        if depth > max_depth:
            return _named_problem(obj, max_depth)
        for v in node.values() if type(node) is dict else node:
            if type(v) is float:
                if not math.isfinite(v):
                    return _named_problem(obj, max_depth)
            elif type(v) is dict or type(v) is list:
                stack.append((v, depth + 1))
    return None


def _named_problem(obj: Any, max_depth: int) -> str | None:
    """`json_problem`'s finding, with the field it is at."""
    stack: list[tuple[Any, int, tuple[Any, ...]]] = [(obj, 1, ())]
    while stack:
        node, depth, loc = stack.pop()
        if isinstance(node, float):
            if not math.isfinite(node):
                return f"{loc_text(loc, obj) or 'the value'} is {node}, not a finite number"
            continue
        if not isinstance(node, dict | list):
            continue
        if depth > max_depth:
            return f"{loc_text(loc, obj) or 'the top level'} nests deeper than {max_depth} levels"
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
    at: tuple[str | int, ...] = (),
    root: Any = None,
) -> T:
    """Validate parsed JSON against schema `tp` (a `Schema` or any pydantic-able type).

    The fix is the failing field's own where `tp` declares one, else `fix`. `obj` found at `at`
    inside `root` (one entry of a list validated on its own) is named by its path from `root`."""
    try:
        return _adapter(tp).validate_python(obj, strict=True)
    except ValidationError as e:
        loc = tuple(e.errors(include_url=False)[0]["loc"])
        said = describe(e, obj if root is None else root, at=at)
        raise error(f"{where}: {said}", fix=field_fix(tp, loc) or fix) from None


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
    where = label(what, path)
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
    **dict.fromkeys(
        ("model_type", "model_attributes_type", "dataclass_type", "dict_type"), "a JSON object"
    ),
    **dict.fromkeys(("list_type", "tuple_type"), "a JSON array"),
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


def describe(e: ValidationError, obj: Any = None, at: tuple[str | int, ...] = ()) -> str:
    """The first problem of a validation error as one line (plus how many more there are);
    `at`: where the validated value sits in `obj`."""
    errors = e.errors(include_url=False)
    first = errors[0]
    loc = at + tuple(
        p for p in first["loc"] if not (isinstance(p, str) and p.startswith("function-"))
    )
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
        shown = f" = {_shown(value)}" if not isinstance(value, dict) else ""
        text = f"{where}{shown}: {msg[:1].lower()}{msg[1:]}"
    more = len(errors) - 1
    return text + (f" (and {more} more problem{'s' * (more > 1)})" if more else "")


def field_fix(tp: Any, loc: tuple[Any, ...]) -> str | None:
    """The `fix` a schema declares on the field at `loc` (`Field(json_schema_extra={"fix":
    ...})`, nested models followed; the innermost wins), or None."""
    current, found = tp, None
    for part in loc:
        fields = getattr(current, "model_fields", None)
        if not isinstance(part, str) or fields is None or part.startswith("function-"):
            continue
        info = fields.get(part) or next((f for f in fields.values() if f.alias == part), None)
        if info is None:
            break
        extra = info.json_schema_extra
        if isinstance(extra, dict) and isinstance(extra.get("fix"), str):
            found = extra["fix"]
        current = info.annotation
    return found


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
