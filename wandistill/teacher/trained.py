"""A tiny Wan teacher that wandistill trains itself, offline, on prompt-conditioned shapes.

Why this exists: the random teacher of `tiny.py` maps noise to noise, so nothing tells a good
few-step student from a bad one. This teacher has learnt a real conditional distribution, small
enough to train in about 65 s of one CPU core: "a red column at the top" gives a red upright
bar near the top of a black frame, and sampling it in one or two steps gives a blurred,
over-bright blob instead, which is the gap few-step distillation has to close (figures:
docs/benchmarks.md, "Trained tiny teacher"). It is still a stock diffusers Wan 2.1 folder
(`WanPipeline.from_pretrained(folder)`); only the transformer is trained.

The world it learns (the prompt grammar, the latent each prompt names, the jittered training
samples) is `teacher.world`; this module builds, trains and saves the teacher.

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
import shutil
from collections.abc import Iterator, Mapping
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
    TRANSFORMER_CONFIG,
    build_components,
    check_target,
    derived_seed,
    write_teacher,
)
from wandistill.teacher.world import (
    COLOURS,
    POSITIONS,
    SHAPES,
    SIZES,
    TRAINED_SAMPLER,
    _grammar,
    _training_batch,
)

__all__ = [
    "TRAINED_TRANSFORMER_CONFIG",
    "BuildSettings",
    "build_trained_pipeline",
    "ensure_trained_teacher",
    "make_trained_teacher",
]


#: Wan's DiT, 2 blocks of width 128 (4 heads x 32): a 16x2x2 patch is 64 numbers, and a width
#: of 64 could not carry the noise through to the output (samples stayed speckled). One
#: optimiser step at batch 64 costs ~80 ms of one CPU core. The rest is the tiny teacher's.
TRAINED_TRANSFORMER_CONFIG: Mapping[str, Any] = MappingProxyType(
    {**TRANSFORMER_CONFIG, "num_attention_heads": 4, "attention_head_dim": 32, "ffn_dim": 256}
)


#: Grammar words the tiny tokenizer lacks; as whole-word pieces each word is one token, which the
#: transformer picks out of the text far sooner than a spelled-out word.
_EXTRA_WORDS: tuple[str, ...] = (*SHAPES, "top", "bottom", "left", "right")
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
    blocks: int = 2
    """Transformer blocks. The demo's 2 keep it within its time; benches that need a student of
    half the teacher's depth to be more than one block build 4 (docs/benchmarks.md)."""

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch_size < 1 or not 1 <= self.blocks <= 16:
            raise UsageError(
                f"trained teacher steps={self.steps}, batch_size={self.batch_size} and "
                f"blocks={self.blocks} must be >= 1 (blocks at most 16)",
                fix="pass positive numbers",
            )

    def transformer_config(self) -> dict[str, Any]:
        """TRAINED_TRANSFORMER_CONFIG with this build's number of blocks."""
        return {**TRAINED_TRANSFORMER_CONFIG, "num_layers": self.blocks}

    def digest(self) -> str:
        """Names a cached build: these settings, the grammar, the configs, the recipe version."""
        blob = json.dumps(
            {
                # blocks lives in the transformer config: the default build keeps its digest
                "settings": {k: v for k, v in dataclasses.asdict(self).items() if k != "blocks"},
                "grammar": [dict(COLOURS), SHAPES, dict(SIZES), dict(POSITIONS)],
                "transformer": self.transformer_config(),
                "text_encoder": dict(TEXT_ENCODER_CONFIG),
                "scheduler": dict(SCHEDULER_CONFIG),
                "sampler": dict(TRAINED_SAMPLER),
                "recipe": _RECIPE_VERSION,
            },
            sort_keys=True,
        )
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


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
        model = WanTransformer3DModel(**settings.transformer_config())
        components["transformer"] = model
        pipe = WanPipeline(**components)
        loss = _train(model, pipe, settings, progress)  # leaves the model in eval mode
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


def _settings(seed: int, steps: int | None, blocks: int = 2) -> BuildSettings:
    """The default recipe with this seed, these blocks and, where given, this number of steps."""
    given = {} if steps is None else {"steps": steps}
    return BuildSettings(seed=seed, blocks=blocks, **given)


def make_trained_teacher(
    path: str | Path,
    *,
    seed: int = 0,
    steps: int | None = None,
    blocks: int = 2,
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
    settings = _settings(seed, steps, blocks)
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
    blocks: int = 2,
    progress: bool = True,
) -> Path:
    """The trained teacher for these settings under `root/teachers/`, trained on first use.

    The folder is named by `BuildSettings.digest()`, so other settings never reuse a stale build.
    A file lock makes concurrent callers (demo and benchmark started together) train it once;
    temp folders that an interrupted build left behind are removed under that lock.
    """
    folder = (
        Path(root).absolute() / "teachers" / f"trained-{_settings(seed, steps, blocks).digest()}"
    )
    if (folder / "model_index.json").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(folder):
        if (folder / "model_index.json").is_file():  # another process built it meanwhile
            return folder
        for stale in folder.parent.glob(f".{folder.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        try:
            return make_trained_teacher(
                folder, seed=seed, steps=steps, blocks=blocks, progress=progress
            )
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
