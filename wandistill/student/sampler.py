"""The student's K-step sampler, from cached noise and prompt embeddings (no text encoder, no VAE).

It is diffusers' own `WanPipeline` built from the student, the run's K-step scheduler
(`schedule.StudentSchedule`) and no text encoder or VAE, called with `prompt_embeds=` and
`latents=` and `output_type="latent"`, guidance off (the student learned the guided output). Not a
loop of our own: the exported folder runs the very same `WanPipeline.__call__`, so what eval
measures here is what a user gets from `WanPipeline.from_pretrained(EXPORT)(prompt,
num_inference_steps=K, guidance_scale=1.0)` (a test compares the two on the same noise).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from wandistill.student.experts import pipeline_parts
from wandistill.student.schedule import StudentSchedule

VAE_SPATIAL = 8
VAE_TEMPORAL = 4
"""WanPipeline's defaults without a VAE (every Wan 2.1 / 2.2 A14B VAE has these factors)."""


def student_pipeline(
    student: nn.Module, schedule: StudentSchedule, *, expand_timesteps: bool = False
) -> Any:
    """A WanPipeline of the student alone, no text encoder or VAE: one student for every step,
    or a per-expert pair as transformer / transformer_2 / boundary_ratio (what export writes, so
    WanPipeline's own boundary rule routes the steps)."""
    from diffusers import WanPipeline

    pipe = WanPipeline(
        tokenizer=None,
        text_encoder=None,
        vae=None,
        scheduler=schedule.make_scheduler(),
        expand_timesteps=expand_timesteps,
        **pipeline_parts(student),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


@torch.no_grad()
def sample_latents(
    pipe: Any,
    noise_BCFHW: torch.Tensor,
    embeds_BLD: torch.Tensor,
    num_inference_steps: int,
    *,
    negative_BLD: torch.Tensor | None = None,
    guidance_scale: float = 1.0,
    guidance_scale_2: float | None = None,
) -> torch.Tensor:
    """Final latents of `pipe` from `noise` and zero-padded prompt embeddings (padded to the
    cache's max_sequence_length, as the pipeline pads them), on the pipeline's device.

    A student samples with guidance off (the defaults). eval runs the teacher through the same
    call with the cache's CFG (`negative_BLD`, `guidance_scale`, `guidance_scale_2`)."""
    _, _, frames, height, width = noise_BCFHW.shape
    out = pipe(
        prompt_embeds=embeds_BLD,
        negative_prompt_embeds=negative_BLD,
        latents=noise_BCFHW.float(),
        num_inference_steps=num_inference_steps,
        guidance_scale=guidance_scale,
        guidance_scale_2=guidance_scale_2,  # None: WanPipeline's default
        height=height * VAE_SPATIAL,
        width=width * VAE_SPATIAL,
        num_frames=(frames - 1) * VAE_TEMPORAL + 1,
        max_sequence_length=embeds_BLD.shape[1],
        output_type="latent",
    )
    return out.frames
