"""`wandistill precompute`: run the teacher over a prompt list into a cache (and what a
recipe records, shown by --dry-run and plan)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape

from wandistill.cli.common import (
    DTYPES,
    PLACEMENT_HELP,
    DryRunOpt,
    RecipeArg,
    SetOpt,
    _flag_sets,
    app,
    choice,
    err,
    option,
    out,
)
from wandistill.errors import UsageError

if TYPE_CHECKING:
    from wandistill.config import Recipe


TeacherOpt = Annotated[
    str | None,
    option(
        help="Local diffusers Wan folder (model_index.json at its root).",
        path="--teacher",
        recipe="teacher.path",
    ),
]
PromptsOpt = Annotated[
    str | None,
    option(
        help='Prompt file: .txt (one per line) or .jsonl ({"prompt": ...} per line).',
        path="--prompts",
        recipe="prompts",
    ),
]
OutOpt = Annotated[
    str | None,
    option(
        "--out",
        help="Cache directory or fsspec URL (s3://bucket/prefix) to write; re-running resumes it.",
        path="--out",
        url=True,
        recipe="cache.path",
    ),
]
BackendOpt = Annotated[
    str | None,
    option(
        help="Cache format: webdataset (tar shards: stream from disk or object storage, copy "
        "with any tool) or zarr (v3 arrays: read one record or one field without its shard). "
        "Training reads both alike.",
        **choice("--backend", ("webdataset", "zarr")),
        recipe="cache.backend",
        fallback="webdataset",
    ),
]
PlacementOpt = Annotated[
    str | None, option(help=PLACEMENT_HELP, recipe="teacher.placement", fallback="auto")
]
DtypeOpt = Annotated[
    str | None,
    option(
        help="Teacher compute dtype: bf16 on recent GPUs (half the memory of fp32), fp16 on "
        "older ones, fp32 on CPU or to compare exactly.",
        **choice("--dtype", DTYPES),
        recipe="teacher.dtype",
        fallback="fp32",
    ),
]
PartOpt = Annotated[
    str | None,
    typer.Option(
        help="I/N: compute only part I (0-based) of N disjoint slices of the prompt list "
        "(batches I, I+N, ...) into OUT/part-IIIII-of-NNNNN, a cache of its own; re-run a part "
        "to resume it. Default: SLURM_ARRAY_TASK_ID - SLURM_ARRAY_TASK_MIN of "
        "SLURM_ARRAY_TASK_COUNT when set; --part wins over them; --part all: the whole list "
        "(see docs/distributed.md).",
        show_default="the whole list",
    ),
]


@app.command("precompute")
def precompute_cmd(
    recipe: RecipeArg = None,
    teacher: TeacherOpt = None,
    prompts: PromptsOpt = None,
    out_dir: OutOpt = None,
    backend: BackendOpt = None,
    placement: PlacementOpt = None,
    dtype: DtypeOpt = None,
    part: PartOpt = None,
    overrides: SetOpt = None,
    dry_run: DryRunOpt = False,
) -> None:
    """Run the teacher once over a prompt list and write a reusable cache."""
    from wandistill.config import load_recipe, to_dict
    from wandistill.precompute import parts

    flags = {
        "teacher.path": teacher,
        "prompts": prompts,
        "cache.path": out_dir,
        "cache.backend": backend,
        "teacher.placement": placement,
        "teacher.dtype": dtype,
    }
    full = load_recipe(recipe, [*(overrides or []), *_flag_sets(flags)], stage="precompute")
    job_part = parts.resolve(part, os.environ)
    if dry_run:
        out.print_json(json.dumps(to_dict(full.precompute)))
        _show_recording(full)
        return
    from wandistill.precompute.entry import launch

    s = launch(full.precompute, part=job_part)
    if s.is_main:  # one report and one summary for the whole job: other ranks stay quiet
        _print_prompt_report(s.cache)
        for line in s.lines():
            out.print(line, highlight=False, soft_wrap=True)


def _print_prompt_report(location: str) -> None:
    """What in the prompt file was skipped or cut (rank 0 wrote the report into the cache)."""
    from wandistill.io.storage import open_storage
    from wandistill.precompute.finish import REPORT_NAME
    from wandistill.precompute.prompts import PromptReport

    cache = open_storage(location)
    if cache.exists(REPORT_NAME):
        text = cache.read(REPORT_NAME, max_bytes=1 << 26, what="report", fix="", error=UsageError)
        for line in PromptReport(**json.loads(text)).summary():
            out.print(line, highlight=False)


def _show_recording(recipe: Recipe) -> None:
    """precompute --dry-run and plan: the steps the recipe records and, against them, the steps
    each of its train objectives would use (problems shown, not raised: nothing runs here)."""
    from wandistill.precompute.header import recorded_steps
    from wandistill.student.schedule import TeacherSchedule, plan_objectives
    from wandistill.teacher.folder import TeacherFolder

    cfg = recipe.precompute
    if not cfg.teacher.path or not Path(cfg.teacher.path).is_dir():
        out.print("(pass --teacher to place the recorded steps on the teacher's schedule)")
        return
    teacher = TeacherFolder.open(cfg.teacher.path, flow_shift=cfg.sampler.flow_shift)
    steps = recorded_steps(teacher, cfg)
    n = cfg.sampler.num_inference_steps
    out.print(f"precompute records {len(steps)} of {n} steps: {steps}", highlight=False)
    schedule = TeacherSchedule.from_scheduler(teacher.scheduler, n, steps, teacher.boundary_ratio)
    try:
        k = recipe.train.student.num_inference_steps
        plan = plan_objectives(recipe.train.loss, k, schedule)
    except UsageError as e:
        err.print(
            f"[yellow]train on this cache:[/yellow] {escape(e.message)}"
            + (f" (fix: {escape(e.fix)})" if e.fix else ""),
            highlight=False,
        )
        return
    for line in plan.describe():  # wrapped at the terminal's width, at word boundaries
        out.print(line, highlight=False)
