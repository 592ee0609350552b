"""Reading JSON files we did not write: capped, strict, typed, and one line per problem.

Every JSON file that comes from outside (a teacher folder's configs, safetensors headers, index
files) goes through here, so each class of bad input is handled once:

* size: a file over `max_bytes` is refused before it is parsed;
* syntax: invalid UTF-8 or JSON, duplicate keys (json would keep the last one silently), integers
  beyond Python's digit limit;
* shape: nesting deeper than `max_depth`; NaN, Infinity and numbers that overflow to inf (1e400),
  which `json` accepts but no config means;
* types and ranges: a pydantic v2 model validates the parsed value.

Every failure is one `WandistillError` (UsageError unless the caller picks another class) whose
message names the file and the field, and whose fix is the field's own (a model field may carry
`json_schema_extra={"fix": ...}`) or the file's.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from wandistill.errors import UsageError, WandistillError

M = TypeVar("M", bound=BaseModel)

MAX_BYTES = 4 << 20
"""Default cap for a config file (real Wan configs are a few KiB)."""
MAX_DEPTH = 32
"""Default cap on nesting; real configs nest 3 levels, tokenizer.json about 6."""


def where(what: str, path: str | Path) -> str:
    """How messages name a file: `teacher file '/t/vae/config.json'`."""
    return f"{what} {str(path)!r}"


def read_bytes(
    path: Path,
    *,
    what: str,
    fix: str,
    max_bytes: int = MAX_BYTES,
    error: type[WandistillError] = UsageError,
) -> bytes:
    """The file's bytes, refused if larger than `max_bytes` (read capped, not trusted stat)."""
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
    except FileNotFoundError:
        raise error(f"{where(what, path)} is missing", fix=fix) from None
    except IsADirectoryError:
        raise error(f"{where(what, path)} is a directory, not a file", fix=fix) from None
    except OSError as e:
        raise error(f"cannot read {where(what, path)}: {e.strerror or e}", fix=fix) from None
    if len(data) > max_bytes:
        raise error(
            f"{where(what, path)} is larger than {max_bytes:,} bytes; no such file is that big",
            fix=fix,
        )
    return data


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _bad_node(value: Any, max_depth: int) -> tuple[Any, int] | None:
    """The first node nested deeper than max_depth or holding a non-finite float, or None.

    Iterative (no recursion limit) and without building field names: tokenizer.json has ~1e6
    nodes; names are built only for the rare file that has a problem (`_name_of`).
    """
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if depth > max_depth or (isinstance(v, float) and not math.isfinite(v)):
            return v, depth
        if isinstance(v, dict):
            stack.extend((x, depth + 1) for x in v.values())
        elif isinstance(v, list):
            stack.extend((x, depth + 1) for x in v)
    return None


def _name_of(value: Any, target: Any, depth: int) -> str:
    """The field path of node `target` (found by identity) at `depth`, e.g. `latents_std[3]`."""
    stack: list[tuple[Any, str, int]] = [(value, "", 1)]
    while stack:
        v, name, d = stack.pop()
        if v is target and d == depth:
            return name or "the top level"
        if isinstance(v, dict):
            stack.extend((x, f"{name}.{k}" if name else str(k), d + 1) for k, x in v.items())
        elif isinstance(v, list):
            stack.extend((x, f"{name}[{i}]", d + 1) for i, x in enumerate(v))
    return "?"


def parse(
    data: bytes,
    *,
    name: str,
    fix: str,
    max_depth: int = MAX_DEPTH,
    error: type[WandistillError] = UsageError,
) -> Any:
    """Parse JSON bytes; `name` is how the message names the source (see `where`)."""
    try:
        value = json.loads(data.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except UnicodeDecodeError as e:
        raise error(f"{name} is not UTF-8 text (byte {e.start})", fix=fix) from None
    except RecursionError:
        raise error(f"{name} is nested more than {max_depth} levels deep", fix=fix) from None
    except ValueError as e:  # JSONDecodeError, duplicate keys, integer digit limit
        raise error(f"{name} is not valid JSON: {e}", fix=fix) from None
    bad = _bad_node(value, max_depth)
    if bad is not None:
        node, depth = bad
        field = _name_of(value, node, depth)
        if depth > max_depth:
            raise error(f"{name} is nested more than {max_depth} levels deep (at {field})", fix=fix)
        raise error(f"{name}: {field} = {node} is not a finite number", fix=fix)
    return value


def _field_fix(model: type[BaseModel], loc: tuple[int | str, ...]) -> str | None:
    """The `fix` a model declares on the field an error points at (nested models followed)."""
    current: Any = model
    found = None
    for part in loc:
        fields = getattr(current, "model_fields", None)
        if not isinstance(part, str) or fields is None:
            continue
        info = fields.get(part) or next((f for f in fields.values() if f.alias == part), None)
        if info is None:
            break
        extra = info.json_schema_extra
        if isinstance(extra, dict) and isinstance(extra.get("fix"), str):
            found = extra["fix"]
        current = info.annotation
    return found


def _loc(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def one_line(e: ValidationError, model: type[BaseModel], *, name: str) -> tuple[str, str | None]:
    """(message, field fix) for the first error of a pydantic ValidationError."""
    errors = e.errors(include_url=False)
    first = errors[0]
    field = _loc(tuple(first["loc"])) or "the top level"
    shown = repr(first.get("input"))
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    if first["type"] == "missing":
        msg = f"{name}: {field} is missing{more}"
    else:
        problem = str(first["msg"]).removeprefix("Value error, ")
        msg = f"{name}: {field} = {shown}: {problem}{more}"
    return msg, _field_fix(model, tuple(first["loc"]))


def validate(
    model: type[M],
    value: Any,
    *,
    name: str,
    fix: str,
    error: type[WandistillError] = UsageError,
) -> M:
    """`model.model_validate(value)` with the first problem as one line naming the field."""
    try:
        return model.model_validate(value)
    except ValidationError as e:
        msg, field_fix = one_line(e, model, name=name)
        raise error(msg, fix=field_fix or fix) from None


def read_model(
    path: Path,
    model: type[M],
    *,
    what: str,
    fix: str,
    max_bytes: int = MAX_BYTES,
    max_depth: int = MAX_DEPTH,
    error: type[WandistillError] = UsageError,
) -> tuple[M, Any, bytes]:
    """Read, parse and validate one JSON file: (typed model, parsed value, raw bytes).

    The parsed value and the bytes come back too: callers keep the exact config (to hand to the
    library or record it) and hash the bytes, without reading the file again.
    """
    raw = read_bytes(path, what=what, fix=fix, max_bytes=max_bytes, error=error)
    name = where(what, path)
    value = parse(raw, name=name, fix=fix, max_depth=max_depth, error=error)
    return validate(model, value, name=name, fix=fix, error=error), value, raw
