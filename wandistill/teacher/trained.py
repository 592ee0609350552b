"""A tiny Wan teacher that wandistill trains itself, offline, on prompt-conditioned shapes.

Why this exists: the random teacher of `tiny.py` maps noise to noise, so nothing tells a good
few-step student from a bad one. This teacher has learnt a real conditional distribution, small
enough to train in about 65 s of one CPU core: "a red column at the top" gives a red upright
bar near the top of a black frame, and sampling it in one or two steps gives a blurred,
over-bright blob instead, which is the gap few-step distillation has to close (figures:
docs/benchmarks.md, "Trained tiny teacher"). It is still a stock diffusers Wan 2.1 folder
(`WanPipeline.from_pretrained(folder)`); only the transformer is trained.

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

**Training.** Rectified flow exactly as Wan's sampler reads the model: ``x_t = (1 - s) x0 + s n``,
target ``v = n - x0``, ``timestep = 1000 s``. ``s`` is a uniform ``u`` mapped through the
scheduler's own shift, ``s = 3u / (1 + 2u)`` (flow_shift 3), so training sigmas follow the density
at which the UniPC sampler queries the model (most steps at high noise, where the layout is
decided); logit-normal sigmas gave crisper edges but a useless first step in a trial. 10% of the
samples get the embedding of the empty prompt, exactly what WanPipeline uses for
``negative_prompt=""``, so classifier-free guidance works. Prompt embeddings come from the frozen
tiny UMT5 encoder (random weights; its tokenizer gets the grammar's words as whole-word pieces),
computed once through `WanPipeline.encode_prompt`. Fused AdamW (lr 4e-3, warm-up, cosine
decay), batch 64, 800 steps, and the weights saved are an EMA (0.995) of the trained ones. More
steps draw crisper shapes, but each costs ~80 ms of a core: 1500 steps took 115 s of CPU, and
even 1000 (~90 s for the whole build) left too little of the 2-minute budget on a shared machine.
`BuildSettings` holds these numbers; `TRAINED_SAMPLER` the sampler settings the teacher is meant
for.

**Reproducibility.** The same seed gives byte-identical safetensors for the same torch build and
CPU kind, whatever OMP_NUM_THREADS says: training runs on one intra-op thread (`_one_thread`),
since CPU matmuls order float sums by thread count. Another instruction set may still round
differently. `ensure_trained_teacher(root, seed)` builds once per digest of everything above
under ``root/teachers/`` (temp folder, then rename; concurrent callers wait on a file lock) and
reuses that folder afterwards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import random
import re
import shutil
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from rich.console import Console

from wandistill.errors import UsageError
from wandistill.runtime.progress import Progress
from wandistill.teacher.tiny import (
    SCHEDULER_CONFIG,
    TEXT_ENCODER_CONFIG,
    build_components,
    check_target,
    derived_seed,
    write_teacher,
)

__all__ = [
    "BRIGHTNESS",
    "COLOURS",
    "POSITIONS",
    "SHAPES",
    "SIZES",
    "TRAINED_SAMPLER",
    "TRAINED_TRANSFORMER_CONFIG",
    "BuildSettings",
    "backdrop",
    "build_trained_pipeline",
    "ensure_trained_teacher",
    "grammar_prompts",
    "make_trained_teacher",
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

#: Wan's DiT, 2 blocks of width 128 (4 heads x 32): a 16x2x2 patch is 64 numbers, and a width
#: of 64 could not carry the noise through to the output (samples stayed speckled). One
#: optimiser step at batch 64 costs ~80 ms of one CPU core. `text_dim` is the tiny UMT5's.
TRAINED_TRANSFORMER_CONFIG: Mapping[str, Any] = MappingProxyType(
    {
        "patch_size": (1, 2, 2),
        "num_attention_heads": 4,
        "attention_head_dim": 32,
        "in_channels": 16,
        "out_channels": 16,
        "text_dim": TEXT_ENCODER_CONFIG["d_model"],
        "freq_dim": 256,
        "ffn_dim": 256,
        "num_layers": 2,
        "cross_attn_norm": True,
        "qk_norm": "rms_norm_across_heads",
        "eps": 1e-6,
        "rope_max_seq_len": 1024,
    }
)

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

#: Grammar words the tiny tokenizer lacks; as whole-word pieces each word is one token, which the
#: transformer picks out of the text far sooner than a spelled-out word.
_EXTRA_WORDS: tuple[str, ...] = (*SHAPES, "top", "bottom", "left", "right")
_LATENT_HW = (TRAINED_SAMPLER["height"] // 8, TRAINED_SAMPLER["width"] // 8)
_CHANNELS = 16
_META_FILE = "wandistill_teacher.json"
_console = Console(stderr=True, highlight=False, soft_wrap=True)
#: Bump when the renderer or the training loop changes what the same settings produce.
_RECIPE_VERSION = 3


@dataclasses.dataclass(frozen=True, slots=True)
class BuildSettings:
    """The numbers that decide the trained teacher's bytes (with the constants above)."""

    seed: int = 0
    """Seeds the components, the data stream and the training."""
    steps: int = 800
    """Optimiser steps; tests pass a few. 800 take about 65 s of one CPU core."""
    batch_size: int = 64
    lr: float = 4e-3
    warmup_steps: int = 50
    ema_decay: float = 0.995
    cond_dropout: float = 0.1
    """Share of samples trained on the empty prompt, so classifier-free guidance works."""

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch_size < 1:
            raise UsageError(
                f"trained teacher steps={self.steps} and batch_size={self.batch_size} must be >= 1",
                fix="pass positive numbers",
            )

    def digest(self) -> str:
        """Names a cached build: these settings, the grammar, the configs, the recipe version."""
        blob = json.dumps(
            {
                "settings": dataclasses.asdict(self),
                "grammar": [dict(COLOURS), SHAPES, dict(SIZES), dict(POSITIONS)],
                "transformer": dict(TRAINED_TRANSFORMER_CONFIG),
                "text_encoder": dict(TEXT_ENCODER_CONFIG),
                "scheduler": dict(SCHEDULER_CONFIG),
                "sampler": dict(TRAINED_SAMPLER),
                "recipe": _RECIPE_VERSION,
            },
            sort_keys=True,
        )
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


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


_KNOWN = {(p.colour, p.shape, p.size, p.position) for p in _grammar()}
_PROMPT_RE = re.compile(
    r"^an? (?:(?P<size>small|big) )?(?P<colour>\w+) (?P<shape>\w+)(?: (?P<position>.+))?$"
)


def parse_prompt(prompt: str) -> _Prompt:
    """The grammar's reading of `prompt`; anything outside the grammar raises UsageError."""
    m = _PROMPT_RE.match(prompt.strip())
    words = {k: m.group(k) or "" for k in ("colour", "shape", "size", "position")} if m else {}
    spec = _Prompt(**words) if words else None
    if spec is None or (spec.colour, spec.shape, spec.size, spec.position) not in _KNOWN:
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


# --------------------------------------------------------------------------- training


def _shifted_sigmas(u: torch.Tensor) -> torch.Tensor:
    """Uniform u -> sigma with the scheduler's flow shift (the density UniPC samples at)."""
    shift = float(SCHEDULER_CONFIG["flow_shift"])
    return shift * u / (1.0 + (shift - 1.0) * u)


@torch.no_grad()
def _embed(pipe: Any, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Text embeddings [P, L, D] of `prompts` and [1, L, D] of "" exactly as WanPipeline makes."""
    cond, uncond = pipe.encode_prompt(
        prompts,
        negative_prompt="",
        do_classifier_free_guidance=True,
        max_sequence_length=TRAINED_SAMPLER["max_sequence_length"],
        device=torch.device("cpu"),
    )
    return cond, uncond[:1]


def _lr_factor(step: int, settings: BuildSettings) -> float:
    """Linear warm-up, then cosine decay to 5% (the late, small steps act like an EMA)."""
    if step < settings.warmup_steps:
        return (step + 1) / settings.warmup_steps
    t = (step - settings.warmup_steps) / max(1, settings.steps - settings.warmup_steps)
    return 0.05 + 0.95 * 0.5 * (1.0 + math.cos(math.pi * t))


def _train(model: torch.nn.Module, pipe: Any, settings: BuildSettings, progress: bool) -> float:
    """Rectified-flow training of `model` on the synthetic set; returns the last loss (smoothed)."""
    specs = _grammar()
    embeds_PLD, empty_1LD = _embed(pipe, [p.text for p in specs])
    g = torch.Generator().manual_seed(derived_seed(settings.seed, "trained-data"))
    # fused: one kernel for all 69 tensors, 2 ms a step instead of 7 (a tenth of the step).
    opt = torch.optim.AdamW(model.parameters(), lr=settings.lr, betas=(0.9, 0.99), fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: _lr_factor(step, settings))
    b, smooth = settings.batch_size, float("nan")
    ema = torch.optim.swa_utils.AveragedModel(
        model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(settings.ema_decay)
    )
    model.train()
    with Progress(total=settings.steps, description="train teacher", enabled=progress) as bar:
        for _ in range(settings.steps):
            idx, x0 = _training_batch(specs, b, g)
            noise = torch.randn(x0.shape, generator=g)
            sigma = _shifted_sigmas(torch.rand(b, generator=g))
            dropped = torch.rand(b, generator=g) < settings.cond_dropout
            text = torch.where(dropped[:, None, None], empty_1LD, embeds_PLD[idx])
            s = sigma.view(b, 1, 1, 1, 1)
            v = model(
                hidden_states=(1.0 - s) * x0 + s * noise,
                timestep=sigma * 1000.0,
                encoder_hidden_states=text,
                return_dict=False,
            )[0]
            loss = torch.nn.functional.mse_loss(v, noise - x0)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            ema.update_parameters(model)
            smooth = loss.item() if math.isnan(smooth) else 0.98 * smooth + 0.02 * loss.item()
            bar.advance(loss=smooth)
    torch.nn.utils.vector_to_parameters(
        torch.nn.utils.parameters_to_vector(ema.module.parameters()), model.parameters()
    )
    model.eval()
    return smooth


def build_trained_pipeline(settings: BuildSettings, progress: bool = True) -> tuple[Any, float]:
    """A WanPipeline whose transformer is trained per `settings`; also the final smoothed loss."""
    from diffusers import WanPipeline, WanTransformer3DModel

    components = build_components(settings.seed, wan22=False, extra_words=_EXTRA_WORDS)
    with torch.random.fork_rng(devices=[]), _one_thread():
        torch.manual_seed(derived_seed(settings.seed, "trained-transformer"))
        model = WanTransformer3DModel(**TRAINED_TRANSFORMER_CONFIG)
        components["transformer"] = model
        pipe = WanPipeline(**components)
        loss = _train(model, pipe, settings, progress)
    model.eval()
    return pipe, loss


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """Run torch on one intra-op thread, then restore the caller's count.

    Why: CPU matmuls split their sums differently under another thread count, so the weights
    would depend on OMP_NUM_THREADS; with one thread the same seed gives the same bytes however
    the process was started. It costs little: these matrices are too small for a second thread
    to help much (about 1.3x when idle), and on a shared 2-core machine two OpenMP threads run
    many times slower as soon as another process takes a core (docs/benchmarks.md, Train).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


# --------------------------------------------------------------------------- building


def _settings(seed: int, steps: int | None) -> BuildSettings:
    """The default recipe with this seed and, where given, this number of steps."""
    return BuildSettings(seed=seed) if steps is None else BuildSettings(seed=seed, steps=steps)


def make_trained_teacher(
    path: str | Path,
    *,
    seed: int = 0,
    steps: int | None = None,
    overwrite: bool = False,
    progress: bool = True,
) -> Path:
    """Train the teacher and write it to `path` as a diffusers Wan 2.1 folder; returns `path`.

    The target is checked before training (no minute lost on a bad PATH) and again before the
    rename; an existing teacher is replaced only with `overwrite=True`. `wandistill_teacher.json`
    beside model_index.json records the build settings, the final loss and the sampler settings.
    """
    path = Path(path).absolute()
    check_target(path, overwrite)
    settings = _settings(seed, steps)
    pipe, loss = build_trained_pipeline(settings, progress)
    meta = {
        "kind": "wandistill trained tiny teacher",
        "digest": settings.digest(),
        "settings": dataclasses.asdict(settings),
        "final_loss": round(loss, 6),
        "sampler": dict(TRAINED_SAMPLER),
    }
    return write_teacher(path, pipe, overwrite=overwrite, extra_json={_META_FILE: meta})


def ensure_trained_teacher(
    root: str | Path = "cache",
    seed: int = 0,
    *,
    steps: int | None = None,
    progress: bool = True,
) -> Path:
    """The trained teacher for these settings under `root/teachers/`, trained on first use.

    The folder is named by `BuildSettings.digest()`, so other settings never reuse a stale build.
    A file lock makes concurrent callers (demo and benchmark started together) train it once;
    temp folders that an interrupted build left behind are removed under that lock.
    """
    folder = Path(root).absolute() / "teachers" / f"trained-{_settings(seed, steps).digest()}"
    if (folder / "model_index.json").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(folder):
        if (folder / "model_index.json").is_file():  # another process built it meanwhile
            return folder
        for stale in folder.parent.glob(f".{folder.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        try:
            return make_trained_teacher(folder, seed=seed, steps=steps, progress=progress)
        except FileExistsError as e:
            raise UsageError(str(e), fix=f"remove {folder} and run again") from None


@contextlib.contextmanager
def _build_lock(folder: Path) -> Iterator[None]:
    """Hold `folder`'s build lock; say so on stderr when another process holds it first.

    Why the line: a second demo started beside the first would otherwise sit silent for the
    minute the first one spends training.
    """
    from filelock import FileLock, Timeout

    lock = FileLock(folder.parent / f".{folder.name}.lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        _console.print(f"teacher: waiting for another process to finish training {folder}")
        lock.acquire()
    try:
        yield
    finally:
        lock.release()
