"""Device-map placements: an explicit module map, and a JSON file with one entry per component.

A device-map file is read once, on first use, into the same typed strategies `--placement`
gives (`Cuda`, `Cpu`, `DiskOffload`, `Balanced` ... or a `ModuleMap`), checked against the
known components and, at plan time, against the module names of the meta model.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from wandistill.errors import UsageError
from wandistill.io.modelfolder import COMPONENT_CLASSES
from wandistill.placement.devices import CPU_OVERHEAD, CUDA_OVERHEAD, Caps, gpu_index
from wandistill.placement.protocol import LoadContext, Loaded, Need, component_class
from wandistill.placement.strategies import (
    AccelerateMap,
    Balanced,
    BalancedLow0,
    Cpu,
    Cuda,
    DiskOffload,
    Placement,
    Sequential,
    mapped_device,
)
from wandistill.runtime import workarounds

if TYPE_CHECKING:
    import torch

    from wandistill.placement.plan import Phase, PlanContext
    from wandistill.teacher.folder import Component

__all__ = ["DeviceMapFile", "ModuleMap"]


@dataclass(frozen=True)
class ModuleMap(Placement):
    """An explicit accelerate device map for one component (a device-map file's entry)."""

    modules: tuple[tuple[str, int | str], ...]
    """(module name, device): GPU index, "cpu" or "disk"; "" is the root."""
    name: ClassVar[str] = "device-map"
    why: ClassVar[str] = "modules where the device-map file puts them"

    @property
    def needs_cuda(self) -> bool:
        return any(isinstance(d, int) for _, d in self.modules)

    @property
    def device(self) -> str:
        gpus = sorted(d for _, d in self.modules if isinstance(d, int))
        return f"cuda:{gpus[0]}" if gpus else "cpu"

    def need(self, phase: Phase, ctx: PlanContext) -> Need:
        devices = Counter({"cpu": CPU_OVERHEAD})
        for name in phase.components:
            sizes = ctx.module_sizes(name)
            self._validate(name, ctx.module_names(name))
            for module, device in self.modules:
                key = f"cuda:{device}" if isinstance(device, int) else device
                devices[key] += sizes.get(module, 0)
        overhead = CUDA_OVERHEAD if self.device != "cpu" else 0
        devices[self.device] += phase.activation_bytes + overhead
        return Need(dict(devices))

    def _validate(self, component: str, names: set[str]) -> None:
        """Every module named exists (one line naming the nearest); a map that misses weights
        is refused by the library at load time (`workarounds.incomplete_device_map`)."""
        for module, _ in self.modules:
            if module not in names:
                near = difflib.get_close_matches(module, sorted(names), n=1, cutoff=0.5)
                hint = f"did you mean {near[0]!r}? " if near else ""
                raise UsageError(
                    f"device map for {component}: module {module!r} does not exist",
                    fix=f"{hint}names are as infer_auto_device_map writes them ('' = the root)",
                )

    def load(self, comp: Component, dtype: torch.dtype, ctx: LoadContext) -> Loaded:
        extra: dict[str, Any] = {}
        mapping = dict(self.modules)
        if "disk" in mapping.values():
            extra["offload_folder"] = str(ctx.offload_folder(comp.name))
            extra.update(workarounds.mixed_map_kwargs(component_class(comp)))
        return Loaded(ctx.load_weights(comp, dtype, device_map=mapping, **extra))

    def execution_device(self, model: torch.nn.Module | None = None) -> torch.device:
        return mapped_device(model, self.device)


@dataclass(frozen=True)
class DeviceMapFile(Placement):
    """A JSON file with one entry per component: a device ("cuda:0", 1, "cpu", "disk"), an
    accelerate strategy ("balanced", ...), or a module map ({"blocks.0": 0, ...}).

    The file is read once, on first use (a training machine that loads the same recipe never
    needs it)."""

    path: Path
    caps: Caps = ()
    budgets: tuple[tuple[str, Caps], ...] | None = None
    name: ClassVar[str] = "device-map file"
    why: ClassVar[str] = "as the device-map file says"

    def __str__(self) -> str:
        return str(self.path)

    @property
    def entries(self) -> dict[str, Placement]:
        return _read_device_map(self.path, self.caps)

    @property
    def needs_cuda(self) -> bool:
        return any(p.needs_cuda for p in self.entries.values())

    def check(self, gpus: int) -> None:
        for component, entry in self.entries.items():
            indices = _gpu_indices(entry)
            if indices and max(indices) >= gpus:
                raise UsageError(
                    f"device map {str(self.path)!r} puts {component} on GPU {max(indices)} but "
                    f"{gpus} GPU(s) are visible",
                    fix=f'use GPU {gpus - 1} at most, or map it to "cpu" or "disk"'
                    if gpus
                    else 'map it to "cpu" or "disk", or run where that GPU exists',
                )

    @property
    def resolved(self) -> bool:
        spread = any(isinstance(p, AccelerateMap) for p in self.entries.values())
        return self.budgets is not None or not spread

    def for_component(self, name: str, class_name: str) -> Placement:
        entries = self.entries
        if name not in entries:
            raise UsageError(
                f"device map {str(self.path)!r} has no entry for {name!r}",
                fix=f'add e.g. "{name}": "cuda:0" (or "cpu", or a module map)',
            )
        entry = entries[name]
        if self.budgets is not None:
            entry = entry.with_budgets(dict((c, dict(b)) for c, b in self.budgets))
        return entry.for_component(name, class_name)

    def need(self, phase: Phase, ctx: PlanContext) -> Need:
        devices: Counter[str] = Counter()
        notes: list[str] = []
        budgets: dict[str, dict[int | str, int]] = {}
        for name in phase.components:
            sub = dataclasses.replace(phase, components=(name,))
            need = self.for_component(name, ctx.comps[name].class_name).need(sub, ctx)
            devices.update(need.devices)
            notes += [need.note] if need.note else []
            budgets.update(need.max_memory)
        return Need(dict(devices), "; ".join(notes), budgets)


def _gpu_indices(entry: Placement) -> list[int]:
    if isinstance(entry, Cuda):
        return [entry.index or 0]
    if isinstance(entry, ModuleMap):
        return [d for _, d in entry.modules if isinstance(d, int)]
    return []


def _device_entry(value: Any, where: str, path: Path) -> int | str:
    """A device-map value as accelerate wants it: GPU index int, "cpu" or "disk"."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    index = gpu_index("cuda:0" if value == "cuda" else value) if isinstance(value, str) else None
    if index is not None:
        return index
    if value in ("cpu", "disk"):
        return value
    raise UsageError(
        f"device map {str(path)!r}: {where} = {value!r} is not a device",
        fix='use a GPU index (0), "cuda:N", "cpu" or "disk"',
    )


def _entry(name: str, value: Any, path: Path, caps: Caps) -> Placement:
    """One component's entry as a placement."""
    spread = {"balanced": Balanced, "balanced_low_0": BalancedLow0, "sequential": Sequential}
    if isinstance(value, str) and value in spread:
        return spread[value](caps=caps)
    modules = (
        tuple((m, _device_entry(v, f"{name}.{m or '<root>'}", path)) for m, v in value.items())
        if isinstance(value, dict)
        else (("", _device_entry(value, name, path)),)
    )
    devices = {d for _, d in modules}
    if (len(devices) > 1 or "disk" in devices) and workarounds.never_split(
        COMPONENT_CLASSES[name][1]
    ):
        raise UsageError(
            f"device map {str(path)!r} splits or disk-offloads the vae",
            fix='map "vae" to one GPU or "cpu": its causal cache does not survive '
            "accelerate's per-module hooks",
        )
    if isinstance(value, dict):
        return ModuleMap(modules)
    device = modules[0][1]
    if device == "disk":
        return DiskOffload()
    return Cpu() if device == "cpu" else Cuda(int(device))


@functools.lru_cache(maxsize=16)
def _read_device_map(path: Path, caps: Caps) -> dict[str, Placement]:
    """Read and check a per-component device-map file (once per path)."""
    if not path.is_file():
        raise UsageError(f"device map {str(path)!r} does not exist", fix="pass an existing .json")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"device map {str(path)!r} is not valid JSON: {e}") from None
    if not isinstance(data, dict) or not data:
        raise UsageError(
            f"device map {str(path)!r} must be a JSON object keyed by component",
            fix='e.g. {"text_encoder": "cuda:0", "transformer": {"": 0}, "vae": "cpu"}',
        )
    for name in data:
        if name not in COMPONENT_CLASSES:
            close = difflib.get_close_matches(name, list(COMPONENT_CLASSES), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise UsageError(
                f"device map {str(path)!r}: unknown component {name!r}",
                fix=f"{hint}keys are {', '.join(COMPONENT_CLASSES)}",
            )
    return {name: _entry(name, value, path, caps) for name, value in data.items()}
