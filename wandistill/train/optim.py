"""AdamW with decoupled weight decay on matrices only, and a warmup + cosine schedule."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from wandistill.config import OptimConfig


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """Two groups: matrices decayed; biases, norms and 1-row modulation tables not."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        flat = p.ndim < 2 or name.endswith("scale_shift_table")
        (no_decay if flat else decay).append(p)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.betas[0], cfg.betas[1]))


def warmup_cosine(cfg: OptimConfig, total_steps: int) -> Callable[[int], float]:
    """LR multiplier for 0-based step s: linear warmup to 1, then cosine to min_lr_ratio."""
    warmup = cfg.warmup_steps
    floor = cfg.min_lr_ratio

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        span = max(1, total_steps - warmup - 1)
        progress = min(1.0, (step - warmup) / span)
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(cfg, total_steps))
