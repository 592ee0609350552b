"""Distillation objectives, computed in fp32 whatever the autocast dtype.

- output: MSE between the student's prediction at a recorded (x_t, t) and the teacher's *guided*
  output there. The student learns the CFG-combined velocity directly, so at inference it runs
  once per step (`guidance_scale=1.0`) instead of twice.
- final_latent: MSE between the student's one-step estimate of the clean latent and the teacher
  sampler's final latent x_0 (same noise, same prompt).
- feature: MSE between projected student block outputs and recorded teacher block outputs.

How x0 is derived. Wan's scheduler (UniPC or flow-match Euler, `prediction_type =
"flow_prediction"`) defines x_t = (1 - sigma_t) x_0 + sigma_t * noise and the model predicts
v = noise - x_0, so x_0 = x_t - sigma_t * v (diffusers `UniPCMultistepScheduler
.convert_model_output`: `x0_pred = sample - sigma_t * model_output` with `sigma_t =
self.sigmas[step_index]`). The timestep fed to the model is `int64(sigma_t * 1000)`, truncated,
so t / 1000 is off by up to 1e-3. `SigmaTable` therefore takes sigma_t from the cache's
`shared.safetensors["sigmas"]` at the recorded step indices (`settings["record_steps"]`), and
falls back to t / num_train_timesteps only for a cache that does not store the schedule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from wandistill.config import LossConfig
from wandistill.errors import CacheError

NUM_TRAIN_TIMESTEPS = 1000


def flow_x0(xt: torch.Tensor, v: torch.Tensor, sigma_B: torch.Tensor) -> torch.Tensor:
    """Clean-latent estimate of a flow-matching prediction: x0 = x_t - sigma_t * v."""
    return xt - sigma_B.view(-1, *([1] * (xt.ndim - 1))).to(xt) * v


@dataclass(frozen=True, slots=True)
class SigmaTable:
    """sigma_t of each recorded step slot (exact), or None to use t / 1000 (approximate)."""

    by_slot: torch.Tensor | None

    @classmethod
    def from_cache(cls, settings: dict[str, Any], shared: dict[str, torch.Tensor]) -> SigmaTable:
        sigmas = shared.get("sigmas")
        steps = list(settings.get("record_steps") or [])
        if not steps:
            steps = list(range(int(settings.get("num_inference_steps", 0))))
        if sigmas is None or not steps or max(steps) >= sigmas.numel():
            return cls(None)
        return cls(sigmas.float().flatten()[torch.tensor(steps)])

    def __call__(self, step_slot_B: torch.Tensor, timesteps_B: torch.Tensor) -> torch.Tensor:
        if self.by_slot is None:
            return timesteps_B.float() / NUM_TRAIN_TIMESTEPS
        return self.by_slot.to(timesteps_B.device)[step_slot_B.to(timesteps_B.device)]


def distill_losses(
    pred: torch.Tensor,
    feats: dict[str, torch.Tensor],
    batch: dict[str, Any],
    weights: LossConfig,
    sigma_B: torch.Tensor | None,
) -> dict[str, torch.Tensor]:
    """Each term (always `output`, the others when weighted) and their weighted sum `loss`."""
    pred = pred.float()
    terms: dict[str, torch.Tensor] = {"output": F.mse_loss(pred, batch["teacher_out"].float())}
    if weights.final_latent > 0:
        assert sigma_B is not None, "final-latent matching needs sigma_t"
        x0 = flow_x0(batch["xt"].float(), pred, sigma_B)
        terms["final_latent"] = F.mse_loss(x0, batch["final_latent"].float())
    if weights.feature > 0:
        per = []
        for name, mine in feats.items():
            theirs = batch[f"feature.{name}"].float()
            if mine.shape != theirs.shape:
                raise CacheError(
                    f"feature {name!r}: the cache holds shape {tuple(theirs.shape[1:])} per "
                    f"sample, the student's projected block output is {tuple(mine.shape[1:])}",
                    fix="match a teacher block output to a student block (same patch size)",
                )
            per.append(F.mse_loss(mine.float(), theirs))
        terms["feature"] = torch.stack(per).mean()
    loss = weights.output * terms["output"]
    if "final_latent" in terms:
        loss = loss + weights.final_latent * terms["final_latent"]
    if "feature" in terms:
        loss = loss + weights.feature * terms["feature"]
    terms["loss"] = loss
    return terms
