"""Consistency along the cached tangents: continuous-time consistency distillation from the cache.

A consistency model f(x_sigma, sigma) = x_sigma - sigma * v_student (the x0 estimate; f(x, 0) = x
holds by construction) is constant along the teacher's probability-flow ODE. The ODE's velocity at
a recorded point is the cached guided output (v = dx/dsigma), so the tangent of f along the ODE is

    g = d f(x_sigma, sigma) / d sigma = (df/dx) v_teacher + df/dsigma,

and continuous-time CD (sCM, Lu & Song 2024, "Simplifying, stabilizing and scaling continuous-time
consistency models"; the limit of Song et al. 2023's discrete CD) descends E[f_theta^T g^-] with g^-
evaluated on a stop-gradient copy: written as the regression ||f_theta - sg(f_theta - g_n)||^2,
whose gradient is 2 g_n . df_theta/dtheta. g_n = g / (rms(g) + c) is sCM's tangent normalisation
(c = 0.1) that keeps the step bounded where f changes fast. Only the student is differentiated.

How g is computed: a finite difference along the cached tangent, g ~ (f^-(x, sigma) - f^-(x - delta
* v_teacher, sigma - delta)) / delta, with f^- the current student under no_grad (its value at x is
the training forward's own output, detached: one extra forward per sample). Not torch.func.jvp:
forward-mode AD through the diffusers Wan transformer needs a JVP of scaled-dot-product attention,
which the fused SDPA kernels do not provide (sCM wrote its own JVP flash attention), and it would
bypass DDP/FSDP's forward hooks; the finite difference is two ordinary forwards, works under every
parallel mode and checkpointing, and its O(delta) bias is far below the student's error at the
deltas used (`loss.tangent_delta`, in sigma units; fp32 inputs).
"""

from __future__ import annotations

import torch

TANGENT_NORM_C = 0.1
"""sCM's tangent normalisation constant: g / (||g|| + c)."""


def _col(v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return v.float().view(-1, *([1] * (like.ndim - 1))).to(like.device)


def tangent_step(
    xt: torch.Tensor, velocity: torch.Tensor, sigma: torch.Tensor, delta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, sigma) a step `delta` further down the teacher's ODE from each recorded point, along
    the cached velocity (x - delta * v); the step is cut to sigma itself near the end."""
    step = torch.minimum(sigma.float(), torch.full_like(sigma.float(), float(delta)))
    return xt.float() - _col(step, xt) * velocity.float(), sigma.float() - step


def tangent_target(
    x0_now: torch.Tensor, x0_ahead: torch.Tensor, step: torch.Tensor, c: float = TANGENT_NORM_C
) -> torch.Tensor:
    """sg(f - g_n): the regression target whose MSE gradient is sCM's, from the student's x0 at
    the recorded point (`x0_now`) and a `step` further along the ODE (`x0_ahead`), both without
    gradient. g = (x0_now - x0_ahead) / step is df/dsigma along the ODE (0 where consistent)."""
    now = x0_now.detach().float()
    g = (now - x0_ahead.detach().float()) / _col(step, now).clamp_min(1e-8)
    rms = g.square().flatten(1).mean(1).sqrt()
    return now - g / _col(rms + c, now)
