"""Run the wandistill CLI in this process, the way a test reads it: (exit code, stdout, stderr)."""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path

import pytest

from wandistill.cli import main


def cli_env(threads: int | str = 1, **extra: str) -> dict[str, str]:
    """The environment of a CLI run in a real process: this process's, offline (conftest forces
    it here too; the subprocess must not depend on inheriting it), `threads` compute threads (a
    run whose numerics a test compares must use the same count as the run it compares with),
    then `extra` (PYTHONPATH, COLUMNS, ...) last, so a test can override anything."""
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", **extra}


def run_cli(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, str, str]:
    """`wandistill ARGS...` in-process; a usage error or a failure is its exit code, not raised."""
    try:
        main([str(a) for a in args])
        code = 0
    except SystemExit as e:
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def run_cli_text(*args: str) -> tuple[int, str]:
    """`wandistill ARGS...` in-process without pytest's capture (usable inside hypothesis
    examples): the exit code and stdout + stderr with whitespace folded to single spaces."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(list(args))
            code = 0
        except SystemExit as e:
            code = int(e.code or 0)
    return code, " ".join((out.getvalue() + err.getvalue()).split())
