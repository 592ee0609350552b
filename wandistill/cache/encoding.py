"""The cache footprint a user chooses: the stored dtype of trajectory tensors and compression.

The recipe's `[cache]` options (`store_dtype`, `store_dtypes`, `compression`,
`compression_level`) become per-field entries of the manifest's sealed `fields` list
(`dtype` = as stored, `decoded` = what readers hand out, `scaled`, `compression`), so they are
declared once, refused on resume when changed, and read back by every reader from there.

fp8 (`float8_e4m3fn`) is stored with a float32 scale `scale.<field>`: one per recorded step for
a step field (each step's x_t is its own tensor, and training reads one step), one per tensor
otherwise. The scale maps the tensor's largest magnitude to e4m3's largest finite value (448),
so nothing saturates; decoding is `fp8.float() * scale`. bf16/fp16/fp32 are plain casts.

Readers decode transparently (`RecordCodec.decode`): the student gets the dtype the record had
before it was stored (the teacher's dtype for x_t / teacher output / features, float32 for the
final latent).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from wandistill.cache.choices import FP8, STORE_DTYPES, TRAJECTORY
from wandistill.cache.contract import (
    DTYPE_BY_NAME,
    FEATURE_PREFIX,
    SCALE_PREFIX,
    Record,
    is_step_field,
)
from wandistill.cache.files import FieldSpec, RecordMeta

FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)


def _group(name: str) -> str | None:
    """The recipe key (`TRAJECTORY`) that chooses field `name`'s stored dtype, or None."""
    if name.startswith(FEATURE_PREFIX):
        return "features"
    return name if name in TRAJECTORY else None


@dataclass(frozen=True, slots=True)
class Encoding:
    """The storage options of a cache, as the recipe gives them (checked by CacheConfig)."""

    dtype: str = "model"
    dtypes: tuple[tuple[str, str], ...] = ()
    """Per-field overrides (`TRAJECTORY` key -> recipe dtype name)."""
    compression: str = "none"
    level: int = 3

    def stored(self, name: str) -> str | None:
        """The dtype field `name` is stored in (None: as computed)."""
        group = _group(name)
        if group is None:
            return None
        return STORE_DTYPES[dict(self.dtypes).get(group, self.dtype)]

    def apply(self, specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The manifest's field specs with these options written into them."""
        out = []
        for spec in specs:
            spec = dict(spec)
            stored = self.stored(spec["name"])
            if stored is not None and stored != spec["dtype"]:
                spec["decoded"], spec["dtype"] = spec["dtype"], stored
                if stored == FP8:
                    spec["scaled"] = True
            if self.compression != "none":
                spec["compression"], spec["compression_level"] = self.compression, self.level
            out.append(spec)
        return out


def stored_as(spec: FieldSpec, sep: str = ", ") -> str:
    """How a field is stored, in words: its dtype, what it decodes to, its compression (after
    `sep`: a list of fields joined by ", " passes " ", so each field stays one item)."""
    text = spec.dtype
    if spec.decoded:
        text += f" (of {spec.decoded}{' + scale' if spec.scaled else ''})"
    if spec.compression:
        text += f"{sep}{spec.compression}-{spec.compression_level}"
    return text


def compression_of(fields: Sequence[FieldSpec]) -> tuple[str, int] | None:
    """The (codec, level) the fields declare (one per cache), or None."""
    for spec in fields:
        if spec.compression:
            return spec.compression, spec.compression_level or 3
    return None


def fp8_encode(t: torch.Tensor, *, per_step: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 tensor, float32 scale): per leading-axis row when `per_step`, else one scalar.

    The largest magnitude comes from one `aminmax` of `t` as it is (exact in any float dtype),
    and `t / scale` promotes to float32 as it divides: no float32 copy of `t` and no `abs`
    temporary before the division (the writer thread does this for every trajectory tensor)."""
    x = t.detach()
    rows = per_step and x.dim() >= 1
    if x.numel() == 0:
        amax = x.new_zeros(x.shape[0] if rows else (), dtype=torch.float32)
    else:
        lo, hi = torch.aminmax(x.reshape(x.shape[0], -1), dim=1) if rows else torch.aminmax(x)
        amax = torch.maximum(-lo.float(), hi.float())
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    # `view` has x's rank: a 0-dim float32 divisor would leave a bf16 `x` in bf16.
    view = scale.reshape(-1, *([1] * (x.dim() - 1))) if rows else scale.reshape([1] * x.dim())
    q = (x / view).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def fp8_decode(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`q * scale` in `dtype`; `scale` has one value per leading row of `q`, or one in all."""
    view = scale.reshape(-1, *([1] * (q.dim() - 1))) if scale.dim() and q.dim() else scale
    return (q.float() * view.float()).to(dtype)


class RecordCodec:
    """Encodes records as the manifest's fields say they are stored, and decodes them back."""

    def __init__(self, fields: Sequence[FieldSpec]) -> None:
        self.stored = {f.name: f.dtype for f in fields}
        self.decoded = {f.name: f.decoded for f in fields if f.decoded}
        self.scaled = {f.name for f in fields if f.scaled}

    @property
    def identity(self) -> bool:
        return not self.decoded

    def encode(self, record: Record) -> Record:
        """The record as it is stored (a new Record; tensors are converted, scales added)."""
        if self.identity:
            return record
        tensors = record.tensors()
        out: dict[str, torch.Tensor] = {}
        for name, t in tensors.items():
            want = self.decoded.get(name) and self.stored[name]
            if not want:
                out[name] = t
            elif name in self.scaled:
                out[name], out[SCALE_PREFIX + name] = fp8_encode(t, per_step=is_step_field(name))
            else:
                out[name] = t.to(DTYPE_BY_NAME[want].torch)
        return Record.from_parts(RecordMeta.model_construct(**record.meta()), out)

    def wanted(self, names: list[str]) -> list[str]:
        """The stored tensors to read for these fields (a scaled field brings its scale)."""
        return [*names, *(SCALE_PREFIX + n for n in names if n in self.scaled)]

    def decode(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Stored tensors (scales included) -> the fields as the record had them."""
        if self.identity:
            return tensors
        out: dict[str, torch.Tensor] = {}
        for name, t in tensors.items():
            if name.startswith(SCALE_PREFIX) and name[len(SCALE_PREFIX) :] in self.scaled:
                continue
            dtype = self.decoded.get(name)
            if dtype is None:
                out[name] = t
            elif name in self.scaled:
                scale = tensors.get(SCALE_PREFIX + name)
                if scale is None:
                    raise KeyError(f"{name!r} is stored as fp8 but {SCALE_PREFIX}{name} is missing")
                out[name] = fp8_decode(t, scale, DTYPE_BY_NAME[dtype].torch)
            else:
                out[name] = t.to(DTYPE_BY_NAME[dtype].torch)
        return out

    def decode_record(self, record: Record) -> Record:
        if self.identity:
            return record
        meta = RecordMeta.model_construct(**record.meta())
        return Record.from_parts(meta, self.decode(record.tensors()))
