"""Declarative numeric ranges: every number a user can set is finite and in range before any work.

A config field states its range once, next to its default, in the dataclass field metadata:

    lr: float = num(1e-4, gt=0, le=10)
    betas: list[float] = num(list_of=(0.9, 0.999), ge=0, lt=1)   # every element

and the class is marked `@checked("optim")` (under `@dataclass`), which runs every declared range
before the class's own relational checks (`height % 16`, `record_steps < num_inference_steps`),
so those never see a NaN. One error names every bad key, its value and the allowed range. CLI
flags that do not go through a recipe use the same `Range` objects (`flag_problem`), and so do
numbers read from files (a prompt's seed) and the environment (`WANDISTILL_DIST_TIMEOUT`).

Why a range and not just a sign: a NaN passes `x > 0 is False` checks as "not positive" but
`inf`, `1e308` or a 70-bit seed pass them and then poison the run hours later (an inf guidance
scale makes every teacher output NaN; a seed >= 2**64 is a torch overflow traceback; a negative
seed aliases another seed).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from wandistill.errors import ConfigError

T = TypeVar("T")
RANGE = "wandistill.range"
"""The field-metadata key holding a field's `Range`."""


@dataclass(frozen=True, slots=True)
class Range:
    """An interval; None means unbounded on that side (a number still has to be finite)."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def text(self) -> str:
        lo = f"[{_fmt(self.ge)}" if self.ge is not None else f"({_fmt(self.gt)}"
        hi = f"{_fmt(self.le)}]" if self.le is not None else f"{_fmt(self.lt)})"
        if self.ge is None and self.gt is None:
            lo = "(-inf"
        if self.le is None and self.lt is None:
            hi = "inf)"
        return f"{lo}, {hi}"

    def problem(self, name: str, value: Any) -> str | None:
        """Why `value` is not allowed for `name` (one line naming both and the range), or None."""
        if value is None or isinstance(value, bool) or not isinstance(value, int | float):
            return None  # types are checked by the loader; None means "not set"
        if isinstance(value, float) and not math.isfinite(value):
            return f"{name}={value!r} must be a finite number in {self.text()}"
        if self.ge is not None and value < self.ge:
            positive = self.ge == 1 and isinstance(value, int)
            need = "positive" if positive else f">= {_fmt(self.ge)}"
            return f"{name}={value!r} must be {need} (allowed: {self.text()})"
        if self.gt is not None and value <= self.gt:
            need = "positive" if self.gt == 0 else f"> {_fmt(self.gt)}"
            return f"{name}={value!r} must be {need} (allowed: {self.text()})"
        if (self.le is not None and value > self.le) or (self.lt is not None and value >= self.lt):
            return f"{name}={value!r} is too large (allowed: {self.text()})"
        return None


def _fmt(x: float | None) -> str:
    if x is None:
        return ""
    if isinstance(x, int) or float(x).is_integer() and abs(x) < 1e15:
        return str(int(x))
    return f"{x:g}"


SEED = Range(ge=0, le=2**63 - 1)
"""Seeds: torch takes 64 bits and wraps negatives onto big ones (-1 is 2**64 - 1), and a base
seed gets a prompt's line index added; 63 bits leave that room and never alias."""
PROMPT_SEED = Range(ge=0, le=2**64 - 1)
"""A prompt's own seed (.jsonl): everything torch.Generator takes without aliasing."""
TIMEOUT_S = Range(gt=0, le=7 * 86400)


def num(
    default: Any = dataclasses.MISSING,
    *,
    list_of: tuple[Any, ...] | None = None,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
) -> Any:
    """A dataclass field with a declared range (for a list field: every element's range)."""
    meta = {RANGE: Range(ge=ge, gt=gt, le=le, lt=lt)}
    if list_of is not None:
        items = list(list_of)
        return field(default_factory=lambda: list(items), metadata=meta)
    return field(default=default, metadata=meta)


def range_of(cls: type, name: str) -> Range | None:
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name == name:
            return f.metadata.get(RANGE)
    return None


def range_problems(obj: Any, section: str) -> list[str]:
    """Every declared range of a config object that its value breaks, as message lines."""
    out: list[str] = []
    for f in dataclasses.fields(obj):
        rng: Range | None = f.metadata.get(RANGE)
        if rng is None:
            continue
        value = getattr(obj, f.name)
        name = f"{section}.{f.name}" if section else f.name
        if isinstance(value, list | tuple):
            found = [rng.problem(f"{name}[{i}]", v) for i, v in enumerate(value)]
            out.extend(p for p in found if p)
        elif (p := rng.problem(name, value)) is not None:
            out.append(p)
    return out


def checked(section: str) -> Callable[[type[T]], type[T]]:
    """Class decorator (put it under `@dataclass`): check declared ranges before `__post_init__`.

    `section` is how messages name the class's keys (`optim` -> `optim.lr=nan ...`)."""

    def wrap(cls: type[T]) -> type[T]:
        own = cls.__dict__.get("__post_init__")

        def __post_init__(self: Any) -> None:
            problems = range_problems(self, section)
            if problems:
                raise ConfigError(
                    "; ".join(problems), fix="set each named key to a value in its allowed range"
                )
            if own is not None:
                own(self)

        __post_init__.__doc__ = own.__doc__ if own is not None else None
        cls.__post_init__ = __post_init__  # type: ignore[attr-defined]
        return cls

    return wrap


def flag_problem(flag: str, value: Any, rng: Range) -> str | None:
    """The same check for a command-line flag that bypasses the recipe (`--limit 0`)."""
    return rng.problem(flag, value)
