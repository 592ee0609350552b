"""Agreement figures between a student's and the teacher's outputs."""

from __future__ import annotations

import math

import numpy as np
import torch


def mse(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.mean((a.float() - b.float()) ** 2))


def psnr(pred: torch.Tensor, ref: torch.Tensor) -> float:
    """PSNR in dB against the reference's own dynamic range (latents have no fixed range)."""
    err = mse(pred, ref)
    rng = float(ref.float().max() - ref.float().min())
    if err == 0:
        return math.inf
    return 10 * math.log10(max(rng, 1e-12) ** 2 / err)


def image_psnr(pred_u8: np.ndarray, ref_u8: np.ndarray) -> float:
    err = float(np.mean((pred_u8.astype(np.float64) - ref_u8.astype(np.float64)) ** 2))
    return math.inf if err == 0 else 10 * math.log10(255.0**2 / err)
