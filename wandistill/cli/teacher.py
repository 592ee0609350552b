"""`wandistill teacher make-tiny | make-trained`: build the tiny offline teachers."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import typer

from wandistill.cli.common import (
    _positive,
    out,
    teacher_app,
)
from wandistill.errors import UsageError
from wandistill.io.location import option as loc

FolderArg = Annotated[
    Path, typer.Argument(help="Folder to create (diffusers layout).", **loc("PATH", url=False))
]


@teacher_app.command("make-tiny")
def teacher_make_tiny(
    path: FolderArg,
    wan22: Annotated[
        bool,
        typer.Option(
            "--wan22/--no-wan22",
            help="Wan 2.2 A14B layout (two experts + boundary_ratio) to test the two-expert "
            "path; the default is the one-transformer Wan 2.1 layout.",
        ),
    ] = False,
    seed: Annotated[
        int, typer.Option(help="Seed of the random weights; same seed, same bytes.")
    ] = 0,
    overwrite: Annotated[
        bool,
        typer.Option(
            "--overwrite/--no-overwrite", help="Replace an existing tiny teacher at PATH."
        ),
    ] = False,
) -> None:
    """Write a tiny random-weight Wan teacher that WanPipeline loads and runs on CPU."""
    from wandistill.teacher.tiny import make_tiny_teacher

    with _teacher_target(path, seed):
        made = make_tiny_teacher(path, wan22=wan22, seed=seed, overwrite=overwrite)
    out.print(f"wrote tiny {'Wan 2.2 A14B' if wan22 else 'Wan 2.1'} teacher to {made}")


@teacher_app.command("make-trained")
def teacher_make_trained(
    path: FolderArg,
    seed: Annotated[
        int,
        typer.Option(
            help="Seed of the weights, the synthetic data and the training; same seed, same "
            "bytes (on the same torch build and CPU)."
        ),
    ] = 0,
    steps: Annotated[
        int | None,
        typer.Option(
            help="Optimiser steps (default: the recipe's 800, about 70 s of one core); "
            "fewer for tests."
        ),
    ] = None,
    overwrite: Annotated[
        bool,
        typer.Option(
            "--overwrite/--no-overwrite", help="Replace an existing trained teacher at PATH."
        ),
    ] = False,
) -> None:
    """Train a tiny Wan teacher on coloured shapes, ~70 s on a CPU (the demo's teacher).

    Prompts like "a red circle at the top" give matching patterns: its samples have structure
    and few-step sampling visibly degrades."""
    from wandistill.teacher.trained import make_trained_teacher

    with _teacher_target(path, seed, steps):
        made = make_trained_teacher(path, seed=seed, steps=steps, overwrite=overwrite)
    out.print(f"wrote trained tiny Wan 2.1 teacher to {made}")


@contextlib.contextmanager
def _teacher_target(path: Path, seed: int, steps: int | None = None) -> Iterator[None]:
    """One line for a bad --seed or --steps, a PATH under a file or an existing folder, for
    every teacher builder."""
    from wandistill.checks.bounds import SEED, flag_problem

    if (problem := flag_problem("--seed", seed, SEED)) is not None:
        raise UsageError(problem)
    _positive(steps=steps)
    blocker = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise UsageError(
            f"cannot create teacher folder {str(path)!r}: {str(blocker)!r} is a file",
            fix="choose another PATH",
        )
    from wandistill.teacher.tiny import NotATeacherError

    try:
        yield
    except NotATeacherError as e:
        raise UsageError(str(e), fix="choose another PATH") from None
    except FileExistsError as e:
        raise UsageError(str(e), fix="pass --overwrite, or choose another PATH") from None
