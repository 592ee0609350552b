"""The eval grid: one row per held-out prompt, one column per sampler, a header row naming them.

    prompt | noise | teacher@N | teacher@K | student@K | baseline@K | baseline@N

Latents are shown through one fixed mapping (`latent_cell`): frame 0, latent channels 0, 1, 2 as
R, G, B, mapped linearly from [lo, hi] to [0, 255] and clipped, where lo and hi are the minimum
and maximum of teacher@N's channels 0-2 in that row. The scale is shared by every column of the
row (a column that looks washed out or dark really is), and by the three channels (hues are kept).
The tiny trained teacher writes its colours into channels 0-2, so there they read as the picture;
for real Wan latents they are a false-colour view, and `--decode` shows the frames the teacher's
VAE decodes instead (`frames_cell`: up to 4 frames side by side, pixels as decoded).
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

from wandistill.teacher.decode import frames_strip, save_png

CELL = 96
"""Cell height in pixels (latents are upscaled by an integer factor, nearest neighbour)."""
GAP = 6
LABEL_WIDTH = 220
HEADER = 24
FONT_SIZE = 13
WRAP = 30
"""Characters per line of a prompt beside its row."""


def latent_cell(latent_CFHW: torch.Tensor, ref_CFHW: torch.Tensor) -> np.ndarray:
    """Channels 0-2 of frame 0 as RGB on the reference's range (see the module docstring)."""
    ref = ref_CFHW[:3, 0].float()
    lo, hi = float(ref.min()), float(ref.max())
    x = (latent_CFHW[:3, 0].float() - lo) / max(hi - lo, 1e-6)
    return (x.clamp(0, 1).permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)


def frames_cell(frames_FHW3: np.ndarray) -> np.ndarray:
    return np.asarray(frames_strip(frames_FHW3))


def _upscale(img: np.ndarray, height: int) -> Image.Image:
    h, w = img.shape[:2]
    scale = max(1, height // h)
    return Image.fromarray(img).resize((w * scale, h * scale), Image.Resampling.NEAREST)


def _font() -> ImageFont.ImageFont | ImageFont.FreeTypeFont:
    try:
        return ImageFont.load_default(size=FONT_SIZE)
    except TypeError:  # Pillow < 10.1: the fixed bitmap font
        return ImageFont.load_default()


def write_grid(
    path: Path, columns: list[str], prompts: list[str], cells: list[list[np.ndarray]]
) -> None:
    """`cells[row][column]` (uint8 HxWx3) under a header of `columns`, each row's prompt on the
    left; written atomically as PNG."""
    rows = [[_upscale(c, CELL) for c in row] for row in cells]
    widths = [max(row[j].width for row in rows) for j in range(len(columns))]
    heights = [max(c.height for c in row) for row in rows]
    canvas = Image.new(
        "RGB",
        (LABEL_WIDTH + sum(widths) + GAP * len(widths), HEADER + sum(heights) + GAP * len(rows)),
        "white",
    )
    draw, font = ImageDraw.Draw(canvas), _font()
    x = LABEL_WIDTH
    draw.text((GAP, 4), "prompt", fill="black", font=font)
    for name, w in zip(columns, widths, strict=True):
        draw.text((x + w // 2, 4), name, fill="black", font=font, anchor="ma")
        x += w + GAP
    y = HEADER
    for prompt, row, h in zip(prompts, rows, heights, strict=True):
        text = "\n".join(textwrap.wrap(prompt, WRAP)[: max(1, h // (FONT_SIZE + 4))])
        draw.multiline_text((GAP, y + 2), text, fill="black", font=font)
        x = LABEL_WIDTH
        for cell, w in zip(row, widths, strict=True):
            canvas.paste(cell, (x, y))
            x += w + GAP
        y += h + GAP
    save_png(canvas, path)
