"""Teacher placements as typed objects: `--placement` is parsed once, objects go everywhere.

`parse_placement("group-offload", group_offload_level="leaf_level")` (done by the recipe loader,
so the CLI flag, the TOML key and `--set` all land here) gives a `GroupOffload`; nothing
downstream looks at the text again. Each strategy is one small class that answers:

* `needs_cuda` / `check(gpus)`: can this machine run it (one-line `UsageError` if not);
* `need(phase, ctx)`: memory per device for one precompute phase (`wandistill.teacher.plan`
  builds `ctx` from a `TeacherFolder`, a dtype and the sampler sizes); `wandistill plan` and
  the loader use these same numbers: a device-map strategy resolved from a plan carries the
  exact `max_memory` the plan printed and passes it to the library;
* `load(component, dtype, ctx)`: the library call that puts one component there
  (`wandistill.teacher.placement.load_component` supplies `ctx` and checks the result);
* `next_to_try(...)`: what to suggest after running out of memory.

This module sits outside `teacher/` because the recipe (`wandistill.config`) parses the
placement and `train/` loads recipes but must never import `teacher/`; it imports nothing of
`teacher/` and no diffusers at module level.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from wandistill import workarounds
from wandistill.errors import UsageError
from wandistill.modelfolder import COMPONENT_CLASSES

if TYPE_CHECKING:
    import torch

    from wandistill.teacher.folder import Component
    from wandistill.teacher.plan import Phase, PlanContext

__all__ = [
    "CPU_OVERHEAD",
    "CUDA_OVERHEAD",
    "GROUP_LEVELS",
    "NAMES",
    "Auto",
    "Balanced",
    "BalancedLow0",
    "Cpu",
    "Cuda",
    "DeviceMapFile",
    "DiskOffload",
    "GroupOffload",
    "ModelOffload",
    "ModuleMap",
    "Need",
    "Placement",
    "Sequential",
    "parse_device",
    "parse_max_memory",
    "parse_placement",
    "parse_size",
]

GiB = 1 << 30
#: Allowance per GPU for the CUDA context, cuBLAS workspaces and caching-allocator slack.
CUDA_OVERHEAD = 1 * GiB
#: Allowance on the CPU for the Python process itself (torch, diffusers, transformers imported).
CPU_OVERHEAD = 2 * GiB
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
Caps = tuple[tuple[int | str, int], ...]
"""max_memory as hashable pairs: (GPU index or "cpu", bytes)."""


# --------------------------------------------------------------------------- sizes


def parse_size(value: Any, what: str) -> int:
    """Bytes from "80GiB", "80 GiB", "80GB", "512MiB", "2TiB" or an int (what accelerate's
    `convert_file_size_to_int` accepts, plus TiB/TB); anything else is one UsageError naming
    `what` and the nearest valid spelling."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value > 0:
            return value
        raise UsageError(f"{what} {value} must be positive", fix=f"e.g. {what} 80GiB")
    text = str(value).strip()
    scaled = re.fullmatch(r"(.*?)\s*([tT])(i?)([bB])", text)
    if scaled:  # accelerate stops at GB/GiB: express TB/TiB in GB/GiB for it
        num, _, i, b = scaled.groups()
        factor = 1024 if i else 1000
        text = f"{_number(num, what, value) * factor}G{i}{b}"
    from accelerate.utils import convert_file_size_to_int

    try:
        size = convert_file_size_to_int(text)
    except (ValueError, OverflowError):
        size = -1
    if size <= 0:
        raise UsageError(
            f"{what} {value!r} is not a memory size", fix=f"write it like {_nearest_size(text)}"
        )
    return size


def _number(num: str, what: str, value: Any) -> float:
    try:
        return float(num)
    except ValueError:
        raise UsageError(f"{what} {value!r} is not a memory size", fix="e.g. 2TiB") from None


def _nearest_size(text: str) -> str:
    """The accepted spelling closest to a refused size: keep the number, fix the unit."""
    m = re.match(r"\s*-?(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)", text)
    if not m:
        return "80GiB (or 80GB, 512MiB, 2TiB)"
    unit = (m.group(2) or "G").upper()
    return f"{m.group(1)}{unit}iB"


def parse_max_memory(caps: Mapping[Any, Any] | None, what: str = "max_memory") -> Caps:
    """{"0": "70GiB", "cuda:1": "70GiB", "cpu": "200GiB"} -> ((0, n), (1, n), ("cpu", n))."""
    out: list[tuple[int | str, int]] = []
    for key, value in (caps or {}).items():
        k = str(key).removeprefix("cuda:")
        if k.isdigit():
            device: int | str = int(k)
        elif k == "cpu":
            device = "cpu"
        else:
            raise UsageError(
                f"{what} key {key!r} is not a device",
                fix='use a GPU index ("0"), "cuda:N" or "cpu"',
            )
        out.append((device, parse_size(value, f"{what}.{key}")))
    return tuple(sorted(out, key=lambda kv: (isinstance(kv[0], str), str(kv[0]))))


# --------------------------------------------------------------------------- protocol


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
    """What `Placement.load` gets from the loader (wandistill.teacher.placement)."""

    def load_weights(
        self, comp: Component, dtype: torch.dtype, **kwargs: Any
    ) -> torch.nn.Module: ...

    def offload_folder(self, name: str) -> Path: ...


def component_class(comp: Component) -> type:
    """The library class of a teacher component (diffusers / transformers, imported lazily)."""
    import importlib

    return getattr(importlib.import_module(comp.library), comp.class_name)


def _merge(into: dict[str, int], need: Mapping[str, int]) -> None:
    for device, n in need.items():
        into[device] = into.get(device, 0) + n


def _exec_gpu(device: str | None) -> str | None:
    return device if device is not None and device.startswith("cuda") else None


@dataclass(frozen=True)
class Placement:
    """One placement strategy. Subclasses set `name` (the --placement value) and `why`."""

    name: ClassVar[str]
    why: ClassVar[str] = ""
    """What it costs at run time (the plan's note for a strategy that fits)."""

    def __str__(self) -> str:
        return self.name

    @property
    def label(self) -> str:
        """The strategy as error messages name it."""
        return str(self)

    @property
    def needs_cuda(self) -> bool:
        return False

    @property
    def cpu_only(self) -> bool:
        """Runs entirely on the CPU (torchrun ranks then bind no GPU)."""
        return False

    def flags(self) -> str:
        """The command-line flags that select this placement."""
        return f"--placement {self}"

    def to_recipe(self) -> str:
        return str(self)

    def check(self, gpus: int) -> None:
        """UsageError if a machine with `gpus` visible GPUs cannot run this placement."""
        if self.needs_cuda and gpus == 0:
            raise UsageError(
                f"placement {str(self)!r} needs CUDA GPUs but none is visible; "
                "use --placement cpu or disk-offload",
                fix="run on a machine with a GPU, or pass --placement cpu (or disk-offload, "
                "or auto)",
            )

    def bind(self, gpu: int | None) -> Placement:
        """The placement with every "the current GPU" made concrete (`gpu`; None: no GPU)."""
        return self

    def for_component(self, name: str, class_name: str) -> Placement:
        """How component `name` is actually placed (exceptions in `workarounds`)."""
        return self

    def on_gpu(self, gpu: int) -> Placement:
        """The same strategy on GPU `gpu` (a torchrun rank's own GPU) instead of its current one."""
        return self

    def with_budgets(self, budgets: Mapping[str, Mapping[int | str, int]]) -> Placement:
        """Device-map strategies keep the plan's per-component max_memory; others ignore it."""
        return self

    @property
    def resolved(self) -> bool:
        """Ready for `load` (no plan or device still to choose)."""
        return True

    def need(self, phase: Phase, ctx: PlanContext) -> Need:
        """Memory per device while `phase` runs (every concrete strategy defines it)."""
        raise TypeError(f"placement {self} is chosen by a plan; it is never planned itself")

    def load(self, comp: Component, dtype: torch.dtype, ctx: LoadContext) -> Loaded:
        """Put one component there (every concrete strategy defines it)."""
        raise TypeError(f"placement {self} is resolved per component before loading")

    def execution_device(self, model: torch.nn.Module | None = None) -> torch.device:
        """Where inputs of a component loaded with this placement must go (`model`: the loaded
        component, for strategies whose device map decides; None: the expected device)."""
        import torch

        return torch.device("cpu")

    def allowed_devices(self, model: torch.nn.Module) -> set[str] | None:
        """Devices real tensors may sit on after loading (None: not checked)."""
        return None

    def next_to_try(self, gpus: int) -> list[Placement]:
        """Placements to suggest after this one ran out of GPU memory, most promising first."""
        return [GroupOffload(), GroupOffload(level="leaf_level"), DiskOffload()]


@dataclass(frozen=True, slots=True)
class Loaded:
    """A loaded component and what its placement attached."""

    model: torch.nn.Module
    hook: Any = None
    """model-offload: accelerate's UserCpuOffloadHook (`park` calls its offload())."""


def _weights(ctx: PlanContext, phase: Phase) -> int:
    return sum(ctx.comps[c].weight_bytes for c in phase.components)


def _component_override(p: Placement, phase: Phase, ctx: PlanContext) -> Placement | None:
    """The placement a single-component phase really uses, if `for_component` changes it."""
    if len(phase.components) != 1:
        return None
    name = phase.components[0]
    other = p.for_component(name, ctx.comps[name].class_name)
    return None if other == p else other


# --------------------------------------------------------------------------- cpu / cuda


@dataclass(frozen=True)
class Cpu(Placement):
    name: ClassVar[str] = "cpu"
    why: ClassVar[str] = "computes on the CPU: orders of magnitude slower at real Wan sizes"

    @property
    def cpu_only(self) -> bool:
        return True

    def need(self, phase: Phase, ctx: PlanContext) -> Need:
        return Need({"cpu": CPU_OVERHEAD + _weights(ctx, phase) + phase.activation_bytes})

    def load(self, comp: Component, dtype: torch.dtype, ctx: LoadContext) -> Loaded:
        return Loaded(ctx.load_weights(comp, dtype))

    def allowed_devices(self, model: torch.nn.Module) -> set[str] | None:
        return {"cpu"}

    def next_to_try(self, gpus: int) -> list[Placement]:
        return [DiskOffload()]


@dataclass(frozen=True)
class Cuda(Placement):
    """One whole component per GPU: `cuda` (the current GPU: the rank's under torchrun),
    `cuda:N`, or `gpu0` (cuda:0, leaving the other GPUs to `train`)."""

    index: int | None = None
    alias: str = ""
    name: ClassVar[str] = "cuda"
    why: ClassVar[str] = "all weights resident on one GPU, no transfers"

    def __str__(self) -> str:
        return self.alias or ("cuda" if self.index is None else f"cuda:{self.index}")

    @property
    def needs_cuda(self) -> bool:
        return True

    @property
    def device(self) -> str:
        return f"cuda:{self.index or 0}"

    def check(self, gpus: int) -> None:
        Placement.check(self, gpus)
        if self.index is not None and self.index >= gpus:
            raise UsageError(
                f"placement {str(self)!r} names a GPU this machine does not have ({gpus} visible)",
                fix=f"use cuda:{gpus - 1} (the highest index here), or set CUDA_VISIBLE_DEVICES",
            )

    def bind(self, gpu: int | None) -> Placement:
        if self.resolved:
            return self
        return Cuda(self.index if self.index is not None else (gpu or 0))

    @property
    def resolved(self) -> bool:
        return self.index is not None and not self.alias

    def need(self, phase: Phase, ctx: PlanContext) -> Need:
        total = _weights(ctx, phase) + phase.activation_bytes + CUDA_OVERHEAD
        return Need({"cpu": CPU_OVERHEAD, self.device: total})

    def load(self, comp: Component, dtype: torch.dtype, ctx: LoadContext) -> Loaded:
        return Loaded(ctx.load_weights(comp, dtype, device_map=self.device))

    def on_gpu(self, gpu: int) -> Placement:
        return Cuda(gpu)

    def execution_device(self, model: torch.nn.Module | None = None) -> torch.device:
        import torch

        return torch.device(self.device)

    def allowed_devices(self, model: torch.nn.Module) -> set[str] | None:
        return {self.device}

    def next_to_try(self, gpus: int) -> list[Placement]:
        spread: list[Placement] = [Balanced()] if gpus > 1 else []
        return [*spread, ModelOffload(), GroupOffload(), DiskOffload()]


# --------------------------------------------------------------------------- device maps


@dataclass(frozen=True)
class AccelerateMap(Placement):
    """accelerate's automatic device maps over the GPUs (balanced / balanced_low_0 / sequential).

    `caps`: the user's max_memory. `budgets`: per component, the max_memory the plan simulated
    with (free memory - activation headroom - CUDA overhead, capped) and the loader passes."""

    caps: Caps = ()
    budgets: tuple[tuple[str, Caps], ...] | None = None
    low_zero: ClassVar[bool] = False

    @property
    def needs_cuda(self) -> bool:
        return True

    def with_budgets(self, budgets: Mapping[str, Mapping[int | str, int]]) -> Placement:
        packed = tuple((c, tuple(b.items())) for c, b in sorted(budgets.items()))
        return dataclasses.replace(self, budgets=packed)

    @property
    def resolved(self) -> bool:
        return self.budgets is not None

    def budget(self, component: str) -> dict[int | str, int]:
        """The max_memory to pass when loading `component` (from the plan)."""
        for name, caps in self.budgets or ():
            if name == component:
                return dict(caps)
        raise KeyError(component)

    def for_component(self, name: str, class_name: str) -> Placement:
        if workarounds.never_split(class_name):
            gpus = [k for k, _ in self.caps if isinstance(k, int)]
            return Cuda(min(gpus, default=0))
        return self

    def need(self, phase: Phase, ctx: PlanContext) -> Need:
        other = _component_override(self, phase, ctx)
        if other is not None:
            return other.need(phase, ctx)
        return ctx.simulate_device_map(phase, self.name, low_zero=self.low_zero)

    def load(self, comp: Component, dtype: torch.dtype, ctx: LoadContext) -> Loaded:
        budget = self.budget(comp.name)
        return Loaded(ctx.load_weights(comp, dtype, device_map=self.name, max_memory=budget))

    def execution_device(self, model: torch.nn.Module | None = None) -> torch.device:
        import torch

        if model is None:
            return torch.device("cuda", 0)
        from diffusers.utils.torch_utils import get_module_execution_device

        return torch.device(get_module_execution_device(model))

    def allowed_devices(self, model: torch.nn.Module) -> set[str] | None:
        dmap = getattr(model, "hf_device_map", None) or {}
        gpus = {f"cuda:{v}" for v in dmap.values() if isinstance(v, int)}
        return gpus | ({"cpu"} if "cpu" in dmap.values() else set()) or None


@dataclass(frozen=True)
class Balanced(AccelerateMap):
    name: ClassVar[str] = "balanced"
    why: ClassVar[str] = "layers spread evenly over the GPUs; one GPU computes at a time"


@dataclass(frozen=True)
class Sequential(AccelerateMap):
    name: ClassVar[str] = "sequential"
    why: ClassVar[str] = "GPUs filled in order; one GPU computes at a time"


@dataclass(frozen=True)
class BalancedLow0(AccelerateMap):
    name: ClassVar[str] = "balanced_low_0"
    why: ClassVar[str] = "like balanced, keeping GPU 0 light"
    low_zero: ClassVar[bool] = True


@dataclass(frozen=True)
class ModuleMap(Placement):
    """An explicit accelerate device map for one component (a device-map file's entry)."""

    modules: tuple[tuple[str, int | str], ...]
    """(module name, device): GPU index, "cpu" or "disk"; "" is the root."""
    name: ClassVar[str] = "device-map"
    why: ClassVar[str] = "modules where the device-map file puts them"

    @property
    def mapping(self) -> dict[str, int | str]:
        return dict(self.modules)

    @property
    def needs_cuda(self) -> bool:
        return any(isinstance(d, int) for _, d in self.modules)

    @property
    def device(self) -> str:
        gpus = sorted(d for _, d in self.modules if isinstance(d, int))
        return f"cuda:{gpus[0]}" if gpus else "cpu"

    def need(self, phase: Phase, ctx: PlanContext) -> Need:
        devices: dict[str, int] = {"cpu": CPU_OVERHEAD}
        for name in phase.components:
            sizes = ctx.module_sizes(name)
            self._validate(name, ctx.module_names(name))
            for module, device in self.modules:
                key = f"cuda:{device}" if isinstance(device, int) else device
                devices[key] = devices.get(key, 0) + sizes.get(module, 0)
        overhead = CUDA_OVERHEAD if self.device != "cpu" else 0
        devices[self.device] = devices.get(self.device, 0) + phase.activation_bytes + overhead
        return Need(devices)

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
        if "disk" in self.mapping.values():
            extra["offload_folder"] = str(ctx.offload_folder(comp.name))
            extra.update(workarounds.mixed_map_kwargs(component_class(comp)))
        return Loaded(ctx.load_weights(comp, dtype, device_map=self.mapping, **extra))

    def execution_device(self, model: torch.nn.Module | None = None) -> torch.device:
        import torch

        if model is None:
            return torch.device(self.device)
        from diffusers.utils.torch_utils import get_module_execution_device

        return torch.device(get_module_execution_device(model))


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

    def with_budgets(self, budgets: Mapping[str, Mapping[int | str, int]]) -> Placement:
        packed = tuple((c, tuple(b.items())) for c, b in sorted(budgets.items()))
        return dataclasses.replace(self, budgets=packed)

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
        devices: dict[str, int] = {}
        notes: list[str] = []
        budgets: dict[str, dict[int | str, int]] = {}
        for name in phase.components:
            sub = dataclasses.replace(phase, components=(name,))
            need = self.for_component(name, ctx.comps[name].class_name).need(sub, ctx)
            _merge(devices, need.devices)
            notes += [need.note] if need.note else []
            budgets.update(need.max_memory)
        return Need(devices, "; ".join(notes), budgets)


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
    if isinstance(value, str) and value.startswith("cuda:") and value[5:].isdigit():
        return int(value[5:])
    if value == "cuda":
        return 0
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
    if isinstance(value, dict):
        modules = tuple(
            (m, _device_entry(v, f"{name}.{m or '<root>'}", path)) for m, v in value.items()
        )
        devices = {d for _, d in modules}
        if (len(devices) > 1 or "disk" in devices) and workarounds.never_split(_class_name(name)):
            raise UsageError(
                f"device map {str(path)!r} splits or disk-offloads the vae",
                fix='map "vae" to one GPU or "cpu": its causal cache does not survive '
                "accelerate's per-module hooks",
            )
        return ModuleMap(modules)
    device = _device_entry(value, name, path)
    if device == "disk":
        if workarounds.never_split(_class_name(name)):
            raise UsageError(
                f"device map {str(path)!r} disk-offloads the vae",
                fix='map "vae" to one GPU or "cpu": its causal cache does not survive '
                "accelerate's per-module hooks",
            )
        return DiskOffload()
    return Cpu() if device == "cpu" else Cuda(int(device))


def _class_name(component: str) -> str:
    return COMPONENT_CLASSES.get(component, ("", ""))[1]


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


# --------------------------------------------------------------------------- offloading


@dataclass(frozen=True)
class _Offload(Placement):
    """Weights rest off the GPU; `device` is where they compute (None: the current GPU)."""

    device: str | None = None

    @property
    def needs_cuda(self) -> bool:
        return self.device is None or self.device.startswith("cuda")

    def bind(self, gpu: int | None) -> Placement:
        if self.device is not None:
            return self
        return dataclasses.replace(self, device="cpu" if gpu is None else f"cuda:{gpu}")

    @property
    def resolved(self) -> bool:
        return self.device is not None

    def on_gpu(self, gpu: int) -> Placement:
        if self.device is None or self.device.startswith("cuda"):
            return dataclasses.replace(self, device=f"cuda:{gpu}")
        return self

    def execution_device(self, model: torch.nn.Module | None = None) -> torch.device:
        import torch

        return torch.device(self.device or "cpu")

    def _whole(self) -> Placement:
        """Where a component that must not be split runs: whole on the execution device."""
        gpu = _exec_gpu(self.device)
        return Cuda(int(gpu.split(":")[1])) if gpu else Cpu()


@dataclass(frozen=True)
class ModelOffload(_Offload):
    name: ClassVar[str] = "model-offload"
    why: ClassVar[str] = "whole component copied CPU->GPU when it starts to run"

    def need(self, phase: Phase, ctx: PlanContext) -> Need:
        biggest = max(ctx.comps[c].weight_bytes for c in phase.components)
        devices = {"cpu": CPU_OVERHEAD + _weights(ctx, phase)}
        _merge(devices, {self.device or ctx.gpu: biggest + phase.activation_bytes + CUDA_OVERHEAD})
        return Need(devices)

    def load(self, comp: Component, dtype: torch.dtype, ctx: LoadContext) -> Loaded:
        from accelerate import cpu_offload_with_hook

        model, hook = cpu_offload_with_hook(ctx.load_weights(comp, dtype), self.device)
        return Loaded(model, hook)

    def allowed_devices(self, model: torch.nn.Module) -> set[str] | None:
        return {"cpu"}


@dataclass(frozen=True)
class GroupOffload(_Offload):
    level: str = "block_level"
    name: ClassVar[str] = "group-offload"
    why: ClassVar[str] = "one block group at a time copied CPU->GPU (overlapped on CUDA streams)"

    @property
    def label(self) -> str:
        return "group-offload (leaf_level)" if self.level == "leaf_level" else self.name

    def flags(self) -> str:
        if self.level == "leaf_level":
            return (
                f"{Placement.flags(self)} --set precompute.teacher.group_offload_level=leaf_level"
            )
        return Placement.flags(self)

    def for_component(self, name: str, class_name: str) -> Placement:
        if workarounds.never_split(class_name):
            return self._whole()
        level = workarounds.group_offload_level(class_name, self.level)
        return self if level == self.level else dataclasses.replace(self, level=level)

    def need(self, phase: Phase, ctx: PlanContext) -> Need:
        other = _component_override(self, phase, ctx)
        if other is not None:
            return other.need(phase, ctx)
        inflight = 2 if ctx.inventory.has_cuda else 1  # current group + the prefetched one
        on_gpu = 0
        for name in phase.components:
            c = ctx.comps[name]
            if self.level == "leaf_level":
                on_gpu = max(on_gpu, inflight * c.largest_leaf_bytes)
            else:
                on_gpu = max(on_gpu, c.resident_bytes + inflight * c.largest_group_bytes)
        devices = {"cpu": CPU_OVERHEAD + _weights(ctx, phase)}
        _merge(devices, {self.device or ctx.gpu: on_gpu + phase.activation_bytes + CUDA_OVERHEAD})
        return Need(devices)

    def load(self, comp: Component, dtype: torch.dtype, ctx: LoadContext) -> Loaded:
        import torch
        from diffusers.hooks import apply_group_offloading

        model = ctx.load_weights(comp, dtype)
        device = torch.device(self.device or "cpu")
        streams = device.type == "cuda"
        apply_group_offloading(
            model,
            onload_device=device,
            offload_device=torch.device("cpu"),
            offload_type=self.level,
            num_blocks_per_group=1 if self.level == "block_level" else None,
            non_blocking=streams,
            use_stream=streams,
            record_stream=streams,
        )
        return Loaded(model)

    def allowed_devices(self, model: torch.nn.Module) -> set[str] | None:
        return {"cpu"}

    def next_to_try(self, gpus: int) -> list[Placement]:
        leaf = [] if self.level == "leaf_level" else [GroupOffload(level="leaf_level")]
        return [*leaf, DiskOffload()]


@dataclass(frozen=True)
class DiskOffload(_Offload):
    name: ClassVar[str] = "disk-offload"
    why: ClassVar[str] = "every forward re-reads all weights from disk (page cache helps)"

    @property
    def needs_cuda(self) -> bool:
        return self.device is not None and self.device.startswith("cuda")

    def for_component(self, name: str, class_name: str) -> Placement:
        return self._whole() if workarounds.never_split(class_name) else self

    def need(self, phase: Phase, ctx: PlanContext) -> Need:
        other = _component_override(self, phase, ctx)
        if other is not None:
            return other.need(phase, ctx)
        leaf = max(ctx.comps[c].largest_leaf_bytes for c in phase.components)
        on = self.device or (ctx.gpu if ctx.inventory.has_cuda else "cpu")
        extra = CUDA_OVERHEAD if on != "cpu" else 0
        devices = {"cpu": CPU_OVERHEAD}
        _merge(devices, {on: leaf + phase.activation_bytes + extra})
        # transformers indexes the original safetensors instead of writing .dat copies
        devices["disk"] = sum(
            ctx.comps[c].weight_bytes for c in phase.components if c != "text_encoder"
        )
        return Need(devices)

    def load(self, comp: Component, dtype: torch.dtype, ctx: LoadContext) -> Loaded:
        import torch

        folder = ctx.offload_folder(comp.name)
        model = ctx.load_weights(comp, dtype, device_map={"": "disk"}, offload_folder=str(folder))
        workarounds.redispatch_disk(model, torch.device(self.device or "cpu"), folder)
        return Loaded(model)

    def next_to_try(self, gpus: int) -> list[Placement]:
        return []


# --------------------------------------------------------------------------- auto


@dataclass(frozen=True)
class Auto(Placement):
    """The plan's choice: the fastest strategy that fits every phase (see teacher/plan.py)."""

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


# --------------------------------------------------------------------------- parsing


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
        index = text.removeprefix("cuda:")
        if not index.isdigit():
            raise UsageError(
                f"placement {text!r}: {index!r} is not a GPU index", fix="use cuda:0, cuda:1, ..."
            )
        return Cuda(int(index))
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
