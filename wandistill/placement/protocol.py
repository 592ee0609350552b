"""What a placement strategy is given and what it answers with (no strategy lives here).

`Need` is a strategy's memory per device for one phase (the plan's numbers); `LoadContext` is
what the loader (`placement.load`) hands `Placement.load`; `Loaded` is what comes back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from wandistill.io.modelfolder import COMPONENT_CLASSES

if TYPE_CHECKING:
    import torch

    from wandistill.teacher.folder import Component

__all__ = ["LoadContext", "Loaded", "Need", "component_class"]


@dataclass(frozen=True, slots=True)
class Need:
    """Memory one placement needs during one phase."""

    devices: dict[str, int]
    """"cuda:N" / "cpu" / "disk" -> bytes."""
    note: str = ""
    """Why it cannot work (non-empty: does not fit), e.g. modules spilled off the GPUs."""
    max_memory: dict[str, dict[int | str, int]] = field(default_factory=dict)
    """Device-map strategies: component -> the max_memory handed to accelerate."""


class LoadContext(Protocol):
    """What `Placement.load` gets from the loader (wandistill.placement.load)."""

    def load_weights(
        self, comp: Component, dtype: torch.dtype, **kwargs: Any
    ) -> torch.nn.Module: ...

    def offload_folder(self, name: str) -> Path: ...


def component_class(comp: Component | str) -> type:
    """The library class of a teacher component, or of the one named so (diffusers /
    transformers, imported lazily)."""
    import importlib

    ref = COMPONENT_CLASSES[comp] if isinstance(comp, str) else (comp.library, comp.class_name)
    library, name = ref
    return getattr(importlib.import_module(library), name)


@dataclass(frozen=True, slots=True)
class Loaded:
    """A loaded component and what its placement attached."""

    model: torch.nn.Module
    hook: Any = None
    """model-offload: accelerate's UserCpuOffloadHook (`park` calls its offload())."""
