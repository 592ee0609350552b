"""VAE previews: final latents -> PNG, de-normalised exactly as WanPipeline does."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image

from wandistill.io.fsutil import atomic_open


@torch.no_grad()
def decode_latents(vae: torch.nn.Module, latents_BCFHW: torch.Tensor) -> np.ndarray:
    """[B, C, F, H, W] latents -> uint8 frames [B, F, H*8, W*8, 3]."""
    from diffusers.utils.torch_utils import get_module_execution_device

    device = get_module_execution_device(vae)
    cfg = vae.config
    z = latents_BCFHW.to(device=device, dtype=vae.dtype)
    mean = torch.tensor(cfg.latents_mean).view(1, cfg.z_dim, 1, 1, 1).to(z.device, z.dtype)
    inv_std = 1.0 / torch.tensor(cfg.latents_std).view(1, cfg.z_dim, 1, 1, 1).to(z.device, z.dtype)
    video = vae.decode(z / inv_std + mean, return_dict=False)[0]  # [B, 3, F, H, W] in [-1, 1]
    video = (video.float().clamp(-1, 1) + 1) / 2
    return (video.permute(0, 2, 3, 4, 1).cpu().numpy() * 255).round().astype(np.uint8)


def frames_strip(frames_FHW3: np.ndarray, max_frames: int = 4) -> Image.Image:
    """A video as one image: up to `max_frames` evenly spaced frames side by side."""
    n = frames_FHW3.shape[0]
    idx = np.linspace(0, n - 1, num=min(n, max_frames)).round().astype(int)
    return Image.fromarray(np.concatenate([frames_FHW3[i] for i in idx], axis=1))


def save_png(image: Image.Image, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_open(path, "wb") as f:
        image.save(f, format="PNG")


def decode_to_png(vae: torch.nn.Module, latent_CFHW: torch.Tensor, path: Path) -> None:
    frames = decode_latents(vae, latent_CFHW.unsqueeze(0))[0]
    save_png(frames_strip(frames), path)
