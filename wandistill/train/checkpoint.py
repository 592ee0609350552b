"""Checkpoints: safetensors + JSON only (no pickle), written atomically, newest k kept.

Layout of `<out>/checkpoints/`:

    checkpoint-<step>/
        student.safetensors      student weights (loads into WanTransformer3DModel as is)
        ema.safetensors          EMA of the student weights
        projections.safetensors  feature projections (only with feature matching)
        optimizer.safetensors    AdamW state tensors, keyed state.<param index>.<name>
        optimizer.json           the rest of the optimizer state (param groups, scalars)
        rng.safetensors          torch RNG states as uint8, rank<r>.cpu / rank<r>.cuda
        state.json               step, LR scheduler, data-reader position, run metadata
    latest                       text: the name of the newest complete checkpoint

A checkpoint is built in a hidden temp folder, every file fsynced, then renamed into place;
`latest` is rewritten atomically after that. A crash leaves either the old or the new checkpoint,
plus perhaps a `.checkpoint-*.tmp` folder that the next save removes. `resolve_latest` trusts
`latest` when it names a complete checkpoint and otherwise takes the highest complete step.

Reading trusts nothing (`train.checkpoint_read`: `check_state`, `load_checkpoint`): state.json
and optimizer.json are checked against their schemas (`CheckpointState`, `OptimizerRest`);
state.json lists every other file with its size and crc32c (`files`) and carries the sha256 of
its own canonical JSON (`sha256`), so a byte changed anywhere is caught; tensor names, dtypes
and finiteness are checked on load, and `check_restorable` matches them against the live model,
optimizer and scheduler.
Each problem is one error naming the file, the field and the fix. Checkpoints written before
the seal (no `files`/`sha256`) are still read, schema-checked but unsealed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import google_crc32c
import torch
from pydantic import Field, JsonValue, model_validator
from safetensors.torch import save

from wandistill.checks.validate import (
    MiB,
    OpenSchema,
    Schema,
    read_capped,
    seal,
)
from wandistill.errors import WandistillError
from wandistill.io.fsutil import atomic_write_bytes, fsync_dir, make_temp_dir, publish, writing

PREFIX = "checkpoint-"
LATEST = "latest"
STATE = "state.json"
OPTIMIZER_JSON = "optimizer.json"
MAX_JSON_BYTES = 64 * MiB
"""Cap on state.json and optimizer.json (a few KB for any real run)."""
FIX = "delete this checkpoint folder so --resume takes the previous one, or start a new --out"
REMOVED_TARGET = (
    "holds the EMA target network of loss.consistency, which was removed (it lost to "
    "loss.perflow and loss.unroll: docs/benchmarks.md), so this run cannot resume"
)
REMOVED_FIX = "start a new run (a new --out) with loss.perflow = 1 or loss.unroll = 1"
_NAME = re.compile(rf"{PREFIX}(\d{{1,15}})")


# --------------------------------------------------------------------------- file schemas

Count = Annotated[int, Field(ge=0, le=1 << 53)]
Lr = Annotated[float, Field(ge=0.0, le=1e6)]


class SchedulerState(OpenSchema):
    """LambdaLR.state_dict(); other keys a torch version adds are matched against the live
    scheduler's own state_dict in `check_restorable` (load_state_dict sets them as attributes)."""

    base_lrs: Annotated[list[Lr], Field(min_length=1, max_length=1024)]
    last_epoch: Annotated[int, Field(ge=-1, le=1 << 53)]
    step_count: Count = Field(alias="_step_count")
    last_lr: Annotated[list[Lr], Field(max_length=1024)] | None = Field(None, alias="_last_lr")
    lr_lambdas: Annotated[list[dict[str, JsonValue] | None], Field(max_length=1024)]


class ReaderState(Schema):
    """TrainingReader.state_dict()."""

    epoch: Count
    batches_done: Count
    seed: Annotated[int, Field(ge=-(1 << 63), le=(1 << 64) - 1)]
    world_size: Annotated[int, Field(ge=1, le=1 << 20)]
    batch_size: Annotated[int, Field(ge=1, le=1 << 30)]
    grad_accum: Annotated[int, Field(ge=1, le=1 << 30)] = 1
    follow: bool
    generations: list[list[Annotated[str, Field(max_length=256)]]] | None = None
    caches: (
        Annotated[list[Annotated[str, Field(max_length=4096)]], Field(max_length=1024)] | None
    ) = None
    """Several caches: their paths (informational) and weights (must match on resume)."""
    weights: Annotated[list[Annotated[float, Field(gt=0)]], Field(max_length=1024)] | None = None


class RunMeta(OpenSchema):
    student_config: dict[str, JsonValue]
    teacher_fingerprint: Annotated[str, Field(max_length=256)] | None
    world_size: Annotated[int, Field(ge=1, le=1 << 20)]
    batch_size: Annotated[int, Field(ge=1, le=1 << 30)]
    grad_accum: Annotated[int, Field(ge=1, le=1 << 30)]


class FileSum(Schema):
    bytes: Count
    crc32c: Annotated[int, Field(ge=0, le=0xFFFFFFFF)]


FileName = (
    Literal[
        "student.safetensors",
        "ema.safetensors",
        "projections.safetensors",
        "optimizer.safetensors",
        "optimizer.json",
        "rng.safetensors",
        "target.safetensors",  # written by the removed loss.consistency: read only to refuse
    ]
    | Annotated[str, Field(pattern=r"^shards/shard-\d{5}-model-\d{5}-of-\d{5}\.safetensors$")]
)
"""A replicated (DDP) checkpoint's files, or one rank's shard of a sharded (FSDP) one."""


class CheckpointState(Schema):
    """state.json."""

    step: Count
    scheduler: SchedulerState
    reader: ReaderState
    meta: RunMeta
    files: dict[FileName, FileSum] | None = None
    sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")] | None = None

    @model_validator(mode="after")
    def _consistent(self) -> CheckpointState:
        if self.scheduler.last_epoch != self.step:
            raise ValueError(
                f"scheduler.last_epoch = {self.scheduler.last_epoch} but step = {self.step} "
                "(the scheduler steps once per optimizer step)"
            )
        if (self.files is None) != (self.sha256 is None):
            raise ValueError("files and sha256 come together (one of them was removed)")
        return self


class ParamGroup(OpenSchema):
    """One AdamW param group; torch's other flags are matched against the live optimizer."""

    lr: Lr
    initial_lr: Lr | None = None
    betas: Annotated[
        list[Annotated[float, Field(ge=0.0, lt=1.0)]], Field(min_length=2, max_length=2)
    ]
    eps: Annotated[float, Field(gt=0.0, le=1.0)]
    weight_decay: Annotated[float, Field(ge=0.0, le=1e3)]
    params: list[Annotated[int, Field(ge=0, le=1 << 30)]]


class OptimizerRest(Schema):
    """optimizer.json: what of optimizer.state_dict() is not a tensor."""

    param_groups: Annotated[list[ParamGroup], Field(min_length=1, max_length=1024)]
    scalars: dict[
        Annotated[str, Field(pattern=r"^\d{1,9}$")],
        dict[Annotated[str, Field(max_length=64)], JsonValue],
    ]


_TENSOR_NAMES = {
    "rng.safetensors": re.compile(r"rank\d{1,7}\.(cpu|cuda)"),
    "optimizer.safetensors": re.compile(r"state\.\d{1,9}\.[A-Za-z_]{1,64}"),
}


@dataclass(slots=True)
class Checkpoint:
    """Everything a checkpoint holds, in memory."""

    step: int
    student: dict[str, torch.Tensor]
    ema: dict[str, torch.Tensor]
    projections: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    rng: dict[str, torch.Tensor]
    state: dict[str, Any]
    """{"step", "scheduler", "reader", "meta"}."""


# --------------------------------------------------------------------------- optimizer state


def flatten_optimizer(sd: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split `optimizer.state_dict()` into safetensors-able tensors and JSON-able rest."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for idx, entry in sd["state"].items():
        for name, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{idx}.{name}"] = value.detach()
            else:
                scalars.setdefault(str(idx), {})[name] = value
    groups = [
        {k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()}
        for g in sd["param_groups"]
    ]
    return tensors, {"param_groups": groups, "scalars": scalars}


def unflatten_optimizer(tensors: dict[str, torch.Tensor], rest: dict[str, Any]) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        _, idx, name = key.split(".", 2)
        state.setdefault(int(idx), {})[name] = value
    for idx, entry in rest.get("scalars", {}).items():
        state.setdefault(int(idx), {}).update(entry)
    groups = [
        {k: (tuple(v) if k == "betas" else v) for k, v in g.items()} for g in rest["param_groups"]
    ]
    return {"state": state, "param_groups": groups}


# --------------------------------------------------------------------------- write


def write_file(path: Path, data: bytes, sums: dict[str, dict[str, int]] | None = None) -> None:
    """Write and fsync one checkpoint file (also train/dcp.py's), its size and crc32c into
    `sums`."""
    with writing(path), open(path, "wb") as f:  # a full disk names this file
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    if sums is not None:
        sums[path.name] = {"bytes": len(data), "crc32c": int(google_crc32c.value(data))}


def file_sum(path: Path) -> dict[str, int]:
    """A file's state.json entry (`FileSum`), streamed: a large student is never held twice."""
    crc, size = 0, 0
    with open(path, "rb") as fh:
        while chunk := fh.read(16 * MiB):
            crc, size = google_crc32c.extend(crc, chunk), size + len(chunk)
    return {"bytes": size, "crc32c": crc}


def cpu_contiguous(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().contiguous() for k, v in tensors.items()}


def save_checkpoint(root: Path, ckpt: Checkpoint, *, keep: int) -> Path:
    """Write `ckpt` as checkpoint-<step>/ under `root`, point `latest` at it, prune to `keep`."""
    tmp = start_checkpoint(root, ckpt.step)
    sums: dict[str, dict[str, int]] = {}
    try:
        write_file(tmp / "student.safetensors", save(cpu_contiguous(ckpt.student)), sums)
        write_file(tmp / "ema.safetensors", save(cpu_contiguous(ckpt.ema)), sums)
        if ckpt.projections:
            write_file(
                tmp / "projections.safetensors", save(cpu_contiguous(ckpt.projections)), sums
            )
        opt_tensors, opt_rest = flatten_optimizer(ckpt.optimizer)
        write_file(tmp / "optimizer.safetensors", save(cpu_contiguous(opt_tensors)), sums)
        write_file(tmp / OPTIMIZER_JSON, json.dumps(opt_rest).encode(), sums)
        write_file(tmp / "rng.safetensors", save(cpu_contiguous(ckpt.rng)), sums)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return seal_and_publish(root, tmp, ckpt.step, ckpt.state, sums, keep=keep)


def start_checkpoint(root: Path, step: int) -> Path:
    """A fresh hidden temp folder for checkpoint `step` (stale ones from a crash removed)."""
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(f".{PREFIX}*.tmp"):  # left by a crash mid-save
        shutil.rmtree(stale, ignore_errors=True)
    return make_temp_dir(root, f"{PREFIX}{step}")


def seal_and_publish(
    root: Path,
    tmp: Path,
    step: int,
    state: dict[str, Any],
    sums: dict[str, dict[str, int]],
    *,
    keep: int,
) -> Path:
    """Write state.json (listing `sums`, the other files' sizes and crc32c, and its own sha256)
    into the finished temp folder `tmp`, rename it to checkpoint-<step>/, point `latest` at it
    and prune to `keep`. Until the rename nothing of it is ever read."""
    name = f"{PREFIX}{step}"
    try:
        state = {k: v for k, v in state.items() if k not in ("files", "sha256")}
        state["files"] = sums
        state["sha256"] = seal(state)
        write_file(tmp / STATE, (json.dumps(state, indent=1) + "\n").encode())
        fsync_dir(tmp)
        final = root / name
        if final.exists():  # re-saving a step (a run extended with a larger --steps)
            shutil.rmtree(final)
        publish(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    atomic_write_bytes(root / LATEST, f"{name}\n".encode())
    for _, old in list_checkpoints(root)[:-keep]:  # prune
        shutil.rmtree(old, ignore_errors=True)
    return final


def step_of(path: Path) -> int | None:
    """The step a checkpoint folder's name says (`checkpoint-<step>`), or None for another name."""
    m = _NAME.fullmatch(path.name)
    return int(m.group(1)) if m else None


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints (those with state.json), oldest first."""
    named = ((step_of(p), p) for p in root.glob(f"{PREFIX}*"))  # none if root is missing
    return sorted((s, p) for s, p in named if s is not None and (p / STATE).is_file())


def resolve_latest(root: Path) -> Path | None:
    """The newest complete checkpoint: what `latest` names, else the highest step.

    `latest` must hold exactly one checkpoint folder name (it is only ever written so); any
    other content is refused rather than followed (it could name a folder elsewhere)."""
    pointer = root / LATEST
    if pointer.is_file():
        raw = read_capped(pointer, max_bytes=256, what="checkpoint pointer", fix=_FIX_LATEST)
        name = raw.decode("utf-8", errors="replace").strip()
        if not _NAME.fullmatch(name):
            raise WandistillError(
                f"checkpoint pointer {str(pointer)!r} holds {name[:60]!r}, not a checkpoint "
                f"folder name ({PREFIX}<step>)",
                fix=_FIX_LATEST,
            )
        if (root / name / STATE).is_file():
            return root / name
    found = list_checkpoints(root)
    return found[-1][1] if found else None


_FIX_LATEST = "delete it: --resume then takes the highest complete checkpoint"
