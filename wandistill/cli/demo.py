"""`wandistill demo`: the whole job on a tiny teacher, offline."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from wandistill.cli.common import SetOpt, app, option, out


@app.command("demo")
def demo_cmd(
    root: Annotated[
        Path,
        option(
            help="Folder for everything the demo makes (relative: to the cwd); a re-run reuses "
            "what is there.",
            path="--root",
        ),
    ] = Path("cache/demo"),
    recipe: Annotated[
        str,
        typer.Option(
            help="Recipe: a path (a slash or .toml) or a shipped name (`wandistill recipes`); "
            "its paths are set under "
            "--root. tiny-fewstep: a 4-step student of the trained tiny teacher."
        ),
    ] = "tiny-fewstep",
    overrides: SetOpt = None,
    baseline: Annotated[
        bool,
        typer.Option(
            "--baseline/--no-baseline",
            help="Also train a step-imitating student for the baseline columns (--no-baseline: "
            "about half the training time).",
        ),
    ] = True,
    teacher: Annotated[
        Path | None,
        option(
            help="A Wan teacher folder to distil instead. Default: the trained tiny teacher, "
            "built under --root on first use (about a minute).",
            path="--teacher",
        ),
    ] = None,
) -> None:
    """The whole job on a tiny teacher, offline: cache, a 4-step student, its evaluation.

    Trained tiny teacher -> precompute (16 steps, CFG) -> a 4-step student -> eval against the
    teacher at 4 steps; prints the table, writes grid.png, loss.png and metrics.png."""
    from wandistill.demo import run_demo, short_path

    result = run_demo(root, recipe, overrides, baseline=baseline, teacher=teacher)
    out.print()
    out.print(result.eval.console_table(), highlight=False)
    from wandistill.runtime.progress import summary_lines

    total = sum(result.seconds.values())
    stages = [f"{k} {v:.0f} s" for k, v in result.seconds.items()]
    stages = [*(f"{x}," for x in stages[:-1]), *stages[-1:]]
    lines = [
        "",
        *summary_lines(["wall time:", *stages, f"({total:.0f} s in all)"]),
        f"grid ({' | '.join(c.name for c in result.eval.columns)}):",
        f"  {result.grid}",
        f"loss curve: {result.loss_plot}",
        f"metrics: {result.metrics_plot}",
        "export it:",
        f"  wandistill export --run {short_path(result.root / 'run')} \\",
        f"    --teacher {short_path(result.teacher)} \\",
        f"    --out {short_path(result.root / 'pipeline')}",
    ]
    for line in lines:
        out.print(line, highlight=False, soft_wrap=True)
