"""`--placement` and `--device` text parsed into the typed strategies, once, at the edge.

`--placement auto` (`Auto`) is not a place for weights but a request to the planner: it loads
nothing and needs nothing (`Placement.need`/`load` refuse it); `placement/plan.py` resolves it
to the fastest of its `candidates` that fits every phase, and the loader asks the plan first.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from wandistill.errors import UsageError
from wandistill.placement.devicemap import DeviceMapFile
from wandistill.placement.devices import Caps, gpu_index, parse_max_memory
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

__all__ = ["GROUP_LEVELS", "NAMES", "Auto", "parse_device", "parse_placement"]

GROUP_LEVELS = ("block_level", "leaf_level")
NAMES = (
    "cpu",
    "cuda",
    "gpu0",
    "balanced",
    "balanced_low_0",
    "sequential",
    "auto",
    "model-offload",
    "group-offload",
    "disk-offload",
)


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


def parse_placement(
    text: str | Placement,
    *,
    group_offload_level: str = "block_level",
    max_memory: Mapping[Any, Any] | Caps | None = None,
) -> Placement:
    """A --placement value (name, cuda:N, or a device-map .json) as its typed strategy, with the
    recipe's group_offload_level and max_memory folded into the strategies that use them."""
    if group_offload_level not in GROUP_LEVELS:
        raise UsageError(
            f"group_offload_level={group_offload_level!r} must be one of {GROUP_LEVELS}",
            fix="--set precompute.teacher.group_offload_level=block_level",
        )
    caps = max_memory if isinstance(max_memory, tuple) else parse_max_memory(max_memory)
    if isinstance(text, Placement):
        text = text.to_recipe()
    if text.endswith(".json"):
        return DeviceMapFile(Path(text), caps=caps)
    if text.startswith("cuda:"):
        index = gpu_index(text)
        if index is None:
            raise UsageError(
                f"placement {text!r}: {text.removeprefix('cuda:')!r} is not a GPU index",
                fix="use cuda:0, cuda:1, ...",
            )
        return Cuda(index)
    table: dict[str, Placement] = {
        "cpu": Cpu(),
        "cuda": Cuda(),
        "gpu0": Cuda(0, alias="gpu0"),
        "balanced": Balanced(caps),
        "balanced_low_0": BalancedLow0(caps),
        "sequential": Sequential(caps),
        "auto": Auto(level=group_offload_level, caps=caps),
        "model-offload": ModelOffload(),
        "group-offload": GroupOffload(level=group_offload_level),
        "disk-offload": DiskOffload(),
    }
    if text not in table:
        close = difflib.get_close_matches(text, NAMES, n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        raise UsageError(
            f"placement={text!r} must be one of {', '.join(NAMES)}, cuda:N or a device-map "
            ".json file",
            fix=f"{hint}pass one of those",
        )
    return table[text]


def parse_device(text: str) -> Placement:
    """eval / sample `--device`: auto (a GPU if one is visible, else the CPU), cpu, cuda,
    cuda:N, parsed into the same placement objects the teacher uses."""
    if text == "auto":
        return Auto()
    if text == "cpu" or text == "cuda" or text.startswith("cuda:"):
        return parse_placement(text)
    close = difflib.get_close_matches(text, ["auto", "cpu", "cuda", "cuda:0"], n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    raise UsageError(
        f"--device {text!r} is not a device", fix=f"{hint}use auto, cpu, cuda or cuda:N"
    )
