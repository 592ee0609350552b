"""`wandistill sample`: images from prompts with the student (or the teacher) in WanPipeline.

The student replaces `transformer` in the teacher's own pipeline (its UMT5 and VAE and scheduler),
with guidance off: it learned the guided output, so one forward per step suffices. For a Wan 2.2
teacher the student covers every step, so the second expert and the boundary are dropped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from wandistill import outputs
from wandistill.errors import UsageError
from wandistill.modelfolder import refuse_custom_code
from wandistill.placements import Cpu, Cuda, Placement
from wandistill.teacher.decode import save_png
from wandistill.teacher.folder import TeacherFolder


def sample(
    teacher: str | Path,
    prompts: list[str],
    out_dir: str | Path,
    *,
    student: str | Path | None = None,
    steps: int = 8,
    guidance_scale: float = 5.0,
    height: int = 32,
    width: int = 32,
    num_frames: int = 1,
    max_sequence_length: int = 512,
    seed: int = 0,
    device: Placement | None = None,
) -> list[Path]:
    """Write `<out>/<i>.png` per prompt and `<out>/grid.png`; returns the PNG paths.

    `device` (`--device`): where the text encoder, VAE and denoiser run, loaded through the
    same placement objects precompute uses (auto: a GPU if they fit one, else the CPU)."""
    from wandistill.eval.run import load_student
    from wandistill.teacher import placement as pl
    from wandistill.teacher.plan import SamplerSizes

    folder = TeacherFolder.open(teacher)
    sizes = SamplerSizes(height, width, num_frames, 1, max_sequence_length, previews=True)
    placement = pl.resolve_placement(
        device or Cpu(), folder=folder, dtype=torch.float32, sizes=sizes, only=(Cuda, Cpu)
    )
    model = None
    if student is not None:
        if not Path(student).is_dir():
            raise UsageError(
                f"student {str(student)!r} does not exist",
                fix="pass <out>/student from `wandistill train`",
            )
        refuse_custom_code(student, "student")
        model = load_student(student).to(placement.execution_device())
        guidance_scale = 1.0
    pipe = _pipeline(folder, model, placement)
    pipe.set_progress_bar_config(disable=True)
    call = dict(
        height=height,
        width=width,
        num_frames=num_frames,
        num_inference_steps=steps,
        guidance_scale=guidance_scale,
        max_sequence_length=max_sequence_length,
    )
    inputs = {"--teacher": teacher, "--student": student}
    with outputs.claim(out_dir, "sample", inputs=inputs) as folder:
        return _sample_into(pipe, prompts, folder.path, call, seed)


def _sample_into(
    pipe: Any, prompts: list[str], out: Path, call: dict[str, Any], seed: int
) -> list[Path]:
    """One PNG per prompt and the grid, written into the claimed folder."""
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
    cols = min(4, len(images))
    rows = -(-len(images) // cols)
    h, w = images[0].shape[:2]
    grid = np.full((rows * h, cols * w, 3), 255, np.uint8)
    for i, img in enumerate(images):
        r, c = divmod(i, cols)
        grid[r * h : (r + 1) * h, c * w : (c + 1) * w] = img
    save_png(Image.fromarray(grid), out / "grid.png")
    return paths


def _pipeline(folder: TeacherFolder, student: torch.nn.Module | None, placement: Placement) -> Any:
    """WanPipeline from the folder's parts, loaded like precompute loads them (safetensors only,
    fp32, with `placement`). A student replaces both experts, so no boundary."""
    from diffusers import WanPipeline

    from wandistill.teacher import placement as pl

    def load(name: str) -> torch.nn.Module:
        return pl.load_component(folder, name, dtype=torch.float32, placement=placement)

    two = student is None and folder.boundary_ratio is not None
    return WanPipeline(
        tokenizer=folder.load_tokenizer(),
        text_encoder=load("text_encoder"),
        vae=load("vae"),
        scheduler=folder.make_scheduler(),
        transformer=student if student is not None else load("transformer"),
        transformer_2=load("transformer_2") if two else None,
        boundary_ratio=folder.boundary_ratio if two else None,
        expand_timesteps=folder.expand_timesteps,
    )
