"""What every command shares: the typer apps, the consoles, the option shapes (recipe
overrides, --set, --dry-run, fixed choices) and the checks of output folders and numbers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from wandistill.errors import UsageError
from wandistill.io.location import option as loc

app = typer.Typer(
    name="wandistill",
    help="Distil Wan 2.1/2.2 video diffusion teachers into small students through a cache.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
teacher_app = typer.Typer(
    help="Teacher folders: build the tiny offline teachers.", no_args_is_help=True
)
cache_app = typer.Typer(help="Inspect and check caches.", no_args_is_help=True)
recipes_app = typer.Typer(
    help="List the recipes that ship with wandistill (any RECIPE takes their NAME); "
    "`recipes copy NAME` writes one out to edit."
)
app.add_typer(teacher_app, name="teacher")
app.add_typer(cache_app, name="cache")
app.add_typer(recipes_app, name="recipes")

out = Console()
err = Console(stderr=True)


def choice(flag: str, values: tuple[str, ...]) -> dict[str, Any]:
    """typer.Option arguments for a flag with a fixed set of values: --help shows them as
    [a|b], and a value outside them is one line naming the flag and the values (a wandistill
    UsageError), not click's usage box."""

    def parse(value: str) -> str:
        if value not in values:
            raise UsageError(
                f"{flag} {value!r} must be one of {', '.join(values)}",
                fix=f"pass {flag} {values[0]}",
            )
        return value

    return {"parser": parse, "metavar": f"[{'|'.join(values)}]"}


def option(
    *decls: str,
    help: str,
    path: str | None = None,
    url: bool = False,
    recipe: str | None = None,
    fallback: str | None = None,
    **rest: Any,
) -> Any:
    """A typer.Option in the shapes commands repeat: `path` names a location flag (parsed by
    io.location, never click's Path, and named in its errors; `url`: fsspec URLs too); `recipe`
    is the recipe key the flag overrides, which --help shows as its default (`fallback`: the
    value when the recipe leaves it out)."""
    if path is not None:
        rest.update(loc(path, url=url))
    if recipe is not None:
        rest["show_default"] = f"recipe's {recipe}" + (f", else {fallback}" if fallback else "")
    return typer.Option(*decls, help=help, **rest)


RecipeArg = Annotated[
    str | None,
    typer.Argument(
        help="A recipe: a path has a slash or ends in .toml (./my.toml); a name has "
        "neither and is a shipped recipe (tiny; `wandistill recipes`). Flags override it."
    ),
]
SetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        help="Override any recipe key: section.key=value, value in TOML (repeatable; applied "
        "before the flags above).",
        show_default="none",
    ),
]
DryRunOpt = Annotated[
    bool,
    typer.Option(
        "--dry-run/--no-dry-run", help="Print the resolved config and stop; nothing is written."
    ),
]


def _flag_sets(flags: dict[str, Any]) -> list[str]:
    """The flags given, as `--set key=value` overrides (a parsed location as its text)."""
    return [
        f"{k}={json.dumps(str(v) if isinstance(v, Path) else v)}"
        for k, v in flags.items()
        if v is not None
    ]


DTYPES = ("fp32", "fp16", "bf16")
PLACEMENT_HELP = (
    "Where the teacher's weights live: auto (the plan's pick: start here), cpu, cuda or cuda:N "
    "(fits one GPU: fastest), gpu0, balanced / balanced_low_0 / sequential (split over GPUs), "
    "model-offload / group-offload (GPU too small: weights in RAM), disk-offload (RAM too small "
    "too: slowest), or a device-map .json. `wandistill plan` shows what each needs; see "
    "docs/placement.md."
)


def _positive(**values: int | None) -> None:
    """Usage error for a numeric flag that must be positive (None: not given)."""
    for name, v in values.items():
        if v is not None and v <= 0:
            raise UsageError(f"--{name.replace('_', '-')} {v} must be positive")


def _out_dir(path: str | Path, flag: str = "--out") -> None:
    """An output directory that is (or is under) a file is a usage error, named as such."""
    from wandistill.io.storage import is_url

    if is_url(path):
        return  # an object-store prefix: `outputs.claim_remote` checks it
    blocker = next(
        (p for p in (Path(path), *Path(path).parents) if p.exists() and not p.is_dir()), None
    )
    if blocker is not None:
        raise UsageError(
            f"{flag} {str(path)!r} cannot be a directory: {str(blocker)!r} is a file",
            fix=f"choose another {flag} directory",
        )
