"""Joining the torchrun job for `precompute`, before the teacher's libraries are imported.

`launch` is what the command line calls: it joins the job (torch.distributed only), then
imports the stage (diffusers, transformers, accelerate, webdataset, zarr: seconds of imports on a
busy machine) and runs `run.run`, whose own `dist.init` finds the job joined. A rank launched by
hand whose peer never comes says so within seconds of starting (`dist._join`'s `waiting:` line),
instead of after the imports. In-process callers may call `run.run` directly: it joins itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
from typing import TYPE_CHECKING, Any

from wandistill.config import PrecomputeConfig, to_dict
from wandistill.io import storage
from wandistill.placement.strategies import Placement
from wandistill.runtime import dist

if TYPE_CHECKING:
    from wandistill.precompute.parts import Part
    from wandistill.precompute.run import Summary


def for_part(cfg: PrecomputeConfig, part: Part | None) -> PrecomputeConfig:
    """`cfg` writing part `part`'s own cache under `cache.path` (precompute/parts.py)."""
    if part is None:
        return cfg
    from wandistill.precompute import parts

    path = parts.part_cache(storage.describe(cfg.cache.path), part)
    return dataclasses.replace(cfg, cache=dataclasses.replace(cfg.cache, path=path))


def join(cfg: PrecomputeConfig) -> dist.DistInfo:
    """This rank in the job (`dist.init`): every rank must run the same config on the same
    prompt file."""
    return dist.init(
        device_kind(cfg.teacher.placement), timeout_s=cfg.dist_timeout, config=run_identity(cfg)
    )


def launch(cfg: PrecomputeConfig, *, part: Part | None = None) -> Summary:
    """Join the job, then import and run the stage (see the module docstring)."""
    info = join(for_part(cfg, part))
    with dist.leaving_on_error(info):
        from wandistill.precompute.run import run

        return run(cfg, part=part)


def device_kind(placement: Placement) -> str:
    """The device torchrun ranks bind to: CPU placements use gloo, the rest the rank's GPU."""
    import torch

    if placement.cpu_only or not torch.cuda.is_available():
        return "cpu"
    return "auto"


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
