"""The student's WanTransformer3DModel config: the teacher's, shrunk, checked against the cache.

Precedence, lowest first: the teacher's transformer config (recorded in the cache manifest),
`student.config_file` (JSON), then the recipe's `student.num_layers / num_attention_heads /
attention_head_dim / ffn_dim`. Everything else (patch size, RoPE, qk-norm, eps) stays the
teacher's, so the student is a drop-in `transformer` for the teacher's `WanPipeline`.
"""

from __future__ import annotations

import inspect
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import Field

from wandistill.checks.validate import OpenSchema, check, load_json_file
from wandistill.config import StudentConfig
from wandistill.errors import UsageError

if TYPE_CHECKING:
    from wandistill.cache.files import DimsBlock

SIZE_KEYS = ("num_layers", "num_attention_heads", "attention_head_dim", "ffn_dim")


@cache
def init_params() -> frozenset[str]:
    """Keys WanTransformer3DModel.__init__ takes (teacher configs also carry `_class_name`)."""
    from diffusers import WanTransformer3DModel

    return frozenset(inspect.signature(WanTransformer3DModel.__init__).parameters) - {"self"}


Dim = Annotated[int, Field(ge=1, le=1 << 16)]
MAX_PARAMS = 100e9
"""A student bigger than this is a typo, not a distillation target (Wan 14B is 14e9)."""
FIX_CONFIG = "point student.config_file at a JSON object of WanTransformer3DModel config keys"


class StudentConfigFile(OpenSchema):
    """WanTransformer3DModel config keys as found in a JSON file: `student.config_file`, the
    teacher's transformer config recorded in the cache, a student folder's config.json. Every
    key is optional; keys the installed diffusers does not take are refused separately."""

    patch_size: (
        Annotated[list[Annotated[int, Field(ge=1, le=64)]], Field(min_length=3, max_length=3)]
        | None
    ) = None
    num_attention_heads: Annotated[int, Field(ge=1, le=4096)] | None = None
    attention_head_dim: Annotated[int, Field(ge=2, le=4096)] | None = None
    in_channels: Dim | None = None
    out_channels: Dim | None = None
    text_dim: Dim | None = None
    freq_dim: Dim | None = None
    ffn_dim: Annotated[int, Field(ge=1, le=1 << 20)] | None = None
    num_layers: Annotated[int, Field(ge=1, le=1024)] | None = None
    cross_attn_norm: bool | None = None
    qk_norm: Literal["rms_norm_across_heads"] | None = None
    """The only norm diffusers' Wan blocks implement (they ignore the value otherwise)."""
    eps: Annotated[float, Field(gt=0.0, lt=1.0)] | None = None
    image_dim: Dim | None = None
    added_kv_proj_dim: Dim | None = None
    rope_max_seq_len: Annotated[int, Field(ge=1, le=1 << 20)] | None = None
    pos_embed_seq_len: Annotated[int, Field(ge=1, le=1 << 20)] | None = None


def check_config(config: dict[str, Any], where: str, fix: str = FIX_CONFIG) -> dict[str, Any]:
    """Types, ranges, keys the installed diffusers takes, and a sane size; `_` keys dropped."""
    data = {k: v for k, v in config.items() if not k.startswith("_")}
    check(StudentConfigFile, data, where, fix=fix)
    unknown = sorted(set(data) - init_params())
    if unknown:
        raise UsageError(
            f"{where} has keys WanTransformer3DModel does not take: {', '.join(unknown)}",
            fix=f"use only: {', '.join(sorted(init_params()))}",
        )
    return data


def check_saved_config(folder: str | Path) -> None:
    """A student folder's config.json (what `train` exported), checked before diffusers reads
    it: bad JSON, wrong types or an absurd size are one error naming the file, not a traceback
    or a model too big to build."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        return  # diffusers reports the folder as not a model folder
    fix = "pass the student folder written by `wandistill train` (<out>/student)"
    data, _ = load_json_file(path, dict[str, Any], what="student config", fix=fix)
    data = check_config(data, f"student config {str(path)!r}", fix=fix)
    _check_size(data, f"student config {str(path)!r}")


def _check_size(config: dict[str, Any], where: str) -> None:
    """A rough parameter count (attention + cross-attention + FFN per block) below MAX_PARAMS."""
    w = int(config.get("num_attention_heads", 40)) * int(config.get("attention_head_dim", 128))
    ffn = int(config.get("ffn_dim", 13824))
    n = float(config.get("num_layers", 40)) * (8.0 * w * w + 2.0 * w * ffn)
    if n > MAX_PARAMS:
        raise UsageError(
            f"{where} describes a model of ~{n / 1e9:.0f}B parameters, more than the "
            f"{MAX_PARAMS / 1e9:.0f}B any distillation target has",
            fix="check num_layers / num_attention_heads / attention_head_dim / ffn_dim",
        )


def resolve_student_config(
    cfg: StudentConfig, teacher_config: dict[str, Any] | None, dims: DimsBlock
) -> dict[str, Any]:
    """The full WanTransformer3DModel kwargs of the student (JSON-able)."""
    base = {k: v for k, v in (teacher_config or {}).items() if k in init_params()}
    if not base:
        # An old cache without the teacher's config: size the interface from the cache itself.
        base = {
            "text_dim": dims.text_dim,
            "in_channels": dims.latent_channels,
            "out_channels": dims.latent_channels,
        }
        base = {k: v for k, v in base.items() if v is not None}
    if cfg.config_file:
        path = cfg.config_file
        data, _ = load_json_file(path, dict[str, Any], what="student.config_file", fix=FIX_CONFIG)
        base.update(check_config(data, f"student.config_file {path!r}"))
    base.update({k: getattr(cfg, k) for k in SIZE_KEYS if getattr(cfg, k) is not None})
    missing = [k for k in SIZE_KEYS if k not in base]
    if missing:
        raise UsageError(
            f"the student's {', '.join(missing)} are not set and the cache records no teacher "
            "transformer config to start from",
            fix="set them under [train.student] or in student.config_file",
        )
    where = "the student config (the cache's teacher config, student.config_file, the recipe)"
    check_config(base, where, fix="fix student.config_file or the [train.student] sizes")
    _check_size(base, "the student config")
    return base


def check_against_cache(config: dict[str, Any], dims: DimsBlock, cache: str) -> list[str]:
    """Every way this student cannot read this cache, each naming both values and the fix."""
    problems: list[str] = []
    pairs = [
        ("text_dim", config.get("text_dim", 4096), "text_dim", "prompt embeddings"),
        ("in_channels", config.get("in_channels", 16), "latent_channels", "latents"),
        (
            "out_channels",
            config.get("out_channels") or config.get("in_channels", 16),
            "latent_channels",
            "teacher outputs",
        ),
    ]
    for key, mine, dim_key, what in pairs:
        theirs = getattr(dims, dim_key)
        if theirs is not None and int(mine) != int(theirs):
            problems.append(
                f"student {key}={mine} but the cache {cache!r} has {what} with "
                f"{dim_key}={theirs}; set {key} to {theirs} (student.config_file) or use a cache "
                f"from a teacher with {dim_key}={mine}"
            )
    head_dim = int(config.get("attention_head_dim", 128))
    if head_dim % 2:
        problems.append(f"student attention_head_dim={head_dim} must be even (Wan RoPE)")
    patch = list(config.get("patch_size", (1, 2, 2)))
    shape = dims.latent_shape
    if shape and len(shape) == 4 and any(s % p for s, p in zip(shape[1:], patch, strict=True)):
        problems.append(
            f"student patch_size={patch} does not divide the cache's latent frames x height x "
            f"width {shape[1:]}; keep the teacher's patch_size"
        )
    if config.get("image_dim") is not None:
        problems.append(
            "student image_dim is set (an image-to-video config) but caches hold text-only "
            "conditioning; remove image_dim"
        )
    return problems


def width(config: dict[str, Any]) -> int:
    """Hidden width of a Wan transformer: heads x head dim (what its blocks output)."""
    return int(config["num_attention_heads"]) * int(config["attention_head_dim"])


def describe(config: dict[str, Any]) -> str:
    return (
        f"{config['num_layers']} layers x width {width(config)} "
        f"({config['num_attention_heads']} heads x {config['attention_head_dim']}), "
        f"ffn {config['ffn_dim']}, patch {tuple(config.get('patch_size', (1, 2, 2)))}"
    )
