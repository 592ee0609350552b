"""The recording sampler: WanPipeline's denoising loop, batched, with (x_t, t, output) taps.

It mirrors `WanPipeline.__call__` line for line where it matters for bits: float32 latents from
`randn_tensor` with one CPU generator per prompt, the folder's scheduler with `set_begin_index(0)`,
the latents cast to the denoiser's dtype, separate cond and uncond forwards combined as
`uncond + g * (cond - uncond)`, and for Wan 2.2 the expert switch at `boundary_ratio * 1000` with
`guidance_scale_2` below it. What it adds: batches of prompts with their own seeds, a state per
batch so a group of batches can run all high-noise steps with one expert resident before the
swap, and recording at chosen step indices (plus block features through forward hooks).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
from diffusers.utils.torch_utils import randn_tensor

from wandistill.cache.contract import Record
from wandistill.checks.finite import check_batch
from wandistill.runtime.progress import beat

CFG_FORMULA = "uncond + g * (cond - uncond)"


@dataclass(slots=True)
class Job:
    """One prompt to sample: identity, seed and its trimmed embeddings."""

    key: str
    prompt: str
    seed: int
    embeds: torch.Tensor
    negative: torch.Tensor
    own_negative: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class SamplerSpec:
    num_inference_steps: int
    guidance_scale: float
    guidance_scale_2: float | None
    boundary_timestep: float | None
    """Wan 2.2: steps with t >= this use `transformer`, the rest `transformer_2`."""
    expand_timesteps: bool
    record_steps: tuple[int, ...]
    features: tuple[str, ...]
    latent_shape: tuple[int, int, int, int]
    """(C, F, H, W) of one latent."""
    max_sequence_length: int

    @property
    def cfg(self) -> bool:
        return self.guidance_scale > 1.0  # as WanPipeline.do_classifier_free_guidance


@dataclass(slots=True)
class BatchState:
    jobs: list[Job]
    latents: torch.Tensor
    noise: torch.Tensor
    scheduler: Any
    timesteps: torch.Tensor
    step: int = 0
    xt: dict[int, torch.Tensor] = field(default_factory=dict)
    out: dict[int, torch.Tensor] = field(default_factory=dict)
    feats: dict[str, dict[int, torch.Tensor]] = field(default_factory=dict)

    @property
    def done(self) -> bool:
        return self.step >= len(self.timesteps)


def _pad_stack(
    embeds: list[torch.Tensor], max_len: int, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """Zero-pad trimmed embeddings to max_len and stack: exactly what encode_prompt returns."""
    out = embeds[0].new_zeros((len(embeds), max_len, embeds[0].shape[1]))
    for i, e in enumerate(embeds):
        out[i, : e.shape[0]] = e
    return out.to(device=device, dtype=dtype)


def _forward(
    model: torch.nn.Module, x: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor
) -> torch.Tensor:
    """One transformer forward (diffusers' Wan call signature) on one text conditioning."""
    return model(hidden_states=x, timestep=timestep, encoder_hidden_states=text, return_dict=False)[
        0
    ]


class _FeatureTap:
    """Forward hooks that keep a block's output from the cond pass of recorded steps only."""

    def __init__(self, model: torch.nn.Module, names: tuple[str, ...]) -> None:
        self.armed = False
        self.taken: dict[str, torch.Tensor] = {}
        self.handles = []
        for name in names:
            try:
                module = model.get_submodule(name)
            except AttributeError:
                raise ValueError(f"feature {name!r} is not a submodule of the teacher") from None
            self.handles.append(module.register_forward_hook(self._hook(name)))

    def _hook(self, name: str):  # noqa: ANN202 - torch hook signature
        def hook(_module: torch.nn.Module, _args: Any, output: Any) -> None:
            if self.armed and name not in self.taken:
                t = output[0] if isinstance(output, tuple) else output
                self.taken[name] = t.detach().to("cpu", copy=True)

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


class RecordingSampler:
    def __init__(self, scheduler: Any, spec: SamplerSpec) -> None:
        self.template = scheduler
        self.spec = spec

    def schedule(self, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """(timesteps, sigmas) of this sampler: cache-level data, written once."""
        sched = copy.deepcopy(self.template)
        sched.set_timesteps(self.spec.num_inference_steps, device=device)
        return sched.timesteps.detach().cpu().float(), sched.sigmas.detach().cpu().float()

    def expert_for(self, t: torch.Tensor) -> str:
        b = self.spec.boundary_timestep
        return "transformer" if b is None or t >= b else "transformer_2"

    def start(self, jobs: list[Job], device: torch.device) -> BatchState:
        shape = (len(jobs), *self.spec.latent_shape)
        gens = [torch.Generator().manual_seed(j.seed) for j in jobs]  # one per prompt
        noise = randn_tensor(shape, generator=gens, device=device, dtype=torch.float32)
        sched = copy.deepcopy(self.template)
        sched.set_timesteps(self.spec.num_inference_steps, device=device)
        sched.set_begin_index(0)
        return BatchState(
            jobs=jobs,
            latents=noise.clone(),
            noise=noise,
            scheduler=sched,
            timesteps=sched.timesteps,
        )

    @torch.no_grad()
    def advance(
        self, state: BatchState, model: torch.nn.Module, expert: str, device: torch.device
    ) -> None:
        """Run every remaining step of `state` that belongs to `expert`, then stop."""
        spec = self.spec
        dtype = model.dtype
        cond = _pad_stack([j.embeds for j in state.jobs], spec.max_sequence_length, device, dtype)
        uncond = None
        if spec.cfg:
            negative = [j.negative for j in state.jobs]
            uncond = _pad_stack(negative, spec.max_sequence_length, device, dtype)
        tap = _FeatureTap(model, spec.features) if spec.features else None
        # transformer_2 guides with guidance_scale_2 where one is set
        g = (expert != "transformer" and spec.guidance_scale_2) or spec.guidance_scale
        try:
            while not state.done and self.expert_for(state.timesteps[state.step]) == expert:
                self._step(state, model, cond, uncond, g, dtype, tap)
        finally:
            if tap is not None:
                tap.remove()

    def _step(
        self,
        state: BatchState,
        model: torch.nn.Module,
        cond: torch.Tensor,
        uncond: torch.Tensor | None,
        g: float,
        dtype: torch.dtype,
        tap: _FeatureTap | None,
    ) -> None:
        i, t = state.step, state.timesteps[state.step]
        latents = state.latents
        model_input = latents.to(dtype)
        if self.spec.expand_timesteps:
            mask = torch.ones(latents.shape, dtype=torch.float32, device=latents.device)
            timestep = (
                (mask[0][0][:, ::2, ::2] * t).flatten().unsqueeze(0).expand(latents.shape[0], -1)
            )
        else:
            timestep = t.expand(latents.shape[0])
        record = i in self.spec.record_steps
        if tap is not None:
            tap.armed, tap.taken = record, {}
        pred = _forward(model, model_input, timestep, cond)
        if tap is not None:
            tap.armed = False
        if uncond is not None:
            pred_uncond = _forward(model, model_input, timestep, uncond)
            pred = pred_uncond + g * (pred - pred_uncond)
        who = [(j.key, j.prompt, j.extra.get("line", "?")) for j in state.jobs]
        check_batch(f"x_t in {dtype}", model_input, who, step=i, timestep=float(t))
        check_batch("the teacher output", pred, who, step=i, timestep=float(t))
        if record:
            state.xt[i] = model_input.detach().to("cpu", copy=True)
            state.out[i] = pred.detach().to("cpu", copy=True)
            if tap is not None:
                for name, feat in tap.taken.items():
                    check_batch(f"teacher feature {name!r}", feat, who, step=i)
                    state.feats.setdefault(name, {})[i] = feat
        state.latents = state.scheduler.step(pred, t, latents, return_dict=False)[0]
        last = i == len(state.timesteps) - 1
        what = "the final latent" if last else "the latent x_t after the scheduler step"
        check_batch(what, state.latents, who, step=i, timestep=float(t))
        state.step += 1
        beat()  # a rank waiting for this one can tell slow from stuck (wandistill.runtime.dist)

    def finish(self, state: BatchState) -> list[Record]:
        """Split a finished batch into one Record per prompt."""
        steps = list(self.spec.record_steps)
        xt = torch.stack([state.xt[s] for s in steps], dim=1)
        out = torch.stack([state.out[s] for s in steps], dim=1)
        ts = torch.stack([state.timesteps[s].detach().cpu().float() for s in steps])
        feats = {n: torch.stack([v[s] for s in steps], dim=1) for n, v in state.feats.items()}
        final = state.latents.detach().cpu()
        noise = state.noise.detach().cpu()
        return [
            Record(
                key=job.key,
                prompt=job.prompt,
                seed=job.seed,
                prompt_embeds=job.embeds,
                noise=noise[b].clone(),
                timesteps=ts.clone(),
                xt=xt[b].clone(),
                teacher_out=out[b].clone(),
                final_latent=final[b].clone(),
                features={n: f[b].clone() for n, f in feats.items()},
                negative_prompt_embeds=job.negative if job.own_negative else None,
                extra=job.extra,
            )
            for b, job in enumerate(state.jobs)
        ]
