"""Memory estimates for one teacher component: weights (exact) and activations (a formula).

Every component is built on the meta device from its config (`accelerate.init_empty_weights`);
parameter sizes come from the safetensors headers when a real teacher folder is given (from the
config otherwise). Activations are estimates (formulas in `activation_bytes`) with a 25% margin.
`SamplerSizes` holds the sampler numbers that set them.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from wandistill.errors import UsageError
from wandistill.io.modelfolder import FLOAT_CODES, SAFETENSORS_BYTES
from wandistill.placement.protocol import component_class
from wandistill.placement.train_size import TrainShape
from wandistill.runtime import workarounds

if TYPE_CHECKING:
    from wandistill.config import PrecomputeConfig

__all__ = [
    "ACTIVATION_MARGIN",
    "BLOCK_LISTS",
    "ComponentSize",
    "SamplerSizes",
    "activation_bytes",
    "component_size",
    "dtype_from_name",
    "dtype_name",
    "fp32_kept",
    "module_sizes",
    "quiet_libraries",
    "shared_meta_model",
    "special_dtypes",
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
    def from_config(cls, cfg: PrecomputeConfig) -> SamplerSizes:
        s = cfg.sampler
        return cls(
            height=s.height,
            width=s.width,
            num_frames=s.num_frames,
            batch_size=s.batch_size,
            max_sequence_length=s.max_sequence_length,
            cfg=s.guidance_scale > 1.0 or (s.guidance_scale_2 or 0.0) > 1.0,
            previews=cfg.previews > 0,
        )

    @property
    def latent(self) -> TrainShape:
        """The latent these sizes give (VAE strides 4 x 8 x 8): one formula, train_size's."""
        return TrainShape.from_video(
            num_frames=self.num_frames, height=self.height, width=self.width
        )

    @property
    def latent_frames(self) -> int:
        return self.latent.latent_frames

    def tokens(self, patch: tuple[int, int, int] = (1, 2, 2)) -> int:
        """Transformer sequence length: latent frames x (h / 16) x (w / 16) for Wan."""
        return self.latent.tokens(patch)

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


def dtype_name(dtype: torch.dtype) -> str:
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


@contextlib.contextmanager
def quiet_libraries() -> Iterator[None]:
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


@functools.lru_cache(maxsize=8)
def shared_meta_model(name: str, config_json: str) -> torch.nn.Module:
    """Component `name` built on the meta device from its config (JSON text): no memory, no
    weights; built once per (component, config), since plans only read these."""
    from accelerate import init_empty_weights

    cls = component_class(name)
    with quiet_libraries(), init_empty_weights():
        if name == "text_encoder":
            from transformers import UMT5Config

            model = cls(UMT5Config.from_dict(json.loads(config_json)))
        else:
            model = cls.from_config(json.loads(config_json))
    workarounds.tie_meta_weights(model)  # from_pretrained ties shared <-> encoder.embed_tokens
    return model.eval()


def special_dtypes(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.dtype]:
    """accelerate's `special_dtypes` for `model` at `dtype`: its fp32-kept parameters."""
    kept = fp32_kept(type(model), dtype)
    return {n: torch.float32 for n, _ in model.named_parameters() if kept(n)}


@functools.lru_cache(maxsize=16)
def module_sizes(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, int]:
    """accelerate's `compute_module_sizes` of a (shared, meta) model at the run dtype."""
    from accelerate.utils import compute_module_sizes

    sizes = compute_module_sizes(model, dtype=dtype, special_dtypes=special_dtypes(model, dtype))
    return dict(sizes)


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
    seen: set[int | str] = set()
    params = total = kept_bytes = 0
    for name, (numel, code) in header.items():
        pid = ids.get(name, name)  # a tensor the model lacks is its own
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
    kept = fp32_kept(type(model), dtype)
    source = "safetensors headers" if header else "config"
    if not header:  # the meta model's own parameters, as float tensors
        header = {n: (p.numel(), "F32") for n, p in model.named_parameters()}
    params, total, kept_bytes = _weights_from_headers(header, model, dtype, kept)
    prefix, sizes = BLOCK_LISTS.get(name), module_sizes(model, dtype)
    count = len(model.get_submodule(prefix)) if prefix else 0
    blocks = [sizes.get(f"{prefix}.{i}", 0) for i in range(count)]
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


def dtype_from_name(name: str) -> torch.dtype:
    """ "fp32" | "fp16" | "bf16" -> torch dtype."""
    table = {v: k for k, v in _DTYPE_NAMES.items()}
    if name not in table:
        raise UsageError(f"dtype {name!r} is not one of fp32, fp16, bf16", fix="pass --dtype bf16")
    return table[name]
