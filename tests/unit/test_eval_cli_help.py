"""The help of eval, sample, export and demo: every option says its default and what it takes."""

from __future__ import annotations

from typing import Any

import pytest
import typer

from wandistill.cli import app

COMMANDS = ("eval", "sample", "export", "demo")


def _options(name: str) -> list[Any]:
    """The command's options (typer's click objects; typer may vendor its own click)."""
    command = typer.main.get_command(app).commands[name]  # type: ignore[attr-defined]
    return [p for p in command.params if p.param_type_name == "option" and p.name != "help"]


@pytest.mark.parametrize("name", COMMANDS)
def test_every_option_states_its_default_and_booleans_have_a_no_form(name: str) -> None:
    for opt in _options(name):
        text = (opt.help or "").lower()
        assert len(text) > 20, f"{name} {opt.opts[0]}: help too short to say when to pick it"
        if opt.is_bool_flag:
            assert opt.secondary_opts, f"{name} {opt.opts[0]} needs a --no- form"
        if opt.required or opt.multiple:  # repeatable (--set): none unless given
            continue
        shown = opt.default is not None and opt.show_default is not False
        chooser = "one of --run, --export, --student" in text  # the student: named by one
        assert shown or chooser or "default" in text, f"{name} {opt.opts[0]}: default not stated"


def test_sample_sizes_default_to_what_is_sampled_not_to_fixed_numbers() -> None:
    by = {o.name: o for o in _options("sample")}
    for size in ("height", "width", "num_frames", "max_sequence_length", "steps"):
        assert by[size].default is None, size
        assert "student" in (by[size].help or ""), size
