"""Distillation objectives, computed in fp32 whatever the autocast dtype.

- output: MSE between the student's prediction at a recorded (x_t, t) and the teacher's *guided*
  output there. The student learns the CFG-combined velocity directly, so at inference it runs
  once per step (`guidance_scale=1.0`) instead of twice.
- final_latent: MSE between the student's one-step estimate of the clean latent and the teacher
  sampler's final latent x_0 (same noise, same prompt).
- feature: MSE between projected student block outputs and recorded teacher block outputs.
- unroll: `student.unroll` says what it trains.
- perflow (piecewise reflow): `student.perflow` says what it trains.

trajectory (x0 regression at the student's steps), consistency (against an EMA target at the
cached next point) and reflow (x0 on the noise-to-final-latent line) were removed: each lost to
unroll in every K >= 2 cell of docs/benchmarks.md, and to perflow in all but one.

Each sample is one (record, recorded step); an objective covers only the steps it trains at (a
per-sample mask, from `schedule.ObjectivePlan`). Its contribution to the loss is the sum of its
per-sample MSEs divided by the batch size, so the accumulated gradient does not depend on how a
global batch is cut into micro-batches and ranks; the reported term is the mean over the samples
it covered.

How x0 is derived. Wan's scheduler (UniPC or flow-match Euler, `prediction_type =
"flow_prediction"`) defines x_t = (1 - sigma_t) x_0 + sigma_t * noise and the model predicts
v = noise - x_0, so x_0 = x_t - sigma_t * v (diffusers `UniPCMultistepScheduler
.convert_model_output`: `x0_pred = sample - sigma_t * model_output` with `sigma_t =
self.sigmas[step_index]`). The timestep fed to the model is `int64(sigma_t * 1000)`, truncated,
so t / 1000 is off by up to 1e-3. `SigmaTable` therefore takes sigma_t from the cache's
`shared.safetensors["sigmas"]` at the recorded step indices (`settings.record_steps`), and
falls back to t / num_train_timesteps only for a cache that does not store the schedule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from wandistill.cache.files import SettingsBlock
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
    def from_cache(cls, settings: SettingsBlock, shared: dict[str, torch.Tensor]) -> SigmaTable:
        sigmas = shared.get("sigmas")
        steps = list(settings.record_steps or range(settings.num_inference_steps or 0))
        if sigmas is None or not steps or max(steps) >= sigmas.numel():
            return cls(None)
        return cls(sigmas.float().flatten()[torch.tensor(steps)])

    def __call__(self, step_slot_B: torch.Tensor, timesteps_B: torch.Tensor) -> torch.Tensor:
        if self.by_slot is None:
            return timesteps_B.float() / NUM_TRAIN_TIMESTEPS
        return self.by_slot.to(timesteps_B.device)[step_slot_B.to(timesteps_B.device)]

    def next(
        self,
        step_slot_B: torch.Tensor,
        timesteps_next_B: torch.Tensor,
        next_slots: list[int],
    ) -> torch.Tensor:
        """sigma of each sample's next point (the reader's `xt_next`): `next_slots[slot]`'s
        (perflow's window ends), and 0 past the last slot (the final latent)."""
        if self.by_slot is None:
            return timesteps_next_B.float() / NUM_TRAIN_TIMESTEPS
        dev = timesteps_next_B.device
        padded = torch.cat([self.by_slot, self.by_slot.new_zeros(1)]).to(dev)
        slot = step_slot_B.to(dev)
        ahead = torch.tensor(next_slots, device=dev).clamp_max(padded.numel() - 1)
        return padded[ahead[slot]]


def per_sample_mse(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[B] mean squared error of each sample, in fp32."""
    return (a.float() - b.float()).square().flatten(1).mean(1)


def distill_losses(
    pred: torch.Tensor,
    feats: dict[str, torch.Tensor],
    batch: dict[str, Any],
    weights: LossConfig,
    sigma_B: torch.Tensor | None,
    masks: dict[str, torch.Tensor] | None = None,
    unrolled: torch.Tensor | None = None,
    perflow_v: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Every weighted term (the mean over the samples it covers; absent if it covers none of
    this batch, `output` always when it covers any and the student ran at the recorded x_t:
    `pred` has no rows when only unroll is weighted) and `loss`, the weighted sum of each term's
    per-sample errors over the batch size. `masks`: objective -> [B] bool (default: all).
    `unrolled`: [B, ...] the student's K-step final latent from each
    sample's noise (`student.unroll`; rows outside the unroll mask are ignored). `perflow_v`:
    [B, ...] the straight velocity across each sample's window (`student.perflow`)."""
    batch_size = batch["xt"].shape[0]
    per: dict[str, torch.Tensor] = {}
    pred = pred.float()
    if pred.shape[0]:  # empty when no weighted objective uses the recorded x_t (unroll alone)
        per["output"] = per_sample_mse(pred, batch["teacher_out"])
    if weights.unroll > 0:
        assert unrolled is not None, "unroll needs the student's K-step final latent"
        per["unroll"] = per_sample_mse(unrolled, batch["final_latent"])
    if pred.shape[0] and weights.perflow > 0:
        assert perflow_v is not None, "perflow needs the window velocity"
        per["perflow"] = per_sample_mse(pred, perflow_v)
    if pred.shape[0] and weights.final_latent > 0:
        assert sigma_B is not None, "x0 objectives need sigma_t"
        x0 = flow_x0(batch["xt"].float(), pred, sigma_B)
        per["final_latent"] = per_sample_mse(x0, batch["final_latent"])
    if weights.feature > 0:
        per["feature"] = _feature_error(feats, batch)
    terms: dict[str, torch.Tensor] = {}
    loss = batch["xt"].new_zeros((), dtype=torch.float32)
    for name, err in per.items():
        mask = torch.ones_like(err, dtype=torch.bool) if masks is None else masks[name]
        covered = err[mask]
        if covered.numel():
            terms[name] = covered.mean()
        w = getattr(weights, name)
        if w > 0:
            loss = loss + w * (err * mask).sum() / batch_size
    terms["loss"] = loss
    return terms


def _feature_error(feats: dict[str, torch.Tensor], batch: dict[str, Any]) -> torch.Tensor:
    """[B] mean over matched features of each sample's feature MSE."""
    per = []
    for name, mine in feats.items():
        theirs = batch[f"feature.{name}"]
        if mine.shape != theirs.shape:
            raise CacheError(
                f"feature {name!r}: the cache holds shape {tuple(theirs.shape[1:])} per "
                f"sample, the student's projected block output is {tuple(mine.shape[1:])}",
                fix="match a teacher block output to a student block (same patch size)",
            )
        per.append(per_sample_mse(mine, theirs))
    return torch.stack(per).mean(0)
