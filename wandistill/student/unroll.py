"""The unroll objective: train the student's own K-step sampler end to end, from the cache alone.

From each record's cached noise the student's first-order K-step sampler runs (x_{k+1} = x_k +
(sigma_{k+1} - sigma_k) * v_student(x_k, t_k): the Euler step, which for flow prediction is also
the deterministic first-order DDIM / UniPC-predictor step), and its final latent is matched to the
record's cached final latent (DiffSynth's "direct distill"). The loss is backpropagated through
all K steps, so each step learns to correct what the steps before it left, which per-point
objectives (perflow) cannot teach. No teacher forward.

Memory: a plain backward through K steps holds K steps' activations. With `loss.unroll_checkpoint`
(default on) each step is an activation checkpoint (torch.utils.checkpoint, non-reentrant): only
the K step inputs are held and one step's activations are rebuilt at a time in backward, for one
extra forward per step. `unroll_memory_problem` refuses a K whose estimate does not fit.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import torch
from torch.utils.checkpoint import checkpoint

from wandistill.placement.train_size import StudentSize, TrainShape, activation_bytes

StepFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""(x [B, C, F, H, W], timesteps [B], embeds [B, L, D]) -> the student's velocity."""


def unroll_final(
    step: StepFn,
    noise: torch.Tensor,
    embeds: torch.Tensor,
    sigmas: Sequence[float],
    timesteps: Sequence[float],
    *,
    checkpointed: bool = True,
) -> torch.Tensor:
    """The student's K-step final latent from `noise`, differentiable through every step.
    `sigmas`: K + 1 values (the student schedule's, ending at 0); `timesteps`: K."""
    if len(sigmas) != len(timesteps) + 1:
        raise ValueError(f"{len(sigmas)} sigmas for {len(timesteps)} steps (want K + 1)")
    x = noise.float()
    for k, t in enumerate(timesteps):
        t_B = torch.full((x.shape[0],), float(t), device=x.device)
        if checkpointed:
            v = checkpoint(step, x, t_B, embeds, use_reentrant=False)
        else:
            v = step(x, t_B, embeds)
        x = x + (float(sigmas[k + 1]) - float(sigmas[k])) * v.float()
    return x


def unroll_bytes(
    k: int, size: StudentSize, shape: TrainShape, *, checkpointed: bool, blocks: bool, bf16: bool
) -> int:
    """Activation memory of one unrolled micro-batch: K steps' activations held for backward, or
    with step checkpoints the K step inputs (fp32 latents) plus one step's rebuilt activations.
    `blocks`: train.gradient_checkpointing (inside each step)."""
    one = activation_bytes(size, shape, bf16=bf16, checkpointing=blocks)
    if not checkpointed:
        return k * one
    latents = shape.batch_size * shape.tokens() * 4 * 4 * 16  # C<=16 channels x 2x2 patch, fp32
    return k * latents + one


def device_memory(device: str) -> int:
    """Bytes the training device has: the GPU's total memory, else the machine's RAM."""
    if device != "cpu" and torch.cuda.is_available():
        index = int(device.split(":")[1]) if ":" in device else 0
        return int(torch.cuda.get_device_properties(index).total_memory)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def unroll_memory_problem(
    k: int,
    size: StudentSize,
    shape: TrainShape,
    available: int,
    *,
    checkpointed: bool,
    blocks: bool,
    bf16: bool,
) -> str | None:
    """One line when the unroll's activations alone would exceed `available`, naming the lever:
    loss.unroll_checkpoint (then train.gradient_checkpointing, then K or the batch)."""
    need = unroll_bytes(k, size, shape, checkpointed=checkpointed, blocks=blocks, bf16=bf16)
    if need <= available:
        return None
    gib = 1 << 30
    head = (
        f"loss.unroll backpropagates through K = {k} student steps: ~{need / gib:.1f} GiB of "
        f"activations at batch {shape.batch_size}, more than the device's {available / gib:.1f} "
        "GiB"
    )
    if not checkpointed:
        fits = unroll_bytes(k, size, shape, checkpointed=True, blocks=blocks, bf16=bf16)
        return (
            f"{head}; set loss.unroll_checkpoint = true (each step an activation checkpoint: "
            f"~{fits / gib:.1f} GiB)"
        )
    lever = "" if blocks else "set train.gradient_checkpointing = true, or "
    return f"{head} even with loss.unroll_checkpoint; {lever}lower K or train.batch_size"
