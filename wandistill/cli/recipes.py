"""`wandistill recipes [copy]`: list the shipped recipes and copy one out to edit."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from wandistill.cli.common import (
    _out_dir,
    out,
    recipes_app,
)
from wandistill.errors import UsageError
from wandistill.io.location import option as loc


@recipes_app.callback(invoke_without_command=True)
def recipes_list(ctx: typer.Context) -> None:
    """List the shipped recipes; pass a NAME wherever a command takes a RECIPE."""
    if ctx.invoked_subcommand is not None:
        return
    from wandistill.config import load_recipe, shipped_recipe_names

    table = Table(title="shipped recipes (`wandistill recipes copy NAME` to edit one)")
    table.add_column("name", no_wrap=True)  # whole, to copy into a command
    for col in ("description", "teacher", "placement"):
        table.add_column(col, overflow="fold")
    for name in shipped_recipe_names():
        r = load_recipe(name)
        t = r.precompute.teacher
        table.add_row(name, r.description, t.path, str(t.placement))
    out.print(table)


@recipes_app.command("copy")
def recipes_copy(
    name: Annotated[str, typer.Argument(help="Shipped recipe name (see `wandistill recipes`).")],
    dest: Annotated[
        Path | None,
        typer.Argument(
            help="File or folder to write (default: ./NAME.toml).", **loc("DEST", url=False)
        ),
    ] = None,
    force: Annotated[
        bool, typer.Option("--force/--no-force", help="Replace an existing DEST file.")
    ] = False,
) -> None:
    """Copy a shipped recipe out for editing; commands take the copy's path as their RECIPE."""
    from wandistill.config import shipped_recipe
    from wandistill.io.fsutil import atomic_write_bytes

    source = shipped_recipe(name)
    target = Path(f"{name}.toml") if dest is None else dest
    if target.is_dir():
        target = target / f"{name}.toml"
    if target.exists() and not force:
        raise UsageError(
            f"{str(target)!r} already exists; not overwritten",
            fix="pass --force to replace it, or choose another DEST",
        )
    _out_dir(target.parent, "DEST")
    target.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(target, source.read_bytes())
    out.print(f"wrote {target} (recipe {name!r}); run it with: wandistill precompute {target}")
