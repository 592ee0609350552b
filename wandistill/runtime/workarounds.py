"""Every place wandistill works around a library bug, limitation or rename: one module.

Each workaround is a function (or constant) here, listed in `WORKAROUNDS` with the library
versions it applies to and the upstream issue or pull request; where no upstream report was
found that is said, not invented. `tests/unit/test_workarounds.py` has one test per entry that
fails when the workaround becomes unnecessary (the bug is fixed, or our declared minimum version
is past a rename) or stops applying (the private attribute or message it relies on is gone), so
it gets removed instead of carried. Nothing here imports diffusers, transformers or accelerate at
module level: `train/` imports this module (the DDP shim) and must stay light.

Versions: "tested" is what CI runs (torch 2.13, diffusers 0.42.1, transformers 5.23,
accelerate 1.15); the lower bound is pyproject's, unless the feature is younger.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = [
    "WORKAROUNDS",
    "Workaround",
    "ddp_no_buffer_sync",
    "ddp_skip_init_sync",
    "dtype_kwarg",
    "group_offload_level",
    "hide_flag_types",
    "incomplete_device_map",
    "mixed_map_kwargs",
    "never_split",
    "offload_hooks",
    "offload_index",
    "redispatch_disk",
    "remove_diffusers_hooks",
    "restore_fp32_offloaded",
    "safetensors_header",
    "served_names",
    "t5_tokenizer_class",
    "tie_meta_weights",
]


@dataclass(frozen=True, slots=True)
class Workaround:
    """One entry of `WORKAROUNDS`: what, for which versions, and where upstream tracks it."""

    name: str
    """The function or constant in this module."""
    library: str
    applies: str
    """Version range, e.g. "diffusers >=0.35 (tested 0.42.1; still needed)"."""
    upstream: str
    """Issue / PR URL, or a sentence saying none was found."""


# --------------------------------------------------------------------------- torch


def ddp_no_buffer_sync() -> dict[str, bool]:
    """DistributedDataParallel kwargs that skip the per-forward buffer broadcast.

    torch 2.13 added `forward_sync_buffers` and deprecated `broadcast_buffers` (which, since
    torch 2.1, also skipped the *initial* buffer broadcast). Older torch only has the old name.
    Our student's only buffers are RoPE tables, equal on every rank, so either spelling is right.
    """
    new = _ddp_takes("forward_sync_buffers")
    return {"forward_sync_buffers" if new else "broadcast_buffers": False}


def ddp_skip_init_sync() -> dict[str, bool]:
    """DistributedDataParallel kwargs that skip its construction-time collectives (the shape
    check and the broadcast of every parameter and buffer from rank 0), for a caller that makes
    the ranks equal itself (`parallel.wrap_ddp` for a LoRA student: the frozen base is read from
    the same file on every rank, the trainable tensors are broadcast explicitly).

    `init_sync` came with torch 2.6 (pytorch#142824); pyproject allows torch >= 2.4, where this
    returns {} and DDP broadcasts everything as before: correct, only a transient of the frozen
    base's size per rank more (docs/benchmarks.md, train memory)."""
    return {"init_sync": False} if _ddp_takes("init_sync") else {}


def _ddp_takes(name: str) -> bool:
    from torch.nn.parallel import DistributedDataParallel

    return name in inspect.signature(DistributedDataParallel.__init__).parameters


# --------------------------------------------------------------------------- transformers


def dtype_kwarg(cls: type, dtype: torch.dtype) -> dict[str, torch.dtype]:
    """The dtype keyword of `cls.from_pretrained`: transformers >= 4.56 renamed `torch_dtype` to
    `dtype` (the old name warns); diffusers still calls it `torch_dtype`."""
    if cls.__module__.startswith("transformers"):
        import transformers

        major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
        if (major, minor) >= (4, 56):
            return {"dtype": dtype}
    return {"torch_dtype": dtype}


def t5_tokenizer_class(index: Mapping[str, Any]) -> dict[str, Any] | None:
    """model_index.json with the tokenizer named `T5TokenizerFast`, or None if it already is.

    transformers 5 saves the T5 tokenizer's class as `T5Tokenizer` (now its fast tokenizer);
    under transformers 4 that name is the slow SentencePiece class, which cannot load a folder
    without spiece.model. `T5TokenizerFast` resolves to the tokenizers-backed class in both.
    """
    if index.get("tokenizer") == ["transformers", "T5Tokenizer"]:
        return {**index, "tokenizer": ["transformers", "T5TokenizerFast"]}
    return None


def incomplete_device_map(exc: BaseException) -> bool:
    """Whether a from_pretrained error means the device map missed some weights.

    accelerate's `check_device_map` raises a bare ValueError ("<param> doesn't have any device
    set."); there is no exception type to catch, so we match its text.
    """
    return isinstance(exc, ValueError) and "doesn't have any device set" in str(exc)


# --------------------------------------------------------------------------- accelerate


def tie_meta_weights(model: torch.nn.Module) -> None:
    """Re-tie a model built under `accelerate.init_empty_weights`.

    The context manager patches `register_parameter`, so assigning one parameter to two modules
    inside it creates two parameters: the meta UMT5 counts its embedding twice (6.73B instead of
    5.68B parameters). Tying again outside the context restores the shared parameter.
    """
    if hasattr(model, "tie_weights"):
        model.tie_weights()


def offload_hooks(model: torch.nn.Module) -> Iterator[tuple[torch.nn.Module, Any]]:
    """(module, accelerate AlignDevicesHook) for every hook that loads offloaded weights.

    accelerate has no public API listing what a dispatched model offloads; this reads the
    private `_hf_hook` attribute (SequentialHook's `.hooks` when hooks are chained) and the
    hook's `offload` / `weights_map` fields.
    """
    for module in model.modules():
        hook = getattr(module, "_hf_hook", None)
        for h in getattr(hook, "hooks", (hook,)):
            if getattr(h, "offload", False) and getattr(h, "weights_map", None) is not None:
                yield module, h


def _loaders(model: torch.nn.Module) -> list[Any]:
    """The distinct OffloadedWeightsLoaders behind the hooks (`PrefixedDataset.dataset`)."""
    loaders = (getattr(h.weights_map, "dataset", h.weights_map) for _, h in offload_hooks(model))
    return list({id(loader): loader for loader in loaders}.values())


def offload_index(model: torch.nn.Module) -> dict[str, Any]:
    """The merged offload index (`OffloadedWeightsLoader.index`) of a disk-offloaded model."""
    return {k: v for loader in _loaders(model) for k, v in getattr(loader, "index", {}).items()}


def served_names(model: torch.nn.Module) -> set[str]:
    """Full names of the meta tensors an offload hook loads at forward time."""
    from accelerate.utils import named_module_tensors

    keys = {id(ld): set(getattr(ld, "all_keys", ())) for ld in _loaders(model)}
    served: set[str] = set()
    for module, h in offload_hooks(model):
        wm = h.weights_map
        prefix = getattr(wm, "prefix", "")
        have = keys[id(getattr(wm, "dataset", wm))]
        tensors = named_module_tensors(
            module, include_buffers=h.offload_buffers, recurse=h.place_submodules
        )
        served |= {prefix + n for n, _ in tensors if prefix + n in have}
    return served


def _retag_meta(model: torch.nn.Module, want: Callable[[str], torch.dtype]) -> None:
    """Give meta (offloaded) parameters the dtype `want(name)`; tied ones stay tied."""
    import torch

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


def restore_fp32_offloaded(
    model: torch.nn.Module, dtype: torch.dtype, kept: Callable[[str], bool]
) -> None:
    """Keep the fp32-kept layers float32 when they are offloaded to disk.

    diffusers and transformers build the meta placeholders of disk-offloaded weights in the
    reduced dtype, ignoring `_keep_in_fp32_modules`, and accelerate casts every weight it loads
    to its placeholder's dtype; transformers also writes the reduced dtype into its offload
    index. Measured on the tiny teacher: Wan transformer in bf16, max abs difference 0.018 from
    the plain load; UMT5 in fp16, 0.0029. We give the placeholders (and the index entries that
    point at the original safetensors) the dtype a plain load gives. diffusers' .dat files were
    written in their final dtype and are read as stored.
    """
    import torch

    _retag_meta(model, lambda n: torch.float32 if kept(n) else dtype)
    for key, entry in offload_index(model).items():
        if entry.get("safetensors_file") and entry.get("dtype") and kept(key):
            entry["dtype"] = "float32"


def redispatch_disk(model: torch.nn.Module, device: torch.device, folder: Path) -> None:
    """Re-attach the disk-offload hooks with `device` as the execution device.

    Both libraries dispatch an all-"disk" device map with the CPU as execution device
    (accelerate's `dispatch_model` picks the first non-CPU, non-disk device and there is none).
    accelerate's own `dispatch_model(main_device=...)` over the same offload index runs it on
    the GPU instead; on a CPU-only machine this is a no-op re-dispatch.
    """
    from accelerate import dispatch_model
    from accelerate.hooks import remove_hook_from_module

    index = offload_index(model)
    remove_hook_from_module(model, recurse=True)
    dispatch_model(
        model,
        device_map={"": "disk"},
        main_device=str(device),  # str: safetensors' safe_open rejects torch.device objects
        offload_dir=str(folder),
        offload_index=index,
    )


# --------------------------------------------------------------------------- diffusers


def mixed_map_kwargs(cls: type) -> dict[str, bool]:
    """from_pretrained kwargs for a device map that mixes "cpu" and "disk".

    diffusers' default `offload_state_dict=True` parks the CPU weights in a temporary state dict
    and reloads them through accelerate, which casts them to the reduced placeholder dtype: the
    fp32-kept layers on the CPU (scale_shift_table, time_embedder) come back bf16. False keeps
    them. transformers components do not take the flag.
    """
    return {"offload_state_dict": False} if cls.__module__.startswith("diffusers") else {}


def never_split(class_name: str) -> bool:
    """Components that must run whole on one device: never split, offloaded or disk-mapped.

    The Wan VAE threads its causal cache (`feat_cache`, `feat_idx`) through forward calls as
    Python lists mutated in place. diffusers marks them `_skip_keys` (PR #12523), but its
    `from_pretrained` dispatch does not pass skip_keys to accelerate, whose per-module hooks then
    copy the lists: a 2-latent-frame decode comes back with 2 frames instead of 5.
    """
    return class_name == "AutoencoderKLWan"


def group_offload_level(class_name: str, level: str) -> str:
    """The group-offload level a component can use: UMT5 always goes leaf by leaf.

    diffusers' `block_level` only groups ModuleLists that are direct children; UMT5's blocks sit
    at `encoder.block`, so the whole encoder becomes one group (no saving at all). Naming
    `block_modules=["encoder"]` recurses, but then its tied embedding (`shared` and
    `encoder.embed_tokens`) sits in two groups, moved (and, with streams, pinned) twice.
    """
    return "leaf_level" if class_name == "UMT5EncoderModel" else level


def remove_diffusers_hooks(module: torch.nn.Module) -> None:
    """Remove every diffusers hook (group offloading) from `module` and its children.

    diffusers has no public "undo group offloading"; the hooks live in each submodule's private
    `_diffusers_hook` HookRegistry, whose `remove_hook` we call per hook name.
    """
    for sub in module.modules():
        if (registry := getattr(sub, "_diffusers_hook", None)) is not None:
            for hook_name in list(registry.hooks):
                registry.remove_hook(hook_name, recurse=False)
            del sub._diffusers_hook


# --------------------------------------------------------------------------- typer


def hide_flag_types(command: Any) -> Any:
    """typer's rich help prints a boolean flag's type, `--resume --no-resume <bool>`, which
    reads as if the flag took a value (`--resume false` is refused). An empty metavar is what
    typer shows instead of the type, so every flag of the command tree gets one."""
    for param in getattr(command, "params", []):
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""
    help_option = command.get_help_option  # --help is made per context, not in `params`

    def get_help_option(ctx: Any) -> Any:
        option = help_option(ctx)
        if option is not None and option.metavar is None:
            option.metavar = ""
        return option

    command.get_help_option = get_help_option
    for sub in getattr(command, "commands", {}).values():
        hide_flag_types(sub)
    return command


# --------------------------------------------------------------------------- safetensors


def safetensors_header(
    tensors: Mapping[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> tuple[bytes, list[str]]:
    """The bytes `safetensors.torch.save(tensors, metadata)` starts with (8-byte length, JSON
    header, space padding) and the order its tensors' bytes follow in, copying no tensor data.

    safetensors serialises only into one new buffer (`save`: every byte copied into freshly
    faulted pages, the cache writer's largest cost) or into a named file (`save_file`), never
    into an open file, on purpose, so a record cannot be streamed into a tar member. The library
    still decides the layout: it serialises zero-size stand-ins with the same names, dtypes and
    metadata keys (once per such signature: ~1 ms), and only each tensor's shape and data
    offsets (in the library's order) and the metadata values are filled in here, then padded to
    8 bytes as the library pads. `tests/unit/test_workarounds.py` checks the result byte for
    byte against `save` (with one metadata key: safetensors orders several in hash-map order).
    """
    import json

    meta = metadata or {}
    signature = tuple((name, t.dtype) for name, t in tensors.items()), tuple(meta)
    template, order = _safetensors_layout(signature, metadata is not None)
    table: dict[str, Any] = {}
    offset = 0
    for name, entry in template.items():
        if name == "__metadata__":
            table[name] = {k: meta[k] for k in entry}
            continue
        t = tensors[name]
        size = t.numel() * t.element_size()
        table[name] = {**entry, "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(table, ensure_ascii=False, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text, list(order)


@functools.lru_cache(maxsize=64)
def _safetensors_layout(
    signature: tuple[tuple[tuple[str, torch.dtype], ...], tuple[str, ...]], has_metadata: bool
) -> tuple[dict[str, Any], list[str]]:
    """The header safetensors writes for zero-size stand-ins of a signature (tensor names and
    dtypes, metadata keys), parsed, and its tensor order."""
    import json

    import torch
    from safetensors.torch import save

    named, keys = signature
    stand_ins = {name: torch.empty(0, dtype=dtype) for name, dtype in named}
    blob = save(stand_ins, metadata=dict.fromkeys(keys, "") if has_metadata else None)
    template = json.loads(blob[8 : 8 + int.from_bytes(blob[:8], "little")])
    return template, [name for name in template if name != "__metadata__"]


# --------------------------------------------------------------------------- registry

WORKAROUNDS: tuple[Workaround, ...] = (
    Workaround(
        "ddp_no_buffer_sync",
        "torch",
        "torch >=2.13 renamed broadcast_buffers to forward_sync_buffers; pyproject allows >=2.4",
        "https://github.com/pytorch/pytorch/pull/178054 (the discussion that led to "
        "forward_sync_buffers; the merged PR itself was not found) and "
        "https://github.com/pytorch/pytorch/issues/111138",
    ),
    Workaround(
        "ddp_skip_init_sync",
        "torch",
        "torch >=2.6 has DistributedDataParallel(init_sync=...); pyproject allows >=2.4",
        "https://github.com/pytorch/pytorch/pull/142824",
    ),
    Workaround(
        "dtype_kwarg",
        "transformers",
        "transformers >=4.56 renamed torch_dtype to dtype; pyproject allows >=4.46",
        "https://github.com/huggingface/transformers/pull/39782",
    ),
    Workaround(
        "t5_tokenizer_class",
        "transformers",
        "transformers 4.x (T5Tokenizer is the slow class); 5.x saves T5Tokenizer for the fast one",
        "none found: the class rename is part of transformers 5's tokenizer unification",
    ),
    Workaround(
        "incomplete_device_map",
        "accelerate",
        "accelerate >=1.0 (tested 1.15): check_device_map raises a bare ValueError",
        "none found: no dedicated exception type has been proposed upstream that we know of",
    ),
    Workaround(
        "tie_meta_weights",
        "accelerate",
        "accelerate >=1.0 (tested 1.15; still needed)",
        "https://github.com/huggingface/accelerate/issues/3668 (open)",
    ),
    Workaround(
        "offload_hooks",
        "accelerate",
        "accelerate >=1.0 (tested 1.15): private _hf_hook / weights_map.dataset / index",
        "https://github.com/huggingface/accelerate/pull/4261 proposes a public API (open)",
    ),
    Workaround(
        "restore_fp32_offloaded",
        "diffusers, transformers, accelerate",
        "diffusers >=0.35, transformers >=4.46 (tested 0.42.1 / 5.23; still needed)",
        "none found for the placeholder dtype itself; related: transformers PR "
        "https://github.com/huggingface/transformers/pull/46849 (the index dtype now follows the "
        "placeholder, so a wrong placeholder still loads wrong) and accelerate PR "
        "https://github.com/huggingface/accelerate/pull/1631",
    ),
    Workaround(
        "safetensors_header",
        "safetensors",
        "safetensors >=0.4 (tested 0.8.0; still needed): no serialisation into an open file",
        "https://github.com/safetensors/safetensors/issues/531 (no file-object API, on purpose) "
        "and https://github.com/safetensors/safetensors/issues/458 (streamed writes asked for)",
    ),
    Workaround(
        "redispatch_disk",
        "accelerate, transformers, diffusers",
        "accelerate >=1.0 (tested 1.15): an all-disk map executes on the CPU",
        "https://github.com/huggingface/transformers/pull/46749 (discussed, left out of scope) "
        "and https://github.com/huggingface/accelerate/issues/1600",
    ),
    Workaround(
        "mixed_map_kwargs",
        "diffusers, accelerate",
        "diffusers >=0.35 (tested 0.42.1; still needed)",
        "https://github.com/huggingface/accelerate/pull/2116 (open: offload_state_dict ignores "
        "the kept dtypes)",
    ),
    Workaround(
        "never_split",
        "diffusers",
        "diffusers >=0.35 (tested 0.42.1; still needed)",
        "https://github.com/huggingface/diffusers/pull/12523 (_skip_keys, not passed by "
        "from_pretrained's dispatch); the same fix downstream: "
        "https://github.com/vladmandic/sdnext/pull/4534",
    ),
    Workaround(
        "group_offload_level",
        "diffusers",
        "diffusers >=0.33 (group offloading; tested 0.42.1; still needed)",
        "none found: block_level grouping of nested ModuleLists with tied weights",
    ),
    Workaround(
        "remove_diffusers_hooks",
        "diffusers",
        "diffusers >=0.33 (tested 0.42.1): private _diffusers_hook registry",
        "none found: no public API to undo apply_group_offloading",
    ),
    Workaround(
        "hide_flag_types",
        "typer",
        "typer >=0.12 (tested 0.29.2; still needed): rich help shows <bool> after every flag",
        "none found: typer's rich_utils prints `display_type_rich()` for flags as for options",
    ),
)
