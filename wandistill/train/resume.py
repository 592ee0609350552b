"""What a run saves at each checkpoint and restores on --resume: the student, EMA, projections,
optimizer, LR schedule, data-reader position and every rank's RNG, in one flow for both checkpoint
formats (safetensors files under DDP, DCP shards under FSDP); the file formats themselves are
`train.checkpoint` / `train.checkpoint_read` and `train.dcp`.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from wandistill.cache.training import TrainingReader
from wandistill.checks.finite import check_weights
from wandistill.errors import UsageError
from wandistill.runtime import dist
from wandistill.student import lora
from wandistill.student.model import DistillModule
from wandistill.train import checkpoint as ckpt_io
from wandistill.train import checkpoint_read as ckpt_read
from wandistill.train import dcp as sharded
from wandistill.train import parallel
from wandistill.train.ema import EMA
from wandistill.train.inputs import console
from wandistill.train.metrics import truncate_after

if TYPE_CHECKING:
    from wandistill.train.inputs import Plan
    from wandistill.train.loop import Trainer


def restore(
    plan: Plan,
    info: dist.DistInfo,
    meta: dict[str, Any],
    model: DistillModule,
    ema: EMA,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    reader: TrainingReader,
) -> int:
    """Load the newest checkpoint (rank 0 picks it, every rank reads it); return its step.

    One flow for both checkpoint formats: only loading the tensors differs (`_load`: one set of
    safetensors files under DDP, DCP shards under FSDP); the schedule, data position, RNG and
    metrics rows are restored the same way."""
    root = plan.out / "checkpoints"
    latest = ckpt_io.resolve_latest(root)
    name = dist.broadcast_json(info, latest.name if latest else None)
    if name is None:
        if info.is_main:
            truncate_after(plan.out, 0)  # rows of a run killed before its first checkpoint
            console.print(f"train: no checkpoint in {root}, starting at step 0")
        return 0
    step, state, rng = _load(root / name, info, meta, model, ema, optimizer, scheduler)
    scheduler.load_state_dict(state["scheduler"])
    reader.load_state_dict(state["reader"])
    rank = info.rank if f"rank{info.rank}.cpu" in rng else 0  # more ranks now: rank 0's
    torch.set_rng_state(rng[f"rank{rank}.cpu"])
    if info.device.type == "cuda" and f"rank{rank}.cuda" in rng:
        torch.cuda.set_rng_state(rng[f"rank{rank}.cuda"], info.device)
    if info.is_main:
        truncate_after(plan.out, step)
        console.print(f"train: resumed from {root / name} at step {step}")
    return step


def _load(
    path: Path,
    info: dist.DistInfo,
    meta: dict[str, Any],
    model: DistillModule,
    ema: EMA,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> tuple[int, dict[str, Any], dict[str, torch.Tensor]]:
    """The checkpoint's tensors into the live modules; returns its step, its state.json as read
    (scheduler, reader) and this rank's RNG states. A sharded (FSDP) checkpoint on any
    number of ranks (train/dcp.py), or a DDP one (whole tensors in safetensors files)."""
    if meta["parallel"] == "fsdp":
        state, raw, _ = ckpt_read.check_state(path)
        check_same_run(raw.get("meta", {}), meta, path)
        rng = sharded.load_checkpoint(path, checkpoint_parts(model, ema), optimizer, info)
        ckpt_read.check_like(raw["scheduler"], scheduler.state_dict(), f"{path / ckpt_io.STATE}")
        return state.step, raw, rng
    ck = ckpt_read.load_checkpoint(path)
    parts = {
        "student.safetensors": lora.trainable_state_dict(model.student),
        "ema.safetensors": ema.state_dict(),
        "projections.safetensors": model.projection_state(),
    }
    ckpt_read.check_restorable(ck, path, parts, optimizer, scheduler)
    check_same_run(ck.state.get("meta", {}), meta, path)
    lora.load_trainable_state_dict(model.student, ck.student)
    model.projections.load_state_dict(
        {k.removeprefix("projections."): v for k, v in ck.projections.items()}
    )
    ema.load_state_dict(ck.ema)
    optimizer.load_state_dict(ck.optimizer)
    return ck.step, ck.state, ck.rng


def check_same_run(saved: dict[str, Any], meta: dict[str, Any], path: Path) -> None:
    """The checkpoint's student and teacher are this run's."""
    if saved.get("student_config") != meta["student_config"]:
        raise UsageError(
            f"checkpoint {str(path)!r} holds a student with another config",
            fix="resume with the recipe it was trained with, or choose a new --out",
        )
    if saved.get("teacher_fingerprint") != meta["teacher_fingerprint"]:
        raise UsageError(
            f"checkpoint {str(path)!r} was trained on a cache of another teacher",
            fix="resume with the same --cache, or choose a new --out",
        )


def checkpoint_parts(model: DistillModule, ema: EMA) -> dict[str, dict[str, torch.Tensor]]:
    """What a sharded checkpoint holds besides the optimizer, by prefix (live tensors)."""
    return {
        "student": lora.trainable_state_dict(model.student),
        "ema": ema.state_dict(),
        "projections": {
            k.removeprefix("projections."): v for k, v in model.projection_state().items()
        },
    }


def rng_states(info: dist.DistInfo) -> dict[str, torch.Tensor]:
    """Every rank's torch RNG states, gathered to all ranks as uint8 tensors."""
    mine = {"cpu": torch.get_rng_state()}
    if info.device.type == "cuda":
        mine["cuda"] = torch.cuda.get_rng_state(info.device)
    encoded = {k: base64.b64encode(v.numpy().tobytes()).decode() for k, v in mine.items()}
    out: dict[str, torch.Tensor] = {}
    for rank, view in enumerate(dist.all_gather_json(info, encoded)):
        for k, text in view.items():
            raw = bytearray(base64.b64decode(text))
            out[f"rank{rank}.{k}"] = torch.frombuffer(raw, dtype=torch.uint8).clone()
    return out


def save(t: Trainer, step: int) -> None:
    weights = {
        "student": [parallel.local(p) for _, p in lora.trainable_parameters(t.model)],
        "student_ema": [parallel.local(s) for s in t.ema.shadow],
    }
    check_weights(t.info, step, weights)  # never a checkpoint (or final student) of NaN weights
    rng = rng_states(t.info)  # a collective: every rank takes part
    state = {
        "step": step,
        "scheduler": t.scheduler.state_dict(),
        "reader": t.reader.state_dict(),
        "meta": t.meta,
    }
    root, keep = t.plan.out / "checkpoints", t.cfg.keep_checkpoints
    if t.cfg.parallel == "fsdp":  # every rank writes its shard
        state["meta"] = {**t.meta, "shards": t.info.world_size}
        parts = checkpoint_parts(t.model, t.ema)
        sharded.save_checkpoint(root, step, parts, t.optimizer, rng, state, t.info, keep=keep)
    elif t.info.is_main:
        own = (lora.trainable_state_dict(t.model.student), t.ema.state_dict())
        tensors = (*own, t.model.projection_state(), t.optimizer.state_dict(), rng)
        ckpt_io.save_checkpoint(root, ckpt_io.Checkpoint(step, *tensors, state), keep=keep)
