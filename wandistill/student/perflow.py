"""Piecewise reflow (PeRFlow, Yan et al. 2024) from the cache alone.

The student's K sigmas cut the teacher's ODE into K windows [sigma_k, sigma_(k+1)]. PeRFlow makes
the flow straight inside each window: its start x_k and end x_(k+1) are points of the teacher's
trajectory, here both read from the cache (the recorded x_t at the student's step k and at its
step k + 1, or the final latent after the last window), and the student's velocity at x_k is the
straight one across the window,

    v* = (x_k - x_(k+1)) / (sigma_k - sigma_(k+1)),

so one first-order (Euler / flow-DDIM) step x_k + (sigma_(k+1) - sigma_k) * v* lands exactly on
the teacher's x_(k+1). The K-step sampler visits only window starts, so that is where the student
is trained (PeRFlow's interior points only matter to a sampler that takes more steps than K).

Against x0 regression at the student's steps (the removed `trajectory`, which asked the velocity
at x_k to point at the trajectory's end, one jump to x_0 from every step), perflow asks it to
reach the next window's start, which is what a K-step sampler uses. No teacher forward: the
window ends are cached points (`ObjectivePlan.next_slots` points the reader's next point at
them; precompute records them with `sampler.record_for_student_steps`).
"""

from __future__ import annotations

import torch


def window_velocity(
    x_start: torch.Tensor, x_end: torch.Tensor, sigma_start: torch.Tensor, sigma_end: torch.Tensor
) -> torch.Tensor:
    """The straight velocity across each sample's window: (x_start - x_end) / (sigma_start -
    sigma_end), in fp32 (v = dx/dsigma for Wan's x_t = (1 - sigma) x_0 + sigma * noise)."""
    gap = (sigma_start.float() - sigma_end.float()).view(-1, *([1] * (x_start.ndim - 1)))
    if bool((gap <= 0).any()):
        raise ValueError("a perflow window does not go down in sigma (its end is not after it)")
    return (x_start.float() - x_end.float()) / gap.to(x_start.device)
