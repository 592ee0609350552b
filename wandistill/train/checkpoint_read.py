"""Reading a checkpoint back, trusting nothing: state.json and optimizer.json checked against
their schemas and their seal, every file against its size and crc32c, tensor names, dtypes and
finiteness on load, and `check_restorable` matching them against the live model, optimizer and
scheduler. Each problem is one error naming the file, the field and the fix. The layout and the
writing side are `train.checkpoint`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from wandistill.checks.validate import (
    check,
    json_kind,
    parse_json,
    read_capped,
    seal,
)
from wandistill.errors import WandistillError
from wandistill.train.checkpoint import (
    _TENSOR_NAMES,
    FIX,
    MAX_JSON_BYTES,
    OPTIMIZER_JSON,
    REMOVED_FIX,
    REMOVED_TARGET,
    STATE,
    Checkpoint,
    CheckpointState,
    OptimizerRest,
    file_sum,
    step_of,
    unflatten_optimizer,
)


class CheckpointError(WandistillError):
    """An unreadable checkpoint (exit 1); train/dcp.py's sharded checkpoints raise it too."""


def unreadable(message: str) -> CheckpointError:
    return CheckpointError(message, fix=FIX)


def _state_where(path: Path) -> str:
    return f"checkpoint state {str(path / STATE)!r}"


def check_state(path: Path) -> tuple[CheckpointState, dict[str, Any], dict[str, Any]]:
    """state.json and optimizer.json of checkpoint folder `path`, checked: schemas, seal, step
    vs folder name, every listed file present with its size; returns (state, the state as read,
    optimizer.json as read). Cheap (no tensor file is read): train runs it before building
    anything, on every rank."""
    where = _state_where(path)
    data = read_capped(
        path / STATE,
        max_bytes=MAX_JSON_BYTES,
        what="checkpoint state",
        fix=FIX,
        error=CheckpointError,
    )
    obj = parse_json(data, where, fix=FIX, error=CheckpointError)
    state = check(CheckpointState, obj, where, fix=FIX, error=CheckpointError)
    if step_of(path) != state.step:
        raise unreadable(f"{where}: step = {state.step} but the folder is {path.name!r}")
    if state.sha256 is not None:
        body = {k: v for k, v in obj.items() if k != "sha256"}
        if seal(body) != state.sha256:
            raise unreadable(
                f"{where}: its content changed after it was written (sha256 does not match)"
            )
        for name, want in (state.files or {}).items():
            f = path / name
            size = f.stat().st_size if f.is_file() else None
            if size != want.bytes:
                got = "missing" if size is None else f"{size} bytes"
                raise unreadable(
                    f"checkpoint file {str(f)!r} is {got}, state.json says {want.bytes} bytes"
                )
    if "target.safetensors" in (state.files or {}) or (path / "target.safetensors").is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} {REMOVED_TARGET}", fix=REMOVED_FIX)
    where = f"checkpoint file {str(path / OPTIMIZER_JSON)!r}"
    data = read_capped(
        check_file(path, OPTIMIZER_JSON, state),
        max_bytes=MAX_JSON_BYTES,
        what="checkpoint file",
        fix=FIX,
        error=CheckpointError,
    )
    opt_obj = parse_json(data, where, fix=FIX, error=CheckpointError)
    check(OptimizerRest, opt_obj, where, fix=FIX, error=CheckpointError)
    return state, obj, opt_obj


def check_file(path: Path, name: str, state: CheckpointState) -> Path:
    """A checkpoint file, checked against the size and crc32c state.json lists (streamed, so a
    large student is never held twice in memory)."""
    f = path / name
    want = (state.files or {}).get(name)  # type: ignore[call-overload]
    if state.files is not None and want is None:
        raise unreadable(f"checkpoint file {str(f)!r} is not listed in state.json.files")
    if not f.is_file():
        raise unreadable(f"checkpoint file {str(f)!r} is missing")
    if want is not None and file_sum(f) != want.model_dump():
        raise unreadable(
            f"checkpoint file {str(f)!r} fails its crc32c check (changed after it was written)"
        )
    return f


def read_tensors(path: Path, name: str, state: CheckpointState) -> dict[str, torch.Tensor]:
    """One safetensors file of the checkpoint: names, dtypes and finite values checked."""
    where = f"checkpoint file {str(path / name)!r}"
    try:
        tensors = load_file(check_file(path, name, state))
    except WandistillError:
        raise
    except Exception as e:  # safetensors raises its own error types on a bad header
        raise unreadable(f"{where} is not a readable safetensors file ({e})") from None
    pattern = _TENSOR_NAMES.get(name)
    for key, t in tensors.items():
        if pattern is not None and not pattern.fullmatch(key):
            raise unreadable(f"{where}: unexpected tensor {key[:80]!r}")
        if name == "rng.safetensors" and (t.dtype != torch.uint8 or t.dim() != 1):
            raise unreadable(f"{where}: {key} must be a 1-D uint8 RNG state")
        if t.is_floating_point() and not bool(t.isfinite().all()):
            raise unreadable(f"{where}: {key} holds NaN or inf values")
    return tensors


def load_checkpoint(path: Path) -> Checkpoint:
    """Read and check every file of checkpoint folder `path` (see the module docstring)."""
    state, raw, opt_obj = check_state(path)

    def has(name: str) -> bool:
        return (path / name).is_file() if state.files is None else name in state.files

    return Checkpoint(
        step=state.step,
        student=read_tensors(path, "student.safetensors", state),
        ema=read_tensors(path, "ema.safetensors", state),
        projections=read_tensors(path, "projections.safetensors", state)
        if has("projections.safetensors")
        else {},
        optimizer=unflatten_optimizer(read_tensors(path, "optimizer.safetensors", state), opt_obj),
        rng=read_tensors(path, "rng.safetensors", state),
        state=raw,
    )


# --------------------------------------------------------------------------- restore checks


def check_like(saved: Any, live: Any, where: str) -> None:
    """`saved` has the structure of `live` (a fresh object's state_dict): the same keys, and
    values of the same JSON kind, so load_state_dict cannot set an unexpected attribute."""
    if isinstance(live, dict):
        if not isinstance(saved, dict):
            raise unreadable(f"{where} must be a JSON object, not {json_kind(saved)}")
        if set(saved) != set(live):
            extra, gone = sorted(set(saved) - set(live)), sorted(set(live) - set(saved))
            detail = f"unexpected {extra[:3]}" if extra else f"missing {gone[:3]}"
            raise unreadable(f"{where} does not fit this run ({detail})")
        for k in live:
            check_like(saved[k], live[k], f"{where}.{k}")
    elif isinstance(live, list | tuple):
        if not isinstance(saved, list | tuple) or len(saved) != len(live):
            raise unreadable(f"{where} must be a list of {len(live)}, not {json_kind(saved)}")
    elif live is not None and saved is not None and _kind(saved) != _kind(live):
        want = {"bool": "true or false", "number": "a number", "str": "a string"}.get(_kind(live))
        raise unreadable(f"{where} must be {want or _kind(live)}, not {json_kind(saved)}")


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
            raise unreadable(f"{where} does not fit this student (tensors {diff[:3]})")
        for key, t in live.items():
            if saved[key].shape != t.shape or saved[key].dtype != t.dtype:
                raise unreadable(
                    f"{where}: {key} is {saved[key].dtype} {list(saved[key].shape)}, this "
                    f"student has {t.dtype} {list(t.shape)}"
                )
    where = f"checkpoint file {str(path / OPTIMIZER_JSON)!r}"
    live_groups = optimizer.state_dict()["param_groups"]
    groups = ck.optimizer["param_groups"]
    check_like([g["params"] for g in groups], [g["params"] for g in live_groups], where)
    for i, (g, live) in enumerate(zip(groups, live_groups, strict=True)):
        check_like(g, live, f"{where}: param_groups[{i}]")
        for key, value in live.items():  # torch's tri-state flags (foreach, fused: None)
            if value is None and g[key] is not None and not isinstance(g[key], bool):
                raise unreadable(
                    f"{where}: param_groups[{i}].{key} must be true, false or null, not "
                    f"{json_kind(g[key])}"
                )
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for idx, entry in ck.optimizer["state"].items():
        if not 0 <= idx < len(params):
            raise unreadable(f"{where}: state for parameter {idx}, this student has {len(params)}")
        for key, value in entry.items():
            if key.startswith("exp_avg") and value.shape != params[idx].shape:
                raise unreadable(
                    f"checkpoint file {str(path / 'optimizer.safetensors')!r}: state.{idx}."
                    f"{key} is {list(value.shape)}, the parameter is {list(params[idx].shape)}"
                )
    where = f"{_state_where(path)}: scheduler"
    check_like(ck.state["scheduler"], scheduler.state_dict(), where)
    cpu = torch.get_rng_state().numel()
    for key, t in ck.rng.items():
        if key.endswith(".cpu") and t.numel() != cpu:
            raise unreadable(
                f"checkpoint file {str(path / 'rng.safetensors')!r}: {key} holds {t.numel()} "
                f"bytes, a CPU RNG state is {cpu}"
            )
