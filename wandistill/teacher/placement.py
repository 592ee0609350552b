"""Load one teacher component with a placement strategy, and unload it for the next phase.

Every strategy is the libraries' own machinery, called per component (never the pipeline):

| placement | how |
|---|---|
| cpu | `from_pretrained(...)` |
| cuda, cuda:N, gpu0 | `from_pretrained(device_map="cuda:N")`; gpu0 is cuda:0 |
| balanced, balanced_low_0, sequential | `from_pretrained(device_map=<it>, max_memory=<GPUs>)` |
| <file>.json | `from_pretrained(device_map=<the component's entry>)` |
| model-offload | load on CPU, then `accelerate.cpu_offload_with_hook` |
| group-offload | load on CPU, then `diffusers.hooks.apply_group_offloading` (streams on CUDA) |
| disk-offload | `from_pretrained(device_map={"": "disk"}, offload_folder=...)`, run on GPU/CPU |

On top of the libraries this module only checks and repairs what they get wrong:

* every component is fully placed: a tensor left on the meta device that no offload hook serves
  is an error, not a silent random/zero weight (the failure mode of pipeline-level `balanced`);
* the layers a model keeps in float32 (Wan: `_keep_in_fp32_modules`; UMT5: `wo` under fp16) stay
  float32 when offloaded to disk. diffusers and transformers both build the meta placeholders of
  disk-offloaded weights in the reduced dtype, and accelerate casts every weight it loads back to
  its placeholder's dtype, so without the repair those layers silently compute in bf16/fp16;
* every component loaded to disk gets its own offload folder (per component, rank and run):
  two experts sharing one folder silently read each other's weights.

`load_component` returns a module in eval mode with requires_grad off; `execution_device` says
where its inputs go; `unload` removes hooks, frees the weights and the offload folder.
"""

from __future__ import annotations

import contextlib
import difflib
import gc
import json
import os
import shutil
import tempfile
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from wandistill.config import NAMED_PLACEMENTS, SamplerConfig
from wandistill.errors import UsageError, WandistillError
from wandistill.modelfolder import load_pretrained
from wandistill.teacher.folder import COMPONENT_CLASSES, Component, TeacherFolder
from wandistill.teacher.oom import oom_guard
from wandistill.teacher.plan import (
    CUDA_OVERHEAD,
    Inventory,
    SamplerSizes,
    activation_bytes,
    component_class,
    fp32_kept,
    make_plan,
)

__all__ = [
    "PLACEMENTS",
    "Placed",
    "check_placement",
    "execution_device",
    "load_component",
    "needs_cuda",
    "oom_guard_for",
    "park",
    "placement_of",
    "read_device_map_file",
    "resolve_placement",
    "unload",
]

PLACEMENTS = NAMED_PLACEMENTS  # one list, defined with the config that validates it
DEVICE_MAP_STRATEGIES = ("balanced", "balanced_low_0", "sequential")
GROUP_LEVELS = ("block_level", "leaf_level")
_CUDA_ONLY = frozenset({"cuda", "gpu0", *DEVICE_MAP_STRATEGIES, "model-offload", "group-offload"})
_ATTR = "_wandistill_placed"


@dataclass(frozen=True, slots=True)
class Placed:
    """How a loaded component was placed (attached to the module; see `placement_of`)."""

    component: str
    strategy: str
    """Concrete strategy: cpu, cuda:N, balanced, ..., device-map, model-offload, ..."""
    execution_device: torch.device
    dtype: torch.dtype
    offload_dir: Path | None = None
    device_map: Mapping[str, Any] | None = None
    """accelerate's hf_device_map where one was used."""
    hook: Any = None
    """model-offload: accelerate's UserCpuOffloadHook (`park` calls its offload())."""
    cleanup: Callable[[], Any] | None = None
    """Removes the offload folder; also runs when the module is garbage-collected or at exit."""
    group_level: str | None = None
    """group-offload: block_level or leaf_level."""

    @property
    def label(self) -> str:
        """The strategy as error messages name it."""
        if self.strategy == "group-offload" and self.group_level == "leaf_level":
            return "group-offload (leaf_level)"
        return self.strategy


# --------------------------------------------------------------------------- validation


def needs_cuda(placement: str) -> bool:
    return placement in _CUDA_ONLY or placement.startswith("cuda:")


def _visible_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _no_cuda_error(placement: str) -> UsageError:
    return UsageError(
        f"placement {placement!r} needs CUDA GPUs but none is visible; "
        "use --placement cpu or disk-offload",
        fix="run on a machine with a GPU, or pass --placement cpu (or disk-offload, or auto)",
    )


def check_placement(placement: str, *, gpus: int | None = None) -> None:
    """Raise UsageError for an unknown placement, or one this machine's GPUs cannot run."""
    gpus = _visible_gpus() if gpus is None else gpus
    if placement.endswith(".json"):
        read_device_map_file(Path(placement), gpus=gpus)
        return
    if placement not in PLACEMENTS and not placement.startswith("cuda:"):
        close = difflib.get_close_matches(placement, PLACEMENTS, n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        raise UsageError(
            f"placement {placement!r} is not known",
            fix=f"{hint}use one of {', '.join(PLACEMENTS)}, cuda:N or a device-map .json file",
        )
    if needs_cuda(placement) and gpus == 0:
        raise _no_cuda_error(placement)
    if placement.startswith("cuda:"):
        index = placement.removeprefix("cuda:")
        if not index.isdigit() or int(index) >= gpus:
            raise UsageError(
                f"placement {placement!r} names a GPU this machine does not have ({gpus} visible)",
                fix=f"use cuda:0 ... cuda:{gpus - 1}, or set CUDA_VISIBLE_DEVICES",
            )


def _device_value(value: Any, where: str, path: Path) -> int | str:
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


def read_device_map_file(path: Path, *, gpus: int | None = None) -> dict[str, int | str | dict]:
    """Read and check a per-component device-map file.

    Format: one entry per component, each either one device for the whole component or an
    accelerate device map of module names (as `infer_auto_device_map` writes them):

        {"text_encoder": "cuda:0",
         "transformer": {"patch_embedding": 0, "blocks.0": 0, ..., "blocks.39": 1, ...},
         "vae": "cpu"}

    Devices: a GPU index, "cuda:N", "cpu" or "disk"; a component may also name an accelerate
    strategy ("balanced", "sequential", ...).
    """
    gpus = _visible_gpus() if gpus is None else gpus
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
    out: dict[str, int | str | dict] = {}
    for name, entry in data.items():
        if name not in COMPONENT_CLASSES:
            close = difflib.get_close_matches(name, list(COMPONENT_CLASSES), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise UsageError(
                f"device map {str(path)!r}: unknown component {name!r}",
                fix=f"{hint}keys are {', '.join(COMPONENT_CLASSES)}",
            )
        if isinstance(entry, dict):
            out[name] = {
                m: _device_value(v, f"{name}.{m or '<root>'}", path) for m, v in entry.items()
            }
            values = list(out[name].values())  # type: ignore[union-attr]
            if name == "vae" and (len(set(values)) > 1 or "disk" in values):
                raise UsageError(
                    f"device map {str(path)!r} splits or disk-offloads the vae",
                    fix='map "vae" to one GPU or "cpu": its causal cache does not survive '
                    "accelerate's per-module hooks",
                )
        elif entry in DEVICE_MAP_STRATEGIES:
            out[name], values = entry, [0]
        else:
            out[name] = _device_value(entry, name, path)
            values = [out[name]]
            if name == "vae" and out[name] == "disk":
                raise UsageError(
                    f"device map {str(path)!r} disk-offloads the vae",
                    fix='map "vae" to one GPU or "cpu": its causal cache does not survive '
                    "accelerate's per-module hooks",
                )
        gpu_values = [v for v in values if isinstance(v, int)]
        if gpu_values and max(gpu_values) >= gpus:
            raise UsageError(
                f"device map {str(path)!r} puts {name} on GPU {max(gpu_values)} but "
                f"{gpus} GPU(s) are visible",
                fix='map it to "cpu" or "disk", or run where that GPU exists',
            )
    return out


# --------------------------------------------------------------------------- resolution


def _current_gpu() -> int:
    return torch.cuda.current_device() if torch.cuda.is_available() else 0


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


def sampler_sizes(sampler: SamplerConfig | SamplerSizes | None) -> SamplerSizes:
    """SamplerSizes from a recipe's `SamplerConfig` (or as is); None: Wan's 480p, 81 frames."""
    if sampler is None:
        return SamplerSizes()
    if isinstance(sampler, SamplerSizes):
        return sampler
    return SamplerSizes.from_sampler(sampler)


def resolve_placement(
    placement: str,
    *,
    folder: TeacherFolder | str | Path | Mapping[str, Mapping[str, Any]],
    dtype: torch.dtype,
    sampler: SamplerConfig | SamplerSizes | None = None,
    inventory: Inventory | None = None,
    world_size: int = 1,
    local_rank: int = 0,
    group_offload_level: str = "block_level",
    max_memory: Mapping[str, str | int] | None = None,
    experts_resident: int = 1,
) -> str:
    """The concrete placement to load every component with.

    `auto` becomes the plan's choice: the fastest strategy that fits every phase with headroom
    for the activations of `sampler`'s sizes (see plan.py); `gpu0` becomes cuda:0 and `cuda` the
    current GPU. Everything is checked before a device is touched: unknown names, placements
    needing CUDA on a CPU-only machine, GPU indices that do not exist, device-map files
    (UsageError). Under torchrun with several ranks per node, a rank plans for GPU `local_rank`
    alone. Call once and pass the result to `load_component` for every component, so all phases
    share one plan. `experts_resident`: Wan 2.2 experts loaded at the same time (1 = swapped).
    """
    inv = inventory if inventory is not None else Inventory.detect()
    check_placement(placement, gpus=len(inv.gpus))
    if placement == "gpu0":
        return "cuda:0"
    if placement == "cuda":
        return f"cuda:{_current_gpu()}"
    if placement != "auto":
        return placement
    view, own_gpu = _rank_view(inv, world_size, local_rank)
    plan = make_plan(
        folder,
        dtype=dtype,
        sizes=sampler_sizes(sampler),
        inventory=view,
        group_offload_level=group_offload_level,
        max_memory=max_memory,
        experts_resident=experts_resident,
    )
    choice = plan.auto.strategy
    if choice is None:
        raise WandistillError(
            f"teacher {plan.teacher} does not fit this machine with any placement: "
            f"{plan.auto.reason}",
            fix="see `wandistill plan`; use --dtype bf16, a smaller batch/resolution, "
            "or free disk space for --placement disk-offload",
        )
    if own_gpu is not None and choice.startswith("cuda:"):
        choice = f"cuda:{own_gpu}"
    return choice


# --------------------------------------------------------------------------- loading


def _dtype_kwarg(cls: type, dtype: torch.dtype) -> dict[str, torch.dtype]:
    """transformers >= 4.56 calls it `dtype` (torch_dtype is deprecated); diffusers torch_dtype."""
    if cls.__module__.startswith("transformers"):
        import transformers

        major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
        if (major, minor) >= (4, 56):
            return {"dtype": dtype}
    return {"torch_dtype": dtype}


def _from_pretrained(cls: type, sub: Path, dtype: torch.dtype, **kwargs: Any) -> torch.nn.Module:
    """The library loader, local safetensors only, with load failures turned into clear errors."""
    try:
        return load_pretrained(cls, sub, **_dtype_kwarg(cls, dtype), **kwargs)
    except OSError as e:
        raise UsageError(
            f"could not load {cls.__name__} from {str(sub)!r}: {str(e).splitlines()[0]}",
            fix="check the teacher folder's weights (*.safetensors) and config.json",
        ) from None
    except ValueError as e:
        if "doesn't have any device set" in str(e):
            raise UsageError(
                f"the device map for {sub.name} does not cover every weight: {e}",
                fix='add the missing module to the map, or map "" (the root) as a default',
            ) from None
        if "offload" in str(e) or "disk" in str(e):
            strategy = kwargs.get("device_map")
            raise WandistillError(
                f"{sub.name} does not fit on the GPUs with placement {strategy!r} "
                "(accelerate would spill weights to disk)",
                fix="run `wandistill plan`; try --placement group-offload or disk-offload, "
                "or raise max_memory",
            ) from None
        raise


def _offload_subdir(root: Path | None, name: str) -> tuple[Path, list[Path]]:
    """A fresh folder for one (component, rank, run): never shared, never reused.

    Returns it and the parent folders this call had to create (deepest first), so the cleanup
    leaves no empty `.offload/rank0/` behind.
    """
    base = Path(root) if root is not None else Path(tempfile.gettempdir()) / "wandistill-offload"
    created = [p for p in (base.absolute(), *base.absolute().parents) if not p.exists()]
    base.mkdir(parents=True, exist_ok=True)
    rank = os.environ.get("RANK", "0")
    sub = Path(tempfile.mkdtemp(prefix=f"{name}-rank{rank}-pid{os.getpid()}-", dir=base))
    return sub, created


def _remove_offload(folder: str, created: list[str]) -> None:
    shutil.rmtree(folder, ignore_errors=True)
    for parent in created:
        with contextlib.suppress(OSError):  # not empty: another component still uses it
            os.rmdir(parent)


def _normalise_max_memory(max_memory: Mapping[str, str | int]) -> dict[int | str, str | int]:
    out: dict[int | str, str | int] = {}
    for key, value in max_memory.items():
        k = str(key).removeprefix("cuda:")
        out[int(k) if k.isdigit() else k] = value
    return out


def _default_max_memory(
    comp: Component, dtype: torch.dtype, sizes: SamplerSizes | None
) -> dict[int | str, int]:
    """Free memory of every GPU minus this component's activation headroom (plan estimate)."""
    act = activation_bytes(comp.name, comp.raw_config, sizes, dtype) if sizes is not None else 0
    return {
        i: max(0, torch.cuda.mem_get_info(i)[0] - act - CUDA_OVERHEAD)
        for i in range(torch.cuda.device_count())
    }


def _group_offload(model: torch.nn.Module, name: str, device: torch.device, level: str) -> None:
    """diffusers group offloading, one block (or leaf) at a time, prefetched on a CUDA stream.

    The text encoder always goes leaf by leaf: its blocks sit one level down (encoder.block) and
    its embedding is tied between two parents, which block-level grouping would pin twice; it
    runs once per prompt batch, so leaf-level costs nothing that matters.
    """
    from diffusers.hooks import apply_group_offloading

    if name == "text_encoder":
        level = "leaf_level"
    streams = device.type == "cuda"
    apply_group_offloading(
        model,
        onload_device=device,
        offload_device=torch.device("cpu"),
        offload_type=level,
        num_blocks_per_group=1 if level == "block_level" else None,
        non_blocking=streams,
        use_stream=streams,
        record_stream=streams,
    )


# --------------------------------------------------------------------------- offload repairs


def _align_hooks(model: torch.nn.Module) -> Iterator[Any]:
    """accelerate AlignDevicesHooks that offload weights (load them at each forward)."""
    for module in model.modules():
        hook = getattr(module, "_hf_hook", None)
        for h in getattr(hook, "hooks", (hook,)):
            if getattr(h, "offload", False) and getattr(h, "weights_map", None) is not None:
                yield module, h


def _offload_loaders(model: torch.nn.Module) -> list[Any]:
    """The distinct OffloadedWeightsLoaders behind the hooks (each has .index, .all_keys)."""
    seen: dict[int, Any] = {}
    for _, h in _align_hooks(model):
        loader = getattr(h.weights_map, "dataset", h.weights_map)
        seen.setdefault(id(loader), loader)
    return list(seen.values())


def _served_names(model: torch.nn.Module) -> set[str]:
    """Full names of the meta tensors an offload hook loads at forward time."""
    from accelerate.utils import named_module_tensors

    keys = {id(ld): set(getattr(ld, "all_keys", ())) for ld in _offload_loaders(model)}
    served: set[str] = set()
    for module, h in _align_hooks(model):
        wm = h.weights_map
        prefix = getattr(wm, "prefix", "")
        have = keys[id(getattr(wm, "dataset", wm))]
        tensors = named_module_tensors(
            module, include_buffers=h.offload_buffers, recurse=h.place_submodules
        )
        served |= {prefix + n for n, _ in tensors if prefix + n in have}
    return served


def _retag_meta(model: torch.nn.Module, want: Callable[[str], torch.dtype]) -> None:
    """Give meta (offloaded) parameters the dtype a plain load would give them.

    accelerate casts each weight it loads to its placeholder's dtype, so the placeholder decides
    the compute dtype. Tied parameters are replaced once and stay tied.
    """
    replaced: dict[int, torch.nn.Parameter] = {}
    for full, param in list(model.named_parameters(remove_duplicate=False)):
        if param.device.type != "meta" or not param.is_floating_point():
            continue
        target = want(full)
        if param.dtype == target and id(param) not in replaced:
            continue
        new = replaced.get(id(param))
        if new is None:
            new = torch.nn.Parameter(param.to(target), requires_grad=False)
            replaced[id(param)] = new
        mod_name, _, leaf = full.rpartition(".")
        model.get_submodule(mod_name)._parameters[leaf] = new


def _restore_fp32_offloaded(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Keep the fp32-kept layers float32 when offloaded (see the module docstring)."""
    kept = fp32_kept(type(model), dtype)
    _retag_meta(model, lambda n: torch.float32 if kept(n) else dtype)
    for loader in _offload_loaders(model):
        for key, entry in getattr(loader, "index", {}).items():
            # transformers indexes the original safetensors plus a cast dtype; .dat files
            # (diffusers) were written in their final dtype and must be read as stored.
            if entry.get("safetensors_file") and entry.get("dtype") and kept(key):
                entry["dtype"] = "float32"


def _redispatch_disk(model: torch.nn.Module, device: torch.device, folder: Path) -> None:
    """Re-attach the disk-offload hooks with `device` as the execution device.

    The libraries dispatch an all-"disk" map with the CPU as execution device; accelerate's own
    `dispatch_model(main_device=...)` over the same offload index runs it on the GPU instead.
    """
    from accelerate import dispatch_model
    from accelerate.hooks import remove_hook_from_module

    index: dict[str, Any] = {}
    for loader in _offload_loaders(model):
        index.update(loader.index)
    remove_hook_from_module(model, recurse=True)
    dispatch_model(
        model,
        device_map={"": "disk"},
        main_device=str(device),  # str: safetensors' safe_open rejects torch.device objects
        offload_dir=str(folder),
        offload_index=index,
    )


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
    model: torch.nn.Module, name: str, strategy: str, allowed: set[str] | None
) -> None:
    """Every tensor is on an allowed device, or served by an offload hook; nothing on meta."""
    served = _served_names(model)
    orphans, misplaced = [], []
    for full, t in [*model.named_parameters(), *model.named_buffers()]:
        dev = t.device.type if t.device.index is None else f"{t.device.type}:{t.device.index}"
        if t.device.type == "meta":
            if full not in served:
                orphans.append(full)
        elif allowed is not None and dev not in allowed:
            misplaced.append(f"{full} on {dev}")
    if orphans:
        raise WandistillError(
            f"{name}: {len(orphans)} tensor(s) were never loaded with placement {strategy!r} "
            f"(e.g. {orphans[0]} is still on the meta device)",
            fix="the component did not fit or the device map missed modules; run `wandistill "
            "plan`, cover every module in the device map, or pick a placement that fits",
        )
    if misplaced:
        raise WandistillError(
            f"{name}: {len(misplaced)} tensor(s) landed off the placement {strategy!r} "
            f"(e.g. {misplaced[0]})",
            fix="run `wandistill plan` and pick a placement that fits, or raise max_memory",
        )


def _allowed_devices(strategy: str, model: torch.nn.Module) -> set[str] | None:
    """Devices real tensors may sit on after loading, per strategy (None: any)."""
    if strategy == "cpu" or strategy in ("model-offload", "group-offload"):
        return {"cpu"}  # offloaded strategies keep weights on the CPU between forwards
    if strategy.startswith("cuda:"):
        return {strategy}
    if strategy in DEVICE_MAP_STRATEGIES:
        dmap = getattr(model, "hf_device_map", None) or {}
        gpus = {f"cuda:{v}" for v in dmap.values() if isinstance(v, int)}
        return gpus | ({"cpu"} if "cpu" in dmap.values() else set()) or None
    return None


# --------------------------------------------------------------------------- public API


def load_component(
    folder: TeacherFolder | str | Path,
    name: str,
    *,
    dtype: torch.dtype,
    placement: str,
    offload_dir: Path | None = None,
    max_memory: Mapping[str, str | int] | None = None,
    group_offload_level: str = "block_level",
    device_map_file: Path | None = None,
    sampler: SamplerConfig | SamplerSizes | None = None,
) -> torch.nn.Module:
    """Load `folder/name` with `placement`; return it ready to call (eval, no grad).

    `name`: text_encoder (transformers UMT5EncoderModel), transformer / transformer_2 (diffusers
    WanTransformer3DModel) or vae (diffusers AutoencoderKLWan). `placement` is any --placement
    value; pass `resolve_placement`'s result so `auto` is planned once. `offload_dir`: where
    disk-offload makes this component's own subfolder (default: the system temp dir), removed by
    `unload`. `max_memory` caps accelerate device maps ({"0": "70GiB", "cpu": "200GiB"}; "cpu"
    allows CPU spill); without it each GPU's free memory minus the activation headroom for
    `sampler`'s sizes is used. `folder`: an opened `TeacherFolder` (a path is opened here).
    Never trusts remote code; loads local safetensors only.
    """
    folder = TeacherFolder.coerce(folder)
    sub = folder.component(name)
    sizes = sampler_sizes(sampler) if sampler is not None else None
    if group_offload_level not in GROUP_LEVELS:
        raise UsageError(
            f"group_offload_level={group_offload_level!r} must be one of {GROUP_LEVELS}",
            fix="--set precompute.teacher.group_offload_level=block_level",
        )
    if placement.endswith(".json"):
        if device_map_file is not None and Path(placement) != Path(device_map_file):
            raise UsageError("two device-map files given", fix="pass the .json once")
        device_map_file = Path(placement)
    if device_map_file is not None:
        maps = read_device_map_file(Path(device_map_file))
        if name not in maps:
            raise UsageError(
                f"device map {str(device_map_file)!r} has no entry for {name!r}",
                fix=f'add e.g. "{name}": "cuda:0" (or "cpu", or a module map)',
            )
        return _load_mapped(sub, name, dtype, maps[name], offload_dir, max_memory, sizes)
    if placement == "auto":
        placement = resolve_placement(
            "auto",
            folder=folder,
            dtype=dtype,
            sampler=sizes,
            max_memory=max_memory,
            group_offload_level=group_offload_level,
        )
    check_placement(placement)
    strategy, device = _concrete(placement)
    return _load(
        sub,
        name,
        dtype,
        strategy,
        device,
        offload_root=offload_dir,
        max_memory=max_memory,
        level=group_offload_level,
        sizes=sizes,
    )


def _concrete(placement: str) -> tuple[str, torch.device]:
    """(strategy, execution device) for a checked, non-auto placement."""
    if placement == "cpu":
        return "cpu", torch.device("cpu")
    if placement in ("cuda", "gpu0") or placement.startswith("cuda:"):
        index = (
            0
            if placement == "gpu0"
            else (_current_gpu() if placement == "cuda" else int(placement[5:]))
        )
        return f"cuda:{index}", torch.device("cuda", index)
    if placement == "disk-offload" and not torch.cuda.is_available():
        return placement, torch.device("cpu")
    return placement, torch.device("cuda", _current_gpu())


def _load_mapped(
    sub: Component,
    name: str,
    dtype: torch.dtype,
    entry: int | str | dict,
    offload_root: Path | None,
    max_memory: Mapping[str, str | int] | None,
    sizes: SamplerSizes | None,
) -> torch.nn.Module:
    """A device-map file's entry: one device, an accelerate strategy, or a module map."""
    if isinstance(entry, int):
        return _load(sub, name, dtype, f"cuda:{entry}", torch.device("cuda", entry))
    if entry == "cpu":
        return _load(sub, name, dtype, "cpu", torch.device("cpu"))
    if entry == "disk":
        _, device = _concrete("disk-offload")
        return _load(sub, name, dtype, "disk-offload", device, offload_root=offload_root)
    if isinstance(entry, str):
        return _load(
            sub, name, dtype, entry, torch.device("cuda", 0), max_memory=max_memory, sizes=sizes
        )
    gpus = sorted(v for v in entry.values() if isinstance(v, int))
    device = torch.device("cuda", gpus[0]) if gpus else torch.device("cpu")
    return _load(
        sub, name, dtype, "device-map", device, offload_root=offload_root, device_map=entry
    )


def _load(
    sub: Component | Path,
    name: str,
    dtype: torch.dtype,
    strategy: str,
    device: torch.device,
    *,
    offload_root: Path | None = None,
    max_memory: Mapping[str, str | int] | None = None,
    level: str = "block_level",
    sizes: SamplerSizes | None = None,
    device_map: dict[str, int | str] | None = None,
) -> torch.nn.Module:
    """Load with a concrete strategy on `device` (tests call this with device=cpu and a path)."""
    comp = sub if isinstance(sub, Component) else TeacherFolder.open(sub.parent).component(name)
    path = comp.path
    cls = component_class(name)
    if name == "vae" and strategy in ("group-offload", "disk-offload"):
        strategy = _vae_whole(device)
    label = strategy
    if strategy == "group-offload" and level != "block_level":
        label = f"group-offload ({level})"
    offload_dir: Path | None = None
    created: list[Path] = []
    hook = None
    with oom_guard(device, label, component=name):
        if strategy == "cpu":
            model = _from_pretrained(cls, path, dtype)
        elif strategy.startswith("cuda:"):
            model = _from_pretrained(cls, path, dtype, device_map=strategy)
        elif strategy in DEVICE_MAP_STRATEGIES:
            model = _load_device_map(cls, comp, dtype, strategy, max_memory, sizes)
        elif strategy == "device-map":
            extra: dict[str, Any] = {}
            if "disk" in (device_map or {}).values():
                offload_dir, created = _offload_subdir(offload_root, name)
                extra["offload_folder"] = str(offload_dir)
                if cls.__module__.startswith("diffusers"):
                    # Its default (True) parks CPU weights in a temp state dict and reloads them
                    # cast to the placeholders' reduced dtype: fp32-kept layers would be rounded.
                    extra["offload_state_dict"] = False
            model = _from_pretrained(cls, path, dtype, device_map=device_map, **extra)
        elif strategy == "model-offload":
            from accelerate import cpu_offload_with_hook

            model, hook = cpu_offload_with_hook(_from_pretrained(cls, path, dtype), device)
        elif strategy == "group-offload":
            model = _from_pretrained(cls, path, dtype)
            _group_offload(model, name, device, level)
        elif strategy == "disk-offload":
            offload_dir, created = _offload_subdir(offload_root, name)
            model = _from_pretrained(
                cls, path, dtype, device_map={"": "disk"}, offload_folder=str(offload_dir)
            )
            _redispatch_disk(model, device, offload_dir)
        else:  # pragma: no cover - guarded by check_placement
            raise UsageError(f"placement {strategy!r} is not known")
    cleanup = None
    if offload_dir is not None:
        cleanup = weakref.finalize(
            model, _remove_offload, str(offload_dir), [str(p) for p in created]
        )
    _restore_fp32_offloaded(model, dtype)
    _check_dtypes(model, name, dtype)
    _check_placed(model, name, strategy, _allowed_devices(strategy, model))
    model.eval().requires_grad_(False)
    placed = Placed(
        component=name,
        strategy=strategy,
        execution_device=_exec_device(model, strategy, device),
        dtype=dtype,
        offload_dir=offload_dir,
        device_map=getattr(model, "hf_device_map", None),
        hook=hook,
        cleanup=cleanup,
        group_level=("leaf_level" if name == "text_encoder" else level)
        if strategy == "group-offload"
        else None,
    )
    setattr(model, _ATTR, placed)
    return model


def _vae_whole(device: torch.device) -> str:
    """The Wan VAE runs whole on the execution device under group- and disk-offload.

    It threads its causal cache through forward calls as Python lists (feat_cache, feat_idx)
    and mutates them in place; accelerate's per-module hooks copy those lists when moving
    inputs, so the decoder loses its temporal state (measured on the tiny teacher: a 2-latent-
    frame decode came back with 2 frames instead of 5). At ~0.25 GB in bf16 there is nothing
    to gain from streaming it anyway.
    """
    return "cpu" if device.type == "cpu" else f"cuda:{device.index or 0}"


def _load_device_map(
    cls: type,
    comp: Component,
    dtype: torch.dtype,
    strategy: str,
    max_memory: Mapping[str, str | int] | None,
    sizes: SamplerSizes | None,
) -> torch.nn.Module:
    """balanced / balanced_low_0 / sequential over the GPUs (the CPU only if max_memory has it)."""
    mm: dict[int | str, Any] = (
        _normalise_max_memory(max_memory) if max_memory else _default_max_memory(comp, dtype, sizes)
    )
    if not getattr(cls, "_no_split_modules", None):
        # accelerate cannot split this model (the Wan VAE): put it whole on the first GPU.
        first = min((k for k in mm if isinstance(k, int)), default=0)
        return _from_pretrained(cls, comp.path, dtype, device_map=f"cuda:{first}")
    return _from_pretrained(cls, comp.path, dtype, device_map=strategy, max_memory=mm)


def _exec_device(model: torch.nn.Module, strategy: str, device: torch.device) -> torch.device:
    if strategy in DEVICE_MAP_STRATEGIES or strategy == "device-map":
        from diffusers.utils.torch_utils import get_module_execution_device

        return torch.device(get_module_execution_device(model))
    return device


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
        return oom_guard(execution_device(module), "unknown")
    return oom_guard(placed.execution_device, placed.label, component=placed.component)


def park(module: torch.nn.Module) -> None:
    """model-offload: move the component back to the CPU now (e.g. between Wan 2.2 experts).

    No-op for other strategies (their hooks already move weights per forward, or they stay put).
    """
    placed = placement_of(module)
    if placed is not None and placed.hook is not None:
        placed.hook.offload()


def _remove_diffusers_hooks(module: torch.nn.Module) -> None:
    for sub in module.modules():
        registry = getattr(sub, "_diffusers_hook", None)
        if registry is None:
            continue
        for hook_name in list(registry.hooks):
            registry.remove_hook(hook_name, recurse=False)
        del sub._diffusers_hook


def unload(module: torch.nn.Module) -> None:
    """Free a component: remove its hooks, drop its weights, delete its offload folder.

    Safe to call on any module; afterwards it holds only meta tensors, so a forgotten reference
    keeps no memory (and fails loudly if called). Then gc and, on CUDA, empty the cache.
    """
    from accelerate.hooks import remove_hook_from_module

    placed = placement_of(module)
    remove_hook_from_module(module, recurse=True)
    _remove_diffusers_hooks(module)
    torch.nn.Module.to_empty(module, device="meta")
    if placed is not None and placed.cleanup is not None:
        placed.cleanup()
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
