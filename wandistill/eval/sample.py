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
from wandistill.config import refuse_custom_code
from wandistill.errors import UsageError
from wandistill.teacher.decode import save_png
from wandistill.weights import require_safetensors

TEACHER_WEIGHTS = ("text_encoder", "vae", "transformer", "transformer_2")


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
    device: str = "cpu",
) -> list[Path]:
    """Write `<out>/<i>.png` per prompt and `<out>/grid.png`; returns the PNG paths."""
    from diffusers import WanPipeline

    from wandistill.eval.run import load_student

    teacher = Path(teacher)
    if not (teacher / "model_index.json").is_file():
        raise UsageError(
            f"teacher {str(teacher)!r} is not a diffusers Wan folder",
            fix="pass the teacher folder the student was distilled from (for its UMT5 and VAE)",
        )
    refuse_custom_code(teacher)
    kwargs: dict[str, object] = {}
    if student is not None:
        if not Path(student).is_dir():
            raise UsageError(
                f"student {str(student)!r} does not exist",
                fix="pass <out>/student from `wandistill train`",
            )
        refuse_custom_code(student, "student")
        kwargs["transformer"] = load_student(student)
        kwargs["transformer_2"] = None
        guidance_scale = 1.0
    loaded = ("text_encoder", "vae") if student is not None else TEACHER_WEIGHTS
    require_safetensors(teacher, "teacher", tuple(c for c in loaded if (teacher / c).is_dir()))
    pipe = WanPipeline.from_pretrained(
        teacher, local_files_only=True, use_safetensors=True, **kwargs
    ).to(device)
    if student is not None:
        pipe.register_to_config(boundary_ratio=None)
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
