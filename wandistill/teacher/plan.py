"""Memory planning for the teacher: which placement fits this machine, and which is fastest.

Nothing here loads weights. Every component is built on the meta device from its config
(`accelerate.init_empty_weights`), parameter sizes come from the safetensors headers when a real
teacher folder is given (from the config otherwise), and accelerate's own `infer_auto_device_map`
simulates the `balanced` / `balanced_low_0` / `sequential` device maps over the GPUs of an
`Inventory` — the real one (`Inventory.detect()`) or a made-up one (`Inventory.fake(...)`), so a
plan for 4x80 GB can be made on a laptop.

Precompute runs in phases and frees each phase's models before the next (docs/architecture.md),
so a strategy's need on a device is the maximum over phases, never the sum:

    encode   text encoder alone (UMT5-xxl: ~5.7B parameters)
    denoise  the transformer; Wan 2.2 A14B: one expert resident at a time by default
    decode   the VAE, only when previews are asked for

Weights are exact; activations are estimates (formulas in `activation_bytes`) with a 25% margin,
plus a fixed allowance for the CUDA context and allocator slack on each GPU and for the Python
process on the CPU. `Plan.auto` is the fastest strategy (lowest speed rank) that fits everywhere.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import shutil
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from wandistill import workarounds
from wandistill.errors import UsageError
from wandistill.modelfolder import COMPONENT_CLASSES, FLOAT_CODES, SAFETENSORS_BYTES
from wandistill.placements import (
    CPU_OVERHEAD,
    CUDA_OVERHEAD,
    Auto,
    Cuda,
    GiB,
    Need,
    Placement,
    parse_size,
)
from wandistill.teacher.folder import (
    CONFIG_NAMES,
    TeacherFolder,
    config_folder,
    validate_config,
)

if TYPE_CHECKING:
    from rich.console import RenderableType

    from wandistill.config import PrecomputeConfig, SamplerConfig

__all__ = [
    "CONFIG_NAMES",
    "CPU_OVERHEAD",
    "CUDA_OVERHEAD",
    "GPU",
    "GiB",
    "PlanContext",
    "ComponentSize",
    "Inventory",
    "Phase",
    "Plan",
    "SamplerSizes",
    "StrategyPlan",
    "config_folder",
    "fp32_kept",
    "make_plan",
    "read_meminfo",
    "render_plan",
    "too_small",
]

#: Margin on every activation estimate.
ACTIVATION_MARGIN = 1.25

#: Where each component keeps its repeated blocks (group offload's block_level granularity).
BLOCK_LISTS: Mapping[str, str | None] = {
    "text_encoder": "encoder.block",
    "transformer": "blocks",
    "transformer_2": "blocks",
    "vae": None,
}

_DTYPE_NAMES: Mapping[torch.dtype, str] = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
}


# --------------------------------------------------------------------------- inventory


class GPU(NamedTuple):
    """One visible accelerator: (name, total_bytes, free_bytes)."""

    name: str
    total_bytes: int
    free_bytes: int


def read_meminfo(path: str = "/proc/meminfo") -> dict[str, int]:
    """/proc/meminfo as bytes ({"MemTotal": ..., "MemAvailable": ...}); {} where there is none."""
    info: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for line in Path(path).read_text().splitlines():
            key, _, rest = line.partition(":")
            fields = rest.split()
            if fields and fields[0].isdigit():
                info[key] = int(fields[0]) * (1024 if fields[1:] == ["kB"] else 1)
    return info


def _cgroup_available() -> int | None:
    """Room left under a cgroup v2 memory limit (containers), or None if unlimited/unknown."""
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
    except (OSError, ValueError):
        return None
    return None if limit == "max" else max(0, int(limit) - used)


def _existing_parent(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


@dataclass(frozen=True, slots=True)
class Inventory:
    """The memory a plan may use: GPUs with their free memory, CPU RAM and disk."""

    gpus: tuple[GPU, ...] = ()
    """Visible GPUs in index order (cuda:0 first)."""
    cpu_bytes: int = 0
    """RAM available to this process (MemAvailable, capped by a cgroup limit)."""
    disk_bytes: int = 0
    """Free space on the filesystem that holds the offload folder."""
    source: str = "detected"
    """"detected" or a description of the fake."""

    @classmethod
    def detect(cls, disk_path: str | Path | None = None) -> Inventory:
        """What this process can see now: torch.cuda.mem_get_info per GPU, /proc/meminfo, df."""
        gpus: list[GPU] = []
        if torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                free, total = torch.cuda.mem_get_info(i)
                gpus.append(GPU(torch.cuda.get_device_name(i), int(total), int(free)))
        info = read_meminfo()
        ram = info.get("MemAvailable", info.get("MemTotal", 0))
        cgroup = _cgroup_available()
        if cgroup is not None:
            ram = min(ram, cgroup) if ram else cgroup
        disk = shutil.disk_usage(_existing_parent(Path(disk_path or "."))).free
        return cls(gpus=tuple(gpus), cpu_bytes=ram, disk_bytes=disk)

    @classmethod
    def fake(
        cls,
        gpus: int = 0,
        gpu_gib: float = 80.0,
        *,
        cpu_gib: float = 256.0,
        disk_gib: float = 1000.0,
        gpu_free_gib: float | None = None,
        gpu_name: str | None = None,
    ) -> Inventory:
        """`gpus` identical GPUs of `gpu_gib` (free: `gpu_free_gib`, default ~all but 0.5 GiB)."""
        free = gpu_free_gib if gpu_free_gib is not None else max(0.0, gpu_gib - 0.5)
        name = gpu_name or f"fake {gpu_gib:g} GB GPU"
        gpu = GPU(name, int(gpu_gib * GiB), int(free * GiB))
        desc = f"fake: {gpus}x{gpu_gib:g} GiB GPU, {cpu_gib:g} GiB RAM, {disk_gib:g} GiB disk"
        return cls((gpu,) * gpus, int(cpu_gib * GiB), int(disk_gib * GiB), desc)

    @classmethod
    def described(
        cls, *, gpus: int | None, gpu_mem: str | None, cpu_mem: str | None, disk: str | None
    ) -> Inventory:
        """A machine described on the command line (`plan --gpus 4 --gpu-mem 80GiB --cpu-mem
        512GiB [--disk 2TiB]`), sizes in any form `placements.parse_size` accepts. Each GPU has
        its size minus 0.5 GiB free (as `fake`); the disk defaults to 1 TiB."""
        if gpus is not None and gpus < 0:
            raise UsageError(f"--gpus {gpus} must be 0 or more", fix="e.g. --gpus 4")
        if gpu_mem is not None and not gpus:
            raise UsageError(
                f"--gpu-mem {gpu_mem} describes GPUs but --gpus is {gpus or 0}",
                fix=f"add --gpus N (e.g. --gpus 1 --gpu-mem {gpu_mem})",
            )
        if gpus and gpu_mem is None:
            raise UsageError(
                f"--gpus {gpus} needs the memory of each GPU", fix="add e.g. --gpu-mem 80GiB"
            )
        if cpu_mem is None:
            raise UsageError(
                "a described machine needs its RAM (--cpu-mem)", fix="add e.g. --cpu-mem 512GiB"
            )
        gpu_bytes = parse_size(gpu_mem, "--gpu-mem") if gpus else 0
        ram = parse_size(cpu_mem, "--cpu-mem")
        room = parse_size(disk or "1TiB", "--disk")
        gpu = GPU(f"{gpu_bytes / GiB:g} GiB GPU", gpu_bytes, max(0, gpu_bytes - GiB // 2))
        desc = (
            f"described: {gpus or 0}x{gpu_bytes / GiB:.1f} GiB GPU, {ram / GiB:.1f} GiB RAM, "
            f"{room / GiB:.0f} GiB disk{'' if disk else ' (default)'}"
        )
        return cls((gpu,) * (gpus or 0), ram, room, desc)

    @classmethod
    def cpu_only(cls, cpu_gib: float = 64.0, disk_gib: float = 1000.0) -> Inventory:
        return cls.fake(0, cpu_gib=cpu_gib, disk_gib=disk_gib)

    def only(self, index: int) -> Inventory:
        """The same machine seen by one torchrun rank that owns GPU `index` (as its cuda:0)."""
        return replace(self, gpus=(self.gpus[index],), source=f"{self.source}, GPU {index} only")

    @property
    def has_cuda(self) -> bool:
        return bool(self.gpus)

    def devices(self) -> list[str]:
        return [f"cuda:{i}" for i in range(len(self.gpus))] + ["cpu", "disk"]

    def available(self, device: str) -> int:
        if device == "cpu":
            return self.cpu_bytes
        if device == "disk":
            return self.disk_bytes
        return self.gpus[int(device.split(":")[1])].free_bytes


# --------------------------------------------------------------------------- workload


@dataclass(frozen=True, slots=True)
class SamplerSizes:
    """The sampler numbers that set activation memory (a subset of `SamplerConfig`)."""

    height: int = 480
    width: int = 832
    num_frames: int = 81
    batch_size: int = 1
    max_sequence_length: int = 512
    cfg: bool = True
    """Classifier-free guidance on (a second, unconditional pass per step)."""
    cfg_batched: bool = False
    """The two CFG passes run as one doubled batch. wandistill's RecordingSampler runs them as
    separate forwards (bit-for-bit WanPipeline), so activations are those of one pass."""
    previews: bool = False
    """A VAE decode phase follows the denoiser."""

    @classmethod
    def from_sampler(cls, s: SamplerConfig, *, previews: bool = False) -> SamplerSizes:
        guided = s.guidance_scale > 1.0 or (s.guidance_scale_2 or 0.0) > 1.0
        return cls(
            height=s.height,
            width=s.width,
            num_frames=s.num_frames,
            batch_size=s.batch_size,
            max_sequence_length=s.max_sequence_length,
            cfg=guided,
            previews=previews,
        )

    @classmethod
    def from_config(cls, cfg: PrecomputeConfig) -> SamplerSizes:
        return cls.from_sampler(cfg.sampler, previews=cfg.previews > 0)

    @property
    def latent_frames(self) -> int:
        return (self.num_frames - 1) // 4 + 1

    def tokens(self, patch: tuple[int, int, int] = (1, 2, 2), vae_stride: int = 8) -> int:
        """Transformer sequence length: latent frames x (h / 16) x (w / 16) for Wan."""
        t, ph, pw = patch
        return (
            math.ceil(self.latent_frames / t)
            * (self.height // vae_stride // ph)
            * (self.width // vae_stride // pw)
        )

    @property
    def denoise_batch(self) -> int:
        return self.batch_size * (2 if self.cfg and self.cfg_batched else 1)

    def describe(self) -> str:
        cfg = ("CFG batched x2" if self.cfg_batched else "CFG 2 passes") if self.cfg else "no CFG"
        return (
            f"{self.width}x{self.height}, {self.num_frames} frames, batch {self.batch_size}, "
            f"{cfg}, {self.tokens():,} tokens, text {self.max_sequence_length}"
        )


# --------------------------------------------------------------------------- components


def _dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def fp32_kept(cls: type, dtype: torch.dtype) -> Callable[[str], bool]:
    """Which parameter names `cls.from_pretrained(torch_dtype=dtype)` keeps in float32.

    The two libraries differ: diffusers keeps `_keep_in_fp32_modules` for any reduced dtype and
    matches whole name parts (Wan: rope, time_embedder, scale_shift_table, norm1/2/3);
    transformers keeps `_keep_in_fp32_modules` only for fp16 (UMT5: the FFN output `wo`) and
    `_keep_in_fp32_modules_strict` for fp16 and bf16, matching patterns anywhere in the name.
    """
    import re

    if dtype == torch.float32:
        return lambda name: False
    if getattr(cls, "__module__", "").startswith("transformers"):
        patterns = set(getattr(cls, "_keep_in_fp32_modules_strict", None) or [])
        if dtype == torch.float16:
            patterns |= set(getattr(cls, "_keep_in_fp32_modules", None) or [])
        if not patterns:
            return lambda name: False
        rx = re.compile("|".join(re.escape(p).replace(r"\*", ".*") for p in sorted(patterns)))
        return lambda name: rx.search(name) is not None
    keep = tuple(getattr(cls, "_keep_in_fp32_modules", None) or ())
    return lambda name: any(part in keep for part in name.split("."))


def component_class(name: str) -> type:
    """The class that loads component `name` (imports diffusers/transformers lazily)."""
    import importlib

    library, cls_name = COMPONENT_CLASSES[name]
    return getattr(importlib.import_module(library), cls_name)


@contextlib.contextmanager
def _quiet_libraries() -> Iterator[None]:
    """Mute accelerate's "Device 0 is not available" and friends while simulating fake GPUs."""
    names = ("accelerate", "accelerate.utils.modeling", "diffusers", "transformers")
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def meta_model(name: str, config: Mapping[str, Any]) -> torch.nn.Module:
    """Component `name` built on the meta device from its config dict: no memory, no weights."""
    from accelerate import init_empty_weights

    cls = component_class(name)
    with _quiet_libraries(), init_empty_weights():
        if name == "text_encoder":
            from transformers import UMT5Config

            model = cls(UMT5Config.from_dict(dict(config)))
        else:
            model = cls.from_config(dict(config))
    workarounds.tie_meta_weights(model)  # from_pretrained ties shared <-> encoder.embed_tokens
    return model.eval()


@functools.lru_cache(maxsize=8)
def _shared_meta_model(name: str, config_json: str) -> torch.nn.Module:
    """meta_model, built once per (component, config): plans only read these."""
    return meta_model(name, json.loads(config_json))


@dataclass(frozen=True, slots=True)
class ComponentSize:
    """Memory facts about one component at one dtype."""

    name: str
    class_name: str
    params: int
    weight_bytes: int
    """All weights at the run dtype, the fp32-kept ones at 4 bytes."""
    fp32_kept_bytes: int
    """The part of weight_bytes that stays float32 under a reduced dtype."""
    largest_group_bytes: int
    """Largest block of its block list (group offload block_level moves one at a time)."""
    resident_bytes: int
    """What block_level group offload keeps on the GPU for the whole forward (embeddings, heads)."""
    largest_leaf_bytes: int
    """Largest single module's own weights (leaf_level group offload and disk offload)."""
    source: str
    """"safetensors headers" or "config"."""
    no_split: tuple[str, ...] = ()
    """Module classes accelerate must not split across devices; empty: whole component on one."""


def _block_sizes(model: torch.nn.Module, prefix: str | None, sizes: Mapping[str, int]) -> list[int]:
    if prefix is None:
        return []
    blocks = model.get_submodule(prefix)
    return [sizes.get(f"{prefix}.{i}", 0) for i in range(len(blocks))]


def _own_bytes(model: torch.nn.Module, dtype: torch.dtype, kept: Callable[[str], bool]) -> int:
    """Largest sum of one module's direct parameters (what one accelerate hook onloads)."""
    best = 0
    for mod_name, module in model.named_modules():
        total = 0
        for p_name, p in module.named_parameters(recurse=False):
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            total += p.numel() * (4 if kept(full) else dtype.itemsize)
        best = max(best, total)
    return best


def _weights_from_headers(
    header: Mapping[str, tuple[int, str]],
    model: torch.nn.Module,
    dtype: torch.dtype,
    kept: Callable[[str], bool],
) -> tuple[int, int, int]:
    """(params, bytes at the run dtype, fp32-kept bytes) from safetensors headers.

    A tensor stored under two tied names (UMT5's shared / encoder.embed_tokens) counts once.
    """
    ids = {n: id(p) for n, p in model.named_parameters(remove_duplicate=False)}
    seen: set[int] = set()
    params = total = kept_bytes = 0
    for name, (numel, code) in header.items():
        pid = ids.get(name)
        if pid is not None:
            if pid in seen:
                continue
            seen.add(pid)
        params += numel
        if code not in FLOAT_CODES:
            total += numel * SAFETENSORS_BYTES.get(code, 4)
        elif kept(name):
            total += numel * 4
            kept_bytes += numel * 4
        else:
            total += numel * dtype.itemsize
    return params, total, kept_bytes


def component_size(
    name: str,
    model: torch.nn.Module,
    dtype: torch.dtype,
    header: Mapping[str, tuple[int, str]] | None = None,
) -> ComponentSize:
    """Sizes of a meta-device component; weight totals from safetensors headers when given
    ({tensor: (numel, dtype code)}, `TeacherFolder.numels`)."""
    from accelerate.utils import compute_module_sizes

    kept = fp32_kept(type(model), dtype)
    special = {n: torch.float32 for n, _ in model.named_parameters() if kept(n)}
    sizes = compute_module_sizes(model, dtype=dtype, special_dtypes=special)
    params = sum(p.numel() for p in model.parameters())
    total = sum(p.numel() * (4 if kept(n) else dtype.itemsize) for n, p in model.named_parameters())
    kept_bytes = sum(p.numel() * 4 for n, p in model.named_parameters() if kept(n))
    source = "config"
    if header:
        params, total, kept_bytes = _weights_from_headers(header, model, dtype, kept)
        source = "safetensors headers"
    blocks = _block_sizes(model, BLOCK_LISTS.get(name), sizes)
    no_split = tuple(getattr(model, "_no_split_modules", None) or ())
    return ComponentSize(
        name=name,
        class_name=type(model).__name__,
        params=params,
        weight_bytes=total,
        fp32_kept_bytes=kept_bytes,
        largest_group_bytes=max(blocks, default=0),
        resident_bytes=total - sum(blocks) if blocks else total,
        largest_leaf_bytes=_own_bytes(model, dtype, kept),
        source=source,
        no_split=no_split,
    )


# --------------------------------------------------------------------------- activations


def activation_bytes(
    name: str, config: Mapping[str, Any], sizes: SamplerSizes, dtype: torch.dtype
) -> int:
    """Estimated peak activation memory of one forward of component `name` (with margin).

    transformer: B x L tokens through one block at a time (no grad): the residual stream, q/k/v,
      fp32 RoPE/norm temporaries and the FFN's two ffn_dim-wide tensors; B doubles when the
      CFG passes are batched.
    text_encoder: B x T tokens, plus fp32 position bias and attention scores (heads x T x T).
    vae: decoding one latent frame at a time to 4 pixel frames at full resolution, ~12 live
      tensors of base_dim channels (the causal cache included), plus the decoded video in fp32.
    """
    s = dtype.itemsize
    if name.startswith("transformer"):
        d = config["num_attention_heads"] * config["attention_head_dim"]
        ffn = config["ffn_dim"]
        tokens = sizes.tokens(tuple(config.get("patch_size", (1, 2, 2))))
        b = sizes.denoise_batch
        per_token = (8 * s + 12) * d + 2 * s * ffn
        text = 4 * b * sizes.max_sequence_length * d * s
        est = b * tokens * per_token + text
    elif name == "text_encoder":
        d, ff, heads = config["d_model"], config["d_ff"], config["num_heads"]
        b, t = sizes.batch_size, sizes.max_sequence_length
        est = b * t * (6 * d + 3 * ff) * s + b * heads * t * t * (2 * s + 4) + heads * t * t * 4
    else:
        base = config.get("base_dim", 96)
        pixels = sizes.height * sizes.width
        est = 4 * pixels * base * s * 12 + 3 * sizes.num_frames * pixels * 4
    return int(est * ACTIVATION_MARGIN)


# --------------------------------------------------------------------------- plan


@dataclass(frozen=True, slots=True)
class Phase:
    """Models resident at the same time, and the activations of the one running."""

    name: str
    components: tuple[str, ...]
    activation_bytes: int


@dataclass(frozen=True, slots=True)
class StrategyPlan:
    """One placement strategy on this inventory."""

    placement: Placement
    """The strategy; device-map strategies carry the per-component max_memory planned here."""
    speed_rank: int
    """1 = expected fastest; an estimate from how much data moves per forward, not measured."""
    needs: dict[str, dict[str, int]]
    """phase name -> device -> bytes."""
    peak: dict[str, int]
    """device -> max over phases (phases run one after another)."""
    fits: bool
    note: str
    """Why it does not fit, or what it assumes."""
    max_memory: dict[str, dict[int | str, int]] = field(default_factory=dict)
    """Device-map strategies: component -> the max_memory passed to accelerate when loading."""

    @property
    def strategy(self) -> str:
        """The --placement value (cuda rows name their GPU, e.g. cuda:0)."""
        return str(self.placement)

    @property
    def flag(self) -> str:
        return self.placement.flags()


@dataclass(frozen=True, slots=True)
class AutoChoice:
    placement: Placement | None
    """None when nothing fits."""
    reason: str

    @property
    def strategy(self) -> str | None:
        return None if self.placement is None else str(self.placement)


@dataclass(frozen=True, slots=True)
class Plan:
    teacher: str
    dtype: torch.dtype
    sizes: SamplerSizes
    inventory: Inventory
    components: tuple[ComponentSize, ...]
    phases: tuple[Phase, ...]
    strategies: tuple[StrategyPlan, ...]
    """Sorted by speed rank; a requested placement that auto never picks comes last."""
    auto: AutoChoice
    requested: Placement | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)

    def strategy(self, which: str | Placement) -> StrategyPlan:
        """The row for a placement (any single-GPU placement maps to the single-GPU row); a
        string is looked up by its --placement text, for tests and the command line."""
        for sp in self.strategies:
            if _same_strategy(sp.placement, which):
                return sp
        raise KeyError(str(which))

    def component(self, name: str) -> ComponentSize:
        return next(c for c in self.components if c.name == name)

    def activation(self, component: str) -> int:
        return max(
            (p.activation_bytes for p in self.phases if component in p.components), default=0
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "teacher": self.teacher,
            "dtype": _dtype_name(self.dtype),
            "sizes": {k: getattr(self.sizes, k) for k in SamplerSizes.__dataclass_fields__},
            "tokens": self.sizes.tokens(),
            "inventory": {
                "gpus": [list(g) for g in self.inventory.gpus],
                "cpu_bytes": self.inventory.cpu_bytes,
                "disk_bytes": self.inventory.disk_bytes,
                "source": self.inventory.source,
            },
            "components": [
                {k: getattr(c, k) for k in ComponentSize.__dataclass_fields__}
                for c in self.components
            ],
            "phases": [
                {
                    "name": p.name,
                    "components": list(p.components),
                    "activation_bytes": p.activation_bytes,
                }
                for p in self.phases
            ],
            "strategies": [
                {
                    "strategy": s.strategy,
                    "speed_rank": s.speed_rank,
                    "fits": s.fits,
                    "peak": s.peak,
                    "needs": s.needs,
                    "max_memory": {
                        c: {str(k): v for k, v in mm.items()} for c, mm in s.max_memory.items()
                    },
                    "note": s.note,
                }
                for s in self.strategies
            ],
            "auto": {"strategy": self.auto.strategy, "reason": self.auto.reason},
            "requested": None if self.requested is None else str(self.requested),
            "notes": list(self.notes),
        }


def _same_strategy(placement: Placement, which: str | Placement) -> bool:
    if isinstance(which, str):
        single = which in ("cuda", "gpu0") or which.startswith("cuda:")
        return str(placement) == which or (single and isinstance(placement, Cuda))
    if isinstance(which, Cuda):
        return isinstance(placement, Cuda)
    if isinstance(which, Auto):
        return False
    same_kind = type(placement) is type(which) and str(placement) == str(which)
    return same_kind and getattr(placement, "level", None) == getattr(which, "level", None)


def _load_configs(
    source: str | Path | TeacherFolder | Mapping[str, Mapping[str, Any]],
) -> tuple[str, dict[str, dict[str, Any]], TeacherFolder | None]:
    """(label, {component: config}, folder or None) for a folder, a config name or dicts.

    A path is opened for planning (`complete=False`: weights, tokenizer and scheduler may be
    missing; what is there is validated as for precompute); config dicts are validated by the
    same typed models."""
    if isinstance(source, Mapping):
        for name, config in source.items():
            validate_config(name, config, source=f"config dict {name!r}")
        return "config dicts", {k: dict(v) for k, v in source.items()}, None
    if isinstance(source, TeacherFolder):
        folder = source
    elif str(source) in CONFIG_NAMES:
        folder = TeacherFolder.published(str(source))
    else:
        folder = TeacherFolder.open(source, complete=False)
    return folder.label, {n: folder.raw_config(n) for n in folder.components}, folder


def _phases(
    configs: Mapping[str, Mapping[str, Any]],
    sizes: SamplerSizes,
    dtype: torch.dtype,
    experts_resident: int,
) -> list[Phase]:
    def act(name: str) -> int:
        return activation_bytes(name, configs[name], sizes, dtype)

    phases = []
    if "text_encoder" in configs:
        phases.append(Phase("encode", ("text_encoder",), act("text_encoder")))
    experts = [n for n in ("transformer", "transformer_2") if n in configs]
    if len(experts) > 1 and experts_resident < len(experts):
        phases += [Phase(f"denoise ({e})", (e,), act(e)) for e in experts]
    elif experts:
        phases.append(Phase("denoise", tuple(experts), max(act(e) for e in experts)))
    if sizes.previews and "vae" in configs:
        phases.append(Phase("decode", ("vae",), act("vae")))
    return phases


@dataclass(slots=True)
class PlanContext:
    """What a placement's `need` reads: the machine, the dtype, the components' sizes and their
    meta models (see `wandistill.placements.Placement.need`)."""

    inventory: Inventory
    dtype: torch.dtype
    comps: dict[str, ComponentSize]
    models: dict[str, torch.nn.Module]
    caps: dict[int | str, int]
    """The user's max_memory: GPU index or "cpu" -> bytes."""
    best_gpu: int
    _sizes: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def gpu(self) -> str:
        """The single GPU a one-GPU strategy uses: the one with the most free memory."""
        return f"cuda:{self.best_gpu}"

    def cap(self, device: str) -> int:
        """Free memory on `device`, lowered by a user max_memory cap where one is set."""
        have = self.inventory.available(device)
        key: int | str = int(device.split(":")[1]) if device.startswith("cuda:") else device
        return min(have, self.caps[key]) if key in self.caps else have

    def special_dtypes(self, name: str) -> dict[str, torch.dtype]:
        kept = fp32_kept(type(self.models[name]), self.dtype)
        return {p: torch.float32 for p, _ in self.models[name].named_parameters() if kept(p)}

    def module_sizes(self, name: str) -> dict[str, int]:
        """accelerate's `compute_module_sizes` of component `name` at the run dtype."""
        if name not in self._sizes:
            from accelerate.utils import compute_module_sizes

            self._sizes[name] = dict(
                compute_module_sizes(
                    self.models[name], dtype=self.dtype, special_dtypes=self.special_dtypes(name)
                )
            )
        return self._sizes[name]

    def module_names(self, name: str) -> set[str]:
        """Every module and tensor name of component `name` (tied ones under each name)."""
        model = self.models[name]
        tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]
        return {n for n, _ in model.named_modules(remove_duplicate=False)} | {n for n, _ in tensors}

    def simulate_device_map(self, phase: Phase, strategy: str, *, low_zero: bool) -> Need:
        """accelerate's own device-map algorithm on the meta models, GPUs only (plus the CPU
        where the user's max_memory names it), activation headroom reserved on every GPU.

        Each component's max_memory (what the loader passes to `from_pretrained`) is recorded:
        the library then runs the same `get_balanced_memory` + `infer_auto_device_map`."""
        from accelerate.utils import get_balanced_memory, infer_auto_device_map

        headroom = phase.activation_bytes + CUDA_OVERHEAD
        budget: dict[int | str, int] = {
            i: max(0, self.cap(f"cuda:{i}") - headroom) for i in range(len(self.inventory.gpus))
        }
        if "cpu" in self.caps:
            budget["cpu"] = self.cap("cpu")
        devices: dict[str, int] = {"cpu": CPU_OVERHEAD}
        planned: dict[str, dict[int | str, int]] = {}
        spilled: list[str] = []
        for name in phase.components:
            model, comp = self.models[name], self.comps[name]
            planned[name] = dict(budget)
            kwargs = {
                "no_split_module_classes": list(comp.no_split),
                "special_dtypes": self.special_dtypes(name),
            }
            with _quiet_libraries():
                mm = dict(budget)
                if strategy != "sequential":
                    mm = get_balanced_memory(
                        model,
                        max_memory=dict(budget),
                        dtype=self.dtype,
                        low_zero=low_zero,
                        **kwargs,
                    )
                dmap = infer_auto_device_map(model, max_memory=mm, dtype=self.dtype, **kwargs)
            sizes = self.module_sizes(name)
            for module, dev in dmap.items():
                if isinstance(dev, int) or (dev == "cpu" and "cpu" in budget):
                    key = f"cuda:{dev}" if isinstance(dev, int) else "cpu"
                    devices[key] = devices.get(key, 0) + sizes.get(module, 0)
                    budget[dev] = max(0, budget[dev] - sizes.get(module, 0))
                else:
                    spilled.append(f"{name}.{module}" if module else name)
        for i in range(len(self.inventory.gpus)):
            if f"cuda:{i}" in devices:
                devices[f"cuda:{i}"] += headroom
        note = (
            f"{len(spilled)} module(s) do not fit on the GPUs (e.g. {spilled[0]})"
            if spilled
            else ""
        )
        return Need(devices, note, planned)


def _strategy_plan(
    ctx: PlanContext, phases: list[Phase], placement: Placement, rank: int
) -> StrategyPlan:
    needs: dict[str, dict[str, int]] = {}
    notes: list[str] = []
    budgets: dict[str, dict[int | str, int]] = {}
    for phase in phases:
        need = placement.need(phase, ctx)
        needs[phase.name] = need.devices
        budgets.update(need.max_memory)
        if need.note:
            notes.append(f"{phase.name}: {need.note}")
    peak: dict[str, int] = {}
    for devices in needs.values():
        for dev, b in devices.items():
            peak[dev] = max(peak.get(dev, 0), b)
    short = [
        f"{dev} needs {b / GiB:.1f} GiB, has {ctx.cap(dev) / GiB:.1f} GiB"
        for dev, b in peak.items()
        if b > ctx.cap(dev)
    ]
    fits = not short and not notes
    note = "; ".join(notes + short) if not fits else placement.why
    if budgets:
        placement = placement.with_budgets(budgets)
    return StrategyPlan(placement, rank, needs, peak, fits, note, budgets)


def _auto(strategies: list[StrategyPlan], inventory: Inventory) -> AutoChoice:
    fitting = [s for s in strategies if s.fits]
    if not fitting:
        least = min(strategies, key=lambda s: sum(s.peak.values()))
        return AutoChoice(None, f"nothing fits; closest is {least.strategy}: {least.note}")
    best = fitting[0]
    faster = [s for s in strategies if s.speed_rank < best.speed_rank]
    why = f"the fastest strategy that fits ({best.note})"
    if faster:
        why += "; faster but too big: " + "; ".join(f"{s.strategy} ({s.note})" for s in faster)
    if not inventory.has_cuda:
        why += "; no GPU visible"
    return AutoChoice(best.placement, why)


def _as_auto(requested: Placement | None) -> Auto:
    """The `auto` whose candidates share the requested strategy's caps and group level."""
    if isinstance(requested, Auto):
        return requested
    caps = getattr(requested, "caps", ())
    return Auto(level=getattr(requested, "level", "block_level"), caps=caps)


def make_plan(
    folder_or_configs: str | Path | TeacherFolder | Mapping[str, Mapping[str, Any]],
    *,
    dtype: torch.dtype,
    sizes: SamplerSizes,
    inventory: Inventory,
    placement: Placement | None = None,
    experts_resident: int = 1,
    components: tuple[str, ...] | None = None,
    only: tuple[type[Placement], ...] | None = None,
) -> Plan:
    """Plan every strategy `auto` may pick (and the requested `placement`, if auto never would)
    for a teacher folder, a committed config name, or config dicts.

    `experts_resident`: Wan 2.2 experts kept loaded together during denoising (1: the sampler
    swaps them; 2: both stay loaded). `components`: plan only these (eval needs the VAE only);
    `only`: the strategy types auto may pick (eval / sample `--device auto`: Cuda or Cpu).
    The requested placement's max_memory caps every device, as accelerate's would."""
    label, configs, folder = _load_configs(folder_or_configs)
    if components is not None:
        configs = {n: c for n, c in configs.items() if n in components}
    unknown = sorted(set(configs) - set(COMPONENT_CLASSES))
    if unknown:
        raise UsageError(f"unknown teacher component(s) {unknown}", fix="use Wan diffusers folders")
    models = {n: _shared_meta_model(n, json.dumps(c, sort_keys=True)) for n, c in configs.items()}
    comps = {
        n: component_size(n, m, dtype, folder.numels(n) if folder is not None else None)
        for n, m in models.items()
    }
    auto = _as_auto(placement)
    best_gpu = max(
        range(len(inventory.gpus)), key=lambda i: inventory.gpus[i].free_bytes, default=0
    )
    ctx = PlanContext(inventory, dtype, comps, models, dict(auto.caps), best_gpu)
    phases = _phases(configs, sizes, dtype, experts_resident)
    candidates = [
        p for p in auto.candidates(len(inventory.gpus), best_gpu) if not only or isinstance(p, only)
    ]
    plans = [_strategy_plan(ctx, phases, p, rank) for rank, p in enumerate(candidates, start=1)]
    choice = _auto(plans, inventory)
    if placement is not None and not isinstance(placement, Auto):
        if not any(_same_strategy(s.placement, placement) for s in plans):
            plans.append(_strategy_plan(ctx, phases, placement, len(plans) + 1))
    notes = (
        "weights: exact (fp32-kept layers at 4 bytes); activations: estimated, +25% margin",
        f"per GPU +{CUDA_OVERHEAD / GiB:.0f} GiB CUDA context/allocator; "
        f"CPU +{CPU_OVERHEAD / GiB:.0f} GiB process",
    )
    return Plan(
        teacher=label,
        dtype=dtype,
        sizes=sizes,
        inventory=inventory,
        components=tuple(comps.values()),
        phases=tuple(phases),
        strategies=tuple(plans),
        auto=choice,
        requested=placement,
        notes=notes,
    )


_FLAGS = {"cpu": "--cpu-mem", "disk": "--disk"}


def too_small(plan: Plan) -> UsageError:
    """The one-line error for a described machine on which nothing fits: the strategy closest
    to fitting (least memory short), what it needs per device, and the flags that would do."""
    spilled = tuple(f"{p.name}: " for p in plan.phases)  # device maps that spill: no size fixes
    pool = [s for s in plan.strategies if not s.note.startswith(spilled)] or list(plan.strategies)

    def short(s: StrategyPlan) -> int:
        inv = plan.inventory
        return sum(max(0, b - inv.available(d)) for d, b in s.peak.items())

    best = min(pool, key=short)
    needs = ", ".join(f"{d} {b / GiB:.1f} GiB" for d, b in best.peak.items())
    raise_to: dict[str, int] = {}
    for device, b in best.peak.items():
        if b > plan.inventory.available(device):
            flag = _FLAGS.get(device, "--gpu-mem")
            extra = GiB // 2 if flag == "--gpu-mem" else 0  # a described GPU keeps 0.5 GiB back
            raise_to[flag] = max(raise_to.get(flag, 0), b + extra)
    fix = " ".join(f"{f} {math.ceil(n / GiB)}GiB" for f, n in raise_to.items())
    return UsageError(
        f"the described machine ({plan.inventory.source.removeprefix('described: ')}) is too "
        f"small for teacher {plan.teacher} with any placement; the closest, {best.strategy}, "
        f"needs {needs}",
        fix=f"describe a bigger machine: {fix}" if fix else best.note,
    )


# --------------------------------------------------------------------------- rendering


def _gib(n: int) -> str:
    return f"{n / GiB:.1f}"


def render_plan(plan: Plan) -> list[RenderableType]:
    """Rich tables: components, inventory, per-phase needs per strategy, the summary, auto."""
    from rich.table import Table
    from rich.text import Text

    head = Table(title=f"teacher {plan.teacher}", show_header=False)
    head.add_row("dtype", _dtype_name(plan.dtype))
    head.add_row("sampler", plan.sizes.describe())
    head.add_row("phases", " -> ".join(f"{p.name}" for p in plan.phases))

    comps = Table(title="components")
    for col in (
        "component",
        "class",
        "params",
        "weights GiB",
        "fp32-kept GiB",
        "largest block GiB",
        "sizes from",
    ):
        comps.add_column(col, justify="right" if "GiB" in col or col == "params" else "left")
    for c in plan.components:
        comps.add_row(
            c.name,
            c.class_name,
            f"{c.params / 1e9:.2f}B",
            _gib(c.weight_bytes),
            _gib(c.fp32_kept_bytes),
            _gib(c.largest_group_bytes),
            c.source,
        )

    devices = plan.inventory.devices()
    inv = Table(title=f"inventory ({plan.inventory.source})")
    for col in ("device", "name", "total GiB", "available GiB"):
        inv.add_column(col)
    for i, g in enumerate(plan.inventory.gpus):
        inv.add_row(f"cuda:{i}", g.name, _gib(g.total_bytes), _gib(g.free_bytes))
    inv.add_row("cpu", "RAM", "", _gib(plan.inventory.cpu_bytes))
    inv.add_row("disk", "offload folder", "", _gib(plan.inventory.disk_bytes))

    out: list[RenderableType] = [head, comps, inv]
    for phase in plan.phases:
        t = Table(
            title=f"phase {phase.name}: {', '.join(phase.components)} "
            f"(activations ~{_gib(phase.activation_bytes)} GiB est.)"
        )
        t.add_column("strategy")
        for d in devices:
            t.add_column(f"{d} GiB", justify="right")
        for s in plan.strategies:
            need = s.needs[phase.name]
            t.add_row(s.strategy, *[_gib(need[d]) if d in need else "-" for d in devices])
        out.append(t)

    summary = Table(title="peak over phases, fastest first")
    for col in ("rank", "strategy", *[f"{d} GiB" for d in devices], "fits", "note"):
        summary.add_column(col, justify="right" if "GiB" in col else "left")
    for s in plan.strategies:
        mark = " <- auto" if s.placement == plan.auto.placement else ""
        if plan.requested is not None and _same_strategy(s.placement, plan.requested):
            mark += " <- requested"
        fits = Text("yes", style="green") if s.fits else Text("no", style="red")
        summary.add_row(
            str(s.speed_rank),
            s.strategy + mark,
            *[_gib(s.peak[d]) if d in s.peak else "-" for d in devices],
            fits,
            s.note,
        )
    out.append(summary)
    budgets = _budget_table(plan, devices)
    if budgets is not None:
        out.append(budgets)
    pick = plan.auto.strategy or "nothing fits"
    out.append(Text(f"auto -> {pick}: {plan.auto.reason}"))
    out.extend(Text(f"note: {n}", style="dim") for n in plan.notes)
    return out


def _budget_table(plan: Plan, devices: list[str]) -> RenderableType | None:
    """The max_memory each device-map strategy hands accelerate, per component: free memory
    minus that phase's activation headroom and the CUDA allowance (what `load` passes)."""
    from rich.table import Table

    rows = [(s, c, mm) for s in plan.strategies for c, mm in s.max_memory.items()]
    if not rows:
        return None
    t = Table(title="max_memory passed to accelerate (GiB; activation headroom reserved)")
    t.add_column("strategy")
    t.add_column("component")
    for d in devices[:-1]:  # GPUs and the CPU; never the disk
        t.add_column(d, justify="right")
    for s, component, mm in rows:
        cells = [_gib(mm[_key(d)]) if _key(d) in mm else "-" for d in devices[:-1]]
        t.add_row(s.strategy, component, *cells)
    return t


def _key(device: str) -> int | str:
    return int(device.split(":")[1]) if device.startswith("cuda:") else device


def dtype_from_name(name: str) -> torch.dtype:
    """ "fp32" | "fp16" | "bf16" -> torch dtype."""
    table = {v: k for k, v in _DTYPE_NAMES.items()}
    if name not in table:
        raise UsageError(f"dtype {name!r} is not one of fp32, fp16, bf16", fix="pass --dtype bf16")
    return table[name]
