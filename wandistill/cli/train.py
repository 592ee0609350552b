"""`wandistill train` and `wandistill launch` (train or precompute under torchrun)."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Annotated

import typer

from wandistill.cli.common import (
    DryRunOpt,
    RecipeArg,
    SetOpt,
    _flag_sets,
    _out_dir,
    app,
    err,
    option,
    out,
)
from wandistill.errors import UsageError

if TYPE_CHECKING:
    from wandistill.config import TrainConfig


CacheOpt = Annotated[
    list[str] | None,
    option(
        help="Cache directory or fsspec URL (precompute --out). Repeat it to train on several "
        "caches of one teacher and settings as one dataset (weights: --set "
        "'train.cache_weights=[2, 1]').",
        recipe="cache",
        path="--cache",
        url=True,
    ),
]
OutOpt = Annotated[
    str | None,
    option(
        "--out",
        help="Run directory to write (run.json, metrics.jsonl, loss.png, checkpoints/, "
        "student/); a local (or mounted) folder.",
        path="--out",
        recipe="out",
    ),
]
StepsOpt = Annotated[
    int | None,
    option(
        help="Total optimizer steps of the run: --resume trains up to it, not that many more "
        "(at 100 steps, --steps 150 --resume trains 50).",
        recipe="steps",
    ),
]
ResumeOpt = Annotated[
    bool,
    typer.Option(
        "--resume/--no-resume",
        help="Continue from the newest checkpoint in --out up to --steps in total (after a "
        "crash, a stop or to train longer: raise --steps); without it a run folder with "
        "checkpoints is refused.",
    ),
]
FollowOpt = Annotated[
    bool,
    typer.Option(
        "--follow/--no-follow",
        help="Train on a cache precompute is still writing, waiting for new shards until it is "
        "complete (it stops, saying so, if nothing writes the cache any more); without it an "
        "incomplete cache is trained on as it stands, with a warning.",
    ),
]
SkipCorruptOpt = Annotated[
    bool,
    typer.Option(
        "--skip-corrupt/--no-skip-corrupt",
        help="Skip (and count) unreadable records instead of stopping at the first one; use it "
        "to finish a run on a damaged cache, then `cache verify` it.",
    ),
]
ParallelOpt = Annotated[
    str | None,
    option(
        help="ddp (each rank holds the whole student) or fsdp (FSDP2: the student, its "
        "gradients, optimizer state and EMA sharded over the ranks; sharded checkpoints).",
        recipe="parallel",
    ),
]


@app.command("train")
def train_cmd(
    recipe: RecipeArg = None,
    cache: CacheOpt = None,
    out_dir: OutOpt = None,
    steps: StepsOpt = None,
    resume: ResumeOpt = False,
    follow: FollowOpt = False,
    skip_corrupt: SkipCorruptOpt = False,
    parallel: ParallelOpt = None,
    overrides: SetOpt = None,
    dry_run: DryRunOpt = False,
) -> None:
    """Distil the cached teacher into a small student (alone or under torchrun)."""
    from wandistill.config import load_recipe

    listed = [str(c) for c in cache] if cache else None
    one_or_many = listed[0] if listed and len(listed) == 1 else listed  # several: a list
    flags = {"cache": one_or_many, "out": out_dir, "steps": steps, "parallel": parallel}
    sets = [*(overrides or []), *_flag_sets(flags)]
    cfg = load_recipe(recipe, sets, stage="train").train
    if cfg.out:
        _out_dir(cfg.out)
    if dry_run:
        _dry_run(cfg, recipe, sets)
        return
    from wandistill.train.entry import finished_at, launch

    if resume and cfg.out and (at := finished_at(cfg)) is not None:
        if os.environ.get("RANK", "0") == "0":
            out.print(
                f"train: already at {at} steps; pass --steps {at + max(cfg.steps, 1)} to "
                f"continue (--steps is the run's total, here {cfg.steps})",
                highlight=False,
            )
        return

    r = launch(cfg, resume=resume, follow=follow, skip_corrupt=skip_corrupt)
    if not r.is_main:
        return
    if r.corrupt:
        shards = sum(1 for line in r.corrupt if line.startswith("unusable shard"))
        err.print(
            f"--skip-corrupt: skipped {len(r.corrupt) - shards} corrupt sample read(s) and "
            f"{shards} unusable shard(s):",
            highlight=False,
        )
        for line in r.corrupt[:20]:
            err.print(f"  {line}", highlight=False)
    for line in r.lines():
        out.print(line, highlight=False, soft_wrap=True)


def _dry_run(cfg: TrainConfig, recipe: str | None, sets: list[str]) -> None:
    """train --dry-run: the resolved config, its memory plan and each objective's steps."""
    from wandistill.cli.plan import _plan_train  # plan registers after train
    from wandistill.config import to_dict

    out.print_json(json.dumps(to_dict(cfg)))
    try:
        _plan_train(recipe, None, None, sets, False, (None, None, None, None))
    except UsageError as e:  # the plan needs the student's sizes; the dry run goes on
        err.print(f"train memory plan: {e.message} ({e.fix})", highlight=False)
    if not cfg.cache:
        out.print("(pass --cache to see which recorded steps each objective trains at)")
        return
    from wandistill.cache.reader import CacheReader
    from wandistill.train.inputs import objective_plan

    with CacheReader(cfg.caches[0]) as store:
        plan = objective_plan(cfg, store.manifest.settings, store.read_shared())
    for line in plan.describe():
        out.print(line, highlight=False, soft_wrap=True)


@app.command(
    "launch",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    options_metavar="[TORCHRUN FLAGS] {precompute|train} [ARGS]...",
)
def launch_cmd(ctx: typer.Context) -> None:
    """Run precompute or train as a torchrun job, ending with a rank's own error, no traceback.

    `wandistill launch [TORCHRUN FLAGS] COMMAND ...` is `torchrun [TORCHRUN FLAGS] -m wandistill
    COMMAND ...` with the same flags (e.g. --standalone --nproc_per_node=2), except that a
    rank's refusal ends the job with that rank's one error line and exit code, without
    torchrun's ChildFailedError traceback."""
    from wandistill.runtime.launch import launch

    launch(ctx.args, verbose=bool(ctx.find_root().params.get("verbose")))
