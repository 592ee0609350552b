"""Build the student and wrap it with what training adds: feature taps and their projections.

`DistillModule` is what DDP wraps and the optimizer trains: the student (a plain
`WanTransformer3DModel`, saved on its own at the end) plus one `nn.Linear` per matched feature,
mapping the student's width to the teacher's. Forward hooks on the chosen student blocks capture
their outputs during the forward pass only (not during gradient-checkpoint recomputation).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from wandistill.errors import UsageError


def build_student(config: dict[str, Any], *, seed: int) -> nn.Module:
    """A randomly initialised WanTransformer3DModel; the same seed gives the same weights."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    return WanTransformer3DModel(**config)


def _key(name: str) -> str:
    return name.replace(".", "__")  # ModuleDict keys cannot hold dots


class DistillModule(nn.Module):
    """Student + feature projections; `forward` returns (prediction, projected features)."""

    def __init__(
        self,
        student: nn.Module,
        feature_map: dict[str, str],
        student_width: int,
        teacher_width: int,
    ) -> None:
        super().__init__()
        self.student = student
        self.feature_map = dict(feature_map)
        """teacher feature name -> student block name."""
        self.projections = nn.ModuleDict(
            {_key(t): nn.Linear(student_width, teacher_width) for t in self.feature_map}
        )
        self._capturing = False
        self._taken: dict[str, torch.Tensor] = {}
        for block in sorted(set(self.feature_map.values())):
            try:
                module = student.get_submodule(block)
            except AttributeError:
                raise UsageError(
                    f"loss.feature_map names student block {block!r}, which the student lacks",
                    fix="use blocks.0 .. blocks.<num_layers - 1>",
                ) from None
            module.register_forward_hook(self._tap(block))

    def _tap(self, name: str) -> Any:
        def hook(_module: nn.Module, _args: Any, output: Any) -> None:
            if self._capturing:
                self._taken[name] = output[0] if isinstance(output, tuple) else output

        return hook

    def forward(
        self,
        xt_BCFHW: torch.Tensor,
        timesteps_B: torch.Tensor,
        prompt_embeds_BLD: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        self._taken = {}
        self._capturing = bool(self.feature_map)
        try:
            (pred,) = self.student(
                hidden_states=xt_BCFHW,
                timestep=timesteps_B,
                encoder_hidden_states=prompt_embeds_BLD,
                return_dict=False,
            )
        finally:
            self._capturing = False
        # fp32 taps: under FSDP bf16 parameters a block's output is bf16 when the hook sees it
        feats = {
            t: self.projections[_key(t)](self._taken[s].float())
            for t, s in self.feature_map.items()
        }
        self._taken = {}
        return pred, feats

    def projection_state(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.state_dict().items() if k.startswith("projections.")}
