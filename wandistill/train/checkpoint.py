"""Checkpoints: safetensors + JSON only (no pickle), written atomically, newest k kept.

Layout of `<out>/checkpoints/`:

    checkpoint-<step>/
        student.safetensors      student weights (loads into WanTransformer3DModel as is)
        ema.safetensors          EMA of the student weights
        projections.safetensors  feature projections (only with feature matching)
        target.safetensors       consistency target network (only with loss.consistency)
        optimizer.safetensors    AdamW state tensors, keyed state.<param index>.<name>
        optimizer.json           the rest of the optimizer state (param groups, scalars)
        rng.safetensors          torch RNG states as uint8, rank<r>.cpu / rank<r>.cuda
        state.json               step, LR scheduler, data-reader position, run metadata
    latest                       text: the name of the newest complete checkpoint

A checkpoint is built in a hidden temp folder, every file fsynced, then renamed into place;
`latest` is rewritten atomically after that. A crash leaves either the old or the new checkpoint,
plus perhaps a `.checkpoint-*.tmp` folder that the next save removes. `resolve_latest` trusts
`latest` when it names a complete checkpoint and otherwise takes the highest complete step.

Reading trusts nothing (`check_state`, `load_checkpoint`): state.json and optimizer.json are
checked against their schemas (`CheckpointState`, `OptimizerRest`); state.json lists every other
file with its size and crc32c (`files`) and carries the sha256 of its own canonical JSON
(`sha256`), so a byte changed anywhere is caught; tensor names, dtypes and finiteness are checked
on load, and `check_restorable` matches them against the live model, optimizer and scheduler.
Each problem is one error naming the file, the field and the fix. Checkpoints written before
the seal (no `files`/`sha256`) are still read, schema-checked but unsealed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import google_crc32c
import torch
from pydantic import Field, JsonValue, model_validator
from safetensors.torch import load_file, save

from wandistill.checks.validate import (
    MiB,
    OpenSchema,
    Schema,
    check,
    json_kind,
    parse_json,
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
        "target.safetensors",
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
    target: dict[str, torch.Tensor] = field(default_factory=dict)
    """The consistency objective's EMA target network (empty without it)."""


# --------------------------------------------------------------------------- optimizer state


def flatten_optimizer(sd: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split `optimizer.state_dict()` into safetensors-able tensors and JSON-able rest."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for idx, entry in sd["state"].items():
        for name, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{idx}.{name}"] = value.detach().cpu().contiguous()
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


def _write(path: Path, data: bytes, sums: dict[str, dict[str, int]] | None = None) -> None:
    with writing(path), open(path, "wb") as f:  # a full disk names this file
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    if sums is not None:
        sums[path.name] = {"bytes": len(data), "crc32c": int(google_crc32c.value(data))}


def _contiguous(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().contiguous() for k, v in tensors.items()}


def save_checkpoint(root: Path, ckpt: Checkpoint, *, keep: int) -> Path:
    """Write `ckpt` as checkpoint-<step>/ under `root`, point `latest` at it, prune to `keep`."""
    tmp = start_checkpoint(root, ckpt.step)
    sums: dict[str, dict[str, int]] = {}
    try:
        _write(tmp / "student.safetensors", save(_contiguous(ckpt.student)), sums)
        _write(tmp / "ema.safetensors", save(_contiguous(ckpt.ema)), sums)
        if ckpt.projections:
            _write(tmp / "projections.safetensors", save(_contiguous(ckpt.projections)), sums)
        if ckpt.target:
            _write(tmp / "target.safetensors", save(_contiguous(ckpt.target)), sums)
        opt_tensors, opt_rest = flatten_optimizer(ckpt.optimizer)
        _write(tmp / "optimizer.safetensors", save(opt_tensors), sums)
        _write(tmp / OPTIMIZER_JSON, json.dumps(opt_rest).encode(), sums)
        _write(tmp / "rng.safetensors", save(_contiguous(ckpt.rng)), sums)
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
        _write(tmp / STATE, (json.dumps(state, indent=1) + "\n").encode())
        fsync_dir(tmp)
        final = root / name
        if final.exists():  # re-saving a step (a run extended with a larger --steps)
            shutil.rmtree(final)
        publish(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    atomic_write_bytes(root / LATEST, f"{name}\n".encode())
    prune(root, keep)
    return final


def step_of(path: Path) -> int | None:
    """The step a checkpoint folder's name says (`checkpoint-<step>`), or None for another name."""
    m = _NAME.fullmatch(path.name)
    return int(m.group(1)) if m else None


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints (those with state.json), oldest first."""
    found = []
    if root.is_dir():
        for p in root.glob(f"{PREFIX}*"):
            step = step_of(p)
            if step is not None and (p / STATE).is_file():
                found.append((step, p))
    return sorted(found)


def prune(root: Path, keep: int) -> None:
    for _, path in list_checkpoints(root)[:-keep]:
        shutil.rmtree(path, ignore_errors=True)


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


# --------------------------------------------------------------------------- read


class _Error(WandistillError):
    """An unreadable checkpoint (exit 1)."""


def _state_where(path: Path) -> str:
    return f"checkpoint state {str(path / STATE)!r}"


def check_state(path: Path) -> tuple[CheckpointState, dict[str, Any], dict[str, Any]]:
    """state.json and optimizer.json of checkpoint folder `path`, checked: schemas, seal, step
    vs folder name, every listed file present with its size; returns (state, the state as read,
    optimizer.json as read). Cheap (no tensor file is read): train runs it before building
    anything, on every rank."""
    where = _state_where(path)
    data = read_capped(
        path / STATE, max_bytes=MAX_JSON_BYTES, what="checkpoint state", fix=FIX, error=_Error
    )
    obj = parse_json(data, where, fix=FIX, error=_Error)
    state = check(CheckpointState, obj, where, fix=FIX, error=_Error)
    if step_of(path) != state.step:
        raise _Error(f"{where}: step = {state.step} but the folder is {path.name!r}", fix=FIX)
    if state.sha256 is not None:
        body = {k: v for k, v in obj.items() if k != "sha256"}
        if seal(body) != state.sha256:
            raise _Error(
                f"{where}: its content changed after it was written (sha256 does not match)",
                fix=FIX,
            )
        for name, want in (state.files or {}).items():
            f = path / name
            size = f.stat().st_size if f.is_file() else None
            if size != want.bytes:
                got = "missing" if size is None else f"{size} bytes"
                raise _Error(
                    f"checkpoint file {str(f)!r} is {got}, state.json says {want.bytes} bytes",
                    fix=FIX,
                )
    where = f"checkpoint file {str(path / OPTIMIZER_JSON)!r}"
    data = read_capped(
        _check_file(path, OPTIMIZER_JSON, state),
        max_bytes=MAX_JSON_BYTES,
        what="checkpoint file",
        fix=FIX,
        error=_Error,
    )
    opt_obj = parse_json(data, where, fix=FIX, error=_Error)
    check(OptimizerRest, opt_obj, where, fix=FIX, error=_Error)
    return state, obj, opt_obj


def _check_file(path: Path, name: str, state: CheckpointState) -> Path:
    """A checkpoint file, checked against the size and crc32c state.json lists (streamed, so a
    large student is never held twice in memory)."""
    f = path / name
    want = (state.files or {}).get(name)  # type: ignore[call-overload]
    if state.files is not None and want is None:
        raise _Error(f"checkpoint file {str(f)!r} is not listed in state.json.files", fix=FIX)
    if not f.is_file():
        raise _Error(f"checkpoint file {str(f)!r} is missing", fix=FIX)
    if want is not None:
        crc, size = 0, 0
        with open(f, "rb") as fh:
            while chunk := fh.read(16 * MiB):
                crc, size = google_crc32c.extend(crc, chunk), size + len(chunk)
        if (size, crc) != (want.bytes, want.crc32c):
            raise _Error(
                f"checkpoint file {str(f)!r} fails its crc32c check (changed after it was written)",
                fix=FIX,
            )
    return f


def _tensors(path: Path, name: str, state: CheckpointState) -> dict[str, torch.Tensor]:
    """One safetensors file of the checkpoint: names, dtypes and finite values checked."""
    where = f"checkpoint file {str(path / name)!r}"
    try:
        tensors = load_file(_check_file(path, name, state))
    except WandistillError:
        raise
    except Exception as e:  # safetensors raises its own error types on a bad header
        raise _Error(f"{where} is not a readable safetensors file ({e})", fix=FIX) from None
    pattern = _TENSOR_NAMES.get(name)
    for key, t in tensors.items():
        if pattern is not None and not pattern.fullmatch(key):
            raise _Error(f"{where}: unexpected tensor {key[:80]!r}", fix=FIX)
        if name == "rng.safetensors" and (t.dtype != torch.uint8 or t.dim() != 1):
            raise _Error(f"{where}: {key} must be a 1-D uint8 RNG state", fix=FIX)
        if t.is_floating_point() and not bool(t.isfinite().all()):
            raise _Error(f"{where}: {key} holds NaN or inf values", fix=FIX)
    return tensors


def load_checkpoint(path: Path) -> Checkpoint:
    """Read and check every file of checkpoint folder `path` (see the module docstring)."""
    state, raw, opt_obj = check_state(path)

    def has(name: str) -> bool:
        return (path / name).is_file() if state.files is None else name in state.files

    return Checkpoint(
        step=state.step,
        student=_tensors(path, "student.safetensors", state),
        ema=_tensors(path, "ema.safetensors", state),
        projections=_tensors(path, "projections.safetensors", state)
        if has("projections.safetensors")
        else {},
        optimizer=unflatten_optimizer(_tensors(path, "optimizer.safetensors", state), opt_obj),
        rng=_tensors(path, "rng.safetensors", state),
        state=raw,
        target=_tensors(path, "target.safetensors", state) if has("target.safetensors") else {},
    )


# --------------------------------------------------------------------------- restore checks


def check_like(saved: Any, live: Any, where: str) -> None:
    """`saved` has the structure of `live` (a fresh object's state_dict): the same keys, and
    values of the same JSON kind, so load_state_dict cannot set an unexpected attribute."""
    if isinstance(live, dict):
        if not isinstance(saved, dict):
            raise _Error(f"{where} must be a JSON object, not {json_kind(saved)}", fix=FIX)
        if set(saved) != set(live):
            extra, gone = sorted(set(saved) - set(live)), sorted(set(live) - set(saved))
            detail = f"unexpected {extra[:3]}" if extra else f"missing {gone[:3]}"
            raise _Error(f"{where} does not fit this run ({detail})", fix=FIX)
        for k in live:
            check_like(saved[k], live[k], f"{where}.{k}")
    elif isinstance(live, list | tuple):
        if not isinstance(saved, list | tuple) or len(saved) != len(live):
            raise _Error(f"{where} must be a list of {len(live)}, not {json_kind(saved)}", fix=FIX)
    elif live is not None and saved is not None and _kind(saved) != _kind(live):
        want = {"bool": "true or false", "number": "a number", "str": "a string"}.get(_kind(live))
        raise _Error(f"{where} must be {want or _kind(live)}, not {json_kind(saved)}", fix=FIX)


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    return "number" if isinstance(value, int | float) else type(value).__name__


def check_restorable(
    ck: Checkpoint,
    path: Path,
    modules: dict[str, dict[str, torch.Tensor]],
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> None:
    """Everything the checkpoint holds fits the model, optimizer and scheduler of this run
    (load_state_dict would otherwise fail deep inside torch, or not at all: an optimizer
    state of the wrong shape only breaks at the next step)."""
    for name, live in modules.items():
        saved = getattr(ck, name.removesuffix(".safetensors"))
        where = f"checkpoint file {str(path / name)!r}"
        if set(saved) != set(live):
            diff = sorted(set(saved) ^ set(live))
            raise _Error(f"{where} does not fit this student (tensors {diff[:3]})", fix=FIX)
        for key, t in live.items():
            if saved[key].shape != t.shape or saved[key].dtype != t.dtype:
                raise _Error(
                    f"{where}: {key} is {saved[key].dtype} {list(saved[key].shape)}, this "
                    f"student has {t.dtype} {list(t.shape)}",
                    fix=FIX,
                )
    where = f"checkpoint file {str(path / OPTIMIZER_JSON)!r}"
    live_groups = optimizer.state_dict()["param_groups"]
    groups = ck.optimizer["param_groups"]
    check_like([g["params"] for g in groups], [g["params"] for g in live_groups], where)
    for i, (g, live) in enumerate(zip(groups, live_groups, strict=True)):
        check_like(g, live, f"{where}: param_groups[{i}]")
        for key, value in live.items():  # torch's tri-state flags (foreach, fused: None)
            if value is None and g[key] is not None and not isinstance(g[key], bool):
                raise _Error(
                    f"{where}: param_groups[{i}].{key} must be true, false or null, not "
                    f"{json_kind(g[key])}",
                    fix=FIX,
                )
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for idx, entry in ck.optimizer["state"].items():
        if not 0 <= idx < len(params):
            raise _Error(
                f"{where}: state for parameter {idx}, this student has {len(params)}", fix=FIX
            )
        for key, value in entry.items():
            if key.startswith("exp_avg") and value.shape != params[idx].shape:
                raise _Error(
                    f"checkpoint file {str(path / 'optimizer.safetensors')!r}: state.{idx}."
                    f"{key} is {list(value.shape)}, the parameter is {list(params[idx].shape)}",
                    fix=FIX,
                )
    where = f"{_state_where(path)}: scheduler"
    check_like(ck.state["scheduler"], scheduler.state_dict(), where)
    cpu = torch.get_rng_state().numel()
    for key, t in ck.rng.items():
        if key.endswith(".cpu") and t.numel() != cpu:
            raise _Error(
                f"checkpoint file {str(path / 'rng.safetensors')!r}: {key} holds {t.numel()} "
                f"bytes, a CPU RNG state is {cpu}",
                fix=FIX,
            )


# Public names for the sharded (FSDP) checkpoints of train/dcp.py, which share this folder
# contract: the same state.json seal, file sums, error type and RNG file.
CheckpointError = _Error
write_file = _write
check_file = _check_file
read_tensors = _tensors
