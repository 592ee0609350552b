"""Sharded checkpoints (`train.parallel = "fsdp"`) through torch.distributed.checkpoint (DCP).

Layout of a sharded `checkpoint-<step>/` (the same folder rules as train/checkpoint.py: built in
a hidden temp folder, renamed into place once complete, `latest` rewritten after that):

    shards/shard-<r+1>-model-<i>-of-<n>.safetensors
                         rank r's shard of every tensor: student.*, ema.*, projections.*,
                         optimizer.state.<param index>.<name>, in n files of at
                         most SHARD_FILE_BYTES each (a tensor larger than that alone in its
                         file); the safetensors metadata (DCP_SHARDING_INFO, JSON) gives each
                         chunk's offsets
    optimizer.json       the optimizer state that is not a tensor (as for DDP checkpoints)
    rng.safetensors      every rank's RNG states
    state.json           step, scheduler, reader, meta (parallel = "fsdp", shards = N), and the
                         size and crc32c of every file above, sealed by its sha256

The tensors go through DCP's `HuggingFaceStorageWriter` / `HuggingFaceStorageReader`
(safetensors + JSON): DCP's default FileSystemReader reads a pickled `.metadata` file, which this
project never parses. Both run with `no_dist=True`: each rank plans and writes its own shard, and
on load reads the chunks it needs from every shard by their offsets, so DCP itself runs no
collective (its planning collectives pickle Python objects) and a checkpoint of N ranks loads on
M ranks (resharding). The ranks agree through `runtime.dist` (JSON in tensors): rank 0 picks
the temp folder, every rank writes its shard and reports its file's size and crc32c, and rank 0
seals state.json and publishes only when all have written. A kill -9 anywhere before that
leaves a temp folder that is never read and the previous checkpoint in force.

Why several files per rank: DCP writes each file with `safetensors.torch.save`, which builds the
whole file in memory and holds it twice at its peak (its buffer, then the Python `bytes`; on a
GPU the tensors' CPU copies too). One file per rank made that host RAM the rank's whole shard
(~57 GB per rank for Wan 2.1 14B over 8 ranks); files of at most SHARD_FILE_BYTES bound it, and
the train plan's checkpoint term follows (`placement.train_plan`). DCP's HF writer splits a plan
into files by `fqn_to_index_mapping`; `file_of` packs this rank's tensors into it in order.
Checkpoints written with one file per rank read the same way.
"""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as torch_dcp
from safetensors.torch import save
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.tensor import DTensor

from wandistill.io.fsutil import fsync_dir
from wandistill.placement.train_plan import SHARD_FILE_BYTES
from wandistill.runtime import dist
from wandistill.runtime.dist import DistInfo
from wandistill.runtime.faults import at
from wandistill.train import checkpoint as ckpt_io
from wandistill.train.checkpoint_read import (
    CheckpointError,
    check_file,
    check_state,
    read_tensors,
    unreadable,
)

SHARDS = "shards"
OPT_PREFIX = "optimizer.state."


def file_of(items: list[Any], limit: int) -> dict[str, int]:
    """DCP write items (this rank's plan) -> the 1-based file each goes to: in plan order, a new
    file once the next tensor would take the current one past `limit` bytes (a tensor larger
    than `limit` gets a file of its own)."""
    out: dict[str, int] = {}
    index, used = 1, 0
    for item in items:
        chunk = item.tensor_data
        size = math.prod(chunk.chunk.sizes) * chunk.properties.dtype.itemsize
        if used and used + size > limit:
            index, used = index + 1, 0
        out[item.index.fqn] = index
        used += size
    return out


class _ShardWriter(HuggingFaceStorageWriter):
    """Writes this rank's shard as shard-<rank + 1>-model-<i>-of-<n>, files of at most
    SHARD_FILE_BYTES (module docstring); under no_dist every rank is DCP's coordinator of a
    1-rank plan, so the shard index comes from the real rank."""

    def __init__(self, path: Path, rank: int) -> None:
        super().__init__(str(path), save_distributed=True)
        self._shard_rank = rank  # not `rank`: set_up_storage_writer sets that to DCP's own

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        return [
            dataclasses.replace(
                p,
                storage_data={
                    "shard_index": self._shard_rank + 1,
                    "fqn_to_index_mapping": file_of(p.items, SHARD_FILE_BYTES),
                },
            )
            for p in plans
        ]


def _quiet(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """DCP warns that no_dist saves 'in a single process': that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        return fn(*args, **kwargs)


def flat_tensors(parts: dict[str, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One flat name -> tensor dict of the sharded parts: `<part>.<name>`."""
    return {f"{p}.{k}": v.detach() for p, named in parts.items() for k, v in named.items()}


def save_checkpoint(
    root: Path,
    step: int,
    parts: dict[str, dict[str, torch.Tensor]],
    optimizer: torch.optim.Optimizer,
    rng: dict[str, torch.Tensor],
    state: dict[str, Any],
    info: DistInfo,
    *,
    keep: int,
) -> None:
    """Every rank writes its shard of `parts` and the optimizer state; rank 0 publishes the
    checkpoint once every rank has written (a collective: every rank calls it)."""
    tmp = ckpt_io.start_checkpoint(root, step) if info.is_main else None
    tmp = root / dist.broadcast_json(info, tmp.name if tmp is not None else None)
    # the optimizer's tensors as `optimizer.state.<param index>.<name>` (as DDP numbers them)
    opt_tensors, rest = ckpt_io.flatten_optimizer(optimizer.state_dict())
    tensors = flat_tensors(parts) | {f"optimizer.{k}": v for k, v in opt_tensors.items()}
    if not info.is_main:  # a tensor every rank holds whole (e.g. AdamW's step) is written once
        tensors = {k: v for k, v in tensors.items() if isinstance(v, DTensor)}
    _quiet(
        torch_dcp.save, tensors, storage_writer=_ShardWriter(tmp / SHARDS, info.rank), no_dist=True
    )
    mine = {
        f"{SHARDS}/{f.name}": ckpt_io.file_sum(f)
        for f in (tmp / SHARDS).glob(f"shard-{info.rank + 1:05d}-*")
    }
    at("train", "shard", step, info.rank)  # test-only: a kill between shard and publish
    views = dist.all_gather_json(info, mine)  # every rank has written (and fsynced) its shard
    if not info.is_main:
        return
    sums = {name: s for view in views for name, s in view.items()}
    ckpt_io.write_file(tmp / ckpt_io.OPTIMIZER_JSON, json.dumps(rest).encode(), sums)
    ckpt_io.write_file(tmp / "rng.safetensors", save(ckpt_io.cpu_contiguous(rng)), sums)
    fsync_dir(tmp / SHARDS)
    ckpt_io.seal_and_publish(root, tmp, step, state, sums, keep=keep)


def load_checkpoint(
    path: Path,
    parts: dict[str, dict[str, torch.Tensor]],
    optimizer: torch.optim.Optimizer,
    info: DistInfo,
) -> dict[str, torch.Tensor]:
    """Load a sharded checkpoint into the live `parts` (their tensors, DTensors of this run's
    layout, are filled in place) and `optimizer`, on any number of ranks; return the RNG
    states. Every shard is checked against state.json's size and crc32c first (a collective)."""
    state, _, opt_obj = check_state(path)
    check_shards(path, state, info)
    reader = HuggingFaceStorageReader(str(path / SHARDS))
    saved = reader.read_metadata().state_dict_metadata
    target = flat_tensors(parts)
    _check_fits(path, saved, target)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    opt = _optimizer_targets(path, saved, params)
    _quiet(torch_dcp.load, {**target, **opt}, storage_reader=reader, no_dist=True)
    by_index = {k.removeprefix("optimizer."): v for k, v in opt.items()}  # state.<i>.<name>
    optimizer.load_state_dict(ckpt_io.unflatten_optimizer(by_index, opt_obj))
    return read_tensors(path, "rng.safetensors", state)


def check_shards(path: Path, state: ckpt_io.CheckpointState, info: DistInfo) -> None:
    """The shards are exactly those state.json lists, each with its size and crc32c. The ranks
    split the reading (each shard is read once by the job, not once per rank) and agree: every
    rank raises the same error, none goes on to load."""
    listed = sorted(n for n in (state.files or {}) if n.startswith(f"{SHARDS}/"))
    present = sorted(f"{SHARDS}/{f.name}" for f in (path / SHARDS).iterdir())
    if present != listed:
        extra = sorted(set(present) - set(listed)) or sorted(set(listed) - set(present))
        raise unreadable(
            f"sharded checkpoint {str(path / SHARDS)!r} holds {len(present)} files, state.json "
            f"lists {len(listed)} (e.g. {extra[0]!r})"
        )
    problems = []
    for name in listed[info.rank :: info.world_size]:
        try:
            check_file(path, name, state)
        except CheckpointError as e:
            problems.append(e.message)
    seen = [p for view in dist.all_gather_json(info, problems) for p in view]
    if seen:
        raise unreadable(seen[0])


def _check_fits(path: Path, saved: dict[str, Any], live: dict[str, torch.Tensor]) -> None:
    """The checkpoint holds exactly this run's tensors, each of this run's global shape."""
    names = {k for k in saved if not k.startswith(OPT_PREFIX)}
    where = f"sharded checkpoint {str(path / SHARDS)!r}"
    if any(k.startswith("target.") for k in names):
        raise CheckpointError(f"{where} {ckpt_io.REMOVED_TARGET}", fix=ckpt_io.REMOVED_FIX)
    if names != set(live):
        diff = sorted(names ^ set(live))
        raise unreadable(f"{where} does not fit this student (tensors {diff[:3]})")
    for key, t in live.items():
        if tuple(saved[key].size) != tuple(t.shape):
            raise unreadable(
                f"{where}: {key} is {list(saved[key].size)}, this student has {list(t.shape)}"
            )


def _optimizer_targets(
    path: Path, saved: dict[str, Any], params: list[torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Empty tensors to load the optimizer's saved tensors into: a moment of a parameter gets
    that parameter's layout (a DTensor shard), anything else (a step count) a plain tensor."""
    out: dict[str, torch.Tensor] = {}
    for key, md in saved.items():
        if not key.startswith(OPT_PREFIX):
            continue
        idx_text, _, name = key.removeprefix(OPT_PREFIX).partition(".")
        idx = int(idx_text) if idx_text.isdigit() else -1
        if not 0 <= idx < len(params) or not name:
            raise unreadable(
                f"sharded checkpoint {str(path / SHARDS)!r}: optimizer tensor {key[:80]!r} "
                f"names no parameter of this student ({len(params)} parameters)"
            )
        p = params[idx].detach()
        if tuple(md.size) == tuple(p.shape) and p.dim() > 0:
            out[key] = torch.zeros_like(p, dtype=md.properties.dtype)
        else:
            out[key] = torch.zeros(tuple(md.size), dtype=md.properties.dtype)
    return out
