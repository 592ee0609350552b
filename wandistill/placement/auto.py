"""`--placement auto`: not a place for weights but a request to the planner.

Why its own module: `Auto` loads nothing and needs nothing (`Placement.need`/`load` refuse it);
`placement/plan.py` resolves it to the fastest of its `candidates` that fits every phase, and
the loader (`placement/load.py`) asks the plan before loading. It sits above `strategies`
(its candidates are the concrete strategies, which never refer back to it) and below `parse`,
so the recipe can name it without importing the planner.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from wandistill.placement.devices import Caps
from wandistill.placement.strategies import (
    Balanced,
    BalancedLow0,
    Cpu,
    Cuda,
    DiskOffload,
    GroupOffload,
    ModelOffload,
    Placement,
    Sequential,
)

__all__ = ["Auto"]


@dataclass(frozen=True)
class Auto(Placement):
    """The plan's choice: the fastest strategy that fits every phase (see placement/plan.py)."""

    level: str = "block_level"
    caps: Caps = ()
    name: ClassVar[str] = "auto"

    @property
    def resolved(self) -> bool:
        return False

    def candidates(self, gpus: int, best: int) -> list[Placement]:
        """Every strategy `auto` may pick on a machine with `gpus` GPUs, fastest first."""
        if gpus == 0:
            return [Cpu(), DiskOffload(device="cpu")]
        gpu = f"cuda:{best}"
        spread: list[Placement] = (
            [Balanced(self.caps), Sequential(self.caps), BalancedLow0(self.caps)]
            if gpus > 1
            else []
        )
        return [
            Cuda(best),
            *spread,
            ModelOffload(device=gpu),
            GroupOffload(device=gpu, level=self.level),
            DiskOffload(device=gpu),
            Cpu(),
        ]
