"""The student's WanTransformer3DModel config: the teacher's, shrunk, checked against the cache.

Precedence, lowest first: the teacher's transformer config (recorded in the cache manifest),
`student.config_file` (JSON), then the recipe's `student.num_layers / num_attention_heads /
attention_head_dim / ffn_dim`. Everything else (patch size, RoPE, qk-norm, eps) stays the
teacher's, so the student is a drop-in `transformer` for the teacher's `WanPipeline`.
"""

from __future__ import annotations

import inspect
import json
from functools import cache
from pathlib import Path
from typing import Any

from wandistill.config import StudentConfig
from wandistill.errors import UsageError

SIZE_KEYS = ("num_layers", "num_attention_heads", "attention_head_dim", "ffn_dim")


@cache
def init_params() -> frozenset[str]:
    """Keys WanTransformer3DModel.__init__ takes (teacher configs also carry `_class_name`)."""
    from diffusers import WanTransformer3DModel

    return frozenset(inspect.signature(WanTransformer3DModel.__init__).parameters) - {"self"}


def _read_config_file(path: str) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise UsageError(
            f"student.config_file {path!r} does not exist",
            fix="point it at a JSON file of WanTransformer3DModel config keys",
        )
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"student.config_file {path!r} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise UsageError(f"student.config_file {path!r} must hold a JSON object")
    data = {k: v for k, v in data.items() if not k.startswith("_")}
    unknown = sorted(set(data) - init_params())
    if unknown:
        raise UsageError(
            f"student.config_file {path!r} has keys WanTransformer3DModel does not take: "
            f"{', '.join(unknown)}",
            fix=f"use only: {', '.join(sorted(init_params()))}",
        )
    return data


def resolve_student_config(
    cfg: StudentConfig, teacher_config: dict[str, Any] | None, dims: dict[str, Any]
) -> dict[str, Any]:
    """The full WanTransformer3DModel kwargs of the student (JSON-able)."""
    base = {k: v for k, v in (teacher_config or {}).items() if k in init_params()}
    if not base:
        # An old cache without the teacher's config: size the interface from the cache itself.
        base = {
            "text_dim": dims.get("text_dim"),
            "in_channels": dims.get("latent_channels"),
            "out_channels": dims.get("latent_channels"),
        }
        base = {k: v for k, v in base.items() if v is not None}
    if cfg.config_file:
        base.update(_read_config_file(cfg.config_file))
    base.update({k: getattr(cfg, k) for k in SIZE_KEYS if getattr(cfg, k) is not None})
    missing = [k for k in SIZE_KEYS if k not in base]
    if missing:
        raise UsageError(
            f"the student's {', '.join(missing)} are not set and the cache records no teacher "
            "transformer config to start from",
            fix="set them under [train.student] or in student.config_file",
        )
    return base


def check_against_cache(config: dict[str, Any], dims: dict[str, Any], cache: str) -> list[str]:
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
        theirs = dims.get(dim_key)
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
    shape = dims.get("latent_shape")
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
