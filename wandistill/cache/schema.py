"""The cache contract, defined once: field names, dtypes, shapes, record keys, format version.

Writers, readers and the verifier import these definitions; nothing else spells a field name.
Shapes use letters: L tokens (trimmed), D text width, S recorded steps, C latent channels,
F latent frames, H/W latent height/width. Feature tensors are `feature.<name>` with shape S,*.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import torch

from wandistill.validate import canonical_json

SCHEMA_VERSION = 2
"""2: the manifest is sealed (`header_sha256`) and records `numerics`; 1 is still read."""
FORMAT_NAME = "wandistill-cache"
MANIFEST_NAME = "manifest.json"
SHARED_NAME = "shared.safetensors"
FEATURE_PREFIX = "feature."


@dataclass(frozen=True, slots=True)
class FieldSpec:
    name: str
    shape: str
    """Comma-separated shape pattern, e.g. "S,C,F,H,W"."""
    kind: str
    """Which dtype the field carries: "latent" (the sampler's latents, fp32 in WanPipeline),
    "model" (what the denoiser sees and returns: the teacher's dtype), "embed", or a fixed one."""
    doc: str


FIELDS: tuple[FieldSpec, ...] = (
    FieldSpec("prompt_embeds", "L,D", "embed", "UMT5 embedding trimmed to its true length L"),
    FieldSpec("noise", "C,F,H,W", "latent", "initial latent noise x_T"),
    FieldSpec("timesteps", "S", "float32", "scheduler timestep at each recorded step"),
    FieldSpec("xt", "S,C,F,H,W", "model", "latent x_t fed to the denoiser at each recorded step"),
    FieldSpec("teacher_out", "S,C,F,H,W", "model", "guided teacher output at each recorded step"),
    FieldSpec("final_latent", "C,F,H,W", "latent", "the sampler's final latent x_0"),
)
FIELD_NAMES = tuple(f.name for f in FIELDS)
STEP_FIELDS = ("timesteps", "xt", "teacher_out")
"""Fields with a leading step axis: a training sample reads one row of each."""
OPTIONAL_FIELDS = ("negative_prompt_embeds",)
"""Per-record negative embedding, present only when a prompt brings its own negative prompt."""

DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float64: "float64",
    torch.int64: "int64",
    torch.int32: "int32",
    torch.uint8: "uint8",
}
DTYPES_BY_NAME = {v: k for k, v in DTYPE_NAMES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES[dtype]


def is_step_field(name: str) -> bool:
    return name in STEP_FIELDS or name.startswith(FEATURE_PREFIX)


@dataclass(slots=True)
class Record:
    """One prompt's worth of teacher output: everything a student needs, nothing of the teacher."""

    key: str
    prompt: str
    seed: int
    prompt_embeds: torch.Tensor
    noise: torch.Tensor
    timesteps: torch.Tensor
    xt: torch.Tensor
    teacher_out: torch.Tensor
    final_latent: torch.Tensor
    features: dict[str, torch.Tensor] = field(default_factory=dict)
    negative_prompt_embeds: torch.Tensor | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    """Small JSON-able metadata (e.g. the prompt's own negative prompt, its line number)."""

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {name: getattr(self, name) for name in FIELD_NAMES}
        if self.negative_prompt_embeds is not None:
            out["negative_prompt_embeds"] = self.negative_prompt_embeds
        for name, t in self.features.items():
            out[FEATURE_PREFIX + name] = t
        return {k: v.detach().contiguous().cpu() for k, v in out.items()}

    def meta(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "prompt": self.prompt,
            "seed": self.seed,
            "embed_len": int(self.prompt_embeds.shape[0]),
            "schema_version": SCHEMA_VERSION,
            **({"extra": self.extra} if self.extra else {}),
        }

    @classmethod
    def from_parts(cls, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Record:
        features = {
            k[len(FEATURE_PREFIX) :]: v for k, v in tensors.items() if k.startswith(FEATURE_PREFIX)
        }
        return cls(
            key=meta["key"],
            prompt=meta["prompt"],
            seed=int(meta["seed"]),
            features=features,
            negative_prompt_embeds=tensors.get("negative_prompt_embeds"),
            extra=meta.get("extra", {}),
            **{name: tensors[name] for name in FIELD_NAMES},
        )


def settings_digest(settings: dict[str, Any]) -> str:
    return hashlib.sha256(canonical_json(settings).encode()).hexdigest()


def record_key(prompt: str, seed: int, settings: dict[str, Any]) -> str:
    """Stable across runs, machines and world sizes: the same work always gets the same key.

    32 hex chars, no dots (webdataset splits member names at the first dot).
    """
    payload = canonical_json(
        {"prompt": prompt, "seed": seed, "settings": settings_digest(settings)}
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:32]


def is_holdout(key: str, fraction: float) -> bool:
    """Deterministic held-out split by key hash, so it survives resharding and resume."""
    if fraction <= 0:
        return False
    return int(key[:8], 16) / 0xFFFFFFFF < fraction


def field_specs(
    *,
    latent_dtype: torch.dtype,
    embed_dtype: torch.dtype,
    features: list[str],
    model_dtype: torch.dtype | None = None,
) -> list[dict[str, str]]:
    """The manifest's `fields` list for a cache with these dtypes and feature names."""
    model = dtype_name(model_dtype or latent_dtype)
    kinds = {"latent": dtype_name(latent_dtype), "model": model, "embed": dtype_name(embed_dtype)}
    specs = [
        {"name": f.name, "dtype": kinds.get(f.kind, f.kind), "shape": f.shape, "doc": f.doc}
        for f in FIELDS
    ]
    for name in features:
        specs.append(
            {
                "name": FEATURE_PREFIX + name,
                "dtype": model,
                "shape": "S,*",
                "doc": f"output of teacher block {name} at each recorded step",
            }
        )
    return specs


def pad_embeds(embeds_LD: torch.Tensor, max_len: int) -> torch.Tensor:
    """Re-pad a trimmed embedding with zeros, exactly as WanPipeline's encode_prompt pads."""
    length, dim = embeds_LD.shape
    if length > max_len:
        raise ValueError(f"embedding length {length} exceeds max_sequence_length {max_len}")
    out = embeds_LD.new_zeros((max_len, dim))
    out[:length] = embeds_LD
    return out
