"""Training's out-of-memory advice: the figures and the levers, in the order to try them.

Whether an error is an out-of-memory one is `wandistill.failures.is_oom` (one rule for both
stages); this module only says what a user of `train` can change.
"""

from __future__ import annotations

import torch

from wandistill.config import TrainConfig
from wandistill.dist import DistInfo
from wandistill.errors import WandistillError


def oom_error(
    cfg: TrainConfig, info: DistInfo, num_params: int, e: BaseException
) -> WandistillError:
    """One message with the figures and the levers, in the order to try them."""
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
    ]
    levers = []
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
