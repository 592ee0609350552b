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
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save

from wandistill.errors import WandistillError
from wandistill.fsutil import atomic_write_bytes, fsync_dir, make_temp_dir, publish

PREFIX = "checkpoint-"
LATEST = "latest"
STATE = "state.json"


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


def _write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _contiguous(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().contiguous() for k, v in tensors.items()}


def save_checkpoint(root: Path, ckpt: Checkpoint, *, keep: int) -> Path:
    """Write `ckpt` as checkpoint-<step>/ under `root`, point `latest` at it, prune to `keep`."""
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(f".{PREFIX}*.tmp"):  # left by a crash mid-save
        shutil.rmtree(stale, ignore_errors=True)
    name = f"{PREFIX}{ckpt.step}"
    tmp = make_temp_dir(root, name)
    try:
        _write(tmp / "student.safetensors", save(_contiguous(ckpt.student)))
        _write(tmp / "ema.safetensors", save(_contiguous(ckpt.ema)))
        if ckpt.projections:
            _write(tmp / "projections.safetensors", save(_contiguous(ckpt.projections)))
        if ckpt.target:
            _write(tmp / "target.safetensors", save(_contiguous(ckpt.target)))
        opt_tensors, opt_rest = flatten_optimizer(ckpt.optimizer)
        _write(tmp / "optimizer.safetensors", save(opt_tensors))
        _write(tmp / "optimizer.json", json.dumps(opt_rest).encode())
        _write(tmp / "rng.safetensors", save(_contiguous(ckpt.rng)))
        _write(tmp / STATE, (json.dumps(ckpt.state, indent=1) + "\n").encode())
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


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints (those with state.json), oldest first."""
    found = []
    if root.is_dir():
        for p in root.glob(f"{PREFIX}*"):
            suffix = p.name[len(PREFIX) :]
            if suffix.isdigit() and (p / STATE).is_file():
                found.append((int(suffix), p))
    return sorted(found)


def prune(root: Path, keep: int) -> None:
    for _, path in list_checkpoints(root)[:-keep]:
        shutil.rmtree(path, ignore_errors=True)


def resolve_latest(root: Path) -> Path | None:
    """The newest complete checkpoint: what `latest` names, else the highest step."""
    with contextlib.suppress(OSError):
        named = root / (root / LATEST).read_text(encoding="utf-8").strip()
        if named.name.startswith(PREFIX) and (named / STATE).is_file():
            return named
    found = list_checkpoints(root)
    return found[-1][1] if found else None


# --------------------------------------------------------------------------- read


def load_checkpoint(path: Path) -> Checkpoint:
    try:
        state = json.loads((path / STATE).read_text(encoding="utf-8"))
        opt_rest = json.loads((path / "optimizer.json").read_text(encoding="utf-8"))
        proj = path / "projections.safetensors"
        target = path / "target.safetensors"
        return Checkpoint(
            step=int(state["step"]),
            student=load_file(path / "student.safetensors"),
            ema=load_file(path / "ema.safetensors"),
            projections=load_file(proj) if proj.is_file() else {},
            optimizer=unflatten_optimizer(load_file(path / "optimizer.safetensors"), opt_rest),
            rng=load_file(path / "rng.safetensors"),
            state=state,
            target=load_file(target) if target.is_file() else {},
        )
    except (OSError, ValueError, KeyError) as e:
        raise WandistillError(
            f"checkpoint {str(path)!r} is unreadable ({type(e).__name__}: {e})",
            fix="delete it so --resume takes the previous one, or start a new --out",
        ) from None
