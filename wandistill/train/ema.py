"""Exponential moving average of the student's weights (fp32, on the training device)."""

from __future__ import annotations

import torch
from torch import nn


def _trained(model: nn.Module) -> list[nn.Parameter]:
    """The parameters the optimizer trains: all of a full student, a LoRA student's adapters
    (the frozen base never changes, so it needs no average)."""
    return [p for p in model.parameters() if p.requires_grad]


class EMA:
    """`shadow = decay * shadow + (1 - decay) * weights`, after every optimizer step, over the
    trained parameters (`wandistill.student.lora.trainable_parameters`)."""

    def __init__(self, model: nn.Module, decay: float) -> None:
        self.decay = decay
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        self.shadow = [p.detach().float().clone() for p in _trained(model)]

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        current = [p.detach().float() for p in _trained(model)]
        torch._foreach_lerp_(self.shadow, current, 1.0 - self.decay)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(zip(self.names, self.shadow, strict=True))

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        missing = [n for n in self.names if n not in state]
        if missing:
            raise KeyError(f"EMA state lacks {missing[:3]}")
        for name, t in zip(self.names, self.shadow, strict=True):
            t.copy_(state[name])

    @torch.no_grad()
    def copy_to(self, model: nn.Module) -> None:
        """Write the averaged weights into `model` (a copy of the student)."""
        for p, t in zip(_trained(model), self.shadow, strict=True):
            p.copy_(t)
