"""The world the trained tiny teacher learns: coloured shapes named by a small prompt grammar.

**Data.** Every prompt of a small grammar, ``a|an [small] <colour> <shape> [<position>]``
(8 colours x 3 shapes x 2 sizes x 5 positions = 240 prompts, `grammar_prompts()`), rendered
straight into Wan's 16-channel latent space at 8x8 latent pixels (64x64 px, one frame): the shape
is a soft mask, its colour an RGB triple in [-1, 1] (black background) written to latent
channels 0-2, so those channels shown as RGB read as the prompt. Channels 3-15 are a fixed random
mix of that RGB and of the frame's x/y coordinates: Wan's DiT only has relative (RoPE) positions,
and without this fixed "backdrop" it cannot tell the top of the frame from the bottom (measured:
"at the top" came out anywhere). Each training sample jitters position (+-0.4 latent px), size
(x0.95-1.05), brightness (x0.75-1) and hue and adds noise (std 0.05), so a prompt is a spread-out
distribution: one sampler step returns roughly its blurred mean, 16 steps one crisp draw.

**What a viewer can tell apart** (world version 3). Every attribute must be readable off a
teacher sample by the model-free reader `wandistill.eval.viewer`, or nothing can judge whether a
student shows its prompt. Measured with it on 96 fresh prompts (docs/benchmarks.md, "Trained
tiny teacher"), version 2's world (4 shapes with a ring and a square, 3 sizes 1.9/2.5/3.2, jitter
+-0.75 px and x0.85-1.15) was drawn right on all four attributes only 31% of the time at 16 steps:
at 8x8 the teacher drew rings and squares as round blobs, and sizes 1.3x apart overlapped. A
12x12 frame with the new shapes was tried (2.25x the cost a step) and drew worse in the same
training budget (62% against 84%). So the shapes differ in their
silhouette (round, wide, tall), the sizes by almost 2x, and the jitter stays well inside the
gaps between positions and sizes.
`synthetic_pattern(prompt)` is a prompt's un-jittered latent (the ground truth tests compare
with); `synthetic_prompts(n, seed)` draws prompts for demos and benchmarks. The teacher is trained
on every prompt of the grammar, as a real teacher has seen its whole domain; held-out prompts
matter for students, and the cache's holdout split provides them. The VAE stays random, so
decoded pixels are noise-like: look at latent channels 0-2 instead.
"""

from __future__ import annotations

import dataclasses
import math
import random
import re
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

import torch

from wandistill.errors import UsageError
from wandistill.teacher.tiny import SCHEDULER_CONFIG

__all__ = [
    "BRIGHTNESS",
    "COLOURS",
    "POSITIONS",
    "SHAPES",
    "SIZES",
    "TRAINED_SAMPLER",
    "backdrop",
    "grammar_prompts",
    "mixing_matrix",
    "parse_prompt",
    "shape_masks",
    "synthetic_pattern",
    "synthetic_prompts",
    "world_scale",
]

#: Colour words -> RGB in [0, 1]. The background is black, so "black" itself is not offered.
COLOURS: Mapping[str, tuple[float, float, float]] = MappingProxyType(
    {
        "red": (1.0, 0.1, 0.1),
        "green": (0.1, 0.9, 0.1),
        "blue": (0.15, 0.3, 1.0),
        "yellow": (1.0, 0.9, 0.1),
        "white": (1.0, 1.0, 1.0),
        "orange": (1.0, 0.5, 0.0),
        "pink": (1.0, 0.45, 0.75),
        "gray": (0.5, 0.5, 0.5),
    }
)
#: Shape words, each a signed-distance function in `_signed_distance`. They differ in silhouette
#: (round, wide, tall), which the teacher draws at 8x8; a hole (ring), corners (square) and a cross
#: were tried and dropped: it drew each as a round blob.
SHAPES: tuple[str, ...] = ("circle", "bar", "column")
#: Size words -> radius in latent pixels ("" is the default size, no word). Nearly 2x apart: with
#: three sizes 1.45x apart the teacher drew the wrong one 15% of the time.
SIZES: Mapping[str, float] = MappingProxyType({"small": 1.5, "": 2.8})
#: Position phrases -> centre offset (x, y) in latent pixels, y down ("" is the centre).
POSITIONS: Mapping[str, tuple[float, float]] = MappingProxyType(
    {
        "": (0.0, 0.0),
        "at the top": (0.0, -1.5),
        "at the bottom": (0.0, 1.5),
        "on the left": (-1.5, 0.0),
        "on the right": (1.5, 0.0),
    }
)

#: Range of the brightness factor each training sample's colour is scaled by (its mean is what
#: `synthetic_pattern` draws); gray is white at about half this, so brightness names it.
BRIGHTNESS: tuple[float, float] = (0.75, 1.0)
#: A bar's half length, in radii (its half width is 0.4 radii).
BAR_LENGTH = 1.3
#: Each training sample's centre moves by up to this many latent pixels on each axis.
POSITION_JITTER = 0.4
#: Each training sample's radius is scaled by a factor within 1 -+ this.
SIZE_JITTER = 0.05

#: The sampler settings the teacher is trained for, keyed like a recipe's `[precompute.sampler]`:
#: 64x64 px and one frame (latents 16x1x8x8), prompts padded to 16 tokens (the longest prompt
#: has 8), 16 UniPC steps at the scheduler's flow shift, CFG against the empty prompt.
TRAINED_SAMPLER: Mapping[str, Any] = MappingProxyType(
    {
        "height": 64,
        "width": 64,
        "num_frames": 1,
        "num_inference_steps": 16,
        "guidance_scale": 3.0,
        "flow_shift": SCHEDULER_CONFIG["flow_shift"],
        "negative_prompt": "",
        "max_sequence_length": 16,
    }
)

_LATENT_HW = (TRAINED_SAMPLER["height"] // 8, TRAINED_SAMPLER["width"] // 8)
_CHANNELS = 16


# --------------------------------------------------------------------------- the data set


@dataclasses.dataclass(frozen=True, slots=True)
class _Prompt:
    colour: str
    shape: str
    size: str = ""
    position: str = ""

    @property
    def text(self) -> str:
        words = [w for w in (self.size, self.colour, self.shape, self.position) if w]
        return " ".join(["an" if words[0][0] in "aeiou" else "a", *words])


def grammar_prompts() -> list[str]:
    """Every prompt of the grammar, in a fixed order (the teacher is trained on all of them)."""
    return [p.text for p in _grammar()]


def _grammar() -> list[_Prompt]:
    return [
        _Prompt(colour, shape, size, position)
        for colour in COLOURS
        for shape in SHAPES
        for size in SIZES
        for position in POSITIONS
    ]


def synthetic_prompts(n: int, seed: int = 0) -> list[str]:
    """`n` prompts of the grammar, shuffled by `seed`; no repeats until all 240 are used.

    The order depends only on `seed`, so a demo's or benchmark's prompt file is reproducible.
    """
    if n < 0:
        raise UsageError(f"n={n} must be >= 0", fix="ask for a non-negative number of prompts")
    rng = random.Random(f"wandistill-trained-prompts:{seed}")
    prompts = grammar_prompts()
    out: list[str] = []
    while len(out) < n:
        rng.shuffle(prompts)
        out += prompts[: n - len(out)]
    return out


_BY_WORDS = {p.text.split(" ", 1)[1]: p for p in _grammar()}
"""Every prompt of the grammar by its words after the article ("a" / "an")."""


def parse_prompt(prompt: str) -> _Prompt:
    """The grammar's reading of `prompt`; anything outside the grammar raises UsageError."""
    m = re.fullmatch(r"an? (.+)", prompt.strip())
    spec = _BY_WORDS.get(m.group(1)) if m else None
    if spec is None:
        raise UsageError(
            f"prompt {prompt!r} is not in the trained teacher's grammar",
            fix="use 'a [small] <colour> <circle|bar|column> [at the top|...]', e.g. 'a red bar'",
        )
    return spec


def mixing_matrix() -> torch.Tensor:
    """[16, 5] from (r, g, b, x, y): channels 0-2 are the RGB, 3-15 a fixed random mix of all 5.

    x and y are the frame's coordinates (a fixed backdrop). Wan's DiT has only relative (RoPE)
    positions, so without them it cannot tell the top of the frame from the bottom, and puts
    "a circle at the top" anywhere; read off a token's own channels, they tell it where it is.
    Public so that `eval.viewer` can unmix a sample back into its RGB.
    """
    g = torch.Generator().manual_seed(1234)
    rest = torch.randn(_CHANNELS - 3, 5, generator=g) / math.sqrt(2.0)
    return torch.cat([torch.eye(3, 5), rest])


def world_scale(hw: tuple[int, int]) -> float:
    """Latent pixels per grammar unit at `hw`: sizes and positions are given for the teacher's
    own frame (`TRAINED_SAMPLER`) and scale with the smaller side of another."""
    return min(hw) / min(_LATENT_HW)


def _grid(hw: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Pixel-centre coordinates (x [W], y [H]) in latent pixels, 0 at the frame's centre."""
    h, w = hw
    ys = torch.arange(h, dtype=torch.float32) + 0.5 - h / 2
    xs = torch.arange(w, dtype=torch.float32) + 0.5 - w / 2
    return xs, ys


def backdrop(hw: tuple[int, int]) -> torch.Tensor:
    """[2, H, W]: the frame's x and y in [-1, 1], the mixing matrix's last two inputs."""
    h, w = hw
    xs, ys = _grid(hw)
    return torch.stack([xs.expand(h, w) / (w / 2), ys[:, None].expand(h, w) / (h / 2)])


def _signed_distance(shape: str, x: torch.Tensor, y: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """Distance to the shape's edge in latent pixels (negative inside); broadcasts over a batch."""
    if shape == "circle":
        return torch.hypot(x, y) - r
    if shape == "bar":
        return torch.maximum(x.abs() - BAR_LENGTH * r, y.abs() - 0.4 * r)
    if shape == "column":
        return torch.maximum(x.abs() - 0.4 * r, y.abs() - BAR_LENGTH * r)
    raise AssertionError(shape)  # pragma: no cover - SHAPES and this function move together


def shape_masks(
    shape_B: torch.Tensor, centre_B2: torch.Tensor, radius_B: torch.Tensor, hw: tuple[int, int]
) -> torch.Tensor:
    """Soft masks [B, H, W] in [0, 1] (edge ~1 px wide): what `_render` colours.

    `shape_B` indexes SHAPES. Every shape's distance is computed for the whole batch and the
    right one gathered: five small tensor ops beat a Python loop over the batch. Public so that
    `eval.viewer` matches samples against the very templates the teacher was trained on.
    """
    h, w = hw
    xs, ys = _grid(hw)
    y, x = torch.meshgrid(ys, xs, indexing="ij")
    x = x - centre_B2[:, 0, None, None]
    y = y - centre_B2[:, 1, None, None]
    r = radius_B[:, None, None]
    dist_SBHW = torch.stack([_signed_distance(shape, x, y, r) for shape in SHAPES])
    dist_BHW = dist_SBHW.gather(0, shape_B.view(1, -1, 1, 1).expand(1, -1, h, w))[0]
    return torch.sigmoid(-4.0 * dist_BHW)


def _render(
    shape_B: torch.Tensor,
    rgb_B3: torch.Tensor,
    centre_B2: torch.Tensor,
    radius_B: torch.Tensor,
    hw: tuple[int, int],
) -> torch.Tensor:
    """Latents [B, 16, 1, H, W]: soft shape masks coloured on black, then mixed."""
    h, w = hw
    mask_BHW = shape_masks(shape_B, centre_B2, radius_B, hw)
    rgb_B3HW = 2.0 * rgb_B3[:, :, None, None] * mask_BHW[:, None] - 1.0
    features = torch.cat([rgb_B3HW, backdrop(hw).expand(len(shape_B), 2, h, w)], dim=1)
    latents = torch.einsum("ck,bkhw->bchw", mixing_matrix(), features)
    return latents.unsqueeze(2)


def synthetic_pattern(prompt: str, hw: tuple[int, int] = _LATENT_HW) -> torch.Tensor:
    """The prompt's latent [16, 1, H, W] with no per-sample jitter: the centre of its spread.

    Tests and benchmarks compare teacher samples with it; H x W are latent pixels (8x8 for the
    recommended 64x64 px).
    """
    spec = parse_prompt(prompt)
    scale = world_scale(hw)
    centre = torch.tensor([POSITIONS[spec.position]]) * scale
    radius = torch.tensor([SIZES[spec.size]]) * scale
    rgb = torch.tensor([COLOURS[spec.colour]]) * sum(BRIGHTNESS) / 2  # the jitter's mean
    shape = torch.tensor([SHAPES.index(spec.shape)])
    return _render(shape, rgb, centre, radius, hw)[0]


def _training_batch(
    specs: Sequence[_Prompt], b: int, g: torch.Generator
) -> tuple[list[int], torch.Tensor]:
    """`b` random prompt indices and their jittered latents [b, 16, 1, 8, 8]."""
    idx = torch.randint(len(specs), (b,), generator=g).tolist()
    chosen = [specs[i] for i in idx]
    u = torch.rand(b, 7, generator=g)
    jitter = 2.0 * POSITION_JITTER * (u[:, :2] - 0.5)
    centre = torch.tensor([POSITIONS[p.position] for p in chosen]) + jitter
    factor = 1 - SIZE_JITTER + 2 * SIZE_JITTER * u[:, 2]
    radius = torch.tensor([SIZES[p.size] for p in chosen]) * factor
    rgb = torch.tensor([COLOURS[p.colour] for p in chosen])
    lo, hi = BRIGHTNESS
    rgb = (rgb + 0.15 * (u[:, 3:6] - 0.5)).clamp(0.0, 1.0) * (lo + (hi - lo) * u[:, 6:])
    shape = torch.tensor([SHAPES.index(p.shape) for p in chosen])
    latents = _render(shape, rgb, centre, radius, _LATENT_HW)
    return idx, latents + 0.05 * torch.randn(latents.shape, generator=g)
