"""`wandistill demo`: the whole job on the embedded tiny teacher, offline, in minutes on a CPU.

teacher (built if absent) -> prompts (written if absent) -> precompute (skips what the cache
has) -> train (resumes from the latest checkpoint) -> eval on the held-out prompts -> a table,
`grid.png` (teacher | student) and `loss.png` under the demo folder. Re-running reuses it all.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from wandistill.config import load_recipe
from wandistill.eval.run import EvalResult
from wandistill.teacher.decode import save_png

SUBJECTS = [
    "a cat",
    "a dog",
    "a red car",
    "an old man",
    "a small boat",
    "a horse",
    "a robot",
    "a child",
]
PLACES = [
    "on a beach at sunset",
    "in a snowy forest",
    "on a busy city street",
    "in a quiet library",
    "under a bright blue sky",
    "next to a river",
    "in the rain",
    "on a mountain top",
]


@dataclass(slots=True)
class DemoResult:
    root: Path
    eval: EvalResult
    grid: Path
    loss_plot: Path


def write_prompts(path: Path) -> None:
    """64 varied prompts (8 subjects x 8 places), one per line, deterministic."""
    if path.exists():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(f"{s} {p}" for s in SUBJECTS for p in PLACES) + "\n")


def loss_plot(metrics: Path, out: Path, size: tuple[int, int] = (480, 240)) -> Path:
    """A plain line plot of training loss per step (PIL only: no plotting dependency)."""
    rows: dict[int, float] = {}
    for line in metrics.read_text().splitlines():
        row = json.loads(line)
        if "loss" in row and "step" in row:
            rows[int(row["step"])] = float(row["loss"])  # a resumed run may repeat steps
    w, h = size
    img = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(img)
    pad = 36
    draw.rectangle([pad, 8, w - 8, h - pad], outline="black")
    if len(rows) >= 2:
        steps = np.array(sorted(rows))
        loss = np.log10(np.maximum([rows[s] for s in steps], 1e-12))
        x = pad + (steps - steps.min()) / max(steps.max() - steps.min(), 1) * (w - pad - 8)
        y = 8 + (loss.max() - loss) / max(loss.max() - loss.min(), 1e-9) * (h - pad - 8)
        draw.line(list(zip(x.tolist(), y.tolist(), strict=True)), fill=(200, 30, 30), width=2)
        draw.text(
            (pad + 4, 10),
            f"loss {rows[int(steps[0])]:.3g} -> {rows[int(steps[-1])]:.3g}",
            fill="black",
        )
        draw.text((pad, h - pad + 4), f"step {steps.min()}", fill="black")
        draw.text((w - 80, h - pad + 4), f"step {steps.max()}", fill="black")
    draw.text((4, h // 2), "log", fill="black")
    save_png(img, out)
    return out


def run_demo(
    root: str | Path = "cache/demo",
    recipe: str | Path = "tiny",
    overrides: list[str] | None = None,
    quiet: bool = False,
) -> DemoResult:
    from wandistill.eval.run import evaluate
    from wandistill.precompute import run as precompute
    from wandistill.teacher.tiny import make_tiny_teacher
    from wandistill.train import run as train

    root = Path(root)
    paths = [
        f'precompute.teacher.path="{root / "teacher"}"',
        f'precompute.prompts="{root / "prompts.txt"}"',
        f'precompute.cache.path="{root / "cache"}"',
        f'train.cache="{root / "cache"}"',
        f'train.out="{root / "run"}"',
    ]
    cfg = load_recipe(recipe, [*paths, *(overrides or [])])
    teacher = Path(cfg.precompute.teacher.path)
    if not (teacher / "model_index.json").is_file():
        make_tiny_teacher(teacher)
    write_prompts(Path(cfg.precompute.prompts))
    precompute(cfg.precompute, quiet=quiet)
    resume = (Path(cfg.train.out) / "checkpoints" / "latest").exists()
    result = train(cfg.train, resume=resume)
    ev = evaluate(cfg.train.cache, result.student, root / "eval", teacher=teacher)
    grid = root / "grid.png"
    shutil.copyfile(root / "eval" / "grid.png", grid)
    plot = loss_plot(Path(cfg.train.out) / "metrics.jsonl", root / "loss.png")
    return DemoResult(root=root, eval=ev, grid=grid, loss_plot=plot)
