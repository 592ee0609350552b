"""Teacher placements as typed objects: `--placement` is parsed once, objects go everywhere.

`parse_placement("group-offload", group_offload_level="leaf_level")` (`placement.parse`, done by
the recipe loader, so the CLI flag, the TOML key and `--set` all land there) gives a
`GroupOffload`; nothing downstream looks at the text again. Each strategy is one small class
that answers:

* `needs_cuda` / `check(gpus)`: can this machine run it (one-line `UsageError` if not);
* `need(phase, ctx)`: memory per device for one precompute phase (`wandistill.placement.plan`
  builds `ctx` from a `TeacherFolder`, a dtype and the sampler sizes); `wandistill plan` and
  the loader use these same numbers: a device-map strategy resolved from a plan carries the
  exact `max_memory` the plan printed and passes it to the library;
* `load(component, dtype, ctx)`: the library call that puts one component there
  (`wandistill.placement.load.load_component` supplies `ctx` and checks the result);
* `next_to_try(...)`: what to suggest after running out of memory.

The recipe (`wandistill.config`) parses placements and `train/` loads recipes but must never
import `teacher/`: this module, `devices`, `protocol`, `devicemap` and `parse` import nothing of
`teacher/` and no diffusers at module level. Device-map files (`ModuleMap`, `DeviceMapFile`)
live in `placement.devicemap`; `Auto`, the planner's request, in `placement.parse`.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from wandistill.errors import UsageError
from wandistill.placement.devices import CPU_OVERHEAD, CUDA_OVERHEAD, Caps, gpu_index
from wandistill.placement.protocol import LoadContext, Loaded, Need
from wandistill.runtime import workarounds

if TYPE_CHECKING:
    import torch

    from wandistill.placement.plan import Phase, PlanContext
    from wandistill.teacher.folder import Component

__all__ = [
    "AccelerateMap",
    "Balanced",
    "BalancedLow0",
    "Cpu",
    "Cuda",
    "DiskOffload",
    "GroupOffload",
    "ModelOffload",
    "Placement",
    "Sequential",
]


@dataclass(frozen=True)
class Placement:
    """One placement strategy. Subclasses set `name` (the --placement value) and `why`."""

    name: ClassVar[str]
    why: ClassVar[str] = ""
    """What it costs at run time (the plan's note for a strategy that fits)."""
    needs_cuda: ClassVar[bool] = False
    cpu_only: ClassVar[bool] = False
    """Runs entirely on the CPU (torchrun ranks then bind no GPU)."""

    def __str__(self) -> str:
        return self.name

    @property
    def label(self) -> str:
        """The strategy as error messages name it."""
        return str(self)

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
        """Device-map strategies (a `budgets` field) keep the plan's per-component max_memory;
        others ignore it."""
        if not hasattr(self, "budgets"):
            return self
        packed = tuple((c, tuple(b.items())) for c, b in sorted(budgets.items()))
        return dataclasses.replace(self, budgets=packed)

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


def _weights(ctx: PlanContext, phase: Phase) -> int:
    return sum(ctx.comps[c].weight_bytes for c in phase.components)


def mapped_device(model: torch.nn.Module | None, expected: str) -> torch.device:
    """Where a device-mapped `model` computes, as diffusers finds it (None: `expected`)."""
    import torch

    if model is None:
        return torch.device(expected)
    from diffusers.utils.torch_utils import get_module_execution_device

    return torch.device(get_module_execution_device(model))


# --------------------------------------------------------------------------- cpu / cuda


@dataclass(frozen=True)
class Cpu(Placement):
    name: ClassVar[str] = "cpu"
    why: ClassVar[str] = "computes on the CPU: orders of magnitude slower at real Wan sizes"
    cpu_only: ClassVar[bool] = True

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
    needs_cuda: ClassVar[bool] = True

    def __str__(self) -> str:
        return self.alias or ("cuda" if self.index is None else f"cuda:{self.index}")

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
        return self if self.resolved else Cuda(self.index if self.index is not None else (gpu or 0))

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
    needs_cuda: ClassVar[bool] = True

    @property
    def resolved(self) -> bool:
        return self.budgets is not None

    def budget(self, component: str) -> dict[int | str, int]:
        """The max_memory to pass when loading `component` (from the plan)."""
        return dict(dict(self.budgets or ())[component])

    def for_component(self, name: str, class_name: str) -> Placement:
        if workarounds.never_split(class_name):
            gpus = [k for k, _ in self.caps if isinstance(k, int)]
            return Cuda(min(gpus, default=0))
        return self

    def need(self, phase: Phase, ctx: PlanContext) -> Need:
        return ctx.simulate_device_map(phase, self.name, low_zero=self.low_zero)

    def load(self, comp: Component, dtype: torch.dtype, ctx: LoadContext) -> Loaded:
        budget = self.budget(comp.name)
        return Loaded(ctx.load_weights(comp, dtype, device_map=self.name, max_memory=budget))

    def execution_device(self, model: torch.nn.Module | None = None) -> torch.device:
        return mapped_device(model, "cuda:0")

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


# --------------------------------------------------------------------------- offloading


@dataclass(frozen=True)
class _Offload(Placement):
    """Weights rest off the GPU; `device` is where they compute (None: the current GPU)."""

    device: str | None = None

    @property
    def needs_cuda(self) -> bool:
        return self.device is None or self.device.startswith("cuda")

    def bind(self, gpu: int | None) -> Placement:
        where = "cpu" if gpu is None else f"cuda:{gpu}"
        return self if self.resolved else dataclasses.replace(self, device=where)

    @property
    def resolved(self) -> bool:
        return self.device is not None

    def on_gpu(self, gpu: int) -> Placement:
        on_cpu = self.device is not None and not self.device.startswith("cuda")
        return self if on_cpu else dataclasses.replace(self, device=f"cuda:{gpu}")

    def execution_device(self, model: torch.nn.Module | None = None) -> torch.device:
        import torch

        return torch.device(self.device or "cpu")

    def _whole(self) -> Placement:
        """Where a component that must not be split runs: whole on the execution device."""
        index = gpu_index(self.device) if self.device else None
        return Cpu() if index is None else Cuda(index)

    def _need(self, phase: Phase, ctx: PlanContext, on_gpu: int) -> Need:
        """Every weight in CPU RAM, `on_gpu` bytes of them on the execution device at a time."""
        devices = Counter({"cpu": CPU_OVERHEAD + _weights(ctx, phase)})
        devices[self.device or ctx.gpu] += on_gpu + phase.activation_bytes + CUDA_OVERHEAD
        return Need(dict(devices))


@dataclass(frozen=True)
class ModelOffload(_Offload):
    name: ClassVar[str] = "model-offload"
    why: ClassVar[str] = "whole component copied CPU->GPU when it starts to run"

    def need(self, phase: Phase, ctx: PlanContext) -> Need:
        return self._need(phase, ctx, max(ctx.comps[c].weight_bytes for c in phase.components))

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
        leaf = " --set precompute.teacher.group_offload_level=leaf_level"
        return Placement.flags(self) + (leaf if self.level == "leaf_level" else "")

    def for_component(self, name: str, class_name: str) -> Placement:
        if workarounds.never_split(class_name):
            return self._whole()
        level = workarounds.group_offload_level(class_name, self.level)
        return self if level == self.level else dataclasses.replace(self, level=level)

    def need(self, phase: Phase, ctx: PlanContext) -> Need:
        inflight = 2 if ctx.inventory.has_cuda else 1  # current group + the prefetched one
        leaf = self.level == "leaf_level"
        on_gpu = max(
            inflight * c.largest_leaf_bytes
            if leaf
            else c.resident_bytes + inflight * c.largest_group_bytes
            for c in (ctx.comps[n] for n in phase.components)
        )
        return self._need(phase, ctx, on_gpu)

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
        leaf = max(ctx.comps[c].largest_leaf_bytes for c in phase.components)
        on = self.device or (ctx.gpu if ctx.inventory.has_cuda else "cpu")
        extra = CUDA_OVERHEAD if on != "cpu" else 0
        devices = Counter({"cpu": CPU_OVERHEAD})
        devices[on] += leaf + phase.activation_bytes + extra
        # transformers indexes the original safetensors instead of writing .dat copies
        devices["disk"] = sum(
            ctx.comps[c].weight_bytes for c in phase.components if c != "text_encoder"
        )
        return Need(dict(devices))

    def load(self, comp: Component, dtype: torch.dtype, ctx: LoadContext) -> Loaded:
        import torch

        folder = ctx.offload_folder(comp.name)
        model = ctx.load_weights(comp, dtype, device_map={"": "disk"}, offload_folder=str(folder))
        workarounds.redispatch_disk(model, torch.device(self.device or "cpu"), folder)
        return Loaded(model)

    def next_to_try(self, gpus: int) -> list[Placement]:
        return []
