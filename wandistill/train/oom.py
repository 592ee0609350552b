"""Training's out-of-memory advice: the figures and the levers, in the order to try them.

Whether an error is an out-of-memory one is `wandistill.runtime.failures.is_oom` (one rule for both
stages); this module only says what a user of `train` can change. The next lever (FSDP, CPU
offload, checkpointing, LoRA, a smaller batch) is the first alternative of the train memory
plan (`wandistill.placement.train_plan`) that fits this rank's device, named with its figures.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch

from wandistill.cache.files import DimsBlock
from wandistill.config import TrainConfig
from wandistill.errors import WandistillError
from wandistill.placement.devices import GiB
from wandistill.placement.inventory import GPU, Inventory, read_meminfo
from wandistill.placement.train_plan import TrainPlan, choice_of, make_train_plan
from wandistill.placement.train_size import TrainShape
from wandistill.runtime.dist import DistInfo


def _inventory(info: DistInfo) -> Inventory:
    """This rank's machine at its full size (free memory is meaningless right after an OOM)."""
    ram = read_meminfo().get("MemTotal", 0)
    if info.device.type != "cuda":
        return Inventory((), ram, 0, "this machine")
    props = torch.cuda.get_device_properties(info.device)
    gpu = GPU(props.name, props.total_memory, props.total_memory)
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return Inventory((gpu,) * local, ram, 0, f"this machine ({props.name})")


def _lever_line(plan: TrainPlan) -> str:
    """The plan's figures for this run, and its first lever that fits."""
    req = plan.requested
    line = (
        f"the memory plan puts this run at {req.total / GiB:.1f} GiB per rank "
        f"(weights {req.weights / GiB:.1f}, gradients {req.gradients / GiB:.1f}, AdamW "
        f"{req.optimizer / GiB:.1f}, EMA {req.ema / GiB:.1f}, activations "
        f"{req.activations / GiB:.1f})"
    )
    lever = plan.next_lever()
    if lever is None:
        return f"{line}; no lever fits this machine: more GPUs or a smaller student"
    return f"{line}; next lever: {lever.choice.flags(req.choice)} ({lever.why()})"


def oom_error(
    cfg: TrainConfig,
    info: DistInfo,
    num_params: int,
    e: BaseException,
    *,
    student_config: dict[str, Any] | None = None,
    dims: DimsBlock | None = None,
) -> WandistillError:
    """One message with the figures and the levers, in the order to try them: the plan's next
    lever first (with its figures) when the student config and the cache's sizes are known."""
    dev = info.device
    figures = [f"rank {info.rank} on {dev}", f"student {num_params / 1e6:.1f}M params"]
    if dev.type == "cuda":
        total = torch.cuda.get_device_properties(dev).total_memory
        figures += [
            f"peak allocated {torch.cuda.max_memory_allocated(dev) / 2**30:.2f} GiB",
            f"of {total / 2**30:.2f} GiB",
        ]
    figures += [
        f"batch_size={cfg.batch_size}",
        f"grad_accum={cfg.grad_accum}",
        f"gradient_checkpointing={str(cfg.gradient_checkpointing).lower()}",
        f"mixed_precision={cfg.mixed_precision}",
        f"parallel={cfg.parallel}",
    ]
    levers = []
    shape_dims = (dims or DimsBlock()).latent_shape or []
    if student_config is not None and len(shape_dims) == 4:  # else the cache's shape is unknown
        _, f, h, w = (int(v) for v in shape_dims)
        shape = TrainShape(f, h, w, 512, cfg.batch_size)  # the dims block records no text length
        targets = tuple(cfg.student.lora.target_modules)
        with contextlib.suppress(Exception):  # advice must never hide the OOM itself
            plan = make_train_plan(
                student_config,
                choice_of(cfg),
                shape,
                _inventory(info),
                world_size=info.world_size,
                lora_targets=targets,
            )
            levers.append(_lever_line(plan))
    if cfg.batch_size > 1:
        half = max(1, cfg.batch_size // 2)
        levers.append(
            f"--set train.batch_size={half} --set train.grad_accum={cfg.grad_accum * 2} "
            "(same global batch)"
        )
    if not cfg.gradient_checkpointing:
        levers.append("--set train.gradient_checkpointing=true")
    if cfg.mixed_precision != "bf16":
        levers.append('--set train.mixed_precision="bf16"')
    levers.append("a smaller student (train.student.num_layers / ffn_dim)")
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return WandistillError(
        f"out of memory while training ({', '.join(figures)}): {first}",
        fix="; or ".join(levers) + "; then re-run with --resume",
    )
