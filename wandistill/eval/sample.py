"""`wandistill sample`: images from prompts through WanPipeline, exactly as a user would get them.

- `--export DIR`: `WanPipeline.from_pretrained(DIR)` (through `modelfolder.load_pretrained`, after
  the folder passed the same checks as a teacher folder), called with the student's K steps and
  guidance 1.0: the user's own code.
- `--run RUN` / `--student RUN/student` + `--teacher T`: the same pipeline built in memory, which is
  what `wandistill export` would write: the teacher's tokenizer, text encoder and VAE (checked to be
  the ones the run's cache was made with), the student for every step (per-expert students:
  both, switched at their boundary_ratio) and its K-step scheduler.
- only `--teacher T`: the teacher's own pipeline with CFG, for comparison.

Defaults come from what is being sampled: a student samples with its K and the height, width,
frames and max_sequence_length of the cache it was distilled from (recorded in sampling.json and
the export's marker); the teacher with `--cache`'s settings, else WanPipeline's own defaults.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from wandistill.errors import UsageError
from wandistill.io import outputs
from wandistill.placement.strategies import Cpu, Cuda, Placement
from wandistill.student.experts import pipeline_parts
from wandistill.student.folders import FinishedStudent, SamplerSizes
from wandistill.teacher.decode import save_png
from wandistill.teacher.folder import TeacherFolder


@dataclass(frozen=True, slots=True)
class SampleOptions:
    """The flags; None: the default of what is sampled (see the module docstring)."""

    steps: int | None = None
    guidance_scale: float | None = None
    height: int | None = None
    width: int | None = None
    num_frames: int | None = None
    max_sequence_length: int | None = None
    seed: int = 0


def sample(
    prompts: list[str],
    out_dir: str | Path,
    *,
    student: FinishedStudent | None = None,
    teacher: TeacherFolder | None = None,
    sizes: SamplerSizes | None = None,
    teacher_steps: int | None = None,
    options: SampleOptions | None = None,
    device: Placement | None = None,
) -> list[Path]:
    """Write `<out>/<i>.png` per prompt and `<out>/grid.png`; returns the PNG paths.

    `sizes` / `teacher_steps`: the teacher's defaults (a cache's settings), when no student.
    `device` (`--device`): where the text encoder, VAE and denoiser run, loaded through the
    same placement objects precompute uses (auto: a GPU if they fit one, else the CPU)."""
    opts = options or SampleOptions()
    pipe, call = _pipeline(student, teacher, opts, sizes, teacher_steps, device)
    pipe.set_progress_bar_config(disable=True)
    inputs = {"--teacher": teacher.path if teacher else None}
    if student is not None:
        inputs[student.flag] = student.path
    with outputs.claim(out_dir, "sample", inputs=inputs) as claimed:
        return _sample_into(pipe, prompts, claimed.path, call, opts.seed)


def _pipeline(
    student: FinishedStudent | None,
    teacher: TeacherFolder | None,
    opts: SampleOptions,
    sizes: SamplerSizes | None,
    teacher_steps: int | None,
    device: Placement | None,
) -> tuple[Any, dict[str, Any]]:
    """The pipeline to call (on `device`) and the call's arguments."""
    from diffusers import WanPipeline

    from wandistill.io.modelfolder import load_pretrained

    if student is not None:
        call = _student_call(student, opts)
        if student.kind == "export":
            if teacher is not None:
                raise UsageError(
                    "--export and --teacher both given; an export brings its own text encoder "
                    "and VAE",
                    fix="leave --teacher out",
                )
            folder = TeacherFolder.open(student.path)  # the teacher-folder checks, typed configs
            placement = _placement(device, folder, call)
            pipe = load_pretrained(WanPipeline, student.path).to(placement.execution_device())
        else:
            folder = _need_teacher(teacher, student)
            placement = _placement(device, folder, call)
            pipe = _run_pipeline(student, folder, placement)
    else:
        folder = _need_teacher(teacher, None)
        call = _teacher_call(opts, sizes, teacher_steps)
        placement = _placement(device, folder, call)
        pipe = _teacher_pipeline(folder, placement)
    return pipe, call


# --------------------------------------------------------------------------- call arguments


_SIZES = ("height", "width", "num_frames", "max_sequence_length")


def _given(source: Any, keys: tuple[str, ...] = _SIZES) -> dict[str, Any]:
    """The `keys` that `source` sets (None: not given; no source: none of them)."""
    values = {k: getattr(source, k) for k in keys} if source is not None else {}
    return {k: v for k, v in values.items() if v is not None}


def _student_call(student: FinishedStudent, opts: SampleOptions) -> dict[str, Any]:
    """K steps (fewer if asked, never more), guidance 1.0, the cache's sizes."""
    if opts.guidance_scale is not None and opts.guidance_scale != 1.0:
        raise UsageError(
            f"--guidance-scale {opts.guidance_scale}: a student learned the guided output and "
            "samples with guidance 1.0 (one forward per step)",
            fix="leave --guidance-scale out when sampling a student",
        )
    steps = student.check_steps(opts.steps)
    return (
        {"num_inference_steps": steps, "guidance_scale": 1.0} | _given(student.sizes) | _given(opts)
    )


def _teacher_call(
    opts: SampleOptions, sizes: SamplerSizes | None, steps: int | None
) -> dict[str, Any]:
    """The flags over the cache's settings over WanPipeline's defaults (left out here)."""
    call = {} if sizes is None else _given(sizes) | {"guidance_scale": sizes.teacher_guidance_scale}
    if (n := opts.steps if opts.steps is not None else steps) is not None:
        call["num_inference_steps"] = n  # --steps, else the cache's or recipe's N
    return call | _given(opts, ("guidance_scale", *_SIZES))


# --------------------------------------------------------------------------- pipelines


def _need_teacher(teacher: TeacherFolder | None, student: FinishedStudent | None) -> TeacherFolder:
    if teacher is not None:
        return teacher
    if student is None:
        raise UsageError(
            "nothing to sample: no student and no teacher",
            fix="pass --export DIR, or --run RUN with --teacher TEACHER, or --teacher alone",
        )
    raise UsageError(
        f"{student.label} needs --teacher for the tokenizer, text encoder and VAE",
        fix="pass --teacher (the run's teacher), or sample an export with --export DIR",
    )


def _placement(device: Placement | None, folder: TeacherFolder, call: dict[str, Any]) -> Placement:
    """`--device` made concrete for the pipeline at the call's sizes: Cuda or Cpu (auto: a GPU
    if the pipeline fits one)."""
    from wandistill.placement import load as pl
    from wandistill.placement.estimate import SamplerSizes as PlanSizes

    given = {k: int(call[k]) for k in _SIZES if k in call}  # the rest: WanPipeline's defaults
    sizes = PlanSizes(**given, cfg=float(call.get("guidance_scale", 5.0)) > 1.0, previews=True)
    return pl.resolve_placement(
        device or Cpu(), folder=folder, dtype=torch.float32, sizes=sizes, only=(Cuda, Cpu)
    )


def _run_pipeline(student: FinishedStudent, teacher: TeacherFolder, placement: Placement) -> Any:
    """What `wandistill export` would write, in memory."""
    from diffusers import WanPipeline

    from wandistill.student.export import check_teacher

    check_teacher(teacher, student)
    load = _loader(teacher, placement)
    return WanPipeline(
        tokenizer=teacher.load_tokenizer(),
        text_encoder=load("text_encoder"),
        vae=load("vae"),
        scheduler=student.schedule.make_scheduler(),
        expand_timesteps=teacher.expand_timesteps,
        **pipeline_parts(student.load().to(placement.execution_device())),
    )


def _teacher_pipeline(teacher: TeacherFolder, placement: Placement) -> Any:
    """The teacher's own WanPipeline (both experts and the boundary for Wan 2.2)."""
    from diffusers import WanPipeline

    load = _loader(teacher, placement)
    two = teacher.boundary_ratio is not None
    return WanPipeline(
        tokenizer=teacher.load_tokenizer(),
        text_encoder=load("text_encoder"),
        vae=load("vae"),
        scheduler=teacher.make_scheduler(),
        transformer=load("transformer"),
        transformer_2=load("transformer_2") if two else None,
        boundary_ratio=teacher.boundary_ratio,
        expand_timesteps=teacher.expand_timesteps,
    )


def _loader(teacher: TeacherFolder, placement: Placement) -> Any:
    """Components loaded like precompute loads them: safetensors only, fp32, with `placement`."""
    from wandistill.placement import load as pl

    return functools.partial(pl.load_component, teacher, dtype=torch.float32, placement=placement)


# --------------------------------------------------------------------------- output


def _sample_into(
    pipe: Any, prompts: list[str], out: Path, call: dict[str, Any], seed: int
) -> list[Path]:
    """One PNG per prompt (frame 0; prompt i draws its noise from seed + i) and a grid."""
    paths, images = [], []
    for i, prompt in enumerate(prompts):
        frames = pipe(
            prompt=prompt,
            generator=torch.Generator().manual_seed(seed + i),
            output_type="np",
            **call,
        ).frames[0]  # [F, H, W, 3] in [0, 1]
        image = Image.fromarray((np.asarray(frames[0]) * 255).round().astype(np.uint8))
        path = out / f"{i:04d}.png"
        save_png(image, path)
        paths.append(path)
        images.append(np.asarray(image))
    cols = min(4, len(images))  # rows of 4, the last one filled out in white
    tiles = images + [np.full_like(images[0], 255)] * (-len(images) % cols)
    rows = [np.hstack(tiles[i : i + cols]) for i in range(0, len(tiles), cols)]
    save_png(Image.fromarray(np.vstack(rows)), out / "grid.png")
    return paths
