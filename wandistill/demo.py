"""`wandistill demo`: a few-step student of a real (tiny) teacher, offline, in minutes on a CPU.

trained tiny teacher (trained once, then reused: `wandistill.teacher.trained`) -> prompts of its
grammar (written if absent) -> precompute with the teacher's N = 16 steps and CFG (skips what the
cache has) -> train a K = 4 student with the trajectory and consistency objectives (resumes from
the latest checkpoint) -> train a step-imitating baseline with the same student and budget ->
`wandistill eval` on the held-out prompts: student@4 beside teacher@4 and baseline@4/@16, R_4 ->
a table, `grid.png` (noise | teacher@16 | teacher@4 | student@4 | baseline@4 | baseline@16) and
`loss.png` under the demo folder. Re-running reuses it all. Every value is the recipe's
(`pipelines/tiny-fewstep.toml`); `--set` overrides them.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from wandistill.config import LossConfig, TrainConfig, load_recipe
from wandistill.eval.run import EvalResult
from wandistill.teacher.decode import save_png

PROMPTS = 480
"""Prompts drawn from the trained teacher's grammar (every one of them, shuffled)."""
TEACHER_SEED = 0


@dataclass(slots=True)
class DemoResult:
    root: Path
    teacher: Path
    eval: EvalResult
    grid: Path
    loss_plot: Path
    seconds: dict[str, float] = field(default_factory=dict)
    """Wall time of each stage."""


def write_prompts(path: Path, n: int = PROMPTS) -> None:
    """`n` prompts of the trained teacher's grammar, one per line, deterministic."""
    if path.exists():  # given (--set precompute.prompts=...) or written by an earlier run
        return
    from wandistill.teacher.trained import synthetic_prompts

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(synthetic_prompts(n, seed=0)) + "\n")


def baseline_config(train: TrainConfig, out: Path) -> TrainConfig:
    """The step-imitating baseline: the same student, data and budget, trained to match the
    teacher's guided output at every recorded step and sampled with the teacher's own scheduler
    (K unset = N)."""
    student = replace(train.student, num_inference_steps=None)
    return replace(train, out=str(out), student=student, loss=LossConfig(output=1.0))


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
    recipe: str | Path = "tiny-fewstep",
    overrides: list[str] | None = None,
    quiet: bool = False,
    baseline: bool = True,
    teacher: str | Path | None = None,
) -> DemoResult:
    """`teacher`: a Wan teacher folder to use instead of the trained tiny one (tests pass a
    random tiny teacher to skip the minute of teacher training)."""
    from wandistill.precompute import run as precompute

    root = Path(root)
    seconds: dict[str, float] = {}
    clock = time.perf_counter()

    def lap(stage: str) -> None:
        nonlocal clock
        seconds[stage] = time.perf_counter() - clock
        clock = time.perf_counter()

    load_recipe(recipe, overrides)  # a bad recipe or --set fails before a minute of teacher
    if teacher is None:
        from wandistill.teacher.trained import ensure_trained_teacher

        teacher = ensure_trained_teacher(root, seed=TEACHER_SEED, progress=not quiet)
    teacher = Path(teacher).absolute()
    lap("teacher")
    paths = [
        f'precompute.teacher.path="{teacher}"',
        f'precompute.prompts="{root / "prompts.txt"}"',
        f'precompute.cache.path="{root / "cache"}"',
        f'train.cache="{root / "cache"}"',
        f'train.out="{root / "run"}"',
        f'train.student.init_from_teacher.path="{teacher}"',
    ]
    cfg = load_recipe(recipe, [*paths, *(overrides or [])])
    write_prompts(Path(cfg.precompute.prompts))
    precompute(cfg.precompute, quiet=quiet)
    lap("precompute")
    runs = {"student": cfg.train}
    if baseline:
        runs["baseline"] = baseline_config(cfg.train, root / "baseline")
    for name, train_cfg in runs.items():
        _train(train_cfg)
        lap(f"train {name}")
    ev = _evaluate(cfg.train.cache, root, teacher, baseline)
    lap("eval")
    grid = root / "grid.png"
    shutil.copyfile(root / "eval" / "grid.png", grid)
    plot = loss_plot(Path(cfg.train.out) / "metrics.jsonl", root / "loss.png")
    return DemoResult(
        root=root, teacher=teacher, eval=ev, grid=grid, loss_plot=plot, seconds=seconds
    )


def _train(cfg: TrainConfig) -> None:
    """Train, resuming from the latest checkpoint a previous demo left."""
    from wandistill.train import run as train

    train(cfg, resume=(Path(cfg.out) / "checkpoints" / "latest").exists())


def _evaluate(cache: str, root: Path, teacher: Path, baseline: bool) -> EvalResult:
    """student@K, teacher@K and (if trained) the baseline on the held-out prompts."""
    from wandistill.eval.run import evaluate
    from wandistill.student.folders import read_run
    from wandistill.teacher.folder import TeacherFolder

    base = read_run(root / "baseline", flag="--baseline") if baseline else None
    return evaluate(
        cache,
        read_run(root / "run"),
        root / "eval",
        teacher=TeacherFolder.open(teacher),
        baseline=base,
    )
