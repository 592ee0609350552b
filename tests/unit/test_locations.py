"""Every location a command takes goes through one parser (`wandistill.io.location`).

A URL is either supported by that command end to end or refused in one line naming the flag,
before any work; a local path named like a URL (`s3:/b/run`: a URL that lost its `//`) is always
refused, so no command ever creates a folder whose name starts with a URL scheme."""

from __future__ import annotations

import inspect
import typing
from pathlib import Path

import pytest
import typer

from wandistill import cli
from wandistill.errors import UsageError
from wandistill.io import location

from clirun import run_cli

LOCATION_PARAMS = {
    "out_dir",
    "cache",
    "run",
    "export",
    "student",
    "teacher",
    "baseline",
    "root",
    "path",
    "inputs",
    "dest",
    "prompts",
}
"""Parameter names that hold a place on a filesystem or an object store."""
URL_OK = {("precompute", "out_dir"), ("train", "cache"), ("eval", "cache"), ("sample", "cache")}
URL_OK |= {("info", "path"), ("verify", "path"), ("merge", "inputs"), ("merge", "out_dir")}
"""Where a URL is read or written end to end (everything else refuses one)."""


def _commands() -> list[tuple[str, typing.Callable[..., object]]]:
    groups = [cli.app, cli.teacher_app, cli.cache_app, cli.recipes_app]
    found = []
    for group in groups:
        for c in group.registered_commands:
            found.append((c.name or c.callback.__name__, c.callback))
    return found


def test_every_location_parameter_of_every_command_goes_through_the_one_parser() -> None:
    seen = set()
    for name, fn in _commands():
        for pname, hint in typing.get_type_hints(fn, include_extras=True).items():
            if pname not in LOCATION_PARAMS or typing.get_origin(hint) is not typing.Annotated:
                continue
            if hint.__origin__ is bool:  # demo --baseline/--no-baseline: a switch
                continue
            info = next(m for m in hint.__metadata__ if isinstance(m, typer.models.ParameterInfo))
            parser = info.parser
            assert parser is not None, f"{name} {pname} is not parsed by wandistill.io.location"
            assert parser.__qualname__ == "option.<locals>.convert", (name, pname)
            flag = inspect.getclosurevars(parser).nonlocals["flag"]
            url = inspect.getclosurevars(parser).nonlocals["url"]
            assert url == ((name, pname) in URL_OK), (name, pname, url)
            with pytest.raises(UsageError, match="lost its '//'"):
                parser("s3:/bucket/x")
            if not url:
                with pytest.raises(UsageError, match=f"{flag} 's3://bucket/x' is a URL"):
                    parser("s3://bucket/x")
            seen.add((name, pname))
    assert len(seen) >= 32, sorted(seen)


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "--cache", "{tmp}/c", "--out", "s3://b/run", "--steps", "1"],
        ["train", "--cache", "{tmp}/c", "--set", 'out="s3://b/run"'],
        ["train", "--cache", "{tmp}/c", "--out", "s3:/b/run"],
        ["eval", "--cache", "{tmp}/c", "--run", "{tmp}/r", "--out", "s3://b/eval"],
        ["sample", "--prompts", "{tmp}/p.txt", "--out", "s3://b/sample"],
        ["export", "--run", "{tmp}/r", "--teacher", "{tmp}/t", "--out", "s3://b/pipe"],
        ["export", "--run", "s3://b/run", "--teacher", "{tmp}/t", "--out", "{tmp}/pipe"],
        ["cache", "merge", "{tmp}/a", "{tmp}/b", "--out", "s3:/b/m"],
        ["precompute", "--out", "gs:b", "--teacher", "{tmp}/t"],
        ["precompute", "--set", 'cache.path="s3:/b/c"', "--teacher", "{tmp}/t"],
        ["recipes", "copy", "tiny", "s3://b/tiny.toml"],
        ["teacher", "make-tiny", "s3://b/t"],
        ["demo", "--root", "s3://b/demo"],
    ],
    ids=lambda argv: " ".join(a for a in argv if not a.startswith("{tmp}"))[:60],
)
def test_a_url_a_command_cannot_write_is_refused_in_one_line_before_any_work(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(capsys, *(a.replace("{tmp}", str(tmp_path)) for a in argv))
    assert code == 2, (out, err)
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and ("is a URL" in lines[0] or "lost its '//'" in lines[0]), err
    assert "Traceback" not in err
    assert not list(tmp_path.rglob("*:*")), list(tmp_path.rglob("*"))  # no `s3:` folder


def test_the_parser_keeps_a_supported_url_whole_and_reads_file_urls_as_paths() -> None:
    assert location.parse("s3://b/run/", "--out", url=True) == "s3://b/run"
    assert location.parse("file:///tmp/x", "--out", url=False) == Path("/tmp/x")
    assert location.parse("./s3:x", "--out", url=False) == Path("s3:x")  # spelled as a folder
    with pytest.raises(UsageError, match="names no bucket"):
        location.parse("s3:///x", "--cache", url=True)
