"""`wandistill demo`: a few-step student of a real (tiny) teacher, offline, in minutes on a CPU.

trained tiny teacher (trained once, then reused: `wandistill.teacher.trained`) -> prompts of its
grammar (written if absent) -> precompute with the teacher's N = 16 steps and CFG (skips what the
cache has) -> train a K = 4 student with the recipe's objective (perflow; resumes from the latest
checkpoint) -> train a step-imitating baseline with the same student and budget ->
`wandistill eval` on the held-out prompts: student@4 beside teacher@4 and baseline@4/@16, R_4 ->
a table, `grid.png` (noise | teacher@16 | teacher@4 | student@4 | baseline@4 | baseline@16),
`loss.png` (per loss term) and `metrics.png` (the eval's figures) under the demo folder.
Re-running reuses it all. Every value is the recipe's (`pipelines/tiny-fewstep.toml`); `--set`
overrides them.
"""

from __future__ import annotations

import functools
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from wandistill import plots
from wandistill.config import LossConfig, TrainConfig, load_recipe
from wandistill.eval.result import EvalResult

PROMPTS = 240
"""Prompts drawn from the trained teacher's grammar (every one of them, shuffled; a test checks
that this is the grammar's size)."""
TEACHER_SEED = 0


@dataclass(slots=True)
class DemoResult:
    root: Path
    teacher: Path
    eval: EvalResult
    grid: Path
    loss_plot: Path
    metrics_plot: Path
    seconds: dict[str, float] = field(default_factory=dict)
    """Wall time of each stage."""


def write_prompts(path: Path, n: int = PROMPTS) -> None:
    """`n` prompts of the trained teacher's grammar, one per line, deterministic."""
    if path.exists():  # given (--set precompute.prompts=...) or written by an earlier run
        return
    from wandistill.teacher.world import synthetic_prompts

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(synthetic_prompts(n, seed=0)) + "\n")


def baseline_config(train: TrainConfig, out: Path) -> TrainConfig:
    """The step-imitating baseline: the same student, data and budget, trained to match the
    teacher's guided output at every recorded step and sampled with the teacher's own scheduler
    (K unset = N)."""
    student = replace(train.student, num_inference_steps=None)
    return replace(train, out=str(out), student=student, loss=LossConfig(output=1.0))


def run_demo(
    root: str | Path = "cache/demo",
    recipe: str | Path = "tiny-fewstep",
    overrides: list[str] | None = None,
    baseline: bool = True,
    teacher: str | Path | None = None,
) -> DemoResult:
    """`teacher`: a Wan teacher folder to use instead of the trained tiny one (tests pass a
    random tiny teacher to skip the minute of teacher training)."""
    from wandistill.eval.run import evaluate
    from wandistill.precompute.run import run as precompute
    from wandistill.student.folders import read_run
    from wandistill.teacher.folder import TeacherFolder

    root = Path(root)
    seconds: dict[str, float] = {}
    clock = time.perf_counter()

    def lap(stage: str) -> None:
        nonlocal clock
        seconds[stage] = time.perf_counter() - clock
        clock = time.perf_counter()

    say = functools.partial(print, flush=True)  # a line per stage, before it (80 columns)
    load_recipe(recipe, overrides)  # a bad recipe or --set fails before a minute of teacher
    say(
        "demo 1/5 teacher: the trained tiny teacher (built once, about a minute)"
        if teacher is None
        else f"demo 1/5 teacher: {short_path(teacher)}"
    )
    if teacher is None:
        from wandistill.teacher.trained import ensure_trained_teacher

        teacher = ensure_trained_teacher(root, seed=TEACHER_SEED, progress=True)
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
    n = cfg.precompute.sampler.num_inference_steps
    say(f"demo 2/5 cache: the teacher's {n}-step samples of each prompt (reused if there)")
    precompute(cfg.precompute)
    lap("precompute")
    k = cfg.train.student.num_inference_steps
    runs = {"student": cfg.train}
    if baseline:
        runs["baseline"] = baseline_config(cfg.train, root / "baseline")
    lines = {
        "student": f"demo 3/5 student: a {k}-step student, {cfg.train.steps} steps (resumed if "
        "there)",
        "baseline": f"demo 4/5 baseline: a step-imitating student, {cfg.train.steps} steps",
    }
    for name, train_cfg in runs.items():
        say(lines[name])
        _train(train_cfg)
        lap(f"train {name}")
    say("demo 5/5 eval: student, teacher and baseline on the held-out prompts")
    base = read_run(root / "baseline", flag="--baseline") if baseline else None
    run, folder = read_run(root / "run"), TeacherFolder.open(teacher)
    ev = evaluate(cfg.train.cache, run, root / "eval", teacher=folder, baseline=base)
    lap("eval")
    grid = root / "grid.png"
    shutil.copyfile(root / "eval" / "grid.png", grid)
    plot = plots.plot_loss(Path(cfg.train.out) / "metrics.jsonl", root / plots.LOSS_PNG)
    metrics = plots.plot_eval_metrics(root / "eval" / "eval.json", root / "metrics.png")
    return DemoResult(root, teacher, ev, grid, plot, metrics, seconds)


def short_path(path: str | Path) -> str:
    """A path as a person would type it here: relative to the cwd when it is under it."""
    p = Path(path).absolute()
    try:
        return str(p.relative_to(Path.cwd()))
    except ValueError:
        return str(p)


def _train(cfg: TrainConfig) -> None:
    """Train, resuming from the latest checkpoint a previous demo left."""
    from wandistill.runtime.failures import Stopped
    from wandistill.train import run as train

    try:
        train(cfg, resume=(Path(cfg.out) / "checkpoints" / "latest").exists())
    except Stopped as e:  # the demo resumes its runs itself: re-running it is the way on
        raise Stopped(e.signum, e.progress, e.info, "re-run the demo to resume") from None
