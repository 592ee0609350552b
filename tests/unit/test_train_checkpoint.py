"""Checkpoints: safetensors + JSON only, atomic, `latest` resolution, newest k kept."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load, save

from wandistill.train.checkpoint import (
    Checkpoint,
    flatten_optimizer,
    list_checkpoints,
    resolve_latest,
    save_checkpoint,
    unflatten_optimizer,
)
from wandistill.train.checkpoint_read import CheckpointError, check_state, load_checkpoint
from wandistill.train.optim import build_optimizer, warmup_cosine


def _model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from wandistill.config import OptimConfig

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    return model, build_optimizer(model, OptimConfig(lr=1e-2))


def _steps(model: torch.nn.Module, opt: torch.optim.Optimizer, n: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        model(torch.randn(5, 4, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()


READER = {"epoch": 0, "batches_done": 3, "seed": 0, "world_size": 1, "batch_size": 2}
META = {"student_config": {}, "teacher_fingerprint": None, "world_size": 1, "batch_size": 2}


def _ckpt(step: int, model: torch.nn.Module, opt: torch.optim.Optimizer) -> Checkpoint:
    from wandistill.config import OptimConfig
    from wandistill.train.optim import build_scheduler

    scheduler = build_scheduler(opt, OptimConfig(), 100)
    scheduler.last_epoch = step  # as after `step` optimizer steps
    return Checkpoint(
        step=step,
        student=model.state_dict(),
        ema=model.state_dict(),
        projections={},
        optimizer=opt.state_dict(),
        rng={"rank0.cpu": torch.get_rng_state()},
        state={
            "step": step,
            "scheduler": scheduler.state_dict(),
            "reader": {**READER, "follow": False},
            "meta": {**META, "grad_accum": 1},
        },
    )


def test_optimizer_state_round_trips_through_safetensors_and_json_exactly() -> None:
    model, opt = _model_and_optimizer()
    _steps(model, opt, 3, seed=1)
    tensors, rest = flatten_optimizer(opt.state_dict())
    tensors = load(save(tensors))  # through bytes, as on disk
    twin, twin_opt = _model_and_optimizer()
    twin.load_state_dict(load(save(model.state_dict())))
    twin_opt.load_state_dict(unflatten_optimizer(tensors, json.loads(json.dumps(rest))))
    _steps(model, opt, 2, seed=2)
    _steps(twin, twin_opt, 2, seed=2)
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_checkpoint_is_only_safetensors_and_json_and_loads_back(tmp_path: Path) -> None:
    model, opt = _model_and_optimizer()
    _steps(model, opt, 1, seed=0)
    path = save_checkpoint(tmp_path, _ckpt(4, model, opt), keep=2)
    assert path.name == "checkpoint-4"
    assert {p.suffix for p in path.iterdir()} == {".safetensors", ".json"}
    back = load_checkpoint(path)
    assert back.step == 4 and back.state["reader"] == {**READER, "follow": False}
    assert all(torch.equal(back.student[k], v) for k, v in model.state_dict().items())
    assert back.rng["rank0.cpu"].dtype == torch.uint8


def test_latest_resolves_the_newest_complete_checkpoint_and_old_ones_are_pruned(
    tmp_path: Path,
) -> None:
    model, opt = _model_and_optimizer()
    for step in (2, 4, 6):
        save_checkpoint(tmp_path, _ckpt(step, model, opt), keep=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [4, 6]
    assert resolve_latest(tmp_path) == tmp_path / "checkpoint-6"
    # A crash mid-save leaves a temp folder and maybe a half-made checkpoint: both ignored.
    (tmp_path / ".checkpoint-8.123.tmp").mkdir()
    (tmp_path / "checkpoint-8").mkdir()
    assert resolve_latest(tmp_path) == tmp_path / "checkpoint-6"
    (tmp_path / "latest").write_text("checkpoint-99\n")  # names something that is not there
    assert resolve_latest(tmp_path) == tmp_path / "checkpoint-6"
    save_checkpoint(tmp_path, _ckpt(10, model, opt), keep=2)
    assert not (tmp_path / ".checkpoint-8.123.tmp").exists()
    assert resolve_latest(tmp_path) == tmp_path / "checkpoint-10"


def test_warmup_then_cosine_reaches_the_floor_on_the_last_step() -> None:
    from wandistill.config import OptimConfig

    f = warmup_cosine(OptimConfig(warmup_steps=4, min_lr_ratio=0.1), total_steps=20)
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4) == 1.0 and abs(f(19) - 0.1) < 1e-12
    assert all(f(s) >= f(s + 1) for s in range(4, 19))


def test_a_checkpoint_with_the_removed_consistency_target_is_refused_by_name(
    tmp_path: Path,
) -> None:
    """A run folder from before loss.consistency was removed: its target.safetensors is named
    with the fix (such a run does not resume), not a schema error or a traceback."""

    model, opt = _model_and_optimizer()
    path = save_checkpoint(tmp_path, _ckpt(2, model, opt), keep=1)
    check_state(path)  # a checkpoint of today reads
    (path / "target.safetensors").write_bytes(save(model.state_dict()))
    with pytest.raises(CheckpointError, match="loss.consistency, which was removed") as e:
        check_state(path)
    assert "cannot resume" in e.value.message and "new --out" in (e.value.fix or "")


def test_a_sharded_checkpoint_with_the_removed_consistency_target_is_refused_by_name(
    tmp_path: Path,
) -> None:
    """The FSDP form of the same: target.* tensors among the shards' metadata are named as the
    removed objective's, before the generic "does not fit this student"."""
    from types import SimpleNamespace

    from wandistill.train import dcp

    live = {"student.w": torch.zeros(2, 3)}
    saved = {"student.w": SimpleNamespace(size=(2, 3))}
    dcp._check_fits(tmp_path, saved, live)  # this run's tensors: fits
    saved["target.w"] = SimpleNamespace(size=(2, 3))
    with pytest.raises(CheckpointError, match="loss.consistency, which was removed"):
        dcp._check_fits(tmp_path, saved, live)
