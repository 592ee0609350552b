"""Every command's --help documents every option: what it does, its default, its allowed values;
booleans can be switched both ways (`--resume/--no-resume`), so a script never needs a value."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer

from wandistill import cli
from wandistill.config import BACKENDS, DTYPES

from cachefixtures import write_cache


def _commands(command: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[str, Any]]:
    """(name, click command) of the app and every command under it. typer 0.29 builds on its
    own copy of click (typer._click), so the tree is walked by attribute, not by click class."""
    yield " ".join(path) or "wandistill", command
    for name, sub in getattr(command, "commands", {}).items():
        yield from _commands(sub, (*path, name))


COMMANDS = dict(_commands(typer.main.get_command(cli.app)))


def _is_action(param: Any) -> bool:
    """--help and --version act and exit; they are not settings to switch off."""
    return bool(param.is_eager and (param.expose_value is False or param.callback is not None))


def _shows_default(param: Any) -> bool:
    """--help states the default: click prints a non-None default (or a show_default text), or
    the help sentence says it, or there is none to state (required, a flag's off form)."""
    if param.required or param.is_flag or isinstance(param.show_default, str):
        return True
    if param.default is not None and param.show_default is not False:
        return True
    return "default" in (param.help or "").lower()


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_option_has_help_a_stated_default_and_booleans_have_a_no_form(name: str) -> None:
    command = COMMANDS[name]
    assert (command.help or "").strip(), f"{name}: no help"
    problems = []
    for param in command.params:
        label = f"{name} {param.opts[0] if param.opts else param.name}"
        if not (getattr(param, "help", None) or "").strip():
            problems.append(f"{label}: no help")
        if param.param_type_name != "option" or _is_action(param):
            continue
        if not _shows_default(param):
            problems.append(f"{label}: default not shown")
        if (
            param.is_flag
            and param.is_bool_flag
            and not any(o.startswith("--no-") for o in param.secondary_opts)
        ):
            problems.append(f"{label}: boolean without its --no- form")
    assert problems == []


def _option(command: str, flag: str) -> Any:
    return next(p for p in COMMANDS[command].params if flag in p.opts)  # type: ignore[misc]


@pytest.mark.parametrize(
    ("command", "flag", "values"),
    [
        ("precompute", "--backend", BACKENDS),
        ("precompute", "--dtype", DTYPES),
        ("plan", "--dtype", DTYPES),
    ],
)
def test_fixed_sets_show_the_recipes_own_values_and_refuse_others_in_one_line(
    command: str, flag: str, values: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    assert _option(command, flag).metavar == f"[{'|'.join(values)}]"
    with pytest.raises(SystemExit) as e:
        cli.main([command, flag, "bogus"])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert f"error: {flag} 'bogus' must be one of {', '.join(values)}" in err
    assert f"fix: pass {flag} {values[0]}" in err and "Usage:" not in err


def test_plan_config_choices_are_the_shipped_teacher_configs() -> None:
    from wandistill.teacher.folder import CONFIG_NAMES

    assert cli.plan.TEACHER_CONFIGS == CONFIG_NAMES
    option = _option("plan", "--config")  # listed in the help (wrapped at words), not the
    assert option.metavar == "NAME"  # metavar column, where a narrow terminal cut the names
    assert all(name in (option.help or "") for name in CONFIG_NAMES)


def test_the_no_form_switches_a_boolean_back_off(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The last of `--json --no-json` wins, as for any click flag: a script can pass either."""
    write_cache(tmp_path / "c", range(2), shard_records=2)
    cli.main(["cache", "info", str(tmp_path / "c"), "--json"])
    assert json.loads(capsys.readouterr().out)["format"] == "wandistill-cache"
    cli.main(["cache", "info", str(tmp_path / "c"), "--json", "--no-json"])
    table = capsys.readouterr().out
    assert not table.lstrip().startswith("{") and "records" in table  # the table, not JSON


def test_every_command_opens_its_help_with_a_one_line_summary() -> None:
    """The command list shows the first paragraph as it is written: one line, or it wraps oddly."""
    for name, command in COMMANDS.items():
        first = (command.help or "").strip().split("\n\n")[0]
        assert "\n" not in first, f"{name}: {first!r}"
