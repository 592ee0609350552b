"""Synthetic records with Wan-like structure, for cache tests that need no teacher."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from wandistill.cache import CacheWriter, Record, record_key
from wandistill.cache.contract import field_specs
from wandistill.cache.encoding import Encoding
from wandistill.cache.files import DimsBlock
from wandistill.teacher.tiny import TRANSFORMER_CONFIG

SETTINGS = {"max_sequence_length": 24, "record_steps": [0, 2, 3], "num_inference_steps": 4}
DIMS = {
    "text_dim": 32,
    "latent_channels": 16,
    "latent_shape": [16, 1, 4, 4],
    "num_recorded_steps": 3,
}
DIMS_BLOCK = DimsBlock.model_validate(DIMS)
TEACHER = {
    "fingerprint": "f" * 64,
    "components": {},
    "transformer_config": dict(TRANSFORMER_CONFIG),
}


def make_record(
    i: int,
    *,
    steps: int = 3,
    latent_dtype: torch.dtype = torch.float32,
    embed_dtype: torch.dtype = torch.bfloat16,
    features: tuple[str, ...] = (),
    negative: bool = False,
) -> Record:
    g = torch.Generator().manual_seed(1000 + i)
    length = 3 + (i * 7) % 20  # ragged, 3..22 tokens

    def lat(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(latent_dtype)

    return Record(
        key=record_key(f"prompt {i}", i, SETTINGS),
        prompt=f"prompt {i}",
        seed=i,
        prompt_embeds=torch.randn(length, 32, generator=g).to(embed_dtype),
        noise=lat(16, 1, 4, 4),
        timesteps=torch.tensor([999.0, 500.0, 250.0][:steps]),
        xt=lat(steps, 16, 1, 4, 4),
        teacher_out=lat(steps, 16, 1, 4, 4),
        final_latent=lat(16, 1, 4, 4),
        features={name: lat(steps, 8, 12) for name in features},
        negative_prompt_embeds=(
            torch.randn(4, 32, generator=g).to(embed_dtype) if negative else None
        ),
    )


def write_cache(
    path: Path,
    indices: range | list[int],
    *,
    backend: str = "webdataset",
    shard_records: int = 4,
    rank: int = 0,
    finalize: bool = True,
    complete: bool = True,
    settings: dict | None = None,
    encoding: Encoding | None = None,
    **record_kw: object,
) -> CacheWriter:
    features = list(record_kw.get("features", ()))  # type: ignore[arg-type]
    writer = CacheWriter(
        path,
        backend=backend,
        teacher=TEACHER,
        settings=settings or SETTINGS,
        dims=DIMS,
        fields=(encoding or Encoding()).apply(
            field_specs(
                latent_dtype=record_kw.get("latent_dtype", torch.float32),  # type: ignore[arg-type]
                embed_dtype=record_kw.get("embed_dtype", torch.bfloat16),  # type: ignore[arg-type]
                features=features,
            )
        ),
        shared={"negative_prompt_embeds": torch.zeros(5, 32), "sigmas": torch.linspace(1, 0, 5)},
        rank=rank,
        shard_records=shard_records,
    )
    for i in indices:
        writer.write(make_record(i, **record_kw))  # type: ignore[arg-type]
    writer.close(finalize=finalize, complete=complete)
    return writer


def without_tensor_checksums(monkeypatch: pytest.MonkeyPatch) -> None:
    """Write records as wandistill did before per-tensor checksums: no header metadata."""
    import wandistill.cache.wds.writer as wds

    header = wds.safetensors_header
    monkeypatch.setattr(wds, "safetensors_header", lambda tensors, metadata=None: header(tensors))
