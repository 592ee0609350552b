"""What the recipe's sections share: the allowed dtypes and backends, the pydantic dataclass every
section is (`section`), how its failures read (one line per key, naming the key, the value and
the fix; "did you mean" for a misspelt key), and how a section reports every failed relational
check at once and checks its locations through the CLI's one parser."""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Callable
from typing import Any, TypeVar

import pydantic.dataclasses
from pydantic import ConfigDict, ValidationError
from pydantic_core import ArgsKwargs

from wandistill.checks.bounds import range_of
from wandistill.errors import ConfigError

T = TypeVar("T")
DTYPES = ("fp32", "fp16", "bf16")
BACKENDS = ("webdataset", "zarr")

RECIPE = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)
"""Strict: no "1" -> 1 beyond what TOML and `--set` literals mean (an int still fills a float);
unknown keys are refused; NaN and inf never reach a range check."""
TYPE_NAMES = {"int_type": "int", "float_type": "float", "string_type": "str", "bool_type": "bool"}
TYPE_NAMES |= {"list_type": "a list", "dict_type": "a table"}
RANGE_FIX = "set each named key to a value in its allowed range"

_LOST = (
    "it lost to loss.unroll in every cell with K >= 2 and to loss.perflow in all but one: "
    "docs/benchmarks.md"
)
_FEW_STEP = "delete {key}; for a few-step student use loss.perflow = 1 or loss.unroll = 1"
REMOVED = {
    "loss.trajectory": (_LOST, _FEW_STEP),
    "loss.reflow": (_LOST, _FEW_STEP),
    "loss.consistency": (
        "it lost to loss.perflow and loss.unroll in every cell: docs/benchmarks.md",
        _FEW_STEP,
    ),
    "loss.consistency_target_decay": (
        "with loss.consistency, whose EMA target it set",
        "delete {key}",
    ),
}
"""Keys a recipe or `--set` may still carry from an older wandistill: section.key -> (why it
went, the fix). Refused by name (`unknown_key`), never guessed at with "did you mean"."""


def section(name: str) -> Callable[[type[T]], type[T]]:
    """Class decorator: a recipe table as a pydantic dataclass (RECIPE config; `replace`, `asdict`
    and `fields` keep working; `__post_init__` runs after the fields validate, so relational
    checks never see a NaN). Constructing one with bad values raises one ConfigError naming every
    bad key. `name` is how range messages name its keys (`optim` -> `optim.lr=nan ...`), the
    way `--set` takes them inside a stage command."""

    def wrap(cls: type[T]) -> type[T]:
        made: Any = pydantic.dataclasses.dataclass(config=RECIPE, kw_only=True, slots=True)(cls)

        def __init__(self: Any, **values: Any) -> None:
            build(type(self), values, name, self)

        made.__init__ = __init__
        made.section_name = name
        return typing.cast(type[T], made)

    return wrap


def build(cls: type[T], values: dict[str, Any], where: str, obj: Any = None) -> T:
    """`cls(**values)` into `obj` (a new one when None), naming keys by their path `where` (the
    loader passes the full path; a direct call the section's name). Raises one ConfigError."""
    obj = cls.__new__(cls) if obj is None else obj
    try:
        cls.__pydantic_validator__.validate_python(ArgsKwargs((), values), self_instance=obj)
    except ValidationError as e:
        lines: dict[str, str | None] = {}  # message -> fix, in order, a union's twins once
        for err in e.errors():
            message, fix = _line(err, cls, where, values)
            lines.setdefault(message, fix)
        fix = next((f for f in lines.values() if f), None)
        raise ConfigError("; ".join(lines), fix=fix) from None
    return obj


def _line(err: Any, cls: Any, where: str, values: dict[str, Any]) -> tuple[str, str | None]:
    """One pydantic error as the recipe message it stands for, and its fix (None: the caller's)."""
    loc, kind, value = err["loc"], err["type"], err["input"]
    key = str(loc[0])
    if kind == "unexpected_keyword_argument":
        return unknown_key(key, list(cls.__pydantic_fields__), where)
    path = f"{where}.{key}" if where else key
    tp = typing.get_type_hints(cls).get(key)
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) not in (
        args := typing.get_args(tp)
    ):  # pydantic tried each member (its name is in loc): the key takes any of them
        need = " | ".join(a.__name__ if isinstance(a, type) else str(a) for a in args)
        return f"{path}={values.get(key)!r} must be {need}", None
    rest = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc[1:])
    huge = kind == "float_type" and type(value) is int  # an int past float's range
    ranged = kind == "finite_number" or kind.startswith(("greater_than", "less_than"))
    if (ranged or huge) and (rng := range_of(cls, key)) is not None:
        at = (f"{cls.section_name}.{key}" if cls.section_name else key) + rest
        if float in (tp, *typing.get_args(tp)) and type(value) is int and abs(value) < 1 << 63:
            value = float(value)  # shown as the float the field holds: lr=-1.0
        return rng.problem(at, value) or f"{at}={value!r}: {err['msg']}", RANGE_FIX
    if kind in TYPE_NAMES:
        need = TYPE_NAMES[kind]
        if isinstance(value, bool) and need in ("int", "float"):
            return f"{path + rest}={value!r} must be {need}, not a boolean", None
        return f"{path + rest}={value!r} must be {need}, got {type(value).__name__}", None
    return f"{path + rest}={value!r} {err['msg']}", None


def unknown_key(key: str, valid: list[str], where: str) -> tuple[str, str]:
    """A removed key (`REMOVED`: why, and what replaces it); a misspelt one: the closest valid
    one ("did you mean"), else every valid key here."""
    name = f"{where}.{key}" if where else key
    for old, (why, fix) in REMOVED.items():
        if name == old or name.endswith("." + old):
            return f"{name} was removed ({why})", fix.format(key=name)
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    prefix = where + "." if where else ""
    if close:
        return (
            f"unknown key {name!r}: did you mean {prefix}{close[0]}?",
            f"spell it {prefix}{close[0]}",
        )
    return (
        f"unknown key {name!r}: valid keys here: {', '.join(valid)}",
        f"use one of the keys of [{where or 'the recipe'}] listed above",
    )


def _locations(**given: tuple[str, bool]) -> tuple[bool, str]:
    """The recipe's locations (key -> (value, URL supported)) through the CLI's one parser
    (`wandistill.io.location`): a URL only where the stage reads or writes it end to end, never
    a local path named like a URL. A (passed, message) check for `_problems`."""
    from wandistill.io.location import problem

    bad = [p for k, (v, url) in given.items() if (p := problem(v, k, url=url))]
    return not bad, "; ".join(bad)


def _problems(*checks: tuple[bool, str]) -> None:
    """Raise once with every failed check, so a user fixes a recipe in one pass."""
    bad = [msg for ok, msg in checks if not ok]
    if bad:
        raise ConfigError("; ".join(bad))
