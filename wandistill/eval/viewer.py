"""What a viewer sees: colour, shape, size and position read off a trained-teacher sample.

Why: R_K and equivalent steps reward per-sample agreement with the teacher, and say nothing of
whether a sample shows what its prompt asks, nor whether a student collapsed to a blurred mean
that is "close on average". The trained tiny teacher's world (`wandistill.teacher.world`) is
rendered by a known function, so a sample can be read back exactly, with no learnt classifier:

1. **Unmix.** The latent is `mixing_matrix() @ (2 rgb mask - 1, x, y)` per pixel. The known
   backdrop (x, y) is subtracted and the RGB solved by least squares over all 16 channels (the
   13 mixed channels average out noise that channels 0-2 alone would keep): per pixel, the
   colour times the mask, 0 on the black background (`unmix`).
2. **Fit.** Every candidate template of `shape_masks` (each shape, a grid of centres and radii,
   then a finer grid around the best) is fitted to that image by least squares with a free RGB:
   the residual is ``|p|^2 - |T.p|^2 / |T|^2``. The best template gives shape and centre; its
   fitted RGB the colour. `fit` is the share of the image's energy it explains.
3. **Name.** Colour: the nearest grammar colour at any brightness from the training data's
   lowest up (guidance over-brightens; gray is a dimmer white, so for gray brightness decides).
   Size: the grammar size whose template is as long at half its peak as the sample (a soft
   edge widens a least-squares fit, not the half-peak contour). Position: the nearest grammar
   offset to the centre. Shape: the template's. Shape and size are only named when the fit is
   `clear` (explains >= `CLEAR_FIT` of the image).

On rendered patterns the reading is exact; a blurred sample loses its size, shape and colour
(tests/unit/test_viewer.py). Measured on the trained teacher: docs/benchmarks.md, "Trained tiny
teacher".

`Tally` keeps the shares per eval column (all four attributes, each one, clear) and the
**spread**: the RMS distance of each sample's (centre, radius) from its prompt's un-jittered
values, in latent pixels of the teacher's frame. Every prompt's samples scatter around those
values the same way in training, so this is the spread across seeds of one prompt, measured with
one seed per prompt; `spread_ratio` divides it by the reference column's (teacher@N). A student
that returns each prompt's mean scores a spread ratio near 0.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch

from wandistill.errors import UsageError
from wandistill.teacher.world import (
    BRIGHTNESS,
    COLOURS,
    POSITIONS,
    SHAPES,
    SIZES,
    backdrop,
    mixing_matrix,
    parse_prompt,
    shape_masks,
    world_scale,
)

ATTRIBUTES = ("colour", "shape", "size", "position")
LEGEND = (
    "shown: share of samples with the prompt's colour, shape, size and position (read off each "
    "sample by the known renderer, no model); then each one alone; spread: how far samples "
    "scatter around their prompt's centre and size, over the reference's (near 0: collapsed "
    "to a mean)."
)
CLEAR_FIT = 0.8
"""A template must explain this share of a sample's colour energy for its shape and size to be
named (a rendered pattern: 1.0; the trained teacher at CFG 3 on 96 fresh prompts: 1.00 at 16
steps, 0.50 at one step)."""
_COARSE_STEP = 0.5
"""Centre grid of the first pass, in latent pixels of the teacher's frame (scaled with it)."""
_RADII = torch.exp(torch.linspace(math.log(0.8), math.log(5.0), 28))
"""Radii of the first pass (x world_scale): 7% apart, below the smallest size, above the largest."""
_FINE = torch.linspace(-0.3, 0.3, 7)
"""Second pass: centre offsets around the best coarse one (x the coarse step x world_scale)."""
_FINE_RADIUS = torch.exp(torch.linspace(-0.06, 0.06, 5))


@dataclass(frozen=True, slots=True)
class Reading:
    """What one sample shows."""

    colour: str
    shape: str | None
    """None when the fit is not clear."""
    size: str | None
    position: str
    rgb: tuple[float, float, float]
    centre: tuple[float, float]
    """(x, y) in latent pixels of the teacher's frame, y down, 0 at the centre."""
    radius: float
    """In latent pixels of the teacher's frame."""
    fit: float

    @property
    def clear(self) -> bool:
        return self.shape is not None


NOTHING = Reading("", None, None, "-", (math.nan,) * 3, (math.nan, math.nan), math.nan, 0.0)
"""The reading of a sample with non-finite values: no attribute, and left out of the spread."""


def unmix(latents_BCFHW: torch.Tensor) -> torch.Tensor:
    """[B, 16, 1, H, W] latents -> [B, H*W, 3]: colour x mask per pixel (0 on the background)."""
    b, c, _, h, w = latents_BCFHW.shape
    m = mixing_matrix()
    x_BCP = latents_BCFHW[:, :, 0].float().reshape(b, c, h * w)
    rest_CP = m[:, 3:] @ backdrop((h, w)).reshape(2, h * w)
    feat_B3P = torch.linalg.pinv(m[:, :3]) @ (x_BCP - rest_CP)
    return ((feat_B3P + 1.0) / 2.0).transpose(1, 2)


@functools.lru_cache(maxsize=4)
def _coarse(hw: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The first pass's templates over the whole frame: (params [N, 4] = shape, cx, cy, r in
    latent pixels of this frame; templates [N, P]; their squared norms [N])."""
    scale = world_scale(hw)
    step = _COARSE_STEP * scale
    half = max(hw) / 2
    offs = torch.arange(-half, half + 1e-6, step)
    cy, cx = torch.meshgrid(offs, offs, indexing="ij")
    radii = _RADII * scale
    s, c, r = torch.meshgrid(
        torch.arange(len(SHAPES)), torch.arange(cx.numel()), torch.arange(len(radii)), indexing="ij"
    )
    c = c.flatten()
    cols = [s.flatten().float(), cx.flatten()[c], cy.flatten()[c], radii[r.flatten()]]
    params = torch.stack(cols, dim=1)
    return params, *_templates(params, hw)


def _templates(params_N4: torch.Tensor, hw: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    t = shape_masks(params_N4[:, 0].long(), params_N4[:, 1:3], params_N4[:, 3], hw)
    t_NP = t.reshape(len(params_N4), -1)
    return t_NP, t_NP.square().sum(dim=1).clamp_min(1e-9)


def _best(p_P3: torch.Tensor, t_NP: torch.Tensor, tt_N: torch.Tensor) -> tuple[int, float]:
    """Index of the template that leaves the least residual, and that residual."""
    proj_N3 = t_NP @ p_P3
    resid_N = p_P3.square().sum() - proj_N3.square().sum(dim=1) / tt_N
    i = int(resid_N.argmin())
    return i, float(resid_N[i])


def _refine(params_4: torch.Tensor, hw: tuple[int, int]) -> torch.Tensor:
    """Templates around one coarse fit: finer centres and radii, every shape."""
    step = _COARSE_STEP * world_scale(hw)
    s, dx, dy, dr = torch.meshgrid(
        torch.arange(len(SHAPES)).float(), _FINE * step, _FINE * step, _FINE_RADIUS, indexing="ij"
    )
    x, y, r = params_4[1] + dx.flatten(), params_4[2] + dy.flatten(), params_4[3] * dr.flatten()
    return torch.stack([s.flatten(), x, y, r], dim=1)


def read(latents_BCFHW: torch.Tensor) -> list[Reading]:
    """Each sample's colour, shape, size and position, from the known renderer alone."""
    hw = (latents_BCFHW.shape[-2], latents_BCFHW.shape[-1])
    scale = world_scale(hw)
    params, t_NP, tt_N = _coarse(hw)
    out = []
    for p_P3 in unmix(latents_BCFHW):
        if not bool(torch.isfinite(p_P3).all()):  # a diverged sampler shows nothing
            out.append(NOTHING)
            continue
        i, _ = _best(p_P3, t_NP, tt_N)
        fine = _refine(params[i], hw)
        f_NP, ff_N = _templates(fine, hw)
        j, resid = _best(p_P3, f_NP, ff_N)
        shape, cx, cy, r = fine[j].tolist()
        rgb_3 = f_NP[j] @ p_P3 / ff_N[j]
        energy = float(p_P3.square().sum())
        fit = 1.0 - resid / energy if energy > 0 else 0.0
        clear = fit >= CLEAR_FIT
        centre = (cx / scale, cy / scale)
        away = {k: math.dist(xy, centre) for k, xy in POSITIONS.items()}
        out.append(
            Reading(
                colour=nearest_colour(rgb_3.tolist()),
                shape=SHAPES[int(shape)] if clear else None,
                size=_size(p_P3, rgb_3, int(shape), (cx, cy), hw) if clear else None,
                position=min(away, key=away.__getitem__),
                rgb=tuple(rgb_3.tolist()),
                centre=centre,
                radius=r / scale,
                fit=fit,
            )
        )
    return out


def _size(
    p_P3: torch.Tensor, rgb_3: torch.Tensor, shape: int, centre: tuple[float, float], hw: tuple
) -> str:
    """The grammar size whose template (this shape, this centre, clipped by the frame) is as
    long as the sample at half its peak (`half_peak_extent`), nearest in log length.

    Why not the fitted radius: a sampler's edges are softer than the renderer's, and a least
    squares template fit widens to take in the soft rim (measured on teacher samples: +15% radius
    on default-sized circles), while the half-maximum contour of a symmetric blur stays on the
    edge, as the renderer's own mask is 0.5 on it. Why length, not area: a bar is one or two
    pixels thick on an 8x8 frame, so its area jumps with how its edges meet the pixel rows,
    while its length does not."""
    h, w = hw
    level_1HW = (p_P3 @ rgb_3 / rgb_3.square().sum().clamp_min(1e-9)).reshape(1, h, w)
    seen = float(half_peak_extent(level_1HW, SHAPES[shape])[0])
    names = list(SIZES)
    radii = torch.tensor([SIZES[n] for n in names]) * world_scale(hw)
    masks = shape_masks(
        torch.full((len(names),), shape), torch.tensor([centre]).expand(len(names), 2), radii, hw
    )
    lengths = half_peak_extent(masks, SHAPES[shape]).tolist()
    ratio = [abs(math.log(max(seen, 0.1) / max(n, 0.1))) for n in lengths]
    return names[ratio.index(min(ratio))]


def half_peak_extent(level_BHW: torch.Tensor, shape: str) -> torch.Tensor:
    """Each image's length at half its peak along the shape's long axis (a bar's rows, a
    column's columns, both for a round shape, averaged), in pixels: the longest line's count of
    pixels, each counted softly (0 at a quarter of the peak, 1 at three quarters, linearly
    between) so that lengths between pixel centres still differ, and a template and a sample
    are measured alike (each against its own peak: a thin shape peaks below 1)."""
    peak = level_BHW.amax(dim=(1, 2), keepdim=True).clamp_min(1e-9)
    on = ((level_BHW / peak - 0.25) / 0.5).clamp(0.0, 1.0)
    along_x, along_y = on.sum(dim=2).amax(dim=1), on.sum(dim=1).amax(dim=1)
    if shape == "bar":
        return along_x
    if shape == "column":
        return along_y
    return (along_x + along_y) / 2


def nearest_colour(rgb: list[float] | tuple[float, ...]) -> str:
    """The grammar colour nearest `rgb` at the best brightness for it: at least the training
    data's lowest, and no more than its highest for gray alone.

    Why no upper bound for the others: guidance makes a teacher overshoot (CFG 5 draws colours
    at 1.3-2x their training brightness), and a hue does not change with it; gray is a dimmer
    white, so for gray and white brightness is the whole difference."""
    lo, hi = BRIGHTNESS

    def distance(name: str) -> float:
        c = COLOURS[name]
        k = sum(a * b for a, b in zip(rgb, c, strict=True)) / sum(v * v for v in c)
        k = min(max(k, lo), hi) if name == "gray" else max(k, lo)
        return sum((a - k * b) ** 2 for a, b in zip(rgb, c, strict=True))

    return min(COLOURS, key=distance)


def judge(reading: Reading, prompt: str) -> dict[str, bool]:
    """Which of the prompt's four attributes the sample shows."""
    spec = parse_prompt(prompt)
    return {a: getattr(reading, a) == getattr(spec, a) for a in ATTRIBUTES}


def deviation(reading: Reading, prompt: str) -> float:
    """Squared distance of (centre, radius) from the prompt's un-jittered values (latent px^2)."""
    spec = parse_prompt(prompt)
    x, y = POSITIONS[spec.position]
    dx, dy = reading.centre[0] - x, reading.centre[1] - y
    return dx * dx + dy * dy + (reading.radius - SIZES[spec.size]) ** 2


def in_world(prompts: list[str], latents_BCFHW: torch.Tensor) -> bool:
    """True when the viewer can judge these samples: every prompt in the trained teacher's
    grammar and latents of its 16 channels and one frame."""
    if latents_BCFHW.dim() != 5 or latents_BCFHW.shape[1:3] != (16, 1):
        return False
    try:
        for p in prompts:
            parse_prompt(p)
    except UsageError:  # a prompt outside the grammar
        return False
    return True


@dataclass(slots=True)
class Score:
    """One eval column's shares over the held-out records (eval.json: `columns[i].viewer`)."""

    all: float
    """All four attributes right."""
    colour: float
    shape: float
    size: float
    position: float
    clear: float
    """Share of samples with a clear shape (fit >= CLEAR_FIT)."""
    spread: float
    """RMS distance of (centre, radius) from the prompt's un-jittered values, latent px."""
    spread_ratio: float | None = None
    """spread / the reference column's (teacher@N); ~1 a teacher-like spread, ~0 a collapse."""


@dataclass(slots=True)
class Tally:
    """Running counts per column, fed a batch at a time by eval (`add`), read by `scores`."""

    active: bool = True
    """False once a prompt outside the grammar (or a latent of another shape) was seen."""
    counts: dict[str, dict[str, float]] = field(default_factory=dict)

    def add(self, prompts: list[str], finals: dict[str, torch.Tensor]) -> list[dict[str, list]]:
        """Judge every column's samples of one batch; per record: column -> what it got right
        (colour, shape, size, position as 0/1), for eval's per-record rows."""
        rows: list[dict[str, list]] = [{} for _ in prompts]
        if not self.active or not all(in_world(prompts, f) for f in finals.values()):
            self.active = False
            return rows
        for name, latents in finals.items():
            keys = (*ATTRIBUTES, "all", "clear", "sq", "n", "finite")
            c = self.counts.setdefault(name, dict.fromkeys(keys, 0))
            for row, reading, prompt in zip(rows, read(latents), prompts, strict=True):
                ok = judge(reading, prompt)
                for a in ATTRIBUTES:
                    c[a] += ok[a]
                c["all"] += all(ok.values())
                c["clear"] += reading.clear
                if reading is not NOTHING:
                    c["sq"] += deviation(reading, prompt)
                    c["finite"] += 1
                c["n"] += 1
                row[name] = [int(ok[a]) for a in ATTRIBUTES]
        return rows

    def scores(self, reference: str) -> dict[str, Score]:
        """Every column's Score; spread_ratio against `reference`'s spread."""
        if not self.active or not self.counts:
            return {}
        out = {
            name: Score(
                **{k: c[k] / c["n"] for k in ("all", *ATTRIBUTES, "clear")},
                spread=math.sqrt(c["sq"] / max(c["finite"], 1)),
            )
            for name, c in self.counts.items()
        }
        ref = out.get(reference)
        if ref is not None and ref.spread > 0:
            for s in out.values():
                s.spread_ratio = s.spread / ref.spread
        return out


def table_rows(columns: list[tuple[str, Score | None]], n: int) -> list[list[str]]:
    """eval's second table: a header, then one row per judged column; [] if none was judged."""
    judged = [(name, s) for name, s in columns if s is not None]
    if not judged:
        return []
    head = ["column", "shown", *ATTRIBUTES, "clear", f"spread / teacher@{n}"]
    rows = [head]
    for name, s in judged:
        ratio = "-" if s.spread_ratio is None else f"{s.spread_ratio:.2f}"
        shares = [s.all, s.colour, s.shape, s.size, s.position, s.clear]
        rows.append([name, *(f"{v:.2f}" for v in shares), ratio])
    return rows
