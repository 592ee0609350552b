"""Load one teacher component with a `Placement`, and unload it for the next phase.

The strategies themselves (which library call puts a component where) are the typed objects of
`wandistill.placement`; this module resolves them against a machine and a teacher once
(`resolve_placement`: `auto` becomes the plan's choice, `cuda` the rank's GPU, device maps get
the plan's max_memory) and supplies what every load needs:

* local safetensors only, load failures as one-line errors;
* every disk-offloaded component gets its own offload folder (per component, rank and run):
  two experts sharing one folder silently read each other's weights;
* after loading, the fp32-kept layers are float32 (`workarounds.restore_fp32_offloaded`), every
  parameter has the dtype a plain load gives, and every tensor is placed: one left on the meta
  device that no offload hook serves is an error, not a silent random weight (the failure mode
  of pipeline-level `balanced`), as is one off the devices the strategy allows.

`load_component` returns a module in eval mode with requires_grad off; `execution_device` says
where its inputs go; `unload` removes hooks, frees the weights and the offload folder.
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import tempfile
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from wandistill.errors import UsageError, WandistillError
from wandistill.io.modelfolder import load_pretrained
from wandistill.placement.devicemap import DeviceMapFile
from wandistill.placement.estimate import SamplerSizes, fp32_kept
from wandistill.placement.inventory import Inventory
from wandistill.placement.oom import oom_guard
from wandistill.placement.parse import Auto
from wandistill.placement.plan import make_plan
from wandistill.placement.protocol import component_class
from wandistill.placement.strategies import AccelerateMap, Placement
from wandistill.runtime import workarounds
from wandistill.teacher.folder import Component, TeacherFolder

__all__ = [
    "Placed",
    "execution_device",
    "load_component",
    "oom_guard_for",
    "park",
    "placement_of",
    "resolve_placement",
    "unload",
]

_ATTR = "_wandistill_placed"


@dataclass(frozen=True, slots=True)
class Placed:
    """How a loaded component was placed (attached to the module; see `placement_of`)."""

    component: str
    placement: Placement
    """The concrete strategy this component was loaded with (after `for_component`)."""
    execution_device: torch.device
    offload_dir: Path | None = None
    hook: Any = None
    """model-offload: accelerate's UserCpuOffloadHook (`park` calls its offload())."""
    cleanup: Callable[[], Any] | None = None
    """Removes the offload folder; also runs when the module is garbage-collected or at exit."""


# --------------------------------------------------------------------------- resolution


def _visible_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _rank_view(
    inventory: Inventory, world_size: int, local_rank: int
) -> tuple[Inventory, int | None]:
    """Under torchrun with several processes per node, each rank plans for its own GPU only.

    One process per node (LOCAL_WORLD_SIZE=1) owns all the node's GPUs (device maps over them).
    """
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if local_world > 1 and 0 <= local_rank < len(inventory.gpus):
        return inventory.only(local_rank), local_rank
    return inventory, None


def resolve_placement(
    placement: Placement,
    *,
    folder: TeacherFolder | str | Path | Mapping[str, Mapping[str, Any]],
    dtype: torch.dtype,
    sizes: SamplerSizes | None = None,
    inventory: Inventory | None = None,
    world_size: int = 1,
    local_rank: int = 0,
    experts_resident: int = 1,
    components: tuple[str, ...] | None = None,
    only: tuple[type[Placement], ...] | None = None,
) -> Placement:
    """The concrete placement to load every component with; call once per run.

    Checked before a device is touched (UsageError): placements needing CUDA on a CPU-only
    machine, GPU indices that do not exist, device-map files (bad JSON, unknown components or
    modules). `auto` becomes the plan's choice for `sizes` (the fastest strategy that fits every
    phase, activations included); balanced / balanced_low_0 / sequential (and device-map file
    entries naming them) get the per-component max_memory the plan computed, so the loader hands
    accelerate exactly the budget `wandistill plan` prints; `cuda` and the offloads get the
    current GPU. Under torchrun with several ranks per node, `auto` plans for GPU `local_rank`.
    `components` / `only`: plan just those components / let `auto` pick only those strategy
    types (eval and sample: `Cuda` or `Cpu`).
    """
    inv = inventory if inventory is not None else Inventory.detect()
    placement.check(len(inv.gpus))
    auto = isinstance(placement, Auto)
    view, own = _rank_view(inv, world_size, local_rank) if auto else (inv, None)
    mapped = isinstance(placement, (AccelerateMap, DeviceMapFile))
    if auto or (mapped and placement.budgets is None):
        plan = make_plan(
            folder,
            dtype=dtype,
            sizes=sizes or SamplerSizes(),
            inventory=view,
            placement=placement,
            experts_resident=experts_resident,
            components=components,
            only=only,
        )
        placement = _planned(plan, placement)
    if own is not None:  # the plan saw this rank's GPU as cuda:0
        return placement.on_gpu(own)
    current = torch.cuda.current_device() if torch.cuda.is_available() else 0
    return placement.bind(current if inv.has_cuda else None)


def _planned(plan: Any, placement: Placement) -> Placement:
    """The plan's row for `placement` (auto: the plan's choice), with its budgets."""
    if not isinstance(placement, Auto):
        return plan.strategy(placement).placement
    if plan.auto.placement is None:
        raise WandistillError(
            f"teacher {plan.teacher} does not fit this machine with any placement: "
            f"{plan.auto.reason}",
            fix="see `wandistill plan`; use --dtype bf16, a smaller batch/resolution, "
            "or free disk space for --placement disk-offload",
        )
    return plan.auto.placement


# --------------------------------------------------------------------------- loading


@dataclass(slots=True)
class _Loader:
    """The services `Placement.load` uses (wandistill.placement.LoadContext)."""

    offload_root: Path | None
    folder: Path | None = None
    created: list[Path] = field(default_factory=list)

    def load_weights(self, comp: Component, dtype: torch.dtype, **kwargs: Any) -> Any:
        """The library's from_pretrained: local safetensors only, failures as one-line errors."""
        cls = component_class(comp)
        try:
            return load_pretrained(cls, comp.path, **workarounds.dtype_kwarg(cls, dtype), **kwargs)
        except OSError as e:
            raise UsageError(
                f"could not load {cls.__name__} from {str(comp.path)!r}: {str(e).splitlines()[0]}",
                fix="check the teacher folder's weights (*.safetensors) and config.json",
            ) from None
        except ValueError as e:
            if workarounds.incomplete_device_map(e):
                raise UsageError(
                    f"the device map for {comp.name} does not cover every weight: {e}",
                    fix='add the missing module to the map, or map "" (the root) as a default',
                ) from None
            if "offload" in str(e) or "disk" in str(e):
                raise WandistillError(
                    f"{comp.name} does not fit on the GPUs with placement "
                    f"{kwargs.get('device_map')!r} (accelerate would spill weights to disk)",
                    fix="run `wandistill plan`; try --placement group-offload or disk-offload, "
                    "or raise max_memory",
                ) from None
            raise

    def offload_folder(self, name: str) -> Path:
        """A fresh folder for one (component, rank, run): never shared, never reused; the
        parents made here are removed with it, so no empty `.offload/rank0/` stays behind."""
        base = Path(self.offload_root or Path(tempfile.gettempdir()) / "wandistill-offload")
        self.created = [p for p in (base.absolute(), *base.absolute().parents) if not p.exists()]
        base.mkdir(parents=True, exist_ok=True)
        prefix = f"{name}-rank{os.environ.get('RANK', '0')}-pid{os.getpid()}-"
        self.folder = Path(tempfile.mkdtemp(prefix=prefix, dir=base))
        return self.folder


def _remove_offload(folder: str, created: list[str]) -> None:
    shutil.rmtree(folder, ignore_errors=True)
    for parent in created:
        with contextlib.suppress(OSError):  # not empty: another component still uses it
            os.rmdir(parent)


def load_component(
    folder: TeacherFolder | str | Path,
    name: str,
    *,
    dtype: torch.dtype,
    placement: Placement,
    offload_dir: Path | None = None,
    sizes: SamplerSizes | None = None,
) -> torch.nn.Module:
    """Load `folder/name` with `placement`; return it ready to call (eval, no grad).

    `name`: text_encoder (transformers UMT5EncoderModel), transformer / transformer_2 (diffusers
    WanTransformer3DModel) or vae (diffusers AutoencoderKLWan). Pass `resolve_placement`'s
    result so `auto` is planned once for all components (an unresolved placement is resolved
    here for `sizes`). `offload_dir`: where disk offload makes this component's own subfolder
    (default: the system temp dir), removed by `unload`. Loads local safetensors only.
    """
    folder = TeacherFolder.coerce(folder)
    comp = folder.component(name)
    placement.check(_visible_gpus())
    if not placement.resolved:
        placement = resolve_placement(placement, folder=folder, dtype=dtype, sizes=sizes)
    concrete = placement.for_component(name, comp.class_name)
    loader = _Loader(offload_dir)
    with oom_guard(concrete.execution_device(None), concrete, component=name):
        loaded = concrete.load(comp, dtype, loader)
    model = loaded.model
    cleanup = None
    if loader.folder is not None:
        cleanup = weakref.finalize(
            model, _remove_offload, str(loader.folder), [str(p) for p in loader.created]
        )
    workarounds.restore_fp32_offloaded(model, dtype, fp32_kept(type(model), dtype))
    _check_dtypes(model, name, dtype)
    _check_placed(model, name, concrete, concrete.allowed_devices(model))
    model.eval().requires_grad_(False)
    placed = Placed(
        component=name,
        placement=concrete,
        execution_device=concrete.execution_device(model),
        offload_dir=loader.folder,
        hook=loaded.hook,
        cleanup=cleanup,
    )
    setattr(model, _ATTR, placed)
    return model


# --------------------------------------------------------------------------- verification


def _check_dtypes(model: torch.nn.Module, name: str, dtype: torch.dtype) -> None:
    kept = fp32_kept(type(model), dtype)
    for full, p in model.named_parameters():
        if not p.is_floating_point():
            continue
        want = torch.float32 if kept(full) else dtype
        if p.dtype != want:
            raise WandistillError(
                f"{name}: parameter {full} is {p.dtype} after loading, expected {want}",
                fix="report this with your diffusers/transformers/accelerate versions",
            )


def _check_placed(
    model: torch.nn.Module, name: str, placement: Placement, allowed: set[str] | None
) -> None:
    """Every tensor is on an allowed device, or served by an offload hook; nothing on meta."""
    served = workarounds.served_names(model)
    orphans, misplaced = [], []
    for full, t in [*model.named_parameters(), *model.named_buffers()]:
        dev = str(t.device)
        if t.device.type == "meta":
            if full not in served:
                orphans.append(full)
        elif allowed is not None and dev not in allowed:
            misplaced.append(f"{full} on {dev}")
    if orphans:
        raise WandistillError(
            f"{name}: {len(orphans)} tensor(s) were never loaded with placement "
            f"{placement.label!r} (e.g. {orphans[0]} is still on the meta device)",
            fix="the component did not fit or the device map missed modules; run `wandistill "
            "plan`, cover every module in the device map, or pick a placement that fits",
        )
    if misplaced:
        raise WandistillError(
            f"{name}: {len(misplaced)} tensor(s) landed off the placement {placement.label!r} "
            f"(e.g. {misplaced[0]})",
            fix="run `wandistill plan` and pick a placement that fits, or raise max_memory",
        )


# --------------------------------------------------------------------------- public API


def placement_of(module: torch.nn.Module) -> Placed | None:
    """How `module` was placed by `load_component` (None for modules loaded elsewhere)."""
    return getattr(module, _ATTR, None)


def execution_device(module: torch.nn.Module) -> torch.device:
    """Where inputs to `module` must be sent (not where its weights rest between forwards)."""
    placed = placement_of(module)
    if placed is not None:
        return placed.execution_device
    from diffusers.utils.torch_utils import get_module_execution_device

    return torch.device(get_module_execution_device(module))


def oom_guard_for(module: torch.nn.Module) -> contextlib.AbstractContextManager[None]:
    """`oom_guard` for running a loaded component: out-of-memory errors inside name its device,
    its strategy and the next strategies to try (wrap the sampler's forward calls in it)."""
    placed = placement_of(module)
    if placed is None:
        return oom_guard(execution_device(module), None)
    return oom_guard(placed.execution_device, placed.placement, component=placed.component)


def park(module: torch.nn.Module) -> None:
    """model-offload: move the component back to the CPU now (e.g. between Wan 2.2 experts).

    No-op for other strategies (their hooks already move weights per forward, or they stay put).
    """
    placed = placement_of(module)
    if placed is not None and placed.hook is not None:
        placed.hook.offload()


def unload(module: torch.nn.Module) -> None:
    """Free a component: remove its hooks, drop its weights, delete its offload folder.

    Safe to call on any module; afterwards it holds only meta tensors, so a forgotten reference
    keeps no memory (and fails loudly if called). Then gc and, on CUDA, empty the cache.
    """
    from accelerate.hooks import remove_hook_from_module

    placed = placement_of(module)
    remove_hook_from_module(module, recurse=True)
    workarounds.remove_diffusers_hooks(module)
    torch.nn.Module.to_empty(module, device="meta")
    if placed is not None and placed.cleanup is not None:
        placed.cleanup()
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
