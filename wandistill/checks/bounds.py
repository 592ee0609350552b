"""Declarative numeric ranges: every number a user can set is finite and in range before any work.

A recipe field states its range once, in its annotation, as pydantic constraint metadata:

    lr: Annotated[float, Range(gt=0, le=10)] = 1e-4
    betas: list[Annotated[float, Range(ge=0, lt=1)]] = field(...)   # every element

pydantic enforces it (with the recipe config's `allow_inf_nan=False`) before the class's own
relational checks (`height % 16`, `record_steps < num_inference_steps`), so those never see a
NaN; `wandistill.config.common` turns each failure back into one line naming the key, its value
and the allowed range (`Range.problem`). CLI flags that do not go through a recipe use the same
`Range` objects, and so do numbers read from files (a prompt's seed) and the environment
(`env_seconds`: `WANDISTILL_DIST_TIMEOUT`).

Why a range and not just a sign: a NaN passes `x > 0 is False` checks as "not positive" but
`inf`, `1e308` or a 70-bit seed pass them and then poison the run hours later (an inf guidance
scale makes every teacher output NaN; a seed >= 2**64 is a torch overflow traceback; a negative
seed aliases another seed).
"""

from __future__ import annotations

import math
import os
import typing
from dataclasses import dataclass
from typing import Any

from annotated_types import Interval

from wandistill.errors import UsageError


@dataclass(frozen=True, slots=True)
class Range(Interval):
    """An interval pydantic enforces (it is an `annotated_types.Interval`); None means unbounded
    on that side (a number still has to be finite). `problem` words a breach for the user."""

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
            need = "positive" if self.ge == 1 and isinstance(value, int) else f">= {_fmt(self.ge)}"
            return f"{name}={value!r} must be {need} (allowed: {self.text()})"
        if self.gt is not None and value <= self.gt:
            need = "positive" if self.gt == 0 else f"> {_fmt(self.gt)}"
            return f"{name}={value!r} must be {need} (allowed: {self.text()})"
        if (self.le is not None and value > self.le) or (self.lt is not None and value >= self.lt):
            return f"{name}={value!r} is too large (allowed: {self.text()})"
        return None


def _fmt(x: Any) -> str:
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


def range_in(annotation: Any) -> Range | None:
    """The `Range` an annotation declares: on the number itself, on an optional number, or on a
    list's elements (`list[Annotated[float, Range(...)]]`)."""
    for meta in getattr(annotation, "__metadata__", ()):
        if isinstance(meta, Range):
            return meta
    for arg in typing.get_args(annotation):
        if (found := range_in(arg)) is not None:
            return found
    return None


def range_of(cls: type, name: str) -> Range | None:
    return range_in(typing.get_type_hints(cls, include_extras=True).get(name))


def env_seconds(name: str, rng: Range, fix: str) -> float | None:
    """Environment variable `name` as a number of seconds in `rng`, or None when unset; any
    other value (a typo, a 5,000-digit number, nan) is one line naming the variable."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        seconds = float(raw) if len(raw) < 64 else float("nan")
    except ValueError:
        seconds = float("nan")
    problem = rng.problem(name, seconds)
    if problem is not None:
        raise UsageError(problem.replace("=nan", f"={raw[:40]!r}"), fix=fix)
    return seconds
