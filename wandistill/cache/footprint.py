"""The footprint `cache info` prints: stored bytes per record per field, here and projected.

Kept apart from the codec (`cache/encoding.py`): it opens a cache through the reader, which
itself uses the codec, so living there made encoding -> reader -> encoding a cycle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from wandistill.cache.contract import SCALE_PREFIX
from wandistill.cache.encoding import stored_as
from wandistill.cache.files import ZarrEntry
from wandistill.cache.reader import open_cache

WAN_SIZES: dict[str, tuple[int, int, int, int]] = {
    "480p": (16, 21, 60, 104),
    "720p": (16, 21, 90, 160),
}
"""Latent (C, F, H, W) of real Wan videos: 832x480 and 1280x720, 81 frames (VAE: 4x time,
8x space)."""
WAN_TEXT_DIM = 4096
"""UMT5-XXL's width: the real prompt embedding's D."""
_TEXT = ("prompt_embeds", "negative_prompt_embeds")


def field_bytes(tensors: dict[str, torch.Tensor]) -> dict[str, int]:
    """Bytes of each stored field of one record (an fp8 field's scale counted with it)."""
    out: dict[str, int] = {}
    for name, t in tensors.items():
        field_name = name.removeprefix(SCALE_PREFIX)
        out[field_name] = out.get(field_name, 0) + t.numel() * t.element_size()
    return out


def projected_bytes(
    tensors: dict[str, torch.Tensor], latent: tuple[int, int, int, int], embed_len: float
) -> dict[str, int]:
    """Bytes per field of a record like this one (same dtypes, recorded steps, features) at
    latent size `latent` (C, F, H, W) with the real text width and `embed_len` tokens.

    Latent-sized tensors (noise, x_t, teacher output, final latent, features: their token count
    follows F*H*W) scale with the latent's element count; scales and timesteps do not."""
    have = tensors.get("noise")
    if have is None or have.dim() != 4 or not have.numel():
        raise ValueError("a record without a 4-d noise latent cannot be projected")
    ratio = (latent[0] * latent[1] * latent[2] * latent[3]) / have.numel()
    out: dict[str, int] = {}
    for name, t in tensors.items():
        field_name = name.removeprefix(SCALE_PREFIX)
        size = t.element_size()
        if name.startswith(SCALE_PREFIX) or name == "timesteps":
            n = t.numel() * size
        elif name in _TEXT:  # a per-record negative keeps its own length
            rows = embed_len if name == "prompt_embeds" else t.shape[0]
            n = round(rows * WAN_TEXT_DIM * size)
        else:
            n = round(t.numel() * ratio) * size
        out[field_name] = out.get(field_name, 0) + n
    return out


@dataclass(frozen=True, slots=True)
class Footprint:
    """What `cache info` prints: stored bytes per record per field, here and projected."""

    fields: dict[str, str]
    """Field -> how it is stored (dtype, scale, compression)."""
    here: dict[str, int]
    """Bytes per record per field in this cache (uncompressed)."""
    projected: dict[str, dict[str, int]]
    """Size name (WAN_SIZES) -> bytes per record per field."""
    embed_len: float
    """Mean prompt length (tokens) the projection uses: this cache's first shard's."""
    on_disk: float
    """Bytes per record on disk (after compression, with container overhead)."""


def footprint(path: Any) -> Footprint | None:
    """This cache's footprint from its first record (None: no record yet)."""
    with open_cache(path) as store:
        if not len(store):
            return None
        entry = store.entries[0]
        tensors = store.source.read_record(entry, 0).tensors()  # as stored
        n = min(entry.records, 64)
        if isinstance(entry, ZarrEntry):
            lens = [m.embed_len for m in entry.meta[:n]]
        else:
            lens = [store.source.read_meta(entry, i).embed_len for i in range(n)]
        embed_len = sum(lens) / len(lens)
        return Footprint(
            fields={spec.name: stored_as(spec) for spec in store.manifest.fields},
            here=field_bytes(tensors),
            projected={k: projected_bytes(tensors, v, embed_len) for k, v in WAN_SIZES.items()},
            embed_len=embed_len,
            on_disk=store.manifest.num_bytes / len(store),
        )
