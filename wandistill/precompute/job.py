"""Joining the torchrun job for `precompute`, before the teacher's libraries are imported.

The run's identity (what every rank must agree on) and the join, with torch.distributed only.
`entry.launch` (the command line) joins here, then imports the stage (diffusers, transformers,
accelerate, webdataset, zarr: seconds on a busy machine), whose own `dist.init` finds the job
joined; a rank launched by hand whose peer never comes says so within seconds. In-process callers
may call `run.run` directly: it joins itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
from typing import TYPE_CHECKING, Any

from wandistill.config import PrecomputeConfig, to_dict
from wandistill.io import storage
from wandistill.runtime import dist

if TYPE_CHECKING:
    from wandistill.precompute.parts import Part


def for_part(cfg: PrecomputeConfig, part: Part | None) -> PrecomputeConfig:
    """`cfg` writing part `part`'s own cache under `cache.path` (precompute/parts.py)."""
    if part is None:
        return cfg
    path = storage.join(storage.describe(cfg.cache.path), part.dirname)
    return dataclasses.replace(cfg, cache=dataclasses.replace(cfg.cache, path=path))


def join(cfg: PrecomputeConfig) -> dist.DistInfo:
    """This rank in the job (`dist.init`): every rank must run the same config on the same
    prompt file. CPU placements bind ranks to gloo, the rest to the rank's GPU."""
    import torch

    cpu = cfg.teacher.placement.cpu_only or not torch.cuda.is_available()
    return dist.init("cpu" if cpu else "auto", timeout_s=cfg.dist_timeout, config=run_identity(cfg))


def run_identity(cfg: PrecomputeConfig) -> dict[str, Any]:
    """What every rank must agree on: the resolved config and the prompt file's bytes (a
    same-named but different file on another node would split the work inconsistently)."""
    return {"precompute": to_dict(cfg), "prompt_file_sha256": prompt_sha256(cfg.prompts)}


def prompt_sha256(path: str) -> str:
    """The prompt file's sha256 (what ranks, and parts, must agree on)."""
    sha = hashlib.sha256()
    with contextlib.suppress(OSError), open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            sha.update(chunk)
    return sha.hexdigest()
