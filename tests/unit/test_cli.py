"""The command line: help works, errors are one line with a fix and the right exit code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cachefixtures import write_cache
from clirun import run_cli as _run


@pytest.mark.slow  # a fresh interpreter
def test_the_console_script_answers_help(capsys: pytest.CaptureFixture[str]) -> None:
    """The entry point in a real process once; the subcommands' help is the same parser, so it is
    read in-process (a second interpreter start would prove nothing more)."""
    proc = subprocess.run(
        [sys.executable, "-m", "wandistill", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "120"},
    )
    assert proc.returncode == 0 and "Usage" in proc.stdout, proc.stderr
    for args in (["cache", "--help"], ["teacher", "--help"]):
        code, out, err = _run(capsys, *args)
        assert code == 0 and "Usage" in out, err


def test_make_tiny_writes_a_teacher_and_refuses_to_overwrite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = _run(capsys, "teacher", "make-tiny", str(tmp_path / "t"))
    assert code == 0 and (tmp_path / "t" / "model_index.json").is_file()
    code, _, err = _run(capsys, "teacher", "make-tiny", str(tmp_path / "t"))
    assert code == 2 and "--overwrite" in err and "Traceback" not in err


def test_cache_info_and_verify_on_a_good_cache(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_cache(tmp_path, range(5), shard_records=2)
    code, out, _ = _run(capsys, "cache", "info", str(tmp_path))
    assert code == 0 and "records" in out and "xt" in out and "r00000-000002" in out
    code, out, _ = _run(capsys, "cache", "info", str(tmp_path), "--json")
    assert code == 0 and json.loads(out)["complete"] is True
    code, out, _ = _run(capsys, "cache", "verify", str(tmp_path))
    assert code == 0 and "OK: 5 records in 3 shards" in out


def test_cache_verify_names_the_bad_shard_and_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_cache(tmp_path, range(4), shard_records=2)
    victim = sorted((tmp_path / "shards").glob("*.tar"))[1]
    victim.write_bytes(victim.read_bytes()[:1000])
    code, _, err = _run(capsys, "cache", "verify", str(tmp_path))
    assert code == 1 and "r00000-000001" in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("setup", "message", "code"),
    [
        ("missing", "does not exist", 2),
        ("not_a_cache", "is not a wandistill cache", 2),
        ("corrupt_manifest", "corrupt", 1),
        ("foreign_manifest", "not a wandistill cache manifest", 1),
    ],
)
def test_bad_cache_paths_are_one_clear_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], setup: str, message: str, code: int
) -> None:
    path = tmp_path / "c"
    if setup != "missing":
        path.mkdir()
    if setup == "corrupt_manifest":
        (path / "manifest.json").write_text("{oops")
    if setup == "foreign_manifest":
        (path / "manifest.json").write_text('{"name": "something else"}')
    for command in ("info", "verify"):
        got, _, err = _run(capsys, "cache", command, str(path))
        assert got == code and message in err and "Traceback" not in err
        assert err.startswith("error:") and "fix:" in err or code == 1


def test_an_unknown_command_or_flag_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(capsys, "cache", "infoo", "x")
    assert code == 2 and "No such command" in err
