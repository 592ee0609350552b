"""The cache contract, defined once: field names, dtypes, shapes, record keys, format version.

Writers, readers and the verifier import these definitions; nothing else spells a field name.
Shapes use letters: L tokens (trimmed), D text width, S recorded steps, C latent channels,
F latent frames, H/W latent height/width. Feature tensors are `feature.<name>` with shape S,*.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

from wandistill.checks.validate import canonical_json

if TYPE_CHECKING:
    from wandistill.cache.files import RecordMeta

SCHEMA_VERSION = 3
"""3: a webdataset shard entry lists `frame_sha256` (every byte but the tensor data, which the
per-tensor crc32c cover); the manifest is sealed (`header_sha256`) and records `numerics`. A cache
of another schema (1 and 2 were written by pre-release versions) is refused: rebuild it."""
FORMAT_NAME = "wandistill-cache"
MAX_ROWS = 1 << 40
"""Largest offset, byte count or row index (a petabyte): beyond it a value is an edit."""
MANIFEST_NAME = "manifest.json"
SHARED_NAME = "shared.safetensors"
FEATURE_PREFIX = "feature."
SCALE_PREFIX = "scale."
"""`scale.<field>`: the float32 scale of a field stored as fp8 (one per recorded step for a step
field, one per tensor otherwise; see wandistill/cache/encoding.py)."""


def plain(t: torch.Tensor) -> torch.Tensor:
    """`t` detached, contiguous, on the CPU: `t` itself when it already is, with no torch call
    (the cache writer asks this of every tensor of every record several times; this and one
    byte view per tensor in `wds` cut the writer's time 7-17%, docs/benchmarks.md)."""
    if t.device.type == "cpu" and not t.requires_grad and t.is_contiguous():
        return t
    return t.detach().contiguous().cpu()


def tensor_bytes(t: torch.Tensor) -> np.ndarray:
    """The bytes of a tensor as a flat uint8 numpy view (copied only if not contiguous or not on
    the CPU): what every checksum of tensor data (crc32c, per row or whole) is taken over."""
    t = plain(t)
    return (t.reshape(1) if t.dim() == 0 else t).view(torch.uint8).numpy().reshape(-1)


class FieldTemplate(NamedTuple):
    """A record field as the contract defines it; `field_specs` turns each into the
    manifest's `files.FieldSpec` for a cache's dtypes."""

    name: str
    shape: str
    """Comma-separated shape pattern, e.g. "S,C,F,H,W"."""
    kind: str
    """Which dtype the field carries: "latent" (the sampler's latents, fp32 in WanPipeline),
    "model" (what the denoiser sees and returns: the teacher's dtype), "embed", or a fixed one."""
    doc: str


FIELDS: tuple[FieldTemplate, ...] = (
    FieldTemplate("prompt_embeds", "L,D", "embed", "UMT5 embedding trimmed to its true length L"),
    FieldTemplate("noise", "C,F,H,W", "latent", "initial latent noise x_T"),
    FieldTemplate("timesteps", "S", "float32", "scheduler timestep at each recorded step"),
    FieldTemplate(
        "xt", "S,C,F,H,W", "model", "latent x_t fed to the denoiser at each recorded step"
    ),
    FieldTemplate(
        "teacher_out", "S,C,F,H,W", "model", "guided teacher output at each recorded step"
    ),
    FieldTemplate("final_latent", "C,F,H,W", "latent", "the sampler's final latent x_0"),
)
FIELD_NAMES = tuple(f.name for f in FIELDS)
STEP_FIELDS = ("timesteps", "xt", "teacher_out")
"""Fields with a leading step axis: a training sample reads one row of each."""

ZARR_DATA_NAME = "data.zarr"
"""The zarr backend's one group, relative to the cache directory."""
ZARR_LOCK_NAME = "data.zarr.lock"
"""The row-claim lock of the zarr backend (zarr/store.py), relative to the cache directory."""
ZARR_DTYPE_ATTR = "wandistill_dtype"
"""zarr array attribute naming the dtype of an array stored as another dtype's bits (bf16)."""


@dataclass(frozen=True, slots=True)
class DType:
    """One storable dtype under every name it goes by: the one dtype table of the cache."""

    name: str
    """The cache's name for it (manifest `fields`, zarr attribute)."""
    torch: torch.dtype
    numpy: str
    """The numpy (= zarr) dtype that stores it. bfloat16 and float8_e4m3fn have none: their bits
    go in as uint16 / uint8, and the array carries attribute {ZARR_DTYPE_ATTR: <name>}."""
    safetensors: str
    """Its code in a safetensors header."""

    @property
    def as_bits(self) -> bool:
        """Stored as another dtype's bits (zarr has no such dtype)."""
        return self.numpy != self.name

    @property
    def bits(self) -> torch.dtype:
        """The torch dtype a tensor is viewed as to hand its bits to numpy (`as_bits` only)."""
        return {1: torch.uint8, 2: torch.int16}[self.torch.itemsize]


DTYPES: tuple[DType, ...] = (
    DType("float32", torch.float32, "float32", "F32"),
    DType("float16", torch.float16, "float16", "F16"),
    DType("bfloat16", torch.bfloat16, "uint16", "BF16"),
    DType("float64", torch.float64, "float64", "F64"),
    DType("int64", torch.int64, "int64", "I64"),
    DType("int32", torch.int32, "int32", "I32"),
    DType("uint8", torch.uint8, "uint8", "U8"),
    DType("float8_e4m3fn", torch.float8_e4m3fn, "uint8", "F8_E4M3"),
)
DTYPE_BY_NAME: dict[str, DType] = {d.name: d for d in DTYPES}
DTYPE_NAMES: dict[torch.dtype, str] = {d.torch: d.name for d in DTYPES}
DTYPE_BY_SAFETENSORS: dict[str, DType] = {d.safetensors: d for d in DTYPES}


def dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES[dtype]


def is_step_field(name: str) -> bool:
    """A tensor with a leading step axis (a field's fp8 scale follows its field)."""
    name = name.removeprefix(SCALE_PREFIX)
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
    scales: dict[str, torch.Tensor] = field(default_factory=dict)
    """Field name -> fp8 scale, only in a record as stored (decoded records have none)."""

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {name: getattr(self, name) for name in FIELD_NAMES}
        if self.negative_prompt_embeds is not None:
            out["negative_prompt_embeds"] = self.negative_prompt_embeds
        for name, t in self.features.items():
            out[FEATURE_PREFIX + name] = t
        for name, t in self.scales.items():
            out[SCALE_PREFIX + name] = t
        return {k: plain(v) for k, v in out.items()}

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
    def from_parts(cls, meta: RecordMeta, tensors: dict[str, torch.Tensor]) -> Record:
        def prefixed(p: str) -> dict[str, torch.Tensor]:
            return {k.removeprefix(p): v for k, v in tensors.items() if k.startswith(p)}

        return cls(
            key=meta.key,
            prompt=meta.prompt,
            seed=meta.seed,
            features=prefixed(FEATURE_PREFIX),
            negative_prompt_embeds=tensors.get("negative_prompt_embeds"),
            extra=dict(meta.extra),
            scales=prefixed(SCALE_PREFIX),
            **{name: tensors[name] for name in FIELD_NAMES},
        )


def record_key(prompt: str, seed: int, settings: dict[str, Any]) -> str:
    """Stable across runs, machines and world sizes: the same work always gets the same key.

    32 hex chars, no dots (webdataset splits member names at the first dot).
    """
    digest = hashlib.sha256(canonical_json(settings).encode()).hexdigest()
    payload = canonical_json({"prompt": prompt, "seed": seed, "settings": digest})
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
    length, _ = embeds_LD.shape  # (and a 2-d tensor)
    if length > max_len:
        raise ValueError(f"embedding length {length} exceeds max_sequence_length {max_len}")
    return torch.nn.functional.pad(embeds_LD, (0, 0, 0, max_len - length))
